//! Saves from a kept plan (`Engine::save_plan`, `begin_save_planned`) write
//! the same file as a save planned afresh, under each step's own header.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::collections::BTreeMap;

use acp_core::{
    Checkpoint, Dtype, Engine, EngineConfig, ErrorKind, LoadRequest, SaveOptions, Staging,
    TensorSpec,
};

fn specs() -> Vec<TensorSpec> {
    vec![
        TensorSpec {
            name: "b".into(),
            dtype: Dtype::U8,
            shape: vec![3],
        },
        TensorSpec {
            name: "w".into(),
            dtype: Dtype::F32,
            shape: vec![2, 3],
        },
        TensorSpec {
            name: "empty".into(),
            dtype: Dtype::F64,
            shape: vec![0],
        },
    ]
}

fn data(seed: u8) -> Vec<Vec<u8>> {
    vec![vec![seed; 3], vec![seed.wrapping_add(1); 24], vec![]]
}

fn opts(extra: &[(&str, &str)]) -> SaveOptions {
    SaveOptions {
        extra_metadata: extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect::<BTreeMap<_, _>>(),
        ..SaveOptions::default()
    }
}

/// An engine over a new root (`dir/ckpt`) and ring in `dir`.
fn open_engine(dir: &tempfile::TempDir) -> Engine {
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let cfg = EngineConfig::new(dir.path().join("ckpt"))
        .with_shm_dir(&shm)
        .with_job("test")
        .with_ring_bytes(8 << 20);
    Engine::open(cfg).unwrap()
}

/// Copies `srcs` into staging `s` of `step`, commits it and loads it back
/// from storage.
fn commit_and_load(engine: &Engine, step: u64, mut s: Staging, srcs: &[&[u8]]) -> Checkpoint {
    s.copy_from(srcs).unwrap();
    s.finish().wait().unwrap();
    engine
        .load(&LoadRequest {
            step: Some(step),
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap()
}

#[test]
fn a_planned_save_writes_what_a_fresh_one_writes() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(&dir);
    let root = dir.path().join("ckpt");
    let values = r#"{"lr":0.5,"tags":["a",null]}"#;
    let plan = engine.save_plan(&specs(), values).unwrap();
    assert_eq!(plan.entries().len(), 3);
    let file = |step: u64| {
        std::fs::read(root.join(format!("step-{step:012}/rank-00000.safetensors"))).unwrap()
    };
    // Steps of different lengths and extra metadata: each header is its own.
    for (step, seed, extra) in [
        (1u64, 1u8, vec![]),
        (123_456_789, 2, vec![("format", "pt")]),
    ] {
        let srcs = data(seed);
        let srcs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
        let mut planned = engine
            .begin_save_planned(step, &plan, &opts(&extra))
            .unwrap()
            .unwrap();
        planned.copy_from(&srcs).unwrap();
        planned.finish().wait().unwrap();
        let mut fresh = engine
            .begin_save_json(step + 1, &specs(), values, &opts(&extra))
            .unwrap()
            .unwrap();
        fresh.copy_from(&srcs).unwrap();
        fresh.finish().wait().unwrap();
        let (a, b) = (file(step), file(step + 1));
        // The same bytes but for the step in the header.
        let want = String::from_utf8_lossy(&b).replace(
            &format!("\"acp.step\":\"{}\"", step + 1),
            &format!("\"acp.step\":\"{step}\""),
        );
        assert_eq!(String::from_utf8_lossy(&a), want);
        let ck = engine
            .load(&LoadRequest {
                step: Some(step),
                storage_only: true,
                ..LoadRequest::default()
            })
            .unwrap();
        assert_eq!(ck.tensor("w").unwrap().data, vec![seed + 1; 24].as_slice());
        assert_eq!(ck.values()["lr"], serde_json::json!(0.5));
    }
    // The input is checked when the plan is made.
    let twice = [specs(), specs()].concat();
    let e = engine.save_plan(&twice, values).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invalid);
    assert!(e.to_string().contains("given twice"), "{e}");
    let e = engine.save_plan(&specs(), "{").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invalid);
    engine.close().unwrap();
}

#[test]
fn a_header_that_grows_past_the_alignment_moves_the_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(&dir);
    let (short, long) = (0u64, 10_000_000_000u64);
    let offset = |step: u64, values: &str| {
        let s = engine
            .begin_save_json(step, &specs(), values, &SaveOptions::default())
            .unwrap()
            .unwrap();
        s.entries()[0].offset
    };
    // Values of a length that puts the step-0 header just under a multiple
    // of 4096 bytes, so that a longer step moves the data start.
    let values = (3800..4096)
        .map(|n| format!("\"{}\"", "x".repeat(n)))
        .find(|v| offset(short, v) != offset(long, v))
        .unwrap();
    let plan = engine.save_plan(&specs(), &values).unwrap();
    for step in [short, long] {
        let want = offset(step, &values);
        let srcs = data(9);
        let srcs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
        let s = engine
            .begin_save_planned(step, &plan, &SaveOptions::default())
            .unwrap()
            .unwrap();
        assert_eq!(s.entries()[0].offset, want);
        let ck = commit_and_load(&engine, step, s, &srcs);
        assert_eq!(ck.tensor("w").unwrap().data, vec![10; 24].as_slice());
    }
    engine.close().unwrap();
}

#[test]
fn a_planned_save_with_other_values_writes_them() {
    let dir = tempfile::tempdir().unwrap();
    let engine = open_engine(&dir);
    let plan = engine.save_plan(&specs(), r#"{"step":1}"#).unwrap();
    // A step counter, then values long enough to move the data section.
    let long = format!(r#"{{"step":3,"log":"{}"}}"#, "y".repeat(10_000));
    for (step, values) in [(2u64, r#"{"step":2}"#.to_owned()), (3, long)] {
        let srcs = data(u8::try_from(step).unwrap());
        let srcs: Vec<&[u8]> = srcs.iter().map(Vec::as_slice).collect();
        let s = engine
            .begin_save_planned_values(step, &plan, &values, &SaveOptions::default())
            .unwrap()
            .unwrap();
        let ck = commit_and_load(&engine, step, s, &srcs);
        let want: serde_json::Value = serde_json::from_str(&values).unwrap();
        assert_eq!(ck.values(), &want, "step {step}");
        for (i, name) in ["b", "w", "empty"].iter().enumerate() {
            assert_eq!(
                ck.tensor(name).unwrap().data,
                srcs[i],
                "step {step}, {name}"
            );
        }
    }
    let e = engine
        .begin_save_planned_values(4, &plan, "{", &SaveOptions::default())
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invalid);
    engine.close().unwrap();
}
