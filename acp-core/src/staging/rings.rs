//! Every ring of this user on the node, seen from outside: found by the
//! names of their slot files ([`super::dir`] owns the naming), probed for
//! a live holder with a non-blocking `flock`, and removed only while held
//! here, so that no process can open a ring while it is being removed.
//!
//! A ring is live while a process holds the `flock` of any of its slot
//! files ([`Ring::open`](super::Ring::open) locks every one for the life
//! of the ring). [`RingFiles::hold`] takes the same exclusive locks,
//! without waiting: it fails at the first file held elsewhere, and while
//! the returned [`HeldRing`] lives, a [`Ring::open`](super::Ring::open) of
//! that job and rank is refused as busy rather than recovering files that
//! are about to be unlinked.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};

use super::dir::{parse_ring_name, SlotDir};
use super::origin::{read_origin, Origin};
use super::peek::{peek_file, SlotPeek};

/// The slot files of one ring (one job and rank) found in the per-user
/// directory.
#[derive(Debug, Clone)]
pub struct RingFiles {
    dir: Arc<SlotDir>,
    /// The ring's name prefix, `acp-{16 hex}-r{rank:05}` (or a replica
    /// ring's, [`replica_prefix`](super::replica_prefix)).
    pub prefix: String,
    /// The rank its names say: whose images it holds.
    pub rank: u32,
    /// For a replica ring (another node's copy of `rank`'s images), the
    /// rank that keeps it; `None` for `rank`'s own ring.
    pub held_by: Option<u32>,
    /// Its slot files, by slot index: (index, file name).
    slots: Vec<(usize, String)>,
}

/// One slot file of a ring, opened and read at one instant.
#[derive(Debug)]
pub struct SlotSeen {
    /// The slot index.
    pub slot: usize,
    /// Its path.
    pub path: PathBuf,
    /// The control block, `None` when it holds none.
    pub peek: Option<SlotPeek>,
    /// The origin record (empty when absent or another job's).
    pub origin: Origin,
    /// Size of the file: the shared memory it holds.
    pub file_bytes: u64,
    /// When its file last changed.
    pub modified: Option<SystemTime>,
    file: File,
}

/// A ring whose every slot file this process holds with an exclusive
/// `flock`: no live process has it open, and none can open it until this
/// is dropped.
#[derive(Debug)]
pub struct HeldRing {
    dir: Arc<SlotDir>,
    /// The ring's prefix.
    pub prefix: String,
    /// Its slot files, read while held.
    pub slots: Vec<SlotSeen>,
}

/// Every ring of this user under `shm_dir`, by prefix; none when the
/// per-user directory does not exist.
///
/// # Errors
/// An untrustworthy per-user directory (see [`SlotDir::open`]);
/// [`Error::Io`] listing it.
pub fn rings(shm_dir: &Path) -> Result<Vec<RingFiles>> {
    let Some(dir) = SlotDir::open(shm_dir)? else {
        return Ok(Vec::new());
    };
    let dir = Arc::new(dir);
    let rd = std::fs::read_dir(dir.path()).map_err(|e| Error::io("list", dir.path(), e))?;
    let mut by_prefix: BTreeMap<String, RingFiles> = BTreeMap::new();
    for ent in rd.flatten() {
        let Some(name) = ent.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        let Some(parsed) = parse_ring_name(&name) else {
            continue;
        };
        by_prefix
            .entry(parsed.prefix.clone())
            .or_insert_with(|| RingFiles {
                dir: Arc::clone(&dir),
                prefix: parsed.prefix,
                rank: parsed.rank,
                held_by: parsed.holder,
                slots: Vec::new(),
            })
            .slots
            .push((parsed.slot, name));
    }
    let mut out: Vec<RingFiles> = by_prefix.into_values().collect();
    for r in &mut out {
        r.slots.sort_unstable();
    }
    Ok(out)
}

impl RingFiles {
    /// The per-user directory that holds it.
    #[must_use]
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Opens and reads its slot files (a file gone meanwhile, or not a
    /// regular file of this user, is left out).
    ///
    /// # Errors
    /// [`Error::Io`].
    pub fn read(&self) -> Result<Vec<SlotSeen>> {
        let mut out = Vec::with_capacity(self.slots.len());
        for (slot, name) in &self.slots {
            let path = self.dir.path().join(name);
            let Some(file) = self.dir.open_read(name)? else {
                continue;
            };
            let meta = file.metadata().map_err(|e| Error::io("stat", &path, e))?;
            let peek = peek_file(&file, &path)?;
            let origin = peek
                .as_ref()
                .map(|p| read_origin(&file, &p.job_tag))
                .unwrap_or_default();
            out.push(SlotSeen {
                slot: *slot,
                path,
                peek,
                origin,
                file_bytes: meta.len(),
                modified: meta.modified().ok(),
                file,
            });
        }
        Ok(out)
    }

    /// Whether a live process holds the ring: a non-blocking probe of each
    /// slot file's `flock` (taken and given back at once). The pid its
    /// control blocks name as the last owner, when one is held.
    ///
    /// # Errors
    /// As [`RingFiles::read`]; [`Error::Io`] from `flock`.
    pub fn holder(&self) -> Result<Option<u32>> {
        for seen in self.read()? {
            match try_lock(&seen.file) {
                Ok(true) => unlock(&seen.file),
                Ok(false) => return Ok(Some(seen.peek.map_or(0, |p| p.owner_pid))),
                Err(e) => return Err(Error::io("flock", &seen.path, e)),
            }
        }
        Ok(None)
    }

    /// Takes the exclusive `flock` of every slot file without waiting.
    /// `Ok(Err(pid))` when a live process holds one (the pid its control
    /// block names, `0` if none).
    ///
    /// # Errors
    /// As [`RingFiles::read`]; [`Error::Io`] from `flock`.
    pub fn hold(&self) -> Result<std::result::Result<HeldRing, u32>> {
        let mut slots = self.read()?;
        #[cfg(test)]
        tests::between_read_and_lock(self);
        for seen in &slots {
            match try_lock(&seen.file) {
                Ok(true) => {}
                // The locks taken so far go with their files when `slots`
                // is dropped.
                Ok(false) => return Ok(Err(seen.peek.as_ref().map_or(0, |p| p.owner_pid))),
                Err(e) => return Err(Error::io("flock", &seen.path, e)),
            }
        }
        // Read again under the locks: a process that held the ring until
        // after the first read may have left other images in it (a step
        // sealed just before it died), and the ring is judged by these.
        for seen in &mut slots {
            seen.reread()?;
        }
        Ok(Ok(HeldRing {
            dir: Arc::clone(&self.dir),
            prefix: self.prefix.clone(),
            slots,
        }))
    }
}

impl HeldRing {
    /// Unlinks its slot files (their memory is freed once no mapping is
    /// left), then the per-user directory when it is empty and no ring
    /// holds it. Returns the bytes freed.
    ///
    /// A name that no longer refers to the file held (unlinked and made
    /// again between the look and the lock: the ring released by its
    /// process, then opened by a new one) is left alone: it is another
    /// ring's file now, possibly live.
    ///
    /// # Errors
    /// [`Error::Io`] naming the file that could not be unlinked (the
    /// others are still removed).
    pub fn remove(self) -> Result<u64> {
        let mut freed = 0;
        let mut first_err = None;
        for seen in &self.slots {
            let Some(name) = seen.path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            match self.holds_name(seen, name) {
                Ok(true) => {}
                Ok(false) => {
                    tracing::info!(
                        "acp: {} is another file than the one held; left alone",
                        seen.path.display()
                    );
                    continue;
                }
                Err(e) => {
                    first_err.get_or_insert(e);
                    continue;
                }
            }
            match self.dir.unlink(name) {
                Ok(()) => freed += seen.file_bytes,
                Err(e) => {
                    if first_err.is_none() {
                        first_err = Some(Error::io("unlink", &seen.path, e));
                    }
                }
            }
        }
        drop(self.slots);
        self.dir.remove_if_unused();
        first_err.map_or(Ok(freed), Err)
    }
}

impl HeldRing {
    /// Whether `name` in the directory is the file `seen` holds (same
    /// device and inode). Nothing but a holder of a file's lock unlinks
    /// it, so while held it stays at its name once it is found there.
    fn holds_name(&self, seen: &SlotSeen, name: &str) -> Result<bool> {
        let held = seen
            .file
            .metadata()
            .map_err(|e| Error::io("stat", &seen.path, e))?;
        let Some(at_name) = self.dir.open_read(name)? else {
            return Ok(false);
        };
        let now = at_name
            .metadata()
            .map_err(|e| Error::io("stat", &seen.path, e))?;
        Ok(held.nlink() > 0 && (held.dev(), held.ino()) == (now.dev(), now.ino()))
    }
}

impl SlotSeen {
    /// Reads its file's control block, origin, size and time again.
    fn reread(&mut self) -> Result<()> {
        let meta = self
            .file
            .metadata()
            .map_err(|e| Error::io("stat", &self.path, e))?;
        self.peek = peek_file(&self.file, &self.path)?;
        self.origin = self
            .peek
            .as_ref()
            .map(|p| read_origin(&self.file, &p.job_tag))
            .unwrap_or_default();
        self.file_bytes = meta.len();
        self.modified = meta.modified().ok();
        Ok(())
    }

    /// How long ago its file last changed, zero when unknown or in the future.
    #[must_use]
    pub fn age(&self) -> Duration {
        self.modified
            .and_then(|m| m.elapsed().ok())
            .unwrap_or_default()
    }
}

/// `flock(LOCK_EX | LOCK_NB)`: `Ok(false)` when another open file holds it.
fn try_lock(file: &File) -> io::Result<bool> {
    loop {
        // SAFETY: `flock` reads no memory of ours; the descriptor is valid
        // for the call because `file` is borrowed.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc == 0 {
            return Ok(true);
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EWOULDBLOCK) => return Ok(false),
            Some(libc::EINTR) => {}
            _ => return Err(e),
        }
    }
}

fn unlock(file: &File) {
    // SAFETY: as in `try_lock`.
    let _ = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;
    use crate::staging::{Ring, RingOptions, SlotState};

    type Hook = Box<dyn FnMut(&RingFiles)>;

    thread_local! {
        /// Run by [`RingFiles::hold`] between its read and its locks.
        static BETWEEN: RefCell<Option<Hook>> = RefCell::new(None);
    }

    pub(super) fn between_read_and_lock(ring: &RingFiles) {
        BETWEEN.with(|h| {
            if let Some(f) = h.borrow_mut().as_mut() {
                f(ring);
            }
        });
    }

    fn options(dir: &Path) -> RingOptions {
        RingOptions {
            dir: dir.to_path_buf(),
            prefix: "acp-0000000000000000-r00000".to_owned(),
            job_tag: [7; 32],
            rank: 0,
            slots: 1,
            budget: 1 << 20,
            shared_budget: false,
            chunk_bytes: 1 << 16,
            mlock: false,
        }
    }

    /// A ring whose one slot holds `step`, in `state`, closed.
    fn left(dir: &Path, step: u64, state: SlotState) {
        let (ring, _) = Ring::open(options(dir)).unwrap();
        let mut slot = ring.acquire(4096, None).unwrap().unwrap();
        slot.image_mut()[..4096].fill(u8::try_from(step).unwrap());
        let pin = slot.seal(step, 4096);
        let at = pin.slot();
        drop(pin);
        ring.set_state(at, state);
    }

    #[test]
    fn a_held_ring_is_judged_by_what_its_files_hold_under_the_locks() {
        let tmp = tempfile::tempdir().unwrap();
        left(tmp.path(), 1, SlotState::Persisted);
        let found = rings(tmp.path()).unwrap().remove(0);
        // Its process was live at the look, sealed step 2 (persisted
        // nowhere) and died before the locks were taken.
        let dir = tmp.path().to_path_buf();
        BETWEEN.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |_: &RingFiles| {
                left(&dir, 2, SlotState::Resident);
            }));
        });
        let held = found.hold();
        BETWEEN.with(|h| h.borrow_mut().take());
        let held = held.unwrap().unwrap();
        let peek = held.slots[0].peek.clone().unwrap();
        assert_eq!(
            (peek.step, peek.state),
            (2, Some(SlotState::Resident)),
            "judged by the image the files hold once held"
        );
    }
}
