//! `rloo sft`: the row formats, and a short run that learns its data.

mod common;

use std::process::Command;

use candle_core::Device;
use common::*;
use rloo::data::Row;
use rloo::data::Tokenizer;
use rloo::error::RowPlace;
use rloo::model::scoring::{completion_logprobs, Sequences};
use rloo::model::Model;
use rloo::train::sft::{example_from_row, Example};
use serde_json::json;

fn row(v: serde_json::Value) -> Row {
    Row::new(std::sync::Arc::from(std::path::Path::new("t.jsonl")), RowPlace::Line(1), v.as_object().unwrap().clone())
}

#[test]
fn row_formats_tokenize_like_the_chat_template() {
    let tok = Tokenizer::from_dir(&model_dir("qwen2-causal")).unwrap();
    let eos = tok.eos_token_id().unwrap();
    let ex = example_from_row(&row(json!({"prompt": "The movie was", "completion": " good."})), &tok, false).unwrap();
    assert_eq!(ex.prompt, tok.encode("The movie was").unwrap());
    assert_eq!(ex.completion, [tok.encode(" good.").unwrap(), vec![eos]].concat(), "text completions end with EOS");

    let chat = json!({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]});
    let ex = example_from_row(&row(chat), &tok, false).unwrap();
    let template = tok.chat_template().unwrap();
    let user = [rloo::data::Message::new("user", "Hi")];
    assert_eq!(ex.prompt, tok.encode(&template.render(&user, true).unwrap()).unwrap());
    let reply = tok.decode(&ex.completion, false).unwrap();
    assert!(reply.starts_with("Hello!") && reply.contains("<|im_end|>"), "{reply}");

    let all = example_from_row(&row(json!({"prompt": "a b", "completion": " c"})), &tok, true).unwrap();
    assert_eq!(all.prompt.len(), 1, "all_tokens trains on everything after the first token");
    let err = example_from_row(&row(json!({"prompt": "a"})), &tok, false).unwrap_err();
    assert!(err.contains("completion"), "{err}");
}

fn logprob_of(model: &Model, ex: &Example) -> f32 {
    let seqs = Sequences::new(vec![&ex.prompt], vec![&ex.completion]);
    completion_logprobs(model.frozen(), &seqs, 1.0, &Device::Cpu)
        .unwrap()
        .logprobs
        .sum_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Twelve demonstrations of one completion, in `dir/sft.jsonl`.
fn write_demonstrations(dir: &std::path::Path) -> std::path::PathBuf {
    let data = dir.join("sft.jsonl");
    let rows: Vec<String> = (0..12)
        .map(|i| {
            json!({"prompt": format!("Review {i}:"), "completion": " wonderful acting and lovely music."}).to_string()
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    data
}

#[test]
fn a_short_run_learns_its_completions() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_demonstrations(tmp.path());
    let out = tmp.path().join("sft");
    let run = Command::new(env!("CARGO_BIN_EXE_rloo"))
        .args(["sft", "--model", model_dir("gpt_neox-causal").to_str().unwrap(), "--dataset", data.to_str().unwrap()])
        .args(["--output-dir", out.to_str().unwrap(), "--learning-rate", "3e-3", "--num-train-epochs", "5"])
        .args(["--per-device-train-batch-size", "2", "--gradient-accumulation-steps", "2", "--eval-fraction", "0.25"])
        .args(["--device", "cpu"])
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let tok = Tokenizer::from_dir(&model_dir("gpt_neox-causal")).unwrap();
    let ex = example_from_row(
        &row(json!({"prompt": "Review 99:", "completion": " wonderful acting and lovely music."})),
        &tok,
        false,
    )
    .unwrap();
    let before = logprob_of(&Model::load(&model_dir("gpt_neox-causal"), &Device::Cpu).unwrap(), &ex);
    let after = logprob_of(&Model::load(&out, &Device::Cpu).unwrap(), &ex);
    println!("log p(completion | unseen prompt): {before:.2} -> {after:.2}");
    assert!(after > before + 10.0, "{before} -> {after}");
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    assert!(metrics.contains("eval/loss") && metrics.contains("train/loss"));
}

/// With --use_peft only LoRA adapters train (with dropout, reproducibly),
/// and the output is a PEFT adapter directory on the unchanged base.
#[test]
fn lora_sft_learns_its_completions_into_an_adapter() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_demonstrations(tmp.path());
    let run = |out: &std::path::Path| {
        let run = Command::new(env!("CARGO_BIN_EXE_rloo"))
            .args([
                "sft",
                "--model",
                model_dir("gpt_neox-causal").to_str().unwrap(),
                "--dataset",
                data.to_str().unwrap(),
            ])
            .args(["--output-dir", out.to_str().unwrap(), "--learning-rate", "1e-2", "--num-train-epochs", "5"])
            .args(["--per-device-train-batch-size", "2", "--device", "cpu"])
            .args(["--use_peft", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0.1"])
            .args(["--lora_target_modules", "all-linear"])
            .env("RAYON_NUM_THREADS", "2")
            .output()
            .unwrap();
        assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    };
    let (out, again) = (tmp.path().join("sft"), tmp.path().join("again"));
    run(&out);
    run(&again);
    assert!(out.join("adapter_config.json").is_file() && !out.join("model.safetensors").exists());
    let weights = |dir: &std::path::Path| std::fs::read(dir.join("adapter_model.safetensors")).unwrap();
    assert!(weights(&out) == weights(&again), "dropout masks come from the seed");
    let tok = Tokenizer::from_dir(&model_dir("gpt_neox-causal")).unwrap();
    let row = row(json!({"prompt": "Review 99:", "completion": " wonderful acting and lovely music."}));
    let ex = example_from_row(&row, &tok, false).unwrap();
    let before = logprob_of(&Model::load(&model_dir("gpt_neox-causal"), &Device::Cpu).unwrap(), &ex);
    let after = logprob_of(&Model::load(&out, &Device::Cpu).unwrap(), &ex);
    println!("log p(completion | unseen prompt): {before:.2} -> {after:.2}");
    assert!(after > before + 10.0, "{before} -> {after}");
}

/// `rloo sft` and `rloo reward train` take options as `rloo train` does: a
/// TOML file, then `--set`, then flags (either spelling), later ones
/// winning; a run saves the resolved config beside its outputs.
#[test]
fn sft_and_reward_train_take_a_file_set_and_flags_and_save_the_resolved_config() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_demonstrations(tmp.path());
    let file = tmp.path().join("sft.toml");
    let policy = model_dir("gpt_neox-causal");
    let toml = format!(
        "model = {:?}\nlearning_rate = 1e-4\nwarmup_steps = 2\nadam_beta2 = 0.95\nnum_train_epochs = 3\n[dataset]\nname = {:?}\n[peft]\nlora_r = 8\n",
        policy.to_str().unwrap(),
        data.to_str().unwrap()
    );
    std::fs::write(&file, toml).unwrap();
    let printed = |command: &[&str], extra: &[&str]| {
        let args = [command, &[file.to_str().unwrap(), "--print_config"], extra].concat();
        String::from_utf8(ok(rloo(&args)).stdout).unwrap()
    };
    for command in [&["sft"][..], &["reward", "train"]] {
        let config = printed(command, &["--set", "learning_rate=2e-4", "--num-train-epochs", "2", "--lora_r", "4"]);
        for line in
            ["learning_rate = 0.0002", "num_train_epochs = 2", "warmup_steps = 2", "adam_beta2 = 0.95", "lora_r = 4"]
        {
            assert!(config.lines().any(|l| l == line), "{command:?}: {line} in\n{config}");
        }
        // The flag wins over --set, which wins over the file.
        let config = printed(command, &["--set", "learning_rate=2e-4", "--learning_rate", "3e-4"]);
        assert!(config.lines().any(|l| l == "learning_rate = 0.0003"), "{config}");
    }
    let out = tmp.path().join("sft");
    let args =
        [file.to_str().unwrap(), "--output_dir", out.to_str().unwrap(), "--device", "cpu", "--num_train_epochs", "1"];
    ok(rloo(&[&["sft"][..], &args].concat()));
    let saved = std::fs::read_to_string(out.join("sft_config.toml")).unwrap();
    assert!(saved.contains("adam_beta2 = 0.95") && saved.contains("num_train_epochs = 1"), "{saved}");
}

/// Runs `rloo sft` on `data` into `out` with `extra` flags.
fn sft_command(data: &std::path::Path, out: &std::path::Path, extra: &[&str]) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_rloo"));
    command
        .args(["sft", "--model", model_dir("gpt_neox-causal").to_str().unwrap(), "--dataset", data.to_str().unwrap()])
        .args(["--output-dir", out.to_str().unwrap(), "--device", "cpu", "--learning-rate", "3e-3"])
        .args(extra)
        .env("RAYON_NUM_THREADS", "2");
    command
}

/// A run stopped part-way (`--stop_after`, across an epoch's end) and
/// resumed gives the uninterrupted run's weights and metrics to the bit:
/// optimizer state, data order, skipped-step count and the adapters'
/// dropout masks all continue where they stood.
#[test]
fn a_stopped_sft_run_resumes_to_the_uninterrupted_runs_weights_and_metrics() {
    let tmp = tempfile::tempdir().unwrap();
    let data = write_demonstrations(tmp.path());
    let flags = [
        "--num-train-epochs",
        "3",
        "--per-device-train-batch-size",
        "2",
        "--gradient-accumulation-steps",
        "2",
        "--eval-fraction",
        "0.25",
        "--use_peft",
        "--lora_dropout",
        "0.1",
        "--lora_target_modules",
        "all-linear",
        "--logging_steps",
        "1",
    ];
    let run = |out: &std::path::Path, extra: &[&str]| {
        let done = sft_command(&data, out, &[&flags[..], extra].concat()).output().unwrap();
        assert!(done.status.success(), "{}", String::from_utf8_lossy(&done.stderr));
        String::from_utf8_lossy(&done.stderr).to_string()
    };
    let (whole, parts) = (tmp.path().join("whole"), tmp.path().join("parts"));
    run(&whole, &[]);
    let stopped = run(&parts, &["--stop_after", "4"]);
    assert!(
        stopped.contains("stopped after step 4") && stopped.contains("--resume_from_checkpoint latest"),
        "{stopped}"
    );
    assert!(!parts.join("adapter_model.safetensors").exists(), "a stopped run saves no final model");
    let checkpoint = parts.join("checkpoint-4");
    for file in ["trainer_state.json", "optimizer.safetensors", "sft_config.toml", "adapter_model.safetensors"] {
        assert!(checkpoint.join(file).is_file(), "{file} in the checkpoint");
    }
    run(&parts, &["--resume_from_checkpoint", "latest", "--save_steps", "2"]);
    let read = |dir: &std::path::Path, file: &str| std::fs::read(dir.join(file)).unwrap();
    assert!(read(&whole, "adapter_model.safetensors") == read(&parts, "adapter_model.safetensors"));
    assert_eq!(
        String::from_utf8(read(&whole, "metrics.jsonl")).unwrap(),
        String::from_utf8(read(&parts, "metrics.jsonl")).unwrap()
    );

    // Options that would change the run are refused, naming them.
    let other =
        sft_command(&data, &parts, &[&flags[..], &["--resume_from_checkpoint", "latest", "--seed", "7"]].concat())
            .output()
            .unwrap();
    let stderr = String::from_utf8_lossy(&other.stderr);
    assert!(!other.status.success() && stderr.contains("seed: 42 -> 7"), "{stderr}");
}

/// A run killed outright (SIGKILL) continues from its last checkpoint to
/// the weights of a run that was never interrupted.
#[cfg(unix)]
#[test]
fn a_killed_sft_run_resumes_to_the_uninterrupted_runs_weights() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("many.jsonl");
    let rows: Vec<String> = (0..150)
        .map(|i| json!({"prompt": format!("Review {i}:"), "completion": " wonderful acting."}).to_string())
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let flags = ["--num-train-epochs", "2", "--per-device-train-batch-size", "1", "--save_steps", "5"];
    let (whole, killed) = (tmp.path().join("whole"), tmp.path().join("killed"));
    assert!(sft_command(&data, &whole, &flags).output().unwrap().status.success());

    let mut child = sft_command(&data, &killed, &flags).stderr(std::process::Stdio::null()).spawn().unwrap();
    let started = std::time::Instant::now();
    while !killed.join("checkpoint-10/trainer_state.json").is_file() {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before it could be killed");
        assert!(started.elapsed().as_secs() < 120, "no checkpoint after 2 minutes");
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!killed.join("model.safetensors").exists(), "killed before the end");
    let resumed =
        sft_command(&data, &killed, &[&flags[..], &["--resume_from_checkpoint", "latest"]].concat()).output().unwrap();
    assert!(resumed.status.success(), "{}", String::from_utf8_lossy(&resumed.stderr));
    let weights = |dir: &std::path::Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    assert!(weights(&whole) == weights(&killed), "the resumed run's weights differ");
}
