//! The control block of a slot file (its bytes are specified in the
//! [module docs](super)) and the sizes the budget gives each slot.

use crate::error::{Error, Result};
use crate::format::Digest;

use super::SlotState;

/// The first bytes of every slot file.
pub(super) const MAGIC: [u8; 8] = *b"ACPSLOT1";
/// The layout version stored after the magic.
pub(super) const VERSION: u32 = 1;
/// Page size the layout is aligned to.
pub(super) const PAGE: u64 = 4096;
/// The header page at offset 0; the digest area follows it.
pub(super) const HEADER_PAGE: u64 = 4096;
/// Slot image areas grow in steps of this many bytes, so small changes in
/// the image size do not regrow (and re-fault) a slot.
pub(super) const GROW_STEP: u64 = 2 << 20;
/// Bytes per recorded chunk digest.
pub(super) const DIGEST_LEN: u64 = 32;
/// [`HEADER_PAGE`] as a `usize`, for offsets into a mapping.
pub(super) const HEADER_BYTES: usize = 4096;
/// [`DIGEST_LEN`] as a `usize`.
pub(super) const DIGEST_BYTES: usize = 32;
/// Bytes per recorded quick sum (xxh3-64), in the sums record.
pub(super) const SUM_LEN: u64 = 8;
/// [`SUM_LEN`] as a `usize`.
pub(super) const SUM_BYTES: usize = 8;
/// The first bytes of a sums record; a record whose magic differs (none
/// written, a later layout) is no record.
pub(super) const SUMS_MAGIC: [u8; 8] = *b"ACPXXH31";
/// The first bytes of a sums record written without digests (a RAM
/// snapshot summed but never persisted: [`sums_alone_tag`]); a reader of a
/// version that knows only [`SUMS_MAGIC`] finds no record there.
pub(super) const SUMS_ALONE_MAGIC: [u8; 8] = *b"ACPXXH3A";
/// Bytes of a sums record before the sums: the magic, then the `u64` tag
/// ([`sums_tag`], [`sums_alone_tag`]).
pub(super) const SUMS_FIXED: usize = 16;

/// Byte offsets of the control-block fields.
pub(super) mod off {
    /// `[u8; 8]` magic.
    pub(in super::super) const MAGIC: usize = 0;
    /// `u32` layout version.
    pub(in super::super) const VERSION: usize = 8;
    /// `u32` state code (the word whose store publishes a seal).
    pub(in super::super) const STATE: usize = 12;
    /// `u64` step of the image.
    pub(in super::super) const STEP: usize = 16;
    /// `u64` image length.
    pub(in super::super) const IMAGE_LEN: usize = 24;
    /// `u64` image area size.
    pub(in super::super) const CAPACITY: usize = 32;
    /// `[u8; 32]` job tag.
    pub(in super::super) const JOB_TAG: usize = 40;
    /// `u32` rank.
    pub(in super::super) const RANK: usize = 72;
    /// `u32` pid of the process that last opened the slot.
    pub(in super::super) const PID: usize = 76;
    /// `u64` generation, incremented at each acquire.
    pub(in super::super) const GENERATION: usize = 80;
    /// `u64` chunk size of the recorded digests.
    pub(in super::super) const CHUNK_BYTES: usize = 88;
    /// `u32` number of recorded digests.
    pub(in super::super) const DIGEST_COUNT: usize = 96;
    /// `u32` 1 when the digests are complete, else 0.
    pub(in super::super) const DIGESTS_VALID: usize = 100;
    /// `u64` offset of the image area.
    pub(in super::super) const IMAGE_OFFSET: usize = 104;
    /// End of the fields; bytes up to 4096 are reserved and zero.
    pub(in super::super) const END: usize = 112;
}

impl SlotState {
    /// The code stored in the control block.
    pub(super) fn code(self) -> u32 {
        match self {
            SlotState::Free => 0,
            SlotState::Staging => 1,
            SlotState::Resident => 2,
            SlotState::Flushing => 3,
            SlotState::Persisted => 4,
        }
    }

    /// The state of a stored code; `None` for an unknown one.
    pub(super) fn from_code(code: u32) -> Option<SlotState> {
        match code {
            0 => Some(SlotState::Free),
            1 => Some(SlotState::Staging),
            2 => Some(SlotState::Resident),
            3 => Some(SlotState::Flushing),
            4 => Some(SlotState::Persisted),
            _ => None,
        }
    }

    /// Whether a slot in this state holds a complete image.
    pub(super) fn is_complete(self) -> bool {
        matches!(
            self,
            SlotState::Resident | SlotState::Flushing | SlotState::Persisted
        )
    }
}

/// The fields of a control block (magic and version are implied).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Header {
    /// Raw state code.
    pub(super) state: u32,
    /// Step of the image.
    pub(super) step: u64,
    /// Image length.
    pub(super) image_len: u64,
    /// Image area size.
    pub(super) capacity: u64,
    /// Job tag.
    pub(super) job_tag: Digest,
    /// Rank.
    pub(super) rank: u32,
    /// Owner pid.
    pub(super) pid: u32,
    /// Generation.
    pub(super) generation: u64,
    /// Chunk size of the digests.
    pub(super) chunk_bytes: u64,
    /// Number of digests.
    pub(super) digest_count: u32,
    /// 1 when the digests are complete.
    pub(super) digests_valid: u32,
    /// Offset of the image area.
    pub(super) image_offset: u64,
}

fn get<const N: usize>(b: &[u8], at: usize) -> [u8; N] {
    let mut a = [0u8; N];
    a.copy_from_slice(&b[at..at + N]);
    a
}

impl Header {
    /// The control block bytes `0..off::END`.
    pub(super) fn encode(&self) -> [u8; off::END] {
        let mut b = [0u8; off::END];
        let mut put = |at: usize, v: &[u8]| b[at..at + v.len()].copy_from_slice(v);
        put(off::MAGIC, &MAGIC);
        put(off::VERSION, &VERSION.to_le_bytes());
        put(off::STATE, &self.state.to_le_bytes());
        put(off::STEP, &self.step.to_le_bytes());
        put(off::IMAGE_LEN, &self.image_len.to_le_bytes());
        put(off::CAPACITY, &self.capacity.to_le_bytes());
        put(off::JOB_TAG, &self.job_tag);
        put(off::RANK, &self.rank.to_le_bytes());
        put(off::PID, &self.pid.to_le_bytes());
        put(off::GENERATION, &self.generation.to_le_bytes());
        put(off::CHUNK_BYTES, &self.chunk_bytes.to_le_bytes());
        put(off::DIGEST_COUNT, &self.digest_count.to_le_bytes());
        put(off::DIGESTS_VALID, &self.digests_valid.to_le_bytes());
        put(off::IMAGE_OFFSET, &self.image_offset.to_le_bytes());
        b
    }

    /// Parses a control block; `None` when `b` is short or its magic or
    /// version is not ours.
    pub(super) fn decode(b: &[u8]) -> Option<Header> {
        if b.len() < off::END
            || get::<8>(b, off::MAGIC) != MAGIC
            || u32::from_le_bytes(get(b, off::VERSION)) != VERSION
        {
            return None;
        }
        Some(Header {
            state: u32::from_le_bytes(get(b, off::STATE)),
            step: u64::from_le_bytes(get(b, off::STEP)),
            image_len: u64::from_le_bytes(get(b, off::IMAGE_LEN)),
            capacity: u64::from_le_bytes(get(b, off::CAPACITY)),
            job_tag: get(b, off::JOB_TAG),
            rank: u32::from_le_bytes(get(b, off::RANK)),
            pid: u32::from_le_bytes(get(b, off::PID)),
            generation: u64::from_le_bytes(get(b, off::GENERATION)),
            chunk_bytes: u64::from_le_bytes(get(b, off::CHUNK_BYTES)),
            digest_count: u32::from_le_bytes(get(b, off::DIGEST_COUNT)),
            digests_valid: u32::from_le_bytes(get(b, off::DIGESTS_VALID)),
            image_offset: u64::from_le_bytes(get(b, off::IMAGE_OFFSET)),
        })
    }

    /// Checks that a header claiming a complete image describes a file of
    /// `file_len` bytes consistently; the reason when it does not.
    pub(super) fn check_complete(&self, file_len: u64) -> std::result::Result<(), String> {
        let off = self.image_offset;
        if off < HEADER_PAGE + PAGE || off % PAGE != 0 {
            return Err(format!(
                "image offset {off} is not a page-aligned offset past the digest area"
            ));
        }
        if off >= file_len || self.capacity != file_len - off {
            return Err(format!(
                "capacity {} does not match a file of {file_len} bytes with the image at {off}",
                self.capacity
            ));
        }
        if self.capacity % PAGE != 0 {
            return Err(format!(
                "capacity {} is not a multiple of {PAGE}",
                self.capacity
            ));
        }
        if self.image_len > self.capacity {
            return Err(format!(
                "image length {} exceeds the capacity {}",
                self.image_len, self.capacity
            ));
        }
        if self.chunk_bytes == 0 {
            return Err("chunk size 0".to_owned());
        }
        Ok(())
    }

    /// Whether the recorded digests can be trusted for chunks of
    /// `chunk_bytes` in a digest area ending at the image offset.
    pub(super) fn digests_usable(&self, chunk_bytes: u64) -> bool {
        self.digests_valid == 1
            && self.chunk_bytes == chunk_bytes
            && self
                .image_offset
                .checked_sub(HEADER_PAGE)
                .is_some_and(|room| u64::from(self.digest_count) * DIGEST_LEN <= room)
    }
}

/// Offset of the sums record of a slot whose digest area holds `count`
/// digests: right after them.
pub(super) fn sums_at(count: usize) -> usize {
    HEADER_BYTES + count * DIGEST_BYTES
}

/// Bytes of the sums record for `count` sums.
pub(super) fn sums_record_len(count: usize) -> usize {
    SUMS_FIXED + count * SUM_BYTES
}

/// The sums of a sums record's body (`SUM_BYTES` each, little-endian).
pub(super) fn decode_sums(body: &[u8]) -> Vec<u64> {
    body.chunks_exact(SUM_BYTES)
        .map(|b| {
            let mut a = [0u8; SUM_BYTES];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        })
        .collect()
}

/// The tag that binds a sums record to the digests it was taken beside:
/// the xxh3-64 of the chunk size and every digest. A record is believed
/// only while its tag is that of the digests recorded now, so digests
/// recorded again by any writer (one that knows nothing of sums
/// included) leave the old record unbelieved.
pub(super) fn sums_tag(digests: &[Digest], chunk_bytes: u64) -> u64 {
    let mut b = Vec::with_capacity(8 + digests.len() * DIGEST_BYTES);
    b.extend_from_slice(&chunk_bytes.to_le_bytes());
    for d in digests {
        b.extend_from_slice(d);
    }
    twox_hash::XxHash3_64::oneshot(&b)
}

/// The tag that binds a sums record written without digests to the image
/// it was taken from: the xxh3-64 of a domain string, the sum count, the
/// chunk size and the image's step, length and slot generation (each 8
/// bytes LE), as the header records them. A record left by an earlier
/// image of the slot (another generation) is not believed for a later one.
pub(super) fn sums_alone_tag(count: usize, chunk_bytes: u64, image: [u64; 3]) -> u64 {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(b"acp sums alone\0\0");
    b.extend_from_slice(&(count as u64).to_le_bytes());
    b.extend_from_slice(&chunk_bytes.to_le_bytes());
    for v in image {
        b.extend_from_slice(&v.to_le_bytes());
    }
    twox_hash::XxHash3_64::oneshot(&b)
}

/// Rounds `v` up to a multiple of `to` (a power of two); `None` on overflow.
pub(super) fn round_up(v: u64, to: u64) -> Option<u64> {
    Some(v.checked_add(to - 1)? & !(to - 1))
}

/// Rounds `v` down to a multiple of `to` (a power of two).
pub(super) fn round_down(v: u64, to: u64) -> u64 {
    v & !(to - 1)
}

/// What the budget gives each slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Layout {
    /// Budget per slot, rounded down to a page.
    pub(super) per_slot: u64,
    /// Header page plus digest area: the image offset of slots we lay out.
    pub(super) ctrl_len: u64,
    /// The largest image a slot may hold.
    pub(super) max_image: u64,
}

impl Layout {
    /// The layout for `slots` slots sharing `budget` bytes, with a digest
    /// area that holds one digest and one quick sum per `chunk_bytes` of
    /// the largest image, and the sums record's fixed part. With `shared`,
    /// one slot may take the whole budget ([`RingOptions::shared_budget`]);
    /// else each gets `budget / slots`.
    ///
    /// [`RingOptions::shared_budget`]: super::RingOptions::shared_budget
    ///
    /// # Errors
    /// [`Error::Invalid`] when there are no slots, the chunk size is 0, or
    /// the budget leaves a slot no room for one page of image.
    pub(super) fn new(budget: u64, slots: usize, chunk_bytes: u64, shared: bool) -> Result<Layout> {
        let what = "ring options";
        if slots == 0 {
            return Err(Error::invalid(what, "the ring needs at least one slot"));
        }
        if chunk_bytes == 0 {
            return Err(Error::invalid(what, "chunk_bytes must be positive"));
        }
        let n = u64::try_from(slots).map_err(|_| Error::invalid(what, "too many slots"))?;
        let per_slot = round_down(if shared { budget } else { budget / n }, PAGE);
        let digests = per_slot.div_ceil(chunk_bytes);
        let digest_area = digests
            .checked_mul(DIGEST_LEN + SUM_LEN)
            .and_then(|b| b.checked_add(SUMS_FIXED as u64))
            .and_then(|b| round_up(b, PAGE))
            .ok_or_else(|| Error::invalid(what, "digest area overflows"))?;
        let ctrl_len = HEADER_PAGE + digest_area;
        let max_image = round_down(per_slot.saturating_sub(ctrl_len), PAGE);
        if max_image == 0 {
            return Err(Error::invalid(
                what,
                format!(
                    "a budget of {budget} bytes over {slots} slots leaves no room for an image \
                     beside a {ctrl_len}-byte control area (chunk size {chunk_bytes})"
                ),
            ));
        }
        Ok(Layout {
            per_slot,
            ctrl_len,
            max_image,
        })
    }

    /// The image area size a slot gets for an image of `len` bytes: `len`
    /// rounded up to [`GROW_STEP`], at most `max_image`.
    pub(super) fn capacity_for(&self, len: u64) -> u64 {
        round_up(len.max(1), GROW_STEP).map_or(self.max_image, |c| c.min(self.max_image))
    }

    /// The size of a slot file readied for an image of `len` bytes: its
    /// control block and [`Layout::capacity_for`].
    pub(super) fn file_for(&self, len: u64) -> u64 {
        self.ctrl_len + self.capacity_for(len)
    }

    /// Whether a mapping with its image at `image_off` and `capacity` bytes
    /// of image area fits this layout and can take an image of `len` bytes.
    pub(super) fn fits(&self, image_off: u64, capacity: u64, len: u64) -> bool {
        image_off == self.ctrl_len
            && capacity >= len
            && capacity % PAGE == 0
            && capacity <= self.max_image
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header() -> Header {
        Header {
            state: 2,
            step: 0x0102_0304_0506_0708,
            image_len: 5000,
            capacity: 8192,
            job_tag: [7; 32],
            rank: 3,
            pid: 4242,
            generation: 9,
            chunk_bytes: 1 << 20,
            digest_count: 1,
            digests_valid: 1,
            image_offset: 8192,
        }
    }

    #[test]
    fn header_round_trips_and_is_little_endian() {
        let h = header();
        let b = h.encode();
        assert_eq!(&b[..8], b"ACPSLOT1");
        assert_eq!(b[8..12], [1, 0, 0, 0]);
        assert_eq!(b[12..16], [2, 0, 0, 0]);
        assert_eq!(b[16..24], [8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(b[72..76], [3, 0, 0, 0]);
        assert_eq!(Header::decode(&b), Some(h));
    }

    #[test]
    fn wrong_magic_or_version_is_not_a_header() {
        let mut b = header().encode();
        b[0] = b'X';
        assert_eq!(Header::decode(&b), None);
        let mut b = header().encode();
        b[8] = 2;
        assert_eq!(Header::decode(&b), None);
        assert_eq!(Header::decode(&[0u8; 16]), None);
    }

    #[test]
    fn complete_header_checks() {
        let h = header();
        assert!(h.check_complete(16384).is_ok());
        assert!(h.check_complete(20000).is_err());
        let mut bad = h.clone();
        bad.image_len = 8193;
        assert!(bad.check_complete(16384).is_err());
        let mut bad = h.clone();
        bad.image_offset = 4096;
        bad.capacity = 12288;
        assert!(bad.check_complete(16384).is_err());
        assert!(h.digests_usable(1 << 20));
        assert!(!h.digests_usable(1 << 19));
    }

    #[test]
    fn layout_from_budget() {
        let l = Layout::new(8 << 20, 2, 1 << 20, false).unwrap();
        assert_eq!(l.per_slot, 4 << 20);
        assert_eq!(l.ctrl_len, 8192);
        assert_eq!(l.max_image, (4 << 20) - 8192);
        assert_eq!(l.capacity_for(0), 2 << 20);
        assert_eq!(l.capacity_for((2 << 20) + 1), l.max_image);
        // 1000 digests of 32 bytes and their 8-byte sums, behind the
        // record's 16 bytes, need 10 pages.
        let l = Layout::new(1000 * 4096 * 3, 3, 4096, false).unwrap();
        assert_eq!(l.ctrl_len, 4096 + 40016_u64.div_ceil(4096) * 4096);
        assert!(Layout::new(8192, 1, 4096, false).is_err());
        assert!(Layout::new(1 << 30, 0, 4096, false).is_err());
        assert!(Layout::new(1 << 30, 1, 0, false).is_err());
        // Shared: one slot may take all of it.
        let l = Layout::new(8 << 20, 2, 1 << 20, true).unwrap();
        assert_eq!(l.per_slot, 8 << 20);
        assert_eq!(l.max_image, (8 << 20) - 8192);
    }
}
