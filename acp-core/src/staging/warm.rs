//! Readying ring slots off the training's path: a background thread that
//! calls [`Ring::warm_next`] until it has nothing left to do.
//!
//! Two costs used to land on the training thread. An open mapped,
//! pre-faulted and locked every slot a previous process left (about 0.3 s
//! per GiB of ring here, on the restart's critical path); and the first
//! save into each slot of a new ring grew it (allocating, zeroing and
//! faulting in its memory: 1 to 5 s per GiB on a virtual machine whose
//! memory is backed on first touch), so the first saves of a job stalled
//! for seconds each. Now an open only maps the slots and this thread
//! faults them in and locks them; and once a save has said how big an
//! image is, it grows the free slots still too small for it. A save that
//! comes first does that work itself, as before: nothing waits for this
//! thread but a save whose only free slot it is growing.
//!
//! Each engine runs one for its own ring and one for each replica ring it
//! holds (there the size comes from the image just received). The thread
//! runs at the flush thread's lower priority (its caller's `setup` lowers
//! it) and exits when the engine closes or drops ([`Warm::stop`]), within
//! one step of its work: a slot left part-way stays cold, and a save (or a
//! replica received) into it warms it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread::JoinHandle;

use crossbeam_channel::Sender;

use super::Ring;

/// The warming thread's handle.
#[derive(Debug)]
pub(crate) struct Warm {
    /// The image length of the saves (`None`: the slots an open mapped).
    tx: Mutex<Option<Sender<Option<u64>>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// The largest image length sent, so a save sends only a bigger one.
    hinted: AtomicU64,
    /// The ring, to stop the warming before the thread is waited for.
    ring: Ring,
}

impl Warm {
    /// Starts the thread on `ring` (named after `rank`); it runs `setup`
    /// (its caller's: signals blocked, priority lowered), then readies the
    /// slots the open mapped. A thread that cannot start is logged and
    /// leaves the saves to ready their slots themselves.
    pub(crate) fn start(ring: Ring, rank: u32, setup: impl FnOnce() + Send + 'static) -> Warm {
        let (tx, rx) = crossbeam_channel::unbounded::<Option<u64>>();
        let stop = ring.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("acp-warm-r{rank}"))
            .spawn(move || {
                setup();
                let mut len = None;
                while let Ok(first) = rx.recv() {
                    len = first.or(len);
                    while let Ok(next) = rx.try_recv() {
                        len = next.or(len);
                    }
                    loop {
                        match ring.warm_next(len) {
                            Ok(true) => {}
                            Ok(false) => break,
                            Err(e) => {
                                tracing::debug!("acp: slot warming stopped: {e}");
                                break;
                            }
                        }
                    }
                }
            });
        let thread = match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::info!("acp: slot warming thread not started: {e}");
                None
            }
        };
        let tx = thread.as_ref().map(|_| tx);
        if let Some(tx) = &tx {
            let _ = tx.send(None);
        }
        Warm {
            tx: Mutex::new(tx),
            thread: Mutex::new(thread),
            hinted: AtomicU64::new(0),
            ring: stop,
        }
    }

    /// A save stages images of `len` bytes: free slots too small for them
    /// are grown in the background.
    pub(crate) fn saw(&self, len: u64) {
        if self.hinted.fetch_max(len, Ordering::Relaxed) >= len {
            return;
        }
        if let Some(tx) = self
            .tx
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            let _ = tx.send(Some(len));
        }
    }

    /// Stops the thread and waits for it: it finishes the step (32 MiB) it
    /// is on, and does not wait out a load's deferral
    /// ([`Ring::stop_warming`]).
    pub(crate) fn stop(&self) {
        self.ring.stop_warming();
        drop(
            self.tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Warm {
    /// Lets go of the thread without stopping or joining it: in a forked
    /// child, where it does not run (the parent's thread was not copied).
    pub(crate) fn forget_thread(&self) {
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        std::mem::forget(thread);
        std::mem::forget(
            self.tx
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        self.stop();
    }
}
