//! Element types a tensor can be stored in, and the model-wide precision policy.

/// Storage type of a tensor. Arithmetic is always `f32`; this is what the bytes hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    F32,
    F16,
    BF16,
    U8,
    I32,
}

impl DType {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }

    /// Name used in the plan JSON and in messages.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::U8 => "u8",
            DType::I32 => "i32",
        }
    }

    /// True for the floating-point types a layer can compute in.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// True for the 16-bit floating-point types (mixed precision).
    pub const fn is_half(self) -> bool {
        matches!(self, DType::F16 | DType::BF16)
    }

    /// Parses "f32", "float32", "f16", "float16", "bf16", "bfloat16", "u8", "uint8", "i32", "int32".
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "f32" | "float32" => DType::F32,
            "f16" | "float16" => DType::F16,
            "bf16" | "bfloat16" => DType::BF16,
            "u8" | "uint8" => DType::U8,
            "i32" | "int32" => DType::I32,
            _ => return None,
        })
    }
}

/// The model-wide mixed-precision policy (Keras's `mixed_precision.set_global_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    Float32,
    MixedFloat16,
    MixedBFloat16,
}

impl Precision {
    /// The dtype layers compute and store activations in under this policy.
    pub const fn compute_dtype(self) -> DType {
        match self {
            Precision::Float32 => DType::F32,
            Precision::MixedFloat16 => DType::F16,
            Precision::MixedBFloat16 => DType::BF16,
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            Precision::Float32 => "float32",
            Precision::MixedFloat16 => "mixed_float16",
            Precision::MixedBFloat16 => "mixed_bfloat16",
        }
    }

    pub fn parse(s: &str) -> Option<Precision> {
        Some(match s {
            "float32" => Precision::Float32,
            "mixed_float16" => Precision::MixedFloat16,
            "mixed_bfloat16" => Precision::MixedBFloat16,
            _ => return None,
        })
    }
}
