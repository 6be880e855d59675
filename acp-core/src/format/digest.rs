//! blake3 digests of fixed-size chunks, and the root digest over them.

/// A blake3 digest.
pub type Digest = [u8; 32];

/// The digest of each `chunk`-byte piece of `data` (the last may be shorter).
/// Empty data has no chunks.
#[must_use]
pub fn chunk_digests(data: &[u8], chunk: usize) -> Vec<Digest> {
    todo!()
}

/// The root digest of a file: blake3 over the concatenated chunk digests.
#[must_use]
pub fn root_digest(chunks: &[Digest]) -> Digest {
    todo!()
}

/// Lowercase hex of a digest.
#[must_use]
pub fn hex(d: &Digest) -> String {
    todo!()
}

/// Parses 64 hex digits; `None` otherwise.
#[must_use]
pub fn unhex(s: &str) -> Option<Digest> {
    todo!()
}
