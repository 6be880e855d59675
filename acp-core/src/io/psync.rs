//! The pwrite/pread engine: up to `queue_depth` named, scoped worker
//! threads, each moving one chunk at a time with positional I/O.
//!
//! Writes are pipelined: the calling thread runs `on_chunk` (the hash) on
//! chunk `i` and hands the index to the workers through a bounded channel,
//! so hashing overlaps the writes of earlier chunks. Reads are pipelined
//! the other way: each worker hands the chunk it has read back to the
//! calling thread, which runs `on_chunk` on it while the workers read on.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread;

use crossbeam_channel::Receiver;

use crate::error::{Error, Result};
use crate::io::file::{self, Geometry, Span};
use crate::io::{IoEngine, IoKind, IoOpts, IoStats};
use crate::storage::{probe_io, probe_op};

/// At most this many worker threads per call, whatever the queue depth.
const MAX_THREADS: usize = 64;

/// The pwrite/pread engine.
#[derive(Debug, Default)]
pub(crate) struct PsyncEngine;

impl IoEngine for PsyncEngine {
    fn kind(&self) -> IoKind {
        IoKind::Psync
    }

    fn write_to(
        &self,
        file: &File,
        path: &Path,
        src: &[u8],
        len: u64,
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<IoStats> {
        file::write_file(
            IoKind::Psync,
            file,
            path,
            src,
            len,
            opts,
            on_chunk,
            |f, geo, on_chunk| write_chunks(f, path, src, geo, opts, on_chunk),
        )
    }

    fn read_from<'a>(
        &self,
        file: &File,
        path: &Path,
        dst: &'a mut [u8],
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
    ) -> Result<u64> {
        file::read_file(file, path, dst, opts, |f, dst, geo| {
            read_chunks(f, path, dst, geo, opts, on_chunk)
        })
    }

    fn read_range(
        &self,
        file: &File,
        path: &Path,
        offset: u64,
        len: usize,
        dst: &mut [u8],
        opts: &IoOpts,
    ) -> Result<()> {
        file::read_range(file, path, offset, len, dst, opts, |f, dst, geo| {
            read_chunks(f, path, dst, geo, opts, &mut |_, _| Ok(()))
        })
    }
}

/// The first error of a call, shared by the caller and the workers; once
/// one is set, nobody starts another chunk.
struct FirstError {
    failed: AtomicBool,
    error: Mutex<Option<Error>>,
}

impl FirstError {
    fn new() -> Self {
        FirstError {
            failed: AtomicBool::new(false),
            error: Mutex::new(None),
        }
    }

    fn failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    fn set(&self, e: Error) {
        let mut slot = self.error.lock().unwrap_or_else(PoisonError::into_inner);
        if slot.is_none() {
            *slot = Some(e);
        }
        self.failed.store(true, Ordering::Release);
    }

    fn into_result(self) -> Result<()> {
        match self
            .error
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
        {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Writes `src[span.start..][..span.io]` at `span.start`; `write_all_at`
/// loops over short writes and EINTR.
fn write_span(f: &File, path: &Path, src: &[u8], span: Span) -> Result<()> {
    f.write_all_at(&src[span.start..span.start + span.io], span.offset())
        .map_err(|e| Error::io("write", path, e))
}

/// Reads chunk `span` into `buf` (`span.io` bytes long) until its
/// `span.data` bytes of file data are in; a short read past them (end of
/// file) is expected.
fn read_span(f: &File, path: &Path, buf: &mut [u8], span: Span) -> Result<()> {
    let mut got = 0;
    while got < span.data {
        match f.read_at(&mut buf[got..], span.offset() + got as u64) {
            Ok(0) => {
                return Err(Error::io(
                    "read",
                    path,
                    std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        "file shrank while being read",
                    ),
                ));
            }
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("read", path, e)),
        }
    }
    Ok(())
}

fn write_chunks(
    f: &File,
    path: &Path,
    src: &[u8],
    geo: Geometry,
    opts: &IoOpts,
    on_chunk: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let n = geo.count();
    // Runs on the calling thread before chunk `i` is handed over.
    let mut prepare = |i: usize| -> Result<Span> {
        let span = geo.span(i);
        on_chunk(i, &src[span.start..span.start + span.data])?;
        probe_io(opts.faults.as_deref(), "write", path, span.data)
            .map_err(|e| Error::io("write", path, e))?;
        Ok(span)
    };
    if n <= 1 {
        for i in 0..n {
            write_span(f, path, src, prepare(i)?)?;
        }
        return Ok(());
    }

    let workers = opts.queue_depth.min(n).min(MAX_THREADS);
    let first = FirstError::new();
    let (tx, rx) = crossbeam_channel::bounded::<Span>(workers);
    thread::scope(|s| {
        for w in 0..workers {
            let rx = rx.clone();
            let first = &first;
            let spawned = thread::Builder::new()
                .name(format!("acp-pwrite-{w}"))
                .spawn_scoped(s, move || {
                    super::block_async_signals();
                    for span in rx {
                        if !first.failed() {
                            if let Err(e) = write_span(f, path, src, span) {
                                first.set(e);
                            }
                        }
                    }
                });
            if let Err(e) = spawned {
                first.set(Error::io("spawn pwrite thread", path, e));
                break;
            }
        }
        drop(rx);
        for i in 0..n {
            if first.failed() {
                break;
            }
            match prepare(i) {
                Ok(span) => {
                    if tx.send(span).is_err() {
                        // Every worker is gone: only when none could start.
                        first.set(Error::io(
                            "write",
                            path,
                            std::io::Error::other("no pwrite thread is running"),
                        ));
                    }
                }
                Err(e) => first.set(e),
            }
        }
        drop(tx);
    });
    first.into_result()
}

fn read_chunks<'a>(
    f: &File,
    path: &Path,
    dst: &'a mut [u8],
    geo: Geometry,
    opts: &IoOpts,
    on_chunk: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
) -> Result<()> {
    let n = geo.count();
    let check =
        || probe_op(opts.faults.as_deref(), "read", path).map_err(|e| Error::io("read", path, e));
    // Each chunk's buffer: `span.io` bytes at `span.start`, disjoint.
    let mut bufs = Vec::with_capacity(n);
    let mut rest = dst;
    for i in 0..n {
        let span = geo.span(i);
        let k = span.io.min(rest.len());
        let (buf, tail) = std::mem::take(&mut rest).split_at_mut(k);
        bufs.push((span, buf));
        rest = tail;
    }
    if n <= 1 {
        for (span, buf) in bufs {
            check()?;
            read_span(f, path, buf, span)?;
            let landed: &'a [u8] = buf;
            on_chunk(span.index, &landed[..span.data])?;
        }
        return Ok(());
    }

    let workers = opts.queue_depth.min(n).min(MAX_THREADS);
    let first = FirstError::new();
    let (tx, rx) = crossbeam_channel::unbounded();
    for job in bufs {
        // The receiver is alive, so the send cannot fail.
        let _ = tx.send(job);
    }
    drop(tx);
    // Chunks read, on their way back to the calling thread.
    let (landed_tx, landed_rx) = crossbeam_channel::unbounded::<(usize, &'a [u8])>();
    thread::scope(|s| {
        for w in 0..workers {
            let rx: Receiver<(Span, &'a mut [u8])> = rx.clone();
            let landed_tx = landed_tx.clone();
            let first = &first;
            let spawned = thread::Builder::new()
                .name(format!("acp-pread-{w}"))
                .spawn_scoped(s, move || {
                    super::block_async_signals();
                    for (span, buf) in rx {
                        if first.failed() {
                            break;
                        }
                        match check().and_then(|()| read_span(f, path, buf, span)) {
                            Ok(()) => {
                                // The chunk is read: from here on it is only
                                // ever read, by `on_chunk`.
                                let landed: &'a [u8] = buf;
                                // The calling thread receives until every
                                // worker is gone, so the send cannot fail.
                                let _ = landed_tx.send((span.index, &landed[..span.data]));
                            }
                            Err(e) => first.set(e),
                        }
                    }
                });
            if let Err(e) = spawned {
                first.set(Error::io("spawn pread thread", path, e));
                break;
            }
        }
        drop(landed_tx);
        // Ends when every worker has ended (each holds a sender).
        for (i, bytes) in &landed_rx {
            if first.failed() {
                continue;
            }
            if let Err(e) = on_chunk(i, bytes) {
                first.set(e);
            }
        }
    });
    first.into_result()
}
