//! `parse_header` on untrusted bytes: never panics; what it accepts is
//! self-consistent (tensors tile the data section inside the file).
#![no_main]

use std::path::Path;

use acp_core::format::parse_header;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let len = data.len() as u64;
    let Ok(h) = parse_header(Path::new("fuzz.safetensors"), data, len) else {
        return;
    };
    let mut end = h.data_start;
    for e in &h.entries {
        assert_eq!(e.offset, end, "tensors tile the data section");
        assert_eq!(
            e.len,
            e.dtype.size() as u64 * e.shape.iter().product::<u64>()
        );
        end = e.offset + e.len;
    }
    assert_eq!(end, len, "the last tensor ends the file");
});
