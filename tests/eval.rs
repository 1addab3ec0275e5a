//! `rloo eval`: two models, rule and model rewards, KL and win rate.

mod common;

use std::process::Command;

use common::*;

#[test]
fn eval_reports_rewards_kl_and_win_rate() {
    let tmp = tempfile::tempdir().unwrap();
    let rewards = tmp.path().join("rewards.toml");
    std::fs::write(&rewards, "[[reward]]\ntype = \"count\"\nsubstring = \"e\"\n").unwrap();
    let out = tmp.path().join("eval.json");
    let policy = model_dir("gpt_neox-causal");
    let run = Command::new(env!("CARGO_BIN_EXE_rloo"))
        .args(["eval", "--prompts", fixtures().join("score/rows_plain.jsonl").to_str().unwrap()])
        .args(["--model", policy.to_str().unwrap(), "--model-b", policy.to_str().unwrap()])
        .args(["--reference", policy.to_str().unwrap(), "--rewards", rewards.to_str().unwrap()])
        .args(["--reward-model", model_dir("gpt_neox-seqcls").to_str().unwrap(), "--samples-per-prompt", "2"])
        .args(["--max-new-tokens", "8", "--device", "cpu", "--output", out.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let a = &report["models"][0];
    assert!(a["reward"]["mean"].is_f64() && a["length"]["mean"].as_f64().unwrap() > 0.0);
    assert_eq!(a["rewards"][0][0], "count");
    // A model against itself, with the same seed: zero KL, the same samples, a 0.5 win rate.
    assert!(a["kl"]["mean"].as_f64().unwrap().abs() < 1e-4);
    assert_eq!(report["win_rate_a_over_b"].as_f64().unwrap(), 0.5);
    let table = String::from_utf8_lossy(&run.stdout);
    assert!(table.contains("KL to reference") && table.contains("win rate"), "{table}");
}
