//! Several ranks saving one step: every rank's file durable before rank 0
//! commits; a silent rank is named in the timeout; every rank loads the same
//! step and can read the others' files.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::Path;
use std::time::Duration;

use acp_core::{Dtype, Engine, EngineConfig, Error, HostTensor, LoadRequest, SaveOptions, Source};
use serde_json::json;

fn engine(root: &Path, shm: &Path, rank: u32, world: u32) -> Engine {
    Engine::open(
        EngineConfig::new(root)
            .with_shm_dir(shm)
            .with_job("ranks")
            .with_rank(rank)
            .with_world_size(world)
            .with_ring_bytes(16 << 20)
            .with_commit_timeout(Duration::from_secs(20)),
    )
    .unwrap()
}

fn shard(rank: u32, step: u64) -> Vec<u8> {
    (0..100_000u32)
        .map(|i| (i as u8) ^ (rank as u8 * 17) ^ step as u8)
        .collect()
}

fn save(e: &Engine, rank: u32, step: u64) -> acp_core::SaveHandle {
    let data = shard(rank, step);
    let name = format!("layer.{rank}.w");
    e.save(
        step,
        &[HostTensor {
            name: &name,
            dtype: Dtype::U8,
            shape: &[data.len() as u64],
            data: &data,
        }],
        &json!({"rank": rank}),
        &SaveOptions::default(),
    )
    .unwrap()
}

#[test]
fn four_ranks_commit_one_step_together() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let world = 4;
    let engines: Vec<Engine> = (0..world).map(|r| engine(&root, &shm, r, world)).collect();
    for step in [10, 20] {
        let handles: Vec<_> = engines
            .iter()
            .enumerate()
            .map(|(r, e)| save(e, r as u32, step))
            .collect();
        for h in handles {
            h.wait().unwrap();
        }
    }
    let index: serde_json::Value = serde_json::from_slice(
        &std::fs::read(root.join("step-000000000020/model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(index["metadata"]["acp"]["world_size"], json!(4));
    assert_eq!(
        index["weight_map"]["layer.3.w"],
        json!("rank-00003.safetensors")
    );
    // No pending or commit directories are left behind.
    let leftovers: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with('.') && n != ".")
        .filter(|n| !n.starts_with(".latest"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    for (r, e) in engines.iter().enumerate() {
        let r = r as u32;
        assert_eq!(e.steps().unwrap(), vec![10, 20]);
        let own = e.load(&LoadRequest::default()).unwrap();
        assert_eq!(own.step(), 20);
        assert_eq!(own.report().source, Source::Ram);
        assert_eq!(
            own.tensor(&format!("layer.{r}.w")).unwrap().data,
            shard(r, 20).as_slice()
        );
        let next = (r + 1) % world;
        let other = e
            .load(&LoadRequest {
                rank: Some(next),
                ..LoadRequest::default()
            })
            .unwrap();
        assert_eq!(other.report().source, Source::Storage);
        assert_eq!(
            other.tensor(&format!("layer.{next}.w")).unwrap().data,
            shard(next, 20).as_slice()
        );
    }
}

#[test]
fn a_rank_that_never_reports_is_named_and_nothing_is_committed() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    // Rank 1 waits longer than rank 0, so it is still there when rank 0
    // gives up on rank 2.
    let short = |rank: u32| {
        Engine::open(
            EngineConfig::new(&root)
                .with_shm_dir(&shm)
                .with_job("silent")
                .with_rank(rank)
                .with_world_size(3)
                .with_ring_bytes(16 << 20)
                .with_commit_timeout(Duration::from_secs(if rank == 0 { 3 } else { 8 })),
        )
        .unwrap()
    };
    let (r0, r1) = (short(0), short(1));
    let h1 = save(&r1, 1, 1);
    // Let rank 1 report first, however slow this machine is right now.
    let reported = |root: &Path| {
        std::fs::read_dir(root).unwrap().flatten().any(|e| {
            let n = e.file_name().into_string().unwrap_or_default();
            n.starts_with(".pending-000000000001-r00001")
                && e.path().join("rank-00001.manifest.json").exists()
        })
    };
    let t0 = std::time::Instant::now();
    while !reported(&root) && t0.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(10));
    }
    let h0 = save(&r0, 0, 1);
    let e0 = h0.wait().unwrap_err();
    assert!(matches!(e0, Error::Timeout { .. }), "{e0}");
    assert!(e0.to_string().contains("ranks [2]"), "{e0}");
    let e1 = h1.wait().unwrap_err();
    assert!(e1.to_string().contains("rank 0"), "{e1}");
    assert!(r0.steps().unwrap().is_empty());
}
