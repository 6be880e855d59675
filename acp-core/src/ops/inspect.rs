//! `acp inspect`: what one committed step holds.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::read;
use super::{open_root, pick_step, shown};
use crate::error::Result;
use crate::storage::Storage;

/// One data file of a step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileInfo {
    /// File name in the step directory.
    pub name: String,
    /// The rank that wrote it.
    pub rank: u32,
    /// Bytes.
    pub size: u64,
    /// Digest chunk size.
    pub chunk_bytes: u64,
    /// Number of chunk digests.
    pub chunks: usize,
    /// Root digest (blake3 over the chunk digests), hex.
    pub root: String,
    /// Start of the data section (the header's end).
    pub data_start: u64,
    /// The header's `__metadata__` other than the values (`acp.version`,
    /// `format`, ...).
    pub metadata: BTreeMap<String, String>,
    /// The plain values saved with it (the JSON tree as stored).
    pub values: Value,
}

/// One tensor of a step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorInfo {
    /// Name.
    pub name: String,
    /// safetensors dtype name.
    pub dtype: String,
    /// Shape.
    pub shape: Vec<u64>,
    /// Bytes.
    pub bytes: u64,
    /// The file that holds it.
    pub file: String,
    /// Offset of its first byte in that file.
    pub offset: u64,
}

/// What `acp inspect` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectReport {
    /// The checkpoint root.
    pub root: String,
    /// The step.
    pub step: u64,
    /// Format version of the index.
    pub format_version: u32,
    /// The world size.
    pub world_size: u32,
    /// Bytes over all files.
    pub bytes: u64,
    /// The data files.
    pub files: Vec<FileInfo>,
    /// Every tensor, by file then offset.
    pub tensors: Vec<TensorInfo>,
}

/// Describes step `step` of `root` (the newest when `None`): its index, and
/// each file's header read from chunks checked against their digests.
/// The tensor bytes are not read (`verify` does that).
///
/// # Errors
/// [`Error::NotFound`](crate::Error::NotFound); [`Error::Corrupt`](crate::Error::Corrupt)
/// when the index or a header is malformed or changed.
pub fn inspect(root: &Path, step: Option<u64>) -> Result<InspectReport> {
    let root = open_root(root)?;
    let step = pick_step(&root, step)?;
    let index = root.read_index(step)?;
    let mut files = Vec::new();
    let mut tensors = Vec::new();
    for (name, entry) in &index.files {
        let mut f = read::open(&root, step, name, entry)?;
        let h = f.header()?;
        let mut metadata = h.metadata.clone();
        metadata.remove("acp.values");
        tensors.extend(h.entries.iter().map(|e| TensorInfo {
            name: e.name.clone(),
            dtype: e.dtype.name().to_owned(),
            shape: e.shape.clone(),
            bytes: e.len,
            file: name.clone(),
            offset: e.offset,
        }));
        files.push(FileInfo {
            name: name.clone(),
            rank: entry.rank,
            size: entry.size,
            chunk_bytes: entry.chunk_bytes,
            chunks: entry.chunks.len(),
            root: entry.root.clone(),
            data_start: h.data_start,
            metadata,
            values: h.values.clone(),
        });
    }
    Ok(InspectReport {
        root: shown(root.location()),
        step,
        format_version: index.format_version,
        world_size: index.world_size,
        bytes: index.files.values().map(|f| f.size).sum(),
        files,
        tensors,
    })
}

/// The values tree of acp's Python state codec (`{"acp.codec": 1, "state":
/// ...}`) as plain JSON for reading: dicts become objects (keys as text),
/// tuples arrays, a tensor `"<tensor NAME>"`, bytes `"<N bytes>"`, a
/// non-finite float its name. Any other JSON comes back as it is.
#[must_use]
pub fn plain_values(values: &Value) -> Value {
    match values {
        Value::Object(o) if o.contains_key(super::CODEC_KEY) => {
            o.get("state").map_or(Value::Null, plain_node)
        }
        other => other.clone(),
    }
}

fn plain_node(n: &Value) -> Value {
    match n {
        Value::Array(a) => Value::Array(a.iter().map(plain_node).collect()),
        Value::Object(o) => match o.get("t").and_then(Value::as_str) {
            Some("dict" | "odict") => {
                let keys = o.get("k").and_then(Value::as_array);
                let vals = o.get("v").and_then(Value::as_array);
                let mut out = serde_json::Map::new();
                if let (Some(k), Some(v)) = (keys, vals) {
                    for (k, v) in k.iter().zip(v) {
                        let key = match plain_node(k) {
                            Value::String(s) => s,
                            other => other.to_string(),
                        };
                        out.insert(key, plain_node(v));
                    }
                }
                Value::Object(out)
            }
            Some("tuple") => o.get("v").map_or(Value::Null, plain_node),
            Some("int") => o.get("v").cloned().unwrap_or(Value::Null),
            Some("float") => Value::String(float_name(o.get("bits").and_then(Value::as_str))),
            Some("bytes") => {
                let n = o
                    .get("v")
                    .and_then(Value::as_str)
                    .map_or(0, |s| s.trim_end_matches('=').len() * 3 / 4);
                Value::String(format!("<{n} bytes>"))
            }
            Some("tensor") => Value::String(format!(
                "<tensor {}>",
                o.get("name").and_then(Value::as_str).unwrap_or("?")
            )),
            Some("value") => o.get("v").cloned().unwrap_or(Value::Null),
            _ => n.clone(),
        },
        other => other.clone(),
    }
}

fn float_name(bits: Option<&str>) -> String {
    let Some(v) = bits.and_then(|b| u64::from_str_radix(b, 16).ok()) else {
        return "nan".to_owned();
    };
    let f = f64::from_bits(v);
    if f.is_nan() {
        "nan".to_owned()
    } else if f > 0.0 {
        "inf".to_owned()
    } else {
        "-inf".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn codec_trees_read_plainly() {
        let tree = json!({"acp.codec": 1, "state": {"t": "dict", "k": ["w", 3, "t"], "v": [
            {"t": "tensor", "fw": "torch", "name": "w"},
            {"t": "float", "bits": "7ff0000000000000"},
            {"t": "tuple", "v": [1, {"t": "bytes", "v": "AAEC"}]},
        ]}});
        assert_eq!(
            plain_values(&tree),
            json!({"w": "<tensor w>", "3": "inf", "t": [1, "<3 bytes>"]})
        );
        assert_eq!(plain_values(&json!({"a": 1})), json!({"a": 1}));
    }
}
