//! Slot memory: the shared mapping of one slot file, split into the control
//! area (owned by the ring's table) and the image area (handed to
//! [`StagingSlot`](super::StagingSlot) and [`PinnedSlot`](super::PinnedSlot)).
//! Every pointer dereference of the ring is in this file; the ring's state
//! machine supplies the exclusivity the image accessors ask for.
//!
//! Mappings are [`MmapRaw`]: it hands out pointers only, so mapping is safe
//! and `Send + Sync` come from memmap2. Each access is then proven here.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::sync::Arc;

use memmap2::{Advice, MmapOptions, MmapRaw};

use super::control::{
    decode_sums, off, sums_alone_tag, sums_at, sums_record_len, sums_tag, Header, DIGEST_BYTES,
    HEADER_BYTES, HEADER_PAGE, PAGE, SUMS_ALONE_MAGIC, SUMS_FIXED, SUMS_MAGIC, SUM_BYTES,
};
use super::SlotState;
use crate::format::Digest;

/// One mapping of a whole slot file.
#[derive(Debug)]
struct Mapping {
    raw: MmapRaw,
    /// Offset of the image area, a multiple of [`PAGE`], `< raw.len()`.
    image_off: usize,
    /// Bytes from `image_off` to the end of the mapping, a multiple of [`PAGE`].
    capacity: usize,
}

/// The control area `[0, image_off)` of one mapping. Exactly one `Control`
/// exists per mapping (it is not `Clone`), so `&mut Control` is exclusive
/// access to those bytes within this process; other processes are kept out
/// by the `flock` the ring holds.
#[derive(Debug)]
pub(super) struct Control {
    map: Arc<Mapping>,
}

/// A handle on the image area `[image_off, image_off + capacity)` of one
/// mapping. The mapping stays alive while any handle does.
#[derive(Debug, Clone)]
pub(super) struct Image {
    map: Arc<Mapping>,
}

/// The bytes [`Warmer`] faults in or locks per system call.
const WARM_STEP: usize = 32 << 20;

/// Pre-faults and locks a mapping off the save path (see
/// [`SlotMem::warmer`]). `MADV_POPULATE_WRITE` and `mlock` change no byte,
/// so it may run beside readers and writers of the slot.
#[derive(Debug)]
pub(super) struct Warmer {
    map: Arc<Mapping>,
}

impl Warmer {
    /// Faults every page in for writing (`MADV_POPULATE_WRITE`), in steps
    /// that `pause` may hold back or stop (see [`Warmer::in_steps`]).
    /// Returns whether every page was faulted in.
    ///
    /// # Errors
    /// The `madvise` error: `EINVAL` on kernels before 5.14, `ENOMEM` or
    /// `EFAULT` when the memory cannot be had.
    pub(super) fn prefault(&self, pause: &dyn Fn() -> bool) -> io::Result<bool> {
        self.in_steps(pause, |at, n| {
            self.map.raw.advise_range(Advice::PopulateWrite, at, n)
        })
    }

    /// `mlock`s the whole mapping, in steps as [`Warmer::prefault`].
    /// Returns whether all of it was locked.
    ///
    /// # Errors
    /// The `mlock` error.
    pub(super) fn lock(&self, pause: &dyn Fn() -> bool) -> io::Result<bool> {
        self.in_steps(pause, |at, n| {
            // SAFETY: `[at, at + n)` lies inside the live mapping (kept
            // alive by `self.map`): `in_steps` hands out sub-ranges of
            // `[0, raw.len())` starting at page multiples. `mlock` changes
            // no byte.
            let rc = unsafe { libc::mlock(self.map.raw.as_ptr().add(at).cast(), n) };
            if rc == 0 {
                Ok(())
            } else {
                Err(io::Error::last_os_error())
            }
        })
    }

    /// Runs `f` over the mapping in steps of [`WARM_STEP`] bytes. Each call
    /// holds the process's memory-map lock (`mlock` for writing) for one
    /// step only, so the training's own page faults (a load reading a
    /// recovered slot) wait for a step at most, not for a whole slot.
    /// `pause` runs before each step (it waits while a load is in
    /// progress) and says whether to go on. Returns whether every step
    /// ran.
    fn in_steps(
        &self,
        pause: &dyn Fn() -> bool,
        mut f: impl FnMut(usize, usize) -> io::Result<()>,
    ) -> io::Result<bool> {
        let len = self.map.raw.len();
        let mut at = 0;
        while at < len {
            if !pause() {
                return Ok(false);
            }
            let n = WARM_STEP.min(len - at);
            f(at, n)?;
            at += n;
        }
        Ok(true)
    }

    /// Whether `mem` is the mapping this handle warms.
    pub(super) fn warms(&self, mem: &SlotMem) -> bool {
        Arc::ptr_eq(&self.map, &mem.ctrl.map)
    }
}

/// A mapped slot file.
#[derive(Debug)]
pub(super) struct SlotMem {
    /// The control area.
    pub(super) ctrl: Control,
    /// The image area (the ring clones it into handles).
    pub(super) image: Image,
    /// Every page is faulted in (and locked, when the ring locks): writes
    /// into it take no fault.
    pub(super) warm: bool,
}

impl SlotMem {
    /// Maps the first `len` bytes of `file` shared and pre-faults them: the
    /// mapping is populated (`MAP_POPULATE`) and each page is then written
    /// once with its own value, so later writes take no fault. The image
    /// area starts at `image_off`.
    ///
    /// # Errors
    /// `InvalidInput` when `image_off` or `len` is not a page multiple or
    /// leaves no image area; the `mmap` error otherwise.
    ///
    /// # Safety
    /// No other thread or process reads or writes the file's bytes during
    /// the call (the pre-fault rewrites every page): the caller holds the
    /// slot's `flock` and no image handle of the slot is alive.
    pub(super) unsafe fn map(file: &File, len: u64, image_off: u64) -> io::Result<SlotMem> {
        let mut mem = Self::mapping(file, len, image_off, true)?;
        // SAFETY: the caller's contract is `prefault_exclusive`'s.
        unsafe { mem.prefault_exclusive() };
        mem.warm = true;
        Ok(mem)
    }

    /// Maps the first `len` bytes of `file` shared without touching a page:
    /// the caller pre-faults it later ([`SlotMem::warmer`] while others may
    /// read it, [`SlotMem::prefault_exclusive`] while nobody does).
    ///
    /// # Errors
    /// As [`SlotMem::map`].
    pub(super) fn map_lazy(file: &File, len: u64, image_off: u64) -> io::Result<SlotMem> {
        Self::mapping(file, len, image_off, false)
    }

    fn mapping(file: &File, len: u64, image_off: u64, populate: bool) -> io::Result<SlotMem> {
        let bad = |what: &str| io::Error::new(io::ErrorKind::InvalidInput, what.to_owned());
        if image_off % PAGE != 0 || len % PAGE != 0 || image_off < HEADER_PAGE || image_off >= len {
            return Err(bad("slot mapping is not page-aligned or has no image area"));
        }
        let len_us =
            usize::try_from(len).map_err(|_| bad("slot too large for the address space"))?;
        let image_off = usize::try_from(image_off).map_err(|_| bad("image offset too large"))?;
        let mut options = MmapOptions::new();
        options.len(len_us);
        if populate {
            options.populate();
        }
        let raw = options.map_raw(file)?;
        if raw.len() != len_us {
            return Err(bad("short slot mapping"));
        }
        let map = Arc::new(Mapping {
            raw,
            image_off,
            capacity: len_us - image_off,
        });
        Ok(SlotMem {
            ctrl: Control {
                map: Arc::clone(&map),
            },
            image: Image { map },
            warm: false,
        })
    }

    /// Faults every page of the mapping in for writing:
    /// `MADV_POPULATE_WRITE`, or where the kernel lacks it (before Linux
    /// 5.14), a write of each page's first byte with its own value.
    ///
    /// # Safety
    /// No other thread or process writes the file's bytes during the call
    /// (the fallback rewrites a byte of every page): the caller holds the
    /// slot's `flock` and no image handle that writes is alive.
    pub(super) unsafe fn prefault_exclusive(&self) {
        let map = &self.ctrl.map;
        if map.raw.advise(Advice::PopulateWrite).is_ok() {
            return;
        }
        let base = map.raw.as_mut_ptr();
        for at in (0..map.raw.len()).step_by(4096) {
            // SAFETY: `at < raw.len()`, the length of the live mapping
            // (kept alive by `map`), so the pointer is in bounds and valid
            // for a one-byte read and write; the caller guarantees nobody
            // else writes the file's bytes during this call, so there is
            // no data race. Writing back the byte just read keeps the
            // contents.
            unsafe {
                let p = base.add(at);
                p.write_volatile(p.read_volatile());
            }
        }
    }

    /// A handle that pre-faults and locks this mapping from another thread
    /// while the slot is in use: it never reads or writes the bytes.
    pub(super) fn warmer(&self) -> Warmer {
        Warmer {
            map: Arc::clone(&self.ctrl.map),
        }
    }

    /// `mlock`s the whole mapping.
    ///
    /// # Errors
    /// The `mlock` error (`ENOMEM`/`EPERM` past `RLIMIT_MEMLOCK` without
    /// `CAP_IPC_LOCK`).
    pub(super) fn lock(&self) -> io::Result<()> {
        self.ctrl.map.raw.lock()
    }

    /// Whether no handle other than this `SlotMem`'s own (an image handle,
    /// a [`Warmer`]) holds the mapping.
    pub(super) fn is_unique(&self) -> bool {
        Arc::strong_count(&self.ctrl.map) == 2
    }

    /// The mapped length (the file size at mapping time).
    pub(super) fn file_len(&self) -> u64 {
        self.ctrl.map.raw.len() as u64
    }

    /// Offset of the image area.
    pub(super) fn image_off(&self) -> u64 {
        self.ctrl.map.image_off as u64
    }

    /// Size of the image area.
    pub(super) fn capacity(&self) -> u64 {
        self.ctrl.map.capacity as u64
    }
}

impl Control {
    /// Pointer to `n` control-area bytes at `at`, or `None` when they are
    /// not inside `[0, image_off)`.
    fn ptr(&self, at: usize, n: usize) -> Option<*mut u8> {
        let end = at.checked_add(n)?;
        if end > self.map.image_off {
            return None;
        }
        // `at < image_off < raw.len()`: in bounds of the mapping.
        Some(self.map.raw.as_mut_ptr().wrapping_add(at))
    }

    fn write(&mut self, at: usize, bytes: &[u8]) {
        let Some(dst) = self.ptr(at, bytes.len()) else {
            tracing::error!(
                at,
                len = bytes.len(),
                "ring control write out of bounds, skipped"
            );
            return;
        };
        // SAFETY: `ptr` checked that `[at, at + len)` lies in the control
        // area of the live mapping (kept alive by `self.map`). `&mut self`
        // on the only `Control` of this mapping excludes every other access
        // to the control area in this process (image handles never touch
        // it), and the ring's `flock` excludes other ring processes.
        // `bytes` is ordinary memory, so the ranges do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst, bytes.len()) }
    }

    fn read(&self, at: usize, out: &mut [u8]) {
        let Some(src) = self.ptr(at, out.len()) else {
            tracing::error!(
                at,
                len = out.len(),
                "ring control read out of bounds, skipped"
            );
            return;
        };
        // SAFETY: in bounds of the live mapping, as checked by `ptr`. Writes
        // to the control area need `&mut Control`, which cannot coexist
        // with this `&self`, so no write races this read.
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) }
    }

    /// The 4-aligned `u32` word at `at` as an atomic, for the words whose
    /// store publishes what was written before them.
    fn word(&self, at: usize) -> Option<&AtomicU32> {
        let p = self.ptr(at, 4)?;
        if at % 4 != 0 {
            return None;
        }
        // SAFETY: `p` is in bounds (checked by `ptr`), 4-aligned (the
        // mapping is page-aligned and `at % 4 == 0`) and valid for the
        // lifetime of `&self` (the mapping lives as long as `self.map`).
        // The only non-atomic accesses to the control area are `write`,
        // which needs `&mut self` and so cannot overlap this borrow, and
        // `read`, which only reads: no non-atomic access conflicts with
        // the atomic without synchronisation.
        Some(unsafe { AtomicU32::from_ptr(p.cast::<u32>()) })
    }

    /// Stores `v` in the word at `at` after everything written before: a
    /// release fence, then the store.
    fn publish(&mut self, at: usize, v: u32) {
        fence(Ordering::Release);
        if let Some(w) = self.word(at) {
            w.store(v, Ordering::Relaxed);
        }
    }

    /// Stores the state word (after a release fence).
    pub(super) fn set_state(&mut self, state: SlotState) {
        self.publish(off::STATE, state.code());
    }

    /// Marks the recorded digests invalid, and the quick sums beside them.
    pub(super) fn clear_digests(&mut self) {
        self.clear_sums();
        self.publish(off::DIGESTS_VALID, 0);
    }

    /// Unmakes the sums record beside the digests recorded now, if any
    /// (zeroes its magic). A record left elsewhere is no longer bound to
    /// the digests by its tag ([`sums_tag`]).
    fn clear_sums(&mut self) {
        let mut c = [0u8; 4];
        self.read(off::DIGEST_COUNT, &mut c);
        let Ok(count) = usize::try_from(u32::from_le_bytes(c)) else {
            return;
        };
        let at = sums_at(count);
        if self.ptr(at, SUMS_MAGIC.len()).is_some() {
            self.write(at, &[0u8; 8]);
        }
    }

    /// The chunk size of the recorded digests.
    fn chunk_bytes(&self) -> u64 {
        let mut b = [0u8; 8];
        self.read(off::CHUNK_BYTES, &mut b);
        u64::from_le_bytes(b)
    }

    /// Records `sums`, the quick sum of each chunk the recorded digests
    /// describe, in the sums record after the digests: magic cleared, tag
    /// and sums written, magic last. Returns `false` (and writes nothing)
    /// when no digests are recorded, the counts differ, or the record does
    /// not fit the digest area (a slot laid out before sums had room).
    pub(super) fn set_sums(&mut self, sums: &[u64]) -> bool {
        let Some(digests) = self.digests() else {
            return false;
        };
        if sums.len() != digests.len() {
            return false;
        }
        let tag = sums_tag(&digests, self.chunk_bytes());
        self.write_sums_record(SUMS_MAGIC, tag, sums)
    }

    /// The recorded quick sums: only when the digests are recorded, a
    /// sums record follows them with our magic, and its tag is that of the
    /// digests and chunk size recorded now.
    pub(super) fn sums(&self) -> Option<Vec<u64>> {
        let digests = self.digests()?;
        let tag = sums_tag(&digests, self.chunk_bytes());
        self.read_sums_record(digests.len(), SUMS_MAGIC, tag)
    }

    /// Records `sums` without digests (a RAM snapshot summed, not hashed:
    /// `read/fast.rs`), bound by their tag ([`sums_alone_tag`]) to the
    /// chunk size and to `image` (the step, length and generation the
    /// header records for the image they were taken from): digests cleared
    /// first (so the record of any earlier ones is unmade), then the count
    /// and chunk size, then the record, magic last. Returns `false` (and
    /// writes nothing) when the record does not fit the digest area.
    pub(super) fn set_sums_alone(
        &mut self,
        sums: &[u64],
        chunk_bytes: u64,
        image: [u64; 3],
    ) -> bool {
        let Ok(count) = u32::try_from(sums.len()) else {
            return false;
        };
        if sums.len() > self.digest_slots()
            || self
                .ptr(sums_at(sums.len()), sums_record_len(sums.len()))
                .is_none()
        {
            return false;
        }
        self.clear_digests();
        self.write(off::DIGEST_COUNT, &count.to_le_bytes());
        self.write(off::CHUNK_BYTES, &chunk_bytes.to_le_bytes());
        let tag = sums_alone_tag(sums.len(), chunk_bytes, image);
        self.write_sums_record(SUMS_ALONE_MAGIC, tag, sums)
    }

    /// The sums recorded without digests ([`Control::set_sums_alone`]) in
    /// chunks of `chunk_bytes` for `image` (step, length, generation): only
    /// while no digests are recorded, and the record's magic and tag are
    /// those of the count recorded now, `chunk_bytes` and `image`.
    pub(super) fn sums_alone(&self, chunk_bytes: u64, image: [u64; 3]) -> Option<Vec<u64>> {
        let count = self.digest_count_if(0)?;
        if self.chunk_bytes() != chunk_bytes {
            return None;
        }
        let tag = sums_alone_tag(count, chunk_bytes, image);
        self.read_sums_record(count, SUMS_ALONE_MAGIC, tag)
    }

    /// Writes the sums record after the digest area of `sums.len()`
    /// digests: magic zeroed, tag and sums written, `magic` last. `false`
    /// when it does not fit before the image area.
    fn write_sums_record(&mut self, magic: [u8; 8], tag: u64, sums: &[u64]) -> bool {
        let at = sums_at(sums.len());
        if self.ptr(at, sums_record_len(sums.len())).is_none() {
            return false;
        }
        self.write(at, &[0u8; 8]);
        self.write(at + magic.len(), &tag.to_le_bytes());
        let body: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
        self.write(at + SUMS_FIXED, &body);
        fence(Ordering::Release);
        self.write(at, &magic);
        true
    }

    /// The `count` sums of the record after a digest area of `count`
    /// digests, when its magic is `magic` and its tag `tag`.
    fn read_sums_record(&self, count: usize, magic: [u8; 8], tag: u64) -> Option<Vec<u64>> {
        let at = sums_at(count);
        self.ptr(at, sums_record_len(count))?;
        let mut fixed = [0u8; SUMS_FIXED];
        self.read(at, &mut fixed);
        let (m, t) = fixed.split_at(magic.len());
        if m != magic || t != tag.to_le_bytes().as_slice() {
            return None;
        }
        let mut body = vec![0u8; count * SUM_BYTES];
        self.read(at + SUMS_FIXED, &mut body);
        Some(decode_sums(&body))
    }

    /// Writes a whole header: every field but the state word first, then
    /// the state word, so a death in between leaves the previous state.
    pub(super) fn write_header(&mut self, h: &Header) {
        let b = h.encode();
        self.write(0, &b[..off::STATE]);
        self.write(off::STATE + 4, &b[off::STATE + 4..]);
        fence(Ordering::Release);
        if let Some(w) = self.word(off::STATE) {
            w.store(h.state, Ordering::Relaxed);
        }
    }

    /// Stores the step and image length of a sealed image.
    pub(super) fn set_image(&mut self, step: u64, len: u64) {
        self.write(off::STEP, &step.to_le_bytes());
        self.write(off::IMAGE_LEN, &len.to_le_bytes());
    }

    /// Stores `pid` as the owner.
    pub(super) fn set_pid(&mut self, pid: u32) {
        self.write(off::PID, &pid.to_le_bytes());
    }

    /// How many digests the digest area holds.
    pub(super) fn digest_slots(&self) -> usize {
        (self.map.image_off - HEADER_BYTES) / DIGEST_BYTES
    }

    /// Records `digests` of chunks of `chunk_bytes`: invalidates, writes the
    /// digests, count and chunk size, then sets `digests_valid` last.
    /// Returns `false` (and changes nothing) when they do not fit.
    pub(super) fn set_digests(&mut self, digests: &[Digest], chunk_bytes: u64) -> bool {
        let Ok(count) = u32::try_from(digests.len()) else {
            return false;
        };
        if digests.len() > self.digest_slots() {
            return false;
        }
        self.clear_digests();
        let base = HEADER_BYTES;
        for (k, d) in digests.iter().enumerate() {
            self.write(base + k * DIGEST_BYTES, d);
        }
        self.write(off::DIGEST_COUNT, &count.to_le_bytes());
        self.write(off::CHUNK_BYTES, &chunk_bytes.to_le_bytes());
        self.publish(off::DIGESTS_VALID, 1);
        true
    }

    /// The recorded digest count, when `digests_valid` is `valid` (1:
    /// digests recorded; 0: none, the count then that of sums recorded
    /// alone, if any) and the count fits the digest area.
    fn digest_count_if(&self, valid: u32) -> Option<usize> {
        if self.word(off::DIGESTS_VALID)?.load(Ordering::Acquire) != valid {
            return None;
        }
        let mut c = [0u8; 4];
        self.read(off::DIGEST_COUNT, &mut c);
        let count = usize::try_from(u32::from_le_bytes(c)).ok()?;
        (count <= self.digest_slots()).then_some(count)
    }

    /// The recorded digests, when `digests_valid` is set and the count fits.
    pub(super) fn digests(&self) -> Option<Vec<Digest>> {
        let count = self.digest_count_if(1)?;
        let base = HEADER_BYTES;
        let mut out = vec![[0u8; 32]; count];
        for (k, d) in out.iter_mut().enumerate() {
            self.read(base + k * DIGEST_BYTES, d);
        }
        Some(out)
    }
}

impl Image {
    /// Size of the image area.
    pub(super) fn capacity(&self) -> usize {
        self.map.capacity
    }

    fn base(&self) -> *mut u8 {
        // `image_off < raw.len()`: in bounds of the mapping.
        self.map.raw.as_mut_ptr().wrapping_add(self.map.image_off)
    }

    /// The whole image area, writable.
    ///
    /// # Safety
    /// While the returned slice lives, no other reference to any byte of
    /// this mapping's image area exists: no slice from [`Image::bytes`] or
    /// from another `bytes_mut` call on any `Image` of the same mapping,
    /// and no other process writes it.
    pub(super) unsafe fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the image area `[image_off, image_off + capacity)` lies in
        // the live mapping, which `self.map` keeps alive for the borrow of
        // `self`; the mapping is page-aligned, non-null and initialised
        // (file bytes). The caller guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.base(), self.map.capacity) }
    }

    /// The first `len` bytes of the image area (fewer if `len` exceeds it).
    ///
    /// # Safety
    /// While the returned slice lives, no slice from [`Image::bytes_mut`]
    /// of the same mapping exists and nobody writes those bytes.
    pub(super) unsafe fn bytes(&self, len: usize) -> &[u8] {
        let len = len.min(self.map.capacity);
        // SAFETY: `len <= capacity`, so the range lies in the live mapping,
        // kept alive by `self.map` for the borrow of `self`; the caller
        // guarantees that nothing writes it meanwhile.
        unsafe { std::slice::from_raw_parts(self.base(), len) }
    }
}

/// Takes `flock(LOCK_EX | LOCK_NB)` on `file`.
///
/// # Errors
/// `WouldBlock` when another open file description holds it.
pub(super) fn try_flock(file: &File) -> io::Result<()> {
    // SAFETY: `flock` reads no memory of ours; the descriptor is valid for
    // the call because `file` is borrowed.
    let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Allocates the first `len` bytes of `file` (so a full tmpfs reports
/// `ENOSPC` here instead of `SIGBUS` at first touch). File systems without
/// `fallocate` are not an error.
///
/// # Errors
/// The `fallocate` error other than "not supported".
pub(super) fn allocate(file: &File, len: u64) -> io::Result<()> {
    let len = libc::off_t::try_from(len)
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "slot size exceeds off_t"))?;
    // SAFETY: `fallocate` reads no memory of ours; the descriptor is valid
    // for the call because `file` is borrowed.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP | libc::ENOSYS) => Ok(()),
        _ => Err(e),
    }
}

/// The effective user id.
pub(super) fn euid() -> u32 {
    // SAFETY: `geteuid` takes no arguments, touches no memory of ours and
    // cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether `mlock` of `bytes` more bytes can succeed: the calling thread
/// holds `CAP_IPC_LOCK`, or `RLIMIT_MEMLOCK` allows it. The reason when not.
pub(super) fn lock_allowed(bytes: u64) -> Result<(), String> {
    if has_cap_ipc_lock() {
        return Ok(());
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable `rlimit` that outlives the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &raw mut lim) };
    if rc != 0 {
        return Err(format!(
            "getrlimit(RLIMIT_MEMLOCK): {}",
            io::Error::last_os_error()
        ));
    }
    if lim.rlim_cur == libc::RLIM_INFINITY || lim.rlim_cur >= bytes {
        return Ok(());
    }
    Err(format!(
        "RLIMIT_MEMLOCK is {} bytes, below the ring budget of {bytes} bytes, and \
         CAP_IPC_LOCK is not held",
        lim.rlim_cur
    ))
}

/// Whether the calling thread's effective capabilities include
/// `CAP_IPC_LOCK` (bit 14), read from `/proc`.
fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    let status = std::fs::read_to_string("/proc/thread-self/status")
        .or_else(|_| std::fs::read_to_string("/proc/self/status"))
        .unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;

    use super::*;

    fn header() -> Header {
        Header {
            state: SlotState::Staging.code(),
            step: 3,
            image_len: 5,
            capacity: 8192,
            job_tag: [4; 32],
            rank: 1,
            pid: 77,
            generation: 2,
            chunk_bytes: 4096,
            digest_count: 0,
            digests_valid: 0,
            image_offset: 8192,
        }
    }

    #[test]
    fn mapping_keeps_contents_and_splits_control_from_image() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(16384).unwrap();
        f.write_all_at(b"kept", 8192).unwrap();
        // SAFETY: the file is private to this test.
        let mut mem = unsafe { SlotMem::map(&f, 16384, 8192) }.unwrap();
        assert!(mem.is_unique());
        assert_eq!(
            (mem.file_len(), mem.image_off(), mem.capacity()),
            (16384, 8192, 8192)
        );
        // SAFETY: no other image handle exists.
        assert_eq!(unsafe { mem.image.bytes(4) }, b"kept");

        let h = header();
        mem.ctrl.write_header(&h);
        mem.ctrl.set_image(9, 4);
        mem.ctrl.set_state(SlotState::Resident);
        let mut b = [0u8; off::END];
        f.read_exact_at(&mut b, 0).unwrap();
        let got = Header::decode(&b).unwrap();
        assert_eq!((got.state, got.step, got.image_len), (2, 9, 4));
        assert_eq!(got.job_tag, h.job_tag);

        assert_eq!(mem.ctrl.digest_slots(), 128);
        assert_eq!(mem.ctrl.digests(), None);
        assert!(mem.ctrl.set_digests(&[[1; 32], [2; 32]], 4096));
        assert_eq!(mem.ctrl.digests(), Some(vec![[1; 32], [2; 32]]));
        assert!(!mem.ctrl.set_digests(&vec![[3; 32]; 129], 4096));
        mem.ctrl.clear_digests();
        assert_eq!(mem.ctrl.digests(), None);

        let pinned = mem.image.clone();
        assert!(!mem.is_unique());
        drop(pinned);
        // SAFETY: the only image handle is `mem.image`, borrowed mutably here.
        let area = unsafe { mem.image.bytes_mut() };
        area[..4].copy_from_slice(b"new!");
        let mut img = [0u8; 4];
        f.read_exact_at(&mut img, 8192).unwrap();
        assert_eq!(&img, b"new!");
    }

    #[test]
    fn sums_follow_the_digests_and_need_room() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(3 * 4096).unwrap();
        // SAFETY: the file is private to this test.
        let mut mem = unsafe { SlotMem::map(&f, 3 * 4096, 8192) }.unwrap();
        mem.ctrl.write_header(&header());
        assert!(!mem.ctrl.set_sums(&[1]), "no digests recorded");
        assert!(mem.ctrl.set_digests(&[[1; 32], [2; 32]], 4096));
        assert!(!mem.ctrl.set_sums(&[1]), "a sum per digest");
        assert!(mem.ctrl.set_sums(&[5, 6]));
        assert_eq!(mem.ctrl.sums(), Some(vec![5, 6]));
        // The record's bytes: magic, tag, then the sums, after the digests.
        let mut rec = [0u8; 32];
        f.read_exact_at(&mut rec, 4096 + 64).unwrap();
        assert_eq!(&rec[..8], b"ACPXXH31");
        assert_eq!(rec[16..24], 5u64.to_le_bytes());
        // Unmade with the digests, and by digests recorded again.
        mem.ctrl.clear_digests();
        assert_eq!(mem.ctrl.sums(), None);
        assert!(mem.ctrl.set_digests(&[[1; 32], [2; 32]], 4096));
        assert_eq!(mem.ctrl.sums(), None);
        assert!(mem.ctrl.set_sums(&[5, 6]));
        assert!(mem.ctrl.set_digests(&[[1; 32], [3; 32]], 4096));
        assert_eq!(mem.ctrl.sums(), None);
        // A digest area full of digests (as an older layout sized it)
        // has no room for the record: digests kept, no sums.
        assert!(mem.ctrl.set_digests(&vec![[3; 32]; 128], 4096));
        assert!(!mem.ctrl.set_sums(&[7; 128]));
        assert_eq!(mem.ctrl.sums(), None);
        assert_eq!(mem.ctrl.digests().map(|d| d.len()), Some(128));
    }

    #[test]
    fn sums_alone_are_bound_to_their_image_and_unmade_by_digests() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(3 * 4096).unwrap();
        // SAFETY: the file is private to this test.
        let mut mem = unsafe { SlotMem::map(&f, 3 * 4096, 8192) }.unwrap();
        mem.ctrl.write_header(&header());
        let image = [7, 8192, 3];
        assert_eq!(mem.ctrl.sums_alone(4096, image), None, "none recorded");
        assert!(mem.ctrl.set_sums_alone(&[5, 6], 4096, image));
        assert_eq!(mem.ctrl.sums_alone(4096, image), Some(vec![5, 6]));
        assert_eq!(mem.ctrl.digests(), None, "no digests with them");
        assert_eq!(mem.ctrl.sums(), None, "not sums beside digests");
        // Their own magic, after a digest area of two digests.
        let mut rec = [0u8; 8];
        f.read_exact_at(&mut rec, 4096 + 64).unwrap();
        assert_eq!(&rec, b"ACPXXH3A");
        // Not believed for another image of the slot (step, length,
        // generation) or another chunk size.
        assert_eq!(mem.ctrl.sums_alone(4096, [8, 8192, 3]), None);
        assert_eq!(mem.ctrl.sums_alone(4096, [7, 8000, 3]), None);
        assert_eq!(mem.ctrl.sums_alone(4096, [7, 8192, 4]), None);
        assert_eq!(mem.ctrl.sums_alone(2048, image), None);
        // Digests recorded unmake them; so does clearing.
        assert!(mem.ctrl.set_digests(&[[1; 32], [2; 32]], 4096));
        assert_eq!(mem.ctrl.sums_alone(4096, image), None);
        mem.ctrl.clear_digests();
        assert_eq!(mem.ctrl.sums_alone(4096, image), None);
        assert!(mem.ctrl.set_sums_alone(&[5, 6], 4096, image));
        mem.ctrl.clear_digests();
        assert_eq!(mem.ctrl.sums_alone(4096, image), None);
        // No room: nothing written.
        assert!(!mem.ctrl.set_sums_alone(&[7; 128], 4096, image));
        assert_eq!(mem.ctrl.sums_alone(4096, image), None);
    }

    #[test]
    fn bad_mapping_geometry_is_refused() {
        let f = tempfile::tempfile().unwrap();
        f.set_len(16384).unwrap();
        for (len, off) in [(16384, 16384), (16384, 4096 + 1), (16000, 8192), (16384, 0)] {
            // SAFETY: the file is private to this test.
            let r = unsafe { SlotMem::map(&f, len, off) };
            assert!(r.is_err(), "len {len} offset {off}");
        }
    }

    #[test]
    fn lock_limit_is_judged() {
        // Zero bytes always fit; the answer for a huge size depends on the
        // capability, but must not panic and must say why when refused.
        assert!(lock_allowed(0).is_ok());
        if let Err(why) = lock_allowed(u64::MAX) {
            assert!(why.contains("RLIMIT_MEMLOCK"), "{why}");
        }
    }
}
