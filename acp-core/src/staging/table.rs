//! The in-process table of slots behind the ring's mutex, and the
//! acquire path that readies a slot's memory outside it.

use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

use super::control::{round_up, Header, Layout, PAGE};
use super::dir::{slot_file_name, SlotDir};
use super::slot::{self, SlotMem};
use super::{RingOptions, SlotInfo, SlotState};

/// The longest the warming waits for loads in progress, from the newest
/// one's start: a load holding its slot's views for long (a zero-copy
/// load) does not keep the slots cold.
const MAX_WARM_DEFER: Duration = Duration::from_secs(5);

/// What all clones of a [`Ring`](super::Ring) share.
#[derive(Debug)]
pub(super) struct Inner {
    pub(super) opts: RingOptions,
    /// The per-user directory of the slot files, held with a shared `flock`.
    pub(super) dir: SlotDir,
    pub(super) layout: Layout,
    /// The slot files, locked for the life of the ring.
    pub(super) files: Vec<File>,
    pub(super) table: Mutex<Table>,
    /// Signalled when a slot may have become available to `acquire`.
    pub(super) freed: Condvar,
    /// Loads in progress ([`Ring::defer_warming`](super::Ring::defer_warming)),
    /// and when the newest of them began: while any is, the warming waits
    /// between its steps.
    pub(super) loads: Mutex<(usize, Instant)>,
    /// Set once the warming is to stop ([`Ring::stop_warming`](super::Ring::stop_warming)):
    /// a step in progress ends, and no wait for loads holds it longer.
    pub(super) warm_stopped: AtomicBool,
    /// Whether a shared budget was found too small for another slot of
    /// the saves' size, and said so (once).
    pub(super) short_warned: AtomicBool,
}

/// The in-process truth about the slots.
#[derive(Debug)]
pub(super) struct Table {
    pub(super) slots: Vec<Entry>,
    /// `mlock` was asked for and nothing refused it so far.
    pub(super) mlock_ok: bool,
    /// The last `mlock` refusal.
    pub(super) mlock_error: Option<String>,
    /// The slot [`Ring::warm_next`](super::Ring::warm_next) holds `Staging`
    /// while it grows it: it is `Free` again shortly, so `acquire` waits
    /// for it rather than report the ring full.
    pub(super) warming: Option<usize>,
}

/// What a slot is taken for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Take {
    /// A save: a free slot, else the oldest persisted one is evicted.
    Save,
    /// A restored step read again into RAM, of this step: as a save, but
    /// a persisted slot is evicted only when its step is not newer.
    SaveUpTo(u64),
    /// Readied for later saves: free slots only.
    Reserve,
    /// Grown in the background: free slots too small for the saves only.
    Grow,
    /// A load's, of the step it holds: only a slot whose memory already
    /// holds the image and is faulted in (`Free`, else the oldest
    /// `Persisted` when its step is not newer than the load's), none to
    /// grow.
    Ready(u64),
}

/// One slot.
#[derive(Debug)]
pub(super) struct Entry {
    /// The mapping; `None` before the slot's memory exists, and while
    /// `acquire` (re)builds it outside the lock.
    pub(super) mem: Option<SlotMem>,
    pub(super) state: SlotState,
    pub(super) step: u64,
    pub(super) len: u64,
    /// Live `PinnedSlot`s.
    pub(super) pins: usize,
    /// Released while pinned: freed when the last pin drops.
    pub(super) free_on_unpin: bool,
    pub(super) has_digests: bool,
    pub(super) generation: u64,
    /// The file size this slot is readied to while `take` has its mapping
    /// out (`mem` is `None`): what it counts against a shared budget then.
    pub(super) reserved: u64,
}

impl Take {
    /// The newest step whose `Persisted` slot this take may evict, if it
    /// may evict any.
    fn evicts_upto(self) -> Option<u64> {
        match self {
            Take::Save => Some(u64::MAX),
            Take::SaveUpTo(step) => Some(step),
            Take::Reserve | Take::Grow | Take::Ready(_) => None,
        }
    }
}

/// Whether `e` is a `Free` slot nobody pins.
fn free(e: &Entry) -> bool {
    e.state == SlotState::Free && e.pins == 0
}

/// Whether `e` is a `Persisted` slot nobody pins, of a step not newer than
/// `upto`: a save may evict it.
fn evictable(e: &Entry, upto: u64) -> bool {
    e.state == SlotState::Persisted && e.pins == 0 && e.step <= upto
}

impl Entry {
    /// Holds a complete image that may be listed and pinned.
    pub(super) fn is_available(&self) -> bool {
        self.state.is_complete() && !self.free_on_unpin && self.mem.is_some()
    }

    /// Marks the slot `Free` here and in its control block (digests, and
    /// the quick sums beside them, first).
    pub(super) fn free(&mut self) {
        self.state = SlotState::Free;
        self.free_on_unpin = false;
        self.has_digests = false;
        if let Some(m) = &mut self.mem {
            m.ctrl.clear_digests();
            m.ctrl.set_state(SlotState::Free);
        }
    }

    /// The bytes of the budget this slot holds: its file, or the size it
    /// is being readied to.
    pub(super) fn footprint(&self) -> u64 {
        self.mem.as_ref().map_or(self.reserved, SlotMem::file_len)
    }

    pub(super) fn info(&self, slot: usize) -> SlotInfo {
        SlotInfo {
            slot,
            step: self.step,
            len: self.len,
            state: self.state,
            has_digests: self.has_digests,
        }
    }
}

impl Inner {
    /// Waits while a load is in progress, until [`MAX_WARM_DEFER`] after
    /// the newest one began. Returns whether the warming may go on: `false`
    /// once it is stopped, at once, whatever loads are in progress (an
    /// engine's close does not wait out a load's deferral).
    pub(super) fn await_loads(&self) -> bool {
        while self.loads_held() && !self.warm_stopped() {
            std::thread::sleep(Duration::from_millis(1));
        }
        !self.warm_stopped()
    }

    fn warm_stopped(&self) -> bool {
        self.warm_stopped.load(Ordering::Acquire)
    }

    fn loads_held(&self) -> bool {
        let (count, newest) = *self.loads();
        count > 0 && newest.elapsed() < MAX_WARM_DEFER
    }

    /// The loads in progress and when the newest began (a few stores each:
    /// poisoning is ignored, as [`Inner::lock`] does).
    pub(super) fn loads(&self) -> MutexGuard<'_, (usize, Instant)> {
        self.loads.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The table. A panic while it was held cannot leave it inconsistent
    /// (every update is a few field stores), so poisoning is ignored.
    pub(super) fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn name(&self, slot: usize) -> String {
        slot_file_name(&self.opts.prefix, slot)
    }

    pub(super) fn path(&self, slot: usize) -> PathBuf {
        self.dir.path().join(self.name(slot))
    }

    pub(super) fn what(&self) -> String {
        format!(
            "ring `{}` in {}",
            self.opts.prefix,
            self.dir.path().display()
        )
    }

    /// Picks the slot to take for `len` bytes. [`Take::Save`]: a `Free`
    /// one (one already big enough first), else the unpinned `Persisted`
    /// one with the oldest step; [`Take::Reserve`]: a `Free` one;
    /// [`Take::Grow`]: a `Free` one too small for `len`; [`Take::Ready`]:
    /// a `Free` one whose memory fits `len` and is faulted in, else the
    /// unpinned `Persisted` one with the oldest step when its memory is so
    /// and its step is not newer than the load's (never a newer step, nor
    /// an older one in place of the oldest: a load must not evict the step
    /// a restart would restore).
    pub(super) fn pick(&self, t: &Table, len: u64, take: Take) -> Option<usize> {
        let fits = |e: &Entry| {
            e.mem
                .as_ref()
                .is_some_and(|m| self.layout.fits(m.image_off(), m.capacity(), len))
        };
        // A slot that must grow may, within a shared budget, only while
        // the others leave room for it.
        let room = |i: usize| self.room_for(t, i, len);
        let slots = t.slots.iter().enumerate();
        if let Take::Ready(step) = take {
            let ready = |e: &Entry| fits(e) && e.mem.as_ref().is_some_and(|m| m.warm);
            return slots
                .clone()
                .find(|(_, e)| free(e) && ready(e))
                .or_else(|| {
                    slots
                        .filter(|(_, e)| e.state == SlotState::Persisted && e.pins == 0)
                        .min_by_key(|(i, e)| (e.step, *i))
                        .filter(|(_, e)| e.step <= step && ready(e))
                })
                .map(|(i, _)| i);
        }
        if take == Take::Grow {
            return slots
                .clone()
                .find(|(i, e)| free(e) && !fits(e) && room(*i))
                .map(|(i, _)| i);
        }
        slots
            .clone()
            .find(|(_, e)| free(e) && fits(e))
            .or_else(|| slots.clone().find(|(i, e)| free(e) && room(*i)))
            .or_else(|| {
                let upto = take.evicts_upto()?;
                slots
                    .filter(|(i, e)| evictable(e, upto) && (fits(e) || room(*i)))
                    .min_by_key(|(i, e)| (e.step, *i))
            })
            .map(|(i, _)| i)
    }

    /// For a save that [`Inner::pick`] found no slot for within a shared
    /// budget: a slot to take (a `Free` one, else the oldest evictable
    /// `Persisted` one) and the other slots to empty so that it may grow
    /// to `len` — `Free` ones first (nothing is lost), then `Persisted`
    /// ones, oldest step first, as few as make room; `None` when emptying
    /// every such slot would not. A slot is emptied only when nothing else
    /// maps it (its memory is handed back: the file cut to its header
    /// page). Without this, slots sized for smaller images kept the budget
    /// for good and a larger image waited forever.
    pub(super) fn room_by_emptying(
        &self,
        t: &Table,
        len: u64,
        take: Take,
    ) -> Option<(usize, Vec<usize>)> {
        let upto = take.evicts_upto()?;
        if !self.opts.shared_budget {
            return None;
        }
        let slots = t.slots.iter().enumerate();
        let target = slots
            .clone()
            .find(|(_, e)| free(e))
            .or_else(|| {
                slots
                    .clone()
                    .filter(|(_, e)| evictable(e, upto))
                    .min_by_key(|(i, e)| (e.step, *i))
            })
            .map(|(i, _)| i)?;
        let emptiable = |e: &Entry| {
            (free(e) || evictable(e, upto)) && e.mem.as_ref().is_some_and(SlotMem::is_unique)
        };
        let mut order: Vec<(usize, &Entry)> = slots
            .clone()
            .filter(|(i, e)| *i != target && emptiable(e))
            .collect();
        order.sort_by_key(|(i, e)| (e.state != SlotState::Free, e.step, *i));
        let own = self.layout.file_for(len);
        let mut others: u64 = slots
            .filter(|(i, _)| *i != target)
            .map(|(_, e)| e.footprint())
            .sum();
        let mut empty = Vec::new();
        for (i, e) in order {
            if others.saturating_add(own) <= self.opts.budget {
                break;
            }
            others -= e.footprint();
            empty.push(i);
        }
        (others.saturating_add(own) <= self.opts.budget).then_some((target, empty))
    }

    /// Sets aside the slots [`Inner::room_by_emptying`] chose: each is freed
    /// (its digests cleared), held `Staging` with its mapping taken out and
    /// its generation bumped, and handed to [`Inner::empty`], which cuts
    /// its file outside the lock.
    pub(super) fn set_aside(
        t: &mut Table,
        empty: Vec<usize>,
    ) -> Vec<(usize, Option<SlotMem>, u64)> {
        let mut out = Vec::with_capacity(empty.len());
        for j in empty {
            if let Some(e) = t.slots.get_mut(j) {
                e.free();
                e.state = SlotState::Staging;
                e.generation = e.generation.wrapping_add(1);
                e.reserved = 0;
                out.push((j, e.mem.take(), e.generation));
            }
        }
        out
    }

    /// Empties the slots [`Inner::room_by_emptying`] chose, each already
    /// `Staging` in the table with its mapping `mem` taken out (the only
    /// one: nothing else maps it) and its `generation` bumped: drops the
    /// mapping, cuts the file to its header page (a `Free` control block)
    /// so its memory goes back to the system, and marks it `Free` without
    /// memory. Called without the table's lock. A file that cannot be cut
    /// is logged; its slot is `Free` all the same, its mapping gone.
    pub(super) fn empty(&self, emptied: Vec<(usize, Option<SlotMem>, u64)>) {
        let mut done = Vec::with_capacity(emptied.len());
        for (slot, mem, generation) in emptied {
            let path = self.path(slot);
            drop(mem);
            let cut = self.files.get(slot).map_or_else(
                || Err(Error::invalid(self.what(), format!("no slot {slot}"))),
                |file| {
                    super::open::write_free_page(file, &path, &self.opts, &self.layout, generation)
                },
            );
            if let Err(e) = cut {
                tracing::warn!("acp: emptying a ring slot to make room: {e}");
            }
            done.push((slot, generation));
        }
        let mut t = self.lock();
        for (slot, generation) in done {
            if let Some(e) = t.slots.get_mut(slot) {
                if e.generation == generation && e.state == SlotState::Staging && e.mem.is_none() {
                    e.state = SlotState::Free;
                }
            }
        }
        drop(t);
        self.freed.notify_all();
    }

    /// Whether slot `slot` may be readied for an image of `len` bytes: with
    /// a budget split per slot, always (the layout caps each slot); with a
    /// shared one ([`RingOptions::shared_budget`]), while the other slots'
    /// files leave room for its file.
    pub(super) fn room_for(&self, t: &Table, slot: usize, len: u64) -> bool {
        if !self.opts.shared_budget {
            return true;
        }
        let others: u64 = t
            .slots
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != slot)
            .map(|(_, e)| e.footprint())
            .sum();
        let own = self.layout.file_for(len);
        others.saturating_add(own) <= self.opts.budget
    }

    /// Says once, when a shared budget has no room for another slot of
    /// `len`-byte images beside those it holds: the saves then take turns
    /// in fewer slots.
    pub(super) fn note_short(&self, t: &Table, len: u64) {
        let short = self.opts.shared_budget
            && t.slots
                .iter()
                .enumerate()
                .any(|(i, e)| e.state == SlotState::Free && !self.room_for(t, i, len));
        if short && !self.short_warned.swap(true, Ordering::Relaxed) {
            let held = t.slots.iter().filter(|e| e.footprint() > 0).count();
            tracing::warn!(
                "acp: {}: its budget of {} (sized from the room at open) holds {held} slot(s) of \
                 {}-byte checkpoints, not {}: a save waits for a slot whose step is persisted \
                 and takes it, so fewer steps stay in RAM, and a RAM snapshot that is not \
                 persisted keeps its slot until then (a save waits for it as `on_full` says); \
                 give the ring more room (a larger /dev/shm, or ring_bytes) for a slot per save \
                 in flight",
                self.what(),
                crate::error::human_bytes(self.opts.budget),
                len,
                self.opts.slots
            );
        }
    }

    /// Readies slot `slot` (already `Staging` in the table, its mapping
    /// taken out as `old`) for an image of `len` bytes, outside the lock:
    /// reuses the mapping when it fits, else regrows the file and maps it
    /// anew. Sets `mlock_error` when `mlock` is refused.
    pub(super) fn prepare(
        &self,
        slot: usize,
        len: u64,
        old: Option<SlotMem>,
        generation: u64,
        mlock_error: &mut Option<String>,
    ) -> Result<SlotMem> {
        let l = &self.layout;
        let mut mem = match old {
            Some(mut m) if l.fits(m.image_off(), m.capacity(), len) => {
                m.ctrl.set_state(SlotState::Staging);
                if !m.warm {
                    // SAFETY: as in `grow`: the `flock` is ours and the
                    // slot is `Staging`, taken with no pin, so no image
                    // handle of it is alive; a `Warmer` of it never
                    // touches its bytes.
                    unsafe { m.prefault_exclusive() };
                    m.warm = true;
                    self.lock_slot(slot, &m, mlock_error);
                }
                m
            }
            other => {
                let mut floor = 0;
                if let Some(mut m) = other {
                    m.ctrl.set_state(SlotState::Staging);
                    if !m.is_unique() {
                        // A handle still maps the file (a `Warmer`: image
                        // handles cannot be alive while the slot is
                        // unpinned): never shrink under it.
                        floor = l.ctrl_len
                            + round_up(m.file_len().saturating_sub(l.ctrl_len), PAGE).unwrap_or(0);
                    }
                }
                self.grow(slot, l.file_for(len).max(floor), mlock_error)?
            }
        };
        mem.ctrl.write_header(&Header {
            state: SlotState::Staging.code(),
            step: 0,
            image_len: 0,
            capacity: mem.capacity(),
            job_tag: self.opts.job_tag,
            rank: self.opts.rank,
            pid: std::process::id(),
            generation,
            chunk_bytes: self.opts.chunk_bytes,
            digest_count: 0,
            digests_valid: 0,
            image_offset: mem.image_off(),
        });
        Ok(mem)
    }

    /// Sizes slot `slot`'s file to `size` bytes, allocates, maps,
    /// pre-faults and (when asked) locks it.
    pub(super) fn grow(
        &self,
        slot: usize,
        size: u64,
        mlock_error: &mut Option<String>,
    ) -> Result<SlotMem> {
        let path = self.path(slot);
        let Some(file) = self.files.get(slot) else {
            return Err(Error::invalid(self.what(), format!("no slot {slot}")));
        };
        file.set_len(size)
            .map_err(|e| Error::io("ftruncate", &path, e))?;
        slot::allocate(file, size).map_err(|e| Error::io("fallocate", &path, e))?;
        // SAFETY: we hold the slot's `flock`, so no other ring process
        // touches the file; in this process the slot is `Staging` in the
        // table with its previous mapping taken out and dropped by
        // `prepare`, and it had no pin when `acquire` took it, so no image
        // handle of it is alive and nobody reads or writes its bytes.
        let mem = unsafe { SlotMem::map(file, size, self.layout.ctrl_len) }
            .map_err(|e| Error::io("mmap", &path, e))?;
        self.lock_slot(slot, &mem, mlock_error);
        Ok(mem)
    }

    /// Records a refused `mlock` (`why`): logged, and reported by
    /// [`Ring::mlock_state`](super::Ring::mlock_state) from now on.
    pub(super) fn mlock_refused(&self, t: &mut Table, why: String) {
        tracing::warn!(
            "{}: {why}; the slot stays pre-faulted but unlocked",
            self.what()
        );
        t.mlock_ok = false;
        t.mlock_error = Some(why);
    }

    /// `mlock`s slot `slot`'s mapping when the ring locks, setting
    /// `mlock_error` when refused.
    pub(super) fn lock_slot(&self, slot: usize, mem: &SlotMem, mlock_error: &mut Option<String>) {
        if self.opts.mlock {
            if let Err(e) = mem.lock() {
                *mlock_error = Some(format!("mlock {}: {e}", self.path(slot).display()));
            }
        }
    }
}
