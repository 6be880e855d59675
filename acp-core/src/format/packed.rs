//! The compressed data file: a head, a frame table and one frame per
//! digest chunk of the plain image (the layout is in the module docs of
//! [`format`](super)).

use std::path::Path;

use super::digest::{chunk_span, digest, Digest};
use super::header::ParsedHeader;
use crate::codec::{self, Run};
use crate::error::{Error, Result};

/// The first 8 bytes of a compressed data file. Read as a safetensors
/// length prefix it is far past [`MAX_HEADER_BYTES`](super::MAX_HEADER_BYTES),
/// so no safetensors reader takes the file for one of its own.
pub const PACKED_MAGIC: [u8; 8] = *b"ACPZ\r\n\x1a\n";
/// Bytes of the head: magic, version, frame count, image length, chunk
/// size, table digest.
pub const PACKED_HEAD_BYTES: u64 = 64;
/// Bytes of one frame table entry.
pub const FRAME_ENTRY_BYTES: u64 = 64;

/// The largest chunk a compressed file may have (the reader's limit on a
/// digest chunk): a frame is decoded into memory of its chunk's size.
const MAX_CHUNK_BYTES: u64 = 1 << 30;

/// The most bytes one stored byte of a compressed frame can decode to. A
/// zstd block yields at most 128 KiB and takes at least 4 bytes (a 3-byte
/// header and an RLE byte), so no zstd stream expands more than 32,768
/// times; a raw plane does not expand, and the frame's tables only add
/// bytes. A table entry claiming more is refused before any memory is
/// sized by it (a reader holds a whole chunk).
pub(super) const MAX_FRAME_EXPANSION: u64 = 32_768;

/// How a frame holds its chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameCodec {
    /// The chunk's bytes as they are (compression did not make them smaller).
    Stored,
    /// Byte-grouped zstd ([`crate::codec`]).
    GroupedZstd,
    /// No bytes in this file: the chunk is held by the file of an earlier
    /// step that the index's `refs` name (container version 3). The
    /// frame's check is the chunk's plain digest.
    Reference,
}

impl FrameCodec {
    fn code(self) -> u8 {
        match self {
            FrameCodec::Stored => 0,
            FrameCodec::GroupedZstd => 1,
            FrameCodec::Reference => 2,
        }
    }

    /// The name `acp inspect` shows.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            FrameCodec::Stored => "stored",
            FrameCodec::GroupedZstd => "zstd",
            FrameCodec::Reference => "reference",
        }
    }
}

/// One frame table entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    /// Offset of the frame's first byte in the file.
    pub offset: u64,
    /// The frame's length in the file.
    pub stored: u64,
    /// The chunk's length once decoded.
    pub raw: u64,
    /// How the frame holds the chunk.
    pub codec: FrameCodec,
    /// The frame's check, verified before its bytes are decoded: blake3
    /// of them, or xxh3-128 where [`Frame::quick`] says so.
    pub check: Digest,
    /// Whether [`Frame::check`] is xxh3-128 ([`quick_frame_check`]): a
    /// compressed frame of a container of version 4 or later.
    pub quick: bool,
}

/// A compressed file's head and frame table, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedTable {
    /// The plain image's length (the index's `size`).
    pub image_len: u64,
    /// The digest chunk (the index's `chunk_bytes`).
    pub chunk_bytes: u64,
    /// One frame per chunk, in order.
    pub frames: Vec<Frame>,
}

impl PackedTable {
    /// The file's length: the end of its last frame.
    #[must_use]
    pub fn file_len(&self) -> u64 {
        self.frames
            .last()
            .map_or(table_end(0), |f| f.offset + f.stored)
    }
}

/// Where the frame table of `n` frames ends (the first frame starts).
fn table_end(n: u64) -> u64 {
    PACKED_HEAD_BYTES.saturating_add(n.saturating_mul(FRAME_ENTRY_BYTES))
}

/// Whether `prefix` (a file's first bytes) starts a compressed data file.
#[must_use]
pub fn is_packed(prefix: &[u8]) -> bool {
    prefix.starts_with(&PACKED_MAGIC)
}

/// The element runs of chunk `[start, end)` of an image with header `h`:
/// width 1 for header bytes and 1-byte dtypes, the scalar size
/// ([`Dtype::scalar_size`](super::Dtype::scalar_size)) for each tensor's
/// part. The layout aligns every tensor to its element size, so
/// the parts are whole elements; a part that is not (a hand-made image)
/// is given width 1, which any bytes fit.
#[must_use]
pub fn chunk_runs(h: &ParsedHeader, start: u64, end: u64) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    let mut push = |width: u8, len: u64| {
        if len == 0 {
            return;
        }
        // Chunks are at most 1 GiB (the index's limit), so a part fits.
        let len = u32::try_from(len).unwrap_or(u32::MAX);
        match runs.last_mut() {
            Some(r) if r.width == width && r.len.checked_add(len).is_some() => r.len += len,
            _ => runs.push(Run { width, len }),
        }
    };
    let mut at = start;
    for e in &h.entries {
        let (s, t) = (e.offset.max(start), (e.offset + e.len).min(end));
        if s >= t {
            continue;
        }
        push(1, s - at);
        // Bytes grouped by scalar: a `C64` element as two `F32`.
        let w = e.dtype.scalar_size() as u64;
        let width = if (s - e.offset) % w == 0 && (t - s) % w == 0 {
            u8::try_from(w).unwrap_or(1)
        } else {
            1
        };
        push(width, t - s);
        at = t;
    }
    push(1, end.saturating_sub(at));
    if runs.is_empty() {
        runs.push(Run { width: 1, len: 0 });
    }
    runs
}

/// Encodes chunk `bytes` as a frame: byte-grouped zstd at `level` when that
/// is smaller, else stored. Returns the frame's bytes and codec.
///
/// # Errors
/// [`Error::Invalid`] naming `what` when `runs` do not tile the chunk.
pub fn encode_frame(
    what: &str,
    bytes: &[u8],
    runs: &[Run],
    level: i32,
) -> Result<(Vec<u8>, FrameCodec)> {
    let mut out = Vec::with_capacity(bytes.len() / 2);
    codec::encode(what, bytes, runs, level, &mut out)?;
    if out.len() < bytes.len() {
        Ok((out, FrameCodec::GroupedZstd))
    } else {
        Ok((bytes.to_vec(), FrameCodec::Stored))
    }
}

/// The head and frame table of a file of `frames` (each frame's bytes and
/// codec, in chunk order) for an image of `image_len` bytes cut into
/// `chunk_bytes` chunks. The frames follow it back to back.
#[must_use]
pub fn packed_head(image_len: u64, chunk_bytes: u64, frames: &[(&[u8], FrameCodec)]) -> Vec<u8> {
    let entries: Vec<FrameEntry> = frames
        .iter()
        .map(|(bytes, codec)| FrameEntry {
            stored: bytes.len() as u64,
            check: frame_check(*codec, bytes),
            codec: *codec,
        })
        .collect();
    packed_head_of(image_len, chunk_bytes, &entries)
}

/// The check the frame table records for a frame of `codec` holding
/// `bytes`, as this build writes it: xxh3-128 for a compressed frame
/// ([`quick_frame_check`]), blake3 for a stored one (the chunk's own
/// digest). A reference frame's check is its chunk's plain digest, which
/// its writer has.
#[must_use]
pub fn frame_check(codec: FrameCodec, bytes: &[u8]) -> Digest {
    if codec == FrameCodec::GroupedZstd {
        quick_frame_check(bytes)
    } else {
        digest(bytes)
    }
}

/// The check of a compressed frame in a container of version 4 or later:
/// xxh3-128 of its bytes, little-endian, then 16 zero bytes.
#[must_use]
pub fn quick_frame_check(bytes: &[u8]) -> Digest {
    let mut d = [0u8; 32];
    d[..16].copy_from_slice(&twox_hash::XxHash3_128::oneshot(bytes).to_le_bytes());
    d
}

/// What the frame table says of one frame, known once it is encoded: a
/// writer that streams the frames keeps these and writes the table last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameEntry {
    /// The frame's length.
    pub stored: u64,
    /// The frame's check ([`frame_check`]).
    pub check: Digest,
    /// How the frame holds its chunk.
    pub codec: FrameCodec,
}

/// Where the first frame of a file of `n` frames starts: the head and
/// the table take the bytes before it.
#[must_use]
pub fn packed_frames_start(n: u64) -> u64 {
    table_end(n)
}

/// [`packed_head`] from each frame's [`FrameEntry`], in chunk order.
#[must_use]
pub fn packed_head_of(image_len: u64, chunk_bytes: u64, frames: &[FrameEntry]) -> Vec<u8> {
    let n = frames.len() as u64;
    let mut table = Vec::with_capacity(frames.len() * FRAME_ENTRY_BYTES as usize);
    let mut offset = table_end(n);
    for (i, f) in frames.iter().enumerate() {
        let (s, e) = chunk_span(i as u64, chunk_bytes, image_len);
        table.extend_from_slice(&offset.to_le_bytes());
        table.extend_from_slice(&f.stored.to_le_bytes());
        table.extend_from_slice(&(e - s).to_le_bytes());
        table.push(f.codec.code());
        table.extend_from_slice(&[0u8; 7]);
        table.extend_from_slice(&f.check);
        offset += f.stored;
    }
    let mut out = Vec::with_capacity(PACKED_HEAD_BYTES as usize + table.len());
    out.extend_from_slice(&PACKED_MAGIC);
    out.extend_from_slice(&super::QUICK_FRAME_VERSION.to_le_bytes());
    // Chunk counts are bounded by the index (a u64 image of >= 4 KiB
    // chunks); a u32 holds every count a writer makes.
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
    out.extend_from_slice(&image_len.to_le_bytes());
    out.extend_from_slice(&chunk_bytes.to_le_bytes());
    out.extend_from_slice(&digest(&table));
    out.extend_from_slice(&table);
    out
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

/// Reads and checks the head and frame table of the compressed file at
/// `path` (`file_len` bytes on storage) against its index record: an
/// image of `image_len` bytes in `chunk_bytes` chunks. `read_at(buf,
/// offset)` reads the file. The table is read only once its size is known
/// to fit the file, and its digest is checked before any entry is used.
///
/// # Errors
/// [`Error::Unsupported`] for a newer container version;
/// [`Error::Corrupt`] naming `path` for a bad magic, a head that is not the
/// index's, a table whose digest differs, or frames that do not tile the
/// file in order (past its end, overlapping, gaps) or whose decoded length
/// is not their chunk's, or compressed frames too short to decode to it
/// (more than 32,768 times their stored length); `read_at`'s errors.
pub fn read_packed_table(
    path: &Path,
    file_len: u64,
    image_len: u64,
    chunk_bytes: u64,
    read_at: &mut dyn FnMut(&mut [u8], u64) -> Result<()>,
) -> Result<PackedTable> {
    let bad = |reason: String| Error::corrupt(path, None, format!("compressed file: {reason}"));
    if file_len < PACKED_HEAD_BYTES {
        return Err(bad(format!("{file_len} bytes, shorter than its head")));
    }
    let mut head = [0u8; PACKED_HEAD_BYTES as usize];
    read_at(&mut head, 0)?;
    if !is_packed(&head) {
        return Err(bad("no compressed-file magic".to_owned()));
    }
    let version = le_u32(&head, 8);
    if version > super::FORMAT_VERSION {
        return Err(Error::Unsupported {
            what: path.display().to_string(),
            reason: format!(
                "compressed file version {version} is newer than {}, the newest this build reads",
                super::FORMAT_VERSION
            ),
        });
    }
    if version < 2 {
        return Err(bad(format!(
            "version {version}, which no compressed file has"
        )));
    }
    let n = u64::from(le_u32(&head, 12));
    let (len, chunk) = (le_u64(&head, 16), le_u64(&head, 24));
    if len != image_len || chunk != chunk_bytes {
        return Err(bad(format!(
            "its head records an image of {len} bytes in chunks of {chunk}, the index {image_len} in chunks of {chunk_bytes}"
        )));
    }
    if chunk == 0 || chunk > MAX_CHUNK_BYTES {
        return Err(bad(format!(
            "chunks of {chunk} bytes are past acp's limits"
        )));
    }
    let want = len.div_ceil(chunk);
    if n != want {
        return Err(bad(format!("{n} frames for {want} chunks")));
    }
    let end = table_end(n);
    if end > file_len {
        return Err(bad(format!(
            "a table of {n} frames ends at {end}, past the file's {file_len} bytes"
        )));
    }
    let mut table = vec![
        0u8;
        usize::try_from(end - PACKED_HEAD_BYTES)
            .map_err(|_| bad("table larger than memory".to_owned()))?
    ];
    read_at(&mut table, PACKED_HEAD_BYTES)?;
    if digest(&table) != head[32..64] {
        return Err(bad("the frame table's digest differs".to_owned()));
    }
    let mut frames = Vec::with_capacity(table.len() / FRAME_ENTRY_BYTES as usize);
    let mut expect = end;
    for (i, e) in table.chunks_exact(FRAME_ENTRY_BYTES as usize).enumerate() {
        let i = i as u64;
        let (offset, stored, raw) = (le_u64(e, 0), le_u64(e, 8), le_u64(e, 16));
        let (s, t) = chunk_span(i, chunk, len);
        let codec = match e[24] {
            0 => FrameCodec::Stored,
            1 => FrameCodec::GroupedZstd,
            2 if version >= super::INCREMENTAL_VERSION => FrameCodec::Reference,
            c => return Err(bad(format!("frame {i} has unknown codec {c}"))),
        };
        if offset != expect {
            return Err(bad(format!(
                "frame {i} starts at {offset}, not at {expect} where the previous one ends (frames overlap or leave gaps)"
            )));
        }
        let frame_end = offset
            .checked_add(stored)
            .filter(|x| *x <= file_len)
            .ok_or_else(|| {
                bad(format!(
                    "frame {i} ({offset}+{stored}) runs past the file's {file_len} bytes"
                ))
            })?;
        if raw != t - s {
            return Err(bad(format!(
                "frame {i} decodes to {raw} bytes, its chunk has {}",
                t - s
            )));
        }
        // A writer compresses a chunk only when that makes it smaller, so
        // no frame is longer than its chunk: nothing a table says makes a
        // reader allocate more than a chunk for a frame.
        match codec {
            FrameCodec::Stored if stored != raw => {
                return Err(bad(format!(
                    "stored frame {i} holds {stored} bytes of a {raw}-byte chunk"
                )));
            }
            FrameCodec::GroupedZstd if stored >= raw => {
                return Err(bad(format!("compressed frame {i} of {stored} bytes is not smaller than its {raw}-byte chunk")));
            }
            FrameCodec::GroupedZstd if raw > stored.saturating_mul(MAX_FRAME_EXPANSION) => {
                return Err(bad(format!(
                    "compressed frame {i} of {stored} bytes claims a {raw}-byte chunk, more than {MAX_FRAME_EXPANSION} times its length"
                )));
            }
            FrameCodec::Reference if stored != 0 => {
                return Err(bad(format!(
                    "reference frame {i} holds {stored} bytes (a reference holds none)"
                )));
            }
            _ => {}
        }
        let mut check = [0u8; 32];
        check.copy_from_slice(&e[32..64]);
        let quick = codec == FrameCodec::GroupedZstd && version >= super::QUICK_FRAME_VERSION;
        if quick && check[16..] != [0u8; 16] {
            return Err(bad(format!(
                "compressed frame {i}'s check has bytes past its 16"
            )));
        }
        frames.push(Frame {
            offset,
            stored,
            raw,
            codec,
            check,
            quick,
        });
        expect = frame_end;
    }
    if expect != file_len {
        return Err(bad(format!(
            "its frames end at {expect}, the file at {file_len}"
        )));
    }
    Ok(PackedTable {
        image_len: len,
        chunk_bytes: chunk,
        frames,
    })
}

/// Decodes `frame_bytes` (frame `i` of the file at `path`, as `frame`
/// describes it) into `dst` (the chunk's length): its check first
/// ([`Frame::quick`] says which), so nothing changed reaches the decoder;
/// the decoder then writes exactly `dst`, never more.
///
/// # Errors
/// [`Error::Corrupt`] naming `path` and the frame when its check differs
/// or it does not decode to its chunk (`tensors()`, called only then,
/// names what the chunk holds, for the message; the first is the error's
/// tensor).
pub fn decode_frame(
    path: &Path,
    i: u64,
    frame: &Frame,
    frame_bytes: &[u8],
    dst: &mut [u8],
    tensors: &dyn Fn() -> Vec<String>,
) -> Result<()> {
    let fail = frame_error(path, i, frame, tensors);
    check_frame(frame, frame_bytes, dst.len(), &fail)?;
    match frame.codec {
        FrameCodec::Stored => {
            dst.copy_from_slice(frame_bytes);
            Ok(())
        }
        FrameCodec::GroupedZstd => codec::decode(frame_bytes, dst).map_err(fail),
        // The reader resolves references before it decodes (`read`); a
        // reference reached here is one the index does not list.
        FrameCodec::Reference => Err(fail(
            "a reference frame that the index does not resolve".to_owned(),
        )),
    }
}

/// The leading bytes of chunk `i` that `frame_bytes` (its frame) holds in
/// a run of width 1, decoded without the chunk's other planes
/// ([`codec::decode_lead`]): of a first chunk, the data file's header
/// (unverified: the chunk's digest is not taken). The frame is checked
/// first, as [`decode_frame`] checks it. `None` for a chunk whose first
/// run is wider, or a frame that is not a grouped one.
///
/// # Errors
/// As [`decode_frame`].
pub fn decode_frame_lead(
    path: &Path,
    i: u64,
    frame: &Frame,
    frame_bytes: &[u8],
) -> Result<Option<Vec<u8>>> {
    let none = &Vec::new;
    let fail = frame_error(path, i, frame, none);
    let raw = usize::try_from(frame.raw).map_err(|_| fail("a chunk past memory".to_owned()))?;
    check_frame(frame, frame_bytes, raw, &fail)?;
    match frame.codec {
        FrameCodec::GroupedZstd => codec::decode_lead(frame_bytes, raw).map_err(fail),
        FrameCodec::Stored | FrameCodec::Reference => Ok(None),
    }
}

/// The error of frame `i` of the file at `path` for a reason.
fn frame_error<'a>(
    path: &'a Path,
    i: u64,
    frame: &'a Frame,
    tensors: &'a dyn Fn() -> Vec<String>,
) -> impl Fn(String) -> Error + 'a {
    move |reason: String| {
        let tensors = tensors();
        let mut reason = format!(
            "compressed frame {i} (bytes {}+{}): {reason}",
            frame.offset, frame.stored
        );
        if tensors.len() > 1 {
            reason = format!(
                "{reason}; its chunk holds parts of `{}`",
                tensors.join("`, `")
            );
        }
        Error::corrupt(path, tensors.first().map(String::as_str), reason)
    }
}

/// Checks `frame_bytes` against `frame`: its lengths (the frame's and its
/// chunk's, `raw`) and its check, so that nothing changed reaches the
/// decoder.
fn check_frame(
    frame: &Frame,
    frame_bytes: &[u8],
    raw: usize,
    fail: &dyn Fn(String) -> Error,
) -> Result<()> {
    if frame_bytes.len() as u64 != frame.stored || raw as u64 != frame.raw {
        return Err(fail("not the length its table records".to_owned()));
    }
    let check = if frame.quick {
        quick_frame_check(frame_bytes)
    } else {
        digest(frame_bytes)
    };
    if check != frame.check {
        return Err(fail(
            "check mismatch (the compressed bytes changed)".to_owned(),
        ));
    }
    Ok(())
}

/// The compressed file of plain `image` (a data file image, its header
/// parsed for the runs) in `chunk_bytes` chunks at zstd `level`, encoded
/// on the calling thread; `path` names the image in errors. The flush
/// encodes the same frames in parallel.
///
/// # Errors
/// [`Error::Corrupt`] for an image whose header does not parse;
/// [`Error::Invalid`] for a chunk size of 0.
pub fn pack_image(path: &Path, image: &[u8], chunk_bytes: usize, level: i32) -> Result<Vec<u8>> {
    if chunk_bytes == 0 {
        return Err(Error::invalid(path.display(), "chunks of 0 bytes"));
    }
    let h = super::parse_header(path, image, image.len() as u64)?;
    let mut frames = Vec::with_capacity(image.len().div_ceil(chunk_bytes));
    for (i, bytes) in image.chunks(chunk_bytes).enumerate() {
        let start = (i * chunk_bytes) as u64;
        let runs = chunk_runs(&h, start, start + bytes.len() as u64);
        frames.push(encode_frame(
            &path.display().to_string(),
            bytes,
            &runs,
            level,
        )?);
    }
    let refs: Vec<(&[u8], FrameCodec)> = frames.iter().map(|(b, c)| (&b[..], *c)).collect();
    let mut out = packed_head(image.len() as u64, chunk_bytes as u64, &refs);
    for (b, _) in &frames {
        out.extend_from_slice(b);
    }
    Ok(out)
}
