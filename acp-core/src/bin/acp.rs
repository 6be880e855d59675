//! `acp`: see, check and repair acp checkpoints. The same program as the
//! `acp` command the Python wheel installs ([`acp_core::cli`]); this build
//! has no framework, so conversions to and from torch and MindSpore files
//! are left to the wheel's.
//!
//! Build with `cargo build -p acp-core --features cli --bin acp`.

use std::process::ExitCode;

fn main() -> ExitCode {
    ExitCode::from(acp_core::cli::run(
        std::env::args_os(),
        &acp_core::cli::NoFramework,
    ))
}
