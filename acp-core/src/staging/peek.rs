//! Reading a slot file's control block from outside the ring: no mapping,
//! no lock, no write. For tools (`acp ls`, `acp persist`) that look at the
//! slots of a job that may be live in another process.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, Result};
use crate::format::Digest;

use super::control::{off, Header};
use super::SlotState;

/// What a slot file's control block says, as read at one instant. A live
/// owner may change it right after; use it for display and as a hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotPeek {
    /// The state, `None` for an unknown code.
    pub state: Option<SlotState>,
    /// Step of the image (meaningful in a complete state).
    pub step: u64,
    /// Image length in bytes.
    pub image_len: u64,
    /// Offset of the image area in the file.
    pub image_offset: u64,
    /// Image area size.
    pub capacity: u64,
    /// blake3 of the job id.
    pub job_tag: Digest,
    /// The rank.
    pub rank: u32,
    /// Pid of the process that last opened or acquired the slot.
    pub owner_pid: u32,
    /// Incremented at each acquire.
    pub generation: u64,
    /// Whether chunk digests are recorded.
    pub digests_valid: bool,
    /// The chunk size of the digests or quick sums recorded for the image
    /// (its writer's `chunk_bytes`); 0 when none are.
    pub chunk_bytes: u64,
    /// The file's size.
    pub file_len: u64,
}

impl SlotPeek {
    /// Whether the slot claims a complete image (`Resident`, `Flushing`,
    /// `Persisted`) that fits the file.
    #[must_use]
    pub fn is_complete(&self) -> bool {
        self.state.is_some_and(SlotState::is_complete)
            && self.image_offset < self.file_len
            && self.image_len <= self.file_len - self.image_offset
    }
}

/// Reads the control block of the slot file at `path` without mapping or
/// locking it (nor following a symlink, nor blocking on a FIFO).
/// `Ok(None)` when the file holds no valid control block (too short,
/// another magic or version) or is not a regular file owned by the
/// effective uid.
///
/// # Errors
/// [`Error::NotFound`] when there is no such file; [`Error::Io`].
pub fn peek_slot(path: &Path) -> Result<Option<SlotPeek>> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound {
                    what: format!("ring slot {}", path.display()),
                }
            } else {
                Error::io("open", path, e)
            }
        })?;
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    if !meta.is_file() || meta.uid() != super::slot::euid() {
        return Ok(None);
    }
    peek_file(&file, path)
}

/// Reads the control block of the open slot file `file` (at `path`, for
/// messages; see [`SlotFile::open`](super::SlotFile::open)) without
/// mapping or locking it. `Ok(None)` when the file holds no valid control
/// block (too short, another magic or version).
///
/// # Errors
/// [`Error::Io`].
pub fn peek_file(file: &File, path: &Path) -> Result<Option<SlotPeek>> {
    let file_len = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    let mut block = [0u8; off::END];
    match file.read_exact_at(&mut block, 0) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(Error::io("read", path, e)),
    }
    Ok(Header::decode(&block).map(|h| SlotPeek {
        state: SlotState::from_code(h.state),
        step: h.step,
        image_len: h.image_len,
        image_offset: h.image_offset,
        capacity: h.capacity,
        job_tag: h.job_tag,
        rank: h.rank,
        owner_pid: h.pid,
        generation: h.generation,
        digests_valid: h.digests_valid == 1,
        chunk_bytes: h.chunk_bytes,
        file_len,
    }))
}
