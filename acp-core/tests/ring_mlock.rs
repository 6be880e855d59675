//! `mlock` of ring slots: used where allowed, and a refusal is reported,
//! never fatal.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use acp_core::staging::{Ring, RingOptions};

const MIB: u64 = 1 << 20;

fn opts(dir: &Path) -> RingOptions {
    RingOptions {
        dir: dir.to_path_buf(),
        prefix: "mlock".to_owned(),
        job_tag: [1; 32],
        rank: 0,
        slots: 2,
        budget: 8 * MIB,
        shared_budget: false,
        chunk_bytes: MIB,
        mlock: true,
    }
}

/// Saves and reads back one image; the ring must work whether or not
/// `mlock` is allowed.
fn round_trip(ring: &Ring) {
    let mut s = ring
        .acquire(MIB, Some(Duration::from_secs(5)))
        .expect("acquire")
        .expect("a free slot");
    s.image_mut()[..4].copy_from_slice(b"abcd");
    let p = s.seal(1, 4);
    assert_eq!(p.image(), b"abcd");
}

#[test]
fn mlock_where_allowed_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, report) = Ring::open(opts(dir.path())).unwrap();
    round_trip(&ring);
    let (locked, why) = ring.mlock_state();
    // Whichever it is on this machine, the report and the state agree and
    // a refusal says why.
    eprintln!(
        "mlock here: report {:?} / {:?}; after growth {locked} / {why:?}",
        report.mlocked, report.mlock_error
    );
    assert_eq!(report.mlocked, report.mlock_error.is_none());
    assert_eq!(locked, why.is_none());
    assert!(!locked || report.mlocked);
}

#[test]
fn mlock_off_reports_unlocked_without_error() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path());
    o.mlock = false;
    let (ring, report) = Ring::open(o).unwrap();
    round_trip(&ring);
    assert!(!report.mlocked);
    assert_eq!(report.mlock_error, None);
    assert_eq!(ring.mlock_state(), (false, None));
}

const CHILD_ENV: &str = "ACP_RING_MLOCK_CHILD";

/// `struct __user_cap_header_struct`.
#[repr(C)]
struct CapHeader {
    version: u32,
    pid: i32,
}

/// `struct __user_cap_data_struct`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

/// Takes `CAP_IPC_LOCK` out of the calling thread's effective set and sets
/// `RLIMIT_MEMLOCK` to 0, as an ordinary user without the capability has it.
fn forbid_mlock() {
    const LINUX_CAPABILITY_VERSION_3: u32 = 0x2008_0522;
    const CAP_IPC_LOCK: u32 = 14;
    let zero = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `zero` is a valid `rlimit` that outlives the call.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raw const zero) };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
    let mut header = CapHeader {
        version: LINUX_CAPABILITY_VERSION_3,
        pid: 0,
    };
    let mut data = [CapData::default(); 2];
    // SAFETY: version 3 reads one header and writes two data structs, both
    // valid and writable for the call.
    let rc = unsafe { libc::syscall(libc::SYS_capget, &raw mut header, data.as_mut_ptr()) };
    assert_eq!(rc, 0, "capget: {}", std::io::Error::last_os_error());
    data[0].effective &= !(1 << CAP_IPC_LOCK);
    // SAFETY: as for capget; capset only reads them.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &raw mut header, data.as_ptr()) };
    assert_eq!(rc, 0, "capset: {}", std::io::Error::last_os_error());
}

/// The child half of [`refused_mlock_is_reported_not_fatal`]; does nothing
/// unless the parent runs it.
#[test]
fn mlock_child_without_permission() {
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    forbid_mlock();
    let dir = Path::new(&dir);
    // A slot left by a previous ring: the open reports the limit before
    // the slot is locked (as it is pre-faulted).
    {
        let mut o = opts(dir);
        o.mlock = false;
        let (ring, _) = Ring::open(o).unwrap();
        round_trip(&ring);
    }
    let (ring, report) = Ring::open(opts(dir)).unwrap();
    assert_eq!(report.recovered.len(), 1);
    assert!(!report.mlocked);
    let why = report.mlock_error.expect("a reason for the refusal");
    assert!(why.contains("mlock"), "{why}");
    eprintln!("refused as expected: {why}");
    round_trip(&ring);
    let (locked, why) = ring.mlock_state();
    assert!(!locked);
    assert!(why.is_some());
}

#[test]
fn refused_mlock_is_reported_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "mlock_child_without_permission",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
}
