//! Side figures a bench records for the report (thread counts, whether the
//! page cache could be dropped, the flush breakdown from `SaveReport`), as
//! `{criterion dir}/acp-notes/{group}.json`, replaced on every run.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// Key/value notes of one criterion group.
#[derive(Debug)]
pub struct Notes {
    group: String,
    values: BTreeMap<String, serde_json::Value>,
}

impl Notes {
    /// Empty notes for `group`.
    #[must_use]
    pub fn new(group: &str) -> Notes {
        Notes {
            group: group.to_owned(),
            values: BTreeMap::new(),
        }
    }

    /// Sets `key` (printed in key order by the report).
    pub fn set(&mut self, key: &str, value: impl Into<serde_json::Value>) {
        self.values.insert(key.to_owned(), value.into());
    }

    /// Where criterion writes: `$CRITERION_HOME`, else
    /// `$CARGO_TARGET_DIR/criterion`, else the workspace's `target/criterion`.
    #[must_use]
    pub fn criterion_dir() -> PathBuf {
        if let Some(h) = std::env::var_os("CRITERION_HOME") {
            return h.into();
        }
        if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
            return PathBuf::from(t).join("criterion");
        }
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("target")
            .join("criterion")
    }

    /// Writes the notes (and echoes them on stderr). A failure to write is
    /// reported on stderr, not fatal.
    pub fn save(&self) {
        let dir = Notes::criterion_dir().join("acp-notes");
        let path = dir.join(format!("{}.json", self.group));
        let json = serde_json::Value::Object(self.values.clone().into_iter().collect());
        eprintln!("acp-bench notes [{}]: {json}", self.group);
        let text = serde_json::to_string_pretty(&json).unwrap_or_default();
        if let Err(e) = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)) {
            eprintln!("acp-bench: could not write {}: {e}", path.display());
        }
    }
}
