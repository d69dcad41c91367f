//! Busy polling: an opt-in trade of CPU for latency at low load, for a
//! process that relays frames (`oab-relay --busy-poll-us`, `oab-connector
//! run --busy-poll-us`; off by default).
//!
//! At low load most of a hop's time is not the work on the frame but the
//! wake-up of an idle CPU: a frame arrives, the kernel wakes the async worker
//! blocked in `epoll_wait`, and on a virtual machine whose idle vCPUs halt
//! (no guest halt polling) that wake-up costs tens of microseconds, once per
//! hop. With busy polling on, every frame batch the process reads ([`touch`])
//! keeps one task, the *poller*, spinning for the window after it: the
//! poller yields to the runtime in a loop, and each time it yields the
//! worker polls its I/O driver without blocking, so a frame that arrives
//! within the window (the answer to the frame just sent on, the next frame
//! of a burst) is read by a worker that is already running. Each turn also
//! yields the CPU to the kernel (`sched_yield`), so a process woken on the
//! same CPU (another process on a shared host) runs at once instead of
//! waiting for the spinning thread's time slice to end. Past the window the
//! poller sleeps until the next frame batch, so an idle process spends
//! nothing on it. HAProxy's `busy-polling` makes the same trade for the same
//! reason.
//!
//! The cost is CPU: the worker stays busy for the window after each batch,
//! so at `r` batches per second with a window `w` the poller takes up to
//! `r × w` of one core, all of it once batches come closer together than
//! the window. It helps only while the poller's worker is the one polling
//! the I/O driver: with one async worker thread that is always so; with
//! more, an idle worker can block in the driver and take the wake-up
//! instead. Measured in `BENCHMARKS.md` ("Busy polling").

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// The largest window accepted (10 ms): past it busy polling is a spinning
/// core in all but name.
pub const MAX_WINDOW: Duration = Duration::from_millis(10);

/// A poller: spins for `window` after each [`Poller::touch`], sleeps
/// otherwise. A process has at most one ([`start`], [`touch`]).
#[derive(Debug)]
pub struct Poller {
    window_ns: u64,
    epoch: Instant,
    /// Nanoseconds since `epoch` of the latest touch.
    last: AtomicU64,
    /// Set while the poller sleeps (or is about to): the next touch wakes it.
    idle: AtomicBool,
    wake: Notify,
    /// Turns of the spin loop so far.
    turns: AtomicU64,
    /// Times it woke from sleep.
    wakes: AtomicU64,
}

static POLLER: OnceLock<Poller> = OnceLock::new();

impl Poller {
    /// A poller with `window` (capped at [`MAX_WINDOW`]), asleep until its
    /// first touch.
    pub fn new(window: Duration) -> Self {
        let window = window.min(MAX_WINDOW);
        Poller {
            window_ns: u64::try_from(window.as_nanos()).unwrap_or(u64::MAX),
            epoch: Instant::now(),
            last: AtomicU64::new(0),
            idle: AtomicBool::new(true),
            wake: Notify::new(),
            turns: AtomicU64::new(0),
            wakes: AtomicU64::new(0),
        }
    }

    fn ns_at(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    fn in_window(&self) -> bool {
        self.ns_at(Instant::now())
            .saturating_sub(self.last.load(Ordering::Relaxed))
            <= self.window_ns
    }

    /// Frames arrived at `at`: spin for the window after it.
    pub fn touch(&self, at: Instant) {
        self.last.fetch_max(self.ns_at(at), Ordering::Relaxed);
        if self.idle.load(Ordering::Relaxed) && self.idle.swap(false, Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }

    /// Whether the poller is asleep (or about to be): no touch within its
    /// window.
    pub fn is_idle(&self) -> bool {
        self.idle.load(Ordering::SeqCst)
    }

    /// Turns of the spin loop so far.
    pub fn turns(&self) -> u64 {
        self.turns.load(Ordering::Relaxed)
    }

    /// Times it woke from sleep so far.
    pub fn wakes(&self) -> u64 {
        self.wakes.load(Ordering::Relaxed)
    }

    /// The poller's loop; runs for ever (spawn it on the runtime whose
    /// driver it should keep polling).
    pub async fn run(&self) {
        loop {
            // Asleep (`idle` set) until a touch unsets `idle` and notifies:
            // each sleep takes exactly one such notification, kept as a
            // permit when the touch came first.
            self.wake.notified().await;
            self.wakes.fetch_add(1, Ordering::Relaxed);
            loop {
                // Spin while touches keep coming.
                while self.in_window() {
                    self.turns.fetch_add(1, Ordering::Relaxed);
                    std::thread::yield_now();
                    tokio::task::yield_now().await;
                }
                self.idle.store(true, Ordering::SeqCst);
                // A touch between the check and the store saw `idle` unset
                // and did not notify: look once more before sleeping, and
                // spin on if it was in time (then nobody notifies).
                if self.in_window() && self.idle.swap(false, Ordering::SeqCst) {
                    continue;
                }
                break;
            }
        }
    }
}

/// Starts the process's poller on the current runtime with `window`; nothing
/// when `window` is zero. Call once, from inside the runtime; a second call
/// changes nothing and returns `false`.
pub fn start(window: Duration) -> bool {
    if window.is_zero() || POLLER.set(Poller::new(window)).is_err() {
        return false;
    }
    let Some(poller) = POLLER.get() else {
        return false;
    };
    tokio::spawn(poller.run());
    true
}

/// A frame batch was read at `at`: keeps the process's poller spinning for
/// the window after it (one atomic load when busy polling is off).
pub fn touch(at: Instant) {
    if let Some(p) = POLLER.get() {
        p.touch(at);
    }
}

/// Parses a window in microseconds for a command-line flag: empty (an empty
/// environment variable) or `0` is off, at most [`MAX_WINDOW`].
pub fn parse_window(s: &str) -> Result<Duration, String> {
    let max = u64::try_from(MAX_WINDOW.as_micros()).unwrap_or(u64::MAX);
    if s.trim().is_empty() {
        return Ok(Duration::ZERO);
    }
    match s.trim().parse::<u64>() {
        Ok(n) if n <= max => Ok(Duration::from_micros(n)),
        _ => Err(format!(
            "expected microseconds from 0 (off) to {max}, got {s:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
    use super::*;
    use std::sync::Arc;

    /// Waits (bounded) until `cond` holds, yielding to the runtime.
    async fn until(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting: {what}");
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_touch_spins_the_poller_for_its_window_then_it_sleeps() {
        let poller = Arc::new(Poller::new(Duration::from_millis(5)));
        let task = tokio::spawn({
            let p = poller.clone();
            async move { p.run().await }
        });
        // Untouched, it sleeps: other tasks run and it takes no turn.
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(poller.turns(), 0);
        assert!(poller.is_idle());

        let touched = Instant::now();
        poller.touch(touched);
        assert!(!poller.is_idle());
        until("the poller spins", || poller.turns() > 10).await;
        until("the poller sleeps again", || poller.is_idle()).await;
        // It went to sleep only once the window had passed.
        assert!(touched.elapsed() >= Duration::from_millis(5));
        let turns = poller.turns();
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert_eq!(poller.turns(), turns, "an idle poller kept spinning");
        task.abort();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sleeping_poller_wakes_for_every_touch_from_another_thread() {
        // A window so short that the poller is back asleep after each touch.
        let poller = Arc::new(Poller::new(Duration::from_micros(1)));
        let task = tokio::spawn({
            let p = poller.clone();
            async move { p.run().await }
        });
        for _ in 0..2_000 {
            until("the poller sleeps", || poller.is_idle()).await;
            let (wakes, turns) = (poller.wakes(), poller.turns());
            let p = poller.clone();
            std::thread::spawn(move || p.touch(Instant::now()))
                .join()
                .unwrap();
            // The touch found it asleep: it wakes, unless it was still
            // checking its window on the way to sleep and took the touch as
            // another turn instead.
            until("a touched poller wakes or turns", || {
                poller.wakes() > wakes || poller.turns() > turns
            })
            .await;
        }
        assert!(poller.wakes() > 0);
        task.abort();
    }

    #[test]
    fn a_flag_value_is_microseconds_up_to_the_cap() {
        assert_eq!(parse_window("").unwrap(), Duration::ZERO);
        assert_eq!(parse_window("0").unwrap(), Duration::ZERO);
        assert_eq!(parse_window(" 250 ").unwrap(), Duration::from_micros(250));
        assert_eq!(parse_window("10000").unwrap(), MAX_WINDOW);
        for bad in ["10001", "-1", "2ms", "1e3"] {
            let e = parse_window(bad).unwrap_err();
            assert!(e.contains("from 0 (off) to 10000"), "{bad}: {e}");
        }
        // Zero starts nothing.
        assert!(!start(Duration::ZERO));
    }

    #[test]
    fn the_window_is_capped() {
        let p = Poller::new(Duration::from_secs(5));
        assert_eq!(p.window_ns, u64::try_from(MAX_WINDOW.as_nanos()).unwrap());
    }
}
