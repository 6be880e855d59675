//! The operations on real checkpoints made by the engine, intact and broken.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::json;

use super::*;
use crate::storage::faults::FaultInjector;
use crate::{Dtype, Engine, EngineConfig, HostTensor, SaveOptions};

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
    shm: PathBuf,
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

fn config(f: &Fixture) -> EngineConfig {
    EngineConfig::new(&f.root)
        .with_job("ops-test")
        .with_shm_dir(&f.shm)
        .with_ring_bytes(16 << 20)
        .with_chunk_bytes(4096)
        .with_mlock(false)
        // Whole steps: these tests read the data files as plain
        // safetensors (`tests/incremental.rs` covers the references).
        .with_incremental(false)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Saves `w` (F32 ×1024, value `scale`·i) and `b` (I32 ×8) with values.
fn save(engine: &Engine, step: u64, scale: f32) {
    let w: Vec<f32> = (0..1024).map(|i| i as f32 * scale).collect();
    let w = f32s(&w);
    let b: Vec<u8> = (0..8i32).flat_map(|x| x.to_le_bytes()).collect();
    engine
        .save(
            step,
            &[
                HostTensor {
                    name: "w",
                    dtype: Dtype::F32,
                    shape: &[32, 32],
                    data: &w,
                },
                HostTensor {
                    name: "b",
                    dtype: Dtype::I32,
                    shape: &[8],
                    data: &b,
                },
            ],
            &json!({"step": step, "lr": 0.1}),
            &SaveOptions::default(),
        )
        .unwrap()
        .wait()
        .unwrap();
}

fn with_steps(f: &Fixture, steps: &[u64]) {
    let engine = Engine::open(config(f)).unwrap();
    for &s in steps {
        save(&engine, s, s as f32);
    }
    engine.close().unwrap();
}

fn data_file(root: &Path, step: u64) -> PathBuf {
    root.join(crate::storage::local::step_dir_name(step))
        .join(crate::format::data_file_name(0))
}

/// Flips one byte inside tensor `w` of `step`.
fn flip(root: &Path, step: u64) {
    let path = data_file(root, step);
    let report = inspect(root, Some(step)).unwrap();
    let w = report.tensors.iter().find(|t| t.name == "w").unwrap();
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[usize::try_from(w.offset + 100).unwrap()] ^= 0x40;
    std::fs::write(&path, bytes).unwrap();
}

#[test]
fn list_shows_steps_and_residency() {
    let f = fixture();
    with_steps(&f, &[1, 2]);
    let r = list(&f.root, Some("ops-test"), &f.shm).unwrap();
    assert_eq!(r.steps.iter().map(|s| s.step).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(r.latest, Some(2));
    assert_eq!(r.steps[1].tensors, 2);
    assert_eq!(r.steps[1].world_size, 1);
    assert!(r.steps[1].bytes > 4096);
    // Two slots, the newest step (at least) resident; nobody holds them now.
    assert!(r.steps[1].resident_ranks.contains(&0), "{r:?}");
    assert!(r.slots.iter().all(|s| !s.locked));
    assert!(r.resident_only.is_empty());
    // Another job id sees no slot.
    let other = list(&f.root, None, &f.shm).unwrap();
    assert!(other.slots.is_empty());
    assert!(text::list(&r).contains("latest"));
    let e = list(&f.root.join("nope"), None, &f.shm).unwrap_err();
    assert_eq!(exit_code(&e), 3);
}

#[test]
fn shm_names_match_the_engine() {
    let f = fixture();
    let engine = Engine::open(config(&f)).unwrap();
    assert!(crate::staging::slot_path(&f.shm, &resident::shm_prefix("ops-test", 0), 0).exists());
    // A live engine holds the lock.
    let slots = resident(&f.shm, "ops-test", Some(0)).unwrap();
    assert_eq!(slots.len(), 2);
    assert!(slots.iter().all(|s| s.locked), "{slots:?}");
    engine.close().unwrap();
    drop(engine);
    let slots = resident(&f.shm, "ops-test", Some(0)).unwrap();
    assert!(slots.iter().all(|s| !s.locked), "{slots:?}");
    // The default job id is the canonical root.
    let canonical = std::fs::canonicalize(&f.root).unwrap();
    assert_eq!(job_id(&canonical, None), canonical.to_string_lossy());
}

#[test]
fn inspect_lists_tensors_and_values() {
    let f = fixture();
    with_steps(&f, &[5]);
    let r = inspect(&f.root, None).unwrap();
    assert_eq!(r.step, 5);
    assert_eq!(r.format_version, crate::format::PLAIN_VERSION);
    let w = r.tensors.iter().find(|t| t.name == "w").unwrap();
    assert_eq!(
        (w.dtype.as_str(), w.shape.as_slice(), w.bytes),
        ("F32", &[32u64, 32][..], 4096)
    );
    assert_eq!(r.files[0].values, json!({"step": 5, "lr": 0.1}));
    assert_eq!(r.files[0].metadata["acp.step"], "5");
    assert!(!r.files[0].metadata.contains_key("acp.values"));
    assert_eq!(r.files[0].root.len(), 64);
    assert!(text::inspect(&r).contains("F32"));
    assert_eq!(exit_code(&inspect(&f.root, Some(9)).unwrap_err()), 3);
}

#[test]
fn verify_finds_a_flipped_byte_and_names_the_tensor() {
    let f = fixture();
    with_steps(&f, &[1, 2]);
    let ok = verify(&f.root, None, true, &Quiet).unwrap();
    assert!(ok.ok, "{ok:?}");
    assert_eq!(ok.steps.len(), 2);
    flip(&f.root, 1);
    let bad = verify(&f.root, None, true, &Quiet).unwrap();
    assert!(!bad.ok);
    assert!(bad.steps[1].ok);
    let p = &bad.steps[0].problems;
    assert_eq!(p.len(), 1, "{p:?}");
    assert!(p[0].file.ends_with("rank-00000.safetensors"), "{p:?}");
    assert_eq!(p[0].tensors, ["w"]);
    // Only step 2 asked: intact.
    assert!(verify(&f.root, Some(2), false, &Quiet).unwrap().ok);
    let text = text::verify(&bad);
    assert!(text.contains("`w`") && text.contains("FAILED"), "{text}");
}

#[test]
fn verify_reports_a_truncated_or_missing_file() {
    let f = fixture();
    with_steps(&f, &[1]);
    let path = data_file(&f.root, 1);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 1]).unwrap();
    let r = verify(&f.root, Some(1), false, &Quiet).unwrap();
    assert!(!r.ok);
    assert!(
        r.steps[0].problems[0].reason.contains("the index says"),
        "{r:?}"
    );
    std::fs::remove_file(&path).unwrap();
    let r = verify(&f.root, Some(1), false, &Quiet).unwrap();
    assert!(r.steps[0].problems[0].reason.contains("missing"), "{r:?}");
}

#[test]
fn verify_names_a_mapped_tensor_the_header_lacks() {
    let f = fixture();
    with_steps(&f, &[1]);
    edit_index(&f.root, 1, |doc| {
        doc["weight_map"]["ghost"] = json!(crate::format::data_file_name(0));
    });
    let r = verify(&f.root, Some(1), false, &Quiet).unwrap();
    assert!(!r.ok, "{r:?}");
    let p = &r.steps[0].problems;
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].tensors, ["ghost"]);
    assert!(p[0].reason.contains("header lacks it"), "{p:?}");
    // Export refuses what verify flags (it wrote the file).
    let out = f.root.parent().unwrap().join("out.safetensors");
    let e = export_safetensors(&f.root, Some(1), None, &out, false, &Quiet).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{e}");
    assert!(!out.exists());
}

/// Rewrites the index of `step` through `edit` (its digests cover the data
/// files, not the index).
fn edit_index(root: &Path, step: u64, edit: impl FnOnce(&mut serde_json::Value)) {
    let index = root
        .join(crate::storage::local::step_dir_name(step))
        .join(crate::format::INDEX_FILE_NAME);
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index).unwrap()).unwrap();
    edit(&mut doc);
    std::fs::write(&index, serde_json::to_vec(&doc).unwrap()).unwrap();
}

#[test]
fn verify_and_export_refuse_a_header_tensor_the_index_does_not_map() {
    // A load refuses it ("the index and the file's header list different
    // tensors"); verify said intact and export wrote the file.
    let f = fixture();
    with_steps(&f, &[1]);
    edit_index(&f.root, 1, |doc| {
        doc["weight_map"].as_object_mut().unwrap().remove("w");
    });
    let r = verify(&f.root, Some(1), false, &Quiet).unwrap();
    assert!(!r.ok, "{r:?}");
    let p = &r.steps[0].problems;
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].tensors, ["w"]);
    assert!(p[0].reason.contains("list different tensors"), "{p:?}");
    let out = f.root.parent().unwrap().join("out.safetensors");
    let e = export_safetensors(&f.root, Some(1), None, &out, false, &Quiet).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Corrupt, "{e}");
    assert!(!out.exists());
}

#[test]
fn verify_says_a_newer_format_is_unsupported_not_corrupt() {
    let f = fixture();
    with_steps(&f, &[1]);
    edit_index(&f.root, 1, |doc| {
        doc["metadata"]["acp"]["format_version"] = json!(99);
    });
    let e = verify(&f.root, Some(1), false, &Quiet).unwrap_err();
    assert_eq!(e.kind(), crate::ErrorKind::Unsupported, "{e}");
    assert_eq!(
        exit_code(&e),
        exit_code(&inspect(&f.root, Some(1)).unwrap_err())
    );
}

#[test]
fn export_copies_and_refuses_a_corrupt_step() {
    let f = fixture();
    with_steps(&f, &[1, 2]);
    let out = f.root.parent().unwrap().join("out.safetensors");
    let r = export_safetensors(&f.root, Some(2), None, &out, false, &Quiet).unwrap();
    assert_eq!(r.tensors, 2);
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(data_file(&f.root, 2)).unwrap()
    );
    // Exists: refused without overwrite.
    let e = export_safetensors(&f.root, Some(2), None, &out, false, &Quiet).unwrap_err();
    assert_eq!(exit_code(&e), 2);
    // A FIFO (as a device like /dev/null) is refused even with overwrite,
    // and stays what it was: it was replaced by a regular file.
    let fifo = f.root.parent().unwrap().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let e = export_safetensors(&f.root, Some(2), None, &fifo, true, &Quiet).unwrap_err();
    assert_eq!(exit_code(&e), 2);
    assert!(e.to_string().contains("not a regular file"), "{e}");
    use std::os::unix::fs::FileTypeExt;
    assert!(std::fs::symlink_metadata(&fifo)
        .unwrap()
        .file_type()
        .is_fifo());
    flip(&f.root, 1);
    let bad = f.root.parent().unwrap().join("bad.safetensors");
    let e = export_safetensors(&f.root, Some(1), None, &bad, false, &Quiet).unwrap_err();
    assert_eq!(exit_code(&e), 1);
    assert!(e.to_string().contains("tensor `w`"), "{e}");
    assert!(!bad.exists());
    let leftovers: Vec<_> = std::fs::read_dir(f.root.parent().unwrap())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn import_round_trips_an_export() {
    let f = fixture();
    with_steps(&f, &[3]);
    let out = f.root.parent().unwrap().join("x.safetensors");
    export_safetensors(&f.root, None, None, &out, false, &Quiet).unwrap();
    let root2 = f.root.parent().unwrap().join("ckpt2");
    let r = import_safetensors(
        &[out],
        &ImportOptions {
            root: root2.clone(),
            step: 7,
            overwrite: false,
            values: None,
            framework: "torch".to_owned(),
            shm_dir: f.shm.clone(),
        },
        &Quiet,
    )
    .unwrap();
    assert_eq!(r.tensors, 2);
    let a = inspect(&f.root, Some(3)).unwrap();
    let b = inspect(&root2, Some(7)).unwrap();
    assert_eq!(b.files[0].values, a.files[0].values);
    let d = diff_roots(&f.root, 3, &root2, 7);
    assert!(d, "tensors differ after import");
    // The private ring is gone: only the fixture's own slots are left.
    let names: Vec<_> = std::fs::read_dir(&f.shm)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [crate::staging::user_dir_name().as_str()]);
    assert_eq!(
        std::fs::read_dir(crate::staging::user_dir(&f.shm))
            .unwrap()
            .count(),
        2
    );
    assert!(verify(&root2, None, false, &Quiet).unwrap().ok);
}

/// Whether every tensor of two steps in two roots has the same bytes.
fn diff_roots(ra: &Path, a: u64, rb: &Path, b: u64) -> bool {
    let ia = inspect(ra, Some(a)).unwrap();
    let ib = inspect(rb, Some(b)).unwrap();
    let fa = std::fs::read(data_file(ra, a)).unwrap();
    let fb = std::fs::read(data_file(rb, b)).unwrap();
    ia.tensors.iter().all(|t| {
        let u = ib.tensors.iter().find(|u| u.name == t.name).unwrap();
        let (x, y) = (
            usize::try_from(t.offset).unwrap(),
            usize::try_from(u.offset).unwrap(),
        );
        let n = usize::try_from(t.bytes).unwrap();
        fa[x..x + n] == fb[y..y + n]
    })
}

#[test]
fn diff_figures_are_right() {
    let f = fixture();
    let engine = Engine::open(config(&f)).unwrap();
    save(&engine, 1, 1.0);
    save(&engine, 2, 1.0);
    // Step 3: w[1] += 0.5, w[3] -= 2; b unchanged; a new tensor.
    let mut w: Vec<f32> = (0..1024).map(|i| i as f32).collect();
    w[1] += 0.5;
    w[3] -= 2.0;
    let w = f32s(&w);
    let b: Vec<u8> = (0..8i32).flat_map(|x| x.to_le_bytes()).collect();
    let h = bf16_one();
    engine
        .save(
            3,
            &[
                HostTensor {
                    name: "w",
                    dtype: Dtype::F32,
                    shape: &[32, 32],
                    data: &w,
                },
                HostTensor {
                    name: "b",
                    dtype: Dtype::I32,
                    shape: &[8],
                    data: &b,
                },
                HostTensor {
                    name: "h",
                    dtype: Dtype::BF16,
                    shape: &[1],
                    data: &h,
                },
            ],
            &json!({"step": 3, "lr": 0.05}),
            &SaveOptions::default(),
        )
        .unwrap()
        .wait()
        .unwrap();
    engine.close().unwrap();
    let same = diff(&f.root, 1, 2, &Quiet).unwrap();
    assert!(same.changed.is_empty() && same.added.is_empty());
    assert_eq!(same.unchanged, 2);
    assert_eq!(same.values.len(), 1, "{:?}", same.values);
    assert_eq!(same.values[0].path, "step");
    let d = diff(&f.root, 2, 3, &Quiet).unwrap();
    assert_eq!(d.added, ["h"]);
    assert_eq!(d.unchanged, 1);
    let w = &d.changed[0];
    assert_eq!(w.name, "w");
    assert_eq!(w.changed_elements, Some(2));
    assert_eq!(w.max_abs_diff, Some(2.0));
    let norm: f64 = (0..1024).map(|i| f64::from(i) * f64::from(i)).sum();
    let want = (0.25f64 + 4.0).sqrt() / norm.sqrt();
    assert!((w.rel_l2.unwrap() - want).abs() < 1e-12, "{w:?}");
    let paths: Vec<&str> = d.values.iter().map(|v| v.path.as_str()).collect();
    assert_eq!(paths, ["lr", "step"]);
    assert!(text::diff(&d).contains("+ h"));
    // A damaged step is refused, naming the tensor.
    flip(&f.root, 3);
    let e = diff(&f.root, 2, 3, &Quiet).unwrap_err();
    assert_eq!(exit_code(&e), 1);
    assert!(e.to_string().contains("tensor `w`"), "{e}");
}

fn bf16_one() -> Vec<u8> {
    vec![0x80, 0x3f] // bf16 1.0
}

#[test]
fn gc_keeps_what_it_should() {
    let f = fixture();
    with_steps(&f, &[100, 200, 300, 400, 500]);
    let stale = f.root.join(".pending-000000000600-r00000-1-2");
    std::fs::create_dir(&stale).unwrap();
    std::fs::write(stale.join("rank-00000.safetensors"), b"xx").unwrap();
    let dry = gc(
        &f.root,
        &GcOptions {
            keep_last: Some(2),
            keep_every: Some(200),
            unfinished_older_than: Some(std::time::Duration::ZERO),
            dry_run: true,
        },
    )
    .unwrap();
    assert_eq!(dry.removed_steps, [100, 300]);
    assert!(stale.exists());
    let r = gc(
        &f.root,
        &GcOptions {
            keep_last: Some(2),
            keep_every: Some(200),
            unfinished_older_than: Some(std::time::Duration::from_secs(3600)),
            dry_run: false,
        },
    )
    .unwrap();
    assert_eq!(r.removed_steps, [100, 300]);
    assert_eq!(r.kept_steps, [200, 400, 500]);
    assert!(r.removed_unfinished.is_empty(), "young leftovers stay");
    assert!(stale.exists());
    let r = gc(
        &f.root,
        &GcOptions {
            unfinished_older_than: Some(std::time::Duration::ZERO),
            ..GcOptions::default()
        },
    )
    .unwrap();
    assert_eq!(r.removed_unfinished.len(), 1);
    assert!(!stale.exists());
    let keep0 = GcOptions {
        keep_last: Some(0),
        ..GcOptions::default()
    };
    assert_eq!(exit_code(&gc(&f.root, &keep0).unwrap_err()), 2);
    assert_eq!(
        crate::storage::LocalStorage::open_existing(&f.root)
            .unwrap()
            .steps()
            .unwrap(),
        [200, 400, 500]
    );
}

/// Step 1 committed, then a saver whose storage is dead: step 2 stays
/// resident, uncommitted. Returns the saver, still open.
fn dead_saver_left_step_2(f: &Fixture) -> Engine {
    with_steps(f, &[1]);
    let faults = Arc::new(FaultInjector::fail_at(0, libc::EIO, true));
    let engine = Engine::open(config(f).with_faults(faults)).unwrap();
    let w = f32s(&[2.0; 16]);
    let tensor = HostTensor {
        name: "w",
        dtype: Dtype::F32,
        shape: &[16],
        data: &w,
    };
    let h = engine
        .save(2, &[tensor], &json!(null), &SaveOptions::default())
        .unwrap();
    assert!(h.wait().is_err());
    engine
}

fn persist_options(f: &Fixture) -> PersistOptions {
    PersistOptions {
        root: f.root.clone(),
        job: Some("ops-test".into()),
        ranks: None,
        shm_dir: f.shm.clone(),
        world_size: None,
        commit_timeout: std::time::Duration::from_secs(30),
    }
}

#[test]
fn persist_commits_what_a_dead_saver_left() {
    let f = fixture();
    let engine = dead_saver_left_step_2(&f);
    // While the saver lives, persist refuses.
    let opts = persist_options(&f);
    let e = persist(&opts).unwrap_err();
    assert_eq!(exit_code(&e), 5, "{e}");
    let _ = engine.close();
    drop(engine);
    // Bad rank or world size: usage errors (they were "corrupt" and
    // "nothing to persist").
    for (ranks, world_size, field) in [
        (Some(vec![0]), Some(0), "--world-size"),
        (Some(vec![7]), Some(2), "--rank"),
        (Some(vec![u32::MAX]), None, "--rank"),
    ] {
        let bad = PersistOptions {
            ranks,
            world_size,
            ..opts.clone()
        };
        let e = persist(&bad).unwrap_err();
        assert_eq!(exit_code(&e), 2, "{e}");
        assert!(e.to_string().contains(field), "{e}");
    }
    let before = list(&f.root, Some("ops-test"), &f.shm).unwrap();
    assert_eq!(before.resident_only.len(), 1, "{before:?}");
    assert_eq!(before.resident_only[0].step, Some(2));
    let r = persist(&opts).unwrap();
    assert_eq!(r.ranks.len(), 1);
    assert_eq!(r.ranks[0].persisted_steps, [2]);
    assert_eq!(r.latest, Some(2));
    assert!(verify(&f.root, Some(2), false, &Quiet).unwrap().ok);
    // In the saver's chunks (4 KiB here), not the default 4 MiB: the
    // restarted saver then restores the step from its slot.
    let index = crate::storage::open_root(&f.root)
        .unwrap()
        .read_index(2)
        .unwrap();
    let chunk = index.files.values().next().unwrap().chunk_bytes;
    assert_eq!(chunk, 4096);
    // Again: nothing left to do.
    let again = persist(&opts).unwrap();
    assert!(again.ranks[0].persisted_steps.is_empty());
    assert!(text::persist(&again).contains("nothing to persist"));
}

#[test]
fn ls_says_when_a_resident_image_cannot_be_persisted() {
    let f = fixture();
    // Step 2 left resident by a dead saver; then a byte of its image's
    // header changes in the slot.
    let engine = dead_saver_left_step_2(&f);
    let _ = engine.close();
    drop(engine);
    let listed = list(&f.root, Some("ops-test"), &f.shm).unwrap();
    assert_eq!(listed.resident_only.len(), 1, "{listed:?}");
    assert!(listed.resident_only[0].header_error.is_none());
    let path = std::path::PathBuf::from(&listed.resident_only[0].path);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes
        .windows(2)
        .position(|w| w == b"{\"")
        .expect("the image's header");
    bytes[at] = b'X';
    std::fs::write(&path, &bytes).unwrap();
    let listed = list(&f.root, Some("ops-test"), &f.shm).unwrap();
    let why = listed.resident_only[0].header_error.as_deref().unwrap();
    assert!(why.contains("header"), "{why}");
    let shown = text::list(&listed);
    assert!(shown.contains("`acp persist` cannot commit it"), "{shown}");
    assert!(persist(&persist_options(&f)).is_err());
}

#[test]
fn bench_runs_small() {
    let f = fixture();
    let r = bench(
        &BenchOptions {
            size: 1 << 20,
            dir: f.root.parent().unwrap().to_path_buf(),
            shm_dir: f.shm.clone(),
        },
        &Quiet,
    )
    .unwrap();
    assert_eq!(r.rows.len(), 7);
    assert!(r.rows.iter().all(|row| row.secs >= 0.0));
    assert!(r.rows[1].ratio.is_some());
    assert_eq!(std::fs::read_dir(&f.shm).unwrap().count(), 0);
    assert!(text::bench(&r).contains("memcpy"));
}

#[test]
fn multi_rank_steps_export_merged_and_persist_together() {
    let f = fixture();
    let save_rank = |rank: u32, step: u64| {
        let engine = Engine::open(
            config(&f)
                .with_rank(rank)
                .with_world_size(2)
                .with_commit_timeout(std::time::Duration::from_secs(30)),
        )
        .unwrap();
        let data = f32s(&[rank as f32; 64]);
        let name = format!("rank{rank}.w");
        engine
            .save(
                step,
                &[HostTensor {
                    name: &name,
                    dtype: Dtype::F32,
                    shape: &[64],
                    data: &data,
                }],
                &json!({"rank": rank}),
                &SaveOptions::default(),
            )
            .unwrap()
            .wait()
            .unwrap();
        engine.close().unwrap();
    };
    std::thread::scope(|s| {
        s.spawn(|| save_rank(0, 1));
        s.spawn(|| save_rank(1, 1));
    });
    let r = list(&f.root, Some("ops-test"), &f.shm).unwrap();
    assert_eq!(r.steps[0].files, 2);
    assert_eq!(r.steps[0].resident_ranks, [0, 1]);
    assert!(verify(&f.root, None, false, &Quiet).unwrap().ok);
    let out = f.root.parent().unwrap().join("merged.safetensors");
    let e = export_safetensors(&f.root, None, None, &out, false, &Quiet).unwrap();
    assert_eq!((e.tensors, e.ranks.clone()), (2, vec![0, 1]));
    let bytes = std::fs::read(&out).unwrap();
    let h = crate::format::parse_header(&out, &bytes, bytes.len() as u64).unwrap();
    assert_eq!(h.metadata["values.rank1"], r#"{"rank":1}"#);
    let w1 = h.entries.iter().find(|e| e.name == "rank1.w").unwrap();
    let off = usize::try_from(w1.offset).unwrap();
    assert_eq!(&bytes[off..off + 256], &f32s(&[1.0; 64])[..]);
    // One rank's file alone, byte for byte.
    let one = f.root.parent().unwrap().join("r1.safetensors");
    export_safetensors(&f.root, None, Some(1), &one, false, &Quiet).unwrap();
    let src = f
        .root
        .join("step-000000000001")
        .join("rank-00001.safetensors");
    assert_eq!(std::fs::read(&one).unwrap(), std::fs::read(src).unwrap());
    let e = export_safetensors(&f.root, None, Some(5), &one, true, &Quiet).unwrap_err();
    assert_eq!(exit_code(&e), 3);
}

#[test]
fn persist_commits_a_multi_rank_step_whose_ranks_all_died() {
    let f = fixture();
    let dead_rank = |rank: u32| {
        let faults = Arc::new(FaultInjector::fail_at(0, libc::EIO, true));
        let engine = Engine::open(
            config(&f)
                .with_rank(rank)
                .with_world_size(2)
                .with_faults(faults)
                .with_commit_timeout(std::time::Duration::from_secs(5)),
        )
        .unwrap();
        let data = f32s(&[rank as f32; 16]);
        let name = format!("rank{rank}.w");
        let h = engine
            .save(
                4,
                &[HostTensor {
                    name: &name,
                    dtype: Dtype::F32,
                    shape: &[16],
                    data: &data,
                }],
                &json!(null),
                &SaveOptions::default(),
            )
            .unwrap();
        assert!(h.wait().is_err());
        let _ = engine.close();
    };
    std::thread::scope(|s| {
        s.spawn(|| dead_rank(0));
        s.spawn(|| dead_rank(1));
    });
    let r = persist(&PersistOptions {
        root: f.root.clone(),
        job: Some("ops-test".into()),
        ranks: None,
        shm_dir: f.shm.clone(),
        world_size: None,
        commit_timeout: std::time::Duration::from_secs(30),
    })
    .unwrap();
    assert_eq!(r.world_size, 2);
    assert_eq!(r.ranks.len(), 2);
    assert!(r.ranks.iter().all(|k| k.persisted_steps == [4]), "{r:?}");
    let i = inspect(&f.root, Some(4)).unwrap();
    assert_eq!(i.files.len(), 2);
    assert!(verify(&f.root, Some(4), false, &Quiet).unwrap().ok);
}
