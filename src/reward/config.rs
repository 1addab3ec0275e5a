//! The `[[reward]]` tables of a config file: one table per reward source,
//! told apart by `type`, and [`build`], which validates them and loads what
//! they name into a [`RewardSet`].
//!
//! ```toml
//! [[reward]]
//! type = "model"          # a *ForSequenceClassification checkpoint
//! path = "runs/rm"        # directory or hub id
//! weight = 1.0
//! batch_size = 16
//!
//! [[reward]]
//! type = "lexicon"
//! name = "sentiment"      # optional; defaults to the type
//! positive = ["great", "good"]
//! negative = ["bad", "boring"]
//! weight = 0.5
//! ```
//!
//! Sources outside the trainer:
//!
//! ```toml
//! [[reward]]
//! type = "command"        # a process speaking JSON lines on stdin/stdout
//! command = ["python3", "score.py"]
//!
//! [[reward]]
//! type = "http"           # POST {"prompts", "completions", "rows"}
//! url = "http://127.0.0.1:8000/score"
//! api_key_env = "SCORER_TOKEN"
//!
//! [[reward]]
//! type = "judge"          # an OpenAI-compatible chat endpoint
//! url = "http://127.0.0.1:8000/v1"
//! model = "nvidia/Llama-3_3-Nemotron-Super-49B-GenRM-Multilingual"
//! mode = "pairwise"
//! ```
//!
//! Every table takes `name` (used in the metrics as `rewards/<name>/mean`;
//! default: the type; names must be unique) and `weight` (default 1.0; the
//! score is `sum_j weight_j * reward_j`). Unknown keys are errors, so that a
//! misspelt option never silently falls back to its default. Relative file
//! paths are read from the current directory.
//!
//! Each source's table lives in the source's file and implements
//! [`RewardTable`]; adding a source is that file and one line in
//! [`reward_types!`]'s list below.

use std::path::Path;

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};

use super::combine::RewardSet;
use super::RewardSource;
use crate::error::{Error, Result};

pub use super::command::CommandSpec;
pub use super::http::HttpSpec;
pub use super::judge::JudgeSpec;
pub use super::model::ModelSpec;
use super::rules::LengthUnit;
pub use super::rules::{CountSpec, ExactMatchSpec, LengthSpec, LexiconSpec};

/// What every `[[reward]]` table gives: its metric name and weight, and the
/// source it describes.
pub trait RewardTable {
    /// `name`, when the table sets it.
    fn name(&self) -> Option<&str>;
    /// Weight in the total score.
    fn weight(&self) -> f32;
    /// Checks the options and makes the source (reward models are loaded
    /// onto `device`, computing in `dtype`); errors carry no table prefix
    /// ([`build`] adds it).
    fn build(&self, name: String, device: &Device, dtype: DType) -> Result<Box<dyn RewardSource>>;
}

/// The registry: one line per source, `type` value => variant(table).
macro_rules! reward_types {
    ($($(#[doc = $doc:literal])* $ty:literal => $variant:ident($spec:ty),)*) => {
        /// One `[[reward]]` table, told apart by `type`.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(tag = "type")]
        pub enum RewardSpec {
            $($(#[doc = $doc])* #[serde(rename = $ty)] $variant($spec),)*
        }

        /// The values of `type`, in the order of [`RewardSpec`]'s variants.
        pub const REWARD_TYPES: &[&str] = &[$($ty),*];

        impl RewardSpec {
            /// The `type` value.
            pub fn type_name(&self) -> &'static str {
                match self {
                    $(RewardSpec::$variant(_) => $ty,)*
                }
            }

            fn table(&self) -> &dyn RewardTable {
                match self {
                    $(RewardSpec::$variant(table) => table,)*
                }
            }
        }
    };
}

reward_types! {
    /// A reward model's score.
    "model" => Model(ModelSpec),
    /// The completion's length, or its distance to a target length.
    "length" => Length(LengthSpec),
    /// Occurrences of a regex or substring.
    "count" => Count(CountSpec),
    /// Positive minus negative words.
    "lexicon" => Lexicon(LexiconSpec),
    /// 1 when the completion equals a dataset column, else 0.
    "exact_match" => ExactMatch(ExactMatchSpec),
    /// A process that scores batches over JSON lines.
    "command" => Command(CommandSpec),
    /// A scoring service over HTTP.
    "http" => Http(HttpSpec),
    /// An LLM judge behind an OpenAI-compatible chat endpoint.
    "judge" => Judge(JudgeSpec),
}

impl RewardSpec {
    /// The metric name: `name`, or the type.
    pub fn name(&self) -> &str {
        self.table().name().unwrap_or(self.type_name())
    }

    pub fn weight(&self) -> f32 {
        self.table().weight()
    }
}

/// The default of every table's `weight`.
pub(super) fn one() -> f32 {
    1.0
}

pub(super) fn finite(key: &str, x: f32) -> Result<()> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(Error::Invalid(format!("{key} must be a finite number, got {x}")))
    }
}

/// Checks a metric name: it becomes a path segment of `rewards/<name>/mean`.
fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'));
    if ok {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "name `{name}` must be non-empty and use only ASCII letters, digits, `_`, `-` and \
             `.` (it becomes part of the metric names rewards/<name>/mean and /std)"
        )))
    }
}

/// The built-in rule rewards `--reward_funcs` names, each with its default
/// options: `length` (the completion's length in tokens) and `exact_match`
/// (the last number of the completion against the last number of the row's
/// `answer` column, as in GSM8K).
pub const BUILTIN_REWARD_FUNCS: &[&str] = &["length", "exact_match"];

/// TRL 1.x's `reward_funcs` and `reward_weights` as `[[reward]]` tables:
/// each function is a built-in rule's name or a reward model (a directory
/// or a cached hub id), named by its last path component as TRL logs it;
/// weights default to 1.
pub fn reward_funcs(funcs: &[String], weights: Option<&[f32]>) -> Result<Vec<RewardSpec>> {
    if let Some(w) = weights.filter(|w| w.len() != funcs.len()) {
        return Err(Error::Invalid(format!(
            "--reward_weights gives {} weights for {} --reward_funcs: give one per function",
            w.len(),
            funcs.len()
        )));
    }
    let mut specs = Vec::with_capacity(funcs.len());
    for (i, func) in funcs.iter().enumerate() {
        let weight = weights.map_or(1.0, |w| w[i]);
        let spec = match func.as_str() {
            "length" => RewardSpec::Length(LengthSpec {
                name: None,
                weight,
                unit: LengthUnit::default(),
                target: None,
                scale: 1.0,
            }),
            "exact_match" => RewardSpec::ExactMatch(ExactMatchSpec {
                name: None,
                weight,
                column: "answer".into(),
                case_insensitive: false,
                marker: None,
                last_number: true,
            }),
            path if Path::new(path).exists() || path.contains('/') => {
                let name = path.trim_end_matches('/').rsplit('/').next().unwrap_or(path);
                RewardSpec::Model(ModelSpec {
                    name: Some(name.to_string()),
                    weight,
                    path: path.to_string(),
                    batch_size: super::model::default_batch_size(),
                })
            }
            other => {
                return Err(Error::Invalid(format!(
                    "--reward_funcs: `{other}` is neither a built-in rule ({}) nor a reward model directory",
                    BUILTIN_REWARD_FUNCS.join(", ")
                )))
            }
        };
        specs.push(spec);
    }
    Ok(specs)
}

/// Validates the `[[reward]]` tables and builds the weighted sources, loading
/// reward models onto `device` to compute in `dtype` (their scores are f32
/// either way). Errors name the table (`reward #2`, counted from 1 in file
/// order) and the option at fault.
pub fn build(specs: &[RewardSpec], device: &Device, dtype: DType) -> Result<RewardSet> {
    if specs.is_empty() {
        return Err(Error::Invalid(format!(
            "no reward: add at least one [[reward]] table with a type ({})",
            REWARD_TYPES.join(", ")
        )));
    }
    // Cheap checks on every table first, so that a typo in the last table is
    // reported before a reward model is loaded.
    for (i, spec) in specs.iter().enumerate() {
        let at = |msg: String| Error::Invalid(format!("reward #{} ({}): {msg}", i + 1, spec.type_name()));
        check_name(spec.name()).map_err(|e| at(e.to_string()))?;
        finite("weight", spec.weight()).map_err(|e| at(e.to_string()))?;
        if let Some(j) = specs[..i].iter().position(|s| s.name() == spec.name()) {
            return Err(at(format!(
                "name `{}` is already used by reward #{}; give one of them a distinct `name`",
                spec.name(),
                j + 1
            )));
        }
    }
    let mut set = RewardSet::new();
    for (i, spec) in specs.iter().enumerate() {
        let source = spec
            .table()
            .build(spec.name().to_string(), device, dtype)
            .map_err(|e| Error::Invalid(format!("reward #{} ({} `{}`): {e}", i + 1, spec.type_name(), spec.name())))?;
        set.push(source, spec.weight())?;
    }
    Ok(set)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reward::test_support::*;
    use serde_json::{json, Value};

    #[test]
    fn reward_funcs_are_rules_by_name_and_models_by_path() {
        let funcs = ["length".to_string(), "exact_match".into(), "models/rm-a/".into(), "org/rm-b".into()];
        let specs = reward_funcs(&funcs, Some(&[0.1, 1.0, 2.0, -1.0])).unwrap();
        let names: Vec<&str> = specs.iter().map(RewardSpec::name).collect();
        assert_eq!(names, ["length", "exact_match", "rm-a", "rm-b"]);
        assert!(matches!(&specs[2], RewardSpec::Model(m) if m.path == "models/rm-a/" && m.weight == 2.0));
        assert!(matches!(&specs[0], RewardSpec::Length(l) if l.weight == 0.1));
        let err = reward_funcs(&funcs, Some(&[1.0])).unwrap_err().to_string();
        assert!(err.contains("1 weights for 4 --reward_funcs"), "{err}");
        let err = reward_funcs(&["lenght".into()], None).unwrap_err().to_string();
        assert!(err.contains("`lenght` is neither a built-in rule (length, exact_match)"), "{err}");
    }

    fn parse(v: Value) -> std::result::Result<Vec<RewardSpec>, String> {
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    fn build_err(v: Value) -> String {
        let specs = parse(v).unwrap();
        match build(&specs, &Device::Cpu, DType::F32) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn tables_parse_with_defaults() {
        let specs = parse(json!([
            {"type": "model", "path": "runs/rm"},
            {"type": "lexicon", "name": "sentiment", "positive": ["good"], "weight": 0.5},
            {"type": "length", "unit": "chars", "target": 100},
            {"type": "count", "substring": "!", "max": 3, "weight": -1},
            {"type": "exact_match", "column": "answer", "marker": "####", "last_number": true},
        ]))
        .unwrap();
        assert_eq!(
            specs[0],
            RewardSpec::Model(ModelSpec { name: None, weight: 1.0, path: "runs/rm".into(), batch_size: 8 })
        );
        assert_eq!(
            specs.iter().map(RewardSpec::name).collect::<Vec<_>>(),
            ["model", "sentiment", "length", "count", "exact_match"]
        );
        assert_eq!(specs.iter().map(RewardSpec::weight).collect::<Vec<_>>(), [1.0, 0.5, 1.0, -1.0, 1.0]);
        assert_eq!(
            specs[2],
            RewardSpec::Length(LengthSpec {
                name: None,
                weight: 1.0,
                unit: LengthUnit::Chars,
                target: Some(100.0),
                scale: 1.0
            })
        );
    }

    #[test]
    fn reward_types_are_the_variants_in_order() {
        for t in REWARD_TYPES {
            // Parsing may still fail on a missing required key.
            let err = parse(json!([{"type": t}])).err().unwrap_or_default();
            assert!(!err.contains("unknown variant"), "{t}: {err}");
        }
        let listed: Vec<String> = REWARD_TYPES.iter().map(|t| format!("`{t}`")).collect();
        assert_eq!(
            parse(json!([{"type": "nope"}])).unwrap_err(),
            format!("unknown variant `nope`, expected one of {}", listed.join(", "))
        );
    }

    #[test]
    fn unknown_types_and_keys_are_errors_that_list_the_known_ones() {
        assert_eq!(
            parse(json!([{"type": "sentiment"}])).unwrap_err(),
            "unknown variant `sentiment`, expected one of `model`, `length`, `count`, \
             `lexicon`, `exact_match`, `command`, `http`, `judge`"
        );
        assert_eq!(
            parse(json!([{"type": "lexicon", "postive": ["good"]}])).unwrap_err(),
            "unknown field `postive`, expected one of `name`, `weight`, `positive`, \
             `negative`, `positive_file`, `negative_file`, `normalize`"
        );
        assert_eq!(parse(json!([{"path": "rm"}])).unwrap_err(), "missing field `type`");
        assert_eq!(parse(json!([{"type": "exact_match"}])).unwrap_err(), "missing field `column`");
        assert_eq!(
            parse(json!([{"type": "length", "unit": "words"}])).unwrap_err(),
            "unknown variant `words`, expected `tokens` or `chars`"
        );
    }

    #[test]
    fn build_errors_name_the_table_and_the_option() {
        assert_eq!(
            build_err(json!([])),
            "no reward: add at least one [[reward]] table with a type (model, length, count, \
             lexicon, exact_match, command, http, judge)"
        );
        let err = build_err(json!([
            {"type": "length"},
            {"type": "count", "pattern": "(oops"}
        ]));
        assert!(err.starts_with("reward #2 (count `count`): pattern `(oops` is not a valid regex: "), "{err}");
        assert_eq!(
            build_err(json!([{"type": "count"}])),
            "reward #1 (count `count`): give `pattern` (a regex) or `substring` (literal text) \
             to count"
        );
        assert_eq!(
            build_err(json!([{"type": "count", "pattern": "a", "substring": "a"}])),
            "reward #1 (count `count`): give either `pattern` (a regex) or `substring` \
             (literal text), not both"
        );
        assert_eq!(
            build_err(json!([{"type": "length", "target": -3}])),
            "reward #1 (length `length`): target must be a length >= 0, got -3"
        );
        assert_eq!(
            build_err(json!([{"type": "model", "path": "x", "batch_size": 0}])),
            "reward #1 (model `model`): batch_size must be at least 1"
        );
    }

    #[test]
    fn duplicate_and_malformed_names_are_errors() {
        assert_eq!(
            build_err(json!([
                {"type": "length"},
                {"type": "count", "substring": "!"},
                {"type": "length", "unit": "chars"}
            ])),
            "reward #3 (length): name `length` is already used by reward #1; give one of them \
             a distinct `name`"
        );
        assert_eq!(
            build_err(json!([{"type": "length", "name": "a/b"}])),
            "reward #1 (length): name `a/b` must be non-empty and use only ASCII letters, \
             digits, `_`, `-` and `.` (it becomes part of the metric names rewards/<name>/mean \
             and /std)"
        );
    }

    #[test]
    fn duplicate_names_are_reported_before_any_model_is_loaded() {
        // The model path does not exist: the name clash must win.
        let err = build_err(json!([
            {"type": "model", "path": "/no/such/rm"},
            {"type": "model", "path": "/no/such/rm2"}
        ]));
        assert!(err.starts_with("reward #2 (model): name `model`"), "{err}");
    }

    #[test]
    fn missing_word_files_and_model_dirs_are_named() {
        let err = build_err(json!([
            {"type": "lexicon", "positive_file": "/no/such/pos.txt"}
        ]));
        assert!(err.starts_with("reward #1 (lexicon `lexicon`): positive_file: /no/such/pos.txt: "), "{err}");
        let err = build_err(json!([{"type": "model", "path": "./no/such/rm"}]));
        assert_eq!(
            err,
            "reward #1 (model `model`): ./no/such/rm: no such directory, and not a hub id of \
             the form owner/name[@revision]"
        );
    }

    #[test]
    fn a_causal_model_path_is_rejected_in_build() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models/gpt2-causal");
        let err = build_err(json!([{"type": "model", "path": dir}]));
        assert!(
            err.starts_with(&format!(
                "reward #1 (model `model`): {}: is a causal language model (GPT2LMHeadModel)",
                dir.display()
            )),
            "{err}"
        );
    }

    #[test]
    fn built_set_scores_with_weights_and_files() {
        let dir = tempfile::tempdir().unwrap();
        let neg = dir.path().join("neg.txt");
        std::fs::write(&neg, "; negative words\nbad\nboring\n").unwrap();
        let specs = parse(json!([
            {"type": "lexicon", "name": "sentiment", "positive": ["good"],
             "negative_file": neg, "weight": 0.5},
            {"type": "count", "name": "shouting", "substring": "!", "weight": -1},
            {"type": "length", "unit": "chars", "target": 4, "weight": 0.1}
        ]))
        .unwrap();
        let set = build(&specs, &Device::Cpu, DType::F32).unwrap();
        assert_eq!(set.names(), ["sentiment", "shouting", "length"]);
        assert_eq!(set.weights(), [0.5, -1.0, 0.1]);
        let owned = completions(&["good!", "bad, boring"]);
        let scores = set.score(&samples(&owned)).unwrap();
        // 0.5 * 1 - 1 * 1 + 0.1 * -1; 0.5 * -2 - 0 + 0.1 * -7.
        let want = [-0.6f32, -1.7];
        for (got, want) in scores.total.iter().zip(want) {
            assert!((got.unwrap() - want).abs() < 1e-6, "{:?}", scores.total);
        }
    }

    #[test]
    fn specs_round_trip_through_serialisation() {
        let specs = parse(json!([
            {"type": "exact_match", "name": "gsm8k", "column": "answer", "marker": "####"},
            {"type": "length", "target": 50, "scale": 0.01}
        ]))
        .unwrap();
        let back: Vec<RewardSpec> = serde_json::from_value(serde_json::to_value(&specs).unwrap()).unwrap();
        assert_eq!(back, specs);
    }
}
