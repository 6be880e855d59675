//! The one way acp opens a checkpoint file for reading: never through a
//! symlink, never blocking on a FIFO or a device, and only a regular file.
//!
//! A hostile checkpoint can put anything where a data file, an index or a
//! manifest should be. A plain blocking `open` of a FIFO waits for a writer
//! for ever, so the type is checked on the descriptor (`fstat`), after an
//! open that cannot block (`O_NONBLOCK`) and does not follow a final
//! symlink (`O_NOFOLLOW`); `O_NONBLOCK` is cleared once the file is known
//! to be regular, so reads behave as usual.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

use crate::error::{Error, Result};

/// Opens `path` read-only (`O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC`), checks
/// with `fstat` that it is a regular file, then clears `O_NONBLOCK`.
///
/// # Errors
/// [`Error::Corrupt`] naming `path` and what it is when it is a symlink, a
/// FIFO, a socket, a device or a directory; [`Error::Io`] for any other
/// failure to open (a missing file is [`Error::Io`] with
/// [`std::io::ErrorKind::NotFound`] as its source, for the caller to name).
pub fn open_regular(path: &Path) -> Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            // ELOOP is how O_NOFOLLOW refuses a symlink as the last component.
            let symlink = e.raw_os_error() == Some(libc::ELOOP)
                && std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
            if symlink {
                not_regular(path, "symlink")
            } else {
                Error::io("open", path, e)
            }
        })?;
    let ft = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .file_type();
    if !ft.is_file() {
        let what = if ft.is_fifo() {
            "FIFO"
        } else if ft.is_socket() {
            "socket"
        } else if ft.is_block_device() {
            "block device"
        } else if ft.is_char_device() {
            "character device"
        } else if ft.is_dir() {
            "directory"
        } else {
            "special file"
        };
        return Err(not_regular(path, what));
    }
    clear_nonblock(&file).map_err(|e| Error::io("fcntl", path, e))?;
    Ok(file)
}

/// As [`open_regular`], for a data file a step's index lists with `size`
/// bytes: a missing file, or one whose real size (`fstat`) is not `size`,
/// is [`Error::Corrupt`], so nothing is sized by an index that disagrees
/// with the file.
///
/// # Errors
/// As [`open_regular`]; [`Error::Corrupt`] for a missing file or another
/// size, naming the file (and both sizes).
pub fn open_listed(path: &Path, size: u64) -> Result<File> {
    let file = open_regular(path).map_err(|e| match e {
        Error::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            Error::corrupt(
                path,
                None,
                "missing: the index lists it, the step directory does not hold it",
            )
        }
        other => other,
    })?;
    let got = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    if got != size {
        return Err(Error::corrupt(
            path,
            None,
            format!("file is {got} bytes, the index says {size}"),
        ));
    }
    Ok(file)
}

fn not_regular(path: &Path, what: &str) -> Error {
    Error::corrupt(path, None, format!("a {what}, not a regular file"))
}

/// Clears `O_NONBLOCK` on `file`'s open file description (`F_GETFL`, then
/// `F_SETFL` when it is set).
///
/// # Errors
/// Any OS error of `fcntl`.
#[expect(
    unsafe_code,
    reason = "fcntl(2) has no std wrapper; the calls pass only an fd that `file` keeps open and integers"
)]
fn clear_nonblock(file: &File) -> std::io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is open for the whole call (`file` is borrowed);
    // F_GETFL takes no argument and reads no memory of ours.
    let old = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if old < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if old & libc::O_NONBLOCK == 0 {
        return Ok(());
    }
    // SAFETY: as above; F_SETFL takes an integer flag word.
    let rc = unsafe { libc::fcntl(fd, libc::F_SETFL, old & !libc::O_NONBLOCK) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Creates `path` (for every file the storage creates, and
/// `IoEngine::write_file`): write-only, mode 0600, `O_EXCL` (it must not
/// exist), close-on-exec.
///
/// # Errors
/// [`Error::Io`] naming `path`.
pub(crate) fn create_exclusive(path: &Path) -> Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| Error::io("create", path, e))
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;
    use crate::error::ErrorKind;

    fn mkfifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        #[expect(unsafe_code, reason = "mkfifo(3) has no std wrapper")]
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
    }

    #[test]
    fn opens_regular_files_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"data").unwrap();
        let mut f = open_regular(&path).unwrap();
        let mut s = String::new();
        f.read_to_string(&mut s).unwrap();
        assert_eq!(s, "data");
        // SAFETY: F_GETFL on an fd `f` keeps open.
        #[expect(unsafe_code, reason = "fcntl(2) has no std wrapper")]
        let fl = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&f), libc::F_GETFL) };
        assert_eq!(fl & libc::O_NONBLOCK, 0);
    }

    #[test]
    fn refuses_everything_else_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        std::fs::write(&target, b"data").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let fifo = dir.path().join("fifo");
        mkfifo(&fifo);
        let sock = dir.path().join("sock");
        let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        for (path, what) in [
            (link.as_path(), "symlink"),
            (fifo.as_path(), "FIFO"),
            (dir.path(), "directory"),
            (Path::new("/dev/null"), "character device"),
        ] {
            let e = open_regular(path).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
            let msg = e.to_string();
            assert!(msg.contains(what), "{msg}");
            assert!(msg.contains(&path.display().to_string()), "{msg}");
        }
        // A socket cannot be opened at all (ENXIO): an error, not a hang.
        assert!(open_regular(&sock).is_err());
        let e = open_regular(&dir.path().join("missing")).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        let e = open_listed(&dir.path().join("missing"), 4).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().contains("missing"), "{e}");
        let e = open_listed(&target, 5).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(
            e.to_string().contains("file is 4 bytes, the index says 5"),
            "{e}"
        );
        open_listed(&target, 4).unwrap();
    }
}
