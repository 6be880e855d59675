//! Compressed flushes: whether a flush compresses ([`Compress`]), and
//! writing a sealed image as a compressed data file (the layout is in
//! [`format`](crate::format), "Compressed data file").
//!
//! The frames are encoded by the flush, never by the save's stall: the
//! image's chunks are shared out among up to `copy_threads` named threads,
//! each of which digests its chunks (over the plain bytes, as a plain
//! flush does) and encodes them. The file (head, table, frames) is then
//! written through the [`IoEngine`](crate::io::IoEngine) from page-aligned
//! memory, like a plain image, and fsynced. The frames are held in memory
//! until they are written: at most the image's size (a frame is never
//! longer than its chunk).

use std::fs::File;
use std::path::Path;
use std::time::Instant;

use super::state::Shared;
use crate::config::Compress;
use crate::error::{Error, Result};
use crate::format::{
    chunk_runs, digest, encode_frame, packed_head, parse_header, Digest, FrameCodec,
};
use crate::io::IoStats;

/// This engine's measurements for [`Compress::Auto`], in plain bytes per
/// second (and compressed over plain bytes).
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Rates {
    write: Option<f64>,
    compress: Option<f64>,
    ratio: Option<f64>,
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

/// One worker's encoded chunks: (chunk, quick sum, plain digest, frame,
/// codec).
type Encoded = Vec<(usize, u64, Digest, Vec<u8>, FrameCodec)>;

/// Writes `image` (a sealed slot's plain image) to `file` (fresh, at
/// `path`) as a compressed data file in `chunk`-byte chunks, and fsyncs
/// it. Each encoded chunk is noted as the flush's progress, for the
/// watchdog.
///
/// # Errors
/// [`Error::Corrupt`] for an image whose header does not parse; the
/// I/O engine's errors; [`Error::Io`] when a worker thread cannot start.
pub(super) fn write_packed(
    shared: &Shared,
    file: &File,
    path: &Path,
    image: &[u8],
    chunk: usize,
) -> Result<Packed> {
    let len = image.len() as u64;
    let header = parse_header(path, image, len)?;
    let level = shared.cfg.compress_level;
    let n = image.len().div_ceil(chunk.max(1));
    let workers = shared.cfg.copy_threads.clamp(1, n.max(1));
    let t_encode = Instant::now();
    let what = path.display().to_string();
    let mut parts: Vec<Encoded> = Vec::with_capacity(workers);
    std::thread::scope(|s| -> Result<()> {
        let mut handles = Vec::with_capacity(workers);
        for w in 0..workers {
            let (header, what) = (&header, &what);
            let h = std::thread::Builder::new()
                .name(format!("acp-compress-{w}"))
                .spawn_scoped(s, move || -> Result<Encoded> {
                    let mut out = Vec::new();
                    for i in (w..n).step_by(workers) {
                        let start = i * chunk;
                        let bytes = &image[start..(start + chunk).min(image.len())];
                        let runs = chunk_runs(header, start as u64, (start + bytes.len()) as u64);
                        let (frame, codec) = encode_frame(what, bytes, &runs, level)?;
                        // The quick sum before the digest, as in a plain
                        // flush (`read/fast.rs` says why).
                        let sum = crate::read::fast_sum(bytes);
                        out.push((i, sum, digest(bytes), frame, codec));
                        // The watchdog sees the encoding progress.
                        shared.note_progress(format!("compressing {what} (chunk {i})"));
                    }
                    Ok(out)
                })
                .map_err(|e| Error::io("start a compression thread for", path, e))?;
            handles.push(h);
        }
        for h in handles {
            let part = h.join().map_err(|_| {
                Error::invalid(
                    path.display(),
                    "a compression thread panicked (a bug in acp)",
                )
            })??;
            parts.push(part);
        }
        Ok(())
    })?;
    let mut frames: Vec<(usize, u64, Digest, Vec<u8>, FrameCodec)> =
        parts.into_iter().flatten().collect();
    frames.sort_unstable_by_key(|f| f.0);
    let encode_secs = t_encode.elapsed().as_secs_f64();
    shared.note_progress(format!("writing {} (compressed)", path.display()));

    let refs: Vec<(&[u8], FrameCodec)> = frames.iter().map(|f| (&f.3[..], f.4)).collect();
    let head = packed_head(len, chunk as u64, &refs);
    let stored = head.len() as u64 + frames.iter().map(|f| f.3.len() as u64).sum::<u64>();
    // Page-aligned memory, so the write can use O_DIRECT like a plain one.
    let mut buf = super::load::heap(stored, path)?;
    let mut at = head.len();
    buf[..at].copy_from_slice(&head);
    for f in &frames {
        buf[at..at + f.3.len()].copy_from_slice(&f.3);
        at += f.3.len();
    }
    let t_write = Instant::now();
    let stats = shared
        .io
        .write_to(file, path, &buf, stored, &shared.io_opts, &mut |i, _| {
            shared.note_progress(format!(
                "writing {} (compressed, piece {i})",
                path.display()
            ));
            Ok(())
        })?;
    let write_secs = t_write.elapsed().as_secs_f64();
    shared
        .lock()
        .rates
        .packed(len, stored, encode_secs, write_secs);
    Ok(Packed {
        sums: frames.iter().map(|f| f.1).collect(),
        digests: frames.into_iter().map(|f| f.2).collect(),
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
