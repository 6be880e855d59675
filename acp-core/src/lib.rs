//! acp-core: the asynchronous checkpoint engine.
//!
//! (Crate docs with a doctested quick start: engine owner.)

#![deny(unsafe_code)]

pub mod config;
pub mod error;
pub mod format;
pub mod io;
pub mod staging;
pub mod storage;

pub use config::{DirectIo, EngineConfig, IoChoice, Verify, WhenFull};
pub use error::{Error, ErrorKind, Result};
pub use format::{Dtype, TensorSpec};
mod engine;

pub use engine::{
    Checkpoint, Engine, HostTensor, LoadReport, LoadRequest, OpenReport, SaveHandle, SaveOptions,
    SaveReport, Source, Staging, TensorView,
};
pub use format::Entry;
pub use io::IoKind;
