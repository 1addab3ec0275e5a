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

fn eval_section(dir: &std::path::Path, rank_by: &str, share_of: &str) -> String {
    let held_out = dir.join("held_out.jsonl");
    let rows: Vec<String> =
        ["The song was", "Our trip was"].iter().map(|p| serde_json::json!({ "prompt": p }).to_string()).collect();
    std::fs::write(&held_out, rows.join("\n") + "\n").unwrap();
    format!(
        "[eval]\nprompts = \"{}\"\nsamples_per_prompt = 3\nrank_by = \"{rank_by}\"\n\
         [[eval.share]]\nname = \"with an e\"\nabove = {{ {share_of} = 0.5 }}\n",
        held_out.display()
    )
}

#[test]
fn a_study_measures_each_run_on_held_out_prompts_and_ranks_arms_by_the_chosen_measure() {
    let tmp = tempfile::tempdir().unwrap();
    let arms = "[[arm]]\nname = \"k=2\"\n[[arm]]\nname = \"k=4\"\nrloo = { k = 4 }\n";
    let study = write_study(tmp.path(), &format!("{arms}{}", eval_section(tmp.path(), "with an e", "count")));
    let out = ok(rloo(&["study", study.to_str().unwrap()]));
    let report = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(report.contains("| count (held-out) | with an e (held-out) |"), "{report}");
    assert!(report.contains("reached the highest with an e on held-out prompts"), "{report}");
    let dir = tmp.path().join("out");
    let record_path = dir.join("k-4/seed-2/study_run.json");
    let record: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&record_path).unwrap()).unwrap();
    let share = record["eval"]["with an e"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&share) && record["eval"]["count"].is_f64(), "{record}");

    // A run finished before the evaluation was asked for is measured
    // without training it again.
    let mut stale = record.clone();
    stale.as_object_mut().unwrap().remove("eval");
    std::fs::write(&record_path, stale.to_string()).unwrap();
    let weights = || std::fs::metadata(dir.join("k-4/seed-2/model.safetensors")).unwrap().modified().unwrap();
    let before = weights();
    let again = ok(rloo(&["study", study.to_str().unwrap()]));
    assert_eq!(weights(), before);
    assert!(String::from_utf8_lossy(&again.stderr).contains("evaluating k=4 seed 2"));
    let measured: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&record_path).unwrap()).unwrap();
    assert_eq!(measured["eval"], record["eval"], "the same draws measure the same policy the same way");
}

#[test]
fn an_evaluation_naming_what_it_does_not_measure_is_refused_before_anything_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let arm = "[[arm]]\nname = \"k=2\"\n";
    for (rank_by, share_of, expected) in [
        ("tone", "count", "rank_by \"tone\" is not a measure of [eval] (they are count, with an e)"),
        ("count", "length", "share \"with an e\": no reward named \"length\" (the rewards are count)"),
    ] {
        let study = write_study(tmp.path(), &format!("{arm}{}", eval_section(tmp.path(), rank_by, share_of)));
        let stderr = err(rloo(&["study", study.to_str().unwrap()]));
        assert!(stderr.contains(expected), "{stderr}");
        assert!(!tmp.path().join("out").exists(), "nothing may run before the evaluation is checked");
    }
}
