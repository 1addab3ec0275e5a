//! The generation engine: greedy parity with transformers' `generate`,
//! reproducible sampling, stopping, and agreement of the sampler's
//! log-probs with the training forward.

mod common;

use candle_core::{DType, Device};
use common::*;
use rloo::generate::{
    generate, warm_up, Completion, FinishReason, GenerateOptions, Sampler, Sampling, Stepping, StopCriteria,
};
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

/// The warm-up that `rloo generate` and `rloo serve` run on a GPU before
/// their first batch: it decodes on every architecture, with each way of
/// stepping and picking, and leaves nothing that changes the completions
/// after it.
#[test]
fn a_warm_up_changes_no_later_completion() {
    let prompts = vec![vec![5, 9, 12], vec![40]];
    let sampling = Sampling::temperature(0.9).with_top_k(50);
    for name in causal_models() {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        for (sampler, stepping) in [(Sampler::Host, Stepping::Shrink), (Sampler::Race, Stepping::Fixed)] {
            let opts = GenerateOptions { sampler, stepping, ..options(sampling.clone(), 6, 2, 4, vec![]) };
            let cold = run(&model, &prompts, &opts);
            warm_up(model.frozen(), &Device::Cpu, sampler, stepping).unwrap();
            let warm = run(&model, &prompts, &opts);
            let tokens = |c: &[Completion]| c.iter().map(|c| c.tokens.clone()).collect::<Vec<_>>();
            assert_eq!(tokens(&warm), tokens(&cold), "{name}, {sampler:?}, {stepping:?}");
        }
    }
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

/// A request to a server: the step it arrives before, its prompt, its
/// completions and the most tokens each may take.
type Request = (usize, Vec<u32>, usize, usize);

/// Each completion's tokens and log-probs, by request.
type Served = Vec<Vec<(Vec<u32>, Vec<f32>)>>;

/// The batch's size, (rows, steps its slots hold), after a step.
type Sizes = Vec<(usize, Option<(usize, usize)>)>;

/// Serves `requests` as `rloo serve`'s batch does, stepping as `stepping`
/// says: each request's completions, and the batch's size (rows, steps its
/// slots hold) after each step that admits one and after the steps `after`.
fn serve_schedule(
    model: &Model,
    requests: &[Request],
    (stepping, sampler): (Stepping, Sampler),
    after: &[usize],
) -> (Served, Sizes) {
    use std::sync::Arc;

    use rloo::generate::decoding::{DecodeRow, Decoding, Verdict};
    use rloo::rng::Rng;

    let mut batch = Decoding::open(model.frozen(), &Device::Cpu, sampler, stepping);
    let mut done: Served = requests.iter().map(|r| vec![Default::default(); r.2]).collect();
    let mut sizes = Vec::new();
    for t in 0.. {
        let arriving: Vec<usize> = (0..requests.len()).filter(|&r| requests[r].0 == t).collect();
        if batch.is_empty() && arriving.is_empty() && requests.iter().all(|r| r.0 < t) {
            break;
        }
        for &r in &arriving {
            let (_, prompt, n, max_tokens) = &requests[r];
            let prompt: Arc<[u32]> = Arc::from(prompt.as_slice());
            let rows = (0..*n)
                .map(|c| DecodeRow {
                    prompt: prompt.clone(),
                    sampling: Sampling::temperature(1.0),
                    repetition_penalty: 1.0,
                    rng: Rng::stream(7, &[r as u64, c as u64]),
                    max_tokens: *max_tokens,
                    tokens: Vec::new(),
                    client: (r, c, Vec::new()),
                })
                .collect();
            batch.admit(rows).unwrap();
        }
        if !arriving.is_empty() {
            sizes.push((t, batch.fixed_size()));
        }
        batch
            .step(|row, pick, _, _| {
                row.client.2.push(pick.logprob);
                if row.tokens.len() < row.max_tokens {
                    return Ok(Verdict::Continues);
                }
                let (r, c, logprobs) = &mut row.client;
                done[*r][*c] = (row.tokens.clone(), std::mem::take(logprobs));
                Ok(Verdict::Leaves)
            })
            .unwrap();
        if after.contains(&t) {
            sizes.push((t, batch.fixed_size()));
        }
    }
    (done, sizes)
}

/// Fails unless `got` has `want`'s tokens, and its log-probs to rounding (a
/// product over more rows may round its last bit differently).
fn assert_served_alike(got: &Served, want: &Served, requests: &[Request], what: &str) {
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1.0));
    for (r, (got, want)) in got.iter().zip(want).enumerate() {
        for (c, (got, want)) in got.iter().zip(want).enumerate() {
            let what = format!("{what}, request {r} of {requests:?}, completion {c}");
            assert_eq!(got.0, want.0, "{what}");
            assert_eq!(got.0.len(), requests[r].3, "{what}");
            assert!(close(&got.1, &want.1), "{what}");
        }
    }
}

/// A server's batch with fixed stepping decodes what a shrinking one
/// decodes, request by request: rows that join take the places of rows
/// that left, or the batch is made again when they outgrow its places or
/// its slots or come with a prompt longer than the slots it has filled,
/// and it is compacted when few of its rows decode.
#[test]
fn a_servers_fixed_batch_decodes_what_a_shrinking_one_decodes() {
    let requests: Vec<Request> = vec![
        (0, vec![3, 4, 5, 6], 3, 10),
        (2, vec![7, 8, 9], 1, 5),
        (3, vec![10, 11], 2, 6),
        (8, (20..50).collect(), 2, 8),
        (9, vec![12, 13, 14], 1, 3),
        (13, vec![15], 1, 4),
        (14, vec![16, 17], 1, 40),
    ];
    for name in ["gpt_neox-causal", "llama-causal"] {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        for sampler in SAMPLERS {
            let (want, _) = serve_schedule(&model, &requests, (Stepping::Shrink, sampler), &[]);
            let (got, sizes) = serve_schedule(&model, &requests, (Stepping::Fixed, sampler), &[11, 16]);
            assert_served_alike(&got, &want, &requests, &format!("{name}, {sampler:?}"));
            // (rows, steps its slots hold), after each admission and two steps:
            // made for 3 rows of 4 slots and 9 steps more, twice; the free place
            // taken 2 steps on; 6 rows need 8, 7 slots filled and 2 x 6 steps; a
            // prompt of 30 slots past the 12 filled (30 + 2 x 7); a free place
            // one step on; 3 steps on, compacted to the 2 rows decoding; 3 rows
            // need 4 (35 + 2 x 3); 39 steps past the 5 left (36 + 2 x 39); 3
            // steps on, compacted to one row.
            let want = [
                (0, (4, 18)),
                (2, (4, 16)),
                (3, (8, 12)),
                (8, (8, 14)),
                (9, (8, 13)),
                (11, (2, 10)),
                (13, (4, 6)),
                (14, (4, 78)),
                (16, (1, 75)),
            ];
            assert_eq!(sizes.iter().map(|&(t, s)| (t, s.unwrap())).collect::<Vec<_>>(), want, "{name}, {sampler:?}");
        }
    }
}

/// The same over many random schedules (requests of 1 to 3 completions,
/// prompts of 1 to 12 tokens, 1 to 12 tokens each, arriving 0 to 3 steps
/// apart): among them, batches whose rows hold every place in another
/// order than the places'.
#[test]
fn a_servers_fixed_batch_decodes_what_a_shrinking_one_decodes_on_random_schedules() {
    use rloo::rng::Rng;

    let model = Model::load(&model_dir("gpt_neox-causal"), &Device::Cpu).unwrap();
    for seed in 0..200 {
        let mut draw = Rng::new(seed);
        let mut pick = |n: u64| (draw.next_u64() % n) as usize;
        let (count, mut t) = (3 + pick(10), 0);
        let requests: Vec<Request> = (0..count)
            .map(|_| {
                t += pick(4);
                let prompt = (0..1 + pick(12)).map(|_| 3 + pick(200) as u32).collect();
                (t, prompt, 1 + pick(3), 1 + pick(12))
            })
            .collect();
        let (want, _) = serve_schedule(&model, &requests, (Stepping::Shrink, Sampler::Host), &[]);
        let (got, _) = serve_schedule(&model, &requests, (Stepping::Fixed, Sampler::Host), &[]);
        assert_served_alike(&got, &want, &requests, &format!("seed {seed}"));
    }
}
