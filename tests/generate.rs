//! The generation engine: greedy parity with transformers' `generate`,
//! reproducible sampling, stopping, and agreement of the sampler's
//! log-probs with the training forward.

mod common;

use candle_core::{DType, Device};
use common::*;
use rloo::generate::{generate, Completion, FinishReason, GenerateOptions, Sampler, Sampling, Stepping, StopCriteria};
use rloo::model::{next_token_logprobs, GenerationConfig, Inputs, Model, PadSide};

fn options(sampling: Sampling, max_new_tokens: usize, k: usize, batch_size: usize, stop: Vec<u32>) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        num_return_sequences: k,
        sampling,
        repetition_penalty: 1.0,
        stop: StopCriteria { token_ids: stop, strings: vec![] },
        batch_size,
        sampler: Sampler::Host,
        stepping: Stepping::Shrink,
        seed: 11,
        prompt_offset: 0,
        max_positions: None,
    }
}

/// Both ways of picking tokens: each must pass what the other passes.
const SAMPLERS: [Sampler; 2] = [Sampler::Host, Sampler::Race];

fn run(model: &Model, prompts: &[Vec<u32>], opts: &GenerateOptions) -> Vec<Completion> {
    let mut done = Vec::new();
    generate(model.frozen(), prompts, opts, None, &Device::Cpu, &mut |_| {}, &mut |c| {
        done.push(c);
        Ok(())
    })
    .unwrap();
    done.sort_by_key(|c| (c.prompt_index, c.sample_index));
    done
}

fn causal_models() -> impl Iterator<Item = &'static str> {
    MODELS.iter().copied().filter(|m| is_causal(m))
}

/// Greedy decoding under a repetition penalty gives transformers' tokens
/// (`reference/repetition_penalty.json`, made by `make_fixtures.py penalty`;
/// the penalty changes most of those outputs).
#[test]
fn repetition_penalty_matches_transformers() {
    let path = fixtures().join("reference/repetition_penalty.json");
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    for name in causal_models() {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let r = &reference[name];
        let ids = |v: &serde_json::Value| -> Vec<Vec<u32>> { serde_json::from_value(v.clone()).unwrap() };
        let (prompts, want) = (ids(&r["prompts"]), ids(&r["outputs"]));
        let eos = GenerationConfig::from_dir(&model_dir(name)).unwrap().unwrap().eos_token_ids().to_vec();
        let mut opts = options(Sampling::greedy(), 12, 1, 8, eos);
        opts.repetition_penalty = r["penalty"].as_f64().unwrap() as f32;
        for sampler in SAMPLERS {
            opts.sampler = sampler;
            let got: Vec<Vec<u32>> = run(&model, &prompts, &opts).into_iter().map(|c| c.tokens).collect();
            assert_eq!(got, want, "{name}, {sampler:?}");
        }
        opts.repetition_penalty = 1.0;
        let plain: Vec<Vec<u32>> = run(&model, &prompts, &opts).into_iter().map(|c| c.tokens).collect();
        println!(
            "{name}: {} of {} completions changed by the penalty, all as transformers",
            plain.iter().zip(&want).filter(|(a, b)| a != b).count(),
            want.len()
        );
    }
}

#[test]
fn greedy_generation_matches_transformers() {
    for name in causal_models() {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let reference = reference(name);
        let eos = GenerationConfig::from_dir(&model_dir(name)).unwrap().unwrap().eos_token_ids().to_vec();
        let ids: Vec<Vec<u32>> = reference["greedy.input_ids"].to_dtype(DType::U32).unwrap().to_vec2().unwrap();
        let mask: Vec<Vec<u32>> = reference["greedy.attention_mask"].to_dtype(DType::U32).unwrap().to_vec2().unwrap();
        let out: Vec<Vec<u32>> = reference["greedy.output_ids"].to_dtype(DType::U32).unwrap().to_vec2().unwrap();
        let t = ids[0].len();
        let prompts: Vec<Vec<u32>> = ids
            .iter()
            .zip(&mask)
            .map(|(r, m)| r.iter().zip(m).filter(|(_, &m)| m == 1).map(|(&i, _)| i).collect())
            .collect();
        let new_tokens = out[0].len() - t;
        let mut opts = options(Sampling::greedy(), new_tokens, 1, 8, eos.clone());
        let host = run(&model, &prompts, &opts);
        opts.sampler = Sampler::Race;
        let race = run(&model, &prompts, &opts);
        for ((row, c), r) in out.iter().zip(&host).zip(&race) {
            assert_eq!(r.tokens, c.tokens, "{name}");
            let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
            assert!(close(&r.logprobs, &c.logprobs) && close(&r.entropies, &c.entropies), "{name}");
            // transformers pads after EOS; rloo stops there.
            let mut want = Vec::new();
            for &tok in &row[t..] {
                want.push(tok);
                if eos.contains(&tok) {
                    break;
                }
            }
            assert_eq!(c.tokens, want, "{name}: prompt {}", c.prompt_index);
            let reason = if eos.contains(want.last().unwrap()) { FinishReason::Stop } else { FinishReason::Length };
            assert_eq!(c.finish_reason, reason);
        }
        println!("{name}: greedy tokens identical to transformers for {} prompts", prompts.len());
    }
}

#[test]
fn sampling_is_reproducible_and_independent_of_batching() {
    for sampler in SAMPLERS {
        sampling_is_reproducible_and_independent_of_batching_with(sampler);
    }
}

fn sampling_is_reproducible_and_independent_of_batching_with(sampler: Sampler) {
    let model = Model::load(&model_dir("qwen2-causal"), &Device::Cpu).unwrap();
    let prompts = vec![vec![5, 9, 12], vec![40], vec![7, 7, 7, 7, 7]];
    let sampling = Sampling::temperature(0.9).with_top_k(50).with_top_p(0.95);
    let with = |batch_size: usize, seed: u64| GenerateOptions {
        sampler,
        seed,
        ..options(sampling.clone(), 10, 4, batch_size, vec![])
    };
    let a = run(&model, &prompts, &with(12, 11));
    let b = run(&model, &prompts, &with(5, 11));
    assert_eq!(a.len(), 12);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.tokens, y.tokens, "batch size must not change samples");
        assert_eq!(x.finish_reason, FinishReason::Length);
        assert_eq!(x.tokens.len(), 10);
    }
    let distinct: std::collections::HashSet<&Vec<u32>> = a.iter().map(|c| &c.tokens).collect();
    assert!(distinct.len() > 6, "k samples of a prompt differ");
    assert_ne!(run(&model, &prompts, &with(12, 12))[0].tokens, a[0].tokens, "the seed matters");
}

#[test]
fn rows_stop_at_stop_tokens_and_leave_the_batch() {
    let model = Model::load(&model_dir("gpt_neox-causal"), &Device::Cpu).unwrap();
    let prompts = vec![vec![3, 4, 5], vec![6, 7]];
    let free = run(&model, &prompts, &options(Sampling::temperature(1.0), 12, 3, 6, vec![]));
    // Stop on the third token some row produced: that row ends there, with reason `stop`.
    let stop = free[1].tokens[2];
    let stopped = run(&model, &prompts, &options(Sampling::temperature(1.0), 12, 3, 6, vec![stop]));
    for (f, s) in free.iter().zip(&stopped) {
        let cut = f.tokens.iter().position(|&t| t == stop);
        match cut {
            Some(i) => {
                assert_eq!(s.tokens, f.tokens[..=i].to_vec());
                assert_eq!(s.finish_reason, FinishReason::Stop);
            }
            None => assert_eq!(s.tokens, f.tokens, "rows that never stop are unaffected by others stopping"),
        }
    }
}

/// Fixed stepping (finished rows stay in the batch until at most half of
/// it decodes, the slot a step writes read from the device) decodes what a
/// shrinking batch decodes: the same tokens and endings, and log-probs to
/// rounding, with
/// rows of one prompt sharing its cache, rows ending at different steps
/// and the batch compacted on the way; in f32 through the decoding kernel,
/// in bf16 through the composed attention.
#[test]
fn fixed_stepping_decodes_what_a_shrinking_batch_decodes() {
    let bf16 = ["gpt_neox-causal", "llama-causal"].map(|name| (name, DType::BF16));
    for (name, dtype) in causal_models().map(|name| (name, DType::F32)).chain(bf16) {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap().with_dtype(dtype, false).unwrap();
        let prompts = vec![vec![3, 4, 5], vec![6, 7], vec![8, 9, 10, 11], vec![12]];
        let mut opts = options(Sampling::temperature(1.0), 12, 3, 12, vec![]);
        for sampler in SAMPLERS {
            (opts.sampler, opts.stepping, opts.stop.token_ids) = (sampler, Stepping::Shrink, vec![]);
            // Stop on a token of each of eight rows, at different steps: those rows end there or earlier.
            let free = run(&model, &prompts, &opts);
            opts.stop.token_ids = free[..8].iter().enumerate().map(|(i, c)| c.tokens[1 + i * 3 % 10]).collect();
            let want = run(&model, &prompts, &opts);
            let early = want.iter().filter(|c| c.tokens.len() < 12).count();
            assert!(2 * early >= want.len(), "{name}: {early} of {} rows end early: no compaction", want.len());
            for stepping in [Stepping::Fixed, Stepping::Graph] {
                opts.stepping = stepping;
                for (got, want) in run(&model, &prompts, &opts).iter().zip(&want) {
                    let what = format!("{name} {dtype:?}, {sampler:?}, {stepping:?}, prompt {}", want.prompt_index);
                    assert_eq!(got.tokens, want.tokens, "{what}");
                    assert_eq!(got.finish_reason, want.finish_reason, "{what}");
                    // A product over more rows may round its last bit differently.
                    let close =
                        |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1.0));
                    assert!(close(&got.logprobs, &want.logprobs) && close(&got.entropies, &want.entropies), "{what}");
                }
            }
            println!(
                "{name} {dtype:?}, {sampler:?}: fixed stepping as shrinking, {early} of {} rows end early",
                want.len()
            );
        }
    }
}

/// The sampling path (frozen weights, KV cache) and the training path (full
/// forward with gradients) give the same log-probs for the sampled tokens.
#[test]
fn sampler_logprobs_agree_with_the_training_forward() {
    for name in causal_models() {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let prompts = vec![vec![10, 11, 12, 13], vec![20, 21]];
        let temperature = 0.7;
        let done = run(&model, &prompts, &options(Sampling::temperature(temperature), 6, 2, 4, vec![]));
        let rows: Vec<Vec<u32>> =
            done.iter().map(|c| [prompts[c.prompt_index].clone(), c.tokens.clone()].concat()).collect();
        let inputs = Inputs::from_rows(&rows, 0, PadSide::Right, &Device::Cpu).unwrap();
        let logits = (model.network().logits(&inputs, None).unwrap() / temperature as f64).unwrap();
        let lp: Vec<Vec<f32>> = next_token_logprobs(&logits, &inputs.ids).unwrap().to_vec2().unwrap();
        let mut worst = 0f32;
        for (c, row) in done.iter().zip(&lp) {
            let start = prompts[c.prompt_index].len() - 1;
            for (k, &want) in c.logprobs.iter().enumerate() {
                worst = worst.max((row[start + k] - want).abs());
            }
        }
        println!("{name}: sampler vs training log-probs max |Δ| = {worst:.2e}");
        assert!(worst < 1e-4, "{name}: {worst}");
    }
}
