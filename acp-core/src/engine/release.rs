//! `release_on_close`: removing this rank's ring files once the flush
//! queue has drained, unless a resident step would be lost with them.

use super::state::Shared;

/// Removes this rank's ring files when every resident step is committed
/// (or superseded by a newer committed step); otherwise keeps them and
/// warns, naming the steps. The ring keeps its open files (their memory
/// goes with the last mapping), so a clone of the engine still reading a
/// pinned slot is unaffected. Never fails: what it cannot do is logged.
/// Returns the steps that kept the ring (empty when it was removed; every
/// resident step when the root could not be listed).
pub(super) fn release_ring(shared: &Shared) -> Vec<u64> {
    let resident: Vec<u64> = shared.ring.complete().iter().map(|s| s.step).collect();
    match super::retention::only_copies(&*shared.root, &resident) {
        Ok(only) if only.is_empty() => {
            shared.ring.unlink_all();
            only
        }
        Ok(only) => {
            tracing::warn!(
            steps = ?only,
            root = %shared.root.location().display(),
            "acp: release_on_close: the ring is kept: it holds the only copy of step(s) {only:?} \
             (not committed; `acp persist` commits it, `acp gc --shm --force` drops it)"
            );
            only
        }
        Err(e) => {
            tracing::warn!("acp: release_on_close: the ring is kept: {e}");
            resident
        }
    }
}
