//! TRL's batch arithmetic: micro-batches, optimizer steps, rollout batches
//! and the run's length, in TRL 0.x's and 1.x's names.

use super::TrainConfig;
use crate::error::{Error, Result};

/// The rollout batch in completions, and how it was reached. TRL 0.x sizes
/// it in optimizer steps (`num_mini_batches` mini-batches of
/// per_device_train_batch_size x gradient_accumulation_steps); TRL 1.x in
/// micro-batches (`steps_per_generation`, by default
/// gradient_accumulation_steps: one optimizer step) or in completions
/// (`generation_batch_size`). Either way it must split into whole optimizer steps.
fn rollout_batch(cfg: &TrainConfig, micro: usize, mini: usize, world: usize) -> Result<(usize, String)> {
    let r = &cfg.rloo;
    let ga = cfg.train.gradient_accumulation_steps;
    let (batch, how) = match (r.steps_per_generation, r.generation_batch_size) {
        (Some(_), Some(_)) => {
            return Err(Error::Invalid(
                "rloo.steps_per_generation and rloo.generation_batch_size both size the rollout batch: give one".into(),
            ))
        }
        (None, None) => {
            let how = format!(
                "per_device_train_batch_size {micro} x gradient_accumulation_steps {ga}{} x num_mini_batches {}",
                processes(world),
                r.num_mini_batches
            );
            return Ok((mini * r.num_mini_batches, how));
        }
        (Some(steps), None) => (
            micro * world * steps,
            format!("per_device_train_batch_size {micro}{} x steps_per_generation {steps}", processes(world)),
        ),
        (None, Some(n)) => (n, format!("generation_batch_size {n}")),
    };
    if r.num_mini_batches != 1 {
        return Err(Error::Invalid(format!(
            "rloo.num_mini_batches = {} (TRL 0.x) and {} (TRL 1.x) both size the rollout batch: give one",
            r.num_mini_batches,
            if r.steps_per_generation.is_some() { "rloo.steps_per_generation" } else { "rloo.generation_batch_size" }
        )));
    }
    if batch == 0 || batch % mini != 0 {
        return Err(Error::Invalid(format!(
            "the rollout batch of {batch} completions ({how}) is not a whole number of optimizer steps of \
             per_device_train_batch_size {micro} x gradient_accumulation_steps {ga}{} = {mini} completions",
            processes(world)
        )));
    }
    Ok((batch, how))
}

/// " x N processes" in a size's derivation, when there are several.
fn processes(world: usize) -> String {
    if world > 1 {
        format!(" x {world} processes")
    } else {
        String::new()
    }
}

/// TRL's batch arithmetic, resolved once:
/// completions per rollout = per_device_train_batch_size x
/// gradient_accumulation_steps x num_mini_batches, made of
/// `batch / k` prompts; each optimizer step sees one mini-batch. With
/// several processes the sizes `per_device_*` are per process, as under
/// `accelerate`, and the mini-batch and rollout are the whole job's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchSizes {
    pub micro: usize,
    pub mini: usize,
    pub batch: usize,
    pub prompts_per_batch: usize,
    pub k: usize,
    pub total_episodes: usize,
    /// Processes in the job; each samples `prompts_per_batch / world` prompts.
    pub world: usize,
    /// Rollout steps (batches).
    pub steps: usize,
    /// Optimizer steps over the run.
    pub optimizer_steps: usize,
}

impl BatchSizes {
    /// One process's sizes; `num_prompts` (the dataset size) sets the default total_episodes.
    pub fn new(cfg: &TrainConfig, num_prompts: Option<usize>) -> Result<Self> {
        Self::for_world(cfg, num_prompts, 1)
    }

    /// The sizes of a job of `world` processes.
    pub fn for_world(cfg: &TrainConfig, num_prompts: Option<usize>, world: usize) -> Result<Self> {
        let t = &cfg.train;
        let k = cfg.rloo.k;
        let micro = t.per_device_train_batch_size;
        let mini = micro * t.gradient_accumulation_steps * world;
        let (batch, how) = rollout_batch(cfg, micro, mini, world)?;
        if batch % k != 0 {
            return Err(Error::Invalid(format!(
                "the rollout batch of {batch} completions ({how}) is not a multiple of rloo_k = {k}"
            )));
        }
        if !(batch / k).is_multiple_of(world) {
            return Err(Error::Invalid(format!(
                "the rollout batch's {} prompts ({how}) do not split evenly over {world} processes: a prompt's \
                 {k} completions stay on one process",
                batch / k
            )));
        }
        let optimizer_steps_per_batch = cfg.rloo.num_ppo_epochs * (batch / mini);
        let total_episodes = match (t.total_episodes, t.max_steps, num_prompts) {
            (Some(_), Some(_), _) => {
                return Err(Error::Invalid(
                    "train.total_episodes and train.max_steps both set the run's length: give one".into(),
                ))
            }
            (Some(n), None, _) => n,
            (None, Some(steps), _) => steps.div_ceil(optimizer_steps_per_batch.max(1)) * batch,
            (None, None, Some(p)) => (t.num_train_epochs * (p * k) as f64).round() as usize,
            (None, None, None) => batch,
        };
        if total_episodes < batch {
            return Err(Error::Invalid(format!(
                "total_episodes = {total_episodes} is less than one rollout batch of {batch} completions"
            )));
        }
        let steps = total_episodes.div_ceil(batch);
        Ok(Self {
            micro,
            mini,
            batch,
            prompts_per_batch: batch / k,
            k,
            total_episodes,
            world,
            steps,
            optimizer_steps: steps * optimizer_steps_per_batch,
        })
    }

    /// TRL 1.x's names of the same sizes.
    pub fn describe_trl_1x(&self) -> String {
        format!(
            "generation_batch_size {} = per_device_train_batch_size {}{} x steps_per_generation {}",
            self.batch,
            self.micro,
            processes(self.world),
            self.batch / self.micro / self.world
        )
    }

    pub fn describe(&self, epochs: usize) -> String {
        let per_process = match self.world {
            1 => String::new(),
            n => format!(" on each of {n} processes"),
        };
        format!(
            "{} steps of {} completions ({} prompts x k={}), {} epoch(s) x {} mini-batch(es) of {} \
             = {} micro-batch(es) of {}{per_process}; {} optimizer steps, {} episodes",
            self.steps,
            self.batch,
            self.prompts_per_batch,
            self.k,
            epochs,
            self.batch / self.mini,
            self.mini,
            self.mini / self.micro / self.world,
            self.micro,
            self.optimizer_steps,
            self.total_episodes
        )
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::with;
    use super::*;

    #[test]
    fn batch_arithmetic_is_trls() {
        let c = with(&[
            "train.per_device_train_batch_size=4",
            "train.gradient_accumulation_steps=2",
            "rloo.num_mini_batches=2",
            "rloo.k=4",
            "rloo.num_ppo_epochs=1",
        ])
        .unwrap();
        let b = BatchSizes::new(&c, Some(100)).unwrap();
        assert_eq!((b.micro, b.mini, b.batch, b.prompts_per_batch), (4, 8, 16, 4));
        assert_eq!(b.total_episodes, 400);
        assert_eq!(b.steps, 25);
        assert_eq!(b.optimizer_steps, 50);
        let c = with(&["rloo.k=3"]).unwrap();
        let err = BatchSizes::new(&c, Some(10)).unwrap_err().to_string();
        assert!(err.contains("not a multiple of rloo_k = 3"), "{err}");
    }

    /// TRL 1.x sizes the same rollout in micro-batches or completions: 4
    /// completions a micro-batch, 2 per optimizer step, 4 micro-batches =
    /// 16 completions = TRL 0.x's 2 mini-batches.
    #[test]
    fn trl_1x_batch_arithmetic_gives_the_same_rollouts() {
        let base = ["train.per_device_train_batch_size=4", "train.gradient_accumulation_steps=2", "rloo.k=4"];
        let sizes = |extra: &str| BatchSizes::new(&with(&[&base[..], &[extra]].concat()).unwrap(), Some(100));
        let old = sizes("rloo.num_mini_batches=2").unwrap();
        assert_eq!(sizes("rloo.steps_per_generation=4").unwrap(), old);
        assert_eq!(sizes("rloo.generation_batch_size=16").unwrap(), old);
        assert_eq!(
            old.describe_trl_1x(),
            "generation_batch_size 16 = per_device_train_batch_size 4 x steps_per_generation 4"
        );
        // TRL 1.x's default, steps_per_generation = gradient_accumulation_steps, is 0.x's one mini-batch.
        assert_eq!(sizes("rloo.steps_per_generation=2").unwrap(), sizes("rloo.num_mini_batches=1").unwrap());
        let err = sizes("rloo.steps_per_generation=3").unwrap_err().to_string();
        assert!(err.contains("12 completions (per_device_train_batch_size 4 x steps_per_generation 3) is not a whole number of optimizer steps"), "{err}");
        let both = with(&[&base[..], &["rloo.steps_per_generation=4", "rloo.num_mini_batches=2"]].concat()).unwrap();
        let err = BatchSizes::new(&both, None).unwrap_err().to_string();
        assert!(err.contains("rloo.num_mini_batches = 2 (TRL 0.x) and rloo.steps_per_generation (TRL 1.x)"), "{err}");
        // max_steps counts optimizer steps: 2 per rollout, so 5 take 3 rollouts.
        let c = with(
            &[&base[..], &["train.max_steps=5", "rloo.generation_batch_size=16", "rloo.num_ppo_epochs=1"]].concat(),
        );
        let b = BatchSizes::new(&c.unwrap(), Some(100)).unwrap();
        assert_eq!((b.steps, b.optimizer_steps, b.total_episodes), (3, 6, 48));
        let both = with(&[&base[..], &["train.max_steps=5", "train.total_episodes=64"]].concat()).unwrap();
        assert!(BatchSizes::new(&both, None).unwrap_err().to_string().contains("give one"));
        let both =
            with(&[&base[..], &["rloo.steps_per_generation=4", "rloo.generation_batch_size=16"]].concat()).unwrap();
        assert!(BatchSizes::new(&both, None).unwrap_err().to_string().contains("give one"));
    }

    /// Under several processes `per_device_*` sizes are per process: two
    /// processes of 2 x 2 make the mini-batch of one process of 4 x 2.
    #[test]
    fn per_device_sizes_are_per_process() {
        let sizes = |per_device: &str, world| {
            let c = with(&[
                &format!("train.per_device_train_batch_size={per_device}"),
                "train.gradient_accumulation_steps=2",
                "rloo.num_mini_batches=2",
                "rloo.k=2",
            ])
            .unwrap();
            BatchSizes::for_world(&c, Some(64), world)
        };
        let (one, two) = (sizes("4", 1).unwrap(), sizes("2", 2).unwrap());
        assert_eq!((two.mini, two.batch, two.prompts_per_batch, two.steps), (one.mini, one.batch, 8, one.steps));
        assert!(two.describe(1).contains("2 micro-batch(es) of 2 on each of 2 processes"), "{}", two.describe(1));
        // 4 x 2 x 3 processes x 2 mini-batches = 48 completions = 24 prompts: 8 each.
        assert_eq!(sizes("4", 3).unwrap().prompts_per_batch, 24);
        // 12 completions in mini-batches of 1 x 4 processes, but 6 prompts do not split over 4.
        let c = with(&["train.per_device_train_batch_size=1", "rloo.generation_batch_size=12", "rloo.k=2"]).unwrap();
        let err = BatchSizes::for_world(&c, Some(64), 4).unwrap_err().to_string();
        assert!(err.contains("6 prompts (generation_batch_size 12) do not split evenly over 4 processes"), "{err}");
        let c = with(&["train.per_device_train_batch_size=2", "rloo.steps_per_generation=4", "rloo.k=2"]).unwrap();
        let b = BatchSizes::for_world(&c, Some(8), 2).unwrap();
        assert_eq!(b.batch, 16);
        assert_eq!(
            b.describe_trl_1x(),
            "generation_batch_size 16 = per_device_train_batch_size 2 x 2 processes x steps_per_generation 4"
        );
    }
}
