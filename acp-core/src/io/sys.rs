//! The system calls acp needs that `std` does not wrap: `fallocate(2)`,
//! `fcntl(2)` `F_SETFL`, and `pthread_sigmask(3)`, `setpriority(2)` and
//! `ioprio_set(2)` for acp's own threads.

#![allow(
    unsafe_code,
    reason = "fallocate(2), fcntl(2), pthread_sigmask(3), setpriority(2) and ioprio_set(2) have no safe std wrapper; each call only passes an owned, open fd, integers or a sigset on our stack"
)]

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Reserves the first `len` bytes of `file` (mode 0: the size grows to at
/// least `len`), so the writes that follow fill allocated extents. A file
/// system without `fallocate` (EOPNOTSUPP) is not an error.
///
/// # Errors
/// The OS error, e.g. ENOSPC when the device cannot hold `len` bytes.
pub(super) fn fallocate(file: &File, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    loop {
        // SAFETY: `file` is borrowed for the whole call, so its fd is open;
        // fallocate reads no memory of ours, it takes only integers.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EINTR) => {}
            Some(libc::EOPNOTSUPP | libc::ENOSYS) => return Ok(()),
            _ => return Err(e),
        }
    }
}

/// Sets `O_DIRECT` on `file` with `F_SETFL`.
///
/// Setting `O_DIRECT` after the open, rather than passing it to `open`, is
/// deliberate: a file system that refuses `O_DIRECT` fails the open with
/// EINVAL only *after* `O_CREAT` has created the file, so a buffered retry
/// with `O_EXCL` would then fail with EEXIST. `F_SETFL` refuses with the same
/// EINVAL and leaves the descriptor as it was.
///
/// # Errors
/// EINVAL when the file system refuses `O_DIRECT`; any other OS error.
pub(super) fn set_direct(file: &File) -> io::Result<()> {
    #[cfg(test)]
    if tests::REFUSE_DIRECT.with(std::cell::Cell::get) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open for the whole call (`file` is borrowed);
    // F_GETFL takes no argument and reads no memory of ours.
    let old = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if old < 0 {
        return Err(io::Error::last_os_error());
    }
    let new = old | libc::O_DIRECT;
    if new == old {
        return Ok(());
    }
    // SAFETY: as above; F_SETFL takes an integer flag word.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, new) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Clears `O_DIRECT` on `file`'s open file description, so that a caller
/// handed the descriptor back can read it at any offset and into any
/// buffer.
///
/// # Errors
/// Any OS error of `fcntl`.
pub(super) fn clear_direct(file: &File) -> io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open for the whole call (`file` is borrowed);
    // F_GETFL takes no argument and reads no memory of ours.
    let old = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if old < 0 {
        return Err(io::Error::last_os_error());
    }
    if old & libc::O_DIRECT == 0 {
        return Ok(());
    }
    // SAFETY: as above; F_SETFL takes an integer flag word.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, old & !libc::O_DIRECT) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use std::cell::Cell;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    use super::*;

    thread_local! {
        /// Makes `set_direct` refuse `O_DIRECT` with EINVAL on this thread, as
        /// a file system without direct I/O does (tmpfs accepts it since
        /// Linux 6.6, so no such file system is at hand in tests).
        pub(in crate::io) static REFUSE_DIRECT: Cell<bool> = const { Cell::new(false) };
    }

    #[test]
    fn f_setfl_direct_takes_effect() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = File::create(&path).unwrap();
        f.write_all(&[0u8; 8192]).unwrap();
        set_direct(&f).unwrap();
        // Under O_DIRECT an unaligned length is refused; buffered it is not.
        let e = f.write_at(&[1u8; 100], 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
    }

    #[test]
    fn fallocate_sets_size() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::create(dir.path().join("f")).unwrap();
        fallocate(&f, 12345).unwrap();
        assert_eq!(f.metadata().unwrap().len(), 12345);
        fallocate(&f, 0).unwrap();
    }
}

/// Blocks the asynchronous signals (SIGTERM, SIGINT, SIGCHLD, ...) in the
/// calling thread, and so in the threads it spawns: acp's background
/// threads never take the application's signals, which the kernel then
/// delivers to the application's own threads, where its handlers (Python's
/// among them) run, and no acp system call is interrupted by them. Faults
/// the thread itself raises (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP,
/// SIGSYS) stay unblocked.
pub(crate) fn block_async_signals() {
    // SAFETY: `set` is a sigset_t on our stack, initialised by sigfillset
    // before any other use; pthread_sigmask reads it and writes no memory
    // of ours (the old mask is not asked for: null).
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        for sig in [
            libc::SIGSEGV,
            libc::SIGBUS,
            libc::SIGFPE,
            libc::SIGILL,
            libc::SIGTRAP,
            libc::SIGSYS,
        ] {
            libc::sigdelset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

/// `IOPRIO_WHO_PROCESS`: `ioprio_set`'s `who` names one thread (by tid).
const IOPRIO_WHO_PROCESS: libc::c_int = 1;
/// `IOPRIO_CLASS_BE << IOPRIO_CLASS_SHIFT | 7`: best effort, its lowest level.
const IOPRIO_BE_LOWEST: libc::c_int = (2 << 13) | 7;

/// The calling thread's kernel id.
fn gettid() -> libc::c_long {
    // SAFETY: gettid takes no argument and touches no memory of ours.
    unsafe { libc::syscall(libc::SYS_gettid) }
}

/// What a background thread of acp runs first: asynchronous signals
/// blocked ([`block_async_signals`]) and, with `nice` > 0, its priority
/// lowered ([`lower_thread_priority`]; a refusal is logged, naming
/// `what`).
pub(crate) fn background_setup(nice: i32, what: &'static str) -> impl FnOnce() + Send + 'static {
    move || {
        block_async_signals();
        if nice > 0 {
            if let Err(e) = lower_thread_priority(nice) {
                tracing::info!("acp: {what} thread priority not lowered: {e}");
            }
        }
    }
}

/// Lowers the calling thread's CPU priority to niceness `nice` and its I/O
/// priority to the lowest best-effort level; threads it starts later
/// inherit both (Linux keeps them per thread). Lowering a priority needs
/// no privilege. Returns what was refused, for the caller to log: the
/// thread keeps running either way.
pub(crate) fn lower_thread_priority(nice: i32) -> Result<(), String> {
    let tid = gettid();
    let mut refused = Vec::new();
    let Ok(id) = libc::id_t::try_from(tid) else {
        return Err(format!("thread id {tid} out of range"));
    };
    // SAFETY: setpriority takes only integers and touches no memory of ours.
    let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, id, nice) };
    if rc != 0 {
        refused.push(format!(
            "setpriority({nice}): {}",
            io::Error::last_os_error()
        ));
    }
    // SAFETY: ioprio_set takes only integers and touches no memory of ours.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            tid,
            IOPRIO_BE_LOWEST,
        )
    };
    if rc != 0 {
        refused.push(format!(
            "ioprio_set(best effort, 7): {}",
            io::Error::last_os_error()
        ));
    }
    if refused.is_empty() {
        Ok(())
    } else {
        Err(refused.join("; "))
    }
}

#[cfg(test)]
mod priority_tests {
    #[test]
    fn a_background_thread_and_its_children_run_at_the_lower_priority() {
        let got = std::thread::Builder::new()
            .name("acp-test-nice".into())
            .spawn(|| {
                super::lower_thread_priority(7).expect("lowering needs no privilege");
                let read = || {
                    let tid = super::gettid();
                    // SAFETY: integers only; errno is cleared first so a
                    // niceness of -1 is told from an error.
                    let nice = unsafe {
                        *libc::__errno_location() = 0;
                        libc::getpriority(libc::PRIO_PROCESS, libc::id_t::try_from(tid).unwrap())
                    };
                    // SAFETY: integers only (IOPRIO_WHO_PROCESS, the tid).
                    let io = unsafe { libc::syscall(libc::SYS_ioprio_get, 1, tid) };
                    (nice, io)
                };
                let own = read();
                let child = std::thread::Builder::new()
                    .name("acp-test-nice-child".into())
                    .spawn(read)
                    .unwrap()
                    .join()
                    .unwrap();
                (own, child)
            })
            .unwrap()
            .join()
            .unwrap();
        let want = (7, i64::from(super::IOPRIO_BE_LOWEST));
        assert_eq!(got.0, want);
        assert_eq!(got.1, want);
    }
}

#[cfg(test)]
mod signal_tests {
    #[test]
    fn background_threads_leave_sigterm_to_others() {
        let blocked = std::thread::Builder::new()
            .name("acp-test-mask".into())
            .spawn(|| {
                super::block_async_signals();
                // SAFETY: `now` is a sigset_t on our stack that pthread_sigmask
                // fills; the new-mask argument is null (nothing changes).
                unsafe {
                    let mut now: libc::sigset_t = std::mem::zeroed();
                    libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut now);
                    (
                        libc::sigismember(&now, libc::SIGTERM),
                        libc::sigismember(&now, libc::SIGSEGV),
                    )
                }
            })
            .expect("the thread starts")
            .join()
            .expect("the thread ran");
        assert_eq!(blocked, (1, 0));
    }
}
