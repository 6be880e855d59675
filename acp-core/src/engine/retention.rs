//! Retention: which committed steps to keep. One rule, applied by the
//! engine after each commit (`keep_last`/`keep_every` in the
//! configuration) and by [`Engine::retain`], and by `acp gc`
//! ([`crate::ops::gc`]) on a root without an engine.
//!
//! A step whose chunks a kept step references (an incremental step's
//! `refs`) is kept whole, listed and loadable, until no kept step
//! references it: keeping the step rather than only its files keeps every
//! directory of the root a complete step, so `steps()`, `load`, `verify`
//! and the commit protocol need no second kind of directory, at the cost
//! of the chunks of it that nothing references. A reference names the
//! file that holds the bytes (one hop), so a step in the middle of a run
//! of incremental steps goes as soon as retention drops it, unless a
//! kept step references it; and a step kept so keeps, in turn, the steps
//! that its own references name.

use super::state::Shared;
use super::Engine;
use crate::error::{Error, Result};
use crate::storage::Storage;

/// The steps retention removes from `steps` (ascending): all but the newest
/// `keep_last` and the multiples of `keep_every`. The engine's rule, and
/// `acp gc`'s.
#[must_use]
pub fn retention_plan(steps: &[u64], keep_last: usize, keep_every: Option<u64>) -> Vec<u64> {
    let n = steps.len();
    steps
        .iter()
        .enumerate()
        .filter(|&(i, &step)| {
            // Not `i + keep_last >= n`: a `keep_last` near `usize::MAX`
            // wrapped around, and the newest steps went.
            let recent = n - i <= keep_last;
            let milestone = keep_every.is_some_and(|m| m > 0 && step % m == 0);
            !recent && !milestone
        })
        .map(|(_, &s)| s)
        .collect()
}

/// Refuses `keep_last == 0`, which would delete every checkpoint.
///
/// # Errors
/// [`Error::Config`] naming `keep_last`.
pub(crate) fn check_keep_last(keep_last: usize) -> Result<()> {
    if keep_last == 0 {
        return Err(Error::Config {
            field: "keep_last",
            reason: "must be at least 1 (0 would delete every checkpoint)".into(),
        });
    }
    Ok(())
}

/// The steps of `plan` (those [`retention_plan`] drops from `steps`) that
/// a kept step references: they stay. Read from the kept steps' indexes,
/// and from those of the steps kept so, in turn: a step kept because a
/// newer one references some of its chunks is kept whole, loadable, so
/// the steps its own other chunks reference stay too.
///
/// # Errors
/// The error of reading a kept step's index, which names it: a step whose
/// references are unknown keeps retention from removing anything.
pub(crate) fn referenced(root: &dyn Storage, steps: &[u64], plan: &[u64]) -> Result<Vec<u64>> {
    let mut held = std::collections::BTreeSet::new();
    let mut todo: Vec<u64> = steps
        .iter()
        .copied()
        .filter(|s| !plan.contains(s))
        .collect();
    while let Some(kept) = todo.pop() {
        let index = root.read_index(kept)?;
        for step in index
            .files
            .values()
            .flat_map(|f| f.refs.iter().map(|r| r.step))
        {
            if plan.contains(&step) && held.insert(step) {
                todo.push(step);
            }
        }
    }
    Ok(plan.iter().copied().filter(|s| held.contains(s)).collect())
}

/// The steps retention removes from `root`: [`retention_plan`]'s, less
/// those a kept step references ([`referenced`]). Returns them and the
/// steps kept only because they are referenced.
///
/// # Errors
/// As [`referenced`]; [`Error::Io`] listing the root.
pub(crate) fn removable(
    root: &dyn Storage,
    keep_last: usize,
    keep_every: Option<u64>,
) -> Result<(Vec<u64>, Vec<u64>)> {
    let steps = root.steps()?;
    let plan = retention_plan(&steps, keep_last, keep_every);
    let held = referenced(root, &steps, &plan)?;
    let remove = plan.into_iter().filter(|s| !held.contains(s)).collect();
    Ok((remove, held))
}

/// Takes the committed steps of `root` that retention removes
/// ([`removable`]) out of its listing; returns them. Their files are
/// deleted by the root's next [`Storage::settle`].
fn retire(root: &dyn Storage, keep_last: usize, keep_every: Option<u64>) -> Result<Vec<u64>> {
    check_keep_last(keep_last)?;
    let (retired, _) = removable(root, keep_last, keep_every)?;
    // Newest first, as `acp gc` removes them: a step leaves the listing
    // before the steps it references.
    for &step in retired.iter().rev() {
        root.retire_step(step)?;
    }
    Ok(retired)
}

impl Shared {
    /// Applies retention to the root and forgets the removed steps, whose
    /// files the root's next `settle` deletes (the flush thread settles
    /// after it has reported the save).
    pub(super) fn retain(&self, keep_last: usize, keep_every: Option<u64>) -> Result<Vec<u64>> {
        let deleted = retire(&*self.root, keep_last, keep_every)?;
        let mut st = self.lock();
        for s in &deleted {
            st.committed.remove(s);
        }
        Ok(deleted)
    }
}

impl Engine {
    /// Deletes committed steps that are neither among the newest `keep_last`
    /// nor a multiple of `keep_every`, nor referenced by a step that is
    /// kept (incremental steps); returns the deleted steps. The newest
    /// step is always kept.
    ///
    /// # Errors
    /// [`Error::Config`] for `keep_last == 0`; [`Error::Io`].
    pub fn retain(&self, keep_last: usize, keep_every: Option<u64>) -> Result<Vec<u64>> {
        let deleted = self.shared().retain(keep_last, keep_every)?;
        self.shared().root.settle()?;
        Ok(deleted)
    }
}

/// Of the steps `resident` in a ring of `root`, those that are nowhere
/// else: neither committed in `root` nor superseded there by a newer
/// committed step. The rule `acp gc --shm` applies, for the engine's
/// release on close.
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) listing the root.
pub(crate) fn only_copies(root: &dyn Storage, resident: &[u64]) -> Result<Vec<u64>> {
    let committed = root.steps()?;
    Ok(resident
        .iter()
        .copied()
        .filter(|&s| is_only_copy(&committed, s))
        .collect())
}

/// Whether a resident `step` is nowhere else, given the `committed` steps
/// of its root (ascending): not committed, and newer than every committed
/// step (an older one is superseded). [`only_copies`]'s rule, and
/// `acp shm list`/`gc`'s for a ring whose root can be read.
pub(crate) fn is_only_copy(committed: &[u64], step: u64) -> bool {
    !committed.contains(&step) && committed.last().is_none_or(|&l| step > l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_keeps_newest_and_milestones() {
        let steps = [100, 200, 300, 400, 500];
        assert_eq!(retention_plan(&steps, 2, None), vec![100, 200, 300]);
        assert_eq!(retention_plan(&steps, 2, Some(200)), vec![100, 300]);
        assert_eq!(retention_plan(&steps, 9, None), Vec::<u64>::new());
        assert_eq!(retention_plan(&steps, 1, Some(0)), vec![100, 200, 300, 400]);
        // Near usize::MAX it wrapped around and dropped the newest steps.
        for huge in [usize::MAX, usize::MAX - 2] {
            assert_eq!(retention_plan(&steps, huge, None), Vec::<u64>::new());
        }
    }

    #[test]
    fn keep_last_zero_is_refused() {
        assert!(matches!(
            check_keep_last(0),
            Err(Error::Config {
                field: "keep_last",
                ..
            })
        ));
        assert!(check_keep_last(1).is_ok());
    }
}
