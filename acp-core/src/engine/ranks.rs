//! What one rank reads of the others' work: another rank's image from its
//! slot on this node (restore from RAM per node), another rank's header
//! (its values) without its tensors, and a step's index.
//!
//! Another rank's slot is read, never mapped or locked: its owner may be
//! alive and reuse the slot at any time. The copy is kept only when the
//! slot's control block is unchanged across it
//! ([`copy_peer_image`](crate::staging::copy_peer_image)) and every chunk
//! matches the committed digests; anything else falls back to storage.

use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use super::Shared;
use crate::error::{Error, Result};
use crate::format::{
    data_file_name, parse_header, unhex, FileEntry, ParsedHeader, MAX_HEADER_BYTES,
};
use crate::staging::{copy_peer_image, PeerImage};

/// The slot files of `rank` of this engine's job in the shm directory
/// (`{prefix}-s{i}`), whatever the number of slots that rank configured.
fn peer_slots(shared: &Shared, rank: u32) -> Vec<PathBuf> {
    let (prefix, _) = super::job_names(&shared.cfg, &shared.root, rank);
    let stem = format!("{prefix}-s");
    let Ok(rd) = std::fs::read_dir(&shared.cfg.shm_dir) else {
        return Vec::new();
    };
    let mut out: Vec<(usize, PathBuf)> = rd
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let i = name.to_str()?.strip_prefix(&stem)?;
            if i.is_empty() || !i.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            Some((i.parse().ok()?, e.path()))
        })
        .collect();
    out.sort();
    out.into_iter().map(|(_, p)| p).collect()
}

/// Copies `rank`'s image of `step` out of its slot on this node into
/// `dst`, when one holds it. Returns the slot file it came from; the
/// caller verifies the bytes against `entry` before trusting them.
pub(super) fn copy_from_peer_slot(
    shared: &Shared,
    step: u64,
    rank: u32,
    entry: &FileEntry,
    dst: &mut [u8],
) -> Option<PathBuf> {
    let (_, job_tag) = super::job_names(&shared.cfg, &shared.root, rank);
    let want = PeerImage {
        job_tag,
        rank,
        step,
        len: entry.size,
    };
    for path in peer_slots(shared, rank) {
        match copy_peer_image(&path, &want, dst) {
            Ok(true) => return Some(path),
            Ok(false) => {}
            Err(e) => tracing::debug!("acp: rank {rank}'s slot {}: {e}", path.display()),
        }
    }
    None
}

/// The header of `rank`'s file of committed `step`, read from the chunks
/// that hold it, each checked against the index's digests.
pub(super) fn read_header(shared: &Shared, step: u64, rank: u32) -> Result<ParsedHeader> {
    let index = shared.root.read_index(step)?;
    let name = data_file_name(rank);
    let Some(entry) = index.files.get(&name) else {
        return Err(Error::NotFound {
            what: format!(
                "rank {rank}'s file in step {step} of {}",
                shared.root.path().display()
            ),
        });
    };
    let path = shared.root.step_dir(step).join(&name);
    let bytes = read_verified_prefix(&path, entry)?;
    parse_header(&path, &bytes, entry.size)
}

/// The first chunks of the file at `path`, verified, up to and including
/// the one where the safetensors header ends.
fn read_verified_prefix(path: &Path, entry: &FileEntry) -> Result<Vec<u8>> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::corrupt(
                path,
                None,
                "missing: the index lists it, the step directory does not hold it",
            ),
            _ => Error::io("open", path, e),
        })?;
    let chunk = entry.chunk_bytes.max(1);
    let mut bytes: Vec<u8> = Vec::new();
    let mut need = 8u64;
    let mut i = 0u64;
    while (bytes.len() as u64) < need.min(entry.size) {
        let start = i * chunk;
        let end = (start + chunk).min(entry.size);
        let want = usize::try_from(i)
            .ok()
            .and_then(|i| entry.chunks.get(i))
            .and_then(|h| unhex(h));
        let Some(want) = want else {
            return Err(Error::corrupt(
                path,
                None,
                format!("the index records no digest for bytes {start}..{end}"),
            ));
        };
        if need > MAX_HEADER_BYTES + 8 || end - start > 1 << 30 {
            return Err(Error::corrupt(
                path,
                None,
                format!("a header of {need} bytes in chunks of {chunk} is past acp's limits"),
            ));
        }
        let old = bytes.len();
        bytes.resize(old + to_usize(end - start), 0);
        file.read_exact_at(&mut bytes[old..], start)
            .map_err(|e| Error::io("read", path, e))?;
        if *blake3::hash(&bytes[old..]).as_bytes() != want {
            return Err(Error::corrupt(
                path,
                None,
                format!("digest mismatch in bytes {start}..{end} (header)"),
            ));
        }
        if let Some(n) = bytes.first_chunk::<8>() {
            need = u64::from_le_bytes(*n).saturating_add(8);
        }
        i += 1;
    }
    Ok(bytes)
}

fn to_usize(v: u64) -> usize {
    super::to_usize(v)
}
