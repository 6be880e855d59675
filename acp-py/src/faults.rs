//! `FaultInjector`: turns the N-th storage operation into an OS error or a
//! stall, so Python tests can fail or hang a save at a chosen step.

use std::sync::Arc;

use pyo3::prelude::*;

/// Counts the engine's storage operations and fails the chosen one (and,
/// when sticky, every later one) with `errno`. Pass it as
/// `Engine(..., faults=...)`. For tests and fault drills.
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct FaultInjector {
    inner: Arc<acp_core::storage::faults::FaultInjector>,
}

impl FaultInjector {
    /// The shared injector, for the engine configuration.
    pub(crate) fn shared(&self) -> Arc<acp_core::storage::faults::FaultInjector> {
        Arc::clone(&self.inner)
    }
}

#[pymethods]
impl FaultInjector {
    /// Fails operation number `fail_at` (0-based, counted from now) with
    /// `errno`; with `sticky`, every later operation too. `fail_at=None`
    /// only counts.
    #[new]
    #[pyo3(signature = (fail_at=None, errno=5, sticky=false))]
    fn new(fail_at: Option<u64>, errno: i32, sticky: bool) -> FaultInjector {
        use acp_core::storage::faults::FaultInjector as Core;
        let inner = match fail_at {
            Some(n) => Core::fail_at(n, errno, sticky),
            None => Core::counting(),
        };
        FaultInjector {
            inner: Arc::new(inner),
        }
    }

    /// Fails the operation `n` operations from now (0 = the next one) with
    /// `errno`; with `sticky`, every later one too.
    #[pyo3(signature = (n, errno=5, sticky=false))]
    fn arm(&self, n: u64, errno: i32, sticky: bool) {
        self.inner.arm(n, errno, sticky);
    }

    /// Stalls the operation `n` operations from now for `seconds` (or until
    /// `heal()`), as a hung file server would; then it goes on normally.
    fn arm_stall(&self, n: u64, seconds: f64) -> PyResult<()> {
        let d = crate::engine::seconds("seconds", seconds)?;
        self.inner.arm_stall(n, d);
        Ok(())
    }

    /// Caps chunk reads and writes at `bytes_per_sec` in all (0 lifts the
    /// cap), each write counted as the bytes it carries and each read as
    /// `op_bytes` (the engine's chunk size): a slow shared file system, for
    /// benchmarks.
    fn throttle(&self, bytes_per_sec: u64, op_bytes: u64) {
        self.inner.throttle(bytes_per_sec, op_bytes);
    }

    /// Stops failing and stalling; a stalled operation goes on at once.
    fn heal(&self) {
        self.inner.heal();
    }

    /// Storage operations seen so far.
    fn ops(&self) -> u64 {
        self.inner.ops()
    }

    /// The operations seen, as "op path" lines.
    fn log(&self) -> Vec<String> {
        self.inner.log()
    }
}
