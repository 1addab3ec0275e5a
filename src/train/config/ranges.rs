//! Range checks of numeric options, with errors naming the option and the range.

use crate::error::{Error, Result};
use Bound::{Closed, Open};

/// AdamW and clipping options, named as every trainer spells them.
#[derive(Debug, Clone, Copy)]
pub struct OptimizerOptions {
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub weight_decay: f64,
    pub max_grad_norm: f64,
}

/// Ranges that keep AdamW's update finite (a zero epsilon divides by zero
/// for a parameter whose gradient is zero); `section` prefixes the option
/// names in errors (`train.`, or none).
pub fn check_optimizer(section: &str, o: &OptimizerOptions) -> Result<()> {
    let name = |key: &str| format!("{section}{key}");
    in_range(&name("adam_beta1"), o.adam_beta1, Closed(0.0), Open(1.0))?;
    in_range(&name("adam_beta2"), o.adam_beta2, Closed(0.0), Open(1.0))?;
    positive(&name("adam_epsilon"), o.adam_epsilon)?;
    non_negative(&name("weight_decay"), o.weight_decay)?;
    non_negative(&name("max_grad_norm"), o.max_grad_norm)
}

/// One end of an allowed range of a numeric option.
#[derive(Debug, Clone, Copy)]
pub enum Bound {
    Open(f64),
    Closed(f64),
}

/// `value` must be finite and within `[lo, hi]` (or open at either end);
/// the error names the option and the range.
pub fn in_range(name: &str, value: f64, lo: Bound, hi: Bound) -> Result<()> {
    let ok_lo = match lo {
        Open(l) => value > l,
        Closed(l) => value >= l,
    };
    let ok_hi = match hi {
        Open(h) => value < h,
        Closed(h) => value <= h,
    };
    if value.is_finite() && ok_lo && ok_hi {
        return Ok(());
    }
    let range = match (lo, hi) {
        (Open(l), Open(h)) if l == f64::NEG_INFINITY && h == f64::INFINITY => "a finite number".to_string(),
        (Open(l), Open(h)) if h == f64::INFINITY => format!("> {l}"),
        (Closed(l), Open(h)) if h == f64::INFINITY => format!(">= {l}"),
        _ => {
            let (open, l) = match lo {
                Open(l) => ('(', l),
                Closed(l) => ('[', l),
            };
            let (close, h) = match hi {
                Open(h) => (')', h),
                Closed(h) => (']', h),
            };
            format!("in {open}{l}, {h}{close}")
        }
    };
    Err(Error::Invalid(format!("{name} must be {range}, got {value}")))
}

pub fn positive(name: &str, value: f64) -> Result<()> {
    in_range(name, value, Open(0.0), Open(f64::INFINITY))
}

pub fn non_negative(name: &str, value: f64) -> Result<()> {
    in_range(name, value, Closed(0.0), Open(f64::INFINITY))
}

pub fn finite(name: &str, value: f64) -> Result<()> {
    in_range(name, value, Open(f64::NEG_INFINITY), Open(f64::INFINITY))
}
