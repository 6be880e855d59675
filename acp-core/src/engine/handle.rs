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
/// Its blocking waits watch the flush: when it makes no progress for the
/// engine's stall timeout, they fail with [`Error::Timeout`] naming what is
/// stuck (the save may still finish later; wait again to see it).
#[derive(Debug, Clone)]
pub struct SaveHandle {
    done: Arc<Completion>,
    /// The engine whose flush to watch, while it lives.
    watch: Option<Weak<Shared>>,
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
        }
    }

    /// A handle whose waits watch `engine`'s flush for progress.
    pub(super) fn watched(c: Arc<Completion>, engine: Weak<Shared>) -> SaveHandle {
        SaveHandle {
            done: c,
            watch: Some(engine),
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

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.done.lock();
        if let Some(r) = &st.result {
            return Poll::Ready(clone_result(r));
        }
        if !st.wakers.iter().any(|w| w.will_wake(cx.waker())) {
            st.wakers.push(cx.waker().clone());
        }
        Poll::Pending
    }
}
