//! Incremental steps through the engine and the operations: a step whose
//! chunks the previous step already holds references them instead of
//! writing them, loads back bit-exact (every dtype, plain and compressed),
//! verifies, exports as the plain file; a changed referenced chunk is an
//! error naming the file that holds it and the tensor; retention and gc
//! keep what a kept step references; a crash at any storage operation of
//! an incremental save leaves the previous step loadable; a hostile
//! reference is refused.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use acp_core::format::{
    hex, root_digest, unhex, FORMAT_VERSION, PACKED_MAGIC, QUICK_FRAME_VERSION,
};
use acp_core::ops::{export_safetensors, gc, inspect, verify, GcOptions, Quiet};
use acp_core::storage::faults::FaultInjector;
use acp_core::{
    Compress, Dtype, Engine, EngineConfig, Error, ErrorKind, HostTensor, LoadRequest, SaveOptions,
    SaveReport,
};
use serde_json::{json, Value};

const CHUNK: usize = 64 << 10;

type Tensors = Vec<(String, Dtype, Vec<u64>, Vec<u8>)>;

fn noise(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A frozen bf16 base (most of the bytes, the same every step), a small
/// fp32 adapter and a u8 tail that change with `step`, and a tensor of
/// every dtype, of which those at odd positions change with `step`.
fn tensors(step: u64) -> Tensors {
    let mut out: Tensors = Vec::new();
    out.push((
        "base.bf16".to_owned(),
        Dtype::BF16,
        vec![300_000],
        noise(7, 600_000),
    ));
    out.push((
        "adapter.f32".to_owned(),
        Dtype::F32,
        vec![5_000],
        noise(100 + step, 20_000),
    ));
    // Laid out last (1-byte elements): its chunks change with the step.
    out.push((
        "tail.u8".to_owned(),
        Dtype::U8,
        vec![100_000],
        noise(300 + step, 100_000),
    ));
    for (k, d) in Dtype::ALL.into_iter().enumerate() {
        let seed = if k % 2 == 1 { 1000 + step } else { 2000 };
        out.push((
            format!("all.{}", d.name()),
            d,
            vec![37],
            noise(seed + k as u64, 37 * d.size()),
        ));
    }
    out
}

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
    dir: tempfile::TempDir,
    root: PathBuf,
    shm: PathBuf,
}

fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let (root, shm) = (dir.path().join("ckpt"), dir.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    Setup { root, shm, dir }
}

fn config(s: &Setup, root: &Path, compress: Compress, incremental: bool) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(&s.shm)
        .with_job(format!(
            "incr-{compress:?}-{incremental}-{}",
            root.file_name().unwrap().to_string_lossy()
        ))
        .with_ring_bytes(16 << 20)
        .with_chunk_bytes(CHUNK)
        .with_copy_threads(2)
        .with_mlock(false)
        .with_compress(compress)
        .with_incremental(incremental)
        .with_release_on_close(true)
}

fn engine(s: &Setup, root: &Path, compress: Compress, incremental: bool) -> Engine {
    Engine::open(config(s, root, compress, incremental)).unwrap()
}

fn save(e: &Engine, step: u64, ts: &Tensors) -> SaveReport {
    e.save(
        step,
        &host(ts),
        &json!({"step": step}),
        &SaveOptions::default(),
    )
    .unwrap()
    .wait()
    .unwrap()
}

fn load(e: &Engine, step: u64) -> Result<acp_core::Checkpoint, Error> {
    e.load(&LoadRequest {
        step: Some(step),
        storage_only: true,
        ..LoadRequest::default()
    })
}

fn assert_loads(e: &Engine, step: u64, ts: &Tensors) {
    let ck = load(e, step).unwrap();
    for (name, _, _, data) in ts {
        assert_eq!(
            ck.tensor(name).unwrap().data,
            &data[..],
            "step {step}, {name}"
        );
    }
    assert_eq!(ck.values()["step"], step);
}

fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:012}"))
}

fn index_path(root: &Path, step: u64) -> PathBuf {
    step_dir(root, step).join("model.safetensors.index.json")
}

fn data_path(root: &Path, step: u64) -> PathBuf {
    step_dir(root, step).join("rank-00000.safetensors")
}

fn index(root: &Path, step: u64) -> Value {
    serde_json::from_slice(&std::fs::read(index_path(root, step)).unwrap()).unwrap()
}

fn entry(root: &Path, step: u64) -> Value {
    index(root, step)["metadata"]["acp"]["files"]["rank-00000.safetensors"].clone()
}

fn edit_index(root: &Path, step: u64, edit: impl FnOnce(&mut Value)) {
    let mut v = index(root, step);
    edit(&mut v);
    std::fs::write(index_path(root, step), serde_json::to_vec(&v).unwrap()).unwrap();
}

fn ref_steps(root: &Path, step: u64) -> Vec<u64> {
    let mut s: Vec<u64> = entry(root, step)["refs"]
        .as_array()
        .map(|a| a.iter().map(|r| r["step"].as_u64().unwrap()).collect())
        .unwrap_or_default();
    s.dedup();
    s
}

fn round_trip(compress: Compress) {
    let s = setup();
    let e = engine(&s, &s.root, compress, true);
    let (t1, t2) = (tensors(1), tensors(2));
    let r1 = save(&e, 1, &t1);
    assert_eq!((r1.reused_chunks, r1.reused_bytes), (0, 0));
    let first_version = index(&s.root, 1)["metadata"]["acp"]["format_version"].clone();
    let expect_first = if compress == Compress::None {
        1
    } else {
        QUICK_FRAME_VERSION
    };
    assert_eq!(
        first_version,
        json!(expect_first),
        "a full step keeps its format"
    );

    let r2 = save(&e, 2, &t2);
    assert!(r2.reused_chunks > 0, "{r2:?}");
    assert!(
        r2.reused_bytes >= 500_000,
        "the frozen base is reused: {r2:?}"
    );
    assert!(
        r2.stored_bytes + r2.reused_bytes <= r2.bytes + 4096,
        "only the new chunks are written: {r2:?}"
    );
    let meta = &index(&s.root, 2)["metadata"]["acp"];
    assert_eq!(meta["format_version"], json!(QUICK_FRAME_VERSION));
    assert_eq!(ref_steps(&s.root, 2), vec![1]);
    let file = std::fs::read(data_path(&s.root, 2)).unwrap();
    assert!(file.starts_with(&PACKED_MAGIC));
    assert_eq!(
        u32::from_le_bytes(file[8..12].try_into().unwrap()),
        QUICK_FRAME_VERSION
    );
    assert_eq!(file.len() as u64, r2.stored_bytes);

    // Both steps from storage, bit-exact, every dtype.
    assert_loads(&e, 1, &t1);
    assert_loads(&e, 2, &t2);
    assert!(verify(&s.root, None, true, &Quiet).unwrap().ok);
    let report = inspect(&s.root, Some(2)).unwrap();
    assert_eq!(report.files[0].reused_chunks, r2.reused_chunks);
    assert_eq!(report.files[0].reused_bytes, r2.reused_bytes);
    assert_eq!(report.files[0].references_steps, vec![1]);

    // Step 3 saves step 2's tensors again: what step 2 references is
    // referenced where it is held (step 1, one hop), the rest in step 2.
    let r3 = save(&e, 3, &t2);
    assert!(r3.reused_chunks > r2.reused_chunks, "{r3:?}");
    assert_eq!(ref_steps(&s.root, 3), vec![1, 2]);
    let e3 = entry(&s.root, 3);
    let e2 = entry(&s.root, 2);
    for r in e3["refs"].as_array().unwrap() {
        if r["step"] == 2 {
            let (first, count) = (r["first"].as_u64().unwrap(), r["count"].as_u64().unwrap());
            for c in first..first + count {
                let held_by_1 = e2["refs"].as_array().unwrap().iter().any(|q| {
                    let f = q["first"].as_u64().unwrap();
                    c >= f && c < f + q["count"].as_u64().unwrap()
                });
                assert!(
                    !held_by_1,
                    "chunk {c} of step 3 names step 2, which does not hold it"
                );
            }
        }
    }
    assert_loads(&e, 3, &t2);

    // The export of an incremental step is the plain file a full save of
    // the same step writes.
    let out = s.dir.path().join("out.safetensors");
    export_safetensors(&s.root, Some(3), None, &out, false, &Quiet).unwrap();
    let plain_root = s.dir.path().join("plain");
    let p = engine(&s, &plain_root, Compress::None, false);
    save(&p, 1, &t1);
    let full = save(&p, 3, &t2);
    assert_eq!((full.reused_chunks, full.reused_bytes), (0, 0));
    assert_eq!(
        index(&plain_root, 3)["metadata"]["acp"]["format_version"],
        json!(1),
        "incremental=false writes every step whole, plain"
    );
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(data_path(&plain_root, 3)).unwrap()
    );
    p.close().unwrap();
    e.close().unwrap();
}

#[test]
fn an_incremental_step_writes_only_new_chunks_and_round_trips_plain() {
    round_trip(Compress::None);
}

#[test]
fn an_incremental_step_writes_only_new_chunks_and_round_trips_compressed() {
    round_trip(Compress::Zstd);
}

#[test]
fn a_step_with_nothing_to_reuse_keeps_the_plain_format() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    save(&e, 1, &tensors(1));
    // Every byte differs: a different base.
    let mut t = tensors(2);
    t[0].3 = noise(99, 600_000);
    for x in &mut t[3..] {
        x.3 = noise(5 + x.3.len() as u64, x.3.len());
    }
    let r = save(&e, 2, &t);
    assert_eq!(r.reused_chunks, 0, "{r:?}");
    assert_eq!(
        index(&s.root, 2)["metadata"]["acp"]["format_version"],
        json!(1)
    );
    assert!(entry(&s.root, 2).get("stored_size").is_none());
    assert_loads(&e, 2, &t);
    e.close().unwrap();
}

/// The offset in step 1's plain file of byte `at` of tensor `name`.
fn file_offset(root: &Path, step: u64, name: &str, at: u64) -> u64 {
    let r = inspect(root, Some(step)).unwrap();
    let t = r.tensors.iter().find(|t| t.name == name).unwrap();
    r.files[0].data_start + t.offset + at
}

#[test]
fn a_changed_referenced_chunk_is_detected_and_named() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    save(&e, 1, &tensors(1));
    save(&e, 2, &tensors(2));
    let off = file_offset(&s.root, 1, "base.bf16", 300_000);
    let held = data_path(&s.root, 1);
    let mut bytes = std::fs::read(&held).unwrap();
    bytes[off as usize] ^= 0x40;
    std::fs::write(&held, &bytes).unwrap();

    let err = load(&e, 2).map(|_| ()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    let msg = err.to_string();
    assert!(msg.contains("base.bf16"), "{msg}");
    assert!(
        msg.contains("step-000000000001/rank-00000.safetensors"),
        "{msg}"
    );

    let v = verify(&s.root, Some(2), false, &Quiet).unwrap();
    assert!(!v.ok);
    let p = &v.steps[0].problems[0];
    assert_eq!(p.tensors, vec!["base.bf16".to_owned()], "{p:?}");
    assert!(p.reason.contains("step-000000000001"), "{p:?}");
    let out = s.dir.path().join("out.safetensors");
    let err = export_safetensors(&s.root, Some(2), None, &out, false, &Quiet).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    e.close().unwrap();
}

#[test]
fn a_changed_referenced_compressed_frame_is_detected() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::Zstd, true);
    save(&e, 1, &tensors(1));
    save(&e, 2, &tensors(2));
    let held = data_path(&s.root, 1);
    let mut bytes = std::fs::read(&held).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&held, &bytes).unwrap();
    let err = load(&e, 2).map(|_| ()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("step-000000000001"), "{err}");
    assert!(!verify(&s.root, Some(2), false, &Quiet).unwrap().ok);
    e.close().unwrap();
}

#[test]
fn retention_keeps_a_referenced_step_until_nothing_kept_references_it() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    let (t1, t2) = (tensors(1), tensors(2));
    save(&e, 1, &t1);
    save(&e, 2, &t2);
    // The referred step: retention drops step 1, step 2 references it.
    assert_eq!(e.retain(1, None).unwrap(), Vec::<u64>::new());
    assert_loads(&e, 2, &t2);
    assert_loads(&e, 1, &t1);

    // Both: a step that references nothing, and then neither is kept.
    let mut t3 = tensors(3);
    t3[0].3 = noise(33, 600_000);
    for x in &mut t3[3..] {
        x.3 = noise(77 + x.3.len() as u64, x.3.len());
    }
    let r3 = save(&e, 3, &t3);
    assert_eq!(r3.reused_chunks, 0, "{}", entry(&s.root, 3));
    assert_eq!(e.retain(1, None).unwrap(), vec![1, 2]);
    assert_loads(&e, 3, &t3);
    e.close().unwrap();
}

#[test]
fn retention_removes_a_referring_step_and_keeps_the_referred_one() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    let (t1, t2) = (tensors(1), tensors(2));
    save(&e, 100, &t1);
    save(&e, 150, &t2);
    assert_eq!(ref_steps(&s.root, 150), vec![100]);
    let mut t3 = tensors(3);
    t3[0].3 = noise(33, 600_000);
    save(&e, 200, &t3);
    // 100 is a milestone, 200 the newest: 150, which references 100, goes.
    assert_eq!(e.retain(1, Some(100)).unwrap(), vec![150]);
    assert_loads(&e, 100, &t1);
    assert_loads(&e, 200, &t3);
    assert!(verify(&s.root, None, true, &Quiet).unwrap().ok);
    e.close().unwrap();
}

/// Three tensors of several chunks each; `a`, `b` and `c` pick each one's
/// bytes (a seed), so a save that changes one references the others'
/// chunks in the steps that hold them.
fn abc(a: u64, b: u64, c: u64) -> Tensors {
    [("a", a), ("b", b), ("c", c)]
        .into_iter()
        .map(|(name, seed)| {
            let n = 4 * CHUNK;
            (name.to_owned(), Dtype::U8, vec![n as u64], noise(seed, n))
        })
        .collect()
}

#[test]
fn retention_keeps_what_a_step_kept_for_its_references_references_in_turn() {
    // Step 2 changes `a`, 3 changes `b`, 4 changes `a` again: step 4
    // references step 3 (for `b`) and step 1 (for `c`); step 3 references
    // step 2 (for `a`). Keeping step 4 alone keeps 3, so 2 as well: it was
    // removed, and step 3, listed as kept, failed to load.
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    let states = [abc(1, 1, 1), abc(2, 1, 1), abc(2, 3, 1), abc(4, 3, 1)];
    for (step, ts) in (1..).zip(&states) {
        save(&e, step, ts);
    }
    assert!(ref_steps(&s.root, 3).contains(&2), "{}", entry(&s.root, 3));
    assert!(ref_steps(&s.root, 4).contains(&3), "{}", entry(&s.root, 4));
    assert!(!ref_steps(&s.root, 4).contains(&2), "{}", entry(&s.root, 4));
    assert_eq!(e.retain(1, None).unwrap(), Vec::<u64>::new());
    for (step, ts) in (1..).zip(&states) {
        assert_loads(&e, step, ts);
    }
    e.close().unwrap();
    let r = gc_keeping_one(&s.root);
    assert_eq!(r.removed_steps, Vec::<u64>::new());
    assert!(verify(&s.root, None, true, &Quiet).unwrap().ok);
}

/// `acp gc --keep 1` of `root`.
fn gc_keeping_one(root: &Path) -> acp_core::ops::GcReport {
    let opts = GcOptions {
        keep_last: Some(1),
        ..GcOptions::default()
    };
    gc(root, &opts).unwrap()
}

#[test]
fn gc_keeps_a_referenced_step_and_says_so() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    save(&e, 1, &tensors(1));
    save(&e, 2, &tensors(2));
    e.close().unwrap();
    let r = gc_keeping_one(&s.root);
    assert_eq!(r.removed_steps, Vec::<u64>::new());
    assert_eq!(r.referenced_steps, vec![1]);
    assert_eq!(r.kept_steps, vec![1, 2]);
    assert!(verify(&s.root, None, true, &Quiet).unwrap().ok);
}

#[test]
fn a_referenced_step_removed_by_hand_makes_the_referring_step_corrupt() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    save(&e, 1, &tensors(1));
    save(&e, 2, &tensors(2));
    std::fs::remove_dir_all(step_dir(&s.root, 1)).unwrap();
    let err = load(&e, 2).map(|_| ()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("reference step 1"), "{err}");
    e.close().unwrap();
}

#[test]
fn a_referenced_step_cannot_be_overwritten() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    let t1 = tensors(1);
    save(&e, 1, &t1);
    save(&e, 2, &tensors(2));
    let opts = SaveOptions {
        overwrite: true,
        ..SaveOptions::default()
    };
    let err = e
        .save(1, &host(&tensors(5)), &json!({"step": 1}), &opts)
        .and_then(|h| h.wait())
        .unwrap_err();
    assert!(err.to_string().contains("cannot be overwritten"), "{err}");
    assert_loads(&e, 1, &t1);
    assert_loads(&e, 2, &tensors(2));
    e.close().unwrap();
}

/// Copies the directory tree `from` to `to` (files and directories only).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    let Ok(entries) = std::fs::read_dir(from) else {
        return;
    };
    for e in entries.flatten() {
        let ty = e.file_type().unwrap();
        let dst = to.join(e.file_name());
        if ty.is_dir() {
            copy_tree(&e.path(), &dst);
        } else if ty.is_file() {
            // A file removed meanwhile is simply absent from the copy.
            let _ = std::fs::copy(e.path(), &dst);
        }
    }
}

#[test]
fn a_crash_at_any_point_of_an_incremental_save_leaves_the_previous_step_loadable() {
    let s = setup();
    let faults = Arc::new(FaultInjector::counting());
    let snaps = s.dir.path().join("snaps");
    let e =
        Engine::open(config(&s, &s.root, Compress::None, true).with_faults(Arc::clone(&faults)))
            .unwrap();
    let (t1, t2) = (tensors(1), tensors(2));
    save(&e, 1, &t1);
    // The root as a crash before each storage operation of step 2 leaves
    // it.
    let taken = Arc::new(Mutex::new(Vec::new()));
    {
        let (root, snaps, taken) = (s.root.clone(), snaps.clone(), Arc::clone(&taken));
        faults.set_hook(move |n, op, _| {
            let to = snaps.join(format!("{n:04}"));
            copy_tree(&root, &to);
            taken.lock().unwrap().push((to, op.to_owned()));
        });
    }
    let r = save(&e, 2, &t2);
    assert!(r.reused_chunks > 0);
    faults.set_hook(|_, _, _| {});
    e.close().unwrap();
    let taken = taken.lock().unwrap().clone();
    assert!(taken.len() > 3, "{taken:?}");
    let mut committed_seen = false;
    for (snap, op) in &taken {
        let v = verify(snap, None, true, &Quiet).unwrap();
        assert!(v.ok, "crash before {op} ({}): {v:?}", snap.display());
        let steps: Vec<u64> = v.steps.iter().map(|s| s.step).collect();
        assert!(steps.contains(&1), "{steps:?}");
        committed_seen |= steps.contains(&2);
        // Step 1 loads whole from the crashed root.
        let shm = snap.join("shm");
        std::fs::create_dir_all(&shm).unwrap();
        let again = Engine::open(
            EngineConfig::new(snap)
                .with_shm_dir(&shm)
                .with_job("incr-crash")
                .with_ring_bytes(16 << 20)
                .with_chunk_bytes(CHUNK)
                .with_mlock(false)
                .with_persist_on_open(false)
                .with_release_on_close(true),
        )
        .unwrap();
        assert_loads(&again, 1, &t1);
        if steps.contains(&2) {
            assert_loads(&again, 2, &t2);
        }
        again.close().unwrap();
    }
    assert!(committed_seen, "some snapshot is after the commit");
}

#[test]
fn hostile_references_are_refused() {
    let s = setup();
    let e = engine(&s, &s.root, Compress::None, true);
    let (t1, t2) = (tensors(1), tensors(2));
    save(&e, 1, &t1);
    save(&e, 2, &t2);
    save(&e, 3, &t2);
    let file = |v: &mut Value| -> Value {
        v["metadata"]["acp"]["files"]["rank-00000.safetensors"].clone()
    };
    let set = |root: &Path, step: u64, f: &dyn Fn(&mut Value)| {
        edit_index(root, step, |v| {
            let mut ent = file(v);
            f(&mut ent);
            v["metadata"]["acp"]["files"]["rank-00000.safetensors"] = ent;
        });
    };
    let original = std::fs::read(index_path(&s.root, 3)).unwrap();
    let refused = |needle: &str| {
        let err = load(&e, 3).map(|_| ()).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert!(err.to_string().contains(needle), "`{needle}` not in {err}");
        std::fs::write(index_path(&s.root, 3), &original).unwrap();
    };
    // A file name that leaves the step directory.
    set(&s.root, 3, &|ent| {
        ent["refs"][0]["file"] = json!("../../etc/passwd")
    });
    refused("file name");
    // A reference to the step itself, or a later one.
    set(&s.root, 3, &|ent| ent["refs"][0]["step"] = json!(3));
    refused("not an earlier step");
    // A chain: step 2 only references the chunks step 1 holds.
    set(&s.root, 3, &|ent| {
        for r in ent["refs"].as_array_mut().unwrap() {
            r["step"] = json!(2);
        }
    });
    refused("itself");
    // A step that is not there.
    set(&s.root, 3, &|ent| ent["refs"][0]["step"] = json!(0));
    refused("reference step 0");
    // The referenced step records another digest for a referenced chunk
    // (its index resealed, so that step alone is consistent).
    let held = std::fs::read(index_path(&s.root, 1)).unwrap();
    let r = entry(&s.root, 3)["refs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["step"] == json!(1))
        .cloned()
        .unwrap();
    set(&s.root, 1, &|ent| {
        let i = usize::try_from(r["first"].as_u64().unwrap()).unwrap();
        ent["chunks"][i] = json!(hex(&[7u8; 32]));
        let digests: Vec<_> = ent["chunks"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| unhex(c.as_str().unwrap()).unwrap())
            .collect();
        ent["root"] = json!(hex(&root_digest(&digests)));
    });
    refused("another span or digest");
    std::fs::write(index_path(&s.root, 1), &held).unwrap();
    // Runs past the file's chunks, overlapping.
    set(&s.root, 3, &|ent| {
        ent["refs"][0]["count"] = json!(1_000_000)
    });
    refused("runs past");
    // The container's reference frames and the index disagree.
    set(&s.root, 3, &|ent| {
        let refs = ent["refs"].as_array_mut().unwrap();
        refs.remove(0);
    });
    refused("reference");
    // An index of a version before references with references.
    edit_index(&s.root, 3, |v| {
        v["metadata"]["acp"]["format_version"] = json!(2)
    });
    refused("references chunks of earlier steps in an index of format version 2");
    // A newer version is unsupported, not corrupt.
    edit_index(&s.root, 3, |v| {
        v["metadata"]["acp"]["format_version"] = json!(FORMAT_VERSION + 1);
    });
    let err = load(&e, 3).map(|_| ()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Unsupported, "{err}");
    std::fs::write(index_path(&s.root, 3), &original).unwrap();
    assert_loads(&e, 3, &t2);
    e.close().unwrap();
}

#[test]
fn ranks_commit_incremental_files_and_read_each_others() {
    let s = setup();
    let world = 2u32;
    let engines: Vec<Engine> = (0..world)
        .map(|r| {
            Engine::open(
                config(&s, &s.root, Compress::None, true)
                    .with_job("incr-ranks")
                    .with_rank(r)
                    .with_world_size(world)
                    .with_commit_timeout(std::time::Duration::from_secs(30)),
            )
            .unwrap()
        })
        .collect();
    // Each rank's own tensors: a frozen base and a trained tail per rank.
    let of = |r: u32, step: u64| -> Tensors {
        vec![
            (
                format!("base.{r}"),
                Dtype::BF16,
                vec![200_000],
                noise(10 + u64::from(r), 400_000),
            ),
            (
                format!("tail.{r}"),
                Dtype::U8,
                vec![50_000],
                noise(100 * step + u64::from(r), 50_000),
            ),
        ]
    };
    for step in [1, 2] {
        let states: Vec<Tensors> = (0..world).map(|r| of(r, step)).collect();
        let handles: Vec<_> = engines
            .iter()
            .zip(&states)
            .map(|(e, ts)| {
                e.save(step, &host(ts), &json!(null), &SaveOptions::default())
                    .unwrap()
            })
            .collect();
        for h in handles {
            h.wait().unwrap();
        }
    }
    let meta = &index(&s.root, 2)["metadata"]["acp"];
    assert_eq!(meta["format_version"], json!(QUICK_FRAME_VERSION));
    for r in 0..world {
        let name = format!("rank-{r:05}.safetensors");
        let refs = meta["files"][&name]["refs"].as_array().unwrap();
        assert!(
            refs.iter().all(|x| x["step"] == 1 && x["file"] == name),
            "{refs:?}"
        );
    }
    for (r, e) in engines.iter().enumerate() {
        let other = (r as u32 + 1) % world;
        let ck = e
            .load(&LoadRequest {
                step: Some(2),
                rank: Some(other),
                storage_only: true,
                ..LoadRequest::default()
            })
            .unwrap();
        for (name, _, _, data) in &of(other, 2) {
            assert_eq!(ck.tensor(name).unwrap().data, &data[..], "{name}");
        }
    }
    assert!(verify(&s.root, None, true, &Quiet).unwrap().ok);
    for e in engines {
        e.close().unwrap();
    }
}

/// A hostile pair of steps: step 1's index lists `r` files of `r` chunks
/// each (sparse, the same digests), and step 2 is a container of `r`
/// reference frames, chunk i referencing step 1's file i. Every check of
/// a reference passes; only the bytes (zeros) then differ from the digests.
fn many_referenced_files(root: &Path, r: usize) {
    use acp_core::format::{packed_head_of, ChunkRef, FileEntry, FrameCodec, FrameEntry, Index};
    const CB: u64 = 4096;
    let digests: Vec<[u8; 32]> = (0..r)
        .map(|i| *blake3::hash(i.to_string().as_bytes()).as_bytes())
        .collect();
    let chunks: Vec<String> = digests.iter().map(hex).collect();
    let size = r as u64 * CB;
    let entry = |refs: Vec<ChunkRef>, stored_size: Option<u64>| FileEntry {
        rank: 0,
        size,
        chunk_bytes: CB,
        chunks: chunks.clone(),
        root: hex(&root_digest(&digests)),
        stored_size,
        refs,
    };
    let (s1, s2) = (
        root.join("step-000000000001"),
        root.join("step-000000000002"),
    );
    std::fs::create_dir_all(&s1).unwrap();
    std::fs::create_dir_all(&s2).unwrap();
    let mut one = Index {
        step: 1,
        world_size: 1,
        format_version: QUICK_FRAME_VERSION,
        files: Default::default(),
        weight_map: Default::default(),
    };
    for k in 0..r {
        let name = format!("f{k:05}.safetensors");
        std::fs::File::create(s1.join(&name))
            .unwrap()
            .set_len(size)
            .unwrap();
        one.files.insert(name, entry(Vec::new(), None));
    }
    one.weight_map
        .insert("w".into(), "f00000.safetensors".into());
    std::fs::write(s1.join("model.safetensors.index.json"), one.to_json()).unwrap();
    let frames: Vec<FrameEntry> = digests
        .iter()
        .map(|d| FrameEntry {
            stored: 0,
            check: *d,
            codec: FrameCodec::Reference,
        })
        .collect();
    let container = packed_head_of(size, CB, &frames);
    std::fs::write(s2.join("rank-00000.safetensors"), &container).unwrap();
    let refs = (0..r as u64)
        .map(|i| ChunkRef {
            first: i,
            count: 1,
            step: 1,
            file: format!("f{i:05}.safetensors"),
        })
        .collect();
    let mut two = Index { step: 2, ..one };
    two.files = [(
        "rank-00000.safetensors".to_owned(),
        entry(refs, Some(container.len() as u64)),
    )]
    .into();
    two.weight_map = [("w".to_owned(), "rank-00000.safetensors".to_owned())].into();
    std::fs::write(s2.join("model.safetensors.index.json"), two.to_json()).unwrap();
}

#[test]
fn references_to_many_files_of_a_step_read_its_index_once() {
    // Each of the 400 referenced files made the load read and parse step
    // 1's index again (10 MB here): minutes of CPU, in effect a hang. Read
    // once, the load fails in well under a second; 60 s is the bound.
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir_all(&shm).unwrap();
    many_referenced_files(&root, 400);
    let (tx, rx) = std::sync::mpsc::channel();
    let (r2, s2) = (root.clone(), shm.clone());
    let spawned = std::thread::Builder::new()
        .name("many-refs".into())
        .spawn(move || {
            let engine = Engine::open(
                EngineConfig::new(&r2)
                    .with_shm_dir(&s2)
                    .with_job("many-refs")
                    .with_ring_bytes(4 << 20)
                    .with_chunk_bytes(4096)
                    .with_mlock(false),
            )
            .unwrap();
            let got = engine.load(&LoadRequest {
                step: Some(2),
                storage_only: true,
                ..LoadRequest::default()
            });
            let _ = tx.send(got.map(|c| c.step()).map_err(|e| e.to_string()));
        });
    spawned.unwrap();
    let err = rx
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("the load of step 2 still runs after 60 s")
        .unwrap_err();
    assert!(err.contains("digest mismatch"), "{err}");
    assert!(err.contains("f00000.safetensors"), "{err}");
}

#[test]
fn retention_removes_a_referencing_step_before_the_step_it_references() {
    // Steps 2 and 3 reference step 1's chunks; step 4 shares nothing, so
    // keep_last = 1 retires 1, 2 and 3 together. Removed oldest first, a
    // reader (or a crash) between two removals found step 2 or 3 listed
    // with step 1 gone: a good step reported corrupt (a hunt running
    // `acp gc --keep 1` beside loads and `acp verify`).
    let s = setup();
    let faults = Arc::new(FaultInjector::counting());
    let snaps = s.dir.path().join("snaps");
    let e = Engine::open(
        config(&s, &s.root, Compress::None, true)
            .with_keep_last(1)
            .with_faults(Arc::clone(&faults)),
    )
    .unwrap();
    let t = tensors(1);
    for step in 1..=3 {
        save(&e, step, &t);
    }
    let fresh: Tensors = vec![("x".to_owned(), Dtype::U8, vec![300_000], noise(4, 300_000))];
    let taken = Arc::new(Mutex::new(Vec::new()));
    {
        let (root, snaps, taken) = (s.root.clone(), snaps.clone(), Arc::clone(&taken));
        faults.set_hook(move |n, op, path| {
            if op.contains("rename") || op.contains("remove") {
                let to = snaps.join(format!("{n:04}"));
                copy_tree(&root, &to);
                taken
                    .lock()
                    .unwrap()
                    .push((to, format!("{op} {}", path.display())));
            }
        });
    }
    save(&e, 4, &fresh);
    e.close().unwrap();
    faults.set_hook(|_, _, _| {});
    let taken = taken.lock().unwrap().clone();
    let mut retiring = 0;
    for (snap, op) in &taken {
        let v = verify(snap, None, true, &Quiet).unwrap();
        assert!(v.ok, "before {op} ({}): {v:?}", snap.display());
        let steps: Vec<u64> = v.steps.iter().map(|s| s.step).collect();
        if steps.contains(&4) && steps.len() > 1 {
            retiring += 1;
        }
    }
    assert!(
        retiring >= 2,
        "snapshots while retiring: {retiring} of {taken:?}"
    );
    assert_eq!(
        std::fs::read_dir(&s.root)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("step-"))
            .count(),
        1
    );
}

#[test]
fn auto_measures_the_ratio_on_the_chunks_it_writes_not_those_it_reuses() {
    // 15 chunks of random bytes, 14 of them the same at every step: an
    // incremental step writes one chunk (which does not shrink) and
    // references 14. Counted over the whole image, the ratio was ~1/15,
    // and Compress::Auto chose zstd for bytes that do not compress.
    let s = setup();
    let e = Engine::open(config(&s, &s.root, Compress::Zstd, true).with_persist_on_open(false))
        .unwrap();
    let frozen = noise(11, 14 * CHUNK);
    for step in 1..=3u64 {
        let mut bytes = frozen.clone();
        bytes.extend(noise(100 + step, CHUNK));
        let ts: Tensors = vec![("x".to_owned(), Dtype::U8, vec![bytes.len() as u64], bytes)];
        let r = save(&e, step, &ts);
        if step > 1 {
            assert!(r.reused_chunks >= 13, "{r:?}");
            let ratio = e.auto_ratio().unwrap();
            assert!(ratio > 0.9, "step {step}: measured ratio {ratio}");
        }
    }
}
