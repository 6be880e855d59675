//! The origin record of a slot file: which checkpoint root and job id the
//! ring belongs to, so that tools that find a ring on the node (`acp ls
//! --shm`, `acp gc --shm`, the engine's reclaim at open) can tell whether
//! its steps are committed.
//!
//! It lives in the control block's reserved bytes (from offset
//! [`ORIGIN_AT`], all zero in a file written before the record existed),
//! so the layout version stays `1`: a reader that does not know the
//! record ignores it, and a file without it reads as "origin unknown".
//!
//! | offset | size | field      | meaning |
//! |-------:|-----:|------------|---------|
//! |    112 |    4 | `magic`    | `b"ORG1"` |
//! |    116 |    2 | `root_len` | bytes of the root path, `0` when not recorded |
//! |    118 |    2 | `job_len`  | bytes of the job id; `0`: the job id is the root path |
//! |    120 |    … | `root`     | the canonical root path (UTF-8) |
//! |      … |    … | `job`      | the job id (UTF-8) |
//!
//! The record is written once per [`Ring::record_origin`] (at engine open)
//! with `pwrite`, outside the mapping: no mapped byte the ring reads or
//! writes overlaps it. A job id read back is trusted only when its blake3
//! is the job tag of the same control block, so a record left by another
//! job in a reused file is never believed.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use super::control::{off, HEADER_BYTES};
use super::dir::job_tag;
use super::Ring;
use crate::format::Digest;

/// Where the origin record starts: the first reserved byte.
pub(super) const ORIGIN_AT: usize = off::END;
const MAGIC: [u8; 4] = *b"ORG1";
/// Bytes of the record before the strings.
const FIXED: usize = 8;
/// The most string bytes the header page holds after the fixed part.
const ROOM: usize = HEADER_BYTES - ORIGIN_AT - FIXED;

/// Where a ring's checkpoints go, as its slot files record it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origin {
    /// The checkpoint root (canonical), when recorded.
    pub root: Option<String>,
    /// The job id, when recorded (and consistent with the job tag).
    pub job: Option<String>,
}

/// The record's bytes for `root` and `job`; `None` when neither fits.
fn encode(root: &str, job: &str) -> Option<Vec<u8>> {
    let job_bytes: &[u8] = if job == root { &[] } else { job.as_bytes() };
    let root_bytes: &[u8] = if root.len() + job_bytes.len() <= ROOM {
        root.as_bytes()
    } else {
        &[]
    };
    if job_bytes.len() > ROOM || (root_bytes.is_empty() && job_bytes.is_empty()) {
        return None;
    }
    let mut b = Vec::with_capacity(FIXED + root_bytes.len() + job_bytes.len());
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&u16::try_from(root_bytes.len()).ok()?.to_le_bytes());
    b.extend_from_slice(&u16::try_from(job_bytes.len()).ok()?.to_le_bytes());
    b.extend_from_slice(root_bytes);
    b.extend_from_slice(job_bytes);
    Some(b)
}

/// Parses the record in the header page `page` of a slot whose control
/// block holds `tag`.
fn decode(page: &[u8], tag: &Digest) -> Origin {
    let Some(rec) = page.get(ORIGIN_AT..) else {
        return Origin::default();
    };
    if rec.len() < FIXED || rec[..4] != MAGIC {
        return Origin::default();
    }
    let root_len = usize::from(u16::from_le_bytes([rec[4], rec[5]]));
    let job_len = usize::from(u16::from_le_bytes([rec[6], rec[7]]));
    let Some(strings) = rec.get(FIXED..FIXED + root_len + job_len) else {
        return Origin::default();
    };
    let root = (root_len > 0)
        .then(|| std::str::from_utf8(&strings[..root_len]).ok())
        .flatten()
        .map(str::to_owned);
    let job = if job_len == 0 {
        root.clone()
    } else {
        std::str::from_utf8(&strings[root_len..])
            .ok()
            .map(str::to_owned)
    };
    let job = job.filter(|j| job_tag(j) == *tag);
    // A root whose job id does not match the tag is another job's record.
    if job.is_none() {
        return Origin::default();
    }
    Origin { root, job }
}

/// Reads the origin record of an open slot file whose control block holds
/// the job tag `tag`; an empty [`Origin`] when it has none or it cannot be
/// read.
#[must_use]
pub fn read_origin(file: &File, tag: &Digest) -> Origin {
    let mut page = vec![0u8; HEADER_BYTES];
    match file.read_exact_at(&mut page, 0) {
        Ok(()) => decode(&page, tag),
        Err(_) => Origin::default(),
    }
}

impl Ring {
    /// Records in every slot file that this ring belongs to the checkpoint
    /// root `root` and the job id `job`.
    /// Best effort: a root and job too long for the header page, or a
    /// failed write, leave the origin unknown (logged), never an error.
    pub fn record_origin(&self, root: &Path, job: &str) {
        let inner = &self.inner;
        let root = root.to_string_lossy();
        let Some(rec) = encode(&root, job) else {
            tracing::debug!(
                "{}: root and job id too long to record; the ring's origin stays unknown",
                inner.what()
            );
            return;
        };
        for (slot, file) in inner.files.iter().enumerate() {
            // Outside every byte the mapping's accessors touch (the
            // control fields end at `ORIGIN_AT`, the digest area starts at
            // the next page), and every slot file is at least one header
            // page long once the ring is open.
            if let Err(e) = file.write_all_at(&rec, ORIGIN_AT as u64) {
                tracing::warn!(
                    "{}: recording the ring's origin: {e}",
                    inner.path(slot).display()
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_with(rec: &[u8]) -> Vec<u8> {
        let mut page = vec![0u8; HEADER_BYTES];
        page[ORIGIN_AT..ORIGIN_AT + rec.len()].copy_from_slice(rec);
        page
    }

    #[test]
    fn origin_round_trips() {
        let rec = encode("/ckpt/run", "job-7").unwrap();
        let o = decode(&page_with(&rec), &job_tag("job-7"));
        assert_eq!(o.root.as_deref(), Some("/ckpt/run"));
        assert_eq!(o.job.as_deref(), Some("job-7"));
        // The default job id is the root: stored once.
        let rec = encode("/ckpt/run", "/ckpt/run").unwrap();
        assert_eq!(rec.len(), FIXED + "/ckpt/run".len());
        let o = decode(&page_with(&rec), &job_tag("/ckpt/run"));
        assert_eq!(o.job.as_deref(), Some("/ckpt/run"));
        assert_eq!(o.root.as_deref(), Some("/ckpt/run"));
    }

    #[test]
    fn unknown_or_foreign_origin_is_empty() {
        // A file written before the record existed: zeros.
        assert_eq!(
            decode(&vec![0u8; HEADER_BYTES], &job_tag("j")),
            Origin::default()
        );
        // Another job's record left in a reused file.
        let rec = encode("/a", "other").unwrap();
        assert_eq!(decode(&page_with(&rec), &job_tag("j")), Origin::default());
        // A root too long to record keeps the job id.
        let long = "/x".repeat(ROOM);
        let rec = encode(&long, "j").unwrap();
        let o = decode(&page_with(&rec), &job_tag("j"));
        assert_eq!((o.root, o.job.as_deref()), (None, Some("j")));
        // Both unrecordable: nothing written.
        assert!(encode(&long, &long).is_none());
        // Cut short: not trusted.
        let rec = encode("/ckpt", "j").unwrap();
        let mut page = page_with(&rec);
        page.truncate(ORIGIN_AT + FIXED + 2);
        assert_eq!(decode(&page, &job_tag("j")), Origin::default());
    }
}
