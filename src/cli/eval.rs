//! `rloo eval`: compare one or two models on held-out prompts.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Deserialize;

use rloo::data::prompts::{ContextRoom, PromptDataset};
use rloo::data::Tokenizer;
use rloo::eval::{evaluate_model, judged_win_rate, win_rate, EvalOptions, ModelReport, Opponent, Spread};
use rloo::model::hub::resolve_model;
use rloo::model::{parse_device, Model, Placement, Precision};
use rloo::report::render_table;
use rloo::reward::config::ModelSpec;
use rloo::reward::judge::{Judge, JudgeMode};
use rloo::reward::{build, RewardSet, RewardSpec};

use super::dataset_flags::DatasetFlags;

/// Evaluate models on held-out prompts: reward (per source), completion
/// length, KL to a reference, and the win rate of model A over model B.
///
/// With --judge, an LLM judge (pairwise) compares A with B, or A with a
/// reference answer column (--judge-reference-column), asking each pair in
/// both orders; its answers are saved beside the report.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// Held-out rows with a `prompt` (string or chat messages): a dataset file, directory,
    /// datasets save or hub dataset id (split: --dataset_split, else test).
    #[arg(long)]
    prompts: String,
    #[command(flatten)]
    data: DatasetFlags,
    /// Model A (directory or cached hub id).
    #[arg(long)]
    model: String,
    /// Model B, compared with A.
    #[arg(long)]
    model_b: Option<String>,
    /// Reference for the KL of each model (e.g. the model before RLOO).
    #[arg(long)]
    reference: Option<String>,
    /// A TOML file of `[[reward]]` tables (the format of `rloo train`).
    #[arg(long)]
    rewards: Option<PathBuf>,
    /// A reward model, added to the rewards and used as the judge of the win rate.
    #[arg(long)]
    reward_model: Option<String>,
    /// A TOML file with one `[[reward]]` table of `type = "judge"` and `mode = "pairwise"`:
    /// the LLM judge of the win rate.
    #[arg(long)]
    judge: Option<PathBuf>,
    /// Judge model A against the reference answers in this dataset column instead of model B.
    #[arg(long, requires = "judge", conflicts_with = "model_b")]
    judge_reference_column: Option<String>,
    /// Where to save the judge's answers (JSONL) [default: beside --output, as <output>.judge.jsonl].
    #[arg(long, requires = "judge")]
    judge_answers: Option<PathBuf>,
    /// Completions per prompt and model.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    samples_per_prompt: u64,
    #[arg(long, default_value_t = 64)]
    max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.7)]
    temperature: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Rows decoded together.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..))]
    batch_size: u64,
    /// Use only the first N prompts.
    #[arg(long)]
    take: Option<usize>,
    /// Write the report as JSON here.
    #[arg(long)]
    output: Option<PathBuf>,
    /// cpu, cuda, cuda:N or auto (the first GPU if there is one).
    #[arg(long, default_value = "auto")]
    device: String,
    /// Compute in bf16 (weights and activations; logits and scores in f32).
    #[arg(long)]
    bf16: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RewardsFile {
    reward: Vec<RewardSpec>,
}

fn cell(s: &Option<Spread>) -> String {
    s.map_or("-".into(), |s| format!("{:.3} ± {:.3}", s.mean, s.std))
}

fn read_rewards(path: &Path) -> Result<Vec<RewardSpec>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let file: RewardsFile = toml::from_str(&text).with_context(|| format!("{}", path.display()))?;
    Ok(file.reward)
}

/// The pairwise judge of `--judge FILE`.
fn read_judge(path: &Path) -> Result<Judge> {
    let specs = read_rewards(path)?;
    let [RewardSpec::Judge(spec)] = specs.as_slice() else {
        bail!("{}: give exactly one [[reward]] table, of type = \"judge\"", path.display());
    };
    if spec.mode != JudgeMode::Pairwise {
        bail!("{}: the judge of a win rate compares two answers: set mode = \"pairwise\"", path.display());
    }
    spec.judge().with_context(|| format!("{}", path.display()))
}

pub fn run(a: EvalArgs) -> Result<()> {
    let device = parse_device(&a.device)?;
    let dtype = Precision::from_bf16(a.bf16).dtype();
    let mut specs = Vec::new();
    if let Some(path) = &a.rewards {
        specs.extend(read_rewards(path)?);
    }
    let judge = a.judge.as_deref().map(read_judge).transpose()?;
    if judge.is_some() && a.model_b.is_none() && a.judge_reference_column.is_none() {
        bail!("--judge compares model A with --model-b or with --judge-reference-column; give one");
    }
    let judge_spec = a.reward_model.as_ref().map(|p| {
        RewardSpec::Model(ModelSpec { name: Some("reward_model".into()), weight: 1.0, path: p.clone(), batch_size: 8 })
    });
    specs.extend(judge_spec.clone());
    let rewards = match (specs.is_empty(), &judge) {
        (true, None) => bail!("no reward: give --rewards FILE.toml, --reward-model DIR or --judge FILE.toml"),
        (true, Some(_)) => RewardSet::new(),
        (false, _) => build(&specs, &device, dtype)?,
    };
    let opts = EvalOptions {
        samples_per_prompt: a.samples_per_prompt as usize,
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        seed: a.seed,
        batch_size: a.batch_size as usize,
    };
    let reference = match &a.reference {
        Some(r) => Some(Model::load_computing(&resolve_model(r)?, Placement::new(&device, dtype))?),
        None => None,
    };
    let mut reports: Vec<ModelReport> = Vec::new();
    let mut datasets = Vec::new();
    for name in std::iter::once(&a.model).chain(a.model_b.iter()) {
        let dir = resolve_model(name)?;
        let model = Model::load_computing(&dir, Placement::new(&device, dtype))
            .with_context(|| format!("loading {}", dir.display()))?;
        let tokenizer = Tokenizer::from_dir(&dir)?;
        let room = ContextRoom::of(model.config(), a.max_new_tokens);
        let prompts = PromptDataset::from_prompt_column(&a.data.spec(&a.prompts, "test", a.take), &tokenizer, room)?;
        reports.push(evaluate_model(name, &model, &tokenizer, &prompts, &rewards, reference.as_ref(), &opts, &device)?);
        datasets.push(prompts);
    }
    let win = match (&judge_spec, reports.len()) {
        (Some(spec), 2) => Some(win_rate(spec.name(), &reports[0], &reports[1])?),
        _ => None,
    };

    let mut headers = vec!["model".to_string(), "reward".into()];
    headers.extend(reports[0].rewards.iter().map(|(n, _)| n.clone()));
    headers.extend(["length".into(), "eos rate".into(), "KL to reference".into()]);
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            let mut row = vec![r.model.clone(), cell(&r.reward)];
            row.extend(r.rewards.iter().map(|(_, s)| cell(s)));
            row.extend([cell(&r.length), format!("{:.2}", r.eos_rate), cell(&r.kl)]);
            row
        })
        .collect();
    let judged = match &judge {
        Some(judge) => {
            let opponent = match &a.judge_reference_column {
                Some(col) => Opponent::Column(col),
                None => Opponent::Model(&reports[1]),
            };
            let (summary, answers) = judged_win_rate(judge, &datasets[0], &reports[0], opponent)?;
            let path = a.judge_answers.clone().or_else(|| a.output.as_ref().map(|o| o.with_extension("judge.jsonl")));
            match &path {
                Some(path) => {
                    let text: String = answers.iter().map(|r| format!("{r}\n")).collect();
                    rloo::io::write_atomic(path, text.as_bytes())?;
                    tracing::info!("the judge's {} answers -> {}", answers.len(), path.display());
                }
                None => tracing::info!("the judge's answers are not saved (give --output or --judge-answers)"),
            }
            Some(summary)
        }
        None => None,
    };

    let headers: Vec<&str> = headers.iter().map(String::as_str).collect();
    println!("{}", render_table(&headers, &rows, rloo::report::terminal_width(), 0));
    if let Some(w) = win {
        println!("win rate of {} over {}: {:.3}", reports[0].model, reports[1].model, w);
    }
    if let Some(j) = &judged {
        let over = match &a.judge_reference_column {
            Some(c) => format!("the `{c}` column"),
            None => reports[1].model.clone(),
        };
        println!(
            "judged win rate of {} over {over}: {:.3} ({} pairs, {} verdicts read, {} unparsable, {} failed, {} without a reference)",
            reports[0].model, j.win_rate, j.pairs, j.verdicts, j.unparsable, j.failed, j.missing_reference
        );
    }
    if let Some(path) = &a.output {
        let json = serde_json::json!({ "models": reports, "win_rate_a_over_b": win, "judged": judged, "prompts": a.prompts, "options": {
            "samples_per_prompt": opts.samples_per_prompt, "max_new_tokens": opts.max_new_tokens,
            "temperature": opts.temperature, "seed": opts.seed } });
        rloo::io::write_atomic(path, serde_json::to_string_pretty(&json)?.as_bytes())?;
    }
    Ok(())
}
