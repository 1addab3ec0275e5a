//! `rloo score` driven as a user runs it: the built binary on the fixture
//! models, compared with transformers' log-probs and scores; tokenization
//! compared with transformers' ids; and the errors for bad input.

mod common;

use std::path::{Path, PathBuf};

use common::*;
use rloo::data::{Prompt, Tokenizer};
use serde_json::Value;

const OUTPUTS: &[&str] = &["prompt_ids", "completion_ids", "logprobs", "sum_logprob", "score"];

fn expected_rows(name: &str) -> Vec<serde_json::Map<String, Value>> {
    let path = fixtures().join("score/expected").join(format!("{name}.jsonl"));
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap().as_object().unwrap().clone())
        .collect()
}

fn run_score(model: &Path, input: &Path, output: &Path) -> std::process::Output {
    rloo(&[
        "score",
        "--model",
        model.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--batch-size",
        "2",
    ])
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn tokenization_matches_transformers() {
    for name in MODELS {
        let tok = Tokenizer::from_dir(&model_dir(name)).unwrap();
        for row in expected_rows(name) {
            let prompt = Prompt::from_value(&row["prompt"]).unwrap();
            assert_eq!(
                tok.encode_prompt(&prompt).unwrap(),
                ids(&row["prompt_ids"]),
                "{name}: prompt ids of {prompt:?}"
            );
            let completion = row["completion"].as_str().unwrap();
            assert_eq!(tok.encode(completion).unwrap(), ids(&row["completion_ids"]), "{name}: completion ids");
        }
    }
}

/// A copy of a fixture whose config allows 512 positions: the references
/// score one row past the fixtures' 128, which rotary models compute like
/// any other but `rloo score` refuses as beyond the model's context.
fn long_context_copy(name: &str, root: &Path) -> PathBuf {
    let dir = root.join(format!("{name}-long"));
    std::fs::create_dir_all(&dir).unwrap();
    for entry in std::fs::read_dir(model_dir(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
    }
    let config = dir.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    let rotary = rloo::model::ModelConfig::from_dir(&model_dir(name)).unwrap().max_positions().is_none();
    if rotary {
        c["max_position_embeddings"] = 512.into();
    }
    std::fs::write(&config, c.to_string()).unwrap();
    dir
}

#[test]
fn score_matches_transformers_for_every_model() {
    let tmp = tempfile::tempdir().unwrap();
    for name in MODELS {
        let expected = expected_rows(name);
        let input = tmp.path().join(format!("{name}.in.jsonl"));
        let inputs: Vec<String> = expected
            .iter()
            .map(|row| {
                let mut row = row.clone();
                OUTPUTS.iter().for_each(|k| {
                    row.remove(*k);
                });
                serde_json::to_string(&row).unwrap()
            })
            .collect();
        std::fs::write(&input, inputs.join("\n") + "\n").unwrap();
        let output = tmp.path().join(format!("{name}.out.jsonl"));
        let run = run_score(&long_context_copy(name, tmp.path()), &input, &output);
        assert!(run.status.success(), "{name}: {}", String::from_utf8_lossy(&run.stderr));
        let got: Vec<Value> =
            std::fs::read_to_string(&output).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(got.len(), expected.len(), "{name}: row count");
        let mut worst = 0f64;
        for (g, e) in got.iter().zip(&expected) {
            assert_eq!(g["prompt"], e["prompt"], "{name}: input fields kept");
            assert_eq!(g["completion"], e["completion"]);
            if is_causal(name) {
                let (gl, el) = (g["logprobs"].as_array().unwrap(), e["logprobs"].as_array().unwrap());
                assert_eq!(gl.len(), el.len(), "{name}: one log-prob per completion token");
                for (a, b) in gl.iter().zip(el) {
                    worst = worst.max((a.as_f64().unwrap() - b.as_f64().unwrap()).abs());
                }
                let sum: f64 = gl.iter().map(|x| x.as_f64().unwrap()).sum();
                assert!((g["sum_logprob"].as_f64().unwrap() - sum).abs() < 1e-6);
                worst =
                    worst.max((g["sum_logprob"].as_f64().unwrap() - e["sum_logprob"].as_f64().unwrap()).abs() / 10.0);
            } else {
                worst = worst.max((g["score"].as_f64().unwrap() - e["score"].as_f64().unwrap()).abs());
            }
        }
        println!("{name}: {} rows, max |Δ| = {worst:.2e}", got.len());
        assert!(worst <= 1e-4, "{name}: max |Δ| = {worst}");
    }
}

#[test]
fn a_malformed_row_is_reported_with_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("bad.jsonl");
    std::fs::write(&input, "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": 3, \"completion\": \"b\"}\n")
        .unwrap();
    let output = tmp.path().join("out.jsonl");
    let run = run_score(&model_dir("gpt2-causal"), &input, &output);
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(err.contains("bad.jsonl:2") && err.contains("`prompt`"), "{err}");

    std::fs::write(&input, "{\"prompt\": \"a\", \"completion\": \"b\"}\nnot json\n").unwrap();
    let err = String::from_utf8_lossy(&run_score(&model_dir("gpt2-causal"), &input, &output).stderr).into_owned();
    assert!(err.contains("bad.jsonl:2"), "{err}");
}

#[test]
fn chat_prompts_need_a_chat_template() {
    let tmp = tempfile::tempdir().unwrap();
    let input = fixtures().join("score/rows_chat.jsonl");
    let run = run_score(&model_dir("gpt_neox-causal"), &input, &tmp.path().join("out.jsonl"));
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(err.contains("rows_chat.jsonl:1") && err.contains("chat template"), "{err}");
}

#[test]
fn a_missing_tokenizer_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(model_dir("gpt2-causal").join(f), dir.join(f)).unwrap();
    }
    let run = run_score(&dir, &fixtures().join("score/rows_plain.jsonl"), &tmp.path().join("out.jsonl"));
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(err.contains("tokenizer.json"), "{err}");
}

#[test]
fn unknown_options_and_missing_models_are_explained() {
    let run = rloo(&["score", "--modle", "x"]);
    assert_eq!(run.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&run.stderr).contains("--model"), "clap suggests the near match");

    let tmp = tempfile::tempdir().unwrap();
    let run = run_score(
        Path::new("no/such/model-dir"),
        &fixtures().join("score/rows_plain.jsonl"),
        &tmp.path().join("o.jsonl"),
    );
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(err.contains("no/such/model-dir"), "{err}");
}

/// `--bf16` scores the same rows within bf16's tolerance of the f32 scores.
#[test]
fn bf16_scores_are_close_to_f32() {
    let tmp = tempfile::tempdir().unwrap();
    let model = model_dir("qwen2-seqcls");
    let input = fixtures().join("score/rows_plain.jsonl");
    let scores = |extra: &[&str], out: &str| -> Vec<f64> {
        let output = tmp.path().join(out);
        let args = [&["score", "--model", model.to_str().unwrap(), "--input", input.to_str().unwrap()][..], extra];
        ok(rloo(&[&args.concat()[..], &["--output", output.to_str().unwrap()]].concat()));
        std::fs::read_to_string(&output)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<Value>(l).unwrap()["score"].as_f64().unwrap())
            .collect()
    };
    let (f32s, bf16s) = (scores(&[], "f32.jsonl"), scores(&["--bf16"], "bf16.jsonl"));
    assert_eq!(f32s.len(), bf16s.len());
    let scale = f32s.iter().fold(1.0f64, |m, s| m.max(s.abs()));
    for (a, b) in f32s.iter().zip(&bf16s) {
        assert!((a - b).abs() <= 6e-2 * scale, "f32 {a} vs bf16 {b}");
    }
    assert_ne!(f32s, bf16s, "bf16 computes differently");
}
