//! Peer replicas: a copy of each rank's resident image in the RAM of ranks
//! on other nodes, so a replaced node restores from a peer's memory rather
//! than from storage, and a step that was only resident survives the loss
//! of one node.
//!
//! # Pieces
//!
//! - [`Transport`]: what moves images between ranks: send an image to a
//!   peer (which receives it into a replica slot), list the replicas a
//!   peer holds, fetch one for a restore, and say which peers hold a
//!   rank's replicas. [`Loopback`] is the in-process one (tests, and
//!   several engines in one process); the PyTorch binding drives its own
//!   exchange over a dedicated `torch.distributed` gloo group with the
//!   same engine calls a transport uses
//!   ([`Engine::resident_replica`](crate::Engine::resident_replica),
//!   [`Engine::receive_replica`](crate::Engine::receive_replica),
//!   [`Engine::pin_replica`](crate::Engine::pin_replica)). A transport
//!   that drives its own exchange brackets each one with
//!   [`Engine::hold_replicating`](crate::Engine::hold_replicating) and
//!   [`Engine::release_replicating`](crate::Engine::release_replicating)
//!   and calls [`Engine::protect`](crate::Engine::protect) once every
//!   holder has the image, so the newest replicated step stays resident on
//!   the sender's node; it also brackets the sends themselves with
//!   [`Engine::exchange_started`](crate::Engine::exchange_started) and
//!   [`Engine::exchange_ended`](crate::Engine::exchange_ended), so that the
//!   step's own persist waits for them
//!   ([`Engine::replicate`](crate::Engine::replicate) does all of it).
//! - The replica store of an engine: rank `h`'s copies of rank `r`'s
//!   images live in a ring of their own in `h`'s shared-memory directory,
//!   named by [`replica_prefix`](crate::staging::replica_prefix)
//!   (`acp-{job}-replica-r{r}-on-r{h}-s{i}`), two slots per source rank:
//!   the two newest complete replicas are kept, and the older one's slot
//!   takes the next one, so the newest stays while it is received and the
//!   previous step stays while the newest may not have reached every
//!   holder (an exchange broken off by a lost node).
//!   Their memory comes out of `h`'s ring budget
//!   ([`EngineConfig::with_replicas_held`](crate::EngineConfig::with_replicas_held)),
//!   they are listed by `acp ls --shm`, and they outlive the holder's
//!   process like its own slots.
//!
//! # What a replica carries, and how it is checked
//!
//! An image travels with its [`ReplicaMeta`]: the rank, step, length, the
//! blake3 digest of each chunk and the xxh3-64 quick sum of each chunk,
//! both computed by the sender off the stall in one pass (each chunk's sum
//! before its digest), or taken from the flush or the snapshot hash when
//! one already hashed the slot. The holder records the digests in the
//! replica slot's digest area and the sums beside them, bound to them
//! (`read/fast.rs`: a sums record is believed only while the digests it
//! was recorded with are the slot's).
//!
//! A transport may also send the sums first and the digests after
//! ([`Engine::resident_sums`](crate::Engine::resident_sums),
//! [`Engine::digests_to_send`](crate::Engine::digests_to_send)), so that an
//! image counts as replicated before anyone hashed it with blake3 (the
//! PyTorch exchange does): the holder seals the slot with the sums alone
//! ([`ReplicaWriter::finish_with_sums`] without digests; the record is
//! bound to the image's step, length and slot generation), and binds it
//! to the digests when they come
//! ([`Engine::add_replica_digests`](crate::Engine::add_replica_digests)).
//! A RAM snapshot's replicas keep their sums alone: its sender has no
//! digests unless the step is persisted.
//!
//! Nothing of a replica reaches a caller before every chunk was checked:
//! a replica fetched from a peer whose digests are the ones wanted (the
//! committed index's when the step is committed, else its own) is checked
//! against its quick sums; one of a step that is not committed with its
//! sums alone is checked against them, as this rank's own RAM snapshot is;
//! one without sums, one of a committed step without digests, or one with
//! a chunk that does not give its sum goes to the one verified reader
//! (`crate::read`), which checks every chunk against the digests wanted
//! with blake3 and names what is wrong. A replica slot read on this node
//! is checked with blake3, or by its sums alone for a step not committed.
//! A replica that is missing, of another length, or that fails
//! verification is skipped with a log line naming it, and the restore
//! takes the next source.
//!
//! What the quick sums stand for: a chunk that still gives the sum its
//! sender took from the bytes its digest describes is, but for a chance
//! of 2⁻⁶⁴ per changed chunk, those bytes, so any accidental change on the
//! way (a flipped bit in transit or in RAM, a truncated or misdirected
//! receive, a stray write into a replica slot) is caught, as blake3 would
//! catch it, at several times its speed. They are no defence against a
//! party that forges bytes together with matching sums: a rank of the job
//! (which could as well write the job's files and index in storage) or
//! whoever can rewrite the transport's traffic (gloo's TCP is neither
//! authenticated nor encrypted, and carries the training's own collectives
//! in the clear). Against those, blake3 against a committed index would
//! still catch forged bytes of a committed step; the sums do not.
//!
//! # Guarantees
//!
//! A step is *replicated* once every holder of this rank's image has it
//! complete in a replica slot, sealed with its digests or its quick sums
//! ([`ReplicaHandle::wait`]). Losing one node
//! then loses no replicated step: each of its ranks' images is in another
//! node's RAM. Two nodes lost together lose the steps whose only RAM
//! copies were on them (an image and its replicas); committed steps stay
//! in storage. A replica in flight when its holder dies is never used: a
//! slot is complete only once sealed, and a restore checks every chunk.

mod handle;
mod loopback;
mod store;

use std::fmt;
use std::path::Path;

pub use handle::ReplicaHandle;
pub use loopback::Loopback;
pub use store::ReplicaWriter;
pub(crate) use store::{sums_of, Store, StoreOptions, SLOTS_PER_SOURCE};

use crate::error::{Error, Result};
use crate::format::{chunk_digests, Digest, FileEntry};

/// What travels with a replica's image: whose it is and its chunk digests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaMeta {
    /// The rank whose image it is.
    pub rank: u32,
    /// Its step.
    pub step: u64,
    /// The image length in bytes.
    pub len: u64,
    /// The digest chunk size in bytes.
    pub chunk_bytes: u64,
    /// blake3 of each `chunk_bytes` piece of the image (the last may be
    /// shorter).
    pub digests: Vec<Digest>,
    /// The xxh3-64 quick sum of each piece, taken from the same bytes in
    /// the same pass as `digests` (`read/fast.rs`), or empty when the
    /// sender has none: what a holder or a restoring rank checks the bytes
    /// against instead of hashing them with blake3 again, once `digests`
    /// are the ones wanted (see the [module docs](self)).
    pub sums: Vec<u64>,
}

impl ReplicaMeta {
    /// The metadata of `image` (rank `rank`'s image of `step`), hashing it
    /// in chunks of `chunk_bytes`.
    #[must_use]
    pub fn of_image(rank: u32, step: u64, image: &[u8], chunk_bytes: u64) -> ReplicaMeta {
        let chunk = usize::try_from(chunk_bytes).unwrap_or(usize::MAX);
        ReplicaMeta {
            rank,
            step,
            len: image.len() as u64,
            chunk_bytes,
            digests: chunk_digests(image, chunk),
            sums: image
                .chunks(chunk.max(1))
                .map(crate::read::fast_sum)
                .collect(),
        }
    }

    /// The index entry these digests make: what the verified reader checks
    /// a replica's bytes against when its step is not committed.
    #[must_use]
    pub fn entry(&self) -> FileEntry {
        // A replica is the RAM image, which is always plain.
        FileEntry::plain(self.rank, self.len, self.chunk_bytes, &self.digests)
    }

    /// Checks that the fields describe an image a replica slot may take:
    /// a chunk size of `chunk_bytes` (the receiver's), one digest per
    /// chunk and one quick sum per chunk or none, or no digests and one
    /// quick sum per chunk (a replica sealed before its digests come).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the replica.
    pub fn check(&self, chunk_bytes: u64) -> Result<()> {
        if self.chunk_bytes != chunk_bytes {
            return Err(Error::invalid(
                self.what(),
                format!(
                    "digest chunks of {} bytes, this engine's are {chunk_bytes}",
                    self.chunk_bytes
                ),
            ));
        }
        let want = self.len.div_ceil(chunk_bytes.max(1));
        // Sums alone (digests to come) are one per chunk too.
        let sums_alone = self.digests.is_empty() && self.sums.len() as u64 == want;
        if self.digests.len() as u64 != want && !sums_alone {
            return Err(Error::invalid(
                self.what(),
                format!(
                    "{} digests for {} bytes in chunks of {chunk_bytes} ({want} expected, \
                     or none with one quick sum per chunk)",
                    self.digests.len(),
                    self.len
                ),
            ));
        }
        if !self.sums.is_empty() && self.sums.len() as u64 != want {
            return Err(Error::invalid(
                self.what(),
                format!(
                    "{} quick sums for {} bytes in chunks of {chunk_bytes} (one per chunk, \
                     or none)",
                    self.sums.len(),
                    self.len
                ),
            ));
        }
        Ok(())
    }

    /// "replica of rank R's step S", for messages.
    #[must_use]
    pub fn what(&self) -> String {
        format!("replica of rank {}'s step {}", self.rank, self.step)
    }
}

/// Private page-aligned memory for one image, as a restore reads into.
#[derive(Debug)]
pub struct ImageBuf {
    map: memmap2::MmapMut,
    len: usize,
}

impl ImageBuf {
    /// Zeroed memory for an image of `len` bytes (padded to a page).
    ///
    /// # Errors
    /// [`Error::Io`] when the memory cannot be mapped.
    pub fn new(len: u64) -> Result<ImageBuf> {
        let n = usize::try_from(len).map_err(|_| {
            Error::invalid(format!("image of {len} bytes"), "exceeds the address space")
        })?;
        // An image is written whole (received into): its pages are taken
        // first, in one call.
        let map = crate::read::image_memory(n, Path::new("replica image"))?;
        Ok(ImageBuf { map, len: n })
    }

    /// The image bytes.
    #[must_use]
    pub fn as_slice(&self) -> &[u8] {
        &self.map[..self.len]
    }

    /// The image bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[..self.len]
    }

    /// The image length.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the image is empty.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub(crate) fn into_parts(self) -> (memmap2::MmapMut, usize) {
        (self.map, self.len)
    }
}

/// A replica fetched from a peer: its metadata as the holder recorded it,
/// the bytes (not yet verified) and where they came from, for messages.
#[derive(Debug)]
pub struct Fetched {
    /// What the holder says the image is.
    pub meta: ReplicaMeta,
    /// The bytes, exactly `meta.len` of them.
    pub image: ImageBuf,
    /// Where they came from (e.g. "rank 2: /dev/shm/acp-u1000/…-s0").
    pub origin: String,
}

/// Moves resident images between ranks (see the [module docs](self)).
///
/// An implementation must not block or reorder the training's own
/// communication (use a channel of its own), and must give up with an
/// error rather than wait for ever on a peer that is gone.
pub trait Transport: Send + Sync + fmt::Debug {
    /// Sends `image`, described by `meta`, to rank `to`, which receives it
    /// into a replica slot ([`Engine::receive_replica`](crate::Engine::receive_replica));
    /// returns once `to` holds it complete.
    ///
    /// # Errors
    /// The peer's refusal (no room, a bad image), or a transport failure.
    fn send(&self, to: u32, meta: &ReplicaMeta, image: &[u8]) -> Result<()>;

    /// The complete replicas rank `peer` holds.
    ///
    /// # Errors
    /// A transport failure.
    fn list(&self, peer: u32) -> Result<Vec<ReplicaMeta>>;

    /// Rank `rank`'s image of `step` from rank `peer`'s replicas;
    /// `Ok(None)` when `peer` holds none.
    ///
    /// # Errors
    /// A transport failure.
    fn fetch(&self, peer: u32, rank: u32, step: u64) -> Result<Option<Fetched>>;

    /// The ranks that hold (or are sent) `rank`'s replicas, in the order a
    /// restore asks them.
    fn holders(&self, rank: u32) -> Vec<u32>;

    /// Whether the engine sends this rank's images through
    /// [`Transport::send`]. When it does, a flush hashes an image before
    /// writing it, once for the write and the send (the send needs the
    /// digests first); otherwise the flush hashes each chunk as it writes
    /// it, overlapped with the writes. Default `true`; a transport that
    /// only serves restores says `false`.
    fn sends(&self) -> bool {
        true
    }
}
