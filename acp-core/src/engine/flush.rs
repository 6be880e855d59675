//! The flush thread: writes sealed slots to storage, hashes them on the way,
//! and commits each step.
//!
//! Commit protocol for step S of rank r (world size 1), through the
//! [`Storage`](crate::storage::Storage) seam (the local storage's own steps
//! in brackets):
//! 1. create a pending place [`.pending-S-rR-pid-nonce/` under the root];
//! 2. write `rank-R.safetensors` in it from the slot (O_DIRECT, chunks in
//!    flight), hashing each chunk before it is submitted; fsync it (an
//!    incremental flush hashes the image first and leaves out the chunks
//!    the newest committed step holds: `incremental.rs`);
//! 3. write `model.safetensors.index.json` (sizes, digests, weight map)
//!    durably; make the pending place durable [fsync the directory];
//! 4. publish it — the commit [rename the pending directory to `step-S`,
//!    or exchange it atomically with the old `step-S` when overwriting;
//!    fsync the root];
//! 5. mark the slot `Persisted`; take the steps retention removes out of
//!    the listing (renames); write the `latest` hint (its fsync of the
//!    root makes those renames durable); report the save;
//! 6. then, once no save is queued, delete the removed steps' files
//!    (`Storage::settle`), off the save's path.
//!
//! A crash before 4 leaves a pending place that is never loaded and is
//! swept by the next engine of this rank; after 4 the step is complete.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, TryRecvError};

use super::handle::Completion;
use super::state::{FailedSlot, Shared};
use super::SaveReport;
use crate::error::{Error, Result};
use crate::format::{
    data_file_name, parse_header, Digest, FileEntry, Index, Manifest, INDEX_FILE_NAME,
    PLAIN_VERSION, QUICK_FRAME_VERSION,
};
use crate::staging::{PinnedSlot, SlotState};
use crate::storage::Pending;

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
    /// A slot left by a previous process that nobody holds the handle of
    /// (persist on open): its failure is raised by `close`.
    pub(super) unwatched: bool,
}

impl Job {
    /// The report of this save when it is not flushed (kept resident, or
    /// superseded): its stall figures, no flush.
    pub(super) fn unflushed(&self, outcome: super::Outcome) -> SaveReport {
        SaveReport {
            step: self.step,
            skipped: false,
            bytes: self.pin.image().len() as u64,
            stored_bytes: 0,
            reused_chunks: 0,
            reused_bytes: 0,
            stall_secs: self.stall_secs,
            slot_wait_secs: self.slot_wait_secs,
            queue_secs: 0.0,
            flush_secs: 0.0,
            replica_wait_secs: 0.0,
            commit_secs: 0.0,
            total_secs: self.started.elapsed().as_secs_f64(),
            // No I/O engine wrote it; the report names the plain one.
            io: crate::io::IoKind::Psync,
            direct: false,
            outcome,
        }
    }
}

/// What the flush thread is asked to do.
#[derive(Debug)]
pub(super) enum Work {
    /// Flush and commit a sealed slot.
    Persist(Job),
    /// Hash the RAM snapshot waiting to be hashed (`hash.rs`), if any.
    Hash,
    /// Read the restored step waiting to be made resident again into a
    /// slot (`reside.rs`), if any.
    Reside,
}

/// The flush thread's loop: one piece of work at a time, in order, until
/// the queue closes; after each persist, the snapshot deferred behind it
/// (coalescing), if any.
pub(super) fn run(shared: &Arc<Shared>, rx: &Receiver<Work>) {
    loop {
        let work = match rx.try_recv() {
            Ok(work) => work,
            Err(TryRecvError::Empty) => {
                // Nothing queued: the commits' housekeeping, then wait.
                settle(shared);
                match rx.recv() {
                    Ok(work) => work,
                    Err(_) => break,
                }
            }
            Err(TryRecvError::Disconnected) => break,
        };
        let mut next = match work {
            Work::Persist(job) => Some(job),
            Work::Hash => {
                super::hash::hash_waiting(shared);
                None
            }
            Work::Reside => {
                super::reside::reside_waiting(shared);
                None
            }
        };
        while let Some(job) = next {
            next = run_one(shared, job);
        }
    }
    settle(shared);
}

/// The housekeeping commits left, if any: the files of the steps
/// retention removed deleted (once their retirement is durable). A failure
/// is logged (the save was committed); what was not deleted is retried by
/// the next settle, or swept by the next engine.
fn settle(shared: &Shared) {
    if !shared.lock().unsettled {
        return;
    }
    shared.note_progress("deleting the steps retention removed".to_owned());
    if let Err(e) = shared.root.settle() {
        tracing::warn!("acp: removing retired steps failed: {e}");
    }
    let mut st = shared.lock();
    st.unsettled = false;
    st.progress = None;
    drop(st);
    shared.idle.notify_all();
}

/// Flushes and commits one job, completes its handle, and takes the
/// deferred snapshot to run next (in the same lock as the job's own
/// accounting, so a save deciding meanwhile sees either the job in flight
/// or nothing in flight).
fn run_one(shared: &Shared, job: Job) -> Option<Job> {
    let slot = job.pin.slot();
    let generation = job.pin.generation();
    let step = job.step;
    let unwatched = job.unwatched;
    let staged_at = job.started;
    let done = Arc::clone(&job.done);
    // The watchdog times the flush from here: a storage call that hangs
    // before the first chunk (creating the directory) is caught too.
    shared.note_progress(format!(
        "step {step}: starting the flush into {}",
        shared.root.location().display()
    ));
    let result = flush_one(shared, job);
    {
        let mut st = shared.lock();
        st.progress = None;
        st.recovering.retain(|s| *s != step);
        match &result {
            Ok(rep) => {
                st.unsettled = true;
                st.counts
                    .committed(step, staged_at, rep.bytes, rep.stored_bytes);
                st.counts.reused(rep.reused_chunks, rep.reused_bytes);
                shared.release_superseded(&mut st, step);
                // Older images whose flush failed are superseded now
                // (not the one just committed, which a recovered slot
                // persisted by `persist_resident` may have been), each
                // only while its slot still holds it.
                for f in std::mem::take(&mut st.failed_slots) {
                    if (f.slot, f.generation) != (slot, generation) {
                        shared.ring.release_generation(f.slot, f.generation);
                    }
                }
            }
            Err(e) => {
                st.failed_slots.push(FailedSlot { slot, generation });
                if unwatched && st.unreported.is_none() {
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
    if let Some(i) = st.queued.iter().position(|s| *s == step) {
        st.queued.swap_remove(i);
    }
    // The deferred snapshot stays counted in `in_flight`: it runs now.
    let next = st.deferred.take();
    if next.is_some() {
        st.counts.last_queued = Some(Instant::now());
    }
    drop(st);
    shared.idle.notify_all();
    next
}

fn flush_one(shared: &Shared, job: Job) -> Result<SaveReport> {
    let queue_secs = job.started.elapsed().as_secs_f64() - job.stall_secs;
    let step = job.step;
    let slot = job.pin.slot();
    shared.ring.set_state(slot, SlotState::Flushing);
    let root = &shared.root;
    let rank = shared.cfg.rank;
    let t_flush = Instant::now();
    // A root removed under the engine (rm -rf, or moved away) is made
    // again, as `open` would: the next save works once it is gone.
    if root.recreate_if_missing()? {
        tracing::warn!(
            step,
            "acp: checkpoint root {} was removed; created it again",
            root.location().display()
        );
        shared.lock().committed.clear();
    }
    if job.overwrite && root.is_committed(step) {
        // The bytes of a step that later steps reference stay where they
        // are: replacing the step would leave those steps without them.
        let referrers = super::incremental::referrers(shared, step)?;
        if !referrers.is_empty() {
            return Err(Error::invalid(
                format!("step {step}"),
                format!(
                    "steps {referrers:?} reference its chunks (incremental), so it cannot be overwritten; remove them first or save under another step"
                ),
            ));
        }
    }
    let pending = root.create_pending(step)?;
    let result = (|| {
        let file_name = data_file_name(rank);
        let (file, path) = root.create_file(&pending, &file_name)?.into_parts();
        let image = job.pin.image();
        let len = image.len() as u64;
        let chunk = shared.io_opts.chunk_bytes;
        let mut digests: Vec<Digest> = Vec::with_capacity(image.len().div_ceil(chunk.max(1)));
        // The RAM tier's quick sums, from the same bytes as the digests
        // (the sum first: `read/fast.rs` says why).
        let mut sums: Vec<u64> = Vec::with_capacity(digests.capacity());
        shared.note_progress(format!("step {step}: writing {}", path.display()));
        let compress = shared.lock().rates.choose(shared.cfg.compress);
        // An incremental flush needs the digests first, to know which
        // chunks the newest committed step already holds.
        let base = if shared.cfg.incremental {
            super::incremental::base(shared, step, &file_name, chunk as u64)
        } else {
            None
        };
        // Digests and quick sums recorded for the slot's image already (a
        // verified read, the replica send of this save, the process of this
        // rank that sealed it) are taken as they are; each chunk must still
        // give its sum as it is written. Else the image is hashed before it is written only when
        // that is needed or shared: an incremental flush whose probe finds
        // chunks to reuse (training changes them all, and the step is then
        // written whole), or a rank whose images are replicated (its
        // replica send takes the same digests: hashed once, whichever of
        // the two comes first). Otherwise the image is hashed as it is
        // written, overlapped with the writes.
        let compute = shared.sends_replicas()
            || base
                .as_ref()
                .is_some_and(|b| super::incremental::likely_reuse(b, image, chunk));
        // While this step's image is sent to its holders, the flush pauses
        // between chunks: replication, the sooner protection, goes first
        // (`Engine::exchange_started`).
        let yield_until = t_flush + super::replicate::FLUSH_YIELD_MAX;
        // The longest single wait: the threads that pause wait for the
        // same exchange to end, so that is how long the flush was held back.
        let held_back = std::sync::atomic::AtomicU64::new(0);
        let pause = || {
            let waited = shared.replicas.yield_to_exchange(step, yield_until);
            let nanos = u64::try_from(waited.as_nanos()).unwrap_or(u64::MAX);
            held_back.fetch_max(nanos, std::sync::atomic::Ordering::Relaxed);
        };
        let pre = super::replicate::hash_once(
            shared,
            slot,
            job.pin.generation(),
            image,
            compute,
            &path,
            &pause,
        )?;
        // A RAM snapshot summed while it waited (`hash.rs`) and not hashed
        // since: every chunk written must still give its sum, or it
        // changed in RAM since and is not committed under digests taken
        // now (the pin holds the image these sums describe).
        let summed = if pre.is_none() {
            shared.ring.sums_alone(slot)
        } else {
            None
        };
        let reuse = match (&base, &pre) {
            (Some(b), Some((d, _))) => super::incremental::reuse(b, d, len, chunk as u64),
            _ => Vec::new(),
        };
        let refs = super::incremental::runs(&reuse);
        let reused: Vec<bool> = reuse.iter().map(Option::is_some).collect();
        let mut stored_size = None;
        let stats = if compress || !refs.is_empty() {
            let mode = super::compress::PackMode {
                compress,
                reuse: &reused,
                pre: pre.as_ref().map(|(d, s)| (&d[..], &s[..])),
                summed: summed.as_deref(),
                slot,
                pause: &pause,
            };
            let packed = super::compress::write_packed(shared, &file, &path, image, chunk, mode)?;
            digests = packed.digests;
            sums = packed.sums;
            stored_size = Some(packed.stored);
            packed.stats
        } else {
            // A plain file: its digests taken as it is written, unless the
            // incremental check took them already (and found nothing to
            // reuse).
            let hashed = pre.is_some();
            if let Some((d, s)) = pre {
                digests = d;
                sums = s;
            }
            let t_write = Instant::now();
            let stats = shared.io.write_to(
                &file,
                &path,
                job.pin.padded(),
                len,
                &shared.io_opts,
                &mut |i, bytes| {
                    pause();
                    if !hashed {
                        debug_assert_eq!(i, digests.len());
                        let (sum, d) = crate::read::sum_then_digest(bytes);
                        if summed.as_ref().is_some_and(|s| s.get(i) != Some(&sum)) {
                            return Err(changed_since_hashed(shared, slot, i));
                        }
                        sums.push(sum);
                        digests.push(d);
                    } else if sums.get(i) != Some(&crate::read::fast_sum(bytes)) {
                        // Digests taken before the write vouch for the
                        // bytes they were taken from: a chunk that changed
                        // in RAM since is not committed under them.
                        return Err(changed_since_hashed(shared, slot, i));
                    }
                    shared.note_progress(format!(
                        "step {step}: writing {} (chunk {i})",
                        path.display()
                    ));
                    Ok(())
                },
            )?;
            shared
                .lock()
                .rates
                .plain(len, t_write.elapsed().as_secs_f64());
            stats
        };
        let flush_secs = t_flush.elapsed().as_secs_f64();
        shared.ring.set_digests(slot, &digests);
        shared.ring.record_quick_sums(slot, &digests, &sums);

        let t_commit = Instant::now();
        shared.note_progress(format!(
            "step {step}: committing in {}",
            root.describe_pending(&pending).display()
        ));
        let header = parse_header(&path, image, len)?;
        // The slot's control block names the step; the image's own header
        // must agree, or a damaged control block would commit a checkpoint
        // under the wrong step.
        if header.step != Some(step) {
            return Err(Error::corrupt(
                shared.ring.slot_path(slot),
                None,
                format!(
                    "the slot holds step {step}, its image's header says {:?}",
                    header.step
                ),
            ));
        }
        // So must its rank and world size, or the file committed is one
        // that every load refuses (a replica slot holding another rank's
        // image, persisted by a survivor).
        for (key, want) in [
            ("acp.rank", rank),
            ("acp.world_size", shared.cfg.world_size),
        ] {
            if let Some(got) = header
                .metadata
                .get(key)
                .filter(|g| g.parse::<u32>().ok() != Some(want))
            {
                return Err(Error::corrupt(
                    shared.ring.slot_path(slot),
                    None,
                    format!("the slot holds rank {rank}'s image of step {step}, its header says {key} {got} ({want} expected)"),
                ));
            }
        }
        let entry = FileEntry {
            stored_size,
            refs,
            ..FileEntry::plain(rank, len, chunk as u64, &digests)
        };
        let (reused_chunks, reused_bytes) = (entry.referenced_chunks(), entry.referenced_bytes());
        // The steps referenced must still be there when this one commits
        // (retention keeps a step that a committed step references, not
        // one that a pending step does).
        for held in super::incremental::held_steps(&entry.refs) {
            if !root.is_committed(held) {
                return Err(Error::invalid(
                    format!("step {step}"),
                    format!(
                        "step {held}, whose chunks it references, was removed while it was written; the next save writes them again"
                    ),
                ));
            }
        }
        let tensors: Vec<String> = header.entries.into_iter().map(|e| e.name).collect();
        if shared.cfg.world_size == 1 {
            let index = Index {
                step,
                world_size: 1,
                format_version: version_of([&entry]),
                weight_map: tensors
                    .into_iter()
                    .map(|t| (t, file_name.clone()))
                    .collect(),
                files: [(file_name, entry)].into_iter().collect(),
            };
            root.write_small(&pending, INDEX_FILE_NAME, &index.to_json())?;
            root.make_durable(&pending)?;
            root.publish(&pending, job.overwrite)?;
        } else {
            let manifest = Manifest {
                format_version: version_of([&entry]),
                step,
                rank,
                world_size: shared.cfg.world_size,
                file: file_name,
                entry,
                tensors,
            };
            // Rank 0 may take this rank's file and remove the pending
            // place as soon as the report appears.
            root.report_rank(&pending, rank, &manifest.to_json()?)?;
            if rank == 0 {
                commit_ranks(shared, step, job.overwrite)?;
            } else {
                wait_for_commit(shared, step, &manifest.entry.root, &pending)?;
                root.discard(&pending);
            }
        }
        shared.ring.set_state(slot, SlotState::Persisted);
        shared.lock().committed.insert(step);
        // The step is committed: what follows is housekeeping, whose
        // failure is logged, not reported as a failed save. Retention
        // first: the hint's fsync of the root makes its renames durable.
        if let Some(k) = shared.cfg.keep_last {
            if let Err(e) = shared.retain(k, shared.cfg.keep_every) {
                tracing::warn!("acp: retention after step {step} failed: {e}");
            }
        }
        if root.steps().is_ok_and(|s| s.last() == Some(&step)) {
            if let Err(e) = root.write_latest(step) {
                tracing::warn!(
                    "acp: step {step} committed, but the latest hint was not updated: {e}"
                );
            }
        }
        let commit_secs = t_commit.elapsed().as_secs_f64();
        Ok(SaveReport {
            step,
            skipped: false,
            bytes: len,
            stored_bytes: stored_size.unwrap_or(len),
            reused_chunks,
            reused_bytes,
            stall_secs: job.stall_secs,
            slot_wait_secs: job.slot_wait_secs,
            queue_secs: queue_secs.max(0.0),
            flush_secs,
            replica_wait_secs: held_back.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1e9,
            commit_secs,
            total_secs: job.started.elapsed().as_secs_f64(),
            io: stats.kind,
            direct: stats.direct,
            outcome: super::Outcome::Persisted,
        })
    })();
    if result.is_err() {
        root.discard(&pending);
    }
    result.map_err(|e: Error| e)
}

/// The format version of an index (or manifest) of these files: a step
/// with a container (a compressed or incremental file) is written in the
/// container's version, which only readers that know it read; an
/// all-plain step stays readable by readers that predate compression.
fn version_of<'a>(files: impl IntoIterator<Item = &'a FileEntry>) -> u32 {
    if files.into_iter().any(|f| f.stored_size.is_some()) {
        QUICK_FRAME_VERSION
    } else {
        PLAIN_VERSION
    }
}

/// How often the ranks look for each other's progress on storage.
const POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// One look of a commit of `step` waiting on ranks `waiting_for`: notes
/// `waiting` as the flush's progress, fails with `late()` once `deadline`
/// (the commit timeout) has passed, or at once when the step was given up
/// ([`Engine::give_up_commits_from`](super::Engine::give_up_commits_from),
/// [`Engine::give_up_commits_waiting_for`](super::Engine::give_up_commits_waiting_for)),
/// else sleeps one poll.
fn poll_ranks(
    shared: &Shared,
    step: u64,
    waiting_for: &[u32],
    deadline: Instant,
    waiting: String,
    late: impl FnOnce() -> String,
) -> Result<()> {
    shared.note_progress(waiting);
    if let Some(why) = given_up(shared, step, waiting_for) {
        return Err(Error::invalid(
            format!("step {step}"),
            format!("given up by the dying checkpoint: {why}"),
        ));
    }
    if Instant::now() >= deadline {
        return Err(Error::Timeout {
            what: late(),
            secs: shared.cfg.commit_timeout.as_secs_f64(),
        });
    }
    std::thread::sleep(POLL);
    Ok(())
}

/// Why the dying checkpoint gave up the commit of `step` that waits for
/// ranks `waiting_for`, if it did.
fn given_up(shared: &Shared, step: u64, waiting_for: &[u32]) -> Option<String> {
    let st = shared.lock();
    if st.given_up_from.is_some_and(|first| step >= first) {
        return Some("not every rank holds it".to_owned());
    }
    if st.given_up_except == Some(step) {
        return None;
    }
    let dead: Vec<u32> = waiting_for
        .iter()
        .copied()
        .filter(|r| st.given_up_ranks.contains(r))
        .collect();
    (!dead.is_empty()).then(|| format!("it waits for ranks {dead:?}, taken as dead"))
}

/// Rank 0 of a multi-rank save: waits until every rank has reported its file
/// durable (a manifest in its pending directory), moves the files into one
/// directory, writes the index and publishes the step.
fn commit_ranks(shared: &Shared, step: u64, overwrite: bool) -> Result<()> {
    let root = &shared.root;
    let world = shared.cfg.world_size;
    let deadline = Instant::now() + shared.cfg.commit_timeout;
    let mut reported = BTreeMap::new();
    let result = (|| loop {
        reported = root.reported_ranks(step)?;
        if (0..world).all(|r| reported.contains_key(&r)) {
            return gather_ranks(shared, step, overwrite, &reported);
        }
        let missing: Vec<u32> = (0..world).filter(|r| !reported.contains_key(r)).collect();
        poll_ranks(
            shared,
            step,
            &missing,
            deadline,
            format!("step {step}: waiting for ranks {missing:?}"),
            || format!("step {step}: ranks {missing:?} did not report their files durable"),
        )?;
    })();
    if let Err(e) = &result {
        // The ranks that reported wait for the commit: tell them now,
        // rather than let each wait out its commit timeout.
        let reason = format!("rank 0 did not commit it: {e}");
        for (_, pending) in reported.iter().filter(|(&r, _)| r != 0) {
            root.refuse(pending, &reason);
        }
    }
    result
}

/// Rank 0's commit of a multi-rank step once every rank has reported:
/// reads the manifests, moves the files into one directory, writes the
/// index and publishes the step.
fn gather_ranks(
    shared: &Shared,
    step: u64,
    overwrite: bool,
    reported: &BTreeMap<u32, Pending>,
) -> Result<()> {
    let root = &shared.root;
    let world = shared.cfg.world_size;
    let mut manifests: Vec<(&Pending, Manifest)> = Vec::with_capacity(reported.len());
    for (&r, pending) in reported {
        if r >= world {
            continue;
        }
        let (path, bytes) = root.read_report(pending, r)?;
        let m = Manifest::parse(&path, &bytes, step, r)?;
        if m.world_size != world {
            return Err(Error::corrupt(
                &path,
                None,
                format!(
                    "rank {r} saved with world size {}, rank 0 with {world}",
                    m.world_size
                ),
            ));
        }
        manifests.push((pending, m));
    }
    let commit = root.create_gather(step)?;
    let result = (|| {
        let mut index = Index {
            step,
            world_size: world,
            format_version: version_of(manifests.iter().map(|(_, m)| &m.entry)),
            files: std::collections::BTreeMap::new(),
            weight_map: std::collections::BTreeMap::new(),
        };
        for (pending, m) in &manifests {
            root.adopt(pending, &m.file, &commit)?;
            for t in &m.tensors {
                if let Some(other) = index.weight_map.insert(t.clone(), m.file.clone()) {
                    return Err(Error::invalid(
                        format!("tensor `{t}` of step {step}"),
                        format!("saved by two ranks ({other} and {})", m.file),
                    ));
                }
            }
            index.files.insert(m.file.clone(), m.entry.clone());
        }
        root.write_small(&commit, INDEX_FILE_NAME, &index.to_json())?;
        root.make_durable(&commit)?;
        root.publish(&commit, overwrite)
    })();
    if result.is_err() {
        root.discard(&commit);
    }
    result?;
    for (pending, _) in &manifests {
        root.discard(pending);
    }
    Ok(())
}

/// A rank other than 0: waits until rank 0 has committed `step` with this
/// rank's file (recognised by its root digest).
fn wait_for_commit(shared: &Shared, step: u64, our_root: &str, pending: &Pending) -> Result<()> {
    let deadline = Instant::now() + shared.cfg.commit_timeout;
    let file = data_file_name(shared.cfg.rank);
    loop {
        if let Ok(index) = shared.root.read_index(step) {
            if index.files.get(&file).is_some_and(|e| e.root == our_root) {
                return Ok(());
            }
        }
        if let Some(why) = shared.root.refusal(pending) {
            return Err(Error::invalid(format!("step {step}"), why));
        }
        poll_ranks(
            shared,
            step,
            &[0],
            deadline,
            format!("step {step}: waiting for rank 0 to commit"),
            || format!("step {step}: rank 0 did not commit (ranks [0] did not answer)"),
        )?;
    }
}

/// The error of a flush that finds chunk `i` of slot `slot` no longer
/// giving the quick sum taken with its digest.
pub(super) fn changed_since_hashed(shared: &Shared, slot: usize, i: usize) -> Error {
    Error::corrupt(
        shared.ring.slot_path(slot),
        None,
        format!(
            "chunk {i} changed in RAM after it was hashed or summed; the step is not committed"
        ),
    )
}
