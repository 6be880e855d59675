//! `Manifest::parse` on untrusted bytes, for the step and rank the first
//! bytes choose: never panics; an accepted manifest is the asked one's.
#![no_main]

use std::path::Path;

use acp_core::format::Manifest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (head, body) = data.split_at(data.len().min(3));
    let step = u64::from(head.first().copied().unwrap_or(0));
    let rank = u32::from(head.get(1).copied().unwrap_or(0) % 4);
    let path = Path::new("rank-00000.manifest.json");
    if let Ok(m) = Manifest::parse(path, body, step, rank) {
        assert_eq!((m.step, m.rank), (step, rank));
        assert!(m.rank < m.world_size);
    }
});
