//! The engine façade: save, load, list, retain, close.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crossbeam_channel::Sender;

use crate::config::{EngineConfig, WhenFull};
use crate::error::{Error, Result};
use crate::format::{check_values_json, Dtype, Entry, ImageMeta, Layout, TensorSpec};
use crate::io::{IoEngine, IoKind, IoOpts};
use crate::staging::{Ring, RingOptions, SlotState, StagingSlot};
use crate::storage::local::Root;

mod copy;
mod flush;
mod handle;
mod load;
mod ranks;
mod verify;

/// A checkpoint engine for one job and rank. Cheap to clone: clones share
/// the ring, the flush thread and the state.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

/// The engine's owner side: dropping the last clone closes the queue; the
/// flush thread drains what is queued and exits on its own.
#[derive(Debug)]
struct Inner {
    shared: Arc<Shared>,
    tx: Mutex<Option<Sender<flush::Job>>>,
    worker: Mutex<Option<std::thread::JoinHandle<()>>>,
}

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
}

/// Options of one save.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// Replace the step if it is already committed (atomically: the old one
    /// stays loadable until the new one is committed).
    pub overwrite: bool,
    /// Extra string metadata for the safetensors header (e.g. `format: pt`).
    pub extra_metadata: BTreeMap<String, String>,
}

/// A host tensor handed to [`Engine::save`].
#[derive(Debug, Clone, Copy)]
pub struct HostTensor<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [u64],
    /// The bytes, exactly `numel × dtype.size()` of them.
    pub data: &'a [u8],
}

/// A save in its stall: the image is laid out in a ring slot and the caller
/// fills the tensors' bytes, directly ([`Staging::tensor_mut`]) or by copy
/// ([`Staging::copy_from`]). [`Staging::finish`] ends the stall. Dropping it
/// unfinished aborts the save and frees the slot.
#[derive(Debug)]
pub struct Staging {
    engine: Engine,
    step: u64,
    overwrite: bool,
    layout: Layout,
    slot: Option<StagingSlot>,
    started: Instant,
    slot_wait: Duration,
}

/// The completion handle of a save. Also a [`Future`](std::future::Future).
///
/// Its blocking waits watch the flush: when it makes no progress for the
/// engine's stall timeout, they fail with [`Error::Timeout`] naming what is
/// stuck (the save may still finish later; wait again to see it).
#[derive(Debug, Clone)]
pub struct SaveHandle {
    done: Arc<handle::Completion>,
    /// The engine whose flush to watch, while it lives.
    watch: Option<std::sync::Weak<Shared>>,
}

/// The figures of a finished save.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveReport {
    /// The step.
    pub step: u64,
    /// True when the save was skipped because no slot was free
    /// ([`WhenFull::Skip`](crate::WhenFull::Skip)); nothing was written.
    pub skipped: bool,
    /// Image bytes (the data file's size).
    pub bytes: u64,
    /// The stall: from `begin_save` to `finish`, in seconds.
    pub stall_secs: f64,
    /// Waiting for a free slot (part of the stall), in seconds.
    pub slot_wait_secs: f64,
    /// Queued behind earlier flushes, in seconds.
    pub queue_secs: f64,
    /// Writing, hashing and fsyncing the data file, in seconds.
    pub flush_secs: f64,
    /// Writing the index, renaming and syncing directories, in seconds.
    pub commit_secs: f64,
    /// From `begin_save` to committed, in seconds.
    pub total_secs: f64,
    /// The I/O engine that wrote it.
    pub io: IoKind,
    /// Whether `O_DIRECT` was used.
    pub direct: bool,
}

/// Which step to load, and from where.
#[derive(Debug, Clone, Default)]
pub struct LoadRequest {
    /// The step; the newest committed one when `None`.
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

/// Where a loaded checkpoint came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A resident shared-memory slot.
    Ram,
    /// The storage files (now resident in a slot, or in private memory
    /// when no slot was free).
    Storage,
}

/// The figures of a load.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    /// Where it came from.
    pub source: Source,
    /// Image bytes.
    pub bytes: u64,
    /// Whether every chunk was verified against its digest.
    pub verified: bool,
    /// Seconds from the call to the views being ready.
    pub secs: f64,
    /// Why a resident copy of the step was found but not used (it failed
    /// verification: the error, naming the slot file and tensor).
    pub rejected: Option<String>,
}

/// A loaded checkpoint; its tensors are zero-copy views into a pinned slot
/// (or a private buffer) that lives as long as this value.
#[derive(Debug)]
pub struct Checkpoint {
    step: u64,
    values: serde_json::Value,
    entries: Vec<Entry>,
    backing: load::Backing,
    report: LoadReport,
    copy_threads: usize,
}

/// One tensor of a loaded [`Checkpoint`].
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [u64],
    /// Bytes.
    pub data: &'a [u8],
}

/// What the caller side and the flush thread share.
#[derive(Debug)]
struct Shared {
    cfg: EngineConfig,
    root: Root,
    ring: Ring,
    io: Arc<dyn IoEngine>,
    io_opts: IoOpts,
    report: OpenReport,
    state: Mutex<EngineState>,
    idle: Condvar,
}

/// A slot holding an image whose flush failed, and that image's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FailedSlot {
    slot: usize,
    generation: u64,
}

#[derive(Debug, Default)]
struct EngineState {
    closed: bool,
    /// Flush jobs queued or running.
    in_flight: usize,
    /// Steps being flushed that came from a previous process's slots; loads
    /// wait for them so the newest step is committed first.
    recovering: Vec<u64>,
    /// Slots whose flush failed: complete images, kept resident (restorable)
    /// but given up when the ring needs room. Each names the image by the
    /// slot's generation, so an entry outliving its image (the slot
    /// released and acquired again) never frees a newer one.
    failed_slots: Vec<FailedSlot>,
    /// Steps known committed (at open, by this engine's flushes, minus
    /// retention), so the stall checks for `Exists` without touching storage.
    committed: std::collections::BTreeSet<u64>,
    /// When the running flush last made progress, and what it was doing.
    progress: Option<(Instant, String)>,
    /// Whether the watchdog has logged the current stall (once per stall).
    stall_logged: bool,
    /// A flush error that no handle has reported yet (recovery flushes).
    unreported: Option<Error>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, EngineState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Forgets the failures recorded for a slot just acquired again: they
    /// named its previous image.
    fn reused(&self, slot: StagingSlot) -> StagingSlot {
        self.lock().failed_slots.retain(|f| f.slot != slot.slot());
        slot
    }

    fn note_progress(&self, what: impl Into<String>) {
        let mut st = self.lock();
        st.progress = Some((Instant::now(), what.into()));
        st.stall_logged = false;
    }

    /// The watchdog: the error to report when the running flush has made
    /// no progress for the stall timeout, naming what it is stuck on.
    /// Logged once per stall.
    fn stuck(&self, st: &mut EngineState) -> Option<Error> {
        let (at, what) = st.progress.as_ref()?;
        let idle = at.elapsed();
        if idle < self.cfg.stall_timeout {
            return None;
        }
        let what = format!("flush stuck: {what}");
        if !std::mem::replace(&mut st.stall_logged, true) {
            tracing::error!(
                "acp: {what}: no progress for {:.1} s (stall timeout {:.1} s)",
                idle.as_secs_f64(),
                self.cfg.stall_timeout.as_secs_f64()
            );
        }
        Some(Error::Timeout {
            what,
            secs: idle.as_secs_f64(),
        })
    }
}

/// How often waits look at the watchdog.
const WATCH_TICK: Duration = Duration::from_millis(100);

/// Whether the digests recorded in a recovered slot are those the index of
/// its (committed) step records for this rank's file.
fn slot_matches_index(
    ring: &Ring,
    root: &Root,
    cfg: &EngineConfig,
    info: &crate::staging::SlotInfo,
) -> bool {
    let Ok(index) = root.read_index(info.step) else {
        return false;
    };
    index
        .files
        .get(&crate::format::data_file_name(cfg.rank))
        .is_some_and(|f| load::slot_matches_entry(ring, info, f, cfg.chunk_bytes as u64))
}

/// This engine's job id: the configured one, else the canonical root path.
fn job_id(cfg: &EngineConfig, root: &Root) -> String {
    cfg.job
        .clone()
        .unwrap_or_else(|| root.path().to_string_lossy().into_owned())
}

/// The slot file prefix of `rank` of this engine's job, and the job tag
/// (see [`crate::staging::ring_prefix`]).
fn job_names(cfg: &EngineConfig, root: &Root, rank: u32) -> (String, crate::format::Digest) {
    let job = job_id(cfg, root);
    (
        crate::staging::ring_prefix(&job, rank),
        crate::staging::job_tag(&job),
    )
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
        let root = Root::open(&config.root, config.faults.clone())?;
        let io = crate::io::open_engine(config.io)?;
        let (prefix, job_tag) = job_names(&config, &root, config.rank);
        let root = root.owned_by(config.rank, &crate::format::hex(&job_tag)[..8]);
        let (ring, ring_report) = Ring::open(RingOptions {
            dir: config.shm_dir.clone(),
            prefix,
            job_tag,
            rank: config.rank,
            slots: config.ring_slots,
            budget: config.ring_bytes,
            chunk_bytes: config.chunk_bytes as u64,
            mlock: config.mlock,
        })?;
        // We hold this rank's ring lock: whatever pending directories this
        // rank left are from a dead process.
        let swept = root.sweep_leftovers();
        if swept > 0 {
            tracing::info!(swept, root = %root.path().display(), "acp: removed unfinished saves of a previous process");
        }
        let committed = root.steps()?;
        let latest = committed.last().copied();
        let resident_steps: Vec<u64> = ring_report.recovered.iter().map(|s| s.step).collect();
        let to_persist: Vec<crate::staging::SlotInfo> = if config.persist_on_open {
            ring_report
                .recovered
                .iter()
                .filter(|s| latest.is_none_or(|l| s.step > l) && !committed.contains(&s.step))
                .filter(|s| matches!(s.state, SlotState::Resident | SlotState::Flushing))
                .cloned()
                .collect()
        } else {
            Vec::new()
        };
        // The other complete slots left Resident or Flushing: a process that
        // died between a commit and marking its slot left a committed copy
        // (Persisted, once its digests match the index's); the rest (older
        // than the newest committed step, or not persisted on open) stay
        // restorable but are given up when the ring needs room, like a slot
        // whose flush failed. Left as they were, they would hold their
        // slots for ever and stall every later save.
        let mut stale = Vec::new();
        for info in &ring_report.recovered {
            if !matches!(info.state, SlotState::Resident | SlotState::Flushing)
                || to_persist.iter().any(|p| p.slot == info.slot)
            {
                continue;
            }
            if committed.contains(&info.step) && slot_matches_index(&ring, &root, &config, info) {
                ring.set_state(info.slot, SlotState::Persisted);
            } else if let Some(generation) = ring.generation(info.slot) {
                stale.push(FailedSlot {
                    slot: info.slot,
                    generation,
                });
            }
        }
        let report = OpenReport {
            io: io.kind(),
            mlocked: ring_report.mlocked,
            mlock_error: ring_report.mlock_error.clone(),
            resident_steps,
            persisting_steps: to_persist.iter().map(|s| s.step).collect(),
            discarded_half_staged: ring_report.discarded_half_staged,
        };
        if let Some(e) = &report.mlock_error {
            tracing::info!("acp: ring not locked in RAM ({e}); it stays pre-faulted");
        }
        let io_opts = IoOpts {
            chunk_bytes: config.chunk_bytes,
            queue_depth: config.queue_depth,
            direct: config.direct,
            faults: config.faults.clone(),
        };
        let shared = Arc::new(Shared {
            cfg: config,
            root,
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
        });
        let (tx, rx) = crossbeam_channel::unbounded();
        let worker = {
            let for_thread = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("acp-flush-r{}", shared.cfg.rank))
                .spawn(move || flush::run(&for_thread, &rx))
                .map_err(|e| Error::io("start flush thread", shared.root.path(), e))?
        };
        let engine = Engine {
            inner: Arc::new(Inner {
                shared,
                tx: Mutex::new(Some(tx)),
                worker: Mutex::new(Some(worker)),
            }),
        };
        for info in &to_persist {
            engine.persist_slot(info, true)?;
        }
        Ok(engine)
    }

    fn shared(&self) -> &Shared {
        &self.inner.shared
    }

    fn enqueue(&self, job: flush::Job) -> Result<()> {
        let shared = self.shared();
        shared.lock().in_flight += 1;
        let tx = self
            .inner
            .tx
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let sent = match tx.as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.into_inner()),
            None => Err(job),
        };
        if let Err(job) = sent {
            let mut st = shared.lock();
            st.in_flight -= 1;
            drop(st);
            let err = Error::Closed {
                root: shared.root.path().to_path_buf(),
            };
            job.done.complete(Err(err.duplicate()));
            return Err(err);
        }
        Ok(())
    }

    /// What opening found and chose.
    #[must_use]
    pub fn open_report(&self) -> &OpenReport {
        &self.shared().report
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &EngineConfig {
        &self.shared().cfg
    }

    /// The checkpoint root (canonical).
    #[must_use]
    pub fn root(&self) -> &Path {
        self.shared().root.path()
    }

    /// Starts a save of `step`: checks the input, lays the image out in a
    /// ring slot and returns the [`Staging`] to fill. Returns `Ok(None)`
    /// when no slot is free and the policy is [`WhenFull::Skip`].
    ///
    /// # Errors
    /// [`Error::Invalid`] naming a bad tensor or value key; [`Error::Exists`]
    /// when the step is committed and `overwrite` is off; [`Error::Timeout`]
    /// waiting for a slot; [`Error::Closed`].
    pub fn begin_save(
        &self,
        step: u64,
        tensors: &[TensorSpec],
        values: &serde_json::Value,
        opts: &SaveOptions,
    ) -> Result<Option<Staging>> {
        let values = serde_json::to_string(values)
            .map_err(|e| Error::invalid("values", format!("cannot write them as JSON: {e}")))?;
        self.begin(step, tensors, &values, opts)
    }

    /// [`Engine::begin_save`] with the values given as JSON text, stored as
    /// given once checked to be one JSON value (bindings that already hold
    /// the text skip building a [`serde_json::Value`] of it, which costs
    /// microseconds per tensor reference in the stall).
    ///
    /// # Errors
    /// As [`Engine::begin_save`], and [`Error::Invalid`] naming `values`
    /// when the text is not JSON.
    pub fn begin_save_json(
        &self,
        step: u64,
        tensors: &[TensorSpec],
        values_json: &str,
        opts: &SaveOptions,
    ) -> Result<Option<Staging>> {
        check_values_json(values_json)?;
        self.begin(step, tensors, values_json, opts)
    }

    /// Readies every free ring slot for a checkpoint of `tensors` and
    /// `values_json` now (the slot's shared memory is created, populated
    /// and locked, as the first save into it would do: about a second per
    /// GiB on first touch), so that the first saves stall no longer than
    /// later ones. Slots holding checkpoints are left alone. Returns how
    /// many slots are ready. Call it before training: a save meanwhile
    /// waits for a slot (or, with [`WhenFull::Skip`], is skipped).
    ///
    /// # Errors
    /// As [`Engine::begin_save_json`] for the input; [`Error::Io`] or
    /// [`Error::NoSpace`] creating the memory.
    pub fn reserve_json(&self, tensors: &[TensorSpec], values_json: &str) -> Result<usize> {
        check_values_json(values_json)?;
        // The longest header any step can have.
        let layout = self.plan("reserve", u64::MAX, tensors, values_json, BTreeMap::new())?;
        self.shared().ring.reserve(layout.total_len)
    }

    /// The image of a save (values as checked JSON text), refused when it
    /// does not fit a ring slot.
    fn plan(
        &self,
        what: &str,
        step: u64,
        tensors: &[TensorSpec],
        values_json: &str,
        extra: BTreeMap<String, String>,
    ) -> Result<Layout> {
        let shared = self.shared();
        let meta = ImageMeta {
            step,
            rank: shared.cfg.rank,
            world_size: shared.cfg.world_size,
            values: serde_json::Value::Null, // given as text
            extra,
        };
        let layout = Layout::plan_with_values(tensors, &meta, values_json)?;
        let max = shared.ring.max_image_bytes();
        if layout.total_len > max {
            return Err(Error::invalid(
                what,
                format!(
                    "checkpoint of {} bytes does not fit a ring slot of {max} bytes; raise ring_bytes (now {}) or lower ring_slots (now {})",
                    layout.total_len, shared.cfg.ring_bytes, shared.cfg.ring_slots
                ),
            ));
        }
        Ok(layout)
    }

    fn begin(
        &self,
        step: u64,
        tensors: &[TensorSpec],
        values_json: &str,
        opts: &SaveOptions,
    ) -> Result<Option<Staging>> {
        let started = Instant::now();
        let shared = self.shared();
        let (closed, known) = {
            let st = shared.lock();
            (st.closed, st.committed.contains(&step))
        };
        if closed {
            return Err(Error::Closed {
                root: shared.root.path().to_path_buf(),
            });
        }
        // The commit re-checks on storage; this only fails early, without I/O.
        if !opts.overwrite && known {
            return Err(Error::Exists {
                step,
                root: shared.root.path().to_path_buf(),
            });
        }
        let layout = self.plan(
            &format!("step {step}"),
            step,
            tensors,
            values_json,
            opts.extra_metadata.clone(),
        )?;
        let Some(mut slot) = self.acquire_slot(step, layout.total_len)? else {
            tracing::warn!(
                step,
                "acp: no free ring slot, save skipped (when_full = skip)"
            );
            return Ok(None);
        };
        let header = layout.header_bytes();
        slot.image_mut()[..header.len()].copy_from_slice(header);
        Ok(Some(Staging {
            engine: self.clone(),
            step,
            overwrite: opts.overwrite,
            layout,
            slot: Some(slot),
            started,
            slot_wait: started.elapsed(),
        }))
    }

    fn acquire_slot(&self, step: u64, len: u64) -> Result<Option<StagingSlot>> {
        let shared = self.shared();
        // A resident image of the same step (an older attempt) must not be
        // confused with the new one.
        for info in shared.ring.complete() {
            if info.step == step {
                shared.ring.release(info.slot);
            }
        }
        let start = Instant::now();
        let mut first_look = true;
        loop {
            // Slots whose flush failed are given up only when the ring needs
            // room: they keep the newest restorable copy until then.
            let free = shared.ring.acquire(len, None)?;
            if let Some(s) = free {
                return Ok(Some(shared.reused(s)));
            }
            let failed = shared.lock().failed_slots.pop();
            if let Some(f) = failed {
                // Only the image whose flush failed: an entry whose slot
                // was acquired again since names nothing any more.
                if shared.ring.release_generation(f.slot, f.generation) {
                    tracing::warn!(
                        slot = f.slot,
                        "acp: dropping a resident checkpoint whose flush failed, to make room"
                    );
                }
                continue;
            }
            let limit = match shared.cfg.when_full {
                WhenFull::Skip => return Ok(None),
                WhenFull::Wait(d) => d,
            };
            let waited = start.elapsed();
            if waited >= limit {
                return Err(Error::Timeout {
                    what: format!("step {step}: waiting for a free ring slot (every slot is staging or flushing)"),
                    secs: limit.as_secs_f64(),
                });
            }
            // Every slot waits on the flush: when it is stuck, say so now
            // rather than after the whole slot wait (after one tick, as in
            // `wait_until`).
            let stuck = if std::mem::take(&mut first_look) {
                None
            } else {
                shared.stuck(&mut shared.lock())
            };
            if let Some(Error::Timeout { what, secs }) = stuck {
                return Err(Error::Timeout {
                    what: format!("step {step}: waiting for a free ring slot: {what}"),
                    secs,
                });
            }
            match shared
                .ring
                .acquire(len, Some((limit - waited).min(WATCH_TICK)))
            {
                Ok(Some(slot)) => return Ok(Some(shared.reused(slot))),
                Ok(None) | Err(Error::Timeout { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Saves host tensors: [`Engine::begin_save`], a parallel copy into the
    /// slot, [`Staging::finish`]. Returns once the bytes are in the slot.
    ///
    /// # Errors
    /// As [`Engine::begin_save`], and [`Error::Invalid`] when a tensor's
    /// bytes do not match its dtype and shape.
    pub fn save(
        &self,
        step: u64,
        tensors: &[HostTensor<'_>],
        values: &serde_json::Value,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .map(|t| TensorSpec {
                name: t.name.to_owned(),
                dtype: t.dtype,
                shape: t.shape.to_vec(),
            })
            .collect();
        for (t, spec) in tensors.iter().zip(&specs) {
            let want = spec.byte_len()?;
            if t.data.len() as u64 != want {
                return Err(Error::invalid(
                    format!("tensor `{}`", t.name),
                    format!(
                        "{} bytes given, {} × {:?} needs {want}",
                        t.data.len(),
                        t.dtype.name(),
                        t.shape
                    ),
                ));
            }
        }
        let Some(mut staging) = self.begin_save(step, &specs, values, opts)? else {
            return Ok(SaveHandle::skipped(step));
        };
        let srcs: Vec<&[u8]> = tensors.iter().map(|t| t.data).collect();
        staging.copy_from(&srcs)?;
        Ok(staging.finish())
    }

    /// Loads a committed step: from its resident slot when one holds it,
    /// else from storage (into a slot, which becomes resident).
    ///
    /// # Errors
    /// [`Error::NotFound`], [`Error::Corrupt`] naming the file and tensor,
    /// [`Error::Io`].
    pub fn load(&self, req: &LoadRequest) -> Result<Checkpoint> {
        load::load(self.shared(), req)
    }

    /// The committed steps, ascending.
    ///
    /// # Errors
    /// [`Error::Io`] listing the root.
    pub fn steps(&self) -> Result<Vec<u64>> {
        self.shared().root.steps()
    }

    /// The newest committed step.
    ///
    /// # Errors
    /// As [`Engine::steps`].
    pub fn latest(&self) -> Result<Option<u64>> {
        Ok(self.steps()?.last().copied())
    }

    /// The steps resident in this rank's ring, newest first.
    #[must_use]
    pub fn resident_steps(&self) -> Vec<u64> {
        self.shared()
            .ring
            .complete()
            .iter()
            .map(|s| s.step)
            .collect()
    }

    /// The index of committed `step`: its files (size, digests, rank) and
    /// which file holds each tensor.
    ///
    /// # Errors
    /// [`Error::NotFound`] when `step` is not committed; [`Error::Corrupt`].
    pub fn index(&self, step: u64) -> Result<crate::format::Index> {
        self.shared().root.read_index(step)
    }

    /// The values saved in `rank`'s file of committed `step`, read from
    /// the chunks that hold its header (each checked against the index),
    /// without reading its tensors.
    ///
    /// # Errors
    /// [`Error::NotFound`] for a step that is not committed or a rank with
    /// no file in it; [`Error::Corrupt`]; [`Error::Io`].
    pub fn read_values(&self, step: u64, rank: u32) -> Result<serde_json::Value> {
        Ok(ranks::read_header(self.shared(), step, rank)?.values)
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
        if shared.lock().committed.contains(&step) || shared.root.is_committed(step) {
            return Err(Error::Exists {
                step,
                root: shared.root.path().to_path_buf(),
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

    /// Queues a recovered slot for flush and commit; `unwatched` when no
    /// caller gets the handle (its failure is then raised by `close`).
    fn persist_slot(
        &self,
        info: &crate::staging::SlotInfo,
        unwatched: bool,
    ) -> Result<Arc<handle::Completion>> {
        let shared = self.shared();
        let pin = shared.ring.pin(info.slot)?;
        tracing::info!(
            step = info.step,
            "acp: persisting a resident checkpoint left by a previous process"
        );
        let mut st = shared.lock();
        st.recovering.push(info.step);
        // Open set it aside as reclaimable; being persisted, it is not.
        st.failed_slots.retain(|f| f.slot != info.slot);
        drop(st);
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

    /// Deletes committed steps that are neither among the newest `keep_last`
    /// nor a multiple of `keep_every`; returns the deleted steps. The newest
    /// step is always kept.
    ///
    /// # Errors
    /// [`Error::Config`] for `keep_last == 0`; [`Error::Io`].
    pub fn retain(&self, keep_last: usize, keep_every: Option<u64>) -> Result<Vec<u64>> {
        let deleted = retain(&self.shared().root, keep_last, keep_every)?;
        let mut st = self.shared().lock();
        for s in &deleted {
            st.committed.remove(s);
        }
        Ok(deleted)
    }

    /// Waits until every queued flush has finished (committed or failed).
    ///
    /// # Errors
    /// [`Error::Timeout`] after `timeout`, or when a flush makes no progress
    /// for the configured stall timeout (the watchdog), naming what is stuck.
    pub fn wait_idle(&self, timeout: Option<Duration>) -> Result<()> {
        wait_for(self.shared(), timeout, |st| st.in_flight == 0)
    }

    /// Waits at most `timeout` until every queued flush has finished;
    /// `Ok(false)` when some are still running then (and none is stuck).
    ///
    /// # Errors
    /// [`Error::Timeout`] from the watchdog, naming what is stuck, when a
    /// flush makes no progress for the configured stall timeout.
    pub fn wait_idle_timeout(&self, timeout: Duration) -> Result<bool> {
        wait_until(self.shared(), Some(timeout), |st| st.in_flight == 0)
    }

    /// Drains the flush queue and stops the flush thread. Resident slots stay
    /// in shared memory. Further saves fail with [`Error::Closed`]. Never
    /// waits longer than the watchdog allows for a stuck flush.
    ///
    /// # Errors
    /// A flush error that no handle reported, or the watchdog's timeout.
    pub fn close(&self) -> Result<()> {
        let shared = self.shared();
        shared.lock().closed = true;
        let drained = self.wait_idle(None);
        drop(
            self.inner
                .tx
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take(),
        );
        let worker = self
            .inner
            .worker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if drained.is_ok() {
            if let Some(w) = worker {
                let _ = w.join();
            }
        }
        drained?;
        match shared.lock().unreported.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// Waits until `done(state)` holds, watching the flush for progress.
fn wait_for(
    shared: &Shared,
    timeout: Option<Duration>,
    done: impl Fn(&EngineState) -> bool,
) -> Result<()> {
    if wait_until(shared, timeout, done)? {
        return Ok(());
    }
    let st = shared.lock();
    Err(Error::Timeout {
        what: format!(
            "{} flushes of {}",
            st.in_flight,
            shared.root.path().display()
        ),
        secs: timeout.map_or(0.0, |t| t.as_secs_f64()),
    })
}

/// Waits until `done(state)` holds (`Ok(true)`) or `timeout` passes
/// (`Ok(false)`); fails when the watchdog finds the flush stuck.
fn wait_until(
    shared: &Shared,
    timeout: Option<Duration>,
    done: impl Fn(&EngineState) -> bool,
) -> Result<bool> {
    let start = Instant::now();
    let mut st = shared.lock();
    let mut first = true;
    loop {
        if done(&st) {
            return Ok(true);
        }
        // Not on the first look: a flush that just got going again (the
        // disk answered) gets one tick to say so.
        if !std::mem::take(&mut first) {
            if let Some(e) = shared.stuck(&mut st) {
                return Err(e);
            }
        }
        let mut tick = WATCH_TICK;
        if let Some(t) = timeout {
            let waited = start.elapsed();
            if waited >= t {
                return Ok(false);
            }
            tick = tick.min(t - waited);
        }
        st = shared
            .idle
            .wait_timeout(st, tick)
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0;
    }
}

fn retain(root: &Root, keep_last: usize, keep_every: Option<u64>) -> Result<Vec<u64>> {
    if keep_last == 0 {
        return Err(Error::Config {
            field: "keep_last",
            reason: "must be at least 1 (0 would delete every checkpoint)".into(),
        });
    }
    let steps = root.steps()?;
    let n = steps.len();
    let mut deleted = Vec::new();
    for (i, &step) in steps.iter().enumerate() {
        let recent = i + keep_last >= n;
        let milestone = keep_every.is_some_and(|m| m > 0 && step % m == 0);
        if recent || milestone {
            continue;
        }
        root.remove_step(step)?;
        deleted.push(step);
    }
    Ok(deleted)
}

impl Staging {
    /// The step.
    #[must_use]
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The laid-out tensors, in the order given to `begin_save`.
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        &self.layout.entries
    }

    fn image_mut(&mut self) -> &mut [u8] {
        match self.slot.as_mut() {
            Some(s) => s.image_mut(),
            None => &mut [],
        }
    }

    /// The writable bytes of tensor `i` in the slot.
    ///
    /// # Panics
    /// When `i` is out of range.
    pub fn tensor_mut(&mut self, i: usize) -> &mut [u8] {
        let e = &self.layout.entries[i];
        let (off, len) = (to_usize(e.offset), to_usize(e.len));
        &mut self.image_mut()[off..off + len]
    }

    /// The writable bytes of every tensor at once, in entry order.
    pub fn tensors_mut(&mut self) -> Vec<&mut [u8]> {
        let ranges: Vec<(usize, usize, usize)> = self
            .layout
            .entries
            .iter()
            .enumerate()
            .map(|(i, e)| (to_usize(e.offset), to_usize(e.len), i))
            .collect();
        split_ranges(self.image_mut(), ranges)
    }

    /// Copies `srcs[i]` into tensor `i`, in parallel over the configured
    /// copy threads.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the tensor whose length differs, before
    /// anything is copied.
    pub fn copy_from(&mut self, srcs: &[&[u8]]) -> Result<()> {
        if srcs.len() != self.layout.entries.len() {
            return Err(Error::invalid(
                format!("step {}", self.step),
                format!(
                    "{} sources for {} tensors",
                    srcs.len(),
                    self.layout.entries.len()
                ),
            ));
        }
        for (e, s) in self.layout.entries.iter().zip(srcs) {
            if s.len() as u64 != e.len {
                return Err(Error::invalid(
                    format!("tensor `{}`", e.name),
                    format!("{} bytes given, {} expected", s.len(), e.len),
                ));
            }
        }
        let threads = self.engine.shared().cfg.copy_threads;
        let dsts = self.tensors_mut();
        copy::parallel_copy(
            dsts.into_iter().zip(srcs.iter().copied()).collect(),
            threads,
        );
        Ok(())
    }

    /// Copies `items[k].1` into tensor `items[k].0` for a subset of the
    /// tensors (each at most once), in parallel over the copy threads. The
    /// rest are left for [`Staging::tensor_mut`] (e.g. device-to-host copies).
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the tensor whose index is out of range,
    /// repeated, or whose length differs, before anything is copied.
    pub fn copy_some(&mut self, items: &[(usize, &[u8])]) -> Result<()> {
        let n = self.layout.entries.len();
        let mut seen = vec![false; n];
        for (i, s) in items {
            let Some(e) = self.layout.entries.get(*i) else {
                return Err(Error::invalid(
                    format!("tensor index {i}"),
                    format!("step {} has {n} tensors", self.step),
                ));
            };
            if std::mem::replace(&mut seen[*i], true) {
                return Err(Error::invalid(
                    format!("tensor `{}`", e.name),
                    "given twice",
                ));
            }
            if s.len() as u64 != e.len {
                return Err(Error::invalid(
                    format!("tensor `{}`", e.name),
                    format!("{} bytes given, {} expected", s.len(), e.len),
                ));
            }
        }
        let threads = self.engine.shared().cfg.copy_threads;
        let mut dsts: Vec<Option<&mut [u8]>> = self.tensors_mut().into_iter().map(Some).collect();
        let pairs = items
            .iter()
            .filter_map(|(i, s)| dsts[*i].take().map(|d| (d, *s)))
            .collect();
        copy::parallel_copy(pairs, threads);
        Ok(())
    }

    /// The image length in bytes (the data file's size).
    #[must_use]
    pub fn image_len(&self) -> u64 {
        self.layout.total_len
    }

    /// Ends the stall: seals the slot and queues its flush.
    #[must_use]
    pub fn finish(mut self) -> SaveHandle {
        let done = handle::Completion::new(self.step);
        let Some(slot) = self.slot.take() else {
            done.complete(Err(Error::invalid(
                format!("step {}", self.step),
                "staging already finished",
            )));
            return SaveHandle::from_completion(done);
        };
        let pin = slot.seal(self.step, self.layout.total_len);
        let job = flush::Job {
            pin,
            step: self.step,
            overwrite: self.overwrite,
            done: Arc::clone(&done),
            started: self.started,
            stall_secs: self.started.elapsed().as_secs_f64(),
            slot_wait_secs: self.slot_wait.as_secs_f64(),
            unwatched: false,
        };
        // An enqueue failure (engine closed) completes `done` with the error.
        let _ = self.engine.enqueue(job);
        SaveHandle::watched(done, Arc::downgrade(&self.engine.inner.shared))
    }
}

/// Splits `buf` into the disjoint `(offset, len, index)` ranges, returned in
/// index order. Ranges must not overlap (the layout guarantees it).
fn split_ranges(buf: &mut [u8], mut ranges: Vec<(usize, usize, usize)>) -> Vec<&mut [u8]> {
    let n = ranges.len();
    // Empty tensors share their offset with the next one: put them first.
    ranges.sort_unstable_by_key(|r| (r.0, r.1));
    let mut out: Vec<(usize, &mut [u8])> = Vec::with_capacity(n);
    let mut rest = buf;
    let mut pos = 0;
    for (off, len, i) in ranges {
        let tail = std::mem::take(&mut rest);
        let (_, tail) = tail.split_at_mut(off - pos);
        let (piece, tail) = tail.split_at_mut(len);
        out.push((i, piece));
        rest = tail;
        pos = off + len;
    }
    out.sort_unstable_by_key(|(i, _)| *i);
    out.into_iter().map(|(_, p)| p).collect()
}

/// Offsets and lengths of a laid-out image fit the address space: the image
/// lives in a mapping.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).expect("image offsets fit in memory: the image is mapped")
}
