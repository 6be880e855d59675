//! Compression on the storage tier: the codec on one core, and the flush
//! compressed against plain.
//!
//! The state is drawn like a trained model's: bf16 weights from
//! normal(0, 0.02), and fp32 Adam state (`exp_avg` from normal(0, 1e-3),
//! `exp_avg_sq` its square plus normal noise, so positive and small).
//!
//! Rows:
//! - `encode_bf16_4m` / `encode_fp32_adam_4m`: one 4 MiB chunk encoded
//!   (byte grouping + zstd at the level below) on one thread: compression throughput
//!   per core;
//! - `decode_bf16_4m` / `decode_fp32_adam_4m`: the same chunks decoded;
//! - `flush_plain` / `flush_zstd`: `save` untimed, then until the step is
//!   committed (`SaveHandle::wait`), for a mixed state (half bf16 weights,
//!   half fp32 Adam state) at `ACP_BENCH_BYTES` (at most 256 MiB);
//! - `flush_plain_200mbs` / `flush_zstd_200mbs`: the same with the storage
//!   capped at 200 MB/s (a slow shared file system: the test-util fault
//!   probe's throttle, each 4 MiB chunk write taking its share of the
//!   pipe), and `flush_{plain,zstd}_bf16_200mbs` for a bf16 model state
//!   alone of the same size;
//! - `restore_plain` / `restore_zstd`: the unthrottled step loaded from
//!   storage (`storage_only`, every chunk verified; the page cache is
//!   warm).
//!
//! - `finetune_flush_{full,incremental}` / `finetune_restore_{full,incremental}`:
//!   the fine-tuning case (90% of the bytes a frozen bf16 base, 10%
//!   adapters and their fp32 Adam state changed every step), each save
//!   written whole or incremental (it references the base's chunks), and
//!   the last step restored from storage, warm and (where the page cache
//!   can be dropped) cold: `finetune_restore_cold_{full,incremental}`;
//!   notes `finetune_written_ratio`, `finetune_restore_ratio` and
//!   `finetune_restore_cold_ratio` (incremental over full); and
//!   `finetune_flush_{full,incremental}_200mbs` with the storage capped at
//!   200 MB/s, note `finetune_flush_200mbs_speedup` (full over
//!   incremental, medians of the steps after the first).
//!
//! `ACP_BENCH_COMPRESS_LEVEL` sets the zstd level (default 1, the engine's).
//!
//! The notes give the compressed size over the plain size for each state
//! (bf16 weights, fp32 Adam state, the mixed flush file), and the flush
//! time of each compressed row over its plain row (`speedup_*`: above 1,
//! compression finishes sooner).

use std::time::{Duration, Instant};

use acp_bench::{engine_config, measurement_time, Notes, Scratch, SAMPLES};
use acp_core::codec::Run;
use acp_core::format::{encode_frame, FrameCodec};
use acp_core::storage::faults::FaultInjector;
use acp_core::{Compress, Dtype, Engine, HostTensor, SaveOptions};
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};

const CHUNK: usize = 4 << 20;

/// The zstd level of every row: `ACP_BENCH_COMPRESS_LEVEL`, else the
/// engine's default.
fn level() -> i32 {
    std::env::var("ACP_BENCH_COMPRESS_LEVEL")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(acp_core::config::DEFAULT_COMPRESS_LEVEL)
}

/// A small, fast generator of normal draws (Box-Muller over xorshift).
struct Normal(u64);

impl Normal {
    fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    fn next(&mut self, sigma: f64) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * sigma) as f32
    }
}

/// `n` bf16 values from normal(0, sigma), rounded to nearest even.
fn bf16_normal(n: usize, sigma: f64, seed: u64) -> Vec<u8> {
    let mut g = Normal(seed | 1);
    let mut out = Vec::with_capacity(n * 2);
    for _ in 0..n {
        let bits = g.next(sigma).to_bits();
        let round = 0x7FFF + ((bits >> 16) & 1);
        let b = (bits.wrapping_add(round) >> 16) as u16;
        out.extend_from_slice(&b.to_le_bytes());
    }
    out
}

/// `n` fp32 values of Adam state: half `exp_avg`, half `exp_avg_sq`.
fn fp32_adam(n: usize, seed: u64) -> Vec<u8> {
    let mut g = Normal(seed | 1);
    let mut out = Vec::with_capacity(n * 4);
    for i in 0..n {
        let m = g.next(1e-3);
        let v = if i < n / 2 {
            m
        } else {
            m * m + g.next(1e-8).abs()
        };
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

fn ratio(bytes: &[u8], width: u8) -> f64 {
    let mut stored = 0usize;
    for c in bytes.chunks(CHUNK) {
        let runs = [Run {
            width,
            len: c.len() as u32,
        }];
        let (f, _) = encode_frame("bench", c, &runs, level()).expect("runs tile the chunk");
        stored += f.len();
    }
    stored as f64 / bytes.len() as f64
}

fn codec(c: &mut Criterion, notes: &mut Notes) {
    let bf16 = bf16_normal(CHUNK / 2, 0.02, 1);
    let adam = fp32_adam(CHUNK / 4, 2);
    notes.set("ratio_bf16_normal_0.02", ratio(&bf16, 2));
    notes.set("ratio_fp32_adam", ratio(&adam, 4));
    let mut g = c.benchmark_group("compress");
    g.sample_size(SAMPLES)
        .warm_up_time(Duration::from_millis(200))
        .measurement_time(measurement_time())
        .throughput(Throughput::Bytes(CHUNK as u64));
    let run = |w: u8| {
        [Run {
            width: w,
            len: CHUNK as u32,
        }]
    };
    g.bench_function("encode_bf16_4m", |b| {
        b.iter(|| encode_frame("bench", &bf16, &run(2), level()).expect("encodes"));
    });
    g.bench_function("encode_fp32_adam_4m", |b| {
        b.iter(|| encode_frame("bench", &adam, &run(4), level()).expect("encodes"));
    });
    let (frame, kind) = encode_frame("bench", &bf16, &run(2), level()).expect("encodes");
    assert_eq!(
        kind,
        FrameCodec::GroupedZstd,
        "normal bf16 weights compress"
    );
    let mut out = vec![0u8; CHUNK];
    g.bench_function("decode_bf16_4m", |b| {
        b.iter(|| acp_core::codec::decode(&frame, &mut out).expect("decodes"));
    });
    let (frame, kind) = encode_frame("bench", &adam, &run(4), level()).expect("encodes");
    assert_eq!(kind, FrameCodec::GroupedZstd, "fp32 Adam state compresses");
    g.bench_function("decode_fp32_adam_4m", |b| {
        b.iter(|| acp_core::codec::decode(&frame, &mut out).expect("decodes"));
    });
    g.finish();
}

/// The storage cap of the throttled rows, in bytes per second.
const SLOW_STORAGE: u64 = 200_000_000;

/// The engine's flush chunk (the throttle's unit).
const FLUSH_CHUNK: usize = 4 << 20;

fn flush(c: &mut Criterion, notes: &mut Notes) {
    let total = acp_bench::bench_bytes().min(256 << 20);
    let weights = bf16_normal(total / 4, 0.02, 3);
    let adam = fp32_adam(total / 8, 4);
    let bf16_only = bf16_normal(total / 2, 0.02, 5);
    let shape_w = [weights.len() as u64 / 2];
    let shape_a = [adam.len() as u64 / 4];
    let shape_b = [bf16_only.len() as u64 / 2];
    let mixed = [
        HostTensor {
            name: "model.w",
            dtype: Dtype::BF16,
            shape: &shape_w,
            data: &weights,
        },
        HostTensor {
            name: "optim.adam",
            dtype: Dtype::F32,
            shape: &shape_a,
            data: &adam,
        },
    ];
    let model = [HostTensor {
        name: "model.w",
        dtype: Dtype::BF16,
        shape: &shape_b,
        data: &bf16_only,
    }];
    let mut g = c.benchmark_group("compress_flush");
    g.sample_size(SAMPLES)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(measurement_time())
        .throughput(Throughput::Bytes(total as u64));
    let mut medians: Vec<(String, f64)> = Vec::new();
    for (name, mode, host, cap) in [
        ("flush_plain", Compress::None, &mixed[..], 0),
        ("flush_zstd", Compress::Zstd, &mixed[..], 0),
        (
            "flush_plain_200mbs",
            Compress::None,
            &mixed[..],
            SLOW_STORAGE,
        ),
        (
            "flush_zstd_200mbs",
            Compress::Zstd,
            &mixed[..],
            SLOW_STORAGE,
        ),
        (
            "flush_plain_bf16_200mbs",
            Compress::None,
            &model[..],
            SLOW_STORAGE,
        ),
        (
            "flush_zstd_bf16_200mbs",
            Compress::Zstd,
            &model[..],
            SLOW_STORAGE,
        ),
    ] {
        let scratch = Scratch::new(&format!("compress-{name}"));
        let faults = std::sync::Arc::new(FaultInjector::counting());
        faults.throttle(cap, FLUSH_CHUNK as u64);
        let engine = Engine::open(
            engine_config(&scratch, total, 2)
                .with_chunk_bytes(FLUSH_CHUNK)
                .with_compress(mode)
                .with_compress_level(level().max(1))
                // Every iteration saves the same state: whole steps, or
                // the incremental default would write only the header.
                .with_incremental(false)
                .with_faults(std::sync::Arc::clone(&faults))
                .with_release_on_close(true),
        )
        .unwrap_or_else(|e| panic!("opening the engine: {e}"));
        let mut step = 0u64;
        let mut times: Vec<f64> = Vec::new();
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    step += 1;
                    let h = engine
                        .save(
                            step,
                            host,
                            &serde_json::json!(null),
                            &SaveOptions::default(),
                        )
                        .unwrap_or_else(|e| panic!("save: {e}"));
                    let t = Instant::now();
                    h.wait().unwrap_or_else(|e| panic!("flush: {e}"));
                    let took = t.elapsed();
                    times.push(took.as_secs_f64());
                    spent += took;
                    engine
                        .retain(1, None)
                        .unwrap_or_else(|e| panic!("retain: {e}"));
                }
                spent
            });
        });
        times.sort_by(f64::total_cmp);
        // A row a filter left out has no times.
        if let Some(m) = times.get(times.len() / 2) {
            medians.push((name.to_owned(), *m));
        }
        if cap == 0 {
            let restore = name.replace("flush", "restore");
            g.bench_function(restore.as_str(), |b| {
                b.iter(|| {
                    engine
                        .load(&acp_core::LoadRequest {
                            step: Some(step),
                            storage_only: true,
                            ..acp_core::LoadRequest::default()
                        })
                        .unwrap_or_else(|e| panic!("restore: {e}"))
                });
            });
        }
        let file = scratch
            .root()
            .join(format!("step-{step:012}"))
            .join("rank-00000.safetensors");
        let stored = std::fs::metadata(&file).map_or(0, |m| m.len());
        notes.set(&format!("{name}_file_bytes"), stored);
        engine
            .close()
            .unwrap_or_else(|e| panic!("closing the engine: {e}"));
    }
    g.finish();
    // Same-run ratios: each plain row's median flush over its zstd row's.
    for (name, secs) in &medians {
        if let Some(zstd) = name.strip_prefix("flush_plain") {
            let z = format!("flush_zstd{zstd}");
            if let Some((_, zsecs)) = medians.iter().find(|(n, _)| *n == z) {
                notes.set(
                    &format!(
                        "speedup{}",
                        if zstd.is_empty() {
                            "_unthrottled"
                        } else {
                            zstd
                        }
                    ),
                    secs / zsecs,
                );
            }
        }
    }
}

/// Changes one byte in every 64 KiB of `data` for step `step`: a trained
/// tensor, every chunk of it new.
fn train(data: &mut [u8], step: u64) {
    for (i, b) in data.iter_mut().step_by(64 << 10).enumerate() {
        *b = b.wrapping_add(((step as u8) ^ (i as u8)) | 1);
    }
}

/// The fine-tuning case: 90% of the bytes frozen (a bf16 base), 10%
/// trained every step (bf16 adapters, 2%, and their fp32 Adam state, 8%).
/// Rows `finetune_flush_{full,incremental}` (a save of a new step, until
/// committed) and `finetune_restore_{full,incremental}` (the last step
/// loaded from storage, every chunk verified, the page cache warm); notes
/// `finetune_written_ratio` (bytes an incremental save writes over a full
/// save's) and `finetune_restore_ratio` (incremental restore over full,
/// medians).
fn finetune(c: &mut Criterion, notes: &mut Notes) {
    let total = acp_bench::bench_bytes().min(512 << 20);
    let base = bf16_normal(total * 9 / 20, 0.02, 6);
    let mut adapter = bf16_normal(total / 100, 0.02, 7);
    let mut adam = fp32_adam(total / 50, 8);
    let shape = |d: &[u8], w: u64| [d.len() as u64 / w];
    let (sb, sa, so) = (shape(&base, 2), shape(&adapter, 2), shape(&adam, 4));
    let mut g = c.benchmark_group("compress_finetune");
    g.sample_size(SAMPLES)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(measurement_time())
        .throughput(Throughput::Bytes(total as u64));
    let mut written: Vec<(bool, u64, u64)> = Vec::new();
    let mut restores: Vec<(bool, f64)> = Vec::new();
    let mut cold_restores: Vec<(bool, f64)> = Vec::new();
    let cold = acp_bench::drop_caches();
    if let Err(why) = &cold {
        notes.set("finetune_restore_cold", format!("not measured: {why}"));
    }
    for incremental in [false, true] {
        let kind = if incremental { "incremental" } else { "full" };
        let scratch = Scratch::new(&format!("compress-finetune-{kind}"));
        let engine = Engine::open(
            engine_config(&scratch, total, 2)
                .with_chunk_bytes(FLUSH_CHUNK)
                .with_incremental(incremental)
                .with_release_on_close(true),
        )
        .unwrap_or_else(|e| panic!("opening the engine: {e}"));
        let mut step = 0u64;
        let save = |step: u64, adapter: &[u8], adam: &[u8]| {
            let host = [
                HostTensor {
                    name: "base.w",
                    dtype: Dtype::BF16,
                    shape: &sb,
                    data: &base,
                },
                HostTensor {
                    name: "lora.w",
                    dtype: Dtype::BF16,
                    shape: &sa,
                    data: adapter,
                },
                HostTensor {
                    name: "lora.adam",
                    dtype: Dtype::F32,
                    shape: &so,
                    data: adam,
                },
            ];
            let h = engine
                .save(
                    step,
                    &host,
                    &serde_json::json!(null),
                    &SaveOptions::default(),
                )
                .unwrap_or_else(|e| panic!("save: {e}"));
            let t = Instant::now();
            let r = h.wait().unwrap_or_else(|e| panic!("flush: {e}"));
            (t.elapsed(), r)
        };
        g.bench_function(format!("finetune_flush_{kind}"), |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    step += 1;
                    train(&mut adapter, step);
                    train(&mut adam, step);
                    let (took, r) = save(step, &adapter, &adam);
                    // The first step of a root has nothing to reuse.
                    if step > 1 {
                        written.push((incremental, r.stored_bytes, r.bytes));
                    }
                    spent += took;
                    engine
                        .retain(2, None)
                        .unwrap_or_else(|e| panic!("retain: {e}"));
                }
                spent
            });
        });
        let mut times = Vec::new();
        g.bench_function(format!("finetune_restore_{kind}"), |b| {
            b.iter(|| {
                let t = Instant::now();
                let ck = engine
                    .load(&acp_core::LoadRequest {
                        step: Some(step),
                        storage_only: true,
                        ..acp_core::LoadRequest::default()
                    })
                    .unwrap_or_else(|e| panic!("restore: {e}"));
                times.push(t.elapsed().as_secs_f64());
                ck
            });
        });
        times.sort_by(f64::total_cmp);
        if let Some(m) = times.get(times.len() / 2) {
            restores.push((incremental, *m));
        }
        // Cold: the page cache dropped before each load (when allowed).
        if cold.is_ok() {
            let mut cold_times = Vec::new();
            g.bench_function(format!("finetune_restore_cold_{kind}"), |b| {
                b.iter_custom(|iters| {
                    let mut spent = Duration::ZERO;
                    for _ in 0..iters {
                        let _ = acp_bench::drop_caches();
                        let t = Instant::now();
                        let ck = engine
                            .load(&acp_core::LoadRequest {
                                step: Some(step),
                                storage_only: true,
                                ..acp_core::LoadRequest::default()
                            })
                            .unwrap_or_else(|e| panic!("restore: {e}"));
                        let took = t.elapsed();
                        drop(ck);
                        cold_times.push(took.as_secs_f64());
                        spent += took;
                    }
                    spent
                });
            });
            cold_times.sort_by(f64::total_cmp);
            if let Some(m) = cold_times.get(cold_times.len() / 2) {
                cold_restores.push((incremental, *m));
            }
        }
        engine
            .close()
            .unwrap_or_else(|e| panic!("closing the engine: {e}"));
    }
    // The flush against a storage of 200 MB/s (the throttle of the
    // `flush` rows): what the bytes not written save there.
    let mut slow: Vec<(bool, f64)> = Vec::new();
    for incremental in [false, true] {
        let kind = if incremental { "incremental" } else { "full" };
        let scratch = Scratch::new(&format!("compress-finetune-slow-{kind}"));
        let faults = std::sync::Arc::new(FaultInjector::counting());
        faults.throttle(SLOW_STORAGE, FLUSH_CHUNK as u64);
        let engine = Engine::open(
            engine_config(&scratch, total, 2)
                .with_chunk_bytes(FLUSH_CHUNK)
                .with_incremental(incremental)
                .with_faults(std::sync::Arc::clone(&faults))
                .with_release_on_close(true),
        )
        .unwrap_or_else(|e| panic!("opening the engine: {e}"));
        let mut step = 0u64;
        let mut times = Vec::new();
        g.bench_function(format!("finetune_flush_{kind}_200mbs"), |b| {
            b.iter_custom(|iters| {
                let mut spent = Duration::ZERO;
                for _ in 0..iters {
                    step += 1;
                    train(&mut adapter, step);
                    train(&mut adam, step);
                    let host = [
                        HostTensor {
                            name: "base.w",
                            dtype: Dtype::BF16,
                            shape: &sb,
                            data: &base,
                        },
                        HostTensor {
                            name: "lora.w",
                            dtype: Dtype::BF16,
                            shape: &sa,
                            data: &adapter,
                        },
                        HostTensor {
                            name: "lora.adam",
                            dtype: Dtype::F32,
                            shape: &so,
                            data: &adam,
                        },
                    ];
                    let h = engine
                        .save(
                            step,
                            &host,
                            &serde_json::json!(null),
                            &SaveOptions::default(),
                        )
                        .unwrap_or_else(|e| panic!("save: {e}"));
                    let t = Instant::now();
                    h.wait().unwrap_or_else(|e| panic!("flush: {e}"));
                    let took = t.elapsed();
                    // The first step of a root has nothing to reuse.
                    if step > 1 {
                        times.push(took.as_secs_f64());
                    }
                    spent += took;
                    engine
                        .retain(2, None)
                        .unwrap_or_else(|e| panic!("retain: {e}"));
                }
                spent
            });
        });
        times.sort_by(f64::total_cmp);
        if let Some(m) = times.get(times.len() / 2) {
            slow.push((incremental, *m));
        }
        engine
            .close()
            .unwrap_or_else(|e| panic!("closing the engine: {e}"));
    }
    g.finish();
    if let [(false, full), (true, incr)] = slow[..] {
        notes.set("finetune_flush_200mbs_speedup", full / incr);
    }
    let mean = |inc: bool| {
        let w: Vec<f64> = written
            .iter()
            .filter(|(i, _, _)| *i == inc)
            .map(|(_, s, _)| *s as f64)
            .collect();
        (!w.is_empty()).then(|| w.iter().sum::<f64>() / w.len() as f64)
    };
    if let (Some(full), Some(incr)) = (mean(false), mean(true)) {
        notes.set("finetune_written_ratio", incr / full);
        notes.set("finetune_written_bytes_full", full);
        notes.set("finetune_written_bytes_incremental", incr);
    }
    let restore = |inc: bool| restores.iter().find(|(i, _)| *i == inc).map(|(_, s)| *s);
    if let (Some(full), Some(incr)) = (restore(false), restore(true)) {
        notes.set("finetune_restore_ratio", incr / full);
    }
    let cold = |inc: bool| {
        cold_restores
            .iter()
            .find(|(i, _)| *i == inc)
            .map(|(_, s)| *s)
    };
    if let (Some(full), Some(incr)) = (cold(false), cold(true)) {
        notes.set("finetune_restore_cold_ratio", incr / full);
    }
}

fn all(c: &mut Criterion) {
    let mut notes = Notes::new("compress");
    codec(c, &mut notes);
    flush(c, &mut notes);
    finetune(c, &mut notes);
    notes.save();
}

criterion_group!(benches, all);
criterion_main!(benches);
