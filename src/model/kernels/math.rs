//! Branch-free `exp` and `erf` for f32 that loops over slices vectorise
//! (libm's are scalar calls), and [`with_avx2`], which compiles a hot loop
//! for AVX2 and FMA when the CPU has them: the crate itself targets
//! baseline x86-64.

/// e^x, within 2 ulp; 0 below -87.3 (where e^x is subnormal).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that n ln 2 is exact for the n that occur.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to an integer, which then sits in the low
    // mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let xc = x.clamp(-87.3, 88.7);
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = xc - n * LN2_HI - n * LN2_LO;
    // e^r on [-ln2/2, ln2/2]: Cephes' expf polynomial.
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let er = p * r * r + r + 1.0;
    let n = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let scale = f32::from_bits(((n + 127) << 23) as u32);
    let y = er * scale;
    if x < -87.3 {
        0.0
    } else {
        y
    }
}

/// The error function, within 3e-7: its Taylor series near 0, where the
/// tail formula would cancel, and Abramowitz and Stegun 7.1.26 (1.5e-7)
/// beyond.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    // 2/sqrt(pi) (x - x^3/3 + x^5/10 - x^7/42 + ...), to x^17: the next
    // term is below 1e-9 for |x| < 0.75.
    let z = x * x;
    let series = 1.0 / 685_440.0;
    let series = series * z - 1.0 / 75_600.0;
    let series = series * z + 1.0 / 9_360.0;
    let series = series * z - 1.0 / 1_320.0;
    let series = series * z + 1.0 / 216.0;
    let series = series * z - 1.0 / 42.0;
    let series = series * z + 0.1;
    let series = series * z - 1.0 / 3.0;
    let series = (series * z + 1.0) * x * std::f32::consts::FRAC_2_SQRT_PI;
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t * (0.254_829_6 + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152_1 + t * 1.061_405_4))));
    let tail = (1.0 - poly * exp(-z)).copysign(x);
    if a < 0.75 {
        series
    } else {
        tail
    }
}

/// The dot product, with eight partial sums so that it vectorises.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for j in 0..8 {
            acc[j] += x[j] * y[j];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `out += w * x` over rows of equal length, eight lanes at a time. Each
/// block is read whole before it is written: a plain zip loop over a
/// head-sized row unrolls into scalar code, the compiler unable to show
/// that its stores miss the next loads.
#[inline(always)]
pub fn axpy(out: &mut [f32], w: f32, x: &[f32]) {
    let (mut o8, x8) = (out.chunks_exact_mut(8), x.chunks_exact(8));
    let tail = x8.remainder();
    for (o, x) in (&mut o8).zip(x8) {
        let mut sum = [0f32; 8];
        for l in 0..8 {
            sum[l] = o[l] + w * x[l];
        }
        o.copy_from_slice(&sum);
    }
    for (o, x) in o8.into_remainder().iter_mut().zip(tail) {
        *o += w * x;
    }
}

/// The sum of `f(x)` over a row, with eight partial sums so that the loop
/// vectorises.
#[inline(always)]
pub fn sum_of(row: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = row.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|&x| f(x)).sum();
    for c in chunks {
        for j in 0..8 {
            acc[j] += f(c[j]);
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// The largest element (-inf for an empty row), with eight running maxima
/// so the loop vectorises.
#[inline(always)]
pub fn max(row: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; 8];
    let chunks = row.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            m[j] = m[j].max(c[j]);
        }
    }
    tail.iter().chain(&m).fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// Runs `f`, compiled for AVX2 and FMA where the CPU has them.
#[inline(always)]
pub fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // Safety: the features were just detected.
            return unsafe { avx2(f) };
        }
    }
    f()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut x = -87.0f32;
        while x < 88.0 {
            let (got, want) = (exp(x), x.exp());
            assert!((got - want).abs() <= 2.5e-7 * want, "exp({x}) = {got}, libm {want}");
            x += 0.0137;
        }
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn erf_is_within_3e7_of_candles() {
        let mut x = -6.0f32;
        while x < 6.0 {
            let want = candle_core::cpu::erf::erf_f64(x as f64) as f32;
            assert!((erf(x) - want).abs() < 3e-7, "erf({x}) = {}, want {want}", erf(x));
            x += 0.001;
        }
    }
}
