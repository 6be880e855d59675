//! Torture: change a stored compressed data file — flip a random byte of
//! its head, frame table or frames, truncate it, or append to it — then
//! load it from storage and verify it:
//! - a load never returns bytes other than those saved, never panics and
//!   never hangs;
//! - every change is an error naming the file (`Corrupt`, or
//!   `Unsupported` for a version field that grew), and `acp verify`
//!   reports the step as not intact.
//!
//! CI: 100 trials; `ACP_TORTURE_FULL=1`: 2,000.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use acp_core::format::{FRAME_ENTRY_BYTES, PACKED_HEAD_BYTES};
use acp_core::ops::{verify, Quiet};
use acp_core::{Compress, Engine, EngineConfig, ErrorKind, LoadRequest};
use torture_util::{check, dirs, report, save, trials, Rng};

#[test]
fn a_changed_compressed_file_is_never_loaded() {
    let (_t, root, shm) = dirs();
    let engine = Engine::open(
        EngineConfig::new(&root)
            .with_shm_dir(&shm)
            .with_job("torture-compressed")
            .with_ring_bytes(8 << 20)
            .with_chunk_bytes(64 << 10)
            .with_mlock(false)
            .with_compress(Compress::Zstd)
            .with_release_on_close(true),
    )
    .unwrap();
    save(&engine, 1).unwrap().wait().unwrap();
    let file = root.join("step-000000000001/rank-00000.safetensors");
    let pristine = std::fs::read(&file).unwrap();
    let n = u32::from_le_bytes(pristine[12..16].try_into().unwrap()) as u64;
    let table_end = PACKED_HEAD_BYTES + n * FRAME_ENTRY_BYTES;
    let count = trials(100, 2_000);
    let mut rng = Rng::new(17, 0xC0DE);
    let mut failures = Vec::new();
    for trial in 0..count {
        let mut bytes = pristine.clone();
        let len = bytes.len() as u64;
        let what = match rng.below(10) {
            // Mostly flips: in the head and table as often as in frames.
            0..=3 => {
                let at = rng.below(table_end) as usize;
                bytes[at] ^= 1 << rng.below(8);
                format!("flip of byte {at} (head or table)")
            }
            4..=7 => {
                let at = (table_end + rng.below(len - table_end)) as usize;
                bytes[at] ^= 1 << rng.below(8);
                format!("flip of byte {at} (frames)")
            }
            8 => {
                let to = rng.below(len) as usize;
                bytes.truncate(to);
                format!("truncation to {to} bytes")
            }
            _ => {
                bytes.extend_from_slice(&[0u8; 3]);
                "3 bytes appended".to_owned()
            }
        };
        std::fs::write(&file, &bytes).unwrap();
        let got = engine.load(&LoadRequest {
            step: Some(1),
            storage_only: true,
            ..LoadRequest::default()
        });
        match got {
            Ok(ck) => {
                let extra = check(&ck).err().unwrap_or_default();
                failures.push(format!("trial {trial}: {what}: loaded {extra}"));
            }
            Err(e) => {
                let named = e.to_string().contains(&file.display().to_string());
                if !matches!(e.kind(), ErrorKind::Corrupt | ErrorKind::Unsupported) || !named {
                    failures.push(format!("trial {trial}: {what}: {e}"));
                }
            }
        }
        match verify(&root, Some(1), false, &Quiet) {
            Ok(r) if r.ok => failures.push(format!("trial {trial}: {what}: verify said intact")),
            _ => {}
        }
    }
    std::fs::write(&file, &pristine).unwrap();
    let ck = engine
        .load(&LoadRequest {
            step: Some(1),
            storage_only: true,
            ..LoadRequest::default()
        })
        .unwrap();
    check(&ck).unwrap();
    drop(ck);
    engine.close().unwrap();
    report("compressed", count, &failures);
}
