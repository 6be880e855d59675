//! The physical baselines of the flush and restore benches: plain
//! `O_DIRECT` writes and reads, written here without acp's io layer.
//!
//! - [`write_pwrite`]: one `pwrite` of `block` bytes at a time (queue depth 1);
//! - [`write_uring`] / [`read_uring`]: `io_uring` with `qd` blocks in flight;
//! - [`read_buffered`]: a plain sequential `read` loop through the page cache.
//!
//! Writes create a fresh file (`O_EXCL`, mode 0600) and end with `fsync`,
//! as acp's flush does. Buffers must be 4096-aligned and their lengths
//! multiples of 4096 (see [`AlignedBuf::padded`](crate::AlignedBuf::padded)).

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;

use io_uring::{opcode, types, IoUring};

fn create_direct(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_DIRECT)
        .open(path)
}

fn check_aligned(buf: &[u8]) -> io::Result<()> {
    if buf.as_ptr().align_offset(4096) != 0 || buf.len() % 4096 != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "O_DIRECT buffer must be 4096-aligned with a length multiple of 4096",
        ));
    }
    Ok(())
}

/// Writes `src` to a new file at `path` with `O_DIRECT`, `block` bytes per
/// `pwrite`, then `fsync`s it.
///
/// # Errors
/// Any failed system call; a misaligned buffer.
pub fn write_pwrite(path: &Path, src: &[u8], block: usize) -> io::Result<()> {
    check_aligned(src)?;
    let file = create_direct(path)?;
    for (i, piece) in src.chunks(block).enumerate() {
        file.write_all_at(piece, (i * block) as u64)?;
    }
    file.sync_all()
}

/// Writes `src` to a new file at `path` with `O_DIRECT` through `io_uring`,
/// `block` bytes per write and up to `qd` writes in flight, then `fsync`s it.
/// With `preallocate`, the file's blocks are allocated first (`fallocate`),
/// so the writes do not extend it.
///
/// # Errors
/// Any failed system call or short write; a misaligned buffer.
pub fn write_uring(
    path: &Path,
    src: &[u8],
    block: usize,
    qd: usize,
    preallocate: bool,
) -> io::Result<()> {
    check_aligned(src)?;
    let file = create_direct(path)?;
    if preallocate {
        fallocate(&file, src.len())?;
    }
    let done = uring_io(&file, src.as_ptr().cast_mut(), src.len(), block, qd, true)?;
    if done != src.len() {
        return Err(io::Error::other(format!("wrote {done} of {}", src.len())));
    }
    file.sync_all()
}

/// Reads the whole file at `path` into `dst` with `O_DIRECT` through
/// `io_uring`, `block` bytes per read, up to `qd` in flight; returns its length.
///
/// # Errors
/// Any failed system call; `dst` smaller than the file rounded up to 4096.
pub fn read_uring(path: &Path, dst: &mut [u8], block: usize, qd: usize) -> io::Result<usize> {
    check_aligned(dst)?;
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(path)?;
    let len = usize::try_from(file.metadata()?.len()).map_err(io::Error::other)?;
    let padded = len.div_ceil(4096) * 4096;
    if padded > dst.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("file of {len} bytes does not fit {} bytes", dst.len()),
        ));
    }
    let done = uring_io(&file, dst.as_mut_ptr(), padded, block, qd, false)?;
    if done != len {
        return Err(io::Error::other(format!("read {done} of {len}")));
    }
    Ok(len)
}

/// Reads the whole file at `path` into `dst` with plain `read` calls of up
/// to `block` bytes (buffered I/O); returns its length.
///
/// # Errors
/// Any failed read; `dst` too small for the file.
pub fn read_buffered(path: &Path, dst: &mut [u8], block: usize) -> io::Result<usize> {
    let mut file = File::open(path)?;
    let mut pos = 0;
    loop {
        if pos == dst.len() {
            let mut probe = [0u8; 1];
            if file.read(&mut probe)? != 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "file larger than the buffer",
                ));
            }
            return Ok(pos);
        }
        let end = (pos + block).min(dst.len());
        match file.read(&mut dst[pos..end]) {
            Ok(0) => return Ok(pos),
            Ok(n) => pos += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

#[expect(unsafe_code, reason = "fallocate(2) has no safe std wrapper")]
fn fallocate(file: &File, len: usize) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(io::Error::other)?;
    // SAFETY: a plain system call on a descriptor `file` keeps open; it
    // touches no memory of this process.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Moves `total` bytes between `base` and `file` at the same offsets, in
/// `block`-byte operations with up to `qd` in flight; returns the bytes
/// moved. Stops submitting at the first error or short operation but always
/// waits for every submitted operation before returning, so `base` is never
/// used by the kernel after this returns.
#[expect(
    unsafe_code,
    reason = "io_uring submissions borrow the buffer for the kernel"
)]
fn uring_io(
    file: &File,
    base: *mut u8,
    total: usize,
    block: usize,
    qd: usize,
    write: bool,
) -> io::Result<usize> {
    let qd = qd.clamp(1, 4096);
    let mut ring = IoUring::new(u32::try_from(qd).map_err(io::Error::other)?)?;
    if block == 0 || u32::try_from(block).is_err() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("block of {block} bytes"),
        ));
    }
    let fd = types::Fd(file.as_raw_fd());
    let blocks = total.div_ceil(block);
    let (mut next, mut in_flight, mut moved) = (0usize, 0usize, 0usize);
    let mut first_err: Option<io::Error> = None;
    while next < blocks || in_flight > 0 {
        while first_err.is_none() && next < blocks && in_flight < qd {
            let off = next * block;
            let len = u32::try_from(block.min(total - off))
                .expect("at most `block`, checked above to fit a u32");
            // SAFETY: `off < total`, so the pointer stays inside the buffer
            // of `total` bytes the caller passed.
            let ptr = unsafe { base.add(off) };
            let entry = if write {
                opcode::Write::new(fd, ptr, len).offset(off as u64).build()
            } else {
                opcode::Read::new(fd, ptr, len).offset(off as u64).build()
            }
            .user_data(off as u64);
            // SAFETY: the entry points at `len` bytes inside the caller's
            // buffer and at `file`'s descriptor; both outlive this function,
            // and this function waits for every submitted entry to complete
            // before it returns, on every path.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                break;
            }
            next += 1;
            in_flight += 1;
        }
        if in_flight == 0 {
            break;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) =>
            {
                continue;
            }
            Err(e) => {
                // Whether the kernel still owns part of the buffer is
                // unknown: returning could let it write freed memory.
                eprintln!("acp-bench: io_uring_enter failed with I/O in flight: {e}");
                std::process::abort();
            }
        }
        for cqe in ring.completion() {
            in_flight -= 1;
            let off = usize::try_from(cqe.user_data())
                .expect("user data is the offset of a submitted block, below `total`");
            let want = block.min(total - off);
            match usize::try_from(cqe.result()) {
                // A read may stop short only in the last block: the end of
                // a file whose length is not a multiple of 4096.
                Ok(n) if n == want || (!write && off + want == total) => moved += n,
                Ok(n) => {
                    moved += n;
                    first_err.get_or_insert(io::Error::other(format!(
                        "short {} at {off}: {n} of {want} bytes",
                        if write { "write" } else { "read" }
                    )));
                }
                Err(_) => {
                    first_err.get_or_insert(io::Error::from_raw_os_error(-cqe.result()));
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(moved),
    }
}
