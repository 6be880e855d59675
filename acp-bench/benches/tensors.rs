//! Tensors: the per-tensor cost of the stall. 20,000 F32 tensors of random
//! sizes between 4 and 64 KiB (fixed seed; `ACP_BENCH_TENSORS` changes the
//! count), and 10 tensors of the same total size, saved by acp and copied
//! one by one by memcpy into a pre-faulted buffer.
//!
//! Per-tensor overhead = (`acp_save_many_1t` − `memcpy_many_1t`) / count,
//! with the engine's copy threads set to 1 so both sides copy on one
//! thread; the `_nt` rows use N threads on both sides (the engine's
//! default). The report prints the overhead. Each acp iteration also times
//! its memcpy baseline right before the save (untimed for criterion); the
//! notes give the median of those back-to-back differences per tensor.

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use acp_bench::{
    copy_pairs_parallel, engine_config, human_bytes, measurement_time, median, save,
    small_tensor_count, threads, wait_and_trim, warm_engine, warm_up_time, AlignedBuf, Notes,
    Paired, Scratch, TensorSet, SAMPLES,
};
use acp_core::format::{
    chunk_digests, data_file_name, parse_header, FileEntry, ImageMeta, Index, Layout, TensorSpec,
    FORMAT_VERSION,
};
use acp_core::{Engine, HostTensor};
use criterion::{
    criterion_group, criterion_main, measurement::WallTime, BenchmarkGroup, Criterion,
    SamplingMode, Throughput,
};

/// One acp row: the engine, the tensors, and the baseline timed right
/// before each save.
struct Row<'a, 'b> {
    name: String,
    engine: &'a Engine,
    host: &'a [HostTensor<'b>],
    base: &'a mut dyn FnMut() -> Duration,
}

/// Times the stall of saves on `row.engine`; flushes untimed. Returns the
/// `SaveReport` stalls and the back-to-back pairs.
fn bench_save(
    g: &mut BenchmarkGroup<'_, WallTime>,
    row: Row<'_, '_>,
    step: &mut u64,
) -> (Vec<f64>, Paired) {
    let mut stalls = Vec::new();
    let mut paired = Paired::default();
    g.bench_function(&row.name, |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let base = (row.base)();
                *step += 1;
                let t = Instant::now();
                let h = save(row.engine, *step, row.host);
                let stall = t.elapsed();
                timed += stall;
                paired.push(base, stall);
                stalls.push(wait_and_trim(row.engine, &h).stall_secs);
            }
            timed
        });
    });
    (stalls, paired)
}

/// Times one memcpy of `set` from `src` into `dst` (the pair list is built
/// untimed).
fn timed_copy(set: &TensorSet, dst: &mut [u8], src: &[u8], threads: usize) -> Duration {
    let mut pairs = set.pairs(dst, src);
    let t = Instant::now();
    copy_pairs_parallel(&mut pairs, threads);
    black_box(&mut pairs);
    t.elapsed()
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
        for (set, host, label) in [(&many, &host_many, "many"), (&few, &host_few, "10")] {
            let name = format!("acp_save_{label}{suffix}");
            let mut base = || timed_copy(set, &mut dst, &src, copy_threads);
            let row = Row {
                name: name.clone(),
                engine: &engine,
                host,
                base: &mut base,
            };
            let (stalls, paired) = bench_save(&mut g, row, &mut step);
            notes.set(
                &format!("{name}: median SaveReport.stall_secs (ms)"),
                median(&stalls) * 1e3,
            );
            let base_row = format!("memcpy_{label}{suffix}");
            notes.set(&format!("{name}: paired"), paired.summary(&base_row, &name));
            if label == "many" {
                #[expect(clippy::cast_precision_loss, reason = "a tensor count")]
                let per = paired.median_diff() / set.len() as f64 * 1e6;
                notes.set(
                    &format!("{name}: paired per-tensor overhead vs {base_row} (µs)"),
                    per,
                );
            }
        }
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

/// The header of an image of `set`, with a values tree that refers to each
/// tensor as the Python binding's does (`{"t":"tensor","fw":"torch",
/// "name":...}` under one dict node).
fn header_of(set: &TensorSet, src: &[u8]) -> (Vec<u8>, u64) {
    let host = set.host(src);
    let specs: Vec<TensorSpec> = host.iter().map(HostTensor::spec).collect();
    let names: Vec<&str> = host.iter().map(|t| t.name).collect();
    let refs: Vec<serde_json::Value> = names
        .iter()
        .map(|n| serde_json::json!({"t": "tensor", "fw": "torch", "name": n}))
        .collect();
    let values = serde_json::json!({"acp.codec": 1, "state": {"t": "dict", "k": names, "v": refs}});
    let meta = ImageMeta {
        step: 1,
        rank: 0,
        world_size: 1,
        values: serde_json::Value::Null,
        extra: std::collections::BTreeMap::new(),
    };
    let layout = Layout::plan_json(&specs, &meta, &values.to_string())
        .unwrap_or_else(|e| panic!("laying out the header: {e}"));
    (layout.header_bytes().to_vec(), layout.total_len)
}

/// The parse of a header of many tensors (the load's plan from a header,
/// a restart's first load), and of the index of a step of them (read by
/// every load of a committed step), each against reading the same JSON
/// and building nothing (`serde::de::IgnoredAny`): the floor of any parse.
fn header(c: &mut Criterion) {
    let count = small_tensor_count();
    let many = TensorSet::small(count, 4 << 10, 64 << 10, 42);
    let src = AlignedBuf::random(many.total, 4);
    let (bytes, file_len) = header_of(&many, &src);
    let text = &bytes[8..];
    let mut g = c.benchmark_group("header");
    g.sample_size(SAMPLES)
        .warm_up_time(warm_up_time())
        .measurement_time(measurement_time())
        .throughput(Throughput::Bytes(bytes.len() as u64));
    g.bench_function("json_scan_many", |b| {
        b.iter(|| {
            let scan: serde::de::IgnoredAny = serde_json::from_slice(black_box(text))
                .unwrap_or_else(|e| panic!("scanning the header: {e}"));
            black_box(scan);
        });
    });
    g.bench_function("parse_header_many", |b| {
        b.iter(|| {
            let h = parse_header(Path::new("bench"), black_box(&bytes), file_len)
                .unwrap_or_else(|e| panic!("parsing the header: {e}"));
            black_box(h);
        });
    });
    let index = index_of(&many, &src).to_json();
    g.throughput(Throughput::Bytes(index.len() as u64));
    g.bench_function("json_scan_index_many", |b| {
        b.iter(|| {
            let scan: serde::de::IgnoredAny = serde_json::from_slice(black_box(&index))
                .unwrap_or_else(|e| panic!("scanning the index: {e}"));
            black_box(scan);
        });
    });
    g.bench_function("parse_index_many", |b| {
        b.iter(|| {
            let i = Index::parse(Path::new("bench"), black_box(&index))
                .unwrap_or_else(|e| panic!("parsing the index: {e}"));
            black_box(i);
        });
    });
    g.finish();
    let mut notes = Notes::new("header");
    notes.set("tensors", count);
    notes.set("header bytes", human_bytes(bytes.len() as u64));
    notes.set("index bytes", human_bytes(index.len() as u64));
    notes.save();
}

/// The index of a step of one rank's image of `set` (every load of a
/// committed step reads it: its `weight_map` names each tensor).
fn index_of(set: &TensorSet, src: &[u8]) -> Index {
    let chunk = 4usize << 20;
    let chunks = chunk_digests(&src[..set.total], chunk);
    let file = data_file_name(0);
    let entry = FileEntry::plain(0, set.total as u64, chunk as u64, &chunks);
    Index {
        step: 1,
        world_size: 1,
        format_version: FORMAT_VERSION,
        files: std::collections::BTreeMap::from([(file.clone(), entry)]),
        weight_map: set
            .tensors
            .iter()
            .map(|t| (t.name.clone(), file.clone()))
            .collect(),
    }
}

criterion_group!(benches, tensors, header);
criterion_main!(benches);
