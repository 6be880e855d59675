//! The shared-memory ring: named slots that hold checkpoint images in RAM.
//!
//! (Owner: ring helper. Document the control block byte by byte here, the
//! state machine, and what a process death at each point leaves.)
//!
//! Each slot is a file `{dir}/{prefix}-s{index}` (mode 0600) mapped shared.
//! Its first bytes are a control block (magic, version, job tag, rank,
//! state, step, image length, capacity, digests); the image starts at a
//! 4096-aligned offset after it. The files are locked with `flock` for the
//! life of the [`Ring`], so a second live process of the same job and rank
//! is refused and a dead one's slots are found again by the next.
//!
//! States: `Free → Staging → Resident → Flushing → Persisted → (reused)`.
//! Only `Resident`, `Flushing` and `Persisted` slots hold a complete image;
//! a slot found in `Staging` was being written when its process died and is
//! never taken as a checkpoint.

#![allow(
    unsafe_code,
    reason = "slots are shared memory mappings handed to several threads"
)]

use std::path::PathBuf;
use std::time::Duration;

use crate::error::Result;
use crate::format::Digest;

/// Where and how big the ring is.
#[derive(Debug, Clone)]
pub struct RingOptions {
    /// Directory of the slot files, e.g. `/dev/shm`.
    pub dir: PathBuf,
    /// File name prefix, unique per job and rank, e.g. `acp-0123456789abcdef-r00000`.
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
    /// Whether every slot is locked in RAM.
    pub mlocked: bool,
    /// Why `mlock` was refused, when it was.
    pub mlock_error: Option<String>,
    /// Complete images left by a previous process of this job and rank.
    pub recovered: Vec<SlotInfo>,
    /// Slots found half-staged (their process died while staging); reset to Free.
    pub discarded_half_staged: usize,
}

/// The ring of one job and rank. Cheap to clone; all clones share the slots.
#[derive(Debug, Clone)]
pub struct Ring {
    // (ring helper: Arc<Inner> with the slots, a Mutex'd table and a Condvar)
}

/// Exclusive write access to one slot in state `Staging`. Dropping it
/// without [`StagingSlot::seal`] returns the slot to `Free`.
#[derive(Debug)]
pub struct StagingSlot {
    // (ring helper)
}

/// Shared read access to a slot holding a complete image. While any clone
/// is alive the slot is not reused.
#[derive(Debug, Clone)]
pub struct PinnedSlot {
    // (ring helper)
}

impl Ring {
    /// Opens (creating as needed) the slot files, locks them with `flock`,
    /// reads their control blocks and reports complete images left by a
    /// previous process. Slot files are created lazily at their first use if
    /// absent; existing ones keep their size until a bigger image needs them.
    ///
    /// # Errors
    /// [`Error::Busy`](crate::Error::Busy) when another live process holds
    /// the slots (names the pid if known); [`Error::Io`](crate::Error::Io).
    pub fn open(opts: RingOptions) -> Result<(Ring, RingReport)> {
        todo!()
    }

    /// The largest image one slot may hold under the budget.
    #[must_use]
    pub fn max_image_bytes(&self) -> u64 {
        todo!()
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
    /// [`Error::Invalid`](crate::Error::Invalid) when `len` exceeds
    /// [`Ring::max_image_bytes`]; [`Error::Timeout`](crate::Error::Timeout);
    /// [`Error::Io`](crate::Error::Io) when growing fails.
    pub fn acquire(&self, len: u64, wait: Option<Duration>) -> Result<Option<StagingSlot>> {
        todo!()
    }

    /// The slots holding complete images, newest step first.
    #[must_use]
    pub fn complete(&self) -> Vec<SlotInfo> {
        todo!()
    }

    /// Pins slot `slot` for reading.
    ///
    /// # Errors
    /// [`Error::NotFound`](crate::Error::NotFound) when it holds no complete image.
    pub fn pin(&self, slot: usize) -> Result<PinnedSlot> {
        todo!()
    }

    /// Moves a complete slot between `Resident`, `Flushing` and `Persisted`.
    pub fn set_state(&self, slot: usize, state: SlotState) {
        todo!()
    }

    /// Records the chunk digests of slot `slot`'s image (computed by the flush
    /// or by a verified read). Ignored when they do not fit the digest area.
    pub fn set_digests(&self, slot: usize, digests: &[Digest]) {
        todo!()
    }

    /// The recorded digests of slot `slot`, if any.
    #[must_use]
    pub fn digests(&self, slot: usize) -> Option<Vec<Digest>> {
        todo!()
    }

    /// Marks slot `slot` `Free` (its image is dropped) once no pin holds it.
    pub fn release(&self, slot: usize) {
        todo!()
    }

    /// The file that backs slot `slot`, for messages.
    #[must_use]
    pub fn slot_path(&self, slot: usize) -> PathBuf {
        todo!()
    }

    /// Wakes waiters in [`Ring::acquire`] (after a state change made elsewhere).
    pub fn notify(&self) {
        todo!()
    }

    /// Unlinks the slot files (their memory is freed once unmapped). For
    /// tests and `acp gc --shm`; a normal close keeps them resident.
    pub fn unlink_all(&self) {
        todo!()
    }
}

impl StagingSlot {
    /// The slot index.
    #[must_use]
    pub fn slot(&self) -> usize {
        todo!()
    }

    /// The whole writable image area: 4096-aligned, at least the `len`
    /// asked for rounded up to 4096.
    pub fn image_mut(&mut self) -> &mut [u8] {
        todo!()
    }

    /// Declares the image complete: stores `step` and `len`, then the state
    /// `Resident` (in that order, so a death before the state store leaves
    /// the slot `Staging`), and pins it.
    #[must_use]
    pub fn seal(self, step: u64, len: u64) -> PinnedSlot {
        todo!()
    }
}

impl PinnedSlot {
    /// The slot index.
    #[must_use]
    pub fn slot(&self) -> usize {
        todo!()
    }

    /// The step of the image.
    #[must_use]
    pub fn step(&self) -> u64 {
        todo!()
    }

    /// The image (exactly its length).
    #[must_use]
    pub fn image(&self) -> &[u8] {
        todo!()
    }

    /// The image padded to a multiple of 4096, 4096-aligned (for `O_DIRECT`).
    #[must_use]
    pub fn padded(&self) -> &[u8] {
        todo!()
    }
}
