//! The text the command lines print for each report (the `--json` output
//! is the report itself).

use std::fmt::Write;

use super::{
    BenchReport, DiffReport, ExportReport, GcReport, ImportReport, InspectReport, ListReport,
    PersistReport, TensorInfo, VerifyReport,
};

/// `1536` → `"1.5 KiB"`.
#[must_use]
pub fn bytes(n: u64) -> String {
    crate::error::human_bytes(n)
}

/// Bytes per second as `"1.2 GiB/s"`.
#[must_use]
pub fn rate(bytes_per_sec: f64) -> String {
    if !bytes_per_sec.is_finite() || bytes_per_sec <= 0.0 {
        return "-".to_owned();
    }
    // Whole bytes are enough for a rate.
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "positive and finite, checked above"
    )]
    let b = bytes_per_sec as u64;
    format!("{}/s", bytes(b))
}

/// How long ago a Unix time was, e.g. `"5m ago"`.
fn ago(t: Option<f64>) -> String {
    let Some(t) = t else { return "-".to_owned() };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let s = (now - t).max(0.0);
    if s < 60.0 {
        format!("{s:.0}s ago")
    } else if s < 3600.0 {
        format!("{:.0}m ago", s / 60.0)
    } else if s < 86400.0 {
        format!("{:.1}h ago", s / 3600.0)
    } else {
        format!("{:.1}d ago", s / 86400.0)
    }
}

fn ranks(r: &[u32]) -> String {
    if r.is_empty() {
        "-".to_owned()
    } else {
        r.iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `acp ls`.
#[must_use]
pub fn list(r: &ListReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{}", r.root);
    if r.steps.is_empty() {
        let _ = writeln!(s, "  no committed step");
    } else {
        let _ = writeln!(
            s,
            "  {:>12}  {:>10}  {:>5}  {:>7}  {:>10}  IN RAM (ranks)",
            "STEP", "SIZE", "RANKS", "TENSORS", "COMMITTED"
        );
    }
    for row in &r.steps {
        let latest = if Some(row.step) == r.latest {
            "  latest"
        } else {
            ""
        };
        match &row.error {
            Some(e) => {
                let _ = writeln!(s, "  {:>12}  unreadable: {e}", row.step);
            }
            None => {
                let _ = writeln!(
                    s,
                    "  {:>12}  {:>10}  {:>5}  {:>7}  {:>10}  {:<14}{latest}",
                    row.step,
                    bytes(row.bytes),
                    row.world_size,
                    row.tensors,
                    ago(row.committed_at),
                    ranks(&row.resident_ranks),
                );
            }
        }
    }
    for slot in &r.resident_only {
        let what = match &slot.header_error {
            Some(e) => format!(
                "its image's header cannot be read, so `acp persist` cannot commit it ({e})"
            ),
            None => "`acp persist` commits it if it is newer than the latest step".to_owned(),
        };
        let _ = writeln!(
            s,
            "  step {} of rank {} is resident in {} but not committed ({}): {what}",
            slot.step.unwrap_or(0),
            slot.rank,
            slot.path,
            slot.state
        );
    }
    if r.unfinished > 0 {
        let _ = writeln!(
            s,
            "  {} unfinished save(s) in the root (in progress, or left by a dead process: `acp gc --pending` removes old ones)",
            r.unfinished
        );
    }
    let used: u64 = r.slots.iter().map(|x| x.file_bytes).sum();
    if !r.slots.is_empty() {
        let live = r.slots.iter().any(|x| x.locked);
        let _ = writeln!(
            s,
            "  shared memory: {} slot file(s) of job `{}` in {}, {}{}",
            r.slots.len(),
            r.job,
            r.shm_dir,
            bytes(used),
            if live { ", held by a live process" } else { "" }
        );
    }
    s
}

/// `acp inspect`.
#[must_use]
pub fn inspect(r: &InspectReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "step {} of {}\n  format version {}, world size {}, {} in {} file(s), {} tensor(s)",
        r.step,
        r.root,
        r.format_version,
        r.world_size,
        bytes(r.bytes),
        r.files.len(),
        r.tensors.len()
    );
    for f in &r.files {
        let _ = writeln!(
            s,
            "\n  {} (rank {}): {}, {} chunk(s) of {}, blake3 root {}",
            f.name,
            f.rank,
            bytes(f.size),
            f.chunks,
            bytes(f.chunk_bytes),
            f.root
        );
        if f.codec != "none" {
            let ratio = if f.size == 0 {
                1.0
            } else {
                f.stored_size as f64 / f.size as f64
            };
            let _ = writeln!(
                s,
                "    codec: {}, {} on storage (ratio {ratio:.3}), {} of {} chunk(s) compressed",
                f.codec,
                bytes(f.stored_size),
                f.compressed_chunks,
                f.chunks
            );
        }
        if f.reused_chunks > 0 {
            let steps: Vec<String> = f.references_steps.iter().map(u64::to_string).collect();
            let _ = writeln!(
                s,
                "    incremental: {} of {} chunk(s) ({}) reused from step(s) {}",
                f.reused_chunks,
                f.chunks,
                bytes(f.reused_bytes),
                steps.join(", ")
            );
        }
        for (k, v) in &f.metadata {
            let _ = writeln!(s, "    {k}: {v}");
        }
        let values = super::plain_values(&f.values);
        if !values.is_null() {
            let text = serde_json::to_string_pretty(&values).unwrap_or_default();
            let _ = writeln!(s, "    values:");
            for line in text.lines() {
                let _ = writeln!(s, "      {line}");
            }
        }
    }
    if !r.tensors.is_empty() {
        // Each column as wide as its widest cell, within bounds (a dtype
        // name is at most `F8_E4M3FNUZ`).
        let width = |cell: fn(&TensorInfo) -> usize, min: usize, max: usize| {
            r.tensors
                .iter()
                .map(cell)
                .max()
                .unwrap_or(min)
                .clamp(min, max)
        };
        let w = width(|t| t.name.len(), 4, 60);
        let d = width(|t| t.dtype.len(), 7, 16);
        let _ = writeln!(
            s,
            "\n  {:<w$}  {:<d$}  {:<20}  {:>10}  FILE",
            "NAME", "DTYPE", "SHAPE", "BYTES"
        );
        for t in &r.tensors {
            let _ = writeln!(
                s,
                "  {:<w$}  {:<d$}  {:<20}  {:>10}  {}",
                t.name,
                t.dtype,
                format!("{:?}", t.shape),
                t.bytes,
                t.file
            );
        }
    }
    s
}

/// `acp verify`.
#[must_use]
pub fn verify(r: &VerifyReport) -> String {
    let mut s = String::new();
    for st in &r.steps {
        if st.ok {
            let _ = writeln!(
                s,
                "step {}: ok ({} file(s), {} re-hashed)",
                st.step,
                st.files,
                bytes(st.bytes)
            );
        } else {
            let _ = writeln!(s, "step {}: CORRUPT", st.step);
            for p in &st.problems {
                if p.tensors.is_empty() {
                    let _ = writeln!(s, "  {}: {}", p.file, p.reason);
                } else {
                    let _ = writeln!(
                        s,
                        "  {}: tensor {}: {}",
                        p.file,
                        p.tensors
                            .iter()
                            .map(|t| format!("`{t}`"))
                            .collect::<Vec<_>>()
                            .join(", "),
                        p.reason
                    );
                }
            }
        }
    }
    let _ = writeln!(
        s,
        "{}",
        if r.ok {
            "intact"
        } else {
            "verification FAILED"
        }
    );
    s
}

/// `acp export`.
#[must_use]
pub fn export(r: &ExportReport) -> String {
    format!(
        "exported step {} ({} tensor(s), {}, rank(s) {}) to {} in {:.2} s\n",
        r.step,
        r.tensors,
        bytes(r.bytes),
        ranks(&r.ranks),
        r.out,
        r.secs
    )
}

/// `acp import`.
#[must_use]
pub fn import(r: &ImportReport) -> String {
    format!(
        "imported {} tensor(s) from {} file(s) as step {} of {} ({}) in {:.2} s\n",
        r.tensors,
        r.files.len(),
        r.step,
        r.root,
        bytes(r.bytes),
        r.secs
    )
}

/// `acp diff`.
#[must_use]
pub fn diff(r: &DiffReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "step {} → step {}: {} changed, {} added, {} removed, {} unchanged tensor(s)",
        r.step_a,
        r.step_b,
        r.changed.len(),
        r.added.len(),
        r.removed.len(),
        r.unchanged
    );
    for t in &r.added {
        let _ = writeln!(s, "  + {t}");
    }
    for t in &r.removed {
        let _ = writeln!(s, "  - {t}");
    }
    for d in &r.changed {
        if d.dtype_a != d.dtype_b || d.shape_a != d.shape_b {
            let _ = writeln!(
                s,
                "  ~ {}: {} {:?} → {} {:?}",
                d.name, d.dtype_a, d.shape_a, d.dtype_b, d.shape_b
            );
            continue;
        }
        let mut line = format!(
            "  ~ {}: {}/{} element(s) changed",
            d.name,
            d.changed_elements.unwrap_or(0),
            d.elements.unwrap_or(0)
        );
        if let Some(m) = d.max_abs_diff {
            let _ = write!(line, ", max |Δ| {m:.6e}");
        }
        if let Some(l2) = d.rel_l2 {
            let _ = write!(line, ", rel L2 {l2:.6e}");
        }
        if let Some(n) = d.nonfinite_changed.filter(|n| *n > 0) {
            let _ = write!(line, ", {n} non-finite");
        }
        if d.max_abs_diff.is_none() {
            let _ = write!(line, ", {} byte(s) differ", d.differing_bytes.unwrap_or(0));
        }
        let _ = writeln!(s, "{line}");
    }
    for v in &r.values {
        let path = if v.path.is_empty() {
            "(values)"
        } else {
            &v.path
        };
        let _ = writeln!(s, "  value {path} ({}): {} → {}", v.file, v.a, v.b);
    }
    s
}

/// `acp gc`.
#[must_use]
pub fn gc(r: &GcReport) -> String {
    let verb = if r.dry_run { "would remove" } else { "removed" };
    let mut s = format!(
        "{verb} {} step(s) {:?} and {} unfinished save(s), {}; kept {} step(s)\n",
        r.removed_steps.len(),
        r.removed_steps,
        r.removed_unfinished.len(),
        bytes(r.freed_bytes),
        r.kept_steps.len()
    );
    if !r.referenced_steps.is_empty() {
        let _ = writeln!(
            s,
            "  kept {:?}: later kept steps reference their chunks (incremental)",
            r.referenced_steps
        );
    }
    for n in &r.removed_unfinished {
        let _ = writeln!(s, "  {verb} {n}");
    }
    s
}

/// `acp persist`.
#[must_use]
pub fn persist(r: &PersistReport) -> String {
    let mut s = String::new();
    if r.ranks.is_empty() {
        let _ = writeln!(
            s,
            "nothing resident for job `{}` on this node; nothing to persist",
            r.job
        );
    }
    for k in &r.ranks {
        if k.persisted_steps.is_empty() {
            let _ = writeln!(
                s,
                "rank {}: nothing to persist (resident: {:?}; none newer than the latest committed step)",
                k.rank, k.resident_steps
            );
        } else if k.from_replica.is_empty() {
            let _ = writeln!(
                s,
                "rank {}: persisted step(s) {:?}",
                k.rank, k.persisted_steps
            );
        } else {
            let _ = writeln!(
                s,
                "rank {}: persisted step(s) {:?} ({:?} from a replica kept on this node)",
                k.rank, k.persisted_steps, k.from_replica
            );
        }
        if k.discarded_half_staged > 0 {
            let _ = writeln!(
                s,
                "rank {}: discarded {} half-staged slot(s)",
                k.rank, k.discarded_half_staged
            );
        }
    }
    for i in &r.incomplete {
        let _ = writeln!(
            s,
            "step {}: not committed, this node lacks the images of ranks {:?}",
            i.step, i.missing
        );
    }
    let _ = writeln!(
        s,
        "latest committed step: {}",
        r.latest
            .map_or_else(|| "none".to_owned(), |l| l.to_string())
    );
    s
}

/// `acp bench`.
#[must_use]
pub fn bench(r: &BenchReport) -> String {
    let mut s = format!(
        "acp bench: {} in {} ({} copy thread(s), flush with {}{})\n\n",
        bytes(r.size),
        r.dir,
        r.threads,
        r.io,
        if r.direct { " + O_DIRECT" } else { "" }
    );
    let _ = writeln!(
        s,
        "  {:<30}  {:>12}  {:>10}  VS BASELINE",
        "STAGE", "THROUGHPUT", "TIME"
    );
    for row in &r.rows {
        let vs = match (&row.baseline, row.ratio) {
            (Some(b), Some(x)) => format!("{x:.2}× {b}"),
            _ => "(baseline)".to_owned(),
        };
        let _ = writeln!(
            s,
            "  {:<30}  {:>12}  {:>8.1}ms  {vs}",
            row.name,
            rate(row.bytes_per_sec),
            row.secs * 1e3
        );
    }
    s
}
