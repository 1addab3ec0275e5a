//! Rows picked from a table that trains on a GPU (an embedding lookup, the
//! hidden states at the completions' positions): one op whose backward
//! writes the table's gradient a row per block (`cuda/embedding.cuh`).

use candle_core::{CustomOp2, Result, Tensor};
#[cfg(feature = "cuda")]
use candle_core::{Layout, Shape};

/// Rows `ids` (N,) of `table` (V, H): the op above on a GPU for a table
/// that trains, where candle's index_add would walk every position for
/// every column on one thread each; elsewhere candle's index_select.
pub fn gather_rows(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if !(super::on_cuda(&[table]) && table.track_op() && ids.dtype() == candle_core::DType::U32) {
        return table.index_select(ids, 0);
    }
    table.contiguous()?.apply_op2(&ids.contiguous()?, Embedding)
}

struct Embedding;

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "embedding"
    }

    super::cuda_only_cpu_fwd!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        table: &candle_core::CudaStorage,
        table_l: &Layout,
        ids: &candle_core::CudaStorage,
        ids_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let h = table_l.dims()[1];
        Ok((table.index_select(ids, table_l, ids_l, 0)?, Shape::from((ids_l.shape().elem_count(), h))))
    }

    fn bwd(&self, table: &Tensor, ids: &Tensor, _: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.contiguous()?;
        Ok((Some(grad.apply_op2_no_bwd(ids, &EmbeddingGrad { rows: table.dim(0)? })?), None))
    }
}

/// (d lookups (N, H), ids (N,)) -> d table (V, H).
struct EmbeddingGrad {
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    rows: usize,
}

impl CustomOp2 for EmbeddingGrad {
    fn name(&self) -> &'static str {
        "embedding-grad"
    }

    super::cuda_only_cpu_fwd!(2);

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        g: &candle_core::CudaStorage,
        g_l: &Layout,
        ids: &candle_core::CudaStorage,
        ids_l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let h = g_l.dims().last().copied().unwrap_or(0);
        Ok((super::cuda::embedding_grad((g, g_l), (ids, ids_l), self.rows)?, Shape::from((self.rows, h))))
    }
}
