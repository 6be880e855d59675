//! Staging: the stall of `Engine::save` (spec building, `begin_save`, the
//! parallel `copy_from` into a ring slot, `finish`) against a plain memcpy
//! of the same tensors into a pre-faulted buffer, on 1 and N threads.
//!
//! The flush of each save is waited for outside the timed region, so it
//! never competes with the next measurement; the ring is warmed first, so
//! the steady state reuses pre-faulted slots. Each `acp_stage` iteration
//! also times a `memcpy_nt` right before its save (untimed for criterion):
//! the notes give the median of those back-to-back ratios.

use std::hint::black_box;
use std::time::{Duration, Instant};

use acp_bench::{
    bench_bytes, copy_pairs, copy_pairs_parallel, engine_config, human_bytes, measurement_time,
    median, save, threads, wait_and_trim, warm_engine, warm_up_time, AlignedBuf, Notes, Paired,
    Scratch, TensorSet, SAMPLES,
};
use acp_core::Engine;
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};

fn staging(c: &mut Criterion) {
    let bytes = bench_bytes();
    let n = threads();
    let set = TensorSet::model_like(bytes);
    let src = AlignedBuf::random(set.total, 1);
    let mut dst = AlignedBuf::new(set.total);
    let scratch = Scratch::new("staging");
    let engine = Engine::open(engine_config(&scratch, set.total, 2))
        .unwrap_or_else(|e| panic!("opening the engine: {e}"));
    let host = set.host(&src);
    let mut step = 0;
    warm_engine(&engine, &mut step, &host, 4);

    let mut g = c.benchmark_group("staging");
    g.sample_size(SAMPLES)
        .warm_up_time(warm_up_time())
        .measurement_time(measurement_time())
        .throughput(Throughput::Bytes(set.total as u64));

    let mut pairs = set.pairs(&mut dst, &src);
    g.bench_function("memcpy_1t", |b| {
        b.iter(|| {
            copy_pairs(&mut pairs);
            black_box(&mut pairs);
        });
    });
    g.bench_function("memcpy_nt", |b| {
        b.iter(|| {
            copy_pairs_parallel(&mut pairs, n);
            black_box(&mut pairs);
        });
    });
    // Each timed save is followed by an untimed flush: keep the iteration
    // count low (flat sampling, short warm-up; the ring is already warm).
    g.sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(measurement_time() / 4);
    let mut reported = Vec::new();
    let mut paired = Paired::default();
    g.bench_function("acp_stage", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                copy_pairs_parallel(&mut pairs, n);
                black_box(&mut pairs);
                let base = t.elapsed();
                step += 1;
                let t = Instant::now();
                let h = save(&engine, step, &host);
                let stall = t.elapsed();
                timed += stall;
                paired.push(base, stall);
                reported.push(wait_and_trim(&engine, &h).stall_secs);
            }
            timed
        });
    });
    drop(pairs);
    g.finish();

    let mut notes = Notes::new("staging");
    notes.set("bytes", human_bytes(set.total as u64));
    notes.set("tensors", set.len());
    notes.set("memcpy_nt threads", n);
    notes.set("ring mlocked", engine.open_report().mlocked);
    notes.set("paired", paired.summary("memcpy_nt", "acp_stage"));
    notes.set(
        "acp_stage: median SaveReport.stall_secs (ms)",
        median(&reported) * 1e3,
    );
    notes.save();
    engine
        .close()
        .unwrap_or_else(|e| panic!("closing the engine: {e}"));
}

criterion_group!(benches, staging);
criterion_main!(benches);
