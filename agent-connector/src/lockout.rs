//! Connector configurations that validate but cannot delegate, or lock
//! callers out: `oab-connector check-config` prints them as warnings (exit
//! code still 0) and `oab-connector run` logs them at start.
//!
//! Each warning names its field and what would happen. Thresholds are
//! values below which ordinary use starts failing, not protocol limits.
//!
//! Never: refuses a configuration ([`ConnectorConfig::validate`] does that,
//! for a facade whose default capabilities the policy does not grant, say).

use oab_wire::identity::KeyWindow;

use crate::a2a::DelegationDefaults;
use crate::authority::{Capability, CapabilitySet};
use crate::config::ConnectorConfig;

/// Below this, `[policy] max_deadline_ms` cuts most real tasks short (the
/// callee clamps deadlines to it; the caller refuses longer ones).
pub const MIN_DEADLINE_MS: u64 = 10_000;

/// Below this, a person at an A2A client has no time to answer
/// `input-required` before the task ends `failed`.
pub const MIN_INPUT_TIMEOUT_MS: u64 = 10_000;

/// Every warning for `config` at `now_ms` (ms since the Unix epoch), each
/// `field: what happens`.
pub fn warnings(config: &ConnectorConfig, now_ms: u64) -> Vec<String> {
    let mut out = Vec::new();
    let a2a = &config.a2a;
    let openab = &config.openab;
    let policy = &config.policy;
    let delegates = a2a.facade_listen.is_some() || !openab.targets.is_empty();
    let serves = a2a.driver_url.is_some() || openab.serves();
    if !delegates && !serves {
        out.push(
            "a2a: no a2a.facade_listen, no openab.targets, no a2a.driver_url and no \
             openab.serve: this connector can neither start delegations nor serve them"
                .to_string(),
        );
    }
    if config.peers.is_empty() {
        out.push(
            "peers: no [[peers]]: every request and result is checked against a peer's key, so \
             this host can neither delegate to nor serve anyone"
                .to_string(),
        );
    }
    for (i, p) in config.peers.iter().enumerate() {
        let usable = p.keys.iter().any(|k| k.window(now_ms) == KeyWindow::Valid);
        for (j, k) in p.keys.iter().enumerate() {
            let window = match k.window(now_ms) {
                KeyWindow::Valid => continue,
                KeyWindow::Expired => "its validity ended (not_after_ms is in the past)",
                KeyWindow::NotYetValid => "it is not valid yet (not_before_ms is in the future)",
            };
            out.push(format!(
                "peers[{i}].keys[{j}]: key {} of {}: {window}; {}",
                k.key_id,
                p.id,
                if usable {
                    "its other key still works"
                } else {
                    "nothing that peer signs is accepted now"
                }
            ));
        }
    }
    if policy.allowed_capabilities.is_empty() {
        if delegates && a2a.default_capabilities.is_empty() {
            out.push(
                "policy.allowed_capabilities: empty, and it is also this host's own grant: \
                 every delegation this host starts that asks for a capability is refused \
                 (capability_denied) before it is sent"
                    .to_string(),
            );
        }
        if serves {
            out.push(
                "policy.allowed_capabilities: empty: callers can be granted nothing here, so \
                 every delegation that asks for a capability is refused (capability_denied)"
                    .to_string(),
            );
        }
    }
    if (delegates || serves) && policy.max_deadline_ms < MIN_DEADLINE_MS {
        out.push(format!(
            "policy.max_deadline_ms: {} ms: delegations served here are cut to it, and this host \
             may not ask for longer (at least {MIN_DEADLINE_MS} ms)",
            policy.max_deadline_ms
        ));
    }
    if a2a.facade_listen.is_some() {
        let timeout = a2a.default_timeout_ms.unwrap_or_else(|| {
            u64::try_from(DelegationDefaults::default().timeout.as_millis()).unwrap_or(u64::MAX)
        });
        if timeout > policy.max_deadline_ms {
            out.push(format!(
                "a2a.default_timeout_ms: {timeout} ms{} is over policy.max_deadline_ms ({} ms): \
                 every delegation of a plain A2A client is refused (over_budget) before it is \
                 sent; lower it",
                if a2a.default_timeout_ms.is_none() {
                    " (the default)"
                } else {
                    ""
                },
                policy.max_deadline_ms
            ));
        }
    }
    if openab.listen.is_some()
        && !openab.targets.is_empty()
        && openab.max_deadline_secs.saturating_mul(1000) > policy.max_deadline_ms
    {
        out.push(format!(
            "openab.max_deadline_secs: {} s is over policy.max_deadline_ms ({} ms): a cp/delegate \
             with a deadline between the two is refused",
            openab.max_deadline_secs, policy.max_deadline_ms
        ));
    }
    if let Ok(grant) = CapabilitySet::parse(&policy.allowed_capabilities) {
        for (i, t) in openab.targets.iter().enumerate() {
            let refused: Vec<&str> = t
                .capabilities
                .iter()
                .filter(|c| Capability::new(c).is_ok_and(|cap| !grant.covers(&cap)))
                .map(String::as_str)
                .collect();
            if !refused.is_empty() {
                out.push(format!(
                    "openab.targets[{i}].capabilities: {refused:?} not in \
                     policy.allowed_capabilities, which is also this host's own grant: every \
                     cp/delegate to this target is refused (capability_denied)"
                ));
            }
            if !t.read_only && !policy.allow_writes {
                out.push(format!(
                    "openab.targets[{i}].read_only: false, but policy.allow_writes is false: \
                     this host may start read-only delegations only, so every cp/delegate to \
                     this target is refused"
                ));
            }
        }
    }
    if a2a.driver_url.is_some()
        && let Some(ms) = a2a.input_timeout_ms
        && ms < MIN_INPUT_TIMEOUT_MS
    {
        out.push(format!(
            "a2a.input_timeout_ms: {ms} ms: a caller has that long to answer input-required \
             before the task ends failed (at least {MIN_INPUT_TIMEOUT_MS} ms)"
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const KEY: &str = "ed25519:iojj3XQJ8ZX9UtstPLpdcspnCb8dlBIb83SIAbQPb1w";

    fn config(extra: &str) -> ConnectorConfig {
        let text = format!(
            "[connector]\nrelay_url = \"wss://r/\"\nidentity = \"/i.toml\"\n\n\
             [[peers]]\nid = \"acme/b\"\nkeys = [{{ key_id = \"k\", public_key = \"{KEY}\" }}]\n\n{extra}"
        );
        let c: ConnectorConfig = toml::from_str(&text).unwrap();
        c.validate().unwrap();
        c
    }

    fn fields(extra: &str) -> Vec<String> {
        warnings(&config(extra), 1_000_000)
            .into_iter()
            .map(|w| w.split(':').next().unwrap().to_string())
            .collect()
    }

    const FACADE: &str = "[a2a]\nfacade_listen = \"127.0.0.1:7070\"\n";

    #[test]
    fn a_facade_with_a_grant_warns_about_nothing() {
        let extra = format!("[policy]\nallowed_capabilities = [\"read:*\"]\n\n{FACADE}");
        assert_eq!(fields(&extra), Vec::<String>::new());
    }

    #[test]
    fn each_configuration_that_cannot_delegate_is_named() {
        let cases: &[(&str, &[&str])] = &[
            ("", &["a2a"]),
            (FACADE, &["policy.allowed_capabilities"]),
            (
                "[policy]\nallowed_capabilities = [\"read:*\"]\n[a2a]\ndriver_url = \"http://127.0.0.1:9\"\ninput_timeout_ms = 100\n",
                &["a2a.input_timeout_ms"],
            ),
            (
                "[a2a]\ndriver_url = \"http://127.0.0.1:9\"\n",
                &["policy.allowed_capabilities"],
            ),
            (
                "[policy]\nallowed_capabilities = [\"read:*\"]\nmax_deadline_ms = 5000\n[a2a]\nfacade_listen = \"127.0.0.1:7070\"\ndefault_timeout_ms = 4000\n",
                &["policy.max_deadline_ms"],
            ),
            (
                "[policy]\nallowed_capabilities = [\"read:*\"]\nmax_deadline_ms = 60000\n[a2a]\nfacade_listen = \"127.0.0.1:7070\"\n",
                &["a2a.default_timeout_ms"],
            ),
        ];
        for (extra, want) in cases {
            assert_eq!(fields(extra), *want, "{extra}");
        }
    }

    #[test]
    fn openab_targets_the_grant_does_not_cover_are_named() {
        let extra = "[policy]\nallowed_capabilities = [\"read:*\"]\n\n\
            [openab]\nlisten = \"127.0.0.1:7071\"\n\n\
            [[openab.targets]]\nname = \"t\"\npeer = \"acme/b\"\nremote = { name = \"r\" }\n\
            capabilities = [\"read:repo\", \"run:tests\"]\nread_only = false\n";
        let w = warnings(&config(extra), 1_000_000);
        assert_eq!(w.len(), 2, "{w:#?}");
        assert!(w[0].starts_with("openab.targets[0].capabilities") && w[0].contains("run:tests"));
        assert!(!w[0].contains("read:repo"));
        assert!(w[1].starts_with("openab.targets[0].read_only"));
    }

    #[test]
    fn ended_and_future_keys_and_no_peers_are_named() {
        let mut c = config(&format!(
            "[policy]\nallowed_capabilities = [\"read:*\"]\n\n{FACADE}"
        ));
        c.peers[0].keys[0].not_after_ms = Some(999);
        let w = warnings(&c, 1_000_000);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("peers[0].keys[0]") && w[0].contains("ended"));
        assert!(w[0].contains("nothing that peer signs"));
        c.peers[0].keys[0].not_after_ms = None;
        c.peers[0].keys[0].not_before_ms = Some(2_000_000);
        assert!(warnings(&c, 1_000_000)[0].contains("not valid yet"));
        c.peers.clear();
        assert!(warnings(&c, 1_000_000)[0].starts_with("peers: no [[peers]]"));
    }
}
