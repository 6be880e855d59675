//! Summing RAM snapshots: the per-chunk quick sums that make a snapshot
//! that is not persisted verifiable, so `load` can serve it from RAM.
//!
//! A persisted save gets blake3 digests (and the quick sums beside them)
//! from its flush, which hashes each chunk as it writes it. A snapshot the
//! policy keeps resident only is summed on the flush thread (low priority,
//! behind any persist already queued, one thread): xxh3 only, nothing
//! written, several times cheaper than blake3 per core. Coalesced like the
//! persists: one snapshot waits to be summed at a time, the newest; a newer
//! one takes its place, so a snapshot superseded before its turn is never
//! summed. The sums go into the slot's control block
//! ([`Ring::record_sums_alone`]), bound to the image (step, length, slot
//! generation), while the slot is pinned and still holds that image, before
//! any load can read them; a load checks the slot's bytes against them, so
//! a byte changed in RAM after they were taken is caught. Bytes changed
//! between the seal and the sums are not, as for a persisted save between
//! seal and flush: the sums vouch for the image from the moment they were
//! taken.
//!
//! A snapshot has no digests of record until it is persisted or sent to a
//! replica holder: the flush (or the replica send, `replicate::hash_once`)
//! then hashes it with blake3, and each chunk must still give the sum
//! taken here, or it changed in RAM since and is not committed (or sent)
//! under the new digests. `read/fast.rs` says what the sums prove, and
//! why they stand for the image in RAM as well as recorded blake3
//! digests would: both live in the same slot file, written by the same
//! process.
//!
//! [`Ring::record_sums_alone`]: crate::staging::Ring::record_sums_alone

use super::state::{EngineState, Shared, Snapshot};
use crate::staging::SlotInfo;

impl Shared {
    /// Makes `snap` (a RAM snapshot just kept resident) the one waiting to
    /// be hashed, in place of any older one. Returns whether the flush
    /// thread must be woken: no wake-up is on its way yet. Called with the
    /// state locked.
    pub(super) fn want_hash(st: &mut EngineState, snap: Snapshot) -> bool {
        st.to_hash = Some(snap);
        !std::mem::replace(&mut st.hash_woken, true)
    }
}

/// The flush thread's turn at hashing: the snapshot waiting to be hashed,
/// if any (a wake-up may find it already taken by an earlier one).
/// [`Engine::wait_idle`](super::Engine::wait_idle) waits for it.
pub(super) fn hash_waiting(shared: &Shared) {
    let next = {
        let mut st = shared.lock();
        st.hash_woken = false;
        let next = st.to_hash.take();
        st.hashing = next.is_some();
        next
    };
    if let Some(s) = next {
        // One thread, off the training's way (a replica send does not
        // wait for these sums: it hashes the image itself).
        hash_slot(shared, s.slot, Some(s.generation), s.step, 1);
        shared.lock().hashing = false;
        shared.idle.notify_all();
    }
}

impl EngineState {
    /// Whether no flush, no hash and no re-read of a restored step
    /// (`reside.rs`) is queued or running.
    pub(super) fn idle(&self) -> bool {
        self.in_flight == 0
            && !self.hash_woken
            && !self.hashing
            && !self.reside_woken
            && self.residing.is_none()
            && !self.unsettled
    }
}

/// Sums the image of `step` in slot `slot` on `threads` threads and
/// records the sums ([`Ring::record_sums_alone`]), unless the slot no
/// longer holds that image (another generation, when `generation` is
/// given), holds no complete image, or is verifiable already (digests
/// recorded by its flush, a replica send or a verified read, or sums by
/// an earlier call). Returns whether the slot is verifiable afterwards.
///
/// [`Ring::record_sums_alone`]: crate::staging::Ring::record_sums_alone
pub(super) fn hash_slot(
    shared: &Shared,
    slot: usize,
    generation: Option<u64>,
    step: u64,
    threads: usize,
) -> bool {
    let ring = &shared.ring;
    // The pin keeps this image in the slot while it is summed: the slot is
    // neither freed nor acquired again until the pin drops.
    let Ok(pin) = ring.pin(slot) else {
        return false;
    };
    if pin.step() != step || generation.is_some_and(|g| g != pin.generation()) {
        return false;
    }
    let summed = || ring.digests(slot).is_some() || ring.sums_alone(slot).is_some();
    if summed() {
        return true;
    }
    // A replica send sums (or hashes) the same image as soon as the save
    // returns: the second of the two takes the first one's result.
    let _hashing = shared.replicas.hashing();
    if summed() {
        return true;
    }
    let sums = crate::read::chunk_sums(pin.image(), shared.cfg.chunk_bytes, threads);
    // Not recorded when digests were recorded meanwhile (a flush or a
    // replica send of the same image), or the slot was released
    // (superseded): either way nothing more is needed.
    if ring.record_sums_alone(slot, pin.generation(), &sums) {
        tracing::debug!(step, slot, "acp: RAM snapshot summed");
    }
    summed()
}

/// At open: sums the images of `recovered` (slots a previous process
/// left, to be persisted) that have neither digests nor sums, on
/// `threads` threads.
///
/// A process killed before its newest snapshot was persisted (or summed)
/// leaves a sealed image with neither. It could be made loadable by
/// waiting for persist-on-open's write to storage, which hashes it on the
/// way; instead it is summed here, at memory speed and before training
/// starts (nothing competes with it yet), so `load` serves it from RAM,
/// checked against sums recorded before the load reads it, while the
/// write to storage runs in the background. The seal protocol guarantees
/// that a slot listed as complete holds a whole image (a half-staged one
/// is discarded at open), so summing it records what the previous process
/// sealed, unless its bytes changed in RAM after the seal, which no sum
/// taken later can tell.
pub(super) fn hash_recovered(shared: &Shared, recovered: &[SlotInfo], threads: usize) {
    for info in recovered {
        let summed = info.has_digests || shared.ring.sums_alone(info.slot).is_some();
        if !summed && hash_slot(shared, info.slot, None, info.step, threads) {
            tracing::info!(
                step = info.step,
                "acp: summed the resident step a previous process left, to restore it from RAM"
            );
        }
    }
}
