//! Opening a ring: slot files, locks, and recovery of what a previous
//! process left in them.

use std::fs::{File, Permissions};
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::{Condvar, Mutex};

use crate::error::{Error, Result};

use super::control::{off, Header, Layout, HEADER_BYTES, HEADER_PAGE, PAGE};
use super::dir::{slot_file_name, SlotDir};
use super::slot::{self, SlotMem};
use super::table::{Entry, Inner, Table};
use super::{RingOptions, RingReport, SlotState};

/// Opens the ring described by `opts`.
pub(super) fn open(opts: RingOptions) -> Result<(Inner, RingReport)> {
    let p = &opts.prefix;
    if p.is_empty() || p.contains('/') || p.contains('\0') || p == "." || p == ".." {
        return Err(Error::invalid(
            format!("ring prefix `{p}`"),
            "must be a non-empty plain file name",
        ));
    }
    let layout = Layout::new(
        opts.budget,
        opts.slots,
        opts.chunk_bytes,
        opts.shared_budget,
    )?;
    let mut report = RingReport::default();
    let dir = SlotDir::create(&opts.dir)?;
    // Every lock first, so that a busy ring is left exactly as it is.
    let files = (0..opts.slots)
        .map(|i| open_locked(&dir, &slot_file_name(p, i)))
        .collect::<Result<Vec<File>>>()?;
    let mut slots = Vec::with_capacity(opts.slots);
    for (i, file) in files.iter().enumerate() {
        let path = dir.path().join(slot_file_name(p, i));
        let entry = Recovery {
            opts: &opts,
            layout: &layout,
            file,
            path: &path,
        }
        .run(i, &mut report)?;
        slots.push(entry);
    }
    // The slots are locked as they are pre-faulted (`Ring::warm_next`,
    // `acquire`); a limit that cannot hold the budget is reported now.
    let mlock_error = if opts.mlock {
        slot::lock_allowed(opts.budget)
            .err()
            .map(|why| format!("mlock of the ring: {why}"))
    } else {
        None
    };
    if let Some(why) = &mlock_error {
        tracing::warn!(
            "ring `{}`: mlock refused ({why}); slots are pre-faulted but may be swapped",
            opts.prefix
        );
    }
    report.mlocked = opts.mlock && mlock_error.is_none();
    report.mlock_error.clone_from(&mlock_error);
    report
        .recovered
        .sort_by(|a, b| b.step.cmp(&a.step).then(a.slot.cmp(&b.slot)));
    let table = Table {
        slots,
        mlock_ok: report.mlocked,
        mlock_error,
        warming: None,
    };
    Ok((
        Inner {
            opts,
            dir,
            layout,
            files,
            table: Mutex::new(table),
            freed: Condvar::new(),
            loads: Mutex::new((0, std::time::Instant::now())),
            warm_stopped: std::sync::atomic::AtomicBool::new(false),
            short_warned: std::sync::atomic::AtomicBool::new(false),
        },
        report,
    ))
}

/// Cuts slot file `file` (at `path`) to its header page and writes there
/// the control block of a `Free` slot with no memory, of `generation`.
pub(super) fn write_free_page(
    file: &File,
    path: &Path,
    opts: &RingOptions,
    layout: &Layout,
    generation: u64,
) -> Result<()> {
    let header = Header {
        state: SlotState::Free.code(),
        step: 0,
        image_len: 0,
        capacity: 0,
        job_tag: opts.job_tag,
        rank: opts.rank,
        pid: std::process::id(),
        generation,
        chunk_bytes: opts.chunk_bytes,
        digest_count: 0,
        digests_valid: 0,
        image_offset: layout.ctrl_len,
    };
    let len = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    if len != HEADER_PAGE {
        file.set_len(HEADER_PAGE)
            .map_err(|e| Error::io("ftruncate", path, e))?;
    }
    let mut page = [0u8; HEADER_BYTES];
    page[..off::END].copy_from_slice(&header.encode());
    file.write_all_at(&page, 0)
        .map_err(|e| Error::io("write", path, e))
}

/// Opens (creating) slot file `name` of `dir` with mode 0600 (a regular
/// file of this user, else refused) and takes its `flock`.
///
/// A ring is removed (`acp gc --shm`, [`Ring::unlink_all`](super::Ring::unlink_all))
/// by unlinking its files while holding their locks: a file opened just
/// before that and locked just after is no longer at its name, and a ring
/// on it would keep its images where no later process finds them. Such a
/// file is let go and the name opened again.
fn open_locked(dir: &SlotDir, name: &str) -> Result<File> {
    let path = &dir.path().join(name);
    for _ in 0..8 {
        let file = dir.open_rw(name)?;
        let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
        if meta.mode() & 0o7777 != 0o600 {
            file.set_permissions(Permissions::from_mode(0o600))
                .map_err(|e| Error::io("chmod", path, e))?;
        }
        #[cfg(test)]
        tests::between_open_and_lock(dir, name);
        if let Err(e) = slot::try_flock(&file) {
            if e.kind() == ErrorKind::WouldBlock {
                let holder = owner_pid(&file).map_or_else(
                    || "locked by another live process".to_owned(),
                    |pid| format!("locked by live process {pid}"),
                );
                return Err(Error::Busy {
                    what: path.display().to_string(),
                    reason: holder,
                });
            }
            return Err(Error::io("flock", path, e));
        }
        let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
        if meta.nlink() > 0 {
            return Ok(file);
        }
    }
    Err(Error::Busy {
        what: path.display().to_string(),
        reason: "removed again at every try while opening it".to_owned(),
    })
}

/// The owner pid in a slot file's control block, if it has one.
fn owner_pid(file: &File) -> Option<u32> {
    let mut b = [0u8; off::END];
    file.read_exact_at(&mut b, 0).ok()?;
    Header::decode(&b).map(|h| h.pid)
}

/// Recovery of one slot file at open.
struct Recovery<'a> {
    opts: &'a RingOptions,
    layout: &'a Layout,
    file: &'a File,
    path: &'a Path,
}

impl Recovery<'_> {
    /// Reads the control block and returns the slot's table entry: a
    /// complete image when it is trusted, else a `Free` slot with a fresh
    /// control block.
    fn run(&self, index: usize, report: &mut RingReport) -> Result<Entry> {
        let file_len = self
            .file
            .metadata()
            .map_err(|e| Error::io("stat", self.path, e))?
            .len();
        let mut block = [0u8; off::END];
        let header = if file_len >= HEADER_PAGE {
            self.file
                .read_exact_at(&mut block, 0)
                .map_err(|e| Error::io("read", self.path, e))?;
            Header::decode(&block)
        } else {
            None
        };
        let mut generation = 0;
        match header {
            Some(h) if h.job_tag == self.opts.job_tag && h.rank == self.opts.rank => {
                generation = h.generation;
                match SlotState::from_code(h.state) {
                    Some(state) if state.is_complete() => match h.check_complete(file_len) {
                        Ok(()) => {
                            let entry = self.recover(state, &h, file_len)?;
                            report.recovered.push(entry.info(index));
                            return Ok(entry);
                        }
                        Err(why) => tracing::warn!(
                            "{}: complete slot not trusted ({why}); reset to free",
                            self.path.display()
                        ),
                    },
                    Some(SlotState::Staging) => {
                        tracing::info!(
                            "{}: slot was half-staged when its process died; discarded",
                            self.path.display()
                        );
                        report.discarded_half_staged += 1;
                    }
                    Some(_) => {}
                    None => tracing::warn!(
                        "{}: unknown state code {}; reset to free",
                        self.path.display(),
                        h.state
                    ),
                }
            }
            Some(_) => tracing::warn!(
                "{}: control block of another job or rank; reset to free",
                self.path.display()
            ),
            None if file_len > 0 => tracing::warn!(
                "{}: no valid control block; reset to free",
                self.path.display()
            ),
            None => {}
        }
        self.reset(file_len, generation)
    }

    /// Maps a trusted complete slot and takes it over.
    fn recover(&self, state: SlotState, h: &Header, file_len: u64) -> Result<Entry> {
        // Mapped only: `Ring::warm_next` faults it in and locks it off the
        // open's path, and a load reads it meanwhile.
        let mut mem = SlotMem::map_lazy(self.file, file_len, h.image_offset)
            .map_err(|e| Error::io("mmap", self.path, e))?;
        mem.ctrl.set_pid(std::process::id());
        let has_digests = h.digests_usable(self.opts.chunk_bytes);
        if !has_digests && h.digests_valid != 0 {
            mem.ctrl.clear_digests();
        }
        Ok(Entry {
            mem: Some(mem),
            state,
            step: h.step,
            len: h.image_len,
            pins: 0,
            free_on_unpin: false,
            has_digests,
            generation: h.generation,
            reserved: 0,
        })
    }

    /// Reinitialises a slot as `Free`. A file whose size fits this ring's
    /// layout is mapped (its memory is reused); any other is cut to its
    /// header page and regrown by the first `acquire`.
    fn reset(&self, file_len: u64, generation: u64) -> Result<Entry> {
        let l = self.layout;
        let capacity = file_len.saturating_sub(l.ctrl_len);
        let reusable = file_len > l.ctrl_len && l.fits(l.ctrl_len, capacity, PAGE);
        let header = Header {
            state: SlotState::Free.code(),
            step: 0,
            image_len: 0,
            capacity: if reusable { capacity } else { 0 },
            job_tag: self.opts.job_tag,
            rank: self.opts.rank,
            pid: std::process::id(),
            generation,
            chunk_bytes: self.opts.chunk_bytes,
            digest_count: 0,
            digests_valid: 0,
            image_offset: l.ctrl_len,
        };
        let mem = if reusable {
            // Mapped only, as in `recover`.
            let mut mem = SlotMem::map_lazy(self.file, file_len, l.ctrl_len)
                .map_err(|e| Error::io("mmap", self.path, e))?;
            mem.ctrl.write_header(&header);
            Some(mem)
        } else {
            write_free_page(self.file, self.path, self.opts, l, generation)?;
            None
        };
        Ok(Entry {
            mem,
            state: SlotState::Free,
            step: 0,
            len: 0,
            pins: 0,
            free_on_unpin: false,
            has_digests: false,
            generation,
            reserved: 0,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use super::*;

    type Hook = Box<dyn FnMut(&SlotDir, &str)>;

    thread_local! {
        /// Run by [`open_locked`] between a slot file's open and its lock.
        static BETWEEN: RefCell<Option<Hook>> = RefCell::new(None);
    }

    pub(super) fn between_open_and_lock(dir: &SlotDir, name: &str) {
        BETWEEN.with(|h| {
            if let Some(f) = h.borrow_mut().as_mut() {
                f(dir, name);
            }
        });
    }

    #[test]
    fn a_slot_file_removed_between_its_open_and_its_lock_is_opened_again() {
        let tmp = tempfile::tempdir().unwrap();
        let opts = RingOptions {
            dir: tmp.path().to_path_buf(),
            prefix: "acp-0000000000000000-r00000".to_owned(),
            job_tag: [7; 32],
            rank: 0,
            slots: 1,
            budget: 1 << 20,
            shared_budget: false,
            chunk_bytes: 1 << 16,
            mlock: false,
        };
        // As `acp gc --shm` removes a ring that was not live when it
        // looked: the file unlinked under its lock, the lock let go.
        let mut once = true;
        BETWEEN.with(|h| {
            *h.borrow_mut() = Some(Box::new(move |dir: &SlotDir, name: &str| {
                if std::mem::take(&mut once) {
                    dir.unlink(name).unwrap();
                }
            }));
        });
        let opened = open(opts.clone());
        BETWEEN.with(|h| h.borrow_mut().take());
        let (ring, _) = opened.unwrap();
        let path = super::super::user_dir(tmp.path()).join(slot_file_name(&opts.prefix, 0));
        let at_name = File::open(&path).expect("the ring's slot file is at its name");
        let probe = slot::try_flock(&at_name).unwrap_err();
        assert_eq!(
            probe.kind(),
            ErrorKind::WouldBlock,
            "the ring holds the file at its name"
        );
        drop(ring);
    }
}
