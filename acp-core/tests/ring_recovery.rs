//! What a ring finds when it is opened again: images left by a previous
//! process (or ring), half-staged slots, foreign or corrupt control blocks,
//! a live holder of the same slots, and the result of a `SIGKILL`.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use acp_core::staging::{slot_path, user_dir, PinnedSlot, Ring, RingOptions, SlotState};
use acp_core::ErrorKind;

const MIB: u64 = 1 << 20;
/// Offset of the state word in a control block (see the staging module docs).
const STATE_OFFSET: u64 = 12;
/// Offset of `image_len`.
const IMAGE_LEN_OFFSET: u64 = 24;

fn opts(dir: &Path, prefix: &str) -> RingOptions {
    RingOptions {
        dir: dir.to_path_buf(),
        prefix: prefix.to_owned(),
        job_tag: [0x5A; 32],
        rank: 3,
        slots: 2,
        budget: 8 * MIB,
        shared_budget: false,
        chunk_bytes: MIB,
        mlock: false,
    }
}

/// Creates this user's private slot directory under `shm`, as a ring would.
fn private_user_dir(shm: &Path) {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(user_dir(shm))
        .expect("the per-user slot directory");
}

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

fn save(ring: &Ring, step: u64, len: usize) -> PinnedSlot {
    let mut s = ring
        .acquire(len as u64, None)
        .expect("acquire")
        .expect("a free slot");
    s.image_mut()[..len].copy_from_slice(&pattern(step, len));
    s.seal(step, len as u64)
}

fn poke_u32(path: &Path, at: u64, v: u32) {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .expect("open slot file");
    f.write_all_at(&v.to_le_bytes(), at).expect("poke");
}

#[test]
fn images_survive_the_ring_and_are_recovered_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(dir.path(), "survive");
    let len = 1_500_000;
    {
        let (ring, _) = Ring::open(o.clone()).unwrap();
        let a = save(&ring, 11, len);
        let b = save(&ring, 12, 777);
        ring.set_state(a.slot(), SlotState::Persisted);
        ring.set_digests(a.slot(), &[[1; 32], [2; 32]]);
        ring.set_state(b.slot(), SlotState::Flushing);
    }
    let (ring, report) = Ring::open(o).unwrap();
    assert_eq!(report.discarded_half_staged, 0);
    let found: Vec<(u64, u64, SlotState, bool)> = report
        .recovered
        .iter()
        .map(|i| (i.step, i.len, i.state, i.has_digests))
        .collect();
    assert_eq!(
        found,
        vec![
            (12, 777, SlotState::Flushing, false),
            (11, len as u64, SlotState::Persisted, true),
        ]
    );
    assert_eq!(ring.complete(), report.recovered);
    let a = ring.pin(report.recovered[1].slot).unwrap();
    assert_eq!(a.step(), 11);
    assert_eq!(a.image(), &pattern(11, len)[..]);
    assert_eq!(ring.digests(a.slot()), Some(vec![[1; 32], [2; 32]]));
    let b = ring.pin(report.recovered[0].slot).unwrap();
    assert_eq!(b.image(), &pattern(12, 777)[..]);
    // Recovered slots are reused like any other.
    drop(a);
    assert!(
        ring.acquire(10, None).unwrap().is_some(),
        "the persisted one"
    );
}

#[test]
fn a_half_staged_slot_is_discarded_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(dir.path(), "half");
    let (kept, torn) = {
        let (ring, _) = Ring::open(o.clone()).unwrap();
        (save(&ring, 1, 5000).slot(), save(&ring, 2, 5000).slot())
    };
    // As a death between acquire and the seal's state store leaves it.
    poke_u32(&slot_path(dir.path(), "half", torn), STATE_OFFSET, 1);
    let (ring, report) = Ring::open(o.clone()).unwrap();
    assert_eq!(report.discarded_half_staged, 1);
    assert_eq!(report.recovered.len(), 1);
    assert_eq!(
        (report.recovered[0].slot, report.recovered[0].step),
        (kept, 1)
    );
    assert_eq!(ring.pin(torn).unwrap_err().kind(), ErrorKind::NotFound);
    drop(ring);
    // It was reset to Free, so it is not counted twice.
    let (_ring, report) = Ring::open(o).unwrap();
    assert_eq!(report.discarded_half_staged, 0);
    assert_eq!(report.recovered.len(), 1);
}

#[test]
fn a_control_block_with_insane_fields_is_not_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(dir.path(), "insane");
    let slot = {
        let (ring, _) = Ring::open(o.clone()).unwrap();
        save(&ring, 1, 5000).slot()
    };
    // image_len far past the capacity.
    poke_u32(
        &slot_path(dir.path(), "insane", slot),
        IMAGE_LEN_OFFSET + 4,
        1,
    );
    let (_ring, report) = Ring::open(o).unwrap();
    assert!(report.recovered.is_empty());
    assert_eq!(report.discarded_half_staged, 0);
}

#[test]
fn another_job_tag_or_rank_is_not_recovered() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(dir.path(), "tagged");
    drop(save(&Ring::open(o.clone()).unwrap().0, 1, 5000));

    let mut other_rank = o.clone();
    other_rank.rank = 4;
    let (ring, report) = Ring::open(other_rank).unwrap();
    assert!(report.recovered.is_empty());
    assert!(ring.complete().is_empty());
    drop(ring);

    drop(save(&Ring::open(o.clone()).unwrap().0, 2, 5000));
    let mut other_job = o.clone();
    other_job.job_tag[0] ^= 1;
    let (ring, report) = Ring::open(other_job).unwrap();
    assert!(report.recovered.is_empty());
    assert_eq!(report.discarded_half_staged, 0);
    drop(ring);
    // The foreign slots were reinitialised, not left for their owner.
    let (_ring, report) = Ring::open(o).unwrap();
    assert!(report.recovered.is_empty());
}

#[test]
fn garbage_in_a_slot_file_is_reinitialised() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(dir.path(), "garbage");
    private_user_dir(dir.path());
    std::fs::write(slot_path(dir.path(), "garbage", 0), vec![0xFF; 10_000]).unwrap();
    let (ring, report) = Ring::open(o).unwrap();
    assert!(report.recovered.is_empty());
    assert_eq!(std::fs::metadata(ring.slot_path(0)).unwrap().len(), 4096);
    let p = save(&ring, 1, 100);
    assert_eq!(p.image(), &pattern(1, 100)[..]);
}

#[test]
fn a_second_open_of_live_slots_is_busy() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(dir.path(), "busy");
    let (ring, _) = Ring::open(o.clone()).unwrap();
    let err = Ring::open(o.clone()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Busy, "{err}");
    let msg = err.to_string();
    assert!(msg.contains("busy-s0"), "{msg}");
    assert!(
        msg.contains(&std::process::id().to_string()),
        "names the holder: {msg}"
    );
    drop(ring);
    Ring::open(o).unwrap();
}

#[test]
fn slot_files_are_private() {
    let dir = tempfile::tempdir().unwrap();
    let o = opts(dir.path(), "private");
    private_user_dir(dir.path());
    let loose = slot_path(dir.path(), "private", 1);
    std::fs::write(&loose, b"").unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o644)).unwrap();
    let (ring, _) = Ring::open(o).unwrap();
    let _p = save(&ring, 1, 3 * MIB as usize);
    for slot in 0..2 {
        let mode = std::fs::metadata(ring.slot_path(slot))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "slot {slot}: {mode:o}");
    }
}

#[test]
fn dev_shm_round_trip() {
    let shm = Path::new("/dev/shm");
    assert!(shm.is_dir(), "/dev/shm is missing");
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let prefix = format!("acp-ringtest-{}-{nanos}", std::process::id());
    let o = opts(shm, &prefix);
    let _cleanup = UnlinkOnDrop(o.clone());
    {
        let (ring, _) = Ring::open(o.clone()).unwrap();
        drop(save(&ring, 42, 1_000_000));
    }
    let (ring, report) = Ring::open(o).unwrap();
    assert_eq!(report.recovered.len(), 1);
    let p = ring.pin(report.recovered[0].slot).unwrap();
    assert_eq!(p.image(), &pattern(42, 1_000_000)[..]);
    ring.unlink_all();
    for slot in 0..2 {
        assert!(!ring.slot_path(slot).exists(), "slot {slot} still linked");
    }
    // The mapping outlives the unlink.
    assert_eq!(p.image(), &pattern(42, 1_000_000)[..]);
}

/// Removes a ring's slot files even when the test fails.
struct UnlinkOnDrop(RingOptions);

impl Drop for UnlinkOnDrop {
    fn drop(&mut self) {
        for slot in 0..self.0.slots {
            let _ = std::fs::remove_file(slot_path(&self.0.dir, &self.0.prefix, slot));
        }
        // Only when empty: other rings of this user may live there.
        let _ = std::fs::remove_dir(user_dir(&self.0.dir));
    }
}

const CRASH_ENV: &str = "ACP_RING_CRASH_DIR";
const STAGING_MARK: &str = "ACP-RING-CHILD-STAGING";
const CRASH_LEN: usize = 1_234_567;

/// The child half of [`sigkill_mid_staging_keeps_the_sealed_image`]; does
/// nothing unless the parent runs it.
#[test]
fn crash_child_stages_until_killed() {
    let Some(dir) = std::env::var_os(CRASH_ENV) else {
        return;
    };
    let (ring, _) = Ring::open(opts(Path::new(&dir), "crash")).unwrap();
    let sealed = save(&ring, 7, CRASH_LEN);
    assert_eq!(sealed.step(), 7);
    let mut s = ring.acquire(CRASH_LEN as u64, None).unwrap().unwrap();
    s.image_mut()[..CRASH_LEN / 2].copy_from_slice(&pattern(8, CRASH_LEN / 2));
    println!("{STAGING_MARK}");
    loop {
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
}

#[test]
fn sigkill_mid_staging_keeps_the_sealed_image() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "crash_child_stages_until_killed",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CRASH_ENV, dir.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = BufReader::new(child.stdout.take().unwrap());
    let mut staged = false;
    for line in out.lines() {
        if line.unwrap().contains(STAGING_MARK) {
            staged = true;
            break;
        }
    }
    child.kill().unwrap(); // SIGKILL
    let status = child.wait().unwrap();
    assert!(staged, "the child ended before staging: {status}");
    assert!(!status.success());

    let (ring, report) = Ring::open(opts(dir.path(), "crash")).unwrap();
    assert_eq!(report.discarded_half_staged, 1, "step 8 was half-staged");
    assert_eq!(report.recovered.len(), 1);
    let info = &report.recovered[0];
    assert_eq!(
        (info.step, info.len, info.state),
        (7, CRASH_LEN as u64, SlotState::Resident)
    );
    let p = ring.pin(info.slot).unwrap();
    assert!(
        p.image() == &pattern(7, CRASH_LEN)[..],
        "step 7 is not bit-exact"
    );
}

#[test]
fn the_per_user_directory_goes_with_the_last_ring_unlinked() {
    let dir = tempfile::tempdir().unwrap();
    let (a, _) = Ring::open(opts(dir.path(), "first")).unwrap();
    let (b, _) = Ring::open(opts(dir.path(), "second")).unwrap();
    let user = user_dir(dir.path());
    let meta = std::fs::symlink_metadata(&user).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.permissions().mode() & 0o7777, 0o700);
    a.unlink_all();
    assert!(user.is_dir(), "the second ring still uses it");
    b.unlink_all();
    assert!(!user.exists(), "empty and unused: removed");
    // A ring opened afterwards makes it again.
    let (c, _) = Ring::open(opts(dir.path(), "third")).unwrap();
    assert!(c.slot_path(0).is_file());
    c.unlink_all();
    assert!(!user.exists());
}
