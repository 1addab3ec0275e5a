//! The RLOO loop (../SPEC-RLOO.md), one rollout batch per step:
//! rollout -> scores -> old and reference log-probs -> KL and returns ->
//! leave-one-out advantages -> epochs x mini-batches x micro-batches of the
//! clipped policy loss -> metrics, samples, checkpoint.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{Device, Tensor};

use super::checkpoint::{self, TrainerState};
use super::config::{BatchSizes, LongPrompts, TrainConfig};
use super::optim::{learning_rate, AdamW, GradAccumulator, StepGuard};
use super::run_dir::{Reuse, RunDir};
use super::stop;
use crate::algo::{self, KlPlacement, LossStats};
use crate::data::prompts::{length_filter, ContextRoom, PromptDataset, PromptSpec};
use crate::data::DatasetSpec;
use crate::data::Tokenizer;
use crate::error::{Error, Result};
use crate::generate::rng::streams;
use crate::generate::{Completion, GenerateOptions, Rng, Sampling, StopCriteria};
use crate::io::write_atomic;
use crate::model::hub::resolve_model;
use crate::model::scoring::{completion_logprobs, completion_logprobs_chunked, Sequences, TokenLogprobs};
use crate::model::{parse_device, HeadKind, Model, Network};
use crate::report::{
    metric_sinks, JsonlMetrics, Metrics, MetricsSink, SampleTable, SampleWriter, TensorBoardWriter, TrainProgress,
};
use crate::reward::{self, RewardSet, Shaping};
use crate::rollout::Rollout;

/// What a finished (or stopped) run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub steps: usize,
    pub episodes: usize,
    pub output_dir: PathBuf,
    /// The last logged metrics.
    pub last: Metrics,
    /// Where the time of this run's steps went.
    pub timing: StepTiming,
}

/// Seconds spent in each phase, summed over steps. The first step of a run
/// also pays one-time warm-up costs, so it is kept apart.
#[derive(Debug, Clone, Default)]
pub struct StepTiming {
    pub steps: usize,
    pub completions: usize,
    pub generation: f64,
    pub scoring: f64,
    pub reference: f64,
    /// Scoring and reference run side by side: the wall time of both.
    pub scoring_and_reference: f64,
    pub training: f64,
    pub total: f64,
    /// The sums leave out the run's first step.
    pub after_first: bool,
}

impl StepTiming {
    fn add(&mut self, completions: usize, phases: [f64; 6]) {
        self.steps += 1;
        self.completions += completions;
        let [generation, scoring, reference, scoring_and_reference, training, total] = phases;
        self.generation += generation;
        self.scoring += scoring;
        self.reference += reference;
        self.scoring_and_reference += scoring_and_reference;
        self.training += training;
        self.total += total;
    }

    /// "generation 0.13 s, scoring ..." per step, and completions per second.
    pub fn describe(&self) -> String {
        let n = self.steps.max(1) as f64;
        format!(
            "per step: generation {:.3} s, scoring {:.3} s and reference {:.3} s side by side ({:.3} s together), \
             training {:.3} s, total {:.3} s; {:.1} completions/s",
            self.generation / n,
            self.scoring / n,
            self.reference / n,
            self.scoring_and_reference / n,
            self.training / n,
            self.total / n,
            self.completions as f64 / self.total.max(1e-9)
        )
    }
}

/// Everything a step needs that does not change between steps.
struct Run {
    cfg: TrainConfig,
    sizes: BatchSizes,
    device: Device,
    tokenizer: Tokenizer,
    policy: Model,
    reference: Option<Model>,
    rewards: RewardSet,
    shaping: Shaping,
    dataset: PromptDataset,
    generation: GenerateOptions,
    warmup: usize,
}

/// Saves the weights of the last finished step, when no checkpoint holds
/// them yet, before a run stops on a failure outside it; says where.
fn save_before_stopping(
    output_dir: &Path,
    run: &Run,
    optimizer: &AdamW,
    state: &TrainerState,
    config_toml: &str,
) -> Result<String> {
    if state.step == 0 {
        return Ok("no step had finished, so there was nothing to save".into());
    }
    let dir = checkpoint::checkpoint_dir(output_dir, state.step);
    if !dir.join(checkpoint::STATE_FILE).exists() {
        checkpoint::save(&dir, &run.policy, optimizer, state, config_toml)?;
    }
    Ok(format!(
        "the run stopped after step {} with its weights in {}; continue with --resume_from_checkpoint latest",
        state.step,
        dir.display()
    ))
}

pub fn train(cfg: &TrainConfig) -> Result<RunSummary> {
    cfg.validate()?;
    let output_dir = PathBuf::from(&cfg.train.output_dir);
    let reuse = if cfg.train.resume_from_checkpoint.is_some() {
        Reuse::Resume
    } else if cfg.train.overwrite_output_dir {
        Reuse::Overwrite
    } else {
        Reuse::Fresh
    };
    let _run_dir = RunDir::open(&output_dir, reuse)?;
    stop::install();
    let mut optimizer =
        AdamW::new(cfg.train.adam_beta1, cfg.train.adam_beta2, cfg.train.adam_epsilon, cfg.train.weight_decay);
    let mut run = Run::start(cfg)?;
    let start = run.resume_state(&mut optimizer)?;
    let config_toml = cfg.to_toml();
    write_atomic(&output_dir.join(checkpoint::CONFIG_FILE), config_toml.as_bytes())?;

    let first_logged = start.step as u64 + 1;
    let mut sinks: Vec<Box<dyn MetricsSink>> = if start.step == 0 {
        metric_sinks(&output_dir)?
    } else {
        vec![
            Box::new(JsonlMetrics::resume(&output_dir, first_logged)?),
            Box::new(TensorBoardWriter::resume(&output_dir, first_logged)?),
        ]
    };
    let mut sample_log = if start.step == 0 {
        SampleWriter::create(&output_dir)?
    } else {
        SampleWriter::resume(&output_dir, first_logged)?
    };

    let sizes = run.sizes;
    let stop_at = cfg.train.stop_after.map_or(sizes.steps, |n| (start.step + n).min(sizes.steps));
    let table_every = (sizes.steps / cfg.train.num_sample_generations.max(1)).max(1);
    let progress = TrainProgress::new(sizes.total_episodes as u64);
    let mut state = start;
    let mut guard = StepGuard::new(cfg.train.max_skipped_steps);
    let mut last = Metrics::new();
    let (mut first_step, mut timing) = (StepTiming::default(), StepTiming::default());
    let run_started = Instant::now();
    while state.step < stop_at {
        let step = state.step;
        let mut metrics = Metrics::new();
        let t0 = Instant::now();

        // 1. Rollout: k completions of each prompt of this step.
        let rollout = run.rollout(step)?;
        let t_gen = t0.elapsed().as_secs_f64();

        // 2 and 3, side by side: the scores, shaped (missing-EOS penalty,
        // normalisation, clipping), on a thread of their own (a source that
        // waits on a command or a service holds no compute thread), and the
        // log-probs of the sampling policy and of the reference.
        let ended = rollout.ended_with_eos();
        let seqs = rollout.sequences(&run.dataset);
        let temperature = cfg.generation.temperature;
        let t1 = Instant::now();
        let (scored, logprobs) = std::thread::scope(|s| {
            let scoring = s.spawn(|| -> Result<_> {
                let started = Instant::now();
                let scores = run.rewards.score(&rollout.samples(&run.dataset))?;
                Ok((scores, started.elapsed().as_secs_f64()))
            });
            let logprobs = (|| -> Result<_> {
                let started = Instant::now();
                let old = if cfg.rloo.recompute_old_logprobs {
                    run.logprobs_in_chunks(run.policy.frozen(), &seqs, temperature)?
                } else {
                    sampler_logprobs(rollout.completions.flat(), &seqs, &run.device)?
                };
                let reference = match &run.reference {
                    Some(r) => Some(run.logprobs_in_chunks(r.frozen(), &seqs, temperature)?.logprobs),
                    None => None,
                };
                Ok((old, reference, started.elapsed().as_secs_f64()))
            })();
            (scoring.join().expect("the scoring thread panicked"), logprobs)
        });
        let t_both = t1.elapsed().as_secs_f64();
        let ((scores, t_score), (old, reference, t_ref)) = match (scored, logprobs) {
            (Err(Error::RewardService(why)), _) => {
                progress.finish();
                let saved = save_before_stopping(&output_dir, &run, &optimizer, &state, &config_toml)?;
                return Err(Error::RewardService(format!("{why}; {saved}")));
            }
            (scored, logprobs) => (scored?, logprobs?),
        };
        let shaped = run.shaping.apply(&scores.total, &ended);

        // 4. KL, returns R = s - beta * KL (reward placement), advantages.
        let beta = cfg.rloo.kl_coef;
        let seq_kl: Vec<f32> = match &reference {
            Some(lp_ref) => {
                let kl = algo::kl_per_token(&old.logprobs, lp_ref, cfg.rloo.kl_estimator)?;
                algo::sequence_kl(&kl, &old.mask)?.to_vec1()?
            }
            None => vec![0.0; seqs.len()],
        };
        let (returns, adv) = algo::returns_and_advantages(&shaped, &seq_kl, sizes.k, &cfg.rloo.return_options());

        // 5. Optimise: epochs x shuffled mini-batches, accumulated over micro-batches.
        let t3 = Instant::now();
        let advantages = Tensor::from_vec(adv.values.flat().to_vec(), seqs.len(), &run.device)?;
        let train_stats = if returns.iter().all(Option::is_none) {
            // Nothing to learn from, and a step would still move the weights through weight decay.
            guard.skip(state.optimizer_step, format!("all {} samples of the rollout are unscorable", returns.len()));
            TrainStats { skipped_steps: 1, ..TrainStats::default() }
        } else {
            run.optimise(step, &seqs, &old, reference.as_ref(), &advantages, &mut optimizer, &mut state, &mut guard)?
        };
        let t_train = t3.elapsed().as_secs_f64();

        // 6. Metrics, samples, checkpoint.
        state.step += 1;
        state.episode += sizes.batch;
        let step_secs = t0.elapsed().as_secs_f64();
        record_rollout_metrics(&mut metrics, &rollout, &shaped, &returns, &seq_kl, beta, &old, &ended)?;
        for (name, value) in scores.metrics() {
            metrics.set(name, value as f64);
        }
        metrics.set("rloo/degenerate_groups", adv.degenerate_groups as f64);
        metrics.set("rloo/unscorable", shaped.iter().filter(|s| s.is_none()).count() as f64);
        train_stats.record(&mut metrics);
        metrics.set(
            "lr",
            learning_rate(
                cfg.train.learning_rate,
                cfg.train.lr_scheduler_type,
                state.optimizer_step.saturating_sub(1),
                sizes.optimizer_steps,
                run.warmup,
            ),
        );
        metrics.set("episode", state.episode as f64);
        metrics.set("eps", sizes.batch as f64 / step_secs);
        let phases = [t_gen, t_score, t_ref, t_both, t_train, step_secs];
        if state.step as u64 == first_logged { &mut first_step } else { &mut timing }.add(sizes.batch, phases);
        for (name, secs) in [
            ("generation", t_gen),
            ("scoring", t_score),
            ("reference", t_ref),
            ("scoring_and_reference", t_both),
            ("training", t_train),
            ("step", step_secs),
        ] {
            metrics.set(format!("time/{name}"), secs);
        }
        if state.step % cfg.train.logging_steps == 0 || state.step == stop_at {
            sinks.log(state.step as u64, &metrics)?;
            sinks.flush()?;
        }
        let table = sample_table(&run, &rollout, &shaped);
        sample_log.write_all(state.step as u64, table.samples())?;
        if state.step % table_every == 0 || state.step == 1 {
            progress.suspend(|| {
                eprintln!("step {}\n{}", state.step, table.render(crate::report::table::terminal_width(), 8))
            });
        }
        progress.update(
            state.episode as u64,
            metrics.get("eps").unwrap_or(0.0),
            metrics.get("objective/scores").unwrap_or(f64::NAN),
            metrics.get("objective/kl").unwrap_or(f64::NAN),
        );
        let (interrupted, diverged) = (stop::requested(), guard.exhausted());
        let save_now = cfg.train.save_steps > 0 && state.step % cfg.train.save_steps == 0;
        if save_now || state.step == stop_at || interrupted || diverged {
            let dir = checkpoint::checkpoint_dir(&output_dir, state.step);
            checkpoint::save(&dir, &run.policy, &optimizer, &state, &config_toml)?;
            checkpoint::prune(&output_dir, cfg.train.save_total_limit)?;
            if diverged {
                progress.finish();
                return Err(Error::Invalid(format!(
                    "{}; stopped at step {} with the last good weights in {} (lower the learning rate, or check \
                     the rewards for huge or non-finite values)",
                    guard.describe(),
                    state.step,
                    dir.display()
                )));
            }
            if interrupted {
                progress.finish();
                return Err(Error::Interrupted(format!(
                    "stopped by a signal after step {} of {}; checkpoint in {}; continue with the same command \
                     and --resume_from_checkpoint latest",
                    state.step,
                    sizes.steps,
                    dir.display()
                )));
            }
        }
        last = metrics;
    }
    progress.finish();
    if state.step == sizes.steps {
        run.policy.save_files(&output_dir)?;
    }
    tracing::info!(
        "{} steps, {} episodes in {:.1} s -> {}",
        state.step,
        state.episode,
        run_started.elapsed().as_secs_f64(),
        output_dir.display()
    );
    if timing.steps == 0 {
        timing = first_step;
    } else {
        timing.after_first = true;
    }
    Ok(RunSummary { steps: state.step, episodes: state.episode, output_dir, last, timing })
}

impl Run {
    fn start(cfg: &TrainConfig) -> Result<Self> {
        let device = parse_device(&cfg.model.device)?;
        let policy_dir = resolve_model(&cfg.model.policy)?;
        let tokenizer_dir = match &cfg.model.tokenizer {
            Some(t) => resolve_model(t)?,
            None => policy_dir.clone(),
        };
        let tokenizer = Tokenizer::from_dir(&tokenizer_dir)?;
        let policy = Model::load(&policy_dir, &device)?;
        if policy.head() != HeadKind::CausalLm {
            return Err(Error::bad_file(
                &policy_dir,
                "the policy must be a causal LM, this is a sequence-classification model",
            ));
        }
        tokenizer.check_model(policy.config())?;
        let reference = if cfg.rloo.kl_coef > 0.0 {
            let dir = match &cfg.model.reference {
                Some(r) => resolve_model(r)?,
                None => policy_dir.clone(),
            };
            let reference = Model::load(&dir, &device)?;
            let (p, r) = (policy.config().vocab_size(), reference.config().vocab_size());
            if reference.head() != HeadKind::CausalLm || p != r {
                return Err(Error::Invalid(format!(
                    "the reference {} does not fit the policy {}: it must be a causal LM over the same {p} tokens \
                     (it has {r})",
                    dir.display(),
                    policy_dir.display()
                )));
            }
            Some(reference)
        } else {
            None
        };
        check_lengths(cfg, policy.config())?;
        let rewards = reward::build(&cfg.reward, &device)?;
        let shaping = Shaping {
            missing_eos_penalty: cfg.rloo.missing_eos_penalty.map(|p| p as f32),
            normalize: cfg.rloo.normalize_reward,
            clip: cfg.rloo.reward_clip_range.map(|r| [-r as f32, r as f32]),
        };
        shaping.validate()?;

        let source = DatasetSpec {
            name: cfg.data.path.clone(),
            config: cfg.data.config.clone(),
            split: cfg.data.split.clone(),
            filter: cfg.data.filter.clone(),
            take: cfg.data.take,
        };
        let spec = PromptSpec {
            prompt_column: cfg.data.prompt_column.clone(),
            template: cfg.data.template.clone(),
            chat: cfg.data.chat,
            system_prompt: cfg.data.system_prompt.clone(),
            max_prompt_length: cfg.data.max_prompt_length,
            context_room: ContextRoom::of(policy.config(), cfg.generation.response_length),
            error_on_long: cfg.data.long_prompts == LongPrompts::Error,
            length_filter: cfg.data.filter_length.then(|| length_filter(cfg.generation.response_length)),
        };
        let dataset = PromptDataset::load(&source, &spec, &tokenizer)?;
        let rows: Vec<_> = dataset.rows.iter().map(|r| &r.row.fields).collect();
        rewards.check_rows(&rows)?;
        let sizes = BatchSizes::new(cfg, Some(dataset.len()))?;
        tracing::info!("{} prompts from {}; {}", dataset.len(), dataset.label, sizes.describe(cfg.rloo.num_ppo_epochs));

        if device.is_cpu() {
            let longest = dataset.rows.iter().map(|r| r.ids.len()).max().unwrap_or(0);
            let params = policy.params().numel();
            let estimate =
                super::memory::rloo_estimate(cfg, &sizes, policy.config(), params, longest, reference.is_some());
            super::memory::warn_if_short(&estimate);
        }
        let generation = generation_options(cfg, &policy_dir, &tokenizer, &policy)?;
        let warmup = if cfg.train.warmup_steps > 0 {
            cfg.train.warmup_steps
        } else {
            (cfg.train.warmup_ratio * sizes.optimizer_steps as f64).ceil() as usize
        };
        Ok(Self {
            cfg: cfg.clone(),
            sizes,
            device,
            tokenizer,
            policy,
            reference,
            rewards,
            shaping,
            dataset,
            generation,
            warmup,
        })
    }

    /// Continues from a checkpoint when asked; returns where the run stands.
    fn resume_state(&mut self, optimizer: &mut AdamW) -> Result<TrainerState> {
        let fresh = TrainerState {
            step: 0,
            episode: 0,
            optimizer_step: 0,
            total_steps: self.sizes.steps,
            prompts_digest: self.dataset.digest(),
        };
        let Some(spec) = &self.cfg.train.resume_from_checkpoint else {
            return Ok(fresh);
        };
        let output_dir = Path::new(&self.cfg.train.output_dir);
        let dir = if spec == "latest" {
            match checkpoint::latest(output_dir) {
                Some(dir) => dir,
                None => {
                    tracing::info!("no checkpoint in {} to resume from; starting fresh", output_dir.display());
                    return Ok(fresh);
                }
            }
        } else {
            PathBuf::from(spec)
        };
        self.check_resumable(&dir)?;
        let (policy, state) = checkpoint::load(&dir, &self.device, optimizer)?;
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
        self.policy = policy;
        Ok(state)
    }

    /// Refuses a checkpoint saved under a configuration that computes a
    /// different run (data, k, batch sizes, seed, models, ...); logs the
    /// changes a resume may make (logging, save cadence, device).
    fn check_resumable(&self, dir: &Path) -> Result<()> {
        let saved_path = dir.join(checkpoint::CONFIG_FILE);
        if !saved_path.is_file() {
            return Err(Error::bad_file(
                dir,
                format!("not a complete checkpoint: {} is missing", checkpoint::CONFIG_FILE),
            ));
        }
        let saved = TrainConfig::load(Some(&saved_path), &[])?;
        match self.cfg.changes_since(&saved) {
            Ok(allowed) if allowed.is_empty() => Ok(()),
            Ok(allowed) => {
                tracing::info!("resuming with changed options: {}", allowed.join("; "));
                Ok(())
            }
            Err(refused) => Err(Error::Invalid(format!(
                "cannot resume from {}: these options differ from the checkpoint's and would change the run:\n  {}\n\
                 resume with the options of {} or start a new run in another output directory",
                dir.display(),
                refused.join("\n  "),
                saved_path.display()
            ))),
        }
    }

    fn rollout(&self, step: usize) -> Result<Rollout> {
        let prompt_rows =
            self.dataset.batch(step, self.sizes.prompts_per_batch, self.cfg.train.seed, self.cfg.data.shuffle);
        let mut opts = self.generation.clone();
        opts.seed = Rng::stream(self.cfg.train.seed, &[streams::ROLLOUT_SAMPLING, step as u64]).next_u64();
        Rollout::sample(self.policy.frozen(), &self.dataset, prompt_rows, &opts, &self.tokenizer, &self.device)
    }

    /// Log-probs without gradients, `local_rollout_forward_batch_size` rows at a time.
    fn logprobs_in_chunks(&self, net: &Network, seqs: &Sequences, temperature: f64) -> Result<TokenLogprobs> {
        let chunk = self.cfg.generation.local_rollout_forward_batch_size;
        completion_logprobs_chunked(net, seqs, temperature, &self.device, chunk)
    }

    #[allow(clippy::too_many_arguments)]
    fn optimise(
        &self,
        step: usize,
        seqs: &Sequences,
        old: &TokenLogprobs,
        reference: Option<&Tensor>,
        advantages: &Tensor,
        optimizer: &mut AdamW,
        state: &mut TrainerState,
        guard: &mut StepGuard,
    ) -> Result<TrainStats> {
        let cfg = &self.cfg;
        let sizes = self.sizes;
        let params = self.policy.params();
        let mut stats = TrainStats::default();
        let mut grads = GradAccumulator::default();
        for epoch in 0..cfg.rloo.num_ppo_epochs {
            let order = Rng::stream(cfg.train.seed, &[streams::MINIBATCH_ORDER, step as u64, epoch as u64])
                .permutation(seqs.len());
            for mini in order.chunks(sizes.mini) {
                let mini_mask = rows_of(&old.mask, mini)?;
                let denominator = algo::loss_denominator(&mini_mask, cfg.rloo.ratio, cfg.rloo.aggregation)?;
                grads.clear();
                let mut loss_sum = 0f64;
                for micro in mini.chunks(sizes.micro) {
                    let part = seqs.select(micro);
                    let now =
                        completion_logprobs(self.policy.network(), &part, cfg.generation.temperature, &self.device)?;
                    let width = part.completion_width();
                    let narrow = |t: &Tensor| -> Result<Tensor> { Ok(rows_of(t, micro)?.narrow(1, 0, width)?) };
                    let (lp_old, mask) = (narrow(&old.logprobs)?, narrow(&old.mask)?);
                    let adv = rows_of(advantages, micro)?;
                    let out = algo::policy_loss(
                        &now.logprobs,
                        &lp_old,
                        &mask,
                        &adv,
                        cfg.rloo.cliprange,
                        cfg.rloo.ratio,
                        cfg.rloo.aggregation,
                        denominator,
                    )?;
                    let mut loss = out.loss;
                    if let (KlPlacement::Loss, Some(lp_ref)) = (cfg.rloo.kl_placement, reference) {
                        // beta * mean_t kl_t on the current policy, aggregated like the policy loss.
                        let kl = algo::kl_per_token(&now.logprobs, &narrow(lp_ref)?, cfg.rloo.kl_estimator)?;
                        let kl_loss =
                            algo::masked_mean_loss(&kl, &mask, cfg.rloo.ratio, cfg.rloo.aggregation, denominator)?;
                        loss = (loss + (kl_loss * cfg.rloo.kl_coef)?)?;
                    }
                    loss_sum += loss.to_scalar::<f32>()? as f64;
                    stats.loss.add(&out.stats);
                    stats.entropy_sum += (&now.entropy * &mask)?.sum_all()?.to_scalar::<f32>()? as f64;
                    stats.tokens += mask.sum_all()?.to_scalar::<f32>()? as f64;
                    grads.add(params, &loss.backward()?)?;
                }
                if denominator == 0.0 {
                    // Every completion of the mini-batch is masked: nothing to learn,
                    // and a step would still move the weights through weight decay.
                    stats.skipped_steps += 1;
                    continue;
                }
                stats.grad_norm = grads.clip(cfg.train.max_grad_norm)?;
                if !guard.check(state.optimizer_step, loss_sum, stats.grad_norm) {
                    stats.skipped_steps += 1;
                    if guard.exhausted() {
                        return Ok(stats);
                    }
                    continue;
                }
                let lr = learning_rate(
                    cfg.train.learning_rate,
                    cfg.train.lr_scheduler_type,
                    state.optimizer_step,
                    sizes.optimizer_steps,
                    self.warmup,
                );
                optimizer.step(params, &grads, lr)?;
                state.optimizer_step += 1;
            }
        }
        Ok(stats)
    }
}

/// The sampler's log-probs and entropies of each completion (`seqs` holds
/// the same completions), laid out like [`completion_logprobs`]' output:
/// (N, Tc), zero-padded, with the mask.
fn sampler_logprobs(completions: &[Completion], seqs: &Sequences, device: &Device) -> Result<TokenLogprobs> {
    let width = seqs.completion_width();
    let padded = |values: fn(&Completion) -> &[f32]| -> Result<Tensor> {
        let data: Vec<f32> = completions
            .iter()
            .flat_map(|c| values(c).iter().copied().chain(std::iter::repeat(0.0)).take(width))
            .collect();
        Ok(Tensor::from_vec(data, (completions.len(), width), device)?)
    };
    Ok(TokenLogprobs {
        logprobs: padded(|c| &c.logprobs)?,
        entropy: padded(|c| &c.entropies)?,
        mask: seqs.mask(device)?,
    })
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
        stop: StopCriteria { token_ids: stop_ids, strings: vec![] },
        batch_size: g.local_rollout_forward_batch_size,
        seed: cfg.train.seed,
        max_positions: policy.config().max_positions(),
    })
}

/// Loss diagnostics summed over a step's optimisation.
#[derive(Default)]
struct TrainStats {
    loss: LossStats,
    entropy_sum: f64,
    tokens: f64,
    grad_norm: f64,
    skipped_steps: usize,
}

impl TrainStats {
    fn record(&self, m: &mut Metrics) {
        m.set("policy/approxkl_avg", self.loss.approxkl());
        m.set("policy/clipfrac_avg", self.loss.clipfrac());
        m.set("loss/policy_avg", self.loss.loss_mean());
        m.set("val/ratio", self.loss.ratio_mean());
        m.set("val/ratio_var", self.loss.ratio_var());
        m.set("policy/entropy_avg", self.entropy_sum / self.tokens.max(1.0));
        m.set("grad_norm", self.grad_norm);
        m.set("train/skipped_steps", self.skipped_steps as f64);
    }
}

#[allow(clippy::too_many_arguments)]
fn record_rollout_metrics(
    m: &mut Metrics,
    rollout: &Rollout,
    scores: &[Option<f32>],
    returns: &[Option<f32>],
    seq_kl: &[f32],
    beta: f64,
    old: &TokenLogprobs,
    ended: &[bool],
) -> Result<()> {
    let mean = |xs: &mut dyn Iterator<Item = f64>| crate::stats::mean(&xs.collect::<Vec<_>>()).unwrap_or(f64::NAN);
    m.set("objective/scores", mean(&mut scores.iter().flatten().map(|&s| s as f64)));
    m.set("objective/kl", mean(&mut seq_kl.iter().map(|&k| k as f64)));
    m.set("objective/non_score_reward", mean(&mut seq_kl.iter().map(|&k| -beta * k as f64)));
    m.set("objective/rlhf_reward", mean(&mut returns.iter().flatten().map(|&r| r as f64)));
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
fn sample_table(run: &Run, rollout: &Rollout, scores: &[Option<f32>]) -> SampleTable {
    let mut table = SampleTable::new();
    for (i, c) in rollout.completions.flat().iter().enumerate().filter(|(_, c)| c.sample_index == 0) {
        let row = &run.dataset.rows[rollout.prompt_rows[c.prompt_index]];
        let prompt = match &row.prompt {
            crate::data::Prompt::Text(t) => t.clone(),
            crate::data::Prompt::Messages(ms) => ms.last().map(|m| m.content.clone()).unwrap_or_default(),
        };
        table.push(crate::report::samples::Sample {
            prompt,
            completion: rollout.texts[i].clone(),
            score: scores[i].map_or(f64::NAN, |s| s as f64),
            extra_scores: vec![],
        });
    }
    table
}

/// Rows `idx` of a tensor (N, ...) in that order.
fn rows_of(t: &Tensor, idx: &[usize]) -> Result<Tensor> {
    let ids: Vec<u32> = idx.iter().map(|&i| i as u32).collect();
    Ok(t.index_select(&Tensor::from_vec(ids, idx.len(), t.device())?, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::train::config::parse_set;

    fn fixture_run(dir: &Path, extra: &[&str]) -> Run {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let prompts = dir.join("prompts.jsonl");
        std::fs::write(&prompts, "{\"prompt\": \"The movie was\"}\n{\"prompt\": \"I think\"}\n").unwrap();
        let mut sets = vec![
            format!("model.policy={}", root.join("tests/fixtures/models/gpt_neox-causal").display()),
            format!("data.path={}", prompts.display()),
            format!("train.output_dir={}", dir.join("out").display()),
            "model.device=cpu".into(),
            "train.per_device_train_batch_size=4".into(),
            "reward=[{type=\"length\"}]".into(),
        ];
        sets.extend(extra.iter().map(|s| s.to_string()));
        let sets: Vec<_> = sets.iter().map(|s| parse_set(s).unwrap()).collect();
        Run::start(&TrainConfig::load(None, &sets).unwrap()).unwrap()
    }

    #[test]
    fn all_masked_completions_leave_the_parameters_unchanged() {
        let tmp = tempfile::tempdir().unwrap();
        // Weight decay and a large learning rate would move every weight on any step.
        let run = fixture_run(tmp.path(), &["train.weight_decay=0.5", "train.learning_rate=1.0"]);
        let before: Vec<Vec<f32>> =
            run.policy.params().iter().map(|p| p.var.as_tensor().flatten_all().unwrap().to_vec1().unwrap()).collect();
        let prompt = [5u32, 6, 7];
        let seqs = Sequences::new(vec![&prompt; 4], vec![&[]; 4]);
        let old = run.logprobs_in_chunks(run.policy.frozen(), &seqs, 0.7).unwrap();
        let adv = Tensor::new(&[1.0f32, -1.0, 2.0, -2.0], &Device::Cpu).unwrap();
        let mut opt = AdamW::new(0.9, 0.999, 1e-8, 0.5);
        let mut state = TrainerState { total_steps: 1, ..TrainerState::default() };
        let mut guard = StepGuard::new(10);
        let stats = run.optimise(0, &seqs, &old, None, &adv, &mut opt, &mut state, &mut guard).unwrap();
        assert_eq!(state.optimizer_step, 0);
        assert_eq!(stats.skipped_steps, run.cfg.rloo.num_ppo_epochs);
        for (p, b) in run.policy.params().iter().zip(before) {
            assert_eq!(p.var.as_tensor().flatten_all().unwrap().to_vec1::<f32>().unwrap(), b, "{} changed", p.name);
        }
    }

    #[test]
    fn one_optimizer_step_per_mini_batch_and_epoch() {
        let tmp = tempfile::tempdir().unwrap();
        let run = fixture_run(
            tmp.path(),
            &["rloo.num_mini_batches=2", "train.per_device_train_batch_size=2", "rloo.num_ppo_epochs=3"],
        );
        let rollout = run.rollout(0).unwrap();
        let seqs = rollout.sequences(&run.dataset);
        let old = run.logprobs_in_chunks(run.policy.frozen(), &seqs, 0.7).unwrap();
        let adv = Tensor::new(&[1.0f32, -1.0, 2.0, -2.0], &Device::Cpu).unwrap();
        let mut opt = AdamW::new(0.9, 0.999, 1e-8, 0.0);
        let mut state = TrainerState { total_steps: 1, ..TrainerState::default() };
        run.optimise(0, &seqs, &old, None, &adv, &mut opt, &mut state, &mut StepGuard::new(10)).unwrap();
        assert_eq!(state.optimizer_step, 6);
    }
}
