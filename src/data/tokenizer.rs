//! A model directory's tokenizer: the fast-tokenizer file `tokenizer.json`
//! (through the `tokenizers` crate) plus what `transformers` keeps beside it:
//! special tokens, the BOS policy and the chat template.
//!
//! Special tokens come from `tokenizer_config.json`, with
//! `special_tokens_map.json` beside it. transformers 4.x reads the map only for
//! "legacy" configs (those without `added_tokens_decoder`), and then lets it
//! override the config; for current configs the config alone counts. rloo
//! follows that, and in the current case also fills a token the config lacks
//! from the map (transformers would fall back to a class default that only the
//! Python class knows).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::data::chat::{ChatTemplate, CHAT_TEMPLATE_FILE};
use crate::data::prompt::{describe_json, Prompt};
use crate::error::{read_json, Error, Result};

/// The tokenizer-side files a saved model directory carries over from its
/// source, so that transformers and vLLM load the same tokenizer from it.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    CHAT_TEMPLATE_FILE,
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
];

/// The special-token attributes of transformers' tokenizers
/// (`SPECIAL_TOKENS_ATTRIBUTES`) that chat templates see when they are set.
const SPECIAL_TOKEN_KEYS: &[&str] =
    &["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"];

/// transformers' `VERY_LARGE_INTEGER` (`int(1e30)`) and similar stand for
/// "no limit" in `model_max_length`.
const NO_LIMIT: f64 = 1e18;

/// A loaded tokenizer. Encoding never adds special tokens by itself; BOS is
/// added by [`Tokenizer::encode_prompt`] only.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    dir: PathBuf,
    inner: tokenizers::Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
    add_bos_token: bool,
    add_eos_token: bool,
    clean_up_tokenization_spaces: bool,
    model_max_length: Option<usize>,
    chat_template: Option<ChatTemplate>,
}

impl Tokenizer {
    /// Loads the tokenizer of the model directory `dir`.
    ///
    /// `tokenizer.json` is required; `tokenizer_config.json`,
    /// `special_tokens_map.json` and `chat_template.jinja` are optional.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let json_path = dir.join("tokenizer.json");
        if !json_path.is_file() {
            return Err(Error::bad_file(
                dir,
                "no tokenizer.json: rloo needs the fast-tokenizer file tokenizer.json \
                 (a model with only tokenizer.model or vocab.json/merges.txt can be converted \
                 by loading it with transformers' AutoTokenizer and calling save_pretrained)",
            ));
        }
        let inner = tokenizers::Tokenizer::from_file(&json_path)
            .map_err(|e| Error::bad_file(&json_path, format!("cannot load tokenizer: {e}")))?;

        let config_path = dir.join("tokenizer_config.json");
        let config: Map<String, Value> = if config_path.is_file() {
            match read_json::<Value>(&config_path)? {
                Value::Object(map) => map,
                other => {
                    return Err(Error::bad_file(
                        &config_path,
                        format!("expected a JSON object, got {}", describe_json(&other)),
                    ))
                }
            }
        } else {
            Map::new()
        };
        let map_path = dir.join("special_tokens_map.json");
        let special_map: Map<String, Value> = if map_path.is_file() {
            match read_json::<Value>(&map_path)? {
                Value::Object(map) => map,
                other => {
                    return Err(Error::bad_file(
                        &map_path,
                        format!("expected a JSON object, got {}", describe_json(&other)),
                    ))
                }
            }
        } else {
            Map::new()
        };
        let legacy = !config.contains_key("added_tokens_decoder");

        // Each special token: (value, file it came from).
        let mut tokens: Map<String, Value> = Map::new();
        for key in SPECIAL_TOKEN_KEYS.iter().copied().chain(["additional_special_tokens"]) {
            let from_config = config.get(key);
            let from_map = special_map.get(key);
            let (value, path) = match (from_config, from_map) {
                (_, Some(m)) if legacy => (m, &map_path),
                (Some(c), _) => (c, &config_path),
                (None, Some(m)) => (m, &map_path),
                (None, None) => continue,
            };
            if key == "additional_special_tokens" {
                let list = additional_tokens(value, path)?;
                if !list.is_empty() {
                    tokens.insert(key.to_string(), Value::from(list));
                }
            } else if let Some(token) = token_content(value, key, path)? {
                tokens.insert(key.to_string(), Value::String(token));
            }
        }
        let token = |key: &str| tokens.get(key).and_then(Value::as_str).map(str::to_string);
        let (bos_token, eos_token, pad_token, unk_token) =
            (token("bos_token"), token("eos_token"), token("pad_token"), token("unk_token"));
        let bos_id = bos_token.as_deref().and_then(|t| inner.token_to_id(t));

        let add_bos_token = match config.get("add_bos_token") {
            Some(v) => bool_field(v, "add_bos_token", &config_path)?,
            // No explicit setting: BOS is added iff the post-processor of
            // tokenizer.json adds it (Llama 3's TemplateProcessing does), which
            // is what `tokenizer(text)` does in transformers.
            None => match bos_id {
                Some(bos) => {
                    let with = inner
                        .encode_fast("", true)
                        .map_err(|e| Error::bad_file(&json_path, format!("cannot encode: {e}")))?;
                    with.get_ids().first() == Some(&bos)
                }
                None => false,
            },
        };
        let add_eos_token = match config.get("add_eos_token") {
            Some(v) => bool_field(v, "add_eos_token", &config_path)?,
            None => false,
        };
        // transformers' default has been False since 4.45 (True before).
        let clean_up_tokenization_spaces = match config.get("clean_up_tokenization_spaces") {
            Some(v) => bool_field(v, "clean_up_tokenization_spaces", &config_path)?,
            None => false,
        };
        let model_max_length = match config.get("model_max_length") {
            None | Some(Value::Null) => None,
            Some(v) => match v.as_f64() {
                Some(n) if n >= NO_LIMIT => None,
                Some(n) if n >= 1.0 && n.fract() == 0.0 => Some(n as usize),
                _ => {
                    return Err(Error::bad_file(
                        &config_path,
                        format!("model_max_length: expected a positive integer, got {}", describe_json(v)),
                    ))
                }
            },
        };

        let chat_template = ChatTemplate::from_model_dir(dir, Some(&config))?
            .map(|t| tokens.iter().fold(t, |t, (k, v)| t.with_var(k.clone(), v.clone())));

        Ok(Tokenizer {
            dir: dir.to_path_buf(),
            inner,
            bos_token,
            eos_token,
            pad_token,
            unk_token,
            add_bos_token,
            add_eos_token,
            clean_up_tokenization_spaces,
            model_max_length,
            chat_template,
        })
    }

    /// The model directory this tokenizer was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The `tokenizers` tokenizer underneath.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Token ids of `text` without added special tokens, like
    /// `tokenizer(text, add_special_tokens=False)`: special tokens written in
    /// the text (`<|im_start|>`) are still recognised as single tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| Error::bad_file(self.dir.join("tokenizer.json"), format!("cannot encode: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`, like transformers' `decode`. Ids outside the vocabulary
    /// are skipped, as the fast tokenizers do (a model's embedding is often
    /// padded past the tokenizer's size).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::bad_file(self.dir.join("tokenizer.json"), format!("cannot decode: {e}")))?;
        Ok(if self.clean_up_tokenization_spaces { clean_up_tokenization(&text) } else { text })
    }

    /// The ids of a prompt as the policy should see them: a conversation is
    /// rendered with the chat template (with the generation prompt), the text
    /// is encoded without special tokens, and the BOS id is put in front when
    /// [`add_bos_token`](Self::add_bos_token) is set, a BOS token exists and
    /// the ids do not already start with it (templates that write
    /// `bos_token` themselves get exactly one).
    pub fn encode_prompt(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let mut ids = match prompt {
            Prompt::Text(text) => self.encode(text)?,
            Prompt::Messages(messages) => {
                let template = self.chat_template.as_ref().ok_or_else(|| {
                    Error::bad_file(
                        &self.dir,
                        format!(
                            "the prompt is a list of chat messages but this model has no chat \
                             template (neither {CHAT_TEMPLATE_FILE} nor a chat_template key in \
                             tokenizer_config.json); use a text prompt or a model with a template"
                        ),
                    )
                })?;
                self.encode(&template.render(messages, true)?)?
            }
        };
        if let (true, Some(bos)) = (self.add_bos_token, self.bos_token_id()) {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
        Ok(ids)
    }

    /// The BOS token string, if the model has one (Qwen has none).
    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    /// The EOS token string of the tokenizer (a model may stop on more ids:
    /// see `GenerationConfig::eos_token_id`).
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// The padding token string, if set.
    pub fn pad_token(&self) -> Option<&str> {
        self.pad_token.as_deref()
    }

    /// The unknown-word token string, if set.
    pub fn unk_token(&self) -> Option<&str> {
        self.unk_token.as_deref()
    }

    /// The id of the BOS token, if it is set and in the vocabulary.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The id of the EOS token, if it is set and in the vocabulary.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The id of the padding token, if it is set and in the vocabulary.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// Whether prompts start with BOS: `add_bos_token` of
    /// `tokenizer_config.json`, or when absent, whether the `tokenizer.json`
    /// post-processor adds BOS.
    pub fn add_bos_token(&self) -> bool {
        self.add_bos_token
    }

    /// `add_eos_token` of `tokenizer_config.json` (false when absent). Not
    /// applied to prompts, which must stay open for the completion.
    pub fn add_eos_token(&self) -> bool {
        self.add_eos_token
    }

    /// `model_max_length` of `tokenizer_config.json`, `None` when absent or
    /// the "no limit" sentinel (`1e30`).
    pub fn model_max_length(&self) -> Option<usize> {
        self.model_max_length
    }

    /// The chat template, with the special tokens bound as variables.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Number of distinct tokens, added tokens included (transformers'
    /// `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The id of a token string (added tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token string of an id (added tokens included).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }
}

impl Tokenizer {
    /// Checks at start-up that this tokenizer can drive the model of
    /// `model`: its tokens and special ids inside the model's embedding,
    /// and, when it comes from another directory than the model, the same
    /// vocabulary and EOS as the model's own tokenizer (or its config's EOS).
    /// A mismatch would otherwise feed the model ids it never learned or
    /// decode its samples to empty text.
    pub fn check_model(&self, model: &crate::model::ModelConfig) -> Result<()> {
        let model_dir = model.path.parent().unwrap_or(Path::new("."));
        let vocab = model.vocab_size();
        let mismatch = |why: String| {
            Error::Invalid(format!(
                "the tokenizer of {} does not fit the model {}: {why}",
                self.dir.display(),
                model_dir.display()
            ))
        };
        if self.vocab_size() > vocab {
            return Err(mismatch(format!("the tokenizer has {} tokens, the model embeds {vocab}", self.vocab_size())));
        }
        for (what, id) in [("BOS", self.bos_token_id()), ("EOS", self.eos_token_id()), ("pad", self.pad_token_id())] {
            if let Some(id) = id.filter(|&id| id as usize >= vocab) {
                return Err(mismatch(format!("its {what} id {id} is outside the model's {vocab} embeddings")));
            }
        }
        if same_dir(&self.dir, model_dir) {
            return Ok(());
        }
        if model_dir.join("tokenizer.json").is_file() {
            let own = Tokenizer::from_dir(model_dir)?;
            if own.vocab_size() != self.vocab_size() || own.eos_token_id() != self.eos_token_id() {
                return Err(mismatch(format!(
                    "it has {} tokens and EOS id {:?}, the model's own tokenizer {} and {:?}",
                    self.vocab_size(),
                    self.eos_token_id(),
                    own.vocab_size(),
                    own.eos_token_id()
                )));
            }
        } else if let (Some(eos), Some(config_eos)) = (self.eos_token_id(), model.raw.get("eos_token_id")) {
            let ids: Vec<u64> = match config_eos {
                serde_json::Value::Array(a) => a.iter().filter_map(serde_json::Value::as_u64).collect(),
                v => v.as_u64().into_iter().collect(),
            };
            if !ids.is_empty() && !ids.contains(&(eos as u64)) {
                return Err(mismatch(format!("its EOS id is {eos}, the model's config.json says {config_eos}")));
            }
        }
        Ok(())
    }
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// Copies those of [`TOKENIZER_FILES`] that exist in `src_dir` to `dst_dir`
/// (created if missing).
pub fn copy_tokenizer_files(src_dir: &Path, dst_dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dst_dir).map_err(|e| Error::io(dst_dir, e))?;
    for name in TOKENIZER_FILES {
        let src = src_dir.join(name);
        if src.is_file() {
            std::fs::copy(&src, dst_dir.join(name)).map_err(|e| Error::io(&src, e))?;
        }
    }
    Ok(())
}

/// A special token as `tokenizer_config.json` writes it: a string, an
/// `AddedToken` object `{"content": ..., ...}`, or null.
fn token_content(value: &Value, key: &str, path: &Path) -> Result<Option<String>> {
    match value {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s.clone())),
        Value::Object(m) => match m.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(Error::bad_file(
                path,
                format!(
                    "{key}: expected a string or an object with a string \"content\", got {}",
                    describe_json(value)
                ),
            )),
        },
        other => Err(Error::bad_file(
            path,
            format!("{key}: expected a string or an object with a string \"content\", got {}", describe_json(other)),
        )),
    }
}

fn additional_tokens(value: &Value, path: &Path) -> Result<Vec<String>> {
    match value {
        Value::Null => Ok(Vec::new()),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .filter_map(|(i, v)| token_content(v, &format!("additional_special_tokens[{i}]"), path).transpose())
            .collect(),
        other => Err(Error::bad_file(
            path,
            format!("additional_special_tokens: expected a list, got {}", describe_json(other)),
        )),
    }
}

fn bool_field(value: &Value, key: &str, path: &Path) -> Result<bool> {
    match value {
        Value::Bool(b) => Ok(*b),
        Value::Null => Ok(false),
        other => Err(Error::bad_file(path, format!("{key}: expected true or false, got {}", describe_json(other)))),
    }
}

/// transformers' `clean_up_tokenization`: removes the spaces that old
/// word-level tokenizers left before punctuation and contractions.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::prompt::Message;
    use serde_json::json;
    use std::collections::HashMap;
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::Whitespace;
    use tokenizers::processors::template::TemplateProcessing;
    use tokenizers::AddedToken;

    const WORDS: &[&str] = &["<unk>", "hello", "world", "user", "assistant", "!", "'s", "it"];
    const SPECIAL: &[&str] = &["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"];

    /// A word-level tokenizer.json: ids 0..8 words, then the special tokens
    /// <s>=8, </s>=9, <pad>=10, <|im_start|>=11, <|im_end|>=12. With
    /// `bos_post_processor`, `tokenizer(text)` would prepend <s>.
    fn write_tokenizer(dir: &Path, bos_post_processor: bool) {
        let vocab: HashMap<String, u32> = WORDS.iter().enumerate().map(|(i, w)| (w.to_string(), i as u32)).collect();
        let model = WordLevel::builder().vocab(vocab.into_iter().collect()).unk_token("<unk>".into()).build().unwrap();
        let mut tok = tokenizers::Tokenizer::new(model);
        tok.with_pre_tokenizer(Some(Whitespace {}));
        let specials: Vec<AddedToken> = SPECIAL.iter().map(|s| AddedToken::from(*s, true)).collect();
        tok.add_special_tokens(&specials);
        if bos_post_processor {
            tok.with_post_processor(Some(
                TemplateProcessing::builder()
                    .try_single("<s> $A")
                    .unwrap()
                    .special_tokens(vec![("<s>", 8)])
                    .build()
                    .unwrap(),
            ));
        }
        tok.save(dir.join("tokenizer.json"), false).unwrap();
    }

    fn write_json(dir: &Path, name: &str, value: Value) {
        std::fs::write(dir.join(name), value.to_string()).unwrap();
    }

    fn chatml_config() -> Value {
        json!({
            "added_tokens_decoder": {},
            "bos_token": {"__type": "AddedToken", "content": "<s>", "special": true},
            "eos_token": "<|im_end|>",
            "pad_token": "<pad>",
            "add_bos_token": true,
            "model_max_length": 32768,
            "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
        })
    }

    #[test]
    fn tokenizer_and_template_can_be_shared_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<ChatTemplate>();
    }

    #[test]
    fn missing_tokenizer_json_names_dir_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: no tokenizer.json", dir.path().display())), "{err}");
    }

    #[test]
    fn encode_adds_no_special_tokens_but_recognises_written_ones() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), true);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.encode("hello world").unwrap(), [1, 2]);
        assert_eq!(tok.encode("<|im_start|>user hello<|im_end|>").unwrap(), [11, 3, 1, 12]);
    }

    #[test]
    fn decode_can_skip_special_tokens() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.decode(&[8, 1, 2, 9], false).unwrap(), "<s> hello world </s>");
        assert_eq!(tok.decode(&[8, 1, 2, 9], true).unwrap(), "hello world");
        assert_eq!(tok.decode(&[1, 999], true).unwrap(), "hello", "unknown ids skipped");
    }

    #[test]
    fn decode_cleans_up_spaces_when_the_config_asks() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        write_json(dir.path(), "tokenizer_config.json", json!({"clean_up_tokenization_spaces": true}));
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.decode(&[7, 6, 1, 5], false).unwrap(), "it's hello!");
    }

    #[test]
    fn special_tokens_and_ids_come_from_tokenizer_config() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        write_json(dir.path(), "tokenizer_config.json", chatml_config());
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.bos_token(), Some("<s>"));
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
        assert_eq!(tok.bos_token_id(), Some(8));
        assert_eq!(tok.eos_token_id(), Some(12));
        assert_eq!(tok.pad_token_id(), Some(10));
        assert!(tok.add_bos_token());
        assert!(!tok.add_eos_token());
        assert_eq!(tok.model_max_length(), Some(32768));
        assert_eq!(tok.vocab_size(), 13);
        assert_eq!(tok.token_to_id("world"), Some(2));
        assert_eq!(tok.id_to_token(11).as_deref(), Some("<|im_start|>"));
    }

    #[test]
    fn huge_model_max_length_means_no_limit() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        // transformers writes int(1e30) as this integer literal.
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"model_max_length": 1000000000000000019884624838656}"#,
        )
        .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.model_max_length(), None);

        write_json(dir.path(), "tokenizer_config.json", json!({"model_max_length": "long"}));
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert!(err.ends_with("model_max_length: expected a positive integer, got a string (\"long\")"), "{err}");
    }

    #[test]
    fn special_tokens_map_fills_tokens_the_config_lacks() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        write_json(dir.path(), "tokenizer_config.json", json!({"added_tokens_decoder": {}, "eos_token": "</s>"}));
        write_json(
            dir.path(),
            "special_tokens_map.json",
            json!({"eos_token": "<|im_end|>", "pad_token": {"content": "<pad>"}}),
        );
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_token(), Some("</s>"), "config wins");
        assert_eq!(tok.pad_token(), Some("<pad>"), "map fills the gap");
    }

    #[test]
    fn legacy_config_lets_special_tokens_map_override() {
        // No added_tokens_decoder: transformers' legacy path.
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        write_json(dir.path(), "tokenizer_config.json", json!({"eos_token": "</s>"}));
        write_json(dir.path(), "special_tokens_map.json", json!({"eos_token": "<|im_end|>"}));
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert_eq!(tok.eos_token(), Some("<|im_end|>"));
    }

    #[test]
    fn bad_special_token_names_the_file_and_key() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        write_json(dir.path(), "tokenizer_config.json", json!({"eos_token": 5}));
        let err = Tokenizer::from_dir(dir.path()).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: eos_token: expected a string or an object with a string \"content\", got a number (5)",
                dir.path().join("tokenizer_config.json").display()
            )
        );
    }

    #[test]
    fn add_bos_token_defaults_to_what_the_post_processor_does() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), true);
        write_json(dir.path(), "tokenizer_config.json", json!({"bos_token": "<s>"}));
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert!(tok.add_bos_token());
        assert_eq!(tok.encode_prompt(&Prompt::Text("hello".into())).unwrap(), [8, 1]);

        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        write_json(dir.path(), "tokenizer_config.json", json!({"bos_token": "<s>"}));
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        assert!(!tok.add_bos_token());
        assert_eq!(tok.encode_prompt(&Prompt::Text("hello".into())).unwrap(), [1]);
    }

    #[test]
    fn encode_prompt_renders_messages_and_adds_bos_once() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        write_json(dir.path(), "tokenizer_config.json", chatml_config());
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let prompt = Prompt::Messages(vec![Message::new("user", "hello")]);
        assert_eq!(tok.encode_prompt(&prompt).unwrap(), [8, 11, 3, 1, 12, 11, 4]);
        // Text that already starts with BOS gets no second one.
        assert_eq!(tok.encode_prompt(&Prompt::Text("<s> hello".into())).unwrap(), [8, 1]);
    }

    #[test]
    fn chat_template_sees_the_special_tokens() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        write_json(
            dir.path(),
            "tokenizer_config.json",
            json!({"added_tokens_decoder": {}, "bos_token": "<s>", "eos_token": "</s>"}),
        );
        std::fs::write(
            dir.path().join(CHAT_TEMPLATE_FILE),
            "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}{{ unk_token is defined }}",
        )
        .unwrap();
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let text = tok.chat_template().unwrap().render(&[Message::new("user", "hello")], false).unwrap();
        assert_eq!(text, "<s>hello</s>False", "unset tokens stay undefined");
    }

    #[test]
    fn messages_without_a_chat_template_name_the_model_dir() {
        let dir = tempfile::tempdir().unwrap();
        write_tokenizer(dir.path(), false);
        let tok = Tokenizer::from_dir(dir.path()).unwrap();
        let err = tok.encode_prompt(&Prompt::Messages(vec![Message::new("user", "hello")])).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: the prompt is a list of chat messages", dir.path().display())), "{err}");
        assert!(err.contains("no chat template"), "{err}");
    }

    #[test]
    fn copy_tokenizer_files_copies_only_what_exists() {
        let src = tempfile::tempdir().unwrap();
        let dst = tempfile::tempdir().unwrap();
        write_tokenizer(src.path(), false);
        std::fs::write(src.path().join(CHAT_TEMPLATE_FILE), "t").unwrap();
        std::fs::write(src.path().join("model.safetensors"), "w").unwrap();
        let out = dst.path().join("saved");
        copy_tokenizer_files(src.path(), &out).unwrap();
        let mut names: Vec<String> =
            std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
        names.sort();
        assert_eq!(names, [CHAT_TEMPLATE_FILE, "tokenizer.json"]);
        Tokenizer::from_dir(&out).unwrap();
    }
}
