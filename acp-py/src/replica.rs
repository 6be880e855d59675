//! Peer replicas for a transport driven from Python (the torch.distributed
//! one in `acp.replica`): a resident image as a zero-copy view to send,
//! receiving another rank's image into a replica slot, serving a held
//! replica, and a mailbox [`Transport`] through which images Python
//! fetched for a restore reach `load` (reported as `"peer"`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use acp_core::format::Digest;
use acp_core::replica::{Fetched, ImageBuf, ReplicaWriter};
use acp_core::staging::PinnedSlot;
use acp_core::{Error, ReplicaMeta, Result, Transport};
use pyo3::exceptions::PyBufferError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{err, invalid};

/// A replica's metadata as Python passes it: (rank, step, len,
/// chunk_bytes, digests as 32 bytes each, concatenated).
pub(crate) type MetaTuple = (u32, u64, u64, u64, Vec<u8>);

/// [`MetaTuple`] as returned to Python.
pub(crate) type MetaOut<'py> = (u32, u64, u64, u64, Bound<'py, PyBytes>);

/// An offered image: the peer it came from, its metadata and bytes.
type Offered = (u32, ReplicaMeta, ImageBuf);

pub(crate) fn meta_from(t: MetaTuple) -> PyResult<ReplicaMeta> {
    let (rank, step, len, chunk_bytes, raw) = t;
    Ok(ReplicaMeta {
        rank,
        step,
        len,
        chunk_bytes,
        digests: digests_from(rank, step, &raw)?,
        sums: Vec::new(),
    })
}

/// Quick sums as Python passes them: 8 little-endian bytes each,
/// concatenated.
fn sums_from(rank: u32, step: u64, raw: &[u8]) -> PyResult<Vec<u64>> {
    if raw.len() % 8 != 0 {
        return Err(invalid(
            format!("replica of rank {rank}'s step {step}"),
            format!("quick sums of {} bytes, not a multiple of 8", raw.len()),
        ));
    }
    Ok(raw
        .chunks_exact(8)
        .map(|c| {
            let mut b = [0; 8];
            b.copy_from_slice(c);
            u64::from_le_bytes(b)
        })
        .collect())
}

pub(crate) fn sums_bytes<'py>(py: Python<'py>, sums: &[u64]) -> Bound<'py, PyBytes> {
    let raw: Vec<u8> = sums.iter().flat_map(|s| s.to_le_bytes()).collect();
    PyBytes::new(py, &raw)
}

/// Digests as Python passes them: 32 bytes each, concatenated.
pub(crate) fn digests_from(rank: u32, step: u64, raw: &[u8]) -> PyResult<Vec<Digest>> {
    if raw.len() % 32 != 0 {
        return Err(invalid(
            format!("replica of rank {rank}'s step {step}"),
            format!("digests of {} bytes, not a multiple of 32", raw.len()),
        ));
    }
    Ok(raw
        .chunks_exact(32)
        .map(|c| {
            let mut d: Digest = [0; 32];
            d.copy_from_slice(c);
            d
        })
        .collect())
}

pub(crate) fn digests_bytes<'py>(py: Python<'py>, digests: &[Digest]) -> Bound<'py, PyBytes> {
    let raw: Vec<u8> = digests.iter().flatten().copied().collect();
    PyBytes::new(py, &raw)
}

pub(crate) fn meta_tuple<'py>(py: Python<'py>, m: &ReplicaMeta) -> MetaOut<'py> {
    (
        m.rank,
        m.step,
        m.len,
        m.chunk_bytes,
        digests_bytes(py, &m.digests),
    )
}

/// A resident image pinned in its slot (this rank's own, or a replica
/// held here) for a transport to send: `meta()` and `buffer()`.
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct ReplicaImage {
    meta: ReplicaMeta,
    pin: PinnedSlot,
    /// A replica held here, not this rank's own image: its digests and
    /// sums are those it was pinned with, never hashed again.
    replica: bool,
}

impl ReplicaImage {
    pub(crate) fn new(meta: ReplicaMeta, pin: PinnedSlot) -> ReplicaImage {
        ReplicaImage {
            meta,
            pin,
            replica: false,
        }
    }

    /// A replica held here (`Engine::pin_replica`).
    pub(crate) fn replica(meta: ReplicaMeta, pin: PinnedSlot) -> ReplicaImage {
        ReplicaImage {
            meta,
            pin,
            replica: true,
        }
    }

    pub(crate) fn is_replica(&self) -> bool {
        self.replica
    }

    /// The digests it was pinned with (none for a resident image pinned
    /// before it was hashed, or a replica held with its quick sums alone).
    pub(crate) fn known_digests(&self) -> &[Digest] {
        &self.meta.digests
    }

    /// The quick sums it was pinned with, beside `known_digests` (none
    /// when it has none).
    pub(crate) fn known_sums(&self) -> &[u64] {
        &self.meta.sums
    }

    pub(crate) fn pin(&self) -> &PinnedSlot {
        &self.pin
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
        self.keep(peer, meta, image)
    }

    /// Drops every image no load has taken; returns how many there were.
    pub(crate) fn clear(&self) -> usize {
        let mut images = self.images.lock().unwrap_or_else(PoisonError::into_inner);
        let n = images.len();
        images.clear();
        n
    }

    /// Keeps `image` (`meta`'s, from rank `peer`) for the next load.
    fn keep(&self, peer: u32, meta: ReplicaMeta, image: ImageBuf) -> Result<()> {
        if image.len() as u64 != meta.len {
            return Err(Error::invalid(
                meta.what(),
                format!(
                    "{} bytes received for an image of {}",
                    image.len(),
                    meta.len
                ),
            ));
        }
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

    /// Replicas are sent by `acp.replica` (whose send hashes the image
    /// through `resident_replica`, shared with the flush through the
    /// slot's digests), never through this mailbox.
    fn sends(&self) -> bool {
        false
    }
}

/// Where a [`Receipt`] writes the image.
#[derive(Debug)]
enum Target {
    /// A replica slot of this rank, sealed by `finish`.
    Slot(ReplicaWriter),
    /// Private memory, handed to the mailbox by `finish` for the next load.
    Peer {
        peer: u32,
        meta: ReplicaMeta,
        image: ImageBuf,
        mailbox: Arc<Mailbox>,
    },
    /// Finished (or failed finishing): nothing to write into.
    Done,
}

/// An image being received from a peer straight into the memory that
/// keeps it (`Engine.begin_replica`: a replica slot; `Engine.begin_peer_image`:
/// the buffer the next load verifies and reads): the transport receives
/// into `buffer()`, then `finish(digests)` seals it. Dropped unfinished,
/// nothing is kept (a replica slot is free again).
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct Receipt {
    what: String,
    target: Mutex<Target>,
    /// Weak references to the exporters of the views `buffer()` handed
    /// out (see `check_views_gone`).
    views: Mutex<Vec<Py<PyAny>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Receipt {
    pub(crate) fn slot(writer: ReplicaWriter) -> Receipt {
        Receipt {
            what: writer.meta().what(),
            target: Mutex::new(Target::Slot(writer)),
            views: Mutex::new(Vec::new()),
        }
    }

    /// `image` (from `Engine::peer_image_buf`, which checked `meta`)
    /// to receive `meta`'s image from rank `peer` into.
    pub(crate) fn peer(
        peer: u32,
        meta: ReplicaMeta,
        image: ImageBuf,
        mailbox: Arc<Mailbox>,
    ) -> Receipt {
        Receipt {
            what: format!("{} from rank {peer}", meta.what()),
            target: Mutex::new(Target::Peer {
                peer,
                meta,
                image,
                mailbox,
            }),
            views: Mutex::new(Vec::new()),
        }
    }

    /// Where the bytes go, while not finished.
    fn bytes(&self) -> PyResult<(*mut u8, usize)> {
        let mut target = lock(&self.target);
        let bytes = match &mut *target {
            Target::Slot(w) => w.image_mut(),
            Target::Peer { image, .. } => image.as_mut_slice(),
            Target::Done => return Err(invalid(&self.what, "already finished")),
        };
        Ok((bytes.as_mut_ptr(), bytes.len()))
    }

    /// Fails while anything that can reach the bytes of a view handed out
    /// by `buffer()` is alive (its exporter, a ctypes array, which every
    /// slice, cast, array or tensor made from the view keeps), so nothing
    /// writes into the image once it is sealed or handed to the load.
    fn check_views_gone(&self, py: Python<'_>) -> PyResult<()> {
        let mut views = lock(&self.views);
        let mut kept = Vec::new();
        for weak in views.drain(..) {
            if !weak.bind(py).call0()?.is_none() {
                kept.push(weak);
            }
        }
        let alive = !kept.is_empty();
        *views = kept;
        if alive {
            return Err(PyBufferError::new_err(format!(
                "{}: its buffer is still in use (a view, slice, array or tensor over it \
                 is alive); drop it first",
                self.what
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl Receipt {
    /// A writable memoryview over the whole image, to receive into. It and
    /// anything made from it keep this object (so the memory) alive, and
    /// `finish()` refuses while any of them is.
    fn buffer<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyAny>> {
        let py = slf.py();
        let (ptr, len) = slf.get().bytes()?;
        // SAFETY: the bytes are a replica slot held staging by the
        // `ReplicaWriter`, or the private mapping of the `ImageBuf`, that
        // `slf.target` owns until `finish` takes it out; neither moves
        // (both are mappings) and no one else writes them (a staging slot
        // has one writer, the mapping is this object's). Every object that
        // can reach the bytes (the view and whatever is derived from it)
        // keeps the view's exporter alive, and the exporter keeps `slf`
        // alive. `finish` takes the target out only once every exporter
        // handed out is gone (`check_views_gone`, under the GIL, which
        // `buffer` holds too), so the memory outlives every view of it, and
        // no view writes into a sealed slot or an image the load reads.
        let view = unsafe { crate::tensors::memoryview_owned_by(slf.as_any(), ptr, len, true)? };
        let exporter = view.getattr(intern!(py, "obj"))?;
        let weak = py
            .import(intern!(py, "weakref"))?
            .getattr(intern!(py, "ref"))?
            .call1((exporter,))?
            .unbind();
        lock(&slf.get().views).push(weak);
        Ok(view)
    }

    /// Seals the image with `digests` (blake3 of each chunk, 32 bytes
    /// each, concatenated, as the sender computed them, or empty: they
    /// follow, `Engine.add_replica_digests`) and `sums` (the xxh3-64 quick
    /// sum of each chunk, 8 little-endian bytes each, or empty; required
    /// without digests): a replica slot is complete (the sums recorded
    /// beside the digests, or alone), an image from a peer goes to the
    /// next load, which checks the bytes against the sums when the digests
    /// are the ones it wants (or, for a step not committed, against the
    /// sums alone), else against the digests. Refuses (`BufferError`)
    /// while a view from `buffer()` is alive; a digest count that is not
    /// the length's (nor zero with a sum per chunk), or a sum count
    /// neither zero nor the length's, frees what was received.
    #[pyo3(signature = (digests, sums=Vec::new()))]
    fn finish(&self, py: Python<'_>, digests: Vec<u8>, sums: Vec<u8>) -> PyResult<()> {
        self.check_views_gone(py)?;
        let target = std::mem::replace(&mut *lock(&self.target), Target::Done);
        match target {
            Target::Slot(writer) => {
                let meta = writer.meta();
                let digests = digests_from(meta.rank, meta.step, &digests)?;
                let sums = sums_from(meta.rank, meta.step, &sums)?;
                py.detach(|| writer.finish_with_sums(digests, sums))
                    .map_err(err)
            }
            Target::Peer {
                peer,
                mut meta,
                image,
                mailbox,
            } => {
                meta.digests = digests_from(meta.rank, meta.step, &digests)?;
                meta.sums = sums_from(meta.rank, meta.step, &sums)?;
                meta.check(meta.chunk_bytes).map_err(err)?;
                mailbox.keep(peer, meta, image).map_err(err)
            }
            Target::Done => Err(invalid(&self.what, "already finished")),
        }
    }

    fn __repr__(&self) -> String {
        format!("Receipt({})", self.what)
    }
}
