//! Several reward sources into one score per sample, and the shaping of
//! that score (docs/algorithm.md section 1):
//!
//! `s_i = sum_j w_j * r_j(i)`, then `s_i -= penalty` when completion `i`
//! has no EOS, then optionally `s = (s - mean(s)) / (std(s) + 1e-8)` over the
//! batch, then optionally `s = clip(s, lo, hi)`. This is the order of TRL's
//! RLOO trainer (`missing_eos_penalty`, then `normalize_reward` and
//! `reward_clip_range`).

use super::{drop_non_finite, RewardSource, Sample};
use crate::error::{Error, Result};
use crate::stats::Deviation;

/// Weighted reward sources with distinct names.
#[derive(Default)]
pub struct RewardSet {
    sources: Vec<(Box<dyn RewardSource>, f32)>,
}

/// The scores of one batch.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Scores {
    /// Each source's own scores (before weighting), in the order the sources
    /// were added; non-finite scores are already `None`.
    pub per_source: Vec<(String, Vec<Option<f32>>)>,
    /// `sum_j w_j r_j` over the sources with a non-zero weight that scored
    /// the sample; `None` (unscorable) when none of them did.
    pub total: Vec<Option<f32>>,
    /// How many NaN or infinite scores each source returned (dropped to
    /// `None`, and warned about).
    pub non_finite: Vec<(String, usize)>,
    /// The requests of the sources that make any.
    pub calls: Vec<(String, super::CallStats)>,
}

impl Scores {
    /// The scores of several shares of one batch, in order, as one batch's.
    pub fn concat(parts: Vec<Scores>) -> Scores {
        let mut parts = parts.into_iter();
        let mut all = parts.next().unwrap_or_default();
        for part in parts {
            for ((_, mine), (_, theirs)) in all.per_source.iter_mut().zip(part.per_source) {
                mine.extend(theirs);
            }
            all.total.extend(part.total);
            for ((_, mine), (_, theirs)) in all.non_finite.iter_mut().zip(part.non_finite) {
                *mine += theirs;
            }
            for ((_, mine), (_, theirs)) in all.calls.iter_mut().zip(part.calls) {
                mine.items += theirs.items;
                mine.failures += theirs.failures;
                mine.latencies.extend(theirs.latencies);
            }
        }
        all
    }
}

impl RewardSet {
    pub fn new() -> RewardSet {
        RewardSet::default()
    }

    /// Adds a source; its name must differ from those already added, since
    /// names key the metrics.
    pub fn push(&mut self, source: Box<dyn RewardSource>, weight: f32) -> Result<()> {
        if !weight.is_finite() {
            return Err(Error::Invalid(format!(
                "reward `{}`: weight must be a finite number, got {weight}",
                source.name()
            )));
        }
        if self.sources.iter().any(|(s, _)| s.name() == source.name()) {
            return Err(Error::Invalid(format!(
                "two rewards are named `{}`; give each a distinct `name`",
                source.name()
            )));
        }
        self.sources.push((source, weight));
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.sources.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// The source names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.sources.iter().map(|(s, _)| s.name()).collect()
    }

    /// The weights, in order.
    pub fn weights(&self) -> Vec<f32> {
        self.sources.iter().map(|(_, w)| *w).collect()
    }

    /// The models the sources score with on the run's device, each with
    /// its source's name.
    pub fn models(&self) -> Vec<(&str, &crate::model::Model)> {
        self.sources.iter().flat_map(|(s, _)| s.models().into_iter().map(|m| (s.name(), m))).collect()
    }

    /// Runs [`RewardSource::check_rows`] of every source on the dataset.
    pub fn check_rows(&self, rows: &[&serde_json::Map<String, serde_json::Value>]) -> Result<()> {
        self.sources.iter().try_for_each(|(s, _)| s.check_rows(rows))
    }

    /// Scores a batch with every source and adds up the weighted scores.
    /// Sources score side by side, each on its own thread, so that one that
    /// waits on a service holds up no other.
    ///
    /// A sample scored by only some sources gets the weighted sum over those
    /// that scored it: a missing score counts as "no opinion", not as 0 and
    /// not as a veto, so that e.g. an exact-match rule on rows without an
    /// answer leaves the other rewards in charge. Sources with weight 0 are
    /// scored (for their metrics) but do not make a sample scorable.
    pub fn score(&self, samples: &[Sample]) -> Result<Scores> {
        let n = samples.len();
        let mut total: Vec<Option<f32>> = vec![None; n];
        let mut per_source = Vec::with_capacity(self.sources.len());
        let mut non_finite = Vec::with_capacity(self.sources.len());
        let mut calls = Vec::new();
        let scored: Vec<Result<Vec<Option<f32>>>> = if self.sources.len() == 1 {
            vec![self.sources[0].0.score(samples)]
        } else {
            std::thread::scope(|s| {
                let running: Vec<_> =
                    self.sources.iter().map(|(source, _)| s.spawn(|| source.score(samples))).collect();
                running.into_iter().map(|r| r.join().expect("a reward source panicked")).collect()
            })
        };
        for ((source, weight), scores) in self.sources.iter().zip(scored) {
            let name = source.name();
            let mut scores = scores?;
            if let Some(stats) = source.call_stats() {
                calls.push((name.to_string(), stats));
            }
            if scores.len() != n {
                return Err(Error::Invalid(format!(
                    "reward `{name}` returned {} scores for {n} samples",
                    scores.len()
                )));
            }
            let dropped = drop_non_finite(&mut scores);
            if dropped > 0 {
                tracing::warn!(
                    "reward `{name}`: {dropped} of {n} scores were NaN or infinite; \
                     those samples get no score from it"
                );
            }
            if *weight != 0.0 {
                for (t, s) in total.iter_mut().zip(&scores) {
                    if let Some(s) = s {
                        *t = Some(t.unwrap_or(0.0) + weight * s);
                    }
                }
            }
            per_source.push((name.to_string(), scores));
            non_finite.push((name.to_string(), dropped));
        }
        // A finite weight times a finite score can still overflow.
        let overflowed = drop_non_finite(&mut total);
        if overflowed > 0 {
            tracing::warn!(
                "{overflowed} of {n} weighted reward sums overflowed to infinity; \
                 those samples are unscorable"
            );
        }
        Ok(Scores { per_source, total, non_finite, calls })
    }
}

impl Scores {
    /// How many samples no source scored.
    pub fn unscorable(&self) -> usize {
        self.total.iter().filter(|s| s.is_none()).count()
    }

    /// `rewards/<name>/mean` and `rewards/<name>/std` (population standard
    /// deviation) over the samples each source scored; a source that scored
    /// nothing in the batch has no entry, so no NaN reaches the logs. Sources
    /// that make requests add `failures` and `latency_s/{p50,p95}`.
    pub fn metrics(&self) -> Vec<(String, f32)> {
        let mut out = Vec::new();
        for (name, scores) in &self.per_source {
            if let Some((mean, std)) = mean_std(scores, Deviation::Population) {
                out.push((format!("rewards/{name}/mean"), mean as f32));
                out.push((format!("rewards/{name}/std"), std as f32));
            }
        }
        for (name, stats) in &self.calls {
            out.extend(stats.metrics(name));
        }
        out
    }
}

/// Mean and standard deviation of the scored entries, `None` when there
/// are none.
fn mean_std(scores: &[Option<f32>], deviation: Deviation) -> Option<(f64, f64)> {
    let xs: Vec<f64> = scores.iter().flatten().map(|&x| x as f64).collect();
    crate::stats::mean_std(&xs, deviation)
}

/// `s_i - penalty` for each completion that did not end with a stop/EOS
/// token (it ran into the length limit); unscorable samples stay `None`.
pub fn missing_eos_penalty(scores: &[Option<f32>], ended_with_eos: &[bool], penalty: f32) -> Vec<Option<f32>> {
    assert_eq!(scores.len(), ended_with_eos.len(), "one EOS flag per score");
    scores.iter().zip(ended_with_eos).map(|(s, &eos)| s.map(|s| if eos { s } else { s - penalty })).collect()
}

/// Z-score over the scorable samples of the batch:
/// `(s - mean) / (std + 1e-8)` with the unbiased standard deviation, as
/// `torch.std` in TRL's `normalize_reward`. One scorable sample becomes 0
/// (where torch would give NaN); unscorable samples stay `None`.
pub fn normalize(scores: &[Option<f32>]) -> Vec<Option<f32>> {
    let Some((mean, std)) = mean_std(scores, Deviation::Sample) else {
        return scores.to_vec();
    };
    let denom = std + 1e-8;
    scores.iter().map(|s| s.map(|s| ((s as f64 - mean) / denom) as f32)).collect()
}

/// Each score clamped to `[lo, hi]`; unscorable samples stay `None`.
pub fn clip(scores: &[Option<f32>], lo: f32, hi: f32) -> Vec<Option<f32>> {
    assert!(lo <= hi, "clip range [{lo}, {hi}] is empty");
    scores.iter().map(|s| s.map(|s| s.clamp(lo, hi))).collect()
}

/// The score shaping, applied in the order of its fields: the options of
/// `[rloo]` as `RlooSection::shaping` gives them (defined and checked there).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shaping {
    /// Subtracted from the score of each completion that ended without a
    /// stop/EOS token (TRL's `missing_eos_penalty`). Off when unset.
    pub missing_eos_penalty: Option<f32>,
    /// Z-score the scores over each rollout batch (TRL's `normalize_reward`).
    pub normalize: bool,
    /// Clamp the scores to `[lo, hi]` after normalising. Off when unset.
    pub clip: Option<[f32; 2]>,
}

impl Shaping {
    /// Applies the penalty, normalisation and clipping that are switched on.
    pub fn apply(&self, scores: &[Option<f32>], ended_with_eos: &[bool]) -> Vec<Option<f32>> {
        let mut s = scores.to_vec();
        if let Some(p) = self.missing_eos_penalty {
            s = missing_eos_penalty(&s, ended_with_eos, p);
        }
        if self.normalize {
            s = normalize(&s);
        }
        if let Some([lo, hi]) = self.clip {
            s = clip(&s, lo, hi);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::test_support::*;

    /// Returns fixed scores, whatever the samples.
    struct Fixed(&'static str, Vec<Option<f32>>);

    impl RewardSource for Fixed {
        fn name(&self) -> &str {
            self.0
        }
        fn score(&self, _: &[Sample]) -> Result<Vec<Option<f32>>> {
            Ok(self.1.clone())
        }
    }

    fn set(sources: Vec<(Fixed, f32)>) -> RewardSet {
        let mut set = RewardSet::new();
        for (s, w) in sources {
            set.push(Box::new(s), w).unwrap();
        }
        set
    }

    fn close(a: &[Option<f32>], b: &[Option<f32>]) -> bool {
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| match (x, y) {
                (Some(x), Some(y)) => (x - y).abs() < 1e-5,
                (None, None) => true,
                _ => false,
            })
    }

    #[test]
    fn total_is_the_weighted_sum_over_sources_that_scored() {
        let set = set(vec![
            (Fixed("rm", vec![Some(1.0), Some(2.0), None, None]), 1.0),
            (Fixed("rule", vec![Some(10.0), None, Some(4.0), None]), 0.5),
        ]);
        let owned = completions(&["a", "b", "c", "d"]);
        let scores = set.score(&samples(&owned)).unwrap();
        // 1 + 0.5 * 10; rm only; rule only; nobody.
        assert_eq!(scores.total, [Some(6.0), Some(2.0), Some(2.0), None]);
        assert_eq!(scores.unscorable(), 1);
        assert_eq!(scores.per_source[1].0, "rule");
        assert_eq!(scores.per_source[1].1, [Some(10.0), None, Some(4.0), None]);
    }

    #[test]
    fn zero_weight_sources_are_reported_but_do_not_make_samples_scorable() {
        let set =
            set(vec![(Fixed("rm", vec![Some(1.0), None]), 1.0), (Fixed("watch", vec![Some(5.0), Some(5.0)]), 0.0)]);
        let owned = completions(&["a", "b"]);
        let scores = set.score(&samples(&owned)).unwrap();
        assert_eq!(scores.total, [Some(1.0), None]);
        assert_eq!(scores.per_source[1].1, [Some(5.0), Some(5.0)]);
    }

    #[test]
    fn nan_and_infinite_scores_are_dropped_and_counted() {
        let set = set(vec![
            (Fixed("rm", vec![Some(f32::NAN), Some(1.0), Some(f32::INFINITY)]), 1.0),
            (Fixed("rule", vec![Some(2.0), Some(2.0), None]), 1.0),
        ]);
        let owned = completions(&["a", "b", "c"]);
        let scores = set.score(&samples(&owned)).unwrap();
        assert_eq!(scores.per_source[0].1, [None, Some(1.0), None]);
        assert_eq!(scores.total, [Some(2.0), Some(3.0), None]);
        assert_eq!(scores.non_finite, [("rm".to_string(), 2), ("rule".to_string(), 0)]);
    }

    #[test]
    fn overflowing_weighted_sums_become_unscorable() {
        let set = set(vec![(Fixed("big", vec![Some(f32::MAX), Some(1.0)]), 2.0)]);
        let owned = completions(&["a", "b"]);
        let scores = set.score(&samples(&owned)).unwrap();
        assert_eq!(scores.total, [None, Some(2.0)]);
    }

    #[test]
    fn duplicate_names_and_wrong_lengths_are_errors() {
        let mut s = set(vec![(Fixed("rm", vec![Some(1.0)]), 1.0)]);
        let err = s.push(Box::new(Fixed("rm", vec![])), 1.0).unwrap_err().to_string();
        assert_eq!(err, "two rewards are named `rm`; give each a distinct `name`");
        let err = s.push(Box::new(Fixed("w", vec![])), f32::NAN).unwrap_err().to_string();
        assert_eq!(err, "reward `w`: weight must be a finite number, got NaN");
        let owned = completions(&["a", "b"]);
        let err = s.score(&samples(&owned)).unwrap_err().to_string();
        assert_eq!(err, "reward `rm` returned 1 scores for 2 samples");
    }

    #[test]
    fn metrics_are_mean_and_std_per_source_over_scored_samples() {
        let set =
            set(vec![(Fixed("a", vec![Some(1.0), Some(3.0), None]), 1.0), (Fixed("b", vec![None, None, None]), 1.0)]);
        let owned = completions(&["x", "y", "z"]);
        let m = set.score(&samples(&owned)).unwrap().metrics();
        assert_eq!(m, [("rewards/a/mean".to_string(), 2.0), ("rewards/a/std".to_string(), 1.0)]);
    }

    #[test]
    fn missing_eos_penalty_hits_only_completions_without_eos() {
        let s = [Some(1.0), Some(1.0), None];
        assert_eq!(missing_eos_penalty(&s, &[true, false, false], 0.5), [Some(1.0), Some(0.5), None]);
    }

    #[test]
    fn normalize_is_a_z_score_over_scorable_samples() {
        // mean 2, unbiased std 1.
        let got = normalize(&[Some(1.0), None, Some(2.0), Some(3.0)]);
        assert!(close(&got, &[Some(-1.0), None, Some(0.0), Some(1.0)]), "{got:?}");
        assert_eq!(normalize(&[Some(7.0), None]), [Some(0.0), None]);
        assert_eq!(normalize(&[Some(4.0), Some(4.0)]), [Some(0.0), Some(0.0)]);
        assert_eq!(normalize(&[None, None]), [None, None]);
    }

    #[test]
    fn clip_clamps_scorable_samples_to_the_range() {
        assert_eq!(
            clip(&[Some(-5.0), Some(0.5), Some(5.0), None], -1.0, 1.0),
            [Some(-1.0), Some(0.5), Some(1.0), None]
        );
    }

    #[test]
    fn shaping_applies_penalty_then_normalisation_then_clipping() {
        let shaping = Shaping { missing_eos_penalty: Some(3.0), normalize: true, clip: Some([-0.5, 0.5]) };
        // After the penalty: [1, 2, 0]: mean 1, std 1 -> [0, 1, -1] -> clipped.
        let got = shaping.apply(&[Some(1.0), Some(2.0), Some(3.0)], &[true, true, false]);
        assert!(close(&got, &[Some(0.0), Some(0.5), Some(-0.5)]), "{got:?}");
        assert_eq!(
            Shaping::default().apply(&[Some(1.0), None], &[false, false]),
            [Some(1.0), None],
            "all off by default"
        );
    }
}
