//! `Engine::load_into` fills the caller's tensors in the storage read's own
//! pass (each read copied by the thread that checked its digests). With
//! both I/O engines, hashing on the reading thread (1 thread) and in a pool
//! (2 threads), plain and compressed files:
//! - the tensors get exactly the saved bytes, from storage and from RAM;
//! - a changed byte in the middle of the file is an error naming the file
//!   and the tensor, and no tensor receives a byte that is not the file's:
//!   each byte of `into` is its old value or the saved one, but for the
//!   changed byte, which may have arrived before its chunk's digest was
//!   compared (each chunk is copied and hashed in one pass);
//! - a name the step lacks, or a length that differs, is refused naming
//!   the tensor, and `into` is left as it was;
//! - on a ring with no slot ready (the file streamed into the tensors), a
//!   read that fails part way is an I/O error naming the file, each byte
//!   of `into` is its old value or the saved one, and nothing becomes
//!   resident.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use acp_core::storage::faults::FaultInjector;
use acp_core::{Compress, Engine, Error, ErrorKind, LoadRequest, Source};

mod six_tensors;
use six_tensors::{
    combos, committed, fresh_engine, name, ready_slots, tensor, TENSORS, TENSOR_BYTES,
};

/// What `into` holds before a load.
const OLD: u8 = 0xee;

fn request(storage_only: bool) -> LoadRequest {
    LoadRequest {
        step: Some(1),
        storage_only,
        ..LoadRequest::default()
    }
}

/// Memory for every tensor, filled with [`OLD`].
fn old_bufs() -> Vec<Vec<u8>> {
    (0..TENSORS).map(|_| vec![OLD; TENSOR_BYTES]).collect()
}

/// Loads step 1 per `req` into `bufs` (tensor `i` into `bufs[i]`), in an
/// order other than the file's.
fn load_into(
    engine: &Engine,
    req: &LoadRequest,
    bufs: &mut [Vec<u8>],
) -> Result<acp_core::Checkpoint, Error> {
    let names: Vec<String> = (0..TENSORS).map(name).collect();
    let mut into: Vec<(&str, &mut [u8])> = names
        .iter()
        .map(String::as_str)
        .zip(bufs.iter_mut().map(Vec::as_mut_slice))
        .rev()
        .collect();
    engine.load_into(req, &mut into)
}

#[test]
fn tensors_get_the_saved_bytes_from_storage_and_from_ram() {
    let dir = tempfile::tempdir().unwrap();
    for compress in [Compress::None, Compress::Zstd] {
        let (root, _) = committed(dir.path(), compress);
        for (io, threads) in combos() {
            let case = format!("{compress:?}, {io:?}, {threads} threads");
            let engine = fresh_engine(
                &root,
                dir.path(),
                &format!("{compress:?}-{io:?}-{threads}"),
                |c| c.with_io(io).with_copy_threads(threads),
            );
            // A new node's ring has no slot ready for the image: the file
            // is streamed into the tensors, and kept nowhere else.
            let mut bufs = old_bufs();
            let ck = load_into(&engine, &request(true), &mut bufs).unwrap();
            assert_eq!(ck.report().source, Source::Storage, "{case}");
            assert!(ck.report().verified, "{case}");
            for (i, b) in bufs.iter().enumerate() {
                assert!(*b == tensor(i), "{case}, streamed: w.{i}");
                assert!(ck.tensor(&name(i)).is_none(), "{case}: w.{i} kept");
            }
            assert_eq!(ck.values(), &serde_json::json!({"step": 1}), "{case}");
            drop(ck);
            assert!(engine.resident_steps().is_empty(), "{case}");
            // A load without destinations reads it into private memory,
            // which holds every tensor.
            let ck = engine.load(&request(true)).unwrap();
            assert_eq!(ck.report().source, Source::Storage, "{case}");
            for i in 0..TENSORS {
                assert!(ck.tensor(&name(i)).unwrap().data == tensor(i), "{case}");
            }
            drop(ck);
            assert!(engine.resident_steps().is_empty(), "{case}");
            // With the slots ready, storage is read into one of them.
            ready_slots(&engine);
            for (storage_only, source) in [(true, Source::Storage), (false, Source::Ram)] {
                let mut bufs = old_bufs();
                let ck = load_into(&engine, &request(storage_only), &mut bufs).unwrap();
                assert_eq!(ck.report().source, source, "{case}");
                assert!(ck.report().verified, "{case}");
                for (i, b) in bufs.iter().enumerate() {
                    assert!(*b == tensor(i), "{case}, {source:?}: w.{i}");
                    assert!(ck.tensor(&name(i)).unwrap().data == tensor(i), "{case}");
                }
                drop(ck);
                // The storage read into a ready slot left the step
                // resident, as `load` does.
                assert_eq!(engine.resident_steps(), vec![1], "{case}");
            }
            engine.close().unwrap();
        }
    }
}

#[test]
fn a_changed_chunk_is_named_and_nothing_but_the_files_bytes_reaches_the_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::None);
    let probe = fresh_engine(&root, dir.path(), "probe", |c| c);
    let ck = probe.load(&request(true)).unwrap();
    let target = ck
        .entries()
        .iter()
        .find(|e| e.name == "w.3")
        .unwrap()
        .clone();
    drop(ck);
    probe.close().unwrap();
    // A byte in the middle of the file, inside `w.3`.
    let at = target.offset + target.len / 2 + 12_345;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
    let in_w3 = usize::try_from(at - target.offset).unwrap();

    for (io, threads) in combos() {
        let case = format!("{io:?}, {threads} threads");
        let engine = fresh_engine(&root, dir.path(), &format!("{io:?}-{threads}"), |c| {
            c.with_io(io).with_copy_threads(threads)
        });
        let mut bufs = old_bufs();
        let e = load_into(&engine, &request(true), &mut bufs).unwrap_err();
        match &e {
            Error::Corrupt {
                path,
                tensor,
                reason,
            } => {
                assert_eq!(path, &file, "{case}: {e}");
                assert_eq!(tensor.as_deref(), Some("w.3"), "{case}: {e}");
                assert!(reason.contains("digest mismatch"), "{case}: {e}");
            }
            other => panic!("{case}: not Corrupt: {other}"),
        }
        // Each byte is its old value or the saved one, but the changed
        // byte, which its chunk's pass may have copied before it compared
        // the chunk's digest: it is the old value or the file's.
        for (i, buf) in bufs.iter().enumerate() {
            let saved = tensor(i);
            for (k, (g, s)) in buf.iter().zip(&saved).enumerate() {
                let file_byte = if (i, k) == (3, in_w3) {
                    b[0] ^ 0x5a
                } else {
                    *s
                };
                assert!(
                    *g == OLD || *g == file_byte,
                    "{case}: byte {k} of w.{i} is {g:#x}, neither old nor the file's"
                );
            }
        }
        // Nothing became resident.
        assert!(engine.resident_steps().is_empty(), "{case}");
        engine.close().unwrap();
    }
}

#[test]
fn a_name_or_length_that_differs_is_refused_and_nothing_is_copied() {
    let dir = tempfile::tempdir().unwrap();
    let (root, _) = committed(dir.path(), Compress::None);
    for storage_only in [true, false] {
        let engine = fresh_engine(&root, dir.path(), &format!("refuse-{storage_only}"), |c| c);
        if !storage_only {
            // Resident: the refusal comes from the copy after the load.
            ready_slots(&engine);
            drop(engine.load(&request(true)).unwrap());
            assert_eq!(engine.resident_steps(), vec![1]);
        }
        let mut a = vec![OLD; TENSOR_BYTES];
        let mut b = vec![OLD; TENSOR_BYTES];
        let err = engine
            .load_into(
                &request(storage_only),
                &mut [("w.0", a.as_mut_slice()), ("w.missing", b.as_mut_slice())],
            )
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
        assert!(err.to_string().contains("w.missing"), "{err}");
        let mut short = vec![OLD; TENSOR_BYTES - 1];
        let err = engine
            .load_into(
                &request(storage_only),
                &mut [("w.0", a.as_mut_slice()), ("w.1", short.as_mut_slice())],
            )
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
        assert!(err.to_string().contains("w.1"), "{err}");
        assert!(a.iter().chain(&b).chain(&short).all(|g| *g == OLD));
        engine.close().unwrap();
    }
}

#[test]
fn a_streamed_read_that_fails_part_way_is_an_io_error_and_nothing_is_kept() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::None);
    let file_text = file.display().to_string();
    for (io, threads) in combos() {
        let case = format!("{io:?}, {threads} threads");
        let engine_with = |tag: &str, faults: &Arc<FaultInjector>| {
            fresh_engine(&root, dir.path(), &format!("{tag}-{io:?}-{threads}"), |c| {
                c.with_io(io)
                    .with_copy_threads(threads)
                    .with_faults(Arc::clone(faults))
            })
        };
        // A new node's healthy restore counts the reads (the engine is
        // closed after it: its slots then grow in the background).
        let counter = Arc::new(FaultInjector::counting());
        let probe = engine_with("count", &counter);
        let mut bufs = old_bufs();
        drop(load_into(&probe, &request(true), &mut bufs).unwrap());
        let reads = counter.ops();
        probe.close().unwrap();
        assert!(reads >= 4, "{case}: {reads} reads");
        // On another new node, the same restore fails half way.
        let faults = Arc::new(FaultInjector::counting());
        let engine = engine_with("fail", &faults);
        faults.arm(reads / 2, libc::EIO, false);
        let mut bufs = old_bufs();
        let e = load_into(&engine, &request(true), &mut bufs).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{case}: {e}");
        assert!(e.to_string().contains(&file_text), "{case}: {e}");
        assert!(engine.resident_steps().is_empty(), "{case}");
        // Each byte is old or the file's.
        for (i, b) in bufs.iter().enumerate() {
            let want = tensor(i);
            assert!(
                b.iter().zip(&want).all(|(g, w)| *g == OLD || g == w),
                "{case}: w.{i}"
            );
        }
        // The disk recovers: the same engine streams the saved bytes.
        faults.heal();
        let mut bufs = old_bufs();
        let ck = load_into(&engine, &request(true), &mut bufs).unwrap();
        assert!(ck.tensor(&name(0)).is_none(), "{case}: streamed, not kept");
        drop(ck);
        assert!(
            bufs.iter().enumerate().all(|(i, b)| *b == tensor(i)),
            "{case}"
        );
        engine.close().unwrap();
    }
}
