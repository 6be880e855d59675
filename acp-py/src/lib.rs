//! Python bindings of acp-core: the extension module `acp._acp`.
//!
//! This crate is thin: it converts arguments, releases the GIL around every
//! call into the engine and maps errors to the exception classes of
//! [`errors`]. The Python package `acp` builds the user-facing API on it.

mod cli;
mod engine;
mod errors;
#[cfg(feature = "test-util")]
mod faults;
mod load;
mod ops;
mod replica;
mod save;
mod tensors;

use pyo3::prelude::*;

/// The `acp._acp` extension module.
#[pymodule]
fn _acp(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", acp_core::format::FORMAT_VERSION)?;
    m.add("MAX_VALUES_DEPTH", acp_core::format::MAX_VALUES_DEPTH)?;
    m.add_class::<engine::Engine>()?;
    m.add_class::<save::Staging>()?;
    m.add_class::<save::SaveHandle>()?;
    m.add_class::<save::SavePlan>()?;
    m.add_class::<load::Loaded>()?;
    m.add_class::<replica::ReplicaImage>()?;
    m.add_class::<replica::Receipt>()?;
    #[cfg(feature = "test-util")]
    m.add_class::<faults::FaultInjector>()?;
    m.add_function(wrap_pyfunction!(tensors::read_only_target, m)?)?;
    ops::register(m)?;
    cli::register(m)?;
    for (name, class) in errors::classes(m.py())?.named() {
        m.add(name, class.clone_ref(m.py()))?;
    }
    Ok(())
}
