//! Prices one layout: step time with its breakdown, throughput, and memory per device per
//! stage, from the op graph, the cluster and the analytic cost model.

use crate::cluster::{Cluster, GIB, Link};
use crate::cost::{Collective, collective_time, p2p_time};
use crate::frontend::{LowerOptions, ModelDef};
use crate::graph::{Graph, LayerKind};
use crate::layer_cost::{KernelOptions, LayerCost, layer_costs};
use crate::layout::{Layout, LayoutError, Recompute, TrainingOptions};
use crate::memory::model_states;
use crate::schedule::{Schedule, ideal_bubble, inflight, pipeline_time};
use crate::tensor_parallel::{TpConfig, indivisible_sequence, indivisible_split};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Memory on one device, bytes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MemoryBreakdown {
    /// Working weights.
    pub weights: f64,
    /// Gradients.
    pub grads: f64,
    /// Optimizer states.
    pub optimizer: f64,
    /// Activations of the micro-batches in flight.
    pub activations: f64,
    /// Transient buffers (the layer being recomputed, working gradients, gathered ZeRO-3
    /// weights) and the framework's reserved memory.
    pub workspace: f64,
    /// Sum of the above.
    pub total: f64,
}

/// Where the time of a step goes, seconds; the parts add up to the step time.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimeBreakdown {
    /// Forward and backward kernels of the slowest stage, all micro-batches.
    pub compute: f64,
    /// Recomputation on the slowest stage.
    pub recompute: f64,
    /// Tensor-parallel collectives on the slowest stage.
    pub tp_comm: f64,
    /// Point-to-point transfers between stages on the slowest stage.
    pub p2p: f64,
    /// ZeRO-2/3 collectives per micro-batch not hidden behind compute.
    pub zero_comm: f64,
    /// Pipeline fill and drain.
    pub bubble: f64,
    /// Data-parallel gradient synchronisation not hidden behind the pipeline drain, plus the
    /// all-reduce of tied embeddings between first and last stage.
    pub grad_sync: f64,
    /// Optimizer step.
    pub optimizer: f64,
}

/// A run of consecutive layers placed on a stage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Chunk {
    /// First layer index (graph order).
    pub first: usize,
    /// Last layer index, inclusive.
    pub last: usize,
    /// Name of the first layer.
    pub first_name: String,
    /// Name of the last layer.
    pub last_name: String,
}

/// One pipeline stage of an estimate.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageEstimate {
    /// Stage index.
    pub index: usize,
    /// Layers of the stage, one run per interleaved chunk.
    pub chunks: Vec<Chunk>,
    /// Blocks (repeated layers) on the stage.
    pub blocks: usize,
    /// Forward time per micro-batch (kernels and tensor-parallel communication), s.
    pub forward_s: f64,
    /// Backward time per micro-batch, s.
    pub backward_s: f64,
    /// Recomputation per micro-batch, s.
    pub recompute_s: f64,
    /// Stage-to-stage transfers per micro-batch, s.
    pub p2p_s: f64,
    /// Everything per micro-batch, s.
    pub per_microbatch_s: f64,
    /// Micro-batches' worth of activations alive at the stage's peak.
    pub inflight_microbatches: f64,
    /// Parameters held per device.
    pub params: f64,
    /// Memory per device.
    pub memory: MemoryBreakdown,
}

/// The priced layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    /// The layout.
    pub layout: Layout,
    /// Micro-batches per pipeline per step.
    pub num_microbatches: u64,
    /// Predicted time of one optimizer step, s.
    pub step_time_s: f64,
    /// Tokens processed per second by the whole cluster.
    pub tokens_per_s: f64,
    /// Executed FLOP/s per GPU (recomputation included, as Megatron-LM reports), in TFLOP/s.
    pub tflops_per_gpu: f64,
    /// Model FLOPs utilisation: forward + backward FLOPs without recomputation over the peak.
    pub mfu: f64,
    /// Forward + backward FLOPs of a step.
    pub model_flops_per_step: f64,
    /// FLOPs executed in a step, recomputation included.
    pub hardware_flops_per_step: f64,
    /// Where the step time goes.
    pub time: TimeBreakdown,
    /// Ideal pipeline bubble fraction `(p - 1)/(v m)`.
    pub ideal_bubble: f64,
    /// Per-stage details.
    pub stages: Vec<StageEstimate>,
    /// Memory of the stage with the highest total.
    pub memory: MemoryBreakdown,
    /// That total in GiB: the per-device memory the layout needs.
    pub memory_per_device_gib: f64,
    /// Index of that stage.
    pub peak_memory_stage: usize,
    /// Memory usable per device after the headroom, bytes.
    pub memory_capacity: f64,
    /// Whether every stage fits in the usable memory.
    pub fits: bool,
}

/// A graph with its layer costs for one (micro-batch, tp, sp), or why that combination cannot
/// run.
type Prepared = Result<Arc<(Arc<Graph>, Vec<LayerCost>)>, LayoutError>;

/// Per-micro-batch time of one stage, by component.
#[derive(Clone, Copy, Debug, Default)]
struct StageTime {
    /// Forward and backward kernels.
    compute: f64,
    /// Tensor-parallel collectives.
    tp_comm: f64,
    /// Recomputation.
    recompute: f64,
    /// Transfers to neighbouring stages.
    p2p: f64,
    /// Exposed ZeRO-2/3 collectives.
    zero: f64,
    /// Backward pass with recomputation (the slack later stages have before stage 0 is done).
    backward: f64,
}

impl StageTime {
    fn total(&self) -> f64 {
        self.compute + self.tp_comm + self.recompute + self.p2p + self.zero
    }
}

/// Prices layouts of one model on one cluster, caching graphs and layer costs across layouts.
pub struct Estimator<'a> {
    name: &'a str,
    model: &'a ModelDef,
    cluster: &'a Cluster,
    opts: TrainingOptions,
    graphs: Mutex<HashMap<(u64, u64), Arc<Graph>>>,
    prepared: Mutex<HashMap<(u64, u64, bool), Prepared>>,
}

impl<'a> Estimator<'a> {
    /// An estimator for `model` (named `name`) trained with `opts` on `cluster`.
    pub fn new(
        name: &'a str,
        model: &'a ModelDef,
        cluster: &'a Cluster,
        opts: TrainingOptions,
    ) -> Self {
        Estimator {
            name,
            model,
            cluster,
            opts,
            graphs: Mutex::new(HashMap::new()),
            prepared: Mutex::new(HashMap::new()),
        }
    }

    /// The training options.
    pub fn options(&self) -> &TrainingOptions {
        &self.opts
    }

    /// The cluster.
    pub fn cluster(&self) -> &Cluster {
        self.cluster
    }

    /// The graph at micro-batch size `micro_batch`, with the vocabulary padded for degree `tp`.
    pub fn graph(&self, micro_batch: u64, tp: u64) -> Result<Arc<Graph>, LayoutError> {
        let multiple = self.opts.vocab_multiple.max(1) * tp;
        let key = (micro_batch, multiple);
        if let Some(g) = lock(&self.graphs).get(&key) {
            return Ok(g.clone());
        }
        let opts = LowerOptions {
            micro_batch,
            seq: self.opts.seq,
            dtype: self.opts.precision.dtype(),
            attention: self.opts.attention,
            vocab_multiple: multiple,
        };
        let g = Arc::new(
            self.model
                .lower(self.name, &opts)
                .map_err(LayoutError::Model)?,
        );
        lock(&self.graphs).insert(key, g.clone());
        Ok(g)
    }

    /// Graph and layer costs for the tensor-parallel part of a layout, checked for
    /// divisibility; computed once per (micro-batch, tp, sp).
    fn prepare(&self, micro_batch: u64, t: u64, sp: bool) -> Prepared {
        let key = (micro_batch, t, sp);
        if let Some(p) = lock(&self.prepared).get(&key) {
            return p.clone();
        }
        let result = self.graph(micro_batch, t).and_then(|g| {
            if let Some((name, axis, size)) = indivisible_split(&g, t) {
                return Err(LayoutError::TensorParallel {
                    what: format!("axis {axis} of `{name}`"),
                    count: size,
                    tp: t,
                });
            }
            if sp && let Some((name, axis, size)) = indivisible_sequence(&g, t) {
                return Err(LayoutError::TensorParallel {
                    what: format!("the sequence axis {axis} of `{name}`"),
                    count: size,
                    tp: t,
                });
            }
            let link = self.cluster.group_link(1, t);
            let kernels = KernelOptions {
                dtype: self.opts.precision.dtype(),
                grad_buffer_bytes: self.opts.precision.state_bytes().1,
                grad_accumulation_fusion: self.opts.grad_accumulation_fusion,
            };
            let costs = layer_costs(&g, TpConfig { t, sp }, &self.cluster.device, &kernels, link);
            Ok(Arc::new((g, costs)))
        });
        lock(&self.prepared).insert(key, result.clone());
        result
    }

    /// Checks what does not depend on the graph: degrees, device count, batch split.
    fn check(&self, l: &Layout) -> Result<(), LayoutError> {
        for (what, v) in [
            ("tp", l.tp),
            ("pp", l.pp),
            ("dp", l.dp),
            ("micro-batch", l.micro_batch),
            ("global batch", l.global_batch),
            ("interleave", l.interleave),
            ("sequence length", self.opts.seq),
        ] {
            if v == 0 {
                return Err(LayoutError::ZeroDegree(what));
            }
        }
        if l.zero > 3 {
            return Err(LayoutError::ZeroStage(l.zero));
        }
        let product = l.tp.saturating_mul(l.pp).saturating_mul(l.dp);
        if product != self.cluster.gpus() {
            return Err(LayoutError::DeviceCount {
                tp: l.tp,
                pp: l.pp,
                dp: l.dp,
                product,
                gpus: self.cluster.gpus(),
            });
        }
        if l.global_batch % l.micro_batch.saturating_mul(l.dp) != 0 {
            return Err(LayoutError::BatchSplit {
                global_batch: l.global_batch,
                micro_batch: l.micro_batch,
                dp: l.dp,
            });
        }
        if l.sequence_parallel && l.tp == 1 {
            return Err(LayoutError::SequenceParallelWithoutTp);
        }
        if let Some(max) = self.model.max_seq()
            && self.model.max_seq_is_hard()
            && self.opts.seq > max
        {
            return Err(LayoutError::Sequence {
                seq: self.opts.seq,
                max,
            });
        }
        if let Some(c) = self.model.transformer() {
            for (what, count) in [
                ("the attention heads", c.heads),
                ("the key/value heads", c.kv_heads),
                ("the FFN width", c.ffn_hidden),
            ] {
                if count % l.tp != 0 {
                    return Err(LayoutError::TensorParallel {
                        what: what.to_string(),
                        count,
                        tp: l.tp,
                    });
                }
            }
        }
        let m = l.num_microbatches();
        if l.interleave > 1 && (l.pp < 2 || m % l.pp != 0) {
            return Err(LayoutError::Interleave {
                microbatches: m,
                pp: l.pp,
            });
        }
        Ok(())
    }

    /// Prices `layout`, or says why it cannot run.
    pub fn evaluate(&self, layout: &Layout) -> Result<Estimate, LayoutError> {
        self.check(layout)?;
        let prepared = self.prepare(layout.micro_batch, layout.tp, layout.sequence_parallel)?;
        let (g, costs) = &*prepared;
        let chunks = assign_chunks(g, layout)?;
        Ok(self.price(g, costs, &chunks, layout))
    }

    fn price(&self, g: &Graph, costs: &[LayerCost], chunks: &[Vec<usize>], l: &Layout) -> Estimate {
        let cluster = self.cluster;
        let device = &cluster.device;
        let precision = self.opts.precision;
        let (p, v, t, d) = (l.pp, l.interleave, l.tp, l.dp);
        let m = l.num_microbatches();
        let n_chunks = chunks.len();
        let (weight_bytes, grad_bytes, _) = precision.state_bytes();
        let stage_rank = |j: u64| j * t * d;
        let tp_link = cluster.group_link(1, t);
        let dp_link = cluster.group_link(t, d);

        // Bytes a stage boundary carries per device: Megatron's scatter/gather (or sequence
        // parallelism) sends 1/t of the activation per rank, then re-gathers inside the node.
        let boundary = |chunk: usize| -> (f64, f64) {
            let first = chunks[chunk][0];
            let full = costs[first].input_bytes;
            if t > 1 {
                let gather = if l.sequence_parallel {
                    0.0
                } else {
                    collective_time(Collective::AllGather, t, full, tp_link)
                };
                (full / t as f64, gather)
            } else {
                (full, 0.0)
            }
        };
        let transfer = |from_chunk: usize, to_chunk: usize| -> f64 {
            let (from, to) = ((from_chunk as u64) % p, (to_chunk as u64) % p);
            let link: Link = cluster.p2p_link(stage_rank(from), stage_rank(to));
            let (bytes, gather) = boundary(to_chunk.max(from_chunk));
            p2p_time(bytes, link) + gather
        };

        let mut stages = Vec::with_capacity(p as usize);
        let mut times: Vec<StageTime> = Vec::with_capacity(p as usize);
        for j in 0..p as usize {
            let mine: Vec<usize> = (0..n_chunks).filter(|k| k % p as usize == j).collect();
            let layers: Vec<usize> = mine
                .iter()
                .flat_map(|&k| chunks[k].iter().copied())
                .collect();
            let (mut fwd_c, mut fwd_m, mut bwd_c, mut bwd_m, mut rec) = (0.0, 0.0, 0.0, 0.0, 0.0);
            let (mut act, mut transient, mut params, mut max_layer_params) =
                (0.0, 0.0f64, 0.0, 0.0f64);
            let mut zero_extra = 0.0;
            let mut blocks = 0;
            for &li in &layers {
                let c = &costs[li];
                fwd_c += c.fwd_compute;
                fwd_m += c.fwd_comm;
                bwd_c += c.bwd_compute;
                bwd_m += c.bwd_comm;
                let block = c.kind == LayerKind::Block;
                blocks += block as usize;
                let (saved, r) = match (block, l.recompute) {
                    (true, Recompute::Full) => (c.checkpoint, c.fwd_compute + c.fwd_comm),
                    (true, Recompute::Selective) => (c.saved_selective, c.attention_core_compute),
                    _ => (c.saved, 0.0),
                };
                act += saved;
                rec += r;
                let rematerialised = if block && l.recompute == Recompute::Full {
                    c.saved
                } else {
                    0.0
                };
                transient = transient.max(rematerialised + c.grad_working);
                let mut lp = c.params;
                for &(owner, n) in &c.borrowed_params {
                    if !layers.contains(&owner) {
                        lp += n;
                    }
                }
                params += lp;
                max_layer_params = max_layer_params.max(lp);
                // ZeRO-2 reduce-scatters a layer's gradients every micro-batch, ZeRO-3 also
                // gathers its weights before the forward and the backward (and again for a full
                // recomputation). Prefetching hides them behind the same layer's compute; what
                // exceeds it is exposed.
                if l.zero >= 2 && d > 1 {
                    let rs =
                        collective_time(Collective::ReduceScatter, d, lp * grad_bytes, dp_link);
                    let ag = collective_time(Collective::AllGather, d, lp * weight_bytes, dp_link);
                    let (fwd_l, bwd_l) =
                        (c.fwd_compute + c.fwd_comm, c.bwd_compute + c.bwd_comm + r);
                    zero_extra += if l.zero == 2 {
                        (rs - bwd_l).max(0.0)
                    } else {
                        let regather = if r > 0.0 && l.recompute == Recompute::Full {
                            ag
                        } else {
                            0.0
                        };
                        (ag - fwd_l).max(0.0) + (ag + regather + rs - bwd_l).max(0.0)
                    };
                }
            }
            let mut p2p = 0.0;
            for &k in &mine {
                if k + 1 < n_chunks {
                    p2p += transfer(k, k + 1);
                }
                if k > 0 {
                    p2p += transfer(k, k - 1);
                }
            }
            let time = StageTime {
                compute: fwd_c + bwd_c,
                tp_comm: fwd_m + bwd_m,
                recompute: rec,
                p2p,
                zero: zero_extra,
                backward: bwd_c + bwd_m + rec,
            };
            times.push(time);

            let states = model_states(params, precision, l.zero, d);
            let in_flight = inflight(Schedule::OneFOneB, j as u64, p, m, v);
            let gathered = if l.zero == 3 {
                // The layer being computed and the one prefetched, in full.
                2.0 * max_layer_params * weight_bytes
            } else {
                0.0
            };
            let workspace = transient + gathered + device.reserved_bytes;
            let activations = act * in_flight;
            let memory = MemoryBreakdown {
                weights: states.weights,
                grads: states.grads,
                optimizer: states.optimizer,
                activations,
                workspace,
                total: states.weights + states.grads + states.optimizer + activations + workspace,
            };
            stages.push(StageEstimate {
                index: j,
                chunks: mine
                    .iter()
                    .map(|&k| {
                        let (first, last) = (chunks[k][0], chunks[k][chunks[k].len() - 1]);
                        Chunk {
                            first,
                            last,
                            first_name: g.layers[first].name.clone(),
                            last_name: g.layers[last].name.clone(),
                        }
                    })
                    .collect(),
                blocks,
                forward_s: fwd_c + fwd_m,
                backward_s: bwd_c + bwd_m,
                recompute_s: rec,
                p2p_s: p2p,
                per_microbatch_s: time.total(),
                inflight_microbatches: in_flight,
                params,
                memory,
            });
        }

        let per_mb: Vec<f64> = times.iter().map(StageTime::total).collect();
        let pipeline = pipeline_time(&per_mb, m, v);
        let (bottleneck, t_max) = per_mb
            .iter()
            .copied()
            .enumerate()
            .fold((0, 0.0), |acc, (i, x)| if x > acc.1 { (i, x) } else { acc });

        // Gradient synchronisation after the last backward of each stage. Stage j finishes
        // j backward passes before stage 0, so only what exceeds that slack lands on the step.
        let mut grad_sync = 0.0f64;
        for (j, s) in stages.iter().enumerate() {
            let grads = s.params * grad_bytes;
            let weights = s.params * weight_bytes;
            let sync = match l.zero {
                0 => collective_time(Collective::AllReduce, d, grads, dp_link),
                1 => {
                    collective_time(Collective::ReduceScatter, d, grads, dp_link)
                        + collective_time(Collective::AllGather, d, weights, dp_link)
                }
                2 => collective_time(Collective::AllGather, d, weights, dp_link),
                _ => 0.0,
            };
            let slack = j as f64 * times[j].backward;
            grad_sync = grad_sync.max(sync - slack);
        }
        // Tied embeddings: first and last stage all-reduce the shared matrix's gradient.
        if p > 1 {
            let tied: f64 = costs
                .iter()
                .flat_map(|c| c.borrowed_params.iter().map(|&(_, n)| n))
                .sum();
            let link = cluster.p2p_link(stage_rank(0), stage_rank(p - 1));
            grad_sync += collective_time(Collective::AllReduce, 2, tied * grad_bytes, link);
        }
        let zero_shard = if l.zero >= 1 { d as f64 } else { 1.0 };
        let optimizer = stages
            .iter()
            .map(|s| {
                s.params / zero_shard * precision.optimizer_traffic()
                    / (device.hbm_bandwidth * device.hbm_efficiency)
            })
            .fold(0.0, f64::max);
        let step = pipeline + grad_sync + optimizer;

        let slowest = times[bottleneck];
        let mf = m as f64;
        let time = TimeBreakdown {
            compute: slowest.compute * mf,
            recompute: slowest.recompute * mf,
            tp_comm: slowest.tp_comm * mf,
            p2p: slowest.p2p * mf,
            zero_comm: slowest.zero * mf,
            bubble: pipeline - t_max * mf,
            grad_sync,
            optimizer,
        };

        let replicas = (m * d) as f64;
        let model_flops: f64 =
            costs.iter().map(|c| c.fwd_flops + c.bwd_flops).sum::<f64>() * replicas;
        let recompute_flops: f64 = costs
            .iter()
            .filter(|c| c.kind == LayerKind::Block)
            .map(|c| match l.recompute {
                Recompute::None => 0.0,
                Recompute::Selective => c.attention_core_flops,
                Recompute::Full => c.fwd_flops,
            })
            .sum::<f64>()
            * replicas;
        let hardware_flops = model_flops + recompute_flops;
        let gpus = cluster.gpus() as f64;
        let peak = match precision {
            crate::memory::Precision::Fp32 => device.peak_fp32_flops,
            _ => device.peak_bf16_flops,
        };
        let capacity = device.hbm_bytes * (1.0 - self.opts.memory_headroom);
        let (peak_stage, memory) = stages.iter().map(|s| (s.index, s.memory)).fold(
            (0, stages[0].memory),
            |acc, (i, mem)| {
                if mem.total > acc.1.total {
                    (i, mem)
                } else {
                    acc
                }
            },
        );
        Estimate {
            layout: *l,
            num_microbatches: m,
            step_time_s: step,
            tokens_per_s: (l.global_batch * self.opts.seq) as f64 / step,
            tflops_per_gpu: hardware_flops / step / gpus / 1e12,
            mfu: model_flops / step / gpus / peak,
            model_flops_per_step: model_flops,
            hardware_flops_per_step: hardware_flops,
            time,
            ideal_bubble: ideal_bubble(p, m, v),
            fits: memory.total <= capacity,
            memory_per_device_gib: memory.total / GIB,
            memory,
            peak_memory_stage: peak_stage,
            memory_capacity: capacity,
            stages,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned cache only means another evaluation panicked; its entries are still valid.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Splits the layers into `pp x interleave` chunks of equally many blocks: layers before the
/// first block join the first chunk, layers after a block join that block's chunk.
fn assign_chunks(g: &Graph, l: &Layout) -> Result<Vec<Vec<usize>>, LayoutError> {
    let n_chunks = l.pp.saturating_mul(l.interleave).min(usize::MAX as u64) as usize;
    let blocks = g.block_layers().len();
    if (blocks == 0 && n_chunks > 1) || (blocks > 0 && blocks % n_chunks != 0) {
        return Err(LayoutError::StageSplit {
            blocks: blocks as u64,
            pp: l.pp,
            interleave: l.interleave,
        });
    }
    let per_chunk = (blocks / n_chunks).max(1);
    let mut chunks = vec![Vec::new(); n_chunks];
    let mut seen = 0usize;
    for (li, layer) in g.layers.iter().enumerate() {
        let k = if layer.kind == LayerKind::Block {
            seen += 1;
            (seen - 1) / per_chunk
        } else {
            seen.saturating_sub(1) / per_chunk
        };
        chunks[k.min(n_chunks - 1)].push(li);
    }
    Ok(chunks)
}
