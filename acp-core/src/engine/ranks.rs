//! What one rank reads of the others' work: another rank's image from its
//! slot on this node (restore from RAM per node), some of another rank's
//! tensors without the rest (resharding), another rank's header (its
//! values) alone.
//!
//! Another rank's slot is read, never mapped or locked: its owner may be
//! alive and reuse the slot at any time. Bytes copied from it are kept only
//! when the slot's control block is unchanged across the copy
//! ([`PeerSlot`]) and every chunk matches the committed digests; anything
//! else falls back to storage. Partial reads read and verify whole digest
//! chunks: the chunks under the header, then those under the wanted
//! tensors.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::checkpoint::Backing;
use super::open::{job_id, job_names};
use super::state::Shared;
use super::{Checkpoint, LoadReport, Source};
use crate::error::{Error, Result};
use crate::format::{data_file_name, FileEntry, ParsedHeader};
use crate::read::{read_and_sum, ChunkDst, ChunkReader, ChunkSource, StoredSource};
use crate::staging::{slot_files, PeerImage, PeerSlot, SlotFile};
use crate::storage::Storage;

/// The slot files of `rank` of this engine's job in this user's directory
/// under the shm directory, whatever the number of slots that rank
/// configured.
fn peer_slots(shared: &Shared, rank: u32) -> Vec<SlotFile> {
    let job = job_id(&shared.cfg, &*shared.root);
    slot_files(&shared.cfg.shm_dir, &job, Some(rank)).unwrap_or_else(|e| {
        tracing::debug!("acp: rank {rank}'s slots: {e}");
        Vec::new()
    })
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
fn storage(root: &dyn Storage, step: u64, name: &str, entry: &FileEntry) -> Result<StoredSource> {
    let (file, path) = root.open_listed(step, name, entry.file_len())?.into_parts();
    StoredSource::open(root, step, name, file, path, entry)
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
    Partial::new(&entry, storage(&*shared.root, step, &name, &entry)?)?.header()
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
                Ok((p, h)) => return Ok(checkpoint(shared, step, p, h, Source::Ram, t0)),
                Err(e) => tracing::warn!(
                    "acp: rank {rank}'s resident copy of step {step} not used, reading storage: {e}"
                ),
            }
        }
    }
    let source = storage(&*shared.root, step, &name, &entry)?;
    let (p, h) = read_tensors(source, &entry, names, step, None)?;
    Ok(checkpoint(shared, step, p, h, Source::Storage, t0))
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

fn checkpoint<S: ChunkSource>(
    shared: &Shared,
    step: u64,
    p: Partial<S>,
    header: ParsedHeader,
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
        header: std::sync::Arc::new(header),
        backing: Backing::Heap(p.buf, len),
        report: LoadReport {
            source,
            bytes: read,
            verified: true,
            secs: t0.elapsed().as_secs_f64(),
            rejected: None,
        },
        copy_threads: shared.cfg.copy_threads,
        _warm: shared.ring.defer_warming(),
    }
}

fn to_usize(v: u64) -> usize {
    super::to_usize(v)
}
