//! AdamW with f32 state, learning-rate schedules, global-norm gradient
//! clipping, and gradient accumulation over micro-batches.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::config::Schedule;
use crate::dist::{host_f32, Communicator};
use crate::error::{Error, Result};
use crate::model::kernels::{self, AdamWParam, AdamWStep};
use crate::model::{Param, ParamStore};

/// Gradients summed over micro-batches, per parameter, kept in the order
/// of the parameters so that the global norm sums them in a fixed order
/// (a hash map's order changes from run to run, and with it the rounding).
#[derive(Default)]
pub struct GradAccumulator {
    sums: Vec<GradSum>,
}

/// One parameter's sum. `owned` once the accumulator made it (a gradient
/// cast up, or two added), so that later gradients add into it in place; a
/// first gradient already in the master's dtype is the backward's own
/// tensor, whose storage another may share (the backward keeps the first
/// gradient that reaches a tensor as it is, and an op such as a residual's
/// sum hands one gradient to each of its inputs).
struct GradSum {
    id: candle_core::TensorId,
    sum: Tensor,
    owned: bool,
}

impl GradAccumulator {
    /// Adds one backward pass's gradients of `params` (those of the copies
    /// they compute with) into sums in their masters' dtype.
    pub fn add(&mut self, params: &ParamStore, grads: &GradStore) -> Result<()> {
        for p in params.iter() {
            if let Some(g) = grads.get(p.compute()) {
                let id = p.var.as_tensor().id();
                match self.sums.iter_mut().find(|s| s.id == id) {
                    Some(s) if s.owned => kernels::add_cast_to(&mut s.sum, g)?,
                    Some(s) => (s.sum, s.owned) = (kernels::add_cast(&s.sum, g)?, true),
                    None => {
                        let sum = kernels::cast(g, p.master_dtype())?;
                        self.sums.push(GradSum { id, sum, owned: g.dtype() != p.master_dtype() });
                    }
                }
            }
        }
        Ok(())
    }

    pub fn get(&self, var: &Var) -> Option<&Tensor> {
        let id = var.as_tensor().id();
        self.sums.iter().find(|s| s.id == id).map(|s| &s.sum)
    }

    pub fn clear(&mut self) {
        self.sums.clear();
    }

    /// Sums the gradients of `stores` over the ranks of a data-parallel
    /// job, in one buffer, in the stores' parameter order; a parameter with
    /// a gradient on any rank has one (zero elsewhere) on every rank after.
    /// The step's `scalars` (its loss, its counts) are summed on the way.
    pub fn all_reduce(&mut self, stores: &[&ParamStore], comm: &dyn Communicator, scalars: &mut [f64]) -> Result<()> {
        let params: Vec<&Param> = stores.iter().flat_map(|s| s.iter()).collect();
        let mut present: Vec<f64> = params.iter().map(|p| if self.get(&p.var).is_some() { 1.0 } else { 0.0 }).collect();
        present.extend_from_slice(scalars);
        comm.all_reduce_sum_f64(&mut present)?;
        scalars.copy_from_slice(&present[params.len()..]);
        let params: Vec<&Param> = params.into_iter().zip(present).filter(|(_, p)| *p > 0.0).map(|(p, _)| p).collect();
        if params.is_empty() {
            return Ok(());
        }
        // One buffer where the gradients lie (a GPU's, for NCCL), in parameter order.
        let parts = params
            .iter()
            .map(|p| match self.get(&p.var) {
                Some(g) => Ok(g.flatten_all()?.to_dtype(DType::F32)?),
                None => Ok(Tensor::zeros(p.var.elem_count(), DType::F32, p.var.device())?),
            })
            .collect::<Result<Vec<_>>>()?;
        let flat = comm.all_reduce_tensor(&Tensor::cat(&parts, 0)?)?;
        let mut at = 0;
        for p in params {
            let n = p.var.elem_count();
            let dtype = self.get(&p.var).map_or(p.master_dtype(), Tensor::dtype);
            let sum = flat.narrow(0, at, n)?.reshape(p.var.shape())?.to_dtype(dtype)?;
            at += n;
            let id = p.var.as_tensor().id();
            // A view of the reduced buffer: not owned.
            match self.sums.iter_mut().find(|s| s.id == id) {
                Some(s) => (s.sum, s.owned) = (sum, false),
                None => self.sums.push(GradSum { id, sum, owned: false }),
            }
        }
        Ok(())
    }

    /// The global L2 norm over all gradients: their sums of squares come
    /// to the host at once (on a GPU, from one launch), to be summed there
    /// in parameter order.
    pub fn norm(&self) -> Result<f64> {
        if self.sums.is_empty() {
            return Ok(0.0);
        }
        let grads: Vec<&Tensor> = self.sums.iter().map(|s| &s.sum).collect();
        let squares = crate::model::kernels::sums_of_squares(&grads)?;
        Ok(squares.iter().fold(0.0, |sum, &sq| sum + sq).sqrt())
    }

    /// Scales gradients so their global norm is at most `max_norm` (as
    /// PyTorch's `clip_grad_norm_`: factor `max_norm / (norm + 1e-6)`, capped
    /// at 1). Returns the norm before clipping.
    pub fn clip(&mut self, max_norm: f64) -> Result<f64> {
        let norm = self.norm()?;
        if max_norm > 0.0 {
            let coef = max_norm / (norm + 1e-6);
            if coef < 1.0 {
                for s in self.sums.iter_mut() {
                    match s.owned {
                        true => kernels::scale_to(&mut s.sum, coef)?,
                        false => (s.sum, s.owned) = ((&s.sum * coef)?, true),
                    }
                }
            }
        }
        Ok(norm)
    }
}

/// Lets an optimizer step go ahead only when its loss and gradient norm
/// are finite, so that no NaN or infinity reaches the weights or the
/// optimizer state; counts the steps skipped in a row, for whatever reason.
#[derive(Debug)]
pub struct StepGuard {
    limit: usize,
    in_a_row: usize,
    /// Why the last skipped step was skipped.
    last: String,
}

impl StepGuard {
    /// `limit`: skipped steps in a row after which [`exhausted`](Self::exhausted) holds.
    pub fn new(limit: usize) -> Self {
        Self { limit: limit.max(1), in_a_row: 0, last: String::new() }
    }

    /// Whether optimizer step `step` (0-based) may update the weights.
    pub fn check(&mut self, step: usize, loss: f64, grad_norm: f64) -> bool {
        if loss.is_finite() && grad_norm.is_finite() {
            self.in_a_row = 0;
            return true;
        }
        self.skip(step, format!("loss {loss}, gradient norm {grad_norm}"));
        false
    }

    /// Records that optimizer step `step` is skipped, and why.
    pub fn skip(&mut self, step: usize, why: String) {
        self.in_a_row += 1;
        tracing::warn!(
            "optimizer step {}: {why}; skipped ({} in a row, the run stops at {})",
            step + 1,
            self.in_a_row,
            self.limit
        );
        self.last = why;
    }

    pub fn exhausted(&self) -> bool {
        self.in_a_row >= self.limit
    }

    pub fn describe(&self) -> String {
        format!("{} optimizer steps in a row were skipped (the last: {})", self.in_a_row, self.last)
    }
}

/// AdamW as PyTorch implements it (decoupled weight decay, bias-corrected
/// moments, `eps` added to the corrected square root).
#[derive(Clone)]
pub struct AdamW {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Optimizer steps taken.
    pub step: usize,
    /// (first moment, second moment) per parameter name.
    moments: HashMap<String, (Tensor, Tensor)>,
    /// ZeRO stage 1: the parameters this process steps, and the job.
    shard: Option<Shard>,
}

/// ZeRO stage 1 (`zero_stage = 1`): AdamW's moments, twice the f32
/// weights, split over the processes. Each still holds the summed gradient
/// (so clipping sees the whole norm) but steps only the parameters it
/// owns, keeping only their moments, and then sends their new values to
/// the others: the weights are the unsharded run's, to the bit.
#[derive(Clone)]
struct Shard {
    /// The owning rank of each parameter that trains.
    owner: HashMap<String, usize>,
    comm: Arc<dyn Communicator>,
}

impl Shard {
    /// Parameters to ranks, largest first, each to the rank holding the
    /// fewest elements so far: the same on every process.
    fn new(params: &ParamStore, comm: Arc<dyn Communicator>) -> Self {
        let mut trainable: Vec<(&str, usize)> =
            params.trainable().map(|p| (p.name.as_str(), p.var.elem_count())).collect();
        trainable.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
        let mut load = vec![0usize; comm.world().size];
        let mut owner = HashMap::new();
        for (name, n) in trainable {
            let rank = (0..load.len()).min_by_key(|&r| (load[r], r)).expect("a rank");
            load[rank] += n;
            owner.insert(name.to_string(), rank);
        }
        Shard { owner, comm }
    }

    fn owns(&self, name: &str) -> bool {
        self.owner.get(name) == Some(&self.comm.world().rank)
    }

    /// Every process's new values of the parameters it owns, to every process.
    fn share_weights(&self, params: &ParamStore) -> Result<()> {
        let mut mine = Vec::new();
        for p in params.trainable().filter(|p| self.owns(&p.name)) {
            mine.extend(host_f32(&p.master()?)?);
        }
        let mut received = Received::gather(&*self.comm, &mine)?;
        for p in params.trainable() {
            let rank = self.owner[&p.name];
            let values = received.next(rank, p.var.elem_count(), &p.name)?;
            if rank != self.comm.world().rank {
                p.set_master(&Tensor::from_slice(values, p.var.shape(), p.var.device())?)?;
            }
        }
        Ok(())
    }
}

/// What every process sent in one all-gather of f32 values, read in the
/// order each sent them.
struct Received(Vec<(Vec<f32>, usize)>);

impl Received {
    fn gather(comm: &dyn Communicator, mine: &[f32]) -> Result<Self> {
        let all = comm.all_gather(&crate::dist::f32_bytes(mine))?;
        Ok(Received(all.iter().map(|b| (crate::dist::bytes_f32(b), 0)).collect()))
    }

    /// The next `n` values from `rank`, those of parameter `name`.
    fn next(&mut self, rank: usize, n: usize, name: &str) -> Result<&[f32]> {
        let (values, at) = &mut self.0[rank];
        if *at + n > values.len() {
            return Err(Error::Dist(format!("rank {rank} sent too few values for `{name}`")));
        }
        *at += n;
        Ok(&values[*at - n..*at])
    }
}

/// Whether weight decay applies: not to biases or norm weights, as the
/// transformers Trainer groups parameters.
pub fn decays(name: &str) -> bool {
    let leaf = name.rsplit('.').nth(1).unwrap_or("");
    !(name.ends_with(".bias") || leaf.contains("norm") || leaf.starts_with("ln_"))
}

impl AdamW {
    pub fn new(beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> Self {
        Self { beta1, beta2, eps, weight_decay, step: 0, moments: HashMap::new(), shard: None }
    }

    /// ZeRO stage 1 over the processes of `comm`: this process keeps the
    /// moments of, and steps, its share of `params` (nothing changes in a
    /// world of one).
    pub fn shard(&mut self, params: &ParamStore, comm: Arc<dyn Communicator>) {
        if comm.world().joined {
            let shard = Shard::new(params, comm);
            self.moments.retain(|name, _| shard.owns(name));
            self.shard = Some(shard);
        }
    }

    fn owns(&self, name: &str) -> bool {
        self.shard.as_ref().is_none_or(|s| s.owns(name))
    }

    /// The whole state on every process: itself, or under ZeRO its shards
    /// gathered (every process of the job calls it), for a checkpoint.
    pub fn gathered(&self, params: &ParamStore) -> Result<AdamW> {
        let Some(shard) = &self.shard else { return Ok(self.clone()) };
        // Per owned parameter: 1 and its two moments, or 0 before its first gradient.
        let mut mine = Vec::new();
        for p in params.trainable().filter(|p| shard.owns(&p.name)) {
            match self.moments.get(&p.name) {
                Some((m, v)) => {
                    mine.push(1.0);
                    mine.extend(host_f32(m)?);
                    mine.extend(host_f32(v)?);
                }
                None => mine.push(0.0),
            }
        }
        let mut received = Received::gather(&*shard.comm, &mine)?;
        let mut full = AdamW { shard: None, moments: HashMap::new(), ..self.clone() };
        for p in params.trainable() {
            let rank = shard.owner[&p.name];
            if received.next(rank, 1, &p.name)?[0] == 0.0 {
                continue;
            }
            let n = p.var.elem_count();
            let both = received.next(rank, 2 * n, &p.name)?;
            let m = Tensor::from_slice(&both[..n], p.var.shape(), p.var.device())?;
            let v = Tensor::from_slice(&both[n..], p.var.shape(), p.var.device())?;
            full.moments.insert(p.name.clone(), (m, v));
        }
        Ok(full)
    }

    /// One update of every parameter that has a gradient at learning rate `lr`.
    pub fn step(&mut self, params: &ParamStore, grads: &GradAccumulator, lr: f64) -> Result<()> {
        self.step += 1;
        let t = self.step as i32;
        let bias1 = 1.0 - self.beta1.powi(t);
        let bias2 = 1.0 - self.beta2.powi(t);
        let mine: Vec<_> = params.iter().filter(|p| self.owns(&p.name)).collect();
        let mut stepped = Vec::new();
        for p in mine {
            let Some(g) = grads.get(&p.var) else { continue };
            let moments = match self.moments.remove(&p.name) {
                Some(mv) => mv,
                None => {
                    let zeros = || Tensor::zeros(p.var.shape(), p.master_dtype(), p.var.device());
                    (zeros()?, zeros()?)
                }
            };
            let decay = if self.weight_decay > 0.0 && decays(&p.name) { 1.0 - lr * self.weight_decay } else { 1.0 };
            stepped.push((p, g, moments, decay));
        }
        let mut updates: Vec<AdamWParam> = stepped
            .iter_mut()
            .map(|(p, g, (m, v), decay)| AdamWParam {
                w: &p.var,
                split: p.split(),
                g,
                m,
                v,
                step: AdamWStep {
                    beta1: self.beta1 as f32,
                    beta2: self.beta2 as f32,
                    eps: self.eps as f32,
                    lr: lr as f32,
                    bias1: bias1 as f32,
                    bias2: bias2 as f32,
                    decay: *decay as f32,
                },
            })
            .collect();
        kernels::adamw_many(&mut updates)?;
        drop(updates);
        for (p, _, moments, _) in stepped {
            self.moments.insert(p.name.clone(), moments);
        }
        if let Some(shard) = &self.shard {
            shard.share_weights(params)?;
        }
        // The networks compute with copies of the masters (bf16).
        params.sync_compute()?;
        Ok(())
    }

    /// The moments as named tensors (`exp_avg.<param>`, `exp_avg_sq.<param>`) for checkpoints.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(self.moments.len() * 2);
        for (name, (m, v)) in &self.moments {
            out.push((format!("exp_avg.{name}"), m.clone()));
            out.push((format!("exp_avg_sq.{name}"), v.clone()));
        }
        out
    }

    /// Restores moments saved by [`AdamW::state_tensors`].
    pub fn load_state(&mut self, tensors: HashMap<String, Tensor>, step: usize, params: &ParamStore) -> Result<()> {
        self.step = step;
        self.moments.clear();
        let mine: Vec<_> = params.iter().filter(|p| self.owns(&p.name)).collect();
        for p in mine {
            let m = tensors.get(&format!("exp_avg.{}", p.name));
            let v = tensors.get(&format!("exp_avg_sq.{}", p.name));
            match (m, v) {
                (Some(m), Some(v)) => {
                    let dev = p.var.device();
                    self.moments.insert(p.name.clone(), (m.to_device(dev)?, v.to_device(dev)?));
                }
                (None, None) => {}
                _ => return Err(Error::Invalid(format!("optimizer state for `{}` is incomplete", p.name))),
            }
        }
        Ok(())
    }
}

/// Warm-up optimizer steps: `warmup_steps`, or (when 0) `warmup_ratio` of
/// all `total` steps, rounded up.
pub fn warmup_steps(warmup_steps: usize, warmup_ratio: f64, total: usize) -> usize {
    match warmup_steps {
        0 => (warmup_ratio * total as f64).ceil() as usize,
        n => n,
    }
}

/// Learning rate at optimizer step `step` (0-based) of `total`: linear
/// warm-up from 0, then constant, linear decay to 0, or cosine decay to 0
/// (the transformers schedules of the same names).
pub fn learning_rate(base: f64, schedule: Schedule, step: usize, total: usize, warmup: usize) -> f64 {
    if step < warmup {
        return base * step as f64 / warmup.max(1) as f64;
    }
    let progress = (step - warmup) as f64 / (total.saturating_sub(warmup)).max(1) as f64;
    match schedule {
        Schedule::Constant => base,
        Schedule::Linear => base * (1.0 - progress).max(0.0),
        Schedule::Cosine => base * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adamw_matches_pytorch_on_a_hand_computed_step() {
        // One step with g = 0.5 on w = 1.0: m = 0.05, v = 0.00025, corrected
        // m = 0.5, v = 0.25 -> w -= lr * 0.5 / (0.5 + eps); decay first.
        let var = Var::new(&[1.0f32], &Device::Cpu).unwrap();
        let store = ParamStore::from_vars(vec![("layer.weight".into(), var.clone())]);
        let mut acc = GradAccumulator::default();
        let loss = (var.as_tensor() * 0.5).unwrap().sum_all().unwrap();
        acc.add(&store, &loss.backward().unwrap()).unwrap();
        let mut opt = AdamW::new(0.9, 0.999, 1e-8, 0.1);
        opt.step(&store, &acc, 0.01).unwrap();
        let want = 1.0 * (1.0 - 0.01 * 0.1) - 0.01 * 0.5 / (0.5 + 1e-8);
        let got = var.as_tensor().to_vec1::<f32>().unwrap()[0] as f64;
        assert!((got - want).abs() < 1e-7, "{got} vs {want}");
    }

    /// Over three micro-batches, a bf16 compute copy that is a variable of
    /// its own (its gradient added into the f32 sum by `add_cast`) gives
    /// the sums that a copy derived from the master in the graph gave (its
    /// backward casting the gradient up, then the sums adding), to the
    /// bit; the weight is used twice, so its gradient first sums in bf16.
    #[test]
    fn a_compute_copy_of_its_own_sums_gradients_as_the_cast_in_the_graph_did() {
        let dev = Device::Cpu;
        let mut rng = crate::rng::Rng::new(3);
        let mut randn = |n: usize| Tensor::from_vec((0..n).map(|_| rng.normal() as f32).collect(), n, &dev).unwrap();
        let w = randn(64);
        let inputs: Vec<Tensor> = (0..3).map(|_| randn(64).to_dtype(DType::BF16).unwrap()).collect();
        let loss = |w: &Tensor, x: &Tensor| -> Tensor {
            let y = (w * x).unwrap().tanh().unwrap();
            ((&y * w).unwrap() + y).unwrap().to_dtype(DType::F32).unwrap().sum_all().unwrap()
        };
        // As the graph had it: the copy made from the master, summed with `+`.
        let master = Var::from_tensor(&w).unwrap();
        let mut want: Option<Tensor> = None;
        for x in &inputs {
            let grads = loss(&master.to_dtype(DType::BF16).unwrap(), x).backward().unwrap();
            let g = grads.get(&master).unwrap().clone();
            want = Some(match want {
                Some(sum) => (sum + g).unwrap(),
                None => g,
            });
        }
        // As the store has it now.
        let mut store = ParamStore::from_vars(vec![("w".into(), Var::from_tensor(&w).unwrap())]);
        store.set_compute_dtype(DType::BF16, true).unwrap();
        let mut acc = GradAccumulator::default();
        let p = store.iter().next().unwrap();
        for x in &inputs {
            acc.add(&store, &loss(p.compute(), x).backward().unwrap()).unwrap();
        }
        let bits = |t: &Tensor| t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let got = acc.get(&p.var).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        assert_eq!(bits(got), bits(&want.unwrap()));
    }

    /// Parameters whose first gradients share storage (an addition's
    /// backward hands one gradient to both inputs) sum apart, to the bit:
    /// the sums add in place only once the accumulator made them (the third
    /// micro-batch's sum is the second's tensor, written over).
    #[test]
    fn sums_add_in_place_only_where_no_gradient_shares_them() {
        let dev = Device::Cpu;
        let (a, b) = (Var::new(&[1f32, 2., 3.], &dev).unwrap(), Var::new(&[4f32, 5., 6.], &dev).unwrap());
        let store = ParamStore::from_vars(vec![("a".into(), a.clone()), ("b".into(), b.clone())]);
        let xs = [[0.5f32, -1., 2.], [0.25, 3., -0.75], [1.5, 0.125, 4.]];
        let mut acc = GradAccumulator::default();
        let mut ids = Vec::new();
        for x in &xs {
            let x = Tensor::new(x, &dev).unwrap();
            let loss = ((a.as_tensor() + b.as_tensor()).unwrap() * x).unwrap().sum_all().unwrap();
            acc.add(&store, &loss.backward().unwrap()).unwrap();
            ids.push(acc.get(&a).unwrap().id());
        }
        let want: Vec<f32> = (0..3).map(|i| xs[0][i] + xs[1][i] + xs[2][i]).collect();
        for var in [&a, &b] {
            assert_eq!(acc.get(var).unwrap().to_vec1::<f32>().unwrap(), want);
        }
        assert_eq!((ids[0] == ids[1], ids[1] == ids[2]), (false, true));
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let var = Var::new(&[3.0f32, 4.0], &Device::Cpu).unwrap();
        let store = ParamStore::from_vars(vec![("w".into(), var.clone())]);
        let mut acc = GradAccumulator::default();
        let loss = (var.as_tensor().sqr().unwrap() * 0.5).unwrap().sum_all().unwrap(); // grad = w
        acc.add(&store, &loss.backward().unwrap()).unwrap();
        assert!((acc.clip(1.0).unwrap() - 5.0).abs() < 1e-6);
        assert!((acc.norm().unwrap() - 1.0).abs() < 1e-5);
    }

    /// Clipping scales a sum the accumulator made in place, and replaces
    /// one that is the backward's own tensor: two parameters whose first
    /// gradients share storage are each scaled once, to candle's product's
    /// bits, whether one micro-batch ran or two.
    #[test]
    fn clipping_scales_each_sum_once_in_place_where_it_owns_it() {
        let dev = Device::Cpu;
        let (a, b) = (Var::new(&[1f32, 2., 3.], &dev).unwrap(), Var::new(&[4f32, 5., 6.], &dev).unwrap());
        let store = ParamStore::from_vars(vec![("a".into(), a.clone()), ("b".into(), b.clone())]);
        let bits = |t: &Tensor| t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for batches in [1, 2] {
            let mut acc = GradAccumulator::default();
            for x in [[0.7f32, -1.3, 2.9], [0.3, 3.1, -0.7]].iter().take(batches) {
                let x = Tensor::new(x, &dev).unwrap();
                let loss = ((a.as_tensor() + b.as_tensor()).unwrap() * x).unwrap().sum_all().unwrap();
                acc.add(&store, &loss.backward().unwrap()).unwrap();
            }
            let (sum, id) = (acc.get(&a).unwrap().copy().unwrap(), acc.get(&a).unwrap().id());
            let norm = acc.clip(0.5).unwrap();
            let want = bits(&(&sum * (0.5 / (norm + 1e-6))).unwrap());
            for var in [&a, &b] {
                assert_eq!(bits(acc.get(var).unwrap()), want, "{batches} micro-batches");
            }
            assert_eq!(acc.get(&a).unwrap().id() == id, batches == 2, "{batches} micro-batches");
        }
    }

    #[test]
    fn the_guard_skips_non_finite_steps_and_gives_up_after_the_limit() {
        let mut g = StepGuard::new(2);
        assert!(g.check(0, 1.0, 0.5));
        assert!(!g.check(1, f64::NAN, 0.5));
        assert!(!g.exhausted());
        assert!(g.check(2, 1.0, 0.5), "a good step resets the count");
        assert!(!g.check(3, 1.0, f64::INFINITY));
        assert!(!g.check(4, f64::NAN, f64::NAN));
        assert!(g.exhausted());
        assert_eq!(g.describe(), "2 optimizer steps in a row were skipped (the last: loss NaN, gradient norm NaN)");
    }

    #[test]
    fn weight_decay_skips_biases_and_norms() {
        assert!(decays("model.layers.0.mlp.up_proj.weight"));
        assert!(!decays("model.layers.0.self_attn.q_proj.bias"));
        assert!(!decays("model.layers.0.input_layernorm.weight"));
        assert!(!decays("transformer.h.0.ln_1.weight"));
        assert!(!decays("model.norm.weight"));
    }

    #[test]
    fn schedules() {
        assert_eq!(learning_rate(1.0, Schedule::Linear, 0, 10, 2), 0.0);
        assert_eq!(learning_rate(1.0, Schedule::Linear, 1, 10, 2), 0.5);
        assert_eq!(learning_rate(1.0, Schedule::Linear, 2, 10, 2), 1.0);
        assert!((learning_rate(1.0, Schedule::Linear, 6, 10, 2) - 0.5).abs() < 1e-12);
        assert!((learning_rate(1.0, Schedule::Cosine, 6, 10, 2) - 0.5).abs() < 1e-12);
        assert_eq!(learning_rate(1.0, Schedule::Constant, 9, 10, 2), 1.0);
    }
}
