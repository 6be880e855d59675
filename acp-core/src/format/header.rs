//! Parsing a safetensors header from untrusted bytes.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use serde_json::value::RawValue;
use serde_json::Value;

use super::json::{escaped, shown, too_deep, unique_entries, unique_map, Checked};
use super::layout::{
    byte_len, name_problem, KEY_RANK, KEY_STEP, KEY_VALUES, KEY_VERSION, KEY_WORLD_SIZE,
    METADATA_KEY,
};
use super::{Dtype, Entry, DATA_ALIGN, FORMAT_VERSION, MAX_VALUES_DEPTH};
use crate::error::{Error, Result};

/// The largest header accepted, in bytes. This is safetensors' own limit
/// (100 MB), so every header acp writes or reads is one safetensors reads.
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

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
    /// `acp.values` parsed, made on first use by [`ParsedHeader::values`]:
    /// a load that hands the values on as text (the Python binding, a
    /// restore of 100,000 tensors) never builds their tree.
    values: OnceLock<Value>,
    /// The positions of `entries` in name order, made on first use by
    /// [`ParsedHeader::by_name`]: a header kept for a resident slot is
    /// checked against the index at every load, sorted once.
    by_name: OnceLock<Vec<u32>>,
}

impl ParsedHeader {
    /// The positions in `entries` of each tensor, in name order; sorted on
    /// first use and kept (sorted again, not kept, should `entries` have
    /// changed length since: the engine never changes a header it checks).
    pub(crate) fn by_name(&self) -> Cow<'_, [u32]> {
        let sort = || {
            // Fewer than 2^32 entries: each takes more than a byte of a
            // header of at most `MAX_HEADER_BYTES`.
            let mut order: Vec<u32> = (0..self.entries.len() as u32).collect();
            order.sort_unstable_by(|&a, &b| {
                self.entries[a as usize]
                    .name
                    .cmp(&self.entries[b as usize].name)
            });
            order
        };
        let kept = self.by_name.get_or_init(sort);
        if kept.len() == self.entries.len() {
            Cow::Borrowed(kept)
        } else {
            Cow::Owned(sort())
        }
    }

    /// `acp.values` parsed, `Null` when absent.
    #[must_use]
    pub fn values(&self) -> &Value {
        self.values.get_or_init(|| {
            // `parse_header` parsed the same text with the same parser
            // (and the same recursion limit), so this does not fail; were
            // it to, no values is what a reader that cannot read them sees.
            self.values_text()
                .and_then(|text| serde_json::from_str(text).ok())
                .unwrap_or(Value::Null)
        })
    }

    /// `acp.values` as stored (JSON text, checked by [`parse_header`]),
    /// when present.
    #[must_use]
    pub fn values_text(&self) -> Option<&str> {
        self.metadata.get(KEY_VALUES).map(String::as_str)
    }
}

/// The bytes of the length prefix that starts every safetensors file.
pub const PREFIX_BYTES: u64 = 8;

/// Where the header stated by `prefix` (the file's first
/// [`PREFIX_BYTES`], little-endian) ends: the data start, `8 + N`. An
/// untrusted prefix may state any length; this saturates rather than
/// overflows, and [`parse_header`] refuses what is past its limits.
#[must_use]
pub fn header_end(prefix: [u8; 8]) -> u64 {
    u64::from_le_bytes(prefix).saturating_add(PREFIX_BYTES)
}

/// Reads the header of a source of `len` bytes through `read_at(buf,
/// offset)` (which fills `buf` from `offset` or fails) and parses it with
/// [`parse_header`]: the prefix first, then exactly the header it states.
/// Nothing is verified against digests here; this is for files that have
/// none (an import's input) and for best-effort reads (naming the tensors
/// of a chunk known to be bad, a slot's summary). `path` only labels
/// errors.
///
/// # Errors
/// [`Error::Corrupt`](crate::Error::Corrupt) for a header longer than
/// `max` bytes and whatever [`parse_header`] refuses; the errors of
/// `read_at`.
pub fn read_header(
    path: &Path,
    len: u64,
    max: u64,
    mut read_at: impl FnMut(&mut [u8], u64) -> Result<()>,
) -> Result<ParsedHeader> {
    let mut prefix = [0u8; 8];
    let have = usize::try_from(len.min(PREFIX_BYTES)).unwrap_or(0);
    read_at(&mut prefix[..have], 0)?;
    let end = header_end(prefix);
    if len < PREFIX_BYTES || end - PREFIX_BYTES > MAX_HEADER_BYTES || end > len {
        // Too short, too long or past the end: the prefix alone says why.
        return parse_header(path, &prefix[..have], len);
    }
    if end - PREFIX_BYTES > max {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "header of {} bytes is past the limit of {max} read here",
                end - PREFIX_BYTES
            ),
        ));
    }
    let mut bytes = vec![0u8; usize::try_from(end).unwrap_or(0)];
    read_at(&mut bytes, 0)?;
    parse_header(path, &bytes, len)
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
/// As safetensors does, it also refuses a key given twice, gaps between
/// tensors, and bytes after the last tensor: the tensors must cover the data
/// section exactly, so `file_len` must be the file's true length. A file that
/// carries `acp.version` must also keep acp's alignment: the data section
/// starts at a multiple of [`DATA_ALIGN`](super::DATA_ALIGN) and each tensor
/// at a multiple of its element size.
///
/// # Errors
/// [`Error::Corrupt`](crate::Error::Corrupt) naming the file and the tensor,
/// [`Error::Unsupported`](crate::Error::Unsupported) for a newer format version.
pub fn parse_header(path: &Path, bytes: &[u8], file_len: u64) -> Result<ParsedHeader> {
    parse_header_with(path, bytes, file_len, true).map(|(h, _)| h)
}

/// [`parse_header`], also returning where the `__metadata__` value lies in
/// `bytes` (its length prefix counted), when the header has one: what
/// [`parse_header_like`] needs of a header it starts from.
///
/// # Errors
/// As [`parse_header`].
pub(crate) fn parse_header_spanned(
    path: &Path,
    bytes: &[u8],
    file_len: u64,
) -> Result<(ParsedHeader, Option<std::ops::Range<usize>>)> {
    parse_header_with(path, bytes, file_len, true)
}

/// [`parse_header_spanned`] of `bytes` (an image of `file_len` bytes) when
/// its header is `kept` (parsed from `kept_bytes`, the image up to its
/// data section, whose `__metadata__` value lies at `span`) but for that
/// value and the header's trailing whitespace: the same data start, and
/// every byte before the value and after it (to the trailing whitespace)
/// the same. Such a header is `kept`'s tensors with the new metadata, which
/// alone is read and checked, as [`parse_header`] reads and checks it (a
/// JSON value put in place of another JSON value leaves the document valid
/// and every other part of it the same); each save of a kept plan writes
/// such a header (its step and values change), and a header of 100,000
/// tensors costs a hundred milliseconds to parse whole. `None` when the
/// headers differ otherwise, or the new value is no complete JSON value,
/// or the format version appears in one metadata and not the other (it
/// changes how tensors are placed): the caller parses the header whole.
///
/// # Errors
/// As [`parse_header`], for the new metadata.
pub(crate) fn parse_header_like(
    path: &Path,
    bytes: &[u8],
    file_len: u64,
    kept: (&ParsedHeader, &[u8], std::ops::Range<usize>),
) -> Option<Result<(ParsedHeader, std::ops::Range<usize>)>> {
    let (kept, kept_bytes, span) = kept;
    let (data_start, text) = header_text(path, bytes, file_len).ok()?;
    let kept_text = std::str::from_utf8(kept_bytes.get(PREFIX_BYTES as usize..)?).ok()?;
    if data_start != kept.data_start || text.len() != kept_text.len() {
        return None;
    }
    let (start, end) = (
        span.start.checked_sub(PREFIX_BYTES as usize)?,
        span.end.checked_sub(PREFIX_BYTES as usize)?,
    );
    if text.get(..start)? != kept_text.get(..start)? {
        return None;
    }
    let mut de = serde_json::Deserializer::from_str(text.get(start..)?);
    let raw: &RawValue = serde::Deserialize::deserialize(&mut de).ok()?;
    let value = span_in(text, raw);
    let value_end = value.end - PREFIX_BYTES as usize;
    let json_space = |c: char| matches!(c, ' ' | '\t' | '\n' | '\r');
    let kept_rest = kept_text.get(end..)?.trim_end_matches(json_space);
    let rest = text.get(value_end..)?;
    if !rest.starts_with(kept_rest) || !rest[kept_rest.len()..].chars().all(json_space) {
        return None;
    }
    let metadata = match metadata_map(path, Some(raw)) {
        Ok(m) => m,
        Err(e) => return Some(Err(e)),
    };
    let acp = match AcpFields::read(path, &metadata) {
        Ok(a) => a,
        Err(e) => return Some(Err(e)),
    };
    if acp.version.is_some() != kept.metadata.contains_key(KEY_VERSION) {
        return None;
    }
    let by_name = OnceLock::new();
    if let Some(order) = kept.by_name.get() {
        let _ = by_name.set(order.clone());
    }
    let header = ParsedHeader {
        data_start,
        entries: kept.entries.clone(),
        metadata,
        step: acp.step,
        values: OnceLock::new(),
        by_name,
    };
    Some(Ok((header, value)))
}

/// Where `raw`, borrowed from the header text `text`, lies in the header's
/// bytes (its length prefix counted).
fn span_in(text: &str, raw: &RawValue) -> std::ops::Range<usize> {
    let at = raw.get().as_ptr() as usize - text.as_ptr() as usize + PREFIX_BYTES as usize;
    at..at + raw.get().len()
}

/// [`parse_header`], trying the one-pass read of a well-formed header
/// first when `quick` (the tests compare it with the checked path alone).
fn parse_header_with(
    path: &Path,
    bytes: &[u8],
    file_len: u64,
    quick: bool,
) -> Result<(ParsedHeader, Option<std::ops::Range<usize>>)> {
    let (data_start, text) = header_text(path, bytes, file_len)?;
    let span_of = |raw: &RawValue| span_in(text, raw);
    let Read {
        metadata,
        acp,
        stated,
        metadata_span,
    } = match quick.then(|| quick_entries(text)).flatten() {
        Some(quick) => {
            let metadata_span = quick.metadata.map(span_of);
            let metadata = metadata_map(path, quick.metadata)?;
            let acp = AcpFields::read(path, &metadata)?;
            let stated: Option<Vec<Stated>> = quick
                .tensors
                .into_iter()
                .map(|(name, f)| {
                    let (dtype, shape, len, begin, end) = well_formed_fields(&name, f)?;
                    Some(Stated::new(name, dtype, shape, len, begin, end))
                })
                .collect();
            match stated {
                Some(stated) => Read {
                    metadata,
                    acp,
                    stated,
                    metadata_span,
                },
                // An entry a check refuses: the checked path names it.
                None => checked_entries(path, text, span_of)?,
            }
        }
        None => checked_entries(path, text, span_of)?,
    };
    let entries = place(path, stated, data_start, file_len, acp.version.is_some())?;
    if acp.version.is_some() && data_start % DATA_ALIGN != 0 {
        return Err(Error::corrupt(
            path,
            None,
            format!("data section starts at {data_start}, not a multiple of {DATA_ALIGN}"),
        ));
    }

    let header = ParsedHeader {
        data_start,
        entries,
        metadata,
        step: acp.step,
        values: OnceLock::new(),
        by_name: OnceLock::new(),
    };
    Ok((header, metadata_span))
}

/// The metadata map, the acp fields and the tensors of a header's JSON
/// `text`, each entry checked on its own and every problem named (the
/// metadata first: a newer version is unsupported whatever its tensors).
/// Each entry stays text until it is checked, one at a time: a header of
/// 100,000 tensors never exists as a tree of JSON values.
fn checked_entries(
    path: &Path,
    text: &str,
    span_of: impl Fn(&RawValue) -> std::ops::Range<usize>,
) -> Result<Read> {
    let mut de = serde_json::Deserializer::from_str(text);
    let mut fields: Vec<(String, &RawValue)> = unique_entries(&mut de)
        .and_then(|m| de.end().map(|()| m))
        .map_err(|e| {
            Error::corrupt(
                path,
                None,
                format!("header is not a valid JSON object: {e}"),
            )
        })?;
    let metadata_raw = fields
        .iter()
        .position(|(k, _)| k == METADATA_KEY)
        .map(|at| fields.remove(at).1);
    let metadata_span = metadata_raw.map(span_of);
    let metadata = metadata_map(path, metadata_raw)?;
    let acp = AcpFields::read(path, &metadata)?;
    let mut stated = Vec::with_capacity(fields.len());
    for (name, raw) in fields {
        stated.push(match well_formed(&name, raw) {
            Some((dtype, shape, len, begin, end)) => {
                Stated::new(name, dtype, shape, len, begin, end)
            }
            // What is wrong, found by the checks one field at a time.
            None => tensor(path, name, raw)?,
        });
    }
    Ok(Read {
        metadata,
        acp,
        stated,
        metadata_span,
    })
}

/// What [`parse_header`] reads of a header before placing its tensors.
struct Read {
    metadata: BTreeMap<String, String>,
    acp: AcpFields,
    stated: Vec<Stated>,
    /// Where the `__metadata__` value lies in the header's bytes.
    metadata_span: Option<std::ops::Range<usize>>,
}

/// A header's `__metadata__` text and its tensors' fields, as
/// [`quick_entries`] reads them.
struct Quick<'a> {
    metadata: Option<&'a RawValue>,
    tensors: Vec<(String, Fields<'a>)>,
}

/// `__metadata__` (its JSON text, when present) as a string map.
fn metadata_map(path: &Path, raw: Option<&RawValue>) -> Result<BTreeMap<String, String>> {
    Ok(match raw.map(|raw| value(path, None, raw)) {
        None => BTreeMap::new(),
        Some(v) => match v? {
            Value::Null => BTreeMap::new(),
            v => string_map(path, v)?,
        },
    })
}

/// A header's `__metadata__` text and its tensors' fields, read in one
/// pass, when the header is a JSON object of well-formed entries (each
/// name once, each entry exactly `dtype`, `shape` and `data_offsets`, a
/// dtype without escapes); None for anything else, which
/// [`checked_entries`] then reads and names. The fields are not checked
/// here ([`well_formed_fields`] does that).
fn quick_entries(text: &str) -> Option<Quick<'_>> {
    let mut de = serde_json::Deserializer::from_str(text);
    let quick = serde::Deserializer::deserialize_map(&mut de, QuickEntries).ok()?;
    de.end().ok()?;
    let mut seen = std::collections::HashSet::with_capacity(quick.tensors.len());
    quick
        .tensors
        .iter()
        .all(|(name, _)| seen.insert(name.as_str()))
        .then_some(quick)
}

/// The visitor of [`quick_entries`]: the metadata kept as text, each
/// other entry parsed into its fields; any surprise is an error.
struct QuickEntries;

impl<'de> serde::de::Visitor<'de> for QuickEntries {
    type Value = Quick<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a header of well-formed entries")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut metadata = None;
        let mut tensors = Vec::with_capacity(map.size_hint().unwrap_or(0));
        while let Some(key) = map.next_key::<String>()? {
            if key == METADATA_KEY {
                if metadata.is_some() {
                    return Err(serde::de::Error::custom("`__metadata__` twice"));
                }
                metadata = Some(map.next_value::<&RawValue>()?);
            } else {
                tensors.push((key, map.next_value::<Fields<'de>>()?));
            }
        }
        Ok(Quick { metadata, tensors })
    }
}

/// One header entry's JSON text (already checked to be valid JSON) as a value.
fn value(path: &Path, tensor: Option<&str>, raw: &RawValue) -> Result<Value> {
    serde_json::from_str(raw.get())
        .map_err(|e| Error::corrupt(path, tensor, format!("header entry is not valid JSON: {e}")))
}

/// Reads the header length and returns the data start and the header text.
fn header_text<'a>(path: &Path, bytes: &'a [u8], file_len: u64) -> Result<(u64, &'a str)> {
    let corrupt = |reason: String| Error::corrupt(path, None, reason);
    if file_len < 8 {
        return Err(corrupt(format!(
            "file of {file_len} bytes is too short for a safetensors header"
        )));
    }
    let Some(prefix) = bytes.first_chunk::<8>() else {
        return Err(corrupt(format!(
            "only {} bytes read, too few for the header length",
            bytes.len()
        )));
    };
    let n = header_end(*prefix) - PREFIX_BYTES;
    if n > MAX_HEADER_BYTES {
        return Err(corrupt(format!(
            "header length {n} exceeds the limit of {MAX_HEADER_BYTES} bytes"
        )));
    }
    // n <= MAX_HEADER_BYTES, so this cannot overflow.
    let data_start = n + 8;
    if data_start > file_len {
        return Err(corrupt(format!(
            "header length {n} past the end of the file ({file_len} bytes)"
        )));
    }
    let json = usize::try_from(data_start)
        .ok()
        .and_then(|end| bytes.get(8..end))
        .ok_or_else(|| {
            corrupt(format!(
                "header length {n} past the end of the {} bytes read",
                bytes.len()
            ))
        })?;
    let text =
        std::str::from_utf8(json).map_err(|e| corrupt(format!("header is not UTF-8: {e}")))?;
    if !text.starts_with('{') {
        return Err(corrupt("header does not start with `{`".to_owned()));
    }
    Ok((data_start, text))
}

/// Sorts the tensors by offset, checks that they cover the data section
/// exactly (no overlap, no gap, nothing after the last), and makes their
/// offsets absolute. With `aligned`, each must sit at a multiple of its
/// element size.
fn place(
    path: &Path,
    mut stated: Vec<Stated>,
    data_start: u64,
    file_len: u64,
    aligned: bool,
) -> Result<Vec<Entry>> {
    // By (begin, end): a zero-length tensor sorts before the one that
    // starts where it sits.
    stated.sort_by_key(|t| (t.begin, t.end));

    let mut cursor = 0u64;
    let mut previous: Option<&str> = None;
    for t in &stated {
        let name = Some(t.entry.name.as_str());
        let (begin, end) = (t.begin, t.end);
        if begin < cursor {
            let other = previous.map_or_else(String::new, |p| format!(" `{p}`"));
            return Err(Error::corrupt(
                path,
                name,
                format!(
                    "data_offsets [{begin}, {end}] overlap the previous tensor{other}, which ends at {cursor}"
                ),
            ));
        }
        if begin > cursor {
            return Err(Error::corrupt(
                path,
                name,
                format!(
                    "data_offsets [{begin}, {end}] leave a gap of {} bytes after offset {cursor}",
                    begin - cursor
                ),
            ));
        }
        if data_start.checked_add(end).is_none_or(|e| e > file_len) {
            return Err(Error::corrupt(
                path,
                name,
                format!(
                    "data_offsets [{begin}, {end}] past the end of the file ({file_len} bytes, data from {data_start})"
                ),
            ));
        }
        cursor = end;
        previous = name;
    }
    // The loop checked `data_start + cursor <= file_len` for the last tensor.
    let data_end = data_start + cursor;
    if data_end != file_len {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "{} bytes after the last tensor, which ends at {data_end}",
                file_len - data_end
            ),
        ));
    }

    let mut entries = Vec::with_capacity(stated.len());
    for t in stated {
        let mut e = t.entry;
        // `data_start + end` was checked above and `begin <= end`.
        e.offset = data_start + t.begin;
        if aligned && e.offset % e.dtype.size_u64() != 0 {
            return Err(Error::corrupt(
                path,
                Some(&e.name),
                format!(
                    "offset {} is not a multiple of the {}-byte element size",
                    e.offset,
                    e.dtype.size()
                ),
            ));
        }
        entries.push(e);
    }
    Ok(entries)
}

/// The acp fields of `__metadata__`, each checked when present (the
/// values too, kept as text: [`ParsedHeader::values`]).
struct AcpFields {
    version: Option<u32>,
    step: Option<u64>,
}

impl AcpFields {
    fn read(path: &Path, metadata: &BTreeMap<String, String>) -> Result<AcpFields> {
        let version: Option<u32> = number(path, metadata, KEY_VERSION)?;
        if let Some(v) = version {
            if v > FORMAT_VERSION {
                return Err(Error::Unsupported {
                    what: path.display().to_string(),
                    reason: format!(
                        "format version {v} is newer than {FORMAT_VERSION}, the newest this build reads"
                    ),
                });
            }
            if v == 0 {
                return Err(Error::corrupt(
                    path,
                    None,
                    format!("`__metadata__.{KEY_VERSION}` is 0, which no format uses"),
                ));
            }
        }
        let step = number::<u64>(path, metadata, KEY_STEP)?;
        number::<u32>(path, metadata, KEY_RANK)?;
        number::<u32>(path, metadata, KEY_WORLD_SIZE)?;
        if let Some(text) = metadata.get(KEY_VALUES) {
            // Checked as `values()` will parse it, building nothing. The
            // parser's recursion limit is [`MAX_VALUES_DEPTH`] levels, so
            // what it takes is no deeper; only text it refuses is walked
            // again, for the path where the values go too deep (the error
            // then names it rather than the parser's limit).
            if let Err(e) = serde_json::from_str::<Checked>(text) {
                if let Some(at) = too_deep(text, MAX_VALUES_DEPTH) {
                    return Err(Error::corrupt(
                        path,
                        None,
                        format!(
                            "`__metadata__.{KEY_VALUES}` nests deeper than {MAX_VALUES_DEPTH} \
                             levels of arrays and objects (at `{at}`)"
                        ),
                    ));
                }
                return Err(Error::corrupt(
                    path,
                    None,
                    format!("`__metadata__.{KEY_VALUES}` is not valid JSON: {e}"),
                ));
            }
        }
        Ok(AcpFields { version, step })
    }
}

/// Parses `metadata[key]` as a decimal number, when present.
fn number<T: std::str::FromStr>(
    path: &Path,
    metadata: &BTreeMap<String, String>,
    key: &str,
) -> Result<Option<T>> {
    let Some(text) = metadata.get(key) else {
        return Ok(None);
    };
    // `str::parse` takes a leading `+`; the format writes bare digits.
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Error::corrupt(
            path,
            None,
            format!(
                "`__metadata__.{key}` is {}, not a decimal number",
                shown(text)
            ),
        ));
    }
    text.parse().map(Some).map_err(|_| {
        Error::corrupt(
            path,
            None,
            format!("`__metadata__.{key}` is {}, out of range", shown(text)),
        )
    })
}

/// `__metadata__` as a string → string map.
fn string_map(path: &Path, value: Value) -> Result<BTreeMap<String, String>> {
    let Value::Object(object) = value else {
        return Err(Error::corrupt(
            path,
            None,
            format!("`{METADATA_KEY}` is not a JSON object"),
        ));
    };
    let mut map = BTreeMap::new();
    for (key, v) in object {
        let Value::String(s) = v else {
            return Err(Error::corrupt(
                path,
                None,
                format!("`{METADATA_KEY}` key {} holds a non-string", shown(&key)),
            ));
        };
        map.insert(key, s);
    }
    Ok(map)
}

/// A header entry's fields as a well-formed one has them, read straight
/// from its text (no tree of JSON values per entry: a header may list
/// 100,000 tensors).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Fields<'a> {
    dtype: &'a str,
    shape: Vec<u64>,
    data_offsets: (u64, u64),
}

/// The dtype, shape, byte length and data offsets of tensor `name`'s entry
/// `raw` when every check of [`tensor`] passes it; None when one fails (or
/// its text takes a path this one does not: an escaped dtype), for
/// [`tensor`] to say which.
fn well_formed(name: &str, raw: &RawValue) -> Option<(Dtype, Vec<u64>, u64, u64, u64)> {
    well_formed_fields(name, serde_json::from_str(raw.get()).ok()?)
}

/// [`well_formed`] of an entry's fields, already read.
fn well_formed_fields(name: &str, f: Fields<'_>) -> Option<(Dtype, Vec<u64>, u64, u64, u64)> {
    let dtype = Dtype::from_name(f.dtype)?;
    let len = byte_len(dtype, &f.shape)?;
    let (begin, end) = f.data_offsets;
    if name_problem(name).is_some() || begin > end || end - begin != len {
        return None;
    }
    Some((dtype, f.shape, len, begin, end))
}

/// One tensor as the header states it, offsets relative to the data start.
struct Stated {
    entry: Entry,
    begin: u64,
    end: u64,
}

impl Stated {
    fn new(name: String, dtype: Dtype, shape: Vec<u64>, len: u64, begin: u64, end: u64) -> Self {
        Stated {
            entry: Entry {
                name,
                dtype,
                shape,
                offset: 0,
                len,
            },
            begin,
            end,
        }
    }
}

/// Checks one tensor's header entry on its own, naming what is wrong.
fn tensor(path: &Path, name: String, raw: &RawValue) -> Result<Stated> {
    if let Some(reason) = name_problem(&name) {
        return Err(Error::corrupt(path, Some(&escaped(&name)), reason));
    }
    let value = value(path, Some(&name), raw)?;
    let bad = |reason: String| Error::corrupt(path, Some(&name), reason);
    let Value::Object(mut fields) = value else {
        return Err(bad("header entry is not a JSON object".to_owned()));
    };
    // A field given twice: a `Value` keeps the last, safetensors refuses.
    unique_map::<_, &RawValue>(&mut serde_json::Deserializer::from_str(raw.get()))
        .map_err(|e| bad(format!("header entry is not valid JSON: {e}")))?;

    let dtype = match fields.remove("dtype") {
        Some(Value::String(s)) => {
            Dtype::from_name(&s).ok_or_else(|| bad(format!("unknown dtype {}", shown(&s))))?
        }
        Some(_) => return Err(bad("`dtype` is not a string".to_owned())),
        None => return Err(bad("`dtype` is missing".to_owned())),
    };

    let shape = match fields.remove("shape") {
        Some(Value::Array(dims)) => {
            let mut shape = Vec::with_capacity(dims.len());
            for d in &dims {
                shape.push(d.as_u64().ok_or_else(|| {
                    bad(format!("shape dimension {d} is not a non-negative integer"))
                })?);
            }
            shape
        }
        Some(_) => return Err(bad("`shape` is not an array".to_owned())),
        None => return Err(bad("`shape` is missing".to_owned())),
    };
    let len = byte_len(dtype, &shape).ok_or_else(|| {
        bad(format!(
            "shape {shape:?} of {} overflows a u64 byte size, or has a dimension past 2**63 - 1",
            dtype.name()
        ))
    })?;

    let (begin, end) = match fields.remove("data_offsets") {
        Some(Value::Array(pair)) => match pair.as_slice() {
            [b, e] => match (b.as_u64(), e.as_u64()) {
                (Some(b), Some(e)) => (b, e),
                _ => {
                    return Err(bad(
                        "`data_offsets` are not non-negative integers".to_owned()
                    ))
                }
            },
            _ => return Err(bad("`data_offsets` is not a pair".to_owned())),
        },
        Some(_) => return Err(bad("`data_offsets` is not an array".to_owned())),
        None => return Err(bad("`data_offsets` is missing".to_owned())),
    };
    if begin > end {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] end before they begin"
        )));
    }
    if end - begin != len {
        return Err(bad(format!(
            "data_offsets [{begin}, {end}] hold {} bytes, but shape {shape:?} of {} needs {len}",
            end - begin,
            dtype.name()
        )));
    }
    if let Some(key) = fields.keys().next() {
        return Err(bad(format!("unknown field {}", shown(key))));
    }

    Ok(Stated::new(name, dtype, shape, len, begin, end))
}

#[cfg(test)]
#[path = "header_tests.rs"]
mod tests;

#[cfg(test)]
mod prefix_tests {
    use std::path::Path;

    use super::read_header;
    use crate::error::Result;

    fn from(bytes: &[u8], max: u64) -> Result<super::ParsedHeader> {
        read_header(Path::new("f"), bytes.len() as u64, max, |buf, at| {
            let at = usize::try_from(at).unwrap();
            buf.copy_from_slice(&bytes[at..at + buf.len()]);
            Ok(())
        })
    }

    #[test]
    fn reads_the_stated_header_only() {
        let mut file = 2u64.to_le_bytes().to_vec();
        file.extend_from_slice(b"{}");
        assert!(from(&file, 1 << 20).unwrap().entries.is_empty());
        // Longer than the caller reads: refused before reading it.
        let e = from(&file, 1).unwrap_err().to_string();
        assert!(e.contains("past the limit of 1"), "{e}");
        // Past the end, or too short for a prefix: the parser's reasons.
        let e = from(&file[..9], 1 << 20).unwrap_err().to_string();
        assert!(e.contains("past the end of the file"), "{e}");
        let e = from(&file[..4], 1 << 20).unwrap_err().to_string();
        assert!(e.contains("too short"), "{e}");
    }
}
