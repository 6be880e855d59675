//! Engine recovery from a crafted root directory: a few entries (step
//! directories, data files, indexes, pending and trash directories, the
//! `latest` hint, symlinks) made from the input, then `Engine::open` and a
//! load with fallback. Never panics; whatever loads is a step whose index
//! and file agree (checked by the engine itself).
#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use acp_core::{Engine, EngineConfig, LoadRequest};
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
enum Kind {
    StepDir,
    DataFile(Vec<u8>),
    Index(Vec<u8>),
    /// A leftover pending directory of this rank (swept at open).
    Pending,
    Latest(Vec<u8>),
    SymlinkOut,
}

#[derive(Debug, Arbitrary)]
struct Entry {
    step: u8,
    kind: Kind,
}

fn base() -> &'static PathBuf {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        let p = std::env::temp_dir().join(format!("acp-fuzz-recovery-{}", std::process::id()));
        std::fs::create_dir_all(p.join("shm")).expect("fuzz scratch directory");
        p
    })
}

fn step_dir(root: &Path, step: u8) -> PathBuf {
    root.join(format!("step-{:012}", step))
}

fuzz_target!(|entries: Vec<Entry>| {
    let root = base().join("root");
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("fuzz root");
    for e in entries.iter().take(12) {
        let dir = step_dir(&root, e.step % 4);
        let _ = match &e.kind {
            Kind::StepDir => std::fs::create_dir(&dir),
            Kind::DataFile(b) => std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(dir.join("rank-00000.safetensors"), b)),
            Kind::Index(b) => std::fs::create_dir_all(&dir)
                .and_then(|()| std::fs::write(dir.join("model.safetensors.index.json"), b)),
            Kind::Pending => std::fs::create_dir_all(
                root.join(format!(".pending-{:012}-r00000-00000000-1-2", e.step)),
            ),
            Kind::Latest(b) => std::fs::write(root.join("latest"), b),
            Kind::SymlinkOut => std::os::unix::fs::symlink("/etc", &dir),
        };
    }
    let Ok(engine) = Engine::open(
        EngineConfig::new(&root)
            .with_shm_dir(base().join("shm"))
            .with_job("fuzz-recovery")
            .with_ring_bytes(1 << 20)
            .with_ring_slots(1)
            .with_chunk_bytes(4096)
            .with_mlock(false)
            .with_persist_on_open(false),
    ) else {
        return;
    };
    let _ = engine.steps();
    if let Ok(ck) = engine.load(&LoadRequest {
        fallback: true,
        storage_only: true,
        ..LoadRequest::default()
    }) {
        for e in ck.entries() {
            assert_eq!(ck.data(e).len() as u64, e.len);
        }
    }
    let _ = engine.close();
});
