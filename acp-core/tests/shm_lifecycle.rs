//! The RAM tier's lifecycle: `release_on_close`, `acp gc --shm` and `acp ls
//! --shm` (the ops behind them), and the reclaim of expired rings at open.
//! Every test uses its own shared-memory directory.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use acp_core::ops::{shm_gc, shm_list, ShmGcOptions};
use acp_core::storage::faults::FaultInjector;
use acp_core::{Dtype, Engine, EngineConfig, HostTensor, SaveHandle, SaveOptions};

fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ckpt");
    let shm = t.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    (t, root, shm)
}

fn config(root: &Path, shm: &Path, job: &str) -> EngineConfig {
    EngineConfig::new(root)
        .with_job(job)
        .with_shm_dir(shm)
        .with_ring_bytes(8 << 20)
        .with_ring_slots(2)
        .with_mlock(false)
}

fn save(engine: &Engine, step: u64) -> SaveHandle {
    let data = vec![u8::try_from(step % 251).unwrap(); 8192];
    engine
        .save(
            step,
            &[HostTensor {
                name: "w",
                dtype: Dtype::U8,
                shape: &[8192],
                data: &data,
            }],
            &serde_json::json!({"step": step}),
            &SaveOptions::default(),
        )
        .unwrap()
}

/// The slot files in the per-user directory of `shm`.
fn slot_files(shm: &Path) -> Vec<String> {
    let dir = acp_core::staging::user_dir(shm);
    let mut v: Vec<String> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// Sets every slot file's modification time `age` into the past.
fn age_files(shm: &Path, age: Duration) {
    let when = SystemTime::now() - age;
    let dir = acp_core::staging::user_dir(shm);
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(e.path())
            .unwrap();
        f.set_modified(when).unwrap();
    }
}

/// A dead job's ring: steps saved and committed, then closed (its open
/// reclaims nothing).
fn dead_ring(root: &Path, shm: &Path, job: &str, steps: &[u64]) {
    let engine = Engine::open(config(root, shm, job).with_shm_ttl(Duration::ZERO)).unwrap();
    for &s in steps {
        save(&engine, s).wait().unwrap();
    }
    engine.close().unwrap();
}

#[test]
fn release_on_close_removes_the_ring_once_everything_is_committed() {
    let (_t, root, shm) = dirs();
    // The default keeps the newest resident step.
    dead_ring(&root, &shm, "keep", &[1]);
    assert_eq!(slot_files(&shm).len(), 2, "{:?}", slot_files(&shm));

    let (_t2, root2, shm2) = dirs();
    let engine =
        Engine::open(config(&root2, &shm2, "release").with_release_on_close(true)).unwrap();
    save(&engine, 1).wait().unwrap();
    save(&engine, 2).wait().unwrap();
    assert_eq!(slot_files(&shm2).len(), 2);
    assert_eq!(engine.kept_on_close(), None);
    engine.close().unwrap();
    assert_eq!(engine.kept_on_close(), Some(vec![]));
    assert_eq!(slot_files(&shm2), Vec::<String>::new());
    assert!(
        !acp_core::staging::user_dir(&shm2).exists(),
        "the emptied per-user directory is removed"
    );
    // The checkpoint itself is still there, and loads from storage.
    let again = Engine::open(config(&root2, &shm2, "release").with_release_on_close(true)).unwrap();
    assert_eq!(again.steps().unwrap(), [1, 2]);
    again.close().unwrap();
}

#[test]
fn release_on_close_keeps_a_ring_holding_an_uncommitted_step() {
    let (_t, root, shm) = dirs();
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(
        config(&root, &shm, "uncommitted")
            .with_release_on_close(true)
            .with_faults(Arc::clone(&faults)),
    )
    .unwrap();
    save(&engine, 1).wait().unwrap();
    // Step 2's flush fails: it is resident only.
    faults.arm(0, libc::EIO, true);
    assert!(save(&engine, 2).wait().is_err());
    // Step 2 is resident; step 1 (committed) too, unless step 2's save
    // found the other slot still being grown by the warming thread and
    // took step 1's slot instead (a committed step's resident copy is
    // only a cache): which one happens depends on timing.
    let resident = engine.resident_steps();
    assert!(
        resident == [2, 1] || resident == [2],
        "resident steps: {resident:?}"
    );
    engine.close().unwrap();
    assert_eq!(engine.kept_on_close(), Some(vec![2]));
    assert_eq!(
        slot_files(&shm).len(),
        2,
        "the only copy of step 2 is kept in RAM"
    );
    // And it is still there to be committed.
    drop(engine);
    faults.heal();
    let again =
        Engine::open(config(&root, &shm, "uncommitted").with_release_on_close(true)).unwrap();
    again.wait_idle(None).unwrap();
    assert_eq!(again.steps().unwrap(), [1, 2]);
    again.close().unwrap();
    assert_eq!(slot_files(&shm), Vec::<String>::new());
}

#[test]
fn ls_shm_shows_each_ring_its_root_steps_and_holder() {
    let (t, root, shm) = dirs();
    dead_ring(&root, &shm, "dead", &[3, 4]);
    let live_root = t.path().join("live");
    let live = Engine::open(config(&live_root, &shm, "live")).unwrap();
    save(&live, 7).wait().unwrap();

    let r = shm_list(&shm).unwrap();
    assert_eq!(r.rings.len(), 2, "{r:?}");
    let dead = r
        .rings
        .iter()
        .find(|g| g.job.as_deref() == Some("dead"))
        .unwrap();
    let canon = std::fs::canonicalize(&root).unwrap();
    assert_eq!(dead.root.as_deref(), Some(canon.to_str().unwrap()));
    // Step 3's resident copy may have been taken by step 4's save while
    // the warming thread grew the other slot (timing: see above); step 4,
    // the newest, is resident either way.
    assert!(
        dead.resident_steps == [4, 3] || dead.resident_steps == [4],
        "{:?}",
        dead.resident_steps
    );
    // Both steps are committed: whichever is resident is.
    assert_eq!(dead.committed_steps, dead.resident_steps);
    assert!(dead.only_copy_steps.is_empty());
    assert!(!dead.live);
    assert!(dead.bytes > 0);
    let alive = r
        .rings
        .iter()
        .find(|g| g.job.as_deref() == Some("live"))
        .unwrap();
    assert!(alive.live, "{alive:?}");
    assert_eq!(alive.owner_pid, Some(std::process::id()));
    assert_eq!(alive.resident_steps, [7]);
    assert_eq!(r.bytes, dead.bytes + alive.bytes);
    // Probing did not disturb the live ring.
    save(&live, 8).wait().unwrap();
    live.close().unwrap();
}

#[test]
fn ls_shm_of_a_ring_without_an_origin_says_unknown() {
    let (_t, root, shm) = dirs();
    dead_ring(&root, &shm, "old", &[1]);
    // A ring written before the origin record existed: reserved bytes zero.
    let dir = acp_core::staging::user_dir(&shm);
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(e.path())
            .unwrap();
        f.write_all_at(&[0u8; 4096 - 112], 112).unwrap();
    }
    let r = shm_list(&shm).unwrap();
    assert_eq!(r.rings.len(), 1);
    assert_eq!(r.rings[0].root, None);
    assert_eq!(r.rings[0].job, None);
    assert_eq!(r.rings[0].resident_steps, [1]);
    // Its step was marked persisted by its flush: gc may drop it.
    let g = shm_gc(&shm, &ShmGcOptions::default()).unwrap();
    assert!(g.rings[0].removed, "{g:?}");
}

#[test]
fn gc_shm_removes_dead_committed_rings_and_nothing_else() {
    let (t, root, shm) = dirs();
    dead_ring(&root, &shm, "done", &[1, 2]);
    // A dead ring whose newest step was never committed: its root lost it.
    let lost_root = t.path().join("lost");
    dead_ring(&lost_root, &shm, "lost", &[5]);
    std::fs::remove_dir_all(lost_root.join("step-000000000005")).unwrap();
    // A live ring, fully committed.
    let live_root = t.path().join("live");
    let live = Engine::open(config(&live_root, &shm, "live")).unwrap();
    save(&live, 9).wait().unwrap();
    let before = slot_files(&shm);
    assert_eq!(before.len(), 6);

    // --dry-run removes nothing and says what it would.
    let dry = shm_gc(
        &shm,
        &ShmGcOptions {
            dry_run: true,
            ..ShmGcOptions::default()
        },
    )
    .unwrap();
    assert_eq!(slot_files(&shm), before);
    let by_job = |r: &acp_core::ops::ShmGcReport, job: &str| {
        r.rings
            .iter()
            .find(|g| g.job.as_deref() == Some(job))
            .cloned()
            .unwrap()
    };
    assert!(by_job(&dry, "done").removed);
    assert!(dry.freed_bytes > 0);
    assert_eq!(dry.freed_bytes, by_job(&dry, "done").bytes);

    let r = shm_gc(&shm, &ShmGcOptions::default()).unwrap();
    let done = by_job(&r, "done");
    assert!(done.removed, "{done:?}");
    assert_eq!(r.freed_bytes, done.bytes);
    let lost = by_job(&r, "lost");
    assert!(!lost.removed);
    assert!(lost.reason.contains("only copy"), "{}", lost.reason);
    let held = by_job(&r, "live");
    assert!(!held.removed);
    assert!(held.reason.contains("live process"), "{}", held.reason);
    assert_eq!(slot_files(&shm).len(), 4);

    // --force drops the only copy, but never a live ring.
    let r = shm_gc(
        &shm,
        &ShmGcOptions {
            force: true,
            ..ShmGcOptions::default()
        },
    )
    .unwrap();
    assert!(by_job(&r, "lost").removed);
    assert!(!by_job(&r, "live").removed);
    assert_eq!(slot_files(&shm).len(), 2);
    save(&live, 10).wait().unwrap();
    live.close().unwrap();
    assert_eq!(live.steps().unwrap(), [9, 10]);
}

#[test]
fn gc_shm_counts_a_superseded_step_as_safe() {
    let (_t, root, shm) = dirs();
    dead_ring(&root, &shm, "sup", &[1, 2]);
    // Step 1 is gone from the root, but step 2 supersedes it.
    std::fs::remove_dir_all(root.join("step-000000000001")).unwrap();
    let r = shm_gc(&shm, &ShmGcOptions::default()).unwrap();
    assert!(r.rings[0].removed, "{r:?}");
}

#[test]
fn gc_shm_ttl_keeps_young_rings() {
    let (_t, root, shm) = dirs();
    dead_ring(&root, &shm, "young", &[1]);
    let opts = ShmGcOptions {
        ttl: Some(Duration::from_secs(3600)),
        ..ShmGcOptions::default()
    };
    let r = shm_gc(&shm, &opts).unwrap();
    assert!(!r.rings[0].removed);
    assert!(r.rings[0].reason.contains("TTL"), "{}", r.rings[0].reason);
    age_files(&shm, Duration::from_secs(7200));
    let r = shm_gc(&shm, &opts).unwrap();
    assert!(r.rings[0].removed, "{r:?}");
}

#[test]
fn open_drops_expired_committed_rings_of_other_jobs() {
    let (t, root, shm) = dirs();
    dead_ring(&root, &shm, "old-done", &[1]);
    let lost_root = t.path().join("lost");
    dead_ring(&lost_root, &shm, "old-lost", &[2]);
    std::fs::remove_dir_all(lost_root.join("step-000000000002")).unwrap();
    age_files(&shm, Duration::from_secs(2 * 86400));
    let fresh_root = t.path().join("fresh");
    dead_ring(&fresh_root, &shm, "fresh", &[3]);
    assert_eq!(slot_files(&shm).len(), 6);

    // TTL 0: off.
    let other = t.path().join("other");
    let e = Engine::open(config(&other, &shm, "other").with_shm_ttl(Duration::ZERO)).unwrap();
    e.close().unwrap();
    drop(e);
    assert_eq!(slot_files(&shm).len(), 8);

    // The default TTL (24 h): only the old, committed ring goes.
    let e = Engine::open(config(&other, &shm, "other")).unwrap();
    let jobs: Vec<Option<String>> = shm_list(&shm)
        .unwrap()
        .rings
        .into_iter()
        .map(|g| g.job)
        .collect();
    assert_eq!(jobs.len(), 3, "{jobs:?}");
    assert!(!jobs.contains(&Some("old-done".to_owned())));
    assert!(jobs.contains(&Some("old-lost".to_owned())));
    assert!(jobs.contains(&Some("fresh".to_owned())));
    e.close().unwrap();
}

/// `acp gc --shm` removes a ring by the names of the files it holds
/// locked. A name that no longer refers to the file it locked (the ring's
/// process released it meanwhile, and a new process of the job opened the
/// ring again at the same names) is left alone: unlinking it would leave
/// the new process's images in files no later process finds.
#[test]
fn gc_shm_never_unlinks_a_slot_file_it_does_not_hold() {
    let (_t, root, shm) = dirs();
    dead_ring(&root, &shm, "again", &[1]);
    let ring = acp_core::staging::rings(&shm).unwrap().remove(0);
    let held = ring.hold().unwrap().unwrap();
    // The names change under the held files (here without the locks that
    // a release takes, which the race slips between).
    let names = slot_files(&shm);
    let dir = acp_core::staging::user_dir(&shm);
    for n in &names {
        std::fs::remove_file(dir.join(n)).unwrap();
    }
    let engine = Engine::open(config(&root, &shm, "again")).unwrap();
    let live = slot_files(&shm);
    assert!(!live.is_empty());
    assert_eq!(held.remove().unwrap(), 0, "nothing it held was at its name");
    assert_eq!(slot_files(&shm), live, "the live ring's files are kept");
    let listed = shm_list(&shm).unwrap();
    assert!(listed.rings.iter().all(|r| r.live), "{listed:?}");
    save(&engine, 2).wait().unwrap();
    engine.close().unwrap();
}

/// Entries of the user's own directory under slot names that are not slot
/// files, or are slot files a crashed process could not have left whole (a
/// FIFO, a directory, a symlink, a 100-byte file, a control block whose
/// capacity the file does not have), make no tool hang, panic or fail:
/// `acp ls --shm`, `acp gc --shm`, `acp ls` and `acp persist` report the
/// real ring and its step, and gc removes only what holds no image.
#[test]
fn odd_entries_under_slot_names_are_passed_over_by_every_ring_tool() {
    let (_t, root, shm) = dirs();
    dead_ring(&root, &shm, "odd", &[1]);
    let dir = acp_core::staging::user_dir(&shm);
    let real = slot_files(&shm);
    let stem = &real[0][..21]; // "acp-{16 hex}-"
    let name = |rank: u32| dir.join(format!("{stem}r{rank:05}-s0"));
    let c = std::ffi::CString::new(name(1).into_os_string().into_encoded_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    std::fs::create_dir(name(2)).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", name(3)).unwrap();
    std::fs::write(name(4), [0u8; 100]).unwrap();
    // A copy of a real slot claiming a capacity past its file's end.
    let copied = name(5);
    std::fs::copy(dir.join(&real[0]), &copied).unwrap();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&copied)
        .unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &(1u64 << 40).to_le_bytes(), 32).unwrap();
    drop(f);

    let (tx, rx) = std::sync::mpsc::channel();
    let (root2, shm2) = (root.clone(), shm.clone());
    std::thread::Builder::new()
        .name("ring-tools".to_owned())
        .spawn(move || {
            let listed = shm_list(&shm2).unwrap();
            let steps: Vec<_> = listed
                .rings
                .iter()
                .filter(|r| !r.resident_steps.is_empty())
                .map(|r| (r.rank, r.resident_steps.clone()))
                .collect();
            assert_eq!(steps, [(0, vec![1])], "{listed:#?}");
            let ls = acp_core::ops::list(&root2, Some("odd"), &shm2).unwrap();
            assert_eq!(ls.steps[0].resident_ranks, [0]);
            let persisted = acp_core::ops::persist(&acp_core::ops::PersistOptions {
                root: root2.clone(),
                job: Some("odd".to_owned()),
                ranks: None,
                shm_dir: shm2.clone(),
                world_size: None,
                commit_timeout: Duration::from_secs(5),
            })
            .unwrap();
            assert_eq!(persisted.latest, Some(1));
            let gc = shm_gc(&shm2, &ShmGcOptions::default()).unwrap();
            tx.send(gc).unwrap();
        })
        .unwrap();
    let gc = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a ring tool hung on an odd entry");
    let removed: Vec<_> = gc
        .rings
        .iter()
        .filter(|r| r.removed)
        .map(|r| r.rank)
        .collect();
    assert_eq!(removed, [0, 4, 5], "{gc:#?}");
    for rank in [1, 2, 3] {
        assert!(
            std::fs::symlink_metadata(name(rank)).is_ok(),
            "entry of rank {rank} left alone"
        );
    }
}

/// Dropping an engine without `close` persists what it had queued and lets
/// go of its ring before the drop returns: an engine opened right after
/// on the same ring, in the same process, is not refused as busy (it was
/// while the old flush thread finished on its own: a torture case failed
/// on it, and so would a training script that drops its checkpointer and
/// makes a new one).
#[test]
fn an_engine_dropped_unclosed_persists_and_frees_its_ring_before_returning() {
    let (_t, root, shm) = dirs();
    let faults = Arc::new(FaultInjector::counting());
    let engine =
        Engine::open(config(&root, &shm, "dropped").with_faults(Arc::clone(&faults))).unwrap();
    // The flush's first storage operation stalls: it is still running
    // when the engine is dropped.
    faults.arm_stall(0, Duration::from_millis(300));
    drop(save(&engine, 1));
    drop(engine);
    let again = Engine::open(config(&root, &shm, "dropped")).unwrap();
    assert_eq!(again.steps().unwrap(), [1]);
    assert_eq!(again.resident_steps(), [1]);
    let ck = again.load(&acp_core::LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 1);
    again.close().unwrap();
}
