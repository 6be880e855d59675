//! Reclaiming other jobs' rings from shared memory: which rings of this
//! user on the node may go, and their removal. The engine runs it at open
//! for rings older than its TTL
//! ([`EngineConfig::with_shm_ttl`](crate::EngineConfig::with_shm_ttl));
//! `acp ls --shm` and `acp gc --shm` (`ops::shm`) report over the same
//! judgement.
//!
//! A ring may be removed only when
//! - no live process holds it (its slot files' `flock`s are free; they are
//!   then held here until the files are unlinked, so nobody opens it
//!   meanwhile), and
//! - no resident step in it is the only copy of that step: each is
//!   committed in the ring's root, or superseded there (a newer step is
//!   committed), or, when the root is not recorded or is gone, was marked
//!   persisted by its flush ([`is_only_copy`]). `--force` drops the only
//!   copies too (never a live ring's).

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::retention::is_only_copy;
use crate::error::Result;
use crate::format::{hex, Digest};
use crate::staging::{rings, user_dir, RingFiles, SlotSeen, SlotState};
use crate::storage::{open_root, Storage};

/// One ring of this user on the node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShmRing {
    /// The ring's name: its slot files are `{ring}-s{i}`.
    pub ring: String,
    /// The job id, when its slot files record it.
    pub job: Option<String>,
    /// The rank whose images it holds.
    pub rank: u32,
    /// For a replica ring (a copy of `rank`'s images kept for another
    /// node), the rank that keeps it; `None` for `rank`'s own ring.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_held_by: Option<u32>,
    /// The checkpoint root it belongs to, when recorded.
    pub root: Option<String>,
    /// Slot files.
    pub slots: usize,
    /// Steps of the complete images it holds, newest first.
    pub resident_steps: Vec<u64>,
    /// Of those, the steps committed in its root.
    pub committed_steps: Vec<u64>,
    /// Of those, the steps that are nowhere else: not committed in its
    /// root nor superseded there by a newer committed step (`acp persist`
    /// commits the newest of them).
    pub only_copy_steps: Vec<u64>,
    /// Bytes of shared memory its files hold.
    pub bytes: u64,
    /// Whether a live process holds it.
    pub live: bool,
    /// The pid its control blocks name as the last owner.
    pub owner_pid: Option<u32>,
    /// Seconds since its files last changed (opened, grown or written).
    pub age_secs: f64,
}

/// What `acp gc --shm` does.
#[derive(Debug, Clone, Default)]
pub struct ShmGcOptions {
    /// Only report what would be removed.
    pub dry_run: bool,
    /// Also remove rings holding the only copy of a step (never a live one).
    pub force: bool,
    /// Only rings whose files have not changed for this long.
    pub ttl: Option<Duration>,
}

/// What `acp gc --shm` did to one ring.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShmGcRow {
    /// The ring's name.
    pub ring: String,
    /// Its job id, when recorded.
    pub job: Option<String>,
    /// The rank.
    pub rank: u32,
    /// Its root, when recorded.
    pub root: Option<String>,
    /// Whether it was removed (with `dry_run`: would be).
    pub removed: bool,
    /// Why.
    pub reason: String,
    /// Bytes of shared memory its files hold.
    pub bytes: u64,
}

/// What `acp gc --shm` removed (or, with `dry_run`, would remove).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShmGcReport {
    /// The per-user directory looked at.
    pub dir: String,
    /// Whether nothing was removed on purpose.
    pub dry_run: bool,
    /// Every ring, removed or kept, with the reason.
    pub rings: Vec<ShmGcRow>,
    /// Bytes freed (with `dry_run`: that would be).
    pub freed_bytes: u64,
}

/// What the slot files of a ring say, judged against its root.
pub(crate) struct Judged {
    pub(crate) row: ShmRing,
    /// Why the steps of `only_copy_steps` are not judged safe (names the
    /// root), when there are any.
    pub(crate) why_kept: Option<String>,
}

/// Reads a ring's slot files and judges its steps against its root.
pub(crate) fn judge(ring: &RingFiles, slots: &[SlotSeen], live: bool) -> Judged {
    let stem = ring.prefix.get(4..20).unwrap_or_default();
    let ours = |s: &&SlotSeen| {
        s.peek
            .as_ref()
            .is_some_and(|p| p.rank == ring.rank && hex(&p.job_tag).starts_with(stem))
    };
    let origin = slots
        .iter()
        .filter(ours)
        .map(|s| s.origin.clone())
        .find(|o| o.job.is_some())
        .unwrap_or_default();
    // (step, marked persisted by its flush), newest first.
    let mut images: Vec<(u64, bool)> = slots
        .iter()
        .filter(ours)
        .filter_map(|s| s.peek.as_ref())
        .filter(|p| p.is_complete())
        .map(|p| (p.step, p.state == Some(SlotState::Persisted)))
        .collect();
    images.sort_unstable_by(|a, b| b.cmp(a));
    images.dedup_by_key(|i| i.0);
    let root = origin
        .root
        .as_deref()
        .and_then(|r| open_root(Path::new(r)).ok());
    let committed = match &root {
        Some(r) => r.steps().unwrap_or_default(),
        None => Vec::new(),
    };
    let committed_steps: Vec<u64> = images
        .iter()
        .map(|i| i.0)
        .filter(|s| committed.contains(s))
        .collect();
    let only_copy_steps: Vec<u64> = images
        .iter()
        .filter(|(s, persisted)| match &root {
            Some(_) => is_only_copy(&committed, *s),
            None => !persisted,
        })
        .map(|i| i.0)
        .collect();
    let why_kept = only_copy_steps.first().map(|_| {
        let steps = only_copy_steps
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        match (&origin.root, &root) {
            (Some(r), Some(_)) => format!("step(s) {steps} not committed in {r}: the only copy"),
            (Some(r), None) => format!(
                "step(s) {steps} not marked persisted and the root {r} cannot be read: \
                 possibly the only copy"
            ),
            (None, _) => format!(
                "step(s) {steps} not marked persisted and the ring records no root: \
                 possibly the only copy"
            ),
        }
    });
    let owner_pid = slots
        .iter()
        .filter(ours)
        .filter_map(|s| s.peek.as_ref().map(|p| p.owner_pid))
        .find(|p| *p != 0);
    let age = slots.iter().map(SlotSeen::age).min().unwrap_or_default();
    Judged {
        row: ShmRing {
            ring: ring.prefix.clone(),
            job: origin.job,
            rank: ring.rank,
            replica_held_by: ring.held_by,
            root: origin.root,
            slots: slots.len(),
            resident_steps: images.iter().map(|i| i.0).collect(),
            committed_steps,
            only_copy_steps,
            bytes: slots.iter().map(|s| s.file_bytes).sum(),
            live,
            owner_pid,
            age_secs: age.as_secs_f64(),
        },
        why_kept,
    }
}

/// Removes the rings of this user in `shm_dir` that no live process holds
/// and that hold no step's only copy (with `force`, those too), older than
/// `ttl` when given, leaving alone the rings of the job tagged `skip`;
/// reports every ring, removed or kept, with the reason (`acp gc --shm`).
///
/// # Errors
/// An untrustworthy per-user directory; [`Error::Io`](crate::Error::Io)
/// listing it or unlinking a slot file.
pub(crate) fn reclaim(
    shm_dir: &Path,
    opts: &ShmGcOptions,
    skip: Option<&Digest>,
) -> Result<ShmGcReport> {
    let skip_stem = skip.map(|t| format!("acp-{}-", &hex(t)[..16]));
    let mut rows = Vec::new();
    let mut freed = 0;
    for ring in rings(shm_dir)? {
        if skip_stem
            .as_ref()
            .is_some_and(|s| ring.prefix.starts_with(s))
        {
            continue;
        }
        // The age first, from an unlocked look: a young ring's locks are
        // never taken.
        let seen = ring.read()?;
        if seen.is_empty() {
            // Only files this user cannot open, or none left: not a ring
            // of this user's to judge or remove.
            continue;
        }
        let age = seen.iter().map(SlotSeen::age).min().unwrap_or_default();
        let row = |j: &Judged, removed: bool, reason: String| ShmGcRow {
            ring: j.row.ring.clone(),
            job: j.row.job.clone(),
            rank: j.row.rank,
            root: j.row.root.clone(),
            removed,
            reason,
            bytes: j.row.bytes,
        };
        if let Some(ttl) = opts.ttl.filter(|t| age < *t) {
            let j = judge(&ring, &seen, false);
            rows.push(row(
                &j,
                false,
                format!(
                    "younger than the TTL ({:.0} s < {:.0} s)",
                    age.as_secs_f64(),
                    ttl.as_secs_f64()
                ),
            ));
            continue;
        }
        drop(seen);
        let held = match ring.hold()? {
            Ok(h) => h,
            Err(pid) => {
                let seen = ring.read()?;
                let j = judge(&ring, &seen, true);
                let who = if pid == 0 {
                    "a live process".to_owned()
                } else {
                    format!("live process {pid}")
                };
                rows.push(row(&j, false, format!("held by {who}")));
                continue;
            }
        };
        let j = judge(&ring, &held.slots, false);
        let reason = match (&j.why_kept, opts.force) {
            (Some(why), false) => {
                let fix = if j.row.root.is_some() {
                    "`acp persist` commits it; --force drops it"
                } else {
                    "--force drops it"
                };
                rows.push(row(&j, false, format!("{why} ({fix})")));
                continue;
            }
            (Some(why), true) => format!("--force: {why}"),
            (None, _) if j.row.resident_steps.is_empty() => "holds no complete image".to_owned(),
            (None, _) => match &j.row.root {
                Some(r) => format!("every resident step is committed in {r} (or superseded)"),
                None => "every resident step was persisted".to_owned(),
            },
        };
        let bytes = if opts.dry_run {
            drop(held);
            j.row.bytes
        } else {
            held.remove()?
        };
        freed += bytes;
        rows.push(ShmGcRow {
            bytes,
            ..row(&j, true, reason)
        });
    }
    Ok(ShmGcReport {
        dir: user_dir(shm_dir).display().to_string(),
        dry_run: opts.dry_run,
        rings: rows,
        freed_bytes: freed,
    })
}

/// At engine open: removes the rings of other jobs of this user in
/// `shm_dir` not changed for `ttl`, with no live holder and no step's only
/// copy. Never fails: what it cannot do is logged.
pub(crate) fn reclaim_expired(shm_dir: &Path, ttl: Duration, own_job: &Digest) {
    let opts = ShmGcOptions {
        dry_run: false,
        force: false,
        ttl: Some(ttl),
    };
    match reclaim(shm_dir, &opts, Some(own_job)) {
        Ok(r) => {
            for g in r.rings.iter().filter(|g| g.removed) {
                tracing::info!(
                    ring = %g.ring,
                    root = g.root.as_deref().unwrap_or("unknown"),
                    bytes = g.bytes,
                    "acp: removed an expired ring of another job: {}",
                    g.reason
                );
            }
        }
        Err(e) => tracing::warn!(
            "acp: reclaiming expired rings in {}: {e}",
            shm_dir.display()
        ),
    }
}
