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
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::checkpoint::Backing;
use super::open::{job_id, job_names};
use super::state::Shared;
use super::{Checkpoint, LoadReport, Source};
use crate::error::{Error, Result};
use crate::format::{
    data_file_name, parse_header, unhex, FileEntry, ParsedHeader, MAX_HEADER_BYTES,
};
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

/// Copies `rank`'s image of `step` out of its slot on this node, when one
/// holds it, into private memory. The memory is sized only once a slot
/// file is found whose real size holds an image of the index's length.
/// Returns the memory and the slot file it came from; the caller verifies
/// the bytes against `entry` before trusting them.
pub(super) fn copy_from_peer_slot(
    shared: &Shared,
    step: u64,
    rank: u32,
    entry: &FileEntry,
) -> Option<(memmap2::MmapMut, PathBuf)> {
    let slot = open_peer_slot(shared, step, rank, entry)?;
    let path = slot.path().to_path_buf();
    let copied = super::load::heap(entry.size, &path).and_then(|mut buf| {
        slot.read_at(0, &mut buf[..to_usize(entry.size)])?;
        Ok(slot.unchanged()?.then_some(buf))
    });
    match copied {
        Ok(buf) => buf.map(|b| (b, path)),
        Err(e) => {
            tracing::debug!("acp: rank {rank}'s slot {}: {e}", path.display());
            None
        }
    }
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

/// Where the chunks of an image are read from.
enum Chunks {
    Storage(File, PathBuf),
    Peer(PeerSlot),
}

impl Chunks {
    /// Opens data file `name` of committed `step`, which the index says
    /// has `size` bytes ([`Storage::open_listed`]: refused when its real
    /// size differs, so no memory is sized by an index that disagrees with
    /// the file).
    fn storage(root: &dyn Storage, step: u64, name: &str, size: u64) -> Result<Chunks> {
        let (file, path) = root.open_listed(step, name, size)?.into_parts();
        Ok(Chunks::Storage(file, path))
    }

    fn path(&self) -> &Path {
        match self {
            Chunks::Storage(_, p) => p,
            Chunks::Peer(s) => s.path(),
        }
    }

    fn read_at(&self, start: u64, dst: &mut [u8]) -> Result<()> {
        match self {
            Chunks::Storage(f, p) => f
                .read_exact_at(dst, start)
                .map_err(|e| Error::io("read", p, e)),
            Chunks::Peer(s) => s.read_at(start, dst),
        }
    }
}

/// An image read chunk by chunk into memory of its full size (untouched
/// pages cost nothing), each chunk checked against the index once.
struct Partial<'a> {
    entry: &'a FileEntry,
    src: Chunks,
    buf: memmap2::MmapMut,
    read: BTreeSet<u64>,
}

impl<'a> Partial<'a> {
    /// Memory for the image of `entry`, read from `src`: a storage file
    /// whose real size is the index's ([`Chunks::storage`]), or a peer slot
    /// whose file holds an image of that length ([`PeerSlot::open`]).
    fn new(entry: &'a FileEntry, src: Chunks) -> Result<Partial<'a>> {
        if entry.chunk_bytes == 0 || entry.chunk_bytes > 1 << 30 {
            return Err(Error::corrupt(
                src.path(),
                None,
                format!(
                    "chunks of {} bytes are past acp's limits",
                    entry.chunk_bytes
                ),
            ));
        }
        let buf = super::load::heap(entry.size, src.path())?;
        Ok(Partial {
            entry,
            src,
            buf,
            read: BTreeSet::new(),
        })
    }

    fn chunk_span(&self, i: u64) -> (u64, u64) {
        let start = i * self.entry.chunk_bytes;
        (start, (start + self.entry.chunk_bytes).min(self.entry.size))
    }

    /// Reads and checks chunk `i`, unless already done.
    fn chunk(&mut self, i: u64) -> Result<()> {
        if self.read.contains(&i) {
            return Ok(());
        }
        let (start, end) = self.chunk_span(i);
        let want = usize::try_from(i)
            .ok()
            .and_then(|i| self.entry.chunks.get(i))
            .and_then(|h| unhex(h));
        let Some(want) = want else {
            return Err(Error::corrupt(
                self.src.path(),
                None,
                format!("the index records no digest for bytes {start}..{end}"),
            ));
        };
        let dst = &mut self.buf[to_usize(start)..to_usize(end)];
        self.src.read_at(start, dst)?;
        if *blake3::hash(dst).as_bytes() != want {
            return Err(Error::corrupt(
                self.src.path(),
                None,
                format!("digest mismatch in bytes {start}..{end}"),
            ));
        }
        self.read.insert(i);
        Ok(())
    }

    /// Reads the chunks under the header; parses it.
    fn header(&mut self) -> Result<ParsedHeader> {
        let mut need = 8u64.min(self.entry.size);
        let mut i = 0;
        while i * self.entry.chunk_bytes < need {
            self.chunk(i)?;
            if let Some(n) = self.buf.first_chunk::<8>() {
                need = u64::from_le_bytes(*n)
                    .saturating_add(8)
                    .min(self.entry.size);
            }
            if need > MAX_HEADER_BYTES + 8 {
                return Err(Error::corrupt(
                    self.src.path(),
                    None,
                    format!("a header of {need} bytes is past acp's limit"),
                ));
            }
            i += 1;
        }
        parse_header(
            self.src.path(),
            &self.buf[..to_usize(need)],
            self.entry.size,
        )
    }

    /// Reads the chunks under bytes `start..end`.
    fn range(&mut self, start: u64, end: u64) -> Result<()> {
        if end <= start {
            return Ok(());
        }
        let c = self.entry.chunk_bytes;
        for i in start / c..end.div_ceil(c) {
            self.chunk(i)?;
        }
        Ok(())
    }
}

/// The header of `rank`'s file of committed `step`, read from the chunks
/// that hold it, each checked against the index's digests.
pub(super) fn read_header(shared: &Shared, step: u64, rank: u32) -> Result<ParsedHeader> {
    let (name, entry) = file_of(shared, step, rank)?;
    let chunks = Chunks::storage(&*shared.root, step, &name, entry.size)?;
    Partial::new(&entry, chunks)?.header()
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
            let got = read_tensors(Chunks::Peer(slot), &entry, names, step).and_then(|(p, h)| {
                match &p.src {
                    Chunks::Peer(s) if !s.unchanged()? => Err(Error::corrupt(
                        &slot_path,
                        None,
                        "the slot was reused during the copy",
                    )),
                    _ => Ok((p, h)),
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
    let chunks = Chunks::storage(&*shared.root, step, &name, entry.size)?;
    let (p, h) = read_tensors(chunks, &entry, names, step)?;
    Ok(checkpoint(shared, step, p, h, Source::Storage, t0))
}

fn read_tensors<'a>(
    src: Chunks,
    entry: &'a FileEntry,
    names: &[String],
    step: u64,
) -> Result<(Partial<'a>, ParsedHeader)> {
    let mut p = Partial::new(entry, src)?;
    let mut header = p.header()?;
    if header.step.is_some_and(|s| s != step) {
        return Err(Error::corrupt(
            p.src.path(),
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
            what: format!("tensor `{missing}` in {}", p.src.path().display()),
        });
    }
    for e in &header.entries {
        p.range(e.offset, e.offset + e.len)?;
    }
    Ok((p, header))
}

fn checkpoint(
    shared: &Shared,
    step: u64,
    p: Partial<'_>,
    header: ParsedHeader,
    source: Source,
    t0: Instant,
) -> Checkpoint {
    let read: u64 = p
        .read
        .iter()
        .map(|&i| {
            let (s, e) = p.chunk_span(i);
            e - s
        })
        .sum();
    let len = to_usize(p.entry.size);
    Checkpoint {
        step,
        values: header.values,
        entries: header.entries,
        backing: Backing::Heap(p.buf, len),
        report: LoadReport {
            source,
            bytes: read,
            verified: true,
            secs: t0.elapsed().as_secs_f64(),
            rejected: None,
        },
        copy_threads: shared.cfg.copy_threads,
    }
}

fn to_usize(v: u64) -> usize {
    super::to_usize(v)
}
