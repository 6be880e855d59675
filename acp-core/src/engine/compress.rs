//! Compressed flushes: whether a flush compresses ([`Compress`]), and
//! writing a sealed image as a container data file (the layout is in
//! [`format`](crate::format), "Compressed data file"): each chunk a
//! compressed or stored frame, or, for a chunk an incremental flush
//! reuses ([`PackMode::reuse`]), a reference frame with no bytes.
//!
//! The frames are encoded by the flush, never by the save's stall: up to
//! `copy_threads` named threads take the image's chunks in order, digest
//! each (over the plain bytes, as a plain flush does), encode it and take
//! the frame's own check. The flush's own thread gathers the frames as
//! they come, in chunk order, into page-aligned pieces (at least a chunk),
//! and [`WRITERS`] writer threads write the pieces, so that one piece's
//! write overlaps the next one's (as a plain flush keeps several writes in
//! flight) while later chunks are encoded: the file is streamed, not
//! assembled in memory. Memory is bounded: at most `2 × threads` chunks
//! are handed out beyond the next one to gather, and `WRITERS + 1` piece
//! buffers of a piece plus a chunk exist, written in whole 4096-byte
//! blocks (`O_DIRECT`, as a plain flush, where the file system allows
//! it). The head and frame table, whose size the chunk count fixes, are
//! reserved at the start of the file and written last, once every piece
//! is written, with the first block they share with the frames; a crash
//! before the fsync leaves a file of a pending step, which no reader
//! opens.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;
use std::sync::{mpsc, Mutex};
use std::time::Instant;

use super::state::Shared;
use crate::config::Compress;
use crate::error::{Error, Result};
use crate::format::{
    chunk_runs, encode_frame, packed_frames_start, packed_head_of, parse_header, quick_frame_check,
    Digest, FrameCodec, FrameEntry,
};
use crate::io::{IoStats, StreamWriter};

/// This engine's measurements for [`Compress::Auto`], in plain bytes per
/// second (and compressed over plain bytes).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Rates {
    write: Option<f64>,
    compress: Option<f64>,
    ratio: Option<f64>,
}

#[cfg(feature = "test-util")]
impl super::Engine {
    /// The compressed over plain bytes [`Compress::Auto`] last measured,
    /// on the chunks a compressed flush wrote (tests only).
    #[must_use]
    pub fn auto_ratio(&self) -> Option<f64> {
        self.shared().lock().rates.ratio
    }
}

impl Rates {
    /// Whether the next flush compresses under `mode`.
    pub(super) fn choose(&self, mode: Compress) -> bool {
        match mode {
            Compress::None => false,
            Compress::Zstd => true,
            Compress::Auto => match (self.write, self.compress, self.ratio) {
                // The first flush measures the storage, the second the codec.
                (None, _, _) => false,
                (Some(_), None, _) | (Some(_), _, None) => true,
                (Some(w), Some(c), Some(r)) => 1.0 / c + r / w < 1.0 / w,
            },
        }
    }

    /// A plain flush wrote `bytes` in `secs`.
    pub(super) fn plain(&mut self, bytes: u64, secs: f64) {
        if let Some(r) = rate(bytes, secs) {
            self.write = Some(r);
        }
    }

    /// A compressed flush encoded `plain` bytes into `stored` in
    /// `encode_secs`, and wrote them in `write_secs`.
    pub(super) fn packed(&mut self, plain: u64, stored: u64, encode_secs: f64, write_secs: f64) {
        if let Some(r) = rate(plain, encode_secs) {
            self.compress = Some(r);
        }
        if let Some(r) = rate(stored, write_secs) {
            self.write = Some(r);
        }
        if plain > 0 {
            self.ratio = Some(stored as f64 / plain as f64);
        }
    }
}

fn rate(bytes: u64, secs: f64) -> Option<f64> {
    (bytes > 0 && secs > 0.0).then(|| bytes as f64 / secs)
}

/// What a compressed flush did.
#[derive(Debug)]
pub(super) struct Packed {
    /// The digests of the plain image's chunks.
    pub(super) digests: Vec<Digest>,
    /// The RAM tier's quick sums of the same chunks ([`crate::read::fast_sum`]).
    pub(super) sums: Vec<u64>,
    /// The compressed file's length.
    pub(super) stored: u64,
    /// The write's figures.
    pub(super) stats: IoStats,
}

/// How [`write_packed`] makes each frame.
#[derive(Clone, Copy)]
pub(super) struct PackMode<'a> {
    /// Whether a chunk that is written is compressed (else stored).
    pub(super) compress: bool,
    /// Chunks not written, by index (`true`): each becomes a reference
    /// frame. Shorter than the chunk count means the rest are written.
    pub(super) reuse: &'a [bool],
    /// The chunks' digests and quick sums, when already taken: each
    /// chunk must still give its sum as it is written.
    pub(super) pre: Option<(&'a [Digest], &'a [u64])>,
    /// Without `pre`: the quick sums a RAM snapshot was summed with
    /// (`hash.rs`), which each chunk must still give as it is hashed.
    pub(super) summed: Option<&'a [u64]>,
    /// The ring slot holding the image, named when a chunk changed since
    /// `pre` or `summed` was taken.
    pub(super) slot: usize,
    /// Called before each chunk is encoded: waits while the step's
    /// replica exchange runs (`Store::yield_to_exchange`).
    pub(super) pause: &'a (dyn Fn() + Sync),
}

/// One encoded chunk: (chunk, quick sum, plain digest, frame, the frame's
/// table entry, seconds spent encoding it).
type Encoded = (usize, u64, Digest, Vec<u8>, FrameEntry, f64);

/// Pieces written at once by a compressed flush.
const WRITERS: usize = 2;

/// A piece handed to a writer thread: its buffer, the bytes of it to
/// write, and where they go in the file.
type Piece = (memmap2::MmapMut, usize, u64);

/// A piece back from a writer thread: its buffer, and the seconds the
/// write took or its error.
type Written = (memmap2::MmapMut, Result<f64>);

/// The smallest piece written at once.
const MIN_PIECE: usize = 1 << 20;

/// `n` rounded up to 4096.
fn round_block(n: usize) -> usize {
    n.div_ceil(4096) * 4096
}

/// Writes `image` (a sealed slot's plain image) to `file` (fresh, at
/// `path`) as a container data file in `chunk`-byte chunks, each chunk a
/// frame as `mode` says (compressed, stored, or a reference), and fsyncs
/// it. Each encoded and each written chunk is noted as the flush's
/// progress, for the watchdog.
///
/// # Errors
/// [`Error::Corrupt`] for an image whose header does not parse; the
/// storage's errors; [`Error::Io`] when a worker thread cannot start;
/// [`Error::Invalid`] when one fails (a bug in acp).
pub(super) fn write_packed(
    shared: &Shared,
    file: &File,
    path: &Path,
    image: &[u8],
    chunk: usize,
    mode: PackMode<'_>,
) -> Result<Packed> {
    let len = image.len() as u64;
    let header = parse_header(path, image, len)?;
    let level = shared.cfg.compress_level;
    let chunk = chunk.max(1);
    let n = image.len().div_ceil(chunk);
    let workers = shared.cfg.copy_threads.clamp(1, n.max(1));
    let window = (2 * workers).min(n);
    let what = path.display().to_string();
    let t_flush = Instant::now();

    // Bytes [0, reserved) hold the head and table; the frames follow.
    let frames_start = packed_frames_start(n as u64);
    let reserved = usize::try_from(frames_start)
        .map_err(|_| Error::invalid(path.display(), "a frame table too large for memory"))?;
    // Pieces are written in whole chunks (`chunk` is the I/O chunk, a
    // multiple of 4096), the storage's unit as for a plain file.
    let head_blocks = round_block(reserved);
    let piece = round_block(chunk.max(MIN_PIECE)).max(head_blocks);
    let stage_len = (piece + chunk + 4096) as u64;
    let mut stage = super::load::heap(stage_len, path)?;
    let mut spare: Vec<memmap2::MmapMut> = Vec::with_capacity(WRITERS);
    for _ in 0..WRITERS {
        spare.push(super::load::heap(stage_len, path)?);
    }
    let out = StreamWriter::start(file, path, &shared.io_opts, len)?;
    // The file offset of `stage[0]`, and the bytes of `stage` in use.
    let (mut base, mut fill) = (0u64, reserved);
    // The file's first blocks (those the head and table touch), kept when
    // they are first written so that the head can be put in front of the
    // frames they hold.
    let mut first: Option<memmap2::MmapMut> = None;
    let mut entries: Vec<FrameEntry> = Vec::with_capacity(n);
    let mut digests: Vec<Digest> = Vec::with_capacity(n);
    let mut sums: Vec<u64> = Vec::with_capacity(n);
    let mut encode_secs = 0.0f64;
    // Each writer thread's seconds spent writing: with the storage the
    // slower side, each is busy for about the whole write.
    let mut write_secs = [0.0f64; WRITERS + 1];

    // The workers take chunk numbers from here; the sender is moved into
    // the scope, so that any way out of it ends the workers' loops.
    let (job_tx, job_rx) = mpsc::channel::<usize>();
    let job_rx = Mutex::new(job_rx);
    // Pieces go to the writer threads from here, as `job_tx`.
    let (piece_tx, piece_rx) = mpsc::channel::<Piece>();
    let piece_rx = Mutex::new(piece_rx);
    std::thread::scope(|s| -> Result<()> {
        let job_tx = job_tx;
        let piece_tx = piece_tx;
        let (written_tx, written_rx) = mpsc::channel::<(usize, Written)>();
        for w in 0..WRITERS {
            let (out, piece_rx, written_tx) = (&out, &piece_rx, written_tx.clone());
            std::thread::Builder::new()
                .name(format!("acp-pack-write-{w}"))
                .spawn_scoped(s, move || loop {
                    let next = match piece_rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => break,
                    };
                    let Ok((buf, n, at)) = next else { break };
                    let t = Instant::now();
                    let r = out.write_at(&buf[..n], at);
                    let r = r.map(|()| t.elapsed().as_secs_f64());
                    if written_tx.send((w, (buf, r))).is_err() {
                        break;
                    }
                })
                .map_err(|e| Error::io("start a writer thread for", path, e))?;
        }
        drop(written_tx);
        let mut writing = 0usize;
        // Takes back one written piece: its buffer, or its write's error.
        let mut take_back = |writing: &mut usize| -> Result<memmap2::MmapMut> {
            let (w, (buf, r)) = written_rx
                .recv()
                .map_err(|_| Error::invalid(path.display(), "the writer threads stopped early"))?;
            *writing -= 1;
            write_secs[w] += r?;
            Ok(buf)
        };
        let (done_tx, done_rx) = mpsc::channel::<Result<Encoded>>();
        for w in 0..workers {
            let (header, what, job_rx, done_tx) = (&header, &what, &job_rx, done_tx.clone());
            std::thread::Builder::new()
                .name(format!("acp-compress-{w}"))
                .spawn_scoped(s, move || loop {
                    let next = match job_rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => break,
                    };
                    let Ok(i) = next else { break };
                    (mode.pause)();
                    let t = Instant::now();
                    let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        let start = i * chunk;
                        let bytes = &image[start..(start + chunk).min(image.len())];
                        let (frame, codec) = if mode.reuse.get(i) == Some(&true) {
                            (Vec::new(), FrameCodec::Reference)
                        } else if mode.compress {
                            let runs =
                                chunk_runs(header, start as u64, (start + bytes.len()) as u64);
                            encode_frame(what, bytes, &runs, level)?
                        } else {
                            (bytes.to_vec(), FrameCodec::Stored)
                        };
                        let (sum, dig) = match mode.pre {
                            // Taken before: the bytes must still give the
                            // sum taken with the digest.
                            Some((_, s)) if s.get(i) != Some(&crate::read::fast_sum(bytes)) => {
                                return Err(super::flush::changed_since_hashed(
                                    shared, mode.slot, i,
                                ));
                            }
                            Some((d, s)) => (s[i], d[i]),
                            // The quick sum before the digest, as in a
                            // plain flush (`read/fast.rs` says why).
                            None => {
                                let (sum, d) = crate::read::sum_then_digest(bytes);
                                if mode.summed.is_some_and(|s| s.get(i) != Some(&sum)) {
                                    return Err(super::flush::changed_since_hashed(
                                        shared, mode.slot, i,
                                    ));
                                }
                                (sum, d)
                            }
                        };
                        let entry = FrameEntry {
                            stored: frame.len() as u64,
                            // A stored frame is its chunk, and a reference
                            // frame's check is the chunk's plain digest:
                            // both are `dig`, taken once.
                            check: if codec == FrameCodec::GroupedZstd {
                                quick_frame_check(&frame)
                            } else {
                                dig
                            },
                            codec,
                        };
                        Ok((i, sum, dig, frame, entry, t.elapsed().as_secs_f64()))
                    }))
                    .unwrap_or_else(|_| {
                        Err(Error::invalid(
                            what.as_str(),
                            "a compression thread panicked (a bug in acp)",
                        ))
                    });
                    shared.note_progress(format!("compressing {what} (chunk {i})"));
                    if done_tx.send(encoded).is_err() {
                        break;
                    }
                })
                .map_err(|e| Error::io("start a compression thread for", path, e))?;
        }
        drop(done_tx);
        for i in 0..window {
            // The workers hold the receiver until this scope ends.
            let _ = job_tx.send(i);
        }
        let mut handed = window;
        let mut pending: BTreeMap<usize, Encoded> = BTreeMap::new();
        while entries.len() < n {
            let next = entries.len();
            let Some(e) = pending.remove(&next) else {
                let got = done_rx.recv().map_err(|_| {
                    Error::invalid(path.display(), "the compression threads stopped early")
                })??;
                pending.insert(got.0, got);
                continue;
            };
            let (_, sum, dig, frame, entry, secs) = e;
            encode_secs += secs;
            stage[fill..fill + frame.len()].copy_from_slice(&frame);
            fill += frame.len();
            entries.push(entry);
            digests.push(dig);
            sums.push(sum);
            drop(frame);
            if handed < n {
                let _ = job_tx.send(handed);
                handed += 1;
            }
            if fill >= piece {
                let whole = fill / chunk * chunk;
                if base == 0 {
                    let mut keep = super::load::heap(head_blocks as u64, path)?;
                    keep[..head_blocks].copy_from_slice(&stage[..head_blocks]);
                    first = Some(keep);
                }
                let mut fresh = match spare.pop() {
                    Some(b) => b,
                    None => take_back(&mut writing)?,
                };
                fresh[..fill - whole].copy_from_slice(&stage[whole..fill]);
                let full = std::mem::replace(&mut stage, fresh);
                // The writers hold the receiver until this scope ends.
                let _ = piece_tx.send((full, whole, base));
                writing += 1;
                shared.note_progress(format!("writing {what} (compressed, chunk {next})"));
                base += whole as u64;
                fill -= whole;
            }
        }
        drop(piece_tx);
        while writing > 0 {
            take_back(&mut writing)?;
        }
        Ok(())
    })?;

    let stored = base + fill as u64;
    let head = packed_head_of(len, chunk as u64, &entries);
    let t = Instant::now();
    match first.as_mut() {
        None => {
            stage[..head.len()].copy_from_slice(&head);
            out.write_at(&stage[..round_block(fill)], 0)?;
        }
        Some(keep) => {
            out.write_at(&stage[..round_block(fill)], base)?;
            keep[..head.len()].copy_from_slice(&head);
            out.write_at(&keep[..head_blocks], 0)?;
        }
    }
    let stats = out.finish(stored)?;
    write_secs[WRITERS] += t.elapsed().as_secs_f64();
    let write_secs =
        write_secs[..WRITERS].iter().copied().fold(0.0, f64::max) + write_secs[WRITERS];
    // The encoding's own rate: its busy time spread over the workers (the
    // flush's wall time when the storage is the faster side).
    let encode_wall = (encode_secs / workers as f64).min(t_flush.elapsed().as_secs_f64());
    // Measured on the chunks written, not those an earlier step holds
    // (reference frames, no bytes): counted in, reused chunks made every
    // incremental step look compressible, and `Compress::Auto` never
    // chose plain for bytes that do not shrink.
    let written: u64 = (0..n)
        .filter(|&i| mode.reuse.get(i) != Some(&true))
        .map(|i| (image.len() - i * chunk).min(chunk) as u64)
        .sum();
    if mode.compress && written > 0 {
        shared.lock().rates.packed(
            written,
            stored.saturating_sub(frames_start),
            encode_wall,
            write_secs,
        );
    }
    Ok(Packed {
        digests,
        sums,
        stored,
        stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_measures_the_storage_then_the_codec_then_compares() {
        let mut r = Rates::default();
        assert!(!r.choose(Compress::None));
        assert!(r.choose(Compress::Zstd));
        assert!(
            !r.choose(Compress::Auto),
            "first: plain, to measure the storage"
        );
        r.plain(200 << 20, 1.0);
        assert!(
            r.choose(Compress::Auto),
            "second: compressed, to measure the codec"
        );
        // Slow storage (200 MB/s), fast codec (1 GB/s), ratio 0.7:
        // 1/1000 + 0.7/200 < 1/200.
        r.packed(1000 << 20, 700 << 20, 1.0, 3.5);
        assert!(r.choose(Compress::Auto));
        // Fast storage (4 GB/s): compressing costs more than it saves.
        r.plain(4000 << 20, 1.0);
        assert!(!r.choose(Compress::Auto));
    }
}
