//! Torture 1: SIGKILL a process that saves in a loop, at a random moment,
//! then open and load: the result is always a committed step, bit for bit,
//! never torn, and never older than a step seen committed before.
//!
//! Three ways to pick the moment, in turn:
//! - `op`: the child kills itself at its k-th storage operation (create
//!   directory, chunk write, fsync, index write, directory fsync, rename,
//!   the `latest` hint, retention), chosen at random over its first saves,
//!   through the fault injector's hook, so every step of the commit
//!   protocol is hit, persist-on-open flushes included;
//! - `time`: the parent kills the child after a random delay, while it
//!   saves without waiting (staging, copying and flushing overlap);
//! - `stage`: the child kills itself half-way through staging a step.
//!
//! Children re-run this test binary with `ACP_TORTURE_CHILD` set.
//! CI: 30 trials; `ACP_TORTURE_FULL=1`: 500.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use acp_core::storage::faults::FaultInjector;
use acp_core::{Dtype, Engine, EngineConfig, Error, LoadRequest, SaveOptions, TensorSpec};
use serde_json::json;
use torture_util::{check, payload, report, save, sigkill_self, trials, Rng, SIZES};

fn config(root: &Path, shm: &Path) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("torture-kill")
        .with_ring_bytes(8 << 20)
        .with_chunk_bytes(64 << 10)
        .with_keep_last(3)
        .with_mlock(false)
}

/// The child side. Does nothing unless `ACP_TORTURE_CHILD` is set.
#[test]
fn child() {
    let Ok(mode) = std::env::var("ACP_TORTURE_CHILD") else {
        return;
    };
    let root = PathBuf::from(std::env::var("ACP_ROOT").unwrap());
    let shm = PathBuf::from(std::env::var("ACP_SHM").unwrap());
    let arg: u64 = std::env::var("ACP_ARG").unwrap().parse().unwrap();
    let mut cfg = config(&root, &shm);
    if mode == "op" || mode == "after-commit" {
        let faults = Arc::new(FaultInjector::counting());
        let log = PathBuf::from(std::env::var("ACP_KILL_LOG").unwrap());
        let after_commit = mode == "after-commit";
        faults.set_hook(move |n, op, path| {
            // The root's fsync right after the rename that commits a step.
            let committed = op == "fsync directory" && path.ends_with("ckpt");
            if n == arg || (after_commit && committed) {
                let _ = std::fs::write(&log, format!("{op}\n{}", path.display()));
                sigkill_self();
            }
        });
        cfg = cfg.with_faults(faults);
    }
    let engine = Engine::open(cfg).unwrap();
    let start = engine.latest().unwrap().unwrap_or(0) + 1;
    match mode.as_str() {
        "op" | "after-commit" => {
            for step in start.. {
                // A failed save (none is injected) would be a bug: panic.
                save(&engine, step).unwrap().wait().unwrap();
            }
        }
        "time" => {
            for step in start.. {
                let h = save(&engine, step).unwrap();
                if step % 3 == 0 {
                    h.wait().unwrap();
                }
            }
        }
        "stage" => {
            save(&engine, start).unwrap();
            let data = payload(start + 1, 1, SIZES[0]);
            let specs = [
                TensorSpec {
                    name: "a".into(),
                    dtype: Dtype::U8,
                    shape: vec![SIZES[0] as u64],
                },
                TensorSpec {
                    name: "b".into(),
                    dtype: Dtype::U8,
                    shape: vec![SIZES[1] as u64],
                },
            ];
            let mut st = engine
                .begin_save(
                    start + 1,
                    &specs,
                    &json!({"step": start + 1}),
                    &SaveOptions::default(),
                )
                .unwrap()
                .unwrap();
            let cut = usize::try_from(arg).unwrap() % (SIZES[0] + 1);
            st.tensor_mut(0)[..cut].copy_from_slice(&data[..cut]);
            sigkill_self();
        }
        other => panic!("unknown child mode {other}"),
    }
}

fn spawn(mode: &str, root: &Path, shm: &Path, arg: u64, log: &Path) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env("ACP_TORTURE_CHILD", mode)
        .env("ACP_ROOT", root)
        .env("ACP_SHM", shm)
        .env("ACP_ARG", arg.to_string())
        .env("ACP_KILL_LOG", log)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a child that kills itself; a child alive after `limit` is a
/// failure (it hung), killed and reported.
fn wait_or_kill(child: &mut std::process::Child, limit: Duration) -> Result<(), String> {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            use std::os::unix::process::ExitStatusExt;
            return match status.signal() {
                Some(libc::SIGKILL) => Ok(()),
                _ => {
                    let mut err = String::new();
                    if let Some(mut e) = child.stderr.take() {
                        use std::io::Read;
                        let _ = e.read_to_string(&mut err);
                    }
                    Err(format!("child ended with {status}: {err}"))
                }
            };
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("child still alive after {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Storage operations of one whole save (after the first).
fn ops_per_save() -> u64 {
    let (_t, root, shm) = torture_util::dirs();
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(config(&root, &shm).with_faults(Arc::clone(&faults))).unwrap();
    save(&engine, 1).unwrap().wait().unwrap();
    let before = faults.ops();
    save(&engine, 2).unwrap().wait().unwrap();
    faults.ops() - before
}

/// Opens the root as the restarted trainer would and checks what it loads.
fn verify(root: &Path, shm: &Path, floor: &mut u64) -> Result<(), String> {
    let engine = Engine::open(config(root, shm)).map_err(|e| format!("open: {e}"))?;
    let result = (|| {
        match engine.load(&LoadRequest::default()) {
            Ok(ck) => {
                check(&ck)?;
                if ck.step() < *floor {
                    return Err(format!(
                        "loaded step {}, but step {} was committed before",
                        ck.step(),
                        *floor
                    ));
                }
                *floor = ck.step();
            }
            Err(Error::NotFound { .. }) if *floor == 0 => return Ok(()),
            Err(e) => return Err(format!("load: {e}")),
        }
        // Storage alone holds the same intact step.
        let disk = engine
            .load(&LoadRequest {
                storage_only: true,
                ..LoadRequest::default()
            })
            .map_err(|e| format!("load from storage: {e}"))?;
        check(&disk)?;
        if disk.step() != *floor {
            return Err(format!(
                "storage has step {}, RAM step {}",
                disk.step(),
                *floor
            ));
        }
        Ok(())
    })();
    engine.close().map_err(|e| format!("close: {e}"))?;
    result
}

/// A process killed between committing a step and marking its slot
/// leaves the slot `Resident` with a committed step. Two such deaths in a
/// row used to leave every slot of a two-slot ring taken for ever: the next
/// save waited for a slot that no flush would free.
#[test]
fn slots_of_steps_committed_just_before_a_kill_are_reused() {
    let (t, root, shm) = torture_util::dirs();
    let log = t.path().join("killed-at");
    for _ in 0..2 {
        let mut child = spawn("after-commit", &root, &shm, u64::MAX, &log);
        wait_or_kill(&mut child, Duration::from_secs(20)).unwrap();
    }
    let engine = Engine::open(
        config(&root, &shm).with_when_full(acp_core::WhenFull::Wait(Duration::from_secs(5))),
    )
    .unwrap();
    assert_eq!(engine.steps().unwrap(), vec![1, 2]);
    assert!(engine.open_report().persisting_steps.is_empty());
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 2);
    assert_eq!(ck.report().source, acp_core::Source::Ram);
    check(&ck).unwrap();
    drop(ck);
    save(&engine, 3).unwrap().wait().unwrap();
    save(&engine, 4).unwrap().wait().unwrap();
    assert_eq!(engine.latest().unwrap(), Some(4));
}

#[test]
fn sigkill_at_random_moments_leaves_a_committed_bit_exact_step() {
    let n = trials(30, 500);
    let per_save = ops_per_save();
    assert!(
        per_save >= 10,
        "a save has only {per_save} storage operations"
    );
    let (t, root, shm) = torture_util::dirs();
    let log = t.path().join("killed-at");
    let mut rng = Rng::new(0x5eed_0001, 1);
    let mut failures = Vec::new();
    let mut hit: BTreeMap<String, u64> = BTreeMap::new();
    let mut floor = 0;
    for trial in 0..n {
        let _ = std::fs::remove_file(&log);
        let outcome = match trial % 3 {
            0 => {
                let k = rng.below(3 * per_save);
                let mut child = spawn("op", &root, &shm, k, &log);
                let r = wait_or_kill(&mut child, Duration::from_secs(20));
                if let Ok(text) = std::fs::read_to_string(&log) {
                    let op = text.lines().next().unwrap_or("?").to_owned();
                    let what = if text.contains("index.json") {
                        format!("{op} (index)")
                    } else if text.contains("latest") {
                        format!("{op} (latest hint)")
                    } else {
                        op
                    };
                    *hit.entry(what).or_default() += 1;
                }
                r
            }
            1 => {
                let mut child = spawn("time", &root, &shm, 0, &log);
                std::thread::sleep(Duration::from_millis(20 + rng.below(400)));
                child.kill().unwrap();
                child.wait().unwrap();
                *hit.entry("random time".into()).or_default() += 1;
                Ok(())
            }
            _ => {
                let mut child = spawn("stage", &root, &shm, rng.next(), &log);
                *hit.entry("staging".into()).or_default() += 1;
                wait_or_kill(&mut child, Duration::from_secs(20))
            }
        };
        let checked = outcome.and_then(|()| verify(&root, &shm, &mut floor));
        if let Err(e) = checked {
            failures.push(format!("trial {trial}: {e}"));
        }
    }
    eprintln!("killed at: {hit:?}");
    assert!(floor > 0, "no step was ever committed");
    report("sigkill", n, &failures);
}
