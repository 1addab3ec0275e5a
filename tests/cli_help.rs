//! Snapshots of every `--help` and of the key error messages, in
//! `tests/snapshots/`. A change to the command line shows here as a diff;
//! `UPDATE_SNAPSHOTS=1 cargo test --test cli_help` rewrites the files.

mod common;

use std::path::PathBuf;

use common::*;

/// Every command and subcommand.
const COMMANDS: &[&[&str]] = &[
    &[],
    &["check"],
    &["data"],
    &["data", "inspect"],
    &["data", "prepare"],
    &["eval"],
    &["generate"],
    &["launch"],
    &["merge"],
    &["pipeline"],
    &["reward"],
    &["reward", "train"],
    &["reward", "serve"],
    &["score"],
    &["serve"],
    &["sft"],
    &["study"],
    &["train"],
];

fn snapshot_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots")
}

/// Compares `got` with the snapshot `name`, or writes it under UPDATE_SNAPSHOTS.
fn check_snapshot(name: &str, got: &str) -> Option<String> {
    let path = snapshot_dir().join(name);
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, got).unwrap();
        return None;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    (want != got).then(|| format!("{}: differs (UPDATE_SNAPSHOTS=1 rewrites it)\n--- got ---\n{got}", path.display()))
}

/// The subcommands `rloo [path] --help` lists.
fn listed(path: &[&str]) -> Vec<String> {
    let out = ok(rloo(&[path, &["--help"]].concat()));
    let help = String::from_utf8(out.stdout).unwrap();
    let commands = help.split("Commands:\n").nth(1).map(|rest| rest.split("\n\n").next().unwrap_or(""));
    commands
        .into_iter()
        .flat_map(str::lines)
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

#[test]
fn every_help_matches_its_snapshot() {
    let mut failures = Vec::new();
    for path in COMMANDS {
        let out = ok(rloo(&[path, &["--help"][..]].concat()));
        let help = String::from_utf8(out.stdout).unwrap();
        let name = if path.is_empty() { "rloo".to_string() } else { format!("rloo-{}", path.join("-")) };
        failures.extend(check_snapshot(&format!("help/{name}.txt"), &help));
        // Every subcommand has a one-line description.
        for line in help.split("Commands:\n").nth(1).unwrap_or("").split("\n\n").next().unwrap_or("").lines() {
            assert!(line.split_whitespace().count() >= 2, "`{line}` in `rloo {}` has no description", path.join(" "));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    for parent in [&[][..], &["data"], &["reward"]] {
        for sub in listed(parent) {
            let path: Vec<&str> = parent.iter().copied().chain([sub.as_str()]).collect();
            assert!(COMMANDS.contains(&path.as_slice()), "`rloo {}` has no help snapshot", path.join(" "));
        }
    }
}

/// The errors a user meets first: misspelt flags, two names of one
/// setting, missing inputs, unknown config keys. Each names what is wrong
/// and exits with 2 (usage) or 1 (a run that cannot start).
#[test]
fn key_errors_match_their_snapshots() {
    let tmp = tempfile::tempdir().unwrap();
    let bad_toml = tmp.path().join("sft.toml");
    std::fs::write(&bad_toml, "learning_rat = 1e-5\n").unwrap();
    let bad_toml = bad_toml.to_str().unwrap();
    let policy = model_dir("gpt_neox-causal");
    let policy = policy.to_str().unwrap();
    let cases: &[(&str, &[&str], i32)] = &[
        ("train-misspelt-flag", &["train", "--learning_rat", "1e-5"], 2),
        ("train-two-names", &["train", "--kl_coef", "0.1", "--beta", "0.2"], 2),
        ("train-fp16", &["train", "--fp16"], 2),
        ("train-not-a-number", &["train", "--learning_rate", "fast"], 2),
        ("train-no-policy", &["train", "--dataset_name", "x.jsonl", "--print_config"], 1),
        (
            "train-reward-funcs",
            &[
                "train",
                "--model_name_or_path",
                policy,
                "--dataset_name",
                "x.jsonl",
                "--reward_funcs",
                "lenght",
                "--print_config",
            ],
            1,
        ),
        ("sft-misspelt-flag", &["sft", "--datset", "x.jsonl"], 2),
        ("sft-two-names", &["sft", "--model", "a", "--model_name_or_path", "b"], 2),
        ("sft-no-model", &["sft", "--dataset", "x.jsonl", "--print_config"], 1),
        ("sft-unknown-config-key", &["sft", bad_toml, "--print_config"], 1),
        (
            "reward-train-dash-and-underscore",
            &["reward", "train", "--per-device-train-batch-size", "2", "--per_device_train_batch_size", "4"],
            2,
        ),
        ("reward-train-no-data", &["reward", "train", "--model", policy, "--print_config"], 1),
    ];
    let mut failures = Vec::new();
    for (name, args, code) in cases {
        let out = rloo(args);
        assert_eq!(out.status.code(), Some(*code), "{name}: {}", String::from_utf8_lossy(&out.stderr));
        let stderr = String::from_utf8_lossy(&out.stderr).replace(bad_toml, "SFT.toml").replace(policy, "POLICY");
        failures.extend(check_snapshot(&format!("errors/{name}.txt"), &stderr));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
