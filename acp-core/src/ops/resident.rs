//! Which checkpoints are resident in this node's shared memory: the slot
//! files of a job, read without mapping or locking them.

use std::collections::{BTreeSet, HashSet};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::format::{read_header, MAX_HEADER_BYTES};
use crate::staging::{job_tag, peek_file, slot_files, SlotState};

/// Where rings live unless configured otherwise.
pub const DEFAULT_SHM_DIR: &str = "/dev/shm";

/// The job id an engine on `root` uses when none is configured: the
/// canonical root path ([`crate::staging::job_id`]).
#[must_use]
pub fn job_id(root: &Path, job: Option<&str>) -> String {
    crate::staging::job_id(root, job)
}

/// The file name prefix of the slots of `job` and `rank`:
/// `acp-{16 hex of blake3(job)}-r{rank:05}` ([`crate::staging::ring_prefix`]);
/// slot `i` is `{prefix}-s{i}` in the per-user directory
/// [`crate::staging::user_dir`].
#[must_use]
pub fn shm_prefix(job: &str, rank: u32) -> String {
    crate::staging::ring_prefix(job, rank)
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
    /// Why the header of a complete image cannot be read (a changed or
    /// torn slot): `acp persist` cannot commit it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub header_error: Option<String>,
    /// The chunk size of the digests or sums recorded for the image (its
    /// writer's `chunk_bytes`), when some are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_bytes: Option<u64>,
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

/// The slot files of `job` in this user's directory under `shm_dir`
/// (every rank, or only `rank`), by rank then slot. Reads each control
/// block and the safetensors header of a complete image; takes no lock and
/// writes nothing, so it is safe on the slots of a live trainer (whose
/// state may change right after). A file that is not a regular file owned
/// by the effective uid is not listed.
///
/// # Errors
/// An untrustworthy per-user directory (see [`crate::staging::SlotDir`]);
/// [`Error::Io`](crate::Error::Io) listing it (a missing directory is no slot).
pub fn resident(shm_dir: &Path, job: &str, rank: Option<u32>) -> Result<Vec<ResidentSlot>> {
    described(slot_files(shm_dir, job, rank)?, job)
}

/// The replica slots of `job` kept in this user's directory under
/// `shm_dir` (by any holder on this node), described as [`resident`] does
/// (`rank` is the rank whose image a slot holds; `locked` says whether its
/// holder is alive).
///
/// # Errors
/// As [`resident`].
pub(crate) fn replicas(shm_dir: &Path, job: &str) -> Result<Vec<ResidentSlot>> {
    described(crate::staging::replica_files(shm_dir, job, None)?, job)
}

fn described(files: Vec<crate::staging::SlotFile>, job: &str) -> Result<Vec<ResidentSlot>> {
    let tag = job_tag(job);
    let locks = if files.is_empty() {
        HashSet::new()
    } else {
        locked_files()
    };
    let mut out = Vec::new();
    for sf in files {
        let path = sf.path();
        let file = match sf.open() {
            Ok(Some(f)) => f,
            Ok(None) => continue,
            Err(e) => {
                tracing::debug!("acp: {e}");
                continue;
            }
        };
        let Ok(meta) = file.metadata() else {
            continue;
        };
        let peek = match peek_file(&file, &path) {
            Ok(p) => p,
            Err(e) => {
                tracing::debug!("acp: {e}");
                continue;
            }
        };
        let r = sf.rank;
        let ours = peek
            .as_ref()
            .is_some_and(|p| p.job_tag == tag && p.rank == r);
        let complete = ours
            && peek
                .as_ref()
                .is_some_and(crate::staging::SlotPeek::is_complete);
        let header = peek
            .as_ref()
            .filter(|_| complete)
            .map(|p| image_header(&file, &path, p.image_offset, p.image_len));
        let (world_size, tensors, header_error) = match header {
            Some(Ok((w, t))) => (w, Some(t), None),
            Some(Err(e)) => (None, None, Some(e)),
            None => (None, None, None),
        };
        out.push(ResidentSlot {
            path: path.display().to_string(),
            rank: r,
            slot: sf.slot,
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
            header_error,
            chunk_bytes: peek
                .as_ref()
                .filter(|p| complete && p.chunk_bytes > 0)
                .map(|p| p.chunk_bytes),
            owner_pid: peek.as_ref().map_or(0, |p| p.owner_pid),
            locked: locks.contains(&(meta.dev(), meta.ino())),
            file_bytes: meta.len(),
        });
    }
    Ok(out)
}

/// The world size and tensor count in the safetensors header of a slot's
/// image; why it cannot be read, when it cannot.
fn image_header(
    f: &std::fs::File,
    path: &Path,
    image_offset: u64,
    image_len: u64,
) -> std::result::Result<(Option<u32>, usize), String> {
    let h = read_header(path, image_len, MAX_HEADER_BYTES, |buf, at| {
        f.read_exact_at(buf, image_offset + at)
            .map_err(|e| crate::Error::io("read", path, e))
    })
    .map_err(|e| e.to_string())?;
    let world = h
        .metadata
        .get("acp.world_size")
        .and_then(|w| w.parse().ok());
    Ok((world, h.entries.len()))
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
