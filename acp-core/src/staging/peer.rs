//! Copying an image out of another rank's slot on this node: the "restore
//! from RAM" of a file this process did not write. No mapping, no lock, no
//! write: the slot belongs to a live or dead process of the same job, which
//! may reuse it at any moment, so the copy is taken between two reads of
//! the control block and kept only when both describe the same sealed image
//! (same state class, step, length and generation). The caller verifies the
//! bytes against the committed digests before using them.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::Digest;

use super::control::{off, Header};
use super::SlotState;

/// The image a caller wants from another rank's slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerImage {
    /// blake3 of the job id (the slot's `job_tag`).
    pub job_tag: Digest,
    /// The rank that owns the slot.
    pub rank: u32,
    /// The step the image must hold.
    pub step: u64,
    /// The image length (the data file's size).
    pub len: u64,
}

/// Copies the image `want` describes out of the slot file at `path` into
/// `dst[..want.len]`. `Ok(false)` when the slot does not hold that image
/// complete (another step, another length, staging, not this job's or
/// rank's, not owned by this user) or was reacquired during the copy.
///
/// # Errors
/// [`Error::Invalid`] when `dst` is shorter than the image; [`Error::Io`]
/// reading the file. A missing file is `Ok(false)`.
pub fn copy_peer_image(path: &Path, want: &PeerImage, dst: &mut [u8]) -> Result<bool> {
    let len = usize::try_from(want.len).unwrap_or(usize::MAX);
    if dst.len() < len {
        return Err(Error::invalid(
            path.display(),
            format!("buffer of {} bytes for an image of {}", dst.len(), want.len),
        ));
    }
    let file = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(Error::io("open", path, e)),
    };
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    if !meta.is_file() || meta.uid() != super::slot::euid() {
        return Ok(false);
    }
    let Some(before) = control_block(&file, path)? else {
        return Ok(false);
    };
    if !holds(&before, want, meta.len()) {
        return Ok(false);
    }
    file.read_exact_at(&mut dst[..len], before.image_offset)
        .map_err(|e| Error::io("read", path, e))?;
    let Some(after) = control_block(&file, path)? else {
        return Ok(false);
    };
    Ok(holds(&after, want, meta.len()) && after.generation == before.generation)
}

fn control_block(file: &File, path: &Path) -> Result<Option<Header>> {
    let mut block = [0u8; off::END];
    match file.read_exact_at(&mut block, 0) {
        Ok(()) => Ok(Header::decode(&block)),
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(Error::io("read", path, e)),
    }
}

fn holds(h: &Header, want: &PeerImage, file_len: u64) -> bool {
    SlotState::from_code(h.state).is_some_and(SlotState::is_complete)
        && h.job_tag == want.job_tag
        && h.rank == want.rank
        && h.step == want.step
        && h.image_len == want.len
        && h.check_complete(file_len).is_ok()
}
