//! Save completion handles: blocking waits and `Future`s over one shared
//! completion cell.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use super::state::Shared;
use super::wait::WATCH_TICK;
use super::SaveReport;
use crate::error::{Error, Result};
use crate::io::IoKind;

/// The completion handle of a save. Also a [`Future`].
///
/// Its waits watch the flush: when it makes no progress for the engine's
/// stall timeout, they fail with [`Error::Timeout`] naming what is stuck
/// (the save may still finish later; wait again, or await a clone of the
/// handle, to see it). An awaited handle is polled again every 100 ms
/// while it is pending (a thread of this crate wakes it) to look, so an
/// `.await` on a save whose storage hangs ends as a blocking wait does
/// instead of pending forever.
#[derive(Debug, Clone)]
pub struct SaveHandle {
    done: Arc<Completion>,
    /// The engine whose flush to watch, while it lives.
    watch: Option<Weak<Shared>>,
    /// Whether this handle was polled as a future and found pending: the
    /// watchdog is consulted from the next poll on (a flush that just got
    /// going again gets a tick to say so, as in the blocking waits).
    polled: bool,
}

/// The shared completion cell of one save.
#[derive(Debug)]
pub(crate) struct Completion {
    pub(crate) step: u64,
    state: Mutex<CompletionState>,
    cv: Condvar,
}

#[derive(Debug, Default)]
struct CompletionState {
    result: Option<Result<SaveReport>>,
    wakers: Vec<Waker>,
}

impl Completion {
    pub(crate) fn new(step: u64) -> Arc<Completion> {
        Arc::new(Completion {
            step,
            state: Mutex::new(CompletionState::default()),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, CompletionState> {
        // A poisoned lock only means a waiter panicked; the cell stays valid.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets the result once; later calls are ignored.
    pub(crate) fn complete(&self, result: Result<SaveReport>) {
        let wakers = {
            let mut st = self.lock();
            if st.result.is_some() {
                return;
            }
            st.result = Some(result);
            std::mem::take(&mut st.wakers)
        };
        self.cv.notify_all();
        for w in wakers {
            w.wake();
        }
    }

    fn peek(&self) -> Option<Result<SaveReport>> {
        self.lock().result.as_ref().map(clone_result)
    }

    fn wait_until(&self, deadline: Option<Instant>) -> Option<Result<SaveReport>> {
        let mut st = self.lock();
        loop {
            if let Some(r) = &st.result {
                return Some(clone_result(r));
            }
            match deadline {
                None => {
                    st = self
                        .cv
                        .wait(st)
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                }
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return None;
                    }
                    st = self
                        .cv
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .0;
                }
            }
        }
    }
}

fn clone_result(r: &Result<SaveReport>) -> Result<SaveReport> {
    match r {
        Ok(rep) => Ok(rep.clone()),
        Err(e) => Err(e.duplicate()),
    }
}

impl SaveHandle {
    pub(crate) fn from_completion(c: Arc<Completion>) -> SaveHandle {
        SaveHandle {
            done: c,
            watch: None,
            polled: false,
        }
    }

    /// A handle whose waits watch `engine`'s flush for progress.
    pub(super) fn watched(c: Arc<Completion>, engine: Weak<Shared>) -> SaveHandle {
        SaveHandle {
            done: c,
            watch: Some(engine),
            polled: false,
        }
    }

    /// The watchdog's error when the engine's flush is stuck.
    fn stuck(&self) -> Option<Error> {
        let shared = self.watch.as_ref()?.upgrade()?;
        let mut st = shared.lock();
        shared.stuck(&mut st)
    }

    /// A handle for a save skipped by the policy.
    #[must_use]
    pub fn skipped(step: u64) -> SaveHandle {
        let c = Completion::new(step);
        c.complete(Ok(SaveReport {
            step,
            skipped: true,
            bytes: 0,
            stored_bytes: 0,
            reused_chunks: 0,
            reused_bytes: 0,
            stall_secs: 0.0,
            slot_wait_secs: 0.0,
            queue_secs: 0.0,
            replica_wait_secs: 0.0,
            flush_secs: 0.0,
            commit_secs: 0.0,
            total_secs: 0.0,
            io: IoKind::Psync,
            direct: false,
            outcome: super::Outcome::Skipped,
        }));
        SaveHandle::from_completion(c)
    }

    /// The step.
    #[must_use]
    pub fn step(&self) -> u64 {
        self.done.step
    }

    /// Whether the save has finished (committed, failed or skipped).
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.done.peek().is_some()
    }

    /// Blocks until the step is committed.
    ///
    /// # Errors
    /// The error that stopped the save; [`Error::Timeout`] naming what is
    /// stuck when the flush makes no progress for the stall timeout.
    pub fn wait(&self) -> Result<SaveReport> {
        loop {
            if let Some(r) = self.done.wait_until(Some(Instant::now() + WATCH_TICK)) {
                return r;
            }
            if let Some(e) = self.stuck() {
                return Err(e);
            }
        }
    }

    /// Like [`SaveHandle::wait`], at most `timeout`; `Ok(None)` when still
    /// running. A zero timeout only polls (the watchdog is not consulted).
    ///
    /// # Errors
    /// The error that stopped the save; the watchdog's [`Error::Timeout`].
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Option<SaveReport>> {
        let start = Instant::now();
        loop {
            let left = timeout.saturating_sub(start.elapsed());
            if let Some(r) = self
                .done
                .wait_until(Some(Instant::now() + left.min(WATCH_TICK)))
            {
                return r.map(Some);
            }
            if timeout.is_zero() {
                return Ok(None);
            }
            if let Some(e) = self.stuck() {
                return Err(e);
            }
            if start.elapsed() >= timeout {
                return Ok(None);
            }
        }
    }
}

impl Future for SaveHandle {
    type Output = Result<SaveReport>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        {
            let mut st = self.done.lock();
            if let Some(r) = &st.result {
                return Poll::Ready(clone_result(r));
            }
            if !st.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                st.wakers.push(cx.waker().clone());
            }
        }
        if self.watch.is_some() {
            if std::mem::replace(&mut self.polled, true) {
                if let Some(e) = self.stuck() {
                    return Poll::Ready(Err(e));
                }
            }
            ticker::wake_later(&self.done, cx.waker());
        }
        Poll::Pending
    }
}

/// The thread that wakes pending save futures every [`WATCH_TICK`], so
/// that each is polled again and consults the watchdog (a stuck flush
/// never completes them). One for the process, started by the first
/// future that waits on a watched save; it sleeps while none waits.
mod ticker {
    use std::sync::{Arc, Condvar, Mutex, OnceLock, PoisonError, Weak};
    use std::task::Waker;

    use super::{Completion, WATCH_TICK};

    type Waiting = Vec<(Weak<Completion>, Waker)>;

    #[derive(Default)]
    struct Ticker {
        waiting: Mutex<Waiting>,
        added: Condvar,
    }

    /// The ticker, its thread started on first use; `None` when the
    /// thread cannot start (logged once): the futures then wait for their
    /// completion alone, as before.
    fn ticker() -> Option<&'static Ticker> {
        static TICKER: OnceLock<Option<Arc<Ticker>>> = OnceLock::new();
        TICKER
            .get_or_init(|| {
                let t = Arc::new(Ticker::default());
                let run = Arc::clone(&t);
                let spawned = std::thread::Builder::new()
                    .name("acp-await-watch".into())
                    .spawn(move || {
                        crate::io::block_async_signals();
                        run.run();
                    });
                match spawned {
                    Ok(_) => Some(t),
                    Err(e) => {
                        tracing::warn!(
                            "acp: awaited saves will not see the watchdog (thread not started: {e})"
                        );
                        None
                    }
                }
            })
            .as_deref()
    }

    impl Ticker {
        fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
            self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
        }

        fn run(&self) {
            loop {
                {
                    let mut w = self.lock();
                    while w.is_empty() {
                        w = self.added.wait(w).unwrap_or_else(PoisonError::into_inner);
                    }
                }
                std::thread::sleep(WATCH_TICK);
                // Each one still pending registers again when it is polled.
                let due = std::mem::take(&mut *self.lock());
                for (done, waker) in due {
                    if done.upgrade().is_some_and(|d| d.lock().result.is_none()) {
                        waker.wake();
                    }
                }
            }
        }
    }

    /// Has `waker` woken after a tick while `done` has no result.
    pub(super) fn wake_later(done: &Arc<Completion>, waker: &Waker) {
        let Some(t) = ticker() else { return };
        let mut w = t.lock();
        let known = w
            .iter()
            .any(|(d, k)| std::ptr::eq(d.as_ptr(), Arc::as_ptr(done)) && k.will_wake(waker));
        if !known {
            w.push((Arc::downgrade(done), waker.clone()));
            t.added.notify_one();
        }
    }
}
