//! The one error type of acp-core.
//!
//! Variants are named after what the caller can do about them, and each one
//! carries the object it is about (path, step, tensor, field). Messages are
//! lowercase and start with that object.

use std::fmt;
use std::path::{Path, PathBuf};

/// A `Result` whose error is [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in acp-core.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The checkpoint, step or file asked for does not exist.
    #[error("{what}: not found")]
    NotFound {
        /// What was looked for, e.g. "step 1200 in /ckpt/run1".
        what: String,
    },
    /// Stored or resident bytes do not match what was saved, or a file is
    /// malformed. Never returned for a checkpoint that is intact.
    #[error("{}", corrupt_message(path, tensor.as_deref(), reason))]
    Corrupt {
        /// The file (or shared-memory slot) that is corrupt.
        path: PathBuf,
        /// The tensor whose bytes are affected, when one is known.
        tensor: Option<String>,
        /// What is wrong.
        reason: String,
    },
    /// The caller's input is not acceptable: a bad tensor name, a value JSON
    /// cannot hold, a size mismatch.
    #[error("{what}: {reason}")]
    Invalid {
        /// The tensor, key or argument at fault.
        what: String,
        /// Why it is refused.
        reason: String,
    },
    /// An operating-system call failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// The operation, e.g. "write", "fsync", "rename".
        op: &'static str,
        /// The path it was applied to.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The device is full (ENOSPC or EDQUOT).
    #[error("{op} {}: no space left on device", path.display())]
    NoSpace {
        /// The operation that ran out of space.
        op: &'static str,
        /// The path being written.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A configuration value is impossible.
    #[error("config `{field}`: {reason}")]
    Config {
        /// The [`EngineConfig`](crate::EngineConfig) field.
        field: &'static str,
        /// Why it is refused.
        reason: String,
    },
    /// The step is already committed and the save did not ask to overwrite.
    #[error("step {step}: already committed in {}", root.display())]
    Exists {
        /// The step.
        step: u64,
        /// The checkpoint root.
        root: PathBuf,
    },
    /// A resource is held by someone else: the ring slots of this job and
    /// rank are open in another live process, or no ring slot became free.
    #[error("{what}: busy: {reason}")]
    Busy {
        /// What is busy.
        what: String,
        /// Who holds it or how long we waited.
        reason: String,
    },
    /// A wait ran past its timeout.
    #[error("{what}: timed out after {secs:.3} s")]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long we waited.
        secs: f64,
    },
    /// The engine is closed.
    #[error("engine for {}: closed", root.display())]
    Closed {
        /// The checkpoint root.
        root: PathBuf,
    },
    /// The checkpoint or platform needs something acp does not support, e.g.
    /// a newer format version.
    #[error("{what}: unsupported: {reason}")]
    Unsupported {
        /// What is unsupported.
        what: String,
        /// Why.
        reason: String,
    },
}

fn corrupt_message(path: &Path, tensor: Option<&str>, reason: &str) -> String {
    match tensor {
        Some(t) => format!("{}: tensor `{t}`: {reason}", path.display()),
        None => format!("{}: {reason}", path.display()),
    }
}

/// The kind of an [`Error`], for bindings that map each to an exception.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// See [`Error::NotFound`].
    NotFound,
    /// See [`Error::Corrupt`].
    Corrupt,
    /// See [`Error::Invalid`].
    Invalid,
    /// See [`Error::Io`].
    Io,
    /// See [`Error::NoSpace`].
    NoSpace,
    /// See [`Error::Config`].
    Config,
    /// See [`Error::Exists`].
    Exists,
    /// See [`Error::Busy`].
    Busy,
    /// See [`Error::Timeout`].
    Timeout,
    /// See [`Error::Closed`].
    Closed,
    /// See [`Error::Unsupported`].
    Unsupported,
}

impl Error {
    /// The kind of this error.
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::NotFound { .. } => ErrorKind::NotFound,
            Error::Corrupt { .. } => ErrorKind::Corrupt,
            Error::Invalid { .. } => ErrorKind::Invalid,
            Error::Io { .. } => ErrorKind::Io,
            Error::NoSpace { .. } => ErrorKind::NoSpace,
            Error::Config { .. } => ErrorKind::Config,
            Error::Exists { .. } => ErrorKind::Exists,
            Error::Busy { .. } => ErrorKind::Busy,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::Closed { .. } => ErrorKind::Closed,
            Error::Unsupported { .. } => ErrorKind::Unsupported,
        }
    }

    /// Wraps an OS error from `op` on `path`, as [`Error::NoSpace`] when the
    /// device is full and [`Error::Io`] otherwise.
    #[must_use]
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        let path = path.into();
        match source.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => Error::NoSpace { op, path, source },
            _ => Error::Io { op, path, source },
        }
    }

    /// A [`Error::Corrupt`] about `path` (and `tensor`, when known).
    #[must_use]
    pub fn corrupt(
        path: impl Into<PathBuf>,
        tensor: Option<&str>,
        reason: impl fmt::Display,
    ) -> Self {
        Error::Corrupt {
            path: path.into(),
            tensor: tensor.map(str::to_owned),
            reason: reason.to_string(),
        }
    }

    /// An [`Error::Invalid`] about `what`.
    #[must_use]
    pub fn invalid(what: impl fmt::Display, reason: impl fmt::Display) -> Self {
        Error::Invalid {
            what: what.to_string(),
            reason: reason.to_string(),
        }
    }

    /// A copy of this error, for handing one failure to several waiters.
    /// OS errors keep their errno and message.
    #[must_use]
    pub fn duplicate(&self) -> Self {
        fn dup_io(e: &std::io::Error) -> std::io::Error {
            match e.raw_os_error() {
                Some(code) => std::io::Error::from_raw_os_error(code),
                None => std::io::Error::new(e.kind(), e.to_string()),
            }
        }
        match self {
            Error::NotFound { what } => Error::NotFound { what: what.clone() },
            Error::Corrupt {
                path,
                tensor,
                reason,
            } => Error::Corrupt {
                path: path.clone(),
                tensor: tensor.clone(),
                reason: reason.clone(),
            },
            Error::Invalid { what, reason } => Error::Invalid {
                what: what.clone(),
                reason: reason.clone(),
            },
            Error::Io { op, path, source } => Error::Io {
                op,
                path: path.clone(),
                source: dup_io(source),
            },
            Error::NoSpace { op, path, source } => Error::NoSpace {
                op,
                path: path.clone(),
                source: dup_io(source),
            },
            Error::Config { field, reason } => Error::Config {
                field,
                reason: reason.clone(),
            },
            Error::Exists { step, root } => Error::Exists {
                step: *step,
                root: root.clone(),
            },
            Error::Busy { what, reason } => Error::Busy {
                what: what.clone(),
                reason: reason.clone(),
            },
            Error::Timeout { what, secs } => Error::Timeout {
                what: what.clone(),
                secs: *secs,
            },
            Error::Closed { root } => Error::Closed { root: root.clone() },
            Error::Unsupported { what, reason } => Error::Unsupported {
                what: what.clone(),
                reason: reason.clone(),
            },
        }
    }
}

/// Bytes for people, in messages and reports: `1536` → `"1.5 KiB"`.
#[must_use]
pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    #[expect(
        clippy::cast_precision_loss,
        reason = "one decimal for people; exact sizes are in the fields"
    )]
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enospc_maps_to_no_space() {
        let e = Error::io(
            "write",
            "/x/f",
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert_eq!(e.kind(), ErrorKind::NoSpace);
        assert!(e.to_string().contains("/x/f"), "{e}");
    }

    #[test]
    fn corrupt_names_file_and_tensor() {
        let e = Error::corrupt(
            "/c/rank-00000.safetensors",
            Some("blk.3.w"),
            "digest mismatch",
        );
        assert_eq!(
            e.to_string(),
            "/c/rank-00000.safetensors: tensor `blk.3.w`: digest mismatch"
        );
        assert_eq!(e.duplicate().to_string(), e.to_string());
    }
}
