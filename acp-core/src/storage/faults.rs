//! A fault injector: turns the N-th storage operation of the engine into an
//! error, so tests can fail every step of a save in turn.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::Mutex;

/// Counts storage operations (each chunk write or read, fsync, rename,
/// small-file write, directory sync) and fails the chosen ones.
#[derive(Debug)]
pub struct FaultInjector {
    ops: AtomicU64,
    fail_at: AtomicU64,
    errno: AtomicI32,
    sticky: AtomicBool,
    log: Mutex<Vec<String>>,
}

impl FaultInjector {
    /// An injector that fails nothing, only counts.
    #[must_use]
    pub fn counting() -> Self {
        FaultInjector {
            ops: AtomicU64::new(0),
            fail_at: AtomicU64::new(u64::MAX),
            errno: AtomicI32::new(libc::EIO),
            sticky: AtomicBool::new(false),
            log: Mutex::new(Vec::new()),
        }
    }

    /// Fails operation number `n` (0-based, counted from now) with `errno`;
    /// with `sticky`, every later operation fails too (a dead disk).
    #[must_use]
    pub fn fail_at(n: u64, errno: i32, sticky: bool) -> Self {
        FaultInjector {
            ops: AtomicU64::new(0),
            fail_at: AtomicU64::new(n),
            errno: AtomicI32::new(errno),
            sticky: AtomicBool::new(sticky),
            log: Mutex::new(Vec::new()),
        }
    }

    /// Fails the operation `n` operations from now (0 = the next one) with
    /// `errno`; with `sticky`, every later one too.
    pub fn arm(&self, n: u64, errno: i32, sticky: bool) {
        self.errno.store(errno, Ordering::SeqCst);
        self.sticky.store(sticky, Ordering::SeqCst);
        self.fail_at.store(self.ops() + n, Ordering::SeqCst);
    }

    /// Stops failing (the cause is gone).
    pub fn heal(&self) {
        self.fail_at.store(u64::MAX, Ordering::SeqCst);
    }

    /// Operations seen so far.
    #[must_use]
    pub fn ops(&self) -> u64 {
        self.ops.load(Ordering::SeqCst)
    }

    /// The operations seen, as "op path" lines.
    #[must_use]
    pub fn log(&self) -> Vec<String> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Called before each storage operation.
    ///
    /// # Errors
    /// The injected OS error when this operation is chosen to fail.
    pub fn check(&self, op: &str, path: &Path) -> std::io::Result<()> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut l) = self.log.lock() {
            l.push(format!("{op} {}", path.display()));
        }
        let at = self.fail_at.load(Ordering::SeqCst);
        if n == at || (self.sticky.load(Ordering::SeqCst) && n > at) {
            return Err(std::io::Error::from_raw_os_error(
                self.errno.load(Ordering::SeqCst),
            ));
        }
        Ok(())
    }
}

/// Calls `f.check` when an injector is set.
pub(crate) fn check(f: Option<&FaultInjector>, op: &str, path: &Path) -> std::io::Result<()> {
    match f {
        Some(f) => f.check(op, path),
        None => Ok(()),
    }
}
