//! bf16 products by cuBLASLt, `d = alpha * x @ w^T (+ b) + beta * c`, each
//! shape's plan made once per device: its layouts, its description and its
//! algorithm, where cudarc's `matmul` made them and asked the heuristic
//! again at every product.
//!
//! `RLOO_GEMM=tuned` also times cuBLASLt's other candidates on a shape's
//! first product of at most [`KEPT_ROWS`] rows (a decoding step's, whose
//! products recur at every token) and keeps the fastest whose output has
//! the same bits as the default's (cuBLASLt's first pick, or cuBLAS's
//! product for a layer without a bias): the choice changes the speed, never
//! a bit, however the timings fall.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::cublaslt::{result, sys};
use candle_core::cuda_backend::cudarc::driver::{
    sys::CUevent_flags, sys::CUstreamCaptureStatus, CudaSlice, CudaStream, DevicePtr, DevicePtrMut,
};
use candle_core::cuda_backend::{DeviceId, WrapErr};
use candle_core::{CudaDevice, CudaStorage, Result};
use half::bf16;

use super::{from_first, view, In};

/// The most rows of a product whose plan is kept (and tuned): decoding
/// steps and servers' batches, whose shapes recur at every token. A
/// prefill's or a training micro-batch's row count changes from batch to
/// batch: its plan is made for the product and dropped after it, and
/// cuBLASLt's first pick serves such large products well.
const KEPT_ROWS: usize = 1024;
/// The largest output whose plan is kept, in elements: tuning reads each
/// candidate's output back to the host to compare its bits.
const KEPT_OUTPUT: usize = 64 << 20;
/// Candidates asked of the heuristic.
const CANDIDATES: usize = 16;
/// Products timed per candidate, after one that warms it.
const TIMED: usize = 5;

/// `out = alpha * x @ w^T (+ b) + beta * out` for x (rows, k) and out (rows,
/// n) contiguous, w (n, k) row-major or the transposed view of a row-major
/// (k, n), and b (n,), by the shape's plan: cuBLASLt's first pick, or with
/// `tuned` its fastest candidate of the same bits.
pub fn product(
    x: In,
    w: In,
    b: Option<In>,
    out: &mut CudaSlice<bf16>,
    (rows, k, n): (usize, usize, usize),
    (alpha, beta): (f32, f32),
    tuned: bool,
) -> Result<()> {
    if out.len() != rows * n {
        candle_core::bail!("cuBLASLt product: an output of {} elements for {rows} x {n}", out.len());
    }
    let dev = x.0.device.clone();
    let stream = dev.cuda_stream();
    let operands = Operands::new(x, w, b, (rows, k, n))?;
    let (xs, ws, bs) = operands.views()?;
    let (xp, _x) = xs.device_ptr(&stream);
    let (wp, _w) = ws.device_ptr(&stream);
    let bias = bs.as_ref().map(|b| b.device_ptr(&stream));
    let (op, _o) = out.device_ptr_mut(&stream);
    let ptrs = Ptrs { x: xp, w: wp, bias: bias.as_ref().map(|b| b.0), c: op, d: op };
    let shape = operands.shape(&ptrs, beta != 0.0);
    with_plans(&dev, |lt| {
        if !shape.kept() {
            let plan = lt.make(shape, &operands, ptrs.bias)?;
            return lt.launch(&plan, &plan.first, ptrs, (alpha, beta), &stream);
        }
        let plan = lt.plan(shape, &operands, ptrs.bias)?;
        if tuned && plan.tunes_now(&stream) {
            let picked = lt.tune(shape, ptrs, (alpha, beta), &stream, Reference::FirstPick)?;
            lt.plans.get_mut(&shape).expect("made above").pick = Some(picked);
        }
        let plan = &lt.plans[&shape];
        let algo = match plan.pick {
            Some(Pick::Lt(algo)) if tuned => algo,
            _ => plan.first,
        };
        lt.launch(plan, &algo, ptrs, (alpha, beta), &stream)
    })
}

/// `x @ w^T` for a layer without a bias under `RLOO_GEMM=tuned`: cuBLAS's
/// product (`cublas`), which a shape's first product of at most
/// [`KEPT_ROWS`] rows also times against cuBLASLt's candidates; later
/// products take the fastest of the same bits.
pub fn plain(
    x: In,
    w: In,
    (rows, k, n): (usize, usize, usize),
    cublas: impl Fn() -> Result<CudaStorage>,
) -> Result<CudaStorage> {
    let dev = x.0.device.clone();
    let stream = dev.cuda_stream();
    let operands = Operands::new(x, w, None, (rows, k, n))?;
    let (xs, ws, _) = operands.views()?;
    let (xp, _x) = xs.device_ptr(&stream);
    let (wp, _w) = ws.device_ptr(&stream);
    // The output is a new buffer of the pool's alignment.
    let ptrs = Ptrs { x: xp, w: wp, bias: None, c: 0, d: 0 };
    let shape = operands.shape(&ptrs, false);
    if !shape.kept() {
        return cublas();
    }
    with_plans(&dev, |lt| {
        let plan = lt.plan(shape, &operands, None)?;
        if plan.tunes_now(&stream) {
            let want = cublas()?;
            let picked = {
                let (c, _c) = want.as_cuda_slice::<bf16>()?.device_ptr(&stream);
                let reference = Reference::Cublas(&want, &cublas);
                lt.tune(shape, Ptrs { c, ..ptrs }, (1.0, 0.0), &stream, reference)?
            };
            lt.plans.get_mut(&shape).expect("made above").pick = Some(picked);
            return Ok(want);
        }
        let plan = &lt.plans[&shape];
        match plan.pick {
            Some(Pick::Lt(algo)) => {
                // Safety: the product writes every element.
                let mut out = unsafe { dev.alloc::<bf16>(rows * n) }?;
                let (d, _d) = out.device_ptr_mut(&stream);
                lt.launch(plan, &algo, Ptrs { c: d, d, ..ptrs }, (1.0, 0.0), &stream)?;
                drop(_d);
                Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
            }
            _ => cublas(),
        }
    })
}

/// A product's inputs and sizes.
struct Operands<'a> {
    x: In<'a>,
    w: In<'a>,
    b: Option<In<'a>>,
    rows: usize,
    k: usize,
    n: usize,
    /// Whether w is (n, k) row-major (else the transposed view of a (k, n)), and its row stride.
    transa: bool,
    lda: i64,
}

impl<'a> Operands<'a> {
    fn new(x: In<'a>, w: In<'a>, b: Option<In<'a>>, (rows, k, n): (usize, usize, usize)) -> Result<Self> {
        // cuBLASLt's matrices are column-major: the output (rows, n) row-major
        // is (n, rows) with rows n apart, = w (n, k) times x^T (k, rows).
        let (transa, lda) = match w.1.stride() {
            [s, 1] if *s == k => (true, k as i64),
            [1, s] if *s == n => (false, n as i64),
            other => candle_core::bail!("linear: a weight with strides {other:?}"),
        };
        Ok(Self { x, w, b, rows, k, n, transa, lda })
    }

    fn views(&self) -> Result<OperandViews<'a>> {
        let bias = self.b.map(|b| view::<bf16>(b.0, b.1)).transpose()?;
        Ok((view::<bf16>(self.x.0, self.x.1)?, from_first::<bf16>(self.w)?, bias))
    }

    /// The plan's key for these operands at `ptrs`.
    fn shape(&self, ptrs: &Ptrs, adds: bool) -> Shape {
        // An algorithm may need more alignment than another: the least of
        // the addresses' trailing zero bits, up to cuBLASLt's 256 bytes.
        let align = [ptrs.x, ptrs.w, ptrs.bias.unwrap_or(0), ptrs.c]
            .into_iter()
            .filter(|p| *p != 0)
            .map(|p| p.trailing_zeros().min(8))
            .min()
            .unwrap_or(8);
        Shape { rows: self.rows, k: self.k, n: self.n, transa: self.transa, bias: self.b.is_some(), adds, align }
    }
}

type OperandViews<'a> = (
    candle_core::cuda_backend::cudarc::driver::CudaView<'a, bf16>,
    candle_core::cuda_backend::cudarc::driver::CudaView<'a, bf16>,
    Option<candle_core::cuda_backend::cudarc::driver::CudaView<'a, bf16>>,
);

/// The device addresses of a product: c is read when beta is not 0, d written.
#[derive(Clone, Copy)]
struct Ptrs {
    x: u64,
    w: u64,
    bias: Option<u64>,
    c: u64,
    d: u64,
}

/// What makes two products share a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Shape {
    rows: usize,
    k: usize,
    n: usize,
    transa: bool,
    bias: bool,
    /// The product adds into its output (beta is not 0).
    adds: bool,
    align: u32,
}

impl Shape {
    /// Whether the shape's plan is kept for its next products.
    fn kept(&self) -> bool {
        self.rows <= KEPT_ROWS && self.rows * self.n <= KEPT_OUTPUT
    }
}

/// A tuned shape's choice.
#[derive(Clone, Copy)]
enum Pick {
    Lt(sys::cublasLtMatmulAlgo_t),
    /// The default (cuBLASLt's first pick, or cuBLAS's product for a layer
    /// without a bias): no candidate was faster with the same bits.
    Default,
}

/// What a candidate's bits are compared with: cuBLASLt's first pick's
/// output, or cuBLAS's (given, and how to make it again for its time).
enum Reference<'a> {
    FirstPick,
    Cublas(&'a CudaStorage, &'a dyn Fn() -> Result<CudaStorage>),
}

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    /// The layouts of w (cuBLASLt's A), x (B), and the output (C and D).
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    c: sys::cublasLtMatrixLayout_t,
    /// cuBLASLt's first pick (a layer without a bias has cuBLAS's product
    /// until tuned).
    first: sys::cublasLtMatmulAlgo_t,
    /// Set once the shape is tuned.
    pick: Option<Pick>,
}

impl Plan {
    /// Whether this product tunes the shape: not yet tuned, and not being
    /// recorded into a CUDA graph (whose replays would repeat the
    /// candidates).
    fn tunes_now(&self, stream: &CudaStream) -> bool {
        // The driver is asked only until the shape is tuned.
        self.pick.is_none()
            && stream.capture_status().is_ok_and(|s| s == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }
}

impl Drop for Plan {
    fn drop(&mut self) {
        // Safety: made by this plan and used by no other.
        unsafe {
            let _ = result::destroy_matmul_desc(self.desc);
            for layout in [self.a, self.b, self.c] {
                let _ = result::destroy_matrix_layout(layout);
            }
        }
    }
}

/// A device's cuBLASLt handle, workspace and plans.
struct Plans {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    plans: HashMap<Shape, Plan>,
}

// Safety: the handle and the plans' descriptors are used under the mutex only.
unsafe impl Send for Plans {}

/// `f` on `dev`'s plans, made with its handle and workspace on first use.
fn with_plans<T>(dev: &CudaDevice, f: impl FnOnce(&mut Plans) -> Result<T>) -> Result<T> {
    static DEVICES: Mutex<Vec<(DeviceId, Plans)>> = Mutex::new(Vec::new());
    let mut devices = DEVICES.lock().unwrap_or_else(|e| e.into_inner());
    let at = match devices.iter().position(|(id, _)| *id == dev.id()) {
        Some(at) => at,
        None => {
            devices.push((dev.id(), Plans::new(&dev.cuda_stream())?));
            devices.len() - 1
        }
    };
    f(&mut devices[at].1)
}

/// cuBLASLt's errors as candle's.
fn lt<T>(what: &str, r: std::result::Result<T, result::CublasError>) -> Result<T> {
    r.map_err(|e| candle_core::Error::msg(format!("cuBLASLt {what}: {e:?}")))
}

impl Plans {
    fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
        let handle = lt("handle", result::create_handle())?;
        // As cudarc's: 32 MiB from Hopper on, 4 before.
        let major = stream.context().attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR).w()?;
        let size = if major >= 9 { 32 << 20 } else { 4 << 20 };
        // Safety: cuBLASLt's scratch space, never read before written.
        let workspace = unsafe { stream.alloc::<u8>(size) }.w()?;
        Ok(Self { handle, workspace, plans: HashMap::new() })
    }

    /// The plan of `shape`, made at its first product.
    fn plan(&mut self, shape: Shape, ops: &Operands, bias: Option<u64>) -> Result<&Plan> {
        if !self.plans.contains_key(&shape) {
            let plan = self.make(shape, ops, bias)?;
            self.plans.insert(shape, plan);
        }
        Ok(&self.plans[&shape])
    }

    fn make(&self, shape: Shape, ops: &Operands, bias: Option<u64>) -> Result<Plan> {
        use sys::cublasLtMatmulDescAttributes_t as Attr;
        let (m, n, k) = (shape.n as u64, shape.rows as u64, shape.k as u64);
        let (a_rows, a_cols) = if shape.transa { (k, m) } else { (m, k) };
        let bf = sys::cudaDataType_t::CUDA_R_16BF;
        let a = lt("layout", result::create_matrix_layout(bf, a_rows, a_cols, ops.lda))?;
        let b = lt("layout", result::create_matrix_layout(bf, k, n, k as i64))?;
        let c = lt("layout", result::create_matrix_layout(bf, m, n, m as i64))?;
        let desc = lt(
            "description",
            result::create_matmul_desc(sys::cublasComputeType_t::CUBLAS_COMPUTE_32F, sys::cudaDataType_t::CUDA_R_32F),
        )?;
        let mut plan = Plan { desc, a, b, c, first: sys::cublasLtMatmulAlgo_t { data: [0; 8] }, pick: None };
        let epilogue = match shape.bias {
            true => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            false => sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
        };
        // Safety: each attribute's value has the type and size cuBLASLt reads.
        unsafe {
            let (transa, transb) = (shape.transa as i32, 0i32);
            set(desc, Attr::CUBLASLT_MATMUL_DESC_TRANSA, &transa)?;
            set(desc, Attr::CUBLASLT_MATMUL_DESC_TRANSB, &transb)?;
            set(desc, Attr::CUBLASLT_MATMUL_DESC_TRANSC, &transb)?;
            set(desc, Attr::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue)?;
            if let Some(bias) = bias {
                set(desc, Attr::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
            }
        }
        // The first pick is asked as cudarc asked it (one candidate), so
        // the default is the product cudarc's `matmul` made.
        plan.first = match self.candidates(&plan, 1)?.first() {
            Some((algo, _)) => *algo,
            None => candle_core::bail!("cuBLASLt has no algorithm for {shape:?}"),
        };
        Ok(plan)
    }

    /// Up to `count` of the heuristic's candidates for `plan`, best first,
    /// with the workspace each needs.
    fn candidates(&self, plan: &Plan, count: usize) -> Result<Vec<(sys::cublasLtMatmulAlgo_t, usize)>> {
        use sys::cublasLtMatmulPreferenceAttributes_t as Pref;
        let pref = lt("preference", result::create_matmul_pref())?;
        let size = self.workspace.len();
        let mut found = vec![unsafe { std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>() }; count];
        let mut returned = 0i32;
        // Safety: the results array holds `count`; the handles are live.
        let status = unsafe {
            let set = result::set_matmul_pref_attribute(
                pref,
                Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&size as *const usize).cast(),
                std::mem::size_of::<usize>(),
            );
            let status = set.and_then(|()| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    plan.desc,
                    plan.a,
                    plan.b,
                    plan.c,
                    plan.c,
                    pref,
                    count as i32,
                    found.as_mut_ptr(),
                    &mut returned,
                )
                .result()
            });
            let _ = result::destroy_matmul_pref(pref);
            status
        };
        lt("heuristic", status)?;
        found.truncate(returned.max(0) as usize);
        let ok = sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS;
        Ok(found.into_iter().filter(|r| r.state == ok).map(|r| (r.algo, r.workspaceSize)).collect())
    }

    /// One product by `algo` on the stream.
    fn launch(
        &self,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        ptrs: Ptrs,
        (alpha, beta): (f32, f32),
        stream: &CudaStream,
    ) -> Result<()> {
        let (workspace, _ws) = self.workspace.device_ptr(stream);
        // Safety: the plan's layouts describe the buffers at `ptrs`; the
        // bias pointer is the description's only per-product attribute,
        // set under the plans' mutex.
        unsafe {
            if let Some(bias) = ptrs.bias {
                set(plan.desc, sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)?;
            }
            lt(
                "product",
                result::matmul(
                    self.handle,
                    plan.desc,
                    (&alpha as *const f32).cast(),
                    (&beta as *const f32).cast(),
                    ptrs.w as *const _,
                    plan.a,
                    ptrs.x as *const _,
                    plan.b,
                    ptrs.c as *const _,
                    plan.c,
                    ptrs.d as *mut _,
                    plan.c,
                    algo,
                    workspace as *mut _,
                    self.workspace.len(),
                    stream.cu_stream() as *mut _,
                ),
            )
        }
    }

    /// Times the heuristic's candidates for `shape` into a scratch output
    /// (reading `ptrs.c` where beta is not 0), compares each one's bits
    /// with `reference`'s, and says which to keep; logs what it found.
    fn tune(
        &self,
        shape: Shape,
        ptrs: Ptrs,
        scales: (f32, f32),
        stream: &Arc<CudaStream>,
        reference: Reference,
    ) -> Result<Pick> {
        let plan = &self.plans[&shape];
        // Safety: every product below writes all of it before it is read.
        let mut scratch = unsafe { stream.alloc::<bf16>(shape.rows * shape.n) }.w()?;
        let (d, _d) = scratch.device_ptr_mut(stream);
        let into_scratch = Ptrs { d, ..ptrs };
        drop(_d);
        let (want, default_us) = match reference {
            Reference::FirstPick => {
                let run = || self.launch(plan, &plan.first, into_scratch, scales, stream);
                let us = time_us(stream, run)?;
                (stream.clone_dtoh(&scratch).w()?, us)
            }
            Reference::Cublas(given, cublas) => {
                let us = time_us(stream, || cublas().map(drop))?;
                (stream.clone_dtoh(given.as_cuda_slice::<bf16>()?).w()?, us)
            }
        };
        let same_bits = |got: &[bf16]| got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits());
        let workspace = self.workspace.len();
        // (index, µs, same bits) of each candidate that ran.
        let mut timed = Vec::new();
        let candidates = self.candidates(plan, CANDIDATES)?;
        for (i, (algo, needs)) in candidates.iter().enumerate() {
            if *needs > workspace || self.launch(plan, algo, into_scratch, scales, stream).is_err() {
                continue;
            }
            let same = same_bits(&stream.clone_dtoh(&scratch).w()?);
            let us = time_us(stream, || self.launch(plan, algo, into_scratch, scales, stream))?;
            timed.push((i, us, same));
        }
        let fastest = |same: bool| timed.iter().filter(|t| t.2 == same).min_by(|a, b| a.1.total_cmp(&b.1)).copied();
        let kept = fastest(true).filter(|(_, us, _)| *us < default_us);
        let other = match fastest(false) {
            Some((i, us, _)) => {
                format!("; the fastest of other bits: #{i} ({}) {us:.1} us", describe(&candidates[i].0))
            }
            None => String::new(),
        };
        let default = match reference {
            Reference::FirstPick => "cuBLASLt's first pick",
            Reference::Cublas(..) => "cuBLAS's product",
        };
        let kept_text = match kept {
            Some((i, us, _)) => format!("keeps #{i} ({}) at {us:.1} us", describe(&candidates[i].0)),
            None => "keeps it".to_string(),
        };
        tracing::info!(
            "product of {} x {} by {} x {}{}{}: {default} {default_us:.1} us; {kept_text}; {} of {} candidates give its bits{other}",
            shape.rows,
            shape.k,
            shape.n,
            shape.k,
            if shape.bias { ", a bias" } else { "" },
            if shape.adds { ", added into its output" } else { "" },
            timed.iter().filter(|t| t.2).count(),
            timed.len(),
        );
        Ok(match kept {
            Some((i, _, _)) => Pick::Lt(candidates[i].0),
            None => Pick::Default,
        })
    }
}

/// Sets a description's attribute to `value`.
///
/// # Safety
/// `T` is the type cuBLASLt reads for `attr`.
unsafe fn set<T>(desc: sys::cublasLtMatmulDesc_t, attr: sys::cublasLtMatmulDescAttributes_t, value: &T) -> Result<()> {
    lt(
        "description",
        result::set_matmul_desc_attribute(desc, attr, (value as *const T).cast(), std::mem::size_of::<T>()),
    )
}

/// An algorithm's tile and split of the sums, for the log.
fn describe(algo: &sys::cublasLtMatmulAlgo_t) -> String {
    use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
    let read = |attr| {
        let (mut value, mut written) = (0u32, 0usize);
        // Safety: both attributes are 32-bit values.
        let status = unsafe {
            sys::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, (&mut value as *mut u32).cast(), 4, &mut written)
        };
        (status == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(value)
    };
    match (read(Config::CUBLASLT_ALGO_CONFIG_TILE_ID), read(Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) {
        (Some(tile), Some(split)) => format!("tile {tile}, sums split {split} ways"),
        _ => "undescribed".to_string(),
    }
}

/// The mean time of [`TIMED`] runs of `run` on the stream's clock, in µs,
/// after one that warms it.
fn time_us(stream: &Arc<CudaStream>, run: impl Fn() -> Result<()>) -> Result<f64> {
    run()?;
    let start = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
    for _ in 0..TIMED {
        run()?;
    }
    let end = stream.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).w()?;
    Ok(start.elapsed_ms(&end).w()? as f64 * 1000.0 / TIMED as f64)
}

/// `x @ w^T + b` in bf16 for x (rows, k) contiguous, w (n, k) row-major or
/// the transposed view of a row-major (k, n), and b (n,): one cuBLASLt
/// product that adds the bias in its epilogue, where cuBLAS's product and
/// [`super::bias_rows`] are two launches and a round trip of the output through
/// memory. `tuned`: see this module.
pub fn linear_bias_epilogue(
    x: In,
    w: In,
    b: In,
    (rows, k, n): (usize, usize, usize),
    tuned: bool,
) -> Result<CudaStorage> {
    let dev = x.0.device.clone();
    // Safety: the product writes every element.
    let mut out = unsafe { dev.alloc::<bf16>(rows * n) }?;
    product(x, w, Some(b), &mut out, (rows, k, n), (1.0, 0.0), tuned)?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev))
}

/// `y += scale * down @ b^T` in bf16, in place, for y (rows, n) and down
/// (rows, r) contiguous and b (n, r) row-major: a LoRA adapter's part added
/// into its base layer's output by the product itself (cuBLASLt reads y as
/// its C), where a scaling, a product and an addition took three launches
/// and two tensors of y's size. `tuned`: see this module.
pub fn add_product(
    y: &mut CudaStorage,
    down: In,
    b: In,
    scale: f32,
    (rows, r, n): (usize, usize, usize),
    tuned: bool,
) -> Result<()> {
    product(down, b, None, y.as_cuda_slice_mut::<bf16>()?, (rows, r, n), (scale, 1.0), tuned)
}
