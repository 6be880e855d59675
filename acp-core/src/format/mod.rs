//! The on-disk and in-RAM format of an acp checkpoint.
//!
//! (Owner: format helper. Full spec goes here: byte layout, header fields,
//! index, commit protocol summary.)
//!
//! One step is a directory `step-{step:012}` under the root. Each rank writes
//! `rank-{rank:05}.safetensors`, a valid safetensors file; the directory's
//! `model.safetensors.index.json` maps every tensor to its file and records
//! each file's size and blake3 chunk digests. Writing the index is the commit.

mod digest;
mod dtype;
mod header;
mod index;
mod json;
mod layout;
#[cfg(test)]
mod tests;

pub use digest::{chunk_digests, hex, root_digest, unhex, Digest};
pub use dtype::Dtype;
pub use header::{parse_header, ParsedHeader, MAX_HEADER_BYTES};
pub use index::{data_file_name, validate_file_name, FileEntry, Index, INDEX_FILE_NAME};
pub use layout::{validate_name, Entry, ImageMeta, Layout, TensorSpec, DATA_ALIGN, MAX_NAME_BYTES};

/// The format version this build writes and the newest it reads.
pub const FORMAT_VERSION: u32 = 1;
