//! The `acp` binary (feature `cli`) on a real checkpoint: exit codes, JSON.
#![cfg(feature = "cli")]

use std::process::Command;

use acp_core::{Dtype, Engine, EngineConfig, HostTensor, SaveOptions};

fn acp(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_acp"))
        .args(args)
        .output()
        .expect("the acp binary runs")
}

#[test]
fn binary_lists_verifies_and_refuses_a_flipped_byte() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let engine = Engine::open(
        EngineConfig::new(&root)
            .with_job("bin")
            .with_shm_dir(&shm)
            .with_ring_bytes(16 << 20)
            .with_mlock(false),
    )
    .unwrap();
    let data = vec![7u8; 4096];
    for step in [1, 2] {
        engine
            .save(
                step,
                &[HostTensor {
                    name: "w",
                    dtype: Dtype::U8,
                    shape: &[4096],
                    data: &data,
                }],
                &serde_json::json!({"step": step}),
                &SaveOptions::default(),
            )
            .unwrap()
            .wait()
            .unwrap();
    }
    engine.close().unwrap();
    let r = root.as_os_str();
    let out = acp(&[r, r]); // no such subcommand
    assert_eq!(out.status.code(), Some(2));
    let out = acp(&["ls".as_ref(), r, "--json".as_ref()]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["latest"], 2);
    let out = acp(&["verify".as_ref(), r, "--all".as_ref()]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let file = root.join("step-000000000001/rank-00000.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let out = acp(&["verify".as_ref(), r, "--all".as_ref()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stdout).contains("`w`"));
    let dst = dir.path().join("x.safetensors");
    let out = acp(&[
        "export".as_ref(),
        r,
        dst.as_os_str(),
        "--step".as_ref(),
        "1".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!dst.exists());
    let out = acp(&["inspect".as_ref(), r, "--step".as_ref(), "7".as_ref()]);
    assert_eq!(out.status.code(), Some(3));
}
