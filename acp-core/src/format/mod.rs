//! The on-disk and in-RAM format of an acp checkpoint.
//!
//! This module's docs are the format's specification. Version 5
//! ([`FORMAT_VERSION`]) is described here: version 1 ([`PLAIN_VERSION`])
//! with compressed data files added in version 2 ([`COMPRESSED_VERSION`]),
//! incremental steps, whose files reference chunks of earlier steps, in
//! version 3 ([`INCREMENTAL_VERSION`]), in version 4
//! ([`QUICK_FRAME_VERSION`]) compressed frames checked with xxh3-128
//! instead of blake3 before they are decoded, and in version 5
//! ([`DTYPES_VERSION`]) four more safetensors dtypes (`C64`,
//! `F8_E4M3FNUZ`, `F8_E5M2FNUZ`, `F8_E8M0`). A step of plain files is
//! written in version 1, which a build that predates compression still
//! reads; a step with a compressed or incremental file (a container) in
//! version 4; a data file that holds one of the newer dtypes says version
//! 5 in its own `acp.version`. A build reads every version up to its own
//! and refuses a newer one as [`Unsupported`](crate::Error::Unsupported).
//! All integers on disk are little-endian; all text is UTF-8.
//!
//! # Directory layout
//!
//! ```text
//! <root>/
//!   step-000000001200/                  one directory per committed step
//!     rank-00000.safetensors            one data file per writing rank
//!     rank-00001.safetensors
//!     model.safetensors.index.json      the index; its presence marks the commit
//!   <pending directory>/                a step being written (any other name)
//! ```
//!
//! A step directory is named `step-{step:012}` (zero-padded decimal, so that
//! names sort by step). Data files are named `rank-{rank:05}.safetensors`
//! ([`data_file_name`]); the index is [`INDEX_FILE_NAME`]. A reader opens only
//! the file names the index lists, after [`validate_file_name`] has accepted
//! them, so no name in a checkpoint can reach outside its step directory.
//!
//! # Data file
//!
//! Each data file is a plain safetensors file: any safetensors reader loads
//! it without acp. The same bytes form the image in a shared-memory slot, so
//! a flush is a straight copy and a restore from RAM can hand out views.
//!
//! ```text
//! offset 0        8                          data_start                 total_len
//!        +--------+--------------------------+----------------------------+
//!        |   N    | header JSON, space-padded | tensor bytes, back to back |
//!        +--------+--------------------------+----------------------------+
//!        u64 LE    N bytes                    data_start = 8 + N
//! ```
//!
//! - `N` is the header length in bytes, at most [`MAX_HEADER_BYTES`]
//!   (safetensors' own limit).
//! - The header is a JSON object that starts with `{`. acp pads it with
//!   trailing spaces so that `data_start` is a multiple of [`DATA_ALIGN`]
//!   (4096), which lets the flush use `O_DIRECT`.
//! - Every key except `__metadata__` is a tensor name (non-empty, no NUL, at
//!   most [`MAX_NAME_BYTES`] bytes; see [`validate_name`]) mapped to
//!   `{"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}`.
//!   `dtype` is one of the safetensors names of [`Dtype`]; `shape` may be
//!   `[]` (a 0-d tensor, one element) or contain zeros (no bytes); offsets
//!   are relative to `data_start`, and `end - begin` is elements × element
//!   size.
//! - The tensors tile the data section exactly: sorted by offset, each
//!   begins where the previous one ends, the first at 0, and the file ends
//!   where the last one ends. There are no gaps and no trailing bytes
//!   (safetensors refuses both).
//! - Alignment: acp lays the tensors out by element size, widest first (a
//!   stable sort, so the caller's order holds within one size). Since
//!   `data_start` is a multiple of 4096 and each length is a multiple of its
//!   element size, each tensor starts at a multiple of its element size in
//!   the file and in a page-aligned slot.
//! - `__metadata__` maps strings to strings. acp writes:
//!
//!   | key              | value                                          |
//!   |------------------|------------------------------------------------|
//!   | `acp.version`    | the format version, decimal: 1, or 5 ([`DTYPES_VERSION`]) when a tensor's dtype is one version 5 added |
//!   | `acp.step`       | the step, decimal                              |
//!   | `acp.rank`       | the rank that wrote the file, decimal          |
//!   | `acp.world_size` | the number of ranks, decimal                   |
//!   | `acp.values`     | the non-tensor state as compact JSON (`null` when none) |
//!
//!   `acp.values` nests at most [`MAX_VALUES_DEPTH`] arrays and objects;
//!   a writer refuses deeper values and a reader deeper files.
//!
//!   plus the caller's own keys ([`ImageMeta::extra`], e.g. `format: pt`),
//!   which may not start with `acp.`.
//!
//! [`Layout::plan`] writes this header; [`parse_header`] reads one from
//! untrusted bytes and checks all of the above. It also refuses a key given
//! twice (at the top level or within a tensor's entry), and, in a file that
//! carries `acp.version`, a data start or tensor offset that breaks the
//! alignment rule. A file whose `acp.version` is newer
//! than this build's is [`Unsupported`](crate::Error::Unsupported), not
//! corrupt.
//!
//! # Compressed data file
//!
//! Under `compress` (see [`EngineConfig`](crate::EngineConfig)) a rank's
//! file holds its plain image compressed chunk by chunk; it keeps the data
//! file's name, and its index entry says it is compressed
//! (`stored_size`). The image it decodes to is exactly the plain file
//! above, byte for byte: the index's `size`, `chunk_bytes`, `chunks` and
//! `root` are the plain image's, so verification means what it means for
//! a plain file, and `acp export` writes the plain file back.
//!
//! ```text
//! offset 0   magic  "ACPZ\r\n\x1a\n" (8 bytes; as a safetensors prefix, far past any header)
//!        8   u32    container version (4 as written; 2 and 3 are read)
//!        12  u32    n, the number of frames = ceil(image_len / chunk_bytes)
//!        16  u64    image_len (the index's size)
//!        24  u64    chunk_bytes (the index's chunk_bytes)
//!        32  [32]   blake3 of the frame table
//!        64  n × 64 frame table, one entry per chunk, in order:
//!                   u64 offset, u64 stored length, u64 decoded length,
//!                   u8 codec (0 stored, 1 byte-grouped zstd, 2 reference),
//!                   7 zero bytes,
//!                   [32] the frame's check: of a codec-1 frame, xxh3-128
//!                   of its bytes (16 bytes, little-endian) and 16 zero
//!                   bytes; of a stored frame, blake3 of its bytes, which
//!                   is the chunk's plain digest; of a reference, the
//!                   chunk's plain digest
//!        64 + 64n   the frames, back to back, to the end of the file
//! ```
//!
//! Frame `i` decodes, on its own, to chunk `i` of the plain image
//! ([`chunk_span`]). Codec 0 stores the chunk as it is (compression did not
//! shrink it); codec 1 is [`crate::codec`]'s frame: the chunk's bytes
//! grouped into planes by element width (1-byte dtypes and header bytes
//! one plane, bf16/fp16 two, fp32 four, fp64 eight), each plane
//! zstd-compressed or stored raw when that does not shrink it.
//!
//! A reader ([`read_packed_table`]) refuses a newer container version as
//! unsupported, checks that the head agrees with the index, checks the
//! table's digest before it uses an entry, and that the frames tile the
//! file exactly: the first starts where the table ends, each where the
//! previous ends, the last ends the file, and each decodes to its chunk's
//! length (a stored frame is exactly its chunk). Before a frame is decoded
//! its bytes are checked against its check ([`decode_frame`]), and the
//! decoder writes into a buffer of the chunk's length and fails rather
//! than grow it, so a changed frame never reaches the decoder and a
//! hostile one cannot expand past its chunk. The decoded chunk is then
//! checked against the index's blake3 digest like any plain chunk: that
//! digest, over the uncompressed bytes, is the integrity of record.
//!
//! The frame check catches a changed frame before it is decoded and names
//! it; it is not what makes the bytes trustworthy (a writer that forges a
//! file can forge its frame checks whatever the hash). So since version 4
//! a codec-1 frame's check is xxh3-128, about ten times cheaper than
//! blake3, instead of blake3 (versions 2 and 3, still read): a cold
//! restore of a compressed file then pays one blake3 pass per chunk, as a
//! plain one does, plus the decode. A stored frame's check was always its
//! chunk's digest, so a reader that checks the chunk against the index
//! reads it straight into place and hashes it once.
//!
//! # Incremental steps
//!
//! A chunk of a step's file whose digest equals the digest of the same
//! chunk (same index, same `chunk_bytes`, so the same byte span) of the
//! same rank's file in the newest committed step before it is not written
//! again (see [`EngineConfig::with_incremental`](crate::EngineConfig::with_incremental)).
//! The file is then a container as above, whose frames for those chunks
//! have codec 2, "reference": no bytes (stored length 0, the offset where
//! the previous frame ends), the chunk's length, and the chunk's plain
//! digest as the check; the other frames are compressed or stored as the
//! step's `compress` says (a container of version 3 or later). The index
//! entry lists the references as runs:
//!
//! ```text
//! "refs": [ {"first": 1, "count": 40, "step": 1000, "file": "rank-00000.safetensors"}, ... ]
//! ```
//!
//! Chunks `first..first + count` of this file are those chunks of data
//! file `file` of step `step`. The rules, each checked by a reader:
//! - runs are sorted, disjoint, at least one chunk, within the file's
//!   chunks; `step` is strictly earlier than the index's step; `file` is a
//!   plain file name ([`validate_file_name`]), opened only as a file of
//!   step directory `step` of the same root, never as a path;
//! - an entry with `refs` has `stored_size` (it is a container), and its
//!   container's reference frames are exactly the chunks `refs` lists;
//! - one hop: the referenced step's index lists `file` with the same
//!   `chunk_bytes`, the same span and the same digest for each referenced
//!   chunk, and holds that chunk itself (no `refs` entry of its own covers
//!   it): a writer names the file that physically holds the bytes, never
//!   a step that references them in turn.
//!
//! A referenced chunk is read from the holding file (decoded when that is
//! compressed, its frame check first) and checked against the digest of
//! the referring index like any chunk, so verification means what it
//! means for a whole file; an error names the referring file, the
//! tensors, and the file that holds the bytes. Reads stay per chunk and
//! parallel. `acp export` writes the plain image back.
//!
//! A step that a committed step references is kept whole by retention and
//! `acp gc` until no kept step references it, and is not overwritten (a
//! save with `overwrite` of it is refused). An incremental step is
//! written and committed by the same protocol as any other; the files it
//! references were committed, and fsynced, before it, and are never
//! changed by it, so a crash at any point leaves the previous step as it
//! was. Before the commit the writer checks that every step it references
//! is still committed.
//!
//! # Index
//!
//! `model.safetensors.index.json` has the shape of a sharded safetensors
//! index, so tools that read those find every tensor through `weight_map`:
//!
//! ```text
//! {
//!   "metadata": {
//!     "total_size": 14096,                         sum of the file sizes
//!     "acp": {
//!       "format_version": 1,
//!       "step": 1200,
//!       "world_size": 2,
//!       "files": {
//!         "rank-00000.safetensors": {
//!           "rank": 0,                             below world_size
//!           "size": 10000,                         exact file length
//!           "chunk_bytes": 4096,                   digest chunk, > 0
//!           "chunks": ["<64 hex>", "<64 hex>", "<64 hex>"],
//!           "root": "<64 hex>",
//!           "stored_size": 4711,                   only for a container (v2)
//!           "refs": [...]                          only for an incremental file (v3)
//!         }, ...
//!       }
//!     }
//!   },
//!   "weight_map": { "blk.0.w": "rank-00000.safetensors", ... }
//! }
//! ```
//!
//! `size` is the plain image's length; a compressed file's length on storage
//! is `stored_size`, which an index of version 1 may not hold.
//! `chunks` holds the blake3 digest of each `chunk_bytes` piece of the whole
//! file, header included (the last piece may be shorter; an empty file has
//! none), so there are `ceil(size / chunk_bytes)` of them. `root` is blake3
//! over the concatenated 32-byte chunk digests ([`root_digest`]). Every
//! `weight_map` target is a file listed under `files`. A rank that holds no
//! tensor may still list its file. [`Index::parse`] checks all of this on
//! untrusted bytes; it reads `format_version` first and answers
//! [`Unsupported`](crate::Error::Unsupported) for a newer one, whatever the
//! rest holds.
//!
//! # Commit protocol
//!
//! 1. Each rank writes its data file into a pending directory (not named
//!    `step-…`, so no reader ever takes it for a checkpoint) and fsyncs it.
//! 2. Once every rank's file is durable, rank 0 writes the index into the
//!    pending directory, fsyncs it, and fsyncs the directory.
//! 3. Rank 0 renames the pending directory to `step-{step:012}` and fsyncs
//!    the root directory. The rename is the commit point.
//!
//! A crash before step 3 leaves only a pending directory, which readers
//! ignore and cleanup removes; the previous step is untouched. A crash after
//! the rename leaves a complete step whose every byte was fsynced before the
//! rename. A reader accepts a `step-…` directory only when its index
//! parses, and checks each file's size and chunk digests against the index
//! before it hands out bytes (see [`Verify`](crate::Verify)), so a torn or
//! changed file is reported as corrupt, naming the file and tensor, never
//! returned.
//!
//! We assume of the media what the commit protocol needs: fsync of a file
//! makes its data durable, fsync of a directory makes its entries (created
//! files, renames) durable, and a rename within one file system is atomic.
//! We do not assume that a write is atomic at any size: torn pages are
//! caught by the digests.

mod digest;
mod dtype;
mod header;
mod index;
mod json;
mod layout;
mod manifest;
mod packed;
#[cfg(test)]
mod packed_tests;
#[cfg(test)]
mod tests;

pub use digest::{chunk_digests, chunk_span, digest, hex, root_digest, unhex, Digest};
pub use dtype::Dtype;
pub use header::{
    header_end, parse_header, read_header, ParsedHeader, MAX_HEADER_BYTES, PREFIX_BYTES,
};
pub(crate) use header::{parse_header_like, parse_header_spanned};
pub use index::{data_file_name, validate_file_name, ChunkRef, FileEntry, Index, INDEX_FILE_NAME};
pub use layout::{
    check_values_json, validate_name, Entry, ImageMeta, Layout, TensorSpec, DATA_ALIGN,
    MAX_NAME_BYTES, MAX_VALUES_DEPTH,
};
pub use manifest::{manifest_file_name, Manifest};
pub use packed::{
    chunk_runs, decode_frame, decode_frame_lead, encode_frame, frame_check, is_packed, pack_image,
    packed_frames_start, packed_head, packed_head_of, quick_frame_check, read_packed_table, Frame,
    FrameCodec, FrameEntry, PackedTable, FRAME_ENTRY_BYTES, PACKED_HEAD_BYTES, PACKED_MAGIC,
};

/// The newest format version this build reads.
pub const FORMAT_VERSION: u32 = 5;

/// The first version with the dtypes `C64`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ`
/// and `F8_E8M0`: the `acp.version` of a data file that holds one of them
/// ([`Dtype::since`]). Nothing else changed: indexes and containers keep
/// the versions their own features give.
pub const DTYPES_VERSION: u32 = 5;

/// The first version whose compressed (codec 1) frames are checked with
/// xxh3-128 rather than blake3: every container is written in it, and so
/// is the index of a step with a compressed or incremental file.
pub const QUICK_FRAME_VERSION: u32 = 4;

/// The first version with incremental steps: index entries with `refs`,
/// containers with reference frames.
pub const INCREMENTAL_VERSION: u32 = 3;

/// The first version with compressed data files: the version of a step
/// with a compressed file and no references, and of a container without
/// reference frames.
pub const COMPRESSED_VERSION: u32 = 2;

/// The version of plain data files (their `acp.version`, unless a tensor's
/// dtype is newer: [`DTYPES_VERSION`]) and of the index of a step whose
/// files are all plain: readers that predate compression read them.
pub const PLAIN_VERSION: u32 = 1;
