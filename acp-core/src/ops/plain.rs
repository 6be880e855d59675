//! The plain-values view: a checkpoint's values tree as plain JSON for
//! people and for formats that hold only plain values.
//!
//! This is the one definition of that view. `acp inspect` and `acp diff`
//! print it ([`Leaves::Described`]); `acp export --to mindspore` (Python,
//! through `acp._acp.plain_values`) keeps its scalars as MindSpore's
//! `append_dict` ([`Leaves::Omitted`]).
//!
//! The tree is the one acp's Python state codec writes (`{"acp.codec": 1,
//! "state": NODE}`, grammar in `python/acp/_codec.py`): dicts become objects
//! with their keys as text (a string key as it is, any other key as its
//! plain JSON text: `3`, `1.5`, `true`, `null`, `inf`), tuples arrays. The
//! leaves that plain JSON cannot hold as they are (tensor references, bytes,
//! non-finite floats, ints beyond 64 bits, framework values) are described
//! or omitted, by [`Leaves`]. A tree without the codec key comes back as it
//! is: it is already plain.

use serde_json::Value;

use super::CODEC_KEY;

/// What the view makes of a leaf that plain JSON cannot hold as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaves {
    /// Text for people: a tensor `"<tensor NAME>"`, bytes `"<N bytes>"`, a
    /// non-finite float its name (`"nan"`, `"inf"`, `"-inf"`), a big int its
    /// decimal digits, a framework value its stored payload.
    Described,
    /// `null`: only values that are plain JSON as saved remain.
    Omitted,
}

/// The values tree of acp's Python state codec as plain JSON, its leaves
/// described for people ([`Leaves::Described`]).
#[must_use]
pub fn plain_values(values: &Value) -> Value {
    plain_values_with(values, Leaves::Described)
}

/// The values tree of acp's Python state codec as plain JSON, with the
/// leaves plain JSON cannot hold treated as `leaves` says.
#[must_use]
pub fn plain_values_with(values: &Value, leaves: Leaves) -> Value {
    match values {
        Value::Object(o) if o.contains_key(CODEC_KEY) => {
            o.get("state").map_or(Value::Null, |n| node(n, leaves))
        }
        other => other.clone(),
    }
}

fn node(n: &Value, leaves: Leaves) -> Value {
    let described = leaves == Leaves::Described;
    match n {
        Value::Array(a) => Value::Array(a.iter().map(|v| node(v, leaves)).collect()),
        Value::Object(o) => match o.get("t").and_then(Value::as_str) {
            Some("dict" | "odict") => {
                let keys = o.get("k").and_then(Value::as_array);
                let vals = o.get("v").and_then(Value::as_array);
                let mut out = serde_json::Map::new();
                if let (Some(k), Some(v)) = (keys, vals) {
                    for (k, v) in k.iter().zip(v) {
                        // Keys are always described: an omitted key would
                        // merge distinct entries under `null`.
                        let key = match node(k, Leaves::Described) {
                            Value::String(s) => s,
                            other => other.to_string(),
                        };
                        out.insert(key, node(v, leaves));
                    }
                }
                Value::Object(out)
            }
            Some("tuple") => o.get("v").map_or(Value::Null, |v| node(v, leaves)),
            Some("int" | "value") if described => o.get("v").cloned().unwrap_or(Value::Null),
            Some("float") if described => {
                Value::String(float_name(o.get("bits").and_then(Value::as_str)))
            }
            Some("bytes") if described => {
                let n = o
                    .get("v")
                    .and_then(Value::as_str)
                    .map_or(0, |s| s.trim_end_matches('=').len() * 3 / 4);
                Value::String(format!("<{n} bytes>"))
            }
            Some("tensor") if described => Value::String(format!(
                "<tensor {}>",
                o.get("name").and_then(Value::as_str).unwrap_or("?")
            )),
            Some("int" | "value" | "float" | "bytes" | "tensor") => Value::Null,
            _ => n.clone(),
        },
        other => other.clone(),
    }
}

fn float_name(bits: Option<&str>) -> String {
    let Some(v) = bits.and_then(|b| u64::from_str_radix(b, 16).ok()) else {
        return "nan".to_owned();
    };
    let f = f64::from_bits(v);
    if f.is_nan() {
        "nan".to_owned()
    } else if f > 0.0 {
        "inf".to_owned()
    } else {
        "-inf".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A tree with every kind of node the codec writes, and every kind of
    /// dict key.
    fn every_node() -> Value {
        json!({"acp.codec": 1, "state": {"t": "dict",
        "k": ["w", 3, 1.5, true, null, {"t": "int", "v": "18446744073709551616"},
              {"t": "float", "bits": "fff0000000000000"}, "rest"],
        "v": [
            {"t": "tensor", "fw": "torch", "name": "model.w", "shape": [2]},
            {"t": "float", "bits": "7ff0000000000000"},
            {"t": "float", "bits": "7ff8000000000000"},
            {"t": "tuple", "v": [1, {"t": "bytes", "v": "AAEC"}]},
            null,
            {"t": "int", "v": "-18446744073709551617"},
            {"t": "value", "fw": "torch", "kind": "dtype", "v": "float32"},
            {"t": "odict", "k": ["lr", "betas", "tag", "ok"], "meta": {"t": "dict", "k": [], "v": []},
             "v": [0.5, {"t": "tuple", "v": [0.9, 0.999]}, "adam", false]},
        ]}})
    }

    #[test]
    fn described_view_pins_every_node() {
        assert_eq!(
            plain_values(&every_node()),
            json!({
                "w": "<tensor model.w>",
                "3": "inf",
                "1.5": "nan",
                "true": [1, "<3 bytes>"],
                "null": null,
                "18446744073709551616": "-18446744073709551617",
                "-inf": "float32",
                "rest": {"lr": 0.5, "betas": [0.9, 0.999], "tag": "adam", "ok": false},
            })
        );
    }

    #[test]
    fn omitted_view_keeps_only_plain_json() {
        assert_eq!(
            plain_values_with(&every_node(), Leaves::Omitted),
            json!({
                "w": null,
                "3": null,
                "1.5": null,
                "true": [1, null],
                "null": null,
                "18446744073709551616": null,
                "-inf": null,
                "rest": {"lr": 0.5, "betas": [0.9, 0.999], "tag": "adam", "ok": false},
            })
        );
    }

    #[test]
    fn trees_without_the_codec_key_are_plain_already() {
        let tree = json!({"a": 1, "t": {"t": "tensor", "name": "x"}});
        assert_eq!(plain_values(&tree), tree);
        assert_eq!(plain_values_with(&tree, Leaves::Omitted), tree);
        assert_eq!(plain_values(&Value::Null), Value::Null);
    }
}
