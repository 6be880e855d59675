//! A fault injector: turns the N-th storage operation of the engine into an
//! error, a stall (a hung disk or NFS server), or whatever a test hook does
//! (e.g. kill the process at that exact point), so tests can break every
//! step of a save in turn. It is the [`Probe`](super::Probe) of tests and
//! fault drills, built only with the `test-util` feature.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// A test hook called before each storage operation with its number
/// (0-based, since the injector was made), name and path.
type Hook = Box<dyn Fn(u64, &str, &Path) + Send + Sync>;

/// Counts storage operations (each chunk write or read, fsync, rename,
/// small-file write, directory sync) and fails or stalls the chosen ones.
pub struct FaultInjector {
    ops: AtomicU64,
    fail_at: AtomicU64,
    errno: AtomicI32,
    sticky: AtomicBool,
    /// The operation to stall and for how long (`u64::MAX`: none).
    stall_at: AtomicU64,
    stall_for: Mutex<Duration>,
    /// Bumped by [`FaultInjector::heal`]; a stalled operation ends early
    /// when it changes.
    heals: Mutex<u64>,
    healed: Condvar,
    hook: Mutex<Option<Hook>>,
    log: Mutex<Vec<String>>,
    /// A bandwidth cap on chunk reads and writes ([`FaultInjector::throttle`]).
    pace: Mutex<Option<Pace>>,
}

/// A storage of limited bandwidth: each read or write takes its bytes'
/// share of a shared pipe (`per_op` for `op_bytes`), one after the other.
#[derive(Debug, Clone, Copy)]
struct Pace {
    per_op: Duration,
    op_bytes: u64,
    /// When the pipe is free again.
    free_at: Instant,
}

impl std::fmt::Debug for FaultInjector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultInjector")
            .field("ops", &self.ops)
            .field("fail_at", &self.fail_at)
            .field("errno", &self.errno)
            .field("sticky", &self.sticky)
            .field("stall_at", &self.stall_at)
            .finish_non_exhaustive()
    }
}

impl FaultInjector {
    /// An injector that fails nothing, only counts.
    #[must_use]
    pub fn counting() -> Self {
        Self::fail_at(u64::MAX, libc::EIO, false)
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
            stall_at: AtomicU64::new(u64::MAX),
            stall_for: Mutex::new(Duration::ZERO),
            heals: Mutex::new(0),
            healed: Condvar::new(),
            hook: Mutex::new(None),
            log: Mutex::new(Vec::new()),
            pace: Mutex::new(None),
        }
    }

    /// Fails the operation `n` operations from now (0 = the next one) with
    /// `errno`; with `sticky`, every later one too.
    pub fn arm(&self, n: u64, errno: i32, sticky: bool) {
        self.errno.store(errno, Ordering::SeqCst);
        self.sticky.store(sticky, Ordering::SeqCst);
        self.fail_at.store(self.ops() + n, Ordering::SeqCst);
    }

    /// Stalls the operation `n` operations from now (0 = the next one) for
    /// `duration`, or until [`FaultInjector::heal`], whichever comes first,
    /// as a hung NFS server or a dead disk would; then it goes on normally.
    pub fn arm_stall(&self, n: u64, duration: Duration) {
        *self
            .stall_for
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = duration;
        self.stall_at.store(self.ops() + n, Ordering::SeqCst);
    }

    /// Calls `hook(n, op, path)` before each operation, after it is counted
    /// and logged and before any failure or stall is applied. Tests use it
    /// to act at an exact point of a save, e.g. to SIGKILL the process.
    pub fn set_hook(&self, hook: impl Fn(u64, &str, &Path) + Send + Sync + 'static) {
        *self
            .hook
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Box::new(hook));
    }

    /// Stops failing and stalling (the cause is gone); a stalled operation
    /// goes on at once.
    pub fn heal(&self) {
        self.fail_at.store(u64::MAX, Ordering::SeqCst);
        self.stall_at.store(u64::MAX, Ordering::SeqCst);
        *self
            .heals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
        self.healed.notify_all();
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

    /// Caps chunk reads and writes at `bytes_per_sec` in all, as a shared
    /// file system's per-node share would (benchmarks): each `read` or
    /// `write` operation returns once the pipe would have carried its
    /// bytes (as the engine's I/O reports them through
    /// [`Probe::check_bytes`](super::Probe::check_bytes); an operation
    /// seen through [`FaultInjector::check`] alone counts as `op_bytes`,
    /// the engine's chunk size); operations of several threads share the
    /// pipe. `bytes_per_sec == 0` lifts the cap.
    pub fn throttle(&self, bytes_per_sec: u64, op_bytes: u64) {
        let pace = (bytes_per_sec > 0).then(|| Pace {
            per_op: Duration::from_secs_f64(op_bytes as f64 / bytes_per_sec as f64),
            op_bytes: op_bytes.max(1),
            free_at: Instant::now(),
        });
        *self
            .pace
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = pace;
    }

    /// Waits for the throttled pipe to carry `bytes` (a whole chunk when
    /// `None`; nothing unthrottled).
    fn paced(&self, op: &str, bytes: Option<u64>) {
        if op != "read" && op != "write" {
            return;
        }
        let done = {
            let mut pace = self
                .pace
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let Some(p) = pace.as_mut() else { return };
            let takes = match bytes {
                None => p.per_op,
                Some(b) => p.per_op.mul_f64(b as f64 / p.op_bytes as f64),
            };
            let done = p.free_at.max(Instant::now()) + takes;
            p.free_at = done;
            done
        };
        let now = Instant::now();
        if done > now {
            std::thread::sleep(done - now);
        }
    }

    /// Called before each storage operation.
    ///
    /// # Errors
    /// The injected OS error when this operation is chosen to fail.
    pub fn check(&self, op: &str, path: &Path) -> std::io::Result<()> {
        self.check_op(op, path, None)
    }

    /// [`FaultInjector::check`] for an operation of `bytes` bytes: the
    /// throttle charges those, not a whole chunk.
    ///
    /// # Errors
    /// The injected OS error when this operation is chosen to fail.
    pub fn check_bytes(&self, op: &str, path: &Path, bytes: u64) -> std::io::Result<()> {
        self.check_op(op, path, Some(bytes))
    }

    fn check_op(&self, op: &str, path: &Path, bytes: Option<u64>) -> std::io::Result<()> {
        let n = self.ops.fetch_add(1, Ordering::SeqCst);
        if let Ok(mut l) = self.log.lock() {
            l.push(format!("{op} {}", path.display()));
        }
        if let Some(hook) = self
            .hook
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .as_ref()
        {
            hook(n, op, path);
        }
        if n == self.stall_at.load(Ordering::SeqCst) {
            self.stall();
        }
        self.paced(op, bytes);
        let at = self.fail_at.load(Ordering::SeqCst);
        if n == at || (self.sticky.load(Ordering::SeqCst) && n > at) {
            return Err(std::io::Error::from_raw_os_error(
                self.errno.load(Ordering::SeqCst),
            ));
        }
        Ok(())
    }

    /// Blocks for the armed stall duration, or until healed.
    fn stall(&self) {
        let duration = *self
            .stall_for
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let deadline = Instant::now() + duration;
        let mut heals = self
            .heals
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let start = *heals;
        while *heals == start {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            heals = self
                .healed
                .wait_timeout(heals, deadline - now)
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

impl super::Probe for FaultInjector {
    fn check(&self, op: &str, path: &Path) -> std::io::Result<()> {
        FaultInjector::check(self, op, path)
    }

    fn check_bytes(&self, op: &str, path: &Path, bytes: u64) -> std::io::Result<()> {
        FaultInjector::check_bytes(self, op, path, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stall_ends_when_healed() {
        let f = std::sync::Arc::new(FaultInjector::counting());
        f.arm_stall(0, Duration::from_secs(60));
        let g = std::sync::Arc::clone(&f);
        let t = std::thread::Builder::new()
            .name("stalled".into())
            .spawn(move || g.check("write", Path::new("/x")))
            .unwrap();
        std::thread::sleep(Duration::from_millis(50));
        assert!(!t.is_finished());
        f.heal();
        t.join().unwrap().unwrap();
    }

    #[test]
    fn a_throttle_spaces_chunk_operations_only() {
        let f = FaultInjector::counting();
        // 1 MiB chunks at 100 MiB/s: 10 ms a chunk.
        f.throttle(100 << 20, 1 << 20);
        let t = Instant::now();
        let free_at = || f.pace.lock().unwrap().unwrap().free_at;
        for _ in 0..5 {
            f.check("read", Path::new("x")).unwrap();
        }
        // The pipe is booked for five chunks in a row, back to back.
        let booked = free_at();
        assert!(booked >= t + Duration::from_millis(50), "{booked:?}");
        f.check("rename", Path::new("x")).unwrap();
        assert_eq!(free_at(), booked);
        f.throttle(0, 1 << 20);
        assert!(f.pace.lock().unwrap().is_none());
    }

    #[test]
    fn a_throttle_charges_the_bytes_an_operation_carries() {
        let f = FaultInjector::counting();
        // 1 MiB chunks at 1 MiB/s: a chunk would book the pipe for a second.
        f.throttle(1 << 20, 1 << 20);
        let free_at = || f.pace.lock().unwrap().unwrap().free_at;
        let t = Instant::now();
        // 4 KiB books about 4 ms of it.
        f.check_bytes("write", Path::new("x"), 4096).unwrap();
        let booked = free_at();
        assert!(booked < t + Duration::from_millis(500), "{:?}", booked - t);
        // Nothing for an empty write or a non-data operation.
        f.check_bytes("write", Path::new("x"), 0).unwrap();
        f.check_bytes("fsync", Path::new("x"), 1 << 20).unwrap();
        assert!(free_at() < t + Duration::from_millis(500));
        // An operation seen without its length counts as a whole chunk.
        f.check("write", Path::new("x")).unwrap();
        assert!(free_at() >= booked + Duration::from_secs(1));
    }

    #[test]
    fn the_hook_sees_every_operation() {
        let f = FaultInjector::counting();
        let seen = std::sync::Arc::new(Mutex::new(Vec::new()));
        let s = std::sync::Arc::clone(&seen);
        f.set_hook(move |n, op, _| s.lock().unwrap().push((n, op.to_owned())));
        f.check("fsync", Path::new("/a")).unwrap();
        f.check("rename", Path::new("/b")).unwrap();
        assert_eq!(
            *seen.lock().unwrap(),
            vec![(0, "fsync".to_owned()), (1, "rename".to_owned())]
        );
    }
}
