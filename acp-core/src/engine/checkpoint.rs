//! A loaded checkpoint: zero-copy views into the memory it was loaded
//! into, and the figures of the load.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::{copy, to_usize};
use crate::error::{Error, Result};
use crate::format::{Dtype, Entry, ParsedHeader};
use crate::staging::{PinnedSlot, WarmDeferral};

/// Where a loaded checkpoint came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// A resident shared-memory slot.
    Ram,
    /// The storage files (now resident in a slot, or in private memory
    /// when no slot was free or the tensors went straight to the memory
    /// given for them).
    Storage,
    /// A replica held by a rank on another node, fetched through the
    /// engine's transport ([`crate::replica`]).
    Peer,
}

/// The figures of a load.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadReport {
    /// Where it came from.
    pub source: Source,
    /// Image bytes.
    pub bytes: u64,
    /// Whether every chunk was verified against its digest.
    pub verified: bool,
    /// Seconds from the call to the views being ready.
    pub secs: f64,
    /// Why a resident copy of the step was found but not used (it failed
    /// verification: the error, naming the slot file and tensor).
    pub rejected: Option<String>,
}

/// A loaded checkpoint; its tensors are zero-copy views into a pinned slot
/// (or a private buffer) that lives as long as this value.
#[derive(Debug)]
pub struct Checkpoint {
    pub(super) step: u64,
    /// The verified header: its values and entries. Shared with the
    /// loads of the same image bytes ([`Checkpoint::header`]).
    pub(super) header: Arc<ParsedHeader>,
    pub(super) backing: Backing,
    pub(super) report: LoadReport,
    pub(super) copy_threads: usize,
    /// The offsets of the tensors (of at least one byte) whose bytes the
    /// load read straight into the caller's memory and did not keep
    /// ([`Checkpoint::holds`]); empty for nearly every load.
    pub(super) elsewhere: BTreeSet<u64>,
    /// The ring's warming waits while the checkpoint is used (its views
    /// read, its tensors copied out), a few seconds at most; until
    /// [`Checkpoint::end_warm_deferral`].
    pub(super) warm: std::sync::Mutex<Option<WarmDeferral>>,
}

/// One tensor of a loaded [`Checkpoint`]. Shaped as [`HostTensor`], the
/// save side's, on purpose: two public types, so that either can change
/// without the other.
///
/// [`HostTensor`]: super::HostTensor
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [u64],
    /// Bytes.
    pub data: &'a [u8],
}

/// The memory a loaded checkpoint's views point into.
#[derive(Debug)]
pub(super) enum Backing {
    /// A pinned ring slot.
    Slot(PinnedSlot),
    /// Private page-aligned memory, `len` bytes of it used.
    Heap(memmap2::MmapMut, usize),
}

impl Backing {
    pub(super) fn image(&self) -> &[u8] {
        match self {
            Backing::Slot(p) => p.image(),
            Backing::Heap(m, len) => &m[..*len],
        }
    }
}

impl Checkpoint {
    /// Lets the ring's warming go on, and lets go of the ring this
    /// checkpoint no longer uses: its image is private memory that the
    /// caller now owns (a fresh load's tensors over a storage read). A
    /// checkpoint kept with its tensors held the engine's ring, its slot
    /// files locked, after the engine closed.
    pub fn end_warm_deferral(&self) {
        if matches!(self.backing, Backing::Heap(..)) {
            self.warm
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take();
        }
    }

    pub(super) fn with_rejected(mut self, rejected: Option<String>) -> Checkpoint {
        self.report.rejected = rejected;
        self
    }

    /// The step.
    #[must_use]
    pub fn step(&self) -> u64 {
        self.step
    }

    /// How it was loaded.
    #[must_use]
    pub fn report(&self) -> &LoadReport {
        &self.report
    }

    /// The plain values saved with it.
    #[must_use]
    pub fn values(&self) -> &serde_json::Value {
        self.header.values()
    }

    /// The tensors, in file order.
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        &self.header.entries
    }

    /// The verified header that [`Checkpoint::values`] and
    /// [`Checkpoint::entries`] come from. Loads of the same image bytes
    /// (the same resident slot, unchanged) share it: two checkpoints whose
    /// headers are [`Arc::ptr_eq`] have equal values and entries, which a
    /// caller may use to reuse what it derived from them.
    #[must_use]
    pub fn header(&self) -> &Arc<ParsedHeader> {
        &self.header
    }

    /// The whole image (a safetensors file). The bytes of a tensor it
    /// does not hold ([`Checkpoint::holds`]) are zeros there.
    #[must_use]
    pub fn image(&self) -> &[u8] {
        self.backing.image()
    }

    /// Whether it holds the bytes of `entry` (one of
    /// [`Checkpoint::entries`]). A checkpoint holds all of its tensors,
    /// except after two kinds of load by
    /// [`PendingLoad::read_into`](super::PendingLoad::read_into), whose
    /// destinations got their tensors' bytes straight from the source,
    /// checked on the way, and only the other tensors are kept: another
    /// rank's file (or some of its tensors) read from that rank's slot,
    /// and a file streamed from storage when no ring slot was ready for
    /// it.
    #[must_use]
    pub fn holds(&self, entry: &Entry) -> bool {
        entry.len == 0 || !self.elsewhere.contains(&entry.offset)
    }

    /// The image, writable, when it is memory of this checkpoint alone:
    /// private memory it was fetched, copied or read into (a peer's
    /// replica, another rank's slot, a storage read with no slot free).
    /// `None` for a ring slot, which the flush, replicas and later loads
    /// read, and for an image that does not hold every tensor
    /// ([`Checkpoint::holds`]). A caller that owns the checkpoint may hand
    /// this memory on instead of copying out of it (a fresh load's tensors
    /// made over it).
    #[must_use]
    pub fn private_image_mut(&mut self) -> Option<&mut [u8]> {
        if !self.elsewhere.is_empty() {
            // Not the whole image: nothing to hand on as its tensors.
            return None;
        }
        match &mut self.backing {
            Backing::Slot(_) => None,
            Backing::Heap(m, len) => Some(&mut m[..*len]),
        }
    }

    /// The tensor named `name`; `None` when there is none, or when the
    /// checkpoint does not hold its bytes ([`Checkpoint::holds`]).
    #[must_use]
    pub fn tensor(&self, name: &str) -> Option<TensorView<'_>> {
        self.entries()
            .iter()
            .find(|e| e.name == name)
            .filter(|e| self.holds(e))
            .map(|e| TensorView {
                name: &e.name,
                dtype: e.dtype,
                shape: &e.shape,
                data: self.data(e),
            })
    }

    /// The bytes of `entry` (one of [`Checkpoint::entries`]); empty when
    /// the checkpoint does not hold them ([`Checkpoint::holds`]).
    #[must_use]
    pub fn data(&self, entry: &Entry) -> &[u8] {
        if !self.holds(entry) {
            return &[];
        }
        let off = to_usize(entry.offset);
        &self.backing.image()[off..off + to_usize(entry.len)]
    }

    /// Copies each tensor `dsts[k].0` (an index into [`Checkpoint::entries`])
    /// into `dsts[k].1`, in parallel over the copy threads.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the tensor when an index is out of range,
    /// a length differs or the checkpoint does not hold the tensor
    /// ([`Checkpoint::holds`]), before anything is copied.
    pub fn copy_into(&self, dsts: &mut [(usize, &mut [u8])]) -> Result<()> {
        for (i, d) in dsts.iter() {
            let e = destination(self.entries(), self.step, *i, d.len())?;
            if !self.holds(e) {
                return Err(not_held(e));
            }
        }
        let pairs = dsts
            .iter_mut()
            .map(|(i, d)| {
                let src = self.data(&self.header.entries[*i]);
                (&mut **d, src)
            })
            .collect();
        copy::parallel_copy(pairs, self.copy_threads);
        Ok(())
    }
}

/// The error for reading a tensor that a checkpoint does not hold.
pub(super) fn not_held(e: &Entry) -> Error {
    Error::invalid(
        format!("tensor `{}`", e.name),
        "this load read its bytes straight into the memory it was given and did not keep them; load the step again to read it",
    )
}

/// Entry `i` of `entries` (of step `step`), checked as the destination of
/// `len` bytes: [`Error::Invalid`] naming the tensor when `i` is out of
/// range or the lengths differ.
pub(super) fn destination(entries: &[Entry], step: u64, i: usize, len: usize) -> Result<&Entry> {
    let Some(e) = entries.get(i) else {
        return Err(Error::invalid(
            format!("tensor index {i}"),
            format!("step {step} has {} tensors", entries.len()),
        ));
    };
    if len as u64 != e.len {
        return Err(Error::invalid(
            format!("tensor `{}`", e.name),
            format!("destination has {len} bytes, the checkpoint {}", e.len),
        ));
    }
    Ok(e)
}
