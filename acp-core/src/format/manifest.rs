//! A rank's manifest: what one rank reports to the committer (rank 0) once
//! its data file is durable, in a multi-rank save.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::index::{check_file, check_refs, validate_file_name, FileEntry};
use super::layout::name_problem;
use super::{data_file_name, FORMAT_VERSION};
use crate::error::{Error, Result};

/// The manifest file name of `rank`: `rank-{rank:05}.manifest.json`.
#[must_use]
pub fn manifest_file_name(rank: u32) -> String {
    format!("rank-{rank:05}.manifest.json")
}

/// One rank's durable data file, as that rank reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Format version.
    pub format_version: u32,
    /// The step.
    pub step: u64,
    /// The reporting rank.
    pub rank: u32,
    /// The number of ranks.
    pub world_size: u32,
    /// The data file's name (always [`data_file_name`] of `rank`).
    pub file: String,
    /// Size and digests of the data file.
    pub entry: FileEntry,
    /// The tensors in the file.
    pub tensors: Vec<String>,
}

impl Manifest {
    /// Serializes to JSON bytes.
    ///
    /// # Errors
    /// [`Error::Invalid`] if serialization fails (it cannot for these types).
    pub fn to_json(&self) -> Result<Vec<u8>> {
        serde_json::to_vec_pretty(self)
            .map_err(|e| Error::invalid(format!("manifest of rank {}", self.rank), e))
    }

    /// Parses and validates untrusted manifest bytes read from `path`, which
    /// must report `step` for `rank`.
    ///
    /// # Errors
    /// [`Error::Corrupt`] naming `path` and the field;
    /// [`Error::Unsupported`] for a newer format version.
    pub fn parse(path: &Path, bytes: &[u8], step: u64, rank: u32) -> Result<Manifest> {
        let corrupt = |reason: String| Error::corrupt(path, None, reason);
        let m: Manifest = serde_json::from_slice(bytes)
            .map_err(|e| corrupt(format!("not a valid acp manifest: {e}")))?;
        if m.format_version > FORMAT_VERSION {
            return Err(Error::Unsupported {
                what: path.display().to_string(),
                reason: format!(
                    "manifest format version {} is newer than {FORMAT_VERSION}",
                    m.format_version
                ),
            });
        }
        if m.step != step || m.rank != rank || m.entry.rank != rank {
            return Err(corrupt(format!(
                "reports step {} rank {} (file rank {}), expected step {step} rank {rank}",
                m.step, m.rank, m.entry.rank
            )));
        }
        if m.world_size == 0 || rank >= m.world_size {
            return Err(corrupt(format!(
                "rank {rank} is not below the world size {}",
                m.world_size
            )));
        }
        validate_file_name(path, &m.file)?;
        if m.file != data_file_name(rank) {
            return Err(corrupt(format!("names file `{}` for rank {rank}", m.file)));
        }
        check_file(path, &m.file, &m.entry, m.world_size)?;
        check_refs(path, &m.file, &m.entry, m.step)?;
        for t in &m.tensors {
            if let Some(p) = name_problem(t) {
                return Err(Error::corrupt(path, Some(t), p));
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::chunk_digests;

    fn sample() -> Manifest {
        let data = vec![7u8; 10_000];
        let d = chunk_digests(&data, 4096);
        Manifest {
            format_version: FORMAT_VERSION,
            step: 5,
            rank: 1,
            world_size: 2,
            file: data_file_name(1),
            entry: FileEntry::plain(1, 10_000, 4096, &d),
            tensors: vec!["a".into(), "b.c".into()],
        }
    }

    #[test]
    fn round_trips_and_checks_who_reports() {
        let m = sample();
        let p = Path::new("/x/rank-00001.manifest.json");
        let bytes = m.to_json().unwrap();
        assert_eq!(Manifest::parse(p, &bytes, 5, 1).unwrap(), m);
        assert!(Manifest::parse(p, &bytes, 6, 1).is_err());
        assert!(Manifest::parse(p, &bytes, 5, 0).is_err());
        let mut evil = sample();
        evil.file = "../rank-00001.safetensors".into();
        assert!(Manifest::parse(p, &evil.to_json().unwrap(), 5, 1).is_err());
        let mut evil = sample();
        evil.tensors.push("x\0y".into());
        assert!(Manifest::parse(p, &evil.to_json().unwrap(), 5, 1).is_err());
        assert!(Manifest::parse(p, b"{", 5, 1).is_err());
    }
}
