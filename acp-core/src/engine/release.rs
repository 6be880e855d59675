//! `release_on_close`: removing this rank's ring files, and the replica
//! rings it holds for other ranks, once the flush queue has drained,
//! unless a step would be lost with them. The rule is
//! [`retention::is_only_copy`](super::retention::is_only_copy)'s, the one
//! `acp gc --shm` applies: a step is kept when it is neither committed in
//! the root nor superseded there by a newer committed step.

use super::state::Shared;

/// Removes this rank's ring files when every resident step is committed
/// (or superseded by a newer committed step), and its replica rings when
/// every replica step they hold is; otherwise keeps them and warns,
/// naming the steps. A ring keeps its open files (their memory goes with
/// the last mapping), so a clone of the engine still reading a pinned slot
/// is unaffected. Never fails: what it cannot do is logged. Returns the
/// steps that kept a ring, ascending (empty when every ring was removed;
/// every resident or held step of a ring when the root could not be
/// listed).
pub(super) fn release_ring(shared: &Shared) -> Vec<u64> {
    let resident: Vec<u64> = shared.ring.complete().iter().map(|s| s.step).collect();
    let mut kept = release(shared, "the ring", &resident, || shared.ring.unlink_all());
    let held: Vec<u64> = shared.replicas.held().iter().map(|m| m.step).collect();
    if held.is_empty() {
        // No complete replica: nothing to lose, and no root to list.
        shared.replicas.unlink_all();
    } else {
        kept.extend(release(shared, "the replica rings", &held, || {
            shared.replicas.unlink_all();
        }));
    }
    kept.sort_unstable();
    kept.dedup();
    kept
}

/// Calls `unlink` when none of `steps` is the only copy of its step;
/// returns the steps that prevented it.
fn release(shared: &Shared, what: &str, steps: &[u64], unlink: impl FnOnce()) -> Vec<u64> {
    match super::retention::only_copies(&*shared.root, steps) {
        Ok(only) if only.is_empty() => {
            unlink();
            only
        }
        Ok(only) => {
            tracing::warn!(
            steps = ?only,
            root = %shared.root.location().display(),
            "acp: release_on_close: {what} is kept: it holds the only copy of step(s) {only:?} \
             (not committed; `acp persist` commits it, `acp gc --shm --force` drops it)"
            );
            only
        }
        Err(e) => {
            tracing::warn!("acp: release_on_close: {what} is kept: {e}");
            steps.to_vec()
        }
    }
}
