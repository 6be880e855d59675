//! The Rust program of the repository's `examples/` folder: the README's
//! quick start runs, and README.md shows it exactly as the example file has
//! it (so the README's code is the code that is compiled and run).
//! `tests/test_examples.py` does the same for the Python quick start.

mod quickstart {
    include!("../../examples/quickstart.rs");

    pub(crate) fn run() -> acp_core::Result<()> {
        main()
    }
}

const README: &str = include_str!("../../README.md");

/// The body of the first fenced block of language `lang` after the line
/// `heading` of README.md.
fn readme_block(heading: &str, lang: &str) -> &'static str {
    let Some(at) = README.find(&format!("\n{heading}\n")) else {
        panic!("README.md has no heading {heading:?}");
    };
    let rest = &README[at..];
    let fence = format!("\n```{lang}\n");
    let Some(open) = rest.find(&fence) else {
        panic!("README.md: no ```{lang} block after {heading:?}");
    };
    let body = &rest[open + fence.len()..];
    let Some(close) = body.find("\n```\n") else {
        panic!("README.md: the ```{lang} block after {heading:?} is not closed");
    };
    &body[..=close]
}

#[test]
fn rust_quick_start_runs() {
    quickstart::run().expect("examples/quickstart.rs");
}

#[test]
fn readme_shows_the_rust_quick_start() {
    assert_eq!(
        readme_block("## Quick start: Rust", "rust"),
        include_str!("../../examples/quickstart.rs"),
        "README.md's Rust quick start differs from examples/quickstart.rs: update one from the other"
    );
}
