//! `rloo reward train`: a reward model learned from preference pairs,
//! starting from a causal LM (a new score head), saved as a
//! sequence-classification directory.

mod common;

use std::process::Command;

use candle_core::Device;
use common::*;
use rloo::model::{HeadKind, Model};
use serde_json::json;

/// Trains on 40 pairs preferring praise, with `extra` flags; gives the
/// output directory and the held-out metrics of the last epoch.
fn train_on_praise(tmp: &std::path::Path, extra: &[&str]) -> (std::path::PathBuf, serde_json::Value) {
    let out = tmp.join("rm");
    let run = praise_run(tmp, &out, extra);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let last = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().last().unwrap().to_string();
    let last: serde_json::Value = serde_json::from_str(&last).unwrap();
    println!("held-out: {last}");
    assert!(last["eval/accuracy"].as_f64().unwrap() >= 0.9);
    (out, last)
}

/// `rloo reward train` on 40 pairs preferring praise, into `out`.
fn praise_run(tmp: &std::path::Path, out: &std::path::Path, extra: &[&str]) -> std::process::Output {
    let good = ["wonderful", "great", "lovely", "brilliant"];
    let bad = ["boring", "awful", "dull", "terrible"];
    let rows: Vec<String> = (0..40)
        .map(|i| {
            json!({"prompt": format!("Review {i}:"), "chosen": format!(" It was {}.", good[i % 4]), "rejected": format!(" It was {}.", bad[(i / 4) % 4])})
                .to_string()
        })
        .collect();
    let data = tmp.join("pairs.jsonl");
    std::fs::write(&data, rows.join("\n")).unwrap();
    Command::new(env!("CARGO_BIN_EXE_rloo"))
        .args(["reward", "train", "--model", model_dir("gpt_neox-causal").to_str().unwrap()])
        .args(["--dataset", data.to_str().unwrap(), "--output-dir", out.to_str().unwrap()])
        .args(["--num-train-epochs", "4", "--eval-fraction", "0.25", "--device", "cpu"])
        .args(extra)
        .env("RAYON_NUM_THREADS", "2")
        .output()
        .unwrap()
}

/// A run stopped part-way and resumed gives the uninterrupted run's
/// weights (the new score head's included) and metrics, with and without
/// LoRA adapters.
#[test]
fn a_stopped_reward_model_run_resumes_to_the_uninterrupted_runs_weights_and_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = ["--use_peft", "--lora_r", "8", "--lora_target_modules", "all-linear", "--learning-rate", "1e-2"];
    for (name, extra, weights) in [
        ("full", &["--learning-rate", "1e-3"][..], "model.safetensors"),
        ("lora", &lora[..], "adapter_model.safetensors"),
    ] {
        let (whole, parts) = (tmp.path().join(format!("{name}-whole")), tmp.path().join(format!("{name}-parts")));
        let run = |out: &std::path::Path, more: &[&str]| {
            let done = praise_run(tmp.path(), out, &[extra, more].concat());
            assert!(done.status.success(), "{name}: {}", String::from_utf8_lossy(&done.stderr));
        };
        run(&whole, &[]);
        run(&parts, &["--stop_after", "5"]);
        assert!(parts.join("checkpoint-5/reward_config.toml").is_file() && !parts.join(weights).exists());
        run(&parts, &["--resume_from_checkpoint", "latest"]);
        let read = |dir: &std::path::Path, file: &str| std::fs::read(dir.join(file)).unwrap();
        assert!(read(&whole, weights) == read(&parts, weights), "{name}: the resumed weights differ");
        assert!(read(&whole, "metrics.jsonl") == read(&parts, "metrics.jsonl"), "{name}: the metrics differ");
    }
}

#[test]
fn preferences_are_learned_and_saved_as_a_reward_model() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, last) = train_on_praise(tmp.path(), &["--learning-rate", "1e-3"]);
    assert!(last["eval/margin"].as_f64().unwrap() > 0.5);

    let rm = Model::load(&out, &Device::Cpu).unwrap();
    assert_eq!(rm.head(), HeadKind::SequenceClassification { num_labels: 1 });
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["architectures"][0], "GPTNeoXForSequenceClassification");
    assert!(config["pad_token_id"].is_u64(), "transformers needs pad_token_id to score batches");
}

/// With --use_peft the reward model is LoRA adapters plus its score head
/// (PEFT's modules_to_save), saved as a SEQ_CLS adapter that loads as a
/// reward model.
#[test]
fn lora_reward_training_saves_the_head_beside_the_adapters() {
    let tmp = tempfile::tempdir().unwrap();
    let lora = ["--use_peft", "--lora_r", "8", "--lora_target_modules", "all-linear"];
    let (out, _) = train_on_praise(tmp.path(), &[&["--learning-rate", "1e-2"][..], &lora].concat());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!((config["task_type"].as_str(), config["modules_to_save"][0].as_str()), (Some("SEQ_CLS"), Some("score")));
    let saved = candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    assert!(saved.contains_key("base_model.model.score.weight"), "{:?}", saved.keys());
    let rm = Model::load(&out, &Device::Cpu).unwrap();
    assert_eq!(rm.head(), HeadKind::SequenceClassification { num_labels: 1 });
}

#[test]
fn malformed_pairs_name_the_row() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("pairs.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n{\"prompt\": \"a\", \"chosen\": \"b\"}\n",
    )
    .unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_rloo"))
        .args([
            "reward",
            "train",
            "--model",
            model_dir("gpt_neox-causal").to_str().unwrap(),
            "--dataset",
            data.to_str().unwrap(),
        ])
        .args(["--output-dir", tmp.path().join("rm").to_str().unwrap(), "--device", "cpu"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    assert!(err.contains("pairs.jsonl:2") && err.contains("`rejected`"), "{err}");
}
