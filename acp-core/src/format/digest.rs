//! blake3 digests of fixed-size chunks, and the root digest over them.

/// A blake3 digest.
pub type Digest = [u8; 32];

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

/// The digest of one chunk: blake3 of its bytes. Every chunk digest acp
/// writes (the flush) or checks (every reader) is this function's.
#[must_use]
pub fn digest(bytes: &[u8]) -> Digest {
    *blake3::hash(bytes).as_bytes()
}

/// The byte range `[start, end)` of chunk `i` of a file of `size` bytes
/// cut into `chunk`-byte pieces (the last may be shorter). Saturates for
/// an `i` past the end (an empty range at `size`).
#[must_use]
pub fn chunk_span(i: u64, chunk: u64, size: u64) -> (u64, u64) {
    let start = i.saturating_mul(chunk).min(size);
    (start, start.saturating_add(chunk).min(size))
}

/// The digest of each `chunk`-byte piece of `data` (the last may be shorter).
/// Empty data has no chunks. A `chunk` of 0 is read as "one chunk holding
/// all of `data`" rather than panicking.
#[must_use]
pub fn chunk_digests(data: &[u8], chunk: usize) -> Vec<Digest> {
    if data.is_empty() {
        return Vec::new();
    }
    let chunk = if chunk == 0 { data.len() } else { chunk };
    data.chunks(chunk).map(digest).collect()
}

/// The root digest of a file: blake3 over the concatenated chunk digests.
#[must_use]
pub fn root_digest(chunks: &[Digest]) -> Digest {
    let mut hasher = blake3::Hasher::new();
    for d in chunks {
        hasher.update(d);
    }
    *hasher.finalize().as_bytes()
}

/// Lowercase hex of a digest.
#[must_use]
pub fn hex(d: &Digest) -> String {
    let mut s = String::with_capacity(64);
    for &b in d {
        s.push(char::from(HEX_DIGITS[usize::from(b >> 4)]));
        s.push(char::from(HEX_DIGITS[usize::from(b & 0x0f)]));
    }
    s
}

/// Parses 64 hex digits; `None` otherwise.
///
/// Upper-case digits are accepted; [`hex`] writes lower case.
#[must_use]
pub fn unhex(s: &str) -> Option<Digest> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            b'A'..=b'F' => Some(c - b'A' + 10),
            _ => None,
        }
    }
    let bytes = s.as_bytes();
    if bytes.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (o, pair) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = (nibble(pair[0])? << 4) | nibble(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn empty_data_has_no_chunks() {
        assert!(chunk_digests(&[], 4096).is_empty());
        assert!(chunk_digests(&[], 0).is_empty());
    }

    #[test]
    fn chunks_are_blake3_of_each_piece() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let d = chunk_digests(&data, 4096);
        assert_eq!(d.len(), 3);
        assert_eq!(d[0], *blake3::hash(&data[..4096]).as_bytes());
        assert_eq!(d[2], *blake3::hash(&data[8192..]).as_bytes());
        assert_eq!(
            chunk_digests(&data, 0),
            vec![*blake3::hash(&data).as_bytes()]
        );
    }

    #[test]
    fn root_is_blake3_of_concatenation() {
        let d = chunk_digests(b"hello world", 4);
        let cat: Vec<u8> = d.iter().flatten().copied().collect();
        assert_eq!(root_digest(&d), *blake3::hash(&cat).as_bytes());
        assert_eq!(root_digest(&[]), *blake3::hash(&[]).as_bytes());
    }

    #[test]
    fn hex_known_value() {
        let d = *blake3::hash(b"").as_bytes();
        assert_eq!(
            hex(&d),
            "af1349b9f5f9a1a6a0404dea36dcc9499bcb25c9adc112b7cc9a93cae41f3262"
        );
    }

    #[test]
    fn unhex_rejects_malformed() {
        assert_eq!(unhex(""), None);
        assert_eq!(unhex(&"0".repeat(63)), None);
        assert_eq!(unhex(&"0".repeat(65)), None);
        assert_eq!(unhex(&"g".repeat(64)), None);
        // 64 bytes, but not 64 ASCII digits.
        assert_eq!(unhex(&"é".repeat(32)), None);
        assert_eq!(unhex(&"A".repeat(64)), Some([0xaa; 32]));
    }

    proptest! {
        #[test]
        fn hex_round_trip(d in any::<[u8; 32]>()) {
            let s = hex(&d);
            prop_assert_eq!(s.len(), 64);
            prop_assert_eq!(unhex(&s), Some(d));
        }

        #[test]
        fn chunk_count_is_ceiling(len in 0usize..5000, chunk in 1usize..700) {
            let data = vec![7u8; len];
            prop_assert_eq!(chunk_digests(&data, chunk).len(), len.div_ceil(chunk));
        }
    }
}

#[cfg(test)]
mod span_tests {
    use super::chunk_span;

    #[test]
    fn spans_tile_the_file_and_saturate_past_it() {
        assert_eq!(chunk_span(0, 4096, 10_000), (0, 4096));
        assert_eq!(chunk_span(2, 4096, 10_000), (8192, 10_000));
        assert_eq!(chunk_span(3, 4096, 10_000), (10_000, 10_000));
        assert_eq!(chunk_span(u64::MAX, u64::MAX, 7), (7, 7));
    }
}
