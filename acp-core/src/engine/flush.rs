//! The flush thread: writes sealed slots to storage, hashes them on the way,
//! and commits each step.
//!
//! Commit protocol for step S of rank r (world size 1):
//! 1. create `.pending-S-rR-pid-nonce/` under the root;
//! 2. write `rank-R.safetensors` in it from the slot (O_DIRECT, chunks in
//!    flight), hashing each chunk before it is submitted; fsync it;
//! 3. write `model.safetensors.index.json` (sizes, digests, weight map);
//!    fsync it; fsync the pending directory;
//! 4. rename the pending directory to `step-S` (or exchange it atomically
//!    with the old `step-S` when overwriting); fsync the root — the commit;
//! 5. write the `latest` hint; mark the slot `Persisted`; apply retention.
//!
//! A crash before 4 leaves a pending directory that is never loaded and is
//! swept by the next engine of this rank; after 4 the step is complete.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Receiver;

use super::handle::Completion;
use super::{retain, SaveReport, Shared};
use crate::error::{Error, Result};
use crate::format::{
    data_file_name, hex, parse_header, root_digest, Digest, FileEntry, Index, FORMAT_VERSION,
    INDEX_FILE_NAME,
};
use crate::staging::{PinnedSlot, SlotState};

/// One sealed slot to flush and commit.
#[derive(Debug)]
pub(super) struct Job {
    pub(super) pin: PinnedSlot,
    pub(super) step: u64,
    pub(super) overwrite: bool,
    pub(super) done: Arc<Completion>,
    pub(super) started: Instant,
    pub(super) stall_secs: f64,
    pub(super) slot_wait_secs: f64,
    /// A slot left by a previous process (persist on open).
    pub(super) recovery: bool,
}

/// The flush thread's loop: one job at a time, in order, until the queue
/// closes.
pub(super) fn run(shared: &Shared, rx: &Receiver<Job>) {
    for job in rx {
        let slot = job.pin.slot();
        let step = job.step;
        let recovery = job.recovery;
        let done = Arc::clone(&job.done);
        let result = flush_one(shared, job);
        {
            let mut st = shared.lock();
            st.progress = None;
            st.recovering.retain(|s| *s != step);
            match &result {
                Ok(_) => {
                    // Older images whose flush failed are superseded now.
                    for s in std::mem::take(&mut st.failed_slots) {
                        shared.ring.release(s);
                    }
                }
                Err(e) => {
                    st.failed_slots.push(slot);
                    if recovery && st.unreported.is_none() {
                        st.unreported = Some(e.duplicate());
                    }
                }
            }
        }
        if let Err(e) = &result {
            tracing::error!(step, "acp: save failed: {e}");
            // The image stays resident (restorable) until the ring needs room.
            shared.ring.set_state(slot, SlotState::Resident);
        }
        shared.ring.notify();
        done.complete(result);
        let mut st = shared.lock();
        st.in_flight -= 1;
        drop(st);
        shared.idle.notify_all();
    }
}

fn flush_one(shared: &Shared, job: Job) -> Result<SaveReport> {
    let queue_secs = job.started.elapsed().as_secs_f64() - job.stall_secs;
    let step = job.step;
    let slot = job.pin.slot();
    shared.ring.set_state(slot, SlotState::Flushing);
    let root = &shared.root;
    let rank = shared.cfg.rank;
    let t_flush = Instant::now();
    let pending = root.create_pending(step, rank)?;
    let result = (|| {
        let file_name = data_file_name(rank);
        let path = pending.join(&file_name);
        let image = job.pin.image();
        let len = image.len() as u64;
        let chunk = shared.io_opts.chunk_bytes;
        let mut digests: Vec<Digest> = Vec::with_capacity(image.len().div_ceil(chunk.max(1)));
        shared.note_progress(format!("step {step}: writing {}", path.display()));
        let stats = shared.io.write_file(
            &path,
            job.pin.padded(),
            len,
            &shared.io_opts,
            &mut |i, bytes| {
                debug_assert_eq!(i, digests.len());
                digests.push(*blake3::hash(bytes).as_bytes());
                shared.note_progress(format!(
                    "step {step}: writing {} (chunk {i})",
                    path.display()
                ));
                Ok(())
            },
        )?;
        let flush_secs = t_flush.elapsed().as_secs_f64();
        shared.ring.set_digests(slot, &digests);

        let t_commit = Instant::now();
        shared.note_progress(format!("step {step}: committing in {}", pending.display()));
        let header = parse_header(&path, image, len)?;
        let index = Index {
            step,
            world_size: shared.cfg.world_size,
            format_version: FORMAT_VERSION,
            files: [(
                file_name.clone(),
                FileEntry {
                    rank,
                    size: len,
                    chunk_bytes: chunk as u64,
                    chunks: digests.iter().map(hex).collect(),
                    root: hex(&root_digest(&digests)),
                },
            )]
            .into_iter()
            .collect(),
            weight_map: header
                .entries
                .iter()
                .map(|e| (e.name.clone(), file_name.clone()))
                .collect(),
        };
        root.write_durable(&pending.join(INDEX_FILE_NAME), &index.to_json())?;
        root.sync_dir(&pending)?;
        let replaced = root.publish(&pending, step, job.overwrite)?;
        if let Some(old) = replaced {
            if let Err(e) = std::fs::remove_dir_all(&old) {
                tracing::warn!("acp: could not remove replaced step {}: {e}", old.display());
            }
        }
        shared.ring.set_state(slot, SlotState::Persisted);
        shared.lock().committed.insert(step);
        // The step is committed: what follows is housekeeping, whose
        // failure is logged, not reported as a failed save.
        if root.steps().is_ok_and(|s| s.last() == Some(&step)) {
            if let Err(e) = root.write_latest(step) {
                tracing::warn!(
                    "acp: step {step} committed, but the latest hint was not updated: {e}"
                );
            }
        }
        if let Some(k) = shared.cfg.keep_last {
            match retain(root, k, shared.cfg.keep_every) {
                Ok(deleted) => {
                    let mut st = shared.lock();
                    for s in &deleted {
                        st.committed.remove(s);
                    }
                }
                Err(e) => tracing::warn!("acp: retention after step {step} failed: {e}"),
            }
        }
        let commit_secs = t_commit.elapsed().as_secs_f64();
        Ok(SaveReport {
            step,
            skipped: false,
            bytes: len,
            stall_secs: job.stall_secs,
            slot_wait_secs: job.slot_wait_secs,
            queue_secs: queue_secs.max(0.0),
            flush_secs,
            commit_secs,
            total_secs: job.started.elapsed().as_secs_f64(),
            io: stats.kind,
            direct: stats.direct,
        })
    })();
    if result.is_err() && pending.exists() {
        let _ = std::fs::remove_dir_all(&pending);
    }
    result.map_err(|e: Error| e)
}
