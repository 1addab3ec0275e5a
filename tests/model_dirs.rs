//! Loading and saving model directories: round trips, and the errors a user
//! sees for broken directories.

mod common;

use std::fs;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use common::*;
use rloo::model::lora::PeftOptions;
use rloo::model::{HeadKind, Inputs, Model, Placement};

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

fn load_err(dir: &Path) -> String {
    match Model::load(dir, &Device::Cpu) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

/// Rewrites `model.safetensors` through `edit`, which may drop or replace tensors.
fn edit_weights(dir: &Path, edit: impl FnOnce(&mut std::collections::HashMap<String, Tensor>)) {
    let path = dir.join("model.safetensors");
    let mut tensors = candle_core::safetensors::load(&path, &Device::Cpu).unwrap();
    edit(&mut tensors);
    candle_core::safetensors::save(&tensors, &path).unwrap();
}

fn left_logits(model: &Model, name: &str) -> Tensor {
    let reference = reference(name);
    let inputs = Inputs::new(&reference["left.input_ids"], &reference["left.attention_mask"]).unwrap();
    model.frozen().logits(&inputs, None).unwrap()
}

#[test]
fn saved_directories_load_back_with_identical_outputs() {
    let tmp = tempfile::tempdir().unwrap();
    for name in MODELS {
        let model = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        let out = tmp.path().join(name);
        model.save(&out).unwrap();
        let again = Model::load(&out, &Device::Cpu).unwrap();
        let diff = max_diff(&left_logits(&model, name), &left_logits(&again, name));
        assert_eq!(diff, 0.0, "{name}: logits changed after save + load");
        for p in model.params().iter() {
            let q = again.params().get(&p.name).unwrap();
            assert_eq!(p.stored_dtype, q.stored_dtype, "{name}: `{}` changed dtype", p.name);
        }
        for file in
            ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
        {
            assert!(out.join(file).is_file(), "{name}: {file} not written");
        }
        // transformers refuses safetensors files without this metadata.
        let bytes = fs::read(out.join("model.safetensors")).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().and_then(|m| m.get("format")).map(String::as_str), Some("pt"));
    }
}

/// Base-model checkpoints keep the decoder under a shorter prefix than the
/// LM class's (`decoder.` for OPT's `model.decoder.`, the root for GPT-2's
/// `transformer.`): they load with the same outputs.
#[test]
fn base_model_checkpoints_load_under_their_shorter_prefix() {
    for (name, prefix) in [("opt-causal", "model."), ("opt-postnorm-causal", "model."), ("gpt2-causal", "transformer.")]
    {
        let tmp = tempfile::tempdir().unwrap();
        copy_dir(&model_dir(name), tmp.path());
        edit_weights(tmp.path(), |tensors| {
            let renamed: Vec<(String, Tensor)> =
                tensors.drain().map(|(k, v)| (k.strip_prefix(prefix).map(str::to_string).unwrap_or(k), v)).collect();
            tensors.extend(renamed);
        });
        let base = Model::load(tmp.path(), &Device::Cpu).unwrap();
        let whole = Model::load(&model_dir(name), &Device::Cpu).unwrap();
        assert_eq!(max_diff(&left_logits(&base, name), &left_logits(&whole, name)), 0.0, "{name}");
    }
}

#[test]
fn a_missing_tensor_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&model_dir("gpt_neox-causal"), tmp.path());
    edit_weights(tmp.path(), |t| {
        t.remove("gpt_neox.layers.1.mlp.dense_4h_to_h.weight");
    });
    let err = load_err(tmp.path());
    assert!(err.contains("missing tensor `gpt_neox.layers.1.mlp.dense_4h_to_h.weight`"), "{err}");
    assert!(err.contains("[32, 64]"), "expected shape named: {err}");
}

#[test]
fn a_misshaped_tensor_is_named_with_both_shapes() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&model_dir("qwen3-causal"), tmp.path());
    edit_weights(tmp.path(), |t| {
        t.insert("model.norm.weight".into(), Tensor::zeros(31, candle_core::DType::F32, &Device::Cpu).unwrap());
    });
    let err = load_err(tmp.path());
    assert!(err.contains("`model.norm.weight` has shape [31], expected [32]"), "{err}");
    assert!(err.contains("model.safetensors"), "file named: {err}");
}

#[test]
fn a_corrupt_weights_file_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&model_dir("gpt2-causal"), tmp.path());
    let path = tmp.path().join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn a_missing_shard_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let src = model_dir("llama-causal");
    copy_dir(&src, tmp.path());
    let index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(src.join("model.safetensors.index.json")).unwrap()).unwrap();
    let shard = index["weight_map"].as_object().unwrap().values().next().unwrap().as_str().unwrap().to_string();
    fs::remove_file(tmp.path().join(&shard)).unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains(&shard) && err.contains("missing"), "{err}");
}

#[test]
fn unsupported_model_types_list_what_is_supported() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&model_dir("gpt2-causal"), tmp.path());
    let path = tmp.path().join("config.json");
    let text = fs::read_to_string(&path).unwrap().replace("\"model_type\": \"gpt2\"", "\"model_type\": \"falcon\"");
    fs::write(&path, text).unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("config.json") && err.contains("`falcon`"), "{err}");
    assert!(err.contains("gpt_neox, llama, qwen2, qwen3, gpt2, opt"), "{err}");
}

#[test]
fn a_reward_model_without_its_score_head_is_explained() {
    let tmp = tempfile::tempdir().unwrap();
    copy_dir(&model_dir("gpt2-causal"), tmp.path());
    let path = tmp.path().join("config.json");
    let text = fs::read_to_string(&path).unwrap().replace("GPT2LMHeadModel", "GPT2ForSequenceClassification");
    fs::write(&path, text).unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("`score.weight`") && err.contains("missing"), "{err}");
}

#[test]
fn a_directory_without_config_is_not_a_model() {
    let tmp = tempfile::tempdir().unwrap();
    let err = load_err(tmp.path());
    assert!(err.contains("config.json is missing"), "{err}");
}

#[test]
fn random_initialisation_makes_the_checkpoints_tensors_and_saves_them() {
    let tmp = tempfile::tempdir().unwrap();
    for name in MODELS {
        let dir = model_dir(name);
        let loaded = Model::load(&dir, &Device::Cpu).unwrap();
        let config = rloo::model::ModelConfig::from_dir(&dir).unwrap();
        let fresh = Model::init_random(config, &Device::Cpu, 7, &dir).unwrap();
        let names = |m: &Model| m.params().iter().map(|p| (p.name.clone(), p.var.dims().to_vec())).collect::<Vec<_>>();
        assert_eq!(names(&fresh), names(&loaded), "{name}: same tensors as the checkpoint");
        for p in fresh.params().iter() {
            let v: Vec<f32> = p.var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            if p.name.ends_with(".bias") {
                assert!(v.iter().all(|&x| x == 0.0), "{name}: {} starts at zero", p.name);
            } else if p.name.contains("norm") || p.name.contains(".ln_") {
                assert!(v.iter().all(|&x| x == 1.0), "{name}: {} starts at one", p.name);
            }
        }
        let out = tmp.path().join(name);
        fresh.save(&out).unwrap();
        let again = Model::load(&out, &Device::Cpu).unwrap();
        assert_eq!(max_diff(&left_logits(&fresh, name), &left_logits(&again, name)), 0.0);
        assert!(out.join("tokenizer.json").is_file());
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// A bf16 run reads weights stored in bf16 as they are, with no f32 copy of
/// them all, and ends where reading them as f32 ends: the same masters
/// where parameters train, the same bf16 copies, the same logits, to the
/// bit; with LoRA too, the base kept in bf16 and the adapters with masters.
#[test]
fn weights_stored_in_the_run_dtype_are_read_as_they_are() {
    let dir = model_dir("qwen2-causal");
    let dev = Device::Cpu;
    let bf16 = Placement::new(&dev, DType::BF16);
    let read = Model::load(&dir, bf16).unwrap();
    assert!(read.params().iter().all(|p| p.var.dtype() == DType::BF16), "stored bf16, read as bf16");
    let reference = reference("qwen2-causal");
    let inputs = Inputs::new(&reference["right.input_ids"], &reference["right.attention_mask"]).unwrap();
    let peft = PeftOptions {
        use_peft: true,
        lora_r: 4,
        lora_target_modules: Some(vec!["all-linear".into()]),
        ..Default::default()
    };
    for lora in [false, true] {
        for trains in [true, false] {
            let load = |at: Placement| {
                let options = if lora { peft.clone() } else { PeftOptions::default() };
                Model::load_trainable(&dir, at, HeadKind::CausalLm, (&options, &[]), 5, false)
                    .unwrap()
                    .with_dtype(DType::BF16, trains)
                    .unwrap()
            };
            let (wide, kept) = (load(Placement::from(&dev)), load(bf16));
            for (a, b) in wide.params().iter().zip(kept.params().iter()) {
                let what = format!("{} (LoRA: {lora}, trains: {trains})", a.name);
                assert_eq!((a.var.dtype(), a.compute().dtype()), (b.var.dtype(), b.compute().dtype()), "{what}");
                assert_eq!(bits(&a.master().unwrap()), bits(&b.master().unwrap()), "{what}: master");
                assert_eq!(bits(a.compute()), bits(b.compute()), "{what}: the copy computed with");
                let master = trains && !a.frozen;
                assert_eq!(a.master_dtype() == DType::F32, master, "{what}: an f32 master only where it trains");
            }
            let logits = |m: &Model| bits(&m.network().logits(&inputs, None).unwrap());
            assert_eq!(logits(&wide), logits(&kept), "LoRA: {lora}, trains: {trains}");
        }
    }
}
