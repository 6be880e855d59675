//! Scratch directories (checkpoint root and ring) and the engine
//! configuration the benches share.

use std::path::{Path, PathBuf};

use acp_core::EngineConfig;

/// A checkpoint root under `ACP_BENCH_DIR` (default `/tmp`) and a ring
/// directory under `ACP_BENCH_SHM` (default `/dev/shm`), both unique to
/// this process and bench, removed on drop (close the engine first).
#[derive(Debug)]
pub struct Scratch {
    name: String,
    dir: PathBuf,
    shm: PathBuf,
}

impl Scratch {
    /// Creates `acp-bench-{name}-{pid}` in both places.
    ///
    /// # Panics
    /// When a directory cannot be created.
    #[must_use]
    pub fn new(name: &str) -> Scratch {
        let base = std::env::var_os("ACP_BENCH_DIR").map_or_else(|| "/tmp".into(), PathBuf::from);
        let shm_base =
            std::env::var_os("ACP_BENCH_SHM").map_or_else(|| "/dev/shm".into(), PathBuf::from);
        let leaf = format!("acp-bench-{name}-{}", std::process::id());
        let dir = base.join(&leaf);
        let shm = shm_base.join(&leaf);
        for d in [&dir, &shm] {
            std::fs::create_dir_all(d)
                .unwrap_or_else(|e| panic!("creating scratch dir {}: {e}", d.display()));
        }
        Scratch {
            name: leaf,
            dir,
            shm,
        }
    }

    /// The scratch directory on the storage under test.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The checkpoint root inside it (created by the engine).
    #[must_use]
    pub fn root(&self) -> PathBuf {
        self.dir.join("ckpt")
    }

    /// The ring directory.
    #[must_use]
    pub fn shm(&self) -> &Path {
        &self.shm
    }

    /// A unique job id for the engine.
    #[must_use]
    pub fn job(&self) -> &str {
        &self.name
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        for d in [&self.dir, &self.shm] {
            if let Err(e) = std::fs::remove_dir_all(d) {
                eprintln!("acp-bench: could not remove {}: {e}", d.display());
            }
        }
    }
}

/// An engine configuration on `scratch` whose ring has `slots` slots, each
/// big enough for an image of `image_bytes` of tensor data (plus header and
/// control block); everything else at its default (`io_uring` where allowed,
/// `O_DIRECT` where accepted, 4 MiB chunks, queue depth 8, copy threads =
/// cores up to 8, verify always), but every step written whole (`incremental` off).
#[must_use]
pub fn engine_config(scratch: &Scratch, image_bytes: usize, slots: usize) -> EngineConfig {
    let per_slot = image_bytes as u64 + image_bytes as u64 / 32 + (32 << 20);
    EngineConfig::new(scratch.root())
        .with_shm_dir(scratch.shm())
        .with_job(scratch.job())
        .with_ring_slots(slots)
        .with_ring_bytes(per_slot * slots as u64)
        // Benches save the same state step after step: whole steps, so
        // every flush writes what a training step that changes its
        // weights writes (the incremental rows turn it back on).
        .with_incremental(false)
}

/// Drops the page cache (`echo 3 > /proc/sys/vm/drop_caches`) so the next
/// read of a file comes from the device.
///
/// # Errors
/// Why it was refused (not root, read-only /proc); the read is then warm.
pub fn drop_caches() -> Result<(), String> {
    std::fs::write("/proc/sys/vm/drop_caches", "3")
        .map_err(|e| format!("/proc/sys/vm/drop_caches: {e}"))
}
