//! Flush: from the end of the stall to the step being committed, against
//! raw `O_DIRECT` writes of the same bytes to a fresh file in the same
//! directory (each ending with `fsync`).
//!
//! Rows:
//! - `raw_pwrite_4m`: `pwrite` of 4 MiB blocks, one at a time;
//! - `raw_uring_4m_qd8`: `io_uring`, 4 MiB blocks, 8 in flight (acp's defaults);
//! - `raw_uring_1m_qd32`: `io_uring`, 1 MiB blocks, 32 in flight (the best
//!   fio configuration on this machine), and `_falloc` with the file
//!   preallocated first (inside the timed region);
//! - `acp_io_write`: acp's own io layer (`IoEngine::write_file`, engine
//!   `Auto`, same chunk and depth as the engine), no hashing, no commit;
//! - `acp_flush`: `save` untimed, then the time from its return to
//!   `SaveHandle::wait` returning: queue + write + blake3 of every chunk +
//!   fsync + index + renames + directory fsyncs. Old steps are deleted
//!   untimed, as the raw files are (then the directory is fsynced, so the
//!   deletion's journal commit is not paid by the next timed fsync).
//!
//! Each `acp_flush` iteration also times a `raw_uring_1m_qd32_falloc` write
//! (acp's io layer preallocates too) right before its save (untimed for
//! criterion); the notes give the median of those back-to-back ratios,
//! steadier than the rows on a shared disk.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use acp_bench::{
    bench_bytes, engine_config, human_bytes, measurement_time, median, raw, remove_settled, save,
    wait_and_trim, warm_engine, AlignedBuf, Notes, Paired, Scratch, TensorSet, BLOCK, SAMPLES,
};
use acp_core::io::IoOpts;
use acp_core::{DirectIo, Engine, IoChoice};
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};

type Writer<'a> = Box<dyn Fn(&Path) -> std::io::Result<()> + 'a>;

fn flush(c: &mut Criterion) {
    let bytes = bench_bytes();
    let set = TensorSet::model_like(bytes);
    let src = AlignedBuf::random(set.total, 1);
    let scratch = Scratch::new("flush");
    let engine = Engine::open(engine_config(&scratch, set.total, 2))
        .unwrap_or_else(|e| panic!("opening the engine: {e}"));
    let host = set.host(&src);
    let mut step = 0;
    warm_engine(&engine, &mut step, &host, 2);
    step += 1;
    let probe = wait_and_trim(&engine, &save(&engine, step, &host));
    // The raw rows write exactly the image's length, padded to 4096.
    let image = usize::try_from(probe.bytes).expect("the image fits in memory");
    let raw_src = AlignedBuf::random(image, 2);
    let mut n_file = 0u64;
    let mut fresh = || {
        n_file += 1;
        scratch.dir().join(format!("raw-{n_file}"))
    };

    let mut g = c.benchmark_group("flush");
    g.sample_size(SAMPLES)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(measurement_time() / 2)
        .throughput(Throughput::Bytes(image as u64));

    let padded = raw_src.padded();
    let raws: Vec<(&str, Writer<'_>)> = vec![
        (
            "raw_pwrite_4m",
            Box::new(|p| raw::write_pwrite(p, padded, BLOCK)),
        ),
        (
            "raw_uring_4m_qd8",
            Box::new(|p| raw::write_uring(p, padded, BLOCK, 8, false)),
        ),
        (
            "raw_uring_1m_qd32",
            Box::new(|p| raw::write_uring(p, padded, 1 << 20, 32, false)),
        ),
        (
            "raw_uring_1m_qd32_falloc",
            Box::new(|p| raw::write_uring(p, padded, 1 << 20, 32, true)),
        ),
    ];
    for (name, write) in &raws {
        g.bench_function(*name, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                for _ in 0..iters {
                    let path: PathBuf = fresh();
                    let t = Instant::now();
                    write(&path).unwrap_or_else(|e| panic!("{name} {}: {e}", path.display()));
                    timed += t.elapsed();
                    remove_settled(&path);
                }
                timed
            });
        });
    }

    let io = acp_core::io::open_engine(IoChoice::Auto)
        .unwrap_or_else(|e| panic!("opening acp's io engine: {e}"));
    let opts = IoOpts {
        chunk_bytes: BLOCK,
        queue_depth: 8,
        direct: DirectIo::Auto,
        faults: None,
    };
    g.bench_function("acp_io_write", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let path = fresh();
                let t = Instant::now();
                io.write_file(&path, padded, image as u64, &opts, &mut |_, _| Ok(()))
                    .unwrap_or_else(|e| panic!("acp write_file {}: {e}", path.display()));
                timed += t.elapsed();
                remove_settled(&path);
            }
            timed
        });
    });

    let mut reports = Vec::new();
    let mut paired = Paired::default();
    g.bench_function("acp_flush", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let path = fresh();
                let t = Instant::now();
                raw::write_uring(&path, padded, 1 << 20, 32, true)
                    .unwrap_or_else(|e| panic!("raw write {}: {e}", path.display()));
                let base = t.elapsed();
                remove_settled(&path);
                step += 1;
                let h = save(&engine, step, &host);
                let t = Instant::now();
                let rep = h
                    .wait()
                    .unwrap_or_else(|e| panic!("save of step {step}: {e}"));
                let flushed = t.elapsed();
                timed += flushed;
                paired.push(base, flushed);
                reports.push(rep);
                wait_and_trim(&engine, &h);
            }
            timed
        });
    });
    g.finish();

    let ms = |f: fn(&acp_core::SaveReport) -> f64| {
        median(&reports.iter().map(f).collect::<Vec<_>>()) * 1e3
    };
    let mut notes = Notes::new("flush");
    notes.set("bytes", human_bytes(image as u64));
    notes.set("dir", scratch.dir().display().to_string());
    notes.set("acp io engine", format!("{:?}", probe.io));
    notes.set("acp O_DIRECT", probe.direct);
    notes.set(
        "paired",
        paired.summary("raw_uring_1m_qd32_falloc", "acp_flush"),
    );
    notes.set("acp_flush: median queue_secs (ms)", ms(|r| r.queue_secs));
    notes.set("acp_flush: median flush_secs (ms)", ms(|r| r.flush_secs));
    notes.set("acp_flush: median commit_secs (ms)", ms(|r| r.commit_secs));
    notes.save();
    engine
        .close()
        .unwrap_or_else(|e| panic!("closing the engine: {e}"));
}

criterion_group!(benches, flush);
criterion_main!(benches);
