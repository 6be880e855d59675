//! `acp persist`: flush and commit the checkpoints a dead trainer left
//! resident in this node's shared memory.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::resident::{job_id, resident, ResidentSlot};
use super::{open_root, shown};
use crate::error::{Error, Result};
use crate::storage::Storage;
use crate::{Engine, EngineConfig};

/// What to persist.
#[derive(Debug, Clone)]
pub struct PersistOptions {
    /// The checkpoint root.
    pub root: PathBuf,
    /// The job id the trainer used; default: the canonical root path (the
    /// engine's default).
    pub job: Option<String>,
    /// The ranks to persist; default: every rank with slots on this node.
    pub ranks: Option<Vec<u32>>,
    /// Where the slots are (default `/dev/shm`).
    pub shm_dir: PathBuf,
    /// The world size the trainer ran with; default: read from the newest
    /// resident image.
    pub world_size: Option<u32>,
    /// With several ranks: how long rank 0 waits for the others (which may
    /// be persisted on other nodes at the same time).
    pub commit_timeout: Duration,
}

/// What one rank persisted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPersist {
    /// The rank.
    pub rank: u32,
    /// Steps found complete in its slots.
    pub resident_steps: Vec<u64>,
    /// Of those, the steps flushed and committed now (newer than the
    /// newest committed step).
    pub persisted_steps: Vec<u64>,
    /// Slots found half-staged (the trainer died mid-copy) and discarded.
    pub discarded_half_staged: usize,
}

/// What `acp persist` did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PersistReport {
    /// The checkpoint root.
    pub root: String,
    /// The job id.
    pub job: String,
    /// The world size used for the commit.
    pub world_size: u32,
    /// Per rank.
    pub ranks: Vec<RankPersist>,
    /// The newest committed step afterwards.
    pub latest: Option<u64>,
}

/// Opens an engine on `opts.root` for each rank with slots on this node,
/// with `persist_on_open`: complete resident checkpoints newer than the
/// newest committed step are flushed and committed. Waits for them. Ranks
/// run at once, so a multi-rank step whose ranks all sit on this node
/// commits; ranks on other nodes must be persisted there meanwhile.
///
/// # Errors
/// [`Error::Busy`] when a live process (the trainer) holds a rank's slots;
/// [`Error::NotFound`] for a missing root; the flush's error (e.g.
/// [`Error::NoSpace`], [`Error::Timeout`] naming ranks that did not report).
pub fn persist(opts: &PersistOptions) -> Result<PersistReport> {
    let root = open_root(&opts.root)?;
    let job = job_id(root.location(), opts.job.as_deref());
    let slots = resident(&opts.shm_dir, &job, None)?;
    let ranks: Vec<u32> = match &opts.ranks {
        Some(r) => r.clone(),
        None => super::resident::ranks(&slots).into_iter().collect(),
    };
    if let Some(s) = slots.iter().find(|s| s.locked && ranks.contains(&s.rank)) {
        return Err(Error::Busy {
            what: format!("rank {} of job `{job}` ({})", s.rank, s.path),
            reason: format!(
                "its slots are held by live process {}; a running trainer persists its own checkpoints",
                s.owner_pid
            ),
        });
    }
    let world_size = opts.world_size.unwrap_or_else(|| {
        slots
            .iter()
            .filter(|s| s.complete)
            .max_by_key(|s| s.step)
            .and_then(|s| s.world_size)
            .unwrap_or(1)
    });
    let results: Vec<Result<RankPersist>> = std::thread::scope(|scope| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|&rank| {
                let mine: Vec<&ResidentSlot> = slots.iter().filter(|s| s.rank == rank).collect();
                let job = job.clone();
                let root = root.location().to_path_buf();
                std::thread::Builder::new()
                    .name(format!("acp-persist-r{rank}"))
                    .spawn_scoped(scope, move || {
                        crate::io::block_async_signals();
                        persist_rank(&root, &job, rank, world_size, &mine, opts)
                    })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|_| Err(Error::invalid("persist", "a rank's thread panicked"))),
                Err(e) => Err(Error::io("start thread", &opts.root, e)),
            })
            .collect()
    });
    let ranks = results.into_iter().collect::<Result<Vec<_>>>()?;
    Ok(PersistReport {
        root: shown(root.location()),
        job,
        world_size,
        ranks,
        latest: root.steps()?.last().copied(),
    })
}

fn persist_rank(
    root: &Path,
    job: &str,
    rank: u32,
    world_size: u32,
    slots: &[&ResidentSlot],
    opts: &PersistOptions,
) -> Result<RankPersist> {
    let n = slots.iter().map(|s| s.slot + 1).max().unwrap_or(0);
    if n == 0 {
        return Ok(RankPersist {
            rank,
            resident_steps: Vec::new(),
            persisted_steps: Vec::new(),
            discarded_half_staged: 0,
        });
    }
    // Recovery takes slots as they are; the budget only has to give each
    // slot room for its largest image.
    let largest = slots.iter().map(|s| s.file_bytes).max().unwrap_or(0);
    let budget = (largest + (8 << 20)) * n as u64;
    let engine = Engine::open(
        EngineConfig::new(root)
            .with_job(job)
            .with_rank(rank)
            .with_world_size(world_size.max(rank + 1))
            .with_shm_dir(&opts.shm_dir)
            .with_ring_slots(n)
            .with_ring_bytes(budget)
            .with_mlock(false)
            .with_persist_on_open(true)
            .with_commit_timeout(opts.commit_timeout),
    )?;
    let report = engine.open_report().clone();
    let closed = engine.close();
    drop(engine);
    closed?;
    Ok(RankPersist {
        rank,
        resident_steps: report.resident_steps,
        persisted_steps: report.persisting_steps,
        discarded_half_staged: report.discarded_half_staged,
    })
}
