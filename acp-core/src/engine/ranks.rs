//! What one rank reads of the others' work: another rank's image from its
//! slot on this node (restore from RAM per node), some of another rank's
//! tensors without the rest (resharding), another rank's header (its
//! values) alone.
//!
//! Another rank's slot is read, never mapped or locked: its owner may be
//! alive and reuse the slot at any time. Bytes copied from it are kept only
//! when the slot's control block is unchanged across the copy
//! ([`PeerSlot`]) and every chunk matches the committed digests; anything
//! else falls back to storage. Where the slot records quick sums beside
//! digests that are the committed ones (read before any byte, and bound to
//! those digests), each chunk is checked against its sum as soon as it is
//! copied, on the copy threads: a chunk that gives the committed image's
//! sum is that image's, whatever the slot holds by then. A load into the
//! caller's memory ([`read_pending_into`]) copies each chunk into a buffer
//! of its thread, checks it, and copies it into its destinations, with
//! nothing kept in between. Partial reads read and verify whole digest
//! chunks: the chunks under the header, then those under the wanted
//! tensors.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::checkpoint::Backing;
use super::open::{job_id, job_names};
use super::state::Shared;
use super::{Checkpoint, LoadReport, Source};
use crate::error::{Error, Result};
use crate::format::{data_file_name, FileEntry, ParsedHeader};
use crate::read::{
    read_and_sum, read_check_copy, ChunkCopy, ChunkDst, ChunkReader, ChunkSource, StoredSource,
};
use crate::staging::{replica_files, slot_files, PeerImage, PeerSlot, SlotFile};

/// The slot files of `rank` of this engine's job in this user's directory
/// under the shm directory, whatever the number of slots that rank
/// configured; then the replica slots kept on this node of `rank`'s
/// images (peer replicas: `rank` on another node), which hold the same
/// images and are read and checked the same way.
fn peer_slots(shared: &Shared, rank: u32) -> Vec<SlotFile> {
    let job = job_id(&shared.cfg, &*shared.root);
    let mut files = slot_files(&shared.cfg.shm_dir, &job, Some(rank)).unwrap_or_else(|e| {
        tracing::debug!("acp: rank {rank}'s slots: {e}");
        Vec::new()
    });
    files.extend(
        replica_files(&shared.cfg.shm_dir, &job, Some(rank)).unwrap_or_else(|e| {
            tracing::debug!("acp: replica slots of rank {rank}: {e}");
            Vec::new()
        }),
    );
    files
}

fn peer_image(shared: &Shared, step: u64, rank: u32, entry: &FileEntry) -> PeerImage {
    let (_, job_tag) = job_names(&shared.cfg, &*shared.root, rank);
    PeerImage {
        job_tag,
        rank,
        step,
        len: entry.size,
    }
}

/// An image copied out of another rank's slot ([`copy_from_peer_slot`]).
pub(super) struct PeerCopy {
    pub(super) buf: memmap2::MmapMut,
    /// The slot file it came from.
    pub(super) path: PathBuf,
    /// Whether every chunk gave, as it was copied, the quick sum the slot
    /// recorded beside digests that are `entry`'s (the committed ones):
    /// the copy is then checked. False when the slot recorded no such sums
    /// or a chunk differed: the caller checks the digests.
    pub(super) summed: bool,
}

/// Copies `rank`'s image of `step` out of its slot on this node, when one
/// holds it, into private memory. The memory is sized only once a slot
/// file is found whose real size holds an image of the index's length.
/// When the slot recorded quick sums beside `entry`'s digests, each chunk
/// is summed as soon as it is copied, on the copy threads, while it is in
/// cache ([`PeerCopy::summed`]); the caller verifies the bytes against
/// `entry` otherwise before trusting them.
pub(super) fn copy_from_peer_slot(
    shared: &Shared,
    step: u64,
    rank: u32,
    entry: &FileEntry,
) -> Option<PeerCopy> {
    let slot = open_peer_slot(shared, step, rank, entry)?;
    let path = slot.path().to_path_buf();
    let copied = super::load::heap_whole(entry.size, &path).and_then(|mut buf| {
        // Read before the bytes, and bound to the committed digests: they
        // are the committed image's sums whatever the slot holds later.
        let sums = committed_sums(&slot, entry)?;
        let len = to_usize(entry.size);
        let summed = match &sums {
            Some(sums) => {
                let chunks = image_chunks(&mut buf[..len], entry.chunk_bytes);
                let differ = read_and_sum(&slot, chunks, sums, shared.cfg.copy_threads)?;
                if let Some(k) = differ.first() {
                    tracing::warn!(
                        "acp: rank {rank}'s resident copy of step {step} in {}: chunk {k} differs from its quick sum; checking its digests",
                        path.display()
                    );
                }
                differ.is_empty()
            }
            None => {
                slot.read_at(0, &mut buf[..len])?;
                false
            }
        };
        Ok(slot.unchanged()?.then_some((buf, summed)))
    });
    match copied {
        Ok(found) => found.map(|(buf, summed)| PeerCopy { buf, path, summed }),
        Err(e) => {
            tracing::debug!("acp: rank {rank}'s slot {}: {e}", path.display());
            None
        }
    }
}

/// The quick sums `slot` records for its image beside digests that are
/// `entry`'s (the committed ones), if it records such.
///
/// # Errors
/// [`Error::Io`] reading the slot's control block.
fn committed_sums(slot: &PeerSlot, entry: &FileEntry) -> Result<Option<Vec<u64>>> {
    match slot.digests()? {
        Some((chunk, digests)) if super::replicate::same_digests(entry, chunk, &digests) => {
            slot.sums(chunk, &digests)
        }
        _ => Ok(None),
    }
}

/// `image` cut into its digest chunks of `chunk` bytes, for
/// [`read_and_sum`].
fn image_chunks(image: &mut [u8], chunk: u64) -> Vec<ChunkDst<'_>> {
    let chunk = to_usize(chunk).max(1);
    image
        .chunks_mut(chunk)
        .enumerate()
        .map(|(k, dst)| (k, (k * chunk) as u64, dst))
        .collect()
}

/// Another rank's slot holding the image, if one on this node does.
fn open_peer_slot(shared: &Shared, step: u64, rank: u32, entry: &FileEntry) -> Option<PeerSlot> {
    let want = peer_image(shared, step, rank, entry);
    peer_slots(shared, rank)
        .into_iter()
        .find_map(|slot| match PeerSlot::open(&slot, want) {
            Ok(open) => open,
            Err(e) => {
                tracing::debug!("acp: rank {rank}'s slot {}: {e}", slot.path().display());
                None
            }
        })
}

/// Opens data file `name` of committed `step`, which the index says has
/// `entry` ([`Storage::open_listed`]: refused when its real size differs,
/// so no memory is sized by an index that disagrees with the file); a
/// compressed file is decoded as it is read.
fn storage(shared: &Shared, step: u64, name: &str, entry: &FileEntry) -> Result<StoredSource> {
    let root = &*shared.root;
    let (file, path) = root.open_listed(step, name, entry.file_len())?.into_parts();
    StoredSource::open(
        root,
        step,
        name,
        file,
        path,
        entry,
        shared.io_opts.faults.as_ref(),
    )
}

/// An image read chunk by chunk into memory of its full size (untouched
/// pages cost nothing), each chunk checked by the [`ChunkReader`] once.
struct Partial<S> {
    reader: ChunkReader<S>,
    buf: memmap2::MmapMut,
    read: BTreeSet<u64>,
}

impl<S: ChunkSource> Partial<S> {
    /// Memory for the image of `entry`, read from `src`: a storage file
    /// whose real size is the index's ([`storage`]), or a peer slot whose
    /// file holds an image of that length ([`PeerSlot::open`]).
    fn new(entry: &FileEntry, src: S) -> Result<Partial<S>> {
        let reader = ChunkReader::new(src, entry)?;
        let buf = super::load::heap(entry.size, reader.path())?;
        Ok(Partial {
            reader,
            buf,
            read: BTreeSet::new(),
        })
    }

    fn path(&self) -> &Path {
        self.reader.path()
    }

    /// Reads and checks the chunks under the header; parses it.
    fn header(&mut self) -> Result<ParsedHeader> {
        let (header, n) = self.reader.header_into(&mut self.buf)?;
        self.read.extend(0..n);
        Ok(header)
    }

    /// Reads the chunks under bytes `start..end`, each checked once.
    fn range(&mut self, start: u64, end: u64) -> Result<()> {
        if end <= start {
            return Ok(());
        }
        let c = self.reader.entry().chunk_bytes;
        for i in start / c..end.div_ceil(c) {
            if self.read.contains(&i) {
                continue;
            }
            let (s, e) = self.reader.span(i);
            self.reader
                .read_chunk_into(i, &mut self.buf[to_usize(s)..to_usize(e)])?;
            self.read.insert(i);
        }
        Ok(())
    }
}

impl<S: ChunkSource + Sync> Partial<S> {
    /// Reads the chunks under the byte ranges `ranges` not read yet, each
    /// summed as soon as it landed, while it is in cache, against `sums`
    /// (one per chunk of the image: the quick sums the slot recorded
    /// beside the committed digests), on up to `threads` threads, their
    /// memory taken first (in huge pages where the kernel allows). A chunk
    /// that does not give its sum is read again and checked against its
    /// digest, whose error names its tensors.
    fn ranges_summed(&mut self, ranges: &[(u64, u64)], sums: &[u64], threads: usize) -> Result<()> {
        let Partial { reader, buf, read } = self;
        let c = reader.entry().chunk_bytes;
        let want: BTreeSet<u64> = ranges
            .iter()
            .filter(|(s, e)| e > s)
            .flat_map(|&(s, e)| s / c..e.div_ceil(c))
            .filter(|i| !read.contains(i))
            .collect();
        if want.is_empty() {
            return Ok(());
        }
        // Advice only: without it the pages are taken as they are written.
        let _ = buf.advise(memmap2::Advice::HugePage);
        let mut run: Option<(u64, u64)> = None;
        for (s, e) in want
            .iter()
            .map(|&i| reader.span(i))
            .chain([(u64::MAX, u64::MAX)])
        {
            match run {
                Some((rs, re)) if re == s => run = Some((rs, e)),
                _ => {
                    if let Some((rs, re)) = run {
                        let from = to_usize(rs) / 4096 * 4096;
                        let to = to_usize(re).div_ceil(4096) * 4096;
                        let _ = buf.advise_range(
                            memmap2::Advice::PopulateWrite,
                            from,
                            to.min(buf.len()) - from,
                        );
                    }
                    run = Some((s, e));
                }
            }
        }
        let mut chunks: Vec<ChunkDst<'_>> = Vec::with_capacity(want.len());
        let mut rest: &mut [u8] = &mut buf[..];
        let mut pos = 0u64;
        for &i in &want {
            let (s, e) = reader.span(i);
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(to_usize(s - pos));
            let (dst, tail) = tail.split_at_mut(to_usize(e - s));
            chunks.push((to_usize(i), s, dst));
            rest = tail;
            pos = e;
        }
        let differ = read_and_sum(reader.source(), chunks, sums, threads)?;
        for k in differ {
            let k = k as u64;
            tracing::warn!(
                "acp: {}: chunk {k} differs from its quick sum; checking its digest",
                reader.path().display()
            );
            let (s, e) = reader.span(k);
            reader.read_chunk_into(k, &mut buf[to_usize(s)..to_usize(e)])?;
        }
        read.extend(want);
        Ok(())
    }
}

/// The header of `rank`'s file of committed `step`, read from the chunks
/// that hold it, each checked against the index's digests.
pub(super) fn read_header(shared: &Shared, step: u64, rank: u32) -> Result<ParsedHeader> {
    let (name, entry) = file_of(shared, step, rank)?;
    Partial::new(&entry, storage(shared, step, &name, &entry)?)?.header()
}

fn file_of(shared: &Shared, step: u64, rank: u32) -> Result<(String, FileEntry)> {
    let mut index = shared.root.read_index(step)?;
    let name = data_file_name(rank);
    let Some(entry) = index.files.remove(&name) else {
        return Err(Error::NotFound {
            what: format!(
                "rank {rank}'s file in step {step} of {}",
                shared.root.location().display()
            ),
        });
    };
    Ok((name, entry))
}

/// The tensors `names` of `rank`'s file of committed `step` (with the
/// file's values): only the chunks under the header and under them are
/// read, from `rank`'s slot on this node when it holds the step (unless
/// `storage_only`), else from storage.
pub(super) fn load_tensors(
    shared: &Shared,
    step: u64,
    rank: u32,
    names: &[String],
    storage_only: bool,
    t0: Instant,
) -> Result<Checkpoint> {
    let (name, entry) = file_of(shared, step, rank)?;
    if !storage_only {
        if let Some(slot) = open_peer_slot(shared, step, rank, &entry) {
            let slot_path = slot.path().to_path_buf();
            // Read before the bytes, bound to the committed digests.
            let sums = committed_sums(&slot, &entry).unwrap_or_else(|e| {
                tracing::debug!("acp: rank {rank}'s slot {}: {e}", slot_path.display());
                None
            });
            let summed = sums.as_deref().map(|s| (s, shared.cfg.copy_threads));
            let got = read_tensors(slot, &entry, names, step, summed).and_then(|(p, h)| {
                if p.reader.source().unchanged()? {
                    Ok((p, h))
                } else {
                    Err(Error::corrupt(
                        &slot_path,
                        None,
                        "the slot was reused during the copy",
                    ))
                }
            });
            match got {
                Ok((p, h)) => return Ok(checkpoint(shared, step, p, Arc::new(h), Source::Ram, t0)),
                Err(e) => tracing::warn!(
                    "acp: rank {rank}'s resident copy of step {step} not used, reading storage: {e}"
                ),
            }
        }
    }
    let source = storage(shared, step, &name, &entry)?;
    let (p, h) = read_tensors(source, &entry, names, step, None)?;
    Ok(checkpoint(
        shared,
        step,
        p,
        Arc::new(h),
        Source::Storage,
        t0,
    ))
}

/// `names` of the image in `src` (with its header): the chunks under the
/// header and under them, each checked against `entry`'s digests, or
/// against `summed` (the quick sums the source recorded beside those
/// digests, and the copy threads) when given.
fn read_tensors<S: ChunkSource + Sync>(
    src: S,
    entry: &FileEntry,
    names: &[String],
    step: u64,
    summed: Option<(&[u64], usize)>,
) -> Result<(Partial<S>, ParsedHeader)> {
    let (mut p, header) = plan_tensors(src, entry, names, step)?;
    match summed {
        Some((sums, threads)) => {
            let ranges: Vec<(u64, u64)> = header
                .entries
                .iter()
                .map(|e| (e.offset, e.offset + e.len))
                .collect();
            p.ranges_summed(&ranges, sums, threads)?;
        }
        None => {
            for e in &header.entries {
                p.range(e.offset, e.offset + e.len)?;
            }
        }
    }
    Ok((p, header))
}

/// The image in `src` with the chunks under its header read and checked
/// against `entry`'s digests, and its header, its entries cut to `names`
/// (each of which it must have).
fn plan_tensors<S: ChunkSource>(
    src: S,
    entry: &FileEntry,
    names: &[String],
    step: u64,
) -> Result<(Partial<S>, ParsedHeader)> {
    let mut p = Partial::new(entry, src)?;
    let mut header = p.header()?;
    if header.step.is_some_and(|s| s != step) {
        return Err(Error::corrupt(
            p.path(),
            None,
            format!("header says step {:?}, expected {step}", header.step),
        ));
    }
    let wanted: BTreeSet<&str> = names.iter().map(String::as_str).collect();
    header.entries.retain(|e| wanted.contains(e.name.as_str()));
    if header.entries.len() < wanted.len() {
        let have: BTreeSet<&str> = header.entries.iter().map(|e| e.name.as_str()).collect();
        let missing = wanted.difference(&have).next().copied().unwrap_or_default();
        return Err(Error::NotFound {
            what: format!("tensor `{missing}` in {}", p.path().display()),
        });
    }
    Ok((p, header))
}

/// Some tensors of another rank's image in its slot on this node, planned
/// ([`pending_tensors`]): the chunks under its header read and checked, the
/// others not read yet ([`read_pending_into`]).
pub(super) struct PeerTensors {
    partial: Partial<PeerSlot>,
    /// The slot's quick sums, recorded beside the committed digests.
    sums: Vec<u64>,
    step: u64,
    rank: u32,
    names: Vec<String>,
    /// Why a newer source was passed over for this one, if one was.
    pub(super) rejected: Option<String>,
}

impl std::fmt::Debug for PeerTensors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerTensors")
            .field("slot", &self.partial.path())
            .field("step", &self.step)
            .field("rank", &self.rank)
            .field("tensors", &self.names.len())
            .finish_non_exhaustive()
    }
}

impl PeerTensors {
    pub(super) fn step(&self) -> u64 {
        self.step
    }

    pub(super) fn image_bytes(&self) -> u64 {
        self.partial.reader.entry().size
    }

    /// The slot file.
    pub(super) fn path(&self) -> &Path {
        self.partial.path()
    }
}

/// The tensors `names` (all of them when `None`) of `rank`'s file of
/// committed `step`, planned from its slot on this node when one holds
/// the step and recorded quick sums beside the committed digests: its
/// header read and checked (against the digests) and cut to `names`.
/// `None` otherwise, or when anything is amiss (the load then takes
/// [`load_tensors`] or the whole file's path, which say what).
pub(super) fn pending_tensors(
    shared: &Shared,
    step: u64,
    rank: u32,
    names: Option<&[String]>,
) -> Option<(PeerTensors, ParsedHeader)> {
    let (_, entry) = file_of(shared, step, rank).ok()?;
    let slot = open_peer_slot(shared, step, rank, &entry)?;
    let path = slot.path().to_path_buf();
    let planned = committed_sums(&slot, &entry).and_then(|sums| {
        let Some(sums) = sums else {
            return Ok(None);
        };
        let (partial, header) = match names {
            Some(names) => plan_tensors(slot, &entry, names, step)?,
            None => {
                let mut partial = Partial::new(&entry, slot)?;
                let header = partial.header()?;
                (partial, header)
            }
        };
        Ok(Some((partial, header, sums)))
    });
    match planned {
        Ok(Some((partial, header, sums))) => Some((
            PeerTensors {
                partial,
                sums,
                step,
                rank,
                names: header.entries.iter().map(|e| e.name.clone()).collect(),
                rejected: None,
            },
            header,
        )),
        Ok(None) => None,
        Err(e) => {
            tracing::debug!("acp: rank {rank}'s slot {}: {e}", path.display());
            None
        }
    }
}

/// [`PendingLoad::read_into`](super::PendingLoad::read_into) of `pending`
/// (planned with `planned`, its header): the chunks under the tensors of
/// `into` are read from the slot into memory of each copy thread, checked
/// against their quick sums and copied into `into` while in cache; the
/// chunks under the other tensors are read, checked the same way, into
/// the checkpoint's memory. The checkpoint holds those, not the ones of
/// `into` ([`Checkpoint::holds`]). When a chunk differs (the slot reused
/// meanwhile, or its bytes changed), the tensors are read from storage
/// instead, into `into` too.
pub(super) fn read_pending_into(
    shared: &Shared,
    pending: PeerTensors,
    planned: &Arc<ParsedHeader>,
    t0: Instant,
    into: &mut [(usize, &mut [u8])],
) -> Result<Checkpoint> {
    let PeerTensors {
        mut partial,
        sums,
        step,
        rank,
        names,
        rejected,
    } = pending;
    let threads = shared.cfg.copy_threads;
    let path = partial.path().to_path_buf();
    let given: BTreeSet<usize> = into.iter().map(|(i, _)| *i).collect();
    // The tensors not given a destination: read into the checkpoint's
    // memory, as a load without `into` reads them.
    let kept: Vec<(u64, u64)> = planned
        .entries
        .iter()
        .enumerate()
        .filter(|(i, _)| !given.contains(i))
        .map(|(_, e)| (e.offset, e.offset + e.len))
        .collect();
    let read = partial.ranges_summed(&kept, &sums, threads).and_then(|()| {
        let c = partial.reader.entry().chunk_bytes;
        let Partial { reader, buf, read } = &mut partial;
        // Every destination cut at chunk boundaries: from the
        // checkpoint's memory where its chunk is there already (checked),
        // else read, checked and copied by a copy thread.
        let mut chunks: std::collections::BTreeMap<u64, ChunkCopy<'_>> =
            std::collections::BTreeMap::new();
        let mut bytes = 0u64;
        for (i, dst) in into.iter_mut() {
            let Some(e) = planned.entries.get(*i) else {
                continue;
            };
            let mut at = e.offset;
            let mut dst: &mut [u8] = dst;
            while !dst.is_empty() {
                let k = at / c;
                let take = to_usize(((k + 1) * c - at).min(dst.len() as u64));
                let (head, tail) = std::mem::take(&mut dst).split_at_mut(take);
                if read.contains(&k) {
                    head.copy_from_slice(&buf[to_usize(at)..to_usize(at) + take]);
                } else {
                    let (start, end) = reader.span(k);
                    chunks
                        .entry(k)
                        .or_insert_with(|| {
                            bytes += end - start;
                            ChunkCopy {
                                k: to_usize(k),
                                start,
                                len: to_usize(end - start),
                                pieces: Vec::new(),
                            }
                        })
                        .pieces
                        .push((at, head));
                }
                dst = tail;
                at += take as u64;
            }
        }
        let matched = read_check_copy(
            reader.source(),
            chunks.into_values().collect(),
            &sums,
            threads,
        )?;
        if matched {
            Ok(bytes)
        } else {
            Err(Error::corrupt(
                &path,
                None,
                "a chunk differs from its quick sum (the slot reused, or its bytes changed)",
            ))
        }
    });
    match read {
        Ok(direct) => {
            let mut ck = checkpoint(shared, step, partial, Arc::clone(planned), Source::Ram, t0);
            ck.report.bytes += direct;
            ck.elsewhere = given
                .iter()
                .filter_map(|&i| planned.entries.get(i))
                .filter(|e| e.len > 0)
                .map(|e| e.offset)
                .collect();
            Ok(ck.with_rejected(rejected))
        }
        Err(e) => {
            tracing::warn!(
                "acp: rank {rank}'s resident copy of step {step} not used, reading storage: {e}"
            );
            let ck = load_tensors(shared, step, rank, &names, true, t0)?;
            super::load::check_planned(&ck, planned, &path)?;
            let mut dsts: Vec<(usize, &mut [u8])> =
                into.iter_mut().map(|(i, d)| (*i, &mut **d)).collect();
            ck.copy_into(&mut dsts)?;
            Ok(ck.with_rejected(Some(e.to_string())))
        }
    }
}

fn checkpoint<S: ChunkSource>(
    shared: &Shared,
    step: u64,
    p: Partial<S>,
    header: Arc<ParsedHeader>,
    source: Source,
    t0: Instant,
) -> Checkpoint {
    let read: u64 = p
        .read
        .iter()
        .map(|&i| {
            let (s, e) = p.reader.span(i);
            e - s
        })
        .sum();
    let len = to_usize(p.reader.entry().size);
    Checkpoint {
        step,
        header,
        backing: Backing::Heap(p.buf, len),
        report: LoadReport {
            source,
            bytes: read,
            verified: true,
            secs: t0.elapsed().as_secs_f64(),
            rejected: None,
        },
        copy_threads: shared.cfg.copy_threads,
        elsewhere: BTreeSet::new(),
        warm: std::sync::Mutex::new(Some(shared.ring.defer_warming())),
    }
}

fn to_usize(v: u64) -> usize {
    super::to_usize(v)
}
