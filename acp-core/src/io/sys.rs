//! The system calls acp needs that `std` does not wrap: `fallocate(2)`,
//! `fcntl(2)` `F_SETFL`, and `pthread_sigmask(3)` for acp's own threads.

#![allow(
    unsafe_code,
    reason = "fallocate(2), fcntl(2) and pthread_sigmask(3) have no safe std wrapper; each call only passes an owned, open fd, integers or a sigset on our stack"
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

/// Sets `O_DIRECT` on `file` (when `direct`) and clears `O_NONBLOCK` (when
/// `clear_nonblock`) in one `F_SETFL`.
///
/// Setting `O_DIRECT` after the open, rather than passing it to `open`, is
/// deliberate: a file system that refuses `O_DIRECT` fails the open with
/// EINVAL only *after* `O_CREAT` has created the file, so a buffered retry
/// with `O_EXCL` would then fail with EEXIST. `F_SETFL` refuses with the same
/// EINVAL and leaves the descriptor as it was.
///
/// # Errors
/// EINVAL when the file system refuses `O_DIRECT`; any other OS error.
pub(super) fn set_flags(file: &File, direct: bool, clear_nonblock: bool) -> io::Result<()> {
    #[cfg(test)]
    if direct && tests::REFUSE_DIRECT.with(std::cell::Cell::get) {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open for the whole call (`file` is borrowed);
    // F_GETFL takes no argument and reads no memory of ours.
    let old = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if old < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut new = old;
    if direct {
        new |= libc::O_DIRECT;
    }
    if clear_nonblock {
        new &= !libc::O_NONBLOCK;
    }
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
        /// Makes `set_flags` refuse `O_DIRECT` with EINVAL on this thread, as
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
        set_flags(&f, true, false).unwrap();
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
