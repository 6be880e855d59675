//! The one verified reader of committed data files: every byte of a
//! checkpoint that reaches a caller (a load from storage or from a slot,
//! another rank's tensors, `verify`, `export`, `diff`, `inspect`) goes
//! through a [`ChunkReader`].
//!
//! # What it guarantees
//!
//! A data file is checked in the chunks its index entry ([`FileEntry`])
//! records: piece `i` is bytes [`chunk_span`]`(i)` of the file and its
//! digest is [`digest`] (blake3) of exactly those bytes, the same function
//! the flush used to write the index. A reader hands out a chunk's bytes,
//! or anything computed from them (the parsed header, a tensor's range, a
//! whole image marked valid), only after that chunk's digest equalled the
//! index's. The header is parsed from verified chunks only. Whole-image
//! reads ([`ChunkReader::read_verified`], [`ChunkReader::verify_in_place`])
//! return the digests only once every chunk matched; on any error the
//! caller must drop the destination unread, and nothing in it was marked
//! valid.
//!
//! # Where bytes come from
//!
//! A [`ChunkSource`] supplies untrusted bytes: an opened data file read
//! with `pread` ([`FileSource`]), an image already in memory such as a
//! resident ring slot ([`MemSource`], checked in place with no copy), a
//! file read whole through the `IoEngine` with several reads in flight
//! ([`IoSource`]), or another rank's slot ([`PeerSlot`](crate::staging::PeerSlot),
//! whose caller also checks that the slot was not reused during the reads).
//! Sources are handed in already opened; the reader never opens a path
//! (the `IoEngine` opens the file it reads whole, as it always has).
//!
//! In the crate's layers this module sits between `engine` (and `ops`),
//! which use it, and `io`, `staging` and `format`, which it uses. The
//! format pieces it builds on are shared with the writer: [`digest`],
//! [`chunk_span`], and the header's length prefix ([`header_end`],
//! [`read_header`] for headers read without digests).
//!
//! # Parallelism
//!
//! A whole image is hashed on several threads: in place by contiguous runs
//! of chunks, or, while it is read, by a pool fed each read as soon as it
//! lands, so a restore takes about `max(read, hash)` rather than their sum.
//! Reads are cut along the digest chunks so each can be checked on its own.
//! A compressed file's frames are read, checked and decoded on the same
//! pool, each read by one thread from its frames to its targets.
//!
//! # The RAM tier's quick check
//!
//! A resident slot already proved against the index's digests may be
//! checked again with a per-chunk xxh3 sum recorded beside them in the
//! slot's control block ([`sums_match`]; what it proves, and why it may
//! live in shared memory, is in `fast.rs`); a sum that
//! differs sends the caller back to the blake3 check, never to an error.
//!
//! # Errors
//!
//! A chunk whose digest differs is [`Error::Corrupt`] naming the file, the
//! chunk's byte range, and the tensors with bytes in it (the first as the
//! error's tensor, all of them in the reason when several share the
//! chunk), or "(header)" when it holds only header bytes. The tensors are
//! named from the verified header when there is one, else from a
//! best-effort parse of the unverified header, used for naming only. A
//! length or chunk count that is not the index's, and a chunk size past
//! acp's limits, are [`Error::Corrupt`] too; read failures are the
//! source's [`Error::Io`].

mod fast;
mod packed;
mod source;
mod whole;

use std::path::Path;

pub(crate) use fast::{
    check_and_copy, chunk_sums, fast_sum, first_differing, read_and_sum, read_check_copy,
    sum_then_digest, sums_match, ChunkCopy, ChunkDst,
};
pub(crate) use packed::StoredSource;
pub(crate) use source::{ChunkSource, IoSource, MemSource};
pub(crate) use whole::Target;

use crate::error::{Error, Result};
use crate::format::{
    chunk_span, digest, header_end, parse_header, read_header, unhex, Digest, FileEntry,
    ParsedHeader, MAX_HEADER_BYTES, PREFIX_BYTES,
};

/// The largest digest chunk a reader accepts: a chunk is held in memory
/// whole, and acp never writes one larger (an I/O chunk is at most 1 GiB).
const MAX_CHUNK_BYTES: u64 = 1 << 30;

/// At most this much unverified header is read to name the tensors of a
/// bad chunk: it is an error path.
const GUESS_HEADER_BYTES: u64 = 1 << 20;

/// One data file, read and checked chunk by chunk against its index entry.
#[derive(Debug)]
pub(crate) struct ChunkReader<S> {
    src: S,
    entry: FileEntry,
    digests: Vec<Option<Digest>>,
    chunk: u64,
    /// The header, once read from verified chunks.
    header: Option<ParsedHeader>,
    /// A header parsed from unverified bytes: used only to name the
    /// tensors a changed chunk holds.
    guess: Option<ParsedHeader>,
    /// The last verified chunk (index, bytes), for ranged reads.
    cache: Option<(u64, Vec<u8>)>,
    /// Called each time a landed read of a whole-image read has been
    /// checked ([`ChunkReader::on_checked`]).
    on_checked: Option<OnChecked>,
    /// Set when `on_checked` asked the read to stop.
    stopped: std::sync::atomic::AtomicBool,
}

/// What a whole-image read calls after each landed read it checked, on
/// the checking thread: a caller's sign of progress (a background read's
/// watchdog note). It returns whether the read goes on: `false` stops it
/// (no further read is started or checked) and the read fails with the
/// error of [`ChunkReader::stopped_error`].
#[derive(Clone)]
pub(crate) struct OnChecked(pub(crate) std::sync::Arc<dyn Fn() -> bool + Send + Sync>);

impl std::fmt::Debug for OnChecked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnChecked")
    }
}

/// A chunk whose digest differs: where it is and what it holds.
#[derive(Debug, Clone)]
pub(crate) struct Mismatch {
    /// Its byte range in the file.
    pub(crate) start: u64,
    /// Its end, exclusive.
    pub(crate) end: u64,
    /// Whether it holds header bytes (also when the header is unknown).
    pub(crate) header: bool,
    /// The tensors with bytes in it: a chunk digest cannot tell which of
    /// them changed, so every one is suspect.
    pub(crate) tensors: Vec<String>,
    /// Why its compressed frame did not decode, when it is one's (the
    /// chunk then has no bytes to digest).
    pub(crate) frame: Option<String>,
    /// The file of an earlier step the chunk's bytes were read from, when
    /// this file references the chunk.
    pub(crate) held_by: Option<std::path::PathBuf>,
}

impl Mismatch {
    /// Why the chunk is bad, for people; the tensors are listed apart.
    pub(crate) fn reason(&self) -> String {
        let mut reason = self.own_reason();
        if let Some(held) = &self.held_by {
            reason = format!(
                "{reason} (the chunk is referenced: its bytes are read from {})",
                held.display()
            );
        }
        reason
    }

    fn own_reason(&self) -> String {
        let (start, end) = (self.start, self.end);
        if let Some(why) = &self.frame {
            return format!("bytes {start}..{end}: {why}");
        }
        match (self.header, self.tensors.is_empty()) {
            (true, true) => format!("digest mismatch in bytes {start}..{end} (header)"),
            (true, false) => {
                format!("digest mismatch in bytes {start}..{end} (header and tensor data)")
            }
            _ => format!("digest mismatch in bytes {start}..{end}"),
        }
    }

    /// The error for the chunk of the file at `path`: names its first
    /// tensor, and all of them when several share it.
    pub(crate) fn into_error(self, path: &Path) -> Error {
        let mut reason = self.reason();
        if self.tensors.len() > 1 {
            reason = format!(
                "{reason}, which hold parts of {} tensors: `{}`",
                self.tensors.len(),
                self.tensors.join("`, `")
            );
        }
        Error::corrupt(path, self.tensors.first().map(String::as_str), reason)
    }
}

impl<S: ChunkSource> ChunkReader<S> {
    /// A reader of `src`, checked against `entry` (the index's record of
    /// the file `src` holds).
    ///
    /// # Errors
    /// [`Error::Corrupt`] for a chunk size of 0 or past 1 GiB.
    pub(crate) fn new(src: S, entry: &FileEntry) -> Result<ChunkReader<S>> {
        if entry.chunk_bytes == 0 || entry.chunk_bytes > MAX_CHUNK_BYTES {
            return Err(Error::corrupt(
                src.name(),
                None,
                format!(
                    "chunks of {} bytes are past acp's limits",
                    entry.chunk_bytes
                ),
            ));
        }
        Ok(ChunkReader {
            src,
            digests: entry.chunks.iter().map(|c| unhex(c)).collect(),
            chunk: entry.chunk_bytes,
            entry: entry.clone(),
            header: None,
            guess: None,
            cache: None,
            on_checked: None,
            stopped: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Has the whole-image reads ([`ChunkReader::read_verified_into`] and
    /// its kin) call `f` after each landed read they checked.
    pub(crate) fn on_checked(&mut self, f: OnChecked) {
        self.on_checked = Some(f);
    }

    /// Whether `on_checked` asked the read to stop.
    pub(crate) fn stop_asked(&self) -> bool {
        self.stopped.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The error of a read its `on_checked` stopped.
    pub(crate) fn stopped_error(&self) -> Error {
        Error::io(
            "read",
            self.src.name(),
            std::io::Error::new(std::io::ErrorKind::Interrupted, "stopped by its caller"),
        )
    }

    /// The file the bytes come from.
    pub(crate) fn path(&self) -> &Path {
        self.src.name()
    }

    /// The index's record of the file.
    pub(crate) fn entry(&self) -> &FileEntry {
        &self.entry
    }

    /// The source.
    pub(crate) fn source(&self) -> &S {
        &self.src
    }

    /// The number of digest chunks the index records.
    pub(crate) fn chunks(&self) -> u64 {
        self.digests.len() as u64
    }

    /// The byte range of chunk `i`.
    pub(crate) fn span(&self, i: u64) -> (u64, u64) {
        chunk_span(i, self.chunk, self.entry.size)
    }

    /// Whether `got` is the index's digest of chunk `i`.
    fn matches(&self, i: u64, got: &Digest) -> bool {
        usize::try_from(i)
            .ok()
            .and_then(|i| self.digests.get(i))
            .copied()
            .flatten()
            .as_ref()
            == Some(got)
    }

    /// Reads chunk `i` into `dst` (exactly its length) and checks it.
    /// `Ok(false)` when its digest differs.
    fn fetch(&self, i: u64, dst: &mut [u8]) -> Result<bool> {
        let (start, _) = self.span(i);
        self.src.read_at(dst, start)?;
        Ok(self.matches(i, &digest(dst)))
    }

    /// The tensors with bytes in `[start, end)`, per the verified header
    /// or else the guessed one; and whether the range holds header bytes
    /// (also when neither is known).
    fn describe(&self, start: u64, end: u64) -> Mismatch {
        let h = self.header.as_ref().or(self.guess.as_ref());
        Mismatch {
            start,
            end,
            header: h.is_none_or(|h| start < h.data_start),
            tensors: h.map_or_else(Vec::new, |h| {
                h.entries
                    .iter()
                    .filter(|e| e.len > 0 && e.offset < end && e.offset + e.len > start)
                    .map(|e| e.name.clone())
                    .collect()
            }),
            frame: None,
            held_by: self.src.held_by(start).map(Path::to_path_buf),
        }
    }

    /// What chunk `i` holds, for its mismatch: when no header is known, one
    /// is first parsed from the image (in memory) or the first
    /// [`GUESS_HEADER_BYTES`] of the source, unverified, for naming only.
    fn mismatch(&mut self, i: u64) -> Mismatch {
        if self.header.is_none() && self.guess.is_none() {
            let (path, len) = (self.src.name(), self.entry.size);
            self.guess = match self.src.in_memory() {
                Some(image) => parse_header(path, image, len).ok(),
                None => {
                    read_header(path, len, GUESS_HEADER_BYTES, |b, o| self.src.read_at(b, o)).ok()
                }
            };
        }
        let (start, end) = self.span(i);
        self.describe(start, end)
    }

    /// The error for chunk `i` differing from its digest. Of a source that
    /// decodes, the chunk is first read again with every frame check (a
    /// stored frame may have been read unchecked, its digest standing for
    /// its check): when it is the frame that changed, its error says so.
    fn mismatch_error(&mut self, i: u64) -> Error {
        if self.src.decodes() {
            let (start, end) = self.span(i);
            let mut buf = vec![0; to_usize(end - start)];
            if let Err(e @ Error::Corrupt { .. }) = self.src.read_at(&mut buf, start) {
                return e;
            }
        }
        let m = self.mismatch(i);
        m.into_error(self.src.name())
    }

    /// Reads chunk `i` into `dst` (its full length: [`ChunkReader::span`])
    /// and checks it.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming the file and the chunk's tensors when its
    /// digest differs; the source's errors.
    pub(crate) fn read_chunk_into(&mut self, i: u64, dst: &mut [u8]) -> Result<()> {
        if self.fetch(i, dst)? {
            Ok(())
        } else {
            Err(self.mismatch_error(i))
        }
    }

    /// Reads the chunks under the header into `buf` (each at its file
    /// offset), checks them, and parses the header. Returns it and the
    /// number of chunks read (`0..n`). All of the header's chunks are read
    /// even past a bad one, so that the tensors it holds can be named.
    fn load_header(&mut self, buf: &mut dyn HeadBuf) -> Result<(ParsedHeader, u64)> {
        let size = self.entry.size;
        let mut need = PREFIX_BYTES.min(size);
        let mut bad = None;
        let mut i = 0;
        while i < self.chunks() && self.span(i).0 < need {
            let (start, end) = self.span(i);
            let dst = buf.span_mut(to_usize(start), to_usize(end), self.src.name())?;
            if !self.fetch(i, dst)? && bad.is_none() {
                bad = Some(i);
            }
            if let Some(p) = buf.filled().first_chunk::<8>() {
                need = header_end(*p).min(size);
            }
            i += 1;
            if need > MAX_HEADER_BYTES + PREFIX_BYTES {
                // Past the limit: the parse below says so from the prefix.
                break;
            }
        }
        let bytes = buf.filled();
        if let Some(b) = bad {
            self.guess = parse_header(self.src.name(), bytes, size).ok();
            return Err(self.mismatch_error(b));
        }
        Ok((parse_header(self.src.name(), bytes, size)?, i))
    }

    /// The header, read and parsed from verified chunks (once).
    ///
    /// # Errors
    /// [`Error::Corrupt`] when a chunk under the header differs from its
    /// digest or the header is malformed; the source's errors.
    pub(crate) fn header(&mut self) -> Result<&ParsedHeader> {
        if self.header.is_none() {
            let (h, _) = self.load_header(&mut Vec::new())?;
            self.header = Some(h);
        }
        Ok(self
            .header
            .as_ref()
            .expect("the header was parsed just above"))
    }

    /// Reads the chunks under the header into `image` (memory of the whole
    /// image, each chunk at its file offset), checks them and parses the
    /// header. Returns a copy of the header and the number of chunks read
    /// (`0..n`), so that the caller need not read them again.
    ///
    /// # Errors
    /// As [`ChunkReader::header`].
    pub(crate) fn header_into(&mut self, image: &mut [u8]) -> Result<(ParsedHeader, u64)> {
        let (h, n) = self.load_header(&mut Image { buf: image, end: 0 })?;
        self.header = Some(h.clone());
        Ok((h, n))
    }

    /// Reads the whole file in order, checking every chunk, and hands each
    /// verified chunk to `sink` with its offset. Stops at the first chunk
    /// that differs (an error naming the file and tensor).
    ///
    /// # Errors
    /// [`Error::Corrupt`]; the source's errors; what `sink` returns.
    pub(crate) fn stream(&mut self, mut sink: impl FnMut(u64, &[u8]) -> Result<()>) -> Result<()> {
        self.header()?;
        let mut buf = Vec::new();
        for i in 0..self.chunks() {
            let (start, end) = self.span(i);
            buf.resize(to_usize(end - start), 0);
            self.read_chunk_into(i, &mut buf)?;
            sink(start, &buf)?;
        }
        Ok(())
    }

    /// Checks every chunk and returns the ones that differ (with the
    /// tensors they hold), all of them, not just the first. `on_chunk` is
    /// told each chunk's length once it is checked.
    ///
    /// # Errors
    /// The source's errors.
    pub(crate) fn check_all(&mut self, on_chunk: &mut dyn FnMut(u64)) -> Result<Vec<Mismatch>> {
        // The header names the tensors of a bad chunk; a bad header chunk
        // is itself reported below.
        let _ = self.header();
        let mut bad = Vec::new();
        let mut buf = Vec::new();
        for i in 0..self.chunks() {
            let (start, end) = self.span(i);
            buf.resize(to_usize(end - start), 0);
            match self.fetch(i, &mut buf) {
                Ok(true) => {}
                Ok(false) => bad.push(self.describe(start, end)),
                // A compressed frame that fails its check or does not
                // decode: this chunk is bad, the others are still checked.
                Err(Error::Corrupt { reason, .. }) if self.src.decodes() => bad.push(Mismatch {
                    frame: Some(reason),
                    ..self.describe(start, end)
                }),
                Err(e) => return Err(e),
            }
            on_chunk(end - start);
        }
        Ok(bad)
    }

    /// The verified bytes `[offset, offset + len)`.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming the tensor when a chunk under the range
    /// differs, or for a range past the end; the source's errors.
    pub(crate) fn read_range(&mut self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let path = self.src.name();
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= self.entry.size)
            .ok_or_else(|| {
                Error::corrupt(path, None, format!("range {offset}+{len} past the end"))
            })?;
        let cap = usize::try_from(len)
            .map_err(|_| Error::invalid(path.display(), "tensor larger than memory"))?;
        let mut out = Vec::with_capacity(cap);
        if len == 0 {
            return Ok(out);
        }
        for i in offset / self.chunk..=(end - 1) / self.chunk {
            let (cs, ce) = self.span(i);
            let bytes = match self.cache.take() {
                Some((c, b)) if c == i => b,
                _ => {
                    let mut b = vec![0; to_usize(ce - cs)];
                    self.read_chunk_into(i, &mut b)?;
                    b
                }
            };
            let from = offset.max(cs) - cs;
            let to = end.min(ce) - cs;
            out.extend_from_slice(&bytes[to_usize(from)..to_usize(to)]);
            self.cache = Some((i, bytes));
        }
        Ok(out)
    }
}

/// Where the header's chunks land while it is read.
trait HeadBuf {
    /// Memory for file bytes `start..end`.
    fn span_mut(&mut self, start: usize, end: usize, path: &Path) -> Result<&mut [u8]>;
    /// The bytes read so far, from the start of the file.
    fn filled(&self) -> &[u8];
}

/// Growing private memory: only the header's chunks.
impl HeadBuf for Vec<u8> {
    fn span_mut(&mut self, start: usize, end: usize, _: &Path) -> Result<&mut [u8]> {
        if self.len() < end {
            self.resize(end, 0);
        }
        Ok(&mut self[start..end])
    }

    fn filled(&self) -> &[u8] {
        self
    }
}

/// Memory of the whole image, filled from the start.
struct Image<'a> {
    buf: &'a mut [u8],
    end: usize,
}

impl HeadBuf for Image<'_> {
    fn span_mut(&mut self, start: usize, end: usize, path: &Path) -> Result<&mut [u8]> {
        self.end = self.end.max(end);
        self.buf
            .get_mut(start..end)
            .ok_or_else(|| Error::invalid(path.display(), "image larger than its buffer"))
    }

    fn filled(&self) -> &[u8] {
        &self.buf[..self.end]
    }
}

/// An offset or length within a chunk or an image held in memory.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("offsets inside memory already allocated fit a usize")
}

/// Private zeroed memory of `len` bytes (padded to a page) for an image
/// that is written whole right away (received, read or copied into), its
/// pages taken before that write: huge pages where the kernel allows them
/// (`MADV_HUGEPAGE`), then populated in one call (`MADV_POPULATE_WRITE`;
/// on a kernel without it, one write per page). Populating 256 MiB took
/// 43 ms in 2 MiB pages against 180 ms in 4 KiB pages (`MAP_POPULATE`) on
/// this project's 2-core VM: a restore pays it before its first byte.
///
/// # Errors
/// [`Error::Io`] naming `what` when the memory cannot be mapped.
pub(crate) fn image_memory(len: usize, what: &Path) -> Result<memmap2::MmapMut> {
    let padded = len.div_ceil(4096).max(1) * 4096;
    let mut map = memmap2::MmapMut::map_anon(padded).map_err(|e| Error::io("allocate", what, e))?;
    // Advice only: without huge pages (disabled, or a small mapping) the
    // memory is the same, in 4 KiB pages.
    let _ = map.advise(memmap2::Advice::HugePage);
    if map.advise(memmap2::Advice::PopulateWrite).is_err() {
        for page in map.chunks_mut(4096) {
            page[0] = 0;
        }
    }
    Ok(map)
}
