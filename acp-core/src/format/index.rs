//! The global index of a step: `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::Result;

/// The index's file name in a step directory.
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";

/// One data file as the index records it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FileEntry {
    /// The rank that wrote it.
    pub rank: u32,
    /// Its exact length in bytes.
    pub size: u64,
    /// The digest chunk, in bytes.
    pub chunk_bytes: u64,
    /// Lowercase hex blake3 of each chunk.
    pub chunks: Vec<String>,
    /// Lowercase hex root digest (blake3 over the chunk digests).
    pub root: String,
}

/// The index: `{"metadata": {"total_size": .., "acp": {..}}, "weight_map": {..}}`.
/// Tools that read sharded safetensors checkpoints read `weight_map`.
#[derive(Debug, Clone, PartialEq)]
pub struct Index {
    /// The step.
    pub step: u64,
    /// The number of ranks.
    pub world_size: u32,
    /// Format version.
    pub format_version: u32,
    /// Data files by file name.
    pub files: BTreeMap<String, FileEntry>,
    /// Tensor name → file name.
    pub weight_map: BTreeMap<String, String>,
}

impl Index {
    /// Serializes to JSON bytes.
    #[must_use]
    pub fn to_json(&self) -> Vec<u8> {
        todo!()
    }

    /// Parses and validates untrusted index bytes read from `path`: file
    /// names pass [`validate_file_name`], every weight_map target is a listed
    /// file, chunk counts match `size / chunk_bytes`, digests are 64 hex
    /// digits, the format version is not newer than this build's.
    ///
    /// # Errors
    /// [`Error::Corrupt`](crate::Error::Corrupt) naming `path` and the field;
    /// [`Error::Unsupported`](crate::Error::Unsupported) for a newer version.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Index> {
        todo!()
    }
}

/// The data file name of `rank`: `rank-{rank:05}.safetensors`.
#[must_use]
pub fn data_file_name(rank: u32) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// Accepts only a plain file name: 1 to 255 bytes of `[A-Za-z0-9._-]`, not
/// starting with `.`, so it can never leave the step directory.
///
/// # Errors
/// [`Error::Corrupt`](crate::Error::Corrupt) naming `path` (the index) and the name.
pub fn validate_file_name(path: &Path, name: &str) -> Result<()> {
    todo!()
}
