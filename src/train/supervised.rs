//! What SFT and reward-model training share: their options (one type, a
//! marker for each trainer), and their loop: epochs of seeded shuffled
//! optimizer steps, each accumulated over micro-batches, clipped,
//! scheduled and guarded against non-finite values; step metrics, the
//! held-out evaluation after each epoch, checkpoints every `save_steps`
//! and on Ctrl-C, and a resume that continues to the same weights as an
//! uninterrupted run. What differs between the two is an [`Objective`].

use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
use serde::{Deserialize, Serialize};

use super::checkpoint::{self, Part, SavedConfig, TrainerState};
use super::config::{check_optimizer, in_range, positive, to_toml, Bound, OptimizerOptions, Schedule};
use super::harness::{Harness, HarnessOptions, Stopping};
use super::optim::{learning_rate, warmup_steps, AdamW, GradAccumulator, StepGuard};
use super::run_dir::{Reuse, RunDir};
use crate::data::{token_digest, DatasetSpec};
use crate::dist::Communicator;
use crate::error::{Error, Result};
use crate::io::write_atomic;
use crate::model::lora::PeftOptions;
use crate::model::{Model, Network, Precision};
use crate::report::Metrics;
use crate::rng::Rng;

/// What sets one supervised trainer apart: its defaults and its files.
pub trait Trainer: Sized {
    /// The resolved configuration's file, in the output directory and in
    /// each checkpoint.
    const CONFIG_FILE: &'static str;
    /// The random stream of the held-out rows, and of each epoch's order
    /// (with the epoch + 1).
    const DATA_STREAM: u64;
    /// The shared defaults with the trainer's own.
    fn defaults(shared: SupervisedConfig<Self>) -> SupervisedConfig<Self>;
    /// Checks the options only this trainer has or lacks.
    fn check(cfg: &SupervisedConfig<Self>) -> Result<()>;
}

/// The options of `rloo sft` and `rloo reward train`, as both name them.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default, bound(serialize = "", deserialize = "K: Trainer"))]
pub struct SupervisedConfig<K> {
    pub model: String,
    pub dataset: DatasetSpec,
    /// Held-out rows; without them, `eval_fraction` of the rows are held out.
    pub eval_dataset: Option<DatasetSpec>,
    pub eval_fraction: f64,
    pub output_dir: String,
    pub device: String,
    /// f32, or bf16 mixed precision (f32 master weights and optimizer state).
    pub dtype: Precision,
    /// Keep only each layer's input in the forward pass and recompute the
    /// layer in the backward.
    pub gradient_checkpointing: bool,
    /// 1: AdamW's moments split over the processes (ZeRO stage 1); 0: not.
    pub zero_stage: u8,
    pub learning_rate: f64,
    /// Examples (SFT) or pairs (reward model) per forward/backward.
    pub per_device_train_batch_size: usize,
    pub gradient_accumulation_steps: usize,
    pub num_train_epochs: usize,
    pub lr_scheduler_type: Schedule,
    /// Warm-up optimizer steps; 0: `warmup_ratio` of all steps (rounded up).
    pub warmup_steps: usize,
    pub warmup_ratio: f64,
    /// AdamW decoupled weight decay (not applied to biases and norm weights).
    pub weight_decay: f64,
    pub adam_beta1: f64,
    pub adam_beta2: f64,
    pub adam_epsilon: f64,
    pub max_grad_norm: f64,
    /// Longest sequence in tokens; longer ones are cut at the end.
    pub max_length: usize,
    /// SFT: train on prompt tokens too.
    pub all_tokens: bool,
    pub seed: u64,
    /// Log metrics every N optimizer steps.
    pub logging_steps: usize,
    /// Replace the outputs of a previous run in output_dir.
    pub overwrite_output_dir: bool,
    /// Stop after this many optimizer steps in a row with a non-finite loss or gradient.
    pub max_skipped_steps: usize,
    /// Checkpoint every N optimizer steps (0: only where the run stops).
    pub save_steps: usize,
    /// Keep at most N checkpoints (0: all).
    pub save_total_limit: usize,
    /// A checkpoint directory, or "latest" in output_dir.
    pub resume_from_checkpoint: Option<String>,
    /// Stop (with a checkpoint) after N optimizer steps of this invocation.
    pub stop_after: Option<usize>,
    /// LoRA adapters instead of full training.
    pub peft: PeftOptions,
    #[serde(skip)]
    pub trainer: PhantomData<K>,
}

impl<K: Trainer> Default for SupervisedConfig<K> {
    fn default() -> Self {
        K::defaults(Self {
            model: String::new(),
            dataset: DatasetSpec::default(),
            eval_dataset: None,
            eval_fraction: 0.0,
            output_dir: String::new(),
            device: "auto".into(),
            dtype: Precision::F32,
            gradient_checkpointing: false,
            zero_stage: 0,
            learning_rate: 2e-5,
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 1,
            num_train_epochs: 1,
            lr_scheduler_type: Schedule::Linear,
            warmup_steps: 0,
            warmup_ratio: 0.0,
            weight_decay: 0.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            max_grad_norm: 1.0,
            max_length: 1024,
            all_tokens: false,
            seed: 42,
            logging_steps: 10,
            overwrite_output_dir: false,
            max_skipped_steps: 10,
            save_steps: 500,
            save_total_limit: 3,
            resume_from_checkpoint: None,
            stop_after: None,
            peft: PeftOptions::default(),
            trainer: PhantomData,
        })
    }
}

/// The options a resume may change: where and how often it reports and
/// saves, and the device.
const CHANGEABLE_ON_RESUME: &[&str] = &[
    "device",
    "output_dir",
    "logging_steps",
    "save_steps",
    "save_total_limit",
    "resume_from_checkpoint",
    "stop_after",
    "overwrite_output_dir",
    "max_skipped_steps",
    "zero_stage",
];

impl<K: Trainer> SupervisedConfig<K> {
    /// Checks values that no type can express; messages name the option.
    pub fn validate(&self) -> Result<()> {
        if self.model.is_empty() {
            return Err(Error::Invalid("no model to start from: set model (or --model / --model_name_or_path)".into()));
        }
        if self.dataset.name.is_empty() {
            return Err(Error::Invalid("no training rows: set dataset.name (or --dataset / --dataset_name)".into()));
        }
        if self.zero_stage > 1 {
            return Err(Error::Invalid(format!("zero_stage = {} is not one of 0 and 1", self.zero_stage)));
        }
        for (name, v) in [
            ("per_device_train_batch_size", self.per_device_train_batch_size),
            ("gradient_accumulation_steps", self.gradient_accumulation_steps),
            ("num_train_epochs", self.num_train_epochs),
        ] {
            if v == 0 {
                return Err(Error::Invalid(format!("{name} must be at least 1")));
            }
        }
        if self.stop_after == Some(0) {
            return Err(Error::Invalid("stop_after must be at least 1".into()));
        }
        positive("learning_rate", self.learning_rate)?;
        in_range("warmup_ratio", self.warmup_ratio, Bound::Closed(0.0), Bound::Closed(1.0))?;
        check_optimizer("", &self.optimizer())?;
        in_range("max_length", self.max_length as f64, Bound::Closed(1.0), Bound::Open(f64::INFINITY))?;
        in_range("eval_fraction", self.eval_fraction, Bound::Closed(0.0), Bound::Open(1.0))?;
        K::check(self)
    }

    fn optimizer(&self) -> OptimizerOptions {
        OptimizerOptions {
            adam_beta1: self.adam_beta1,
            adam_beta2: self.adam_beta2,
            adam_epsilon: self.adam_epsilon,
            weight_decay: self.weight_decay,
            max_grad_norm: self.max_grad_norm,
        }
    }

    /// Joins the job's processes (one, unless launched data-parallel) and
    /// locks the output directory on the main one: the first thing a run does.
    pub fn start_job(&self) -> Result<Job> {
        let comm = crate::dist::init()?;
        let reuse = match (&self.resume_from_checkpoint, self.overwrite_output_dir) {
            (Some(_), _) => Reuse::Resume,
            (None, true) => Reuse::Overwrite,
            (None, false) => Reuse::Fresh,
        };
        let run_dir = match comm.world().is_main() {
            true => Some(Harness::lock(Path::new(&self.output_dir), reuse)?),
            false => None,
        };
        Ok(Job { comm, run_dir })
    }

    /// The training rows and the held-out rows (see [`crate::data::split_eval`]).
    pub fn split_eval<T>(&self, train: Vec<T>, eval: Option<Vec<T>>) -> (Vec<T>, Vec<T>) {
        crate::data::split_eval(train, eval, self.eval_fraction, &mut Rng::stream(self.seed, &[K::DATA_STREAM]))
    }
}

/// The processes of a run and, on the main one, its locked output directory.
pub struct Job {
    pub comm: std::sync::Arc<dyn Communicator>,
    run_dir: Option<RunDir>,
}

impl Job {
    /// The device `name` (`--device`) means for this process (with several
    /// processes, `cuda` is the GPU of this process's local rank), and the
    /// job's communicator for it (NCCL on GPUs).
    pub fn device(&mut self, name: &str) -> Result<candle_core::Device> {
        let device = crate::dist::device_for(name, self.comm.world())?;
        self.comm = crate::dist::on_device(self.comm.clone(), &device)?;
        Ok(device)
    }
}

/// What a trainer puts into the loop.
pub trait Objective {
    type Example;

    /// The token sequences of an example (for the digest a checkpoint keeps).
    fn tokens(example: &Self::Example) -> [&[u32]; 2];

    /// The loss of `micro` as its share of the loss of the optimizer step
    /// over `step` (so that the shares add up to the step's loss however it
    /// is split), and a count that [`step_metrics`](Self::step_metrics)
    /// receives summed over the step.
    fn micro_loss(
        &mut self,
        net: &Network,
        micro: &[&Self::Example],
        step: &[&Self::Example],
    ) -> Result<(Tensor, usize)>;

    /// Adds the trainer's own metrics of an optimizer step over `step_len`
    /// examples (`count`: the summed counts of its micro-batches).
    fn step_metrics(&self, m: &mut Metrics, step_len: usize, count: usize, epoch_progress: f64);

    /// The held-out metrics after an epoch; `None` without held-out rows.
    fn evaluate(&mut self, net: &Network) -> Result<Option<Metrics>>;
}

/// How the loop ended.
#[derive(Debug, Clone)]
pub struct LoopSummary {
    /// Optimizer steps done, those of earlier invocations included.
    pub steps: usize,
    /// The loss of the last optimizer step of this invocation (NaN: none ran).
    pub last_loss: f64,
    /// Whether every step is done and the model saved in the output directory.
    pub finished: bool,
    /// Whether this is the process that wrote the run (the only one, or rank 0).
    pub main: bool,
}

/// Trains `model` on `train` with `objective` in the `job`'s locked output
/// directory, each optimizer step's examples shared among its processes,
/// continuing from a checkpoint when `resume_from_checkpoint` says so
/// (`reload` reads the checkpoint's model as the trainer loads its own),
/// and saves the model when every step is done.
pub fn train_supervised<K: Trainer, O: Objective>(
    cfg: &SupervisedConfig<K>,
    job: Job,
    model: Model,
    reload: impl FnOnce(&Path) -> Result<Model>,
    train: &[O::Example],
    objective: &mut O,
) -> Result<LoopSummary> {
    let output_dir = PathBuf::from(&cfg.output_dir);
    let (comm, world) = (&*job.comm, job.comm.world());
    let main = world.is_main();
    let mini = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world.size;
    let steps_per_epoch = train.len().div_ceil(mini);
    let total_steps = steps_per_epoch * cfg.num_train_epochs;
    let warmup = warmup_steps(cfg.warmup_steps, cfg.warmup_ratio, total_steps);
    let o = cfg.optimizer();
    let mut optimizer = AdamW::new(o.adam_beta1, o.adam_beta2, o.adam_epsilon, o.weight_decay);
    if cfg.zero_stage == 1 {
        optimizer.shard(model.params(), job.comm.clone());
    }
    let digest = token_digest(train.iter().flat_map(O::tokens));
    if world.joined {
        crate::dist::check_same(comm, "options", &crate::data::byte_digest(to_toml(cfg).as_bytes()))?;
        crate::dist::check_same(comm, "rows", &digest)?;
        crate::dist::check_same(comm, "weights", &model.params().fingerprint()?)?;
    }
    let mut state =
        TrainerState { total_steps, prompts_digest: digest, world_size: world.size, ..TrainerState::default() };
    if let Some(dir) = cfg.resume_from_checkpoint.as_deref().and_then(|spec| checkpoint::to_resume(spec, &output_dir)) {
        let mut saved = checkpoint::load_state(&dir)?;
        let changeable = changeable_on_resume(&dir, cfg, &saved, world.size)?;
        checkpoint::check_config(&dir, K::CONFIG_FILE, cfg, &changeable)?;
        saved.world_size = world.size;
        if (saved.total_steps, &saved.prompts_digest) != (total_steps, &state.prompts_digest) {
            return Err(Error::Invalid(format!(
                "cannot resume from {}: it belongs to a run of {} steps over other rows ({} steps over rows of \
                 digest {} now); resume with the data and options it was saved with",
                dir.display(),
                saved.total_steps,
                total_steps,
                state.prompts_digest
            )));
        }
        tracing::info!("resuming from {} at step {}", dir.display(), saved.step);
        checkpoint::restore_into(&dir, "", &model, &mut optimizer, saved.optimizer_step, reload)?;
        state = saved;
    }
    let options =
        HarnessOptions { logging_steps: cfg.logging_steps, progress_total: None, samples: false, tensorboard: true };
    let mut harness = match job.run_dir {
        Some(run_dir) => Harness::open(run_dir, state.step, options)?,
        None => Harness::silent(state.step),
    };
    let config_toml = to_toml(cfg);
    if main {
        write_atomic(&output_dir.join(K::CONFIG_FILE), config_toml.as_bytes())?;
    }
    let saved_config = SavedConfig { file: K::CONFIG_FILE, toml: &config_toml };
    let stop_at = cfg.stop_after.map_or(total_steps, |n| (state.step + n).min(total_steps));

    let mut grads = GradAccumulator::default();
    let mut guard = StepGuard::new(cfg.max_skipped_steps);
    let mut last_loss = f64::NAN;
    let mut order: (usize, Vec<usize>) = (usize::MAX, Vec::new());
    while state.step < stop_at {
        let step = state.step;
        let (epoch, at) = (step / steps_per_epoch, step % steps_per_epoch);
        if order.0 != epoch {
            let mut rng = Rng::stream(cfg.seed, &[K::DATA_STREAM, epoch as u64 + 1]);
            order = (epoch, rng.permutation(train.len()));
        }
        let examples: Vec<&O::Example> =
            order.1.chunks(mini).nth(at).unwrap_or(&[]).iter().map(|&i| &train[i]).collect();
        model.start_dropout_step(cfg.seed, step);
        grads.clear();
        let (mut loss_sum, mut count) = (0f64, 0usize);
        // Each process takes its share of the step's examples; the losses
        // are shares of the whole step's, so the summed gradients are one process's.
        let share = examples.len().div_ceil(world.size).max(1);
        for micro in examples.chunks(share).nth(world.rank).unwrap_or(&[]).chunks(cfg.per_device_train_batch_size) {
            let (loss, n) = objective.micro_loss(model.network(), micro, &examples)?;
            loss_sum += loss.to_scalar::<f32>()? as f64;
            count += n;
            grads.add(model.params(), &crate::model::backward(&loss, &[&model])?)?;
        }
        if world.joined {
            let mut sums = [loss_sum, count as f64];
            grads.all_reduce(&[model.params()], comm, &mut sums)?;
            (loss_sum, count) = (sums[0], sums[1] as usize);
        }
        let grad_norm = grads.clip(o.max_grad_norm)?;
        let lr = learning_rate(cfg.learning_rate, cfg.lr_scheduler_type, step, total_steps, warmup);
        if guard.check(step, loss_sum, grad_norm) {
            optimizer.step(model.params(), &grads, lr)?;
            state.optimizer_step += 1;
        } else {
            state.skipped_steps += 1;
        }
        state.step += 1;
        state.episode += examples.len();
        last_loss = loss_sum;
        let mut m = Metrics::new();
        m.set("train/loss", loss_sum);
        m.set("train/grad_norm", grad_norm);
        m.set("train/lr", lr);
        m.set("train/skipped_steps", state.skipped_steps as f64);
        objective.step_metrics(&mut m, examples.len(), count, state.step as f64 / steps_per_epoch as f64);
        let evaluated = match main && state.step.is_multiple_of(steps_per_epoch) {
            true => objective.evaluate(model.frozen())?,
            false => None,
        };
        for (name, value) in evaluated.iter().flat_map(Metrics::iter) {
            m.set(name, value);
        }
        harness.log(state.step, &m, evaluated.is_some() || state.step == stop_at)?;
        // A signal to any process stops them all after the same step.
        let stopping = Stopping::now(&guard, comm.any(crate::train::stop::requested())?);
        let save_now = cfg.save_steps > 0 && state.step.is_multiple_of(cfg.save_steps);
        if save_now || stopping.is_some() || state.step == stop_at {
            let dir = checkpoint::checkpoint_dir(&output_dir, state.step);
            let whole = optimizer.gathered(model.params())?;
            if main {
                let parts = [Part { subdir: "", model: &model, optimizer: &whole }];
                checkpoint::save(&dir, &parts, &state, &saved_config)?;
                checkpoint::prune(&output_dir, cfg.save_total_limit)?;
            }
            if let Some(stopping) = stopping {
                let resume = "continue with the same command and --resume_from_checkpoint latest";
                return Err(stopping.error(&guard, state.step, &dir, resume));
            }
        }
    }
    let finished = state.step == total_steps;
    if finished && main {
        model.save_files(&output_dir)?;
    } else {
        tracing::info!(
            "stopped after step {} of {total_steps}; continue with --resume_from_checkpoint latest",
            state.step
        );
    }
    Ok(LoopSummary { steps: state.step, last_loss, finished, main })
}

/// What a resume may change: with another number of processes, the
/// per-process batch sizes too, when the step's examples stay as many.
fn changeable_on_resume<K: Trainer>(
    dir: &Path,
    cfg: &SupervisedConfig<K>,
    saved: &TrainerState,
    world: usize,
) -> Result<Vec<&'static str>> {
    let mut keys = CHANGEABLE_ON_RESUME.to_vec();
    let then = saved.world_size.max(1);
    if then == world {
        return Ok(keys);
    }
    let before: SupervisedConfig<K> = super::config::load_toml(Some(&dir.join(K::CONFIG_FILE)), &[], |_, _| Ok(()))?;
    let step = |c: &SupervisedConfig<K>, n: usize| c.per_device_train_batch_size * c.gradient_accumulation_steps * n;
    if step(&before, then) != step(cfg, world) {
        return Err(Error::Invalid(format!(
            "{} was saved by {then} process(es) with steps of {} examples; here {world} process(es) make {}: give \
             per_device_train_batch_size x gradient_accumulation_steps x {world} = {} to continue it",
            dir.display(),
            step(&before, then),
            step(cfg, world),
            step(&before, then)
        )));
    }
    tracing::info!(
        "continuing a run of {then} process(es) on {world}: the same steps of {} examples",
        step(cfg, world)
    );
    keys.extend(["per_device_train_batch_size", "gradient_accumulation_steps"]);
    Ok(keys)
}
