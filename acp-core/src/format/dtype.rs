//! Element types, named as safetensors names them.
//!
//! Version 5 of the format ([`DTYPES_VERSION`](super::DTYPES_VERSION))
//! added `C64`, `F8_E4M3FNUZ`, `F8_E5M2FNUZ` and `F8_E8M0`; a data file
//! that holds one of them says so in its `acp.version`
//! ([`Dtype::since`]), so a build that predates them refuses it as a
//! newer format instead of calling it corrupt.

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
    /// `C64`: a complex number of two `F32`, real part first (torch's
    /// `complex64`, as in the rotary `freqs_cis` buffers of Llama-style
    /// models).
    C64,
    /// `F8_E4M3FNUZ` (torch's `float8_e4m3fnuz`)
    F8E4M3Fnuz,
    /// `F8_E5M2FNUZ` (torch's `float8_e5m2fnuz`)
    F8E5M2Fnuz,
    /// `F8_E8M0`: an 8-bit exponent, the scale of MX formats (torch's
    /// `float8_e8m0fnu`)
    F8E8M0,
}

impl Dtype {
    /// Every dtype.
    pub const ALL: [Dtype; 19] = [
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
        Dtype::C64,
        Dtype::F8E4M3Fnuz,
        Dtype::F8E5M2Fnuz,
        Dtype::F8E8M0,
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
            Dtype::C64 => "C64",
            Dtype::F8E4M3Fnuz => "F8_E4M3FNUZ",
            Dtype::F8E5M2Fnuz => "F8_E5M2FNUZ",
            Dtype::F8E8M0 => "F8_E8M0",
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

    /// The bytes of the scalars an element is made of: its size, but for
    /// `C64`, two `F32` (4). The byte planes of a compressed chunk group
    /// bytes of this width ([`crate::codec`]), so a complex tensor's
    /// exponent bytes land together as a float tensor's do.
    #[must_use]
    pub fn scalar_size(self) -> usize {
        match self {
            Dtype::C64 => 4,
            d => d.size(),
        }
    }

    /// The format version that added this dtype: the `acp.version` a data
    /// file holding it is written in (at least).
    #[must_use]
    pub fn since(self) -> u32 {
        match self {
            Dtype::C64 | Dtype::F8E4M3Fnuz | Dtype::F8E5M2Fnuz | Dtype::F8E8M0 => {
                super::DTYPES_VERSION
            }
            _ => super::PLAIN_VERSION,
        }
    }

    fn width(self) -> u8 {
        match self {
            Dtype::F64 | Dtype::I64 | Dtype::U64 | Dtype::C64 => 8,
            Dtype::F32 | Dtype::I32 | Dtype::U32 => 4,
            Dtype::F16 | Dtype::BF16 | Dtype::I16 | Dtype::U16 => 2,
            Dtype::F8E4M3
            | Dtype::F8E5M2
            | Dtype::F8E4M3Fnuz
            | Dtype::F8E5M2Fnuz
            | Dtype::F8E8M0
            | Dtype::I8
            | Dtype::U8
            | Dtype::Bool => 1,
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
        // Names safetensors has that acp does not store: refused by name.
        for unknown in ["F4", "F6_E2M3", "F6_E3M2", "C128"] {
            assert_eq!(Dtype::from_name(unknown), None, "{unknown}");
        }
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
            ("C64", 8),
            ("F8_E4M3FNUZ", 1),
            ("F8_E5M2FNUZ", 1),
            ("F8_E8M0", 1),
        ];
        for (name, size) in expected {
            assert_eq!(Dtype::from_name(name).unwrap().size(), size, "{name}");
        }
        assert_eq!(expected.len(), Dtype::ALL.len());
    }

    #[test]
    fn new_dtypes_carry_their_version_and_complex_groups_as_f32() {
        for d in Dtype::ALL {
            let new = matches!(
                d,
                Dtype::C64 | Dtype::F8E4M3Fnuz | Dtype::F8E5M2Fnuz | Dtype::F8E8M0
            );
            let want = if new {
                crate::format::DTYPES_VERSION
            } else {
                crate::format::PLAIN_VERSION
            };
            assert_eq!(d.since(), want, "{}", d.name());
            assert!(d.since() <= crate::format::FORMAT_VERSION);
            assert_eq!(d.size() % d.scalar_size(), 0);
        }
        assert_eq!(Dtype::C64.scalar_size(), 4);
        assert_eq!(Dtype::F64.scalar_size(), 8);
    }
}
