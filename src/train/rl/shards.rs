//! A data-parallel step's exchange. Each process samples, scores and runs
//! the forward passes over its share of the rollout's prompts (rank r the
//! r-th share, its rows' random streams keyed by their place in the whole
//! batch); the shares are then gathered, so every process holds the batch
//! that one process would have made, and computes the same advantages,
//! metrics and mini-batch order from it. Only the per-completion numbers
//! move: a few bytes per token, against a model's worth of gradients.

use candle_core::{Device, Tensor};

use super::RolloutForward;
use crate::algo::Grouped;
use crate::dist::{bytes_f32, f32_bytes, host_f32, Communicator};
use crate::error::{Error, Result};
use crate::generate::Completion;
use crate::model::scoring::TokenLogprobs;
use crate::reward::Scores;
use crate::rollout::Rollout;

/// What a share's rollout and scores travel as: its prompt rows,
/// completions, texts and scores.
type Share = (Vec<usize>, Vec<Completion>, Vec<String>, Scores);

/// The whole batch's rollout, scores and forward passes, from this
/// process's share of them.
pub(super) fn gather(
    comm: &dyn Communicator,
    rollout: &Rollout,
    scores: Scores,
    forward: RolloutForward,
    device: &Device,
) -> Result<(Rollout, Scores, RolloutForward)> {
    let mine = (&rollout.prompt_rows, rollout.completions.flat(), &rollout.texts, &scores);
    let bytes = serde_json::to_vec(&mine).map_err(|e| Error::Dist(format!("encoding a rollout share: {e}")))?;
    let (mut prompt_rows, mut completions, mut texts, mut scores) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for (rank, part) in comm.all_gather(&bytes)?.into_iter().enumerate() {
        let (rows, done, said, scored): Share = serde_json::from_slice(&part)
            .map_err(|e| Error::Dist(format!("rank {rank} sent an unreadable rollout share: {e}")))?;
        let offset = prompt_rows.len();
        prompt_rows.extend(rows);
        completions.extend(done.into_iter().map(|c| Completion { prompt_index: c.prompt_index + offset, ..c }));
        texts.extend(said);
        scores.push(scored);
    }
    // The whole batch's sequences are as wide as its longest completion.
    let width = completions.iter().map(|c| c.tokens.len()).max().unwrap_or(0);
    let rollout = Rollout { prompt_rows, completions: Grouped::new(rollout.completions.k(), completions), texts };
    let rows = |t: &Tensor| gather_rows(comm, t, width, device);
    let old = TokenLogprobs {
        logprobs: rows(&forward.old.logprobs)?,
        entropy: rows(&forward.old.entropy)?,
        mask: rows(&forward.old.mask)?,
    };
    let reference = forward.reference.as_ref().map(rows).transpose()?;
    let values = forward.values.as_ref().map(rows).transpose()?;
    let forward = RolloutForward { old, reference, values, secs: forward.secs };
    Ok((rollout, Scores::concat(scores), forward))
}

/// Every rank's rows of a (rows, columns) tensor, zero-padded to `width`
/// columns, stacked in rank order.
fn gather_rows(comm: &dyn Communicator, t: &Tensor, width: usize, device: &Device) -> Result<Tensor> {
    let (n, w) = t.dims2()?;
    let dtype = t.dtype();
    let padded = if w < width { t.pad_with_zeros(1, 0, width - w)? } else { t.clone() };
    let mine = f32_bytes(&host_f32(&padded)?);
    let mut all = Vec::with_capacity(n * width * comm.world().size);
    for part in comm.all_gather(&mine)? {
        all.extend(bytes_f32(&part));
    }
    let rows = all.len() / width.max(1);
    Ok(Tensor::from_vec(all, (rows, width), device)?.to_dtype(dtype)?)
}
