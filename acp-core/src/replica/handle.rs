//! [`ReplicaHandle`]: the completion of one background replication.

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use crate::error::{Error, Result};

/// The completion of [`Engine::replicate`](crate::Engine::replicate): done
/// once every holder has the image complete, or the send failed.
#[derive(Debug, Clone)]
pub struct ReplicaHandle {
    inner: Arc<Done>,
}

#[derive(Debug)]
struct Done {
    step: u64,
    result: Mutex<Option<std::result::Result<Vec<u32>, Error>>>,
    cv: Condvar,
}

impl ReplicaHandle {
    pub(crate) fn new(step: u64) -> ReplicaHandle {
        ReplicaHandle {
            inner: Arc::new(Done {
                step,
                result: Mutex::new(None),
                cv: Condvar::new(),
            }),
        }
    }

    pub(crate) fn complete(&self, result: Result<Vec<u32>>) {
        let mut r = self
            .inner
            .result
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        *r = Some(result);
        drop(r);
        self.inner.cv.notify_all();
    }

    /// The step being replicated.
    #[must_use]
    pub fn step(&self) -> u64 {
        self.inner.step
    }

    /// Whether it has finished (either way).
    #[must_use]
    pub fn is_done(&self) -> bool {
        self.inner
            .result
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some()
    }

    /// Blocks until every holder has the image (returns their ranks), or
    /// `timeout` passed.
    ///
    /// # Errors
    /// The send's error (naming the peer), or [`Error::Timeout`].
    pub fn wait(&self, timeout: Option<Duration>) -> Result<Vec<u32>> {
        let guard = self
            .inner
            .result
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let pred = |r: &mut Option<std::result::Result<Vec<u32>, Error>>| r.is_none();
        let guard = match timeout {
            None => self
                .inner
                .cv
                .wait_while(guard, pred)
                .unwrap_or_else(PoisonError::into_inner),
            Some(t) => {
                let (g, res) = self
                    .inner
                    .cv
                    .wait_timeout_while(guard, t, pred)
                    .unwrap_or_else(PoisonError::into_inner);
                if res.timed_out() && g.is_none() {
                    return Err(Error::Timeout {
                        what: format!("replication of step {}", self.inner.step),
                        secs: t.as_secs_f64(),
                    });
                }
                g
            }
        };
        match guard.as_ref() {
            Some(Ok(h)) => Ok(h.clone()),
            Some(Err(e)) => Err(e.duplicate()),
            None => Err(Error::Timeout {
                what: format!("replication of step {}", self.inner.step),
                secs: 0.0,
            }),
        }
    }
}
