//! Scoring prompt/completion pairs: the log-probability of every completion
//! token under a causal LM, or the score a sequence-classification head
//! gives the whole sequence.

use candle_core::{Device, Tensor, D};

use super::batch::{Inputs, PadSide};
use super::network::Network;
use super::ops;
use crate::error::{Error, Result};

/// Token ids of one prompt and its completion.
#[derive(Debug, Clone)]
pub struct Pair {
    pub prompt: Vec<u32>,
    pub completion: Vec<u32>,
}

impl Pair {
    fn joined(&self) -> Vec<u32> {
        [self.prompt.as_slice(), self.completion.as_slice()].concat()
    }
}

/// Log-probability of each completion token given everything before it.
/// Only the completion positions go through the LM head.
pub fn completion_logprobs(net: &Network, pairs: &[Pair], device: &Device) -> Result<Vec<Vec<f32>>> {
    if let Some(i) = pairs.iter().position(|p| p.prompt.is_empty() && !p.completion.is_empty()) {
        return Err(Error::Invalid(format!(
            "pair {i}: the prompt has no tokens, so the first completion token has no context"
        )));
    }
    let rows: Vec<Vec<u32>> = pairs.iter().map(Pair::joined).collect();
    let inputs = Inputs::from_rows(&rows, 0, PadSide::Right, device)?;
    let hidden = net.hidden_states(&inputs, None)?;
    let (b, t, h) = hidden.dims3()?;
    // The hidden state at position p predicts token p + 1.
    let mut at = Vec::new();
    let mut targets = Vec::new();
    for (row, pair) in pairs.iter().enumerate() {
        let start = pair.prompt.len();
        for (k, &token) in pair.completion.iter().enumerate() {
            at.push((row * t + start + k - 1) as u32);
            targets.push(token);
        }
    }
    debug_assert_eq!(b, pairs.len());
    if at.is_empty() {
        return Ok(vec![Vec::new(); pairs.len()]);
    }
    let n = at.len();
    let picked = hidden.reshape((b * t, h))?.index_select(&Tensor::from_vec(at, n, device)?, 0)?;
    let logp = ops::log_softmax_last(&net.project(&picked)?)?;
    let targets = Tensor::from_vec(targets, (n, 1), device)?;
    let flat: Vec<f32> = logp.gather(&targets, D::Minus1)?.flatten_all()?.to_vec1()?;
    let mut out = Vec::with_capacity(pairs.len());
    let mut rest = flat.as_slice();
    for pair in pairs {
        let (mine, tail) = rest.split_at(pair.completion.len());
        out.push(mine.to_vec());
        rest = tail;
    }
    Ok(out)
}

/// The head's output (num_labels values) at the last token of prompt + completion.
pub fn sequence_scores(net: &Network, pairs: &[Pair], device: &Device) -> Result<Vec<Vec<f32>>> {
    if let Some(i) = pairs.iter().position(|p| p.prompt.is_empty() && p.completion.is_empty()) {
        return Err(Error::Invalid(format!("pair {i}: prompt and completion are both empty")));
    }
    let rows: Vec<Vec<u32>> = pairs.iter().map(Pair::joined).collect();
    let inputs = Inputs::from_rows(&rows, 0, PadSide::Right, device)?;
    Ok(net.scores(&inputs)?.to_vec2()?)
}
