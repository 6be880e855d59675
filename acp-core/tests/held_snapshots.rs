//! Held snapshots ([`Persist::Hold`]): a save whose persist its caller
//! decides later ([`Engine::decide`]), as the ranks of a job do when they
//! agree on which snapshot to persist. A held snapshot survives newer
//! seals (an unheld one is released by them), is persisted or let go when
//! decided, is never persisted by a full ring on its own, and does not
//! outlive `close`.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::path::Path;
use std::time::Duration;

use acp_core::{
    Dtype, Engine, EngineConfig, Error, HostTensor, LoadRequest, Outcome, Persist, PersistPolicy,
    SaveHandle, SaveOptions, WhenFull,
};
use serde_json::json;
use torture_util::{check, dirs, payload, SIZES};

fn config(root: &Path, shm: &Path, slots: usize) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("held")
        .with_ring_slots(slots)
        .with_ring_bytes(slots as u64 * (4 << 20))
        .with_chunk_bytes(64 << 10)
        .with_mlock(false)
        // A ring that never frees a slot fails the test instead of hanging.
        .with_when_full(WhenFull::Wait(Duration::from_secs(60)))
        .with_persist_policy(PersistPolicy::Every(1))
}

/// Saves step `step` (the torture payload) with `persist`.
fn save(engine: &Engine, step: u64, persist: Persist) -> Option<SaveHandle> {
    let a = payload(step, 1, SIZES[0]);
    let b = payload(step, 2, SIZES[1]);
    let (sa, sb) = ([a.len() as u64], [b.len() as u64]);
    let handle = engine
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
        .unwrap();
    let skipped = handle.is_done() && handle.wait().is_ok_and(|r| r.skipped);
    (!skipped).then_some(handle)
}

fn held(engine: &Engine, step: u64) -> SaveHandle {
    save(engine, step, Persist::Hold).unwrap()
}

/// The names under the checkpoint root that mention `step`'s directory
/// (committed or pending).
fn written(root: &Path, step: u64) -> Vec<String> {
    let tag = format!("{step:012}");
    std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(&tag))
        .collect()
}

#[test]
fn a_held_snapshot_survives_newer_seals_and_is_persisted_when_decided() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 4)).unwrap();
    let first = held(&engine, 1);
    let second = held(&engine, 2);
    let _third = held(&engine, 3);
    // Nothing is decided: no handle is complete, nothing is queued.
    assert!(!first.is_done() && !second.is_done());
    assert_eq!(engine.held(), [1, 2, 3]);
    assert_eq!(engine.snapshots(), [3, 2, 1]);
    assert_eq!(engine.persist_stats().queue_depth, 0);
    assert!(engine.decide(1, true).unwrap());
    let rep = first.wait().unwrap();
    assert_eq!(rep.outcome, Outcome::Persisted);
    assert_eq!(engine.steps().unwrap(), [1]);
    // Decided once: a second decision finds nothing held.
    assert!(!engine.decide(1, true).unwrap());
    assert!(engine.decide(2, false).unwrap());
    assert_eq!(second.wait().unwrap().outcome, Outcome::Superseded);
    assert!(!engine.snapshots().contains(&2));
    assert!(written(&root, 2).is_empty());
    let got = engine
        .load(&LoadRequest {
            step: Some(1),
            ..LoadRequest::default()
        })
        .unwrap();
    check(&got).unwrap();
    engine.close().unwrap();
}

#[test]
fn an_unheld_snapshot_is_released_by_a_newer_seal() {
    // The case holds exist for: a rank that staged step 2 before learning
    // that step 1 is the one to persist has lost step 1 from its ring.
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 4)).unwrap();
    save(&engine, 1, Persist::Never).unwrap();
    save(&engine, 2, Persist::Never).unwrap();
    assert_eq!(engine.snapshots(), [2]);
    assert!(matches!(
        engine.persist_resident(1),
        Err(Error::NotFound { .. })
    ));
    // Held, it stays (and `persist_resident` persists it as its own save).
    let third = held(&engine, 3);
    save(&engine, 4, Persist::Never).unwrap();
    assert_eq!(engine.snapshots(), [4, 3]);
    engine.persist_resident(3).unwrap().wait().unwrap();
    assert_eq!(third.wait().unwrap().outcome, Outcome::Persisted);
    assert!(engine.held().is_empty());
    engine.close().unwrap();
}

#[test]
fn a_held_snapshot_let_go_is_kept_while_it_is_the_newest() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 3)).unwrap();
    let first = held(&engine, 1);
    assert!(engine.decide(1, false).unwrap());
    assert_eq!(first.wait().unwrap().outcome, Outcome::Resident);
    assert_eq!(engine.snapshots(), [1]);
    // A newer seal releases it as any kept snapshot.
    let second = held(&engine, 2);
    assert_eq!(engine.snapshots(), [2]);
    assert!(engine.decide(2, false).unwrap());
    assert_eq!(second.wait().unwrap().outcome, Outcome::Resident);
    let stats = engine.persist_stats();
    assert_eq!((stats.staged, stats.resident, stats.persisted), (2, 2, 0));
    // Close commits the newest resident step, never the one let go.
    engine.close().unwrap();
    assert_eq!(engine.steps().unwrap(), [2]);
    assert!(written(&root, 1).is_empty());
}

#[test]
fn a_full_ring_of_holds_never_persists_one_by_itself() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 2).with_when_full(WhenFull::Skip)).unwrap();
    let first = held(&engine, 1);
    let _second = held(&engine, 2);
    // Both slots held: the save is skipped (a ring of unheld snapshots
    // would persist the newest to make room); nothing is written.
    assert!(save(&engine, 3, Persist::Never).is_none());
    assert!(engine.steps().unwrap().is_empty());
    assert!(written(&root, 2).is_empty());
    assert_eq!(engine.held(), [1, 2]);
    // Deciding frees the slot, once nothing pins it: the background hash
    // of the snapshots may still be reading it (a save with `Skip` does
    // not wait for a slot being freed).
    assert!(engine.decide(1, false).unwrap());
    assert_eq!(first.wait().unwrap().outcome, Outcome::Superseded);
    engine.wait_idle(None).unwrap();
    assert!(save(&engine, 4, Persist::Never).is_some());
    engine.close().unwrap();
}

#[test]
fn the_dying_checkpoint_persists_a_held_newest_step_as_its_own_save() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 3)).unwrap();
    let first = held(&engine, 1);
    let dying = engine.persist_newest().unwrap().unwrap();
    dying.wait().unwrap();
    assert_eq!(first.wait().unwrap().outcome, Outcome::Persisted);
    assert!(!engine.decide(1, true).unwrap());
    assert_eq!(engine.steps().unwrap(), [1]);
    engine.close().unwrap();
}

#[test]
fn undecided_holds_do_not_outlive_close() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 4).with_release_on_close(true)).unwrap();
    let first = held(&engine, 1);
    let second = held(&engine, 2);
    let third = held(&engine, 3);
    engine.close().unwrap();
    // The newest is persisted as its own save; the others are let go,
    // never written, and the ring is removed: nothing is left resident.
    assert_eq!(third.wait().unwrap().outcome, Outcome::Persisted);
    assert_eq!(first.wait().unwrap().outcome, Outcome::Superseded);
    assert_eq!(second.wait().unwrap().outcome, Outcome::Superseded);
    assert_eq!(engine.steps().unwrap(), [3]);
    assert!(written(&root, 1).is_empty() && written(&root, 2).is_empty());
    assert_eq!(engine.kept_on_close(), Some(vec![]));
    assert!(engine.held().is_empty());
    assert!(!engine.decide(2, true).unwrap());
}

#[test]
fn saving_a_held_step_again_lets_the_old_image_go() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 3)).unwrap();
    let old = held(&engine, 1);
    let new = held(&engine, 1);
    assert!(old.is_done());
    assert_eq!(engine.held(), [1]);
    assert!(engine.decide(1, true).unwrap());
    assert_eq!(new.wait().unwrap().outcome, Outcome::Persisted);
    check(&engine.load(&LoadRequest::default()).unwrap()).unwrap();
    engine.close().unwrap();
}

/// The digests a replica exchange sends after a held snapshot's quick
/// sums wait for its decision: persisted, the snapshot's digests (the
/// flush's hash); let go, none (a RAM snapshot is not hashed with blake3
/// for its replicas).
#[test]
fn the_digests_sent_for_a_held_snapshot_wait_for_its_decision() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm, 4)).unwrap();
    let _one = held(&engine, 1);
    let _two = held(&engine, 2);
    for (step, persist) in [(1, true), (2, false)] {
        let pin = engine.pin_resident(step).unwrap();
        let sums = engine.resident_sums(&pin);
        let got = std::thread::scope(|s| {
            let sent = s.spawn(|| {
                engine
                    .digests_to_send(&pin, Duration::from_secs(60))
                    .unwrap()
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(!sent.is_finished(), "step {step}: sent before its decision");
            assert!(engine.decide(step, persist).unwrap());
            sent.join().unwrap()
        });
        match got {
            Some((digests, got_sums)) => {
                assert!(persist, "step {step}: digests of a snapshot let go");
                assert_eq!(got_sums, sums);
                assert_eq!(digests.len(), sums.len());
            }
            None => assert!(!persist, "step {step}: no digests for a persisted step"),
        }
    }
}
