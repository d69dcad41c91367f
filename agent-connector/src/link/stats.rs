//! What the link tells operators: counters and gauges the link task updates
//! as it goes (atomics, no lock on the frame path), a few facts about the
//! current session behind a short lock, their Prometheus text
//! ([`LinkStats::render_prometheus`], every series `oab_connector_*`), and
//! readiness ([`LinkStats::relay_reachable`]).
//!
//! Labels come from fixed sets only: `side` (`caller`, `callee`), `outcome`
//! (the wire outcomes and `refused`), `direction` (`in`, `out`), `state`
//! (`connecting`, `connected`, `stopped`), `code` (the wire error code
//! names). Never a peer id, a request id or anything the relay sends as text.
//!
//! Never: blocks the link task: every update is an atomic add or a lock held
//! for one assignment.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use oab_wire::{ErrorCode, Outcome};
use parking_lot::Mutex;

/// The two sides a connector plays in a delegation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// This host delegated it.
    Caller,
    /// This host serves it.
    Callee,
}

impl Side {
    /// Both sides, in label order.
    pub const ALL: [Side; 2] = [Side::Caller, Side::Callee];

    /// The label value.
    pub const fn name(self) -> &'static str {
        match self {
            Side::Caller => "caller",
            Side::Callee => "callee",
        }
    }

    /// The side of a delegation where this host is the caller or not.
    pub const fn of(is_caller: bool) -> Side {
        if is_caller {
            Side::Caller
        } else {
            Side::Callee
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// The `outcome` label of a delegation refused before it existed (the
/// relay refused its open).
pub const REFUSED: &str = "refused";

/// Slots of the error counter: every wire error code and one for codes
/// this version does not know.
const ERROR_SLOTS: usize = ErrorCode::ALL.len() + 1;

/// The number of `outcome` label values: the wire outcomes and `refused`.
const OUTCOMES: usize = Outcome::ALL.len() + 1;

fn outcome_index(o: Option<Outcome>) -> usize {
    o.and_then(|o| Outcome::ALL.iter().position(|x| *x == o))
        .unwrap_or(Outcome::ALL.len())
}

/// Facts about the current (or last) session, for `/status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SessionFacts {
    /// The session id the relay gave (hex), while connected.
    pub session: Option<String>,
    /// When the current session started (ms since the Unix epoch).
    pub connected_since_ms: Option<u64>,
    /// The relay's store epoch, as last welcomed.
    pub epoch: Option<u64>,
    /// The relay's heartbeat interval, ms, as last welcomed.
    pub heartbeat_ms: Option<u64>,
    /// Why the link last went down, and when (ms since the Unix epoch).
    pub last_disconnect: Option<(u64, String)>,
    /// The published descriptor: its size, when it was set locally, and
    /// whether it went out on the current session.
    pub descriptor: Option<DescriptorFacts>,
}

/// The descriptor (agent card) this connector publishes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DescriptorFacts {
    /// Its size in bytes.
    pub bytes: usize,
    /// When it was last set (ms since the Unix epoch).
    pub set_ms: u64,
    /// Sent to the relay on the current session (it is sent again on each
    /// new session).
    pub sent: bool,
}

/// Counters and gauges of one link. Shared between the link task (which
/// updates them) and its handles (which read them).
#[derive(Debug, Default)]
pub struct LinkStats {
    /// Sessions established (welcomed by the relay).
    pub(super) sessions: AtomicU64,
    /// Times the link went down or a connection attempt failed and a
    /// reconnect was scheduled.
    pub(super) reconnects: AtomicU64,
    /// Frames received from the relay.
    pub(super) frames_in: AtomicU64,
    /// Frames written to the relay.
    pub(super) frames_out: AtomicU64,
    /// Acks received.
    pub(super) acks: AtomicU64,
    /// Frames sent but not yet acknowledged (the resend buffer).
    pub(super) unacked: AtomicU64,
    /// Delegations taken on, by side.
    opened: [AtomicU64; 2],
    /// Delegations ended, by side and outcome.
    finished: [[AtomicU64; OUTCOMES]; 2],
    /// Delegations open now, by side.
    open: [AtomicI64; 2],
    /// Error frames from the relay, by code (index in `ErrorCode::ALL`;
    /// the last slot counts codes this version does not know).
    refusals: [AtomicU64; ERROR_SLOTS],
    /// Descriptors sent to the relay.
    pub(super) publishes: AtomicU64,
    /// When a frame last arrived (ms since the Unix epoch; 0: never).
    pub(super) last_rx_ms: AtomicU64,
    /// The current session's facts.
    pub(super) facts: Mutex<SessionFacts>,
    /// The relay's payload limit from its last `Welcome` (0: no `Welcome`
    /// yet, read as the protocol's ceiling).
    max_payload: AtomicU64,
}

impl LinkStats {
    /// The relay's payload limit as the last `Welcome` gave it, or the
    /// protocol's ceiling before the first one.
    pub(super) fn max_payload(&self) -> usize {
        match self.max_payload.load(Ordering::Relaxed) {
            0 => oab_wire::limits::MAX_PAYLOAD_CEILING as usize,
            n => usize::try_from(n).unwrap_or(usize::MAX),
        }
    }

    /// A `Welcome` set the relay's payload limit.
    pub(super) fn set_max_payload(&self, max_payload: u32) {
        self.max_payload
            .store(u64::from(max_payload), Ordering::Relaxed);
    }

    /// A delegation was taken on (opened as caller, or received as callee).
    pub(super) fn opened(&self, side: Side) {
        self.opened[side.index()].fetch_add(1, Ordering::Relaxed);
        self.open[side.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// A delegation ended with `outcome` (`None`: refused before it
    /// existed).
    pub(super) fn ended(&self, side: Side, outcome: Option<Outcome>) {
        if let Some(slot) = self.finished[side.index()].get(outcome_index(outcome)) {
            slot.fetch_add(1, Ordering::Relaxed);
        }
        self.open[side.index()].fetch_sub(1, Ordering::Relaxed);
    }

    /// A descriptor of `bytes` was set; `sent`: it went out on the current
    /// session (else it goes out on the next).
    pub(super) fn descriptor_set(&self, bytes: usize, sent: bool) {
        self.facts.lock().descriptor = Some(DescriptorFacts {
            bytes,
            set_ms: oab_wire::identity::now_ms(),
            sent,
        });
        if sent {
            self.publishes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The descriptor went out on a new session.
    pub(super) fn published(&self) {
        if let Some(d) = self.facts.lock().descriptor.as_mut() {
            d.sent = true;
        }
        self.publishes.fetch_add(1, Ordering::Relaxed);
    }

    /// The relay sent an error frame with `code`.
    pub(super) fn refused(&self, code: u16) {
        let i = ErrorCode::ALL
            .iter()
            .position(|c| *c as u16 == code)
            .unwrap_or(ERROR_SLOTS - 1);
        if let Some(slot) = self.refusals.get(i) {
            slot.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Delegations open now, by side.
    pub fn open(&self, side: Side) -> u64 {
        u64::try_from(self.open[side.index()].load(Ordering::Relaxed)).unwrap_or(0)
    }

    /// Delegations ended on `side` with `outcome` (`None`: refused).
    pub fn finished(&self, side: Side, outcome: Option<Outcome>) -> u64 {
        self.finished[side.index()]
            .get(outcome_index(outcome))
            .map_or(0, |c| c.load(Ordering::Relaxed))
    }

    /// Sessions established so far.
    pub fn sessions(&self) -> u64 {
        self.sessions.load(Ordering::Relaxed)
    }

    /// Reconnects scheduled so far.
    pub fn reconnects(&self) -> u64 {
        self.reconnects.load(Ordering::Relaxed)
    }

    /// Frames sent and not yet acknowledged.
    pub fn unacked(&self) -> u64 {
        self.unacked.load(Ordering::Relaxed)
    }

    /// The current session's facts.
    pub fn facts(&self) -> SessionFacts {
        self.facts.lock().clone()
    }

    /// Whether a frame arrived from the relay within the dead-link deadline
    /// (`dead_after_heartbeats` heartbeats): the relay answers on the
    /// current session. `false` while not connected.
    pub fn relay_reachable(&self, now_ms: u64, dead_after_heartbeats: u32) -> bool {
        let facts = self.facts.lock();
        let (Some(_), Some(hb)) = (&facts.session, facts.heartbeat_ms) else {
            return false;
        };
        let last = self.last_rx_ms.load(Ordering::Relaxed);
        last > 0 && now_ms.saturating_sub(last) <= hb * u64::from(dead_after_heartbeats.max(2))
    }

    /// Every series in the Prometheus text format (0.0.4), given the link
    /// state now (`connecting`, `connected` or `stopped`) and whether the
    /// relay is reachable.
    pub fn render_prometheus(&self, state: &str, reachable: bool) -> String {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::new();
        family(
            &mut out,
            "oab_connector_build_info",
            "gauge",
            "Always 1; the labels name the build.",
            &[(
                format!(
                    "version=\"{}\",commit=\"{}\"",
                    oab_ops::build::VERSION,
                    oab_ops::build::COMMIT
                ),
                1,
            )],
        );
        family(
            &mut out,
            "oab_connector_link_up",
            "gauge",
            "1 while a session with the relay is up.",
            &[(String::new(), u64::from(state == "connected"))],
        );
        let states: Vec<(String, u64)> = LINK_STATES
            .iter()
            .map(|s| (format!("state=\"{s}\""), u64::from(*s == state)))
            .collect();
        family(
            &mut out,
            "oab_connector_link_state",
            "gauge",
            "1 for the link's current state.",
            &states,
        );
        family(
            &mut out,
            "oab_connector_relay_reachable",
            "gauge",
            "1 while frames arrive from the relay within the dead-link deadline.",
            &[(String::new(), u64::from(reachable))],
        );
        family(
            &mut out,
            "oab_connector_sessions_total",
            "counter",
            "Sessions established with the relay.",
            &[(String::new(), load(&self.sessions))],
        );
        family(
            &mut out,
            "oab_connector_reconnects_total",
            "counter",
            "Reconnects scheduled after a lost link or a failed attempt.",
            &[(String::new(), load(&self.reconnects))],
        );
        family(
            &mut out,
            "oab_connector_frames_total",
            "counter",
            "Frames by direction (in: from the relay, out: to it).",
            &[
                ("direction=\"in\"".into(), load(&self.frames_in)),
                ("direction=\"out\"".into(), load(&self.frames_out)),
            ],
        );
        family(
            &mut out,
            "oab_connector_acks_total",
            "counter",
            "Acks received from the relay.",
            &[(String::new(), load(&self.acks))],
        );
        family(
            &mut out,
            "oab_connector_unacked_frames",
            "gauge",
            "Frames sent and not yet acknowledged (the resend buffer).",
            &[(String::new(), load(&self.unacked))],
        );
        let by_side = |f: &dyn Fn(Side) -> u64| -> Vec<(String, u64)> {
            Side::ALL
                .iter()
                .map(|s| (format!("side=\"{}\"", s.name()), f(*s)))
                .collect()
        };
        family(
            &mut out,
            "oab_connector_delegations_opened_total",
            "counter",
            "Delegations taken on, by side (caller: opened or restored here; callee: received).",
            &by_side(&|s| load(&self.opened[s.index()])),
        );
        let mut finished = Vec::new();
        for s in Side::ALL {
            for (i, o) in Outcome::ALL
                .iter()
                .map(|o| o.name())
                .chain([REFUSED])
                .enumerate()
            {
                finished.push((
                    format!("side=\"{}\",outcome=\"{o}\"", s.name()),
                    self.finished[s.index()].get(i).map_or(0, load),
                ));
            }
        }
        family(
            &mut out,
            "oab_connector_delegations_finished_total",
            "counter",
            "Delegations ended, by side and outcome (refused: the relay refused the open).",
            &finished,
        );
        family(
            &mut out,
            "oab_connector_open_delegations",
            "gauge",
            "Delegations open now, by side.",
            &by_side(&|s| self.open(s)),
        );
        let mut errors: Vec<(String, u64)> = ErrorCode::ALL
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    format!("code=\"{}\"", c.name()),
                    self.refusals.get(i).map_or(0, load),
                )
            })
            .collect();
        errors.push((
            "code=\"other\"".into(),
            self.refusals.last().map_or(0, load),
        ));
        family(
            &mut out,
            "oab_connector_relay_errors_total",
            "counter",
            "Error frames from the relay, by code (other: a code this version does not know).",
            &errors,
        );
        let published = self.facts.lock().descriptor.is_some_and(|d| d.sent);
        family(
            &mut out,
            "oab_connector_descriptor_published",
            "gauge",
            "1 while this host's descriptor (agent card) went out on the current session.",
            &[(String::new(), u64::from(published))],
        );
        family(
            &mut out,
            "oab_connector_publishes_total",
            "counter",
            "Descriptors sent to the relay (once per set, and again on each new session).",
            &[(String::new(), load(&self.publishes))],
        );
        out
    }
}

/// The `state` label values of `oab_connector_link_state`.
pub const LINK_STATES: [&str; 3] = ["connecting", "connected", "stopped"];

/// Appends one metric family: its help, its type and its samples
/// (`labels` without braces, empty for none).
pub(crate) fn family(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    samples: &[(String, u64)],
) {
    use std::fmt::Write as _;
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        if labels.is_empty() {
            let _ = writeln!(out, "{name} {value}");
        } else {
            let _ = writeln!(out, "{name}{{{labels}}} {value}");
        }
    }
}
