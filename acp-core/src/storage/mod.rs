//! The storage seam: where committed checkpoints live, and the lifecycle of
//! one step from "being written" to "committed" to "removed".
//!
//! In the crate's layers this module is at the bottom with `staging`: it
//! uses only [`format`](crate::format) (the index it reads back) and
//! [`error`](crate::error). `engine`, `ops` and `read` hold a
//! `dyn Storage` and never touch the file system for a checkpoint root
//! themselves; the [`io`](crate::io) engines write and read through the
//! files it hands out. Its invariant, which every implementation keeps: a
//! step is either committed whole (listed, its index and every file it
//! names readable) or not visible at all.
//!
//! # The contract
//!
//! A [`Storage`] holds committed steps, each a set of named files (one data
//! file per rank, plus the index `model.safetensors.index.json`). Callers
//! never see where or how: they hold handles ([`Pending`] for a step being
//! written, [`FileHandle`] for one opened file) and names, never a path to
//! join. A path appears only as text in messages ([`Storage::describe`]).
//!
//! A step is written in this order, and each arrow is a promise:
//!
//! 1. [`Storage::create_pending`]: a fresh place for step `S` that no
//!    reader lists. Whatever is put there is invisible to
//!    [`Storage::steps`], [`Storage::read_index`] and every open.
//! 2. [`Storage::create_file`] returns an opened, empty file in it; the
//!    caller's [`IoEngine`](crate::io::IoEngine) writes the data through
//!    the handle (chunks in flight, `O_DIRECT`) and fsyncs it.
//!    [`Storage::write_small`] writes a small file (the index, a rank's
//!    manifest) whole and durably.
//! 3. [`Storage::make_durable`]: every file written in the pending place
//!    is durable under its name. Nothing is visible yet.
//! 4. [`Storage::publish`]: **the commit**. Afterwards the step is listed,
//!    its index reads back and its files open; before, none of that. It is
//!    atomic: a crash at any point leaves either the old state (the
//!    previous step `S`, if any, still whole) or the new one, never a mix.
//!    A publish that fails has left the old state.
//! 5. [`Storage::write_latest`]: a hint for tools; never trusted by a load.
//!    Retention's [`Storage::retire_step`] renames come before it, so that
//!    its fsync makes them durable too; [`Storage::settle`] deletes the
//!    retired files after the save is reported committed.
//!
//! A step is committed exactly when its index can be read: the index is the
//! last thing that becomes visible. A pending place that is never published
//! is [`Storage::discard`]ed, or, after a crash, removed by
//! [`Storage::sweep_leftovers`] of the next engine of the same rank (which
//! removes only its own job's and rank's leftovers: other ranks and jobs may
//! share the storage).
//!
//! With several ranks, each writes its own pending step and reports its
//! file durable with [`Storage::report_rank`] (its manifest, which appears
//! whole or not at all); rank 0 finds the reports with
//! [`Storage::reported_ranks`], gathers the files into a pending step of its
//! own with [`Storage::adopt`], writes the index and publishes.
//!
//! # The local implementation
//!
//! [`LocalStorage`] is a directory on a POSIX file system (local or
//! shared): a pending step is a directory `.pending-…` beside the
//! `step-…` directories (readers list only `step-…`), durable is
//! fsync of each file and of the directory, and publish is a rename of the
//! pending directory to `step-S` (or a `renameat2(RENAME_EXCHANGE)` with
//! the old one when overwriting) followed by an fsync of the root.
//!
//! # An object store
//!
//! The same contract fits an object store (S3, GCS, Azure Blob), which has
//! no rename and no directories, by making the index object the commit:
//! - pending = a key prefix nobody lists (`pending/<step>-<nonce>/`), or
//!   the final prefix `step-S/` itself, since readers find steps through
//!   their index objects alone;
//! - [`Storage::create_file`] = a local staging file (or a multipart
//!   upload's part buffer) that the I/O engine writes through the handle;
//! - durable = every upload completed (the multipart upload is closed and
//!   acknowledged);
//! - publish = one put of `step-S/model.safetensors.index.json`, written
//!   last: a single object put is atomic, and until it lands the step is
//!   not listed;
//! - list = list the index objects (`step-*/model.safetensors.index.json`);
//! - open = a ranged-read handle over the object;
//! - remove = delete the index first (the step stops existing), then the
//!   rest; sweep = delete prefixes without an index older than a lease.
//!
//! Overwriting a committed step there means publishing the new index over
//! the old one; its data objects must then carry the new step's nonce in
//! their names, so the old index never points at new bytes.
//!
//! # Fault injection
//!
//! Tests break every operation of the protocol in turn with a
//! [`Probe`]: it sees each primitive operation (a chunk write, an fsync, a
//! rename, a directory sync) before it runs, and may fail or stall it. The
//! probe sits at the primitives, inside [`LocalStorage`] and the I/O
//! engines, rather than in a wrapper around [`Storage`]: a wrapper sees
//! only whole calls, and the interesting crash points lie inside one call
//! (between the rename that commits and the fsync that makes it durable,
//! between two chunk writes of one file). The injector
//! that implements it, `faults::FaultInjector`, exists only with the
//! `test-util` feature, and so does the configuration that installs it:
//! a build without the feature has no way to inject a fault.

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::error::Result;
use crate::format::Index;

#[cfg(feature = "test-util")]
pub mod faults;
pub mod local;
mod regular;

pub(crate) use local::open_root;
pub use local::LocalStorage;
pub(crate) use regular::create_exclusive;
pub use regular::{open_listed, open_regular};

/// Sees each primitive storage operation before it runs, and may fail it
/// (or stall, or act, e.g. kill the process at that exact point). `op` is
/// what is done ("write", "fsync", "rename", "fsync directory", "create
/// directory", "read"), `path` what it is done to.
pub trait Probe: Send + Sync + Debug {
    /// Called before the operation.
    ///
    /// # Errors
    /// The OS error the operation is to fail with.
    fn check(&self, op: &str, path: &Path) -> std::io::Result<()>;

    /// Called before a read or write of `bytes` bytes (the operation's
    /// own length: a file's last chunk, a compressed file's head, may be
    /// shorter than a chunk). Defaults to [`Probe::check`].
    ///
    /// # Errors
    /// The OS error the operation is to fail with.
    fn check_bytes(&self, op: &str, path: &Path, bytes: u64) -> std::io::Result<()> {
        let _ = bytes;
        self.check(op, path)
    }
}

/// Calls `probe.check` when there is a probe.
pub(crate) fn probe_op(p: Option<&dyn Probe>, op: &str, path: &Path) -> std::io::Result<()> {
    match p {
        Some(p) => p.check(op, path),
        None => Ok(()),
    }
}

/// Calls `probe.check_bytes` when there is a probe: a read or write of
/// `bytes` bytes.
pub(crate) fn probe_io(
    p: Option<&dyn Probe>,
    op: &str,
    path: &Path,
    bytes: usize,
) -> std::io::Result<()> {
    match p {
        Some(p) => p.check_bytes(op, path, bytes as u64),
        None => Ok(()),
    }
}

/// A step being written: a place no reader lists, until
/// [`Storage::publish`] commits it. What `key` means is the storage's own
/// (a directory name, an object prefix).
#[derive(Debug, PartialEq, Eq)]
pub struct Pending {
    step: u64,
    key: String,
}

impl Pending {
    /// The handle of pending place `key` for `step` (for [`Storage`]
    /// implementations).
    #[must_use]
    pub fn new(step: u64, key: String) -> Pending {
        Pending { step, key }
    }

    /// The step it will commit as.
    #[must_use]
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The storage's own name for it.
    #[must_use]
    pub fn key(&self) -> &str {
        &self.key
    }
}

/// One opened file of a step, and its name for messages. The name is never
/// opened again: every read or write goes through [`FileHandle::file`].
#[derive(Debug)]
pub struct FileHandle {
    file: File,
    shown: PathBuf,
}

impl FileHandle {
    /// Wraps an opened `file`, shown in messages as `shown`.
    #[must_use]
    pub fn new(file: File, shown: PathBuf) -> FileHandle {
        FileHandle { file, shown }
    }

    /// The opened file.
    #[must_use]
    pub fn file(&self) -> &File {
        &self.file
    }

    /// How messages name it.
    #[must_use]
    pub fn shown(&self) -> &Path {
        &self.shown
    }

    /// The opened file and its name.
    #[must_use]
    pub fn into_parts(self) -> (File, PathBuf) {
        (self.file, self.shown)
    }
}

/// Something an interrupted save or removal left behind (a pending step,
/// an unfinished commit or removal, a half-written `latest` hint).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leftover {
    /// The storage's name for it.
    pub name: String,
    /// Bytes it holds.
    pub bytes: u64,
    /// When it was last changed, when known.
    pub modified: Option<SystemTime>,
    /// Whether it is only a half-written `latest` hint (not a step).
    pub hint: bool,
}

/// Where committed checkpoints live: the lifecycle of a step (see the
/// module docs for the contract each call keeps).
pub trait Storage: Send + Sync + Debug {
    /// Where the checkpoints are, as messages name it (and as the default
    /// job id is derived from).
    fn location(&self) -> &Path;

    /// How messages name file `name` of committed `step`. Never opened.
    fn describe(&self, step: u64, name: &str) -> PathBuf;

    /// How messages name pending place `pending`. Never opened.
    fn describe_pending(&self, pending: &Pending) -> PathBuf;

    /// Makes the storage again when it was removed under the engine;
    /// returns whether it had to.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) when it cannot be made.
    fn recreate_if_missing(&self) -> Result<bool>;

    /// A fresh pending place for `step`, owned by this engine's rank and job.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    fn create_pending(&self, step: u64) -> Result<Pending>;

    /// Creates file `name` (it must not exist) in `pending`, private to
    /// this user, opened for writing, for the I/O engine to fill.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) naming the file.
    fn create_file(&self, pending: &Pending, name: &str) -> Result<FileHandle>;

    /// Writes `bytes` as the new file `name` in `pending`, durably.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) / [`Error::NoSpace`](crate::Error::NoSpace).
    fn write_small(&self, pending: &Pending, name: &str, bytes: &[u8]) -> Result<()>;

    /// Makes every file written in `pending` durable under its name.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    fn make_durable(&self, pending: &Pending) -> Result<()>;

    /// Commits `pending` as step `pending.step()`, replacing a committed
    /// step of that number when `overwrite` (the replaced step is retired:
    /// its files are deleted by the next [`Storage::settle`]).
    ///
    /// # Errors
    /// [`Error::Exists`](crate::Error::Exists) when the step is committed
    /// and `overwrite` is off; [`Error::Io`](crate::Error::Io), after which
    /// the previous state is visible and `pending` is as it was.
    fn publish(&self, pending: &Pending, overwrite: bool) -> Result<()>;

    /// Records `step` as the newest committed step (a hint for tools, no
    /// load trusts it), durably: the storage's other renames before it
    /// (the retirements of [`Storage::retire_step`]) are durable with it.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    fn write_latest(&self, step: u64) -> Result<()>;

    /// Removes a pending place and what it holds, best effort (a leftover
    /// is swept later).
    fn discard(&self, pending: &Pending);

    /// Reports this rank's file of `pending` durable for rank 0: writes its
    /// `manifest` so that it appears whole or not at all.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) / [`Error::NoSpace`](crate::Error::NoSpace).
    fn report_rank(&self, pending: &Pending, rank: u32, manifest: &[u8]) -> Result<()>;

    /// The pending places of `step` of this job whose rank has reported,
    /// by rank (the newest when a rank has several).
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) listing the storage.
    fn reported_ranks(&self, step: u64) -> Result<BTreeMap<u32, Pending>>;

    /// The manifest `rank` reported in `pending`, and how messages name it.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io); [`Error::Corrupt`](crate::Error::Corrupt)
    /// when it is not a regular file or is too large.
    fn read_report(&self, pending: &Pending, rank: u32) -> Result<(PathBuf, Vec<u8>)>;

    /// Rank 0's answer to a rank whose report (in its pending place
    /// `pending`) it took but could not commit: records `reason` there,
    /// for that rank's [`Storage::refusal`], so that the rank fails at
    /// once rather than at its commit timeout. Best effort.
    fn refuse(&self, pending: &Pending, reason: &str);

    /// Why rank 0 refused the report in this rank's pending place
    /// `pending`, once it has ([`Storage::refuse`]).
    fn refusal(&self, pending: &Pending) -> Option<String>;

    /// A fresh pending place in which rank 0 gathers the ranks' files of a
    /// multi-rank `step`.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    fn create_gather(&self, step: u64) -> Result<Pending>;

    /// Moves file `name` of pending place `from` into pending place `into`.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    fn adopt(&self, from: &Pending, name: &str, into: &Pending) -> Result<()>;

    /// The committed steps, ascending.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) listing the storage.
    fn steps(&self) -> Result<Vec<u64>>;

    /// Every step that has a step directory, ascending, known by its name
    /// alone (one listing, nothing opened or looked up inside): the
    /// committed steps and any whose index damage removed (the commit
    /// publishes the index with the step, so nothing else leaves one). For
    /// a caller that reads the index of the step it picks next, which tells
    /// the two apart ([`Storage::read_index`] reports a missing index as
    /// corruption), without paying a lookup per step on a cold cache.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) listing the storage.
    fn step_dirs(&self) -> Result<Vec<u64>>;

    /// Whether `step` is committed.
    fn is_committed(&self, step: u64) -> bool;

    /// Reads and validates the index of committed `step`.
    ///
    /// # Errors
    /// [`Error::NotFound`](crate::Error::NotFound) when the step is not
    /// committed; [`Error::Corrupt`](crate::Error::Corrupt) when its index
    /// is malformed, names another step, or is missing.
    fn read_index(&self, step: u64) -> Result<Index>;

    /// When `step` was committed (its index last changed), when known.
    fn committed_at(&self, step: u64) -> Option<SystemTime>;

    /// Opens file `name` of committed `step` for reading: only a regular
    /// file inside the step, never through a symlink, never blocking (see
    /// [`open_regular`]).
    ///
    /// # Errors
    /// [`Error::Corrupt`](crate::Error::Corrupt) for a name that would
    /// leave the step or a file that is not regular;
    /// [`Error::Io`](crate::Error::Io) (a missing file has
    /// [`std::io::ErrorKind::NotFound`] as its source).
    fn open_file(&self, step: u64, name: &str) -> Result<FileHandle>;

    /// As [`Storage::open_file`], for a data file the index lists with
    /// `size` bytes: a missing file or one of another size is
    /// [`Error::Corrupt`](crate::Error::Corrupt) (see
    /// [`open_listed`]).
    ///
    /// # Errors
    /// As [`Storage::open_file`].
    fn open_listed(&self, step: u64, name: &str, size: u64) -> Result<FileHandle>;

    /// The bytes committed `step` holds.
    fn step_bytes(&self, step: u64) -> u64;

    /// Removes committed `step`: it stops being listed first, then its
    /// files go ([`Storage::retire_step`], then [`Storage::settle`]).
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    fn remove_step(&self, step: u64) -> Result<()> {
        self.retire_step(step)?;
        self.settle()
    }

    /// Stops listing committed `step` at once, whole (one rename); its
    /// files are deleted by the next [`Storage::settle`]. A crash before
    /// that may list the step again, whole, or leave its files under a
    /// leftover name: never a step with files missing.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    fn retire_step(&self, step: u64) -> Result<()>;

    /// The housekeeping a commit leaves for later, off the save's path:
    /// makes the retirements since the last call durable (if the hint did
    /// not), then deletes the retired steps' files.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io); the retirements not yet deleted are
    /// tried again by the next call.
    fn settle(&self) -> Result<()>;

    /// Removes what this engine's rank and job left behind in a previous
    /// life (the caller holds that rank's ring lock, so no live process
    /// owns it). Returns how many were removed.
    fn sweep_leftovers(&self) -> usize;

    /// What any interrupted save or removal left behind, whoever's.
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io) listing the storage.
    fn leftovers(&self) -> Result<Vec<Leftover>>;

    /// Removes leftover `name` (from [`Storage::leftovers`]).
    ///
    /// # Errors
    /// [`Error::Io`](crate::Error::Io).
    fn remove_leftover(&self, name: &str) -> Result<()>;
}
