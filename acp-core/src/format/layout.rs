//! Planning the file image of one rank: header, tensor offsets, alignment.

use std::collections::BTreeMap;

use super::Dtype;
use crate::error::Result;

/// The data section starts at a multiple of this (for `O_DIRECT`).
pub const DATA_ALIGN: u64 = 4096;
/// The longest tensor name or value key, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;

/// A tensor to be saved: name, dtype and shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// Unique, non-empty, no NUL, at most [`MAX_NAME_BYTES`], not `__metadata__`.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape; empty for a 0-d tensor; zero dimensions allowed.
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// Bytes of this tensor (elements × element size).
    ///
    /// # Errors
    /// [`Error::Invalid`](crate::Error::Invalid) naming the tensor when the size overflows `u64`.
    pub fn byte_len(&self) -> Result<u64> {
        todo!()
    }
}

/// What goes into the header's `__metadata__` beside the tensors.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ImageMeta {
    /// The step.
    pub step: u64,
    /// This file's rank.
    pub rank: u32,
    /// The number of ranks.
    pub world_size: u32,
    /// Plain values (any JSON), stored under `acp.values` as a JSON string.
    pub values: serde_json::Value,
    /// Extra string metadata (e.g. `format: pt`); keys starting `acp.` are refused.
    pub extra: BTreeMap<String, String>,
}

/// One tensor's place in the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<u64>,
    /// Absolute offset of the first byte in the image (file).
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

/// The planned image of one rank's file.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Entries in the order the specs were given.
    pub entries: Vec<Entry>,
    /// Start of the data section: `8 + header JSON + padding`, a multiple of [`DATA_ALIGN`].
    pub data_start: u64,
    /// Total image length (data_start + all tensor bytes). Not padded.
    pub total_len: u64,
    header: Vec<u8>,
}

impl Layout {
    /// Plans the image: checks every name (unique, non-empty, no NUL, bounded,
    /// not `__metadata__`), orders tensors by element size descending (stable),
    /// so each is aligned to its element size with no gaps (safetensors
    /// demands contiguous data), writes the header JSON with `__metadata__`
    /// (`acp.version`, `acp.step`, `acp.rank`, `acp.world_size`, `acp.values`
    /// and the extra keys) and pads it with spaces so the data starts at a
    /// multiple of [`DATA_ALIGN`].
    ///
    /// # Errors
    /// [`Error::Invalid`](crate::Error::Invalid) naming the tensor or key at fault.
    pub fn plan(specs: &[TensorSpec], meta: &ImageMeta) -> Result<Layout> {
        todo!()
    }

    /// The first `data_start` bytes of the image: the 8-byte little-endian
    /// header length, the header JSON and its padding.
    #[must_use]
    pub fn header_bytes(&self) -> &[u8] {
        &self.header
    }
}

/// Checks a tensor name or value key.
///
/// # Errors
/// [`Error::Invalid`](crate::Error::Invalid) naming it.
pub fn validate_name(name: &str) -> Result<()> {
    todo!()
}
