//! `Loaded`: a loaded checkpoint, its values and its tensors' bytes.

use acp_core::{Checkpoint, Error, Source};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::{err, invalid};
use crate::save::{host_ranges, EntryInfo};
use crate::tensors::{host_slices_mut, loaded_view, slice_span};

/// A loaded checkpoint. Its tensors' bytes live in a resident ring slot (or
/// a private buffer) for as long as this object, which `buffer()` views
/// keep alive.
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct Loaded {
    inner: Checkpoint,
    entries: Vec<EntryInfo>,
    values_json: String,
}

fn source_name(s: Source) -> &'static str {
    match s {
        Source::Ram => "ram",
        Source::Storage => "storage",
        Source::Peer => "peer",
    }
}

impl Loaded {
    /// Wraps a loaded checkpoint; serialises its values for Python.
    pub(crate) fn new(inner: Checkpoint) -> Result<Loaded, Error> {
        let entries = inner
            .entries()
            .iter()
            .map(EntryInfo::from_entry)
            .collect::<Result<_, _>>()?;
        let values_json = serde_json::to_string(inner.values())
            .map_err(|e| Error::invalid(format!("step {}: values", inner.step()), e))?;
        Ok(Loaded {
            inner,
            entries,
            values_json,
        })
    }

    /// The bytes of tensor `i` (an index into `entries()`).
    ///
    /// # Errors
    /// `acp.InvalidInput` when `i` is out of range.
    pub(crate) fn bytes(&self, i: usize) -> PyResult<&[u8]> {
        let entry = self.inner.entries().get(i).ok_or_else(|| {
            invalid(
                self.what(),
                format!(
                    "tensor index {i} out of range (there are {})",
                    self.entries.len()
                ),
            )
        })?;
        Ok(self.inner.data(entry))
    }

    fn what(&self) -> String {
        format!("load of step {}", self.inner.step())
    }
}

#[pymethods]
impl Loaded {
    /// The step.
    #[getter]
    fn step(&self) -> u64 {
        self.inner.step()
    }

    /// Where it came from: "ram" or "storage".
    #[getter]
    fn source(&self) -> &'static str {
        source_name(self.inner.report().source)
    }

    /// The plain values saved with it, as JSON text.
    #[getter]
    fn values_json(&self) -> &str {
        &self.values_json
    }

    /// The load's figures: source, bytes, verified, secs, and `rejected`:
    /// why a resident copy was found but not used (None when it was not).
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.report();
        let d = PyDict::new(py);
        d.set_item("step", self.inner.step())?;
        d.set_item("source", source_name(r.source))?;
        d.set_item("bytes", r.bytes)?;
        d.set_item("verified", r.verified)?;
        d.set_item("secs", r.secs)?;
        d.set_item("rejected", r.rejected.as_deref())?;
        Ok(d)
    }

    /// The tensors in file order, as `(name, dtype, shape, nbytes)`.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyTuple>>> {
        self.entries.iter().map(|e| e.to_tuple(py)).collect()
    }

    /// A read-only, zero-copy memoryview over the bytes of tensor `i`
    /// (an index into `entries()`). It keeps this checkpoint alive.
    fn buffer<'py>(slf: &Bound<'py, Self>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        loaded_view(slf, i)
    }

    /// Copies tensors out: each `(index, address, nbytes)` names a tensor
    /// (an index into `entries()`) and the contiguous memory to fill, in
    /// parallel over the engine's copy threads with the GIL released.
    ///
    /// The caller guarantees each range is the live memory of a contiguous
    /// tensor that nothing reads or writes until the call returns.
    fn copy_into(&self, py: Python<'_>, items: Vec<(usize, usize, usize)>) -> PyResult<()> {
        let what = self.what();
        let mut ranges = host_ranges(&what, &self.entries, &items)?;
        py.detach(|| -> Result<(), Error> {
            let sources: Vec<_> = self
                .inner
                .entries()
                .iter()
                .enumerate()
                .map(|(i, e)| slice_span(i, self.inner.data(e)))
                .collect();
            let mut dsts = host_slices_mut(&what, &mut ranges, &sources)?;
            self.inner.copy_into(&mut dsts)
        })
        .map_err(err)
    }

    fn __repr__(&self) -> String {
        format!(
            "Loaded(step={}, source={:?}, tensors={})",
            self.inner.step(),
            self.source(),
            self.entries.len()
        )
    }
}
