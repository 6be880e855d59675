//! The global index of a step: `model.safetensors.index.json`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use super::digest::{hex, root_digest, unhex, Digest};
use super::json::{escaped, shown, unique_map};
use super::layout::name_problem;
use super::{COMPRESSED_VERSION, FORMAT_VERSION, INCREMENTAL_VERSION};
use crate::error::{Error, Result};

/// The index's file name in a step directory.
pub const INDEX_FILE_NAME: &str = "model.safetensors.index.json";

/// The longest data file name, in bytes.
const MAX_FILE_NAME_BYTES: usize = 255;

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
    /// The file's length on storage when it is a compressed data file
    /// (`stored_size` in the index, format version 2); absent for a plain
    /// safetensors file, whose length is `size`. `size` and the digests
    /// are the plain image's either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_size: Option<u64>,
    /// The chunks this file does not hold (an incremental step, format
    /// version 3): each run is read from the same chunks of a file of an
    /// earlier step, the one that physically holds them. Empty for a file
    /// that holds all of its chunks. Sorted, never overlapping.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub refs: Vec<ChunkRef>,
}

/// A run of chunks of a data file held by the file of an earlier step:
/// chunks `first..first + count` of this file are the same chunks (same
/// index, same `chunk_bytes`, so the same byte spans) of data file `file`
/// of step `step`, which holds their bytes itself (one hop: never a
/// reference of its own).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChunkRef {
    /// The first chunk of the run.
    pub first: u64,
    /// The number of chunks in the run, at least 1.
    pub count: u64,
    /// The earlier step whose file holds the bytes.
    pub step: u64,
    /// That step's data file name (a plain name, checked like every file
    /// name of an index).
    pub file: String,
}

impl ChunkRef {
    /// Whether chunk `i` is in the run.
    #[must_use]
    pub fn holds(&self, i: u64) -> bool {
        i >= self.first && i - self.first < self.count
    }
}

impl FileEntry {
    /// The entry of a plain data file of `size` bytes whose `chunk_bytes`
    /// chunks have `digests`: their hex and root digest, no compression,
    /// no references.
    #[must_use]
    pub fn plain(rank: u32, size: u64, chunk_bytes: u64, digests: &[Digest]) -> FileEntry {
        FileEntry {
            rank,
            size,
            chunk_bytes,
            chunks: digests.iter().map(hex).collect(),
            root: hex(&root_digest(digests)),
            stored_size: None,
            refs: Vec::new(),
        }
    }

    /// The file's length on storage: [`FileEntry::stored_size`] for a
    /// compressed file, else `size`.
    #[must_use]
    pub fn file_len(&self) -> u64 {
        self.stored_size.unwrap_or(self.size)
    }

    /// The reference that covers chunk `i`, when the file does not hold it.
    #[must_use]
    pub fn held_by(&self, i: u64) -> Option<&ChunkRef> {
        // Runs are sorted and disjoint (checked by the parser).
        let at = self.refs.partition_point(|r| r.first + r.count <= i);
        self.refs.get(at).filter(|r| r.holds(i))
    }

    /// The number of chunks this file references instead of holding.
    #[must_use]
    pub fn referenced_chunks(&self) -> u64 {
        self.refs.iter().map(|r| r.count).sum()
    }

    /// The plain bytes of the chunks this file references.
    #[must_use]
    pub fn referenced_bytes(&self) -> u64 {
        self.refs
            .iter()
            .flat_map(|r| r.first..r.first + r.count)
            .map(|i| {
                let (s, e) = super::digest::chunk_span(i, self.chunk_bytes, self.size);
                e - s
            })
            .sum()
    }
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

/// The index as it is stored (borrowed, for writing).
#[derive(Serialize)]
struct IndexOut<'a> {
    metadata: MetaOut<'a>,
    weight_map: &'a BTreeMap<String, String>,
}

#[derive(Serialize)]
struct MetaOut<'a> {
    total_size: u64,
    acp: AcpOut<'a>,
}

#[derive(Serialize)]
struct AcpOut<'a> {
    format_version: u32,
    step: u64,
    world_size: u32,
    files: &'a BTreeMap<String, FileEntry>,
}

/// The index as it is stored (owned, for reading).
#[derive(Deserialize)]
struct IndexIn {
    metadata: MetaIn,
    #[serde(deserialize_with = "unique_map")]
    weight_map: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct MetaIn {
    total_size: u64,
    acp: AcpIn,
}

#[derive(Deserialize)]
struct AcpIn {
    format_version: u32,
    step: u64,
    world_size: u32,
    #[serde(deserialize_with = "unique_map")]
    files: BTreeMap<String, FileEntry>,
}

/// Just enough of the index to read its version, whatever else it holds.
#[derive(Deserialize)]
struct VersionOnly {
    metadata: VersionMeta,
}

#[derive(Deserialize)]
struct VersionMeta {
    acp: VersionAcp,
}

#[derive(Deserialize)]
struct VersionAcp {
    format_version: u64,
}

impl Index {
    /// Serializes to JSON bytes (pretty-printed, with a final newline).
    /// `metadata.total_size` is the sum of the file sizes.
    ///
    /// # Panics
    /// Never: the index holds only string-keyed maps, strings and integers,
    /// which always serialize.
    #[must_use]
    pub fn to_json(&self) -> Vec<u8> {
        let total_size = self
            .files
            .values()
            .fold(0u64, |sum, f| sum.saturating_add(f.size));
        let stored = IndexOut {
            metadata: MetaOut {
                total_size,
                acp: AcpOut {
                    format_version: self.format_version,
                    step: self.step,
                    world_size: self.world_size,
                    files: &self.files,
                },
            },
            weight_map: &self.weight_map,
        };
        let mut out = serde_json::to_vec_pretty(&stored)
            .expect("maps with string keys, strings and integers always serialize to JSON");
        out.push(b'\n');
        out
    }

    /// Parses and validates untrusted index bytes read from `path`: file
    /// names pass [`validate_file_name`], every `weight_map` target is a listed
    /// file, chunk counts match `size / chunk_bytes`, digests are 64 hex
    /// digits, the format version is not newer than this build's.
    ///
    /// It also checks that the step is present, the world size is at least
    /// 1 and above every file's rank, `chunk_bytes` is not 0, each `root`
    /// is the root digest of its `chunks`, `total_size` is the sum of the
    /// file sizes, tensor names are valid, and no JSON key is given twice.
    /// Unknown fields are ignored.
    ///
    /// # Errors
    /// [`Error::Corrupt`](crate::Error::Corrupt) naming `path` and the field;
    /// [`Error::Unsupported`](crate::Error::Unsupported) for a newer version.
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<Index> {
        let corrupt = |reason: String| Error::corrupt(path, None, reason);

        // A newer version is refused whether or not it fits this build's
        // schema; the version alone is read (a second pass) only when the
        // whole does not parse.
        let newer = |version: u64| {
            (version > u64::from(FORMAT_VERSION)).then(|| Error::Unsupported {
                what: path.display().to_string(),
                reason: format!(
                    "index format version {version} is newer than {FORMAT_VERSION}, the newest this build reads"
                ),
            })
        };
        let stored: IndexIn = serde_json::from_slice(bytes).map_err(|e| {
            serde_json::from_slice::<VersionOnly>(bytes)
                .ok()
                .and_then(|v| newer(v.metadata.acp.format_version))
                .unwrap_or_else(|| corrupt(format!("not a valid acp index: {e}")))
        })?;
        if let Some(e) = newer(u64::from(stored.metadata.acp.format_version)) {
            return Err(e);
        }
        let IndexIn {
            metadata:
                MetaIn {
                    total_size,
                    acp:
                        AcpIn {
                            format_version,
                            step,
                            world_size,
                            files,
                        },
                },
            weight_map,
        } = stored;

        if format_version == 0 {
            return Err(corrupt(
                "`metadata.acp.format_version` is 0, which no format uses".to_owned(),
            ));
        }
        if world_size == 0 {
            return Err(corrupt("`metadata.acp.world_size` is 0".to_owned()));
        }
        let mut sum = 0u64;
        for (name, file) in &files {
            validate_file_name(path, name)?;
            check_file(path, name, file, world_size)?;
            check_refs(path, name, file, step)?;
            sum = sum.checked_add(file.size).ok_or_else(|| {
                corrupt("the file sizes add up to more than a u64 holds".to_owned())
            })?;
        }
        if format_version < COMPRESSED_VERSION {
            if let Some((name, _)) = files.iter().find(|(_, f)| f.stored_size.is_some()) {
                return Err(corrupt(format!(
                    "`metadata.acp.files.{name}` is compressed in an index of format version {format_version}"
                )));
            }
        }
        if format_version < INCREMENTAL_VERSION {
            if let Some((name, _)) = files.iter().find(|(_, f)| !f.refs.is_empty()) {
                return Err(corrupt(format!(
                    "`metadata.acp.files.{name}` references chunks of earlier steps in an index of format version {format_version}"
                )));
            }
        }
        if sum != total_size {
            return Err(corrupt(format!(
                "`metadata.total_size` is {total_size}, but the files add up to {sum} bytes"
            )));
        }
        for (tensor, file) in &weight_map {
            if let Some(reason) = name_problem(tensor) {
                return Err(Error::corrupt(
                    path,
                    Some(&escaped(tensor)),
                    format!("`weight_map`: {reason}"),
                ));
            }
            if !files.contains_key(file) {
                return Err(Error::corrupt(
                    path,
                    Some(tensor),
                    format!(
                        "`weight_map` names file {}, which `metadata.acp.files` does not list",
                        shown(file)
                    ),
                ));
            }
        }

        Ok(Index {
            step,
            world_size,
            format_version,
            files,
            weight_map,
        })
    }
}

/// Checks one `files` entry: rank, chunk count and digests.
pub(super) fn check_file(path: &Path, name: &str, file: &FileEntry, world_size: u32) -> Result<()> {
    let bad = |reason: String| {
        Error::corrupt(path, None, format!("`metadata.acp.files.{name}`: {reason}"))
    };
    if file.rank >= world_size {
        return Err(bad(format!(
            "rank {} is not below the world size {world_size}",
            file.rank
        )));
    }
    if file.chunk_bytes == 0 {
        return Err(bad("`chunk_bytes` is 0".to_owned()));
    }
    let expected = file.size.div_ceil(file.chunk_bytes);
    if u64::try_from(file.chunks.len()).ok() != Some(expected) {
        return Err(bad(format!(
            "{} chunk digests, but {} bytes in chunks of {} make {expected}",
            file.chunks.len(),
            file.size,
            file.chunk_bytes
        )));
    }
    let mut digests: Vec<Digest> = Vec::with_capacity(file.chunks.len());
    for (i, chunk) in file.chunks.iter().enumerate() {
        digests.push(
            unhex(chunk).ok_or_else(|| bad(format!("chunk digest {i} is not 64 hex digits")))?,
        );
    }
    let root = unhex(&file.root).ok_or_else(|| bad("`root` is not 64 hex digits".to_owned()))?;
    if root != root_digest(&digests) {
        return Err(bad(
            "`root` is not the root digest of its chunk digests".to_owned()
        ));
    }
    Ok(())
}

/// Checks the references of one `files` entry of step `step`: each run
/// is at least one chunk, within the file's chunks, after the previous
/// run, names a strictly earlier step and a plain file name; and a file
/// with references is a container ([`FileEntry::stored_size`]), since a
/// safetensors file cannot leave chunks out. Where the referenced chunks
/// are is checked when the file is opened (`read`), against the
/// referenced step's own index.
pub(super) fn check_refs(path: &Path, name: &str, file: &FileEntry, step: u64) -> Result<()> {
    let bad = |reason: String| {
        Error::corrupt(path, None, format!("`metadata.acp.files.{name}`: {reason}"))
    };
    if file.refs.is_empty() {
        return Ok(());
    }
    if file.stored_size.is_none() {
        return Err(bad(
            "references chunks but is not a container (no `stored_size`)".to_owned(),
        ));
    }
    let chunks = file.chunks.len() as u64;
    let mut next = 0u64;
    for (k, r) in file.refs.iter().enumerate() {
        if r.count == 0 {
            return Err(bad(format!("reference {k} covers no chunk")));
        }
        let end = r
            .first
            .checked_add(r.count)
            .filter(|e| *e <= chunks)
            .ok_or_else(|| {
                bad(format!(
                    "reference {k} (chunks {}+{}) runs past the file's {chunks} chunks",
                    r.first, r.count
                ))
            })?;
        if r.first < next {
            return Err(bad(format!(
                "reference {k} starts at chunk {}, before the previous one ends ({next})",
                r.first
            )));
        }
        if r.step >= step {
            return Err(bad(format!(
                "reference {k} names step {}, not an earlier step than {step}",
                r.step
            )));
        }
        validate_file_name(path, &r.file)?;
        next = end;
    }
    Ok(())
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
    let problem = if name.is_empty() {
        Some("is empty")
    } else if name.len() > MAX_FILE_NAME_BYTES {
        Some("is longer than 255 bytes")
    } else if name.starts_with('.') {
        Some("starts with `.`")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        Some("holds a character outside [A-Za-z0-9._-]")
    } else {
        None
    };
    match problem {
        Some(p) => Err(Error::corrupt(
            path,
            None,
            format!("file name {} {p}", shown(name)),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::{json, Value};

    use super::*;
    use crate::format::{chunk_digests, hex};
    use crate::ErrorKind;

    const PATH: &str = "/c/step-000000001200/model.safetensors.index.json";

    fn entry(rank: u32, data: &[u8], chunk: usize) -> FileEntry {
        let digests = chunk_digests(data, chunk);
        FileEntry::plain(rank, data.len() as u64, chunk as u64, &digests)
    }

    fn sample() -> Index {
        let files = BTreeMap::from([
            (data_file_name(0), entry(0, &[1u8; 10_000], 4096)),
            (data_file_name(1), entry(1, &[2u8; 4096], 4096)),
            (data_file_name(2), entry(2, &[], 4096)),
        ]);
        let weight_map = BTreeMap::from([
            ("blk.0.w".to_owned(), data_file_name(0)),
            ("blk.1.w".to_owned(), data_file_name(1)),
            ("é \"odd\" name".to_owned(), data_file_name(1)),
        ]);
        Index {
            step: 1200,
            world_size: 3,
            format_version: FORMAT_VERSION,
            files,
            weight_map,
        }
    }

    fn parse(bytes: &[u8]) -> Result<Index> {
        Index::parse(Path::new(PATH), bytes)
    }

    /// `sample()` as JSON, changed by `edit`.
    fn edited(edit: impl FnOnce(&mut Value)) -> Vec<u8> {
        let mut v: Value = serde_json::from_slice(&sample().to_json()).unwrap();
        edit(&mut v);
        serde_json::to_vec(&v).unwrap()
    }

    fn refused(bytes: &[u8], needle: &str) -> Error {
        let e = parse(bytes).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
        assert!(e.to_string().starts_with(PATH), "{e}");
        assert!(e.to_string().contains(needle), "`{needle}` not in: {e}");
        e
    }

    #[test]
    fn round_trip() {
        let idx = sample();
        assert_eq!(parse(&idx.to_json()).unwrap(), idx);
    }

    #[test]
    fn json_shape_is_a_sharded_safetensors_index() {
        let v: Value = serde_json::from_slice(&sample().to_json()).unwrap();
        assert_eq!(v["metadata"]["total_size"], json!(10_000 + 4096));
        assert_eq!(v["weight_map"]["blk.0.w"], "rank-00000.safetensors");
        let acp = &v["metadata"]["acp"];
        assert_eq!(acp["format_version"], json!(FORMAT_VERSION));
        assert_eq!(acp["step"], json!(1200));
        assert_eq!(acp["world_size"], json!(3));
        let f = &acp["files"]["rank-00000.safetensors"];
        assert_eq!(f["rank"], json!(0));
        assert_eq!(f["size"], json!(10_000));
        assert_eq!(f["chunk_bytes"], json!(4096));
        assert_eq!(f["chunks"].as_array().unwrap().len(), 3);
        assert_eq!(f["root"].as_str().unwrap().len(), 64);
    }

    #[test]
    fn unsafe_file_names_are_refused() {
        let p = Path::new(PATH);
        let long = "a".repeat(256);
        for bad in [
            "../x",
            "..",
            ".",
            "/etc/passwd",
            "a/b",
            ".hidden",
            "a\0b",
            "",
            "a\\b",
            "é",
            "a b",
            &long,
        ] {
            let e = validate_file_name(p, bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{bad:?}");
            assert!(e.to_string().starts_with(PATH), "{e}");
        }
        for good in [
            "rank-00000.safetensors",
            "a",
            "A_b-c.d..e",
            &"a".repeat(255),
        ] {
            validate_file_name(p, good).unwrap();
        }
        assert_eq!(data_file_name(3), "rank-00003.safetensors");
        validate_file_name(p, &data_file_name(u32::MAX)).unwrap();
    }

    #[test]
    fn unsafe_file_names_in_the_index_are_refused() {
        for bad in ["../x", "/etc/passwd", "a/b", ".hidden", "a\u{0}b"] {
            let mut idx = sample();
            let f = idx.files.remove(&data_file_name(2)).unwrap();
            idx.files.insert(bad.to_owned(), f);
            refused(&idx.to_json(), "file name");
        }
    }

    #[test]
    fn weight_map_must_point_at_a_listed_file() {
        let mut idx = sample();
        idx.weight_map
            .insert("x".to_owned(), "rank-00009.safetensors".to_owned());
        let e = refused(&idx.to_json(), "does not list");
        assert!(e.to_string().contains("tensor `x`"), "{e}");
        let mut idx = sample();
        idx.weight_map
            .insert("x".to_owned(), "../../etc/passwd".to_owned());
        refused(&idx.to_json(), "does not list");
        let mut idx = sample();
        idx.weight_map.insert("a\0b".to_owned(), data_file_name(0));
        refused(&idx.to_json(), "NUL");
    }

    #[test]
    fn chunk_counts_must_match() {
        let mut idx = sample();
        let f = idx.files.get_mut(&data_file_name(0)).unwrap();
        f.chunks.pop();
        f.root = hex(&root_digest(
            &f.chunks
                .iter()
                .map(|c| unhex(c).unwrap())
                .collect::<Vec<_>>(),
        ));
        refused(
            &idx.to_json(),
            "2 chunk digests, but 10000 bytes in chunks of 4096 make 3",
        );

        let mut idx = sample();
        idx.files.get_mut(&data_file_name(1)).unwrap().size += 1;
        refused(&idx.to_json(), "make 2");

        let mut idx = sample();
        idx.files.get_mut(&data_file_name(1)).unwrap().chunk_bytes = 0;
        refused(&idx.to_json(), "`chunk_bytes` is 0");
    }

    #[test]
    fn digests_are_checked() {
        let mut idx = sample();
        idx.files.get_mut(&data_file_name(0)).unwrap().chunks[1] = "zz".repeat(32);
        refused(&idx.to_json(), "chunk digest 1 is not 64 hex digits");

        let mut idx = sample();
        idx.files.get_mut(&data_file_name(0)).unwrap().root = "0".repeat(64);
        refused(&idx.to_json(), "not the root digest");

        let mut idx = sample();
        idx.files.get_mut(&data_file_name(0)).unwrap().root = "0".repeat(63);
        refused(&idx.to_json(), "`root` is not 64 hex digits");

        // A chunk changed and the root recomputed over it still parses: the
        // index is self-consistent, and the data check is the loader's.
        let mut idx = sample();
        let f = idx.files.get_mut(&data_file_name(0)).unwrap();
        f.chunks[0] = "ab".repeat(32);
        f.root = hex(&root_digest(
            &f.chunks
                .iter()
                .map(|c| unhex(c).unwrap())
                .collect::<Vec<_>>(),
        ));
        parse(&idx.to_json()).unwrap();
    }

    /// `sample()` at version 3 with chunks 1..3 of file 0 referencing
    /// step 1000.
    fn with_refs() -> Index {
        let mut idx = sample();
        idx.format_version = INCREMENTAL_VERSION;
        let f = idx.files.get_mut(&data_file_name(0)).unwrap();
        f.stored_size = Some(500);
        f.refs = vec![ChunkRef {
            first: 1,
            count: 2,
            step: 1000,
            file: data_file_name(0),
        }];
        idx
    }

    #[test]
    fn references_round_trip_and_are_checked() {
        let idx = with_refs();
        assert_eq!(parse(&idx.to_json()).unwrap(), idx);
        let f = &idx.files[&data_file_name(0)];
        assert!(f.held_by(0).is_none());
        assert_eq!(f.held_by(2).unwrap().step, 1000);
        assert_eq!(f.referenced_chunks(), 2);
        assert_eq!(f.referenced_bytes(), 10_000 - 4096);

        let edit = |e: &dyn Fn(&mut Index)| {
            let mut idx = with_refs();
            e(&mut idx);
            idx.to_json()
        };
        fn file0(i: &mut Index) -> &mut FileEntry {
            i.files.get_mut(&data_file_name(0)).unwrap()
        }
        refused(
            &edit(&|i| i.format_version = COMPRESSED_VERSION),
            "in an index of format version 2",
        );
        refused(
            &edit(&|i| file0(i).stored_size = None),
            "is not a container",
        );
        refused(&edit(&|i| file0(i).refs[0].count = 0), "covers no chunk");
        refused(&edit(&|i| file0(i).refs[0].count = 3), "runs past");
        refused(
            &edit(&|i| file0(i).refs[0].step = 1200),
            "not an earlier step",
        );
        refused(
            &edit(&|i| file0(i).refs[0].file = "../x".to_owned()),
            "file name",
        );
        refused(
            &edit(&|i| {
                let r = file0(i).refs[0].clone();
                file0(i).refs.push(r);
            }),
            "before the previous one ends",
        );
    }

    #[test]
    fn newer_version_is_unsupported() {
        let next = FORMAT_VERSION + 1;
        let mut idx = sample();
        idx.format_version = next;
        let e = parse(&idx.to_json()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        assert!(e.to_string().contains(PATH), "{e}");

        // A newer index need not fit this build's schema at all.
        let v = json!({"metadata": {"acp": {"format_version": next, "shards": 7}}});
        let e = parse(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
        let v = json!({"metadata": {"acp": {"format_version": u64::MAX}}});
        let e = parse(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    }

    #[test]
    fn fields_are_checked() {
        refused(
            &edited(|v| {
                v["metadata"]["acp"].as_object_mut().unwrap().remove("step");
            }),
            "missing field `step`",
        );
        refused(
            &edited(|v| v["metadata"]["acp"]["world_size"] = json!(0)),
            "`metadata.acp.world_size` is 0",
        );
        refused(
            &edited(|v| v["metadata"]["acp"]["world_size"] = json!(2)),
            "rank 2 is not below the world size 2",
        );
        refused(
            &edited(|v| v["metadata"]["acp"]["format_version"] = json!(0)),
            "which no format uses",
        );
        refused(
            &edited(|v| v["metadata"]["total_size"] = json!(1)),
            "`metadata.total_size` is 1",
        );
        refused(
            &edited(|v| v["metadata"]["acp"]["step"] = json!(-1)),
            "not a valid acp index",
        );
        refused(
            &edited(|v| {
                v.as_object_mut().unwrap().remove("weight_map");
            }),
            "missing field `weight_map`",
        );
        // Unknown fields are ignored.
        let extra = edited(|v| v["metadata"]["other"] = json!({"x": 1}));
        assert_eq!(parse(&extra).unwrap(), sample());
    }

    #[test]
    fn malformed_json_is_refused() {
        refused(b"", "not a valid acp index");
        refused(b"[]", "not a valid acp index");
        refused(b"{\"metadata\": ", "not a valid acp index");
        refused(&[0xff, 0xfe], "not a valid acp index");
        let json = String::from_utf8(sample().to_json()).unwrap();
        let dup = json.replacen(
            "\"weight_map\": {",
            "\"weight_map\": {\n    \"blk.0.w\": \"rank-00001.safetensors\",",
            1,
        );
        refused(dup.as_bytes(), "key `blk.0.w` appears twice");
        let dup = json.replacen(
            "\"files\": {",
            "\"files\": {\n \"rank-00002.safetensors\": {\"rank\": 2, \"size\": 0, \"chunk_bytes\": 1, \"chunks\": [], \"root\": \"\"},",
            1,
        );
        refused(dup.as_bytes(), "appears twice");
    }

    #[test]
    fn every_truncation_is_refused() {
        let json = sample().to_json();
        // The last byte is a newline; dropping it leaves a valid index.
        for cut in 0..json.len() - 1 {
            assert!(parse(&json[..cut]).is_err(), "cut at {cut}");
        }
    }

    proptest! {
        #[test]
        fn random_indexes_round_trip(
            step in any::<u64>(),
            files in prop::collection::btree_map(
                "[A-Za-z0-9_-][A-Za-z0-9._-]{0,20}",
                (0u32..8, prop::collection::vec(any::<u8>(), 0..300), 1usize..100),
                0..5,
            ),
            tensors in prop::collection::vec("[^\u{0}]{1,12}", 0..10),
        ) {
            let names: Vec<String> = files.keys().cloned().collect();
            let files: BTreeMap<_, _> = files
                .into_iter()
                .map(|(name, (rank, data, chunk))| (name, entry(rank, &data, chunk)))
                .collect();
            let weight_map = if names.is_empty() {
                BTreeMap::new()
            } else {
                tensors
                    .into_iter()
                    .enumerate()
                    .map(|(i, t)| (t, names[i % names.len()].clone()))
                    .collect()
            };
            let idx = Index { step, world_size: 8, format_version: FORMAT_VERSION, files, weight_map };
            prop_assert_eq!(parse(&idx.to_json()).unwrap(), idx);
        }

        #[test]
        fn byte_flips_never_panic(at in any::<prop::sample::Index>(), x in 1u8..=255) {
            let mut json = sample().to_json();
            let i = at.index(json.len());
            json[i] ^= x;
            let _ = parse(&json);
        }
    }
}
