//! Datasets as users download them: every file format gives the same rows,
//! names resolve like `datasets` and the hub lay them out, filters and
//! `take` apply while streaming, and `rloo data` inspects and prepares the
//! upstream schemas into files the trainers take. The files under
//! tests/fixtures/datasets come from scripts/fixtures/make_dataset_fixtures.py
//! (pyarrow and datasets).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use rloo::data::prompts::{length_filter, PromptDataset, PromptSpec};
use rloo::data::source::resolve;
use rloo::data::{read_rows, DatasetSpec, Tokenizer};
use rloo::model::hub::HubEnv;
use serde_json::{json, Value};

fn data(rel: &str) -> PathBuf {
    fixtures().join("datasets").join(rel)
}

fn spec(path: &Path) -> DatasetSpec {
    DatasetSpec::named(path.to_str().unwrap())
}

fn read_jsonl(path: &Path) -> Vec<Value> {
    read_rows(path).unwrap().into_iter().map(|r| Value::Object(r.fields)).collect()
}

#[test]
fn every_format_gives_the_same_rows() {
    let reference = read_jsonl(&data("formats/rows.jsonl"));
    assert_eq!(reference.len(), 5);
    for name in [
        "rows.json",
        "rows_data.json",
        "rows.jsonl.gz",
        "rows.jsonl.zst",
        "rows.parquet",
        "rows_zstd.parquet",
        "rows.arrow",
        "rows_stream.arrow",
        "saved",
    ] {
        let rows: Vec<Value> = spec(&data(&format!("formats/{name}")))
            .read_all()
            .unwrap()
            .into_iter()
            .map(|r| Value::Object(r.fields))
            .collect();
        assert_eq!(rows, reference, "{name}");
    }
    // Text formats have no types: every cell is a string, an empty cell is "".
    for name in ["rows.csv", "rows.tsv"] {
        let rows = read_rows(data(&format!("formats/{name}"))).unwrap();
        assert_eq!(rows[1].fields["prompt"], json!("Prompt 1: say \"hi\",\nthen stop"), "{name}");
        assert_eq!(rows[3].fields["score"], json!(""), "{name}");
        assert_eq!(rows[4].fields["id"], json!("4"), "{name}");
    }
}

#[test]
fn parquet_nested_and_dictionary_columns_become_json() {
    let rows = read_rows(data("formats/rows.parquet")).unwrap();
    assert_eq!(
        rows[1].fields["messages"],
        json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question 1?"}])
    );
    assert_eq!(rows[1].fields["lang"], json!("chinese"), "dictionary-encoded");
    assert_eq!(rows[2].fields["meta"], json!({"source": "synthetic", "n": 20}));
    assert_eq!(rows[3].fields["score"], Value::Null);
    assert_eq!(rows[4].at.to_string(), ": row 5 (row group 2)");
}

#[test]
fn datasets_saves_resolve_by_split() {
    let dict = data("formats/saved_dict");
    let test = DatasetSpec { split: "test".into(), ..spec(&dict) }.read_all().unwrap();
    assert_eq!(test.iter().map(|r| r.fields["id"].clone()).collect::<Vec<_>>(), [json!(3), json!(4)]);
    let err = DatasetSpec { split: "validation".into(), ..spec(&dict) }.read_all().unwrap_err().to_string();
    assert!(err.ends_with("no split `validation` in this save (splits: train, test)"), "{err}");
}

#[test]
fn hub_ids_resolve_in_the_local_cache_with_configurations_and_shards() {
    let cache = data("hub");
    let env = HubEnv::from_lookup(|k| match k {
        "HF_HUB_CACHE" => Some(cache.to_str().unwrap().to_string()),
        "HF_HUB_OFFLINE" => Some("1".into()),
        _ => None,
    });
    let files = resolve(&DatasetSpec::named("org/tiny"), &env).unwrap();
    let names: Vec<String> = files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
    assert_eq!(names, ["train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]);
    let test = resolve(&DatasetSpec::named("org/tiny").with_split("test"), &env).unwrap();
    assert_eq!(test.len(), 1);
    let pref = DatasetSpec { config: Some("preference".into()), ..DatasetSpec::named("org/tiny") };
    assert!(resolve(&pref, &env).unwrap()[0].ends_with("preference/train.jsonl.gz"));
    let err = resolve(&DatasetSpec::named("org/absent"), &env).unwrap_err().to_string();
    assert!(err.contains("not in the Hugging Face cache") && err.contains("HF_HUB_OFFLINE"), "{err}");
}

#[test]
fn filter_and_take_apply_while_streaming() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("d.jsonl");
    std::fs::write(&path, "{\"n\": 1}\n{\"n\": 2}\n{\"n\": 3}\nnot json\n").unwrap();
    let take = DatasetSpec { take: Some(2), filter: Some("n >= 2".into()), ..spec(&path) };
    let rows = take.read_all().unwrap();
    assert_eq!(rows.iter().map(|r| r.fields["n"].clone()).collect::<Vec<_>>(), [json!(2), json!(3)]);
    assert!(spec(&path)
        .read_all()
        .unwrap_err()
        .to_string()
        .ends_with("d.jsonl:4: invalid JSON: expected ident at line 1 column 2"));

    let bad = DatasetSpec { filter: Some("id < 2 or nope == 1".into()), ..spec(&data("formats/rows.parquet")) };
    let err = bad.read_all().unwrap_err().to_string();
    assert!(
        err.ends_with(
            "rows.parquet: row 3 (row group 1): --dataset_filter at character 11: no column `nope` \
                       (columns: id, prompt, messages, score, ok, lang, meta)"
        ),
        "{err}"
    );
    let none = DatasetSpec { filter: Some("lang == \"french\"".into()), ..spec(&data("formats/rows.arrow")) };
    let err = none.read_all().unwrap_err().to_string();
    assert!(err.ends_with("--dataset_filter \"lang == \\\"french\\\"\" kept none of the 5 rows"), "{err}");
}

#[test]
fn prompt_datasets_read_any_format_and_filter_length_drops_long_prompts() {
    let tok = Tokenizer::from_dir(&model_dir("qwen2-causal")).unwrap();
    let source = DatasetSpec { filter: Some("id != 3".into()), ..spec(&data("formats/rows.parquet")) };
    let chat = PromptSpec { prompt_column: "prompt".into(), chat: true, ..Default::default() };
    let ds = PromptDataset::load(&source, &chat, &tok).unwrap();
    assert_eq!(ds.len(), 4);
    let longest = ds.rows.iter().map(|r| r.ids.len()).max().unwrap();
    let shortest = ds.rows.iter().map(|r| r.ids.len()).min().unwrap();
    assert!(shortest < longest);
    // filter_length keeps prompts of at most 0.9 x response_length tokens.
    let response_length = (longest * 10).div_ceil(9) - 1;
    assert!(length_filter(response_length) < longest);
    let filtered = PromptSpec { length_filter: Some(length_filter(response_length)), ..chat };
    let ds = PromptDataset::load(&source, &filtered, &tok).unwrap();
    assert_eq!(ds.skipped_long, 4 - ds.len());
    assert!(ds.rows.iter().all(|r| r.ids.len() <= length_filter(response_length)));
}

#[test]
fn inspect_prints_splits_schema_rows_and_token_lengths() {
    let out = rloo(&["data", "inspect", data("tldr").to_str().unwrap(), "--rows", "1"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("splits: test, train, valid1"), "{text}");
    assert!(text.contains("  prompt: string\n  chosen: string\n  rejected: string\nrows: 10\n"), "{text}");

    let parquet = data("formats/rows.parquet");
    let model = model_dir("qwen2-causal");
    let args =
        ["data", "inspect", parquet.to_str().unwrap(), "--tokenizer", model.to_str().unwrap(), "--column", "messages"];
    let out = rloo(&args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("  messages: list<struct<role: string, content: string>>"), "{text}");
    assert!(text.contains("  lang: dictionary<string>"), "{text}");
    assert!(text.contains("tokens of `messages`:\n  min "), "{text}");

    let out = rloo(&["data", "inspect", data("helpsteer3").to_str().unwrap()]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("choose a configuration with --dataset_config (edit, preference have it)"), "{err}");
}

/// Runs `rloo data prepare` and returns the output directory.
fn prepare(tmp: &Path, args: &[&str]) -> PathBuf {
    let out = tmp.join("prepared");
    let mut all = vec!["data", "prepare"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--output-dir", out.to_str().unwrap()]);
    let run = rloo(&all);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    out
}

#[test]
fn helpsteer3_english_preferences_prompts_and_sft_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let input = data("helpsteer3");
    let out = prepare(
        tmp.path(),
        &["helpsteer3", "--input", input.to_str().unwrap(), "--dataset_filter", "language == \"english\""],
    );
    let pairs = read_jsonl(&out.join("preference/train.jsonl"));
    assert_eq!(pairs.len(), 10, "11 English rows, one a tie");
    let first = &pairs[0];
    assert_eq!(first["chosen"].as_str().unwrap().split(':').next(), Some("R1 of 0"), "-3: response 1 is better");
    assert_eq!(first["prompt"][0]["role"], json!("user"));
    assert_eq!(read_jsonl(&out.join("prompts/train.jsonl")).len(), 10, "ties are left out");
    assert_eq!(read_jsonl(&out.join("sft/train.jsonl"))[0]["completion"], first["chosen"]);
    assert_eq!(read_jsonl(&out.join("preference/validation.jsonl")).len(), 2);
    let args: Value = serde_json::from_str(&std::fs::read_to_string(out.join("prepare_args.json")).unwrap()).unwrap();
    assert_eq!(args["options"]["recipe"], json!("helpsteer3"));
    assert_eq!(args["splits"]["train"]["skipped"]["a tie (overall_preference 0)"], json!(1));
    assert_eq!(args["splits"]["train"]["read"], json!(11), "rows the filter kept");
}

#[test]
fn hh_splits_transcripts_and_drops_what_seed_options_say() {
    let tmp = tempfile::tempdir().unwrap();
    let input = data("hh");
    let out = prepare(
        tmp.path(),
        &["hh", "--input", input.to_str().unwrap(), "--dataset_config", "helpful-base", "--remove-same-responses"],
    );
    let pairs = read_jsonl(&out.join("preference/train.jsonl"));
    assert_eq!(pairs.len(), 6, "8 rows, one with different prefixes, one with equal answers");
    assert!(pairs[0]["chosen"].as_str().unwrap().starts_with("Good answer 0"));
    assert_eq!(pairs[1]["prompt"].as_array().unwrap().len(), 3, "user, assistant, user");
    assert_eq!(read_jsonl(&out.join("preference/test.jsonl")).len(), 3);
}

#[test]
fn tldr_comparisons_dedupe_prompts_and_hold_out_validation() {
    let tmp = tempfile::tempdir().unwrap();
    let input = data("tldr");
    let out = prepare(
        tmp.path(),
        &[
            "tldr",
            "--input",
            input.to_str().unwrap(),
            "--remove-same-inputs",
            "--validation-percentage",
            "20",
            "--shuffle",
        ],
    );
    let train = read_jsonl(&out.join("prompts/train.jsonl"));
    let validation = read_jsonl(&out.join("prompts/validation.jsonl"));
    assert_eq!((train.len(), validation.len()), (4, 1), "5 distinct posts, 20% held out");
    assert!(train[0]["prompt"].as_str().unwrap().ends_with("TL;DR:"));
    assert!(train[0]["reference"].as_str().unwrap().starts_with("good summary"));
    assert!(read_jsonl(&out.join("sft/train.jsonl"))[0]["completion"].as_str().unwrap().starts_with(" good summary"));
    assert_eq!(read_jsonl(&out.join("preference/valid1.jsonl")).len(), 1, "deduped too");

    let sft_form = data("tldr_sft");
    let out = prepare(tmp.path(), &["tldr", "--input", sft_form.to_str().unwrap()]);
    assert_eq!(read_jsonl(&out.join("sft/train.jsonl")).len(), 4);
    assert!(!out.join("preference").join("train.jsonl").exists(), "files of the earlier preparation are removed");
}

#[test]
fn imdb_prompts_and_token_limits() {
    let tmp = tempfile::tempdir().unwrap();
    let input = data("imdb");
    let out = prepare(tmp.path(), &["imdb", "--input", input.to_str().unwrap(), "--prompt-words", "4"]);
    let prompts = read_jsonl(&out.join("prompts/train.jsonl"));
    assert_eq!(prompts.len(), 6);
    assert_eq!(prompts[0]["prompt"].as_str().unwrap().split(' ').count(), 4);
    assert_eq!(read_jsonl(&out.join("sft/train.jsonl")).len(), 3, "positive reviews only");

    let model = model_dir("gpt_neox-causal");
    let out = prepare(
        tmp.path(),
        &["imdb", "--input", input.to_str().unwrap(), "--tokenizer", model.to_str().unwrap(), "--max-length", "1"],
    );
    let args: Value = serde_json::from_str(&std::fs::read_to_string(out.join("prepare_args.json")).unwrap()).unwrap();
    assert_eq!(args["splits"]["train"]["skipped"]["over --max-length or --max-prompt-length tokens"], json!(6));
}

/// Options that would quietly give a useless or self-destroying result
/// are refused before anything is read or written: empty prompts, and an
/// output directory that is the input, inside it, or over its file.
#[test]
fn prepare_refuses_empty_prompts_and_writing_into_its_input() {
    let tmp = tempfile::tempdir().unwrap();
    let imdb = tmp.path().join("imdb");
    std::fs::create_dir_all(imdb.join("plain_text")).unwrap();
    for entry in std::fs::read_dir(data("imdb/plain_text")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), imdb.join("plain_text").join(entry.file_name())).unwrap();
    }
    let listing = || {
        let mut names: Vec<_> = std::fs::read_dir(&imdb).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        names
    };
    let before = listing();
    let input = imdb.to_str().unwrap();
    let run = |out: &str, extra: &[&str]| {
        let mut args = vec!["data", "prepare", "imdb", "--input", input, "--output-dir", out];
        args.extend_from_slice(extra);
        err(rloo(&args))
    };
    let prepared = tmp.path().join("prepared");
    let e = run(prepared.to_str().unwrap(), &["--prompt-words", "0"]);
    assert!(e.contains("--prompt-words must be at least 1: with 0 every imdb prompt is empty"), "{e}");
    let e = run(input, &[]);
    assert!(e.contains(&format!("--output-dir {input} is the dataset directory --input")), "{e}");
    let inside = imdb.join("prepared");
    let e = run(inside.to_str().unwrap(), &[]);
    assert!(e.contains("is inside the dataset directory"), "{e}");
    // Another spelling of the same directory.
    let e = run(&format!("{}/../imdb/.", input), &[]);
    assert!(e.contains("is the dataset directory"), "{e}");
    assert_eq!(listing(), before, "nothing was written into the input");

    // A single file where the output would write.
    let out = tmp.path().join("out");
    std::fs::create_dir_all(out.join("prompts")).unwrap();
    let file = out.join("prompts/train.jsonl");
    std::fs::write(&file, "{\"text\": \"A fine film, truly.\", \"label\": 1}\n").unwrap();
    let e = err(rloo(&[
        "data",
        "prepare",
        "imdb",
        "--input",
        file.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ]));
    assert!(e.contains("would overwrite or remove"), "{e}");
}

#[test]
fn prepared_files_train_a_reward_model_and_fine_tune() {
    let tmp = tempfile::tempdir().unwrap();
    let tldr = data("tldr");
    let prepared = prepare(tmp.path(), &["tldr", "--input", tldr.to_str().unwrap()]);
    let rm = tmp.path().join("rm");
    let run = rloo(&[
        "reward",
        "train",
        "--model",
        model_dir("gpt_neox-seqcls").to_str().unwrap(),
        "--dataset",
        prepared.to_str().unwrap(),
        "--dataset_config",
        "preference",
        "--dataset_test_split",
        "valid1",
        "--output-dir",
        rm.to_str().unwrap(),
        "--device",
        "cpu",
        "--max-length",
        "96",
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));

    let hs3 = tmp.path().join("hs3");
    std::fs::create_dir(&hs3).unwrap();
    let qwen2 = model_dir("qwen2-causal");
    let input = data("helpsteer3");
    let limits = ["--tokenizer", qwen2.to_str().unwrap(), "--max-length", "128"];
    let prepared = prepare(&hs3, &[&["helpsteer3", "--input", input.to_str().unwrap()][..], &limits].concat());
    let run = rloo(&[
        "sft",
        "--model",
        qwen2.to_str().unwrap(),
        "--dataset",
        prepared.to_str().unwrap(),
        "--dataset_config",
        "sft",
        "--dataset_test_split",
        "validation",
        "--output-dir",
        tmp.path().join("sft").to_str().unwrap(),
        "--device",
        "cpu",
        "--max-length",
        "128",
    ]);
    assert!(run.status.success(), "{}", String::from_utf8_lossy(&run.stderr));
    let metrics = std::fs::read_to_string(tmp.path().join("sft/metrics.jsonl")).unwrap();
    assert!(metrics.contains("eval/loss"), "the validation split is the held-out set");
}

#[test]
fn train_reads_a_cached_hub_dataset_through_a_filter() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    let policy = model_dir("gpt_neox-causal");
    let args = [
        "train",
        "--dataset_name",
        "org/tiny",
        "--dataset_filter",
        "idx != 0",
        "--model_name_or_path",
        policy.to_str().unwrap(),
        "--output_dir",
        out.to_str().unwrap(),
        "--per_device_train_batch_size",
        "4",
        "--total_episodes",
        "8",
        "--response_length",
        "8",
        "--device",
        "cpu",
        "--set",
        "reward=[{type=\"count\", substring=\"e\"}]",
    ];
    let run = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_rloo"))
            .args(args)
            .args(extra)
            .env("HF_HUB_CACHE", data("hub"))
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .unwrap()
    };
    let done = run(&[]);
    let log = String::from_utf8_lossy(&done.stderr);
    assert!(done.status.success(), "{log}");
    assert!(log.contains("--dataset_filter \"idx != 0\" kept 4 of 5 rows"), "{log}");
    let config = std::fs::read_to_string(out.join("rloo_config.toml")).unwrap();
    assert!(config.contains("filter = \"idx != 0\""), "{config}");

    // Six-word prompts are longer than 0.9 x 8 tokens.
    let refused = run(&["--filter_length", "true", "--overwrite_output_dir", "true"]);
    let log = String::from_utf8_lossy(&refused.stderr);
    assert!(log.contains("all 4 prompts are longer than max_prompt_length, filter_length"), "{log}");
}

/// A stand-in for the hub's dataset API serving `files` of `org/remote`:
/// the repo listing, and each file by byte range with the headers
/// `hf-hub` reads. Returns its URL and the paths it was asked for.
fn stub_hub(files: Vec<(&'static str, Vec<u8>)>) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use common::stub::{Reply, Stub};
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = asked.clone();
    let stub = Stub::start(move |seen| {
        log.lock().unwrap().push(seen.path.clone());
        if seen.path == "/api/datasets/org/remote/revision/main" {
            let siblings: Vec<Value> = files.iter().map(|(name, _)| json!({"rfilename": name})).collect();
            return Reply::Json(200, json!({"sha": "f".repeat(40), "siblings": siblings}).to_string());
        }
        let file = seen.path.strip_prefix("/datasets/org/remote/resolve/main/");
        let Some((_, bytes)) = files.iter().find(|(name, _)| Some(*name) == file) else {
            return Reply::Bytes(404, Vec::new(), Vec::new());
        };
        let (start, end) = match seen.header("Range").and_then(|r| r.strip_prefix("bytes=")) {
            Some(r) => {
                let (a, b) = r.split_once('-').unwrap();
                (a.parse().unwrap(), b.parse().map_or(bytes.len(), |b: usize| b + 1))
            }
            None => (0, bytes.len()),
        };
        let headers = [
            ("Content-Range", format!("bytes {start}-{}/{}", end - 1, bytes.len())),
            ("ETag", format!("\"etag{}\"", bytes.len())),
            ("X-Repo-Commit", "f".repeat(40)),
        ];
        Reply::Bytes(206, headers.into_iter().map(|(k, v)| (k.to_string(), v)).collect(), bytes[start..end].to_vec())
    });
    (stub.url, asked)
}

#[test]
fn hub_datasets_download_only_the_split_they_read() {
    let snapshot = data("hub/datasets--org--tiny/snapshots/0123456789abcdef0123456789abcdef01234567");
    let read = |rel: &str| std::fs::read(snapshot.join(rel)).unwrap();
    let (url, asked) = stub_hub(vec![
        ("README.md", b"# remote\n".to_vec()),
        ("data/train-00000-of-00002.parquet", read("data/train-00000-of-00002.parquet")),
        ("data/train-00001-of-00002.parquet", read("data/train-00001-of-00002.parquet")),
        ("data/test-00000-of-00001.parquet", read("data/test-00000-of-00001.parquet")),
    ]);
    let cache = tempfile::tempdir().unwrap();
    let inspect = |offline: &str| {
        Command::new(env!("CARGO_BIN_EXE_rloo"))
            .args(["data", "inspect", "org/remote", "--rows", "0"])
            .env("HF_HUB_CACHE", cache.path())
            .env("HF_ENDPOINT", &url)
            .env("HF_HUB_OFFLINE", offline)
            .output()
            .unwrap()
    };
    let out = inspect("0");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("rows: 5\n"), "{text}");
    let paths = asked.lock().unwrap().clone();
    assert!(paths.iter().all(|p| !p.contains("test-") && !p.contains("README")), "{paths:?}");
    // Now in the cache: read again with downloads off.
    let again = inspect("1");
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert!(String::from_utf8_lossy(&again.stdout).contains("rows: 5\n"));
}
