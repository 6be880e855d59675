//! The engine façade: save, load, list, retain, close.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::config::EngineConfig;
use crate::error::Result;
use crate::format::{Dtype, Entry, TensorSpec};
use crate::io::IoKind;

/// A checkpoint engine for one job and rank. Cheap to clone: clones share
/// the ring, the flush thread and the state.
#[derive(Debug, Clone)]
pub struct Engine {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {}

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
    pub extra_metadata: std::collections::BTreeMap<String, String>,
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
pub struct Staging {}

/// The completion handle of a save. Also a [`Future`](std::future::Future).
#[derive(Debug, Clone)]
pub struct SaveHandle {}

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
}

/// A loaded checkpoint; its tensors are zero-copy views into a pinned slot
/// (or a private buffer) that lives as long as this value.
#[derive(Debug)]
pub struct Checkpoint {}

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

impl Engine {
    /// Opens an engine on `config.root` (created if missing, mode 0700),
    /// opens the ring, probes the I/O engine, starts the flush thread and,
    /// with `persist_on_open`, queues resident checkpoints newer than the
    /// newest committed step for flush.
    ///
    /// # Errors
    /// [`Error::Config`](crate::Error::Config), [`Error::Busy`](crate::Error::Busy)
    /// when another live process has this job and rank open, [`Error::Io`](crate::Error::Io).
    pub fn open(config: EngineConfig) -> Result<Engine> {
        todo!()
    }

    /// What opening found and chose.
    #[must_use]
    pub fn open_report(&self) -> &OpenReport {
        todo!()
    }

    /// The configuration.
    #[must_use]
    pub fn config(&self) -> &EngineConfig {
        todo!()
    }

    /// The checkpoint root.
    #[must_use]
    pub fn root(&self) -> &Path {
        todo!()
    }

    /// Starts a save of `step`: checks the input, lays the image out in a
    /// ring slot and returns the [`Staging`] to fill. Returns `Ok(None)`
    /// when no slot is free and the policy is [`WhenFull::Skip`](crate::WhenFull::Skip).
    ///
    /// # Errors
    /// [`Error::Invalid`](crate::Error::Invalid) naming a bad tensor or value key;
    /// [`Error::Exists`](crate::Error::Exists) when the step is committed and
    /// `overwrite` is off; [`Error::Timeout`](crate::Error::Timeout) waiting
    /// for a slot; [`Error::Closed`](crate::Error::Closed).
    pub fn begin_save(
        &self,
        step: u64,
        tensors: &[TensorSpec],
        values: &serde_json::Value,
        opts: &SaveOptions,
    ) -> Result<Option<Staging>> {
        todo!()
    }

    /// Saves host tensors: [`Engine::begin_save`], a parallel copy into the
    /// slot, [`Staging::finish`]. Returns once the bytes are in the slot.
    ///
    /// # Errors
    /// As [`Engine::begin_save`], and [`Error::Invalid`](crate::Error::Invalid)
    /// when a tensor's bytes do not match its dtype and shape.
    pub fn save(
        &self,
        step: u64,
        tensors: &[HostTensor<'_>],
        values: &serde_json::Value,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        todo!()
    }

    /// Loads a committed step: from its resident slot when one holds it,
    /// else from storage (into a slot, which becomes resident).
    ///
    /// # Errors
    /// [`Error::NotFound`](crate::Error::NotFound), [`Error::Corrupt`](crate::Error::Corrupt)
    /// naming the file and tensor, [`Error::Io`](crate::Error::Io).
    pub fn load(&self, req: &LoadRequest) -> Result<Checkpoint> {
        todo!()
    }

    /// The committed steps, ascending.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) listing the root.
    pub fn steps(&self) -> Result<Vec<u64>> {
        todo!()
    }

    /// The newest committed step.
    ///
    /// # Errors
    /// As [`Engine::steps`].
    pub fn latest(&self) -> Result<Option<u64>> {
        todo!()
    }

    /// Deletes committed steps that are neither among the newest `keep_last`
    /// nor a multiple of `keep_every`; returns the deleted steps.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    pub fn retain(&self, keep_last: usize, keep_every: Option<u64>) -> Result<Vec<u64>> {
        todo!()
    }

    /// Waits until every queued flush has finished (committed or failed).
    ///
    /// # Errors
    /// [`Error::Timeout`](crate::Error::Timeout).
    pub fn wait_idle(&self, timeout: Option<Duration>) -> Result<()> {
        todo!()
    }

    /// Drains the flush queue and stops the flush thread. Resident slots stay
    /// in shared memory. Further saves fail with [`Error::Closed`](crate::Error::Closed).
    ///
    /// # Errors
    /// The first flush error not yet reported through a handle.
    pub fn close(&self) -> Result<()> {
        todo!()
    }
}

impl Staging {
    /// The step.
    #[must_use]
    pub fn step(&self) -> u64 {
        todo!()
    }

    /// The laid-out tensors, in the order given to `begin_save`.
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        todo!()
    }

    /// The writable bytes of tensor `i` in the slot.
    ///
    /// # Panics
    /// When `i` is out of range.
    pub fn tensor_mut(&mut self, i: usize) -> &mut [u8] {
        todo!()
    }

    /// The writable bytes of every tensor at once, in entry order.
    pub fn tensors_mut(&mut self) -> Vec<&mut [u8]> {
        todo!()
    }

    /// Copies `srcs[i]` into tensor `i`, in parallel over the configured
    /// copy threads.
    ///
    /// # Errors
    /// [`Error::Invalid`](crate::Error::Invalid) naming the tensor whose
    /// length differs, before anything is copied.
    pub fn copy_from(&mut self, srcs: &[&[u8]]) -> Result<()> {
        todo!()
    }

    /// Ends the stall: seals the slot and queues its flush.
    #[must_use]
    pub fn finish(self) -> SaveHandle {
        todo!()
    }
}

impl SaveHandle {
    /// A handle for a save skipped by the policy.
    #[must_use]
    pub fn skipped(step: u64) -> SaveHandle {
        todo!()
    }

    /// The step.
    #[must_use]
    pub fn step(&self) -> u64 {
        todo!()
    }

    /// Whether the save has finished (committed, failed or skipped).
    #[must_use]
    pub fn is_done(&self) -> bool {
        todo!()
    }

    /// Blocks until the step is committed.
    ///
    /// # Errors
    /// The error that stopped the save.
    pub fn wait(&self) -> Result<SaveReport> {
        todo!()
    }

    /// Like [`SaveHandle::wait`], at most `timeout`; `Ok(None)` when still running.
    ///
    /// # Errors
    /// The error that stopped the save.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Option<SaveReport>> {
        todo!()
    }
}

impl Checkpoint {
    /// The step.
    #[must_use]
    pub fn step(&self) -> u64 {
        todo!()
    }

    /// How it was loaded.
    #[must_use]
    pub fn report(&self) -> &LoadReport {
        todo!()
    }

    /// The plain values saved with it.
    #[must_use]
    pub fn values(&self) -> &serde_json::Value {
        todo!()
    }

    /// The tensors, in file order.
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        todo!()
    }

    /// The tensor named `name`.
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        todo!()
    }

    /// The bytes of `entry` (one of [`Checkpoint::entries`]).
    #[must_use]
    pub fn data(&self, entry: &Entry) -> &[u8] {
        todo!()
    }

    /// Copies each tensor `dsts[k].0` (an index into [`Checkpoint::entries`])
    /// into `dsts[k].1`, in parallel over the copy threads.
    ///
    /// # Errors
    /// [`Error::Invalid`](crate::Error::Invalid) naming the tensor when an
    /// index is out of range or a length differs, before anything is copied.
    pub fn copy_into(&self, dsts: &mut [(usize, &mut [u8])]) -> Result<()> {
        todo!()
    }
}
