//! JSON helpers shared by the header and index parsers.

use std::collections::btree_map::{BTreeMap, Entry};
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, Deserializer, Error as _, MapAccess, Visitor};

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

struct UniqueMap<V>(PhantomData<V>);

impl<'de, V: Deserialize<'de>> Visitor<'de> for UniqueMap<V> {
    type Value = BTreeMap<String, V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut map = BTreeMap::new();
        while let Some(key) = access.next_key::<String>()? {
            match map.entry(key) {
                Entry::Occupied(e) => {
                    return Err(A::Error::custom(format!(
                        "key {} appears twice",
                        shown(e.key())
                    )));
                }
                Entry::Vacant(e) => {
                    e.insert(access.next_value()?);
                }
            }
        }
        Ok(map)
    }
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
    }

    #[test]
    fn shown_escapes_and_cuts() {
        assert_eq!(shown("blk.3.w"), "`blk.3.w`");
        assert_eq!(shown("a\0b"), "`a\\u{0}b`");
        let long = "x".repeat(200);
        assert_eq!(shown(&long).chars().count(), 80 + 3);
    }
}
