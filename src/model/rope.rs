//! Rotary position embeddings: the config keys of both transformers dialects,
//! the frequency table (with `linear` and `llama3` scaling), and the
//! per-row cos/sin tables.
//!
//! transformers 4.x writes `rope_theta` (`rotary_emb_base` for GPT-NeoX),
//! `rope_scaling` and `rotary_pct` / `partial_rotary_factor` at the top level;
//! 5.x writes one `rope_parameters` object holding `rope_type`, `rope_theta`,
//! `partial_rotary_factor` and the scaling fields. Both resolve to [`Rope`].

use candle_core::{DType, Device, Result as TResult, Tensor};
use serde::Deserialize;
use serde_json::Value;

/// The rotary keys a `config.json` may carry, in either dialect.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RawRope {
    pub rope_theta: Option<f64>,
    pub rotary_emb_base: Option<f64>,
    pub rope_scaling: Option<Value>,
    pub rotary_pct: Option<f64>,
    pub partial_rotary_factor: Option<f64>,
    pub rope_parameters: Option<Value>,
}

#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f64,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub theta: f64,
    /// Leading features of each head that rotate (the rest pass through).
    pub rotary_dim: usize,
    pub scaling: RopeScaling,
}

impl RawRope {
    /// Resolves the keys against a head size and the architecture's default
    /// base. Errors are plain messages; the caller adds the file name.
    pub fn resolve(&self, head_dim: usize, default_theta: f64) -> Result<Rope, String> {
        let params = match &self.rope_parameters {
            Some(Value::Object(map)) => Some(map),
            Some(Value::Null) | None => None,
            Some(other) => return Err(format!("rope_parameters must be an object, got {other}")),
        };
        let scaling_map = match &self.rope_scaling {
            Some(Value::Object(map)) => Some(map),
            Some(Value::Null) | None => None,
            Some(other) => return Err(format!("rope_scaling must be an object or null, got {other}")),
        };
        // 5.x keeps everything in rope_parameters; 4.x splits it.
        let fields = params.or(scaling_map);
        let num = |key: &str| fields.and_then(|m| m.get(key)).and_then(Value::as_f64);

        let theta = params
            .and_then(|m| m.get("rope_theta"))
            .and_then(Value::as_f64)
            .or(self.rope_theta)
            .or(self.rotary_emb_base)
            .unwrap_or(default_theta);
        let fraction = params
            .and_then(|m| m.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or(self.partial_rotary_factor)
            .or(self.rotary_pct)
            .unwrap_or(1.0);
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(format!("partial rotary factor must be in (0, 1], got {fraction}"));
        }
        // transformers truncates: int(head_dim * partial_rotary_factor).
        let rotary_dim = (head_dim as f64 * fraction) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) {
            return Err(format!(
                "rotary dimension {rotary_dim} (head_dim {head_dim} x {fraction}) must be even and positive"
            ));
        }

        let rope_type = fields
            .and_then(|m| m.get("rope_type").or_else(|| m.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let factor = || num("factor").ok_or_else(|| format!("rope type `{rope_type}` needs `factor`"));
        let scaling = match rope_type {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: factor()? },
            "llama3" => {
                let need = |k: &str| num(k).ok_or_else(|| format!("rope type `llama3` needs `{k}`"));
                RopeScaling::Llama3 {
                    factor: factor()?,
                    low_freq_factor: need("low_freq_factor")?,
                    high_freq_factor: need("high_freq_factor")?,
                    original_max_position_embeddings: need("original_max_position_embeddings")?,
                }
            }
            other => return Err(format!("rope type `{other}` is not supported (supported: default, linear, llama3)")),
        };
        Ok(Rope { theta, rotary_dim, scaling })
    }
}

impl Rope {
    /// Inverse frequencies, one per rotated pair: `theta^(-2i/R)`, then scaled.
    pub fn inv_freq(&self) -> Vec<f32> {
        let r = self.rotary_dim;
        let base: Vec<f64> = (0..r / 2).map(|i| 1.0 / self.theta.powf((2 * i) as f64 / r as f64)).collect();
        match self.scaling {
            RopeScaling::None => base.iter().map(|&f| f as f32).collect(),
            RopeScaling::Linear { factor } => base.iter().map(|&f| (f / factor) as f32).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old_len,
            } => {
                // Long wavelengths are slowed by `factor`, short ones kept, and
                // the band between interpolated (transformers'
                // `_compute_llama3_parameters`).
                let low_freq_wavelen = old_len / low_freq_factor;
                let high_freq_wavelen = old_len / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        let scaled = if wavelen > low_freq_wavelen {
                            f / factor
                        } else if wavelen < high_freq_wavelen {
                            f
                        } else {
                            let smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        };
                        scaled as f32
                    })
                    .collect()
            }
        }
    }

    /// cos and sin tables for a batch of positions, shaped to broadcast over
    /// heads. positions: (B, T) u32 -> two tensors (B, 1, T, R).
    pub fn cos_sin(&self, inv_freq: &Tensor, positions: &Tensor) -> TResult<(Tensor, Tensor)> {
        let (b, t) = positions.dims2()?;
        let pos = positions.to_dtype(DType::F32)?.reshape((b, t, 1))?;
        // (B, T, 1) x (1, 1, R/2) -> (B, T, R/2), duplicated to (B, T, R) for rotate-half.
        let freqs = pos.broadcast_mul(&inv_freq.reshape((1, 1, ()))?)?;
        let emb = Tensor::cat(&[&freqs, &freqs], 2)?;
        Ok((emb.cos()?.unsqueeze(1)?, emb.sin()?.unsqueeze(1)?))
    }

    pub fn inv_freq_tensor(&self, device: &Device) -> TResult<Tensor> {
        let f = self.inv_freq();
        Tensor::from_vec(f.clone(), f.len(), device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn raw(v: Value) -> RawRope {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn both_dialects_resolve_to_the_same_rope() {
        let v4 = raw(json!({"rotary_pct": 0.25, "rotary_emb_base": 10000}));
        let v5 = raw(
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": 10000, "partial_rotary_factor": 0.25}}),
        );
        let a = v4.resolve(16, 1.0).unwrap();
        assert_eq!(a, v5.resolve(16, 1.0).unwrap());
        assert_eq!(a.rotary_dim, 4);
        assert_eq!(a.theta, 10000.0);

        let l4 = raw(json!({"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}));
        let l5 = raw(json!({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}));
        assert_eq!(l4.resolve(64, 1.0).unwrap(), l5.resolve(64, 1.0).unwrap());
    }

    #[test]
    fn llama3_scaling_slows_only_long_wavelengths() {
        let rope = raw(json!({"rope_theta": 500000.0, "rope_scaling": {"type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}))
        .resolve(16, 1.0)
        .unwrap();
        let plain = Rope { scaling: RopeScaling::None, ..rope.clone() }.inv_freq();
        let scaled = rope.inv_freq();
        assert_eq!(scaled[0], plain[0], "wavelength 2pi < 64/4 stays");
        assert!((scaled[7] - plain[7] / 8.0).abs() < 1e-12, "longest wavelength divided by factor");
    }

    #[test]
    fn unknown_rope_types_are_named() {
        let err = raw(json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})).resolve(16, 1e4).unwrap_err();
        assert!(err.contains("`yarn`") && err.contains("llama3"), "{err}");
    }
}
