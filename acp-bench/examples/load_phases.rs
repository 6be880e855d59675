//! A cold `load_into` from storage in a loop, plain or zstd, with its
//! planning (`Engine::open_load`: the file opened, its header read and
//! checked) timed apart from the read (`PendingLoad::read_into`: every
//! chunk read, decoded, verified and copied into the caller's memory).
//! Criterion's `restore` bench times the whole load; this splits it, and
//! runs under `perf record` without criterion's own work beside it.
//!
//! ```text
//! ACP_BENCH_BYTES=67108864 cargo run --release -p acp-bench --example load_phases -- zstd 30
//! ```
//!
//! Arguments: `plain` or `zstd` (default), the number of loads (30), and
//! `warm` to leave the page cache as it is (cold by default: the file's
//! pages are dropped before each load, as in `restore`). The state is
//! [`TensorSet::model_like`] of fp32 normal(0, 0.02) values.

use std::time::Instant;

use acp_bench::{
    bench_bytes, drop_caches, engine_config, median, save, split_dst, wait_and_trim, warm_engine,
    AlignedBuf, Scratch, TensorSet,
};
use acp_core::{Compress, Engine, LoadRequest, Opened};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let zstd = !args.iter().any(|a| a == "plain");
    let warm = args.iter().any(|a| a == "warm");
    let n: usize = args
        .iter()
        .find_map(|a| a.parse().ok())
        .unwrap_or(30)
        .max(1);
    let set = TensorSet::model_like(bench_bytes());
    let src = AlignedBuf::weights(set.total);
    let scratch = Scratch::new("load-phases");
    let mut cfg = engine_config(&scratch, set.total, 2);
    if zstd {
        cfg = cfg.with_compress(Compress::Zstd).with_compress_level(1);
    }
    let engine = Engine::open(cfg)?;
    let host = set.host(&src);
    let mut step = 0;
    warm_engine(&engine, &mut step, &host, 1);
    wait_and_trim(&engine, &save(&engine, step + 1, &host));
    step += 1;
    let req = LoadRequest {
        step: Some(step),
        storage_only: true,
        ..LoadRequest::default()
    };
    let mut dst = AlignedBuf::new(set.total);
    let ranges = set.ranges();
    let (mut plans, mut totals) = (Vec::new(), Vec::new());
    let mut cpu = std::time::Duration::ZERO;
    for _ in 0..n {
        if !warm {
            let _ = drop_caches();
        }
        let c = cpu_time();
        let t = Instant::now();
        let Opened::Pending(p) = engine.open_load(&req)? else {
            return Err("a storage load that is not pending".into());
        };
        plans.push(t.elapsed().as_secs_f64() * 1e3);
        let mut into = Vec::new();
        for (i, d) in split_dst(&mut dst, &ranges) {
            let name = &set.tensors[i].name;
            let at = p
                .entries()
                .iter()
                .position(|e| &e.name == name)
                .ok_or_else(|| format!("`{name}` is not in the checkpoint"))?;
            into.push((at, d));
        }
        drop(p.read_into(&mut into)?);
        totals.push(t.elapsed().as_secs_f64() * 1e3);
        cpu += cpu_time().saturating_sub(c);
    }
    if dst[..] != src[..] {
        return Err("the loads returned other bytes".into());
    }
    println!(
        "{} {}: {n} loads of {} MiB, median {:.1} ms, of which planning {:.2} ms; \
         CPU time (user + system, all threads) {:.1} ms per load",
        if zstd { "zstd" } else { "plain" },
        if warm { "warm" } else { "cold" },
        set.total >> 20,
        median(&totals),
        median(&plans),
        cpu.as_secs_f64() * 1e3 / n as f64,
    );
    Ok(())
}

/// The process's CPU time so far, user and system, all threads.
fn cpu_time() -> std::time::Duration {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is valid for writes of one `rusage`, which getrusage
    // fills on success; on failure it is left zeroed, which is a valid
    // `rusage` (all integers).
    let ru = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr());
        ru.assume_init()
    };
    let t = |tv: libc::timeval| {
        std::time::Duration::new(
            u64::try_from(tv.tv_sec).unwrap_or(0),
            u32::try_from(tv.tv_usec).unwrap_or(0) * 1000,
        )
    };
    t(ru.ru_utime) + t(ru.ru_stime)
}
