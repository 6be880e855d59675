//! `acp bench`: a quick self-benchmark of this machine, each acp stage
//! beside its physical baseline.

use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::{shown, Progress};
use crate::error::{Error, Result};
use crate::{Dtype, Engine, EngineConfig, HostTensor, LoadRequest, SaveOptions, Source};

/// What to measure.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Checkpoint size in bytes (default 256 MiB).
    pub size: u64,
    /// Directory on the storage to measure; a scratch directory is made in
    /// it and removed.
    pub dir: PathBuf,
    /// Where the ring's slots go (default `/dev/shm`).
    pub shm_dir: PathBuf,
}

/// One measured figure.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    /// What was measured.
    pub name: String,
    /// Bytes moved.
    pub bytes: u64,
    /// Seconds taken.
    pub secs: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// The baseline row this one compares to.
    pub baseline: Option<String>,
    /// This row's throughput over the baseline's.
    pub ratio: Option<f64>,
}

/// What `acp bench` measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchReport {
    /// The directory measured.
    pub dir: String,
    /// Checkpoint size.
    pub size: u64,
    /// Copy threads (memcpy and staging).
    pub threads: usize,
    /// The I/O engine the flush used.
    pub io: String,
    /// Whether the flush used `O_DIRECT`.
    pub direct: bool,
    /// The figures, baselines first in each pair.
    pub rows: Vec<BenchRow>,
}

fn row(name: &str, bytes: u64, secs: f64) -> BenchRow {
    BenchRow {
        name: name.to_owned(),
        bytes,
        secs,
        bytes_per_sec: if secs > 0.0 { bytes as f64 / secs } else { 0.0 },
        baseline: None,
        ratio: None,
    }
}

fn against(mut r: BenchRow, base: &BenchRow) -> BenchRow {
    r.baseline = Some(base.name.clone());
    r.ratio = (base.bytes_per_sec > 0.0).then(|| r.bytes_per_sec / base.bytes_per_sec);
    r
}

/// A copy split over `threads` threads, as the engine's staging does.
fn parallel_memcpy(dst: &mut [u8], src: &[u8], threads: usize) {
    let per = src.len().div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        for (d, c) in dst.chunks_mut(per).zip(src.chunks(per)) {
            s.spawn(move || d.copy_from_slice(c));
        }
    });
}

/// Measures, at `opts.size`: a parallel memcpy; the stall of
/// [`Engine::save`] (the copy into a warm ring slot); a plain
/// write + fsync of a file and the engine's flush; a plain read of that
/// file and a load from storage (read and verified); and a load from RAM
/// (a resident slot, verified). Removes everything it wrote.
///
/// # Errors
/// [`Error::Io`] / [`Error::NoSpace`] in `opts.dir` or `opts.shm_dir`.
pub fn bench(opts: &BenchOptions, progress: &dyn Progress) -> Result<BenchReport> {
    let size = usize::try_from(opts.size)
        .map_err(|_| Error::invalid("--size", "larger than the address space"))?;
    let nonce = format!(
        "acp-bench-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    );
    let scratch = opts.dir.join(&nonce);
    let shm = opts.shm_dir.join(format!("{nonce}-shm"));
    for d in [&scratch, &shm] {
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(d)
            .map_err(|e| Error::io("create directory", d, e))?;
    }
    let result = run(opts, size, &scratch, &shm, progress);
    let _ = std::fs::remove_dir_all(&scratch);
    let _ = std::fs::remove_dir_all(&shm);
    result
}

fn run(
    opts: &BenchOptions,
    size: usize,
    scratch: &Path,
    shm: &Path,
    progress: &dyn Progress,
) -> Result<BenchReport> {
    let bytes = opts.size;
    let cfg = EngineConfig::new(scratch.join("ckpt"))
        .with_job(shown(shm))
        .with_shm_dir(shm)
        .with_ring_slots(1)
        .with_ring_bytes(bytes + bytes / 64 + (8 << 20))
        .with_mlock(false);
    let threads = cfg.copy_threads;
    progress.begin("bench", bytes * 8);
    let src: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; size];
    parallel_memcpy(&mut dst, &src, threads); // fault the pages in
    let t = Instant::now();
    parallel_memcpy(&mut dst, &src, threads);
    let memcpy = row("memcpy", bytes, t.elapsed().as_secs_f64());
    drop(dst);
    progress.advance(bytes);

    let raw = scratch.join("raw.bin");
    let t = Instant::now();
    {
        let mut f = std::fs::File::create(&raw).map_err(|e| Error::io("create", &raw, e))?;
        f.write_all(&src).map_err(|e| Error::io("write", &raw, e))?;
        f.sync_all().map_err(|e| Error::io("fsync", &raw, e))?;
    }
    let write = row("write+fsync", bytes, t.elapsed().as_secs_f64());
    progress.advance(bytes);
    let t = Instant::now();
    let mut back = Vec::with_capacity(size);
    std::fs::File::open(&raw)
        .and_then(|mut f| f.read_to_end(&mut back))
        .map_err(|e| Error::io("read", &raw, e))?;
    let read = row("read", bytes, t.elapsed().as_secs_f64());
    drop(back);
    let _ = std::fs::remove_file(&raw);
    progress.advance(bytes);

    let engine = Engine::open(cfg)?;
    let measured = (|| {
        let shape = [bytes];
        let tensor = [HostTensor {
            name: "bench",
            dtype: Dtype::U8,
            shape: &shape,
            data: &src,
        }];
        let none = serde_json::Value::Null;
        // The first save grows and faults the slot; the second is steady state.
        engine
            .save(1, &tensor, &none, &SaveOptions::default())?
            .wait()?;
        progress.advance(bytes);
        let t = Instant::now();
        let handle = engine.save(2, &tensor, &none, &SaveOptions::default())?;
        let stall = t.elapsed().as_secs_f64();
        let report = handle.wait()?;
        progress.advance(bytes * 2);
        let ram = engine.load(&LoadRequest {
            step: Some(2),
            ..LoadRequest::default()
        })?;
        let ram_secs = ram.report().secs;
        let ram_source = ram.report().source;
        drop(ram);
        progress.advance(bytes);
        let storage = engine.load(&LoadRequest {
            step: Some(2),
            storage_only: true,
            ..LoadRequest::default()
        })?;
        let storage_secs = storage.report().secs;
        drop(storage);
        progress.advance(bytes);
        Ok::<_, Error>((stall, report, ram_secs, ram_source, storage_secs))
    })();
    let closed = engine.close();
    drop(engine);
    let (stall, report, ram_secs, ram_source, storage_secs) = measured?;
    closed?;
    progress.end();
    let stage = against(row("save stall (copy to ring)", bytes, stall), &memcpy);
    let flush = against(
        row("flush (write+hash+fsync)", report.bytes, report.flush_secs),
        &write,
    );
    let load_storage = against(
        row("load from storage (verified)", bytes, storage_secs),
        &read,
    );
    let ram_name = if ram_source == Source::Ram {
        "load from RAM (verified)"
    } else {
        "load (RAM copy unavailable)"
    };
    let load_ram = against(row(ram_name, bytes, ram_secs), &memcpy);
    Ok(BenchReport {
        dir: shown(&opts.dir),
        size: bytes,
        threads,
        io: format!("{:?}", report.io).to_lowercase(),
        direct: report.direct,
        rows: vec![
            memcpy.clone(),
            stage,
            load_ram,
            write.clone(),
            flush,
            read.clone(),
            load_storage,
        ],
    })
}
