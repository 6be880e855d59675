//! Bindings of the `acp_core::ops` that the command line's conversions
//! (`acp.convert`) build on. Each returns a [`Report`]: the JSON the
//! `--json` output prints and the text the command prints otherwise.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use acp_core::ops::{self, text, Progress};
use acp_core::Error;
use pyo3::prelude::*;

use crate::errors::err;

/// The outcome of an operation: `json` (the report) and `text` (for people).
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct Report {
    json: String,
    text: String,
}

#[pymethods]
impl Report {
    /// The report as JSON text.
    #[getter]
    fn json(&self) -> &str {
        &self.json
    }

    /// The report as the command line prints it.
    #[getter]
    fn text(&self) -> &str {
        &self.text
    }

    fn __repr__(&self) -> String {
        format!("Report({})", self.json)
    }
}

fn report<T: serde::Serialize>(r: &T, text: impl FnOnce(&T) -> String) -> Result<Report, Error> {
    Ok(Report {
        json: serde_json::to_string(r).map_err(|e| Error::invalid("report", e))?,
        text: text(r),
    })
}

/// Calls a Python `progress(phase, done, total)` at most ten times a
/// second, and at the end of each phase.
struct PyProgress {
    callback: Option<Py<PyAny>>,
    state: Mutex<(String, u64, u64, Option<Instant>)>,
}

impl PyProgress {
    fn new(callback: Option<Py<PyAny>>) -> Self {
        PyProgress {
            callback,
            state: Mutex::new((String::new(), 0, 0, None)),
        }
    }

    fn call(&self, force: bool) {
        let Some(cb) = &self.callback else { return };
        let mut st = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let due =
            st.3.is_none_or(|t| t.elapsed() >= Duration::from_millis(100));
        if !(force || due) {
            return;
        }
        st.3 = Some(Instant::now());
        let (phase, done, total) = (st.0.clone(), st.1, st.2);
        drop(st);
        Python::attach(|py| {
            if let Err(e) = cb.call1(py, (phase, done, total)) {
                e.write_unraisable(py, None);
            }
        });
    }
}

impl Progress for PyProgress {
    fn begin(&self, what: &str, total: u64) {
        {
            let mut st = self
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            *st = (what.to_owned(), 0, total, None);
        }
        self.call(true);
    }

    fn advance(&self, n: u64) {
        {
            let mut st = self
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            st.1 = st.1.saturating_add(n);
        }
        self.call(false);
    }

    fn end(&self) {
        self.call(true);
    }
}

/// What step `step` (the newest when None) of `root` holds.
#[pyfunction]
#[pyo3(signature = (root, step=None))]
fn ops_inspect(py: Python<'_>, root: PathBuf, step: Option<u64>) -> PyResult<Report> {
    py.detach(|| report(&ops::inspect(&root, step)?, text::inspect))
        .map_err(err)
}

/// Writes a step as one plain safetensors file `out`.
#[pyfunction]
#[pyo3(signature = (root, out, step=None, rank=None, overwrite=false, progress=None))]
fn ops_export(
    py: Python<'_>,
    root: PathBuf,
    out: PathBuf,
    step: Option<u64>,
    rank: Option<u32>,
    overwrite: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<Report> {
    let p = PyProgress::new(progress);
    py.detach(|| {
        report(
            &ops::export_safetensors(&root, step, rank, &out, overwrite, &p)?,
            text::export,
        )
    })
    .map_err(err)
}

/// The plain-values view of a values tree (`values_json`, JSON text) as
/// JSON text: the leaves plain JSON cannot hold as they are (tensors, bytes,
/// non-finite floats, big ints, framework values) described for people, or
/// `null` when `describe` is false. The one definition is
/// [`ops::plain_values_with`].
#[pyfunction]
#[pyo3(signature = (values_json, describe=true))]
fn plain_values(values_json: &str, describe: bool) -> PyResult<String> {
    let values: serde_json::Value =
        serde_json::from_str(values_json).map_err(|e| err(Error::invalid("values JSON", e)))?;
    let leaves = if describe {
        ops::Leaves::Described
    } else {
        ops::Leaves::Omitted
    };
    Ok(ops::plain_values_with(&values, leaves).to_string())
}

/// Registers the operations in the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Report>()?;
    m.add_function(wrap_pyfunction!(ops_inspect, m)?)?;
    m.add_function(wrap_pyfunction!(ops_export, m)?)?;
    m.add_function(wrap_pyfunction!(plain_values, m)?)?;
    Ok(())
}
