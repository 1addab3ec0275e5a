//! A run's fixed parts, made once: the models (policy, reference, critic),
//! tokenizer, rewards, prompts, batch sizes and sampling options; and the
//! resume from a checkpoint.

use std::path::Path;

use super::algorithm::{self, Start};
use super::{Optimizers, Reference, Run};
use crate::data::prompts::{length_filter, ContextRoom, PromptDataset, PromptSpec};
use crate::data::{DatasetSpec, Tokenizer};
use crate::dist::{self, Communicator};
use crate::error::{Error, Result};
use crate::generate::{GenerateOptions, Sampler, Sampling, Stepping, StopCriteria};
use crate::model::arch::Keeping;
use crate::model::hub::resolve_model;
use crate::model::kernels;
use crate::model::layer_graphs::LayerGraphs;
use crate::model::{HeadKind, Model, ModelConfig, Placement};
use crate::reward;
use crate::train::checkpoint::{self, TrainerState};
use crate::train::config::{load_toml, BatchSizes, LongPrompts, TrainConfig, CHANGEABLE_ON_RESUME, CONFIG_FILE};
use crate::train::memory;
use crate::train::optim::warmup_steps;

/// How the run reads prompts from its rows (column or template, chat,
/// length limits), for a policy of `config`; evaluations on held-out rows
/// read them the same way.
pub fn prompt_spec(cfg: &TrainConfig, config: &ModelConfig) -> PromptSpec {
    PromptSpec {
        prompt_column: cfg.data.prompt_column.clone(),
        template: cfg.data.template.clone(),
        chat: cfg.data.chat,
        system_prompt: cfg.data.system_prompt.clone(),
        max_prompt_length: cfg.data.max_prompt_length,
        context_room: ContextRoom::of(config, cfg.generation.response_length),
        error_on_long: cfg.data.long_prompts == LongPrompts::Error,
        length_filter: cfg.data.filter_length.then(|| length_filter(cfg.generation.response_length)),
    }
}

impl Run {
    pub(super) fn start(cfg: &TrainConfig, comm: std::sync::Arc<dyn Communicator>) -> Result<Self> {
        let world = comm.world();
        let device = dist::device_for(&cfg.model.device, world)?;
        let comm = dist::on_device(comm, &device)?;
        let policy_dir = resolve_model(&cfg.model.policy)?;
        let tokenizer_dir = match &cfg.model.tokenizer {
            Some(t) => resolve_model(t)?,
            None => policy_dir.clone(),
        };
        let tokenizer = Tokenizer::from_dir(&tokenizer_dir)?;
        // No LoRA dropout in online training, as in TRL.
        let peft = (&cfg.peft, &[][..]);
        let dtype = cfg.train.dtype.dtype();
        let policy = Model::load_trainable(
            &policy_dir,
            Placement::new(&device, dtype),
            HeadKind::CausalLm,
            peft,
            cfg.train.seed,
            false,
        )?
        .with_dtype(dtype, true)?
        .with_layer_graphs(LayerGraphs::for_training(cfg.train.gradient_checkpointing));
        if policy.head() != HeadKind::CausalLm {
            return Err(Error::bad_file(
                &policy_dir,
                "the policy must be a causal LM, this is a sequence-classification model",
            ));
        }
        tokenizer.check_model(policy.config())?;
        let reference = if cfg.rloo.kl_coef > 0.0 && cfg.model.reference.is_none() && policy.base().is_some() {
            tracing::info!("KL reference: the policy without its LoRA adapters");
            Some(Reference::PolicyBase)
        } else if cfg.rloo.kl_coef > 0.0 {
            let dir = match &cfg.model.reference {
                Some(r) => resolve_model(r)?,
                None => policy_dir.clone(),
            };
            let reference = Model::load_computing(&dir, Placement::new(&device, dtype))?;
            let (p, r) = (policy.config().vocab_size(), reference.config().vocab_size());
            if reference.head() != HeadKind::CausalLm || p != r {
                return Err(Error::Invalid(format!(
                    "the reference {} does not fit the policy {}: it must be a causal LM over the same {p} tokens \
                     (it has {r})",
                    dir.display(),
                    policy_dir.display()
                )));
            }
            Some(Reference::Model(Box::new(reference)))
        } else {
            None
        };
        check_lengths(cfg, policy.config())?;
        let algorithm =
            algorithm::start(&Start { cfg, policy_dir: &policy_dir, policy: policy.config(), device: &device })?;
        let rewards = reward::build(&cfg.reward, &device, dtype)?;
        if cfg.rloo.ref_reward_offload {
            let own_reference = matches!(reference, Some(Reference::Model(_)));
            match rewards.models().len() + own_reference as usize {
                0 => tracing::warn!(
                    "ref_reward_offload: no reference or reward model of its own to move (a LoRA policy's \
                     reference is its own base weights)"
                ),
                _ if device.is_cpu() => tracing::info!(
                    "ref_reward_offload: on the CPU the models' weights are moved aside and back, saving no memory"
                ),
                _ => {}
            }
        }
        let shaping = cfg.rloo.shaping();

        let source = DatasetSpec {
            name: cfg.data.path.clone(),
            config: cfg.data.config.clone(),
            split: cfg.data.split.clone(),
            filter: cfg.data.filter.clone(),
            take: cfg.data.take,
        };
        let dataset = PromptDataset::load(&source, &prompt_spec(cfg, policy.config()), &tokenizer)?;
        let rows: Vec<_> = dataset.rows.iter().map(|r| &r.row.fields).collect();
        rewards.check_rows(&rows)?;
        let sizes = BatchSizes::for_world(cfg, Some(dataset.len()), world.size)?;
        if world.joined {
            // Ranks that differ would train different models in lockstep.
            dist::check_same(&*comm, "options", &crate::data::byte_digest(cfg.to_toml().as_bytes()))?;
            dist::check_same(&*comm, "prompts", &dataset.digest())?;
            dist::check_same(&*comm, "policy weights", &policy.params().fingerprint()?)?;
            tracing::info!("rank {} of {}: one process per device, batch sizes per process", world.rank, world.size);
        }
        tracing::info!("{} prompts from {}; {}", dataset.len(), dataset.label, sizes.describe(cfg.rloo.num_ppo_epochs));
        if cfg.rloo.steps_per_generation.is_some() || cfg.rloo.generation_batch_size.is_some() {
            tracing::info!("in TRL 1.x's terms: {}", sizes.describe_trl_1x());
        }

        let memory_plan = {
            let longest = dataset.rows.iter().map(|r| r.ids.len()).max().unwrap_or(0);
            let held = memory::Held {
                params: policy.params().numel(),
                trainable: policy.params().trainable_numel(),
                head_trains: policy.network().head_trains(),
                // An offloaded reference is in host memory at the training's peak.
                reference: matches!(reference, Some(Reference::Model(_))) && !cfg.rloo.ref_reward_offload,
                critic_params: algorithm.trained().iter().map(|t| t.model.params().numel()).sum(),
                dtype,
            };
            let config = policy.config();
            let keeping = Keeping {
                lora: policy.lora().is_some(),
                mlp_input_remade: kernels::mlp_input_remade()?,
                mask_spans: device.is_cuda()
                    && kernels::attention_spans_chosen()?
                    && kernels::spans_taken(kernels::attention_kernels()?, dtype, config.head_dim()),
            };
            let estimate = memory::rloo_estimate(cfg, &sizes, (config, keeping), held, longest);
            match device.is_cpu() {
                true => memory::warn_if_short(&estimate),
                false => tracing::info!("GPU memory plan: {}", estimate.describe()),
            }
            Some(estimate.total())
        };
        let generation = generation_options(cfg, &policy_dir, &tokenizer, &policy)?;
        let warmup = warmup_steps(cfg.train.warmup_steps, cfg.train.warmup_ratio, sizes.optimizer_steps);
        Ok(Self {
            cfg: cfg.clone(),
            sizes,
            device,
            tokenizer,
            policy,
            reference,
            algorithm,
            rewards,
            shaping,
            dataset,
            generation,
            warmup,
            memory_plan,
            comm,
        })
    }

    /// Continues from a checkpoint when asked; returns where the run stands.
    pub(super) fn resume_state(&mut self, optimizers: &mut Optimizers) -> Result<TrainerState> {
        let fresh = TrainerState {
            step: 0,
            episode: 0,
            optimizer_step: 0,
            total_steps: self.sizes.steps,
            prompts_digest: self.dataset.digest(),
            skipped_steps: 0,
            world_size: self.comm.world().size,
        };
        let Some(spec) = &self.cfg.train.resume_from_checkpoint else {
            return Ok(fresh);
        };
        let Some(dir) = checkpoint::to_resume(spec, Path::new(&self.cfg.train.output_dir)) else {
            return Ok(fresh);
        };
        let mut state = checkpoint::load_state(&dir)?;
        checkpoint::check_config(&dir, CONFIG_FILE, &self.cfg, &self.changeable_on_resume(&dir, &state)?)?;
        state.world_size = fresh.world_size;
        if state.total_steps != self.sizes.steps {
            return Err(Error::Invalid(format!(
                "{} belongs to a run of {} steps, this configuration makes {}; resume with the same batch sizes and total_episodes",
                dir.display(),
                state.total_steps,
                self.sizes.steps
            )));
        }
        if !state.prompts_digest.is_empty() && state.prompts_digest != fresh.prompts_digest {
            return Err(Error::Invalid(format!(
                "cannot resume from {}: the prompts of {} differ from those the run was trained on",
                dir.display(),
                self.dataset.label
            )));
        }
        tracing::info!("resuming from {} at step {}", dir.display(), state.step);
        let (at, dtype) = (state.optimizer_step, self.cfg.train.dtype.dtype());
        let policy = self.policy.config().clone();
        self.policy = checkpoint::load_part(&dir, "", &policy, &self.device, &mut optimizers.policy, at, dtype)?;
        let subdirs: Vec<&str> = self.algorithm.trained().iter().map(|t| t.subdir).collect();
        let trained = self.algorithm.trained_mut().into_iter().zip(subdirs).zip(&mut optimizers.trained);
        for ((model, subdir), optimizer) in trained {
            let config = model.config().clone();
            *model = checkpoint::load_part(&dir, subdir, &config, &self.device, optimizer, at, dtype)?;
        }
        Ok(state)
    }
}

impl Run {
    /// What a resume may change: with another number of processes, the
    /// per-process batch sizes too, as long as the job's mini-batches and
    /// rollouts stay what they were.
    fn changeable_on_resume(&self, dir: &Path, state: &TrainerState) -> Result<Vec<&'static str>> {
        let mut keys = CHANGEABLE_ON_RESUME.to_vec();
        let (then, now) = (state.world_size.max(1), self.comm.world().size);
        if then == now {
            return Ok(keys);
        }
        let saved: TrainConfig = load_toml(Some(&dir.join(CONFIG_FILE)), &[], |_, _| Ok(()))?;
        let before = BatchSizes::for_world(&saved, Some(self.dataset.len()), then)?;
        let after = &self.sizes;
        if (before.mini, before.batch, before.total_episodes) != (after.mini, after.batch, after.total_episodes) {
            return Err(Error::Invalid(format!(
                "{} was saved by {then} process(es) training on mini-batches of {} completions from rollouts of {}; \
                 here {now} process(es) make {} from {}: give per_device_train_batch_size x \
                 gradient_accumulation_steps x {now} = {} to continue it",
                dir.display(),
                before.mini,
                before.batch,
                after.mini,
                after.batch,
                before.mini
            )));
        }
        tracing::info!(
            "continuing a run of {then} process(es) on {now}: the same mini-batches of {} completions",
            after.mini
        );
        keys.extend([
            "train.per_device_train_batch_size",
            "train.gradient_accumulation_steps",
            "rloo.steps_per_generation",
        ]);
        Ok(keys)
    }
}

/// The options that must fit the policy: the stop token inside its
/// vocabulary, the longest prompt and the completion inside its context.
fn check_lengths(cfg: &TrainConfig, policy: &crate::model::ModelConfig) -> Result<()> {
    let bad = |msg: String| Err(Error::Invalid(msg));
    let vocab = policy.vocab_size();
    if let Some(id) = cfg.generation.stop_token_id.filter(|&id| id as usize >= vocab) {
        return bad(format!("generation.stop_token_id = {id} is outside the policy's vocabulary of {vocab}"));
    }
    let Some(positions) = policy.context_length() else { return Ok(()) };
    if let Some(max) = cfg.data.max_prompt_length.filter(|&m| m > positions) {
        return bad(format!(
            "data.max_prompt_length = {max} is more than the policy's context of {positions} positions"
        ));
    }
    let response = cfg.generation.response_length;
    if response >= positions {
        return bad(format!(
            "generation.response_length = {response} leaves no room for a prompt in the policy's context of \
             {positions} positions"
        ));
    }
    Ok(())
}

/// Sampling and stopping for rollouts, from the configuration and the
/// policy's generation config.
fn generation_options(
    cfg: &TrainConfig,
    policy_dir: &Path,
    tokenizer: &Tokenizer,
    policy: &Model,
) -> Result<GenerateOptions> {
    let g = &cfg.generation;
    let mut stop_ids = Vec::new();
    if g.stop_token == "eos" {
        stop_ids = StopCriteria::model_eos_ids(policy_dir, tokenizer)?;
        if stop_ids.is_empty() {
            tracing::warn!("stop_token = \"eos\" but the policy has no EOS id; completions run to response_length");
        }
    }
    stop_ids.extend(g.stop_token_id);
    Ok(GenerateOptions {
        max_new_tokens: g.response_length,
        num_return_sequences: cfg.rloo.k,
        sampling: Sampling::temperature(g.temperature as f32)
            .with_top_k(g.top_k)
            .with_top_p(g.top_p as f32)
            .with_min_p(g.min_p as f32),
        repetition_penalty: g.repetition_penalty as f32,
        stop: StopCriteria { token_ids: stop_ids, strings: vec![] },
        batch_size: g.local_rollout_forward_batch_size,
        sampler: Sampler::from_env(&policy.device())?,
        stepping: Stepping::from_env(&policy.device())?,
        seed: cfg.train.seed,
        prompt_offset: 0,
        max_positions: policy.config().max_positions(),
    })
}
