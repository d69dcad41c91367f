//! `slow-consumer`: one receiver stops reading its socket while other pairs
//! stream through the same relay.
//!
//! `pairs` independent (caller, callee) pairs, each its own peers and
//! delegation, stream paced `Data` frames (open loop, `rate` per second)
//! through the relay for `before + stall + after` seconds. One extra
//! delegation streams to a *stalled* receiver, which stops reading its
//! socket completely for `stall` seconds (longer than the relay's
//! `limits.slow_consumer_ms`, set short in the generated config). The relay's
//! policy (`relay/src/outbox.rs`): a full data queue falls back to replay
//! from the log; a session whose full queue drains nothing for
//! `slow_consumer_ms` is closed with 4001 `slow_consumer`.
//!
//! Measured: (a) whether and how the stalled receiver was disconnected (the
//! close code it finds after the stall, when it reads again), (b) the relay's
//! RSS during the stall (`VmRSS`, sampled every 20 ms; the relay alone in
//! process mode), (c) after the stall the receiver reconnects and resumes
//! from its cursor (`Resume` after the last frame it processed): every frame
//! must arrive exactly once and in order, and (d) the other pairs' one-way
//! latency p99 for frames sent during the stall against frames sent before
//! it. `--check` fails only on lost, duplicated, reordered or corrupt frames.

use parking_lot::Mutex;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures_util::{SinkExt as _, StreamExt as _};
use hdrhistogram::Histogram;
use oab_testkit::raw_client::{RawClient, Target};
use oab_wire::identity::Identity;
use oab_wire::{
    DelegationKey, Direction, Frame, InstanceId, Limits, RequestId, Resume, decode_message, encode,
};
use serde::Serialize;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;
use tokio_util::sync::CancellationToken;

use super::{Common, relay_bin, run_header};
use crate::endpoint::{CalleeRole, PaceSpec, latency_histogram, open_delegation, paced_sender};
use crate::relay::{RelayUnderTest, StoreKind};
use crate::report::{Percentiles, Report, Table, fmt_bytes, fmt_count, fmt_size, fmt_us};
use crate::setup::Setup;
use crate::traffic::{CheckReport, DataTemplate, Progress, StreamCheck, now_ns, stamp_of};

/// Options of the slow-consumer scenario.
#[derive(Debug, Clone, Serialize)]
pub struct SlowConsumerOptions {
    /// The relay's store.
    pub store: StoreKind,
    /// Healthy (caller, callee) pairs streaming meanwhile.
    pub pairs: usize,
    /// Frames per second per healthy pair.
    pub rate: f64,
    /// Payload bytes per healthy pair frame.
    pub size: usize,
    /// Frames per second towards the stalled receiver.
    pub stalled_rate: f64,
    /// Payload bytes per frame towards the stalled receiver (large, so the
    /// socket buffers and the relay's queue fill soon).
    pub stalled_size: usize,
    /// Streaming time before the stall, seconds.
    pub before_seconds: f64,
    /// How long the stalled receiver reads nothing, seconds.
    pub stall_seconds: f64,
    /// Streaming time after the stall, seconds.
    pub after_seconds: f64,
    /// The relay's `limits.slow_consumer_ms` for the run.
    pub slow_consumer_ms: u64,
}

/// One close a receiver saw.
#[derive(Debug, Clone, Serialize)]
pub struct CloseSeen {
    /// The WebSocket close code (`None`: the connection ended without one).
    pub code: Option<u16>,
    /// The close reason or the transport error.
    pub reason: String,
    /// When it was seen, ms after the stall began.
    pub seen_ms_after_stall_start: f64,
    /// The receiver's cursor (last contiguous sequence) at that moment.
    pub cursor: u64,
}

/// One receiver's figures.
#[derive(Debug, Clone, Serialize)]
pub struct ReceiverResult {
    /// `pair-<i>` or `stalled`.
    pub name: String,
    /// Payload bytes per frame.
    pub payload_bytes: usize,
    /// Frames sent (sequences 2..=last_seq).
    pub sent: u64,
    /// The last sequence sent.
    pub last_seq: u64,
    /// The correctness check over the whole run (across reconnects).
    pub check: CheckReport,
    /// One-way delay of frames sent before the stall.
    pub one_way_before: Percentiles,
    /// One-way delay of frames sent during the stall.
    pub one_way_during: Percentiles,
    /// One-way delay of frames sent after the stall.
    pub one_way_after: Percentiles,
    /// Closes seen (each followed by a reconnect and a `Resume`).
    pub closes: Vec<CloseSeen>,
    /// Reconnects done.
    pub reconnects: u32,
    /// From the `Resume` after a reconnect to the first resumed frame, ms.
    pub resume_to_first_frame_ms: Option<f64>,
    /// Protocol errors and gaps seen.
    pub errors: Vec<String>,
}

/// The relay's memory around the stall.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct RssResult {
    /// Whether the samples are the relay's alone (process mode).
    pub relay_only: bool,
    /// Last sample before the stall, bytes.
    pub before_bytes: Option<u64>,
    /// Largest sample from the stall's start to its end plus one second.
    pub max_during_bytes: Option<u64>,
    /// `max_during - before`, bytes (negative: shrank).
    pub max_growth_bytes: Option<i64>,
    /// Last sample of the run, bytes.
    pub end_bytes: Option<u64>,
    /// Samples taken.
    pub samples: usize,
    /// Bytes of frames appended to the stalled delegation's log during the
    /// stall (the durable log grows by design; on the memory store it is
    /// part of the relay's RSS, bounded by `store.max_log_entries`).
    pub stalled_log_bytes_during_stall: u64,
}

/// Runs the scenario.
pub async fn run(opts: &SlowConsumerOptions, common: &Common) -> anyhow::Result<Report> {
    anyhow::ensure!(
        opts.stall_seconds * 1000.0 > opts.slow_consumer_ms as f64,
        "the stall ({} s) must be longer than slow_consumer_ms ({} ms)",
        opts.stall_seconds,
        opts.slow_consumer_ms
    );
    let total = opts.before_seconds + opts.stall_seconds + opts.after_seconds;
    let mut tuning = common.tuning.clone();
    tuning.slow_consumer_ms = Some(opts.slow_consumer_ms.max(1));
    let largest = opts.size.max(opts.stalled_size);
    tuning.max_payload = tuning
        .max_payload
        .max(u32::try_from(largest).unwrap_or(u32::MAX));
    // The stalled log must keep every frame until the receiver resumes:
    // a trimmed entry would be a gap, not a measurement.
    let needed = (opts.stalled_rate * total * 1.25) as u64 + 1024;
    tuning.max_log_entries = tuning.max_log_entries.max(needed);
    let common = Common {
        tuning: tuning.clone(),
        ..common.clone()
    };
    let setup = Setup::with_pairs(0, opts.pairs, tuning)?;
    let limits = setup.config.wire_limits();
    let relay = RelayUnderTest::start(&setup, &common.relay, opts.store, common.redis_persistence)
        .await
        .with_context(|| format!("starting the relay on the {} store", opts.store.name()))?;
    tracing::info!(pid = ?relay.pid(), addr = %relay.addr(), "relay started");
    let outcome = Box::pin(run_streams(opts, &common, &setup, &relay, &limits, total)).await;
    let log = relay.log_tail();
    let relay_pid = relay.pid();
    relay.stop().await;
    let (receivers, rss) = outcome.with_context(|| format!("relay log:\n{log}"))?;
    Ok(build_report(opts, &common, receivers, rss, relay_pid))
}

struct Stream {
    name: String,
    caller: Identity,
    callee: Identity,
    size: usize,
    rate: f64,
    stalled: bool,
}

/// The phase boundaries on the [`now_ns`] clock.
#[derive(Debug, Clone, Copy)]
struct Phases {
    stall_start_ns: u64,
    stall_end_ns: u64,
}

impl Phases {
    fn index(&self, sent_ns: u64) -> usize {
        if sent_ns < self.stall_start_ns {
            0
        } else if sent_ns < self.stall_end_ns {
            1
        } else {
            2
        }
    }
}

async fn run_streams(
    opts: &SlowConsumerOptions,
    common: &Common,
    setup: &Setup,
    relay: &RelayUnderTest,
    limits: &Limits,
    total: f64,
) -> anyhow::Result<(Vec<ReceiverResult>, RssResult)> {
    let mut streams: Vec<Stream> = setup
        .pairs
        .iter()
        .enumerate()
        .map(|(i, (c, e))| Stream {
            name: format!("pair-{i}"),
            caller: c.clone(),
            callee: e.clone(),
            size: opts.size,
            rate: opts.rate,
            stalled: false,
        })
        .collect();
    streams.push(Stream {
        name: "stalled".into(),
        caller: setup.caller.clone(),
        callee: setup.callee.clone(),
        size: opts.stalled_size,
        rate: opts.stalled_rate,
        stalled: true,
    });
    let target = relay.target();
    let run_id = oab_wire::identity::now_ms();
    // Connect and open every delegation first.
    let mut opened = Vec::new();
    for s in &streams {
        let key = DelegationKey::new(
            s.caller.peer.clone(),
            RequestId::new(&format!("slow-{}-{run_id}", s.name)).context("request id")?,
        );
        let callee = RawClient::connect(&target, &s.callee, InstanceId::random())
            .await
            .with_context(|| format!("{}: callee connect", s.name))?;
        let caller = RawClient::connect(&target, &s.caller, InstanceId::random())
            .await
            .with_context(|| format!("{}: caller connect", s.name))?;
        let window = u64::from(caller.welcome.max_in_flight).max(1);
        let (mut a, mut b) = (caller.ws, callee.ws);
        open_delegation(
            &mut a,
            &mut b,
            &key,
            &s.callee.peer,
            CalleeRole::BehindRelay,
            limits,
        )
        .await
        .with_context(|| format!("{}: open", s.name))?;
        opened.push((key, a, b, window));
    }

    let start_ns = now_ns();
    let start = Instant::now();
    let phases = Phases {
        stall_start_ns: start_ns + (opts.before_seconds * 1e9) as u64,
        stall_end_ns: start_ns + ((opts.before_seconds + opts.stall_seconds) * 1e9) as u64,
    };
    let stall_start = start + Duration::from_secs_f64(opts.before_seconds);
    let stall_end = stall_start + Duration::from_secs_f64(opts.stall_seconds);

    // RSS sampler.
    let sampling = CancellationToken::new();
    let samples: Arc<Mutex<Vec<(u64, u64)>>> = Arc::default();
    let sampler = {
        let stop = sampling.clone();
        let samples = samples.clone();
        let pid = relay.pid();
        tokio::spawn(async move {
            let path = pid.map_or_else(
                || "/proc/self/status".to_string(),
                |p| format!("/proc/{p}/status"),
            );
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            loop {
                tokio::select! {
                    () = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                if let Some(rss) = crate::relay::rss_of(&path) {
                    samples.lock().push((now_ns(), rss));
                }
            }
        })
    };

    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for (s, (key, a, b, window)) in streams.iter().zip(opened) {
        let template = DataTemplate::new(&key, Direction::Down, s.size)?;
        let (last_tx, last_rx) = watch::channel(u64::MAX);
        let acked = Arc::new(Progress::new(1));
        let (sink, stream) = a.split();
        let ack_reader = tokio::spawn(ack_reader(
            stream,
            key.clone(),
            acked.clone(),
            stop.clone(),
            *limits,
        ));
        let spec = PaceSpec {
            template,
            first_seq: 2,
            rate: s.rate,
            duration: Duration::from_secs_f64(total),
            window,
        };
        let sender = tokio::spawn(paced_sender(sink, spec, acked, last_tx));
        let ctx = RecvCtx {
            name: s.name.clone(),
            key,
            size: s.size,
            target: target.clone(),
            callee: s.callee.clone(),
            limits: *limits,
            phases,
            stall: s.stalled.then_some((stall_start, stall_end)),
        };
        let receiver = tokio::spawn(receiver(b, ctx, last_rx, stop.clone()));
        tasks.push((s.name.clone(), s.size, sender, ack_reader, receiver));
    }

    let mut results = Vec::new();
    let mut pending = Vec::new();
    for (name, size, sender, ack_reader, receiver) in tasks {
        let (sink, sent) = sender.await.context("a sender task failed")?;
        pending.push((name, size, sink, sent, ack_reader, receiver));
    }
    // Every sender is done: give the receivers the drain time, then stop.
    let deadline = Instant::now() + common.drain;
    let mut joined = Vec::new();
    for (name, size, sink, sent, ack_reader, mut receiver) in pending {
        let r = match tokio::time::timeout_at(deadline, &mut receiver).await {
            Ok(r) => r,
            Err(_) => {
                stop.cancel();
                receiver.await
            }
        };
        joined.push((name, size, sink, sent, ack_reader, r));
    }
    stop.cancel();
    sampling.cancel();
    let _ = sampler.await;
    for (name, size, sink, sent, ack_reader, r) in joined {
        let out = r.context("a receiver task failed")?;
        let ack_errors = ack_reader.await.unwrap_or_default();
        let mut sink = sink;
        let _ = tokio::time::timeout(Duration::from_secs(1), sink.close()).await;
        let mut errors = out.errors;
        errors.extend(ack_errors);
        if sent.failed {
            errors.push("sender: the connection failed".into());
        }
        results.push(ReceiverResult {
            name,
            payload_bytes: size,
            sent: sent.sent,
            last_seq: sent.last_seq,
            check: out.check.report(2, sent.last_seq),
            one_way_before: Percentiles::of(&out.one_way[0]),
            one_way_during: Percentiles::of(&out.one_way[1]),
            one_way_after: Percentiles::of(&out.one_way[2]),
            closes: out.closes,
            reconnects: out.reconnects,
            resume_to_first_frame_ms: out.resume_to_first_frame_ms,
            errors,
        });
    }

    let samples = std::mem::take(&mut *samples.lock());
    let before = samples
        .iter()
        .filter(|(t, _)| *t < phases.stall_start_ns)
        .map(|(_, r)| *r)
        .next_back();
    let max_during = samples
        .iter()
        .filter(|(t, _)| *t >= phases.stall_start_ns && *t < phases.stall_end_ns + 1_000_000_000)
        .map(|(_, r)| *r)
        .max();
    let frame_len = DataTemplate::new(
        &DelegationKey::new(
            setup.caller.peer.clone(),
            RequestId::new("size-probe").context("request id")?,
        ),
        Direction::Down,
        opts.stalled_size,
    )?
    .frame_len() as u64;
    let rss = RssResult {
        relay_only: relay.rss_is_relay_only(),
        before_bytes: before,
        max_during_bytes: max_during,
        max_growth_bytes: before
            .zip(max_during)
            .map(|(b, m)| i64::try_from(m).unwrap_or(i64::MAX) - i64::try_from(b).unwrap_or(0)),
        end_bytes: samples.last().map(|(_, r)| *r),
        samples: samples.len(),
        stalled_log_bytes_during_stall: (opts.stalled_rate * opts.stall_seconds) as u64 * frame_len,
    };
    Ok((results, rss))
}

/// Reads the caller's socket: acknowledgements advance `acked`.
async fn ack_reader<S>(
    mut stream: S,
    key: DelegationKey,
    acked: Arc<Progress>,
    stop: CancellationToken,
    limits: Limits,
) -> Vec<String>
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    let mut errors = Vec::new();
    loop {
        let msg = tokio::select! {
            () = stop.cancelled() => break,
            m = stream.next() => m,
        };
        match msg {
            Some(Ok(Message::Binary(b))) => match decode_message(b, &limits) {
                Ok(Frame::Ack(a)) if a.key == key && a.direction == Direction::Down => {
                    acked.advance(a.seq);
                }
                Ok(Frame::Error(e)) => {
                    errors.push(format!("caller: error {}: {}", e.code, e.message))
                }
                Ok(_) => {}
                Err(e) => {
                    errors.push(format!("caller: undecodable frame: {e}"));
                    break;
                }
            },
            Some(Ok(Message::Close(c))) => {
                errors.push(format!(
                    "caller: closed {}",
                    c.map_or(0, |c| u16::from(c.code))
                ));
                break;
            }
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                errors.push(format!("caller: websocket: {e}"));
                break;
            }
            None => break,
        }
    }
    errors
}

struct RecvCtx {
    name: String,
    key: DelegationKey,
    size: usize,
    target: Target,
    callee: Identity,
    limits: Limits,
    phases: Phases,
    /// For the stalled receiver: stop reading from .0 to .1.
    stall: Option<(Instant, Instant)>,
}

struct RecvOutcome {
    check: StreamCheck,
    one_way: [Histogram<u64>; 3],
    closes: Vec<CloseSeen>,
    reconnects: u32,
    resume_to_first_frame_ms: Option<f64>,
    errors: Vec<String>,
}

type RelayWs = tokio_tungstenite::WebSocketStream<oab_testkit::raw_client::Io>;

/// A callee: checks every frame; the stalled one stops reading during its
/// stall; after any close it reconnects and resumes from its cursor.
async fn receiver(
    mut ws: RelayWs,
    ctx: RecvCtx,
    mut last_sent: watch::Receiver<u64>,
    stop: CancellationToken,
) -> RecvOutcome {
    let mut check = StreamCheck::new(2, ctx.size, 0);
    let mut one_way = [
        latency_histogram(),
        latency_histogram(),
        latency_histogram(),
    ];
    let mut closes = Vec::new();
    let mut errors = Vec::new();
    let mut reconnects = 0u32;
    let mut resume_to_first_frame_ms = None;
    let mut resumed_at: Option<Instant> = None;
    let mut stall = ctx.stall;
    let mut final_known = false;
    loop {
        if check.contiguous() >= *last_sent.borrow_and_update() {
            break;
        }
        let stall_at = stall.map(|(s, _)| s);
        let msg = tokio::select! {
            () = stop.cancelled() => break,
            changed = last_sent.changed(), if !final_known => {
                final_known = changed.is_err();
                continue;
            }
            () = async { if let Some(at) = stall_at { tokio::time::sleep_until(at).await } }, if stall_at.is_some() => {
                if let Some((_, end)) = stall.take() {
                    tracing::info!(receiver = %ctx.name, "stalled: reading nothing");
                    tokio::select! {
                        () = stop.cancelled() => break,
                        () = tokio::time::sleep_until(end) => {}
                    }
                    tracing::info!(receiver = %ctx.name, "reading again");
                }
                continue;
            }
            m = ws.next() => m,
        };
        let closed = match msg {
            Some(Ok(Message::Binary(b))) => match decode_message(b, &ctx.limits) {
                Ok(Frame::Data(d)) if d.direction == Direction::Down && d.key == ctx.key => {
                    let now = now_ns();
                    if let Some(at) = resumed_at.take() {
                        resume_to_first_frame_ms.get_or_insert(at.elapsed().as_secs_f64() * 1e3);
                    }
                    if check.observe(d.seq, &d.payload)
                        && let Some((_, sent, _)) = stamp_of(&d.payload)
                    {
                        let phase = ctx.phases.index(sent);
                        if let Some(h) = one_way.get_mut(phase) {
                            let _ = h.record(now.saturating_sub(sent).max(1));
                        }
                    }
                    None
                }
                Ok(Frame::Error(e)) => {
                    errors.push(format!("error {}: {}", e.code, e.message));
                    None
                }
                Ok(Frame::Gap(g)) => {
                    errors.push(format!("gap after {} ({})", g.after, g.reason.name()));
                    None
                }
                Ok(_) => None,
                Err(e) => Some((None, format!("undecodable frame: {e}"))),
            },
            Some(Ok(Message::Close(c))) => Some(match c {
                Some(c) => (Some(u16::from(c.code)), c.reason.to_string()),
                None => (None, "close without a code".into()),
            }),
            Some(Ok(_)) => None,
            Some(Err(e)) => Some((None, format!("websocket: {e}"))),
            None => Some((None, "connection ended".into())),
        };
        let Some((code, reason)) = closed else {
            continue;
        };
        let seen = now_ns() as f64 - ctx.phases.stall_start_ns as f64;
        tracing::info!(receiver = %ctx.name, ?code, %reason, cursor = check.contiguous(), "receiver closed; reconnecting");
        closes.push(CloseSeen {
            code,
            reason,
            seen_ms_after_stall_start: seen / 1e6,
            cursor: check.contiguous(),
        });
        if closes.len() > 20 {
            errors.push("more than 20 closes: giving up".into());
            break;
        }
        match reconnect(&ctx, check.contiguous()).await {
            Ok(new) => {
                ws = new;
                reconnects += 1;
                resumed_at = Some(Instant::now());
            }
            Err(e) => {
                errors.push(format!("reconnect: {e:#}"));
                break;
            }
        }
    }
    let _ = tokio::time::timeout(Duration::from_secs(1), ws.close(None)).await;
    RecvOutcome {
        check,
        one_way,
        closes,
        reconnects,
        resume_to_first_frame_ms,
        errors,
    }
}

async fn reconnect(ctx: &RecvCtx, after: u64) -> anyhow::Result<RelayWs> {
    let mut attempt = 0u32;
    let mut client = loop {
        match RawClient::connect(&ctx.target, &ctx.callee, InstanceId::random()).await {
            Ok(c) => break c,
            Err(e) if attempt < 20 => {
                attempt += 1;
                tracing::debug!(error = %e, "reconnect failed; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e).context("connecting again"),
        }
    };
    let resume = Frame::Resume(Resume {
        key: ctx.key.clone(),
        direction: Direction::Down,
        after,
    });
    client
        .ws
        .send(Message::Binary(encode(&resume)?))
        .await
        .context("sending the resume")?;
    Ok(client.ws)
}

fn build_report(
    opts: &SlowConsumerOptions,
    common: &Common,
    receivers: Vec<ReceiverResult>,
    rss: RssResult,
    relay_pid: Option<u32>,
) -> Report {
    let mut violations = Vec::new();
    for r in &receivers {
        violations.extend(r.check.violations(&r.name));
    }
    // The healthy pairs together, before and during the stall.
    let merged = |phase: usize| -> (f64, u64) {
        let mut p99s = Vec::new();
        let mut n = 0;
        for r in receivers.iter().filter(|r| r.name != "stalled") {
            let p = match phase {
                0 => r.one_way_before,
                _ => r.one_way_during,
            };
            if p.count > 0 {
                p99s.push(p.p99_us);
                n += p.count;
            }
        }
        // The worst pair's p99 (histograms are per pair).
        (p99s.into_iter().fold(0.0, f64::max), n)
    };
    let (p99_before, _) = merged(0);
    let (p99_during, _) = merged(1);
    let ratio = (p99_before > 0.0).then(|| p99_during / p99_before);
    let stalled = receivers.iter().find(|r| r.name == "stalled");
    let first_close = stalled.and_then(|s| s.closes.first());
    let disconnect = match first_close {
        Some(c) if c.code == Some(4001) => "closed with 4001 slow_consumer".to_string(),
        Some(c) => format!(
            "closed {} ({})",
            c.code.map_or("without a code".into(), |c| c.to_string()),
            c.reason
        ),
        None => "never cut: the relay switched it to replay from the log".to_string(),
    };

    let mut table = Table::new(
        format!(
            "slow-consumer: {} pairs at {}/s x {}, one receiver stalled {} s (slow_consumer_ms {}), {} store",
            opts.pairs,
            fmt_count(opts.rate),
            fmt_size(opts.size),
            opts.stall_seconds,
            opts.slow_consumer_ms,
            opts.store.name()
        ),
        &[
            "receiver",
            "payload",
            "frames",
            "p99 before",
            "p99 during",
            "p99 after",
            "during/before",
            "closes",
            "lost",
            "dup",
            "reord",
            "errors",
        ],
    );
    for r in &receivers {
        let ratio = (r.one_way_before.p99_us > 0.0 && r.one_way_during.count > 0)
            .then(|| r.one_way_during.p99_us / r.one_way_before.p99_us);
        table.row(vec![
            r.name.clone(),
            fmt_size(r.payload_bytes),
            fmt_count(r.check.received as f64),
            fmt_us(r.one_way_before.p99_us),
            fmt_us(r.one_way_during.p99_us),
            fmt_us(r.one_way_after.p99_us),
            ratio.map_or("-".into(), |v| format!("{v:.2}x")),
            r.closes
                .iter()
                .map(|c| c.code.map_or("-".into(), |c| c.to_string()))
                .collect::<Vec<_>>()
                .join(","),
            r.check.lost.to_string(),
            r.check.duplicated.to_string(),
            r.check.reordered.to_string(),
            r.errors.len().to_string(),
        ]);
    }
    let mut summary = Table::new("slow-consumer: summary", &["measure", "value"]);
    summary.row(vec!["(a) stalled receiver".into(), disconnect.clone()]);
    let opt_bytes = |b: Option<u64>| b.map_or("-".into(), fmt_bytes);
    summary.row(vec![
        format!(
            "(b) relay RSS before / max during (+1 s){}",
            if rss.relay_only {
                ""
            } else {
                " [in-process: tool+relay]"
            }
        ),
        format!(
            "{} / {}",
            opt_bytes(rss.before_bytes),
            opt_bytes(rss.max_during_bytes)
        ),
    ]);
    summary.row(vec![
        "(b) relay RSS max growth".into(),
        rss.max_growth_bytes.map_or("-".into(), |g| {
            let s = fmt_bytes(g.unsigned_abs());
            if g < 0 {
                format!("-{s}")
            } else {
                format!("+{s}")
            }
        }),
    ]);
    summary.row(vec![
        "(b) stalled log appended during stall".into(),
        fmt_bytes(rss.stalled_log_bytes_during_stall),
    ]);
    summary.row(vec![
        "(c) stalled receiver after resume".into(),
        stalled.map_or("-".into(), |s| {
            format!(
                "{} of {} frames, lost {}, dup {}, reord {}; {} reconnect(s); resume->first frame {}",
                fmt_count(s.check.received as f64),
                fmt_count(s.sent as f64),
                s.check.lost,
                s.check.duplicated,
                s.check.reordered,
                s.reconnects,
                s.resume_to_first_frame_ms
                    .map_or("-".into(), |ms| format!("{ms:.1} ms"))
            )
        }),
    ]);
    summary.row(vec![
        "(d) pairs' worst one-way p99 before / during".into(),
        format!("{} / {}", fmt_us(p99_before), fmt_us(p99_during)),
    ]);
    summary.row(vec![
        "(d) during / before (target <= 1.10x)".into(),
        ratio.map_or("-".into(), |r| format!("{r:.2}x")),
    ]);

    let mut json = run_header("slow-consumer", common, relay_bin(common).as_deref());
    if let Some(obj) = json.as_object_mut() {
        obj.insert(
            "params".into(),
            serde_json::to_value(opts).unwrap_or_default(),
        );
        obj.insert("relay_pid".into(), serde_json::json!(relay_pid));
        obj.insert(
            "result".into(),
            serde_json::json!({
                "stalled_disconnect": disconnect,
                "stalled_close_code": first_close.and_then(|c| c.code),
                "stalled_closed_4001": first_close.is_some_and(|c| c.code == Some(4001)),
                "stalled_cut": first_close.is_some(),
                "rss": rss,
                "pairs_p99_before_us": p99_before,
                "pairs_p99_during_us": p99_during,
                "pairs_p99_during_over_before": ratio,
                "pairs_p99_target_ratio": 1.10,
            }),
        );
        obj.insert(
            "receivers".into(),
            serde_json::to_value(&receivers).unwrap_or_default(),
        );
    }
    Report {
        scenario: "slow-consumer",
        tables: vec![table, summary],
        notes: vec![
            "one-way: send stamp to receipt on one clock; before/during/after by the frame's \
             send time against the stall window. during/before: p99 of frames sent during the \
             stall over p99 of frames sent before it (pairs: the worst pair's p99)."
                .into(),
            "the stalled receiver stops reading its socket; it sees the relay's close only when \
             it reads again after the stall, then reconnects and sends Resume after its last \
             in-order frame. --check fails on lost/duplicated/reordered/corrupt frames only."
                .into(),
        ],
        json,
        violations,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_split_by_send_time() {
        let p = Phases {
            stall_start_ns: 100,
            stall_end_ns: 200,
        };
        assert_eq!(p.index(99), 0);
        assert_eq!(p.index(100), 1);
        assert_eq!(p.index(199), 1);
        assert_eq!(p.index(200), 2);
    }
}
