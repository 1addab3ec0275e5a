//! Summary statistics over f64 values. Sums run in the order given, so that
//! the same values give the same bits however a run is threaded.

/// Which variance a standard deviation is the root of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Deviation {
    /// Over `n`.
    Population,
    /// Over `n - 1`, as `torch.std`; 0 for a single value.
    Sample,
}

/// The mean; `None` for no values.
pub fn mean(xs: &[f64]) -> Option<f64> {
    (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64)
}

/// The mean and standard deviation; `None` for no values.
pub fn mean_std(xs: &[f64], deviation: Deviation) -> Option<(f64, f64)> {
    let mean = mean(xs)?;
    let squares: f64 = xs.iter().map(|x| (x - mean).powi(2)).sum();
    let var = match (deviation, xs.len()) {
        (Deviation::Population, n) => squares / n as f64,
        (Deviation::Sample, 1) => 0.0,
        (Deviation::Sample, n) => squares / (n - 1) as f64,
    };
    Some((mean, var.sqrt()))
}

/// The nearest-rank percentile (`q` in [0, 1]) of sorted values.
pub fn percentile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    Some(sorted[rank.clamp(1, sorted.len()) - 1])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn population_and_sample_deviations() {
        let xs = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0];
        assert_eq!(mean_std(&xs, Deviation::Population), Some((5.0, 2.0)));
        let (_, sample) = mean_std(&xs, Deviation::Sample).unwrap();
        assert!((sample - (32.0f64 / 7.0).sqrt()).abs() < 1e-12);
        assert_eq!(mean_std(&[3.0], Deviation::Sample), Some((3.0, 0.0)));
        assert_eq!(mean_std(&[], Deviation::Population), None);
        assert_eq!(mean(&[]), None);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let xs: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&xs, 0.5), Some(10.0));
        assert_eq!(percentile(&xs, 0.95), Some(19.0));
        assert_eq!(percentile(&xs, 0.0), Some(1.0));
        assert_eq!(percentile(&xs, 1.0), Some(20.0));
        assert_eq!(percentile(&[], 0.5), None);
    }
}
