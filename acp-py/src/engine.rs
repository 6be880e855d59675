//! `Engine`: one checkpoint engine for a job and rank, with every
//! [`EngineConfig`] setter as a keyword argument.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use acp_core::{
    DirectIo, EngineConfig, Error, IoChoice, IoKind, LoadRequest, OnWait, Persist, PersistPolicy,
    SaveOptions, TensorSpec, Verify, WhenFull,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{err, invalid};
use crate::load::{Kept, Loaded};
use crate::replica::{
    digests_bytes, meta_from, meta_tuple, sums_bytes, Mailbox, MetaOut, MetaTuple, Receipt,
    ReplicaImage,
};
use crate::save::{SaveHandle, SavePlan, Staging};
use crate::tensors::{host_slices, HostRange};

/// A checkpoint engine: a shared-memory ring, flush threads and the
/// checkpoint directory of one job and rank.
///
/// `close()` drops this object's hold on the core engine, so the ring (and
/// its lock on the job's slots) is released once no staging or loaded
/// checkpoint still uses it: the same job can then be opened again.
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct Engine {
    inner: RwLock<Option<acp_core::Engine>>,
    root: PathBuf,
    /// Images fetched from peers by `acp.replica`, for the next load.
    mailbox: Arc<Mailbox>,
    /// What Python reads of the last loaded header, for the next load of
    /// the same header.
    kept: Kept,
}

impl Engine {
    /// The open core engine (a cheap clone), or `Closed`.
    fn get(&self) -> PyResult<acp_core::Engine> {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| {
                err(Error::Closed {
                    root: self.root.clone(),
                })
            })
    }
}

/// Drops `v` with the GIL released. For what may hold the core engine's
/// last handle: that drop waits for the engine's queued flushes before it
/// frees the ring, and the program's other threads run meanwhile.
pub(crate) fn drop_detached<T: Send>(v: T) {
    Python::attach(|py| py.detach(move || drop(v)));
}

/// Python lets go of a checkpointer without `close()`.
impl Drop for Engine {
    fn drop(&mut self) {
        let inner = self
            .inner
            .get_mut()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(inner) = inner {
            drop_detached(inner);
        }
    }
}

/// The name of an I/O engine, as Python sees it.
pub(crate) fn io_name(io: IoKind) -> &'static str {
    match io {
        IoKind::Uring => "uring",
        IoKind::Psync => "psync",
    }
}

fn config_error(field: &'static str, reason: impl Into<String>) -> PyErr {
    err(Error::Config {
        field,
        reason: reason.into(),
    })
}

/// How long a blocking wait runs with the GIL released before it lets
/// Python handle pending signals.
pub(crate) const SIGNAL_TICK: Duration = Duration::from_millis(100);

/// `c` with the fault injector `f` (an `acp._acp.FaultInjector`).
#[cfg(feature = "test-util")]
fn with_faults(c: EngineConfig, f: &Bound<'_, PyAny>) -> PyResult<EngineConfig> {
    let f = f.cast::<crate::faults::FaultInjector>()?;
    Ok(c.with_faults(f.get().shared()))
}

/// Refuses `faults=`: this build has no fault injection.
#[cfg(not(feature = "test-util"))]
fn with_faults(_c: EngineConfig, _f: &Bound<'_, PyAny>) -> PyResult<EngineConfig> {
    Err(invalid(
        "faults",
        "this build of acp has no fault injection (built without the `test-util` feature)",
    ))
}

/// Seconds from Python as a [`Duration`].
pub(crate) fn seconds(field: &'static str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs)
        .map_err(|_| config_error(field, format!("{secs} is not a duration in seconds")))
}

fn choice<T: Copy>(field: &'static str, value: &str, options: &[(&str, T)]) -> PyResult<T> {
    options
        .iter()
        .find(|(name, _)| *name == value)
        .map(|&(_, v)| v)
        .ok_or_else(|| {
            let names: Vec<&str> = options.iter().map(|(n, _)| *n).collect();
            config_error(field, format!("{value:?} is not one of {names:?}"))
        })
}

#[pymethods]
impl Engine {
    /// Opens the engine (see `acp_core::Engine::open`). Keyword arguments
    /// left at `None` keep the engine's default.
    #[new]
    #[pyo3(signature = (
        root, *, job=None, rank=0, world_size=1, ring_bytes=None, ring_slots=None,
        shm_dir=None, mlock=None, copy_threads=None, chunk_bytes=None, queue_depth=None,
        io=None, direct_io=None, on_full=None, full_timeout=None, verify=None,
        keep_last=None, keep_every=None, persist_on_open=None, stall_timeout=None,
        commit_timeout=None, faults=None, release_on_close=None, keep_restored=None, shm_ttl=None,
        persist_every=None, persist_interval=None, persist_policy=None, background_nice=None,
        replicas_held=None, compress=None, compress_level=None, incremental=None,
    ))]
    #[expect(
        clippy::too_many_arguments,
        reason = "one keyword per EngineConfig setter"
    )]
    fn new(
        py: Python<'_>,
        root: PathBuf,
        job: Option<String>,
        rank: u32,
        world_size: u32,
        ring_bytes: Option<u64>,
        ring_slots: Option<usize>,
        shm_dir: Option<PathBuf>,
        mlock: Option<bool>,
        copy_threads: Option<usize>,
        chunk_bytes: Option<usize>,
        queue_depth: Option<usize>,
        io: Option<&str>,
        direct_io: Option<&str>,
        on_full: Option<&str>,
        full_timeout: Option<f64>,
        verify: Option<&str>,
        keep_last: Option<usize>,
        keep_every: Option<u64>,
        persist_on_open: Option<bool>,
        stall_timeout: Option<f64>,
        commit_timeout: Option<f64>,
        faults: Option<Bound<'_, PyAny>>,
        release_on_close: Option<bool>,
        keep_restored: Option<bool>,
        shm_ttl: Option<f64>,
        persist_every: Option<u64>,
        persist_interval: Option<f64>,
        persist_policy: Option<&str>,
        background_nice: Option<i32>,
        replicas_held: Option<u32>,
        compress: Option<&str>,
        compress_level: Option<i32>,
        incremental: Option<bool>,
    ) -> PyResult<Engine> {
        let mut c = EngineConfig::new(root)
            .with_rank(rank)
            .with_world_size(world_size);
        if let Some(job) = job {
            c = c.with_job(job);
        }
        if let Some(v) = ring_bytes {
            c = c.with_ring_bytes(v);
        }
        if let Some(v) = ring_slots {
            c = c.with_ring_slots(v);
        }
        if let Some(v) = shm_dir {
            c = c.with_shm_dir(v);
        }
        if let Some(v) = mlock {
            c = c.with_mlock(v);
        }
        if let Some(v) = copy_threads {
            c = c.with_copy_threads(v);
        }
        if let Some(v) = chunk_bytes {
            c = c.with_chunk_bytes(v);
        }
        if let Some(v) = queue_depth {
            c = c.with_queue_depth(v);
        }
        if let Some(v) = io {
            let options = [
                ("auto", IoChoice::Auto),
                ("uring", IoChoice::Uring),
                ("psync", IoChoice::Psync),
            ];
            c = c.with_io(choice("io", v, &options)?);
        }
        if let Some(v) = direct_io {
            let options = [
                ("auto", DirectIo::Auto),
                ("on", DirectIo::On),
                ("off", DirectIo::Off),
            ];
            c = c.with_direct_io(choice("direct_io", v, &options)?);
        }
        match (on_full, full_timeout) {
            (None | Some("wait"), Some(secs)) => {
                c = c.with_when_full(WhenFull::Wait(seconds("full_timeout", secs)?));
            }
            (None | Some("wait"), None) => {}
            (Some("skip"), None) => c = c.with_when_full(WhenFull::Skip),
            (Some("skip"), Some(_)) => {
                return Err(config_error(
                    "full_timeout",
                    "only applies with on_full=\"wait\"",
                ));
            }
            (Some(other), _) => {
                return Err(config_error(
                    "on_full",
                    format!("{other:?} is not one of [\"wait\", \"skip\"]"),
                ));
            }
        }
        if let Some(v) = verify {
            let options = [
                ("always", Verify::Always),
                ("storage_only", Verify::StorageOnly),
            ];
            c = c.with_verify(choice("verify", v, &options)?);
        }
        if let Some(v) = keep_last {
            c = c.with_keep_last(v);
        }
        if let Some(v) = keep_every {
            c = c.with_keep_every(v);
        }
        if let Some(v) = persist_on_open {
            c = c.with_persist_on_open(v);
        }
        c = c.with_persist_policy(persist_policy_of(
            persist_every,
            persist_interval,
            persist_policy,
        )?);
        if let Some(v) = background_nice {
            c = c.with_background_nice(v);
        }
        if let Some(v) = stall_timeout {
            c = c.with_stall_timeout(seconds("stall_timeout", v)?);
        }
        if let Some(v) = commit_timeout {
            c = c.with_commit_timeout(seconds("commit_timeout", v)?);
        }
        if let Some(f) = faults {
            c = with_faults(c, &f)?;
        }
        if let Some(v) = release_on_close {
            c = c.with_release_on_close(v);
        }
        if let Some(v) = keep_restored {
            c = c.with_keep_restored(v);
        }
        if let Some(v) = shm_ttl {
            c = c.with_shm_ttl(seconds("shm_ttl", v)?);
        }
        if let Some(v) = replicas_held {
            c = c.with_replicas_held(v);
        }
        if let Some(v) = compress {
            c = c.with_compress(acp_core::Compress::parse(v).map_err(err)?);
        }
        if let Some(v) = compress_level {
            c = c.with_compress_level(v);
        }
        if let Some(v) = incremental {
            c = c.with_incremental(v);
        }
        let mailbox = Arc::new(Mailbox::default());
        c = c.with_transport(Arc::clone(&mailbox) as Arc<dyn acp_core::Transport>);
        let inner = py.detach(|| acp_core::Engine::open(c)).map_err(err)?;
        Ok(Engine {
            root: inner.root().to_path_buf(),
            inner: RwLock::new(Some(inner)),
            mailbox,
            kept: Kept::default(),
        })
    }

    /// The steps resident in this rank's ring, newest first.
    fn resident_steps(&self) -> PyResult<Vec<u64>> {
        Ok(self.get()?.resident_steps())
    }

    /// This rank's resident image of `step`, pinned, with its digests
    /// (computed now when the flush has not recorded them).
    fn resident_replica(&self, py: Python<'_>, step: u64) -> PyResult<ReplicaImage> {
        let engine = self.get()?;
        let (meta, pin) = py.detach(|| engine.resident_replica(step)).map_err(err)?;
        Ok(ReplicaImage::new(meta, pin))
    }

    /// This rank's resident image of `step`, pinned, without digests: a
    /// transport sends the bytes, then `resident_digests(image)`.
    fn pin_resident(&self, py: Python<'_>, step: u64) -> PyResult<ReplicaImage> {
        let engine = self.get()?;
        let (meta, pin) = py
            .detach(|| {
                let pin = engine.pin_resident(step)?;
                Ok::<_, Error>((engine.resident_meta(&pin), pin))
            })
            .map_err(err)?;
        Ok(ReplicaImage::new(meta, pin))
    }

    /// The chunk digests of `image` (32 bytes each, concatenated): those it
    /// was pinned with, else those of this rank's resident image it holds,
    /// recorded by the flush or computed now (GIL released) and recorded.
    fn resident_digests<'py>(
        &self,
        py: Python<'py>,
        image: &ReplicaImage,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if !image.known_digests().is_empty() {
            return Ok(digests_bytes(py, image.known_digests()));
        }
        no_digests_of_replica(image)?;
        let engine = self.get()?;
        let digests = py
            .detach(|| engine.resident_digests(image.pin()))
            .map_err(err)?;
        Ok(digests_bytes(py, &digests))
    }

    /// The chunk digests and quick sums of `image` (32 and 8 little-endian
    /// bytes each, concatenated): those it was pinned with, else those of
    /// this rank's resident image it holds, recorded by the flush or
    /// computed now (GIL released) and recorded. The sums are empty when
    /// the image has none.
    fn resident_hashes<'py>(
        &self,
        py: Python<'py>,
        image: &ReplicaImage,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        if !image.known_digests().is_empty() {
            return Ok((
                digests_bytes(py, image.known_digests()),
                sums_bytes(py, image.known_sums()),
            ));
        }
        no_digests_of_replica(image)?;
        let engine = self.get()?;
        let (digests, sums) = py
            .detach(|| engine.resident_hashes(image.pin()))
            .map_err(err)?;
        Ok((digests_bytes(py, &digests), sums_bytes(py, &sums)))
    }

    /// The quick sums of `image` (8 little-endian bytes each,
    /// concatenated): those it was pinned with, else those of this rank's
    /// resident image it holds, recorded or taken now (GIL released) and
    /// recorded. Sent right after the image: the holder seals its replica
    /// with them, before any blake3 digest exists.
    fn resident_sums<'py>(
        &self,
        py: Python<'py>,
        image: &ReplicaImage,
    ) -> PyResult<Bound<'py, PyBytes>> {
        if !image.known_sums().is_empty() || image.is_replica() {
            return Ok(sums_bytes(py, image.known_sums()));
        }
        let engine = self.get()?;
        let sums = py.detach(|| engine.resident_sums(image.pin()));
        Ok(sums_bytes(py, &sums))
    }

    /// The digests to send after `image`'s sums (32 bytes each,
    /// concatenated), with the sums beside them: those it was pinned with,
    /// else those of this rank's resident image recorded in its slot, or
    /// taken now (GIL released) when its step is being persisted; `None`
    /// for a RAM snapshot that is not (its replicas keep their sums
    /// alone). A held save is waited for until decided, at most `wait`
    /// seconds.
    #[pyo3(signature = (image, wait=30.0))]
    fn digests_to_send<'py>(
        &self,
        py: Python<'py>,
        image: &ReplicaImage,
        wait: f64,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)>> {
        if !image.known_digests().is_empty() {
            return Ok(Some((
                digests_bytes(py, image.known_digests()),
                sums_bytes(py, image.known_sums()),
            )));
        }
        if image.is_replica() {
            return Ok(None);
        }
        let engine = self.get()?;
        let wait = seconds("wait", wait)?;
        let got = py
            .detach(|| engine.digests_to_send(image.pin(), wait))
            .map_err(err)?;
        Ok(got.map(|(d, s)| (digests_bytes(py, &d), sums_bytes(py, &s))))
    }

    /// Records `digests` (32 bytes each, concatenated) beside the quick
    /// sums this rank's replica of rank `rank`'s `step` was sealed with.
    /// Returns whether they were recorded (see
    /// `acp_core::Engine::add_replica_digests`).
    fn add_replica_digests(
        &self,
        py: Python<'_>,
        rank: u32,
        step: u64,
        digests: Vec<u8>,
    ) -> PyResult<bool> {
        let digests = crate::replica::digests_from(rank, step, &digests)?;
        let engine = self.get()?;
        Ok(py.detach(|| engine.add_replica_digests(rank, step, &digests)))
    }

    /// A replica slot for rank `rank`'s image of `step` (`nbytes`, digests
    /// in chunks of `chunk_bytes`): receive into its `buffer()`, then
    /// `finish(digests)`.
    fn begin_replica(
        &self,
        py: Python<'_>,
        rank: u32,
        step: u64,
        nbytes: u64,
        chunk_bytes: u64,
    ) -> PyResult<Receipt> {
        let engine = self.get()?;
        let writer = py
            .detach(|| engine.begin_replica(rank, step, nbytes, chunk_bytes))
            .map_err(err)?;
        Ok(Receipt::slot(writer))
    }

    /// Memory for rank `rank`'s image of `step` (`nbytes`) fetched from
    /// rank `peer`: receive into its `buffer()`, then `finish(digests)`
    /// keeps it for the next load, which verifies it and reports it as
    /// from a peer: this rank's image, or another rank's whose file holds
    /// tensors of a `replicated` state this rank did not write. The claim
    /// is checked first (a rank of the job, the engine's chunk size, no
    /// longer than a slot of its ring).
    fn begin_peer_image(
        &self,
        py: Python<'_>,
        peer: u32,
        rank: u32,
        step: u64,
        nbytes: u64,
        chunk_bytes: u64,
    ) -> PyResult<Receipt> {
        let meta = acp_core::ReplicaMeta {
            rank,
            step,
            len: nbytes,
            chunk_bytes,
            digests: Vec::new(),
            sums: Vec::new(),
        };
        let engine = self.get()?;
        let mailbox = Arc::clone(&self.mailbox);
        py.detach(|| {
            let image = engine.peer_image_buf(&meta)?;
            Ok::<_, Error>(Receipt::peer(peer, meta, image, mailbox))
        })
        .map_err(err)
    }

    /// Frees the images a restore fetched from peers that no load took
    /// (`begin_peer_image`); returns how many there were.
    fn drop_peer_images(&self) -> usize {
        self.mailbox.clear()
    }

    /// This rank's replica of `rank`'s `step`, pinned, if it holds one.
    fn pin_replica(&self, py: Python<'_>, rank: u32, step: u64) -> PyResult<Option<ReplicaImage>> {
        let engine = self.get()?;
        Ok(py
            .detach(|| engine.pin_replica(rank, step))
            .map(|(meta, pin, _)| ReplicaImage::replica(meta, pin)))
    }

    /// The replicas this rank holds: (rank, step, len, chunk_bytes, digests).
    fn replicas<'py>(&self, py: Python<'py>) -> PyResult<Vec<MetaOut<'py>>> {
        let engine = self.get()?;
        let held = py.detach(|| engine.replicas());
        Ok(held.iter().map(|m| meta_tuple(py, m)).collect())
    }

    /// Receives another rank's image (`nbytes` at `addr`) into a replica slot.
    fn receive_replica(
        &self,
        py: Python<'_>,
        meta: MetaTuple,
        addr: usize,
        nbytes: usize,
    ) -> PyResult<()> {
        let engine = self.get()?;
        let meta = meta_from(meta)?;
        let range = [HostRange::new("replica image", 0, addr, nbytes)?];
        py.detach(|| {
            let src = host_slices("replica image", &range, &[])?;
            engine.receive_replica(&meta, |dst| {
                if dst.len() != src[0].len() {
                    return Err(Error::invalid(
                        meta.what(),
                        format!("{} bytes for an image of {}", src[0].len(), dst.len()),
                    ));
                }
                dst.copy_from_slice(src[0]);
                Ok(())
            })
        })
        .map_err(err)
    }

    /// Keeps an image fetched from rank `peer` (`nbytes` at `addr`) for the
    /// next load, which verifies it and reports it as from a peer.
    fn offer_peer_image(
        &self,
        py: Python<'_>,
        peer: u32,
        meta: MetaTuple,
        addr: usize,
        nbytes: usize,
    ) -> PyResult<()> {
        let meta = meta_from(meta)?;
        let range = [HostRange::new("peer image", 0, addr, nbytes)?];
        let mailbox = Arc::clone(&self.mailbox);
        py.detach(|| {
            let src = host_slices("peer image", &range, &[])?;
            mailbox.offer(peer, meta, src[0])
        })
        .map_err(err)
    }

    /// The checkpoint root.
    #[getter]
    fn root(&self) -> PathBuf {
        self.root.clone()
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
    }

    /// What opening the engine found and chose, as a dict.
    fn open_report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let engine = self.get()?;
        let r = engine.open_report();
        let d = PyDict::new(py);
        d.set_item("io", io_name(r.io))?;
        d.set_item("mlocked", r.mlocked)?;
        d.set_item("mlock_error", r.mlock_error.as_deref())?;
        d.set_item("resident_steps", r.resident_steps.clone())?;
        d.set_item("persisting_steps", r.persisting_steps.clone())?;
        d.set_item("discarded_half_staged", r.discarded_half_staged)?;
        d.set_item("shm_in_ram", r.shm_in_ram)?;
        d.set_item("shm_dir", r.shm_dir.clone())?;
        Ok(d)
    }

    /// Starts a save: lays out `specs` (name, safetensors dtype, shape) and
    /// the JSON `values_json` in a ring slot. Returns the `Staging` to fill,
    /// or `None` when the save was skipped because no slot was free.
    /// `persist`: True persists the save, False keeps it a RAM snapshot,
    /// None lets the engine's persist policy decide. `hold=True` (with
    /// `persist=None`) holds the snapshot until `decide(step, persist)`.
    #[pyo3(signature = (step, specs, values_json, overwrite=false, extra_metadata=None, persist=None, hold=false))]
    #[expect(
        clippy::too_many_arguments,
        reason = "one argument per SaveOptions field"
    )]
    fn begin_save(
        &self,
        py: Python<'_>,
        step: u64,
        specs: Vec<(String, String, Vec<u64>)>,
        values_json: &str,
        overwrite: bool,
        extra_metadata: Option<BTreeMap<String, String>>,
        persist: Option<bool>,
        hold: bool,
    ) -> PyResult<Option<Staging>> {
        let specs = tensor_specs(specs)?;
        start_save(
            py,
            &self.get()?,
            overwrite,
            extra_metadata,
            persist_of(persist, hold)?,
            |engine, opts| {
                let staging = engine.begin_save_json(step, &specs, values_json, opts)?;
                staging.map(Staging::new).transpose()
            },
        )
    }

    /// Checks and lays out `specs` and `values_json` once, for the saves
    /// of a state whose structure does not change (`begin_save_planned`),
    /// with `host`, the `(index, address, nbytes)` ranges to copy from
    /// (`Staging.copy_planned`), if given.
    #[pyo3(signature = (specs, values_json, host=None))]
    fn save_plan(
        &self,
        py: Python<'_>,
        specs: Vec<(String, String, Vec<u64>)>,
        values_json: &str,
        host: Option<Vec<(usize, usize, usize)>>,
    ) -> PyResult<SavePlan> {
        let specs = tensor_specs(specs)?;
        let engine = self.get()?;
        let core = py
            .detach(|| engine.save_plan(&specs, values_json))
            .map_err(err)?;
        SavePlan::new(core, host)
    }

    /// `begin_save` of the tensors and values of `plan`.
    #[pyo3(signature = (step, plan, overwrite=false, extra_metadata=None, persist=None, hold=false, values_json=None))]
    #[expect(
        clippy::too_many_arguments,
        reason = "one argument per SaveOptions field, and the values"
    )]
    fn begin_save_planned(
        &self,
        py: Python<'_>,
        step: u64,
        plan: &SavePlan,
        overwrite: bool,
        extra_metadata: Option<BTreeMap<String, String>>,
        persist: Option<bool>,
        hold: bool,
        values_json: Option<&str>,
    ) -> PyResult<Option<Staging>> {
        start_save(
            py,
            &self.get()?,
            overwrite,
            extra_metadata,
            persist_of(persist, hold)?,
            |engine, opts| {
                let staging = match values_json {
                    None => engine.begin_save_planned(step, &plan.core, opts)?,
                    Some(v) => engine.begin_save_planned_values(step, &plan.core, v, opts)?,
                };
                Ok(staging.map(|s| Staging::planned(s, plan)))
            },
        )
    }

    /// Readies every free ring slot for a checkpoint of these tensors and
    /// values now (creates its shared memory), so the first saves stall no
    /// longer than later ones; returns how many slots are ready.
    fn reserve(
        &self,
        py: Python<'_>,
        specs: Vec<(String, String, Vec<u64>)>,
        values_json: &str,
    ) -> PyResult<usize> {
        let specs = tensor_specs(specs)?;
        let engine = self.get()?;
        py.detach(|| engine.reserve_json(&specs, values_json))
            .map_err(err)
    }

    /// Loads a committed step (the newest when `step` is None), from RAM
    /// when a resident slot holds it, else from storage; `rank` loads the
    /// file another rank wrote (from its slot when resident on this node),
    /// and `tensors` only those of its tensors. With `defer`, a step read
    /// from storage comes back pending (`Loaded.pending`): its header read
    /// (verified later, by the read), its data read by the first
    /// `copy_into`, into the caller's tensors in the read's own pass; so
    /// does one held by this rank's resident slot (`source` "ram"), whose
    /// check is that copy's pass, and so does another rank's file (or its
    /// `tensors`) held by its slot on this node: the tensors `copy_into`
    /// fills are then not kept (`buffer` of them raises `acp.InvalidInput`).
    #[pyo3(signature = (step=None, storage_only=false, fallback=false, rank=None, tensors=None, defer=false))]
    #[expect(
        clippy::too_many_arguments,
        reason = "the keywords of the Python method"
    )]
    fn load(
        &self,
        py: Python<'_>,
        step: Option<u64>,
        storage_only: bool,
        fallback: bool,
        rank: Option<u32>,
        tensors: Option<Vec<String>>,
        defer: bool,
    ) -> PyResult<Loaded> {
        let req = LoadRequest {
            step,
            storage_only,
            fallback,
            rank,
            tensors,
        };
        let engine = self.get()?;
        py.detach(|| {
            if defer {
                Loaded::opened(engine.open_load(&req)?, &self.kept)
            } else {
                Loaded::new(engine.load(&req)?, &self.kept)
            }
        })
        .map_err(err)
    }

    /// The committed steps, ascending.
    fn steps(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        let engine = self.get()?;
        py.detach(|| engine.steps()).map_err(err)
    }

    /// The newest committed step, or None.
    fn latest(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        let engine = self.get()?;
        py.detach(|| engine.latest()).map_err(err)
    }

    /// The index of committed `step` as JSON text (the
    /// `model.safetensors.index.json` it was committed with).
    fn index_json(&self, py: Python<'_>, step: u64) -> PyResult<String> {
        let engine = self.get()?;
        py.detach(|| engine.index(step))
            .map_err(err)
            .map(|i| String::from_utf8_lossy(&i.to_json()).into_owned())
    }

    /// The values JSON of `rank`'s file of committed `step`, from its
    /// verified header only (its tensors are not read).
    fn read_values(&self, py: Python<'_>, step: u64, rank: u32) -> PyResult<String> {
        let engine = self.get()?;
        py.detach(|| engine.read_values(step, rank))
            .map_err(err)
            .map(|v| v.to_string())
    }

    /// The RAM snapshots of this rank on this node: the steps resident in
    /// its ring (persisted or not), newest first.
    fn snapshots(&self) -> PyResult<Vec<u64>> {
        Ok(self.get()?.snapshots())
    }

    /// Queues the persist of the newest resident step when it is newer
    /// than every committed step and no persist of it is under way,
    /// whatever the policy chose at its save; returns its handle, or None
    /// when there is nothing to persist.
    fn persist_newest(&self, py: Python<'_>) -> PyResult<Option<SaveHandle>> {
        let engine = self.get()?;
        py.detach(|| engine.persist_newest())
            .map(|h| h.map(SaveHandle::new))
            .map_err(err)
    }

    /// Gives up making a step restored from storage resident again
    /// (`keep_restored`): a waiting re-read is dropped, a running one stops
    /// at its next checked read. The dying checkpoint calls it.
    fn stop_keeping_restored(&self) -> PyResult<()> {
        self.get()?.stop_keeping_restored();
        Ok(())
    }

    /// What became of the saves so far: `staged`, `persisted`, `resident`,
    /// `superseded` and `skipped` counts, `bytes_written` to storage (plain
    /// image bytes) and `bytes_stored` (what the files take there,
    /// compressed or not) with their `compression_ratio`, `chunks_reused`
    /// and `bytes_reused` (not written: incremental steps), the
    /// persist `queue_depth`, `newest_snapshot`, `newest_persisted` and
    /// `persisted_lag_secs` (how much older the newest persisted step's
    /// snapshot is than the newest snapshot).
    fn persist_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.get()?.persist_stats();
        let d = PyDict::new(py);
        d.set_item("staged", s.staged)?;
        d.set_item("persisted", s.persisted)?;
        d.set_item("resident", s.resident)?;
        d.set_item("superseded", s.superseded)?;
        d.set_item("skipped", s.skipped)?;
        d.set_item("bytes_written", s.bytes_written)?;
        d.set_item("bytes_stored", s.bytes_stored)?;
        d.set_item(
            "compression_ratio",
            (s.bytes_written > 0).then(|| s.bytes_stored as f64 / s.bytes_written as f64),
        )?;
        d.set_item("chunks_reused", s.chunks_reused)?;
        d.set_item("bytes_reused", s.bytes_reused)?;
        d.set_item("queue_depth", s.queue_depth)?;
        d.set_item("newest_snapshot", s.newest_snapshot)?;
        d.set_item("newest_persisted", s.newest_persisted)?;
        d.set_item("persisted_lag_secs", s.persisted_lag_secs)?;
        Ok(d)
    }

    /// Queues the persist of this rank's resident image of `step` when it
    /// is newer than every committed step and not being persisted,
    /// whatever the policy chose at its save; returns its handle, or None
    /// when there is nothing to persist.
    fn persist_step(&self, py: Python<'_>, step: u64) -> PyResult<Option<SaveHandle>> {
        let engine = self.get()?;
        py.detach(|| engine.persist_step(step))
            .map(|h| h.map(SaveHandle::new))
            .map_err(err)
    }

    /// Makes every commit of step `first` or a newer one fail at its next
    /// look instead of waiting out `commit_timeout` (the dying checkpoint:
    /// no such step has every rank's file).
    fn give_up_commits_from(&self, first: u64) -> PyResult<()> {
        self.get()?.give_up_commits_from(first);
        Ok(())
    }

    /// Ends the give-ups below and above (the dying checkpoint, once
    /// drained).
    fn clear_given_up(&self) -> PyResult<()> {
        self.get()?.clear_given_up();
        Ok(())
    }

    /// Makes every commit that waits for one of the ranks `dead` fail at
    /// its next look, except that of step `keep` (the dying checkpoint:
    /// the survivors write the dead ranks' files of that step).
    #[pyo3(signature = (dead, keep=None))]
    fn give_up_commits_waiting_for(&self, dead: Vec<u32>, keep: Option<u64>) -> PyResult<()> {
        self.get()?.give_up_commits_waiting_for(&dead, keep);
        Ok(())
    }

    /// Queues the flush and commit of the unflushed resident image of
    /// `step` a previous process of this rank left; returns its handle.
    fn persist_resident(&self, py: Python<'_>, step: u64) -> PyResult<SaveHandle> {
        let engine = self.get()?;
        py.detach(|| engine.persist_resident(step))
            .map_err(err)
            .map(SaveHandle::new)
    }

    /// Decides a held save of `step` (`begin_save(..., hold=True)`): True
    /// queues its persist (its save handle completes when committed),
    /// False lets it go (a RAM snapshot, released once a newer step is
    /// sealed). Returns whether `step` was held (False when decided
    /// already, persisted as the newest step meanwhile, or let go at
    /// close).
    fn decide(&self, py: Python<'_>, step: u64, persist: bool) -> PyResult<bool> {
        let engine = self.get()?;
        py.detach(|| engine.decide(step, persist)).map_err(err)
    }

    /// Records that every holder of this rank's replicas has its image of
    /// `step` (called by acp.replica once an exchange completed): that RAM
    /// snapshot stays resident until a newer step is protected or
    /// committed. Returns whether `step` is now the protected step.
    fn protect(&self, step: u64) -> PyResult<bool> {
        Ok(self.get()?.protect(step))
    }

    /// Marks this rank's RAM snapshot of `step` as being replicated (called
    /// by acp.replica before it pins and sends the image): kept resident
    /// while newer saves seal, until `release_replicating(step)`. False
    /// (nothing marked) when `step` is not a kept RAM snapshot here.
    fn hold_replicating(&self, step: u64) -> PyResult<bool> {
        Ok(self.get()?.hold_replicating(step))
    }

    /// Ends one `hold_replicating(step)`: the snapshot is released now if a
    /// newer one superseded it and it is not the protected step.
    fn release_replicating(&self, step: u64) -> PyResult<()> {
        self.get()?.release_replicating(step);
        Ok(())
    }

    /// Marks this rank's image of `step` as being sent to its holders,
    /// until `exchange_ended(step)`: the flush of `step` pauses between
    /// chunks meanwhile (at most `FLUSH_YIELD_MAX` from its start), so
    /// the replication goes first.
    fn exchange_started(&self, step: u64) -> PyResult<()> {
        self.get()?.exchange_started(step);
        Ok(())
    }

    /// Ends one `exchange_started(step)`.
    fn exchange_ended(&self, step: u64) -> PyResult<()> {
        self.get()?.exchange_ended(step);
        Ok(())
    }

    /// The steps of the held saves not decided yet, in save order.
    fn held(&self) -> PyResult<Vec<u64>> {
        Ok(self.get()?.held())
    }

    /// Deletes committed steps that are neither among the newest `keep_last`
    /// nor a multiple of `keep_every`; returns the deleted steps.
    #[pyo3(signature = (keep_last, keep_every=None))]
    fn retain(
        &self,
        py: Python<'_>,
        keep_last: usize,
        keep_every: Option<u64>,
    ) -> PyResult<Vec<u64>> {
        let engine = self.get()?;
        py.detach(|| engine.retain(keep_last, keep_every))
            .map_err(err)
    }

    /// Waits until every queued flush has finished, at most `timeout`
    /// seconds (forever when None, unless the watchdog finds the flush
    /// stuck: `AcpTimeout` naming what). Signals are handled meanwhile.
    #[pyo3(signature = (timeout=None))]
    fn wait_idle(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let limit = timeout.map(|t| seconds("timeout", t)).transpose()?;
        let engine = self.get()?;
        let start = std::time::Instant::now();
        loop {
            let left = limit.map(|l| l.saturating_sub(start.elapsed()));
            let slice = left.map_or(SIGNAL_TICK, |l| l.min(SIGNAL_TICK));
            if py.detach(|| engine.wait_idle_timeout(slice)).map_err(err)? {
                return Ok(());
            }
            if left.is_some_and(|l| l <= slice) {
                return Err(err(Error::Timeout {
                    what: format!("flushes of {}", self.root.display()),
                    secs: timeout.unwrap_or_default(),
                }));
            }
            // A signal handler (SIGTERM, Ctrl-C) runs here, not after the wait.
            py.check_signals()?;
        }
    }

    /// Drains the flush queue, stops the flush thread and lets go of the
    /// engine; resident slots stay in shared memory (with
    /// `release_on_close`, they are removed when every resident step is
    /// committed). Raises the first flush error no handle reported. Returns,
    /// with `release_on_close`, the uncommitted steps that kept the ring
    /// (empty when it was removed), else None. A second call does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<Option<Vec<u64>>> {
        let taken = self
            .inner
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        match taken {
            // Closing waits for the flushes; dropping may join the flush thread.
            Some(engine) => py
                .detach(move || {
                    let closed = engine.close().map(|()| engine.kept_on_close());
                    drop(engine);
                    closed
                })
                .map_err(err),
            None => Ok(None),
        }
    }

    fn __repr__(&self) -> String {
        format!("Engine(root={:?}, closed={})", self.root, self.closed())
    }
}

/// The persist policy from the keywords: `persist_every=N`,
/// `persist_interval=seconds`, or `persist_policy` `"every"` (every save,
/// or every `persist_every`) or `"coalesce"`; at most one kind.
fn persist_policy_of(
    every: Option<u64>,
    interval: Option<f64>,
    policy: Option<&str>,
) -> PyResult<PersistPolicy> {
    match (every, interval, policy) {
        (None, None, None | Some("every")) => Ok(PersistPolicy::default()),
        (Some(n), None, None | Some("every")) => Ok(PersistPolicy::Every(n)),
        (None, Some(secs), None | Some("interval")) => {
            Ok(PersistPolicy::Interval(seconds("persist_interval", secs)?))
        }
        (None, None, Some("coalesce")) => Ok(PersistPolicy::Coalesce),
        (_, _, Some(other)) if !["every", "interval", "coalesce"].contains(&other) => {
            Err(config_error(
                "persist_policy",
                format!("{other:?} is not one of [\"every\", \"interval\", \"coalesce\"]"),
            ))
        }
        _ => Err(config_error(
            "persist_policy",
            "give one of persist_every, persist_interval or persist_policy=\"coalesce\"",
        )),
    }
}

/// A save's `persist=` and `hold=` keywords as one choice; `hold` only
/// with `persist=None` (a held save's persist is decided later).
fn persist_of(persist: Option<bool>, hold: bool) -> PyResult<Persist> {
    Ok(match (persist, hold) {
        (None, false) => Persist::Policy,
        (None, true) => Persist::Hold,
        (Some(true), false) => Persist::Always,
        (Some(false), false) => Persist::Never,
        (Some(p), true) => {
            return Err(invalid(
                "save",
                format!("hold=True decides the persist later; persist={p} decides it now"),
            ))
        }
    })
}

/// Tensor specs from `(name, dtype name, shape)` tuples.
fn tensor_specs(specs: Vec<(String, String, Vec<u64>)>) -> PyResult<Vec<TensorSpec>> {
    specs
        .into_iter()
        .map(
            |(name, dtype, shape)| match acp_core::Dtype::from_name(&dtype) {
                Some(dtype) => Ok(TensorSpec { name, dtype, shape }),
                None => Err(invalid(
                    format!("tensor `{name}`"),
                    format!("unknown dtype {dtype:?}"),
                )),
            },
        )
        .collect()
}

/// Runs `begin` (an engine's save start, GIL released) with the options of
/// one save; while the save waits for a free slot, Python's signal
/// handlers run at every tick (a SIGTERM's dying checkpoint must not wait
/// for a slot), and the first exception one raises ends the save.
fn start_save(
    py: Python<'_>,
    engine: &acp_core::Engine,
    overwrite: bool,
    extra_metadata: Option<BTreeMap<String, String>>,
    persist: Persist,
    begin: impl FnOnce(&acp_core::Engine, &SaveOptions) -> Result<Option<Staging>, Error> + Send,
) -> PyResult<Option<Staging>> {
    let raised: Arc<Mutex<Option<PyErr>>> = Arc::default();
    let seen = Arc::clone(&raised);
    let on_wait = OnWait(Arc::new(move || {
        Python::attach(|py| py.check_signals()).map_err(|e| {
            *seen.lock().unwrap_or_else(PoisonError::into_inner) = Some(e);
            Error::invalid("save", "interrupted by a signal handler's exception")
        })
    }));
    let opts = SaveOptions {
        overwrite,
        extra_metadata: extra_metadata.unwrap_or_default(),
        on_wait: Some(on_wait),
        persist,
    };
    py.detach(|| begin(engine, &opts)).map_err(|e| {
        raised
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .unwrap_or_else(|| err(e))
    })
}

/// A replica held here is never hashed again by the methods that hash
/// this rank's own image: one sealed with its quick sums alone has no
/// digests to give.
fn no_digests_of_replica(image: &ReplicaImage) -> PyResult<()> {
    if image.is_replica() {
        return Err(invalid(
            "replica image",
            "held with its quick sums alone: no digests to give (digests_to_send)",
        ));
    }
    Ok(())
}
