//! Loading a step: from a resident slot when one holds it, else from a
//! replica (this node's, then a peer's, `replicate.rs`), else from storage
//! into a slot (or private memory when the ring has no room).

use std::fs::File;
use std::path::Path;
use std::time::Instant;

use super::checkpoint::Backing;
use super::state::Shared;
use super::to_usize;
use super::wait::wait_for;
use super::{ranks, replicate, Checkpoint, Engine, LoadReport, Source};
use crate::config::Verify;
use crate::error::{Error, ErrorKind, Result};
use crate::format::Digest;
use crate::format::{data_file_name, parse_header, read_header, unhex, FileEntry, ParsedHeader};
use crate::read::{
    sums_match, ChunkReader, ChunkSource, IoSource, MemSource, StoredSource, Target,
};
use crate::staging::{Ring, SlotInfo, SlotState};
use crate::storage::FileHandle;

/// Which step to load, and from where.
#[derive(Debug, Clone, Default)]
pub struct LoadRequest {
    /// The step; when `None`, the newest of the committed steps and, with
    /// one rank, the RAM snapshots of this rank's ring that are hashed
    /// (verifiable), a RAM snapshot that fails verification giving way to
    /// the next source.
    pub step: Option<u64>,
    /// Read from storage even when the step is resident.
    pub storage_only: bool,
    /// When the wanted (latest) step is corrupt, fall back to the newest
    /// older committed step that is intact. Only with `step: None`.
    pub fallback: bool,
    /// Load the file written by this rank instead of this engine's own:
    /// from that rank's slot when it is resident on this node (verified
    /// against the committed digests), else from storage. With several
    /// ranks, each file holds that rank's share of the tensors.
    pub rank: Option<u32>,
    /// Only these tensors of another rank's file (with its values): only
    /// the digest chunks under its header and under them are read. Ignored
    /// for this engine's own file, which is loaded whole.
    pub tensors: Option<Vec<String>>,
}

impl Engine {
    /// Loads a step from the best source that has it, each verified
    /// before use: this rank's resident slot, another slot on this node
    /// (another rank's own, or a replica kept here), a replica on another
    /// node through the transport ([`Source::Peer`]), then storage (into
    /// a slot, which becomes resident). A source that is missing or fails
    /// verification is logged, naming it, and the next one is used. An
    /// explicit `step` that is not committed is loaded from RAM only,
    /// checked against the digests recorded with the image (by its flush,
    /// by the background hash of a RAM snapshot, or at open for one a
    /// previous process left); without a step, the newest such snapshot of
    /// this rank (one rank only) is tried before the committed steps.
    ///
    /// # Errors
    /// [`Error::NotFound`], [`Error::Corrupt`] naming the file and tensor,
    /// [`Error::Io`].
    pub fn load(&self, req: &LoadRequest) -> Result<Checkpoint> {
        load(self.shared(), req)
    }

    /// [`Engine::load`], then copies each tensor `into[k].0` into
    /// `into[k].1` (exactly its length). From storage, the tensors are
    /// filled in the read's own pass: each read is copied into them by the
    /// thread that checked its digests, while it is in cache, so the image
    /// is not read from memory a second time; from any other source, they
    /// are copied once the load succeeded.
    ///
    /// Nothing reaches `into` before its digest chunk matched. On an error,
    /// each tensor of `into` holds its old bytes or bytes of the step
    /// being loaded that were verified (a storage read that failed part
    /// way, or before falling back to an older step): the caller is told
    /// by the error and must not use them.
    ///
    /// # Errors
    /// As [`Engine::load`]; [`Error::Invalid`] naming the tensor when a
    /// name is not in the loaded step or a length differs, before anything
    /// is copied into it.
    pub fn load_into(
        &self,
        req: &LoadRequest,
        into: &mut [(&str, &mut [u8])],
    ) -> Result<Checkpoint> {
        let mut targets = Targets {
            into,
            filled: false,
        };
        let ck = load_with(self.shared(), req, &mut targets)?;
        if !targets.filled {
            let mut dsts = targets
                .into
                .iter_mut()
                .map(|(name, d)| {
                    let i = ck
                        .entries()
                        .iter()
                        .position(|e| e.name == *name)
                        .ok_or_else(|| not_in_step(name, ck.step()))?;
                    Ok((i, &mut **d))
                })
                .collect::<Result<Vec<_>>>()?;
            ck.copy_into(&mut dsts)?;
        }
        Ok(ck)
    }
}

/// The caller's memory for tensors of a load ([`Engine::load_into`]), and
/// whether the load already filled it.
pub(super) struct Targets<'a, 'n, 'b> {
    into: &'a mut [(&'n str, &'b mut [u8])],
    filled: bool,
}

fn not_in_step(name: &str, step: u64) -> Error {
    Error::invalid(
        format!("tensor `{name}`"),
        format!("not in the loaded step {step}"),
    )
}

pub(super) fn load(shared: &Shared, req: &LoadRequest) -> Result<Checkpoint> {
    let mut none = Targets {
        into: &mut [],
        filled: false,
    };
    load_with(shared, req, &mut none)
}

fn load_with(
    shared: &Shared,
    req: &LoadRequest,
    targets: &mut Targets<'_, '_, '_>,
) -> Result<Checkpoint> {
    let t0 = Instant::now();
    // This rank's RAM snapshots that `load` may serve without a step.
    let ram = if req.step.is_none() {
        ram_snapshots(shared, req)
    } else {
        Vec::new()
    };
    // Resident checkpoints of a dead process that are being persisted are
    // newer than anything committed: let them commit first, unless they
    // were hashed at open and are served from RAM.
    wait_for(shared, None, |st| {
        st.recovering.iter().all(|s| ram.contains(s))
    })?;
    let (ram_first, candidates): (Vec<u64>, Vec<u64>) = match req.step {
        Some(s) => (Vec::new(), vec![s]),
        None => {
            let mut steps = shared.root.steps()?;
            // A step directory whose index is gone was committed once (the
            // index is in place before the rename that commits): its loss
            // is corruption to report, not a step to skip in silence.
            steps.extend(shared.root.steps_without_index()?);
            steps.sort_unstable();
            // RAM snapshots newer than every committed step come first.
            let newest = steps.last().copied();
            let ram_first: Vec<u64> = ram
                .iter()
                .copied()
                .filter(|s| newest.is_none_or(|n| *s > n))
                .collect();
            if steps.is_empty() && ram_first.is_empty() {
                return Err(Error::NotFound {
                    what: format!(
                        "committed checkpoint in {}",
                        shared.root.location().display()
                    ),
                });
            }
            let newest_first = steps.into_iter().rev();
            let committed = if req.fallback {
                newest_first.collect()
            } else {
                newest_first.take(1).collect()
            };
            (ram_first, committed)
        }
    };
    // A RAM snapshot that fails (changed in RAM, gone meanwhile) is only
    // the newest of several sources: the next one is used, whatever
    // `fallback` says, as for a resident copy of a committed step.
    let mut rejected: Option<String> = None;
    for step in ram_first {
        match load_step(shared, step, req.rank, false, t0, targets) {
            Ok(c) => return Ok(c),
            Err(e) => {
                tracing::warn!(
                    "acp: RAM snapshot of step {step} cannot be loaded, trying the next source: {e}"
                );
                // Why it failed verification goes with the load (a slot
                // released meanwhile is no rejection).
                if e.kind() == ErrorKind::Corrupt || e.to_string().contains("(last rejected: ") {
                    rejected = Some(e.to_string());
                }
            }
        }
    }
    if candidates.is_empty() {
        return Err(Error::NotFound {
            what: format!(
                "intact checkpoint in {}{}",
                shared.root.location().display(),
                rejected.map_or_else(String::new, |r| format!(" (last rejected: {r})"))
            ),
        });
    }
    let mut first_err: Option<Error> = None;
    for step in candidates {
        let result = match (&req.tensors, req.rank) {
            (Some(names), Some(rank)) if rank != shared.cfg.rank => {
                ranks::load_tensors(shared, step, rank, names, req.storage_only, t0)
            }
            _ => load_step(shared, step, req.rank, req.storage_only, t0, targets),
        };
        match result {
            Ok(c) => {
                if let Some(e) = &first_err {
                    tracing::warn!("acp: fell back to step {step}: {e}");
                }
                if c.report.rejected.is_none() && rejected.is_some() {
                    return Ok(c.with_rejected(rejected));
                }
                return Ok(c);
            }
            Err(e)
                if req.fallback
                    && req.step.is_none()
                    && matches!(
                        e.kind(),
                        ErrorKind::Corrupt
                            | ErrorKind::NotFound
                            | ErrorKind::Io
                            | ErrorKind::Unsupported
                    ) =>
            {
                tracing::warn!("acp: step {step} cannot be loaded: {e}");
                first_err.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(first_err.unwrap_or_else(|| Error::NotFound {
        what: format!("intact checkpoint in {}", shared.root.location().display()),
    }))
}

/// The steps of this rank's RAM snapshots that a load without a step may
/// serve, newest first: resident in its ring with recorded digests (hashed
/// by their flush, in the background, or at open), so they are verified
/// like a committed step; not the image of a save whose flush failed (a
/// failed save is not offered in place of the committed step before it).
/// Only for this rank's own image read from wherever it is, and only with
/// one rank: with several, a step is loadable only once every rank holds
/// it, and no agreement on RAM snapshots across ranks exists, so a load
/// without a step keeps to committed steps there.
fn ram_snapshots(shared: &Shared, req: &LoadRequest) -> Vec<u64> {
    if shared.cfg.world_size != 1
        || req.storage_only
        || req.rank.is_some_and(|r| r != shared.cfg.rank)
    {
        return Vec::new();
    }
    let failed: Vec<(usize, u64)> = shared
        .lock()
        .failed_slots
        .iter()
        .map(|f| (f.slot, f.generation))
        .collect();
    shared
        .ring
        .complete()
        .into_iter()
        .filter(|i| i.has_digests)
        .filter(|i| {
            shared
                .ring
                .generation(i.slot)
                .is_none_or(|g| !failed.contains(&(i.slot, g)))
        })
        .map(|i| i.step)
        .collect()
}

fn load_step(
    shared: &Shared,
    step: u64,
    rank: Option<u32>,
    storage_only: bool,
    t0: Instant,
    targets: &mut Targets<'_, '_, '_>,
) -> Result<Checkpoint> {
    // Filled by an earlier step's read whose load then failed (the
    // caller falls back to this one): those bytes are not this step's.
    targets.filled = false;
    let own = shared.cfg.rank;
    let rank = rank.unwrap_or(own);
    let index = match shared.root.read_index(step) {
        Ok(index) => index,
        // Not committed: only RAM copies (own, this node's, a peer's) can
        // have it, each checked against the digests recorded with it.
        Err(e) if e.kind() == ErrorKind::NotFound && !storage_only => {
            return load_uncommitted(shared, step, rank, t0);
        }
        Err(e) => return Err(e),
    };
    let file_name = data_file_name(rank);
    let Some(entry) = index.files.get(&file_name) else {
        return Err(Error::NotFound {
            what: format!(
                "rank {rank}'s file in step {step} of {}",
                shared.root.location().display()
            ),
        });
    };
    let threads = shared.cfg.copy_threads;
    let expected = Expected {
        tensors: index
            .weight_map
            .iter()
            .filter(|(_, f)| **f == file_name)
            .map(|(t, _)| t.as_str())
            .collect(),
        rank,
        world_size: index.world_size,
    };
    let mut rejected = None;
    if !storage_only && rank != own {
        // Another rank's image may be resident in its slot on this node.
        if let Some((buf, slot_path)) = ranks::copy_from_peer_slot(shared, step, rank, entry) {
            let len = to_usize(entry.size);
            match verify_in_place(&buf[..len], &slot_path, entry, threads) {
                Ok(_) => {
                    let backing = Backing::Heap(buf, len);
                    return finish(
                        shared,
                        step,
                        backing,
                        &slot_path,
                        Source::Ram,
                        true,
                        t0,
                        &expected,
                    );
                }
                Err(e) => tracing::warn!(
                    "acp: rank {rank}'s resident copy of step {step} rejected, reading storage: {e}"
                ),
            }
        }
    }
    if !storage_only && rank == own {
        for info in shared.ring.complete() {
            if info.step != step || info.len != entry.size {
                continue;
            }
            let Ok(pin) = shared.ring.pin(info.slot) else {
                continue;
            };
            let slot_path = shared.ring.slot_path(info.slot);
            // The job id names the ring, not the root: a slot of this step
            // may hold another root's image (two roots under one job id, a
            // root removed and made again). Only one whose recorded digests
            // are this index's is this checkpoint; the pin keeps them fixed.
            if !slot_matches_entry(&shared.ring, &info, entry, shared.cfg.chunk_bytes as u64) {
                tracing::warn!(
                    "acp: resident copy of step {step} in {} is not the one {} records (another root's image, or no digests); reading storage",
                    slot_path.display(),
                    shared.root.describe(step, crate::format::INDEX_FILE_NAME).display()
                );
                continue;
            }
            let verified = shared.cfg.verify == Verify::Always;
            if verified {
                if let Err(e) =
                    check_resident(&shared.ring, &info, pin.image(), &slot_path, entry, threads)
                {
                    // The resident copy is only a cache of the committed
                    // one: drop it and read storage.
                    tracing::warn!(
                        "acp: resident copy of step {step} rejected, reading storage: {e}"
                    );
                    rejected = Some(e.to_string());
                    drop(pin);
                    shared.ring.release(info.slot);
                    break;
                }
            }
            return finish(
                shared,
                step,
                Backing::Slot(pin),
                &slot_path,
                Source::Ram,
                verified,
                t0,
                &expected,
            )
            .map(|c| c.with_rejected(rejected));
        }
    }
    if !storage_only {
        // This node's replica slots of the rank, then its holders on
        // other nodes, before the storage.
        let found = replicate::node_replica(shared, step, rank, Some(entry), &mut rejected)
            .or_else(|| replicate::from_peers(shared, step, rank, Some(entry), &mut rejected));
        if let Some(f) = found {
            return finish(
                shared, step, f.backing, &f.origin, f.source, true, t0, &expected,
            )
            .map(|c| c.with_rejected(rejected));
        }
    }
    let path = shared.root.describe(step, &file_name);
    // The file's true size before any memory is sized by the index's.
    let opened = shared.root.open_file(step, &file_name);
    let file = check_file_size(opened, &path, entry.file_len(), &expected.tensors)?;
    // Another rank's file is read into private memory: the ring holds this
    // rank's own checkpoints only.
    let fits = rank == own && entry.size <= shared.ring.max_image_bytes();
    let slot = if fits {
        shared.ring.acquire(entry.size, None)?
    } else {
        None
    };
    // Each chunk is verified as it lands; nothing is sealed or handed out
    // before every digest matched, and nothing reaches `targets` before
    // its chunk matched.
    let io_chunk = shared.io_opts.chunk_bytes;
    let mut read = |dst: &mut [u8]| {
        if entry.stored_size.is_some() {
            // A compressed file: its frames are read and decoded on this
            // thread, each chunk then checked like a plain one.
            let file = file.try_clone().map_err(|e| Error::io("open", &path, e))?;
            let src =
                StoredSource::open(&*shared.root, step, &file_name, file, path.clone(), entry)?;
            return read_placed(
                ChunkReader::new(src, entry)?,
                dst,
                targets,
                threads,
                io_chunk,
            );
        }
        let src = IoSource {
            io: &*shared.io,
            opts: &shared.io_opts,
            file: &file,
            path: &path,
            len: entry.size,
        };
        read_placed(
            ChunkReader::new(src, entry)?,
            dst,
            targets,
            threads,
            io_chunk,
        )
    };
    let backing = if let Some(mut slot) = slot {
        let digests = read(slot.image_mut())?;
        let pin = slot.seal(step, entry.size);
        shared.ring.set_digests(pin.slot(), &digests);
        shared.ring.set_state(pin.slot(), SlotState::Persisted);
        Backing::Slot(pin)
    } else {
        let mut buf = heap(entry.size, &path)?;
        read(&mut buf)?;
        Backing::Heap(buf, to_usize(entry.size))
    };
    finish(
        shared,
        step,
        backing,
        &path,
        Source::Storage,
        true,
        t0,
        &expected,
    )
    .map(|c| c.with_rejected(rejected))
}

/// Reads the whole file of `reader` into `dst`, verified
/// ([`ChunkReader::read_verified`]); with tensors to fill, first reads and
/// checks the header, then fills them in the read's own pass
/// ([`ChunkReader::read_verified_into`]) and marks `targets` filled.
fn read_placed<S: ChunkSource + Sync>(
    mut reader: ChunkReader<S>,
    dst: &mut [u8],
    targets: &mut Targets<'_, '_, '_>,
    threads: usize,
    io_chunk: usize,
) -> Result<Vec<Digest>> {
    if targets.into.is_empty() {
        return reader.read_verified(dst, threads, io_chunk);
    }
    let header = reader.header()?;
    let step = header.step.unwrap_or_default();
    let placed = targets
        .into
        .iter_mut()
        .map(|(name, d)| {
            let e = header
                .entries
                .iter()
                .find(|e| e.name == *name)
                .ok_or_else(|| not_in_step(name, step))?;
            if d.len() as u64 != e.len {
                return Err(Error::invalid(
                    format!("tensor `{name}`"),
                    format!(
                        "destination has {} bytes, the checkpoint {}",
                        d.len(),
                        e.len
                    ),
                ));
            }
            Ok((e.offset, &mut **d))
        })
        .collect::<Result<Vec<Target<'_>>>>()?;
    let digests = reader.read_verified_into(dst, threads, io_chunk, placed)?;
    targets.filled = true;
    Ok(digests)
}

/// Loads `rank`'s image of `step`, which is not committed, from RAM: this
/// rank's own slot, another slot on this node, then a peer's replica,
/// each verified against the digests recorded with it. The tensors and
/// rank the verified header lists are what it is checked against.
fn load_uncommitted(shared: &Shared, step: u64, rank: u32, t0: Instant) -> Result<Checkpoint> {
    let own = shared.cfg.rank;
    let mut rejected = None;
    let found = (if rank == own {
        replicate::own_uncommitted(shared, step, &mut rejected)
    } else {
        None
    })
    .or_else(|| replicate::node_replica(shared, step, rank, None, &mut rejected))
    .or_else(|| replicate::from_peers(shared, step, rank, None, &mut rejected));
    let Some(f) = found else {
        let last = rejected.map_or_else(String::new, |r| format!(" (last rejected: {r})"));
        return Err(Error::NotFound {
            what: format!(
                "rank {rank}'s image of step {step}: not committed in {}, and no verified copy in RAM{last}",
                shared.root.location().display()
            ),
        });
    };
    let image = f.backing.image();
    let header = parse_header(&f.origin, image, image.len() as u64)?;
    let mut tensors: Vec<String> = header.entries.into_iter().map(|e| e.name).collect();
    tensors.sort_unstable();
    let expected = Expected {
        tensors: tensors.iter().map(String::as_str).collect(),
        rank,
        world_size: shared.cfg.world_size,
    };
    finish(
        shared, step, f.backing, &f.origin, f.source, true, t0, &expected,
    )
    .map(|c| c.with_rejected(rejected))
}

/// Checks `image`, which came from the file at `path`, in place against
/// `entry`'s digests ([`ChunkReader::verify_in_place`]).
fn verify_in_place(
    image: &[u8],
    path: &Path,
    entry: &FileEntry,
    threads: usize,
) -> Result<Vec<crate::format::Digest>> {
    ChunkReader::new(MemSource::new(image, path), entry)?.verify_in_place(threads)
}

/// Checks the image of this rank's resident slot `info` (whose recorded
/// digests are `entry`'s: [`slot_matches_entry`]) before it is used: by the
/// quick sums recorded beside those digests in this process when there are
/// some and every chunk still gives its sum, else by the blake3 check
/// against `entry` ([`verify_in_place`]), which records the quick sums for
/// the next load. A quick sum that differs only sends the image to the
/// blake3 check, whose error names the file and tensor.
///
/// # Errors
/// As [`verify_in_place`].
fn check_resident(
    ring: &Ring,
    info: &SlotInfo,
    image: &[u8],
    path: &Path,
    entry: &FileEntry,
    threads: usize,
) -> Result<()> {
    let chunk = to_usize(entry.chunk_bytes);
    if let Some(sums) = ring.quick_sums(info.slot) {
        if sums_match(image, chunk, &sums, threads) {
            return Ok(());
        }
        tracing::warn!(
            "acp: resident copy of step {} in {} differs from its quick sums; checking its digests",
            info.step,
            path.display()
        );
    }
    let (digests, sums) =
        ChunkReader::new(MemSource::new(image, path), entry)?.verify_in_place_with_sums(threads)?;
    ring.record_quick_sums(info.slot, &digests, sums);
    Ok(())
}

/// Whether ring slot `info` records, for its image, the length, the chunk
/// size and every chunk digest that `entry` (a committed index's entry for
/// this rank's file) records: the slot then holds that file's bytes unless
/// they changed since they were hashed (which [`Verify::Always`] checks).
/// A comparison of recorded digests, no hashing; a slot without recorded
/// digests does not match.
pub(super) fn slot_matches_entry(
    ring: &Ring,
    info: &SlotInfo,
    entry: &FileEntry,
    chunk_bytes: u64,
) -> bool {
    let Some(digests) = ring.digests(info.slot) else {
        return false;
    };
    entry.size == info.len
        && entry.chunk_bytes == chunk_bytes
        && entry.chunks.len() == digests.len()
        && entry
            .chunks
            .iter()
            .zip(&digests)
            .all(|(h, d)| unhex(h).as_ref() == Some(d))
}

/// What the index says of one data file, checked against its header.
struct Expected<'a> {
    /// The tensors the index maps to the file, sorted.
    tensors: Vec<&'a str>,
    rank: u32,
    world_size: u32,
}

/// Checks that `opened`, the data file named `path` (opened by
/// [`Storage::open_file`](crate::storage::Storage::open_file), so a FIFO is
/// refused, not waited on), has `size` bytes (the index's), so no buffer is
/// sized by an index that disagrees with the file; returns the file. Names
/// the tensor cut by a truncation when the header is still readable, else
/// the first tensor the file should hold.
fn check_file_size(
    opened: Result<FileHandle>,
    path: &Path,
    size: u64,
    tensors: &[&str],
) -> Result<File> {
    let first = tensors.first().copied();
    let file = match opened {
        Ok(f) => f.into_parts().0,
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::corrupt(
                path,
                first,
                format!(
                    "missing: the index lists it, with {} tensors",
                    tensors.len()
                ),
            ));
        }
        Err(e) => return Err(e),
    };
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    let got = meta.len();
    if got == size {
        return Ok(file);
    }
    let cut = if got < size {
        tensor_at(&file, path, size, got)
    } else {
        None
    };
    Err(Error::corrupt(
        path,
        cut.as_deref().or(first),
        format!("file is {got} bytes, the index says {size}"),
    ))
}

/// The tensor holding byte `offset` of the data file `file` at `path`
/// (whose index says it has `size` bytes), read from its header; `None`
/// when the header cannot be read or parsed. Reads at most 1 MiB of header.
fn tensor_at(file: &File, path: &Path, size: u64, offset: u64) -> Option<String> {
    use std::os::unix::fs::FileExt;
    read_header(path, size, 1 << 20, |buf, at| {
        file.read_exact_at(buf, at)
            .map_err(|e| Error::io("read", path, e))
    })
    .ok()?
    .entries
    .into_iter()
    .find(|e| e.offset <= offset && offset < e.offset + e.len.max(1))
    .map(|e| e.name)
}

/// Private page-aligned memory for an image of `len` bytes (padded to a
/// page, as the I/O layer reads whole pages).
pub(super) fn heap(len: u64, what: &Path) -> Result<memmap2::MmapMut> {
    let padded = to_usize(len).div_ceil(4096).max(1) * 4096;
    memmap2::MmapMut::map_anon(padded).map_err(|e| Error::io("allocate", what, e))
}

#[expect(
    clippy::too_many_arguments,
    reason = "one call site per source; a struct would only rename them"
)]
fn finish(
    shared: &Shared,
    step: u64,
    backing: Backing,
    path: &Path,
    source: Source,
    verified: bool,
    t0: Instant,
    expected: &Expected<'_>,
) -> Result<Checkpoint> {
    let image = backing.image();
    let header = parse_header(path, image, image.len() as u64)?;
    if header.step.is_some_and(|s| s != step) {
        return Err(Error::corrupt(
            path,
            None,
            format!("header says step {:?}, expected {step}", header.step),
        ));
    }
    check_agrees(path, &header, expected)?;
    let report = LoadReport {
        source,
        bytes: image.len() as u64,
        verified,
        secs: t0.elapsed().as_secs_f64(),
        rejected: None,
    };
    Ok(Checkpoint {
        step,
        values: header.values,
        entries: header.entries,
        backing,
        report,
        copy_threads: shared.cfg.copy_threads,
    })
}

/// The index and the file's header must tell the same story: the same
/// tensors, rank and world size. (The digests vouch for the file; this
/// catches an index changed where its digests do not reach.)
fn check_agrees(path: &Path, header: &ParsedHeader, expected: &Expected<'_>) -> Result<()> {
    let mut names: Vec<&str> = header.entries.iter().map(|e| e.name.as_str()).collect();
    names.sort_unstable();
    if names != expected.tensors {
        let odd = names
            .iter()
            .find(|n| expected.tensors.binary_search(n).is_err())
            .or_else(|| {
                expected
                    .tensors
                    .iter()
                    .find(|n| names.binary_search(n).is_err())
            })
            .copied();
        return Err(Error::corrupt(
            path,
            odd,
            "the index and the file's header list different tensors",
        ));
    }
    for (key, want) in [
        ("acp.rank", expected.rank),
        ("acp.world_size", expected.world_size),
    ] {
        if let Some(got) = header.metadata.get(key) {
            if got.parse::<u32>().ok() != Some(want) {
                return Err(Error::corrupt(
                    path,
                    None,
                    format!("header says {key} {got}, the index {want}"),
                ));
            }
        }
    }
    Ok(())
}
