//! The connector's status as operators read it: the link (state, session,
//! reconnects, whether the relay answers), the relay it goes to, the
//! published descriptor and the open delegations ([`ConnectorStatus`]),
//! served as JSON on `/status` by [`crate::admin`] and printed as tables by
//! `oab-connector status` ([`ConnectorStatus::render`]).
//!
//! Never: shows a payload, a descriptor's content, a key or the relay URL's
//! user info. Lists at most [`MAX_LISTED`] delegations, and asks the link
//! task for them under [`LIST_DEADLINE`] (a link whose resend buffer is full
//! takes no commands; the counts come from its stats regardless).

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::link::stats::Side;
use crate::link::{LinkHandle, LinkState};

/// Open delegations listed at most.
pub const MAX_LISTED: usize = 100;

/// How long `/status` waits for the link task's list of open delegations.
pub const LIST_DEADLINE: Duration = Duration::from_secs(1);

/// Everything `/status` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectorStatus {
    /// This host's peer id.
    pub peer: String,
    /// This process's instance id.
    pub instance: String,
    /// The build: version, git commit, build date.
    pub version: String,
    /// The git commit built (short), or `unknown`.
    pub commit: String,
    /// When it was built (UTC, RFC 3339).
    pub built: String,
    /// When this answer was made (ms since the Unix epoch).
    pub now_ms: u64,
    /// The link to the relay.
    pub link: LinkStatus,
    /// The relay.
    pub relay: RelayStatus,
    /// The descriptor (agent card) this host publishes, if any.
    pub descriptor: Option<DescriptorStatus>,
    /// Open delegations.
    pub delegations: DelegationsStatus,
}

/// The link to the relay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinkStatus {
    /// `connecting`, `connected` or `stopped`.
    pub state: String,
    /// While connecting: consecutive failed attempts.
    pub attempt: Option<u32>,
    /// When stopped for good: why.
    pub stopped_reason: Option<String>,
    /// The session id, while connected.
    pub session: Option<String>,
    /// Since when the session is up (ms since the Unix epoch).
    pub connected_since_ms: Option<u64>,
    /// The relay's store epoch, as last welcomed.
    pub epoch: Option<u64>,
    /// Whether frames arrive from the relay within the dead-link deadline.
    pub relay_reachable: bool,
    /// Why the link last went down, and when.
    pub last_disconnect: Option<Disconnect>,
    /// Sessions established since start.
    pub sessions: u64,
    /// Reconnects scheduled since start.
    pub reconnects: u64,
}

/// A lost link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Disconnect {
    /// When (ms since the Unix epoch).
    pub at_ms: u64,
    /// Why.
    pub reason: String,
}

/// The relay this connector goes to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayStatus {
    /// Its URL, without user info.
    pub url: String,
    /// The relay id it must present, if pinned (`connector.relay_id`).
    pub relay_id: Option<String>,
}

/// The descriptor this host publishes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DescriptorStatus {
    /// Its size in bytes.
    pub bytes: usize,
    /// When it was last set (ms since the Unix epoch).
    pub set_ms: u64,
    /// Whether it went out on the current session (it goes out again on
    /// each new session).
    pub published: bool,
}

/// Open delegations.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DelegationsStatus {
    /// Open as caller (delegated from this host).
    pub open_caller: u64,
    /// Open as callee (served by this host).
    pub open_callee: u64,
    /// Frames sent and not yet acknowledged.
    pub unacked_frames: u64,
    /// Up to [`MAX_LISTED`] of them.
    pub listed: Vec<OpenDelegationStatus>,
    /// Why no list could be had (the link did not answer within
    /// [`LIST_DEADLINE`], or it stopped).
    pub list_error: Option<String>,
}

/// One open delegation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenDelegationStatus {
    /// `caller#request_id`.
    pub key: String,
    /// The other peer.
    pub counterpart: String,
    /// `caller` or `callee`: this host's side.
    pub side: String,
    /// Last sequence sent on our sending log.
    pub sent: u64,
    /// Last sequence the relay acknowledged.
    pub acked: u64,
    /// Last sequence received.
    pub received: u64,
}

impl ConnectorStatus {
    /// The status of the link behind `link` now.
    pub async fn of(link: &LinkHandle) -> ConnectorStatus {
        let stats = link.stats();
        let facts = stats.facts();
        let (state, attempt, stopped_reason) = match link.state() {
            LinkState::Connecting { attempt } => ("connecting", Some(attempt), None),
            LinkState::Connected { .. } => ("connected", None, None),
            LinkState::Stopped(r) => ("stopped", None, Some(r)),
        };
        let (listed, list_error) =
            match tokio::time::timeout(LIST_DEADLINE, link.open_delegations(MAX_LISTED)).await {
                Ok(Ok((list, _))) => (
                    list.into_iter()
                        .map(|d| OpenDelegationStatus {
                            key: d.key.to_string(),
                            counterpart: d.counterpart.to_string(),
                            side: d.side.name().to_string(),
                            sent: d.sent,
                            acked: d.acked,
                            received: d.received,
                        })
                        .collect(),
                    None,
                ),
                Ok(Err(e)) => (Vec::new(), Some(e.to_string())),
                Err(_) => (
                    Vec::new(),
                    Some("the link task did not answer within 1 s (resend buffer full?)".into()),
                ),
            };
        let relay = link.relay();
        ConnectorStatus {
            peer: link.peer.to_string(),
            instance: link.instance.to_string(),
            version: oab_ops::build::VERSION.to_string(),
            commit: oab_ops::build::COMMIT.to_string(),
            built: oab_ops::build::DATE.to_string(),
            now_ms: oab_wire::identity::now_ms(),
            link: LinkStatus {
                state: state.to_string(),
                attempt,
                stopped_reason,
                session: facts.session.clone(),
                connected_since_ms: facts.connected_since_ms,
                epoch: facts.epoch,
                relay_reachable: link.relay_reachable(),
                last_disconnect: facts
                    .last_disconnect
                    .map(|(at_ms, reason)| Disconnect { at_ms, reason }),
                sessions: stats.sessions(),
                reconnects: stats.reconnects(),
            },
            relay: RelayStatus {
                url: relay.url.clone(),
                relay_id: relay.relay_id.as_ref().map(ToString::to_string),
            },
            descriptor: facts.descriptor.map(|d| DescriptorStatus {
                bytes: d.bytes,
                set_ms: d.set_ms,
                published: d.sent,
            }),
            delegations: DelegationsStatus {
                open_caller: stats.open(Side::Caller),
                open_callee: stats.open(Side::Callee),
                unacked_frames: stats.unacked(),
                listed,
                list_error,
            },
        }
    }

    /// The status as text tables (what `oab-connector status` prints).
    pub fn render(&self) -> String {
        use oab_ops::table::render;
        use oab_ops::time::{short_duration, utc_rfc3339};
        let now = self.now_ms;
        let when = |ms: u64| {
            format!(
                "{} ({} ago)",
                utc_rfc3339(i64::try_from(ms / 1_000).unwrap_or(i64::MAX)),
                short_duration(now.saturating_sub(ms))
            )
        };
        let dash = || "-".to_string();
        let l = &self.link;
        let mut out = format!(
            "connector {} (instance {}), version {} (commit {}, built {})\n\n",
            self.peer, self.instance, self.version, self.commit, self.built
        );
        let state = match (&l.state[..], l.attempt, &l.stopped_reason) {
            ("connecting", Some(a), _) => format!("connecting (attempt {a})"),
            ("stopped", _, Some(r)) => format!("STOPPED: {r}"),
            (s, _, _) => s.to_string(),
        };
        let rows = vec![
            vec!["relay".into(), self.relay.url.clone()],
            vec![
                "relay id".into(),
                self.relay
                    .relay_id
                    .clone()
                    .unwrap_or_else(|| "(not pinned)".into()),
            ],
            vec!["link".into(), state],
            vec![
                "relay reachable".into(),
                if l.relay_reachable { "yes" } else { "no" }.into(),
            ],
            vec!["session".into(), l.session.clone().unwrap_or_else(dash)],
            vec![
                "connected since".into(),
                l.connected_since_ms.map_or_else(dash, when),
            ],
            vec![
                "sessions / reconnects".into(),
                format!("{} / {}", l.sessions, l.reconnects),
            ],
            vec![
                "last disconnect".into(),
                l.last_disconnect
                    .as_ref()
                    .map_or_else(dash, |d| format!("{}: {}", when(d.at_ms), d.reason)),
            ],
            vec![
                "descriptor".into(),
                self.descriptor.as_ref().map_or_else(
                    || "none published".into(),
                    |d| {
                        format!(
                            "{} bytes, set {}, {}",
                            d.bytes,
                            when(d.set_ms),
                            if d.published {
                                "published on this session"
                            } else {
                                "not sent on this session yet"
                            }
                        )
                    },
                ),
            ],
        ];
        out.push_str(&oab_ops::table::render_rows(&rows));
        let d = &self.delegations;
        out.push_str(&format!(
            "\nopen delegations: {} as caller, {} as callee; {} frame(s) unacknowledged\n",
            d.open_caller, d.open_callee, d.unacked_frames
        ));
        if let Some(e) = &d.list_error {
            out.push_str(&format!("(no list: {e})\n"));
        } else if !d.listed.is_empty() {
            let rows: Vec<Vec<String>> = d
                .listed
                .iter()
                .map(|x| {
                    vec![
                        x.key.clone(),
                        x.side.clone(),
                        x.counterpart.clone(),
                        x.sent.to_string(),
                        x.acked.to_string(),
                        x.received.to_string(),
                    ]
                })
                .collect();
            out.push_str(&render(
                &[
                    "DELEGATION",
                    "SIDE",
                    "COUNTERPART",
                    "SENT",
                    "ACKED",
                    "RECEIVED",
                ],
                &rows,
            ));
        }
        out
    }
}
