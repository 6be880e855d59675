//! The RAM tier's quick sums in the slot's control block, beside the
//! blake3 digests: recorded only beside the digests they were taken with,
//! found again by the next process that opens the ring, and unmade
//! exactly when the digests are (recorded again, or the slot acquired or
//! released), including by a writer that knows nothing of sums.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::os::unix::fs::FileExt;
use std::path::Path;

use acp_core::staging::{slot_path, user_dir, PinnedSlot, Ring, RingOptions, SlotState};

const MIB: u64 = 1 << 20;
/// Where the digest area starts (after the header page; the staging
/// module docs).
const DIGESTS_AT: u64 = 4096;

fn opts(dir: &Path) -> RingOptions {
    RingOptions {
        dir: dir.to_path_buf(),
        prefix: "sums".to_owned(),
        job_tag: [0x33; 32],
        rank: 0,
        slots: 2,
        budget: 8 * MIB,
        shared_budget: false,
        chunk_bytes: MIB,
        mlock: false,
    }
}

fn private_user_dir(shm: &Path) {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(user_dir(shm))
        .unwrap();
}

/// A sealed image of `step` over three 1 MiB chunks (the last one short),
/// `Persisted`, with digests recorded.
fn sealed(ring: &Ring, step: u64) -> PinnedSlot {
    let len = (2 * MIB + 5000) as usize;
    let mut s = ring.acquire(len as u64, None).unwrap().unwrap();
    for (i, b) in s.image_mut()[..len].iter_mut().enumerate() {
        *b = (i as u64 * 31 + step) as u8;
    }
    let pin = s.seal(step, len as u64);
    ring.set_state(pin.slot(), SlotState::Persisted);
    ring.set_digests(pin.slot(), &digests(step));
    pin
}

fn digests(step: u64) -> Vec<[u8; 32]> {
    (0..3u8).map(|k| [k ^ step as u8; 32]).collect()
}

const SUMS: [u64; 3] = [11, 22, 33];

#[test]
fn sums_outlive_the_process_that_recorded_them() {
    let t = tempfile::tempdir().unwrap();
    private_user_dir(t.path());
    let slot;
    {
        let (ring, _) = Ring::open(opts(t.path())).unwrap();
        let pin = sealed(&ring, 7);
        slot = pin.slot();
        assert_eq!(ring.quick_sums(slot), None, "none before they are recorded");
        ring.record_quick_sums(slot, &digests(7), &SUMS);
        assert_eq!(ring.quick_sums(slot), Some(SUMS.to_vec()));
    }
    let (ring, report) = Ring::open(opts(t.path())).unwrap();
    assert!(report
        .recovered
        .iter()
        .any(|i| i.slot == slot && i.has_digests));
    assert_eq!(ring.quick_sums(slot), Some(SUMS.to_vec()));
    ring.unlink_all();
}

#[test]
fn sums_are_kept_only_beside_the_digests_they_were_taken_with() {
    let t = tempfile::tempdir().unwrap();
    private_user_dir(t.path());
    let (ring, _) = Ring::open(opts(t.path())).unwrap();
    let pin = sealed(&ring, 7);
    let slot = pin.slot();
    // Other digests, or another count of sums: ignored.
    ring.record_quick_sums(slot, &digests(8), &SUMS);
    assert_eq!(ring.quick_sums(slot), None);
    ring.record_quick_sums(slot, &digests(7), &SUMS[..2]);
    assert_eq!(ring.quick_sums(slot), None);
    // New digests unmake the sums.
    ring.record_quick_sums(slot, &digests(7), &SUMS);
    ring.set_digests(slot, &digests(9));
    assert_eq!(ring.quick_sums(slot), None);
    // So does a slot taken again for a new image, and a release.
    ring.record_quick_sums(slot, &digests(9), &SUMS);
    assert_eq!(ring.quick_sums(slot), Some(SUMS.to_vec()));
    drop(pin);
    ring.release(slot);
    assert_eq!(ring.quick_sums(slot), None);
    let pin = sealed(&ring, 9);
    assert_eq!(ring.quick_sums(pin.slot()), None);
    drop(pin);
    ring.unlink_all();
}

#[test]
fn digests_rewritten_by_a_writer_that_knows_nothing_of_sums_unmake_them() {
    let t = tempfile::tempdir().unwrap();
    private_user_dir(t.path());
    let slot;
    {
        let (ring, _) = Ring::open(opts(t.path())).unwrap();
        let pin = sealed(&ring, 7);
        slot = pin.slot();
        ring.record_quick_sums(slot, &digests(7), &SUMS);
    }
    // What an older version recording other digests of the same count
    // leaves: new digest bytes, the old sums record after them untouched.
    let path = slot_path(t.path(), "sums", slot);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xEE; 32], DIGESTS_AT + 32).unwrap();
    drop(f);
    let (ring, _) = Ring::open(opts(t.path())).unwrap();
    let mut want = digests(7);
    want[1] = [0xEE; 32];
    assert_eq!(ring.digests(slot), Some(want));
    assert_eq!(ring.quick_sums(slot), None, "a record of other digests");
    ring.unlink_all();
}
