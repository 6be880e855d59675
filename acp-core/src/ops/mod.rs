//! The back end of the `acp` command line: list, inspect, verify, export,
//! import, diff, gc, persist and bench, on a checkpoint root and on this
//! node's shared-memory slots.
//!
//! Every operation returns a report that serializes to JSON (the `--json`
//! output of both command lines, the Rust binary and the Python script)
//! and renders as text ([`text`]). Operations that read or write many bytes
//! take a [`Progress`] to report to; none of them prints.
//!
//! Reading is read-only and verified: every byte taken from a data file is
//! checked against the chunk digests of the step's index before it is used
//! (see [`format`](crate::format)), so `export` and `diff` never pass on
//! corrupt data, and a changed byte is reported naming its file and tensor.
//!
//! # Exit codes
//!
//! The command lines map errors to exit codes with [`exit_code`]:
//!
//! | code | meaning |
//! |-----:|---------|
//! | 0 | success (for `verify`: every checked byte is intact) |
//! | 1 | a checkpoint is corrupt or failed verification |
//! | 2 | usage: bad arguments or input ([`ErrorKind::Invalid`], [`ErrorKind::Config`]) |
//! | 3 | not found: no such root, step, rank or file |
//! | 4 | any other error (I/O, no space, timeout, ...) |
//! | 5 | busy: a live process holds the job's shared-memory slots |
//! | 6 | unsupported: written by a newer acp (format version) |

mod bench;
mod diff;
mod export;
mod gc;
mod inspect;
mod list;
mod persist;
mod plain;
mod read;
mod resident;
mod shm;
#[cfg(test)]
mod tests;
pub mod text;
mod verify;

use std::path::{Path, PathBuf};

pub use bench::{bench, BenchOptions, BenchReport, BenchRow};
pub use diff::{diff, DiffReport, TensorDiff, ValueDiff, MAX_VALUE_DIFFS};
pub use export::{
    export_safetensors, import_safetensors, ExportReport, ImportOptions, ImportReport,
};
pub use gc::{gc, retention_plan, GcOptions, GcReport};
pub use inspect::{inspect, FileInfo, InspectReport, TensorInfo};
pub use list::{list, ListReport, StepRow};
pub use persist::{persist, IncompleteStep, PersistOptions, PersistReport, RankPersist};
pub use plain::{plain_values, plain_values_with, Leaves};
pub use resident::{job_id, resident, shm_prefix, ResidentSlot, DEFAULT_SHM_DIR};
pub use shm::{
    gc_text as shm_gc_text, list_text as shm_list_text, shm_gc, shm_list, ShmGcOptions,
    ShmGcReport, ShmGcRow, ShmListReport, ShmRing,
};
pub use verify::{verify, Problem, StepVerify, VerifyReport};

use crate::error::{Error, ErrorKind, Result};
use crate::storage::{LocalStorage, Storage};

/// The key that marks a values tree of acp's Python state codec
/// (`{"acp.codec": 1, "state": ...}`).
pub(crate) const CODEC_KEY: &str = "acp.codec";

/// Where an operation reports how far it got. Calls come from the thread
/// that runs the operation; implementations throttle their own drawing.
pub trait Progress: Sync {
    /// A phase of `total` bytes starts, e.g. "verify step 1200".
    fn begin(&self, what: &str, total: u64) {
        let _ = (what, total);
    }
    /// `n` more bytes of the current phase are done.
    fn advance(&self, n: u64) {
        let _ = n;
    }
    /// The current phase is over.
    fn end(&self) {}
}

/// A [`Progress`] that shows nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct Quiet;

impl Progress for Quiet {}

/// The exit code of a command that failed with `e` (see the module docs).
#[must_use]
pub fn exit_code(e: &Error) -> u8 {
    exit_code_of(e.kind())
}

/// The exit code of an error of kind `kind` (see the module docs).
#[must_use]
pub fn exit_code_of(kind: ErrorKind) -> u8 {
    match kind {
        ErrorKind::Corrupt => 1,
        ErrorKind::Invalid | ErrorKind::Config | ErrorKind::Exists => 2,
        ErrorKind::NotFound => 3,
        ErrorKind::Busy => 5,
        ErrorKind::Unsupported => 6,
        _ => 4,
    }
}

pub(crate) use crate::storage::open_root;

/// The steps to work on: `step` when given (it must be committed), else
/// the newest committed one.
pub(crate) fn pick_step(root: &LocalStorage, step: Option<u64>) -> Result<u64> {
    match step {
        Some(s) => {
            if root.is_committed(s) {
                Ok(s)
            } else {
                Err(Error::NotFound {
                    what: format!("step {s} in {}", root.location().display()),
                })
            }
        }
        None => root
            .steps()?
            .last()
            .copied()
            .ok_or_else(|| Error::NotFound {
                what: format!("committed checkpoint in {}", root.location().display()),
            }),
    }
}

/// A path as text for reports.
pub(crate) fn shown(p: &Path) -> String {
    p.display().to_string()
}

/// Seconds since the Unix epoch of a time.
pub(crate) fn epoch_secs(m: std::time::SystemTime) -> Option<f64> {
    m.duration_since(std::time::UNIX_EPOCH)
        .ok()
        .map(|d| d.as_secs_f64())
}

/// A unique scratch path next to `target`, for write-then-rename.
pub(crate) fn scratch_beside(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map_or_else(|| "out".to_owned(), |n| n.to_string_lossy().into_owned());
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    target.with_file_name(format!(".{name}.acp-{}-{nonce}.tmp", std::process::id()))
}
