//! One conformance suite for the engine, run with each I/O engine and each
//! `O_DIRECT` setting: round trips, byte-identical files, restore from RAM
//! and from storage, retention, overwrite, the slot policy.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::Path;
use std::time::Duration;

use acp_core::{
    DirectIo, Dtype, Engine, EngineConfig, Error, HostTensor, IoChoice, LoadRequest, SaveOptions,
    Source, TensorSpec, WhenFull,
};
use serde_json::json;

struct Fixture {
    _dir: tempfile::TempDir,
    root: std::path::PathBuf,
    shm: std::path::PathBuf,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    Fixture {
        _dir: dir,
        root,
        shm,
    }
}

fn config(f: &Fixture, io: IoChoice, direct: DirectIo) -> EngineConfig {
    EngineConfig::new(&f.root)
        .with_shm_dir(&f.shm)
        .with_job("test")
        .with_ring_bytes(64 << 20)
        .with_chunk_bytes(64 << 10)
        .with_queue_depth(4)
        .with_io(io)
        .with_direct_io(direct)
}

/// A deterministic set of tensors of every dtype, 0-d and empty included.
fn tensors(seed: u8) -> Vec<(String, Dtype, Vec<u64>, Vec<u8>)> {
    let mut out = Vec::new();
    for (i, dt) in Dtype::ALL.iter().enumerate() {
        let shape = vec![3, (i as u64 % 4) + 1];
        let n = 3 * ((i % 4) + 1) * dt.size();
        let data = (0..n)
            .map(|j| (j as u8).wrapping_mul(31).wrapping_add(seed + i as u8))
            .collect();
        out.push((format!("t.{}", dt.name()), *dt, shape, data));
    }
    out.push(("scalar".into(), Dtype::F32, vec![], vec![1, 2, 3, seed]));
    out.push(("empty".into(), Dtype::F64, vec![0, 5], vec![]));
    let big: Vec<u8> = (0..300_000u32).map(|j| (j % 251) as u8 ^ seed).collect();
    out.push(("big".into(), Dtype::U8, vec![300_000], big));
    out
}

fn save(engine: &Engine, step: u64, seed: u8) -> acp_core::SaveHandle {
    let t = tensors(seed);
    let host: Vec<HostTensor<'_>> = t
        .iter()
        .map(|(n, d, s, b)| HostTensor {
            name: n,
            dtype: *d,
            shape: s,
            data: b,
        })
        .collect();
    engine
        .save(
            step,
            &host,
            &json!({"step": step, "lr": 0.5, "tags": ["a", null, true]}),
            &SaveOptions::default(),
        )
        .unwrap()
}

fn assert_matches(ck: &acp_core::Checkpoint, seed: u8) {
    for (name, dtype, shape, data) in tensors(seed) {
        let v = ck
            .tensor(&name)
            .unwrap_or_else(|| panic!("tensor {name} missing"));
        assert_eq!(v.dtype, dtype, "{name}");
        assert_eq!(v.shape, shape.as_slice(), "{name}");
        assert_eq!(v.data, data.as_slice(), "{name}");
        // Every tensor is aligned to its element size in the image.
        assert_eq!(v.data.as_ptr() as usize % dtype.size(), 0, "{name}");
    }
    assert_eq!(ck.values()["lr"], json!(0.5));
}

fn engines() -> Vec<(IoChoice, DirectIo)> {
    vec![
        (IoChoice::Uring, DirectIo::On),
        (IoChoice::Uring, DirectIo::Off),
        (IoChoice::Psync, DirectIo::On),
        (IoChoice::Psync, DirectIo::Off),
    ]
}

fn data_file(root: &Path, step: u64) -> Vec<u8> {
    std::fs::read(root.join(format!("step-{step:012}/rank-00000.safetensors"))).unwrap()
}

#[test]
fn round_trip_from_ram_and_storage_with_every_engine() {
    let mut files = Vec::new();
    for (io, direct) in engines() {
        let f = fixture();
        let engine = Engine::open(config(&f, io, direct)).unwrap();
        assert_eq!(
            engine.open_report().io,
            match io {
                IoChoice::Uring => acp_core::IoKind::Uring,
                _ => acp_core::IoKind::Psync,
            }
        );
        let rep = save(&engine, 10, 7).wait().unwrap();
        assert_eq!(rep.step, 10);
        assert!(!rep.skipped);
        assert_eq!(rep.direct, direct == DirectIo::On, "{io:?} {direct:?}");
        assert_eq!(engine.steps().unwrap(), vec![10]);

        let ram = engine.load(&LoadRequest::default()).unwrap();
        assert_eq!(ram.report().source, Source::Ram);
        assert!(ram.report().verified);
        assert_matches(&ram, 7);
        drop(ram);

        let disk = engine
            .load(&LoadRequest {
                storage_only: true,
                ..LoadRequest::default()
            })
            .unwrap();
        assert_eq!(disk.report().source, Source::Storage);
        assert_matches(&disk, 7);
        // The file on disk is the image, byte for byte.
        let bytes = data_file(&f.root, 10);
        assert_eq!(bytes, disk.image());
        files.push(bytes);
        drop(disk);
        engine.close().unwrap();
    }
    // Byte-identical files whichever engine wrote them.
    for w in files.windows(2) {
        assert_eq!(w[0], w[1]);
    }
}

#[test]
fn a_new_engine_restores_from_ram_after_close() {
    let f = fixture();
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    save(&engine, 1, 1).wait().unwrap();
    save(&engine, 2, 2).wait().unwrap();
    engine.close().unwrap();
    drop(engine);
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    let mut resident = engine.open_report().resident_steps.clone();
    resident.sort_unstable();
    // Step 1's slot may have taken step 2 while the warming thread was
    // still growing the other slot (`shm_lifecycle.rs` says the same):
    // step 2, the newest, is resident either way.
    assert!(resident == [1, 2] || resident == [2], "{resident:?}");
    assert!(engine.open_report().persisting_steps.is_empty());
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), 2);
    assert_eq!(ck.report().source, Source::Ram);
    assert_matches(&ck, 2);
    let ck1 = engine
        .load(&LoadRequest {
            step: Some(1),
            ..LoadRequest::default()
        })
        .unwrap();
    assert_matches(&ck1, 1);
}

#[test]
fn a_file_written_by_acp_is_plain_safetensors() {
    let f = fixture();
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    save(&engine, 3, 3).wait().unwrap();
    let bytes = data_file(&f.root, 3);
    // The safetensors rules: 8-byte LE header length, JSON, tensors packed
    // back to back from offset 0 to the end of the file.
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!((8 + n) % 4096, 0, "data start aligned for O_DIRECT");
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let mut spans: Vec<(u64, u64)> = header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(_, v)| {
            let o = &v["data_offsets"];
            (o[0].as_u64().unwrap(), o[1].as_u64().unwrap())
        })
        .collect();
    spans.sort_unstable();
    let mut pos = 0;
    for (b, e) in spans {
        assert_eq!(b, pos);
        pos = e;
    }
    assert_eq!(pos as usize, bytes.len() - 8 - n);
    assert_eq!(header["__metadata__"]["acp.step"], json!("3"));
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(
            f.root
                .join("step-000000000003/model.safetensors.index.json"),
        )
        .unwrap(),
    )
    .unwrap();
    assert_eq!(index["weight_map"]["big"], json!("rank-00000.safetensors"));
    assert_eq!(index["metadata"]["total_size"], json!(bytes.len()));
}

#[test]
fn a_committed_step_is_refused_unless_overwrite() {
    let f = fixture();
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    save(&engine, 5, 1).wait().unwrap();
    let t = tensors(9);
    let host: Vec<HostTensor<'_>> = t
        .iter()
        .map(|(n, d, s, b)| HostTensor {
            name: n,
            dtype: *d,
            shape: s,
            data: b,
        })
        .collect();
    let err = engine
        .save(5, &host, &json!(null), &SaveOptions::default())
        .unwrap_err();
    assert!(matches!(err, Error::Exists { step: 5, .. }), "{err}");
    assert_matches(&engine.load(&LoadRequest::default()).unwrap(), 1);
    let opts = SaveOptions {
        overwrite: true,
        ..SaveOptions::default()
    };
    engine
        .save(5, &host, &json!({"lr": 0.5}), &opts)
        .unwrap()
        .wait()
        .unwrap();
    let ck = engine
        .load(&LoadRequest {
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap();
    assert_matches(&ck, 9);
    assert_eq!(engine.steps().unwrap(), vec![5]);
}

#[test]
fn retention_keeps_last_k_and_every_mth() {
    let f = fixture();
    let engine = Engine::open(
        config(&f, IoChoice::Auto, DirectIo::Auto)
            .with_keep_last(2)
            .with_keep_every(4),
    )
    .unwrap();
    for step in 1..=9 {
        save(&engine, step, step as u8).wait().unwrap();
    }
    assert_eq!(engine.steps().unwrap(), vec![4, 8, 9]);
    assert_eq!(engine.retain(1, None).unwrap(), vec![4, 8]);
    assert_eq!(engine.steps().unwrap(), vec![9]);
}

#[test]
fn bad_input_is_refused_with_its_name() {
    let f = fixture();
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    let spec = |name: &str| TensorSpec {
        name: name.into(),
        dtype: Dtype::F32,
        shape: vec![2],
    };
    for (specs, needle) in [
        (vec![spec("a"), spec("a")], "`a`"),
        (vec![spec("")], "empty"),
        (vec![spec("x\0y")], "NUL"),
    ] {
        let err = engine
            .begin_save(1, &specs, &json!(null), &SaveOptions::default())
            .unwrap_err();
        assert!(matches!(err, Error::Invalid { .. }), "{err}");
        assert!(
            err.to_string().contains(needle)
                || err
                    .to_string()
                    .to_lowercase()
                    .contains(&needle.to_lowercase()),
            "{err} lacks {needle}"
        );
    }
    let data = [0u8; 7];
    let err = engine
        .save(
            1,
            &[HostTensor {
                name: "w",
                dtype: Dtype::F32,
                shape: &[2],
                data: &data,
            }],
            &json!(null),
            &SaveOptions::default(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("`w`"), "{err}");
    // Nothing was committed by the failed attempts.
    assert!(engine.steps().unwrap().is_empty());
    let err = engine.load(&LoadRequest::default()).unwrap_err();
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    let big = vec![0u8; 70 << 20];
    let err = engine
        .save(
            1,
            &[HostTensor {
                name: "huge",
                dtype: Dtype::U8,
                shape: &[big.len() as u64],
                data: &big,
            }],
            &json!(null),
            &SaveOptions::default(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("ring"), "{err}");
}

#[test]
fn skip_policy_says_it_skipped() {
    let f = fixture();
    let faults = std::sync::Arc::new(acp_core::storage::faults::FaultInjector::counting());
    let engine = Engine::open(
        config(&f, IoChoice::Psync, DirectIo::Auto)
            .with_ring_slots(1)
            .with_when_full(WhenFull::Skip)
            .with_faults(faults),
    )
    .unwrap();
    // Fill the only slot with a save whose staging is still open.
    let specs = [TensorSpec {
        name: "a".into(),
        dtype: Dtype::U8,
        shape: vec![4],
    }];
    let open = engine
        .begin_save(1, &specs, &json!(null), &SaveOptions::default())
        .unwrap()
        .unwrap();
    let h = save(&engine, 2, 2);
    let rep = h.wait().unwrap();
    assert!(rep.skipped, "the save should have been skipped");
    drop(open);
    // Once the slot is free again, saves go through.
    save(&engine, 3, 3).wait().unwrap();
    assert_eq!(engine.steps().unwrap(), vec![3]);
}

#[test]
fn wait_policy_times_out_naming_the_ring() {
    let f = fixture();
    let engine = Engine::open(
        config(&f, IoChoice::Auto, DirectIo::Auto)
            .with_ring_slots(1)
            .with_when_full(WhenFull::Wait(Duration::from_millis(100))),
    )
    .unwrap();
    let specs = [TensorSpec {
        name: "a".into(),
        dtype: Dtype::U8,
        shape: vec![4],
    }];
    let _open = engine
        .begin_save(1, &specs, &json!(null), &SaveOptions::default())
        .unwrap()
        .unwrap();
    let err = engine
        .begin_save(2, &specs, &json!(null), &SaveOptions::default())
        .unwrap_err();
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    assert!(err.to_string().contains("ring slot"), "{err}");
}

#[test]
fn direct_staging_into_the_slot() {
    let f = fixture();
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    let specs = [
        TensorSpec {
            name: "a".into(),
            dtype: Dtype::F32,
            shape: vec![4],
        },
        TensorSpec {
            name: "b".into(),
            dtype: Dtype::F64,
            shape: vec![2],
        },
    ];
    let mut st = engine
        .begin_save(4, &specs, &json!({"k": 1}), &SaveOptions::default())
        .unwrap()
        .unwrap();
    st.tensor_mut(0).copy_from_slice(&[1u8; 16]);
    st.tensor_mut(1).copy_from_slice(&[2u8; 16]);
    st.finish().wait().unwrap();
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.tensor("a").unwrap().data, &[1u8; 16]);
    assert_eq!(ck.tensor("b").unwrap().data, &[2u8; 16]);
    let mut out = vec![0u8; 16];
    let idx = ck.entries().iter().position(|e| e.name == "b").unwrap();
    ck.copy_into(&mut [(idx, &mut out[..])]).unwrap();
    assert_eq!(out, [2u8; 16]);
    let mut short = [0u8; 3];
    let err = ck.copy_into(&mut [(idx, &mut short[..])]).unwrap_err();
    assert!(err.to_string().contains("`b`"), "{err}");
}

#[test]
fn a_dropped_staging_commits_nothing() {
    let f = fixture();
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    save(&engine, 1, 1).wait().unwrap();
    let specs = [TensorSpec {
        name: "a".into(),
        dtype: Dtype::U8,
        shape: vec![4],
    }];
    drop(
        engine
            .begin_save(2, &specs, &json!(null), &SaveOptions::default())
            .unwrap()
            .unwrap(),
    );
    engine.wait_idle(None).unwrap();
    assert_eq!(engine.steps().unwrap(), vec![1]);
}

#[test]
fn handles_are_futures() {
    let f = fixture();
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let rep = rt.block_on(async { save(&engine, 8, 8).await }).unwrap();
    assert_eq!(rep.step, 8);
    assert!(rep.total_secs >= rep.stall_secs);
}

/// An awaited save whose storage hangs ends with the watchdog's timeout,
/// as a blocking wait does (the future used to stay pending until the
/// storage answered); once it answers, a clone of the handle gives the
/// save's result.
#[test]
fn an_awaited_save_on_hung_storage_ends_with_the_watchdogs_timeout() {
    use acp_core::storage::faults::FaultInjector;
    use std::sync::Arc;
    let f = fixture();
    let faults = Arc::new(FaultInjector::counting());
    let engine = Engine::open(
        config(&f, IoChoice::Auto, DirectIo::Auto)
            .with_faults(Arc::clone(&faults))
            .with_stall_timeout(Duration::from_millis(500))
            .with_background_nice(0),
    )
    .unwrap();
    // The flush's first storage operation hangs for 4 s.
    faults.arm_stall(0, Duration::from_secs(4));
    let handle = save(&engine, 3, 3);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let t = std::time::Instant::now();
    let err = rt.block_on(handle.clone()).unwrap_err();
    let took = t.elapsed();
    assert_eq!(err.kind(), acp_core::ErrorKind::Timeout, "{err}");
    assert!(took < Duration::from_secs(3), "the await took {took:?}");
    // Once the storage has answered, the save completes.
    std::thread::sleep(Duration::from_secs(4).saturating_sub(t.elapsed()));
    let rep = rt.block_on(handle).unwrap();
    assert_eq!(rep.step, 3);
    engine.close().unwrap();
}

#[test]
fn closed_engine_refuses_saves() {
    let f = fixture();
    let engine = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    engine.close().unwrap();
    let specs = [TensorSpec {
        name: "a".into(),
        dtype: Dtype::U8,
        shape: vec![4],
    }];
    let err = engine
        .begin_save(1, &specs, &json!(null), &SaveOptions::default())
        .unwrap_err();
    assert!(matches!(err, Error::Closed { .. }), "{err}");
}

#[test]
fn a_second_live_engine_on_the_same_job_is_busy() {
    let f = fixture();
    let _a = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap();
    let err = Engine::open(config(&f, IoChoice::Auto, DirectIo::Auto)).unwrap_err();
    assert!(matches!(err, Error::Busy { .. }), "{err}");
}
