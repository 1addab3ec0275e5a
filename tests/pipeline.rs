//! The default job, shortened: every stage runs, the report is written, the
//! study compares RLOO with PPO, and a second run reuses what finished.

use std::process::Command;

#[test]
fn the_pipeline_runs_every_stage_and_its_study_and_reuses_them() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("pipeline");
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_rloo"))
            .args(["pipeline", "--fast", "--study", "--device", "cpu", "--out", out.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let first = run();
    assert!(first.status.success(), "{}", String::from_utf8_lossy(&first.stderr));
    for stage in ["data", "init", "sft", "reward_model", "rloo"] {
        assert!(out.join(stage).join(".done").is_file(), "stage {stage} not finished");
    }
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("| sft |") && report.contains("| rloo |") && report.contains("Win rate"), "{report}");
    for plot in ["reward", "kl", "entropy", "eval_reward"] {
        let png = std::fs::read(out.join("plots").join(format!("{plot}.png"))).unwrap();
        assert!(png.starts_with(b"\x89PNG"), "{plot}.png is a PNG");
        assert!(report.contains(&format!("plots/{plot}.png")));
    }
    let arms = [
        "rloo k=2",
        "rloo k=4",
        "batch mean k=4",
        "no baseline k=4",
        "grpo",
        "dr_grpo",
        "reinforce_plus_plus",
        "reinforce_plus_plus_baseline",
        "ppo",
    ];
    for arm in arms {
        let cell = arm.replace('_', "\\_"); // as Markdown escapes it
        assert!(report.contains(&format!("| {cell} |")), "{arm} missing from the study in\n{report}");
    }
    assert!(report.contains("| positive reviews (held-out) |"), "{report}");
    assert!(report.contains("reached the highest positive reviews on held-out prompts"), "{report}");
    let study = std::fs::read_to_string(out.join("study/study.md")).unwrap();
    assert!(study.contains("![reward-KL frontier](frontier.png)"), "{study}");
    assert!(out.join("study/ppo/seed-43/critic/model.safetensors").is_file());
    let config = std::fs::read_to_string(out.join("reward_model/config.json")).unwrap();
    assert!(config.contains("GPTNeoXForSequenceClassification"));

    let sft_weights = std::fs::metadata(out.join("sft/model.safetensors")).unwrap().modified().unwrap();
    let second = run();
    assert!(second.status.success());
    assert!(String::from_utf8_lossy(&second.stderr).contains("study: ppo seed 43 is done"));
    let again = std::fs::metadata(out.join("sft/model.safetensors")).unwrap().modified().unwrap();
    assert_eq!(sft_weights, again, "a finished stage is reused, not redone");
}
