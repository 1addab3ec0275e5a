//! LoRA adapters in PEFT's format: adapters PEFT made load onto their base
//! with PEFT's logits; new adapters start as the base, train alone (the
//! base gets no gradient, every adapter does), and save and load back.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use rloo::model::lora::LoraConfig;
use rloo::model::{HeadKind, Inputs, Model};

fn right_inputs(name: &str) -> (Inputs, Tensor) {
    let reference = reference(name);
    let mask = reference["right.attention_mask"].clone();
    (Inputs::new(&reference["right.input_ids"], &mask).unwrap(), mask)
}

fn outputs(model: &Model, name: &str, inputs: &Inputs, train: bool) -> Tensor {
    let net = if train { model.network() } else { model.frozen() };
    if is_causal(name) {
        net.logits(inputs, None).unwrap()
    } else {
        net.scores(inputs).unwrap()
    }
}

#[test]
fn adapters_peft_made_give_peft_logits() {
    for name in ["gpt_neox-causal", "llama-causal", "gpt2-causal", "qwen2-seqcls", "opt-postnorm-causal", "opt-seqcls"]
    {
        let dir = fixtures().join("adapters").join(name);
        let expected = candle_core::safetensors::load(dir.with_extension("safetensors"), &Device::Cpu).unwrap();
        let expected = &expected["right.logits"];
        let (inputs, mask) = right_inputs(name);
        // The base named in adapter_config.json (relative to the repository), or given.
        for model in [Model::load(&dir, &Device::Cpu).unwrap(), {
            Model::load_adapter(&dir, Some(&model_dir(name)), &Device::Cpu).unwrap()
        }] {
            for train in [true, false] {
                let got = outputs(&model, name, &inputs, train);
                let diff =
                    if is_causal(name) { max_diff_masked(&got, expected, &mask) } else { max_diff(&got, expected) };
                println!("{name} (train network: {train}): max |Δ| = {diff:.2e}");
                assert!(diff < 1e-4, "{name}: {diff}");
            }
        }
    }
}

fn config(targets: &[&str], modules_to_save: &[&str]) -> LoraConfig {
    LoraConfig {
        r: 4,
        alpha: 8.0,
        dropout: 0.0,
        targets: targets.iter().map(|s| s.to_string()).collect(),
        modules_to_save: modules_to_save.iter().map(|s| s.to_string()).collect(),
    }
}

#[test]
fn new_adapters_start_as_the_base_train_alone_and_save_as_peft_does() {
    for (name, head, save) in [
        ("gpt_neox-causal", HeadKind::CausalLm, &[][..]),
        ("llama-seqcls", HeadKind::SequenceClassification { num_labels: 1 }, &["score"][..]),
    ] {
        let base = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let model =
            Model::load_with_new_adapters(&model_dir(name), &Device::Cpu, head, config(&["all-linear"], save), 3)
                .unwrap();
        let (inputs, _) = right_inputs(name);
        let start = outputs(&model, name, &inputs, true);
        assert_eq!(max_diff(&start, &outputs(&base, name, &inputs, true)), 0.0, "{name}: B = 0 at the start");
        let reference_net = model.base().expect("a LoRA model has a base network");
        let without = if is_causal(name) { reference_net.logits(&inputs, None) } else { reference_net.scores(&inputs) };
        assert_eq!(max_diff(&without.unwrap(), &start), 0.0);

        // Move every B off zero, as training would, so that every A gets a gradient too.
        for p in model.params().trainable().filter(|p| p.name.ends_with("lora_B.weight")) {
            let moved = (p.var.as_tensor() + rloo::rng::Rng::new(7).normal_tensor(p.var.dims(), 0.0, 0.1)).unwrap();
            p.var.set(&moved).unwrap();
        }
        let loss = outputs(&model, name, &inputs, true).sqr().unwrap().mean_all().unwrap();
        let grads = loss.backward().unwrap();
        let mut trained = 0;
        for p in model.params().iter() {
            let g = grads.get(p.compute());
            if p.frozen {
                assert!(g.is_none(), "{name}: frozen `{}` got a gradient", p.name);
                continue;
            }
            let g = g.unwrap_or_else(|| panic!("{name}: `{}` got no gradient", p.name));
            let norm = g.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(norm.is_finite() && norm > 0.0, "{name}: `{}` gradient norm {norm}", p.name);
            trained += 1;
        }
        let layers = model.config().num_layers();
        let per_layer = if name.starts_with("llama") { 7 } else { 4 };
        assert_eq!(trained, 2 * per_layer * layers + save.len(), "{name}: adapters of every dense layer, and the head");
        // The adapted network moved; the base (the KL reference) did not.
        let moved = outputs(&model, name, &inputs, true);
        assert!(max_diff(&moved, &start) > 1e-4);
        let still = if is_causal(name) { reference_net.logits(&inputs, None) } else { reference_net.scores(&inputs) };
        assert_eq!(max_diff(&still.unwrap(), &start), 0.0);

        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("adapter");
        model.save(&dir).unwrap();
        assert!(!dir.join("model.safetensors").exists(), "{name}: only the adapter is saved");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap()).unwrap();
        assert_eq!(config["peft_type"], "LORA");
        let saved = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
        assert_eq!(saved.len(), trained);
        assert!(saved.keys().all(|k| k.starts_with("base_model.model.")), "{:?}", saved.keys());
        let back = Model::load(&dir, &Device::Cpu).unwrap();
        assert_eq!(max_diff(&outputs(&back, name, &inputs, true), &moved), 0.0, "{name}: the adapter loads back");
        assert_eq!(back.params().trainable().count(), trained);

        // For scripts/fixtures/make_peft_fixtures.py check: the adapter and its logits.
        if let Some(out) = std::env::var_os("RLOO_LORA_CHECK_DIR") {
            let out = std::path::Path::new(&out).join(name);
            back.save(&out).unwrap();
            let (ids, mask) =
                (reference(name)["right.input_ids"].clone(), reference(name)["right.attention_mask"].clone());
            let tensors =
                [("input_ids", ids), ("attention_mask", mask), ("logits", moved.to_dtype(DType::F32).unwrap())];
            candle_core::safetensors::save(
                &tensors.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
                out.with_extension("safetensors"),
            )
            .unwrap();
        }
    }
}

#[test]
fn an_adapter_on_the_wrong_base_or_with_unsupported_options_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("adapter");
    std::fs::create_dir_all(&dir).unwrap();
    let source = fixtures().join("adapters/gpt_neox-causal");
    std::fs::copy(source.join("adapter_model.safetensors"), dir.join("adapter_model.safetensors")).unwrap();
    let config = std::fs::read_to_string(source.join("adapter_config.json")).unwrap();
    let mut value: serde_json::Value = serde_json::from_str(&config).unwrap();
    value["base_model_name_or_path"] = model_dir("llama-causal").display().to_string().into();
    std::fs::write(dir.join("adapter_config.json"), value.to_string()).unwrap();
    let err = Model::load(&dir, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("fits no module of the base model"), "{err}");

    value["use_dora"] = true.into();
    std::fs::write(dir.join("adapter_config.json"), value.to_string()).unwrap();
    let err = Model::load(&dir, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("`use_dora` = true is not supported"), "{err}");
}

/// `rloo merge` writes the full model an adapter makes: it loads without
/// the adapter and gives PEFT's logits.
#[test]
fn a_merged_adapter_is_a_full_model_with_peft_logits() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["gpt2-causal", "qwen2-seqcls", "opt-postnorm-causal"] {
        let adapter = fixtures().join("adapters").join(name);
        let out = tmp.path().join(name);
        let base = model_dir(name);
        let args = ["merge", "--adapter", adapter.to_str().unwrap(), "--base", base.to_str().unwrap()];
        ok(rloo(&[&args[..], &["--output", out.to_str().unwrap(), "--device", "cpu"]].concat()));
        assert!(out.join("model.safetensors").is_file() && !out.join("adapter_config.json").exists());
        assert!(out.join("tokenizer.json").is_file(), "the base's tokenizer comes along");
        let merged = Model::load(&out, &Device::Cpu).unwrap();
        let names = |m: &Model| m.params().iter().map(|p| p.name.clone()).collect::<std::collections::BTreeSet<_>>();
        assert!(merged.lora().is_none());
        assert_eq!(names(&merged), names(&Model::load(&base, &Device::Cpu).unwrap()), "the base's tensors, no adapter");
        let expected = candle_core::safetensors::load(adapter.with_extension("safetensors"), &Device::Cpu).unwrap();
        let (inputs, mask) = right_inputs(name);
        let got = outputs(&merged, name, &inputs, false);
        let want = &expected["right.logits"];
        let diff = if is_causal(name) { max_diff_masked(&got, want, &mask) } else { max_diff(&got, want) };
        println!("{name} merged: max |Δ| = {diff:.2e}");
        assert!(diff < 1e-4, "{name}: {diff}");
    }
}

/// Whether the LM head gets a gradient, which the memory plan counts: a
/// full model's does, a LoRA run's frozen head does not, unless its
/// `modules_to_save` train it; the detached network's never does.
#[test]
fn the_head_trains_in_full_runs_and_where_modules_to_save_name_it() {
    let dir = model_dir("gpt_neox-causal");
    let full = Model::load(&dir, &Device::Cpu).unwrap();
    let adapted = |save: &[&str]| {
        Model::load_with_new_adapters(&dir, &Device::Cpu, HeadKind::CausalLm, config(&["all-linear"], save), 3).unwrap()
    };
    let (frozen_head, saved_head) = (adapted(&[]), adapted(&["embed_out"]));
    let trains = |m: &Model| (m.network().head_trains(), m.frozen().head_trains());
    assert_eq!(trains(&full), (true, false));
    assert_eq!(trains(&frozen_head), (false, false));
    assert_eq!(trains(&saved_head), (true, false));
    let (inputs, _) = right_inputs("gpt_neox-causal");
    let loss = saved_head.network().logits(&inputs, None).unwrap().sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    let head = saved_head.params().iter().find(|p| p.name == "embed_out.weight").unwrap();
    assert!(!head.frozen && grads.get(head.compute()).is_some(), "the saved head gets a gradient");
}
