//! A compressed data file seen as its plain image: a [`ChunkSource`] that
//! decodes frames, so the [`ChunkReader`](super::ChunkReader) checks the
//! decoded chunks against the index as it checks a plain file's.

use std::fs::File;
use std::path::{Path, PathBuf};

use super::source::{ChunkSource, FileSource};
use crate::error::{Error, Result};
use crate::format::{
    chunk_span, decode_frame, read_header, read_packed_table, FileEntry, PackedTable,
};

/// The most threads a whole-file read decodes on.
const DECODE_THREADS: usize = 8;

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
        Ok(PackedSource { inner, table })
    }

    /// The head and frame table.
    pub(crate) fn table(&self) -> &PackedTable {
        &self.table
    }

    /// Decodes the image bytes `[offset, offset + buf.len())` into `buf`;
    /// `tensors` names what a bad frame holds.
    fn decode_at(
        &self,
        buf: &mut [u8],
        offset: u64,
        tensors: &dyn Fn(u64, u64) -> Vec<String>,
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
        let mut stored = Vec::new();
        let mut chunk = Vec::new();
        for i in offset / t.chunk_bytes..=(end - 1) / t.chunk_bytes {
            let (cs, ce) = chunk_span(i, t.chunk_bytes, t.image_len);
            let frame = usize::try_from(i)
                .ok()
                .and_then(|i| t.frames.get(i))
                .ok_or_else(|| {
                    Error::corrupt(self.inner.name(), None, format!("no frame for chunk {i}"))
                })?;
            stored.resize(to_usize(frame.stored), 0);
            self.inner.read_at(&mut stored, frame.offset)?;
            let (from, to) = (offset.max(cs), end.min(ce));
            let whole = from == cs && to == ce;
            let at = to_usize(from - offset);
            // A read of the whole chunk decodes in place; a part decodes
            // into a chunk buffer first.
            let dst: &mut [u8] = if whole {
                &mut buf[at..at + to_usize(ce - cs)]
            } else {
                chunk.resize(to_usize(ce - cs), 0);
                &mut chunk[..]
            };
            decode_frame(self.inner.name(), i, frame, &stored, dst, &|| {
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
            |b, o| self.decode_at(b, o, &none),
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
        self.decode_at(buf, offset, &|s, e| self.guess_tensors(s, e))
    }

    /// Decodes the pieces on up to [`DECODE_THREADS`] named threads, each
    /// piece handed to `on_piece` (on the calling thread) as soon as it is
    /// decoded, so the caller hashes while later pieces decode.
    fn read_all<'a>(
        &self,
        dst: &'a mut [u8],
        piece: usize,
        on_piece: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
    ) -> Result<u64> {
        let len = super::source::image_len(self, dst.len())?;
        let piece = piece.max(1);
        let pieces: Vec<(usize, &'a mut [u8])> = dst[..len].chunks_mut(piece).enumerate().collect();
        let threads = std::thread::available_parallelism()
            .map_or(1, std::num::NonZero::get)
            .clamp(1, DECODE_THREADS)
            .min(pieces.len().max(1));
        let mut shares: Vec<Vec<(usize, &'a mut [u8])>> =
            (0..threads).map(|_| Vec::new()).collect();
        for (n, p) in pieces.into_iter().enumerate() {
            shares[n % threads].push(p);
        }
        let stop = std::sync::atomic::AtomicBool::new(false);
        let (tx, rx) = crossbeam_channel::unbounded::<Result<(usize, &'a [u8])>>();
        std::thread::scope(|s| -> Result<()> {
            for (w, share) in shares.into_iter().enumerate() {
                let (tx, stop) = (tx.clone(), &stop);
                std::thread::Builder::new()
                    .name(format!("acp-decode-{w}"))
                    .spawn_scoped(s, move || {
                        for (i, buf) in share {
                            if stop.load(std::sync::atomic::Ordering::Relaxed) {
                                return;
                            }
                            let got = self.read_at(buf, (i * piece) as u64);
                            let failed = got.is_err();
                            // The receiver outlives the workers (same scope).
                            let _ = tx.send(got.map(|()| (i, &*buf)));
                            if failed {
                                return;
                            }
                        }
                    })
                    .map_err(|e| Error::io("start a decoding thread for", self.name(), e))?;
            }
            drop(tx);
            let mut first_err = None;
            for got in &rx {
                match got.and_then(|(i, bytes)| on_piece(i, bytes)) {
                    Ok(()) => {}
                    Err(e) => {
                        stop.store(true, std::sync::atomic::Ordering::Relaxed);
                        first_err.get_or_insert(e);
                    }
                }
            }
            first_err.map_or(Ok(()), Err)
        })?;
        Ok(len as u64)
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
    /// describes it.
    ///
    /// # Errors
    /// For a compressed file, as [`PackedSource::new`].
    pub(crate) fn new(file: File, path: PathBuf, entry: &FileEntry) -> Result<StoredSource> {
        let raw = FileSource::new(file, path, entry.file_len());
        if entry.stored_size.is_some() {
            Ok(StoredSource::Packed(PackedSource::new(raw, entry)?))
        } else {
            Ok(StoredSource::Plain(raw))
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

    fn decodes(&self) -> bool {
        matches!(self, StoredSource::Packed(_))
    }
}

/// A length within a frame or chunk held in memory.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("frames and chunks are at most 1 GiB, checked against the index")
}
