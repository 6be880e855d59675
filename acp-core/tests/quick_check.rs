//! The RAM tier's quick check: a resident image that was proved once (by
//! the flush's digests, or by a load's full check) is checked again at
//! every load, so a byte changed after any number of good loads is still
//! caught, reported naming the slot file and tensor, and storage is read.
//! The sums live in the slot's control block, so a new process's first
//! load checks them too.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use acp_core::{Dtype, Engine, EngineConfig, HostTensor, LoadRequest, SaveOptions, Source};
use serde_json::json;

/// Two tensors over several 64 KiB chunks, so the checks run on threads
/// and a flip lands in one chunk of many.
/// (Made once per test binary: a byte-by-byte generator in an unoptimised
/// build cost more than the loads it feeds.)
fn tensors() -> Vec<(String, Vec<u8>)> {
    static TENSORS: OnceLock<Vec<(String, Vec<u8>)>> = OnceLock::new();
    TENSORS
        .get_or_init(|| {
            ["a.w", "b.w"]
                .iter()
                .enumerate()
                .map(|(k, n)| {
                    let data = (0..(12u32 << 20))
                        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ k as u8)
                        .collect();
                    ((*n).to_owned(), data)
                })
                .collect()
        })
        .clone()
}

fn engine(root: &Path, shm: &Path) -> Engine {
    Engine::open(
        EngineConfig::new(root)
            .with_shm_dir(shm)
            .with_job("quick")
            .with_ring_bytes(128 << 20)
            .with_chunk_bytes(64 << 10)
            .with_copy_threads(2),
    )
    .unwrap()
}

fn save(e: &Engine, step: u64, data: &[(String, Vec<u8>)]) {
    save_with(e, step, data, &json!({}));
}

fn save_with(e: &Engine, step: u64, data: &[(String, Vec<u8>)], values: &serde_json::Value) {
    save_opts(e, step, data, values, &SaveOptions::default());
}

fn save_opts(
    e: &Engine,
    step: u64,
    data: &[(String, Vec<u8>)],
    values: &serde_json::Value,
    opts: &SaveOptions,
) {
    let shapes: Vec<[u64; 1]> = data.iter().map(|(_, d)| [d.len() as u64]).collect();
    let host: Vec<HostTensor<'_>> = data
        .iter()
        .zip(&shapes)
        .map(|((n, d), s)| HostTensor {
            name: n,
            dtype: Dtype::U8,
            shape: s,
            data: d,
        })
        .collect();
    e.save(step, &host, values, opts).unwrap().wait().unwrap();
}

fn load(e: &Engine, step: u64) -> acp_core::Checkpoint {
    e.load(&LoadRequest {
        step: Some(step),
        ..LoadRequest::default()
    })
    .unwrap()
}

/// The slot file holding `step`, and where its image starts.
fn slot_of(shm: &Path, step: u64) -> (PathBuf, u64) {
    std::fs::read_dir(acp_core::staging::user_dir(shm))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find_map(|p| {
            let peek = acp_core::staging::peek_slot(&p).ok()??;
            (peek.is_complete() && peek.step == step).then_some((p, peek.image_offset))
        })
        .unwrap()
}

fn flip(file: &Path, at: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x10], at).unwrap();
}

fn assert_intact(ck: &acp_core::Checkpoint, data: &[(String, Vec<u8>)]) {
    for (n, d) in data {
        assert!(ck.tensor(n).unwrap().data == d.as_slice(), "tensor `{n}`");
    }
}

#[test]
fn a_byte_changed_after_good_loads_is_caught_at_the_next() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = engine(&root, &shm);
    save(&e, 1, &data);
    // Proved by the flush, then by loads: each one from RAM, verified.
    for _ in 0..3 {
        let ck = load(&e, 1);
        assert_eq!(ck.report().source, Source::Ram);
        assert!(ck.report().verified);
        assert_intact(&ck, &data);
    }
    let (file, image) = slot_of(&shm, 1);
    let b = e
        .load(&LoadRequest::default())
        .unwrap()
        .entries()
        .iter()
        .find(|x| x.name == "b.w")
        .unwrap()
        .offset;
    // A byte deep in `b.w`, changed by another process writing the file.
    flip(&file, image + b + (5 << 20) + 3);
    let ck = load(&e, 1);
    assert_eq!(ck.report().source, Source::Storage);
    let why = ck.report().rejected.clone().unwrap();
    assert!(
        why.contains(file.file_name().unwrap().to_str().unwrap()),
        "{why}"
    );
    assert!(why.contains("`b.w`"), "{why}");
    assert_intact(&ck, &data);
    drop(ck);
    // Read back into a slot, the step is proved again and served from RAM.
    let ck = load(&e, 1);
    assert_eq!(ck.report().source, Source::Ram);
    assert_intact(&ck, &data);
    drop(ck);
    e.close().unwrap();
}

#[test]
fn a_new_process_proves_the_slot_before_trusting_it() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = engine(&root, &shm);
    save(&e, 1, &data);
    assert_eq!(load(&e, 1).report().source, Source::Ram);
    e.close().unwrap();
    drop(e);
    // Changed while no process held the ring: the next one's first load
    // finds a chunk that no longer gives the sum the flush recorded, and
    // checks the digests, which name the file.
    let (file, image) = slot_of(&shm, 1);
    flip(&file, image + (20 << 20));
    let e = engine(&root, &shm);
    let ck = load(&e, 1);
    assert_eq!(ck.report().source, Source::Storage);
    assert!(ck.report().rejected.is_some());
    assert_intact(&ck, &data);
    drop(ck);
    e.close().unwrap();
}

/// The flush's sums reach the next process; a slot without them (an older
/// version's) still loads from RAM, by blake3, which records them.
#[test]
fn the_flush_sums_reach_the_next_process() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = engine(&root, &shm);
    save(&e, 1, &data);
    e.close().unwrap();
    drop(e);
    // The ring as the next process finds it: the flush's sums beside the
    // digests, one per 64 KiB chunk.
    let (file, _) = slot_of(&shm, 1);
    let peek = acp_core::staging::peek_slot(&file).unwrap().unwrap();
    let name = file.file_name().unwrap().to_str().unwrap();
    let (prefix, index) = name.rsplit_once("-s").unwrap();
    let opts = || acp_core::staging::RingOptions {
        dir: shm.clone(),
        prefix: prefix.to_owned(),
        job_tag: peek.job_tag,
        rank: peek.rank,
        slots: index.parse::<usize>().unwrap() + 1,
        budget: 128 << 20,
        shared_budget: false,
        chunk_bytes: 64 << 10,
        mlock: false,
    };
    let (ring, _) = acp_core::staging::Ring::open(opts()).unwrap();
    let slot = index.parse().unwrap();
    let digests = ring.digests(slot).unwrap();
    assert_eq!(digests.len() as u64, peek.image_len.div_ceil(64 << 10));
    assert_eq!(ring.quick_sums(slot).map(|s| s.len()), Some(digests.len()));
    // Unmade (the digests recorded again, as by a version without sums).
    ring.set_digests(slot, &digests);
    assert_eq!(ring.quick_sums(slot), None);
    drop(ring);
    let (ring, _) = acp_core::staging::Ring::open(opts()).unwrap();
    assert_eq!(ring.quick_sums(slot), None);
    drop(ring);
    // Served, checked against the digests, from RAM.
    let e = engine(&root, &shm);
    let (ck, _) = load_into(&e, &data);
    assert_eq!(ck.report().source, Source::Ram);
    assert!(ck.report().verified);
    assert!(ck.report().rejected.is_none());
    assert_intact(&ck, &data);
    drop(ck);
    e.close().unwrap();
    drop(e);
    let (ring, _) = acp_core::staging::Ring::open(opts()).unwrap();
    // Its blake3 check recorded the sums again.
    assert_eq!(ring.quick_sums(slot).map(|s| s.len()), Some(digests.len()));
    drop(ring);
}

/// `load_into` of step 1 into fresh buffers filled with 0xEE.
fn load_into(e: &Engine, data: &[(String, Vec<u8>)]) -> (acp_core::Checkpoint, Vec<Vec<u8>>) {
    let req = LoadRequest {
        step: Some(1),
        ..LoadRequest::default()
    };
    let (ck, bufs) = try_load_into(e, &req, data);
    (ck.unwrap(), bufs)
}

/// `load_into` of `req` into fresh buffers filled with 0xEE, one per
/// tensor of `data`, whatever the load gave.
fn try_load_into(
    e: &Engine,
    req: &LoadRequest,
    data: &[(String, Vec<u8>)],
) -> (acp_core::Result<acp_core::Checkpoint>, Vec<Vec<u8>>) {
    let mut bufs: Vec<Vec<u8>> = data.iter().map(|(_, d)| vec![0xEE; d.len()]).collect();
    let mut into: Vec<(&str, &mut [u8])> = data
        .iter()
        .zip(bufs.iter_mut())
        .map(|((n, _), b)| (n.as_str(), b.as_mut_slice()))
        .collect();
    (e.load_into(req, &mut into), bufs)
}

fn assert_filled(bufs: &[Vec<u8>], data: &[(String, Vec<u8>)]) {
    for (b, (n, d)) in bufs.iter().zip(data) {
        assert!(b == d, "tensor `{n}`");
    }
}

/// The offset of tensor `name` in the image of step 1.
fn offset_of(e: &Engine, name: &str) -> u64 {
    let ck = load(e, 1);
    ck.entries().iter().find(|x| x.name == name).unwrap().offset
}

#[test]
fn load_into_from_ram_checks_each_chunk_as_it_copies_it() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = engine(&root, &shm);
    save(&e, 1, &data);
    // The resident slot's check waits for the copy.
    let req = LoadRequest {
        step: Some(1),
        ..LoadRequest::default()
    };
    match e.open_load(&req).unwrap() {
        acp_core::Opened::Pending(p) => assert_eq!(p.source(), Source::Ram),
        acp_core::Opened::Ready(_) => panic!("a resident step is checked by its copy"),
    }
    for _ in 0..2 {
        let (ck, bufs) = load_into(&e, &data);
        assert_eq!(ck.report().source, Source::Ram);
        assert!(ck.report().verified);
        assert!(ck.report().rejected.is_none());
        assert_filled(&bufs, &data);
        assert_intact(&ck, &data);
    }
    // A byte deep in `b.w` changed after the seal: its chunk differs from
    // its sum, the blake3 check names the slot file and the tensor, and
    // the tensors are read from storage.
    let (file, image) = slot_of(&shm, 1);
    flip(&file, image + offset_of(&e, "b.w") + (7 << 20) + 1);
    let (ck, bufs) = load_into(&e, &data);
    assert_eq!(ck.report().source, Source::Storage);
    let why = ck.report().rejected.clone().unwrap();
    assert!(
        why.contains(file.file_name().unwrap().to_str().unwrap()),
        "{why}"
    );
    assert!(why.contains("`b.w`"), "{why}");
    assert_filled(&bufs, &data);
    drop(ck);
    e.close().unwrap();
}

#[test]
fn a_new_process_load_into_checks_the_sums_in_the_slot() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = engine(&root, &shm);
    save(&e, 1, &data);
    let a = offset_of(&e, "a.w");
    e.close().unwrap();
    drop(e);
    // Intact: served from RAM by the first load of the next process.
    let e = engine(&root, &shm);
    let (ck, bufs) = load_into(&e, &data);
    assert_eq!(ck.report().source, Source::Ram);
    assert!(ck.report().rejected.is_none());
    assert_filled(&bufs, &data);
    drop(ck);
    e.close().unwrap();
    drop(e);
    // Changed while no process held the ring: caught, named, and read
    // from storage.
    let (file, image) = slot_of(&shm, 1);
    flip(&file, image + a + 12345);
    let e = engine(&root, &shm);
    let (ck, bufs) = load_into(&e, &data);
    assert_eq!(ck.report().source, Source::Storage);
    let why = ck.report().rejected.clone().unwrap();
    assert!(why.contains("`a.w`"), "{why}");
    assert_filled(&bufs, &data);
    drop(ck);
    e.close().unwrap();
}

#[test]
fn a_header_planned_from_changed_bytes_is_not_the_checked_one() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = engine(&root, &shm);
    save_with(&e, 1, &data, &json!({"lr": 7}));
    // Where the value 7 sits in the slot's header (the values are JSON
    // text inside the header's JSON: `{\"lr\":7}`).
    let (file, image) = slot_of(&shm, 1);
    let mut head = vec![0u8; 64 << 10];
    std::fs::File::open(&file)
        .unwrap()
        .read_exact_at(&mut head, image)
        .unwrap();
    let key = br#"lr\":7"#;
    let at =
        image + (head.windows(key.len()).position(|w| w == key).unwrap() + key.len() - 1) as u64;
    let req = LoadRequest {
        step: Some(1),
        ..LoadRequest::default()
    };
    // The load is planned from a header saying 6; the byte is put back
    // before its check, which then passes: the planned header is not the
    // checked one, and the load fails rather than hand out values the
    // checked image does not hold.
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.write_all_at(b"6", at).unwrap();
    let opened = e.open_load(&req).unwrap();
    f.write_all_at(b"7", at).unwrap();
    let acp_core::Opened::Pending(p) = opened else {
        panic!("a resident step is checked by its copy");
    };
    assert_eq!(p.source(), Source::Ram);
    assert_eq!(p.values(), &json!({"lr": 6}));
    let err = p.read_into(&mut []).unwrap_err();
    assert!(
        err.to_string().contains("differs from the verified one"),
        "{err}"
    );
    // Unchanged since planning: the planned header is the checked one.
    let acp_core::Opened::Pending(p) = e.open_load(&req).unwrap() else {
        panic!("a resident step is checked by its copy");
    };
    let ck = p.read_into(&mut []).unwrap();
    assert_eq!(ck.values(), &json!({"lr": 7}));
    assert_eq!(ck.report().source, Source::Ram);
    assert_intact(&ck, &data);
    drop(ck);
    e.close().unwrap();
}

fn snapshot(e: &Engine, step: u64, data: &[(String, Vec<u8>)]) {
    let never = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    save_opts(e, step, data, &json!({}), &never);
    // Summed in the background.
    e.wait_idle(None).unwrap();
}

/// A RAM snapshot that is not persisted gets quick sums, not blake3
/// digests (none are recorded in its slot), and a load serves it from RAM
/// checked against them; a byte changed afterwards is caught.
#[test]
fn a_ram_snapshot_is_summed_and_checked_by_its_sums() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = engine(&root, &shm);
    snapshot(&e, 1, &data);
    let (file, image) = slot_of(&shm, 1);
    let peek = acp_core::staging::peek_slot(&file).unwrap().unwrap();
    assert!(!peek.digests_valid, "a snapshot is not hashed with blake3");
    for _ in 0..2 {
        let ck = load(&e, 1);
        assert_eq!(ck.report().source, Source::Ram);
        assert!(ck.report().verified);
        assert_intact(&ck, &data);
    }
    flip(&file, image + (7 << 20) + 5);
    let err = e
        .load(&LoadRequest {
            step: Some(1),
            ..LoadRequest::default()
        })
        .unwrap_err()
        .to_string();
    assert!(err.contains("differ from the quick sum"), "{err}");
    assert!(err.contains("`a.w`"), "{err}");
    assert!(
        err.contains(file.file_name().unwrap().to_str().unwrap()),
        "{err}"
    );
    drop(e);
}

/// `load_into` of a RAM snapshot checks each chunk against its sum and
/// copies it in the same pass (the load is pending until that copy, as for
/// a committed resident step); a chunk changed afterwards fails the load,
/// naming the tensor, with nothing but old bytes and the slot's bytes in
/// the destinations, and a load without a step then takes the committed
/// step before it, with or without `fallback`.
#[test]
fn load_into_a_ram_snapshot_checks_each_chunk_as_it_copies_it() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let older: Vec<(String, Vec<u8>)> = data
        .iter()
        .map(|(n, d)| (n.clone(), d.iter().map(|b| b ^ 0x5A).collect()))
        .collect();
    let e = engine(&root, &shm);
    save(&e, 1, &older);
    snapshot(&e, 2, &data);
    let step = |s| LoadRequest {
        step: s,
        ..LoadRequest::default()
    };
    match e.open_load(&step(Some(2))).unwrap() {
        acp_core::Opened::Pending(p) => {
            assert_eq!(p.source(), Source::Ram);
            assert_eq!(p.step(), 2);
        }
        acp_core::Opened::Ready(_) => panic!("a RAM snapshot is checked by its copy"),
    }
    let fill = |req: &LoadRequest| try_load_into(&e, req, &data);
    for req in [step(Some(2)), step(None)] {
        let (ck, bufs) = fill(&req);
        let ck = ck.unwrap();
        assert_eq!((ck.step(), ck.report().source), (2, Source::Ram));
        assert!(ck.report().verified);
        assert!(ck.report().rejected.is_none());
        assert_filled(&bufs, &data);
        assert_intact(&ck, &data);
    }
    // A byte of `b.w` changed in RAM: asked for by number, an error naming
    // it. Its chunk is copied as it is summed: the destination holds its
    // old bytes or the slot's (the changed one among them).
    let (file, image) = slot_of(&shm, 2);
    let b = {
        let ck = load(&e, 1);
        ck.entries()
            .iter()
            .find(|x| x.name == "b.w")
            .unwrap()
            .offset
    };
    let at = b + (5 << 20) + 3;
    flip(&file, image + at);
    let (got, bufs) = fill(&step(Some(2)));
    let err = got.unwrap_err().to_string();
    assert!(err.contains("differ from the quick sum"), "{err}");
    assert!(err.contains("`b.w`"), "{err}");
    let flipped = usize::try_from(at - b).unwrap();
    for (j, (&got, &want)) in bufs[1].iter().zip(&data[1].1).enumerate() {
        let slot = if j == flipped { want ^ 0x10 } else { want };
        assert!(got == 0xEE || got == slot, "byte {j} of `b.w`: {got:#x}");
    }
    // Without a step, the committed step 1, whatever `fallback` says.
    for fallback in [false, true] {
        let (ck, bufs) = fill(&LoadRequest {
            fallback,
            ..step(None)
        });
        let ck = ck.unwrap();
        assert_eq!(ck.step(), 1);
        assert_filled(&bufs, &older);
        drop(ck);
    }
    drop(e);
}

/// Persisting a summed snapshot hashes it as it is written, and a chunk
/// that no longer gives the sum taken at the snapshot is not committed
/// under digests taken now: the persist fails naming the slot and chunk.
#[test]
fn a_summed_snapshot_changed_in_ram_is_not_persisted() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = engine(&root, &shm);
    snapshot(&e, 1, &data);
    snapshot(&e, 2, &data);
    // Unchanged: persisted, hashed on the way, and loadable from storage.
    e.persist_resident(2).unwrap().wait().unwrap();
    assert_eq!(e.steps().unwrap(), [2]);
    let ck = e
        .load(&LoadRequest {
            step: Some(2),
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap();
    assert_intact(&ck, &data);
    drop(ck);
    snapshot(&e, 3, &data);
    let (file, image) = slot_of(&shm, 3);
    // Chunk 100 of 64 KiB chunks.
    flip(&file, image + 100 * (64 << 10) + 9);
    let err = e
        .persist_resident(3)
        .unwrap()
        .wait()
        .unwrap_err()
        .to_string();
    assert!(err.contains("chunk 100 changed in RAM"), "{err}");
    assert!(
        err.contains(file.file_name().unwrap().to_str().unwrap()),
        "{err}"
    );
    assert_eq!(e.steps().unwrap(), [2], "step 3 is not committed");
    drop(e);
}

/// The same through the packed writer (a compressed file): it checks each
/// chunk's sum in its own pass as it hashes it.
#[test]
fn a_summed_snapshot_changed_in_ram_is_not_persisted_compressed() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors();
    let e = Engine::open(
        EngineConfig::new(&root)
            .with_shm_dir(&shm)
            .with_job("quick")
            .with_ring_bytes(128 << 20)
            .with_chunk_bytes(64 << 10)
            .with_copy_threads(2)
            .with_compress(acp_core::Compress::Zstd),
    )
    .unwrap();
    snapshot(&e, 1, &data);
    let (file, image) = slot_of(&shm, 1);
    flip(&file, image + 100 * (64 << 10) + 9);
    let err = e
        .persist_resident(1)
        .unwrap()
        .wait()
        .unwrap_err()
        .to_string();
    assert!(err.contains("chunk 100 changed in RAM"), "{err}");
    assert_eq!(e.steps().unwrap(), Vec::<u64>::new(), "not committed");
    drop(e);
}
