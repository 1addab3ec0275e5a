//! Rewards through the public API, as the trainer uses them: `[[reward]]`
//! tables built into a set, a batch of samples scored by a fixture reward
//! model and rules together, then shaped.

mod common;

use candle_core::{DType, Device};
use serde_json::{json, Map, Value};

use common::*;
use rloo::data::Prompt;
use rloo::reward::{build, RewardSpec, Sample, Shaping};

fn expected_rows(name: &str) -> Vec<Map<String, Value>> {
    let path = fixtures().join("score/expected").join(format!("{name}.jsonl"));
    std::fs::read_to_string(&path).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn model_and_rules_combine_into_one_shaped_score() {
    let rm_dir = model_dir("llama-seqcls");
    let specs: Vec<RewardSpec> = serde_json::from_value(json!([
        {"type": "model", "name": "rm", "path": rm_dir, "batch_size": 2},
        {"type": "exact_match", "name": "answer", "column": "answer", "weight": 2.0},
        {"type": "count", "name": "dots", "substring": ".", "weight": 0.0}
    ]))
    .unwrap();
    let rewards = build(&specs, &Device::Cpu, DType::F32).unwrap();
    assert_eq!(rewards.names(), ["rm", "answer", "dots"]);

    let expected = expected_rows("llama-seqcls");
    let prompts: Vec<Prompt> = expected.iter().map(|r| Prompt::from_value(&r["prompt"]).unwrap()).collect();
    let completions: Vec<&str> = expected.iter().map(|r| r["completion"].as_str().unwrap()).collect();
    // Only the first row carries an answer, and its completion matches it.
    let rows: Vec<Map<String, Value>> = completions
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let row = if i == 0 { json!({"answer": c.trim()}) } else { json!({}) };
            row.as_object().unwrap().clone()
        })
        .collect();
    let ids: Vec<Vec<u32>> = vec![vec![0; 3]; completions.len()];
    let eos = [true, false, true];
    let samples: Vec<Sample> = (0..completions.len())
        .map(|i| Sample {
            prompt: &prompts[i],
            completion: completions[i],
            completion_ids: &ids[i],
            ended_with_eos: eos[i],
            row: &rows[i],
            group: i,
        })
        .collect();

    let scores = rewards.score(&samples).unwrap();
    let rm: Vec<f32> = expected.iter().map(|r| r["score"].as_f64().unwrap() as f32).collect();
    let want = [rm[0] + 2.0, rm[1], rm[2]];
    for (got, want) in scores.total.iter().zip(want) {
        assert!((got.unwrap() - want).abs() < 1e-4, "{:?}", scores.total);
    }
    assert_eq!(scores.per_source[1].1, [Some(1.0), None, None]);
    assert_eq!(scores.per_source[2].1, [Some(1.0), Some(1.0), Some(1.0)]);
    assert_eq!(scores.unscorable(), 0);
    let metric_names: Vec<String> = scores.metrics().into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        metric_names,
        [
            "rewards/rm/mean",
            "rewards/rm/std",
            "rewards/answer/mean",
            "rewards/answer/std",
            "rewards/dots/mean",
            "rewards/dots/std"
        ]
    );

    let shaping = Shaping { missing_eos_penalty: Some(1.0), normalize: false, clip: Some([-1.0, 2.0]) };
    let shaped = shaping.apply(&scores.total, &eos);
    let want = [(rm[0] + 2.0).clamp(-1.0, 2.0), (rm[1] - 1.0).clamp(-1.0, 2.0), rm[2].clamp(-1.0, 2.0)];
    for (got, want) in shaped.iter().zip(want) {
        assert!((got.unwrap() - want).abs() < 1e-4, "{shaped:?}");
    }
}
