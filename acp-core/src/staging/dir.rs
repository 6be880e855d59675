//! Where slot files live and what they are called: the one place that
//! names them, and the per-user directory that holds them.
//!
//! Slot `i` of rank `r` of job `j` is
//! `{shm_dir}/acp-u{euid}/acp-{16 hex of blake3(j)}-r{r:05}-s{i}`. The
//! per-user directory is created mode `0700` and trusted only when the
//! descriptor opened on it (`O_DIRECTORY | O_NOFOLLOW`) is a directory
//! owned by the effective uid with mode exactly `0700`: nobody else can
//! then create, replace or remove a name in it, so the predictable slot
//! names cannot be squatted by another local user of a shared, sticky
//! `shm_dir`. Slot files are opened relative to that descriptor
//! (`openat`, `O_NOFOLLOW | O_CLOEXEC`, created `0600`) and trusted only
//! when `fstat` of the opened file says a regular file owned by the
//! effective uid (root may still plant one: the engine refuses it, every
//! tool ignores it).
//!
//! A ring holds a shared `flock` on the directory until it unlinks its
//! slot files; [`SlotDir::remove_if_unused`] then removes the directory
//! only under an exclusive one and only when empty, and a ring that finds
//! the directory removed under it (link count 0 once it holds its lock)
//! makes it again. So an emptied directory disappears and a ring being
//! opened never loses its directory.

use std::ffi::CString;
use std::fs::{DirBuilder, File, OpenOptions, Permissions};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{hex, Digest};

use super::slot::euid;

/// The name of the per-user directory in `shm_dir`: `acp-u{euid}`.
#[must_use]
pub fn user_dir_name() -> String {
    format!("acp-u{}", euid())
}

/// The per-user directory that holds this user's slot files under `shm_dir`.
#[must_use]
pub fn user_dir(shm_dir: &Path) -> PathBuf {
    shm_dir.join(user_dir_name())
}

/// The job id of an engine on `root` (its canonical path) configured with
/// `job`: `job` when given, else the root path. Slot names and the job tag
/// derive from it.
#[must_use]
pub fn job_id(root: &Path, job: Option<&str>) -> String {
    job.map_or_else(|| root.to_string_lossy().into_owned(), str::to_owned)
}

/// The job tag stored in every control block: blake3 of the job id.
#[must_use]
pub fn job_tag(job: &str) -> Digest {
    *blake3::hash(job.as_bytes()).as_bytes()
}

/// The slot file prefix of `job` and `rank`: `acp-{16 hex of
/// blake3(job)}-r{rank:05}`.
#[must_use]
pub fn ring_prefix(job: &str, rank: u32) -> String {
    format!("{}r{rank:05}", job_stem(job))
}

/// `acp-{16 hex of blake3(job)}-`: what every slot name of `job` starts with.
fn job_stem(job: &str) -> String {
    format!("acp-{}-", &hex(&job_tag(job))[..16])
}

/// The prefix of the replica ring that rank `holder` keeps of rank
/// `rank`'s images of `job`: `acp-{16 hex of blake3(job)}-replica-r{rank:05}-on-r{holder:05}`.
/// Its slots are `{prefix}-s{i}`, like a rank's own; an own-slot parser
/// never takes them for `rank`'s own (the part after the job's stem does
/// not start with `r` and digits), and `parse_replica_name` reads them.
/// Their control blocks record `rank` (the image's rank), so a reader of
/// another slot on this node ([`PeerSlot`](super::PeerSlot)) can use
/// them as it uses `rank`'s own.
#[must_use]
pub fn replica_prefix(job: &str, rank: u32, holder: u32) -> String {
    format!("{}replica-r{rank:05}-on-r{holder:05}", job_stem(job))
}

/// `{stem}replica-r{rank:05}-on-r{holder:05}-s{slot}` → (rank, holder, slot).
fn parse_replica_name(name: &str, stem: &str) -> Option<(u32, u32, usize)> {
    let rest = name.strip_prefix(stem)?.strip_prefix("replica-r")?;
    let (rank, rest) = rest.split_once("-on-r")?;
    let (holder, slot) = rest.split_once("-s")?;
    let digits = |s: &str, min: usize| s.len() >= min && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(rank, 5) || !digits(holder, 5) || !digits(slot, 1) {
        return None;
    }
    Some((rank.parse().ok()?, holder.parse().ok()?, slot.parse().ok()?))
}

/// The file name of slot `slot` of the ring named `prefix`: `{prefix}-s{slot}`.
#[must_use]
pub fn slot_file_name(prefix: &str, slot: usize) -> String {
    format!("{prefix}-s{slot}")
}

/// The path of slot `slot` of the ring named `prefix` under `shm_dir`.
#[must_use]
pub fn slot_path(shm_dir: &Path, prefix: &str, slot: usize) -> PathBuf {
    user_dir(shm_dir).join(slot_file_name(prefix, slot))
}

/// `{stem}r{rank:05}-s{slot}` → (rank, slot).
fn parse_slot_name(name: &str, stem: &str) -> Option<(u32, usize)> {
    let rest = name.strip_prefix(stem)?.strip_prefix('r')?;
    let (rank, slot) = rest.split_once("-s")?;
    if rank.len() < 5 || !rank.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if slot.is_empty() || !slot.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((rank.parse().ok()?, slot.parse().ok()?))
}

/// A ring's slot file name, parsed ([`parse_ring_name`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RingName {
    /// The ring's prefix (the name without `-s{slot}`).
    pub(super) prefix: String,
    /// The rank whose images it holds.
    pub(super) rank: u32,
    /// For a replica ring, the rank that holds it ([`replica_prefix`]).
    pub(super) holder: Option<u32>,
    /// The slot index.
    pub(super) slot: usize,
}

/// `acp-{16 hex}-r{rank:05}-s{slot}` (a rank's own ring) or
/// `acp-{16 hex}-replica-r{rank:05}-on-r{holder:05}-s{slot}` (a replica
/// ring): any ring's slot file, whatever its job.
pub(super) fn parse_ring_name(name: &str) -> Option<RingName> {
    let hex = name.strip_prefix("acp-")?.get(..16)?;
    if !hex
        .bytes()
        .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
    {
        return None;
    }
    let stem = format!("acp-{hex}-");
    let (rank, holder, slot) = match parse_slot_name(name, &stem) {
        Some((rank, slot)) => (rank, None, slot),
        None => {
            let (rank, holder, slot) = parse_replica_name(name, &stem)?;
            (rank, Some(holder), slot)
        }
    };
    let prefix = name.rsplit_once("-s")?.0.to_owned();
    Some(RingName {
        prefix,
        rank,
        holder,
        slot,
    })
}

/// The trusted per-user slot directory, held open.
#[derive(Debug)]
pub struct SlotDir {
    fd: File,
    path: PathBuf,
}

impl SlotDir {
    /// Opens the per-user directory under `shm_dir`, creating it (mode
    /// `0700`) when absent, and takes a shared `flock` on it that lasts as
    /// long as the returned handle.
    ///
    /// # Errors
    /// [`Error::Busy`] when the name is taken by another user's file,
    /// symlink or directory; [`Error::Invalid`] when it is this user's
    /// symlink, file, or directory with another mode than `0700`;
    /// [`Error::Io`].
    pub fn create(shm_dir: &Path) -> Result<SlotDir> {
        let path = user_dir(shm_dir);
        // A try finds the directory removed under it only when a
        // `remove_if_unused` ran between its `mkdir` and its lock.
        for _ in 0..8 {
            let made = match DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => true,
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => false,
                Err(e) => return Err(Error::io("create directory", &path, e)),
            };
            let dir = match Self::open_verified(&path, made) {
                Ok(Some(d)) => d,
                Ok(None) => continue, // removed between mkdir and open
                Err(e) => return Err(e),
            };
            flock(&dir.fd, libc::LOCK_SH).map_err(|e| Error::io("flock", &path, e))?;
            let meta = dir.fd.metadata().map_err(|e| Error::io("stat", &path, e))?;
            if meta.nlink() > 0 {
                return Ok(dir);
            }
        }
        Err(Error::Busy {
            what: path.display().to_string(),
            reason: "removed again at every try while opening it".to_owned(),
        })
    }

    /// Opens the per-user directory under `shm_dir` for reading its slots,
    /// without creating it or locking it; `Ok(None)` when it does not exist.
    ///
    /// # Errors
    /// As [`SlotDir::create`].
    pub fn open(shm_dir: &Path) -> Result<Option<SlotDir>> {
        Self::open_verified(&user_dir(shm_dir), false)
    }

    /// Opens `path` as the per-user directory and checks it; `Ok(None)`
    /// when absent. `made`: this process just created it, so a mode
    /// narrowed by the umask is set to `0700`.
    fn open_verified(path: &Path, made: bool) -> Result<Option<SlotDir>> {
        let fd = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(e) if matches!(e.raw_os_error(), Some(libc::ELOOP | libc::ENOTDIR)) => {
                return Err(untrusted(path, std::fs::symlink_metadata(path).ok()));
            }
            Err(e) => return Err(Error::io("open directory", path, e)),
        };
        let meta = fd.metadata().map_err(|e| Error::io("stat", path, e))?;
        if !meta.is_dir() || meta.uid() != euid() {
            return Err(untrusted(path, Some(meta)));
        }
        if meta.mode() & 0o7777 != 0o700 {
            if !made {
                return Err(untrusted(path, Some(meta)));
            }
            fd.set_permissions(Permissions::from_mode(0o700))
                .map_err(|e| Error::io("chmod", path, e))?;
        }
        Ok(Some(SlotDir {
            fd,
            path: path.to_path_buf(),
        }))
    }

    /// The directory's path.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Opens (creating, mode `0600`) the slot file `name` read-write,
    /// relative to this directory, without following a symlink.
    ///
    /// # Errors
    /// [`Error::Busy`] for a file owned by another user; [`Error::Invalid`]
    /// for one that is not a regular file; [`Error::Io`].
    pub(super) fn open_rw(&self, name: &str) -> Result<File> {
        let path = self.path.join(name);
        let file = self
            .openat(
                name,
                libc::O_RDWR | libc::O_CREAT | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
            .map_err(|e| Error::io("open", &path, e))?;
        let meta = file.metadata().map_err(|e| Error::io("stat", &path, e))?;
        if meta.uid() != euid() {
            return Err(Error::Busy {
                what: path.display().to_string(),
                reason: format!(
                    "owned by uid {}, not by this user (uid {}); remove it",
                    meta.uid(),
                    euid()
                ),
            });
        }
        if !meta.is_file() {
            return Err(Error::invalid(
                path.display(),
                "ring slot is not a regular file",
            ));
        }
        Ok(file)
    }

    /// Opens the slot file `name` read-only, relative to this directory,
    /// without following a symlink and without blocking on a FIFO.
    /// `Ok(None)` when it is absent, not a regular file, not owned by the
    /// effective uid or not readable by it: such a file is ignored.
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn open_read(&self, name: &str) -> Result<Option<File>> {
        let path = self.path.join(name);
        let file = match self.openat(
            name,
            libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC,
        ) {
            Ok(f) => f,
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT | libc::ELOOP | libc::ENXIO)
                ) =>
            {
                return Ok(None);
            }
            // Not this user's to open (another user's file, which only root
            // can put here, or one made unreadable): ignored like a file of
            // another user, not an error that stops every ring's listing.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) => {
                tracing::debug!("acp: {} ignored: {e}", path.display());
                return Ok(None);
            }
            Err(e) => return Err(Error::io("open", &path, e)),
        };
        let meta = file.metadata().map_err(|e| Error::io("stat", &path, e))?;
        if !meta.is_file() || meta.uid() != euid() {
            tracing::debug!(
                "acp: {} ignored: not a regular file of this user (uid {}, owner {})",
                path.display(),
                euid(),
                meta.uid()
            );
            return Ok(None);
        }
        Ok(Some(file))
    }

    fn openat(&self, name: &str, flags: libc::c_int) -> io::Result<File> {
        let c = plain_name(name)?;
        // SAFETY: `c` is a NUL-terminated string that outlives the call;
        // the directory descriptor is valid because `self.fd` is borrowed;
        // the mode argument is read only with `O_CREAT`.
        let fd = unsafe { libc::openat(self.fd.as_raw_fd(), c.as_ptr(), flags, 0o600) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `openat` just returned this descriptor, open and owned by
        // nobody else.
        Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Removes the slot file `name` (absent is not an error).
    ///
    /// # Errors
    /// The `unlinkat` error.
    pub(super) fn unlink(&self, name: &str) -> io::Result<()> {
        let c = plain_name(name)?;
        // SAFETY: as in `openat`: a valid string and a borrowed descriptor.
        let rc = unsafe { libc::unlinkat(self.fd.as_raw_fd(), c.as_ptr(), 0) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::NotFound {
            Ok(())
        } else {
            Err(e)
        }
    }

    /// Gives up the caller's hold on the directory (its slot files are
    /// gone) and removes the directory if it is empty and no other ring
    /// holds it: under an exclusive `flock` taken without waiting, so a
    /// ring being opened either keeps it or makes it again. Failing is
    /// harmless and silent.
    pub(super) fn remove_if_unused(&self) {
        if flock(&self.fd, libc::LOCK_EX | libc::LOCK_NB).is_ok() {
            match std::fs::remove_dir(&self.path) {
                Ok(()) => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY | libc::EEXIST)) => {}
                Err(e) => tracing::debug!("acp: rmdir {}: {e}", self.path.display()),
            }
        }
        let _ = flock(&self.fd, libc::LOCK_UN);
    }

    /// The slot names of `job` in this directory (every rank, or only
    /// `rank`), by rank then slot.
    ///
    /// # Errors
    /// [`Error::Io`] listing the directory.
    pub fn slots_of(self: &Arc<Self>, job: &str, rank: Option<u32>) -> Result<Vec<SlotFile>> {
        let stem = job_stem(job);
        self.list(|name| {
            let (r, slot) = parse_slot_name(name, &stem)?;
            rank.is_none_or(|want| want == r).then_some((r, None, slot))
        })
    }

    /// The replica slot names of `job` in this directory ([`replica_prefix`]:
    /// other ranks' images kept for `rank`, every rank or only `rank`),
    /// by rank, holder, then slot.
    ///
    /// # Errors
    /// [`Error::Io`] listing the directory.
    pub fn replicas_of(self: &Arc<Self>, job: &str, rank: Option<u32>) -> Result<Vec<SlotFile>> {
        let stem = job_stem(job);
        self.list(|name| {
            let (r, holder, slot) = parse_replica_name(name, &stem)?;
            rank.is_none_or(|want| want == r)
                .then_some((r, Some(holder), slot))
        })
    }

    /// The files of this directory that `pick` recognises from their name
    /// (rank, holder, slot), by rank, holder, then slot.
    fn list(
        self: &Arc<Self>,
        pick: impl Fn(&str) -> Option<(u32, Option<u32>, usize)>,
    ) -> Result<Vec<SlotFile>> {
        // Listed by path: only names come from it, and each is then opened
        // relative to the checked descriptor.
        let rd = std::fs::read_dir(&self.path).map_err(|e| Error::io("list", &self.path, e))?;
        let mut out: Vec<SlotFile> = rd
            .flatten()
            .filter_map(|ent| {
                let name = ent.file_name().to_str()?.to_owned();
                let (rank, holder, slot) = pick(&name)?;
                Some(SlotFile {
                    dir: Arc::clone(self),
                    name,
                    rank,
                    holder,
                    slot,
                })
            })
            .collect();
        out.sort_by_key(|s| (s.rank, s.holder, s.slot));
        Ok(out)
    }
}

/// One slot file of a job found in the per-user directory.
#[derive(Debug, Clone)]
pub struct SlotFile {
    dir: Arc<SlotDir>,
    name: String,
    /// The rank its name says: whose images it holds.
    pub rank: u32,
    /// For a replica slot, the rank that keeps it ([`replica_prefix`]);
    /// `None` for `rank`'s own slot.
    pub holder: Option<u32>,
    /// The slot index its name says.
    pub slot: usize,
}

impl SlotFile {
    /// Its path, for messages.
    #[must_use]
    pub fn path(&self) -> PathBuf {
        self.dir.path.join(&self.name)
    }

    /// Opens it read-only; `Ok(None)` when it is gone or is not a regular
    /// file of this user (see [`SlotDir::open_read`]).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn open(&self) -> Result<Option<File>> {
        self.dir.open_read(&self.name)
    }
}

/// The slot files of `job` under `shm_dir` (every rank, or only `rank`), by
/// rank then slot; none when the per-user directory does not exist.
///
/// # Errors
/// As [`SlotDir::open`]; [`Error::Io`] listing it.
pub fn slot_files(shm_dir: &Path, job: &str, rank: Option<u32>) -> Result<Vec<SlotFile>> {
    match SlotDir::open(shm_dir)? {
        Some(dir) => Arc::new(dir).slots_of(job, rank),
        None => Ok(Vec::new()),
    }
}

/// The replica slot files of `job` under `shm_dir` (of every rank's
/// images, or only `rank`'s), by rank, holder, then slot; none when the
/// per-user directory does not exist.
///
/// # Errors
/// As [`SlotDir::open`]; [`Error::Io`] listing it.
pub fn replica_files(shm_dir: &Path, job: &str, rank: Option<u32>) -> Result<Vec<SlotFile>> {
    match SlotDir::open(shm_dir)? {
        Some(dir) => Arc::new(dir).replicas_of(job, rank),
        None => Ok(Vec::new()),
    }
}

/// A file name as a C string; refuses a path (a `/`), `.`, `..` and NUL.
fn plain_name(name: &str) -> io::Result<CString> {
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("`{name}` is not a plain file name"),
        ));
    }
    CString::new(Path::new(name).as_os_str().as_bytes())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

fn flock(fd: &File, op: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: `flock` reads no memory of ours; the descriptor is valid
        // for the call because `fd` is borrowed.
        let rc = unsafe { libc::flock(fd.as_raw_fd(), op) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// The error for a per-user directory that cannot be trusted.
fn untrusted(path: &Path, meta: Option<std::fs::Metadata>) -> Error {
    let me = euid();
    let what = match &meta {
        Some(m) if m.file_type().is_symlink() => format!("a symlink owned by uid {}", m.uid()),
        Some(m) if !m.is_dir() => format!("not a directory (owned by uid {})", m.uid()),
        Some(m) if m.uid() != me => format!("a directory owned by uid {}", m.uid()),
        Some(m) => format!("a directory with mode {:o}", m.mode() & 0o7777),
        None => "not a directory".to_owned(),
    };
    let reason = format!(
        "{what}, not this user's (uid {me}) private directory (mode 700) of ring slots; \
         remove it, or set `shm_dir` (`--shm-dir`) to another directory"
    );
    if meta.as_ref().is_some_and(|m| m.uid() != me) {
        Error::Busy {
            what: path.display().to_string(),
            reason,
        }
    } else {
        Error::invalid(path.display(), reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_names_parse() {
        let stem = job_stem("j");
        assert_eq!(stem.len(), 21);
        assert_eq!(
            parse_slot_name(&format!("{stem}r00003-s1"), &stem),
            Some((3, 1))
        );
        assert_eq!(parse_slot_name(&format!("{stem}r00003-s"), &stem), None);
        assert_eq!(parse_slot_name(&format!("{stem}r3-s1"), &stem), None);
        assert_eq!(
            parse_slot_name("acp-0000000000000000-r00000-s0", &stem),
            None
        );
        assert_eq!(ring_prefix("j", 7).len(), 27);
        assert!(ring_prefix("j", 7).ends_with("-r00007"));
        let p = slot_path(Path::new("/s"), &ring_prefix("j", 7), 2);
        assert_eq!(
            p,
            Path::new("/s")
                .join(user_dir_name())
                .join(format!("{}-s2", ring_prefix("j", 7)))
        );
    }

    #[test]
    fn replica_names_are_not_own_slots() {
        let stem = job_stem("j");
        let prefix = replica_prefix("j", 3, 7);
        let name = slot_file_name(&prefix, 1);
        assert!(name.contains("-replica-r00003-on-r00007-s1"), "{name}");
        assert_eq!(parse_slot_name(&name, &stem), None);
        assert_eq!(parse_replica_name(&name, &stem), Some((3, 7, 1)));
        assert_eq!(
            parse_ring_name(&name),
            Some(RingName {
                prefix: prefix.clone(),
                rank: 3,
                holder: Some(7),
                slot: 1
            })
        );
        let own = slot_file_name(&ring_prefix("j", 3), 1);
        assert_eq!(parse_replica_name(&own, &stem), None);
        for bad in [
            format!("{stem}replica-r3-on-r00007-s1"),
            format!("{stem}replica-r00003-on-r00007-s"),
            format!("{stem}replica-r00003-on-r7-s1"),
            format!("{stem}replica-r00003-s1"),
        ] {
            assert_eq!(parse_ring_name(&bad), None, "{bad}");
        }
    }

    #[test]
    fn any_ring_name_parses() {
        let prefix = ring_prefix("some job", 12);
        assert_eq!(
            parse_ring_name(&slot_file_name(&prefix, 3)),
            Some(RingName {
                prefix: prefix.clone(),
                rank: 12,
                holder: None,
                slot: 3
            })
        );
        assert_eq!(parse_ring_name(&prefix), None);
        assert_eq!(parse_ring_name("acp-0123456789ABCDEF-r00000-s0"), None);
        assert_eq!(parse_ring_name("acp-0123-r00000-s0"), None);
        assert_eq!(parse_ring_name("other-file"), None);
    }

    #[test]
    fn plain_names_only() {
        for bad in ["", ".", "..", "a/b", "/abs", "nul\0"] {
            assert!(plain_name(bad).is_err(), "{bad:?}");
        }
        assert!(plain_name("acp-x-s0").is_ok());
    }
}
