//! `acp ls --shm` and `acp gc --shm`: every ring of this user on the node,
//! and the reclaim of those nobody needs any more. The engine runs the
//! same reclaim at open for rings older than its TTL
//! ([`EngineConfig::with_shm_ttl`](crate::EngineConfig::with_shm_ttl)).
//!
//! A ring may be removed only when
//! - no live process holds it (its slot files' `flock`s are free; they are
//!   then held here until the files are unlinked, so nobody opens it
//!   meanwhile), and
//! - no resident step in it is the only copy of that step: each is
//!   committed in the ring's root, or superseded there (a newer step is
//!   committed), or, when the root is not recorded or is gone, was marked
//!   persisted by its flush. `--force` drops the only copies too (never a
//!   live ring's).
//!
//! The judgement and the removal are the engine's (its reclaim at open
//! runs them); this module is the reporting front over them: it lists,
//! and renders both reports as text.

use std::fmt::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{shown, text};
use crate::engine::reclaim::{judge, reclaim};
pub use crate::engine::reclaim::{ShmGcOptions, ShmGcReport, ShmGcRow, ShmRing};
use crate::error::Result;
use crate::staging::{rings, user_dir};

/// What `acp ls --shm` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShmListReport {
    /// The per-user directory looked at.
    pub dir: String,
    /// Every ring in it, by name.
    pub rings: Vec<ShmRing>,
    /// Bytes over all of them.
    pub bytes: u64,
}

/// Every ring of this user in `shm_dir`, with its job, root, resident
/// steps (and which are committed), size, live holder and age. Probes each
/// ring's locks without waiting (taken and released at once); reads no
/// image.
///
/// # Errors
/// An untrustworthy per-user directory (see
/// [`SlotDir`](crate::staging::SlotDir)); [`Error::Io`](crate::Error::Io).
pub fn shm_list(shm_dir: &Path) -> Result<ShmListReport> {
    let mut out = Vec::new();
    for ring in rings(shm_dir)? {
        let holder = ring.holder()?;
        let slots = ring.read()?;
        if slots.is_empty() {
            // Only files this user cannot open, or none left: not a ring
            // of this user's.
            continue;
        }
        let mut j = judge(&ring, &slots, holder.is_some());
        if let Some(pid) = holder.filter(|p| *p != 0) {
            j.row.owner_pid = Some(pid);
        }
        out.push(j.row);
    }
    Ok(ShmListReport {
        dir: shown(&user_dir(shm_dir)),
        bytes: out.iter().map(|r| r.bytes).sum(),
        rings: out,
    })
}

/// Removes the rings of this user in `shm_dir` that no live process holds
/// and that hold no step's only copy (with `force`, those too), older than
/// `ttl` when given; reports every ring, removed or kept, with the reason.
///
/// # Errors
/// An untrustworthy per-user directory; [`Error::Io`](crate::Error::Io)
/// listing it or unlinking a slot file.
pub fn shm_gc(shm_dir: &Path, opts: &ShmGcOptions) -> Result<ShmGcReport> {
    reclaim(shm_dir, opts, None)
}

fn age(secs: f64) -> String {
    if secs < 60.0 {
        format!("{secs:.0}s")
    } else if secs < 3600.0 {
        format!("{:.0}m", secs / 60.0)
    } else if secs < 86400.0 {
        format!("{:.1}h", secs / 3600.0)
    } else {
        format!("{:.1}d", secs / 86400.0)
    }
}

/// `acp ls --shm` as text.
#[must_use]
pub fn list_text(r: &ShmListReport) -> String {
    if r.rings.is_empty() {
        return format!("no ring in {}\n", r.dir);
    }
    let mut s = format!(
        "{} ring(s) in {}, {} (steps: * committed in its root, ! the only copy; rank r@h: a replica of rank r's images kept by rank h)\n",
        r.rings.len(),
        r.dir,
        text::bytes(r.bytes)
    );
    let _ = writeln!(
        s,
        "{:<27} {:>5} {:<10} {:>6} {:>10}  {:<24} ROOT",
        "RING", "RANK", "HOLDER", "AGE", "BYTES", "STEPS"
    );
    for g in &r.rings {
        let steps = g
            .resident_steps
            .iter()
            .map(|st| {
                let mark = if g.committed_steps.contains(st) {
                    "*"
                } else if g.only_copy_steps.contains(st) {
                    "!"
                } else {
                    ""
                };
                format!("{st}{mark}")
            })
            .collect::<Vec<_>>()
            .join(",");
        let holder = match (g.live, g.owner_pid) {
            (true, Some(p)) => format!("pid {p}"),
            (true, None) => "live".to_owned(),
            (false, _) => "-".to_owned(),
        };
        let root = match (&g.root, &g.job) {
            (Some(r), Some(j)) if j != r => format!("{r} (job {j})"),
            (Some(r), _) => r.clone(),
            (None, _) => "unknown".to_owned(),
        };
        let rank = match g.replica_held_by {
            Some(h) => format!("{}@{h}", g.rank),
            None => g.rank.to_string(),
        };
        let _ = writeln!(
            s,
            "{:<27} {:>5} {:<10} {:>6} {:>10}  {:<24} {root}",
            g.ring,
            rank,
            holder,
            age(g.age_secs),
            text::bytes(g.bytes),
            if steps.is_empty() {
                "-".to_owned()
            } else {
                steps
            },
        );
    }
    s
}

/// `acp gc --shm` as text.
#[must_use]
pub fn gc_text(r: &ShmGcReport) -> String {
    let verb = if r.dry_run { "would remove" } else { "removed" };
    let removed = r.rings.iter().filter(|g| g.removed).count();
    let mut s = format!(
        "{verb} {removed} ring(s) in {}, {}; kept {}\n",
        r.dir,
        text::bytes(r.freed_bytes),
        r.rings.len() - removed
    );
    for g in &r.rings {
        let what = if g.removed { verb } else { "kept" };
        let _ = writeln!(
            s,
            "  {what} {} ({}): {}",
            g.ring,
            text::bytes(g.bytes),
            g.reason
        );
    }
    s
}
