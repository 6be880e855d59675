//! The path rule: a file name the index may hold is accepted by
//! `validate_file_name` only if joining it to a step directory names a
//! file directly inside that directory.
#![no_main]

use std::path::{Component, Path};

use acp_core::format::validate_file_name;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(name) = std::str::from_utf8(data) else {
        return;
    };
    if validate_file_name(Path::new("index.json"), name).is_err() {
        return;
    }
    let dir = Path::new("/ckpt/step-000000000001");
    let joined = dir.join(name);
    assert_eq!(joined.parent(), Some(dir), "{name:?} leaves the directory");
    let mut comps = Path::new(name).components();
    assert!(
        matches!(comps.next(), Some(Component::Normal(_))),
        "{name:?}"
    );
    assert!(comps.next().is_none(), "{name:?} has several components");
    assert!(!name.starts_with('.') && !name.contains('\0'), "{name:?}");
});
