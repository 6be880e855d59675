//! The fixture of the storage-read tests (`verify_while_reading.rs`,
//! `load_into.rs`): six tensors of 4 MiB in 1 MiB chunks, a 24 MiB file of
//! 24+ chunks (large enough for the hashing pool), committed as step 1.

#![allow(dead_code, reason = "each suite uses a different subset")]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use acp_core::{
    Compress, Dtype, Engine, EngineConfig, HostTensor, IoChoice, SaveOptions, TensorSpec,
};
use serde_json::json;

pub(crate) const CHUNK: usize = 1 << 20;
pub(crate) const TENSORS: usize = 6;
pub(crate) const TENSOR_BYTES: usize = 4 << 20;

/// An engine's settings over `root` with its ring in `shm`. A restore
/// from storage is not read again into a slot afterwards
/// (`with_keep_restored(false)`): these suites check what the load itself
/// leaves resident; `keep_restored.rs` turns it on.
pub(crate) fn config(root: &Path, shm: &Path, io: IoChoice, threads: usize) -> EngineConfig {
    EngineConfig::new(root)
        .with_keep_restored(false)
        .with_shm_dir(shm)
        .with_job("six-tensors")
        .with_ring_bytes(64 << 20)
        .with_ring_slots(2)
        .with_chunk_bytes(CHUNK)
        .with_queue_depth(4)
        .with_copy_threads(threads)
        .with_mlock(false)
        .with_io(io)
}

/// An engine over `root` with an empty ring of its own (in `dir`, named
/// by `tag`), its settings [`config`]'s as `cfg` changes them.
pub(crate) fn fresh_engine(
    root: &Path,
    dir: &Path,
    tag: &str,
    cfg: impl Fn(EngineConfig) -> EngineConfig,
) -> Engine {
    let shm = dir.join(format!("shm-{tag}"));
    std::fs::create_dir(&shm).unwrap();
    let engine = Engine::open(cfg(config(root, &shm, IoChoice::Auto, 2))).unwrap();
    assert!(engine.resident_steps().is_empty());
    engine
}

/// Readies `engine`'s free ring slots for the six tensors' image (their
/// memory made, as `reserve` before training does): a load from storage
/// then reads into a slot, which becomes resident. On a ring with no slot
/// ready (a new node's), a load reads into private memory or straight
/// into its destinations, and nothing becomes resident.
pub(crate) fn ready_slots(engine: &Engine) {
    let specs: Vec<TensorSpec> = (0..TENSORS)
        .map(|i| TensorSpec {
            name: name(i),
            dtype: Dtype::U8,
            shape: vec![TENSOR_BYTES as u64],
        })
        .collect();
    assert!(engine.reserve_json(&specs, r#"{"step": 1}"#).unwrap() > 0);
}

/// Tensor `i`'s bytes (no two chunks alike), made once per test binary:
/// the tests compare against them after every load, and a byte-by-byte
/// generator in an unoptimised build cost more than the loads it checks.
pub(crate) fn tensor(i: usize) -> Vec<u8> {
    static TENSOR_DATA: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    let all = TENSOR_DATA.get_or_init(|| {
        (0..TENSORS)
            .map(|i| {
                (0..TENSOR_BYTES)
                    .map(|j| u8::try_from((i * 131 + j * 7 + j / 4093) % 251).unwrap())
                    .collect()
            })
            .collect()
    });
    all[i].clone()
}

/// Tensor `i`'s name.
pub(crate) fn name(i: usize) -> String {
    format!("w.{i}")
}

/// Both I/O engines, hashing on the reading thread (1) and in a pool (2).
pub(crate) fn combos() -> Vec<(IoChoice, usize)> {
    vec![
        (IoChoice::Uring, 1),
        (IoChoice::Uring, 2),
        (IoChoice::Psync, 1),
        (IoChoice::Psync, 2),
    ]
}

/// A root under `dir` with step 1 committed (compressed or not); returns
/// it and the data file's path.
pub(crate) fn committed(dir: &Path, compress: Compress) -> (PathBuf, PathBuf) {
    let root = dir.join(format!("ckpt-{compress:?}"));
    let shm = dir.join(format!("shm-save-{compress:?}"));
    std::fs::create_dir(&shm).unwrap();
    let engine =
        Engine::open(config(&root, &shm, IoChoice::Auto, 2).with_compress(compress)).unwrap();
    let data: Vec<Vec<u8>> = (0..TENSORS).map(tensor).collect();
    save_six(&engine, 1, &data);
    engine.close().unwrap();
    let file = root.join("step-000000000001/rank-00000.safetensors");
    (root, file)
}

/// Saves `data` (one buffer per tensor, named [`name`]) as `step` with
/// `engine` and waits for its commit.
pub(crate) fn save_six(engine: &Engine, step: u64, data: &[Vec<u8>]) {
    save_six_with(engine, step, data, &SaveOptions::default());
}

/// [`save_six`] with `opts`.
pub(crate) fn save_six_with(engine: &Engine, step: u64, data: &[Vec<u8>], opts: &SaveOptions) {
    let names: Vec<String> = (0..data.len()).map(name).collect();
    let shape = [TENSOR_BYTES as u64];
    let host: Vec<HostTensor<'_>> = names
        .iter()
        .zip(data)
        .map(|(n, d)| HostTensor {
            name: n,
            dtype: Dtype::U8,
            shape: &shape,
            data: d,
        })
        .collect();
    engine
        .save(step, &host, &json!({"step": step}), opts)
        .unwrap()
        .wait()
        .unwrap();
}
