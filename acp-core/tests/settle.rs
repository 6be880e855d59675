//! The commit's housekeeping runs after the save is reported: retention
//! takes a removed step out of the listing before `wait()` returns (one
//! rename, made durable by the `latest` hint's fsync of the root), and the
//! root's `settle` deletes the step's files afterwards, in the flush
//! thread, once no save is queued. A failed hint leaves the save committed.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use acp_core::storage::faults::FaultInjector;
use acp_core::{Dtype, Engine, EngineConfig, HostTensor, LoadRequest, SaveOptions};
use serde_json::json;

fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("root");
    let shm = t.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    (t, root, shm)
}

fn config(root: &Path, shm: &Path, faults: &Arc<FaultInjector>) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("settle")
        .with_ring_bytes(8 << 20)
        .with_chunk_bytes(64 << 10)
        .with_mlock(false)
        .with_keep_last(1)
        .with_faults(Arc::clone(faults))
}

fn save(engine: &Engine, step: u64) -> acp_core::Result<acp_core::SaveReport> {
    save_with(engine, step, 0, false)
}

fn payload(step: u64, salt: u8) -> Vec<u8> {
    (0..300_000u32)
        .map(|i| (i as u8).wrapping_mul(step as u8) ^ salt)
        .collect()
}

fn save_with(
    engine: &Engine,
    step: u64,
    salt: u8,
    overwrite: bool,
) -> acp_core::Result<acp_core::SaveReport> {
    let data = payload(step, salt);
    engine
        .save(
            step,
            &[HostTensor {
                name: "w",
                dtype: Dtype::U8,
                shape: &[data.len() as u64],
                data: &data,
            }],
            &json!({"step": step}),
            &SaveOptions {
                overwrite,
                ..SaveOptions::default()
            },
        )?
        .wait()
}

/// An engine on `root` that committed step 1 and is idle, and its fault
/// injector (counting the storage operations).
fn with_step_1(root: &Path, shm: &Path) -> (Arc<FaultInjector>, Engine) {
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(config(root, shm, &faults)).unwrap();
    save(&engine, 1).unwrap();
    engine.wait_idle(None).unwrap();
    (faults, engine)
}

/// The names directly under `root` that start with `prefix`.
fn named(root: &Path, prefix: &str) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(root)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(prefix))
        .collect();
    names.sort();
    names
}

#[test]
fn retention_unlists_before_wait_returns_and_deletes_after() {
    let (_t, root, shm) = dirs();
    let (faults, engine) = with_step_1(&root, &shm);
    let before = faults.log().len();
    save(&engine, 2).unwrap();
    // Reported committed: step 1 is already out of the listing.
    assert_eq!(engine.steps().unwrap(), vec![2]);
    assert_eq!(named(&root, "step-").len(), 1);
    assert_eq!(std::fs::read_to_string(root.join("latest")).unwrap(), "2\n");
    engine.wait_idle(None).unwrap();
    assert_eq!(named(&root, ".trash-"), Vec::<String>::new());
    assert_eq!(named(&root, ".latest-"), Vec::<String>::new());

    // The order on storage, all before `wait()` returned: the
    // retirement's rename, then the hint, whose fsync of the root makes
    // the retirement durable; the files go after, outside the probe.
    let log = faults.log()[before..].to_vec();
    let pos = |what: &dyn Fn(&str) -> bool| log.iter().position(|l| what(l));
    let root_s = root.display().to_string();
    let retire = pos(&|l| l.starts_with("rename") && l.ends_with("step-000000000001")).unwrap();
    let hint = pos(&|l| l.starts_with("rename") && l.ends_with("/latest")).unwrap();
    assert!(retire < hint, "{log:#?}");
    assert_eq!(
        log.last(),
        Some(&format!("fsync directory {root_s}")),
        "{log:#?}"
    );
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 2);
    drop(ck);
    engine.close().unwrap();
}

#[test]
fn a_failed_hint_keeps_the_save_and_the_retired_step_still_goes() {
    let (_t, root, shm) = dirs();
    let (faults, engine) = with_step_1(&root, &shm);
    // Find the hint's write in a save like the next one.
    let before = faults.log().len();
    save(&engine, 2).unwrap();
    engine.wait_idle(None).unwrap();
    let log = faults.log()[before..].to_vec();
    let hint = log
        .iter()
        .position(|l| l.starts_with("write ") && l.contains("/.latest-"))
        .unwrap();
    faults.arm(hint as u64, libc::EIO, false);
    let report = save(&engine, 3).unwrap();
    assert_eq!(report.step, 3);
    engine.wait_idle(None).unwrap();
    assert_eq!(engine.steps().unwrap(), vec![3]);
    assert_eq!(std::fs::read_to_string(root.join("latest")).unwrap(), "2\n");
    assert_eq!(named(&root, ".trash-"), Vec::<String>::new());
    assert_eq!(named(&root, ".latest-"), Vec::<String>::new());
    faults.heal();
    save(&engine, 4).unwrap();
    assert_eq!(std::fs::read_to_string(root.join("latest")).unwrap(), "4\n");
    engine.close().unwrap();
}

#[test]
fn engine_retain_deletes_before_it_returns() {
    let (_t, root, shm) = dirs();
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(config(&root, &shm, &faults).with_keep_last(3)).unwrap();
    for step in 1..=3 {
        save(&engine, step).unwrap();
    }
    engine.wait_idle(None).unwrap();
    assert_eq!(engine.retain(1, None).unwrap(), vec![1, 2]);
    assert_eq!(engine.steps().unwrap(), vec![3]);
    assert_eq!(named(&root, ".trash-"), Vec::<String>::new());
    engine.close().unwrap();
}

#[test]
fn an_overwritten_step_is_replaced_at_once_and_its_old_files_go_after() {
    let (_t, root, shm) = dirs();
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(config(&root, &shm, &faults)).unwrap();
    save(&engine, 1).unwrap();
    save_with(&engine, 1, 0x5a, true).unwrap();
    assert_eq!(engine.steps().unwrap(), vec![1]);
    let request = LoadRequest {
        storage_only: true,
        ..LoadRequest::default()
    };
    let ck = engine.load(&request).unwrap();
    assert_eq!(ck.tensor("w").unwrap().data, payload(1, 0x5a).as_slice());
    drop(ck);
    engine.wait_idle(None).unwrap();
    assert_eq!(named(&root, ".trash-"), Vec::<String>::new());
    assert_eq!(named(&root, ".pending-"), Vec::<String>::new());
    engine.close().unwrap();
}
