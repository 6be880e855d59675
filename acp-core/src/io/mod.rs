//! The I/O engines that move checkpoint files between ring slots and
//! storage: io_uring ([`uring`]) and a pwrite/pread pool ([`psync`]), behind
//! one trait, producing byte-identical files.

use std::fmt::Debug;
use std::path::Path;
use std::sync::Arc;

use crate::config::{DirectIo, IoChoice};
use crate::error::Result;
use crate::storage::faults::FaultInjector;

mod psync;
mod uring;

/// Which engine is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    /// io_uring.
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
    /// Fault injection: `check("write", path)` before each chunk write,
    /// `check("fsync", path)` before the fsync, `check("read", path)` before
    /// each chunk read.
    pub faults: Option<Arc<FaultInjector>>,
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

    /// Creates `path` (mode 0600, `O_EXCL`: it must not exist), writes the
    /// first `len` bytes of `src` in chunks of `opts.chunk_bytes` with up to
    /// `opts.queue_depth` in flight, sets the file length to exactly `len`,
    /// and fsyncs it. `src.len()` is at least `len` rounded up to 4096 and
    /// `src` is 4096-aligned, so the last chunk can be written whole under
    /// `O_DIRECT` and the file truncated after.
    ///
    /// `on_chunk(i, bytes)` is called for chunk `i` (the unpadded bytes)
    /// before that chunk is submitted, in order, on the calling thread; an
    /// error from it stops the write. On any error the partial file is
    /// removed.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) / [`Error::NoSpace`](crate::Error::NoSpace)
    /// naming `path` and the operation.
    fn write_file(
        &self,
        path: &Path,
        src: &[u8],
        len: u64,
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<IoStats>;

    /// Reads the whole of `path` (opened with `O_NOFOLLOW`) into the start of
    /// `dst` and returns its length. `dst` is 4096-aligned; the file must fit
    /// in `dst` rounded down to 4096... precisely: `round_up(file_len, 4096)
    /// <= dst.len()`, else [`Error::Invalid`](crate::Error::Invalid) without
    /// reading.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) naming `path`.
    fn read_file(&self, path: &Path, dst: &mut [u8], opts: &IoOpts) -> Result<u64>;
}

/// Opens the engine `choice` asks for. `Auto` probes io_uring once (a ring
/// is created and a no-op submitted) and falls back to psync when refused.
///
/// # Errors
/// [`Error::Unsupported`](crate::Error::Unsupported) when `Uring` is forced
/// and refused.
pub fn open_engine(choice: IoChoice) -> Result<Arc<dyn IoEngine>> {
    todo!()
}
