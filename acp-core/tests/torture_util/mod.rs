//! Shared pieces of the torture suites (`torture_*.rs`): trial counts, the
//! figures each suite reports, deterministic payloads, a small PRNG.
//!
//! Trial counts are small by default (CI) and large with
//! `ACP_TORTURE_FULL=1`. Each suite runs all its trials, collects every
//! failure, prints `TORTURE <name>: trials=N failures=F`, appends the same
//! as a JSON line to `$ACP_TORTURE_REPORT` when set (so
//! `tests/torture/run_full.py` can keep RELIABILITY.md true), and then fails
//! if any trial failed.

#![allow(dead_code, reason = "each suite uses a different subset")]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use acp_core::{Dtype, Engine, HostTensor, SaveOptions};
use serde_json::json;

/// Whether the full trial counts are asked for.
pub(crate) fn full() -> bool {
    std::env::var("ACP_TORTURE_FULL").is_ok_and(|v| v == "1")
}

/// `ci` trials, or `full` ones with `ACP_TORTURE_FULL=1`, or exactly
/// `ACP_TORTURE_TRIALS` when set (to reproduce one case).
pub(crate) fn trials(ci: u64, full_count: u64) -> u64 {
    if let Some(n) = std::env::var("ACP_TORTURE_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        n
    } else if full() {
        full_count
    } else {
        ci
    }
}

/// Reports a suite's figures and fails the test when a trial failed.
pub(crate) fn report(name: &str, trials: u64, failures: &[String]) {
    report_with(name, trials, failures, "");
}

/// [`report`] with a line of details (what the trials hit).
pub(crate) fn report_with(name: &str, trials: u64, failures: &[String], notes: &str) {
    let line = format!(
        "TORTURE {name}: trials={trials} failures={}",
        failures.len()
    );
    eprintln!("{line}");
    if let Ok(path) = std::env::var("ACP_TORTURE_REPORT") {
        let rec = json!({"suite": name, "trials": trials, "failures": failures.len(),
                         "notes": notes,
                         "first_failures": failures.iter().take(5).collect::<Vec<_>>()});
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
        {
            let _ = writeln!(f, "{rec}");
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {trials} trials failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// xorshift64*: deterministic, seedable from `ACP_TORTURE_SEED`.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator seeded from `ACP_TORTURE_SEED` (default: `default`),
    /// mixed with `salt` so that suites draw different sequences.
    pub(crate) fn new(default: u64, salt: u64) -> Rng {
        let seed = std::env::var("ACP_TORTURE_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default);
        let mut r = Rng((seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1);
        r.next();
        r
    }

    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The bytes of tensor `which` of step `step`: derived from both, so any
/// loaded step can be checked bit for bit without keeping it.
pub(crate) fn payload(step: u64, which: u8, len: usize) -> Vec<u8> {
    // The part that depends on the position alone is made once per test
    // binary (the torture tests check every load against a payload, and a
    // byte-by-byte generator in an unoptimised build cost more than the
    // loads it checks); each payload is it XORed with a byte of its own.
    const BASE_LEN: usize = 1 << 18;
    static BASE: OnceLock<Vec<u8>> = OnceLock::new();
    let at = |i: u64| (i.wrapping_mul(2_654_435_761) >> 7) as u8;
    let salt = (step as u8).wrapping_mul(31) ^ which;
    if len > BASE_LEN {
        return (0..len as u64).map(|i| at(i) ^ salt).collect();
    }
    let base = BASE.get_or_init(|| (0..BASE_LEN as u64).map(at).collect());
    let mut out = base[..len].to_vec();
    let word = u64::from_le_bytes([salt; 8]);
    let mut words = out.chunks_exact_mut(8);
    for w in &mut words {
        let x = u64::from_le_bytes(w.try_into().unwrap()) ^ word;
        w.copy_from_slice(&x.to_le_bytes());
    }
    for b in words.into_remainder() {
        *b ^= salt;
    }
    out
}

/// Sizes of the two tensors every torture checkpoint holds.
pub(crate) const SIZES: [usize; 2] = [150_000, 70_001];

/// Saves step `step` (tensors `a` and `b`, values `{"step": step}`).
pub(crate) fn save(engine: &Engine, step: u64) -> acp_core::Result<acp_core::SaveHandle> {
    let a = payload(step, 1, SIZES[0]);
    let b = payload(step, 2, SIZES[1]);
    engine.save(
        step,
        &[
            HostTensor {
                name: "a",
                dtype: Dtype::U8,
                shape: &[a.len() as u64],
                data: &a,
            },
            HostTensor {
                name: "b",
                dtype: Dtype::U8,
                shape: &[b.len() as u64],
                data: &b,
            },
        ],
        &json!({"step": step}),
        &SaveOptions::default(),
    )
}

/// `Ok` when `ck` holds exactly what [`save`] saved for its step.
pub(crate) fn check(ck: &acp_core::Checkpoint) -> Result<(), String> {
    let step = ck.step();
    for (name, which, len) in [("a", 1, SIZES[0]), ("b", 2, SIZES[1])] {
        let Some(t) = ck.tensor(name) else {
            return Err(format!("step {step}: tensor `{name}` missing"));
        };
        if t.data != payload(step, which, len).as_slice() {
            return Err(format!("step {step}: tensor `{name}` differs"));
        }
    }
    if ck.values()["step"] != json!(step) {
        return Err(format!("step {step}: values {}", ck.values()));
    }
    Ok(())
}

/// A temporary directory with `root` (not created) and `shm` (created).
pub(crate) fn dirs() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let t = tempfile::tempdir().expect("a temporary directory");
    let root = t.path().join("ckpt");
    let shm = t.path().join("shm");
    std::fs::create_dir(&shm).expect("the shm directory");
    (t, root, shm)
}

/// Copies the tree `from` to `to`, directory modes kept (a ring's per-user
/// directory must stay 0700).
pub(crate) fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("copy target");
    let mode = std::fs::metadata(from).expect("copy source").permissions();
    std::fs::set_permissions(to, mode).expect("copy mode");
    for ent in std::fs::read_dir(from).expect("copy source") {
        let ent = ent.expect("entry");
        let dst = to.join(ent.file_name());
        let ft = ent.file_type().expect("file type");
        if ft.is_dir() {
            copy_tree(&ent.path(), &dst);
        } else if ft.is_file() {
            std::fs::copy(ent.path(), &dst).expect("copy");
        }
    }
}

/// Every regular file under `dir`, sorted.
pub(crate) fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for ent in rd.flatten() {
            let Ok(ft) = ent.file_type() else { continue };
            if ft.is_dir() {
                stack.push(ent.path());
            } else if ft.is_file() {
                out.push(ent.path());
            }
        }
    }
    out.sort();
    out
}

/// Kills this process with SIGKILL, as the OOM killer does: no destructor,
/// no flush, nothing after this runs.
pub(crate) fn sigkill_self() -> ! {
    // SAFETY: kill(2) with this process's own pid and a valid signal number
    // touches no memory; getpid cannot fail.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    loop {
        std::thread::park();
    }
}
