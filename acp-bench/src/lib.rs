//! Fixtures shared by the acp benchmarks: sizes from the environment,
//! pre-faulted page-aligned buffers, model-like tensor sets, a scratch
//! directory with a matching engine configuration, the raw I/O baselines,
//! and notes that the report prints beside criterion's figures.
//!
//! Environment:
//! - `ACP_BENCH_BYTES`: bytes per checkpoint (default 256 MiB);
//! - `ACP_BENCH_GIB`: the same in GiB (`ACP_BENCH_GIB=1` for 1 GiB), used
//!   when `ACP_BENCH_BYTES` is unset;
//! - `ACP_BENCH_DIR`: where scratch checkpoint directories go (default
//!   `/tmp`); it must be on the storage under test;
//! - `ACP_BENCH_SHM`: where the engine's ring slots go (default `/dev/shm`);
//! - `ACP_BENCH_TENSORS`: tensor count of the `tensors` bench (default 20000);
//! - `ACP_BENCH_MEASURE_SECS`: criterion measurement time per row (default 3).

#![deny(unsafe_code)]

use std::time::Duration;

mod buf;
mod notes;
pub mod raw;
mod scratch;
mod tensors;

pub use buf::{copy_pairs, copy_pairs_parallel, fill_random, AlignedBuf, Rng};
pub use notes::Notes;
pub use scratch::{drop_caches, engine_config, Scratch};
pub use tensors::{Tensor, TensorSet};

/// Default checkpoint size: 256 MiB, so the whole suite runs in minutes.
pub const DEFAULT_BYTES: usize = 256 << 20;

/// Samples per criterion row.
pub const SAMPLES: usize = 10;

/// The block of the raw I/O baselines and acp's default flush chunk: 4 MiB.
pub const BLOCK: usize = 4 << 20;

/// Bytes per checkpoint, from `ACP_BENCH_BYTES` or `ACP_BENCH_GIB`, else
/// [`DEFAULT_BYTES`]; rounded down to a multiple of 4096 (at least 4096).
///
/// # Panics
/// When a variable is set but is not a number.
#[must_use]
pub fn bench_bytes() -> usize {
    let from_env = |name: &str| {
        std::env::var(name).ok().map(|v| {
            v.trim()
                .parse::<f64>()
                .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
        })
    };
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "sizes from the environment are small positive numbers"
    )]
    let bytes = if let Some(b) = from_env("ACP_BENCH_BYTES") {
        b as usize
    } else if let Some(g) = from_env("ACP_BENCH_GIB") {
        (g * f64::from(1u32 << 30)) as usize
    } else {
        DEFAULT_BYTES
    };
    (bytes / 4096).max(1) * 4096
}

/// The tensor count of the small-tensor bench: `ACP_BENCH_TENSORS`, default
/// 20,000.
///
/// # Panics
/// When the variable is set but is not an integer.
#[must_use]
pub fn small_tensor_count() -> usize {
    std::env::var("ACP_BENCH_TENSORS").map_or(20_000, |v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("ACP_BENCH_TENSORS={v:?} is not an integer"))
    })
}

/// Threads of the parallel baselines: the cores available, at most 8 (the
/// engine's default `copy_threads`).
#[must_use]
pub fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(8)
}

/// Criterion's measurement time per row: `ACP_BENCH_MEASURE_SECS`, default 3 s
/// (rows whose iterations hide an untimed flush use a half or a quarter).
#[must_use]
pub fn measurement_time() -> Duration {
    let secs = std::env::var("ACP_BENCH_MEASURE_SECS")
        .ok()
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(3.0);
    Duration::from_secs_f64(secs.max(0.1))
}

/// Criterion's warm-up per row: short, because the fixtures warm the ring
/// and buffers before criterion starts.
#[must_use]
pub fn warm_up_time() -> Duration {
    Duration::from_millis(300)
}

/// Bytes as GiB or MiB for labels.
#[must_use]
pub fn human_bytes(bytes: u64) -> String {
    #[expect(
        clippy::cast_precision_loss,
        reason = "a label; precision beyond 2^52 bytes does not matter"
    )]
    let b = bytes as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", b / f64::from(1u32 << 30))
    } else {
        format!("{:.1} MiB", b / f64::from(1u32 << 20))
    }
}

/// The plain values saved with every bench checkpoint.
#[must_use]
pub fn values(step: u64) -> serde_json::Value {
    serde_json::json!({ "step": step, "bench": true })
}

/// Saves `tensors` as `step` and returns its handle.
///
/// # Panics
/// When the save is refused or skipped: a bench cannot go on.
#[must_use]
pub fn save(
    engine: &acp_core::Engine,
    step: u64,
    tensors: &[acp_core::HostTensor<'_>],
) -> acp_core::SaveHandle {
    engine
        .save(
            step,
            tensors,
            &values(step),
            &acp_core::SaveOptions::default(),
        )
        .unwrap_or_else(|e| panic!("saving step {step}: {e}"))
}

/// Waits for a save, checks it was not skipped, and deletes every older
/// committed step so the scratch directory holds one checkpoint (then
/// fsyncs the root, as [`remove_settled`] does for raw files).
///
/// # Panics
/// When the save failed or was skipped.
#[expect(
    clippy::must_use_candidate,
    reason = "callers often only wait; the report is optional"
)]
pub fn wait_and_trim(engine: &acp_core::Engine, h: &acp_core::SaveHandle) -> acp_core::SaveReport {
    let rep = h
        .wait()
        .unwrap_or_else(|e| panic!("save of step {}: {e}", h.step()));
    assert!(!rep.skipped, "step {} was skipped", rep.step);
    engine
        .retain(1, None)
        .unwrap_or_else(|e| panic!("retention: {e}"));
    if let Ok(d) = std::fs::File::open(engine.root()) {
        let _ = d.sync_all();
    }
    rep
}

/// Saves and commits `rounds` steps (from `*step`, advancing it), so every
/// ring slot has been grown and faulted in before anything is timed.
pub fn warm_engine(
    engine: &acp_core::Engine,
    step: &mut u64,
    tensors: &[acp_core::HostTensor<'_>],
    rounds: usize,
) {
    for _ in 0..rounds {
        *step += 1;
        let h = save(engine, *step, tensors);
        wait_and_trim(engine, &h);
    }
}

/// The median of `xs` (0 when empty).
#[must_use]
pub fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => f64::midpoint(v[n / 2 - 1], v[n / 2]),
    }
}

/// Splits `dst` into the destinations of a loaded checkpoint's entries:
/// `ranges[k] = (entry index, offset in dst, len)`, disjoint. Returns the
/// `(entry index, slice)` pairs [`acp_core::Checkpoint::copy_into`] takes.
///
/// # Panics
/// When ranges overlap or run past `dst`.
#[must_use]
pub fn split_dst<'a>(
    dst: &'a mut [u8],
    ranges: &[(usize, usize, usize)],
) -> Vec<(usize, &'a mut [u8])> {
    let mut sorted = ranges.to_vec();
    sorted.sort_unstable_by_key(|r| r.1);
    let mut out = Vec::with_capacity(sorted.len());
    let mut rest = dst;
    let mut pos = 0;
    for (i, off, len) in sorted {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(off - pos);
        let (piece, tail) = tail.split_at_mut(len);
        out.push((i, piece));
        rest = tail;
        pos = off + len;
    }
    out
}

/// Back-to-back measurements of a baseline and an acp row, taken inside
/// the acp row's iterations (the baseline right before each acp
/// operation), so both see the same machine: on a shared, noisy machine
/// their per-pair ratio is steadier than the ratio of two criterion rows
/// measured a minute apart.
#[derive(Debug, Default, Clone)]
pub struct Paired {
    base: Vec<f64>,
    acp: Vec<f64>,
}

impl Paired {
    /// Records one pair, in seconds.
    pub fn push(&mut self, base: Duration, acp: Duration) {
        self.base.push(base.as_secs_f64());
        self.acp.push(acp.as_secs_f64());
    }

    /// The number of pairs.
    #[must_use]
    pub fn len(&self) -> usize {
        self.base.len()
    }

    /// Whether there are none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.base.is_empty()
    }

    /// Median of `base / acp` over the pairs: acp's throughput as a
    /// multiple of the baseline's.
    #[must_use]
    pub fn median_ratio(&self) -> f64 {
        let r: Vec<f64> = self
            .base
            .iter()
            .zip(&self.acp)
            .map(|(b, a)| b / a)
            .collect();
        median(&r)
    }

    /// Median of `acp − base` over the pairs, in seconds.
    #[must_use]
    pub fn median_diff(&self) -> f64 {
        let d: Vec<f64> = self
            .base
            .iter()
            .zip(&self.acp)
            .map(|(b, a)| a - b)
            .collect();
        median(&d)
    }

    /// One line for the notes: medians of both and of the ratio.
    #[must_use]
    pub fn summary(&self, base: &str, acp: &str) -> String {
        format!(
            "{} pairs: `{base}` {:.2} ms, `{acp}` {:.2} ms, median ratio {:.2}×",
            self.len(),
            median(&self.base) * 1e3,
            median(&self.acp) * 1e3,
            self.median_ratio()
        )
    }
}

/// Deletes `path` and fsyncs its directory, so the deletion's journal
/// commit (and, on a file system mounted with `discard`, its discards)
/// happens here, untimed, not in the next timed `fsync`.
///
/// # Panics
/// When the file cannot be removed.
pub fn remove_settled(path: &std::path::Path) {
    std::fs::remove_file(path).unwrap_or_else(|e| panic!("removing {}: {e}", path.display()));
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
}
