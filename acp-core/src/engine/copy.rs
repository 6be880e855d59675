//! Parallel copies between host buffers and ring slots.
//!
//! The work is split by bytes, not by tensor, so one huge tensor is shared
//! between threads and thousands of small ones are grouped: each thread gets
//! one contiguous run of about `total / threads` bytes.

/// Below this many bytes a copy runs on the calling thread alone: starting a
/// thread costs more than copying.
const PARALLEL_MIN_BYTES: usize = 8 << 20;

/// Copies `pairs[i].1` into `pairs[i].0` (equal lengths, checked by the
/// caller) over up to `threads` threads, the calling one included.
pub(crate) fn parallel_copy(pairs: Vec<(&mut [u8], &[u8])>, threads: usize) {
    let total: usize = pairs.iter().map(|(d, _)| d.len()).sum();
    if threads <= 1 || total < PARALLEL_MIN_BYTES {
        for (d, s) in pairs {
            d.copy_from_slice(s);
        }
        return;
    }
    let per = total.div_ceil(threads);
    let mut groups: Vec<Vec<(&mut [u8], &[u8])>> = Vec::with_capacity(threads);
    let mut cur: Vec<(&mut [u8], &[u8])> = Vec::new();
    let mut room = per;
    for (mut d, mut s) in pairs {
        while !d.is_empty() {
            if room == 0 {
                groups.push(std::mem::take(&mut cur));
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
        groups.push(cur);
    }
    crate::io::run_on_threads("acp-copy", groups, copy_group);
}

/// One thread's turn: a run of (destination, source) pairs.
fn copy_group(g: Vec<(&mut [u8], &[u8])>) {
    for (d, s) in g {
        d.copy_from_slice(s);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_everything_across_splits() {
        let srcs: Vec<Vec<u8>> = [0usize, 1, 5 << 20, 3, 9 << 20, 4096]
            .iter()
            .enumerate()
            .map(|(i, &n)| (0..n).map(|j| (i * 31 + j * 7) as u8).collect())
            .collect();
        for threads in [1, 2, 3, 8] {
            let mut dsts: Vec<Vec<u8>> = srcs.iter().map(|s| vec![0; s.len()]).collect();
            let pairs = dsts
                .iter_mut()
                .zip(&srcs)
                .map(|(d, s)| (d.as_mut_slice(), s.as_slice()))
                .collect();
            parallel_copy(pairs, threads);
            assert_eq!(dsts, srcs, "threads {threads}");
        }
    }
}
