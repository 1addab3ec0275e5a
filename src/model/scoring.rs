//! Scoring prompt/completion pairs: the log-probability of every completion
//! token under a causal LM, or the score a sequence-classification head
//! gives the whole sequence.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};

use super::batch::{Inputs, SharedPrefix};
use super::kernels;
use super::network::Network;
use crate::error::{Error, Result};

/// Token ids of one prompt and its completion.
#[derive(Debug, Clone)]
pub struct Pair {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
}

/// The head's output (num_labels values) at the last token of prompt + completion.
pub fn sequence_scores(net: &Network, pairs: &[Pair], device: &Device) -> Result<Vec<Vec<f32>>> {
    if let Some(i) = pairs.iter().position(|p| p.prompt.is_empty() && p.completion.is_empty()) {
        return Err(Error::Invalid(format!("pair {i}: prompt and completion are both empty")));
    }
    let seqs = Sequences::new(
        pairs.iter().map(|p| p.prompt.as_slice()).collect(),
        pairs.iter().map(|p| p.completion.as_slice()).collect(),
    );
    let packed = seqs.packed(device)?;
    let hidden = net.hidden_states(&packed.inputs, None)?;
    // Each pair's last token: its completion's last, or its prompt's last for an empty completion.
    let last: Vec<u32> = (0..pairs.len()).map(|i| packed.slot(i, seqs.completions[i].len()) as u32).collect();
    let last = Tensor::from_vec(last, pairs.len(), device)?;
    Ok(net.project(&packed.flat(&hidden)?.index_select(&last, 0)?)?.to_vec2()?)
}

/// Sampled sequences laid out for scoring: row `i` is `prompts[i]` followed
/// by `completions[i]`. Rows of one prompt group (the `k` completions of a
/// prompt) share one computation of the prompt.
pub struct Sequences<'a> {
    pub prompts: Vec<&'a [u32]>,
    pub completions: Vec<&'a [u32]>,
    /// The prompt group of each row.
    groups: Vec<usize>,
}

/// Per-token values over completion positions, padded to the longest
/// completion: all (N, Tc).
pub struct TokenLogprobs {
    pub logprobs: Tensor,
    /// Entropy of the (tempered) next-token distribution, detached.
    pub entropy: Tensor,
    /// 1 on completion tokens, 0 on padding.
    pub mask: Tensor,
}

impl<'a> Sequences<'a> {
    /// Rows whose groups are known: `groups[i]` is row i's prompt group,
    /// whose rows all have the same prompt.
    pub fn grouped(prompts: Vec<&'a [u32]>, completions: Vec<&'a [u32]>, groups: Vec<usize>) -> Self {
        assert!(
            prompts.len() == completions.len() && prompts.len() == groups.len(),
            "one prompt, completion and group per row"
        );
        Sequences { prompts, completions, groups }
    }

    /// Rows with no known structure: rows with the same prompt tokens form
    /// a group.
    pub fn new(prompts: Vec<&'a [u32]>, completions: Vec<&'a [u32]>) -> Self {
        let mut first: HashMap<&[u32], usize> = HashMap::new();
        let groups = prompts.iter().enumerate().map(|(i, &p)| *first.entry(p).or_insert(i)).collect();
        Self::grouped(prompts, completions, groups)
    }

    /// The rows at `rows`, in that order, keeping their groups.
    pub fn select(&self, rows: &[usize]) -> Sequences<'a> {
        Sequences {
            prompts: rows.iter().map(|&i| self.prompts[i]).collect(),
            completions: rows.iter().map(|&i| self.completions[i]).collect(),
            groups: rows.iter().map(|&i| self.groups[i]).collect(),
        }
    }

    /// `rows` reordered so that the rows of each group stand together
    /// (groups in the order they first appear, rows within one in their
    /// order): cut into micro-batches, a group's completions then share one
    /// pass over their prompt ([`Self::packed`]).
    pub fn grouped_order(&self, rows: &[usize]) -> Vec<usize> {
        let mut first: HashMap<usize, usize> = HashMap::new();
        for &i in rows {
            let n = first.len();
            first.entry(self.groups[i]).or_insert(n);
        }
        let mut order = rows.to_vec();
        order.sort_by_key(|&i| first[&self.groups[i]]);
        order
    }

    pub fn len(&self) -> usize {
        self.prompts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.prompts.is_empty()
    }

    /// The longest completion.
    pub fn completion_width(&self) -> usize {
        self.completions.iter().map(|c| c.len()).max().unwrap_or(0)
    }

    /// The rows packed by prompt group ([`Inputs::shared_prefix`]): a
    /// group's rows share one packed row, so the prompt is computed once for
    /// all its completions. A row takes completions up to
    /// [`PACKED_ROW_TOKENS`] (its attention bias grows with the square of its
    /// length), then the group starts another.
    fn packed(&self, device: &Device) -> Result<Packed> {
        let mut open: HashMap<usize, usize> = HashMap::new();
        let mut groups: Vec<SharedPrefix> = Vec::new();
        let mut place = Vec::with_capacity(self.len());
        for ((&p, &c), &group) in self.prompts.iter().zip(&self.completions).zip(&self.groups) {
            let g = match open.get(&group) {
                Some(&g) if groups[g].len() + c.len() <= PACKED_ROW_TOKENS => g,
                _ => {
                    groups.push(SharedPrefix { prompt: p, continuations: Vec::new() });
                    open.insert(group, groups.len() - 1);
                    groups.len() - 1
                }
            };
            place.push((g, groups[g].continuations.len()));
            groups[g].continuations.push(c);
        }
        let inputs = Inputs::shared_prefix(&groups, 0, device)?;
        let place = place.iter().map(|&(g, c)| (g, groups[g].prompt.len(), groups[g].start(c))).collect();
        Ok(Packed { inputs, place })
    }

    /// (N, Tc) mask of completion tokens.
    pub fn mask(&self, device: &Device) -> Result<Tensor> {
        let width = self.completion_width();
        let data: Vec<f32> = self
            .completions
            .iter()
            .flat_map(|c| (0..width).map(move |j| if j < c.len() { 1.0 } else { 0.0 }))
            .collect();
        Ok(Tensor::from_vec(data, (self.len(), width), device)?)
    }
}

/// The most tokens a packed row takes once it holds one completion.
pub const PACKED_ROW_TOKENS: usize = 2048;

/// [`Sequences`] packed by prompt, and where each row's tokens went.
struct Packed {
    inputs: Inputs,
    /// Per row: its packed row, its prompt's length, where its completion starts.
    place: Vec<(usize, usize, usize)>,
}

impl Packed {
    /// The flat index, in the packed (B * T) hidden states, of the token
    /// before row `i`'s completion token `j`: the one that predicts it.
    fn slot(&self, i: usize, j: usize) -> usize {
        let (g, prompt_len, start) = self.place[i];
        g * self.inputs.seq_len() + if j == 0 { prompt_len - 1 } else { start + j - 1 }
    }

    /// Hidden states (B, T, H) -> (B * T, H).
    fn flat(&self, hidden: &Tensor) -> Result<Tensor> {
        let (b, t, h) = hidden.dims3()?;
        Ok(hidden.reshape((b * t, h))?)
    }
}

/// Log-probs of each completion token at `temperature` (logits divided by
/// it before the log-softmax, as when sampling). Runs `net` as it is: pass
/// the training network for gradients, the frozen one for constants.
pub fn completion_logprobs(
    net: &Network,
    seqs: &Sequences,
    temperature: f64,
    device: &Device,
) -> Result<TokenLogprobs> {
    if let Some(i) = seqs.prompts.iter().zip(&seqs.completions).position(|(p, c)| p.is_empty() && !c.is_empty()) {
        return Err(Error::Invalid(format!(
            "row {i}: the prompt has no tokens, so the first completion token has no context"
        )));
    }
    let n = seqs.len();
    let width = seqs.completion_width();
    let mask = seqs.mask(device)?;
    if width == 0 {
        let empty = Tensor::zeros((n, 0), candle_core::DType::F32, device)?;
        return Ok(TokenLogprobs { logprobs: empty.clone(), entropy: empty, mask });
    }
    let picked = completion_hidden(net, seqs, device)?;
    let targets: Vec<u32> =
        seqs.completions.iter().flat_map(|c| (0..width).map(|j| c.get(j).copied().unwrap_or(0))).collect();
    let (logprobs, entropy) = net.token_logprobs(&picked, &targets, temperature)?;
    let (logprobs, entropy) = (logprobs.reshape((n, width))?, entropy.reshape((n, width))?);
    Ok(TokenLogprobs { logprobs: (logprobs * &mask)?, entropy: (entropy * &mask)?, mask })
}

/// The hidden state that predicts each completion token, (N * Tc, H) row
/// by row; padding slots read slot 0 (callers mask them).
fn completion_hidden(net: &Network, seqs: &Sequences, device: &Device) -> Result<Tensor> {
    let width = seqs.completion_width();
    let packed = seqs.packed(device)?;
    let hidden = net.hidden_states(&packed.inputs, None)?;
    let packed = &packed;
    let at: Vec<u32> = seqs
        .completions
        .iter()
        .enumerate()
        .flat_map(|(i, c)| (0..width).map(move |j| if j < c.len() { packed.slot(i, j) as u32 } else { 0 }))
        .collect();
    Ok(kernels::gather_rows(&packed.flat(&hidden)?, &Tensor::from_vec(at, seqs.len() * width, device)?)?)
}

/// A critic's value of the state before each completion token: its score
/// head (one label) at the token that precedes it, (N, Tc), zero on padding.
/// Runs `net` as it is: the training network for gradients.
pub fn completion_values(net: &Network, seqs: &Sequences, device: &Device) -> Result<Tensor> {
    let (n, width) = (seqs.len(), seqs.completion_width());
    let mask = seqs.mask(device)?;
    if width == 0 {
        return Ok(mask);
    }
    let values = net.project(&completion_hidden(net, seqs, device)?)?;
    if values.dim(1)? != 1 {
        return Err(Error::Invalid(format!("a critic has one output per token, this head has {}", values.dim(1)?)));
    }
    Ok((values.reshape((n, width))? * mask)?)
}

/// [`completion_logprobs`] on frozen weights, `chunk` rows per forward pass,
/// padded to the longest completion of all `seqs`.
pub fn completion_logprobs_chunked(
    net: &Network,
    seqs: &Sequences,
    temperature: f64,
    device: &Device,
    chunk: usize,
) -> Result<TokenLogprobs> {
    let width = seqs.completion_width();
    let (mut lps, mut ents) = (Vec::new(), Vec::new());
    for part in chunks(seqs, chunk) {
        let out = completion_logprobs(net, &part, temperature, device)?;
        lps.push(pad_width(&out.logprobs, width)?);
        ents.push(pad_width(&out.entropy, width)?);
    }
    Ok(TokenLogprobs { logprobs: Tensor::cat(&lps, 0)?, entropy: Tensor::cat(&ents, 0)?, mask: seqs.mask(device)? })
}

/// [`completion_values`] on frozen weights, `chunk` rows per forward pass.
pub fn completion_values_chunked(net: &Network, seqs: &Sequences, device: &Device, chunk: usize) -> Result<Tensor> {
    let width = seqs.completion_width();
    let parts: Vec<Tensor> = chunks(seqs, chunk)
        .map(|part| pad_width(&completion_values(net, &part, device)?, width))
        .collect::<Result<_>>()?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// `seqs` in consecutive parts of `chunk` rows.
fn chunks<'s, 'a>(seqs: &'s Sequences<'a>, chunk: usize) -> impl Iterator<Item = Sequences<'a>> + 's {
    let chunk = chunk.max(1);
    (0..seqs.len())
        .step_by(chunk)
        .map(move |start| seqs.select(&(start..(start + chunk).min(seqs.len())).collect::<Vec<_>>()))
}

/// Right-pads (N, w) with zeros to (N, width).
fn pad_width(t: &Tensor, width: usize) -> Result<Tensor> {
    let (n, w) = t.dims2()?;
    if w == width {
        return Ok(t.clone());
    }
    Ok(Tensor::cat(&[t, &Tensor::zeros((n, width - w), DType::F32, t.device())?], 1)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_starts_a_new_packed_row_when_one_is_full() {
        let prompt = vec![1u32; 8];
        let long = vec![2u32; 900];
        let seqs = Sequences::new(vec![&prompt; 3], vec![&long; 3]);
        let packed = seqs.packed(&Device::Cpu).unwrap();
        // 8 + 900 + 900 fits in a row, a third completion would not.
        let rows: Vec<usize> = packed.place.iter().map(|&(g, _, _)| g).collect();
        assert_eq!(rows, [0, 0, 1]);
        assert_eq!(packed.inputs.seq_len(), 8 + 2 * 900);
        assert_eq!(packed.slot(1, 0), 7, "the first token is predicted from the prompt's last");
        assert_eq!(packed.slot(1, 5), 8 + 900 + 4);
        assert_eq!(packed.slot(2, 1), packed.inputs.seq_len() + 8);
    }

    #[test]
    fn a_grouped_order_keeps_the_rows_and_puts_each_prompts_together() {
        let (a, b, c) = (vec![1u32], vec![2u32], vec![3u32]);
        let completion = [9u32; 4];
        // Three prompts' completions, shuffled as mini-batches are.
        let prompts = [&a, &b, &c, &a, &b, &c, &a, &b];
        let seqs = Sequences::new(prompts.iter().map(|p| p.as_slice()).collect(), vec![&completion[..]; 8]);
        let shuffled = [4, 0, 7, 3, 5, 1, 6];
        assert_eq!(seqs.grouped_order(&shuffled), [4, 7, 1, 0, 3, 6, 5]);
        // A micro-batch of the first three packs one prompt's row, not two.
        let rows = |micro: &[usize]| seqs.select(micro).packed(&Device::Cpu).unwrap().inputs.ids.dim(0).unwrap();
        assert_eq!(rows(&seqs.grouped_order(&shuffled)[..3]), 1);
        assert_eq!(rows(&shuffled[..3]), 2);
    }
}
