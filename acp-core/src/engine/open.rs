//! Opening an engine: the root, the ring and the I/O engine, and recovery
//! of what a previous process of this rank left (its unfinished saves, and
//! the checkpoints resident in its ring slots, persisted when newer than the
//! newest committed step).

use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use super::state::{EngineState, FailedSlot, Shared};
use super::{flush, handle, load, Engine, Inner, SaveHandle};
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::io::{IoKind, IoOpts};
use crate::staging::{Ring, RingOptions, SlotInfo, SlotState};
use crate::storage::{LocalStorage, Storage};

/// What opening the engine found and chose.
#[derive(Debug, Clone)]
pub struct OpenReport {
    /// The I/O engine in use.
    pub io: IoKind,
    /// Whether the ring is locked in RAM.
    pub mlocked: bool,
    /// Why `mlock` was refused, when it was.
    pub mlock_error: Option<String>,
    /// Steps found resident in shared memory, left by a previous process.
    pub resident_steps: Vec<u64>,
    /// Of those, the steps newer than the newest committed one, queued for
    /// flush and commit (when `persist_on_open`).
    pub persisting_steps: Vec<u64>,
    /// Slots found half-staged and discarded.
    pub discarded_half_staged: usize,
    /// The shared-memory directory of the ring.
    pub shm_dir: std::path::PathBuf,
    /// Whether the shared-memory directory is on a file system that keeps
    /// its files in memory (tmpfs); `false` for a disk's, where every
    /// image saved is also written back to the disk; `None` when it
    /// cannot be told.
    pub shm_in_ram: Option<bool>,
}

/// Whether the digests recorded in a recovered slot are those the index of
/// its (committed) step records for this rank's file.
fn slot_matches_index(
    ring: &Ring,
    root: &dyn Storage,
    cfg: &EngineConfig,
    info: &SlotInfo,
) -> bool {
    let Ok(index) = root.read_index(info.step) else {
        return false;
    };
    index
        .files
        .get(&crate::format::data_file_name(cfg.rank))
        .is_some_and(|f| load::slot_matches_entry(ring, info, f, cfg.chunk_bytes as u64))
}

/// This engine's job id: the configured one, else the canonical root path
/// ([`crate::staging::job_id`]).
pub(super) fn job_id(cfg: &EngineConfig, root: &dyn Storage) -> String {
    crate::staging::job_id(root.location(), cfg.job.as_deref())
}

/// The slot file prefix of `rank` of this engine's job, and the job tag
/// (see [`crate::staging::ring_prefix`]).
pub(super) fn job_names(
    cfg: &EngineConfig,
    root: &dyn Storage,
    rank: u32,
) -> (String, crate::format::Digest) {
    let job = job_id(cfg, root);
    (
        crate::staging::ring_prefix(&job, rank),
        crate::staging::job_tag(&job),
    )
}

/// What open does with the complete slots a previous process left.
struct Recovery {
    /// Newer than the newest committed step: flushed and committed now
    /// (with `persist_on_open`).
    to_persist: Vec<SlotInfo>,
    /// Restorable, but given up when the ring needs room.
    stale: Vec<FailedSlot>,
}

/// Sorts the slots recovered from a previous process. Those left Resident
/// or Flushing and newer than the newest committed step are persisted
/// (with `persist_on_open`). Of the others left so: a process that died
/// between a commit and marking its slot left a committed copy (marked
/// Persisted here, once its digests match the index's); the rest (older
/// than the newest committed step, or not persisted on open) stay
/// restorable but are given up when the ring needs room, like a slot whose
/// flush failed. Left as they were, they would hold their slots for ever
/// and stall every later save.
fn sort_recovered(
    cfg: &EngineConfig,
    ring: &Ring,
    root: &dyn Storage,
    recovered: &[SlotInfo],
    committed: &[u64],
) -> Recovery {
    let latest = committed.last().copied();
    let to_persist: Vec<SlotInfo> = if cfg.persist_on_open {
        recovered
            .iter()
            .filter(|s| latest.is_none_or(|l| s.step > l) && !committed.contains(&s.step))
            .filter(|s| matches!(s.state, SlotState::Resident | SlotState::Flushing))
            .cloned()
            .collect()
    } else {
        Vec::new()
    };
    let mut stale = Vec::new();
    for info in recovered {
        if !matches!(info.state, SlotState::Resident | SlotState::Flushing)
            || to_persist.iter().any(|p| p.slot == info.slot)
        {
            continue;
        }
        if committed.contains(&info.step) && slot_matches_index(ring, root, cfg, info) {
            ring.set_state(info.slot, SlotState::Persisted);
        } else if let Some(generation) = ring.generation(info.slot) {
            stale.push(FailedSlot {
                slot: info.slot,
                generation,
            });
        }
    }
    Recovery { to_persist, stale }
}

impl Engine {
    /// Opens an engine on `config.root` (created if missing, mode 0700),
    /// opens the ring, probes the I/O engine, starts the flush thread and,
    /// with `persist_on_open`, queues resident checkpoints newer than the
    /// newest committed step for flush.
    ///
    /// # Errors
    /// [`Error::Config`], [`Error::Busy`] when another live process has this
    /// job and rank open, [`Error::Io`].
    pub fn open(config: EngineConfig) -> Result<Engine> {
        config.validate()?;
        let root = LocalStorage::open(&config.root)?.with_probe(config.probe());
        let io = crate::io::open_engine(config.io)?;
        let (prefix, job_tag) = job_names(&config, &root, config.rank);
        let shm_in_ram = crate::staging::in_ram(&config.shm_dir);
        if shm_in_ram == Some(false) {
            tracing::warn!(
                "acp: shm_dir {} is not in memory (not a tmpfs): every image saved \
                 there is also written back to its disk, which slows saves, flushes and \
                 replicas; point shm_dir (ACP_SHM_DIR) at /dev/shm or another tmpfs",
                config.shm_dir.display()
            );
        }
        // A ring without a given budget is sized from the room it has.
        let room = crate::staging::shm_room(&config.shm_dir, &prefix);
        let config = config.sized_by(room)?;
        let root: Box<dyn Storage> =
            Box::new(root.owned_by(config.rank, &crate::format::hex(&job_tag)[..8]));
        let (ring, ring_report) = Ring::open(RingOptions {
            dir: config.shm_dir.clone(),
            prefix,
            job_tag,
            rank: config.rank,
            slots: config.ring_slots,
            budget: config.own_ring_bytes(),
            // Sized from the room found at open, and this rank's alone
            // (no replica rings beside it): a checkpoint too large for two
            // slots of it saves in one.
            shared_budget: config.ring_room.is_some() && config.replicas_held == 0,
            chunk_bytes: config.chunk_bytes as u64,
            mlock: config.mlock,
        })?;
        ring.record_origin(root.location(), &job_id(&config, &*root));
        if !config.shm_ttl.is_zero() {
            super::reclaim::reclaim_expired(&config.shm_dir, config.shm_ttl, &job_tag);
        }
        // We hold this rank's ring lock: whatever pending directories this
        // rank left are from a dead process.
        let swept = root.sweep_leftovers();
        if swept > 0 {
            tracing::info!(swept, root = %root.location().display(), "acp: removed unfinished saves of a previous process");
        }
        let committed = root.steps()?;
        let Recovery { to_persist, stale } =
            sort_recovered(&config, &ring, &*root, &ring_report.recovered, &committed);
        let report = OpenReport {
            io: io.kind(),
            mlocked: ring_report.mlocked,
            mlock_error: ring_report.mlock_error.clone(),
            resident_steps: ring_report.recovered.iter().map(|s| s.step).collect(),
            persisting_steps: to_persist.iter().map(|s| s.step).collect(),
            discarded_half_staged: ring_report.discarded_half_staged,
            shm_dir: config.shm_dir.clone(),
            shm_in_ram,
        };
        if let Some(e) = &report.mlock_error {
            tracing::info!("acp: ring not locked in RAM ({e}); it stays pre-faulted");
        }
        let io_opts = IoOpts {
            chunk_bytes: config.chunk_bytes,
            queue_depth: config.queue_depth,
            direct: config.direct,
            faults: config.probe(),
        };
        let replicas = crate::replica::Store::open(
            crate::replica::StoreOptions {
                shm_dir: config.shm_dir.clone(),
                job: job_id(&config, &*root),
                job_tag,
                holder: config.rank,
                world_size: config.world_size,
                max_sources: config.replicas_held,
                ring_budget: config.slot_share() * crate::replica::SLOTS_PER_SOURCE as u64,
                chunk_bytes: config.chunk_bytes as u64,
                mlock: config.mlock,
                root: root.location().to_path_buf(),
                nice: config.background_nice,
            },
            config.transport.clone(),
        );
        let shared = Arc::new(Shared {
            cfg: config,
            root,
            replicas,
            ring,
            io,
            io_opts,
            report,
            state: Mutex::new(EngineState {
                committed: committed.iter().copied().collect(),
                failed_slots: stale,
                ..EngineState::default()
            }),
            idle: Condvar::new(),
            kept_header: Mutex::new(None),
        });
        // Made loadable from RAM before the flush thread starts writing
        // them (see `hash::hash_recovered`): the resident images newer than
        // every committed step, persisted now or not.
        let newer: Vec<_> = ring_report
            .recovered
            .iter()
            .filter(|s| committed.last().is_none_or(|l| s.step > *l))
            .filter(|s| matches!(s.state, SlotState::Resident | SlotState::Flushing))
            .cloned()
            .collect();
        super::hash::hash_recovered(&shared, &newer, shared.cfg.copy_threads);
        let engine = Engine::start(shared)?;
        for info in &to_persist {
            engine.persist_slot(info, true)?;
        }
        Ok(engine)
    }

    /// Starts the flush thread on `shared`.
    fn start(shared: Arc<Shared>) -> Result<Engine> {
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = {
            let for_thread = Arc::clone(&shared);
            // Hashing and writing yield to the training threads; the
            // threads the flush starts inherit its priority.
            let setup = crate::io::background_setup(shared.cfg.background_nice, "flush");
            std::thread::Builder::new()
                .name(format!("acp-flush-r{}", shared.cfg.rank))
                .spawn(move || {
                    setup();
                    flush::run(&for_thread, &rx);
                })
                .map_err(|e| Error::io("start flush thread", shared.root.location(), e))?
        };
        let warm = crate::staging::Warm::start(
            shared.ring.clone(),
            shared.cfg.rank,
            crate::io::background_setup(shared.cfg.background_nice, "slot warming"),
        );
        Ok(Engine {
            inner: Arc::new(Inner {
                shared,
                tx: Mutex::new(Some(tx)),
                worker: Mutex::new(Some(worker)),
                warm,
                kept_on_close: Mutex::new(None),
                pid: std::process::id(),
            }),
        })
    }

    /// Queues the flush and commit of the resident image of `step` that a
    /// previous process of this rank left in the ring (as `persist_on_open`
    /// does, for one step the caller chose, e.g. once every rank is known
    /// to hold its part of it). Loads wait for it, as for open's.
    ///
    /// # Errors
    /// [`Error::NotFound`] when no slot holds `step` unflushed (resident
    /// or flushing); [`Error::Exists`] when `step` is committed;
    /// [`Error::Closed`].
    pub fn persist_resident(&self, step: u64) -> Result<SaveHandle> {
        let shared = self.shared();
        // A held save is persisted as its own save (its handle completes).
        let held = Shared::take_held(&mut shared.lock(), step);
        if let Some(job) = held {
            let done = Arc::clone(&job.done);
            self.enqueue(job)?;
            return Ok(SaveHandle::from_completion(done));
        }
        if shared.lock().committed.contains(&step) || shared.root.is_committed(step) {
            return Err(Error::Exists {
                step,
                root: shared.root.location().to_path_buf(),
            });
        }
        let info = shared
            .ring
            .complete()
            .into_iter()
            .find(|s| {
                s.step == step && matches!(s.state, SlotState::Resident | SlotState::Flushing)
            })
            .ok_or_else(|| Error::NotFound {
                what: format!(
                    "unflushed resident image of step {step} in rank {}'s ring",
                    shared.cfg.rank
                ),
            })?;
        let done = self.persist_slot(&info, false)?;
        Ok(SaveHandle::from_completion(done))
    }

    /// Decides a held save of `step` ([`Persist::Hold`](super::Persist)):
    /// `persist` queues its persist (flush and commit, as any persisted
    /// save; its save handle completes when committed); otherwise the hold
    /// ends and it is a RAM snapshot like one the policy kept: released at
    /// once when a newer step has been sealed (its handle says
    /// superseded), else kept as the newest (resident) until a newer one
    /// is. Returns whether `step` was held: false when it never was, was
    /// decided already, or the engine persisted it as its newest resident
    /// step meanwhile (the dying checkpoint) or let it go at `close`.
    ///
    /// Decide from another thread than the saves', or before the ring
    /// fills: a save waiting for a slot that only holds free does not
    /// persist a held snapshot to make room (the ranks must agree on it).
    ///
    /// # Errors
    /// [`Error::Closed`] when `persist` and the engine is closing (the
    /// save's handle says so too).
    pub fn decide(&self, step: u64, persist: bool) -> Result<bool> {
        let shared = self.shared();
        let mut st = shared.lock();
        let Some(job) = Shared::take_held(&mut st, step) else {
            return Ok(false);
        };
        if !persist {
            shared.let_go(&mut st, job);
            return Ok(true);
        }
        st.counts.last_queued = Some(Instant::now());
        drop(st);
        // An enqueue failure (engine closed) completes the save's handle.
        self.enqueue(job)?;
        Ok(true)
    }

    /// The steps of the held saves not decided yet, in save order.
    #[must_use]
    pub fn held(&self) -> Vec<u64> {
        self.shared().lock().held.iter().map(|j| j.step).collect()
    }

    /// Lets go of every held save not decided (`close`, after it queued
    /// the newest resident step's persist): each is a RAM snapshot from
    /// then on. Returns their steps.
    pub(super) fn release_holds(&self) -> Vec<u64> {
        let shared = self.shared();
        let mut st = shared.lock();
        let held = std::mem::take(&mut st.held);
        let steps: Vec<u64> = held.iter().map(|j| j.step).collect();
        for job in held {
            shared.let_go(&mut st, job);
        }
        drop(st);
        if !steps.is_empty() {
            tracing::info!(?steps, "acp: held snapshots never decided, let go at close");
        }
        steps
    }

    /// Queues the persist of the newest resident step of this rank's ring
    /// when no persist of it is queued or running and it is newer than
    /// every committed step, whatever the policy chose for it at its save
    /// (the dying checkpoint, `close`, and a full ring use it). Returns its
    /// handle, or `None` when there is nothing to persist: the newest
    /// complete image is persisted, being persisted, older than the newest
    /// committed step, or one whose flush failed. A held save
    /// ([`Persist::Hold`](super::Persist)) is persisted as its own save:
    /// its handle completes with the persist, and it is no longer held.
    ///
    /// # Errors
    /// [`Error::Closed`].
    pub fn persist_newest(&self) -> Result<Option<SaveHandle>> {
        // The dying checkpoint and `close` call it: their persists, and the
        // one already running, no longer yield to a replica exchange
        // (`Engine::exchange_started`), whose peer may be gone.
        self.shared().replicas.hurry();
        self.persist_newest_of(true)
    }

    /// Queues the persist of this rank's resident image of `step`, as
    /// [`Engine::persist_newest`] does for the newest: when no persist of
    /// it is queued or running and it is newer than every committed step,
    /// whatever the policy chose for it at its save. With several ranks,
    /// the dying checkpoint persists the newest step that every rank
    /// holds, which may be older than this rank's newest. Returns its
    /// handle, or `None` when there is nothing to persist (no complete
    /// image of `step` is resident, or see [`Engine::persist_newest`]).
    ///
    /// # Errors
    /// [`Error::Closed`].
    pub fn persist_step(&self, step: u64) -> Result<Option<SaveHandle>> {
        self.shared().replicas.hurry();
        let info = self
            .shared()
            .ring
            .complete()
            .into_iter()
            .find(|i| i.step == step);
        match info {
            Some(info) => self.persist_slot_info(info, true),
            None => Ok(None),
        }
    }

    /// Makes every commit of step `first` or a newer one fail at its next
    /// look instead of waiting out `commit_timeout`: rank 0's wait for
    /// the other ranks' files, and the other ranks' wait for rank 0. The
    /// dying checkpoint calls it with the step after the newest one every
    /// rank holds: no newer step can have every rank's file. Until
    /// [`Engine::clear_given_up`].
    pub fn give_up_commits_from(&self, first: u64) {
        let mut st = self.shared().lock();
        st.given_up_from = Some(st.given_up_from.map_or(first, |g| g.min(first)));
    }

    /// Makes every commit that waits for one of `dead` (rank 0 waiting
    /// for their files, another rank waiting for rank 0) fail at its next
    /// look instead of waiting out `commit_timeout`, except the commit of
    /// step `except`: the dying checkpoint took them as dead, and the
    /// survivors write their files of that step (`acp.cover`); no other
    /// step can get them. Until [`Engine::clear_given_up`].
    pub fn give_up_commits_waiting_for(&self, dead: &[u32], except: Option<u64>) {
        let mut st = self.shared().lock();
        st.given_up_ranks.extend_from_slice(dead);
        st.given_up_except = except;
    }

    /// Ends what [`Engine::give_up_commits_from`] and
    /// [`Engine::give_up_commits_waiting_for`] started: the dying
    /// checkpoint calls it once its flushes drained, so a process that
    /// goes on after it (code that caught the exit) commits again.
    pub fn clear_given_up(&self) {
        let mut st = self.shared().lock();
        st.given_up_from = None;
        st.given_up_ranks.clear();
        st.given_up_except = None;
    }

    /// [`Engine::persist_newest`]; with `held` false, `None` when the
    /// newest resident step is held (a full ring: only its caller decides
    /// a held save).
    pub(super) fn persist_newest_of(&self, held: bool) -> Result<Option<SaveHandle>> {
        let shared = self.shared();
        let Some(info) = shared.ring.complete().into_iter().next() else {
            return Ok(None);
        };
        self.persist_slot_info(info, held)
    }

    /// [`Engine::persist_newest_of`] for the resident image `info`.
    fn persist_slot_info(&self, info: SlotInfo, held: bool) -> Result<Option<SaveHandle>> {
        let shared = self.shared();
        if info.state != SlotState::Resident {
            return Ok(None);
        }
        let generation = shared.ring.generation(info.slot);
        {
            let mut st = shared.lock();
            let newer = st.committed.last().is_none_or(|l| info.step > *l);
            let failed = st
                .failed_slots
                .iter()
                .any(|f| Some(f.generation) == generation && f.slot == info.slot);
            if !newer || failed || st.queued.contains(&info.step) {
                return Ok(None);
            }
            let holds = st
                .held
                .iter()
                .any(|j| j.step == info.step && j.pin.slot() == info.slot);
            if holds && !held {
                return Ok(None);
            }
            if holds {
                if let Some(job) = Shared::take_held(&mut st, info.step) {
                    st.counts.last_queued = Some(Instant::now());
                    drop(st);
                    tracing::info!(step = info.step, "acp: persisting a resident step (held)");
                    let done = Arc::clone(&job.done);
                    self.enqueue(job)?;
                    return Ok(Some(SaveHandle::watched(
                        done,
                        Arc::downgrade(&self.inner.shared),
                    )));
                }
            }
        }
        // Being persisted, it is no longer a kept snapshot to release.
        shared.lock().snapshots.retain(|s| s.slot != info.slot);
        tracing::info!(step = info.step, "acp: persisting a resident step");
        let done = self.enqueue_resident(&info, false)?;
        Ok(Some(SaveHandle::watched(
            done,
            Arc::downgrade(&self.inner.shared),
        )))
    }

    /// Queues a recovered slot for flush and commit; `unwatched` when no
    /// caller gets the handle (its failure is then raised by `close`).
    fn persist_slot(&self, info: &SlotInfo, unwatched: bool) -> Result<Arc<handle::Completion>> {
        let shared = self.shared();
        tracing::info!(
            step = info.step,
            "acp: persisting a resident checkpoint left by a previous process"
        );
        let mut st = shared.lock();
        st.recovering.push(info.step);
        // Open set it aside as reclaimable; being persisted, it is not.
        st.failed_slots.retain(|f| f.slot != info.slot);
        drop(st);
        self.enqueue_resident(info, unwatched)
    }

    /// Pins resident slot `info` and queues it for flush and commit as it
    /// is (no stall, no slot wait to report).
    fn enqueue_resident(
        &self,
        info: &SlotInfo,
        unwatched: bool,
    ) -> Result<Arc<handle::Completion>> {
        let pin = self.shared().ring.pin(info.slot)?;
        let done = handle::Completion::new(info.step);
        self.enqueue(flush::Job {
            pin,
            step: info.step,
            overwrite: false,
            done: Arc::clone(&done),
            started: Instant::now(),
            stall_secs: 0.0,
            slot_wait_secs: 0.0,
            unwatched,
        })?;
        Ok(done)
    }
}
