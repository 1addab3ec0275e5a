//! A run never loses or corrupts work and never trains silently on bad
//! input: output directories, locks, signals, atomic outputs, non-finite
//! values, resume checks, context lengths, tokenizer mismatches. Each test
//! drives the built binary as a user would.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn policy() -> String {
    model_dir("gpt_neox-causal").to_str().unwrap().to_string()
}

fn write(path: &Path, text: &str) -> String {
    std::fs::write(path, text).unwrap();
    path.to_str().unwrap().to_string()
}

fn prompts(dir: &Path) -> String {
    write(&dir.join("prompts.jsonl"), "{\"prompt\": \"The movie was\"}\n{\"prompt\": \"We cooked\"}\n")
}

/// `rloo train` on the tiny policy with a rule reward: `steps` rollout
/// steps of 4 completions, 4 new tokens each. A flag in `extra` replaces
/// the same flag of these defaults.
fn train_args(out: &Path, prompts: &str, steps: usize, extra: &[&str]) -> Vec<String> {
    let episodes = (4 * steps).to_string();
    let mut flags: Vec<(String, Option<String>)> = [
        ("--model_name_or_path", policy()),
        ("--dataset_name", prompts.to_string()),
        ("--output_dir", out.to_str().unwrap().to_string()),
        ("--device", "cpu".into()),
        ("--per_device_train_batch_size", "4".into()),
        ("--response_length", "4".into()),
        ("--num_ppo_epochs", "1".into()),
        ("--learning_rate", "1e-3".into()),
        ("--total_episodes", episodes),
        ("--set", "reward=[{type=\"count\", substring=\"e\"}]".into()),
    ]
    .into_iter()
    .map(|(f, v)| (f.to_string(), Some(v)))
    .collect();
    let mut i = 0;
    while i < extra.len() {
        let value = extra.get(i + 1).filter(|v| !v.starts_with("--")).map(|v| v.to_string());
        let step = if value.is_some() { 2 } else { 1 };
        match flags.iter_mut().find(|(f, _)| f == extra[i] && f != "--set") {
            Some(slot) => slot.1 = value,
            None => flags.push((extra[i].to_string(), value)),
        }
        i += step;
    }
    let mut args = vec!["train".to_string()];
    for (flag, value) in flags {
        args.push(flag);
        args.extend(value);
    }
    args
}

fn train(out: &Path, prompts: &str, steps: usize, extra: &[&str]) -> Output {
    let args = train_args(out, prompts, steps, extra);
    rloo(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

fn checkpoints(dir: &Path) -> Vec<String> {
    let mut found: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str().map(String::from))
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    found.sort();
    found
}

#[test]
fn a_directory_holding_a_run_is_refused_unless_overwritten_or_resumed() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    ok(train(&out, &prompts, 6, &["--save_steps", "3"]));
    assert_eq!(checkpoints(&out), ["checkpoint-3", "checkpoint-6"]);

    // Before: a new 2-step run here pruned its own checkpoint-2 (the old
    // run's steps are higher) and `latest` then resumed the old run.
    let e = err(train(&out, &prompts, 2, &[]));
    assert!(e.contains("already holds a run") && e.contains("--overwrite_output_dir"), "{e}");
    ok(train(&out, &prompts, 2, &["--overwrite_output_dir"]));
    assert_eq!(checkpoints(&out), ["checkpoint-2"], "the old run's checkpoints are gone");
    let rows = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert_eq!(rows.lines().count(), 2, "metrics of the new run only");
    ok(train(&out, &prompts, 2, &["--resume_from_checkpoint", "latest"]));
}

#[test]
fn a_second_run_in_a_locked_directory_fails_at_once_naming_the_holder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let _held = rloo::train::run_dir::RunDir::open(&out, rloo::train::run_dir::Reuse::Fresh).unwrap();
    let started = Instant::now();
    let e = err(train(&out, &prompts(tmp.path()), 2, &[]));
    assert!(e.contains(&format!("in use by another run (pid {})", std::process::id())), "{e}");
    assert!(started.elapsed() < Duration::from_secs(20), "fails before loading anything");
    let sft = tmp.path().join("sft.jsonl");
    write(&sft, "{\"prompt\": \"a\", \"completion\": \" b\"}\n");
    let e = err(rloo(&[
        "sft",
        "--model",
        &policy(),
        "--dataset",
        sft.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--device",
        "cpu",
    ]));
    assert!(e.contains("in use by another run"), "{e}");
}

#[test]
fn sigterm_finishes_the_step_saves_a_checkpoint_and_the_run_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    let args = train_args(&out, &prompts, 400, &["--save_steps", "1000", "--response_length", "16"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_rloo")).args(&args).stderr(Stdio::piped()).spawn().unwrap();
    let metrics = out.join("metrics.jsonl");
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 2 {
        assert!(Instant::now() < deadline, "no step logged");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Safety: signals a child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("stopped by a signal") && stderr.contains("--resume_from_checkpoint latest"), "{stderr}");
    let saved = checkpoints(&out);
    assert_eq!(saved.len(), 1, "one checkpoint at the interrupted step: {saved:?}");
    let step: usize = saved[0]["checkpoint-".len()..].parse().unwrap();
    assert!((2..400).contains(&step), "{step}");
    let logged = std::fs::read_to_string(&metrics).unwrap().lines().count();
    assert_eq!(logged, step, "every finished step is logged and checkpointed");

    // Resuming needs the same run: continue for a few steps only.
    let resumed = train(
        &out,
        &prompts,
        400,
        &["--save_steps", "1000", "--response_length", "16", "--resume_from_checkpoint", "latest", "--stop_after", "1"],
    );
    ok(resumed);
    assert!(out.join(format!("checkpoint-{}", step + 1)).is_dir());
}

#[test]
fn a_second_signal_stops_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    let args = train_args(&out, &prompts, 400, &["--save_steps", "1000"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_rloo")).args(&args).stderr(Stdio::null()).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !out.join("metrics.jsonl").exists() {
        assert!(Instant::now() < deadline, "no step logged");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Safety: signals a child this test started.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    std::thread::sleep(Duration::from_millis(5));
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert_eq!(child.wait().unwrap().code(), Some(130));
    assert!(!out.join("model.safetensors").exists(), "the run did not finish");
}

#[test]
fn a_bad_row_found_late_leaves_an_existing_output_whole() {
    let tmp = tempfile::tempdir().unwrap();
    let previous = "{\"prompt\": \"kept\", \"completion\": \"x\"}\n";
    let output = tmp.path().join("out.jsonl");
    write(&output, previous);
    let mut rows: Vec<String> = (0..20).map(|i| format!("{{\"prompt\": \"Row {i} says\"}}")).collect();
    rows.push("{\"prompt\": \"\"}".into());
    let input = write(&tmp.path().join("prompts.jsonl"), &(rows.join("\n") + "\n"));
    let e = err(rloo(&["generate", "--model", &policy(), "--prompts", &input, "--output", output.to_str().unwrap()]));
    assert!(e.contains("prompts.jsonl:21") && e.contains("empty"), "{e}");
    assert_eq!(std::fs::read_to_string(&output).unwrap(), previous);

    let scored = tmp.path().join("scored.jsonl");
    write(&scored, previous);
    let mut rows: Vec<String> =
        (0..20).map(|i| format!("{{\"prompt\": \"Row {i}\", \"completion\": \" ok\"}}")).collect();
    rows.push("{\"prompt\": \"no completion\"}".into());
    let input = write(&tmp.path().join("score.jsonl"), &(rows.join("\n") + "\n"));
    let e = err(rloo(&["score", "--model", &policy(), "--input", &input, "--output", scored.to_str().unwrap()]));
    assert!(e.contains("score.jsonl:21") && e.contains("completion"), "{e}");
    assert_eq!(std::fs::read_to_string(&scored).unwrap(), previous);
    // A good run replaces the file whole, with no temporary left beside it.
    let good = write(&tmp.path().join("good.jsonl"), "{\"prompt\": \"A\", \"completion\": \" b\"}\n");
    ok(rloo(&["score", "--model", &policy(), "--input", &good, "--output", scored.to_str().unwrap()]));
    assert!(std::fs::read_to_string(&scored).unwrap().contains("sum_logprob"));
    let names: Vec<String> =
        std::fs::read_dir(tmp.path()).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into()).collect();
    assert!(names.iter().all(|n| !n.contains(".tmp")), "{names:?}");
}

#[test]
fn non_finite_and_out_of_range_options_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    for (flag, value, want) in [
        ("--learning_rate", "nan", "train.learning_rate must be > 0, got NaN"),
        ("--learning_rate", "inf", "train.learning_rate must be > 0, got inf"),
        ("--kl_coef", "nan", "rloo.kl_coef must be >= 0, got NaN"),
        ("--adam_epsilon", "0", "train.adam_epsilon must be > 0, got 0"),
        ("--adam_beta1", "1", "train.adam_beta1 must be in [0, 1), got 1"),
        ("--warmup_ratio", "2", "train.warmup_ratio must be in [0, 1], got 2"),
        ("--top_p", "0", "generation.top_p must be in (0, 1], got 0"),
        ("--stop_token_id", "100000", "stop_token_id = 100000 is outside the policy's vocabulary"),
    ] {
        let e = err(train(&out, &prompts, 2, &[flag, value]));
        assert!(e.contains(want), "{flag} {value}: {e}");
    }
    let e = err(train(&out, &prompts, 2, &["--learning_rate", "nan", "--print_config"]));
    assert!(e.contains("train.learning_rate must be > 0"), "--print_config validates: {e}");
    assert!(!out.join("model.safetensors").exists());

    let sft = write(&tmp.path().join("sft.jsonl"), "{\"prompt\": \"a\", \"completion\": \" b\"}\n");
    let sft_out = tmp.path().join("sft");
    for (flag, want) in [
        ("--learning-rate=nan", "learning_rate must be > 0, got NaN"),
        ("--weight-decay=-1", "weight_decay must be >= 0, got -1"),
        ("--eval-fraction=1", "eval_fraction must be in [0, 1), got 1"),
    ] {
        let e = err(rloo(&[
            "sft",
            "--model",
            &policy(),
            "--dataset",
            &sft,
            "--output-dir",
            sft_out.to_str().unwrap(),
            "--device",
            "cpu",
            flag,
        ]));
        assert!(e.contains(want), "sft {flag}: {e}");
    }
}

/// A reward weight of 1e38 overflows the scores to infinity: every sample
/// is unscorable, each step is skipped, and the run stops with the untouched
/// weights saved and an error (before: exit 0 with weights moved by weight
/// decay alone).
#[test]
fn non_finite_losses_never_reach_the_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    let args = train_args(
        &out,
        &prompts,
        6,
        &[
            "--set",
            "reward=[{type=\"count\", substring=\"e\", weight=1e38}, {type=\"length\", weight=1e38}]",
            "--max_skipped_steps",
            "2",
            "--weight_decay",
            "0.1",
        ],
    );
    let e = err(rloo(&args.iter().map(String::as_str).collect::<Vec<_>>()));
    assert!(e.contains("2 optimizer steps in a row were skipped (the last: all 4 samples"), "{e}");
    assert_eq!(checkpoints(&out), ["checkpoint-2"]);
    let saved =
        candle_core::safetensors::load(out.join("checkpoint-2/model.safetensors"), &candle_core::Device::Cpu).unwrap();
    let initial = candle_core::safetensors::load(
        model_dir("gpt_neox-causal").join("model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    for (name, t) in &saved {
        assert_eq!(max_diff(t, &initial[name].to_dtype(t.dtype()).unwrap()), 0.0, "{name} changed");
    }
    let last = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let last: serde_json::Value = serde_json::from_str(last.lines().last().unwrap()).unwrap();
    assert_eq!(last["train/skipped_steps"], 1.0);
}

fn copy_model(name: &str, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(model_dir(name)).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
    }
    to.to_path_buf()
}

#[test]
fn a_policy_with_a_nan_weight_is_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_model("gpt_neox-causal", &tmp.path().join("broken"));
    let file = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    let name = "gpt_neox.layers.0.mlp.dense_h_to_4h.weight".to_string();
    let t = &tensors[&name];
    let mut values: Vec<f32> = t.flatten_all().unwrap().to_dtype(candle_core::DType::F32).unwrap().to_vec1().unwrap();
    values[7] = f32::NAN;
    let broken = candle_core::Tensor::from_vec(values, t.shape(), &candle_core::Device::Cpu).unwrap();
    tensors.insert(name.clone(), broken.to_dtype(t.dtype()).unwrap());
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let prompts = prompts(tmp.path());
    let e = err(rloo(&["generate", "--model", dir.to_str().unwrap(), "--prompts", &prompts, "--output", "/dev/null"]));
    assert!(e.contains(&name) && e.contains("NaN or infinite"), "{e}");
}

#[test]
fn resume_refuses_a_changed_run_and_accepts_reporting_changes() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    ok(train(&out, &prompts, 4, &["--stop_after", "2"]));
    let e = err(train(&out, &prompts, 4, &["--resume_from_checkpoint", "latest", "--seed", "7", "--rloo_k", "4"]));
    assert!(e.contains("cannot resume") && e.contains("rloo.k: 2 -> 4") && e.contains("train.seed: 42 -> 7"), "{e}");
    let other = write(&tmp.path().join("other.jsonl"), "{\"prompt\": \"Something else\"}\n{\"prompt\": \"Two\"}\n");
    let e = err(train(&out, &other, 4, &["--resume_from_checkpoint", "latest"]));
    assert!(e.contains("data.path"), "{e}");
    // The same path with other contents.
    write(Path::new(&prompts), "{\"prompt\": \"Changed\"}\n{\"prompt\": \"prompts\"}\n");
    let e = err(train(&out, &prompts, 4, &["--resume_from_checkpoint", "latest"]));
    assert!(e.contains("prompts") && e.contains("differ from those the run was trained on"), "{e}");
    std::fs::write(&prompts, "{\"prompt\": \"The movie was\"}\n{\"prompt\": \"We cooked\"}\n").unwrap();
    let saved = std::fs::read_to_string(out.join("rloo_config.toml")).unwrap();
    let done = ok(train(&out, &prompts, 4, &["--resume_from_checkpoint", "latest", "--logging_steps", "2"]));
    let log = String::from_utf8_lossy(&done.stderr);
    assert!(log.contains("train.logging_steps: 1 -> 2"), "{log}");
    assert_ne!(std::fs::read_to_string(out.join("rloo_config.toml")).unwrap(), saved);
}

/// Prompts past the fixture's 128 positions: skipped or an error in
/// `train` (per `long_prompts`), an error naming the row elsewhere.
#[test]
fn prompts_beyond_the_models_context_are_caught_in_every_command() {
    let tmp = tempfile::tempdir().unwrap();
    let long = "word ".repeat(200);
    let prompts = write(
        &tmp.path().join("prompts.jsonl"),
        &format!("{{\"prompt\": \"Short one\"}}\n{{\"prompt\": \"{long}\"}}\n{{\"prompt\": \"Another\"}}\n"),
    );
    let out = tmp.path().join("run");
    let e = err(train(&out, &prompts, 2, &["--long_prompts", "error"]));
    assert!(e.contains("prompts.jsonl:2") && e.contains("context of 128 positions"), "{e}");
    let done = ok(train(&out, &prompts, 2, &["--overwrite_output_dir"]));
    assert!(String::from_utf8_lossy(&done.stderr).contains("skipped 1 prompts"));
    let e = err(train(&out, &prompts, 2, &["--overwrite_output_dir", "--max_prompt_length", "4096"]));
    assert!(e.contains("max_prompt_length = 4096 is more than the policy's context of 128"), "{e}");
    let e = err(train(&out, &prompts, 2, &["--overwrite_output_dir", "--response_length", "128"]));
    assert!(e.contains("response_length = 128 leaves no room"), "{e}");

    let e = err(rloo(&["generate", "--model", &policy(), "--prompts", &prompts, "--output", "/dev/null"]));
    assert!(e.contains("prompts.jsonl:2") && e.contains("context of 128"), "{e}");
    let e = err(rloo(&[
        "eval",
        "--model",
        &policy(),
        "--prompts",
        &prompts,
        "--reward-model",
        model_dir("gpt_neox-seqcls").to_str().unwrap(),
        "--device",
        "cpu",
    ]));
    assert!(e.contains("prompts.jsonl:2") && e.contains("128 positions"), "{e}");
    let rows = format!("{{\"prompt\": \"{long}\", \"completion\": \" x\"}}\n");
    let scored = write(&tmp.path().join("score.jsonl"), &rows);
    let e = err(rloo(&["score", "--model", &policy(), "--input", &scored, "--output", "/dev/null"]));
    assert!(e.contains("score.jsonl:1") && e.contains("context of 128"), "{e}");
    let e = err(rloo(&[
        "sft",
        "--model",
        &policy(),
        "--dataset",
        &scored,
        "--output-dir",
        tmp.path().join("sft").to_str().unwrap(),
        "--device",
        "cpu",
    ]));
    assert!(e.contains("score.jsonl:1") && e.contains("context of 128"), "{e}");
    let pairs = write(
        &tmp.path().join("pairs.jsonl"),
        &format!("{{\"prompt\": \"{long}\", \"chosen\": \" a\", \"rejected\": \" b\"}}\n"),
    );
    let e = err(rloo(&[
        "reward",
        "train",
        "--model",
        &policy(),
        "--dataset",
        &pairs,
        "--output-dir",
        tmp.path().join("rm").to_str().unwrap(),
        "--device",
        "cpu",
    ]));
    assert!(e.contains("pairs.jsonl:1") && e.contains("context of 128"), "{e}");
}

/// A tokenizer trained here (another model's, in effect) with fewer or more
/// tokens than the fixture policy's 384.
fn other_tokenizer(dir: &Path, vocab: usize) -> String {
    // Pseudo-random words, so that there are merges enough for any size.
    let mut x = 12345u64;
    let texts: Vec<String> = (0..400)
        .map(|_| {
            (0..12)
                .map(|_| {
                    (0..5)
                        .map(|_| {
                            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                            (b'a' + (x >> 59) as u8 % 26) as char
                        })
                        .collect::<String>()
                })
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    rloo::task::tokenizer::train_byte_level_bpe(&texts, vocab, dir).unwrap();
    dir.to_str().unwrap().to_string()
}

#[test]
fn a_tokenizer_that_does_not_fit_the_policy_is_refused_naming_both() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    for vocab in [300, 600] {
        let tok = other_tokenizer(&tmp.path().join(format!("tok{vocab}")), vocab);
        let e = err(train(&out, &prompts, 2, &["--model_name_or_path", &tok, "--sft_model_path", &policy()]));
        assert!(e.contains(&tok) && e.contains(&policy()) && e.contains("does not fit"), "{vocab}: {e}");
    }
    // A reference over another vocabulary.
    let e = err(train(&out, &prompts, 2, &["--reference_model_path", model_dir("gpt2-seqcls").to_str().unwrap()]));
    assert!(e.contains("the reference") && e.contains("does not fit the policy"), "{e}");
}

#[test]
fn small_mistakes_are_explained() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompts(tmp.path());
    let rm = model_dir("gpt_neox-seqcls");
    let rm = rm.to_str().unwrap();
    let e = err(rloo(&[
        "eval",
        "--model",
        &policy(),
        "--prompts",
        &prompts,
        "--reward-model",
        rm,
        "--samples-per-prompt",
        "0",
    ]));
    assert!(e.contains("--samples-per-prompt") && e.contains("0"), "{e}");
    let e = err(rloo(&["eval", "--model", rm, "--prompts", &prompts, "--reward-model", rm, "--device", "cpu"]));
    assert!(e.contains("cannot generate"), "{e}");
    let dir = copy_model("gpt_neox-causal", &tmp.path().join("tokcls"));
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap().replace("GPTNeoXForCausalLM", "GPTNeoXForTokenClassification");
    std::fs::write(&config, text).unwrap();
    let e = err(rloo(&["generate", "--model", dir.to_str().unwrap(), "--prompts", &prompts, "--output", "/dev/null"]));
    assert!(e.contains("GPTNeoXForTokenClassification` is not supported"), "{e}");
}

/// A model directory whose weights hold tensors its config.json does not
/// use (an edited `num_hidden_layers`, another model's file) is refused,
/// naming them; buffers older transformers saved are not counted.
#[test]
fn tensors_the_config_leaves_unused_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompts(tmp.path());
    let fewer = copy_model("gpt_neox-causal", &tmp.path().join("fewer"));
    let config = fewer.join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    assert!(text.contains("\"num_hidden_layers\": 2"));
    std::fs::write(&config, text.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1")).unwrap();
    let e =
        err(rloo(&["generate", "--model", fewer.to_str().unwrap(), "--prompts", &prompts, "--output", "/dev/null"]));
    assert!(e.contains("tensors that config.json does not use (`gpt_neox.layers.1."), "{e}");
    assert!(e.contains("was config.json edited, e.g. num_hidden_layers?"), "{e}");

    let extra = copy_model("gpt_neox-causal", &tmp.path().join("extra"));
    let file = extra.join("model.safetensors");
    let dev = candle_core::Device::Cpu;
    let mut tensors = candle_core::safetensors::load(&file, &dev).unwrap();
    tensors.insert("gpt_neox.layers.0.attention.masked_bias".into(), candle_core::Tensor::new(-1e4f32, &dev).unwrap());
    candle_core::safetensors::save(&tensors, &file).unwrap();
    ok(rloo(&["generate", "--model", extra.to_str().unwrap(), "--prompts", &prompts, "--output", "/dev/null"]));
    tensors
        .insert("value_head.weight".into(), candle_core::Tensor::zeros((1, 4), candle_core::DType::F32, &dev).unwrap());
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let e =
        err(rloo(&["generate", "--model", extra.to_str().unwrap(), "--prompts", &prompts, "--output", "/dev/null"]));
    assert!(e.contains("1 tensors that config.json does not use (`value_head.weight`)"), "{e}");
}

/// A checkpoint whose config.json was edited does not resume as another
/// model: the difference is named.
#[test]
fn a_checkpoint_with_an_edited_config_does_not_resume() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    ok(train(&out, &prompts, 4, &["--stop_after", "2"]));
    let config = out.join("checkpoint-2/config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replacen("\"layer_norm_eps\": ", "\"layer_norm_eps\": 0.5, \"was\": ", 1)).unwrap();
    let e = err(train(&out, &prompts, 4, &["--resume_from_checkpoint", "latest"]));
    assert!(e.contains("checkpoint-2/config.json: the checkpoint's model differs from the run's"), "{e}");
    assert!(e.contains("layer_norm_eps: 0.5 vs "), "{e}");
    assert!(e.contains("a checkpoint resumes only the model it was saved from"), "{e}");
}

#[test]
fn an_empty_stop_string_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompts(tmp.path());
    let e =
        err(rloo(&["generate", "--model", &policy(), "--prompts", &prompts, "--output", "/dev/null", "--stop", ""]));
    assert!(
        e.contains("--stop: a stop string is empty, which would end every completion before its first token"),
        "{e}"
    );
}

#[test]
fn a_batch_too_large_for_memory_is_warned_about_at_start_up() {
    let tmp = tempfile::tempdir().unwrap();
    let (out, prompts) = (tmp.path().join("run"), prompts(tmp.path()));
    let big = (1usize << 22).to_string();
    let done = ok(train(
        &out,
        &prompts,
        1,
        &["--per_device_train_batch_size", &big, "--total_episodes", &big, "--stop_after", "0"],
    ));
    let log = String::from_utf8_lossy(&done.stderr);
    assert!(log.contains("this run may need up to") && log.contains("lower per_device_train_batch_size"), "{log}");
}

/// `RLOO_SAMPLER` picks how tokens are drawn: `race` gives the same
/// completions from the same seed, in `generate` and in a training run's
/// rollouts, and an unknown value is refused by name.
#[test]
fn the_sampler_variable_is_obeyed_and_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompts(tmp.path());
    let with_sampler = |sampler: &str, args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_rloo")).env("RLOO_SAMPLER", sampler).args(args).output().unwrap()
    };
    let generate = |sampler: &str, name: &str| -> (Output, String) {
        let out = tmp.path().join(name);
        let args = ["generate", "--model", &policy(), "--prompts", &prompts, "--output", out.to_str().unwrap()];
        let flags = ["--num-return-sequences", "4", "--max-new-tokens", "8", "--temperature", "1.0", "--seed", "5"];
        let run = with_sampler(sampler, &[&args[..], &flags[..], &["--ignore-eos"]].concat());
        (run, std::fs::read_to_string(&out).unwrap_or_default())
    };
    let (first, race) = generate("race", "a.jsonl");
    ok(first);
    let (second, again) = generate("race", "b.jsonl");
    ok(second);
    assert_eq!(race, again, "the same seed draws the same completions");
    let (host_run, host) = generate("host", "c.jsonl");
    ok(host_run);
    assert_ne!(race, host, "the two samplers draw differently from one seed");
    let e = err(generate("gpu", "d.jsonl").0);
    assert!(e.contains("RLOO_SAMPLER=gpu: expected host or race"), "{e}");

    let metrics = |dir: &str| -> Vec<serde_json::Map<String, serde_json::Value>> {
        let out = tmp.path().join(dir);
        let args = train_args(&out, &prompts, 2, &[]);
        ok(with_sampler("race", &args.iter().map(String::as_str).collect::<Vec<_>>()));
        let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let mut rows: Vec<serde_json::Map<String, serde_json::Value>> =
            text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        for row in &mut rows {
            row.retain(|k, _| !k.starts_with("time/") && !k.starts_with("memory/") && k != "eps");
        }
        rows
    };
    assert_eq!(metrics("run-a"), metrics("run-b"), "a training run's rollouts draw the same");
}

#[test]
fn the_decode_attention_variable_is_obeyed_and_checked() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompts(tmp.path());
    let generate = |choice: &str, name: &str| -> (Output, String) {
        let out = tmp.path().join(name);
        let args = ["generate", "--model", &policy(), "--prompts", &prompts, "--output", out.to_str().unwrap()];
        let flags = ["--num-return-sequences", "2", "--max-new-tokens", "12", "--temperature", "0"];
        let run = Command::new(env!("CARGO_BIN_EXE_rloo"))
            .env("RLOO_DECODE_ATTENTION", choice)
            .args([&args[..], &flags[..], &["--ignore-eos"]].concat())
            .output()
            .unwrap();
        (run, std::fs::read_to_string(&out).unwrap_or_default())
    };
    let (fused_run, fused) = generate("fused", "a.jsonl");
    ok(fused_run);
    let (composed_run, composed) = generate("composed", "b.jsonl");
    ok(composed_run);
    assert!(!fused.is_empty());
    assert_eq!(fused, composed, "the kernel and the composition choose the same greedy tokens");
    // On the CPU the kernel with a lane per key is the CPU kernel.
    let (lanes_run, lanes) = generate("lanes", "d.jsonl");
    ok(lanes_run);
    assert_eq!(lanes, fused);
    let e = err(generate("flash", "c.jsonl").0);
    assert!(e.contains("RLOO_DECODE_ATTENTION=flash: expected lanes or fused or composed"), "{e}");
}

#[test]
fn the_gpu_variables_are_checked_on_every_device() {
    let tmp = tempfile::tempdir().unwrap();
    let prompts = prompts(tmp.path());
    let generate = |var: &str, choice: &str| {
        let out = tmp.path().join("out.jsonl");
        let args = ["generate", "--model", &policy(), "--prompts", &prompts, "--output", out.to_str().unwrap()];
        Command::new(env!("CARGO_BIN_EXE_rloo"))
            .env(var, choice)
            .args([&args[..], &["--max-new-tokens", "2"]].concat())
            .output()
            .unwrap()
    };
    ok(generate("RLOO_CUDA_POOL", "keep"));
    ok(generate("RLOO_CUDA_POOL", "release"));
    let e = err(generate("RLOO_CUDA_POOL", "hoard"));
    assert!(e.contains("RLOO_CUDA_POOL=hoard: expected keep or release"), "{e}");
    ok(generate("RLOO_CUDA_EVENTS", "off"));
    ok(generate("RLOO_CUDA_EVENTS", "on"));
    let e = err(generate("RLOO_CUDA_EVENTS", "sometimes"));
    assert!(e.contains("RLOO_CUDA_EVENTS=sometimes: expected off or on"), "{e}");
    ok(generate("RLOO_ATTENTION", "rows"));
    ok(generate("RLOO_ATTENTION", "tensor"));
    ok(generate("RLOO_ATTENTION", "flash"));
    let e = err(generate("RLOO_ATTENTION", "wmma"));
    assert!(e.contains("RLOO_ATTENTION=wmma: expected flash or tensor or rows"), "{e}");
    ok(generate("RLOO_CUDA_PROFILE", "training"));
    let e = err(generate("RLOO_CUDA_PROFILE", "everything"));
    assert!(e.contains("RLOO_CUDA_PROFILE=everything: expected off or generation or scoring or training"), "{e}");
    ok(generate("RLOO_DECODE_ATTENTION", "composed"));
    let e = err(generate("RLOO_DECODE_ATTENTION", "split"));
    assert!(e.contains("RLOO_DECODE_ATTENTION=split: expected lanes or fused or composed"), "{e}");
    ok(generate("RLOO_DECODE_APPEND", "composed"));
    ok(generate("RLOO_DECODE_APPEND", "fused"));
    let e = err(generate("RLOO_DECODE_APPEND", "always"));
    assert!(e.contains("RLOO_DECODE_APPEND=always: expected fused or composed"), "{e}");
    ok(generate("RLOO_ATTENTION_HEADS", "composed"));
    ok(generate("RLOO_ATTENTION_HEADS", "fused"));
    let e = err(generate("RLOO_ATTENTION_HEADS", "copied"));
    assert!(e.contains("RLOO_ATTENTION_HEADS=copied: expected fused or composed"), "{e}");
    ok(generate("RLOO_ATTENTION_MASK", "bias"));
    ok(generate("RLOO_ATTENTION_MASK", "spans"));
    let e = err(generate("RLOO_ATTENTION_MASK", "runs"));
    assert!(e.contains("RLOO_ATTENTION_MASK=runs: expected spans or bias"), "{e}");
    let completions = |choice: &str| {
        ok(generate("RLOO_DECODE_STEP", choice));
        std::fs::read_to_string(tmp.path().join("out.jsonl")).unwrap()
    };
    let shrinking = completions("shrink");
    assert_eq!(completions("fixed"), shrinking);
    assert_eq!(completions("graph"), shrinking);
    let e = err(generate("RLOO_DECODE_STEP", "replay"));
    assert!(e.contains("RLOO_DECODE_STEP=replay: expected shrink or fixed or graph"), "{e}");
}
