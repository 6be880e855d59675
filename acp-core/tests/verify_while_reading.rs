//! A restore from storage hashes each chunk as soon as it has landed,
//! while later chunks are still being read. With both I/O engines, hashing
//! on the reading thread (1 thread) and in a pool (2 threads):
//! - a changed byte in the middle of a large file is still found, and the
//!   error names the file, the chunk's bytes and the tensor;
//! - an I/O error in the middle of the read, with hashing under way, is
//!   reported naming the file;
//! - neither leaves a slot marked valid: nothing becomes resident, a later
//!   load does not serve the step from RAM, and once the cause is gone the
//!   step loads with its saved bytes.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::os::unix::fs::FileExt;
use std::sync::Arc;

use acp_core::storage::faults::FaultInjector;
use acp_core::{Compress, Engine, Error, ErrorKind, LoadRequest, Source};

mod six_tensors;
use six_tensors::{combos, committed, fresh_engine, name, ready_slots, tensor, CHUNK, TENSORS};

fn storage() -> LoadRequest {
    LoadRequest {
        step: Some(1),
        storage_only: true,
        ..LoadRequest::default()
    }
}

/// A load from storage into a ready ring slot returns the saved bytes and
/// leaves the step resident.
fn assert_saved_bytes(engine: &Engine) {
    ready_slots(engine);
    let ck = engine.load(&storage()).unwrap();
    assert_eq!(ck.report().source, Source::Storage);
    assert!(ck.report().verified);
    for i in 0..TENSORS {
        assert!(ck.tensor(&name(i)).unwrap().data == tensor(i), "w.{i}");
    }
    drop(ck);
    assert_eq!(engine.resident_steps(), vec![1]);
}

#[test]
fn a_changed_chunk_in_the_middle_is_found_and_named() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::None);
    let ck = fresh_engine(&root, dir.path(), "probe", |c| c)
        .load(&storage())
        .unwrap();
    let target = ck
        .entries()
        .iter()
        .find(|e| e.name == "w.3")
        .unwrap()
        .clone();
    drop(ck);
    // A byte in the middle of the file, inside `w.3`.
    let at = target.offset + target.len / 2 + 12_345;
    let chunk_start = at / CHUNK as u64 * CHUNK as u64;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&file)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();

    for (io, threads) in combos() {
        let case = format!("{io:?}, {threads} threads");
        let tag = format!("{io:?}-{threads}");
        let engine = fresh_engine(&root, dir.path(), &tag, |c| {
            c.with_io(io).with_copy_threads(threads)
        });
        // Into a slot: the failed read must not mark it valid.
        ready_slots(&engine);
        let e = engine.load(&storage()).unwrap_err();
        match &e {
            Error::Corrupt {
                path,
                tensor,
                reason,
            } => {
                assert_eq!(path, &file, "{case}: {e}");
                assert_eq!(tensor.as_deref(), Some("w.3"), "{case}: {e}");
                let bytes = format!("bytes {chunk_start}..{}", chunk_start + CHUNK as u64);
                assert!(reason.contains("digest mismatch"), "{case}: {e}");
                assert!(reason.contains(&bytes), "{case}: {e}");
            }
            other => panic!("{case}: not Corrupt: {other}"),
        }
        // No slot was marked valid: nothing is served from RAM.
        assert!(engine.resident_steps().is_empty(), "{case}");
        let e = engine
            .load(&LoadRequest {
                step: Some(1),
                ..LoadRequest::default()
            })
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{case}: {e}");
        assert!(engine.resident_steps().is_empty(), "{case}");
        engine.close().unwrap();
    }

    // Put the byte back: the step loads again.
    f.write_all_at(&b, at).unwrap();
    assert_saved_bytes(&fresh_engine(&root, dir.path(), "healed", |c| c));
}

#[test]
fn an_io_error_mid_read_is_reported_and_marks_nothing_valid() {
    let dir = tempfile::tempdir().unwrap();
    let (root, file) = committed(dir.path(), Compress::None);
    let file_text = file.display().to_string();
    let chunks = std::fs::metadata(&file)
        .unwrap()
        .len()
        .div_ceil(CHUNK as u64);

    for (io, threads) in combos() {
        let case = format!("{io:?}, {threads} threads");
        let tag = format!("{io:?}-{threads}");
        let faults = Arc::new(FaultInjector::counting());
        let engine = fresh_engine(&root, dir.path(), &tag, |c| {
            c.with_io(io)
                .with_copy_threads(threads)
                .with_faults(Arc::clone(&faults))
        });
        // Into a slot: the failed read must not mark it valid.
        ready_slots(&engine);
        // The operations before the first chunk read, in a load: none but
        // the chunk reads are counted on this path.
        let before = faults.ops();
        faults.arm(chunks / 2, libc::EIO, false);
        let e = engine.load(&storage()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Io, "{case}: {e}");
        let text = e.to_string();
        assert!(text.contains(&file_text), "{case}: {e}");
        assert!(text.contains("read"), "{case}: {e}");
        let reads: Vec<String> = faults.log()[usize::try_from(before).unwrap()..].to_vec();
        assert!(
            reads.iter().all(|l| l == &format!("read {file_text}")),
            "{case}: only chunk reads were counted: {reads:?}"
        );
        assert!(
            reads.len() as u64 > chunks / 2,
            "{case}: the fault was mid-read"
        );
        // No slot was marked valid.
        assert!(engine.resident_steps().is_empty(), "{case}");

        // The disk recovers: the same engine loads the saved bytes.
        faults.heal();
        assert_saved_bytes(&engine);
        engine.close().unwrap();
    }
}
