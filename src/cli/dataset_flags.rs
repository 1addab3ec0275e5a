//! The dataset flags the commands share, under TRL's names.

use clap::{ArgMatches, Args};

use rloo::data::DatasetSpec;

use super::config_flags::{text, Flag, Kind};

/// Which part of a dataset a command reads (`generate`, `score`, `eval`).
#[derive(Debug, Args)]
pub struct DatasetFlags {
    /// The dataset configuration (a sub-directory), e.g. preference.
    #[arg(long = "dataset_config")]
    dataset_config: Option<String>,
    /// The split read from a dataset directory, datasets save or hub dataset.
    #[arg(long = "dataset_split")]
    dataset_split: Option<String>,
    /// Keep only rows this expression accepts, e.g. 'language == "english" and len(context) <= 4'.
    #[arg(long = "dataset_filter")]
    dataset_filter: Option<String>,
}

impl DatasetFlags {
    /// The rows of dataset `name`, from `default_split` unless a split was given.
    pub fn spec(&self, name: &str, default_split: &str, take: Option<usize>) -> DatasetSpec {
        DatasetSpec {
            name: name.to_string(),
            config: self.dataset_config.clone(),
            split: self.dataset_split.clone().unwrap_or_else(|| default_split.to_string()),
            filter: self.dataset_filter.clone(),
            take,
        }
    }
}

/// The training and held-out rows of `sft` and `reward train`, as config
/// keys (`dataset`, `eval_fraction`, `max_length`); the held-out dataset is
/// built from the training one by [`HeldOut`].
pub const TRAINING_DATA: &[Flag] = &[
    ("dataset", "dataset.name", Kind::Str, "Training rows: a dataset file (JSONL, JSON, CSV, TSV, Parquet, Arrow; .gz/.zst), a dataset directory, a datasets save or a hub dataset id"),
    ("dataset_name", "dataset.name", Kind::Str, "TRL's name of --dataset"),
    ("dataset_config", "dataset.config", Kind::Str, "The dataset configuration (a sub-directory), e.g. helpful-base"),
    ("dataset_train_split", "dataset.split", Kind::Str, "The training split"),
    ("dataset_filter", "dataset.filter", Kind::Str, "Keep only rows (training and held-out) this expression accepts"),
    ("dataset_test_split", "", Kind::Str, "Hold out this split (of --eval_dataset when given, else of --dataset) instead of a fraction of the training rows [default: none]"),
    ("eval_dataset", "", Kind::Str, "Held-out rows from another dataset [split: --dataset_test_split, else test] [default: none]"),
    ("eval_fraction", "eval_fraction", Kind::Float, "Fraction of the training rows held out when no --eval_dataset or --dataset_test_split is given"),
    ("max_length", "max_length", Kind::Int, "Longest prompt + completion in tokens (longer ones are cut at the end)"),
];

/// `--eval_dataset` and `--dataset_test_split`: held-out rows named on the
/// command line, from the training dataset's configuration and filter.
#[derive(Debug, Default)]
pub struct HeldOut {
    eval_dataset: Option<String>,
    test_split: Option<String>,
}

impl HeldOut {
    pub fn from_matches(m: &ArgMatches) -> Self {
        Self { eval_dataset: text(m, "eval_dataset"), test_split: text(m, "dataset_test_split") }
    }

    /// Sets `eval` when the flags name held-out rows (replacing a file's).
    pub fn apply(&self, train: &DatasetSpec, eval: &mut Option<DatasetSpec>) {
        match (&self.eval_dataset, &self.test_split) {
            (Some(name), split) => {
                let split = split.clone().unwrap_or_else(|| "test".into());
                *eval = Some(DatasetSpec { name: name.clone(), split, ..train.clone() });
            }
            (None, Some(split)) => *eval = Some(train.with_split(split)),
            (None, None) => {}
        }
    }
}
