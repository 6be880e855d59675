//! Waiting on the flush, and the watchdog that turns a flush making no
//! progress into an [`Error::Timeout`] naming what it is stuck on, instead
//! of a wait that never returns.

use std::time::{Duration, Instant};

use super::state::{EngineState, Shared};
use super::Engine;
use crate::error::{Error, Result};

/// How often waits look at the watchdog.
pub(super) const WATCH_TICK: Duration = Duration::from_millis(100);

impl Shared {
    /// The watchdog: the error to report when the running flush has made
    /// no progress for the stall timeout, naming what it is stuck on.
    /// Logged once per stall.
    pub(super) fn stuck(&self, st: &mut EngineState) -> Option<Error> {
        let (at, what) = st.progress.as_ref()?;
        let idle = at.elapsed();
        if idle < self.cfg.stall_timeout {
            return None;
        }
        let what = format!("flush stuck: {what}");
        if !std::mem::replace(&mut st.stall_logged, true) {
            tracing::error!(
                "acp: {what}: no progress for {:.1} s (stall timeout {:.1} s)",
                idle.as_secs_f64(),
                self.cfg.stall_timeout.as_secs_f64()
            );
        }
        Some(Error::Timeout {
            what,
            secs: idle.as_secs_f64(),
        })
    }
}

impl Engine {
    /// Waits until every queued flush has finished (committed or failed),
    /// and the RAM snapshot waiting to be hashed, if any, is hashed.
    ///
    /// # Errors
    /// [`Error::Timeout`] after `timeout`, or when a flush makes no progress
    /// for the configured stall timeout (the watchdog), naming what is stuck.
    pub fn wait_idle(&self, timeout: Option<Duration>) -> Result<()> {
        wait_for(self.shared(), timeout, EngineState::idle)
    }

    /// Waits at most `timeout` until every queued flush (and hash) has finished;
    /// `Ok(false)` when some are still running then (and none is stuck).
    ///
    /// # Errors
    /// [`Error::Timeout`] from the watchdog, naming what is stuck, when a
    /// flush makes no progress for the configured stall timeout.
    pub fn wait_idle_timeout(&self, timeout: Duration) -> Result<bool> {
        wait_until(self.shared(), Some(timeout), EngineState::idle)
    }
}

/// Waits until `done(state)` holds, watching the flush for progress.
pub(super) fn wait_for(
    shared: &Shared,
    timeout: Option<Duration>,
    done: impl Fn(&EngineState) -> bool,
) -> Result<()> {
    if wait_until(shared, timeout, done)? {
        return Ok(());
    }
    let st = shared.lock();
    Err(Error::Timeout {
        what: format!(
            "{} flushes of {}",
            st.in_flight,
            shared.root.location().display()
        ),
        secs: timeout.map_or(0.0, |t| t.as_secs_f64()),
    })
}

/// Waits until `done(state)` holds (`Ok(true)`) or `timeout` passes
/// (`Ok(false)`); fails when the watchdog finds the flush stuck.
pub(super) fn wait_until(
    shared: &Shared,
    timeout: Option<Duration>,
    done: impl Fn(&EngineState) -> bool,
) -> Result<bool> {
    let start = Instant::now();
    let mut st = shared.lock();
    let mut first = true;
    loop {
        if done(&st) {
            return Ok(true);
        }
        // Not on the first look: a flush that just got going again (the
        // disk answered) gets one tick to say so.
        if !std::mem::take(&mut first) {
            if let Some(e) = shared.stuck(&mut st) {
                return Err(e);
            }
        }
        let mut tick = WATCH_TICK;
        if let Some(t) = timeout {
            let waited = start.elapsed();
            if waited >= t {
                return Ok(false);
            }
            tick = tick.min(t - waited);
        }
        st = shared
            .idle
            .wait_timeout(st, tick)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
    }
}
