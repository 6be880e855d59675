//! Bindings of `acp_core::ops`, the back end of the `acp` command line.
//! Each function returns a [`Report`]: the JSON the `--json` output prints
//! and the text the command prints otherwise.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use acp_core::ops::{self, text, Progress};
use acp_core::Error;
use pyo3::prelude::*;

use crate::engine::seconds;
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

fn shm(dir: Option<PathBuf>) -> PathBuf {
    dir.unwrap_or_else(|| PathBuf::from(ops::DEFAULT_SHM_DIR))
}

/// The committed steps of `root` and this node's slots of `job`.
#[pyfunction]
#[pyo3(signature = (root, job=None, shm_dir=None))]
fn ops_list(
    py: Python<'_>,
    root: PathBuf,
    job: Option<String>,
    shm_dir: Option<PathBuf>,
) -> PyResult<Report> {
    py.detach(|| {
        report(
            &ops::list(&root, job.as_deref(), &shm(shm_dir))?,
            text::list,
        )
    })
    .map_err(err)
}

/// What step `step` (the newest when None) of `root` holds.
#[pyfunction]
#[pyo3(signature = (root, step=None))]
fn ops_inspect(py: Python<'_>, root: PathBuf, step: Option<u64>) -> PyResult<Report> {
    py.detach(|| report(&ops::inspect(&root, step)?, text::inspect))
        .map_err(err)
}

/// Re-hashes step `step` (the newest when None), or every step with `all`.
#[pyfunction]
#[pyo3(signature = (root, step=None, all=false, progress=None))]
fn ops_verify(
    py: Python<'_>,
    root: PathBuf,
    step: Option<u64>,
    all: bool,
    progress: Option<Py<PyAny>>,
) -> PyResult<Report> {
    let p = PyProgress::new(progress);
    py.detach(|| report(&ops::verify(&root, step, all, &p)?, text::verify))
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

/// Commits the tensors of safetensors `files` as step `step` of `root`.
#[pyfunction]
#[pyo3(signature = (files, root, step, overwrite=false, values_json=None, shm_dir=None, progress=None))]
#[expect(clippy::too_many_arguments, reason = "one keyword per import option")]
fn ops_import(
    py: Python<'_>,
    files: Vec<PathBuf>,
    root: PathBuf,
    step: u64,
    overwrite: bool,
    values_json: Option<String>,
    shm_dir: Option<PathBuf>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Report> {
    let p = PyProgress::new(progress);
    py.detach(|| {
        let values = values_json
            .map(|v| serde_json::from_str(&v))
            .transpose()
            .map_err(|e| Error::invalid("values", format!("not valid JSON: {e}")))?;
        let opts = ops::ImportOptions {
            root,
            step,
            overwrite,
            values,
            shm_dir: shm(shm_dir),
        };
        report(&ops::import_safetensors(&files, &opts, &p)?, text::import)
    })
    .map_err(err)
}

/// Which tensors and values differ between steps `a` and `b`.
#[pyfunction]
#[pyo3(signature = (root, a, b, progress=None))]
fn ops_diff(
    py: Python<'_>,
    root: PathBuf,
    a: u64,
    b: u64,
    progress: Option<Py<PyAny>>,
) -> PyResult<Report> {
    let p = PyProgress::new(progress);
    py.detach(|| report(&ops::diff(&root, a, b, &p)?, text::diff))
        .map_err(err)
}

/// Retention and removal of old unfinished saves.
#[pyfunction]
#[pyo3(signature = (root, keep_last=None, keep_every=None, unfinished_older_than=None, dry_run=false))]
fn ops_gc(
    py: Python<'_>,
    root: PathBuf,
    keep_last: Option<usize>,
    keep_every: Option<u64>,
    unfinished_older_than: Option<f64>,
    dry_run: bool,
) -> PyResult<Report> {
    let age = unfinished_older_than
        .map(|s| seconds("unfinished_older_than", s))
        .transpose()?;
    let opts = ops::GcOptions {
        keep_last,
        keep_every,
        unfinished_older_than: age,
        dry_run,
    };
    py.detach(|| report(&ops::gc(&root, &opts)?, text::gc))
        .map_err(err)
}

/// Flushes and commits what a dead trainer left resident on this node.
#[pyfunction]
#[pyo3(signature = (root, job=None, ranks=None, shm_dir=None, world_size=None, commit_timeout=600.0))]
fn ops_persist(
    py: Python<'_>,
    root: PathBuf,
    job: Option<String>,
    ranks: Option<Vec<u32>>,
    shm_dir: Option<PathBuf>,
    world_size: Option<u32>,
    commit_timeout: f64,
) -> PyResult<Report> {
    let opts = ops::PersistOptions {
        root,
        job,
        ranks,
        shm_dir: shm(shm_dir),
        world_size,
        commit_timeout: seconds("commit_timeout", commit_timeout)?,
    };
    py.detach(|| report(&ops::persist(&opts)?, text::persist))
        .map_err(err)
}

/// A quick benchmark of this machine at `size` bytes, in `dir`.
#[pyfunction]
#[pyo3(signature = (dir, size, shm_dir=None, progress=None))]
fn ops_bench(
    py: Python<'_>,
    dir: PathBuf,
    size: u64,
    shm_dir: Option<PathBuf>,
    progress: Option<Py<PyAny>>,
) -> PyResult<Report> {
    let p = PyProgress::new(progress);
    let opts = ops::BenchOptions {
        size,
        dir,
        shm_dir: shm(shm_dir),
    };
    py.detach(|| report(&ops::bench(&opts, &p)?, text::bench))
        .map_err(err)
}

/// Registers the operations in the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Report>()?;
    m.add_function(wrap_pyfunction!(ops_list, m)?)?;
    m.add_function(wrap_pyfunction!(ops_inspect, m)?)?;
    m.add_function(wrap_pyfunction!(ops_verify, m)?)?;
    m.add_function(wrap_pyfunction!(ops_export, m)?)?;
    m.add_function(wrap_pyfunction!(ops_import, m)?)?;
    m.add_function(wrap_pyfunction!(ops_diff, m)?)?;
    m.add_function(wrap_pyfunction!(ops_gc, m)?)?;
    m.add_function(wrap_pyfunction!(ops_persist, m)?)?;
    m.add_function(wrap_pyfunction!(ops_bench, m)?)?;
    Ok(())
}
