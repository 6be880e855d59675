//! [`Storage`] on a local or shared POSIX file system: step directories,
//! durable small files, renames and directory syncs.
//!
//! Every primitive operation that the commit protocol depends on goes
//! through here (and the I/O engine's chunk writes and fsyncs), so a
//! [`Probe`] sees each one.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use super::{probe_op, FileHandle, Leftover, Pending, Probe, Storage};
use crate::error::{Error, Result};
use crate::format::{manifest_file_name, validate_file_name, Index, INDEX_FILE_NAME};

/// The name of the directory of a committed step.
#[must_use]
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step:012}")
}

/// Parses a committed step directory name: only the canonical name of a
/// step ([`step_dir_name`]) is one. Any other spelling of the same number
/// (`step-0000000000005`, `step-+00000000005`) is not, so it can neither
/// alias a step nor be listed as one whose directory does not exist.
#[must_use]
pub fn parse_step_dir_name(name: &str) -> Option<u64> {
    let step: u64 = name.strip_prefix("step-")?.parse().ok()?;
    (step_dir_name(step) == name).then_some(step)
}

/// The file holding the newest committed step, as a hint for tools.
pub const LATEST_FILE_NAME: &str = "latest";

/// Where rank 0 records, in a rank's pending place, why it refused that
/// rank's report ([`Storage::refuse`]).
const REFUSED_FILE_NAME: &str = "refused";

/// The most of a refusal a rank reads: a message, not a file.
const MAX_REFUSAL: u64 = 64 << 10;

/// The name prefixes of what an interrupted save or removal leaves in the
/// root (pending, gathering and trash directories; `latest` hints).
const LEFTOVER_PREFIXES: [&str; 4] = [".pending-", ".commit-", ".trash-", ".latest-"];

/// A checkpoint root directory: [`Storage`] on a POSIX file system.
#[derive(Debug, Clone)]
pub struct LocalStorage {
    path: PathBuf,
    probe: Option<Arc<dyn Probe>>,
    /// `r{rank:05}-{job tag}`: marks the temporary directories this engine
    /// creates, so that it sweeps only its own job's and rank's leftovers.
    owner: String,
    /// Steps retired (renamed out of the listing) whose files the next
    /// `settle` deletes; shared by the clones of this root.
    retired: Arc<Mutex<Vec<PathBuf>>>,
}

impl LocalStorage {
    /// Opens `path` to write checkpoints to, creating it (mode 0700) when
    /// missing. An existing root must be owned by this process's effective
    /// user and writable by nobody else: whoever else can write to it could
    /// swap step directories and data files under the engine.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be created or is not a directory;
    /// [`Error::Config`] (field `root`) naming the path when another user
    /// owns it or its group or others may write to it.
    pub fn open(path: &Path) -> Result<LocalStorage> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| Error::io("create directory", path, e))?;
        let path = fs::canonicalize(path).map_err(|e| Error::io("resolve", path, e))?;
        let meta = fs::metadata(&path).map_err(|e| Error::io("stat", &path, e))?;
        check_writable_root(&path, meta.uid(), meta.mode(), euid())?;
        Ok(LocalStorage {
            path,
            probe: None,
            owner: "r00000-any".to_owned(),
            retired: Arc::default(),
        })
    }

    /// Marks this root's temporary directories as those of `rank` of the
    /// job whose tag is `job_tag` (a few hex digits).
    #[must_use]
    pub fn owned_by(mut self, rank: u32, job_tag: &str) -> LocalStorage {
        self.owner = format!("r{rank:05}-{job_tag}");
        self
    }

    /// Shows every primitive operation to `probe` before it runs.
    #[must_use]
    pub fn with_probe(mut self, probe: Option<Arc<dyn Probe>>) -> LocalStorage {
        self.probe = probe;
        self
    }

    /// Opens an existing root without creating it, to read from. Unlike
    /// [`LocalStorage::open`], the root may belong to another user (a
    /// checkpoint downloaded or shared read-only): reads still never leave it.
    ///
    /// # Errors
    /// [`Error::NotFound`] when it does not exist.
    pub fn open_existing(path: &Path) -> Result<LocalStorage> {
        let path = fs::canonicalize(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound {
                    what: format!("checkpoint root {}", path.display()),
                }
            } else {
                Error::io("resolve", path, e)
            }
        })?;
        Ok(LocalStorage {
            path,
            probe: None,
            owner: "r00000-any".to_owned(),
            retired: Arc::default(),
        })
    }

    /// The canonical path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, op: &'static str, path: &Path) -> Result<()> {
        probe_op(self.probe.as_deref(), op, path).map_err(|e| Error::io(op, path, e))
    }

    /// The directory of committed step `step`.
    fn step_dir(&self, step: u64) -> PathBuf {
        self.path.join(step_dir_name(step))
    }

    /// The directory of a pending place.
    fn dir_of(&self, pending: &Pending) -> PathBuf {
        self.path.join(pending.key())
    }

    fn retired_list(&self) -> std::sync::MutexGuard<'_, Vec<PathBuf>> {
        self.retired
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A fresh name `{prefix}-{step}-{owner}-{pid}-{nonce}` in the root.
    fn fresh_name(&self, prefix: &str, step: u64) -> String {
        format!(
            "{prefix}-{step:012}-{}-{}-{}",
            self.owner,
            std::process::id(),
            nonce()
        )
    }

    /// Creates the fresh directory `{prefix}-…` for `step`.
    fn create_temp_dir(&self, prefix: &str, step: u64) -> Result<Pending> {
        let name = self.fresh_name(prefix, step);
        let path = self.path.join(&name);
        self.check("create directory", &path)?;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| Error::io("create directory", &path, e))?;
        Ok(Pending::new(step, name))
    }

    /// Renames `from` to `to` (both inside the root).
    fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        self.check("rename", to)?;
        fs::rename(from, to).map_err(|e| Error::io("rename", to, e))
    }

    /// Writes `bytes` to a new file `path` (mode 0600) and fsyncs it.
    fn write_durable(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        self.check("write", path)?;
        let mut f = super::create_exclusive(path)?;
        f.write_all(bytes)
            .map_err(|e| Error::io("write", path, e))?;
        self.check("fsync", path)?;
        f.sync_all().map_err(|e| Error::io("fsync", path, e))
    }

    /// Fsyncs a directory, so the names created or renamed in it are durable.
    fn sync_dir(&self, dir: &Path) -> Result<()> {
        self.check("fsync directory", dir)?;
        fsync_dir(dir)
    }

    /// Renames a fully written pending directory into place as `step`
    /// (atomically exchanging it with an existing step directory when
    /// `overwrite`), then fsyncs the root. Returns the directory of the
    /// replaced step (now under a trash name), if any.
    fn rename_into_place(
        &self,
        pending: &Path,
        step: u64,
        overwrite: bool,
    ) -> Result<Option<PathBuf>> {
        let target = self.step_dir(step);
        self.check("rename", &target)?;
        let exists = fs::symlink_metadata(&target).is_ok();
        if exists && !overwrite {
            return Err(Error::Exists {
                step,
                root: self.path.clone(),
            });
        }
        if exists {
            exchange(pending, &target).map_err(|e| Error::io("exchange", &target, e))?;
        } else {
            fs::rename(pending, &target).map_err(|e| Error::io("rename", &target, e))?;
        }
        if let Err(e) = self.sync_dir(&self.path) {
            // Not durable, so not committed: take the new step back out of
            // view (restoring the old one when overwriting) and report.
            let undone = if exists {
                exchange(pending, &target)
            } else {
                fs::rename(&target, pending)
            };
            if let Err(u) = undone {
                tracing::error!(
                    "acp: step {step} is visible in {} but its commit failed ({e}) and could not be undone: {u}",
                    self.path.display()
                );
            }
            return Err(e);
        }
        if !exists {
            return Ok(None);
        }
        // `pending` now holds the old step; move it out of the way.
        let trash = self.path.join(self.fresh_name(".trash", step));
        fs::rename(pending, &trash).map_err(|e| Error::io("rename", pending, e))?;
        Ok(Some(trash))
    }

    /// The step directories (`step-…`, not symlinks: the listing's own
    /// file type, no lookup), ascending, and, with `look_inside`, whether
    /// each holds an index file (a regular one; one lookup per step).
    fn listed(&self, look_inside: bool) -> Result<Vec<(u64, bool)>> {
        let rd = fs::read_dir(&self.path).map_err(|e| Error::io("list", &self.path, e))?;
        let mut steps = Vec::new();
        for ent in rd {
            let ent = ent.map_err(|e| Error::io("list", &self.path, e))?;
            let Some(step) = ent.file_name().to_str().and_then(parse_step_dir_name) else {
                continue;
            };
            if !ent.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let index = look_inside
                && fs::symlink_metadata(ent.path().join(INDEX_FILE_NAME))
                    .is_ok_and(|m| m.is_file());
            steps.push((step, index));
        }
        steps.sort_unstable();
        Ok(steps)
    }

    /// The path of file `name` of committed `step`, once `name` is known to
    /// stay inside the step directory.
    fn file_path(&self, step: u64, name: &str) -> Result<PathBuf> {
        let dir = self.step_dir(step);
        validate_file_name(&dir.join(INDEX_FILE_NAME), name)?;
        Ok(dir.join(name))
    }
}

/// Fsyncs directory `dir` (no probe: [`LocalStorage::sync_dir`] is the
/// probed one).
fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::io("fsync directory", dir, e))
}

impl Storage for LocalStorage {
    fn location(&self) -> &Path {
        &self.path
    }

    fn describe(&self, step: u64, name: &str) -> PathBuf {
        self.step_dir(step).join(name)
    }

    fn describe_pending(&self, pending: &Pending) -> PathBuf {
        self.dir_of(pending)
    }

    fn recreate_if_missing(&self) -> Result<bool> {
        match fs::symlink_metadata(&self.path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.check("create directory", &self.path)?;
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(&self.path)
                    .map_err(|e| Error::io("create directory", &self.path, e))?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn create_pending(&self, step: u64) -> Result<Pending> {
        self.create_temp_dir(".pending", step)
    }

    fn create_file(&self, pending: &Pending, name: &str) -> Result<FileHandle> {
        let dir = self.dir_of(pending);
        validate_file_name(&dir.join(INDEX_FILE_NAME), name)?;
        let path = dir.join(name);
        let file = super::create_exclusive(&path)?;
        Ok(FileHandle::new(file, path))
    }

    fn write_small(&self, pending: &Pending, name: &str, bytes: &[u8]) -> Result<()> {
        self.write_durable(&self.dir_of(pending).join(name), bytes)
    }

    fn make_durable(&self, pending: &Pending) -> Result<()> {
        self.sync_dir(&self.dir_of(pending))
    }

    fn publish(&self, pending: &Pending, overwrite: bool) -> Result<()> {
        let dir = self.dir_of(pending);
        if let Some(old) = self.rename_into_place(&dir, pending.step(), overwrite)? {
            self.retired_list().push(old);
        }
        Ok(())
    }

    fn write_latest(&self, step: u64) -> Result<()> {
        let tmp = self
            .path
            .join(format!(".latest-{}-{}", std::process::id(), nonce()));
        self.write_durable(&tmp, format!("{step}\n").as_bytes())?;
        let dst = self.path.join(LATEST_FILE_NAME);
        self.check("rename", &dst)?;
        if let Err(e) = fs::rename(&tmp, &dst) {
            let _ = fs::remove_file(&tmp);
            return Err(Error::io("rename", &dst, e));
        }
        self.sync_dir(&self.path)
    }

    fn discard(&self, pending: &Pending) {
        let dir = self.dir_of(pending);
        if fs::symlink_metadata(&dir).is_ok() {
            let _ = fs::remove_dir_all(&dir);
        }
    }

    fn report_rank(&self, pending: &Pending, rank: u32, manifest: &[u8]) -> Result<()> {
        // Rank 0 takes a manifest as soon as its name appears, and may
        // move this directory's data file and remove the directory at
        // once: the name appears by a rename, after the content and
        // the directory are durable.
        let dir = self.dir_of(pending);
        let name = manifest_file_name(rank);
        let tmp = dir.join(format!("{name}.tmp"));
        self.write_durable(&tmp, manifest)?;
        self.sync_dir(&dir)?;
        self.rename(&tmp, &dir.join(name))
    }

    fn reported_ranks(&self, step: u64) -> Result<BTreeMap<u32, Pending>> {
        let prefix = format!(".pending-{step:012}-r");
        let job = format!("-{}-", self.owner.split_once('-').map_or("", |(_, j)| j));
        let mut found: BTreeMap<u32, (SystemTime, String)> = BTreeMap::new();
        let rd = fs::read_dir(&self.path).map_err(|e| Error::io("list", &self.path, e))?;
        for ent in rd.flatten() {
            let name = ent.file_name();
            let Some(name) = name.to_str() else { continue };
            let Some(rest) = name.strip_prefix(&prefix) else {
                continue;
            };
            let Some(rank) = rest.get(..5).and_then(|r| r.parse::<u32>().ok()) else {
                continue;
            };
            // Only this job's ranks (another job may share the root).
            if !rest.get(5..).is_some_and(|r| r.starts_with(&job)) {
                continue;
            }
            let manifest = ent.path().join(manifest_file_name(rank));
            let Ok(meta) = fs::symlink_metadata(&manifest) else {
                continue;
            };
            if !meta.is_file() {
                continue;
            }
            let when = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
            if found.get(&rank).is_none_or(|(w, _)| *w < when) {
                found.insert(rank, (when, name.to_owned()));
            }
        }
        Ok(found
            .into_iter()
            .map(|(r, (_, key))| (r, Pending::new(step, key)))
            .collect())
    }

    fn read_report(&self, pending: &Pending, rank: u32) -> Result<(PathBuf, Vec<u8>)> {
        let path = self.dir_of(pending).join(manifest_file_name(rank));
        let bytes = read_small(&path, 256 << 20)?;
        Ok((path, bytes))
    }

    fn refuse(&self, pending: &Pending, reason: &str) {
        // Written aside and renamed, as a report is: the rank reads it
        // whole or not at all.
        let dir = self.dir_of(pending);
        let tmp = dir.join(format!("{REFUSED_FILE_NAME}.tmp"));
        let written = self
            .write_durable(&tmp, reason.as_bytes())
            .and_then(|()| self.rename(&tmp, &dir.join(REFUSED_FILE_NAME)));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            tracing::debug!("acp: the refusal of {} not recorded: {e}", dir.display());
        }
    }

    fn refusal(&self, pending: &Pending) -> Option<String> {
        let path = self.dir_of(pending).join(REFUSED_FILE_NAME);
        let bytes = read_small(&path, MAX_REFUSAL).ok()?;
        Some(String::from_utf8_lossy(&bytes).into_owned())
    }

    fn create_gather(&self, step: u64) -> Result<Pending> {
        self.create_temp_dir(".commit", step)
    }

    fn adopt(&self, from: &Pending, name: &str, into: &Pending) -> Result<()> {
        let to = self.dir_of(into);
        validate_file_name(&to.join(INDEX_FILE_NAME), name)?;
        self.rename(&self.dir_of(from).join(name), &to.join(name))
    }

    fn steps(&self) -> Result<Vec<u64>> {
        Ok(self
            .listed(true)?
            .into_iter()
            .filter_map(|(s, index)| index.then_some(s))
            .collect())
    }

    fn step_dirs(&self) -> Result<Vec<u64>> {
        Ok(self.listed(false)?.into_iter().map(|(s, _)| s).collect())
    }

    fn is_committed(&self, step: u64) -> bool {
        let dir = self.step_dir(step);
        fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir())
            && fs::symlink_metadata(dir.join(INDEX_FILE_NAME)).is_ok_and(|m| m.is_file())
    }

    fn read_index(&self, step: u64) -> Result<Index> {
        let dir = self.step_dir(step);
        if !fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
            return Err(Error::NotFound {
                what: format!("step {step} in {}", self.path.display()),
            });
        }
        let path = dir.join(INDEX_FILE_NAME);
        let bytes = read_small(&path, 64 << 20).map_err(|e| match e {
            Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                Error::corrupt(
                    &path,
                    None,
                    "missing: the step directory exists, so the step was committed with one",
                )
            }
            other => other,
        })?;
        let index = Index::parse(&path, &bytes)?;
        if index.step != step {
            return Err(Error::corrupt(
                &path,
                None,
                format!("index says step {}, directory says {step}", index.step),
            ));
        }
        Ok(index)
    }

    fn committed_at(&self, step: u64) -> Option<SystemTime> {
        let index = self.step_dir(step).join(INDEX_FILE_NAME);
        fs::symlink_metadata(index).ok()?.modified().ok()
    }

    fn open_file(&self, step: u64, name: &str) -> Result<FileHandle> {
        let path = self.file_path(step, name)?;
        let file = super::open_regular(&path)?;
        Ok(FileHandle::new(file, path))
    }

    fn open_listed(&self, step: u64, name: &str, size: u64) -> Result<FileHandle> {
        let path = self.file_path(step, name)?;
        let file = super::open_listed(&path, size)?;
        Ok(FileHandle::new(file, path))
    }

    fn step_bytes(&self, step: u64) -> u64 {
        dir_bytes(&self.step_dir(step))
    }

    fn retire_step(&self, step: u64) -> Result<()> {
        let dir = self.step_dir(step);
        let trash = self.path.join(self.fresh_name(".trash", step));
        self.check("rename", &dir)?;
        fs::rename(&dir, &trash).map_err(|e| Error::io("rename", &dir, e))?;
        self.retired_list().push(trash);
        Ok(())
    }

    fn settle(&self) -> Result<()> {
        let retired = std::mem::take(&mut *self.retired_list());
        if retired.is_empty() {
            return Ok(());
        }
        let mut done = 0;
        let result = (|| {
            // The retirements are made durable before any file goes: a
            // retired step's files are never deleted while a crash could
            // still list it. (Not through the probe: the commit's own
            // operations are all done by now, and a fault injected here
            // would land in whatever the caller armed for the next save.)
            fsync_dir(&self.path)?;
            for trash in &retired {
                match fs::remove_dir_all(trash) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        return Err(Error::io("remove", trash, e));
                    }
                    _ => done += 1,
                }
            }
            Ok(())
        })();
        // What was not deleted is tried again by the next call.
        self.retired_list().extend_from_slice(&retired[done..]);
        result
    }

    fn sweep_leftovers(&self) -> usize {
        let Ok(rd) = fs::read_dir(&self.path) else {
            return 0;
        };
        let tag = format!("-{}-", self.owner);
        let mut n = 0;
        for ent in rd.flatten() {
            let name = ent.file_name();
            let Some(name) = name.to_str() else { continue };
            let ours = (name.starts_with(".pending-")
                || name.starts_with(".trash-")
                || name.starts_with(".commit-"))
                && name.contains(&tag);
            if ours
                && ent.file_type().is_ok_and(|t| t.is_dir())
                && fs::remove_dir_all(ent.path()).is_ok()
            {
                n += 1;
            }
        }
        n
    }

    fn leftovers(&self) -> Result<Vec<Leftover>> {
        let rd = fs::read_dir(&self.path).map_err(|e| Error::io("list", &self.path, e))?;
        let mut found = Vec::new();
        for ent in rd.flatten() {
            let name = ent.file_name().to_string_lossy().into_owned();
            if !LEFTOVER_PREFIXES.iter().any(|p| name.starts_with(p)) {
                continue;
            }
            let Ok(meta) = fs::symlink_metadata(ent.path()) else {
                continue;
            };
            found.push(Leftover {
                bytes: if meta.is_dir() {
                    dir_bytes(&ent.path())
                } else {
                    meta.len()
                },
                modified: meta.modified().ok(),
                hint: name.starts_with(".latest-"),
                name,
            });
        }
        found.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(found)
    }

    fn remove_leftover(&self, name: &str) -> Result<()> {
        let path = self.path.join(name);
        if !LEFTOVER_PREFIXES.iter().any(|p| name.starts_with(p)) || name.contains('/') {
            return Err(Error::invalid(
                path.display(),
                "is not something an interrupted save left behind",
            ));
        }
        let meta = fs::symlink_metadata(&path).map_err(|e| Error::io("remove", &path, e))?;
        let gone = if meta.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        gone.map_err(|e| Error::io("remove", &path, e))
    }
}

/// The bytes of the regular files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir).map_or(0, |rd| {
        rd.flatten()
            .filter_map(|e| fs::symlink_metadata(e.path()).ok())
            .filter(fs::Metadata::is_file)
            .map(|m| m.len())
            .sum()
    })
}

/// Opens an existing checkpoint root (never creates one).
///
/// # Errors
/// [`Error::NotFound`]; [`Error::Invalid`] when it is not a directory.
pub(crate) fn open_root(path: &Path) -> Result<LocalStorage> {
    let root = LocalStorage::open_existing(path)?;
    if !root.path().is_dir() {
        return Err(Error::invalid(
            path.display(),
            "is not a directory (a checkpoint root is a directory of step-… directories)",
        ));
    }
    Ok(root)
}

/// Reads a small file whole (at most `limit` bytes), opened by
/// [`super::open_regular`]: a symlink, a FIFO or any other non-regular
/// file is refused without blocking.
///
/// # Errors
/// [`Error::Io`]; [`Error::Corrupt`] when it is not a regular file or is
/// larger than `limit`.
pub fn read_small(path: &Path, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = super::open_regular(path)?;
    let meta = f.metadata().map_err(|e| Error::io("stat", path, e))?;
    if meta.len() > limit {
        return Err(Error::corrupt(
            path,
            None,
            format!("{} bytes, more than the {limit} allowed", meta.len()),
        ));
    }
    let mut buf = Vec::new();
    f.take(limit)
        .read_to_end(&mut buf)
        .map_err(|e| Error::io("read", path, e))?;
    Ok(buf)
}

/// Refuses a root to write to that the effective user `euid` does not own
/// (`uid`) or whose `mode` lets group or others write to it.
fn check_writable_root(path: &Path, uid: u32, mode: u32, euid: u32) -> Result<()> {
    if uid != euid {
        return Err(Error::Config {
            field: "root",
            reason: format!(
                "{} is owned by uid {uid}, not by this process's user (uid {euid}); acp writes checkpoints only to a root its user owns",
                path.display()
            ),
        });
    }
    if mode & 0o022 != 0 {
        return Err(Error::Config {
            field: "root",
            reason: format!(
                "{} has mode {:o}: its group or others may write to it; acp writes checkpoints only to a root no one else can change (chmod go-w)",
                path.display(),
                mode & 0o7777
            ),
        });
    }
    Ok(())
}

/// The effective user id.
#[expect(unsafe_code, reason = "geteuid has no safe wrapper in std or libc")]
fn euid() -> u32 {
    // SAFETY: `geteuid` takes no arguments, touches no memory of ours and
    // cannot fail.
    unsafe { libc::geteuid() }
}

/// Atomically swaps two paths (`renameat2(RENAME_EXCHANGE)`).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let ca = CString::new(a.as_os_str().as_bytes())?;
    let cb = CString::new(b.as_os_str().as_bytes())?;
    let rc = renameat2_exchange(&ca, &cb);
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[expect(unsafe_code, reason = "renameat2 has no safe wrapper in std or libc")]
fn renameat2_exchange(a: &std::ffi::CStr, b: &std::ffi::CStr) -> libc::c_int {
    // SAFETY: both pointers come from live `CStr`s (NUL-terminated) that
    // outlive the call; AT_FDCWD needs no fd; the syscall reads only them.
    unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    }
}

/// A process-unique number for temporary names.
fn nonce() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    #[expect(
        clippy::cast_possible_truncation,
        reason = "only the low bits are wanted"
    )]
    let t = t as u64;
    t ^ (N.fetch_add(1, Ordering::Relaxed) << 48)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_names_round_trip() {
        assert_eq!(step_dir_name(42), "step-000000000042");
        assert_eq!(parse_step_dir_name("step-000000000042"), Some(42));
        assert_eq!(parse_step_dir_name("step-42"), None);
        assert_eq!(parse_step_dir_name("step-00000000004x"), None);
        assert_eq!(parse_step_dir_name(".pending-000000000042"), None);
        // Only the canonical spelling: longer names must not alias a step.
        assert_eq!(parse_step_dir_name("step-0000000000042"), None);
        assert_eq!(parse_step_dir_name("step-+00000000042"), None);
        assert_eq!(parse_step_dir_name("step-00000000042"), None);
        assert_eq!(
            parse_step_dir_name("step-1234567890123"),
            Some(1_234_567_890_123)
        );
        assert_eq!(
            parse_step_dir_name(&step_dir_name(u64::MAX)),
            Some(u64::MAX)
        );
    }

    #[test]
    fn writable_root_must_be_ours_and_private() {
        let p = Path::new("/ckpt");
        assert!(check_writable_root(p, 1000, 0o40700, 1000).is_ok());
        assert!(check_writable_root(p, 1000, 0o40755, 1000).is_ok());
        let e = check_writable_root(p, 0, 0o40700, 1000).unwrap_err();
        assert!(e.to_string().contains("/ckpt is owned by uid 0"), "{e}");
        for mode in [0o40770, 0o40707, 0o41777] {
            let e = check_writable_root(p, 1000, mode, 1000).unwrap_err();
            assert!(e.to_string().contains("/ckpt has mode"), "{e}");
        }
    }

    #[test]
    fn step_dirs_go_by_name_and_steps_by_index() {
        let t = tempfile::tempdir().unwrap();
        let root = LocalStorage::open(t.path()).unwrap();
        let dir = |s: u64| t.path().join(step_dir_name(s));
        for s in [3, 7, 9] {
            fs::create_dir(dir(s)).unwrap();
        }
        fs::write(dir(3).join(INDEX_FILE_NAME), b"{}").unwrap();
        fs::write(dir(7).join(INDEX_FILE_NAME), b"{}").unwrap();
        // Step 9's index is gone (damage); step 11 is a file, step 12 a
        // symlink to a step directory, neither a step directory.
        fs::write(dir(11), b"junk").unwrap();
        std::os::unix::fs::symlink(dir(7), dir(12)).unwrap();
        fs::create_dir(t.path().join(".pending-000000000013-x")).unwrap();
        assert_eq!(root.steps().unwrap(), vec![3, 7]);
        assert_eq!(root.step_dirs().unwrap(), vec![3, 7, 9]);
        let missing = root.read_index(9).unwrap_err();
        assert_eq!(missing.kind(), crate::ErrorKind::Corrupt, "{missing}");
    }

    #[test]
    fn exchange_swaps_directories() {
        let t = tempfile::tempdir().unwrap();
        let a = t.path().join("a");
        let b = t.path().join("b");
        fs::create_dir(&a).unwrap();
        fs::create_dir(&b).unwrap();
        fs::write(a.join("x"), b"a").unwrap();
        fs::write(b.join("x"), b"b").unwrap();
        exchange(&a, &b).unwrap();
        assert_eq!(fs::read(a.join("x")).unwrap(), b"b");
        assert_eq!(fs::read(b.join("x")).unwrap(), b"a");
    }
}
