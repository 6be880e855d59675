//! What the caller side and the flush thread share: the configuration,
//! the storage root, the ring, the I/O engine, and the state under one
//! lock (queued flushes, slots given up, steps known committed, the
//! flush's last progress for the watchdog).

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Instant;

use super::OpenReport;
use crate::config::EngineConfig;
use crate::error::Error;
use crate::io::{IoEngine, IoOpts};
use crate::staging::{Ring, StagingSlot};
use crate::storage::Storage;

/// What the caller side and the flush thread share.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) cfg: EngineConfig,
    pub(super) root: Box<dyn Storage>,
    pub(super) ring: Ring,
    pub(super) io: Arc<dyn IoEngine>,
    pub(super) io_opts: IoOpts,
    pub(super) report: OpenReport,
    /// Other ranks' images kept here, and the transport to peers.
    pub(super) replicas: crate::replica::Store,
    pub(super) state: Mutex<EngineState>,
    pub(super) idle: Condvar,
    /// The header last parsed from an image by a load, with its bytes
    /// (`load.rs`, `image_header`): the next load of the same bytes uses
    /// it rather than parsing them again.
    pub(super) kept_header: Mutex<Option<super::load::KeptHeader>>,
}

/// A slot holding an image whose flush failed, and that image's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FailedSlot {
    pub(super) slot: usize,
    pub(super) generation: u64,
}

#[derive(Debug, Default)]
pub(super) struct EngineState {
    pub(super) closed: bool,
    /// Flush jobs queued or running.
    pub(super) in_flight: usize,
    /// Steps being flushed that came from a previous process's slots; loads
    /// wait for them so the newest step is committed first.
    pub(super) recovering: Vec<u64>,
    /// Slots whose flush failed: complete images, kept resident (restorable)
    /// but given up when the ring needs room. Each names the image by the
    /// slot's generation, so an entry outliving its image (the slot
    /// released and acquired again) never frees a newer one.
    pub(super) failed_slots: Vec<FailedSlot>,
    /// Steps known committed (at open, by this engine's flushes, minus
    /// retention), so the stall checks for `Exists` without touching storage.
    pub(super) committed: std::collections::BTreeSet<u64>,
    /// When the running flush last made progress, and what it was doing.
    pub(super) progress: Option<(Instant, String)>,
    /// Whether the watchdog has logged the current stall (once per stall).
    pub(super) stall_logged: bool,
    /// A flush error that no handle has reported yet (recovery flushes).
    pub(super) unreported: Option<Error>,
    /// The newest snapshot waiting for the persist in flight
    /// ([`PersistPolicy::Coalesce`](crate::PersistPolicy)); counted in
    /// `in_flight` and `queued`. The flush thread runs it next, unless a
    /// newer save supersedes it first.
    pub(super) deferred: Option<super::flush::Job>,
    /// The steps of the persists counted in `in_flight` (queued, deferred
    /// or running), so the newest resident step is never queued twice.
    pub(super) queued: Vec<u64>,
    /// What became of the saves so far.
    pub(super) counts: super::policy::Counts,
    /// RAM snapshots kept resident and unpinned (not persisted by the
    /// policy, or superseded while deferred), each named by its slot's
    /// generation. All but the newest are released when a newer image is
    /// sealed or persisted: superseded, they are no step's only copy worth
    /// a slot, and the ring only reuses `Persisted` slots by itself.
    pub(super) snapshots: Vec<Snapshot>,
    /// The newest step whose image this rank's replica holders have
    /// ([`Engine::protect`](super::Engine::protect)): its snapshot is kept
    /// resident (not released as superseded) until a newer step is
    /// protected or committed, so that the loss of a node that holds this
    /// rank's replica finds this rank's image of that step on its own node.
    pub(super) protected: Option<u64>,
    /// The steps whose replica exchange is in flight
    /// ([`Engine::hold_replicating`](super::Engine::hold_replicating)),
    /// one entry per hold: their snapshots are kept resident like the
    /// protected one, so that the exchange, once complete, can protect a
    /// step this rank still holds, however many saves sealed meanwhile.
    pub(super) replicating: Vec<u64>,
    /// The measured write and compression rates that
    /// [`Compress::Auto`](crate::Compress::Auto) decides by.
    pub(super) rates: super::compress::Rates,
    /// The newest RAM snapshot kept resident and not hashed yet: the flush
    /// thread hashes it when it gets to it (`hash.rs`), unless a newer one
    /// took its place first.
    pub(super) to_hash: Option<Snapshot>,
    /// Whether a wake-up for `to_hash` is queued to the flush thread.
    pub(super) hash_woken: bool,
    /// Whether the flush thread is hashing a RAM snapshot now.
    pub(super) hashing: bool,
    /// A step a load read from storage with no ring slot ready for it,
    /// waiting for the flush thread to read it again into a slot
    /// (`reside.rs`); a newer load's takes its place.
    pub(super) to_reside: Option<super::reside::Reside>,
    /// Whether a wake-up for `to_reside` is queued to the flush thread.
    pub(super) reside_woken: bool,
    /// The step the flush thread is reading into a slot now, if any.
    pub(super) residing: Option<u64>,
    /// Set by [`Engine::stop_keeping_restored`](super::Engine::stop_keeping_restored)
    /// while a re-read runs: it stops at its next checked read.
    pub(super) reside_stop: bool,
    /// Whether a commit left housekeeping (`Storage::settle`) that the
    /// flush thread has not done yet: it does it when it has no save
    /// queued, so a save that follows at once is not delayed by it.
    pub(super) unsettled: bool,
    /// Held snapshots ([`Persist::Hold`](crate::Persist)) waiting for
    /// [`Engine::decide`](super::Engine::decide), in save order. Each job
    /// pins its slot, so the ring never reuses it, and none is in
    /// `snapshots`, so `release_superseded` never frees it; not counted in
    /// `in_flight` (nothing is queued until it is decided).
    pub(super) held: Vec<super::flush::Job>,
    /// Steps from this one on cannot be committed: the dying checkpoint
    /// found that not every rank holds them
    /// ([`Engine::give_up_commits_from`](super::Engine::give_up_commits_from)).
    /// A commit of one (rank 0 waiting for the other ranks' files, or
    /// another rank waiting for rank 0) fails at its next look instead of
    /// waiting out the commit timeout.
    pub(super) given_up_from: Option<u64>,
    /// Ranks the dying checkpoint took as dead, and the step that is not
    /// given up for them (its dead ranks' files are being written by the
    /// survivors: `acp.cover`): a commit of any other step that waits for
    /// one of them fails at its next look
    /// ([`Engine::give_up_commits_waiting_for`](super::Engine::give_up_commits_waiting_for)).
    pub(super) given_up_ranks: Vec<u32>,
    pub(super) given_up_except: Option<u64>,
}

/// A RAM snapshot kept resident: its slot, the slot's generation, its step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Snapshot {
    pub(super) slot: usize,
    pub(super) generation: u64,
    pub(super) step: u64,
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, EngineState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether this rank's images go to replica holders: it holds
    /// replicas (a rank of a replica exchange sends as it receives), or
    /// its transport sends them ([`Transport::sends`](crate::Transport)).
    /// Their send needs the digests first, so whoever hashes an image
    /// hashes it for the send too (`replicate::hash_once`).
    pub(super) fn sends_replicas(&self) -> bool {
        self.cfg.replicas_held > 0 || self.replicas.transport().is_some_and(|t| t.sends())
    }

    /// Forgets the failures recorded for a slot just acquired again: they
    /// named its previous image.
    pub(super) fn reused(&self, slot: StagingSlot) -> StagingSlot {
        let mut st = self.lock();
        st.failed_slots.retain(|f| f.slot != slot.slot());
        st.snapshots.retain(|s| s.slot != slot.slot());
        drop(st);
        slot
    }

    /// Completes the deferred snapshot, if any, as superseded (its pin
    /// drops: the slot stays resident until a newer save reuses it).
    /// Called with the state locked, by whoever queues a newer persist.
    pub(super) fn supersede_deferred(st: &mut EngineState) {
        if let Some(job) = st.deferred.take() {
            st.in_flight -= 1;
            if let Some(i) = st.queued.iter().position(|s| *s == job.step) {
                st.queued.swap_remove(i);
            }
            st.counts.superseded += 1;
            st.snapshots.push(Snapshot {
                slot: job.pin.slot(),
                generation: job.pin.generation(),
                step: job.step,
            });
            let report = job.unflushed(super::Outcome::Superseded);
            job.done.complete(Ok(report));
        }
    }

    /// Releases the kept snapshots older than `newest` (a step just sealed
    /// or persisted), each only while its slot still holds it. Called with
    /// the state locked.
    pub(super) fn release_superseded(&self, st: &mut EngineState, newest: u64) {
        let newest = st
            .snapshots
            .iter()
            .map(|s| s.step)
            .max()
            .map_or(newest, |m| m.max(newest));
        // The protected step's image stays until a newer step is protected
        // (which moves `protected`) or committed (storage has a newer one);
        // an image being replicated stays until its exchange ends.
        let keep = st
            .protected
            .filter(|p| st.committed.range(p + 1..).next().is_none());
        st.snapshots.retain(|s| {
            if s.step >= newest || Some(s.step) == keep || st.replicating.contains(&s.step) {
                return true;
            }
            self.ring.release_generation(s.slot, s.generation);
            false
        });
    }

    /// Takes the held job of `step` out of `held`, if any.
    pub(super) fn take_held(st: &mut EngineState, step: u64) -> Option<super::flush::Job> {
        let i = st.held.iter().position(|j| j.step == step)?;
        Some(st.held.remove(i))
    }

    /// Lets go of a held job as a RAM snapshot the caller chose not to
    /// persist: its handle completes as superseded when a newer step was
    /// sealed since (its slot is then released at once), else as resident
    /// (kept, released like any snapshot once a newer one is sealed).
    /// Called with the state locked.
    pub(super) fn let_go(&self, st: &mut EngineState, job: super::flush::Job) {
        let newer = st.counts.newest_snapshot.is_some_and(|(s, _)| s > job.step);
        let outcome = if newer {
            st.counts.superseded += 1;
            super::Outcome::Superseded
        } else {
            st.counts.resident += 1;
            super::Outcome::Resident
        };
        st.snapshots.push(Snapshot {
            slot: job.pin.slot(),
            generation: job.pin.generation(),
            step: job.step,
        });
        let report = job.unflushed(outcome);
        let done = std::sync::Arc::clone(&job.done);
        // The pin drops first, so a release below frees the slot now.
        drop(job);
        let newest = st.counts.newest_snapshot.map_or(0, |(s, _)| s);
        self.release_superseded(st, newest);
        done.complete(Ok(report));
    }

    pub(super) fn note_progress(&self, what: impl Into<String>) {
        let mut st = self.lock();
        st.progress = Some((Instant::now(), what.into()));
        st.stall_logged = false;
    }
}
