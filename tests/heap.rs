//! The allocator's counts, alone in a test binary of their own: any other
//! test's allocations, or its reading of the peak (a training run's phases
//! read it), would move them.

use std::sync::Mutex;

use candle_core::{DType, Device, Tensor, Var};
use rloo::heap;
use rloo::model::kernels;
use rloo::model::ops::Activation;

/// The tests here, one at a time.
static ONE: Mutex<()> = Mutex::new(());

#[test]
fn the_peak_keeps_what_was_held_after_it_is_freed_and_starts_again_when_read() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    heap::take_peak();
    let before = heap::in_use();
    let big = vec![1u8; 64 << 20];
    assert_eq!(heap::in_use(), before + (64 << 20));
    let small = vec![1u8; heap::COUNTED - 1];
    assert_eq!(heap::in_use(), before + (64 << 20), "blocks under COUNTED are not counted");
    drop((big, small));
    assert_eq!(heap::in_use(), before);
    assert!(heap::take_peak() >= before + (64 << 20), "the peak keeps the 64 MiB once they are freed");
    assert!(heap::take_peak() < before + (64 << 20), "and starts again from what is held");
}

/// A freed block of KEPT_FROM bytes or more is kept and handed out again
/// for the next allocation of exactly its size (zeroed when asked so),
/// counted as held only while the program holds it; another size gets a
/// block of its own. What is kept and held stays within the most ever
/// held: a new block that would pass it has the kept ones handed back.
#[test]
fn large_freed_blocks_are_reused_for_the_same_size_within_the_most_held() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let within = || heap::in_use() + heap::kept_bytes() <= heap::most_held();
    let size = heap::KEPT_FROM + 4096;
    let before = heap::in_use();
    let first = vec![7u8; size];
    let at = first.as_ptr();
    drop(first);
    assert_eq!(heap::in_use(), before, "a kept block is not held");
    assert!(heap::kept_bytes() >= size as u64);
    let again = vec![0u8; size];
    assert_eq!(again.as_ptr(), at, "the same size takes the kept block");
    assert!(again.iter().all(|&b| b == 0), "zeroed over the old contents");
    assert_eq!(heap::in_use(), before + size as u64);
    let other = vec![1u8; size + 1];
    assert_ne!(other.as_ptr(), at);
    drop((again, other));
    assert!(within());
    let blocks: Vec<Vec<u8>> = (0..20).map(|i| vec![i as u8; size + i]).collect();
    drop(blocks);
    assert!(heap::kept_bytes() >= 8 * size as u64, "{} bytes kept", heap::kept_bytes());
    assert!(within());
    // Zeroed and never touched, so it costs no resident memory.
    let past = vec![0u8; (heap::most_held() - heap::in_use()) as usize + 1];
    assert_eq!(heap::kept_bytes(), 0, "a new peak hands every kept block back");
    drop(past);
    assert!(within());
    assert_eq!(heap::in_use(), before);
}

/// What a training graph holds of a residual's sum `x + branch`: a plain
/// addition keeps the branch's output until the backward; the residual sums
/// free it once the sum is made, unless the op that made it reads it in its
/// own backward (exp), and free the tensors that views and copies of it
/// were made from too. The gradients are the same.
#[test]
fn residual_sums_keep_no_branch_output_the_backward_does_not_read() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let size = (1usize << 20) * 4;
    let x = Var::ones(1 << 20, DType::F32, &Device::Cpu).unwrap();
    let held = |branch: &dyn Fn(&Tensor) -> candle_core::Result<Tensor>,
                sum: &dyn Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>| {
        let before = heap::in_use();
        let y = sum(x.as_tensor(), &branch(x.as_tensor()).unwrap()).unwrap();
        let held = (heap::in_use() - before) as usize;
        let grad = y.sum_all().unwrap().backward().unwrap().remove(x.as_tensor()).unwrap();
        (held, grad.to_vec1::<f32>().unwrap()[0])
    };
    let affine = |x: &Tensor| x.affine(3.0, 1.0);
    let viewed = |x: &Tensor| {
        let square = x.affine(3.0, 1.0)?.reshape((1 << 10, 1 << 10))?;
        square.t()?.contiguous()?.t()?.to_dtype(DType::F32)?.reshape(1 << 20)
    };
    let exp = |x: &Tensor| x.exp();
    let plain = |x: &Tensor, a: &Tensor| x + a;
    let residual = |x: &Tensor, a: &Tensor| kernels::residual(x, a);
    let sum3 = |x: &Tensor, a: &Tensor| kernels::sum3(x, a, &x.zeros_like()?);

    let (kept, grad) = held(&affine, &plain);
    assert!(kept >= 2 * size && grad == 4.0, "a plain addition keeps the sum and the branch");
    for (name, sum) in [("residual", &residual as &dyn Fn(&Tensor, &Tensor) -> _), ("sum3", &sum3)] {
        let (kept, grad) = held(&affine, sum);
        assert!(kept < size + size / 2 && grad == 4.0, "{name} keeps the sum alone ({kept} bytes)");
        let (kept, grad) = held(&viewed, sum);
        assert!(kept < size + size / 2 && grad == 4.0, "{name} keeps no view or copy ({kept} bytes)");
        let (kept, grad) = held(&exp, sum);
        assert!(kept >= 2 * size && grad == 1.0 + 1f32.exp(), "{name} keeps exp's output for its backward");
    }
}

/// What a training forward holds of an MLP after its norm: its output, and
/// the wide input (four times as large) unless the backward makes it again.
#[test]
fn a_remade_mlp_input_is_not_held_after_the_forward() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let (rows, h) = (4096, 64);
    let mut rng = rloo::rng::Rng::new(3);
    let mut var = |shape: &[usize]| Var::from_tensor(&rng.normal_tensor(shape, 0.0, 0.5)).unwrap();
    let (x, norm_w, norm_b, up_w, up_b, down_w, down_b) =
        (var(&[rows, h]), var(&[h]), var(&[h]), var(&[4 * h, h]), var(&[4 * h]), var(&[h, 4 * h]), var(&[h]));
    let held = |remade: bool| {
        let before = heap::in_use();
        let norm = (norm_w.as_tensor(), norm_b.as_tensor(), 1e-5);
        let wide = kernels::norm_linear(&x, norm, &up_w, &up_b).unwrap();
        let y = match remade {
            true => {
                let remake = kernels::norm_linear_remake(&x, norm, &up_w, &up_b).unwrap().expect("one op");
                kernels::activation_linear_remade(&wide, Activation::Gelu, &down_w, &down_b, remake).unwrap()
            }
            false => kernels::activation_linear(&wide, Activation::Gelu, &down_w, Some(&down_b)).unwrap(),
        };
        drop(wide);
        let held = (heap::in_use() - before) as usize;
        drop(y);
        held
    };
    let (output, wide) = (rows * h * 4, rows * 4 * h * 4);
    assert!(held(false) >= output + wide, "kept: the output and the wide input");
    assert!(held(true) < output + wide / 4, "remade: the output alone");
}

/// Each architecture's count of what a training forward keeps per layer
/// and token (`kept_per_layer`, the memory plan's), against what the heap
/// holds once a forward over packed completions ends: the difference between
/// two models that differ only in their number of layers, per layer between
/// them. And the plan's activations, masks and logits within 5% of the
/// whole forward's.
#[test]
fn each_architecture_keeps_per_layer_what_the_memory_plan_counts() {
    use rloo::model::arch::Keeping;
    use rloo::model::layer_graphs::LayerGraphs;
    use rloo::model::scoring::{completion_logprobs, Sequences};
    use rloo::model::{lora::LoraConfig, HeadKind, Model, ModelConfig};
    use rloo::train::memory::{activation_bytes, MicroTokens};
    use serde_json::{json, Value};

    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/models");
    let tmp = tempfile::tempdir().unwrap();
    // 8 prompts of 8 tokens, each with 4 completions of 100: packed, 8 rows of 408.
    let (groups, k, prompt, completion) = (8, 4, 8, 100);
    let prompts: Vec<Vec<u32>> =
        (0..groups * k).map(|i| (0..prompt).map(|j| (i / k * 10 + j) as u32 + 2).collect()).collect();
    let completions: Vec<Vec<u32>> =
        (0..groups * k).map(|i| (0..completion).map(|j| ((i * 7 + j) % 100) as u32 + 2).collect()).collect();
    let seqs =
        Sequences::new(prompts.iter().map(Vec::as_slice).collect(), completions.iter().map(Vec::as_slice).collect());
    let micro = MicroTokens {
        tokens: (groups * prompt + groups * k * completion) as u64,
        row: (prompt + k * completion) as u64,
    };

    // A fixture widened to a hidden size of 128 (its heads wider), an MLP of 4 times that, `layers` layers.
    let config = |fixture: &str, patch: &[(&str, Value)], layers: usize| {
        let dir = root.join(fixture);
        let mut raw: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        let keys = raw.as_object_mut().unwrap();
        let mut set = |names: &[&str], value: Value| {
            for name in names {
                if keys.contains_key(*name) {
                    keys.insert(name.to_string(), value.clone());
                }
            }
        };
        set(&["hidden_size", "n_embd", "word_embed_proj_dim"], json!(128));
        set(&["intermediate_size", "n_inner", "ffn_dim"], json!(512));
        set(&["num_hidden_layers", "n_layer"], json!(layers));
        set(&["head_dim"], json!(32));
        for (key, value) in patch {
            keys.insert(key.to_string(), value.clone());
        }
        (ModelConfig::from_value(raw, &dir).unwrap(), dir)
    };
    // The bytes a training forward holds at its end, the plan's for them, the config.
    let held = |fixture: &str, patch: &[(&str, Value)], keeping: Keeping, layers: usize| {
        std::env::set_var("RLOO_MLP_INPUT", if keeping.mlp_input_remade { "remade" } else { "kept" });
        let (cfg, dir) = config(fixture, patch, layers);
        let mut model = Model::init_random(cfg.clone(), &Device::Cpu, 1, &dir).unwrap();
        if keeping.lora {
            let saved = tmp.path().join(format!("{fixture}-{layers}"));
            model.save(&saved).unwrap();
            let lora = LoraConfig {
                r: 8,
                alpha: 16.0,
                dropout: 0.0,
                targets: vec!["all-linear".into()],
                modules_to_save: vec![],
            };
            model = Model::load_with_new_adapters(&saved, &Device::Cpu, HeadKind::CausalLm, lora, 1).unwrap();
        }
        let model = model.with_layer_graphs(LayerGraphs::PerLayer);
        let before = heap::in_use();
        let out = completion_logprobs(model.network(), &seqs, 1.0, &Device::Cpu).unwrap();
        let held = heap::in_use() - before;
        drop(out);
        let (activations, masks) = activation_bytes(&cfg, keeping, micro, 4, false);
        // The f32 kernel keeps the completions' logits for the backward when they fit one chunk, as here.
        let logits = (groups * k * completion * cfg.vocab_size() * 4) as u64;
        (held as f64, (activations + masks + logits) as f64, cfg)
    };
    let kept = Keeping::default();
    let remade = Keeping { mlp_input_remade: true, ..kept };
    let lora = Keeping { lora: true, ..kept };
    let sequential = [("use_parallel_residual", json!(false)), ("attention_bias", json!(false))];
    let no_bias = [("enable_bias", json!(false))];
    type Case<'a> = (&'a str, &'a [(&'a str, Value)], Keeping);
    let cases: &[Case] = &[
        ("gpt_neox-causal", &[], kept),
        ("gpt_neox-causal", &[], remade),
        ("gpt_neox-causal", &[], lora),
        ("gpt_neox-causal", &sequential, kept),
        ("gpt2-causal", &[], kept),
        ("gpt2-causal", &[], remade),
        ("gpt2-causal", &[], lora),
        ("opt-causal", &[], kept),
        ("opt-causal", &[], remade),
        ("opt-causal", &no_bias, kept),
        ("opt-postnorm-causal", &[], kept),
        ("opt-causal", &no_bias, lora),
        ("llama-causal", &[], kept),
        ("llama-causal", &[], remade),
        ("llama-causal", &[], lora),
        ("qwen2-causal", &[], kept),
        ("qwen3-causal", &[], kept),
        ("qwen3-causal", &[], remade),
        ("qwen3-causal", &[], lora),
    ];
    held("gpt_neox-causal", &[], kept, 2); // the first forward's one-off allocations
    for &(fixture, patch, keeping) in cases {
        let (two, planned, cfg) = held(fixture, patch, keeping, 2);
        let (six, ..) = held(fixture, patch, keeping, 6);
        let per_layer = (six - two) / 4.0 / (micro.tokens as f64 * 128.0 * 4.0);
        let counted = cfg.kept_per_layer(keeping);
        let case = format!("{fixture} {patch:?} {keeping:?}");
        assert!((per_layer - counted).abs() < 0.01, "{case}: {per_layer:.3} kept a layer, {counted} counted");
        let ratio = planned / two;
        assert!((0.95..1.05).contains(&ratio), "{case}: planned {planned} bytes, held {two}");
    }
}
