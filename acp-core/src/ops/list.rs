//! `acp ls`: the committed steps of a root, and what this node holds of
//! them in shared memory.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::resident::{job_id, resident, ResidentSlot};
use super::{epoch_secs, open_root, shown};
use crate::error::Result;
use crate::storage::Storage;

/// One committed step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepRow {
    /// The step.
    pub step: u64,
    /// Data files (one per writing rank).
    pub files: usize,
    /// The world size it was saved with.
    pub world_size: u32,
    /// Bytes over all its files.
    pub bytes: u64,
    /// Tensors over all its files.
    pub tensors: usize,
    /// When it was committed (the index's modification time, Unix seconds).
    pub committed_at: Option<f64>,
    /// The ranks whose shared-memory ring on this node holds it.
    pub resident_ranks: Vec<u32>,
    /// Why its index cannot be read, when it cannot (the step is then
    /// listed with zeros).
    pub error: Option<String>,
}

/// What `acp ls` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListReport {
    /// The checkpoint root (canonical).
    pub root: String,
    /// The job id whose slots were looked at.
    pub job: String,
    /// The shared-memory directory looked at.
    pub shm_dir: String,
    /// The committed steps, ascending.
    pub steps: Vec<StepRow>,
    /// The newest committed step.
    pub latest: Option<u64>,
    /// Complete images in this node's slots whose step is not committed:
    /// left by a process that died before its flush (`acp persist`
    /// commits those newer than `latest`).
    pub resident_only: Vec<ResidentSlot>,
    /// Every slot file of the job on this node.
    pub slots: Vec<ResidentSlot>,
    /// Unfinished saves in the root (`.pending-…`, `.commit-…`, `.trash-…`
    /// directories): in progress, or left by a dead process.
    pub unfinished: usize,
}

/// Lists the committed steps of `root` and the slots of `job` (default:
/// the canonical root path, as the engine names them) in `shm_dir`.
///
/// # Errors
/// [`Error::NotFound`](crate::Error::NotFound) when `root` does not exist;
/// [`Error::Io`](crate::Error::Io) listing it.
pub fn list(root: &Path, job: Option<&str>, shm_dir: &Path) -> Result<ListReport> {
    let root = open_root(root)?;
    let job = job_id(root.location(), job);
    let slots = resident(shm_dir, &job, None)?;
    let steps = root.steps()?;
    let mut rows = Vec::with_capacity(steps.len());
    for &step in &steps {
        let mut resident_ranks: Vec<u32> = slots
            .iter()
            .filter(|s| s.complete && s.step == Some(step))
            .map(|s| s.rank)
            .collect();
        resident_ranks.dedup();
        let committed_at = root.committed_at(step).and_then(epoch_secs);
        let row = match root.read_index(step) {
            Ok(index) => StepRow {
                step,
                files: index.files.len(),
                world_size: index.world_size,
                bytes: index.files.values().map(|f| f.size).sum(),
                tensors: index.weight_map.len(),
                committed_at,
                resident_ranks,
                error: None,
            },
            Err(e) => StepRow {
                step,
                files: 0,
                world_size: 0,
                bytes: 0,
                tensors: 0,
                committed_at,
                resident_ranks,
                error: Some(e.to_string()),
            },
        };
        rows.push(row);
    }
    let resident_only = slots
        .iter()
        .filter(|s| s.complete && s.step.is_some_and(|st| !steps.contains(&st)))
        .cloned()
        .collect();
    // Unfinished saves and removals; a half-written `latest` hint is not one.
    let unfinished = root
        .leftovers()
        .map(|l| l.iter().filter(|l| !l.hint).count())
        .unwrap_or(0);
    Ok(ListReport {
        root: shown(root.location()),
        job,
        shm_dir: shown(shm_dir),
        latest: steps.last().copied(),
        steps: rows,
        resident_only,
        slots,
        unfinished,
    })
}
