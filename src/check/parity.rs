//! The committed fixtures on a device: the logits, scores, KV-cache
//! decoding and every parameter's gradient of each architecture against
//! the reference outputs `transformers` produced, and greedy generation
//! against transformers' tokens.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use crate::generate::decoding::{DecodeRow, Decoding, Verdict};
use crate::generate::{generate, GenerateOptions, Sampler, Sampling, Stepping, StopCriteria};
use crate::model::{next_token_logprobs, GenerationConfig, Inputs, Model, Network};
use crate::rng::Rng;

/// A fixture model and the tensors transformers produced for it (on the CPU).
pub struct Fixture {
    pub name: String,
    pub model: Model,
    pub reference: HashMap<String, Tensor>,
}

impl Fixture {
    /// `fixtures/models/<name>` loaded on `device` to compute in `dtype`
    /// (f32 masters, split by default, beside bf16 copies), with its
    /// reference outputs.
    pub fn load(fixtures: &Path, name: &str, device: &Device, dtype: DType) -> crate::Result<Self> {
        let model = Model::load(&fixtures.join("models").join(name), device)?.with_dtype(dtype, true)?;
        let path = fixtures.join("reference").join(format!("{name}.safetensors"));
        let reference = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| crate::Error::Invalid(format!("{}: {e}", path.display())))?;
        Ok(Self { name: name.into(), model, reference })
    }

    pub fn is_causal(&self) -> bool {
        self.name.ends_with("-causal")
    }

    fn tensor(&self, key: &str) -> Result<&Tensor> {
        self.reference.get(key).ok_or_else(|| candle_core::Error::Msg(format!("{}: no reference `{key}`", self.name)))
    }

    /// The reference batch padded on `side` ("left" or "right"), on the model's device.
    pub fn inputs(&self, side: &str) -> Result<Inputs> {
        let device = self.model.device();
        let ids = self.tensor(&format!("{side}.input_ids"))?.to_device(&device)?;
        let mask = self.tensor(&format!("{side}.attention_mask"))?.to_device(&device)?;
        Inputs::new(&ids, &mask)
    }

    /// Max |Δ logit| over real tokens of the batch padded on `side`.
    pub fn logits_error(&self, net: &Network, side: &str) -> Result<f32> {
        let inputs = self.inputs(side)?;
        let logits = net.logits(&inputs, None)?;
        max_diff_masked(&logits, self.tensor(&format!("{side}.logits"))?, &inputs.mask)
    }

    /// Max |Δ score| of a sequence-classification model.
    pub fn scores_error(&self, side: &str) -> Result<f32> {
        let scores = self.model.frozen().scores(&self.inputs(side)?)?;
        max_diff(&scores, self.tensor(&format!("{side}.scores"))?)
    }

    /// Prefills all but the last four columns of the left-padded batch, then
    /// feeds one token per step: max |Δ logit| against the full forward's reference.
    pub fn kv_cache_error(&self) -> Result<f32> {
        let full = self.inputs("left")?;
        let net = self.model.frozen();
        let t = full.seq_len();
        let prefill = t - 4;
        let mut cache = net.new_cache();
        let columns = |start: usize, n: usize| -> Result<Inputs> {
            Ok(Inputs {
                ids: full.ids.narrow(1, start, n)?,
                mask: full.mask.narrow(1, start, n)?,
                positions: full.positions.narrow(1, start, n)?,
                segments: None,
                real_runs: None,
            })
        };
        let mut outputs = vec![net.logits(&columns(0, prefill)?, Some(&mut cache))?];
        for step in prefill..t {
            outputs.push(net.logits(&columns(step, 1)?, Some(&mut cache))?);
        }
        max_diff_masked(&Tensor::cat(&outputs, 1)?, self.tensor("left.logits")?, &full.mask)
    }

    /// The loss the reference script differentiated: the mean next-token
    /// NLL over pairs of real tokens (causal), or the sum of the scores.
    pub fn reference_loss(&self, side: &str) -> Result<Tensor> {
        let inputs = self.inputs(side)?;
        let net = self.model.network();
        if !self.is_causal() {
            return net.scores(&inputs)?.sum_all();
        }
        let logits = net.logits(&inputs, None)?;
        let logp = next_token_logprobs(&logits, &inputs.ids)?;
        let t = inputs.seq_len();
        let pairs = (inputs.mask.narrow(1, 0, t - 1)? * inputs.mask.narrow(1, 1, t - 1)?)?;
        let total = (logp * &pairs)?.sum_all()?;
        total.neg()? / pairs.sum_all()?.to_scalar::<f32>()? as f64
    }

    /// Every parameter's gradient of the reference loss against transformers':
    /// the number of parameters and the worst error relative to each
    /// gradient's largest magnitude (at least 1).
    pub fn gradient_error(&self) -> Result<(usize, f32)> {
        let grads = self.reference_loss("right")?.backward()?;
        let params = self.model.params();
        let expected = self.reference.keys().filter(|k| k.starts_with("grad.")).count();
        if expected != params.len() {
            candle_core::bail!("{}: {} parameters, transformers has {expected}", self.name, params.len());
        }
        let mut worst = 0f32;
        for p in params.iter() {
            let want = self.tensor(&format!("grad.{}", p.name))?;
            let Some(got) = grads.get(p.compute()) else {
                candle_core::bail!("{}: no gradient for `{}`", self.name, p.name)
            };
            worst = worst.max(relative_error(got, want)?);
        }
        Ok((params.len(), worst))
    }

    /// Greedy completions of the reference prompts, from a shrinking batch,
    /// from recorded steps (fixed stepping where nothing is recorded) and
    /// from a server's batch of recorded steps ([`Self::served_greedy`]);
    /// the number of rows whose tokens differ from transformers' (which pads
    /// after EOS) in any, out of all rows.
    pub fn greedy_mismatches(&self) -> crate::Result<(usize, usize)> {
        let u32s = |key: &str| -> Result<Vec<Vec<u32>>> { self.tensor(key)?.to_dtype(DType::U32)?.to_vec2() };
        let (ids, mask, out) = (u32s("greedy.input_ids")?, u32s("greedy.attention_mask")?, u32s("greedy.output_ids")?);
        let eos = GenerationConfig::from_dir(self.model.dir())?.unwrap_or_default().eos_token_ids().to_vec();
        let prompts: Vec<Vec<u32>> = ids
            .iter()
            .zip(&mask)
            .map(|(r, m)| r.iter().zip(m).filter(|(_, &m)| m == 1).map(|(&i, _)| i).collect())
            .collect();
        let t = ids[0].len();
        let mut wrong = vec![false; prompts.len()];
        let mut compare = |got: &[Vec<u32>]| {
            for ((row, got), wrong) in out.iter().zip(got).zip(&mut wrong) {
                let end = row[t..].iter().position(|tok| eos.contains(tok)).map_or(row.len(), |i| t + i + 1);
                *wrong |= row[t..end] != got[..];
            }
        };
        let device = self.model.device();
        for stepping in [Stepping::Shrink, Stepping::Graph] {
            let sampler = Sampler::from_env(&device)?;
            compare(&greedy(self.model.frozen(), (&device, sampler, stepping), &prompts, out[0].len() - t, &eos)?);
        }
        compare(&self.served_greedy(&prompts, out[0].len() - t, &eos)?);
        Ok((wrong.iter().filter(|&&w| w).count(), prompts.len()))
    }

    /// Greedy completions of `prompts` (at least 3) as a server decodes
    /// them, its steps recorded: the first arrives at step 0, the second two
    /// steps later (the batch made again for both), the rest from the step
    /// the first row has left on (`max_new` tokens), each taking a place
    /// rows left while the recording replays (the third beside the second,
    /// the batch's places held in another order than theirs).
    fn served_greedy(&self, prompts: &[Vec<u32>], max_new: usize, eos: &[u32]) -> crate::Result<Vec<Vec<u32>>> {
        let device = self.model.device();
        let mut batch = Decoding::open(self.model.frozen(), &device, Sampler::from_env(&device)?, Stepping::Graph);
        let arrives = |i: usize| if i < 2 { 2 * i } else { max_new + i - 2 };
        let (mut got, mut next) = (vec![Vec::new(); prompts.len()], 0);
        for step in 0.. {
            while next < prompts.len() && arrives(next) == step {
                batch.admit(vec![DecodeRow {
                    prompt: Arc::from(prompts[next].as_slice()),
                    sampling: Sampling::greedy(),
                    repetition_penalty: 1.0,
                    rng: Rng::new(0),
                    max_tokens: max_new,
                    tokens: Vec::new(),
                    client: next,
                }])?;
                next += 1;
            }
            if batch.is_empty() && next == prompts.len() {
                break;
            }
            batch.step(|row, pick, _, _| {
                if !eos.contains(&pick.token) && row.tokens.len() < row.max_tokens {
                    return Ok(Verdict::Continues);
                }
                got[row.client] = std::mem::take(&mut row.tokens);
                Ok(Verdict::Leaves)
            })?;
        }
        Ok(got)
    }
}

/// Greedy completions of `prompts` by `net` on a device, with a sampler
/// and a stepping: at most `max_new` tokens each, fewer where one of `eos`
/// ends them.
fn greedy(
    net: &Network,
    (device, sampler, stepping): (&Device, Sampler, Stepping),
    prompts: &[Vec<u32>],
    max_new: usize,
    eos: &[u32],
) -> crate::Result<Vec<Vec<u32>>> {
    let opts = GenerateOptions {
        max_new_tokens: max_new,
        num_return_sequences: 1,
        sampling: Sampling::greedy(),
        repetition_penalty: 1.0,
        stop: StopCriteria { token_ids: eos.to_vec(), strings: vec![] },
        batch_size: 8,
        sampler,
        stepping,
        seed: 11,
        prompt_offset: 0,
        max_positions: None,
    };
    let mut got = vec![Vec::new(); prompts.len()];
    generate(net, prompts, &opts, None, device, &mut |_| {}, &mut |c| {
        got[c.prompt_index] = c.tokens;
        Ok(())
    })?;
    Ok(got)
}

/// Prompts of the adapters' greedy check: of 2 to 7 tokens, none an EOS id
/// of the fixtures.
const ADAPTER_PROMPTS: [&[u32]; 3] = [&[23, 9, 2, 11, 77], &[100, 3], &[17, 250, 33, 8, 64, 129, 12]];

/// Greedy completions (12 tokens, fewer where an EOS ends them) of the
/// causal fixture `name` with its PEFT adapter (`fixtures/adapters/<name>`)
/// in f32: on `device` by the race over fixed steps (a GPU's defaults,
/// recorded there), and on the CPU by its host sampler over a shrinking
/// batch. The number of prompts whose tokens differ, out of all.
pub fn adapter_greedy_mismatches(fixtures: &Path, name: &str, device: &Device) -> crate::Result<(usize, usize)> {
    let (base, adapter) = (fixtures.join("models").join(name), fixtures.join("adapters").join(name));
    let eos = GenerationConfig::from_dir(&base)?.unwrap_or_default().eos_token_ids().to_vec();
    let prompts: Vec<Vec<u32>> = ADAPTER_PROMPTS.iter().map(|p| p.to_vec()).collect();
    let tokens = |on: &Device, sampler: Sampler, stepping: Stepping| -> crate::Result<Vec<Vec<u32>>> {
        let model = Model::load_adapter(&adapter, Some(&base), on)?;
        greedy(model.frozen(), (on, sampler, stepping), &prompts, 12, &eos)
    };
    let want = tokens(&Device::Cpu, Sampler::Host, Stepping::Shrink)?;
    let got = tokens(device, Sampler::Race, Stepping::Graph)?;
    Ok((want.iter().zip(&got).filter(|(w, g)| w != g).count(), prompts.len()))
}

/// Max |a - b| over entries where `mask` (broadcast from the leading dims)
/// is 1; `b` may live on another device.
pub fn max_diff_masked(a: &Tensor, b: &Tensor, mask: &Tensor) -> Result<f32> {
    let b = b.to_device(a.device())?.to_dtype(a.dtype())?;
    if a.dims() != b.dims() {
        candle_core::bail!("shapes differ: {:?} and {:?}", a.dims(), b.dims());
    }
    let diff = (a - b)?.abs()?.to_dtype(DType::F32)?;
    let mut mask = mask.to_dtype(DType::F32)?;
    while mask.rank() < diff.rank() {
        mask = mask.unsqueeze(mask.rank())?;
    }
    diff.broadcast_mul(&mask)?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

/// Max |a - b|; `b` may live on another device.
pub fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    max_diff_masked(a, b, &Tensor::ones(1, DType::F32, a.device())?.reshape(())?)
}

/// Max |a - b| over the largest magnitude of `b` (at least 1).
pub fn relative_error(a: &Tensor, b: &Tensor) -> Result<f32> {
    let scale = b.to_dtype(DType::F32)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?.max(1.0);
    Ok(max_diff(a, b)? / scale)
}
