//! What both engines share: argument checks, opening files under the
//! `O_DIRECT` policy, the chunk geometry, and the write and read skeletons
//! around each engine's chunk loop.

use std::fs::File;
use std::path::Path;

use crate::config::DirectIo;
use crate::error::{Error, Result};
use crate::io::{IoKind, IoOpts, IoStats};
use crate::storage::probe_op;

use super::sys;

/// The alignment `O_DIRECT` needs of buffers, offsets and lengths.
pub(super) const ALIGN: usize = 4096;

/// The largest chunk: one SQE length is a `u32`.
const MAX_CHUNK: usize = 1 << 30;

/// `n` rounded up to [`ALIGN`], or `None` on overflow.
pub(super) fn round_up(n: usize) -> Option<usize> {
    n.checked_next_multiple_of(ALIGN)
}

/// One chunk of a file: where it starts and how many bytes move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Span {
    /// The chunk's index in the file.
    pub(super) index: usize,
    /// Offset in the buffer, and in the file past [`Span::base`].
    pub(super) start: usize,
    /// The file offset of the buffer's first byte (0 for a whole file).
    pub(super) base: u64,
    /// Bytes of file data in the chunk.
    pub(super) data: usize,
    /// Bytes transferred: `data`, or `data` rounded up to [`ALIGN`] when
    /// padded.
    pub(super) io: usize,
}

impl Span {
    /// The file offset.
    pub(super) fn offset(&self) -> u64 {
        self.base + self.start as u64
    }
}

/// How a file of `len` bytes splits into chunks.
#[derive(Debug, Clone, Copy)]
pub(super) struct Geometry {
    len: usize,
    chunk: usize,
    pad: bool,
    base: u64,
}

impl Geometry {
    /// `len` bytes in chunks of `chunk` (a positive multiple of [`ALIGN`]);
    /// with `pad`, the last transfer is rounded up to [`ALIGN`] (the buffer
    /// must hold that many bytes).
    pub(super) fn new(len: usize, chunk: usize, pad: bool) -> Self {
        Geometry {
            len,
            chunk,
            pad,
            base: 0,
        }
    }

    /// The same chunks of a buffer that holds the file's bytes from
    /// offset `base` on.
    pub(super) fn at(self, base: u64) -> Self {
        Geometry { base, ..self }
    }

    /// The number of chunks; 0 for an empty file.
    pub(super) fn count(&self) -> usize {
        self.len.div_ceil(self.chunk)
    }

    /// Chunk `i` (below [`count`](Self::count)).
    pub(super) fn span(&self, i: usize) -> Span {
        let start = i * self.chunk;
        let data = self.chunk.min(self.len - start);
        // `start + io` never passes round_up(len), checked by the caller.
        let io = if self.pad {
            data.next_multiple_of(ALIGN)
        } else {
            data
        };
        Span {
            index: i,
            start,
            base: self.base,
            data,
            io,
        }
    }
}

/// Removes a file on drop unless disarmed: no partial file survives an
/// error (or an unwinding `on_chunk`).
pub(super) struct RemoveOnDrop<'a> {
    pub(super) path: Option<&'a Path>,
}

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(path) = self.path {
            if let Err(e) = std::fs::remove_file(path) {
                tracing::warn!(path = %path.display(), error = %e, "cannot remove partial file");
            }
        }
    }
}

/// Rejects a chunk size or queue depth the engines cannot use.
fn check_opts(opts: &IoOpts) -> Result<()> {
    if opts.chunk_bytes == 0 || opts.chunk_bytes % ALIGN != 0 || opts.chunk_bytes > MAX_CHUNK {
        return Err(Error::invalid(
            "chunk_bytes",
            format!(
                "{} is not a positive multiple of 4096 up to 1 GiB",
                opts.chunk_bytes
            ),
        ));
    }
    if opts.queue_depth == 0 {
        return Err(Error::invalid("queue_depth", "must be at least 1"));
    }
    Ok(())
}

/// Whether to ask for `O_DIRECT`, given the policy and whether the buffer
/// allows it (aligned, and long enough for the padded tail).
fn want_direct(policy: DirectIo, buf_ok: bool, op: &str, path: &Path) -> Result<bool> {
    match policy {
        DirectIo::Off => Ok(false),
        DirectIo::Auto => Ok(buf_ok),
        DirectIo::On if buf_ok => Ok(true),
        DirectIo::On => Err(Error::invalid(
            format!("{op} {}", path.display()),
            "O_DIRECT needs a 4096-aligned buffer that holds the length rounded up to 4096",
        )),
    }
}

/// Sets `O_DIRECT` on a fresh descriptor when wanted (with `Auto`, a
/// refusal means buffered I/O: `F_SETFL` leaves the descriptor as it was).
/// Returns whether `O_DIRECT` is on.
pub(super) fn apply_flags(file: &File, policy: DirectIo, want: bool, path: &Path) -> Result<bool> {
    if !want {
        return Ok(false);
    }
    match sys::set_direct(file) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) && policy == DirectIo::Auto => {
            tracing::debug!(path = %path.display(), "file system refuses O_DIRECT; buffered I/O");
            Ok(false)
        }
        Err(e) => Err(Error::io("open O_DIRECT", path, e)),
    }
}

/// Whether `p` is [`ALIGN`]-aligned.
fn aligned(p: *const u8) -> bool {
    (p as usize) % ALIGN == 0
}

/// What a write of `len` bytes of `src` moves, once its arguments are
/// checked.
pub(super) struct WritePlan {
    /// Bytes of file data.
    n: usize,
    /// `n` rounded up to [`ALIGN`].
    padded: usize,
    /// Whether to ask for `O_DIRECT`.
    want: bool,
}

/// Checks a write's arguments (options, `len` within `src`, `O_DIRECT`
/// policy) before anything is created or written.
pub(super) fn plan_write(path: &Path, src: &[u8], len: u64, opts: &IoOpts) -> Result<WritePlan> {
    check_opts(opts)?;
    let what = || format!("write {}", path.display());
    let n = usize::try_from(len)
        .ok()
        .filter(|&n| n <= src.len())
        .ok_or_else(|| {
            Error::invalid(
                what(),
                format!("length {len} exceeds the {} byte source", src.len()),
            )
        })?;
    let padded = round_up(n).ok_or_else(|| Error::invalid(what(), "length overflows"))?;
    let buf_ok = padded <= src.len() && aligned(src.as_ptr());
    let want = want_direct(opts.direct, buf_ok, "write", path)?;
    Ok(WritePlan { n, padded, want })
}

/// The write skeleton over a fresh, empty `file` (named `path` in
/// messages): checks, `O_DIRECT` policy, `fallocate`, then
/// `chunks(file, geometry, on_chunk)` writes the chunks, then the tail
/// truncate and the fsync.
#[expect(
    clippy::too_many_arguments,
    reason = "IoEngine::write_to's arguments, plus the engine's kind and chunk loop"
)]
pub(super) fn write_file<F>(
    kind: IoKind,
    file: &File,
    path: &Path,
    src: &[u8],
    len: u64,
    opts: &IoOpts,
    on_chunk: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    chunks: F,
) -> Result<IoStats>
where
    F: FnOnce(&File, Geometry, &mut dyn FnMut(usize, &[u8]) -> Result<()>) -> Result<()>,
{
    let WritePlan { n, padded, want } = plan_write(path, src, len, opts)?;

    let direct = apply_flags(file, opts.direct, want, path)?;
    sys::fallocate(file, len).map_err(|e| Error::io("fallocate", path, e))?;
    chunks(file, Geometry::new(n, opts.chunk_bytes, direct), on_chunk)?;
    if direct && padded != n {
        file.set_len(len)
            .map_err(|e| Error::io("truncate", path, e))?;
    }
    probe_op(opts.faults.as_deref(), "fsync", path).map_err(|e| Error::io("fsync", path, e))?;
    file.sync_all().map_err(|e| Error::io("fsync", path, e))?;
    Ok(IoStats {
        bytes: len,
        direct,
        kind,
    })
}

/// The read skeleton over `file` (opened by [`super::open_regular`]: no
/// symlink, no FIFO, only a regular file; named `path` in messages):
/// refusal of a file that does not fit, `O_DIRECT` policy, then
/// `chunks(file, dst, geometry)` reads the chunks (each padded to
/// [`ALIGN`]; the last one comes back short at end of file) and hands each
/// one over as it lands. Returns the file length.
pub(super) fn read_file<'a, F>(
    file: &File,
    path: &Path,
    dst: &'a mut [u8],
    opts: &IoOpts,
    chunks: F,
) -> Result<u64>
where
    F: FnOnce(&File, &'a mut [u8], Geometry) -> Result<()>,
{
    check_opts(opts)?;
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    let len = meta.len();
    let n = usize::try_from(len).map_err(|_| too_big(path, len, dst.len()))?;
    read_range(file, path, 0, n, dst, opts, chunks).map(|()| len)
}

/// The read skeleton of [`read_file`] over the `n` bytes of `file` from
/// `base` on (a multiple of [`ALIGN`]), read into the start of `dst`
/// under the `O_DIRECT` policy, which it leaves as it found it: the caller
/// knows the file holds them (a shorter file fails the read).
pub(super) fn read_range<'a, F>(
    file: &File,
    path: &Path,
    base: u64,
    n: usize,
    dst: &'a mut [u8],
    opts: &IoOpts,
    chunks: F,
) -> Result<()>
where
    F: FnOnce(&File, &'a mut [u8], Geometry) -> Result<()>,
{
    check_opts(opts)?;
    if base % ALIGN as u64 != 0 {
        return Err(Error::invalid(
            format!("read {}", path.display()),
            format!("offset {base} is not a multiple of 4096"),
        ));
    }
    let padded = round_up(n)
        .filter(|&p| p <= dst.len())
        .ok_or_else(|| too_big(path, n as u64, dst.len()))?;
    let want = want_direct(opts.direct, aligned(dst.as_ptr()), "read", path)?;
    let direct = apply_flags(file, opts.direct, want, path)?;
    tracing::trace!(path = %path.display(), base, n, direct, "read");
    let read = if n > 0 {
        let (dst, _) = dst.split_at_mut(padded);
        chunks(file, dst, Geometry::new(n, opts.chunk_bytes, true).at(base))
    } else {
        Ok(())
    };
    // The caller keeps the descriptor (to name a changed chunk's tensors
    // from the header, say): hand it back as buffered as it came.
    if direct {
        sys::clear_direct(file).map_err(|e| Error::io("fcntl", path, e))?;
    }
    read
}

fn too_big(path: &Path, len: u64, room: usize) -> Error {
    Error::invalid(
        format!("read {}", path.display()),
        format!("{len} bytes (rounded up to 4096) do not fit in a {room} byte buffer"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn geometry_pads_only_the_tail() {
        let g = Geometry::new(3 * 8192 + 5, 8192, true);
        assert_eq!(g.count(), 4);
        assert_eq!(
            g.span(0),
            Span {
                index: 0,
                start: 0,
                base: 0,
                data: 8192,
                io: 8192
            }
        );
        assert_eq!(
            g.span(3),
            Span {
                index: 3,
                start: 24576,
                base: 0,
                data: 5,
                io: 4096
            }
        );
        let g = Geometry::new(8192 + 5, 8192, true).at(1 << 20);
        assert_eq!(g.span(1).start, 8192);
        assert_eq!(g.span(1).offset(), (1 << 20) + 8192);
        let g = Geometry::new(8192, 8192, false);
        assert_eq!(g.count(), 1);
        assert_eq!(Geometry::new(0, 8192, true).count(), 0);
        assert_eq!(Geometry::new(1, 8192, false).span(0).io, 1);
    }

    #[test]
    fn rounding() {
        assert_eq!(round_up(0), Some(0));
        assert_eq!(round_up(1), Some(4096));
        assert_eq!(round_up(4096), Some(4096));
        assert_eq!(round_up(usize::MAX), None);
    }
}
