//! `Index::parse` on untrusted bytes: never panics; an accepted index names
//! only plain file names and maps every tensor to a listed file.
#![no_main]

use std::path::Path;

use acp_core::format::{validate_file_name, Index};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = Path::new("model.safetensors.index.json");
    let Ok(index) = Index::parse(path, data) else {
        return;
    };
    assert!(index.world_size > 0);
    for (name, file) in &index.files {
        assert!(validate_file_name(path, name).is_ok());
        assert!(file.rank < index.world_size);
        assert!(file.chunk_bytes > 0);
    }
    for file in index.weight_map.values() {
        assert!(index.files.contains_key(file));
    }
    // What it accepts, it writes back and reads again the same.
    let again = Index::parse(path, &index.to_json()).expect("a parsed index round-trips");
    assert_eq!(again, index);
});
