//! Readying slots off the save path (`Ring::warm_next`): an open only maps
//! the slots a previous process left, and the warming faults them in
//! without changing a byte; free slots grow to the saves' size before a
//! save needs them; a save never reports the ring full because of it.

use std::path::Path;
use std::sync::mpsc::Receiver;
use std::sync::Barrier;
use std::thread::JoinHandle;

use acp_core::staging::{Ring, RingOptions, SlotState};

const MIB: u64 = 1 << 20;

fn opts(dir: &Path, slots: usize) -> RingOptions {
    RingOptions {
        dir: dir.to_path_buf(),
        prefix: "acp-test-r00000".to_owned(),
        job_tag: [0x5A; 32],
        rank: 0,
        slots,
        budget: slots as u64 * 8 * MIB,
        shared_budget: false,
        chunk_bytes: MIB,
        mlock: true,
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i % 251) as u8))
        .collect()
}

fn save(ring: &Ring, step: u64, len: usize) {
    let mut s = ring
        .acquire(len as u64, None)
        .expect("acquire")
        .expect("a free slot");
    s.image_mut()[..len].copy_from_slice(&pattern(step as u8, len));
    drop(s.seal(step, len as u64));
}

/// Calls `warm_next(len)` until it has nothing left; returns how often it
/// did something.
fn warm_all(ring: &Ring, len: Option<u64>) -> usize {
    let mut n = 0;
    while ring.warm_next(len).expect("warm_next") {
        n += 1;
        assert!(n <= 16, "warm_next never runs out of work");
    }
    n
}

#[test]
fn recovered_slots_are_warmed_in_place_and_free_ones_grown() {
    let dir = tempfile::tempdir().unwrap();
    let len = 3 * MIB as usize + 123;
    {
        let (ring, _) = Ring::open(opts(dir.path(), 3)).unwrap();
        save(&ring, 1, len);
        save(&ring, 2, len);
        for s in ring.complete() {
            ring.set_state(s.slot, SlotState::Persisted);
        }
    }
    let (ring, report) = Ring::open(opts(dir.path(), 3)).unwrap();
    assert_eq!(report.recovered.len(), 2);
    // The two recovered slots, each once; the third was never grown.
    assert_eq!(warm_all(&ring, None), 2);
    for s in ring.complete() {
        let pin = ring.pin(s.slot).unwrap();
        assert_eq!(
            pin.image(),
            &pattern(s.step as u8, len)[..],
            "step {}",
            s.step
        );
    }
    // Given the saves' size, the free slot grows, once.
    let free = (0..3)
        .find(|i| ring.complete().iter().all(|s| s.slot != *i))
        .unwrap();
    let before = std::fs::metadata(ring.slot_path(free)).unwrap().len();
    assert_eq!(warm_all(&ring, Some(len as u64)), 1);
    let after = std::fs::metadata(ring.slot_path(free)).unwrap().len();
    assert!(
        before < len as u64 && after > len as u64,
        "{before} -> {after}"
    );
    assert_eq!(warm_all(&ring, Some(len as u64)), 0);
    // The recovered images are untouched, and a save takes the grown slot
    // rather than evict one of them.
    save(&ring, 3, len);
    let steps: Vec<u64> = ring.complete().iter().map(|s| s.step).collect();
    assert_eq!(steps, vec![3, 2, 1]);
    let (locked, why) = ring.mlock_state();
    assert_eq!(locked, why.is_none());
}

#[test]
fn a_save_waits_for_the_slot_being_grown_instead_of_finding_the_ring_full() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 1)).unwrap();
    let len = 2 * MIB as usize;
    for round in 0..8u64 {
        // Each round needs a bigger image, so the slot grows again.
        let want = len as u64 + round * 512 * 1024;
        let start = Barrier::new(2);
        std::thread::scope(|s| {
            s.spawn(|| {
                start.wait();
                warm_all(&ring, Some(want));
            });
            start.wait();
            // Whichever comes first, the save gets the only slot: it grows
            // it itself, or waits for the warming to let go of it.
            let mut slot = ring
                .acquire(want, None)
                .expect("acquire")
                .expect("the only slot, not `None` (ring full)");
            slot.image_mut()[..4].copy_from_slice(b"abcd");
            let pin = slot.seal(round + 1, 4);
            assert_eq!(pin.image(), b"abcd");
            ring.release(pin.slot());
        });
    }
}

/// A ring reopened over `dir` after a process left step 1 (`len` bytes)
/// in it: its slot is recovered, mapped and not yet warmed.
fn reopened_with_one_image(dir: &Path, len: usize) -> Ring {
    {
        let (ring, _) = Ring::open(opts(dir, 2)).expect("opening the ring");
        save(&ring, 1, len);
        for s in ring.complete() {
            ring.set_state(s.slot, SlotState::Persisted);
        }
    }
    let (ring, report) = Ring::open(opts(dir, 2)).expect("reopening the ring");
    assert_eq!(report.recovered.len(), 1);
    ring
}

/// One `warm_next` on another thread; its result comes on the receiver.
fn warm_once(ring: &Ring) -> (Receiver<Result<bool, String>>, JoinHandle<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let ring = ring.clone();
    let thread = std::thread::Builder::new()
        .name("test-warm".into())
        .spawn(move || {
            let did = ring.warm_next(None).map_err(|e| e.to_string());
            // The test may have ended waiting: nobody to tell.
            let _ = tx.send(did);
        })
        .expect("starting the warming thread");
    (rx, thread)
}

#[test]
fn a_load_in_progress_holds_the_warming_back() {
    let dir = tempfile::tempdir().unwrap();
    let len = 3 * MIB as usize;
    let ring = reopened_with_one_image(dir.path(), len);
    let load = ring.defer_warming();
    let second = ring.defer_warming();
    let (rx, warming) = warm_once(&ring);
    assert!(
        rx.recv_timeout(std::time::Duration::from_millis(300))
            .is_err(),
        "the recovered slot was warmed while a load was in progress"
    );
    drop(load);
    assert!(
        rx.recv_timeout(std::time::Duration::from_millis(200))
            .is_err(),
        "the warming went on while a second load was in progress"
    );
    drop(second);
    let did = rx
        .recv_timeout(std::time::Duration::from_secs(5))
        .expect("the warming goes on once the loads are done");
    assert_eq!(did, Ok(true));
    warming.join().unwrap();
    let pin = ring.pin(ring.complete()[0].slot).unwrap();
    assert_eq!(pin.image(), &pattern(1, len)[..]);
}

#[test]
fn stopping_the_warming_does_not_wait_out_a_load() {
    // An engine's close stops its warming thread and waits for it: a load
    // still holding its deferral (a zero-copy load's views kept alive)
    // must not hold the close for the deferral's seconds.
    let dir = tempfile::tempdir().unwrap();
    let len = 3 * MIB as usize;
    let ring = reopened_with_one_image(dir.path(), len);
    let load = ring.defer_warming();
    let (rx, warming) = warm_once(&ring);
    assert!(
        rx.recv_timeout(std::time::Duration::from_millis(300))
            .is_err(),
        "the recovered slot was warmed while a load was in progress"
    );
    ring.stop_warming();
    // Well under the deferral's cap of 5 s after the load began.
    let did = rx
        .recv_timeout(std::time::Duration::from_secs(2))
        .expect("a stopped warming ends without waiting for the load");
    assert_eq!(
        did,
        Ok(false),
        "a slot left part-way is not reported warmed"
    );
    warming.join().unwrap();
    drop(load);
    assert!(!ring.warm_next(Some(len as u64)).unwrap());
    // The image is intact and readable.
    let pin = ring.pin(ring.complete()[0].slot).unwrap();
    assert_eq!(pin.image(), &pattern(1, len)[..]);
}
