//! Torture 4: an I/O error at the N-th storage operation, for every N over
//! a whole save (both I/O engines, EIO, ENOSPC, and a dead disk where every
//! later operation fails too), over a two-rank save (the fault in either
//! rank), and over a load from storage. Each time:
//! - the failed save's handle reports the error, naming a path and the
//!   operation; nothing half-written is committed;
//! - the previous committed step still loads bit for bit;
//! - the failed step's resident copy is restorable: a restarted engine
//!   commits it and loads it bit for bit;
//! - once the fault is gone, the next save works;
//! - a load hit by a read error fails naming the file, or returns the saved
//!   bytes; with fallback it returns the newest step it can read.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use acp_core::storage::faults::FaultInjector;
use acp_core::{
    Dtype, Engine, EngineConfig, Error, HostTensor, IoChoice, LoadRequest, SaveOptions, Source,
};
use serde_json::json;
use torture_util::{check, report, save};

fn config(root: &Path, shm: &Path, io: IoChoice, faults: &Arc<FaultInjector>) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("torture-faults")
        .with_ring_bytes(8 << 20)
        .with_chunk_bytes(64 << 10)
        .with_io(io)
        .with_mlock(false)
        .with_faults(Arc::clone(faults))
}

fn storage_only(step: Option<u64>) -> LoadRequest {
    LoadRequest {
        step,
        storage_only: true,
        ..LoadRequest::default()
    }
}

/// The I/O engines this kernel allows.
fn io_engines() -> Vec<IoChoice> {
    let (_t, root, shm) = torture_util::dirs();
    let f = Arc::new(FaultInjector::counting());
    match Engine::open(config(&root, &shm, IoChoice::Uring, &f)) {
        Ok(_) => vec![IoChoice::Psync, IoChoice::Uring],
        Err(e) => {
            eprintln!("SKIPPED io_uring runs: {e}");
            vec![IoChoice::Psync]
        }
    }
}

/// Storage operations of one save (after the first).
fn ops_per_save(io: IoChoice) -> u64 {
    let (_t, root, shm) = torture_util::dirs();
    let f = Arc::new(FaultInjector::counting());
    let engine = Engine::open(config(&root, &shm, io, &f)).unwrap();
    save(&engine, 1).unwrap().wait().unwrap();
    let before = f.ops();
    save(&engine, 2).unwrap().wait().unwrap();
    f.ops() - before
}

/// One faulty save of `step` on an open engine whose newest committed step
/// is `step - 1`; checks everything the module docs promise.
fn faulty_save(
    root: &Path,
    shm: &Path,
    io: IoChoice,
    engine: Engine,
    faults: &Arc<FaultInjector>,
    step: u64,
) -> Result<Engine, String> {
    let r = check_faulty_save(root, shm, io, &engine, faults, step);
    match r {
        Ok(true) => {
            // The resident copy of the failed step: a restart commits it.
            engine.close().map_err(|e| format!("close: {e}"))?;
            drop(engine);
            let engine = Engine::open(config(root, shm, io, faults)).map_err(|e| e.to_string())?;
            let restored = check_restored(&engine, step);
            if restored.is_err() {
                let _ = engine.close();
            }
            restored.map(|()| engine)
        }
        Ok(false) => Ok(engine),
        Err(e) => {
            let _ = engine.close();
            Err(e)
        }
    }
}

fn check_restored(engine: &Engine, step: u64) -> Result<(), String> {
    if engine.open_report().persisting_steps != vec![step] {
        return Err(format!(
            "restart persists {:?}, not the failed step {step}",
            engine.open_report().persisting_steps
        ));
    }
    let ck = engine
        .load(&LoadRequest::default())
        .map_err(|e| format!("restored step: {e}"))?;
    check(&ck)?;
    if ck.step() != step || ck.report().source != Source::Ram {
        return Err(format!(
            "restored step {} from {:?}, not {step} from RAM",
            ck.step(),
            ck.report().source
        ));
    }
    drop(ck);
    // The load was served from RAM, verified, without waiting for the
    // restart's persist: the step is committed once the engine is idle
    // (and the next trial's fault hits its own save, not this persist).
    engine
        .wait_idle(None)
        .map_err(|e| format!("restart's persist: {e}"))?;
    if !engine.steps().map_err(|e| e.to_string())?.contains(&step) {
        return Err(format!("the restart did not commit step {step}"));
    }
    Ok(())
}

/// `Ok(true)` when the save failed as it may, `Ok(false)` when it
/// committed.
fn check_faulty_save(
    root: &Path,
    _shm: &Path,
    _io: IoChoice,
    engine: &Engine,
    faults: &Arc<FaultInjector>,
    step: u64,
) -> Result<bool, String> {
    let result = save(engine, step)
        .map_err(|e| format!("stall: {e}"))?
        .wait();
    faults.heal();
    let committed = engine.steps().map_err(|e| e.to_string())?;
    match &result {
        Err(e) => {
            if committed.contains(&step) {
                return Err(format!("failed step {step} is committed: {e}"));
            }
            let msg = e.to_string();
            if !matches!(e, Error::Io { .. } | Error::NoSpace { .. }) {
                return Err(format!("not a storage error: {msg}"));
            }
            if !msg.contains(&root.display().to_string()) {
                return Err(format!("error names no path under the root: {msg}"));
            }
        }
        Ok(_) if !committed.contains(&step) => {
            return Err(format!("step {step} reported committed but is not"));
        }
        Ok(_) => {}
    }
    let ck = engine
        .load(&storage_only(None))
        .map_err(|e| format!("previous step: {e}"))?;
    check(&ck)?;
    if Some(ck.step()) != committed.last().copied() {
        return Err(format!("loaded {} of {committed:?}", ck.step()));
    }
    Ok(result.is_err())
}

#[test]
fn an_error_at_every_operation_of_a_save_loses_nothing() {
    let mut failures = Vec::new();
    let mut n_trials = 0;
    for io in io_engines() {
        let per_save = ops_per_save(io);
        assert!(per_save >= 10, "{io:?}: {per_save} operations");
        for (errno, sticky) in [(libc::EIO, false), (libc::ENOSPC, false), (libc::EIO, true)] {
            let (_t, root, shm) = torture_util::dirs();
            let faults = Arc::new(FaultInjector::counting());
            let mut engine = Engine::open(config(&root, &shm, io, &faults)).unwrap();
            save(&engine, 1).unwrap().wait().unwrap();
            let mut step = 1;
            for n in 0..per_save {
                step += 1;
                n_trials += 1;
                faults.arm(n, errno, sticky);
                let what = format!("{io:?} errno {errno} sticky {sticky} at op {n}");
                match faulty_save(&root, &shm, io, engine, &faults, step) {
                    Ok(e) => engine = e,
                    Err(e) => {
                        failures.push(format!("{what}: {e}"));
                        faults.heal();
                        engine = Engine::open(config(&root, &shm, io, &faults)).unwrap();
                    }
                }
                faults.heal();
            }
            // Once the cause is gone, saves work.
            step += 1;
            if let Err(e) = save(&engine, step).and_then(|h| h.wait()) {
                failures.push(format!("{io:?} errno {errno}: next save failed: {e}"));
            }
        }
    }
    report("io-error-every-op", n_trials, &failures);
}

fn rank_config(
    root: &Path,
    shm: &Path,
    rank: u32,
    faults: &Arc<FaultInjector>,
    commit_timeout: Duration,
) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("torture-ranks")
        .with_rank(rank)
        .with_world_size(2)
        .with_ring_bytes(8 << 20)
        .with_chunk_bytes(64 << 10)
        .with_mlock(false)
        .with_commit_timeout(commit_timeout)
        .with_faults(Arc::clone(faults))
}

fn rank_save(e: &Engine, rank: u32, step: u64) -> acp_core::SaveHandle {
    let data = torture_util::payload(step, 10 + rank as u8, 200_000);
    let name = format!("rank{rank}.w");
    e.save(
        step,
        &[HostTensor {
            name: &name,
            dtype: Dtype::U8,
            shape: &[data.len() as u64],
            data: &data,
        }],
        &json!({"step": step}),
        &SaveOptions::default(),
    )
    .unwrap()
}

fn rank_check(e: &Engine, rank: u32, step: u64) -> Result<(), String> {
    let ck = e
        .load(&LoadRequest {
            step: Some(step),
            storage_only: true,
            rank: Some(rank),
            ..LoadRequest::default()
        })
        .map_err(|e| format!("rank {rank} step {step}: {e}"))?;
    let t = ck
        .tensor(&format!("rank{rank}.w"))
        .ok_or_else(|| format!("rank {rank} step {step}: tensor missing"))?;
    if t.data != torture_util::payload(step, 10 + rank as u8, 200_000).as_slice() {
        return Err(format!("rank {rank} step {step}: bytes differ"));
    }
    Ok(())
}

#[test]
fn an_error_at_every_operation_of_a_two_rank_save_loses_nothing() {
    let (_t, root, shm) = torture_util::dirs();
    let timeout = Duration::from_millis(700);
    let faults = [
        Arc::new(FaultInjector::counting()),
        Arc::new(FaultInjector::counting()),
    ];
    let engines: Vec<Engine> = (0..2)
        .map(|r| Engine::open(rank_config(&root, &shm, r, &faults[r as usize], timeout)).unwrap())
        .collect();
    let both = |step| {
        let h: Vec<_> = (0..2)
            .map(|r| rank_save(&engines[r], r as u32, step))
            .collect();
        h.into_iter().map(|h| h.wait()).collect::<Vec<_>>()
    };
    for r in both(1) {
        r.unwrap();
    }
    // Operations of one rank's save (after the first).
    let before: Vec<u64> = faults.iter().map(|f| f.ops()).collect();
    for r in both(2) {
        r.unwrap();
    }
    let per_rank: Vec<u64> = faults
        .iter()
        .zip(&before)
        .map(|(f, b)| f.ops() - b)
        .collect();
    let mut failures = Vec::new();
    let mut n_trials = 0;
    let mut step = 2;
    let mut last_good = 2;
    for rank in 0..2 {
        for n in 0..per_rank[rank] {
            step += 1;
            n_trials += 1;
            let what = format!("rank {rank} at op {n} (step {step})");
            faults[rank].arm(n, libc::EIO, false);
            let results = both(step);
            faults[rank].heal();
            let committed = engines[0].steps().unwrap();
            let ok = results.iter().all(Result::is_ok);
            if ok != committed.contains(&step) {
                failures.push(format!(
                    "{what}: handles {results:?}, committed {committed:?}"
                ));
            }
            if ok {
                last_good = step;
            } else if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                let msg = e.to_string();
                if !msg.contains(&root.display().to_string()) && !msg.contains("rank") {
                    failures.push(format!("{what}: error names neither path nor rank: {msg}"));
                }
            }
            for r in 0..2 {
                if let Err(e) = rank_check(&engines[r as usize], r, last_good) {
                    failures.push(format!("{what}: {e}"));
                }
            }
        }
    }
    // Once the faults are gone, a two-rank save commits again.
    step += 1;
    for (r, result) in both(step).into_iter().enumerate() {
        if let Err(e) = result {
            failures.push(format!("after the faults: rank {r}: {e}"));
        }
    }
    for r in 0..2 {
        if let Err(e) = rank_check(&engines[r as usize], r, step) {
            failures.push(format!("after the faults: {e}"));
        }
    }
    report("io-error-every-op-two-ranks", n_trials, &failures);
}

#[test]
fn a_read_error_at_every_operation_of_a_load_is_reported_or_harmless() {
    let mut failures = Vec::new();
    let mut n_trials = 0;
    for io in io_engines() {
        let (_t, root, shm) = torture_util::dirs();
        let faults = Arc::new(FaultInjector::counting());
        let engine = Engine::open(config(&root, &shm, io, &faults)).unwrap();
        for step in 1..=3 {
            save(&engine, step).unwrap().wait().unwrap();
        }
        let before = faults.ops();
        check(&engine.load(&storage_only(None)).unwrap()).unwrap();
        let per_load = faults.ops() - before;
        assert!(per_load >= 3, "{io:?}: a load has {per_load} operations");
        for n in 0..per_load {
            for fallback in [false, true] {
                n_trials += 1;
                let what = format!("{io:?} read error at op {n}, fallback {fallback}");
                faults.arm(n, libc::EIO, false);
                let got = engine.load(&LoadRequest {
                    fallback,
                    ..storage_only(None)
                });
                faults.heal();
                match got {
                    Ok(ck) => {
                        if let Err(e) = check(&ck) {
                            failures.push(format!("{what}: {e}"));
                        }
                        if !fallback && ck.step() != 3 {
                            failures.push(format!("{what}: loaded step {}", ck.step()));
                        }
                    }
                    Err(e) if fallback => failures.push(format!("{what}: {e}")),
                    Err(e) => {
                        let msg = e.to_string();
                        if !matches!(e, Error::Io { .. }) || !msg.contains("rank-00000.safetensors")
                        {
                            failures.push(format!("{what}: {msg}"));
                        }
                    }
                }
            }
        }
        // A dead disk: every read fails, each load says so.
        faults.arm(0, libc::EIO, true);
        n_trials += 1;
        match engine.load(&storage_only(None)) {
            Err(Error::Io { .. }) => {}
            other => failures.push(format!("{io:?} dead disk: {:?}", other.map(|c| c.step()))),
        }
        faults.heal();
        check(&engine.load(&storage_only(None)).unwrap()).unwrap();
    }
    report("io-error-every-op-load", n_trials, &failures);
}

/// Rank 1 fails the directory fsync after writing its manifest, slowly (a
/// stall, then EIO). Rank 0 must not have taken the manifest as the report
/// that rank 1's file is durable meanwhile: the step is committed exactly
/// when every rank's save succeeds. (The two-rank torture found rank 0
/// committing a step whose rank 1 save then failed.)
#[test]
fn a_rank_failing_after_its_manifest_is_written_is_never_committed() {
    let (_t, root, shm) = torture_util::dirs();
    let faults = [
        Arc::new(FaultInjector::counting()),
        Arc::new(FaultInjector::counting()),
    ];
    let engines: Vec<Engine> = (0..2)
        .map(|r| {
            Engine::open(rank_config(
                &root,
                &shm,
                r,
                &faults[r as usize],
                Duration::from_secs(3),
            ))
            .unwrap()
        })
        .collect();
    let both = |step| {
        let h: Vec<_> = (0..2)
            .map(|r| rank_save(&engines[r], r as u32, step))
            .collect();
        h.into_iter().map(|h| h.wait()).collect::<Vec<_>>()
    };
    for r in both(1) {
        r.unwrap();
    }
    // Where rank 1's pending-directory fsync falls in one save.
    let before = faults[1].ops();
    for r in both(2) {
        r.unwrap();
    }
    let log = faults[1].log();
    let k = log[usize::try_from(before).unwrap()..]
        .iter()
        .position(|l| l.starts_with("fsync directory") && l.contains(".pending-"))
        .expect("rank 1 fsyncs its pending directory") as u64;
    faults[1].arm_stall(k, Duration::from_secs(2));
    faults[1].arm(k, libc::EIO, false);
    let results = both(3);
    faults[1].heal();
    let committed = engines[0].steps().unwrap();
    assert!(results[1].is_err(), "{results:?}");
    assert!(
        !committed.contains(&3),
        "step 3 committed although rank 1's save failed: {results:?}"
    );
    for r in both(4) {
        r.unwrap();
    }
    assert_eq!(engines[0].steps().unwrap(), vec![1, 2, 4]);
}

/// A step left resident by a failed flush, persisted later on request
/// (`persist_resident`, as ranks that recover together do) stays resident:
/// open had set its slot aside as reclaimable, and the flush's success
/// used to free it with the other reclaimable slots.
#[test]
fn a_slot_persisted_on_request_stays_resident() {
    let (_t, root, shm) = torture_util::dirs();
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(config(&root, &shm, IoChoice::Psync, &faults)).unwrap();
    faults.arm(0, libc::EIO, true);
    assert!(save(&engine, 1).unwrap().wait().is_err());
    faults.heal();
    engine.close().unwrap();
    drop(engine);
    let engine =
        Engine::open(config(&root, &shm, IoChoice::Psync, &faults).with_persist_on_open(false))
            .unwrap();
    assert_eq!(engine.open_report().resident_steps, vec![1]);
    engine.persist_resident(1).unwrap().wait().unwrap();
    let ck = engine.load(&LoadRequest::default()).unwrap();
    check(&ck).unwrap();
    assert_eq!(ck.report().source, Source::Ram);
}
