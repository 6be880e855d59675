//! Several ranks saving one step: every rank's file durable before rank 0
//! commits; a silent rank is named in the timeout; every rank loads the same
//! step and can read the others' files.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::Path;
use std::time::Duration;

use acp_core::{
    Dtype, Engine, EngineConfig, Error, HostTensor, LoadRequest, Opened, SaveOptions, Source,
};
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
        // The other rank's slot is on this node: copied from RAM.
        assert_eq!(other.report().source, Source::Ram);
        assert!(other.report().verified);
        assert_eq!(
            other.tensor(&format!("layer.{next}.w")).unwrap().data,
            shard(next, 20).as_slice()
        );
        let stored = e
            .load(&LoadRequest {
                rank: Some(next),
                storage_only: true,
                ..LoadRequest::default()
            })
            .unwrap();
        assert_eq!(stored.report().source, Source::Storage);
        assert_eq!(stored.image(), other.image());
        // Its values, without its tensors.
        assert_eq!(e.read_values(20, next).unwrap(), json!({"rank": next}));
    }
    assert!(engines[0].read_values(20, world).is_err());
    assert_eq!(engines[0].index(10).unwrap().files.len(), 4);
}

/// The slot files of `rank` in this user's directory under `shm`.
fn slot_files(shm: &Path, rank: u32) -> Vec<std::path::PathBuf> {
    let tail = format!("-r{rank:05}-s");
    let mut v: Vec<_> = std::fs::read_dir(acp_core::staging::user_dir(shm))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().contains(&tail))
        .collect();
    v.sort();
    v
}

#[test]
fn another_ranks_image_comes_from_its_slot_only_when_intact() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let (e0, e1) = (engine(&root, &shm, 0, 2), engine(&root, &shm, 1, 2));
    let (h0, h1) = (save(&e0, 0, 3), save(&e1, 1, 3));
    h0.wait().unwrap();
    h1.wait().unwrap();
    let peer = |e: &Engine| {
        e.load(&LoadRequest {
            rank: Some(1),
            ..LoadRequest::default()
        })
        .unwrap()
    };
    assert_eq!(peer(&e0).report().source, Source::Ram);

    // A changed byte in the resident copy: rejected, storage read instead.
    change_resident_byte(&shm, 1, 3);
    let got = peer(&e0);
    assert_eq!(got.report().source, Source::Storage);
    assert_eq!(
        got.tensor("layer.1.w").unwrap().data,
        shard(1, 3).as_slice()
    );

    // A replaced node: the other rank's slots are gone.
    e1.close().unwrap();
    drop(e1);
    for p in slot_files(&shm, 1) {
        std::fs::remove_file(p).unwrap();
    }
    assert_eq!(peer(&e0).report().source, Source::Storage);
}

#[test]
fn resident_images_of_every_rank_are_committed_on_request() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let open = |rank, persist| {
        Engine::open(
            EngineConfig::new(&root)
                .with_shm_dir(&shm)
                .with_job("late")
                .with_rank(rank)
                .with_world_size(2)
                .with_ring_bytes(16 << 20)
                .with_persist_on_open(persist)
                .with_commit_timeout(Duration::from_millis(300)),
        )
        .unwrap()
    };
    // Each rank stages step 4, but too late for the other: nothing commits,
    // and both images stay resident.
    let e0 = open(0, false);
    assert!(save(&e0, 0, 4).wait().is_err());
    let e1 = open(1, false);
    assert!(save(&e1, 1, 4).wait().is_err());
    assert!(e0.steps().unwrap().is_empty());
    for e in [e0, e1] {
        e.close().unwrap();
    }
    // Restarted, without persist_on_open: nothing is flushed by itself.
    let (e0, e1) = (open(0, false), open(1, false));
    assert_eq!(e0.open_report().resident_steps, vec![4]);
    assert!(e0.open_report().persisting_steps.is_empty());
    assert!(matches!(
        e0.persist_resident(5).unwrap_err(),
        Error::NotFound { .. }
    ));
    // Once both ranks are known to hold it, both persist it: committed.
    let (h0, h1) = (
        e0.persist_resident(4).unwrap(),
        e1.persist_resident(4).unwrap(),
    );
    h0.wait().unwrap();
    h1.wait().unwrap();
    assert_eq!(e1.steps().unwrap(), vec![4]);
    assert!(matches!(
        e0.persist_resident(4).unwrap_err(),
        Error::Exists { .. }
    ));
    let back = e1.load(&LoadRequest::default()).unwrap();
    assert_eq!(
        back.tensor("layer.1.w").unwrap().data,
        shard(1, 4).as_slice()
    );
    e0.close().unwrap();
    e1.close().unwrap();
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

#[test]
fn commits_given_up_fail_at_once_and_an_older_step_is_persisted_on_request() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let (r0, r1) = (engine(&root, &shm, 0, 2), engine(&root, &shm, 1, 2));
    // Both ranks hold step 1 as a RAM snapshot; rank 1 also persists step
    // 2, which rank 0 never saves: its commit could only time out (20 s).
    let snapshot = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    for (r, e) in [(0u32, &r0), (1, &r1)] {
        let data = shard(r, 1);
        let name = format!("layer.{r}.w");
        let tensor = HostTensor {
            name: &name,
            dtype: Dtype::U8,
            shape: &[data.len() as u64],
            data: &data,
        };
        e.save(1, &[tensor], &json!({"rank": r}), &snapshot)
            .unwrap();
    }
    let h2 = save(&r1, 1, 2);
    std::thread::sleep(Duration::from_millis(200));
    let t0 = std::time::Instant::now();
    r1.give_up_commits_from(2);
    let e = h2.wait().unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(
        e.to_string().contains("given up by the dying checkpoint"),
        "{e}"
    );
    // Rank 1's snapshot of step 1 was released when step 2 sealed; with
    // nothing of step 1 resident, persist_step has nothing to do.
    assert!(r1.persist_step(1).unwrap().is_none());
    // Rank 0 still holds step 1: persisted on request, it then waits for
    // rank 1's file, which never comes, and gives up at once too.
    r0.give_up_commits_from(1);
    let h1 = r0.persist_step(1).unwrap().unwrap();
    assert!(h1.wait().is_err());
    assert!(r0.steps().unwrap().is_empty());
}

#[test]
fn commits_waiting_for_a_dead_rank_fail_at_once_but_the_covered_step_commits() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let (r0, r1) = (engine(&root, &shm, 0, 3), engine(&root, &shm, 1, 3));
    // Rank 2 never writes step 3: its commit could only time out (20 s).
    let (h0, h1) = (save(&r0, 0, 3), save(&r1, 1, 3));
    std::thread::sleep(Duration::from_millis(200));
    let t0 = std::time::Instant::now();
    // Rank 2 is taken as dead; step 4 is the one its file is written of.
    r0.give_up_commits_waiting_for(&[2], Some(4));
    let e0 = h0.wait().unwrap_err();
    assert!(e0.to_string().contains("ranks [2], taken as dead"), "{e0}");
    // Rank 1 waited for rank 0's commit: rank 0 refused it when it gave up.
    assert!(h1.wait().is_err());
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    // Step 4 still commits once rank 2's file of it arrives (as acp.cover
    // writes it, here an engine opened as rank 2).
    let (h0, h1) = (save(&r0, 0, 4), save(&r1, 1, 4));
    let r2 = engine(&root, &shm, 2, 3);
    let h2 = save(&r2, 2, 4);
    for h in [h0, h1, h2] {
        h.wait().unwrap();
    }
    assert_eq!(r0.steps().unwrap(), [4]);
}

/// Rank `rank` of two in job `job`, in chunks of 64 KiB.
fn two_rank_config(root: &Path, shm: &Path, job: &str, rank: u32) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job(job)
        .with_rank(rank)
        .with_world_size(2)
        .with_chunk_bytes(64 << 10)
        .with_commit_timeout(Duration::from_secs(20))
}

#[test]
fn some_tensors_of_another_rank_read_only_their_chunks() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let open = |rank| {
        Engine::open(two_rank_config(&root, &shm, "partial", rank).with_ring_bytes(16 << 20))
            .unwrap()
    };
    let (e0, e1) = (open(0), open(1));
    // Rank 1 writes four tensors of 256 KiB, each over four chunks.
    let data: Vec<Vec<u8>> = (0..4u8).map(|i| vec![i + 1; 256 << 10]).collect();
    let names: Vec<String> = (0..4).map(|i| format!("t{i}")).collect();
    let tensors: Vec<HostTensor<'_>> = names
        .iter()
        .zip(&data)
        .map(|(n, d)| HostTensor {
            name: n,
            dtype: Dtype::U8,
            shape: &[256 << 10],
            data: d,
        })
        .collect();
    let h1 = e1
        .save(3, &tensors, &json!({"of": 1}), &SaveOptions::default())
        .unwrap();
    let h0 = save(&e0, 0, 3);
    h0.wait().unwrap();
    let size = h1.wait().unwrap().bytes;
    let some = |storage_only, names: &[&str]| {
        e0.load(&LoadRequest {
            step: Some(3),
            rank: Some(1),
            storage_only,
            tensors: Some(names.iter().map(|n| (*n).to_owned()).collect()),
            ..LoadRequest::default()
        })
    };
    for storage_only in [false, true] {
        let got = some(storage_only, &["t2"]).unwrap();
        let want = if storage_only {
            Source::Storage
        } else {
            Source::Ram
        };
        assert_eq!(got.report().source, want);
        assert_eq!(got.entries().len(), 1);
        assert_eq!(got.tensor("t2").unwrap().data, data[2].as_slice());
        assert_eq!(got.values(), &json!({"of": 1}));
        // The header's chunk and t2's four (or five, unaligned) chunks.
        assert!(
            got.report().bytes <= 6 * (64 << 10),
            "{}",
            got.report().bytes
        );
        assert!(got.report().bytes < size / 2);
    }
    assert!(matches!(
        some(true, &["t1", "nope"]).unwrap_err(),
        Error::NotFound { .. }
    ));
    // A changed byte under a wanted tensor is caught; one elsewhere is not read.
    let file = root.join("step-000000000003/rank-00001.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.len() - 10;
    bytes[at] ^= 0xFF;
    std::fs::write(&file, &bytes).unwrap();
    assert!(matches!(
        some(true, &["t3"]).unwrap_err(),
        Error::Corrupt { .. }
    ));
    assert_eq!(
        some(true, &["t0"]).unwrap().tensor("t0").unwrap().data,
        data[0].as_slice()
    );
}

/// Two ranks of job `job` (chunks of 64 KiB, 3 copy threads) that both
/// committed `step`, rank 1 with four tensors `t0`..`t3` of about 3 MiB
/// (made by `byte`), returned with them.
fn two_ranks_four_tensors(
    root: &Path,
    shm: &Path,
    job: &str,
    step: u64,
    byte: fn(u32, u32) -> u8,
) -> (Engine, Engine, Vec<Vec<u8>>) {
    let open = |rank| {
        Engine::open(
            two_rank_config(root, shm, job, rank)
                .with_ring_bytes(64 << 20)
                .with_copy_threads(3),
        )
        .unwrap()
    };
    let (e0, e1) = (open(0), open(1));
    // Enough bytes that the chunks are read and checked on several threads.
    let data: Vec<Vec<u8>> = (0..4u32)
        .map(|i| (0..(3 << 20) + 17 * i).map(|j| byte(i, j)).collect())
        .collect();
    let names: Vec<String> = (0..4).map(|i| format!("t{i}")).collect();
    let shapes: Vec<[u64; 1]> = data.iter().map(|d| [d.len() as u64]).collect();
    let tensors: Vec<HostTensor<'_>> = names
        .iter()
        .zip(&data)
        .zip(&shapes)
        .map(|((n, d), s)| HostTensor {
            name: n,
            dtype: Dtype::U8,
            shape: s,
            data: d,
        })
        .collect();
    let h1 = e1
        .save(step, &tensors, &json!({"of": 1}), &SaveOptions::default())
        .unwrap();
    save(&e0, 0, step).wait().unwrap();
    h1.wait().unwrap();
    (e0, e1, data)
}

/// Changes the tenth byte from the end of `rank`'s resident image of
/// `step` in its slot under `shm` (a byte of its last tensor).
fn change_resident_byte(shm: &Path, rank: u32, step: u64) {
    let slot = slot_files(shm, rank)
        .into_iter()
        .find(|p| {
            acp_core::staging::peek_slot(p)
                .unwrap()
                .is_some_and(|s| s.is_complete() && s.step == step)
        })
        .unwrap();
    let peek = acp_core::staging::peek_slot(&slot).unwrap().unwrap();
    let at = peek.image_offset + peek.image_len - 10;
    let f = std::fs::OpenOptions::new().write(true).open(&slot).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&f, &[0xAA], at).unwrap();
}

#[test]
fn some_tensors_of_another_ranks_slot_are_checked_chunk_by_chunk() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let (e0, _e1, data) =
        two_ranks_four_tensors(&root, &shm, "summed", 5, |i, j| (j * 7 + i) as u8);
    let some = |names: &[&str]| {
        e0.load(&LoadRequest {
            step: Some(5),
            rank: Some(1),
            tensors: Some(names.iter().map(|n| (*n).to_owned()).collect()),
            ..LoadRequest::default()
        })
        .unwrap()
    };
    let got = some(&["t1", "t3"]);
    assert_eq!(got.report().source, Source::Ram);
    assert!(got.report().verified);
    assert_eq!(got.tensor("t1").unwrap().data, data[1].as_slice());
    assert_eq!(got.tensor("t3").unwrap().data, data[3].as_slice());
    drop(got);
    // A byte changed in the slot under t3 (after its sums were taken):
    // that chunk is checked against its digest, which fails, and storage
    // is read instead; t0, whose chunks are intact, still comes from RAM.
    change_resident_byte(&shm, 1, 5);
    let got = some(&["t3", "t1"]);
    assert_eq!(got.report().source, Source::Storage);
    assert_eq!(got.tensor("t3").unwrap().data, data[3].as_slice());
    assert_eq!(got.tensor("t1").unwrap().data, data[1].as_slice());
    let got = some(&["t0"]);
    assert_eq!(got.report().source, Source::Ram);
    assert_eq!(got.tensor("t0").unwrap().data, data[0].as_slice());
}

#[test]
fn some_tensors_of_another_ranks_slot_go_straight_into_the_callers_memory() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let (e0, _e1, data) =
        two_ranks_four_tensors(&root, &shm, "direct", 6, |i, j| (j * 5 + i) as u8);
    let req = LoadRequest {
        step: Some(6),
        rank: Some(1),
        tensors: Some(vec!["t3".into(), "t1".into(), "t2".into()]),
        ..LoadRequest::default()
    };
    // Planned from rank 1's slot: t1, t2, t3 in file order.
    let load_some = |dsts: &mut [Vec<u8>]| {
        let Opened::Pending(p) = e0.open_load(&req).unwrap() else {
            panic!("another rank's resident tensors are read by the copy");
        };
        assert_eq!(p.source(), Source::Ram);
        let names: Vec<&str> = p.entries().iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["t1", "t2", "t3"]);
        // Destinations for t1 and t3; t2 is kept by the checkpoint.
        let (a, b) = dsts.split_at_mut(1);
        p.read_into(&mut [(0, &mut a[0][..]), (2, &mut b[0][..])])
            .unwrap()
    };
    let mut dsts = vec![vec![0u8; data[1].len()], vec![0u8; data[3].len()]];
    let ck = load_some(&mut dsts);
    assert_eq!(ck.report().source, Source::Ram);
    assert!(ck.report().verified);
    assert_eq!(ck.report().rejected, None);
    assert_eq!(dsts[0], data[1]);
    assert_eq!(dsts[1], data[3]);
    // The checkpoint holds t2, not t1 or t3, and says so.
    assert_eq!(ck.tensor("t2").unwrap().data, data[2].as_slice());
    assert!(ck.tensor("t1").is_none());
    assert!(!ck.holds(&ck.entries()[2]));
    assert!(ck.data(&ck.entries()[2]).is_empty());
    let mut again = vec![0u8; data[1].len()];
    let err = ck.copy_into(&mut [(0, &mut again[..])]).unwrap_err();
    assert!(err.to_string().contains("tensor `t1`"), "{err}");
    drop(ck);
    // The whole file the same way: every tensor straight into its
    // destination.
    let whole = LoadRequest {
        step: Some(6),
        rank: Some(1),
        ..LoadRequest::default()
    };
    let Opened::Pending(p) = e0.open_load(&whole).unwrap() else {
        panic!("another rank's resident file is read by the copy");
    };
    assert_eq!(p.entries().len(), 4);
    let mut all: Vec<Vec<u8>> = data.iter().map(|d| vec![0u8; d.len()]).collect();
    let mut dsts: Vec<(usize, &mut [u8])> = all
        .iter_mut()
        .enumerate()
        .map(|(i, d)| (i, &mut d[..]))
        .collect();
    let ck = p.read_into(&mut dsts).unwrap();
    assert_eq!(ck.report().source, Source::Ram);
    assert_eq!(all, data);
    assert!(ck.entries().iter().all(|e| !ck.holds(e)));
    drop(ck);

    // A byte of t3 changed in rank 1's slot: read from storage instead,
    // into the same destinations, with the reason.
    change_resident_byte(&shm, 1, 6);
    let mut dsts = vec![vec![0u8; data[1].len()], vec![0u8; data[3].len()]];
    let ck = load_some(&mut dsts);
    assert_eq!(ck.report().source, Source::Storage);
    assert!(ck
        .report()
        .rejected
        .as_deref()
        .unwrap()
        .contains("quick sum"));
    assert_eq!(dsts[0], data[1]);
    assert_eq!(dsts[1], data[3]);
    assert_eq!(ck.tensor("t2").unwrap().data, data[2].as_slice());
}

#[test]
fn another_ranks_tensors_stay_exact_while_it_saves_over_its_slots() {
    // Rank 1 keeps saving into a ring of two slots while rank 0 reads the
    // newest committed step of rank 1's file straight into its memory:
    // the slot read may be reused under the read, and every load must
    // still give that step's bytes exactly (from the slot, or storage).
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let open = |rank| {
        Engine::open(
            two_rank_config(&root, &shm, "race", rank)
                .with_ring_bytes(16 << 20)
                .with_ring_slots(2)
                .with_keep_last(1000)
                .with_copy_threads(3),
        )
        .unwrap()
    };
    let (e0, e1) = (open(0), open(1));
    let pattern = |step: u64, i: u32| -> Vec<u8> {
        (0..(1 << 20) + 4099 * i)
            .map(|j| (j as u64 * 31 + step * 7 + u64::from(i)) as u8)
            .collect()
    };
    let names = ["a".to_owned(), "b".to_owned()];
    let steps = 24u64;
    let done = std::sync::atomic::AtomicBool::new(false);
    let (mut ram, mut storage, mut passed_over) = (0, 0, 0);
    std::thread::scope(|scope| {
        scope.spawn(|| {
            for step in 1..=steps {
                let data = [pattern(step, 0), pattern(step, 1)];
                let shapes = [[data[0].len() as u64], [data[1].len() as u64]];
                let tensors: Vec<HostTensor<'_>> = (0..2)
                    .map(|i| HostTensor {
                        name: &names[i],
                        dtype: Dtype::U8,
                        shape: &shapes[i],
                        data: &data[i],
                    })
                    .collect();
                let h1 = e1
                    .save(
                        step,
                        &tensors,
                        &json!({"step": step}),
                        &SaveOptions::default(),
                    )
                    .unwrap();
                save(&e0, 0, step).wait().unwrap();
                h1.wait().unwrap();
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            // The newest step, or the one before it, whose slot the next
            // save takes (two slots): reused under the read, at times.
            let Some(newest) = e0.latest().unwrap() else {
                continue;
            };
            let step = if (ram + storage) % 2 == 0 || newest == 1 {
                newest
            } else {
                newest - 1
            };
            let req = LoadRequest {
                step: Some(step),
                rank: Some(1),
                // The whole file and some of its tensors, in turn.
                tensors: (step % 2 == 0).then(|| vec!["b".to_owned(), "a".to_owned()]),
                ..LoadRequest::default()
            };
            let mut dsts = [
                vec![0u8; pattern(step, 0).len()],
                vec![0u8; pattern(step, 1).len()],
            ];
            let (a, b) = dsts.split_at_mut(1);
            let ck = match e0.open_load(&req).unwrap() {
                Opened::Pending(p) => p
                    .read_into(&mut [(0, &mut a[0][..]), (1, &mut b[0][..])])
                    .unwrap(),
                Opened::Ready(ck) => {
                    ck.copy_into(&mut [(0, &mut a[0][..]), (1, &mut b[0][..])])
                        .unwrap();
                    ck
                }
            };
            match ck.report().source {
                Source::Ram => ram += 1,
                _ => storage += 1,
            }
            // A slot reused while it was read.
            passed_over += usize::from(ck.report().rejected.is_some());
            assert_eq!(dsts[0], pattern(step, 0), "step {step}");
            assert_eq!(dsts[1], pattern(step, 1), "step {step}");
        }
    });
    assert!(ram + storage > 0);
    eprintln!(
        "loads: {ram} from rank 1's slots, {storage} from storage, {passed_over} of them after the slot changed under the read"
    );
}
