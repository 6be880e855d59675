//! Python bindings of acp-core (module `acp._acp`).

use pyo3::prelude::*;

/// The `acp._acp` extension module.
#[pymodule]
fn _acp(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
