//! JSON helpers shared by the header and index parsers.

use std::collections::BTreeMap;
use std::collections::HashSet;
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, SeqAccess, Visitor};

/// Deserializes a JSON object into a map, refusing a key that appears twice
/// (`serde_json` would silently keep the last one, so a hostile file could
/// hide an entry from one reader and show it to another).
pub(super) fn unique_map<'de, D, V>(d: D) -> Result<BTreeMap<String, V>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    d.deserialize_map(UniqueMap(PhantomData))
}

/// Deserializes a JSON object into its entries in document order, refusing
/// a key that appears twice as [`unique_map`] does; no ordered map is built
/// (a header of 100,000 tensors spent a third of its parse inserting into
/// one).
pub(super) fn unique_entries<'de, D, V>(d: D) -> Result<Vec<(String, V)>, D::Error>
where
    D: Deserializer<'de>,
    V: Deserialize<'de>,
{
    d.deserialize_map(UniqueEntries(PhantomData))
}

struct UniqueEntries<V>(PhantomData<V>);

impl<'de, V: Deserialize<'de>> Visitor<'de> for UniqueEntries<V> {
    type Value = Vec<(String, V)>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut entries = Vec::with_capacity(access.size_hint().unwrap_or(0));
        while let Some(entry) = access.next_entry::<String, V>()? {
            entries.push(entry);
        }
        let mut seen = HashSet::with_capacity(entries.len());
        for (key, _) in &entries {
            if !seen.insert(key.as_str()) {
                return Err(A::Error::custom(format!(
                    "key {} appears twice",
                    shown(key)
                )));
            }
        }
        Ok(entries)
    }
}

struct UniqueMap<V>(PhantomData<V>);

impl<'de, V: Deserialize<'de>> Visitor<'de> for UniqueMap<V> {
    type Value = BTreeMap<String, V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        // Collected, sorted and built in bulk rather than inserted one by
        // one: the keys of a map this engine wrote are in order already, so
        // the (stable) sorts compare each key with its neighbour once,
        // where inserts searched the tree (an index of 100,000 tensors
        // spent most of its parse there). A repeated key is then next to
        // itself.
        let mut entries: Vec<(String, V)> = Vec::with_capacity(access.size_hint().unwrap_or(0));
        while let Some(entry) = access.next_entry::<String, V>()? {
            entries.push(entry);
        }
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = entries.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(A::Error::custom(format!(
                "key {} appears twice",
                shown(&w[0].0)
            )));
        }
        Ok(entries.into_iter().collect())
    }
}

/// A JSON value checked as `serde_json::Value` reads one (strings decoded,
/// their escapes and surrogate pairs too, numbers in range, the same
/// recursion limit), with nothing built: `serde::de::IgnoredAny` skips
/// strings without decoding their escapes, so it would pass text that a
/// `Value` refuses.
pub(super) struct Checked;

impl<'de> Deserialize<'de> for Checked {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(Checked)
    }
}

impl<'de> Visitor<'de> for Checked {
    type Value = Checked;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, _: bool) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_u64<E>(self, _: u64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_str<E>(self, _: &str) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_unit<E>(self) -> Result<Checked, E> {
        Ok(Checked)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Checked, A::Error> {
        while seq.next_element::<Checked>()?.is_some() {}
        Ok(Checked)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Checked, A::Error> {
        while map.next_key::<Checked>()?.is_some() {
            map.next_value::<Checked>()?;
        }
        Ok(Checked)
    }
}

/// Where `text` nests arrays and objects deeper than `limit`: the path of
/// the first array or object that does, from the top value, e.g.
/// `state.v[0].v[2]` (object keys after `.`, array indices in brackets), or
/// None when no value is nested deeper. A top-level array or object is at
/// depth 1.
///
/// Reads the bytes once, without recursion and without building anything,
/// so it is cheap on the save path and safe on any input: text that is not
/// JSON gives some answer and no panic (the parser then refuses it).
pub(super) fn too_deep(text: &str, limit: usize) -> Option<String> {
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for &b in bytes {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                if depth > limit {
                    return Some(path_to_depth(bytes, limit + 1));
                }
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    None
}

/// One open array or object while walking JSON text.
enum Open {
    /// An object and the raw text of its current key, once read.
    Object(Option<(usize, usize)>),
    /// An array and the index of its current element.
    Array(usize),
}

/// The path of the first array or object opened at `depth`, for
/// [`too_deep`]. Only runs when the limit was crossed, so it may be slower.
fn path_to_depth(bytes: &[u8], depth: usize) -> String {
    let mut open: Vec<Open> = Vec::new();
    let mut expect_key = false;
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        match b {
            b'"' => {
                let start = i + 1;
                i = start;
                while let Some(&c) = bytes.get(i) {
                    match c {
                        b'\\' => i += 1,
                        b'"' => break,
                        _ => {}
                    }
                    i += 1;
                }
                if expect_key {
                    if let Some(Open::Object(key)) = open.last_mut() {
                        *key = Some((start, i.min(bytes.len())));
                    }
                    expect_key = false;
                }
            }
            b'{' | b'[' => {
                if open.len() + 1 == depth {
                    return path_text(bytes, &open);
                }
                open.push(if b == b'{' {
                    Open::Object(None)
                } else {
                    Open::Array(0)
                });
                expect_key = b == b'{';
            }
            b'}' | b']' => {
                open.pop();
                expect_key = false;
            }
            b',' => match open.last_mut() {
                Some(Open::Array(index)) => *index += 1,
                Some(Open::Object(_)) => expect_key = true,
                None => {}
            },
            _ => {}
        }
        i += 1;
    }
    path_text(bytes, &open)
}

fn path_text(bytes: &[u8], open: &[Open]) -> String {
    let mut path = String::new();
    for o in open {
        match o {
            Open::Object(Some((start, end))) => {
                if !path.is_empty() {
                    path.push('.');
                }
                let key = bytes.get(*start..*end).unwrap_or_default();
                path.push_str(&escaped(&String::from_utf8_lossy(key)));
            }
            Open::Object(None) => path.push_str(".?"),
            Open::Array(index) => path.push_str(&format!("[{index}]")),
        }
    }
    path
}

/// A name as it appears in an error message: in backquotes, control
/// characters escaped, cut after 80 characters.
pub(super) fn shown(name: &str) -> String {
    format!("`{}`", escaped(name))
}

/// A name made safe to print: control characters escaped, cut after 80
/// characters.
pub(super) fn escaped(name: &str) -> String {
    const MAX_CHARS: usize = 80;
    let mut s = String::new();
    for (i, c) in name.chars().enumerate() {
        if i == MAX_CHARS {
            s.push('…');
            break;
        }
        if c.is_control() {
            s.extend(c.escape_default());
        } else {
            s.push(c);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> serde_json::Result<BTreeMap<String, u32>> {
        let mut de = serde_json::Deserializer::from_str(text);
        let m = unique_map(&mut de)?;
        de.end()?;
        Ok(m)
    }

    #[test]
    fn unique_map_refuses_duplicates() {
        assert_eq!(parse(r#"{"a": 1, "b": 2}"#).unwrap().len(), 2);
        let e = parse(r#"{"a": 1, "a": 2}"#).unwrap_err();
        assert!(e.to_string().contains("key `a` appears twice"), "{e}");
        assert!(parse("[1]").is_err());
        assert!(parse("{} x").is_err());
        // Keys in any order; a repeat found wherever it is.
        let m = parse(r#"{"c": 3, "a": 1, "b": 2}"#).unwrap();
        assert_eq!(
            m.into_iter().collect::<Vec<_>>(),
            [("a".into(), 1), ("b".into(), 2), ("c".into(), 3)]
        );
        let e = parse(r#"{"b": 1, "c": 2, "a": 3, "\u0062": 4}"#).unwrap_err();
        assert!(e.to_string().contains("key `b` appears twice"), "{e}");
    }

    #[test]
    fn unique_entries_keep_document_order_and_refuse_duplicates() {
        let entries = |text: &str| {
            let mut de = serde_json::Deserializer::from_str(text);
            unique_entries::<_, u32>(&mut de)
        };
        assert_eq!(
            entries(r#"{"b": 1, "a": 2, "c": 3}"#).unwrap(),
            [("b".into(), 1), ("a".into(), 2), ("c".into(), 3)]
        );
        // Keys compare decoded: an escaped `a` is the same key.
        for twice in [r#"{"a": 1, "b": 2, "a": 3}"#, r#"{"a": 1, "\u0061": 2}"#] {
            let e = entries(twice).unwrap_err();
            assert!(e.to_string().contains("key `a` appears twice"), "{e}");
        }
        assert!(entries("[1]").is_err());
        assert!(entries(r#"{"a": "x"}"#).is_err());
    }

    #[test]
    fn the_parsers_recursion_limit_is_the_values_depth_limit() {
        // `parse_header` relies on it: values `Checked` passes are no
        // deeper than `MAX_VALUES_DEPTH`, so only refused text is walked
        // again by `too_deep`. Arrays, objects and a mix, at the limit and
        // one past it.
        let limit = crate::format::MAX_VALUES_DEPTH;
        let arrays = |d: usize| format!("{}1{}", "[".repeat(d), "]".repeat(d));
        let objects = |d: usize| format!("{}1{}", r#"{"k":"#.repeat(d), "}".repeat(d));
        let mixed = |d: usize| {
            let open: String = (0..d)
                .map(|i| if i % 2 == 0 { "[" } else { r#"{"k":"# })
                .collect();
            let close: String = (0..d)
                .rev()
                .map(|i| if i % 2 == 0 { "]" } else { "}" })
                .collect();
            format!("{open}null{close}")
        };
        for make in [&arrays as &dyn Fn(usize) -> String, &objects, &mixed] {
            for depth in [1, limit - 1, limit, limit + 1, limit + 2] {
                let text = make(depth);
                let parsed = serde_json::from_str::<Checked>(&text).is_ok();
                assert_eq!(parsed, depth <= limit, "depth {depth}: {text:.40}");
                assert_eq!(
                    too_deep(&text, limit).is_none(),
                    depth <= limit,
                    "depth {depth}"
                );
            }
        }
    }

    #[test]
    fn too_deep_names_the_path() {
        assert_eq!(too_deep("[[1]]", 2), None);
        assert_eq!(too_deep("[[[1]]]", 2).as_deref(), Some("[0][0]"));
        assert_eq!(too_deep("1", 0), None);
        assert_eq!(too_deep("{}", 0).as_deref(), Some(""));
        let text = r#"{"a": [1, {"b": 2}, {"c\\\"]": {"d": []}}], "e": 3}"#;
        assert_eq!(too_deep(text, 5), None);
        assert_eq!(too_deep(text, 3).as_deref(), Some(r#"a[2].c\\\"]"#));
        // Brackets inside strings do not count; the second key is named.
        let text = r#"{"x": "[[[[", "y,{": {"z": [[]]}}"#;
        assert_eq!(too_deep(text, 3).as_deref(), Some("y,{.z[0]"));
        // Not JSON: some answer, no panic.
        for junk in ["]]]][[[", "\"", "{\"a", "[[\"\\", "{,,,{", "}{"] {
            let _ = too_deep(junk, 1);
        }
    }

    #[test]
    fn shown_escapes_and_cuts() {
        assert_eq!(shown("blk.3.w"), "`blk.3.w`");
        assert_eq!(shown("a\0b"), "`a\\u{0}b`");
        let long = "x".repeat(200);
        assert_eq!(shown(&long).chars().count(), 80 + 3);
    }
}
