//! The engine keeps the last header it parsed from an image, with the
//! bytes it was parsed from, so that restoring the same resident image
//! again does not parse its header again. What it keeps is found by those
//! bytes alone: a slot rewritten by a later save, or a header byte changed
//! in shared memory between two loads, is parsed afresh, and the load
//! still gives exactly the saved bytes and values, or reads storage.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use acp_core::{
    Checkpoint, Dtype, Engine, EngineConfig, HostTensor, LoadRequest, Opened, SaveOptions, Source,
};
use serde_json::json;

/// Two tensors over several 64 KiB chunks; `k` changes every byte.
fn tensors(k: u8) -> Vec<(String, Vec<u8>)> {
    ["a.w", "b.w"]
        .iter()
        .enumerate()
        .map(|(j, n)| {
            let data = (0..(3u32 << 20))
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8 ^ j as u8 ^ k)
                .collect();
            ((*n).to_owned(), data)
        })
        .collect()
}

fn engine(root: &Path, shm: &Path) -> Engine {
    Engine::open(
        EngineConfig::new(root)
            .with_shm_dir(shm)
            .with_job("kept")
            .with_ring_bytes(32 << 20)
            .with_ring_slots(2)
            .with_chunk_bytes(64 << 10)
            .with_copy_threads(2),
    )
    .unwrap()
}

fn save(e: &Engine, step: u64, data: &[(String, Vec<u8>)], values: &serde_json::Value) {
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
    e.save(step, &host, values, &SaveOptions::default())
        .unwrap()
        .wait()
        .unwrap();
}

fn request(step: u64) -> LoadRequest {
    LoadRequest {
        step: Some(step),
        ..LoadRequest::default()
    }
}

/// `load_into` of `step` into fresh buffers filled with 0xEE.
fn load_into(e: &Engine, step: u64, data: &[(String, Vec<u8>)]) -> (Checkpoint, Vec<Vec<u8>>) {
    let (ck, bufs) = try_load_into(e, step, data);
    (ck.unwrap(), bufs)
}

/// [`load_into`], its error returned.
fn try_load_into(
    e: &Engine,
    step: u64,
    data: &[(String, Vec<u8>)],
) -> (acp_core::Result<Checkpoint>, Vec<Vec<u8>>) {
    let mut bufs: Vec<Vec<u8>> = data.iter().map(|(_, d)| vec![0xEE; d.len()]).collect();
    let mut into: Vec<(&str, &mut [u8])> = data
        .iter()
        .zip(bufs.iter_mut())
        .map(|((n, _), b)| (n.as_str(), b.as_mut_slice()))
        .collect();
    let ck = e.load_into(&request(step), &mut into);
    drop(into);
    (ck, bufs)
}

fn assert_filled(bufs: &[Vec<u8>], data: &[(String, Vec<u8>)]) {
    for (b, (n, d)) in bufs.iter().zip(data) {
        assert!(b == d, "tensor `{n}`");
    }
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

#[test]
fn loads_of_one_resident_image_share_its_header_and_a_new_save_does_not() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let e = engine(&root, &shm);
    // Two slots: steps 3 and 5 go where 1 and 3 were, each a header of
    // the same length as the one before it there, of other bytes.
    let mut last: Option<Checkpoint> = None;
    for step in 1..=5u64 {
        let data = tensors(step as u8);
        let values = json!({"step": step, "lr": 0.5});
        save(&e, step, &data, &values);
        let (a, bufs) = load_into(&e, step, &data);
        assert_eq!(a.report().source, Source::Ram, "step {step}");
        assert_eq!(a.values(), &values);
        assert_filled(&bufs, &data);
        let (b, bufs) = load_into(&e, step, &data);
        assert_eq!(b.report().source, Source::Ram);
        assert_filled(&bufs, &data);
        // The second load of the same bytes took the kept header.
        assert!(Arc::ptr_eq(a.header(), b.header()), "step {step}");
        if let Some(prev) = &last {
            assert!(!Arc::ptr_eq(prev.header(), b.header()), "step {step}");
        }
        last = Some(b);
    }
    drop(last);
    e.close().unwrap();
}

#[test]
fn a_header_byte_changed_after_it_was_kept_is_parsed_again_and_caught() {
    let t = tempfile::tempdir().unwrap();
    let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
    std::fs::create_dir(&shm).unwrap();
    let data = tensors(0);
    let e = engine(&root, &shm);
    save(&e, 1, &data, &json!({"lr": 7}));
    // Loaded twice: its header is kept.
    for _ in 0..2 {
        let (ck, bufs) = load_into(&e, 1, &data);
        assert_eq!(ck.report().source, Source::Ram);
        assert_eq!(ck.values(), &json!({"lr": 7}));
        assert_filled(&bufs, &data);
    }
    // The value 7 in the slot's header becomes 6 (the values are JSON
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
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.write_all_at(b"6", at).unwrap();
    // Planned from the bytes the slot holds now, not the kept header...
    let Opened::Pending(p) = e.open_load(&request(1)).unwrap() else {
        panic!("a resident step is checked by its copy");
    };
    assert_eq!(p.source(), Source::Ram);
    assert_eq!(p.values(), &json!({"lr": 6}));
    drop(p);
    // ...whose check fails: the load planned from the changed header is
    // refused (storage's verified header is not the planned one), and the
    // slot is dropped, so the next load reads storage, whose values and
    // bytes are the saved ones.
    let err = try_load_into(&e, 1, &data).0.unwrap_err();
    assert_eq!(err.kind(), acp_core::ErrorKind::Corrupt, "{err}");
    let (ck, bufs) = load_into(&e, 1, &data);
    assert_eq!(ck.report().source, Source::Storage);
    assert_eq!(ck.values(), &json!({"lr": 7}));
    assert_filled(&bufs, &data);
    drop(ck);
    e.close().unwrap();
}
