//! The two endpoints of a benchmark and what they do on a WebSocket, the
//! same whether it leads to the relay or directly to the other endpoint:
//!
//! - [`open_delegation`]: the caller's `Open` and its ack;
//! - [`pipelined_sender`] and [`counting_receiver`]: the throughput pair (the
//!   sender keeps a window of unacknowledged frames in flight, the receiver
//!   checks and counts);
//! - [`paced_sender`], [`echo_reader`] and [`echoer`]: the latency trio (the
//!   caller sends on a schedule, the callee echoes each down `Data` as an up
//!   `Data`, the caller measures the round trip).
//!
//! On the direct path there is no relay to acknowledge, so the callee plays
//! that part: it acks each batch of down frames cumulatively, as the relay
//! does after its store append ([`CalleeRole::AckAsRelay`]).

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use bytes::Bytes;
use futures_util::{FutureExt as _, Sink, SinkExt as _, Stream, StreamExt as _};
use hdrhistogram::Histogram;
use oab_wire::{
    Ack, Data, DelegationKey, Digest, Direction, ErrorCode, Frame, Limits, Open, Outcome,
    decode_message, encode,
};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::{Error as WsError, Message};
use tokio_util::sync::CancellationToken;

use crate::traffic::{DataTemplate, Progress, StreamCheck, now_ns, stamp_of};

/// Messages taken from the socket before a batch is processed (the relay's
/// own batch size, so both paths batch alike).
const MAX_BATCH: usize = 256;
/// Frames fed before the sender flushes.
const FLUSH_EVERY: u64 = 64;

/// A WebSocket either end of any connection can drive.
pub trait Ws:
    Stream<Item = Result<Message, WsError>> + Sink<Message, Error = WsError> + Unpin + Send + 'static
{
}
impl<T> Ws for T where
    T: Stream<Item = Result<Message, WsError>>
        + Sink<Message, Error = WsError>
        + Unpin
        + Send
        + 'static
{
}

/// What the callee does besides receiving.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CalleeRole {
    /// Behind the relay: the relay acknowledges the caller's frames.
    BehindRelay,
    /// Direct: the callee acknowledges down frames itself, per batch.
    AckAsRelay,
}

/// Shared record of protocol errors seen by one endpoint.
#[derive(Debug, Clone, Default)]
pub struct Errors(Arc<Mutex<Vec<String>>>);

impl Errors {
    /// Records one.
    pub fn push(&self, e: String) {
        let mut v = self.0.lock();
        // Keep the first few: one broken run must not fill the memory.
        if v.len() < 32 {
            v.push(e);
        }
    }

    /// Everything recorded.
    pub fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock())
    }
}

fn describe(frame: &Frame) -> String {
    match frame {
        Frame::Error(e) => format!(
            "Error code {} seq {} dir {}: {}",
            e.code,
            e.seq,
            e.direction.name(),
            e.message
        ),
        Frame::Gap(g) => format!("Gap after {} reason {}", g.after, g.reason.name()),
        other => format!("{} frame", other.frame_type().name()),
    }
}

/// What one read from a WebSocket produced.
enum Read {
    Frame(Frame),
    Skip,
    Closed(String),
}

fn read_one(msg: Option<Result<Message, WsError>>, limits: &Limits) -> Read {
    match msg {
        None => Read::Closed("connection ended".into()),
        Some(Err(e)) => Read::Closed(format!("websocket: {e}")),
        Some(Ok(Message::Binary(b))) => match decode_message(b, limits) {
            Ok(f) => Read::Frame(f),
            Err(e) => Read::Closed(format!("undecodable frame: {e}")),
        },
        Some(Ok(Message::Close(c))) => Read::Closed(match c {
            Some(c) => format!("closed {}: {}", u16::from(c.code), c.reason),
            None => "closed".into(),
        }),
        Some(Ok(_)) => Read::Skip,
    }
}

/// Reads the next message and whatever else is already buffered (up to
/// [`MAX_BATCH`]) without waiting. The returned `Read::Closed`, if any, is last.
async fn read_batch<W: Ws>(ws: &mut W, limits: &Limits, out: &mut Vec<Read>) {
    out.clear();
    let first = read_one(ws.next().await, limits);
    let closed = matches!(first, Read::Closed(_));
    out.push(first);
    if closed {
        return;
    }
    while out.len() < MAX_BATCH {
        let Some(msg) = ws.next().now_or_never() else {
            break;
        };
        let r = read_one(msg, limits);
        let closed = matches!(r, Read::Closed(_));
        out.push(r);
        if closed {
            return;
        }
    }
}

async fn send_frame<W: Ws>(ws: &mut W, frame: &Frame) -> anyhow::Result<()> {
    ws.send(Message::Binary(encode(frame)?)).await?;
    Ok(())
}

/// The caller's `Open` for a benchmark delegation (down entry 1).
pub fn open_frame(key: &DelegationKey, target: &oab_wire::PeerId) -> Frame {
    let payload = Bytes::from_static(b"{\"benchmark\":true}");
    Frame::Open(Open {
        key: key.clone(),
        target: target.clone(),
        deadline_ms: oab_wire::identity::now_ms() + 3_600_000,
        depth: 1,
        digest: Digest::of(&payload),
        ceiling: String::new(),
        trace: None,
        payload,
    })
}

/// Opens a delegation: the caller sends the `Open`, the callee receives it
/// (and acks it on the direct path), the caller receives `Ack(down, 1)`.
pub async fn open_delegation<A: Ws, B: Ws>(
    caller: &mut A,
    callee: &mut B,
    key: &DelegationKey,
    target: &oab_wire::PeerId,
    role: CalleeRole,
    limits: &Limits,
) -> anyhow::Result<()> {
    let caller_side = async {
        send_frame(caller, &open_frame(key, target)).await?;
        loop {
            match read_one(caller.next().await, limits) {
                Read::Frame(Frame::Ack(a)) if a.key == *key && a.direction == Direction::Down => {
                    return Ok(());
                }
                Read::Frame(f @ (Frame::Error(_) | Frame::Gap(_))) => {
                    bail!("caller: {}", describe(&f))
                }
                Read::Frame(_) | Read::Skip => {}
                Read::Closed(why) => bail!("caller: {why}"),
            }
        }
    };
    let callee_side = async {
        loop {
            match read_one(callee.next().await, limits) {
                Read::Frame(Frame::Open(o)) if o.key == *key => break,
                Read::Frame(_) | Read::Skip => {}
                Read::Closed(why) => bail!("callee: {why}"),
            }
        }
        if role == CalleeRole::AckAsRelay {
            let ack = Frame::Ack(Ack {
                key: key.clone(),
                direction: Direction::Down,
                seq: 1,
            });
            send_frame(callee, &ack).await?;
        }
        anyhow::Ok(())
    };
    let (a, b) = tokio::time::timeout(Duration::from_secs(30), async {
        tokio::join!(caller_side, callee_side)
    })
    .await
    .context("the open was not delivered and acknowledged within 30 s")?;
    a.and(b)
}

/// The callee ends the delegation with a `completed` terminal at up entry
/// `seq` and waits (bounded) for its ack, so the relay's delegation count
/// and logs are released before the next case.
pub async fn finish_delegation<W: Ws>(
    callee: &mut W,
    key: &DelegationKey,
    seq: u64,
    limits: &Limits,
) -> anyhow::Result<()> {
    let terminal = Frame::Data(Data {
        key: key.clone(),
        direction: Direction::Up,
        seq,
        terminal: Some(Outcome::Completed),
        flags: 0,
        payload: Bytes::from_static(b"{}"),
    });
    send_frame(callee, &terminal).await?;
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match read_one(callee.next().await, limits) {
                Read::Frame(Frame::Ack(a)) if a.direction == Direction::Up && a.seq >= seq => {
                    return Ok(());
                }
                Read::Frame(f @ Frame::Error(_)) => bail!("callee: {}", describe(&f)),
                Read::Frame(_) | Read::Skip => {}
                Read::Closed(why) => bail!("callee: {why}"),
            }
        }
    })
    .await
    .context("no ack for the terminal within 10 s")?
}

/// Parameters of a pipelined send.
#[derive(Debug, Clone)]
pub struct PipelineSpec {
    /// Frames to send.
    pub template: DataTemplate,
    /// The first sequence (2: the `Open` is down entry 1).
    pub first_seq: u64,
    /// At most this many frames beyond the last confirmed one.
    pub window: u64,
    /// Stop sending at this time.
    pub deadline: Instant,
    /// Stop sending after this many frames.
    pub max_frames: u64,
    /// After sending stops, how long to wait for the acks and the receiver.
    pub drain: Duration,
}

/// What a pipelined send did.
#[derive(Debug, Clone)]
pub struct SenderOutcome {
    /// When the first frame was sent.
    pub started: Instant,
    /// When the last frame was sent.
    pub stopped: Instant,
    /// The last sequence sent (`first_seq - 1` if none).
    pub last_seq: u64,
    /// The highest sequence acknowledged when the send ended.
    pub acked: u64,
    /// Whether every frame was acknowledged and received within the drain.
    pub drained: bool,
    /// Errors, gaps and closes the sender saw.
    pub errors: Vec<String>,
    /// Times the sender found the window full and waited.
    pub window_waits: u64,
}

/// Where the sender is to send from again: a `sequence_gap` refusal at
/// `seq` means the relay did not append anything after `seq` (on a Redis
/// Cluster a batch can overtake an earlier one between the budget's round
/// trip and the append's), and a connector resends from `seq + 1`; so does
/// the benchmark's sender, once per refusal point.
#[derive(Default)]
struct Rewind {
    /// The latest point asked for, and the last one the sender took.
    at: Mutex<(u64, u64)>,
    changed: tokio::sync::Notify,
}

impl Rewind {
    fn ask(&self, from: u64) {
        let mut at = self.at.lock();
        if from > at.0 {
            at.0 = from;
            drop(at);
            self.changed.notify_one();
        }
    }

    /// A point not taken yet.
    fn take(&self) -> Option<u64> {
        let mut at = self.at.lock();
        (at.0 > at.1).then(|| {
            at.1 = at.0;
            at.0
        })
    }
}

/// Sends `spec.template` frames as fast as the window allows: a frame goes
/// out while fewer than `window` frames are beyond the highest sequence that
/// is both acknowledged (by the relay, or the direct callee) and, when
/// `received` is given, received by the callee. The second bound is
/// end-to-end flow control, as an application on top of the relay would
/// need: acks mean "durable", not "delivered", and without it a fast sender
/// overflows the receiver's bounded relay queue (`slow_consumer`).
///
/// `last_sent` is set to the last sequence once sending stops, so the
/// receiver knows when it is done.
pub async fn pipelined_sender<W: Ws>(
    ws: W,
    spec: PipelineSpec,
    received: Option<Arc<Progress>>,
    last_sent: watch::Sender<u64>,
    limits: Limits,
) -> (Option<W>, SenderOutcome) {
    let (mut sink, stream) = ws.split();
    let acked = Arc::new(Progress::new(spec.first_seq - 1));
    let errors = Errors::default();
    let stop_reader = CancellationToken::new();
    let rewind = Arc::new(Rewind::default());
    let reader = tokio::spawn(ack_reader(
        stream,
        acked.clone(),
        errors.clone(),
        rewind.clone(),
        stop_reader.clone(),
        limits,
    ));
    let started = Instant::now();
    let mut next = spec.first_seq;
    let last_allowed = spec.first_seq.saturating_add(spec.max_frames.max(1) - 1);
    let mut unflushed = 0u64;
    let mut window_waits = 0u64;
    let mut failed = false;
    let mut highest = spec.first_seq - 1;
    loop {
        if let Some(from) = rewind.take()
            && from < next
        {
            next = from;
        }
        if next > last_allowed || reader.is_finished() {
            break;
        }
        let confirmed = match &received {
            Some(r) => acked.get().min(r.get()),
            None => acked.get(),
        };
        if next <= confirmed + spec.window {
            let frame = spec.template.frame(next, now_ns(), 0);
            if sink.feed(Message::Binary(frame)).await.is_err() {
                failed = true;
                break;
            }
            highest = highest.max(next);
            next += 1;
            unflushed += 1;
            if unflushed >= FLUSH_EVERY {
                unflushed = 0;
                if sink.flush().await.is_err() {
                    failed = true;
                    break;
                }
                if Instant::now() >= spec.deadline {
                    break;
                }
            }
            continue;
        }
        if unflushed > 0 {
            unflushed = 0;
            if sink.flush().await.is_err() {
                failed = true;
                break;
            }
            continue;
        }
        if Instant::now() >= spec.deadline {
            break;
        }
        window_waits += 1;
        let receiver_moved = async {
            match &received {
                Some(r) => r.changed.notified().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = acked.changed.notified() => {}
            () = receiver_moved => {}
            () = rewind.changed.notified() => {}
            () = tokio::time::sleep_until(spec.deadline) => {}
        }
    }
    if !failed && sink.flush().await.is_err() {
        failed = true;
    }
    let stopped = Instant::now();
    let last_seq = highest;
    last_sent.send_replace(last_seq);
    if failed {
        errors.push("the sender's connection failed".into());
    }
    // Drain: everything sent acknowledged, and received when we can see it.
    let drained = tokio::time::timeout(spec.drain, async {
        acked.wait_for(last_seq).await;
        if let Some(r) = &received {
            r.wait_for(last_seq).await;
        }
    })
    .await
    .is_ok();
    stop_reader.cancel();
    let stream = reader.await.ok();
    let acked_now = acked.get();
    let outcome = SenderOutcome {
        started,
        stopped,
        last_seq,
        acked: acked_now,
        drained,
        errors: errors.take(),
        window_waits,
    };
    // The reader returns its half unless it panicked (a bug); then the
    // connection is dropped here and the caller gets none back.
    let ws = stream.and_then(|s| s.reunite(sink).ok());
    (ws, outcome)
}

async fn ack_reader<S>(
    mut stream: S,
    acked: Arc<Progress>,
    errors: Errors,
    rewind: Arc<Rewind>,
    stop: CancellationToken,
    limits: Limits,
) -> S
where
    S: Stream<Item = Result<Message, WsError>> + Unpin,
{
    loop {
        let msg = tokio::select! {
            () = stop.cancelled() => return stream,
            m = stream.next() => m,
        };
        match read_one(msg, &limits) {
            Read::Frame(Frame::Ack(a)) if a.direction == Direction::Down => acked.advance(a.seq),
            Read::Frame(f @ (Frame::Error(_) | Frame::Gap(_))) => {
                if let Frame::Error(e) = &f
                    && e.code == ErrorCode::SequenceGap.as_u16()
                    && e.direction == Direction::Down
                {
                    rewind.ask(e.seq.saturating_add(1));
                }
                errors.push(describe(&f));
            }
            Read::Frame(_) | Read::Skip => {}
            Read::Closed(why) => {
                errors.push(format!("sender connection: {why}"));
                return stream;
            }
        }
    }
}

/// What a counting receiver saw.
#[derive(Debug)]
pub struct ReceiverOutcome {
    /// The frame check.
    pub check: StreamCheck,
    /// When the last new frame arrived.
    pub last_at: Option<Instant>,
    /// One-way delay of each frame (send stamp to receipt), nanoseconds.
    pub one_way: Histogram<u64>,
    /// Errors, gaps and closes the receiver saw.
    pub errors: Vec<String>,
    /// Payload bytes received.
    pub payload_bytes: u64,
}

/// A histogram for nanosecond latencies: 1 ns to 100 s, 3 significant
/// digits (a few hundred KiB of counters).
#[allow(clippy::expect_used)] // Constant bounds that hdrhistogram accepts.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid constant histogram bounds")
}

/// The callee of the throughput pair: checks and counts down `Data` frames,
/// advances `progress` to the highest in-order sequence after each batch
/// (and, as [`CalleeRole::AckAsRelay`], acks it), and stops once it has
/// everything up to `last_sent` (set by the sender when it stops), or on
/// `stop`.
#[allow(clippy::too_many_arguments)]
pub async fn counting_receiver<W: Ws>(
    mut ws: W,
    key: DelegationKey,
    mut check: StreamCheck,
    progress: Arc<Progress>,
    role: CalleeRole,
    mut last_sent: watch::Receiver<u64>,
    stop: CancellationToken,
    limits: Limits,
) -> (W, ReceiverOutcome) {
    let mut errors = Vec::new();
    let mut last_at = None;
    let mut one_way = latency_histogram();
    let mut payload_bytes = 0u64;
    let mut batch = Vec::with_capacity(MAX_BATCH);
    let mut acked = 0u64;
    let mut final_known = false;
    'outer: loop {
        if check.contiguous() >= *last_sent.borrow_and_update() {
            break;
        }
        tokio::select! {
            () = stop.cancelled() => break,
            changed = last_sent.changed(), if !final_known => {
                // The sender dropped its end after setting the last value:
                // that value is final; keep reading up to it.
                final_known = changed.is_err();
                continue;
            }
            () = read_batch(&mut ws, &limits, &mut batch) => {}
        }
        let now = now_ns();
        for r in batch.drain(..) {
            match r {
                Read::Frame(Frame::Data(d)) if d.direction == Direction::Down && d.key == key => {
                    if check.observe(d.seq, &d.payload) {
                        payload_bytes += d.payload.len() as u64;
                        if let Some((_, sent, _)) = stamp_of(&d.payload) {
                            let _ = one_way.record(now.saturating_sub(sent).max(1));
                        }
                    }
                }
                Read::Frame(f @ (Frame::Error(_) | Frame::Gap(_))) => errors.push(describe(&f)),
                Read::Frame(_) | Read::Skip => {}
                Read::Closed(why) => {
                    errors.push(format!("receiver connection: {why}"));
                    break 'outer;
                }
            }
        }
        last_at = Some(Instant::now());
        let contiguous = check.contiguous();
        progress.advance(contiguous);
        if role == CalleeRole::AckAsRelay && contiguous > acked {
            acked = contiguous;
            let ack = Frame::Ack(Ack {
                key: key.clone(),
                direction: Direction::Down,
                seq: contiguous,
            });
            if send_frame(&mut ws, &ack).await.is_err() {
                errors.push("receiver: could not send an ack".into());
                break;
            }
        }
    }
    (
        ws,
        ReceiverOutcome {
            check,
            last_at,
            one_way,
            errors,
            payload_bytes,
        },
    )
}

/// Parameters of a paced (open-loop) send.
#[derive(Debug, Clone)]
pub struct PaceSpec {
    /// Frames to send.
    pub template: DataTemplate,
    /// The first sequence (2).
    pub first_seq: u64,
    /// Offered load, frames per second.
    pub rate: f64,
    /// How long to send.
    pub duration: Duration,
    /// At most this many frames sent and not yet echoed; a full window
    /// delays sends, which the schedule-based latency shows.
    pub window: u64,
}

/// What a paced send did.
#[derive(Debug, Clone)]
pub struct PacedOutcome {
    /// The last sequence sent.
    pub last_seq: u64,
    /// Frames sent.
    pub sent: u64,
    /// How long sending took.
    pub elapsed: Duration,
    /// How late sends were against their schedule, nanoseconds.
    pub lateness: Histogram<u64>,
    /// Whether the connection failed.
    pub failed: bool,
}

/// Sends frames on a fixed schedule (frame `i` at `start + i / rate`),
/// independent of answers (open loop). Each frame carries its send time and
/// its scheduled time. Timers have millisecond resolution, so frames that
/// fall due together go out together, then one flush.
pub async fn paced_sender<S>(
    mut sink: S,
    spec: PaceSpec,
    echoed: Arc<Progress>,
    last_sent: watch::Sender<u64>,
) -> (S, PacedOutcome)
where
    S: Sink<Message, Error = WsError> + Unpin,
{
    let interval_ns = (1e9 / spec.rate.max(1.0)) as u64;
    let total = ((spec.duration.as_secs_f64() * spec.rate) as u64).max(1);
    let start = Instant::now();
    let start_ns = now_ns();
    let mut lateness = latency_histogram();
    let mut failed = false;
    let mut i = 0u64;
    while i < total {
        let due_ns = start_ns + i * interval_ns;
        let now = now_ns();
        if now < due_ns {
            if sink.flush().await.is_err() {
                failed = true;
                break;
            }
            tokio::time::sleep_until(start + Duration::from_nanos(due_ns - start_ns)).await;
            continue;
        }
        let seq = spec.first_seq + i;
        if seq > echoed.get() + spec.window {
            if sink.flush().await.is_err() {
                failed = true;
                break;
            }
            echoed.wait_for(seq - spec.window).await;
            continue;
        }
        let sent = now_ns();
        let _ = lateness.record(sent.saturating_sub(due_ns).max(1));
        if sink
            .feed(Message::Binary(spec.template.frame(seq, sent, due_ns)))
            .await
            .is_err()
        {
            failed = true;
            break;
        }
        i += 1;
    }
    if !failed && sink.flush().await.is_err() {
        failed = true;
    }
    let last_seq = spec.first_seq + i - 1;
    last_sent.send_replace(last_seq);
    (
        sink,
        PacedOutcome {
            last_seq,
            sent: i,
            elapsed: start.elapsed(),
            lateness,
            failed,
        },
    )
}

/// What the echo reader measured.
#[derive(Debug)]
pub struct EchoOutcome {
    /// The check of the up log (echoes).
    pub check: StreamCheck,
    /// Round trip from the actual send, nanoseconds.
    pub rtt: Histogram<u64>,
    /// Round trip from the scheduled send (includes sender queueing: free of
    /// coordinated omission), nanoseconds.
    pub rtt_from_schedule: Histogram<u64>,
    /// Errors, gaps and closes seen.
    pub errors: Vec<String>,
}

/// The caller's reader in the latency trio: checks the echoes on the up
/// log, records round trips, advances `echoed` (in down-log sequences), and
/// stops once the echo of `last_sent` arrived, or on `stop`.
pub async fn echo_reader<S>(
    mut stream: S,
    key: DelegationKey,
    payload_len: usize,
    echoed: Arc<Progress>,
    mut last_sent: watch::Receiver<u64>,
    stop: CancellationToken,
    limits: Limits,
) -> (S, EchoOutcome)
where
    S: Stream<Item = Result<Message, WsError>> + Unpin,
{
    // Up entry n echoes down entry n + 1.
    let mut check = StreamCheck::new(1, payload_len, 1);
    let mut rtt = latency_histogram();
    let mut rtt_from_schedule = latency_histogram();
    let mut errors = Vec::new();
    let mut final_known = false;
    loop {
        if echoed.get() >= *last_sent.borrow_and_update() {
            break;
        }
        let msg = tokio::select! {
            () = stop.cancelled() => break,
            changed = last_sent.changed(), if !final_known => {
                // The sender dropped its end after setting the last value:
                // that value is final; keep reading up to it.
                final_known = changed.is_err();
                continue;
            }
            m = stream.next() => m,
        };
        match read_one(msg, &limits) {
            Read::Frame(Frame::Data(d)) if d.direction == Direction::Up && d.key == key => {
                let now = now_ns();
                if check.observe(d.seq, &d.payload)
                    && let Some((_, sent, scheduled)) = stamp_of(&d.payload)
                {
                    let _ = rtt.record(now.saturating_sub(sent).max(1));
                    let _ = rtt_from_schedule.record(now.saturating_sub(scheduled).max(1));
                }
                echoed.advance(check.contiguous() + 1);
            }
            Read::Frame(f @ (Frame::Error(_) | Frame::Gap(_))) => errors.push(describe(&f)),
            Read::Frame(_) | Read::Skip => {}
            Read::Closed(why) => {
                errors.push(format!("caller connection: {why}"));
                break;
            }
        }
    }
    (
        stream,
        EchoOutcome {
            check,
            rtt,
            rtt_from_schedule,
            errors,
        },
    )
}

/// What the echoing callee saw.
#[derive(Debug)]
pub struct EchoerOutcome {
    /// The check of the down log.
    pub check: StreamCheck,
    /// The last up sequence it sent.
    pub up_seq: u64,
    /// Errors, gaps and closes seen.
    pub errors: Vec<String>,
}

/// The callee of the latency trio: echoes each down `Data` (sequence n) as
/// an up `Data` (sequence n - 1) with the same payload, per batch then one
/// flush, until `stop`.
pub async fn echoer<W: Ws>(
    mut ws: W,
    key: DelegationKey,
    payload_len: usize,
    stop: CancellationToken,
    limits: Limits,
) -> (W, EchoerOutcome) {
    let mut check = StreamCheck::new(2, payload_len, 0);
    let mut up_seq = 0u64;
    let mut errors = Vec::new();
    let mut batch = Vec::with_capacity(MAX_BATCH);
    'outer: loop {
        tokio::select! {
            () = stop.cancelled() => break,
            () = read_batch(&mut ws, &limits, &mut batch) => {}
        }
        let mut fed = false;
        for r in batch.drain(..) {
            match r {
                Read::Frame(Frame::Data(d)) if d.direction == Direction::Down && d.key == key => {
                    if !check.observe(d.seq, &d.payload) {
                        continue;
                    }
                    up_seq += 1;
                    let echo = Frame::Data(Data {
                        key: key.clone(),
                        direction: Direction::Up,
                        seq: up_seq,
                        terminal: None,
                        flags: 0,
                        payload: d.payload,
                    });
                    let Ok(bytes) = encode(&echo) else {
                        errors.push("could not encode an echo".into());
                        break 'outer;
                    };
                    if ws.feed(Message::Binary(bytes)).await.is_err() {
                        errors.push("callee: could not send an echo".into());
                        break 'outer;
                    }
                    fed = true;
                }
                Read::Frame(f @ (Frame::Error(_) | Frame::Gap(_))) => errors.push(describe(&f)),
                Read::Frame(_) | Read::Skip => {}
                Read::Closed(why) => {
                    errors.push(format!("callee connection: {why}"));
                    break 'outer;
                }
            }
        }
        if fed && ws.flush().await.is_err() {
            errors.push("callee: flush failed".into());
            break;
        }
    }
    (
        ws,
        EchoerOutcome {
            check,
            up_seq,
            errors,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::Rewind;

    #[test]
    fn a_refusal_point_is_resent_from_once_and_only_a_later_one_again() {
        let r = Rewind::default();
        assert_eq!(r.take(), None);
        r.ask(100);
        // The same point refused again (every frame of the batches in
        // flight behind it is): no second rewind.
        r.ask(100);
        r.ask(90);
        assert_eq!(r.take(), Some(100));
        assert_eq!(r.take(), None);
        r.ask(100);
        assert_eq!(r.take(), None);
        r.ask(250);
        assert_eq!(r.take(), Some(250));
    }
}
