//! Torture 5: hostile checkpoints. Crafted headers and indexes (lengths
//! past the end, overlapping or reversed offsets, dtype/shape/size
//! mismatches, names with `..`, `/`, NUL, absolute paths), symlinks,
//! FIFOs and directories where files should be, and junk in the root:
//! every case is an error (never a panic), nothing outside the checkpoint
//! directory is read, and no allocation is sized by an unchecked field.
//!
//! Each crafted data file comes with an index whose digests match it, so
//! the integrity check passes and the parsers and path rules are what must
//! refuse it. A symlink's target is itself a valid checkpoint, so a load
//! that followed the link would succeed: the error proves it did not. The
//! test binary counts the largest single heap allocation (a tracking
//! global allocator) and checks it stays small whatever sizes the files
//! claim (the data is a few bytes; an index may claim 2^62).

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use acp_core::format::{chunk_digests, hex, parse_header, root_digest, Index};
use acp_core::{Engine, EngineConfig, Error, LoadRequest};
use serde_json::{json, Value};
use torture_util::report;

/// The system allocator, recording the largest single request.
struct Tracking;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, so `System`'s guarantees are ours; the counter is an atomic.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: forwarded as is; `ptr` came from `System` with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// Serialises this file's tests: the allocation record above counts every
/// thread's requests, so a test running beside a case would be charged
/// with its allocations (each test takes the guard first).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    // A test that panicked holding it poisons nothing the others need.
    ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The largest allocation any hostile case may cause: far below anything a
/// claimed size could ask for, far above what the test's own data needs.
const ALLOC_LIMIT: usize = 32 << 20;

const STEP: u64 = 7;
const CHUNK: u64 = 4096;

fn config(root: &Path, shm: &Path) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("torture-hostile")
        .with_ring_bytes(4 << 20)
        .with_chunk_bytes(4096)
        .with_mlock(false)
}

/// A safetensors file: the header length, the header, the data.
fn st(header: impl AsRef<[u8]>, data: &[u8]) -> Vec<u8> {
    let header = header.as_ref();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// The baseline: two U8 tensors, `a` (8 bytes) and `b` (4 bytes).
fn good_header() -> Value {
    json!({
        "__metadata__": {"acp.step": STEP.to_string(), "acp.rank": "0", "acp.world_size": "1"},
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [2, 2], "data_offsets": [8, 12]},
    })
}

const DATA: [u8; 12] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];

/// An index for `file` (named `name`) that matches its bytes, listing
/// `tensors`.
fn index_for(file: &[u8], name: &str, tensors: &[&str]) -> Value {
    let digests = chunk_digests(file, CHUNK as usize);
    json!({
        "metadata": {
            "total_size": file.len(),
            "acp": {
                "format_version": 1,
                "step": STEP,
                "world_size": 1,
                "files": {
                    name: {
                        "rank": 0,
                        "size": file.len(),
                        "chunk_bytes": CHUNK,
                        "chunks": digests.iter().map(hex).collect::<Vec<_>>(),
                        "root": hex(&root_digest(&digests)),
                    }
                }
            }
        },
        "weight_map": tensors.iter().map(|t| (t.to_string(), json!(name))).collect::<serde_json::Map<_, _>>(),
    })
}

struct Case {
    _dir: tempfile::TempDir,
    root: PathBuf,
    shm: PathBuf,
    step_dir: PathBuf,
    outside: PathBuf,
}

fn case() -> Case {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("ckpt");
    let shm = dir.path().join("shm");
    let outside = dir.path().join("outside");
    for d in [&root, &shm, &outside] {
        std::fs::create_dir_all(d).unwrap();
    }
    let step_dir = root.join(format!("step-{STEP:012}"));
    std::fs::create_dir(&step_dir).unwrap();
    Case {
        _dir: dir,
        root,
        shm,
        step_dir,
        outside,
    }
}

const DATA_NAME: &str = "rank-00000.safetensors";
const INDEX_NAME: &str = "model.safetensors.index.json";

fn write_json(path: &Path, v: &Value) {
    std::fs::write(path, serde_json::to_vec(v).unwrap()).unwrap();
}

/// Loads step `STEP` from storage (and the newest step, with fallback).
fn load(c: &Case) -> Result<acp_core::Checkpoint, Error> {
    let engine = Engine::open(config(&c.root, &c.shm))?;
    let r = engine.load(&LoadRequest {
        step: Some(STEP),
        storage_only: true,
        ..LoadRequest::default()
    });
    if r.is_err() {
        // The newest-step paths must refuse it too, with and without fallback.
        for fallback in [false, true] {
            if let Ok(ck) = engine.load(&LoadRequest {
                fallback,
                ..LoadRequest::default()
            }) {
                panic!("step {} loaded with fallback {fallback}", ck.step());
            }
        }
    }
    r
}

struct Suite {
    trials: u64,
    failures: Vec<String>,
}

impl Suite {
    /// Runs one case that must fail; a panic inside is a failure too.
    fn refuse(&mut self, what: &str, f: impl FnOnce() -> Result<String, String>) {
        self.trials += 1;
        let before = LARGEST.load(Ordering::Relaxed);
        LARGEST.store(0, Ordering::Relaxed);
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        let largest = LARGEST.load(Ordering::Relaxed);
        LARGEST.fetch_max(before, Ordering::Relaxed);
        match outcome {
            // A buffer sized by the index's claim is mapped, not allocated
            // on the heap: its refusal names the `allocate` operation.
            Ok(Ok(err)) if err.contains("allocate") => self.failures.push(format!(
                "{what}: tried to allocate what the file claims: {err}"
            )),
            Ok(Ok(err)) if largest <= ALLOC_LIMIT => {
                eprintln!("refused {what}: {err}");
            }
            Ok(Ok(_)) => self
                .failures
                .push(format!("{what}: allocated {largest} bytes at once")),
            Ok(Err(e)) => self.failures.push(format!("{what}: {e}")),
            Err(_) => self.failures.push(format!("{what}: panicked")),
        }
    }
}

/// A data file with `header` and `data`, and an index that matches it.
fn crafted_file(suite: &mut Suite, what: &str, file: Vec<u8>, tensors: &[&str]) {
    crafted_file_as(suite, what, file, tensors, true);
}

/// As [`crafted_file`]; `parser_refuses` is false for files only the engine
/// can tell are wrong (a header naming another step than its directory).
fn crafted_file_as(
    suite: &mut Suite,
    what: &str,
    file: Vec<u8>,
    tensors: &[&str],
    parser_refuses: bool,
) {
    suite.refuse(what, || {
        // The parser alone.
        let parsed = parse_header(Path::new(DATA_NAME), &file, file.len() as u64);
        if let (true, Ok(h)) = (parser_refuses, parsed) {
            return Err(format!("parse_header accepted it: {:?}", h.entries));
        }
        // And through the engine, behind a matching index.
        let c = case();
        std::fs::write(c.step_dir.join(DATA_NAME), &file).unwrap();
        write_json(
            &c.step_dir.join(INDEX_NAME),
            &index_for(&file, DATA_NAME, tensors),
        );
        match load(&c) {
            Ok(ck) => Err(format!("loaded: {:?}", ck.entries())),
            Err(e) => Ok(e.to_string()),
        }
    });
}

fn header_cases(suite: &mut Suite) {
    // The baseline loads: the harness itself is sound.
    {
        let c = valid_step();
        let ck = load(&c).expect("the baseline checkpoint loads");
        assert_eq!(ck.tensor("b").unwrap().data, &DATA[8..]);
    }
    let edit = |f: &dyn Fn(&mut Value)| {
        let mut h = good_header();
        f(&mut h);
        st(h.to_string(), &DATA)
    };
    let ab = ["a", "b"];
    let mut raw = |what: &str, file: Vec<u8>| crafted_file(suite, what, file, &ab);
    let hdr = good_header().to_string();
    raw("empty file", Vec::new());
    raw("7 bytes", vec![0; 7]);
    raw("header length past the end", {
        let mut f = st(&hdr, &DATA);
        let len = f.len() as u64;
        f[..8].copy_from_slice(&len.to_le_bytes());
        f
    });
    raw("header length u64::MAX", {
        let mut f = st(&hdr, &DATA);
        f[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        f
    });
    raw("header length 2^62", {
        let mut f = st(&hdr, &DATA);
        f[..8].copy_from_slice(&(1u64 << 62).to_le_bytes());
        f
    });
    raw("header length 0", st("", &DATA));
    raw("header not UTF-8", st(b"{\"a\xff\": 1}", &DATA));
    raw("header a JSON array", st("[1, 2]", &DATA));
    raw("header not JSON", st("{not json", &DATA));
    raw("header with trailing junk", st(format!("{hdr} x"), &DATA));
    raw("header with a NUL", st(format!("{hdr}\0"), &DATA));
    raw("duplicate tensor key", {
        st(
            r#"{"a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, "a": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}"#,
            &DATA,
        )
    });
    raw(
        "trailing bytes after the last tensor",
        st(&hdr, &[DATA.as_slice(), &[0]].concat()),
    );
    raw("file shorter than the tensors", st(&hdr, &DATA[..10]));
    let mut edited = |what: &str, f: &dyn Fn(&mut Value)| crafted_file(suite, what, edit(f), &ab);
    edited("offsets past the end", &|h| {
        h["b"]["data_offsets"] = json!([8, 1_000_000_000_000u64]);
    });
    edited("offsets near u64::MAX", &|h| {
        h["b"]["data_offsets"] = json!([8, u64::MAX]);
    });
    edited("overlapping offsets", &|h| {
        h["b"]["data_offsets"] = json!([4, 8]);
        h["b"]["shape"] = json!([4]);
    });
    edited("reversed offsets", &|h| {
        h["b"]["data_offsets"] = json!([12, 8])
    });
    edited("a gap between tensors", &|h| {
        h["a"]["data_offsets"] = json!([0, 6]);
        h["a"]["shape"] = json!([6]);
    });
    edited("offsets not integers", &|h| {
        h["a"]["data_offsets"] = json!(["0", 8])
    });
    edited("negative offsets", &|h| {
        h["a"]["data_offsets"] = json!([-8, 8])
    });
    edited("three offsets", &|h| {
        h["a"]["data_offsets"] = json!([0, 4, 8])
    });
    edited("unknown dtype", &|h| h["a"]["dtype"] = json!("F128"));
    edited("dtype not a string", &|h| h["a"]["dtype"] = json!(4));
    edited("dtype size mismatch", &|h| h["a"]["dtype"] = json!("F32"));
    edited("shape size mismatch", &|h| h["a"]["shape"] = json!([3]));
    edited("shape overflowing u64", &|h| {
        h["a"]["shape"] = json!([u64::MAX, u64::MAX]);
    });
    edited("shape product overflowing", &|h| {
        h["a"]["shape"] = json!([1u64 << 32, 1u64 << 32, 16]);
    });
    edited("negative shape", &|h| h["a"]["shape"] = json!([-8]));
    edited("float shape", &|h| h["a"]["shape"] = json!([8.0]));
    edited("shape not a list", &|h| h["a"]["shape"] = json!(8));
    edited("tensor not an object", &|h| h["a"] = json!("x"));
    edited("missing data_offsets", &|h| {
        h["a"].as_object_mut().unwrap().remove("data_offsets");
    });
    edited("metadata not strings", &|h| {
        h["__metadata__"] = json!({"k": 1})
    });
    edited("metadata a list", &|h| h["__metadata__"] = json!([]));
    let mut h = good_header();
    h["__metadata__"]["acp.step"] = json!("8");
    crafted_file_as(
        suite,
        "another step in the header",
        st(h.to_string(), &DATA),
        &ab,
        false,
    );
    let mut edited = |what: &str, f: &dyn Fn(&mut Value)| crafted_file(suite, what, edit(f), &ab);
    edited("step not a number", &|h| {
        h["__metadata__"]["acp.step"] = json!("x")
    });
    edited("newer format version", &|h| {
        h["__metadata__"]["acp.version"] = json!("999");
    });
    edited("format version 0", &|h| {
        h["__metadata__"]["acp.version"] = json!("0")
    });
    edited("acp file not 4096-aligned", &|h| {
        h["__metadata__"]["acp.version"] = json!("1");
    });
    edited("values not JSON", &|h| {
        h["__metadata__"]["acp.values"] = json!("{")
    });
    // Tensor names are keys, never paths: `/` and `..` in them are legal
    // (TensorFlow and JAX name tensors `dense/kernel`), load verbatim, and
    // touch no file.
    for name in ["../../../../etc/passwd", "/etc/passwd", "a/../../b"] {
        let mut h = good_header();
        let b = h.as_object_mut().unwrap().remove("b").unwrap();
        h[name] = b;
        let file = st(h.to_string(), &DATA);
        let c = case();
        std::fs::write(c.step_dir.join(DATA_NAME), &file).unwrap();
        write_json(
            &c.step_dir.join(INDEX_NAME),
            &index_for(&file, DATA_NAME, &["a", name]),
        );
        let ck = load(&c).expect("a tensor name with `/` is a plain key");
        assert_eq!(ck.tensor(name).unwrap().data, &DATA[8..], "{name}");
    }
    // Names the format refuses: each replaces `b`; the index lists it.
    for name in ["a\0b", "", "__metadata__", &"n".repeat(5000)] {
        let mut h = good_header();
        let b = h.as_object_mut().unwrap().remove("b").unwrap();
        h[name] = b;
        let file = st(h.to_string(), &DATA);
        let shown: String = name.chars().take(40).collect();
        crafted_file(
            suite,
            &format!("tensor named {shown:?}"),
            file,
            &["a", name],
        );
    }
}

/// A good data file with a crafted index.
fn crafted_index(suite: &mut Suite, what: &str, f: &dyn Fn(&mut Value)) {
    let file = st(good_header().to_string(), &DATA);
    let mut index = index_for(&file, DATA_NAME, &["a", "b"]);
    f(&mut index);
    let bytes = serde_json::to_vec(&index).unwrap();
    crafted_index_bytes(suite, what, &file, bytes);
}

fn crafted_index_bytes(suite: &mut Suite, what: &str, file: &[u8], bytes: Vec<u8>) {
    suite.refuse(what, || {
        // Some cases are well-formed indexes that lie about the file: the
        // parser may accept them (it must not panic), the load must not.
        let _ = Index::parse(Path::new(INDEX_NAME), &bytes);
        let c = case();
        std::fs::write(c.step_dir.join(DATA_NAME), file).unwrap();
        std::fs::write(c.step_dir.join(INDEX_NAME), &bytes).unwrap();
        match load(&c) {
            Ok(ck) => Err(format!("loaded: {:?}", ck.entries())),
            Err(e) => Ok(e.to_string()),
        }
    });
}

fn rename_file(index: &mut Value, to: &str) {
    let files = index["metadata"]["acp"]["files"].as_object_mut().unwrap();
    let entry = files.remove(DATA_NAME).unwrap();
    files.insert(to.to_owned(), entry);
    for v in index["weight_map"].as_object_mut().unwrap().values_mut() {
        *v = json!(to);
    }
}

fn index_cases(suite: &mut Suite) {
    for name in [
        "..",
        "../rank-00000.safetensors",
        "../../outside/rank-00000.safetensors",
        "/etc/passwd",
        "/tmp",
        "a/b",
        "a\0b",
        ".hidden",
        "",
        "rank-00000.safetensors\0",
        "ran\u{212a}-00000.safetensors",
        &"r".repeat(300),
    ] {
        let shown: String = name.chars().take(40).collect();
        crafted_index(suite, &format!("file named {shown:?}"), &|i| {
            rename_file(i, name);
        });
    }
    let file = |i: &mut Value, k: &str, v: Value| {
        i["metadata"]["acp"]["files"][DATA_NAME][k] = v;
    };
    crafted_index(suite, "size 2^62 (one huge chunk)", &|i| {
        file(i, "size", json!(1u64 << 62));
        file(i, "chunk_bytes", json!(1u64 << 62));
        i["metadata"]["total_size"] = json!(1u64 << 62);
    });
    crafted_index(suite, "size u64::MAX", &|i| {
        file(i, "size", json!(u64::MAX));
        file(i, "chunk_bytes", json!(u64::MAX));
        i["metadata"]["total_size"] = json!(u64::MAX);
    });
    crafted_index(suite, "size one byte short", &|i| {
        let size = i["metadata"]["acp"]["files"][DATA_NAME]["size"]
            .as_u64()
            .unwrap();
        file(i, "size", json!(size - 1));
        i["metadata"]["total_size"] = json!(size - 1);
    });
    crafted_index(suite, "chunk_bytes 0", &|i| {
        file(i, "chunk_bytes", json!(0))
    });
    crafted_index(suite, "chunk_bytes 1", &|i| {
        file(i, "chunk_bytes", json!(1))
    });
    crafted_index(suite, "a chunk digest missing", &|i| {
        file(i, "chunks", json!([]));
    });
    crafted_index(suite, "a chunk digest not hex", &|i| {
        file(i, "chunks", json!(["zz".repeat(32)]));
    });
    crafted_index(suite, "a wrong chunk digest", &|i| {
        let d = hex(&[7; 32]);
        file(i, "chunks", json!([d]));
        file(i, "root", json!(hex(&root_digest(&[[7; 32]]))));
    });
    crafted_index(suite, "root not the root of the chunks", &|i| {
        file(i, "root", json!(hex(&[0; 32])));
    });
    crafted_index(suite, "rank past the world size", &|i| {
        file(i, "rank", json!(3))
    });
    crafted_index(suite, "world size 0", &|i| {
        i["metadata"]["acp"]["world_size"] = json!(0);
    });
    crafted_index(suite, "world size 2 (the file says 1)", &|i| {
        i["metadata"]["acp"]["world_size"] = json!(2);
    });
    crafted_index(suite, "another step", &|i| {
        i["metadata"]["acp"]["step"] = json!(8)
    });
    crafted_index(suite, "format version 0", &|i| {
        i["metadata"]["acp"]["format_version"] = json!(0);
    });
    crafted_index(suite, "format version 99", &|i| {
        i["metadata"]["acp"]["format_version"] = json!(99);
    });
    crafted_index(suite, "total_size wrong", &|i| {
        i["metadata"]["total_size"] = json!(1)
    });
    crafted_index(suite, "weight_map names an unlisted file", &|i| {
        i["weight_map"]["a"] = json!("rank-00001.safetensors");
    });
    crafted_index(suite, "weight_map names a tensor the file lacks", &|i| {
        i["weight_map"]["c"] = json!(DATA_NAME);
    });
    crafted_index(suite, "weight_map misses a tensor of the file", &|i| {
        i["weight_map"].as_object_mut().unwrap().remove("b");
    });
    crafted_index(suite, "weight_map tensor named ../x", &|i| {
        i["weight_map"]["../x"] = json!(DATA_NAME);
    });
    crafted_index(suite, "no files", &|i| {
        i["metadata"]["acp"]["files"] = json!({});
        i["weight_map"] = json!({});
    });
    crafted_index(suite, "files a list", &|i| {
        i["metadata"]["acp"]["files"] = json!([])
    });
    crafted_index(suite, "size negative", &|i| file(i, "size", json!(-1)));
    crafted_index(suite, "size a float", &|i| file(i, "size", json!(1e300)));
    crafted_index(suite, "metadata missing", &|i| {
        i.as_object_mut().unwrap().remove("metadata");
    });
    let good = st(good_header().to_string(), &DATA);
    let text = serde_json::to_string(&index_for(&good, DATA_NAME, &["a", "b"])).unwrap();
    crafted_index_bytes(suite, "index empty", &good, Vec::new());
    crafted_index_bytes(suite, "index not UTF-8", &good, b"{\"\xff\": 1}".to_vec());
    crafted_index_bytes(
        suite,
        "index truncated",
        &good,
        text.as_bytes()[..text.len() / 2].to_vec(),
    );
    crafted_index_bytes(
        suite,
        "index nested 100,000 deep",
        &good,
        format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)).into_bytes(),
    );
    crafted_index_bytes(
        suite,
        "duplicate file key",
        &good,
        text.replacen(
            "\"files\":{",
            &format!("\"files\":{{\"{DATA_NAME}\":{{}},"),
            1,
        )
        .into_bytes(),
    );
    crafted_index_bytes(suite, "index of 70 MB", &good, vec![b' '; 70 << 20]);
}

/// Symlinks, FIFOs and directories where files should be. The symlinks
/// point at a valid checkpoint outside the root.
fn path_cases(suite: &mut Suite) {
    let file = st(good_header().to_string(), &DATA);
    let index = index_for(&file, DATA_NAME, &["a", "b"]);
    let valid_outside = |c: &Case| {
        let step = c.outside.join(format!("step-{STEP:012}"));
        std::fs::create_dir_all(&step).unwrap();
        std::fs::write(step.join(DATA_NAME), &file).unwrap();
        write_json(&step.join(INDEX_NAME), &index);
        step
    };
    let load_err = |c: &Case| match load(c) {
        Ok(ck) => Err(format!("loaded: {:?}", ck.entries())),
        Err(e) => Ok(e.to_string()),
    };
    suite.refuse("data file a symlink out of the root", || {
        let c = case();
        let out = valid_outside(&c);
        std::os::unix::fs::symlink(out.join(DATA_NAME), c.step_dir.join(DATA_NAME)).unwrap();
        write_json(&c.step_dir.join(INDEX_NAME), &index);
        load_err(&c)
    });
    suite.refuse("index a symlink out of the root", || {
        let c = case();
        let out = valid_outside(&c);
        std::fs::write(c.step_dir.join(DATA_NAME), &file).unwrap();
        std::os::unix::fs::symlink(out.join(INDEX_NAME), c.step_dir.join(INDEX_NAME)).unwrap();
        load_err(&c)
    });
    suite.refuse("step directory a symlink out of the root", || {
        let c = case();
        let out = valid_outside(&c);
        std::fs::remove_dir(&c.step_dir).unwrap();
        std::os::unix::fs::symlink(&out, &c.step_dir).unwrap();
        load_err(&c)
    });
    suite.refuse("data file a symlink to /dev/zero", || {
        let c = case();
        std::os::unix::fs::symlink("/dev/zero", c.step_dir.join(DATA_NAME)).unwrap();
        write_json(&c.step_dir.join(INDEX_NAME), &index);
        load_err(&c)
    });
    suite.refuse("data file a FIFO (a naive open would hang)", || {
        let c = case();
        let status = std::process::Command::new("mkfifo")
            .arg(c.step_dir.join(DATA_NAME))
            .status()
            .unwrap();
        assert!(status.success());
        write_json(&c.step_dir.join(INDEX_NAME), &index);
        load_err(&c)
    });
    suite.refuse("data file a directory", || {
        let c = case();
        std::fs::create_dir(c.step_dir.join(DATA_NAME)).unwrap();
        write_json(&c.step_dir.join(INDEX_NAME), &index);
        load_err(&c)
    });
    suite.refuse("index a directory", || {
        let c = case();
        std::fs::write(c.step_dir.join(DATA_NAME), &file).unwrap();
        std::fs::create_dir(c.step_dir.join(INDEX_NAME)).unwrap();
        load_err(&c)
    });
    suite.refuse("step directory a regular file", || {
        let c = case();
        std::fs::remove_dir(&c.step_dir).unwrap();
        std::fs::write(&c.step_dir, b"junk").unwrap();
        load_err(&c)
    });
    suite.refuse("step directory without an index", || {
        let c = case();
        std::fs::write(c.step_dir.join(DATA_NAME), &file).unwrap();
        load_err(&c)
    });
}

/// A root full of junk beside one valid step: opening never fails on it,
/// and the valid step is what loads.
fn root_cases(suite: &mut Suite) {
    suite.trials += 1;
    let c = valid_step();
    let r = &c.root;
    std::fs::write(r.join("step-000000000009"), b"a file, not a directory").unwrap();
    std::fs::create_dir(r.join("step-9")).unwrap();
    std::fs::create_dir(r.join("step-00000000000x")).unwrap();
    std::fs::create_dir(r.join("step-000000000011")).unwrap();
    std::fs::write(r.join("step-000000000011").join(INDEX_NAME), b"{").unwrap();
    // Temporary directories carry the rank and the job's tag: this job's
    // rank 0 left one (swept at open); another rank and another job too.
    let tag = &hex(blake3::hash(b"torture-hostile").as_bytes())[..8];
    let ours = format!(".pending-000000000012-r00000-{tag}-1-2");
    let theirs = [
        format!(".pending-000000000012-r00003-{tag}-1-2"),
        ".pending-000000000012-r00000-0badf00d-1-2".to_owned(),
    ];
    for d in std::iter::once(&ours).chain(&theirs) {
        std::fs::create_dir(r.join(d)).unwrap();
    }
    std::fs::write(r.join("latest"), b"99999999999999999999999999\n").unwrap();
    std::os::unix::fs::symlink("/etc", r.join("step-000000000013")).unwrap();
    std::os::unix::fs::symlink(r.join("nowhere"), r.join("step-000000000014")).unwrap();
    let outcome = std::panic::catch_unwind(|| {
        let engine = Engine::open(config(&c.root, &c.shm)).map_err(|e| e.to_string())?;
        // Only the directory with a valid index counts as committed.
        let steps = engine.steps().map_err(|e| e.to_string())?;
        if steps != vec![STEP, 11] {
            return Err(format!("steps {steps:?}"));
        }
        // The newest (11) is damaged: an error without fallback...
        if engine.load(&LoadRequest::default()).is_ok() {
            return Err("the damaged step 11 loaded".into());
        }
        // ...and the valid step with it.
        let ck = engine
            .load(&LoadRequest {
                fallback: true,
                ..LoadRequest::default()
            })
            .map_err(|e| e.to_string())?;
        if ck.step() != STEP {
            return Err(format!("fallback loaded step {}", ck.step()));
        }
        // This rank's leftover pending directory is swept; the others are kept.
        if r.join(&ours).exists() || theirs.iter().any(|d| !r.join(d).exists()) {
            return Err("sweep removed the wrong leftovers".into());
        }
        Ok(())
    });
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => suite.failures.push(format!("junk root: {e}")),
        Err(_) => suite.failures.push("junk root: panicked".into()),
    }
}

#[test]
fn hostile_checkpoints_are_refused_without_panic_or_reads_outside() {
    let _one = one_at_a_time();
    let mut suite = Suite {
        trials: 0,
        failures: Vec::new(),
    };
    header_cases(&mut suite);
    index_cases(&mut suite);
    path_cases(&mut suite);
    root_cases(&mut suite);
    report("hostile", suite.trials, &suite.failures);
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(
        rc,
        0,
        "mkfifo {}: {}",
        path.display(),
        std::io::Error::last_os_error()
    );
}

/// Runs `f` on its own thread and waits for it at most 10 s: a reader that
/// blocks on the FIFO `fifo` fails the test instead of hanging the suite.
/// On a timeout the FIFO is opened for writing and closed, so the stuck
/// open returns and the thread ends.
fn prompt<T: Send + 'static>(
    what: &str,
    fifo: &Path,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(format!("hostile-{what}"))
        .spawn(move || {
            let _ = tx.send(f());
        })
        .unwrap();
    match rx.recv_timeout(std::time::Duration::from_secs(10)) {
        Ok(v) => Ok(v),
        Err(_) => {
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(fifo);
            Err(format!(
                "{what}: still blocked on {} after 10 s",
                fifo.display()
            ))
        }
    }
}

/// Checks that `err` (an error's text) names `file` and says it is a FIFO.
fn names_fifo(what: &str, file: &str, err: &str, failures: &mut Vec<String>) {
    if err.contains(file) && err.contains("FIFO") {
        eprintln!("refused {what}: {err}");
    } else {
        failures.push(format!(
            "{what}: the error does not name the FIFO {file}: {err}"
        ));
    }
}

/// A valid step `STEP` in a fresh root.
fn valid_step() -> Case {
    let c = case();
    let file = st(good_header().to_string(), &DATA);
    std::fs::write(c.step_dir.join(DATA_NAME), &file).unwrap();
    write_json(
        &c.step_dir.join(INDEX_NAME),
        &index_for(&file, DATA_NAME, &["a", "b"]),
    );
    c
}

type Outcome = Result<String, String>;

/// An operation's error as text; `Err` when it succeeded.
fn failed<T: std::fmt::Debug>(r: Result<T, Error>) -> Outcome {
    match r {
        Ok(v) => Err(format!("succeeded: {v:?}")),
        Err(e) => Ok(e.to_string()),
    }
}

/// A FIFO where a data file, the index or the `latest` hint should be:
/// every reader (the engine's loads and each tool) returns an error naming
/// it at once instead of waiting for a writer for ever.
#[test]
fn fifos_are_refused_at_once_by_every_reader() {
    let _one = one_at_a_time();
    use acp_core::ops;
    let mut failures = Vec::new();

    // A FIFO in place of the data file.
    let c = valid_step();
    let fifo = c.step_dir.join(DATA_NAME);
    std::fs::remove_file(&fifo).unwrap();
    mkfifo(&fifo);
    let (root, shm) = (c.root.clone(), c.shm.clone());
    type Op = Box<dyn FnOnce() -> Outcome + Send>;
    let ops: Vec<(&str, Op)> = vec![
        ("inspect", {
            let root = root.clone();
            Box::new(move || failed(ops::inspect(&root, Some(STEP))))
        }),
        ("verify", {
            let root = root.clone();
            Box::new(
                move || match ops::verify(&root, Some(STEP), false, &ops::Quiet) {
                    Ok(r) if !r.ok => Ok(format!("{:?}", r.steps)),
                    other => Err(format!("{other:?}")),
                },
            )
        }),
        ("verify --all", {
            let root = root.clone();
            Box::new(move || match ops::verify(&root, None, true, &ops::Quiet) {
                Ok(r) if !r.ok => Ok(format!("{:?}", r.steps)),
                other => Err(format!("{other:?}")),
            })
        }),
        ("export", {
            let root = root.clone();
            let out = c.outside.join("out.safetensors");
            Box::new(move || {
                failed(ops::export_safetensors(
                    &root,
                    Some(STEP),
                    None,
                    &out,
                    false,
                    &ops::Quiet,
                ))
            })
        }),
        ("diff", {
            let root = root.clone();
            Box::new(move || failed(ops::diff(&root, STEP, STEP, &ops::Quiet)))
        }),
        ("load", {
            let (root, shm) = (root.clone(), shm.clone());
            Box::new(move || {
                let engine = Engine::open(config(&root, &shm)).map_err(|e| e.to_string())?;
                let r = engine.load(&LoadRequest {
                    step: Some(STEP),
                    storage_only: true,
                    ..LoadRequest::default()
                });
                engine.close().map_err(|e| e.to_string())?;
                failed(r)
            })
        }),
        ("load another rank's tensors", {
            let (root, shm) = (root.clone(), shm.clone());
            Box::new(move || {
                let cfg = config(&root, &shm).with_rank(1).with_world_size(2);
                let engine = Engine::open(cfg).map_err(|e| e.to_string())?;
                let r = engine.load(&LoadRequest {
                    step: Some(STEP),
                    rank: Some(0),
                    tensors: Some(vec!["a".to_owned()]),
                    storage_only: true,
                    ..LoadRequest::default()
                });
                engine.close().map_err(|e| e.to_string())?;
                failed(r)
            })
        }),
    ];
    for (what, op) in ops {
        match prompt(what, &fifo, op) {
            Ok(Ok(err)) => names_fifo(what, DATA_NAME, &err, &mut failures),
            Ok(Err(e)) => failures.push(format!("data file a FIFO, {what}: {e}")),
            Err(e) => failures.push(e),
        }
    }

    // A FIFO in place of the index: the step is not listed, and a load
    // that names the step refuses it.
    let c = valid_step();
    let fifo = c.step_dir.join(INDEX_NAME);
    std::fs::remove_file(&fifo).unwrap();
    mkfifo(&fifo);
    let (root, shm) = (c.root.clone(), c.shm.clone());
    match prompt("load, index a FIFO", &fifo, move || {
        let engine = Engine::open(config(&root, &shm)).map_err(|e| e.to_string())?;
        let r = engine.load(&LoadRequest {
            step: Some(STEP),
            ..LoadRequest::default()
        });
        engine.close().map_err(|e| e.to_string())?;
        failed(r)
    }) {
        Ok(Ok(err)) => names_fifo("load, index a FIFO", INDEX_NAME, &err, &mut failures),
        Ok(Err(e)) => failures.push(format!("index a FIFO, load: {e}")),
        Err(e) => failures.push(e),
    }
    for what in ["inspect", "verify --all"] {
        let root = c.root.clone();
        let all = what == "verify --all";
        let r = prompt(what, &fifo, move || {
            if all {
                ops::verify(&root, None, true, &ops::Quiet).map(|r| format!("{r:?}"))
            } else {
                ops::inspect(&root, Some(STEP)).map(|r| format!("{r:?}"))
            }
        });
        match r {
            Ok(Err(_)) => {}
            Ok(Ok(v)) => failures.push(format!("index a FIFO, {what}: succeeded: {v}")),
            Err(e) => failures.push(e),
        }
    }

    // A FIFO in place of the `latest` hint: nothing reads it, so opening,
    // loading, listing and committing a new step go on as usual.
    let c = valid_step();
    let fifo = c.root.join("latest");
    mkfifo(&fifo);
    let (root, shm) = (c.root.clone(), c.shm.clone());
    let r = prompt("latest a FIFO", &fifo, move || -> Result<(), String> {
        let s = |e: Error| e.to_string();
        let engine = Engine::open(config(&root, &shm)).map_err(s)?;
        let ck = engine.load(&LoadRequest::default()).map_err(s)?;
        if ck.step() != STEP {
            return Err(format!("loaded step {}", ck.step()));
        }
        drop(ck);
        ops::list(&root, Some("torture-hostile"), &shm).map_err(s)?;
        let data = vec![5u8; 64];
        let t = acp_core::HostTensor {
            name: "w",
            dtype: acp_core::Dtype::U8,
            shape: &[64],
            data: &data,
        };
        engine
            .save(
                STEP + 1,
                &[t],
                &json!({}),
                &acp_core::SaveOptions::default(),
            )
            .map_err(s)?
            .wait()
            .map_err(s)?;
        engine.close().map_err(s)
    });
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => failures.push(format!("latest a FIFO: {e}")),
        Err(e) => failures.push(e),
    }
    report("fifo", 11, &failures);
}

/// Directories whose names spell a step number other than canonically
/// (13 digits, a sign) are not steps: they neither hide the real newest
/// step from `load()` nor make `acp verify --all` or `acp ls` fail.
#[test]
fn step_names_that_alias_a_step_are_ignored() {
    let _one = one_at_a_time();
    let c = valid_step();
    let file = st(good_header().to_string(), &DATA);
    let index = index_for(&file, DATA_NAME, &["a", "b"]);
    for stray in [
        format!("step-0{:012}", STEP + 2),
        format!("step-0{STEP:012}"),
        format!("step-+{:011}", STEP + 3),
    ] {
        let d = c.root.join(stray);
        std::fs::create_dir(&d).unwrap();
        std::fs::write(d.join(DATA_NAME), &file).unwrap();
        write_json(&d.join(INDEX_NAME), &index);
    }
    let engine = Engine::open(config(&c.root, &c.shm)).unwrap();
    assert_eq!(engine.steps().unwrap(), vec![STEP]);
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert_eq!(ck.step(), STEP);
    drop(ck);
    engine.close().unwrap();
    let report = acp_core::ops::verify(&c.root, None, true, &acp_core::ops::Quiet).unwrap();
    assert!(report.ok, "{report:?}");
    assert_eq!(
        report.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
        vec![STEP]
    );
    let list = acp_core::ops::list(&c.root, Some("torture-hostile"), &c.shm).unwrap();
    assert_eq!(list.latest, Some(STEP));
}

/// Two roots under one job id share its ring: root A's resident image of
/// a step must not be served for root B's same step of the same size,
/// even when resident copies are trusted without hashing.
#[test]
fn resident_image_of_another_root_is_not_served() {
    let _one = one_at_a_time();
    let dir = tempfile::tempdir().unwrap();
    let shm = dir.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let save = |root: &Path, job: &str, byte: u8| {
        let cfg = config(root, &shm).with_job(job);
        let engine = Engine::open(cfg).unwrap();
        let data = vec![byte; 4096];
        let t = acp_core::HostTensor {
            name: "w",
            dtype: acp_core::Dtype::U8,
            shape: &[4096],
            data: &data,
        };
        engine
            .save(1, &[t], &json!({}), &acp_core::SaveOptions::default())
            .unwrap()
            .wait()
            .unwrap();
        engine.close().unwrap();
    };
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    // Root B's step 1 is committed by another job, so only root A's image
    // is resident in the shared job's ring.
    save(&b, "other-job", 0xbb);
    save(&a, "shared-job", 0xaa);
    let cfg = config(&b, &shm)
        .with_job("shared-job")
        .with_verify(acp_core::Verify::StorageOnly);
    let engine = Engine::open(cfg).unwrap();
    let ck = engine
        .load(&LoadRequest {
            step: Some(1),
            ..LoadRequest::default()
        })
        .unwrap();
    let w = ck.tensor("w").unwrap().data;
    assert!(w.iter().all(|&x| x == 0xbb), "root B loaded root A's bytes");
    assert_eq!(ck.report().source, acp_core::Source::Storage);
    drop(ck);
    // Root A's image is still resident and still served to root A.
    engine.close().unwrap();
    drop(engine);
    let cfg = config(&a, &shm)
        .with_job("shared-job")
        .with_verify(acp_core::Verify::StorageOnly);
    let engine = Engine::open(cfg).unwrap();
    let ck = engine.load(&LoadRequest::default()).unwrap();
    assert!(ck.tensor("w").unwrap().data.iter().all(|&x| x == 0xaa));
    assert_eq!(ck.report().source, acp_core::Source::Ram);
    drop(ck);
    engine.close().unwrap();
}

/// An index that claims a data file far larger than it is: every load
/// path refuses it naming the file and both sizes before any memory is
/// sized by the claim (another rank's whole file, another rank's tensors,
/// this rank's file).
#[test]
fn claimed_size_is_checked_against_the_file_before_memory_is_sized() {
    let _one = one_at_a_time();
    const CLAIM: u64 = 1 << 40;
    let c = valid_step();
    let file = st(good_header().to_string(), &DATA);
    let mut index = index_for(&file, DATA_NAME, &["a", "b"]);
    index["metadata"]["total_size"] = json!(CLAIM);
    // Chunks of 1 GiB, so the digest list stays short and is consistent
    // with the claim; the first is the real file's.
    let digests = vec![chunk_digests(&file, 1 << 30)[0]; 1024];
    let entry = &mut index["metadata"]["acp"]["files"][DATA_NAME];
    entry["size"] = json!(CLAIM);
    entry["chunk_bytes"] = json!(1u64 << 30);
    entry["chunks"] = json!(digests.iter().map(hex).collect::<Vec<_>>());
    entry["root"] = json!(hex(&root_digest(&digests)));
    write_json(&c.step_dir.join(INDEX_NAME), &index);
    let want = format!("file is {} bytes, the index says {CLAIM}", file.len());
    let mut failures = Vec::new();
    let requests = [
        ("this rank's file", 0, None),
        ("another rank's file", 1, None),
        ("another rank's tensors", 1, Some(vec!["a".to_owned()])),
    ];
    for (what, own, tensors) in requests {
        let cfg = config(&c.root, &c.shm).with_rank(own).with_world_size(2);
        let engine = Engine::open(cfg).unwrap();
        let r = engine.load(&LoadRequest {
            step: Some(STEP),
            rank: Some(0),
            tensors,
            ..LoadRequest::default()
        });
        match r {
            Ok(_) => failures.push(format!("{what}: loaded")),
            Err(e) => {
                let msg = e.to_string();
                if msg.contains(&want) && msg.contains(DATA_NAME) && !msg.contains("allocate") {
                    eprintln!("refused {what}: {msg}");
                } else {
                    failures.push(format!("{what}: {msg}"));
                }
            }
        }
        engine.close().unwrap();
    }
    report("claimed size", 3, &failures);
}

/// A root another user could change is not written to: the engine refuses
/// to open one that is group- or world-writable or owned by another user,
/// naming the path; the read-only tools still read such a root (a
/// downloaded checkpoint), and still only inside it.
#[test]
fn engine_refuses_a_root_others_can_write_and_tools_still_read_it() {
    let _one = one_at_a_time();
    use std::os::unix::fs::PermissionsExt;
    let read_only_tools = |root: &Path, shm: &Path| -> Result<(), String> {
        let s = |e: Error| e.to_string();
        acp_core::ops::inspect(root, Some(STEP)).map_err(s)?;
        let v = acp_core::ops::verify(root, None, true, &acp_core::ops::Quiet).map_err(s)?;
        if !v.ok {
            return Err(format!("verify: {v:?}"));
        }
        acp_core::ops::list(root, Some("torture-hostile"), shm).map_err(s)?;
        let out = tempfile::tempdir().unwrap();
        acp_core::ops::export_safetensors(
            root,
            Some(STEP),
            None,
            &out.path().join("x.safetensors"),
            false,
            &acp_core::ops::Quiet,
        )
        .map_err(s)?;
        Ok(())
    };
    let refused = |root: &Path, shm: &Path, says: &str| match Engine::open(config(root, shm)) {
        Ok(_) => panic!("engine opened {}", root.display()),
        Err(e) => {
            assert_eq!(e.kind(), acp_core::ErrorKind::Config, "{e}");
            let msg = e.to_string();
            assert!(msg.contains(&root.display().to_string()), "{msg}");
            assert!(msg.contains(says), "{msg}");
        }
    };
    for mode in [0o777, 0o770, 0o1777] {
        let c = valid_step();
        std::fs::set_permissions(&c.root, std::fs::Permissions::from_mode(mode)).unwrap();
        refused(&c.root, &c.shm, &format!("mode {mode:o}"));
        read_only_tools(&c.root, &c.shm).unwrap();
        // Private again, it is the engine's to write.
        std::fs::set_permissions(&c.root, std::fs::Permissions::from_mode(0o700)).unwrap();
        Engine::open(config(&c.root, &c.shm))
            .unwrap()
            .close()
            .unwrap();
    }
    // SAFETY: `geteuid` takes no arguments and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        // As root, give a checkpoint to another user.
        let c = valid_step();
        for p in [&c.root, &c.step_dir] {
            std::os::unix::fs::chown(p, Some(65534), Some(65534)).unwrap();
        }
        refused(&c.root, &c.shm, "owned by uid 65534");
        read_only_tools(&c.root, &c.shm).unwrap();
    } else {
        // Any other user: `/` belongs to root.
        let shm = tempfile::tempdir().unwrap();
        refused(Path::new("/"), shm.path(), "owned by uid 0");
    }
}

/// A compressed data file whose frame table claims a gigabyte chunk held
/// by a frame of a few bytes (no zstd stream expands past 32,768 times
/// its length): every reader refuses it naming the file, and none sizes
/// memory by the claim (no heap allocation past [`ALLOC_LIMIT`], no
/// mapping of the claimed image).
#[test]
fn a_compressed_frame_claiming_gigabytes_is_refused_before_memory_is_sized() {
    let _one = one_at_a_time();
    use acp_core::format::{digest, packed_head, FrameCodec};
    const CLAIM: u64 = 1 << 30;
    let frame = [0x5Au8; 64];
    let packed = packed_head(CLAIM, CLAIM, &[(&frame[..], FrameCodec::GroupedZstd)]);
    let packed = [packed, frame.to_vec()].concat();
    let c = case();
    std::fs::write(c.step_dir.join(DATA_NAME), &packed).unwrap();
    let digests = [digest(b"any chunk")];
    let mut index = index_for(&packed, DATA_NAME, &["a", "b"]);
    index["metadata"]["total_size"] = json!(CLAIM);
    index["metadata"]["acp"]["format_version"] = json!(4);
    let entry = &mut index["metadata"]["acp"]["files"][DATA_NAME];
    entry["size"] = json!(CLAIM);
    entry["stored_size"] = json!(packed.len());
    entry["chunk_bytes"] = json!(CLAIM);
    entry["chunks"] = json!(digests.iter().map(hex).collect::<Vec<_>>());
    entry["root"] = json!(hex(&root_digest(&digests)));
    write_json(&c.step_dir.join(INDEX_NAME), &index);
    let mut suite = Suite {
        trials: 0,
        failures: Vec::new(),
    };
    let named = |r: Outcome| -> Outcome {
        let err = r?;
        if err.contains(DATA_NAME) {
            Ok(err)
        } else {
            Err(format!("the error does not name the file: {err}"))
        }
    };
    suite.refuse("load", || named(failed(load(&c))));
    other_tools_refuse(&mut suite, &c, &named, &[Some(vec!["a".to_owned()])]);
    report("claimed frame", suite.trials, &suite.failures);
}

/// Every reader but a load of this rank's file refuses the step of `c`,
/// each error passing `named`: loads as another rank (of the file, when
/// `rank_loads` holds None, or of the tensors it lists), verify, export,
/// diff and inspect.
fn other_tools_refuse(
    suite: &mut Suite,
    c: &Case,
    named: &dyn Fn(Outcome) -> Outcome,
    rank_loads: &[Option<Vec<String>>],
) {
    use acp_core::ops;
    for tensors in rank_loads {
        suite.refuse("load another rank's file or tensors", || {
            let cfg = config(&c.root, &c.shm).with_rank(1).with_world_size(2);
            let engine = Engine::open(cfg).unwrap();
            let r = engine.load(&LoadRequest {
                step: Some(STEP),
                rank: Some(0),
                tensors: tensors.clone(),
                storage_only: true,
                ..LoadRequest::default()
            });
            engine.close().unwrap();
            named(failed(r))
        });
    }
    suite.refuse("verify", || {
        match ops::verify(&c.root, Some(STEP), false, &ops::Quiet) {
            Ok(r) if !r.ok => named(Ok(format!("{:?}", r.steps))),
            other => Err(format!("{other:?}")),
        }
    });
    suite.refuse("export", || {
        let out = c.outside.join("out.safetensors");
        let r = ops::export_safetensors(&c.root, Some(STEP), None, &out, false, &ops::Quiet);
        named(failed(r))
    });
    suite.refuse("diff", || {
        named(failed(ops::diff(&c.root, STEP, STEP, &ops::Quiet)))
    });
    suite.refuse("inspect", || {
        named(failed(ops::inspect(&c.root, Some(STEP))))
    });
}

/// An incremental compressed file whose reference frames (which hold no
/// bytes) claim a terabyte of chunks held by a step that is not there:
/// every reader refuses it naming the reference, and none sizes memory by
/// the claim before the references are resolved against the referenced
/// step's index.
#[test]
fn unresolved_references_claiming_a_terabyte_size_no_memory() {
    let _one = one_at_a_time();
    use acp_core::codec::Run;
    use acp_core::format::{chunk_digests, digest, encode_frame, packed_head, FrameCodec};
    const CHUNK_BYTES: u64 = 16 << 20;
    const REFS: u64 = 1 << 16;
    const CLAIM: u64 = (REFS + 1) * CHUNK_BYTES;
    // The first chunk holds the header (padded to 504 bytes) and the
    // start of `c`, which covers the rest of the claimed image.
    let mut header = json!({
        "__metadata__": {"acp.step": STEP.to_string(), "acp.rank": "0", "acp.world_size": "1"},
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [2, 2], "data_offsets": [8, 12]},
        "c": {"dtype": "U8", "shape": [CLAIM - 512 - 12], "data_offsets": [12, CLAIM - 512]},
    })
    .to_string();
    header.push_str(&" ".repeat(504 - header.len()));
    let mut chunk0 = st(&header, &DATA);
    chunk0.resize(CHUNK_BYTES as usize, 0);
    let runs = [Run {
        width: 1,
        len: CHUNK_BYTES as u32,
    }];
    let (frame0, codec) = encode_frame(DATA_NAME, &chunk0, &runs, 1).unwrap();
    assert_eq!(codec, FrameCodec::GroupedZstd);
    let mut frames = vec![(&frame0[..], codec)];
    frames.extend((0..REFS).map(|_| (&[][..], FrameCodec::Reference)));
    let packed = [packed_head(CLAIM, CHUNK_BYTES, &frames), frame0.clone()].concat();
    let c = case();
    std::fs::write(c.step_dir.join(DATA_NAME), &packed).unwrap();
    let mut digests = chunk_digests(&chunk0, CHUNK_BYTES as usize);
    digests.extend((0..REFS).map(|_| digest(b"a chunk of step 3")));
    let mut index = index_for(&packed, DATA_NAME, &["a", "b", "c"]);
    index["metadata"]["total_size"] = json!(CLAIM);
    index["metadata"]["acp"]["format_version"] = json!(4);
    let entry = &mut index["metadata"]["acp"]["files"][DATA_NAME];
    entry["size"] = json!(CLAIM);
    entry["stored_size"] = json!(packed.len());
    entry["chunk_bytes"] = json!(CHUNK_BYTES);
    entry["chunks"] = json!(digests.iter().map(hex).collect::<Vec<_>>());
    entry["root"] = json!(hex(&root_digest(&digests)));
    entry["refs"] = json!([{"first": 1, "count": REFS, "step": 3, "file": DATA_NAME}]);
    write_json(&c.step_dir.join(INDEX_NAME), &index);
    let mut suite = Suite {
        trials: 0,
        failures: Vec::new(),
    };
    let named = |r: Outcome| -> Outcome {
        let err = r?;
        if err.contains("reference step 3") {
            Ok(err)
        } else {
            Err(format!("the error does not name the reference: {err}"))
        }
    };
    suite.refuse("load", || named(failed(load(&c))));
    // A planned load (`load(into=)`): its header sizes the caller's
    // tensors, so it is handed out only once the references resolve.
    suite.refuse("plan a load", || {
        let engine = Engine::open(config(&c.root, &c.shm)).unwrap();
        let r = engine.open_load(&LoadRequest {
            step: Some(STEP),
            storage_only: true,
            ..LoadRequest::default()
        });
        engine.close().unwrap();
        match r {
            Ok(_) => Err("planned a load of the claimed tensors".to_owned()),
            Err(e) => named(Ok(e.to_string())),
        }
    });
    other_tools_refuse(&mut suite, &c, &named, &[None, Some(vec!["a".to_owned()])]);
    report("unresolved references", suite.trials, &suite.failures);
}
