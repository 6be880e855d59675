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

fn shm_engine(root: &std::path::Path, shm: &std::path::Path, job: &str) -> Engine {
    Engine::open(
        EngineConfig::new(root)
            .with_job(job)
            .with_shm_dir(shm)
            .with_ring_bytes(8 << 20)
            .with_ring_slots(1)
            .with_shm_ttl(std::time::Duration::ZERO)
            .with_mlock(false),
    )
    .expect("the engine opens")
}

fn save_one(engine: &Engine, step: u64) {
    let data = vec![1u8; 4096];
    engine
        .save(
            step,
            &[HostTensor {
                name: "w",
                dtype: Dtype::U8,
                shape: &[4096],
                data: &data,
            }],
            &serde_json::json!({}),
            &SaveOptions::default(),
        )
        .expect("the save starts")
        .wait()
        .expect("the save commits");
}

#[test]
fn binary_lists_and_collects_rings_but_never_a_held_one() {
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let s = shm.as_os_str();
    let dead = shm_engine(&dir.path().join("a"), &shm, "dead");
    save_one(&dead, 1);
    dead.close().unwrap();
    drop(dead);
    // This process holds the ring: to the `acp` process it is a live holder.
    let live = shm_engine(&dir.path().join("b"), &shm, "live");
    save_one(&live, 2);

    let out = acp(&[
        "ls".as_ref(),
        "--shm".as_ref(),
        "--shm-dir".as_ref(),
        s,
        "--json".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rings = v["rings"].as_array().unwrap();
    assert_eq!(rings.len(), 2);
    let ring = |job: &str| {
        rings
            .iter()
            .find(|r| r["job"] == job)
            .cloned()
            .unwrap_or_else(|| panic!("no ring of {job} in {v}"))
    };
    assert_eq!(ring("dead")["live"], false);
    assert_eq!(ring("dead")["committed_steps"], serde_json::json!([1]));
    assert_eq!(ring("live")["live"], true);
    assert_eq!(ring("live")["owner_pid"], std::process::id());
    let text = acp(&["ls".as_ref(), "--shm".as_ref(), "--shm-dir".as_ref(), s]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("2 ring(s)"), "{text}");
    assert!(
        text.contains(&format!("pid {}", std::process::id())),
        "{text}"
    );

    // A root and --shm together is a usage error.
    let out = acp(&["ls".as_ref(), s, "--shm".as_ref()]);
    assert_eq!(out.status.code(), Some(2));
    let out = acp(&[
        "gc".as_ref(),
        s,
        "--keep".as_ref(),
        "1".as_ref(),
        "--force".as_ref(),
    ]);
    assert_eq!(out.status.code(), Some(2));

    let gc = |extra: &[&str]| {
        let mut args: Vec<&std::ffi::OsStr> = vec![
            "gc".as_ref(),
            "--shm".as_ref(),
            "--shm-dir".as_ref(),
            s,
            "--json".as_ref(),
        ];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        let out = acp(&args);
        assert_eq!(out.status.code(), Some(0), "{out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let dry = gc(&["--dry-run", "--force"]);
    assert_eq!(dry["dry_run"], true);
    assert!(dry["freed_bytes"].as_u64().unwrap() > 0);
    let v = gc(&["--force"]);
    let rows = v["rings"].as_array().unwrap();
    let row = |job: &str| rows.iter().find(|r| r["job"] == job).cloned().unwrap();
    assert_eq!(row("dead")["removed"], true);
    assert_eq!(row("live")["removed"], false, "{v}");
    assert!(row("live")["reason"]
        .as_str()
        .unwrap()
        .contains("live process"));
    assert_eq!(v["freed_bytes"], dry["freed_bytes"]);
    // The live ring still works; once its process lets go, it goes too.
    save_one(&live, 3);
    live.close().unwrap();
    drop(live);
    let v = gc(&[]);
    assert_eq!(v["rings"][0]["removed"], true, "{v}");
    assert!(!acp_core::staging::user_dir(&shm).exists());
}
