//! Training runs recorded once, kept to the bit: the same commands must give
//! the same weights, metrics and samples as `tests/fixtures/runs/*.json`
//! say. A record holds on the machine that made it (its CPU and thread
//! count are in it): another CPU's kernels may round differently, and a
//! sampled token then takes the run elsewhere, so there the comparison is
//! skipped with a message. `RECORD_RUNS=1` rewrites the records, for a
//! change that is meant to change the numbers.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use serde_json::{json, Map, Value};

const THREADS: &str = "2";

/// What the record depends on besides the code: the CPU's model and the
/// instruction sets its kernels pick from, and the thread count.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map_or("?", |m| m.trim_start_matches([' ', '\t', ':']));
    #[cfg(target_arch = "x86_64")]
    let features = format!(
        "avx512f={} avx2={} fma={}",
        is_x86_feature_detected!("avx512f"),
        is_x86_feature_detected!("avx2"),
        is_x86_feature_detected!("fma")
    );
    #[cfg(not(target_arch = "x86_64"))]
    let features = std::env::consts::ARCH.to_string();
    format!("{model}; {features}; {THREADS} threads")
}

/// FNV-1a, 64 bits: enough to tell two files apart.
fn digest(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    format!("{h:016x}")
}

fn prompts(dir: &Path) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    let rows: String =
        ["The movie was", "Tomorrow the weather will be", "I think the film", "We cooked", "The music was"]
            .iter()
            .map(|p| format!("{}\n", json!({ "prompt": p })))
            .collect();
    std::fs::write(&path, rows).unwrap();
    path
}

/// Runs `rloo train` with `args` on the fixture policy and a rule reward,
/// and compares (or records) its weights, metrics and samples.
fn recorded(name: &str, args: &[&str], weights: &[&str]) {
    let record_path = fixtures().join("runs").join(format!("{name}.json"));
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompts(tmp.path());
    let out = tmp.path().join("run");
    let policy = model_dir("gpt_neox-causal");
    let mut command = vec![
        "train",
        "--sft_model_path",
        policy.to_str().unwrap(),
        "--dataset_name",
        prompts.to_str().unwrap(),
        "--output_dir",
        out.to_str().unwrap(),
        "--set",
        "reward=[{type=\"count\", substring=\"e\"}, {type=\"length\", weight=0.05}]",
        "--response_length",
        "12",
        "--learning_rate",
        "3e-3",
        "--device",
        "cpu",
    ];
    command.extend_from_slice(args);
    ok(Command::new(env!("CARGO_BIN_EXE_rloo")).args(&command).env("RAYON_NUM_THREADS", THREADS).output().unwrap());

    let files: Map<String, Value> =
        weights.iter().chain(&["samples.jsonl"]).map(|f| (f.to_string(), json!(digest(&out.join(f))))).collect();
    let metrics: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut row: Map<String, Value> = serde_json::from_str(l).unwrap();
            // Timings and memory are the only values that may differ.
            row.retain(|k, _| !k.starts_with("time/") && !k.starts_with("memory/") && k != "eps");
            Value::Object(row)
        })
        .collect();
    let run = json!({"machine": machine(), "args": args, "files": files, "metrics": metrics});
    if std::env::var_os("RECORD_RUNS").is_some() {
        std::fs::create_dir_all(record_path.parent().unwrap()).unwrap();
        std::fs::write(&record_path, serde_json::to_string_pretty(&run).unwrap() + "\n").unwrap();
        return;
    }
    let record: Value = serde_json::from_str(&std::fs::read_to_string(&record_path).unwrap()).unwrap();
    assert_eq!(record["args"], run["args"], "{name}: the record is of other options; rerun with RECORD_RUNS=1");
    if record["machine"] != run["machine"] {
        eprintln!("skipped: {name} was recorded on `{}`, this is `{}`", record["machine"], run["machine"]);
        return;
    }
    for (i, (want, got)) in record["metrics"].as_array().unwrap().iter().zip(metrics.iter()).enumerate() {
        assert_eq!(want, got, "{name}: step {} metrics", i + 1);
    }
    assert_eq!(record["metrics"].as_array().unwrap().len(), metrics.len(), "{name}: steps");
    assert_eq!(record["files"], run["files"], "{name}: weights or samples");
}

#[test]
fn rloo_with_its_defaults_is_as_recorded() {
    recorded(
        "rloo",
        &["--total_episodes", "40", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"],
        &["model.safetensors"],
    );
}

#[test]
fn rloo_with_other_options_is_as_recorded() {
    recorded(
        "rloo_options",
        &[
            "--total_episodes",
            "48",
            "--rloo_k",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--num_mini_batches",
            "2",
            "--num_ppo_epochs",
            "2",
            "--kl_estimator",
            "k3",
            "--kl_placement",
            "loss",
            "--ratio",
            "token",
            "--aggregation",
            "token_mean",
            "--normalize_advantage",
            "--missing_eos_penalty",
            "0.5",
            "--epsilon_high",
            "0.28",
            "--baseline",
            "batch_mean",
        ],
        &["model.safetensors"],
    );
}

#[test]
fn ppo_is_as_recorded() {
    recorded(
        "ppo",
        &[
            "--algo",
            "ppo",
            "--rloo_k",
            "1",
            "--total_episodes",
            "32",
            "--per_device_train_batch_size",
            "4",
            "--gradient_accumulation_steps",
            "2",
            "--num_ppo_epochs",
            "2",
            "--vf_coef",
            "0.5",
            "--whiten_rewards",
        ],
        &["model.safetensors", "critic/model.safetensors"],
    );
}
