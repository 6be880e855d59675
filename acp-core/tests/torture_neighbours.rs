//! Hostile neighbours: another local user of a shared, sticky shm
//! directory (as `/dev/shm` is) who plants files, symlinks or directories
//! under the names a job's ring uses, or forges a slot file with a control
//! block that claims a resident step. The job's ring lives in its user's
//! private directory (`{shm_dir}/acp-u{euid}`, mode 0700): what others
//! plant beside it does not touch the job, an untrustworthy private
//! directory is refused with an error naming it, and a slot file not owned
//! by the user is ignored by every tool and refused by the engine.
//!
//! The parts that plant files owned by another uid need `chown` (root, as
//! in CI); they run whenever the process may chown and say when they did
//! not.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use acp_core::ops::{self, PersistOptions};
use acp_core::staging::{ring_prefix, slot_file_name, slot_path, user_dir};
use acp_core::{Engine, EngineConfig, ErrorKind, LoadRequest};
use torture_util::{check, dirs, save};

const JOB: &str = "torture-neighbours";
const STRANGER: u32 = 12345;
/// Offsets in a control block (see the staging module docs).
const STATE_OFFSET: u64 = 12;
const STEP_OFFSET: u64 = 16;
const RANK_OFFSET: u64 = 72;

fn config(root: &Path, shm: &Path) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job(JOB)
        .with_ring_slots(2)
        .with_ring_bytes(8 << 20)
        .with_chunk_bytes(64 << 10)
        .with_mlock(false)
}

/// Makes `path` owned by [`STRANGER`]; `false` when this process may not
/// chown (not root).
fn give_away(path: &Path) -> bool {
    match std::os::unix::fs::lchown(path, Some(STRANGER), Some(STRANGER)) {
        Ok(()) => true,
        Err(e) if e.raw_os_error() == Some(libc::EPERM) => false,
        Err(e) => panic!("chown {}: {e}", path.display()),
    }
}

fn skipped(what: &str) {
    eprintln!("SKIPPED {what}: this process may not chown (needs root)");
}

/// A job saves, restores and reopens whatever is planted in the shm
/// directory under its slots' predictable top-level names.
fn job_runs(root: &Path, shm: &Path) {
    let engine = Engine::open(config(root, shm)).unwrap();
    save(&engine, 1).unwrap().wait().unwrap();
    check(&engine.load(&LoadRequest::default()).unwrap()).unwrap();
    engine.close().unwrap();
    drop(engine);
    let engine = Engine::open(config(root, shm)).unwrap();
    assert_eq!(engine.resident_steps(), [1]);
    engine.close().unwrap();
}

#[test]
fn files_and_symlinks_at_the_top_level_slot_names_do_not_affect_the_job() {
    let (_t, root, shm) = dirs();
    std::fs::set_permissions(&shm, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let prefix = ring_prefix(JOB, 0);
    // What a neighbour could squat: the bare slot names in the shm directory.
    let file = shm.join(slot_file_name(&prefix, 0));
    std::fs::write(&file, b"squatted").unwrap();
    let target = shm.join("elsewhere");
    std::fs::write(&target, b"do not touch").unwrap();
    let link = shm.join(slot_file_name(&prefix, 1));
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let foreign = give_away(&file) && give_away(&link) && give_away(&target);
    if !foreign {
        skipped("the squatter as another uid (the files are this user's)");
    }
    job_runs(&root, &shm);
    assert_eq!(std::fs::read(&file).unwrap(), b"squatted");
    assert_eq!(std::fs::read(&target).unwrap(), b"do not touch");
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
    assert!(slot_path(&shm, &prefix, 0).is_file());
}

/// `Engine::open` fails naming the per-user directory, and says how to get
/// out of the way.
fn refused(root: &Path, shm: &Path, what: &str, kinds: &[ErrorKind]) -> String {
    let err = Engine::open(config(root, shm)).unwrap_err();
    let msg = err.to_string();
    assert!(
        kinds.contains(&err.kind()),
        "{what}: {:?}: {msg}",
        err.kind()
    );
    assert!(
        msg.contains(&user_dir(shm).display().to_string()),
        "{what}: names the directory: {msg}"
    );
    assert!(msg.contains("shm_dir"), "{what}: names the fix: {msg}");
    msg
}

#[test]
fn an_untrustworthy_per_user_directory_is_refused() {
    let (_t, root, shm) = dirs();
    let dir = user_dir(&shm);

    // A symlink to a directory that looks right.
    let decoy = shm.join("decoy");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&decoy)
        .unwrap();
    std::os::unix::fs::symlink(&decoy, &dir).unwrap();
    let msg = refused(&root, &shm, "symlink", &[ErrorKind::Invalid]);
    assert!(msg.contains("symlink"), "{msg}");
    assert_eq!(std::fs::read_dir(&decoy).unwrap().count(), 0);
    std::fs::remove_file(&dir).unwrap();

    // A regular file.
    std::fs::write(&dir, b"").unwrap();
    let msg = refused(&root, &shm, "file", &[ErrorKind::Invalid]);
    assert!(msg.contains("not a directory"), "{msg}");
    std::fs::remove_file(&dir).unwrap();

    // A directory others may write into.
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let msg = refused(&root, &shm, "mode 777", &[ErrorKind::Invalid]);
    assert!(msg.contains("777"), "{msg}");
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);

    // Another user's directory, mode 0700 (needs chown).
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    if give_away(&dir) {
        let msg = refused(&root, &shm, "another user's", &[ErrorKind::Busy]);
        assert!(msg.contains(&format!("uid {STRANGER}")), "{msg}");
    } else {
        skipped("a per-user directory owned by another uid");
    }
    std::fs::remove_dir(&dir).unwrap();

    // Once it is gone, the job runs and the directory is private.
    job_runs(&root, &shm);
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.mode() & 0o7777, 0o700);
}

fn poke(path: &Path, at: u64, bytes: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

/// Copies the job's slot holding step 1 to `rank`'s slot 0 and makes its
/// control block claim an unflushed image of `step`.
fn forge(shm: &Path, rank: u32, step: u64) -> PathBuf {
    let real = (0..2)
        .map(|i| slot_path(shm, &ring_prefix(JOB, 0), i))
        .find(|p| {
            acp_core::staging::peek_slot(p)
                .unwrap()
                .is_some_and(|s| s.is_complete() && s.step == 1)
        })
        .unwrap();
    let forged = slot_path(shm, &ring_prefix(JOB, rank), 0);
    std::fs::copy(&real, &forged).unwrap();
    poke(&forged, STATE_OFFSET, &2u32.to_le_bytes()); // Resident
    poke(&forged, STEP_OFFSET, &step.to_le_bytes());
    poke(&forged, RANK_OFFSET, &rank.to_le_bytes());
    forged
}

#[test]
fn a_forged_slot_file_of_another_user_is_ignored_by_the_tools() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm)).unwrap();
    save(&engine, 1).unwrap().wait().unwrap();
    engine.close().unwrap();
    drop(engine);
    let forged = forge(&shm, 3, 99);

    // The control: this user's own forged file is announced.
    let resident_only = |shm: &Path| {
        ops::list(&root, Some(JOB), shm)
            .unwrap()
            .resident_only
            .iter()
            .map(|s| (s.rank, s.step))
            .collect::<Vec<_>>()
    };
    assert_eq!(resident_only(&shm), [(3, Some(99))]);

    if !give_away(&forged) {
        skipped("a forged slot file owned by another uid");
        return;
    }
    assert_eq!(resident_only(&shm), []);
    let listed = ops::list(&root, Some(JOB), &shm).unwrap().slots;
    assert!(listed.iter().all(|s| s.rank == 0), "{listed:#?}");
    assert!(ops::resident(&shm, JOB, Some(3)).unwrap().is_empty());
    let report = ops::persist(&PersistOptions {
        root: root.clone(),
        job: Some(JOB.to_owned()),
        ranks: None,
        shm_dir: shm.clone(),
        world_size: None,
        commit_timeout: std::time::Duration::from_secs(10),
    })
    .unwrap();
    assert!(
        report.ranks.iter().all(|r| r.rank != 3),
        "{:#?}",
        report.ranks
    );
    assert_eq!(report.latest, Some(1));

    // The engine of that rank refuses the file, naming it.
    let err = Engine::open(config(&root, &shm).with_rank(3).with_world_size(4)).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    assert!(
        err.to_string().contains(&forged.display().to_string()),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!("uid {STRANGER}")),
        "{err}"
    );
}
