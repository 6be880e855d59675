//! Incremental flushes: which chunks of a sealed image the root's newest
//! committed step already holds, so the flush references them instead of
//! writing them again (the layout is in [`format`](crate::format),
//! "Incremental steps").
//!
//! A chunk is reused when its digest equals the digest of the chunk at the
//! same index of the same rank's file in the newest committed step before
//! this one, with the same chunk size (so the same byte span). Matching by
//! index, not by any digest anywhere in the root, is deliberate: acp lays
//! an image out from its tensor list alone, so a tensor that did not
//! change sits at the same offsets step after step (the fine-tuning case:
//! a frozen base beside trained adapters), while a layout that moves
//! shifts offsets by amounts that are not whole chunks, so a digest found
//! elsewhere would almost never match anyway; and a reference by index
//! needs no per-chunk table of the root's digests to be built or kept.
//!
//! A reference names the file that physically holds the bytes: a chunk the
//! newest step itself references is referenced where that reference
//! points, so reads take one hop and never follow chains.

use std::collections::BTreeSet;
use std::path::Path;

use super::state::Shared;
use crate::error::{Error, Result};
use crate::format::{chunk_span, digest, unhex, ChunkRef, Digest};

/// Where the chunks of the newest committed step's file are held.
#[derive(Debug)]
pub(super) struct Base {
    /// Its file's image length.
    size: u64,
    /// Its chunk digests.
    digests: Vec<Option<Digest>>,
    /// For each chunk, the step and file that hold its bytes.
    holders: Vec<(u64, String)>,
}

impl Base {
    /// Whether chunk `i` of an image of `len` bytes in `chunk`-byte chunks
    /// spans the same bytes as the base's chunk `i` (so equal digests mean
    /// the same bytes at the same place).
    fn same_span(&self, i: usize, chunk: u64, len: u64) -> bool {
        i < self.digests.len()
            && chunk_span(i as u64, chunk, len) == chunk_span(i as u64, chunk, self.size)
    }
}

/// The base of an incremental flush of `step` for file `file` with
/// `chunk`-byte chunks: the newest committed step before `step`, when
/// its index lists `file` with the same chunk size. `None` (write the step
/// whole) when there is none or it cannot be read (logged).
pub(super) fn base(shared: &Shared, step: u64, file: &str, chunk: u64) -> Option<Base> {
    let root = &shared.root;
    let steps = match root.steps() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("acp: step {step}: not incremental, the root's steps: {e}");
            return None;
        }
    };
    let prev = steps.iter().rev().copied().find(|s| *s < step)?;
    let index = match root.read_index(prev) {
        Ok(i) => i,
        Err(e) => {
            tracing::warn!("acp: step {step}: not incremental, step {prev}'s index: {e}");
            return None;
        }
    };
    let entry = index.files.get(file)?;
    if entry.chunk_bytes != chunk {
        return None;
    }
    let holders = (0..entry.chunks.len() as u64)
        .map(|i| match entry.held_by(i) {
            Some(r) => (r.step, r.file.clone()),
            None => (prev, file.to_owned()),
        })
        .collect();
    Some(Base {
        size: entry.size,
        digests: entry.chunks.iter().map(|c| unhex(c)).collect(),
        holders,
    })
}

/// Chunks [`likely_reuse`] hashes at most.
const PROBES: usize = 8;

/// Whether `image` (in `chunk`-byte chunks) likely shares chunks with
/// `base`: up to [`PROBES`] chunks spread evenly over it are hashed, and
/// one that equals the base's chunk at the same span says yes. Training
/// changes every chunk of a state; a fine-tuned one keeps most of them
/// (a frozen base), so a probe that finds none spares the flush hashing
/// the whole image before it writes anything (it then writes the step
/// whole and takes the digests as it writes, overlapped with the writes),
/// at the cost of writing whole the rare step that shares few chunks, all
/// away from the probes: still a complete, verified step.
pub(super) fn likely_reuse(base: &Base, image: &[u8], chunk: usize) -> bool {
    let chunk = chunk.max(1);
    let n = image.len().div_ceil(chunk);
    let len = image.len() as u64;
    let probes = n.min(PROBES);
    (0..probes).any(|k| {
        // Evenly spread, the first and the last chunk included.
        let i = if probes <= 1 {
            0
        } else {
            k * (n - 1) / (probes - 1)
        };
        let (s, e) = chunk_span(i as u64, chunk as u64, len);
        base.same_span(i, chunk as u64, len)
            && base.digests[i] == Some(digest(&image[to_index(s)..to_index(e)]))
    })
}

fn to_index(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// The quick sum and digest of each `chunk`-byte chunk of `image`, over up
/// to `threads` threads (contiguous runs of chunks). The sum of a chunk is
/// taken before its digest, as in a plain flush (`read/fast.rs` says why).
/// Each thread calls `pause` before each chunk.
///
/// # Errors
/// [`Error::Io`] naming `path` when a thread cannot start.
pub(super) fn prehash(
    image: &[u8],
    chunk: usize,
    threads: usize,
    path: &Path,
    pause: &(dyn Fn() + Sync),
) -> Result<(Vec<Digest>, Vec<u64>)> {
    let chunk = chunk.max(1);
    let n = image.len().div_ceil(chunk);
    let mut out: Vec<(u64, Digest)> = vec![(0, [0u8; 32]); n];
    let per = n.div_ceil(threads.clamp(1, n.max(1))).max(1);
    std::thread::scope(|s| -> Result<()> {
        for (k, part) in out.chunks_mut(per).enumerate() {
            std::thread::Builder::new()
                .name(format!("acp-digest-{k}"))
                .spawn_scoped(s, move || {
                    for (j, slot) in part.iter_mut().enumerate() {
                        pause();
                        let start = (k * per + j) * chunk;
                        let bytes = &image[start..(start + chunk).min(image.len())];
                        *slot = crate::read::sum_then_digest(bytes);
                    }
                })
                .map_err(|e| Error::io("start a digest thread for", path, e))?;
        }
        Ok(())
    })?;
    Ok(out.into_iter().map(|(s, d)| (d, s)).unzip())
}

/// For each chunk of an image of `len` bytes in `chunk`-byte chunks with
/// `digests`, where `base` holds the same bytes (the step and file), or
/// `None` to write it.
pub(super) fn reuse(
    base: &Base,
    digests: &[Digest],
    len: u64,
    chunk: u64,
) -> Vec<Option<(u64, String)>> {
    digests
        .iter()
        .enumerate()
        .map(|(i, d)| {
            (base.same_span(i, chunk, len) && base.digests[i].as_ref() == Some(d))
                .then(|| base.holders[i].clone())
        })
        .collect()
}

/// The index's runs of `reuse`: consecutive chunks held by the same file.
pub(super) fn runs(reuse: &[Option<(u64, String)>]) -> Vec<ChunkRef> {
    let mut out: Vec<ChunkRef> = Vec::new();
    for (i, held) in reuse.iter().enumerate() {
        let Some((step, file)) = held else { continue };
        let i = i as u64;
        match out.last_mut() {
            Some(r) if r.first + r.count == i && r.step == *step && r.file == *file => r.count += 1,
            _ => out.push(ChunkRef {
                first: i,
                count: 1,
                step: *step,
                file: file.clone(),
            }),
        }
    }
    out
}

/// The committed steps after `step` that reference chunks of `step`.
///
/// # Errors
/// The error of listing the root or reading one of their indexes.
pub(super) fn referrers(shared: &Shared, step: u64) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for s in shared.root.steps()?.into_iter().filter(|s| *s > step) {
        let index = shared.root.read_index(s)?;
        if index
            .files
            .values()
            .any(|f| f.refs.iter().any(|r| r.step == step))
        {
            out.push(s);
        }
    }
    Ok(out)
}

/// The steps `refs` reference.
pub(super) fn held_steps(refs: &[ChunkRef]) -> BTreeSet<u64> {
    refs.iter().map(|r| r.step).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_group_consecutive_chunks_of_one_holder() {
        let a = Some((1, "f".to_owned()));
        let b = Some((2, "f".to_owned()));
        let r = runs(&[a.clone(), a.clone(), None, a.clone(), b.clone(), b]);
        let got: Vec<(u64, u64, u64)> = r.iter().map(|r| (r.first, r.count, r.step)).collect();
        assert_eq!(got, vec![(0, 2, 1), (3, 1, 1), (4, 2, 2)]);
    }

    fn base_of(image: &[u8], chunk: usize) -> Base {
        let digests = crate::format::chunk_digests(image, chunk);
        Base {
            size: image.len() as u64,
            holders: vec![(1, "f".to_owned()); digests.len()],
            digests: digests.into_iter().map(Some).collect(),
        }
    }

    #[test]
    fn likely_reuse_finds_a_frozen_part_and_not_a_trained_state() {
        let chunk = 4096;
        let old: Vec<u8> = (0..64 * chunk).map(|i| (i % 251) as u8).collect();
        let base = base_of(&old, chunk);
        // Every chunk changed (training): no probe matches.
        let trained: Vec<u8> = old.iter().map(|b| b.wrapping_add(1)).collect();
        assert!(!likely_reuse(&base, &trained, chunk));
        // The first three quarters frozen, the rest trained.
        let mut tuned = old.clone();
        for b in &mut tuned[48 * chunk..] {
            *b = b.wrapping_add(1);
        }
        assert!(likely_reuse(&base, &tuned, chunk));
        // Only the last chunk unchanged: the last probe finds it.
        let mut last = trained.clone();
        last[63 * chunk..].copy_from_slice(&old[63 * chunk..]);
        assert!(likely_reuse(&base, &last, chunk));
        // The same bytes at another span (a longer image) do not count.
        let mut longer = old.clone();
        longer.push(0);
        assert!(
            likely_reuse(&base, &longer, chunk),
            "the first chunks keep their span"
        );
        let shifted: Vec<u8> = std::iter::once(0).chain(old.iter().copied()).collect();
        assert!(!likely_reuse(&base, &shifted, chunk));
        assert!(!likely_reuse(&base, &[], chunk));
    }

    #[test]
    fn prehash_matches_the_plain_digests() {
        let image: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        for threads in [1, 3, 8] {
            let (d, s) = prehash(&image, 4096, threads, Path::new("x"), &|| {}).unwrap();
            assert_eq!(d, crate::format::chunk_digests(&image, 4096));
            assert_eq!(s.len(), d.len());
        }
    }
}
