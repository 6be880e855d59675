//! The two handles [`Ring`](super::Ring) gives out on a slot:
//! [`StagingSlot`] (exclusive write, while `Staging`) and [`PinnedSlot`]
//! (shared read of a complete image), and the pin counting that keeps a
//! pinned slot from being reused.

use std::sync::Arc;

use super::control::{round_up, PAGE};
use super::slot::Image;
use super::table::Inner;
use super::SlotState;

/// Exclusive write access to one slot in state `Staging`. Dropping it
/// without [`StagingSlot::seal`] returns the slot to `Free`.
#[derive(Debug)]
pub struct StagingSlot {
    pub(super) ring: Arc<Inner>,
    pub(super) slot: usize,
    pub(super) image: Image,
    pub(super) sealed: bool,
}

/// Shared read access to a slot holding a complete image. While any clone
/// is alive the slot is not reused.
#[derive(Debug)]
pub struct PinnedSlot {
    pub(super) ring: Arc<Inner>,
    pub(super) slot: usize,
    pub(super) image: Image,
    pub(super) step: u64,
    pub(super) len: usize,
    pub(super) generation: u64,
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
    /// [`Ring::acquire`](super::Ring::acquire) of the slot changes it.
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
