//! The default job, shortened: every stage runs, the report is written, and
//! a second run reuses the finished stages.

use std::process::Command;

#[test]
fn the_pipeline_runs_every_stage_and_reuses_them() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("pipeline");
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_rloo"))
            .args(["pipeline", "--fast", "--device", "cpu", "--out", out.to_str().unwrap()])
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
    for plot in ["reward", "kl", "entropy"] {
        let png = std::fs::read(out.join("plots").join(format!("{plot}.png"))).unwrap();
        assert!(png.starts_with(b"\x89PNG"), "{plot}.png is a PNG");
        assert!(report.contains(&format!("plots/{plot}.png")));
    }
    let config = std::fs::read_to_string(out.join("reward_model/config.json")).unwrap();
    assert!(config.contains("GPTNeoXForSequenceClassification"));

    let sft_weights = std::fs::metadata(out.join("sft/model.safetensors")).unwrap().modified().unwrap();
    let second = run();
    assert!(second.status.success());
    let again = std::fs::metadata(out.join("sft/model.safetensors")).unwrap().modified().unwrap();
    assert_eq!(sft_weights, again, "a finished stage is reused, not redone");
}
