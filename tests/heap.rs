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

/// What a training graph holds of a residual's sum `x + branch`: a plain
/// addition keeps the branch's output until the backward; the residual sums
/// free it once the sum is made, unless the op that made it reads it in its
/// own backward (exp). The gradients are the same.
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
    let exp = |x: &Tensor| x.exp();
    let plain = |x: &Tensor, a: &Tensor| x + a;
    let residual = |x: &Tensor, a: &Tensor| kernels::residual(x, a);
    let sum3 = |x: &Tensor, a: &Tensor| kernels::sum3(x, a, &x.zeros_like()?);

    let (kept, grad) = held(&affine, &plain);
    assert!(kept >= 2 * size && grad == 4.0, "a plain addition keeps the sum and the branch");
    for (name, sum) in [("residual", &residual as &dyn Fn(&Tensor, &Tensor) -> _), ("sum3", &sum3)] {
        let (kept, grad) = held(&affine, sum);
        assert!(kept < size + size / 2 && grad == 4.0, "{name} keeps the sum alone ({kept} bytes)");
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
    let var = |shape: &[usize]| Var::from_tensor(&Tensor::randn(0f32, 0.5, shape, &Device::Cpu).unwrap()).unwrap();
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
