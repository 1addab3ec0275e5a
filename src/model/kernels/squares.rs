//! Each tensor's sum of squares in f64, for the gradient norm: on a GPU,
//! one launch over all of them and one read; elsewhere each tensor's
//! composition (square, sum, widen), brought to the host at once.

use candle_core::{DType, Result, Tensor};

pub fn sums_of_squares(ts: &[&Tensor]) -> Result<Vec<f64>> {
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    #[cfg(feature = "cuda")]
    if super::on_cuda(ts) && ts.iter().all(|t| t.dtype() == DType::F32 && t.is_contiguous()) {
        return super::cuda::sum_squares_multi(ts);
    }
    let squares = ts.iter().map(|t| t.sqr()?.sum_all()?.to_dtype(DType::F64)).collect::<Result<Vec<_>>>()?;
    Tensor::stack(&squares, 0)?.to_vec1::<f64>()
}
