//! Parsing a safetensors header from untrusted bytes.

use std::collections::BTreeMap;
use std::path::Path;

use super::Entry;
use crate::error::Result;

/// The largest header accepted, in bytes.
pub const MAX_HEADER_BYTES: u64 = 100 << 20;

/// A parsed and validated header.
#[derive(Debug, Clone)]
pub struct ParsedHeader {
    /// Start of the data section.
    pub data_start: u64,
    /// Tensors, sorted by offset; offsets are absolute in the file.
    pub entries: Vec<Entry>,
    /// `__metadata__` as stored.
    pub metadata: BTreeMap<String, String>,
    /// `acp.step`, when present.
    pub step: Option<u64>,
    /// `acp.values` parsed, `Null` when absent.
    pub values: serde_json::Value,
}

/// Parses and validates the header at the start of `bytes`, a file of
/// `file_len` bytes (`bytes` holds at least the header; it may hold the
/// whole file). `path` only labels errors.
///
/// Checks: header length within `file_len` and [`MAX_HEADER_BYTES`]; UTF-8
/// JSON object; known dtypes; shapes whose byte size does not overflow;
/// `data_offsets` ordered, non-overlapping, inside the file, and matching the
/// shape's size; names valid; `acp.version` not newer than this build
/// reads. Allocates nothing sized by an unchecked field.
///
/// # Errors
/// [`Error::Corrupt`](crate::Error::Corrupt) naming the file and the tensor,
/// [`Error::Unsupported`](crate::Error::Unsupported) for a newer format version.
pub fn parse_header(path: &Path, bytes: &[u8], file_len: u64) -> Result<ParsedHeader> {
    todo!()
}
