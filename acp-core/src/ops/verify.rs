//! `acp verify`: re-hash every file of a step against its index.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::read;
use super::{open_root, pick_step, shown, Progress};
use crate::engine::check_file_header;
use crate::error::{Error, ErrorKind, Result};
use crate::format::INDEX_FILE_NAME;
use crate::storage::{LocalStorage, Storage};

/// One thing wrong with a step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    /// The file at fault (a data file or the index).
    pub file: String,
    /// The tensors whose bytes are affected (empty for header or index
    /// problems).
    pub tensors: Vec<String>,
    /// What is wrong.
    pub reason: String,
}

/// The verification of one step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepVerify {
    /// The step.
    pub step: u64,
    /// True when every byte matched.
    pub ok: bool,
    /// Files checked.
    pub files: usize,
    /// Bytes re-hashed.
    pub bytes: u64,
    /// What is wrong (empty when `ok`).
    pub problems: Vec<Problem>,
}

/// What `acp verify` reports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// The checkpoint root.
    pub root: String,
    /// True when every step checked is intact.
    pub ok: bool,
    /// Each step checked, ascending.
    pub steps: Vec<StepVerify>,
}

/// Re-hashes every file of step `step` (the newest when `None`), or of every
/// committed step with `all`, against the chunk digests of its index, and
/// checks each header and that the index's tensors are where it says.
/// Finds every changed chunk, not just the first.
///
/// # Errors
/// [`Error::NotFound`] for a missing root or step; [`Error::Io`] when a file
/// cannot be read. A corrupt step is not an error: it is reported with
/// `ok: false`.
pub fn verify(
    root: &Path,
    step: Option<u64>,
    all: bool,
    progress: &dyn Progress,
) -> Result<VerifyReport> {
    let root = open_root(root)?;
    let steps = if all {
        let s = root.steps()?;
        if s.is_empty() {
            return Err(Error::NotFound {
                what: format!("committed checkpoint in {}", root.location().display()),
            });
        }
        s
    } else {
        vec![pick_step(&root, step)?]
    };
    let mut out = Vec::with_capacity(steps.len());
    for step in steps {
        out.push(verify_step(&root, step, progress)?);
    }
    Ok(VerifyReport {
        root: shown(root.location()),
        ok: out.iter().all(|s| s.ok),
        steps: out,
    })
}

/// A problem from an error: its path and tensor when it names them.
fn problem(e: &Error, fallback: &Path) -> Problem {
    match e {
        Error::Corrupt {
            path,
            tensor,
            reason,
        } => Problem {
            file: shown(path),
            tensors: tensor.iter().cloned().collect(),
            reason: reason.clone(),
        },
        other => Problem {
            file: shown(fallback),
            tensors: Vec::new(),
            reason: other.to_string(),
        },
    }
}

fn verify_step(root: &LocalStorage, step: u64, progress: &dyn Progress) -> Result<StepVerify> {
    let index_path = root.describe(step, INDEX_FILE_NAME);
    let mut report = StepVerify {
        step,
        ok: false,
        files: 0,
        bytes: 0,
        problems: Vec::new(),
    };
    let index = match root.read_index(step) {
        Ok(i) => i,
        Err(e) if e.kind() == ErrorKind::Corrupt => {
            report.problems.push(problem(&e, &index_path));
            return Ok(report);
        }
        // A newer format is not a corruption: `Unsupported`, as `inspect`,
        // `export` and `gc` say (it was reported as CORRUPT, exit 1).
        Err(e) => return Err(e),
    };
    let total = index.files.values().map(|f| f.size).sum();
    // The index's tensors by file, so that each header is checked in one pass.
    let mut mapped: HashMap<&str, Vec<&str>> = HashMap::new();
    for (t, file) in &index.weight_map {
        mapped.entry(file.as_str()).or_default().push(t.as_str());
    }
    progress.begin(&format!("verify step {step}"), total);
    for (name, entry) in &index.files {
        report.files += 1;
        let mut f = match read::open(root, step, name, entry) {
            Ok(f) => f,
            Err(e) if e.kind() == ErrorKind::Corrupt => {
                report
                    .problems
                    .push(problem(&e, &root.describe(step, name)));
                progress.advance(entry.size);
                continue;
            }
            Err(e) => {
                progress.end();
                return Err(e);
            }
        };
        let header = f.header().cloned();
        let bad = match f.check_all(&mut |n| progress.advance(n)) {
            Ok(b) => b,
            Err(e) => {
                progress.end();
                return Err(e);
            }
        };
        report.bytes += entry.size;
        for b in &bad {
            report.problems.push(Problem {
                file: shown(f.path()),
                tensors: b.tensors.clone(),
                reason: b.reason(),
            });
        }
        match header {
            Ok(header) => {
                let held: HashSet<&str> = header.entries.iter().map(|e| e.name.as_str()).collect();
                for &t in mapped.get(name.as_str()).map_or(&[][..], Vec::as_slice) {
                    if !held.contains(t) {
                        report.problems.push(Problem {
                            file: shown(f.path()),
                            tensors: vec![t.to_owned()],
                            reason: "the index maps the tensor to this file, whose header lacks it"
                                .to_owned(),
                        });
                    }
                }
                // The rest of what a load refuses: another step, a tensor
                // the index does not map here, another rank or world size.
                if let Err(e) = check_file_header(f.path(), &header, step, &index, name) {
                    if report.problems.iter().all(|p| p.file != shown(f.path())) {
                        report.problems.push(problem(&e, f.path()));
                    }
                }
            }
            // A header under a changed chunk is already reported above.
            Err(e) if bad.is_empty() => report.problems.push(problem(&e, f.path())),
            Err(_) => {}
        }
    }
    progress.end();
    report.ok = report.problems.is_empty();
    Ok(report)
}
