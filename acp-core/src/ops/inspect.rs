//! `acp inspect`: what one committed step holds.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::read;
use super::{open_root, pick_step, shown};
use crate::error::Result;
use crate::format::FrameCodec;
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
    /// How the file is stored: `"none"` (plain safetensors) or `"zstd"`
    /// (a compressed data file).
    #[serde(default = "plain_codec")]
    pub codec: String,
    /// Its length on storage (`size` for a plain file).
    #[serde(default)]
    pub stored_size: u64,
    /// For a compressed file, how many of its chunks were stored
    /// compressed (the others did not shrink and were stored as they are).
    #[serde(default)]
    pub compressed_chunks: usize,
    /// Chunks the file references instead of holding (an incremental
    /// step: their bytes are in the files of earlier steps).
    #[serde(default)]
    pub reused_chunks: u64,
    /// The image bytes of those chunks.
    #[serde(default)]
    pub reused_bytes: u64,
    /// The earlier steps whose files hold them.
    #[serde(default)]
    pub references_steps: Vec<u64>,
    /// The header's `__metadata__` other than the values (`acp.version`,
    /// `format`, ...).
    pub metadata: BTreeMap<String, String>,
    /// The plain values saved with it (the JSON tree as stored).
    pub values: Value,
}

fn plain_codec() -> String {
    "none".to_owned()
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
        let compressed_chunks = f.source().packed().map_or(0, |t| {
            t.frames
                .iter()
                .filter(|fr| fr.codec == FrameCodec::GroupedZstd)
                .count()
        });
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
            // A container written only to leave chunks out (incremental,
            // not compressed) stores the rest as they are.
            codec: match (entry.stored_size, compressed_chunks) {
                (None, _) => "none",
                (Some(_), 0) if !entry.refs.is_empty() => "stored",
                (Some(_), _) => "zstd",
            }
            .to_owned(),
            stored_size: entry.file_len(),
            compressed_chunks,
            reused_chunks: entry.referenced_chunks(),
            reused_bytes: entry.referenced_bytes(),
            references_steps: entry
                .refs
                .iter()
                .map(|r| r.step)
                .collect::<std::collections::BTreeSet<u64>>()
                .into_iter()
                .collect(),
            metadata,
            values: h.values().clone(),
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
