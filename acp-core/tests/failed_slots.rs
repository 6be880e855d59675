//! A slot whose flush failed is given up when the ring needs room, and
//! only while it still holds the image whose flush failed: once the slot
//! is reused, the record of the failure no longer frees it.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use acp_core::storage::faults::FaultInjector;
use acp_core::{Engine, EngineConfig, LoadRequest, WhenFull};
use torture_util::{check, dirs, save};

fn config(root: &Path, shm: &Path, faults: &Arc<FaultInjector>) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("failed-slots")
        .with_ring_slots(2)
        .with_ring_bytes(8 << 20)
        .with_chunk_bytes(64 << 10)
        .with_mlock(false)
        .with_when_full(WhenFull::Skip)
        .with_faults(Arc::clone(faults))
}

#[test]
fn a_reused_slot_is_not_freed_by_the_failure_of_its_previous_image() {
    let (_t, root, shm) = dirs();
    // The first storage operation of the first flush fails.
    let faults = Arc::new(FaultInjector::fail_at(0, libc::EIO, false));
    let engine = Engine::open(config(&root, &shm, &faults)).unwrap();
    assert!(save(&engine, 1).unwrap().wait().is_err());
    assert_eq!(
        engine.resident_steps(),
        [1],
        "kept resident after the failure"
    );

    // Step 1 again: its old image is dropped and the slot taken again; its
    // flush hangs (a stalled disk) until healed.
    faults.arm_stall(0, Duration::from_secs(600));
    let retry = save(&engine, 1).unwrap();
    // Step 2 takes the other slot and queues behind it; step 3 finds no
    // room: the only slot recorded as failed now holds step 1's new image,
    // which is unflushed and must stay.
    let second = save(&engine, 2).unwrap();
    let third = save(&engine, 3).unwrap();
    let resident = engine.resident_steps();
    faults.heal();
    assert!(third.wait().unwrap().skipped, "step 3 is skipped");
    assert_eq!(resident, [2, 1], "step 1's new image was given up");

    retry.wait().unwrap();
    second.wait().unwrap();
    assert_eq!(engine.steps().unwrap(), [1, 2]);
    check(&engine.load(&LoadRequest::default()).unwrap()).unwrap();
    engine.close().unwrap();
}
