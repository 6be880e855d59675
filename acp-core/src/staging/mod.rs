//! The shared-memory ring: named slots that hold checkpoint images in RAM.
//!
//! Each slot is a file `{shm_dir}/acp-u{euid}/{prefix}-s{index}` mapped
//! shared (`MAP_SHARED`), normally under `/dev/shm`, so its bytes outlive
//! the process that wrote them: a restarted trainer or `acp persist` finds
//! them again.
//!
//! # Where slot files live
//!
//! Slot `i` of rank `r` of job `j` is
//! `{shm_dir}/acp-u{euid}/acp-{16 hex of blake3(j)}-r{r:05}-s{i}`
//! ([`user_dir`], [`ring_prefix`], [`slot_file_name`], [`slot_path`]: the
//! one place that names them). The names are predictable, so they live in
//! a directory no other user can write: `acp-u{euid}` is created mode
//! `0700` and opened `O_DIRECTORY | O_NOFOLLOW`, and `fstat` on that
//! descriptor must say a directory owned by the effective uid with mode
//! exactly `0700`; anything else (a symlink, a file, another user's
//! directory, mode `0777`) is refused with an error that names the path,
//! its owner and the fix (another `shm_dir`). Slot files are opened
//! relative to that descriptor (`openat`). A ring holds a shared `flock`
//! on the directory until [`Ring::unlink_all`], which removes the
//! directory once it is empty and no other ring holds it. A normal close keeps the slot files,
//! and with them the directory.
//!
//! # Slot files
//!
//! - Created with `O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW` relative to
//!   the per-user directory, mode `0600` (a file found with other
//!   permission bits is `chmod`ed to `0600`; one that is not a regular
//!   file owned by the effective uid is refused with [`Error::Busy`] or
//!   [`Error::Invalid`], naming it). Tools that read slots without a ring
//!   (`acp ls`, `acp persist`, another rank's restore from this node's
//!   RAM) ignore such a file.
//! - Locked with `flock(LOCK_EX | LOCK_NB)` for the life of the [`Ring`].
//!   A lock held elsewhere (another process, or another open of the same
//!   files in this one) makes [`Ring::open`] fail with `Busy`, naming the
//!   file and the pid recorded in its control block. The lock dies with its
//!   holder, so a crashed process never blocks the next one.
//! - [`Ring::open`] creates absent files as a single header page (4 KiB, so
//!   every slot can be locked and name its owner); the image memory is
//!   allocated lazily, by the first [`Ring::acquire`] that needs it.
//! - Layout: the control block (one page), the digest area, then the image
//!   area, each starting at a multiple of 4096:
//!
//! ```text
//!  0 ─────── 4096 ───────────────── image_offset ─────────────── file end
//!  │ header  │ digest area         │ image area (capacity bytes)      │
//!  │ page    │ 32 B per chunk      │ image_len bytes of image, then   │
//!  │         │ (digest_count used) │ zero padding to 4096, then slack │
//! ```
//!
//! # Control block
//!
//! All integers little-endian, written with explicit `to_le_bytes`.
//!
//! | offset | size | field           | meaning |
//! |-------:|-----:|-----------------|---------|
//! |      0 |    8 | `magic`         | `b"ACPSLOT1"` |
//! |      8 |    4 | `version`       | layout version, `1` |
//! |     12 |    4 | `state`         | `0` Free, `1` Staging, `2` Resident, `3` Flushing, `4` Persisted |
//! |     16 |    8 | `step`          | step of the image (valid in a complete state) |
//! |     24 |    8 | `image_len`     | image length in bytes, `≤ capacity` |
//! |     32 |    8 | `capacity`      | image area size: file size − `image_offset`, a multiple of 4096 |
//! |     40 |   32 | `job_tag`       | blake3 of the job id ([`RingOptions::job_tag`]) |
//! |     72 |    4 | `rank`          | [`RingOptions::rank`] |
//! |     76 |    4 | `owner_pid`     | pid of the process that last opened or acquired the slot |
//! |     80 |    8 | `generation`    | incremented at each acquire of the slot |
//! |     88 |    8 | `chunk_bytes`   | chunk size of the recorded digests |
//! |     96 |    4 | `digest_count`  | number of recorded digests |
//! |    100 |    4 | `digests_valid` | `1` when the digests are complete, else `0` |
//! |    104 |    8 | `image_offset`  | offset of the image area, a multiple of 4096 |
//! |    112 |    … | origin record   | the ring's checkpoint root and job id ([`Ring::record_origin`]; zero when not recorded) |
//! |      … |    … | reserved        | zero |
//! |   4096 |    … | digest area     | `digest_count` × 32-byte blake3 chunk digests |
//!
//! The digest area holds one digest per `chunk_bytes` of the largest image
//! the budget allows a slot, rounded up to 4096 bytes, so every slot of a
//! ring has the same `image_offset` whatever its current size.
//!
//! A control block whose magic, version, job tag or rank is not ours, whose
//! state code is unknown, or that claims a complete image with inconsistent
//! fields (an `image_offset` or `capacity` that does not match the file,
//! `image_len > capacity`, `chunk_bytes == 0`) is not trusted: the slot is
//! reinitialised as `Free`. Digests recorded for another chunk size are
//! dropped (`digests_valid` cleared), the image kept.
//!
//! # State machine
//!
//! ```text
//!            acquire             seal              set_state            set_state
//!   Free ──────────────▶ Staging ──────▶ Resident ───────────▶ Flushing ───────────▶ Persisted
//!    ▲  ◀────────────────── │               └──────────◀───────────┴────────◀───────────┘
//!    │   StagingSlot dropped                     (set_state moves between any of the three)
//!    │   unsealed, or a failed grow
//!    │
//!    ├──── release / set_state(Free), once the last pin drops ◀── Resident, Flushing, Persisted
//!    │
//!    └ (acquire also takes the unpinned Persisted slot with the oldest step ─▶ Staging)
//! ```
//!
//! - **Free**: holds nothing; [`Ring::acquire`] takes it first.
//! - **Staging**: owned by exactly one [`StagingSlot`], the only writer of
//!   the image area. Never pinned, never handed out twice.
//! - **Resident / Flushing / Persisted**: the image is complete and
//!   read-only; any number of [`PinnedSlot`]s read it. The flush moves it
//!   along with [`Ring::set_state`].
//! - [`Ring::acquire`] takes a `Free` slot, else the unpinned `Persisted`
//!   slot with the oldest step; never a pinned, `Staging`, `Resident` or
//!   `Flushing` one. [`Ring::release`] frees a complete slot, at once or
//!   when its last pin drops (it stops being listed or pinnable at once).
//!
//! In a process, the table of states and pin counts behind one mutex is
//! the truth, and every state change is written through to the control
//! block; control-block bytes are only touched with that mutex held. The
//! image area is written only through a `StagingSlot`, which exists only
//! while its slot is `Staging` with no pin, and read only through
//! `PinnedSlot`s, which exist only while it is complete; this is what makes
//! handing the same mapping to several threads sound.
//!
//! # Write order, and what a process death leaves
//!
//! Acquire stores the state `Staging` before it changes anything else.
//! Seal stores `step` and `image_len` after the caller's image bytes, then
//! a release fence, then the state word `Resident`. Digests are recorded
//! with `digests_valid = 0` first and `1` last; freeing clears
//! `digests_valid` before the state becomes `Free`. A process death (even
//! `SIGKILL`) loses no store already made: the bytes are in the shared
//! file, not in the process. So the next [`Ring::open`] finds:
//!
//! | state at death | what the next open does |
//! |---|---|
//! | `Free` | nothing to recover; the slot is reused |
//! | `Staging` (mid-acquire, mid-copy, or mid-seal before the state store) | the image is incomplete: reset to `Free` and counted in [`RingReport::discarded_half_staged`] |
//! | `Resident` | recovered intact: the checkpoint was not flushed, so the new process (or `acp persist`) can flush it |
//! | `Flushing` | recovered intact; the flush may have written part of a file, which was never committed, so it is flushed again |
//! | `Persisted` | recovered intact; it is already in storage and is a fast restore source |
//! | between the digest stores | `digests_valid` is `0`: image recovered without digests |
//!
//! A slot being regrown (ftruncate/fallocate) when its process died is in
//! `Staging` and discarded likewise; a file cut short is caught by the
//! `capacity` check. Files of indices past [`RingOptions::slots`] are
//! neither opened nor removed.
//!
//! # Memory
//!
//! The budget is split evenly: each slot may use `budget / slots` bytes
//! (rounded down to 4096), control area included; the largest image is
//! [`Ring::max_image_bytes`]. A slot's file is sized to the control area
//! plus the image length rounded up to 2 MiB (at most the per-slot share),
//! so small changes in size reuse it. Growing `ftruncate`s and
//! `fallocate`s the file (a full tmpfs fails there with `ENOSPC` instead of
//! `SIGBUS` later), maps it with `MAP_POPULATE`, writes each page once, and
//! `mlock`s it when asked. A slot grows only when taken by `acquire`, so
//! steady-state saves touch no fresh page. `mlock` failure (an ordinary
//! user past `RLIMIT_MEMLOCK`, without `CAP_IPC_LOCK`) is reported in
//! [`RingReport`] and [`Ring::mlock_state`], never fatal: the slots stay
//! pre-faulted. A recovered slot larger than the current per-slot share
//! (the budget shrank) is kept until reused, then shrunk.

#![allow(
    unsafe_code,
    reason = "slots are shared memory mappings handed to several threads"
)]

mod control;
mod dir;
mod open;
mod origin;
mod peek;
mod peer;
mod rings;
mod slot;
mod table;

use std::path::PathBuf;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::format::Digest;

use control::{round_up, PAGE};
use slot::Image;
use table::Inner;

pub use dir::{
    job_id, job_tag, ring_prefix, slot_file_name, slot_files, slot_path, user_dir, user_dir_name,
    SlotDir, SlotFile,
};
pub use origin::{read_origin, Origin};
pub use peek::{peek_file, peek_slot, SlotPeek};
pub use peer::{PeerImage, PeerSlot};
pub use rings::{rings, HeldRing, RingFiles, SlotSeen};

/// Where and how big the ring is.
#[derive(Debug, Clone)]
pub struct RingOptions {
    /// The shared-memory directory, e.g. `/dev/shm`: the slot files live
    /// in its per-user directory [`user_dir`]`(dir)`.
    pub dir: PathBuf,
    /// File name prefix, unique per job and rank, e.g.
    /// `acp-0123456789abcdef-r00000` ([`ring_prefix`]).
    pub prefix: String,
    /// blake3 of the job id; stored in each control block and checked on open.
    pub job_tag: Digest,
    /// The rank; stored and checked like `job_tag`.
    pub rank: u32,
    /// Number of slots.
    pub slots: usize,
    /// Memory budget over all slots (control blocks included), in bytes.
    pub budget: u64,
    /// Digest chunk size, to size each slot's digest area.
    pub chunk_bytes: u64,
    /// Try to `mlock` the slots.
    pub mlock: bool,
}

/// The state of a slot, as stored in its control block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Holds nothing.
    Free,
    /// Being written; its image is incomplete.
    Staging,
    /// Holds a complete image not yet flushed.
    Resident,
    /// Holds a complete image being flushed.
    Flushing,
    /// Holds a complete image that is committed in storage.
    Persisted,
}

/// A slot that holds a complete image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    /// Slot index.
    pub slot: usize,
    /// The step of its image.
    pub step: u64,
    /// The image length.
    pub len: u64,
    /// Its state (`Resident`, `Flushing` or `Persisted`).
    pub state: SlotState,
    /// Whether chunk digests are recorded for it.
    pub has_digests: bool,
}

/// What opening the ring found and did.
#[derive(Debug, Clone, Default)]
pub struct RingReport {
    /// Whether every slot is locked in RAM: `mlock` was asked for, every
    /// slot mapped at open was locked, and the process may lock the whole
    /// budget (`CAP_IPC_LOCK`, or `RLIMIT_MEMLOCK` at least the budget).
    pub mlocked: bool,
    /// Why `mlock` was refused, when it was.
    pub mlock_error: Option<String>,
    /// Complete images left by a previous process of this job and rank,
    /// newest step first.
    pub recovered: Vec<SlotInfo>,
    /// Slots found half-staged (their process died while staging); reset to Free.
    pub discarded_half_staged: usize,
}

/// The ring of one job and rank. Cheap to clone; all clones share the slots.
#[derive(Debug, Clone)]
pub struct Ring {
    inner: Arc<Inner>,
}

/// Exclusive write access to one slot in state `Staging`. Dropping it
/// without [`StagingSlot::seal`] returns the slot to `Free`.
#[derive(Debug)]
pub struct StagingSlot {
    ring: Arc<Inner>,
    slot: usize,
    image: Image,
    sealed: bool,
}

/// Shared read access to a slot holding a complete image. While any clone
/// is alive the slot is not reused.
#[derive(Debug)]
pub struct PinnedSlot {
    ring: Arc<Inner>,
    slot: usize,
    image: Image,
    step: u64,
    len: usize,
    generation: u64,
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
        self.take(len, wait, true)
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
        while let Some(slot) = self.take(len, None, false)? {
            held.push(slot); // dropped unsealed below: `Free` again, memory kept
        }
        Ok(held.len())
    }

    fn take(&self, len: u64, wait: Option<Duration>, evict: bool) -> Result<Option<StagingSlot>> {
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
        let slot = loop {
            if let Some(i) = inner.pick(&t, len, evict) {
                break i;
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
        drop(t);

        let mut mlock_error = None;
        let prepared = inner.prepare(slot, len, old, generation, &mut mlock_error);
        let mut t = inner.lock();
        if let Some(why) = mlock_error {
            tracing::warn!(
                "{}: {why}; the slot stays pre-faulted but unlocked",
                inner.what()
            );
            t.mlock_ok = false;
            t.mlock_error = Some(why);
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

impl StagingSlot {
    /// The slot index.
    #[must_use]
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The whole writable image area: 4096-aligned, at least the `len`
    /// asked for rounded up to 4096.
    pub fn image_mut(&mut self) -> &mut [u8] {
        // SAFETY: `acquire` created this `StagingSlot` for a slot it marked
        // `Staging` under the table lock, having picked it with no pin.
        // While the slot is `Staging`, `pin` refuses it and `acquire` does
        // not pick it, and `StagingSlot` is not `Clone`, so no other image
        // handle of this mapping is used; the returned slice borrows
        // `self` mutably, so no other slice from this handle coexists.
        unsafe { self.image.bytes_mut() }
    }

    /// Declares the image complete: stores `step` and `len`, then the state
    /// `Resident` (in that order, so a death before the state store leaves
    /// the slot `Staging`), and pins it. The bytes from `len` to the next
    /// multiple of 4096 are zeroed (they are part of
    /// [`PinnedSlot::padded`]). A `len` past the image area is a caller
    /// bug: it is logged and cut to the area.
    #[must_use]
    pub fn seal(mut self, step: u64, len: u64) -> PinnedSlot {
        let cap = self.image.capacity();
        let len = match usize::try_from(len) {
            Ok(l) if l <= cap => l,
            _ => {
                tracing::error!(
                    "{}: slot {}: sealed length {len} exceeds the image area of {cap} bytes; cut",
                    self.ring.what(),
                    self.slot
                );
                cap
            }
        };
        let padded =
            round_up(len as u64, PAGE).map_or(cap, |p| usize::try_from(p).unwrap_or(cap).min(cap));
        self.image_mut()[len..padded].fill(0);

        let ring = Arc::clone(&self.ring);
        let mut t = ring.lock();
        let mut generation = 0;
        if let Some(e) = t.slots.get_mut(self.slot) {
            generation = e.generation;
            if let Some(m) = &mut e.mem {
                m.ctrl.set_image(step, len as u64);
                m.ctrl.set_state(SlotState::Resident);
            }
            e.state = SlotState::Resident;
            e.step = step;
            e.len = len as u64;
            e.pins += 1;
        }
        drop(t);
        self.sealed = true;
        PinnedSlot {
            ring,
            slot: self.slot,
            image: self.image.clone(),
            step,
            len,
            generation,
        }
    }
}

impl Drop for StagingSlot {
    fn drop(&mut self) {
        if self.sealed {
            return;
        }
        let mut t = self.ring.lock();
        if let Some(e) = t.slots.get_mut(self.slot) {
            e.free();
        }
        drop(t);
        self.ring.freed.notify_all();
    }
}

impl PinnedSlot {
    /// The slot index.
    #[must_use]
    pub fn slot(&self) -> usize {
        self.slot
    }

    /// The step of the image.
    #[must_use]
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The slot's generation, which names this image: each
    /// [`Ring::acquire`] of the slot changes it.
    #[must_use]
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The image (exactly its length).
    #[must_use]
    pub fn image(&self) -> &[u8] {
        // SAFETY: this pin keeps the slot's pin count above zero, so
        // `acquire` does not hand the slot out and no `StagingSlot` of it
        // exists (one exists only for a `Staging` slot, and `pin` and
        // `seal` create pins only for complete slots, after the staging
        // handle's last write); nothing else writes the image area.
        unsafe { self.image.bytes(self.len) }
    }

    /// The image padded to a multiple of 4096, 4096-aligned (for `O_DIRECT`).
    #[must_use]
    pub fn padded(&self) -> &[u8] {
        let padded = round_up(self.len as u64, PAGE)
            .and_then(|p| usize::try_from(p).ok())
            .unwrap_or(usize::MAX);
        // SAFETY: as in `image`: the pin excludes every writer.
        unsafe { self.image.bytes(padded) }
    }
}

impl Clone for PinnedSlot {
    fn clone(&self) -> Self {
        let mut t = self.ring.lock();
        if let Some(e) = t.slots.get_mut(self.slot) {
            e.pins += 1;
        }
        drop(t);
        PinnedSlot {
            ring: Arc::clone(&self.ring),
            slot: self.slot,
            image: self.image.clone(),
            step: self.step,
            len: self.len,
            generation: self.generation,
        }
    }
}

impl Drop for PinnedSlot {
    fn drop(&mut self) {
        let mut t = self.ring.lock();
        if let Some(e) = t.slots.get_mut(self.slot) {
            e.pins = e.pins.saturating_sub(1);
            if e.pins == 0 && e.free_on_unpin {
                e.free();
            }
        }
        drop(t);
        self.ring.freed.notify_all();
    }
}
