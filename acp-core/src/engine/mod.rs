//! The engine: save, load, list, retain, close, for one job and rank.
//!
//! # The seam
//!
//! This module owns a rank's checkpointing as a process sees it: the ring
//! of shared-memory slots it stages into, the flush thread that writes a
//! sealed slot to storage and commits it, the state both sides share, and
//! what a process finds at open (recovery). [`Engine`] is the one entry
//! point; everything above it (`ops`, `cli`, acp-py) holds an `Engine` or
//! calls its public types, never its parts.
//!
//! Below, it drives four layers and reaches past none of them: the ring
//! through [`staging`](crate::staging) (slot states, seals, pins), the
//! files through a `Box<dyn `[`Storage`](crate::storage::Storage)`>`
//! (pending, durable, publish; it never builds a path or calls `std::fs`),
//! the bytes through an [`IoEngine`](crate::io::IoEngine), and every read
//! of committed bytes through the verified reader (`read`). Formats (the
//! header it lays out, the index it writes last) come from
//! [`format`](crate::format).
//!
//! Its invariants:
//! - **The stall is only the copy.** `save` returns once the tensors are in
//!   a sealed slot; hashing, writing and committing happen on the flush
//!   thread. A save never waits on storage, except for a free slot when the
//!   ring is full (`on_full`).
//! - **Committed means published.** A step counts as committed only once
//!   [`Storage::publish`](crate::storage::Storage::publish) returned. A
//!   flush that fails leaves the previous committed step as it was and its
//!   own image resident (restorable) in its slot.
//! - **Nothing unverified reaches a caller.** A load from a slot, a peer
//!   rank's slot or storage hands out bytes only after every chunk matched
//!   the committed index's digests.
//! - **A slot is reused only when its image is safe elsewhere**: a save
//!   takes a free slot or one whose image is persisted, never an unflushed
//!   one; the image of a failed flush is given up (with a warning) only
//!   when the ring has no other room. Recovery at open persists a resident
//!   image newer than anything committed.
//!
//! # Files
//!
//! [`Engine`] is a cheap handle on `state::Shared` (configuration,
//! storage, ring, I/O engine, and the state under one lock). Each file owns
//! one part of its life:
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
//!   retention. `hash.rs`: the same thread hashes the newest RAM snapshot
//!   that is not persisted (and open hashes one a previous process left),
//!   so that `load` can verify and serve it.
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
//!   `acp gc` (which calls [`retention_plan`](crate::ops::retention_plan)).
//! - `release.rs`: `release_on_close`, removing the ring's files at close
//!   unless a resident step is nowhere else.
//! - `load.rs`, `ranks.rs` and `checkpoint.rs`: loading a committed step
//!   (from a resident slot, a peer rank's slot or storage, verified through
//!   `read`) into a [`Checkpoint`] of zero-copy views. `copy.rs` is the
//!   parallel copy both sides use.
//!
//! This file holds the [`Engine`] handle itself: the flush queue and thread
//! it owns, [`Engine::close`], and the read-only accessors.

use std::path::Path;
use std::sync::{Arc, Mutex};

use crossbeam_channel::Sender;

use crate::config::EngineConfig;
use crate::error::{Error, Result};

mod checkpoint;
mod compress;
mod copy;
mod flush;
mod handle;
mod hash;
mod incremental;
mod load;
mod open;
mod policy;
mod ranks;
pub(crate) mod reclaim;
mod release;
mod replicate;
mod reside;
pub(crate) mod retention;
mod save;
mod stage;
mod state;
mod wait;

pub use checkpoint::{Checkpoint, LoadReport, Source, TensorView};
pub use handle::SaveHandle;
pub(crate) use load::check_file_header;
pub use load::{LoadRequest, Opened, PendingLoad};
pub use open::OpenReport;
pub use policy::{Outcome, Persist, PersistStats};
pub use save::{HostTensor, OnWait, SaveOptions, SavePlan, SaveReport};
pub use stage::Staging;

pub(crate) use replicate::WeakEngine;
pub use replicate::FLUSH_YIELD_MAX;
use state::Shared;

/// A checkpoint engine for one job and rank. Cheap to clone: clones share
/// the ring, the flush thread and the state.
///
/// An engine belongs to the process that opened it. A child that process
/// forks holds a copy without the engine's threads: there,
/// [`Engine::save`], the loads and [`Engine::close`] fail with
/// [`Error::Invalid`] naming both processes, and dropping it touches
/// nothing of the parent's (its threads, ring locks and queued work).
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// The engine's owner side: dropping the last clone closes the queue and
/// waits while the flush thread drains it (see the `Drop` below).
#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    tx: Mutex<Option<Sender<flush::Work>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// The thread that readies ring slots off the saves' path.
    warm: crate::staging::Warm,
    /// After a close with `release_on_close`: the steps whose only copy
    /// kept the ring (empty when it was released).
    kept_on_close: Mutex<Option<Vec<u64>>>,
    /// The process that opened the engine: a child it forks holds a copy
    /// of this memory but none of its threads.
    pid: u32,
}

/// Dropping the last clone without [`Engine::close`] still persists what
/// was queued, and lets go of the ring before it returns: an engine opened
/// next on the same ring in this process finds its slot files unlocked
/// (they used to stay locked until the flush thread had exited on its
/// own, and such an open failed with [`Error::Busy`] naming this process).
/// The queued replica sends finish first, as at close, and a restored
/// step not yet re-read into the ring is skipped.
/// A flush the watchdog finds stuck is not waited for: its thread exits
/// on its own when the storage answers.
///
/// In a child the opening process forked, the drop touches nothing: the
/// flush, warming and replica threads are the parent's (the child has
/// none to stop or join), and so are the ring's locks and the queued
/// work. What the engine holds is left to the child's exit.
impl Drop for Inner {
    fn drop(&mut self) {
        if self.forked() {
            let worker = self
                .worker
                .get_mut()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
            std::mem::forget(worker);
            self.warm.forget_thread();
            std::mem::forget(Arc::clone(&self.shared));
            return;
        }
        self.shared.lock().closed = true;
        self.shared.replicas.stop();
        let Some(worker) = self.close_queue() else {
            return;
        };
        // The flush thread holds no engine, but never join oneself.
        if worker.thread().id() == std::thread::current().id() {
            return;
        }
        // A flush thread that ended (a panic) leaves the state busy: the
        // wait ends with it.
        let done = |st: &state::EngineState| st.idle() || worker.is_finished();
        match wait::wait_for(&self.shared, None, done) {
            Ok(()) => {
                let _ = worker.join();
            }
            Err(e) => tracing::warn!("acp: engine dropped while its flush is stuck: {e}"),
        }
    }
}

impl Inner {
    /// Whether this is a copy of the engine in a child that the opening
    /// process forked.
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    /// Closes the flush queue (the thread drains what is queued, then
    /// exits) and hands out the thread to be joined, once.
    fn close_queue(&self) -> Option<std::thread::JoinHandle<()>> {
        drop(
            self.tx
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(),
        );
        self.worker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take()
    }
}

impl Engine {
    fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    /// Refuses the engine's use in a child that the opening process
    /// forked: the child has a copy of the engine's memory but none of its
    /// threads, so a save would wait forever for a flush thread that is
    /// not there.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming both processes.
    pub(crate) fn check_process(&self) -> Result<()> {
        if !self.inner.forked() {
            return Ok(());
        }
        Err(Error::invalid(
            format!("engine for {}", self.shared().root.location().display()),
            format!(
                "opened by process {}; process {} is a child it forked, which cannot use it (the engine's threads were not copied): open an engine of its own",
                self.inner.pid,
                std::process::id()
            ),
        ))
    }

    fn enqueue(&self, job: flush::Job) -> Result<()> {
        let shared = self.shared();
        let step = job.step;
        {
            let mut st = shared.lock();
            st.in_flight += 1;
            st.queued.push(step);
        }
        let tx = self
            .inner
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let sent = match tx.as_ref() {
            Some(tx) => tx
                .send(flush::Work::Persist(job))
                .map_err(|e| e.into_inner()),
            None => Err(flush::Work::Persist(job)),
        };
        if let Err(flush::Work::Persist(job)) = sent {
            let mut st = shared.lock();
            st.in_flight -= 1;
            if let Some(i) = st.queued.iter().position(|s| *s == step) {
                st.queued.swap_remove(i);
            }
            drop(st);
            shared.idle.notify_all();
            let err = Error::Closed {
                root: shared.root.location().to_path_buf(),
            };
            job.done.complete(Err(err.duplicate()));
            return Err(err);
        }
        Ok(())
    }

    /// Wakes the flush thread to hash the RAM snapshot waiting to be
    /// hashed ([`Shared::want_hash`]); nothing when the engine is closed.
    fn wake_hasher(&self) {
        self.wake(flush::Work::Hash, |st| {
            st.hash_woken = false;
            st.to_hash = None;
        });
    }

    /// Wakes the flush thread to read the restored step waiting to be
    /// made resident again (`reside.rs`); nothing when the engine is
    /// closed.
    fn wake_resider(&self) {
        self.wake(flush::Work::Reside, |st| {
            st.reside_woken = false;
            st.to_reside = None;
        });
    }

    /// Sends `work` to the flush thread; when its queue is closed (a
    /// closed engine: nothing will do the work, and nothing waits for
    /// it), `forget`s it in the state instead.
    fn wake(&self, work: flush::Work, forget: impl FnOnce(&mut state::EngineState)) {
        let tx = self
            .inner
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let sent = tx.as_ref().is_some_and(|tx| tx.send(work).is_ok());
        drop(tx);
        if !sent {
            let shared = self.shared();
            forget(&mut shared.lock());
            shared.idle.notify_all();
        }
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

    /// The RAM snapshots of this rank on this node: the steps resident in
    /// its ring (persisted or not), newest first. Same as
    /// [`Engine::resident_steps`].
    #[must_use]
    pub fn snapshots(&self) -> Vec<u64> {
        self.resident_steps()
    }

    /// What became of this engine's saves so far: staged, persisted, kept
    /// resident, superseded and skipped counts, bytes written to storage,
    /// the persist queue's depth, and how far the newest persisted step
    /// lags the newest snapshot.
    #[must_use]
    pub fn persist_stats(&self) -> PersistStats {
        let st = self.shared().lock();
        st.counts.stats(st.in_flight)
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
        Ok(ranks::read_header(self.shared(), step, rank)?
            .values()
            .clone())
    }

    /// Persists the newest resident step when it is not committed (a RAM
    /// snapshot the policy did not persist: [`Engine::persist_newest`]),
    /// lets go of the held saves not decided ([`Engine::decide`]), drains
    /// the flush queue and stops the flush thread. Resident slots stay
    /// in shared memory, unless `release_on_close` is set and every
    /// resident step is committed: then this rank's ring files are removed. Further saves fail with [`Error::Closed`]. Never
    /// waits longer than the watchdog allows for a stuck flush.
    ///
    /// # Errors
    /// A flush error that no handle reported, or the watchdog's timeout.
    pub fn close(&self) -> Result<()> {
        self.check_process()?;
        let shared = self.shared();
        // Nothing protected is lost: the newest snapshot is committed
        // whatever the policy chose for it. A failure is its flush's, raised
        // below as an unreported error.
        let closed = std::mem::replace(&mut shared.lock().closed, true);
        // The queued replica sends finish (each gives up on a dead peer
        // by the transport's contract) before the rings may be released.
        shared.replicas.stop();
        let newest = if closed {
            Ok(None)
        } else {
            // The newest step is persisted, held or not (a held one as
            // its own save); the held saves nobody decided are snapshots
            // from then on, released as superseded ones.
            let newest = self.persist_newest();
            self.release_holds();
            newest
        };
        let drained = self.wait_idle(None);
        let worker = self.inner.close_queue();
        if drained.is_ok() {
            if let Some(w) = worker {
                let _ = w.join();
            }
        }
        self.inner.warm.stop();
        drained?;
        if let Some(e) = shared.lock().unreported.take() {
            return Err(e);
        }
        if let Some(h) = newest? {
            h.wait()?;
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
