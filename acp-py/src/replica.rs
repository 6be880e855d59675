//! Peer replicas for a transport driven from Python (the torch.distributed
//! one in `acp.replica`): a resident image as a zero-copy view to send,
//! receiving another rank's image into a replica slot, serving a held
//! replica, and a mailbox [`Transport`] through which images Python
//! fetched for a restore reach `load` (reported as `"peer"`).

use std::collections::BTreeMap;
use std::sync::{Mutex, PoisonError};

use acp_core::format::Digest;
use acp_core::replica::{Fetched, ImageBuf};
use acp_core::staging::PinnedSlot;
use acp_core::{Error, ReplicaMeta, Result, Transport};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::invalid;

/// A replica's metadata as Python passes it: (rank, step, len,
/// chunk_bytes, digests as 32 bytes each, concatenated).
pub(crate) type MetaTuple = (u32, u64, u64, u64, Vec<u8>);

/// [`MetaTuple`] as returned to Python.
pub(crate) type MetaOut<'py> = (u32, u64, u64, u64, Bound<'py, PyBytes>);

/// An offered image: the peer it came from, its metadata and bytes.
type Offered = (u32, ReplicaMeta, ImageBuf);

pub(crate) fn meta_from(t: MetaTuple) -> PyResult<ReplicaMeta> {
    let (rank, step, len, chunk_bytes, raw) = t;
    if raw.len() % 32 != 0 {
        return Err(invalid(
            format!("replica of rank {rank}'s step {step}"),
            format!("digests of {} bytes, not a multiple of 32", raw.len()),
        ));
    }
    let digests = raw
        .chunks_exact(32)
        .map(|c| {
            let mut d: Digest = [0; 32];
            d.copy_from_slice(c);
            d
        })
        .collect();
    Ok(ReplicaMeta {
        rank,
        step,
        len,
        chunk_bytes,
        digests,
    })
}

pub(crate) fn meta_tuple<'py>(py: Python<'py>, m: &ReplicaMeta) -> MetaOut<'py> {
    let raw: Vec<u8> = m.digests.iter().flatten().copied().collect();
    (m.rank, m.step, m.len, m.chunk_bytes, PyBytes::new(py, &raw))
}

/// A resident image pinned in its slot (this rank's own, or a replica
/// held here) for a transport to send: `meta()` and `buffer()`.
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct ReplicaImage {
    meta: ReplicaMeta,
    pin: PinnedSlot,
}

impl ReplicaImage {
    pub(crate) fn new(meta: ReplicaMeta, pin: PinnedSlot) -> ReplicaImage {
        ReplicaImage { meta, pin }
    }
}

#[pymethods]
impl ReplicaImage {
    /// (rank, step, len, chunk_bytes, digests).
    fn meta<'py>(&self, py: Python<'py>) -> MetaOut<'py> {
        meta_tuple(py, &self.meta)
    }

    /// The image as a read-only memoryview, valid (and the image kept in
    /// its slot) while the view or anything made from it lives.
    fn buffer<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let image = slf.get().pin.image();
        // SAFETY: the bytes are in the slot pinned by `slf.pin`, which
        // `slf` (a frozen object) holds for its whole life: the ring hands
        // a pinned slot to no writer. The view keeps `slf` alive, and it is
        // read-only, so the pointer is never written through.
        unsafe {
            crate::tensors::memoryview_owned_by(
                slf.as_any(),
                image.as_ptr().cast_mut(),
                image.len(),
                false,
            )
        }
    }
}

/// Images Python fetched from peers for a restore, by (rank, step), each
/// with the peer it came from: the engine's transport, so `load` finds
/// them after this node's own sources.
#[derive(Debug, Default)]
pub(crate) struct Mailbox {
    images: Mutex<BTreeMap<(u32, u64), Offered>>,
}

impl Mailbox {
    /// Keeps `data` (`meta`'s image, from rank `peer`) for the next load.
    pub(crate) fn offer(&self, peer: u32, meta: ReplicaMeta, data: &[u8]) -> Result<()> {
        if data.len() as u64 != meta.len {
            return Err(Error::invalid(
                meta.what(),
                format!("{} bytes offered for an image of {}", data.len(), meta.len),
            ));
        }
        let mut image = ImageBuf::new(meta.len)?;
        image.as_mut_slice().copy_from_slice(data);
        self.images
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert((meta.rank, meta.step), (peer, meta, image));
        Ok(())
    }
}

impl Transport for Mailbox {
    fn send(&self, to: u32, meta: &ReplicaMeta, _image: &[u8]) -> Result<()> {
        Err(Error::Unsupported {
            what: format!("{} to rank {to}", meta.what()),
            reason: "the Python transport sends replicas itself (acp.replica)".to_owned(),
        })
    }

    fn list(&self, peer: u32) -> Result<Vec<ReplicaMeta>> {
        Ok(self
            .images
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|(p, _, _)| *p == peer)
            .map(|(_, m, _)| m.clone())
            .collect())
    }

    fn fetch(&self, peer: u32, rank: u32, step: u64) -> Result<Option<Fetched>> {
        let mut images = self.images.lock().unwrap_or_else(PoisonError::into_inner);
        if images.get(&(rank, step)).is_none_or(|(p, _, _)| *p != peer) {
            return Ok(None);
        }
        Ok(images
            .remove(&(rank, step))
            .map(|(peer, meta, image)| Fetched {
                meta,
                image,
                origin: format!("rank {peer}'s replica (torch.distributed)"),
            }))
    }

    fn holders(&self, rank: u32) -> Vec<u32> {
        self.images
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .filter(|((r, _), _)| *r == rank)
            .map(|(_, (p, _, _))| *p)
            .collect()
    }
}
