//! Which checkpoints are resident in this node's shared memory: the slot
//! files of a job, read without mapping or locking them.

use std::collections::{BTreeSet, HashSet};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::format::{hex, parse_header, MAX_HEADER_BYTES};
use crate::staging::{peek_slot, SlotState};

/// Where rings live unless configured otherwise.
pub const DEFAULT_SHM_DIR: &str = "/dev/shm";

/// The job id an engine on `root` uses when none is configured: the
/// canonical root path.
#[must_use]
pub fn job_id(root: &Path, job: Option<&str>) -> String {
    job.map_or_else(|| root.to_string_lossy().into_owned(), str::to_owned)
}

/// The file name prefix of the slots of `job` and `rank`:
/// `acp-{16 hex of blake3(job)}-r{rank:05}`; slot `i` is `{prefix}-s{i}`.
#[must_use]
pub fn shm_prefix(job: &str, rank: u32) -> String {
    let tag = hex(blake3::hash(job.as_bytes()).as_bytes());
    format!("acp-{}-r{rank:05}", &tag[..16])
}

/// One slot file of a job.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResidentSlot {
    /// The slot file.
    pub path: String,
    /// The rank.
    pub rank: u32,
    /// The slot index.
    pub slot: usize,
    /// `free`, `staging`, `resident` (not yet flushed), `flushing`,
    /// `persisted` (also in storage), or `invalid`.
    pub state: String,
    /// Whether it holds a complete image.
    pub complete: bool,
    /// The step of the image (when complete).
    pub step: Option<u64>,
    /// Image bytes (when complete).
    pub bytes: Option<u64>,
    /// The world size the image was saved with, from its header.
    pub world_size: Option<u32>,
    /// Tensors in the image, from its header.
    pub tensors: Option<usize>,
    /// The pid recorded as the slot's last owner.
    pub owner_pid: u32,
    /// Whether a live process holds the slot's lock (from `/proc/locks`).
    pub locked: bool,
    /// Size of the file (shared memory in use).
    pub file_bytes: u64,
}

fn state_name(s: Option<SlotState>) -> &'static str {
    match s {
        Some(SlotState::Free) => "free",
        Some(SlotState::Staging) => "staging",
        Some(SlotState::Resident) => "resident",
        Some(SlotState::Flushing) => "flushing",
        Some(SlotState::Persisted) => "persisted",
        None => "invalid",
    }
}

/// The slot files of `job` in `shm_dir` (every rank, or only `rank`),
/// by rank then slot. Reads each control block and the safetensors header
/// of a complete image; takes no lock and writes nothing, so it is safe
/// on the slots of a live trainer (whose state may change right after).
///
/// # Errors
/// [`Error::Io`] listing `shm_dir` (a missing directory is no slot).
pub fn resident(shm_dir: &Path, job: &str, rank: Option<u32>) -> Result<Vec<ResidentSlot>> {
    let tag = *blake3::hash(job.as_bytes()).as_bytes();
    let stem = &shm_prefix(job, 0)[..21]; // "acp-" + 16 hex + "-"
    let rd = match std::fs::read_dir(shm_dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list", shm_dir, e)),
    };
    let locks = locked_files();
    let mut out = Vec::new();
    for ent in rd.flatten() {
        let name = ent.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some((r, slot)) = parse_slot_name(name, stem) else {
            continue;
        };
        if rank.is_some_and(|want| want != r) {
            continue;
        }
        let path = ent.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_file() {
            continue;
        }
        let peek = match peek_slot(&path) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!("acp: {e}");
                continue;
            }
        };
        let ours = peek
            .as_ref()
            .is_some_and(|p| p.job_tag == tag && p.rank == r);
        let complete = ours
            && peek
                .as_ref()
                .is_some_and(crate::staging::SlotPeek::is_complete);
        let (world_size, tensors) = if complete {
            peek.as_ref()
                .and_then(|p| image_header(&path, p.image_offset, p.image_len))
                .map_or((None, None), |(w, t)| (w, Some(t)))
        } else {
            (None, None)
        };
        out.push(ResidentSlot {
            path: path.display().to_string(),
            rank: r,
            slot,
            state: if ours {
                state_name(peek.as_ref().and_then(|p| p.state)).to_owned()
            } else {
                "invalid".to_owned()
            },
            complete,
            step: peek.as_ref().filter(|_| complete).map(|p| p.step),
            bytes: peek.as_ref().filter(|_| complete).map(|p| p.image_len),
            world_size,
            tensors,
            owner_pid: peek.as_ref().map_or(0, |p| p.owner_pid),
            locked: locks.contains(&(meta.dev(), meta.ino())),
            file_bytes: meta.len(),
        });
    }
    out.sort_by_key(|s| (s.rank, s.slot));
    Ok(out)
}

/// `{stem}r{rank:05}-s{slot}` → (rank, slot).
fn parse_slot_name(name: &str, stem: &str) -> Option<(u32, usize)> {
    let rest = name.strip_prefix(stem)?.strip_prefix('r')?;
    let (rank, slot) = rest.split_once("-s")?;
    if rank.len() < 5 || !rank.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if slot.is_empty() || !slot.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((rank.parse().ok()?, slot.parse().ok()?))
}

/// The world size and tensor count in the safetensors header of a slot's
/// image, best effort.
fn image_header(path: &Path, image_offset: u64, image_len: u64) -> Option<(Option<u32>, usize)> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .ok()?;
    let mut n = [0u8; 8];
    f.read_exact_at(&mut n, image_offset).ok()?;
    let hlen = u64::from_le_bytes(n);
    if hlen > MAX_HEADER_BYTES || hlen + 8 > image_len {
        return None;
    }
    let mut bytes = vec![0u8; usize::try_from(hlen + 8).ok()?];
    f.read_exact_at(&mut bytes, image_offset).ok()?;
    let h = parse_header(path, &bytes, image_len).ok()?;
    let world = h
        .metadata
        .get("acp.world_size")
        .and_then(|w| w.parse().ok());
    Some((world, h.entries.len()))
}

/// The (device, inode) of every file with an `flock` held, from
/// `/proc/locks` (empty where it cannot be read).
///
/// The kernel produces `/proc/locks` a page per `read` call, resuming by
/// line number: a lock released meanwhile on an earlier line shifts the
/// rest, so one pass can skip a lock that was held throughout. Three passes
/// are merged; a held lock is missed only if every pass skips it.
fn locked_files() -> HashSet<(u64, u64)> {
    let mut out = HashSet::new();
    for _ in 0..3 {
        if let Ok(text) = std::fs::read_to_string("/proc/locks") {
            parse_locks(&text, &mut out);
        }
    }
    out
}

fn parse_locks(text: &str, out: &mut HashSet<(u64, u64)>) {
    for line in text.lines() {
        // "1: FLOCK  ADVISORY  WRITE 1234 00:19:5678 0 EOF"; blocked
        // waiters carry "->" and hold nothing.
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.get(1) != Some(&"FLOCK") || fields.contains(&"->") {
            continue;
        }
        let Some(id) = fields.get(5) else { continue };
        let mut parts = id.split(':');
        let (Some(maj), Some(min), Some(ino)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (Ok(maj), Ok(min), Ok(ino)) = (
            u32::from_str_radix(maj, 16),
            u32::from_str_radix(min, 16),
            ino.parse::<u64>(),
        ) else {
            continue;
        };
        out.insert((libc::makedev(maj, min), ino));
    }
}

/// The ranks that have slot files of `job` in `shm_dir`.
pub(crate) fn ranks(slots: &[ResidentSlot]) -> BTreeSet<u32> {
    slots.iter().map(|s| s.rank).collect()
}

/// The path of slot `slot` of `job` and `rank`.
#[cfg(test)]
#[must_use]
pub(crate) fn slot_path(shm_dir: &Path, job: &str, rank: u32, slot: usize) -> std::path::PathBuf {
    shm_dir.join(format!("{}-s{slot}", shm_prefix(job, rank)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_parse() {
        let stem = &shm_prefix("j", 0)[..21];
        assert_eq!(
            parse_slot_name(&format!("{stem}r00003-s1"), stem),
            Some((3, 1))
        );
        assert_eq!(parse_slot_name(&format!("{stem}r00003-s"), stem), None);
        assert_eq!(parse_slot_name(&format!("{stem}r3-s1"), stem), None);
        assert_eq!(
            parse_slot_name("acp-0000000000000000-r00000-s0", stem),
            None
        );
        assert_eq!(shm_prefix("j", 7).len(), 27);
        assert!(shm_prefix("j", 7).ends_with("-r00007"));
    }
}
