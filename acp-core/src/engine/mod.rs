//! The engine façade: save, load, list, retain, close.
//!
//! [`Engine`] is a cheap handle on `state::Shared`: what the caller side
//! and the flush thread share (configuration, storage root, ring, I/O
//! engine, and the engine state under one lock). Each file owns one part of
//! its life:
//!
//! - `open.rs`: opening, and recovery of what a previous process of this
//!   rank left: its unfinished saves are swept, the checkpoints resident in
//!   its ring slots are persisted when newer than the newest committed step
//!   (or on request, [`Engine::persist_resident`]), marked persisted when
//!   the index already records them, or set aside to be given up when the
//!   ring needs room. [`OpenReport`] says what it found.
//! - `save.rs` and `stage.rs`: a save's stall. `save.rs` checks the input,
//!   lays the image out and waits for a free ring slot (giving up the slots
//!   of failed flushes first); `stage.rs` is the [`Staging`] the caller
//!   fills, whose [`Staging::finish`] seals the slot and queues its flush.
//! - `flush.rs`: the flush thread: writes a sealed slot to storage, hashes
//!   it, commits the step (the protocol is in its docs), then applies
//!   retention.
//! - `replicate.rs`: peer replicas ([`crate::replica`]): sending this
//!   rank's resident image to its holders, receiving and serving other
//!   ranks' images, and the RAM sources of a load past this rank's ring.
//! - `handle.rs`: [`SaveHandle`], a save's completion, blocking or as a
//!   `Future`.
//! - `wait.rs`: waiting for the flush, and the watchdog: a flush that makes
//!   no progress for the stall timeout turns every wait on it into an
//!   [`Error::Timeout`] naming what it is stuck on.
//! - `retention.rs`: which committed steps to keep (the newest `keep_last`
//!   and the multiples of `keep_every`), one rule for the engine and for
//!   `acp gc` ([`crate::ops::retention_plan`]).
//! - `load.rs`, `ranks.rs`, `verify.rs` and `checkpoint.rs`: loading a
//!   committed step (from a resident slot, a peer rank's slot or storage,
//!   verified against the index's digests) into a [`Checkpoint`] of
//!   zero-copy views. `copy.rs` is the parallel copy both sides use.
//!
//! This file holds the [`Engine`] handle itself: the flush queue and thread
//! it owns, [`Engine::close`], and the read-only accessors.

use std::path::Path;
use std::sync::{Arc, Mutex};

use crossbeam_channel::Sender;

use crate::config::EngineConfig;
use crate::error::{Error, Result};

mod checkpoint;
mod copy;
mod flush;
mod handle;
mod load;
mod open;
mod ranks;
mod release;
mod replicate;
pub(crate) mod retention;
mod save;
mod stage;
mod state;
mod wait;

pub use checkpoint::{Checkpoint, LoadReport, Source, TensorView};
pub use handle::SaveHandle;
pub use load::LoadRequest;
pub use open::OpenReport;
pub use save::{HostTensor, OnWait, SaveOptions, SaveReport};
pub use stage::Staging;

pub(crate) use replicate::WeakEngine;
use state::Shared;

/// A checkpoint engine for one job and rank. Cheap to clone: clones share
/// the ring, the flush thread and the state.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// The engine's owner side: dropping the last clone closes the queue; the
/// flush thread drains what is queued and exits on its own.
#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    tx: Mutex<Option<Sender<flush::Job>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// After a close with `release_on_close`: the steps whose only copy
    /// kept the ring (empty when it was released).
    kept_on_close: Mutex<Option<Vec<u64>>>,
}

impl Engine {
    fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    fn enqueue(&self, job: flush::Job) -> Result<()> {
        let shared = self.shared();
        shared.lock().in_flight += 1;
        let tx = self
            .inner
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let sent = match tx.as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.into_inner()),
            None => Err(job),
        };
        if let Err(job) = sent {
            let mut st = shared.lock();
            st.in_flight -= 1;
            drop(st);
            let err = Error::Closed {
                root: shared.root.location().to_path_buf(),
            };
            job.done.complete(Err(err.duplicate()));
            return Err(err);
        }
        Ok(())
    }

    /// What opening found and chose.
    #[must_use]
    pub fn open_report(&self) -> &OpenReport {
        &self.shared().report
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &EngineConfig {
        &self.shared().cfg
    }

    /// The checkpoint root (canonical).
    #[must_use]
    pub fn root(&self) -> &Path {
        self.shared().root.location()
    }

    /// The committed steps, ascending.
    ///
    /// # Errors
    /// [`Error::Io`] listing the root.
    pub fn steps(&self) -> Result<Vec<u64>> {
        self.shared().root.steps()
    }

    /// The newest committed step.
    ///
    /// # Errors
    /// As [`Engine::steps`].
    pub fn latest(&self) -> Result<Option<u64>> {
        Ok(self.steps()?.last().copied())
    }

    /// The steps resident in this rank's ring, newest first.
    #[must_use]
    pub fn resident_steps(&self) -> Vec<u64> {
        self.shared()
            .ring
            .complete()
            .iter()
            .map(|s| s.step)
            .collect()
    }

    /// The index of committed `step`: its files (size, digests, rank) and
    /// which file holds each tensor.
    ///
    /// # Errors
    /// [`Error::NotFound`] when `step` is not committed; [`Error::Corrupt`].
    pub fn index(&self, step: u64) -> Result<crate::format::Index> {
        self.shared().root.read_index(step)
    }

    /// The values saved in `rank`'s file of committed `step`, read from
    /// the chunks that hold its header (each checked against the index),
    /// without reading its tensors.
    ///
    /// # Errors
    /// [`Error::NotFound`] for a step that is not committed or a rank with
    /// no file in it; [`Error::Corrupt`]; [`Error::Io`].
    pub fn read_values(&self, step: u64, rank: u32) -> Result<serde_json::Value> {
        Ok(ranks::read_header(self.shared(), step, rank)?.values)
    }

    /// Drains the flush queue and stops the flush thread. Resident slots stay
    /// in shared memory, unless `release_on_close` is set and every
    /// resident step is committed: then this rank's ring files are removed. Further saves fail with [`Error::Closed`]. Never
    /// waits longer than the watchdog allows for a stuck flush.
    ///
    /// # Errors
    /// A flush error that no handle reported, or the watchdog's timeout.
    pub fn close(&self) -> Result<()> {
        let shared = self.shared();
        shared.lock().closed = true;
        let drained = self.wait_idle(None);
        drop(
            self.inner
                .tx
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(),
        );
        let worker = self
            .inner
            .worker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if drained.is_ok() {
            if let Some(w) = worker {
                let _ = w.join();
            }
        }
        drained?;
        if let Some(e) = shared.lock().unreported.take() {
            return Err(e);
        }
        if shared.cfg.release_on_close {
            let kept = release::release_ring(shared);
            *self
                .inner
                .kept_on_close
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(kept);
        }
        Ok(())
    }

    /// After [`Engine::close`] with `release_on_close`: the resident steps
    /// that are the only copy of their step (not committed), for which the
    /// ring was kept; empty when it was removed. `None` before such a close.
    #[must_use]
    pub fn kept_on_close(&self) -> Option<Vec<u64>> {
        self.inner
            .kept_on_close
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// Offsets and lengths of a laid-out image fit the address space: the image
/// lives in a mapping.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("image offsets fit in memory: the image is mapped")
}
