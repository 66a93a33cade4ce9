//! Summary statistics of timing samples.
//!
//! Percentile rule (used for the median, p10 and p90 alike): sort the samples ascending into
//! `x[0] <= ... <= x[n-1]`, put the p-quantile at the fractional index `h = p * (n - 1)` and
//! interpolate linearly between its two neighbours:
//! `q(p) = x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])`.
//! This is the "linear" rule (Hyndman & Fan type 7). It gives the textbook median (mean of the two
//! middle samples for even `n`), `q(0) = min`, `q(1) = max`, and never leaves `[min, max]`.

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// Median, spread and extremes of a set of samples (for timings: microseconds per rep).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub min: f64,
    pub max: f64,
    pub mean: f64,
    /// Number of samples summarised.
    pub n: usize,
}

impl Summary {
    /// Summarise `samples` (any order). Errors on an empty slice or on any NaN / infinite sample,
    /// naming the index of the first bad one.
    pub fn of(samples: &[f64]) -> Result<Summary> {
        if samples.is_empty() {
            bail!("cannot summarise an empty set of samples");
        }
        if let Some((index, value)) = samples.iter().enumerate().find(|(_, v)| !v.is_finite()) {
            bail!(
                "sample {index} of {} is {value}; every sample must be finite",
                samples.len()
            );
        }
        let mut sorted = samples.to_vec();
        // All values are finite, so `total_cmp` is the ordinary numeric order here.
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let mean = sorted.iter().sum::<f64>() / n as f64;
        Ok(Summary {
            median: percentile_of_sorted(&sorted, 0.5)?,
            p10: percentile_of_sorted(&sorted, 0.1)?,
            p90: percentile_of_sorted(&sorted, 0.9)?,
            min: sorted[0],
            max: sorted[n - 1],
            mean,
            n,
        })
    }
}

/// The `p`-quantile (`0 <= p <= 1`) of ascending `sorted` samples by the linear-interpolation rule in
/// the module docs. Errors on an empty slice or `p` outside `[0, 1]`; the caller guarantees the order.
pub fn percentile_of_sorted(sorted: &[f64], p: f64) -> Result<f64> {
    if sorted.is_empty() {
        bail!("cannot take a percentile of an empty set of samples");
    }
    if !(0.0..=1.0).contains(&p) {
        bail!("percentile fraction {p} is outside [0, 1]");
    }
    let h = p * (sorted.len() - 1) as f64;
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    let frac = h - lo as f64;
    Ok(sorted[lo] + frac * (sorted[hi] - sorted[lo]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn four_samples_interpolate() {
        // h(0.5) = 1.5 -> 2.5; h(0.1) = 0.3 -> 1.3; h(0.9) = 2.7 -> 3.7.
        let s = Summary::of(&[4.0, 1.0, 3.0, 2.0]).unwrap();
        assert_eq!(s.median, 2.5);
        assert!((s.p10 - 1.3).abs() < 1e-12, "{}", s.p10);
        assert!((s.p90 - 3.7).abs() < 1e-12, "{}", s.p90);
        assert_eq!((s.min, s.max, s.mean, s.n), (1.0, 4.0, 2.5, 4));
    }

    #[test]
    fn single_sample_is_every_statistic() {
        let s = Summary::of(&[7.25]).unwrap();
        assert_eq!(
            (s.median, s.p10, s.p90, s.min, s.max, s.mean),
            (7.25, 7.25, 7.25, 7.25, 7.25, 7.25)
        );
    }

    #[test]
    fn eleven_random_samples_hit_exact_ranks() {
        // With n = 11 the fractional indices 0.1*10, 0.5*10, 0.9*10 are whole numbers, so the
        // quantiles are exactly the 2nd, 6th and 10th smallest samples, whatever the input order.
        let seed = rand::rng().random::<u64>();
        println!("seed {seed}");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut ranked: Vec<f64> = (0..11).map(|_| rng.random_range(1.0..1000.0)).collect();
        ranked.sort_by(f64::total_cmp);
        let mut shuffled = ranked.clone();
        shuffled.shuffle(&mut rng);
        let s = Summary::of(&shuffled).unwrap();
        assert_eq!(s.p10, ranked[1]);
        assert_eq!(s.median, ranked[5]);
        assert_eq!(s.p90, ranked[9]);
        assert_eq!(s.min, ranked[0]);
        assert_eq!(s.max, ranked[10]);
        let mean = ranked.iter().sum::<f64>() / 11.0;
        assert!((s.mean - mean).abs() <= 1e-12 * mean);
    }

    #[test]
    fn random_samples_keep_order_between_statistics() {
        let seed = rand::rng().random::<u64>();
        println!("seed {seed}");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        for n in [2usize, 3, 10, 101] {
            let v: Vec<f64> = (0..n).map(|_| rng.random_range(-5.0..5.0)).collect();
            let s = Summary::of(&v).unwrap();
            assert!(s.min <= s.p10 && s.p10 <= s.median && s.median <= s.p90 && s.p90 <= s.max);
            assert!(s.min <= s.mean && s.mean <= s.max);
            // At most half of the samples lie strictly below the median, and at most half above.
            let below = v.iter().filter(|&&x| x < s.median).count();
            let above = v.iter().filter(|&&x| x > s.median).count();
            assert!(
                2 * below <= n && 2 * above <= n,
                "n={n} below={below} above={above}"
            );
        }
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(Summary::of(&[]).unwrap_err().to_string().contains("empty"));
        let err = Summary::of(&[1.0, f64::NAN]).unwrap_err().to_string();
        assert!(err.contains("sample 1"), "{err}");
        assert!(Summary::of(&[f64::INFINITY]).is_err());
        assert!(percentile_of_sorted(&[1.0], 1.5).is_err());
        assert!(percentile_of_sorted(&[1.0], -0.1).is_err());
    }
}
