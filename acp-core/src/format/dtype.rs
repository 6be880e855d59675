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
        match self {
            Dtype::F64 => "F64",
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::I64 => "I64",
            Dtype::I32 => "I32",
            Dtype::I16 => "I16",
            Dtype::I8 => "I8",
            Dtype::U64 => "U64",
            Dtype::U32 => "U32",
            Dtype::U16 => "U16",
            Dtype::U8 => "U8",
            Dtype::Bool => "BOOL",
        }
    }

    /// Parses a safetensors dtype name; `None` for an unknown one.
    #[must_use]
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == name)
    }

    /// Bytes per element.
    #[must_use]
    pub fn size(self) -> usize {
        usize::from(self.width())
    }

    /// Bytes per element as a `u64`, for offset arithmetic.
    pub(crate) fn size_u64(self) -> u64 {
        u64::from(self.width())
    }

    fn width(self) -> u8 {
        match self {
            Dtype::F64 | Dtype::I64 | Dtype::U64 => 8,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::F16 | Dtype::BF16 | Dtype::I16 | Dtype::U16 => 2,
            Dtype::F8E4M3 | Dtype::F8E5M2 | Dtype::I8 | Dtype::U8 | Dtype::Bool => 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
            assert_eq!(d.size_u64(), d.size() as u64);
        }
        assert_eq!(Dtype::from_name("f32"), None);
        assert_eq!(Dtype::from_name("F8E4M3"), None);
        assert_eq!(Dtype::from_name(""), None);
    }

    #[test]
    fn sizes_match_safetensors() {
        let expected = [
            ("F64", 8),
            ("F32", 4),
            ("F16", 2),
            ("BF16", 2),
            ("F8_E4M3", 1),
            ("F8_E5M2", 1),
            ("I64", 8),
            ("I32", 4),
            ("I16", 2),
            ("I8", 1),
            ("U64", 8),
            ("U32", 4),
            ("U16", 2),
            ("U8", 1),
            ("BOOL", 1),
        ];
        for (name, size) in expected {
            assert_eq!(Dtype::from_name(name).unwrap().size(), size, "{name}");
        }
    }
}
