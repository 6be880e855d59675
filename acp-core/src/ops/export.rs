//! `acp export` (a committed step to a plain safetensors file) and
//! `acp import` (safetensors files to a committed step).
//!
//! A data file already is a safetensors file, so exporting a single-rank
//! step copies it, checking every chunk against the index on the way; a
//! multi-rank step is merged into one file. A chunk that differs from its
//! digest stops the export, and the partial output is removed.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::read::{self, DataFile};
use super::{open_root, pick_step, scratch_beside, shown, Progress, CODEC_KEY};
use crate::engine::check_file_header;
use crate::error::{Error, Result};
use crate::format::{read_header, Entry, ImageMeta, Layout, TensorSpec, MAX_HEADER_BYTES};
use crate::storage::Storage;
use crate::{Engine, EngineConfig, SaveOptions};

/// What `acp export` wrote.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExportReport {
    /// The checkpoint root.
    pub root: String,
    /// The step exported.
    pub step: u64,
    /// The file written.
    pub out: String,
    /// Its size.
    pub bytes: u64,
    /// Tensors in it.
    pub tensors: usize,
    /// The ranks whose files went into it.
    pub ranks: Vec<u32>,
    /// Seconds taken.
    pub secs: f64,
}

/// Writes step `step` (the newest when `None`) of `root` as one plain
/// safetensors file `out`. With `rank`, only that rank's file, byte for
/// byte; else every rank's tensors merged (a single-rank step is copied
/// byte for byte). In a merged file `__metadata__` carries each rank's
/// plain values as `values.rank{N}` and the first rank's other entries.
/// The output is written under a temporary name, fsynced and renamed, so
/// `out` is never a partial file.
///
/// # Errors
/// [`Error::Corrupt`] naming the file and tensor when any byte differs
/// from the index (nothing is left at `out`); [`Error::Exists`]-like
/// [`Error::Invalid`] when `out` exists and `overwrite` is off;
/// [`Error::NotFound`]; [`Error::Io`].
pub fn export_safetensors(
    root: &Path,
    step: Option<u64>,
    rank: Option<u32>,
    out: &Path,
    overwrite: bool,
    progress: &dyn Progress,
) -> Result<ExportReport> {
    let t0 = Instant::now();
    let root = open_root(root)?;
    let step = pick_step(&root, step)?;
    let index = root.read_index(step)?;
    if let Ok(m) = std::fs::symlink_metadata(out) {
        // A regular file or a link is replaced, never written through; a
        // device or FIFO (`/dev/null` given with --force) was replaced by
        // a regular file.
        let kind = m.file_type();
        if !kind.is_file() && !kind.is_symlink() {
            return Err(Error::invalid(
                out.display(),
                "is not a regular file (a directory, device, FIFO or socket): export writes a new file; name a path for it",
            ));
        }
        if !overwrite {
            return Err(Error::invalid(
                out.display(),
                "exists; pass --force to replace it",
            ));
        }
    }
    let mut files = Vec::new();
    for (name, entry) in &index.files {
        if rank.is_none_or(|r| entry.rank == r) {
            let mut f = read::open(&root, step, name, entry)?;
            // What a load (and `acp verify`) refuses, export refuses: a
            // header that tells another story than the index.
            let path = f.path().to_path_buf();
            check_file_header(&path, f.header()?, step, &index, name)?;
            files.push(f);
        }
    }
    if files.is_empty() {
        return Err(Error::NotFound {
            what: format!(
                "rank {}'s file in step {step} of {}",
                rank.unwrap_or(0),
                root.location().display()
            ),
        });
    }
    files.sort_by_key(|f| f.entry().rank);
    let total: u64 = files.iter().map(|f| f.entry().size).sum();
    let tmp = scratch_beside(out);
    let result = (|| {
        let file = crate::storage::create_exclusive(&tmp)?;
        progress.begin(&format!("export step {step}"), total);
        let (bytes, tensors) = if files.len() == 1 {
            let f = &mut files[0];
            f.stream(|off, buf| {
                file.write_all_at(buf, off)
                    .map_err(|e| Error::io("write", &tmp, e))?;
                progress.advance(buf.len() as u64);
                Ok(())
            })?;
            let n = f.header()?.entries.len();
            (f.entry().size, n)
        } else {
            merge(&mut files, step, &file, &tmp, progress)?
        };
        file.sync_all().map_err(|e| Error::io("fsync", &tmp, e))?;
        std::fs::rename(&tmp, out).map_err(|e| Error::io("rename", out, e))?;
        Ok((bytes, tensors))
    })();
    progress.end();
    let (bytes, tensors) = match result {
        Ok(v) => v,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
        if let Ok(d) = File::open(parent) {
            let _ = d.sync_all();
        }
    }
    Ok(ExportReport {
        root: shown(root.location()),
        step,
        out: shown(out),
        bytes,
        tensors,
        ranks: files.iter().map(|f| f.entry().rank).collect(),
        secs: t0.elapsed().as_secs_f64(),
    })
}

/// Writes the tensors of several ranks' files into one safetensors file.
fn merge(
    files: &mut [DataFile],
    step: u64,
    out: &File,
    out_path: &Path,
    progress: &dyn Progress,
) -> Result<(u64, usize)> {
    let mut specs = Vec::new();
    let mut extra = BTreeMap::new();
    let mut sources: Vec<Vec<Entry>> = Vec::new();
    for (i, f) in files.iter_mut().enumerate() {
        let rank = f.entry().rank;
        let h = f.header()?;
        if !h.values().is_null() {
            extra.insert(format!("values.rank{rank}"), h.values().to_string());
        }
        if i == 0 {
            for (k, v) in &h.metadata {
                if !k.starts_with("acp.") {
                    extra.entry(k.clone()).or_insert_with(|| v.clone());
                }
            }
        }
        let mut entries = h.entries.clone();
        entries.sort_by_key(|e| e.offset);
        specs.extend(entries.iter().map(|e| TensorSpec {
            name: e.name.clone(),
            dtype: e.dtype,
            shape: e.shape.clone(),
        }));
        sources.push(entries);
    }
    let meta = ImageMeta {
        step,
        rank: 0,
        world_size: 1,
        values: Value::Null,
        extra,
    };
    let layout = Layout::plan(&specs, &meta)?;
    out.set_len(layout.total_len)
        .map_err(|e| Error::io("ftruncate", out_path, e))?;
    out.write_all_at(layout.header_bytes(), 0)
        .map_err(|e| Error::io("write", out_path, e))?;
    let mut next = 0;
    for (f, entries) in files.iter_mut().zip(&sources) {
        let dests = &layout.entries[next..next + entries.len()];
        next += entries.len();
        f.stream(|off, buf| {
            let end = off + buf.len() as u64;
            for (src, dst) in entries.iter().zip(dests) {
                let (s, e) = (src.offset.max(off), (src.offset + src.len).min(end));
                if s >= e {
                    continue;
                }
                let piece = &buf[to_usize(s - off)..to_usize(e - off)];
                out.write_all_at(piece, dst.offset + (s - src.offset))
                    .map_err(|e| Error::io("write", out_path, e))?;
            }
            progress.advance(buf.len() as u64);
            Ok(())
        })?;
    }
    Ok((layout.total_len, layout.entries.len()))
}

/// Where and how `import` commits.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// The checkpoint root (created when missing).
    pub root: PathBuf,
    /// The step to commit.
    pub step: u64,
    /// Replace the step when it is committed already.
    pub overwrite: bool,
    /// The plain values to save with the tensors; `None` keeps the values
    /// of a single file that carries acp's (`acp.values`), and otherwise
    /// saves a flat `{name: tensor}` dict in acp's Python state codec (so
    /// that `Checkpointer.load` returns the tensors by name).
    pub values: Option<Value>,
    /// The framework whose tensors the flat dict refers to (`"torch"` or
    /// `"numpy"`).
    pub framework: String,
    /// Where the temporary shared-memory slot is made (default `/dev/shm`);
    /// it needs room for the whole checkpoint and is removed afterwards.
    pub shm_dir: PathBuf,
}

/// What `acp import` committed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImportReport {
    /// The checkpoint root.
    pub root: String,
    /// The step committed.
    pub step: u64,
    /// The files read.
    pub files: Vec<String>,
    /// Tensors imported.
    pub tensors: usize,
    /// Bytes of the committed data file.
    pub bytes: u64,
    /// Seconds taken.
    pub secs: f64,
}

/// One input file: its header and handle.
struct Source {
    path: PathBuf,
    file: File,
    entries: Vec<Entry>,
    metadata: BTreeMap<String, String>,
    values: Value,
}

fn open_source(path: &Path) -> Result<Source> {
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound {
                    what: path.display().to_string(),
                }
            } else {
                Error::io("open", path, e)
            }
        })?;
    let len = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    let h = read_header(path, len, MAX_HEADER_BYTES, |buf, at| {
        file.read_exact_at(buf, at)
            .map_err(|e| Error::io("read", path, e))
    })?;
    let values = h.values().clone();
    Ok(Source {
        path: path.to_path_buf(),
        file,
        entries: h.entries,
        metadata: h.metadata,
        values,
    })
}

/// Commits the tensors of the safetensors `files` as step `opts.step` of
/// `opts.root`, through an engine with a private one-slot ring (so the
/// step is hashed, indexed and committed like any save). Tensor names must
/// be unique over the files. Non-acp `__metadata__` entries of the first
/// file (e.g. `format: pt`) are kept.
///
/// # Errors
/// [`Error::Corrupt`] for a malformed input file; [`Error::Invalid`] for a
/// name given twice; [`Error::Exists`] when the step is committed and
/// `overwrite` is off; [`Error::NoSpace`] when the shared-memory directory
/// cannot hold the checkpoint; [`Error::Io`].
pub fn import_safetensors(
    files: &[PathBuf],
    opts: &ImportOptions,
    progress: &dyn Progress,
) -> Result<ImportReport> {
    let t0 = Instant::now();
    if files.is_empty() {
        return Err(Error::invalid("import", "no input file"));
    }
    let sources = files
        .iter()
        .map(|p| open_source(p))
        .collect::<Result<Vec<_>>>()?;
    let mut specs = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for s in &sources {
        for e in &s.entries {
            if !seen.insert(e.name.clone()) {
                return Err(Error::invalid(
                    format!("tensor `{}`", e.name),
                    format!("given twice (again in {})", s.path.display()),
                ));
            }
            specs.push(TensorSpec {
                name: e.name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
            });
        }
    }
    let values = match &opts.values {
        Some(v) => v.clone(),
        None if sources.len() == 1 && !sources[0].values.is_null() => sources[0].values.clone(),
        None => flat_tensor_dict(&specs, &opts.framework),
    };
    let extra: BTreeMap<String, String> = sources[0]
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with("acp."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let meta = ImageMeta {
        step: opts.step,
        rank: 0,
        world_size: 1,
        values: values.clone(),
        extra: extra.clone(),
    };
    let total = Layout::plan(&specs, &meta)?.total_len;
    let shm = opts.shm_dir.join(format!(
        "acp-import-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos())
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&shm)
        .map_err(|e| Error::io("create directory", &shm, e))?;
    let result = (|| {
        let engine = Engine::open(
            EngineConfig::new(&opts.root)
                .with_job(format!("import:{}", shm.display()))
                .with_shm_dir(&shm)
                .with_ring_slots(1)
                .with_ring_bytes(total + total / 64 + (8 << 20))
                .with_mlock(false)
                .with_persist_on_open(false),
        )?;
        let saved = (|| {
            let save_opts = SaveOptions {
                overwrite: opts.overwrite,
                extra_metadata: extra,
                ..SaveOptions::default()
            };
            let Some(mut staging) = engine.begin_save(opts.step, &specs, &values, &save_opts)?
            else {
                return Err(Error::Busy {
                    what: "import".to_owned(),
                    reason: "no ring slot".to_owned(),
                });
            };
            progress.begin(&format!("import step {}", opts.step), total);
            let mut i = 0;
            for s in &sources {
                for e in &s.entries {
                    let dst = staging.tensor_mut(i);
                    s.file
                        .read_exact_at(dst, e.offset)
                        .map_err(|err| Error::io("read", &s.path, err))?;
                    progress.advance(e.len);
                    i += 1;
                }
            }
            staging.finish().wait()
        })();
        progress.end();
        let closed = engine.close();
        drop(engine);
        let report = saved?;
        closed?;
        Ok(report)
    })();
    let _ = std::fs::remove_dir_all(&shm);
    let report = result?;
    Ok(ImportReport {
        root: shown(&std::fs::canonicalize(&opts.root).unwrap_or_else(|_| opts.root.clone())),
        step: opts.step,
        files: sources.iter().map(|s| shown(&s.path)).collect(),
        tensors: specs.len(),
        bytes: report.bytes,
        secs: t0.elapsed().as_secs_f64(),
    })
}

/// An in-memory offset as an index.
fn to_usize(v: u64) -> usize {
    usize::try_from(v).unwrap_or(usize::MAX)
}

/// The codec tree of a flat `{name: tensor}` dict over `specs`.
fn flat_tensor_dict(specs: &[TensorSpec], framework: &str) -> Value {
    let names: Vec<Value> = specs.iter().map(|s| Value::from(s.name.clone())).collect();
    let refs: Vec<Value> = specs
        .iter()
        .map(|s| serde_json::json!({"t": "tensor", "fw": framework, "name": s.name}))
        .collect();
    serde_json::json!({CODEC_KEY: 1, "state": {"t": "dict", "k": names, "v": refs}})
}
