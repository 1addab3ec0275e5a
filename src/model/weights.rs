//! Weights: reading safetensors checkpoints (single file or sharded with an
//! index) into trainable f32 variables, and handing them to the
//! architectures by their Hugging Face names with shape checks.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Shape, Tensor, Var};
use serde::Deserialize;

use super::kernels::SplitMaster;
use super::lora::{adapter_names, Adapter, AdapterPlan};
use crate::error::{read_json, Error, Result};
use crate::rng::Rng;

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The safetensors files of one model directory, memory-mapped.
pub struct WeightFiles {
    files: MmapedSafetensors,
    /// Which file holds each tensor (for error messages).
    location: HashMap<String, PathBuf>,
    pub dir: PathBuf,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: BTreeMap<String, String>,
}

impl WeightFiles {
    /// Opens `model.safetensors`, or the shards named by `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(SINGLE_FILE);
        let index = dir.join(INDEX_FILE);
        let paths: Vec<PathBuf> = if single.is_file() {
            vec![single]
        } else if index.is_file() {
            let idx: ShardIndex = read_json(&index)?;
            let shards: BTreeSet<&String> = idx.weight_map.values().collect();
            if shards.is_empty() {
                return Err(Error::bad_file(&index, "weight_map is empty"));
            }
            shards.into_iter().map(|s| dir.join(s)).collect()
        } else {
            return Err(Error::bad_file(
                dir,
                format!("no weights: expected {SINGLE_FILE} or {INDEX_FILE} (only safetensors is read)"),
            ));
        };
        for p in &paths {
            if !p.is_file() {
                return Err(Error::bad_file(p, "shard listed in the index is missing"));
            }
        }
        Self::from_paths(dir, &paths)
    }

    /// Opens a PEFT adapter's `adapter_model.safetensors`.
    pub fn open_adapter(dir: &Path) -> Result<Self> {
        let path = dir.join(super::lora::ADAPTER_WEIGHTS);
        if !path.is_file() {
            return Err(Error::bad_file(
                dir,
                format!("no adapter weights: {} is missing", super::lora::ADAPTER_WEIGHTS),
            ));
        }
        Self::from_paths(dir, &[path])
    }

    fn from_paths(dir: &Path, paths: &[PathBuf]) -> Result<Self> {
        // Safety: the files are mapped read-only; rloo never writes into a
        // directory while it has it mapped (saves go to a temp dir + rename).
        let files = unsafe { MmapedSafetensors::multi(paths) }
            .map_err(|e| Error::bad_file(dir, format!("cannot read safetensors weights: {e}")))?;
        let mut location = HashMap::new();
        for p in paths {
            let one = unsafe { MmapedSafetensors::new(p) }
                .map_err(|e| Error::bad_file(p, format!("corrupt safetensors file: {e}")))?;
            for (name, _) in one.tensors() {
                location.insert(name, p.clone());
            }
        }
        Ok(Self { files, location, dir: dir.to_path_buf() })
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.location.keys()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.location.contains_key(name)
    }

    /// The stored shape and dtype of a tensor.
    pub fn info(&self, name: &str) -> Result<(Vec<usize>, DType)> {
        let view = self.files.get(name).map_err(|e| self.read_error(name, e))?;
        let dtype = view_dtype(view.dtype()).ok_or_else(|| Error::Weights {
            msg: format!("{}: tensor `{name}` has unsupported dtype {:?}", self.where_is(name), view.dtype()),
        })?;
        Ok((view.shape().to_vec(), dtype))
    }

    /// Loads a tensor as f32 on `device`.
    pub fn load_f32(&self, name: &str, device: &Device) -> Result<Tensor> {
        self.load_keeping(name, device, DType::F32)
    }

    /// Loads a tensor on `device`: as it is stored when that is `keep`,
    /// else as f32.
    fn load_keeping(&self, name: &str, device: &Device, keep: DType) -> Result<Tensor> {
        let t = self.files.load(name, device).map_err(|e| self.read_error(name, e))?;
        Ok(if t.dtype() == keep { t } else { t.to_dtype(DType::F32)? })
    }

    fn where_is(&self, name: &str) -> String {
        self.location.get(name).unwrap_or(&self.dir).display().to_string()
    }

    fn read_error(&self, name: &str, e: candle_core::Error) -> Error {
        Error::Weights { msg: format!("{}: cannot read tensor `{name}`: {e}", self.where_is(name)) }
    }
}

fn view_dtype(d: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype as S;
    Some(match d {
        S::F32 => DType::F32,
        S::F16 => DType::F16,
        S::BF16 => DType::BF16,
        S::F64 => DType::F64,
        _ => return None,
    })
}

/// One tensor of a model: the f32 master copy and the dtype it was stored
/// in, which is the dtype it is saved back in.
#[derive(Clone)]
pub struct Param {
    pub name: String,
    /// The master copy: f32, or the compute dtype for a weight that never
    /// trains in a model computing in a narrower dtype.
    pub var: Var,
    pub stored_dtype: DType,
    /// A base weight under LoRA adapters: it gets no gradient and no
    /// optimizer state, and an adapter save leaves it out.
    pub frozen: bool,
    /// The copy the networks compute with when it differs from the master
    /// (bf16 compute): a variable of its own, whose gradient a backward
    /// gives in its dtype, to be added into the master's f32 sum in one
    /// pass (`kernels::add_cast`); refreshed in place after every
    /// optimizer step.
    compute: Option<Var>,
    /// With split masters (bf16, `RLOO_MASTERS=split`, the default), `var`
    /// is the bf16 copy the networks compute with, and this the rest of its
    /// f32 master.
    split: Option<SplitMaster>,
}

impl Param {
    /// A parameter that trains, saved back as `stored_dtype`.
    fn new(name: &str, var: Var, stored_dtype: DType) -> Self {
        Self { name: name.to_string(), var, stored_dtype, frozen: false, compute: None, split: None }
    }

    /// The tensor the networks compute with, and that a backward gives the
    /// parameter's gradient for.
    pub fn compute(&self) -> &Tensor {
        self.compute.as_ref().unwrap_or(&self.var).as_tensor()
    }

    /// The master's values, joined from its parts where it is split.
    pub fn master(&self) -> Result<Tensor> {
        match &self.split {
            Some(split) => Ok(split.join(self.var.as_tensor())?),
            None => Ok(self.var.as_tensor().clone()),
        }
    }

    /// The master's values in `dtype`: a split master's bf16 rounding is its copy.
    pub fn master_in(&self, dtype: DType) -> Result<Tensor> {
        match &self.split {
            Some(_) if dtype == self.var.dtype() => Ok(self.var.as_tensor().clone()),
            _ => Ok(self.master()?.to_dtype(dtype)?),
        }
    }

    /// The master's dtype: its gradients are summed and its moments kept in it.
    pub fn master_dtype(&self) -> DType {
        if self.split.is_some() {
            DType::F32
        } else {
            self.var.dtype()
        }
    }

    /// Sets the master to `value` (cast to its dtype), in place; a whole
    /// master's compute copy follows at the next [`ParamStore::sync_compute`],
    /// a split one's at once.
    pub fn set_master(&self, value: &Tensor) -> Result<()> {
        match &self.split {
            Some(split) => Ok(split.set(&self.var, value)?),
            None => Ok(self.var.set(&value.to_dtype(self.var.dtype())?)?),
        }
    }

    /// The split master's parts beside the compute copy, if split.
    pub fn split(&self) -> Option<&SplitMaster> {
        self.split.as_ref()
    }
}

/// The parameters of a model, in the order the architecture asked for them.
#[derive(Clone, Default)]
pub struct ParamStore {
    params: Vec<Param>,
    index: HashMap<String, usize>,
}

impl ParamStore {
    pub fn iter(&self) -> impl Iterator<Item = &Param> {
        self.params.iter()
    }
    pub fn len(&self) -> usize {
        self.params.len()
    }
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }
    pub fn get(&self, name: &str) -> Option<&Param> {
        self.index.get(name).map(|&i| &self.params[i])
    }
    pub fn vars(&self) -> Vec<Var> {
        self.params.iter().map(|p| p.var.clone()).collect()
    }
    /// Total number of scalar parameters.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.var.elem_count()).sum()
    }
    /// A store of f32 variables that were not read from a checkpoint.
    pub fn from_vars(vars: Vec<(String, Var)>) -> Self {
        let mut store = Self::default();
        for (name, var) in vars {
            store.push(Param::new(&name, var, DType::F32));
        }
        store
    }

    /// Freezes every parameter but those `trains` accepts.
    pub fn freeze_all_but(&mut self, trains: impl Fn(&str) -> bool) {
        for p in &mut self.params {
            p.frozen = !trains(&p.name);
        }
    }

    /// The parameters that train.
    pub fn trainable(&self) -> impl Iterator<Item = &Param> {
        self.params.iter().filter(|p| !p.frozen)
    }

    /// A short digest of every parameter's name, shape and values (their
    /// sum and sum of squares, reduced where they live), to tell whether two
    /// processes hold the same weights without moving them.
    pub fn fingerprint(&self) -> Result<String> {
        let mut text = String::new();
        for p in &self.params {
            let t = p.master()?.to_dtype(DType::F32)?;
            let sum = t.sum_all()?.to_scalar::<f32>()?;
            let sq = t.sqr()?.sum_all()?.to_scalar::<f32>()?;
            text.push_str(&format!("{} {:?} {sum:e} {sq:e}\n", p.name, t.dims()));
        }
        Ok(crate::data::byte_digest(text.as_bytes()))
    }

    /// Number of scalar parameters that train.
    pub fn trainable_numel(&self) -> usize {
        self.trainable().map(|p| p.var.elem_count()).sum()
    }

    /// Makes the networks built on this store compute in `dtype`. A
    /// parameter that trains keeps its f32 master: in bf16 by default as the
    /// copy the networks compute with and the master's rest, else whole
    /// (`RLOO_MASTERS=f32`) beside a compute copy derived from it; the
    /// others (frozen, or every one when `trains` is false) are converted in
    /// place: nothing updates them, so a master would only take memory.
    pub fn set_compute_dtype(&mut self, dtype: DType, trains: bool) -> Result<()> {
        let split = crate::model::kernels::masters_split(dtype)?;
        for p in &mut self.params {
            if trains && !p.frozen {
                let master = match (&p.split, p.var.dtype()) {
                    (None, DType::F32) => p.var.clone(),
                    _ => Var::from_tensor(&p.master()?.to_dtype(DType::F32)?)?,
                };
                if split {
                    let (copy, rest) = SplitMaster::split(master.as_tensor())?;
                    (p.var, p.compute, p.split) = (Var::from_tensor(&copy)?, None, Some(rest));
                    continue;
                }
                p.compute = match dtype {
                    DType::F32 => None,
                    _ => Some(Var::from_tensor(&master.to_dtype(dtype)?.detach())?),
                };
                (p.var, p.split) = (master, None);
            } else if p.var.dtype() != dtype || p.compute.is_some() || p.split.is_some() {
                p.var = Var::from_tensor(&p.compute().to_dtype(dtype)?.detach())?;
                (p.compute, p.split) = (None, None);
            }
        }
        Ok(())
    }

    /// Whether every parameter already is as [`Self::set_compute_dtype`]
    /// leaves it: computing in `dtype`, with an f32 master (whole or
    /// split) where it trains (`trains`) in another dtype, and none elsewhere.
    pub fn computes_in(&self, dtype: DType, trains: bool) -> Result<bool> {
        let split = crate::model::kernels::masters_split(dtype)?;
        Ok(self.params.iter().all(|p| {
            let master = trains && !p.frozen && dtype != DType::F32;
            match (&p.compute, &p.split) {
                (Some(copy), None) => master && !split && copy.dtype() == dtype && p.var.dtype() == DType::F32,
                (None, Some(_)) => master && split && p.var.dtype() == dtype,
                (None, None) => !master && p.var.dtype() == dtype,
                (Some(_), Some(_)) => false,
            }
        }))
    }

    /// The dtype the networks compute in.
    pub fn compute_dtype(&self) -> DType {
        self.params.iter().find(|p| !p.frozen).or(self.params.first()).map_or(DType::F32, |p| p.compute().dtype())
    }

    /// Copies the masters into the compute copies, in place, so the
    /// networks built on them see the optimizer's update (a split master's
    /// copy is its own top half, which the update wrote).
    pub fn sync_compute(&self) -> Result<()> {
        for p in &self.params {
            if let Some(copy) = &p.compute {
                super::kernels::cast_into(copy, &p.var)?;
            }
        }
        Ok(())
    }

    fn push(&mut self, param: Param) {
        self.index.insert(param.name.clone(), self.params.len());
        self.params.push(param);
    }
}

/// Where an architecture's constructor gets its tensors: from checkpoint
/// files (creating the variables) or from an existing store (sharing them,
/// optionally detached so that no autograd graph is recorded).
pub enum Source<'a> {
    Files {
        files: &'a WeightFiles,
        device: Device,
        /// Tensors stored in this dtype are kept in it (a bf16 run reading
        /// bf16 weights never holds an f32 copy of them all); the others
        /// are widened to f32.
        keep: DType,
        store: RefCell<ParamStore>,
    },
    Store {
        store: &'a ParamStore,
        detach: Detach,
        used: RefCell<BTreeSet<String>>,
    },
    /// Fresh weights, as transformers' `_init_weights` makes them: normal(0,
    /// std) for matrices and embeddings, ones for norm weights, zeros for biases.
    Random {
        device: Device,
        std: f64,
        rng: RefCell<Rng>,
        store: RefCell<ParamStore>,
    },
}

/// Which of a store's parameters a network sees detached (no autograd graph).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detach {
    /// All: a network for sampling and scoring.
    All,
    /// The frozen ones: a training network whose gradients reach only
    /// what trains.
    Frozen,
}

/// A view on a [`Source`] under a name prefix, like walking the HF module
/// tree (`w.pp("layers").pp(0).get("attention.dense.weight", ..)`).
#[derive(Clone)]
pub struct Weights<'a> {
    source: &'a Source<'a>,
    prefix: String,
    /// LoRA adapters to attach to the dense layers it names.
    plan: Option<&'a AdapterPlan>,
}

impl<'a> Source<'a> {
    /// Tensors stored in `keep` are read as they are, the others as f32.
    pub fn files(files: &'a WeightFiles, device: &Device, keep: DType) -> Self {
        Source::Files { files, device: device.clone(), keep, store: RefCell::new(ParamStore::default()) }
    }

    pub fn store(store: &'a ParamStore, detach: Detach) -> Self {
        Source::Store { store, detach, used: RefCell::new(BTreeSet::new()) }
    }

    pub fn random(device: &Device, std: f64, seed: u64) -> Self {
        Source::Random {
            device: device.clone(),
            std,
            rng: RefCell::new(Rng::stream(seed, &[crate::rng::streams::WEIGHT_INIT])),
            store: RefCell::new(ParamStore::default()),
        }
    }

    pub fn root(&'a self) -> Weights<'a> {
        self.root_with(None)
    }

    /// The root, attaching the adapters of `plan` (none: the base network).
    pub fn root_with(&'a self, plan: Option<&'a AdapterPlan>) -> Weights<'a> {
        Weights { source: self, prefix: String::new(), plan }
    }

    /// Adds a parameter the checkpoint lacks (a new head), trained and saved as f32.
    pub fn add_fresh(&self, name: &str, init: &Tensor) -> Result<()> {
        match self {
            Source::Files { store, .. } => {
                let var = Var::from_tensor(&init.to_dtype(DType::F32)?)?;
                store.borrow_mut().push(Param::new(name, var, DType::F32));
                Ok(())
            }
            _ => Err(Error::Invalid(format!("`{name}` can only be added to a model read from files"))),
        }
    }

    /// The tensor `name`, or, when the source has none and makes
    /// parameters, a new f32 one `init` gives on the source's device.
    fn get_or_add(
        &self,
        name: &str,
        shape: (usize, usize),
        init: impl FnOnce(&Device) -> Result<Tensor>,
    ) -> Result<Tensor> {
        match self {
            Source::Files { device, store, .. } | Source::Random { device, store, .. } if !self.has_stored(name) => {
                let var = Var::from_tensor(&init(device)?)?;
                let tensor = var.as_tensor().clone();
                store.borrow_mut().push(Param::new(name, var, DType::F32));
                Ok(tensor)
            }
            _ => self.get(name, &Shape::from(shape)),
        }
    }

    /// Whether the source holds `name` already (random sources make any name).
    fn has_stored(&self, name: &str) -> bool {
        match self {
            Source::Random { store, .. } => store.borrow().get(name).is_some(),
            _ => self.has(name),
        }
    }

    /// The parameters created from files (empty for a store source).
    pub fn into_store(self) -> ParamStore {
        match self {
            Source::Files { store, .. } | Source::Random { store, .. } => store.into_inner(),
            Source::Store { .. } => ParamStore::default(),
        }
    }

    fn has(&self, name: &str) -> bool {
        match self {
            Source::Files { files, store, .. } => files.contains(name) || store.borrow().get(name).is_some(),
            Source::Store { store, .. } => store.get(name).is_some(),
            // Every tensor an architecture asks for can be made.
            Source::Random { .. } => true,
        }
    }

    fn get(&self, name: &str, shape: &Shape) -> Result<Tensor> {
        match self {
            Source::Random { device, std, rng, store } => {
                if let Some(p) = store.borrow().get(name) {
                    return Ok(p.var.as_tensor().clone());
                }
                let n = shape.elem_count();
                let leaf = name.rsplit('.').nth(1).unwrap_or("");
                let values: Vec<f32> = if name.ends_with(".bias") {
                    vec![0.0; n]
                } else if shape.rank() == 1 && (leaf.contains("norm") || leaf.starts_with("ln_")) {
                    vec![1.0; n]
                } else {
                    let mut rng = rng.borrow_mut();
                    (0..n).map(|_| (rng.normal() * std) as f32).collect()
                };
                let var = Var::from_vec(values, shape.clone(), device)?;
                let tensor = var.as_tensor().clone();
                store.borrow_mut().push(Param::new(name, var, DType::F32));
                Ok(tensor)
            }
            Source::Files { files, device, keep, store } => {
                if let Some(p) = store.borrow().get(name) {
                    return Ok(p.var.as_tensor().clone());
                }
                if !files.contains(name) {
                    return Err(Error::Weights {
                        msg: format!("{}: missing tensor `{name}` (expected shape {shape:?})", files.dir.display()),
                    });
                }
                let (stored_shape, stored_dtype) = files.info(name)?;
                if stored_shape.as_slice() != shape.dims() {
                    return Err(Error::Weights {
                        msg: format!(
                            "{}: tensor `{name}` has shape {stored_shape:?}, expected {:?}",
                            files.where_is(name),
                            shape.dims()
                        ),
                    });
                }
                let loaded = files.load_keeping(name, device, *keep)?;
                if crate::model::kernels::any_non_finite(&loaded)? {
                    return Err(Error::Weights {
                        msg: format!(
                            "{}: tensor `{name}` holds NaN or infinite values (saved from a diverged run?)",
                            files.where_is(name)
                        ),
                    });
                }
                let var = Var::from_tensor(&loaded)?;
                let tensor = var.as_tensor().clone();
                store.borrow_mut().push(Param::new(name, var, stored_dtype));
                Ok(tensor)
            }
            Source::Store { store, detach, used } => {
                let p = store
                    .get(name)
                    .ok_or_else(|| Error::Weights { msg: format!("parameter `{name}` is not in the model") })?;
                if p.var.shape() != shape {
                    return Err(Error::Weights {
                        msg: format!("parameter `{name}` has shape {:?}, expected {:?}", p.var.dims(), shape.dims()),
                    });
                }
                used.borrow_mut().insert(name.to_string());
                let detached = *detach == Detach::All || p.frozen;
                Ok(if detached { p.compute().detach() } else { p.compute().clone() })
            }
        }
    }

    /// Checkpoint tensors no architecture asked for (buffers such as
    /// `attn.masked_bias` in old checkpoints, or another head's weights).
    pub fn unused(&self) -> Vec<String> {
        match self {
            Source::Files { files, store, .. } => {
                let store = store.borrow();
                let mut names: Vec<String> = files.names().filter(|n| store.get(n).is_none()).cloned().collect();
                names.sort();
                names
            }
            Source::Store { store, used, .. } => {
                let used = used.borrow();
                store.iter().filter(|p| !used.contains(&p.name)).map(|p| p.name.clone()).collect()
            }
            Source::Random { .. } => Vec::new(),
        }
    }
}

impl<'a> Weights<'a> {
    /// A view one level down the module tree.
    pub fn pp(&self, sub: impl std::fmt::Display) -> Weights<'a> {
        Weights { source: self.source, prefix: self.name(&sub.to_string()), plan: self.plan }
    }

    /// The LoRA adapter of the dense layer `module` (out, in) under this
    /// view, when the plan targets it: read from the source, or new.
    pub fn adapter(&self, module: &str, out_dim: usize, in_dim: usize) -> Result<Option<Adapter>> {
        let Some(plan) = self.plan else { return Ok(None) };
        let full = self.name(module);
        if !plan.config.targets(&full) {
            return Ok(None);
        }
        let r = plan.config.r;
        let (a, b) = adapter_names(&full);
        let a = self.source.get_or_add(&a, (r, in_dim), |device| plan.initial(&a, (r, in_dim), device))?;
        let b = self.source.get_or_add(&b, (out_dim, r), |device| plan.initial(&b, (out_dim, r), device))?;
        Ok(Some(Adapter { a, b, scale: plan.config.scale(), dropout: plan.dropout.clone() }))
    }

    pub fn name(&self, leaf: &str) -> String {
        if self.prefix.is_empty() {
            leaf.to_string()
        } else {
            format!("{}.{leaf}", self.prefix)
        }
    }

    /// The tensor `prefix.leaf`, which must exist with this shape.
    pub fn get(&self, leaf: &str, shape: impl Into<Shape>) -> Result<Tensor> {
        self.source.get(&self.name(leaf), &shape.into())
    }

    pub fn contains(&self, leaf: &str) -> bool {
        self.source.has(&self.name(leaf))
    }
}
