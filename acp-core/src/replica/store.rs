//! The replica store of one engine: the rings in which this rank keeps
//! other ranks' images (one ring of [`SLOTS_PER_SOURCE`] slots per source
//! rank, opened at the first image received from it, or at open when a
//! previous process of this rank left one).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{ReplicaMeta, Transport};
use crate::error::{Error, Result};
use crate::format::Digest;
use crate::staging::{
    replica_files, replica_prefix, PinnedSlot, Ring, RingOptions, StagingSlot, Warm,
};

/// Slots of a replica ring: the newest complete replica stays while the
/// next is received.
pub(crate) const SLOTS_PER_SOURCE: usize = 2;

/// Frees the complete replicas of a source's ring but two: the newest,
/// and the newest of an older step (kept until a newer replica needs its
/// slot), so that every holder still has the previous step when the
/// newest did not reach every holder (its exchange broke off with a node).
/// A second copy of the newest step goes.
fn trim(ring: &Ring) {
    let complete = ring.complete();
    let Some(newest) = complete.first() else {
        return;
    };
    let previous = complete
        .iter()
        .find(|i| i.step < newest.step)
        .map(|i| i.slot);
    for old in complete.iter().skip(1) {
        if Some(old.slot) != previous {
            ring.release(old.slot);
        }
    }
}

/// Where and how a store keeps its rings.
#[derive(Debug, Clone)]
pub(crate) struct StoreOptions {
    pub(crate) shm_dir: PathBuf,
    pub(crate) job: String,
    pub(crate) job_tag: Digest,
    /// This rank: the holder of every ring of the store.
    pub(crate) holder: u32,
    /// The job's ranks: only `0..world_size` have images to hold.
    pub(crate) world_size: u32,
    /// How many source ranks it may hold images of.
    pub(crate) max_sources: u32,
    /// Budget of one replica ring (its share of the ring budget).
    pub(crate) ring_budget: u64,
    pub(crate) chunk_bytes: u64,
    pub(crate) mlock: bool,
    /// The checkpoint root, recorded in each ring's slots.
    pub(crate) root: PathBuf,
    /// The niceness of the threads that ready each ring's slots.
    pub(crate) nice: i32,
}

/// Replica rings by source rank, and the transport, if any.
#[derive(Debug)]
pub(crate) struct Store {
    opts: StoreOptions,
    rings: Mutex<BTreeMap<u32, Ring>>,
    /// Each ring's warming thread: it readies the slots a previous
    /// process left and, once an image's size is known, grows the ring's
    /// free slot to it, so that the next image received does not wait for
    /// its memory (0.5 to 1 s for 256 MiB here).
    warms: Mutex<BTreeMap<u32, Warm>>,
    transport: Option<Arc<dyn Transport>>,
    /// The one thread that sends this rank's images, in the order they
    /// were queued; started by the first send, joined by [`Store::stop`].
    sender: Mutex<Option<Worker>>,
    /// Held while an image of this rank's ring is hashed for a flush or a
    /// replica send, so the second one finds the first one's digests.
    hashing: Mutex<()>,
    /// The steps whose images are being sent to their holders now (one
    /// entry per exchange), which their flushes yield to
    /// ([`Store::yield_to_exchange`]); notified as each ends.
    exchanging: Mutex<Vec<u64>>,
    exchanged: Condvar,
    /// Set once the engine persists its newest step to end (the dying
    /// checkpoint, `close`): no flush yields to an exchange from then on.
    hurried: AtomicBool,
}

/// A job of the sending thread.
pub(crate) type Job = Box<dyn FnOnce() + Send>;

#[derive(Debug)]
struct Worker {
    tx: Sender<Job>,
    thread: JoinHandle<()>,
}

impl Store {
    /// Opens the replica rings a previous process of this rank left (their
    /// complete images are kept: the newest of each, the others freed).
    /// A ring that cannot be opened is logged and left alone.
    pub(crate) fn open(opts: StoreOptions, transport: Option<Arc<dyn Transport>>) -> Store {
        let store = Store {
            opts,
            rings: Mutex::new(BTreeMap::new()),
            warms: Mutex::new(BTreeMap::new()),
            transport,
            sender: Mutex::new(None),
            hashing: Mutex::new(()),
            exchanging: Mutex::new(Vec::new()),
            exchanged: Condvar::new(),
            hurried: AtomicBool::new(false),
        };
        if store.opts.max_sources > 0 {
            let found =
                replica_files(&store.opts.shm_dir, &store.opts.job, None).unwrap_or_else(|e| {
                    tracing::debug!("acp: replica slots: {e}");
                    Vec::new()
                });
            let mut sources: Vec<u32> = found
                .iter()
                .filter(|f| f.holder == Some(store.opts.holder))
                .map(|f| f.rank)
                .collect();
            sources.dedup();
            for rank in sources {
                if let Err(e) = store.ring_for(rank) {
                    tracing::warn!(
                        "acp: rank {}'s replicas of rank {rank} left by a previous process not opened: {e}",
                        store.opts.holder
                    );
                }
            }
        }
        store
    }

    /// The lock under which an image of this rank's ring is hashed for a
    /// flush or a replica send (`engine::replicate::hash_once`), or summed
    /// for a replica send or in the background (`engine::hash`): the second
    /// of two takes the first one's result rather than hashing again.
    pub(crate) fn hashing(&self) -> MutexGuard<'_, ()> {
        self.hashing.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// [`Store::hashing`] when no one holds it, else `None` (at once).
    pub(crate) fn try_hashing(&self) -> Option<MutexGuard<'_, ()>> {
        match self.hashing.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    pub(crate) fn transport(&self) -> Option<&Arc<dyn Transport>> {
        self.transport.as_ref()
    }

    /// Marks the image of `step` as being sent to its holders, until
    /// [`Store::exchange_ended`].
    pub(crate) fn exchange_started(&self, step: u64) {
        self.exchanging
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(step);
    }

    /// Ends one [`Store::exchange_started`] of `step`; nothing when none
    /// is marked.
    pub(crate) fn exchange_ended(&self, step: u64) {
        let mut ex = self
            .exchanging
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = ex.iter().position(|s| *s == step) {
            ex.swap_remove(i);
            drop(ex);
            self.exchanged.notify_all();
        }
    }

    /// Stops every flush from yielding to an exchange, now and from then
    /// on: the engine's last persists (the dying checkpoint's, `close`'s)
    /// must not wait for a peer that may be gone.
    pub(crate) fn hurry(&self) {
        let ex = self
            .exchanging
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        self.hurried.store(true, Ordering::Release);
        drop(ex);
        self.exchanged.notify_all();
    }

    /// Waits while an image of `step` is being sent to its holders, until
    /// `until` at the latest: the flush of a step calls it between chunks,
    /// so that the step's replication, the sooner of its two protections,
    /// has the cores and the memory bandwidth first. Returns how long it
    /// waited: at once when no exchange of `step` runs.
    pub(crate) fn yield_to_exchange(&self, step: u64, until: Instant) -> Duration {
        let mut ex = self
            .exchanging
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let start = Instant::now();
        let mut waited = false;
        while ex.contains(&step) && !self.hurried.load(Ordering::Acquire) {
            waited = true;
            let Some(left) = until.checked_duration_since(Instant::now()) else {
                break;
            };
            ex = self
                .exchanged
                .wait_timeout(ex, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        if waited {
            start.elapsed()
        } else {
            Duration::ZERO
        }
    }

    /// Queues `job` on the sending thread, starting it on first use.
    ///
    /// # Errors
    /// [`Error::Io`] when the thread cannot be started; [`Error::Closed`]
    /// after [`Store::stop`].
    pub(crate) fn send_in_background(&self, job: Job) -> Result<()> {
        let mut sender = self.sender.lock().unwrap_or_else(PoisonError::into_inner);
        if sender.is_none() {
            let (tx, rx) = channel::<Job>();
            let thread = std::thread::Builder::new()
                .name(format!("acp-replicate-r{}", self.opts.holder))
                .spawn(move || {
                    crate::io::block_async_signals();
                    while let Ok(job) = rx.recv() {
                        job();
                    }
                })
                .map_err(|e| Error::io("start replica thread", &self.opts.root, e))?;
            *sender = Some(Worker { tx, thread });
        }
        let Some(w) = sender.as_ref() else {
            return Err(Error::Closed {
                root: self.opts.root.clone(),
            });
        };
        w.tx.send(job).map_err(|_| Error::Closed {
            root: self.opts.root.clone(),
        })
    }

    /// Lets the sending thread finish the queued sends, then joins it.
    /// Called by close; a later send starts a new thread.
    pub(crate) fn stop(&self) {
        let worker = self
            .sender
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(Worker { tx, thread }) = worker {
            drop(tx);
            // A send that drops the last handle of this engine runs here.
            let on_it = thread.thread().id() == std::thread::current().id();
            if !on_it && thread.join().is_err() {
                tracing::warn!("acp: rank {}'s replica thread panicked", self.opts.holder);
            }
        }
        let warms = std::mem::take(&mut *self.warms.lock().unwrap_or_else(PoisonError::into_inner));
        for w in warms.values() {
            w.stop();
        }
    }

    fn rings(&self) -> MutexGuard<'_, BTreeMap<u32, Ring>> {
        self.rings.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The ring holding `rank`'s replicas, opened when first needed.
    fn ring_for(&self, rank: u32) -> Result<Ring> {
        let mut rings = self.rings();
        if let Some(r) = rings.get(&rank) {
            return Ok(r.clone());
        }
        let o = &self.opts;
        if rank == o.holder {
            return Err(Error::invalid(
                format!("replica of rank {rank}"),
                "a rank does not hold replicas of its own images",
            ));
        }
        // Checked before a ring is opened: a ring, once open, keeps one of
        // the `replicas_held` sources for good.
        if rank >= o.world_size {
            return Err(Error::invalid(
                format!("replica of rank {rank}"),
                format!("the job's world has {} rank(s)", o.world_size),
            ));
        }
        if rings.len() as u64 >= u64::from(o.max_sources) {
            return Err(Error::invalid(
                format!("replica of rank {rank}"),
                format!(
                    "rank {} already holds replicas of {} rank(s) {:?}, its `replicas_held`",
                    o.holder,
                    rings.len(),
                    rings.keys().collect::<Vec<_>>()
                ),
            ));
        }
        let (ring, _) = Ring::open(RingOptions {
            dir: o.shm_dir.clone(),
            prefix: replica_prefix(&o.job, rank, o.holder),
            job_tag: o.job_tag,
            rank,
            slots: SLOTS_PER_SOURCE,
            budget: o.ring_budget,
            shared_budget: false,
            chunk_bytes: o.chunk_bytes,
            mlock: o.mlock,
        })?;
        ring.record_origin(&o.root, &o.job);
        // What a previous holder left is kept as `receive` keeps it, with
        // the digests it recorded.
        trim(&ring);
        rings.insert(rank, ring.clone());
        self.warms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(
                rank,
                Warm::start(
                    ring.clone(),
                    o.holder,
                    crate::io::background_setup(o.nice, "replica slot warming"),
                ),
            );
        Ok(ring)
    }

    /// Receives `meta`'s image into a replica slot: `fill` writes exactly
    /// `meta.len` bytes; the slot is sealed with the shipped digests, and
    /// older replicas of the same rank are freed.
    pub(crate) fn receive(
        &self,
        meta: &ReplicaMeta,
        fill: impl FnOnce(&mut [u8]) -> Result<()>,
    ) -> Result<()> {
        meta.check(self.opts.chunk_bytes)?;
        let mut writer = self.begin(meta.rank, meta.step, meta.len, meta.chunk_bytes)?;
        fill(writer.image_mut())?;
        writer.finish_with_sums(meta.digests.clone(), meta.sums.clone())
    }

    /// A replica slot of rank `rank`'s ring, staging, for its image of
    /// `step` (`len` bytes, digests in chunks of `chunk_bytes`, to come
    /// with [`ReplicaWriter::finish`]). When both slots hold complete
    /// replicas, the older one is freed for it.
    pub(crate) fn begin(
        &self,
        rank: u32,
        step: u64,
        len: u64,
        chunk_bytes: u64,
    ) -> Result<ReplicaWriter> {
        let what = || format!("replica of rank {rank}'s step {step}");
        if chunk_bytes != self.opts.chunk_bytes {
            return Err(Error::invalid(
                what(),
                format!(
                    "digest chunks of {chunk_bytes} bytes, this engine's are {}",
                    self.opts.chunk_bytes
                ),
            ));
        }
        let len_usize = usize::try_from(len)
            .map_err(|_| Error::invalid(what(), format!("{len} bytes exceed the address space")))?;
        let ring = self.ring_for(rank)?;
        let staging = match ring.acquire(len, None)? {
            Some(s) => s,
            None => {
                // Both slots hold complete replicas: keep the newest.
                for old in ring.complete().iter().skip(1) {
                    ring.release(old.slot);
                }
                ring.acquire(len, None)?.ok_or_else(|| Error::Busy {
                    what: format!("rank {}'s replica slots of rank {rank}", self.opts.holder),
                    reason: "every slot is pinned by a reader".to_owned(),
                })?
            }
        };
        // The ring's other slot grows to this size in the background.
        if let Some(w) = self
            .warms
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&rank)
        {
            w.saw(len);
        }
        Ok(ReplicaWriter {
            ring,
            staging,
            rank,
            step,
            len: len_usize,
            chunk_bytes,
        })
    }

    /// The complete replicas held, with the digests they were received
    /// with, by rank then newest step first.
    pub(crate) fn held(&self) -> Vec<ReplicaMeta> {
        let rings: Vec<(u32, Ring)> = self.rings().iter().map(|(r, g)| (*r, g.clone())).collect();
        let mut out = Vec::new();
        for (rank, ring) in rings {
            for info in ring.complete() {
                // Pinned while its digests are read, so that they and the
                // step and length are those of one image (the slot may be
                // filled again between the listing and the read).
                let Ok(pin) = ring.pin_step(info.slot, info.step) else {
                    continue;
                };
                let Some((digests, sums)) = checks_of(&ring, info.slot) else {
                    continue;
                };
                out.push(ReplicaMeta {
                    rank,
                    step: info.step,
                    len: pin.image().len() as u64,
                    chunk_bytes: self.opts.chunk_bytes,
                    digests,
                    sums,
                });
            }
        }
        out
    }

    /// Removes the files of every replica ring of the store (their open
    /// mappings stay valid: a reader of a pinned replica is unaffected).
    pub(crate) fn unlink_all(&self) {
        for ring in self.rings().values() {
            ring.unlink_all();
        }
    }

    /// Pins the replica of `rank`'s `step`, if held: its metadata, the pin
    /// (the image stays while it lives) and the slot file.
    pub(crate) fn pin(&self, rank: u32, step: u64) -> Option<(ReplicaMeta, PinnedSlot, PathBuf)> {
        let ring = self.rings().get(&rank)?.clone();
        let info = ring.complete().into_iter().find(|i| i.step == step)?;
        let pin = ring.pin_step(info.slot, step).ok()?;
        // Read after the pin: the digests and sums then belong to the
        // pinned image (a sums record is believed only while bound to the
        // digests recorded now, or, alone, to the image).
        let (digests, sums) = checks_of(&ring, info.slot)?;
        let meta = ReplicaMeta {
            rank,
            step,
            len: pin.image().len() as u64,
            chunk_bytes: self.opts.chunk_bytes,
            digests,
            sums,
        };
        Some((meta, pin, ring.slot_path(info.slot)))
    }

    /// Records `digests`, which came after the replica of `rank`'s `step`
    /// was sealed with its quick sums alone, beside those sums: from then
    /// on the replica is bound to them as if it had been sealed with both.
    /// Returns whether they were recorded: not when no replica of that
    /// step is held, it has digests already, or they are not one per
    /// chunk.
    pub(crate) fn add_digests(&self, rank: u32, step: u64, digests: &[Digest]) -> bool {
        let Some(ring) = self.rings().get(&rank).cloned() else {
            return false;
        };
        let Some(info) = ring.complete().into_iter().find(|i| i.step == step) else {
            return false;
        };
        // The pin keeps the image whose sums are read in the slot.
        let Ok(pin) = ring.pin_step(info.slot, step) else {
            return false;
        };
        let Some(sums) = ring.sums_alone(pin.slot()) else {
            return false;
        };
        if sums.len() != digests.len() {
            return false;
        }
        ring.set_digests(pin.slot(), digests);
        ring.record_quick_sums(pin.slot(), digests, &sums);
        ring.digests(pin.slot()).is_some_and(|d| d == digests)
    }
}

/// What checks `slot`'s replica: its digests and the sums bound to them,
/// or no digests and the sums recorded alone (sealed before its digests
/// came); `None` when it has neither.
fn checks_of(ring: &Ring, slot: usize) -> Option<(Vec<Digest>, Vec<u64>)> {
    match ring.digests(slot) {
        Some(d) => {
            let sums = sums_of(ring, slot, d.len());
            Some((d, sums))
        }
        None => ring.sums_alone(slot).map(|s| (Vec::new(), s)),
    }
}

/// The quick sums recorded for `slot` of `ring` when there is one per
/// digest (bound to the digests recorded now), else none.
pub(crate) fn sums_of(ring: &Ring, slot: usize, digests: usize) -> Vec<u64> {
    ring.quick_sums(slot)
        .filter(|s| s.len() == digests)
        .unwrap_or_default()
}

/// A replica slot being received (from [`Engine::begin_replica`]): the
/// transport writes the image into [`ReplicaWriter::image_mut`], then
/// [`ReplicaWriter::finish`] seals it with the image's digests. Dropped
/// unfinished, the slot is free again and the older replicas stay.
///
/// [`Engine::begin_replica`]: crate::Engine::begin_replica
#[derive(Debug)]
pub struct ReplicaWriter {
    ring: Ring,
    staging: StagingSlot,
    rank: u32,
    step: u64,
    len: usize,
    chunk_bytes: u64,
}

impl ReplicaWriter {
    /// The slot bytes the image goes to: exactly its length.
    pub fn image_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.staging.image_mut()[..len]
    }

    /// The image's rank, step, length and digest chunk size, without
    /// digests.
    #[must_use]
    pub fn meta(&self) -> ReplicaMeta {
        ReplicaMeta {
            rank: self.rank,
            step: self.step,
            len: self.len as u64,
            chunk_bytes: self.chunk_bytes,
            digests: Vec::new(),
            sums: Vec::new(),
        }
    }

    /// Seals the slot with `digests` (blake3 of each chunk, as the sender
    /// computed them: a load checks the bytes against them before using
    /// them), and frees the rank's replicas but the newest two.
    /// [`ReplicaWriter::finish_with_sums`] without quick sums.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the digest count is not the length's (the
    /// slot is then freed, unsealed).
    pub fn finish(self, digests: Vec<Digest>) -> Result<()> {
        self.finish_with_sums(digests, Vec::new())
    }

    /// Seals the slot with `digests` and, when not empty, the quick sums
    /// `sums` the sender took in the same pass (one per chunk), recorded
    /// in the slot's control block bound to those digests (`read/fast.rs`):
    /// a restore served from this slot then checks the bytes against the
    /// sums instead of hashing them with blake3. With no digests, the sums
    /// are recorded alone, bound to the image (its step, length and slot
    /// generation), and the digests may follow
    /// ([`Engine::add_replica_digests`](crate::Engine::add_replica_digests)):
    /// a sender need not hash an image with blake3 before it counts as
    /// replicated. Frees the rank's replicas but the newest two.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the digest count is not the length's (nor
    /// zero, with a sum per chunk), or the sum count neither zero nor the
    /// length's (the slot is then freed, unsealed).
    pub fn finish_with_sums(self, digests: Vec<Digest>, sums: Vec<u64>) -> Result<()> {
        let mut meta = self.meta();
        meta.digests = digests;
        meta.sums = sums;
        meta.check(self.chunk_bytes)?;
        let pin = self.staging.seal(meta.step, meta.len);
        if meta.digests.is_empty() {
            // Sums alone: the digests follow ([`Store::add_digests`]).
            if !self
                .ring
                .record_sums_alone(pin.slot(), pin.generation(), &meta.sums)
            {
                let slot = pin.slot();
                drop(pin);
                self.ring.release(slot);
                return Err(Error::invalid(
                    meta.what(),
                    "its quick sums do not fit the slot's digest area".to_owned(),
                ));
            }
        } else {
            self.ring.set_digests(pin.slot(), &meta.digests);
            if !meta.sums.is_empty() {
                self.ring
                    .record_quick_sums(pin.slot(), &meta.digests, &meta.sums);
            }
        }
        // A copy of the same step received before is another image of it
        // (its rank re-ran the step): this one replaces it, whichever slot
        // each is in.
        for old in self.ring.complete() {
            if old.step == meta.step && old.slot != pin.slot() {
                self.ring.release(old.slot);
            }
        }
        drop(pin);
        // The previous replica stays beside the new one: the new step may
        // not be replicated everywhere (a node lost during its exchange
        // leaves other ranks' images of it nowhere), and a restore then
        // needs the previous step, which every holder must still have.
        trim(&self.ring);
        Ok(())
    }
}
