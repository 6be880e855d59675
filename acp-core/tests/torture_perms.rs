//! Torture 7: shared-memory slots and checkpoint files are readable by
//! their owner only. The slots sit in a world-writable sticky directory
//! (as `/dev/shm` is), the root under a world-readable parent; another user
//! (the test, as root, runs a child as uid/gid 65534) can open none of the
//! slot files, list none of the checkpoint directories, read none of the
//! files, and cannot open the engine of that job over the slots.
//!
//! The mode bits are checked for any user; the other-user part needs root
//! and says so when skipped.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use acp_core::{Engine, EngineConfig, ErrorKind};
use torture_util::{report, save};

const NOBODY: u32 = 65534;

fn config(root: &Path, shm: &Path) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("torture-perms")
        .with_ring_bytes(8 << 20)
        .with_chunk_bytes(64 << 10)
        .with_mlock(false)
}

/// The other user's side: every path given must be out of reach.
#[test]
fn child() {
    if std::env::var("ACP_TORTURE_CHILD").is_err() {
        return;
    }
    let root = PathBuf::from(std::env::var("ACP_ROOT").unwrap());
    let shm = PathBuf::from(std::env::var("ACP_SHM").unwrap());
    let paths: Vec<PathBuf> = std::env::var("ACP_PATHS")
        .unwrap()
        .split('\n')
        .map(PathBuf::from)
        .collect();
    let mut reachable = Vec::new();
    // The control: the world-readable parent is listable, so what follows
    // is refused by the files' own modes, not by the child's setup.
    let control = PathBuf::from(std::env::var("ACP_CONTROL").unwrap());
    assert!(
        std::fs::read_dir(&control).is_ok(),
        "the child cannot list the world-readable {}",
        control.display()
    );
    // SAFETY: getuid has no preconditions and cannot fail.
    assert_eq!(unsafe { libc::getuid() }, NOBODY);
    for p in &paths {
        if std::fs::File::open(p).is_ok() || std::fs::read_dir(p).is_ok() {
            reachable.push(p.display().to_string());
        }
    }
    // Refused for the root (another user's) or, past that, for the slots.
    match Engine::open(config(&root, &shm)) {
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::Config | ErrorKind::Busy | ErrorKind::Io
            ) => {}
        Err(e) => reachable.push(format!("engine open: unexpected {e}")),
        Ok(_) => reachable.push("engine open over another user's slots succeeded".into()),
    }
    assert!(reachable.is_empty(), "another user reaches: {reachable:#?}");
}

#[test]
fn slots_and_checkpoint_files_are_private_to_their_owner() {
    let mut failures = Vec::new();
    let t = tempfile::tempdir().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = t.path().join("ckpt");
    let shm = t.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let engine = Engine::open(config(&root, &shm)).unwrap();
    save(&engine, 1).unwrap().wait().unwrap();
    save(&engine, 2).unwrap().wait().unwrap();
    engine.close().unwrap();
    drop(engine);

    let mut paths = vec![root.clone()];
    paths.extend(torture_util::files_under(&root));
    for ent in std::fs::read_dir(&root).unwrap().flatten() {
        if ent.file_type().unwrap().is_dir() {
            paths.push(ent.path());
        }
    }
    let slots = torture_util::files_under(&shm);
    assert!(!slots.is_empty());
    // The per-user directory that holds them: mode 0700 exactly.
    let dir = acp_core::staging::user_dir(&shm);
    let mode = std::fs::symlink_metadata(&dir).unwrap().mode() & 0o7777;
    if mode != 0o700 {
        failures.push(format!("{}: mode {mode:o}, not 700", dir.display()));
    }
    paths.push(dir);
    paths.extend(slots);
    // Mode bits: nothing for group or others, on every file and directory.
    for p in &paths {
        let mode = std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
        if mode & 0o077 != 0 {
            failures.push(format!("{}: mode {mode:o}", p.display()));
        }
    }
    // Another user, for real.
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let mut trials = paths.len() as u64;
    if euid == 0 {
        trials += paths.len() as u64 + 1;
        let list: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
        let out = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
            .env("ACP_TORTURE_CHILD", "1")
            .env("ACP_ROOT", &root)
            .env("ACP_SHM", &shm)
            .env("ACP_PATHS", list.join("\n"))
            .env("ACP_CONTROL", t.path())
            .uid(NOBODY)
            .gid(NOBODY)
            .output()
            .unwrap();
        if !out.status.success() {
            failures.push(format!(
                "as uid {NOBODY}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
    } else {
        eprintln!("SKIPPED the other-user part: needs root to run a child as uid {NOBODY}");
    }
    report("permissions", trials, &failures);
}
