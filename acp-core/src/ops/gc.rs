//! `acp gc`: retention on a root without opening a ring, and removal of
//! what dead saves left behind.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{open_root, shown};
use crate::engine::retention::{check_keep_last, removable};
use crate::error::Result;
use crate::storage::Storage;

/// What `gc` removes.
#[derive(Debug, Clone, Default)]
pub struct GcOptions {
    /// Keep the newest `keep_last` committed steps (at least 1); `None`
    /// removes no committed step.
    pub keep_last: Option<usize>,
    /// Also keep every step that is a multiple of this.
    pub keep_every: Option<u64>,
    /// Also remove unfinished saves (`.pending-…`, `.commit-…`, `.trash-…`
    /// directories and `.latest-…` files) not modified for this long.
    pub unfinished_older_than: Option<Duration>,
    /// Only report what would be removed.
    pub dry_run: bool,
}

/// What `gc` removed (or, with `dry_run`, would remove).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GcReport {
    /// The checkpoint root.
    pub root: String,
    /// Whether nothing was removed on purpose.
    pub dry_run: bool,
    /// Committed steps removed.
    pub removed_steps: Vec<u64>,
    /// Committed steps kept.
    pub kept_steps: Vec<u64>,
    /// Of those, the steps retention would have removed but a kept step
    /// references (incremental steps): they go once nothing kept does.
    #[serde(default)]
    pub referenced_steps: Vec<u64>,
    /// Unfinished-save entries removed (names in the root).
    pub removed_unfinished: Vec<String>,
    /// Bytes freed (approximate: the files' sizes).
    pub freed_bytes: u64,
}

pub use crate::engine::retention::retention_plan;

/// Applies retention to `root` (never removing a step that a kept step
/// references; removing each step by renaming it out of
/// view, syncing the root, then deleting it, so a reader never sees half a
/// step) and, when asked, removes unfinished saves older than the given
/// age. Safe beside a live trainer: it never removes the newest step, and
/// an unfinished save younger than the age is left alone.
///
/// # Errors
/// [`Error::Config`](crate::Error::Config) for `keep_last == 0`; [`Error::NotFound`](crate::Error::NotFound); [`Error::Io`](crate::Error::Io).
pub fn gc(root: &Path, opts: &GcOptions) -> Result<GcReport> {
    let root = open_root(root)?;
    if let Some(k) = opts.keep_last {
        check_keep_last(k)?;
    }
    let steps = root.steps()?;
    let (remove, referenced_steps) = match opts.keep_last {
        Some(k) => removable(&root, k, opts.keep_every)?,
        None => (Vec::new(), Vec::new()),
    };
    let mut freed = 0;
    // Newest first: a step goes before the steps it references (all in
    // the plan with it), so a reader never finds a listed step whose
    // referenced step is already gone, and reports a good step corrupt.
    for &step in remove.iter().rev() {
        freed += root.step_bytes(step);
        if !opts.dry_run {
            root.remove_step(step)?;
        }
    }
    let mut removed_unfinished = Vec::new();
    if let Some(age) = opts.unfinished_older_than {
        for left in root.leftovers()? {
            let old = left
                .modified
                .and_then(|m| m.elapsed().ok())
                .is_some_and(|e| e >= age);
            if !old {
                continue;
            }
            freed += left.bytes;
            if !opts.dry_run {
                root.remove_leftover(&left.name)?;
            }
            removed_unfinished.push(left.name);
        }
        removed_unfinished.sort();
    }
    Ok(GcReport {
        root: shown(root.location()),
        dry_run: opts.dry_run,
        kept_steps: steps
            .iter()
            .copied()
            .filter(|s| !remove.contains(s))
            .collect(),
        removed_steps: remove,
        referenced_steps,
        removed_unfinished,
        freed_bytes: freed,
    })
}
