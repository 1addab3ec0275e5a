//! `rloo data`: look into a dataset, and prepare published ones for training.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use rloo::data::inspect::{inspect, InspectOptions};
use rloo::data::prepare::{prepare, PrepareOptions};
use rloo::data::recipes::Recipe;

use super::dataset_flags::DatasetFlags;

#[derive(Debug, Subcommand)]
pub enum DataCommand {
    Inspect(InspectArgs),
    Prepare(PrepareArgs),
}

/// Print a dataset's splits, files, columns, row count, first rows and (with --tokenizer) prompt lengths.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A dataset file, directory, datasets save or hub dataset id.
    name: String,
    #[command(flatten)]
    data: DatasetFlags,
    /// Rows to print.
    #[arg(long, default_value_t = 3)]
    rows: usize,
    /// Read only the first N rows (after the filter): the count and lengths cover those.
    #[arg(long)]
    take: Option<usize>,
    /// Count tokens of --column with this model's tokenizer (a directory or hub id).
    #[arg(long)]
    tokenizer: Option<String>,
    /// The column measured: a string or chat messages.
    #[arg(long, default_value = "prompt")]
    column: String,
}

/// Turn a published dataset into the JSONL files of `sft`, `reward train` and `train`.
///
/// Writes DIR/preference/<split>.jsonl (prompt, chosen, rejected), DIR/sft/<split>.jsonl
/// (prompt, completion) and DIR/prompts/<split>.jsonl (prompt and kept columns), and
/// DIR/prepare_args.json with the options and per-split counts.
#[derive(Debug, Args)]
pub struct PrepareArgs {
    recipe: Recipe,
    /// The upstream dataset: a file, a directory, a datasets save or a hub dataset id.
    #[arg(long)]
    input: String,
    /// The configuration read [default: the recipe's, e.g. preference for helpsteer3].
    #[arg(long = "dataset_config")]
    dataset_config: Option<String>,
    /// Keep only upstream rows this expression accepts, e.g. 'language == "english"'.
    #[arg(long = "dataset_filter")]
    dataset_filter: Option<String>,
    #[arg(long)]
    output_dir: PathBuf,
    /// The tokenizer that --max-length and --max-prompt-length count with (a model directory or hub id).
    #[arg(long)]
    tokenizer: Option<String>,
    /// Drop rows whose prompt and longer answer exceed N tokens.
    #[arg(long)]
    max_length: Option<usize>,
    /// Drop rows whose prompt exceeds N tokens.
    #[arg(long)]
    max_prompt_length: Option<usize>,
    /// Percent of train held out as the validation split.
    #[arg(long, default_value_t = 0.0)]
    validation_percentage: f64,
    /// Keep one row per distinct prompt.
    #[arg(long)]
    remove_same_inputs: bool,
    /// Drop pairs whose chosen and rejected answers are equal.
    #[arg(long)]
    remove_same_responses: bool,
    /// Shuffle each split (seeded) before writing.
    #[arg(long)]
    shuffle: bool,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Words of a review that make an imdb prompt.
    #[arg(long, default_value_t = 8)]
    prompt_words: usize,
}

pub fn run(cmd: DataCommand) -> Result<()> {
    match cmd {
        DataCommand::Inspect(a) => {
            let opts = InspectOptions {
                dataset: a.data.spec(&a.name, "train", a.take),
                rows: a.rows,
                tokenizer: a.tokenizer,
                column: a.column,
            };
            let mut out = std::io::stdout().lock();
            inspect(&opts, &mut out).with_context(|| format!("inspecting {}", a.name))
        }
        DataCommand::Prepare(a) => {
            let opts = PrepareOptions {
                recipe: a.recipe,
                input: a.input,
                config: a.dataset_config,
                filter: a.dataset_filter,
                output_dir: a.output_dir,
                tokenizer: a.tokenizer,
                max_length: a.max_length,
                max_prompt_length: a.max_prompt_length,
                validation_percentage: a.validation_percentage,
                remove_same_inputs: a.remove_same_inputs,
                remove_same_responses: a.remove_same_responses,
                shuffle: a.shuffle,
                seed: a.seed,
                prompt_words: a.prompt_words,
            };
            let reports = prepare(&opts).context("preparing the dataset failed")?;
            for (split, r) in &reports {
                let skipped: usize = r.skipped.values().sum();
                eprintln!(
                    "{split}: {} preference pairs, {} sft rows, {} prompts ({} rows read, {skipped} left out)",
                    r.preference, r.sft, r.prompts, r.read
                );
                for (why, n) in &r.skipped {
                    eprintln!("  {n} left out: {why}");
                }
            }
            eprintln!("-> {}", opts.output_dir.display());
            Ok(())
        }
    }
}
