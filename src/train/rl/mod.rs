//! Online policy-gradient training, one rollout batch per step:
//! rollout -> scores, and the old and reference log-probs (and the
//! algorithm's values) side by side -> KL -> the algorithm's advantages ->
//! epochs x mini-batches x micro-batches of the clipped policy loss (plus
//! the algorithm's own terms) -> metrics, samples, checkpoint. The
//! algorithms (RLOO, PPO, ...) are in [`algorithm`]; see docs/algorithm.md.

pub mod algorithm;
pub mod evaluation;
mod optimise;
mod report;
mod setup;
mod shards;

pub use setup::prompt_spec;

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{Device, Tensor};

use super::checkpoint::{self, Part, SavedConfig, TrainerState};
use super::config::{BatchSizes, TrainConfig, CONFIG_FILE};
use super::harness::{Harness, HarnessOptions, Phases, StepTiming, Stopping};
use super::memory::PhasePeaks;
use super::optim::{learning_rate, AdamW, StepGuard};
use super::run_dir::Reuse;
use crate::algo;
use crate::data::prompts::PromptDataset;
use crate::data::Tokenizer;
use crate::dist::{self, Communicator};
use crate::error::{Error, Result};
use crate::generate::{Completion, GenerateOptions};
use crate::io::write_atomic;
use crate::model::device::in_profiled_phase;
use crate::model::scoring::{completion_logprobs_chunked, Sequences, TokenLogprobs};
use crate::model::{Model, Network};
use crate::report::Metrics;
use crate::reward::{RewardSet, Shaping};
use crate::rng::streams;
use crate::rng::Rng;
use crate::rollout::Rollout;
use algorithm::{Algorithm, Batch};
use optimise::TrainStats;

/// What a finished (or stopped) run reports.
#[derive(Debug, Clone)]
pub struct RunSummary {
    pub steps: usize,
    pub episodes: usize,
    pub output_dir: PathBuf,
    /// The last logged metrics.
    pub last: Metrics,
    /// Where the time of this invocation's steps went.
    pub timing: StepTiming,
    /// On the CPU, the start-up memory estimate and the measured peaks.
    pub memory: super::memory::HostMemory,
    /// On a GPU, its memory in use over the steps.
    pub device_memory: Option<super::memory::DeviceMemory>,
    /// This process's place in the job.
    pub world: dist::World,
}

/// Everything a step needs that does not change between steps.
struct Run {
    cfg: TrainConfig,
    sizes: BatchSizes,
    device: Device,
    tokenizer: Tokenizer,
    policy: Model,
    reference: Option<Reference>,
    /// What turns a scored rollout into the loss's targets, and what it
    /// trains beside the policy.
    algorithm: Box<dyn Algorithm>,
    rewards: RewardSet,
    shaping: Shaping,
    dataset: PromptDataset,
    generation: GenerateOptions,
    warmup: usize,
    /// The start-up estimate of the peak memory, in bytes.
    memory_plan: Option<u64>,
    /// The job's processes (one, unless launched data-parallel).
    comm: Arc<dyn Communicator>,
}

/// The frozen model the KL is measured against.
enum Reference {
    Model(Box<Model>),
    /// The policy without its LoRA adapters: no second copy of the weights.
    PolicyBase,
}

impl Reference {
    /// The network the KL is measured against, its weights on the device.
    fn network<'a>(&'a self, policy: &'a Model) -> Result<&'a Network> {
        match self {
            Reference::Model(m) => {
                m.resident()?;
                Ok(m.frozen())
            }
            Reference::PolicyBase => Ok(policy.base().expect("a LoRA policy has a base network")),
        }
    }
}

/// The optimizers of the policy and of what the algorithm trains beside it
/// (in the order of [`Algorithm::trained`]).
struct Optimizers {
    policy: AdamW,
    trained: Vec<AdamW>,
}

pub fn train(cfg: &TrainConfig) -> Result<RunSummary> {
    cfg.validate()?;
    let comm = dist::init()?;
    let main = comm.world().is_main();
    let output_dir = PathBuf::from(&cfg.train.output_dir);
    let reuse = if cfg.train.resume_from_checkpoint.is_some() {
        Reuse::Resume
    } else if cfg.train.overwrite_output_dir {
        Reuse::Overwrite
    } else {
        Reuse::Fresh
    };
    // One writer: the main rank locks the directory and writes its files.
    let run_dir = if main { Some(Harness::lock(&output_dir, reuse)?) } else { None };
    let mut run = Run::start(cfg, comm)?;
    let t = &cfg.train;
    let adamw = || AdamW::new(t.adam_beta1, t.adam_beta2, t.adam_epsilon, t.weight_decay);
    let mut optimizers =
        Optimizers { policy: adamw(), trained: run.algorithm.trained().iter().map(|_| adamw()).collect() };
    if t.zero_stage == 1 {
        optimizers.policy.shard(run.policy.params(), run.comm.clone());
        for (trained, optimizer) in run.algorithm.trained().iter().zip(&mut optimizers.trained) {
            optimizer.shard(trained.model.params(), run.comm.clone());
        }
    }
    let start = run.resume_state(&mut optimizers)?;
    let sizes = run.sizes;
    let options = HarnessOptions {
        logging_steps: t.logging_steps,
        progress_total: Some(sizes.total_episodes as u64),
        samples: true,
        tensorboard: t.tensorboard(),
    };
    let evaluation = if main { evaluation::Evaluation::start(&run)? } else { None };
    let mut harness = match run_dir {
        Some(run_dir) => Harness::open(run_dir, start.step, options)?,
        None => Harness::silent(start.step),
    };
    let config_toml = cfg.to_toml();
    if main {
        write_atomic(&output_dir.join(CONFIG_FILE), config_toml.as_bytes())?;
    }
    let saved_config = SavedConfig { file: CONFIG_FILE, toml: &config_toml };

    let stop_at = t.stop_after.map_or(sizes.steps, |n| (start.step + n).min(sizes.steps));
    let table_every = (sizes.steps / t.num_sample_generations.max(1)).max(1);
    let mut state = start;
    let mut guard = StepGuard::new(t.max_skipped_steps);
    let mut last = Metrics::new();
    let mut device_memory = None;
    let mut peaks = PhasePeaks::default();
    let run_started = std::time::Instant::now();
    while state.step < stop_at {
        let step = state.step;
        let mut phases = Phases::start();
        let mut metrics = Metrics::new();
        let step_result =
            run.step(step, &mut optimizers, &mut state, &mut guard, (&mut phases, &mut peaks), &mut metrics);
        let (rollout, shaped) = match step_result {
            Ok(done) => done,
            // Under ZeRO the optimizer's state is spread over the processes: no save from one alone.
            Err(Error::RewardService(why)) if main && t.zero_stage == 0 => {
                harness.finish();
                let saved = run.save_before_stopping(&output_dir, &optimizers, &state, &config_toml)?;
                return Err(Error::RewardService(format!("{why}; {saved}")));
            }
            Err(e) => return Err(e),
        };

        state.step += 1;
        state.episode += sizes.batch;
        metrics.set(
            "lr",
            learning_rate(
                t.learning_rate,
                t.lr_scheduler_type,
                state.optimizer_step.saturating_sub(1),
                sizes.optimizer_steps,
                run.warmup,
            ),
        );
        metrics.set("episode", state.episode as f64);
        metrics.set("eps", sizes.batch as f64 / phases.elapsed());
        harness.record_phases(state.step, sizes.batch, &phases, &mut metrics);
        peaks.record(&mut metrics);
        if let Some(used) = super::memory::device_used_bytes(&run.device) {
            metrics.set("memory/device_gib", super::memory::in_gib(used));
            device_memory = Some(super::memory::DeviceMemory::add(device_memory, used));
        }
        let held_out = match &evaluation {
            Some(e) if e.due(state.step, sizes.steps) => {
                let started = std::time::Instant::now();
                let table = e.evaluate(&run, &mut metrics)?;
                metrics.set("time/evaluation", started.elapsed().as_secs_f64());
                Some(table)
            }
            _ => None,
        };
        harness.log(state.step, &metrics, state.step == stop_at || held_out.is_some())?;
        // With held-out prompts, the printed table is theirs (as TRL 0.x's).
        let table = report::sample_table(&run.dataset, &rollout, &shaped);
        let show = evaluation.is_none() && (state.step % table_every == 0 || state.step == 1);
        harness.samples(state.step, &table, if show { t.num_completions_to_print } else { 0 })?;
        if let Some(table) = held_out {
            harness.print_table(&format!("step {} (held-out prompts)", state.step), &table, t.num_completions_to_print);
        }
        harness.progress(state.episode, &metrics);
        // A signal to any rank stops them all after the same step.
        let stopping = Stopping::now(&guard, run.comm.any(super::stop::requested())?);
        let save_now = t.save_steps > 0 && state.step % t.save_steps == 0;
        if save_now || state.step == stop_at || stopping.is_some() {
            let dir = checkpoint::checkpoint_dir(&output_dir, state.step);
            let whole = run.gathered(&optimizers)?;
            if main {
                checkpoint::save(&dir, &run.parts(&whole), &state, &saved_config)?;
                checkpoint::prune(&output_dir, t.save_total_limit)?;
            }
            if let Some(stopping) = stopping {
                harness.finish();
                let resume = "continue with the same command and --resume_from_checkpoint latest";
                return Err(stopping.error(&guard, state.step, &dir, resume));
            }
        }
        last = metrics;
    }
    let timing = harness.finish();
    if state.step == sizes.steps && main {
        run.policy.save_files(&output_dir)?;
        for trained in run.algorithm.trained() {
            trained.model.save_files(&output_dir.join(trained.subdir))?;
        }
    }
    tracing::info!(
        "{} steps, {} episodes in {:.1} s -> {}",
        state.step,
        state.episode,
        run_started.elapsed().as_secs_f64(),
        output_dir.display()
    );
    // The plan is of the device's memory: the host's on the CPU, the GPU's on a GPU.
    let on_cpu = run.device.is_cpu();
    let memory = super::memory::HostMemory {
        planned: run.memory_plan.filter(|_| on_cpu),
        resident: super::memory::peak_rss_bytes(),
        held: Some(peaks.most).filter(|_| on_cpu),
    };
    let device_memory = device_memory.map(|m| super::memory::DeviceMemory {
        peak_allocated: super::memory::device_peak_bytes(&run.device).map(|p| p.max(peaks.most)),
        planned: run.memory_plan,
        ..m
    });
    let world = run.comm.world();
    Ok(RunSummary {
        steps: state.step,
        episodes: state.episode,
        output_dir,
        last,
        timing,
        memory,
        device_memory,
        world,
    })
}

impl Run {
    /// One rollout step up to its metrics; gives the rollout and its shaped
    /// scores for the sample log.
    fn step(
        &self,
        step: usize,
        optimizers: &mut Optimizers,
        state: &mut TrainerState,
        guard: &mut StepGuard,
        (phases, peaks): (&mut Phases, &mut PhasePeaks),
        metrics: &mut Metrics,
    ) -> Result<(Rollout, Vec<Option<f32>>)> {
        let cfg = &self.cfg;
        // 1. Rollout: k completions of each prompt of this step (of this
        // process's share of them, in a data-parallel job).
        // The frozen models' weights come back from host memory while the policy samples.
        self.offloaded().iter().try_for_each(|(_, model)| model.begin_return())?;
        let local =
            phases.time("generation", || in_profiled_phase(&self.device, "generation", || self.rollout(step)))?;
        peaks.mark(&self.device, "generation");

        // 2 and 3, side by side: the scores, shaped (missing-EOS penalty,
        // normalisation, clipping), on a thread of their own (a source that
        // waits on a command or a service holds no compute thread), and the
        // log-probs of the sampling policy and of the reference (and PPO's values).
        let local_seqs = local.sequences(&self.dataset);
        let started = std::time::Instant::now();
        let (scored, forward) = in_profiled_phase(&self.device, "scoring", || {
            std::thread::scope(|s| {
                let scoring = s.spawn(|| -> Result<_> {
                    let started = std::time::Instant::now();
                    let scores = self.rewards.score(&local.samples(&self.dataset))?;
                    Ok((scores, started.elapsed().as_secs_f64()))
                });
                (scoring.join().expect("the scoring thread panicked"), self.rollout_forward(&local, &local_seqs))
            })
        });
        let both = started.elapsed().as_secs_f64();
        let ((scores, t_score), forward) = (scored?, forward?);
        // Nothing reads them again this step: their device memory is the training's.
        self.offloaded().iter().try_for_each(|(role, model)| model.park(role))?;
        // Several processes: every one of them gathers the whole batch.
        let (whole, scores, mut forward) = if self.comm.world().joined {
            let (whole, scores, forward) =
                phases.time("exchange", || shards::gather(&*self.comm, &local, scores, forward, &self.device))?;
            (Some(whole), scores, forward)
        } else {
            (None, scores, forward)
        };
        let (rollout, seqs) = match &whole {
            Some(whole) => (whole, whole.sequences(&self.dataset)),
            None => (&local, local_seqs),
        };
        let ended = rollout.ended_with_eos();
        if cfg.rloo.mask_truncated_completions {
            // A completion cut at the length limit takes no part in the loss or the KL.
            let keep: Vec<f32> = ended.iter().map(|&e| if e { 1.0 } else { 0.0 }).collect();
            let keep = Tensor::from_vec(keep, (ended.len(), 1), &self.device)?;
            forward.old.mask = forward.old.mask.broadcast_mul(&keep)?;
        }
        peaks.mark(&self.device, "scoring_and_reference");
        phases.record("scoring", t_score);
        // "reference": every forward pass beside the scoring (old log-probs, reference, PPO's values).
        phases.record("reference", forward.secs);
        phases.record("scoring_and_reference", both);
        let shaped = self.shaping.apply(&scores.total, &ended);

        // 4. KL, and the algorithm's advantages (the first read of the
        // forward passes' results: on a GPU, it waits for what they queued).
        let beta = cfg.rloo.kl_coef;
        let (old, reference) = (&forward.old, forward.reference.as_ref());
        let (seq_kl, targets) = phases.time("advantages", || -> Result<_> {
            let kl = match reference {
                Some(lp_ref) => Some(algo::kl_per_token(&old.logprobs, lp_ref, cfg.rloo.kl_estimator)?),
                None => None,
            };
            let seq_kl: Vec<f32> = match &kl {
                Some(kl) => algo::sequence_kl(kl, &old.mask)?.to_vec1()?,
                None => vec![0.0; seqs.len()],
            };
            let batch = Batch {
                k: self.sizes.k,
                scores: &shaped,
                token_kl: kl.as_ref(),
                seq_kl: &seq_kl,
                mask: &old.mask,
                values: forward.values.as_ref(),
            };
            let targets = self.algorithm.targets(&batch, metrics)?;
            Ok((seq_kl, targets))
        })?;

        // 5. Optimise: epochs x shuffled mini-batches, accumulated over micro-batches.
        let train_stats = phases.time("training", || -> Result<TrainStats> {
            if shaped.iter().all(Option::is_none) {
                // Nothing to learn from, and a step would still move the weights through weight decay.
                guard.skip(state.optimizer_step, format!("all {} samples of the rollout are unscorable", shaped.len()));
                return Ok(TrainStats { skipped_steps: 1, ..TrainStats::default() });
            }
            in_profiled_phase(&self.device, "training", || {
                self.optimise(step, &seqs, old, reference, &targets, optimizers, state, guard)
            })
        })?;
        peaks.mark(&self.device, "training");
        let parts = train_stats.seconds;
        phases.record("training_forward", parts.forward);
        phases.record("training_backward", parts.backward);
        phases.record("training_update", parts.update);
        phases.record("training_forward_queued", parts.forward_queued);
        phases.record("training_backward_queued", parts.backward_queued);

        // 6. Metrics.
        phases.time("metrics", || -> Result<()> {
            report::rollout_metrics(metrics, rollout, &shaped, &seq_kl, beta, old, &ended)?;
            for (name, value) in scores.metrics() {
                metrics.set(name, value as f64);
            }
            metrics.set("rloo/unscorable", shaped.iter().filter(|s| s.is_none()).count() as f64);
            train_stats.record(metrics);
            self.algorithm.record(&train_stats.extra, metrics);
            Ok(())
        })?;
        Ok((whole.unwrap_or(local), shaped))
    }

    /// The models nothing trains that spend the training phase in host
    /// memory (`ref_reward_offload`): a reference of its own and the reward
    /// models.
    fn offloaded(&self) -> Vec<(String, &Model)> {
        if !self.cfg.rloo.ref_reward_offload {
            return Vec::new();
        }
        let mut models: Vec<_> =
            self.rewards.models().into_iter().map(|(name, m)| (format!("reward `{name}`"), m)).collect();
        if let Some(Reference::Model(m)) = &self.reference {
            models.push(("the reference".to_string(), m));
        }
        models
    }

    /// This process's share of the step's prompts, sampled.
    fn rollout(&self, step: usize) -> Result<Rollout> {
        let world = self.comm.world();
        let prompt_rows =
            self.dataset.batch(step, self.sizes.prompts_per_batch, self.cfg.train.seed, self.cfg.data.shuffle);
        let share = prompt_rows.len() / world.size;
        let first = world.rank * share;
        let prompt_rows = prompt_rows[first..first + share].to_vec();
        let mut opts = self.generation.clone();
        opts.prompt_offset = first;
        opts.seed = Rng::stream(self.cfg.train.seed, &[streams::ROLLOUT_SAMPLING, step as u64]).next_u64();
        Rollout::sample(self.policy.frozen(), &self.dataset, prompt_rows, &opts, &self.tokenizer, &self.device)
    }

    /// The forward passes over a rollout without gradients: the sampling
    /// policy's log-probs (kept from sampling unless recomputed), the
    /// reference's, and the algorithm's values.
    fn rollout_forward(&self, rollout: &Rollout, seqs: &Sequences) -> Result<RolloutForward> {
        let started = std::time::Instant::now();
        let temperature = self.cfg.generation.temperature;
        // The sampler's log-probs are the policy's unless a repetition penalty changed them.
        let recompute = self.cfg.rloo.recompute_old_logprobs || self.cfg.generation.repetition_penalty != 1.0;
        let old = if recompute {
            self.logprobs_in_chunks(self.policy.frozen(), seqs, temperature)?
        } else {
            sampler_logprobs(rollout.completions.flat(), seqs, &self.device)?
        };
        let reference = match &self.reference {
            Some(r) => Some(self.logprobs_in_chunks(r.network(&self.policy)?, seqs, temperature)?.logprobs),
            None => None,
        };
        let chunk = self.cfg.generation.local_rollout_forward_batch_size;
        let values = self.algorithm.rollout_values(seqs, &self.device, chunk)?;
        Ok(RolloutForward { old, reference, values, secs: started.elapsed().as_secs_f64() })
    }

    /// Log-probs without gradients, `local_rollout_forward_batch_size` rows at a time.
    fn logprobs_in_chunks(&self, net: &Network, seqs: &Sequences, temperature: f64) -> Result<TokenLogprobs> {
        let chunk = self.cfg.generation.local_rollout_forward_batch_size;
        completion_logprobs_chunked(net, seqs, temperature, &self.device, chunk)
    }

    /// The optimizers' whole state (gathered from every process under ZeRO).
    fn gathered(&self, optimizers: &Optimizers) -> Result<Optimizers> {
        let trained = self.algorithm.trained();
        Ok(Optimizers {
            policy: optimizers.policy.gathered(self.policy.params())?,
            trained: trained
                .iter()
                .zip(&optimizers.trained)
                .map(|(t, o)| o.gathered(t.model.params()))
                .collect::<Result<_>>()?,
        })
    }

    /// The models a checkpoint holds, with their optimizers.
    fn parts<'a>(&'a self, optimizers: &'a Optimizers) -> Vec<Part<'a>> {
        let mut parts = vec![Part { subdir: "", model: &self.policy, optimizer: &optimizers.policy }];
        for (trained, optimizer) in self.algorithm.trained().into_iter().zip(&optimizers.trained) {
            parts.push(Part { subdir: trained.subdir, model: trained.model, optimizer });
        }
        parts
    }

    /// Saves the weights of the last finished step, when no checkpoint holds
    /// them yet, before a run stops on a failure outside it; says where.
    fn save_before_stopping(
        &self,
        output_dir: &std::path::Path,
        optimizers: &Optimizers,
        state: &TrainerState,
        config_toml: &str,
    ) -> Result<String> {
        if state.step == 0 {
            return Ok("no step had finished, so there was nothing to save".into());
        }
        let dir = checkpoint::checkpoint_dir(output_dir, state.step);
        if !dir.join(checkpoint::STATE_FILE).exists() {
            checkpoint::save(
                &dir,
                &self.parts(optimizers),
                state,
                &SavedConfig { file: CONFIG_FILE, toml: config_toml },
            )?;
        }
        Ok(format!(
            "the run stopped after step {} with its weights in {}; continue with --resume_from_checkpoint latest",
            state.step,
            dir.display()
        ))
    }
}

/// What the rollout's forward passes give.
struct RolloutForward {
    old: TokenLogprobs,
    reference: Option<Tensor>,
    /// The algorithm's values (N, Tc).
    values: Option<Tensor>,
    secs: f64,
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

#[cfg(test)]
mod tests {
    use std::path::Path;

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
        Run::start(&TrainConfig::load(None, &sets).unwrap(), Arc::new(dist::Solo)).unwrap()
    }

    fn sequence_targets(advantages: &[f32], old: &TokenLogprobs) -> algorithm::Targets {
        let advantages = Tensor::new(advantages, &Device::Cpu).unwrap();
        algorithm::Targets { advantages, mask: old.mask.clone(), returns: None, values: None }
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
        let adv = sequence_targets(&[1.0, -1.0, 2.0, -2.0], &old);
        let mut opt = Optimizers { policy: AdamW::new(0.9, 0.999, 1e-8, 0.5), trained: Vec::new() };
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
        let adv = sequence_targets(&[1.0, -1.0, 2.0, -2.0], &old);
        let mut opt = Optimizers { policy: AdamW::new(0.9, 0.999, 1e-8, 0.0), trained: Vec::new() };
        let mut state = TrainerState { total_steps: 1, ..TrainerState::default() };
        run.optimise(0, &seqs, &old, None, &adv, &mut opt, &mut state, &mut StepGuard::new(10)).unwrap();
        assert_eq!(state.optimizer_step, 6);
    }
}
