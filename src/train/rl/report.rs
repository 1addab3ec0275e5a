//! What a step reports about its rollout: TRL's metrics and the sample table.

use crate::data::prompts::PromptDataset;
use crate::data::Prompt;
use crate::error::Result;
use crate::model::scoring::TokenLogprobs;
use crate::report::{Metrics, Sample, SampleTable};
use crate::rollout::Rollout;

/// The rollout's metrics, as TRL names them.
pub(super) fn rollout_metrics(
    m: &mut Metrics,
    rollout: &Rollout,
    scores: &[Option<f32>],
    seq_kl: &[f32],
    beta: f64,
    old: &TokenLogprobs,
    ended: &[bool],
) -> Result<()> {
    let mean = |xs: &mut dyn Iterator<Item = f64>| crate::stats::mean(&xs.collect::<Vec<_>>()).unwrap_or(f64::NAN);
    m.set("objective/scores", mean(&mut scores.iter().flatten().map(|&s| s as f64)));
    m.set("objective/kl", mean(&mut seq_kl.iter().map(|&k| k as f64)));
    m.set("objective/non_score_reward", mean(&mut seq_kl.iter().map(|&k| -beta * k as f64)));
    let seq_entropy: Vec<f32> = old.entropy.sum(1)?.to_vec1()?;
    m.set("objective/entropy", mean(&mut seq_entropy.iter().map(|&e| e as f64)));
    let lengths: Vec<f64> = rollout.completions.flat().iter().map(|c| c.tokens.len() as f64).collect();
    m.set("completions/mean_length", mean(&mut lengths.iter().copied()));
    let eos = ended.iter().filter(|&&e| e).count();
    m.set("val/num_eos_tokens", eos as f64);
    m.set("completions/clipped_ratio", 1.0 - eos as f64 / ended.len().max(1) as f64);
    Ok(())
}

/// One sample per prompt of the step for the console table and samples.jsonl.
pub(super) fn sample_table(dataset: &PromptDataset, rollout: &Rollout, scores: &[Option<f32>]) -> SampleTable {
    let mut table = SampleTable::new();
    for (i, c) in rollout.completions.flat().iter().enumerate().filter(|(_, c)| c.sample_index == 0) {
        let row = &dataset.rows[rollout.prompt_rows[c.prompt_index]];
        let prompt = match &row.prompt {
            Prompt::Text(t) => t.clone(),
            Prompt::Messages(ms) => ms.last().map(|m| m.content.clone()).unwrap_or_default(),
        };
        table.push(Sample {
            prompt,
            completion: rollout.texts[i].clone(),
            score: scores[i].map_or(f64::NAN, |s| s as f64),
            extra_scores: vec![],
        });
    }
    table
}
