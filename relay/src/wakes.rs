//! Polling a session's halves in one task without waking it from inside
//! its own poll.
//!
//! A session is one task that polls its reader and its writer together.
//! When the reader queues an ack on the session's own control lane, the
//! lane wakes the writer's waker, which is the task's: the task is woken
//! while it runs. Tokio reschedules such a task as if it had yielded, to
//! the back of the run queue, and wakes an idle worker thread to steal it
//! (a `futex` wake, and the sleeping thread's wake-up on another vCPU),
//! although the writer is polled in the same pass and has already written
//! the ack. On an idle relay that was one spurious thread wake-up per
//! relayed frame, about half of the relay's `futex` calls.
//!
//! [`coalesce_wakes`] gives the inner future a waker of its own: a wake
//! that arrives while the inner future is being polled (from this thread
//! or from another) only marks it to be polled again before the poll
//! returns; a wake at any other time wakes the task as usual. The re-polls
//! are bounded ([`MAX_REPOLLS`]): past them, or when the task's cooperative
//! budget is spent, the task is woken as usual and yields, so a busy
//! session never starves the others on its worker thread.
//!
//! Never: loses a wake. A wake that lands just as the poll ends either is
//! seen by the poll (which polls again) or finds the poll over and wakes
//! the task; both may happen, which costs one spurious poll, never a missed
//! one (the order of the two flags' stores and loads is sequentially
//! consistent).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, Wake, Waker};

use futures_util::task::AtomicWaker;

/// Polls of the inner future in one poll of the task, at most: a wake
/// during the last of them wakes the task (it yields and runs again later).
pub const MAX_REPOLLS: usize = 4;

#[derive(Default)]
struct Shared {
    /// The inner future is being polled.
    polling: AtomicBool,
    /// Woken since the current poll of the inner future began.
    woken: AtomicBool,
    /// The task's own waker, registered at every poll.
    task: AtomicWaker,
}

impl Wake for Shared {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.store(true, Ordering::SeqCst);
        if !self.polling.load(Ordering::SeqCst) {
            self.task.wake();
        }
    }
}

/// Runs `inner`, coalescing the wakes it receives while it is being polled
/// into re-polls within the same poll (see the module docs).
pub async fn coalesce_wakes<F: Future>(inner: F) -> F::Output {
    let shared = Arc::new(Shared::default());
    let waker = Waker::from(shared.clone());
    let mut inner = std::pin::pin!(inner);
    std::future::poll_fn(move |cx| {
        shared.task.register(cx.waker());
        let mut inner_cx = Context::from_waker(&waker);
        for _ in 0..MAX_REPOLLS {
            shared.woken.store(false, Ordering::SeqCst);
            shared.polling.store(true, Ordering::SeqCst);
            let polled = inner.as_mut().poll(&mut inner_cx);
            shared.polling.store(false, Ordering::SeqCst);
            if polled.is_ready() {
                return polled;
            }
            if !shared.woken.load(Ordering::SeqCst) {
                // Not woken during the poll; a wake from now on finds
                // `polling` false and wakes the task.
                return Poll::Pending;
            }
            if !tokio::task::coop::has_budget_remaining() {
                break;
            }
        }
        // Woken during the last poll allowed (or out of budget): yield.
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Counts the wakes of the task that polls it.
    #[derive(Default)]
    struct CountingWaker(AtomicUsize);

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn poll_once<F: Future + Unpin>(f: &mut F, counter: &Arc<CountingWaker>) -> Poll<F::Output> {
        let waker = Waker::from(counter.clone());
        std::pin::Pin::new(f).poll(&mut Context::from_waker(&waker))
    }

    #[tokio::test]
    async fn a_wake_during_the_poll_polls_again_without_waking_the_task() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(4);
        let polls = Arc::new(AtomicUsize::new(0));
        let p = polls.clone();
        // Polled: registers interest in the channel, then (first poll only)
        // sends to it, which wakes its own waker from inside the poll.
        let mut tx = Some(tx);
        let inner = std::future::poll_fn(move |cx| {
            p.fetch_add(1, Ordering::SeqCst);
            match rx.poll_recv(cx) {
                Poll::Ready(Some(v)) => return Poll::Ready(v),
                Poll::Ready(None) => return Poll::Ready(0),
                Poll::Pending => {}
            }
            if let Some(tx) = tx.take() {
                let _ = tx.try_send(7);
            }
            Poll::Pending
        });
        let mut fut = Box::pin(coalesce_wakes(inner));
        let counter = Arc::new(CountingWaker::default());
        assert_eq!(poll_once(&mut fut, &counter), Poll::Ready(7));
        assert_eq!(
            polls.load(Ordering::SeqCst),
            2,
            "polled again in the same poll"
        );
        assert_eq!(
            counter.0.load(Ordering::SeqCst),
            0,
            "the task was not woken"
        );
    }

    #[tokio::test]
    async fn a_wake_after_the_poll_wakes_the_task() {
        let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(4);
        let inner = std::future::poll_fn(move |cx| rx.poll_recv(cx));
        let mut fut = Box::pin(coalesce_wakes(inner));
        let counter = Arc::new(CountingWaker::default());
        assert_eq!(poll_once(&mut fut, &counter), Poll::Pending);
        assert_eq!(counter.0.load(Ordering::SeqCst), 0);
        tx.send(3).await.expect("receiver alive");
        assert_eq!(counter.0.load(Ordering::SeqCst), 1, "woken once");
        assert_eq!(poll_once(&mut fut, &counter), Poll::Ready(Some(3)));
    }

    #[tokio::test]
    async fn a_future_that_keeps_waking_itself_yields_after_the_bound() {
        let polls = Arc::new(AtomicUsize::new(0));
        let p = polls.clone();
        let inner = std::future::poll_fn(move |cx: &mut Context<'_>| {
            p.fetch_add(1, Ordering::SeqCst);
            cx.waker().wake_by_ref();
            Poll::<()>::Pending
        });
        let mut fut = Box::pin(coalesce_wakes(inner));
        let counter = Arc::new(CountingWaker::default());
        assert_eq!(poll_once(&mut fut, &counter), Poll::Pending);
        assert_eq!(polls.load(Ordering::SeqCst), MAX_REPOLLS);
        assert_eq!(
            counter.0.load(Ordering::SeqCst),
            1,
            "woken to run again later"
        );
    }

    #[test]
    fn a_wake_from_another_thread_is_never_lost() {
        // A second thread wakes the inner future while the task polls it
        // over and over: every wake is either seen by a poll or wakes the
        // task, so the receiver always gets every value.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let (tx, mut rx) = tokio::sync::mpsc::channel::<u32>(1);
            let sender = tokio::spawn(async move {
                for i in 0..20_000 {
                    if tx.send(i).await.is_err() {
                        break;
                    }
                }
            });
            let receiver = tokio::spawn(coalesce_wakes(async move {
                let mut n = 0u32;
                while let Some(v) = rx.recv().await {
                    assert_eq!(v, n);
                    n += 1;
                }
                n
            }));
            // A lost wake leaves the receiver waiting forever.
            let got = tokio::time::timeout(std::time::Duration::from_secs(60), receiver)
                .await
                .expect("a wake was lost: the receiver stopped")
                .expect("receiver task");
            sender.await.expect("sender task");
            assert_eq!(got, 20_000);
        });
    }
}
