//! Verified reading of a committed data file: every byte handed out was
//! checked against the chunk digests the step's index records.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use super::Progress;
use crate::error::{Error, Result};
use crate::format::{
    parse_header, unhex, validate_file_name, Digest, FileEntry, ParsedHeader, INDEX_FILE_NAME,
};
use crate::storage::Storage;

/// One data file of a committed step, opened for verified reads.
#[derive(Debug)]
pub(crate) struct DataFile {
    pub(crate) path: PathBuf,
    pub(crate) entry: FileEntry,
    file: File,
    digests: Vec<Option<Digest>>,
    chunk: u64,
    /// The header, once read from verified chunks.
    header: Option<ParsedHeader>,
    /// The header parsed from chunks that failed their digest: used only to
    /// name the tensors a changed chunk holds.
    guess: Option<ParsedHeader>,
    /// The last verified chunk (index, bytes), for ranged reads.
    cache: Option<(u64, Vec<u8>)>,
}

/// A changed chunk: the tensors it covers and why it is bad.
#[derive(Debug, Clone)]
pub(crate) struct BadChunk {
    pub(crate) tensors: Vec<String>,
    pub(crate) reason: String,
}

impl DataFile {
    /// Opens file `name` of committed `step` as the index describes it.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for a bad name, a missing or non-regular file
    /// (never waited on: see [`Storage::open_listed`]) or one whose
    /// size differs from the index; [`Error::Io`].
    pub(crate) fn open(
        root: &dyn Storage,
        step: u64,
        name: &str,
        entry: &FileEntry,
    ) -> Result<DataFile> {
        validate_file_name(&root.describe(step, INDEX_FILE_NAME), name)?;
        let (file, path) = root.open_listed(step, name, entry.size)?.into_parts();
        Ok(DataFile {
            path,
            entry: entry.clone(),
            file,
            digests: entry.chunks.iter().map(|c| unhex(c)).collect(),
            chunk: entry.chunk_bytes.max(1),
            header: None,
            guess: None,
            cache: None,
        })
    }

    /// The number of digest chunks.
    pub(crate) fn chunks(&self) -> u64 {
        self.digests.len() as u64
    }

    fn chunk_span(&self, i: u64) -> (u64, u64) {
        let start = i * self.chunk;
        (start, (start + self.chunk).min(self.entry.size))
    }

    /// Reads chunk `i` into `buf` and checks it. `Ok(false)` when its digest
    /// does not match.
    fn read_chunk(&self, i: u64, buf: &mut Vec<u8>) -> Result<bool> {
        let (start, end) = self.chunk_span(i);
        let len = usize::try_from(end - start)
            .map_err(|_| Error::invalid(self.path.display(), "chunk larger than memory"))?;
        buf.resize(len, 0);
        self.file
            .read_exact_at(buf, start)
            .map_err(|e| Error::io("read", &self.path, e))?;
        let got = *blake3::hash(buf).as_bytes();
        Ok(self
            .digests
            .get(usize::try_from(i).unwrap_or(usize::MAX))
            .copied()
            .flatten()
            == Some(got))
    }

    /// The tensors whose bytes overlap `[start, end)`; empty when the
    /// header is unknown or the range holds only header bytes.
    fn tensors_in(&self, start: u64, end: u64) -> Vec<String> {
        self.header
            .as_ref()
            .or(self.guess.as_ref())
            .map_or_else(Vec::new, |h| {
                h.entries
                    .iter()
                    .filter(|e| e.offset < end && e.offset + e.len.max(1) > start)
                    .map(|e| e.name.clone())
                    .collect()
            })
    }

    /// Whether `[start, end)` holds header bytes.
    fn holds_header(&self, start: u64) -> bool {
        self.header
            .as_ref()
            .or(self.guess.as_ref())
            .is_none_or(|h| start < h.data_start)
    }

    /// Why chunk `i` is bad, for people: its byte range and whether the
    /// header is in it.
    pub(crate) fn mismatch_reason(&self, start: u64, end: u64) -> String {
        let tensors = self.tensors_in(start, end);
        match (self.holds_header(start), tensors.is_empty()) {
            (true, true) => format!("digest mismatch in bytes {start}..{end} (header)"),
            (true, false) => {
                format!("digest mismatch in bytes {start}..{end} (header and tensor data)")
            }
            _ => format!("digest mismatch in bytes {start}..{end}"),
        }
    }

    fn mismatch(&self, i: u64) -> Error {
        let (start, end) = self.chunk_span(i);
        let tensors = self.tensors_in(start, end);
        let reason = self.mismatch_reason(start, end);
        if tensors.is_empty() {
            Error::corrupt(&self.path, None, reason)
        } else {
            // A chunk digest cannot tell which of its tensors changed: name
            // every one it holds.
            Error::corrupt(&self.path, Some(&tensors.join("`, `")), reason)
        }
    }

    /// Reads and parses the header from verified chunks.
    ///
    /// # Errors
    /// [`Error::Corrupt`] when a chunk under the header differs from its
    /// digest or the header is malformed.
    pub(crate) fn header(&mut self) -> Result<&ParsedHeader> {
        if self.header.is_none() {
            let mut bytes = Vec::new();
            let mut buf = Vec::new();
            let mut bad = None;
            let mut i = 0;
            let mut need = 8u64;
            while (bytes.len() as u64) < need.min(self.entry.size) && i < self.chunks() {
                if !self.read_chunk(i, &mut buf)? && bad.is_none() {
                    bad = Some(i);
                }
                bytes.extend_from_slice(&buf);
                if let Some(n) = bytes.first_chunk::<8>() {
                    need = u64::from_le_bytes(*n).saturating_add(8);
                }
                i += 1;
            }
            if let Some(i) = bad {
                self.guess = parse_header(&self.path, &bytes, self.entry.size).ok();
                return Err(self.mismatch(i));
            }
            let h = parse_header(&self.path, &bytes, self.entry.size)?;
            self.header = Some(h);
        }
        Ok(self
            .header
            .as_ref()
            .expect("the header was parsed just above"))
    }

    /// Reads the whole file in order, checking every chunk, and hands each
    /// verified chunk to `sink` with its offset. Stops at the first chunk
    /// that differs (an error naming the file and tensor).
    ///
    /// # Errors
    /// [`Error::Corrupt`]; [`Error::Io`]; what `sink` returns.
    pub(crate) fn stream(
        &mut self,
        progress: &dyn Progress,
        mut sink: impl FnMut(u64, &[u8]) -> Result<()>,
    ) -> Result<()> {
        self.header()?;
        let mut buf = Vec::new();
        for i in 0..self.chunks() {
            if !self.read_chunk(i, &mut buf)? {
                return Err(self.mismatch(i));
            }
            sink(i * self.chunk, &buf)?;
            progress.advance(buf.len() as u64);
        }
        Ok(())
    }

    /// Checks every chunk; returns the ones that differ (with the tensors
    /// they cover), all of them, not just the first.
    ///
    /// # Errors
    /// [`Error::Io`] reading.
    pub(crate) fn check_all(&mut self, progress: &dyn Progress) -> Result<Vec<BadChunk>> {
        // The header names the tensors of a bad chunk; a bad header chunk is
        // itself reported below.
        let _ = self.header();
        let mut bad = Vec::new();
        let mut buf = Vec::new();
        for i in 0..self.chunks() {
            if !self.read_chunk(i, &mut buf)? {
                let (start, end) = self.chunk_span(i);
                bad.push(BadChunk {
                    tensors: self.tensors_in(start, end),
                    reason: self.mismatch_reason(start, end),
                });
            }
            progress.advance(buf.len() as u64);
        }
        Ok(bad)
    }

    /// The verified bytes `[offset, offset + len)`.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming the tensor when a chunk under the range
    /// differs; [`Error::Io`].
    pub(crate) fn read_range(&mut self, offset: u64, len: u64) -> Result<Vec<u8>> {
        let end = offset
            .checked_add(len)
            .filter(|e| *e <= self.entry.size)
            .ok_or_else(|| {
                Error::corrupt(
                    &self.path,
                    None,
                    format!("range {offset}+{len} past the end"),
                )
            })?;
        let cap = usize::try_from(len)
            .map_err(|_| Error::invalid(self.path.display(), "tensor larger than memory"))?;
        let mut out = Vec::with_capacity(cap);
        if len == 0 {
            return Ok(out);
        }
        let first = offset / self.chunk;
        let last = (end - 1) / self.chunk;
        for i in first..=last {
            let bytes = match self.cache.take() {
                Some((c, b)) if c == i => b,
                _ => {
                    let mut b = Vec::new();
                    if !self.read_chunk(i, &mut b)? {
                        return Err(self.mismatch(i));
                    }
                    b
                }
            };
            let (cs, ce) = self.chunk_span(i);
            let from = offset.max(cs) - cs;
            let to = end.min(ce) - cs;
            out.extend_from_slice(&bytes[to_usize(from)..to_usize(to)]);
            self.cache = Some((i, bytes));
        }
        Ok(out)
    }
}

/// A chunk-relative offset as an index; chunks are in memory.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("offsets inside a chunk held in memory fit a usize")
}
