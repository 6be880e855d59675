//! The I/O engines that move checkpoint files between ring slots and
//! storage: `io_uring` (`uring`) and a pwrite/pread pool (`psync`), behind
//! one trait, producing byte-identical files.
//!
//! # The seam
//!
//! This module owns the bulk data path and nothing else: given an opened
//! file and a buffer, an [`IoEngine`] writes the buffer to the file (or
//! reads the file into the buffer) in chunks of [`IoOpts::chunk_bytes`],
//! [`IoOpts::queue_depth`] of them in flight, with `O_DIRECT` when the
//! policy and the file system allow it, and fsyncs what it wrote. It
//! decides neither where a file lives nor when it counts: the caller above
//! (`engine`'s flush, `read`'s whole-image source) gets the file from a
//! [`Storage`](crate::storage::Storage), which created it and later makes
//! it durable and publishes it or discards it. The engine is chosen once
//! ([`open_engine`]): `io_uring` when the kernel allows it, else psync.
//!
//! The contract with the layers above:
//! - **Chunks are reported in order of their bytes' life.** A write calls
//!   `on_chunk(i, bytes)` for each chunk before submitting it, in order (the
//!   flush hashes there, so the digests are of exactly the bytes written);
//!   a read calls it as each chunk lands, in completion order (the verified
//!   reader hashes there, overlapping the read).
//! - **Buffers are the caller's and stay put.** `src`/`dst` are borrowed
//!   for the whole call, 4096-aligned and padded to a whole last chunk;
//!   every operation in flight has finished before a call returns, on
//!   success and on error, so the kernel never touches a buffer after it
//!   is given back.
//! - **Errors reach the caller, naming the file and the operation.** Worker
//!   loops never panic; a short write, an fsync error or an `ENOSPC` is an
//!   [`Error`] for that call. After an error, nothing in the file or in
//!   `dst` may be trusted; the file's owner discards it.
//!
//! Fault injection enters here as an [`IoOpts::faults`] probe (see
//! [`storage`](crate::storage#fault-injection)): it sees each chunk write,
//! fsync and chunk read before it runs. Without the `test-util` feature the
//! engine is never given one.

use std::fmt::Debug;
use std::fs::File;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::config::{DirectIo, IoChoice};
use crate::error::{Error, Result};
use crate::storage::Probe;

use crate::storage::create_exclusive;
pub use crate::storage::{open_listed, open_regular};
pub(crate) use pool::run_on_threads;
pub(crate) use stream::StreamWriter;
pub(crate) use sys::{background_setup, block_async_signals};

mod file;
mod pool;
mod psync;
mod stream;
mod sys;
mod uring;

/// Which engine is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// `io_uring`.
    Uring,
    /// pwrite/pread threads.
    Psync,
}

/// How a file is written or read.
#[derive(Debug, Clone)]
pub struct IoOpts {
    /// Chunk size (multiple of 4096): one write or read per chunk, and the
    /// unit of `on_chunk`.
    pub chunk_bytes: usize,
    /// Chunks in flight at once.
    pub queue_depth: usize,
    /// `O_DIRECT` policy. With `Auto`, a file system that rejects `O_DIRECT`
    /// (EINVAL at open) gets buffered I/O.
    pub direct: DirectIo,
    /// Sees each operation before it runs, and may fail it (fault
    /// injection in tests): `check("write", path)` before each chunk write,
    /// `check("fsync", path)` before the fsync, `check("read", path)` before
    /// each chunk read. `None` outside tests.
    pub faults: Option<Arc<dyn Probe>>,
}

/// What a write or read did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IoStats {
    /// Bytes of file data moved.
    pub bytes: u64,
    /// Whether `O_DIRECT` was used.
    pub direct: bool,
    /// The engine used.
    pub kind: IoKind,
}

/// Moves whole files between memory and storage.
pub trait IoEngine: Send + Sync + Debug {
    /// Which engine this is.
    fn kind(&self) -> IoKind;

    /// Writes the first `len` bytes of `src` to `file` (fresh and empty,
    /// opened for writing; `path` names it in messages) in chunks of
    /// `opts.chunk_bytes` with up to `opts.queue_depth` in flight, sets the
    /// file length to exactly `len`, and fsyncs it. `src.len()` is at least
    /// `len` rounded up to 4096 and `src` is 4096-aligned, so the last chunk
    /// can be written whole under `O_DIRECT` and the file truncated after.
    /// (A source that is not so is written buffered under
    /// [`DirectIo::Auto`] and refused under [`DirectIo::On`].)
    ///
    /// `on_chunk(i, bytes)` is called for chunk `i` (the unpadded bytes)
    /// before that chunk is submitted, in order, on the calling thread; an
    /// error from it stops the write. An empty file has no chunks, so
    /// `on_chunk` is not called. On error the file holds some of the bytes:
    /// its owner (the [`Storage`](crate::storage::Storage) that made it)
    /// discards it.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::NoSpace`] naming `path` and the operation;
    /// the error of `on_chunk`; [`Error::Invalid`] for a chunk size that is
    /// not a positive multiple of 4096 up to 1 GiB, a queue depth of 0, or a
    /// `len` beyond `src`.
    fn write_to(
        &self,
        file: &File,
        path: &Path,
        src: &[u8],
        len: u64,
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<IoStats>;

    /// Reads the whole of `file` (opened by [`open_regular`]; `path` names
    /// it in messages) into the start of `dst` in chunks of
    /// `opts.chunk_bytes` with up to `opts.queue_depth` in flight, and
    /// returns its length. `dst` is 4096-aligned; the file must fit with
    /// its last chunk padded: `round_up(file_len, 4096) <= dst.len()`, else
    /// [`Error::Invalid`] without reading. Bytes of `dst` between the file
    /// length and that bound may be overwritten.
    ///
    /// `on_chunk(i, bytes)` is called once for each chunk `i` as soon as it
    /// has landed, with its file bytes (unpadded; chunk `i` starts at byte
    /// `i * opts.chunk_bytes`), on the calling thread, while later chunks
    /// are still being read. Chunks are reported in the order they complete,
    /// which need not be `i`'s. The bytes are final: nothing writes them
    /// again, so `on_chunk` may keep them (to hash them elsewhere) for as
    /// long as `dst` is borrowed. An error from `on_chunk` stops the read
    /// (reads in flight are waited for) and is returned. On any error, some
    /// chunks may have been reported and others not: a caller must not
    /// trust any of `dst` unless the call returned `Ok`. An empty file has
    /// no chunks. `O_DIRECT`, when used, is cleared again before the call
    /// returns, so `file` can be read at any offset afterwards.
    ///
    /// # Errors
    /// [`Error::Io`]; the error of `on_chunk`; [`Error::Invalid`] when the
    /// file does not fit, or for the bad options `write_to` refuses.
    fn read_from<'a>(
        &self,
        file: &File,
        path: &Path,
        dst: &'a mut [u8],
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
    ) -> Result<u64>;

    /// Reads the `len` bytes of `file` from `offset` on (a multiple of
    /// 4096) into the start of `dst`, as [`IoEngine::read_from`] reads a
    /// whole file (same chunks, depth and `O_DIRECT` policy, and `dst`
    /// rules: 4096-aligned, room for `len` rounded up to 4096), and
    /// returns once all of them have landed. A file that ends before
    /// `offset + len` fails the read. A reader that streams a file through
    /// a few small buffers reads it so, one window at a time.
    ///
    /// # Errors
    /// [`Error::Io`]; [`Error::Invalid`] for an unaligned `offset`, a `len`
    /// that does not fit, or the bad options `write_to` refuses.
    fn read_range(
        &self,
        file: &File,
        path: &Path,
        offset: u64,
        len: usize,
        dst: &mut [u8],
        opts: &IoOpts,
    ) -> Result<()>;

    /// Creates `path` (mode 0600, `O_EXCL`: it must not exist) and writes it
    /// as [`IoEngine::write_to`] does. On any error the partial file is
    /// removed; an existing file at `path` is never touched.
    ///
    /// # Errors
    /// As [`IoEngine::write_to`]; [`Error::Io`] (EEXIST when `path` exists).
    fn write_file(
        &self,
        path: &Path,
        src: &[u8],
        len: u64,
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<IoStats> {
        file::plan_write(path, src, len, opts)?;
        let file = create_exclusive(path)?;
        let mut guard = file::RemoveOnDrop { path: Some(path) };
        let stats = self.write_to(&file, path, src, len, opts, on_chunk)?;
        guard.path = None;
        Ok(stats)
    }

    /// Opens `path` with [`open_regular`] and reads it as
    /// [`IoEngine::read_from`] does.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming `path` when it is not a regular file (a
    /// symlink, a FIFO, a directory...); as [`IoEngine::read_from`].
    fn read_file<'a>(
        &self,
        path: &Path,
        dst: &'a mut [u8],
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
    ) -> Result<u64> {
        let file = open_regular(path)?;
        self.read_from(&file, path, dst, opts, on_chunk)
    }
}

/// Opens the engine `choice` asks for. `Auto` probes `io_uring` once (a ring
/// is created and a no-op submitted) and falls back to psync when refused.
///
/// # Errors
/// [`Error::Unsupported`] when `Uring` is forced
/// and refused.
pub fn open_engine(choice: IoChoice) -> Result<Arc<dyn IoEngine>> {
    if choice == IoChoice::Psync {
        return Ok(Arc::new(psync::PsyncEngine));
    }
    match uring_refused() {
        None => Ok(Arc::new(uring::UringEngine)),
        Some(reason) if choice == IoChoice::Uring => Err(Error::Unsupported {
            what: "io_uring".to_owned(),
            reason: reason.to_owned(),
        }),
        Some(reason) => {
            tracing::info!(
                reason,
                "io_uring refused; using the pwrite/pread thread pool"
            );
            Ok(Arc::new(psync::PsyncEngine))
        }
    }
}

/// Why `io_uring` is refused here, or `None` when it works. Probed once per
/// process.
fn uring_refused() -> Option<&'static str> {
    static PROBE: OnceLock<Option<String>> = OnceLock::new();
    PROBE
        .get_or_init(|| uring::probe().err().map(|e| e.to_string()))
        .as_deref()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use memmap2::MmapMut;

    use super::*;
    use crate::error::ErrorKind;

    fn opts(direct: DirectIo) -> IoOpts {
        IoOpts {
            chunk_bytes: 8192,
            queue_depth: 2,
            direct,
            faults: None,
        }
    }

    /// Runs `f` as if the file system refused `O_DIRECT`.
    fn refusing_direct<T>(f: impl FnOnce() -> T) -> T {
        sys::tests::REFUSE_DIRECT.with(|r| r.set(true));
        let out = f();
        sys::tests::REFUSE_DIRECT.with(|r| r.set(false));
        out
    }

    fn engines() -> Vec<Arc<dyn IoEngine>> {
        vec![Arc::new(psync::PsyncEngine), Arc::new(uring::UringEngine)]
    }

    #[test]
    fn auto_falls_back_to_buffered_when_direct_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let len = 3 * 8192 + 5;
        let mut src = MmapMut::map_anon(4 * 8192).unwrap();
        src.iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = u8::try_from(i % 251).expect("below 251"));
        for engine in engines() {
            let path: PathBuf = dir.path().join(format!("{:?}", engine.kind()));
            let stats = refusing_direct(|| {
                engine.write_file(
                    &path,
                    &src,
                    len as u64,
                    &opts(DirectIo::Auto),
                    &mut |_, _| Ok(()),
                )
            })
            .unwrap();
            assert!(!stats.direct);
            assert_eq!(std::fs::read(&path).unwrap(), src[..len]);

            let mut dst = MmapMut::map_anon(4 * 8192).unwrap();
            let n = refusing_direct(|| {
                engine.read_file(&path, &mut dst, &opts(DirectIo::Auto), &mut |_, _| Ok(()))
            })
            .unwrap();
            assert_eq!(n, len as u64);
            assert_eq!(dst[..len], src[..len]);

            // `On` refuses instead, and leaves no file behind.
            let e = refusing_direct(|| {
                engine.read_file(&path, &mut dst, &opts(DirectIo::On), &mut |_, _| Ok(()))
            })
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io, "{e}");
            std::fs::remove_file(&path).unwrap();
            let e = refusing_direct(|| {
                engine.write_file(&path, &src, len as u64, &opts(DirectIo::On), &mut |_, _| {
                    Ok(())
                })
            })
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io, "{e}");
            assert!(!path.exists());
        }
    }

    /// A range of a file, read into a buffer of its own: the bytes at that
    /// offset, a tail short of a whole chunk included; an unaligned offset
    /// and a file that ends too soon are errors.
    #[test]
    fn ranges_read_the_bytes_at_their_offset() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let len = 5 * 8192 + 5;
        let data: Vec<u8> = (0..len)
            .map(|i| u8::try_from(i % 251).expect("below 251"))
            .collect();
        std::fs::write(&path, &data).unwrap();
        let file = File::open(&path).unwrap();
        for engine in engines() {
            for direct in [DirectIo::Auto, DirectIo::Off] {
                let mut dst = MmapMut::map_anon(3 * 8192).unwrap();
                let o = opts(direct);
                engine
                    .read_range(&file, &path, 8192, 2 * 8192 + 4096, &mut dst, &o)
                    .unwrap();
                let first_diff = |a: &[u8], b: &[u8]| a.iter().zip(b).position(|(x, y)| x != y);
                let k = engine.kind();
                let got = first_diff(&dst[..2 * 8192 + 4096], &data[8192..4 * 8192 + 4096]);
                assert_eq!(got, None, "{k:?} {direct:?}");
                // The tail, padded to 4096 in the buffer.
                engine
                    .read_range(&file, &path, 4 * 8192, 8192 + 5, &mut dst, &o)
                    .unwrap();
                let got = first_diff(&dst[..8192 + 5], &data[4 * 8192..]);
                assert_eq!(got, None, "{k:?} {direct:?}");
                let e = engine
                    .read_range(&file, &path, 100, 4096, &mut dst, &o)
                    .unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
                let e = engine
                    .read_range(&file, &path, 4 * 8192, 2 * 8192, &mut dst, &o)
                    .unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Io, "{e}");
                let e = engine
                    .read_range(&file, &path, 0, 4 * 8192, &mut dst, &o)
                    .unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
            }
        }
    }

    #[test]
    fn engines_open_as_asked() {
        assert_eq!(open_engine(IoChoice::Psync).unwrap().kind(), IoKind::Psync);
        // io_uring works on the machines the tests run on.
        assert_eq!(open_engine(IoChoice::Uring).unwrap().kind(), IoKind::Uring);
        assert_eq!(open_engine(IoChoice::Auto).unwrap().kind(), IoKind::Uring);
        uring::probe().unwrap();
    }
}
