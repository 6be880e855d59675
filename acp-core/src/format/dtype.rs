//! Element types, named as safetensors names them.

/// An element type. Names and sizes follow safetensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// `F64`
    F64,
    /// `F32`
    F32,
    /// `F16`
    F16,
    /// `BF16`
    BF16,
    /// `F8_E4M3`
    F8E4M3,
    /// `F8_E5M2`
    F8E5M2,
    /// `I64`
    I64,
    /// `I32`
    I32,
    /// `I16`
    I16,
    /// `I8`
    I8,
    /// `U64`
    U64,
    /// `U32`
    U32,
    /// `U16`
    U16,
    /// `U8`
    U8,
    /// `BOOL` (one byte per element)
    Bool,
}

impl Dtype {
    /// Every dtype.
    pub const ALL: [Dtype; 15] = [
        Dtype::F64,
        Dtype::F32,
        Dtype::F16,
        Dtype::BF16,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
        Dtype::I64,
        Dtype::I32,
        Dtype::I16,
        Dtype::I8,
        Dtype::U64,
        Dtype::U32,
        Dtype::U16,
        Dtype::U8,
        Dtype::Bool,
    ];

    /// The safetensors name, e.g. `"BF16"`, `"F8_E4M3"`.
    #[must_use]
    pub fn name(self) -> &'static str {
        todo!()
    }

    /// Parses a safetensors dtype name; `None` for an unknown one.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Dtype> {
        todo!()
    }

    /// Bytes per element.
    #[must_use]
    pub fn size(self) -> usize {
        todo!()
    }
}
