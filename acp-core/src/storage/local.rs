//! The checkpoint root on a local or shared POSIX file system: step
//! directories, durable small files, renames and directory syncs.
//!
//! Every operation that the commit protocol depends on goes through here,
//! so the fault injector sees each one.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::format::{Index, INDEX_FILE_NAME};
use crate::storage::faults::{check, FaultInjector};

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

/// A checkpoint root directory.
#[derive(Debug, Clone)]
pub struct Root {
    path: PathBuf,
    faults: Option<std::sync::Arc<FaultInjector>>,
    /// `r{rank:05}-{job tag}`: marks the temporary directories this engine
    /// creates, so that it sweeps only its own job's and rank's leftovers.
    owner: String,
}

impl Root {
    /// Opens `path` to write checkpoints to, creating it (mode 0700) when
    /// missing. An existing root must be owned by this process's effective
    /// user and writable by nobody else: whoever else can write to it could
    /// swap step directories and data files under the engine.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be created or is not a directory;
    /// [`Error::Config`] (field `root`) naming the path when another user
    /// owns it or its group or others may write to it.
    pub fn open(path: &Path, faults: Option<std::sync::Arc<FaultInjector>>) -> Result<Root> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(path)
            .map_err(|e| Error::io("create directory", path, e))?;
        let path = fs::canonicalize(path).map_err(|e| Error::io("resolve", path, e))?;
        let meta = fs::metadata(&path).map_err(|e| Error::io("stat", &path, e))?;
        check_writable_root(&path, meta.uid(), meta.mode(), euid())?;
        Ok(Root {
            path,
            faults,
            owner: "r00000-any".to_owned(),
        })
    }

    /// Marks this root's temporary directories as those of `rank` of the
    /// job whose tag is `job_tag` (a few hex digits).
    #[must_use]
    pub fn owned_by(mut self, rank: u32, job_tag: &str) -> Root {
        self.owner = format!("r{rank:05}-{job_tag}");
        self
    }

    /// Opens an existing root without creating it, to read from. Unlike
    /// [`Root::open`], the root may belong to another user (a checkpoint
    /// downloaded or shared read-only): reads still never leave it.
    ///
    /// # Errors
    /// [`Error::NotFound`] when it does not exist.
    pub fn open_existing(path: &Path) -> Result<Root> {
        let path = fs::canonicalize(path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound {
                    what: format!("checkpoint root {}", path.display()),
                }
            } else {
                Error::io("resolve", path, e)
            }
        })?;
        Ok(Root {
            path,
            faults: None,
            owner: "r00000-any".to_owned(),
        })
    }

    /// The canonical path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, op: &'static str, path: &Path) -> Result<()> {
        check(self.faults.as_deref(), op, path).map_err(|e| Error::io(op, path, e))
    }

    /// The directory of committed step `step`.
    #[must_use]
    pub fn step_dir(&self, step: u64) -> PathBuf {
        self.path.join(step_dir_name(step))
    }

    /// The committed steps, ascending: directories `step-…` that hold an index
    /// file. Symlinks are ignored.
    ///
    /// # Errors
    /// [`Error::Io`] listing the root.
    pub fn steps(&self) -> Result<Vec<u64>> {
        let rd = fs::read_dir(&self.path).map_err(|e| Error::io("list", &self.path, e))?;
        let mut steps = Vec::new();
        for ent in rd {
            let ent = ent.map_err(|e| Error::io("list", &self.path, e))?;
            let Some(step) = ent.file_name().to_str().and_then(parse_step_dir_name) else {
                continue;
            };
            let Ok(ft) = ent.file_type() else { continue };
            if !ft.is_dir() {
                continue;
            }
            let index = ent.path().join(INDEX_FILE_NAME);
            if fs::symlink_metadata(&index).is_ok_and(|m| m.is_file()) {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }

    /// Step directories (`step-…`, not symlinks) that hold no index file.
    /// The commit protocol never leaves one (the index is in place before
    /// the rename that commits), so each is a committed step whose index
    /// was lost.
    ///
    /// # Errors
    /// [`Error::Io`] listing the root.
    pub fn steps_without_index(&self) -> Result<Vec<u64>> {
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
            if fs::symlink_metadata(ent.path().join(INDEX_FILE_NAME)).is_err() {
                steps.push(step);
            }
        }
        steps.sort_unstable();
        Ok(steps)
    }

    /// Whether step `step` is committed.
    #[must_use]
    pub fn is_committed(&self, step: u64) -> bool {
        let dir = self.step_dir(step);
        fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir())
            && fs::symlink_metadata(dir.join(INDEX_FILE_NAME)).is_ok_and(|m| m.is_file())
    }

    /// Reads and validates the index of committed step `step`.
    ///
    /// # Errors
    /// [`Error::NotFound`] when the step is not committed; [`Error::Corrupt`]
    /// when its index is malformed, names another step, or is missing from
    /// an existing step directory.
    pub fn read_index(&self, step: u64) -> Result<Index> {
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

    /// Creates the root again (mode 0700, with its parents) when it was
    /// removed; returns whether it had to.
    ///
    /// # Errors
    /// [`Error::Io`] when it cannot be made.
    pub fn recreate_if_missing(&self) -> Result<bool> {
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

    /// Creates a fresh pending directory for `step` written by `rank`.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn create_pending(&self, step: u64) -> Result<PathBuf> {
        let name = format!(
            ".pending-{step:012}-{}-{}-{}",
            self.owner,
            std::process::id(),
            nonce()
        );
        let path = self.path.join(name);
        self.check("create directory", &path)?;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| Error::io("create directory", &path, e))?;
        Ok(path)
    }

    /// Creates the directory in which rank 0 assembles a multi-rank step.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn create_commit_dir(&self, step: u64) -> Result<PathBuf> {
        let path = self.path.join(format!(
            ".commit-{step:012}-{}-{}-{}",
            self.owner,
            std::process::id(),
            nonce()
        ));
        self.check("create directory", &path)?;
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| Error::io("create directory", &path, e))?;
        Ok(path)
    }

    /// The pending directories of `step` that hold a manifest, by rank
    /// (the newest one when a rank has several).
    ///
    /// # Errors
    /// [`Error::Io`] listing the root.
    pub fn reported_ranks(&self, step: u64) -> Result<std::collections::BTreeMap<u32, PathBuf>> {
        let prefix = format!(".pending-{step:012}-r");
        let job = format!("-{}-", self.owner.split_once('-').map_or("", |(_, j)| j));
        let mut found: std::collections::BTreeMap<u32, (std::time::SystemTime, PathBuf)> =
            std::collections::BTreeMap::new();
        let rd = fs::read_dir(&self.path).map_err(|e| Error::io("list", &self.path, e))?;
        for ent in rd.flatten() {
            let name = ent.file_name();
            let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&prefix)) else {
                continue;
            };
            let Some(rank) = rest.get(..5).and_then(|r| r.parse::<u32>().ok()) else {
                continue;
            };
            // Only this job's ranks (another job may share the root).
            if !rest.get(5..).is_some_and(|r| r.starts_with(&job)) {
                continue;
            }
            let manifest = ent.path().join(crate::format::manifest_file_name(rank));
            let Ok(meta) = fs::symlink_metadata(&manifest) else {
                continue;
            };
            if !meta.is_file() {
                continue;
            }
            let when = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
            if found.get(&rank).is_none_or(|(w, _)| *w < when) {
                found.insert(rank, (when, ent.path()));
            }
        }
        Ok(found.into_iter().map(|(r, (_, p))| (r, p)).collect())
    }

    /// Renames `from` to `to` (both inside the root).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn rename(&self, from: &Path, to: &Path) -> Result<()> {
        self.check("rename", to)?;
        fs::rename(from, to).map_err(|e| Error::io("rename", to, e))
    }

    /// Removes the pending, commit and trash directories that this job's
    /// rank (see [`Root::owned_by`]) left behind in a previous life (the
    /// caller holds that rank's ring lock, so no live process owns them).
    /// Returns how many were removed.
    pub fn sweep_leftovers(&self) -> usize {
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

    /// Writes `bytes` to a new file `path` (mode 0600) and fsyncs it.
    ///
    /// # Errors
    /// [`Error::Io`] / [`Error::NoSpace`].
    pub fn write_durable(&self, path: &Path, bytes: &[u8]) -> Result<()> {
        self.check("write", path)?;
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| Error::io("create", path, e))?;
        f.write_all(bytes)
            .map_err(|e| Error::io("write", path, e))?;
        self.check("fsync", path)?;
        f.sync_all().map_err(|e| Error::io("fsync", path, e))
    }

    /// Fsyncs a directory, so the names created or renamed in it are durable.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn sync_dir(&self, dir: &Path) -> Result<()> {
        self.check("fsync directory", dir)?;
        File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| Error::io("fsync directory", dir, e))
    }

    /// Publishes a fully written pending directory as committed step `step`:
    /// renames it into place (atomically exchanging it with an existing
    /// step directory when `overwrite`), then fsyncs the root. Returns the
    /// directory of the replaced step (now under a trash name), if any.
    ///
    /// # Errors
    /// [`Error::Exists`] when the step exists and `overwrite` is off;
    /// [`Error::Io`].
    pub fn publish(&self, pending: &Path, step: u64, overwrite: bool) -> Result<Option<PathBuf>> {
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
        let trash = self.path.join(format!(
            ".trash-{step:012}-{}-{}-{}",
            self.owner,
            std::process::id(),
            nonce()
        ));
        fs::rename(pending, &trash).map_err(|e| Error::io("rename", pending, e))?;
        Ok(Some(trash))
    }

    /// Records `step` as the newest committed step in the `latest` file
    /// (written under a temporary name, fsynced, renamed, root fsynced).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn write_latest(&self, step: u64) -> Result<()> {
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

    /// Removes committed step `step`: renames it out of view, fsyncs the root,
    /// then deletes it.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn remove_step(&self, step: u64) -> Result<()> {
        let dir = self.step_dir(step);
        let trash = self.path.join(format!(
            ".trash-{step:012}-{}-{}-{}",
            self.owner,
            std::process::id(),
            nonce()
        ));
        self.check("rename", &dir)?;
        fs::rename(&dir, &trash).map_err(|e| Error::io("rename", &dir, e))?;
        self.sync_dir(&self.path)?;
        fs::remove_dir_all(&trash).map_err(|e| Error::io("remove", &trash, e))
    }
}

/// Reads a small file whole (at most `limit` bytes), opened by
/// [`crate::io::open_regular`]: a symlink, a FIFO or any other non-regular
/// file is refused without blocking.
///
/// # Errors
/// [`Error::Io`]; [`Error::Corrupt`] when it is not a regular file or is
/// larger than `limit`.
pub fn read_small(path: &Path, limit: u64) -> Result<Vec<u8>> {
    use std::io::Read;
    let f = crate::io::open_regular(path)?;
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
