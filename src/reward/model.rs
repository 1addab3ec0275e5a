//! A reward model: a `*ForSequenceClassification` checkpoint with one label,
//! whose score head read at the last token of prompt + completion is the
//! reward (docs/algorithm.md section 1; TRL's `get_reward`).
//!
//! The reward model may have been trained with another tokenizer and chat
//! template than the policy's, so each sample is re-tokenized with the
//! reward model's own:
//! - a chat prompt becomes `messages + [{"role": "assistant", "content":
//!   completion}]`, rendered with the reward model's template without a
//!   generation prompt (the conversation is complete), then encoded with the
//!   BOS rule of [`Tokenizer::encode_prompt`];
//! - a text prompt becomes `encode_prompt(text) ++ encode(completion)`, the
//!   tokenization that `rloo score` and the fixture references use.
//!
//! The completion is expected without the policy's stop token: a chat
//! template writes the reward model's own end-of-turn marker.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::config::{one, RewardTable};
use super::{RewardSource, Sample};
use crate::data::{Message, Prompt, Tokenizer};
use crate::error::{Error, Result};
use crate::model::hub::resolve_model;
use crate::model::scoring::{sequence_scores, Pair};
use crate::model::{HeadKind, Model, ModelConfig, Placement};

pub(super) fn default_batch_size() -> usize {
    8
}

/// `type = "model"`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Metric name; default `model`.
    pub name: Option<String>,
    /// Weight in the total score.
    #[serde(default = "one")]
    pub weight: f32,
    /// A `*ForSequenceClassification` model directory with `num_labels = 1`,
    /// or a hub id (`owner/name[@revision]`) in the local cache.
    pub path: String,
    /// Sequences per forward pass.
    #[serde(default = "default_batch_size")]
    pub batch_size: usize,
}

impl RewardTable for ModelSpec {
    fn name(&self) -> Option<&str> {
        self.name.as_deref()
    }

    fn weight(&self) -> f32 {
        self.weight
    }

    fn build(&self, name: String, device: &Device, dtype: DType) -> Result<Box<dyn RewardSource>> {
        if self.batch_size == 0 {
            return Err(Error::Invalid("batch_size must be at least 1".into()));
        }
        Ok(Box::new(RewardModel::load(name, &self.path, Placement::new(device, dtype), self.batch_size)?))
    }
}

/// A sequence-classification model and its tokenizer, scoring on a device.
pub struct RewardModel {
    name: String,
    model: Model,
    tokenizer: Tokenizer,
    device: Device,
    batch_size: usize,
}

impl RewardModel {
    /// Loads the reward model at `path` (a directory or a hub id) onto
    /// `at`'s device, computing in its dtype (bf16: weights and
    /// activations; the scores stay f32); `batch_size` sequences go through
    /// each forward pass.
    pub fn load<'a>(
        name: impl Into<String>,
        path: &str,
        at: impl Into<Placement<'a>>,
        batch_size: usize,
    ) -> Result<RewardModel> {
        Self::from_dir(name, &resolve_model(path)?, at, batch_size)
    }

    /// [`load`](Self::load) from a model directory.
    pub fn from_dir<'a>(
        name: impl Into<String>,
        dir: &Path,
        at: impl Into<Placement<'a>>,
        batch_size: usize,
    ) -> Result<RewardModel> {
        if batch_size == 0 {
            return Err(Error::Invalid("batch_size must be at least 1, got 0".into()));
        }
        // The head is checked before the weights are read, so that pointing
        // at the policy instead of the reward model fails fast and clearly.
        check_head(&ModelConfig::from_dir(dir)?)?;
        let at = at.into();
        let model = Model::load_computing(dir, at)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        Ok(RewardModel { name: name.into(), model, tokenizer, device: at.device.clone(), batch_size })
    }

    /// The directory the model was loaded from.
    pub fn dir(&self) -> &Path {
        self.model.dir()
    }

    /// The reward model's tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The token ids the reward model reads for a sample (see the module
    /// documentation).
    pub fn encode(&self, sample: &Sample) -> Result<Vec<u32>> {
        encode_pair(&self.tokenizer, sample.prompt, sample.completion)
    }

    /// Errors unless the model can score `ids`: every id in its vocabulary,
    /// and no more tokens than its context (a rotary model's
    /// `max_position_embeddings` too, which it would run past without error
    /// but not as trained).
    pub fn check_fits(&self, ids: &[u32]) -> Result<()> {
        self.model.check_tokens(ids)
    }
}

/// The ids a reward model reads for a prompt and its completion: a text
/// prompt is encoded (BOS rule included) and followed by the completion's
/// ids; a conversation gets the completion as the assistant's reply and is
/// rendered with the reward model's chat template (no generation prompt).
pub fn encode_pair(tokenizer: &Tokenizer, prompt: &Prompt, completion: &str) -> Result<Vec<u32>> {
    match prompt {
        Prompt::Text(text) => {
            let mut ids = tokenizer.encode_prompt(&Prompt::Text(text.clone()))?;
            ids.extend(tokenizer.encode(completion)?);
            Ok(ids)
        }
        Prompt::Messages(messages) => {
            let template = tokenizer.chat_template().ok_or_else(|| {
                Error::bad_file(
                    tokenizer.dir(),
                    "the prompt is a list of chat messages but this reward model has no \
                     chat template (neither chat_template.jinja nor a chat_template key in \
                     tokenizer_config.json) to render prompt and completion with",
                )
            })?;
            let mut conversation = messages.clone();
            conversation.push(Message::new("assistant", completion));
            let text = template.render(&conversation, false)?;
            tokenizer.encode_prompt(&Prompt::Text(text))
        }
    }
}

/// Errors unless the config is a sequence classifier with one label.
fn check_head(config: &ModelConfig) -> Result<()> {
    let dir = config.path.parent().unwrap_or(Path::new("."));
    let class = config
        .raw
        .get("architectures")
        .and_then(|a| a.get(0))
        .and_then(Value::as_str)
        .map(str::to_string)
        .unwrap_or_else(|| config.class_name());
    match config.head {
        HeadKind::CausalLm => Err(Error::bad_file(
            dir,
            format!(
                "is a causal language model ({class}), not a reward model: a reward model is a \
                 *ForSequenceClassification checkpoint with num_labels = 1 and a `score.weight` \
                 head"
            ),
        )),
        HeadKind::SequenceClassification { num_labels: 1 } => Ok(()),
        HeadKind::SequenceClassification { num_labels } => Err(Error::bad_config(
            &config.path,
            format!(
                "num_labels = {num_labels} ({class}); a reward model gives one score per \
                 sequence, so num_labels must be 1"
            ),
        )),
    }
}

impl RewardSource for RewardModel {
    fn name(&self) -> &str {
        &self.name
    }

    fn models(&self) -> Vec<&Model> {
        vec![&self.model]
    }

    fn score(&self, samples: &[Sample]) -> Result<Vec<Option<f32>>> {
        self.model.resident()?;
        let vocab = self.model.config().vocab_size();
        let max_len = self.model.config().context_length();
        let mut out = vec![None; samples.len()];
        // Samples that can be scored, as (index, ids).
        let mut rows: Vec<(usize, Vec<u32>)> = Vec::with_capacity(samples.len());
        let (mut empty, mut too_long) = (0, 0);
        for (i, sample) in samples.iter().enumerate() {
            let ids =
                self.encode(sample).map_err(|e| Error::Invalid(format!("reward `{}`: sample {i}: {e}", self.name)))?;
            if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
                return Err(Error::bad_file(
                    self.dir(),
                    format!(
                        "the tokenizer produced token id {bad}, outside the model's vocabulary \
                         of {vocab}: tokenizer.json and config.json do not belong together"
                    ),
                ));
            }
            if ids.is_empty() {
                empty += 1;
            } else if max_len.is_some_and(|m| ids.len() > m) {
                too_long += 1;
            } else {
                rows.push((i, ids));
            }
        }
        if empty + too_long > 0 {
            tracing::warn!(
                "reward `{}`: {empty} empty and {too_long} over-long sequences (more than {} \
                 tokens) of {} get no score",
                self.name,
                max_len.map_or("unlimited".to_string(), |m| m.to_string()),
                samples.len()
            );
        }
        // Samples of one prompt share a batch and their common leading
        // tokens, which the scoring pass computes once for all of them.
        let shared = shared_prefix_lengths(samples, &rows);
        rows.sort_by_key(|(i, ids)| (shared[i].0, ids.len()));
        for chunk in rows.chunks(self.batch_size) {
            let pairs: Vec<Pair> = chunk
                .iter()
                .map(|(i, ids)| {
                    let (prompt, completion) = ids.split_at(shared[i].1);
                    Pair { prompt: prompt.to_vec(), completion: completion.to_vec() }
                })
                .collect();
            let scores = sequence_scores(self.model.frozen(), &pairs, &self.device)?;
            for ((i, _), s) in chunk.iter().zip(scores) {
                out[*i] = s.first().copied();
            }
        }
        Ok(out)
    }
}

/// Per scorable sample (`rows` holds their index and ids): its prompt group
/// ([`Sample::group`]), and the number of leading tokens the group's
/// scorable samples have in common.
fn shared_prefix_lengths(samples: &[Sample], rows: &[(usize, Vec<u32>)]) -> HashMap<usize, (usize, usize)> {
    let mut group_of: HashMap<usize, usize> = HashMap::new();
    let mut common: Vec<&[u32]> = Vec::new();
    let mut out = HashMap::with_capacity(rows.len());
    for (i, ids) in rows {
        let g = *group_of.entry(samples[*i].group).or_insert_with(|| {
            common.push(ids);
            common.len() - 1
        });
        let same = common[g].iter().zip(ids).take_while(|(a, b)| a == b).count();
        common[g] = &common[g][..same];
        out.insert(*i, (g, 0));
    }
    for v in out.values_mut() {
        v.1 = common[v.0].len();
    }
    out
}

impl std::fmt::Debug for RewardModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardModel")
            .field("name", &self.name)
            .field("dir", &self.dir())
            .field("batch_size", &self.batch_size)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::test_support::*;
    use serde_json::{json, Map};
    use std::path::PathBuf;

    fn fixture(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(path)
    }

    fn expected_rows(name: &str) -> Vec<Map<String, Value>> {
        let path = fixture(&format!("score/expected/{name}.jsonl"));
        std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
    }

    fn ids(v: &Value) -> Vec<u32> {
        serde_json::from_value(v.clone()).unwrap()
    }

    /// A copy of a fixture model directory that a test may edit.
    fn copy_model(name: &str) -> tempfile::TempDir {
        let dst = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(fixture(&format!("models/{name}"))).unwrap() {
            let entry = entry.unwrap();
            std::fs::copy(entry.path(), dst.path().join(entry.file_name())).unwrap();
        }
        dst
    }

    fn edit_config(dir: &Path, edit: impl FnOnce(&mut Map<String, Value>)) {
        let path = dir.join("config.json");
        let mut config: Map<String, Value> = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        edit(&mut config);
        std::fs::write(&path, Value::Object(config).to_string()).unwrap();
    }

    #[test]
    fn a_table_builds_a_model_computing_in_the_given_dtype() {
        let spec = ModelSpec {
            name: None,
            weight: 1.0,
            path: fixture("models/gpt_neox-seqcls").display().to_string(),
            batch_size: 2,
        };
        let prompt = Prompt::Text("The movie was".into());
        let row = Map::new();
        let sample = Sample {
            prompt: &prompt,
            completion: " good.",
            completion_ids: &[],
            ended_with_eos: true,
            row: &row,
            group: 0,
        };
        let score = |dtype: DType| {
            let rm = RewardModel::load("rm", &spec.path, Placement::new(&Device::Cpu, dtype), 2).unwrap();
            assert_eq!(rm.model.dtype(), dtype);
            let source = spec.build("rm".into(), &Device::Cpu, dtype).unwrap();
            let built = source.score(std::slice::from_ref(&sample)).unwrap()[0].unwrap();
            let direct = rm.score(std::slice::from_ref(&sample)).unwrap()[0].unwrap();
            assert_eq!(built, direct, "the table's model computes in {dtype:?}");
            direct
        };
        let (f32, bf16) = (score(DType::F32), score(DType::BF16));
        assert!(f32 != bf16 && (f32 - bf16).abs() < 0.05 * f32.abs().max(1.0), "{f32} in f32, {bf16} in bf16");
    }

    #[test]
    fn completions_of_one_prompt_score_as_they_do_alone() {
        let completions = [" good.", " bad, really", " good.", " fine I guess", ""];
        for name in ["qwen2-seqcls", "gpt_neox-seqcls", "gpt2-seqcls"] {
            let rm = RewardModel::from_dir("rm", &fixture(&format!("models/{name}")), &Device::Cpu, 3).unwrap();
            let prompts = [Prompt::Text("The movie was".into()), Prompt::Text("Rate it:".into())];
            let row = Map::new();
            // Completions of each prompt interleaved.
            let samples: Vec<Sample> = completions
                .iter()
                .enumerate()
                .map(|(i, c)| Sample {
                    prompt: &prompts[i % 2],
                    completion: c,
                    completion_ids: &[],
                    ended_with_eos: true,
                    row: &row,
                    group: i % 2,
                })
                .collect();
            let together = rm.score(&samples).unwrap();
            for (i, sample) in samples.iter().enumerate() {
                let alone = rm.score(std::slice::from_ref(sample)).unwrap()[0].unwrap();
                let got = together[i].unwrap();
                assert!((got - alone).abs() < 1e-4, "{name} sample {i}: {got} together, {alone} alone");
            }
        }
    }

    #[test]
    fn scores_text_prompts_like_transformers() {
        for name in ["qwen2-seqcls", "llama-seqcls", "qwen3-seqcls", "gpt_neox-seqcls", "gpt2-seqcls"] {
            let rm = RewardModel::from_dir("rm", &fixture(&format!("models/{name}")), &Device::Cpu, 2).unwrap();
            let rows = expected_rows(name);
            let owned: Vec<Owned> = rows
                .iter()
                .map(|r| Owned::text(r["prompt"].as_str().unwrap(), r["completion"].as_str().unwrap()))
                .collect();
            let samples = samples(&owned);
            for (row, sample) in rows.iter().zip(&samples) {
                let want = [ids(&row["prompt_ids"]), ids(&row["completion_ids"])].concat();
                assert_eq!(rm.encode(sample).unwrap(), want, "{name}: ids");
            }
            // Batches of 2 sorted by length: the padding path is exercised.
            let got = rm.score(&samples).unwrap();
            let mut max_diff = 0f32;
            for (row, got) in rows.iter().zip(&got) {
                let want = row["score"].as_f64().unwrap() as f32;
                max_diff = max_diff.max((got.unwrap() - want).abs());
            }
            println!("{name}: max |score - transformers| = {max_diff:e}");
            assert!(max_diff < 1e-4, "{name}: max diff {max_diff}");
        }
    }

    #[test]
    fn chat_prompts_are_rendered_with_the_completion_as_assistant_turn() {
        // llama-seqcls with the Llama 3.1 template of llama-causal.
        let dir = copy_model("llama-seqcls");
        let causal: Map<String, Value> = serde_json::from_str(
            &std::fs::read_to_string(fixture("models/llama-causal/tokenizer_config.json")).unwrap(),
        )
        .unwrap();
        let template = causal["chat_template"].as_str().unwrap();
        std::fs::write(dir.path().join("chat_template.jinja"), template).unwrap();
        // The rendered conversation is longer than the fixture's 128 positions.
        edit_config(dir.path(), |c| {
            c.insert("max_position_embeddings".into(), json!(512));
        });
        let rm = RewardModel::from_dir("rm", dir.path(), &Device::Cpu, 4).unwrap();

        let messages = vec![
            Message::new("system", "You are a helpful cooking assistant."),
            Message::new("user", "How long should I boil an egg?"),
        ];
        let completion = "About nine minutes for a firm yolk.";
        let owned = vec![
            Owned { prompt: Prompt::Messages(messages.clone()), ..Owned::text("", completion) },
            Owned::text("The movie was", " surprisingly good."),
        ];
        let samples = samples(&owned);
        let got = rm.encode(&samples[0]).unwrap();

        let mut conversation = messages;
        conversation.push(Message::new("assistant", completion));
        let text = rm.tokenizer().chat_template().unwrap().render(&conversation, false).unwrap();
        assert!(
            text.ends_with(
                "<|start_header_id|>assistant<|end_header_id|>\n\nAbout nine minutes for a firm yolk.<|eot_id|>"
            ),
            "{text:?}"
        );
        assert_eq!(got, rm.tokenizer().encode(&text).unwrap());
        assert_eq!(got.iter().filter(|&&t| t == 4).count(), 1, "exactly one BOS (the template writes it)");

        // Scoring in a batch with a text prompt gives each sample's own score.
        let batch = rm.score(&samples).unwrap();
        for (i, sample) in samples.iter().enumerate() {
            let alone = rm.score(std::slice::from_ref(sample)).unwrap();
            let pair = Pair { prompt: rm.encode(sample).unwrap(), completion: Vec::new() };
            let direct = sequence_scores(rm.model.frozen(), &[pair], &Device::Cpu).unwrap();
            assert!((alone[0].unwrap() - direct[0][0]).abs() < 1e-6);
            assert!((batch[i].unwrap() - direct[0][0]).abs() < 1e-4, "sample {i}: {batch:?} vs {direct:?}");
        }
    }

    #[test]
    fn chat_prompts_without_a_template_name_the_reward_model() {
        let dir = fixture("models/qwen2-seqcls");
        let rm = RewardModel::from_dir("rm", &dir, &Device::Cpu, 1).unwrap();
        let owned =
            vec![Owned { prompt: Prompt::Messages(vec![Message::new("user", "hi")]), ..Owned::text("", "hello") }];
        let err = rm.score(&samples(&owned)).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "reward `rm`: sample 0: {}: the prompt is a list of chat messages but this \
                 reward model has no chat template",
                dir.display()
            )),
            "{err}"
        );
    }

    #[test]
    fn empty_sequences_get_no_score() {
        let dir = fixture("models/qwen2-seqcls");
        let rm = RewardModel::from_dir("rm", &dir, &Device::Cpu, 8).unwrap();
        let owned = vec![Owned::text("", ""), Owned::text("The movie was", " fine")];
        let got = rm.score(&samples(&owned)).unwrap();
        assert_eq!(got[0], None);
        assert!(got[1].is_some());
    }

    #[test]
    fn sequences_longer_than_a_rotary_models_context_get_no_score() {
        // GPT-NeoX: rotary, max_position_embeddings 128.
        let dir = fixture("models/gpt_neox-seqcls");
        let rm = RewardModel::from_dir("rm", &dir, &Device::Cpu, 8).unwrap();
        let owned = vec![Owned::text("The movie was", &" word".repeat(200)), Owned::text("A", " b")];
        let got = rm.score(&samples(&owned)).unwrap();
        assert_eq!(got[0], None);
        assert!(got[1].is_some());
    }

    #[test]
    fn sequences_longer_than_learned_positions_get_no_score() {
        // gpt2 has 128 learned positions.
        let dir = fixture("models/gpt2-seqcls");
        let rm = RewardModel::from_dir("rm", &dir, &Device::Cpu, 8).unwrap();
        let long = " word".repeat(200);
        let owned = vec![Owned::text("The movie was", &long), Owned::text("A", " b")];
        let got = rm.score(&samples(&owned)).unwrap();
        assert_eq!(got[0], None);
        assert!(got[1].is_some());
    }

    #[test]
    fn a_causal_lm_is_rejected_with_its_class() {
        let dir = fixture("models/llama-causal");
        let err = RewardModel::from_dir("rm", &dir, &Device::Cpu, 8).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: is a causal language model (LlamaForCausalLM), not a reward model: a reward \
                 model is a *ForSequenceClassification checkpoint with num_labels = 1 and a \
                 `score.weight` head",
                dir.display()
            )
        );
    }

    #[test]
    fn more_than_one_label_is_rejected() {
        let dir = copy_model("qwen2-seqcls");
        edit_config(dir.path(), |c| {
            c.insert("id2label".into(), json!({"0": "LABEL_0", "1": "LABEL_1"}));
        });
        let err = RewardModel::from_dir("rm", dir.path(), &Device::Cpu, 8).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: num_labels = 2 (Qwen2ForSequenceClassification); a reward model gives one \
                 score per sequence, so num_labels must be 1",
                dir.path().join("config.json").display()
            )
        );
    }

    #[test]
    fn a_missing_score_head_names_the_directory() {
        let dir = copy_model("qwen2-causal");
        edit_config(dir.path(), |c| {
            c.insert("architectures".into(), json!(["Qwen2ForSequenceClassification"]));
            c.insert("id2label".into(), json!({"0": "LABEL_0"}));
        });
        let err = RewardModel::from_dir("rm", dir.path(), &Device::Cpu, 8).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{}: the sequence-classification head `score.weight`", dir.path().display())),
            "{err}"
        );
    }

    #[test]
    fn zero_batch_size_is_an_error() {
        let err =
            RewardModel::from_dir("rm", &fixture("models/qwen2-seqcls"), &Device::Cpu, 0).unwrap_err().to_string();
        assert_eq!(err, "batch_size must be at least 1, got 0");
    }

    #[test]
    fn reward_models_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<RewardModel>();
    }
}
