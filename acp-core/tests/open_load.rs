//! `Engine::open_load` and `PendingLoad::read_into`, the two phases of a
//! restore from storage into the caller's memory:
//! - a step read from storage comes back pending, its entries and values
//!   from the verified header, its data not read (nothing resident yet);
//!   from a resident slot, it comes back pending too, its source RAM (the
//!   slot's check is done by the copy);
//! - `read_into` fills the destinations named by entry index with the saved
//!   bytes, and the step becomes resident as after `load`;
//! - a changed header is refused, naming the file, by `open_load` (which
//!   reads it unverified, checked against the index) or by `read_into`
//!   (which checks its chunk and compares it with what was planned);
//! - with `fallback`, `load_into` of a newest step whose data fails during
//!   the read fills every tensor with the previous step's bytes.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::os::unix::fs::FileExt;

use acp_core::{Compress, Error, LoadRequest, Opened, Source};
use serde_json::json;

mod six_tensors;
use six_tensors::{
    committed, fresh_engine, name, ready_slots, save_six, tensor, TENSORS, TENSOR_BYTES,
};

fn storage(step: Option<u64>) -> LoadRequest {
    LoadRequest {
        step,
        storage_only: true,
        ..LoadRequest::default()
    }
}

#[test]
fn a_storage_step_opens_pending_and_its_read_fills_the_destinations() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _) = committed(dir.path(), Compress::None);
    let engine = fresh_engine(&root, dir.path(), "pending", |c| c);
    let Opened::Pending(p) = engine.open_load(&storage(Some(1))).unwrap() else {
        panic!("a storage load is not pending");
    };
    assert_eq!(p.step(), 1);
    assert_eq!(p.values(), &json!({"step": 1}));
    assert_eq!(p.entries().len(), TENSORS);
    assert!(engine.resident_steps().is_empty(), "read before read_into");
    let mut bufs: Vec<Vec<u8>> = (0..TENSORS).map(|_| vec![0; TENSOR_BYTES]).collect();
    let mut into: Vec<(usize, &mut [u8])> = bufs
        .iter_mut()
        .enumerate()
        .map(|(k, b)| {
            let i = p.entries().iter().position(|e| e.name == name(k)).unwrap();
            (i, b.as_mut_slice())
        })
        .collect();
    let ck = p.read_into(&mut into).unwrap();
    assert_eq!(ck.report().source, Source::Storage);
    for (k, b) in bufs.iter().enumerate() {
        assert!(*b == tensor(k), "w.{k}");
    }
    drop(ck);
    // No slot was ready (a fresh ring): streamed into the destinations,
    // kept nowhere. With the slots ready, a load makes it resident.
    assert!(engine.resident_steps().is_empty());
    ready_slots(&engine);
    drop(engine.load(&storage(Some(1))).unwrap());
    assert_eq!(engine.resident_steps(), vec![1]);
    // Resident now: pending from RAM, checked and copied in one pass.
    let req = LoadRequest {
        step: Some(1),
        ..LoadRequest::default()
    };
    let Opened::Pending(p) = engine.open_load(&req).unwrap() else {
        panic!("a resident load is checked by its copy");
    };
    assert_eq!(p.source(), Source::Ram);
    let mut bufs: Vec<Vec<u8>> = (0..TENSORS).map(|_| vec![0; TENSOR_BYTES]).collect();
    let mut into: Vec<(usize, &mut [u8])> = bufs
        .iter_mut()
        .enumerate()
        .map(|(k, b)| {
            let i = p.entries().iter().position(|e| e.name == name(k)).unwrap();
            (i, b.as_mut_slice())
        })
        .collect();
    let ck = p.read_into(&mut into).unwrap();
    assert_eq!(ck.report().source, Source::Ram);
    for (k, b) in bufs.iter().enumerate() {
        assert!(*b == tensor(k), "w.{k}");
    }
    drop(ck);
    engine.close().unwrap();
}

#[test]
fn a_changed_header_is_refused_by_the_open_or_by_the_read() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::None);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    // Bytes of the header's JSON: a tensor's name, a digit of an offset, a
    // value. Each is refused, naming the file: when opening (the index
    // disagrees, or it does not parse), else by the read, which checks the
    // header's chunk and compares what it planned with.
    let head = {
        let mut p = [0u8; 8];
        f.read_exact_at(&mut p, 0).unwrap();
        let n = usize::try_from(u64::from_le_bytes(p)).unwrap();
        let mut h = vec![0u8; n];
        f.read_exact_at(&mut h, 8).unwrap();
        String::from_utf8(h).unwrap()
    };
    let at_name = head.find("w.3").unwrap() + 2;
    let at_offset = head.find("data_offsets\":[").unwrap() + 15;
    let at_value = head.find("acp.values").unwrap() + 14;
    for (case, at) in [
        ("name", at_name),
        ("offset", at_offset),
        ("value", at_value),
    ] {
        let at = 8 + at as u64;
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, at).unwrap();
        let flipped = if b[0].is_ascii_digit() {
            b'0' + (b[0] - b'0' + 1) % 10
        } else {
            b[0] ^ 0x01
        };
        f.write_all_at(&[flipped], at).unwrap();
        let engine = fresh_engine(&root, dir.path(), case, |c| c);
        let got = match engine.open_load(&storage(Some(1))) {
            Ok(Opened::Pending(p)) => {
                let mut bufs: Vec<Vec<u8>> = p
                    .entries()
                    .iter()
                    .map(|e| vec![0; usize::try_from(e.len).unwrap()])
                    .collect();
                let mut into: Vec<(usize, &mut [u8])> =
                    bufs.iter_mut().map(Vec::as_mut_slice).enumerate().collect();
                p.read_into(&mut into).map(drop)
            }
            Ok(Opened::Ready(_)) => panic!("{case}: not pending"),
            Err(e) => Err(e),
        };
        match got {
            Err(Error::Corrupt { path, .. }) => assert_eq!(path, file, "{case}"),
            Err(e) => panic!("{case}: not Corrupt: {e}"),
            Ok(()) => panic!("{case}: a changed header was loaded"),
        }
        assert!(engine.resident_steps().is_empty(), "{case}");
        engine.close().unwrap();
        f.write_all_at(&b, at).unwrap();
    }
}

#[test]
fn load_into_falls_back_when_the_newest_step_fails_during_the_read() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _) = committed(dir.path(), Compress::None);
    // Step 2: every byte of each tensor flipped from step 1's.
    let engine = fresh_engine(&root, dir.path(), "save2", |c| c);
    let data: Vec<Vec<u8>> = (0..TENSORS)
        .map(|i| tensor(i).iter().map(|b| !b).collect())
        .collect();
    save_six(&engine, 2, &data);
    engine.close().unwrap();
    let file2 = root.join("step-000000000002/rank-00000.safetensors");
    let len = std::fs::metadata(&file2).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&file2)
        .unwrap();
    f.write_all_at(&[0x42], len - 100).unwrap();

    let engine = fresh_engine(&root, dir.path(), "fallback", |c| c);
    let names: Vec<String> = (0..TENSORS).map(name).collect();
    let mut bufs: Vec<Vec<u8>> = (0..TENSORS).map(|_| vec![0xee; TENSOR_BYTES]).collect();
    let mut into: Vec<(&str, &mut [u8])> = names
        .iter()
        .map(String::as_str)
        .zip(bufs.iter_mut().map(Vec::as_mut_slice))
        .collect();
    let e = engine.load_into(&storage(None), &mut into).unwrap_err();
    assert!(matches!(e, Error::Corrupt { .. }), "{e}");
    let req = LoadRequest {
        fallback: true,
        ..storage(None)
    };
    let ck = engine.load_into(&req, &mut into).unwrap();
    assert_eq!(ck.step(), 1);
    drop(ck);
    drop(into);
    for (k, b) in bufs.iter().enumerate() {
        assert!(*b == tensor(k), "w.{k} is not step 1's");
    }
    engine.close().unwrap();
}
