//! Compressed data files through the engine and the operations: a save
//! with `compress` loads back bit-exact from storage, verifies, exports
//! as the plain file, and a changed or hostile frame is an error naming
//! the file, the chunk and its tensors.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::{Path, PathBuf};

use acp_core::format::{
    digest, FRAME_ENTRY_BYTES, PACKED_HEAD_BYTES, PACKED_MAGIC, QUICK_FRAME_VERSION,
};
use acp_core::ops::{export_safetensors, inspect, verify, Quiet};
use acp_core::{
    Compress, Dtype, Engine, EngineConfig, Error, ErrorKind, HostTensor, LoadRequest, SaveOptions,
    Source,
};
use serde_json::json;

const CHUNK: usize = 64 << 10;
const FILE: &str = "step-000000000007/rank-00000.safetensors";

/// Every dtype: a large bf16 "weight" drawn near zero, fp32 state, and a
/// small tensor of each other dtype with arbitrary bytes.
fn tensors() -> Vec<(String, Dtype, Vec<u64>, Vec<u8>)> {
    let mut x = 0x243F_6A88_85A3_08D3u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut out = Vec::new();
    let n = 150_000usize;
    let mut w = Vec::with_capacity(n * 2);
    for _ in 0..n {
        // A normal-ish value of sigma about 0.02: sum of uniforms.
        let u: f32 = (0..4)
            .map(|_| (next() >> 40) as f32 / (1u64 << 24) as f32)
            .sum::<f32>()
            - 2.0;
        let v = u * 0.035;
        w.extend_from_slice(&v.to_bits().to_le_bytes()[2..4]);
    }
    out.push(("w.bf16".to_owned(), Dtype::BF16, vec![n as u64], w));
    let m = 40_000usize;
    let mut s = Vec::with_capacity(m * 4);
    for _ in 0..m {
        let u = (next() >> 40) as f32 / (1u64 << 24) as f32;
        s.extend_from_slice(&(u * 1e-4).to_le_bytes());
    }
    out.push(("adam.exp_avg_sq".to_owned(), Dtype::F32, vec![m as u64], s));
    for d in Dtype::ALL {
        let bytes: Vec<u8> = (0..37 * d.size()).map(|_| next() as u8).collect();
        out.push((format!("all.{}", d.name()), d, vec![37], bytes));
    }
    out
}

type Tensors = [(String, Dtype, Vec<u64>, Vec<u8>)];

fn host(ts: &Tensors) -> Vec<HostTensor<'_>> {
    ts.iter()
        .map(|(name, dtype, shape, data)| HostTensor {
            name,
            dtype: *dtype,
            shape,
            data,
        })
        .collect()
}

struct Setup {
    _dir: tempfile::TempDir,
    root: PathBuf,
    shm: PathBuf,
    tensors: Vec<(String, Dtype, Vec<u64>, Vec<u8>)>,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let (root, shm) = (dir.path().join("ckpt"), dir.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    Setup {
        root,
        shm,
        tensors: tensors(),
        _dir: dir,
    }
}

fn engine(s: &Setup, root: &Path, compress: Compress) -> Engine {
    Engine::open(
        EngineConfig::new(root)
            .with_shm_dir(&s.shm)
            .with_job(format!("compressed-{compress:?}"))
            .with_ring_bytes(16 << 20)
            .with_chunk_bytes(CHUNK)
            .with_copy_threads(2)
            .with_compress(compress)
            // Compression alone: steps of the same tensors would otherwise
            // reference each other (`incremental.rs` covers both).
            .with_incremental(false)
            .with_release_on_close(true),
    )
    .unwrap()
}

fn save(s: &Setup, e: &Engine) {
    e.save(
        7,
        &host(&s.tensors),
        &json!({"lr": 0.5}),
        &SaveOptions::default(),
    )
    .unwrap()
    .wait()
    .unwrap();
}

/// The `metadata.acp` object of `root`'s index of `step`.
fn acp_meta(root: &Path, step: u64) -> serde_json::Value {
    let path = root.join(format!("step-{step:012}/model.safetensors.index.json"));
    let index: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    index["metadata"]["acp"].clone()
}

fn load_storage(e: &Engine) -> Result<acp_core::Checkpoint, Error> {
    e.load(&LoadRequest {
        step: Some(7),
        storage_only: true,
        ..LoadRequest::default()
    })
}

/// The reads of a compressed file's frames go through the engine's probe
/// like every other storage operation (they did not: an injected fault or
/// a throttle never reached them): an EIO on the first of them fails the
/// load with an I/O error naming the data file, and the next load, with
/// storage healed, gives the tensors.
#[test]
fn a_failed_read_of_a_compressed_file_is_an_io_error_naming_it() {
    use acp_core::storage::faults::FaultInjector;
    use std::sync::Arc;
    let s = setup();
    let e = engine(&s, &s.root, Compress::Zstd);
    save(&s, &e);
    e.close().unwrap();
    let faults = Arc::new(FaultInjector::counting());
    let e = Engine::open(
        EngineConfig::new(&s.root)
            .with_shm_dir(&s.shm)
            .with_job("compressed-read-fault")
            .with_ring_bytes(16 << 20)
            .with_chunk_bytes(CHUNK)
            .with_keep_restored(false)
            .with_faults(Arc::clone(&faults)),
    )
    .unwrap();
    // Where the first read of the data file comes in a load.
    let before = faults.ops();
    load_storage(&e).unwrap();
    let log = faults.log();
    let first = log
        .iter()
        .skip(usize::try_from(before).unwrap())
        .position(|l| l.starts_with("read ") && l.ends_with(FILE))
        .unwrap_or_else(|| panic!("no read of the data file was probed: {log:?}"));
    faults.arm(u64::try_from(first).unwrap(), libc::EIO, false);
    let err = load_storage(&e).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Io, "{err}");
    assert!(err.to_string().contains(FILE), "{err}");
    faults.heal();
    let ck = load_storage(&e).unwrap();
    for (name, _, _, data) in &s.tensors {
        assert_eq!(ck.tensor(name).unwrap().data, &data[..], "{name}");
    }
    e.close().unwrap();
}

#[test]
fn a_compressed_save_round_trips_verifies_and_exports_as_plain() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::Zstd);
    save(&s, &e);
    let file = s.root.join(FILE);
    let stored = std::fs::read(&file).unwrap();
    assert!(stored.starts_with(&PACKED_MAGIC));

    let acp = &acp_meta(&s.root, 7);
    assert_eq!(acp["format_version"], json!(QUICK_FRAME_VERSION));
    let entry = &acp["files"]["rank-00000.safetensors"];
    assert_eq!(entry["stored_size"], json!(stored.len()));
    let size = entry["size"].as_u64().unwrap();
    assert!((stored.len() as u64) < size, "{} of {size}", stored.len());

    // From storage, bit-exact, every dtype.
    let ck = load_storage(&e).unwrap();
    assert_eq!(ck.report().source, Source::Storage);
    for (name, _, _, data) in &s.tensors {
        assert_eq!(ck.tensor(name).unwrap().data, &data[..], "{name}");
    }
    assert_eq!(ck.values()["lr"], 0.5);
    drop(ck);

    let report = inspect(&s.root, Some(7)).unwrap();
    assert_eq!(report.files[0].codec, "zstd");
    assert_eq!(report.files[0].stored_size, stored.len() as u64);
    assert!(report.files[0].compressed_chunks > 0);
    assert!(verify(&s.root, Some(7), false, &Quiet).unwrap().ok);

    // The export is the plain file a save without compression writes.
    let out = s._dir.path().join("out.safetensors");
    export_safetensors(&s.root, Some(7), None, &out, false, &Quiet).unwrap();
    let plain_root = s._dir.path().join("plain");
    let p = engine(&s, &plain_root, Compress::None);
    save(&s, &p);
    let plain = std::fs::read(plain_root.join(FILE)).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), plain);
    let plain_meta = acp_meta(&plain_root, 7);
    assert_eq!(
        plain_meta["format_version"],
        json!(1),
        "plain steps stay v1"
    );
    assert!(plain_meta["files"]["rank-00000.safetensors"]
        .get("stored_size")
        .is_none());
    assert_eq!(
        inspect(&plain_root, Some(7)).unwrap().files[0].codec,
        "none"
    );
    p.close().unwrap();
    e.close().unwrap();
}

/// Frame `i`'s table entry: (offset, stored length).
fn frame(file: &[u8], i: usize) -> (usize, usize) {
    let at = PACKED_HEAD_BYTES as usize + i * FRAME_ENTRY_BYTES as usize;
    let u = |o: usize| u64::from_le_bytes(file[at + o..at + o + 8].try_into().unwrap()) as usize;
    (u(0), u(8))
}

#[test]
fn a_changed_frame_is_detected_and_named_by_every_reader() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::Zstd);
    save(&s, &e);
    let file = s.root.join(FILE);
    let mut bytes = std::fs::read(&file).unwrap();
    // Chunk 1 lies inside `adam.exp_avg_sq` (fp32 first, 160000 bytes).
    let (off, len) = frame(&bytes, 1);
    bytes[off + len / 2] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();

    let load = load_storage(&e).unwrap_err();
    let export = export_safetensors(
        &s.root,
        Some(7),
        None,
        &s._dir.path().join("o"),
        false,
        &Quiet,
    )
    .unwrap_err();
    for err in [&load, &export] {
        let Error::Corrupt {
            path,
            tensor,
            reason,
        } = err
        else {
            panic!("not Corrupt: {err}");
        };
        assert_eq!(path, &file, "{err}");
        assert_eq!(tensor.as_deref(), Some("adam.exp_avg_sq"), "{err}");
        assert!(reason.contains("compressed frame 1"), "{err}");
        assert!(reason.contains("check mismatch"), "{err}");
    }
    let report = verify(&s.root, Some(7), false, &Quiet).unwrap();
    assert!(!report.ok);
    let problems = &report.steps[0].problems;
    assert_eq!(problems.len(), 1, "{problems:?}");
    assert_eq!(problems[0].tensors, ["adam.exp_avg_sq"]);
    assert!(
        problems[0]
            .reason
            .contains(&format!("bytes {CHUNK}..{}", 2 * CHUNK)),
        "{problems:?}"
    );
    e.close().unwrap();
}

#[test]
fn a_changed_header_frame_fails_the_load_with_the_same_error() {
    // A load plans from the first frame's header bytes alone; a frame that
    // fails its check there is read again through the verified path, whose
    // error names it.
    let s = setup();
    let e = engine(&s, &s.root, Compress::Zstd);
    save(&s, &e);
    let file = s.root.join(FILE);
    let mut bytes = std::fs::read(&file).unwrap();
    let (off, _) = frame(&bytes, 0);
    // Past the frame's run and plane tables, inside its first plane: the
    // header's bytes.
    bytes[off + 64] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    for err in [
        load_storage(&e).unwrap_err(),
        e.open_load(&LoadRequest {
            step: Some(7),
            storage_only: true,
            ..LoadRequest::default()
        })
        .expect_err("a load planned from a changed header frame"),
    ] {
        let Error::Corrupt { path, reason, .. } = &err else {
            panic!("not Corrupt: {err}");
        };
        assert_eq!(path, &file, "{err}");
        assert!(reason.contains("compressed frame 0"), "{err}");
        assert!(reason.contains("check mismatch"), "{err}");
    }
    e.close().unwrap();
}

#[test]
fn a_hostile_frame_table_is_a_clear_error() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::Zstd);
    save(&s, &e);
    let file = s.root.join(FILE);
    let good = std::fs::read(&file).unwrap();
    let n = u32::from_le_bytes(good[12..16].try_into().unwrap()) as usize;
    let table =
        PACKED_HEAD_BYTES as usize..PACKED_HEAD_BYTES as usize + n * FRAME_ENTRY_BYTES as usize;
    // Frame 2 claims a length past the file, or to overlap frame 1; the
    // table is resealed, as a hostile writer would.
    for (what, field, value) in [
        ("past the file", 8, 1u64 << 50),
        ("overlap", 0, frame(&good, 1).0 as u64),
    ] {
        let mut bad = good.clone();
        let at = table.start + 2 * FRAME_ENTRY_BYTES as usize + field;
        bad[at..at + 8].copy_from_slice(&value.to_le_bytes());
        let d = digest(&bad[table.clone()]);
        bad[32..64].copy_from_slice(&d);
        std::fs::write(&file, &bad).unwrap();
        let err = load_storage(&e).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{what}: {err}");
        let msg = err.to_string();
        assert!(
            msg.contains(&file.display().to_string()) && msg.contains(what),
            "{what}: {msg}"
        );
        let report = verify(&s.root, Some(7), false, &Quiet).unwrap();
        assert!(!report.ok, "{what}");
    }
    e.close().unwrap();
}

#[test]
fn a_newer_compressed_file_is_unsupported() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::Zstd);
    save(&s, &e);
    let file = s.root.join(FILE);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[8..12].copy_from_slice(&99u32.to_le_bytes());
    std::fs::write(&file, &bytes).unwrap();
    let err = load_storage(&e).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    e.close().unwrap();
}

#[test]
fn ranks_commit_compressed_files_under_a_version_4_index() {
    let s = setup();
    let open = |rank| {
        Engine::open(
            EngineConfig::new(&s.root)
                .with_shm_dir(&s.shm)
                .with_job("compressed-ranks")
                .with_rank(rank)
                .with_world_size(2)
                .with_ring_bytes(16 << 20)
                .with_chunk_bytes(CHUNK)
                .with_compress(Compress::Zstd)
                .with_release_on_close(true)
                .with_commit_timeout(std::time::Duration::from_secs(20)),
        )
        .unwrap()
    };
    let (e0, e1) = (open(0), open(1));
    let (a, b) = s.tensors.split_at(1);
    let h0 = e0
        .save(7, &host(a), &json!(null), &SaveOptions::default())
        .unwrap();
    let h1 = e1
        .save(7, &host(b), &json!(null), &SaveOptions::default())
        .unwrap();
    h0.wait().unwrap();
    h1.wait().unwrap();
    let acp = &acp_meta(&s.root, 7);
    assert_eq!(acp["format_version"], json!(QUICK_FRAME_VERSION));
    for f in ["rank-00000.safetensors", "rank-00001.safetensors"] {
        assert!(acp["files"][f]["stored_size"].is_u64(), "{f}");
    }
    let ck = e0
        .load(&LoadRequest {
            step: Some(7),
            rank: Some(1),
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap();
    for (name, _, _, data) in b {
        assert_eq!(ck.tensor(name).unwrap().data, &data[..], "{name}");
    }
    drop(ck);
    assert!(verify(&s.root, Some(7), false, &Quiet).unwrap().ok);
    e0.close().unwrap();
    e1.close().unwrap();
}

#[test]
fn auto_writes_the_first_flush_plain_and_the_second_compressed() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::Auto);
    for step in [1, 2] {
        e.save(
            step,
            &host(&s.tensors),
            &json!(null),
            &SaveOptions::default(),
        )
        .unwrap()
        .wait()
        .unwrap();
    }
    let version = |step: u64| acp_meta(&s.root, step)["format_version"].clone();
    // The first measures the storage, the second the codec.
    assert_eq!(version(1), json!(1));
    assert_eq!(version(2), json!(QUICK_FRAME_VERSION));
    for step in [1, 2] {
        let ck = e
            .load(&LoadRequest {
                step: Some(step),
                storage_only: true,
                ..LoadRequest::default()
            })
            .unwrap();
        for (name, _, _, data) in &s.tensors {
            assert_eq!(ck.tensor(name).unwrap().data, &data[..], "{name}");
        }
    }
    e.close().unwrap();
}

/// A storage failure at each operation of a compressed flush fails that
/// save or not, and the newest committed step always loads bit-exact.
#[test]
fn a_failure_at_any_point_of_a_compressed_flush_loses_nothing_committed() {
    use acp_core::storage::faults::FaultInjector;
    use std::sync::Arc;
    let s = setup();
    let small: Vec<_> = s.tensors[1..].to_vec();
    let open = |faults: Option<&Arc<FaultInjector>>| {
        let mut c = EngineConfig::new(&s.root)
            .with_shm_dir(&s.shm)
            .with_job("compressed-faults")
            .with_ring_bytes(16 << 20)
            .with_chunk_bytes(CHUNK)
            .with_compress(Compress::Zstd)
            .with_release_on_close(true);
        if let Some(f) = faults {
            c = c.with_faults(Arc::clone(f));
        }
        Engine::open(c).unwrap()
    };
    let save_step = |e: &Engine, step: u64| {
        e.save(
            step,
            &host(&small),
            &json!({"step": step}),
            &SaveOptions::default(),
        )
        .unwrap()
        .wait()
    };
    let counting = Arc::new(FaultInjector::counting());
    let e = open(Some(&counting));
    save_step(&e, 1).unwrap();
    let before = counting.ops();
    save_step(&e, 2).unwrap();
    let per_flush = counting.ops() - before;
    e.close().unwrap();
    assert!(per_flush > 3, "{per_flush} storage operations per flush");
    let mut failed = 0;
    for n in 0..per_flush {
        let faults = Arc::new(FaultInjector::counting());
        let e = open(Some(&faults));
        faults.arm(n, libc::ENOSPC, false);
        let step = 10 + n;
        if save_step(&e, step).is_err() {
            failed += 1;
        }
        // A failed save fails `close` too; the engine lets go of the ring
        // when dropped.
        let _ = e.close();
        drop(e);
        let e = open(None);
        let ck = e
            .load(&LoadRequest {
                storage_only: true,
                ..LoadRequest::default()
            })
            .unwrap_or_else(|err| panic!("fault at operation {n}: {err}"));
        for (name, _, _, data) in &small {
            assert_eq!(
                ck.tensor(name).unwrap().data,
                &data[..],
                "fault at {n}: {name}"
            );
        }
        drop(ck);
        e.close().unwrap();
    }
    assert!(failed > 0, "no injected fault failed a save");
}

/// A compressed flush streams its frames through a buffer of a piece
/// (1 MiB here) and writes the head last: the file is byte for byte the
/// one [`pack_image`] makes of the plain image, for a file of one piece
/// and for one of several (whose head shares its first block with
/// frames written long before), under `O_DIRECT` and buffered.
#[test]
fn a_streamed_compressed_file_is_the_reference_packing_of_the_plain_image() {
    use acp_core::format::pack_image;
    use acp_core::DirectIo;
    let mut x = 0x1234_5678_9ABC_DEF1u64;
    let mut big = vec![0u8; 3 << 20];
    for (i, b) in big.iter_mut().enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // Random bytes in some chunks, few values in others.
        *b = if (i >> 16) % 3 == 0 {
            x as u8
        } else {
            (x & 3) as u8
        };
    }
    for extra in [false, true] {
        let s = setup();
        let mut ts = s.tensors.clone();
        if extra {
            ts.push((
                "big.u8".to_owned(),
                Dtype::U8,
                vec![big.len() as u64],
                big.clone(),
            ));
        }
        for direct in [DirectIo::Auto, DirectIo::Off] {
            let root = s._dir.path().join(format!("z-{direct:?}"));
            let plain_root = s._dir.path().join(format!("p-{direct:?}"));
            let open = |root: &Path, c: Compress| {
                Engine::open(
                    EngineConfig::new(root)
                        .with_shm_dir(&s.shm)
                        .with_job(format!("stream-{c:?}-{direct:?}"))
                        .with_ring_bytes(16 << 20)
                        .with_chunk_bytes(CHUNK)
                        .with_copy_threads(2)
                        .with_direct_io(direct)
                        .with_compress(c)
                        .with_release_on_close(true),
                )
                .unwrap()
            };
            for (r, c) in [(&root, Compress::Zstd), (&plain_root, Compress::None)] {
                let e = open(r, c);
                e.save(7, &host(&ts), &json!({"lr": 0.5}), &SaveOptions::default())
                    .unwrap()
                    .wait()
                    .unwrap();
                e.close().unwrap();
            }
            let plain = std::fs::read(plain_root.join(FILE)).unwrap();
            let stored = std::fs::read(root.join(FILE)).unwrap();
            let want = pack_image(Path::new("x"), &plain, CHUNK, 1).unwrap();
            assert!(
                stored == want,
                "extra {extra}, {direct:?}: {} vs {} bytes",
                stored.len(),
                want.len()
            );
            if extra {
                assert!(
                    stored.len() > 1 << 20,
                    "more than one piece: {}",
                    stored.len()
                );
            }
        }
    }
}
