//! Restore: loading a committed step into pre-faulted destination tensors,
//! from storage (cold) and from the resident ring slot, against a raw
//! sequential read of the same file and a memcpy of the same bytes.
//!
//! Rows:
//! - `raw_read`: page cache dropped (untimed), then a plain `read` loop of
//!   4 MiB into a pre-faulted buffer;
//! - `raw_read_direct`: the same cold file read with `O_DIRECT` through
//!   `io_uring`, 4 MiB blocks, 8 in flight (acp's defaults);
//! - `acp_load_storage`: page cache dropped (untimed), then
//!   `load(storage_only)` (read into a ring slot, blake3 verification,
//!   header parse) and `copy_into` the destination tensors;
//! - `acp_load_into_storage`: the same load through `Engine::load_into`,
//!   which fills the destination tensors in the read's own pass (each read
//!   copied by the thread that checked it, while in cache); each iteration
//!   also times, untimed for criterion, a cold `raw_read_direct` followed
//!   by the scatter of the tensors out of the read buffer into the
//!   destination on the copy threads (the physical floor of target 4: the
//!   read and the scatter), and the same `load_into` of the same state saved
//!   compressed (`Compress::Zstd`, level 1, by a second engine: issue 17's
//!   cold restore from compressed storage against the plain one);
//! - `memcpy_1t`, `memcpy_nt`: the tensors copied from a pre-faulted buffer
//!   into the destination;
//! - `acp_load_ram`: `load` from the resident slot (verify `Always`, the
//!   default: every chunk checked against the xxh3 sums the flush recorded
//!   beside its blake3 digests in the slot's control block)
//!   and `copy_into`;
//! - `acp_load_into_ram`: the same load through `Engine::load_into`, which
//!   checks each chunk against its sum and copies it into the destination
//!   tensors while it is in cache, in one pass on the copy threads; each
//!   iteration paired with a `memcpy_nt` right before it, and followed
//!   (untimed for criterion, in the notes) by an `acp_load_ram` (check
//!   pass, then copy);
//! - `acp_load_ram_new_process`: the first load of a new process (a
//!   restart): the engine closed and opened again on the same ring
//!   (untimed), then `Engine::load_into` from the resident slot, checked
//!   against the xxh3 sums the flush recorded in the slot's control block
//!   in the copy's pass; each iteration paired with a `memcpy_nt` right before it,
//!   and followed (untimed for criterion, in the notes) by the same with
//!   the slot's sums unmade before the open (its digests recorded again):
//!   that load re-hashes the slot with blake3, as every new process's
//!   first load did before the sums were kept in the slot;
//! - `acp_load_into_storage_new_node`: a replaced node's restore: an engine
//!   on the same root opened over a new, empty ring (untimed), then the
//!   cold `Engine::load_into` from storage, which finds no slot ready and
//!   streams the file into the destination through small buffers; each
//!   iteration paired with a cold `raw_read_direct` + scatter right before
//!   it;
//! - `acp_load_ram_trusted`: the same with `Verify::StorageOnly` (a second
//!   engine; the resident slot is trusted, no hashing).
//!
//! Each `acp_load_storage` iteration also times a cold `raw_read` and a
//! cold `raw_read_direct` right before it, and each `acp_load_ram` a
//! `memcpy_nt` (untimed for criterion): the notes give the medians of
//! those back-to-back ratios, and of `LoadReport::secs` (the load up to the
//! views being ready: read and verification, without the `copy_into`),
//! also paired with `raw_read_direct`.
//!
//! `ACP_BENCH_RESTORE_WEIGHTS=normal` fills the state with fp32 values
//! drawn from normal(0, 0.02), as trained weights are, instead of random
//! bytes: their compressed file then holds zstd frames to decode (random
//! bytes do not shrink, and are stored as they are).
//!
//! Dropping the page cache needs root; when refused, the storage rows are
//! warm reads, and the report's notes say so.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::{Duration, Instant};

use acp_bench::{
    bench_bytes, copy_pairs, copy_pairs_parallel, drop_caches, engine_config, human_bytes,
    measurement_time, median, raw, save, split_dst, threads, wait_and_trim, warm_engine,
    warm_up_time, AlignedBuf, Notes, Paired, Scratch, TensorSet, BLOCK, SAMPLES,
};
use acp_core::{Checkpoint, Compress, Engine, LoadRequest, Source, Verify};
use criterion::{criterion_group, criterion_main, Criterion, SamplingMode, Throughput};

/// `(entry index, offset in the destination, len)` of every tensor of `ck`.
fn ranges(ck: &Checkpoint, set: &TensorSet) -> Vec<(usize, usize, usize)> {
    let by_name: HashMap<&str, (usize, usize)> = set
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), (t.offset, t.len)))
        .collect();
    ck.entries()
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let (off, len) = by_name[e.name.as_str()];
            (i, off, len)
        })
        .collect()
}

/// Loads `step` per `req`, copies every tensor into `dst`; returns the
/// checkpoint (dropped by the caller, untimed) after checking its source.
fn load_into(engine: &Engine, req: &LoadRequest, set: &TensorSet, dst: &mut [u8]) -> Checkpoint {
    let ck = engine
        .load(req)
        .unwrap_or_else(|e| panic!("loading {req:?}: {e}"));
    let want = if req.storage_only {
        Source::Storage
    } else {
        Source::Ram
    };
    assert_eq!(ck.report().source, want, "{req:?}");
    let mut dsts = split_dst(dst, &ranges(&ck, set));
    ck.copy_into(&mut dsts)
        .unwrap_or_else(|e| panic!("copy_into: {e}"));
    ck
}

/// [`load_into`] through [`Engine::load_into`]: the tensors are filled by
/// the load itself (from storage, in the read's pass; from a resident
/// slot, in the pass that checks it).
fn load_into_fused(
    engine: &Engine,
    req: &LoadRequest,
    set: &TensorSet,
    dst: &mut [u8],
) -> Checkpoint {
    let mut into: Vec<(&str, &mut [u8])> = split_dst(dst, &set.ranges())
        .into_iter()
        .map(|(i, d)| (set.tensors[i].name.as_str(), d))
        .collect();
    let ck = engine
        .load_into(req, &mut into)
        .unwrap_or_else(|e| panic!("loading {req:?} into: {e}"));
    let want = if req.storage_only {
        Source::Storage
    } else {
        Source::Ram
    };
    assert_eq!(ck.report().source, want, "{req:?}");
    ck
}

/// Unmakes the quick sums recorded beside the digests of every slot
/// holding `step` in the ring of `cfg` (no engine holds it; a load from
/// storage may have put the step in a second slot): their digests are
/// recorded again, as a slot filled by a version without sums has them.
fn unmake_sums(scratch: &Scratch, cfg: &acp_core::EngineConfig, step: u64) {
    use acp_core::staging::{peek_slot, user_dir, Ring, RingOptions};
    let dir = user_dir(scratch.shm());
    let found: Vec<(usize, String, acp_core::staging::SlotPeek)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("listing {}: {e}", dir.display()))
        .filter_map(|e| {
            let path = e.ok()?.path();
            let peek = peek_slot(&path).ok()??;
            let name = path.file_name()?.to_str()?.to_owned();
            let (prefix, index) = name.rsplit_once("-s")?;
            (peek.is_complete() && peek.step == step)
                .then(|| Some((index.parse().ok()?, prefix.to_owned(), peek)))?
        })
        .collect();
    let Some((_, prefix, peek)) = found.first() else {
        panic!("no slot holds step {step} in {}", dir.display());
    };
    let (ring, _) = Ring::open(RingOptions {
        dir: scratch.shm().to_path_buf(),
        prefix: prefix.clone(),
        job_tag: peek.job_tag,
        rank: peek.rank,
        slots: found.iter().map(|f| f.0 + 1).max().unwrap_or(2).max(2),
        budget: cfg.ring_bytes(),
        shared_budget: false,
        chunk_bytes: acp_core::config::DEFAULT_CHUNK_BYTES as u64,
        mlock: false,
    })
    .unwrap_or_else(|e| panic!("opening the ring in {}: {e}", dir.display()));
    for (slot, _, _) in &found {
        let digests = ring
            .digests(*slot)
            .unwrap_or_else(|| panic!("slot {slot} of step {step} has no digests"));
        ring.set_digests(*slot, &digests);
        assert!(ring.quick_sums(*slot).is_none(), "sums unmade");
    }
}

/// Copies each tensor `(file offset, destination offset, len)` of
/// `places` out of the file image `image` into `dst` on `threads` threads.
fn scatter(image: &[u8], dst: &mut [u8], places: &[(usize, usize, usize)], threads: usize) {
    let ranges: Vec<(usize, usize, usize)> = places
        .iter()
        .enumerate()
        .map(|(i, &(_, d, len))| (i, d, len))
        .collect();
    let mut pairs: Vec<(&mut [u8], &[u8])> = split_dst(dst, &ranges)
        .into_iter()
        .map(|(i, d)| {
            let (file, _, len) = places[i];
            (d, &image[file..file + len])
        })
        .collect();
    copy_pairs_parallel(&mut pairs, threads);
}

fn restore(c: &mut Criterion) {
    let bytes = bench_bytes();
    let n = threads();
    let set = TensorSet::model_like(bytes);
    let src = if std::env::var("ACP_BENCH_RESTORE_WEIGHTS").is_ok_and(|v| v == "normal") {
        AlignedBuf::weights(set.total)
    } else {
        AlignedBuf::random(set.total, 1)
    };
    let mut dst = AlignedBuf::new(set.total);
    let scratch = Scratch::new("restore");
    let engine = Engine::open(engine_config(&scratch, set.total, 2))
        .unwrap_or_else(|e| panic!("opening the engine: {e}"));
    let host = set.host(&src);
    let mut step = 0;
    warm_engine(&engine, &mut step, &host, 3);
    let image = wait_and_trim(&engine, &save(&engine, step + 1, &host)).bytes;
    step += 1;
    let path = engine
        .root()
        .join(format!("step-{step:012}"))
        .join(acp_core::format::data_file_name(0));
    let mut read_buf = AlignedBuf::new(usize::try_from(image).expect("fits in memory"));
    let cold = drop_caches();
    let storage = LoadRequest {
        step: Some(step),
        storage_only: true,
        ..LoadRequest::default()
    };
    let ram = LoadRequest {
        step: Some(step),
        ..LoadRequest::default()
    };
    // Check once, untimed, that the loads return the saved bytes.
    for req in [&storage, &ram] {
        dst.fill(0);
        drop(load_into(&engine, req, &set, &mut dst));
        assert!(dst[..] == src[..], "{req:?} returned other bytes");
    }

    dst.fill(0);
    drop(load_into_fused(&engine, &storage, &set, &mut dst));
    assert!(
        dst[..] == src[..],
        "load_into {storage:?} returned other bytes"
    );

    // The same state saved compressed by a second engine, for the cold
    // restore from compressed storage.
    let scratch_z = Scratch::new("restore-zstd");
    let zstd = Engine::open(
        engine_config(&scratch_z, set.total, 2)
            .with_compress(Compress::Zstd)
            .with_compress_level(1),
    )
    .unwrap_or_else(|e| panic!("opening the zstd engine: {e}"));
    let mut step_z = 0;
    warm_engine(&zstd, &mut step_z, &host, 1);
    wait_and_trim(&zstd, &save(&zstd, step_z + 1, &host));
    step_z += 1;
    let zstd_file_bytes = std::fs::metadata(
        zstd.root()
            .join(format!("step-{step_z:012}"))
            .join(acp_core::format::data_file_name(0)),
    )
    .map_or(0, |m| m.len());
    let storage_z = LoadRequest {
        step: Some(step_z),
        storage_only: true,
        ..LoadRequest::default()
    };
    dst.fill(0);
    drop(load_into_fused(&zstd, &storage_z, &set, &mut dst));
    assert!(
        dst[..] == src[..],
        "load_into {storage_z:?} (zstd) returned other bytes"
    );
    // Where each tensor is in the file image and in the destination, for
    // the read + scatter baseline.
    let places: Vec<(usize, usize, usize)> = {
        let ck = engine
            .load(&storage)
            .unwrap_or_else(|e| panic!("loading {storage:?}: {e}"));
        let by_name: HashMap<&str, usize> = set
            .tensors
            .iter()
            .map(|t| (t.name.as_str(), t.offset))
            .collect();
        ck.entries()
            .iter()
            .map(|e| {
                let len = usize::try_from(e.len).expect("fits in memory");
                let file = usize::try_from(e.offset).expect("fits in memory");
                (file, by_name[e.name.as_str()], len)
            })
            .collect()
    };

    let mut g = c.benchmark_group("restore");
    g.sample_size(SAMPLES)
        .sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(measurement_time() / 2)
        .throughput(Throughput::Bytes(set.total as u64));

    g.bench_function("raw_read", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let _ = drop_caches();
                let t = Instant::now();
                let got = raw::read_buffered(&path, &mut read_buf, BLOCK)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                timed += t.elapsed();
                assert_eq!(got as u64, image);
            }
            timed
        });
    });
    g.bench_function("raw_read_direct", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let _ = drop_caches();
                let t = Instant::now();
                let got = raw::read_uring(&path, read_buf.padded_mut(), BLOCK, 8)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                timed += t.elapsed();
                assert_eq!(got as u64, image);
            }
            timed
        });
    });
    let mut paired_storage = Paired::default();
    let mut paired_direct = Paired::default();
    let mut paired_direct_load = Paired::default();
    let mut storage_secs = Vec::new();
    g.bench_function("acp_load_storage", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let _ = drop_caches();
                let t = Instant::now();
                raw::read_buffered(&path, &mut read_buf, BLOCK)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                let base = t.elapsed();
                let _ = drop_caches();
                let t = Instant::now();
                raw::read_uring(&path, read_buf.padded_mut(), BLOCK, 8)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                let base_direct = t.elapsed();
                let _ = drop_caches();
                let t = Instant::now();
                let ck = load_into(&engine, &storage, &set, &mut dst);
                let took = t.elapsed();
                timed += took;
                paired_storage.push(base, took);
                paired_direct.push(base_direct, took);
                paired_direct_load.push(base_direct, Duration::from_secs_f64(ck.report().secs));
                storage_secs.push(ck.report().secs);
                drop(ck);
            }
            timed
        });
    });
    let mut paired_into = Paired::default();
    let mut paired_into_vs_load = Paired::default();
    let mut paired_into_scatter = Paired::default();
    let mut paired_zstd = Paired::default();
    g.bench_function("acp_load_into_storage", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let _ = drop_caches();
                let t = Instant::now();
                raw::read_uring(&path, read_buf.padded_mut(), BLOCK, 8)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                let base_direct = t.elapsed();
                let _ = drop_caches();
                let t = Instant::now();
                drop(load_into(&engine, &storage, &set, &mut dst));
                let two_pass = t.elapsed();
                let _ = drop_caches();
                let t = Instant::now();
                let ck = load_into_fused(&engine, &storage, &set, &mut dst);
                let took = t.elapsed();
                timed += took;
                paired_into.push(base_direct, took);
                paired_into_vs_load.push(two_pass, took);
                drop(ck);
                let _ = drop_caches();
                let t = Instant::now();
                raw::read_uring(&path, read_buf.padded_mut(), BLOCK, 8)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                scatter(&read_buf, &mut dst, &places, n);
                paired_into_scatter.push(t.elapsed(), took);
                let _ = drop_caches();
                let t = Instant::now();
                drop(load_into_fused(&zstd, &storage_z, &set, &mut dst));
                paired_zstd.push(took, t.elapsed());
            }
            timed
        });
    });

    g.sampling_mode(SamplingMode::Auto)
        .warm_up_time(warm_up_time())
        .measurement_time(measurement_time());
    let mut pairs = set.pairs(&mut read_buf, &src);
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
    let mut paired_ram = Paired::default();
    let mut ram_secs = Vec::new();
    g.bench_function("acp_load_ram", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                copy_pairs_parallel(&mut pairs, n);
                black_box(&mut pairs);
                let base = t.elapsed();
                let t = Instant::now();
                let ck = load_into(&engine, &ram, &set, &mut dst);
                let took = t.elapsed();
                timed += took;
                paired_ram.push(base, took);
                ram_secs.push(ck.report().secs);
                drop(ck);
            }
            timed
        });
    });
    let mut paired_ram_into = Paired::default();
    let mut paired_ram_into_vs_load = Paired::default();
    g.bench_function("acp_load_into_ram", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                copy_pairs_parallel(&mut pairs, n);
                black_box(&mut pairs);
                let base = t.elapsed();
                let t = Instant::now();
                let ck = load_into_fused(&engine, &ram, &set, &mut dst);
                let took = t.elapsed();
                timed += took;
                paired_ram_into.push(base, took);
                drop(ck);
                // The same load checked, then copied (untimed for criterion).
                let t = Instant::now();
                drop(load_into(&engine, &ram, &set, &mut dst));
                paired_ram_into_vs_load.push(t.elapsed(), took);
            }
            timed
        });
    });
    zstd.close()
        .unwrap_or_else(|e| panic!("closing the zstd engine: {e}"));
    drop(zstd);
    drop(scratch_z);
    let mlocked = engine.open_report().mlocked;
    engine
        .close()
        .unwrap_or_else(|e| panic!("closing the engine: {e}"));
    drop(engine);

    // The first load of a new process (a restart): the engine closed and
    // opened again on the same ring, untimed, then one load, paired with a
    // memcpy run right before it. Each iteration then also times, untimed
    // for criterion, the same after the slot's sums were unmade (its
    // digests recorded again): what a new process's first load did before
    // the sums were kept in the slot (a blake3 pass over the image).
    g.sampling_mode(SamplingMode::Flat)
        .warm_up_time(Duration::from_millis(50))
        .measurement_time(measurement_time() / 2);
    let cfg = || engine_config(&scratch, set.total, 2);
    let mut live: Option<Engine> = None;
    let mut paired_first = Paired::default();
    let mut paired_first_blake3 = Paired::default();
    let (mut first_secs, mut first_blake3_secs) = (Vec::new(), Vec::new());
    let reopen = |live: &mut Option<Engine>, unmake: bool| -> Engine {
        if let Some(e) = live.take() {
            e.close()
                .unwrap_or_else(|e| panic!("closing the engine: {e}"));
        }
        if unmake {
            unmake_sums(&scratch, &cfg(), step);
        }
        Engine::open(cfg()).unwrap_or_else(|e| panic!("opening the engine again: {e}"))
    };
    g.bench_function("acp_load_ram_new_process", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                for unmake in [false, true] {
                    let e = reopen(&mut live, unmake);
                    let t = Instant::now();
                    copy_pairs_parallel(&mut pairs, n);
                    black_box(&mut pairs);
                    let base = t.elapsed();
                    let t = Instant::now();
                    let ck = load_into_fused(&e, &ram, &set, &mut dst);
                    let took = t.elapsed();
                    if unmake {
                        paired_first_blake3.push(base, took);
                        first_blake3_secs.push(ck.report().secs);
                    } else {
                        timed += took;
                        paired_first.push(base, took);
                        first_secs.push(ck.report().secs);
                    }
                    drop(ck);
                    live = Some(e);
                }
            }
            timed
        });
    });
    drop(pairs);
    if let Some(e) = live.take() {
        e.close()
            .unwrap_or_else(|e| panic!("closing the engine: {e}"));
    }

    // A replaced node's restore: an engine on the same root opened over a
    // new, empty ring (untimed), the page cache dropped, then
    // `Engine::load_into` from storage; each iteration paired with a cold
    // `raw_read_direct` + scatter right before it. No slot is ready, so
    // the file is streamed into the tensors through small buffers. The
    // re-read that would then make the step resident in the background
    // (`keep_restored`) is off: it follows the timed load, and each
    // iteration's close would wait for it.
    let mut paired_node = Paired::default();
    let mut node_secs = Vec::new();
    let mut nodes = 0u32;
    g.bench_function("acp_load_into_storage_new_node", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                nodes += 1;
                let shm = scratch.shm().join(format!("node-{nodes}"));
                std::fs::create_dir_all(&shm)
                    .unwrap_or_else(|e| panic!("creating {}: {e}", shm.display()));
                let e = Engine::open(cfg().with_shm_dir(&shm).with_keep_restored(false))
                    .unwrap_or_else(|e| panic!("opening the engine on a new ring: {e}"));
                let _ = drop_caches();
                let t = Instant::now();
                raw::read_uring(&path, read_buf.padded_mut(), BLOCK, 8)
                    .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
                scatter(&read_buf, &mut dst, &places, n);
                let base = t.elapsed();
                let _ = drop_caches();
                let t = Instant::now();
                let ck = load_into_fused(&e, &storage, &set, &mut dst);
                let took = t.elapsed();
                timed += took;
                paired_node.push(base, took);
                node_secs.push(ck.report().secs);
                drop(ck);
                e.close()
                    .unwrap_or_else(|e| panic!("closing the engine: {e}"));
                let _ = std::fs::remove_dir_all(&shm);
            }
            timed
        });
    });
    drop(scratch);

    let scratch2 = Scratch::new("restore-trusted");
    let trusted =
        Engine::open(engine_config(&scratch2, set.total, 2).with_verify(Verify::StorageOnly))
            .unwrap_or_else(|e| panic!("opening the engine: {e}"));
    let mut step2 = 0;
    warm_engine(&trusted, &mut step2, &host, 3);
    let ram2 = LoadRequest {
        step: Some(step2),
        ..LoadRequest::default()
    };
    g.bench_function("acp_load_ram_trusted", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            for _ in 0..iters {
                let t = Instant::now();
                let ck = load_into(&trusted, &ram2, &set, &mut dst);
                timed += t.elapsed();
                drop(ck);
            }
            timed
        });
    });
    g.finish();
    trusted
        .close()
        .unwrap_or_else(|e| panic!("closing the engine: {e}"));

    let mut notes = Notes::new("restore");
    notes.set("bytes", human_bytes(set.total as u64));
    notes.set("file bytes", image);
    notes.set("zstd file bytes", zstd_file_bytes);
    notes.set(
        "cold reads (drop_caches)",
        match &cold {
            Ok(()) => "yes".to_owned(),
            Err(e) => format!("NO, warm page cache: {e}"),
        },
    );
    notes.set("memcpy_nt threads", n);
    notes.set(
        "paired storage",
        paired_storage.summary("raw_read", "acp_load_storage"),
    );
    notes.set(
        "paired storage direct",
        paired_direct.summary("raw_read_direct", "acp_load_storage"),
    );
    notes.set(
        "paired storage direct, before copy_into",
        paired_direct_load.summary("raw_read_direct", "acp_load_storage LoadReport.secs"),
    );
    notes.set(
        "paired storage direct, load_into",
        paired_into.summary("raw_read_direct", "acp_load_into_storage"),
    );
    notes.set(
        "paired storage direct + scatter, load_into",
        paired_into_scatter.summary("raw_read_direct + scatter", "acp_load_into_storage"),
    );
    notes.set(
        "paired storage direct + scatter, load_into on a new node",
        paired_node.summary(
            "raw_read_direct + scatter",
            "acp_load_into_storage_new_node",
        ),
    );
    notes.set(
        "acp_load_into_storage_new_node: median LoadReport.secs (ms)",
        median(&node_secs) * 1e3,
    );
    notes.set(
        "paired storage, load_into zstd vs plain",
        paired_zstd.summary("acp_load_into_storage", "acp_load_into_storage zstd"),
    );
    notes.set(
        "paired storage, load_into vs load + copy_into",
        paired_into_vs_load.summary("acp_load_storage", "acp_load_into_storage"),
    );
    notes.set(
        "paired ram",
        paired_ram.summary("memcpy_nt", "acp_load_ram"),
    );
    notes.set(
        "paired ram, load_into",
        paired_ram_into.summary("memcpy_nt", "acp_load_into_ram"),
    );
    notes.set(
        "paired ram, load_into vs load + copy_into",
        paired_ram_into_vs_load.summary("acp_load_ram", "acp_load_into_ram"),
    );
    notes.set(
        "paired ram, first load of a new process",
        paired_first.summary("memcpy_nt", "acp_load_ram_new_process"),
    );
    notes.set(
        "paired ram, first load of a new process, no sums in the slot",
        paired_first_blake3.summary("memcpy_nt", "acp_load_ram_new_process, no sums"),
    );
    notes.set(
        "acp_load_storage: median LoadReport.secs, before copy_into (ms)",
        median(&storage_secs) * 1e3,
    );
    notes.set(
        "acp_load_ram: median LoadReport.secs, before copy_into (ms)",
        median(&ram_secs) * 1e3,
    );
    notes.set(
        "acp_load_ram_new_process: median LoadReport.secs, the check and copy in one pass (ms)",
        median(&first_secs) * 1e3,
    );
    notes.set(
        "acp_load_ram_new_process, no sums: median LoadReport.secs, the blake3 check before the copy (ms)",
        median(&first_blake3_secs) * 1e3,
    );
    notes.set("ring mlocked", mlocked);
    notes.save();
}

/// The ways a restore from RAM can check the image and copy it into the
/// caller's memory, on the same bytes and threads, each paired with a
/// plain `memcpy` of them run right before it: a check pass then a copy
/// pass (blake3, as acp did; xxh3, as acp does), and each chunk checked
/// then copied while it is in cache (the fused pass acp does not have),
/// whole chunks or streamed in 256 KiB pieces (`streamed_xxh3_copy_nt`:
/// a piece reaches the destination before its chunk's sum is known).
/// 4 MiB chunks (acp's default), each thread a contiguous run of them.
fn ram_check(c: &mut Criterion) {
    use std::hash::Hasher;
    const CHUNK: usize = 4 << 20;
    const PIECE: usize = 256 << 10;
    type Check = fn(&[u8]) -> u64;
    fn blake3_sum(b: &[u8]) -> u64 {
        u64::from(blake3::hash(b).as_bytes()[0])
    }
    fn xxh3_sum(b: &[u8]) -> u64 {
        twox_hash::XxHash3_64::oneshot(b)
    }
    /// Copies `src` into `dst` on `n` threads; `check` runs over each
    /// thread's run first (`fused`: over each chunk right before its copy).
    fn run(dst: &mut [u8], src: &[u8], n: usize, check: Option<Check>, fused: bool) -> u64 {
        let per = src.len().div_ceil(n).div_ceil(CHUNK) * CHUNK;
        std::thread::scope(|s| {
            let parts: Vec<_> = dst
                .chunks_mut(per)
                .zip(src.chunks(per))
                .map(|(d, s_)| {
                    s.spawn(move || {
                        let mut acc = 0u64;
                        match (check, fused) {
                            // Streaming: each 256 KiB piece hashed, then
                            // copied while in L2; the chunk's sum known
                            // only after its last piece is copied.
                            (None, true) => {
                                for (dc, sc) in d.chunks_mut(CHUNK).zip(s_.chunks(CHUNK)) {
                                    let mut h = twox_hash::XxHash3_64::new();
                                    for (dp, sp) in dc.chunks_mut(PIECE).zip(sc.chunks(PIECE)) {
                                        h.write(sp);
                                        dp.copy_from_slice(sp);
                                    }
                                    acc ^= h.finish();
                                }
                            }
                            (Some(f), true) => {
                                for (dc, sc) in d.chunks_mut(CHUNK).zip(s_.chunks(CHUNK)) {
                                    acc ^= f(sc);
                                    dc.copy_from_slice(sc);
                                }
                            }
                            (Some(f), false) => {
                                for sc in s_.chunks(CHUNK) {
                                    acc ^= f(sc);
                                }
                                d.copy_from_slice(s_);
                            }
                            (None, false) => d.copy_from_slice(s_),
                        }
                        acc
                    })
                })
                .collect();
            parts
                .into_iter()
                .map(|h| h.join().expect("a copy thread panicked"))
                .fold(0, |a, b| a ^ b)
        })
    }
    let bytes = bench_bytes();
    let n = threads();
    let src = AlignedBuf::random(bytes, 3);
    let mut dst = AlignedBuf::new(bytes);
    let mut base = AlignedBuf::new(bytes);
    let mut g = c.benchmark_group("restore_check");
    g.sample_size(SAMPLES)
        .warm_up_time(warm_up_time())
        .measurement_time(measurement_time())
        .throughput(Throughput::Bytes(bytes as u64));
    let rows: [(&str, Option<Check>, bool); 6] = [
        ("memcpy_nt", None, false),
        ("blake3_then_copy_nt", Some(blake3_sum), false),
        ("xxh3_then_copy_nt", Some(xxh3_sum), false),
        ("fused_xxh3_copy_nt", Some(xxh3_sum), true),
        ("fused_blake3_copy_nt", Some(blake3_sum), true),
        ("streamed_xxh3_copy_nt", None, true),
    ];
    let mut notes = Notes::new("restore_check");
    notes.set("bytes", human_bytes(bytes as u64));
    notes.set("threads", n);
    // Whether any row ran (a filter on another group skips them all, and
    // `dst` is then never written).
    let mut ran = false;
    for (name, check, fused) in rows {
        let mut paired = Paired::default();
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                ran |= iters > 0;
                for _ in 0..iters {
                    let t = Instant::now();
                    black_box(run(&mut base, &src, n, None, false));
                    let plain = t.elapsed();
                    let t = Instant::now();
                    black_box(run(&mut dst, &src, n, check, fused));
                    let took = t.elapsed();
                    timed += took;
                    paired.push(plain, took);
                }
                timed
            });
        });
        notes.set(&format!("paired {name}"), paired.summary("memcpy_nt", name));
    }
    g.finish();
    assert!(!ran || dst[..] == src[..], "the copies differ");
    notes.save();
}

criterion_group!(benches, restore, ram_check);
criterion_main!(benches);
