//! Every algorithm learns the built-in task: trained from the pipeline's SFT
//! model against its reward model (the pipeline's RL stage, shortened to a
//! quarter of its episodes), its share of positive reviews on held-out
//! titles rises well above the SFT model's, measured as the pipeline
//! measures it.

mod common;

use std::path::Path;
use std::sync::OnceLock;

use candle_core::Device;
use common::*;
use rloo::model::Model;
use rloo::pipeline::HeldOut;

/// The task's data, SFT model and reward model (`rloo pipeline`, made once
/// for every test here), and the SFT model's share of positive reviews.
struct Task {
    dir: tempfile::TempDir,
    sft_share: f64,
}

const SEED: u64 = 42;

fn task() -> &'static Task {
    static TASK: OnceLock<Task> = OnceLock::new();
    TASK.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        ok(rloo(&["pipeline", "--device", "cpu", "--out", dir.path().to_str().unwrap()]));
        let held_out = HeldOut::new(dir.path(), &Device::Cpu, SEED).unwrap();
        let sft = Model::load(&dir.path().join("sft"), &Device::Cpu).unwrap();
        let sft_share = held_out.positive_share(&sft).unwrap();
        Task { dir, sft_share }
    })
}

fn learns(algo: &str, k: &str) {
    let task = task();
    let at = |p: &str| task.dir.path().join(p).to_str().unwrap().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    ok(rloo(&[
        "train",
        "--algo",
        algo,
        "--rloo_k",
        k,
        "--sft_model_path",
        &at("sft"),
        "--reward_model_path",
        &at("reward_model"),
        "--dataset_name",
        &at("data/prompts.jsonl"),
        "--response_length",
        "32",
        "--temperature",
        "1.0",
        "--kl_coef",
        "0.05",
        "--num_ppo_epochs",
        "1",
        "--learning_rate",
        "3e-4",
        "--per_device_train_batch_size",
        "32",
        "--total_episodes",
        "1024",
        "--num_sample_generations",
        "0",
        "--output_dir",
        out.to_str().unwrap(),
        "--device",
        "cpu",
    ]));
    let held_out = HeldOut::new(task.dir.path(), &Device::Cpu, SEED).unwrap();
    let share = held_out.positive_share(&Model::load(Path::new(&out), &Device::Cpu).unwrap()).unwrap();
    println!("{algo}: positive reviews {:.1}% (SFT {:.1}%)", 100.0 * share, 100.0 * task.sft_share);
    assert!(share > task.sft_share + 0.25, "{algo}: {share} against the SFT model's {}", task.sft_share);
}

#[test]
fn rloo_learns_the_built_in_task() {
    learns("rloo", "4");
}

#[test]
fn grpo_learns_the_built_in_task() {
    learns("grpo", "4");
}

#[test]
fn dr_grpo_learns_the_built_in_task() {
    learns("dr_grpo", "4");
}

#[test]
fn reinforce_plus_plus_learns_the_built_in_task() {
    learns("reinforce_plus_plus", "4");
}

#[test]
fn reinforce_plus_plus_baseline_learns_the_built_in_task() {
    learns("reinforce_plus_plus_baseline", "4");
}

#[test]
fn ppo_learns_the_built_in_task() {
    learns("ppo", "1");
}
