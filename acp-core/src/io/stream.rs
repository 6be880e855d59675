//! A file written piece by piece as its bytes are produced (the
//! compressed flush), under the same `O_DIRECT` policy, fault probe and
//! durability as [`IoEngine::write_to`](super::IoEngine::write_to).
//!
//! The pieces are written by `pwrite` on the calling thread: the producer
//! of the bytes (the encoding threads) runs beside it, so one write in
//! flight keeps the storage busy while the next piece is made.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::file::{apply_flags, ALIGN};
use super::{sys, IoKind, IoOpts, IoStats};
use crate::config::DirectIo;
use crate::error::{Error, Result};
use crate::storage::{probe_io, probe_op};

/// A fresh file being written in aligned pieces at chosen offsets.
#[derive(Debug)]
pub(crate) struct StreamWriter<'a> {
    file: &'a File,
    path: &'a Path,
    opts: &'a IoOpts,
    direct: bool,
}

impl<'a> StreamWriter<'a> {
    /// Starts writing `file` (fresh and empty; `path` names it), whose
    /// length will be about `len_hint` (space is reserved for it).
    /// `O_DIRECT` is asked for unless `opts.direct` is off; pieces must
    /// then come as [`StreamWriter::write_at`] says.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::NoSpace`] naming `path`.
    pub(crate) fn start(
        file: &'a File,
        path: &'a Path,
        opts: &'a IoOpts,
        len_hint: u64,
    ) -> Result<Self> {
        let want = opts.direct != DirectIo::Off;
        let direct = apply_flags(file, opts.direct, want, path)?;
        sys::fallocate(file, len_hint).map_err(|e| Error::io("fallocate", path, e))?;
        Ok(StreamWriter {
            file,
            path,
            opts,
            direct,
        })
    }

    /// Writes `buf` at `offset`, one operation per `opts.chunk_bytes` (the
    /// unit the fault probe sees, as for a plain write). `buf` starts
    /// 4096-aligned, and `offset` and `buf.len()` are multiples of 4096
    /// (bytes past the file's end are cut off by [`StreamWriter::finish`]).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a piece that is not so aligned;
    /// [`Error::Io`] / [`Error::NoSpace`] naming the file.
    pub(crate) fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        if (buf.as_ptr() as usize) % ALIGN != 0
            || buf.len() % ALIGN != 0
            || offset % ALIGN as u64 != 0
        {
            return Err(Error::invalid(
                format!("write {}", self.path.display()),
                format!(
                    "a piece of {} bytes at {offset} is not 4096-aligned",
                    buf.len()
                ),
            ));
        }
        let mut at = offset;
        for op in buf.chunks(self.opts.chunk_bytes.max(ALIGN)) {
            probe_io(self.opts.faults.as_deref(), "write", self.path, op.len())
                .map_err(|e| Error::io("write", self.path, e))?;
            self.file
                .write_all_at(op, at)
                .map_err(|e| Error::io("write", self.path, e))?;
            at += op.len() as u64;
        }
        Ok(())
    }

    /// Sets the file's length to `len` and fsyncs it.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::NoSpace`] naming the file.
    pub(crate) fn finish(self, len: u64) -> Result<IoStats> {
        self.file
            .set_len(len)
            .map_err(|e| Error::io("truncate", self.path, e))?;
        probe_op(self.opts.faults.as_deref(), "fsync", self.path)
            .map_err(|e| Error::io("fsync", self.path, e))?;
        self.file
            .sync_all()
            .map_err(|e| Error::io("fsync", self.path, e))?;
        Ok(IoStats {
            bytes: len,
            direct: self.direct,
            kind: IoKind::Psync,
        })
    }
}
