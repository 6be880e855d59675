//! `acp diff`: which tensors and values differ between two steps, and by
//! how much.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::plain_values;
use super::read::{self, DataFile};
use super::{open_root, pick_step, shown, Progress};
use crate::error::{Error, Result};
use crate::format::{Dtype, Entry};
use crate::storage::{LocalStorage, Storage};

/// How one tensor present in both steps differs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorDiff {
    /// Name.
    pub name: String,
    /// dtype in step A.
    pub dtype_a: String,
    /// dtype in step B.
    pub dtype_b: String,
    /// Shape in step A.
    pub shape_a: Vec<u64>,
    /// Shape in step B.
    pub shape_b: Vec<u64>,
    /// Elements (when dtype and shape agree).
    pub elements: Option<u64>,
    /// Elements whose bytes differ (when dtype and shape agree).
    pub changed_elements: Option<u64>,
    /// Bytes that differ (when dtype and shape agree).
    pub differing_bytes: Option<u64>,
    /// Largest |b − a| over the finite pairs (float dtypes).
    pub max_abs_diff: Option<f64>,
    /// ‖b − a‖₂ / ‖a‖₂ over the finite pairs (float dtypes; absent when
    /// ‖a‖₂ is 0).
    pub rel_l2: Option<f64>,
    /// Changed elements where a or b is nan or infinite (float dtypes).
    pub nonfinite_changed: Option<u64>,
}

/// A plain value that differs, by its path in the values tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ValueDiff {
    /// The data file whose values differ (each rank saves its own).
    pub file: String,
    /// Dotted path, e.g. `sched.lr`; empty for the whole tree.
    pub path: String,
    /// The value in step A (absent: `null` and `missing_a`).
    pub a: Value,
    /// The value in step B.
    pub b: Value,
}

/// What `acp diff` reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiffReport {
    /// The checkpoint root.
    pub root: String,
    /// Step A.
    pub step_a: u64,
    /// Step B.
    pub step_b: u64,
    /// Tensors only in B.
    pub added: Vec<String>,
    /// Tensors only in A.
    pub removed: Vec<String>,
    /// Tensors in both whose dtype, shape or bytes differ.
    pub changed: Vec<TensorDiff>,
    /// Tensors in both, identical.
    pub unchanged: usize,
    /// Plain values that differ (at most [`MAX_VALUE_DIFFS`]).
    pub values: Vec<ValueDiff>,
}

/// The most value differences listed.
pub const MAX_VALUE_DIFFS: usize = 100;

struct Side {
    files: BTreeMap<String, DataFile>,
    tensors: BTreeMap<String, (String, Entry)>,
}

fn open_side(root: &LocalStorage, step: u64) -> Result<Side> {
    let index = root.read_index(step)?;
    let mut files = BTreeMap::new();
    let mut tensors = BTreeMap::new();
    for (name, entry) in &index.files {
        let mut f = read::open(root, step, name, entry)?;
        for e in &f.header()?.entries {
            tensors.insert(e.name.clone(), (name.clone(), e.clone()));
        }
        files.insert(name.clone(), f);
    }
    Ok(Side { files, tensors })
}

/// Compares steps `a` and `b` of `root`: tensors added, removed and
/// changed (for float dtypes with the largest absolute difference and the
/// relative L2 norm of the difference; for others the count of differing
/// bytes), and the plain values that differ. Every byte read is verified.
///
/// # Errors
/// [`Error::NotFound`]; [`Error::Corrupt`] naming the file and tensor when
/// either step is damaged; [`Error::Io`].
pub fn diff(root: &Path, a: u64, b: u64, progress: &dyn Progress) -> Result<DiffReport> {
    let root = open_root(root)?;
    let (a, b) = (pick_step(&root, Some(a))?, pick_step(&root, Some(b))?);
    let mut sa = open_side(&root, a)?;
    let mut sb = open_side(&root, b)?;
    let added = sb
        .tensors
        .keys()
        .filter(|t| !sa.tensors.contains_key(*t))
        .cloned()
        .collect();
    let removed = sa
        .tensors
        .keys()
        .filter(|t| !sb.tensors.contains_key(*t))
        .cloned()
        .collect();
    let common: Vec<String> = sa
        .tensors
        .keys()
        .filter(|t| sb.tensors.contains_key(*t))
        .cloned()
        .collect();
    let total = common.iter().map(|t| sa.tensors[t].1.len).sum();
    progress.begin(&format!("diff steps {a} and {b}"), total);
    let mut changed = Vec::new();
    let mut unchanged = 0;
    for name in &common {
        let (fa, ea) = sa.tensors[name].clone();
        let (fb, eb) = sb.tensors[name].clone();
        let mut d = TensorDiff {
            name: name.clone(),
            dtype_a: ea.dtype.name().to_owned(),
            dtype_b: eb.dtype.name().to_owned(),
            shape_a: ea.shape.clone(),
            shape_b: eb.shape.clone(),
            elements: None,
            changed_elements: None,
            differing_bytes: None,
            max_abs_diff: None,
            rel_l2: None,
            nonfinite_changed: None,
        };
        if ea.dtype != eb.dtype || ea.shape != eb.shape {
            changed.push(d);
            continue;
        }
        let bytes_a = side_file(&mut sa, &fa)?.read_range(ea.offset, ea.len)?;
        let bytes_b = side_file(&mut sb, &fb)?.read_range(eb.offset, eb.len)?;
        progress.advance(ea.len);
        if bytes_a == bytes_b {
            unchanged += 1;
            continue;
        }
        compare(&mut d, ea.dtype, &bytes_a, &bytes_b);
        changed.push(d);
    }
    progress.end();
    let mut values = Vec::new();
    let names: Vec<String> = sa.files.keys().chain(sb.files.keys()).cloned().collect();
    for file in names.iter().collect::<std::collections::BTreeSet<_>>() {
        let va = side_values(&mut sa, file)?;
        let vb = side_values(&mut sb, file)?;
        json_diff(file, "", &va, &vb, &mut values);
    }
    Ok(DiffReport {
        root: shown(root.location()),
        step_a: a,
        step_b: b,
        added,
        removed,
        changed,
        unchanged,
        values,
    })
}

fn side_file<'s>(side: &'s mut Side, name: &str) -> Result<&'s mut DataFile> {
    side.files
        .get_mut(name)
        .ok_or_else(|| Error::invalid(name, "file missing from the step"))
}

fn side_values(side: &mut Side, name: &str) -> Result<Value> {
    match side.files.get_mut(name) {
        Some(f) => Ok(plain_values(f.header()?.values())),
        None => Ok(Value::Null),
    }
}

/// Reads one element as a complex number `(re, im)`.
type Decode = fn(&[u8]) -> (f64, f64);

/// Fills the figures of a tensor whose bytes differ.
fn compare(d: &mut TensorDiff, dtype: Dtype, a: &[u8], b: &[u8]) {
    let size = dtype.size();
    let elements = (a.len() / size.max(1)) as u64;
    d.elements = Some(elements);
    d.differing_bytes = Some(a.iter().zip(b).filter(|(x, y)| x != y).count() as u64);
    let pairs = a.chunks_exact(size).zip(b.chunks_exact(size));
    // Each element as a complex number (a real one with no imaginary
    // part): a complex tensor's figures are of the distance between
    // elements, `|b - a|`.
    let decode: Option<Decode> = match dtype {
        Dtype::F64 => Some(|c| (f64::from_le_bytes(c.try_into().unwrap_or([0; 8])), 0.0)),
        Dtype::F32 => Some(|c| (f32_at(c, 0), 0.0)),
        Dtype::C64 => Some(|c| (f32_at(c, 0), f32_at(c, 4))),
        Dtype::F16 => Some(|c| {
            (
                f16_to_f64(u16::from_le_bytes(c.try_into().unwrap_or([0; 2]))),
                0.0,
            )
        }),
        Dtype::BF16 => Some(|c| {
            let bits = u32::from(u16::from_le_bytes(c.try_into().unwrap_or([0; 2]))) << 16;
            (f64::from(f32::from_bits(bits)), 0.0)
        }),
        _ => None,
    };
    let Some(decode) = decode else {
        d.changed_elements = Some(pairs.filter(|(x, y)| x != y).count() as u64);
        return;
    };
    let (mut changed, mut nonfinite, mut max_abs) = (0u64, 0u64, 0f64);
    let (mut diff_sq, mut norm_sq) = (0f64, 0f64);
    let finite = |(re, im): (f64, f64)| re.is_finite() && im.is_finite();
    for (x, y) in pairs {
        let (fx, fy) = (decode(x), decode(y));
        if finite(fx) {
            norm_sq += fx.0 * fx.0 + fx.1 * fx.1;
        }
        if x == y {
            continue;
        }
        changed += 1;
        if !(finite(fx) && finite(fy)) {
            nonfinite += 1;
            continue;
        }
        let delta = (fy.0 - fx.0).hypot(fy.1 - fx.1);
        max_abs = max_abs.max(delta);
        diff_sq += delta * delta;
    }
    d.changed_elements = Some(changed);
    d.nonfinite_changed = Some(nonfinite);
    d.max_abs_diff = Some(max_abs);
    d.rel_l2 = (norm_sq > 0.0).then(|| (diff_sq / norm_sq).sqrt());
}

/// The little-endian f32 at byte `at` of `c`, as f64 (0 when `c` is short).
fn f32_at(c: &[u8], at: usize) -> f64 {
    let bytes = c.get(at..at + 4).and_then(|b| b.try_into().ok());
    f64::from(f32::from_le_bytes(bytes.unwrap_or([0; 4])))
}

/// IEEE half precision to f64.
fn f16_to_f64(h: u16) -> f64 {
    let sign = if h & 0x8000 == 0 { 1.0 } else { -1.0 };
    let exp = i32::from((h >> 10) & 0x1f);
    let man = f64::from(h & 0x3ff);
    match exp {
        0 => sign * man * 2f64.powi(-24),
        31 if man == 0.0 => sign * f64::INFINITY,
        31 => f64::NAN,
        _ => sign * (1.0 + man / 1024.0) * 2f64.powi(exp - 15),
    }
}

/// Appends the paths where `a` and `b` differ.
fn json_diff(file: &str, path: &str, a: &Value, b: &Value, out: &mut Vec<ValueDiff>) {
    if out.len() >= MAX_VALUE_DIFFS || a == b {
        return;
    }
    let join = |k: &str| {
        if path.is_empty() {
            k.to_owned()
        } else {
            format!("{path}.{k}")
        }
    };
    match (a, b) {
        (Value::Object(x), Value::Object(y)) => {
            let keys: std::collections::BTreeSet<&String> = x.keys().chain(y.keys()).collect();
            for k in keys {
                let (va, vb) = (
                    x.get(k).unwrap_or(&Value::Null),
                    y.get(k).unwrap_or(&Value::Null),
                );
                json_diff(file, &join(k), va, vb, out);
            }
        }
        (Value::Array(x), Value::Array(y)) if x.len() == y.len() => {
            for (i, (va, vb)) in x.iter().zip(y).enumerate() {
                json_diff(file, &join(&i.to_string()), va, vb, out);
            }
        }
        _ => out.push(ValueDiff {
            file: file.to_owned(),
            path: path.to_owned(),
            a: a.clone(),
            b: b.clone(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_precision_decodes() {
        assert_eq!(f16_to_f64(0x3c00), 1.0);
        assert_eq!(f16_to_f64(0xc000), -2.0);
        assert_eq!(f16_to_f64(0x0001), 2f64.powi(-24));
        assert_eq!(f16_to_f64(0x7bff), 65504.0);
        assert!(f16_to_f64(0x7c00).is_infinite());
        assert!(f16_to_f64(0x7e00).is_nan());
    }

    #[test]
    fn float_figures() {
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let b: Vec<u8> = [1.0f32, 2.5, 3.0, 3.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let mut d = TensorDiff {
            name: "w".into(),
            dtype_a: "F32".into(),
            dtype_b: "F32".into(),
            shape_a: vec![4],
            shape_b: vec![4],
            elements: None,
            changed_elements: None,
            differing_bytes: None,
            max_abs_diff: None,
            rel_l2: None,
            nonfinite_changed: None,
        };
        compare(&mut d, Dtype::F32, &a, &b);
        assert_eq!(d.changed_elements, Some(2));
        assert_eq!(d.max_abs_diff, Some(1.0));
        let want = (0.25f64 + 1.0).sqrt() / 30f64.sqrt();
        assert!((d.rel_l2.unwrap() - want).abs() < 1e-12);
        let mut d2 = d.clone();
        compare(&mut d2, Dtype::I32, &a, &b);
        assert_eq!(d2.changed_elements, Some(2));
        assert_eq!(
            d2.max_abs_diff,
            Some(1.0),
            "left from before: ints set no float figure"
        );
        // The same bytes as two complex64 elements, (1+2i, 3+4i) and
        // (1+2.5i, 3+3i): both changed, by 0.5 and 1.
        let mut d3 = d.clone();
        d3.max_abs_diff = None;
        compare(&mut d3, Dtype::C64, &a, &b);
        assert_eq!(d3.elements, Some(2));
        assert_eq!(d3.changed_elements, Some(2));
        assert_eq!(d3.max_abs_diff, Some(1.0));
        assert!((d3.rel_l2.unwrap() - want).abs() < 1e-12);
        // A distance, not a difference of parts: 3+4i against 0.
        let zero = [0u8; 8];
        let c: Vec<u8> = [3.0f32, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        compare(&mut d3, Dtype::C64, &zero, &c);
        assert_eq!(d3.max_abs_diff, Some(5.0));
    }

    #[test]
    fn json_paths() {
        let mut out = Vec::new();
        let a = serde_json::json!({"lr": 0.1, "sched": {"step": 1, "x": [1, 2]}});
        let b = serde_json::json!({"lr": 0.1, "sched": {"step": 2, "x": [1, 3]}, "new": true});
        json_diff("f", "", &a, &b, &mut out);
        let paths: Vec<&str> = out.iter().map(|d| d.path.as_str()).collect();
        assert_eq!(paths, ["new", "sched.step", "sched.x.1"]);
    }
}
