//! Tensors: the per-tensor cost of the stall. 20,000 F32 tensors of random
//! sizes between 4 and 64 KiB (fixed seed; `ACP_BENCH_TENSORS` changes the
//! count), and 10 tensors of the same total size, saved by acp and copied
//! one by one by memcpy into a pre-faulted buffer.
//!
//! Per-tensor overhead = (`acp_save_many_1t` − `memcpy_many_1t`) / count,
//! with the engine's copy threads set to 1 so both sides copy on one
//! thread; the `_nt` rows use N threads on both sides (the engine's
//! default). The report prints the overhead.

use std::hint::black_box;
use std::time::{Duration, Instant};

use acp_bench::{
    copy_pairs, copy_pairs_parallel, engine_config, human_bytes, measurement_time, median, save,
    small_tensor_count, threads, wait_and_trim, warm_engine, warm_up_time, AlignedBuf, Notes,
    Scratch, TensorSet, SAMPLES,
};
use acp_core::{Engine, HostTensor};
use criterion::{
    criterion_group, criterion_main, measurement::WallTime, BenchmarkGroup, Criterion,
    SamplingMode, Throughput,
};

/// Times the stall of saves of `host` on `engine`; flushes untimed.
fn bench_save(
    g: &mut BenchmarkGroup<'_, WallTime>,
    name: &str,
    engine: &Engine,
    step: &mut u64,
    host: &[HostTensor<'_>],
    stalls: &mut Vec<f64>,
) {
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                *step += 1;
                let t = Instant::now();
                let h = save(engine, *step, host);
                timed += t.elapsed();
                stalls.push(wait_and_trim(engine, &h).stall_secs);
            }
            timed
        });
    });
}

fn tensors(c: &mut Criterion) {
    let count = small_tensor_count();
    let n = threads();
    let many = TensorSet::small(count, 4 << 10, 64 << 10, 42);
    let few = TensorSet::even(10, many.total);
    let src = AlignedBuf::random(many.total, 4);
    let mut dst = AlignedBuf::new(many.total);
    let host_many = many.host(&src);
    let host_few = few.host(&src);

    let mut g = c.benchmark_group("tensors");
    g.sample_size(SAMPLES)
        .warm_up_time(warm_up_time())
        .measurement_time(measurement_time())
        .throughput(Throughput::Bytes(many.total as u64));
    for (set, name, threads) in [
        (&many, "memcpy_many_1t", 1),
        (&few, "memcpy_10_1t", 1),
        (&many, "memcpy_many_nt", n),
        (&few, "memcpy_10_nt", n),
    ] {
        let mut pairs = set.pairs(&mut dst, &src);
        g.bench_function(name, |b| {
            b.iter(|| {
                copy_pairs_parallel(&mut pairs, threads);
                black_box(&mut pairs);
            });
        });
    }
    // The one-by-one loop itself, without the thread split.
    let mut pairs = many.pairs(&mut dst, &src);
    copy_pairs(&mut pairs);
    drop(pairs);

    g.sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(measurement_time() / 4);
    let mut notes = Notes::new("tensors");
    for (suffix, copy_threads) in [("_1t", 1), ("_nt", n)] {
        let scratch = Scratch::new(&format!("tensors{suffix}"));
        let engine =
            Engine::open(engine_config(&scratch, many.total, 2).with_copy_threads(copy_threads))
                .unwrap_or_else(|e| panic!("opening the engine: {e}"));
        let mut step = 0;
        warm_engine(&engine, &mut step, &host_many, 2);
        warm_engine(&engine, &mut step, &host_few, 2);
        let (mut s_many, mut s_few) = (Vec::new(), Vec::new());
        let many_row = format!("acp_save_many{suffix}");
        let few_row = format!("acp_save_10{suffix}");
        bench_save(
            &mut g,
            &many_row,
            &engine,
            &mut step,
            &host_many,
            &mut s_many,
        );
        bench_save(&mut g, &few_row, &engine, &mut step, &host_few, &mut s_few);
        notes.set(
            &format!("{many_row}: median SaveReport.stall_secs (ms)"),
            median(&s_many) * 1e3,
        );
        notes.set(
            &format!("{few_row}: median SaveReport.stall_secs (ms)"),
            median(&s_few) * 1e3,
        );
        engine
            .close()
            .unwrap_or_else(|e| panic!("closing the engine: {e}"));
    }
    g.finish();

    notes.set("tensors", count);
    notes.set("bytes", human_bytes(many.total as u64));
    notes.set("_nt threads", n);
    notes.save();
}

criterion_group!(benches, tensors);
criterion_main!(benches);
