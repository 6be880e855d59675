//! How much room the shared-memory directory and the machine leave a ring:
//! what sizes a ring whose budget is not given.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{human_bytes as human, Error, Result};

use super::dir::user_dir;

/// The room a ring may take, measured when it opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShmRoom {
    /// The shared-memory directory measured (e.g. `/dev/shm`).
    pub dir: PathBuf,
    /// Bytes its file system has free for this user (`statvfs`'s
    /// `f_bavail × f_frsize`).
    pub free: u64,
    /// Its file system's size in bytes.
    pub size: u64,
    /// Bytes already held by this ring's own slot files there: they are
    /// reused, so they count as room though no longer free.
    pub held: u64,
    /// `MemAvailable` of `/proc/meminfo` in bytes, when it can be read.
    pub mem_available: Option<u64>,
}

impl ShmRoom {
    /// For people: the figures, e.g. "/dev/shm: 64.0 MiB free of 64.0 MiB,
    /// this ring's files 0 B; MemAvailable 22.1 GiB".
    #[must_use]
    pub fn describe(&self) -> String {
        let mem = self
            .mem_available
            .map_or_else(|| "unknown".to_owned(), human);
        format!(
            "{}: {} free of {}, this ring's files {}; MemAvailable {mem}",
            self.dir.display(),
            human(self.free),
            human(self.size),
            human(self.held)
        )
    }
}

/// Measures `dir` (which must exist) with `statvfs`, the files of the
/// ring named `prefix` in its per-user directory, and `MemAvailable`.
///
/// # Errors
/// [`Error::Io`] naming `dir` when `statvfs` fails (a missing directory).
pub fn shm_room(dir: &Path, prefix: &str) -> Result<ShmRoom> {
    let (free, size) = statvfs(dir).map_err(|e| Error::io("statvfs", dir, e))?;
    Ok(ShmRoom {
        dir: dir.to_path_buf(),
        free,
        size,
        held: held_by(dir, prefix),
        mem_available: mem_available(),
    })
}

/// Whether `dir` is on a file system that keeps its files in memory
/// (tmpfs, ramfs, hugetlbfs), as a ring's directory should be: a ring on a
/// disk's file system works, but every image written into its shared
/// mappings is written back to the disk (page-cache writeback competing
/// with the saves, the flush and the training). `None` when it cannot be
/// told (`statfs` failed).
#[must_use]
pub fn in_ram(dir: &Path) -> Option<bool> {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;
    let c = CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero `statfs` is a valid value of this plain C struct
    // of integers.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated string that lives across the call,
    // and `st` is a valid, writable `statfs` the call fills in.
    let rc = unsafe { libc::statfs(c.as_ptr(), &raw mut st) };
    if rc != 0 {
        return None;
    }
    #[expect(
        clippy::useless_conversion,
        reason = "f_type's type differs between targets"
    )]
    let kind = i64::from(st.f_type);
    Some(matches!(kind, TMPFS_MAGIC | RAMFS_MAGIC | HUGETLBFS_MAGIC))
}

/// `(free for this user, size)` of the file system holding `dir`, in bytes.
fn statvfs(dir: &Path) -> std::io::Result<(u64, u64)> {
    let c = CString::new(dir.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in path"))?;
    // SAFETY: an all-zero `statvfs` is a valid value of this plain C struct
    // of integers.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated string that lives across the call,
    // and `st` is a valid, writable `statvfs` the call fills in.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &raw mut st) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[expect(
        clippy::useless_conversion,
        reason = "the field types differ between targets"
    )]
    let (avail, blocks, frsize) = (
        u64::from(st.f_bavail),
        u64::from(st.f_blocks),
        u64::from(st.f_frsize),
    );
    Ok((avail.saturating_mul(frsize), blocks.saturating_mul(frsize)))
}

/// Bytes allocated to the slot files `{prefix}-s{i}` of the per-user
/// directory under `dir`; 0 where it cannot be listed.
fn held_by(dir: &Path, prefix: &str) -> u64 {
    let Ok(list) = std::fs::read_dir(user_dir(dir)) else {
        return 0;
    };
    let stem = format!("{prefix}-s");
    list.filter_map(std::result::Result::ok)
        .filter(|e| {
            e.file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(&stem))
                .is_some_and(|i| !i.is_empty() && i.bytes().all(|b| b.is_ascii_digit()))
        })
        .filter_map(|e| e.metadata().ok())
        .filter(std::fs::Metadata::is_file)
        .map(|m| m.blocks().saturating_mul(512))
        .sum()
}

/// `MemAvailable` in bytes, from `/proc/meminfo`.
fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut words = line.split_whitespace().skip(1);
    let kib: u64 = words.next()?.parse().ok()?;
    (words.next() == Some("kB")).then(|| kib.saturating_mul(1024))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24684092 kB\nMemFree: 1 kB\nMemAvailable:   23776452 kB\n";
        assert_eq!(parse_mem_available(text), Some(23_776_452 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
        assert_eq!(parse_mem_available("MemAvailable: x kB\n"), None);
    }

    #[test]
    fn a_tmpfs_is_in_ram_and_other_file_systems_are_not() {
        assert_eq!(in_ram(Path::new("/dev/shm")), Some(true));
        assert_eq!(in_ram(Path::new("/proc")), Some(false));
        assert_eq!(in_ram(Path::new("/no/such/dir")), None);
    }

    #[test]
    fn a_directory_is_measured_and_a_missing_one_named() {
        let t = tempfile::tempdir().unwrap();
        let room = shm_room(t.path(), "acp-x-r00000").unwrap();
        assert!(room.size >= room.free && room.size > 0, "{room:?}");
        assert_eq!(room.held, 0);
        let gone = t.path().join("gone");
        let e = shm_room(&gone, "p").unwrap_err();
        assert!(e.to_string().contains("gone"), "{e}");
    }

    #[test]
    fn the_rings_own_files_count_as_held() {
        let t = tempfile::tempdir().unwrap();
        let user = user_dir(t.path());
        std::fs::create_dir(&user).unwrap();
        std::fs::write(user.join("acp-x-r00000-s0"), vec![1u8; 1 << 16]).unwrap();
        std::fs::write(user.join("acp-x-r00000-s1"), vec![1u8; 1 << 16]).unwrap();
        // Another rank's, and a file that only looks alike.
        std::fs::write(user.join("acp-x-r00001-s0"), vec![1u8; 1 << 16]).unwrap();
        std::fs::write(user.join("acp-x-r00000-s0.tmp"), vec![1u8; 1 << 16]).unwrap();
        let held = shm_room(t.path(), "acp-x-r00000").unwrap().held;
        assert!((2 << 16..=(2 << 16) + (64 << 10)).contains(&held), "{held}");
    }

    #[test]
    fn sizes_are_named_for_people() {
        assert_eq!(human(64 << 20), "64.0 MiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
        assert_eq!(human(100), "100 B");
    }
}
