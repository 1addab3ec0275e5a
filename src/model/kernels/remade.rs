//! Inputs that a backward makes again instead of keeping (selective
//! recomputation). An MLP's wide input is 4 of the 9 tensors of the hidden
//! size that a GPT-NeoX layer keeps for its backward; made again from the
//! layer's input, which is kept anyway, it costs one product of the MLP's
//! three in a backward (`RLOO_MLP_INPUT=remade`; kept by default).

use std::sync::Arc;

use candle_core::op::Op;
use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

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
    let [input, a, b] = args;
    let values = input.detach().contiguous()?.apply_op3(&a.detach(), &b.detach(), op())?;
    let node =
        Op::CustomOp3(input.without_values()?, a.clone(), b.clone(), Arc::new(Box::new(Remade { op: op(), remake })));
    Ok(values.share_as_op(node))
}

struct Remade<O> {
    op: O,
    remake: Remake,
}

impl<O: CustomOp3> CustomOp3 for Remade<O> {
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
        _place: &Tensor,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.op.bwd(&(self.remake)()?, a, b, res, grad)
    }
}
