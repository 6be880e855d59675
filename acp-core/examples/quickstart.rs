//! The README's Rust quick start: `cargo run -p acp-core --example quickstart`.
//!
//! The program is `examples/quickstart.rs` at the repository's root, beside
//! the Python one, exactly as README.md shows it (`tests/examples.rs` checks
//! that, and runs it). It is included here so that this example crate has
//! the crate documentation the workspace's lints ask for, which the README's
//! code does not carry.

include!("../../examples/quickstart.rs");
