//! Every training kernel against its composition: values and the gradient
//! of every input, on random data.

use candle_core::{Device, Result, Tensor, Var};

use super::*;
use crate::model::ops::{self, Activation};

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar().unwrap()
}

/// Runs `fused` and `composed` on the same inputs, then backpropagates a
/// random weighting of the output through both; values and every input's
/// gradient must agree within `tol` (relative to the largest magnitude).
fn check(
    name: &str,
    inputs: &[Tensor],
    fused: impl Fn(&[Tensor]) -> Result<Tensor>,
    composed: impl Fn(&[Tensor]) -> Result<Tensor>,
    tol: f32,
) {
    let run = |f: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
        let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let out = f(&ts).unwrap();
        let w = test_randn(out.dims(), 0.0, 1.0);
        (out, vars, w)
    };
    let (out_f, vars_f, w) = run(&fused);
    let (out_c, vars_c, _) = run(&composed);
    let scale = |t: &Tensor| 1.0 + t.abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap();
    assert!(max_abs_diff(&out_f, &out_c) < tol * scale(&out_c), "{name}: values differ");
    let g_f = out_f.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    let g_c = out_c.mul(&w).unwrap().sum_all().unwrap().backward().unwrap();
    for (i, (vf, vc)) in vars_f.iter().zip(&vars_c).enumerate() {
        let (gf, gc) = (g_f.get(vf).expect("fused gradient"), g_c.get(vc).expect("composed gradient"));
        assert_eq!(gf.dims(), gc.dims(), "{name}: gradient {i} shape");
        let diff = max_abs_diff(gf, gc);
        assert!(diff < tol * scale(gc), "{name}: gradient of input {i} differs by {diff}");
    }
}

/// The bits of an f32 tensor's elements.
fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// The bits of `y`, then of each input's gradient of `y` weighted by
/// `weights` and summed.
fn output_and_grad_bits(y: &Tensor, weights: &Tensor, inputs: &[Var]) -> Vec<Vec<u32>> {
    let grads = (y * weights).unwrap().sum_all().unwrap().backward().unwrap();
    let mut all = vec![bits(y)];
    all.extend(inputs.iter().map(|v| bits(grads.get(v).expect("a gradient"))));
    all
}

fn randn(shape: &[usize], mean: f32) -> Tensor {
    test_randn(shape, mean, 1.5)
}

#[test]
fn layer_norm_matches_the_composition() {
    let (x, w, b) = (randn(&[3, 5, 24], 0.7), randn(&[24], 1.0), randn(&[24], 0.0));
    check(
        "layer_norm",
        &[x, w, b],
        |t| layer_norm(&t[0], &t[1], &t[2], 1e-5),
        |t| ops::layernorm(&t[0], &t[1], &t[2], 1e-5),
        2e-5,
    );
}

#[test]
fn rms_norm_matches_the_composition() {
    let (x, w) = (randn(&[2, 7, 3, 16], 0.3), randn(&[16], 1.0));
    check("rms_norm", &[x, w], |t| rms_norm(&t[0], &t[1], 1e-6), |t| ops::rmsnorm(&t[0], &t[1], 1e-6), 2e-5);
}

#[test]
fn linear_matches_the_composition() {
    // 300 rows: several parallel tasks for the bias gradient, the last one partial.
    let (x, w, b) = (randn(&[3, 100, 48], 0.0), randn(&[40, 48], 0.0), randn(&[40], 0.0));
    check(
        "linear",
        &[x.clone(), w.clone(), b],
        |t| linear(&t[0], &t[1], Some(&t[2])),
        |t| ops::linear(&t[0], &t[1], Some(&t[2])),
        1e-5,
    );
    check(
        "linear, no bias",
        &[x.flatten_to(1).unwrap(), w.clone()],
        |t| linear(&t[0], &t[1], None),
        |t| ops::linear(&t[0], &t[1], None),
        1e-5,
    );
    // A weight stored (in, out), read through its transposed view as GPT-2's Conv1D is.
    check(
        "linear, (in, out) storage",
        &[x, w.t().unwrap().contiguous().unwrap()],
        |t| linear(&t[0], &t[1].t()?, None),
        |t| ops::linear(&t[0], &t[1].t()?, None),
        1e-5,
    );
}

#[test]
fn activations_match_the_composition() {
    for act in [Activation::Gelu, Activation::GeluTanh, Activation::Silu, Activation::Relu] {
        let x = randn(&[4, 9000], 0.0);
        check(&format!("{act:?}"), &[x], |t| activation(&t[0], act), |t| act.apply(&t[0]), 1e-5);
    }
}

#[test]
fn activation_linear_matches_the_composition() {
    let (u, w, b) = (randn(&[3, 50, 64], 0.0), randn(&[24, 64], 0.0), randn(&[24], 0.0));
    for act in [Activation::Gelu, Activation::GeluTanh, Activation::Relu] {
        check(
            &format!("activation_linear {act:?}"),
            &[u.clone(), w.clone(), b.clone()],
            |t| activation_linear(&t[0], act, &t[1], Some(&t[2])),
            |t| ops::linear(&act.apply(&t[0])?, &t[1], Some(&t[2])),
            1e-5,
        );
    }
    check(
        "activation_linear, no bias, (in, out) storage",
        &[u, w.t().unwrap().contiguous().unwrap()],
        |t| activation_linear(&t[0], Activation::Silu, &t[1].t()?, None),
        |t| ops::linear(&Activation::Silu.apply(&t[0])?, &t[1].t()?, None),
        1e-5,
    );
}

#[test]
fn lora_linear_matches_the_composition() {
    let (x, a, b) = (randn(&[2, 30, 40], 0.0), randn(&[4, 40], 0.0), randn(&[24, 4], 0.0));
    let (w, bias) = (randn(&[24, 40], 0.0), randn(&[24], 0.0));
    let mask = || Mask::new([7, 11], 1.0 / 3.0);
    for act in [None, Some(Activation::Gelu)] {
        for dropout in [false, true] {
            for bias in [None, Some(&bias)] {
                let composed = |t: &[Tensor]| {
                    let h = match act {
                        Some(act) => act.apply(&t[0])?,
                        None => t[0].clone(),
                    };
                    let dropped = if dropout { (&h * mask().to_tensor(&h)?)? } else { h.clone() };
                    let delta = ops::linear(&ops::linear(&dropped, &t[1], None)?, &t[2], None)?;
                    ops::linear(&h, &w, bias)? + (delta * 2.0)?
                };
                check(
                    &format!("lora_linear {act:?}, dropout {dropout}, bias {}", bias.is_some()),
                    &[x.clone(), a.clone(), b.clone()],
                    |t| {
                        let layer = LoraLayer { weight: &w, bias, a: &t[1], b: &t[2], scale: 2.0 };
                        super::lora::lora_linear(&t[0], act, &layer, dropout.then(mask))
                    },
                    composed,
                    1e-5,
                );
            }
        }
    }
}

#[test]
fn attention_matches_the_composition_with_gqa_partial_rotary_and_padding() {
    use crate::model::batch::{attention_bias, Inputs, PadSide};
    let dev = Device::Cpu;
    let (b, t, h, h_kv, d, r) = (2, 5, 4, 2, 6, 4);
    // Row 1 is right-padded: its last two slots are padding.
    let inputs = Inputs::from_rows(&[vec![1, 2, 3, 4, 5], vec![6, 7, 8]], 0, PadSide::Right, &dev).unwrap();
    let bias = attention_bias(&inputs, &inputs.mask).unwrap();
    let angles = test_randn(&[b, 1, t, r / 2], 0.0, 1.0);
    let angles = Tensor::cat(&[&angles, &angles], 3).unwrap();
    let rotary = (angles.cos().unwrap(), angles.sin().unwrap());
    let host = AttentionInputs::new(&bias, Some(&rotary)).unwrap();
    let scale = 0.4;
    let composed = |x: &[Tensor]| -> Result<Tensor> {
        let heads = |x: &Tensor| x.transpose(1, 2)?.contiguous();
        let q = ops::apply_rotary(&heads(&x[0])?, &rotary.0, &rotary.1)?;
        let k = ops::apply_rotary(&heads(&x[1])?, &rotary.0, &rotary.1)?;
        let (k, v) = (ops::repeat_kv(&k, h / h_kv)?, ops::repeat_kv(&heads(&x[2])?, h / h_kv)?);
        ops::attention(&q, &k, &v, &bias, scale)?.transpose(1, 2)?.reshape((b, t, h * d))
    };
    let (q, k, v) = (randn(&[b, t, h, d], 0.0), randn(&[b, t, h_kv, d], 0.0), randn(&[b, t, h_kv, d], 0.0));
    check("attention", &[q, k, v], |x| attention(&x[0], &x[1], &x[2], &host, scale), composed, 2e-5);
}

#[test]
fn packed_attention_matches_the_composition() {
    use crate::model::batch::{attention_bias, Inputs, PadSide};
    let dev = Device::Cpu;
    let (b, t, h, d, r) = (2, 4, 3, 4, 2);
    let inputs = Inputs::from_rows(&[vec![1, 2, 3, 4], vec![5, 6]], 0, PadSide::Right, &dev).unwrap();
    let bias = attention_bias(&inputs, &inputs.mask).unwrap();
    let angles = test_randn(&[b, 1, t, r / 2], 0.0, 1.0);
    let angles = Tensor::cat(&[&angles, &angles], 3).unwrap();
    let rotary = (angles.cos().unwrap(), angles.sin().unwrap());
    let host = AttentionInputs::new(&bias, Some(&rotary)).unwrap();
    // GPT-NeoX's layout: per head [q | k | v].
    let packing = Packing { q: 0, k: d, v: 2 * d, head_stride: 3 * d };
    let composed = |x: &[Tensor]| -> Result<Tensor> {
        let per_head = x[0].reshape((b, t, h, 3 * d))?;
        let part = |i: usize| per_head.narrow(3, i * d, d)?.transpose(1, 2)?.contiguous();
        let q = ops::apply_rotary(&part(0)?, &rotary.0, &rotary.1)?;
        let k = ops::apply_rotary(&part(1)?, &rotary.0, &rotary.1)?;
        ops::attention(&q, &k, &part(2)?, &bias, 0.5)?.transpose(1, 2)?.reshape((b, t, h * d))
    };
    let fused = |x: &[Tensor]| attention_packed(&x[0], packing, h, d, &host, 0.5);
    check("attention_packed", &[randn(&[b, t, 3 * h * d], 0.0)], fused, composed, 2e-5);
}

#[test]
fn rotary_matches_the_composition() {
    let (b, h, t, d, r) = (2, 3, 5, 6, 4);
    let angles = test_randn(&[b, 1, t, r / 2], 0.0, 1.0);
    let angles = Tensor::cat(&[&angles, &angles], 3).unwrap();
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let tables = RotaryTables::new(&cos, &sin).unwrap();
    check(
        "rotary",
        &[randn(&[b, h, t, d], 0.0)],
        |x| rotary(&x[0], &tables),
        |x| ops::apply_rotary(&x[0], &cos, &sin),
        1e-5,
    );
}

#[test]
fn adamw_matches_the_composition_over_steps() {
    let (beta1, beta2, eps, lr, wd) = (0.9f64, 0.999f64, 1e-8f64, 1e-2f64, 0.1f64);
    let w0 = randn(&[37, 1000], 0.0);
    let (w, mut m, mut v) = (Var::from_tensor(&w0).unwrap(), w0.zeros_like().unwrap(), w0.zeros_like().unwrap());
    let (mut w_ref, mut m_ref, mut v_ref) = (w0.clone(), w0.zeros_like().unwrap(), w0.zeros_like().unwrap());
    for t in 1..=3 {
        let g = randn(&[37, 1000], 0.1);
        let (bias1, bias2) = (1.0 - beta1.powi(t), 1.0 - beta2.powi(t));
        let step = AdamWStep {
            beta1: beta1 as f32,
            beta2: beta2 as f32,
            eps: eps as f32,
            lr: lr as f32,
            bias1: bias1 as f32,
            bias2: bias2 as f32,
            decay: (1.0 - lr * wd) as f32,
        };
        adamw(&w, &g, &mut m, &mut v, step).unwrap();
        m_ref = ((m_ref * beta1).unwrap() + (&g * (1.0 - beta1)).unwrap()).unwrap();
        v_ref = ((v_ref * beta2).unwrap() + (g.sqr().unwrap() * (1.0 - beta2)).unwrap()).unwrap();
        let denom = ((v_ref.sqrt().unwrap() / bias2.sqrt()).unwrap() + eps).unwrap();
        let update = ((&m_ref / denom).unwrap() * (lr / bias1)).unwrap();
        w_ref = ((w_ref * (1.0 - lr * wd)).unwrap() - update).unwrap();
    }
    assert!(max_abs_diff(&m, &m_ref) < 1e-6 && max_abs_diff(&v, &v_ref) < 1e-6, "moments differ");
    // A few roundings of the largest weight: the kernel and the composition
    // round the decayed weight and the update in different orders.
    let largest = w_ref.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let diff = max_abs_diff(&w, &w_ref);
    assert!(diff <= 4.0 * f32::EPSILON * largest, "weights differ by {diff}, the largest is {largest}");
}

/// The residual sums give the additions' values and gradients, to the
/// bit (`tests/heap.rs` shows what they keep).
#[test]
fn residual_sums_are_additions_to_the_bit() {
    let (x, a, b) = (randn(&[3, 7, 40], 0.5), randn(&[3, 7, 40], 0.0), randn(&[3, 7, 40], -0.5));
    let vars: Vec<Var> = [&x, &a, &b].iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let weights = randn(&[3, 7, 40], 0.0);
    let run = |f: &dyn Fn(&[Tensor]) -> Result<Tensor>| {
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = f(&ts).unwrap();
        let grads = (&y * &weights).unwrap().sum_all().unwrap().backward().unwrap();
        let mut all = vec![y.flatten_all().unwrap().to_vec1::<f32>().unwrap()];
        all.extend(vars.iter().map(|v| grads.get(v).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap()));
        all
    };
    let bits = |all: Vec<Vec<f32>>| {
        all.into_iter().map(|v| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).collect::<Vec<_>>()
    };
    let additions = bits(run(&|t| (&t[0] + &t[1])? + &t[2]));
    assert_eq!(bits(run(&|t| sum3(&t[0], &t[1], &t[2]))), additions);
    assert_eq!(bits(run(&|t| residual(&residual(&t[0], &t[1])?, &t[2]))), additions);
}

/// An MLP whose wide input the backward makes again gives the values and
/// gradients of one that keeps it, to the bit (`tests/heap.rs` shows what
/// each keeps).
#[test]
fn a_remade_mlp_input_changes_no_bit() {
    let shapes: [&[usize]; 7] = [&[2, 5, 16], &[16], &[16], &[64, 16], &[64], &[16, 64], &[16]];
    let inputs = shapes.map(|s| Var::from_tensor(&randn(s, 0.1)).unwrap());
    let weights = randn(&[2, 5, 16], 0.0);
    let run = |remade: bool| -> Vec<Vec<u32>> {
        let t: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let norm = (&t[1], &t[2], 1e-5);
        let wide = norm_linear(&t[0], norm, &t[3], &t[4]).unwrap();
        let y = match remade {
            true => {
                let remake = norm_linear_remake(&t[0], norm, &t[3], &t[4]).unwrap().expect("one op");
                activation_linear_remade(&wide, Activation::Gelu, &t[5], &t[6], remake).unwrap()
            }
            false => activation_linear(&wide, Activation::Gelu, &t[5], Some(&t[6])).unwrap(),
        };
        output_and_grad_bits(&y, &weights, &inputs)
    };
    assert_eq!(run(true), run(false));
}

/// A gated MLP after its RMS norm (Llama, Qwen): the dense layers on the
/// norm's output keeping only its place, and with `remade` the output layer
/// keeping only its inputs' places too, give the values and gradients of
/// the ops that keep them all, to the bit. The norm's output feeds two
/// layers, whose gradients meet at one node as before.
#[test]
fn remade_norm_outputs_and_gated_inputs_change_no_bit() {
    let shapes: [&[usize]; 5] = [&[2, 5, 16], &[16], &[48, 16], &[48, 16], &[16, 48]];
    let inputs = shapes.map(|s| Var::from_tensor(&randn(s, 0.1)).unwrap());
    let weights = randn(&[2, 5, 16], 0.0);
    let run = |remade: &dyn Fn(&[Tensor]) -> Result<Tensor>| -> Vec<Vec<u32>> {
        let t: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let y = remade(&t).unwrap();
        output_and_grad_bits(&y, &weights, &inputs)
    };
    let kept = run(&|t| {
        let h = rms_norm(&t[0], &t[1], 1e-6)?;
        gated_linear(&linear(&h, &t[2], None)?, &linear(&h, &t[3], None)?, Activation::Silu, &t[4])
    });
    let normed = |t: &[Tensor]| -> Result<(Tensor, Remake)> {
        Ok((rms_norm(&t[0], &t[1], 1e-6)?, rms_norm_remake(&t[0], &t[1], 1e-6).expect("a graph")))
    };
    let norm_remade = run(&|t| {
        let (h, remake) = normed(t)?;
        let (gate, up) = (linear_remade(&h, &t[2], None, remake.clone())?, linear_remade(&h, &t[3], None, remake)?);
        gated_linear(&gate, &up, Activation::Silu, &t[4])
    });
    assert_eq!(norm_remade, kept);
    let all_remade = run(&|t| {
        let (h, remake) = normed(t)?;
        let (gate, up) =
            (linear_remade(&h, &t[2], None, remake.clone())?, linear_remade(&h, &t[3], None, remake.clone())?);
        let again = |w: &Tensor| -> Remake {
            let (remake, w) = (remake.clone(), w.detach());
            std::sync::Arc::new(move || linear(&remake()?, &w, None))
        };
        gated_linear_remade(&gate, &up, Activation::Silu, &t[4], (again(&t[2]), again(&t[3])))
    });
    assert_eq!(all_remade, kept);
}

/// A down projection with an adapter (and dropout) over a gated MLP's
/// product: the product as one op keeping the gate and up projections, the
/// adapter's op keeping only its place and making it again, give the
/// values and gradients of the composition that keeps all four tensors of
/// the MLP's width, to the bit.
#[test]
fn an_adapter_over_a_remade_gated_product_changes_no_bit() {
    let shapes: [&[usize]; 4] = [&[2, 5, 24], &[2, 5, 24], &[4, 24], &[16, 4]];
    let inputs = shapes.map(|s| Var::from_tensor(&randn(s, 0.1)).unwrap());
    let (w, weights) = (randn(&[16, 24], 0.0), randn(&[2, 5, 16], 0.0));
    let run = |remade: bool| -> Vec<Vec<u32>> {
        let t: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let layer = LoraLayer { weight: &w, bias: None, a: &t[2], b: &t[3], scale: 2.0 };
        let mask = Some(Mask::new([7, 11], 0.25));
        let y = match remade {
            true => {
                let (product, remake) = gated_product(&t[0], &t[1], Activation::Silu).unwrap();
                assert!(remake.is_some(), "the product's op runs");
                lora_forward_remade(&product, &layer, mask, remake).unwrap()
            }
            false => {
                let product = (activation(&t[0], Activation::Silu).unwrap() * &t[1]).unwrap();
                lora_forward(&product, None, &layer, mask).unwrap()
            }
        };
        output_and_grad_bits(&y, &weights, &inputs)
    };
    assert_eq!(run(true), run(false));
}

/// A gradient added into its f32 sum gives the bits of candle's cast and
/// addition, from bf16 and from f32; other dtypes take candle's way.
#[test]
fn add_cast_is_the_cast_and_the_addition() {
    let sum = randn(&[5, 300], 0.0);
    for dtype in [DType::BF16, DType::F32] {
        let g = randn(&[5, 300], 1.0).to_dtype(dtype).unwrap();
        let want = (&sum + g.to_dtype(DType::F32).unwrap()).unwrap();
        let got = add_cast(&sum, &g).unwrap();
        assert_eq!(bits(&got), bits(&want), "{dtype:?}");
    }
    let wide = sum.to_dtype(DType::F64).unwrap();
    assert_eq!(add_cast(&wide, &sum).unwrap().dtype(), DType::F64);
}

/// In place, the same bits as into a new tensor, on the sum's own storage
/// (the same tensor); a sum the kernel does not take (f64) becomes a new
/// tensor with candle's sum.
#[test]
fn add_cast_to_writes_over_the_sum() {
    for dtype in [DType::BF16, DType::F32] {
        let g = randn(&[5, 300], 1.0).to_dtype(dtype).unwrap();
        let mut sum = randn(&[5, 300], 0.0).copy().unwrap();
        let (want, id) = (add_cast(&sum, &g).unwrap(), sum.id());
        add_cast_to(&mut sum, &g).unwrap();
        assert_eq!(bits(&sum), bits(&want), "{dtype:?}");
        assert_eq!(sum.id(), id, "{dtype:?}: not written in place");
    }
    let (mut wide, g) = (randn(&[5, 300], 0.0).to_dtype(DType::F64).unwrap(), randn(&[5, 300], 1.0));
    let (want, id) = ((&wide + g.to_dtype(DType::F64).unwrap()).unwrap(), wide.id());
    add_cast_to(&mut wide, &g).unwrap();
    assert_ne!(wide.id(), id);
    assert_eq!(
        wide.flatten_all().unwrap().to_vec1::<f64>().unwrap(),
        want.flatten_all().unwrap().to_vec1::<f64>().unwrap()
    );
}
