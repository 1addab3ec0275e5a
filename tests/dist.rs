//! Data-parallel `rloo train` over the CPU transport: two processes with a
//! job's batch train as one process with that batch does (to float
//! rounding), bit-identically run to run; a run continues on another
//! number of processes; and the faults: a rank that dies, one started with
//! other options, a port in use, Ctrl-C on the launcher.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use common::*;
use serde_json::{Map, Value};

fn prompts(dir: &Path) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    let rows: String = [
        "The movie was",
        "Tomorrow the weather will be",
        "I think the film",
        "We cooked",
        "The music was",
        "A story about",
        "Our trip to",
        "The best part",
    ]
    .iter()
    .map(|p| format!("{}\n", serde_json::json!({ "prompt": p })))
    .collect();
    std::fs::write(&path, rows).unwrap();
    path
}

/// `rloo train` on the fixture policy, 2 steps of 8 prompts x k = 2, two
/// epochs of two mini-batches of 8 completions each; `extra` sizes the
/// micro-batches and says where the run goes.
fn train_args(dir: &Path, out: &str, extra: &[&str]) -> Vec<String> {
    let policy = model_dir("gpt_neox-causal");
    let mut args: Vec<String> = [
        "train",
        "--sft_model_path",
        policy.to_str().unwrap(),
        "--dataset_name",
        prompts(dir).to_str().unwrap(),
        "--output_dir",
        dir.join(out).to_str().unwrap(),
        "--set",
        "reward=[{type=\"count\", substring=\"e\"}, {type=\"length\", weight=0.05}]",
        "--response_length",
        "12",
        "--learning_rate",
        "1e-5",
        "--rloo_k",
        "2",
        "--num_mini_batches",
        "2",
        "--num_ppo_epochs",
        "2",
        "--total_episodes",
        "32",
        "--num_sample_generations",
        "0",
        "--device",
        "cpu",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A run far longer than a test waits for.
fn endless(args: &mut [String]) {
    let at = args.iter().position(|a| a == "--total_episodes").unwrap();
    args[at + 1] = "100000".into();
}

fn free_port() -> String {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string()
}

/// One process, one thread (as each of two processes gets on two cores).
fn one_process(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rloo")).args(args).env("RAYON_NUM_THREADS", "1").output().unwrap()
}

fn launch(n: usize, args: &[String]) -> Output {
    launch_with(n, args, &[])
}

fn launch_with(n: usize, args: &[String], env: &[(&str, &str)]) -> Output {
    let n = n.to_string();
    let port = free_port();
    let mut all = vec!["launch", "--nproc_per_node", &n, "--master_port", &port, "--timeout", "60", "--"];
    all.extend(args.iter().map(String::as_str));
    let mut command = Command::new(env!("CARGO_BIN_EXE_rloo"));
    command.args(&all).env("RAYON_NUM_THREADS", "1").envs(env.iter().copied());
    command.output().unwrap()
}

fn weights(run: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(run.join("model.safetensors"), &Device::Cpu).unwrap()
}

fn largest_weight_difference(a: &Path, b: &Path) -> f32 {
    let (a, b) = (weights(a), weights(b));
    assert_eq!(a.len(), b.len());
    a.iter().map(|(name, t)| max_diff(t, &b[name])).fold(0.0, f32::max)
}

/// Each step's metrics without the timings.
fn metrics(run: &Path) -> Vec<Map<String, Value>> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut row: Map<String, Value> = serde_json::from_str(l).unwrap();
            row.retain(|k, _| !k.starts_with("time/") && !k.starts_with("memory/") && k != "eps");
            row
        })
        .collect()
}

fn samples(run: &Path) -> Vec<Value> {
    std::fs::read_to_string(run.join("samples.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// Metrics equal to rounding: relative to their size, or absolute near zero.
fn assert_close_metrics(a: &[Map<String, Value>], b: &[Map<String, Value>], tolerance: f64) {
    assert_eq!(a.len(), b.len(), "steps");
    for (step, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.keys().collect::<Vec<_>>(), y.keys().collect::<Vec<_>>(), "step {}", step + 1);
        for (key, value) in x {
            let (u, v) = (value.as_f64().unwrap(), y[key].as_f64().unwrap());
            assert!((u - v).abs() <= tolerance * u.abs().max(1.0), "step {} {key}: {u} vs {v}", step + 1);
        }
    }
}

#[test]
fn two_processes_train_as_one_process_with_the_same_batch() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // Mini-batches of 8: 4 x 2 in one process, 2 x 2 x 2 processes.
    ok(one_process(&train_args(
        dir,
        "one",
        &["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"],
    )));
    let two = train_args(dir, "two", &["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]);
    let out = ok(launch(2, &two));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("mini-batch(es) of 8 = 2 micro-batch(es) of 2 on each of 2 processes"), "{log}");
    assert_eq!(log.matches("trained 2 steps").count(), 1, "one rank reports: {log}");
    let (one, two_dir) = (dir.join("one"), dir.join("two"));
    // The same prompts, sampled from the same streams, give the same completions.
    assert_eq!(samples(&one), samples(&two_dir));
    assert_close_metrics(&metrics(&one), &metrics(&two_dir), 1e-3);
    let diff = largest_weight_difference(&one, &two_dir);
    assert!(diff < 1e-5, "weights differ by {diff}");
    for file in ["samples.jsonl", "config.json", "rloo_config.toml", "checkpoint-2/trainer_state.json"] {
        assert!(two_dir.join(file).is_file(), "{file}");
    }

    // Run to run at two processes: the same to the bit.
    let again = train_args(dir, "again", &["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]);
    ok(launch(2, &again));
    let again = dir.join("again");
    assert_eq!(metrics(&two_dir), metrics(&again));
    assert_eq!(samples(&two_dir), samples(&again));
    assert_eq!(
        std::fs::read(two_dir.join("model.safetensors")).unwrap(),
        std::fs::read(again.join("model.safetensors")).unwrap()
    );

    // ZeRO stage 1: each process keeps and steps half the moments; the
    // weights and the checkpoint's optimizer state are the same to the bit,
    // and a process of its own continues from it.
    let mut zero =
        train_args(dir, "zero", &["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]);
    zero.extend(["--zero_stage".into(), "1".into(), "--stop_after".into(), "1".into()]);
    ok(launch(2, &zero));
    let at_1 = |run: &str| std::fs::read(dir.join(run).join("checkpoint-1/optimizer.safetensors")).unwrap();
    let mut unsharded =
        train_args(dir, "unsharded", &["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]);
    unsharded.extend(["--stop_after".into(), "1".into()]);
    ok(launch(2, &unsharded));
    assert!(at_1("zero") == at_1("unsharded"), "the gathered optimizer state differs");
    let zero = dir.join("zero");
    let mut rest =
        train_args(dir, "zero", &["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"]);
    rest.extend(["--resume_from_checkpoint".into(), "latest".into()]);
    ok(one_process(&rest));
    let diff = largest_weight_difference(&one, &zero);
    assert!(diff < 1e-5, "ZeRO on 2 processes, then 1: weights differ by {diff}");
    let mut whole =
        train_args(dir, "zero_whole", &["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]);
    whole.extend(["--zero_stage".into(), "1".into()]);
    ok(launch(2, &whole));
    assert!(
        std::fs::read(two_dir.join("model.safetensors")).unwrap()
            == std::fs::read(dir.join("zero_whole/model.safetensors")).unwrap(),
        "ZeRO changed the weights"
    );
}

/// ZeRO stage 1 over masters kept split beside bf16 copies (the
/// default): each process sends the masters it stepped, which the others
/// split again, and the weights are those of whole f32 masters
/// (`RLOO_MASTERS=f32`) without ZeRO, to the bit.
#[test]
fn zero_over_split_masters_trains_as_whole_masters() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let sizes = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", "--bf16"];
    ok(launch_with(2, &train_args(dir, "whole", &sizes), &[("RLOO_MASTERS", "f32")]));
    let mut split = train_args(dir, "split", &sizes);
    split.extend(["--zero_stage".into(), "1".into()]);
    ok(launch_with(2, &split, &[("RLOO_MASTERS", "split")]));
    let weights = |run: &str| std::fs::read(dir.join(run).join("model.safetensors")).unwrap();
    assert!(weights("whole") == weights("split"), "ZeRO over split masters changed the weights");
}

/// A job of one process that names its transport goes through every
/// collective of a job of several (what one GPU can show of NCCL) and
/// trains as a lone process does, to the bit.
#[test]
fn a_job_of_one_runs_every_collective_and_trains_as_a_lone_process() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let sizes = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2"];
    ok(one_process(&train_args(dir, "alone", &sizes)));
    let out =
        ok(launch_with(1, &train_args(dir, "job", &sizes), &[("RLOO_DIST_BACKEND", "tcp"), ("RUST_LOG", "info")]));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("rank 0 of 1 joined the job"), "{log}");
    let (alone, job) = (dir.join("alone"), dir.join("job"));
    assert_eq!(samples(&alone), samples(&job));
    assert_eq!(metrics(&alone), metrics(&job));
    assert_eq!(largest_weight_difference(&alone, &job), 0.0);
}

#[test]
fn a_run_continues_on_another_number_of_processes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let per_process = |n: &'static str| ["--per_device_train_batch_size", n, "--gradient_accumulation_steps", "2"];
    ok(one_process(&train_args(dir, "whole", &per_process("4"))));
    let whole = dir.join("whole");

    // Two processes stop after step 1; one continues.
    let mut first = train_args(dir, "two_then_one", &per_process("2"));
    first.extend(["--stop_after".into(), "1".into()]);
    ok(launch(2, &first));
    let mut rest = train_args(dir, "two_then_one", &per_process("4"));
    rest.extend(["--resume_from_checkpoint".into(), "latest".into()]);
    let out = ok(one_process(&rest));
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("continuing a run of 2 process(es) on 1"), "{log}");
    let diff = largest_weight_difference(&whole, &dir.join("two_then_one"));
    assert!(diff < 1e-5, "2 then 1 process(es): weights differ by {diff}");
    assert_eq!(samples(&whole), samples(&dir.join("two_then_one")));

    // One process stops after step 1; two continue.
    let mut first = train_args(dir, "one_then_two", &per_process("4"));
    first.extend(["--stop_after".into(), "1".into()]);
    ok(one_process(&first));
    let mut rest = train_args(dir, "one_then_two", &per_process("2"));
    rest.extend(["--resume_from_checkpoint".into(), "latest".into()]);
    ok(launch(2, &rest));
    let diff = largest_weight_difference(&whole, &dir.join("one_then_two"));
    assert!(diff < 1e-5, "1 then 2 processes: weights differ by {diff}");
    assert_close_metrics(&metrics(&whole), &metrics(&dir.join("one_then_two")), 1e-3);

    // Another job-wide batch is another run.
    let mut wrong = train_args(dir, "one_then_two", &per_process("4"));
    let checkpoint = dir.join("one_then_two/checkpoint-1");
    wrong.extend(["--resume_from_checkpoint".into(), checkpoint.to_str().unwrap().into()]);
    let err = err(launch(2, &wrong));
    assert!(err.contains("saved by 1 process(es) training on mini-batches of 8 completions"), "{err}");
    assert!(err.contains("here 2 process(es) make 16"), "{err}");
}

/// A rank started by hand, with torchrun's variables.
fn rank(rank: usize, port: &str, args: &[String], timeout: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_rloo"))
        .args(args)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", rank.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port)
        .env("RLOO_JOB_SECRET", "test-job")
        .env("RLOO_DIST_TIMEOUT", timeout)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn finished(child: Child, within: Duration) -> (Output, Duration) {
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    let took = started.elapsed();
    assert!(took < within, "took {took:?}");
    (out, took)
}

#[test]
fn a_rank_that_differs_dies_or_cannot_listen_stops_the_job_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let sizes = ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"];

    // Another seed on rank 1: refused at start-up, by both.
    let port = free_port();
    let main = rank(0, &port, &train_args(dir, "differs", &sizes), "60");
    let mut other = train_args(dir, "differs", &sizes);
    other.extend(["--seed".into(), "7".into()]);
    let other = rank(1, &port, &other, "60");
    let (main, _) = finished(main, Duration::from_secs(60));
    let text = err(main);
    assert!(
        text.contains("[rank 0] error") && text.contains("rank 1 started with other options than rank 0"),
        "{text}"
    );
    err(finished(other, Duration::from_secs(60)).0);

    // Rank 1 killed during the run: rank 0 stops at its next exchange, naming it.
    let port = free_port();
    let mut long = train_args(dir, "dies", &sizes);
    endless(&mut long);
    let main = rank(0, &port, &long, "60");
    let mut other = rank(1, &port, &long, "60");
    progress(&dir.join("dies"));
    other.kill().unwrap();
    other.wait().unwrap();
    let (main, took) = finished(main, Duration::from_secs(30));
    let text = err(main);
    assert!(text.contains("rank 1 left the job"), "{text}");
    eprintln!("rank 0 stopped {took:?} after rank 1 was killed");

    // A hung rank (stopped): the others give up after the timeout, naming it.
    let port = free_port();
    let mut hangs = train_args(dir, "hangs", &sizes);
    endless(&mut hangs);
    let main = rank(0, &port, &hangs, "10");
    let mut other = rank(1, &port, &hangs, "10");
    progress(&dir.join("hangs"));
    stop_signal(&other, libc::SIGSTOP);
    let text = err(finished(main, Duration::from_secs(60)).0);
    assert!(text.contains("rank 1 sent nothing for 10 s"), "{text}");
    other.kill().unwrap();
    other.wait().unwrap();

    // The launcher: rank 0 cannot listen, so every rank stops and the launcher says which failed.
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let mut all = vec!["launch", "--nproc_per_node", "2", "--master_port", &port, "--"];
    let args = train_args(dir, "port", &sizes);
    all.extend(args.iter().map(String::as_str));
    let started = Instant::now();
    let text = err(Command::new(env!("CARGO_BIN_EXE_rloo")).args(&all).output().unwrap());
    assert!(started.elapsed() < Duration::from_secs(60), "took {:?}", started.elapsed());
    assert!(text.contains(&format!("127.0.0.1:{port} is in use")), "{text}");
    assert!(text.contains("rank 0 exited with status 1"), "{text}");
}

/// Waits until the run in `out` has logged two steps.
fn progress(out: &Path) {
    let metrics = out.join("metrics.jsonl");
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(&metrics).map_or(true, |m| m.lines().count() < 2) {
        assert!(Instant::now() < deadline, "the job made no progress");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn stop_signal(child: &Child, signal: libc::c_int) {
    // Safety: kill(2) on our own child, not yet reaped.
    unsafe { libc::kill(child.id() as libc::pid_t, signal) };
}

#[test]
fn ctrl_c_on_the_launcher_stops_every_rank_after_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut args =
        train_args(dir, "stopped", &["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]);
    endless(&mut args);
    let port = free_port();
    let mut all =
        vec!["launch".to_string(), "--nproc_per_node".into(), "2".into(), "--master_port".into(), port, "--".into()];
    all.extend(args);
    let launcher = Command::new(env!("CARGO_BIN_EXE_rloo")).args(&all).stderr(Stdio::piped()).spawn().unwrap();
    progress(&dir.join("stopped"));
    stop_signal(&launcher, libc::SIGINT);
    let (out, _) = finished(launcher, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(130), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("stopped by a signal"), "{text}");
    let saved: Vec<_> = std::fs::read_dir(dir.join("stopped"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    assert_eq!(saved.len(), 1, "{saved:?}");
    assert!(dir.join("stopped").join(&saved[0]).join("trainer_state.json").is_file());
}

/// `rloo sft` and `rloo reward train` on two processes: steps of 8
/// examples, 4 x 2 in one process and 2 x 2 x 2 processes.
#[test]
fn supervised_trainers_run_on_two_processes_as_on_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let sft = dir.join("sft.jsonl");
    let rows: Vec<String> = (0..16)
        .map(|i| serde_json::json!({"prompt": format!("Review {i}:"), "completion": " lovely music."}).to_string())
        .collect();
    std::fs::write(&sft, rows.join("\n")).unwrap();
    let pairs = dir.join("pairs.jsonl");
    let rows: Vec<String> = (0..16)
        .map(|i| {
            serde_json::json!({"prompt": format!("Review {i}:"), "chosen": " lovely.", "rejected": " awful."})
                .to_string()
        })
        .collect();
    std::fs::write(&pairs, rows.join("\n")).unwrap();
    let run = |command: &[&str], model: &str, data: &Path, out: &str, per_device: &str| -> Vec<String> {
        let mut args: Vec<String> = command.iter().map(|s| s.to_string()).collect();
        args.extend(
            [
                "--model",
                model_dir(model).to_str().unwrap(),
                "--dataset",
                data.to_str().unwrap(),
                "--output_dir",
                dir.join(out).to_str().unwrap(),
                "--learning_rate",
                "1e-5",
                "--num_train_epochs",
                "2",
                "--eval_fraction",
                "0.25",
                "--gradient_accumulation_steps",
                "2",
                "--per_device_train_batch_size",
                per_device,
                "--device",
                "cpu",
            ]
            .iter()
            .map(|s| s.to_string()),
        );
        args
    };
    for (command, model, data) in
        [(&["sft"][..], "gpt_neox-causal", &sft), (&["reward", "train"][..], "gpt_neox-seqcls", &pairs)]
    {
        let name = command.join("_");
        let (one, two) = (format!("{name}_one"), format!("{name}_two"));
        ok(one_process(&run(command, model, data, &one, "4")));
        // The two processes split AdamW's moments too (ZeRO stage 1).
        let mut two_args = run(command, model, data, &two, "2");
        two_args.extend(["--zero_stage".into(), "1".into()]);
        let out = ok(launch(2, &two_args));
        let log = String::from_utf8_lossy(&out.stderr);
        assert!(log.contains("x 2 processes") || log.contains("steps of 8"), "{log}");
        let diff = largest_weight_difference(&dir.join(&one), &dir.join(&two));
        assert!(diff < 1e-5, "{name}: weights differ by {diff}");
        assert_close_metrics(&metrics(&dir.join(&one)), &metrics(&dir.join(&two)), 1e-4);
        // Stopped on two processes after 2 of 4 steps, continued on one.
        let parts = format!("{name}_parts");
        let mut first = run(command, model, data, &parts, "2");
        first.extend(["--stop_after".into(), "2".into()]);
        ok(launch(2, &first));
        let mut rest = run(command, model, data, &parts, "4");
        rest.extend(["--resume_from_checkpoint".into(), "latest".into()]);
        let log = String::from_utf8_lossy(&ok(one_process(&rest)).stderr).into_owned();
        assert!(log.contains("continuing a run of 2 process(es) on 1"), "{log}");
        let diff = largest_weight_difference(&dir.join(&one), &dir.join(&parts));
        assert!(diff < 1e-5, "{name}, 2 then 1 process(es): weights differ by {diff}");
    }
}
