//! Tests of the header parser on hostile input.

use proptest::prelude::*;

use super::*;
use crate::format::{check_values_json, ImageMeta, Layout, TensorSpec};
use crate::ErrorKind;

const PATH: &str = "/c/step-000000001200/rank-00003.safetensors";

fn parse(bytes: &[u8]) -> Result<ParsedHeader> {
    parse_header(Path::new(PATH), bytes, bytes.len() as u64)
}

/// A file with the header `json` (unpadded) and `data_len` zero bytes.
fn raw(json: &str, data_len: usize) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.resize(out.len() + data_len, 0);
    out
}

/// A valid acp image with a few tensors and random-looking data.
fn image() -> (Layout, Vec<u8>) {
    let specs = [
        TensorSpec {
            name: "w".to_owned(),
            dtype: Dtype::F32,
            shape: vec![4, 3],
        },
        TensorSpec {
            name: "b".to_owned(),
            dtype: Dtype::BF16,
            shape: vec![3],
        },
        TensorSpec {
            name: "s".to_owned(),
            dtype: Dtype::I64,
            shape: vec![],
        },
        TensorSpec {
            name: "z".to_owned(),
            dtype: Dtype::U8,
            shape: vec![0],
        },
    ];
    let meta = ImageMeta {
        step: 1200,
        rank: 3,
        world_size: 4,
        values: serde_json::json!({"epoch": 3, "rng": [1, 2, 3]}),
        extra: BTreeMap::new(),
    };
    let l = Layout::plan(&specs, &meta).unwrap();
    let mut bytes = l.header_bytes().to_vec();
    let data_len = usize::try_from(l.total_len - l.data_start).unwrap();
    bytes.extend((0..data_len).map(|i| u8::try_from(i * 37 % 251).unwrap()));
    (l, bytes)
}

fn corrupt_tensor(e: &Error) -> Option<&str> {
    match e {
        Error::Corrupt { path, tensor, .. } => {
            assert_eq!(path, Path::new(PATH), "{e}");
            tensor.as_deref()
        }
        other => panic!("not Corrupt: {other}"),
    }
}

/// Asserts `bytes` is refused as corrupt, blaming `tensor`, with a message
/// that contains `needle`.
fn refused(bytes: &[u8], tensor: Option<&str>, needle: &str) {
    let e = parse(bytes).unwrap_err();
    assert_eq!(corrupt_tensor(&e), tensor, "{e}");
    assert!(e.to_string().contains(needle), "`{needle}` not in: {e}");
}

#[test]
fn parses_a_planned_image() {
    let (l, bytes) = image();
    let h = parse(&bytes).unwrap();
    assert_eq!(h.data_start, l.data_start);
    assert_eq!(h.step, Some(1200));
    assert_eq!(
        *h.values(),
        serde_json::json!({"epoch": 3, "rng": [1, 2, 3]})
    );
    assert_eq!(h.metadata["acp.rank"], "3");
    let names: Vec<_> = h.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["s", "w", "b", "z"]);
    for e in &h.entries {
        assert_eq!(Some(e), l.entries.iter().find(|x| x.name == e.name));
    }
    // The header alone is enough when the file length is known.
    let head = &bytes[..usize::try_from(l.data_start).unwrap()];
    let h2 = parse_header(Path::new(PATH), head, bytes.len() as u64).unwrap();
    assert_eq!(h2.entries, h.entries);
}

#[test]
fn plain_safetensors_without_acp_metadata() {
    let json = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[],"data_offsets":[4,5]}}"#;
    let h = parse(&raw(json, 5)).unwrap();
    assert_eq!(h.step, None);
    assert_eq!(*h.values(), Value::Null);
    assert!(h.metadata.is_empty());
    assert_eq!(h.entries.len(), 2);
    assert_eq!(h.entries[1].offset, 8 + json.len() as u64 + 4);
    let h = parse(&raw(r#"{"__metadata__":null}"#, 0)).unwrap();
    assert!(h.entries.is_empty());
}

#[test]
fn too_short() {
    for n in 0..8 {
        refused(&vec![0; n], None, "too short");
    }
    let e = parse_header(Path::new(PATH), &[2, 0, 0], 100).unwrap_err();
    assert!(e.to_string().contains("too few"), "{e}");
}

#[test]
fn header_length_past_the_end() {
    let (_, mut bytes) = image();
    let len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&(len - 7).to_le_bytes());
    refused(
        &bytes,
        None,
        &format!(
            "header length {} past the end of the file ({len} bytes)",
            len - 7
        ),
    );
    // Within the file, past the bytes the caller read.
    let (l, bytes) = image();
    let e = parse_header(Path::new(PATH), &bytes[..100], l.total_len).unwrap_err();
    assert!(
        e.to_string().contains("past the end of the 100 bytes read"),
        "{e}"
    );
}

#[test]
fn huge_header_length() {
    for n in [MAX_HEADER_BYTES + 1, u64::MAX, u64::MAX - 7, 1 << 63] {
        let mut bytes = n.to_le_bytes().to_vec();
        bytes.extend_from_slice(b"{}");
        let e = parse_header(Path::new(PATH), &bytes, u64::MAX).unwrap_err();
        assert!(e.to_string().contains("exceeds the limit"), "{e}");
    }
}

#[test]
fn not_utf8_or_not_an_object() {
    refused(&raw("{\"\u{e9}\":1}", 0)[..11], None, "past the end");
    let mut bad = raw("{\"xx\":{}}", 0);
    bad[10] = 0xff;
    refused(&bad, None, "not UTF-8");
    refused(&raw("[]", 0), None, "does not start with `{`");
    refused(&raw(" {}", 0), None, "does not start with `{`");
    refused(&raw("1", 0), None, "does not start with `{`");
    refused(&raw("", 0), None, "does not start with `{`");
    refused(&raw("{", 0), None, "not a valid JSON object");
    refused(&raw("{} {}", 0), None, "not a valid JSON object");
    refused(&raw("{\"a\":", 0), None, "not a valid JSON object");
    // Trailing whitespace is the padding, and allowed.
    parse(&raw("{}    \n\t ", 0)).unwrap();
}

#[test]
fn duplicate_keys() {
    let t = r#"{"dtype":"U8","shape":[1],"data_offsets":[0,1]}"#;
    refused(
        &raw(&format!(r#"{{"a":{t},"a":{t}}}"#), 1),
        None,
        "appears twice",
    );
    refused(
        &raw(r#"{"__metadata__":{},"__metadata__":{}}"#, 0),
        None,
        "appears twice",
    );
}

#[test]
fn metadata_must_map_strings_to_strings() {
    refused(&raw(r#"{"__metadata__":[]}"#, 0), None, "not a JSON object");
    refused(&raw(r#"{"__metadata__":{"k":1}}"#, 0), None, "non-string");
    refused(
        &raw(r#"{"__metadata__":{"k":{"dtype":"U8"}}}"#, 0),
        None,
        "non-string",
    );
}

#[test]
fn acp_fields_are_checked() {
    let with = |k: &str, v: &str| raw(&format!(r#"{{"__metadata__":{{"{k}":"{v}"}}}}"#), 0);
    refused(&with("acp.step", "x"), None, "not a decimal number");
    refused(&with("acp.step", "+1"), None, "not a decimal number");
    refused(&with("acp.step", ""), None, "not a decimal number");
    refused(
        &with("acp.step", "99999999999999999999"),
        None,
        "out of range",
    );
    refused(&with("acp.rank", "-1"), None, "not a decimal number");
    refused(&with("acp.world_size", "4294967296"), None, "out of range");
    refused(&with("acp.version", "0"), None, "which no format uses");
    refused(&with("acp.values", "{"), None, "not valid JSON");
    assert_eq!(parse(&with("acp.step", "7")).unwrap().step, Some(7));
    assert_eq!(
        *parse(&with("acp.values", "[1]")).unwrap().values(),
        serde_json::json!([1])
    );
    // Kept as text, but checked as a parse of it reads it: escapes
    // decoded, a lone surrogate refused, numbers in range.
    let values = |text: &str| {
        let header = serde_json::json!({"__metadata__": {"acp.values": text}});
        raw(&header.to_string(), 0)
    };
    let h = parse(&values(r#"{"k":"a\u00e9"}"#)).unwrap();
    assert_eq!(h.values_text(), Some(r#"{"k":"a\u00e9"}"#));
    assert_eq!(*h.values(), serde_json::json!({"k": "a\u{e9}"}));
    for bad in [
        r#"["\ud800"]"#,
        r#"{"\ud800":1}"#,
        "[1e999]",
        r#"["\x"]"#,
        "[1,]",
    ] {
        refused(&values(bad), None, "not valid JSON");
    }
}

#[test]
fn newer_version_is_unsupported() {
    let next = FORMAT_VERSION + 1;
    // Even with tensors this build would refuse: the version comes first.
    let json = format!(
        r#"{{"__metadata__":{{"acp.version":"{next}"}},"t":{{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}}}"#
    );
    let e = parse(&raw(&json, 16)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported, "{e}");
    assert!(e.to_string().contains(PATH), "{e}");
    assert!(
        e.to_string().contains(&format!("format version {next}")),
        "{e}"
    );
    let json = format!(r#"{{"__metadata__":{{"acp.version":"{FORMAT_VERSION}"}}}}"#);
    assert!(parse(&raw(&json, 0)).is_err(), "unaligned acp file");
}

#[test]
fn tensor_entries_are_checked() {
    let one = |t: &str, data: usize| raw(&format!(r#"{{"t":{t}}}"#), data);
    let t = Some("t");
    refused(&one("1", 0), t, "not a JSON object");
    refused(
        &one(r#"{"dtype":"F128","shape":[1],"data_offsets":[0,16]}"#, 16),
        t,
        "unknown dtype `F128`",
    );
    refused(
        &one(r#"{"dtype":"f32","shape":[1],"data_offsets":[0,4]}"#, 4),
        t,
        "unknown dtype",
    );
    refused(
        &one(r#"{"dtype":3,"shape":[1],"data_offsets":[0,4]}"#, 4),
        t,
        "not a string",
    );
    refused(
        &one(r#"{"shape":[1],"data_offsets":[0,4]}"#, 4),
        t,
        "`dtype` is missing",
    );
    refused(
        &one(r#"{"dtype":"F32","data_offsets":[0,4]}"#, 4),
        t,
        "`shape` is missing",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":4,"data_offsets":[0,4]}"#, 4),
        t,
        "not an array",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}"#, 4),
        t,
        "non-negative",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}"#, 4),
        t,
        "non-negative",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":["1"],"data_offsets":[0,4]}"#, 4),
        t,
        "non-negative",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":[1]}"#, 4),
        t,
        "`data_offsets` is missing",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":[1],"data_offsets":[0]}"#, 4),
        t,
        "not a pair",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4,8]}"#, 4),
        t,
        "not a pair",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":[1],"data_offsets":[0,-4]}"#, 4),
        t,
        "non-negative",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":[1],"data_offsets":{}}"#, 4),
        t,
        "not an array",
    );
    refused(
        &one(r#"{"dtype":"F32","shape":[1],"data_offsets":[4,0]}"#, 4),
        t,
        "end before they begin",
    );
    refused(
        &one(
            r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}"#,
            4,
        ),
        t,
        "unknown field `x`",
    );
    // A field given twice is refused (a reader keeping the first one
    // would see another tensor), as safetensors refuses it.
    for twice in [
        r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4],"dtype":"F32"}"#,
        r#"{"dtype":"F32","shape":[2],"shape":[1],"data_offsets":[0,4]}"#,
    ] {
        refused(&one(twice, 4), t, "appears twice");
    }
    // A dtype written with escapes is still the dtype (the checks one field
    // at a time read it).
    let h = parse(&one(
        r#"{"dtype":"F\u0033\u0032","shape":[1],"data_offsets":[0,4]}"#,
        4,
    ))
    .unwrap();
    assert_eq!(h.entries[0].dtype, Dtype::F32);
}

#[test]
fn size_must_match_shape_and_dtype() {
    let one = |t: &str, data: usize| raw(&format!(r#"{{"t":{t}}}"#), data);
    let t = Some("t");
    refused(
        &one(r#"{"dtype":"F32","shape":[2],"data_offsets":[0,4]}"#, 4),
        t,
        "needs 8",
    );
    refused(
        &one(r#"{"dtype":"F64","shape":[],"data_offsets":[0,4]}"#, 4),
        t,
        "needs 8",
    );
    refused(
        &one(r#"{"dtype":"U8","shape":[0],"data_offsets":[0,1]}"#, 1),
        t,
        "needs 0",
    );
    refused(
        &one(
            r#"{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}"#,
            0,
        ),
        t,
        "overflows",
    );
    refused(
        &one(
            r#"{"dtype":"F32","shape":[18446744073709551615,18446744073709551615],"data_offsets":[0,0]}"#,
            0,
        ),
        t,
        "overflows",
    );
    // No elements, but a dimension no framework can make (torch's sizes
    // are signed): it was accepted, and torch failed on it with an error
    // of its own.
    refused(
        &one(
            r#"{"dtype":"F32","shape":[0,9223372036854775808],"data_offsets":[0,0]}"#,
            0,
        ),
        t,
        "past 2**63 - 1",
    );
    refused(
        &one(
            r#"{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,0]}"#,
            0,
        ),
        t,
        "non-negative",
    );
}

#[test]
fn offsets_must_tile_the_data() {
    let u8s = |name: &str, b: u64, e: u64| {
        format!(
            r#""{name}":{{"dtype":"U8","shape":[{}],"data_offsets":[{b},{e}]}}"#,
            e - b
        )
    };
    let two = |a: String, b: String, data: usize| raw(&format!("{{{a},{b}}}"), data);
    // Overlap.
    refused(
        &two(u8s("a", 0, 8), u8s("b", 4, 12), 12),
        Some("b"),
        "overlap the previous tensor `a`",
    );
    // Same range twice.
    refused(
        &two(u8s("a", 0, 8), u8s("b", 0, 8), 8),
        Some("b"),
        "overlap",
    );
    // Gap, at the start and between.
    refused(
        &two(u8s("a", 1, 8), u8s("b", 8, 9), 9),
        Some("a"),
        "gap of 1 bytes",
    );
    refused(
        &two(u8s("a", 0, 4), u8s("b", 6, 9), 9),
        Some("b"),
        "gap of 2 bytes",
    );
    // Past the end.
    refused(
        &two(u8s("a", 0, 4), u8s("b", 4, 9), 8),
        Some("b"),
        "past the end of the file",
    );
    // (u64::MAX - 4 bytes, in dimensions a framework can make.)
    let far = r#""b":{"dtype":"U8","shape":[11,1676976733973595601],"data_offsets":[4,18446744073709551615]}"#;
    refused(
        &two(u8s("a", 0, 4), far.to_owned(), 8),
        Some("b"),
        "past the end of the file",
    );
    // Bytes after the last tensor.
    refused(
        &two(u8s("a", 0, 4), u8s("b", 4, 8), 9),
        None,
        "1 bytes after the last tensor",
    );
    // Zero-length tensors may sit anywhere in the chain, in any order.
    let h = parse(&two(u8s("a", 0, 4), u8s("e", 4, 4), 4)).unwrap();
    assert_eq!(h.entries[1].len, 0);
    parse(&two(u8s("e", 0, 0), u8s("a", 0, 4), 4)).unwrap();
    // But not past the end.
    refused(&two(u8s("a", 0, 4), u8s("e", 5, 5), 4), Some("e"), "gap");
}

#[test]
fn tensor_names_are_checked() {
    let t = r#"{"dtype":"U8","shape":[],"data_offsets":[0,1]}"#;
    refused(
        &raw(&format!(r#"{{"a\u0000b":{t}}}"#), 1),
        Some("a\\u{0}b"),
        "NUL",
    );
    refused(&raw(&format!(r#"{{"":{t}}}"#), 1), Some(""), "empty");
    let long = "n".repeat(crate::format::MAX_NAME_BYTES + 1);
    let e = parse(&raw(&format!(r#"{{"{long}":{t}}}"#), 1)).unwrap_err();
    assert!(e.to_string().contains("more than the limit"), "{e}");
    // Escapes in names are fine when they decode to a valid name.
    let h = parse(&raw(&format!(r#"{{"\u00e9\"\\":{t}}}"#), 1)).unwrap();
    assert_eq!(h.entries[0].name, "é\"\\");
}

#[test]
fn acp_files_must_be_aligned() {
    let v = FORMAT_VERSION;
    // Data starts at 8 + len(json): not a multiple of 4096.
    let json = format!(
        r#"{{"__metadata__":{{"acp.version":"{v}"}},"t":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}}}"#
    );
    refused(&raw(&json, 1), None, "not a multiple of 4096");
    // Padded to 4096, but an F32 at an odd offset.
    let json = format!(
        r#"{{"__metadata__":{{"acp.version":"{v}"}},"a":{{"dtype":"U8","shape":[1],"data_offsets":[0,1]}},"b":{{"dtype":"F32","shape":[1],"data_offsets":[1,5]}}}}"#
    );
    let mut padded = json.clone();
    padded.push_str(&" ".repeat(4096 - 8 - json.len()));
    refused(
        &raw(&padded, 5),
        Some("b"),
        "not a multiple of the 4-byte element size",
    );
    // A plain safetensors file need not be aligned.
    let plain = json.replace(&format!(r#""acp.version":"{v}""#), r#""format":"pt""#);
    parse(&raw(&plain, 5)).unwrap();
}

#[test]
fn every_truncation_is_refused() {
    let (l, bytes) = image();
    for cut in 0..bytes.len() {
        let prefix = &bytes[..cut];
        // A file that really is this short.
        assert!(
            parse_header(Path::new(PATH), prefix, cut as u64).is_err(),
            "cut at {cut}"
        );
        // A short read of the full file: fine once the header is in.
        let r = parse_header(Path::new(PATH), prefix, bytes.len() as u64);
        assert_eq!(r.is_ok(), cut as u64 >= l.data_start, "cut at {cut}");
    }
    // One byte too many is refused as well.
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(parse(&longer).is_err());
}

/// `parse_header` and the checked path alone give the same header, or
/// the same error.
fn same_as_checked(bytes: &[u8], file_len: u64) {
    let quick = parse_header(Path::new(PATH), bytes, file_len);
    let checked = super::parse_header_with(Path::new(PATH), bytes, file_len, false).map(|(h, _)| h);
    match (&quick, &checked) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a.entries, b.entries);
            assert_eq!(a.metadata, b.metadata);
            assert_eq!((a.data_start, a.step), (b.data_start, b.step));
        }
        (Err(a), Err(b)) => {
            assert_eq!(a.kind(), b.kind());
            assert_eq!(a.to_string(), b.to_string());
        }
        _ => panic!("quick {quick:?}, checked {checked:?}"),
    }
}

#[test]
fn the_one_pass_read_agrees_with_the_checked_path() {
    let (_, bytes) = image();
    same_as_checked(&bytes, bytes.len() as u64);
    let one = |t: &str, data: usize| raw(&format!(r#"{{"t":{t}}}"#), data);
    for entry in [
        r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4]}"#,
        r#"{"dtype":"F\u0033\u0032","shape":[1],"data_offsets":[0,4]}"#,
        r#"{"dtype":"F128","shape":[1],"data_offsets":[0,4]}"#,
        r#"{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}"#,
        r#"{"dtype":"F32","shape":[1],"shape":[1],"data_offsets":[0,4]}"#,
        r#"{"dtype":"F32","shape":[2],"data_offsets":[0,4]}"#,
        r#"{"data_offsets":[0,4],"shape":[1],"dtype":"C64"}"#,
    ] {
        same_as_checked(&one(entry, 4), 12);
        same_as_checked(&one(entry, 8), 12);
    }
    let twice = r#"{"__metadata__":{},"__metadata__":{},"t":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#;
    same_as_checked(&raw(twice, 1), 8 + twice.len() as u64 + 1);
}

proptest! {
    #[test]
    fn the_one_pass_read_agrees_on_random_headers(
        text in r#"\{("[a-z_]{0,3}":(\{("[a-z_]{0,12}":(\[[0-9,-]{0,8}\]|"[A-Z0-9_]{0,7}"|[0-9]{1,3}),?){0,4}\}|"[a-z0-9.]{0,4}"),?){0,4}\}"#,
        data in 0usize..64,
    ) {
        let bytes = raw(&text, data);
        same_as_checked(&bytes, bytes.len() as u64);
    }

    #[test]
    fn header_byte_flips_never_panic(
        flips in prop::collection::vec((0usize..4200, 1u8..=255), 1..8)
    ) {
        let (_, mut bytes) = image();
        for (at, x) in flips {
            let at = at % bytes.len();
            bytes[at] ^= x;
        }
        // Either outcome is fine; only a panic fails. The one-pass read
        // and the checked path alone agree on it.
        same_as_checked(&bytes, bytes.len() as u64);
        let _ = parse(&bytes);
        let _ = parse_header(Path::new(PATH), &bytes, u64::MAX);
        let _ = parse_header(Path::new(PATH), &bytes, 0);
    }

    #[test]
    fn json_byte_flips_never_panic(at in 8usize..300, x in 1u8..=255) {
        // Flips inside the JSON text proper, where they do the most harm.
        let (_, mut bytes) = image();
        bytes[at] ^= x;
        let _ = parse(&bytes);
    }

    #[test]
    fn random_bytes_never_panic(
        n in 0u64..600,
        body in prop::collection::vec(any::<u8>(), 0..600),
        file_len in any::<u64>(),
    ) {
        let mut bytes = n.to_le_bytes().to_vec();
        bytes.extend(body);
        let _ = parse(&bytes);
        let _ = parse_header(Path::new(PATH), &bytes, file_len);
    }

    #[test]
    fn random_json_headers_never_panic(
        text in r#"\{("[a-z_]{0,3}":(\{("[a-z_]{0,12}":(\[[0-9,-]{0,8}\]|"[A-Z0-9_]{0,7}"|[0-9]{1,3}),?){0,4}\}|"[a-z0-9.]{0,4}"),?){0,4}\}"#,
        data in 0usize..64,
    ) {
        let _ = parse(&raw(&text, data));
    }
}

/// Values JSON `{"k":[{"k":[...]}]}` nested `depth` arrays and objects deep.
fn nested_values(depth: usize) -> String {
    let mut open = String::new();
    let mut close = String::new();
    for level in 0..depth {
        if level % 2 == 0 {
            open.push_str(r#"{"k":"#);
            close.insert(0, '}');
        } else {
            open.push('[');
            close.insert(0, ']');
        }
    }
    format!("{open}1{close}")
}

fn values_meta() -> ImageMeta {
    ImageMeta {
        step: 7,
        rank: 0,
        world_size: 1,
        values: Value::Null,
        extra: BTreeMap::new(),
    }
}

#[test]
fn values_at_the_depth_limit_round_trip_and_deeper_ones_are_refused_by_the_writer() {
    let at = nested_values(MAX_VALUES_DEPTH);
    check_values_json(&at).unwrap();
    let l = Layout::plan_json(&[], &values_meta(), &at).unwrap();
    let h = parse(l.header_bytes()).unwrap();
    assert_eq!(*h.values(), serde_json::from_str::<Value>(&at).unwrap());
    // The same through a built value.
    let meta = ImageMeta {
        values: h.values().clone(),
        ..values_meta()
    };
    let h2 = parse(Layout::plan(&[], &meta).unwrap().header_bytes()).unwrap();
    assert_eq!(h2.values(), h.values());

    let deeper = nested_values(MAX_VALUES_DEPTH + 1);
    // 127 levels: 64 objects, 63 arrays; the 128th is an array.
    let path = format!("{}k", "k[0].".repeat(MAX_VALUES_DEPTH / 2));
    for e in [
        check_values_json(&deeper).unwrap_err(),
        Layout::plan_json(&[], &values_meta(), &deeper).unwrap_err(),
        Layout::plan(
            &[],
            &ImageMeta {
                // One level more than the parser takes, built by hand.
                values: serde_json::json!({ "k": [h.values().clone()] }),
                ..values_meta()
            },
        )
        .unwrap_err(),
    ] {
        assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
        let text = e.to_string();
        assert!(text.contains(&format!("values at `{path}`")), "{text}");
        assert!(
            text.contains(&format!("deeper than {MAX_VALUES_DEPTH} ")),
            "{text}"
        );
    }
    let e = check_values_json(&"[".repeat(100_000)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
}

#[test]
fn a_file_with_values_deeper_than_the_limit_is_corrupt() {
    let l = Layout::plan_json(&[], &values_meta(), "null").unwrap();
    let header = std::str::from_utf8(&l.header_bytes()[8..]).unwrap();
    let deeper = nested_values(MAX_VALUES_DEPTH + 1);
    let forged = header.trim_end().replace(
        r#""acp.values":"null""#,
        &format!(r#""acp.values":{}"#, Value::String(deeper)),
    );
    assert_ne!(forged, header.trim_end());
    refused(
        &raw(&forged, 0),
        None,
        &format!("nests deeper than {MAX_VALUES_DEPTH} levels"),
    );
    // Far deeper than any parser's recursion limit: refused, no overflow.
    let forged = header.trim_end().replace(
        r#""acp.values":"null""#,
        &format!(r#""acp.values":"{}""#, "[".repeat(1_000_000)),
    );
    refused(&raw(&forged, 0), None, "nests deeper than");
}

/// `parse_header_like` of `bytes` from the header of `kept`: what it gives,
/// and (when it gives a header) that a whole parse gives the same.
fn like(kept: &[u8], bytes: &[u8]) -> Option<Result<ParsedHeader>> {
    let path = Path::new(PATH);
    let (k, span) = parse_header_spanned(path, kept, kept.len() as u64).unwrap();
    let span = span.unwrap();
    let head = usize::try_from(k.data_start).unwrap();
    let got = parse_header_like(path, bytes, bytes.len() as u64, (&k, &kept[..head], span));
    got.map(|r| {
        r.map(|(h, span)| {
            let whole = parse(bytes).unwrap();
            assert_eq!(h.entries, whole.entries);
            assert_eq!(h.metadata, whole.metadata);
            assert_eq!((h.data_start, h.step), (whole.data_start, whole.step));
            // The span found is where the new metadata lies.
            let (w, at) = parse_header_spanned(path, bytes, bytes.len() as u64).unwrap();
            assert_eq!(at, Some(span));
            assert_eq!(w.metadata, h.metadata);
            h
        })
    })
}

#[test]
fn a_header_like_the_kept_one_but_its_metadata_reuses_its_tensors() {
    let (l, bytes) = image();
    let meta = |step, epoch| ImageMeta {
        step,
        rank: 3,
        world_size: 4,
        values: serde_json::json!({"epoch": epoch, "rng": [1, 2, 3]}),
        extra: BTreeMap::new(),
    };
    let data = &bytes[usize::try_from(l.data_start).unwrap()..];
    // The next steps of a kept plan: the step and the values change, the
    // metadata gets longer or shorter, the padding takes up the rest.
    for (step, epoch) in [(1201, 3), (1_000_000, 123_456), (7, 4)] {
        let m = meta(step, epoch);
        let values = serde_json::to_string(&m.values).unwrap();
        let (mut next, start) = l.restamp_header(&m, &values).unwrap();
        assert_eq!(start, l.data_start, "the same padded header");
        next.extend_from_slice(data);
        let h = like(&bytes, &next).expect("like the kept header").unwrap();
        assert_eq!(h.step, Some(step));
        assert_eq!(h.values()["epoch"], epoch);
    }
    // Anything else is parsed whole: a tensor's entry changed, trailing
    // bytes that are not whitespace, no metadata.
    let text = std::str::from_utf8(&bytes[8..usize::try_from(l.data_start).unwrap()]).unwrap();
    let with = |from: &str, to: &str| {
        assert!(text.contains(from), "{from}");
        let mut out = bytes.clone();
        let t = text.replacen(from, to, 1);
        assert_eq!(t.len(), text.len());
        out[8..8 + t.len()].copy_from_slice(t.as_bytes());
        out
    };
    assert!(like(&bytes, &with(r#""shape":[4,3]"#, r#""shape":[3,4]"#)).is_none());
    let end = text.trim_end().len();
    let mut junk = bytes.clone();
    junk[8 + end + 1] = b'x';
    assert!(like(&bytes, &junk).is_none());
    assert!(parse(&junk).is_err());
    // A metadata value cut short is no complete value: parsed whole, and
    // refused there.
    let cut = with(r#""acp.rank":"3""#, r#""acp.rank":{  "#);
    assert!(like(&bytes, &cut).is_none());
    assert!(parse(&cut).is_err());
    // A metadata value that is complete but wrong is refused as a whole
    // parse refuses it.
    let bad = with(r#""acp.step":"1200""#, r#""acp.step":"12x0""#);
    let e = like(&bytes, &bad)
        .expect("like the kept header")
        .unwrap_err();
    assert_eq!(e.to_string(), parse(&bad).unwrap_err().to_string());
    // The format version gone from the metadata changes how tensors are
    // placed: parsed whole.
    let m = ImageMeta {
        extra: BTreeMap::new(),
        ..meta(1201, 3)
    };
    let mut none = l.restamp_header(&m, "{}").unwrap().0;
    let t = std::str::from_utf8(&none[8..]).unwrap();
    let v = format!(r#""acp.version":"{FORMAT_VERSION}","#);
    if let Some(at) = t.find(&v) {
        let mut t = t.replacen(&v, "", 1);
        t.push_str(&" ".repeat(v.len()));
        none[8..].copy_from_slice(t.as_bytes());
        none.extend_from_slice(data);
        assert!(like(&bytes, &none).is_none(), "{at}");
    }
}
