//! Whole images checked on several threads: in place
//! ([`ChunkReader::verify_in_place`]), or while they are read
//! ([`ChunkReader::read_verified`]), optionally copying each read into
//! the caller's tensors in the pass that verifies it, a cache-sized block
//! at a time ([`ChunkReader::read_verified_into`]).
//!
//! A read is verified while it runs: the source hands over each read as
//! soon as it has landed, and a small pool of hashing threads (fed through
//! a channel) checks it while later reads are still in flight. The reads
//! are cut along the digest chunks (a whole number of them per read), so
//! each landed read can be checked on its own, in any order.
//!
//! A compressed file's reads are filled on the pool instead: its frames
//! decode independently, so each thread takes the next read in file order
//! and reads its frames, checks and decodes them, then hashes the decoded
//! chunks and copies them into the targets, all while they are in its
//! cache; the kernel's readahead keeps the next frames coming meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use super::fast::{copy_block, sum_then_digest, HOT_BYTES};
use super::{to_usize, ChunkReader, ChunkSource};
use crate::error::{Error, Result};
use crate::format::{digest, Digest};

/// The largest read the I/O engines take (one SQE's length is a `u32`).
const MAX_READ: usize = 1 << 30;

/// Below this many bytes, chunks are hashed on the calling thread rather
/// than by several: starting threads costs more.
const POOL_MIN_BYTES: usize = 8 << 20;

/// The bytes a streamed read ([`ChunkReader::read_verified_streamed`])
/// reads at once into one of its buffers: enough reads of the I/O engine's
/// chunk to keep its queue full, few enough that its buffers stay small.
const WINDOW_BYTES: usize = 16 << 20;

impl<S: ChunkSource + Sync> ChunkReader<S> {
    /// Checks the image the source holds in memory (a resident slot) in
    /// place, on up to `threads` threads, without copying it. Returns the
    /// digests once every one matched.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming the file and the first differing chunk's
    /// tensors, or when the length or chunk count is not the index's;
    /// [`Error::Invalid`] for a source that is not in memory.
    pub(crate) fn verify_in_place(&mut self, threads: usize) -> Result<Vec<Digest>> {
        let image = self
            .src
            .in_memory()
            .ok_or_else(|| Error::invalid(self.src.name().display(), "not an image in memory"))?;
        let got = digests_of(image, to_usize(self.chunk), threads);
        self.check_digests(got, image.len() as u64)
    }

    /// [`ChunkReader::verify_in_place`], also computing each chunk's quick
    /// sum ([`fast_sum`]) in the same pass, from the same bytes as its
    /// digest while they are in cache. Returns the digests and the sums once
    /// every digest matched.
    ///
    /// # Errors
    /// As [`ChunkReader::verify_in_place`].
    pub(crate) fn verify_in_place_with_sums(
        &mut self,
        threads: usize,
    ) -> Result<(Vec<Digest>, Vec<u64>)> {
        let image = self
            .src
            .in_memory()
            .ok_or_else(|| Error::invalid(self.src.name().display(), "not an image in memory"))?;
        let (digests, sums): (Vec<Digest>, Vec<u64>) =
            hashes_of(image, to_usize(self.chunk), threads)
                .into_iter()
                .unzip();
        let digests = self.check_digests(digests, image.len() as u64)?;
        Ok((digests, sums))
    }

    /// Compares `got`, the digests of an image of `len` bytes, with the
    /// index's; the error names the lowest chunk that differs.
    fn check_digests(&mut self, got: Vec<Digest>, len: u64) -> Result<Vec<Digest>> {
        if len != self.entry.size {
            return Err(self.len_error(len));
        }
        if got.len() != self.digests.len() {
            return Err(self.count_error(got.len()));
        }
        match (0..).zip(&got).find(|(i, g)| !self.matches(*i, g)) {
            Some((i, _)) => Err(self.mismatch_error(i)),
            None => Ok(got),
        }
    }

    /// Reads the whole image into `dst` ([`ChunkSource::read_all`], in
    /// reads near `io_chunk` bytes), checking each chunk as it lands: on
    /// `threads` hashing threads (the calling one helps at the end), or on
    /// the calling thread alone when `threads` is 1 or the file is small.
    /// Returns the digests once every one matched.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming the file and the chunk's tensors when a
    /// digest differs (the lowest chunk found before the read stopped), or
    /// when the file's length or chunk count is not the index's; the
    /// source's errors.
    pub(crate) fn read_verified(
        &mut self,
        dst: &mut [u8],
        threads: usize,
        io_chunk: usize,
    ) -> Result<Vec<Digest>> {
        self.read_verified_into(dst, threads, io_chunk, Vec::new())
    }

    /// [`ChunkReader::read_verified`], also copying file bytes
    /// `[off, off + d.len())` into each target `(off, d)` in the pass that
    /// checks them, on the thread that checks them: each digest chunk is
    /// copied and hashed a cache-sized block at a time, and its digest
    /// compared at the chunk's end.
    ///
    /// On an error, each target holds its old bytes, the file's verified
    /// ones, or bytes of a chunk whose digest then differed (at most one
    /// per checking thread): a mix the caller is told of by the error and
    /// must overwrite from a verified source or discard, never use.
    ///
    /// # Errors
    /// As [`ChunkReader::read_verified`]; [`Error::Invalid`] for a target
    /// past the end of the file (before anything is read).
    pub(crate) fn read_verified_into(
        &mut self,
        dst: &mut [u8],
        threads: usize,
        io_chunk: usize,
        targets: Vec<Target<'_>>,
    ) -> Result<Vec<Digest>> {
        let len = to_usize(self.entry.size);
        self.check_targets(&targets)?;
        let chunk = to_usize(self.chunk);
        let n = len.div_ceil(chunk);
        if self.digests.len() != n {
            return Err(self.count_error(n));
        }
        let Some(read_bytes) = read_size(chunk, io_chunk) else {
            // Reads cannot be cut along these digest chunks (acp never
            // writes such a file): read it all, then hash it.
            let got = self.src.read_all(dst, io_chunk, &mut |_, _| Ok(()))?;
            if got != self.entry.size {
                return Err(self.len_error(got));
            }
            let image = &dst[..len];
            let digests = digests_of(image, chunk, threads);
            if digests.len() == n && !(0..).zip(&digests).all(|(i, g)| self.matches(i, g)) {
                self.guess = crate::format::parse_header(self.src.name(), image, got).ok();
            }
            let digests = self.check_digests(digests, got)?;
            scatter(image, targets.into_iter().map(|(o, d)| (to_usize(o), d)));
            return Ok(digests);
        };
        let per_read = read_bytes / chunk;
        let found = Found::default();
        let mut got = vec![[0u8; 32]; n];
        let this = &*self;
        let reads = len.div_ceil(read_bytes);
        // Per read `i`, the targets' parts it holds; taken with its digests.
        let mut copies = split_targets(targets, read_bytes, reads);
        let read = {
            // Per read `i`, the digests it covers; taken when it lands.
            let mut outs: Vec<Option<&mut [Digest]>> = got.chunks_mut(per_read).map(Some).collect();
            let read =
                this.hash_while_reading(dst, threads, read_bytes, &found, &mut outs, &mut copies);
            read.map(|r| (r, outs.iter().any(Option::is_some)))
        };
        if let Some(i) = found.first() {
            return Err(self.mismatch_error(i as u64));
        }
        let (read, unreported) = read?;
        if read != self.entry.size {
            return Err(self.len_error(read));
        }
        if unreported {
            // Every read succeeded but some chunk was never handed over:
            // check the whole image rather than trust the unseen part.
            tracing::warn!(path = %self.src.name().display(), "the source did not report every chunk");
            let digests = digests_of(&dst[..len], chunk, threads);
            let digests = self.check_digests(digests, read)?;
            let rest = copies.into_iter().enumerate().flat_map(|(i, c)| {
                c.into_iter()
                    .flatten()
                    .map(move |(at, d)| (i * read_bytes + at, d))
            });
            scatter(&dst[..len], rest);
            return Ok(digests);
        }
        Ok(got)
    }

    /// The read of [`ChunkReader::read_verified`], each landed read hashed
    /// into its `outs` slot by a pool (or this thread); records the chunks
    /// that differ in `found`.
    fn hash_while_reading<'d, 'c: 'd>(
        &self,
        dst: &'d mut [u8],
        threads: usize,
        read_bytes: usize,
        found: &Found,
        outs: &mut [Option<&'d mut [Digest]>],
        copies: &mut [Option<Parts<'c>>],
    ) -> Result<u64> {
        if self.src.decodes() {
            let len = super::source::image_len(&self.src, dst.len())?;
            let fills = dst[..len]
                .chunks_mut(read_bytes)
                .zip(outs)
                .enumerate()
                .filter_map(|(i, (bytes, out))| {
                    let out = out.take()?;
                    let copies = copies.get_mut(i).and_then(Option::take).unwrap_or_default();
                    Some((
                        i,
                        Fill {
                            bytes: Some(bytes),
                            out,
                            copies,
                        },
                    ))
                })
                .collect();
            return self
                .decode_on_pool(fills, threads, read_bytes, found)
                .map(|()| len as u64);
        }
        let chunk = to_usize(self.chunk);
        let per_read = read_bytes / chunk;
        // One thread asked for, or a small file: hash on the calling
        // thread, between reads, while the next ones are in flight.
        let pool = self.helpers(threads);
        std::thread::scope(|s| {
            let (tx, rx) = crossbeam_channel::unbounded::<Job<'_>>();
            let mut hashers = 0;
            for _ in 0..pool {
                let rx = rx.clone();
                let spawned = std::thread::Builder::new()
                    .name("acp-verify".into())
                    .spawn_scoped(s, move || {
                        crate::io::block_async_signals();
                        for job in rx {
                            job.check(chunk, self, found);
                        }
                    });
                // A thread that cannot start leaves its share to the
                // others, or to the calling thread when none started.
                if spawned.is_ok() {
                    hashers += 1;
                }
            }
            let path = self.src.name();
            let mut on_piece = |i: usize, bytes| -> Result<()> {
                if self.stop_asked() {
                    return Err(self.stopped_error());
                }
                if found.any() {
                    // Reported by the caller as the mismatch it is.
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
                    copies: copies.get_mut(i).and_then(Option::take).unwrap_or_default(),
                };
                if hashers == 0 {
                    job.check(chunk, self, found);
                } else if let Err(e) = tx.send(job) {
                    // Unreachable: `rx` lives until the scope ends.
                    e.into_inner().check(chunk, self, found);
                }
                Ok(())
            };
            let read = self.src.read_all(dst, read_bytes, &mut on_piece);
            drop(tx);
            // The calling thread helps with what is still queued.
            for job in &rx {
                job.check(chunk, self, found);
            }
            read
        })
    }

    /// The read of [`ChunkReader::read_verified`] for a source that decodes
    /// (a compressed file, whose frames decode independently): each read
    /// `(i, fill)` of `fills` (read `i` starts at byte `i * read_bytes`) is
    /// filled (its frames read, checked and decoded) into its bytes, or
    /// into a buffer of the thread that takes it when it has none, then
    /// hashed and copied into its targets by that thread, while it is in
    /// that thread's cache; `threads` threads, the calling one among them,
    /// take the reads in file order. Records the chunks that differ in
    /// `found`.
    pub(super) fn decode_on_pool(
        &self,
        fills: Vec<(usize, Fill<'_>)>,
        threads: usize,
        read_bytes: usize,
        found: &Found,
    ) -> Result<()> {
        let len = to_usize(self.entry.size);
        let chunk = to_usize(self.chunk);
        let per_read = read_bytes / chunk;
        let (tx, rx) = crossbeam_channel::unbounded::<(usize, Fill<'_>)>();
        for fill in fills {
            // Unreachable failure: `rx` is alive.
            let _ = tx.send(fill);
        }
        drop(tx);
        let failed: Mutex<Option<(usize, Error)>> = Mutex::new(None);
        let stop = AtomicBool::new(false);
        let work = || {
            let (mut scratch, mut own) = (Vec::new(), Vec::new());
            for (i, fill) in &rx {
                if stop.load(Ordering::Acquire) || found.any() {
                    return;
                }
                if self.stop_asked() {
                    let mut first = failed.lock().unwrap_or_else(PoisonError::into_inner);
                    first.get_or_insert((i, self.stopped_error()));
                    stop.store(true, Ordering::Release);
                    return;
                }
                let offset = i * read_bytes;
                let bytes = match fill.bytes {
                    Some(b) => b,
                    None => {
                        own.resize(read_bytes.min(len.saturating_sub(offset)), 0);
                        own.as_mut_slice()
                    }
                };
                let digest_of = |c: u64| {
                    usize::try_from(c)
                        .ok()
                        .and_then(|c| self.digests.get(c))
                        .copied()
                        .flatten()
                };
                if let Err(e) =
                    self.src
                        .read_for_digests(bytes, offset as u64, &digest_of, &mut scratch)
                {
                    let mut first = failed.lock().unwrap_or_else(PoisonError::into_inner);
                    if first.as_ref().is_none_or(|(at, _)| i < *at) {
                        *first = Some((i, e));
                    }
                    stop.store(true, Ordering::Release);
                    return;
                }
                Job {
                    first: i * per_read,
                    bytes,
                    out: fill.out,
                    copies: fill.copies,
                }
                .check(chunk, self, found);
            }
        };
        // The calling thread is one of the `threads`: each of them decodes
        // and hashes without waiting on anything but the buffered reads the
        // kernel's readahead serves, so one more than the cores asked for
        // only contends for them (BENCHMARKS.md, "Compressed storage,
        // cold"). A small file, or one thread asked for: the calling thread
        // alone.
        let helpers = self.helpers(threads).saturating_sub(1);
        std::thread::scope(|s| {
            for _ in 0..helpers {
                // A thread that cannot start leaves its share to the
                // others and the calling thread.
                let _ = std::thread::Builder::new()
                    .name("acp-decode".into())
                    .spawn_scoped(s, || {
                        crate::io::block_async_signals();
                        work();
                    });
            }
            work();
        });
        match failed.into_inner().unwrap_or_else(PoisonError::into_inner) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }

    /// [`ChunkReader::read_verified_into`] with no memory for the image:
    /// only the targets receive its bytes. The file is read a window of
    /// [`WINDOW_BYTES`] (whole digest chunks) at a time into a few buffers
    /// of this call, reused, each window checked and copied into its
    /// targets by a hashing thread while the next windows are read (a
    /// compressed file: each read filled, checked and copied by one of
    /// `threads` threads, as [`ChunkReader::read_verified_into`] does, into
    /// a buffer of that thread). So a restore into the caller's tensors
    /// touches tens of MiB of fresh memory, not the image's size of it.
    ///
    /// On an error, each target holds what
    /// [`ChunkReader::read_verified_into`] says.
    ///
    /// # Errors
    /// As [`ChunkReader::read_verified_into`].
    pub(crate) fn read_verified_streamed(
        &mut self,
        threads: usize,
        io_chunk: usize,
        targets: Vec<Target<'_>>,
    ) -> Result<Vec<Digest>> {
        self.streamed(threads, io_chunk, WINDOW_BYTES, targets)
    }

    /// [`ChunkReader::read_verified_streamed`] in windows near
    /// `window_bytes`.
    fn streamed(
        &mut self,
        threads: usize,
        io_chunk: usize,
        window_bytes: usize,
        targets: Vec<Target<'_>>,
    ) -> Result<Vec<Digest>> {
        self.check_targets(&targets)?;
        let len = to_usize(self.entry.size);
        let chunk = to_usize(self.chunk);
        let n = len.div_ceil(chunk);
        if self.digests.len() != n {
            return Err(self.count_error(n));
        }
        let Some(read_bytes) = read_size(chunk, io_chunk) else {
            // Reads cannot be cut along these digest chunks (acp never
            // writes such a file): the whole image in memory, as before.
            let mut image = crate::read::image_memory(len, self.src.name())?;
            return self.read_verified_into(&mut image, threads, io_chunk, targets);
        };
        let found = Found::default();
        let mut got = vec![[0u8; 32]; n];
        let read = if self.src.decodes() {
            let reads = len.div_ceil(read_bytes);
            let copies = split_targets(targets, read_bytes, reads);
            let fills = got
                .chunks_mut(read_bytes / chunk)
                .zip(copies)
                .enumerate()
                .map(|(i, (out, copies))| {
                    let copies = copies.unwrap_or_default();
                    let fill = Fill {
                        bytes: None,
                        out,
                        copies,
                    };
                    (i, fill)
                })
                .collect();
            self.decode_on_pool(fills, threads, read_bytes, &found)
        } else {
            let window = read_bytes * (window_bytes / read_bytes).max(1);
            let windows = len.div_ceil(window);
            let copies = split_targets(targets, window, windows);
            let jobs = got
                .chunks_mut(window / chunk)
                .zip(copies)
                .enumerate()
                .map(|(i, (out, copies))| Window {
                    i,
                    out,
                    copies: copies.unwrap_or_default(),
                })
                .collect();
            self.stream_windows(jobs, window, threads, &found)
        };
        if let Some(i) = found.first() {
            return Err(self.mismatch_error(i as u64));
        }
        read?;
        Ok(got)
    }

    /// The windows of [`ChunkReader::read_verified_streamed`] for a source
    /// that reads ([`ChunkSource::read_window`]): the calling thread reads
    /// each window into a free buffer and hands it to a pool of `threads`
    /// hashing threads (or checks it itself when there is none), which give
    /// the buffer back once it is checked; two buffers more than hashers,
    /// so the reads never wait on a hash unless the hashing is slower.
    /// Stops reading once a chunk is found to differ.
    fn stream_windows(
        &self,
        jobs: Vec<Window<'_>>,
        window: usize,
        threads: usize,
        found: &Found,
    ) -> Result<()> {
        let len = to_usize(self.entry.size);
        let chunk = to_usize(self.chunk);
        let per_window = window / chunk;
        let pool = self.helpers(threads);
        let (free_tx, free_rx) = crossbeam_channel::unbounded::<memmap2::MmapMut>();
        for _ in 0..(pool + 2).min(jobs.len()) {
            let buf = bounce_memory(window, self.src.name())?;
            // Unreachable failure: `free_rx` is alive.
            let _ = free_tx.send(buf);
        }
        let check = |w: Window<'_>, bytes: &[u8]| {
            Job {
                first: w.i * per_window,
                bytes,
                out: w.out,
                copies: w.copies,
            }
            .check(chunk, self, found);
        };
        std::thread::scope(|s| {
            let (tx, rx) = crossbeam_channel::unbounded::<(Window<'_>, memmap2::MmapMut, usize)>();
            let mut hashers = 0;
            for _ in 0..pool {
                let (rx, free_tx) = (rx.clone(), free_tx.clone());
                let spawned = std::thread::Builder::new()
                    .name("acp-verify".into())
                    .spawn_scoped(s, move || {
                        crate::io::block_async_signals();
                        for (w, buf, n) in rx {
                            check(w, &buf[..n]);
                            // Unreachable failure: the reader holds `free_rx`.
                            let _ = free_tx.send(buf);
                        }
                    });
                // A thread that cannot start leaves its share to the
                // others, or to the calling thread when none started.
                if spawned.is_ok() {
                    hashers += 1;
                }
            }
            drop(rx);
            for w in jobs {
                if found.any() {
                    break;
                }
                // Never fails: this thread holds a sender, and every
                // buffer comes back once its window is checked.
                let Ok(mut buf) = free_rx.recv() else {
                    break;
                };
                let offset = w.i * window;
                let n = window.min(len - offset);
                self.src.read_window(&mut buf, offset as u64, n)?;
                if hashers == 0 {
                    check(w, &buf[..n]);
                    let _ = free_tx.send(buf);
                } else if let Err(e) = tx.send((w, buf, n)) {
                    // Unreachable: the hashers hold receivers until `tx`
                    // is dropped.
                    let (w, buf, n) = e.into_inner();
                    check(w, &buf[..n]);
                }
            }
            Ok(())
        })
    }

    /// Refuses a target past the end of the file, before anything is read.
    fn check_targets(&self, targets: &[Target<'_>]) -> Result<()> {
        match targets.iter().find(|(off, d)| {
            off.checked_add(d.len() as u64)
                .is_none_or(|e| e > self.entry.size)
        }) {
            Some((off, d)) => Err(Error::invalid(
                self.src.name().display(),
                format!("bytes {off}+{} past the end of the file", d.len()),
            )),
            None => Ok(()),
        }
    }

    /// The threads that help the calling one with a whole-file read of
    /// `threads` asked for: none for one thread or a small file.
    fn helpers(&self, threads: usize) -> usize {
        if threads > 1 && to_usize(self.entry.size) >= POOL_MIN_BYTES {
            threads
        } else {
            0
        }
    }

    fn len_error(&self, got: u64) -> Error {
        Error::corrupt(
            self.src.name(),
            None,
            format!("file is {got} bytes, the index says {}", self.entry.size),
        )
    }

    fn count_error(&self, got: usize) -> Error {
        Error::corrupt(
            self.src.name(),
            None,
            format!("{got} chunks, the index records {}", self.digests.len()),
        )
    }
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

/// A streamed read's buffer of `len` bytes (a multiple of 4096): huge
/// pages where the kernel allows, faulted in by the reads that land in
/// it, not ahead of them, so that making the memory overlaps the reads in
/// flight (fresh memory costs about as much as the read itself on a host
/// that backs a guest's memory on first touch).
fn bounce_memory(len: usize, what: &std::path::Path) -> Result<memmap2::MmapMut> {
    let map =
        memmap2::MmapMut::map_anon(len.max(4096)).map_err(|e| Error::io("allocate", what, e))?;
    // Advice only: without huge pages the memory is the same, in 4 KiB pages.
    let _ = map.advise(memmap2::Advice::HugePage);
    Ok(map)
}

/// Where verified file bytes are copied: `(offset in the file, memory)`.
pub(crate) type Target<'t> = (u64, &'t mut [u8]);

/// The parts of targets one read holds: `(offset in the read, memory)`.
type Parts<'t> = Vec<(usize, &'t mut [u8])>;

/// `targets` cut along reads of `read_bytes` bytes (`reads` of them): per
/// read, `(offset in the read, memory)` of each part it holds. Every
/// target lies inside the `reads` reads (the caller checked).
fn split_targets<'t>(
    targets: Vec<Target<'t>>,
    read_bytes: usize,
    reads: usize,
) -> Vec<Option<Parts<'t>>> {
    let mut per: Vec<Option<Parts<'t>>> = (0..reads).map(|_| None).collect();
    for (off, mut d) in targets {
        let mut at = to_usize(off);
        while !d.is_empty() {
            let (i, in_read) = (at / read_bytes, at % read_bytes);
            let n = (read_bytes - in_read).min(d.len());
            let (head, tail) = std::mem::take(&mut d).split_at_mut(n);
            if let Some(slot) = per.get_mut(i) {
                slot.get_or_insert_with(Vec::new).push((in_read, head));
            }
            d = tail;
            at += n;
        }
    }
    per
}

/// Copies `src[at..at + d.len()]` into each `(at, d)`; a part outside
/// `src` is left as it is (callers pass parts inside it).
fn scatter<'t>(src: &[u8], parts: impl IntoIterator<Item = (usize, &'t mut [u8])>) {
    for (at, d) in parts {
        if let Some(s) = at.checked_add(d.len()).and_then(|end| src.get(at..end)) {
            d.copy_from_slice(s);
        }
    }
}

/// One read still to fill (a compressed file's): where its bytes go (into
/// a buffer of the thread that fills it when `None`), where its digests
/// go, and the targets' parts it holds.
pub(super) struct Fill<'a> {
    pub(super) bytes: Option<&'a mut [u8]>,
    pub(super) out: &'a mut [Digest],
    pub(super) copies: Parts<'a>,
}

/// One window of a streamed read still to read: its index, where its
/// digests go, and the targets' parts it holds.
struct Window<'a> {
    i: usize,
    out: &'a mut [Digest],
    copies: Parts<'a>,
}

/// One landed read: its bytes, the digest chunks it holds from index
/// `first` on, where their digests go, and the targets' parts it holds.
struct Job<'a> {
    first: usize,
    bytes: &'a [u8],
    out: &'a mut [Digest],
    copies: Parts<'a>,
}

impl Job<'_> {
    /// Hashes each `chunk`-byte piece and compares it with the index's
    /// digest; records the first that differs and stops there. Each piece
    /// is taken [`HOT_BYTES`] at a time: the block's bytes that the
    /// targets' parts take are copied into them first (the copy streams
    /// them from memory), then the block is fed to the piece's hash from
    /// the cache the copy left it in; the digest is compared at the
    /// piece's end. So the read's bytes cross memory once, not twice (a
    /// hash of a whole 4 MiB chunk, then its copy, read it twice: it does
    /// not fit in a core's cache). The price: a piece that differs may
    /// have put some of its bytes into the targets before its digest was
    /// compared; the read then fails, and the caller must not use them.
    /// Skips the work once any mismatch is known (the read fails anyway).
    fn check<S: ChunkSource>(self, chunk: usize, reader: &ChunkReader<S>, found: &Found) {
        if found.any() {
            return;
        }
        let Job {
            first,
            bytes,
            out,
            mut copies,
        } = self;
        copies.sort_unstable_by_key(|p| p.0);
        // The first part that may still take bytes of the next block.
        let mut lo = 0;
        for (k, (piece, d)) in bytes.chunks(chunk.max(1)).zip(out).enumerate() {
            let base = k * chunk;
            let mut hasher = blake3::Hasher::new();
            for from in (0..piece.len()).step_by(HOT_BYTES) {
                let block = &piece[from..(from + HOT_BYTES).min(piece.len())];
                copy_block(&mut copies, &mut lo, base + from, block);
                hasher.update(block);
            }
            *d = *hasher.finalize().as_bytes();
            let i = first + k;
            if !reader.matches(i as u64, d) {
                found.record(i);
                return;
            }
        }
        if let Some(f) = &reader.on_checked {
            if !(f.0)() {
                reader.stopped.store(true, Ordering::Release);
            }
        }
    }
}

/// The chunks found to differ, shared by the hashers.
#[derive(Default)]
pub(super) struct Found {
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

/// The digest of each `chunk`-byte piece of `data`, computed over up to
/// `threads` threads (each takes a contiguous run of chunks).
pub(crate) fn digests_of(data: &[u8], chunk: usize, threads: usize) -> Vec<Digest> {
    let chunk = chunk.max(1);
    let n = data.len().div_ceil(chunk);
    if threads <= 1 || data.len() < POOL_MIN_BYTES || n < 2 {
        return crate::format::chunk_digests(data, chunk);
    }
    let per = n.div_ceil(threads);
    let mut out = vec![[0u8; 32]; n];
    let work: Vec<(&mut [Digest], &[u8])> =
        out.chunks_mut(per).zip(data.chunks(per * chunk)).collect();
    crate::io::run_on_threads("acp-hash", work, |(dst, src)| {
        for (d, piece) in dst.iter_mut().zip(src.chunks(chunk)) {
            *d = digest(piece);
        }
    });
    out
}

/// The digest and the quick sum of each `chunk`-byte piece of `data`, both
/// from one read of the piece, over up to `threads` threads; the sum
/// first (`fast.rs` says why).
fn hashes_of(data: &[u8], chunk: usize, threads: usize) -> Vec<Hashes> {
    let chunk = chunk.max(1);
    let n = data.len().div_ceil(chunk);
    let both = |piece: &[u8]| {
        let (sum, d) = sum_then_digest(piece);
        (d, sum)
    };
    if threads <= 1 || data.len() < POOL_MIN_BYTES || n < 2 {
        return data.chunks(chunk).map(both).collect();
    }
    let per = n.div_ceil(threads);
    let mut out = vec![([0u8; 32], 0); n];
    let work: Vec<(&mut [Hashes], &[u8])> =
        out.chunks_mut(per).zip(data.chunks(per * chunk)).collect();
    crate::io::run_on_threads("acp-hash", work, |(dst, src)| {
        for (d, piece) in dst.iter_mut().zip(src.chunks(chunk)) {
            *d = both(piece);
        }
    });
    out
}

/// A chunk's digest and quick sum.
type Hashes = (Digest, u64);

#[cfg(test)]
mod tests {
    use super::super::fast::fast_sum;
    use super::super::source::MemSource;
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

    #[test]
    fn targets_are_cut_along_reads_and_scattered_from_each() {
        let file: Vec<u8> = (0..40u32).map(|i| i as u8).collect();
        let (mut a, mut b, mut c) = (vec![0u8; 3], vec![0u8; 12], vec![0u8; 0]);
        // Reads of 8 bytes: `a` lies in read 0, `b` spans reads 1 to 3.
        let targets: Vec<Target<'_>> = vec![(2, &mut a), (13, &mut b), (40, &mut c)];
        let per = split_targets(targets, 8, 5);
        let spans: Vec<Vec<(usize, usize)>> = per
            .iter()
            .map(|p| p.iter().flatten().map(|(at, d)| (*at, d.len())).collect())
            .collect();
        assert_eq!(
            spans,
            vec![
                vec![(2, 3)],
                vec![(5, 3)],
                vec![(0, 8)],
                vec![(0, 1)],
                vec![],
            ]
        );
        for (i, parts) in per.into_iter().enumerate() {
            scatter(
                &file[i * 8..(i * 8 + 8).min(file.len())],
                parts.into_iter().flatten(),
            );
        }
        assert_eq!(a, file[2..5]);
        assert_eq!(b, file[13..25]);
    }

    /// An image of `n` bytes in `chunk`-byte digest chunks, with its entry.
    fn image_and_entry(n: usize, chunk: usize) -> (Vec<u8>, crate::format::FileEntry) {
        let image: Vec<u8> = (0..n).map(|i| (i * 7 % 253) as u8).collect();
        let digests = crate::format::chunk_digests(&image, chunk);
        let entry = crate::format::FileEntry::plain(0, n as u64, chunk as u64, &digests);
        (image, entry)
    }

    /// Memory for each `(offset, length)` of `spans`, filled with 0xee.
    fn bufs_for(spans: &[(usize, usize)]) -> Vec<Vec<u8>> {
        spans.iter().map(|&(_, l)| vec![0xee; l]).collect()
    }

    /// `bufs` as the targets of `spans`.
    fn targets_over<'b>(spans: &[(usize, usize)], bufs: &'b mut [Vec<u8>]) -> Vec<Target<'b>> {
        spans
            .iter()
            .zip(bufs)
            .map(|(&(at, _), b)| (at as u64, b.as_mut_slice()))
            .collect()
    }

    /// Each of `bufs` holds `image`'s bytes at its span.
    fn assert_spans(image: &[u8], spans: &[(usize, usize)], bufs: &[Vec<u8>], case: &str) {
        for (&(at, l), b) in spans.iter().zip(bufs) {
            assert!(b[..] == image[at..at + l], "{at}+{l}, {case}");
        }
    }

    #[test]
    fn targets_get_their_bytes_from_the_pass_that_hashes_them() {
        // Chunks of two blocks and a short last one; targets that start and
        // end mid-block, span blocks, chunks and reads, overlap each other,
        // or are empty.
        let chunk = 2 * HOT_BYTES;
        let n = 5 * chunk + 1000;
        let (image, entry) = image_and_entry(n, chunk);
        let spans = [
            (3, 10),
            (HOT_BYTES - 5, 10),
            (chunk - 1, 2),
            (100, 3 * chunk),
            (200, 50),
            (4 * chunk + 7, chunk + 993),
            (n, 0),
        ];
        for (threads, io_chunk) in [(1, chunk), (2, chunk), (2, 2 * chunk), (3, 4 * chunk)] {
            let path = std::path::PathBuf::from("image");
            let mut reader = ChunkReader::new(MemSource::new(&image, &path), &entry).unwrap();
            let mut bufs = bufs_for(&spans);
            let mut dst = vec![0u8; n];
            let targets = targets_over(&spans, &mut bufs);
            let got = reader.read_verified_into(&mut dst, threads, io_chunk, targets);
            assert!(got.is_ok(), "{threads} threads, reads of {io_chunk}");
            assert_spans(&image, &spans, &bufs, &format!("{threads} threads"));
        }
    }

    #[test]
    fn a_streamed_read_fills_the_targets_alone() {
        // As above, through windows of one to three reads (the last one
        // short), on one to three hashing threads (the image is over
        // `POOL_MIN_BYTES`), with fewer buffers than windows.
        let chunk = 8 * HOT_BYTES;
        let n = 9 * chunk + 1000;
        let (image, entry) = image_and_entry(n, chunk);
        let spans = [
            (3, 10),
            (HOT_BYTES - 5, 10),
            (chunk - 1, 2),
            (100, 7 * chunk),
            (4 * chunk + 7, 5 * chunk + 993),
            (n, 0),
        ];
        for (threads, io_chunk, window) in [
            (1, chunk, chunk),
            (2, chunk, 2 * chunk),
            (3, 2 * chunk, 6 * chunk),
            (2, chunk, 64 * chunk),
        ] {
            let path = std::path::PathBuf::from("image");
            let mut reader = ChunkReader::new(MemSource::new(&image, &path), &entry).unwrap();
            let mut bufs = bufs_for(&spans);
            let targets = targets_over(&spans, &mut bufs);
            let got = reader.streamed(threads, io_chunk, window, targets).unwrap();
            assert_eq!(got, crate::format::chunk_digests(&image, chunk));
            assert_spans(&image, &spans, &bufs, &format!("window {window}"));
        }
        // A target past the end is refused before anything is read.
        let path = std::path::PathBuf::from("image");
        let mut reader = ChunkReader::new(MemSource::new(&image, &path), &entry).unwrap();
        let mut past = [0u8; 2];
        let e = reader
            .read_verified_streamed(2, chunk, vec![(n as u64 - 1, &mut past[..])])
            .unwrap_err();
        assert!(e.to_string().contains("past the end"), "{e}");
    }

    #[test]
    fn a_streamed_read_stops_at_a_chunk_that_differs() {
        let chunk = 8 * HOT_BYTES;
        let n = 10 * chunk;
        let (mut image, entry) = image_and_entry(n, chunk);
        image[5 * chunk + 3] ^= 1;
        for threads in [1, 2] {
            let path = std::path::PathBuf::from("image");
            let mut reader = ChunkReader::new(MemSource::new(&image, &path), &entry).unwrap();
            let mut all = vec![0xeeu8; n];
            let e = reader
                .streamed(threads, chunk, chunk, vec![(0, &mut all[..])])
                .unwrap_err();
            assert!(
                e.to_string().contains(&format!("bytes {}..", 5 * chunk)),
                "{e}"
            );
            assert!(all.iter().zip(&image).all(|(g, f)| *g == 0xee || g == f));
            if threads == 1 {
                // Nothing read past the window that differed.
                assert!(all[6 * chunk..].iter().all(|g| *g == 0xee));
            }
        }
    }

    #[test]
    fn a_chunk_that_differs_stops_its_thread_and_nothing_but_its_bytes_arrive() {
        let chunk = 2 * HOT_BYTES;
        let n = 6 * chunk;
        let (mut image, entry) = image_and_entry(n, chunk);
        let bad = 3 * chunk + HOT_BYTES + 17;
        image[bad] ^= 0x5a;
        for threads in [1, 2] {
            let path = std::path::PathBuf::from("image");
            let mut reader = ChunkReader::new(MemSource::new(&image, &path), &entry).unwrap();
            let mut all = vec![0xeeu8; n - 1];
            let mut dst = vec![0u8; n];
            let e = reader
                .read_verified_into(&mut dst, threads, chunk, vec![(1, &mut all[..])])
                .unwrap_err();
            let want = format!("bytes {}..{}", 3 * chunk, 4 * chunk);
            assert!(e.to_string().contains(&want), "{e}");
            // Each byte is old or the file's (the changed one included).
            assert!(all
                .iter()
                .zip(&image[1..])
                .all(|(g, f)| *g == 0xee || g == f));
            // One thread stops at the chunk that differs: the chunks after
            // it were never copied.
            if threads == 1 {
                assert!(all[4 * chunk - 1..].iter().all(|g| *g == 0xee));
            }
        }
    }

    #[test]
    fn digests_on_threads_are_the_serial_ones() {
        let data: Vec<u8> = (0..(20u32 << 20)).map(|i| (i % 251) as u8).collect();
        for threads in [1, 2, 3, 8] {
            assert_eq!(
                digests_of(&data, 1 << 20, threads),
                crate::format::chunk_digests(&data, 1 << 20),
                "threads {threads}"
            );
            let serial: Vec<_> = data
                .chunks(1 << 20)
                .map(|p| (digest(p), fast_sum(p)))
                .collect();
            assert_eq!(
                hashes_of(&data, 1 << 20, threads),
                serial,
                "threads {threads}"
            );
        }
    }
}
