//! `Staging` (a save in its stall) and `SaveHandle` (its completion).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use acp_core::{Error, SaveReport};
use pyo3::exceptions::PyBufferError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::engine::{io_name, seconds, SIGNAL_TICK};
use crate::errors::{err, invalid};
use crate::tensors::{host_slices, slice_span, staging_view, HostRange};

/// What Python sees of one laid-out tensor.
#[derive(Debug, Clone)]
pub(crate) struct EntryInfo {
    pub(crate) name: String,
    pub(crate) dtype: &'static str,
    pub(crate) shape: Vec<u64>,
    pub(crate) len: usize,
}

impl EntryInfo {
    pub(crate) fn from_entry(e: &acp_core::Entry) -> Result<EntryInfo, Error> {
        Ok(EntryInfo {
            name: e.name.clone(),
            dtype: e.dtype.name(),
            shape: e.shape.clone(),
            len: usize::try_from(e.len).map_err(|_| {
                Error::invalid(
                    format!("tensor `{}`", e.name),
                    "larger than the address space",
                )
            })?,
        })
    }

    pub(crate) fn to_tuple<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        let shape = PyTuple::new(py, &self.shape)?;
        PyTuple::new(
            py,
            [
                self.name.as_str().into_pyobject(py)?.into_any(),
                self.dtype.into_pyobject(py)?.into_any(),
                shape.into_any(),
                self.len.into_pyobject(py)?.into_any(),
            ],
        )
    }
}

/// Checks `(index, address, nbytes)` triples against `entries`: each index
/// in range and used once, each length equal to its tensor's.
pub(crate) fn host_ranges(
    what: &str,
    entries: &[EntryInfo],
    items: &[(usize, usize, usize)],
) -> PyResult<Vec<HostRange>> {
    let mut seen = vec![false; entries.len()];
    items
        .iter()
        .map(|&(index, addr, len)| {
            let Some(entry) = entries.get(index) else {
                return Err(invalid(
                    what,
                    format!(
                        "tensor index {index} out of range (there are {})",
                        entries.len()
                    ),
                ));
            };
            let name = format!("{what}: tensor `{}`", entry.name);
            if std::mem::replace(&mut seen[index], true) {
                return Err(invalid(name, "given twice"));
            }
            if len != entry.len {
                return Err(invalid(
                    name,
                    format!("{len} bytes given, the tensor has {}", entry.len),
                ));
            }
            HostRange::new(&name, index, addr, len)
        })
        .collect()
}

/// What Python sees of each of `entries`.
fn entry_infos(entries: &[acp_core::Entry]) -> Result<Arc<[EntryInfo]>, Error> {
    entries.iter().map(EntryInfo::from_entry).collect()
}

/// A save's tensors and values checked and laid out once
/// (`Engine.save_plan`), for saves of a state whose structure is unchanged
/// (`Engine.begin_save_planned`), with the host ranges to copy from, if
/// given (`Staging.copy_planned`).
#[pyclass(module = "acp._acp", frozen)]
pub(crate) struct SavePlan {
    pub(crate) core: acp_core::SavePlan,
    entries: Arc<[EntryInfo]>,
    host: Option<Vec<HostRange>>,
}

impl std::fmt::Debug for SavePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavePlan")
            .field("tensors", &self.entries.len())
            .finish_non_exhaustive()
    }
}

impl SavePlan {
    /// Wraps a core plan; `host`: `(index, address, nbytes)` triples,
    /// checked against its entries as `Staging.copy_from` checks them.
    pub(crate) fn new(
        core: acp_core::SavePlan,
        host: Option<Vec<(usize, usize, usize)>>,
    ) -> PyResult<SavePlan> {
        let entries = entry_infos(core.entries()).map_err(err)?;
        let host = host
            .map(|items| host_ranges("save plan", &entries, &items))
            .transpose()?;
        Ok(SavePlan {
            core,
            entries,
            host,
        })
    }
}

#[pymethods]
impl SavePlan {
    fn __len__(&self) -> usize {
        self.entries.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "SavePlan(tensors={}, host={})",
            self.entries.len(),
            self.host.is_some()
        )
    }
}

enum State {
    Open(acp_core::Staging),
    /// Aborted while a view of its bytes was still exported: kept (and the
    /// slot held) until this object dies, which the views prevent until
    /// they are gone.
    Aborting(
        #[expect(
            dead_code,
            reason = "held only so that dropping it (the abort) comes last"
        )]
        acp_core::Staging,
    ),
    Done,
}

/// A save in its stall: fill the tensors' bytes with `copy_from` or through
/// `buffer(i)`, then `finish()`. Dropping it unfinished aborts the save.
#[pyclass(module = "acp._acp", frozen)]
pub(crate) struct Staging {
    step: u64,
    image_bytes: u64,
    /// Shared with the [`SavePlan`] the save was started from, if any.
    entries: Arc<[EntryInfo]>,
    state: Mutex<State>,
    /// `(tensor index, weakref to the exporter of a view handed out by
    /// buffer())`: the `ctypes` array over the slot bytes, which every view,
    /// array or tensor derived from that view keeps alive (see
    /// [`staging_view`]).
    views: Mutex<Vec<(usize, Py<PyAny>)>>,
}

/// An open or aborting staging holds an engine handle, maybe its last.
impl Drop for Staging {
    fn drop(&mut self) {
        let state = std::mem::replace(
            self.state.get_mut().unwrap_or_else(PoisonError::into_inner),
            State::Done,
        );
        if !matches!(state, State::Done) {
            crate::engine::drop_detached(state);
        }
    }
}

impl std::fmt::Debug for Staging {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Staging")
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Staging {
    pub(crate) fn new(s: acp_core::Staging) -> Result<Staging, Error> {
        let entries = entry_infos(s.entries())?;
        Ok(Staging::with_entries(s, entries))
    }

    /// A staging started from `plan`: its entries are the plan's (the
    /// same names, dtypes, shapes and lengths, in the same order).
    pub(crate) fn planned(s: acp_core::Staging, plan: &SavePlan) -> Staging {
        Staging::with_entries(s, Arc::clone(&plan.entries))
    }

    fn with_entries(s: acp_core::Staging, entries: Arc<[EntryInfo]>) -> Staging {
        Staging {
            step: s.step(),
            image_bytes: s
                .entries()
                .iter()
                .map(|e| e.offset + e.len)
                .max()
                .unwrap_or(0),
            entries,
            state: Mutex::new(State::Open(s)),
            views: Mutex::new(Vec::new()),
        }
    }

    /// Copies `ranges` (checked against this staging's entries) into the
    /// slot, in parallel with the GIL released (`background`: on
    /// [`acp_core::Staging::background_threads`]).
    fn copy_ranges(&self, py: Python<'_>, ranges: &[HostRange], background: bool) -> PyResult<()> {
        py.detach(|| -> Result<(), Error> {
            let mut state = lock(&self.state);
            let State::Open(staging) = &mut *state else {
                return Err(self.closed());
            };
            let slot: Vec<_> = staging
                .tensors_mut()
                .iter()
                .enumerate()
                .map(|(i, t)| slice_span(i, t))
                .collect();
            let what = format!("copy into step {}", self.step);
            let srcs = host_slices(&what, ranges, &slot)?;
            let items: Vec<(usize, &[u8])> = ranges
                .iter()
                .zip(srcs)
                .map(|(r, src)| (r.index(), src))
                .collect();
            let threads = if background {
                staging.background_threads()
            } else {
                staging.copy_threads()
            };
            staging.copy_some_on(&items, threads)
        })
        .map_err(err)
    }

    /// Where the slot bytes of tensor `i` are, while the staging is open.
    ///
    /// # Errors
    /// `acp.InvalidInput` when finished or aborted, or `i` is out of range.
    pub(crate) fn slot_bytes(&self, i: usize) -> PyResult<(*mut u8, usize)> {
        let mut state = lock(&self.state);
        let State::Open(staging) = &mut *state else {
            return Err(err(self.closed()));
        };
        if i >= self.entries.len() {
            return Err(invalid(
                format!("staging of step {}", self.step),
                format!(
                    "tensor index {i} out of range (there are {})",
                    self.entries.len()
                ),
            ));
        }
        let bytes = staging.tensor_mut(i);
        Ok((bytes.as_mut_ptr(), bytes.len()))
    }

    fn closed(&self) -> Error {
        Error::invalid(
            format!("staging of step {}", self.step),
            "already finished or aborted",
        )
    }

    /// Fails while anything that can reach the slot bytes of a view handed
    /// out by `buffer()` is alive, so nothing writes into the slot after it
    /// is sealed or freed. What is watched is the view's exporter, not the
    /// view: a slice, a cast or `numpy.frombuffer` shares the exporter
    /// through the view's managed buffer without keeping the view itself,
    /// and `torch.frombuffer` keeps the view (hence the exporter) but no
    /// export. The exporter dies only when the last of them does, or when
    /// every view over it is `release()`d.
    ///
    /// # Errors
    /// `BufferError` naming the tensor whose view is alive.
    fn check_views_gone(&self, py: Python<'_>) -> PyResult<()> {
        let mut views = lock(&self.views);
        let mut alive = None;
        let mut kept = Vec::new();
        for (index, weak) in views.drain(..) {
            if weak.bind(py).call0()?.is_none() {
                continue;
            }
            alive.get_or_insert(index);
            kept.push((index, weak));
        }
        *views = kept;
        match alive {
            None => Ok(()),
            Some(index) => Err(PyBufferError::new_err(format!(
                "staging of step {}: the buffer of tensor `{}` is still in use (a view, \
                 slice, array or tensor over it is alive); drop it first",
                self.step, self.entries[index].name
            ))),
        }
    }
}

#[pymethods]
impl Staging {
    /// The step being saved.
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }

    /// The end of the last tensor's bytes in the image (0 without tensors):
    /// the image size, up to the header when there are no tensors.
    #[getter]
    fn image_bytes(&self) -> u64 {
        self.image_bytes
    }

    /// The laid-out tensors, in the order given to `begin_save`, as
    /// `(name, dtype, shape, nbytes)`.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.entries.iter().map(|e| e.to_tuple(py)).collect()
    }

    /// Copies host memory into the slot: each `(index, address, nbytes)`
    /// names a tensor and the contiguous bytes to copy into it (any subset,
    /// each tensor at most once). The copy runs in parallel over the
    /// engine's copy threads with the GIL released.
    ///
    /// The caller guarantees each range is the live memory of a contiguous
    /// tensor that nothing writes until the call returns. `background`:
    /// a copy that runs beside the training (an overlapped save), on half
    /// the copy threads.
    #[pyo3(signature = (items, background=false))]
    fn copy_from(
        &self,
        py: Python<'_>,
        items: Vec<(usize, usize, usize)>,
        background: bool,
    ) -> PyResult<()> {
        let ranges = host_ranges(
            &format!("copy into step {}", self.step),
            &self.entries,
            &items,
        )?;
        self.copy_ranges(py, &ranges, background)
    }

    /// `copy_from` of the host ranges `plan` was made with: this staging
    /// must have been started from `plan` (`Engine.begin_save_planned`).
    ///
    /// The caller guarantees, as for `copy_from`, that each range is still
    /// the live memory of a contiguous tensor that nothing writes until
    /// the call returns.
    fn copy_planned(&self, py: Python<'_>, plan: &SavePlan) -> PyResult<()> {
        let what = || format!("copy into step {}", self.step);
        if !Arc::ptr_eq(&self.entries, &plan.entries) {
            return Err(invalid(
                what(),
                "the staging was not started from this plan",
            ));
        }
        let Some(ranges) = plan.host.as_deref() else {
            return Err(invalid(what(), "the plan was made without host ranges"));
        };
        self.copy_ranges(py, ranges, false)
    }

    /// A writable memoryview over the slot bytes of tensor `i`, for copies
    /// that land directly in the slot (device to host). It and anything
    /// made from it (slices, casts, arrays, tensors) keep this staging
    /// alive. `finish()` refuses, naming the tensor, while any of them is
    /// alive, and `abort()` then frees the slot only once they are all gone.
    fn buffer<'py>(slf: &Bound<'py, Self>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let view = staging_view(slf, i)?;
        // The view's exporter (`memoryview.obj`): see `check_views_gone`.
        let exporter = view.getattr(intern!(py, "obj"))?;
        let weak = py
            .import(intern!(py, "weakref"))?
            .getattr(intern!(py, "ref"))?
            .call1((exporter,))?
            .unbind();
        lock(&slf.get().views).push((i, weak));
        Ok(view)
    }

    /// Ends the stall: seals the slot and queues its flush. Returns the
    /// save's handle.
    fn finish(&self, py: Python<'_>) -> PyResult<SaveHandle> {
        self.check_views_gone(py)?;
        let staging = {
            let mut state = lock(&self.state);
            match std::mem::replace(&mut *state, State::Done) {
                State::Open(s) => s,
                other => {
                    *state = other;
                    return Err(err(self.closed()));
                }
            }
        };
        let inner = py.detach(|| staging.finish());
        Ok(SaveHandle { inner })
    }

    /// Abandons the save and frees the slot. While a view from `buffer()`
    /// is alive, the slot is freed only once it is gone.
    fn abort(&self, py: Python<'_>) {
        let released = self.check_views_gone(py).is_ok();
        let mut state = lock(&self.state);
        match std::mem::replace(&mut *state, State::Done) {
            State::Open(s) if !released => *state = State::Aborting(s),
            State::Open(s) => {
                drop(state);
                // Dropping an open staging aborts it and frees its slot.
                py.detach(move || {
                    let _aborted = s;
                });
            }
            other => *state = other,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "Staging(step={}, tensors={})",
            self.step,
            self.entries.len()
        )
    }
}

/// The completion handle of a save.
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct SaveHandle {
    inner: acp_core::SaveHandle,
}

fn report_dict<'py>(py: Python<'py>, r: &SaveReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("step", r.step)?;
    d.set_item("skipped", r.skipped)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("stored_bytes", r.stored_bytes)?;
    d.set_item("reused_chunks", r.reused_chunks)?;
    d.set_item("reused_bytes", r.reused_bytes)?;
    d.set_item("stall_secs", r.stall_secs)?;
    d.set_item("slot_wait_secs", r.slot_wait_secs)?;
    d.set_item("queue_secs", r.queue_secs)?;
    d.set_item("flush_secs", r.flush_secs)?;
    d.set_item("replica_wait_secs", r.replica_wait_secs)?;
    d.set_item("commit_secs", r.commit_secs)?;
    d.set_item("total_secs", r.total_secs)?;
    d.set_item("io", io_name(r.io))?;
    d.set_item("direct", r.direct)?;
    d.set_item("outcome", r.outcome.as_str())?;
    Ok(d)
}

impl SaveHandle {
    /// Wraps a core handle.
    pub(crate) fn new(inner: acp_core::SaveHandle) -> SaveHandle {
        SaveHandle { inner }
    }
}

#[pymethods]
impl SaveHandle {
    /// A handle for a save skipped because no slot was free.
    #[staticmethod]
    fn skipped(step: u64) -> SaveHandle {
        SaveHandle {
            inner: acp_core::SaveHandle::skipped(step),
        }
    }

    /// The step.
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    /// Whether the save has finished (committed, failed or skipped).
    fn done(&self) -> bool {
        self.inner.is_done()
    }

    /// Blocks (GIL released) until the step is committed and returns the
    /// save's figures; raises the error that stopped the save, or
    /// `AcpTimeout` after `timeout` seconds or when the watchdog finds the
    /// flush stuck (naming what). Signals are handled meanwhile.
    #[pyo3(signature = (timeout=None))]
    fn wait<'py>(&self, py: Python<'py>, timeout: Option<f64>) -> PyResult<Bound<'py, PyDict>> {
        let limit = timeout.map(|t| seconds("timeout", t)).transpose()?;
        let start = std::time::Instant::now();
        loop {
            let left = limit.map(|l| l.saturating_sub(start.elapsed()));
            let slice = left.map_or(SIGNAL_TICK, |l| l.min(SIGNAL_TICK));
            if let Some(report) = py
                .detach(|| self.inner.wait_timeout(slice.max(Duration::from_micros(1))))
                .map_err(err)?
            {
                return report_dict(py, &report);
            }
            if left.is_some_and(|l| l <= slice) {
                return Err(err(Error::Timeout {
                    what: format!("save of step {}", self.inner.step()),
                    secs: timeout.unwrap_or_default(),
                }));
            }
            // A signal handler (SIGTERM, Ctrl-C) runs here, not after the wait.
            py.check_signals()?;
        }
    }

    /// The save's figures when it has finished, else None; raises the
    /// error that stopped it.
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.inner.wait_timeout(Duration::ZERO).map_err(err)? {
            Some(r) => Ok(Some(report_dict(py, &r)?)),
            None => Ok(None),
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "SaveHandle(step={}, done={})",
            self.inner.step(),
            self.inner.is_done()
        )
    }
}
