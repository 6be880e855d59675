//! `acp persist`: flush and commit the checkpoints a dead trainer left
//! resident in this node's shared memory.

use std::collections::BTreeSet;
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
    /// newest committed step); with `from_replica`, those taken from a
    /// replica.
    pub persisted_steps: Vec<u64>,
    /// Steps committed from a replica of this rank's image that a rank of
    /// this node keeps (its own node was lost).
    #[serde(default)]
    pub from_replica: Vec<u64>,
    /// Slots found half-staged (the trainer died mid-copy) and discarded.
    pub discarded_half_staged: usize,
}

/// A step newer than the newest committed one that this node cannot
/// commit alone: some ranks' images are neither resident nor replicated
/// here.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncompleteStep {
    /// The step.
    pub step: u64,
    /// The ranks whose image of it this node lacks.
    pub missing: Vec<u32>,
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
    /// Steps newer than every step committed here that were left alone
    /// because this node lacks some ranks' images of them.
    #[serde(default)]
    pub incomplete: Vec<IncompleteStep>,
    /// The newest committed step afterwards.
    pub latest: Option<u64>,
}

/// Where a rank's image of a step to persist is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// The rank's own slot.
    Own,
    /// A replica slot kept by another rank of this node.
    Replica,
}

/// What one rank's engine does.
#[derive(Debug, Clone)]
enum Work {
    /// `persist_on_open`: every complete image of its own newer than the
    /// newest committed step (ranks named by `--rank`; one rank).
    OnOpen,
    /// These steps, in order, each from where it is.
    Steps(Vec<(u64, Origin)>),
}

/// Commits what this node holds for the job.
///
/// With ranks named (`opts.ranks`) or a world of one rank: opens an
/// engine for each with `persist_on_open`, so its complete resident
/// images newer than the newest committed step are flushed and committed
/// (a named rank with no slot of its own here but a replica kept here
/// commits its newest replica newer than that step); ranks on other nodes
/// must be persisted there meanwhile (rank 0 waits `commit_timeout` for
/// them).
///
/// Otherwise (every rank of a multi-rank job): the steps newer than the
/// newest committed one whose every rank's image is on this node, in a
/// rank's own slot or in a replica slot kept here for a rank of another
/// node (peer replicas), are committed, every rank at once, each replica
/// verified against the digests it came with before it is written. A
/// newer step that some rank's image is missing from is left alone and
/// named in [`PersistReport::incomplete`], with the missing ranks: it is
/// never committed partially.
///
/// # Errors
/// [`Error::Busy`] when a live process (the trainer) holds a rank's slots;
/// [`Error::NotFound`] for a missing root, and when no step is complete
/// on this node while some are incomplete (naming the missing ranks); the
/// flush's error (e.g. [`Error::NoSpace`], [`Error::Timeout`] naming ranks
/// that did not report).
pub fn persist(opts: &PersistOptions) -> Result<PersistReport> {
    let root = open_root(&opts.root)?;
    let job = job_id(root.location(), opts.job.as_deref());
    let slots = resident(&opts.shm_dir, &job, None)?;
    let held = super::resident::replicas(&opts.shm_dir, &job)?;
    let own = super::resident::ranks(&slots);
    let known = opts.world_size.or_else(|| {
        slots
            .iter()
            .chain(&held)
            .filter(|s| s.complete)
            .max_by_key(|s| s.step)
            .and_then(|s| s.world_size)
    });
    let world_size = known.unwrap_or(1);
    // A usage error, not a corrupt slot ("header says acp.world_size 2")
    // or "nothing to persist".
    if world_size == 0 {
        return Err(Error::invalid("--world-size", "must be at least 1"));
    }
    let beyond = known.and_then(|w| opts.ranks.iter().flatten().find(|&&r| r >= w));
    if let Some(r) = beyond {
        return Err(Error::invalid(
            "--rank",
            format!("rank {r} is not below the world size {world_size}"),
        ));
    }
    let mut incomplete = Vec::new();
    let work: Vec<(u32, Work)> = match &opts.ranks {
        Some(r) => {
            let latest = root.steps()?.last().copied();
            r.iter()
                .map(|&r| (r, named(r, &own, &held, latest)))
                .collect()
        }
        None if world_size <= 1 => own.iter().map(|&r| (r, Work::OnOpen)).collect(),
        None => {
            let latest = root.steps()?.last().copied();
            let (work, left) = plan(&slots, &held, world_size, latest);
            if work.is_empty() && !left.is_empty() {
                let newest = &left[left.len() - 1];
                return Err(Error::NotFound {
                    what: format!(
                        "a step of job `{job}` complete on this node: step {} lacks the images of ranks {:?} \
                         (neither their own slots nor replicas of them are here); to commit it from \
                         several nodes, run `acp persist --rank R` for each node's ranks on every node at once",
                        newest.step, newest.missing
                    ),
                });
            }
            incomplete = left;
            work
        }
    };
    let named: Vec<u32> = work.iter().map(|(r, _)| *r).collect();
    if let Some(s) = slots.iter().find(|s| s.locked && named.contains(&s.rank)) {
        return Err(Error::Busy {
            what: format!("rank {} of job `{job}` ({})", s.rank, s.path),
            reason: format!(
                "its slots are held by live process {}; a running trainer persists its own checkpoints",
                s.owner_pid
            ),
        });
    }
    let results: Vec<Result<RankPersist>> = std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .iter()
            .map(|(rank, work)| {
                let rank = *rank;
                let mine: Vec<&ResidentSlot> = slots.iter().filter(|s| s.rank == rank).collect();
                let theirs: Vec<&ResidentSlot> = held.iter().filter(|s| s.rank == rank).collect();
                let job = job.clone();
                let root = root.location().to_path_buf();
                std::thread::Builder::new()
                    .name(format!("acp-persist-r{rank}"))
                    .spawn_scoped(scope, move || {
                        crate::io::block_async_signals();
                        let on = Node {
                            own: &mine,
                            replicas: &theirs,
                        };
                        persist_rank(&root, &job, rank, world_size, &on, work, opts)
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
        incomplete,
        latest: root.steps()?.last().copied(),
    })
}

/// What a rank named by `--rank` does: persist its own images on open,
/// or, with none of its own on this node, its newest replica kept here
/// that is newer than `latest` (its node was lost).
fn named(rank: u32, own: &BTreeSet<u32>, held: &[ResidentSlot], latest: Option<u64>) -> Work {
    if own.contains(&rank) {
        return Work::OnOpen;
    }
    let newest = held
        .iter()
        .filter(|s| s.rank == rank && s.complete)
        .filter_map(|s| s.step)
        .filter(|&s| latest.is_none_or(|l| s > l))
        .max();
    match newest {
        Some(step) => Work::Steps(vec![(step, Origin::Replica)]),
        None => Work::OnOpen,
    }
}

/// Which steps each rank of `0..world` commits, and from where: the steps
/// newer than `latest` whose every rank's image is in `own` (complete
/// slots of its own) or `held` (replicas kept here), own slots first; and
/// the newer steps than those that some ranks lack, with those ranks.
fn plan(
    own: &[ResidentSlot],
    held: &[ResidentSlot],
    world: u32,
    latest: Option<u64>,
) -> (Vec<(u32, Work)>, Vec<IncompleteStep>) {
    let newer =
        |s: &&ResidentSlot| s.complete && s.step.is_some_and(|x| latest.is_none_or(|l| x > l));
    let steps_of = |slots: &[ResidentSlot], rank: u32| -> BTreeSet<u64> {
        slots
            .iter()
            .filter(newer)
            .filter(|s| s.rank == rank)
            .filter_map(|s| s.step)
            .collect()
    };
    let mine: Vec<BTreeSet<u64>> = (0..world).map(|r| steps_of(own, r)).collect();
    let kept: Vec<BTreeSet<u64>> = (0..world).map(|r| steps_of(held, r)).collect();
    let candidates: BTreeSet<u64> = mine.iter().chain(&kept).flatten().copied().collect();
    let missing = |step: u64| -> Vec<u32> {
        (0..world)
            .filter(|&r| !mine[r as usize].contains(&step) && !kept[r as usize].contains(&step))
            .collect()
    };
    let complete: Vec<u64> = candidates
        .iter()
        .copied()
        .filter(|&s| missing(s).is_empty())
        .collect();
    let newest = complete.last().copied();
    let incomplete = candidates
        .iter()
        .copied()
        .filter(|&s| newest.is_none_or(|n| s > n))
        .map(|step| IncompleteStep {
            step,
            missing: missing(step),
        })
        .collect();
    let work = if complete.is_empty() {
        Vec::new()
    } else {
        (0..world)
            .map(|r| {
                let steps = complete
                    .iter()
                    .map(|&s| {
                        let origin = if mine[r as usize].contains(&s) {
                            Origin::Own
                        } else {
                            Origin::Replica
                        };
                        (s, origin)
                    })
                    .collect();
                (r, Work::Steps(steps))
            })
            .collect()
    };
    (work, incomplete)
}

/// The slots of one rank on this node: its own, and replicas of its
/// images kept by other ranks here.
struct Node<'a> {
    own: &'a [&'a ResidentSlot],
    replicas: &'a [&'a ResidentSlot],
}

fn persist_rank(
    root: &Path,
    job: &str,
    rank: u32,
    world_size: u32,
    on: &Node<'_>,
    work: &Work,
    opts: &PersistOptions,
) -> Result<RankPersist> {
    let own_slots = on.own.iter().map(|s| s.slot + 1).max().unwrap_or(0);
    let from_replicas = match work {
        Work::OnOpen => 0,
        Work::Steps(steps) => steps.iter().filter(|(_, f)| *f == Origin::Replica).count(),
    };
    let n = own_slots.max(from_replicas);
    if n == 0 {
        return Ok(RankPersist {
            rank,
            resident_steps: Vec::new(),
            persisted_steps: Vec::new(),
            from_replica: Vec::new(),
            discarded_half_staged: 0,
        });
    }
    // Recovery takes slots as they are; the budget only has to give each
    // slot room for its largest image.
    let largest = on
        .own
        .iter()
        .map(|s| s.file_bytes)
        .chain(on.replicas.iter().filter_map(|s| s.bytes))
        .max()
        .unwrap_or(0);
    let budget = (largest + (8 << 20)) * n as u64;
    let mut config = EngineConfig::new(root);
    // The trainer's chunk size, as its slots recorded it: the committed
    // step's digests then match the slots', and the restarted trainer
    // restores it from RAM (in chunks of the default size, from storage).
    if let Some(chunk) = on
        .own
        .iter()
        .chain(on.replicas)
        .find_map(|s| s.chunk_bytes)
        .filter(|c| *c > 0 && c % 4096 == 0 && *c <= 1 << 30)
    {
        config = config.with_chunk_bytes(usize::try_from(chunk).unwrap_or(usize::MAX));
    }
    let engine = Engine::open(
        config
            .with_job(job)
            .with_rank(rank)
            .with_world_size(world_size.max(rank + 1))
            .with_shm_dir(&opts.shm_dir)
            .with_ring_slots(n)
            .with_ring_bytes(budget)
            .with_mlock(false)
            .with_persist_on_open(matches!(work, Work::OnOpen))
            // A ring made here only to stage a replica goes once its
            // steps are committed.
            .with_release_on_close(own_slots == 0)
            .with_commit_timeout(opts.commit_timeout),
    )?;
    let report = engine.open_report().clone();
    let mut persisted = report.persisting_steps.clone();
    let mut from_replica = Vec::new();
    let queued = (|| {
        if let Work::Steps(steps) = work {
            let mut handles = Vec::new();
            for &(step, origin) in steps {
                handles.push(match origin {
                    Origin::Own => engine.persist_resident(step)?,
                    Origin::Replica => engine.persist_replica(step)?,
                });
                persisted.push(step);
                if origin == Origin::Replica {
                    from_replica.push(step);
                }
            }
            for h in handles {
                h.wait()?;
            }
        }
        Ok(())
    })();
    let closed = engine.close();
    drop(engine);
    queued?;
    closed?;
    Ok(RankPersist {
        rank,
        resident_steps: report.resident_steps,
        persisted_steps: persisted,
        from_replica,
        discarded_half_staged: report.discarded_half_staged,
    })
}
