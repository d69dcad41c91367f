//! The audit trail: one structured [`AuditRecord`] per delegation state
//! change, on either side, written as JSON lines by an [`AuditSink`].
//!
//! **No secret material.** A record holds ids (peers, request, task, key),
//! the event and its refusal code, sequence numbers, digests, the outcome,
//! capability names and times. It never holds the task text, the context,
//! the A2A message, outputs, artifacts, error messages or envelopes: those
//! may carry anything the principals typed. The digests identify the exact
//! signed request and result, so an auditor holding the payloads (for
//! example from the relay's log) can match them to the trail without the
//! trail ever holding them.
//!
//! Sinks: [`TracingAuditSink`] (a `tracing` event with target `oab::audit`
//! and one field per member), [`FileAuditSink`] (appends JSON lines through a
//! bounded queue and a writer thread), [`MemoryAuditSink`] (tests), and
//! [`TeeAuditSink`] to send to several.
//!
//! Never: holds a principal's content (task text, context, messages, outputs,
//! artifacts, error messages, envelopes), and never blocks the delegation path
//! on disk: [`FileAuditSink`] drops and counts a record its full queue cannot
//! take.

use parking_lot::Mutex;
use std::io::Write;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::thread::JoinHandle;

use oab_wire::{DelegationKey, Digest, KeyId, Outcome, PeerId, RequestId};
use serde::{Deserialize, Serialize};

/// Which side of a delegation wrote a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    /// The connector that opened the delegation.
    Caller,
    /// The connector that serves it.
    Callee,
}

impl Side {
    /// Stable name.
    pub const fn name(self) -> &'static str {
        match self {
            Side::Caller => "caller",
            Side::Callee => "callee",
        }
    }
}

/// A delegation state change.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AuditEvent {
    /// Caller: the request was signed and the `Open` sent.
    Opened,
    /// Callee: an `Open` arrived.
    Received,
    /// Callee: the request envelope verified and is bound to the `Open`.
    Verified,
    /// Refused (either side); `code` says why.
    Refused,
    /// Callee: the nonce and the delegation slot are taken.
    Reserved,
    /// Callee: the work is accepted with its effective authority.
    Accepted,
    /// Callee: the executor started.
    Executing,
    /// Callee: an event was sent up; `seq` says which.
    EventSent,
    /// Caller: a cancel was sent down.
    CancelRequested,
    /// Terminal: completed.
    Completed,
    /// Terminal: failed.
    Failed,
    /// Terminal: cancelled (the worker stopped).
    Cancelled,
    /// Terminal: expired (appended by the relay).
    Expired,
    /// Terminal: unknown (the callee went away after accepting).
    Unknown,
    /// Terminal: rejected before acceptance.
    Rejected,
    /// Caller: the signed result verified.
    VerifiedResult,
    /// Caller: the signed result did not verify; `code` says why.
    VerifyFailed,
}

impl AuditEvent {
    /// The terminal event of an outcome.
    pub const fn terminal(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Completed => AuditEvent::Completed,
            Outcome::Failed => AuditEvent::Failed,
            Outcome::Cancelled => AuditEvent::Cancelled,
            Outcome::Expired => AuditEvent::Expired,
            Outcome::Unknown => AuditEvent::Unknown,
            Outcome::Rejected => AuditEvent::Rejected,
        }
    }

    /// Stable snake_case name (as serialized).
    pub const fn name(self) -> &'static str {
        match self {
            AuditEvent::Opened => "opened",
            AuditEvent::Received => "received",
            AuditEvent::Verified => "verified",
            AuditEvent::Refused => "refused",
            AuditEvent::Reserved => "reserved",
            AuditEvent::Accepted => "accepted",
            AuditEvent::Executing => "executing",
            AuditEvent::EventSent => "event_sent",
            AuditEvent::CancelRequested => "cancel_requested",
            AuditEvent::Completed => "completed",
            AuditEvent::Failed => "failed",
            AuditEvent::Cancelled => "cancelled",
            AuditEvent::Expired => "expired",
            AuditEvent::Unknown => "unknown",
            AuditEvent::Rejected => "rejected",
            AuditEvent::VerifiedResult => "verified_result",
            AuditEvent::VerifyFailed => "verify_failed",
        }
    }
}

impl std::fmt::Display for AuditEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One delegation state change. Absent optional members are omitted from
/// the JSON line. Holds no secret material (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditRecord {
    /// When, ms since the Unix epoch.
    pub time_ms: u64,
    /// Which side wrote it.
    pub side: Side,
    /// The delegation's caller (first half of the delegation key).
    pub caller: PeerId,
    /// The delegation's request id (second half of the delegation key).
    pub request_id: RequestId,
    /// The callee, once known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub callee: Option<PeerId>,
    /// The A2A task id, once minted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_id: Option<String>,
    /// What happened.
    pub event: AuditEvent,
    /// The refusal or verification code (`refused`, `verify_failed`,
    /// `rejected`, `failed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<String>,
    /// The sequence number (`event_sent`, terminals).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// SHA-256 of the signed request payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_digest: Option<Digest>,
    /// The result's result digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result_digest: Option<Digest>,
    /// The terminal outcome.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<Outcome>,
    /// Effective capabilities (`accepted`, `verified_result`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub effective_capabilities: Vec<String>,
    /// The key id that signed what this record is about.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key_id: Option<KeyId>,
}

impl AuditRecord {
    /// A record with only the required members; add the rest with the
    /// `with_*` methods.
    pub fn new(time_ms: u64, side: Side, key: &DelegationKey, event: AuditEvent) -> Self {
        AuditRecord {
            time_ms,
            side,
            caller: key.caller.clone(),
            request_id: key.request_id.clone(),
            callee: None,
            task_id: None,
            event,
            code: None,
            seq: None,
            request_digest: None,
            result_digest: None,
            outcome: None,
            effective_capabilities: Vec::new(),
            key_id: None,
        }
    }

    /// A `refused` record with its code (e.g. from `ProfileError::code`).
    pub fn refused(time_ms: u64, side: Side, key: &DelegationKey, code: &str) -> Self {
        AuditRecord::new(time_ms, side, key, AuditEvent::Refused).with_code(code)
    }

    /// Sets the callee.
    pub fn with_callee(mut self, callee: PeerId) -> Self {
        self.callee = Some(callee);
        self
    }

    /// Sets the A2A task id.
    pub fn with_task_id(mut self, task_id: impl Into<String>) -> Self {
        self.task_id = Some(task_id.into());
        self
    }

    /// Sets the code.
    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.code = Some(code.into());
        self
    }

    /// Sets the sequence number.
    pub fn with_seq(mut self, seq: u64) -> Self {
        self.seq = Some(seq);
        self
    }

    /// Sets the request digest.
    pub fn with_request_digest(mut self, digest: Digest) -> Self {
        self.request_digest = Some(digest);
        self
    }

    /// Sets the result digest.
    pub fn with_result_digest(mut self, digest: Digest) -> Self {
        self.result_digest = Some(digest);
        self
    }

    /// Sets the outcome.
    pub fn with_outcome(mut self, outcome: Outcome) -> Self {
        self.outcome = Some(outcome);
        self
    }

    /// Sets the effective capabilities.
    pub fn with_capabilities(mut self, capabilities: Vec<String>) -> Self {
        self.effective_capabilities = capabilities;
        self
    }

    /// Sets the signing key id.
    pub fn with_key_id(mut self, key_id: KeyId) -> Self {
        self.key_id = Some(key_id);
        self
    }

    /// The delegation key.
    pub fn key(&self) -> DelegationKey {
        DelegationKey::new(self.caller.clone(), self.request_id.clone())
    }

    /// The record as one JSON line, newline included.
    pub fn to_json_line(&self) -> String {
        // String-keyed structs of strings and integers always serialize.
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }
}

/// Where audit records go. Implementations must not block for long: they
/// are called on the delegation path.
pub trait AuditSink: Send + Sync {
    /// Records one state change.
    fn record(&self, record: &AuditRecord);
}

impl<S: AuditSink + ?Sized> AuditSink for Arc<S> {
    fn record(&self, record: &AuditRecord) {
        (**self).record(record);
    }
}

/// Sends every record to each of several sinks, in order.
#[derive(Default)]
pub struct TeeAuditSink {
    sinks: Vec<Arc<dyn AuditSink>>,
}

impl TeeAuditSink {
    /// A tee over these sinks.
    pub fn new(sinks: Vec<Arc<dyn AuditSink>>) -> Self {
        TeeAuditSink { sinks }
    }
}

impl AuditSink for TeeAuditSink {
    fn record(&self, record: &AuditRecord) {
        for s in &self.sinks {
            s.record(record);
        }
    }
}

/// Emits each record as a `tracing` event at INFO with target `oab::audit`
/// and one structured field per member (absent members are left out).
#[derive(Debug, Clone, Copy, Default)]
pub struct TracingAuditSink;

impl AuditSink for TracingAuditSink {
    fn record(&self, r: &AuditRecord) {
        tracing::info!(
            target: "oab::audit",
            time_ms = r.time_ms,
            side = r.side.name(),
            caller = %r.caller,
            request_id = %r.request_id,
            callee = r.callee.as_ref().map(tracing::field::display),
            task_id = r.task_id.as_deref(),
            event = r.event.name(),
            code = r.code.as_deref(),
            seq = r.seq,
            request_digest = r.request_digest.as_ref().map(tracing::field::display),
            result_digest = r.result_digest.as_ref().map(tracing::field::display),
            outcome = r.outcome.map(Outcome::name),
            effective_capabilities = (!r.effective_capabilities.is_empty())
                .then(|| r.effective_capabilities.join(",")),
            key_id = r.key_id.as_ref().map(tracing::field::display),
            "delegation {}",
            r.event.name()
        );
    }
}

/// Keeps records in memory (tests). Bounded: beyond `capacity` the oldest
/// record is dropped.
#[derive(Debug)]
pub struct MemoryAuditSink {
    capacity: usize,
    records: Mutex<std::collections::VecDeque<AuditRecord>>,
}

impl MemoryAuditSink {
    /// Default capacity: enough for any test, bounded for a long run.
    pub const DEFAULT_CAPACITY: usize = 10_000;

    /// A sink keeping at most `capacity` records.
    pub fn new(capacity: usize) -> Self {
        MemoryAuditSink {
            capacity,
            records: Mutex::new(std::collections::VecDeque::new()),
        }
    }

    /// A copy of the records, oldest first.
    pub fn records(&self) -> Vec<AuditRecord> {
        self.records.lock().iter().cloned().collect()
    }

    /// The events of the records about `key`, oldest first.
    pub fn events_for(&self, key: &DelegationKey) -> Vec<AuditEvent> {
        self.records
            .lock()
            .iter()
            .filter(|r| r.caller == key.caller && r.request_id == key.request_id)
            .map(|r| r.event)
            .collect()
    }
}

impl Default for MemoryAuditSink {
    fn default() -> Self {
        MemoryAuditSink::new(Self::DEFAULT_CAPACITY)
    }
}

impl AuditSink for MemoryAuditSink {
    fn record(&self, record: &AuditRecord) {
        let mut records = self.records.lock();
        if self.capacity == 0 {
            return;
        }
        if records.len() >= self.capacity {
            records.pop_front();
        }
        records.push_back(record.clone());
    }
}

#[derive(Debug, Default)]
struct FileCounters {
    dropped: AtomicU64,
    write_errors: AtomicU64,
}

/// Appends records as JSON lines to a file (or any writer).
///
/// **Bounded queue, overflow drops.** `record` serializes the line and hands
/// it to a writer thread through a queue of `capacity` lines; it never
/// blocks the delegation path on disk. When the queue is full the new record
/// is dropped, counted in [`FileAuditSink::dropped`] and reported with a
/// `tracing` warning (target `oab::audit`), so pair this sink with
/// [`TracingAuditSink`] in a [`TeeAuditSink`] when no record may go unseen.
/// The thread writes through a buffer and flushes whenever the queue runs
/// empty; [`FileAuditSink::close`] (or drop) flushes and stops it. Write
/// errors are counted ([`FileAuditSink::write_errors`]) and warned about.
#[derive(Debug)]
pub struct FileAuditSink {
    tx: Option<SyncSender<String>>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<FileCounters>,
}

impl FileAuditSink {
    /// Default queue capacity in lines: with records of a few hundred bytes,
    /// about 1 MiB of backlog before records are dropped.
    pub const DEFAULT_CAPACITY: usize = 4_096;

    /// Opens `path` for appending (creating it, mode 0600 on Unix) and starts
    /// the writer thread.
    pub fn open(path: &Path, capacity: usize) -> std::io::Result<Self> {
        let mut opts = std::fs::OpenOptions::new();
        opts.append(true).create(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt as _;
            opts.mode(0o600);
        }
        let file = opts.open(path)?;
        Self::with_writer(file, capacity)
    }

    /// Starts the writer thread over any writer.
    pub fn with_writer<W: Write + Send + 'static>(
        writer: W,
        capacity: usize,
    ) -> std::io::Result<Self> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<String>(capacity);
        let counters = Arc::new(FileCounters::default());
        let thread_counters = Arc::clone(&counters);
        let thread = std::thread::Builder::new()
            .name("oab-audit".into())
            .spawn(move || write_lines(rx, std::io::BufWriter::new(writer), &thread_counters))?;
        Ok(FileAuditSink {
            tx: Some(tx),
            thread: Some(thread),
            counters,
        })
    }

    /// Records dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.counters.dropped.load(Ordering::Relaxed)
    }

    /// Writes or flushes that failed.
    pub fn write_errors(&self) -> u64 {
        self.counters.write_errors.load(Ordering::Relaxed)
    }

    /// Writes everything queued, flushes and stops the writer thread.
    pub fn close(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.tx = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn write_lines<W: Write>(rx: Receiver<String>, mut out: W, counters: &FileCounters) {
    let fail = |e: std::io::Error| {
        counters.write_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(target: "oab::audit", error = %e, "audit file write failed");
    };
    while let Ok(line) = rx.recv() {
        if let Err(e) = out.write_all(line.as_bytes()) {
            fail(e);
        }
        // Drain what is queued before flushing, so a burst costs one flush.
        while let Ok(line) = rx.try_recv() {
            if let Err(e) = out.write_all(line.as_bytes()) {
                fail(e);
            }
        }
        if let Err(e) = out.flush() {
            fail(e);
        }
    }
}

impl AuditSink for FileAuditSink {
    fn record(&self, record: &AuditRecord) {
        let Some(tx) = &self.tx else { return };
        match tx.try_send(record.to_json_line()) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                let n = self.counters.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                tracing::warn!(
                    target: "oab::audit",
                    dropped_total = n,
                    event = record.event.name(),
                    request_id = %record.request_id,
                    "audit file queue full: record dropped"
                );
            }
        }
    }
}

impl Drop for FileAuditSink {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;

    use super::*;
    use crate::profile::tests::{NOW, sample_request};

    fn key() -> DelegationKey {
        DelegationKey::new(
            PeerId::new("acme/a").unwrap(),
            RequestId::new("req-1").unwrap(),
        )
    }

    fn full_record() -> AuditRecord {
        AuditRecord::new(NOW, Side::Callee, &key(), AuditEvent::Completed)
            .with_callee(PeerId::new("acme/b").unwrap())
            .with_task_id("task-42")
            .with_seq(7)
            .with_request_digest(Digest::of(b"req"))
            .with_result_digest(Digest::of(b"res"))
            .with_outcome(Outcome::Completed)
            .with_capabilities(vec!["read:repo".into()])
            .with_key_id(KeyId::new("kb").unwrap())
    }

    #[test]
    fn json_lines_round_trip_and_omit_absent_members() {
        let r = full_record();
        let line = r.to_json_line();
        assert!(line.ends_with('\n'));
        assert_eq!(line.matches('\n').count(), 1);
        let back: AuditRecord = serde_json::from_str(line.trim_end()).unwrap();
        assert_eq!(back, r);
        assert_eq!(back.key(), key());
        let minimal = AuditRecord::refused(NOW, Side::Caller, &key(), "capability_denied");
        let v: serde_json::Value = serde_json::from_str(&minimal.to_json_line()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"time_ms": NOW, "side": "caller", "caller": "acme/a",
                "request_id": "req-1", "event": "refused", "code": "capability_denied"})
        );
    }

    #[test]
    fn event_names_match_serde_and_terminals() {
        for o in Outcome::ALL {
            let e = AuditEvent::terminal(*o);
            assert_eq!(e.name(), o.name());
        }
        for e in [
            AuditEvent::Opened,
            AuditEvent::Received,
            AuditEvent::Verified,
            AuditEvent::Refused,
            AuditEvent::Reserved,
            AuditEvent::Accepted,
            AuditEvent::Executing,
            AuditEvent::EventSent,
            AuditEvent::CancelRequested,
            AuditEvent::VerifiedResult,
            AuditEvent::VerifyFailed,
        ] {
            assert_eq!(serde_json::to_value(e).unwrap(), e.name());
        }
    }

    #[test]
    fn records_hold_no_task_material() {
        // Everything an auditor would build from a verified request.
        let mut req = sample_request(NOW);
        req.task.text = "SECRET-TASK-TEXT".into();
        req.task
            .context
            .insert("note".into(), serde_json::json!("SECRET-CONTEXT"));
        let digest = Digest::of(&serde_json::to_vec(&req).unwrap());
        let k = DelegationKey::new(req.caller.clone(), req.request_id.clone());
        let r = AuditRecord::new(NOW, Side::Callee, &k, AuditEvent::Accepted)
            .with_request_digest(digest)
            .with_capabilities(req.capabilities.clone());
        let line = r.to_json_line();
        assert!(!line.contains("SECRET"), "{line}");
        assert!(line.contains(&digest.to_string()));
    }

    #[test]
    fn memory_sink_is_bounded() {
        let sink = MemoryAuditSink::new(2);
        for e in [
            AuditEvent::Received,
            AuditEvent::Verified,
            AuditEvent::Accepted,
        ] {
            sink.record(&AuditRecord::new(NOW, Side::Callee, &key(), e));
        }
        assert_eq!(
            sink.events_for(&key()),
            vec![AuditEvent::Verified, AuditEvent::Accepted]
        );
        assert_eq!(sink.records().len(), 2);
        let none = MemoryAuditSink::new(0);
        none.record(&full_record());
        assert!(none.records().is_empty());
    }

    #[test]
    fn tee_sends_to_every_sink() {
        let a = Arc::new(MemoryAuditSink::default());
        let b = Arc::new(MemoryAuditSink::default());
        let tee = TeeAuditSink::new(vec![a.clone(), b.clone()]);
        tee.record(&full_record());
        assert_eq!(a.records(), b.records());
        assert_eq!(a.records().len(), 1);
    }

    #[test]
    fn file_sink_appends_json_lines() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit.jsonl");
        let sink = FileAuditSink::open(&path, 16).unwrap();
        sink.record(&full_record());
        sink.record(&AuditRecord::refused(
            NOW,
            Side::Callee,
            &key(),
            "nonce_reused",
        ));
        sink.close();
        // Reopening appends.
        let sink = FileAuditSink::open(&path, 16).unwrap();
        sink.record(&full_record());
        drop(sink);
        let text = std::fs::read_to_string(&path).unwrap();
        let records: Vec<AuditRecord> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(records.len(), 3);
        assert_eq!(records[1].code.as_deref(), Some("nonce_reused"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
    }

    /// A writer that announces each write and then waits for a go-ahead.
    struct GatedWriter {
        entered: mpsc::Sender<()>,
        gate: mpsc::Receiver<()>,
        out: Arc<Mutex<Vec<u8>>>,
    }

    impl Write for GatedWriter {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            let _ = self.entered.send(());
            let _ = self.gate.recv();
            self.out.lock().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn file_sink_drops_and_counts_when_the_queue_is_full() {
        let (entered_tx, entered) = mpsc::channel();
        let (go, gate) = mpsc::channel();
        let out = Arc::new(Mutex::new(Vec::new()));
        // The sink buffers lines, so the writer's first write happens when
        // the thread flushes record 1.
        let writer = GatedWriter {
            entered: entered_tx,
            gate,
            out: out.clone(),
        };
        let sink = FileAuditSink::with_writer(writer, 2).unwrap();
        sink.record(&full_record());
        // The thread took record 1 and is blocked writing it.
        entered.recv().unwrap();
        sink.record(&full_record()); // queued
        sink.record(&full_record()); // queued
        sink.record(&full_record()); // dropped
        sink.record(&full_record()); // dropped
        assert_eq!(sink.dropped(), 2);
        // Release every write and close: the three accepted records land.
        for _ in 0..16 {
            let _ = go.send(());
        }
        drop(go);
        sink.close();
        let text = String::from_utf8(out.lock().clone()).unwrap();
        assert_eq!(text.lines().count(), 3);
    }

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn tracing_sink_emits_structured_fields() {
        let captured = Captured::default();
        let make = {
            let c = captured.clone();
            move || c.clone()
        };
        let subscriber = tracing_subscriber::fmt()
            .json()
            .with_writer(make)
            .with_max_level(tracing::Level::INFO)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            TracingAuditSink.record(&full_record());
            TracingAuditSink.record(&AuditRecord::refused(
                NOW,
                Side::Callee,
                &key(),
                "capability_denied",
            ));
        });
        let text = String::from_utf8(captured.0.lock().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["target"], "oab::audit");
        let f = &lines[0]["fields"];
        assert_eq!(f["event"], "completed");
        assert_eq!(f["caller"], "acme/a");
        assert_eq!(f["task_id"], "task-42");
        assert_eq!(f["seq"], 7);
        assert_eq!(f["outcome"], "completed");
        assert_eq!(f["request_digest"], Digest::of(b"req").to_string());
        assert_eq!(f["effective_capabilities"], "read:repo");
        let f = &lines[1]["fields"];
        assert_eq!(f["code"], "capability_denied");
        assert!(f.get("task_id").is_none());
    }
}
