//! A compressed data file seen as its plain image: a [`ChunkSource`] that
//! decodes frames, so the [`ChunkReader`](super::ChunkReader) checks the
//! decoded chunks against the index as it checks a plain file's.

use std::collections::{btree_map, BTreeMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::source::{ChunkSource, FileSource};
use crate::error::{Error, ErrorKind, Result};
use crate::format::{
    chunk_span, decode_frame, decode_frame_lead, read_header, read_packed_table,
    validate_file_name, ChunkRef, Digest, FileEntry, FrameCodec, Index, PackedTable,
    INDEX_FILE_NAME,
};
use crate::storage::{Probe, Storage};

/// At most this much of the decoded header is read to name the tensors of
/// a bad frame: it is an error path.
const GUESS_HEADER_BYTES: u64 = 1 << 20;

/// The plain image of the compressed file `inner` holds (whose
/// [`ChunkSource::len`] is the file's length on storage). Each read
/// decodes the frames under it: a frame's check is verified before it is
/// decoded, and it decodes into its chunk's length only.
#[derive(Debug)]
pub(crate) struct PackedSource<S> {
    inner: S,
    table: PackedTable,
    /// The index's references of the file, sorted by chunk (an
    /// incremental step's), each with the position in `held` of the file
    /// that holds its chunks.
    refs: Vec<(ChunkRef, usize)>,
    /// The files of earlier steps that hold the referenced chunks, opened
    /// without their own references (one hop).
    held: Vec<StoredSource>,
    /// For each of `held` that is a plain file, the same file opened again
    /// with `O_DIRECT` where the file system allows it: whole aligned
    /// chunks are read with it, as a plain restore reads, without the
    /// page cache's copy.
    direct: Vec<Option<File>>,
}

impl<S: ChunkSource> PackedSource<S> {
    /// Reads and checks `inner`'s head and frame table against `entry`
    /// (the index's record of the file).
    ///
    /// # Errors
    /// As [`read_packed_table`].
    pub(crate) fn new(inner: S, entry: &FileEntry) -> Result<PackedSource<S>> {
        let table = read_packed_table(
            inner.name(),
            inner.len(),
            entry.size,
            entry.chunk_bytes,
            &mut |b, o| inner.read_at(b, o),
        )?;
        Ok(PackedSource {
            inner,
            table,
            refs: Vec::new(),
            held: Vec::new(),
            direct: Vec::new(),
        })
    }

    /// Resolves the file's references (`entry.refs`) through `held`,
    /// which opens the file that holds each run (one per distinct step and
    /// file): the container's reference frames must be exactly the chunks
    /// the index references.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming the file for a reference frame the index
    /// does not list or a listed chunk that is not one; `held`'s errors.
    fn resolve(
        &mut self,
        entry: &FileEntry,
        held: &mut dyn FnMut(&ChunkRef) -> Result<StoredSource>,
    ) -> Result<()> {
        for (i, frame) in self.table.frames.iter().enumerate() {
            let i = i as u64;
            let is_ref = frame.codec == FrameCodec::Reference;
            if is_ref != entry.held_by(i).is_some() {
                return Err(Error::corrupt(
                    self.inner.name(),
                    None,
                    format!(
                        "chunk {i}: the container {} a reference, the index {}",
                        if is_ref { "holds" } else { "does not hold" },
                        if is_ref {
                            "does not list one"
                        } else {
                            "lists one"
                        }
                    ),
                ));
            }
        }
        let mut opened: BTreeMap<(u64, &str), usize> = BTreeMap::new();
        for r in &entry.refs {
            let at = match opened.entry((r.step, r.file.as_str())) {
                btree_map::Entry::Occupied(o) => *o.get(),
                btree_map::Entry::Vacant(v) => {
                    let src = held(r)?;
                    self.direct.push(match &src {
                        StoredSource::Plain(f) => f.reopen_direct(),
                        StoredSource::Packed(_) => None,
                    });
                    self.held.push(src);
                    *v.insert(self.held.len() - 1)
                }
            };
            self.refs.push((r.clone(), at));
        }
        Ok(())
    }

    /// The file that holds chunk `i`, when this file references it, and
    /// its `O_DIRECT` handle, when it has one.
    fn holder_of(&self, i: u64) -> Option<(&StoredSource, Option<&File>)> {
        let at = self.refs.partition_point(|(r, _)| r.first + r.count <= i);
        self.refs
            .get(at)
            .filter(|(r, _)| r.holds(i))
            .and_then(|(_, h)| {
                let direct = self.direct.get(*h).and_then(Option::as_ref);
                self.held.get(*h).map(|s| (s, direct))
            })
    }

    /// The file that holds chunk `i`, when this file references it.
    fn holder(&self, i: u64) -> Option<&StoredSource> {
        self.holder_of(i).map(|(s, _)| s)
    }

    /// The head and frame table.
    pub(crate) fn table(&self) -> &PackedTable {
        &self.table
    }

    /// The leading bytes of the image that its first frame holds in a
    /// run of width 1 (the header, and any 1-byte tensors after it),
    /// decoded alone after the frame's check ([`decode_frame_lead`]),
    /// unverified against the chunk's digest: for planning a load, whose
    /// read then verifies every chunk. `None` when the first frame is not
    /// a grouped one (stored raw, or referenced) or starts with a wider
    /// run.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for a frame that fails its check or does not
    /// decode; the source's errors.
    pub(crate) fn lead(&self) -> Result<Option<Vec<u8>>> {
        let Some(frame) = self.table.frames.first() else {
            return Ok(None);
        };
        if frame.codec != FrameCodec::GroupedZstd {
            return Ok(None);
        }
        let mut stored = vec![0u8; to_usize(frame.stored)];
        self.inner.read_at(&mut stored, frame.offset)?;
        decode_frame_lead(self.inner.name(), 0, frame, &stored)
    }

    /// Decodes the image bytes `[offset, offset + buf.len())` into `buf`;
    /// `tensors` names what a bad frame holds. Frames are read into
    /// `stored` (grown to the largest frame, kept by the caller between
    /// calls). `digest_of(i)`, when given, is the digest the caller checks
    /// chunk `i` against before it trusts its bytes: a stored frame whose
    /// check is that very digest (blake3 of the same bytes) is then read
    /// straight into `buf` and left to that one check.
    fn decode_at(
        &self,
        buf: &mut [u8],
        offset: u64,
        tensors: &dyn Fn(u64, u64) -> Vec<String>,
        digest_of: Option<&dyn Fn(u64) -> Option<Digest>>,
        stored: &mut Vec<u8>,
    ) -> Result<()> {
        let t = &self.table;
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|e| *e <= t.image_len)
            .ok_or_else(|| {
                Error::invalid(
                    self.inner.name().display(),
                    format!(
                        "bytes {offset}+{} of an image of {}",
                        buf.len(),
                        t.image_len
                    ),
                )
            })?;
        if buf.is_empty() {
            return Ok(());
        }
        let mut chunk = Vec::new();
        for i in offset / t.chunk_bytes..=(end - 1) / t.chunk_bytes {
            let (cs, ce) = chunk_span(i, t.chunk_bytes, t.image_len);
            let frame = usize::try_from(i)
                .ok()
                .and_then(|i| t.frames.get(i))
                .ok_or_else(|| {
                    Error::corrupt(self.inner.name(), None, format!("no frame for chunk {i}"))
                })?;
            let (from, to) = (offset.max(cs), end.min(ce));
            let at = to_usize(from - offset);
            if frame.codec == FrameCodec::Reference {
                if let Some((h, direct)) = self.holder_of(i) {
                    // The same span of the file that holds the chunk; the
                    // reader checks it against this file's digest.
                    let dst = &mut buf[at..at + to_usize(to - from)];
                    match direct.filter(|_| direct_aligned(dst, from)) {
                        Some(f) => f
                            .read_exact_at(dst, from)
                            .map_err(|e| Error::io("read", h.name(), e))?,
                        None => h.read_at(dst, from)?,
                    }
                    continue;
                }
            }
            let whole = from == cs && to == ce;
            if whole
                && frame.codec == FrameCodec::Stored
                && digest_of.and_then(|d| d(i)) == Some(frame.check)
            {
                self.inner
                    .read_at(&mut buf[at..at + to_usize(ce - cs)], frame.offset)?;
                continue;
            }
            if stored.len() < to_usize(frame.stored) {
                stored.resize(to_usize(frame.stored), 0);
            }
            let stored = &mut stored[..to_usize(frame.stored)];
            self.inner.read_at(stored, frame.offset)?;
            // A read of the whole chunk decodes in place; a part decodes
            // into a chunk buffer first.
            let dst: &mut [u8] = if whole {
                &mut buf[at..at + to_usize(ce - cs)]
            } else {
                chunk.resize(to_usize(ce - cs), 0);
                &mut chunk[..]
            };
            decode_frame(self.inner.name(), i, frame, stored, dst, &|| {
                tensors(cs, ce)
            })?;
            if !whole {
                buf[at..at + to_usize(to - from)]
                    .copy_from_slice(&chunk[to_usize(from - cs)..to_usize(to - cs)]);
            }
        }
        Ok(())
    }

    /// The tensors with bytes in `[start, end)`, from a best-effort decode
    /// of the header (unverified, for naming only); none when that fails.
    fn guess_tensors(&self, start: u64, end: u64) -> Vec<String> {
        let none = |_: u64, _: u64| Vec::new();
        let Ok(h) = read_header(
            self.inner.name(),
            self.table.image_len,
            GUESS_HEADER_BYTES,
            |b, o| self.decode_at(b, o, &none, None, &mut Vec::new()),
        ) else {
            return Vec::new();
        };
        h.entries
            .iter()
            .filter(|e| e.len > 0 && e.offset < end && e.offset + e.len > start)
            .map(|e| e.name.clone())
            .collect()
    }
}

impl<S: ChunkSource + Sync> ChunkSource for PackedSource<S> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.decode_at(
            buf,
            offset,
            &|s, e| self.guess_tensors(s, e),
            None,
            &mut Vec::new(),
        )
    }

    fn read_for_digests(
        &self,
        buf: &mut [u8],
        offset: u64,
        digest_of: &dyn Fn(u64) -> Option<Digest>,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        self.decode_at(
            buf,
            offset,
            &|s, e| self.guess_tensors(s, e),
            Some(digest_of),
            scratch,
        )
    }

    fn len(&self) -> u64 {
        self.table.image_len
    }

    fn name(&self) -> &Path {
        self.inner.name()
    }

    fn decodes(&self) -> bool {
        true
    }

    fn held_by(&self, offset: u64) -> Option<&Path> {
        self.holder(offset / self.table.chunk_bytes.max(1))
            .map(ChunkSource::name)
    }
}

/// A committed data file as its index entry describes it: plain, or
/// compressed and decoded on the fly.
#[derive(Debug)]
pub(crate) enum StoredSource {
    /// A plain safetensors file.
    Plain(FileSource),
    /// A compressed file.
    Packed(PackedSource<FileSource>),
}

impl StoredSource {
    /// The source of `file` (opened at `path`, its length on storage
    /// already checked against [`FileEntry::file_len`]) as `entry`
    /// describes it; its reads of a compressed file are first shown to
    /// `probe` (a plain file is read through the I/O engine, which has its
    /// own).
    ///
    /// # Errors
    /// For a compressed file, as [`PackedSource::new`].
    pub(crate) fn new(
        file: File,
        path: PathBuf,
        entry: &FileEntry,
        probe: Option<Arc<dyn Probe>>,
    ) -> Result<StoredSource> {
        let raw = FileSource::new(file, path, entry.file_len(), probe);
        if entry.stored_size.is_some() {
            Ok(StoredSource::Packed(PackedSource::new(raw, entry)?))
        } else {
            Ok(StoredSource::Plain(raw))
        }
    }

    /// [`StoredSource::new`] for file `name` of committed `step` of
    /// `root`, with the chunks it references (an incremental step) read
    /// from the files of the earlier steps that hold them, opened through
    /// `root` by step number and checked file name only (never a path
    /// from the index). Each referenced file must be listed by its step's
    /// index with the same chunk size, hold the referenced chunks itself
    /// (one hop), and record the same digests for them as this file's
    /// index does; the bytes read are then checked against this file's
    /// digests like any others.
    ///
    /// # Errors
    /// As [`StoredSource::new`]; [`Error::Corrupt`] naming this step's
    /// index for a reference that does not resolve as above (a missing
    /// step or file included).
    pub(crate) fn open(
        root: &dyn Storage,
        step: u64,
        name: &str,
        file: File,
        path: PathBuf,
        entry: &FileEntry,
        probe: Option<&Arc<dyn Probe>>,
    ) -> Result<StoredSource> {
        let mut src = StoredSource::new(file, path, entry, probe.cloned())?;
        if let StoredSource::Packed(p) = &mut src {
            let index_path = root.describe(step, INDEX_FILE_NAME);
            // Each referenced step's index is read once, however many of
            // its files the references name: a hostile index naming R
            // files of a step whose index lists them all cost R reads of
            // an index of R² bytes (minutes of CPU at R = 1,000).
            let mut indexes: BTreeMap<u64, Index> = BTreeMap::new();
            p.resolve(entry, &mut |r| {
                let index = match indexes.entry(r.step) {
                    btree_map::Entry::Occupied(o) => o.into_mut(),
                    btree_map::Entry::Vacant(v) => {
                        v.insert(root.read_index(r.step).map_err(|e| match e.kind() {
                            ErrorKind::Io => e,
                            _ => bad_ref(
                                &index_path,
                                name,
                                r,
                                format!("that step cannot be read ({e})"),
                            ),
                        })?)
                    }
                };
                held_file(root, &index_path, name, entry, r, index, probe)
            })?;
        }
        Ok(src)
    }

    /// [`PackedSource::lead`] of a compressed file; `None` for a plain
    /// one.
    ///
    /// # Errors
    /// As [`PackedSource::lead`].
    pub(crate) fn lead(&self) -> Result<Option<Vec<u8>>> {
        match self {
            StoredSource::Plain(_) => Ok(None),
            StoredSource::Packed(p) => p.lead(),
        }
    }

    /// The compressed file's table, when it is one.
    pub(crate) fn packed(&self) -> Option<&PackedTable> {
        match self {
            StoredSource::Plain(_) => None,
            StoredSource::Packed(p) => Some(p.table()),
        }
    }
}

impl ChunkSource for StoredSource {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        match self {
            StoredSource::Plain(s) => s.read_at(buf, offset),
            StoredSource::Packed(s) => s.read_at(buf, offset),
        }
    }

    fn len(&self) -> u64 {
        match self {
            StoredSource::Plain(s) => s.len(),
            StoredSource::Packed(s) => s.len(),
        }
    }

    fn name(&self) -> &Path {
        match self {
            StoredSource::Plain(s) => s.name(),
            StoredSource::Packed(s) => s.name(),
        }
    }

    fn read_for_digests(
        &self,
        buf: &mut [u8],
        offset: u64,
        digest_of: &dyn Fn(u64) -> Option<Digest>,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        match self {
            StoredSource::Plain(s) => s.read_at(buf, offset),
            StoredSource::Packed(s) => s.read_for_digests(buf, offset, digest_of, scratch),
        }
    }

    fn decodes(&self) -> bool {
        matches!(self, StoredSource::Packed(_))
    }

    fn held_by(&self, offset: u64) -> Option<&Path> {
        match self {
            StoredSource::Plain(_) => None,
            StoredSource::Packed(s) => s.held_by(offset),
        }
    }
}

/// The error for reference `r` of file `name` (index at `index_path`)
/// that does not resolve, for `reason`.
fn bad_ref(index_path: &Path, name: &str, r: &ChunkRef, reason: String) -> Error {
    Error::corrupt(
        index_path,
        None,
        format!(
            "`metadata.acp.files.{name}`: chunks {}+{} reference step {} file {}: {reason}",
            r.first, r.count, r.step, r.file
        ),
    )
}

/// Opens the file that reference `r` of file `name` (index entry `entry`,
/// index at `index_path`) names, after checking it against its own step's
/// index (`index`) as [`StoredSource::open`] says.
fn held_file(
    root: &dyn Storage,
    index_path: &Path,
    name: &str,
    entry: &FileEntry,
    r: &ChunkRef,
    index: &Index,
    probe: Option<&Arc<dyn Probe>>,
) -> Result<StoredSource> {
    let bad = |reason: String| bad_ref(index_path, name, r, reason);
    validate_file_name(index_path, &r.file)?;
    let held = index
        .files
        .get(&r.file)
        .ok_or_else(|| bad("that step's index does not list the file".to_owned()))?;
    if held.chunk_bytes != entry.chunk_bytes {
        return Err(bad(format!(
            "it has chunks of {} bytes, this file {}",
            held.chunk_bytes, entry.chunk_bytes
        )));
    }
    for i in r.first..r.first + r.count {
        if held.held_by(i).is_some() {
            return Err(bad(format!(
                "it references chunk {i} itself (a reference must name the file that holds the bytes)"
            )));
        }
        let here = chunk_span(i, entry.chunk_bytes, entry.size);
        let there = chunk_span(i, held.chunk_bytes, held.size);
        let (mine, theirs) = (
            usize::try_from(i).ok().and_then(|i| entry.chunks.get(i)),
            usize::try_from(i).ok().and_then(|i| held.chunks.get(i)),
        );
        if here != there || mine.is_none() || mine != theirs {
            return Err(bad(format!(
                "its chunk {i} is not this file's (another span or digest)"
            )));
        }
    }
    let (file, path) = root
        .open_listed(r.step, &r.file, held.file_len())?
        .into_parts();
    StoredSource::new(file, path, held, probe.cloned())
}

/// Whether a read of `dst` at file offset `offset` meets `O_DIRECT`'s
/// alignment: memory, offset and length all multiples of 4096.
fn direct_aligned(dst: &[u8], offset: u64) -> bool {
    const ALIGN: usize = 4096;
    dst.as_ptr() as usize % ALIGN == 0
        && offset % ALIGN as u64 == 0
        && dst.len() % ALIGN == 0
        && !dst.is_empty()
}

/// A length within a frame or chunk held in memory.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("frames and chunks are at most 1 GiB, checked against the index")
}
