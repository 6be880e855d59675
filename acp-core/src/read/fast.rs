//! The RAM tier's quick check: an xxh3-64 sum per digest chunk, beside the
//! blake3 digest of record.
//!
//! # What it proves, and what it does not
//!
//! A resident slot is a cache of a committed file: its bytes were hashed
//! with blake3 by the flush (or by a verified read), and those digests are
//! compared with the index's before the slot is used. The quick sums are
//! computed from the same chunk bytes in the same pass as those digests
//! (by the flush, or by the first full check of a slot that has none) and
//! recorded in the slot's control block beside them, in a record bound to
//! those digests by a tag (the staging module docs give the bytes), so a
//! restarted process's first load checks xxh3, not blake3. A chunk whose
//! bytes still give its recorded sum is, but for a chance of 2⁻⁶⁴ per
//! changed chunk, the chunk the blake3 digest describes: any accidental
//! change (a stray write, a bit flip, another process reusing the file) is
//! caught.
//!
//! The blake3 digests stay the integrity of record: storage is checked
//! against them only, and a slot is used only when its recorded digests
//! are the committed index's. The sums only stand in for re-hashing a slot
//! whose digests already matched, and they are as safe as those recorded
//! digests are. Both live in the same control block of the same slot file:
//! a file created `0600` (another mode is reset to it at open) with
//! `O_NOFOLLOW` in a per-user directory that must be owned by this user
//! with mode `0700` (opened `O_DIRECTORY | O_NOFOLLOW`, checked with
//! `fstat`), refused when another user owns it, and `flock`ed by the one
//! process that holds the ring. Only this user (or root) can write it, and
//! such a writer could as well rewrite the recorded digests, or the
//! committed files and index in storage, which blake3 does not stop
//! either; xxh3 not being a cryptographic hash (a crafted collision would
//! pass it) gives such a writer nothing new. Against anyone else the slot
//! file cannot be written at all.
//!
//! # Sums alone: RAM snapshots
//!
//! A RAM snapshot that is not persisted has no committed index to be
//! checked against: digests taken for it would be recorded by the same
//! process, in the same control block, as its sums, and compared with
//! nothing else. Such a snapshot is summed, not hashed (`engine/hash.rs`):
//! its sums are recorded alone, in a record with its own magic
//! (`ACPXXH3A`) whose tag binds them to the image (its step, length and
//! slot generation, and the chunk size), and a load checks the slot's
//! bytes against them. They catch what sums beside digests catch (any
//! accidental change), at a fraction of blake3's CPU per snapshot, which
//! is what saving a snapshot every step costs in the background. Digests
//! are taken when the snapshot leaves RAM: its flush hashes it as it
//! writes it, and a replica send hashes it before sending; each chunk's
//! sum is taken again first and must be the recorded one, so the new
//! digests never vouch for a change made in RAM after the snapshot was
//! summed. A slot that holds sums alone has no digests (`digests_valid`
//! 0): a version that knows nothing of them sees a snapshot never hashed.
//!
//! A sums record is believed only while its tag is the xxh3 of the digests
//! recorded now (and their chunk size): digests recorded again, by this
//! version or by one that knows nothing of sums, leave the old record
//! unbelieved, and a record with another magic (none written, a later
//! layout) is no record. A slot laid out without room for sums (an older
//! version's) has none, and is checked with blake3 at every first load.
//!
//! Where a digest and a sum are both taken from bytes in shared memory,
//! the sum is taken first: a digest that still matches then vouches for
//! bytes at least as new as those the sum describes, so a change made
//! before the digest was taken either fails the digest or leaves a sum that
//! the bytes no longer give.
//!
//! A chunk whose sum differs is not an error by itself: the caller falls
//! back to the full blake3 check, which names the file and tensor when the
//! bytes really changed, and records fresh sums when they did not.
//!
//! # What each `Verify` mode checks from RAM
//!
//! - `Verify::Always` (the default): the slot's recorded digests must be
//!   the index's, then every chunk of the image is checked: against its
//!   recorded sum when there is one, else (or when a sum differs) against
//!   the index's blake3 digest.
//! - `Verify::StorageOnly`: the recorded digests must be the index's; the
//!   image's bytes are trusted without hashing.
//!
//! xxh3 runs at several times blake3's speed per core (tens of GB/s with
//! AVX2, picked at run time), so a check over all copy threads costs about
//! one read of the image.

use std::hash::Hasher;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

use twox_hash::XxHash3_64;

/// The quick sum of one chunk.
pub(crate) fn fast_sum(bytes: &[u8]) -> u64 {
    XxHash3_64::oneshot(bytes)
}

/// The quick sum and the blake3 digest of one chunk, in one read of it:
/// both are fed from each [`HOT_BYTES`] block in turn, the sum first (so a
/// digest never vouches for bytes older than those the sum describes; the
/// module docs say why that order), the digest from the cache the sum left
/// the block in. A chunk summed, then hashed, is read from memory twice
/// when it does not fit in a core's cache (a 4 MiB chunk): the `digest`
/// bench's `sum_and_digest_blocks_1t` against `sum_then_digest_1t`.
pub(crate) fn sum_then_digest(bytes: &[u8]) -> (u64, crate::format::Digest) {
    let mut sum = XxHash3_64::new();
    let mut hasher = blake3::Hasher::new();
    for block in bytes.chunks(HOT_BYTES) {
        sum.write(block);
        hasher.update(block);
    }
    (sum.finish(), *hasher.finalize().as_bytes())
}

/// Below this many bytes, the check runs on the calling thread alone.
const PARALLEL_MIN_BYTES: usize = 8 << 20;

/// The quick sum of every `chunk`-byte piece of `image`, taken on up to
/// `threads` threads, each a contiguous run of chunks.
pub(crate) fn chunk_sums(image: &[u8], chunk: usize, threads: usize) -> Vec<u64> {
    let chunk = chunk.max(1);
    let n = image.len().div_ceil(chunk);
    let mut out = vec![0u64; n];
    if threads <= 1 || image.len() < PARALLEL_MIN_BYTES || n < 2 {
        for (o, piece) in out.iter_mut().zip(image.chunks(chunk)) {
            *o = fast_sum(piece);
        }
        return out;
    }
    let per = n.div_ceil(threads);
    let work: Vec<(&mut [u64], &[u8])> =
        out.chunks_mut(per).zip(image.chunks(per * chunk)).collect();
    crate::io::run_on_threads("acp-sums", work, |(o, data)| {
        for (s, piece) in o.iter_mut().zip(data.chunks(chunk)) {
            *s = fast_sum(piece);
        }
    });
    out
}

/// The first `chunk`-byte piece of `image` that does not give its sum in
/// `sums` (a missing sum counts as not given), on the calling thread.
pub(crate) fn first_differing(image: &[u8], chunk: usize, sums: &[u64]) -> Option<usize> {
    image
        .chunks(chunk.max(1))
        .enumerate()
        .find(|(i, piece)| sums.get(*i) != Some(&fast_sum(piece)))
        .map(|(i, _)| i)
}

/// Whether every `chunk`-byte piece of `image` gives the sum `sums`
/// records for it (and there is one sum per piece), checked over up to
/// `threads` threads, each a contiguous run of chunks.
pub(crate) fn sums_match(image: &[u8], chunk: usize, sums: &[u64], threads: usize) -> bool {
    let chunk = chunk.max(1);
    if image.len().div_ceil(chunk) != sums.len() {
        return false;
    }
    let run = |(data, want): (&[u8], &[u64])| {
        data.chunks(chunk)
            .zip(want)
            .all(|(piece, w)| fast_sum(piece) == *w)
    };
    if threads <= 1 || image.len() < PARALLEL_MIN_BYTES || sums.len() < 2 {
        return run((image, sums));
    }
    let per = sums.len().div_ceil(threads);
    let work: Vec<(&[u8], &[u64])> = image.chunks(per * chunk).zip(sums.chunks(per)).collect();
    let differs = AtomicBool::new(false);
    crate::io::run_on_threads("acp-check", work, |w| {
        if !differs.load(Ordering::Relaxed) && !run(w) {
            differs.store(true, Ordering::Relaxed);
        }
    });
    !differs.into_inner()
}

/// Runs `work(first, run)` over `items` cut into contiguous runs (`first`:
/// the position of the run's first item), one per thread of up to
/// `threads` named `name`, the calling thread among them; on the calling
/// thread alone when the items hold fewer than [`PARALLEL_MIN_BYTES`]
/// (`bytes` in all) or there are fewer than two.
fn in_runs<T: Send>(
    name: &str,
    items: Vec<T>,
    bytes: usize,
    threads: usize,
    work: impl Fn(usize, Vec<T>) + Sync,
) {
    let runs = if threads <= 1 || bytes < PARALLEL_MIN_BYTES || items.len() < 2 {
        1
    } else {
        threads.min(items.len())
    };
    let per = items.len().div_ceil(runs).max(1);
    let mut batches: Vec<(usize, Vec<T>)> = Vec::with_capacity(runs);
    let mut it = items.into_iter();
    loop {
        let run: Vec<T> = it.by_ref().take(per).collect();
        if run.is_empty() {
            break;
        }
        batches.push((batches.len() * per, run));
    }
    if batches.len() <= 1 {
        for (first, run) in batches {
            work(first, run);
        }
    } else {
        crate::io::run_on_threads(name, batches, |(first, run)| work(first, run));
    }
}

/// One chunk to read: its index, its offset in the image, and the memory
/// it goes to (exactly its length).
pub(crate) type ChunkDst<'m> = (usize, u64, &'m mut [u8]);

/// Reads each chunk of `chunks` from `src` into its memory
/// [`HOT_BYTES`] at a time and sums each block right after it landed,
/// while it is in cache (one pass over the bytes instead of a read and
/// then a check), on up to `threads` threads, each a contiguous run of
/// chunks in the order given. `src` must read any range as cheaply as a
/// whole chunk (a plain file, not compressed frames). Returns the chunks whose
/// bytes do not give their sum in `sums` (none missing: a chunk past the
/// sums counts as differing), in the order given; the caller checks those
/// against their digests, whose error names the tensors.
///
/// # Errors
/// The first of the source's errors; the other reads stop at their next
/// chunk.
pub(crate) fn read_and_sum<S: super::ChunkSource + Sync + ?Sized>(
    src: &S,
    chunks: Vec<ChunkDst<'_>>,
    sums: &[u64],
    threads: usize,
) -> crate::error::Result<Vec<usize>> {
    let bytes: usize = chunks.iter().map(|c| c.2.len()).sum();
    let failed = AtomicBool::new(false);
    // (position in `chunks`, chunk) of each chunk that differs; the
    // first error.
    let differ = Mutex::new(Vec::<(usize, usize)>::new());
    let error = Mutex::new(None::<crate::error::Error>);
    let run = |first: usize, run: Vec<ChunkDst<'_>>| {
        for (j, (k, offset, dst)) in run.into_iter().enumerate() {
            if failed.load(Ordering::Relaxed) {
                return;
            }
            // A block at a time: each summed while the read left it in
            // cache.
            let mut sum = XxHash3_64::new();
            let mut at = offset;
            for block in dst.chunks_mut(HOT_BYTES) {
                if let Err(e) = src.read_at(block, at) {
                    failed.store(true, Ordering::Relaxed);
                    error
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .get_or_insert(e);
                    return;
                }
                sum.write(block);
                at += block.len() as u64;
            }
            if sums.get(k) != Some(&sum.finish()) {
                differ
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push((first + j, k));
            }
        }
    };
    in_runs("acp-read-sum", chunks, bytes, threads, run);
    if let Some(e) = error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        return Err(e);
    }
    let mut differ = differ.into_inner().unwrap_or_else(PoisonError::into_inner);
    differ.sort_unstable();
    Ok(differ.into_iter().map(|(_, k)| k).collect())
}

/// One chunk for [`read_check_copy`]: its index, its span in the image
/// (start, length), and the destination pieces it fills, each (image
/// offset, memory) inside the span.
pub(crate) struct ChunkCopy<'m> {
    pub(crate) k: usize,
    pub(crate) start: u64,
    pub(crate) len: usize,
    pub(crate) pieces: Vec<(u64, &'m mut [u8])>,
}

/// Reads each chunk of `chunks` from `src` [`HOT_BYTES`] at a time into
/// memory of its thread (one block's worth, reused), copies the block's
/// bytes that its pieces take into their destinations and feeds the block
/// to the chunk's sum while it is in cache, then checks the chunk against
/// its sum in `sums`: the bytes go from the source to the destinations
/// with no other copy and no read of memory beyond the core's cache, on
/// up to `threads` threads, each a contiguous run of chunks in the order
/// given. `src` must read any range as cheaply as a whole chunk (a plain
/// file, not compressed frames).
///
/// Returns whether every chunk matched (a chunk past the sums does not,
/// nor a piece outside its chunk, which is refused before its chunk is
/// read). When one differs, each thread stops after its current chunk,
/// and every destination holds its old bytes, bytes of chunks that
/// matched, or bytes of the chunk that differed (at most one per thread):
/// a mix the caller must overwrite from a verified source or discard,
/// never use.
///
/// # Errors
/// The first of the source's errors (the same holds of the destinations).
pub(crate) fn read_check_copy<S: super::ChunkSource + Sync + ?Sized>(
    src: &S,
    chunks: Vec<ChunkCopy<'_>>,
    sums: &[u64],
    threads: usize,
) -> crate::error::Result<bool> {
    let bytes: usize = chunks.iter().map(|c| c.len).sum();
    let stop = AtomicBool::new(false);
    let differs = AtomicBool::new(false);
    let error = Mutex::new(None::<crate::error::Error>);
    let fail = |e: Option<crate::error::Error>| {
        stop.store(true, Ordering::Relaxed);
        match e {
            Some(e) => {
                error
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_or_insert(e);
            }
            None => differs.store(true, Ordering::Relaxed),
        }
    };
    let run = |_: usize, run: Vec<ChunkCopy<'_>>| {
        let mut buf: Vec<u8> = Vec::new();
        for c in run {
            if stop.load(Ordering::Relaxed) {
                return;
            }
            // Each piece as (offset in the chunk, memory), in offset order;
            // one outside its chunk is a caller's mistake, never copied
            // from elsewhere.
            let mut pieces: Vec<(usize, &mut [u8])> = Vec::with_capacity(c.pieces.len());
            for (at, dst) in c.pieces {
                let from = at
                    .checked_sub(c.start)
                    .and_then(|d| usize::try_from(d).ok())
                    .filter(|f| f.checked_add(dst.len()).is_some_and(|e| e <= c.len));
                match from {
                    Some(f) => pieces.push((f, dst)),
                    None => return fail(None),
                }
            }
            pieces.sort_by_key(|p| p.0);
            let mut sum = XxHash3_64::new();
            // The first piece that may still take bytes of the next block.
            let mut lo = 0;
            for from in (0..c.len).step_by(HOT_BYTES) {
                let to = (from + HOT_BYTES).min(c.len);
                buf.resize(to - from, 0);
                if let Err(e) = src.read_at(&mut buf, c.start + from as u64) {
                    return fail(Some(e));
                }
                copy_block(&mut pieces, &mut lo, from, &buf);
                sum.write(&buf);
            }
            if sums.get(c.k) != Some(&sum.finish()) {
                return fail(None);
            }
        }
    };
    in_runs("acp-read-copy", chunks, bytes, threads, run);
    if let Some(e) = error.into_inner().unwrap_or_else(PoisonError::into_inner) {
        return Err(e);
    }
    Ok(!differs.into_inner())
}

/// Copies `block`, the bytes at offsets `from..from + block.len()`, into
/// each `(offset, memory)` of `pieces` (sorted by offset) that takes any
/// of them. `lo` is the first piece that may still take bytes of this
/// block or a later one; it moves past the pieces that end before the
/// block, so blocks must come in offset order. Shared by the checks that
/// copy a block, then sum or hash it from cache ([`read_check_copy`],
/// and a storage read's check in `whole.rs`).
pub(crate) fn copy_block(
    pieces: &mut [(usize, &mut [u8])],
    lo: &mut usize,
    from: usize,
    block: &[u8],
) {
    let to = from + block.len();
    while pieces.get(*lo).is_some_and(|p| p.0 + p.1.len() <= from) {
        *lo += 1;
    }
    for (at, dst) in pieces[*lo..].iter_mut().take_while(|p| p.0 < to) {
        // The piece's bytes in this block.
        let (s, e) = ((*at).max(from), (*at + dst.len()).min(to));
        if s < e {
            stream_copy(&mut dst[s - *at..e - *at], &block[s - from..e - from]);
        }
    }
}

/// Copies `src` into `dst` (of the same length) bypassing the cache where
/// it can: the caller's tensors are written once and not read back soon,
/// and a plain copy of a block this size (which `memcpy` makes with
/// ordinary stores) first reads each destination line into the cache,
/// a third pass over memory beside the read and the write that a
/// whole-buffer `memcpy` (non-temporal past a few MiB) does not pay.
/// Small pieces, and the edges of large ones, are copied plainly.
pub(crate) fn stream_copy(dst: &mut [u8], src: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    if dst.len() >= STREAM_MIN && dst.len() == src.len() {
        let head = dst.as_ptr().align_offset(16).min(dst.len());
        let body = (dst.len() - head) / 64 * 64;
        let (d_head, rest) = dst.split_at_mut(head);
        let (d_body, d_tail) = rest.split_at_mut(body);
        let (s_head, rest) = src.split_at(head);
        let (s_body, s_tail) = rest.split_at(body);
        d_head.copy_from_slice(s_head);
        stream::copy64(d_body, s_body);
        d_tail.copy_from_slice(s_tail);
        return;
    }
    dst.copy_from_slice(src);
}

/// The smallest piece [`stream_copy`] writes with non-temporal stores (on
/// x86-64; elsewhere every piece is copied plainly).
#[cfg_attr(
    not(target_arch = "x86_64"),
    expect(dead_code, reason = "used by the x86-64 path only")
)]
const STREAM_MIN: usize = 16 << 10;

/// Non-temporal stores with SSE2 (part of every x86-64 CPU).
#[cfg(target_arch = "x86_64")]
mod stream {
    /// Copies `src` into `dst`: both a multiple of 64 bytes long and of
    /// the same length, `dst` 16-byte aligned; then fences, so the
    /// weakly ordered stores are done before anything this thread does
    /// next (a join, a flag another thread reads) can be seen.
    #[expect(unsafe_code, reason = "SSE2 intrinsics over checked ranges")]
    pub(super) fn copy64(dst: &mut [u8], src: &[u8]) {
        use std::arch::x86_64::{_mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        assert!(
            dst.len() == src.len() && dst.len() % 64 == 0 && dst.as_ptr().align_offset(16) == 0,
            "stream::copy64: lengths or alignment"
        );
        for (d, s) in dst.chunks_exact_mut(64).zip(src.chunks_exact(64)) {
            // SAFETY: SSE2 is part of x86-64, so the intrinsics exist on
            // every CPU this runs on. `d` and `s` are 64 bytes each
            // (`chunks_exact`); `d` is 16-byte aligned (asserted above for
            // `dst`, whose 64-byte chunks keep it), as `_mm_stream_si128`
            // needs; the unaligned loads read exactly `s`'s bytes and the
            // stores write exactly `d`'s. Non-temporal stores are weakly
            // ordered: the `_mm_sfence` below, which every call reaches
            // after the loop (there is no other way out), orders them
            // before anything else this thread does to `dst` or publishes.
            unsafe {
                let (sp, dp) = (s.as_ptr(), d.as_mut_ptr());
                for k in 0..4 {
                    let v = _mm_loadu_si128(sp.add(16 * k).cast());
                    _mm_stream_si128(dp.add(16 * k).cast(), v);
                }
            }
        }
        // SAFETY: a store fence, no memory operand. It is what makes the
        // streamed stores above safe to follow with ordinary accesses:
        // keep it the last thing this function does.
        unsafe { _mm_sfence() };
    }
}

/// One destination piece of a fused check and copy: the block holding it
/// (its chunk times the blocks per chunk, plus its block in the chunk),
/// its offset in the image, and the memory it goes to.
type Piece<'t> = (usize, usize, &'t mut [u8]);

/// Bytes of a chunk read or copied, then summed, at a time by the checks
/// that sum or hash as they copy ([`check_and_copy`], [`read_check_copy`],
/// [`read_and_sum`], and a storage read's check in `whole.rs`): small
/// enough to be still in the core's cache when the sum reads them, large
/// enough that a block costs few calls (and a whole number of blake3's
/// 1 KiB chunks, so its hasher takes each block in its wide path).
pub(crate) const HOT_BYTES: usize = 128 << 10;

/// Checks each `chunk`-byte piece of `image` against its sum in `sums`
/// and copies the bytes of it that `targets` (image offset, destination)
/// take into their destinations, in one pass over the image, on up to
/// `threads` threads, each a contiguous run of chunks. Every chunk is
/// checked, whether or not a destination takes bytes of it.
///
/// Each chunk is taken [`HOT_BYTES`] at a time: the block's bytes are
/// copied into their destinations first (the copy streams them from
/// memory), then fed to the chunk's sum from the cache the copy left
/// them in. Summing first and copying after reads memory at the hash's
/// pace and then copies with a second read of the cache; this order
/// costs about one memcpy and a read of the cache (1.2× a memcpy of
/// 256 MiB on two threads, against 1.7× for a whole chunk summed, then
/// copied).
///
/// Returns whether every chunk matched (and there is one sum per chunk,
/// and every target lies inside the image). When one differs, each
/// thread stops after its current chunk, and every destination holds its
/// old bytes, bytes of chunks that matched, or bytes of the chunk that
/// differed (at most one per thread): a mix the caller must overwrite
/// from a verified source or discard, never use. A target outside the
/// image makes it return `false` before anything is copied.
pub(crate) fn check_and_copy(
    image: &[u8],
    chunk: usize,
    sums: &[u64],
    targets: Vec<(u64, &mut [u8])>,
    threads: usize,
) -> bool {
    let chunk = chunk.max(1);
    let n = image.len().div_ceil(chunk);
    if n != sums.len() {
        return false;
    }
    let block = HOT_BYTES.min(chunk);
    let blocks = chunk.div_ceil(block);
    // Every destination cut at block edges, in block order (a piece's
    // first field: its chunk times `blocks`, plus its block in the chunk).
    let mut pieces: Vec<Piece<'_>> = Vec::with_capacity(targets.len() + n);
    for (off, mut dst) in targets {
        let Some(mut at) = usize::try_from(off)
            .ok()
            .filter(|o| o.checked_add(dst.len()).is_some_and(|e| e <= image.len()))
        else {
            return false;
        };
        // Cut at block edges: a block never crosses a chunk's edge.
        while !dst.is_empty() {
            let k = at / chunk;
            let j = (at - k * chunk) / block;
            let end = (k * chunk + (j + 1) * block).min((k + 1) * chunk);
            let take = (end - at).min(dst.len());
            let (head, tail) = std::mem::take(&mut dst).split_at_mut(take);
            pieces.push((k * blocks + j, at, head));
            dst = tail;
            at += take;
        }
    }
    pieces.sort_by_key(|p| p.0);
    let runs = if threads <= 1 || image.len() < PARALLEL_MIN_BYTES || n < 2 {
        1
    } else {
        threads.min(n)
    };
    let per = n.div_ceil(runs);
    // One run per thread: its chunks and the pieces in them.
    let mut work: Vec<(usize, Vec<Piece<'_>>)> = (0..runs).map(|r| (r * per, Vec::new())).collect();
    for p in pieces {
        if let Some(w) = work.get_mut(p.0 / blocks / per) {
            w.1.push(p);
        }
    }
    let differs = AtomicBool::new(false);
    let run = |(first, pieces): (usize, Vec<Piece<'_>>)| {
        let mut pieces = pieces.into_iter().peekable();
        for k in first..(first + per).min(n) {
            if differs.load(Ordering::Relaxed) {
                return;
            }
            let start = k * chunk;
            let end = (start + chunk).min(image.len());
            let mut sum = XxHash3_64::new();
            for (j, from) in (start..end).step_by(block).enumerate() {
                let id = k * blocks + j;
                while let Some((_, at, dst)) = pieces.next_if(|p| p.0 == id) {
                    stream_copy(dst, &image[at..at + dst.len()]);
                }
                sum.write(&image[from..(from + block).min(end)]);
            }
            if sums.get(k) != Some(&sum.finish()) {
                differs.store(true, Ordering::Relaxed);
                return;
            }
        }
    };
    if runs == 1 {
        for w in work {
            run(w);
        }
    } else {
        crate::io::run_on_threads("acp-check", work, run);
    }
    !differs.into_inner()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_copy_is_a_copy_at_every_offset_and_length() {
        // The pieces `stream_copy` streams start at 16 KiB: the lengths
        // below must reach past it, or nothing here streams.
        const MIN: usize = 16 << 10;
        #[cfg(target_arch = "x86_64")]
        assert_eq!(MIN, STREAM_MIN, "the lengths tested must follow STREAM_MIN");
        let src: Vec<u8> = (0..(3 * MIN + 200)).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 63, 64, MIN - 1, MIN, MIN + 65, 3 * MIN] {
            for (s_off, d_off) in [(0, 0), (1, 0), (0, 1), (5, 13), (16, 3), (63, 64)] {
                let mut dst = vec![0xAAu8; len + d_off + 100];
                stream_copy(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                assert_eq!(
                    &dst[d_off..d_off + len],
                    &src[s_off..s_off + len],
                    "{len} {s_off} {d_off}"
                );
                assert!(
                    dst[..d_off].iter().all(|&b| b == 0xAA),
                    "before {len} {s_off} {d_off}"
                );
                assert!(
                    dst[d_off + len..].iter().all(|&b| b == 0xAA),
                    "after {len} {s_off} {d_off}"
                );
            }
        }
    }

    #[test]
    fn a_sum_and_digest_in_one_read_are_the_ones_taken_apart() {
        let data: Vec<u8> = (0..(3 * HOT_BYTES + 77))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        for len in [
            0,
            1,
            1023,
            HOT_BYTES - 1,
            HOT_BYTES,
            HOT_BYTES + 1,
            data.len(),
        ] {
            let bytes = &data[..len];
            assert_eq!(
                sum_then_digest(bytes),
                (fast_sum(bytes), crate::format::digest(bytes)),
                "{len} bytes"
            );
        }
    }

    fn image(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 % 251) as u8).collect()
    }

    fn sums(data: &[u8], chunk: usize) -> Vec<u64> {
        data.chunks(chunk).map(fast_sum).collect()
    }

    #[test]
    fn read_and_sum_reports_the_chunks_that_differ_on_any_thread_count() {
        let data = image((20 << 20) + 123);
        let chunk = 1 << 20;
        let mut s = sums(&data, chunk);
        s[3] ^= 1;
        s[17] ^= 1;
        let src = super::super::MemSource::new(&data, std::path::Path::new("image"));
        for threads in [1, 2, 3, 8] {
            let mut dst = vec![0u8; data.len()];
            // Every chunk but the fifth.
            let chunks: Vec<ChunkDst<'_>> = dst
                .chunks_mut(chunk)
                .enumerate()
                .filter(|(k, _)| *k != 5)
                .map(|(k, d)| (k, (k * chunk) as u64, d))
                .collect();
            let differ = read_and_sum(&src, chunks, &s, threads).unwrap();
            assert_eq!(differ, vec![3, 17], "threads {threads}");
            for (k, (got, want)) in dst.chunks(chunk).zip(data.chunks(chunk)).enumerate() {
                if k == 5 {
                    assert!(got.iter().all(|&b| b == 0), "chunk 5 was not wanted");
                } else {
                    assert_eq!(got, want, "chunk {k}, threads {threads}");
                }
            }
        }
        // A chunk past the sums differs; a read past the source fails.
        let mut one = vec![0u8; chunk];
        let differ = read_and_sum(&src, vec![(99, 0, &mut one[..])], &s, 2).unwrap();
        assert_eq!(differ, vec![99]);
        let past = data.len() as u64;
        assert!(read_and_sum(&src, vec![(0, past, &mut one[..])], &s, 2).is_err());
    }

    /// `dst` (bytes `base..` of an image) cut at `chunk` boundaries into
    /// the chunks [`read_check_copy`] reads, for an image of `len` bytes.
    fn copies(dst: &mut [u8], base: usize, chunk: usize, len: usize) -> Vec<ChunkCopy<'_>> {
        let mut out = Vec::new();
        let (mut at, mut rest) = (base, dst);
        while !rest.is_empty() {
            let k = at / chunk;
            let take = ((k + 1) * chunk - at).min(rest.len());
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(take);
            out.push(ChunkCopy {
                k,
                start: (k * chunk) as u64,
                len: chunk.min(len - k * chunk),
                pieces: vec![(at as u64, head)],
            });
            rest = tail;
            at += take;
        }
        out
    }

    #[test]
    fn read_check_copy_fills_every_piece_and_stops_at_a_chunk_that_differs() {
        let data = image((12 << 20) + 77);
        let chunk = 1 << 20;
        let s = sums(&data, chunk);
        let src = super::super::MemSource::new(&data, std::path::Path::new("image"));
        let (a0, b0) = (2 * chunk + 100, 9 * chunk + 5);
        let (a_len, b_len) = (3 * chunk, data.len() - b0);
        for threads in [1, 2, 3, 8] {
            let (mut a, mut b) = (vec![0u8; a_len], vec![0u8; b_len]);
            let mut chunks = copies(&mut a, a0, chunk, data.len());
            chunks.extend(copies(&mut b, b0, chunk, data.len()));
            assert!(read_check_copy(&src, chunks, &s, threads).unwrap());
            assert_eq!(a, data[a0..a0 + a_len], "threads {threads}");
            assert_eq!(b, data[b0..], "threads {threads}");
        }
        // Small pieces of one chunk, given out of order, some inside one
        // block, some across block edges.
        let spans = [(5000, 300_000), (0, 10), (HOT_BYTES - 3, 6), (20, 4000)];
        let mut bufs: Vec<Vec<u8>> = spans.iter().map(|&(_, n)| vec![0; n]).collect();
        let pieces = spans
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&(at, _), b)| ((chunk + at) as u64, b.as_mut_slice()))
            .collect();
        let one = vec![ChunkCopy {
            k: 1,
            start: chunk as u64,
            len: chunk,
            pieces,
        }];
        assert!(read_check_copy(&src, one, &s, 1).unwrap());
        for (&(at, n), b) in spans.iter().zip(&bufs) {
            assert!(b[..] == data[chunk + at..chunk + at + n], "piece at {at}");
        }
        // A chunk that differs from its sum: every destination byte is old
        // (zero) or the image's, and on one thread nothing after it came.
        let mut bad = s.clone();
        bad[3] ^= 1;
        for threads in [1, 2] {
            let mut a = vec![0u8; a_len];
            let chunks = copies(&mut a, a0, chunk, data.len());
            assert!(!read_check_copy(&src, chunks, &bad, threads).unwrap());
            assert!(a
                .iter()
                .zip(&data[a0..])
                .all(|(&got, &want)| got == 0 || got == want));
            if threads == 1 {
                assert!(a[4 * chunk - a0..].iter().all(|&x| x == 0));
            }
        }
        // A piece outside its chunk is refused, never copied.
        let mut one = [0u8; 10];
        let wrong = vec![ChunkCopy {
            k: 0,
            start: 0,
            len: chunk,
            pieces: vec![(chunk as u64 - 5, &mut one[..])],
        }];
        assert!(!read_check_copy(&src, wrong, &s, 1).unwrap());
        // A read past the source fails.
        let past = vec![ChunkCopy {
            k: 0,
            start: data.len() as u64,
            len: chunk,
            pieces: Vec::new(),
        }];
        assert!(read_check_copy(&src, past, &s, 1).is_err());
    }

    #[test]
    fn matching_sums_pass_on_any_thread_count() {
        let data = image((20 << 20) + 123);
        let s = sums(&data, 1 << 20);
        for threads in [1, 2, 3, 8] {
            assert!(sums_match(&data, 1 << 20, &s, threads), "threads {threads}");
        }
    }

    #[test]
    fn any_changed_byte_fails_on_any_thread_count() {
        let mut data = image((20 << 20) + 123);
        let s = sums(&data, 1 << 20);
        for at in [0, 1 << 20, (13 << 20) + 7, data.len() - 1] {
            data[at] ^= 1;
            for threads in [1, 2, 3, 8] {
                assert!(
                    !sums_match(&data, 1 << 20, &s, threads),
                    "byte {at}, threads {threads}"
                );
            }
            data[at] ^= 1;
        }
    }

    #[test]
    fn a_count_that_is_not_the_chunks_fails() {
        let data = image(3 << 20);
        let s = sums(&data, 1 << 20);
        assert!(!sums_match(&data, 1 << 20, &s[..2], 2));
        assert!(!sums_match(&data[..2 << 20], 1 << 20, &s, 2));
    }

    /// Targets over `data`: pieces crossing chunk edges, one inside a
    /// chunk, one empty, one at the end, given out of order.
    fn places(len: usize) -> Vec<(usize, usize)> {
        vec![
            (len - 1000, 1000),
            (0, 3 << 20),
            ((5 << 20) + 17, 9 << 20),
            ((3 << 20) + 5, 100),
            (4 << 20, 0),
        ]
    }

    fn fused(data: &[u8], s: &[u64], threads: usize) -> (bool, Vec<Vec<u8>>) {
        let mut bufs: Vec<Vec<u8>> = places(data.len())
            .iter()
            .map(|&(_, n)| vec![0xAA; n])
            .collect();
        let targets = places(data.len())
            .iter()
            .zip(bufs.iter_mut())
            .map(|(&(at, _), b)| (at as u64, b.as_mut_slice()))
            .collect();
        let ok = check_and_copy(data, 1 << 20, s, targets, threads);
        (ok, bufs)
    }

    #[test]
    fn fused_check_copies_every_target_when_all_match() {
        let data = image((20 << 20) + 123);
        let s = sums(&data, 1 << 20);
        for threads in [1, 2, 3, 8] {
            let (ok, bufs) = fused(&data, &s, threads);
            assert!(ok, "threads {threads}");
            for (&(at, n), b) in places(data.len()).iter().zip(&bufs) {
                assert!(b[..] == data[at..at + n], "threads {threads}, at {at}");
            }
        }
    }

    #[test]
    fn fused_check_stops_at_a_chunk_that_differs() {
        let mut data = image((20 << 20) + 123);
        let s = sums(&data, 1 << 20);
        // A byte of chunk 7 (in its second copy block), inside the third
        // target.
        data[(7 << 20) + HOT_BYTES + 9] ^= 1;
        for threads in [1, 2, 3, 8] {
            let (ok, bufs) = fused(&data, &s, threads);
            assert!(!ok, "threads {threads}");
            let (at, n) = places(data.len())[2];
            let b = &bufs[2];
            assert_eq!(b.len(), n);
            // Each byte holds its old value or the image's.
            for (j, &v) in b.iter().enumerate() {
                assert!(
                    v == 0xAA || v == data[at + j],
                    "byte {j}, threads {threads}"
                );
            }
            if threads == 1 {
                // One run: nothing after chunk 7 arrived.
                assert!(b[(8 << 20) - at..].iter().all(|&v| v == 0xAA));
            }
        }
    }

    #[test]
    fn fused_check_sums_blocks_as_one_chunk_sum() {
        // Chunks that are not a whole number of blocks, a last chunk
        // shorter than a block, and targets cut at every block edge.
        let chunk = (3 * HOT_BYTES) / 2 + 4096;
        let data = image(5 * chunk + 1000);
        let s = sums(&data, chunk);
        for threads in [1, 2] {
            let mut dst = vec![0u8; data.len() - 3];
            let ok = check_and_copy(&data, chunk, &s, vec![(3, dst.as_mut_slice())], threads);
            assert!(ok, "threads {threads}");
            assert!(dst[..] == data[3..]);
        }
    }

    #[test]
    fn fused_check_refuses_a_target_outside_the_image() {
        let data = image(3 << 20);
        let s = sums(&data, 1 << 20);
        let mut b = [0u8; 10];
        assert!(!check_and_copy(
            &data,
            1 << 20,
            &s,
            vec![((3 << 20) - 5, &mut b[..])],
            2
        ));
        assert!(b.iter().all(|&v| v == 0));
        assert!(!check_and_copy(&data, 1 << 20, &s[..2], Vec::new(), 2));
    }
}
