//! A step restored from storage on a ring with no slot ready for it (a new
//! node's: the file is streamed into the caller's tensors, or read into
//! private memory) is read again into a ring slot in the background
//! (`EngineConfig::with_keep_restored`, on by default), plain and
//! compressed:
//! - once the engine is idle the step is resident, and a restarted
//!   process on the node restores it from RAM, verified, bit-exact;
//! - a save sealed right after the restore is the newest resident step,
//!   whatever the re-read did;
//! - a re-read that fails leaves nothing resident and raises nothing: the
//!   load had succeeded, and the step is still on storage;
//! - a re-read that hangs is reported by the watchdog as a stuck flush is,
//!   naming what it reads, and the engine closes once storage answers; one
//!   that takes longer than the stall timeout but makes progress is not;
//! - a close, `Engine::stop_keeping_restored` (the dying checkpoint's) or
//!   a save that begins stops a running re-read within its reads in
//!   flight and seals nothing;
//! - with `keep_restored` off, nothing becomes resident.
//!
//! (The fixture's engines have it off; these turn it on.)

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use acp_core::storage::faults::FaultInjector;
use acp_core::{Compress, Engine, IoChoice, LoadRequest, Source};

mod six_tensors;
use six_tensors::{
    committed, config, fresh_engine, name, save_six, save_six_with, tensor, TENSORS, TENSOR_BYTES,
};

/// The watchdog's stall timeout in the tests of a re-read that hangs or
/// is slow. Their flush threads run at the default priority
/// (`with_background_nice(0)`): a lowered one can be starved for longer
/// than this on a busy test machine, which is not what they test.
const STALL: Duration = Duration::from_millis(1500);

fn step1(storage_only: bool) -> LoadRequest {
    LoadRequest {
        step: Some(1),
        storage_only,
        ..LoadRequest::default()
    }
}

/// Loads step 1 per `req` into fresh buffers, checks every byte, and
/// returns where it came from.
fn restore_into(engine: &Engine, req: &LoadRequest, what: &str) -> Source {
    let names: Vec<String> = (0..TENSORS).map(name).collect();
    let mut bufs: Vec<Vec<u8>> = (0..TENSORS).map(|_| vec![0xee; TENSOR_BYTES]).collect();
    let mut into: Vec<(&str, &mut [u8])> = names
        .iter()
        .map(String::as_str)
        .zip(bufs.iter_mut().map(Vec::as_mut_slice))
        .collect();
    let ck = engine.load_into(req, &mut into).unwrap();
    assert!(ck.report().verified, "{what}");
    for (i, b) in bufs.iter().enumerate() {
        assert!(*b == tensor(i), "{what}: w.{i}");
    }
    ck.report().source
}

/// The storage operations of step 1's restore alone, counted on a new
/// node's engine opened by `open(tag, counter, keep_restored = false)`
/// (nothing then reads the file again).
fn restore_ops(open: impl Fn(&str, &Arc<FaultInjector>, bool) -> Engine) -> u64 {
    let counter = Arc::new(FaultInjector::counting());
    let probe = open("probe", &counter, false);
    let before = counter.ops();
    assert_eq!(
        restore_into(&probe, &step1(false), "probe"),
        Source::Storage
    );
    let ops = counter.ops() - before;
    probe.wait_idle(None).unwrap();
    assert!(probe.resident_steps().is_empty(), "keep_restored off");
    probe.close().unwrap();
    ops
}

/// An engine on the ring in `dir/shm-{tag}` (made by [`fresh_engine`]),
/// as a restarted process on the same node opens it.
fn reopen(root: &Path, dir: &Path, tag: &str) -> Engine {
    Engine::open(config(
        root,
        &dir.join(format!("shm-{tag}")),
        IoChoice::Auto,
        2,
    ))
    .unwrap()
}

#[test]
fn a_restore_on_a_new_node_is_resident_again_and_a_restart_restores_it_from_ram() {
    let dir = tempfile::tempdir().unwrap();
    for compress in [Compress::None, Compress::Zstd] {
        let (root, _) = committed(dir.path(), compress);
        for into in [true, false] {
            let tag = format!("{compress:?}-{into}");
            let case = format!("{compress:?}, into={into}");
            let engine = fresh_engine(&root, dir.path(), &tag, |c| c.with_keep_restored(true));
            if into {
                assert_eq!(restore_into(&engine, &step1(false), &case), Source::Storage);
            } else {
                let ck = engine.load(&step1(false)).unwrap();
                assert_eq!(ck.report().source, Source::Storage, "{case}");
                for i in 0..TENSORS {
                    assert!(ck.tensor(&name(i)).unwrap().data == tensor(i), "{case}");
                }
            }
            engine.wait_idle(None).unwrap();
            assert_eq!(engine.resident_steps(), vec![1], "{case}");
            // The process ends before its next save; its successor on
            // the node restores the step from RAM.
            engine.close().unwrap();
            drop(engine);
            let engine = reopen(&root, dir.path(), &tag);
            assert_eq!(engine.resident_steps(), vec![1], "{case}");
            let what = format!("{case}, restarted");
            assert_eq!(restore_into(&engine, &step1(false), &what), Source::Ram);
            engine.close().unwrap();
        }
    }
}

#[test]
fn a_save_right_after_the_restore_is_the_newest_resident_step() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _) = committed(dir.path(), Compress::None);
    let engine = fresh_engine(&root, dir.path(), "save", |c| c.with_keep_restored(true));
    assert_eq!(
        restore_into(&engine, &step1(false), "restore"),
        Source::Storage
    );
    let data: Vec<Vec<u8>> = (0..TENSORS).map(|i| tensor((i + 1) % TENSORS)).collect();
    save_six(&engine, 2, &data);
    engine.wait_idle(None).unwrap();
    let resident = engine.resident_steps();
    assert_eq!(resident.first(), Some(&2), "{resident:?}");
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!((ck.step(), ck.report().source), (2, Source::Ram));
    assert!(ck.tensor(&name(0)).unwrap().data == data[0]);
    drop(ck);
    engine.close().unwrap();
}

#[test]
fn a_reread_that_fails_leaves_nothing_resident_and_raises_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _) = committed(dir.path(), Compress::None);
    let with_faults = |tag: &str, faults: &Arc<FaultInjector>, keep: bool| {
        fresh_engine(&root, dir.path(), tag, |c| {
            c.with_faults(Arc::clone(faults)).with_keep_restored(keep)
        })
    };
    let ops = restore_ops(with_faults);
    // Every operation after the restore's fails: the re-read's.
    let faults = Arc::new(FaultInjector::counting());
    let engine = with_faults("fail", &faults, true);
    faults.arm(ops, libc::EIO, true);
    assert_eq!(
        restore_into(&engine, &step1(false), "restore"),
        Source::Storage
    );
    engine.wait_idle(None).unwrap();
    assert!(faults.ops() > ops, "the re-read was tried");
    assert!(engine.resident_steps().is_empty());
    engine.close().unwrap();
}

#[test]
fn a_reread_that_hangs_is_reported_by_the_watchdog() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::None);
    let engine_with = |tag: &str, faults: &Arc<FaultInjector>, keep: bool| {
        fresh_engine(&root, dir.path(), tag, |c| {
            c.with_faults(Arc::clone(faults))
                .with_keep_restored(keep)
                .with_stall_timeout(STALL)
                .with_background_nice(0)
        })
    };
    let ops = restore_ops(engine_with);
    // The re-read's first storage operation hangs until healed.
    let faults = Arc::new(FaultInjector::counting());
    let engine = engine_with("hang", &faults, true);
    faults.arm_stall(ops, Duration::from_secs(600));
    assert_eq!(
        restore_into(&engine, &step1(false), "restore"),
        Source::Storage
    );
    let e = engine.wait_idle(None).unwrap_err();
    assert_eq!(e.kind(), acp_core::ErrorKind::Timeout, "{e}");
    let text = e.to_string();
    assert!(text.contains("again into a ring slot"), "{text}");
    assert!(text.contains(&file.display().to_string()), "{text}");
    faults.heal();
    // The watchdog reports the stall until the re-read's next read is
    // checked.
    let t = std::time::Instant::now();
    while let Err(e) = engine.wait_idle(None) {
        assert_eq!(e.kind(), acp_core::ErrorKind::Timeout, "{e}");
        assert!(t.elapsed() < Duration::from_secs(60), "still stuck: {e}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(engine.resident_steps(), vec![1]);
    engine.close().unwrap();
}

#[test]
fn a_slow_reread_that_makes_progress_is_not_a_stall() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _) = committed(dir.path(), Compress::None);
    let faults = Arc::new(FaultInjector::counting());
    let engine = fresh_engine(&root, dir.path(), "slow", |c| {
        c.with_faults(Arc::clone(&faults))
            .with_keep_restored(true)
            .with_stall_timeout(STALL)
            .with_background_nice(0)
    });
    // The restore, then the re-read of its 24 MiB, at 8 MB/s: about 3 s
    // each, twice the stall timeout, in 1 MiB chunk reads.
    faults.throttle(8_000_000, 1 << 20);
    assert_eq!(
        restore_into(&engine, &step1(false), "restore"),
        Source::Storage
    );
    let t = std::time::Instant::now();
    engine.wait_idle(None).unwrap();
    faults.throttle(0, 1 << 20);
    let waited = t.elapsed();
    assert!(waited > STALL, "the re-read took {waited:?}");
    assert_eq!(engine.resident_steps(), vec![1]);
    engine.close().unwrap();
}

/// Opens a new node's engine, restores step 1 (stored in `file`) from
/// storage at full speed, then slows storage so that the re-read that
/// follows would take about 12 s.
fn restored_then_slowed(
    root: &Path,
    file: &Path,
    dir: &Path,
    tag: &str,
) -> (Engine, Arc<FaultInjector>) {
    let faults = Arc::new(FaultInjector::counting());
    let engine = fresh_engine(root, dir, tag, |c| {
        c.with_faults(Arc::clone(&faults))
            .with_keep_restored(true)
            .with_background_nice(0)
    });
    assert_eq!(
        restore_into(&engine, &step1(false), "restore"),
        Source::Storage
    );
    let stored = std::fs::metadata(file).unwrap().len();
    faults.throttle((stored / 12).max(1000), 1 << 20);
    // Let the re-read start.
    std::thread::sleep(Duration::from_millis(300));
    (engine, faults)
}

/// The most a stopped re-read may take to give up: the reads it has in
/// flight, slowed, and a loaded machine's delays; far below the 12 s of
/// the whole re-read.
const GIVE_UP: Duration = Duration::from_secs(4);

#[test]
fn a_close_stops_a_running_reread_and_leaves_nothing_resident() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::None);
    let (engine, faults) = restored_then_slowed(&root, &file, dir.path(), "close");
    let t = std::time::Instant::now();
    engine.close().unwrap();
    let took = t.elapsed();
    faults.throttle(0, 1 << 20);
    assert!(took < GIVE_UP, "close waited {took:?} for the re-read");
    assert!(engine.resident_steps().is_empty());
    drop(engine);
    // The next process on the node restores from storage: nothing half
    // read was sealed.
    let again = reopen(&root, dir.path(), "close");
    assert!(again.resident_steps().is_empty());
    assert_eq!(
        restore_into(&again, &step1(false), "after close"),
        Source::Storage
    );
    again.close().unwrap();
}

#[test]
fn stop_keeping_restored_stops_a_running_reread_and_a_later_restore_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::Zstd);
    let (engine, faults) = restored_then_slowed(&root, &file, dir.path(), "stop");
    let t = std::time::Instant::now();
    engine.stop_keeping_restored();
    engine.wait_idle(None).unwrap();
    let took = t.elapsed();
    faults.throttle(0, 1 << 20);
    assert!(took < GIVE_UP, "the re-read went on for {took:?}");
    assert!(engine.resident_steps().is_empty());
    // Not sticky: the next restore from storage is read again into RAM.
    assert_eq!(
        restore_into(&engine, &step1(false), "again"),
        Source::Storage
    );
    engine.wait_idle(None).unwrap();
    assert_eq!(engine.resident_steps(), vec![1]);
    engine.close().unwrap();
}

#[test]
fn a_save_that_begins_stops_the_reread_it_makes_moot() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::None);
    let (engine, faults) = restored_then_slowed(&root, &file, dir.path(), "moot");
    // A RAM snapshot of step 2 (nothing to write on the slowed storage):
    // the re-read of step 1 would be dropped unsealed when it ends; it
    // stops instead of taking the disk and a core for 12 s.
    let data: Vec<Vec<u8>> = (0..TENSORS).map(|i| tensor((i + 1) % TENSORS)).collect();
    let t = std::time::Instant::now();
    let opts = acp_core::SaveOptions {
        persist: acp_core::Persist::Never,
        ..acp_core::SaveOptions::default()
    };
    save_six_with(&engine, 2, &data, &opts);
    engine.wait_idle(None).unwrap();
    let took = t.elapsed();
    faults.throttle(0, 1 << 20);
    assert!(took < GIVE_UP, "the re-read went on for {took:?}");
    assert_eq!(engine.resident_steps(), vec![2]);
    engine.close().unwrap();
}
