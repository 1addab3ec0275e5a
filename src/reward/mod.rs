//! Rewards: what turns a completion into a score (docs/algorithm.md section 1).
//!
//! A [`RewardSource`] scores a batch of [`Sample`]s: a reward model
//! ([`model::RewardModel`]), a rule ([`rules`]: length, count, lexicon,
//! exact match), or something outside the trainer ([`remote`]): a process
//! ([`command`]), a scoring service ([`http`]) or an LLM judge ([`judge`]). A [`RewardSet`] adds the weighted scores of several sources
//! into one score per sample, and [`Shaping`] applies the missing-EOS
//! penalty, z-score normalisation and clipping. The `[[reward]]` tables of a
//! config file become a `RewardSet` through [`config::build`].
//!
//! A source may answer "no score" (`None`) for a sample, e.g. an exact-match
//! rule on a row without the answer column. A sample that no source scores is
//! *unscorable*: it gets no advantage and enters no baseline.

pub mod combine;
pub mod command;
pub mod config;
pub mod http;
pub mod judge;
pub mod model;
pub mod remote;
pub mod rules;
pub mod serve;

use serde_json::{Map, Value};

use crate::data::Prompt;
use crate::error::Result;

pub use combine::{clip, missing_eos_penalty, normalize, RewardSet, Scores, Shaping};
pub use config::{build, RewardSpec, REWARD_TYPES};
pub use model::RewardModel;
pub use remote::CallStats;

/// One completion as a reward sees it.
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    /// The prompt the completion answers (text or chat messages).
    pub prompt: &'a Prompt,
    /// The completion text, decoded without the stop token.
    pub completion: &'a str,
    /// The completion's token ids under the policy's tokenizer.
    pub completion_ids: &'a [u32],
    /// Whether generation stopped on a stop/EOS token (rather than at the
    /// length limit).
    pub ended_with_eos: bool,
    /// The dataset row the prompt came from, so that rules can compare the
    /// completion with one of its columns.
    pub row: &'a Map<String, Value>,
    /// The prompt group: samples with the same `group` answer the same
    /// prompt (the `k` completions of one prompt in a rollout).
    pub group: usize,
}

/// Something that scores completions.
///
/// `score` returns one entry per sample, in order; `None` means "no score for
/// this sample". Sources need not check for NaN or infinite scores: the
/// [`RewardSet`] turns them into `None` and counts them.
pub trait RewardSource: Send + Sync {
    /// The name under which the source's scores are logged
    /// (`rewards/<name>/mean`).
    fn name(&self) -> &str;

    /// Scores a batch of samples.
    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>>;

    /// Checks the dataset rows before training starts, so that a mistake such
    /// as a misspelt column name fails at once rather than after the first
    /// rollout. Most sources look at no column and accept anything.
    fn check_rows(&self, _rows: &[&Map<String, Value>]) -> Result<()> {
        Ok(())
    }

    /// The requests of the last [`score`](Self::score) call, for sources
    /// that make any (failures and latencies); taken once.
    fn call_stats(&self) -> Option<CallStats> {
        None
    }

    /// The models the source scores with on the run's device, which a run
    /// may move to host memory between scorings (`ref_reward_offload`).
    fn models(&self) -> Vec<&crate::model::Model> {
        Vec::new()
    }
}

/// Replaces NaN and infinite scores by `None` and returns how many there
/// were: a non-finite score would poison every mean and baseline it enters.
pub fn drop_non_finite(scores: &mut [Option<f32>]) -> usize {
    let mut dropped = 0;
    for s in scores.iter_mut() {
        if s.is_some_and(|x| !x.is_finite()) {
            *s = None;
            dropped += 1;
        }
    }
    dropped
}

#[cfg(test)]
pub(crate) mod test_support {
    //! Samples for the reward tests.

    use super::*;

    /// The owned parts of a [`Sample`].
    pub struct Owned {
        pub prompt: Prompt,
        pub completion: String,
        pub ids: Vec<u32>,
        pub eos: bool,
        pub row: Map<String, Value>,
    }

    impl Owned {
        pub fn text(prompt: &str, completion: &str) -> Owned {
            Owned {
                prompt: Prompt::Text(prompt.into()),
                completion: completion.into(),
                ids: Vec::new(),
                eos: true,
                row: Map::new(),
            }
        }

        pub fn with_ids(mut self, ids: &[u32]) -> Owned {
            self.ids = ids.to_vec();
            self
        }

        pub fn with_row(mut self, row: Value) -> Owned {
            self.row = row.as_object().expect("row is an object").clone();
            self
        }

        pub fn sample(&self) -> Sample<'_> {
            Sample {
                prompt: &self.prompt,
                completion: &self.completion,
                completion_ids: &self.ids,
                ended_with_eos: self.eos,
                row: &self.row,
                group: 0,
            }
        }
    }

    /// Completions for a text prompt.
    pub fn completions(texts: &[&str]) -> Vec<Owned> {
        texts.iter().map(|t| Owned::text("p", t)).collect()
    }

    pub fn samples(owned: &[Owned]) -> Vec<Sample<'_>> {
        owned.iter().map(Owned::sample).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_finite_scores_become_none_and_are_counted() {
        let mut s = vec![Some(1.0), Some(f32::NAN), None, Some(f32::INFINITY), Some(f32::NEG_INFINITY), Some(-2.5)];
        assert_eq!(drop_non_finite(&mut s), 3);
        assert_eq!(s, [Some(1.0), None, None, None, None, Some(-2.5)]);
    }
}
