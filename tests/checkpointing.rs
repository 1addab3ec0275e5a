//! A training network cut between layers, each layer's graph freed after
//! its backward or recomputed in it (gradient checkpointing), gives the
//! gradients of one whole graph: for every architecture, full fine-tuning
//! and LoRA (whose dropout masks a recomputation must draw again the same),
//! f32 and bf16.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use rloo::model::layer_graphs::LayerGraphs;
use rloo::model::lora::PeftOptions;
use rloo::model::{backward, HeadKind, Inputs, Model};

/// Every trainable parameter's gradient of a loss over the training
/// network's outputs, by name; the loss weighs each output differently so
/// that no gradient is zero by symmetry.
fn gradients(model: &Model, name: &str) -> Vec<(String, Tensor)> {
    let reference = reference(name);
    let inputs = Inputs::new(&reference["right.input_ids"], &reference["right.attention_mask"]).unwrap();
    let net = model.network();
    let out = if is_causal(name) { net.logits(&inputs, None) } else { net.scores(&inputs) }.unwrap();
    let weights = wave(out.shape(), 1.0);
    let loss = (out.to_dtype(DType::F32).unwrap() * weights).unwrap().sum_all().unwrap();
    let grads = backward(&loss, &[model]).unwrap();
    model
        .params()
        .trainable()
        .map(|p| {
            let g = grads.get(p.compute()).unwrap_or_else(|| panic!("{name}: `{}` got no gradient", p.name));
            (p.name.clone(), g.to_dtype(DType::F32).unwrap())
        })
        .collect()
}

/// Fixed values of `shape` in [-scale, scale].
fn wave(shape: &candle_core::Shape, scale: f64) -> Tensor {
    let n = shape.elem_count() as u32;
    let x = Tensor::arange(0u32, n, &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
    ((x * 0.37).unwrap().sin().unwrap() * scale).unwrap().reshape(shape).unwrap()
}

fn load(name: &str, peft: &PeftOptions, dtype: DType, graphs: LayerGraphs) -> Model {
    let head = if is_causal(name) { HeadKind::CausalLm } else { HeadKind::SequenceClassification { num_labels: 1 } };
    let save: &[&str] = if is_causal(name) { &[] } else { &["score"] };
    // With dropout: SFT's and reward training's adapters draw masks.
    let model = Model::load_trainable(&model_dir(name), &Device::Cpu, head, (peft, save), 7, true).unwrap();
    // Adapters' B off its zero start, as training moves it, so that A gets a gradient.
    for p in model.params().trainable().filter(|p| p.name.ends_with("lora_B.weight")) {
        p.var.set(&wave(p.var.shape(), 0.1)).unwrap();
    }
    model.with_dtype(dtype, true).unwrap().with_layer_graphs(graphs)
}

/// Gradients of cut networks against the whole graph's over two successive
/// passes (the second draws dropout masks after the first's, so a
/// recomputation that moved the mask stream shows there), with the largest
/// gap relative to the largest gradient.
fn compare(name: &str, peft: &PeftOptions, dtype: DType, tolerance: f32) {
    let whole = load(name, peft, dtype, LayerGraphs::Whole);
    let cut = [LayerGraphs::PerLayer, LayerGraphs::Recomputed].map(|g| (g, load(name, peft, dtype, g)));
    for pass in 0..2 {
        let want = gradients(&whole, name);
        assert!(!want.is_empty());
        for (graphs, model) in &cut {
            let got = gradients(model, name);
            assert_eq!(want.len(), got.len());
            for ((n, w), (_, g)) in want.iter().zip(&got) {
                let scale = w.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
                let gap = max_diff(w, g);
                assert!(scale > 0.0, "{name}: `{n}` has a zero gradient");
                assert!(
                    gap <= tolerance * scale,
                    "{name} {dtype:?} {graphs:?} pass {pass}: `{n}` differs by {gap} (largest {scale})"
                );
            }
        }
    }
}

#[test]
fn cut_networks_give_the_whole_graphs_gradients() {
    let full = PeftOptions::default();
    for name in [
        "gpt_neox-causal",
        "llama-causal",
        "gpt2-causal",
        "qwen2-causal",
        "qwen3-causal",
        "gpt_neox-seqcls",
        "llama-seqcls",
        "opt-postnorm-causal",
        "opt-seqcls",
    ] {
        compare(name, &full, DType::F32, 1e-5);
    }
}

#[test]
fn cut_lora_networks_give_the_whole_graphs_gradients_with_dropout() {
    let lora = PeftOptions {
        use_peft: true,
        lora_r: 4,
        lora_dropout: 0.2,
        lora_target_modules: Some(vec!["all-linear".into()]),
        ..PeftOptions::default()
    };
    for name in ["gpt_neox-causal", "llama-causal", "gpt2-causal", "qwen2-seqcls", "opt-causal"] {
        compare(name, &lora, DType::F32, 1e-5);
    }
}

/// In bf16 the gradients are the compute copies', which the accumulator
/// adds into the f32 masters' sums.
#[test]
fn cut_bf16_networks_give_gradients_to_the_bf16_copies() {
    compare("llama-causal", &PeftOptions::default(), DType::BF16, 1e-2);
}
