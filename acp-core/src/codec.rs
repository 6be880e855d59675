//! The chunk codec of compressed data files: byte grouping by element
//! width, then zstd per byte plane.
//!
//! A chunk of a data image is described by *runs*: consecutive byte ranges
//! each of one element width (1, 2, 4 or 8 bytes; header bytes and 1-byte
//! dtypes are width 1). Byte `k` of every element of every run of width
//! `w` goes into the plane `(w, k)`: a bf16 chunk has two planes (the low
//! mantissa byte and the sign/exponent byte), an fp32 chunk four, fp64
//! eight. Bytes of one significance compress far better together than
//! interleaved (the exponent bytes of trained weights take few values).
//! Each plane is compressed with zstd on its own, and stored raw when that
//! does not make it smaller. Grouping is a permutation of the chunk's
//! bytes, so decoding is bit-exact whatever the bytes are.
//!
//! # Levels
//!
//! A plane of float bytes has almost no repeated strings: what shrinks is
//! the skew of its byte histogram (exponent bytes take few values), which
//! zstd's Huffman coding of literals captures. Level 1, the default, is
//! therefore a literal-first profile ([`LITERAL_FIRST`]): zstd's fast
//! strategy with a small hash table and matches of at least 7 bytes (so
//! the match finder costs little and finds only real repeats, such as
//! zeroed or constant regions), and Huffman-coded literals forced on.
//! On bf16 weights from normal(0, 0.02) it is about 3× faster than zstd's
//! own level 1 and a little smaller (matches of 3 to 6 exponent bytes cost
//! more than they save). Levels 2 to 19 are zstd's own levels, slower, for
//! data with long repeats. Whatever the level, frames are plain zstd
//! frames: the decoder needs no parameters.
//!
//! # Frame layout
//!
//! A frame encodes one chunk and decodes on its own (all integers
//! little-endian):
//!
//! ```text
//! u32 R                          the number of runs, 1..=MAX_RUNS
//! R × { u8 width, u32 len }      width in {1, 2, 4, 8}; len a multiple of width
//! P × { u8 mode, u32 stored }    one per plane, in order of (width, byte) for
//!                                the widths present; mode 0 = raw, 1 = zstd;
//!                                stored = the bytes that follow for it
//! P × plane bytes                back to back, in the same order
//! ```
//!
//! The lengths of the runs add up to the chunk's length, which the caller
//! knows (from the file's frame table, checked against the index) and
//! passes to [`decode`]: nothing in a frame can make the decoder write past
//! it, a raw plane must have exactly its plane's length, and a zstd plane
//! is decompressed into a buffer of exactly its plane's length and must
//! fill it, so a frame crafted to expand (a "zip bomb") fails instead of
//! allocating.

use crate::error::{Error, Result};

/// The element widths a run may have.
pub const WIDTHS: [u8; 4] = [1, 2, 4, 8];

/// The most runs one frame may list (a chunk holds at most this many
/// distinct width changes; acp's layout, widest first, has at most four).
pub const MAX_RUNS: u32 = 1 << 16;

/// The level that selects the literal-first profile (see "Levels").
pub const LITERAL_FIRST: i32 = 1;

/// A zstd compression context set up for `level` (see "Levels").
fn compressor(level: i32) -> std::result::Result<zstd::zstd_safe::CCtx<'static>, String> {
    use zstd::zstd_safe::{CCtx, CParameter, ParamSwitch, Strategy};
    let mut cx = CCtx::try_create().ok_or("zstd cannot allocate a context")?;
    let params: &[CParameter] = if level <= LITERAL_FIRST {
        &[
            CParameter::CompressionLevel(1),
            CParameter::Strategy(Strategy::ZSTD_fast),
            CParameter::HashLog(10),
            CParameter::MinMatch(7),
            CParameter::TargetLength(64),
            CParameter::LiteralCompressionMode(ParamSwitch::Enable),
            CParameter::ChecksumFlag(false),
        ]
    } else {
        &[
            CParameter::CompressionLevel(level),
            CParameter::ChecksumFlag(false),
        ]
    };
    for p in params {
        cx.set_parameter(*p)
            .map_err(|c| format!("zstd refuses {p:?}: {}", zstd::zstd_safe::get_error_name(c)))?;
    }
    Ok(cx)
}

/// Writes byte `k` of each element of `bytes` to `dsts[k]` (one
/// destination per byte of a `dsts.len()`-byte element, each of
/// `bytes.len() / dsts.len()` bytes).
fn split(bytes: &[u8], dsts: &mut [&mut [u8]]) {
    match dsts {
        [a] => a.copy_from_slice(bytes),
        [a, b] => {
            let done = simd::split2(bytes, a, b);
            for ((e, x), y) in bytes[2 * done..]
                .chunks_exact(2)
                .zip(a[done..].iter_mut())
                .zip(b[done..].iter_mut())
            {
                *x = e[0];
                *y = e[1];
            }
        }
        [a, b, c, d] => {
            let done = simd::split4(bytes, [a, b, c, d]);
            for ((((e, x), y), z), t) in bytes[4 * done..]
                .chunks_exact(4)
                .zip(a[done..].iter_mut())
                .zip(b[done..].iter_mut())
                .zip(c[done..].iter_mut())
                .zip(d[done..].iter_mut())
            {
                *x = e[0];
                *y = e[1];
                *z = e[2];
                *t = e[3];
            }
        }
        _ => {
            let w = dsts.len();
            for (i, e) in bytes.chunks_exact(w).enumerate() {
                for (d, &x) in dsts.iter_mut().zip(e) {
                    d[i] = x;
                }
            }
        }
    }
}

/// Writes `srcs[k][i]` to byte `k` of element `i` of `out` (`srcs` has
/// one slice per byte of a `srcs.len()`-byte element, each of
/// `out.len() / srcs.len()` bytes).
fn merge(out: &mut [u8], srcs: &[&[u8]]) {
    match srcs {
        [a] => out.copy_from_slice(a),
        [a, b] => {
            let done = simd::merge2(out, a, b);
            for ((e, &x), &y) in out[2 * done..]
                .chunks_exact_mut(2)
                .zip(&a[done..])
                .zip(&b[done..])
            {
                e[0] = x;
                e[1] = y;
            }
        }
        // Each element is assembled in a register and stored whole: byte
        // stores of four or eight planes do not vectorise, and cost about
        // 2.5 times as much.
        [a, b, c, d] => {
            let done = simd::merge4(out, [a, b, c, d]);
            for ((((e, &x), &y), &z), &t) in out[4 * done..]
                .chunks_exact_mut(4)
                .zip(&a[done..])
                .zip(&b[done..])
                .zip(&c[done..])
                .zip(&d[done..])
            {
                e.copy_from_slice(&[x, y, z, t]);
            }
        }
        [a, b, c, d, f, g, h, k] => {
            for (i, e) in out.chunks_exact_mut(8).enumerate() {
                e.copy_from_slice(&[a[i], b[i], c[i], d[i], f[i], g[i], h[i], k[i]]);
            }
        }
        _ => {
            for (i, e) in out.chunks_exact_mut(srcs.len()).enumerate() {
                for (b, s) in e.iter_mut().zip(srcs) {
                    *b = s[i];
                }
            }
        }
    }
}

/// Interleaving byte planes 16 elements at a time with SSE2's unpack
/// instructions (part of every x86-64 CPU), and taking them apart: a
/// decoded fp32 chunk's four planes merge several times as fast as
/// element by element. Elsewhere nothing is done here and [`merge`]'s and
/// [`split`]'s loops do it all.
mod simd {
    /// Writes the first `16 * k` elements of `out` from the planes `a`
    /// and `b` (2-byte elements) and returns how many it wrote.
    #[cfg(target_arch = "x86_64")]
    #[expect(unsafe_code, reason = "SSE2 intrinsics over checked ranges")]
    pub(super) fn merge2(out: &mut [u8], a: &[u8], b: &[u8]) -> usize {
        use std::arch::x86_64::{
            _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpacklo_epi8,
        };
        let n = blocks(out.len() / 2, [a.len(), b.len()]);
        for i in (0..n).step_by(16) {
            let (x, y) = (&a[i..i + 16], &b[i..i + 16]);
            let o = &mut out[2 * i..2 * i + 32];
            // SAFETY: SSE2 is part of x86-64, so the intrinsics exist on
            // every CPU this runs on. `x` and `y` are 16 bytes and `o` 32
            // (sliced above, so bounds-checked); the unaligned loads and
            // stores read and write exactly those bytes.
            unsafe {
                let (x, y) = (
                    _mm_loadu_si128(x.as_ptr().cast()),
                    _mm_loadu_si128(y.as_ptr().cast()),
                );
                let o = o.as_mut_ptr();
                _mm_storeu_si128(o.cast(), _mm_unpacklo_epi8(x, y));
                _mm_storeu_si128(o.add(16).cast(), _mm_unpackhi_epi8(x, y));
            }
        }
        n
    }

    /// Writes the first `16 * k` elements of `out` from the four planes
    /// of 4-byte elements and returns how many it wrote.
    #[cfg(target_arch = "x86_64")]
    #[expect(unsafe_code, reason = "SSE2 intrinsics over checked ranges")]
    pub(super) fn merge4(out: &mut [u8], planes: [&[u8]; 4]) -> usize {
        use std::arch::x86_64::{
            _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi16, _mm_unpackhi_epi8,
            _mm_unpacklo_epi16, _mm_unpacklo_epi8,
        };
        let [a, b, c, d] = planes;
        let n = blocks(out.len() / 4, [a.len(), b.len(), c.len(), d.len()]);
        for i in (0..n).step_by(16) {
            let (pa, pb, pc, pd) = (&a[i..i + 16], &b[i..i + 16], &c[i..i + 16], &d[i..i + 16]);
            let o = &mut out[4 * i..4 * i + 64];
            // SAFETY: as in `merge2`: SSE2 is part of x86-64; each plane
            // slice is 16 bytes and `o` 64, bounds-checked above, and the
            // unaligned loads and stores touch exactly those bytes.
            unsafe {
                let va = _mm_loadu_si128(pa.as_ptr().cast());
                let vb = _mm_loadu_si128(pb.as_ptr().cast());
                let vc = _mm_loadu_si128(pc.as_ptr().cast());
                let vd = _mm_loadu_si128(pd.as_ptr().cast());
                // a0 b0 a1 b1 ..., c0 d0 c1 d1 ...: then pairs of those
                // pairs are whole elements a_i b_i c_i d_i.
                let (ab_lo, ab_hi) = (_mm_unpacklo_epi8(va, vb), _mm_unpackhi_epi8(va, vb));
                let (cd_lo, cd_hi) = (_mm_unpacklo_epi8(vc, vd), _mm_unpackhi_epi8(vc, vd));
                let o = o.as_mut_ptr();
                _mm_storeu_si128(o.cast(), _mm_unpacklo_epi16(ab_lo, cd_lo));
                _mm_storeu_si128(o.add(16).cast(), _mm_unpackhi_epi16(ab_lo, cd_lo));
                _mm_storeu_si128(o.add(32).cast(), _mm_unpacklo_epi16(ab_hi, cd_hi));
                _mm_storeu_si128(o.add(48).cast(), _mm_unpackhi_epi16(ab_hi, cd_hi));
            }
        }
        n
    }

    /// The inverse of [`merge2`]: byte 0 and byte 1 of the first `16 * k`
    /// elements of `bytes` into `a` and `b`; returns how many elements.
    #[cfg(target_arch = "x86_64")]
    #[expect(unsafe_code, reason = "SSE2 intrinsics over checked ranges")]
    pub(super) fn split2(bytes: &[u8], a: &mut [u8], b: &mut [u8]) -> usize {
        use std::arch::x86_64::{
            _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi8, _mm_unpacklo_epi8,
        };
        let n = blocks(bytes.len() / 2, [a.len(), b.len()]);
        for i in (0..n).step_by(16) {
            let src = &bytes[2 * i..2 * i + 32];
            let (pa, pb) = (&mut a[i..i + 16], &mut b[i..i + 16]);
            // SAFETY: SSE2 is part of x86-64. `src` is 32 bytes and each
            // plane slice 16, bounds-checked above; the unaligned loads
            // and stores touch exactly those bytes.
            unsafe {
                let v0 = _mm_loadu_si128(src.as_ptr().cast());
                let v1 = _mm_loadu_si128(src.as_ptr().add(16).cast());
                // Four rounds of the perfect shuffle take 16 interleaved
                // pairs apart.
                let (t0, t1) = (_mm_unpacklo_epi8(v0, v1), _mm_unpackhi_epi8(v0, v1));
                let (u0, u1) = (_mm_unpacklo_epi8(t0, t1), _mm_unpackhi_epi8(t0, t1));
                let (w0, w1) = (_mm_unpacklo_epi8(u0, u1), _mm_unpackhi_epi8(u0, u1));
                _mm_storeu_si128(pa.as_mut_ptr().cast(), _mm_unpacklo_epi8(w0, w1));
                _mm_storeu_si128(pb.as_mut_ptr().cast(), _mm_unpackhi_epi8(w0, w1));
            }
        }
        n
    }

    /// The inverse of [`merge4`]: the first `16 * k` 4-byte elements of
    /// `bytes` into the four planes; returns how many elements.
    #[cfg(target_arch = "x86_64")]
    #[expect(unsafe_code, reason = "SSE2 intrinsics over checked ranges")]
    pub(super) fn split4(bytes: &[u8], planes: [&mut &mut [u8]; 4]) -> usize {
        use std::arch::x86_64::{
            _mm_loadu_si128, _mm_storeu_si128, _mm_unpackhi_epi64, _mm_unpackhi_epi8,
            _mm_unpacklo_epi64, _mm_unpacklo_epi8,
        };
        let [a, b, c, d] = planes;
        let n = blocks(bytes.len() / 4, [a.len(), b.len(), c.len(), d.len()]);
        for i in (0..n).step_by(16) {
            let src = &bytes[4 * i..4 * i + 64];
            let (pa, pb) = (&mut a[i..i + 16], &mut b[i..i + 16]);
            let (pc, pd) = (&mut c[i..i + 16], &mut d[i..i + 16]);
            // SAFETY: as in `split2`: SSE2 is part of x86-64; `src` is 64
            // bytes and each plane slice 16, bounds-checked above, and the
            // unaligned loads and stores touch exactly those bytes.
            unsafe {
                let p = src.as_ptr();
                let v0 = _mm_loadu_si128(p.cast());
                let v1 = _mm_loadu_si128(p.add(16).cast());
                let v2 = _mm_loadu_si128(p.add(32).cast());
                let v3 = _mm_loadu_si128(p.add(48).cast());
                // Three rounds of byte unpacks leave each half of `w*`
                // eight bytes of one plane: w0 = planes 0|1 of elements
                // 0-7, w1 = planes 2|3 of 0-7, w2 and w3 the same of 8-15.
                let (t0, t1) = (_mm_unpacklo_epi8(v0, v1), _mm_unpackhi_epi8(v0, v1));
                let (t2, t3) = (_mm_unpacklo_epi8(v2, v3), _mm_unpackhi_epi8(v2, v3));
                let (u0, u1) = (_mm_unpacklo_epi8(t0, t1), _mm_unpackhi_epi8(t0, t1));
                let (u2, u3) = (_mm_unpacklo_epi8(t2, t3), _mm_unpackhi_epi8(t2, t3));
                let (w0, w1) = (_mm_unpacklo_epi8(u0, u1), _mm_unpackhi_epi8(u0, u1));
                let (w2, w3) = (_mm_unpacklo_epi8(u2, u3), _mm_unpackhi_epi8(u2, u3));
                _mm_storeu_si128(pa.as_mut_ptr().cast(), _mm_unpacklo_epi64(w0, w2));
                _mm_storeu_si128(pb.as_mut_ptr().cast(), _mm_unpackhi_epi64(w0, w2));
                _mm_storeu_si128(pc.as_mut_ptr().cast(), _mm_unpacklo_epi64(w1, w3));
                _mm_storeu_si128(pd.as_mut_ptr().cast(), _mm_unpackhi_epi64(w1, w3));
            }
        }
        n
    }

    /// The elements the vector loops take: the fewest of `elements` and
    /// the planes' lengths, rounded down to whole blocks of 16.
    #[cfg(target_arch = "x86_64")]
    fn blocks<const N: usize>(elements: usize, planes: [usize; N]) -> usize {
        planes.into_iter().fold(elements, usize::min) / 16 * 16
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub(super) fn split2(_: &[u8], _: &mut [u8], _: &mut [u8]) -> usize {
        0
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub(super) fn split4(_: &[u8], _: [&mut &mut [u8]; 4]) -> usize {
        0
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub(super) fn merge2(_: &mut [u8], _: &[u8], _: &[u8]) -> usize {
        0
    }

    #[cfg(not(target_arch = "x86_64"))]
    pub(super) fn merge4(_: &mut [u8], _: [&[u8]; 4]) -> usize {
        0
    }
}

/// Plane mode: the plane's bytes as they are.
const MODE_RAW: u8 = 0;
/// Plane mode: the plane compressed by zstd.
const MODE_ZSTD: u8 = 1;

/// One byte range of a chunk whose elements are `width` bytes wide.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    /// Element width in bytes: 1, 2, 4 or 8.
    pub width: u8,
    /// Length in bytes, a multiple of `width`.
    pub len: u32,
}

/// What encoding a chunk did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncodeStats {
    /// Planes written compressed.
    pub zstd_planes: u32,
    /// Planes written raw (zstd did not make them smaller).
    pub raw_planes: u32,
}

/// Plane index of byte `k` of width `w` in the fixed order (1,0) (2,0)
/// (2,1) (4,0) .. (8,7): `w - 1 + k`.
fn plane_slot(width: u8, k: u8) -> usize {
    usize::from(width) - 1 + usize::from(k)
}

/// The 15 plane lengths a run list gives (0 for planes of absent widths).
fn plane_lens(runs: &[Run]) -> [usize; 15] {
    let mut lens = [0usize; 15];
    for r in runs {
        let n = r.len as usize / usize::from(r.width);
        for k in 0..r.width {
            lens[plane_slot(r.width, k)] += n;
        }
    }
    lens
}

/// Checks a run list against the chunk length `len`.
fn check_runs(runs: &[Run], len: usize) -> std::result::Result<(), String> {
    if runs.is_empty() || runs.len() > MAX_RUNS as usize {
        return Err(format!("{} runs, not 1..={MAX_RUNS}", runs.len()));
    }
    let mut sum = 0usize;
    for (i, r) in runs.iter().enumerate() {
        if !WIDTHS.contains(&r.width) {
            return Err(format!("run {i} has element width {}", r.width));
        }
        if r.len % u32::from(r.width) != 0 {
            return Err(format!(
                "run {i} of {} bytes is not whole elements of {}",
                r.len, r.width
            ));
        }
        sum = sum.saturating_add(r.len as usize);
    }
    if sum != len {
        return Err(format!("runs cover {sum} bytes of a {len}-byte chunk"));
    }
    Ok(())
}

/// The planes present, in frame order: `(width, k)`.
fn planes_present(runs: &[Run]) -> Vec<(u8, u8)> {
    WIDTHS
        .iter()
        .filter(|w| runs.iter().any(|r| r.width == **w))
        .flat_map(|&w| (0..w).map(move |k| (w, k)))
        .collect()
}

/// Encodes `chunk`, laid out as `runs`, at zstd `level`, appending the
/// frame to `out`.
///
/// # Errors
/// [`Error::Invalid`] naming `what` when `runs` do not tile `chunk` with
/// whole elements of a width in [`WIDTHS`], or the chunk is 4 GiB or more.
pub fn encode(
    what: &str,
    chunk: &[u8],
    runs: &[Run],
    level: i32,
    out: &mut Vec<u8>,
) -> Result<EncodeStats> {
    if u32::try_from(chunk.len()).is_err() {
        return Err(Error::invalid(what, "a chunk of 4 GiB or more"));
    }
    check_runs(runs, chunk.len()).map_err(|r| Error::invalid(what, r))?;
    let lens = plane_lens(runs);
    ENCODE.with(|cell| {
        let mut cached = cell.borrow_mut();
        let (memory, scratch) = &mut *cached;
        // The planes, back to back in this thread's memory (they add up to
        // the chunk): fresh memory costs a page fault per page per chunk.
        // Every byte of it is written below (the planes tile the chunk).
        if memory.len() < chunk.len() {
            memory.resize(chunk.len(), 0);
        }
        let mut planes: Vec<&mut [u8]> = Vec::with_capacity(lens.len());
        let mut rest = &mut memory[..chunk.len()];
        for &n in &lens {
            let (plane, tail) = std::mem::take(&mut rest).split_at_mut(n);
            planes.push(plane);
            rest = tail;
        }
        let mut filled = [0usize; 15];
        let mut at = 0usize;
        for r in runs {
            let bytes = &chunk[at..at + r.len as usize];
            let n = r.len as usize / usize::from(r.width);
            let first = plane_slot(r.width, 0);
            let mut dsts: Vec<&mut [u8]> = planes[first..first + usize::from(r.width)]
                .iter_mut()
                .zip(&filled[first..])
                .map(|(p, &f)| &mut p[f..f + n])
                .collect();
            split(bytes, &mut dsts);
            for f in &mut filled[first..first + usize::from(r.width)] {
                *f += n;
            }
            at += r.len as usize;
        }
        let planes: Vec<&[u8]> = planes.into_iter().map(|p| &*p).collect();
        let stats = encode_all(what, runs, level, &planes, out, scratch);
        let_go_if_large(memory);
        let_go_if_large(scratch);
        stats
    })
}

/// The frame of a chunk laid out as `runs`, split into `planes` (by plane
/// slot), appended to `out`; `scratch` takes each plane's compressed bytes.
fn encode_all(
    what: &str,
    runs: &[Run],
    level: i32,
    planes: &[&[u8]],
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) -> Result<EncodeStats> {
    out.extend_from_slice(&(runs.len() as u32).to_le_bytes());
    for r in runs {
        out.push(r.width);
        out.extend_from_slice(&r.len.to_le_bytes());
    }
    let present = planes_present(runs);
    let table_at = out.len();
    out.resize(table_at + present.len() * 5, 0);
    let mut stats = EncodeStats::default();
    CCTX.with(|cell| -> Result<()> {
        let mut cached = cell.borrow_mut();
        if cached.as_ref().is_none_or(|(l, _)| *l != level) {
            *cached = Some((
                level,
                compressor(level).map_err(|r| Error::invalid(what, r))?,
            ));
        }
        let Some((_, cx)) = cached.as_mut() else {
            return Err(Error::invalid(what, "no zstd context (a bug in acp)"));
        };
        encode_planes(out, table_at, &present, planes, cx, scratch, &mut stats);
        Ok(())
    })?;
    Ok(stats)
}

// This thread's memory for a chunk's planes and for a plane's compressed
// bytes, kept between chunks (up to `KEEP_SCRATCH_BYTES` each).
thread_local! {
    static ENCODE: std::cell::RefCell<(Vec<u8>, Vec<u8>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

// This thread's zstd context and the level it is set for: a context costs
// an allocation of its tables, and a flush encodes many chunks.
thread_local! {
    static CCTX: std::cell::RefCell<Option<(i32, zstd::zstd_safe::CCtx<'static>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Compresses each of the `present` planes into `out`, filling their
/// entries of the table at `table_at`.
fn encode_planes(
    out: &mut Vec<u8>,
    table_at: usize,
    present: &[(u8, u8)],
    planes: &[&[u8]],
    cx: &mut zstd::zstd_safe::CCtx<'static>,
    scratch: &mut Vec<u8>,
    stats: &mut EncodeStats,
) {
    for (p, &(w, k)) in present.iter().enumerate() {
        let plane = planes[plane_slot(w, k)];
        // A buffer one byte short of the plane: zstd fails when its output
        // would not be smaller, and the plane is then stored raw.
        let packed = match plane.len() {
            0 => None,
            _ if looks_random(plane) => None,
            n => cx.compress2(scratch_slice(scratch, n - 1), plane).ok(),
        };
        let (mode, stored) = match packed {
            Some(m) if m < plane.len() => {
                out.extend_from_slice(&scratch[..m]);
                stats.zstd_planes += 1;
                (MODE_ZSTD, m)
            }
            _ => {
                out.extend_from_slice(plane);
                stats.raw_planes += 1;
                (MODE_RAW, plane.len())
            }
        };
        let e = table_at + p * 5;
        out[e] = mode;
        // Every plane is at most the chunk, which fits a u32 (checked above).
        out[e + 1..e + 5].copy_from_slice(&(stored as u32).to_le_bytes());
    }
}

/// The order-0 entropy, in bits per byte, above which a plane is stored
/// raw without trying zstd.
const RANDOM_BITS: f64 = 7.9;

/// The blocks [`looks_random`] counts, and how many bytes of a plane it
/// counts at most: a histogram of 256 KiB estimates the order-0 entropy
/// of a plane within a thousandth of a bit per byte (the plug-in
/// estimator's bias is about 255 / (2 n ln 2) bits), so a plane of
/// megabytes needs no more to be judged.
const SAMPLE_BLOCK: usize = 4096;
const SAMPLE_BYTES: usize = 256 << 10;

/// Whether `plane` (at least 64 KiB) has so even a byte histogram that
/// zstd could not shrink it by more than about 1%: the low mantissa bytes
/// of floats look so. Skipping zstd on them is most of the codec's speed
/// on trained weights. The histogram is of evenly spaced 4 KiB blocks,
/// [`SAMPLE_BYTES`] in all (the whole plane when smaller). A plane whose
/// counted blocks look random but whose others do not (rare in tensors:
/// their bytes are alike along a tensor), or whose bytes are all equally
/// frequent but repeat in long runs, is then stored raw: still correct,
/// only larger.
fn looks_random(plane: &[u8]) -> bool {
    if plane.len() < 64 << 10 {
        return false;
    }
    let stride = (plane.len() / SAMPLE_BYTES).max(1);
    // Four histograms, so that runs of one byte value (the exponent
    // bytes of weights) do not wait on one counter's previous update.
    let mut four = [[0u64; 256]; 4];
    let mut n = 0usize;
    for block in plane.chunks(SAMPLE_BLOCK).step_by(stride) {
        n += block.len();
        let mut quads = block.chunks_exact(4);
        for q in &mut quads {
            four[0][usize::from(q[0])] += 1;
            four[1][usize::from(q[1])] += 1;
            four[2][usize::from(q[2])] += 1;
            four[3][usize::from(q[3])] += 1;
        }
        for &b in quads.remainder() {
            four[0][usize::from(b)] += 1;
        }
    }
    let mut counts = [0u64; 256];
    for (i, c) in counts.iter_mut().enumerate() {
        *c = four[0][i] + four[1][i] + four[2][i] + four[3][i];
    }
    let n = n as f64;
    let bits: f64 = counts
        .iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.log2()
        })
        .sum();
    bits > RANDOM_BITS
}

/// The first `n` bytes of `v` (grown when shorter), for zstd to write into.
fn scratch_slice(v: &mut Vec<u8>, n: usize) -> &mut [u8] {
    // Grown (zeroed) once; later planes reuse its bytes as they are, which
    // zstd overwrites.
    if v.len() < n {
        v.resize(n, 0);
    }
    &mut v[..n]
}

/// A reader of little-endian fields of an untrusted frame.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.bytes.len())
            .ok_or_else(|| {
                format!(
                    "the frame ends at byte {} inside a field of {n} bytes at {}",
                    self.bytes.len(),
                    self.at
                )
            })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> std::result::Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> std::result::Result<u32, String> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// Where a frame's planes are, from its tables (see "Frame layout"),
/// checked against the chunk's length before anything is decoded.
struct Parsed<'f> {
    runs: Vec<Run>,
    /// Each plane slot's raw bytes in the frame, or its place in the
    /// decoding scratch (a zstd plane).
    at_frame: [(usize, usize); 15],
    at_scratch: [Option<(usize, usize)>; 15],
    /// The zstd planes: `(width, byte, compressed bytes, scratch offset,
    /// decoded length)`.
    packed: Vec<(u8, u8, &'f [u8], usize, usize)>,
    scratch_len: usize,
}

/// Parses `frame`'s tables for a chunk of `len` bytes: the runs must tile
/// it, each plane's stored bytes must be in the frame (a raw plane of
/// exactly its length), and nothing may follow the last plane.
fn parse(frame: &[u8], len: usize) -> std::result::Result<Parsed<'_>, String> {
    let mut c = Cursor {
        bytes: frame,
        at: 0,
    };
    let nruns = c.u32()?;
    if nruns == 0 || nruns > MAX_RUNS {
        return Err(format!("{nruns} runs, not 1..={MAX_RUNS}"));
    }
    // Each run takes 5 bytes of the frame: the count is bounded by the
    // frame before anything is allocated for it.
    if (nruns as usize).saturating_mul(5) > frame.len() {
        return Err(format!(
            "{nruns} runs do not fit a frame of {} bytes",
            frame.len()
        ));
    }
    let mut runs = Vec::with_capacity(nruns as usize);
    for _ in 0..nruns {
        let width = c.u8()?;
        let len = c.u32()?;
        runs.push(Run { width, len });
    }
    check_runs(&runs, len)?;
    let lens = plane_lens(&runs);
    let present = planes_present(&runs);
    let mut modes = Vec::with_capacity(present.len());
    for _ in &present {
        let mode = c.u8()?;
        let stored = c.u32()? as usize;
        modes.push((mode, stored));
    }
    // Where each plane's bytes are: a raw plane in the frame itself (never
    // copied), a zstd plane in the decoding thread's scratch.
    let mut p = Parsed {
        runs: Vec::new(),
        at_frame: [(0usize, 0usize); 15],
        at_scratch: [None::<(usize, usize)>; 15],
        packed: Vec::with_capacity(present.len()),
        scratch_len: 0,
    };
    for (&(w, k), &(mode, stored)) in present.iter().zip(&modes) {
        let slot = plane_slot(w, k);
        let want = lens[slot];
        let start = c.at;
        let bytes = c.take(stored)?;
        match mode {
            MODE_RAW if stored == want => p.at_frame[slot] = (start, start + stored),
            MODE_RAW => {
                return Err(format!(
                    "raw plane {k} of width {w} holds {stored} bytes, not {want}"
                ))
            }
            MODE_ZSTD => {
                p.at_scratch[slot] = Some((p.scratch_len, p.scratch_len + want));
                p.packed.push((w, k, bytes, p.scratch_len, want));
                // Planes add up to the chunk (the runs tile it).
                p.scratch_len += want;
            }
            m => return Err(format!("plane {k} of width {w} has unknown mode {m}")),
        }
    }
    if c.at != frame.len() {
        return Err(format!("{} bytes after the last plane", frame.len() - c.at));
    }
    p.runs = runs;
    Ok(p)
}

/// Decompresses the zstd planes `packed` (of [`Parsed`]) into `scratch`
/// with `dctx`; each must fill exactly its decoded length.
fn unpack(
    dctx: &mut zstd::zstd_safe::DCtx<'_>,
    packed: &[(u8, u8, &[u8], usize, usize)],
    scratch: &mut [u8],
) -> std::result::Result<(), String> {
    for &(w, k, bytes, at, want) in packed {
        let n = dctx
            .decompress(&mut scratch[at..at + want], bytes)
            .map_err(|c| {
                format!(
                    "plane {k} of width {w}: zstd: {}",
                    zstd::zstd_safe::get_error_name(c)
                )
            })?;
        if n != want {
            return Err(format!(
                "plane {k} of width {w} decodes to {n} bytes, not {want}"
            ));
        }
    }
    Ok(())
}

/// This thread's zstd decoding context (made on first use).
fn with_decoder<T>(
    f: impl FnOnce(&mut zstd::zstd_safe::DCtx<'static>, &mut Vec<u8>) -> std::result::Result<T, String>,
) -> std::result::Result<T, String> {
    DECODE.with(|cell| {
        let mut cached = cell.borrow_mut();
        let (dctx, scratch) = &mut *cached;
        if dctx.is_none() {
            *dctx = zstd::zstd_safe::DCtx::try_create();
        }
        let Some(dctx) = dctx.as_mut() else {
            return Err("zstd cannot allocate a decoding context".to_owned());
        };
        let out = f(dctx, scratch);
        let_go_if_large(scratch);
        out
    })
}

/// Decodes `frame` into `dst`, whose length is the chunk's (known to the
/// caller, never taken from the frame). Never writes past `dst` and never
/// allocates more than `dst.len()` beside it.
///
/// # Errors
/// A description of what is wrong with the frame (the caller names the
/// file and chunk): a run table that does not tile `dst`, a plane whose
/// stored or decoded length is not its own, bytes left over, or zstd's
/// refusal.
pub fn decode(frame: &[u8], dst: &mut [u8]) -> std::result::Result<(), String> {
    let p = parse(frame, dst.len())?;
    with_decoder(|dctx, scratch| {
        if scratch.len() < p.scratch_len {
            scratch.resize(p.scratch_len, 0);
        }
        unpack(dctx, &p.packed, scratch)?;
        let plane = |slot: usize| -> &[u8] {
            match p.at_scratch[slot] {
                Some((s, e)) => &scratch[s..e],
                None => &frame[p.at_frame[slot].0..p.at_frame[slot].1],
            }
        };
        let mut taken = [0usize; 15];
        let mut at = 0usize;
        for r in &p.runs {
            let len = r.len as usize;
            let out = &mut dst[at..at + len];
            let n = len / usize::from(r.width);
            let mut srcs: [&[u8]; 8] = [&[]; 8];
            for k in 0..r.width {
                let slot = plane_slot(r.width, k);
                srcs[usize::from(k)] = &plane(slot)[taken[slot]..taken[slot] + n];
                taken[slot] += n;
            }
            merge(out, &srcs[..usize::from(r.width)]);
            at += len;
        }
        Ok(())
    })
}

/// The bytes of the first run of the chunk `frame` encodes (a chunk of
/// `len` bytes), when that run is of width 1, decoding the one plane of
/// width 1 and none of the others: a data file's first chunk begins with
/// its header, which a load's planning reads. `None` when the first run
/// is wider.
///
/// # Errors
/// As [`decode`], for the frame's tables and its plane of width 1.
pub fn decode_lead(frame: &[u8], len: usize) -> std::result::Result<Option<Vec<u8>>, String> {
    let p = parse(frame, len)?;
    let first = match p.runs.first() {
        Some(r) if r.width == 1 => r.len as usize,
        _ => return Ok(None),
    };
    let slot = plane_slot(1, 0);
    if p.at_scratch[slot].is_none() {
        let (s, _) = p.at_frame[slot];
        return Ok(Some(frame[s..s + first].to_vec()));
    }
    let Some(&(w, k, bytes, _, want)) = p.packed.iter().find(|z| (z.0, z.1) == (1, 0)) else {
        return Err("no plane of width 1 for a run of width 1".to_owned());
    };
    let mut plane = vec![0u8; want];
    with_decoder(|dctx, _| unpack(dctx, &[(w, k, bytes, 0, want)], &mut plane))?;
    plane.truncate(first);
    Ok(Some(plane))
}

/// The most plane scratch a thread keeps between frames (four default
/// chunks): larger chunks allocate their scratch per frame.
const KEEP_SCRATCH_BYTES: usize = 16 << 20;

/// Frees a thread's kept buffer `v` when it grew past
/// [`KEEP_SCRATCH_BYTES`] for an unusually large chunk.
fn let_go_if_large(v: &mut Vec<u8>) {
    if v.capacity() > KEEP_SCRATCH_BYTES {
        *v = Vec::new();
    }
}

// This thread's zstd decoding context and the scratch its zstd planes are
// decoded into before their bytes are merged: a context costs an
// allocation of its tables, and fresh scratch costs a page fault per page
// for every frame.
thread_local! {
    static DECODE: std::cell::RefCell<(Option<zstd::zstd_safe::DCtx<'static>>, Vec<u8>)> =
        const { std::cell::RefCell::new((None, Vec::new())) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(chunk: &[u8], runs: &[Run]) -> (Vec<u8>, EncodeStats) {
        let mut frame = Vec::new();
        let stats = encode("t", chunk, runs, 3, &mut frame).unwrap();
        let mut back = vec![0xAA; chunk.len()];
        decode(&frame, &mut back).unwrap();
        assert_eq!(back, chunk);
        (frame, stats)
    }

    /// bf16 values near zero, as trained weights: the exponent plane is
    /// low-entropy, the mantissa plane is not.
    fn bf16_weights(n: usize) -> Vec<u8> {
        let mut s = 0x2545_F491_4F6C_DD1Du64;
        let mut out = Vec::with_capacity(n * 2);
        for _ in 0..n {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // A small value: sign and exponent around 2^-6, random mantissa.
            let v = f32::from_bits(0x3C00_0000 | ((s as u32) & 0x807F_FFFF)) * 0.5;
            out.extend_from_slice(&v.to_bits().to_le_bytes()[2..4]);
        }
        out
    }

    #[test]
    fn grouped_bf16_shrinks_and_round_trips() {
        let chunk = bf16_weights(32 * 1024);
        let (frame, stats) = roundtrip(
            &chunk,
            &[Run {
                width: 2,
                len: chunk.len() as u32,
            }],
        );
        assert!(
            frame.len() < chunk.len() * 3 / 4,
            "{} of {}",
            frame.len(),
            chunk.len()
        );
        assert_eq!(stats.zstd_planes + stats.raw_planes, 2, "two planes");
        assert!(stats.zstd_planes >= 1, "the exponent plane shrinks");
    }

    #[test]
    fn the_literal_first_level_shrinks_exponent_planes_as_well_as_level_3() {
        let chunk = bf16_weights(256 * 1024);
        let runs = [Run {
            width: 2,
            len: chunk.len() as u32,
        }];
        let size = |level| {
            let mut frame = Vec::new();
            encode("t", &chunk, &runs, level, &mut frame).unwrap();
            let mut back = vec![0u8; chunk.len()];
            decode(&frame, &mut back).unwrap();
            assert_eq!(back, chunk, "level {level}");
            frame.len()
        };
        let (fast, l3) = (size(LITERAL_FIRST), size(3));
        assert!(fast <= l3 + l3 / 50, "level 1: {fast} bytes, level 3: {l3}");
    }

    #[test]
    fn incompressible_planes_are_stored_raw() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let chunk: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        let (frame, stats) = roundtrip(
            &chunk,
            &[Run {
                width: 1,
                len: 4096,
            }],
        );
        assert_eq!(
            stats,
            EncodeStats {
                zstd_planes: 0,
                raw_planes: 1
            }
        );
        assert_eq!(frame.len(), 4 + 5 + 5 + 4096);
    }

    /// `n` bytes of a xorshift stream: random to the randomness test.
    fn xorshift_bytes(n: usize) -> Vec<u8> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    }

    #[test]
    fn a_random_plane_skips_zstd_and_a_skewed_one_does_not() {
        let random = xorshift_bytes(1 << 17);
        assert!(looks_random(&random));
        let skewed: Vec<u8> = random.iter().map(|b| b & 0x1F).collect();
        assert!(!looks_random(&skewed));
        assert!(
            !looks_random(&random[..1000]),
            "small planes are always tried"
        );
    }

    #[test]
    fn a_large_plane_is_judged_by_spread_samples() {
        // 2 MiB: random bytes, then from a quarter on the skewed bytes of
        // an exponent plane. Samples only at the start would call it
        // random; spread over the plane they see that it is not.
        let mut plane = xorshift_bytes(2 << 20);
        assert!(looks_random(&plane));
        assert!(looks_random(&plane[..SAMPLE_BYTES]));
        for b in &mut plane[512 << 10..] {
            *b &= 0x07;
        }
        assert!(!looks_random(&plane));
        // Whatever the judgement, the frame round-trips.
        roundtrip(
            &plane,
            &[Run {
                width: 1,
                len: plane.len() as u32,
            }],
        );
    }

    #[test]
    fn merge_interleaves_planes_at_every_length() {
        // The vector part (16 elements at a time) and the element tail
        // agree with a byte-by-byte interleave, for every length around
        // the vector's.
        for width in [2usize, 4, 8] {
            for n in 0..80 {
                let planes: Vec<Vec<u8>> = (0..width)
                    .map(|k| (0..n).map(|i| (i * 7 + k * 64 + 1) as u8).collect())
                    .collect();
                let srcs: Vec<&[u8]> = planes.iter().map(Vec::as_slice).collect();
                let mut out = vec![0xEE; n * width];
                merge(&mut out, &srcs);
                let want: Vec<u8> = (0..n)
                    .flat_map(|i| planes.iter().map(move |p| p[i]))
                    .collect();
                assert_eq!(out, want, "width {width}, {n} elements");
            }
        }
    }

    #[test]
    fn split_takes_planes_apart_at_every_length() {
        for width in [2usize, 4, 8] {
            for n in 0..80 {
                let bytes: Vec<u8> = (0..n * width).map(|i| (i * 13 + 5) as u8).collect();
                let mut planes = vec![vec![0xEEu8; n]; width];
                let mut dsts: Vec<&mut [u8]> = planes.iter_mut().map(Vec::as_mut_slice).collect();
                split(&bytes, &mut dsts);
                for (k, p) in planes.iter().enumerate() {
                    let want: Vec<u8> = bytes.iter().skip(k).step_by(width).copied().collect();
                    assert_eq!(p, &want, "width {width}, {n} elements, plane {k}");
                }
            }
        }
    }

    #[test]
    fn mixed_widths_round_trip() {
        let chunk: Vec<u8> = (0..(24 + 16 + 8 + 3) as u32).map(|i| i as u8).collect();
        let runs = [
            Run { width: 8, len: 24 },
            Run { width: 4, len: 16 },
            Run { width: 2, len: 8 },
            Run { width: 1, len: 3 },
        ];
        roundtrip(&chunk, &runs);
    }

    #[test]
    fn runs_that_do_not_tile_the_chunk_are_refused() {
        let chunk = [0u8; 8];
        let mut out = Vec::new();
        for runs in [
            &[Run { width: 2, len: 6 }][..],
            &[Run { width: 4, len: 6 }, Run { width: 1, len: 2 }][..],
            &[Run { width: 3, len: 6 }, Run { width: 1, len: 2 }][..],
            &[][..],
        ] {
            assert!(encode("t", &chunk, runs, 3, &mut out).is_err(), "{runs:?}");
        }
    }

    #[test]
    fn a_frame_that_expands_past_its_chunk_is_refused() {
        // A plane of 1 MiB of zeros compresses to a few bytes; a frame that
        // claims it for a 4 KiB chunk must fail, not allocate 1 MiB.
        let big = vec![0u8; 1 << 20];
        let z = zstd::bulk::compress(&big, 3).unwrap();
        let mut frame = Vec::new();
        frame.extend_from_slice(&1u32.to_le_bytes());
        frame.push(1);
        frame.extend_from_slice(&4096u32.to_le_bytes());
        frame.push(MODE_ZSTD);
        frame.extend_from_slice(&(z.len() as u32).to_le_bytes());
        frame.extend_from_slice(&z);
        let mut dst = vec![0u8; 4096];
        let err = decode(&frame, &mut dst).unwrap_err();
        assert!(err.contains("zstd"), "{err}");
    }

    #[test]
    fn hostile_frames_are_errors() {
        let chunk = bf16_weights(2048);
        let mut frame = Vec::new();
        encode(
            "t",
            &chunk,
            &[Run {
                width: 2,
                len: 4096,
            }],
            3,
            &mut frame,
        )
        .unwrap();
        let mut dst = vec![0u8; 4096];
        // Every truncation, and a byte flipped at every offset, is an error
        // or (a flip in a raw plane) different bytes: never a panic.
        for cut in 0..frame.len() {
            assert!(decode(&frame[..cut], &mut dst).is_err(), "cut at {cut}");
        }
        for i in 0..frame.len() {
            let mut f = frame.clone();
            f[i] ^= 0x5A;
            let _ = decode(&f, &mut dst);
        }
        // A run count far past the frame allocates nothing.
        let mut f = frame.clone();
        f[..4].copy_from_slice(&MAX_RUNS.to_le_bytes());
        assert!(decode(&f, &mut dst).unwrap_err().contains("do not fit"));
        // Bytes past the last plane.
        let mut f = frame.clone();
        f.push(0);
        assert!(decode(&f, &mut dst)
            .unwrap_err()
            .contains("after the last plane"));
        // A chunk length other than the frame's.
        assert!(decode(&frame, &mut vec![0u8; 4094]).is_err());
    }

    #[test]
    fn a_header_run_is_decoded_alone_and_checked_like_a_whole_frame() {
        // A first chunk: header bytes (width 1, compressible text), then
        // fp32 values.
        let header: Vec<u8> = b"{\"t\":{\"dtype\":\"F32\"}}    ".repeat(40);
        let values = xorshift_bytes(4096);
        let chunk = [header.clone(), values].concat();
        let runs = [
            Run {
                width: 1,
                len: header.len() as u32,
            },
            Run {
                width: 4,
                len: 4096,
            },
        ];
        let mut frame = Vec::new();
        encode("t", &chunk, &runs, LITERAL_FIRST, &mut frame).unwrap();
        assert_eq!(decode_lead(&frame, chunk.len()).unwrap(), Some(header));
        // The frame's tables must still tile the chunk and hold every
        // plane: a truncated frame or another length is refused.
        for cut in 0..frame.len() {
            assert!(
                decode_lead(&frame[..cut], chunk.len()).is_err(),
                "cut at {cut}"
            );
        }
        assert!(decode_lead(&frame, chunk.len() - 4).is_err());
    }

    fn arb_chunk() -> impl Strategy<Value = (Vec<u8>, Vec<Run>)> {
        // Runs of each dtype width in any order, with elements that are
        // random or drawn from a few values (so zstd sees both cases).
        let run = (
            prop::sample::select(crate::format::Dtype::ALL.to_vec()),
            0usize..300,
            any::<bool>(),
        );
        prop::collection::vec(run, 1..6)
            .prop_flat_map(|runs| {
                let total: usize = runs.iter().map(|(d, n, _)| d.size() * n).sum();
                let lows: Vec<bool> = runs.iter().map(|r| r.2).collect();
                let runs: Vec<Run> = runs
                    .iter()
                    .map(|(d, n, _)| Run {
                        width: d.size() as u8,
                        len: (d.size() * n) as u32,
                    })
                    .collect();
                (
                    prop::collection::vec(any::<u8>(), total),
                    Just(runs),
                    Just(lows),
                )
            })
            .prop_map(|(mut bytes, runs, lows)| {
                let mut at = 0;
                for (r, low) in runs.iter().zip(lows) {
                    if low {
                        for b in &mut bytes[at..at + r.len as usize] {
                            *b &= 0x3;
                        }
                    }
                    at += r.len as usize;
                }
                (bytes, runs)
            })
    }

    proptest! {
        #[test]
        fn every_dtype_round_trips_bit_exact(
            (chunk, runs) in arb_chunk(),
            level in prop::sample::select(vec![LITERAL_FIRST, 2, 19]),
        ) {
            let mut frame = Vec::new();
            encode("t", &chunk, &runs, level, &mut frame).unwrap();
            let mut back = vec![0u8; chunk.len()];
            decode(&frame, &mut back).unwrap();
            prop_assert_eq!(back, chunk);
        }

        #[test]
        fn arbitrary_frames_never_panic(frame in prop::collection::vec(any::<u8>(), 0..200), len in 0usize..512) {
            let mut dst = vec![0u8; len];
            let _ = decode(&frame, &mut dst);
            let _ = decode_lead(&frame, len);
        }

        #[test]
        fn the_lead_is_the_first_run_of_width_1_decoded_alone(
            (chunk, runs) in arb_chunk(),
            level in prop::sample::select(vec![LITERAL_FIRST, 19]),
        ) {
            let mut frame = Vec::new();
            encode("t", &chunk, &runs, level, &mut frame).unwrap();
            let lead = decode_lead(&frame, chunk.len()).unwrap();
            match runs.first() {
                Some(r) if r.width == 1 => {
                    prop_assert_eq!(lead.as_deref(), Some(&chunk[..r.len as usize]));
                }
                _ => prop_assert!(lead.is_none()),
            }
        }
    }
}
