//! The CPU backend: one thread per virtual device running its stage's actions on f32 shards,
//! talking to the others through the in-process [`Fabric`].

use super::attention::zigzag_position;
use super::comm::{Endpoint, Fabric, Payload, Tag};
use super::kernels::{self, Group};
use super::lower::{Action, Init, Program, Role};
use super::placement::{Conversion, Placement, conversions, shard, slice};
use super::tensor::Tensor;
use super::{ExecError, RunOptions};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

/// Adam hyper-parameters of the synthetic training run.
const LR: f32 = 1e-3;
const BETA1: f32 = 0.9;
const BETA2: f32 = 0.95;
const ADAM_EPS: f32 = 1e-8;
/// Scale of random weights (GPT-2's initialiser standard deviation).
const WEIGHT_SCALE: f32 = 0.02;
/// Scale of the perturbation of gains and of biases.
const SMALL_SCALE: f32 = 0.1;

/// Where a device sits in the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Coord {
    /// Pipeline stage.
    pub pp: usize,
    /// Data-parallel replica.
    pub dp: usize,
    /// Index on its stage's mesh (axis 0 major; Megatron-LM's tensor-parallel rank).
    pub m: usize,
}

/// What one device measured and, when checking, what it computed.
#[derive(Debug, Default)]
pub struct DeviceReport {
    /// Sum of the losses of its micro-batches, per step (last stage, mesh index 0 only).
    pub loss_sums: Vec<f64>,
    /// Wall time of every step, s.
    pub step_times: Vec<f64>,
    /// Where the time of every step went.
    pub phases: Vec<Phases>,
    /// Local parameter gradients of the first step before any synchronisation (when
    /// checking).
    pub grads: Vec<HashMap<u32, Tensor>>,
    /// Local parameters after the first step (when checking).
    pub params: HashMap<u32, Tensor>,
}

/// Where one device's step time went, s.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Phases {
    /// Forward passes of every micro-batch.
    pub forward: f64,
    /// Backward passes.
    pub backward: f64,
    /// Sending, waiting for and reducing activations and gradients between devices.
    pub communication: f64,
    /// The optimizer update.
    pub optimizer: f64,
}

/// Devices in rank order: stage after stage, replica after replica within a stage, mesh index
/// fastest (Megatron-LM's order: tensor ranks, then data, then pipeline).
pub fn rank_of(prog: &Program, c: Coord) -> usize {
    let l = &prog.layout;
    let before: usize = (0..c.pp).map(|j| l.stage_devices(j)).sum();
    l.dp * before + c.dp * l.stage_devices(c.pp) + c.m
}

/// The coordinates of device `rank`.
pub fn coord_of(prog: &Program, rank: usize) -> Coord {
    let l = &prog.layout;
    let mut rest = rank;
    for pp in 0..l.pp {
        let n = l.stage_devices(pp);
        if rest < l.dp * n {
            return Coord {
                pp,
                dp: rest / n,
                m: rest % n,
            };
        }
        rest -= l.dp * n;
    }
    Coord { pp: 0, dp: 0, m: 0 }
}

/// Sequences `[b, s, ..]` stored in the load-balanced order of `cp` context-parallel ranks
/// (Megatron-Core's `get_batch_on_this_cp_rank`): storage index `j` holds position
/// [`zigzag_position`]`(j)`, so that a contiguous split gives rank `r` chunks `r` and
/// `2 cp - 1 - r`.
fn zigzag_order(t: &Tensor, cp: usize) -> Tensor {
    let s = t.shape[1];
    let inner: usize = t.shape[2..].iter().product();
    let mut data = Vec::with_capacity(t.len());
    for seq in t.data.chunks(s * inner) {
        for j in 0..s {
            let from = zigzag_position(j, s, cp) * inner;
            data.extend_from_slice(&seq[from..from + inner]);
        }
    }
    Tensor {
        shape: t.shape.clone(),
        data,
    }
}

/// The coordinates on `mesh` of mesh index `m` (axis 0 major).
pub fn mesh_coords(m: usize, mesh: &[usize]) -> Vec<usize> {
    let mut out = vec![0; mesh.len()];
    let mut rest = m;
    for a in (0..mesh.len()).rev() {
        out[a] = rest % mesh[a].max(1);
        rest /= mesh[a].max(1);
    }
    out
}

/// The mesh index of coordinates `at` on `mesh`.
fn mesh_index(at: &[usize], mesh: &[usize]) -> usize {
    at.iter().zip(mesh).fold(0, |i, (&c, &n)| i * n + c)
}

/// The group of a kernel communicating over mesh axes `axes` (ascending), from a device's
/// `groups`, and the device's index in it.
fn kernel_group<'g>(groups: &'g [(Vec<usize>, usize)], axes: &[usize]) -> (&'g [usize], usize) {
    let (group, index) = &groups[axes.iter().fold(0, |m, &a| m | 1 << a)];
    (group, *index)
}

/// The devices that differ from device `at` (mesh coordinates `coords`) only on the mesh axes
/// of bit mask `axes`, in the order of their combined index over those axes (major first), and
/// `at`'s index among them.
fn mesh_group(
    prog: &Program,
    at: Coord,
    mesh: &[usize],
    coords: &[usize],
    axes: usize,
) -> (Vec<usize>, usize) {
    let chosen: Vec<usize> = (0..mesh.len()).filter(|a| axes & (1 << a) != 0).collect();
    let size: usize = chosen.iter().map(|&a| mesh[a]).product();
    let mut c = coords.to_vec();
    let group = (0..size)
        .map(|k| {
            // Digit `a` of combined index `k`, the last chosen axis fastest.
            let mut rest = k;
            for &a in chosen.iter().rev() {
                c[a] = rest % mesh[a];
                rest /= mesh[a];
            }
            rank_of(
                prog,
                Coord {
                    m: mesh_index(&c, mesh),
                    ..at
                },
            )
        })
        .collect();
    let index = chosen.iter().fold(0, |i, &a| i * mesh[a] + coords[a]);
    (group, index)
}

/// A deterministic value in `[-1, 1)` from a seed and a position (splitmix64).
pub fn noise(parts: &[u64]) -> f32 {
    let mut z: u64 = 0x9e37_79b9_7f4a_7c15;
    for &p in parts {
        z = z.wrapping_add(p).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
    }
    ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

/// A token id (or label) below `bound` from a noise value `u` in `[-1, 1)`, stored as f32.
pub fn id_below(u: f32, bound: usize) -> f32 {
    (((u + 1.0) * 0.5 * bound as f32) as usize).min(bound.saturating_sub(1)) as f32
}

/// The whole initial value of parameter `value`.
pub fn initial_parameter(prog: &Program, seed: u64, value: u32) -> Tensor {
    let info = &prog.values[value as usize];
    let n: usize = info.shape.iter().product();
    let init = match info.role {
        Role::Parameter { init } => init,
        _ => Init::Weight,
    };
    let data = (0..n)
        .map(|i| {
            let u = noise(&[seed, 1, value as u64, i as u64]);
            match init {
                Init::Weight => u * WEIGHT_SCALE,
                Init::Gain => 1.0 + u * SMALL_SCALE,
                Init::Bias => u * SMALL_SCALE,
            }
        })
        .collect();
    Tensor {
        shape: info.shape.clone(),
        data,
    }
}

// Values are shared rather than copied between the environment, the parameters and what a
// backward keeps, as a framework's tensors are: only conversions and transfers copy.
struct Saved {
    env: HashMap<u32, Arc<Tensor>>,
    ctx: Vec<Option<StepCtx>>,
}

struct StepCtx {
    inputs: Vec<Arc<Tensor>>,
    outputs: Vec<Arc<Tensor>>,
    aux: Option<Tensor>,
}

/// A virtual device.
pub struct Device<'p> {
    prog: &'p Program,
    opts: &'p RunOptions,
    me: usize,
    at: Coord,
    ep: Endpoint,
    /// Its stage's logical mesh and its coordinates on it.
    mesh: Vec<usize>,
    coords: Vec<usize>,
    /// For every set of mesh axes (bit `a`: axis `a`), the devices that differ from this one
    /// only on those axes (combined major first) and this one's index among them: the group of
    /// a collective along one axis, or of a kernel communicating over several.
    groups: Vec<(Vec<usize>, usize)>,
    dp_group: Vec<usize>,
    params: HashMap<u32, Arc<Tensor>>,
    /// Master weights of the parameters whose optimizer states are placed apart from the
    /// weight (sharded further inside the mesh), in their states' placement.
    masters: HashMap<u32, Tensor>,
    grads: HashMap<u32, Tensor>,
    /// Adam's moments of this rank's range of the optimizer-state bucket.
    moments: Option<(Vec<f32>, Vec<f32>)>,
    /// This rank's range of the summed gradient bucket, between sync and update.
    reduced: Vec<f32>,
    updates: u32,
    saved: HashMap<(usize, usize), Saved>,
    inbox: HashMap<(usize, usize, Payload), HashMap<u32, Tensor>>,
    /// Input gradients of a (chunk, micro-batch) backward, until they are sent, named as the
    /// previous virtual stage names the values.
    outbox: HashMap<(usize, usize), Vec<(u32, Tensor)>>,
    report: DeviceReport,
}

struct KernelGroup<'a> {
    ep: &'a mut Endpoint,
    group: &'a [usize],
    rank: usize,
}

impl Group for KernelGroup<'_> {
    fn rank(&self) -> (usize, usize) {
        (self.rank, self.group.len())
    }
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), ExecError> {
        self.ep.all_reduce_sum(self.group, self.rank, data)
    }
    fn all_reduce_max(&mut self, data: &mut [f32]) -> Result<(), ExecError> {
        self.ep.all_reduce_max(self.group, self.rank, data)
    }
    fn shift(&mut self, data: Vec<f32>) -> Result<Vec<f32>, ExecError> {
        self.ep.shift(self.group, self.rank, data)
    }
}

impl<'p> Device<'p> {
    /// Device `me` of `prog`, with its parameters initialised.
    pub fn new(prog: &'p Program, opts: &'p RunOptions, me: usize, fabric: Arc<Fabric>) -> Self {
        let at = coord_of(prog, me);
        let l = &prog.layout;
        let mesh = l.mesh(at.pp);
        let coords = mesh_coords(at.m, &mesh);
        let groups = (0..1usize << mesh.len())
            .map(|axes| mesh_group(prog, at, &mesh, &coords, axes))
            .collect();
        let dp_group = (0..l.dp)
            .map(|d| rank_of(prog, Coord { dp: d, ..at }))
            .collect();
        let mut params = HashMap::new();
        let mut masters = HashMap::new();
        for code in prog.chunks.iter().filter(|c| c.stage == at.pp) {
            for &p in &code.parameters {
                if params.contains_key(&p) {
                    continue;
                }
                let whole = initial_parameter(prog, opts.seed, p);
                let info = &prog.values[p as usize];
                params.insert(p, Arc::new(shard(&whole, &info.placement, &coords, &mesh)));
                if let Some(sp) = info
                    .state_placement
                    .as_ref()
                    .filter(|sp| **sp != info.placement)
                {
                    masters.insert(p, shard(&whole, sp, &coords, &mesh));
                }
            }
        }
        Device {
            prog,
            opts,
            me,
            at,
            ep: Endpoint::new(fabric),
            mesh,
            coords,
            groups,
            dp_group,
            params,
            masters,
            grads: HashMap::new(),
            moments: None,
            reduced: Vec::new(),
            updates: 0,
            saved: HashMap::new(),
            inbox: HashMap::new(),
            outbox: HashMap::new(),
            report: DeviceReport::default(),
        }
    }

    /// Runs every step; returns what was measured.
    pub fn run(mut self) -> Result<DeviceReport, ExecError> {
        let actions = &self.prog.stages[self.at.pp];
        for step in 0..self.opts.steps {
            let start = Instant::now();
            let mut loss = 0.0f64;
            let mut phases = Phases::default();
            for &action in actions {
                let began = Instant::now();
                loss += self.act(action, step)?;
                let took = began.elapsed().as_secs_f64();
                *match action {
                    Action::Forward { .. } => &mut phases.forward,
                    Action::Backward { .. } => &mut phases.backward,
                    Action::OptimizerStep => &mut phases.optimizer,
                    _ => &mut phases.communication,
                } += took;
            }
            self.report.step_times.push(start.elapsed().as_secs_f64());
            self.report.phases.push(phases);
            self.report.loss_sums.push(loss);
            if self.opts.check && step == 0 {
                self.report.params = self
                    .params
                    .iter()
                    .map(|(&k, p)| (k, Tensor::clone(p)))
                    .collect();
            }
        }
        Ok(self.report)
    }

    fn act(&mut self, action: Action, step: usize) -> Result<f64, ExecError> {
        let prog = self.prog;
        match action {
            Action::RecvActivations { chunk, microbatch } => {
                let code = &prog.chunks[chunk];
                let whole = code.reshard;
                self.receive(
                    &code.recv_from,
                    &code.recv,
                    whole,
                    Payload::Activation,
                    chunk,
                    microbatch,
                )?;
            }
            Action::Forward { chunk, microbatch } => {
                return self.forward(chunk, microbatch, step);
            }
            Action::SendActivations { chunk, microbatch } => {
                let next = &prog.chunks[chunk + 1];
                let to = self.peers(chunk + 1, next.reshard);
                let saved = self.saved.get(&(chunk, microbatch));
                let mut out = Vec::new();
                for &v in &prog.chunks[chunk].send {
                    let t = saved
                        .and_then(|s| s.env.get(&v))
                        .map(|t| Tensor::clone(t))
                        .ok_or_else(|| missing(v, prog))?;
                    out.push((v, t));
                }
                for (v, t) in out {
                    let t = if next.reshard { self.whole(t, v)? } else { t };
                    for &r in &to {
                        let tag = self.tag(r, Payload::Activation, chunk + 1, microbatch, v);
                        self.ep.fabric.send(tag, t.clone());
                    }
                }
            }
            Action::RecvGradients { chunk, microbatch } => {
                // The gradients of what this chunk sent forward.
                let values = &prog.chunks[chunk].send;
                let whole = prog.chunks[chunk + 1].reshard;
                self.receive(values, values, whole, Payload::Gradient, chunk, microbatch)?;
            }
            Action::Backward { chunk, microbatch } => self.backward(chunk, microbatch)?,
            Action::SendGradients { chunk, microbatch } => {
                let to = self.peers(chunk - 1, prog.chunks[chunk].reshard);
                let grads = self.outbox.remove(&(chunk, microbatch)).unwrap_or_default();
                for (v, g) in grads {
                    for &r in &to {
                        let tag = self.tag(r, Payload::Gradient, chunk - 1, microbatch, v);
                        self.ep.fabric.send(tag, g.clone());
                    }
                }
            }
            Action::SyncTied => {
                if self.opts.check && self.report.grads.is_empty() {
                    self.report.grads.push(self.grads.clone());
                }
                self.sync_tied()?;
            }
            Action::SyncGradients => self.sync_gradients()?,
            Action::OptimizerStep => self.optimizer_step()?,
        }
        Ok(0.0)
    }

    /// Receives `payload` of the values named `tags` by the sender for a micro-batch of a
    /// chunk into the inbox, as `names`; `whole` values are cut to this device's placement.
    fn receive(
        &mut self,
        tags: &[u32],
        names: &[u32],
        whole: bool,
        payload: Payload,
        chunk: usize,
        microbatch: usize,
    ) -> Result<(), ExecError> {
        let mut got = HashMap::new();
        for (&t, &v) in tags.iter().zip(names) {
            let tag = self.tag(self.me, payload, chunk, microbatch, t);
            let mut x = self.ep.fabric.recv(tag)?;
            if whole {
                x = shard(
                    &x,
                    &self.prog.values[v as usize].placement,
                    &self.coords,
                    &self.mesh,
                );
            }
            got.insert(v, x);
        }
        self.inbox.insert((chunk, microbatch, payload), got);
        Ok(())
    }

    fn tag(&self, to: usize, payload: Payload, chunk: usize, microbatch: usize, value: u32) -> Tag {
        Tag {
            to,
            payload,
            chunk,
            microbatch,
            value,
        }
    }

    /// The devices of virtual stage `chunk` (this device's replica) that this one sends to:
    /// the device of its own mesh index, or, across a change of mesh (`whole` values), every
    /// device whose index is this one's modulo this mesh's size, so that each receives once.
    fn peers(&self, chunk: usize, whole: bool) -> Vec<usize> {
        let l = &self.prog.layout;
        let pp = chunk % l.pp;
        if !whole {
            return vec![rank_of(self.prog, Coord { pp, ..self.at })];
        }
        let mine = self.mesh.iter().product::<usize>().max(1);
        (0..l.stage_devices(pp))
            .filter(|m| m % mine == self.at.m)
            .map(|m| rank_of(self.prog, Coord { pp, m, ..self.at }))
            .collect()
    }

    /// The whole of value `v` (this device's piece gathered over its mesh).
    fn whole(&mut self, t: Tensor, v: u32) -> Result<Tensor, ExecError> {
        let from = &self.prog.values[v as usize].placement;
        let convs = conversions(from, &Placement::replicated(self.mesh.len()), &self.mesh)
            .ok_or_else(|| missing(v, self.prog))?;
        self.convert(t, &convs)
    }

    fn input(&self, v: u32, microbatch: usize, step: usize) -> Tensor {
        let info = &self.prog.values[v as usize];
        let l = &self.prog.layout;
        let mb = self.prog.micro_batch;
        let per_seq: usize = info.shape[1..].iter().product();
        let mut data = Vec::with_capacity(mb * per_seq);
        for i in 0..mb {
            let seq = ((self.at.dp * l.microbatches + microbatch) * mb + i) as u64;
            for e in 0..per_seq {
                let u = noise(&[self.opts.seed, 2, step as u64, v as u64, seq, e as u64]);
                data.push(match info.role {
                    Role::Input { bound: Some(b) } => id_below(u, b),
                    _ => u,
                });
            }
        }
        let mut whole = Tensor {
            shape: info.shape.clone(),
            data,
        };
        if l.cp > 1 && info.shape.len() >= 2 {
            whole = zigzag_order(&whole, l.cp);
        }
        shard(&whole, &info.placement, &self.coords, &self.mesh)
    }

    /// [`Self::convert`] of a shared value: shared further when nothing converts it.
    fn convert_shared(
        &mut self,
        t: Arc<Tensor>,
        convs: &[Conversion],
    ) -> Result<Arc<Tensor>, ExecError> {
        if convs.is_empty() {
            return Ok(t);
        }
        let owned = Arc::unwrap_or_clone(t);
        Ok(Arc::new(self.convert(owned, convs)?))
    }

    fn convert(&mut self, mut t: Tensor, convs: &[Conversion]) -> Result<Tensor, ExecError> {
        let bad = || ExecError::Lower("a conversion along a mesh axis the stage lacks".into());
        for c in convs {
            let (group, rank) = self.groups.get(c.mask()).ok_or_else(bad)?;
            let (group, rank) = (group.as_slice(), *rank);
            let n = group.len();
            t = match c {
                Conversion::Slice {
                    to: super::placement::State::Split { axis, parts },
                    ..
                } => slice(&t, *axis, parts, rank, n),
                Conversion::AllGather {
                    from: super::placement::State::Split { axis, parts },
                    ..
                } => self.ep.all_gather(group, rank, t, *axis, parts)?,
                Conversion::AllReduce { .. } => {
                    self.ep.all_reduce_sum(group, rank, &mut t.data)?;
                    t
                }
                Conversion::ReduceScatter {
                    to: super::placement::State::Split { axis, parts },
                    ..
                } => {
                    self.ep.all_reduce_sum(group, rank, &mut t.data)?;
                    slice(&t, *axis, parts, rank, n)
                }
                Conversion::AllToAll {
                    from: super::placement::State::Split { axis, parts },
                    to:
                        super::placement::State::Split {
                            axis: to_axis,
                            parts: to_parts,
                        },
                    ..
                } => self
                    .ep
                    .all_to_all(group, rank, t, (*axis, parts), (*to_axis, to_parts))?,
                _ => return Err(ExecError::Lower(format!("malformed conversion {c:?}"))),
            };
        }
        Ok(t)
    }

    fn forward(&mut self, chunk: usize, microbatch: usize, step: usize) -> Result<f64, ExecError> {
        let prog = self.prog;
        let code = &prog.chunks[chunk];
        let mut env: HashMap<u32, Arc<Tensor>> = self
            .inbox
            .remove(&(chunk, microbatch, Payload::Activation))
            .unwrap_or_default()
            .into_iter()
            .map(|(v, t)| (v, Arc::new(t)))
            .collect();
        for &v in &code.inputs {
            env.insert(v, Arc::new(self.input(v, microbatch, step)));
        }
        let mut ctx = Vec::with_capacity(code.steps.len());
        for s in &code.steps {
            let mut inputs = Vec::with_capacity(s.inputs.len());
            for (&v, convs) in s.inputs.iter().zip(&s.before) {
                let t = env
                    .get(&v)
                    .or_else(|| self.params.get(&v))
                    .cloned()
                    .ok_or_else(|| missing(v, prog))?;
                inputs.push(self.convert_shared(t, convs)?);
            }
            let shapes: Vec<Vec<usize>> = s
                .outputs
                .iter()
                .zip(&s.out_states)
                .map(|(&o, st)| st.local_shape(&prog.values[o as usize].shape, &self.mesh))
                .collect();
            let refs: Vec<&Tensor> = inputs.iter().map(|t| &**t).collect();
            let (members, rank) = kernel_group(&self.groups, &s.kernel_axes);
            let mut group = KernelGroup {
                ep: &mut self.ep,
                group: members,
                rank,
            };
            let f = kernels::forward(&s.kernel, &refs, &shapes, &mut group)?;
            let outputs: Vec<Arc<Tensor>> = f.outputs.into_iter().map(Arc::new).collect();
            for ((&o, convs), t) in s.outputs.iter().zip(&s.after).zip(&outputs) {
                let placed = self.convert_shared(t.clone(), convs)?;
                env.insert(o, placed);
            }
            ctx.push(Some(StepCtx {
                inputs,
                outputs,
                aux: f.aux,
            }));
        }
        let mut loss = 0.0;
        if chunk + 1 == prog.chunks.len() && self.at.m == 0 {
            loss = env
                .get(&prog.loss)
                .and_then(|t| t.data.first())
                .copied()
                .unwrap_or(f32::NAN) as f64;
        }
        self.saved.insert((chunk, microbatch), Saved { env, ctx });
        Ok(loss)
    }

    fn backward(&mut self, chunk: usize, microbatch: usize) -> Result<(), ExecError> {
        let prog = self.prog;
        let code = &prog.chunks[chunk];
        let l = &prog.layout;
        let mut saved = self.saved.remove(&(chunk, microbatch)).ok_or_else(|| {
            ExecError::Lower(format!("backward of chunk {chunk} before its forward"))
        })?;
        let mut grads = self
            .inbox
            .remove(&(chunk, microbatch, Payload::Gradient))
            .unwrap_or_default();
        if chunk + 1 == prog.chunks.len() {
            // Mean over every micro-batch of every data-parallel replica.
            let scale = 1.0 / (l.microbatches * l.dp) as f32;
            grads.insert(
                prog.loss,
                Tensor {
                    shape: vec![1],
                    data: vec![scale],
                },
            );
        }
        for (si, s) in code.steps.iter().enumerate().rev() {
            let present: Vec<Option<Tensor>> = s.outputs.iter().map(|o| grads.remove(o)).collect();
            if present.iter().all(Option::is_none) {
                continue;
            }
            let Some(c) = saved.ctx[si].take() else {
                continue;
            };
            let mut dys = Vec::with_capacity(present.len());
            for ((g, convs), y) in present.into_iter().zip(&s.grad_before).zip(&c.outputs) {
                let g = match g {
                    Some(g) => self.convert(g, convs)?,
                    None => Tensor::zeros(y.shape.clone()),
                };
                dys.push(g);
            }
            let xs: Vec<&Tensor> = c.inputs.iter().map(|t| &**t).collect();
            let ys: Vec<&Tensor> = c.outputs.iter().map(|t| &**t).collect();
            let ds: Vec<&Tensor> = dys.iter().collect();
            let (members, rank) = kernel_group(&self.groups, &s.kernel_axes);
            let mut group = KernelGroup {
                ep: &mut self.ep,
                group: members,
                rank,
            };
            // Under fused accumulation a parameter's gradient so far is lent to the kernel,
            // which adds into it; it needs no conversion (a weight is stored as its products
            // read it).
            let mut sums: Vec<Option<Tensor>> = s
                .inputs
                .iter()
                .zip(&s.grad_after)
                .map(|(v, convs)| {
                    let fuse = l.grad_accumulation_fusion
                        && convs.as_ref().is_some_and(Vec::is_empty)
                        && matches!(prog.values[*v as usize].role, Role::Parameter { .. });
                    fuse.then(|| self.grads.remove(v)).flatten()
                })
                .collect();
            let mut into: Vec<Option<&mut Tensor>> = sums.iter_mut().map(Option::as_mut).collect();
            let dx = kernels::backward(
                &s.kernel,
                &xs,
                &ys,
                c.aux.as_ref(),
                &ds,
                &mut group,
                &mut into,
            )?;
            drop(into);
            for (&v, sum) in s.inputs.iter().zip(sums) {
                if let Some(sum) = sum {
                    self.grads.insert(v, sum);
                }
            }
            for ((&v, convs), g) in s.inputs.iter().zip(&s.grad_after).zip(dx) {
                let (Some(convs), Some(g)) = (convs, g) else {
                    continue;
                };
                let g = self.convert(g, convs)?;
                let into = if matches!(prog.values[v as usize].role, Role::Parameter { .. }) {
                    &mut self.grads
                } else {
                    &mut grads
                };
                match into.get_mut(&v) {
                    Some(acc) => acc.add_assign(&g),
                    None => {
                        into.insert(v, g);
                    }
                }
            }
        }
        if chunk > 0 {
            let mut out = Vec::with_capacity(code.recv.len());
            for (&v, &named) in code.recv.iter().zip(&code.recv_from) {
                let g = match grads.remove(&v) {
                    Some(g) => g,
                    None => {
                        let x = saved.env.get(&v).ok_or_else(|| missing(v, prog))?;
                        Tensor::zeros(x.shape.clone())
                    }
                };
                // Across a change of mesh the gradient goes back whole.
                let g = if code.reshard { self.whole(g, v)? } else { g };
                out.push((named, g));
            }
            self.outbox.insert((chunk, microbatch), out);
        }
        Ok(())
    }

    /// Sums the gradients of parameters that several stages hold (a tied embedding): between
    /// the devices of one mesh index when the stages share a mesh, else whole (each stage's
    /// gradient gathered on its mesh, summed over every device of the stages, where only each
    /// stage's first device contributes it, and cut back to each device's piece).
    fn sync_tied(&mut self) -> Result<(), ExecError> {
        let prog = self.prog;
        let l = &prog.layout;
        let stage = self.at.pp;
        for tied in prog.tied.iter().filter(|t| t.stages.contains(&stage)) {
            if tied.stages.iter().any(|&j| l.mesh(j) != self.mesh) {
                let v = tied.value;
                let info = &prog.values[v as usize];
                let g = match self.grads.remove(&v) {
                    Some(g) => g,
                    None => Tensor::zeros(info.placement.local_shape(&info.shape, &self.mesh)),
                };
                let mut whole = self.whole(g, v)?;
                if self.at.m != 0 {
                    whole.data.iter_mut().for_each(|x| *x = 0.0);
                }
                let at = self.at;
                let group: Vec<usize> = tied
                    .stages
                    .iter()
                    .flat_map(|&j| {
                        (0..l.stage_devices(j))
                            .map(move |m| rank_of(prog, Coord { pp: j, m, ..at }))
                    })
                    .collect();
                let index = group.iter().position(|&r| r == self.me).unwrap_or(0);
                self.ep.all_reduce_sum(&group, index, &mut whole.data)?;
                let mine = shard(&whole, &info.placement, &self.coords, &self.mesh);
                self.grads.insert(v, mine);
                continue;
            }
            let group: Vec<usize> = tied
                .stages
                .iter()
                .map(|&s| rank_of(prog, Coord { pp: s, ..self.at }))
                .collect();
            let index = tied
                .stages
                .iter()
                .position(|&s| s == self.at.pp)
                .unwrap_or(0);
            let shape = self
                .params
                .get(&tied.value)
                .map(|p| p.shape.clone())
                .unwrap_or_default();
            let g = self
                .grads
                .entry(tied.value)
                .or_insert_with(|| Tensor::zeros(shape));
            self.ep.all_reduce_sum(&group, index, &mut g.data)?;
        }
        Ok(())
    }

    /// Length of parameter `k`'s optimizer-state piece on this device.
    fn state_len(&self, k: u32) -> usize {
        self.masters
            .get(&k)
            .map_or_else(|| self.params.get(&k).map_or(0, |p| p.len()), Tensor::len)
    }

    /// This device's parameters in key order, the total length of their optimizer-state pieces,
    /// and the range of that flat bucket this rank updates: all of it, or (ZeRO over several
    /// replicas) its shard.
    fn bucket(&self) -> (Vec<u32>, usize, Range<usize>) {
        let mut keys: Vec<u32> = self.params.keys().copied().collect();
        keys.sort_unstable();
        let n: usize = keys.iter().map(|&k| self.state_len(k)).sum();
        let dp = self.dp_group.len();
        if self.prog.layout.zero > 0 && dp > 1 {
            let shard = n.div_ceil(dp);
            let lo = (self.at.dp * shard).min(n);
            (keys, n, lo..(lo + shard).min(n))
        } else {
            (keys, n, 0..n)
        }
    }

    /// Gradient synchronisation. Inside the mesh, every parameter's gradient goes from where
    /// the backward passes left it (partial sums over the axes that split the batch) to its
    /// optimizer states' placement: an all-reduce, or a reduce-scatter where the states are
    /// sharded. Over the replicas, one flat bucket: an all-reduce, or (ZeRO) a reduce-scatter
    /// that leaves each rank the sum of its shard only.
    fn sync_gradients(&mut self) -> Result<(), ExecError> {
        let prog = self.prog;
        let mut keys: Vec<u32> = self.params.keys().copied().collect();
        keys.sort_unstable();
        for &k in &keys {
            let info = &prog.values[k as usize];
            let from = info.grad_placement.as_ref().unwrap_or(&info.placement);
            let to = info.state_placement.as_ref().unwrap_or(&info.placement);
            let g = match self.grads.remove(&k) {
                Some(g) => g,
                None => Tensor::zeros(from.local_shape(&info.shape, &self.mesh)),
            };
            let convs = conversions(from, to, &self.mesh).ok_or_else(|| {
                ExecError::Lower(format!(
                    "no collective takes the gradient of `{}` from {from} to {to}",
                    info.name
                ))
            })?;
            let g = self.convert(g, &convs)?;
            self.grads.insert(k, g);
        }
        if self.dp_group.len() == 1 {
            // Nothing more to reduce: the optimizer reads the gradients where they are.
            return Ok(());
        }
        let (keys, n, range) = self.bucket();
        let mut flat = Vec::with_capacity(n);
        for k in &keys {
            match self.grads.get(k) {
                Some(g) => flat.extend_from_slice(&g.data),
                None => flat.extend(std::iter::repeat_n(0.0, self.state_len(*k))),
            }
        }
        self.grads.clear();
        self.reduced = if range.len() < n {
            let all = self.ep.exchange(&self.dp_group, self.at.dp, flat)?;
            let mut mine = vec![0.0; range.len()];
            for piece in all.iter() {
                for (d, v) in mine.iter_mut().zip(&piece[range.clone()]) {
                    *d += v;
                }
            }
            mine
        } else {
            self.ep
                .all_reduce_sum(&self.dp_group, self.at.dp, &mut flat)?;
            flat
        };
        Ok(())
    }

    /// Adam on this rank's range of the optimizer-state bucket, then (ZeRO over replicas) an
    /// all-gather of the states, and (states sharded inside the mesh) an all-gather of each
    /// master weight into its working weight.
    fn optimizer_step(&mut self) -> Result<(), ExecError> {
        let (keys, n, range) = self.bucket();
        self.updates += 1;
        let t = self.updates as i32;
        let (m, v) = self
            .moments
            .get_or_insert_with(|| (vec![0.0; range.len()], vec![0.0; range.len()]));
        let c1 = 1.0 - BETA1.powi(t);
        let c2 = 1.0 - BETA2.powi(t);
        let adam = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
            for i in 0..g.len() {
                m[i] = BETA1 * m[i] + (1.0 - BETA1) * g[i];
                v[i] = BETA2 * v[i] + (1.0 - BETA2) * g[i] * g[i];
                p[i] -= LR * (m[i] / c1) / ((v[i] / c2).sqrt() + ADAM_EPS);
            }
        };
        if range.len() == n {
            // Every state is this rank's to update: in place, from the reduced bucket or, with
            // one replica, from the gradients themselves.
            let single = self.dp_group.len() == 1;
            let mut at = 0;
            for k in &keys {
                let Some(state) = optimizer_state(&mut self.masters, &mut self.params, *k) else {
                    continue;
                };
                let span = at..at + state.len();
                at = span.end;
                let none;
                let g = match (single, self.grads.get(k)) {
                    (false, _) => &self.reduced[span.clone()],
                    (true, Some(g)) => &g.data[..],
                    (true, None) => {
                        none = vec![0.0; state.len()];
                        &none[..]
                    }
                };
                adam(&mut state.data, g, &mut m[span.clone()], &mut v[span]);
            }
            self.grads.clear();
        } else {
            let mut flat_p = Vec::with_capacity(n);
            for k in &keys {
                match self.masters.get(k) {
                    Some(master) => flat_p.extend_from_slice(&master.data),
                    None => flat_p.extend_from_slice(&self.params[k].data),
                }
            }
            adam(&mut flat_p[range.clone()], &self.reduced, m, v);
            let mine = flat_p[range].to_vec();
            let all = self.ep.exchange(&self.dp_group, self.at.dp, mine)?;
            let mut at = 0;
            for piece in all.iter() {
                let end = (at + piece.len()).min(n);
                flat_p[at..end].copy_from_slice(&piece[..end - at]);
                at = end;
            }
            let mut at = 0;
            for k in &keys {
                let Some(state) = optimizer_state(&mut self.masters, &mut self.params, *k) else {
                    continue;
                };
                let len = state.len();
                state.data.copy_from_slice(&flat_p[at..at + len]);
                at += len;
            }
        }
        // Working weights from sharded master weights, in key order on every device.
        let mut sharded: Vec<u32> = self.masters.keys().copied().collect();
        sharded.sort_unstable();
        for k in sharded {
            let info = &self.prog.values[k as usize];
            let Some(from) = info.state_placement.as_ref() else {
                continue;
            };
            let convs = conversions(from, &info.placement, &self.mesh)
                .ok_or_else(|| missing(k, self.prog))?;
            let master = self.masters[&k].clone();
            let weight = self.convert(master, &convs)?;
            self.params.insert(k, Arc::new(weight));
        }
        Ok(())
    }
}

/// The tensor Adam updates for parameter `k`: its sharded master weight, or the weight itself.
fn optimizer_state<'a>(
    masters: &'a mut HashMap<u32, Tensor>,
    params: &'a mut HashMap<u32, Arc<Tensor>>,
    k: u32,
) -> Option<&'a mut Tensor> {
    match masters.get_mut(&k) {
        Some(master) => Some(master),
        None => params.get_mut(&k).map(Arc::make_mut),
    }
}

fn missing(v: u32, prog: &Program) -> ExecError {
    let name = prog.values.get(v as usize).map_or("?", |i| i.name.as_str());
    ExecError::Lower(format!("value `{name}` is not available where it is read"))
}
