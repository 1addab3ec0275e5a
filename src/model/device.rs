//! Choosing where tensors live: `cpu`, `cuda[:N]`, or `auto` (the first GPU
//! when rloo was built with the `cuda` feature and one is present).

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub fn parse_device(name: &str) -> Result<Device> {
    let cuda = |ordinal: usize| Device::new_cuda(ordinal).map_err(|e| Error::Invalid(format!("--device {name}: {e}")));
    match name {
        "cpu" => Ok(Device::Cpu),
        "auto" => Ok(Device::cuda_if_available(0).unwrap_or(Device::Cpu)),
        "cuda" | "gpu" => cuda(0),
        _ => match name.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(ordinal)) => cuda(ordinal),
            _ => Err(Error::Invalid(format!("--device `{name}` is not a device (expected cpu, auto, cuda or cuda:N)"))),
        },
    }
}

/// The dtype a model computes in: `f32`, or `bf16` mixed precision (bf16
/// weights and activations; f32 master weights, optimizer state,
/// log-softmax and losses).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    #[default]
    #[serde(alias = "float32", alias = "fp32")]
    F32,
    #[serde(alias = "bfloat16")]
    Bf16,
}

impl Precision {
    /// From a `--bf16` switch.
    pub fn from_bf16(bf16: bool) -> Self {
        if bf16 {
            Self::Bf16
        } else {
            Self::F32
        }
    }

    pub fn dtype(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_or_are_explained() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        let err = parse_device("tpu").unwrap_err().to_string();
        assert!(err.contains("`tpu`") && err.contains("cuda:N"), "{err}");
    }
}
