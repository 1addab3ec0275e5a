//! `rloo study` as users run it: arms x seeds in their own processes, a
//! report with a row per arm and its charts, finished runs kept on a rerun.

mod common;

use common::*;

fn write_study(dir: &std::path::Path, arms: &str) -> std::path::PathBuf {
    let prompts = dir.join("prompts.jsonl");
    let rows: Vec<String> = ["The movie was", "I think the film", "The music was", "We cooked"]
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string())
        .collect();
    std::fs::write(&prompts, rows.join("\n") + "\n").unwrap();
    let study = format!(
        r#"seeds = [1, 2]
output_dir = "{out}"
[model]
policy = "{policy}"
device = "cpu"
[data]
path = "{prompts}"
[generation]
response_length = 8
[rloo]
k = 2
num_ppo_epochs = 1
[train]
learning_rate = 1e-3
per_device_train_batch_size = 8
total_episodes = 32
num_sample_generations = 0
[[reward]]
type = "count"
substring = "e"
{arms}"#,
        out = dir.join("out").display(),
        policy = model_dir("gpt_neox-causal").display(),
        prompts = prompts.display(),
    );
    let path = dir.join("study.toml");
    std::fs::write(&path, study).unwrap();
    path
}

#[test]
fn a_study_reports_every_arm_and_keeps_finished_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let arms = "[[arm]]\nname = \"rloo k=2\"\n[[arm]]\nname = \"ppo\"\ntrain = { algo = \"ppo\" }\nrloo = { k = 1 }\n";
    let study = write_study(tmp.path(), arms);
    let out = ok(rloo(&["study", study.to_str().unwrap()]));
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    let dir = tmp.path().join("out");
    assert_eq!(report, std::fs::read_to_string(dir.join("study.md")).unwrap());
    for arm in ["| rloo k=2 |", "| ppo |", "reached the highest final reward"] {
        assert!(report.contains(arm), "{arm} missing from\n{report}");
    }
    for png in ["reward.png", "kl.png", "frontier.png"] {
        assert!(std::fs::read(dir.join(png)).unwrap().starts_with(b"\x89PNG"), "{png}");
        assert!(report.contains(&format!("]({png})")), "{png} not linked");
    }
    for (arm, seed) in [("rloo-k-2", 1), ("rloo-k-2", 2), ("ppo", 1), ("ppo", 2)] {
        let run = dir.join(arm).join(format!("seed-{seed}"));
        assert!(run.join("model.safetensors").is_file() && run.join("study_run.json").is_file(), "{}", run.display());
        let config = std::fs::read_to_string(dir.join(arm).join(format!("seed-{seed}.toml"))).unwrap();
        assert!(config.contains(&format!("seed = {seed}")), "{config}");
    }
    assert!(dir.join("ppo/seed-1/critic/model.safetensors").is_file());

    // A second run trains nothing: every run is finished.
    let weights = || std::fs::metadata(dir.join("ppo/seed-2/model.safetensors")).unwrap().modified().unwrap();
    let before = weights();
    let again = ok(rloo(&["study", study.to_str().unwrap()]));
    assert_eq!(weights(), before);
    assert!(String::from_utf8_lossy(&again.stderr).contains("is done"));
}

#[test]
fn a_bad_arm_is_refused_before_anything_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let arms = "[[arm]]\nname = \"fine\"\n[[arm]]\nname = \"broken\"\nrloo = { k = 3 }\n";
    let study = write_study(tmp.path(), arms);
    let stderr = err(rloo(&["study", study.to_str().unwrap()]));
    assert!(stderr.contains("arm \"broken\"") && stderr.contains("not a multiple of rloo_k = 3"), "{stderr}");
    assert!(!tmp.path().join("out/fine").exists(), "nothing may run before every arm is checked");
}
