//! Planning the file image of one rank: header, tensor offsets, alignment.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashSet};

use serde::Serialize;

use super::json::{shown, too_deep};
use super::{Dtype, MAX_HEADER_BYTES, PLAIN_VERSION};
use crate::error::{Error, Result};

/// The data section starts at a multiple of this (for `O_DIRECT`).
pub const DATA_ALIGN: u64 = 4096;
/// The longest tensor name or value key, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;

/// The deepest nesting of JSON arrays and objects in `acp.values` that acp
/// writes or reads (a top-level array or object is at depth 1). A save
/// deeper than this is refused ([`check_values_json`]), a file deeper than
/// this is corrupt ([`parse_header`](super::parse_header)). It is the most
/// `serde_json`'s parser takes (its recursion limit is 128), so every
/// checkpoint an earlier build committed stays readable and nothing one
/// writes fails to parse.
pub const MAX_VALUES_DEPTH: usize = 127;

/// The key of the header's free-form string map.
pub(super) const METADATA_KEY: &str = "__metadata__";
/// Prefix of the `__metadata__` keys that acp owns.
pub(super) const ACP_PREFIX: &str = "acp.";
/// `__metadata__` key: the format version, decimal.
pub(super) const KEY_VERSION: &str = "acp.version";
/// `__metadata__` key: the step, decimal.
pub(super) const KEY_STEP: &str = "acp.step";
/// `__metadata__` key: the rank that wrote the file, decimal.
pub(super) const KEY_RANK: &str = "acp.rank";
/// `__metadata__` key: the number of ranks, decimal.
pub(super) const KEY_WORLD_SIZE: &str = "acp.world_size";
/// `__metadata__` key: the plain values, as compact JSON text.
pub(super) const KEY_VALUES: &str = "acp.values";

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
        byte_len(self.dtype, &self.shape).ok_or_else(|| {
            Error::invalid(
                tensor_label(&self.name),
                format!(
                    "shape {:?} of {} overflows a u64 byte size, or has a dimension past 2**63 - 1",
                    self.shape,
                    self.dtype.name()
                ),
            )
        })
    }
}

/// Elements × element size, `None` on overflow. An empty shape is one element.
/// A dimension past [`MAX_DIM`] is an overflow too, even in a shape of no
/// elements: no framework can make that tensor.
pub(super) fn byte_len(dtype: Dtype, shape: &[u64]) -> Option<u64> {
    if shape.iter().any(|&d| d > MAX_DIM) {
        return None;
    }
    shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))?
        .checked_mul(dtype.size_u64())
}

/// The largest dimension a shape may have: torch's and numpy's sizes are
/// signed 64-bit integers (a shape `[0, 2**63]` was accepted here, and
/// torch then failed to make it with an overflow error of its own).
const MAX_DIM: u64 = i64::MAX as u64;

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
    /// Total image length (`data_start` + all tensor bytes). Not padded.
    pub total_len: u64,
    header: Vec<u8>,
    /// Where the tensors' part of the header JSON starts (after the
    /// `__metadata__` value) and where the JSON ends, as offsets into
    /// `header`: [`Layout::restamp`] keeps those bytes.
    tensors_json: (usize, usize),
    /// Where the `acp.values` string literal (its quotes included) lies in
    /// `header`: a restamp with the same values copies it instead of
    /// escaping the text again (megabytes at 100,000 tensors).
    values_literal: (usize, usize),
    /// The header's `acp.version`: the newest [`Dtype::since`] of its
    /// tensors, [`PLAIN_VERSION`] for none.
    version: u32,
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
    /// [`Error::Invalid`](crate::Error::Invalid) naming the tensor or key at
    /// fault, or the path of a value nested deeper than [`MAX_VALUES_DEPTH`].
    pub fn plan(specs: &[TensorSpec], meta: &ImageMeta) -> Result<Layout> {
        let values = serde_json::to_string(&meta.values)
            .map_err(|e| Error::invalid("values", format!("cannot write them as JSON: {e}")))?;
        check_values_depth(&values)?;
        Self::plan_with_values(specs, meta, &values)
    }

    /// [`Layout::plan`] with the values given as JSON text (stored as given;
    /// `meta.values` is ignored). The text is checked to be one JSON value
    /// without building it: with many tensors, parsing the values into a
    /// [`serde_json::Value`] and writing them back would cost more than the
    /// rest of the plan.
    ///
    /// # Errors
    /// As [`Layout::plan`], and [`Error::Invalid`](crate::Error::Invalid)
    /// naming `values` when the text is not JSON.
    pub fn plan_json(specs: &[TensorSpec], meta: &ImageMeta, values_json: &str) -> Result<Layout> {
        check_values_json(values_json)?;
        Self::plan_with_values(specs, meta, values_json)
    }

    pub(crate) fn plan_with_values(
        specs: &[TensorSpec],
        meta: &ImageMeta,
        values: &str,
    ) -> Result<Layout> {
        let mut seen = HashSet::with_capacity(specs.len());
        let mut placed = Vec::with_capacity(specs.len());
        let mut version = PLAIN_VERSION;
        for (index, spec) in specs.iter().enumerate() {
            version = version.max(spec.dtype.since());
            check_name("tensor", &spec.name)?;
            if !seen.insert(spec.name.as_str()) {
                return Err(Error::invalid(
                    tensor_label(&spec.name),
                    "the name is given twice",
                ));
            }
            placed.push(Placed {
                index,
                spec,
                len: spec.byte_len()?,
                begin: 0,
            });
        }

        // Widest elements first; the sort is stable, so the caller's order
        // holds within one element size. Every length is a multiple of its
        // element size and sizes only shrink, so each begin is a multiple of
        // its own element size.
        placed.sort_by_key(|p| Reverse(p.spec.dtype.size()));
        let mut cursor = 0u64;
        for p in &mut placed {
            p.begin = cursor;
            cursor = cursor.checked_add(p.len).ok_or_else(|| {
                Error::invalid(
                    tensor_label(&p.spec.name),
                    "the data section overflows a u64 byte size",
                )
            })?;
        }

        let (mut json, values_literal) = metadata_start(meta, version, Values::Text(values), 0)?;
        let tensors_at = json.len();
        // The rest of the header's one JSON object: `,"name":{..}` per
        // tensor in offset order, then the closing brace.
        let write = |json: &mut Vec<u8>| -> serde_json::Result<()> {
            for p in &placed {
                json.push(b',');
                serde_json::to_writer(&mut *json, &p.spec.name)?;
                json.push(b':');
                serde_json::to_writer(
                    &mut *json,
                    &TensorJson {
                        dtype: p.spec.dtype.name(),
                        shape: &p.spec.shape,
                        // `begin + len` was checked when the cursor advanced.
                        data_offsets: [p.begin, p.begin + p.len],
                    },
                )?;
            }
            json.push(b'}');
            Ok(())
        };
        write(&mut json)
            .map_err(|e| Error::invalid("header", format!("cannot write the JSON: {e}")))?;
        let json_len = json.len();
        let (header, data_start) = padded_header(json)?;

        let total_len = data_start
            .checked_add(cursor)
            .ok_or_else(|| Error::invalid("image", "the file length overflows a u64 byte size"))?;
        // Every begin is at most `cursor`, so no offset below overflows.
        placed.sort_by_key(|p| p.index);
        let entries = placed
            .iter()
            .map(|p| Entry {
                name: p.spec.name.clone(),
                dtype: p.spec.dtype,
                shape: p.spec.shape.clone(),
                offset: data_start + p.begin,
                len: p.len,
            })
            .collect();

        Ok(Layout {
            entries,
            data_start,
            total_len,
            header,
            tensors_json: (tensors_at, json_len),
            values_literal,
            version,
        })
    }

    /// The same tensors, in the same places of the data section, under the
    /// header of another `meta` and `values` (JSON text, checked as by
    /// [`Layout::plan_json`]): what [`Layout::plan_json`] of this
    /// layout's specs gives, without walking the tensors again. Only the
    /// `__metadata__` value is written anew; the tensors' part of the JSON
    /// is kept, and each entry's offset moves with the data start.
    ///
    /// # Errors
    /// As [`Layout::plan`] for the metadata and the header's size.
    pub fn restamp(&self, meta: &ImageMeta, values: &str) -> Result<Layout> {
        let Restamped {
            header,
            data_start,
            tensors_json,
            values_literal,
        } = self.restamped_header(meta, Values::Text(values))?;
        let entries = self
            .entries
            .iter()
            .map(|e| Entry {
                name: e.name.clone(),
                dtype: e.dtype,
                shape: e.shape.clone(),
                // Every entry ends within the data section, and a data
                // start is at most the header limit: no overflow.
                offset: e.offset - self.data_start + data_start,
                len: e.len,
            })
            .collect();
        Ok(Layout {
            entries,
            data_start,
            // The data section keeps its length, checked when planned.
            total_len: self.total_len - self.data_start + data_start,
            header,
            tensors_json,
            values_literal,
            version: self.version,
        })
    }

    /// [`Layout::restamp`]'s header bytes and data start, for callers that
    /// keep the entries (their offsets move by the change of data start).
    ///
    /// # Errors
    /// As [`Layout::restamp`].
    pub fn restamp_header(&self, meta: &ImageMeta, values: &str) -> Result<(Vec<u8>, u64)> {
        let r = self.restamped_header(meta, Values::Text(values))?;
        Ok((r.header, r.data_start))
    }

    /// [`Layout::restamp_header`] with this layout's own values: the
    /// same bytes, with the values' escaped text copied from this header
    /// rather than written again.
    ///
    /// # Errors
    /// As [`Layout::restamp`].
    pub fn restamp_header_same_values(&self, meta: &ImageMeta) -> Result<(Vec<u8>, u64)> {
        let (from, to) = self.values_literal;
        let literal = Values::Literal(&self.header[from..to]);
        let r = self.restamped_header(meta, literal)?;
        Ok((r.header, r.data_start))
    }

    /// The header of `meta` and `values` over this layout's tensors.
    fn restamped_header(&self, meta: &ImageMeta, values: Values<'_>) -> Result<Restamped> {
        let (from, to) = self.tensors_json;
        let (mut json, values_literal) = metadata_start(meta, self.version, values, to - from)?;
        let tensors_at = json.len();
        json.extend_from_slice(&self.header[from..to]);
        let json_len = json.len();
        let (header, data_start) = padded_header(json)?;
        if data_start
            .checked_add(self.total_len - self.data_start)
            .is_none()
        {
            return Err(Error::invalid(
                "image",
                "the file length overflows a u64 byte size",
            ));
        }
        Ok(Restamped {
            header,
            data_start,
            tensors_json: (tensors_at, json_len),
            values_literal,
        })
    }

    /// The entries and the header bytes, taken apart.
    #[must_use]
    pub fn into_parts(self) -> (Vec<Entry>, Vec<u8>) {
        (self.entries, self.header)
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
    check_name("name", name)
}

/// The reason `name` is not a valid tensor name or value key, if it is not.
pub(super) fn name_problem(name: &str) -> Option<String> {
    if name.is_empty() {
        Some("the name is empty".to_owned())
    } else if name.contains('\0') {
        Some("the name contains a NUL byte".to_owned())
    } else if name.len() > MAX_NAME_BYTES {
        Some(format!(
            "the name is {} bytes long, more than the limit of {MAX_NAME_BYTES}",
            name.len()
        ))
    } else if name == METADATA_KEY {
        Some(format!("the name `{METADATA_KEY}` is reserved"))
    } else {
        None
    }
}

fn check_name(kind: &str, name: &str) -> Result<()> {
    match name_problem(name) {
        Some(reason) => Err(Error::invalid(format!("{kind} {}", shown(name)), reason)),
        None => Ok(()),
    }
}

fn tensor_label(name: &str) -> String {
    format!("tensor {}", shown(name))
}

/// Checks that `values_json` is one JSON value that a reader accepts: at
/// most [`MAX_VALUES_DEPTH`] arrays and objects deep. Nothing is built.
///
/// # Errors
/// [`Error::Invalid`](crate::Error::Invalid) naming `values`, or the path of
/// the first value nested too deep.
pub fn check_values_json(values_json: &str) -> Result<()> {
    serde_json::from_str::<serde::de::IgnoredAny>(values_json)
        .map_err(|e| Error::invalid("values", format!("not valid JSON: {e}")))?;
    check_values_depth(values_json)
}

/// Refuses values nested deeper than [`MAX_VALUES_DEPTH`], naming the path
/// of the first array or object past it.
fn check_values_depth(values_json: &str) -> Result<()> {
    match too_deep(values_json, MAX_VALUES_DEPTH) {
        None => Ok(()),
        Some(path) => Err(Error::invalid(
            if path.is_empty() {
                "values".to_owned()
            } else {
                format!("values at `{path}`")
            },
            format!(
                "nested deeper than {MAX_VALUES_DEPTH} levels of JSON arrays and objects, \
                 the most a checkpoint holds"
            ),
        )),
    }
}

/// The `__metadata__` map of an image.
fn metadata(meta: &ImageMeta, values: &str, version: u32) -> Result<BTreeMap<String, String>> {
    let mut map = BTreeMap::from([
        (KEY_VERSION.to_owned(), version.to_string()),
        (KEY_STEP.to_owned(), meta.step.to_string()),
        (KEY_RANK.to_owned(), meta.rank.to_string()),
        (KEY_WORLD_SIZE.to_owned(), meta.world_size.to_string()),
        (KEY_VALUES.to_owned(), values.to_owned()),
    ]);
    for (key, value) in &meta.extra {
        if key.starts_with(ACP_PREFIX) {
            return Err(Error::invalid(
                format!("metadata key {}", shown(key)),
                format!("the prefix `{ACP_PREFIX}` is reserved for acp"),
            ));
        }
        map.insert(key.clone(), value.clone());
    }
    Ok(map)
}

/// A tensor with its place in the data section.
struct Placed<'a> {
    /// Position in the caller's list.
    index: usize,
    spec: &'a TensorSpec,
    len: u64,
    /// Offset relative to the data start.
    begin: u64,
}

/// A header written anew over a layout's tensors: its bytes, its data
/// start, and where its tensors' JSON and its values literal lie in it.
struct Restamped {
    header: Vec<u8>,
    data_start: u64,
    tensors_json: (usize, usize),
    values_literal: (usize, usize),
}

/// The values of a header: JSON text to write as a string, or a string
/// literal already written (an earlier header's, quotes included).
#[derive(Clone, Copy)]
enum Values<'a> {
    Text(&'a str),
    Literal(&'a [u8]),
}

/// The header's start: room for its 8-byte length, then
/// `{"__metadata__":{..}` up to the first tensor (the tensors follow in
/// offset order, then the closing brace), with room for `more` bytes after
/// it; and where the `acp.values` string literal lies in it.
///
/// The metadata is written with empty values and the literal put in their
/// place: `"acp.values":""` occurs once in that text, since every key and
/// value is an escaped string (a `"` in one is written `\"`) and the key
/// is reserved to acp.
fn metadata_start(
    meta: &ImageMeta,
    version: u32,
    values: Values<'_>,
    more: usize,
) -> Result<(Vec<u8>, (usize, usize))> {
    const EMPTY_VALUES: &[u8] = b"\"acp.values\":\"\"";
    let cannot =
        |e: serde_json::Error| Error::invalid("header", format!("cannot write the JSON: {e}"));
    let mut short = Vec::with_capacity(256);
    short.push(b'{');
    serde_json::to_writer(&mut short, METADATA_KEY).map_err(cannot)?;
    short.push(b':');
    serde_json::to_writer(&mut short, &metadata(meta, "", version)?).map_err(cannot)?;
    let at = short
        .windows(EMPTY_VALUES.len())
        .position(|w| w == EMPTY_VALUES)
        .map(|p| p + EMPTY_VALUES.len() - 2)
        .ok_or_else(|| Error::invalid("header", "the metadata lost its values key"))?;
    let literal_len = match values {
        // Escapes lengthen it: the capacity is a guess, not a bound.
        Values::Text(t) => t.len() + t.len() / 8 + 2,
        Values::Literal(l) => l.len(),
    };
    let mut json = Vec::with_capacity(8 + short.len() + literal_len + more + DATA_ALIGN_USIZE);
    json.extend_from_slice(&[0; 8]);
    json.extend_from_slice(&short[..at]);
    let from = json.len();
    match values {
        Values::Text(t) => serde_json::to_writer(&mut json, t).map_err(cannot)?,
        Values::Literal(l) => json.extend_from_slice(l),
    }
    let to = json.len();
    json.extend_from_slice(&short[at + 2..]);
    Ok((json, (from, to)))
}

const DATA_ALIGN_USIZE: usize = DATA_ALIGN as usize;

/// The header bytes from `header`: its 8 bytes of room, then the JSON; the
/// length written into those 8 bytes (little-endian) and spaces added up
/// to the data start, a multiple of [`DATA_ALIGN`]; with the data start.
fn padded_header(mut header: Vec<u8>) -> Result<(Vec<u8>, u64)> {
    let json_len = header.len() - 8;
    let too_big = || {
        Error::invalid(
            "header",
            format!("{json_len} bytes of JSON exceed the limit of {MAX_HEADER_BYTES} bytes"),
        )
    };
    let data_start = u64::try_from(header.len())
        .ok()
        .and_then(|n| n.checked_next_multiple_of(DATA_ALIGN))
        .ok_or_else(too_big)?;
    let n = data_start - 8;
    if n > MAX_HEADER_BYTES {
        return Err(too_big());
    }
    let header_len = usize::try_from(data_start).map_err(|_| too_big())?;
    header[..8].copy_from_slice(&n.to_le_bytes());
    header.resize(header_len, b' ');
    Ok((header, data_start))
}

#[derive(Serialize)]
struct TensorJson<'a> {
    dtype: &'static str,
    shape: &'a [u64],
    data_offsets: [u64; 2],
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn spec(name: &str, dtype: Dtype, shape: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.to_owned(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    fn meta() -> ImageMeta {
        ImageMeta {
            step: 1200,
            rank: 3,
            world_size: 8,
            values: serde_json::json!({"lr": 0.5, "epoch": 2, "names": ["a", null]}),
            extra: BTreeMap::from([("format".to_owned(), "pt".to_owned())]),
        }
    }

    fn header_json(layout: &Layout) -> serde_json::Value {
        let n = u64::from_le_bytes(*layout.header_bytes().first_chunk::<8>().unwrap());
        let json = &layout.header_bytes()[8..8 + usize::try_from(n).unwrap()];
        serde_json::from_slice(json).unwrap()
    }

    fn invalid_what(e: &Error) -> &str {
        match e {
            Error::Invalid { what, .. } => what,
            other => panic!("not Invalid: {other}"),
        }
    }

    #[test]
    fn restamp_gives_what_a_fresh_plan_gives() {
        let specs = [
            spec("b", Dtype::U8, &[3]),
            spec("w", Dtype::F32, &[2, 3]),
            spec("h", Dtype::BF16, &[5]),
        ];
        let first = meta();
        let kept = Layout::plan(&specs, &first).unwrap();
        // Values long enough that the header crosses a DATA_ALIGN boundary
        // between the two steps: the data start moves, and every offset.
        let long = serde_json::json!("x".repeat(4000));
        for (step, values) in [(1201, first.values.clone()), (u64::MAX, long)] {
            let next = ImageMeta {
                step,
                values,
                extra: BTreeMap::from([("a".to_owned(), "b".to_owned())]),
                ..meta()
            };
            let text = serde_json::to_string(&next.values).unwrap();
            let want = Layout::plan(&specs, &next).unwrap();
            let got = kept.restamp(&next, &text).unwrap();
            assert_eq!(got.header_bytes(), want.header_bytes());
            assert_eq!(got.entries, want.entries);
            assert_eq!(
                (got.data_start, got.total_len),
                (want.data_start, want.total_len)
            );
            // Kept again from a restamped layout.
            let again = got.restamp(&first, &serde_json::to_string(&first.values).unwrap());
            assert_eq!(again.unwrap().header_bytes(), kept.header_bytes());
        }
    }

    #[test]
    fn a_restamp_with_the_same_values_gives_the_fresh_header() {
        let specs = [spec("w", Dtype::F32, &[2, 3]), spec("b", Dtype::U8, &[3])];
        // Values whose text needs escaping, and an extra value holding
        // what the values' key looks like in the metadata.
        let values = serde_json::json!({"q": "\"quoted\" \\ tab\t nl\n \u{1} é 👍", "n": [1, 2.5]});
        let extra = BTreeMap::from([
            ("a".to_owned(), r#""acp.values":"""#.to_owned()),
            ("zz".to_owned(), "last".to_owned()),
        ]);
        let at = |step, values: &serde_json::Value, extra: &BTreeMap<String, String>| ImageMeta {
            step,
            values: values.clone(),
            extra: extra.clone(),
            ..meta()
        };
        let kept = Layout::plan(&specs, &at(1, &values, &BTreeMap::new())).unwrap();
        let long = serde_json::json!("\"".repeat(3000));
        for (step, extra) in [(2, BTreeMap::new()), (u64::MAX - 1, extra)] {
            let next = at(step, &values, &extra);
            let want = Layout::plan(&specs, &next).unwrap();
            let (header, data_start) = kept.restamp_header_same_values(&next).unwrap();
            assert_eq!(header, want.header_bytes());
            assert_eq!(data_start, want.data_start);
            // Values that move the data start, kept and restamped again.
            let text = serde_json::to_string(&long).unwrap();
            let moved = kept.restamp(&at(step, &long, &extra), &text).unwrap();
            let want = Layout::plan(&specs, &at(step + 1, &long, &extra)).unwrap();
            let (header, data_start) = moved
                .restamp_header_same_values(&at(step + 1, &long, &extra))
                .unwrap();
            assert_eq!(
                (header.as_slice(), data_start),
                (want.header_bytes(), want.data_start)
            );
            assert!(data_start > kept.data_start);
        }
        assert_eq!(
            Layout::plan(
                &specs,
                &ImageMeta {
                    values: serde_json::json!("x".repeat(4000)),
                    ..meta()
                }
            )
            .unwrap()
            .data_start,
            8192
        );
    }

    #[test]
    fn restamp_without_tensors_and_refusing_metadata() {
        let kept = Layout::plan(&[], &meta()).unwrap();
        let next = ImageMeta { step: 7, ..meta() };
        let text = serde_json::to_string(&next.values).unwrap();
        let got = kept.restamp(&next, &text).unwrap();
        assert_eq!(
            got.header_bytes(),
            Layout::plan(&[], &next).unwrap().header_bytes()
        );
        let bad = ImageMeta {
            extra: BTreeMap::from([("acp.step".to_owned(), "1".to_owned())]),
            ..meta()
        };
        let e = kept.restamp(&bad, &text).unwrap_err();
        assert_eq!(invalid_what(&e), "metadata key `acp.step`");
    }

    #[test]
    fn orders_by_element_size_and_keeps_input_order() {
        let specs = [
            spec("b", Dtype::U8, &[3]),
            spec("w", Dtype::F32, &[2, 3]),
            spec("h", Dtype::BF16, &[5]),
            spec("d", Dtype::F64, &[1]),
            spec("v", Dtype::I32, &[1]),
        ];
        let l = Layout::plan(&specs, &meta()).unwrap();
        assert_eq!(l.data_start, 4096);
        assert_eq!(l.header_bytes().len(), 4096);
        let names: Vec<_> = l.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["b", "w", "h", "d", "v"]);
        let at = |name: &str| {
            let e = l.entries.iter().find(|e| e.name == name).unwrap();
            (e.offset - l.data_start, e.len)
        };
        assert_eq!(at("d"), (0, 8));
        assert_eq!(at("w"), (8, 24));
        assert_eq!(at("v"), (32, 4));
        assert_eq!(at("h"), (36, 10));
        assert_eq!(at("b"), (46, 3));
        assert_eq!(l.total_len, 4096 + 49);
    }

    #[test]
    fn a_tensor_of_a_newer_dtype_raises_the_files_version() {
        let version = |l: &Layout| {
            let json = header_json(l);
            json["__metadata__"]["acp.version"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        let plain = Layout::plan(&[spec("x", Dtype::F16, &[2])], &meta()).unwrap();
        assert_eq!(version(&plain), super::super::PLAIN_VERSION.to_string());
        for d in [
            Dtype::C64,
            Dtype::F8E4M3Fnuz,
            Dtype::F8E5M2Fnuz,
            Dtype::F8E8M0,
        ] {
            let specs = [spec("x", Dtype::F16, &[2]), spec("n", d, &[3])];
            let l = Layout::plan(&specs, &meta()).unwrap();
            let want = super::super::DTYPES_VERSION.to_string();
            assert_eq!(version(&l), want, "{}", d.name());
            // A restamp (a kept plan's next save) keeps it.
            let again = l.restamp(&meta(), "null").unwrap();
            assert_eq!(version(&again), want, "{}", d.name());
            let json = header_json(&l);
            assert_eq!(json["n"]["dtype"], d.name());
        }
        // A plain layout's restamp stays plain.
        let again = plain.restamp(&meta(), "null").unwrap();
        assert_eq!(version(&again), super::super::PLAIN_VERSION.to_string());
    }

    #[test]
    fn header_is_padded_json_with_acp_metadata() {
        let l = Layout::plan(&[spec("x", Dtype::F16, &[2, 2])], &meta()).unwrap();
        let h = l.header_bytes();
        let n = u64::from_le_bytes(*h.first_chunk::<8>().unwrap());
        assert_eq!(n + 8, l.data_start);
        assert_eq!(h.get(8), Some(&b'{'));
        assert_eq!(h.last(), Some(&b' '));
        let json = header_json(&l);
        let m = &json["__metadata__"];
        assert_eq!(m["acp.version"], super::super::PLAIN_VERSION.to_string());
        assert_eq!(m["acp.step"], "1200");
        assert_eq!(m["acp.rank"], "3");
        assert_eq!(m["acp.world_size"], "8");
        assert_eq!(m["format"], "pt");
        let values: serde_json::Value =
            serde_json::from_str(m["acp.values"].as_str().unwrap()).unwrap();
        assert_eq!(values, meta().values);
        assert_eq!(
            json["x"],
            serde_json::json!({"dtype": "F16", "shape": [2, 2], "data_offsets": [0, 8]})
        );
    }

    #[test]
    fn zero_d_and_zero_sized_tensors() {
        let specs = [
            spec("scalar", Dtype::F64, &[]),
            spec("empty", Dtype::F32, &[0, 7]),
            spec("empty1d", Dtype::U8, &[0]),
        ];
        let l = Layout::plan(&specs, &ImageMeta::default()).unwrap();
        assert_eq!(l.entries[0].len, 8);
        assert_eq!(l.entries[1].len, 0);
        assert_eq!(l.entries[2].len, 0);
        assert_eq!(l.total_len, l.data_start + 8);
        assert_eq!(header_json(&l)["scalar"]["shape"], serde_json::json!([]));
    }

    #[test]
    fn no_tensors_is_a_valid_plan() {
        let l = Layout::plan(&[], &ImageMeta::default()).unwrap();
        assert!(l.entries.is_empty());
        assert_eq!(l.total_len, l.data_start);
        assert_eq!(header_json(&l)["__metadata__"]["acp.values"], "null");
    }

    #[test]
    fn big_header_spills_to_the_next_page() {
        let specs: Vec<_> = (0..200)
            .map(|i| spec(&format!("layer.{i:04}.weight"), Dtype::BF16, &[64, 64]))
            .collect();
        let l = Layout::plan(&specs, &ImageMeta::default()).unwrap();
        assert!(l.data_start > 4096);
        assert_eq!(l.data_start % DATA_ALIGN, 0);
        assert_eq!(l.header_bytes().len() as u64, l.data_start);
    }

    #[test]
    fn names_are_checked() {
        let m = ImageMeta::default();
        for bad in ["", "a\0b", "__metadata__"] {
            let e = Layout::plan(&[spec(bad, Dtype::U8, &[1])], &m).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Invalid, "{bad:?}");
            assert!(invalid_what(&e).starts_with("tensor `"), "{e}");
        }
        let long = "x".repeat(MAX_NAME_BYTES + 1);
        let e = Layout::plan(&[spec(&long, Dtype::U8, &[1])], &m).unwrap_err();
        assert!(e.to_string().contains("more than the limit"), "{e}");
        let ok = "x".repeat(MAX_NAME_BYTES);
        Layout::plan(&[spec(&ok, Dtype::U8, &[1])], &m).unwrap();

        assert!(validate_name("blk.3.w").is_ok());
        assert!(validate_name("").is_err());
        assert!(validate_name("a\0").is_err());
        assert!(validate_name("__metadata__").is_err());
        assert!(validate_name(&long).is_err());
    }

    #[test]
    fn duplicate_name_is_named() {
        let specs = [
            spec("a", Dtype::U8, &[1]),
            spec("dup", Dtype::F32, &[1]),
            spec("dup", Dtype::U8, &[1]),
        ];
        let e = Layout::plan(&specs, &ImageMeta::default()).unwrap_err();
        assert_eq!(invalid_what(&e), "tensor `dup`");
        assert!(e.to_string().contains("twice"), "{e}");
    }

    #[test]
    fn reserved_extra_keys_are_refused() {
        let mut m = meta();
        m.extra.insert("acp.step".to_owned(), "7".to_owned());
        let e = Layout::plan(&[], &m).unwrap_err();
        assert_eq!(invalid_what(&e), "metadata key `acp.step`");
        let mut m = meta();
        m.extra.insert("acp.mine".to_owned(), "7".to_owned());
        assert!(Layout::plan(&[], &m).is_err());
        let mut m = meta();
        m.extra.insert("acpx".to_owned(), "7".to_owned());
        assert!(Layout::plan(&[], &m).is_ok());
    }

    #[test]
    fn size_overflow_names_the_tensor() {
        let s = spec("huge", Dtype::F32, &[u64::MAX / 2, 3]);
        let e = s.byte_len().unwrap_err();
        assert_eq!(invalid_what(&e), "tensor `huge`");
        let e = Layout::plan(&[s], &ImageMeta::default()).unwrap_err();
        assert_eq!(invalid_what(&e), "tensor `huge`");

        // Each fits, the sum does not (2**63 bytes each).
        let half = spec("half", Dtype::U8, &[2, 1 << 62]);
        let other = spec("other", Dtype::U8, &[2, 1 << 62]);
        let e = Layout::plan(&[half, other], &ImageMeta::default()).unwrap_err();
        assert_eq!(invalid_what(&e), "tensor `other`");

        // A dimension past 2**63 - 1, even with no elements.
        let e = spec("wide", Dtype::U8, &[0, 1 << 63])
            .byte_len()
            .unwrap_err();
        assert_eq!(invalid_what(&e), "tensor `wide`");

        // Data that fits in u64 but not once the header is added
        // (u64::MAX - 100 bytes).
        let near = spec("near", Dtype::U8, &[5, 3_689_348_814_741_910_303]);
        let e = Layout::plan(&[near], &ImageMeta::default()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid);
    }

    #[test]
    fn byte_len_counts_elements() {
        assert_eq!(spec("s", Dtype::F64, &[]).byte_len().unwrap(), 8);
        assert_eq!(spec("z", Dtype::F64, &[3, 0]).byte_len().unwrap(), 0);
        assert_eq!(spec("m", Dtype::BF16, &[3, 5]).byte_len().unwrap(), 30);
        assert_eq!(spec("b", Dtype::Bool, &[7]).byte_len().unwrap(), 7);
    }

    #[test]
    fn values_as_text_give_the_same_image_and_bad_text_is_refused() {
        let specs = [spec("w", Dtype::F32, &[2, 3]), spec("b", Dtype::F16, &[3])];
        let m = meta();
        let text = serde_json::to_string(&m.values).unwrap();
        let from_value = Layout::plan(&specs, &m).unwrap();
        let from_text = Layout::plan_json(
            &specs,
            &ImageMeta {
                values: serde_json::Value::Null,
                ..m.clone()
            },
            &text,
        )
        .unwrap();
        assert_eq!(from_value.header_bytes(), from_text.header_bytes());
        assert_eq!(from_value.entries, from_text.entries);

        for bad in ["", "{", "{} {}", "[1,]", "nan", "\"\\x\""] {
            let e = Layout::plan_json(&specs, &m, bad).unwrap_err();
            assert_eq!(invalid_what(&e), "values", "{bad:?}: {e}");
        }
    }
}
