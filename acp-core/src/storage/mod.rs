//! Storage-side helpers: fault injection for drills and tests.

pub mod faults;
pub mod local;
