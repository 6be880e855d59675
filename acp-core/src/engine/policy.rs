//! The persist policy: which sealed saves are flushed and committed, and
//! which stay RAM snapshots; and the counts of what became of each save.
//!
//! Every save is staged into a ring slot (a **snapshot**, resident in this
//! node's RAM). [`decide`] chooses, when the slot is sealed, between
//! queueing its persist now, deferring it behind the persist in flight
//! ([`PersistPolicy::Coalesce`]: at most one in flight, the newest deferred
//! one supersedes an older one), or keeping it resident only. A snapshot
//! that is not persisted keeps its slot until a newer complete image
//! supersedes it (the ring never reuses the slot of the newest step); the
//! dying checkpoint, `close`, persist-on-open and `acp persist` persist the
//! newest resident step whatever the policy chose for it.
//!
//! A save may also be **held** ([`Persist::Hold`]): the caller decides
//! later ([`Engine::decide`](super::Engine::decide)), e.g. once the ranks
//! of a job agree on which snapshot to persist. A held snapshot keeps its
//! slot whatever newer snapshots are sealed, until it is decided or the
//! engine closes.

use std::time::Instant;

use crate::config::PersistPolicy;

/// Whether one save is persisted ([`SaveOptions::persist`](super::SaveOptions)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Persist {
    /// The engine's [`PersistPolicy`] decides.
    #[default]
    Policy,
    /// Persisted (flushed to storage and committed), whatever the policy.
    Always,
    /// Kept resident only (a RAM snapshot); nothing is written to storage
    /// unless the dying checkpoint, `close` or a restart persists it as
    /// the newest resident step.
    Never,
    /// Held: kept resident and exempt from the release of superseded
    /// snapshots until [`Engine::decide`](super::Engine::decide) persists
    /// it or lets it go, whatever the policy. For callers that decide
    /// later, together with other ranks, which snapshots to persist (the
    /// coalescing policy with several ranks). Its handle completes once it
    /// is decided: when persisted, or at once when let go.
    Hold,
}

/// What became of a save ([`SaveReport::outcome`](super::SaveReport)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Flushed to storage and committed.
    Persisted,
    /// Kept as a RAM snapshot in its ring slot, not written to storage.
    Resident,
    /// Waiting for the persist in flight when a newer save was queued or
    /// deferred in its place: never written; resident until its slot is
    /// reused.
    Superseded,
    /// Not staged: no ring slot was free ([`WhenFull::Skip`](crate::WhenFull)).
    Skipped,
}

impl Outcome {
    /// Its name: `persisted`, `resident`, `superseded` or `skipped`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Persisted => "persisted",
            Outcome::Resident => "resident",
            Outcome::Superseded => "superseded",
            Outcome::Skipped => "skipped",
        }
    }
}

/// What became of this engine's saves so far ([`Engine::persist_stats`](super::Engine::persist_stats)).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PersistStats {
    /// Saves staged into a ring slot (snapshots).
    pub staged: u64,
    /// Steps persisted (committed) by this engine, recovered ones included.
    pub persisted: u64,
    /// Snapshots the policy or the caller kept resident only.
    pub resident: u64,
    /// Snapshots superseded while waiting for a persist: never written.
    pub superseded: u64,
    /// Saves skipped for want of a free slot.
    pub skipped: u64,
    /// Image bytes written to storage by committed persists (their plain
    /// size).
    pub bytes_written: u64,
    /// Bytes those persists' data files take in storage: `bytes_written`
    /// when they are plain, less when compressed.
    pub bytes_stored: u64,
    /// Chunks those persists did not write because the root's newest
    /// committed step already held them (incremental steps).
    pub chunks_reused: u64,
    /// The image bytes of those chunks: bytes not written.
    pub bytes_reused: u64,
    /// Persists queued, deferred or running now.
    pub queue_depth: usize,
    /// The newest step staged by this engine.
    pub newest_snapshot: Option<u64>,
    /// The newest step this engine persisted.
    pub newest_persisted: Option<u64>,
    /// How much older the newest persisted step's snapshot is than the
    /// newest snapshot's, in seconds (0 when the newest snapshot is
    /// persisted; `None` before both exist).
    pub persisted_lag_secs: Option<f64>,
}

/// What to do with a sealed save.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Decision {
    /// Queue its persist now.
    Queue,
    /// Persist it once the persist in flight has finished, unless a newer
    /// save supersedes it first.
    Defer,
    /// Keep it resident only.
    Keep,
    /// Keep it resident and held until the caller decides
    /// ([`Persist::Hold`]).
    Hold,
}

/// The policy's choice for a sealed save of `step` asked to be persisted
/// as `persist`, `now`, when the last persist was queued at `last_queued`
/// and `in_flight` persists are queued, deferred or running.
pub(super) fn decide(
    policy: PersistPolicy,
    persist: Persist,
    step: u64,
    now: Instant,
    last_queued: Option<Instant>,
    in_flight: usize,
) -> Decision {
    match persist {
        Persist::Always => return Decision::Queue,
        Persist::Never => return Decision::Keep,
        Persist::Hold => return Decision::Hold,
        Persist::Policy => {}
    }
    let due = match policy {
        PersistPolicy::Every(n) => n == 0 || step % n == 0,
        PersistPolicy::Interval(d) => {
            last_queued.is_none_or(|t| now.saturating_duration_since(t) >= d)
        }
        PersistPolicy::Coalesce => {
            return if in_flight == 0 {
                Decision::Queue
            } else {
                Decision::Defer
            };
        }
    };
    if due {
        Decision::Queue
    } else {
        Decision::Keep
    }
}

/// The figures behind [`PersistStats`], kept in the engine state.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) staged: u64,
    pub(super) persisted: u64,
    pub(super) resident: u64,
    pub(super) superseded: u64,
    pub(super) skipped: u64,
    pub(super) bytes_written: u64,
    pub(super) bytes_stored: u64,
    pub(super) chunks_reused: u64,
    pub(super) bytes_reused: u64,
    /// The newest staged step and when it was sealed.
    pub(super) newest_snapshot: Option<(u64, Instant)>,
    /// The newest persisted step and when its snapshot was staged.
    pub(super) newest_persisted: Option<(u64, Instant)>,
    /// When the last persist was queued (for [`PersistPolicy::Interval`]).
    pub(super) last_queued: Option<Instant>,
}

impl Counts {
    pub(super) fn sealed(&mut self, step: u64, at: Instant) {
        self.staged += 1;
        if self.newest_snapshot.is_none_or(|(s, _)| step >= s) {
            self.newest_snapshot = Some((step, at));
        }
    }

    /// A persist of `step` committed a data file of `bytes` plain bytes
    /// stored in `stored` bytes.
    pub(super) fn committed(&mut self, step: u64, staged_at: Instant, bytes: u64, stored: u64) {
        self.persisted += 1;
        self.bytes_written += bytes;
        self.bytes_stored += stored;
        if self.newest_persisted.is_none_or(|(s, _)| step >= s) {
            self.newest_persisted = Some((step, staged_at));
        }
    }

    /// That persist referenced `chunks` chunks (`bytes` image bytes)
    /// instead of writing them.
    pub(super) fn reused(&mut self, chunks: u64, bytes: u64) {
        self.chunks_reused += chunks;
        self.bytes_reused += bytes;
    }

    pub(super) fn stats(&self, queue_depth: usize) -> PersistStats {
        let lag = match (self.newest_snapshot, self.newest_persisted) {
            (Some((_, snap)), Some((_, pers))) => {
                Some(snap.saturating_duration_since(pers).as_secs_f64())
            }
            _ => None,
        };
        PersistStats {
            staged: self.staged,
            persisted: self.persisted,
            resident: self.resident,
            superseded: self.superseded,
            skipped: self.skipped,
            bytes_written: self.bytes_written,
            bytes_stored: self.bytes_stored,
            chunks_reused: self.chunks_reused,
            bytes_reused: self.bytes_reused,
            queue_depth,
            newest_snapshot: self.newest_snapshot.map(|(s, _)| s),
            newest_persisted: self.newest_persisted.map(|(s, _)| s),
            persisted_lag_secs: lag,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const T: Duration = Duration::from_secs(10);

    #[test]
    fn every_n_persists_the_multiples_only() {
        let now = Instant::now();
        let p = PersistPolicy::Every(5);
        let got: Vec<Decision> = (0..=10)
            .map(|s| decide(p, Persist::Policy, s, now, None, 0))
            .collect();
        for (s, d) in got.iter().enumerate() {
            let want = if s % 5 == 0 {
                Decision::Queue
            } else {
                Decision::Keep
            };
            assert_eq!(*d, want, "step {s}");
        }
        // Every(1) is every save, whatever is in flight.
        assert_eq!(
            decide(PersistPolicy::Every(1), Persist::Policy, 7, now, None, 3),
            Decision::Queue
        );
    }

    #[test]
    fn interval_persists_once_it_has_passed() {
        let t0 = Instant::now();
        let p = PersistPolicy::Interval(T);
        assert_eq!(decide(p, Persist::Policy, 1, t0, None, 0), Decision::Queue);
        assert_eq!(
            decide(p, Persist::Policy, 2, t0 + T / 2, Some(t0), 0),
            Decision::Keep
        );
        assert_eq!(
            decide(p, Persist::Policy, 3, t0 + T, Some(t0), 1),
            Decision::Queue
        );
    }

    #[test]
    fn coalesce_queues_only_when_nothing_is_in_flight() {
        let now = Instant::now();
        let p = PersistPolicy::Coalesce;
        assert_eq!(decide(p, Persist::Policy, 1, now, None, 0), Decision::Queue);
        assert_eq!(
            decide(p, Persist::Policy, 2, now, Some(now), 1),
            Decision::Defer
        );
    }

    #[test]
    fn an_explicit_choice_overrides_every_policy() {
        let now = Instant::now();
        for p in [
            PersistPolicy::Every(1),
            PersistPolicy::Every(100),
            PersistPolicy::Interval(T),
            PersistPolicy::Coalesce,
        ] {
            assert_eq!(
                decide(p, Persist::Always, 3, now, Some(now), 2),
                Decision::Queue,
                "{p:?}"
            );
            assert_eq!(
                decide(p, Persist::Never, 100, now, None, 0),
                Decision::Keep,
                "{p:?}"
            );
            assert_eq!(
                decide(p, Persist::Hold, 100, now, None, 0),
                Decision::Hold,
                "{p:?}"
            );
        }
    }

    #[test]
    fn lag_is_the_age_of_the_newest_persisted_snapshot() {
        let t0 = Instant::now();
        let mut c = Counts::default();
        assert_eq!(c.stats(0).persisted_lag_secs, None);
        c.sealed(1, t0);
        c.committed(1, t0, 100, 70);
        assert_eq!(c.stats(0).persisted_lag_secs, Some(0.0));
        c.sealed(2, t0 + T);
        let s = c.stats(1);
        assert_eq!(s.persisted_lag_secs, Some(T.as_secs_f64()));
        assert_eq!(
            (s.staged, s.persisted, s.bytes_written, s.bytes_stored),
            (2, 1, 100, 70)
        );
        assert_eq!((s.newest_snapshot, s.newest_persisted), (Some(2), Some(1)));
    }
}
