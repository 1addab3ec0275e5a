//! `rloo train` run as users run it: learning on a rule reward, resume
//! equivalence, the seed 001 command with local paths, and the errors for
//! bad input.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::{json, Value};

fn write_prompts(dir: &Path) -> String {
    let path = dir.join("prompts.jsonl");
    let prompts = [
        "The movie was",
        "Tomorrow the weather will be",
        "To make a simple tomato soup,",
        "I think the film",
        "The music was",
        "We cooked",
    ];
    let rows: Vec<String> = prompts.iter().map(|p| serde_json::json!({ "prompt": p }).to_string()).collect();
    std::fs::write(&path, rows.join("\n") + "\n").unwrap();
    path.to_str().unwrap().to_string()
}

fn metrics(dir: &Path) -> Vec<serde_json::Map<String, Value>> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap().as_object().unwrap().clone())
        .collect()
}

fn policy() -> String {
    model_dir("gpt_neox-causal").to_str().unwrap().to_string()
}

/// A short run of a rule reward ("count the letter e") on the committed tiny
/// policy, with `algo`'s options: the reward's mean rises clearly, the KL
/// stays bounded. Gives the metrics' rows.
fn learning_run(out: &Path, algo: &[&str]) -> Vec<serde_json::Map<String, Value>> {
    let prompts = write_prompts(out.parent().unwrap());
    let mut args = vec![
        "train",
        "--model_name_or_path",
        &policy(),
        "--dataset_name",
        &prompts,
        "--output_dir",
        out.to_str().unwrap(),
        "--set",
        "reward=[{type=\"count\", substring=\"e\"}]",
        "--total_episodes",
        "640",
        "--per_device_train_batch_size",
        "16",
        "--response_length",
        "16",
        "--num_ppo_epochs",
        "1",
        "--kl_coef",
        "0.1",
        "--num_sample_generations",
        "0",
        "--device",
        "cpu",
    ]
    .into_iter()
    .map(String::from)
    .collect::<Vec<_>>();
    args.extend(algo.iter().map(|a| a.to_string()));
    ok(rloo(&args.iter().map(String::as_str).collect::<Vec<_>>()));
    let rows = metrics(out);
    assert_eq!(rows.len(), 40);
    let mean = |rows: &[serde_json::Map<String, Value>], key: &str| {
        rows.iter().map(|r| r[key].as_f64().unwrap()).sum::<f64>() / rows.len() as f64
    };
    let (first, last) = (mean(&rows[..5], "objective/scores"), mean(&rows[35..], "objective/scores"));
    let kl = rows.iter().map(|r| r["objective/kl"].as_f64().unwrap()).fold(0.0, f64::max);
    for r in &rows {
        println!(
            "step {:>2} reward {:.2} kl {:.3}",
            r["step"],
            r["objective/scores"].as_f64().unwrap(),
            r["objective/kl"].as_f64().unwrap()
        );
    }
    println!("reward {first:.2} -> {last:.2}, max KL {kl:.2}");
    assert!(last > first + 1.0, "reward did not rise: {first} -> {last}");
    assert!(kl < 16.0, "KL per sequence of 16 tokens should stay below one nat per token, got {kl}");
    let weights = ["model.safetensors", "adapter_model.safetensors"];
    assert!(weights.iter().any(|w| out.join(w).is_file()) && out.join("rloo_config.toml").is_file());
    assert!(std::fs::read_dir(out.join("tensorboard")).unwrap().count() > 0);
    rows
}

#[test]
fn a_rule_reward_rises_within_a_short_run() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = learning_run(&tmp.path().join("run"), &["--rloo_k", "4", "--learning_rate", "2e-3"]);
    // Every docs/algorithm.md section 6 metric is logged.
    for key in [
        "objective/scores",
        "objective/kl",
        "objective/non_score_reward",
        "objective/rlhf_reward",
        "objective/entropy",
        "policy/entropy_avg",
        "policy/approxkl_avg",
        "policy/clipfrac_avg",
        "loss/policy_avg",
        "val/ratio",
        "val/ratio_var",
        "val/num_eos_tokens",
        "rewards/count/mean",
        "rewards/count/std",
        "completions/mean_length",
        "completions/clipped_ratio",
        "lr",
        "episode",
        "eps",
        "grad_norm",
        "time/generation",
        "time/scoring",
        "time/reference",
        "time/scoring_and_reference",
        "time/training",
        "time/training_forward",
        "time/training_backward",
        "time/training_forward_queued",
        "time/training_backward_queued",
        "time/advantages",
        "time/metrics",
    ] {
        assert!(rows[0].contains_key(key), "metric {key} missing");
    }
    for part in ["forward", "backward"] {
        let seconds = |name: String| rows[0][&name].as_f64().unwrap();
        let (queued, whole) =
            (seconds(format!("time/training_{part}_queued")), seconds(format!("time/training_{part}")));
        assert!(queued <= whole, "{part}: queued {queued} of {whole} s");
    }
    // The first micro-batch's forward kept its activations, at most what the forwards held.
    let gib = |key: &str| rows[0][key].as_f64().unwrap_or_else(|| panic!("metric {key} missing"));
    let kept = gib("memory/activations_gib");
    assert!(kept > 0.0, "the forward kept {kept} GiB");
    assert!(gib("memory/held_before_training_gib") + kept <= gib("memory/held_after_forward_gib") + 1e-9);
}

/// PPO learns the same reward with one completion per prompt, logs TRL's
/// PPO metrics, and saves its critic as a one-label sequence classifier.
#[test]
fn ppo_learns_a_rule_reward_and_saves_its_critic() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let rows = learning_run(&out, &["--algo", "ppo", "--rloo_k", "1", "--vf_coef", "0.5", "--learning_rate", "2e-3"]);
    for key in
        ["loss/value_avg", "val/clipfrac_avg", "val/vpred", "val/error", "loss/policy_avg", "objective/rlhf_reward"]
    {
        assert!(rows.iter().all(|r| r[key].as_f64().is_some_and(f64::is_finite)), "metric {key} missing");
    }
    // The critic learns: its error on the last steps is below that of the first.
    let error =
        |rows: &[serde_json::Map<String, Value>]| rows.iter().map(|r| r["val/error"].as_f64().unwrap()).sum::<f64>();
    assert!(error(&rows[35..]) < error(&rows[..5]), "the critic's error did not fall");
    let critic: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("critic/config.json")).unwrap()).unwrap();
    assert_eq!(critic["architectures"][0], "GPTNeoXForSequenceClassification");
    assert_eq!(critic["num_labels"], 1);
    assert!(out.join("critic/model.safetensors").is_file());
}

/// The other estimators learn the same reward, each with its own
/// advantages and loss (docs/algorithm.md section 11).
#[test]
fn grpo_learns_a_rule_reward() {
    estimator_learns(&["--algo", "grpo", "--rloo_k", "4"]);
}

#[test]
fn dr_grpo_learns_a_rule_reward() {
    estimator_learns(&["--algo", "dr_grpo", "--rloo_k", "4"]);
}

#[test]
fn reinforce_plus_plus_learns_a_rule_reward_from_one_completion_per_prompt() {
    // Its whitened per-token advantages take larger steps: a smaller rate
    // keeps the KL as low as the others'.
    estimator_learns(&["--advantage_estimator", "reinforce_plus_plus", "--rloo_k", "1", "--learning_rate", "1e-3"]);
}

#[test]
fn reinforce_plus_plus_baseline_learns_a_rule_reward() {
    estimator_learns(&["--adv_estimator", "reinforce_plus_plus_baseline", "--rloo_k", "4"]);
}

fn estimator_learns(algo: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let mut args = algo.to_vec();
    if !args.contains(&"--learning_rate") {
        args.extend(["--learning_rate", "2e-3"]);
    }
    let rows = learning_run(&tmp.path().join("run"), &args);
    assert!(rows.iter().all(|r| r["objective/rlhf_reward"].as_f64().is_some_and(f64::is_finite)));
}

/// RLOO with LoRA adapters (TRL's PEFT flags): the reward rises with only
/// the adapters training against the policy without them as the KL
/// reference, and the output is a PEFT adapter directory on the policy.
#[test]
fn lora_learns_a_rule_reward_and_saves_a_peft_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let lora = ["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_target_modules", "all-linear"];
    let rows = learning_run(&out, &[&["--rloo_k", "4", "--learning_rate", "4e-3"][..], &lora].concat());
    // The reference is the base: the KL starts at zero (up to the sampler's
    // rounding), as the adapters do.
    let first_kl = rows[0]["objective/kl"].as_f64().unwrap();
    assert!(first_kl.abs() < 1e-5, "{first_kl}");
    assert!(!out.join("model.safetensors").exists(), "only the adapter is saved");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap()).unwrap();
    assert_eq!((config["r"].as_u64(), config["target_modules"].as_str()), (Some(8), Some("all-linear")));
    assert_eq!(config["base_model_name_or_path"].as_str(), Some(policy().as_str()));
    // The adapter directory is a model wherever one is accepted.
    let (prompts, completions) = (write_prompts(tmp.path()), tmp.path().join("completions.jsonl"));
    let model = out.to_str().unwrap();
    ok(rloo(&["generate", "--model", model, "--prompts", &prompts, "--output", completions.to_str().unwrap()]));
    assert!(std::fs::read_to_string(&completions).unwrap().lines().count() > 0);
}

/// bf16 mixed precision learns as f32 does (the same assertions), and the
/// model is saved in its checkpoint's dtype from the f32 masters.
#[test]
fn bf16_mixed_precision_learns_a_rule_reward() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    learning_run(&out, &["--rloo_k", "4", "--learning_rate", "1.25e-3", "--bf16"]);
    let saved = candle_core::safetensors::load(out.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    assert!(saved.values().all(|t| t.dtype() == candle_core::DType::F32));
    assert!(std::fs::read_to_string(out.join("rloo_config.toml")).unwrap().contains("dtype = \"bf16\""));
}

/// With a given thread count a run is bit-identical: two runs of the same
/// command, and two steps, a stop and two more against four steps straight,
/// give the same weight bytes, metrics and samples (no reduction whose split
/// depends on scheduling). Two threads, so that work is shared. The second
/// run makes the MLPs' wide inputs again in the backward
/// (`RLOO_MLP_INPUT=remade`), which must not change a bit either.
#[test]
fn the_same_seed_gives_a_bit_identical_run_and_resume() {
    bit_identical_runs_and_resume("gpt_neox-causal", &[], &["model.safetensors"]);
}

/// The same for a Llama policy, whose norms' outputs the backward makes
/// again, and with `RLOO_MLP_INPUT=remade` its MLPs' gate and up projections.
#[test]
fn a_llama_policy_runs_and_resumes_bit_identically() {
    bit_identical_runs_and_resume("llama-causal", &[], &["model.safetensors"]);
}

/// The same for LoRA adapters and their optimizer state.
#[test]
fn lora_runs_and_resumes_bit_identically() {
    bit_identical_runs_and_resume("gpt_neox-causal", &["--use_peft", "--lora_r", "4"], &["adapter_model.safetensors"]);
}

/// The same in bf16: a resume rebuilds the bf16 copies from whole f32
/// masters (`RLOO_MASTERS=f32`); with masters kept split (the default: the
/// run beside, and the run that stops for the resume) the run trains to the
/// same bits, and their checkpoint resumes with whole ones.
#[test]
fn bf16_runs_and_resumes_bit_identically() {
    bit_identical_runs_and_resume("gpt_neox-causal", &["--bf16"], &["model.safetensors"]);
}

/// The same for PPO, whose critic and its optimizer state resume too.
#[test]
fn ppo_runs_and_resumes_bit_identically() {
    bit_identical_runs_and_resume(
        "gpt_neox-causal",
        &["--algo", "ppo", "--rloo_k", "1", "--vf_coef", "0.5"],
        &["model.safetensors", "critic/model.safetensors"],
    );
}

fn bit_identical_runs_and_resume(fixture: &str, algo: &[&str], weights: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = write_prompts(tmp.path());
    let run_with = |out: &Path, extra: &[&str], (mlp_input, masters): (&str, &str)| {
        let mut args = vec![
            "train",
            "--sft_model_path",
            "",
            "--dataset_name",
            &prompts,
            "--output_dir",
            out.to_str().unwrap(),
            "--set",
            "reward=[{type=\"count\", substring=\"e\"}, {type=\"length\", weight=0.1}]",
            "--total_episodes",
            "64",
            "--per_device_train_batch_size",
            "8",
            "--gradient_accumulation_steps",
            "2",
            "--response_length",
            "16",
            "--num_ppo_epochs",
            "2",
            "--learning_rate",
            "1e-3",
            "--weight_decay",
            "0.01",
            "--device",
            "cpu",
            "--lr_scheduler_type",
            "cosine",
            "--warmup_steps",
            "2",
        ];
        let p = model_dir(fixture);
        args[2] = p.to_str().unwrap();
        args.extend_from_slice(algo);
        args.extend_from_slice(extra);
        let command = Command::new(env!("CARGO_BIN_EXE_rloo"))
            .args(&args)
            .env("RAYON_NUM_THREADS", "2")
            .env("RLOO_MLP_INPUT", mlp_input)
            .env("RLOO_MASTERS", masters)
            .output();
        ok(command.unwrap());
    };
    let run = |out: &Path, extra: &[&str]| run_with(out, extra, ("kept", "f32"));
    let straight = tmp.path().join("straight");
    run(&straight, &[]);
    let again = tmp.path().join("again");
    run_with(&again, &[], ("remade", "split"));
    let resumed = tmp.path().join("resumed");
    run_with(&resumed, &["--stop_after", "2"], ("kept", "split"));
    assert!(resumed.join("checkpoint-2").is_dir() && !resumed.join("model.safetensors").exists());
    run(&resumed, &["--resume_from_checkpoint", "latest"]);

    let bytes = |dir: &Path, file: &str| std::fs::read(dir.join(file)).unwrap();
    // Metrics without the timings and memory readings, which are the only values that may differ.
    let logged = |dir: &Path| -> Vec<serde_json::Map<String, Value>> {
        metrics(dir)
            .into_iter()
            .map(|mut row| {
                row.retain(|k, _| !k.starts_with("time/") && !k.starts_with("memory/") && k != "eps");
                row
            })
            .collect()
    };
    for other in [&again, &resumed] {
        for file in weights {
            assert!(bytes(&straight, file) == bytes(other, file), "{file} of {}", other.display());
        }
        assert_eq!(logged(&straight), logged(other), "{}", other.display());
        assert_eq!(bytes(&straight, "samples.jsonl"), bytes(other, "samples.jsonl"), "{}", other.display());
    }
    assert_eq!(logged(&resumed).len(), 4, "resumed metrics have one row per step");
}

/// The sampler's log-probs stand in for a forward pass of the sampling
/// policy: with two PPO epochs (so the ratio moves away from 1) a run logs
/// the same KL, entropy, ratio and loss either way.
#[test]
fn sampler_log_probs_train_like_a_recomputed_forward() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = write_prompts(tmp.path());
    let p = policy();
    let run = |out: &Path, recompute: &str| {
        let args = [
            "train",
            "--sft_model_path",
            &p,
            "--dataset_name",
            &prompts,
            "--output_dir",
            out.to_str().unwrap(),
            "--set",
            "reward=[{type=\"count\", substring=\"e\"}]",
            "--total_episodes",
            "16",
            "--per_device_train_batch_size",
            "8",
            "--response_length",
            "8",
            "--num_ppo_epochs",
            "2",
            "--learning_rate",
            "1e-4",
            "--kl_coef",
            "0.1",
            "--device",
            "cpu",
            "--recompute_old_logprobs",
            recompute,
        ];
        ok(rloo(&args));
    };
    let (sampler, forward) = (tmp.path().join("sampler"), tmp.path().join("forward"));
    run(&sampler, "false");
    run(&forward, "true");
    // Metrics, not weights: Adam turns the rounding noise of gradients that
    // cancel to zero (advantages sum to zero in each group) into whole steps.
    let (ma, mb) = (metrics(&sampler), metrics(&forward));
    assert_eq!(ma.len(), 2);
    for (ra, rb) in ma.iter().zip(&mb) {
        for key in ["objective/kl", "objective/entropy", "policy/approxkl_avg", "loss/policy_avg", "val/ratio"] {
            let (x, y) = (ra[key].as_f64().unwrap(), rb[key].as_f64().unwrap());
            println!("step {} {key}: sampler {x:.6}, recomputed {y:.6}", ra["step"]);
            assert!((x - y).abs() <= 1e-3 * (1.0 + x.abs()), "step {}: {key} {x} vs {y}", ra["step"]);
        }
    }
}

/// Seed 001's command, with local paths in place of hub ids.
#[test]
fn the_trl_example_command_runs_with_local_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("descriptiveness-sentiment");
    std::fs::create_dir(&data).unwrap();
    let rows: Vec<String> =
        (0..64).map(|i| serde_json::json!({ "prompt": format!("Story number {i}:") }).to_string()).collect();
    std::fs::write(data.join("descriptiveness.jsonl"), rows.join("\n")).unwrap();
    let out = tmp.path().join("models/minimal/rloo");
    ok(rloo(&[
        "train",
        "--dataset_name",
        data.to_str().unwrap(),
        "--dataset_train_split",
        "descriptiveness",
        "--learning_rate",
        "3e-6",
        "--output_dir",
        out.to_str().unwrap(),
        "--per_device_train_batch_size",
        "64",
        "--gradient_accumulation_steps",
        "1",
        "--total_episodes",
        "128",
        "--model_name_or_path",
        &policy(),
        "--reward_model_path",
        model_dir("gpt_neox-seqcls").to_str().unwrap(),
        "--missing_eos_penalty",
        "1.0",
        "--response_length",
        "8",
        "--device",
        "cpu",
    ]));
    let rows = metrics(&out);
    assert_eq!(rows.len(), 2);
    assert!(rows[0].contains_key("rewards/model/mean"));
    let config = std::fs::read_to_string(out.join("rloo_config.toml")).unwrap();
    assert!(config.contains("missing_eos_penalty = 1.0") && config.contains("split = \"descriptiveness\""), "{config}");
}

/// Seed 001's TL;DR benchmark command as written, with local paths for its
/// hub ids and `--stop_after 1` (it asks for a million episodes): the
/// validation split is evaluated during training and logged as `eval/...`,
/// its sample table is the one printed, and evaluating changes nothing the
/// run trains.
#[test]
fn the_tldr_benchmark_command_evaluates_its_validation_split() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("tldr-preference-sft-trl-style");
    std::fs::create_dir(&data).unwrap();
    let words = ["cat", "river", "green", "old", "stones", "quiet", "light", "friends"];
    let post = |i: usize| {
        let pick = |j: usize| words[(i * 7 + j * 3) % words.len()];
        // Short posts: the fixture reward model reads 128 positions.
        let prompt = format!("SUBREDDIT: r/cats\nTITLE: {}\nPOST: {} {}\nTL;DR:", pick(0), pick(1), pick(2));
        let messages = [
            json!({"role": "user", "content": prompt}),
            json!({"role": "assistant", "content": format!(" {} {}", pick(6), pick(7))}),
        ];
        json!({"prompt": prompt, "messages": messages, "id": format!("t{i}")}).to_string()
    };
    std::fs::write(data.join("train.jsonl"), (0..64).map(post).collect::<Vec<_>>().join("\n")).unwrap();
    std::fs::write(data.join("validation.jsonl"), (64..70).map(post).collect::<Vec<_>>().join("\n")).unwrap();
    let (sft, reward) = (policy(), model_dir("gpt_neox-seqcls").display().to_string());
    let run = |out: &Path, test_split: &[&str]| {
        let mut args = vec!["train", "--output_dir", out.to_str().unwrap(), "--dataset_name", data.to_str().unwrap()];
        args.extend(test_split);
        args.extend(["--num_ppo_epochs", "2", "--num_mini_batches", "2", "--learning_rate", "3e-6"]);
        args.extend(["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "16"]);
        args.extend(["--total_episodes", "1000000", "--model_name_or_path", &sft, "--sft_model_path", &sft]);
        args.extend(["--reward_model_path", &reward, "--local_rollout_forward_batch_size", "16"]);
        args.extend(["--missing_eos_penalty", "1.0", "--stop_token", "eos", "--kl_coef", "0.03"]);
        args.extend(["--stop_after", "1", "--device", "cpu"]);
        let out = Command::new(env!("CARGO_BIN_EXE_rloo")).args(&args).env("RAYON_NUM_THREADS", "2").output().unwrap();
        String::from_utf8_lossy(&ok(out).stderr).to_string()
    };
    let (evaluated, plain) = (tmp.path().join("models/minimal/rloo_tldr"), tmp.path().join("plain"));
    let log = run(&evaluated, &["--dataset_test_split", "validation"]);
    assert!(log.contains("evaluating on 6 held-out prompts") && log.contains("(held-out prompts)"), "{log}");
    let rows = metrics(&evaluated);
    assert_eq!(rows.len(), 1);
    for key in [
        "eval/reward",
        "eval/reward_std",
        "eval/kl",
        "eval/completions/mean_length",
        "eval/completions/eos_rate",
        "eval/win_rate",
    ] {
        let value = rows[0].get(key).and_then(Value::as_f64);
        assert!(value.is_some_and(f64::is_finite), "{key} in {:?}", rows[0]);
    }
    let win = rows[0]["eval/win_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&win), "{win}");

    run(&plain, &[]);
    let weights = |dir: &Path| std::fs::read(dir.join("checkpoint-1/model.safetensors")).unwrap();
    assert!(weights(&evaluated) == weights(&plain), "evaluating changed the training");
    assert!(!metrics(&plain)[0].keys().any(|k| k.starts_with("eval/")));
}

/// Moving the reference and the reward model to host memory for the
/// training phase (`--ref_reward_offload`) changes no bit of a run: the
/// same weights, metrics and samples over three steps whose held-out
/// prompts are evaluated (reading both models while they are parked).
#[test]
fn offloading_the_reference_and_reward_model_changes_no_bit() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let rows = |range: std::ops::Range<usize>| -> String {
        let words = ["cat", "river", "green", "old", "stones", "quiet", "light", "friends"];
        let prompt = |i: usize| format!("{} {} {}", words[i % 8], words[(i * 3 + 1) % 8], words[(i * 5 + 2) % 8]);
        range.map(|i| json!({"prompt": prompt(i)}).to_string()).collect::<Vec<_>>().join("\n")
    };
    std::fs::write(data.join("train.jsonl"), rows(0..24)).unwrap();
    std::fs::write(data.join("validation.jsonl"), rows(24..28)).unwrap();
    let (sft, reward) = (policy(), model_dir("gpt_neox-seqcls").display().to_string());
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec!["train", "--output_dir", out.to_str().unwrap(), "--dataset_name", data.to_str().unwrap()];
        args.extend(["--dataset_test_split", "validation", "--eval_steps", "1", "--rloo_k", "2"]);
        args.extend(["--model_name_or_path", &sft, "--reward_model_path", &reward, "--kl_coef", "0.1"]);
        args.extend(["--set", "reward=[{type=\"count\", substring=\"e\"}]", "--learning_rate", "1e-3"]);
        args.extend(["--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "2"]);
        args.extend(["--total_episodes", "48", "--response_length", "8", "--device", "cpu"]);
        args.extend(extra);
        let out = Command::new(env!("CARGO_BIN_EXE_rloo")).args(&args).env("RAYON_NUM_THREADS", "2").output().unwrap();
        String::from_utf8_lossy(&ok(out).stderr).to_string()
    };
    let (kept, moved) = (tmp.path().join("kept"), tmp.path().join("moved"));
    run(&kept, &[]);
    let log = run(&moved, &["--ref_reward_offload"]);
    assert_eq!(log.matches("held in host memory while nothing reads them").count(), 2, "{log}");
    let logged = |dir: &Path| -> Vec<serde_json::Map<String, Value>> {
        let mut rows = metrics(dir);
        rows.iter_mut()
            .for_each(|row| row.retain(|k, _| !k.starts_with("time/") && !k.starts_with("memory/") && k != "eps"));
        rows
    };
    let (a, b) = (logged(&kept), logged(&moved));
    assert_eq!(a.len(), 3);
    assert!(a.iter().all(|row| row.contains_key("eval/win_rate") && row.contains_key("rewards/model/mean")));
    assert_eq!(a, b);
    for file in ["model.safetensors", "samples.jsonl"] {
        assert!(std::fs::read(kept.join(file)).unwrap() == std::fs::read(moved.join(file)).unwrap(), "{file}");
    }
    let config = std::fs::read_to_string(moved.join("rloo_config.toml")).unwrap();
    assert!(config.contains("ref_reward_offload = true"), "{config}");
}

/// Seed 002's command (the HelpSteer3 script's flags, with its model,
/// prompts and reward model given as local paths): bf16 and gradient
/// checkpointing included.
#[test]
fn the_helpsteer3_command_runs_with_local_paths() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = write_prompts(tmp.path());
    let out = tmp.path().join("models/rloo_helpsteer3");
    let (policy, reward_model) = (policy(), model_dir("gpt_neox-seqcls"));
    let mut args = vec!["train", "--model_name_or_path", &policy, "--dataset_name", &prompts];
    args.extend(["--reward_model_path", reward_model.to_str().unwrap(), "--response_length", "8", "--device", "cpu"]);
    args.extend(["--output_dir", out.to_str().unwrap(), "--per_device_train_batch_size", "2"]);
    args.extend(["--gradient_accumulation_steps", "8", "--learning_rate", "1e-6", "--total_episodes", "32"]);
    args.extend(["--num_ppo_epochs", "1", "--num_mini_batches", "1", "--rloo_k", "4"]);
    args.extend(["--local_rollout_forward_batch_size", "2", "--missing_eos_penalty", "1.0", "--bf16"]);
    args.extend(["--gradient_checkpointing"]);
    let run = ok(rloo(&args));
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(log.contains("2 steps of 16 completions (4 prompts x k=4)"), "{log}");
    assert_eq!(metrics(&out).len(), 2);
    let config = std::fs::read_to_string(out.join("rloo_config.toml")).unwrap();
    assert!(config.contains("dtype = \"bf16\"") && config.contains("gradient_checkpointing = true"), "{config}");
}

#[test]
fn help_lists_every_flag_with_its_default() {
    let help = String::from_utf8(ok(rloo(&["train", "--help"])).stdout).unwrap();
    for (flag, default) in [
        ("--rloo_k", "[default: 2]"),
        ("--kl_coef", "[default: 0.05]"),
        ("--cliprange", "[default: 0.2]"),
        ("--num_ppo_epochs", "[default: 4]"),
        ("--num_mini_batches", "[default: 1]"),
        ("--temperature", "[default: 0.7]"),
        ("--response_length", "[default: 53]"),
        ("--missing_eos_penalty", "[default: none]"),
        ("--baseline", "[default: \"leave_one_out\"]"),
        ("--kl_estimator", "[default: \"k1\"]"),
    ] {
        let line =
            help.lines().find(|l| l.trim_start().starts_with(flag)).unwrap_or_else(|| panic!("{flag} not in --help"));
        assert!(help.contains(default) && line.contains(flag), "{flag}: {line}");
        let after = &help[help.find(line).unwrap()..];
        assert!(after[..after.find(']').unwrap() + 1].contains(default), "{flag} should show {default}");
    }
}

#[test]
fn bad_configurations_are_explained() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = write_prompts(tmp.path());
    let out = tmp.path().join("o");
    let base = |extra: &[&str]| {
        let mut args = vec![
            "train".to_string(),
            "--model_name_or_path".into(),
            policy(),
            "--dataset_name".into(),
            prompts.clone(),
            "--output_dir".into(),
            out.to_str().unwrap().into(),
            "--device".into(),
            "cpu".into(),
            "--response_length".into(),
            "4".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        rloo(&args)
    };
    let e = err(base(&["--set", "reward=[{type=\"length\"}]", "--rloo_k", "1"]));
    assert!(e.contains("rloo_k") && e.contains("at least 2"), "{e}");
    let e = err(base(&["--reward_model_path", &policy()]));
    assert!(e.contains("not a reward model"), "{e}");
    let e = err(base(&["--set", "reward=[{type=\"length\"}]", "--prompt_column", "question"]));
    assert!(e.contains("no `question` column") && e.contains("prompts.jsonl"), "{e}");
    let e = err(base(&["--set", "reward=[{type=\"length\"}]", "--max_prompt_length", "3", "--long_prompts", "error"]));
    assert!(e.contains("prompts.jsonl:1") && e.contains("max_prompt_length = 3"), "{e}");
    let e = err(base(&["--set", "reward=[{type=\"length\"}]", "--set", "rloo.kl_coeff=1"]));
    assert!(e.contains("kl_coeff"), "{e}");
    let e = err(base(&["--set", "reward=[{type=\"lenght\"}]"]));
    assert!(e.contains("lenght") && e.contains("length"), "{e}");
    let e = err(base(&["--rloo_k", "two"]));
    assert!(e.contains("--rloo_k") && e.contains("integer"), "{e}");
    let e = err(base(&[]));
    assert!(e.contains("no reward"), "{e}");
}

/// TRL 1.x's RLOOConfig names set the same keys as the 0.x names, as flags
/// and as TOML keys; one setting given under two names is refused.
#[test]
fn trl_1x_names_map_onto_the_same_settings() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = write_prompts(tmp.path());
    let (out, policy) = (tmp.path().join("o"), policy());
    let printed = |extra: &[&str]| -> std::process::Output {
        let mut args = vec!["train", "--model_name_or_path", &policy, "--dataset_name", &prompts];
        args.extend(["--output_dir", out.to_str().unwrap(), "--set", "reward=[{type=\"length\"}]", "--print_config"]);
        args.extend(extra);
        rloo(&args)
    };
    let config = String::from_utf8(
        ok(printed(&[
            "--num_generations",
            "4",
            "--beta",
            "0.1",
            "--max_completion_length",
            "16",
            "--num_iterations",
            "2",
            "--epsilon",
            "0.1",
            "--epsilon_high",
            "0.3",
            "--normalize_advantages",
            "--mask_truncated_completions",
        ]))
        .stdout,
    )
    .unwrap();
    for line in [
        "k = 4",
        "kl_coef = 0.1",
        "response_length = 16",
        "num_ppo_epochs = 2",
        "cliprange = 0.1",
        "cliprange_high = 0.3",
        "normalize_advantage = true",
        "mask_truncated_completions = true",
    ] {
        assert!(config.lines().any(|l| l == line), "{line} in\n{config}");
    }
    let file = tmp.path().join("trl1.toml");
    std::fs::write(
        &file,
        "[rloo]\nnum_generations = 4\nbeta = 0.2\nepsilon_high = 0.25\n[generation]\nmax_completion_length = 9\n",
    )
    .unwrap();
    let config = String::from_utf8(ok(printed(&[file.to_str().unwrap()])).stdout).unwrap();
    for line in ["k = 4", "kl_coef = 0.2", "cliprange_high = 0.25", "response_length = 9"] {
        assert!(config.lines().any(|l| l == line), "{line} in\n{config}");
    }
    let e = err(printed(&["--beta", "0.1", "--kl_coef", "0.2"]));
    assert!(e.contains("--kl_coef and --beta are two names of one setting (rloo.kl_coef): give one"), "{e}");
    // A --set under the other name overrides the file's value.
    let config = String::from_utf8(ok(printed(&[file.to_str().unwrap(), "--set", "rloo.kl_coef=0.4"])).stdout).unwrap();
    assert!(config.lines().any(|l| l == "kl_coef = 0.4"), "{config}");
    std::fs::write(&file, "[rloo]\nk = 4\nnum_generations = 4\n").unwrap();
    let e = err(printed(&[file.to_str().unwrap()]));
    assert!(e.contains("[rloo] sets both `k` and `num_generations`, two names of one setting: give one"), "{e}");
    let e = err(printed(&["--report_to", "wandb"]));
    assert!(e.contains("train.report_to: `wandb` is not available here; use tensorboard or none"), "{e}");
    let e = err(printed(&["--rloo_k", "2", "--num_generations", "4"]));
    assert!(e.contains("--rloo_k and --num_generations"), "{e}");
}

/// A command in TRL 1.x's terms runs as it reads: reward functions (a
/// reward model and a built-in rule) with weights, the rollout sized by
/// steps_per_generation, the run's length by max_steps (optimizer steps),
/// bf16 and gradient checkpointing; the resolved sizes are printed in both
/// TRL generations' terms. --fp16 is refused with the reason.
#[test]
fn a_trl_1x_command_runs_with_its_own_batch_arithmetic() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = write_prompts(tmp.path());
    let (out, policy) = (tmp.path().join("o"), policy());
    let reward_model = model_dir("gpt_neox-seqcls").to_str().unwrap().to_string();
    let mut args = vec!["train", "--model_name_or_path", &policy, "--dataset_name", &prompts];
    args.extend(["--output_dir", out.to_str().unwrap(), "--device", "cpu", "--reward_funcs", &reward_model, "length"]);
    args.extend(["--reward_weights", "1.0", "0.01", "--num_generations", "2", "--per_device_train_batch_size", "4"]);
    args.extend(["--gradient_accumulation_steps", "2", "--steps_per_generation", "4", "--max_steps", "3"]);
    args.extend(["--max_completion_length", "6", "--beta", "0.05", "--num_iterations", "1", "--logging_steps", "1"]);
    args.extend(["--num_completions_to_print", "2", "--bf16", "--gradient_checkpointing", "--learning_rate", "1e-6"]);
    let run = ok(rloo(&args));
    let log = String::from_utf8_lossy(&run.stderr);
    // 4 x 4 = 16 completions a rollout, 2 optimizer steps of 4 x 2 each: 3 optimizer steps take 2 rollouts.
    assert!(log.contains("2 steps of 16 completions (8 prompts x k=2)"), "{log}");
    assert!(
        log.contains(
            "in TRL 1.x's terms: generation_batch_size 16 = per_device_train_batch_size 4 x steps_per_generation 4"
        ),
        "{log}"
    );
    assert!(log.contains("4 optimizer steps"), "{log}");
    let rows = metrics(&out);
    assert_eq!(rows.len(), 2, "one metrics row per rollout");
    for key in ["rewards/gpt_neox-seqcls/mean", "rewards/length/mean"] {
        assert!(rows[0].contains_key(key), "{key} in {:?}", rows[0].keys());
    }
    let config = std::fs::read_to_string(out.join("rloo_config.toml")).unwrap();
    assert!(config.contains("steps_per_generation = 4") && config.contains("dtype = \"bf16\""), "{config}");
    args.extend(["--fp16"]);
    let e = err(rloo(&args));
    assert!(e.contains("--fp16") && e.contains("use --bf16"), "{e}");
}

/// With mask_truncated_completions, completions cut at the length limit
/// teach nothing: when every completion is cut, the weights stay as they were.
#[test]
fn masked_truncated_completions_leave_the_policy_unchanged() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = write_prompts(tmp.path());
    let (out, policy) = (tmp.path().join("o"), policy());
    let run = |out: &Path, extra: &[&str]| {
        let mut args = vec!["train", "--model_name_or_path", &policy, "--dataset_name", &prompts];
        args.extend(["--output_dir", out.to_str().unwrap(), "--set", "reward=[{type=\"length\"}]", "--device", "cpu"]);
        args.extend(["--response_length", "4", "--stop_token", "none", "--total_episodes", "16"]);
        args.extend(["--learning_rate", "0.01", "--weight_decay", "0.1", "--kl_coef", "0.1"]);
        args.extend(extra);
        ok(rloo(&args));
    };
    run(&out, &["--mask_truncated_completions", "--report_to", "none"]);
    assert!(!out.join("tensorboard").exists(), "--report_to none writes no TensorBoard events");
    let load =
        |dir: &Path| candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let (trained, start) = (load(&out), load(Path::new(&policy)));
    for (name, t) in &trained {
        assert_eq!(max_diff(t, &start[name]), 0.0, "{name} moved");
    }
    assert!(metrics(&out).iter().all(|m| m["objective/kl"] == 0.0), "masked completions carry no KL");
    // Without the option the same run moves the weights (here sampling
    // under a repetition penalty, which recomputes the old log-probs).
    let other = tmp.path().join("unmasked");
    run(&other, &["--repetition_penalty", "1.3"]);
    let moved = load(&other);
    assert!(other.join("tensorboard").is_dir());
    assert!(moved.iter().any(|(name, t)| max_diff(t, &start[name]) > 0.0));
}
