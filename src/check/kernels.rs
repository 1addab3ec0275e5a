//! Each kernel of the training and sampling paths on the checked device
//! against the fused CPU kernel, on the same random inputs: the forward
//! value and the gradient of every input, as relative errors.

use candle_core::{DType, Device, Result, Tensor, Var};

use super::{relative_error, Check};
use crate::generate::race::{self, RaceRow};
use crate::generate::sampling::Pick;
use crate::generate::Sampling;
use crate::model::batch::{attention_bias, attention_spans, AttentionSpans, Inputs, PadSide, SharedPrefix};
use crate::model::cache::{KvCache, LayerKv, SharedKv};
use crate::model::kernels::{self, AdamWParam, AdamWStep, AttentionInputs, LoraLayer, Mask, RotaryTables};
use crate::model::ops::Activation;
use crate::rng::Rng;

/// The kernels with a CUDA implementation; on a GPU the others run as
/// compositions of candle ops, and the table says so.
const CUDA_KERNELS: &[&str] = &[
    "linear",
    "activation_linear",
    "gated_linear",
    "gated_mlp_remade",
    "lora",
    "layer_norm",
    "layer_norm_pair",
    "norm_linear",
    "mlp_remade",
    "rms_norm",
    "activation",
    "sum3",
    "sum2",
    "add_cast",
    "cast",
    "non_finite",
    "embedding",
    "rotary",
    "attention",
    "qkv_attention",
    "qkv_heads",
    "decode_attention",
    "rotary_append",
    "token_logprobs",
    "adamw",
    "sum_squares",
    "race",
];

/// Which implementation of `kernel` runs on `device` in `dtype`.
fn path(kernel: &str, device: &Device, dtype: DType) -> &'static str {
    match device {
        Device::Cpu if dtype == DType::F32 => "cpu kernel",
        Device::Cuda(_) if CUDA_KERNELS.contains(&kernel) => "cuda kernel",
        _ => "composition",
    }
}

/// Tolerances on errors relative to the reference's largest magnitude.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-4,
        _ => 4e-2,
    }
}

/// Rotary (cos, sin) tables in rotate-half layout: random angles of the
/// given spread, `half` = (..., R / 2) of them, each used twice.
fn rotary_tables(rng: &mut Rng, half: &[usize], spread: f32) -> Result<(Tensor, Tensor)> {
    let angles = rng.normal_tensor(half, 0.0, spread);
    let angles = Tensor::cat(&[&angles, &angles], half.len() - 1)?;
    Ok((angles.cos()?, angles.sin()?))
}

type Path<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;

/// Runs `cpu` in f32 on the CPU and `device_path` on `device` in `dtype`,
/// backpropagates the same random weighting of the output through both, and
/// reports the worst relative error of the value and of the input gradients
/// (or the error that stopped the comparison).
fn compare(
    name: &str,
    inputs: &[Tensor],
    cpu: Path,
    device_path: Path,
    device: &Device,
    dtype: DType,
    rng: &mut Rng,
) -> Check {
    // The output and the input gradients of `path` run on `device` in
    // `dtype`, as f32 on the CPU; `weights` weight the output in the loss.
    let forward = |f: Path, device: &Device, dtype: DType| -> Result<(Vec<Var>, Tensor)> {
        let vars: Vec<Var> =
            inputs.iter().map(|t| Var::from_tensor(&t.to_device(device)?.to_dtype(dtype)?)).collect::<Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        Ok((vars, f(&ts)?))
    };
    let backward = |(vars, out): (Vec<Var>, Tensor), weights: &Tensor| -> Result<(Tensor, Vec<Tensor>)> {
        let grads = out.mul(&weights.to_device(out.device())?.to_dtype(out.dtype())?)?.sum_all()?.backward()?;
        let mut input_grads = Vec::with_capacity(vars.len());
        for (i, v) in vars.iter().enumerate() {
            match grads.get(v) {
                Some(g) => input_grads.push(g.to_dtype(DType::F32)?.to_device(&Device::Cpu)?),
                None => candle_core::bail!("{name}: input {i} got no gradient on {:?}", out.device()),
            }
        }
        Ok((out.to_dtype(DType::F32)?.to_device(&Device::Cpu)?, input_grads))
    };
    let mut measure = || -> Result<(f32, f32)> {
        let on_cpu = forward(cpu, &Device::Cpu, DType::F32)?;
        let weights = rng.normal_tensor(on_cpu.1.dims(), 0.0, 1.0);
        let (want, want_grads) = backward(on_cpu, &weights)?;
        let (got, got_grads) = backward(forward(device_path, device, dtype)?, &weights)?;
        let mut gradient = 0f32;
        for (g, w) in got_grads.iter().zip(&want_grads) {
            gradient = gradient.max(relative_error(g, w)?);
        }
        Ok((relative_error(&got, &want)?, gradient))
    };
    let kernel = name.split(' ').next().unwrap_or(name);
    let label = format!("{name} ({})", path(kernel, device, dtype));
    match measure() {
        Ok((value, gradient)) => Check::new("kernel", &label, dtype, value, Some(gradient), tolerance(dtype)),
        Err(e) => Check::failed("kernel", &label, dtype, e),
    }
}

/// Every kernel, in f32 and bf16, on `device`.
pub fn check_kernels(device: &Device, dtypes: &[DType]) -> Vec<Check> {
    let mut out = Vec::new();
    for &dtype in dtypes {
        let mut rng = Rng::new(7);
        let rng = &mut rng;
        let (x, w, b) = (
            rng.normal_tensor(&[3, 40, 96], 0.3, 1.0),
            rng.normal_tensor(&[80, 96], 0.0, 0.1),
            rng.normal_tensor(&[80], 0.0, 1.0),
        );
        out.extend(dense_checks(device, dtype, rng, [&x, &w, &b]));
        out.extend(norm_checks(device, dtype, rng, [&x, &w, &b]));
        for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu] {
            out.push(compare(
                &format!("activation {act:?}"),
                std::slice::from_ref(&x),
                &|t| kernels::activation(&t[0], act),
                &|t| kernels::activation(&t[0], act),
                device,
                dtype,
                rng,
            ));
        }
        let (a, m) = (rng.normal_tensor(x.dims(), 0.0, 1.0), rng.normal_tensor(x.dims(), 0.0, 1.0));
        out.push(compare(
            "sum3",
            &[x.clone(), a, m],
            &|t| (&t[0] + &t[1])? + &t[2],
            &|t| kernels::sum3(&t[0], &t[1], &t[2]),
            device,
            dtype,
            rng,
        ));
        out.push(sum2_check(device, dtype, rng).unwrap_or_else(|e| Check::failed("kernel", "sum2", dtype, e)));
        out.push(add_cast_check(device, dtype, rng).unwrap_or_else(|e| Check::failed("kernel", "add_cast", dtype, e)));
        out.push(non_finite_check(device, dtype).unwrap_or_else(|e| Check::failed("kernel", "non_finite", dtype, e)));
        out.push(park_check(device, dtype, rng).unwrap_or_else(|e| Check::failed("kernel", "park", dtype, e)));
        if device.is_cuda() && dtype == DType::BF16 {
            let label = "products tuned";
            out.push(tuned_products_check(device, rng).unwrap_or_else(|e| Check::failed("kernel", label, dtype, e)));
            let label = "products of few rows";
            out.push(rows_products_check(device, rng).unwrap_or_else(|e| Check::failed("kernel", label, dtype, e)));
        }
        // Ids that repeat, and rows of the table that none reads.
        let ids: Vec<u32> = (0..130).map(|i| (i * 7 % 33) as u32).collect();
        out.push(compare(
            "embedding",
            &[rng.normal_tensor(&[40, 96], 0.0, 1.0)],
            &|t| t[0].index_select(&Tensor::new(ids.as_slice(), t[0].device())?, 0),
            &|t| kernels::gather_rows(&t[0], &Tensor::new(ids.as_slice(), t[0].device())?),
            device,
            dtype,
            rng,
        ));
        match attention_checks(device, dtype, rng) {
            Ok(checks) => out.extend(checks),
            Err(e) => out.push(Check::failed("kernel", "attention", dtype, e)),
        }
        // On a GPU also the kernel with a lane per key, at a head size under 32 too.
        let lanes = match device.is_cuda() {
            true => &[16, 64, 128][..],
            false => &[],
        };
        // And a cache long enough that a few rows split their keys across blocks; and the rows of
        // a prompt in one block of the lanes.
        // And the lanes with their value rows packed into loads (RLOO_DECODE_VALUES=packed).
        let kernels = [64, 128].iter().map(|&d| (d, (false, false, false), false));
        let lanes = lanes.iter().map(|&d| (d, (true, false, false), false));
        let gpu = device.is_cuda().then_some([
            (64, (false, false, false), true),
            (64, (true, false, false), true),
            (64, (true, true, false), false),
            (128, (true, true, false), false),
            (64, (true, true, false), true),
            (16, (true, false, true), false),
            (64, (true, false, true), false),
            (128, (true, false, true), true),
            (64, (true, true, true), false),
        ]);
        for (d, lanes, long) in kernels.chain(lanes).chain(gpu.into_iter().flatten()) {
            out.push(
                decode_attention_check(device, dtype, d, lanes, long, rng)
                    .unwrap_or_else(|e| Check::failed("kernel", &format!("decode_attention, head size {d}"), dtype, e)),
            );
        }
        // One launch on a GPU; elsewhere the composition it would be compared with.
        if device.is_cuda() {
            out.push(
                layer_norm_pair_check(device, dtype, rng)
                    .unwrap_or_else(|e| Check::failed("kernel", "layer_norm_pair, against each alone", dtype, e)),
            );
            // 40: features not in whole 8s, a thread each; else 8 a thread.
            for d in [40, 64, 128] {
                out.push(
                    rotary_append_check(device, dtype, d, rng).unwrap_or_else(|e| {
                        Check::failed("kernel", &format!("rotary_append, head size {d}"), dtype, e)
                    }),
                );
            }
        }
        let (hidden, head) = (rng.normal_tensor(&[24, 64], 0.0, 1.0), rng.normal_tensor(&[500, 64], 0.0, 0.2));
        let targets: Vec<u32> = (0..24).map(|i| (i * 37 % 500) as u32).collect();
        out.push(compare(
            "token_logprobs",
            &[hidden, head],
            &|t| Ok(kernels::token_logprobs(&t[0], &t[1], &targets, 0.7)?.0),
            &|t| Ok(kernels::token_logprobs(&t[0], &t[1], &targets, 0.7)?.0),
            device,
            dtype,
            rng,
        ));
    }
    // The optimizer's casts between its f32 sums and masters and the bf16 copies.
    out.push(cast_check(device).unwrap_or_else(|e| Check::failed("kernel", "cast", DType::BF16, e)));
    // AdamW keeps f32 state whatever the compute dtype.
    out.push(adamw_check(device).unwrap_or_else(|e| Check::failed("kernel", "adamw", DType::F32, e)));
    out.push(adamw_many_check(device).unwrap_or_else(|e| Check::failed("kernel", "adamw_many", DType::F32, e)));
    out.push(
        adamw_split_check(device)
            .unwrap_or_else(|e| Check::failed("kernel", "adamw_many, split masters", DType::BF16, e)),
    );
    // One launch on a GPU; elsewhere the composition it would be compared with.
    if device.is_cuda() {
        out.push(squares_check(device).unwrap_or_else(|e| Check::failed("kernel", "sum_squares", DType::F32, e)));
    }
    // Sampling reads f32 logits whatever the compute dtype.
    match race_checks(device) {
        Ok(checks) => out.extend(checks),
        Err(e) => out.push(Check::failed("kernel", "race sampler", DType::F32, e)),
    }
    out
}

/// The dense layers on `device` in `dtype`, over the input `x` (3, 40, 96)
/// and a layer's weight `w` (80, 96) and bias `b`: with and without the
/// bias (and on a GPU in bf16 with it in cuBLASLt's epilogue), on an
/// activated input, a gated MLP's output layer and the whole MLP after its
/// norm, and LoRA adapters over them.
fn dense_checks(device: &Device, dtype: DType, rng: &mut Rng, [x, w, b]: [&Tensor; 3]) -> Vec<Check> {
    let mut out = Vec::new();
    out.push(compare(
        "linear",
        &[x.clone(), w.clone(), b.clone()],
        &|t| kernels::linear(&t[0], &t[1], Some(&t[2])),
        &|t| kernels::linear_with(&t[0], &t[1], Some(&t[2]), false),
        device,
        dtype,
        rng,
    ));
    out.push(compare(
        "linear without a bias",
        &[x.clone(), w.clone()],
        &|t| kernels::linear(&t[0], &t[1], None),
        &|t| kernels::linear(&t[0], &t[1], None),
        device,
        dtype,
        rng,
    ));
    // On a GPU in bf16, also the bias added in cuBLASLt's epilogue, with the
    // weight as given and as the transposed view of an (in, out) tensor.
    if device.is_cuda() && dtype == DType::BF16 {
        let labels =
            [("linear with the bias in the epilogue", false), ("linear with the bias in the epilogue, w^T", true)];
        for (label, transposed) in labels {
            // Transposed: the input is (in, out), and the op gets its transposed view.
            let w = match transposed {
                true => w.t().and_then(|t| t.contiguous()).expect("a 2-d weight transposes"),
                false => w.clone(),
            };
            out.push(compare(
                label,
                &[x.clone(), w, b.clone()],
                &|t| kernels::linear(&t[0], &maybe_t(&t[1], transposed)?, Some(&t[2])),
                &|t| kernels::linear_with(&t[0], &maybe_t(&t[1], transposed)?, Some(&t[2]), true),
                device,
                dtype,
                rng,
            ));
        }
    }
    // An MLP's second layer on its activated input, which the backward makes again.
    for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu] {
        out.push(compare(
            &format!("activation_linear {act:?}"),
            &[x.clone(), w.clone(), b.clone()],
            &|t| kernels::linear(&kernels::activation(&t[0], act)?, &t[1], Some(&t[2])),
            &|t| kernels::activation_linear(&t[0], act, &t[1], Some(&t[2])),
            device,
            dtype,
            rng,
        ));
    }
    // A gated MLP's output layer on its two inputs, which the backward
    // multiplies again.
    let up = rng.normal_tensor(x.dims(), 0.0, 1.0);
    out.push(compare(
        "gated_linear",
        &[x.clone(), up, w.clone()],
        &|t| kernels::linear(&(kernels::activation(&t[0], Activation::Silu)? * &t[1])?, &t[2], None),
        &|t| kernels::gated_linear(&t[0], &t[1], Activation::Silu, &t[2]),
        device,
        dtype,
        rng,
    ));
    // A gated MLP after its RMS norm, whose backward makes the norm's
    // output and the gate and up projections again (Llama, Qwen with
    // RLOO_MLP_INPUT=remade); its dense layers have no bias.
    let (gate_w, up_w, down_w) = (
        rng.normal_tensor(&[80, 96], 0.0, 0.1),
        rng.normal_tensor(&[80, 96], 0.0, 0.1),
        rng.normal_tensor(&[96, 80], 0.0, 0.1),
    );
    let gated_mlp = |t: &[Tensor]| {
        let h = kernels::rms_norm(&t[0], &t[1], 1e-6)?;
        let (gate, up) = (kernels::linear(&h, &t[2], None)?, kernels::linear(&h, &t[3], None)?);
        kernels::gated_linear(&gate, &up, Activation::Silu, &t[4])
    };
    out.push(compare(
        "gated_mlp_remade",
        &[x.clone(), rng.normal_tensor(&[96], 1.0, 0.2), gate_w, up_w, down_w],
        &gated_mlp,
        &|t| {
            let h = kernels::rms_norm(&t[0], &t[1], 1e-6)?;
            // None where the norm is a composition (bf16 on the CPU).
            let Some(normed) = kernels::rms_norm_remake(&t[0], &t[1], 1e-6) else { return gated_mlp(t) };
            let dense = |w: &Tensor| kernels::linear_remade(&h, w, None, normed.clone());
            let again = |w: &Tensor| -> kernels::Remake {
                let (normed, w) = (normed.clone(), w.detach());
                std::sync::Arc::new(move || kernels::linear(&normed()?, &w, None))
            };
            let remakes = (again(&t[2]), again(&t[3]));
            kernels::gated_linear_remade(&dense(&t[2])?, &dense(&t[3])?, Activation::Silu, &t[4], remakes)
        },
        device,
        dtype,
        rng,
    ));
    // A LoRA adapter over a frozen base (its weight and bias no inputs),
    // with its input dropped out by one mask on both sides; also on an
    // activated input.
    let (a, lora_b, mask) =
        (rng.normal_tensor(&[8, 96], 0.0, 0.2), rng.normal_tensor(&[80, 8], 0.0, 0.2), Mask::new([3, 5], 0.1));
    for act in [None, Some(Activation::Gelu)] {
        let lora = |t: &[Tensor]| {
            let frozen = |x: &Tensor| x.to_device(t[0].device())?.to_dtype(t[0].dtype());
            let (w, b) = (frozen(w)?, frozen(b)?);
            let layer = LoraLayer { weight: &w, bias: Some(&b), a: &t[1], b: &t[2], scale: 2.0 };
            kernels::lora_forward(&t[0], act, &layer, Some(mask))
        };
        let name = match act {
            Some(act) => format!("lora on {act:?}, with dropout"),
            None => "lora with dropout".into(),
        };
        out.push(compare(&name, &[x.clone(), a.clone(), lora_b.clone()], &lora, &lora, device, dtype, rng));
    }
    // The same over a gated MLP's product (Llama, Qwen with an adapter on
    // down_proj): the product's op keeps the gate and up projections, and
    // the adapter's op makes the product again; against the composition.
    let gated_lora = |remade: bool| {
        let w = w.clone();
        move |t: &[Tensor]| -> Result<Tensor> {
            let w = w.to_device(t[0].device())?.to_dtype(t[0].dtype())?;
            let layer = LoraLayer { weight: &w, bias: None, a: &t[2], b: &t[3], scale: 2.0 };
            if !remade {
                let product = (kernels::activation(&t[0], Activation::Silu)? * &t[1])?;
                return kernels::lora_forward(&product, None, &layer, Some(mask));
            }
            let (product, remake) = kernels::gated_product(&t[0], &t[1], Activation::Silu)?;
            kernels::lora_forward_remade(&product, &layer, Some(mask), remake)
        }
    };
    let up = rng.normal_tensor(x.dims(), 0.0, 1.0);
    out.push(compare(
        "lora over a gated product, with dropout",
        &[x.clone(), up, a.clone(), lora_b.clone()],
        &gated_lora(false),
        &gated_lora(true),
        device,
        dtype,
        rng,
    ));
    out
}

/// The norms on `device` in `dtype` over `x`, alone and as one op with the
/// dense layer `w`, `b` that they feed, and an MLP after its norm.
fn norm_checks(device: &Device, dtype: DType, rng: &mut Rng, [x, w, b]: [&Tensor; 3]) -> Vec<Check> {
    let mut out = Vec::new();
    let (g, beta) = (rng.normal_tensor(&[96], 1.0, 0.2), rng.normal_tensor(&[96], 0.0, 0.2));
    out.push(compare(
        "layer_norm",
        &[x.clone(), g.clone(), beta],
        &|t| kernels::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        &|t| kernels::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        device,
        dtype,
        rng,
    ));
    // Rows of 1,032 features: on a GPU, lanes that hold unequal numbers of 8-feature chunks.
    let (wide, wide_g, wide_beta) = (
        rng.normal_tensor(&[5, 1032], 0.5, 1.0),
        rng.normal_tensor(&[1032], 1.0, 0.2),
        rng.normal_tensor(&[1032], 0.0, 0.2),
    );
    out.push(compare(
        "layer_norm over 1,032 features",
        &[wide, wide_g, wide_beta],
        &|t| kernels::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        &|t| kernels::layer_norm(&t[0], &t[1], &t[2], 1e-5),
        device,
        dtype,
        rng,
    ));
    // A norm and the dense layer it feeds, as one op.
    let (norm_w, norm_b) = (rng.normal_tensor(&[96], 1.0, 0.2), rng.normal_tensor(&[96], 0.0, 0.2));
    out.push(compare(
        "norm_linear",
        &[x.clone(), norm_w, norm_b, w.clone(), b.clone()],
        &|t| kernels::linear(&kernels::layer_norm(&t[0], &t[1], &t[2], 1e-5)?, &t[3], Some(&t[4])),
        &|t| kernels::norm_linear(&t[0], (&t[1], &t[2], 1e-5), &t[3], &t[4]),
        device,
        dtype,
        rng,
    ));
    // An MLP after its norm whose backward makes the wide input again
    // (where the norm and its dense layer run as one op).
    let (down_w, down_b) = (rng.normal_tensor(&[96, 80], 0.0, 0.1), rng.normal_tensor(&[96], 0.0, 1.0));
    let (norm_w, norm_b) = (rng.normal_tensor(&[96], 1.0, 0.2), rng.normal_tensor(&[96], 0.0, 0.2));
    let act = Activation::Gelu;
    out.push(compare(
        "mlp_remade",
        &[x.clone(), norm_w, norm_b, w.clone(), b.clone(), down_w, down_b],
        &|t| {
            let wide = kernels::linear(&kernels::layer_norm(&t[0], &t[1], &t[2], 1e-5)?, &t[3], Some(&t[4]))?;
            kernels::activation_linear(&wide, act, &t[5], Some(&t[6]))
        },
        &|t| {
            let norm = (&t[1], &t[2], 1e-5);
            let wide = kernels::norm_linear(&t[0], norm, &t[3], &t[4])?;
            match kernels::norm_linear_remake(&t[0], norm, &t[3], &t[4])? {
                Some(remake) => kernels::activation_linear_remade(&wide, act, &t[5], &t[6], remake),
                None => kernels::activation_linear(&wide, act, &t[5], Some(&t[6])),
            }
        },
        device,
        dtype,
        rng,
    ));
    out.push(compare(
        "rms_norm",
        &[x.clone(), g],
        &|t| kernels::rms_norm(&t[0], &t[1], 1e-6),
        &|t| kernels::rms_norm(&t[0], &t[1], 1e-6),
        device,
        dtype,
        rng,
    ));
    out
}

/// The tensor-core attention kernels on `device` against the CPU, where
/// they run: on a GPU, in bf16. Run after every other check, as a fault
/// there ends every later launch on the device.
pub fn check_tensor_attention(device: &Device, dtypes: &[DType]) -> Vec<Check> {
    let mut out = Vec::new();
    if !(device.is_cuda() && dtypes.contains(&DType::BF16)) {
        return out;
    }
    let mut rng = Rng::new(7);
    for (choice, spans, name) in [
        (kernels::AttentionKernels::Tensor, false, "attention on tensor cores"),
        (kernels::AttentionKernels::Flash, false, "flash attention on tensor cores"),
        (kernels::AttentionKernels::Flash, true, "flash attention on tensor cores over spans"),
    ] {
        for d in [64, 128, 256] {
            let name = format!("{name}, head size {d}");
            out.push(
                tensor_attention_check(device, d, (choice, spans), false, &name, &mut rng)
                    .unwrap_or_else(|e| Check::failed("kernel", &name, DType::BF16, e)),
            );
        }
        // The output as the output projection takes it (the flash kernels write it so).
        for d in [64, 128] {
            let name = format!("{name}, a token's heads side by side, head size {d}");
            out.push(
                tensor_attention_check(device, d, (choice, spans), true, &name, &mut rng)
                    .unwrap_or_else(|e| Check::failed("kernel", &name, DType::BF16, e)),
            );
        }
        for d in [64, 128] {
            let name = format!("qkv_attention, {name}, head size {d}");
            out.push(
                qkv_attention_check(device, d, (choice, spans), &name, &mut rng)
                    .unwrap_or_else(|e| Check::failed("kernel", &name, DType::BF16, e)),
            );
        }
    }
    out
}

/// Step `t` (from 1) of the checks' AdamW.
fn adamw_step(t: i32, decay: f32) -> AdamWStep {
    AdamWStep {
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        lr: 1e-2,
        bias1: 1.0 - 0.9f32.powi(t),
        bias2: 1.0 - 0.999f32.powi(t),
        decay,
    }
}

/// Three AdamW steps of several parameters at once (one launch on a GPU),
/// with and without weight decay, against the CPU kernel one by one.
fn adamw_many_check(device: &Device) -> Result<Check> {
    let mut rng = Rng::new(12);
    let shapes: [&[usize]; 4] = [&[37, 1000], &[5], &[3, 7, 11], &[1]];
    let w0: Vec<Tensor> = shapes.iter().map(|s| rng.normal_tensor(s, 0.0, 1.0)).collect();
    let grads: Vec<Vec<Tensor>> =
        (0..3).map(|_| shapes.iter().map(|s| rng.normal_tensor(s, 0.1, 1.0)).collect()).collect();
    let run = |device: &Device, together: bool| -> Result<Vec<Tensor>> {
        let ws = w0.iter().map(|w| Var::from_tensor(&w.to_device(device)?)).collect::<Result<Vec<_>>>()?;
        let mut moments = ws.iter().map(|w| Ok((w.zeros_like()?, w.zeros_like()?))).collect::<Result<Vec<_>>>()?;
        for (t, gs) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            let gs = gs.iter().map(|g| g.to_device(device)).collect::<Result<Vec<_>>>()?;
            let mut params: Vec<AdamWParam> = ws
                .iter()
                .zip(&gs)
                .zip(moments.iter_mut())
                .enumerate()
                .map(|(i, ((w, g), (m, v)))| AdamWParam {
                    w,
                    split: None,
                    g,
                    m,
                    v,
                    step: adamw_step(t, if i % 2 == 0 { 1.0 - 1e-3 } else { 1.0 }),
                })
                .collect();
            match together {
                true => kernels::adamw_many(&mut params)?,
                false => {
                    for p in params.iter_mut() {
                        kernels::adamw(p.w, p.g, p.m, p.v, p.step)?;
                    }
                }
            }
        }
        ws.iter().map(|w| w.as_tensor().flatten_all()?.to_device(&Device::Cpu)).collect()
    };
    let (want, got) = (run(&Device::Cpu, false)?, run(device, true)?);
    let error = Tensor::cat(&got, 0).and_then(|got| relative_error(&got, &Tensor::cat(&want, 0)?))?;
    let label = format!("adamw_many, 4 parameters, 3 steps ({})", path("adamw", device, DType::F32));
    Ok(Check::new("kernel", &label, DType::F32, error, None, 1e-5))
}

/// Three AdamW steps of several parameters at once with their masters
/// split beside bf16 copies (`RLOO_MASTERS=split`; one launch on a GPU)
/// against the same steps on f32 masters cast to bf16 after each: the
/// masters and the copies must be the same bits. Returns the share of
/// elements that differ in either.
fn adamw_split_check(device: &Device) -> Result<Check> {
    let mut rng = Rng::new(13);
    // 37,003 and 5 elements: warps that end inside a word of carries.
    let shapes: [&[usize]; 3] = [&[37, 1001, 1], &[5], &[64, 3]];
    let w0: Vec<Tensor> = shapes.iter().map(|s| rng.normal_tensor(s, 0.0, 1.0)).collect();
    let grads: Vec<Vec<Tensor>> =
        (0..3).map(|_| shapes.iter().map(|s| rng.normal_tensor(s, 0.1, 1.0)).collect()).collect();
    // Each way: the masters (f32) and the copies (bf16), flattened on the host.
    let run = |split: bool| -> Result<(Tensor, Tensor)> {
        let masters = w0.iter().map(|w| Var::from_tensor(&w.to_device(device)?)).collect::<Result<Vec<_>>>()?;
        let parts: Vec<Option<(Tensor, kernels::SplitMaster)>> = masters
            .iter()
            .map(|w| split.then(|| kernels::SplitMaster::split(w.as_tensor())).transpose())
            .collect::<Result<_>>()?;
        let ws: Vec<Var> = match split {
            true => parts.iter().flatten().map(|(copy, _)| Var::from_tensor(copy)).collect::<Result<_>>()?,
            false => masters,
        };
        let mut moments = ws
            .iter()
            .map(|w| Ok((Tensor::zeros(w.shape(), DType::F32, device)?, Tensor::zeros(w.shape(), DType::F32, device)?)))
            .collect::<Result<Vec<_>>>()?;
        for (t, gs) in grads.iter().enumerate() {
            let gs = gs.iter().map(|g| g.to_device(device)).collect::<Result<Vec<_>>>()?;
            let mut params: Vec<AdamWParam> = ws
                .iter()
                .zip(&parts)
                .zip(&gs)
                .zip(moments.iter_mut())
                .enumerate()
                .map(|(i, (((w, part), g), (m, v)))| AdamWParam {
                    w,
                    split: part.as_ref().map(|(_, s)| s),
                    g,
                    m,
                    v,
                    step: adamw_step(t as i32 + 1, if i % 2 == 0 { 1.0 - 1e-3 } else { 1.0 }),
                })
                .collect();
            kernels::adamw_many(&mut params)?;
        }
        let flat = |ts: Vec<Tensor>| Tensor::cat(&ts.iter().map(|t| t.flatten_all()).collect::<Result<Vec<_>>>()?, 0);
        let (masters, copies): (Vec<Tensor>, Vec<Tensor>) = ws
            .iter()
            .zip(&parts)
            .map(|(w, part)| match part {
                Some((_, rest)) => Ok((rest.join(w.as_tensor())?, w.as_tensor().clone())),
                None => Ok((w.as_tensor().clone(), w.to_dtype(DType::BF16)?)),
            })
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .unzip();
        Ok((flat(masters)?.to_device(&Device::Cpu)?, flat(copies)?.to_device(&Device::Cpu)?))
    };
    let ((want_m, want_c), (got_m, got_c)) = (run(false)?, run(true)?);
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.to_dtype(DType::F32)?.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
    };
    let (want_m, got_m, want_c, got_c) = (bits(&want_m)?, bits(&got_m)?, bits(&want_c)?, bits(&got_c)?);
    let differ = (0..want_m.len()).filter(|&i| want_m[i] != got_m[i] || want_c[i] != got_c[i]).count();
    let share = differ as f32 / want_m.len() as f32;
    let label = format!("adamw_many, split masters, the f32 masters' bits ({})", path("adamw", device, DType::F32));
    Ok(Check::new("kernel", &label, DType::BF16, share, None, 0.0))
}

/// The gradient norm's sums of squares of several tensors (one launch on a
/// GPU) against the CPU's composition.
fn squares_check(device: &Device) -> Result<Check> {
    let mut rng = Rng::new(14);
    let shapes: [&[usize]; 4] = [&[37, 1000], &[5], &[3, 7, 11], &[1]];
    let host: Vec<Tensor> = shapes.iter().map(|s| rng.normal_tensor(s, 0.1, 1.0)).collect();
    let on_device = host.iter().map(|t| t.to_device(device)).collect::<Result<Vec<_>>>()?;
    let sums = |ts: &[Tensor]| -> Result<Tensor> {
        let sums = kernels::sums_of_squares(&ts.iter().collect::<Vec<_>>())?;
        Tensor::from_vec(sums.iter().map(|&s| s as f32).collect::<Vec<_>>(), sums.len(), &Device::Cpu)
    };
    let error = relative_error(&sums(&on_device)?, &sums(&host)?)?;
    let label = format!("sum_squares, 4 tensors ({})", path("sum_squares", device, DType::F32));
    Ok(Check::new("kernel", &label, DType::F32, error, None, 1e-6))
}

/// The race sampler on the device against its CPU reference on the same
/// logits, each row with its own settings (greedy, temperature, top-k,
/// top-p, min-p, a repetition penalty): the share of tokens that differ
/// (exp and log may round a near-tie the other way: at most one row in 50),
/// the log-probs and entropies, and whether a second run draws the same.
fn race_checks(device: &Device) -> Result<Vec<Check>> {
    let (rows, vocab) = (96, 12_579); // a vocabulary that is no multiple of 4 or 32
    let mut rng = Rng::new(13);
    let logits = rng.normal_tensor(&[rows, vocab], 0.0, 3.0);
    let settings = [
        Sampling::greedy(),
        Sampling::temperature(1.0),
        Sampling::temperature(0.7).with_top_k(50),
        Sampling::temperature(1.0).with_top_p(0.9),
        Sampling::temperature(1.3).with_min_p(0.05),
        Sampling::temperature(1.0).with_top_k(40).with_top_p(0.8).with_min_p(0.02),
    ];
    let draws: Vec<RaceRow> = (0..rows)
        .map(|i| {
            let penalty = if i % 2 == 0 { 1.0 } else { 1.3 };
            RaceRow::new(&settings[i % settings.len()], penalty, &Rng::stream(13, &[i as u64]), i % 5)
        })
        .collect();
    let seen: Vec<Vec<u32>> =
        (0..rows).map(|_| (0..200).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()).collect();
    let (bits, width) = race::seen_bits(seen.iter().map(|r| r.iter()), vocab);
    let seen = Tensor::from_vec(bits, (rows, width), &Device::Cpu)?;
    let picks = |logits: &Tensor, device: &Device| -> Result<Vec<Pick>> {
        race::pick(&logits.to_device(device)?, &draws, Some(&seen.to_device(device)?)).map_err(candle_core::Error::wrap)
    };
    let run = |device: &Device| picks(&logits, device);
    let (want, got, again) = (run(&Device::Cpu)?, run(device)?, run(device)?);
    let differ =
        |a: &[Pick], b: &[Pick]| a.iter().zip(b).filter(|(x, y)| x.token != y.token).count() as f32 / rows as f32;
    let mut stats = 0f32;
    for (g, w) in got.iter().zip(&want) {
        if g.token == w.token {
            stats = stats.max((g.logprob - w.logprob).abs() / w.logprob.abs().max(1.0));
        }
        stats = stats.max((g.entropy - w.entropy).abs() / w.entropy.abs().max(1.0));
    }
    let label = |what: &str| format!("race sampler {what} ({})", path("race", device, DType::F32));
    let mut checks = vec![
        Check::new("kernel", &label("tokens"), DType::F32, differ(&got, &want), None, 2e-2),
        Check::new("kernel", &label("log-probs, entropies"), DType::F32, stats, None, 1e-4),
        Check::new("kernel", &label("run twice"), DType::F32, (got != again) as u8 as f32, None, 0.0),
    ];
    if !device.is_cpu() {
        // A bf16 run's logits, read as they are: the picks of their f32 cast, to the bit.
        let narrow = logits.to_dtype(DType::BF16)?;
        let (got, want) = (picks(&narrow, device)?, picks(&narrow.to_dtype(DType::F32)?, device)?);
        let bits = |p: &Pick| (p.token, p.logprob.to_bits(), p.entropy.to_bits());
        let differ = got.iter().zip(&want).filter(|(g, w)| bits(g) != bits(w)).count() as f32 / rows as f32;
        let what = format!(
            "race sampler on bf16 logits against their f32 cast, to the bit ({})",
            path("race", device, DType::BF16)
        );
        checks.push(Check::new("kernel", &what, DType::BF16, differ, None, 0.0));
    }
    Ok(checks)
}

/// The largest absolute difference between `got` and `want`, wherever
/// they lie, compared as f32 on the CPU.
fn largest_difference(got: &Tensor, want: &Tensor) -> Result<f32> {
    let on_cpu = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    (on_cpu(got)? - on_cpu(want)?)?.abs()?.max_all()?.to_scalar::<f32>()
}

/// Two tensors in `dtype` added on `device` (as the backward adds a
/// tensor's gradients), against the CPU's addition in `dtype`: the same
/// values (the largest difference, which must be 0).
fn sum2_check(device: &Device, dtype: DType, rng: &mut Rng) -> Result<Check> {
    let (x, a) = (rng.normal_tensor(&[37, 129], 0.0, 1.0), rng.normal_tensor(&[37, 129], 0.0, 3.0));
    let (x, a) = (x.to_dtype(dtype)?, a.to_dtype(dtype)?);
    let got = kernels::sum2(&x.to_device(device)?, &a.to_device(device)?)?;
    let differ = largest_difference(&got, &(&x + &a)?)?;
    // On the CPU, candle's addition.
    let how = if device.is_cpu() { "composition" } else { path("sum2", device, dtype) };
    let label = format!("sum2, a tensor's two gradients summed ({how})");
    Ok(Check::new("kernel", &label, dtype, differ, None, 0.0))
}

/// A gradient in `dtype` added into an f32 sum on `device`, into a new
/// tensor and in place, against the CPU's cast and addition: the same bits
/// (the largest difference, which must be 0).
fn add_cast_check(device: &Device, dtype: DType, rng: &mut Rng) -> Result<Check> {
    let (sum, g) = (rng.normal_tensor(&[37, 129], 0.0, 1.0), rng.normal_tensor(&[37, 129], 0.0, 1.0).to_dtype(dtype)?);
    let want = (&sum + g.to_dtype(DType::F32)?)?;
    let (on_device, g) = (sum.to_device(device)?, g.to_device(device)?);
    let new = kernels::add_cast(&on_device, &g)?;
    // A copy of its own: to_device onto the CPU shares the host tensor's storage.
    let mut in_place = on_device.copy()?;
    kernels::add_cast_to(&mut in_place, &g)?;
    let differ = largest_difference(&new, &want)?.max(largest_difference(&in_place, &want)?);
    let label =
        format!("add_cast, a gradient into its f32 sum, new and in place ({})", path("add_cast", device, dtype));
    Ok(Check::new("kernel", &label, dtype, differ, None, 0.0))
}

/// The casts between f32 and bf16 on `device`, into a new tensor and
/// written over one, and an f32 sum scaled in place, against the CPU's
/// casts and product: the same values (the largest difference, which must
/// be 0).
fn cast_check(device: &Device) -> Result<Check> {
    let wide = Rng::new(16).normal_tensor(&[37, 129], 0.0, 1.0);
    let narrow = wide.to_dtype(DType::BF16)?;
    let (wide_on, narrow_on) = (wide.to_device(device)?, narrow.to_device(device)?);
    let narrow_into = Tensor::zeros(wide.shape(), DType::BF16, device)?;
    kernels::cast_into(&narrow_into, &wide_on)?;
    let wide_into = Tensor::zeros(wide.shape(), DType::F32, device)?;
    kernels::cast_into(&wide_into, &narrow_on)?;
    // A copy of its own: to_device onto the CPU shares the host tensor's storage.
    let mut scaled = wide_on.copy()?;
    kernels::scale_to(&mut scaled, 0.37)?;
    let pairs = [
        (kernels::cast(&wide_on, DType::BF16)?, narrow.clone()),
        (narrow_into, narrow.clone()),
        (kernels::cast(&narrow_on, DType::F32)?, narrow.to_dtype(DType::F32)?),
        (wide_into, narrow.to_dtype(DType::F32)?),
        (scaled, (&wide * 0.37)?),
    ];
    let mut differ = 0f32;
    for (got, want) in pairs {
        differ = differ.max(largest_difference(&got, &want)?);
    }
    let how = if device.is_cpu() { "cpu" } else { path("cast", device, DType::BF16) };
    let label = format!("cast between f32 and bf16, new and in place, and a scale in place ({how})");
    Ok(Check::new("kernel", &label, DType::BF16, differ, None, 0.0))
}

/// Weights in `dtype` moved to host memory and back (`ref_reward_offload`,
/// `model::park`): products read through a detached copy and a transposed
/// view, before the move and after each way back (brought back when read,
/// and copied back beside other work first); the largest difference, which
/// must be 0.
fn park_check(device: &Device, dtype: DType, rng: &mut Rng) -> Result<Check> {
    let on_device = |t: Tensor| t.to_dtype(dtype)?.to_device(device);
    let (w, x) =
        (on_device(rng.normal_tensor(&[300, 129], 0.0, 1.0))?, on_device(rng.normal_tensor(&[7, 300], 0.0, 1.0))?);
    let (copy, view) = (w.detach(), w.t()?);
    let products = || -> Result<[Tensor; 2]> { Ok([x.matmul(&copy)?, view.matmul(&x.t()?)?]) };
    let before = products()?;
    let parking = crate::model::park::Parking::default();
    let moved = |r: crate::error::Result<()>| r.map_err(|e| candle_core::Error::msg(e.to_string()));
    let mut differ = 0f32;
    for beside in [false, true] {
        moved(parking.park("check", || vec![w.clone(), copy.clone(), view.clone()]))?;
        if beside {
            moved(parking.begin_return())?;
            x.matmul(&x.t()?)?;
        }
        moved(parking.resident())?;
        for (got, want) in products()?.iter().zip(&before) {
            differ = differ.max(largest_difference(got, want)?);
        }
    }
    let how = if device.is_cuda() { "page-locked, copied back on a stream of their own" } else { "moved aside" };
    let label = format!("park, weights to host memory and back ({how})");
    Ok(Check::new("kernel", &label, dtype, differ, None, 0.0))
}

/// bf16 products at a decoding step's shape (256 rows) with `RLOO_GEMM=tuned`
/// against the default's, to the bit: a layer with its bias in cuBLASLt's
/// epilogue, without a bias (cuBLAS's product by default), with the
/// weight as the transposed view of an (in, out) tensor, and a LoRA
/// adapter's part added into its output; each twice, as the shape is tuned
/// and with the kept pick. The largest difference, which must be 0.
fn tuned_products_check(device: &Device, rng: &mut Rng) -> Result<Check> {
    let on_device = |t: Tensor| t.to_dtype(DType::BF16)?.to_device(device);
    let x = on_device(rng.normal_tensor(&[256, 1024], 0.0, 1.0))?;
    let w = on_device(rng.normal_tensor(&[3072, 1024], 0.0, 0.03))?;
    let b = on_device(rng.normal_tensor(&[3072], 0.0, 1.0))?;
    let w_in_out = w.t()?.contiguous()?;
    let (a, lora_b) =
        (on_device(rng.normal_tensor(&[16, 1024], 0.0, 0.03))?, on_device(rng.normal_tensor(&[3072, 16], 0.0, 0.03))?);
    let layer = LoraLayer { weight: &w, bias: Some(&b), a: &a, b: &lora_b, scale: 2.0 };
    let products = || -> Result<Vec<Tensor>> {
        Ok(vec![
            kernels::linear_with(&x, &w, Some(&b), true)?,
            kernels::linear(&x, &w, None)?,
            kernels::linear(&x, &w_in_out.t()?, None)?,
            kernels::lora_forward(&x, None, &layer, None)?,
        ])
    };
    // The default's bits whatever RLOO_GEMM the check runs under (rows' differ).
    let before = with_gemm("heuristic", products)?;
    let tuned = with_gemm("tuned", || Ok([products()?, products()?]));
    let mut differ = 0f32;
    for run in tuned? {
        for (got, want) in run.iter().zip(&before) {
            differ = differ.max(largest_difference(got, want)?);
        }
    }
    let label = "products tuned (RLOO_GEMM=tuned), the default's bits (cuda kernel)";
    Ok(Check::new("kernel", label, DType::BF16, differ, None, 0.0))
}

/// `run` with `RLOO_GEMM` set to `choice`, then as it was.
fn with_gemm<T>(choice: &str, run: impl FnOnce() -> Result<T>) -> Result<T> {
    let chosen = std::env::var(kernels::GEMM_VAR).ok();
    std::env::set_var(kernels::GEMM_VAR, choice);
    let out = run();
    match chosen {
        Some(v) => std::env::set_var(kernels::GEMM_VAR, v),
        None => std::env::remove_var(kernels::GEMM_VAR),
    }
    out
}

/// bf16 products by the rows kernel (`RLOO_GEMM=rows`) against the CPU's
/// f32 products of the same bf16 operands: a 410m decoding step's (256
/// rows by 1,024 into 3,072; GELU's of 4,096 into 1,024, in slices of k),
/// few rows of odd widths, and one too large for the kernel (cuBLAS's
/// then). Each twice, which must give the same bits. The largest relative
/// error, or 1 where a run differs from the first or the kernel did not
/// take a product it should have (or took the large one).
fn rows_products_check(device: &Device, rng: &mut Rng) -> Result<Check> {
    // (rows, in, out, bias, the activation of x, whether the kernel takes it)
    let shapes = [
        (256, 1024, 3072, true, None, true),
        (256, 4096, 1024, true, Some(Activation::Gelu), true),
        (7, 1000, 70, false, Some(Activation::Silu), true),
        (300, 264, 100, true, None, true),
        (256, 1024, 12800, false, None, false),
    ];
    let mut differ = 0f32;
    for (rows, k, n, bias, act, takes) in shapes {
        let bf = |t: Tensor| t.to_dtype(DType::BF16);
        let (x, w) = (bf(rng.normal_tensor(&[rows, k], 0.0, 1.0))?, bf(rng.normal_tensor(&[n, k], 0.0, 0.03))?);
        let b = bias.then(|| bf(rng.normal_tensor(&[n], 0.0, 1.0))).transpose()?;
        let f32s = |t: &Tensor| t.to_dtype(DType::F32);
        // The activation as a GPU pass writes it: bf16 of the f32 value.
        let input = match act {
            Some(act) => bf(kernels::activation(&f32s(&x)?, act)?)?,
            None => x.clone(),
        };
        let want = f32s(&input)?.matmul(&f32s(&w)?.t()?)?;
        let want = match &b {
            Some(b) => want.broadcast_add(&f32s(b)?)?,
            None => want,
        };
        let (x, w) = (x.to_device(device)?, w.to_device(device)?);
        let b = b.map(|b| b.to_device(device)).transpose()?;
        let (first, again) = with_gemm("rows", || {
            let product = || {
                let y = match act {
                    Some(act) => kernels::activation_linear(&x, act, &w, b.as_ref())?,
                    None => kernels::linear(&x, &w, b.as_ref())?,
                };
                y.to_dtype(DType::F32)?.to_device(&Device::Cpu)
            };
            Ok((product()?, product()?))
        })?;
        let same = largest_difference(&first, &again)? == 0.0;
        let taken = kernels::rows_kernel_takes(&x, &w)? == takes;
        differ = differ.max(if same && taken { relative_error(&first, &want)? } else { 1.0 });
    }
    let label = "products of few rows (RLOO_GEMM=rows), of x and of its activation, the same bits twice (cuda kernel)";
    Ok(Check::new("kernel", label, DType::BF16, differ, None, tolerance(DType::BF16)))
}

/// The check of a loading weight for NaN and infinities on `device` in
/// `dtype`: a clean tensor, then each bad value at the first element, in
/// the middle and at the last, in a tensor of 3M elements (more than the
/// kernel's blocks take in one stride); how many answers were wrong.
fn non_finite_check(device: &Device, dtype: DType) -> Result<Check> {
    let n = 3 << 20;
    let clean: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
    let answer = |values: &[f32]| -> Result<bool> {
        kernels::any_non_finite(&Tensor::from_slice(values, n, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?)
    };
    let mut wrong = answer(&clean)? as u32;
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        for at in [0, n / 2 + 3, n - 1] {
            let mut values = clean.clone();
            values[at] = bad;
            wrong += !answer(&values)? as u32;
        }
    }
    let how = if device.is_cpu() { "cpu scan" } else { path("non_finite", device, dtype) };
    let label = format!("non_finite, NaN and infinities in a loading weight ({how})");
    Ok(Check::new("kernel", &label, dtype, wrong as f32, None, 0.0))
}

/// Rotary and self-attention (grouped-query heads, partial rotary, a
/// right-padded row): the CPU kernels against the device's path.
fn attention_checks(device: &Device, dtype: DType, rng: &mut Rng) -> Result<Vec<Check>> {
    let (b, t, h, h_kv, d, r) = (2, 9, 4, 2, 16, 8);
    let rows = [(1..=9).collect::<Vec<u32>>(), (1..=6).collect()];
    let bias_on = |dev: &Device| -> Result<Tensor> {
        let inputs = Inputs::from_rows(&rows, 0, PadSide::Right, dev)?;
        attention_bias(&inputs, &inputs.mask)
    };
    let (cos, sin) = rotary_tables(rng, &[b, 1, t, r / 2], 1.0)?;
    let tables = RotaryTables::new(&cos, &sin)?;
    let host = AttentionInputs::new(&bias_on(&Device::Cpu)?, Some(&(cos.clone(), sin.clone())))?;
    let (dcos, dsin) = (cos.to_device(device)?, sin.to_device(device)?);
    let dbias = bias_on(device)?;
    let composed = |x: &[Tensor]| -> Result<Tensor> {
        let heads = |x: &Tensor| x.transpose(1, 2)?.contiguous();
        let q = kernels::rotate(&heads(&x[0])?, &dcos, &dsin)?;
        let k = kernels::rotate(&heads(&x[1])?, &dcos, &dsin)?;
        kernels::sdpa(&q, &k, &heads(&x[2])?, &dbias, 0.25)?.transpose(1, 2)?.reshape((b, t, h * d))
    };
    let (q, k, v) = (
        rng.normal_tensor(&[b, t, h, d], 0.0, 1.0),
        rng.normal_tensor(&[b, t, h_kv, d], 0.0, 1.0),
        rng.normal_tensor(&[b, t, h_kv, d], 0.0, 1.0),
    );
    let attention = compare(
        "attention",
        &[q.clone(), k, v],
        &|x| kernels::attention(&x[0], &x[1], &x[2], &host, 0.25),
        &composed,
        device,
        dtype,
        rng,
    );
    let rotary = compare(
        "rotary",
        &[q.transpose(1, 2)?.contiguous()?],
        &|x| kernels::rotary(&x[0], &tables),
        &|x| kernels::rotate(&x[0], &dcos, &dsin),
        device,
        dtype,
        rng,
    );
    let projection = rng.normal_tensor(&[b, t, 3 * h * d], 0.0, 1.0);
    let qkv = compare(
        "qkv_attention",
        &[projection],
        &|x| kernels::attention_packed(&x[0], neox(d), h, d, &host, 0.25),
        &|x| {
            let rotary = Some(&(dcos.clone(), dsin.clone()));
            let kernels = kernels::AttentionKernels::Rows;
            let mask = kernels::AttentionMask::Bias(dbias.clone());
            match kernels::qkv_attention(&x[0], neox(d), h, d, rotary, &mask, 0.25, kernels)? {
                Some(out) => Ok(out),
                None => qkv_composed(&x[0], h, d, (&dcos, &dsin), &dbias, 0.25),
            }
        },
        device,
        dtype,
        rng,
    );
    let mut out = vec![rotary, attention, qkv];
    // A prefill's heads: one launch on a GPU, the composition elsewhere.
    if device.is_cuda() {
        let projection = rng.normal_tensor(&[b, t, 3 * h * d], 0.0, 1.0).to_dtype(dtype)?.to_device(device)?;
        let label = format!("qkv_heads, a prefill's heads cut and rotated ({})", path("qkv_heads", device, dtype));
        out.push(match qkv_heads_differ(&projection, h, d, (&dcos, &dsin)) {
            Ok(differ) => Check::new("kernel", &label, dtype, differ, None, 0.0),
            Err(e) => Check::failed("kernel", &label, dtype, e),
        });
    }
    Ok(out)
}

/// The largest difference between the heads `kernels::qkv_heads` cuts from
/// `fused` (laid out as [`neox`]) and those the composition makes: the
/// parts transposed, q and k rotated. It must be 0.
fn qkv_heads_differ(fused: &Tensor, h: usize, d: usize, (cos, sin): (&Tensor, &Tensor)) -> Result<f32> {
    let Some((q, k, v)) = kernels::qkv_heads(fused, neox(d), h, d, Some(&(cos.clone(), sin.clone())))? else {
        candle_core::bail!("qkv_heads does not take these inputs")
    };
    let want = neox_heads(fused, h, d, (cos, sin))?;
    let mut differ = 0f32;
    for (got, want) in [q, k, v].iter().zip(&want) {
        differ = differ.max(largest_difference(got, want)?);
    }
    Ok(differ)
}

/// GPT-NeoX's fused projection of head size `d`: each head's [q | k | v].
fn neox(d: usize) -> kernels::Packing {
    kernels::Packing { q: 0, k: d, v: 2 * d, head_stride: 3 * d }
}

/// Attention over a fused projection laid out as [`neox`], op by op: its
/// heads ([`neox_heads`]), attention, the output transposed back.
fn qkv_composed(
    fused: &Tensor,
    h: usize,
    d: usize,
    rotary: (&Tensor, &Tensor),
    bias: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let (b, t, _) = fused.dims3()?;
    let [q, k, v] = neox_heads(fused, h, d, rotary)?;
    kernels::sdpa(&q, &k, &v, bias, scale)?.transpose(1, 2)?.reshape((b, t, h * d))
}

/// The heads (B, H, T, D) of a fused projection laid out as [`neox`], op
/// by op: each part cut and transposed, q and k rotated.
fn neox_heads(fused: &Tensor, h: usize, d: usize, (cos, sin): (&Tensor, &Tensor)) -> Result<[Tensor; 3]> {
    let (b, t, _) = fused.dims3()?;
    let part = |p: usize| fused.reshape((b, t, h, 3 * d))?.narrow(3, p * d, d)?.transpose(1, 2)?.contiguous();
    Ok([kernels::rotate(&part(0)?, cos, sin)?, kernels::rotate(&part(1)?, cos, sin)?, part(2)?])
}

/// The tensor-core attention kernels `choice` at head size `d` against the
/// CPU's composition, value and gradients: grouped-query heads, 70 queries
/// and keys (so the last tiles are cut short), a right-padded row and one
/// packed as training packs them, a prompt then completions that each see
/// it and themselves; masked by the bias or (`spans`) each query's runs.
/// `merged`: the output (B, T, H * D), each token's heads side by side.
fn tensor_attention_check(
    device: &Device,
    d: usize,
    (choice, spans): (kernels::AttentionKernels, bool),
    merged: bool,
    name: &str,
    rng: &mut Rng,
) -> Result<Check> {
    let (b, t, h, h_kv) = (2, 70, 4, 2);
    let (host, on_device) = (two_rows_bias(&Device::Cpu)?, two_rows_mask(device, spans)?);
    let scale = 1.0 / (d as f64).sqrt();
    let inputs = [
        rng.normal_tensor(&[b, h, t, d], 0.0, 1.0),
        rng.normal_tensor(&[b, h_kv, t, d], 0.0, 1.0),
        rng.normal_tensor(&[b, h_kv, t, d], 0.0, 1.0),
    ];
    Ok(compare(
        name,
        &inputs,
        &|x| {
            let out = kernels::sdpa(&x[0], &x[1], &x[2], &host, scale)?;
            match merged {
                true => out.transpose(1, 2)?.reshape((b, t, h * d)),
                false => Ok(out),
            }
        },
        &|x| match merged {
            true => kernels::sdpa_merged(&x[0], &x[1], &x[2], &on_device, scale, choice),
            false => kernels::sdpa_with(&x[0], &x[1], &x[2], &on_device, scale, choice),
        },
        device,
        DType::BF16,
        rng,
    ))
}

/// The two rows of the tensor-core checks: a row right-padded after 41
/// tokens (the second of a padded pair), and one packed as training packs
/// it (a prompt of 20 tokens, then completions that each see it and
/// themselves).
fn two_rows(dev: &Device) -> Result<[Inputs; 2]> {
    let ids: Vec<u32> = (1..=70).collect();
    let padded = Inputs::from_rows(&[ids.clone(), ids[..41].to_vec()], 0, PadSide::Right, dev)?;
    let packed = Inputs::shared_prefix(
        &[SharedPrefix { prompt: &ids[..20], continuations: vec![&ids[20..37], &ids[37..49], &ids[49..]] }],
        0,
        dev,
    )?;
    Ok([padded, packed])
}

/// The (2, 1, 70, 70) attention bias of [`two_rows`].
fn two_rows_bias(dev: &Device) -> Result<Tensor> {
    let [padded, packed] = two_rows(dev)?;
    let padded = attention_bias(&padded, &padded.mask)?.narrow(0, 1, 1)?;
    Tensor::cat(&[&padded, &attention_bias(&packed, &packed.mask)?], 0)
}

/// What masks [`two_rows`] on `dev`: the bias, or (`spans`) each query's runs.
fn two_rows_mask(dev: &Device, spans: bool) -> Result<kernels::AttentionMask> {
    if !spans {
        return Ok(kernels::AttentionMask::Bias(two_rows_bias(dev)?));
    }
    let [padded, packed] = two_rows(dev)?;
    let missing = || candle_core::Error::Msg("the check's rows have no spans".into());
    let (padded, packed) =
        (attention_spans(&padded).ok_or_else(missing)?, attention_spans(&packed).ok_or_else(missing)?);
    // Rows are laid out one after another: the padded pair's second row, then the packed one.
    let (t, blocks) = (padded.spans.len() / 2, padded.key_blocks.len() / 2);
    let both = AttentionSpans {
        spans: [&padded.spans[t..], &packed.spans[..]].concat(),
        key_blocks: [&padded.key_blocks[blocks..], &packed.key_blocks[..]].concat(),
    };
    Ok(kernels::AttentionMask::Spans(kernels::DeviceSpans::new(&both, dev)?))
}

/// Attention over a GPT-NeoX fused projection of head size `d` on
/// tensor cores (`choice`, over spans where `spans`) against the CPU
/// kernel, value and gradient: [`two_rows`], rotary over a quarter of each
/// head, as Pythia's. Where the kernels do not take it, an error.
fn qkv_attention_check(
    device: &Device,
    d: usize,
    (choice, spans): (kernels::AttentionKernels, bool),
    name: &str,
    rng: &mut Rng,
) -> Result<Check> {
    let (b, t, h, r) = (2, 70, 4, d / 4);
    let (cos, sin) = rotary_tables(rng, &[b, 1, t, r / 2], 1.0)?;
    let host = AttentionInputs::new(&two_rows_bias(&Device::Cpu)?, Some(&(cos.clone(), sin.clone())))?;
    let rotary = (cos.to_device(device)?, sin.to_device(device)?);
    let mask = two_rows_mask(device, spans)?;
    let scale = 1.0 / (d as f64).sqrt();
    Ok(compare(
        name,
        &[rng.normal_tensor(&[b, t, 3 * h * d], 0.0, 1.0)],
        &|x| kernels::attention_packed(&x[0], neox(d), h, d, &host, scale),
        &|x| {
            kernels::qkv_attention(&x[0], neox(d), h, d, Some(&rotary), &mask, scale, choice)?
                .ok_or_else(|| candle_core::Error::Msg("the kernels do not take these inputs".into()))
        },
        device,
        DType::BF16,
        rng,
    ))
}

/// `w`, or its transposed view where the check's input is the weight transposed.
fn maybe_t(w: &Tensor, transposed: bool) -> Result<Tensor> {
    if transposed {
        w.t()
    } else {
        Ok(w.clone())
    }
}

/// One decoding step's attention over a cache whose rows continue shared
/// slots (two prompts, one left-padded) and own slots with spare capacity,
/// with grouped-query heads and a padded newest slot: the device's kernel
/// (`lanes`: the one with a lane per key, on a GPU only; where none runs,
/// the composition over the cache copied out) against
/// the CPU kernel; and again as over fixed slots, the mask covering every
/// slot and the own slots' count read from the device (the views show one).
/// `long`: 700 slots, which a GPU splits across blocks (RLOO_DECODE_SPLIT),
/// and 4 query heads a key/value head, which the kernel with a lane per
/// key takes in one block (RLOO_DECODE_HEADS). `by_prompt`: 2 prompts of 4
/// rows each, which the kernel with a lane per key takes in one block
/// (what RLOO_DECODE_ROWS=prompt chooses), one row with a masked shared
/// slot the others see. `packed`: the lanes read value rows packed into
/// loads (RLOO_DECODE_VALUES=packed).
fn decode_attention_check(
    device: &Device,
    dtype: DType,
    d: usize,
    (lanes, by_prompt, packed): (bool, bool, bool),
    long: bool,
    rng: &mut Rng,
) -> Result<Check> {
    let rows: &[u32] = match by_prompt {
        true => &[0, 0, 0, 0, 1, 1, 1, 1],
        false => &[0, 1, 1, 0, 1, 0],
    };
    let (b, h, h_kv) = (rows.len(), if long { 8 } else { 4 }, 2);
    let (p, s_own, capacity) = if long { (300, 400, 420) } else { (13, 9, 16) };
    let q = rng.normal_tensor(&[b, h, 1, d], 0.0, 1.0);
    let (shared_k, shared_v) =
        (rng.normal_tensor(&[2, h_kv, p, d], 0.0, 1.0), rng.normal_tensor(&[2, h_kv, p, d], 0.0, 1.0));
    let (own_k, own_v) =
        (rng.normal_tensor(&[b, h_kv, capacity, d], 0.0, 1.0), rng.normal_tensor(&[b, h_kv, capacity, d], 0.0, 1.0));
    let s = p + s_own;
    // Over `width` slots: padding where a row's prompt is short and in row 4's newest slot, 1 past the filled ones.
    let mask = |width: usize| -> Vec<f32> {
        (0..b * width)
            .map(|i| {
                let (row, slot) = (i / width, i % width);
                let padded = (rows[row] == 1 && slot < 4) || (row == 4 && slot == s - 1) || (row == 2 && slot == 6);
                if padded {
                    0.0
                } else {
                    1.0
                }
            })
            .collect()
    };
    let run = |device: &Device, dtype: DType, fixed: bool| -> Result<Tensor> {
        let on = |t: &Tensor| t.to_device(device)?.to_dtype(dtype);
        let (shared_k, shared_v, own_k, own_v) = (on(&shared_k)?, on(&shared_v)?, on(&own_k)?, on(&own_v)?);
        let device_rows = Tensor::new(rows, device)?;
        let on_gpu = fixed && device.is_cuda();
        let slot = Tensor::new(&[s_own as u32 - 1], device)?;
        let (shown, width) = match (fixed, on_gpu) {
            (false, _) => (s_own, s),
            (true, false) => (s_own, p + capacity),
            (true, true) => (1, p + capacity),
        };
        let kv = LayerKv {
            keys: own_k.narrow(2, 0, shown)?,
            values: own_v.narrow(2, 0, shown)?,
            shared: Some(SharedKv { keys: &shared_k, values: &shared_v, rows, device_rows: &device_rows }),
            slot_at: on_gpu.then_some(&slot),
        };
        let q = on(&q)?;
        let mask = mask(width);
        if device.is_cpu() && dtype == DType::F32 {
            return kernels::decode_attention(&q, &kv, &mask, 0.125);
        }
        let key_mask = Tensor::from_slice(&mask, (b, width), device)?;
        let rows = if by_prompt { kernels::DecodeRows::Prompt } else { kernels::DecodeRows::Each };
        let kernel = kernels::DecodeKernel { rows, packed_values: packed, ..kernels::DecodeKernel::from_env(lanes)? };
        if let Some(out) = kernels::decode_attention_cuda(&q, &kv, &key_mask, 0.125, kernel)? {
            return out.to_dtype(DType::F32)?.to_device(&Device::Cpu);
        }
        if lanes {
            candle_core::bail!("the kernel with a lane per key did not run");
        }
        let (keys, values) = kv.whole()?;
        let bias = ((key_mask.narrow(1, 0, s)? - 1.0)? * 1e30)?.reshape((b, 1, 1, s))?;
        let out = kernels::sdpa(&q, &keys.contiguous()?, &values.contiguous()?, &bias, 0.125)?;
        out.to_dtype(DType::F32)?.to_device(&Device::Cpu)
    };
    let want = run(&Device::Cpu, DType::F32, false)?;
    let error =
        relative_error(&run(device, dtype, false)?, &want)?.max(relative_error(&run(device, dtype, true)?, &want)?);
    let per = match (lanes, by_prompt) {
        (true, true) => ", a lane per key, the rows of a prompt a block",
        (true, false) => ", a lane per key",
        (false, _) => "",
    };
    let per = if packed { format!("{per}, value rows packed") } else { per.to_string() };
    let split = match (long, kernels::decode_split_keys()?) {
        (true, true) => format!(", {} slots, {} heads a key/value head, keys split", p + s_own, h / h_kv),
        (true, false) => format!(", {} slots, {} heads a key/value head", p + s_own, h / h_kv),
        (false, _) => String::new(),
    };
    let label = format!("decode_attention, head size {d}{per}{split} ({})", path("decode_attention", device, dtype));
    Ok(Check::new("kernel", &label, dtype, error, None, tolerance(dtype)))
}

/// A decoding step's rotary and cache append in one launch, with q, k and v
/// cut from one fused projection (grouped-query heads, a quarter of each
/// head rotated) after two filled slots of a cache with spare capacity,
/// against the CPU composition: the rotated queries, then the cache's keys
/// and values; and again with the cache's slots fixed, the slot written
/// read from the device.
fn rotary_append_check(device: &Device, dtype: DType, d: usize, rng: &mut Rng) -> Result<Check> {
    let (b, h, h_kv, r, filled) = (3, 4, 2, d / 4, 2);
    let qkv = rng.normal_tensor(&[b, 1, h + 2 * h_kv, d], 0.0, 1.0);
    let (past_k, past_v) =
        (rng.normal_tensor(&[b, h_kv, filled, d], 0.0, 1.0), rng.normal_tensor(&[b, h_kv, filled, d], 0.0, 1.0));
    // Rotate-half tables: each angle serves features j and j + R/2.
    let (cos, sin) = rotary_tables(rng, &[b, 1, 1, r / 2], 2.0)?;
    let run = |device: &Device, dtype: DType, fixed: bool| -> Result<Tensor> {
        let on = |t: &Tensor| t.to_device(device)?.to_dtype(dtype);
        let qkv = on(&qkv)?;
        let (q, k, v) = (qkv.narrow(2, 0, h)?, qkv.narrow(2, h, h_kv)?, qkv.narrow(2, h + h_kv, h_kv)?);
        let tables = (cos.to_device(device)?, sin.to_device(device)?);
        let mut cache = KvCache::new(1);
        cache.reserve(filled + 2);
        cache.append(0, &on(&past_k)?, &on(&past_v)?)?;
        cache.finish_pass(Tensor::ones((b, filled), DType::F32, device)?, filled);
        if fixed {
            cache.fix_slots(Tensor::new(&[filled as u32], device)?)?;
        }
        let (q, kv) = match kernels::rotary_append_cuda((&q, &k, &v), Some(&tables), &mut cache, 0)? {
            Some(appended) => appended,
            None if device.is_cpu() => {
                let heads = |t: &Tensor| t.transpose(1, 2)?.contiguous();
                let rotate = |t: &Tensor| kernels::rotate(&heads(t)?, &tables.0, &tables.1);
                (rotate(&q)?, cache.append(0, &rotate(&k)?, &heads(&v)?)?)
            }
            None => candle_core::bail!("the fused kernel did not run"),
        };
        let (keys, values) = kv.whole()?;
        let flat = |t: &Tensor| t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.flatten_all();
        Tensor::cat(&[flat(&q)?, flat(&keys)?, flat(&values)?], 0)
    };
    let want = run(&Device::Cpu, DType::F32, false)?;
    let error =
        relative_error(&run(device, dtype, false)?, &want)?.max(relative_error(&run(device, dtype, true)?, &want)?);
    let label = format!("rotary_append, head size {d} ({})", path("rotary_append", device, dtype));
    Ok(Check::new("kernel", &label, dtype, error, None, tolerance(dtype)))
}

/// Two LayerNorms of the same rows in one launch on a GPU against each
/// alone there: the same bits (the largest difference, which must be 0), as
/// a parallel-residual layer's forward without a graph takes them.
fn layer_norm_pair_check(device: &Device, dtype: DType, rng: &mut Rng) -> Result<Check> {
    let h = 1024;
    let on = |t: Tensor| t.to_device(device)?.to_dtype(dtype);
    let x = on(rng.normal_tensor(&[3, 7, h], 0.5, 1.0))?;
    let (w1, b1) = (on(rng.normal_tensor(&[h], 1.0, 0.5))?, on(rng.normal_tensor(&[h], 0.0, 0.5))?);
    let (w2, b2) = (on(rng.normal_tensor(&[h], 1.0, 0.5))?, on(rng.normal_tensor(&[h], 0.0, 0.5))?);
    let (eps1, eps2) = (1e-5, 1e-3);
    let Some((first, second)) = kernels::layer_norm_pair(&x, (&w1, &b1, eps1), (&w2, &b2, eps2))? else {
        candle_core::bail!("the pair did not run")
    };
    let differ = largest_difference(&first, &kernels::layer_norm(&x, &w1, &b1, eps1)?)?
        .max(largest_difference(&second, &kernels::layer_norm(&x, &w2, &b2, eps2)?)?);
    let label = format!("layer_norm_pair, against each alone to the bit ({})", path("layer_norm_pair", device, dtype));
    Ok(Check::new("kernel", &label, dtype, differ, None, 0.0))
}

/// Three AdamW steps on the device against the CPU kernel.
fn adamw_check(device: &Device) -> Result<Check> {
    let mut rng = Rng::new(11);
    let w0 = rng.normal_tensor(&[37, 1000], 0.0, 1.0);
    let grads: Vec<Tensor> = (0..3).map(|_| rng.normal_tensor(&[37, 1000], 0.1, 1.0)).collect();
    let run = |device: &Device| -> Result<Tensor> {
        let w = Var::from_tensor(&w0.to_device(device)?)?;
        let (mut m, mut v) = (w.zeros_like()?, w.zeros_like()?);
        for (t, g) in grads.iter().enumerate() {
            let t = t as i32 + 1;
            let step = adamw_step(t, 1.0 - 1e-3);
            kernels::adamw(&w, &g.to_device(device)?, &mut m, &mut v, step)?;
        }
        w.as_tensor().to_device(&Device::Cpu)
    };
    let (want, got) = (run(&Device::Cpu)?, run(device)?);
    let label = format!("adamw, 3 steps ({})", path("adamw", device, DType::F32));
    Ok(Check::new("kernel", &label, DType::F32, relative_error(&got, &want)?, None, 1e-5))
}
