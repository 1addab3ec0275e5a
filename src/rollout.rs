//! A rollout: `k` sampled completions of each prompt of a batch, laid out
//! `[prompts][k]`, with their texts. The one place that turns completions
//! into reward samples and into the sequences the scoring passes read, for
//! the trainer and for evaluation alike.

use candle_core::Device;

use crate::algo::Grouped;
use crate::data::prompts::PromptDataset;
use crate::data::Tokenizer;
use crate::error::Result;
use crate::generate::{generate, Completion, FinishReason, GenerateOptions};
use crate::model::scoring::Sequences;
use crate::model::Network;
use crate::reward::Sample;

#[derive(Debug, Clone)]
pub struct Rollout {
    /// The dataset row of each prompt, in batch order.
    pub prompt_rows: Vec<usize>,
    pub completions: Grouped<Completion>,
    /// Each completion decoded without its stop token.
    pub texts: Vec<String>,
}

impl Rollout {
    /// Samples `opts.num_return_sequences` completions of each prompt of
    /// `dataset` at `prompt_rows`.
    pub fn sample(
        net: &Network,
        dataset: &PromptDataset,
        prompt_rows: Vec<usize>,
        opts: &GenerateOptions,
        tokenizer: &Tokenizer,
        device: &Device,
    ) -> Result<Rollout> {
        let prompts: Vec<Vec<u32>> = prompt_rows.iter().map(|&i| dataset.rows[i].ids.clone()).collect();
        let mut done: Vec<Completion> = Vec::with_capacity(prompts.len() * opts.num_return_sequences);
        generate(net, &prompts, opts, Some(tokenizer), device, &mut |_| {}, &mut |c| {
            done.push(c);
            Ok(())
        })?;
        // Finishing order is arbitrary; the layout is [prompts][k].
        done.sort_by_key(|c| (c.prompt_index, c.sample_index));
        let texts = done.iter().map(|c| tokenizer.decode(&c.tokens, true)).collect::<Result<Vec<_>>>()?;
        Ok(Rollout { prompt_rows, completions: Grouped::new(opts.num_return_sequences, done), texts })
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    /// Whether each completion stopped on a stop token (not the length limit).
    pub fn ended_with_eos(&self) -> Vec<bool> {
        self.completions.flat().iter().map(|c| c.finish_reason == FinishReason::Stop).collect()
    }

    /// The reward sources' view of each completion; a prompt's `k`
    /// completions share its group.
    pub fn samples<'a>(&'a self, dataset: &'a PromptDataset) -> Vec<Sample<'a>> {
        self.completions
            .flat()
            .iter()
            .zip(&self.texts)
            .map(|(c, text)| {
                let row = &dataset.rows[self.prompt_rows[c.prompt_index]];
                Sample {
                    prompt: &row.prompt,
                    completion: text,
                    completion_ids: &c.tokens,
                    ended_with_eos: c.finish_reason == FinishReason::Stop,
                    row: &row.row.fields,
                    group: c.prompt_index,
                }
            })
            .collect()
    }

    /// Prompt and completion tokens of each completion, for scoring passes.
    pub fn sequences<'a>(&'a self, dataset: &'a PromptDataset) -> Sequences<'a> {
        let flat = self.completions.flat();
        Sequences::grouped(
            flat.iter().map(|c| dataset.rows[self.prompt_rows[c.prompt_index]].ids.as_slice()).collect(),
            flat.iter().map(|c| c.tokens.as_slice()).collect(),
            flat.iter().map(|c| c.prompt_index).collect(),
        )
    }
}
