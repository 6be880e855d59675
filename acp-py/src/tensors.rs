//! Raw-pointer intake: the only unsafe code of acp-py.
//!
//! Python hands tensors to Rust as `(index, address, nbytes)` triples taken
//! from `tensor.data_ptr()` or `ndarray.__array_interface__`, and takes slot
//! bytes back as memoryviews. The functions here turn those into slices and
//! views after checking what can be checked (null, overflow, overlap); the
//! rest is the Python caller's obligation, stated on each method in
//! `_acp.pyi`: the memory belongs to live, contiguous tensors that nobody
//! else writes (nor, for destinations, reads) during the call.

#![allow(
    unsafe_code,
    reason = "turns Python-supplied host addresses into slices"
)]

use acp_core::{Checkpoint, Error};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::PyAny;

use crate::errors::invalid;
use crate::load::Loaded;
use crate::save::Staging;

/// One `(index, address, nbytes)` triple from Python, checked to describe a
/// plausible range: non-null unless empty, not wrapping, at most
/// `isize::MAX` bytes. Not `Clone`: each yields at most one exclusive slice
/// at a time (see [`host_slices_mut`]).
#[derive(Debug)]
pub(crate) struct HostRange {
    index: usize,
    addr: usize,
    len: usize,
}

impl HostRange {
    /// Checks one triple.
    ///
    /// # Errors
    /// `acp.InvalidInput` for a null address with bytes, a length above
    /// `isize::MAX`, or a range that wraps around the address space.
    pub(crate) fn new(what: &str, index: usize, addr: usize, len: usize) -> PyResult<HostRange> {
        if len > isize::MAX as usize {
            return Err(invalid(
                what,
                format!("{len} bytes is more than isize::MAX"),
            ));
        }
        if len > 0 && addr == 0 {
            return Err(invalid(what, "null address"));
        }
        if addr.checked_add(len).is_none() {
            return Err(invalid(what, "address range wraps around"));
        }
        Ok(HostRange { index, addr, len })
    }

    /// The tensor index it goes with.
    pub(crate) fn index(&self) -> usize {
        self.index
    }

    fn span(&self) -> (usize, usize) {
        (self.addr, self.addr + self.len)
    }
}

/// Shared slices over host ranges from Python, in the order given, after
/// checking that none overlaps a range of `written` (the slot being filled).
///
/// Trust: every [`HostRange`] comes from a triple passed to a method whose
/// documentation (`Staging.copy_from`, in `_acp.pyi` too) obliges the caller
/// to name the live memory of a contiguous tensor that nothing writes until
/// the call returns; the slices must not outlive that call.
///
/// # Errors
/// [`Error::Invalid`] when a range overlaps a written one.
pub(crate) fn host_slices<'a>(
    what: &str,
    ranges: &'a [HostRange],
    written: &[(usize, usize, usize)],
) -> Result<Vec<&'a [u8]>, Error> {
    require_disjoint(what, written, &spans(ranges))?;
    Ok(ranges
        .iter()
        .map(|r| {
            if r.len == 0 {
                return &[][..];
            }
            // SAFETY: `HostRange::new` checked the address is non-null and the
            // range neither wraps nor exceeds `isize::MAX`; by the trust rule
            // above it is one live allocation nothing writes while the slice
            // is used, and it does not overlap the memory written meanwhile
            // (checked above). Bytes have no alignment or validity
            // requirement.
            unsafe { std::slice::from_raw_parts(r.addr as *const u8, r.len) }
        })
        .collect())
}

/// Exclusive slices over host ranges from Python, as `(tensor index,
/// slice)`, after checking that no two overlap and none overlaps `read`
/// (the checkpoint's bytes).
///
/// Trust: as [`host_slices`], for `Loaded.copy_into`: the memory of live,
/// writable, contiguous tensors that nothing else reads or writes until the
/// call returns.
///
/// A range that lies on pages a zero-copy load made read-only
/// ([`ReadOnly`]) is refused: it is a view of a loaded checkpoint, and a
/// write into it would kill the process with SIGSEGV.
///
/// # Errors
/// [`Error::Invalid`] when two ranges overlap, or a range is read-only
/// (naming its tensor by `name_of(index)`).
pub(crate) fn host_slices_mut<'a>(
    what: &str,
    ranges: &'a mut [HostRange],
    read: &[(usize, usize, usize)],
    name_of: &dyn Fn(usize) -> String,
) -> Result<Vec<(usize, &'a mut [u8])>, Error> {
    check_disjoint(&spans(ranges), read).map_err(|(a, b)| {
        Error::invalid(
            what,
            format!(
                "the memory of tensors `{}` and `{}` overlaps",
                name_of(a),
                name_of(b)
            ),
        )
    })?;
    if let Some(i) = read_only_among(&spans(ranges)) {
        return Err(Error::invalid(
            format!("{what}: tensor `{}`", name_of(i)),
            "its memory is a read-only view of a loaded checkpoint (`load(zero_copy=True)`); \
             clone() it, or load without into=, to get tensors that can be written",
        ));
    }
    Ok(ranges
        .iter_mut()
        .map(|r| {
            if r.len == 0 {
                return (r.index, &mut [][..]);
            }
            // SAFETY: as in `host_slices`, and the ranges are writable by
            // the trust rule above; no two of them overlap each other or the
            // memory read meanwhile (checked above), and `ranges` is borrowed
            // mutably for as long as the slices live, so each range yields
            // one exclusive slice.
            (r.index, unsafe {
                std::slice::from_raw_parts_mut(r.addr as *mut u8, r.len)
            })
        })
        .collect())
}

/// Checks that no range of `written` overlaps another range of `written` or
/// a range of `read`, so the slices made from them never alias. Ranges are
/// `(index, start, end)`; empty ones alias nothing.
///
/// # Errors
/// The indices of two overlapping ranges.
pub(crate) fn check_disjoint(
    written: &[(usize, usize, usize)],
    read: &[(usize, usize, usize)],
) -> Result<(), (usize, usize)> {
    let mut all: Vec<(usize, usize, usize, bool)> = written
        .iter()
        .map(|&(i, s, e)| (s, e, i, true))
        .chain(read.iter().map(|&(i, s, e)| (s, e, i, false)))
        .filter(|r| r.1 > r.0)
        .collect();
    all.sort_unstable();
    // The furthest-reaching range seen so far among the written and among
    // the read ones, as (end, index).
    let mut far_w: Option<(usize, usize)> = None;
    let mut far_r: Option<(usize, usize)> = None;
    for &(start, end, index, is_written) in &all {
        let reaches = |far: Option<(usize, usize)>| far.filter(|&(e, _)| e > start);
        let clash = if is_written {
            reaches(far_w).or(reaches(far_r))
        } else {
            reaches(far_w)
        };
        if let Some((_, other)) = clash {
            return Err((other, index));
        }
        let far = if is_written { &mut far_w } else { &mut far_r };
        if far.is_none_or(|(e, _)| end > e) {
            *far = Some((end, index));
        }
    }
    Ok(())
}

/// [`check_disjoint`] as an error about `what`.
///
/// # Errors
/// [`Error::Invalid`] naming the two overlapping tensor indices.
pub(crate) fn require_disjoint(
    what: &str,
    written: &[(usize, usize, usize)],
    read: &[(usize, usize, usize)],
) -> Result<(), Error> {
    check_disjoint(written, read).map_err(|(a, b)| {
        Error::invalid(what, format!("the memory of tensors {a} and {b} overlaps"))
    })
}

/// The `(index, start, end)` span of each range.
pub(crate) fn spans(ranges: &[HostRange]) -> Vec<(usize, usize, usize)> {
    ranges
        .iter()
        .map(|r| {
            let (s, e) = r.span();
            (r.index, s, e)
        })
        .collect()
}

/// The `(index, start, end)` span of a slice.
pub(crate) fn slice_span(index: usize, bytes: &[u8]) -> (usize, usize, usize) {
    let start = bytes.as_ptr() as usize;
    (index, start, start + bytes.len())
}

/// A memoryview over `len` bytes at `ptr` that keeps `owner` alive for as
/// long as the view, or any view, array or tensor made from it, lives.
///
/// The bytes are wrapped in a `ctypes` array made with `from_address`, which
/// owns nothing; `owner` is stored as an attribute of that array, and the
/// view returned is a byte-format cast of a memoryview of it, so every view
/// derived from it (slices, `torch.frombuffer`, `numpy.frombuffer`) keeps the
/// array, hence `owner`, alive. ctypes objects take part in garbage
/// collection properly, so a view caught in a reference cycle is freed
/// safely. (pyo3's buffer protocol needs Python 3.11 in abi3 builds; this
/// works from 3.9.)
///
/// # Safety
/// The `len` bytes at `ptr` must stay allocated, and writable when
/// `writable`, for as long as `owner` lives.
pub(crate) unsafe fn memoryview_owned_by<'py>(
    owner: &Bound<'py, PyAny>,
    ptr: *mut u8,
    len: usize,
    writable: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let py = owner.py();
    let ctypes = py.import(intern!(py, "ctypes"))?;
    let array_type = ctypes
        .getattr(intern!(py, "c_char"))?
        .call_method1(intern!(py, "__mul__"), (len,))?;
    // The caller's guarantee (the bytes live while `owner` does) is what
    // makes handing this address to ctypes sound; ctypes only records it.
    let array = array_type.call_method1(intern!(py, "from_address"), (ptr as usize,))?;
    array.setattr(intern!(py, "_acp_owner"), owner)?;
    let view = py
        .import(intern!(py, "builtins"))?
        .getattr(intern!(py, "memoryview"))?
        .call1((array,))?
        .call_method1(intern!(py, "cast"), (intern!(py, "B"),))?;
    if writable {
        Ok(view)
    } else {
        view.call_method0(intern!(py, "toreadonly"))
    }
}

/// A writable memoryview over the slot bytes of tensor `i` of `staging`
/// (see `Staging.buffer`).
///
/// # Errors
/// As [`Staging::slot_bytes`].
pub(crate) fn staging_view<'py>(
    staging: &Bound<'py, Staging>,
    i: usize,
) -> PyResult<Bound<'py, PyAny>> {
    let (ptr, len) = staging.get().slot_bytes(i)?;
    // SAFETY: the bytes are in the mapping of the slot that the core staging
    // held by `staging` owns. Every object that can reach them (the view and
    // whatever is derived from it) keeps the view's exporter, a ctypes array,
    // alive, and the array keeps `staging` alive. `Staging::buffer` watches
    // the array through a weak reference: `finish()` refuses while it lives,
    // and `abort()` keeps the core staging (so the mapping) until `staging`
    // dies, which the array prevents until it is gone. So the mapping
    // outlives every view of it, and no view can write into a sealed slot.
    unsafe { memoryview_owned_by(staging.as_any(), ptr, len, true) }
}

/// A read-only memoryview over the bytes of tensor `i` of `loaded` (see
/// `Loaded.buffer`).
///
/// # Errors
/// As [`Loaded::bytes`].
pub(crate) fn loaded_view<'py>(
    loaded: &Bound<'py, Loaded>,
    i: usize,
) -> PyResult<Bound<'py, PyAny>> {
    if loaded.get().given() {
        let (ptr, len) = loaded.get().given_bytes(i)?;
        // SAFETY: `ptr..ptr + len` is tensor `i`'s bytes inside the private
        // image that the checkpoint `loaded` (a frozen object) owns for its
        // whole life: an anonymous mapping of its own, taken with write
        // access (`Checkpoint::private_image_mut`) when the checkpoint was
        // moved into `loaded`, and the entry lies inside the image (its
        // header was checked against the image when loaded). The view keeps
        // `loaded` alive. Once given, nothing in acp reads or writes the
        // image again (`bytes`, `copy_into` and `protect` refuse), so the
        // caller's writes through the view alias no Rust reference.
        return unsafe { memoryview_owned_by(loaded.as_any(), ptr, len, true) };
    }
    let bytes = loaded.get().bytes(loaded.py(), i)?;
    // SAFETY: the bytes belong to the checkpoint that `loaded` (a frozen
    // object) owns for its whole life, and the view keeps `loaded` alive; the
    // view is read-only, so the pointer is never written through.
    unsafe {
        memoryview_owned_by(
            loaded.as_any(),
            bytes.as_ptr().cast_mut(),
            bytes.len(),
            false,
        )
    }
}

/// The pages of a loaded image made read-only in this process while a
/// zero-copy load hands out tensors over them (`Loaded.protect`), so that
/// a write through one of them faults instead of changing the resident
/// checkpoint. Counted per page range: the range is writable again once
/// the last holder of it is dropped.
///
/// Holders must drop this before the memory's pin (the `Loaded` declares
/// it first): once unpinned, the slot may be reused by a save that writes
/// into it.
#[derive(Debug)]
pub(crate) struct ReadOnly {
    start: usize,
    len: usize,
}

/// Per protected page range `(start, len)`, how many [`ReadOnly`] hold it.
static PROTECTED: std::sync::Mutex<Vec<(usize, usize, usize)>> = std::sync::Mutex::new(Vec::new());

const PAGE: usize = 4096;

impl ReadOnly {
    /// Makes the pages under `ck`'s image read-only, or `None` when they
    /// cannot be: an image that does not start on a page boundary, an
    /// empty one, or an `mprotect` refused. The holder must drop the
    /// result before `ck`.
    pub(crate) fn protect(ck: &Checkpoint) -> Option<ReadOnly> {
        let image = ck.image();
        let start = image.as_ptr() as usize;
        if image.is_empty() || start % PAGE != 0 {
            return None;
        }
        let len = image.len().div_ceil(PAGE) * PAGE;
        let mut table = PROTECTED.lock().ok()?;
        if let Some(e) = table.iter_mut().find(|e| e.0 == start && e.1 == len) {
            e.2 += 1;
            return Some(ReadOnly { start, len });
        }
        // SAFETY: a checkpoint's image is the start of a mapping area that
        // holds it alone: a ring slot's image area (page-aligned, its
        // capacity a multiple of 4096 at least the image's length) or
        // private memory padded to a page; `start` is page-aligned
        // (checked), so `[start, start + len)` covers only the image's own
        // pages. mprotect changes their access rights, no bytes. acp never
        // writes a loaded image while the checkpoint pins it (a sealed slot
        // is written again only once released and acquired by a save;
        // private memory only during its load), and the holder drops this
        // before `ck` (its contract), so no write of acp's faults.
        let rc = unsafe { libc::mprotect(start as *mut libc::c_void, len, libc::PROT_READ) };
        if rc != 0 {
            return None;
        }
        table.push((start, len, 1));
        Some(ReadOnly { start, len })
    }
}

/// The index of the first of `spans` (`(index, start, end)`) that lies
/// on pages made read-only by a [`ReadOnly`], if any.
fn read_only_among(spans: &[(usize, usize, usize)]) -> Option<usize> {
    let table = PROTECTED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if table.is_empty() {
        return None;
    }
    spans
        .iter()
        .filter(|&&(_, s, e)| e > s)
        .find(|&&(_, s, e)| table.iter().any(|&(p, n, _)| s < p + n && p < e))
        .map(|&(i, _, _)| i)
}

/// Of `spans` (`(index, start, end)` of memory a load is about to write),
/// the index of the first that lies on pages a zero-copy load made
/// read-only, if any: for the targets torch fills itself (strided views),
/// which the engine's own check never sees.
#[pyfunction]
pub(crate) fn read_only_target(spans: Vec<(usize, usize, usize)>) -> Option<usize> {
    read_only_among(&spans)
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        let Ok(mut table) = PROTECTED.lock() else {
            return;
        };
        let Some(at) = table
            .iter()
            .position(|e| e.0 == self.start && e.1 == self.len)
        else {
            return;
        };
        table[at].2 -= 1;
        if table[at].2 > 0 {
            return;
        }
        table.swap_remove(at);
        // SAFETY: the same page range `protect` made read-only, still mapped
        // and pinned (holders drop before the pin, per its contract); making
        // it writable again restores the access the mapping had, which the
        // engine needs once the slot is reused. A refusal (a mapping that
        // was never writable) leaves it read-only, which is harmless.
        let _ = unsafe {
            libc::mprotect(
                self.start as *mut libc::c_void,
                self.len,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clash(w: &[(usize, usize, usize)], r: &[(usize, usize, usize)]) -> bool {
        check_disjoint(w, r).is_err()
    }

    #[test]
    fn overlaps() {
        assert!(!clash(&[(0, 0, 10), (1, 10, 20)], &[(2, 20, 30)]));
        assert!(clash(&[(0, 0, 10), (1, 9, 20)], &[]));
        assert!(clash(&[(0, 0, 10)], &[(1, 5, 6)]));
        assert!(clash(&[(0, 5, 6)], &[(1, 0, 10)]));
        assert!(!clash(&[(0, 0, 10)], &[(1, 10, 20), (2, 12, 14)]));
        assert!(!clash(&[], &[(1, 0, 20), (2, 5, 14)]));
        assert!(clash(&[(0, 30, 40)], &[(1, 0, 100), (2, 5, 14)]));
        assert!(!clash(&[(0, 0, 0), (1, 0, 0)], &[(2, 0, 0)]));
    }
}
