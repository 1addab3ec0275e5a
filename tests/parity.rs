//! Parity with transformers on the committed fixtures: logits of padded
//! batches (left and right), KV-cache decoding (shared slots too), sequence
//! scores and critic values, and the gradient of every parameter. Each test prints its max |Δ|.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use rloo::check::{self, Fixture, GRADIENT_TOLERANCE, LOGIT_TOLERANCE};
use rloo::model::scoring::{completion_logprobs, completion_values, sequence_scores, Pair, Sequences};
use rloo::model::{next_token_logprobs, Inputs, Model, PadSide};

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
        let fixture = Fixture::load(&fixtures(), name, &Device::Cpu, DType::F32).unwrap();
        for side in ["left", "right"] {
            inputs(&fixture.reference, side);
            for (which, net) in [("train", fixture.model.network()), ("frozen", fixture.model.frozen())] {
                let diff = fixture.logits_error(net, side).unwrap();
                println!("{name} {side} {which}: max |Δ logit| = {diff:.2e}");
                assert!(diff <= LOGIT_TOLERANCE, "{name} {side} {which}: max |Δ logit| = {diff}");
            }
            if !is_causal(name) {
                let diff = fixture.scores_error(side).unwrap();
                println!("{name} {side}: max |Δ score| = {diff:.2e}");
                assert!(diff <= LOGIT_TOLERANCE, "{name} {side}: max |Δ score| = {diff}");
            }
        }
    }
}

/// bf16 mixed precision on the same fixtures: logits, scores, KV-cache
/// decoding and gradients within bf16's tolerance of transformers' f32
/// outputs, as `rloo check` measures them on any device.
#[test]
fn bf16_outputs_and_gradients_are_within_bf16_tolerance() {
    let checks = check::check_fixtures(&fixtures(), &Device::Cpu, &[DType::BF16]);
    print!("{}", check::table(&Device::Cpu, &checks));
    assert_eq!(checks.len(), 3 * MODELS.len());
    assert!(checks.iter().all(|c| c.passed()), "{}", check::table(&Device::Cpu, &checks));
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
                    assert!((got - want).abs() < LOGIT_TOLERANCE, "{name} row {i} token {j}: {got} vs {want} alone");
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
                assert!(max_diff(&got, &want) < LOGIT_TOLERANCE, "{name} row {i}: score differs from the row alone");
                let per_position = net.logits(&alone(p, c), None).unwrap().to_vec3::<f32>().unwrap();
                for (j, got) in values[i].iter().enumerate() {
                    let want = if j < c.len() { per_position[0][p.len() + j - 1][0] } else { 0.0 };
                    assert!((got - want).abs() < LOGIT_TOLERANCE, "{name} row {i} value {j}: {got} vs {want} alone");
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
        let fixture = Fixture::load(&fixtures(), name, &Device::Cpu, DType::F32).unwrap();
        let diff = fixture.kv_cache_error().unwrap();
        println!("{name} kv-cache: max |Δ logit| = {diff:.2e}");
        assert!(diff <= LOGIT_TOLERANCE, "{name} kv-cache: max |Δ logit| = {diff}");
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
            real_runs: None,
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
        assert!(worst <= LOGIT_TOLERANCE, "{name} shared cache: max |Δ logit| = {worst}");
    }
}

#[test]
fn every_gradient_matches_transformers() {
    for name in MODELS {
        let fixture = Fixture::load(&fixtures(), name, &Device::Cpu, DType::F32).unwrap();
        let (n, worst) = fixture.gradient_error().unwrap();
        println!("{name}: {n} gradients, max relative |Δ| = {worst:.2e}");
        assert!(worst <= GRADIENT_TOLERANCE, "{name}: a gradient differs by {worst} (relative)");
    }
}

/// DESIGN.md's guard: the training loss reaches every trainable parameter
/// with a finite, non-zero gradient, for every architecture and head.
#[test]
fn every_parameter_gets_a_finite_nonzero_gradient() {
    for name in MODELS {
        let fixture = Fixture::load(&fixtures(), name, &Device::Cpu, DType::F32).unwrap();
        let grads = fixture.reference_loss("left").unwrap().backward().unwrap();
        for p in fixture.model.params().iter() {
            let g = grads.get(p.compute()).unwrap_or_else(|| panic!("{name}: `{}` got no gradient", p.name));
            let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
            assert!(g.iter().all(|x| x.is_finite()), "{name}: `{}` has a non-finite gradient", p.name);
            assert!(g.iter().any(|&x| x != 0.0), "{name}: `{}` has an all-zero gradient", p.name);
        }
    }
}

/// `rloo check` on the CPU: every kernel and fixture row passes, in one table.
#[test]
fn rloo_check_passes_on_the_cpu() {
    let out = ok(rloo(&["check", "--device", "cpu", "--fixtures", fixtures().to_str().unwrap()]));
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("160 checks on the CPU: 160 passed, 0 failed"), "{table}");
    assert!(table.contains("attention (cpu kernel)") && table.contains("gradients (28 tensors)"), "{table}");
}
