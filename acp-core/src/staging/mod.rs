//! The shared-memory ring: named slots that hold checkpoint images in RAM.
//!
//! Each slot is a file `{shm_dir}/acp-u{euid}/{prefix}-s{index}` mapped
//! shared (`MAP_SHARED`), normally under `/dev/shm`, so its bytes outlive
//! the process that wrote them: a restarted trainer or `acp persist` finds
//! them again.
//!
//! # Where slot files live
//!
//! Slot `i` of rank `r` of job `j` is
//! `{shm_dir}/acp-u{euid}/acp-{16 hex of blake3(j)}-r{r:05}-s{i}`
//! ([`user_dir`], [`ring_prefix`], [`slot_file_name`], [`slot_path`]: the
//! one place that names them). The names are predictable, so they live in
//! a directory no other user can write: `acp-u{euid}` is created mode
//! `0700` and opened `O_DIRECTORY | O_NOFOLLOW`, and `fstat` on that
//! descriptor must say a directory owned by the effective uid with mode
//! exactly `0700`; anything else (a symlink, a file, another user's
//! directory, mode `0777`) is refused with an error that names the path,
//! its owner and the fix (another `shm_dir`). Slot files are opened
//! relative to that descriptor (`openat`). A ring holds a shared `flock`
//! on the directory until [`Ring::unlink_all`], which removes the
//! directory once it is empty and no other ring holds it. A normal close keeps the slot files,
//! and with them the directory.
//!
//! Another node's images kept here (peer replicas, [`crate::replica`])
//! live in rings of their own in the same directory:
//! `acp-{16 hex of blake3(j)}-replica-r{r:05}-on-r{h:05}-s{i}` is slot
//! `i` of rank `h`'s copy of rank `r`'s images ([`replica_prefix`]). Their
//! control blocks record rank `r`, so they follow every rule below, and
//! their slots come out of rank `h`'s ring budget.
//!
//! # Slot files
//!
//! - Created with `O_CREAT | O_RDWR | O_CLOEXEC | O_NOFOLLOW` relative to
//!   the per-user directory, mode `0600` (a file found with other
//!   permission bits is `chmod`ed to `0600`; one that is not a regular
//!   file owned by the effective uid is refused with [`Error::Busy`] or
//!   [`Error::Invalid`], naming it). Tools that read slots without a ring
//!   (`acp ls`, `acp persist`, another rank's restore from this node's
//!   RAM) ignore such a file.
//! - Locked with `flock(LOCK_EX | LOCK_NB)` for the life of the [`Ring`].
//!   A lock held elsewhere (another process, or another open of the same
//!   files in this one) makes [`Ring::open`] fail with `Busy`, naming the
//!   file and the pid recorded in its control block. The lock dies with its
//!   holder, so a crashed process never blocks the next one.
//! - [`Ring::open`] creates absent files as a single header page (4 KiB, so
//!   every slot can be locked and name its owner); the image memory is
//!   allocated lazily, by the first [`Ring::acquire`] that needs it.
//! - Layout: the control block (one page), the digest area, then the image
//!   area, each starting at a multiple of 4096:
//!
//! ```text
//!  0 ─────── 4096 ───────────────── image_offset ─────────────── file end
//!  │ header  │ digest area         │ image area (capacity bytes)      │
//!  │ page    │ 40 B per chunk + 16 │ image_len bytes of image, then   │
//!  │         │ (digests, then sums)│ zero padding to 4096, then slack │
//! ```
//!
//! # Control block
//!
//! All integers little-endian, written with explicit `to_le_bytes`.
//!
//! | offset | size | field           | meaning |
//! |-------:|-----:|-----------------|---------|
//! |      0 |    8 | `magic`         | `b"ACPSLOT1"` |
//! |      8 |    4 | `version`       | layout version, `1` |
//! |     12 |    4 | `state`         | `0` Free, `1` Staging, `2` Resident, `3` Flushing, `4` Persisted |
//! |     16 |    8 | `step`          | step of the image (valid in a complete state) |
//! |     24 |    8 | `image_len`     | image length in bytes, `≤ capacity` |
//! |     32 |    8 | `capacity`      | image area size: file size − `image_offset`, a multiple of 4096 |
//! |     40 |   32 | `job_tag`       | blake3 of the job id ([`RingOptions::job_tag`]) |
//! |     72 |    4 | `rank`          | [`RingOptions::rank`] |
//! |     76 |    4 | `owner_pid`     | pid of the process that last opened or acquired the slot |
//! |     80 |    8 | `generation`    | incremented at each acquire of the slot |
//! |     88 |    8 | `chunk_bytes`   | chunk size of the recorded digests |
//! |     96 |    4 | `digest_count`  | number of recorded digests |
//! |    100 |    4 | `digests_valid` | `1` when the digests are complete, else `0` |
//! |    104 |    8 | `image_offset`  | offset of the image area, a multiple of 4096 |
//! |    112 |    … | origin record   | the ring's checkpoint root and job id ([`Ring::record_origin`]; zero when not recorded) |
//! |      … |    … | reserved        | zero |
//! |   4096 |    … | digest area     | `digest_count` × 32-byte blake3 chunk digests |
//! | 4096 + 32 × `digest_count` | 8 | sums magic | `b"ACPXXH31"` when a sums record follows the digests; `b"ACPXXH3A"` for sums recorded alone (no digests, `digests_valid` 0) |
//! | … + 8 |    8 | sums tag        | `ACPXXH31`: xxh3-64 of `chunk_bytes` (8 bytes LE) then every recorded digest; `ACPXXH3A`: xxh3-64 of `b"acp sums alone\0\0"`, then `digest_count`, `chunk_bytes`, `step`, `image_len` and `generation` (8 bytes LE each) |
//! | … + 16 | 8 × `digest_count` | quick sums | xxh3-64 of each chunk ([`Ring::record_quick_sums`]) |
//!
//! The digest area holds one digest and one quick sum per `chunk_bytes` of
//! the largest image the budget allows a slot, plus the sums record's
//! 16 bytes, rounded up to 4096 bytes, so every slot of a ring has the same
//! `image_offset` whatever its current size. A slot laid out by an older
//! version (32 bytes per chunk) keeps its layout, version `1` and its
//! digests; a sums record that does not fit before its `image_offset` is
//! not written, and the slot has no sums.
//!
//! The sums record is written after the digests (magic zeroed, tag and
//! sums written, magic last) and believed only while its magic is ours and
//! its tag is that of the digests and chunk size recorded now: recording
//! digests (or clearing them) zeroes the magic of the record beside the
//! old ones first, and digests recorded by a writer that knows nothing of
//! the record leave a tag that no longer matches. Sums recorded alone (a RAM
//! snapshot summed, not hashed) set `digest_count` and `chunk_bytes` with
//! `digests_valid` 0, and are believed only for the image their tag names:
//! recording digests or clearing them unmakes them the same way, and an
//! image staged later in the slot has another generation. What the sums
//! prove, and why they may live in shared memory, is in `read/fast.rs`.
//!
//! A control block whose magic, version, job tag or rank is not ours, whose
//! state code is unknown, or that claims a complete image with inconsistent
//! fields (an `image_offset` or `capacity` that does not match the file,
//! `image_len > capacity`, `chunk_bytes == 0`) is not trusted: the slot is
//! reinitialised as `Free`. Digests recorded for another chunk size are
//! dropped (`digests_valid` cleared), the image kept.
//!
//! # State machine
//!
//! ```text
//!            acquire             seal              set_state            set_state
//!   Free ──────────────▶ Staging ──────▶ Resident ───────────▶ Flushing ───────────▶ Persisted
//!    ▲  ◀────────────────── │               └──────────◀───────────┴────────◀───────────┘
//!    │   StagingSlot dropped                     (set_state moves between any of the three)
//!    │   unsealed, or a failed grow
//!    │
//!    ├──── release / set_state(Free), once the last pin drops ◀── Resident, Flushing, Persisted
//!    │
//!    └ (acquire also takes the unpinned Persisted slot with the oldest step ─▶ Staging)
//! ```
//!
//! - **Free**: holds nothing; [`Ring::acquire`] takes it first.
//! - **Staging**: owned by exactly one [`StagingSlot`], the only writer of
//!   the image area. Never pinned, never handed out twice.
//! - **Resident / Flushing / Persisted**: the image is complete and
//!   read-only; any number of [`PinnedSlot`]s read it. The flush moves it
//!   along with [`Ring::set_state`].
//! - [`Ring::acquire`] takes a `Free` slot, else the unpinned `Persisted`
//!   slot with the oldest step; never a pinned, `Staging`, `Resident` or
//!   `Flushing` one. [`Ring::release`] frees a complete slot, at once or
//!   when its last pin drops (it stops being listed or pinnable at once).
//!
//! In a process, the table of states and pin counts behind one mutex is
//! the truth, and every state change is written through to the control
//! block; control-block bytes are only touched with that mutex held. The
//! image area is written only through a `StagingSlot`, which exists only
//! while its slot is `Staging` with no pin, and read only through
//! `PinnedSlot`s, which exist only while it is complete; this is what makes
//! handing the same mapping to several threads sound.
//!
//! # Write order, and what a process death leaves
//!
//! Acquire stores the state `Staging` before it changes anything else.
//! Seal stores `step` and `image_len` after the caller's image bytes, then
//! a release fence, then the state word `Resident`. Digests are recorded
//! with `digests_valid = 0` first and `1` last, the quick sums after
//! them; freeing clears the sums and then `digests_valid` before the
//! state becomes `Free`. A process death (even
//! `SIGKILL`) loses no store already made: the bytes are in the shared
//! file, not in the process. So the next [`Ring::open`] finds:
//!
//! | state at death | what the next open does |
//! |---|---|
//! | `Free` | nothing to recover; the slot is reused |
//! | `Staging` (mid-acquire, mid-copy, or mid-seal before the state store) | the image is incomplete: reset to `Free` and counted in [`RingReport::discarded_half_staged`] |
//! | `Resident` | recovered intact: the checkpoint was not flushed, so the new process (or `acp persist`) can flush it |
//! | `Flushing` | recovered intact; the flush may have written part of a file, which was never committed, so it is flushed again |
//! | `Persisted` | recovered intact; it is already in storage and is a fast restore source |
//! | between the digest stores | `digests_valid` is `0`: image recovered without digests |
//!
//! A slot being regrown (ftruncate/fallocate) when its process died is in
//! `Staging` and discarded likewise; a file cut short is caught by the
//! `capacity` check. Files of indices past [`RingOptions::slots`] are
//! neither opened nor removed.
//!
//! # Memory
//!
//! The budget is split evenly: each slot may use `budget / slots` bytes
//! (rounded down to 4096), control area included; the largest image is
//! [`Ring::max_image_bytes`]. A slot's file is sized to the control area
//! plus the image length rounded up to 2 MiB (at most the per-slot share),
//! so small changes in size reuse it. Growing `ftruncate`s and
//! `fallocate`s the file (a full tmpfs fails there with `ENOSPC` instead of
//! `SIGBUS` later), maps it with `MAP_POPULATE`, faults each page in for
//! writing, and `mlock`s it when asked. A slot grows when taken by
//! `acquire`, or, taken as `Staging` for the time, by
//! [`Ring::warm_next`] given the saves' image length (an `acquire` that
//! finds only that slot waits for it rather than report the ring full), so
//! steady-state saves touch no fresh page. An open only maps the slots it
//! keeps (no page is touched on the open's path); [`Ring::warm_next`]
//! faults them in and locks them with `MADV_POPULATE_WRITE` and `mlock`,
//! which change no byte, so loads may read them meanwhile, and an
//! `acquire` of a slot not yet warmed faults it in itself. `mlock` failure (an ordinary
//! user past `RLIMIT_MEMLOCK`, without `CAP_IPC_LOCK`) is reported in
//! [`RingReport`] and [`Ring::mlock_state`], never fatal: the slots stay
//! pre-faulted. A recovered slot larger than the current per-slot share
//! (the budget shrank) is kept until reused, then shrunk.
//!
//! [`Error::Busy`]: crate::Error::Busy
//! [`Error::Invalid`]: crate::Error::Invalid

#![allow(
    unsafe_code,
    reason = "slots are shared memory mappings handed to several threads"
)]

mod control;
mod dir;
mod handles;
mod open;
mod origin;
mod peek;
mod peer;
mod ring;
mod rings;
mod room;
mod slot;
mod table;
mod warm;

use std::path::PathBuf;

use crate::format::Digest;

pub use dir::{
    job_id, job_tag, replica_files, replica_prefix, ring_prefix, slot_file_name, slot_files,
    slot_path, user_dir, user_dir_name, SlotDir, SlotFile,
};
pub use handles::{PinnedSlot, StagingSlot};
pub use origin::{read_origin, Origin};
pub use peek::{peek_file, peek_slot, SlotPeek};
pub use peer::{PeerImage, PeerSlot};
pub use ring::{Ring, WarmDeferral};
pub use rings::{rings, HeldRing, RingFiles, SlotSeen};
pub use room::{in_ram, shm_room, ShmRoom};
pub(crate) use warm::Warm;

/// Where and how big the ring is.
#[derive(Debug, Clone)]
pub struct RingOptions {
    /// The shared-memory directory, e.g. `/dev/shm`: the slot files live
    /// in its per-user directory [`user_dir`]`(dir)`.
    pub dir: PathBuf,
    /// File name prefix, unique per job and rank, e.g.
    /// `acp-0123456789abcdef-r00000` ([`ring_prefix`]).
    pub prefix: String,
    /// blake3 of the job id; stored in each control block and checked on open.
    pub job_tag: Digest,
    /// The rank; stored and checked like `job_tag`.
    pub rank: u32,
    /// Number of slots.
    pub slots: usize,
    /// Memory budget over all slots (control blocks included), in bytes.
    pub budget: u64,
    /// Whether the slots share the budget: any slot may grow to all of it,
    /// while the other slots' files leave room for it. Else each slot gets
    /// `budget / slots`. A ring sized from the room it found (no
    /// `ring_bytes` given) shares it, so that a checkpoint too large for
    /// two slots still saves in one.
    pub shared_budget: bool,
    /// Digest chunk size, to size each slot's digest area.
    pub chunk_bytes: u64,
    /// Try to `mlock` the slots.
    pub mlock: bool,
}

/// The state of a slot, as stored in its control block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// Holds nothing.
    Free,
    /// Being written; its image is incomplete.
    Staging,
    /// Holds a complete image not yet flushed.
    Resident,
    /// Holds a complete image being flushed.
    Flushing,
    /// Holds a complete image that is committed in storage.
    Persisted,
}

/// A slot that holds a complete image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    /// Slot index.
    pub slot: usize,
    /// The step of its image.
    pub step: u64,
    /// The image length.
    pub len: u64,
    /// Its state (`Resident`, `Flushing` or `Persisted`).
    pub state: SlotState,
    /// Whether chunk digests are recorded for it.
    pub has_digests: bool,
}

/// What opening the ring found and did.
#[derive(Debug, Clone, Default)]
pub struct RingReport {
    /// Whether every slot is locked in RAM: `mlock` was asked for, every
    /// slot mapped at open was locked, and the process may lock the whole
    /// budget (`CAP_IPC_LOCK`, or `RLIMIT_MEMLOCK` at least the budget).
    pub mlocked: bool,
    /// Why `mlock` was refused, when it was.
    pub mlock_error: Option<String>,
    /// Complete images left by a previous process of this job and rank,
    /// newest step first.
    pub recovered: Vec<SlotInfo>,
    /// Slots found half-staged (their process died while staging); reset to Free.
    pub discarded_half_staged: usize,
}
