//! Checking a data file against the chunk digests its index records: an
//! image already in memory ([`verify`]), or a file as it is read from
//! storage ([`read_verified`]).
//!
//! A read is verified while it runs: the I/O engine hands over each chunk
//! as soon as it has landed, and a small pool of hashing threads (fed
//! through a channel) checks it while later chunks are still in flight, so
//! a restore takes about `max(read, hash)` rather than `read + hash`. The
//! reads are cut along the digest chunks (a whole number of them per read),
//! so each landed read can be checked on its own, in any order.
//!
//! Nothing is trusted early: [`read_verified`] returns the digests only
//! once the whole file was read and every chunk's digest equals the
//! index's; on any error the caller drops the buffer unmarked.

use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use super::copy;
use crate::error::{Error, Result};
use crate::format::{parse_header, unhex, Digest, FileEntry, ParsedHeader};
use crate::io::{IoEngine, IoOpts};

/// The largest read the I/O engines take (one SQE's length is a `u32`).
const MAX_READ: usize = 1 << 30;

/// Below this many bytes, chunks are hashed on the calling thread, between
/// reads, rather than by a pool: starting threads costs more.
const POOL_MIN_BYTES: usize = 8 << 20;

/// Checks `image` against the digests the index recorded; names the first
/// tensor of the first chunk that differs.
pub(super) fn verify(
    path: &Path,
    image: &[u8],
    entry: &FileEntry,
    threads: usize,
) -> Result<Vec<Digest>> {
    let chunk = to_usize(entry.chunk_bytes);
    let got = copy::parallel_digests(image, chunk, threads);
    if got.len() != entry.chunks.len() {
        return Err(count_error(path, got.len(), entry));
    }
    match got
        .iter()
        .zip(&entry.chunks)
        .position(|(g, want)| !matches(want, g))
    {
        Some(i) => {
            let header = parse_header(path, image, image.len() as u64).ok();
            Err(mismatch(path, header, chunk, i))
        }
        None => Ok(got),
    }
}

/// Reads the file at `path` (whose index entry is `entry`) into `dst` with
/// `io`, verifying each chunk against the index as it lands: on `threads`
/// hashing threads (the calling one helps at the end), or on the calling
/// thread alone when `threads` is 1 or the file is small. Returns the
/// digests once every one matched.
///
/// # Errors
/// [`Error::Corrupt`] naming `path` and the chunk's tensors when a digest
/// differs (the lowest chunk found before the read stopped), or when the
/// file's length or chunk count is not the index's; the I/O engine's
/// errors ([`Error::Io`] naming `path`).
pub(super) fn read_verified(
    io: &dyn IoEngine,
    opts: &IoOpts,
    file: &File,
    path: &Path,
    dst: &mut [u8],
    entry: &FileEntry,
    threads: usize,
) -> Result<Vec<Digest>> {
    let len = to_usize(entry.size);
    let chunk = to_usize(entry.chunk_bytes).max(1);
    let n = len.div_ceil(chunk);
    if entry.chunks.len() != n {
        return Err(count_error(path, n, entry));
    }
    let Some(read_bytes) = read_size(chunk, opts.chunk_bytes) else {
        // Reads cannot be cut along these digest chunks (acp never writes
        // such a file): read it all, then hash it.
        let got = io.read_from(file, path, dst, opts, &mut |_, _| Ok(()))?;
        check_len(path, got, entry)?;
        return verify(path, &dst[..len], entry, threads);
    };
    let opts = IoOpts {
        chunk_bytes: read_bytes,
        ..opts.clone()
    };
    let per_read = read_bytes / chunk;
    let found = Found::default();
    let mut got = vec![[0u8; 32]; n];
    // Per read `i`, the digests it covers; taken when it lands.
    let mut outs: Vec<Option<&mut [Digest]>> = got.chunks_mut(per_read).map(Some).collect();
    // One thread asked for, or a small file: hash on the calling thread,
    // between reads, while the next ones are in flight.
    let pool = if threads > 1 && len >= POOL_MIN_BYTES {
        threads
    } else {
        0
    };
    let read = std::thread::scope(|s| {
        let (tx, rx) = crossbeam_channel::unbounded::<Job<'_>>();
        let mut hashers = 0;
        for _ in 0..pool {
            let rx = rx.clone();
            let found = &found;
            let spawned = std::thread::Builder::new()
                .name("acp-verify".into())
                .spawn_scoped(s, move || {
                    crate::io::block_async_signals();
                    for job in rx {
                        job.check(chunk, entry, found);
                    }
                });
            // A thread that cannot start leaves its share to the others, or
            // to the calling thread when none started.
            if spawned.is_ok() {
                hashers += 1;
            }
        }
        let mut on_chunk = |i: usize, bytes| -> Result<()> {
            if found.any() {
                // Reported below as the mismatch it is.
                return Err(Error::corrupt(path, None, "digest mismatch"));
            }
            let Some(out) = outs.get_mut(i).and_then(Option::take) else {
                return Err(Error::io(
                    "read",
                    path,
                    std::io::Error::other(format!("chunk {i} reported twice or out of range")),
                ));
            };
            let job = Job {
                first: i * per_read,
                bytes,
                out,
            };
            if hashers == 0 {
                job.check(chunk, entry, &found);
            } else if let Err(e) = tx.send(job) {
                // Unreachable: `rx` lives until the scope ends.
                e.into_inner().check(chunk, entry, &found);
            }
            Ok(())
        };
        let read = io.read_from(file, path, dst, &opts, &mut on_chunk);
        drop(tx);
        // The calling thread helps with what is still queued.
        for job in &rx {
            job.check(chunk, entry, &found);
        }
        read
    });
    let unreported = outs.iter().any(Option::is_some);
    drop(outs);
    if let Some(i) = found.first() {
        return Err(mismatch(
            path,
            file_header(file, path, entry.size),
            chunk,
            i,
        ));
    }
    check_len(path, read?, entry)?;
    if unreported {
        // Every read succeeded but some chunk was never handed over: check
        // the whole image rather than trust the unseen part.
        tracing::warn!(path = %path.display(), "the I/O engine did not report every chunk");
        return verify(path, &dst[..len], entry, threads);
    }
    Ok(got)
}

/// The read size for digest chunks of `chunk` bytes, near the engine's
/// `io_chunk`: a whole number of digest chunks, at least one. `None` when
/// reads cannot be cut so (`chunk` not a multiple of 4096, or over the
/// largest read).
fn read_size(chunk: usize, io_chunk: usize) -> Option<usize> {
    if chunk % 4096 != 0 || chunk > MAX_READ {
        return None;
    }
    Some(chunk * (io_chunk / chunk).clamp(1, MAX_READ / chunk))
}

/// One landed read: its bytes, the digest chunks it holds from index
/// `first` on, and where their digests go.
struct Job<'a> {
    first: usize,
    bytes: &'a [u8],
    out: &'a mut [Digest],
}

impl Job<'_> {
    /// Hashes each `chunk`-byte piece and compares it with the index's
    /// digest; records the first that differs. Skips the work once any
    /// mismatch is known (the load fails anyway).
    fn check(self, chunk: usize, entry: &FileEntry, found: &Found) {
        if found.any() {
            return;
        }
        for (k, (piece, d)) in self.bytes.chunks(chunk).zip(self.out).enumerate() {
            *d = *blake3::hash(piece).as_bytes();
            let i = self.first + k;
            if !entry.chunks.get(i).is_some_and(|want| matches(want, d)) {
                found.record(i);
                return;
            }
        }
    }
}

/// The chunks found to differ, shared by the hashers.
#[derive(Default)]
struct Found {
    any: AtomicBool,
    lowest: Mutex<Option<usize>>,
}

impl Found {
    fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    fn record(&self, i: usize) {
        let mut lowest = self.lowest.lock().unwrap_or_else(PoisonError::into_inner);
        *lowest = Some(lowest.map_or(i, |l| l.min(i)));
        self.any.store(true, Ordering::Release);
    }

    fn first(&self) -> Option<usize> {
        *self.lowest.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn matches(want: &str, got: &Digest) -> bool {
    unhex(want).as_ref() == Some(got)
}

fn check_len(path: &Path, got: u64, entry: &FileEntry) -> Result<()> {
    if got == entry.size {
        return Ok(());
    }
    Err(Error::corrupt(
        path,
        None,
        format!("file is {got} bytes, the index says {}", entry.size),
    ))
}

fn count_error(path: &Path, got: usize, entry: &FileEntry) -> Error {
    Error::corrupt(
        path,
        None,
        format!("{got} chunks, the index records {}", entry.chunks.len()),
    )
}

/// The error for chunk `i` (of `chunk` bytes) differing: names the tensors
/// with bytes in it, per `header` (none when it could not be read).
fn mismatch(path: &Path, header: Option<ParsedHeader>, chunk: usize, i: usize) -> Error {
    let start = (i * chunk) as u64;
    let end = start + chunk as u64;
    // A digest covers a chunk: every tensor with bytes in it is suspect.
    let suspects: Vec<String> = header
        .map(|h| {
            h.entries
                .into_iter()
                .filter(|e| e.len > 0 && e.offset < end && e.offset + e.len > start)
                .map(|e| e.name)
                .collect()
        })
        .unwrap_or_default();
    let what = match suspects.len() {
        0 => format!("digest mismatch in bytes {start}..{end} (header)"),
        1 => format!("digest mismatch in bytes {start}..{end}"),
        n => format!(
            "digest mismatch in bytes {start}..{end}, which hold parts of {n} tensors: `{}`",
            suspects.join("`, `")
        ),
    };
    Error::corrupt(path, suspects.first().map(String::as_str), what)
}

/// The header of data `file` (named `path`, whose index says it has `size`
/// bytes), read from the file itself; `None` when it cannot be read or
/// parsed. Reads at most 1 MiB of header.
pub(super) fn file_header(file: &File, path: &Path, size: u64) -> Option<ParsedHeader> {
    use std::os::unix::fs::FileExt;
    let mut prefix = [0u8; 8];
    file.read_exact_at(&mut prefix, 0).ok()?;
    let n = u64::from_le_bytes(prefix);
    if n > 1 << 20 {
        return None;
    }
    // The header as far as the file holds it (a cut file may end inside).
    let mut bytes = prefix.to_vec();
    bytes.resize(8 + usize::try_from(n).ok()?, 0);
    let mut got = 8;
    while got < bytes.len() {
        match file.read_at(&mut bytes[got..], got as u64) {
            Ok(0) => break,
            Ok(k) => got += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    bytes.truncate(got);
    parse_header(path, &bytes, size).ok()
}

fn to_usize(v: u64) -> usize {
    super::to_usize(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_hold_whole_digest_chunks() {
        assert_eq!(read_size(4096, 4 << 20), Some(4 << 20));
        assert_eq!(read_size(3 << 20, 4 << 20), Some(3 << 20));
        assert_eq!(read_size(8 << 20, 4 << 20), Some(8 << 20));
        assert_eq!(read_size(64 << 10, 1 << 20), Some(1 << 20));
        assert_eq!(read_size(1 << 30, 4 << 20), Some(1 << 30));
        assert_eq!(read_size(4096, 1 << 30), Some(1 << 30));
        assert_eq!(read_size(1000, 4 << 20), None);
        assert_eq!(read_size(2 << 30, 4 << 20), None);
    }
}
