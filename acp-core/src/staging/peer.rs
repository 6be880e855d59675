//! Copying an image out of another rank's slot on this node: the "restore
//! from RAM" of a file this process did not write. No mapping, no lock, no
//! write: the slot belongs to a live or dead process of the same job, which
//! may reuse it at any moment, so the bytes are read between two reads of
//! the control block ([`PeerSlot::open`] and [`PeerSlot::unchanged`]) and
//! kept only when both describe the same sealed image (state class, step,
//! length and generation). The caller verifies the bytes against the
//! committed digests before using them.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::Digest;

use super::control::{
    decode_sums, off, sums_alone_tag, sums_at, sums_record_len, sums_tag, Header, HEADER_PAGE,
    SUMS_ALONE_MAGIC, SUMS_FIXED, SUMS_MAGIC,
};
use super::{SlotFile, SlotState};

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

/// Another rank's slot file that held the wanted image when opened.
#[derive(Debug)]
pub struct PeerSlot {
    file: File,
    path: PathBuf,
    want: PeerImage,
    file_len: u64,
    before: Header,
}

impl PeerSlot {
    /// Opens the slot file `slot` when it holds the image `want`
    /// describes, complete; `Ok(None)` when it does not (another step or
    /// length, staging, not this job's or rank's, not this user's, absent).
    ///
    /// # Errors
    /// [`Error::Io`] opening or reading it.
    pub fn open(slot: &SlotFile, want: PeerImage) -> Result<Option<PeerSlot>> {
        let path = &slot.path();
        let Some(file) = slot.open()? else {
            return Ok(None);
        };
        let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
        let Some(before) = control_block(&file, path)? else {
            return Ok(None);
        };
        if !holds(&before, &want, meta.len()) {
            return Ok(None);
        }
        Ok(Some(PeerSlot {
            file,
            path: path.to_path_buf(),
            want,
            file_len: meta.len(),
            before,
        }))
    }

    /// The slot file.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The length of the wanted image, which the slot holds.
    #[must_use]
    pub fn image_len(&self) -> u64 {
        self.want.len
    }

    /// Copies image bytes `start..start + dst.len()` into `dst`. They are
    /// only the image's if [`PeerSlot::unchanged`] holds afterwards.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a range past the image; [`Error::Io`].
    pub fn read_at(&self, start: u64, dst: &mut [u8]) -> Result<()> {
        let end = start.saturating_add(dst.len() as u64);
        if end > self.want.len {
            return Err(Error::invalid(
                self.path.display(),
                format!("bytes {start}..{end} of an image of {}", self.want.len),
            ));
        }
        self.file
            .read_exact_at(dst, self.before.image_offset + start)
            .map_err(|e| Error::io("read", &self.path, e))
    }

    /// The chunk digests the slot records for its image, and their chunk
    /// size; `None` when none are recorded (not yet hashed, or being
    /// rewritten). Like the bytes, they are the image's only if
    /// [`PeerSlot::unchanged`] holds afterwards.
    ///
    /// # Errors
    /// [`Error::Io`] reading the control block or the digest area.
    pub fn digests(&self) -> Result<Option<(u64, Vec<Digest>)>> {
        let Some(now) = control_block(&self.file, &self.path)? else {
            return Ok(None);
        };
        // Read again, unlocked: checked again as `open` checked it, so a
        // block rewritten meanwhile sizes nothing.
        if !holds(&now, &self.want, self.file_len)
            || now.digests_valid != 1
            || !now.digests_usable(now.chunk_bytes)
        {
            return Ok(None);
        }
        let count = usize::try_from(now.digest_count).unwrap_or(usize::MAX);
        let mut area = vec![0u8; count.saturating_mul(32)];
        self.file
            .read_exact_at(&mut area, HEADER_PAGE)
            .map_err(|e| Error::io("read", &self.path, e))?;
        let digests = area
            .chunks_exact(32)
            .map(|c| {
                let mut d = [0u8; 32];
                d.copy_from_slice(c);
                d
            })
            .collect();
        Ok(Some((now.chunk_bytes, digests)))
    }

    /// The quick sums the slot records beside `digests` (as
    /// [`PeerSlot::digests`] returned them, of chunks of `chunk_bytes`):
    /// `None` when there is no sums record, or its tag is not that of these
    /// digests (sums taken beside other digests, or none). Like the bytes,
    /// they are the image's only if [`PeerSlot::unchanged`] holds
    /// afterwards.
    ///
    /// # Errors
    /// [`Error::Io`] reading the record.
    pub fn sums(&self, chunk_bytes: u64, digests: &[Digest]) -> Result<Option<Vec<u64>>> {
        let Some(now) = control_block(&self.file, &self.path)? else {
            return Ok(None);
        };
        if !holds(&now, &self.want, self.file_len) {
            return Ok(None);
        }
        let tag = sums_tag(digests, chunk_bytes);
        self.sums_record(&now, digests.len(), SUMS_MAGIC, tag)
    }

    /// The sums of the record after a digest area of `count` digests, when
    /// it lies before the image area (as the control block `now` places
    /// it) and its magic is `magic` and its tag `tag`.
    fn sums_record(
        &self,
        now: &Header,
        count: usize,
        magic: [u8; 8],
        tag: u64,
    ) -> Result<Option<Vec<u64>>> {
        let at = sums_at(count);
        if at.saturating_add(sums_record_len(count)) as u64 > now.image_offset {
            return Ok(None);
        }
        let mut record = vec![0u8; sums_record_len(count)];
        self.file
            .read_exact_at(&mut record, at as u64)
            .map_err(|e| Error::io("read", &self.path, e))?;
        let (fixed, body) = record.split_at(SUMS_FIXED);
        let (got_magic, got_tag) = fixed.split_at(magic.len());
        if got_magic != magic || got_tag != tag.to_le_bytes() {
            return Ok(None);
        }
        Ok(Some(decode_sums(body)))
    }

    /// The quick sums the slot records for its image without digests (a
    /// replica sealed before its digests came, or a RAM snapshot summed
    /// but not hashed), and their chunk size: `None` when digests are
    /// recorded, or the record is absent or not bound to this image (its
    /// step, length and generation). Like the bytes, they are the image's
    /// only if [`PeerSlot::unchanged`] holds afterwards.
    ///
    /// # Errors
    /// [`Error::Io`] reading the control block or the record.
    pub fn sums_alone(&self) -> Result<Option<(u64, Vec<u64>)>> {
        let Some(now) = control_block(&self.file, &self.path)? else {
            return Ok(None);
        };
        let chunk = now.chunk_bytes;
        let count = usize::try_from(now.digest_count).unwrap_or(usize::MAX);
        if !holds(&now, &self.want, self.file_len)
            || now.digests_valid != 0
            || chunk == 0
            || now.image_len.div_ceil(chunk) != count as u64
        {
            return Ok(None);
        }
        let tag = sums_alone_tag(count, chunk, [now.step, now.image_len, now.generation]);
        Ok(self
            .sums_record(&now, count, SUMS_ALONE_MAGIC, tag)?
            .map(|sums| (chunk, sums)))
    }

    /// Whether the slot still holds the same image, not reacquired since
    /// [`PeerSlot::open`]: the bytes read in between are that image's.
    ///
    /// # Errors
    /// [`Error::Io`] reading the control block.
    pub fn unchanged(&self) -> Result<bool> {
        Ok(control_block(&self.file, &self.path)?.is_some_and(|after| {
            holds(&after, &self.want, self.file_len) && after.generation == self.before.generation
        }))
    }
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
