//! Opening a committed data file for the operations' verified reads: the
//! reading and checking is [`crate::read::ChunkReader`]'s.

use crate::error::Result;
use crate::format::{validate_file_name, FileEntry, INDEX_FILE_NAME};
use crate::read::{ChunkReader, StoredSource};
use crate::storage::Storage;

/// One data file of a committed step, opened for verified reads.
pub(crate) type DataFile = ChunkReader<StoredSource>;

/// Opens file `name` of committed `step` as the index describes it
/// (`entry`).
///
/// # Errors
/// [`Error::Corrupt`](crate::Error::Corrupt) for a bad name, a missing or
/// non-regular file (never waited on: see [`Storage::open_listed`]), one
/// whose size differs from the index, a compressed file whose frame table
/// is bad, or a chunk size past acp's limits;
/// [`Error::Io`](crate::Error::Io).
pub(crate) fn open(
    root: &dyn Storage,
    step: u64,
    name: &str,
    entry: &FileEntry,
) -> Result<DataFile> {
    validate_file_name(&root.describe(step, INDEX_FILE_NAME), name)?;
    let (file, path) = root.open_listed(step, name, entry.file_len())?.into_parts();
    ChunkReader::new(
        StoredSource::open(root, step, name, file, path, entry, None)?,
        entry,
    )
}
