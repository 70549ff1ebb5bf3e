//! Prices one layout: step time with its breakdown, throughput, and memory per device per
//! stage, from the op graph, the cluster and the analytic cost model.

use crate::cost::analytic::{Collective, FP8_CAST_BYTES_PER_ELEMENT, collective_time, p2p_time};
use crate::cost::cluster::{Cluster, GIB, Link};
use crate::cost::context_parallel::{CpComm, CpConfig, CpGroups, hierarchical_inner};
use crate::cost::layer_cost::{ExpertLinks, KernelOptions, LayerCost, LayerCostContext, Pricing};
use crate::cost::memory::{FP8_WEIGHT_COPY_BYTES, StateBytes, fp32_loss_working, model_states};
use crate::cost::profile::Profile;
use crate::cost::tensor_parallel::{TpConfig, indivisible_sequence, indivisible_split};
use crate::model::frontend::{Attention, LowerOptions, ModelDef};
use crate::model::graph::{Graph, LayerKind};
use crate::plan::layout::{Layout, LayoutError, Recompute, TrainingOptions};
use crate::solve::schedule::{
    Bubble, PipelineSpec, Schedule, ideal_bubble, inflight_profiles, pipeline_time, simulate_times,
};
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
    /// Tensor- and context-parallel collectives on the slowest stage (the part of the ring
    /// attention exchange that attention does not hide).
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

/// Layers of one chunk (virtual stage) of a pipeline, as a layout places them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ChunkLayers {
    /// First layer (graph order).
    pub first: usize,
    /// Last layer, inclusive.
    pub last: usize,
    /// Under full recomputation: how many blocks at the start of the chunk are recomputed
    /// (Megatron-LM's `--recompute-method block --recompute-num-layers N`); ignored otherwise.
    pub full_recompute: usize,
}

/// How a layout's layers were split into chunks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Partition {
    /// Equally many blocks per chunk (the later chunks take the remainder), Megatron-LM's
    /// default; every block recomputed under full recomputation.
    Even,
    /// Alpa's stage-construction DP over the layers ([`crate::solve::inter`]).
    Dp,
    /// SAPP balancing of blocks and fully recomputed blocks ([`crate::solve::balance`]).
    Balance,
}

impl Partition {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Partition::Even => "even",
            Partition::Dp => "dp",
            Partition::Balance => "balance",
        }
    }
}

/// A run of consecutive layers placed on a stage, priced.
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
    /// Blocks in the chunk.
    pub blocks: usize,
    /// Blocks recomputed in full (the first ones of the chunk).
    pub full_recompute: usize,
    /// Forward time per micro-batch, sending the output to the next chunk included, s.
    pub forward_s: f64,
    /// Backward time per micro-batch, recomputation and sending the input gradient included,
    /// s.
    pub backward_s: f64,
    /// The recomputation part of the backward time, s.
    pub recompute_s: f64,
    /// Activation bytes one micro-batch keeps on the chunk from its forward to its backward.
    pub activation_bytes: f64,
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
    /// Forward time per micro-batch (kernels and tensor-, context- and expert-parallel communication), s.
    pub forward_s: f64,
    /// Backward time per micro-batch, s.
    pub backward_s: f64,
    /// Recomputation per micro-batch, s.
    pub recompute_s: f64,
    /// Stage-to-stage transfers per micro-batch, s.
    pub p2p_s: f64,
    /// Everything per micro-batch, s.
    pub per_microbatch_s: f64,
    /// Micro-batches' worth of activations alive at the stage's peak (chunks in flight over
    /// chunks per stage).
    pub inflight_microbatches: f64,
    /// Parameters held per device.
    pub params: f64,
    /// Of those, the routed experts' (reduced and sharded over the expert data-parallel
    /// group).
    #[serde(default)]
    pub expert_params: f64,
    /// Of those, the weights FP8 products read (cast to FP8 once per step, their copies held).
    #[serde(default)]
    pub fp8_params: f64,
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
    /// The bubble decomposition `real = ideal + imbalance + recompute` of the pipeline.
    pub bubble: Bubble,
    /// Whether the pipeline time comes from the list-scheduling simulation (otherwise from the
    /// closed form, which the search uses to screen layouts).
    pub simulated: bool,
    /// How the layers were split into chunks.
    pub partition: Partition,
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
pub type Prepared = Result<Arc<(Arc<Graph>, Vec<LayerCost>)>, LayoutError>;

/// In-flight micro-batches per chunk at every possible activation peak, per stage
/// (`[stage][profile][chunk]`).
type Profiles = Arc<Vec<Vec<Vec<u32>>>>;

/// How the pipeline time of a layout is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timing {
    /// The closed form of [`pipeline_time`]: exact for equal stages, fast; used to screen.
    ClosedForm,
    /// The list-scheduling simulation: exact for any stages.
    Simulated,
}

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
    /// Forward pass.
    forward: f64,
    /// Parameters of the layer whose gradients the backward finishes last (the stage's first):
    /// the data-parallel bucket that no backward work can hide.
    last_bucket: f64,
}

impl StageTime {
    fn total(&self) -> f64 {
        self.compute + self.tp_comm + self.recompute + self.p2p + self.zero
    }
}

/// What one layer costs per micro-batch under a recomputation kind, on a stage where it holds
/// `params` parameters.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LayerTime {
    /// Forward kernels, s.
    pub fwd_compute: f64,
    /// Forward tensor-, context- and expert-parallel communication, s.
    pub fwd_comm: f64,
    /// Backward kernels, s.
    pub bwd_compute: f64,
    /// Backward tensor-, context- and expert-parallel communication, s.
    pub bwd_comm: f64,
    /// Recomputation, s.
    pub recompute: f64,
    /// ZeRO collectives not hidden behind the forward, s.
    pub zero_fwd: f64,
    /// ZeRO collectives not hidden behind the backward, s.
    pub zero_bwd: f64,
    /// Activations kept per micro-batch, bytes.
    pub saved: f64,
    /// Transient memory of its backward (rematerialised activations, working gradients; an
    /// unfused fp32 loss's two logit-sized fp32 gradients), bytes.
    pub transient: f64,
}

impl LayerTime {
    /// Forward time, s.
    pub fn forward(&self) -> f64 {
        self.fwd_compute + self.fwd_comm + self.zero_fwd
    }

    /// Backward time with recomputation, s.
    pub fn backward(&self) -> f64 {
        self.bwd_compute + self.bwd_comm + self.recompute + self.zero_bwd
    }
}

/// Where an estimator gets layer costs: priced on the spot, or looked up in a cache keyed by
/// [`LayerCostContext::key_parts`].
pub trait CostSource: Sync {
    /// The costs of every layer of `ctx`'s graph under `pricing`, in layer order.
    fn layer_costs(&self, ctx: &LayerCostContext<'_>, pricing: &Pricing<'_>) -> Vec<LayerCost>;
}

/// Prices every layer with the cost model, remembering nothing.
pub struct Direct;

impl CostSource for Direct {
    fn layer_costs(&self, ctx: &LayerCostContext<'_>, pricing: &Pricing<'_>) -> Vec<LayerCost> {
        (0..ctx.graph().layers.len())
            .map(|li| ctx.cost(li, pricing))
            .collect()
    }
}

/// Which graph an estimator lowered: per micro-batch, vocabulary padding and tokens per
/// sequence on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphKey {
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Vocabulary padding multiple.
    pub vocab_multiple: u64,
    /// Tokens of each sequence on one rank.
    pub seq: u64,
}

/// What a layer's cost depends on in a layout: its micro-batch, tensor parallelism (with or
/// without sequence parallelism) and context parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PricingKey {
    /// Sequences per micro-batch.
    pub micro_batch: u64,
    /// Tensor-parallel degree.
    pub tp: u64,
    /// Sequence parallelism.
    pub sp: bool,
    /// Context parallelism.
    pub cp: CpConfig,
    /// Expert-parallel degree.
    pub ep: u64,
    /// Expert tensor-parallel degree.
    pub etp: u64,
}

impl PricingKey {
    /// The part of `l` its layer costs depend on.
    pub fn of(l: &Layout) -> PricingKey {
        PricingKey {
            micro_batch: l.micro_batch,
            tp: l.tp,
            sp: l.sequence_parallel,
            cp: l.cp_config(),
            ep: l.ep,
            etp: l.etp,
        }
    }

    /// The tensor-parallel configuration with its expert layout.
    pub fn tp_config(&self) -> TpConfig {
        TpConfig {
            t: self.tp,
            sp: self.sp,
            ep: self.ep,
            etp: self.etp,
        }
    }
}

/// Prices layouts of one model on one cluster, caching graphs and layer costs across layouts.
pub struct Estimator<'a> {
    name: &'a str,
    model: &'a ModelDef,
    cluster: &'a Cluster,
    opts: TrainingOptions,
    costs: &'a dyn CostSource,
    profile: Option<&'a Profile>,
    graphs: Mutex<HashMap<GraphKey, Arc<Graph>>>,
    prepared: Mutex<HashMap<PricingKey, Prepared>>,
    profiles: Mutex<HashMap<(usize, usize, usize), Profiles>>,
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
            costs: &Direct,
            profile: None,
            graphs: Mutex::new(HashMap::new()),
            prepared: Mutex::new(HashMap::new()),
            profiles: Mutex::new(HashMap::new()),
        }
    }

    /// The same estimator getting layer costs from `costs`.
    pub fn with_costs(mut self, costs: &'a dyn CostSource) -> Self {
        self.costs = costs;
        self
    }

    /// The same estimator starting from graphs another one lowered (of the same model and
    /// training options: see [`Estimator::graphs`]), so pricing the model on other device
    /// numbers lowers nothing again.
    pub fn with_graphs(self, graphs: HashMap<GraphKey, Arc<Graph>>) -> Self {
        *lock(&self.graphs) = graphs;
        self
    }

    /// The graphs lowered so far.
    pub fn graphs(&self) -> HashMap<GraphKey, Arc<Graph>> {
        lock(&self.graphs).clone()
    }

    /// The same estimator with measured times overriding the cost model.
    pub fn with_profile(mut self, profile: Option<&'a Profile>) -> Self {
        self.profile = profile;
        self
    }

    /// The training options.
    pub fn options(&self) -> &TrainingOptions {
        &self.opts
    }

    /// The cluster.
    pub fn cluster(&self) -> &Cluster {
        self.cluster
    }

    /// The graph one rank runs at micro-batch size `micro_batch` with the vocabulary padded
    /// for degree `tp`, over its `seq / cp` tokens of every sequence.
    pub fn graph(&self, micro_batch: u64, tp: u64, cp: u64) -> Result<Arc<Graph>, LayoutError> {
        let multiple = self.opts.vocab_multiple.max(1) * tp;
        let seq = self.opts.seq / cp.max(1);
        let key = GraphKey {
            micro_batch,
            vocab_multiple: multiple,
            seq,
        };
        if let Some(g) = lock(&self.graphs).get(&key) {
            return Ok(g.clone());
        }
        let opts = LowerOptions {
            micro_batch,
            seq,
            dtype: self.opts.precision.dtype(),
            attention: self.opts.attention,
            vocab_multiple: multiple,
            eager_elementwise: self.opts.eager_elementwise,
            fp8: self.opts.fp8,
        };
        let routed = self.model.with_routing(self.opts.moe_routing);
        let g = Arc::new(
            routed
                .as_ref()
                .unwrap_or(self.model)
                .lower(self.name, &opts)
                .map_err(LayoutError::Model)?,
        );
        lock(&self.graphs).insert(key, g.clone());
        Ok(g)
    }

    /// Graph and layer costs for the tensor- and context-parallel part of a layout, checked
    /// for divisibility; computed once per key.
    pub(crate) fn prepare(&self, key: PricingKey) -> Prepared {
        let PricingKey { tp: t, sp, .. } = key;
        if let Some(p) = lock(&self.prepared).get(&key) {
            return p.clone();
        }
        let result = self.graph(key.micro_batch, t, key.cp.c).and_then(|g| {
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
            let kernels = self.kernels();
            let ctx = LayerCostContext::new(&g);
            let costs = self
                .costs
                .layer_costs(&ctx, &self.pricing(key.tp_config(), key.cp, &kernels));
            Ok(Arc::new((g.clone(), costs)))
        });
        lock(&self.prepared).insert(key, result.clone());
        result
    }

    /// How the training options run kernels.
    fn kernels(&self) -> KernelOptions {
        KernelOptions {
            dtype: self.opts.precision.dtype(),
            grad_buffer_bytes: self.opts.state_bytes().grads,
            grad_accumulation_fusion: self.opts.grad_accumulation_fusion,
            tp_comm_overlap: self.opts.tp_comm_overlap,
        }
    }

    /// What pricing a layer needs under tensor parallelism `tp` (with its expert layout) and
    /// context parallelism `cp` (its ranks `t` apart, Megatron-Core's tp-cp-dp-pp order; the
    /// expert groups in its etp-ep-edp-pp order).
    fn pricing<'k>(
        &'k self,
        tp: TpConfig,
        cp: CpConfig,
        kernels: &'k KernelOptions,
    ) -> Pricing<'k> {
        Pricing {
            tp,
            cp,
            device: &self.cluster.device,
            kernels,
            tp_link: self.cluster.group_link(1, tp.t),
            expert_links: ExpertLinks {
                ep: self.cluster.group_link(tp.etp, tp.ep),
                etp: self.cluster.group_link(1, tp.etp),
            },
            cp_groups: CpGroups::on(self.cluster, tp.t, cp.c),
            profile: self.profile,
        }
    }

    /// Every kernel and collective the layers run under `key`, with the analytic model's
    /// times: a template for measuring them.
    pub fn modelled_profile(&self, key: PricingKey) -> Result<Profile, LayoutError> {
        let prepared = self.prepare(key)?;
        let g = &prepared.0;
        let kernels = self.kernels();
        let p = Pricing {
            profile: None,
            ..self.pricing(key.tp_config(), key.cp, &kernels)
        };
        let ctx = LayerCostContext::new(g);
        let mut out = Profile::new(self.cluster.device.name.clone());
        for li in 0..g.layers.len() {
            out = out.overlaid(&ctx.modelled_entries(li, &p));
        }
        Ok(out)
    }

    /// The graph and layer costs under `key`, or why that combination cannot run.
    pub fn layer_costs(&self, key: PricingKey) -> Prepared {
        self.prepare(key)
    }

    /// Checks what does not depend on the graph: degrees, device count, batch split.
    pub(crate) fn check(&self, l: &Layout) -> Result<(), LayoutError> {
        for (what, v) in [
            ("tp", l.tp),
            ("pp", l.pp),
            ("dp", l.dp),
            ("cp", l.cp),
            ("ep", l.ep),
            ("etp", l.etp),
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
        let product = l.stage_ranks().saturating_mul(l.pp);
        if product != self.cluster.gpus() {
            let degrees = if l.cp > 1 {
                format!(
                    "tp x cp x pp x dp = {} x {} x {} x {}",
                    l.tp, l.cp, l.pp, l.dp
                )
            } else {
                format!("tp x pp x dp = {} x {} x {}", l.tp, l.pp, l.dp)
            };
            return Err(LayoutError::DeviceCount {
                degrees,
                product,
                gpus: self.cluster.gpus(),
            });
        }
        if self.opts.fp8 && !self.cluster.device.has_fp8() {
            return Err(LayoutError::Fp8Unsupported {
                device: self.cluster.device.name.clone(),
            });
        }
        self.check_context_parallel(l)?;
        self.check_expert_parallel(l)?;
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

    /// Megatron-Core's conditions on context parallelism: the sequence cut into `2 cp`
    /// equal chunks (causal load balancing), flash attention (the blockwise kernel the ring
    /// and the gathers feed), and for `a2a` every rank's tensor-parallel share of the query
    /// and key/value heads split again over the `cp` ranks.
    fn check_context_parallel(&self, l: &Layout) -> Result<(), LayoutError> {
        if l.cp == 1 {
            return Ok(());
        }
        let bad = |why: String| LayoutError::ContextParallel { cp: l.cp, why };
        let seq = self.opts.seq;
        if seq % (2 * l.cp) != 0 {
            return Err(bad(format!(
                "the sequence of {seq} tokens does not split into 2 x cp = {} equal chunks",
                2 * l.cp
            )));
        }
        if self.opts.attention.flash_kernel().is_none() {
            return Err(bad(format!(
                "needs attention = {} (the ring and the gathers feed a blockwise attention kernel)",
                Attention::fused_names()
            )));
        }
        // The ranks an all-to-all splits the heads over: the whole group, or under `a2a+p2p`
        // its ranks inside a node.
        let a2a = match l.cp_comm {
            CpComm::A2a => Some(l.cp),
            CpComm::A2aP2p => Some(hierarchical_inner(l.tp, l.cp, self.cluster.gpus_per_node)),
            CpComm::P2p | CpComm::AllGather => None,
        };
        if let (Some(a), Some(c)) = (a2a, self.model.transformer()) {
            for (what, count) in [
                ("attention heads", c.heads),
                ("key/value heads", c.kv_heads),
            ] {
                if count % (l.tp * a) != 0 {
                    return Err(bad(format!(
                        "cp_comm = \"{}\" splits the heads over tp x {a} = {} ranks, but the model has {count} {what}",
                        l.cp_comm.name(),
                        l.tp * a
                    )));
                }
            }
        }
        Ok(())
    }

    /// Megatron-Core's conditions on expert parallelism (MoE parallel folding): the experts
    /// divided by `ep`, each expert's width by `etp`, the stage's `tp x cp x dp` GPUs by
    /// `etp x ep`, and sequence parallelism under tensor parallelism (each rank routes its own
    /// tokens). A dense model has no experts to divide.
    fn check_expert_parallel(&self, l: &Layout) -> Result<(), LayoutError> {
        let bad = |why: String| LayoutError::ExpertParallel {
            ep: l.ep,
            etp: l.etp,
            why,
        };
        let Some(moe) = self.model.transformer().and_then(|c| c.moe) else {
            if l.has_expert_parallelism() {
                return Err(bad("the model has no mixture-of-experts layers".into()));
            }
            return Ok(());
        };
        if moe.experts % l.ep != 0 {
            return Err(bad(format!(
                "ep does not divide the model's {} experts",
                moe.experts
            )));
        }
        if moe.expert_ffn % l.etp != 0 {
            return Err(bad(format!(
                "etp does not divide the experts' width {}",
                moe.expert_ffn
            )));
        }
        let stage = l.stage_ranks();
        if stage % (l.ep * l.etp) != 0 {
            return Err(bad(format!(
                "etp x ep = {} does not divide a stage's tp x cp x dp = {stage} GPUs",
                l.ep * l.etp
            )));
        }
        if l.tp > 1 && !l.sequence_parallel {
            return Err(bad(
                "mixture-of-experts layers under tensor parallelism need sequence parallelism \
                 (Megatron-Core asserts it: each rank routes its own tokens)"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Prices `layout` with its layers split evenly (Megatron-LM's default), or says why it
    /// cannot run.
    pub fn evaluate(&self, layout: &Layout) -> Result<Estimate, LayoutError> {
        self.evaluate_timed(layout, Timing::Simulated)
    }

    pub(crate) fn evaluate_timed(
        &self,
        layout: &Layout,
        timing: Timing,
    ) -> Result<Estimate, LayoutError> {
        self.evaluate_even(layout, timing, usize::MAX)
    }

    /// Prices `layout` split evenly with full recomputation of only the first `blocks` blocks
    /// of every chunk (Megatron-LM's `--recompute-method block --recompute-num-layers N`; with
    /// one stage, the cost of torchtitan's every-Nth-block checkpointing).
    pub fn evaluate_recomputing(
        &self,
        layout: &Layout,
        blocks: usize,
    ) -> Result<Estimate, LayoutError> {
        self.evaluate_even(layout, Timing::Simulated, blocks)
    }

    /// The even split, recomputing at most `blocks` blocks per chunk under full recomputation.
    fn evaluate_even(
        &self,
        layout: &Layout,
        timing: Timing,
        blocks: usize,
    ) -> Result<Estimate, LayoutError> {
        self.check(layout)?;
        let prepared = self.prepare(PricingKey::of(layout))?;
        let (g, costs) = &*prepared;
        let mut chunks = even_chunks(g, layout)?;
        for c in &mut chunks {
            c.full_recompute = c.full_recompute.min(blocks);
        }
        self.price(g, costs, &chunks, layout, Partition::Even, timing)
    }

    /// Prices `layout` with the chunks of `assignment` (virtual-stage order: chunk `c` of stage
    /// `j` at `c * pp + j`).
    pub fn evaluate_assignment(
        &self,
        layout: &Layout,
        assignment: &[ChunkLayers],
        partition: Partition,
    ) -> Result<Estimate, LayoutError> {
        self.check(layout)?;
        let prepared = self.prepare(PricingKey::of(layout))?;
        let (g, costs) = &*prepared;
        check_assignment(g, layout, assignment)?;
        self.price(g, costs, assignment, layout, partition, Timing::Simulated)
    }

    /// Usable memory per device after the headroom, bytes.
    pub fn capacity(&self) -> f64 {
        self.cluster.device.hbm_bytes * (1.0 - self.opts.memory_headroom)
    }

    /// In-flight micro-batches per chunk at each possible activation peak of every stage under
    /// (interleaved) 1F1B; they depend only on the schedule's order, so they are cached.
    pub(crate) fn profiles(&self, p: usize, v: usize, m: usize) -> Profiles {
        let key = (p, v, m);
        if let Some(q) = lock(&self.profiles).get(&key) {
            return q.clone();
        }
        let q: Profiles = Arc::new(
            (0..p)
                .map(|j| {
                    if v == 1 {
                        // One chunk: the warm-up forwards plus one, at most all micro-batches.
                        vec![vec![(p - j).min(m) as u32]]
                    } else {
                        inflight_profiles(Schedule::OneFOneB, j, p, v, m)
                    }
                })
                .collect(),
        );
        lock(&self.profiles).insert(key, q.clone());
        q
    }

    /// What layer `c` costs per micro-batch under recomputation `kind` on a stage where it
    /// holds `params` parameters.
    pub(crate) fn layer_time(
        &self,
        c: &LayerCost,
        kind: Recompute,
        params: f64,
        l: &Layout,
    ) -> LayerTime {
        let StateBytes {
            weights: weight_bytes,
            grads: grad_bytes,
            ..
        } = self.opts.state_bytes();
        let d = l.grad_ranks();
        let (saved, recompute) = match kind {
            Recompute::Full => (c.checkpoint, c.fwd_compute + c.fwd_comm),
            Recompute::Selective => (
                c.saved_selective,
                c.attention_core_compute + c.attention_core_comm,
            ),
            Recompute::None => (c.saved, 0.0),
            Recompute::SelectiveOp => (c.saved_op_policy, c.op_policy_recompute),
        };
        // Recomputing a block's forward brings back, during its backward, what it dropped.
        let rematerialised = match kind {
            Recompute::Full => c.saved,
            Recompute::SelectiveOp => (c.saved - c.saved_op_policy).max(0.0),
            Recompute::None | Recompute::Selective => 0.0,
        };
        let (mut zero_fwd, mut zero_bwd) = (0.0, 0.0);
        // ZeRO-2 reduce-scatters a layer's gradients every micro-batch, ZeRO-3 also gathers its
        // weights before the forward and the backward (and again for a full recomputation).
        // Prefetching hides them behind the same layer's compute; what exceeds it is exposed
        // (in the backward, as much as the runtime's prefetch lets it: `BackwardPrefetch`).
        // Routed experts' weights are sharded over the expert data-parallel group instead.
        let over = |kind, bytes| self.weight_collective(kind, params, c.expert_params, bytes, l);
        if l.zero >= 2 && (d > 1 || l.expert_grad_ranks() > 1) {
            let rs = over(Collective::ReduceScatter, grad_bytes);
            let ag = over(Collective::AllGather, weight_bytes);
            let (fwd_l, bwd_l) = (
                c.fwd_compute + c.fwd_comm,
                c.bwd_compute + c.bwd_comm + recompute,
            );
            if l.zero == 2 {
                zero_bwd = (rs - bwd_l).max(0.0);
            } else {
                // Both re-run the block's forward through its checkpoint wrapper.
                let regather = match kind {
                    Recompute::Full | Recompute::SelectiveOp => ag,
                    Recompute::None | Recompute::Selective => 0.0,
                };
                zero_fwd = (ag - fwd_l).max(0.0);
                zero_bwd = self.opts.backward_prefetch.exposed(ag, regather, rs, bwd_l);
            }
        }
        LayerTime {
            fwd_compute: c.fwd_compute,
            fwd_comm: c.fwd_comm,
            bwd_compute: c.bwd_compute,
            bwd_comm: c.bwd_comm,
            recompute,
            zero_fwd,
            zero_bwd,
            saved,
            transient: (rematerialised + c.grad_working).max(if self.opts.fp32_loss {
                fp32_loss_working(c.loss_probs)
            } else {
                0.0
            }),
        }
    }

    /// Time of collective `kind` over the ranks holding each weight, for `params` parameters
    /// per device (of which `expert` are routed experts') at `bytes` each: the dense weights
    /// over the data- and context-parallel group (`tp` apart), then the experts' over the
    /// expert data-parallel group (`etp x ep` apart, Megatron-Core's expert rank order etp,
    /// ep, edp, pp).
    fn weight_collective(
        &self,
        kind: Collective,
        params: f64,
        expert: f64,
        bytes: f64,
        l: &Layout,
    ) -> f64 {
        let (d, edp) = (l.grad_ranks(), l.expert_grad_ranks());
        let dense_link = self.cluster.group_link(l.tp, d);
        let expert_link = self.cluster.group_link(l.ep.saturating_mul(l.etp), edp);
        collective_time(kind, d, (params - expert) * bytes, dense_link)
            + collective_time(kind, edp, expert * bytes, expert_link)
    }

    /// Time to send an activation of `bytes` (unsharded) from stage `from` to stage `to`: with
    /// tensor parallelism each rank sends `1/t` of it (Megatron-LM's scatter/gather, or the
    /// sequence-parallel shard) and the receiver re-gathers it inside the node unless sequence
    /// parallelism keeps it sharded.
    pub(crate) fn p2p_time(&self, bytes: f64, from: u64, to: u64, l: &Layout) -> f64 {
        let t = l.tp;
        let stage_rank = |j: u64| j * l.stage_ranks();
        let link: Link = self.cluster.p2p_link(stage_rank(from), stage_rank(to));
        if t > 1 {
            let gather = if l.sequence_parallel {
                0.0
            } else {
                collective_time(
                    Collective::AllGather,
                    t,
                    bytes,
                    self.cluster.group_link(1, t),
                )
            };
            p2p_time(bytes / t as f64, link) + gather
        } else {
            p2p_time(bytes, link)
        }
    }

    /// Parameters a stage holding `on_stage` layers keeps for layer `li`: its own, plus those it
    /// borrows from a layer on another stage (a tied output embedding needs its own copy).
    pub(crate) fn held_params(
        costs: &[LayerCost],
        li: usize,
        on_stage: &dyn Fn(usize) -> bool,
    ) -> f64 {
        let c = &costs[li];
        c.params
            + c.borrowed_params
                .iter()
                .filter(|(owner, _)| !on_stage(*owner))
                .map(|(_, n)| n)
                .sum::<f64>()
    }

    fn price(
        &self,
        g: &Graph,
        costs: &[LayerCost],
        chunks: &[ChunkLayers],
        l: &Layout,
        partition: Partition,
        timing: Timing,
    ) -> Result<Estimate, LayoutError> {
        let cluster = self.cluster;
        let device = &cluster.device;
        let precision = self.opts.precision;
        // `d`: the ranks holding each weight (data- and context-parallel together).
        let (p, v, d) = (l.pp, l.interleave, l.grad_ranks());
        let (pu, vu) = (p as usize, v as usize);
        let m = l.num_microbatches();
        let mu = m as usize;
        let n_chunks = chunks.len();
        let StateBytes {
            weights: weight_bytes,
            grads: grad_bytes,
            ..
        } = self.opts.state_bytes();
        let stage_rank = |j: u64| j * l.stage_ranks();
        // The routed experts' ranks of the same weights (MoE parallel folding).
        let edp = l.expert_grad_ranks();
        let stage_of = |li: usize| -> usize {
            chunks
                .iter()
                .position(|c| c.first <= li && li <= c.last)
                .map_or(usize::MAX, |k| k % pu)
        };
        let layer_stage: Vec<usize> = (0..costs.len()).map(stage_of).collect();
        let profiles = self.profiles(pu, vu, mu);

        let mut spec = PipelineSpec {
            schedule: Schedule::OneFOneB,
            microbatches: mu,
            forward: vec![vec![0.0; pu]; vu],
            backward: vec![vec![0.0; pu]; vu],
            recompute: vec![vec![0.0; pu]; vu],
            activation: vec![vec![0.0; pu]; vu],
        };
        let mut stages = Vec::with_capacity(pu);
        let mut times: Vec<StageTime> = Vec::with_capacity(pu);
        for j in 0..pu {
            let on_stage = |li: usize| layer_stage[li] == j;
            let mut time = StageTime::default();
            let (mut fwd_s, mut bwd_s) = (0.0, 0.0);
            let (mut transient, mut params, mut max_layer_params) = (0.0f64, 0.0, 0.0f64);
            let (mut expert_params, mut fp8_params) = (0.0, 0.0);
            let mut blocks = 0;
            let mut stage_chunks = Vec::with_capacity(vu);
            for c in 0..vu {
                let k = c * pu + j;
                let chunk = chunks[k];
                let (mut fwd, mut bwd, mut rec, mut act) = (0.0, 0.0, 0.0, 0.0);
                let mut chunk_blocks = 0;
                for li in chunk.first..=chunk.last {
                    let cost = &costs[li];
                    let block = cost.kind == LayerKind::Block;
                    let kind = match (block, l.recompute) {
                        (false, _) | (true, Recompute::None) => Recompute::None,
                        (true, Recompute::Selective) => Recompute::Selective,
                        (true, Recompute::Full) if chunk_blocks < chunk.full_recompute => {
                            Recompute::Full
                        }
                        (true, Recompute::Full) => Recompute::None,
                        (true, Recompute::SelectiveOp) => Recompute::SelectiveOp,
                    };
                    chunk_blocks += usize::from(block);
                    let lp = Self::held_params(costs, li, &on_stage);
                    let lt = self.layer_time(cost, kind, lp, l);
                    fwd += lt.forward();
                    bwd += lt.backward();
                    rec += lt.recompute;
                    act += lt.saved;
                    time.compute += lt.fwd_compute + lt.bwd_compute;
                    time.tp_comm += lt.fwd_comm + lt.bwd_comm;
                    time.recompute += lt.recompute;
                    time.zero += lt.zero_fwd + lt.zero_bwd;
                    fwd_s += lt.fwd_compute + lt.fwd_comm;
                    bwd_s += lt.bwd_compute + lt.bwd_comm;
                    transient = transient.max(lt.transient);
                    params += lp;
                    expert_params += cost.expert_params;
                    fp8_params += cost.fp8_params;
                    max_layer_params = max_layer_params.max(lp);
                }
                // The output goes to the next virtual stage, the input gradient back to the
                // previous one.
                let (mut send_f, mut send_b) = (0.0, 0.0);
                if k + 1 < n_chunks {
                    let bytes = costs[chunks[k + 1].first].input_bytes;
                    send_f = self.p2p_time(bytes, j as u64, ((k + 1) % pu) as u64, l);
                }
                if k > 0 {
                    let bytes = costs[chunk.first].input_bytes;
                    send_b = self.p2p_time(bytes, j as u64, ((k - 1) % pu) as u64, l);
                }
                time.p2p += send_f + send_b;
                blocks += chunk_blocks;
                spec.forward[c][j] = fwd + send_f;
                spec.backward[c][j] = bwd + send_b;
                spec.recompute[c][j] = rec;
                spec.activation[c][j] = act;
                stage_chunks.push(Chunk {
                    first: chunk.first,
                    last: chunk.last,
                    first_name: g.layers[chunk.first].name.clone(),
                    last_name: g.layers[chunk.last].name.clone(),
                    blocks: chunk_blocks,
                    full_recompute: if l.recompute == Recompute::Full {
                        chunk.full_recompute.min(chunk_blocks)
                    } else {
                        0
                    },
                    forward_s: fwd + send_f,
                    backward_s: bwd + send_b,
                    recompute_s: rec,
                    activation_bytes: act,
                });
            }
            time.backward = stage_chunks.iter().map(|c| c.backward_s).sum();
            time.forward = stage_chunks.iter().map(|c| c.forward_s).sum();
            time.last_bucket = Self::held_params(costs, chunks[j].first, &on_stage);
            times.push(time);

            // The activation peak: the worst in-flight profile of the stage.
            let (activations, held) = profiles[j]
                .iter()
                .map(|q| {
                    let bytes: f64 = q
                        .iter()
                        .zip(&stage_chunks)
                        .map(|(&n, ch)| n as f64 * ch.activation_bytes)
                        .sum();
                    (bytes, q.iter().sum::<u32>())
                })
                .fold((0.0f64, 0u32), |acc, x| if x.0 > acc.0 { x } else { acc });
            let dense = model_states(params - expert_params, self.opts.state_bytes(), l.zero, d);
            let experts = model_states(expert_params, self.opts.state_bytes(), l.zero, edp);
            let states = crate::cost::memory::ModelStates {
                weights: dense.weights + experts.weights,
                grads: dense.grads + experts.grads,
                optimizer: dense.optimizer + experts.optimizer,
            };
            let gathered = if l.zero == 3 {
                // The layer being computed and the one prefetched, in full.
                2.0 * max_layer_params * weight_bytes
            } else {
                0.0
            };
            let workspace = transient + gathered + device.reserved_bytes;
            let weights = states.weights + fp8_params * FP8_WEIGHT_COPY_BYTES;
            let memory = MemoryBreakdown {
                weights,
                grads: states.grads,
                optimizer: states.optimizer,
                activations,
                workspace,
                total: weights + states.grads + states.optimizer + activations + workspace,
            };
            stages.push(StageEstimate {
                index: j,
                chunks: stage_chunks,
                blocks,
                forward_s: fwd_s,
                backward_s: bwd_s,
                recompute_s: time.recompute,
                p2p_s: time.p2p,
                per_microbatch_s: time.total(),
                inflight_microbatches: held as f64 / v as f64,
                params,
                expert_params,
                fp8_params,
                memory,
            });
        }

        let per_mb: Vec<f64> = times.iter().map(StageTime::total).collect();
        let mf = m as f64;
        let recompute_total: f64 = times.iter().map(|x| x.recompute).sum::<f64>() * mf;
        let compute_total = per_mb.iter().sum::<f64>() * mf - recompute_total;
        let (pipeline, bubble) = match timing {
            Timing::ClosedForm => {
                let pipeline = pipeline_time(&per_mb, m, v);
                let bubble = Bubble::of(pu, mu, vu, pipeline, compute_total, recompute_total);
                (pipeline, bubble)
            }
            Timing::Simulated => {
                let sim = simulate_times(&spec).map_err(LayoutError::Schedule)?;
                (sim.makespan, sim.bubble)
            }
        };
        let (bottleneck, t_max) = per_mb
            .iter()
            .copied()
            .enumerate()
            .fold((0, 0.0), |acc, (i, x)| if x > acc.1 { (i, x) } else { acc });

        // Data-parallel synchronisation of each stage: the gradient reduction after its last
        // backward, then, under a sharded optimizer, the all-gather of the updated weights
        // after the step. Stage j finishes j backward passes before stage 0, so only the
        // reduction that exceeds that slack lands on the step. Overlapped with the backward
        // (Megatron-Core's `--overlap-grad-reduce`, FSDP), the reduction also hides behind the
        // last micro-batch's backward, all but the bucket of the layer the backward finishes
        // last; overlapped with the forward (`--overlap-param-gather`), the gather hides behind
        // the next step's first forward, all but that layer's.
        let mut grad_sync = 0.0f64;
        for (j, s) in stages.iter().enumerate() {
            // Dense weights over the data-parallel group, routed experts' over theirs.
            let over =
                |kind, bytes| self.weight_collective(kind, s.params, s.expert_params, bytes, l);
            let reduce = match l.zero {
                0 => over(Collective::AllReduce, grad_bytes),
                1 => over(Collective::ReduceScatter, grad_bytes),
                _ => 0.0,
            };
            let gather = match l.zero {
                1 | 2 => over(Collective::AllGather, weight_bytes),
                _ => 0.0,
            };
            let t = &times[j];
            let last = if s.params > 0.0 {
                (t.last_bucket / s.params).min(1.0)
            } else {
                1.0
            };
            let reduce = if self.opts.overlap_grad_reduce {
                (reduce - t.backward).max(reduce * last)
            } else {
                reduce
            };
            let gather = if self.opts.overlap_param_gather {
                (gather - t.forward).max(gather * last)
            } else {
                gather
            };
            let slack = j as f64 * t.backward;
            grad_sync = grad_sync.max((reduce - slack).max(0.0) + gather);
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
        let (zero_shard, expert_shard) = if l.zero >= 1 {
            (d as f64, edp as f64)
        } else {
            (1.0, 1.0)
        };
        let optimizer = stages
            .iter()
            .map(|s| {
                let updated =
                    (s.params - s.expert_params) / zero_shard + s.expert_params / expert_shard;
                // Every rank casts the FP8 weights it computes with, once per step.
                (updated * precision.optimizer_traffic()
                    + s.fp8_params * FP8_CAST_BYTES_PER_ELEMENT)
                    / (device.hbm_bandwidth * device.hbm_efficiency)
            })
            .fold(0.0, f64::max);
        let step = pipeline + grad_sync + optimizer;

        let slowest = times[bottleneck];
        let time = TimeBreakdown {
            compute: slowest.compute * mf,
            recompute: slowest.recompute * mf,
            tp_comm: slowest.tp_comm * mf,
            p2p: slowest.p2p * mf,
            zero_comm: slowest.zero * mf,
            // The simulation of a single stage can end a rounding error below the sum.
            bubble: (pipeline - t_max * mf).max(0.0),
            grad_sync,
            optimizer,
        };

        // Every rank of a stage's tp group runs the layer's FLOPs over its `seq / cp` tokens.
        let replicas = (m * d) as f64;
        let model_flops: f64 =
            costs.iter().map(|c| c.fwd_flops + c.bwd_flops).sum::<f64>() * replicas;
        // FLOPs re-run per micro-batch: selective re-runs every block's attention core, full
        // the forward of the blocks each chunk recomputes, torchtitan's op policy what it
        // drops of every block.
        let mut recompute_flops = 0.0;
        for chunk in chunks {
            let mut seen = 0;
            for c in &costs[chunk.first..=chunk.last] {
                if c.kind != LayerKind::Block {
                    continue;
                }
                recompute_flops += match l.recompute {
                    Recompute::None => 0.0,
                    Recompute::Selective => c.attention_core_flops,
                    Recompute::Full if seen < chunk.full_recompute => c.fwd_flops,
                    Recompute::Full => 0.0,
                    Recompute::SelectiveOp => c.op_policy_flops,
                };
                seen += 1;
            }
        }
        recompute_flops *= replicas;
        let hardware_flops = model_flops + recompute_flops;
        let gpus = cluster.gpus() as f64;
        let peak = match precision {
            crate::cost::memory::Precision::Fp32 => device.peak_fp32_flops,
            _ => device.peak_bf16_flops,
        };
        let capacity = self.capacity();
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
        Ok(Estimate {
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
            bubble,
            simulated: timing == Timing::Simulated,
            partition,
            fits: memory.total <= capacity,
            memory_per_device_gib: memory.total / GIB,
            memory,
            peak_memory_stage: peak_stage,
            memory_capacity: capacity,
            stages,
        })
    }
}

impl Estimate {
    /// The chunks of the estimate in virtual-stage order, as an assignment.
    pub fn assignment(&self) -> Vec<ChunkLayers> {
        let (p, v) = (self.stages.len(), self.layout.interleave as usize);
        (0..p * v)
            .map(|k| {
                let c = &self.stages[k % p].chunks[k / p];
                ChunkLayers {
                    first: c.first,
                    last: c.last,
                    full_recompute: c.full_recompute,
                }
            })
            .collect()
    }

    /// The pipeline of the estimate, for the simulator (and its trace).
    pub fn pipeline_spec(&self) -> PipelineSpec {
        let (p, v) = (self.stages.len(), self.layout.interleave as usize);
        let table = |f: &dyn Fn(&Chunk) -> f64| -> Vec<Vec<f64>> {
            (0..v)
                .map(|c| (0..p).map(|j| f(&self.stages[j].chunks[c])).collect())
                .collect()
        };
        PipelineSpec {
            schedule: Schedule::OneFOneB,
            microbatches: self.num_microbatches as usize,
            forward: table(&|c| c.forward_s),
            backward: table(&|c| c.backward_s),
            recompute: table(&|c| c.recompute_s),
            activation: table(&|c| c.activation_bytes),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned cache only means another evaluation panicked; its entries are still valid.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Splits the layers into `pp x interleave` chunks of (nearly) equally many blocks, the later
/// chunks taking the remainder: layers before the first block join the first chunk, layers
/// after a block join that block's chunk. Under full recomputation every block is recomputed.
pub(crate) fn even_chunks(g: &Graph, l: &Layout) -> Result<Vec<ChunkLayers>, LayoutError> {
    let n_chunks = l.pp.saturating_mul(l.interleave).min(usize::MAX as u64) as usize;
    let blocks = g.block_layers().len();
    if n_chunks > 1 && blocks < n_chunks {
        return Err(LayoutError::StageSplit {
            blocks: blocks as u64,
            pp: l.pp,
            interleave: l.interleave,
        });
    }
    let per_chunk = crate::solve::balance::even_split(blocks.max(1), n_chunks);
    let mut bounds = Vec::with_capacity(n_chunks);
    let mut acc = 0usize;
    for &n in &per_chunk {
        acc += n as usize;
        bounds.push(acc);
    }
    let mut chunks: Vec<ChunkLayers> = Vec::with_capacity(n_chunks);
    let mut seen = 0usize;
    let mut k = 0usize;
    for (li, layer) in g.layers.iter().enumerate() {
        if layer.kind == LayerKind::Block {
            if seen == bounds[k] && k + 1 < n_chunks {
                k += 1;
            }
            seen += 1;
        }
        match chunks.get_mut(k) {
            Some(c) => c.last = li,
            None => chunks.push(ChunkLayers {
                first: li,
                last: li,
                full_recompute: 0,
            }),
        }
    }
    for (c, &n) in chunks.iter_mut().zip(&per_chunk) {
        if l.recompute == Recompute::Full {
            c.full_recompute = n as usize;
        }
    }
    Ok(chunks)
}

/// Checks that `chunks` cover the layers contiguously in `pp x interleave` non-empty chunks.
fn check_assignment(g: &Graph, l: &Layout, chunks: &[ChunkLayers]) -> Result<(), LayoutError> {
    let want = l.pp.saturating_mul(l.interleave);
    let bad = |why: String| Err(LayoutError::Assignment(why));
    if chunks.len() as u64 != want {
        return bad(format!(
            "expected pp x interleave = {want} chunks, found {}",
            chunks.len()
        ));
    }
    let mut next = 0usize;
    for (k, c) in chunks.iter().enumerate() {
        if c.first != next || c.last < c.first {
            return bad(format!(
                "chunk {k} holds layers {}..={} but should start at layer {next}",
                c.first, c.last
            ));
        }
        next = c.last + 1;
    }
    if next != g.layers.len() {
        return bad(format!(
            "the chunks end at layer {next}, the model has {} layers",
            g.layers.len()
        ));
    }
    Ok(())
}
