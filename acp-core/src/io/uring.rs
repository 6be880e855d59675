//! The `io_uring` engine: one ring per call, up to `queue_depth` chunk
//! writes (or reads) in flight, each an `IORING_OP_WRITE` / `IORING_OP_READ`
//! over a raw pointer into the caller's buffer.
//!
//! The pointers are sound because of one rule, kept by [`Flight`]: it
//! borrows the buffer and the file for its whole life, and it does not end
//! (its `Drop` included) while the kernel still holds one of its
//! operations. Registered (fixed) buffers are not used: they count against
//! `RLIMIT_MEMLOCK`, which is often a few MiB.
//!
//! A read hands each chunk to the caller's `on_chunk` as soon as it has
//! landed, after the freed ring slots have been refilled: the caller's work
//! on a chunk (hashing it) runs while the next reads are in flight.

#![allow(
    unsafe_code,
    reason = "io_uring SQEs carry raw pointers into the caller's buffer; Flight waits for every completion before the borrow ends"
)]

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::marker::PhantomData;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::Duration;

use io_uring::register::Probe;
use io_uring::{opcode, types, IoUring};

use crate::error::{Error, Result};
use crate::io::file::{self, Geometry, Span};
use crate::io::{IoEngine, IoKind, IoOpts, IoStats};
use crate::storage::{probe_io, probe_op};

/// `IORING_ENTER_GETEVENTS` from the kernel uapi (`io_uring.h`); the crate
/// keeps its copy private.
const IORING_ENTER_GETEVENTS: u32 = 1;

/// A ring never has more entries than this, whatever the queue depth.
const MAX_DEPTH: usize = 4096;

/// An operation that ends in EINTR or EAGAIN is retried this many times.
const MAX_RETRIES: u8 = 16;
/// How long a flight waits in `io_uring_enter` before it looks at its
/// operations again.
const WAIT_TICK: Duration = Duration::from_millis(500);
/// An operation with no completion for this long is cancelled and started
/// again: on some kernels a write punted to io-wq while the process takes a
/// signal never runs (no worker is started for it), and waiting longer
/// does not help, while a new submission goes through.
const STUCK_AFTER: Duration = Duration::from_secs(2);
/// The `user_data` of the cancel requests a flight submits for stuck
/// operations (operations use their slot index, far below it).
const CANCEL_TAG: u64 = u64::MAX;

/// The `io_uring` engine.
#[derive(Debug, Default)]
pub(crate) struct UringEngine;

impl IoEngine for UringEngine {
    fn kind(&self) -> IoKind {
        IoKind::Uring
    }

    fn write_to(
        &self,
        file: &File,
        path: &Path,
        src: &[u8],
        len: u64,
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
    ) -> Result<IoStats> {
        file::write_file(
            IoKind::Uring,
            file,
            path,
            src,
            len,
            opts,
            on_chunk,
            |f, geo, on_chunk| write_chunks(f, path, src, geo, opts, on_chunk),
        )
    }

    fn read_from<'a>(
        &self,
        file: &File,
        path: &Path,
        dst: &'a mut [u8],
        opts: &IoOpts,
        on_chunk: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
    ) -> Result<u64> {
        file::read_file(file, path, dst, opts, |f, dst, geo| {
            read_chunks(f, path, dst, geo, opts, on_chunk)
        })
    }

    fn read_range(
        &self,
        file: &File,
        path: &Path,
        offset: u64,
        len: usize,
        dst: &mut [u8],
        opts: &IoOpts,
    ) -> Result<()> {
        file::read_range(file, path, offset, len, dst, opts, |f, dst, geo| {
            read_chunks(f, path, dst, geo, opts, &mut |_, _| Ok(()))
        })
    }
}

/// Whether `io_uring` works here: a ring can be created, the kernel has
/// `IORING_OP_READ` and `IORING_OP_WRITE`, and a no-op completes.
///
/// # Errors
/// Why not: EPERM or ENOSYS from `io_uring_setup` (a seccomp filter, the
/// `io_uring_disabled` sysctl, an old kernel), or a missing opcode.
pub(super) fn probe() -> io::Result<()> {
    let mut ring = IoUring::new(2)?;
    let mut ops = Probe::new();
    ring.submitter().register_probe(&mut ops)?;
    for (code, name) in [(opcode::Read::CODE, "READ"), (opcode::Write::CODE, "WRITE")] {
        if !ops.is_supported(code) {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("the kernel lacks IORING_OP_{name}"),
            ));
        }
    }
    let nop = opcode::Nop::new().build().user_data(0);
    // SAFETY: a no-op names no buffer and no file, so nothing must outlive it.
    unsafe { ring.submission().push(&nop) }
        .map_err(|_| io::Error::other("a new ring's submission queue is full"))?;
    loop {
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if transient(&e) => {}
            Err(e) => return Err(e),
        }
        if let Some(cqe) = ring.completion().next() {
            if cqe.result() < 0 {
                return Err(io::Error::from_raw_os_error(-cqe.result()));
            }
            return Ok(());
        }
    }
}

/// Errors of `io_uring_enter` after which trying again is right.
fn transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
    )
}

fn write_chunks(
    f: &File,
    path: &Path,
    src: &[u8],
    geo: Geometry,
    opts: &IoOpts,
    on_chunk: &mut dyn FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let n = geo.count();
    if n == 0 {
        return Ok(());
    }
    let io_err = |e: io::Error| Error::io("write", path, e);
    let mut flight = Flight::writing(f, src, opts.queue_depth.min(n))
        .map_err(|e| Error::io("io_uring_setup", path, e))?;
    // Hashes chunk `i` and passes the fault check, before it is submitted.
    let mut prepare = |i: usize| -> Result<Span> {
        let span = geo.span(i);
        on_chunk(i, &src[span.start..span.start + span.data])?;
        probe_io(opts.faults.as_deref(), "write", path, span.data).map_err(io_err)?;
        Ok(span)
    };
    let mut next = 0;
    // A chunk hashed while the ring was full, submitted at the next free
    // slot: so hashing overlaps the writes even at queue depth 1.
    let mut staged: Option<Span> = None;
    let result = (|| -> Result<()> {
        loop {
            while flight.has_room() {
                let span = match staged.take() {
                    Some(span) => span,
                    None if next < n => {
                        next += 1;
                        prepare(next - 1)?
                    }
                    None => break,
                };
                flight.start(span, span.io).map_err(io_err)?;
            }
            if flight.idle() {
                return Ok(());
            }
            if staged.is_none() && next < n {
                next += 1;
                staged = Some(prepare(next - 1)?);
            }
            flight.wait().map_err(io_err)?;
        }
    })();
    // On error, operations may still be in flight: wait for them here (the
    // drop would too) before the file is removed and `src` handed back.
    flight.drain();
    result
}

fn read_chunks<'a>(
    f: &File,
    path: &Path,
    dst: &'a mut [u8],
    geo: Geometry,
    opts: &IoOpts,
    on_chunk: &mut dyn FnMut(usize, &'a [u8]) -> Result<()>,
) -> Result<()> {
    let n = geo.count();
    if n == 0 {
        return Ok(());
    }
    let io_err = |e: io::Error| Error::io("read", path, e);
    let mut flight = Flight::reading(f, dst, opts.queue_depth.min(n))
        .map_err(|e| Error::io("io_uring_setup", path, e))?;
    let mut next = 0;
    let result = (|| -> Result<()> {
        loop {
            while next < n && flight.has_room() {
                let span = geo.span(next);
                probe_op(opts.faults.as_deref(), "read", path).map_err(io_err)?;
                // `span.io` is padded; only `span.data` bytes must come back.
                flight.start(span, span.data).map_err(io_err)?;
                next += 1;
            }
            // The ring is full again: hand over what has landed while the
            // next chunks are read.
            while let Some((i, bytes)) = flight.take_landed() {
                on_chunk(i, bytes)?;
            }
            if next == n && flight.idle() {
                return Ok(());
            }
            flight.wait().map_err(io_err)?;
        }
    })();
    flight.drain();
    result
}

/// The caller's buffer, as the base pointer the SQEs are built over.
#[derive(Debug, Clone, Copy)]
enum Dir {
    /// Writes read from here.
    Write(*const u8),
    /// Reads land here.
    Read(*mut u8),
}

/// One chunk transfer: `len` bytes at `start` in the buffer and `offset`
/// in the file, of which `done` have moved; it is complete once `need`
/// have (a read may end short at end of file).
#[derive(Debug)]
struct Op {
    /// The chunk's index in the file.
    index: usize,
    start: usize,
    offset: u64,
    len: usize,
    need: usize,
    done: usize,
    retries: u8,
    /// This flight asked the kernel to cancel it (it was stuck): its
    /// `ECANCELED` means "start again", not a failure.
    cancelled: bool,
}

/// What a completion means for its operation.
enum Step {
    Done,
    Again,
    Failed(io::Error),
}

/// A ring with operations in flight over one file and one buffer.
///
/// Invariant: every operation the kernel has consumed from the submission
/// queue names a range inside the buffer (borrowed for `'b`) and the file's
/// fd (borrowed for `'f`); [`Flight::drain`], which `Drop` calls, returns
/// only when the kernel holds none. So the buffer and fd outlive every
/// operation, on error paths and on unwinding alike.
///
/// A reading flight moves forward only: each read starts at or past the
/// end of the one before ([`Flight::start`] refuses others), so the range
/// of a completed read is never written again, and
/// [`Flight::take_landed`] lends it out for all of `'b`.
struct Flight<'f, 'b> {
    ring: IoUring,
    file: &'f File,
    dir: Dir,
    buf_len: usize,
    /// The borrow of the buffer: shared for writes, exclusive for reads.
    _buf: PhantomData<&'b [u8]>,
    /// Operation per slot; the slot index is the SQE's `user_data`.
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
    /// SQEs pushed and CQEs reaped, over the flight's life.
    pushed: u64,
    completed: u64,
    /// Scratch for reaping.
    cqes: Vec<(u64, i32)>,
    /// Reads: no read may start below this offset (the end of the last
    /// range started).
    floor: usize,
    /// Reads: `(index, start, len)` of completed reads not yet taken.
    landed: VecDeque<(usize, usize, usize)>,
    /// When the last completion arrived (or the first wait began): an
    /// operation in the kernel with none since [`STUCK_AFTER`] is stuck.
    progress: std::time::Instant,
    /// Whether `io_uring_enter` takes a timeout (`IORING_FEAT_EXT_ARG`).
    timed_waits: bool,
}

impl<'f, 'b> Flight<'f, 'b> {
    /// A flight that writes `file` from `src`.
    fn writing(file: &'f File, src: &'b [u8], depth: usize) -> io::Result<Self> {
        Self::new(file, Dir::Write(src.as_ptr()), src.len(), depth)
    }

    /// A flight that reads `file` into `dst`, which it borrows exclusively:
    /// nothing else reads or writes `dst` while the kernel may write it,
    /// except the ranges of completed reads that
    /// [`take_landed`](Self::take_landed) lends out.
    fn reading(file: &'f File, dst: &'b mut [u8], depth: usize) -> io::Result<Self> {
        Self::new(file, Dir::Read(dst.as_mut_ptr()), dst.len(), depth)
    }

    fn new(file: &'f File, dir: Dir, buf_len: usize, depth: usize) -> io::Result<Self> {
        let depth = depth.clamp(1, MAX_DEPTH);
        let ring = IoUring::builder()
            .setup_clamp()
            .build(u32::try_from(depth).unwrap_or(1))?;
        let depth = depth.min(usize::try_from(ring.params().sq_entries()).unwrap_or(1));
        Ok(Flight {
            file,
            dir,
            buf_len,
            _buf: PhantomData,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            pushed: 0,
            completed: 0,
            cqes: Vec::with_capacity(depth),
            floor: 0,
            landed: VecDeque::with_capacity(depth),
            progress: std::time::Instant::now(),
            timed_waits: ring.params().is_feature_ext_arg(),
            ring,
        })
    }

    /// Whether another operation can start.
    fn has_room(&self) -> bool {
        !self.free.is_empty()
    }

    /// Whether no operation is under way.
    fn idle(&self) -> bool {
        self.free.len() == self.slots.len()
    }

    /// Starts moving `span.io` bytes at `span.start`, complete once `need`
    /// of them have moved.
    fn start(&mut self, span: Span, need: usize) -> io::Result<()> {
        let end = span.start.checked_add(span.io);
        if end.is_none_or(|end| end > self.buf_len)
            || u32::try_from(span.io).is_err()
            || need > span.io
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "chunk outside the buffer",
            ));
        }
        if let Dir::Read(_) = self.dir {
            // A landed range may be lent out: never read into it again.
            if span.start < self.floor {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "reads of a flight must move forward",
                ));
            }
            self.floor = span.start + span.io;
        }
        if self.idle() {
            self.progress = std::time::Instant::now();
        }
        let slot = self
            .free
            .pop()
            .ok_or_else(|| io::Error::other("no free io_uring slot"))?;
        self.slots[slot] = Some(Op {
            index: span.index,
            start: span.start,
            offset: span.offset(),
            len: span.io,
            need,
            done: 0,
            retries: 0,
            cancelled: false,
        });
        self.push(slot)?;
        // Start it now, so it runs while the caller prepares the next one.
        match self.ring.submit() {
            Err(e) if !transient(&e) => Err(e),
            // A transient refusal leaves the SQE queued for `wait`.
            _ => Ok(()),
        }
    }

    /// Queues the rest of the operation in `slot`; on failure frees the
    /// slot.
    fn push(&mut self, slot: usize) -> io::Result<()> {
        let Some(op) = self.slots.get(slot).and_then(Option::as_ref) else {
            return Err(io::Error::other("io_uring slot is empty"));
        };
        // `start` checked `op.start + op.len <= buf_len` and `len <= u32::MAX`,
        // and `done < len` here, so `at + rest <= buf_len`.
        let at = op.start + op.done;
        let rest = u32::try_from(op.len - op.done).map_err(io::Error::other)?;
        let offset = op.offset + op.done as u64;
        let fd = types::Fd(self.file.as_raw_fd());
        let entry = match self.dir {
            Dir::Write(base) => opcode::Write::new(fd, base.wrapping_add(at), rest)
                .offset(offset)
                .build(),
            Dir::Read(base) => opcode::Read::new(fd, base.wrapping_add(at), rest)
                .offset(offset)
                .build(),
        }
        .user_data(slot as u64);
        // SAFETY: the entry names `rest` bytes at `base + at`, and
        // `at + rest <= buf_len` (above), so it stays inside the buffer this
        // flight borrows for `'b`; for writes that borrow is shared (the
        // bytes cannot change), for reads it is exclusive (the only Rust
        // references into `dst` before the flight ends are the ranges of
        // completed reads lent by `take_landed`, and this operation's range
        // is not one of them: it is not complete, and reads move forward
        // past `floor`; so the kernel's stores race with nothing).
        // The fd belongs to `self.file`, borrowed for `'f`, so it is
        // neither closed nor reused. The flight outlives the operation:
        // `drain` (called by `Drop`) returns only when the kernel holds no
        // operation, and no flight is ever leaked.
        let queued = unsafe { self.ring.submission().push(&entry) };
        if queued.is_err() {
            self.slots[slot] = None;
            self.free.push(slot);
            return Err(io::Error::other("io_uring submission queue is full"));
        }
        self.pushed += 1;
        Ok(())
    }

    /// Submits what is queued, waits for a completion and handles every
    /// completion there is: short transfers are queued again, finished
    /// operations free their slot.
    ///
    /// # Errors
    /// The first failed operation's error, or `io_uring_enter`'s. The
    /// other operations stay in flight: call [`drain`](Self::drain).
    fn wait(&mut self) -> io::Result<()> {
        if self.timed_waits {
            self.wait_timed()?;
            return self.reap(true);
        }
        match self.ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e) if transient(&e) => {
                if self.in_kernel() > 0 {
                    self.wait_only()?;
                } else {
                    std::thread::yield_now();
                }
            }
            Err(e) => return Err(e),
        }
        self.reap(true)
    }

    /// Submits what is queued and waits at most [`WAIT_TICK`] for a
    /// completion; a wait that times out cancels stuck operations
    /// ([`cancel_if_stuck`](Self::cancel_if_stuck)). Completions are left
    /// for the caller to reap.
    fn wait_timed(&mut self) -> io::Result<()> {
        let ts = types::Timespec::from(WAIT_TICK);
        let args = types::SubmitArgs::new().timespec(&ts);
        match self.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => self.cancel_if_stuck(),
            Err(e) if transient(&e) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Asks the kernel to cancel every operation of this flight when none
    /// has completed for [`STUCK_AFTER`]; each comes back with `ECANCELED`
    /// (or done, if it finished meanwhile) and [`step`](Self::step) starts
    /// it again, at most [`MAX_RETRIES`] times.
    fn cancel_if_stuck(&mut self) -> io::Result<()> {
        if self.in_kernel() == 0 || self.progress.elapsed() < STUCK_AFTER {
            return Ok(());
        }
        let busy: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].as_ref().is_some_and(|op| !op.cancelled))
            .collect();
        for slot in busy {
            tracing::warn!(
                slot,
                "io_uring operation stuck for {STUCK_AFTER:?}; cancelling it to start it again"
            );
            let entry = opcode::AsyncCancel::new(slot as u64)
                .build()
                .user_data(CANCEL_TAG);
            // SAFETY: a cancel request names no memory of ours (only the
            // `user_data` of the operation to cancel).
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                break; // the queue is full: the next tick tries again
            }
            self.pushed += 1;
            if let Some(Some(op)) = self.slots.get_mut(slot) {
                op.cancelled = true;
            }
        }
        self.progress = std::time::Instant::now();
        match self.ring.submit() {
            Err(e) if !transient(&e) => Err(e),
            _ => Ok(()),
        }
    }

    /// Operations the kernel has consumed and not completed.
    fn in_kernel(&mut self) -> u64 {
        let queued = self.ring.submission().len() as u64;
        self.pushed - self.completed - queued
    }

    /// Waits for a completion without submitting anything.
    fn wait_only(&mut self) -> io::Result<()> {
        // SAFETY: `to_submit` is 0, so no queued SQE is handed to the
        // kernel; the argument pointer is null (no signal mask), as in the
        // crate's own `submit_and_wait`.
        let rc = unsafe {
            self.ring
                .submitter()
                .enter::<libc::sigset_t>(0, 1, IORING_ENTER_GETEVENTS, None)
        };
        match rc {
            Err(e) if !transient(&e) => Err(e),
            _ => Ok(()),
        }
    }

    /// Handles the completions in the queue. With `resubmit`, unfinished
    /// operations are queued again; without, they are dropped (draining).
    fn reap(&mut self, resubmit: bool) -> io::Result<()> {
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.clear();
        cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        let mut first = Ok(());
        if !cqes.is_empty() {
            self.progress = std::time::Instant::now();
        }
        for &(slot, res) in &cqes {
            self.completed += 1;
            if slot == CANCEL_TAG {
                continue; // the cancel request's own completion
            }
            let slot = usize::try_from(slot).unwrap_or(usize::MAX);
            let step = self.step(slot, res);
            let outcome = match step {
                Step::Again if resubmit => self.push(slot),
                Step::Done => {
                    self.land(slot);
                    Ok(())
                }
                Step::Again => {
                    self.release(slot);
                    Ok(())
                }
                Step::Failed(e) => {
                    self.release(slot);
                    Err(e)
                }
            };
            if first.is_ok() {
                first = outcome;
            }
        }
        self.cqes = cqes;
        first
    }

    /// Applies the result `res` to the operation in `slot`.
    fn step(&mut self, slot: usize, res: i32) -> Step {
        let dir = self.dir;
        let Some(op) = self.slots.get_mut(slot).and_then(Option::as_mut) else {
            return Step::Failed(io::Error::other("completion for no io_uring operation"));
        };
        let cancelled = std::mem::take(&mut op.cancelled);
        let Ok(moved) = usize::try_from(res) else {
            let errno = -res;
            let again = matches!(errno, libc::EINTR | libc::EAGAIN)
                || (cancelled && errno == libc::ECANCELED);
            if again && op.retries < MAX_RETRIES {
                op.retries += 1;
                return Step::Again;
            }
            return Step::Failed(io::Error::from_raw_os_error(errno));
        };
        op.done = (op.done + moved).min(op.len);
        if op.done >= op.need {
            Step::Done
        } else if moved == 0 {
            Step::Failed(match dir {
                Dir::Write(_) => {
                    io::Error::new(io::ErrorKind::WriteZero, "the kernel wrote 0 bytes")
                }
                Dir::Read(_) => {
                    io::Error::new(io::ErrorKind::UnexpectedEof, "file shrank while being read")
                }
            })
        } else {
            Step::Again
        }
    }

    /// Frees the slot of a completed operation; a read's range is queued
    /// for [`take_landed`](Self::take_landed).
    fn land(&mut self, slot: usize) {
        if let (Dir::Read(_), Some(Some(op))) = (self.dir, self.slots.get(slot)) {
            self.landed.push_back((op.index, op.start, op.need));
        }
        self.release(slot);
    }

    /// The next completed read, as its chunk index and its `need` bytes,
    /// lent for all of `'b`; `None` when none is waiting (or for writes).
    fn take_landed(&mut self) -> Option<(usize, &'b [u8])> {
        let Dir::Read(base) = self.dir else {
            return None;
        };
        let (index, start, len) = self.landed.pop_front()?;
        // SAFETY: `land` queued `(start, len)` when the read of
        // `start..start + io` completed with at least `len` (its `need`)
        // bytes, so the kernel holds no operation over those bytes; `start`
        // checked `start + io <= buf_len` and `len <= io`, so they lie in the
        // buffer this flight borrows exclusively for `'b`, which came from a
        // `&'b mut [u8]` (initialised, no other reference to it). Every later
        // read starts at or past `floor >= start + io` (`start` refuses
        // others) and this flight never writes the buffer from Rust, so these
        // bytes are not written again during `'b`: a shared borrow of them is
        // sound, as one from `split_at_mut` would be.
        let bytes =
            unsafe { std::slice::from_raw_parts(base.wrapping_add(start).cast_const(), len) };
        Some((index, bytes))
    }

    fn release(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot) {
            if s.take().is_some() {
                self.free.push(slot);
            }
        }
    }

    /// Waits until the kernel holds no operation of this flight. SQEs
    /// still queued are never submitted: nothing enters the ring with them
    /// after this, and closing the ring discards them.
    fn drain(&mut self) {
        while self.in_kernel() > 0 {
            // Timed where the kernel can, so a stuck operation is cancelled
            // here too rather than waited on for ever. (Operations queued
            // but not yet submitted may start now; they are waited for.)
            let waited = if self.timed_waits {
                self.wait_timed()
            } else {
                self.wait_only()
            };
            if let Err(e) = waited {
                // Returning would let the kernel use memory we no longer
                // own; `io_uring_enter(0, 1, GETEVENTS)` on a live ring has
                // no lasting failure, so wait and try again.
                tracing::error!(error = %e, "io_uring wait failed while draining; retrying");
                std::thread::sleep(Duration::from_millis(1));
            }
            // Failures of operations being drained are dropped: the first
            // error is already on its way to the caller.
            let _ = self.reap(false);
        }
    }
}

impl Drop for Flight<'_, '_> {
    fn drop(&mut self) {
        self.drain();
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use memmap2::MmapMut;

    use super::*;
    use crate::io::sys;

    /// `O_DIRECT` set with `F_SETFL` after the open governs `io_uring` writes
    /// too: an unaligned buffer is refused.
    #[test]
    fn o_direct_from_f_setfl_applies_to_ring_writes() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = File::create(dir.path().join("f")).unwrap();
        f.write_all(&[0u8; 8192]).unwrap();
        sys::set_direct(&f).unwrap();
        let buf = MmapMut::map_anon(3 * 4096).unwrap();
        let span = Span {
            index: 0,
            start: 0,
            base: 0,
            data: 4096,
            io: 4096,
        };

        let mut flight = Flight::writing(&f, &buf[1..], 1).unwrap();
        flight.start(span, span.io).unwrap();
        let e = flight.wait().unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
        assert!(flight.idle());

        let mut flight = Flight::writing(&f, &buf, 1).unwrap();
        flight.start(span, span.io).unwrap();
        while !flight.idle() {
            flight.wait().unwrap();
        }
    }

    #[test]
    fn a_reading_flight_moves_forward_and_lends_what_landed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let data: Vec<u8> = (0..3 * 4096u32)
            .map(|i| u8::try_from(i % 251).expect("below 251"))
            .collect();
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        let mut buf = MmapMut::map_anon(3 * 4096).unwrap();
        let span = |index: usize| Span {
            index,
            start: index * 4096,
            base: 0,
            data: 4096,
            io: 4096,
        };
        let mut flight = Flight::reading(&f, &mut buf, 2).unwrap();
        flight.start(span(1), 4096).unwrap();
        // At or behind the last read: refused, it could land on bytes
        // already lent out.
        assert!(flight.start(span(1), 4096).is_err());
        assert!(flight.start(span(0), 4096).is_err());
        while !flight.idle() {
            flight.wait().unwrap();
        }
        let (i, first) = flight.take_landed().unwrap();
        assert_eq!(i, 1);
        assert!(flight.take_landed().is_none());
        flight.start(span(2), 4096).unwrap();
        while !flight.idle() {
            flight.wait().unwrap();
        }
        let (i, second) = flight.take_landed().unwrap();
        assert_eq!(i, 2);
        drop(flight);
        // Both stay lent for the buffer's borrow, past the flight.
        assert_eq!(first, &data[4096..8192]);
        assert_eq!(second, &data[8192..]);
    }

    #[test]
    fn operations_outside_the_buffer_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::create(dir.path().join("f")).unwrap();
        let buf = [0u8; 100];
        let mut flight = Flight::writing(&f, &buf, 2).unwrap();
        let span = Span {
            index: 0,
            start: 50,
            base: 0,
            data: 51,
            io: 51,
        };
        assert!(flight.start(span, 51).is_err());
        assert!(flight.idle());
    }
}
