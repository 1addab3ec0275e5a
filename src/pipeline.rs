//! The whole pipeline on the built-in movie-review task, the default job:
//! generate the data, train a tokenizer, initialise a tiny Pythia-shaped
//! policy, SFT it, train a reward model on preference pairs, run RLOO
//! against that reward model, evaluate before/after, and write a report;
//! with `--study`, also compare RLOO's k and baselines with the other
//! algorithms (a `rloo study` in `study/`). Each stage writes its own directory and a
//! `.done` marker last, so a second run reuses every finished stage (and
//! the study its finished runs).

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::{DType, Device};
use serde_json::json;

use crate::data::jsonl::JsonlWriter;
use crate::data::prompts::{ContextRoom, PromptDataset};
use crate::data::{DatasetSpec, Tokenizer};
use crate::error::{Error, Result};
use crate::eval::{evaluate_model, win_rate, EvalOptions, ModelReport, Share};
use crate::io::write_atomic;
use crate::model::{parse_device, Model, ModelConfig};
use crate::report::chart::{Chart, Series};
use crate::report::table::render_markdown;
use crate::reward::config::{LexiconSpec, ModelSpec};
use crate::reward::{build, RewardSet, RewardSpec};
use crate::study::eval::StudyEval;
use crate::study::{summarise, write_report as write_study_report, Arm, Study, StudyReport};
use crate::task::movie_reviews::{self, NEGATIVE, POSITIVE};
use crate::task::tokenizer::{train_byte_level_bpe, EOS};
use crate::train::reward_model::{train_reward_model, RewardTrainConfig};
use crate::train::rl;
use crate::train::sft::{train_sft, SftConfig};

/// Sizes of one pipeline run.
#[derive(Debug, Clone)]
pub struct PipelineOptions {
    pub out: PathBuf,
    pub seed: u64,
    pub device: String,
    /// A few-seconds version for tests.
    pub fast: bool,
    /// Also run the study of RLOO's k and baselines against the other
    /// algorithms, training its arms with this `rloo` binary.
    pub study: Option<PathBuf>,
}

struct Sizes {
    sft: usize,
    prefs: usize,
    prompts: usize,
    eval_prompts: usize,
    vocab: usize,
    hidden: usize,
    layers: usize,
    sft_epochs: usize,
    rm_epochs: usize,
    rl_episodes: usize,
}

impl Sizes {
    fn new(fast: bool) -> Self {
        if fast {
            Self {
                sft: 96,
                prefs: 64,
                prompts: 32,
                eval_prompts: 8,
                vocab: 300,
                hidden: 32,
                layers: 2,
                sft_epochs: 2,
                rm_epochs: 2,
                rl_episodes: 64,
            }
        } else {
            Self {
                sft: 2000,
                prefs: 800,
                prompts: 512,
                eval_prompts: 64,
                vocab: 1024,
                hidden: 128,
                layers: 4,
                sft_epochs: 2,
                rm_epochs: 2,
                rl_episodes: 4096,
            }
        }
    }
}

fn done(dir: &Path) -> bool {
    dir.join(".done").is_file()
}

fn mark_done(dir: &Path) -> Result<()> {
    write_atomic(&dir.join(".done"), b"")
}

fn write_rows(path: &Path, rows: &[serde_json::Value]) -> Result<()> {
    let mut w = JsonlWriter::create(path)?;
    rows.iter().try_for_each(|r| w.write_row(r))
}

/// Runs every stage that has not finished yet; returns the report's path.
pub fn run(opts: &PipelineOptions) -> Result<PathBuf> {
    let sizes = Sizes::new(opts.fast);
    let device = parse_device(&opts.device)?;
    let out = &opts.out;
    let stage = |name: &str| out.join(name);
    let started = Instant::now();

    // 1. Data.
    let data = stage("data");
    if !done(&data) {
        std::fs::create_dir_all(&data).map_err(|e| Error::io(&data, e))?;
        let task = movie_reviews::generate(opts.seed, sizes.sft, sizes.prefs, sizes.prompts, sizes.eval_prompts);
        write_rows(&data.join("sft.jsonl"), &task.sft)?;
        write_rows(&data.join("preferences.jsonl"), &task.preferences)?;
        write_rows(&data.join("prompts.jsonl"), &task.prompts)?;
        write_rows(&data.join("eval_prompts.jsonl"), &task.eval_prompts)?;
        mark_done(&data)?;
    }

    // 2. Tokenizer and a randomly initialised Pythia-shaped policy.
    let init = stage("init");
    if !done(&init) {
        let corpus: Vec<String> = crate::data::read_rows(data.join("sft.jsonl"))?
            .iter()
            .map(|r| {
                format!(
                    "{}{}",
                    r.fields["prompt"].as_str().unwrap_or(""),
                    r.fields["completion"].as_str().unwrap_or("")
                )
            })
            .collect();
        let tok = train_byte_level_bpe(&corpus, sizes.vocab, &init)?;
        let eos = tok.token_to_id(EOS).unwrap_or(0);
        let config = json!({
            "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
            "vocab_size": tok.get_vocab_size(true), "hidden_size": sizes.hidden, "num_hidden_layers": sizes.layers,
            "num_attention_heads": 4, "intermediate_size": 4 * sizes.hidden, "max_position_embeddings": 256,
            "rotary_pct": 0.25, "rotary_emb_base": 10000, "hidden_act": "gelu", "layer_norm_eps": 1e-5,
            "use_parallel_residual": true, "tie_word_embeddings": false, "initializer_range": 0.02,
            "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos,
        });
        write_atomic(
            &init.join("generation_config.json"),
            json!({"eos_token_id": eos, "pad_token_id": eos}).to_string().as_bytes(),
        )?;
        let config = ModelConfig::from_value(config, &init.join("config.json"))?;
        Model::init_random(config, &device, opts.seed, &init)?.save_files(&init)?;
        mark_done(&init)?;
    }

    // 3. Supervised fine-tuning on positive, negative and mixed reviews.
    let sft = stage("sft");
    if !done(&sft) {
        train_sft(&SftConfig {
            model: init.display().to_string(),
            dataset: DatasetSpec::named(data.join("sft.jsonl").display().to_string()),
            eval_fraction: 0.05,
            output_dir: sft.display().to_string(),
            device: opts.device.clone(),
            learning_rate: 3e-3,
            per_device_train_batch_size: 16,
            num_train_epochs: sizes.sft_epochs,
            warmup_ratio: 0.05,
            max_length: 128,
            seed: opts.seed,
            // A stage without its `.done` marker was cut short: continue it.
            resume_from_checkpoint: Some("latest".into()),
            ..SftConfig::default()
        })?;
        mark_done(&sft)?;
    }

    // 4. A reward model on preference pairs, started from the SFT model.
    let rm = stage("reward_model");
    if !done(&rm) {
        train_reward_model(&RewardTrainConfig {
            model: sft.display().to_string(),
            dataset: DatasetSpec::named(data.join("preferences.jsonl").display().to_string()),
            output_dir: rm.display().to_string(),
            device: opts.device.clone(),
            learning_rate: 1e-3,
            per_device_train_batch_size: 16,
            num_train_epochs: sizes.rm_epochs,
            max_length: 128,
            seed: opts.seed,
            resume_from_checkpoint: Some("latest".into()),
            ..RewardTrainConfig::default()
        })?;
        mark_done(&rm)?;
    }

    // 5. RLOO against the reward model, KL-anchored to the SFT model.
    let rl_base = rl_base(opts, &sizes, &data, &sft, reward_model(&rm))?;
    let rl = stage("rloo");
    if !done(&rl) {
        // Evaluated on the held-out titles as it trains (charted below).
        let mut config = rl_base.clone();
        let held_out = toml::toml! { dataset = (data.join("eval_prompts.jsonl").display().to_string()) };
        config.insert("eval".into(), toml::Value::Table(held_out));
        let run = Arm { name: "rloo".into(), config };
        rl::train(&run.config(opts.seed, &rl)?)?;
        mark_done(&rl)?;
    }

    // 6. Evaluation before (SFT) and after (RLOO) on held-out titles.
    let held_out = HeldOut::new(out, &device, opts.seed)?;
    let sft_model = Model::load(&sft, &device)?;
    let before = held_out.evaluate("sft", &sft_model, None)?;
    let after = held_out.evaluate("rloo", &Model::load(&rl, &device)?, Some(&sft_model))?;
    let win = win_rate(REWARD_MODEL, &after, &before)?;
    let plots = plot_curves(&rl, out)?;
    let shares = [held_out.positive.of(&before.scores)?, held_out.positive.of(&after.scores)?];

    // 7. Seed 004's ablation on the same task, when asked.
    let study = match &opts.study {
        Some(exe) => Some(run_study(out, rl_base, &data, &rm, opts.seed, exe)?),
        None => None,
    };
    let report = write_report(out, [&before, &after], shares, win, &plots, study, started.elapsed().as_secs_f64())?;
    tracing::info!("pipeline finished in {:.0} s -> {}", started.elapsed().as_secs_f64(), report.display());
    Ok(report)
}

/// The evaluation on the task's held-out titles, of a pipeline's models
/// or of any other trained from its SFT model: 4 samples of each prompt,
/// scored by the reward model and the task's word lists.
pub struct HeldOut {
    rewards: RewardSet,
    /// The share of positive reviews: praise and no criticism.
    pub positive: Share,
    prompts: PromptDataset,
    tokenizer: Tokenizer,
    options: EvalOptions,
    device: Device,
}

impl HeldOut {
    /// The evaluation of the task in pipeline directory `out` (its data,
    /// SFT model and reward model must be there).
    pub fn new(out: &Path, device: &Device, seed: u64) -> Result<HeldOut> {
        let (measures, positive) = positive_reviews(&out.join("reward_model"));
        let options = EvalOptions { samples_per_prompt: 4, max_new_tokens: 32, temperature: 1.0, seed, batch_size: 64 };
        let tokenizer = Tokenizer::from_dir(&out.join("sft"))?;
        let room = ContextRoom::of(&ModelConfig::from_dir(&out.join("sft"))?, options.max_new_tokens);
        let eval_prompts = DatasetSpec::named(out.join("data/eval_prompts.jsonl").display().to_string());
        let prompts = PromptDataset::from_prompt_column(&eval_prompts, &tokenizer, room)?;
        let rewards = build(&measures, device, DType::F32)?;
        Ok(HeldOut { rewards, positive, prompts, tokenizer, options, device: device.clone() })
    }

    /// `model`'s samples, measures and KL to `reference`.
    pub fn evaluate(&self, name: &str, model: &Model, reference: Option<&Model>) -> Result<ModelReport> {
        let (tok, prompts, rewards, opts) = (&self.tokenizer, &self.prompts, &self.rewards, &self.options);
        evaluate_model(name, model, tok, prompts, rewards, reference, opts, &self.device)
    }

    /// The share of `model`'s samples that are positive reviews.
    pub fn positive_share(&self, model: &Model) -> Result<f64> {
        self.positive.of(&self.evaluate("model", model, None)?.scores)
    }
}

/// The RL stage's configuration but its seed and output directory; the
/// base of the study's arms too.
fn rl_base(opts: &PipelineOptions, sizes: &Sizes, data: &Path, sft: &Path, reward: RewardSpec) -> Result<toml::Table> {
    let text = format!(
        r#"
[model]
policy = {policy}
device = {device}
[data]
path = {prompts}
[generation]
response_length = 32
temperature = 1.0
[rloo]
k = 4
kl_coef = 0.05
num_ppo_epochs = 1
[train]
learning_rate = 3e-4
per_device_train_batch_size = 32
total_episodes = {episodes}
num_sample_generations = 4
"#,
        policy = toml_str(sft),
        device = toml_str(Path::new(&opts.device)),
        prompts = toml_str(&data.join("prompts.jsonl")),
        episodes = sizes.rl_episodes,
    );
    let mut table: toml::Table =
        toml::from_str(&text).map_err(|e| Error::Invalid(format!("the RL stage's configuration: {e}")))?;
    let reward = toml::Value::try_from(reward).map_err(|e| Error::Invalid(e.to_string()))?;
    table.insert("reward".into(), toml::Value::Array(vec![reward]));
    Ok(table)
}

/// The name of the reward model among the rewards, and the judge of the win rate.
const REWARD_MODEL: &str = "reward_model";

/// The reward model as the RL stage's reward and the evaluation's judge.
fn reward_model(rm: &Path) -> RewardSpec {
    RewardSpec::Model(ModelSpec {
        name: Some(REWARD_MODEL.into()),
        weight: 1.0,
        path: rm.display().to_string(),
        batch_size: 32,
    })
}

/// Seed 004's study on the task, grown to every algorithm: RLOO with k = 2
/// and 4, the leave-one-out baseline against the batch mean and none,
/// GRPO, Dr. GRPO, REINFORCE++, REINFORCE++-baseline and PPO, over two
/// seeds, ranked by the share of positive reviews on held-out titles.
fn run_study(out: &Path, base: toml::Table, data: &Path, rm: &Path, seed: u64, exe: &Path) -> Result<StudyReport> {
    let dir = out.join("study");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let mut table = base;
    let arms: toml::Table = toml::from_str(
        r#"
[[arm]]
name = "rloo k=2"
rloo = { k = 2 }
[[arm]]
name = "rloo k=4"
[[arm]]
name = "batch mean k=4"
rloo = { baseline = "batch_mean" }
[[arm]]
name = "no baseline k=4"
rloo = { baseline = "none" }
[[arm]]
name = "grpo"
train = { algo = "grpo" }
[[arm]]
name = "dr_grpo"
train = { algo = "dr_grpo" }
[[arm]]
name = "reinforce_plus_plus"
train = { algo = "reinforce_plus_plus" }
[[arm]]
name = "reinforce_plus_plus_baseline"
train = { algo = "reinforce_plus_plus_baseline" }
[[arm]]
name = "ppo"
train = { algo = "ppo" }
rloo = { k = 1 }
"#,
    )
    .map_err(|e| Error::Invalid(e.to_string()))?;
    table.extend(arms);
    table.insert("seeds".into(), toml::Value::Array(vec![(seed as i64).into(), (seed as i64 + 1).into()]));
    table.insert("output_dir".into(), dir.display().to_string().into());
    let (reward, positive) = positive_reviews(rm);
    let eval = StudyEval {
        prompts: data.join("eval_prompts.jsonl").display().to_string(),
        split: "train".into(),
        take: None,
        samples_per_prompt: 4,
        max_new_tokens: None,
        temperature: None,
        seed,
        batch_size: 64,
        rank_by: Some(positive.name.clone()),
        reward,
        share: vec![positive],
    };
    table.insert("eval".into(), toml::Value::try_from(eval).map_err(|e| Error::Invalid(e.to_string()))?);
    let path = dir.join("study.toml");
    let text = toml::to_string_pretty(&table).map_err(|e| Error::Invalid(e.to_string()))?;
    write_atomic(&path, text.as_bytes())?;
    let study = Study::load(&path)?;
    let records = study.run(exe)?;
    write_study_report(&study, &summarise(&study, &records)?)
}

fn toml_str(p: &Path) -> String {
    toml::Value::String(p.display().to_string()).to_string()
}

/// The measures of the evaluation: the reward model's score (the judge of
/// the win rate), praise and criticism (the task's word lists, weight 0),
/// and the share of positive reviews: praise and no criticism.
fn positive_reviews(rm: &Path) -> (Vec<RewardSpec>, Share) {
    let words = |list: &[&str]| list.iter().map(|w| w.to_string()).collect::<Vec<_>>();
    let lexicon = |name: &str, positive, negative| {
        RewardSpec::Lexicon(LexiconSpec {
            name: Some(name.into()),
            weight: 0.0,
            positive,
            negative,
            positive_file: None,
            negative_file: None,
            normalize: false,
        })
    };
    let measures = vec![
        reward_model(rm),
        lexicon("praise", words(POSITIVE), vec![]),
        lexicon("criticism", vec![], words(NEGATIVE)),
    ];
    // Criticism scores minus one per negative word.
    let share = Share {
        name: "positive reviews".into(),
        above: [("praise".to_string(), 0.5), ("criticism".to_string(), -0.5)].into(),
        below: Default::default(),
    };
    (measures, share)
}

/// PNG charts of the RLOO run's reward, KL, entropy and held-out reward by step, as
/// (title, path relative to `out`).
fn plot_curves(rl: &Path, out: &Path) -> Result<Vec<(String, String)>> {
    let rows = crate::data::read_rows(rl.join("metrics.jsonl"))?;
    let dir = out.join("plots");
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let mut made = Vec::new();
    for (key, file, title) in [
        ("objective/scores", "reward.png", "reward-model score by step"),
        ("objective/kl", "kl.png", "KL to the SFT model by step"),
        ("objective/entropy", "entropy.png", "entropy per completion by step"),
        ("eval/reward", "eval_reward.png", "reward-model score on held-out titles by step"),
    ] {
        let points: Vec<(f64, f64)> =
            rows.iter().filter_map(|r| Some((r.fields.get("step")?.as_f64()?, r.fields.get(key)?.as_f64()?))).collect();
        if points.is_empty() {
            continue;
        }
        let series = vec![Series { points, ..Series::default() }];
        let chart = Chart { title: title.into(), x_label: "step".into(), y_label: String::new(), series };
        chart.write_png(&dir.join(file))?;
        made.push((title.to_string(), format!("plots/{file}")));
    }
    Ok(made)
}

fn write_report(
    out: &Path,
    [before, after]: [&ModelReport; 2],
    positive: [f64; 2],
    win: f64,
    plots: &[(String, String)],
    study: Option<StudyReport>,
    secs: f64,
) -> Result<PathBuf> {
    let fmt = |s: &Option<crate::eval::Spread>| s.map_or("-".into(), |s| format!("{:.3} ± {:.3}", s.mean, s.std));
    let rows: Vec<Vec<String>> = [before, after]
        .iter()
        .zip(positive)
        .map(|(r, positive)| {
            vec![r.model.clone(), fmt(&r.reward), format!("{:.0}%", 100.0 * positive), fmt(&r.length), fmt(&r.kl)]
        })
        .collect();
    let table =
        render_markdown(&["model", "reward-model score", "positive reviews", "length (tokens)", "KL to SFT"], &rows);
    let (before_texts, after_texts) = (&before.rollout.texts, &after.rollout.texts);
    let samples: Vec<Vec<String>> = (0..before_texts.len().min(8))
        .step_by(before_texts.len().clamp(1, 8) / 4)
        .map(|i| vec![before_texts[i].trim().to_string(), after_texts[i].trim().to_string()])
        .collect();
    let samples = render_markdown(&["before (SFT)", "after (RLOO)"], &samples);
    let charts: String = plots.iter().map(|(title, path)| format!("![{title}]({path})\n\n")).collect();
    let study = match study {
        Some(s) => format!(
            "## Study: RLOO's k and baselines against the other algorithms\n\nEvery arm starts from the SFT model with the same \
             reward model, prompts and episodes; held-out measures on the evaluation titles. Charts and runs: \
             [study/study.md](study/study.md).\n\n{}\n{}\n",
            s.table, s.verdict
        ),
        None => String::new(),
    };
    let text = format!(
        "# rloo pipeline report\n\nMovie reviews of controllable sentiment: a tiny GPT-NeoX policy trained from scratch \
         (SFT), a reward model trained on preference pairs, then RLOO against that reward model, evaluated on held-out \
         titles ({} samples each). A review is positive when it praises and never criticises.\n\n\
         ## Before and after\n\n{table}\nWin rate of RLOO over SFT (judged by the reward \
         model): **{:.0}%**\n\n## Training curves (RLOO)\n\n{charts}## Samples\n\n{samples}\n{study}All metrics are in \
         `rloo/metrics.jsonl` and `rloo/tensorboard/`. Total time: {secs:.0} s.\n",
        before.rollout.len(),
        100.0 * win
    );
    let path = out.join("report.md");
    write_atomic(&path, text.as_bytes())?;
    Ok(path)
}
