//! The persist policy: which saves reach storage and which stay RAM
//! snapshots; a snapshot that is superseded is never written; the newest
//! resident step is committed by `close` and by the next open whatever the
//! policy chose for it; the ring never drops the only copy of the newest
//! step to make room.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use acp_core::storage::faults::FaultInjector;
use acp_core::{
    Dtype, Engine, EngineConfig, HostTensor, LoadRequest, Outcome, Persist, PersistPolicy,
    SaveHandle, SaveOptions, Source, WhenFull,
};
use serde_json::json;
use torture_util::{check, dirs, payload, sigkill_self, SIZES};

fn config(root: &Path, shm: &Path, slots: usize, policy: PersistPolicy) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("persist-policy")
        .with_ring_slots(slots)
        .with_ring_bytes(slots as u64 * (4 << 20))
        .with_chunk_bytes(64 << 10)
        .with_mlock(false)
        // A ring that never frees a slot fails the test instead of hanging.
        .with_when_full(WhenFull::Wait(Duration::from_secs(60)))
        .with_persist_policy(policy)
}

/// Saves step `step` (the torture payload) with `persist`.
fn save(engine: &Engine, step: u64, persist: Persist) -> SaveHandle {
    let a = payload(step, 1, SIZES[0]);
    let b = payload(step, 2, SIZES[1]);
    let (sa, sb) = ([a.len() as u64], [b.len() as u64]);
    engine
        .save(
            step,
            &[
                HostTensor {
                    name: "a",
                    dtype: Dtype::U8,
                    shape: &sa,
                    data: &a,
                },
                HostTensor {
                    name: "b",
                    dtype: Dtype::U8,
                    shape: &sb,
                    data: &b,
                },
            ],
            &json!({ "step": step }),
            &SaveOptions {
                persist,
                ..SaveOptions::default()
            },
        )
        .unwrap()
}

/// The names under the checkpoint root that mention `step`'s directory
/// (committed or pending).
fn written(root: &Path, step: u64) -> Vec<String> {
    let tag = format!("{step:012}");
    let pending = format!("pending-{step}-");
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&tag) || n.contains(&pending))
        .collect()
}

#[test]
fn every_n_persists_the_multiples_and_keeps_the_rest_resident() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 3, PersistPolicy::Every(3))).unwrap();
    for step in 1..=7 {
        let rep = save(&engine, step, Persist::Policy).wait().unwrap();
        let want = if step % 3 == 0 {
            Outcome::Persisted
        } else {
            Outcome::Resident
        };
        assert_eq!(rep.outcome, want, "step {step}");
    }
    assert_eq!(engine.steps().unwrap(), [3, 6]);
    for step in [1, 2, 4, 5, 7] {
        assert!(written(&root, step).is_empty(), "step {step} was written");
    }
    assert_eq!(engine.snapshots()[0], 7);
    let stats = engine.persist_stats();
    assert_eq!(
        (stats.staged, stats.persisted, stats.resident),
        (7, 2, 5),
        "{stats:?}"
    );
    assert_eq!(
        (stats.newest_snapshot, stats.newest_persisted),
        (Some(7), Some(6))
    );
    // Closing commits the newest resident step, not the older snapshots.
    engine.close().unwrap();
    assert_eq!(engine.steps().unwrap(), [3, 6, 7]);
    assert!(written(&root, 5).is_empty());
}

#[test]
fn an_explicit_persist_overrides_the_policy() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 3, PersistPolicy::Every(1))).unwrap();
    let kept = save(&engine, 1, Persist::Never).wait().unwrap();
    assert_eq!(kept.outcome, Outcome::Resident);
    assert!(!kept.skipped);
    assert_eq!(engine.steps().unwrap(), Vec::<u64>::new());
    let forced = save(&engine, 2, Persist::Always).wait().unwrap();
    assert_eq!(forced.outcome, Outcome::Persisted);
    assert_eq!(engine.steps().unwrap(), [2]);
    assert!(written(&root, 1).is_empty());
    let by_policy = save(&engine, 3, Persist::Policy).wait().unwrap();
    assert_eq!(by_policy.outcome, Outcome::Persisted);
    assert_eq!(engine.steps().unwrap(), [2, 3]);
    engine.close().unwrap();
}

#[test]
fn interval_persists_the_first_save_then_waits_for_the_interval() {
    let (_t, root, shm) = dirs();
    let policy = PersistPolicy::Interval(Duration::from_secs(3600));
    let engine = Engine::open(config(&root, &shm, 3, policy)).unwrap();
    let outcomes: Vec<Outcome> = (1..=4)
        .map(|s| save(&engine, s, Persist::Policy).wait().unwrap().outcome)
        .collect();
    assert_eq!(
        outcomes,
        [
            Outcome::Persisted,
            Outcome::Resident,
            Outcome::Resident,
            Outcome::Resident
        ]
    );
    assert_eq!(engine.steps().unwrap(), [1]);
    assert!(written(&root, 2).is_empty() && written(&root, 3).is_empty());
}

#[test]
fn coalescing_persists_the_newest_and_never_writes_a_superseded_snapshot() {
    let (_t, root, shm) = dirs();
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(
        config(&root, &shm, 4, PersistPolicy::Coalesce).with_faults(Arc::clone(&faults)),
    )
    .unwrap();
    // Step 1's flush hangs on its first storage operation until healed:
    // steps 2 and 3 are sealed while it is in flight.
    faults.arm_stall(0, Duration::from_secs(600));
    let first = save(&engine, 1, Persist::Policy);
    let second = save(&engine, 2, Persist::Policy);
    let third = save(&engine, 3, Persist::Policy);
    // Step 2 waited behind step 1 and was superseded by step 3: its handle
    // is complete without any flush.
    let rep2 = second.wait().unwrap();
    assert_eq!(rep2.outcome, Outcome::Superseded);
    assert!(!first.is_done());
    assert_eq!(engine.persist_stats().queue_depth, 2);
    faults.heal();
    assert_eq!(first.wait().unwrap().outcome, Outcome::Persisted);
    assert_eq!(third.wait().unwrap().outcome, Outcome::Persisted);
    assert_eq!(engine.steps().unwrap(), [1, 3]);
    assert!(written(&root, 2).is_empty(), "{:?}", written(&root, 2));
    let stats = engine.persist_stats();
    assert_eq!(
        (stats.staged, stats.persisted, stats.superseded),
        (3, 2, 1),
        "{stats:?}"
    );
    assert_eq!(stats.persisted_lag_secs, Some(0.0));
    assert!(stats.bytes_written > 0);
    // With nothing in flight, the next save is persisted at once.
    assert_eq!(
        save(&engine, 4, Persist::Policy).wait().unwrap().outcome,
        Outcome::Persisted
    );
    check(&engine.load(&LoadRequest::default()).unwrap()).unwrap();
    engine.close().unwrap();
}

#[test]
fn snapshots_that_are_never_persisted_cycle_through_a_small_ring() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 2, PersistPolicy::Every(1))).unwrap();
    for step in 1..=10 {
        let rep = save(&engine, step, Persist::Never).wait().unwrap();
        assert_eq!(rep.outcome, Outcome::Resident, "step {step}");
    }
    // Each newer snapshot superseded the older one; the newest stays.
    assert_eq!(engine.snapshots(), [10]);
    assert_eq!(engine.steps().unwrap(), Vec::<u64>::new());
    engine.close().unwrap();
    assert_eq!(engine.steps().unwrap(), [10]);
    for step in 1..10 {
        assert!(written(&root, step).is_empty(), "step {step} was written");
    }
}

#[test]
fn a_full_ring_persists_the_only_copy_of_the_newest_step_instead_of_dropping_it() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 1, PersistPolicy::Every(1))).unwrap();
    save(&engine, 1, Persist::Never).wait().unwrap();
    // One slot, holding step 1's only copy: step 2 needs it, so step 1 is
    // persisted first.
    let rep = save(&engine, 2, Persist::Never).wait().unwrap();
    assert_eq!(rep.outcome, Outcome::Resident);
    assert_eq!(engine.steps().unwrap(), [1]);
    assert_eq!(engine.snapshots(), [2]);
}

/// The child side of the SIGKILL test: saves step 100 persisted and
/// steps 101 and 102 as RAM snapshots, then kills itself. Does nothing
/// unless `ACP_PERSIST_CHILD` is set.
#[test]
fn child() {
    let (Ok(root), Ok(shm)) = (
        std::env::var("ACP_PERSIST_CHILD"),
        std::env::var("ACP_PERSIST_SHM"),
    ) else {
        return;
    };
    let cfg = config(
        Path::new(&root),
        Path::new(&shm),
        3,
        PersistPolicy::Every(100),
    );
    let engine = Engine::open(cfg).unwrap();
    for step in [100, 101, 102] {
        save(&engine, step, Persist::Policy).wait().unwrap();
    }
    assert_eq!(engine.steps().unwrap(), [100]);
    sigkill_self();
}

#[test]
fn a_process_killed_with_ram_only_snapshots_has_the_newest_committed_on_reopen() {
    if std::env::var("ACP_PERSIST_CHILD").is_ok() {
        return;
    }
    let (_t, root, shm) = dirs();
    let status = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("ACP_PERSIST_CHILD", &root)
        .env("ACP_PERSIST_SHM", &shm)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    let engine = Engine::open(config(&root, &shm, 3, PersistPolicy::Every(100))).unwrap();
    assert_eq!(engine.open_report().persisting_steps, [102]);
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 102);
    check(&ck).unwrap();
    drop(ck);
    assert!(written(&root, 101).is_empty());
    engine.close().unwrap();
}

/// The slot file under `shm` holding step `step`, and where its image
/// starts and how long it is (from the control block's little-endian
/// fields: step at 16, image length at 24, image offset at 104).
fn slot_of(shm: &Path, step: u64) -> (std::path::PathBuf, u64, u64) {
    torture_util::files_under(shm)
        .into_iter()
        .find_map(|p| {
            let b = std::fs::read(&p).ok()?;
            let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
            (b.len() >= 112 && u64_at(16) == step).then(|| (p.clone(), u64_at(104), u64_at(24)))
        })
        .unwrap_or_else(|| panic!("no slot file holds step {step}"))
}

/// Changes the byte at `at` of the file at `path` (a slot's image, in RAM).
fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
}

#[test]
fn load_without_a_step_serves_a_newer_ram_snapshot_over_an_older_committed_step() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 3, PersistPolicy::Every(1))).unwrap();
    save(&engine, 1, Persist::Always).wait().unwrap();
    let rep = save(&engine, 2, Persist::Never).wait().unwrap();
    assert_eq!(rep.outcome, Outcome::Resident);
    // The background hash of step 2 is done once the engine is idle.
    engine.wait_idle(None).unwrap();
    assert_eq!(engine.steps().unwrap(), [1]);
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 2);
    assert_eq!(ck.report().source, Source::Ram);
    assert!(ck.report().verified);
    check(&ck).unwrap();
    drop(ck);
    // And by its step, though it is not committed.
    let ck = engine
        .load(&LoadRequest {
            step: Some(2),
            ..LoadRequest::default()
        })
        .unwrap();
    assert_eq!(ck.step(), 2);
    check(&ck).unwrap();
    drop(ck);
    // Nothing was written for it.
    assert!(written(&root, 2).is_empty());
    // From storage only, the committed step.
    let ck = engine
        .load(&LoadRequest {
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap();
    assert_eq!(ck.step(), 1);
    drop(ck);
    engine.close().unwrap();
}

#[test]
fn a_ram_snapshot_changed_in_ram_is_rejected_naming_the_slot_and_tensor() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 3, PersistPolicy::Every(1))).unwrap();
    save(&engine, 1, Persist::Always).wait().unwrap();
    save(&engine, 2, Persist::Never).wait().unwrap();
    engine.wait_idle(None).unwrap();
    // One byte of step 2's image changes in RAM after it was hashed: the
    // last byte, in the last tensor's data.
    let (path, offset, len) = slot_of(&shm, 2);
    flip_byte(&path, offset + len - 1);
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    // Without a step: the next source, the committed step 1, saying why.
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 1);
    check(&ck).unwrap();
    let why = ck.report().rejected.clone().unwrap();
    assert!(why.contains(&name) && why.contains("step 2"), "{why}");
    drop(ck);
    // By its step: an error naming the slot file and a tensor.
    let e = engine
        .load(&LoadRequest {
            step: Some(2),
            ..LoadRequest::default()
        })
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains(&name), "{e}");
    assert!(e.contains("`a`") || e.contains("`b`"), "{e}");
    // `close` persists the newest resident step, but not under digests
    // its bytes no longer give: step 2 is not committed.
    let e = engine.close().expect_err("close refuses the changed step");
    assert!(e.to_string().contains("changed in RAM"), "{e}");
    assert_eq!(engine.steps().unwrap(), [1]);
}

#[test]
fn a_snapshot_changed_in_ram_after_its_hash_is_not_committed_by_its_persist() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 3, PersistPolicy::Every(1))).unwrap();
    save(&engine, 1, Persist::Always).wait().unwrap();
    save(&engine, 2, Persist::Never).wait().unwrap();
    // Hashed in the background: its persist takes those digests.
    engine.wait_idle(None).unwrap();
    let (path, offset, len) = slot_of(&shm, 2);
    flip_byte(&path, offset + len / 2);
    let handle = engine.persist_newest().unwrap().expect("step 2 to persist");
    let e = handle
        .wait()
        .expect_err("the persist of a changed image fails");
    let name = path.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        e.to_string().contains(&name) && e.to_string().contains("changed in RAM"),
        "{e}"
    );
    // Nothing of step 2 was committed; step 1 is intact.
    assert_eq!(engine.steps().unwrap(), [1]);
    let ck = engine
        .load(&LoadRequest {
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap();
    assert_eq!(ck.step(), 1);
    check(&ck).unwrap();
    drop(ck);
    let _ = engine.close();
}

/// The child side of the restart test: step 100's persist hangs in storage
/// (a hook that never returns), steps 101 and 102 are RAM snapshots whose
/// background hash waits behind it; then the process kills itself, leaving
/// sealed images without digests. Does nothing unless
/// `ACP_UNHASHED_CHILD` is set.
#[test]
fn unhashed_child() {
    let (Ok(root), Ok(shm)) = (
        std::env::var("ACP_UNHASHED_CHILD"),
        std::env::var("ACP_UNHASHED_SHM"),
    ) else {
        return;
    };
    let faults = Arc::new(FaultInjector::counting());
    faults.set_hook(|_, _, path| {
        // The storage names a pending step `.pending-{step:012}-r…`.
        if path.to_string_lossy().contains(".pending-000000000100-") {
            std::thread::park();
        }
    });
    let cfg = config(
        Path::new(&root),
        Path::new(&shm),
        3,
        PersistPolicy::Every(100),
    )
    .with_faults(faults);
    let engine = Engine::open(cfg).unwrap();
    let first = save(&engine, 100, Persist::Policy);
    for step in [101, 102] {
        save(&engine, step, Persist::Policy).wait().unwrap();
    }
    assert!(!first.is_done());
    sigkill_self();
}

#[test]
fn a_restarted_engine_serves_an_unhashed_ram_snapshot_from_ram_while_it_is_persisted() {
    if std::env::var("ACP_UNHASHED_CHILD").is_ok() {
        return;
    }
    let (_t, root, shm) = dirs();
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "unhashed_child",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env("ACP_UNHASHED_CHILD", &root)
        .env("ACP_UNHASHED_SHM", &shm)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status:?}");
    // Every persist of the new engine waits at a gate this test opens.
    let gate = Arc::new((std::sync::Mutex::new(false), std::sync::Condvar::new()));
    let faults = Arc::new(FaultInjector::counting());
    {
        let gate = Arc::clone(&gate);
        faults.set_hook(move |_, _, path| {
            if path.to_string_lossy().contains("pending-") {
                let (open, cv) = &*gate;
                let mut o = open.lock().unwrap();
                while !*o {
                    o = cv.wait(o).unwrap();
                }
            }
        });
    }
    let cfg = config(&root, &shm, 3, PersistPolicy::Every(100))
        .with_faults(faults)
        // A load that waited for the persist would fail here, not hang.
        .with_stall_timeout(Duration::from_secs(5));
    let engine = Engine::open(cfg).unwrap();
    assert!(
        engine.open_report().persisting_steps.contains(&102),
        "{:?}",
        engine.open_report()
    );
    // Served from RAM, verified, while its persist waits at the gate.
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 102);
    assert_eq!(ck.report().source, Source::Ram);
    assert!(ck.report().verified);
    check(&ck).unwrap();
    drop(ck);
    assert_eq!(engine.steps().unwrap(), Vec::<u64>::new());
    {
        let (open, cv) = &*gate;
        *open.lock().unwrap() = true;
        cv.notify_all();
    }
    engine.close().unwrap();
    assert!(engine.steps().unwrap().contains(&102));
}
