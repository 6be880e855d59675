//! Loading a step: from a resident slot when one holds it, else from a
//! replica (this node's, then a peer's, `replicate.rs`), else from storage
//! into a slot whose memory is ready, or else into private memory (or,
//! with destinations, straight into them).

use std::collections::BTreeSet;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use super::checkpoint::Backing;
use super::state::Shared;
use super::to_usize;
use super::wait::wait_for;
use super::{ranks, replicate, Checkpoint, Engine, LoadReport, Source};
use crate::config::Verify;
use crate::error::{Error, ErrorKind, Result};
use crate::format::Digest;
use crate::format::{data_file_name, read_header, unhex, Entry, FileEntry, ParsedHeader};
use crate::read::{
    check_and_copy, sums_match, ChunkReader, ChunkSource, IoSource, MemSource, OnChecked,
    StoredSource, Target,
};
use crate::staging::{PinnedSlot, Ring, SlotInfo, SlotState, StagingSlot, WarmDeferral};
use crate::storage::FileHandle;

/// Which step to load, and from where.
#[derive(Debug, Clone, Default)]
pub struct LoadRequest {
    /// The step; when `None`, the newest of the committed steps and, with
    /// one rank, the RAM snapshots of this rank's ring that are hashed
    /// (verifiable), a RAM snapshot that fails verification giving way to
    /// the next source.
    pub step: Option<u64>,
    /// Read from storage even when the step is resident.
    pub storage_only: bool,
    /// When the wanted (latest) step is corrupt, fall back to the newest
    /// older committed step that is intact. Only with `step: None`.
    pub fallback: bool,
    /// Load the file written by this rank instead of this engine's own:
    /// from that rank's slot when it is resident on this node (verified
    /// against the committed digests), else from storage. With several
    /// ranks, each file holds that rank's share of the tensors.
    pub rank: Option<u32>,
    /// Only these tensors of another rank's file (with its values): only
    /// the digest chunks under its header and under them are read. Ignored
    /// for this engine's own file, which is loaded whole.
    pub tensors: Option<Vec<String>>,
}

impl Engine {
    /// Loads a step from the best source that has it, each verified
    /// before use: this rank's resident slot, another slot on this node
    /// (another rank's own, or a replica kept here), a replica on another
    /// node through the transport ([`Source::Peer`]), then storage (into
    /// a slot whose memory is ready, which becomes resident, else into
    /// private memory: fresh slot memory costs more than the read). A
    /// source that is missing or fails verification is logged, naming it,
    /// and the next one is used. An explicit `step` that is not committed
    /// is loaded from RAM only, checked against the quick sums or digests
    /// recorded with the image (by its flush, by the background sums of a
    /// RAM snapshot, or at open for one a previous process left); without
    /// a step, the newest such snapshot of this rank (one rank only) is
    /// tried before the committed steps.
    ///
    /// # Errors
    /// [`Error::NotFound`], [`Error::Corrupt`] naming the file and tensor,
    /// [`Error::Io`].
    pub fn load(&self, req: &LoadRequest) -> Result<Checkpoint> {
        load(self, req)
    }

    /// [`Engine::load`], then copies each tensor `into[k].0` into
    /// `into[k].1` (exactly its length). From storage, the tensors are
    /// filled in the read's own pass ([`Engine::open_load`], then
    /// [`PendingLoad::read_into`]); from this rank's resident slot, in the
    /// pass that checks it (each chunk copied and summed a cache-sized
    /// block at a time, then its sum compared; a chunk that differs sends
    /// the load to the full check, then to storage, and every tensor is
    /// filled again); from any other source, they are copied once the load
    /// succeeded.
    ///
    /// Every source is checked in the pass that copies: each chunk is
    /// copied and hashed (or summed) a cache-sized block at a time, and its
    /// digest (or sum) compared at the chunk's end. On an error, each
    /// tensor of `into` holds its old bytes or bytes of the step being
    /// loaded (verified ones of a storage read that failed part way, or
    /// those of a chunk whose digest or sum then differed): the caller is
    /// told by the error and must not use them. With
    /// `fallback`, a step whose data fails verification during that read
    /// is loaded again through [`Engine::load`], which falls back to the
    /// newest intact step; every tensor of `into` then holds that step's
    /// bytes.
    ///
    /// # Errors
    /// As [`Engine::load`]; [`Error::Invalid`] naming the tensor when a
    /// name is not in the loaded step or a length differs, before anything
    /// is copied into it.
    pub fn load_into(
        &self,
        req: &LoadRequest,
        into: &mut [(&str, &mut [u8])],
    ) -> Result<Checkpoint> {
        let ck = match self.open_load(req)? {
            Opened::Ready(ck) => ck,
            Opened::Pending(p) => {
                let step = p.step();
                // A RAM snapshot that fails is only the newest of several
                // sources, whatever `fallback` says (as in `load_with`).
                let snapshot = matches!(p.what, Deferred::Snapshot(_));
                let mut dsts = by_index(p.entries(), step, into)?;
                match p.read_into(&mut dsts) {
                    Ok(ck) => return Ok(ck),
                    Err(e)
                        if (req.fallback || snapshot) && req.step.is_none() && falls_back(&e) =>
                    {
                        tracing::warn!(
                            "acp: step {step} cannot be loaded, loading the newest intact step: {e}"
                        );
                        self.load(req)?
                    }
                    Err(e) => return Err(e),
                }
            }
        };
        let mut dsts = by_index(ck.entries(), ck.step(), into)?;
        ck.copy_into(&mut dsts)?;
        Ok(ck)
    }

    /// [`Engine::load`], except that a step of this rank to be read from
    /// storage is not read yet: its file is opened and sized and its
    /// header read (a few KiB) and checked against the index, and
    /// [`Opened::Pending`] says what it holds, so that the caller can name
    /// where each tensor goes before the one pass that reads, verifies and
    /// copies it there ([`PendingLoad::read_into`]). That pass checks the
    /// header's chunks too, and fails if they do not hold the header the
    /// caller planned with: nothing from the file is trusted before it.
    /// A step held by this rank's resident slot (with [`Verify::Always`])
    /// is [`Opened::Pending`] too, planned from the slot's header: its
    /// check is the copy's pass ([`PendingLoad::read_into`]); so is this
    /// rank's RAM snapshot of a step not committed, checked by the same
    /// pass against its quick sums; and so is another rank's committed
    /// file ([`LoadRequest::rank`]), or some of its tensors
    /// ([`LoadRequest::tensors`]), held by that rank's slot on this node with
    /// quick sums recorded beside the committed digests: planned from the
    /// chunks under its header (checked against the digests), each chunk
    /// of the tensors read into a buffer of a copy thread, checked
    /// against its quick sum and copied into its destinations, with no
    /// copy kept: the checkpoint then does not hold the tensors given a
    /// destination ([`Checkpoint::holds`]). Every other source is loaded
    /// as [`Engine::load`] loads it ([`Opened::Ready`]).
    ///
    /// The fallback of [`LoadRequest::fallback`] covers what this call
    /// reads (a missing file, a bad header); a data chunk that fails its
    /// digest is found by [`PendingLoad::read_into`], whose caller falls
    /// back by loading again ([`Engine::load_into`] does).
    ///
    /// # Errors
    /// As [`Engine::load`].
    pub fn open_load(&self, req: &LoadRequest) -> Result<Opened> {
        load_with(self, req, true)
    }
}

/// Whether a load error lets `fallback` try an older step.
fn falls_back(e: &Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::Corrupt | ErrorKind::NotFound | ErrorKind::Io | ErrorKind::Unsupported
    )
}

/// `into`'s tensors as `(index into entries, memory)`, each checked to be
/// in `entries` (of `step`) with its length.
fn by_index<'b>(
    entries: &[Entry],
    step: u64,
    into: &'b mut [(&str, &mut [u8])],
) -> Result<Vec<(usize, &'b mut [u8])>> {
    into.iter_mut()
        .map(|(name, d)| {
            let i = entries
                .iter()
                .position(|e| e.name == *name)
                .ok_or_else(|| not_in_step(name, step))?;
            Ok((i, &mut **d))
        })
        .collect()
}

/// What [`Engine::open_load`] found.
#[derive(Debug)]
pub enum Opened {
    /// Loaded and verified: from RAM, a replica, or another rank's file.
    Ready(Checkpoint),
    /// A committed step of this engine's rank to read from storage, or
    /// held by its resident slot, or a RAM snapshot of this rank in its
    /// slot, or another rank's file (or some of its tensors) in its slot
    /// on this node, to check by the copy ([`PendingLoad::read_into`]).
    Pending(PendingLoad),
}

/// A committed step whose header was read but not yet verified, nor its
/// tensors read ([`Engine::open_load`]): a data file open and sized
/// (held open, so retention removing the step meanwhile does not change
/// what is read), or this rank's resident slot, pinned, whose check waits
/// for the copy ([`PendingLoad::read_into`]).
#[derive(Debug)]
pub struct PendingLoad {
    engine: Engine,
    what: Deferred,
    header: Arc<ParsedHeader>,
    t0: Instant,
    /// The ring's warming waits while the load is planned and read.
    _warm: WarmDeferral,
}

/// Where a pending load's bytes are.
#[derive(Debug)]
enum Deferred {
    /// In storage.
    Stored(Box<StoredFile>),
    /// In this rank's ring slot.
    Resident(Box<ResidentSlot>),
    /// This rank's RAM snapshot of a step not committed, in its ring slot.
    Snapshot(Box<SnapshotSlot>),
    /// Another rank's committed file, or some of its tensors, in its slot
    /// on this node.
    PeerTensors(Box<ranks::PeerTensors>),
}

/// This rank's RAM snapshot of a step that is not committed, in its ring
/// slot, pinned, with the quick sums recorded for its image (alone, or
/// beside digests a replica send took); its bytes not checked yet.
#[derive(Debug)]
struct SnapshotSlot {
    step: u64,
    rank: u32,
    pin: PinnedSlot,
    /// The slot file, for messages.
    path: PathBuf,
    sums: Vec<u64>,
    rejected: Option<String>,
    /// As [`ResidentSlot::header_bytes`].
    header_bytes: Arc<[u8]>,
}

/// This rank's resident slot holding a committed step, whose recorded
/// digests are the index's ([`slot_matches_entry`]), pinned; its bytes not
/// checked yet.
#[derive(Debug)]
struct ResidentSlot {
    step: u64,
    rank: u32,
    pin: PinnedSlot,
    info: SlotInfo,
    /// The slot file, for messages.
    path: PathBuf,
    entry: FileEntry,
    expected: Expected,
    rejected: Option<String>,
    /// The image's header bytes (its length prefix included) that
    /// [`PendingLoad::header`] was parsed from: once the image is checked,
    /// a header still holding these bytes is the planned one, which then
    /// is not parsed again.
    header_bytes: Arc<[u8]>,
}

impl PendingLoad {
    /// The step.
    #[must_use]
    pub fn step(&self) -> u64 {
        match &self.what {
            Deferred::Stored(f) => f.step,
            Deferred::Resident(r) => r.step,
            Deferred::Snapshot(r) => r.step,
            Deferred::PeerTensors(r) => r.step(),
        }
    }

    /// Where its bytes will come from: [`Source::Storage`], or
    /// [`Source::Ram`] for a resident slot or a RAM snapshot whose check is
    /// done by the copy.
    #[must_use]
    pub fn source(&self) -> Source {
        match &self.what {
            Deferred::Stored(_) => Source::Storage,
            Deferred::Resident(_) | Deferred::Snapshot(_) | Deferred::PeerTensors(_) => Source::Ram,
        }
    }

    /// The tensors of the file, as its header lists them (verified by
    /// [`PendingLoad::read_into`], which fails if they differ).
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        &self.header.entries
    }

    /// The plain values saved with the step, from its header (verified as
    /// [`PendingLoad::entries`]).
    #[must_use]
    pub fn values(&self) -> &serde_json::Value {
        self.header.values()
    }

    /// The header [`PendingLoad::entries`] and [`PendingLoad::values`]
    /// come from; shared, as [`Checkpoint::header`], with the loads of the
    /// same header bytes (and with the checkpoint this load gives when the
    /// checked header is this one).
    #[must_use]
    pub fn header(&self) -> &Arc<ParsedHeader> {
        &self.header
    }

    /// The size of the step's image, in bytes.
    #[must_use]
    pub fn image_bytes(&self) -> u64 {
        match &self.what {
            Deferred::Stored(f) => f.entry.size,
            Deferred::Resident(r) => r.entry.size,
            Deferred::Snapshot(r) => r.pin.image().len() as u64,
            Deferred::PeerTensors(r) => r.image_bytes(),
        }
    }

    /// Reads the whole file in one pass, verifying each digest chunk as it
    /// lands and copying tensor `i` of [`PendingLoad::entries`] into each
    /// `into` destination `(i, memory)` (exactly its length) by the thread
    /// that checked its chunks, while they are in cache. The image is read
    /// into a ring slot only when one is ready for it (its memory already
    /// faulted in: [`Ring::acquire_ready`](crate::staging::Ring::acquire_ready)),
    /// which then becomes resident as after [`Engine::load`]. Else, with no
    /// destination, into private memory; with destinations, it is streamed
    /// through a few buffers of 16 MiB, and the checkpoint keeps only the
    /// header and the tensors given no destination
    /// ([`Checkpoint::holds`]). Fresh memory for the whole image (a new
    /// node's empty ring) would cost a page fault per 4 KiB, more than the
    /// read itself on some hosts (BENCHMARKS.md, "A replaced node's restore
    /// from storage"); after such a load the free slots grow in the
    /// background.
    ///
    /// From a resident slot ([`PendingLoad::source`] is [`Source::Ram`]),
    /// the same pass over the slot: each chunk checked against the quick
    /// sum recorded beside its digest (`read/fast.rs`) and copied while in
    /// cache. A slot without sums is checked against the digests first,
    /// then copied. A chunk whose sum differs sends the slot to the full
    /// blake3 check: if the bytes pass it, they are copied; if not, the
    /// slot is dropped (the reason goes in [`LoadReport::rejected`]) and
    /// the step is read from storage into `into` as above.
    ///
    /// A RAM snapshot that is not committed is checked and copied in the
    /// same one pass, against the quick sums recorded for it. When a chunk
    /// differs, the next source the load would have taken is read (a
    /// replica on this node or a peer's, checked before use) and copied
    /// into `into`.
    ///
    /// Another rank's file (or some of its tensors) in its slot: each chunk under
    /// the tensors of `into` read into a buffer of a copy thread, checked
    /// against the slot's quick sum and copied into `into`; the chunks
    /// under the others read into the checkpoint's memory, checked the
    /// same way. The checkpoint holds only those ([`Checkpoint::holds`]).
    /// When a chunk differs (the slot reused meanwhile, a changed byte),
    /// the tensors are read from storage into `into`, the reason in
    /// [`LoadReport::rejected`].
    ///
    /// From every source, a chunk is copied into `into` and hashed (its
    /// digest, or its quick sum) in one pass, a cache-sized block at a
    /// time, and compared at the chunk's end; a chunk of this rank's own
    /// slot or another rank's that differs sends every tensor it fed to
    /// be filled again from the full check or storage. On an error, each
    /// destination holds its old bytes or bytes of this step (per read it
    /// spans, and of a chunk whose digest or sum differed, at most one per
    /// checking thread); nothing becomes resident. When the verified
    /// header is not the one [`PendingLoad::entries`] and
    /// [`PendingLoad::values`] came from, the load fails
    /// ([`Error::Corrupt`]).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the tensor when an index is out of range
    /// or a length differs (before anything is read); [`Error::Corrupt`]
    /// naming the file and tensor; [`Error::Io`].
    pub fn read_into(self, into: &mut [(usize, &mut [u8])]) -> Result<Checkpoint> {
        let step = self.step();
        for (i, d) in into.iter() {
            super::checkpoint::destination(&self.header.entries, step, *i, d.len())?;
        }
        match self.what {
            Deferred::Stored(file) => {
                read_stored_into(&self.engine, &file, &self.header, self.t0, into)
            }
            Deferred::Resident(slot) => {
                read_resident_into(&self.engine, slot, self.header, self.t0, into)
            }
            Deferred::Snapshot(slot) => {
                read_snapshot_into(&self.engine, *slot, &self.header, self.t0, into)
            }
            Deferred::PeerTensors(p) => {
                ranks::read_pending_into(self.engine.shared(), *p, &self.header, self.t0, into)
            }
        }
    }
}

/// [`PendingLoad::read_into`] of `file`, planned with `planned`, `into`
/// checked against it.
fn read_stored_into(
    engine: &Engine,
    file: &StoredFile,
    planned: &ParsedHeader,
    t0: Instant,
    into: &mut [(usize, &mut [u8])],
) -> Result<Checkpoint> {
    let given: BTreeSet<usize> = into.iter().map(|(i, _)| *i).collect();
    let targets = into
        .iter_mut()
        .filter_map(|(i, d)| Some((planned.entries.get(*i)?.offset, &mut **d)))
        .collect::<Vec<Target<'_>>>();
    let memory = if targets.is_empty() {
        Memory::Image
    } else {
        Memory::Given(planned, &given)
    };
    let ck = read_stored(engine.shared(), file, targets, t0, memory)?;
    check_planned(&ck, planned, &file.path)?;
    grow_slots_after(engine, file, &ck);
    Ok(ck)
}

/// The placement and the values a caller planned with (`planned`) must be
/// the ones the load verified.
pub(super) fn check_planned(ck: &Checkpoint, planned: &ParsedHeader, path: &Path) -> Result<()> {
    if ck.entries() != planned.entries.as_slice()
        || ck.header().values_text() != planned.values_text()
    {
        return Err(Error::corrupt(
            path,
            None,
            "the header read to plan the load differs from the verified one",
        ));
    }
    Ok(())
}

/// [`PendingLoad::read_into`] of the resident slot `slot`, planned with
/// `planned`, `into` checked against it.
fn read_resident_into(
    engine: &Engine,
    slot: Box<ResidentSlot>,
    planned: Arc<ParsedHeader>,
    t0: Instant,
    into: &mut [(usize, &mut [u8])],
) -> Result<Checkpoint> {
    let shared = engine.shared();
    let ring = &shared.ring;
    let threads = shared.cfg.copy_threads;
    let image = slot.pin.image();
    let chunk = to_usize(slot.entry.chunk_bytes);
    // The check and the copy in one pass, when the slot has sums.
    let copied = ring.quick_sums(slot.info.slot).is_some_and(|sums| {
        let targets = into
            .iter_mut()
            .filter_map(|(i, d)| Some((planned.entries.get(*i)?.offset, &mut **d)))
            .collect::<Vec<Target<'_>>>();
        check_and_copy(image, chunk, &sums, targets, threads)
    });
    if !copied {
        // No sums, or a chunk that differs from its sum: the full check.
        if let Err(e) = check_resident(ring, &slot.info, image, &slot.path, &slot.entry, threads) {
            // The resident copy is only a cache of the committed one:
            // drop it and read storage.
            tracing::warn!(
                "acp: resident copy of step {} rejected, reading storage: {e}",
                slot.step
            );
            let (index, step, rank) = (slot.info.slot, slot.step, slot.rank);
            drop(slot.pin);
            ring.release(index);
            return storage_instead(engine, step, rank, &planned, t0, into, e.to_string());
        }
    }
    let ResidentSlot {
        step,
        pin,
        path,
        expected,
        rejected,
        header_bytes,
        ..
    } = *slot;
    let ck = checked_slot(
        shared,
        step,
        pin,
        &path,
        &planned,
        &header_bytes,
        t0,
        |_| Ok(expected),
    )?
    .with_rejected(rejected);
    if !copied {
        let mut dsts: Vec<(usize, &mut [u8])> =
            into.iter_mut().map(|(i, d)| (*i, &mut **d)).collect();
        ck.copy_into(&mut dsts)?;
    }
    Ok(ck)
}

/// The checkpoint of the slot image `pin` (named `path`), whose bytes were
/// just checked, planned with `planned` parsed from `header_bytes`. The
/// planned header is the checked one when the checked image still holds
/// the bytes it was parsed from (a header of thousands of tensors costs
/// milliseconds to parse again); else the checked bytes are parsed, agree
/// with `expected` (of the image), and must tell the planned story.
#[allow(clippy::too_many_arguments, reason = "one call per kind of slot")]
fn checked_slot(
    shared: &Shared,
    step: u64,
    pin: PinnedSlot,
    path: &Path,
    planned: &Arc<ParsedHeader>,
    header_bytes: &[u8],
    t0: Instant,
    expected: impl FnOnce(&[u8]) -> Result<Expected>,
) -> Result<Checkpoint> {
    let image = pin.image();
    if image.get(..header_bytes.len()) == Some(header_bytes) {
        let planned = Arc::clone(planned);
        return Ok(checked(
            shared,
            step,
            Backing::Slot(pin),
            planned,
            Source::Ram,
            true,
            t0,
        ));
    }
    let expected = expected(image)?;
    let ck = finish(
        shared,
        step,
        Backing::Slot(pin),
        path,
        Source::Ram,
        true,
        t0,
        &expected,
    )?;
    check_planned(&ck, planned, path)?;
    Ok(ck)
}

/// [`PendingLoad::read_into`] of this rank's RAM snapshot `slot`, planned
/// with `planned`, `into` checked against it: the check against its quick
/// sums and the copy in one pass; when a chunk differs, the sources after
/// this rank's slot ([`load_uncommitted`]) in its place.
fn read_snapshot_into(
    engine: &Engine,
    slot: SnapshotSlot,
    planned: &Arc<ParsedHeader>,
    t0: Instant,
    into: &mut [(usize, &mut [u8])],
) -> Result<Checkpoint> {
    let shared = engine.shared();
    let image = slot.pin.image();
    let targets = into
        .iter_mut()
        .filter_map(|(i, d)| Some((planned.entries.get(*i)?.offset, &mut **d)))
        .collect::<Vec<Target<'_>>>();
    if check_and_copy(
        image,
        shared.cfg.chunk_bytes,
        &slot.sums,
        targets,
        shared.cfg.copy_threads,
    ) {
        let rank = slot.rank;
        let ck = checked_slot(
            shared,
            slot.step,
            slot.pin,
            &slot.path,
            planned,
            &slot.header_bytes,
            t0,
            |image| {
                let (header, _) = image_header(shared, &slot.path, image)?;
                Ok(snapshot_expected(shared, &header, rank))
            },
        )?;
        return Ok(ck.with_rejected(slot.rejected));
    }
    // A chunk differs: the error names it and its tensors. The same step
    // from the sources after this rank's slot (a replica on this node, a
    // peer's), else that error: a caller without a step then loads the
    // next one, as after a resident copy that failed.
    let differs =
        replicate::differs_from_sums(image, shared.cfg.chunk_bytes, &slot.sums, &slot.path);
    tracing::warn!(
        "acp: RAM snapshot of step {} rejected: {differs}; trying the next source",
        slot.step
    );
    let (step, rank, path) = (slot.step, slot.rank, slot.path);
    drop(slot.pin);
    let ck = load_uncommitted(shared, step, rank, t0).map_err(|_| differs)?;
    check_planned(&ck, planned, &path)?;
    let mut dsts: Vec<(usize, &mut [u8])> = into.iter_mut().map(|(i, d)| (*i, &mut **d)).collect();
    ck.copy_into(&mut dsts)?;
    // The snapshot's own rejection, which `load_uncommitted` recorded
    // again, else the one of a newer step the load fell back from.
    let rejected = ck.report.rejected.clone().or(slot.rejected);
    Ok(ck.with_rejected(rejected))
}

/// Reads `step` of `rank` from storage into `into`, planned with
/// `planned` (from a resident slot that failed its check, for the reason
/// `why`).
fn storage_instead(
    engine: &Engine,
    step: u64,
    rank: u32,
    planned: &ParsedHeader,
    t0: Instant,
    into: &mut [(usize, &mut [u8])],
    why: String,
) -> Result<Checkpoint> {
    match load_step(engine, step, Some(rank), true, t0, true)? {
        Opened::Pending(mut p) => {
            let path = match &p.what {
                Deferred::Stored(f) => f.path.clone(),
                Deferred::Resident(r) => r.path.clone(),
                Deferred::Snapshot(r) => r.path.clone(),
                Deferred::PeerTensors(r) => r.path().to_path_buf(),
            };
            if p.header.entries != planned.entries
                || p.header.values_text() != planned.values_text()
            {
                return Err(Error::corrupt(
                    &path,
                    None,
                    "the header read to plan the load differs from the verified one",
                ));
            }
            if let Deferred::Stored(f) = &mut p.what {
                f.rejected = Some(why);
            }
            p.read_into(into)
        }
        Opened::Ready(ck) => {
            let path = engine.shared().root.describe(step, &data_file_name(rank));
            check_planned(&ck, planned, &path)?;
            let mut dsts: Vec<(usize, &mut [u8])> =
                into.iter_mut().map(|(i, d)| (*i, &mut **d)).collect();
            ck.copy_into(&mut dsts)?;
            Ok(ck.with_rejected(Some(why)))
        }
    }
}

impl Opened {
    fn rejected(&self) -> bool {
        match self {
            Opened::Ready(c) => c.report.rejected.is_some(),
            Opened::Pending(p) => match &p.what {
                Deferred::Stored(f) => f.rejected.is_some(),
                Deferred::Resident(r) => r.rejected.is_some(),
                Deferred::Snapshot(r) => r.rejected.is_some(),
                Deferred::PeerTensors(r) => r.rejected.is_some(),
            },
        }
    }

    fn with_rejected(self, rejected: Option<String>) -> Opened {
        match self {
            Opened::Ready(c) => Opened::Ready(c.with_rejected(rejected)),
            Opened::Pending(mut p) => {
                match &mut p.what {
                    Deferred::Stored(f) => f.rejected = rejected,
                    Deferred::Resident(r) => r.rejected = rejected,
                    Deferred::Snapshot(r) => r.rejected = rejected,
                    Deferred::PeerTensors(r) => r.rejected = rejected,
                }
                Opened::Pending(p)
            }
        }
    }
}

fn not_in_step(name: &str, step: u64) -> Error {
    Error::invalid(
        format!("tensor `{name}`"),
        format!("not in the loaded step {step}"),
    )
}

fn load(engine: &Engine, req: &LoadRequest) -> Result<Checkpoint> {
    match load_with(engine, req, false)? {
        Opened::Ready(ck) => Ok(ck),
        Opened::Pending(p) => p.read_into(&mut []),
    }
}

/// Loads per `req`; with `defer`, a step read from storage is returned
/// [`Opened::Pending`] (its header verified, its data not read).
fn load_with(engine: &Engine, req: &LoadRequest, defer: bool) -> Result<Opened> {
    engine.check_process()?;
    let shared = engine.shared();
    let t0 = Instant::now();
    let _warm = shared.ring.defer_warming();
    // This rank's RAM snapshots that `load` may serve without a step.
    let ram = if req.step.is_none() {
        ram_snapshots(shared, req)
    } else {
        Vec::new()
    };
    // Resident checkpoints of a dead process that are being persisted are
    // newer than anything committed: let them commit first, unless they
    // were hashed at open and are served from RAM.
    wait_for(shared, None, |st| {
        st.recovering.iter().all(|s| ram.contains(s))
    })?;
    let (ram_first, candidates): (Vec<u64>, Vec<u64>) = match req.step {
        Some(s) => (Vec::new(), vec![s]),
        None => {
            // Every step directory, by name: one whose index is gone was
            // committed once (the index is in place before the rename that
            // commits), and reading its index reports that corruption
            // rather than skipping the step in silence. Nothing is looked
            // up per step: on a cold cache that cost more than a small
            // step's read.
            let steps = shared.root.step_dirs()?;
            // RAM snapshots newer than every committed step come first.
            let newest = steps.last().copied();
            let ram_first: Vec<u64> = ram
                .iter()
                .copied()
                .filter(|s| newest.is_none_or(|n| *s > n))
                .collect();
            if steps.is_empty() && ram_first.is_empty() {
                return Err(Error::NotFound {
                    what: format!(
                        "committed checkpoint in {}",
                        shared.root.location().display()
                    ),
                });
            }
            let newest_first = steps.into_iter().rev();
            let committed = if req.fallback {
                newest_first.collect()
            } else {
                newest_first.take(1).collect()
            };
            (ram_first, committed)
        }
    };
    // A RAM snapshot that fails (changed in RAM, gone meanwhile) is only
    // the newest of several sources: the next one is used, whatever
    // `fallback` says, as for a resident copy of a committed step.
    let mut rejected: Option<String> = None;
    for step in ram_first {
        match load_step(engine, step, req.rank, false, t0, defer) {
            Ok(c) => return Ok(c),
            Err(e) => {
                tracing::warn!(
                    "acp: RAM snapshot of step {step} cannot be loaded, trying the next source: {e}"
                );
                // Why it failed verification goes with the load (a slot
                // released meanwhile is no rejection).
                if e.kind() == ErrorKind::Corrupt || e.to_string().contains("(last rejected: ") {
                    rejected = Some(e.to_string());
                }
            }
        }
    }
    if candidates.is_empty() {
        return Err(Error::NotFound {
            what: format!(
                "intact checkpoint in {}{}",
                shared.root.location().display(),
                rejected.map_or_else(String::new, |r| format!(" (last rejected: {r})"))
            ),
        });
    }
    let mut first_err: Option<Error> = None;
    for step in candidates {
        let result = match (&req.tensors, req.rank) {
            (Some(names), Some(rank)) if rank != shared.cfg.rank => {
                // From that rank's slot, the copy checks each chunk on its
                // way into the caller's memory.
                let pending = (defer && !req.storage_only)
                    .then(|| ranks::pending_tensors(shared, step, rank, Some(names)))
                    .flatten();
                match pending {
                    Some((p, header)) => Ok(Opened::Pending(PendingLoad {
                        engine: engine.clone(),
                        what: Deferred::PeerTensors(Box::new(p)),
                        header: Arc::new(header),
                        t0,
                        _warm: shared.ring.defer_warming(),
                    })),
                    None => ranks::load_tensors(shared, step, rank, names, req.storage_only, t0)
                        .map(Opened::Ready),
                }
            }
            _ => load_step(engine, step, req.rank, req.storage_only, t0, defer),
        };
        match result {
            Ok(c) => {
                if let Some(e) = &first_err {
                    tracing::warn!("acp: fell back to step {step}: {e}");
                }
                if !c.rejected() && rejected.is_some() {
                    return Ok(c.with_rejected(rejected));
                }
                return Ok(c);
            }
            Err(e) if req.fallback && req.step.is_none() && falls_back(&e) => {
                tracing::warn!("acp: step {step} cannot be loaded: {e}");
                first_err.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    Err(first_err.unwrap_or_else(|| Error::NotFound {
        what: format!("intact checkpoint in {}", shared.root.location().display()),
    }))
}

/// The steps of this rank's RAM snapshots that a load without a step may
/// serve, newest first: resident in its ring with recorded digests (hashed
/// by their flush or a replica send) or quick sums (summed in the
/// background or at open, `hash.rs`), so they are checked before they are
/// used; not the image of a save whose flush failed (a
/// failed save is not offered in place of the committed step before it).
/// Only for this rank's own image read from wherever it is, and only with
/// one rank: with several, a step is loadable only once every rank holds
/// it, and no agreement on RAM snapshots across ranks exists, so a load
/// without a step keeps to committed steps there.
fn ram_snapshots(shared: &Shared, req: &LoadRequest) -> Vec<u64> {
    if shared.cfg.world_size != 1
        || req.storage_only
        || req.rank.is_some_and(|r| r != shared.cfg.rank)
    {
        return Vec::new();
    }
    let failed: Vec<(usize, u64)> = shared
        .lock()
        .failed_slots
        .iter()
        .map(|f| (f.slot, f.generation))
        .collect();
    shared
        .ring
        .complete()
        .into_iter()
        .filter(|i| i.has_digests || shared.ring.sums_alone(i.slot).is_some())
        .filter(|i| {
            shared
                .ring
                .generation(i.slot)
                .is_none_or(|g| !failed.contains(&(i.slot, g)))
        })
        .map(|i| i.step)
        .collect()
}

fn load_step(
    engine: &Engine,
    step: u64,
    rank: Option<u32>,
    storage_only: bool,
    t0: Instant,
    defer: bool,
) -> Result<Opened> {
    let shared = engine.shared();
    let own = shared.cfg.rank;
    let rank = rank.unwrap_or(own);
    let index = match shared.root.read_index(step) {
        Ok(index) => index,
        // Not committed: only RAM copies (own, this node's, a peer's) can
        // have it, each checked against the digests recorded with it.
        Err(e) if e.kind() == ErrorKind::NotFound && !storage_only => {
            if defer && rank == own {
                if let Some(p) = plan_snapshot(engine, step, t0) {
                    return Ok(Opened::Pending(p));
                }
            }
            return load_uncommitted(shared, step, rank, t0).map(Opened::Ready);
        }
        Err(e) => return Err(e),
    };
    let file_name = data_file_name(rank);
    let Some(entry) = index.files.get(&file_name) else {
        return Err(Error::NotFound {
            what: format!(
                "rank {rank}'s file in step {step} of {}",
                shared.root.location().display()
            ),
        });
    };
    let threads = shared.cfg.copy_threads;
    let expected = Expected::of(&index, &file_name, rank);
    let mut rejected = None;
    if !storage_only && rank != own && defer {
        // Another rank's image resident in its slot on this node, checked
        // on its way into the caller's memory.
        if let Some((p, header)) = ranks::pending_tensors(shared, step, rank, None) {
            match check_header(p.path(), &header, step, &expected) {
                Ok(()) => {
                    return Ok(Opened::Pending(PendingLoad {
                        engine: engine.clone(),
                        what: Deferred::PeerTensors(Box::new(p)),
                        header: Arc::new(header),
                        t0,
                        _warm: shared.ring.defer_warming(),
                    }))
                }
                // Copied and checked below, which names what is wrong.
                Err(e) => tracing::debug!("acp: rank {rank}'s slot: {e}"),
            }
        }
    }
    if !storage_only && rank != own {
        // Another rank's image may be resident in its slot on this node.
        if let Some(copy) = ranks::copy_from_peer_slot(shared, step, rank, entry) {
            let (buf, slot_path) = (copy.buf, copy.path);
            let len = to_usize(entry.size);
            // Summed as it was copied, against the sums the slot took
            // beside the committed digests, as for this rank's own slot;
            // else (or when one differs) blake3.
            let checked = if copy.summed {
                Ok(())
            } else {
                verify_in_place(&buf[..len], &slot_path, entry, threads).map(|_| ())
            };
            match checked {
                Ok(()) => {
                    let backing = Backing::Heap(buf, len);
                    return finish(
                        shared,
                        step,
                        backing,
                        &slot_path,
                        Source::Ram,
                        true,
                        t0,
                        &expected,
                    )
                    .map(Opened::Ready);
                }
                Err(e) => tracing::warn!(
                    "acp: rank {rank}'s resident copy of step {step} rejected, reading storage: {e}"
                ),
            }
        }
    }
    if !storage_only && rank == own {
        for info in shared.ring.complete() {
            if info.step != step || info.len != entry.size {
                continue;
            }
            let Ok(pin) = shared.ring.pin(info.slot) else {
                continue;
            };
            let slot_path = shared.ring.slot_path(info.slot);
            // The job id names the ring, not the root: a slot of this step
            // may hold another root's image (two roots under one job id, a
            // root removed and made again). Only one whose recorded digests
            // are this index's is this checkpoint; the pin keeps them fixed.
            if !slot_matches_entry(&shared.ring, &info, entry, shared.cfg.chunk_bytes as u64) {
                tracing::warn!(
                    "acp: resident copy of step {step} in {} is not the one {} records (another root's image, or no digests); reading storage",
                    slot_path.display(),
                    shared.root.describe(step, crate::format::INDEX_FILE_NAME).display()
                );
                continue;
            }
            let verified = shared.cfg.verify == Verify::Always;
            if verified && defer {
                // The check waits for the copy, which does both in one
                // pass ([`PendingLoad::read_into`]); planned from the
                // slot's header, compared with the checked one then.
                match plan_resident(shared, &pin, &slot_path, step, &expected) {
                    Ok((header, header_bytes)) => {
                        return Ok(Opened::Pending(PendingLoad {
                            engine: engine.clone(),
                            what: Deferred::Resident(Box::new(ResidentSlot {
                                step,
                                rank,
                                pin,
                                info,
                                path: slot_path,
                                entry: entry.clone(),
                                expected,
                                rejected,
                                header_bytes,
                            })),
                            header,
                            t0,
                            _warm: shared.ring.defer_warming(),
                        }));
                    }
                    // Checked now, which names what is wrong.
                    Err(e) => tracing::debug!("acp: resident copy of step {step}: {e}"),
                }
            }
            if verified {
                if let Err(e) =
                    check_resident(&shared.ring, &info, pin.image(), &slot_path, entry, threads)
                {
                    // The resident copy is only a cache of the committed
                    // one: drop it and read storage.
                    tracing::warn!(
                        "acp: resident copy of step {step} rejected, reading storage: {e}"
                    );
                    rejected = Some(e.to_string());
                    drop(pin);
                    shared.ring.release(info.slot);
                    break;
                }
            }
            return finish(
                shared,
                step,
                Backing::Slot(pin),
                &slot_path,
                Source::Ram,
                verified,
                t0,
                &expected,
            )
            .map(|c| Opened::Ready(c.with_rejected(rejected)));
        }
    }
    if !storage_only {
        // This node's replica slots of the rank, then its holders on
        // other nodes, before the storage.
        let found = replicate::node_replica(shared, step, rank, Some(entry), &mut rejected)
            .or_else(|| replicate::from_peers(shared, step, rank, Some(entry), &mut rejected));
        if let Some(f) = found {
            return finish(
                shared, step, f.backing, &f.origin, f.source, true, t0, &expected,
            )
            .map(|c| Opened::Ready(c.with_rejected(rejected)));
        }
    }
    let path = shared.root.describe(step, &file_name);
    // The file's true size before any memory is sized by the index's.
    let opened = shared.root.open_file(step, &file_name);
    let file = check_file_size(opened, &path, entry.file_len(), &expected.tensors)?;
    let stored = StoredFile {
        step,
        own: rank == own,
        name: file_name,
        path,
        file,
        entry: entry.clone(),
        expected,
        rejected,
    };
    // Only this rank's own file is deferred: another rank's is read into
    // private memory, whole, by `ranks` or here.
    if defer && stored.own {
        let header = read_header_for_plan(shared, &stored)?;
        return Ok(Opened::Pending(PendingLoad {
            engine: engine.clone(),
            what: Deferred::Stored(Box::new(stored)),
            header,
            t0,
            _warm: shared.ring.defer_warming(),
        }));
    }
    let ck = read_stored(shared, &stored, Vec::new(), t0, Memory::Image)?;
    grow_slots_after(engine, &stored, &ck);
    Ok(Opened::Ready(ck))
}

/// After a load of this rank's `file` that found no ring slot ready for
/// it (a new node's ring) and read it elsewhere: the next saves are
/// likely of its size, so the free slots grow in the background, once the
/// load is done, rather than in the first saves' stalls; and the step is
/// read again into one of them, so that it is resident until the next
/// save (`reside.rs`).
fn grow_slots_after(engine: &Engine, file: &StoredFile, ck: &Checkpoint) {
    if file.own && matches!(ck.backing, Backing::Heap(..)) {
        engine.inner.warm.saw(file.entry.size);
        engine.keep_restored(file);
    }
}

/// The header of the resident image `pin` (the slot file `path`), not yet
/// checked, checked against the index like a loaded one, for planning a
/// load whose copy checks it ([`read_resident_into`]); with the bytes it
/// was parsed from (the image up to its data section).
fn plan_resident(
    shared: &Shared,
    pin: &PinnedSlot,
    path: &Path,
    step: u64,
    expected: &Expected,
) -> Result<(Arc<ParsedHeader>, Arc<[u8]>)> {
    let (header, bytes) = image_header(shared, path, pin.image())?;
    check_header(path, &header, step, expected)?;
    Ok((header, bytes))
}

/// A header parsed from an image, with the bytes it was parsed from (its
/// length prefix and JSON text: the image up to its data section).
#[derive(Clone)]
pub(super) struct KeptHeader {
    bytes: Arc<[u8]>,
    image_len: u64,
    header: Arc<ParsedHeader>,
    /// Where its `__metadata__` value lies in `bytes`, when it has one.
    metadata: Option<std::ops::Range<usize>>,
}

impl std::fmt::Debug for KeptHeader {
    /// Sizes only: the bytes and the header are large.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeptHeader")
            .field("header_bytes", &self.bytes.len())
            .field("image_len", &self.image_len)
            .field("tensors", &self.header.entries.len())
            .finish()
    }
}

/// [`parse_header`](crate::format::parse_header) of `image` (named `path`
/// in errors), with the bytes it was parsed from. The engine keeps the
/// last header it parsed ([`Shared::kept_header`]): an image of the same
/// length whose bytes up to its data section are the kept ones gives the
/// kept header, unparsed (a header of thousands of tensors costs
/// milliseconds to parse, a comparison of its bytes microseconds), and
/// one that differs from them only in its metadata gives the kept tensors
/// with that metadata parsed ([`crate::format::parse_header_like`]). The
/// parse reads nothing else and
/// depends on nothing else: the kept header is the one a parse of `image`
/// would give now. Nothing here checks the bytes against a digest: as
/// after a parse, the caller checks them, or they were checked.
fn image_header(
    shared: &Shared,
    path: &Path,
    image: &[u8],
) -> Result<(Arc<ParsedHeader>, Arc<[u8]>)> {
    let len = image.len() as u64;
    let kept = shared
        .kept_header
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    // A header like the kept one but for its metadata (the next step a
    // kept save plan wrote: its step and values changed) gives the kept
    // tensors with the new metadata, which alone is parsed.
    let mut like = None;
    if let Some(k) = kept {
        if k.image_len == len && image.get(..k.bytes.len()) == Some(&k.bytes[..]) {
            return Ok((k.header, k.bytes));
        }
        if let (true, Some(span)) = (k.image_len == len, k.metadata.clone()) {
            like = crate::format::parse_header_like(path, image, len, (&k.header, &k.bytes, span));
        }
    }
    let (header, metadata) = match like {
        Some(parsed) => parsed.map(|(h, span)| (h, Some(span)))?,
        None => crate::format::parse_header_spanned(path, image, len)?,
    };
    let header = Arc::new(header);
    // `parse_header` read no byte past the data start, which lies inside
    // the image (it refused the header otherwise).
    let bytes: Arc<[u8]> = usize::try_from(header.data_start)
        .ok()
        .and_then(|end| image.get(..end))
        .ok_or_else(|| Error::corrupt(path, None, "header ends past the image"))?
        .into();
    *shared
        .kept_header
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(KeptHeader {
        bytes: Arc::clone(&bytes),
        image_len: len,
        header: Arc::clone(&header),
        metadata,
    });
    Ok((header, bytes))
}

/// A committed data file, opened and sized, that a load reads from
/// storage.
#[derive(Debug)]
pub(super) struct StoredFile {
    pub(super) step: u64,
    /// Whether it is this engine's rank's file (which a ring slot may hold).
    pub(super) own: bool,
    /// Its name in the step directory.
    name: String,
    pub(super) path: PathBuf,
    file: File,
    pub(super) entry: FileEntry,
    expected: Expected,
    /// Why a resident copy was found but not used.
    rejected: Option<String>,
}

impl StoredFile {
    /// The same file through another handle of it, for a read after this
    /// load (`reside.rs`); `None`, logged, when the handle cannot be
    /// duplicated.
    pub(super) fn reopened(&self) -> Option<StoredFile> {
        let file = match self.file.try_clone() {
            Ok(f) => f,
            Err(e) => {
                tracing::debug!(path = %self.path.display(), "acp: not kept resident: {e}");
                return None;
            }
        };
        Some(StoredFile {
            step: self.step,
            own: self.own,
            name: self.name.clone(),
            path: self.path.clone(),
            file,
            entry: self.entry.clone(),
            expected: self.expected.clone(),
            rejected: None,
        })
    }
}

/// Runs `f` on a verified reader of `stored`: through the I/O engine for
/// a plain file, through its decoded frames for a compressed one.
pub(super) fn with_reader<T>(
    shared: &Shared,
    stored: &StoredFile,
    f: &mut dyn FnMut(&mut dyn VerifiedRead) -> Result<T>,
) -> Result<T> {
    let (entry, path) = (&stored.entry, &stored.path);
    if entry.stored_size.is_some() {
        // A compressed file: its frames are read, checked and decoded on
        // the copy threads, each chunk then checked like a plain one.
        let file = stored
            .file
            .try_clone()
            .map_err(|e| Error::io("open", path, e))?;
        let src = StoredSource::open(
            &*shared.root,
            stored.step,
            &stored.name,
            file,
            path.clone(),
            entry,
            shared.io_opts.faults.as_ref(),
        )?;
        return f(&mut ChunkReader::new(src, entry)?);
    }
    let src = IoSource {
        io: &*shared.io,
        opts: &shared.io_opts,
        file: &stored.file,
        path,
        len: entry.size,
    };
    f(&mut ChunkReader::new(src, entry)?)
}

/// What a load needs of a [`ChunkReader`], whatever its source.
pub(super) trait VerifiedRead {
    fn header(&mut self) -> Result<ParsedHeader>;
    fn read_verified_streamed(
        &mut self,
        threads: usize,
        io_chunk: usize,
        targets: Vec<Target<'_>>,
    ) -> Result<Vec<Digest>>;
    fn read_verified_into(
        &mut self,
        dst: &mut [u8],
        threads: usize,
        io_chunk: usize,
        targets: Vec<Target<'_>>,
    ) -> Result<Vec<Digest>>;
    /// [`ChunkReader::on_checked`].
    fn on_checked(&mut self, f: OnChecked);
}

impl<S: ChunkSource + Sync> VerifiedRead for ChunkReader<S> {
    fn header(&mut self) -> Result<ParsedHeader> {
        ChunkReader::header(self).cloned()
    }

    fn read_verified_streamed(
        &mut self,
        threads: usize,
        io_chunk: usize,
        targets: Vec<Target<'_>>,
    ) -> Result<Vec<Digest>> {
        ChunkReader::read_verified_streamed(self, threads, io_chunk, targets)
    }

    fn read_verified_into(
        &mut self,
        dst: &mut [u8],
        threads: usize,
        io_chunk: usize,
        targets: Vec<Target<'_>>,
    ) -> Result<Vec<Digest>> {
        if targets.is_empty() {
            return self.read_verified(dst, threads, io_chunk);
        }
        ChunkReader::read_verified_into(self, dst, threads, io_chunk, targets)
    }

    fn on_checked(&mut self, f: OnChecked) {
        ChunkReader::on_checked(self, f);
    }
}

/// The header of `stored`, checked against the index like a loaded one,
/// for planning a read. Of a plain file, read as is (a few KiB, buffered,
/// where checking it would read its whole digest chunk): the read that
/// follows checks the chunks
/// under it against their digests, and [`PendingLoad::read_into`] refuses
/// a header that differs from what that read verified. Of a compressed
/// file, likewise: the first frame is read and checked, and only its plane
/// of header bytes decoded ([`StoredSource::lead`]; the whole chunk's
/// decode and digest cost milliseconds, serial, that the read pays again),
/// else (a header past the first chunk, a first chunk stored raw or
/// referenced, or anything that fails there) read from the decoded
/// chunks, each checked against its digest.
fn read_header_for_plan(shared: &Shared, stored: &StoredFile) -> Result<Arc<ParsedHeader>> {
    let header = if stored.entry.stored_size.is_some() {
        match lead_header(shared, stored) {
            Some(h) => h,
            None => with_reader(shared, stored, &mut |r| r.header())?,
        }
    } else {
        use std::os::unix::fs::FileExt;
        let path = &stored.path;
        read_header(
            path,
            stored.entry.size,
            crate::format::MAX_HEADER_BYTES,
            |buf, at| {
                stored
                    .file
                    .read_exact_at(buf, at)
                    .map_err(|e| Error::io("read", path, e))
            },
        )?
    };
    check_header(&stored.path, &header, stored.step, &stored.expected)?;
    Ok(Arc::new(header))
}

/// The header of the compressed file `stored` from its first frame's
/// header bytes alone ([`StoredSource::lead`]), unverified; `None` when
/// they do not hold it or anything fails (the caller then reads it from
/// verified chunks, which names what is wrong). The file's references are
/// resolved first, so that a planned header never lists tensors in chunks
/// that no earlier step holds.
fn lead_header(shared: &Shared, stored: &StoredFile) -> Option<ParsedHeader> {
    let file = stored.file.try_clone().ok()?;
    let src = StoredSource::open(
        &*shared.root,
        stored.step,
        &stored.name,
        file,
        stored.path.clone(),
        &stored.entry,
        shared.io_opts.faults.as_ref(),
    )
    .ok()?;
    let lead = src.lead().ok()??;
    read_header(
        &stored.path,
        stored.entry.size,
        crate::format::MAX_HEADER_BYTES,
        |buf, at| {
            let bytes = usize::try_from(at)
                .ok()
                .and_then(|s| lead.get(s..s.checked_add(buf.len())?))
                .ok_or_else(|| {
                    Error::invalid(stored.path.display(), "past the first frame's header bytes")
                })?;
            buf.copy_from_slice(bytes);
            Ok(())
        },
    )
    .ok()
}

/// Reads `stored` whole, each chunk verified as it lands, into a ring slot
/// (this rank's file, when the ring has room: it becomes resident) or
/// private memory, copying file bytes into `targets` in the read's own pass
/// ([`ChunkReader::read_verified_into`]). Nothing is sealed or handed out
/// before every digest matched, and nothing reaches `targets` before its
/// chunk matched.
fn read_stored(
    shared: &Shared,
    stored: &StoredFile,
    targets: Vec<Target<'_>>,
    t0: Instant,
    memory: Memory<'_>,
) -> Result<Checkpoint> {
    let (entry, path, step) = (&stored.entry, &stored.path, stored.step);
    let fits = stored.own && entry.size <= shared.ring.max_image_bytes();
    let threads = shared.cfg.copy_threads;
    let io_chunk = shared.io_opts.chunk_bytes;
    let mut targets = Some(targets);
    // The offsets of the tensors whose bytes went only to the caller.
    let mut elsewhere = BTreeSet::new();
    // The reader is opened first: a compressed file's references are
    // resolved against the steps that hold their chunks (which bounds the
    // index's length) before memory is sized by that length.
    let backing = with_reader(shared, stored, &mut |r| {
        let mut targets = targets.take().unwrap_or_default();
        // Only a slot whose memory is ready: fresh ring memory costs a
        // page fault per 4 KiB (and cannot use huge pages), more than the
        // read itself on some hosts (BENCHMARKS.md, "A replaced node's
        // restore from storage").
        let slot = if fits {
            shared.ring.acquire_ready(entry.size, step)?
        } else {
            None
        };
        if let Some(mut slot) = slot {
            let digests = r.read_verified_into(slot.image_mut(), threads, io_chunk, targets)?;
            let pin = seal_stored(&shared.ring, slot, step, entry.size, &digests);
            Ok(Backing::Slot(pin))
        } else if let Memory::Given(planned, given) = memory {
            // No slot ready: stream the file through a few small buffers
            // into the caller's memory, and keep only the header and the
            // tensors given no destination, in memory that is never
            // touched elsewhere (so never faulted in).
            let mut kept = memmap2::MmapMut::map_anon(to_usize(entry.size).max(1))
                .map_err(|e| Error::io("allocate", path, e))?;
            let others = planned
                .entries
                .iter()
                .enumerate()
                .filter(|(i, _)| !given.contains(i))
                .map(|(_, e)| (e.offset, e.offset.saturating_add(e.len)));
            let ranges = kept_ranges(planned.data_start, others, entry.size);
            targets.extend(carve(&mut kept, &ranges));
            r.read_verified_streamed(threads, io_chunk, targets)?;
            elsewhere = planned
                .entries
                .iter()
                .enumerate()
                .filter(|(i, e)| e.len > 0 && given.contains(i))
                .map(|(_, e)| e.offset)
                .collect();
            Ok(Backing::Heap(kept, to_usize(entry.size)))
        } else {
            // Private memory, in huge pages where the kernel allows: a
            // fresh load hands it to its tensors without a copy.
            let mut buf = heap_whole(entry.size, path)?;
            r.read_verified_into(&mut buf, threads, io_chunk, targets)?;
            Ok(Backing::Heap(buf, to_usize(entry.size)))
        }
    })?;
    let mut ck = finish(
        shared,
        step,
        backing,
        path,
        Source::Storage,
        true,
        t0,
        &stored.expected,
    )?;
    ck.elsewhere = elsewhere;
    Ok(ck.with_rejected(stored.rejected.clone()))
}

/// Seals `slot`, filled with the `size` bytes of committed `step` by a
/// read that verified them against `digests`, as a persisted image with
/// those digests: a restart may restore it from RAM.
pub(super) fn seal_stored(
    ring: &Ring,
    slot: StagingSlot,
    step: u64,
    size: u64,
    digests: &[Digest],
) -> PinnedSlot {
    let pin = slot.seal(step, size);
    ring.set_digests(pin.slot(), digests);
    ring.set_state(pin.slot(), SlotState::Persisted);
    pin
}

/// Where a storage read puts the image.
#[derive(Clone, Copy)]
enum Memory<'a> {
    /// All of it in memory: a ring slot whose memory is ready, else
    /// private memory.
    Image,
    /// The tensors of the given indices of the planned header go to the
    /// caller: a ring slot whose memory is ready holds the image, else
    /// only the rest is kept.
    Given(&'a ParsedHeader, &'a BTreeSet<usize>),
}

/// The byte ranges of an image of `size` bytes a streamed load keeps: the
/// header (`0..data_start`) and the `others` (the tensors given no
/// destination); sorted, merged where they touch or overlap (a hostile
/// header may overlap its tensors), cut to the image, empty ones dropped.
fn kept_ranges(
    data_start: u64,
    others: impl Iterator<Item = (u64, u64)>,
    size: u64,
) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = std::iter::once((0, data_start))
        .chain(others)
        .map(|(s, e)| (s.min(size), e.min(size)))
        .filter(|(s, e)| s < e)
        .collect();
    ranges.sort_unstable();
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for (s, e) in ranges {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged
}

/// `mem`'s bytes at each of `ranges` (sorted, disjoint, inside `mem`), as
/// targets at the same offsets.
fn carve<'m>(mem: &'m mut [u8], ranges: &[(u64, u64)]) -> Vec<Target<'m>> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut rest = mem;
    let mut at = 0u64;
    for &(s, e) in ranges {
        let tail = std::mem::take(&mut rest).split_at_mut(to_usize(s - at)).1;
        let (part, tail) = tail.split_at_mut(to_usize(e - s));
        out.push((s, part));
        rest = tail;
        at = e;
    }
    out
}

/// A load of this rank's RAM snapshot of `step` (not committed) whose
/// check waits for the copy ([`read_snapshot_into`]), planned from the
/// image's header: `None` when this rank's ring holds no snapshot of it
/// with quick sums, or its header does not parse or is not of this step
/// (the load then takes [`load_uncommitted`], which says why).
fn plan_snapshot(engine: &Engine, step: u64, t0: Instant) -> Option<PendingLoad> {
    let shared = engine.shared();
    let ring = &shared.ring;
    let (info, pin, sums) = replicate::own_snapshot(ring, step)?;
    let sums = sums?;
    let path = ring.slot_path(info.slot);
    let rank = shared.cfg.rank;
    let planned = image_header(shared, &path, pin.image()).and_then(|(header, bytes)| {
        let expected = snapshot_expected(shared, &header, rank);
        check_header(&path, &header, step, &expected)?;
        Ok((header, bytes))
    });
    let (header, header_bytes) = match planned {
        Ok(p) => p,
        Err(e) => {
            tracing::debug!("acp: RAM snapshot of step {step}: {e}");
            return None;
        }
    };
    Some(PendingLoad {
        engine: engine.clone(),
        what: Deferred::Snapshot(Box::new(SnapshotSlot {
            step,
            rank,
            pin,
            path,
            sums,
            rejected: None,
            header_bytes,
        })),
        header,
        t0,
        _warm: ring.defer_warming(),
    })
}

/// What a snapshot's `header` must agree with: no index lists its
/// tensors, so the header does, with this job's rank and world size.
fn snapshot_expected(shared: &Shared, header: &ParsedHeader, rank: u32) -> Expected {
    let mut tensors: Vec<String> = header.entries.iter().map(|e| e.name.clone()).collect();
    tensors.sort_unstable();
    Expected {
        tensors,
        rank,
        world_size: shared.cfg.world_size,
    }
}

/// Loads `rank`'s image of `step`, which is not committed, from RAM: this
/// rank's own slot (or, for another rank's, that rank's slot on this
/// node), a replica slot on this node, then a peer's replica, each
/// verified against the digests or quick sums recorded with it. The
/// tensors and rank the verified header lists are what it is checked
/// against.
fn load_uncommitted(shared: &Shared, step: u64, rank: u32, t0: Instant) -> Result<Checkpoint> {
    let own = shared.cfg.rank;
    let mut rejected = None;
    let found = (if rank == own {
        replicate::own_uncommitted(shared, step, &mut rejected)
    } else {
        replicate::node_slot(shared, step, rank, &mut rejected)
    })
    .or_else(|| replicate::node_replica(shared, step, rank, None, &mut rejected))
    .or_else(|| replicate::from_peers(shared, step, rank, None, &mut rejected));
    let Some(f) = found else {
        let last = rejected.map_or_else(String::new, |r| format!(" (last rejected: {r})"));
        return Err(Error::NotFound {
            what: format!(
                "rank {rank}'s image of step {step}: not committed in {}, and no verified copy in RAM{last}",
                shared.root.location().display()
            ),
        });
    };
    let (header, _) = image_header(shared, &f.origin, f.backing.image())?;
    let expected = snapshot_expected(shared, &header, rank);
    finish(
        shared, step, f.backing, &f.origin, f.source, true, t0, &expected,
    )
    .map(|c| c.with_rejected(rejected))
}

/// Checks `image`, which came from the file at `path`, in place against
/// `entry`'s digests ([`ChunkReader::verify_in_place`]).
fn verify_in_place(
    image: &[u8],
    path: &Path,
    entry: &FileEntry,
    threads: usize,
) -> Result<Vec<crate::format::Digest>> {
    ChunkReader::new(MemSource::new(image, path), entry)?.verify_in_place(threads)
}

/// Checks the image of this rank's resident slot `info` (whose recorded
/// digests are `entry`'s: [`slot_matches_entry`]) before it is used: by the
/// quick sums recorded beside those digests in the slot's control block
/// (by its flush, or by an earlier full check, in this process or an
/// earlier one) when there are some and every chunk still gives its sum,
/// else by the blake3 check against `entry` ([`verify_in_place`]), which
/// records the quick sums for the next load. A quick sum that differs only
/// sends the image to the blake3 check, whose error names the file and
/// tensor.
///
/// # Errors
/// As [`verify_in_place`].
fn check_resident(
    ring: &Ring,
    info: &SlotInfo,
    image: &[u8],
    path: &Path,
    entry: &FileEntry,
    threads: usize,
) -> Result<()> {
    if given_sums(
        info.step,
        image,
        path,
        entry,
        ring.quick_sums(info.slot),
        threads,
    ) {
        return Ok(());
    }
    let (digests, sums) =
        ChunkReader::new(MemSource::new(image, path), entry)?.verify_in_place_with_sums(threads)?;
    ring.record_quick_sums(info.slot, &digests, &sums);
    Ok(())
}

/// Whether every chunk of `image` (a resident copy of `entry`'s file of
/// `step`, in `path`) gives its quick sum in `sums` (recorded beside `entry`'s
/// digests); false, logged, when one does not, and false when there are
/// none: the caller then checks the digests, whose error names the chunk.
fn given_sums(
    step: u64,
    image: &[u8],
    path: &Path,
    entry: &FileEntry,
    sums: Option<Vec<u64>>,
    threads: usize,
) -> bool {
    let Some(sums) = sums else {
        return false;
    };
    if sums_match(image, to_usize(entry.chunk_bytes), &sums, threads) {
        return true;
    }
    tracing::warn!(
        "acp: resident copy of step {step} in {} differs from its quick sums; checking its digests",
        path.display()
    );
    false
}

/// Whether ring slot `info` records, for its image, the length, the chunk
/// size and every chunk digest that `entry` (a committed index's entry for
/// this rank's file) records: the slot then holds that file's bytes unless
/// they changed since they were hashed (which [`Verify::Always`] checks).
/// A comparison of recorded digests, no hashing; a slot without recorded
/// digests does not match.
pub(super) fn slot_matches_entry(
    ring: &Ring,
    info: &SlotInfo,
    entry: &FileEntry,
    chunk_bytes: u64,
) -> bool {
    let Some(digests) = ring.digests(info.slot) else {
        return false;
    };
    entry.size == info.len
        && entry.chunk_bytes == chunk_bytes
        && entry.chunks.len() == digests.len()
        && entry
            .chunks
            .iter()
            .zip(&digests)
            .all(|(h, d)| unhex(h).as_ref() == Some(d))
}

/// What the index says of one data file, checked against its header.
#[derive(Debug, Clone)]
struct Expected {
    /// The tensors the index maps to the file, sorted.
    tensors: Vec<String>,
    rank: u32,
    world_size: u32,
}

impl Expected {
    /// What `index` says of its file `file`, written by `rank`.
    fn of(index: &crate::format::Index, file: &str, rank: u32) -> Expected {
        Expected {
            tensors: index
                .weight_map
                .iter()
                .filter(|(_, f)| *f == file)
                .map(|(t, _)| t.clone())
                .collect(),
            rank,
            world_size: index.world_size,
        }
    }
}

/// The checks a load makes of file `file`'s header (the file at `path`)
/// against the index of `step`: the same step, tensors, rank and world
/// size. For `acp verify` and `acp export`, which refuse what a load
/// refuses.
///
/// # Errors
/// [`Error::Corrupt`] naming `path` (and the tensor, for a tensor list
/// that differs).
pub(crate) fn check_file_header(
    path: &Path,
    header: &ParsedHeader,
    step: u64,
    index: &crate::format::Index,
    file: &str,
) -> Result<()> {
    let rank = index.files.get(file).map_or(0, |f| f.rank);
    check_header(path, header, step, &Expected::of(index, file, rank))
}

/// Checks that `opened`, the data file named `path` (opened by
/// [`Storage::open_file`](crate::storage::Storage::open_file), so a FIFO is
/// refused, not waited on), has `size` bytes (the index's), so no buffer is
/// sized by an index that disagrees with the file; returns the file. Names
/// the tensor cut by a truncation when the header is still readable, else
/// the first tensor the file should hold.
fn check_file_size(
    opened: Result<FileHandle>,
    path: &Path,
    size: u64,
    tensors: &[String],
) -> Result<File> {
    let first = tensors.first().map(String::as_str);
    let file = match opened {
        Ok(f) => f.into_parts().0,
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::corrupt(
                path,
                first,
                format!(
                    "missing: the index lists it, with {} tensors",
                    tensors.len()
                ),
            ));
        }
        Err(e) => return Err(e),
    };
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    let got = meta.len();
    if got == size {
        return Ok(file);
    }
    let cut = if got < size {
        tensor_at(&file, path, size, got)
    } else {
        None
    };
    Err(Error::corrupt(
        path,
        cut.as_deref().or(first),
        format!("file is {got} bytes, the index says {size}"),
    ))
}

/// The tensor holding byte `offset` of the data file `file` at `path`
/// (whose index says it has `size` bytes), read from its header; `None`
/// when the header cannot be read or parsed. Reads at most 1 MiB of header.
fn tensor_at(file: &File, path: &Path, size: u64, offset: u64) -> Option<String> {
    use std::os::unix::fs::FileExt;
    read_header(path, size, 1 << 20, |buf, at| {
        file.read_exact_at(buf, at)
            .map_err(|e| Error::io("read", path, e))
    })
    .ok()?
    .entries
    .into_iter()
    .find(|e| e.offset <= offset && offset < e.offset + e.len.max(1))
    .map(|e| e.name)
}

/// Private page-aligned memory for an image of `len` bytes (padded to a
/// page, as the I/O layer reads whole pages), its pages taken as they are
/// first written: for a buffer written in part.
pub(super) fn heap(len: u64, what: &Path) -> Result<memmap2::MmapMut> {
    let padded = to_usize(len).div_ceil(4096).max(1) * 4096;
    memmap2::MmapMut::map_anon(padded).map_err(|e| Error::io("allocate", what, e))
}

/// [`heap`] for an image about to be written whole: its pages taken first,
/// in huge pages where the kernel allows ([`crate::read::image_memory`]).
pub(super) fn heap_whole(len: u64, what: &Path) -> Result<memmap2::MmapMut> {
    crate::read::image_memory(to_usize(len), what)
}

#[expect(
    clippy::too_many_arguments,
    reason = "one call site per source; a struct would only rename them"
)]
fn finish(
    shared: &Shared,
    step: u64,
    backing: Backing,
    path: &Path,
    source: Source,
    verified: bool,
    t0: Instant,
    expected: &Expected,
) -> Result<Checkpoint> {
    let (header, _) = image_header(shared, path, backing.image())?;
    check_header(path, &header, step, expected)?;
    Ok(checked(shared, step, backing, header, source, verified, t0))
}

/// The checkpoint of `backing`, whose `header` (parsed from it) was checked
/// against the index ([`check_header`]).
fn checked(
    shared: &Shared,
    step: u64,
    backing: Backing,
    header: Arc<ParsedHeader>,
    source: Source,
    verified: bool,
    t0: Instant,
) -> Checkpoint {
    let report = LoadReport {
        source,
        bytes: backing.image().len() as u64,
        verified,
        secs: t0.elapsed().as_secs_f64(),
        rejected: None,
    };
    Checkpoint {
        step,
        header,
        backing,
        report,
        copy_threads: shared.cfg.copy_threads,
        elsewhere: std::collections::BTreeSet::new(),
        warm: std::sync::Mutex::new(Some(shared.ring.defer_warming())),
    }
}

/// A verified header must be of `step` and agree with the index
/// ([`check_agrees`]).
fn check_header(path: &Path, header: &ParsedHeader, step: u64, expected: &Expected) -> Result<()> {
    if header.step.is_some_and(|s| s != step) {
        return Err(Error::corrupt(
            path,
            None,
            format!("header says step {:?}, expected {step}", header.step),
        ));
    }
    check_agrees(path, header, expected)
}

/// The index and the file's header must tell the same story: the same
/// tensors, rank and world size. (The digests vouch for the file; this
/// catches an index changed where its digests do not reach.)
fn check_agrees(path: &Path, header: &ParsedHeader, expected: &Expected) -> Result<()> {
    // In name order, sorted once per header (a kept slot header is
    // checked at every load).
    let names: Vec<&str> = header
        .by_name()
        .iter()
        .map(|&i| header.entries[i as usize].name.as_str())
        .collect();
    if names != expected.tensors {
        let odd = names
            .iter()
            .copied()
            .find(|n| {
                expected
                    .tensors
                    .binary_search_by(|t| t.as_str().cmp(n))
                    .is_err()
            })
            .or_else(|| {
                expected
                    .tensors
                    .iter()
                    .map(String::as_str)
                    .find(|n| names.binary_search(n).is_err())
            });
        return Err(Error::corrupt(
            path,
            odd,
            "the index and the file's header list different tensors",
        ));
    }
    for (key, want) in [
        ("acp.rank", expected.rank),
        ("acp.world_size", expected.world_size),
    ] {
        if let Some(got) = header.metadata.get(key) {
            if got.parse::<u32>().ok() != Some(want) {
                return Err(Error::corrupt(
                    path,
                    None,
                    format!("header says {key} {got}, the index {want}"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_streamed_load_keeps_the_header_and_the_tensors_not_given() {
        // Overlapping, touching, empty, reversed and out-of-image ranges.
        let others = [(50, 60), (55, 70), (70, 80), (90, 90), (95, 92), (150, 400)];
        let ranges = kept_ranges(20, others.into_iter(), 200);
        assert_eq!(ranges, vec![(0, 20), (50, 80), (150, 200)]);
        assert_eq!(kept_ranges(0, std::iter::empty(), 10), vec![]);
        let mut mem: Vec<u8> = (0..200u8).collect();
        let copy = mem.clone();
        let parts = carve(&mut mem, &ranges);
        let got: Vec<(u64, Vec<u8>)> = parts.into_iter().map(|(at, d)| (at, d.to_vec())).collect();
        assert_eq!(
            got,
            vec![
                (0, copy[..20].to_vec()),
                (50, copy[50..80].to_vec()),
                (150, copy[150..].to_vec())
            ]
        );
    }
}
