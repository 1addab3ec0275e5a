//! A dataset name to the files of one split, resolved as `datasets` and the
//! hub lay them out, and those files' rows as one filtered stream.
//!
//! A name is, in order:
//! - a file: read as it is (the split is not used);
//! - a `datasets` `save_to_disk` directory: a `DatasetDict` save
//!   (`dataset_dict.json`, one sub-directory per split) or a single split
//!   (`state.json` listing its `data-*.arrow` files);
//! - a directory of data files: in the configuration's sub-directory when
//!   one is named (`preference/`, `helpful-base/`), the split's files are
//!   `<split>.<ext>`, shards `<split>-*.<ext>`, or everything under a
//!   `<split>/` directory, at the top or under `data/` (the hub's layout);
//! - a hub id (`owner/name[@revision]`): that directory in the local
//!   Hugging Face cache (`datasets--owner--name/snapshots/<commit>`), else
//!   the split's files downloaded into it (the `hub` feature, not offline).

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::filter::Filter;
use super::rows::{format_of, open_file, Row, RowIter, DATA_SUFFIXES};
use crate::error::{Error, Result};
use crate::model::hub::{find_snapshot, HubEnv, HubId};

/// Which rows a command reads.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DatasetSpec {
    /// A file, a directory or a hub id.
    pub name: String,
    /// The configuration: a sub-directory of the dataset.
    pub config: Option<String>,
    pub split: String,
    /// A `--dataset_filter` expression; rows it rejects are skipped.
    pub filter: Option<String>,
    /// Keep only the first N rows that pass the filter.
    pub take: Option<usize>,
}

/// The `train` split, as a config that names only the dataset means.
impl Default for DatasetSpec {
    fn default() -> Self {
        DatasetSpec { name: String::new(), config: None, split: "train".into(), filter: None, take: None }
    }
}

impl DatasetSpec {
    /// The `train` split of `name`, unfiltered.
    pub fn named(name: impl Into<String>) -> DatasetSpec {
        DatasetSpec { name: name.into(), ..Default::default() }
    }

    /// The same dataset, another split.
    pub fn with_split(&self, split: &str) -> DatasetSpec {
        DatasetSpec { split: split.to_string(), ..self.clone() }
    }

    /// The name with the configuration and split, for messages.
    pub fn label(&self) -> String {
        match &self.config {
            Some(config) => format!("{} ({config}, {})", self.name, self.split),
            None if Path::new(&self.name).is_file() => self.name.clone(),
            None => format!("{} ({})", self.name, self.split),
        }
    }

    /// The files of the split, in order.
    pub fn files(&self) -> Result<Vec<PathBuf>> {
        resolve(self, &HubEnv::from_process())
    }

    /// The rows of the split, filtered and cut to `take`, read lazily.
    pub fn rows(&self) -> Result<Rows> {
        let filter = self.filter.as_deref().map(Filter::parse).transpose()?;
        Ok(Rows { files: self.files()?.into_iter(), current: None, filter, left: self.take, seen: 0, kept: 0 })
    }

    /// Every row [`rows`](Self::rows) gives; an error when there is none.
    pub fn read_all(&self) -> Result<Vec<Row>> {
        let mut rows = self.rows()?;
        let all: Vec<Row> = rows.by_ref().collect::<Result<_>>()?;
        if all.is_empty() {
            return Err(Error::Invalid(format!("{}: {}", self.label(), rows.why_empty())));
        }
        rows.log_filtered(&self.label());
        Ok(all)
    }
}

/// The rows of a split's files one after another, filtered.
pub struct Rows {
    files: std::vec::IntoIter<PathBuf>,
    current: Option<RowIter>,
    filter: Option<Filter>,
    left: Option<usize>,
    /// Rows read so far, and those the filter kept.
    pub seen: usize,
    kept: usize,
}

impl Rows {
    /// Says how many rows the filter kept, when there is one.
    pub fn log_filtered(&self, label: &str) {
        if let Some(filter) = &self.filter {
            tracing::info!("{label}: --dataset_filter {:?} kept {} of {} rows", filter.source(), self.kept, self.seen);
        }
    }

    /// Why a stream gave no rows, for the error that follows.
    pub fn why_empty(&self) -> String {
        match &self.filter {
            Some(filter) if self.seen > 0 => {
                format!("--dataset_filter {:?} kept none of the {} rows", filter.source(), self.seen)
            }
            _ => "the dataset has no rows".to_string(),
        }
    }
}

impl Iterator for Rows {
    type Item = Result<Row>;

    fn next(&mut self) -> Option<Result<Row>> {
        if self.left == Some(0) {
            return None;
        }
        loop {
            let rows = match &mut self.current {
                Some(rows) => rows,
                None => match open_file(&self.files.next()?) {
                    Ok(rows) => self.current.insert(rows),
                    Err(e) => return Some(Err(e)),
                },
            };
            let row = match rows.next() {
                None => {
                    self.current = None;
                    continue;
                }
                Some(Err(e)) => {
                    self.left = Some(0);
                    return Some(Err(e));
                }
                Some(Ok(row)) => row,
            };
            self.seen += 1;
            match self.filter.as_ref().map(|f| f.keeps(&row)) {
                Some(Ok(false)) => continue,
                Some(Err(e)) => {
                    self.left = Some(0);
                    return Some(Err(e));
                }
                _ => {}
            }
            self.kept += 1;
            if let Some(left) = &mut self.left {
                *left -= 1;
            }
            return Some(Ok(row));
        }
    }
}

/// Resolves `spec` with the given environment (see the module docs).
pub fn resolve(spec: &DatasetSpec, env: &HubEnv) -> Result<Vec<PathBuf>> {
    let path = Path::new(&spec.name);
    if path.is_file() {
        return Ok(vec![path.to_path_buf()]);
    }
    if path.is_dir() {
        return resolve_dir(path, spec);
    }
    let Some(id) = HubId::parse(&spec.name) else {
        return Err(Error::bad_file(path, "no such dataset file or directory, and not a hub id owner/name[@revision]"));
    };
    let Some(cache_dir) = env.cache_dir() else {
        return Err(Error::bad_file(path, "no such file or directory, and no Hugging Face cache to look in"));
    };
    if let Some(snapshot) = find_snapshot(&cache_dir.join(id.dataset_folder_name()), id.revision()) {
        return resolve_dir(&snapshot, spec);
    }
    let not_cached = format!(
        "no such file or directory, and the hub dataset {id} is not in the Hugging Face cache at {} \
         (looked for {}/refs/{})",
        cache_dir.display(),
        id.dataset_folder_name(),
        id.revision()
    );
    if env.offline() {
        return Err(Error::bad_file(path, format!("{not_cached}; downloading is off because HF_HUB_OFFLINE is set")));
    }
    let snapshot =
        download(&id, env, &cache_dir, spec).map_err(|why| Error::bad_file(path, format!("{not_cached}; {why}")))?;
    resolve_dir(&snapshot, spec)
}

/// The split's files in a local directory.
fn resolve_dir(dir: &Path, spec: &DatasetSpec) -> Result<Vec<PathBuf>> {
    let dict = dir.join("dataset_dict.json");
    if dict.is_file() {
        #[derive(serde::Deserialize)]
        struct Dict {
            splits: Vec<String>,
        }
        let Dict { splits } = crate::error::read_json(&dict)?;
        if !splits.contains(&spec.split) {
            return Err(Error::bad_file(
                dir,
                format!("no split `{}` in this save (splits: {})", spec.split, splits.join(", ")),
            ));
        }
        return saved_files(&dir.join(&spec.split));
    }
    if dir.join("state.json").is_file() {
        return saved_files(dir);
    }
    let listing = list_files(dir);
    let chosen = select(&listing, spec.config.as_deref(), &spec.split).map_err(|why| Error::bad_file(dir, why))?;
    Ok(chosen.into_iter().map(|rel| dir.join(rel)).collect())
}

/// The Arrow files of one `save_to_disk` split, from its `state.json`.
fn saved_files(dir: &Path) -> Result<Vec<PathBuf>> {
    #[derive(serde::Deserialize)]
    struct State {
        #[serde(rename = "_data_files")]
        data_files: Vec<DataFile>,
    }
    #[derive(serde::Deserialize)]
    struct DataFile {
        filename: String,
    }
    let state: State = crate::error::read_json(dir.join("state.json"))?;
    let files: Vec<PathBuf> = state.data_files.into_iter().map(|f| dir.join(f.filename)).collect();
    if let Some(missing) = files.iter().find(|f| !f.is_file()) {
        return Err(Error::bad_file(missing, "listed in state.json but missing"));
    }
    Ok(files)
}

/// Data files under `dir` (three levels deep), as `/`-separated relative
/// paths in sorted order.
fn list_files(dir: &Path) -> Vec<String> {
    fn walk(dir: &Path, prefix: &str, depth: usize, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') {
                continue;
            }
            let rel = format!("{prefix}{name}");
            let path = entry.path();
            if path.is_dir() && depth > 0 {
                walk(&path, &format!("{rel}/"), depth - 1, out);
            } else if path.is_file() && is_data_file(&name) {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, "", 3, &mut out);
    out.sort();
    out
}

/// Whether a file name is a dataset file's, not the metadata that
/// `datasets` writes beside them.
fn is_data_file(name: &str) -> bool {
    const METADATA: [&str; 4] = ["dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"];
    format_of(name).is_some() && !METADATA.contains(&name)
}

/// The split a data file belongs to, with `rel` taken inside a
/// configuration: `train.jsonl`, `train-00000-of-00002.parquet`,
/// `data/train-*`, `train/0000.parquet` all give `train`.
fn split_of(rel: &str) -> Option<String> {
    let rel = rel.strip_prefix("data/").unwrap_or(rel);
    if let Some((dir, _)) = rel.split_once('/') {
        return (!dir.contains('/')).then(|| dir.to_string());
    }
    let stem = rel.split('.').next().unwrap_or(rel);
    let shard = stem.find('-').filter(|&i| stem[i + 1..].starts_with(|c: char| c.is_ascii_digit()));
    Some(shard.map_or(stem, |i| &stem[..i]).to_string())
}

/// The files of `split` among `files` (relative paths of a dataset
/// directory or hub repo), inside the `config` sub-directory when given;
/// otherwise a message listing the splits or configurations there are.
pub fn select(files: &[String], config: Option<&str>, split: &str) -> std::result::Result<Vec<String>, String> {
    let inside = within(files, config);
    let chosen: Vec<String> =
        inside.iter().filter(|(_, rel)| split_of(rel).as_deref() == Some(split)).map(|(f, _)| f.to_string()).collect();
    if !chosen.is_empty() {
        return Ok(chosen);
    }
    let configs = configs(files);
    if let Some(config) = config {
        if inside.is_empty() {
            return Err(format!("no configuration `{config}` (configurations: {})", list_or_none(&configs)));
        }
    }
    let with_split: Vec<&str> =
        configs.iter().map(String::as_str).filter(|c| split_names(files, Some(c)).iter().any(|s| s == split)).collect();
    if config.is_none() && !with_split.is_empty() {
        return Err(format!(
            "no split `{split}` at the top; choose a configuration with --dataset_config ({} have it)",
            with_split.join(", ")
        ));
    }
    Err(format!(
        "no split `{split}`{} (found: {}; looked for {split}.<ext>, {split}-*.<ext> and {split}/ at the top and \
         under data/, with <ext> one of {DATA_SUFFIXES})",
        config.map(|c| format!(" in configuration `{c}`")).unwrap_or_default(),
        list_or_none(&split_names(files, config))
    ))
}

/// The splits among `files` (inside `config` when given), sorted.
fn split_names(files: &[String], config: Option<&str>) -> Vec<String> {
    let mut splits: Vec<String> = within(files, config).iter().filter_map(|(_, rel)| split_of(rel)).collect();
    splits.sort();
    splits.dedup();
    splits
}

/// The splits a dataset offers (in its configuration), as far as the local
/// files show.
pub fn splits(spec: &DatasetSpec) -> Result<Vec<String>> {
    let path = Path::new(&spec.name);
    if path.is_file() {
        return Ok(vec!["none (a single file)".into()]);
    }
    let dir = if path.is_dir() {
        path.to_path_buf()
    } else {
        let env = HubEnv::from_process();
        let cached = HubId::parse(&spec.name)
            .zip(env.cache_dir())
            .and_then(|(id, cache)| find_snapshot(&cache.join(id.dataset_folder_name()), id.revision()));
        match cached {
            Some(dir) => dir,
            None => return Ok(vec![spec.split.clone()]),
        }
    };
    if dir.join("dataset_dict.json").is_file() {
        let dict: Value = crate::error::read_json(dir.join("dataset_dict.json"))?;
        return Ok(dict["splits"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(String::from))
            .collect());
    }
    if dir.join("state.json").is_file() {
        let state: Value = crate::error::read_json(dir.join("state.json"))?;
        return Ok(vec![state["_split"].as_str().unwrap_or("one split (a datasets save)").to_string()]);
    }
    Ok(split_names(&list_files(&dir), spec.config.as_deref()))
}

/// The files inside `config` (all when none), with their paths relative to it.
fn within<'a>(files: &'a [String], config: Option<&str>) -> Vec<(&'a String, &'a str)> {
    match config {
        Some(config) => {
            let prefix = format!("{config}/");
            files.iter().filter_map(|f| f.strip_prefix(&prefix).map(|rel| (f, rel))).collect()
        }
        None => files.iter().map(|f| (f, f.as_str())).collect(),
    }
}

/// Sub-directories (other than `data/`) holding data files: a dataset's
/// configurations.
fn configs(files: &[String]) -> Vec<String> {
    let mut out: Vec<String> = files
        .iter()
        .filter_map(|f| f.split_once('/').map(|(dir, _)| dir.to_string()))
        .filter(|dir| dir != "data")
        .collect();
    out.dedup();
    out
}

fn list_or_none(items: &[String]) -> String {
    if items.is_empty() {
        "none".to_string()
    } else {
        items.join(", ")
    }
}

#[cfg(not(feature = "hub"))]
fn download(
    _id: &HubId,
    _env: &HubEnv,
    _cache_dir: &Path,
    _spec: &DatasetSpec,
) -> std::result::Result<PathBuf, String> {
    Err("downloading is off: rloo was built without the `hub` feature".to_string())
}

/// Downloads the split's files into the cache and returns the snapshot.
#[cfg(feature = "hub")]
fn download(id: &HubId, env: &HubEnv, cache_dir: &Path, spec: &DatasetSpec) -> std::result::Result<PathBuf, String> {
    let repo = crate::model::hub::hub_repo(id, env, cache_dir, hf_hub::RepoType::Dataset)?;
    let info = repo.info().map_err(|e| format!("downloading it failed: {e}"))?;
    let files: Vec<String> = info
        .siblings
        .into_iter()
        .map(|s| s.rfilename)
        .filter(|f| is_data_file(f.rsplit('/').next().unwrap_or(f)))
        .collect();
    let chosen = select(&files, spec.config.as_deref(), &spec.split)?;
    let mut snapshot = None;
    for rel in &chosen {
        let local = repo.get(rel).map_err(|e| format!("downloading {rel} failed: {e}"))?;
        let depth = rel.split('/').count();
        snapshot = local.ancestors().nth(depth).map(Path::to_path_buf);
    }
    snapshot.ok_or_else(|| "the download gave no files".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn splits_follow_the_hub_layouts() {
        let hub = files(&[
            "README.md",
            "data/test-00000-of-00001.parquet",
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
        ]);
        assert_eq!(
            select(&hub, None, "train").unwrap(),
            ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
        );
        let flat = files(&["test.jsonl", "train.jsonl", "valid1.csv"]);
        assert_eq!(select(&flat, None, "valid1").unwrap(), ["valid1.csv"]);
        let converted = files(&["default/train/0000.parquet", "default/train/0001.parquet"]);
        assert_eq!(select(&converted, Some("default"), "train").unwrap().len(), 2);
        let err = select(&flat, None, "validation").unwrap_err();
        assert!(err.starts_with("no split `validation` (found: test, train, valid1; looked for"), "{err}");
    }

    #[test]
    fn configurations_are_sub_directories() {
        let hs3 = files(&["edit/train.jsonl.gz", "preference/train.jsonl.gz", "preference/validation.jsonl.gz"]);
        assert_eq!(select(&hs3, Some("preference"), "validation").unwrap(), ["preference/validation.jsonl.gz"]);
        let err = select(&hs3, None, "train").unwrap_err();
        assert_eq!(
            err,
            "no split `train` at the top; choose a configuration with --dataset_config (edit, preference have it)"
        );
        let err = select(&hs3, Some("prefs"), "train").unwrap_err();
        assert_eq!(err, "no configuration `prefs` (configurations: edit, preference)");
        let err = select(&hs3, Some("edit"), "validation").unwrap_err();
        assert!(err.starts_with("no split `validation` in configuration `edit` (found: train;"), "{err}");
    }
}
