//! acp-core: the asynchronous checkpoint engine.
//!
//! A training loop calls [`Engine::save`] every few steps. The call returns
//! once the tensors' bytes are copied into a pre-faulted shared-memory ring
//! slot (the *stall*); a background thread then writes the slot to storage
//! with io_uring and `O_DIRECT`, hashes it with blake3 on the way, and
//! commits the step atomically. The newest checkpoint stays *resident* in
//! shared memory, so a restarted process restores it at memory speed
//! ([`Engine::load`]), and a checkpoint staged by a process that was
//! SIGKILLed before its flush finished is persisted by the next one.
//!
//! Each rank's file is a plain safetensors file; a step directory holds one
//! per rank plus `model.safetensors.index.json`, whose writing (by a rename)
//! is the commit. See [`format`](mod@format) for the byte layout and the commit protocol.
//!
//! # Layers
//!
//! Each module uses only the ones below it (or beside it, on its own
//! line); nothing imports upwards, and `tests/layering.rs` checks every
//! `crate::` path in the source against this table:
//!
//! ```text
//! bin/acp.rs      the `acp` binary: argv in, exit code out
//! cli             the command line (clap), shared with the wheel's `acp`
//! ops             list, inspect, verify, export, import, diff, gc, persist, shm
//! engine          Engine: save, flush, load, recovery at open, retention,
//!                 the reclaim of expired rings (which `acp gc --shm` reports)
//! replica         the Transport seam: replica slots and what peers hold
//! read            the one verified reader of committed data files
//! io              IoEngine: io_uring / psync bulk reads and writes
//! staging, storage   the shared-memory ring; the Storage seam (LocalStorage,
//!                 and the opener of regular files that `io` re-exports)
//! format, codec   the on-disk format: header, index, digests, dtypes;
//!                 the chunk codec of compressed files (byte planes, zstd)
//! error           Error, ErrorKind, Result
//! ```
//!
//! One file is let through upwards, by name in the check: `replica`'s
//! in-process transport (`Loopback`) holds engines, because it delivers
//! images into their replica slots.
//!
//! `config` (the engine's settings) sits beside `engine` and is read by
//! the layers it configures. The seams are documented where they are
//! defined: `engine` (what a save and a load promise), `read` (what
//! "verified" means), [`io`] (the data path) and [`storage`] (the commit
//! protocol, and how an object store fits it).
//!
//! # Quick start
//!
//! ```
//! use acp_core::{Dtype, Engine, EngineConfig, HostTensor, LoadRequest, SaveOptions, Source};
//! # fn main() -> acp_core::Result<()> {
//! # let dir = tempfile::tempdir().unwrap();
//! # let root = dir.path().join("run1");
//! # let shm = dir.path().join("shm"); std::fs::create_dir(&shm).unwrap();
//! let engine = Engine::open(
//!     EngineConfig::new(&root)          // one directory per job
//!         .with_job("run1")             // names this job's shared-memory slots
//!         .with_ring_bytes(64 << 20)    // RAM budget of the ring
//! #       .with_shm_dir(&shm)
//! )?;
//!
//! let weights: Vec<f32> = vec![0.5; 1024];
//! let bytes: Vec<u8> = weights.iter().flat_map(|w| w.to_le_bytes()).collect();
//! let handle = engine.save(
//!     100,
//!     &[HostTensor { name: "layer.0.weight", dtype: Dtype::F32, shape: &[32, 32], data: &bytes }],
//!     &serde_json::json!({"epoch": 3, "lr": 0.001}),
//!     &SaveOptions::default(),
//! )?;
//! // Training goes on here; the flush runs in the background.
//! let report = handle.wait()?; // durable and committed
//! assert_eq!(report.step, 100);
//!
//! let ckpt = engine.load(&LoadRequest::default())?; // the newest committed step
//! assert_eq!(ckpt.report().source, Source::Ram);
//! assert_eq!(ckpt.tensor("layer.0.weight").unwrap().data, &bytes[..]);
//! assert_eq!(ckpt.values()["epoch"], 3);
//! engine.close()?;
//! # Ok(())
//! # }
//! ```

#![deny(unsafe_code)]

#[cfg(feature = "cli")]
pub mod cli;
pub mod codec;
pub mod config;
pub mod error;
pub mod format;
pub mod io;
pub mod ops;
mod read;
pub mod replica;
pub mod staging;
pub mod storage;

mod engine;

pub use config::{
    auto_ring_bytes, Compress, DirectIo, EngineConfig, IoChoice, PersistPolicy, Verify, WhenFull,
    MIN_AUTO_SLOT_BYTES,
};
pub use engine::{
    Checkpoint, Engine, HostTensor, LoadReport, LoadRequest, OnWait, OpenReport, Opened, Outcome,
    PendingLoad, Persist, PersistStats, SaveHandle, SaveOptions, SavePlan, SaveReport, Source,
    Staging, TensorView, FLUSH_YIELD_MAX,
};
pub use error::{Error, ErrorKind, Result};
pub use format::{Dtype, Entry, TensorSpec};
pub use io::IoKind;
pub use replica::{ReplicaHandle, ReplicaMeta, Transport};

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;
