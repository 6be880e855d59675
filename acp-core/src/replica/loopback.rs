//! [`Loopback`]: the in-process transport. Engines of one process (tests,
//! or a process that simulates several nodes) register under their rank;
//! a send copies the image straight into the holder's replica slot.

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use super::{Fetched, ImageBuf, ReplicaMeta, Transport};
use crate::engine::WeakEngine;
use crate::error::{Error, Result};
use crate::Engine;

/// The in-process [`Transport`]: rank `r`'s images are held by the ranks
/// [`Loopback::new`] was given for it.
#[derive(Debug)]
pub struct Loopback {
    placement: BTreeMap<u32, Vec<u32>>,
    engines: Mutex<BTreeMap<u32, WeakEngine>>,
}

impl Loopback {
    /// A transport where rank `r`'s replicas go to `placement[r]`, in
    /// that order.
    #[must_use]
    pub fn new(placement: BTreeMap<u32, Vec<u32>>) -> Loopback {
        Loopback {
            placement,
            engines: Mutex::new(BTreeMap::new()),
        }
    }

    /// Makes `engine` reachable as its rank (replacing an earlier one,
    /// as a restarted rank does). Holds no strong reference.
    pub fn register(&self, engine: &Engine) {
        self.engines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(engine.config().rank(), engine.downgrade());
    }

    /// Forgets rank `rank` (its node was lost).
    pub fn unregister(&self, rank: u32) {
        self.engines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&rank);
    }

    fn engine(&self, rank: u32) -> Result<Engine> {
        self.engines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&rank)
            .and_then(WeakEngine::upgrade)
            .ok_or_else(|| Error::NotFound {
                what: format!("rank {rank} on the loopback transport"),
            })
    }
}

impl Transport for Loopback {
    fn send(&self, to: u32, meta: &ReplicaMeta, image: &[u8]) -> Result<()> {
        self.engine(to)?.receive_replica(meta, |dst| {
            dst.copy_from_slice(image);
            Ok(())
        })
    }

    fn list(&self, peer: u32) -> Result<Vec<ReplicaMeta>> {
        Ok(self.engine(peer)?.replicas())
    }

    fn fetch(&self, peer: u32, rank: u32, step: u64) -> Result<Option<Fetched>> {
        let Some((meta, pin, path)) = self.engine(peer)?.pin_replica(rank, step) else {
            return Ok(None);
        };
        let mut image = ImageBuf::new(meta.len)?;
        image.as_mut_slice().copy_from_slice(pin.image());
        Ok(Some(Fetched {
            meta,
            image,
            origin: format!("rank {peer}: {}", path.display()),
        }))
    }

    fn holders(&self, rank: u32) -> Vec<u32> {
        self.placement.get(&rank).cloned().unwrap_or_default()
    }
}
