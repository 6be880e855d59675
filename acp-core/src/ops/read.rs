//! Opening a committed data file for the operations' verified reads: the
//! reading and checking is [`crate::read::ChunkReader`]'s.

use std::path::Path;

use crate::error::Result;
use crate::format::{validate_file_name, FileEntry};
use crate::read::{ChunkReader, FileSource};

/// One data file of a committed step, opened for verified reads.
pub(crate) type DataFile = ChunkReader<FileSource>;

/// Opens `name` in step directory `dir` as the index at `index_path`
/// describes it (`entry`).
///
/// # Errors
/// [`Error::Corrupt`](crate::Error::Corrupt) for a bad name, a missing or
/// non-regular file (never waited on: see [`crate::io::open_regular`]), one
/// whose size differs from the index, or a chunk size past acp's limits;
/// [`Error::Io`](crate::Error::Io).
pub(crate) fn open(
    dir: &Path,
    index_path: &Path,
    name: &str,
    entry: &FileEntry,
) -> Result<DataFile> {
    validate_file_name(index_path, name)?;
    let path = dir.join(name);
    let file = crate::io::open_listed(&path, entry.size)?;
    ChunkReader::new(FileSource::new(file, path, entry.size), entry)
}
