//! Crashes and failures: a SIGKILLed saver's resident slot is restored bit
//! for bit; a half-staged slot is refused; an I/O error at any operation of
//! a save leaves the previous step loadable; tampered files are detected.
//!
//! Child processes re-run this test binary with `ACP_CHILD` set, selecting
//! the `child` test below as their whole program.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use acp_core::storage::faults::FaultInjector;
use acp_core::{Dtype, Engine, EngineConfig, Error, HostTensor, LoadRequest, SaveOptions, Source};
use serde_json::json;

fn config(root: &Path, shm: &Path) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("crash")
        .with_ring_bytes(32 << 20)
        .with_chunk_bytes(64 << 10)
}

/// The tensor bytes of step `step`: derived from the step, so any step's
/// content can be checked without keeping it.
fn payload(step: u64) -> Vec<u8> {
    (0..(1u64 << 20) + 123)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8 ^ step as u8)
        .collect()
}

fn save(engine: &Engine, step: u64) -> acp_core::SaveHandle {
    let data = payload(step);
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
            &SaveOptions::default(),
        )
        .unwrap()
}

fn check_step(ck: &acp_core::Checkpoint) {
    assert_eq!(
        ck.tensor("w").unwrap().data,
        payload(ck.step()).as_slice(),
        "step {}",
        ck.step()
    );
    assert_eq!(ck.values()["step"], json!(ck.step()));
}

fn kill_self() -> ! {
    // A real SIGKILL, as the OOM killer sends: no destructor, no flush.
    let pid = std::process::id().to_string();
    let _ = Command::new("kill").args(["-9", &pid]).status();
    std::thread::sleep(Duration::from_secs(60));
    unreachable!("SIGKILL did not arrive");
}

/// The child side. Does nothing unless `ACP_CHILD` is set.
#[test]
fn child() {
    let Ok(mode) = std::env::var("ACP_CHILD") else {
        return;
    };
    let root = PathBuf::from(std::env::var("ACP_ROOT").unwrap());
    let shm = PathBuf::from(std::env::var("ACP_SHM").unwrap());
    match mode.as_str() {
        // Commit step 1, then stage step 2 while storage is dead, and die.
        "resident" => {
            let faults = Arc::new(FaultInjector::counting());
            let engine =
                Engine::open(config(&root, &shm).with_faults(Arc::clone(&faults))).unwrap();
            save(&engine, 1).wait().unwrap();
            faults.arm(0, libc::EIO, true);
            assert!(save(&engine, 2).wait().is_err());
            kill_self();
        }
        // Commit step 1, then die half-way through staging step 2.
        "half" => {
            let engine = Engine::open(config(&root, &shm)).unwrap();
            save(&engine, 1).wait().unwrap();
            let data = payload(2);
            let spec = [acp_core::TensorSpec {
                name: "w".into(),
                dtype: Dtype::U8,
                shape: vec![data.len() as u64],
            }];
            let mut st = engine
                .begin_save(2, &spec, &json!({"step": 2}), &SaveOptions::default())
                .unwrap()
                .unwrap();
            let half = data.len() / 2;
            st.tensor_mut(0)[..half].copy_from_slice(&data[..half]);
            kill_self();
        }
        // Save steps in a loop until killed from outside.
        "loop" => {
            let engine = Engine::open(config(&root, &shm)).unwrap();
            let start = engine.latest().unwrap().unwrap_or(0) + 1;
            for step in start.. {
                let h = save(&engine, step);
                if step % 2 == 0 {
                    h.wait().unwrap();
                }
            }
        }
        other => panic!("unknown child mode {other}"),
    }
}

fn spawn_child(mode: &str, root: &Path, shm: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("ACP_CHILD", mode)
        .env("ACP_ROOT", root)
        .env("ACP_SHM", shm)
        .spawn()
        .unwrap()
}

fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ckpt");
    let shm = t.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    (t, root, shm)
}

#[test]
fn a_sigkilled_savers_resident_slot_is_persisted_and_restored_bit_exact() {
    let (_t, root, shm) = dirs();
    let status = spawn_child("resident", &root, &shm).wait().unwrap();
    assert!(!status.success(), "the child should have been killed");
    let engine = Engine::open(config(&root, &shm)).unwrap();
    assert_eq!(engine.open_report().persisting_steps, vec![2]);
    // `load` serves it from RAM (hashed at open), while it is committed
    // in the background.
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 2);
    assert_eq!(ck.report().source, Source::Ram);
    check_step(&ck);
    engine.wait_idle(None).unwrap();
    assert_eq!(engine.steps().unwrap(), vec![1, 2]);
    // And the persisted copy on storage is intact.
    let disk = engine
        .load(&LoadRequest {
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap();
    check_step(&disk);
}

#[test]
fn a_half_staged_slot_is_never_taken_as_a_checkpoint() {
    let (_t, root, shm) = dirs();
    let status = spawn_child("half", &root, &shm).wait().unwrap();
    assert!(!status.success());
    let engine = Engine::open(config(&root, &shm)).unwrap();
    assert_eq!(engine.open_report().discarded_half_staged, 1);
    assert!(engine.open_report().persisting_steps.is_empty());
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 1);
    check_step(&ck);
    assert_eq!(engine.steps().unwrap(), vec![1]);
}

#[test]
fn sigkill_at_random_moments_always_leaves_a_committed_intact_step() {
    let (_t, root, shm) = dirs();
    let trials: u64 = std::env::var("ACP_CRASH_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8);
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for trial in 0..trials {
        let mut child = spawn_child("loop", &root, &shm);
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_millis(150 + seed % 400));
        child.kill().unwrap();
        child.wait().unwrap();
        let engine = Engine::open(config(&root, &shm)).unwrap();
        match engine.load(&LoadRequest::default()) {
            Ok(ck) => check_step(&ck),
            Err(Error::NotFound { .. }) if trial == 0 => {}
            Err(e) => panic!("trial {trial}: {e}"),
        }
        // Storage alone holds an intact copy too.
        if let Ok(ck) = engine.load(&LoadRequest {
            storage_only: true,
            ..LoadRequest::default()
        }) {
            check_step(&ck);
        }
        engine.close().unwrap();
    }
}

#[test]
fn an_io_error_at_every_operation_of_a_save_leaves_the_previous_step() {
    let (_t, root, shm) = dirs();
    // Count the operations of one whole save.
    let per_save = {
        let (_t2, root2, shm2) = dirs();
        let faults = Arc::new(FaultInjector::counting());
        let engine = Engine::open(config(&root2, &shm2).with_faults(Arc::clone(&faults))).unwrap();
        save(&engine, 1).wait().unwrap();
        let before = faults.ops();
        save(&engine, 2).wait().unwrap();
        faults.ops() - before
    };
    assert!(per_save >= 8, "a save has {per_save} storage operations");
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(config(&root, &shm).with_faults(Arc::clone(&faults))).unwrap();
    save(&engine, 1).wait().unwrap();
    let mut step = 1;
    for n in 0..per_save {
        for errno in [libc::EIO, libc::ENOSPC] {
            step += 1;
            faults.arm(n, errno, false);
            let result = save(&engine, step).wait();
            faults.heal();
            let committed = engine.steps().unwrap();
            match result {
                Err(e) => {
                    assert!(
                        !committed.contains(&step),
                        "op {n}: failed step {step} is committed"
                    );
                    if errno == libc::ENOSPC {
                        assert!(matches!(e, Error::NoSpace { .. }), "op {n}: {e}");
                    }
                }
                Ok(_) => assert!(
                    committed.contains(&step),
                    "op {n}: step {step} reported but not committed"
                ),
            }
            // Whatever happened, the newest committed step loads intact.
            let ck = engine
                .load(&LoadRequest {
                    storage_only: true,
                    ..LoadRequest::default()
                })
                .unwrap();
            assert_eq!(Some(ck.step()), committed.last().copied());
            check_step(&ck);
        }
    }
    // After the cause is gone, saves work again.
    step += 1;
    save(&engine, step).wait().unwrap();
    assert_eq!(engine.latest().unwrap(), Some(step));
}

#[test]
fn tampered_files_are_detected_naming_file_and_tensor() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm)).unwrap();
    save(&engine, 1).wait().unwrap();
    save(&engine, 2).wait().unwrap();
    let file = root.join("step-000000000002/rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 1000;
    bytes[at] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let err = engine
        .load(&LoadRequest {
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Corrupt { .. }), "{msg}");
    assert!(
        msg.contains("rank-00000.safetensors") && msg.contains("`w`"),
        "{msg}"
    );
    // With fallback, the newest intact step is returned.
    let ck = engine
        .load(&LoadRequest {
            storage_only: true,
            fallback: true,
            ..LoadRequest::default()
        })
        .unwrap();
    assert_eq!(ck.step(), 1);
    check_step(&ck);
    // A truncated file is caught too.
    bytes.truncate(bytes.len() / 2);
    std::fs::write(&file, &bytes).unwrap();
    let err = engine
        .load(&LoadRequest {
            step: Some(2),
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap_err();
    assert!(matches!(err, Error::Corrupt { .. }), "{err}");
}

#[test]
fn an_index_naming_a_path_outside_the_step_is_refused() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(config(&root, &shm)).unwrap();
    save(&engine, 1).wait().unwrap();
    let index = root.join("step-000000000001/model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    for evil in ["../../../etc/passwd", "/etc/passwd", "a/b", ".hidden"] {
        std::fs::write(&index, text.replace("rank-00000.safetensors", evil)).unwrap();
        let err = engine
            .load(&LoadRequest {
                storage_only: true,
                ..LoadRequest::default()
            })
            .unwrap_err();
        assert!(
            matches!(err, Error::Corrupt { .. } | Error::NotFound { .. }),
            "{evil}: {err}"
        );
    }
    // A step directory that is a symlink is not a committed step.
    std::fs::write(&index, &text).unwrap();
    let outside = root.parent().unwrap().join("outside");
    std::fs::rename(root.join("step-000000000001"), &outside).unwrap();
    std::os::unix::fs::symlink(&outside, root.join("step-000000000001")).unwrap();
    assert!(engine.steps().unwrap().is_empty());
}
