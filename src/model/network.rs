//! A decoder with its head, and [`Model`]: the door through which the rest
//! of rloo sees a network (forward, log-probs, parameters, save), never
//! an architecture's fields.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result as TResult, Tensor, D};

use super::batch::Inputs;
use super::cache::KvCache;
use super::config::{HeadKind, ModelConfig};
use super::layer_graphs::{LayerCuts, LayerGraphs};
use super::layers::{Context, Linear};
use super::lora::{self, AdapterPlan, Dropout, LoraConfig, PeftOptions, ADAPTER_CONFIG, PEFT_PREFIX};
use super::park::Parking;
use super::weights::{Detach, ParamStore, Source, WeightFiles, Weights};
use super::{kernels, ops};
use crate::error::{Error, Result};
use crate::rng::streams;
use crate::rng::Rng;

/// The transformer body: embeddings through the final norm.
pub trait Decoder: Send + Sync {
    /// What every layer of one forward pass reads: the attention mask's
    /// bias and the rotary tables.
    fn context(&self, inputs: &Inputs, cache: Option<&KvCache>) -> TResult<Context>;
    /// The embedded inputs (B, T, H).
    fn embed(&self, inputs: &Inputs) -> TResult<Tensor>;
    /// Layer `layer` on hidden states (B, T, H). With a cache, `x` continues
    /// the cached tokens and the layer appends their keys/values.
    fn block(&self, layer: usize, x: &Tensor, ctx: &Context, cache: Option<&mut KvCache>) -> TResult<Tensor>;
    /// The norm after the last layer.
    fn final_norm(&self, x: &Tensor) -> TResult<Tensor>;
    /// The token-embedding table (V, H), which tied LM heads reuse.
    fn embedding(&self) -> &Tensor;
    fn num_layers(&self) -> usize;
}

enum Head {
    /// (V, H) next-token projection.
    Lm(Linear),
    /// (num_labels, H) score projection.
    Score(Linear),
}

/// A decoder and its head built on one set of weight tensors.
pub struct Network {
    decoder: Arc<dyn Decoder>,
    head: Head,
    /// Where the training network's graph is cut between layers, if anywhere.
    cuts: Option<LayerCuts>,
}

impl Network {
    pub fn build(cfg: &ModelConfig, root: &Weights) -> Result<Self> {
        // Base-model checkpoints (and the original GPT-2 files) store the
        // decoder under a shorter prefix: `decoder.` for `model.decoder.`,
        // the root for `model.`. The first prefix holding the embedding wins.
        let (prefix, embedding) = (cfg.arch.base_prefix(), cfg.arch.embedding_name());
        let shorter = prefix.match_indices('.').map(|(i, _)| &prefix[i + 1..]);
        let base = match std::iter::once(prefix).chain(shorter).find(|p| root.contains(&format!("{p}.{embedding}"))) {
            Some(p) => root.pp(p),
            None if root.contains(embedding) => root.clone(),
            None => root.pp(prefix),
        };
        let decoder = cfg.resolved.load_decoder(&base)?;
        let (v, h) = (cfg.vocab_size(), cfg.head_width());
        let head = match cfg.head {
            HeadKind::CausalLm if cfg.tie_word_embeddings() => Head::Lm(Linear::new(decoder.embedding().clone(), None)),
            HeadKind::CausalLm => Head::Lm(Linear::new(root.get(cfg.arch.lm_head_name(), (v, h))?, None)),
            HeadKind::SequenceClassification { num_labels } => {
                if !root.contains("score.weight") {
                    return Err(Error::Weights {
                        msg: format!(
                            "{}: the sequence-classification head `score.weight` (shape [{num_labels}, {h}]) is missing",
                            cfg.path.parent().unwrap_or(Path::new(".")).display()
                        ),
                    });
                }
                Head::Score(Linear::new(root.get("score.weight", (num_labels, h))?, None))
            }
        };
        Ok(Self { decoder, head, cuts: None })
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.decoder.num_layers())
    }

    /// Final hidden states (B, T, H). With a cache, `inputs` continue the
    /// cached tokens and their keys/values are appended.
    pub fn hidden_states(&self, inputs: &Inputs, mut cache: Option<&mut KvCache>) -> TResult<Tensor> {
        let ctx = Arc::new(self.decoder.context(inputs, cache.as_deref())?);
        let mut x = self.decoder.embed(inputs)?;
        for layer in 0..self.decoder.num_layers() {
            x = match (&self.cuts, &cache) {
                (Some(cuts), None) => {
                    let (decoder, ctx) = (self.decoder.clone(), ctx.clone());
                    cuts.apply(&x, Arc::new(move |x: &Tensor| decoder.block(layer, x, &ctx, None)))?
                }
                _ => self.decoder.block(layer, &x, &ctx, cache.as_deref_mut())?,
            };
        }
        ctx.finish(cache);
        self.decoder.final_norm(&x)
    }

    /// Whether a backward gives the LM head's weight a gradient: a
    /// trained head (or tied embedding), not a LoRA run's frozen one
    /// unless its `modules_to_save` train it.
    pub fn head_trains(&self) -> bool {
        matches!(&self.head, Head::Lm(head) if head.weight.track_op())
    }

    /// Head outputs at every position: (B, T, V) next-token logits, or
    /// (B, T, num_labels) scores for a sequence-classification head.
    pub fn logits(&self, inputs: &Inputs, cache: Option<&mut KvCache>) -> TResult<Tensor> {
        self.project(&self.hidden_states(inputs, cache)?)
    }

    /// Applies the head to hidden states (..., H), e.g. to a gathered subset
    /// of positions so the full (B, T, V) logits are never materialised.
    /// Logits and scores are f32 whatever the compute dtype: log-softmax,
    /// losses and the CPU's samplers read them (a GPU's sampler reads the
    /// head's own output, [`project_to_sample`](Self::project_to_sample)).
    /// Without a graph one kernel widens them.
    pub fn project(&self, hidden: &Tensor) -> TResult<Tensor> {
        match &self.head {
            Head::Lm(head) | Head::Score(head) => {
                let out = head.forward(hidden)?;
                match out.track_op() {
                    true => out.to_dtype(DType::F32),
                    false => kernels::cast(&out, DType::F32),
                }
            }
        }
    }

    /// Next-token logits for a sampler, (..., V): on a GPU the LM head's
    /// output as it is, bf16 in a bf16 run, which the race sampler reads as
    /// its f32 cast (the same picks, at half the bytes, without a pass that
    /// widens 256 rows of 50,304 words at every decoding step); f32
    /// elsewhere, as [`project`](Self::project) gives.
    pub fn project_to_sample(&self, hidden: &Tensor) -> TResult<Tensor> {
        match &self.head {
            Head::Lm(head) if hidden.device().is_cuda() => {
                let out = head.forward(hidden)?;
                match out.dtype() {
                    DType::BF16 | DType::F32 => Ok(out),
                    _ => kernels::cast(&out, DType::F32),
                }
            }
            _ => self.project(hidden),
        }
    }

    /// [`project_to_sample`](Self::project_to_sample) at every position.
    pub fn logits_to_sample(&self, inputs: &Inputs, cache: Option<&mut KvCache>) -> TResult<Tensor> {
        self.project_to_sample(&self.hidden_states(inputs, cache)?)
    }

    /// The log-prob of each target under the LM head at temperature `T`
    /// and the entropy of that distribution, from hidden states (N, H): both
    /// (N,), only the log-probs differentiable.
    pub fn token_logprobs(&self, hidden: &Tensor, targets: &[u32], temperature: f64) -> TResult<(Tensor, Tensor)> {
        match &self.head {
            Head::Lm(head) => kernels::token_logprobs(hidden, &head.weight, targets, temperature),
            Head::Score(_) => candle_core::bail!("token log-probs need an LM head, not a score head"),
        }
    }

    /// Sequence scores (B, num_labels), read at each row's last real token.
    /// For an LM head this is the last token's logits.
    pub fn scores(&self, inputs: &Inputs) -> TResult<Tensor> {
        let hidden = self.hidden_states(inputs, None)?;
        let (b, t, h) = hidden.dims3()?;
        let last: Vec<u32> =
            inputs.last_token_index()?.into_iter().enumerate().map(|(row, i)| (row * t + i) as u32).collect();
        let idx = Tensor::from_vec(last, b, hidden.device())?;
        // (B, T, H) -> (B * T, H) -> (B, H)
        self.project(&kernels::gather_rows(&hidden.reshape((b * t, h))?, &idx)?)
    }
}

/// The gradients of `loss` for the parameters of `models`, whose
/// training networks computed it: with the networks cut between layers,
/// the layers' parameter gradients arrive beside the backward pass's own.
pub fn backward(loss: &Tensor, models: &[&Model]) -> TResult<GradStore> {
    let mut grads = loss.backward()?;
    for model in models {
        if let Some(cuts) = &model.train.cuts {
            cuts.collect(&mut grads)?;
        }
    }
    Ok(grads)
}

/// Tensors a checkpoint may hold that no architecture reads: the causal
/// masks and rotary tables older transformers saved as buffers, a tied LM
/// head's copy of the embeddings, and the head that a load replaces (a
/// reward model or critic started from a causal LM).
fn may_go_unused(name: &str, config: &ModelConfig) -> bool {
    const BUFFERS: [&str; 5] =
        [".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq"];
    let causal = config.head == HeadKind::CausalLm;
    BUFFERS.iter().any(|b| name.ends_with(b))
        || (name == config.arch.lm_head_name() && (config.tie_word_embeddings() || !causal))
        || (name.starts_with("score.") && causal)
}

/// Log-probability of each next token: for logits (B, T, V) and ids (B, T),
/// entry (b, t) is `log p(ids[b, t+1] | ids[b, ..=t])`, shape (B, T-1).
pub fn next_token_logprobs(logits: &Tensor, ids: &Tensor) -> TResult<Tensor> {
    let t = logits.dim(1)?;
    let logp = ops::log_softmax_last(&logits.narrow(1, 0, t - 1)?)?;
    let targets = ids.narrow(1, 1, t - 1)?.contiguous()?.unsqueeze(D::Minus1)?;
    logp.gather(&targets, D::Minus1)?.squeeze(D::Minus1)
}

/// A loaded model: its config, its parameters, a network that records
/// gradients, and a frozen one on detached weights for sampling and
/// scoring. Both share storage, so optimizer updates show in both.
pub struct Model {
    config: ModelConfig,
    params: ParamStore,
    train: Network,
    frozen: Network,
    dir: PathBuf,
    lora: Option<Lora>,
    layer_graphs: LayerGraphs,
    /// Whether the weights are on their device (see [`Model::park`]).
    parking: Parking,
}

/// A model's LoRA adapters: their config, the base model's directory, and
/// the network without them (the base, on the same detached weights).
struct Lora {
    config: LoraConfig,
    base_dir: PathBuf,
    base: Network,
    /// The dropout the training network applies to the adapters' inputs.
    dropout: Option<Dropout>,
}

/// Where a model's weights are loaded, and the dtype its run computes in:
/// tensors stored in that dtype are read as they are, the others as f32, so
/// that a bf16 run on bf16 weights never holds an f32 copy of them all
/// (at 8B, 33 GB beside the 16 GB it keeps). [`Model::with_dtype`] then
/// sets the dtype the model computes in. A device alone loads f32.
#[derive(Debug, Clone, Copy)]
pub struct Placement<'a> {
    pub device: &'a Device,
    pub dtype: DType,
}

impl<'a> Placement<'a> {
    pub fn new(device: &'a Device, dtype: DType) -> Self {
        Self { device, dtype }
    }
}

impl<'a> From<&'a Device> for Placement<'a> {
    fn from(device: &'a Device) -> Self {
        Self { device, dtype: DType::F32 }
    }
}

/// Where a model's adapters come from.
enum Adapters<'a> {
    /// New ones: `B` = 0, `A` drawn from the seed.
    New(LoraConfig, u64),
    /// A PEFT adapter directory's.
    Saved(LoraConfig, &'a Path),
}

impl Model {
    /// Loads a Hugging Face model directory, or a PEFT adapter directory
    /// onto the base model its `adapter_config.json` names.
    pub fn load<'a>(dir: &Path, at: impl Into<Placement<'a>>) -> Result<Self> {
        let at = at.into();
        if dir.join(ADAPTER_CONFIG).is_file() {
            return Self::load_adapter(dir, None, at);
        }
        let config = ModelConfig::from_dir(dir)?;
        Self::load_config(dir, at, config, None, None)
    }

    /// Loads a model that samples or scores, computing in `at`'s dtype with
    /// no f32 copy of its weights ([`Self::with_dtype`], not training).
    pub fn load_computing(dir: &Path, at: Placement) -> Result<Self> {
        Self::load(dir, at)?.with_dtype(at.dtype, false)
    }

    /// Loads a directory with the given head. A sequence-classification
    /// head the checkpoint lacks (a reward model started from a causal LM)
    /// is initialised like transformers does, normal(0, initializer_range),
    /// from `seed`.
    pub fn load_with_head<'a>(dir: &Path, at: impl Into<Placement<'a>>, head: HeadKind, seed: u64) -> Result<Self> {
        let mut config = ModelConfig::from_dir(dir)?;
        config.head = head;
        Self::load_config(dir, at.into(), config, Some(seed), None)
    }

    /// Loads the model in `dir` (with `head`) and adds new LoRA adapters:
    /// it starts as the base, and only the adapters and `modules_to_save`
    /// train.
    pub fn load_with_new_adapters<'a>(
        dir: &Path,
        at: impl Into<Placement<'a>>,
        head: HeadKind,
        lora: LoraConfig,
        seed: u64,
    ) -> Result<Self> {
        lora.validate()?;
        let mut config = ModelConfig::from_dir(dir)?;
        config.head = head;
        Self::load_config(dir, at.into(), config, Some(seed), Some(Adapters::New(lora, seed)))
    }

    /// Loads a PEFT adapter directory onto its base model: `base`, or the
    /// one its `adapter_config.json` names.
    pub fn load_adapter<'a>(dir: &Path, base: Option<&Path>, at: impl Into<Placement<'a>>) -> Result<Self> {
        let file = lora::read_adapter_config(dir)?;
        let base_dir = match base {
            Some(b) => b.to_path_buf(),
            None => super::hub::resolve_model(&file.base)?,
        };
        let mut config = ModelConfig::from_dir(&base_dir)?;
        if file.task_type.as_deref() == Some("SEQ_CLS") && config.head == HeadKind::CausalLm {
            // A reward model trained from a causal LM: its head is in the adapter.
            let score = format!("{PEFT_PREFIX}score.weight");
            let (shape, _) = WeightFiles::open_adapter(dir)?.info(&score).map_err(|_| {
                Error::bad_file(dir, format!("a SEQ_CLS adapter on a causal LM must hold its head `{score}`"))
            })?;
            config.head = HeadKind::SequenceClassification { num_labels: shape[0] };
        }
        let mut model = Self::load_config(&base_dir, at.into(), config, None, Some(Adapters::Saved(file.config, dir)))?;
        model.dir = dir.to_path_buf();
        Ok(model)
    }

    fn load_config(
        dir: &Path,
        Placement { device, dtype }: Placement,
        config: ModelConfig,
        seed: Option<u64>,
        adapters: Option<Adapters>,
    ) -> Result<Self> {
        let files = WeightFiles::open(dir)?;
        let source = Source::files(&files, device, dtype);
        // A saved adapter's tensors: its modules_to_save replace the base's
        // tensors; its LoRA matrices wait for the modules they adapt.
        let mut saved_adapters = HashMap::new();
        if let Some(Adapters::Saved(_, adapter_dir)) = &adapters {
            let adapter_files = WeightFiles::open_adapter(adapter_dir)?;
            for name in adapter_files.names() {
                let short = name.strip_prefix(PEFT_PREFIX).ok_or_else(|| {
                    Error::bad_file(adapter_dir, format!("adapter tensor `{name}` lacks PEFT's `{PEFT_PREFIX}`"))
                })?;
                let tensor = adapter_files.load_f32(name, device)?;
                if lora::is_adapter(short) {
                    saved_adapters.insert(short.to_string(), tensor);
                } else {
                    source.add_fresh(short, &tensor)?;
                }
            }
        }
        if let (HeadKind::SequenceClassification { num_labels }, Some(seed)) = (config.head, seed) {
            if !files.contains("score.weight") {
                let std = config.raw.get("initializer_range").and_then(serde_json::Value::as_f64).unwrap_or(0.02);
                let mut rng = crate::rng::Rng::stream(seed, &[crate::rng::streams::SCORE_HEAD_INIT]);
                let width = config.head_width();
                let values: Vec<f32> = (0..num_labels * width).map(|_| (rng.normal() * std) as f32).collect();
                source.add_fresh("score.weight", &Tensor::from_vec(values, (num_labels, width), device)?)?;
                tracing::info!("{}: new score head ({num_labels} x {width})", dir.display());
            }
        }
        let plan = adapters.map(|a| match a {
            Adapters::New(lora, seed) => AdapterPlan::new(lora, seed),
            Adapters::Saved(lora, _) => AdapterPlan::saved(lora, saved_adapters),
        });
        let train = Network::build(&config, &source.root_with(plan.as_ref()))?;
        let unused = source.unused();
        let stray: Vec<&String> = unused.iter().filter(|name| !may_go_unused(name, &config)).collect();
        if !stray.is_empty() {
            let shown: Vec<String> = stray.iter().take(6).map(|n| format!("`{n}`")).collect();
            return Err(Error::Weights {
                msg: format!(
                    "{}: {} tensors that config.json does not use ({}{}): the weights and config.json do not \
                     belong together (was config.json edited, e.g. num_hidden_layers?)",
                    dir.display(),
                    stray.len(),
                    shown.join(", "),
                    if stray.len() > shown.len() { ", ..." } else { "" }
                ),
            });
        }
        if !unused.is_empty() {
            tracing::debug!("{}: ignoring {} unused tensors: {:?}", dir.display(), unused.len(), unused);
        }
        let mut params = source.into_store();
        let Some(plan) = plan else {
            let frozen = Network::build(&config, &Source::store(&params, Detach::All).root())?;
            return Ok(Self {
                config,
                params,
                train,
                frozen,
                dir: dir.to_path_buf(),
                lora: None,
                layer_graphs: LayerGraphs::Whole,
                parking: Parking::default(),
            });
        };
        if let Some(stray) = plan.unused().first() {
            return Err(Error::Weights {
                msg: format!(
                    "adapter tensor `{PEFT_PREFIX}{stray}` fits no module of the base model {}",
                    dir.display()
                ),
            });
        }
        let lora = plan.config.clone();
        params.freeze_all_but(|name| lora::is_adapter(name) || lora.saves(name));
        // Rebuilt on the store, so that the base weights record no graph.
        let train = Network::build(&config, &Source::store(&params, Detach::Frozen).root_with(Some(&plan)))?;
        let frozen = Network::build(&config, &Source::store(&params, Detach::All).root_with(Some(&plan)))?;
        let base = Network::build(&config, &Source::store(&params, Detach::All).root())?;
        let lora = Some(Lora { config: lora, base_dir: dir.to_path_buf(), base, dropout: None });
        let dir = dir.to_path_buf();
        Ok(Self {
            config,
            params,
            train,
            frozen,
            dir,
            lora,
            layer_graphs: LayerGraphs::Whole,
            parking: Parking::default(),
        })
    }

    /// A new model with random weights (transformers' initialisation,
    /// normal(0, `initializer_range`)) for `config`; `files_from` is the
    /// directory whose tokenizer and generation config a save carries over.
    pub fn init_random(config: ModelConfig, device: &Device, seed: u64, files_from: &Path) -> Result<Self> {
        let std = config.raw.get("initializer_range").and_then(serde_json::Value::as_f64).unwrap_or(0.02);
        let source = Source::random(device, std, seed);
        let train = Network::build(&config, &source.root())?;
        let params = source.into_store();
        let frozen = Network::build(&config, &Source::store(&params, Detach::All).root())?;
        Ok(Self {
            config,
            params,
            train,
            frozen,
            dir: files_from.to_path_buf(),
            lora: None,
            layer_graphs: LayerGraphs::Whole,
            parking: Parking::default(),
        })
    }

    /// Sets a `config.json` key written when saving (e.g. `pad_token_id`).
    pub fn set_config_key(&mut self, key: &str, value: serde_json::Value) {
        if let serde_json::Value::Object(map) = &mut self.config.raw {
            map.insert(key.to_string(), value);
        }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn head(&self) -> HeadKind {
        self.config.head
    }

    /// The directory the model was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn params(&self) -> &ParamStore {
        &self.params
    }

    /// Where the weights live.
    pub fn device(&self) -> Device {
        self.params.iter().next().map_or(Device::Cpu, |p| p.var.device().clone())
    }

    /// The network whose outputs carry gradients to [`Model::params`].
    pub fn network(&self) -> &Network {
        &self.train
    }

    /// The same network on detached weights: no autograd graph is recorded.
    pub fn frozen(&self) -> &Network {
        &self.frozen
    }

    /// Moves the weights of a model nothing trains (a reference, a reward
    /// model: its `role` in the log) to host memory, freeing its device's;
    /// nothing may read them until [`Self::resident`]. See [`super::park`].
    pub fn park(&self, role: &str) -> Result<()> {
        let tensors = || self.params.iter().flat_map(|p| [p.var.as_tensor().clone(), p.compute().clone()]).collect();
        self.parking.park(&format!("{role} ({})", self.dir.display()), tensors)
    }

    /// Starts copying parked weights back, beside the device's work.
    pub fn begin_return(&self) -> Result<()> {
        self.parking.begin_return()
    }

    /// Makes the weights readable again where they were parked: the
    /// device's work from now on runs after their copies.
    pub fn resident(&self) -> Result<()> {
        self.parking.resident()
    }

    /// Loads a model to train with `head`: a PEFT adapter directory keeps
    /// training its adapters; otherwise `peft` may add new ones (with
    /// `modules_to_save` training in full beside them), or the whole model
    /// trains. With `dropout`, the training network applies the adapters'
    /// `lora_dropout` (SFT and reward training; online RL trains without
    /// it, as TRL's trainers do).
    pub fn load_trainable<'a>(
        dir: &Path,
        at: impl Into<Placement<'a>>,
        head: HeadKind,
        (peft, modules_to_save): (&PeftOptions, &[&str]),
        seed: u64,
        dropout: bool,
    ) -> Result<Self> {
        let at = at.into();
        let mut model = if dir.join(ADAPTER_CONFIG).is_file() {
            Self::load_adapter(dir, None, at)?
        } else {
            match peft.lora(ModelConfig::from_dir(dir)?.arch, modules_to_save)? {
                Some(lora) => Self::load_with_new_adapters(dir, at, head, lora, seed)?,
                None if head == HeadKind::CausalLm => Self::load(dir, at)?,
                None => Self::load_with_head(dir, at, head, seed)?,
            }
        };
        if let Some(l) = model.lora.as_mut().filter(|l| dropout && l.config.dropout > 0.0) {
            l.dropout = Some(Dropout::new(l.config.dropout, seed));
            model.build_networks()?;
        }
        if model.lora.is_some() {
            let (trainable, all) = (model.params.trainable_numel(), model.params.numel());
            let share = 100.0 * trainable as f64 / all.max(1) as f64;
            tracing::info!("LoRA: {trainable} trainable parameters of {all} ({share:.2}%)");
        }
        Ok(model)
    }

    /// The model computing in `dtype` (bf16 mixed precision: the networks
    /// compute in bf16 while the parameters that train keep f32 masters,
    /// split beside the copies by default; see
    /// [`ParamStore::set_compute_dtype`]). `trains`: whether an
    /// optimizer will update it; a model that only samples or scores keeps
    /// no f32 copy.
    pub fn with_dtype(mut self, dtype: DType, trains: bool) -> Result<Self> {
        if self.params.computes_in(dtype, trains)? {
            return Ok(self);
        }
        self.params.set_compute_dtype(dtype, trains)?;
        self.build_networks()?;
        Ok(self)
    }

    /// The dtype the networks compute in.
    pub fn dtype(&self) -> DType {
        self.params.compute_dtype()
    }

    /// Builds the networks on the parameters: the training one (with the
    /// adapters' dropout), the detached one, and the base without adapters.
    fn build_networks(&mut self) -> Result<()> {
        let plan = |dropout: Option<Dropout>| {
            self.lora.as_ref().map(|l| {
                let mut plan = AdapterPlan::new(l.config.clone(), 0);
                plan.dropout = dropout;
                plan
            })
        };
        let train_plan = plan(self.lora.as_ref().and_then(|l| l.dropout.clone()));
        let graphs = self.layer_graphs;
        self.train =
            Network::build(&self.config, &Source::store(&self.params, Detach::Frozen).root_with(train_plan.as_ref()))?;
        let frozen_plan = plan(None);
        self.frozen =
            Network::build(&self.config, &Source::store(&self.params, Detach::All).root_with(frozen_plan.as_ref()))?;
        if let Some(l) = &mut self.lora {
            l.base = Network::build(&self.config, &Source::store(&self.params, Detach::All).root())?;
        }
        self.set_layer_graphs(graphs);
        Ok(())
    }

    /// What the training network keeps of each layer's graph (see
    /// [`LayerGraphs`]). Cut between layers, its gradients are complete
    /// only through [`backward`].
    pub fn with_layer_graphs(mut self, graphs: LayerGraphs) -> Self {
        self.set_layer_graphs(graphs);
        self
    }

    /// Starts the adapters' dropout masks of optimizer step `step` from a
    /// stream of (seed, step) alone, so that a resumed run draws a step's
    /// masks as the uninterrupted one did.
    pub fn start_dropout_step(&self, seed: u64, step: usize) {
        if let Some(dropout) = self.lora.as_ref().and_then(|l| l.dropout.as_ref()) {
            dropout.replace_state(Rng::stream(seed, &[streams::LORA_DROPOUT, step as u64 + 1]));
        }
    }

    fn set_layer_graphs(&mut self, graphs: LayerGraphs) {
        let dropout = self.lora.as_ref().and_then(|l| l.dropout.clone());
        self.layer_graphs = graphs;
        self.train.cuts = LayerCuts::new(graphs, dropout);
    }

    /// With LoRA adapters: the network without them (the base model, on
    /// the same detached weights), e.g. the KL reference.
    pub fn base(&self) -> Option<&Network> {
        self.lora.as_ref().map(|l| &l.base)
    }

    /// With LoRA adapters: their config and the base model's directory.
    pub fn lora(&self) -> Option<(&LoraConfig, &Path)> {
        self.lora.as_ref().map(|l| (&l.config, l.base_dir.as_path()))
    }

    /// Checks that one token sequence fits the model: ids inside the
    /// vocabulary and length inside learned position tables.
    pub fn check_tokens(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::Invalid(format!("token id {bad} is outside the vocabulary of size {vocab}")));
        }
        match self.config.context_length() {
            Some(max) if ids.len() > max => Err(Error::Invalid(format!(
                "sequence of {} tokens is longer than the model's context of {max} positions",
                ids.len()
            ))),
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    /// candle's backward as vendor/candle-core patches it: a tensor's first
    /// gradient is kept (contiguous) and later ones are added to it.
    #[test]
    fn gradients_sum_over_every_use_and_come_back_contiguous() {
        let dev = Device::Cpu;
        let x = Var::from_vec(vec![1f32, -2., 3., 0.5, -0., 4.], (2, 3), &dev).unwrap();
        let w = Var::from_vec(vec![0.25f32, 1., -1., 2., 3., -4.], (2, 3), &dev).unwrap();
        let c = Tensor::from_vec(vec![1f32, 2., 3., 4., 5., 6.], (3, 2), &dev).unwrap();
        // x is used twice (through a transpose and squared); w once, through a transpose.
        let through_t = (x.t().unwrap() * &c).unwrap().sum_all().unwrap();
        let squared = x.sqr().unwrap().sum_all().unwrap();
        let w_term = (w.t().unwrap() * &c).unwrap().sum_all().unwrap();
        let loss = ((through_t + squared).unwrap() + w_term).unwrap();
        let grads = loss.backward().unwrap();
        let (gx, gw) = (grads.get(&x).unwrap(), grads.get(&w).unwrap());
        let ct: Vec<f32> = c.t().unwrap().flatten_all().unwrap().to_vec1().unwrap();
        let xs: Vec<f32> = x.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let want_x: Vec<f32> = ct.iter().zip(&xs).map(|(c, x)| c + 2. * x).collect();
        assert_eq!(gx.flatten_all().unwrap().to_vec1::<f32>().unwrap(), want_x);
        assert_eq!(gw.flatten_all().unwrap().to_vec1::<f32>().unwrap(), ct);
        assert!(gx.is_contiguous() && gw.is_contiguous(), "a transposed gradient is stored contiguous");
    }
}
