//! `Loaded`: a loaded checkpoint, its values and its tensors' bytes.

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use acp_core::format::ParsedHeader;
use acp_core::{Checkpoint, Error, Opened, PendingLoad, Source};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use crate::errors::{err, invalid};
use crate::save::{host_ranges, EntryInfo};
use crate::tensors::{host_slices_mut, loaded_view, slice_span, ReadOnly};

/// A loaded checkpoint. Its tensors' bytes live in a resident ring slot (or
/// a private buffer) for as long as this object, which `buffer()` views
/// keep alive.
///
/// A load from storage opened with `Engine.load(defer=True)` is pending:
/// its step, entries and values come from the file's header, not yet
/// verified, and the data is read by the first call that needs it (which
/// verifies every chunk, the header's too, and fails if the header is not
/// the one these came from). `copy_into` then reads,
/// verifies and copies into the caller's tensors in one pass; `buffer`
/// and `report` read the whole image first.
#[pyclass(module = "acp._acp", frozen)]
#[derive(Debug)]
pub(crate) struct Loaded {
    /// Declared first, so dropped first: the image is writable again
    /// before the checkpoint (its pin on the slot) goes.
    read_only: OnceLock<Option<ReadOnly>>,
    ready: OnceLock<Checkpoint>,
    /// The address and length of `ready`'s image when it is private
    /// memory (`Checkpoint::private_image_mut`), taken with write access
    /// when the checkpoint was moved in: what `give` hands to the caller.
    private: OnceLock<(usize, usize)>,
    /// Set by `give`: the image is the caller's (its tensors are views of
    /// it, written by training), so nothing here reads it again.
    given: OnceLock<()>,
    /// The storage read not done yet (`None` once done or failed).
    pending: Mutex<Pending>,
    step: u64,
    /// Its entries and values as Python sees them; shared with the loads
    /// of the same header (`Kept`).
    info: Arc<Info>,
}

/// What Python reads of a loaded header: derived once per header
/// (`Kept`), not per load.
#[derive(Debug)]
pub(crate) struct Info {
    /// The header these are of, held so that a pointer comparison with it
    /// is a comparison of contents (`Checkpoint::header`).
    header: Arc<ParsedHeader>,
    entries: Vec<EntryInfo>,
    values_json: String,
    /// `entries()` and `values_json` as Python objects, made on first use:
    /// the loads of one header hand out the same objects, which Python
    /// then compares by identity, not item by item.
    py_entries: OnceLock<Py<PyTuple>>,
    py_values: OnceLock<Py<PyString>>,
}

impl Info {
    fn new(header: &Arc<ParsedHeader>) -> Result<Info, Error> {
        Ok(Info {
            header: Arc::clone(header),
            entries: entry_infos(&header.entries)?,
            values_json: values_json(header),
            py_entries: OnceLock::new(),
            py_values: OnceLock::new(),
        })
    }
}

/// The `Info` of the last header an engine loaded: a load of the same
/// header (the same resident image, unchanged: the core engine then hands
/// out the same `Arc`) reuses it instead of converting thousands of
/// entries and serialising the values again.
#[derive(Debug, Default)]
pub(crate) struct Kept(Mutex<Option<Arc<Info>>>);

impl Kept {
    /// The `Info` of `header`: the kept one when it is of this
    /// very header, else a new one, kept from now on.
    fn info(&self, header: &Arc<ParsedHeader>) -> Result<Arc<Info>, Error> {
        let mut kept = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(info) = kept.as_ref().filter(|i| Arc::ptr_eq(&i.header, header)) {
            return Ok(Arc::clone(info));
        }
        let info = Arc::new(Info::new(header)?);
        *kept = Some(Arc::clone(&info));
        Ok(info)
    }
}

/// The state of a deferred read.
#[derive(Debug)]
enum Pending {
    /// Nothing to read: the checkpoint is in `ready`.
    None,
    /// The read to do.
    Read(Box<PendingLoad>),
    /// The read failed with this message; the load failed.
    Failed(String),
}

/// A storage read not done holds an engine handle, maybe its last.
impl Drop for Loaded {
    fn drop(&mut self) {
        let pending = std::mem::replace(
            self.pending
                .get_mut()
                .unwrap_or_else(PoisonError::into_inner),
            Pending::None,
        );
        if let Pending::Read(load) = pending {
            crate::engine::drop_detached(load);
        }
    }
}

fn source_name(s: Source) -> &'static str {
    match s {
        Source::Ram => "ram",
        Source::Storage => "storage",
        Source::Peer => "peer",
    }
}

/// The values of `header` as JSON text: as stored (`parse_header` checked
/// it), not parsed and written again; `null` when it has none.
fn values_json(header: &ParsedHeader) -> String {
    header.values_text().unwrap_or("null").to_owned()
}

fn entry_infos(entries: &[acp_core::Entry]) -> Result<Vec<EntryInfo>, Error> {
    entries.iter().map(EntryInfo::from_entry).collect()
}

impl Loaded {
    /// Wraps a loaded checkpoint; serialises its values for Python (or
    /// takes them from `kept`, of the same header).
    pub(crate) fn new(mut inner: Checkpoint, kept: &Kept) -> Result<Loaded, Error> {
        let info = kept.info(inner.header())?;
        let private = OnceLock::new();
        if let Some(image) = inner.private_image_mut() {
            let _ = private.set((image.as_mut_ptr() as usize, image.len()));
        }
        Ok(Loaded {
            step: inner.step(),
            read_only: OnceLock::new(),
            ready: OnceLock::from(inner),
            private,
            given: OnceLock::new(),
            pending: Mutex::new(Pending::None),
            info,
        })
    }

    /// Wraps what `Engine::open_load` found.
    pub(crate) fn opened(opened: Opened, kept: &Kept) -> Result<Loaded, Error> {
        match opened {
            Opened::Ready(c) => Loaded::new(c, kept),
            Opened::Pending(p) => Ok(Loaded {
                step: p.step(),
                info: kept.info(p.header())?,
                read_only: OnceLock::new(),
                ready: OnceLock::new(),
                private: OnceLock::new(),
                given: OnceLock::new(),
                pending: Mutex::new(Pending::Read(Box::new(p))),
            }),
        }
    }

    /// Takes the pending read, if any; with the lock held (the caller has
    /// released the GIL), so that one caller does it and others wait.
    fn with_pending<T>(
        &self,
        read: impl FnOnce(Option<PendingLoad>) -> Result<(Option<Checkpoint>, T), Error>,
    ) -> Result<T, Error> {
        let mut state = self
            .pending
            .lock()
            .map_err(|_| Error::invalid(self.what(), "a read of it panicked"))?;
        let p = match std::mem::replace(&mut *state, Pending::None) {
            Pending::Read(p) => Some(*p),
            Pending::None => None,
            Pending::Failed(msg) => {
                let e = Error::invalid(self.what(), format!("its read failed: {msg}"));
                *state = Pending::Failed(msg);
                return Err(e);
            }
        };
        match read(p) {
            Ok((ck, out)) => {
                if let Some(mut ck) = ck {
                    if let Some(image) = ck.private_image_mut() {
                        let _ = self.private.set((image.as_mut_ptr() as usize, image.len()));
                    }
                    // Only this call, under the lock, sets them.
                    let _ = self.ready.set(ck);
                }
                Ok(out)
            }
            Err(e) => {
                *state = Pending::Failed(e.to_string());
                Err(e)
            }
        }
    }

    /// The checkpoint, read first when it is pending (the GIL released).
    fn checkpoint(&self, py: Python<'_>) -> PyResult<&Checkpoint> {
        if let Some(c) = self.ready.get() {
            return Ok(c);
        }
        py.detach(|| self.with_pending(|p| Ok((p.map(|p| p.read_into(&mut [])).transpose()?, ()))))
            .map_err(err)?;
        self.ready
            .get()
            .ok_or_else(|| invalid(self.what(), "not read"))
    }

    /// The bytes of tensor `i` (an index into `entries()`), reading a
    /// pending load first.
    ///
    /// # Errors
    /// `acp.InvalidInput` when `i` is out of range; the read's errors.
    pub(crate) fn bytes(&self, py: Python<'_>, i: usize) -> PyResult<&[u8]> {
        self.not_given()?;
        let ck = self.checkpoint(py)?;
        let entry = self.entry(ck, i)?;
        if !ck.holds(entry) {
            return Err(invalid(
                self.what(),
                format!(
                    "tensor `{}` was read straight into the memory given to copy_into and is not kept; load the step again to read it",
                    entry.name
                ),
            ));
        }
        Ok(ck.data(entry))
    }

    fn entry<'c>(&self, ck: &'c Checkpoint, i: usize) -> PyResult<&'c acp_core::Entry> {
        ck.entries().get(i).ok_or_else(|| {
            invalid(
                self.what(),
                format!(
                    "tensor index {i} out of range (there are {})",
                    self.info.entries.len()
                ),
            )
        })
    }

    /// Refuses once `give` handed the image to the caller.
    fn not_given(&self) -> PyResult<()> {
        if self.given.get().is_some() {
            return Err(invalid(
                self.what(),
                "its image was handed to the tensors of a fresh load; it is theirs now",
            ));
        }
        Ok(())
    }

    /// Where tensor `i`'s bytes are in the image handed out by `give`.
    ///
    /// # Errors
    /// `acp.InvalidInput` when nothing was given or `i` is out of range.
    pub(crate) fn given_bytes(&self, i: usize) -> PyResult<(*mut u8, usize)> {
        let (Some(ck), Some(&(base, image_len)), Some(())) =
            (self.ready.get(), self.private.get(), self.given.get())
        else {
            return Err(invalid(self.what(), "its image was not handed out"));
        };
        let entry = self.entry(ck, i)?;
        // The load checked the header against the image (every entry lies
        // inside it); checked again here, where a slip would be a pointer
        // out of bounds rather than a panic.
        let span = usize::try_from(entry.offset)
            .ok()
            .zip(usize::try_from(entry.len).ok())
            .filter(|&(off, len)| off.checked_add(len).is_some_and(|end| end <= image_len));
        let Some((offset, len)) = span else {
            return Err(invalid(
                self.what(),
                format!("tensor `{}` lies outside its image", entry.name),
            ));
        };
        Ok(((base + offset) as *mut u8, len))
    }

    fn what(&self) -> String {
        format!("load of step {}", self.step)
    }
}

#[pymethods]
impl Loaded {
    /// The step.
    #[getter]
    fn step(&self) -> u64 {
        self.step
    }

    /// Where it came from: "ram", "storage" or "peer"; while pending,
    /// where its bytes will come from ("storage", or "ram" for a resident
    /// slot whose check is done by the copy), unless that check fails and
    /// storage is read instead (`report()` then says so).
    #[getter]
    fn source(&self) -> &'static str {
        if let Some(c) = self.ready.get() {
            return source_name(c.report().source);
        }
        match self.pending.lock().as_deref() {
            Ok(Pending::Read(p)) => source_name(p.source()),
            _ => "storage",
        }
    }

    /// Whether its data is still to be read (a deferred storage load), or
    /// checked (a resident slot, checked by the copy).
    #[getter]
    fn pending(&self) -> bool {
        self.ready.get().is_none() && !self.failed()
    }

    /// Whether its deferred read failed (the load failed; `copy_into`'s
    /// error said why).
    #[getter]
    fn failed(&self) -> bool {
        self.pending
            .lock()
            .is_ok_and(|p| matches!(*p, Pending::Failed(_)))
    }

    /// The plain values saved with it, as JSON text (the same object for
    /// the loads of the same header).
    #[getter]
    fn values_json<'py>(&self, py: Python<'py>) -> Bound<'py, PyString> {
        self.info
            .py_values
            .get_or_init(|| PyString::new(py, &self.info.values_json).unbind())
            .bind(py)
            .clone()
    }

    /// The load's figures: source, bytes, verified, secs, and `rejected`:
    /// why a resident copy was found but not used (None when it was not).
    fn report<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.checkpoint(py)?.report();
        let d = PyDict::new(py);
        d.set_item("step", self.step)?;
        d.set_item("source", source_name(r.source))?;
        d.set_item("bytes", r.bytes)?;
        d.set_item("verified", r.verified)?;
        d.set_item("secs", r.secs)?;
        d.set_item("rejected", r.rejected.as_deref())?;
        Ok(d)
    }

    /// The tensors in file order, as `(name, dtype, shape, nbytes)`: a new
    /// list, of the same tuples for the loads of the same header.
    fn entries<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let tuples = match self.info.py_entries.get() {
            Some(t) => t.bind(py).clone(),
            None => {
                let items = self
                    .info
                    .entries
                    .iter()
                    .map(|e| e.to_tuple(py))
                    .collect::<PyResult<Vec<_>>>()?;
                let made = PyTuple::new(py, items)?.unbind();
                // Another thread may have made them meanwhile: use theirs.
                self.info.py_entries.get_or_init(|| made).bind(py).clone()
            }
        };
        Ok(tuples.to_list())
    }

    /// A read-only, zero-copy memoryview over the bytes of tensor `i`
    /// (an index into `entries()`). It keeps this checkpoint alive.
    /// Writable, once `give` handed the image to the caller.
    fn buffer<'py>(slf: &Bound<'py, Self>, i: usize) -> PyResult<Bound<'py, PyAny>> {
        loaded_view(slf, i)
    }

    /// Hands the image to the caller, when it is private memory (fetched
    /// from a peer, copied out of another rank's slot, read from storage
    /// with no slot free; never a ring slot) and was neither protected nor
    /// is still to be read: `buffer()` views are then writable, and
    /// `copy_into`, `protect` and the read-only views refuse, since the
    /// caller's tensors own the bytes. False (nothing changed) otherwise:
    /// the caller copies. Idempotent.
    fn give(&self) -> bool {
        if self.given.get().is_some() {
            return true;
        }
        if self.ready.get().is_none()
            || self.private.get().is_none()
            || self.read_only.get().is_some()
        {
            return false;
        }
        let _ = self.given.set(());
        // The caller's tensors own the image from now on, for as long as
        // they live: the checkpoint holds the engine's ring no longer.
        if let Some(ck) = self.ready.get() {
            ck.end_warm_deferral();
        }
        true
    }

    /// Whether `give` handed the image to the caller.
    #[getter]
    pub(crate) fn given(&self) -> bool {
        self.given.get().is_some()
    }

    /// Makes the image's pages read-only in this process for as long as
    /// this object lives (reading a pending load first), so that a write
    /// through a tensor made from `buffer()` faults (SIGSEGV) instead of
    /// changing the resident checkpoint. False when the image cannot be
    /// protected (the caller then copies). Idempotent.
    fn protect(&self, py: Python<'_>) -> PyResult<bool> {
        let ck = self.checkpoint(py)?;
        // Checked after the read (which releases the GIL), and with the GIL
        // held from here to the `mprotect`: `give` cannot come between.
        if self.given.get().is_some() {
            return Ok(false);
        }
        Ok(self
            .read_only
            .get_or_init(|| ReadOnly::protect(ck))
            .is_some())
    }

    /// Copies tensors out: each `(index, address, nbytes)` names a tensor
    /// (an index into `entries()`) and the contiguous memory to fill, in
    /// parallel over the engine's copy threads with the GIL released. When
    /// the load is pending, this is its read: the file is read once, each
    /// chunk verified and copied into these tensors as it lands.
    ///
    /// The caller guarantees each range is the live memory of a contiguous
    /// tensor that nothing reads or writes until the call returns.
    ///
    /// On an error, each tensor holds its old bytes or verified bytes of
    /// this step, and the load failed (`failed`).
    fn copy_into(&self, py: Python<'_>, items: Vec<(usize, usize, usize)>) -> PyResult<()> {
        self.not_given()?;
        let what = self.what();
        let mut ranges = host_ranges(&what, &self.info.entries, &items)?;
        let entries = &self.info.entries;
        let name_of = |i: usize| {
            entries
                .get(i)
                .map_or_else(|| i.to_string(), |e| e.name.clone())
        };
        py.detach(|| -> Result<(), Error> {
            if self.ready.get().is_none() {
                let read = self.with_pending(|p| match p {
                    Some(p) => {
                        let mut dsts = host_slices_mut(&what, &mut ranges, &[], &name_of)?;
                        Ok((Some(p.read_into(&mut dsts)?), true))
                    }
                    // Read by another call meanwhile: copied below.
                    None => Ok((None, false)),
                })?;
                if read {
                    return Ok(());
                }
            }
            let ck = self
                .ready
                .get()
                .ok_or_else(|| Error::invalid(&what, "not read"))?;
            let sources: Vec<_> = ck
                .entries()
                .iter()
                .enumerate()
                .map(|(i, e)| slice_span(i, ck.data(e)))
                .collect();
            let mut dsts = host_slices_mut(&what, &mut ranges, &sources, &name_of)?;
            ck.copy_into(&mut dsts)
        })
        .map_err(err)
    }

    fn __repr__(&self) -> String {
        format!(
            "Loaded(step={}, source={:?}, tensors={})",
            self.step,
            self.source(),
            self.info.entries.len()
        )
    }
}
