//! Fixtures shared by the acp benchmarks.
