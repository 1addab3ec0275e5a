//! `rloo data prepare`: a published dataset, through a [`Recipe`], to the
//! JSONL files the trainers take, one per kind and split:
//!
//! ```text
//! DIR/preference/<split>.jsonl   {"prompt", "chosen", "rejected"}   rloo reward train --dataset_config preference
//! DIR/sft/<split>.jsonl          {"prompt", "completion"}           rloo sft --dataset_config sft
//! DIR/prompts/<split>.jsonl      {"prompt", ...kept columns}        rloo train --dataset_config prompts
//! DIR/prepare_args.json          the options, and what each split kept and left out
//! ```
//! Per split, in order: convert, shuffle (seeded), drop repeated prompts and
//! pairs with equal answers when asked, drop rows over the token limits
//! (with a tokenizer), then hold out the validation share of `train`.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{json, Value};

use super::recipes::{Answers, Example, Recipe, RecipeOptions};
use super::source::DatasetSpec;
use super::{hold_out, shuffle, JsonlWriter, Prompt, Tokenizer};
use crate::error::{Error, Result};
use crate::reward::model::encode_pair;
use crate::rng::streams;
use crate::rng::Rng;

/// What `rloo data prepare` was asked to do.
#[derive(Debug, Clone, Serialize)]
pub struct PrepareOptions {
    pub recipe: Recipe,
    /// The upstream dataset: a file, a directory or a hub id.
    pub input: String,
    /// Its configuration [default: the recipe's].
    pub config: Option<String>,
    pub filter: Option<String>,
    pub output_dir: PathBuf,
    /// Counts tokens for the length limits (a model directory or hub id).
    pub tokenizer: Option<String>,
    /// Most tokens of prompt plus the longer answer.
    pub max_length: Option<usize>,
    pub max_prompt_length: Option<usize>,
    /// Percent of `train` held out as `validation`.
    pub validation_percentage: f64,
    pub remove_same_inputs: bool,
    pub remove_same_responses: bool,
    pub shuffle: bool,
    pub seed: u64,
    pub prompt_words: usize,
}

/// What happened to one split's rows.
#[derive(Debug, Default, Serialize)]
pub struct SplitReport {
    pub read: usize,
    /// Rows left out, by reason.
    pub skipped: BTreeMap<String, usize>,
    pub preference: usize,
    pub sft: usize,
    pub prompts: usize,
}

const KINDS: [&str; 3] = ["preference", "sft", "prompts"];

/// Runs the recipe and writes the files; returns each split's report.
pub fn prepare(opts: &PrepareOptions) -> Result<BTreeMap<String, SplitReport>> {
    if opts.prompt_words == 0 {
        return Err(Error::Invalid("--prompt-words must be at least 1: with 0 every imdb prompt is empty".into()));
    }
    check_paths(&opts.input, &opts.output_dir)?;
    if !(0.0..100.0).contains(&opts.validation_percentage) {
        return Err(Error::Invalid(format!(
            "--validation-percentage must be in [0, 100), got {}",
            opts.validation_percentage
        )));
    }
    let tokenizer = match &opts.tokenizer {
        Some(model) => Some(Tokenizer::from_dir(&crate::model::hub::resolve_model(model)?)?),
        None if opts.max_length.is_some() || opts.max_prompt_length.is_some() => {
            return Err(Error::Invalid("--max-length and --max-prompt-length count tokens: give --tokenizer".into()))
        }
        None => None,
    };
    let mut source = DatasetSpec { name: opts.input.clone(), config: opts.config.clone(), ..Default::default() };
    if source.config.is_none() {
        // The recipe's configuration, where the dataset has it.
        let default =
            opts.recipe.default_config().map(|c| DatasetSpec { config: Some(c.into()), ..source.with_split("train") });
        source.config = default.filter(|d| d.files().is_ok()).and_then(|d| d.config);
    }
    source.filter = opts.filter.clone();
    source.filter.as_deref().map(super::filter::Filter::parse).transpose()?;
    let single_file = Path::new(&opts.input).is_file();
    let splits: Vec<&str> = if single_file { vec!["train"] } else { opts.recipe.splits().to_vec() };
    let recipe_opts = RecipeOptions { prompt_words: opts.prompt_words };

    let mut examples: BTreeMap<String, Vec<Example>> = BTreeMap::new();
    let mut reports: BTreeMap<String, SplitReport> = BTreeMap::new();
    for split in splits {
        let spec = source.with_split(split);
        let rows = match spec.rows() {
            Ok(rows) => rows,
            Err(_) if split != "train" => continue, // the upstream lacks this split
            Err(e) => return Err(e),
        };
        let report = reports.entry(split.to_string()).or_default();
        let kept = examples.entry(split.to_string()).or_default();
        for row in rows {
            let row = row?;
            report.read += 1;
            match opts.recipe.convert(&row, &recipe_opts).map_err(|e| row.error(e))? {
                Ok(example) => kept.push(example),
                Err(why) => *report.skipped.entry(why.to_string()).or_default() += 1,
            }
        }
    }
    for (split, rows) in examples.iter_mut() {
        let report = reports.get_mut(split).expect("a report per split");
        if opts.shuffle {
            let split_key = split.bytes().fold(0u64, |h, b| h.wrapping_mul(0x100_0000_01b3) ^ b as u64);
            *rows = shuffle(std::mem::take(rows), &mut Rng::stream(opts.seed, &[streams::PREPARE_SHUFFLE, split_key]));
        }
        let mut skip = |why: &str, n: usize| {
            if n > 0 {
                *report.skipped.entry(why.to_string()).or_default() += n;
            }
        };
        if opts.remove_same_inputs {
            let mut seen = HashSet::new();
            let before = rows.len();
            rows.retain(|ex| seen.insert(ex.prompt.to_string()));
            skip("a repeated prompt (--remove-same-inputs)", before - rows.len());
        }
        if opts.remove_same_responses {
            let before = rows.len();
            rows.retain(|ex| !matches!(&ex.answers, Answers::Pair { chosen, rejected } if chosen == rejected));
            skip("equal chosen and rejected answers (--remove-same-responses)", before - rows.len());
        }
        if let Some(tok) = &tokenizer {
            let before = rows.len();
            let mut fits = Vec::with_capacity(rows.len());
            for ex in std::mem::take(rows) {
                if within_limits(&ex, tok, opts)? {
                    fits.push(ex);
                }
            }
            *rows = fits;
            skip("over --max-length or --max-prompt-length tokens", before - rows.len());
        }
    }

    if opts.validation_percentage > 0.0 {
        if examples.contains_key("validation") {
            return Err(Error::Invalid(format!(
                "{} already has a `validation` split: drop --validation-percentage",
                opts.input
            )));
        }
        let train = examples.remove("train").expect("checked above");
        let (train, validation) = hold_out(
            train,
            opts.validation_percentage / 100.0,
            &mut Rng::stream(opts.seed, &[streams::PREPARE_VALIDATION]),
        );
        examples.insert("train".into(), train);
        reports.insert("validation".into(), SplitReport::default());
        examples.insert("validation".into(), validation);
    }

    write(opts, &examples, &mut reports)?;
    Ok(reports)
}

/// Whether an example fits the token limits, counted as the trainers
/// tokenize: the prompt (chat template and generation prompt included), and
/// prompt and answer together (a conversation ending on the answer).
fn within_limits(ex: &Example, tok: &Tokenizer, opts: &PrepareOptions) -> Result<bool> {
    let prompt = Prompt::from_value(&ex.prompt).map_err(Error::Invalid)?;
    if let Some(max) = opts.max_prompt_length {
        if tok.encode_prompt(&prompt)?.len() > max {
            return Ok(false);
        }
    }
    let Some(max) = opts.max_length else { return Ok(true) };
    let answers: Vec<&String> = match &ex.answers {
        Answers::Pair { chosen, rejected } => vec![chosen, rejected],
        Answers::Demo(text) => vec![text],
        Answers::None => vec![],
    };
    if answers.is_empty() {
        return Ok(tok.encode_prompt(&prompt)?.len() <= max);
    }
    for answer in answers {
        // One more for the EOS that SFT appends to text completions.
        if encode_pair(tok, &prompt, answer)?.len() + 1 > max {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Refuses an output directory that would write into the dataset being
/// read (the files written would join it, and stale ones are removed), or
/// over the input file.
fn check_paths(input: &str, output_dir: &Path) -> Result<()> {
    let Ok(input) = Path::new(input).canonicalize() else { return Ok(()) }; // a hub id
    let output = resolved(output_dir);
    let refused = |why: &str| {
        Err(Error::Invalid(format!(
            "--output-dir {} {why} --input {}: write the prepared files elsewhere",
            output_dir.display(),
            input.display()
        )))
    };
    if input.is_dir() && output.starts_with(&input) {
        return refused(if output == input { "is the dataset directory" } else { "is inside the dataset directory" });
    }
    let written_by_prepare =
        |rel: &Path| rel == Path::new("prepare_args.json") || KINDS.iter().any(|kind| rel.starts_with(kind));
    match input.strip_prefix(&output) {
        Ok(rel) if input.is_dir() || written_by_prepare(rel) => refused("would overwrite or remove"),
        _ => Ok(()),
    }
}

/// `path` made absolute through its nearest existing ancestor, symbolic
/// links resolved, so that two spellings of one place compare equal.
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    while !existing.exists() {
        let (Some(parent), Some(name)) = (existing.parent(), existing.file_name()) else { return absolute };
        rest.push(name);
        existing = parent;
    }
    let mut out = existing.canonicalize().unwrap_or_else(|_| existing.to_path_buf());
    out.extend(rest.iter().rev());
    out
}

/// Writes every kind and split (each file whole or not at all), removes
/// files of an earlier preparation that this one did not write, and the
/// options file last.
fn write(
    opts: &PrepareOptions,
    examples: &BTreeMap<String, Vec<Example>>,
    reports: &mut BTreeMap<String, SplitReport>,
) -> Result<()> {
    let dir = &opts.output_dir;
    let _lock = crate::train::run_dir::RunDir::open(dir, crate::train::run_dir::Reuse::Overwrite)?;
    let mut written = HashSet::new();
    for (split, rows) in examples {
        let report = reports.get_mut(split).expect("a report per split");
        for kind in KINDS {
            let lines: Vec<Value> = rows.iter().filter_map(|ex| line(kind, ex)).collect();
            match kind {
                "preference" => report.preference = lines.len(),
                "sft" => report.sft = lines.len(),
                _ => report.prompts = lines.len(),
            }
            if lines.is_empty() {
                continue;
            }
            let path = dir.join(kind).join(format!("{split}.jsonl"));
            let mut out = JsonlWriter::replacing(&path)?;
            for l in &lines {
                out.write_row(l)?;
            }
            out.commit()?;
            written.insert(path);
        }
    }
    for kind in KINDS {
        let Ok(entries) = std::fs::read_dir(dir.join(kind)) else { continue };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "jsonl") && !written.contains(&path) {
                std::fs::remove_file(&path).map_err(|e| Error::io(&path, e))?;
            }
        }
    }
    let args = json!({"options": opts, "splits": reports});
    crate::io::write_atomic(
        &dir.join("prepare_args.json"),
        serde_json::to_string_pretty(&args).expect("serialisable").as_bytes(),
    )
}

/// The row of `kind` an example gives, if any.
fn line(kind: &str, ex: &Example) -> Option<Value> {
    match (kind, &ex.answers) {
        ("preference", Answers::Pair { chosen, rejected }) => {
            Some(json!({"prompt": ex.prompt, "chosen": chosen, "rejected": rejected}))
        }
        ("sft", Answers::Pair { chosen: completion, .. } | Answers::Demo(completion)) => {
            Some(json!({"prompt": ex.prompt, "completion": completion}))
        }
        ("prompts", _) => {
            let mut row = serde_json::Map::from_iter([("prompt".to_string(), ex.prompt.clone())]);
            row.extend(ex.extra.clone());
            Some(Value::Object(row))
        }
        _ => None,
    }
}
