//! `acp ls --shm` and `acp gc --shm` as a user who is not root, beside a
//! slot file in their per-user directory that they cannot open (put there
//! by root, or made unreadable by hand): it is ignored, as a file of
//! another user is, and the user's own rings are listed and reclaimed. As
//! root every file opens, so the test (root, as in CI) runs its checks in
//! a child process as uid 65534, and says so when it cannot.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use acp_core::ops::{shm_gc, shm_list, ShmGcOptions};
use acp_core::{Dtype, Engine, EngineConfig, HostTensor, SaveOptions};

const NOBODY: u32 = 65534;
const PLANTED: &str = "acp-0000000000000000-r00007-s0";

fn paths() -> (PathBuf, PathBuf) {
    let var = |k: &str| PathBuf::from(std::env::var(k).unwrap());
    (var("ACP_ROOT"), var("ACP_SHM"))
}

/// A committed step in a closed ring of this user's.
fn make(root: &Path, shm: &Path) {
    let engine = Engine::open(
        EngineConfig::new(root)
            .with_job("as-user")
            .with_shm_dir(shm)
            .with_ring_bytes(8 << 20)
            .with_ring_slots(2)
            .with_mlock(false),
    )
    .unwrap();
    let data = vec![7u8; 8192];
    engine
        .save(
            1,
            &[HostTensor {
                name: "w",
                dtype: Dtype::U8,
                shape: &[8192],
                data: &data,
            }],
            &serde_json::json!({}),
            &SaveOptions::default(),
        )
        .unwrap()
        .wait()
        .unwrap();
    engine.close().unwrap();
}

/// The user's side.
#[test]
fn child() {
    let Ok(what) = std::env::var("ACP_SHM_TOOLS_CHILD") else {
        return;
    };
    let (root, shm) = paths();
    if what == "make" {
        make(&root, &shm);
        return;
    }
    let listed = shm_list(&shm).unwrap();
    let steps: Vec<_> = listed
        .rings
        .iter()
        .map(|r| r.resident_steps.clone())
        .collect();
    assert_eq!(steps, [vec![1]], "{listed:#?}");
    let gc = shm_gc(&shm, &ShmGcOptions::default()).unwrap();
    let removed: Vec<_> = gc.rings.iter().map(|r| (r.rank, r.removed)).collect();
    assert_eq!(removed, [(0, true)], "{gc:#?}");
}

fn as_nobody(what: &str, root: &Path, shm: &Path) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("ACP_SHM_TOOLS_CHILD", what)
        .env("ACP_ROOT", root)
        .env("ACP_SHM", shm)
        .uid(NOBODY)
        .gid(NOBODY)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "as uid {NOBODY} ({what}): {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn an_unreadable_file_in_the_users_directory_is_ignored_by_ls_and_gc_shm() {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: needs root to run a child as uid {NOBODY}");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    for d in [&root, &shm] {
        std::fs::create_dir(d).unwrap();
        std::os::unix::fs::chown(d, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    as_nobody("make", &root, &shm);
    // Root's file, 0600, under a slot file's name in the user's directory.
    let dir = shm.join(format!("acp-u{NOBODY}"));
    let planted = dir.join(PLANTED);
    std::fs::write(&planted, [0u8; 4096]).unwrap();
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o600)).unwrap();
    as_nobody("check", &root, &shm);
    assert!(planted.exists(), "the file the user cannot open is left");
}
