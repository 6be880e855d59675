//! The ring's slot state machine within one process: acquire, seal, pin,
//! release, back-pressure, reuse order, growth and digests.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use acp_core::staging::{Ring, RingOptions, SlotInfo, SlotState};
use acp_core::ErrorKind;

const MIB: u64 = 1 << 20;

fn opts(dir: &Path, slots: usize, budget: u64) -> RingOptions {
    RingOptions {
        dir: dir.to_path_buf(),
        prefix: "acp-test-r00000".to_owned(),
        job_tag: [0xA5; 32],
        rank: 0,
        slots,
        budget,
        shared_budget: false,
        chunk_bytes: MIB,
        mlock: false,
    }
}

/// Deterministic bytes for `seed`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

/// Stages `len` bytes of `pattern(step)` and seals them as `step`.
fn save(ring: &Ring, step: u64, len: usize) -> acp_core::staging::PinnedSlot {
    let mut s = ring
        .acquire(len as u64, None)
        .expect("acquire")
        .expect("a free slot");
    s.image_mut()[..len].copy_from_slice(&pattern(step, len));
    s.seal(step, len as u64)
}

#[test]
fn acquire_seal_pin_release_cycle() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, report) = Ring::open(opts(dir.path(), 2, 8 * MIB)).unwrap();
    assert!(report.recovered.is_empty());
    assert_eq!(report.discarded_half_staged, 0);
    assert!(!report.mlocked);
    assert!(ring.complete().is_empty());

    let len = 300_000;
    let mut s = ring.acquire(len as u64, None).unwrap().unwrap();
    let slot = s.slot();
    let area = s.image_mut();
    assert!(
        area.len() >= 303_104 && area.len() % 4096 == 0,
        "{}",
        area.len()
    );
    assert_eq!(area.as_ptr() as usize % 4096, 0);
    area.fill(0xEE);
    area[..len].copy_from_slice(&pattern(5, len));
    let pinned = s.seal(5, len as u64);
    assert_eq!((pinned.slot(), pinned.step()), (slot, 5));
    assert_eq!(pinned.image(), &pattern(5, len)[..]);
    let padded = pinned.padded();
    assert_eq!(padded.len(), 303_104);
    assert_eq!(padded.as_ptr() as usize % 4096, 0);
    assert!(padded[len..].iter().all(|&b| b == 0), "padding is zeroed");
    assert_eq!(
        ring.complete(),
        vec![SlotInfo {
            slot,
            step: 5,
            len: len as u64,
            state: SlotState::Resident,
            has_digests: false,
        }]
    );

    let again = ring.pin(slot).unwrap();
    assert_eq!(again.image(), pinned.image());
    ring.set_state(slot, SlotState::Flushing);
    assert_eq!(ring.complete()[0].state, SlotState::Flushing);
    ring.set_state(slot, SlotState::Persisted);
    assert_eq!(ring.complete()[0].state, SlotState::Persisted);

    // Released while pinned: gone from the listing at once, memory kept
    // until the pins drop.
    ring.release(slot);
    assert!(ring.complete().is_empty());
    assert_eq!(ring.pin(slot).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(again.image(), &pattern(5, len)[..]);
    drop(again);
    drop(pinned);
    assert_eq!(ring.pin(slot).unwrap_err().kind(), ErrorKind::NotFound);
    assert_eq!(ring.pin(99).unwrap_err().kind(), ErrorKind::NotFound);

    // Both slots usable again.
    let a = save(&ring, 6, 1000);
    let b = save(&ring, 7, 1000);
    assert_ne!(a.slot(), b.slot());
    let steps: Vec<u64> = ring.complete().iter().map(|i| i.step).collect();
    assert_eq!(steps, vec![7, 6], "newest first");
}

#[test]
fn dropping_an_unsealed_slot_frees_it() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 1, 4 * MIB)).unwrap();
    let s = ring.acquire(10, None).unwrap().unwrap();
    assert!(
        ring.acquire(10, None).unwrap().is_none(),
        "the only slot is staging"
    );
    assert_eq!(ring.pin(0).unwrap_err().kind(), ErrorKind::NotFound);
    drop(s);
    assert!(ring.complete().is_empty());
    assert!(ring.acquire(10, None).unwrap().is_some());
}

#[test]
fn image_over_budget_is_invalid() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 2, 8 * MIB)).unwrap();
    let max = ring.max_image_bytes();
    // 4 MiB per slot, one header page and one digest page.
    assert_eq!(max, 4 * MIB - 8192);
    assert_eq!(max % 4096, 0);
    let err = ring.acquire(max + 1, None).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    let mut s = ring.acquire(max, None).unwrap().unwrap();
    assert_eq!(s.image_mut().len() as u64, max);
    let file = std::fs::metadata(ring.slot_path(s.slot())).unwrap().len();
    assert!(
        file <= 4 * MIB,
        "slot file of {file} bytes exceeds its share"
    );
}

#[test]
fn impossible_options_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 0, 8 * MIB);
    assert_eq!(
        Ring::open(o.clone()).unwrap_err().kind(),
        ErrorKind::Invalid
    );
    o.slots = 4;
    o.budget = 16 * 1024;
    assert_eq!(
        Ring::open(o.clone()).unwrap_err().kind(),
        ErrorKind::Invalid
    );
    o.budget = 8 * MIB;
    o.prefix = "../escape".to_owned();
    assert_eq!(Ring::open(o).unwrap_err().kind(), ErrorKind::Invalid);
}

#[test]
fn full_ring_returns_none_or_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 2, 8 * MIB)).unwrap();
    drop(save(&ring, 1, 4096));
    drop(save(&ring, 2, 4096));
    // Both Resident (unpinned): neither may be reused.
    assert!(ring.acquire(4096, None).unwrap().is_none());
    let err = ring
        .acquire(4096, Some(Duration::from_millis(50)))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Timeout, "{err}");
    // Flushing is not reusable either.
    ring.set_state(0, SlotState::Flushing);
    assert!(ring.acquire(4096, None).unwrap().is_none());
}

fn two_resident(dir: &Path) -> Ring {
    let (ring, _) = Ring::open(opts(dir, 2, 8 * MIB)).expect("open");
    drop(save(&ring, 1, 4096));
    drop(save(&ring, 2, 4096));
    ring
}

fn spawn_waiter(ring: &Ring) -> std::thread::JoinHandle<usize> {
    let ring = ring.clone();
    std::thread::Builder::new()
        .name("ring-waiter".to_owned())
        .spawn(move || {
            let s = ring
                .acquire(4096, Some(Duration::from_secs(20)))
                .expect("acquire")
                .expect("a slot, not None, with a wait");
            s.slot()
        })
        .expect("spawn")
}

#[test]
fn waiter_is_woken_by_persisted() {
    let dir = tempfile::tempdir().unwrap();
    let ring = two_resident(dir.path());
    let waiter = spawn_waiter(&ring);
    std::thread::sleep(Duration::from_millis(50));
    ring.set_state(1, SlotState::Persisted);
    ring.notify();
    assert_eq!(waiter.join().unwrap(), 1);
}

#[test]
fn waiter_is_woken_by_release() {
    let dir = tempfile::tempdir().unwrap();
    let ring = two_resident(dir.path());
    let pin = ring.pin(0).unwrap();
    let waiter = spawn_waiter(&ring);
    std::thread::sleep(Duration::from_millis(50));
    // Released while pinned: freed, and the waiter woken, when the pin drops.
    ring.release(0);
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished());
    drop(pin);
    assert_eq!(waiter.join().unwrap(), 0);
}

#[test]
fn persisted_reuse_takes_the_oldest_step() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 3, 12 * MIB)).unwrap();
    let slots: Vec<usize> = [10, 5, 7]
        .iter()
        .map(|&s| save(&ring, s, 4096).slot())
        .collect();
    for &s in &slots {
        ring.set_state(s, SlotState::Persisted);
    }
    let first = ring.acquire(4096, None).unwrap().unwrap();
    assert_eq!(first.slot(), slots[1], "step 5 is the oldest");
    let second = ring.acquire(4096, None).unwrap().unwrap();
    assert_eq!(second.slot(), slots[2], "then step 7");
    let steps: Vec<u64> = ring.complete().iter().map(|i| i.step).collect();
    assert_eq!(steps, vec![10]);
}

#[test]
fn free_slots_come_before_persisted_ones() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 2, 8 * MIB)).unwrap();
    let a = save(&ring, 1, 4096).slot();
    ring.set_state(a, SlotState::Persisted);
    let s = ring.acquire(4096, None).unwrap().unwrap();
    assert_ne!(s.slot(), a);
    assert_eq!(ring.complete().len(), 1);
}

#[test]
fn pinned_slots_are_never_handed_out() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 2, 8 * MIB)).unwrap();
    let old = save(&ring, 1, 4096);
    let new = save(&ring, 2, 4096);
    ring.set_state(old.slot(), SlotState::Persisted);
    ring.set_state(new.slot(), SlotState::Persisted);
    let copy = old.clone();
    drop(old);
    let new_slot = new.slot();
    // Both pinned: nothing to hand out.
    assert!(ring.acquire(4096, None).unwrap().is_none());
    drop(new);
    // The oldest is pinned (by the clone): the other one is taken.
    let s = ring.acquire(4096, None).unwrap().unwrap();
    assert_eq!(s.slot(), new_slot);
    // While staging, it is not handed out either.
    assert!(ring.acquire(4096, None).unwrap().is_none());
    drop(s);
    // Now slot `new_slot` is Free and taken again; the pinned one never.
    let s = ring.acquire(4096, None).unwrap().unwrap();
    assert_eq!(s.slot(), new_slot);
    assert!(
        ring.acquire(4096, None).unwrap().is_none(),
        "the pinned slot stays"
    );
    assert_eq!(copy.image(), &pattern(1, 4096)[..]);
    drop(copy);
    assert!(ring.acquire(4096, None).unwrap().is_some());
}

#[test]
fn slots_grow_in_2_mib_steps_and_keep_working() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 1, 8 * MIB)).unwrap();
    let path = ring.slot_path(0);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        4096,
        "header page only"
    );

    let p = save(&ring, 1, 100_000);
    let small = std::fs::metadata(&path).unwrap().len();
    assert_eq!(small, 8192 + 2 * MIB);
    ring.release(0);
    drop(p);

    // A slightly bigger image fits the same file.
    let p = save(&ring, 2, 2_000_000);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), small);
    ring.release(0);
    drop(p);

    // A bigger one regrows it, capped at the share of the budget.
    let len = 5 * MIB as usize;
    let p = save(&ring, 3, len);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 8192 + 6 * MIB);
    assert_eq!(p.image(), &pattern(3, len)[..]);
    ring.release(0);
    drop(p);

    let len = ring.max_image_bytes() as usize;
    let p = save(&ring, 4, len);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 8 * MIB);
    assert_eq!(p.image(), &pattern(4, len)[..]);
    ring.release(0);
    drop(p);

    // Smaller images reuse the big slot.
    let p = save(&ring, 5, 10);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 8 * MIB);
    assert_eq!(p.image(), &pattern(5, 10)[..]);
}

#[test]
fn digests_are_recorded_and_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 2, 8 * MIB)).unwrap();
    let p = save(&ring, 1, 3 * MIB as usize);
    let slot = p.slot();
    assert_eq!(ring.digests(slot), None);
    let d: Vec<[u8; 32]> = (0..3u8).map(|i| [i; 32]).collect();
    ring.set_digests(slot, &d);
    assert_eq!(ring.digests(slot), Some(d.clone()));
    assert!(ring.complete()[0].has_digests);

    // More digests than the area holds (4 MiB share / 1 MiB chunks = 4
    // slots, rounded up to a page = 128): ignored, old ones kept.
    ring.set_digests(slot, &vec![[9; 32]; 129]);
    assert_eq!(ring.digests(slot), Some(d));

    ring.set_state(slot, SlotState::Persisted);
    ring.release(slot);
    drop(p);
    assert_eq!(ring.digests(slot), None);
    let p = save(&ring, 2, 10);
    assert_eq!(ring.digests(p.slot()), None);
    assert!(!ring.complete()[0].has_digests);
}

#[test]
fn ring_is_send_sync_and_handles_move_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Ring>();
    assert_send_sync::<acp_core::staging::PinnedSlot>();
    assert_send_sync::<acp_core::staging::StagingSlot>();

    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 3, 12 * MIB)).unwrap();
    let ring = Arc::new(ring);
    let workers: Vec<_> = (0..4u64)
        .map(|w| {
            let ring = Arc::clone(&ring);
            std::thread::Builder::new()
                .name(format!("ring-worker-{w}"))
                .spawn(move || {
                    for i in 0..40u64 {
                        let step = w * 1000 + i;
                        let len = 4096 + (step as usize % 7) * 3000;
                        let mut s = ring
                            .acquire(len as u64, Some(Duration::from_secs(20)))
                            .unwrap()
                            .unwrap();
                        s.image_mut()[..len].copy_from_slice(&pattern(step, len));
                        let p = s.seal(step, len as u64);
                        let reader = p.clone();
                        let check = std::thread::Builder::new()
                            .name(format!("ring-reader-{w}"))
                            .spawn(move || reader.image() == &pattern(step, len)[..])
                            .unwrap();
                        assert!(check.join().unwrap(), "image of step {step} changed");
                        ring.set_state(p.slot(), SlotState::Persisted);
                        assert_eq!(p.image(), &pattern(step, len)[..]);
                    }
                })
                .unwrap()
        })
        .collect();
    for w in workers {
        w.join().unwrap();
    }
    assert_eq!(ring.complete().len(), 3);
}

/// Minor page faults taken by the calling thread so far.
fn minor_faults() -> i64 {
    // SAFETY: all-zero bytes are a valid `rusage` (plain integers).
    let mut r: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `r` is a valid, writable `rusage` that outlives the call.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &raw mut r) };
    assert_eq!(rc, 0);
    r.ru_minflt
}

/// Invariant 5: the copy into a slot takes no page fault, on a slot just
/// grown by `acquire` and on a reused one (on tmpfs, where the ring lives).
#[test]
fn staging_writes_take_no_page_fault() {
    let shm = Path::new("/dev/shm");
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let mut o = opts(shm, 1, 8 * MIB);
    o.prefix = format!("acp-ringtest-faults-{}-{nanos}", std::process::id());
    let (ring, _) = Ring::open(o).unwrap();
    let _cleanup = UnlinkOnDrop(ring.clone());
    for round in 0..2u8 {
        let mut s = ring.acquire(6 * MIB, None).unwrap().unwrap();
        let area = s.image_mut();
        let before = minor_faults();
        area.fill(round + 1);
        let faults = minor_faults() - before;
        assert!(
            faults < 8,
            "round {round}: {faults} faults writing {} pages",
            area.len() / 4096
        );
        drop(s.seal(u64::from(round), 6 * MIB));
        ring.release(0);
    }
}

/// Unlinks a ring's files even when the test fails.
struct UnlinkOnDrop(Ring);

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        self.0.unlink_all();
    }
}

#[test]
fn reserve_grows_free_slots_only_and_keeps_images() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 3, 24 * MIB)).unwrap();
    let len = 3 * MIB as usize;
    let size = |slot: usize| std::fs::metadata(ring.slot_path(slot)).unwrap().len();
    assert!(
        (0..3).all(|s| size(s) < len as u64),
        "fresh slots are a header page"
    );

    // A persisted image in slot 0 is a restorable copy: reserve leaves it.
    let pinned = save(&ring, 7, 1000);
    let kept = pinned.slot();
    ring.set_state(kept, SlotState::Flushing);
    ring.set_state(kept, SlotState::Persisted);
    drop(pinned);
    let before = size(kept);

    assert_eq!(ring.reserve(len as u64).unwrap(), 2);
    for slot in (0..3).filter(|&s| s != kept) {
        assert!(
            size(slot) >= len as u64,
            "slot {slot} grown to {}",
            size(slot)
        );
    }
    assert_eq!(size(kept), before);
    let complete = ring.complete();
    assert_eq!(complete.len(), 1);
    assert_eq!((complete[0].step, complete[0].slot), (7, kept));
    assert_eq!(ring.pin(kept).unwrap().image(), pattern(7, 1000).as_slice());

    // Idempotent, and the grown slots are the ones the next saves take.
    assert_eq!(ring.reserve(len as u64).unwrap(), 2);
    let s = ring.acquire(len as u64, None).unwrap().unwrap();
    assert_ne!(s.slot(), kept);
    drop(s);

    // Too big for a slot: refused, naming the capacity.
    let e = ring.reserve(25 * MIB).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
}

#[test]
fn a_release_by_generation_spares_a_slot_acquired_again() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 1, 8 << 20)).unwrap();
    let first = save(&ring, 1, 4096);
    let (slot, old) = (first.slot(), first.generation());
    assert_eq!(ring.generation(slot), Some(old));
    drop(first);
    ring.release(slot);
    assert_eq!(ring.generation(slot), None, "free: no image");
    let second = save(&ring, 2, 4096);
    assert_eq!(second.slot(), slot);
    assert_ne!(second.generation(), old);
    drop(second);
    assert!(!ring.release_generation(slot, old), "names the old image");
    assert_eq!(ring.complete()[0].step, 2);
    assert!(ring.release_generation(slot, ring.generation(slot).unwrap()));
    assert!(ring.complete().is_empty());
}

/// Bytes of the ring's slot files in `dir`.
fn ring_file_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(acp_core::staging::user_dir(dir))
        .expect("the ring's directory")
        .map(|f| f.and_then(|f| f.metadata()).expect("a slot file").len())
        .sum()
}

#[test]
fn a_shared_budget_lets_one_slot_take_it_and_saves_take_turns() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 2, 24 * MIB);
    o.shared_budget = true;
    let (ring, _) = Ring::open(o).unwrap();
    // 14 MiB: past an even split's 12 MiB, within the budget.
    let len = 14 << 20;
    assert!(ring.max_image_bytes() >= len as u64);
    let first = save(&ring, 1, len).slot();
    assert!(ring_file_bytes(dir.path()) <= 24 * MIB);
    // Resident, not persisted: the other slot has no room to grow, and
    // the only image is not given up.
    assert!(ring.acquire(len as u64, None).unwrap().is_none());
    assert!(ring.reserve(len as u64).unwrap() == 0);
    assert!(!ring.warm_next(Some(len as u64)).unwrap());
    // A save waiting for a slot gets the first one once it is persisted.
    let waiter = {
        let ring = ring.clone();
        std::thread::Builder::new()
            .name("ring-waiter".to_owned())
            .spawn(move || {
                let mut s = ring
                    .acquire(len as u64, Some(Duration::from_secs(20)))
                    .expect("acquire")
                    .expect("a slot, not None, with a wait");
                s.image_mut()[..len].copy_from_slice(&pattern(2, len));
                s.seal(2, len as u64).slot()
            })
            .expect("spawn")
    };
    std::thread::sleep(Duration::from_millis(50));
    assert!(!waiter.is_finished());
    ring.set_state(first, SlotState::Persisted);
    assert_eq!(waiter.join().unwrap(), first);
    let steps: Vec<u64> = ring.complete().iter().map(|i| i.step).collect();
    assert_eq!(steps, [2]);
    assert!(ring_file_bytes(dir.path()) <= 24 * MIB);
    // Small images: both slots fit the budget side by side.
    ring.set_state(first, SlotState::Persisted);
    let a = save(&ring, 3, 4 << 20);
    let b = save(&ring, 4, 4 << 20);
    assert_ne!(a.slot(), b.slot());
    assert!(ring_file_bytes(dir.path()) <= 24 * MIB);
}

/// Slots sized for smaller images do not keep a shared budget from a
/// larger one: a save empties the others it may give up (free slots
/// first, then persisted ones, oldest step first), their memory given
/// back, and takes a slot. It used to wait forever: every slot's file
/// counted against the budget, whatever its state.
#[test]
fn a_shared_budget_empties_smaller_slots_for_a_larger_image() {
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 2, 24 * MIB);
    o.shared_budget = true;
    let (ring, _) = Ring::open(o).unwrap();
    let small = 10 << 20;
    let large = 14 << 20;
    let wait = Some(Duration::from_millis(500));
    // Both slots persisted at 10 MiB: the save takes the older step's
    // slot and empties the other.
    for step in [1, 2] {
        let slot = save(&ring, step, small).slot();
        ring.set_state(slot, SlotState::Persisted);
    }
    let mut s = ring.acquire(large as u64, wait).unwrap().expect("a slot");
    s.image_mut()[..large].copy_from_slice(&pattern(3, large));
    let slot = s.seal(3, large as u64).slot();
    let steps: Vec<u64> = ring.complete().iter().map(|i| i.step).collect();
    assert_eq!(steps, [3]);
    assert!(ring_file_bytes(dir.path()) <= 24 * MIB);
    assert_eq!(ring.pin(slot).unwrap().image(), &pattern(3, large)[..]);
    // Both slots free at 10 MiB (two smaller images staged side by side,
    // then dropped unsealed): a larger one gets a slot at once.
    drop(ring);
    let dir = tempfile::tempdir().unwrap();
    let mut o = opts(dir.path(), 2, 24 * MIB);
    o.shared_budget = true;
    let (ring, _) = Ring::open(o).unwrap();
    let a = ring.acquire(small as u64, wait).unwrap().expect("a slot");
    let b = ring.acquire(small as u64, wait).unwrap().expect("a slot");
    drop((a, b));
    assert!(ring.complete().is_empty());
    let grown = ring.acquire(large as u64, wait).unwrap().expect("a slot");
    assert!(ring_file_bytes(dir.path()) <= 24 * MIB);
    drop(grown);
    // A resident step that is not persisted is never emptied: no room.
    let mut s = ring.acquire(large as u64, wait).unwrap().expect("a slot");
    s.image_mut()[..large].copy_from_slice(&pattern(5, large));
    let five = s.seal(5, large as u64);
    let e = ring.acquire(large as u64, wait).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Timeout, "{e}");
    assert_eq!(five.image(), &pattern(5, large)[..]);
}

#[test]
fn an_even_split_refuses_an_image_past_its_share() {
    let dir = tempfile::tempdir().unwrap();
    let (ring, _) = Ring::open(opts(dir.path(), 2, 24 * MIB)).unwrap();
    let e = ring.acquire(14 << 20, None).unwrap_err();
    assert_eq!(e.kind(), acp_core::ErrorKind::Invalid, "{e}");
}

#[test]
fn a_load_never_takes_the_slot_of_a_newer_step() {
    let dir = tempfile::tempdir().unwrap();
    let len = 4096;
    {
        let (ring, _) = Ring::open(opts(dir.path(), 2, 8 * MIB)).unwrap();
        for step in [3, 5] {
            let slot = save(&ring, step, len).slot();
            ring.set_state(slot, SlotState::Persisted);
        }
    }
    // A restarted process: the slots are mapped, and the warming readies
    // the newest first; the oldest is still cold.
    let (ring, _) = Ring::open(opts(dir.path(), 2, 8 * MIB)).unwrap();
    assert!(ring.warm_next(None).unwrap());
    // A load of step 4 finds no ready slot it may take: the only one ready
    // holds step 5, which it must not evict, and step 3's is cold.
    assert!(ring.acquire_ready(len as u64, 4).unwrap().is_none());
    assert!(ring.warm_next(None).unwrap());
    // Both ready: step 4 takes the slot of step 3, the oldest, and step 2
    // takes none (every step in the ring is newer).
    assert!(ring.acquire_ready(len as u64, 2).unwrap().is_none());
    let s = ring.acquire_ready(len as u64, 4).unwrap().unwrap();
    drop(s);
    let steps: Vec<u64> = ring.complete().iter().map(|i| i.step).collect();
    assert_eq!(steps, [5]);
}
