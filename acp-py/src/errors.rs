//! The Python exception hierarchy and the mapping of each
//! [`acp_core::ErrorKind`] to one of its classes.
//!
//! ```text
//! AcpError(Exception)
//! ├── CheckpointNotFound(AcpError, FileNotFoundError)   NotFound
//! ├── CheckpointCorrupt(AcpError)                       Corrupt
//! ├── CheckpointExists(AcpError, FileExistsError)       Exists
//! ├── InvalidInput(AcpError, ValueError)                Invalid
//! ├── ConfigError(AcpError, ValueError)                 Config
//! ├── StorageError(AcpError, OSError)                   Io
//! │   └── NoSpace(StorageError)                         NoSpace
//! ├── BusyError(AcpError)                               Busy
//! ├── AcpTimeout(AcpError, TimeoutError)                Timeout
//! ├── EngineClosed(AcpError)                            Closed
//! └── Unsupported(AcpError)                             Unsupported
//! ```
//!
//! The second bases let callers catch the usual built-in classes
//! (`except FileNotFoundError`, `except ValueError`, `except OSError`). The
//! classes are built with `type()` because `create_exception!` takes a single
//! base; their `__module__` is `acp`, where the package re-exports them.

use acp_core::{Error, ErrorKind};
use pyo3::exceptions::{
    PyException, PyFileExistsError, PyFileNotFoundError, PyOSError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The exception classes, created once per interpreter.
#[derive(Debug)]
pub(crate) struct Classes {
    pub(crate) base: Py<PyType>,
    pub(crate) not_found: Py<PyType>,
    pub(crate) corrupt: Py<PyType>,
    pub(crate) exists: Py<PyType>,
    pub(crate) invalid: Py<PyType>,
    pub(crate) config: Py<PyType>,
    pub(crate) storage: Py<PyType>,
    pub(crate) no_space: Py<PyType>,
    pub(crate) busy: Py<PyType>,
    pub(crate) timeout: Py<PyType>,
    pub(crate) closed: Py<PyType>,
    pub(crate) unsupported: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

fn new_class<'py>(
    py: Python<'py>,
    name: &str,
    doc: &str,
    bases: &[Bound<'py, PyType>],
) -> PyResult<Py<PyType>> {
    let dict = PyDict::new(py);
    dict.set_item("__module__", "acp")?;
    dict.set_item("__doc__", doc)?;
    let bases = PyTuple::new(py, bases)?;
    let class = py.get_type::<PyType>().call1((name, bases, dict))?;
    Ok(class.cast_into::<PyType>()?.unbind())
}

impl Classes {
    fn create(py: Python<'_>) -> PyResult<Classes> {
        let base = new_class(
            py,
            "AcpError",
            "Base class of every error raised by acp.",
            &[py.get_type::<PyException>()],
        )?;
        let b = base.bind(py).clone();
        let sub = |name: &str, doc: &str, extra: Option<Bound<'_, PyType>>| {
            let mut bases = vec![b.clone()];
            bases.extend(extra);
            new_class(py, name, doc, &bases)
        };
        let storage = sub(
            "StorageError",
            "An operating-system call on the checkpoint storage failed.",
            Some(py.get_type::<PyOSError>()),
        )?;
        // `OSError.__str__` formats `[Errno N] strerror: filename` once
        // `errno` and `filename` are set, which would replace acp's message
        // (operation, path and cause) with `[Errno 5] None: '...'`. The
        // message is what users read: keep `BaseException.__str__`.
        storage.bind(py).setattr(
            "__str__",
            py.get_type::<pyo3::exceptions::PyBaseException>()
                .getattr("__str__")?,
        )?;
        let no_space = new_class(
            py,
            "NoSpace",
            "The checkpoint storage is full (ENOSPC or EDQUOT).",
            &[storage.bind(py).clone()],
        )?;
        Ok(Classes {
            not_found: sub(
                "CheckpointNotFound",
                "The checkpoint, step or file asked for does not exist.",
                Some(py.get_type::<PyFileNotFoundError>()),
            )?,
            corrupt: sub(
                "CheckpointCorrupt",
                "Stored or resident bytes do not match what was saved, or a file is malformed.",
                None,
            )?,
            exists: sub(
                "CheckpointExists",
                "The step is already committed and the save did not ask to overwrite it.",
                Some(py.get_type::<PyFileExistsError>()),
            )?,
            invalid: sub(
                "InvalidInput",
                "The input cannot be saved or loaded as given (the message names the key).",
                Some(py.get_type::<PyValueError>()),
            )?,
            config: sub(
                "ConfigError",
                "A configuration value is impossible (the message names the field).",
                Some(py.get_type::<PyValueError>()),
            )?,
            busy: sub(
                "BusyError",
                "A resource is held elsewhere, e.g. the job's ring is open in another process.",
                None,
            )?,
            timeout: sub(
                "AcpTimeout",
                "A wait ran past its timeout.",
                Some(py.get_type::<PyTimeoutError>()),
            )?,
            closed: sub("EngineClosed", "The checkpointer is closed.", None)?,
            unsupported: sub(
                "Unsupported",
                "The checkpoint or platform needs something acp does not support, \
                 e.g. a newer format version.",
                None,
            )?,
            storage,
            no_space,
            base,
        })
    }

    /// Every class with its Python name, for registration.
    pub(crate) fn named(&self) -> [(&'static str, &Py<PyType>); 12] {
        [
            ("AcpError", &self.base),
            ("CheckpointNotFound", &self.not_found),
            ("CheckpointCorrupt", &self.corrupt),
            ("CheckpointExists", &self.exists),
            ("InvalidInput", &self.invalid),
            ("ConfigError", &self.config),
            ("StorageError", &self.storage),
            ("NoSpace", &self.no_space),
            ("BusyError", &self.busy),
            ("AcpTimeout", &self.timeout),
            ("EngineClosed", &self.closed),
            ("Unsupported", &self.unsupported),
        ]
    }

    fn for_kind(&self, kind: ErrorKind) -> &Py<PyType> {
        match kind {
            ErrorKind::NotFound => &self.not_found,
            ErrorKind::Corrupt => &self.corrupt,
            ErrorKind::Invalid => &self.invalid,
            ErrorKind::Io => &self.storage,
            ErrorKind::NoSpace => &self.no_space,
            ErrorKind::Config => &self.config,
            ErrorKind::Exists => &self.exists,
            ErrorKind::Busy => &self.busy,
            ErrorKind::Timeout => &self.timeout,
            ErrorKind::Closed => &self.closed,
            ErrorKind::Unsupported => &self.unsupported,
            _ => &self.base,
        }
    }
}

/// The exception classes of this interpreter.
pub(crate) fn classes(py: Python<'_>) -> PyResult<&Classes> {
    CLASSES.get_or_try_init(py, || Classes::create(py))
}

/// The Python exception for `e`: the class of its kind, the Rust message,
/// and for OS errors `errno` and `filename` set as on an `OSError`.
pub(crate) fn to_py(py: Python<'_>, e: &Error) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let class = classes(py)?.for_kind(e.kind()).bind(py);
        let exc = class.call1((e.to_string(),))?;
        if let Error::Io { path, source, .. } | Error::NoSpace { path, source, .. } = e {
            if let Some(code) = source.raw_os_error() {
                exc.setattr("errno", code)?;
            }
            exc.setattr("filename", path.to_string_lossy().as_ref())?;
        }
        Ok(PyErr::from_value(exc))
    };
    build().unwrap_or_else(|failure| failure)
}

/// The kind of a Python exception raised by acp code: the kind whose class
/// it is an instance of (the most specific first), `NotFound` for a
/// `FileNotFoundError`, `Io` for another `OSError`; `None` for anything
/// else.
pub(crate) fn kind_of(py: Python<'_>, e: &PyErr) -> Option<ErrorKind> {
    let c = classes(py).ok()?;
    let kinds = [
        (ErrorKind::Corrupt, &c.corrupt),
        (ErrorKind::NotFound, &c.not_found),
        (ErrorKind::Exists, &c.exists),
        (ErrorKind::Invalid, &c.invalid),
        (ErrorKind::Config, &c.config),
        (ErrorKind::Busy, &c.busy),
        (ErrorKind::Timeout, &c.timeout),
        (ErrorKind::Closed, &c.closed),
        (ErrorKind::Unsupported, &c.unsupported),
        (ErrorKind::NoSpace, &c.no_space),
        (ErrorKind::Io, &c.storage),
    ];
    if let Some((kind, _)) = kinds
        .iter()
        .find(|(_, class)| e.is_instance(py, class.bind(py)))
    {
        return Some(*kind);
    }
    if e.is_instance_of::<pyo3::exceptions::PyFileNotFoundError>(py) {
        return Some(ErrorKind::NotFound);
    }
    if e.is_instance_of::<pyo3::exceptions::PyOSError>(py) {
        return Some(ErrorKind::Io);
    }
    None
}

/// [`to_py`] for use in `map_err`.
pub(crate) fn err(e: Error) -> PyErr {
    Python::attach(|py| to_py(py, &e))
}

/// An `acp.InvalidInput` about `what`.
pub(crate) fn invalid(what: impl std::fmt::Display, reason: impl std::fmt::Display) -> PyErr {
    err(Error::invalid(what, reason))
}
