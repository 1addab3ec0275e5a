//! The dataset flags the commands share, under TRL's names.

use clap::Args;

use rloo::data::DatasetSpec;

/// Which part of a dataset a command reads (`generate`, `score`, `eval`).
#[derive(Debug, Args)]
pub struct DatasetFlags {
    /// The dataset configuration (a sub-directory), e.g. preference.
    #[arg(long = "dataset_config", alias = "dataset-config")]
    dataset_config: Option<String>,
    /// The split read from a dataset directory, datasets save or hub dataset.
    #[arg(long = "dataset_split", alias = "dataset-split")]
    dataset_split: Option<String>,
    /// Keep only rows this expression accepts, e.g. 'language == "english" and len(context) <= 4'.
    #[arg(long = "dataset_filter", alias = "dataset-filter")]
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

/// The training and held-out rows of `sft` and `reward train`.
#[derive(Debug, Args)]
pub struct TrainingDataFlags {
    /// Training rows: a dataset file (JSONL, JSON, CSV, TSV, Parquet, Arrow; .gz/.zst), a dataset directory,
    /// a datasets save or a hub dataset id.
    #[arg(long, alias = "dataset_name")]
    dataset: String,
    /// The dataset configuration (a sub-directory), e.g. helpful-base.
    #[arg(long = "dataset_config", alias = "dataset-config")]
    dataset_config: Option<String>,
    /// The training split.
    #[arg(long = "dataset_train_split", alias = "dataset-train-split", default_value = "train")]
    dataset_train_split: String,
    /// Hold out this split (of --eval-dataset when given, else of --dataset) instead of a fraction of the training rows.
    #[arg(long = "dataset_test_split", alias = "dataset-test-split")]
    dataset_test_split: Option<String>,
    /// Held-out rows from another dataset [split: --dataset_test_split, else test].
    #[arg(long, alias = "eval_dataset")]
    eval_dataset: Option<String>,
    /// Keep only rows (training and held-out) this expression accepts.
    #[arg(long = "dataset_filter", alias = "dataset-filter")]
    dataset_filter: Option<String>,
}

impl TrainingDataFlags {
    /// The training rows, and the held-out rows when a split or dataset was named for them.
    pub fn specs(self) -> (DatasetSpec, Option<DatasetSpec>) {
        let train = DatasetSpec {
            name: self.dataset,
            config: self.dataset_config,
            split: self.dataset_train_split,
            filter: self.dataset_filter,
            take: None,
        };
        let eval = match (self.eval_dataset, self.dataset_test_split) {
            (Some(name), split) => {
                Some(DatasetSpec { name, split: split.unwrap_or_else(|| "test".into()), ..train.clone() })
            }
            (None, Some(split)) => Some(train.with_split(&split)),
            (None, None) => None,
        };
        (train, eval)
    }
}
