//! The crate's layers (its crate docs, "Layers") hold in the source: no
//! module names a module of a higher layer through a `crate::` path.
//!
//! A source-level check rather than a build-level one: a Rust crate's
//! modules may import each other freely, so nothing else catches an import
//! that runs upwards. It reads every `.rs` file under `src/` (comments
//! stripped), finds each `crate::` path (a module, a name the crate root
//! re-exports, or a `crate::{…}` group of either) and compares layers.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Each module's layer, lowest first (lib.rs's table). Modules of one layer
/// may use each other.
const LAYERS: &[(&str, u32)] = &[
    ("error", 0),
    ("format", 1),
    ("codec", 1),
    ("staging", 2),
    ("storage", 2),
    ("io", 3),
    ("read", 4),
    ("replica", 5),
    ("engine", 6),
    ("ops", 7),
    ("cli", 8),
];

/// `config` sits beside `engine`: every layer may read it, and it may use
/// what lies below `engine`.
const CONFIG: &str = "config";

/// Files allowed to use a higher layer, each with its reason.
const EXCEPTIONS: &[(&str, &str, &str)] = &[(
    "replica/loopback.rs",
    "engine",
    "the in-process Transport delivers into other engines' replica slots, so it holds engines",
)];

fn layer(module: &str) -> Option<u32> {
    if module == CONFIG {
        return LAYERS.iter().find(|l| l.0 == "engine").map(|l| l.1);
    }
    LAYERS.iter().find(|l| l.0 == module).map(|l| l.1)
}

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for ent in std::fs::read_dir(dir).unwrap() {
        let path = ent.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The source without `//` comments (doc comments included).
fn code(text: &str) -> String {
    text.lines()
        .map(|l| l.find("//").map_or(l, |i| &l[..i]))
        .collect::<Vec<_>>()
        .join("\n")
}

fn ident(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// The first segment of every `crate::` path in `code`.
fn crate_paths(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in code.match_indices("crate::") {
        let rest = code[i + "crate::".len()..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0;
            let mut item = String::new();
            let mut items = Vec::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => items.push(std::mem::take(&mut item)),
                    _ if depth == 0 => item.push(c),
                    _ => {}
                }
            }
            items.push(item);
            out.extend(
                items
                    .iter()
                    .map(|i| ident(i.trim()).to_owned())
                    .filter(|i| !i.is_empty()),
            );
        } else {
            out.push(ident(rest).to_owned());
        }
    }
    out
}

/// The names the crate root re-exports, with the module each comes from.
fn root_reexports() -> BTreeMap<String, String> {
    let lib = code(&std::fs::read_to_string(src().join("lib.rs")).unwrap());
    let mut out = BTreeMap::new();
    for stmt in lib.split(';') {
        let Some(rest) = stmt.trim().strip_prefix("pub use ") else {
            continue;
        };
        let Some((module, names)) = rest.split_once("::") else {
            continue;
        };
        let names = names.trim().trim_start_matches('{').trim_end_matches('}');
        for name in names.split(',') {
            let name = name.trim();
            if !name.is_empty() {
                out.insert(name.to_owned(), module.trim().to_owned());
            }
        }
    }
    out
}

#[test]
fn no_module_uses_a_higher_layer() {
    let root = src();
    let reexports = root_reexports();
    assert!(
        reexports.get("Engine").map(String::as_str) == Some("engine"),
        "lib.rs's re-exports were not understood: {reexports:?}"
    );
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let mut wrong = Vec::new();
    let mut checked = 0;
    for path in &files {
        let rel = path.strip_prefix(&root).unwrap();
        let rel_s = rel.to_string_lossy().replace('\\', "/");
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let module = first.trim_end_matches(".rs");
        if module == "lib" || module == "bin" {
            continue; // the root and the binary sit above every layer
        }
        let Some(own) = layer(module) else {
            wrong.push(format!(
                "{rel_s}: module `{module}` is not in the layer table"
            ));
            continue;
        };
        let text = std::fs::read_to_string(path).unwrap();
        for seg in crate_paths(&code(&text)) {
            let used = if layer(&seg).is_some() {
                seg.clone()
            } else if let Some(m) = reexports.get(&seg) {
                m.clone()
            } else {
                wrong.push(format!(
                    "{rel_s}: `crate::{seg}` is neither a module of the layer table nor a root re-export"
                ));
                continue;
            };
            checked += 1;
            if used == CONFIG || used == module {
                continue;
            }
            let Some(theirs) = layer(&used) else { continue };
            let excepted = EXCEPTIONS.iter().any(|(f, m, _)| *f == rel_s && *m == used);
            if theirs > own && !excepted {
                wrong.push(format!(
                    "{rel_s} (layer `{module}`) uses `crate::{seg}` of the higher layer `{used}`"
                ));
            }
        }
    }
    assert!(
        checked > 100,
        "only {checked} crate:: paths found: the scan is broken"
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn the_scan_sees_upward_paths() {
    let src = "use crate::ops::shm; // crate::cli in a comment\n\
               use crate::{error::Error, Engine};\n\
               /// [`crate::cli`]\n\
               let x = crate::engine::reclaim::f();";
    assert_eq!(
        crate_paths(&code(src)),
        ["ops", "error", "Engine", "engine"]
    );
}
