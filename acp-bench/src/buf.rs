//! Pre-faulted page-aligned buffers and the memcpy baselines.

use std::ops::{Deref, DerefMut};

/// A page-aligned anonymous buffer whose every page is faulted in (written)
/// at creation, so timed copies into it never take a first-touch fault.
#[derive(Debug)]
pub struct AlignedBuf {
    map: memmap2::MmapMut,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed, pre-faulted buffer of `len` bytes (the mapping is rounded up
    /// to 4096, so `O_DIRECT` may use [`AlignedBuf::padded_mut`]).
    ///
    /// # Panics
    /// When the mapping fails (out of memory).
    #[must_use]
    pub fn new(len: usize) -> AlignedBuf {
        let padded = len.div_ceil(4096).max(1) * 4096;
        let mut map = memmap2::MmapOptions::new()
            .len(padded)
            .populate()
            .map_anon()
            .unwrap_or_else(|e| panic!("mapping {padded} bytes of anonymous memory: {e}"));
        // MAP_POPULATE may map the shared zero page for reads; a write per
        // page makes each page private and present.
        for page in map.chunks_mut(4096) {
            page[0] = 0;
        }
        AlignedBuf { map, len }
    }

    /// A pre-faulted buffer of `len` pseudo-random bytes from `seed`.
    #[must_use]
    pub fn random(len: usize, seed: u64) -> AlignedBuf {
        let mut b = AlignedBuf::new(len);
        fill_random(&mut b, seed);
        b
    }

    /// `len` bytes of fp32 values drawn from normal(0, 0.02) (Box-Muller
    /// over xorshift), a trained model's weights: what compression meets.
    #[must_use]
    pub fn weights(len: usize) -> AlignedBuf {
        let mut b = AlignedBuf::new(len);
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut uniform = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        for w in b.chunks_exact_mut(4) {
            let (u, v) = (uniform(), uniform());
            #[expect(clippy::cast_possible_truncation, reason = "a weight is an fp32 value")]
            let x = ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 0.02) as f32;
            w.copy_from_slice(&x.to_le_bytes());
        }
        b
    }

    /// The whole mapping, `len` rounded up to 4096 (for `O_DIRECT`).
    #[must_use]
    pub fn padded(&self) -> &[u8] {
        &self.map
    }

    /// The whole mapping, writable.
    pub fn padded_mut(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }
}

/// A small deterministic generator (splitmix64): fixed seeds give the same
/// tensor sizes and bytes on every run.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    #[must_use]
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// Fills `buf` with pseudo-random bytes from `seed`.
pub fn fill_random(buf: &mut [u8], seed: u64) {
    let mut rng = Rng::new(seed);
    let mut words = buf.chunks_exact_mut(8);
    for w in &mut words {
        w.copy_from_slice(&rng.next_u64().to_le_bytes());
    }
    for b in words.into_remainder() {
        *b = rng.next_u64().to_le_bytes()[0];
    }
}

/// The memcpy baseline on one thread: `d.copy_from_slice(s)` for each pair,
/// in order.
pub fn copy_pairs(pairs: &mut [(&mut [u8], &[u8])]) {
    for (d, s) in pairs.iter_mut() {
        d.copy_from_slice(s);
    }
}

/// The memcpy baseline on `threads` threads (the calling one included),
/// split by bytes into contiguous runs, as acp splits its own copies: one
/// scoped thread per run, started on each call.
///
/// # Panics
/// When a thread cannot be started.
pub fn copy_pairs_parallel(pairs: &mut [(&mut [u8], &[u8])], threads: usize) {
    let total: usize = pairs.iter().map(|(d, _)| d.len()).sum();
    if threads <= 1 || total == 0 {
        copy_pairs(pairs);
        return;
    }
    let per = total.div_ceil(threads);
    let mut runs: Vec<Vec<(&mut [u8], &[u8])>> = Vec::with_capacity(threads);
    let mut cur: Vec<(&mut [u8], &[u8])> = Vec::new();
    let mut room = per;
    for (d, s) in pairs.iter_mut() {
        let (mut d, mut s): (&mut [u8], &[u8]) = (&mut **d, *s);
        while !d.is_empty() {
            if room == 0 {
                runs.push(std::mem::take(&mut cur));
                room = per;
            }
            let take = room.min(d.len());
            let (dh, dt) = d.split_at_mut(take);
            let (sh, st) = s.split_at(take);
            cur.push((dh, sh));
            d = dt;
            s = st;
            room -= take;
        }
    }
    if !cur.is_empty() {
        runs.push(cur);
    }
    let mine = runs.pop();
    std::thread::scope(|scope| {
        for mut run in runs {
            std::thread::Builder::new()
                .name("bench-memcpy".into())
                .spawn_scoped(scope, move || copy_pairs(&mut run))
                .expect("a benchmark thread starts: the machine has room for a few threads");
        }
        if let Some(mut run) = mine {
            copy_pairs(&mut run);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_copy_copies_everything() {
        let src = AlignedBuf::random(3 << 20, 7);
        for threads in [1, 2, 3, 8] {
            let mut dst = AlignedBuf::new(src.len());
            let mut pairs: Vec<(&mut [u8], &[u8])> =
                dst.chunks_mut(100_003).zip(src.chunks(100_003)).collect();
            copy_pairs_parallel(&mut pairs, threads);
            assert!(dst[..] == src[..], "threads {threads}");
        }
    }
}
