//! Hashing RAM snapshots: the chunk digests that make a snapshot that is
//! not persisted verifiable, so `load` can serve it from RAM.
//!
//! A persisted save gets its digests from its flush, which hashes each
//! chunk as it writes it. A snapshot the policy keeps resident only is
//! hashed on the flush thread (low priority, behind any persist already
//! queued; on one thread, or on the copy threads for a rank that takes
//! part in a replica exchange, whose send waits for this hash): hash
//! only, nothing written. Coalesced like the persists: one
//! snapshot waits to be hashed at a time, the newest; a newer one takes its
//! place, so a snapshot superseded before its turn is never hashed. The
//! digests go into the slot's control block ([`Ring::set_digests`]) while
//! the slot is pinned and still holds that image (same generation), before
//! any load can read them; a load then checks the slot's bytes against them
//! exactly as it checks a persisted slot against its index, so a byte
//! changed in RAM after the hash is caught. Bytes changed between the seal
//! and the hash are not, as for a persisted save between seal and flush:
//! the digests vouch for the image from the moment they were taken.
//!
//! [`Ring::set_digests`]: crate::staging::Ring::set_digests

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
        // One thread, off the training's way; but a rank whose images go
        // to replica holders sends this snapshot too, and its send waits
        // for this hash (the two share it, `replicate::hash_once`): then
        // the hash is on the replication's path and takes the copy
        // threads, as the send would have.
        let threads = if shared.sends_replicas() {
            shared.cfg.copy_threads
        } else {
            1
        };
        hash_slot(shared, s.slot, Some(s.generation), s.step, threads);
        shared.lock().hashing = false;
        shared.idle.notify_all();
    }
}

impl EngineState {
    /// Whether no flush and no hash is queued or running.
    pub(super) fn idle(&self) -> bool {
        self.in_flight == 0 && !self.hash_woken && !self.hashing && !self.unsettled
    }
}

/// Hashes the image of `step` in slot `slot` on `threads` threads and
/// records its digests, unless the slot no longer holds that image (another
/// generation, when `generation` is given), holds no complete image, or
/// already has digests (its flush, or a replica send, recorded them).
/// Returns whether the slot has digests afterwards.
pub(super) fn hash_slot(
    shared: &Shared,
    slot: usize,
    generation: Option<u64>,
    step: u64,
    threads: usize,
) -> bool {
    let ring = &shared.ring;
    // The pin keeps this image in the slot while it is hashed: the slot is
    // neither freed nor acquired again until the pin drops.
    let Ok(pin) = ring.pin(slot) else {
        return false;
    };
    if pin.step() != step || generation.is_some_and(|g| g != pin.generation()) {
        return false;
    }
    if ring.digests(slot).is_some() {
        return true;
    }
    // With the quick sums, under the lock the flush and the replica send
    // hash under (`replicate::hash_once`), so none of them hashes this
    // image again: a load checks the sums, and a persist of the snapshot
    // takes these digests, checking each chunk's sum as it writes it. A
    // slot released meanwhile (superseded) ignores them.
    let path = ring.slot_path(slot);
    match super::replicate::hash_once(
        shared,
        slot,
        pin.generation(),
        pin.image(),
        true,
        threads,
        &path,
    ) {
        Ok(_) => tracing::debug!(step, slot, "acp: RAM snapshot hashed"),
        Err(e) => {
            tracing::warn!(step, "acp: RAM snapshot not hashed: {e}");
            return false;
        }
    }
    ring.digests(slot).is_some()
}

/// At open: hashes the images of `recovered` (slots a previous process
/// left, to be persisted) that have no digests, on `threads` threads.
///
/// A process killed before its newest snapshot was persisted (or hashed)
/// leaves a sealed image without digests. It could be made loadable by
/// waiting for persist-on-open's write to storage, which hashes it on the
/// way; instead it is hashed here, at memory speed and before training
/// starts (nothing competes with it yet), so `load` serves it from RAM,
/// verified against digests recorded before the load reads it, while the
/// write to storage runs in the background. The seal protocol guarantees
/// that a slot listed as complete holds a whole image (a half-staged one
/// is discarded at open), so hashing it records what the previous process
/// sealed, unless its bytes changed in RAM after the seal, which no
/// digest taken later can tell.
pub(super) fn hash_recovered(shared: &Shared, recovered: &[SlotInfo], threads: usize) {
    for info in recovered {
        if !info.has_digests && hash_slot(shared, info.slot, None, info.step, threads) {
            tracing::info!(
                step = info.step,
                "acp: hashed the resident step a previous process left, to restore it from RAM"
            );
        }
    }
}
