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
