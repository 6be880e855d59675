//! A save in its stall: the caller fills a laid-out ring slot, then
//! [`Staging::finish`] seals it and queues its flush.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::policy::{self, Decision};
use super::state::{Shared, Snapshot};
use super::{copy, flush, handle, to_usize, Engine, Outcome, Persist, SaveHandle};
use crate::error::{Error, Result};
use crate::format::Entry;
use crate::staging::StagingSlot;

/// A save in its stall: the image is laid out in a ring slot and the caller
/// fills the tensors' bytes, directly ([`Staging::tensor_mut`]) or by copy
/// ([`Staging::copy_from`]). [`Staging::finish`] ends the stall. Dropping it
/// unfinished aborts the save and frees the slot.
#[derive(Debug)]
pub struct Staging {
    pub(super) engine: Engine,
    pub(super) step: u64,
    pub(super) overwrite: bool,
    pub(super) persist: Persist,
    /// Where each tensor goes in the slot (shared with the
    /// [`SavePlan`](super::SavePlan) it came from, if any).
    pub(super) entries: Arc<[Entry]>,
    /// The image length.
    pub(super) total_len: u64,
    pub(super) slot: Option<StagingSlot>,
    pub(super) started: Instant,
    pub(super) slot_wait: Duration,
}

impl Staging {
    /// The step.
    #[must_use]
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The laid-out tensors, in the order given to `begin_save`.
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    fn image_mut(&mut self) -> &mut [u8] {
        match self.slot.as_mut() {
            Some(s) => s.image_mut(),
            None => &mut [],
        }
    }

    /// The writable bytes of tensor `i` in the slot.
    ///
    /// # Panics
    /// When `i` is out of range.
    pub fn tensor_mut(&mut self, i: usize) -> &mut [u8] {
        let e = &self.entries[i];
        let (off, len) = (to_usize(e.offset), to_usize(e.len));
        &mut self.image_mut()[off..off + len]
    }

    /// The writable bytes of every tensor at once, in entry order.
    pub fn tensors_mut(&mut self) -> Vec<&mut [u8]> {
        let ranges: Vec<(usize, usize, usize)> = self
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (to_usize(e.offset), to_usize(e.len), i))
            .collect();
        split_ranges(self.image_mut(), ranges)
    }

    /// Copies `srcs[i]` into tensor `i`, in parallel over the configured
    /// copy threads.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the tensor whose length differs, before
    /// anything is copied.
    pub fn copy_from(&mut self, srcs: &[&[u8]]) -> Result<()> {
        if srcs.len() != self.entries.len() {
            return Err(Error::invalid(
                format!("step {}", self.step),
                format!("{} sources for {} tensors", srcs.len(), self.entries.len()),
            ));
        }
        for (e, s) in self.entries.iter().zip(srcs) {
            if s.len() as u64 != e.len {
                return Err(Error::invalid(
                    format!("tensor `{}`", e.name),
                    format!("{} bytes given, {} expected", s.len(), e.len),
                ));
            }
        }
        let threads = self.engine.shared().cfg.copy_threads;
        let dsts = self.tensors_mut();
        copy::parallel_copy(
            dsts.into_iter().zip(srcs.iter().copied()).collect(),
            threads,
        );
        Ok(())
    }

    /// Copies `items[k].1` into tensor `items[k].0` for a subset of the
    /// tensors (each at most once), in parallel over the copy threads. The
    /// rest are left for [`Staging::tensor_mut`] (e.g. device-to-host copies).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the tensor whose index is out of range,
    /// repeated, or whose length differs, before anything is copied.
    pub fn copy_some(&mut self, items: &[(usize, &[u8])]) -> Result<()> {
        self.copy_some_on(items, self.copy_threads())
    }

    /// The configured copy threads (`EngineConfig::with_copy_threads`).
    pub fn copy_threads(&self) -> usize {
        self.engine.shared().cfg.copy_threads
    }

    /// The threads of a copy that runs beside the training (an overlapped
    /// save): half the copy threads, at least one, so that the training's
    /// own threads keep most of the cores.
    pub fn background_threads(&self) -> usize {
        (self.copy_threads() / 2).max(1)
    }

    /// [`Staging::copy_some`] on `threads` threads (at least one) instead
    /// of the configured copy threads: a copy that runs beside the
    /// training (an overlapped save) leaves it the other cores.
    ///
    /// # Errors
    /// As [`Staging::copy_some`].
    pub fn copy_some_on(&mut self, items: &[(usize, &[u8])], threads: usize) -> Result<()> {
        let n = self.entries.len();
        let mut seen = vec![false; n];
        for (i, s) in items {
            let Some(e) = self.entries.get(*i) else {
                return Err(Error::invalid(
                    format!("tensor index {i}"),
                    format!("step {} has {n} tensors", self.step),
                ));
            };
            if std::mem::replace(&mut seen[*i], true) {
                return Err(Error::invalid(
                    format!("tensor `{}`", e.name),
                    "given twice",
                ));
            }
            if s.len() as u64 != e.len {
                return Err(Error::invalid(
                    format!("tensor `{}`", e.name),
                    format!("{} bytes given, {} expected", s.len(), e.len),
                ));
            }
        }
        let mut dsts: Vec<Option<&mut [u8]>> = self.tensors_mut().into_iter().map(Some).collect();
        let pairs = items
            .iter()
            .filter_map(|(i, s)| dsts[*i].take().map(|d| (d, *s)))
            .collect();
        copy::parallel_copy(pairs, threads.max(1));
        Ok(())
    }

    /// The image length in bytes (the data file's size).
    #[must_use]
    pub fn image_len(&self) -> u64 {
        self.total_len
    }

    /// Ends the stall: seals the slot, then queues its persist, defers it
    /// behind the persist in flight, or keeps it resident only, as the
    /// save's [`Persist`](super::Persist) and the engine's
    /// [`PersistPolicy`](crate::PersistPolicy) decide. The handle of a
    /// save kept resident is complete at once (outcome
    /// [`Outcome::Resident`](super::Outcome)); a deferred one completes
    /// when persisted, or as [`Outcome::Superseded`](super::Outcome) when
    /// a newer save takes its place first. A held save
    /// ([`Persist::Hold`](super::Persist)) completes once decided
    /// ([`Engine::decide`](super::Engine::decide)).
    #[must_use]
    pub fn finish(mut self) -> SaveHandle {
        let done = handle::Completion::new(self.step);
        let Some(slot) = self.slot.take() else {
            done.complete(Err(Error::invalid(
                format!("step {}", self.step),
                "staging already finished",
            )));
            return SaveHandle::from_completion(done);
        };
        let pin = slot.seal(self.step, self.total_len);
        // The free slots still too small for such an image grow in the
        // background (after the stall: they would compete with its copy),
        // so the next saves do not grow them.
        self.engine.inner.warm.saw(self.total_len);
        let job = flush::Job {
            pin,
            step: self.step,
            overwrite: self.overwrite,
            done: Arc::clone(&done),
            started: self.started,
            stall_secs: self.started.elapsed().as_secs_f64(),
            slot_wait_secs: self.slot_wait.as_secs_f64(),
            unwatched: false,
        };
        let engine = &self.engine;
        let shared = engine.shared();
        let now = Instant::now();
        let mut st = shared.lock();
        st.counts.sealed(self.step, self.started);
        let decision = policy::decide(
            shared.cfg.persist_policy,
            self.persist,
            self.step,
            now,
            st.counts.last_queued,
            st.in_flight,
        );
        if matches!(decision, Decision::Queue | Decision::Defer) {
            // This step is to be persisted: one waiting for the persist in
            // flight is superseded (never the newest: this one is newer).
            Shared::supersede_deferred(&mut st);
        }
        // Kept snapshots older than this step go, whatever becomes of it.
        shared.release_superseded(&mut st, self.step);
        match decision {
            Decision::Queue => {
                st.counts.last_queued = Some(now);
                drop(st);
                // An enqueue failure (engine closed) completes `done`.
                let _ = engine.enqueue(job);
            }
            Decision::Defer => {
                st.in_flight += 1;
                st.queued.push(self.step);
                st.deferred = Some(job);
            }
            Decision::Hold => {
                let snap = Snapshot {
                    slot: job.pin.slot(),
                    generation: job.pin.generation(),
                    step: self.step,
                };
                // Held with its pin until decided (`Engine::decide`);
                // summed meanwhile, so `load` can check it.
                st.held.push(job);
                let wake = Shared::want_hash(&mut st, snap);
                drop(st);
                if wake {
                    engine.wake_hasher();
                }
            }
            Decision::Keep => {
                st.counts.resident += 1;
                let snap = Snapshot {
                    slot: job.pin.slot(),
                    generation: job.pin.generation(),
                    step: self.step,
                };
                st.snapshots.push(snap);
                // Summed in the background, so `load` can check it.
                let wake = Shared::want_hash(&mut st, snap);
                drop(st);
                if wake {
                    engine.wake_hasher();
                }
                let report = job.unflushed(Outcome::Resident);
                // The pin drops with the job: the slot stays resident,
                // reused once a newer complete image supersedes it.
                drop(job);
                done.complete(Ok(report));
            }
        }
        SaveHandle::watched(done, Arc::downgrade(&self.engine.inner.shared))
    }
}

/// Splits `buf` into the disjoint `(offset, len, index)` ranges, returned in
/// index order. Ranges must not overlap (the layout guarantees it).
fn split_ranges(buf: &mut [u8], mut ranges: Vec<(usize, usize, usize)>) -> Vec<&mut [u8]> {
    let n = ranges.len();
    // Empty tensors share their offset with the next one: put them first.
    ranges.sort_unstable_by_key(|r| (r.0, r.1));
    let mut out: Vec<(usize, &mut [u8])> = Vec::with_capacity(n);
    let mut rest = buf;
    let mut pos = 0;
    for (off, len, i) in ranges {
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(off - pos);
        let (piece, tail) = tail.split_at_mut(len);
        out.push((i, piece));
        rest = tail;
        pos = off + len;
    }
    out.sort_unstable_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, p)| p).collect()
}
