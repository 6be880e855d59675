//! [`Ring`]: the handle to one job's and rank's slots, and what it does
//! with them: open, acquire and reserve, pin, state and digest updates,
//! release and unlink. The protocol it follows is the module doc of
//! [`staging`](super).

use std::path::PathBuf;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::format::Digest;

use super::handles::{PinnedSlot, StagingSlot};
use super::open;
use super::slot::SlotMem;
use super::table::{Inner, Take};
use super::{RingOptions, RingReport, SlotInfo, SlotState};

/// A load in progress, holding the ring's warming back while it lives
/// ([`Ring::defer_warming`]).
#[derive(Debug)]
pub struct WarmDeferral {
    inner: Arc<Inner>,
}

impl Drop for WarmDeferral {
    fn drop(&mut self) {
        self.inner.loads().0 -= 1;
    }
}

/// The ring of one job and rank. Cheap to clone; all clones share the slots.
#[derive(Debug, Clone)]
pub struct Ring {
    pub(super) inner: Arc<Inner>,
}

impl Ring {
    /// Opens (creating as needed) the slot files, locks them with `flock`,
    /// reads their control blocks and reports complete images left by a
    /// previous process. Slot files are created lazily at their first use if
    /// absent; existing ones keep their size until a bigger image needs them.
    ///
    /// Absent files are created as one header page so that each is locked
    /// and names its owner; their image memory is still allocated only by
    /// the first [`Ring::acquire`] that needs it.
    ///
    /// # Errors
    /// [`Error::Busy`] when another live process holds the slots (names
    /// the pid if known), or a slot file or the per-user directory is
    /// owned by another user; [`Error::Invalid`] when the per-user
    /// directory is a symlink, not a directory or not mode `0700`, a slot
    /// file is not a regular file, or the options are impossible (no slots, chunk
    /// size 0, a budget with no room for an image, a prefix that is not a
    /// plain file name); [`Error::Io`], or [`Error::NoSpace`] when the
    /// directory is full.
    pub fn open(opts: RingOptions) -> Result<(Ring, RingReport)> {
        let (inner, report) = open::open(opts)?;
        Ok((
            Ring {
                inner: Arc::new(inner),
            },
            report,
        ))
    }

    /// The largest image one slot may hold under the budget.
    #[must_use]
    pub fn max_image_bytes(&self) -> u64 {
        self.inner.layout.max_image
    }

    /// Whether two images of `len` bytes fit the budget side by side: with
    /// a budget split per slot, whenever one fits a slot; with a shared
    /// one ([`RingOptions::shared_budget`]), when two slots of them do.
    #[must_use]
    pub fn holds_two(&self, len: u64) -> bool {
        let inner = &self.inner;
        let l = &inner.layout;
        len <= l.max_image
            && inner.opts.slots >= 2
            && (!inner.opts.shared_budget || l.file_for(len).saturating_mul(2) <= inner.opts.budget)
    }

    /// Takes a slot for an image of `len` bytes and marks it `Staging`.
    /// Chooses a `Free` slot, else the `Persisted` one with the oldest step;
    /// never a slot that is pinned, `Staging`, `Resident` or `Flushing`.
    /// Grows the slot's file and mapping when it is too small (fallocate,
    /// populate, mlock), so steady-state saves touch no fresh page. With
    /// `wait = Some(d)` blocks up to `d` for a slot to free; with `None`
    /// returns `Ok(None)` at once when none is free.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `len` exceeds [`Ring::max_image_bytes`];
    /// [`Error::Timeout`]; [`Error::Io`] when growing fails, or
    /// [`Error::NoSpace`] when the directory (tmpfs) has no room for it.
    pub fn acquire(&self, len: u64, wait: Option<Duration>) -> Result<Option<StagingSlot>> {
        self.take(len, wait, Take::Save)
    }

    /// [`Ring::acquire`] without waiting, for an image of `step` read
    /// again from storage: a `Persisted` slot is evicted (or emptied to
    /// make room) only when its step is not newer than `step`.
    ///
    /// # Errors
    /// As [`Ring::acquire`].
    pub fn acquire_upto(&self, len: u64, step: u64) -> Result<Option<StagingSlot>> {
        self.take(len, None, Take::SaveUpTo(step))
    }

    /// [`Ring::acquire`] of a slot whose memory already fits `len` bytes
    /// and is faulted in, for a load of `step`, without waiting: a `Free`
    /// one, else the `Persisted` one with the oldest step when that step
    /// is not newer than `step` (a load never gives up a newer step, nor
    /// an older one in place of the oldest); `Ok(None)` when there is none.
    /// A load that can put its bytes elsewhere takes one so, rather than
    /// pay for fresh memory.
    ///
    /// # Errors
    /// As [`Ring::acquire`].
    pub fn acquire_ready(&self, len: u64, step: u64) -> Result<Option<StagingSlot>> {
        if len > self.inner.layout.max_image {
            return Ok(None);
        }
        self.take(len, None, Take::Ready(step))
    }

    /// Readies every `Free` slot for images of `len` bytes now (grows,
    /// populates and locks its memory, as the first [`Ring::acquire`] of
    /// it would), so the first saves into them pay no more than later
    /// ones. Slots holding images (`Persisted` included) are left alone.
    /// Returns how many slots are ready.
    ///
    /// # Errors
    /// As [`Ring::acquire`].
    pub fn reserve(&self, len: u64) -> Result<usize> {
        let mut held = Vec::new();
        while let Some(slot) = self.take(len, None, Take::Reserve)? {
            held.push(slot); // dropped unsealed below: `Free` again, memory kept
        }
        Ok(held.len())
    }

    /// Does one piece of the work that keeps saves off the page-fault path
    /// and says whether there was any: pre-faults (and locks, when the
    /// ring locks) one mapped slot that is not yet (the slots an open
    /// mapped, recovered images included, stay readable meanwhile); else,
    /// given the image length `len` of the saves, grows one `Free` slot too
    /// small for it, as its first [`Ring::acquire`] would. A background
    /// thread calls it until it returns `false`, off the training's path;
    /// an `acquire` that comes first does the same work itself, and one
    /// that finds only the slot being grown waits for it.
    ///
    /// # Errors
    /// The `madvise` error (a kernel before 5.14 has no
    /// `MADV_POPULATE_WRITE`: `acquire` then pre-faults as it takes a
    /// slot), and [`Ring::acquire`]'s when growing fails.
    pub fn warm_next(&self, len: Option<u64>) -> Result<bool> {
        let inner = &self.inner;
        // The newest image first: a load after a restart reads it (while
        // the load runs, the warming waits: `defer_warming`).
        let cold = {
            let t = inner.lock();
            t.slots
                .iter()
                .enumerate()
                .filter(|(_, e)| e.mem.as_ref().is_some_and(|m| !m.warm))
                .max_by_key(|(i, e)| (e.state.is_complete(), e.step, std::cmp::Reverse(*i)))
                .and_then(|(i, e)| Some((i, e.mem.as_ref()?.warmer())))
        };
        let pause = || inner.await_loads();
        if let Some((slot, warmer)) = cold {
            let faulted = warmer.prefault(&pause);
            let locked = match faulted {
                Ok(true) if inner.opts.mlock => warmer.lock(&pause),
                _ => Ok(true),
            };
            let mut t = inner.lock();
            let locked = locked.unwrap_or_else(|e| {
                inner.mlock_refused(&mut t, format!("mlock {}: {e}", inner.path(slot).display()));
                true
            });
            let faulted = faulted
                .map_err(|e| Error::io("madvise(MADV_POPULATE_WRITE)", inner.path(slot), e))?;
            if !(faulted && locked) {
                // Stopped part-way: the slot stays cold (a save into it
                // warms it itself), and nothing more is done.
                return Ok(false);
            }
            if let Some(m) = t
                .slots
                .get_mut(slot)
                .and_then(|e| e.mem.as_mut())
                .filter(|m| warmer.warms(m))
            {
                m.warm = true;
            }
            return Ok(true);
        }
        let Some(len) = len.filter(|l| *l <= inner.layout.max_image) else {
            return Ok(false);
        };
        if !pause() {
            return Ok(false);
        }
        // The slot, dropped unsealed, is `Free` again with its memory kept.
        let grown = self.take(len, None, Take::Grow).map(|slot| slot.is_some());
        let mut t = inner.lock();
        let was = t.warming.take();
        drop(t);
        if was.is_some() {
            inner.freed.notify_all();
        }
        grown
    }

    /// Holds [`Ring::warm_next`] back while the returned guard lives (up
    /// to a few seconds after the newest such guard was made): a load
    /// reading a slot takes one, so the warming's page faults, `mlock`s
    /// and growing do not compete with it for the memory-map lock and the
    /// cores. A
    /// process restarted after a fault opens its ring and loads at once,
    /// while the warming has every slot still to do: on a 2-core machine
    /// the first load of 268 MB from RAM took about four times as long
    /// beside it (BENCHMARKS.md, "The first load after a restart").
    #[must_use]
    pub fn defer_warming(&self) -> WarmDeferral {
        {
            let mut loads = self.inner.loads();
            *loads = (loads.0 + 1, Instant::now());
        }
        WarmDeferral {
            inner: Arc::clone(&self.inner),
        }
    }

    /// Stops [`Ring::warm_next`] for good: a call in progress ends after
    /// the step it is on (without waiting out a load's
    /// [`Ring::defer_warming`]) and returns `Ok(false)`, as every later
    /// one does at once. An engine's close calls it before it waits for
    /// its warming thread. Saves still ready their own slots.
    pub fn stop_warming(&self) {
        self.inner
            .warm_stopped
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn take(&self, len: u64, wait: Option<Duration>, take: Take) -> Result<Option<StagingSlot>> {
        let inner = &self.inner;
        let max = inner.layout.max_image;
        if len > max {
            return Err(Error::invalid(
                format!("image of {len} bytes"),
                format!(
                    "exceeds the {max}-byte slot capacity of {} ({} bytes over {} slots)",
                    inner.what(),
                    inner.opts.budget,
                    inner.opts.slots
                ),
            ));
        }
        let start = Instant::now();
        let deadline = wait.and_then(|d| start.checked_add(d));
        let mut t = inner.lock();
        // Slots emptied to make room for this one (a shared budget).
        let mut emptied = Vec::new();
        let slot = loop {
            if let Some(i) = inner.pick(&t, len, take) {
                break i;
            }
            if let Some((i, empty)) = inner.room_by_emptying(&t, len, take) {
                emptied = Inner::set_aside(&mut t, empty);
                break i;
            }
            if matches!(take, Take::Grow | Take::Save | Take::SaveUpTo(_)) {
                inner.note_short(&t, len);
            }
            if !matches!(take, Take::Grow | Take::Ready(_)) && t.warming.is_some() {
                // The slot being grown is `Free` again shortly.
                t = inner.freed.wait(t).unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            let Some(d) = wait else { return Ok(None) };
            match deadline {
                None => t = inner.freed.wait(t).unwrap_or_else(PoisonError::into_inner),
                Some(dl) => {
                    let now = Instant::now();
                    if now >= dl {
                        return Err(Error::Timeout {
                            what: format!("{}: a free slot for {len} bytes", inner.what()),
                            secs: d.as_secs_f64(),
                        });
                    }
                    t = inner
                        .freed
                        .wait_timeout(t, dl - now)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        };
        let Some(e) = t.slots.get_mut(slot) else {
            return Err(Error::invalid(inner.what(), format!("no slot {slot}")));
        };
        e.state = SlotState::Staging;
        e.step = 0;
        e.len = 0;
        e.has_digests = false;
        e.free_on_unpin = false;
        e.generation = e.generation.wrapping_add(1);
        let generation = e.generation;
        let old = e.mem.take();
        // What it counts against a shared budget until its mapping is back.
        e.reserved = old
            .as_ref()
            .map_or(0, SlotMem::file_len)
            .max(inner.layout.file_for(len));
        if take == Take::Grow {
            t.warming = Some(slot);
        }
        drop(t);
        if !emptied.is_empty() {
            inner.empty(emptied);
        }

        let mut mlock_error = None;
        let prepared = inner.prepare(slot, len, old, generation, &mut mlock_error);
        let mut t = inner.lock();
        if let Some(why) = mlock_error {
            inner.mlock_refused(&mut t, why);
        }
        let Some(e) = t.slots.get_mut(slot) else {
            return Err(Error::invalid(inner.what(), format!("no slot {slot}")));
        };
        match prepared {
            Ok(mem) => {
                let image = mem.image.clone();
                e.mem = Some(mem);
                Ok(Some(StagingSlot {
                    ring: Arc::clone(inner),
                    slot,
                    image,
                    sealed: false,
                }))
            }
            Err(err) => {
                // The file may be left `Staging`; the next open discards it.
                e.state = SlotState::Free;
                e.reserved = 0;
                drop(t);
                inner.freed.notify_all();
                Err(err)
            }
        }
    }

    /// The slots holding complete images, newest step first.
    #[must_use]
    pub fn complete(&self) -> Vec<SlotInfo> {
        let t = self.inner.lock();
        let mut v: Vec<SlotInfo> = t
            .slots
            .iter()
            .enumerate()
            .filter(|(_, e)| e.is_available())
            .map(|(i, e)| e.info(i))
            .collect();
        v.sort_by(|a, b| b.step.cmp(&a.step).then(a.slot.cmp(&b.slot)));
        v
    }

    /// [`Ring::pin`] of `slot` while it holds `step`'s image: a slot that
    /// [`Ring::complete`] listed may be freed and filled again before it
    /// is pinned, and the pin holds whatever it holds then.
    ///
    /// # Errors
    /// [`Error::NotFound`] when it holds no complete image of `step`.
    pub fn pin_step(&self, slot: usize, step: u64) -> Result<PinnedSlot> {
        let pin = self.pin(slot)?;
        if pin.step() != step {
            return Err(Error::NotFound {
                what: format!(
                    "step {step} in slot {slot} of {} (it holds step {} now)",
                    self.inner.what(),
                    pin.step()
                ),
            });
        }
        Ok(pin)
    }

    /// Pins slot `slot` for reading.
    ///
    /// # Errors
    /// [`Error::NotFound`] when it holds no complete image.
    pub fn pin(&self, slot: usize) -> Result<PinnedSlot> {
        let inner = &self.inner;
        let mut t = inner.lock();
        let not_found = || Error::NotFound {
            what: format!("complete image in slot {slot} of {}", inner.what()),
        };
        let Some(e) = t.slots.get_mut(slot) else {
            return Err(not_found());
        };
        let Some(mem) = e.mem.as_ref().filter(|_| e.is_available()) else {
            return Err(not_found());
        };
        let image = mem.image.clone();
        e.pins += 1;
        Ok(PinnedSlot {
            ring: Arc::clone(inner),
            slot,
            image,
            step: e.step,
            len: usize::try_from(e.len).unwrap_or(usize::MAX),
            generation: e.generation,
        })
    }

    /// Moves a complete slot between `Resident`, `Flushing` and `Persisted`.
    /// `Free` is [`Ring::release`]. Ignored (and logged) for a slot that
    /// holds no complete image, and for `Staging`, which only
    /// [`Ring::acquire`] sets. Moving to `Persisted` wakes `acquire` waiters.
    pub fn set_state(&self, slot: usize, state: SlotState) {
        let inner = &self.inner;
        match state {
            SlotState::Free => return self.release(slot),
            SlotState::Staging => {
                tracing::warn!("{}: slot {slot}: set_state(Staging) ignored", inner.what());
                return;
            }
            SlotState::Resident | SlotState::Flushing | SlotState::Persisted => {}
        }
        let mut t = inner.lock();
        match t.slots.get_mut(slot) {
            Some(e) if e.is_available() => {
                if let Some(m) = &mut e.mem {
                    m.ctrl.set_state(state);
                }
                e.state = state;
            }
            _ => {
                tracing::warn!(
                    "{}: slot {slot}: set_state({state:?}) on a slot without a complete image ignored",
                    inner.what()
                );
                return;
            }
        }
        drop(t);
        if state == SlotState::Persisted {
            inner.freed.notify_all();
        }
    }

    /// Records the chunk digests of slot `slot`'s image (computed by the flush
    /// or by a verified read). Ignored when they do not fit the digest area.
    pub fn set_digests(&self, slot: usize, digests: &[Digest]) {
        let inner = &self.inner;
        let chunk = inner.opts.chunk_bytes;
        let mut t = inner.lock();
        let Some(e) = t.slots.get_mut(slot).filter(|e| e.is_available()) else {
            tracing::warn!(
                "{}: slot {slot}: digests for a slot without a complete image ignored",
                inner.what()
            );
            return;
        };
        // New digests unmake the sums taken beside the old ones
        // (`Control::set_digests` clears them first).
        let stored = e
            .mem
            .as_mut()
            .is_some_and(|m| m.ctrl.set_digests(digests, chunk));
        if stored {
            e.has_digests = true;
        } else {
            tracing::warn!(
                "{}: slot {slot}: {} digests do not fit the digest area; ignored",
                inner.what(),
                digests.len()
            );
        }
    }

    /// Records the quick sum of each digest chunk of slot `slot`'s image,
    /// computed from the same bytes, in the same pass, as `digests`, in the
    /// slot's control block beside them (so a later process finds them).
    /// Recorded only while `digests` are the slot's recorded digests
    /// (checked here); they stay believed until the slot's digests are
    /// set again or cleared (acquire, release), which unmakes them. Ignored
    /// otherwise, and for a slot whose digest area has no room for them
    /// (laid out by an older version).
    pub fn record_quick_sums(&self, slot: usize, digests: &[Digest], sums: &[u64]) {
        let mut t = self.inner.lock();
        let Some(e) = t
            .slots
            .get_mut(slot)
            .filter(|e| e.is_available() && e.has_digests)
        else {
            return;
        };
        let Some(m) = e.mem.as_mut() else {
            return;
        };
        if sums.len() == digests.len() && m.ctrl.digests().is_some_and(|d| d == digests) {
            m.ctrl.set_sums(sums);
        }
    }

    /// The quick sums recorded for slot `slot` ([`Ring::record_quick_sums`],
    /// by this process or an earlier one), if any.
    #[must_use]
    pub fn quick_sums(&self, slot: usize) -> Option<Vec<u64>> {
        let t = self.inner.lock();
        t.slots
            .get(slot)
            .filter(|e| e.is_available() && e.has_digests)?
            .mem
            .as_ref()?
            .ctrl
            .sums()
    }

    /// Records `sums`, the quick sum of each chunk of slot `slot`'s image
    /// of generation `generation`, without digests: a RAM snapshot checked
    /// by its sums until it is persisted (whose flush hashes it, checking
    /// each chunk against its sum) or sent to a replica holder (hashed then,
    /// checked the same way); `read/fast.rs` says what the sums prove.
    /// Recorded in the control block bound to the image (its step, length
    /// and generation), so a later process finds them. Returns whether they
    /// were recorded: not when the slot holds another image or one with
    /// digests already, the count is not the image's, or they do not fit.
    pub fn record_sums_alone(&self, slot: usize, generation: u64, sums: &[u64]) -> bool {
        let chunk = self.inner.opts.chunk_bytes;
        let mut t = self.inner.lock();
        let Some(e) = t.slots.get_mut(slot).filter(|e| {
            e.is_available()
                && !e.has_digests
                && e.generation == generation
                && e.len.div_ceil(chunk.max(1)) == sums.len() as u64
        }) else {
            return false;
        };
        let image = [e.step, e.len, e.generation];
        e.mem
            .as_mut()
            .is_some_and(|m| m.ctrl.set_sums_alone(sums, chunk, image))
    }

    /// The sums recorded for slot `slot`'s image without digests
    /// ([`Ring::record_sums_alone`], by this process or an earlier one),
    /// if any: none once digests are recorded.
    #[must_use]
    pub fn sums_alone(&self, slot: usize) -> Option<Vec<u64>> {
        let chunk = self.inner.opts.chunk_bytes;
        let t = self.inner.lock();
        let e = t
            .slots
            .get(slot)
            .filter(|e| e.is_available() && !e.has_digests)?;
        let sums = e
            .mem
            .as_ref()?
            .ctrl
            .sums_alone(chunk, [e.step, e.len, e.generation])?;
        (sums.len() as u64 == e.len.div_ceil(chunk.max(1))).then_some(sums)
    }

    /// Whether a slot released while pinned (a superseded snapshot being
    /// hashed or sent) becomes free once its pins drop: a ring waiting
    /// for room then needs no other way to make it.
    #[must_use]
    pub fn freeing(&self) -> bool {
        self.inner.lock().slots.iter().any(|e| e.free_on_unpin)
    }

    /// The recorded digests of slot `slot`, if any.
    #[must_use]
    pub fn digests(&self, slot: usize) -> Option<Vec<Digest>> {
        let t = self.inner.lock();
        let e = t
            .slots
            .get(slot)
            .filter(|e| e.is_available() && e.has_digests)?;
        e.mem.as_ref()?.ctrl.digests()
    }

    /// Marks slot `slot` `Free` (its image is dropped) once no pin holds it.
    /// From then on it is neither listed by [`Ring::complete`] nor pinnable.
    /// Ignored for a `Staging` slot (dropping its [`StagingSlot`] frees it).
    pub fn release(&self, slot: usize) {
        self.release_if(slot, None);
    }

    /// [`Ring::release`] of slot `slot` only while it holds the image of
    /// generation `generation` ([`PinnedSlot::generation`],
    /// [`Ring::generation`]); a slot acquired again since is left alone.
    /// Returns whether the image was released.
    pub fn release_generation(&self, slot: usize, generation: u64) -> bool {
        self.release_if(slot, Some(generation))
    }

    /// The generation of slot `slot` while it holds a complete image.
    #[must_use]
    pub fn generation(&self, slot: usize) -> Option<u64> {
        let t = self.inner.lock();
        t.slots
            .get(slot)
            .filter(|e| e.is_available())
            .map(|e| e.generation)
    }

    fn release_if(&self, slot: usize, generation: Option<u64>) -> bool {
        let inner = &self.inner;
        let mut t = inner.lock();
        let Some(e) = t.slots.get_mut(slot) else {
            return false;
        };
        if generation.is_some_and(|g| g != e.generation) {
            return false;
        }
        match e.state {
            SlotState::Free => return false,
            SlotState::Staging => {
                tracing::warn!(
                    "{}: slot {slot}: release of a staging slot ignored",
                    inner.what()
                );
                return false;
            }
            SlotState::Resident | SlotState::Flushing | SlotState::Persisted => {}
        }
        if e.pins > 0 {
            let released = !e.free_on_unpin;
            e.free_on_unpin = true;
            e.has_digests = false;
            // Free in the control block at once (the pins read the mapped
            // bytes, not the block): a process that dies before they drop
            // leaves no released image for a later open to take for a
            // resident step and persist.
            if let Some(m) = &mut e.mem {
                m.ctrl.clear_digests();
                m.ctrl.set_state(SlotState::Free);
            }
            return released;
        }
        e.free();
        drop(t);
        inner.freed.notify_all();
        true
    }

    /// The file that backs slot `slot`, for messages.
    #[must_use]
    pub fn slot_path(&self, slot: usize) -> PathBuf {
        self.inner.path(slot)
    }

    /// Wakes waiters in [`Ring::acquire`] (after a state change made elsewhere).
    pub fn notify(&self) {
        self.inner.freed.notify_all();
    }

    /// Unlinks the slot files (their memory is freed once unmapped), then
    /// the per-user directory when no other ring uses it and it is empty.
    /// The ring keeps working on its open files but no longer holds the
    /// directory.
    /// For tests and `acp gc --shm`; a normal close keeps them resident.
    pub fn unlink_all(&self) {
        let inner = &self.inner;
        for slot in 0..inner.opts.slots {
            if let Err(e) = inner.dir.unlink(&inner.name(slot)) {
                tracing::warn!("unlink {}: {e}", inner.path(slot).display());
            }
        }
        inner.dir.remove_if_unused();
    }

    /// Whether every slot mapped so far is locked in RAM (`mlock` asked for
    /// and never refused), and the last refusal. Unlike
    /// [`RingReport::mlocked`], this covers slots grown after open.
    #[must_use]
    pub fn mlock_state(&self) -> (bool, Option<String>) {
        let t = self.inner.lock();
        (t.mlock_ok, t.mlock_error.clone())
    }
}
