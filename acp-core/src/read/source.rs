//! Where a data file's bytes come from: one trait, [`ChunkSource`], and
//! its implementations for an opened file, bytes already in memory, reads
//! through the [`IoEngine`], and another rank's slot.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::Digest;
use crate::io::{IoEngine, IoOpts};
use crate::staging::PeerSlot;
use crate::storage::{probe_io, Probe};

/// The bytes of one data file image, wherever they are. Nothing a source
/// hands out is trusted: [`ChunkReader`](super::ChunkReader) checks it.
pub(crate) trait ChunkSource {
    /// Fills `buf` with the bytes at `offset..offset + buf.len()`.
    ///
    /// # Errors
    /// [`Error::Io`] naming [`ChunkSource::name`], or the source's own
    /// refusal of a range past its end.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;

    /// The image's length in bytes (the index's, which the opener checked
    /// against the file's real size).
    fn len(&self) -> u64;

    /// The file the bytes are (a data file, a slot file): every error
    /// names it.
    fn name(&self) -> &Path;

    /// The bytes themselves, when the source already holds them in memory:
    /// they are then checked in place, never copied.
    fn in_memory(&self) -> Option<&[u8]> {
        None
    }

    /// Whether the bytes are decoded from stored frames (a compressed
    /// file), so that a chunk can be bad before its digest is taken: a
    /// [`Error::Corrupt`] from [`ChunkSource::read_at`] then names one
    /// bad chunk, not a failed source.
    fn decodes(&self) -> bool {
        false
    }

    /// [`ChunkSource::read_at`] of whole digest chunks, for a caller that
    /// checks each of them against `digest_of(i)` (the index's digest of
    /// chunk `i`) before it trusts a byte of it: a source may then leave
    /// out a check of its own that the caller's proves (a compressed
    /// file's stored frame whose check is that digest). `scratch` is the
    /// caller's memory for the source to reuse between calls.
    ///
    /// # Errors
    /// As [`ChunkSource::read_at`].
    fn read_for_digests(
        &self,
        buf: &mut [u8],
        offset: u64,
        digest_of: &dyn Fn(u64) -> Option<Digest>,
        scratch: &mut Vec<u8>,
    ) -> Result<()> {
        let _ = (digest_of, scratch);
        self.read_at(buf, offset)
    }

    /// The file of an earlier step that holds the chunk at `offset`, when
    /// this file references it (an incremental step): a bad chunk's error
    /// names it too.
    fn held_by(&self, _offset: u64) -> Option<&Path> {
        None
    }

    /// Fills the start of `buf` with the `len` bytes at `offset` (a
    /// multiple of 4096), one window of a streamed read: `buf` is
    /// 4096-aligned with room for `len` rounded up to 4096. A `read_at`
    /// unless the source has a better way.
    ///
    /// # Errors
    /// As [`ChunkSource::read_at`].
    fn read_window(&self, buf: &mut [u8], offset: u64, len: usize) -> Result<()> {
        let dst = buf.get_mut(..len).ok_or_else(|| {
            Error::invalid(self.name().display(), "window larger than its buffer")
        })?;
        self.read_at(dst, offset)
    }

    /// Reads the whole image into the start of `dst` (at least
    /// [`ChunkSource::len`] bytes, rounded up to 4096), handing each landed
    /// `piece`-byte part to `on_piece(i, bytes)` (part `i` starts at
    /// `i * piece`) while later parts may still be in flight, in any
    /// order. Returns the number of bytes read. `piece` is a positive
    /// multiple of 4096. Sequential `read_at`s unless the source has a
    /// better way.
    ///
    /// # Errors
    /// As [`ChunkSource::read_at`]; the error of `on_piece`, which stops
    /// the read.
    fn read_all<'a>(
        &self,
        dst: &'a mut [u8],
        piece: usize,
        on_piece: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
    ) -> Result<u64> {
        let len = image_len(self, dst.len())?;
        let mut rest: &'a mut [u8] = &mut dst[..len];
        let mut i = 0;
        while !rest.is_empty() {
            let n = piece.max(1).min(rest.len());
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
            self.read_at(head, (i * piece) as u64)?;
            on_piece(i, head)?;
            rest = tail;
            i += 1;
        }
        Ok(len as u64)
    }
}

/// An opened data file, read with `pread`.
#[derive(Debug)]
pub(crate) struct FileSource {
    file: File,
    path: PathBuf,
    len: u64,
    /// Called before each read (the engine's fault injection, which
    /// reaches its other reads through the I/O engine).
    probe: Option<Arc<dyn Probe>>,
}

impl FileSource {
    /// `file`, opened by the caller at `path`, whose index says it holds
    /// `len` bytes; each read is first shown to `probe`.
    pub(crate) fn new(
        file: File,
        path: PathBuf,
        len: u64,
        probe: Option<Arc<dyn Probe>>,
    ) -> FileSource {
        FileSource {
            file,
            path,
            len,
            probe,
        }
    }
}

impl FileSource {
    /// The same file opened again (through `/proc/self/fd`, so the very
    /// inode this handle holds, never a path that may have changed) with
    /// `O_DIRECT`, for aligned reads that skip the page cache; `None`
    /// where that is refused (tmpfs, no `/proc`).
    pub(crate) fn reopen_direct(&self) -> Option<File> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
            .ok()
    }
}

impl ChunkSource for FileSource {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        probe_io(self.probe.as_deref(), "read", &self.path, buf.len())
            .map_err(|e| Error::io("read", &self.path, e))?;
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io("read", &self.path, e))
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn name(&self) -> &Path {
        &self.path
    }
}

/// An image already in memory: a resident ring slot, or bytes copied out
/// of another rank's slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemSource<'a> {
    bytes: &'a [u8],
    path: &'a Path,
}

impl<'a> MemSource<'a> {
    /// The image `bytes`, which came from the file at `path`.
    pub(crate) fn new(bytes: &'a [u8], path: &'a Path) -> MemSource<'a> {
        MemSource { bytes, path }
    }
}

impl ChunkSource for MemSource<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let range = usize::try_from(offset)
            .ok()
            .and_then(|s| Some(s..s.checked_add(buf.len())?))
            .and_then(|r| self.bytes.get(r))
            .ok_or_else(|| {
                Error::invalid(
                    self.path.display(),
                    format!(
                        "bytes {offset}+{} of an image of {}",
                        buf.len(),
                        self.bytes.len()
                    ),
                )
            })?;
        buf.copy_from_slice(range);
        Ok(())
    }

    fn len(&self) -> u64 {
        self.bytes.len() as u64
    }

    fn name(&self) -> &Path {
        self.path
    }

    fn in_memory(&self) -> Option<&[u8]> {
        Some(self.bytes)
    }
}

/// A data file read whole through the [`IoEngine`] (io_uring or the pread
/// pool, several reads in flight), as a restore from storage reads it, from
/// the handle the storage opened (`path` only names it in messages).
#[derive(Debug)]
pub(crate) struct IoSource<'a> {
    pub(crate) io: &'a dyn IoEngine,
    pub(crate) opts: &'a IoOpts,
    pub(crate) file: &'a File,
    pub(crate) path: &'a Path,
    /// The index's length, which the caller checked against the file's.
    pub(crate) len: u64,
}

impl ChunkSource for IoSource<'_> {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| Error::io("read", self.path, e))
    }

    fn len(&self) -> u64 {
        self.len
    }

    fn name(&self) -> &Path {
        self.path
    }

    fn read_window(&self, buf: &mut [u8], offset: u64, len: usize) -> Result<()> {
        self.io
            .read_range(self.file, self.path, offset, len, buf, self.opts)
    }

    fn read_all<'a>(
        &self,
        dst: &'a mut [u8],
        piece: usize,
        on_piece: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
    ) -> Result<u64> {
        let opts = IoOpts {
            chunk_bytes: piece,
            ..self.opts.clone()
        };
        self.io
            .read_from(self.file, self.path, dst, &opts, on_piece)
    }
}

/// Another rank's slot on this node, read (never mapped): the bytes are
/// that image's only if [`PeerSlot::unchanged`] holds after the reads.
impl ChunkSource for PeerSlot {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        PeerSlot::read_at(self, offset, buf)
    }

    fn len(&self) -> u64 {
        self.image_len()
    }

    fn name(&self) -> &Path {
        self.path()
    }
}

/// `source`'s image length, checked to fit a buffer of `buf` bytes (what
/// every [`ChunkSource::read_all`] checks first).
pub(super) fn image_len<S: ChunkSource + ?Sized>(source: &S, buf: usize) -> Result<usize> {
    usize::try_from(source.len())
        .ok()
        .filter(|&l| l <= buf)
        .ok_or_else(|| Error::invalid(source.name().display(), "image larger than its buffer"))
}
