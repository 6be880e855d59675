//! Making a step restored from storage resident again.
//!
//! A load from storage lands in a ring slot only when one is ready for the
//! image (`load.rs`, `read_stored`): on a new node's ring, fresh slot
//! memory costs more than the read, so the file is streamed into the
//! caller's tensors, or read into private memory, and no slot holds the
//! step. Until the next save, a crash would then restore from storage
//! again. So, after such a load of this rank's own file, the flush thread
//! reads the file once more into a slot (growing it if the slot warming
//! has not yet), checks every chunk against the index as any read does,
//! takes the chunks' quick sums for the next load from RAM, and marks the
//! slot `Persisted` with the step's digests: the step is resident again,
//! as a load from a ready slot would have left it.
//!
//! It runs behind any persist already queued, at the flush thread's lower
//! priority, on one thread, and only while nothing newer is in the ring: a
//! save sealed before it starts (or before it ends) makes it moot, and the
//! slot goes back to the ring unsealed; a save of a step not older that
//! begins meanwhile drops it, or stops it at its next checked read. A
//! failed read is logged and leaves
//! nothing behind: the step is still on storage, which is where the load
//! found it. [`Engine::wait_idle`](super::Engine::wait_idle) waits for it;
//! a close skips one that has not started and stops one that has at its
//! next checked read (as does the drop of the engine's last handle).

use std::sync::Arc;
use std::time::Instant;

use super::load::StoredFile;
use super::state::{EngineState, Shared};
use super::Engine;
use crate::error::Result;
use crate::read::OnChecked;

/// A restored step waiting to be read again into a slot.
#[derive(Debug)]
pub(super) struct Reside {
    file: StoredFile,
    /// When its load finished, for the log.
    since: Instant,
}

impl Engine {
    /// After a load of this rank's `file` from storage that no ring slot
    /// held: asks the flush thread to read it again into a slot, unless
    /// `keep_restored` is off, its chunks are not the ring's, or the ring
    /// cannot hold two such images (a single slot, or a budget shared by
    /// slots that fits one: the next save would wait for the re-read's
    /// slot, or be skipped with `on_full` = skip).
    pub(super) fn keep_restored(&self, file: &StoredFile) {
        let shared = self.shared();
        if !shared.cfg.keep_restored || !file.own || !shared.ring.holds_two(file.entry.size) {
            return;
        }
        // The ring records digests and sums per chunk of its own size.
        if file.entry.chunk_bytes != shared.cfg.chunk_bytes as u64 {
            tracing::info!(
                step = file.step,
                "acp: the restored step is not kept resident: it was written in chunks of {} bytes, this engine's are {} (chunk_bytes)",
                file.entry.chunk_bytes,
                shared.cfg.chunk_bytes
            );
            return;
        }
        let Some(file) = file.reopened() else {
            return;
        };
        let wake = {
            let mut st = shared.lock();
            if st.closed {
                return;
            }
            st.to_reside = Some(Reside {
                file,
                since: Instant::now(),
            });
            !std::mem::replace(&mut st.reside_woken, true)
        };
        if wake {
            self.wake_resider();
        }
    }

    /// Gives up making a restored step resident again (`keep_restored`):
    /// one waiting is dropped, and one being read stops at its next
    /// checked read, its slot going back to the ring unsealed. Nothing is
    /// lost: the step is on storage, where its load found it. The dying
    /// checkpoint calls it: a process about to exit spends its last
    /// seconds on what protects data, and a re-read only saves the next
    /// restart on this node a read from storage. A later restore from
    /// storage is kept resident again as before.
    pub fn stop_keeping_restored(&self) {
        give_up_upto(&mut self.shared().lock(), u64::MAX);
    }
}

/// Gives up the re-read of a restored step not newer than `step`: one
/// waiting is dropped, one running stops at its next checked read. A save
/// of `step` that begins calls it: the re-read is moot (the save's image
/// will be the newest resident one, and a re-read that ends after the
/// save's seal is dropped unsealed anyway), and it would hold a slot the
/// save waits for, or take the disk and a core from the save's flush.
pub(super) fn give_up_upto(st: &mut EngineState, step: u64) {
    if st.to_reside.as_ref().is_some_and(|r| r.file.step <= step) {
        st.to_reside = None;
    }
    if st.residing.is_some_and(|s| s <= step) {
        st.reside_stop = true;
    }
}

/// The flush thread's turn at the restored step waiting to be made
/// resident, if any (a wake-up may find it taken by an earlier one).
pub(super) fn reside_waiting(shared: &Arc<Shared>) {
    let next = {
        let mut st = shared.lock();
        st.reside_woken = false;
        let next = st.to_reside.take().filter(|_| !st.closed);
        st.residing = next.as_ref().map(|r| r.file.step);
        next
    };
    if let Some(r) = next {
        let step = r.file.step;
        match reside(shared, &r) {
            Ok(true) => tracing::debug!(
                step,
                secs = r.since.elapsed().as_secs_f64(),
                "acp: the restored step is resident again"
            ),
            Ok(false) => {}
            Err(e) if stopped(shared) => tracing::debug!(
                step,
                "acp: reading the restored step again into RAM stopped: {e}"
            ),
            Err(e) => tracing::warn!(
                step,
                "acp: the restored step stays on storage only (reading it again into RAM failed): {e}"
            ),
        }
        let mut st = shared.lock();
        st.residing = None;
        st.reside_stop = false;
        st.progress = None;
        drop(st);
        shared.idle.notify_all();
    }
}

/// Whether the running re-read was asked to stop (a close, the drop of
/// the last handle, [`Engine::stop_keeping_restored`]).
fn stopped(shared: &Shared) -> bool {
    given_up(&shared.lock())
}

/// [`stopped`] with the state's lock held.
fn given_up(st: &EngineState) -> bool {
    st.closed || st.reside_stop
}

/// Whether an image newer than `step`, or `step` itself, is in the ring
/// or has been sealed by a save.
fn superseded(shared: &Shared, step: u64) -> bool {
    superseded_in(shared, &shared.lock(), step)
}

/// [`superseded`] with the state's lock held (the ring's is taken after
/// it, the order used throughout).
fn superseded_in(shared: &Shared, st: &EngineState, step: u64) -> bool {
    st.counts.newest_snapshot.is_some_and(|(s, _)| s >= step)
        || shared.ring.complete().iter().any(|s| s.step >= step)
}

/// Reads `r`'s file into a slot and seals it there; `Ok(false)` when
/// that became moot (a newer image) or no slot is free.
fn reside(shared: &Arc<Shared>, r: &Reside) -> Result<bool> {
    let file = &r.file;
    let (step, size) = (file.step, file.entry.size);
    if superseded(shared, step) {
        return Ok(false);
    }
    // The watchdog's note, renewed as each read is checked: a read that
    // hangs is reported as a stuck flush would be, however long the file.
    let doing = format!(
        "step {step}: reading {} again into a ring slot",
        file.path.display()
    );
    shared.note_progress(doing.clone());
    // A free slot (grown now when the warming has not grown it yet), else
    // the oldest persisted one, never one of a newer step (a load may have
    // sealed one since the check above).
    let Some(mut slot) = shared.ring.acquire_upto(size, step)? else {
        return Ok(false);
    };
    shared.note_progress(doing.clone());
    let chunk = super::to_usize(file.entry.chunk_bytes);
    let io_chunk = shared.io_opts.chunk_bytes;
    let noted = Arc::clone(shared);
    // A close (or the last handle's drop) stops the read at its next
    // check: nobody is left to load what it would make resident.
    let note = OnChecked(Arc::new(move || {
        noted.note_progress(doing.clone());
        !stopped(&noted)
    }));
    let digests = super::load::with_reader(shared, file, &mut |reader| {
        reader.on_checked(note.clone());
        reader.read_verified_into(slot.image_mut(), 1, io_chunk, Vec::new())
    })?;
    let sums = crate::read::chunk_sums(&slot.image_mut()[..super::to_usize(size)], chunk, 1);
    // Sealed under the state's lock, after a last look: a save that began
    // (or sealed), a close or a stop since the last checked read makes it
    // moot, and none can come between the look and the seal.
    let st = shared.lock();
    if given_up(&st) || superseded_in(shared, &st, step) {
        // Dropped unsealed: the slot is free.
        return Ok(false);
    }
    let pin = super::load::seal_stored(&shared.ring, slot, step, size, &digests);
    shared.ring.record_quick_sums(pin.slot(), &digests, &sums);
    drop(st);
    Ok(true)
}
