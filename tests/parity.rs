//! Parity with transformers on the committed fixtures: logits of padded
//! batches (left and right), KV-cache decoding (shared slots too), sequence
//! scores and critic values, and the gradient of every parameter. Each test prints its max |Δ|.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use rloo::model::scoring::{completion_logprobs, completion_values, sequence_scores, Pair, Sequences};
use rloo::model::{next_token_logprobs, Inputs, Model, PadSide};

const LOGIT_TOL: f32 = 1e-4;

fn inputs(reference: &std::collections::HashMap<String, Tensor>, side: &str) -> Inputs {
    let ids = &reference[&format!("{side}.input_ids")];
    let mask = &reference[&format!("{side}.attention_mask")];
    let inputs = Inputs::new(ids, mask).unwrap();
    let expected: Vec<Vec<u32>> =
        reference[&format!("{side}.position_ids")].to_dtype(DType::U32).unwrap().to_vec2().unwrap();
    assert_eq!(inputs.positions.to_vec2::<u32>().unwrap(), expected, "{side} position ids");
    inputs
}

#[test]
fn logits_match_transformers_on_padded_batches() {
    for name in MODELS {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let reference = reference(name);
        for side in ["left", "right"] {
            let inputs = inputs(&reference, side);
            let expected = &reference[&format!("{side}.logits")];
            for (which, net) in [("train", model.network()), ("frozen", model.frozen())] {
                let logits = net.logits(&inputs, None).unwrap();
                let diff = max_diff_masked(&logits, expected, &inputs.mask);
                println!("{name} {side} {which}: max |Δ logit| = {diff:.2e}");
                assert!(diff <= LOGIT_TOL, "{name} {side} {which}: max |Δ logit| = {diff}");
            }
            if !is_causal(name) {
                let scores = model.frozen().scores(&inputs).unwrap();
                let diff = max_diff(&scores, &reference[&format!("{side}.scores")]);
                println!("{name} {side}: max |Δ score| = {diff:.2e}");
                assert!(diff <= LOGIT_TOL, "{name} {side}: max |Δ score| = {diff}");
            }
        }
    }
}

#[test]
fn decoding_weight_copies_give_the_same_logits() {
    for name in MODELS {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let inputs = inputs(&reference(name), "right");
        let net = model.frozen();
        let plain = net.logits(&inputs, None).unwrap();
        let with_copies = {
            let _decoding = net.decoding_weights().unwrap();
            net.logits(&inputs, None).unwrap()
        };
        let diff = max_diff_masked(&with_copies, &plain, &inputs.mask);
        assert!(diff <= 1e-5, "{name}: decoding copies change the logits by {diff}");
    }
}

/// Completions of shared prompts, in mixed order and of mixed lengths (one
/// empty): scored together, each prompt is packed once for its rows.
fn shared_prompt_rows() -> Vec<(Vec<u32>, Vec<u32>)> {
    let prompts = [vec![5, 9, 2, 7], vec![3, 11], vec![8]];
    let completions = [vec![4, 4, 12], vec![30, 2], vec![17], vec![6, 1, 9, 40], vec![], vec![21, 22]];
    [0, 1, 0, 2, 1, 0, 2].iter().zip(&completions).map(|(&p, c)| (prompts[p].clone(), c.clone())).collect()
}

#[test]
fn rows_sharing_a_prompt_score_as_they_do_alone() {
    let rows = shared_prompt_rows();
    let dev = Device::Cpu;
    for name in MODELS {
        let model = Model::load(&model_dir(name), &dev).unwrap();
        let net = model.frozen();
        let alone = |p: &[u32], c: &[u32]| Inputs::from_rows(&[[p, c].concat()], 0, PadSide::Right, &dev).unwrap();
        if is_causal(name) {
            let temperature = 0.8;
            let seqs = Sequences::new(
                rows.iter().map(|(p, _)| p.as_slice()).collect(),
                rows.iter().map(|(_, c)| c.as_slice()).collect(),
            );
            let together =
                completion_logprobs(net, &seqs, temperature, &dev).unwrap().logprobs.to_vec2::<f32>().unwrap();
            for (i, (p, c)) in rows.iter().enumerate() {
                let inputs = alone(p, c);
                let logits = (net.logits(&inputs, None).unwrap() / temperature).unwrap();
                let want = next_token_logprobs(&logits, &inputs.ids).unwrap().to_vec2::<f32>().unwrap();
                for (j, got) in together[i].iter().enumerate() {
                    let want = if j < c.len() { want[0][p.len() + j - 1] } else { 0.0 };
                    assert!((got - want).abs() < LOGIT_TOL, "{name} row {i} token {j}: {got} vs {want} alone");
                }
            }
        } else {
            let pairs: Vec<Pair> =
                rows.iter().map(|(p, c)| Pair { prompt: p.clone(), completion: c.clone() }).collect();
            let together = sequence_scores(net, &pairs, &dev).unwrap();
            // As a critic: the score head at the position before each completion token.
            let seqs = Sequences::new(
                rows.iter().map(|(p, _)| p.as_slice()).collect(),
                rows.iter().map(|(_, c)| c.as_slice()).collect(),
            );
            let values = completion_values(net, &seqs, &dev).unwrap().to_vec2::<f32>().unwrap();
            for (i, (p, c)) in rows.iter().enumerate() {
                let want = net.scores(&alone(p, c)).unwrap();
                let got = Tensor::new(together[i].as_slice(), &dev).unwrap().unsqueeze(0).unwrap();
                assert!(max_diff(&got, &want) < LOGIT_TOL, "{name} row {i}: score differs from the row alone");
                let per_position = net.logits(&alone(p, c), None).unwrap().to_vec3::<f32>().unwrap();
                for (j, got) in values[i].iter().enumerate() {
                    let want = if j < c.len() { per_position[0][p.len() + j - 1][0] } else { 0.0 };
                    assert!((got - want).abs() < LOGIT_TOL, "{name} row {i} value {j}: {got} vs {want} alone");
                }
            }
        }
    }
}

/// Prefill part of the left-padded batch into the cache, then feed the rest
/// one token per step: every step's logits equal the full forward's.
#[test]
fn kv_cache_decoding_matches_the_full_forward() {
    for name in MODELS {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let reference = reference(name);
        let full = inputs(&reference, "left");
        let expected = &reference["left.logits"];
        let net = model.frozen();
        let t = full.seq_len();
        let prefill = t - 4;
        let mut cache = net.new_cache();
        let first = Inputs {
            ids: full.ids.narrow(1, 0, prefill).unwrap(),
            mask: full.mask.narrow(1, 0, prefill).unwrap(),
            positions: full.positions.narrow(1, 0, prefill).unwrap(),
            segments: None,
        };
        let mut outputs = vec![net.logits(&first, Some(&mut cache)).unwrap()];
        for step in prefill..t {
            // One column per step; its mask marks rows still inside their left padding.
            let column = |x: &Tensor| x.narrow(1, step, 1).unwrap();
            let inputs = Inputs {
                ids: column(&full.ids),
                mask: column(&full.mask),
                positions: column(&full.positions),
                segments: None,
            };
            outputs.push(net.logits(&inputs, Some(&mut cache)).unwrap());
        }
        assert_eq!(cache.len(), t);
        for (i, o) in outputs.iter().enumerate() {
            let s = if i == 0 { 0 } else { prefill + i - 1 };
            let n = o.dim(1).unwrap();
            println!(
                "chunk {i}: {:.2e}",
                max_diff_masked(o, &expected.narrow(1, s, n).unwrap(), &full.mask.narrow(1, s, n).unwrap())
            );
        }
        let decoded = Tensor::cat(&outputs, 1).unwrap();
        let diff = max_diff_masked(&decoded, expected, &full.mask);
        println!("{name} kv-cache: max |Δ logit| = {diff:.2e}");
        assert!(diff <= LOGIT_TOL, "{name} kv-cache: max |Δ logit| = {diff}");
    }
}

/// Rows that share their prompt's cached slots (`KvCache::share`) decode
/// as the full forward does, through whole-chunk and one-token steps and
/// after rows leave the batch.
#[test]
fn rows_sharing_cached_slots_decode_as_the_full_forward() {
    for name in MODELS {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let reference = reference(name);
        let full = inputs(&reference, "left");
        let net = model.frozen();
        let (b, t) = (full.batch_size(), full.seq_len());
        let prefill = t - 5;
        let mut cache = net.new_cache();
        let columns = |x: &Tensor, start: usize, n: usize, rows: &[u32]| {
            let idx = Tensor::from_slice(rows, rows.len(), &Device::Cpu).unwrap();
            x.narrow(1, start, n).unwrap().contiguous().unwrap().index_select(&idx, 0).unwrap()
        };
        let chunk = |start: usize, n: usize, rows: &[u32]| Inputs {
            ids: columns(&full.ids, start, n, rows),
            mask: columns(&full.mask, start, n, rows),
            positions: columns(&full.positions, start, n, rows),
            segments: None,
        };
        let all: Vec<u32> = (0..b as u32).collect();
        net.logits(&chunk(0, prefill, &all), Some(&mut cache)).unwrap();
        // Every prompt twice, in another order.
        let mut rows: Vec<u32> = all.iter().rev().flat_map(|&r| [r, r]).collect();
        cache.share(&rows).unwrap();
        cache.reserve(5);
        let mut step = prefill;
        let mut worst = 0f32;
        for n in [2, 1, 1, 1] {
            if step == prefill + 3 {
                // Rows leave the batch: keep every other one.
                let keep: Vec<u32> = (0..rows.len() as u32).step_by(2).collect();
                cache.select_rows(&keep).unwrap();
                rows = keep.iter().map(|&k| rows[k as usize]).collect();
            }
            let got = net.logits(&chunk(step, n, &rows), Some(&mut cache)).unwrap();
            let want = columns(&reference["left.logits"], step, n, &rows);
            worst = worst.max(max_diff_masked(&got, &want, &columns(&full.mask, step, n, &rows)));
            step += n;
        }
        assert_eq!(cache.len(), t);
        println!("{name} shared cache: max |Δ logit| = {worst:.2e}");
        assert!(worst <= LOGIT_TOL, "{name} shared cache: max |Δ logit| = {worst}");
    }
}

/// The loss of the reference script: mean next-token NLL over pairs whose
/// both tokens are real (causal), or the sum of the pooled scores (seqcls).
fn reference_loss(model: &Model, name: &str, inputs: &Inputs) -> Tensor {
    if is_causal(name) {
        let logits = model.network().logits(inputs, None).unwrap();
        let logp = next_token_logprobs(&logits, &inputs.ids).unwrap();
        let t = inputs.seq_len();
        let pair_mask = (inputs.mask.narrow(1, 0, t - 1).unwrap() * inputs.mask.narrow(1, 1, t - 1).unwrap()).unwrap();
        let total = (logp * &pair_mask).unwrap().sum_all().unwrap();
        (total.neg().unwrap() / pair_mask.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64).unwrap()
    } else {
        model.network().scores(inputs).unwrap().sum_all().unwrap()
    }
}

#[test]
fn every_gradient_matches_transformers() {
    for name in MODELS {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let reference = reference(name);
        let inputs = inputs(&reference, "right");
        let grads = reference_loss(&model, name, &inputs).backward().unwrap();
        let expected: Vec<&String> = reference.keys().filter(|k| k.starts_with("grad.")).collect();
        assert_eq!(expected.len(), model.params().len(), "{name}: parameter count differs from transformers");
        let mut worst = 0f32;
        for p in model.params().iter() {
            let want = reference
                .get(&format!("grad.{}", p.name))
                .unwrap_or_else(|| panic!("{name}: transformers has no parameter `{}`", p.name));
            let got = grads.get(&p.var).unwrap_or_else(|| panic!("{name}: no gradient for `{}`", p.name));
            let scale = want.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap().max(1.0);
            let diff = max_diff(got, want) / scale;
            assert!(diff <= 1e-4, "{name}: gradient of `{}` differs by {diff} (relative)", p.name);
            worst = worst.max(diff);
        }
        println!("{name}: {} gradients, max relative |Δ| = {worst:.2e}", model.params().len());
    }
}

/// DESIGN.md's guard: the training loss reaches every trainable parameter
/// with a finite, non-zero gradient, for every architecture and head.
#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    for name in MODELS {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let reference = reference(name);
        let grads = reference_loss(&model, name, &inputs(&reference, "left")).backward().unwrap();
        for p in model.params().iter() {
            let g = grads.get(&p.var).unwrap_or_else(|| panic!("{name}: `{}` got no gradient", p.name));
            let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
            assert!(g.iter().all(|x| x.is_finite()), "{name}: `{}` has a non-finite gradient", p.name);
            assert!(g.iter().any(|&x| x != 0.0), "{name}: `{}` has an all-zero gradient", p.name);
        }
    }
}
