//! A scoped pool that works off a list of items: the one way acp spreads
//! memory-bound work (copies, hashes) over threads.

use std::sync::{Mutex, PoisonError};

/// Runs `work` on every item of `items`: the calling thread and up to
/// `items.len() - 1` more (named `name`, with acp's signal mask) each take
/// the next item from a shared queue until it is empty. Returns once every
/// item is done. A thread that cannot be started leaves its share to the
/// others, the calling thread included, so the work is always done.
pub(crate) fn run_on_threads<T: Send>(name: &str, items: Vec<T>, work: impl Fn(T) + Sync) {
    let workers = items.len().saturating_sub(1);
    let queue = Mutex::new(items);
    let drain = || loop {
        let item = queue.lock().unwrap_or_else(PoisonError::into_inner).pop();
        let Some(item) = item else { return };
        work(item);
    };
    std::thread::scope(|scope| {
        for _ in 0..workers {
            let _ = std::thread::Builder::new()
                .name(name.to_owned())
                .spawn_scoped(scope, || {
                    super::block_async_signals();
                    drain();
                });
        }
        drain();
    });
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[test]
    fn every_item_is_done_once() {
        let done: Vec<AtomicUsize> = (0..17).map(|_| AtomicUsize::new(0)).collect();
        run_on_threads("acp-test", (0..17).collect(), |i: usize| {
            done[i].fetch_add(1, Ordering::Relaxed);
        });
        assert!(done.iter().all(|d| d.load(Ordering::Relaxed) == 1));
        run_on_threads("acp-test", Vec::<usize>::new(), |_| unreachable!());
    }
}
