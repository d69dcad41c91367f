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
    if openab.result_retention_secs.is_some() {
        out.push(
            "openab.result_retention_secs is no longer used and is ignored: a primary \
             whose connection ends has its delegations cancelled (as on openab-cp), so \
             no result is kept for a later connection"
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

/// Whether two capability patterns (`name` or `name:*`) have a capability
/// in common.
fn overlap(a: &str, b: &str) -> bool {
    let prefix = |p: &str| p.strip_suffix(":*").map(|base| format!("{base}:"));
    match (prefix(a), prefix(b)) {
        (None, None) => a == b,
        (Some(pa), None) => b.len() > pa.len() && b.starts_with(&pa),
        (None, Some(pb)) => a.len() > pb.len() && a.starts_with(&pb),
        (Some(pa), Some(pb)) => pa.starts_with(&pb) || pb.starts_with(&pa),
    }
}

/// Whether the patterns `set` cover the capability name `cap`.
fn covered(set: &[String], cap: &str) -> bool {
    set.iter().any(|p| match p.strip_suffix(":*") {
        Some(base) => cap.len() > base.len() + 1 && cap.starts_with(&format!("{base}:")),
        None => p == cap,
    })
}

/// A route of the relay's configuration, as far as this check reads it.
struct Route {
    index: usize,
    from: String,
    to: String,
    ceiling: Vec<String>,
}

/// Checks `config`, the configuration of peer `me` (whose key is `my_key`
/// when its identity file could be read), against the relay's configuration
/// `relay_toml`: what the relay would refuse that this file alone cannot
/// show. Reads only the relay file's `[[peers]]` and `[[routes]]`; `Err`
/// when it is not TOML of that shape.
pub fn against_relay(
    config: &ConnectorConfig,
    me: &str,
    my_key: Option<(&str, &str)>,
    relay_toml: &str,
) -> Result<Vec<String>, String> {
    let doc: toml::Table = toml::from_str(relay_toml).map_err(|e| e.message().to_string())?;
    let strings = |v: Option<&toml::Value>| -> Vec<String> {
        v.and_then(toml::Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let table_array = |name: &str| -> Vec<toml::Table> {
        doc.get(name)
            .and_then(toml::Value::as_array)
            .map(|a| a.iter().filter_map(|t| t.as_table().cloned()).collect())
            .unwrap_or_default()
    };
    let str_of =
        |t: &toml::Table, k: &str| t.get(k).and_then(toml::Value::as_str).map(str::to_string);
    // The relay's keys per peer: (key_id, public_key).
    let mut relay_keys: std::collections::HashMap<String, Vec<(String, String)>> =
        std::collections::HashMap::new();
    for p in table_array("peers") {
        let Some(id) = str_of(&p, "id") else { continue };
        let keys = p
            .get("keys")
            .and_then(toml::Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|k| {
                        let k = k.as_table()?;
                        Some((str_of(k, "key_id")?, str_of(k, "public_key")?))
                    })
                    .collect()
            })
            .unwrap_or_default();
        relay_keys.insert(id, keys);
    }
    let routes: Vec<Route> = table_array("routes")
        .iter()
        .enumerate()
        .filter_map(|(index, r)| {
            Some(Route {
                index,
                from: str_of(r, "from")?,
                to: str_of(r, "to")?,
                ceiling: strings(r.get("ceiling")),
            })
        })
        .collect();
    let mut out = Vec::new();
    match relay_keys.get(me) {
        None => out.push(format!(
            "relay: {me} is not in the relay's [[peers]]: its connection is refused \
             (4504 auth_failed, not retried)"
        )),
        Some(keys) => {
            if let Some((key_id, public_key)) = my_key
                && !keys.iter().any(|(i, k)| i == key_id && k == public_key)
            {
                out.push(format!(
                    "relay: the relay has no key {key_id} = {public_key} for {me} (this host's \
                     identity file): its connection is refused (4504 auth_failed, not retried)"
                ));
            }
        }
    }
    for (i, p) in config.peers.iter().enumerate() {
        let id = p.id.as_str();
        let Some(keys) = relay_keys.get(id) else {
            out.push(format!(
                "peers[{i}].id: {id} is not in the relay's [[peers]]: it cannot connect"
            ));
            continue;
        };
        for k in &p.keys {
            let public = k.public_key.to_string();
            if let Some((_, other)) = keys.iter().find(|(key_id, _)| key_id == k.key_id.as_str())
                && other != &public
            {
                out.push(format!(
                    "peers[{i}].keys: key {} of {id} differs from the relay's: one of the two \
                     files has a wrong key (the relay refuses the peer, or this host refuses \
                     what it signs)",
                    k.key_id
                ));
            }
        }
    }
    let known: Vec<&str> = config.peers.iter().map(|p| p.id.as_str()).collect();
    // Callee side: what routes towards this host let callers ask for.
    let serves = config.a2a.driver_url.is_some() || config.openab.serves();
    if serves {
        let towards: Vec<&Route> = routes
            .iter()
            .filter(|r| r.to == me && known.contains(&r.from.as_str()))
            .collect();
        if towards.is_empty() {
            out.push(format!(
                "relay: this host serves delegations, but no route of the relay leads to {me} \
                 from a peer in [[peers]]: nobody can delegate to it"
            ));
        }
        for r in towards {
            if !r.ceiling.is_empty()
                && !r.ceiling.iter().any(|c| {
                    config
                        .policy
                        .allowed_capabilities
                        .iter()
                        .any(|a| overlap(c, a))
                })
            {
                out.push(format!(
                    "relay: routes[{}] ({} -> {me}) has ceiling {:?}, none of which \
                     policy.allowed_capabilities grants: every delegation on it that asks for \
                     a capability is refused (capability_denied)",
                    r.index, r.from, r.ceiling
                ));
            }
        }
    }
    // Caller side: what this host asks for, against the routes from it.
    let from_me: Vec<&Route> = routes.iter().filter(|r| r.from == me).collect();
    if config.a2a.facade_listen.is_some() {
        if !from_me.iter().any(|r| known.contains(&r.to.as_str())) {
            out.push(format!(
                "relay: the facade is on, but no route of the relay leads from {me} to a peer in \
                 [[peers]]: every delegation is refused (route_denied)"
            ));
        }
        for r in &from_me {
            let refused: Vec<&String> = config
                .a2a
                .default_capabilities
                .iter()
                .filter(|c| !r.ceiling.is_empty() && !covered(&r.ceiling, c))
                .collect();
            if !refused.is_empty() {
                out.push(format!(
                    "a2a.default_capabilities: {refused:?} are outside the ceiling {:?} of \
                     routes[{}] ({me} -> {}): plain A2A clients' delegations to {} are refused",
                    r.ceiling, r.index, r.to, r.to
                ));
            }
        }
    }
    for (i, t) in config.openab.targets.iter().enumerate() {
        let peer = t.peer.as_str();
        match from_me.iter().find(|r| r.to == peer) {
            None => out.push(format!(
                "openab.targets[{i}].peer: the relay has no route {me} -> {peer}: every \
                 cp/delegate to this target is refused (route_denied)"
            )),
            Some(r) => {
                let refused: Vec<&String> = t
                    .capabilities
                    .iter()
                    .filter(|c| !r.ceiling.is_empty() && !covered(&r.ceiling, c))
                    .collect();
                if !refused.is_empty() {
                    out.push(format!(
                        "openab.targets[{i}].capabilities: {refused:?} are outside the ceiling \
                         {:?} of routes[{}] ({me} -> {peer}): every cp/delegate to this target \
                         is refused",
                        r.ceiling, r.index
                    ));
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod relay_tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const KEY_A: &str = "ed25519:iojj3XQJ8ZX9UtstPLpdcspnCb8dlBIb83SIAbQPb1w";
    const KEY_B: &str = "ed25519:VLiJKgQnc1IQU02UPmeG3NtDWkYNa-6PPFtlGxj6oKI";

    fn callee(policy: &str) -> ConnectorConfig {
        let text = format!(
            "[connector]\nrelay_url = \"wss://r/\"\nidentity = \"/i.toml\"\n\n\
             [[peers]]\nid = \"acme/a\"\nkeys = [{{ key_id = \"k\", public_key = \"{KEY_A}\" }}]\n\n\
             [policy]\nallowed_capabilities = {policy}\n\n[a2a]\ndriver_url = \"http://127.0.0.1:9\"\n"
        );
        toml::from_str(&text).unwrap()
    }

    fn relay(ceiling: &str, b_key: &str) -> String {
        format!(
            "[relay]\nid = \"r\"\n\n\
             [[peers]]\nid = \"acme/a\"\nkeys = [{{ key_id = \"k\", public_key = \"{KEY_A}\" }}]\n\n\
             [[peers]]\nid = \"acme/b\"\nkeys = [{{ key_id = \"k\", public_key = \"{b_key}\" }}]\n\n\
             [[routes]]\nfrom = \"acme/a\"\nto = \"acme/b\"\nceiling = {ceiling}\n"
        )
    }

    #[test]
    fn patterns_overlap_as_the_policy_would_grant_them() {
        assert!(overlap("read:*", "read:repo"));
        assert!(overlap("read:repo", "read:*"));
        assert!(overlap("read:*", "read:repo:*"));
        assert!(overlap("run:tests", "run:tests"));
        assert!(!overlap("read:*", "run:tests"));
        assert!(!overlap("read:*", "read"));
        assert!(covered(&["read:*".into()], "read:repo"));
        assert!(!covered(&["read:*".into()], "run:tests"));
    }

    #[test]
    fn a_ceiling_the_callees_policy_grants_nothing_of_is_named() {
        let me = ("k", KEY_B);
        let ok = against_relay(
            &callee("[\"read:*\"]"),
            "acme/b",
            Some(me),
            &relay("[\"read:repo\"]", KEY_B),
        )
        .unwrap();
        assert_eq!(ok, Vec::<String>::new());
        let w = against_relay(
            &callee("[\"read:*\"]"),
            "acme/b",
            Some(me),
            &relay("[\"run:tests\"]", KEY_B),
        )
        .unwrap();
        assert_eq!(w.len(), 1, "{w:#?}");
        assert!(w[0].contains("routes[0] (acme/a -> acme/b)") && w[0].contains("run:tests"));
        // No ceiling stated: nothing to say.
        let w = against_relay(
            &callee("[\"read:*\"]"),
            "acme/b",
            Some(me),
            &relay("[]", KEY_B),
        )
        .unwrap();
        assert!(w.is_empty(), "{w:#?}");
    }

    #[test]
    fn keys_the_relay_does_not_have_and_missing_routes_are_named() {
        let w = against_relay(
            &callee("[\"read:*\"]"),
            "acme/b",
            Some(("k", KEY_A)),
            &relay("[]", KEY_B),
        )
        .unwrap();
        assert_eq!(w.len(), 1, "{w:#?}");
        assert!(w[0].contains("no key k") && w[0].contains("4504"));
        let w =
            against_relay(&callee("[\"read:*\"]"), "acme/c", None, &relay("[]", KEY_B)).unwrap();
        assert!(
            w[0].contains("acme/c is not in the relay's [[peers]]"),
            "{w:#?}"
        );
        assert!(
            w[1].contains("no route of the relay leads to acme/c"),
            "{w:#?}"
        );
    }
}
