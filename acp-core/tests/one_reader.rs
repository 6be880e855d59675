//! Every path that reads a committed file (a whole load, another rank's
//! tensors alone, `verify`, `export`) checks it with the same reader, so a
//! changed byte is reported alike everywhere: naming the file and every
//! tensor of the chunk that holds it.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::time::Duration;

use acp_core::ops::{export_safetensors, verify, Quiet};
use acp_core::{Dtype, Engine, EngineConfig, Error, HostTensor, LoadRequest, SaveOptions};
use serde_json::json;

const CHUNK: u64 = 64 << 10;

#[test]
fn a_changed_byte_is_named_alike_by_every_reader() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let open = |rank| {
        Engine::open(
            EngineConfig::new(&root)
                .with_shm_dir(&shm)
                .with_job("one-reader")
                .with_rank(rank)
                .with_world_size(2)
                .with_ring_bytes(16 << 20)
                .with_chunk_bytes(CHUNK as usize)
                .with_commit_timeout(Duration::from_secs(20)),
        )
        .unwrap()
    };
    let (e0, e1) = (open(0), open(1));
    // Rank 1's file: `a` ends, and `s0`, `s1` and the start of `z` sit, in
    // the chunk 196608..262144.
    let sizes = [
        ("a", 200 << 10),
        ("s0", 2 << 10),
        ("s1", 2 << 10),
        ("z", 100 << 10),
    ];
    let data: Vec<Vec<u8>> = (0..4u8)
        .zip(sizes)
        .map(|(i, (_, n))| vec![i + 1; n])
        .collect();
    let shapes: Vec<[u64; 1]> = sizes.iter().map(|(_, n)| [*n as u64]).collect();
    let tensors: Vec<HostTensor<'_>> = sizes
        .iter()
        .zip(&data)
        .zip(&shapes)
        .map(|(((name, _), d), shape)| HostTensor {
            name,
            dtype: Dtype::U8,
            shape,
            data: d,
        })
        .collect();
    let h1 = e1
        .save(3, &tensors, &json!(null), &SaveOptions::default())
        .unwrap();
    let one = [0u8; 8];
    let h0 = e0
        .save(
            3,
            &[HostTensor {
                name: "r0",
                dtype: Dtype::U8,
                shape: &[8],
                data: &one,
            }],
            &json!(null),
            &SaveOptions::default(),
        )
        .unwrap();
    h0.wait().unwrap();
    h1.wait().unwrap();

    let file = root.join("step-000000000003/rank-00001.safetensors");
    let s1 = e0
        .load(&LoadRequest {
            step: Some(3),
            rank: Some(1),
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap()
        .entries()
        .iter()
        .find(|e| e.name == "s1")
        .unwrap()
        .clone();
    let at = s1.offset + 5;
    let chunk_start = at / CHUNK * CHUNK;
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[usize::try_from(at).unwrap()] ^= 0x5a;
    std::fs::write(&file, &bytes).unwrap();

    let load = |tensors: Option<Vec<String>>| {
        e0.load(&LoadRequest {
            step: Some(3),
            rank: Some(1),
            storage_only: true,
            tensors,
            ..LoadRequest::default()
        })
        .unwrap_err()
    };
    let whole = load(None);
    let some = load(Some(vec!["s1".to_owned()]));
    let exported = export_safetensors(
        &root,
        Some(3),
        Some(1),
        &t.path().join("out.safetensors"),
        false,
        &Quiet,
    )
    .unwrap_err();
    let range = format!("bytes {chunk_start}..{}", chunk_start + CHUNK);
    for e in [&whole, &some, &exported] {
        let Error::Corrupt { path, tensor, .. } = e else {
            panic!("not Corrupt: {e}");
        };
        assert_eq!(path, &file, "{e}");
        assert_eq!(tensor.as_deref(), Some("a"), "{e}");
        let msg = e.to_string();
        assert!(msg.contains(&range), "{msg}");
        for name in ["a", "s0", "s1", "z"] {
            assert!(
                msg.contains(&format!("`{name}`")),
                "{name} not named: {msg}"
            );
        }
    }
    // One reader, one message.
    assert_eq!(whole.to_string(), some.to_string());
    assert_eq!(whole.to_string(), exported.to_string());

    let report = verify(&root, Some(3), false, &Quiet).unwrap();
    let problems = &report.steps[0].problems;
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].tensors, ["a", "s0", "s1", "z"]);
    assert!(problems[0].reason.contains(&range), "{problems:?}");
    e0.close().unwrap();
    e1.close().unwrap();
}
