//! Inputs that a backward makes again instead of keeping (selective
//! recomputation). An MLP's wide input is 4 of the 9 tensors of the hidden
//! size that a GPT-NeoX layer keeps for its backward; made again from the
//! layer's input, which is kept anyway, it costs one product of the MLP's
//! three in a backward (`RLOO_MLP_INPUT=remade`; kept by default). A
//! norm's output, made again from its input in one pass, is never kept.

use std::sync::Arc;

use candle_core::op::Op;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

/// How a training graph has an MLP's wide input: `kept` (the default) or
/// `remade` in the backward.
pub const MLP_INPUT_VAR: &str = "RLOO_MLP_INPUT";

/// Whether an MLP's wide input is made again in the backward; an unknown
/// choice is an error.
pub fn mlp_input_remade() -> Result<bool> {
    let chosen = crate::model::device::variant(MLP_INPUT_VAR, &["kept", "remade"]);
    Ok(chosen.map_err(candle_core::Error::msg)? == "remade")
}

/// What makes an input's values again, without a graph, the same to the bit.
pub type Remake = Arc<dyn Fn() -> Result<Tensor> + Send + Sync>;

/// `op` on `args`, where the graph keeps only the place of `args[0]`;
/// `op`'s backward gets that input from `remake`.
pub(super) fn on_remade_input<O>(op: impl Fn() -> O, args: [&Tensor; 3], remake: Remake) -> Result<Tensor>
where
    O: CustomOp3 + Send + Sync + 'static,
{
    on_remade_inputs3(op, args, [Some(remake), None, None])
}

/// `op` on `args`, where the graph keeps only the places of the arguments
/// that have a remake; `op`'s backward gets their values from it.
pub(super) fn on_remade_inputs3<O>(
    op: impl Fn() -> O,
    args: [&Tensor; 3],
    remakes: [Option<Remake>; 3],
) -> Result<Tensor>
where
    O: CustomOp3 + Send + Sync + 'static,
{
    let [a, b, c] = args;
    let values = a.detach().contiguous()?.apply_op3(&b.detach(), &c.detach(), op())?;
    let [a, b, c] = places(args, &remakes)?;
    let node = Op::CustomOp3(a, b, c, Arc::new(Box::new(Remade { op: op(), remakes })));
    Ok(values.share_as_op(node))
}

/// [`on_remade_inputs3`] for an op of two inputs.
pub(super) fn on_remade_inputs2<O>(
    op: impl Fn() -> O,
    args: [&Tensor; 2],
    remakes: [Option<Remake>; 2],
) -> Result<Tensor>
where
    O: CustomOp2 + Send + Sync + 'static,
{
    let [a, b] = args;
    let values = a.detach().contiguous()?.apply_op2(&b.detach(), op())?;
    let [a, b] = places(args, &remakes)?;
    let node = Op::CustomOp2(a, b, Arc::new(Box::new(Remade { op: op(), remakes })));
    Ok(values.share_as_op(node))
}

/// Each argument, or its place where it has a remake.
fn places<const N: usize>(args: [&Tensor; N], remakes: &[Option<Remake>; N]) -> Result<[Tensor; N]> {
    let mut out = args.map(Tensor::clone);
    for (arg, remake) in out.iter_mut().zip(remakes) {
        if remake.is_some() {
            *arg = arg.without_values()?;
        }
    }
    Ok(out)
}

struct Remade<O, const N: usize> {
    op: O,
    remakes: [Option<Remake>; N],
}

impl<O, const N: usize> Remade<O, N> {
    /// The `i`th argument's values: made again, or as the node kept them.
    fn arg(&self, i: usize, kept: &Tensor) -> Result<Tensor> {
        match &self.remakes[i] {
            Some(remake) => remake(),
            None => Ok(kept.clone()),
        }
    }
}

impl<O: CustomOp2> CustomOp2 for Remade<O, 2> {
    fn name(&self) -> &'static str {
        "remade-input"
    }

    fn bwd_reads_res(&self) -> bool {
        self.op.bwd_reads_res()
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("remade-input: the values are the op's, made before the node")
    }

    fn bwd(&self, a: &Tensor, b: &Tensor, res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.op.bwd(&self.arg(0, a)?, &self.arg(1, b)?, res, grad)
    }
}

impl<O: CustomOp3> CustomOp3 for Remade<O, 3> {
    fn name(&self) -> &'static str {
        "remade-input"
    }

    fn bwd_reads_res(&self) -> bool {
        self.op.bwd_reads_res()
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("remade-input: the values are the op's, made before the node")
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.op.bwd(&self.arg(0, a)?, &self.arg(1, b)?, &self.arg(2, c)?, res, grad)
    }
}
