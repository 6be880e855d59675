//! Prints the acp benchmark table as Markdown from criterion's output:
//! per group, each row's median time and throughput, and each acp row's
//! throughput as a multiple of its baseline rows from the same run.
//!
//! ```text
//! cargo run -p acp-bench --bin report [CRITERION_DIR]
//! ```
//!
//! `CRITERION_DIR` defaults to where criterion wrote (`$CRITERION_HOME`,
//! `$CARGO_TARGET_DIR/criterion`, else the workspace's `target/criterion`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// Groups in print order; rows of each in print order (rows not listed
/// follow, sorted).
const ORDER: &[(&str, &[&str])] = &[
    ("staging", &["memcpy_1t", "memcpy_nt", "acp_stage"]),
    (
        "flush",
        &[
            "raw_pwrite_4m",
            "raw_uring_4m_qd8",
            "raw_uring_1m_qd32",
            "raw_uring_1m_qd32_falloc",
            "acp_io_write",
            "acp_flush",
        ],
    ),
    (
        "restore",
        &[
            "raw_read",
            "raw_read_direct",
            "acp_load_storage",
            "memcpy_1t",
            "memcpy_nt",
            "acp_load_ram",
            "acp_load_ram_trusted",
        ],
    ),
    ("digest", &["blake3_1t", "acp_chunk_digests", "blake3_nt"]),
    (
        "tensors",
        &[
            "memcpy_many_1t",
            "acp_save_many_1t",
            "memcpy_10_1t",
            "acp_save_10_1t",
            "memcpy_many_nt",
            "acp_save_many_nt",
            "memcpy_10_nt",
            "acp_save_10_nt",
        ],
    ),
];

/// (group, acp row, its baselines; the first one carries the target
/// throughput ratio of issue 2, if any).
const PAIRS: &[(&str, &str, &[&str], Option<f64>)] = &[
    (
        "staging",
        "acp_stage",
        &["memcpy_nt", "memcpy_1t"],
        Some(0.9),
    ),
    (
        "flush",
        "acp_flush",
        &[
            "raw_uring_1m_qd32_falloc",
            "raw_uring_1m_qd32",
            "raw_uring_4m_qd8",
            "raw_pwrite_4m",
        ],
        Some(0.9),
    ),
    (
        "flush",
        "acp_io_write",
        &["raw_uring_4m_qd8", "raw_uring_1m_qd32"],
        None,
    ),
    (
        "restore",
        "acp_load_storage",
        &["raw_read", "raw_read_direct"],
        Some(0.9),
    ),
    ("restore", "acp_load_ram", &["memcpy_nt", "memcpy_1t"], None),
    (
        "restore",
        "acp_load_ram_trusted",
        &["memcpy_nt", "memcpy_1t"],
        None,
    ),
    ("digest", "acp_chunk_digests", &["blake3_1t"], None),
    ("tensors", "acp_save_many_1t", &["memcpy_many_1t"], None),
    ("tensors", "acp_save_10_1t", &["memcpy_10_1t"], None),
    ("tensors", "acp_save_many_nt", &["memcpy_many_nt"], None),
    ("tensors", "acp_save_10_nt", &["memcpy_10_nt"], None),
];

/// The per-tensor stall overhead target of issue 2, in microseconds.
const PER_TENSOR_TARGET_US: f64 = 2.0;

#[derive(Debug)]
struct Row {
    median_ns: f64,
    bytes: Option<u64>,
}

fn criterion_dir() -> PathBuf {
    if let Some(arg) = std::env::args_os().nth(1) {
        return arg.into();
    }
    if let Some(h) = std::env::var_os("CRITERION_HOME") {
        return h.into();
    }
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(t).join("criterion");
    }
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("criterion")
}

fn read_json(path: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
}

/// Every `*/new/benchmark.json` under `dir`, depth first.
fn find_benchmarks(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n == "new") {
                let b = p.join("benchmark.json");
                if b.is_file() {
                    out.push(b);
                }
            } else {
                find_benchmarks(&p, out);
            }
        }
    }
}

/// group → row → figures.
fn load(dir: &Path) -> BTreeMap<String, BTreeMap<String, Row>> {
    let mut files = Vec::new();
    find_benchmarks(dir, &mut files);
    let mut groups: BTreeMap<String, BTreeMap<String, Row>> = BTreeMap::new();
    for bench in files {
        let Some(b) = read_json(&bench) else { continue };
        let est_path = bench.with_file_name("estimates.json");
        let Some(est) = read_json(&est_path) else {
            continue;
        };
        let Some(median_ns) = est["median"]["point_estimate"].as_f64() else {
            continue;
        };
        let group = b["group_id"].as_str().unwrap_or("?").to_owned();
        let mut name = b["function_id"].as_str().unwrap_or("").to_owned();
        if let Some(v) = b["value_str"].as_str() {
            if !name.is_empty() {
                name.push('/');
            }
            name.push_str(v);
        }
        let t = &b["throughput"];
        let bytes = t["Bytes"].as_u64().or_else(|| t["BytesDecimal"].as_u64());
        groups
            .entry(group)
            .or_default()
            .insert(name, Row { median_ns, bytes });
    }
    groups
}

fn fmt_time(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.3} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.0} ns")
    }
}

fn row_order(group: &str, rows: &BTreeMap<String, Row>) -> Vec<String> {
    let listed: &[&str] = ORDER
        .iter()
        .find(|(g, _)| *g == group)
        .map_or(&[], |(_, r)| *r);
    let mut out: Vec<String> = listed
        .iter()
        .filter(|r| rows.contains_key(**r))
        .map(|r| (*r).to_owned())
        .collect();
    for r in rows.keys() {
        if !listed.contains(&r.as_str()) {
            out.push(r.clone());
        }
    }
    out
}

fn ratios(group: &str, row: &str, rows: &BTreeMap<String, Row>) -> String {
    let Some((_, _, bases, target)) = PAIRS.iter().find(|(g, r, _, _)| *g == group && *r == row)
    else {
        return String::new();
    };
    let Some(me) = rows.get(row) else {
        return String::new();
    };
    let mut parts = Vec::new();
    for (i, base) in bases.iter().enumerate() {
        let Some(b) = rows.get(*base) else { continue };
        let ratio = b.median_ns / me.median_ns;
        let mut s = format!("{ratio:.2}× `{base}`");
        if let (0, Some(t)) = (i, target) {
            let verdict = if ratio >= *t { "meets" } else { "misses" };
            let _ = write!(s, " ({verdict} ≥ {t:.2})");
        }
        parts.push(s);
    }
    parts.join(", ")
}

fn notes(dir: &Path, group: &str) -> Option<serde_json::Map<String, Value>> {
    let path = dir.join("acp-notes").join(format!("{group}.json"));
    read_json(&path)?.as_object().cloned()
}

fn per_tensor(rows: &BTreeMap<String, Row>, count: f64) -> Vec<String> {
    let mut out = Vec::new();
    let diff = |a: &str, b: &str| Some(rows.get(a)?.median_ns - rows.get(b)?.median_ns);
    for (acp, base, what) in [
        ("acp_save_many_1t", "memcpy_many_1t", "1 thread, vs memcpy"),
        ("acp_save_many_nt", "memcpy_many_nt", "N threads, vs memcpy"),
    ] {
        if let Some(d) = diff(acp, base) {
            let us = d / count / 1e3;
            let verdict = if us <= PER_TENSOR_TARGET_US {
                "meets"
            } else {
                "misses"
            };
            out.push(format!(
                "per-tensor stall overhead ({what}): ({acp} − {base}) / {count} = **{us:.2} µs** ({verdict} ≤ {PER_TENSOR_TARGET_US} µs)"
            ));
        }
    }
    for (many, few, what) in [
        ("acp_save_many_1t", "acp_save_10_1t", "1 thread"),
        ("acp_save_many_nt", "acp_save_10_nt", "N threads"),
    ] {
        if let Some(d) = diff(many, few) {
            let us = d / (count - 10.0) / 1e3;
            out.push(format!(
                "per-tensor cost inside acp ({what}): ({many} − {few}) / ({count} − 10) = {us:.2} µs"
            ));
        }
    }
    out
}

fn main() {
    let dir = criterion_dir();
    let groups = load(&dir);
    if groups.is_empty() {
        eprintln!(
            "no criterion results under {} (run `cargo bench -p acp-bench` first)",
            dir.display()
        );
        std::process::exit(1);
    }
    let mut names: Vec<&String> = ORDER
        .iter()
        .filter_map(|(g, _)| groups.get_key_value(*g).map(|(k, _)| k))
        .collect();
    for g in groups.keys() {
        if !ORDER.iter().any(|(o, _)| o == g) {
            names.push(g);
        }
    }
    let mut out = String::new();
    for group in names {
        let rows = &groups[group];
        let _ = writeln!(out, "### {group}\n");
        let _ = writeln!(
            out,
            "| row | median | GB/s | throughput vs baseline (same run) |"
        );
        let _ = writeln!(out, "|---|---:|---:|---|");
        for name in row_order(group, rows) {
            let r = &rows[&name];
            #[expect(clippy::cast_precision_loss, reason = "byte counts far below 2^52")]
            let gbs = r
                .bytes
                .map_or_else(String::new, |b| format!("{:.2}", b as f64 / r.median_ns));
            let _ = writeln!(
                out,
                "| `{name}` | {} | {gbs} | {} |",
                fmt_time(r.median_ns),
                ratios(group, &name, rows)
            );
        }
        let mut extra = Vec::new();
        let notes = notes(&dir, group);
        if group == "tensors" {
            if let Some(count) = notes
                .as_ref()
                .and_then(|n| n.get("tensors"))
                .and_then(Value::as_f64)
            {
                extra.extend(per_tensor(rows, count));
            }
        }
        if let Some(n) = notes {
            for (k, v) in n {
                let v = match v {
                    Value::String(s) => s,
                    Value::Number(x) => match x.as_f64() {
                        Some(f) if f.fract() != 0.0 => format!("{f:.2}"),
                        _ => x.to_string(),
                    },
                    other => other.to_string(),
                };
                extra.push(format!("{k}: {v}"));
            }
        }
        if !extra.is_empty() {
            let _ = writeln!(out);
            for e in extra {
                let _ = writeln!(out, "- {e}");
            }
        }
        let _ = writeln!(out);
    }
    print!("{out}");
}
