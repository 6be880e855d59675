//! The `acp` command line of the wheel: acp-core's clap program
//! ([`acp_core::cli`]) with a front that hands conversions to and from
//! torch and MindSpore files to Python (`acp.convert`).

use std::ffi::OsString;
use std::sync::{Arc, Mutex, PoisonError};

use acp_core::cli::{self, Converted, ExportRequest, Failure, ImportRequest};
use acp_core::ops::{self, Progress};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::kind_of;

/// A Python callable `progress(phase, done, total)` that draws on the
/// command line's progress bar.
#[pyclass(module = "acp._acp", frozen)]
pub(crate) struct CliProgress {
    inner: Arc<dyn Progress + Send>,
    /// The phase being drawn and the bytes done in it.
    state: Mutex<Option<(String, u64)>>,
}

#[pymethods]
impl CliProgress {
    fn __call__(&self, phase: &str, done: u64, total: u64) {
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let last = match st.as_mut() {
            Some((p, last)) if p == phase => last,
            _ => {
                if st.is_some() {
                    self.inner.end();
                }
                self.inner.begin(phase, total);
                &mut st.insert((phase.to_owned(), 0)).1
            }
        };
        self.inner.advance(done.saturating_sub(*last));
        *last = (*last).max(done);
    }
}

impl CliProgress {
    fn end(&self) {
        if self
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
            .is_some()
        {
            self.inner.end();
        }
    }
}

/// The wheel's front: conversions run `acp.convert` under the GIL.
struct PyFront {
    framework: String,
}

impl PyFront {
    /// Calls `acp.convert.NAME(**kwargs, progress=...)`, which returns
    /// `(report dict, text)`.
    fn call(
        name: &str,
        kwargs: impl FnOnce(Python<'_>) -> PyResult<Bound<'_, PyDict>>,
        progress: Arc<dyn Progress + Send>,
    ) -> Result<Converted, Failure> {
        Python::attach(|py| {
            let bar = Py::new(
                py,
                CliProgress {
                    inner: progress,
                    state: Mutex::new(None),
                },
            )
            .map_err(|e| failure(py, &e))?;
            let result = (|| -> PyResult<(String, String)> {
                let kw = kwargs(py)?;
                kw.set_item("progress", bar.clone_ref(py))?;
                let module = py.import("acp.convert")?;
                let out = module.getattr(name)?.call((), Some(&kw))?;
                let (data, text): (Bound<'_, PyAny>, String) = out.extract()?;
                let json: String = py
                    .import("json")?
                    .getattr("dumps")?
                    .call1((data,))?
                    .extract()?;
                Ok((json, text))
            })();
            bar.get().end();
            let (json, text) = result.map_err(|e| failure(py, &e))?;
            let json = serde_json::from_str(&json).map_err(|e| Failure {
                message: format!("{name}: report is not JSON: {e}"),
                exit_code: 4,
            })?;
            Ok(Converted { json, text })
        })
    }
}

/// The exit code and message of a Python exception; one that is not acp's
/// nor an `OSError` is a bug, and its traceback is printed.
fn failure(py: Python<'_>, e: &PyErr) -> Failure {
    let Some(kind) = kind_of(py, e) else {
        e.display(py);
        let kind = e
            .get_type(py)
            .name()
            .map_or_else(|_| "exception".to_owned(), |n| n.to_string());
        return Failure {
            message: format!("internal error: {kind}: {}", e.value(py)),
            exit_code: 4,
        };
    };
    Failure {
        message: e.value(py).to_string(),
        exit_code: ops::exit_code_of(kind),
    }
}

impl cli::Front for PyFront {
    fn tensor_framework(&self) -> &str {
        &self.framework
    }

    fn export(
        &self,
        req: &ExportRequest,
        progress: Arc<dyn Progress + Send>,
    ) -> Result<Converted, Failure> {
        PyFront::call(
            "export",
            |py| {
                let kw = PyDict::new(py);
                kw.set_item("root", &req.root)?;
                kw.set_item("out", &req.out)?;
                kw.set_item("step", req.step)?;
                kw.set_item("rank", req.rank)?;
                kw.set_item("format", req.format.name())?;
                Ok(kw)
            },
            progress,
        )
    }

    fn import(
        &self,
        req: &ImportRequest,
        progress: Arc<dyn Progress + Send>,
    ) -> Result<Converted, Failure> {
        PyFront::call(
            "import_files",
            |py| {
                let kw = PyDict::new(py);
                kw.set_item("files", PyTuple::new(py, &req.files)?)?;
                kw.set_item("root", &req.root)?;
                kw.set_item("step", req.step)?;
                kw.set_item("format", req.format.name())?;
                kw.set_item("force", req.force)?;
                kw.set_item("shm_dir", &req.shm_dir)?;
                Ok(kw)
            },
            progress,
        )
    }
}

/// Runs the `acp` command line on `argv` (the program name first) and
/// returns its exit code; the GIL is released but for conversions.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<OsString>) -> PyResult<u8> {
    let torch = py
        .import("importlib.util")?
        .getattr("find_spec")?
        .call1(("torch",))?;
    let front = PyFront {
        framework: if torch.is_none() { "numpy" } else { "torch" }.to_owned(),
    };
    Ok(py.detach(|| cli::run(argv, &front)))
}

/// Registers the command line in the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CliProgress>()?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    Ok(())
}
