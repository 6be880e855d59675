//! Peer replicas, the engine side ([`crate::replica`] has the design):
//! handing this rank's resident image to a transport, receiving and
//! serving other ranks' images, and the RAM sources of a restore beyond
//! this rank's own ring: another slot on this node, then a replica on
//! another node. Every image found is checked by the one verified reader
//! before it is used; one that fails is logged, naming it, and skipped.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::checkpoint::Backing;
use super::state::Shared;
use super::{Engine, Inner, Source};
use crate::error::{Error, Result};
use crate::format::{unhex, Digest, FileEntry};
use crate::read::{sums_match, ChunkReader, MemSource};
use crate::replica::{ImageBuf, ReplicaHandle, ReplicaMeta, ReplicaWriter};
use crate::staging::{
    peek_file, replica_files, slot_files, PeerImage, PeerSlot, PinnedSlot, Ring, SlotFile, SlotInfo,
};

/// The longest a flush pauses for its own step's replica exchange
/// ([`Engine::exchange_started`]), counted from the flush's start: a
/// peer that stalls never holds persistence back for longer.
pub const FLUSH_YIELD_MAX: Duration = Duration::from_secs(10);

/// An engine reachable without keeping it open ([`crate::replica::Loopback`]).
#[derive(Debug, Clone)]
pub(crate) struct WeakEngine(Weak<Inner>);

impl WeakEngine {
    pub(crate) fn upgrade(&self) -> Option<Engine> {
        self.0.upgrade().map(|inner| Engine { inner })
    }
}

impl Engine {
    pub(crate) fn downgrade(&self) -> WeakEngine {
        WeakEngine(Arc::downgrade(&self.inner))
    }

    /// Pins this rank's resident image of `step` and describes it for a
    /// replica: [`Engine::pin_resident`], then
    /// [`Engine::resident_digests`]. The image stays in its slot while the
    /// pin lives. Never call it in the stall.
    ///
    /// # Errors
    /// [`Error::NotFound`] when no slot of this rank holds `step`.
    pub fn resident_replica(&self, step: u64) -> Result<(ReplicaMeta, PinnedSlot)> {
        let pin = self.pin_resident(step)?;
        let (digests, sums) = self.resident_hashes(&pin)?;
        let meta = ReplicaMeta {
            digests,
            sums,
            ..self.resident_meta(&pin)
        };
        Ok((meta, pin))
    }

    /// Records that every holder of this rank's replicas has its image of
    /// `step` (a transport calls it once an exchange completed): from now
    /// on that snapshot stays resident, not released when newer ones are
    /// sealed, until a newer step is protected or committed. Without it a
    /// node loss right after a newer save (sealed, not replicated yet)
    /// would find this rank's image of the newest replicated step on no
    /// surviving node: its own slot released, its replica on the lost one.
    /// A ring that keeps it needs a slot more than the saves in flight
    /// (the replica configuration's default). Returns whether `step` is
    /// now the protected step: false when a newer one is, or when this
    /// rank no longer keeps `step` as a RAM snapshot (persisted, so storage
    /// protects it, or already released).
    #[must_use]
    pub fn protect(&self, step: u64) -> bool {
        let shared = self.shared();
        let mut st = shared.lock();
        if st.protected.is_some_and(|p| p >= step) || !st.snapshots.iter().any(|s| s.step == step) {
            return false;
        }
        st.protected = Some(step);
        // The previously protected snapshot is superseded now.
        shared.release_superseded(&mut st, step);
        true
    }

    /// Marks this rank's RAM snapshot of `step` as being replicated (a
    /// transport calls it before it pins and sends the image): it stays
    /// resident while newer saves seal, until
    /// [`Engine::release_replicating`], so the exchange, once complete,
    /// protects an image this rank still holds ([`Engine::protect`]).
    /// Without it, a ring that saves faster than it replicates would
    /// release each step before its exchange ends and never protect a
    /// newer one. Returns false (and marks nothing) when `step` is not a
    /// kept RAM snapshot here (persisted, held for a decision, or
    /// released). Each hold that returned true takes one
    /// [`Engine::release_replicating`].
    ///
    /// A ring with holds needs a slot more: the protected image, the one
    /// being replicated, the newest one and the one being staged.
    #[must_use]
    pub fn hold_replicating(&self, step: u64) -> bool {
        let shared = self.shared();
        let mut st = shared.lock();
        if !st.snapshots.iter().any(|s| s.step == step) {
            return false;
        }
        st.replicating.push(step);
        true
    }

    /// Marks this rank's image of `step` as being sent to its holders (a
    /// transport calls it before it sends the image, and
    /// [`Engine::exchange_ended`] once the sends are done or failed, each
    /// call once): the flush of `step`, if it runs meanwhile, pauses
    /// between chunks (hashing, compressing and writing) for at most
    /// [`FLUSH_YIELD_MAX`] from its start, so that the step's replication,
    /// the sooner of its two protections, has the cores and the memory
    /// bandwidth first. Only a persist of `step` itself yields: an
    /// exchange of a newer step never holds an older step's persist back.
    /// Once [`Engine::persist_newest`] was called (the dying checkpoint,
    /// `close`), no persist yields any more.
    pub fn exchange_started(&self, step: u64) {
        self.shared().replicas.exchange_started(step);
    }

    /// Ends one [`Engine::exchange_started`] of `step`.
    pub fn exchange_ended(&self, step: u64) {
        self.shared().replicas.exchange_ended(step);
    }

    /// Ends one [`Engine::hold_replicating`] of `step` (its exchange
    /// completed, and [`Engine::protect`] was called, or failed): the
    /// snapshot is released now if a newer one superseded it and nothing
    /// else keeps it. Releasing a step that is not held does nothing.
    pub fn release_replicating(&self, step: u64) {
        let shared = self.shared();
        let mut st = shared.lock();
        if let Some(i) = st.replicating.iter().position(|s| *s == step) {
            st.replicating.swap_remove(i);
            shared.release_superseded(&mut st, step);
        }
    }

    /// Pins this rank's resident image of `step` (in its slot while the
    /// pin lives), for a transport that sends the bytes before their
    /// digests ([`Engine::resident_digests`]).
    ///
    /// # Errors
    /// [`Error::NotFound`] when no slot of this rank holds `step`.
    pub fn pin_resident(&self, step: u64) -> Result<PinnedSlot> {
        let shared = self.shared();
        let not_found = || Error::NotFound {
            what: format!(
                "resident image of step {step} in rank {}'s ring",
                shared.cfg.rank
            ),
        };
        let info = shared
            .ring
            .complete()
            .into_iter()
            .find(|i| i.step == step)
            .ok_or_else(not_found)?;
        shared
            .ring
            .pin_step(info.slot, step)
            .map_err(|_| not_found())
    }

    /// The metadata of `pin` (from [`Engine::pin_resident`]), without
    /// digests.
    #[must_use]
    pub fn resident_meta(&self, pin: &PinnedSlot) -> ReplicaMeta {
        let shared = self.shared();
        ReplicaMeta {
            rank: shared.cfg.rank,
            step: pin.step(),
            len: pin.image().len() as u64,
            chunk_bytes: shared.cfg.chunk_bytes as u64,
            digests: Vec::new(),
            sums: Vec::new(),
        }
    }

    /// The chunk digests of the image `pin` holds:
    /// [`Engine::resident_hashes`] without the quick sums.
    ///
    /// # Errors
    /// [`Error::Io`] when a hashing thread cannot start.
    pub fn resident_digests(&self, pin: &PinnedSlot) -> Result<Vec<Digest>> {
        self.resident_hashes(pin).map(|(d, _)| d)
    }

    /// The chunk digests and quick sums of the image `pin` holds: those
    /// the flush (or an earlier call) recorded in its slot, else taken now
    /// on the engine's copy threads, each chunk's quick sum before its
    /// digest, as a flush takes them, and recorded, so that the flush of
    /// the same image and a restore of the step from this node's RAM use
    /// them rather than hashing it again (the flush and this call hash
    /// under one lock: the second takes the first one's). A RAM snapshot
    /// summed before (`hash.rs`) must still give its sums, or this fails
    /// ([`Error::Corrupt`]). The sums are empty when the slot records
    /// digests without sums (laid out by an older version). Never call it
    /// in the stall.
    ///
    /// # Errors
    /// [`Error::Io`] when a hashing thread cannot start; [`Error::Corrupt`]
    /// naming the slot file and chunk when the image changed in RAM since
    /// its quick sums were taken.
    pub fn resident_hashes(&self, pin: &PinnedSlot) -> Result<(Vec<Digest>, Vec<u64>)> {
        let shared = self.shared();
        let want = pin.image().len().div_ceil(shared.cfg.chunk_bytes.max(1));
        // Digests alone do (a slot laid out without room for quick sums
        // records none); the pin keeps them this image's.
        if let Some(d) = shared.ring.digests(pin.slot()).filter(|d| d.len() == want) {
            return Ok((d, crate::replica::sums_of(&shared.ring, pin.slot(), want)));
        }
        let path = shared.ring.slot_path(pin.slot());
        let hashed = hash_once(
            shared,
            pin.slot(),
            pin.generation(),
            pin.image(),
            true,
            &path,
            &|| {},
        )?;
        Ok(hashed.unwrap_or_default())
    }

    /// The quick sums of the image `pin` holds (one xxh3-64 per chunk):
    /// those recorded in its slot (beside its digests, or alone: a RAM
    /// snapshot summed, or an earlier call), else taken now on the copy
    /// threads and recorded alone (so the snapshot's own background sum
    /// and a load of it from RAM use them). What a transport sends first,
    /// so that the image counts as replicated before anyone hashed it with
    /// blake3 ([`Engine::digests_to_send`] after). Never call it in the
    /// stall.
    #[must_use]
    pub fn resident_sums(&self, pin: &PinnedSlot) -> Vec<u64> {
        let shared = self.shared();
        let ring = &shared.ring;
        let chunk = shared.cfg.chunk_bytes;
        let want = pin.image().len().div_ceil(chunk.max(1));
        let recorded = || {
            ring.sums_alone(pin.slot())
                .or_else(|| ring.quick_sums(pin.slot()))
                .filter(|s| s.len() == want)
        };
        if let Some(sums) = recorded() {
            return sums;
        }
        // The snapshot's background sum (`hash.rs`) starts when the save
        // returns, as this call does: summing under the hashing lock makes
        // it take these sums rather than sum again. Never waited for: the
        // lock may be a flush's blake3 pass over the image (`hash_once`),
        // which is what sending the sums first keeps off replication's
        // path; summing beside it costs a few ms of a core.
        let _hashing = shared.replicas.try_hashing();
        if let Some(sums) = recorded() {
            return sums;
        }
        let sums = crate::read::chunk_sums(pin.image(), chunk, shared.cfg.copy_threads);
        // Not recorded when digests came meanwhile (a flush's hash).
        let _ = ring.record_sums_alone(pin.slot(), pin.generation(), &sums);
        sums
    }

    /// The digests (and the quick sums beside them) to send after the
    /// image `pin` holds and its sums ([`Engine::resident_sums`]), so that
    /// its holders can bind their replica to the committed index: those
    /// recorded in its slot; else, when its step is being persisted
    /// (queued, deferred or being written: the flush hashes it anyway),
    /// taken now or by the flush, whichever comes first
    /// ([`Engine::resident_hashes`]); else `None`: a RAM snapshot is not
    /// hashed with blake3 for its replicas, which its quick sums check
    /// (a restore of it after it was persisted, from a replica without
    /// digests, checks the bytes against the committed index with
    /// blake3). A held save ([`Engine::decide`]) is waited for until it is
    /// decided, at most `wait` (rank 0's decision reaches the other ranks
    /// within milliseconds; a transport passes less than its peers wait
    /// for the digests), then counts as not persisted. Never call it in
    /// the stall.
    ///
    /// # Errors
    /// As [`Engine::resident_hashes`].
    pub fn digests_to_send(
        &self,
        pin: &PinnedSlot,
        wait: std::time::Duration,
    ) -> Result<Option<(Vec<Digest>, Vec<u64>)>> {
        let shared = self.shared();
        let want = pin.image().len().div_ceil(shared.cfg.chunk_bytes.max(1));
        let deadline = std::time::Instant::now() + wait;
        loop {
            if let Some(d) = shared.ring.digests(pin.slot()).filter(|d| d.len() == want) {
                let sums = crate::replica::sums_of(&shared.ring, pin.slot(), want);
                return Ok(Some((d, sums)));
            }
            let (persisting, held) = {
                let st = shared.lock();
                let step = pin.step();
                (
                    st.queued.contains(&step),
                    st.held.iter().any(|j| j.step == step),
                )
            };
            if persisting {
                return self.resident_hashes(pin).map(Some);
            }
            if !held || std::time::Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    }

    /// Records `digests`, sent after the quick sums its replica of rank
    /// `rank`'s `step` was sealed with
    /// ([`ReplicaWriter::finish_with_sums`] without digests), beside those
    /// sums. Returns whether they were recorded: not when no such replica
    /// is held here, it has digests already, or their count is not its
    /// chunk count.
    #[must_use]
    pub fn add_replica_digests(&self, rank: u32, step: u64, digests: &[Digest]) -> bool {
        self.shared().replicas.add_digests(rank, step, digests)
    }

    /// Sends this rank's resident image of `step` to its holders (the
    /// transport's [`holders`](crate::replica::Transport::holders)) on the
    /// engine's replica thread (one per engine, sending in the order of
    /// the calls, joined by [`Engine::close`]); returns at once. The image
    /// stays pinned in its slot until every send is done, so a ring that
    /// saves faster than it replicates waits for a slot like one that
    /// saves faster than it flushes.
    ///
    /// # Errors
    /// [`Error::Config`] without a transport; [`Error::NotFound`] when no
    /// slot holds `step`; [`Error::Io`] starting the thread.
    pub fn replicate(&self, step: u64) -> Result<ReplicaHandle> {
        let shared = self.shared();
        let Some(transport) = shared.replicas.transport().cloned() else {
            return Err(Error::Config {
                field: "transport",
                reason: "replicas need a transport (EngineConfig::with_transport)".to_owned(),
            });
        };
        let info = shared
            .ring
            .complete()
            .into_iter()
            .find(|i| i.step == step)
            .ok_or_else(|| Error::NotFound {
                what: format!(
                    "resident image of step {step} in rank {}'s ring",
                    shared.cfg.rank
                ),
            })?;
        // Kept resident until the sends end, so that they can protect it.
        // Released when dropped: by the job once it ran, or here on an
        // early return.
        let hold = self.hold_replicating(step).then(|| ReplicatingHold {
            engine: self.clone(),
            step,
        });
        // Pinned now, so the image sent is the one resident at the call.
        let early = shared.ring.pin(info.slot)?;
        let handle = ReplicaHandle::new(step);
        let done = handle.clone();
        // Dropped once the job ran: no reference cycle outlives it.
        let engine = self.clone();
        let rank = shared.cfg.rank;
        shared.replicas.send_in_background(Box::new(move || {
            let result = (|| {
                let (meta, pin) = engine.resident_replica(step)?;
                drop(early);
                let mut sent = Vec::new();
                // Marked once the digests are taken (`resident_replica`
                // may wait for a flush's hash, which must not be paused).
                engine.exchange_started(step);
                let sends = transport.holders(rank).into_iter().try_for_each(|to| {
                    transport.send(to, &meta, pin.image()).map_err(|e| {
                        tracing::warn!("acp: {} to rank {to} failed: {e}", meta.what());
                        e
                    })?;
                    sent.push(to);
                    Ok::<(), Error>(())
                });
                engine.exchange_ended(step);
                sends?;
                if !sent.is_empty() {
                    // Every holder has it: kept resident until a newer
                    // step is protected or committed.
                    let _ = engine.protect(step);
                }
                Ok(sent)
            })();
            drop(hold);
            done.complete(result);
        }))?;
        Ok(handle)
    }

    /// Receives another rank's image into a replica slot of this rank:
    /// `fill` writes exactly `meta.len` bytes into the slot (a transport
    /// reads the network straight into it); the slot is then sealed with
    /// `meta.digests`, and this rank's older replicas of that rank are
    /// freed. A `fill` error leaves the slot free and the older replica
    /// in place.
    ///
    /// # Errors
    /// [`Error::Invalid`] for metadata that does not fit (another chunk
    /// size, a digest count that is not the length's, an image past the
    /// slot size, a rank outside the job's world, more source ranks than
    /// `replicas_held`); [`Error::Busy`]
    /// when every slot is pinned; `fill`'s error; [`Error::Io`].
    pub fn receive_replica(
        &self,
        meta: &ReplicaMeta,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.shared().replicas.receive(meta, fill)
    }

    /// A replica slot for rank `rank`'s image of `step` (`len` bytes,
    /// digests in chunks of `chunk_bytes`), staging: a transport reads the
    /// image straight into [`ReplicaWriter::image_mut`], then seals it
    /// with the digests that come after it ([`ReplicaWriter::finish`]).
    /// Dropped unfinished, the slot is free again and the older replica
    /// stays.
    ///
    /// # Errors
    /// As [`Engine::receive_replica`].
    pub fn begin_replica(
        &self,
        rank: u32,
        step: u64,
        len: u64,
        chunk_bytes: u64,
    ) -> Result<ReplicaWriter> {
        self.shared().replicas.begin(rank, step, len, chunk_bytes)
    }

    /// The other ranks' images this rank holds complete, with the digests
    /// they came with.
    #[must_use]
    pub fn replicas(&self) -> Vec<ReplicaMeta> {
        self.shared().replicas.held()
    }

    /// Persists this rank's image of `step` from a replica slot on this
    /// node (kept by another rank here: this rank's own node was lost, or
    /// its process is gone): the replica is copied out and verified
    /// against the digests it was received with, staged into a slot of
    /// this rank's ring, and flushed and committed like a save of this
    /// rank (with several ranks, rank 0 commits the step once every rank's
    /// file is durable). How a survivor commits a dead node's step.
    ///
    /// # Errors
    /// [`Error::Exists`] when `step` is committed; [`Error::NotFound`]
    /// when no replica slot on this node holds a verified image of this
    /// rank's `step` (naming the one rejected, if any); [`Error::Busy`]
    /// when no slot of the ring is free; [`Error::Closed`].
    pub fn persist_replica(&self, step: u64) -> Result<crate::SaveHandle> {
        let shared = self.shared();
        let rank = shared.cfg.rank;
        if shared.lock().committed.contains(&step) || shared.root.is_committed(step) {
            return Err(Error::Exists {
                step,
                root: shared.root.location().to_path_buf(),
            });
        }
        let mut rejected = None;
        let found = node_replica(shared, step, rank, None, &mut rejected).ok_or_else(|| {
            Error::NotFound {
                what: format!(
                    "rank {rank}'s replica of step {step} on this node{}",
                    rejected.map(|r| format!(" ({r})")).unwrap_or_default()
                ),
            }
        })?;
        let image = found.backing.image();
        let len = image.len() as u64;
        let mut slot = shared.ring.acquire(len, None)?.ok_or_else(|| Error::Busy {
            what: format!("rank {rank}'s ring"),
            reason: format!(
                "no free slot for the replica of step {step} from {}",
                found.origin.display()
            ),
        })?;
        slot.image_mut()[..image.len()].copy_from_slice(image);
        // Sealed `Resident`, as a save leaves it: the persist below takes
        // it from there, hashing it again as it writes.
        drop(slot.seal(step, len));
        tracing::info!(
            step,
            "acp: persisting rank {rank}'s image from the replica in {}",
            found.origin.display()
        );
        self.persist_resident(step)
    }

    /// Private memory for an image of this job described by `meta` (the
    /// rank, step, length and chunk size a peer's message claims; digests
    /// come after the bytes), which a transport fetches from a peer for a
    /// restore and hands to the next load: this rank's own image, or
    /// another rank's whose file holds tensors of a `replicated` state this
    /// rank did not write. Sized only once the claim describes an image a
    /// slot of this rank's ring could have held (a rank of the job, this
    /// engine's digest chunks, no longer than
    /// [`Ring::max_image_bytes`](crate::staging::Ring::max_image_bytes)).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the replica; [`Error::Io`] when the memory
    /// cannot be mapped.
    pub fn peer_image_buf(&self, meta: &ReplicaMeta) -> Result<ImageBuf> {
        let shared = self.shared();
        let chunk = shared.cfg.chunk_bytes as u64;
        let max = shared.ring.max_image_bytes();
        if meta.rank >= shared.cfg.world_size {
            return Err(Error::invalid(
                meta.what(),
                format!(
                    "offered to rank {} of a job of {} ranks",
                    shared.cfg.rank, shared.cfg.world_size
                ),
            ));
        }
        if meta.chunk_bytes != chunk {
            return Err(Error::invalid(
                meta.what(),
                format!(
                    "digest chunks of {} bytes, this engine's are {chunk}",
                    meta.chunk_bytes
                ),
            ));
        }
        if meta.len > max {
            return Err(Error::invalid(
                meta.what(),
                format!(
                    "{} bytes claimed, more than a slot of rank {}'s ring holds ({max} bytes)",
                    meta.len, shared.cfg.rank
                ),
            ));
        }
        ImageBuf::new(meta.len)
    }

    /// Pins this rank's replica of `rank`'s `step`, if it holds one: what
    /// a transport serves to a restore. Returns its metadata, the pin and
    /// the slot file (for messages).
    #[must_use]
    pub fn pin_replica(&self, rank: u32, step: u64) -> Option<(ReplicaMeta, PinnedSlot, PathBuf)> {
        self.shared().replicas.pin(rank, step)
    }
}

/// The chunk digests and quick sums of `image`, this rank's image in slot
/// `slot` of generation `generation` (kept there by the caller's pin),
/// hashed once: those recorded in the slot, else, when `compute`, taken
/// now on the copy threads (each chunk's quick sum before its digest, as a
/// flush takes them) and recorded; `None` when none are recorded and not
/// `compute`. The flush and the replica send of a save both want them at
/// once, on the two threads that start when the save returns: the store's
/// hashing lock makes the second wait for the first one's rather than
/// hash the image again. `path` names the image in errors. The hashing
/// threads call `pause` before each chunk (a flush's: it waits while its
/// step's replica exchange runs).
///
/// # Errors
/// [`Error::Io`] when a hashing thread cannot start.
pub(super) fn hash_once(
    shared: &Shared,
    slot: usize,
    generation: u64,
    image: &[u8],
    compute: bool,
    path: &Path,
    pause: &(dyn Fn() + Sync),
) -> Result<Option<(Vec<Digest>, Vec<u64>)>> {
    let ring = &shared.ring;
    let chunk = shared.cfg.chunk_bytes;
    let want = image.len().div_ceil(chunk.max(1));
    let _hashing = shared.replicas.hashing();
    let recorded = || {
        let digests = ring.digests(slot).filter(|d| d.len() == want)?;
        let sums = ring.quick_sums(slot).filter(|s| s.len() == want)?;
        Some((digests, sums))
    };
    if ring.generation(slot) == Some(generation) {
        if let Some(got) = recorded() {
            return Ok(Some(got));
        }
    }
    if !compute {
        return Ok(None);
    }
    // A RAM snapshot summed before it was hashed (`hash.rs`): the bytes
    // hashed now must be those the sums were taken from (each chunk's sum
    // is taken before its digest), or the new digests would vouch for a
    // change made in RAM since.
    let summed = ring
        .sums_alone(slot)
        .filter(|_| ring.generation(slot) == Some(generation));
    let threads = shared.cfg.copy_threads;
    let (digests, sums) = super::incremental::prehash(image, chunk, threads, path, pause)?;
    if let Some(i) = summed.and_then(|before| (0..want).find(|&i| before.get(i) != sums.get(i))) {
        return Err(Error::corrupt(
            ring.slot_path(slot),
            None,
            format!("chunk {i} changed in RAM after its quick sum was taken; not hashed"),
        ));
    }
    // The caller's pin keeps this image in the slot: still this generation.
    if ring.generation(slot) == Some(generation) {
        ring.set_digests(slot, &digests);
        ring.record_quick_sums(slot, &digests, &sums);
    }
    Ok(Some((digests, sums)))
}

/// An image of one rank's file found in RAM outside this rank's ring,
/// verified.
pub(super) struct Found {
    pub(super) backing: Backing,
    /// Where it came from, for messages.
    pub(super) origin: PathBuf,
    pub(super) source: Source,
}

/// Checks `image`, from `origin`, against `entry` with the one verified
/// reader; when it does not match, logs it, records why in `rejected` (the
/// load's report) and returns `false`.
fn verified(
    image: &[u8],
    origin: &Path,
    entry: &FileEntry,
    threads: usize,
    step: u64,
    rejected: &mut Option<String>,
) -> bool {
    match ChunkReader::new(MemSource::new(image, origin), entry)
        .and_then(|mut r| r.verify_in_place(threads))
    {
        Ok(_) => true,
        Err(e) => {
            let why = format!(
                "rank {}'s image of step {step} in {} rejected: {e}",
                entry.rank,
                origin.display()
            );
            tracing::warn!("acp: {why}; trying the next source");
            *rejected = Some(why);
            false
        }
    }
}

/// Whether `image`, a replica from `origin` described by `meta`, is the
/// image `entry` records, checked by the quick sums shipped with it
/// rather than by hashing it again: `meta`'s digests must be `entry`'s
/// (compared, not computed) and every chunk must give the sum the sender
/// took beside its digest (`read/fast.rs`; the [`crate::replica`] docs say
/// what this check stands for). `false` (nothing logged but a differing
/// sum) when there are no sums, the digests are not `entry`'s or a chunk
/// differs from its sum: the caller then checks the bytes against `entry`
/// with blake3, which names what is wrong (or passes bytes whose sums
/// alone were damaged).
fn verified_by_sums(
    image: &[u8],
    origin: &Path,
    entry: &FileEntry,
    meta: &ReplicaMeta,
    threads: usize,
) -> bool {
    if meta.sums.is_empty()
        || entry.size != image.len() as u64
        || !same_digests(entry, meta.chunk_bytes, &meta.digests)
    {
        return false;
    }
    let chunk = usize::try_from(entry.chunk_bytes).unwrap_or(usize::MAX);
    if sums_match(image, chunk, &meta.sums, threads) {
        return true;
    }
    tracing::warn!(
        "acp: {} differs from the quick sums shipped with it; checking its digests",
        origin.display()
    );
    false
}

/// Whether `image`, from `origin`, gives `sums` (one quick sum per chunk
/// of `chunk_bytes`): how a replica of a step that is not committed, sealed
/// with its sums alone, is checked. When it does not, logs it, naming the
/// first chunk that differs and the tensors in it, records why in
/// `rejected` and returns `false`.
fn by_sums_alone(
    image: &[u8],
    origin: &Path,
    chunk_bytes: u64,
    sums: &[u64],
    threads: usize,
    step: u64,
    rejected: &mut Option<String>,
) -> bool {
    let chunk = usize::try_from(chunk_bytes).unwrap_or(usize::MAX);
    if sums_match(image, chunk, sums, threads) {
        return true;
    }
    let e = if image.len().div_ceil(chunk.max(1)) == sums.len() {
        differs_from_sums(image, chunk, sums, origin)
    } else {
        Error::corrupt(
            origin,
            None,
            format!(
                "{} quick sums for {} bytes in chunks of {chunk}",
                sums.len(),
                image.len()
            ),
        )
    };
    let why = format!("image of step {step} in {} rejected: {e}", origin.display());
    tracing::warn!("acp: {why}; trying the next source");
    *rejected = Some(why);
    false
}

fn to_entry(rank: u32, len: u64, chunk_bytes: u64, digests: Vec<Digest>) -> FileEntry {
    ReplicaMeta {
        rank,
        step: 0,
        len,
        chunk_bytes,
        digests,
        sums: Vec::new(),
    }
    .entry()
}

/// Whether `digests` are the ones `entry` records (the image a replica
/// holds is the committed one), compared without hashing.
pub(super) fn same_digests(entry: &FileEntry, chunk_bytes: u64, digests: &[Digest]) -> bool {
    entry.chunk_bytes == chunk_bytes
        && entry.chunks.len() == digests.len()
        && entry
            .chunks
            .iter()
            .zip(digests)
            .all(|(h, d)| unhex(h).as_ref() == Some(d))
}

/// This rank's own image of uncommitted `step` in its ring, checked
/// against the quick sums recorded for it (beside its digests, or alone:
/// a RAM snapshot summed but not hashed, `hash.rs`), else against the
/// digests recorded in its slot (by the flush, or by
/// [`Engine::resident_replica`]) with blake3; a slot with neither cannot
/// be checked and is skipped, as is one whose bytes give neither.
pub(super) fn own_uncommitted(
    shared: &Shared,
    step: u64,
    rejected: &mut Option<String>,
) -> Option<Found> {
    let ring = &shared.ring;
    let (info, pin, sums) = own_snapshot(ring, step)?;
    let origin = ring.slot_path(info.slot);
    let threads = shared.cfg.copy_threads;
    let found = |pin| Found {
        backing: Backing::Slot(pin),
        origin: origin.clone(),
        source: Source::Ram,
    };
    let digests = ring.digests(info.slot);
    if let Some(s) = &sums {
        if sums_match(pin.image(), shared.cfg.chunk_bytes, s, threads) {
            return Some(found(pin));
        }
    }
    let Some(digests) = digests else {
        if let Some(s) = &sums {
            let e = differs_from_sums(pin.image(), shared.cfg.chunk_bytes, s, &origin);
            let why = format!(
                "rank {}'s image of step {step} in {} rejected: {e}",
                shared.cfg.rank,
                origin.display()
            );
            tracing::warn!("acp: {why}; trying the next source");
            *rejected = Some(why);
        } else {
            tracing::warn!(
                "acp: resident image of step {step} in {} has neither digests nor quick sums (never summed), trying the next source",
                origin.display()
            );
        }
        return None;
    };
    let entry = to_entry(
        shared.cfg.rank,
        info.len,
        shared.cfg.chunk_bytes as u64,
        digests,
    );
    verified(pin.image(), &origin, &entry, threads, step, rejected).then(|| found(pin))
}

/// This rank's complete slot holding `step`, pinned, with the quick sums
/// recorded for its image when there are some. The pin holds the image the
/// sums (and digests) read now describe; the sums alone are read first: a
/// persist that ends meanwhile records digests, and sums beside them, in
/// their place.
pub(super) fn own_snapshot(
    ring: &Ring,
    step: u64,
) -> Option<(SlotInfo, PinnedSlot, Option<Vec<u64>>)> {
    let info = ring.complete().into_iter().find(|i| i.step == step)?;
    let pin = ring.pin_step(info.slot, step).ok()?;
    let sums = ring
        .sums_alone(info.slot)
        .or_else(|| ring.quick_sums(info.slot));
    Some((info, pin, sums))
}

/// The error for `image`, from `path`, whose first chunk that differs from
/// its quick sum in `sums` names the tensors it holds (read from the
/// image's own header, unverified, for naming only).
pub(super) fn differs_from_sums(image: &[u8], chunk: usize, sums: &[u64], path: &Path) -> Error {
    let chunk = chunk.max(1);
    let i = crate::read::first_differing(image, chunk, sums).unwrap_or(0);
    let (start, end) = (
        (i * chunk) as u64,
        ((i + 1) * chunk).min(image.len()) as u64,
    );
    let tensors: Vec<String> = crate::format::parse_header(path, image, image.len() as u64)
        .map(|h| {
            h.entries
                .into_iter()
                .filter(|e| e.offset < end && start < e.offset + e.len.max(1))
                .map(|e| e.name)
                .collect()
        })
        .unwrap_or_default();
    let mut reason = format!(
        "bytes {start}..{end} (chunk {i}) differ from the quick sum taken when the snapshot was summed"
    );
    if tensors.len() > 1 {
        reason = format!(
            "{reason}, which hold parts of {} tensors: `{}`",
            tensors.len(),
            tensors.join("`, `")
        );
    }
    Error::corrupt(path, tensors.first().map(String::as_str), reason)
}

/// `rank`'s image of `step` from a replica slot on this node (kept by any
/// rank here), checked against `committed` (the index's entry) when the
/// step is committed, else against the digests recorded with the replica.
/// Why one was rejected goes to `rejected`.
pub(super) fn node_replica(
    shared: &Shared,
    step: u64,
    rank: u32,
    committed: Option<&FileEntry>,
    rejected: &mut Option<String>,
) -> Option<Found> {
    let job = super::open::job_id(&shared.cfg, &*shared.root);
    let files = replica_files(&shared.cfg.shm_dir, &job, Some(rank)).unwrap_or_else(|e| {
        tracing::debug!("acp: replica slots of rank {rank}: {e}");
        Vec::new()
    });
    let (_, job_tag) = super::open::job_names(&shared.cfg, &*shared.root, rank);
    files
        .iter()
        .find_map(|f| copy_node_replica(shared, f, job_tag, step, committed, rejected))
}

/// Another rank's image of `step`, which is not committed, from that
/// rank's own ring slot on this node: what a rank of a `replicated` state
/// needs of the ranks beside it, whose files hold the tensors it did not
/// write. Read as a replica slot on this node is (never mapped: its owner
/// may reuse it), and checked against the digests or the quick sums the
/// slot recorded with the image; a slot with neither is not used.
pub(super) fn node_slot(
    shared: &Shared,
    step: u64,
    rank: u32,
    rejected: &mut Option<String>,
) -> Option<Found> {
    let job = super::open::job_id(&shared.cfg, &*shared.root);
    let files = slot_files(&shared.cfg.shm_dir, &job, Some(rank)).unwrap_or_else(|e| {
        tracing::debug!("acp: rank {rank}'s slots: {e}");
        Vec::new()
    });
    let (_, job_tag) = super::open::job_names(&shared.cfg, &*shared.root, rank);
    files
        .iter()
        .find_map(|f| copy_node_replica(shared, f, job_tag, step, None, rejected))
}

fn copy_node_replica(
    shared: &Shared,
    file: &SlotFile,
    job_tag: Digest,
    step: u64,
    committed: Option<&FileEntry>,
    rejected: &mut Option<String>,
) -> Option<Found> {
    let path = file.path();
    let opened = file.open().ok()??;
    let peek = peek_file(&opened, &path).ok()??;
    if !peek.is_complete() || peek.step != step || peek.rank != file.rank {
        return None;
    }
    if committed.is_some_and(|e| e.size != peek.image_len) {
        return None;
    }
    let want = PeerImage {
        job_tag,
        rank: file.rank,
        step,
        len: peek.image_len,
    };
    let slot = PeerSlot::open(file, want).ok()??;
    // Digests, or quick sums alone (a replica sealed before its digests
    // came): a committed step is checked against its index either way.
    let (chunk, digests, sums) = match slot.digests().ok()? {
        Some((chunk, digests)) => (chunk, digests, None),
        None => {
            let (chunk, sums) = slot.sums_alone().ok()??;
            (chunk, Vec::new(), Some(sums))
        }
    };
    let entry = match committed {
        Some(e) if digests.is_empty() || same_digests(e, chunk, &digests) => Some(e.clone()),
        Some(_) => {
            tracing::warn!(
                "acp: {} holds another image of step {step} than the committed one, trying the next source",
                path.display()
            );
            return None;
        }
        None if digests.is_empty() => None,
        None => Some(to_entry(file.rank, peek.image_len, chunk, digests)),
    };
    let mut buf = super::load::heap_whole(peek.image_len, &path).ok()?;
    let len = super::to_usize(peek.image_len);
    slot.read_at(0, &mut buf[..len]).ok()?;
    if !slot.unchanged().ok()? {
        tracing::debug!("acp: {} was reused during the copy", path.display());
        return None;
    }
    let threads = shared.cfg.copy_threads;
    let ok = match (&entry, &sums) {
        (Some(entry), _) => verified(&buf[..len], &path, entry, threads, step, rejected),
        (None, Some(sums)) => {
            by_sums_alone(&buf[..len], &path, chunk, sums, threads, step, rejected)
        }
        (None, None) => false,
    };
    ok.then(|| Found {
        backing: Backing::Heap(buf, len),
        origin: path,
        source: Source::Ram,
    })
}

/// `rank`'s image of `step` fetched from the first holder that has it,
/// through the engine's transport, checked against `committed` when the
/// step is committed, else against the digests the holder recorded. Why
/// one was rejected goes to `rejected`.
pub(super) fn from_peers(
    shared: &Shared,
    step: u64,
    rank: u32,
    committed: Option<&FileEntry>,
    rejected: &mut Option<String>,
) -> Option<Found> {
    let transport = shared.replicas.transport()?;
    for peer in transport.holders(rank) {
        let fetched = match transport.fetch(peer, rank, step) {
            Ok(Some(f)) => f,
            Ok(None) => continue,
            Err(e) => {
                tracing::warn!(
                    "acp: rank {rank}'s replica of step {step} on rank {peer} not fetched, trying the next source: {e}"
                );
                continue;
            }
        };
        let origin = PathBuf::from(&fetched.origin);
        let meta = &fetched.meta;
        if meta.rank != rank || meta.step != step || meta.len != fetched.image.len() as u64 {
            tracing::warn!(
                "acp: {} is not rank {rank}'s image of step {step} ({}), trying the next source",
                origin.display(),
                meta.what()
            );
            continue;
        }
        let image = fetched.image.as_slice();
        let threads = shared.cfg.copy_threads;
        let ok = match committed {
            // Sealed with its quick sums alone, never persisted: they are
            // all there is to check it by, as for this rank's own snapshot.
            None if meta.digests.is_empty() => by_sums_alone(
                image,
                &origin,
                meta.chunk_bytes,
                &meta.sums,
                threads,
                step,
                rejected,
            ),
            _ => {
                let entry = committed.cloned().unwrap_or_else(|| meta.entry());
                verified_by_sums(image, &origin, &entry, meta, threads)
                    || verified(image, &origin, &entry, threads, step, rejected)
            }
        };
        if ok {
            let (map, len) = fetched.image.into_parts();
            return Some(Found {
                backing: Backing::Heap(map, len),
                origin,
                source: Source::Peer,
            });
        }
    }
    None
}

/// One [`Engine::hold_replicating`] that returned true, ended by
/// [`Engine::release_replicating`] when dropped.
struct ReplicatingHold {
    engine: Engine,
    step: u64,
}

impl Drop for ReplicatingHold {
    fn drop(&mut self) {
        self.engine.release_replicating(self.step);
    }
}
