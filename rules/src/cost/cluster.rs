//! GPUs and clusters: the hardware numbers the cost model reads, and where communication groups
//! of a layout land (inside a node on NVLink, or across nodes on the network).

use serde::{Deserialize, Serialize};

/// Bytes in a GiB.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// One GPU model. All values are in SI base units (FLOP/s, bytes, bytes/s, seconds) or are
/// dimensionless fractions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Device {
    /// Preset name (`a100-80g`, ...) or a user label.
    pub name: String,
    /// Streaming multiprocessors (the unit GEMM tiles are scheduled on).
    pub sm_count: f64,
    /// Dense bf16/fp16 tensor-core peak, FLOP/s.
    pub peak_bf16_flops: f64,
    /// fp32 peak without tensor cores (used for fp32 training and for non-matmul ops), FLOP/s.
    pub peak_fp32_flops: f64,
    /// Dense FP8 tensor-core peak, FLOP/s; 0 for a device without FP8 tensor cores (before
    /// Hopper), which cannot train with `fp8`. Absent from plans of earlier versions (0).
    #[serde(default)]
    pub peak_fp8_flops: f64,
    /// Memory capacity, bytes.
    pub hbm_bytes: f64,
    /// Memory bandwidth, bytes/s.
    pub hbm_bandwidth: f64,
    /// NVLink bandwidth per GPU and direction, bytes/s.
    pub nvlink_bandwidth: f64,
    /// Start-up latency of a collective inside a node, s.
    pub nvlink_latency: f64,
    /// Start-up latency of a collective or transfer across nodes, s.
    pub internode_latency: f64,
    /// Fraction of the tensor-core peak that the matrix products of a training step sustain.
    pub matmul_efficiency: f64,
    /// Reduction length, in elements, that a matrix product's kernel spends per output tile
    /// filling its pipeline and writing the tile back (`analytic::depth_efficiency`); 0 for a
    /// device whose products have no such cost. Absent from plans of earlier versions (0).
    #[serde(default)]
    pub gemm_pipeline_depth: f64,
    /// Fraction of the tensor-core peak that FlashAttention-2's CUDA kernels (`flash-attn`,
    /// PyTorch's SDPA flash backend) reach, forward + backward.
    pub attention_efficiency: f64,
    /// Fraction of the tensor-core peak that cuDNN's fused attention (Transformer Engine's
    /// `FusedAttention`) reaches, forward + backward; 0, in plans of earlier versions (which
    /// priced every fused kernel alike), prices it as [`Device::attention_efficiency`].
    #[serde(default)]
    pub fused_attention_efficiency: f64,
    /// Fraction of the memory bandwidth that streaming kernels reach.
    pub hbm_efficiency: f64,
    /// Fraction of the NVLink bandwidth that NCCL collectives reach (bus bandwidth).
    pub nvlink_efficiency: f64,
    /// Fraction of the network bandwidth that NCCL collectives reach (bus bandwidth).
    pub internode_efficiency: f64,
    /// Fixed cost of launching one kernel, s.
    pub kernel_overhead: f64,
    /// Memory the framework holds before the first tensor (CUDA context, library workspaces,
    /// NCCL buffers), bytes.
    pub reserved_bytes: f64,
}

impl Device {
    /// The fraction of peak cuDNN's fused attention reaches
    /// ([`Device::fused_attention_efficiency`], or where that is absent FlashAttention-2's).
    pub fn fused_attention(&self) -> f64 {
        if self.fused_attention_efficiency > 0.0 {
            self.fused_attention_efficiency
        } else {
            self.attention_efficiency
        }
    }

    /// Whether the device has FP8 tensor cores ([`Device::peak_fp8_flops`]): what training with
    /// `fp8` needs.
    pub fn has_fp8(&self) -> bool {
        self.peak_fp8_flops > 0.0
    }

    /// The device without its name and link numbers: what a result that reads the links
    /// only through a [`Link`] of its own depends on, so that a change
    /// to the network leaves the results of single-node groups as they were.
    pub fn compute_part(&self) -> Device {
        Device {
            name: String::new(),
            nvlink_bandwidth: 0.0,
            nvlink_latency: 0.0,
            internode_latency: 0.0,
            nvlink_efficiency: 0.0,
            internode_efficiency: 0.0,
            ..self.clone()
        }
    }
}

/// A field of [`Device`] as users write it (in `workspace.toml` overrides), with its unit.
#[derive(Clone, Copy, Debug)]
pub struct DeviceField {
    /// Key in `workspace.toml`.
    pub key: &'static str,
    /// Unit of the value users write.
    pub unit: &'static str,
    /// Multiply the user's value by this to get SI units.
    pub scale: f64,
    /// What the field means.
    pub doc: &'static str,
    /// The values the number may take.
    pub domain: Domain,
    /// Accessor.
    pub field: fn(&mut Device) -> &mut f64,
}

/// The values a device number may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Domain {
    /// Greater than 0.
    Positive,
    /// 0 or more: 0 means the cost the number prices does not exist.
    NonNegative,
    /// A fraction in (0, 1].
    Fraction,
}

impl Domain {
    /// Whether `v` is one of the domain's values.
    pub fn contains(self, v: f64) -> bool {
        v.is_finite()
            && match self {
                Domain::Positive => v > 0.0,
                Domain::NonNegative => v >= 0.0,
                Domain::Fraction => v > 0.0 && v <= 1.0,
            }
    }

    /// What a value of the domain is, for an error message (`unit`: the number's unit).
    pub fn expected(self, unit: &str) -> String {
        match self {
            Domain::Positive => format!("a positive number of {unit}"),
            Domain::NonNegative => format!("a number of {unit} >= 0"),
            Domain::Fraction => "a fraction in (0, 1]".to_string(),
        }
    }
}

/// Every overridable field of a device, with user-facing units.
pub const DEVICE_FIELDS: &[DeviceField] = &[
    DeviceField {
        key: "sm_count",
        unit: "SMs",
        scale: 1.0,
        doc: "streaming multiprocessors",
        domain: Domain::Positive,
        field: |d| &mut d.sm_count,
    },
    DeviceField {
        key: "peak_bf16_tflops",
        unit: "TFLOP/s",
        scale: 1e12,
        doc: "dense bf16/fp16 tensor-core peak",
        domain: Domain::Positive,
        field: |d| &mut d.peak_bf16_flops,
    },
    DeviceField {
        key: "peak_fp8_tflops",
        unit: "TFLOP/s",
        scale: 1e12,
        doc: "dense FP8 tensor-core peak (0: no FP8 tensor cores)",
        domain: Domain::NonNegative,
        field: |d| &mut d.peak_fp8_flops,
    },
    DeviceField {
        key: "peak_fp32_tflops",
        unit: "TFLOP/s",
        scale: 1e12,
        doc: "fp32 peak without tensor cores",
        domain: Domain::Positive,
        field: |d| &mut d.peak_fp32_flops,
    },
    DeviceField {
        key: "hbm_gib",
        unit: "GiB",
        scale: GIB,
        doc: "memory capacity",
        domain: Domain::Positive,
        field: |d| &mut d.hbm_bytes,
    },
    DeviceField {
        key: "hbm_tbps",
        unit: "TB/s",
        scale: 1e12,
        doc: "memory bandwidth",
        domain: Domain::Positive,
        field: |d| &mut d.hbm_bandwidth,
    },
    DeviceField {
        key: "nvlink_gbps",
        unit: "GB/s",
        scale: 1e9,
        doc: "NVLink bandwidth per GPU and direction",
        domain: Domain::Positive,
        field: |d| &mut d.nvlink_bandwidth,
    },
    DeviceField {
        key: "nvlink_latency_us",
        unit: "us",
        scale: 1e-6,
        doc: "collective start-up latency inside a node",
        domain: Domain::Positive,
        field: |d| &mut d.nvlink_latency,
    },
    DeviceField {
        key: "internode_latency_us",
        unit: "us",
        scale: 1e-6,
        doc: "collective start-up latency across nodes",
        domain: Domain::Positive,
        field: |d| &mut d.internode_latency,
    },
    DeviceField {
        key: "matmul_efficiency",
        unit: "fraction",
        scale: 1.0,
        doc: "fraction of peak that the matrix products of a training step sustain",
        domain: Domain::Fraction,
        field: |d| &mut d.matmul_efficiency,
    },
    DeviceField {
        key: "gemm_pipeline_depth",
        unit: "elements",
        scale: 1.0,
        doc: "reduction length a matrix product spends per output tile filling its pipeline",
        domain: Domain::NonNegative,
        field: |d| &mut d.gemm_pipeline_depth,
    },
    DeviceField {
        key: "attention_efficiency",
        unit: "fraction",
        scale: 1.0,
        doc: "fraction of peak reached by FlashAttention-2 (flash-attn, PyTorch SDPA)",
        domain: Domain::Fraction,
        field: |d| &mut d.attention_efficiency,
    },
    DeviceField {
        key: "fused_attention_efficiency",
        unit: "fraction",
        scale: 1.0,
        doc: "fraction of peak reached by cuDNN's fused attention (Transformer Engine)",
        domain: Domain::Fraction,
        field: |d| &mut d.fused_attention_efficiency,
    },
    DeviceField {
        key: "hbm_efficiency",
        unit: "fraction",
        scale: 1.0,
        doc: "fraction of memory bandwidth reached by streaming kernels",
        domain: Domain::Fraction,
        field: |d| &mut d.hbm_efficiency,
    },
    DeviceField {
        key: "nvlink_efficiency",
        unit: "fraction",
        scale: 1.0,
        doc: "fraction of NVLink bandwidth reached by collectives",
        domain: Domain::Fraction,
        field: |d| &mut d.nvlink_efficiency,
    },
    DeviceField {
        key: "internode_efficiency",
        unit: "fraction",
        scale: 1.0,
        doc: "fraction of network bandwidth reached by collectives",
        domain: Domain::Fraction,
        field: |d| &mut d.internode_efficiency,
    },
    DeviceField {
        key: "kernel_overhead_us",
        unit: "us",
        scale: 1e-6,
        doc: "fixed cost per kernel launch",
        domain: Domain::Positive,
        field: |d| &mut d.kernel_overhead,
    },
    DeviceField {
        key: "reserved_gib",
        unit: "GiB",
        scale: GIB,
        doc: "memory held by CUDA context, libraries and NCCL",
        domain: Domain::Positive,
        field: |d| &mut d.reserved_bytes,
    },
];

/// Names of the built-in device presets.
pub const PRESET_NAMES: &[&str] = &["a100-40g", "a100-80g", "h100-sxm", "h200", "cpu"];

const MIB: f64 = 1024.0 * 1024.0;

/// Fraction of the A100's tensor-core peak that the matrix products of a training step sustain
/// (dimensionless), before tile and wave quantisation and the pipeline fill of short reductions
/// ([`TENSOR_CORE_PIPELINE_DEPTH`]).
///
/// Microbenchmarks bound it from above: `mamf-finder` (S. Bekman, *Machine Learning
/// Engineering*, "compute" chapter) reaches 271.2 of 312 TFLOP/s (0.87) on the best shape of a
/// sweep, one GPU, a few seconds at a time. A training step sustains less: eight GPUs at their
/// power limit for hours, and the shapes the model has rather than the best one. With 0.87
/// Megatron-LM's published A100 results came out 12-26% faster than measured. The value is
/// therefore calibrated on published end-to-end runs by a stated rule: MosaicML's A100
/// throughput tables for its MPT models (llm-foundry, `scripts/train/benchmarking/README.md`,
/// 40 and 80 GB, PyTorch FSDP), keeping the 25 rows whose time goes to matrix products: models
/// of 7B parameters or more, activation checkpointing on, sequences of at most 2048. It is the
/// value that makes the median error of those rows zero (0.747, each row priced with
/// llm-foundry's runtime settings, its Triton attention kernel and its table's gradient
/// reduction dtype; 0.724 while its attention was priced as the CUDA kernel, 0.710 before the
/// pipeline fill was priced). Megatron-LM's 2021 results (Narayanan et al., Table 1) are not
/// part of the fit and check it. `tests/tests/calibration.rs` repeats the fit.
pub const AMPERE_MATMUL_EFFICIENCY: f64 = 0.75;

/// Reduction length, in elements, that a tensor-core matrix product spends per output tile
/// outside its main loop ([`Device::gemm_pipeline_depth`]). A tiled kernel computes each output
/// tile in a loop over the reduction dimension, one k tile at a time, software-pipelined over
/// shared-memory stages (CUTLASS, *Efficient GEMM in CUDA*, "Software pipelining"): before the
/// first multiply-accumulate it fills the pipeline, and after the last its epilogue converts
/// and writes the tile; neither overlaps the tensor cores. Those steps take about one main-loop
/// iteration per stage, so a tile with reduction `k` takes as long as `k + 192` would at the
/// main loop's rate. 192 = 3 stages x 64-wide k tiles, the shape of the Ampere bf16 tensor-op
/// kernels (128x256x64 or 256x128x64 tiles, 3 stages: CUTLASS's default for SM80, and the
/// structure of cuBLAS's); Hopper's 16-bit kernels keep the 64-wide k tile, and the same value
/// is taken (FP8 products, whose k tiles are twice as wide, spend twice the elements:
/// [`crate::cost::analytic::FP8_K_TILE_WIDENING`]). A reduction of 8192 or more loses under 3%; the 768-wide reductions of a 125M model
/// lose 20%, and the head-dimension reductions of unfused attention's score product more.
pub const TENSOR_CORE_PIPELINE_DEPTH: f64 = 192.0;

/// Fraction of the H100/H200 tensor-core peak that the matrix products of a training step
/// sustain (dimensionless). `mamf-finder` bounds it from above at 794.5 of 989 TFLOP/s (0.80; H200
/// has the same GH100 die and clocks). Calibrated by the rule of [`AMPERE_MATMUL_EFFICIENCY`]
/// on MosaicML's H100 bf16 table: its 8 rows of 7B or more with checkpointing and sequences of at
/// most 2048 have a median error of zero at 0.635 (0.615 while every fused attention kernel on
/// Hopper was priced at one efficiency between FlashAttention-2's and cuDNN's, which made
/// llm-foundry's Triton kernel, slower than FlashAttention-2, 1.7x too fast; 0.602 while that
/// kernel was priced as the CUDA one).
pub const HOPPER_MATMUL_EFFICIENCY: f64 = 0.64;

/// A built-in device by name.
///
/// Sources. SM counts, peaks, memory bandwidth and NVLink: NVIDIA A100 and H100/H200 SXM datasheets (the
/// FP8 peak is the datasheet's 3,958 TFLOP/s "with sparsity" halved; A100 has no FP8; NVLink
/// is quoted there as total bidirectional bandwidth: 600 and 900 GB/s, i.e. 300 and 450 GB/s per
/// direction). Memory capacity: the total `nvidia-smi` reports. The network between nodes is the
/// cluster's ([`Network`]); the efficiency and latency of collectives over it are the device's.
/// Matmul efficiency: calibrated, see [`AMPERE_MATMUL_EFFICIENCY`]. GEMM pipeline depth: the
/// tensor-core kernels' tile structure, see [`TENSOR_CORE_PIPELINE_DEPTH`].
/// Attention efficiency, of FlashAttention-2's CUDA kernels: its paper reports 50-73% of A100
/// peak forward and less backward (0.6 for the pair). On H100 SXM, Shah et al.
/// (*FlashAttention-3*, 2024, Figs. 5-6: head dimension 128, 8k tokens) measure it at 333
/// TFLOP/s forward (causal) and 318 backward, 322 for a training step's pair (backward = 2.5x
/// the forward's FLOPs): 0.33 of the 989 peak (an Azure ND H100 v5 benchmark measures 328
/// forward at batch 2 x 8192, head dimension 128). FlashAttention-2 is an Ampere kernel; it
/// uses none of Hopper's TMA or warpgroup MMA. Fused attention efficiency, of cuDNN's kernels:
/// in the same figures 529 forward and 518 backward, 521 for the pair, 0.53; on A100 cuDNN's
/// attention runs 0.82x FlashAttention-2's (huggingface/transformers#48163, which measured it
/// across GPUs before preferring cuDNN on Hopper only), 0.49. Transformer Engine picks the
/// faster of the two per device (`auto`). The Triton kernel runs slower than
/// FlashAttention-2 by a documented factor
/// ([`crate::cost::analytic::TRITON_FLASH_ATTENTION_SPEED`]). Memory efficiency:
/// streaming (STREAM/BabelStream copy) kernels reach ~90% of HBM peak on both generations.
/// Collective efficiency: `nccl-tests` all-reduce bus bandwidth on DGX A100 is ~230 GB/s of 300
/// (0.77), on DGX H100 ~360 of 450 (0.8); across nodes ~90% of the adapter rate. Latencies:
/// small-message NCCL all-reduce takes ~10 us inside a node and ~20 us across nodes. Kernel
/// overhead: launch plus inter-kernel gap of eager PyTorch, a few microseconds. Reserved memory:
/// CUDA context with cuBLAS and NCCL communicators, about 1 GiB per process.
///
/// `cpu` is one thread of the host as the CPU executor runs it (`autopar run`, `autopar profile
/// run`), so plans can be executed and their predictions checked on any machine: one core with
/// two 8-wide f32 FMA units at 3.75 GHz (120 GFLOP/s; no faster bf16 path), of which the
/// `matrixmultiply` products the backend uses reach 0.55-0.8 on large shapes (0.6 taken; no
/// tensor-core pipeline to fill, so a GEMM pipeline depth of 0); about
/// 30 GB/s of streaming bandwidth for one core (Adam over 19.4 M parameters, 620 MB, takes
/// 23 ms); the 8 GiB the CPU backend's state guard allows; collectives between threads through
/// shared memory. These were measured on the 2-core AMD EPYC machine that made this preset and
/// are rough by nature: `autopar profile run --backend cpu` measures the host's kernels and
/// collectives, and plans then read those.
pub fn preset(name: &str) -> Option<Device> {
    let ampere = |name: &str, hbm_mib: f64, hbm_bw: f64| Device {
        name: name.to_string(),
        sm_count: 108.0,
        peak_bf16_flops: 312e12,
        peak_fp32_flops: 19.5e12,
        peak_fp8_flops: 0.0,
        hbm_bytes: hbm_mib * MIB,
        hbm_bandwidth: hbm_bw,
        nvlink_bandwidth: 300e9,
        nvlink_latency: 10e-6,
        internode_latency: 20e-6,
        matmul_efficiency: AMPERE_MATMUL_EFFICIENCY,
        gemm_pipeline_depth: TENSOR_CORE_PIPELINE_DEPTH,
        attention_efficiency: 0.6,
        fused_attention_efficiency: 0.49,
        hbm_efficiency: 0.9,
        nvlink_efficiency: 0.77,
        internode_efficiency: 0.9,
        kernel_overhead: 4e-6,
        reserved_bytes: GIB,
    };
    let hopper = |name: &str, hbm_mib: f64, hbm_bw: f64| Device {
        name: name.to_string(),
        sm_count: 132.0,
        peak_bf16_flops: 989e12,
        peak_fp32_flops: 67e12,
        peak_fp8_flops: 1979e12,
        hbm_bytes: hbm_mib * MIB,
        hbm_bandwidth: hbm_bw,
        nvlink_bandwidth: 450e9,
        nvlink_latency: 10e-6,
        internode_latency: 20e-6,
        matmul_efficiency: HOPPER_MATMUL_EFFICIENCY,
        gemm_pipeline_depth: TENSOR_CORE_PIPELINE_DEPTH,
        attention_efficiency: 0.33,
        fused_attention_efficiency: 0.53,
        hbm_efficiency: 0.9,
        nvlink_efficiency: 0.8,
        internode_efficiency: 0.9,
        kernel_overhead: 4e-6,
        reserved_bytes: GIB,
    };
    Some(match name {
        "a100-40g" => ampere(name, 40960.0, 1.555e12),
        "a100-80g" => ampere(name, 81920.0, 2.039e12),
        "h100-sxm" => hopper(name, 81559.0, 3.35e12),
        "h200" => hopper(name, 143771.0, 4.8e12),
        "cpu" => Device {
            name: name.to_string(),
            sm_count: 1.0,
            peak_bf16_flops: 120e9,
            peak_fp32_flops: 120e9,
            peak_fp8_flops: 0.0,
            hbm_bytes: 8.0 * GIB,
            hbm_bandwidth: 30e9,
            nvlink_bandwidth: 5e9,
            nvlink_latency: 20e-6,
            internode_latency: 20e-6,
            matmul_efficiency: 0.6,
            gemm_pipeline_depth: 0.0,
            attention_efficiency: 0.2,
            fused_attention_efficiency: 0.2,
            hbm_efficiency: 0.9,
            nvlink_efficiency: 0.5,
            internode_efficiency: 0.5,
            kernel_overhead: 1e-6,
            reserved_bytes: 64.0 * MIB,
        },
        _ => return None,
    })
}

/// The network between nodes: the adapters of a node that carry GPU traffic (the compute
/// fabric, not storage or management ports) and their line rate.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Network {
    /// Adapters per node.
    pub nics_per_node: u64,
    /// Line rate of one adapter, per direction, bytes/s.
    pub nic_bandwidth: f64,
}

impl Network {
    /// Bytes/s in a Gb/s (the unit adapters are sold in).
    pub const GBIT: f64 = 1e9 / 8.0;

    /// The network a bare device preset gets on nodes of `gpus_per_node` GPUs: one adapter per
    /// GPU at the rate of its generation's DGX (200 Gb/s HDR InfiniBand for A100, 400 Gb/s NDR
    /// for H100 and H200; see [`NODE_PRESETS`]); the `cpu` device's threads share memory, taken
    /// as 40 Gb/s.
    pub fn default_for(device: &str, gpus_per_node: u64) -> Network {
        let gbit = match device {
            "a100-40g" | "a100-80g" => 200.0,
            "cpu" => 40.0,
            _ => 400.0,
        };
        Network {
            nics_per_node: gpus_per_node,
            nic_bandwidth: gbit * Network::GBIT,
        }
    }
}

/// A node model: a device preset, its GPUs per node and its network.
#[derive(Clone, Copy, Debug)]
pub struct NodePreset {
    /// Name (`dgx-a100`, ...).
    pub name: &'static str,
    /// The device preset of its GPUs.
    pub device: &'static str,
    /// GPUs per node.
    pub gpus_per_node: u64,
    /// Compute-fabric adapters per node.
    pub nics_per_node: u64,
    /// Line rate of one adapter, Gb/s.
    pub nic_gbits: f64,
    /// What the node is, with the source of its numbers.
    pub doc: &'static str,
}

/// The built-in node presets.
///
/// Sources: the NVIDIA DGX A100 and DGX H100/H200 user guides (eight single-port ConnectX-6
/// 200 Gb/s HDR, or ConnectX-7 400 Gb/s NDR, InfiniBand adapters for the compute fabric, one per
/// GPU, cabled rail-optimised; the storage adapters are not counted), and the Amazon EC2 P4
/// instance page (p4d.24xlarge and p4de.24xlarge: eight A100 40 GB or 80 GB and 400 Gb/s of
/// Elastic Fabric Adapter networking as four 100 Gb/s adapters, two GPUs per adapter).
pub const NODE_PRESETS: &[NodePreset] = &[
    NodePreset {
        name: "dgx-a100",
        device: "a100-80g",
        gpus_per_node: 8,
        nics_per_node: 8,
        nic_gbits: 200.0,
        doc: "NVIDIA DGX A100 640GB: 8 x A100 80GB, 8 x 200 Gb/s HDR InfiniBand",
    },
    NodePreset {
        name: "dgx-a100-40g",
        device: "a100-40g",
        gpus_per_node: 8,
        nics_per_node: 8,
        nic_gbits: 200.0,
        doc: "NVIDIA DGX A100 320GB: 8 x A100 40GB, 8 x 200 Gb/s HDR InfiniBand",
    },
    NodePreset {
        name: "dgx-h100",
        device: "h100-sxm",
        gpus_per_node: 8,
        nics_per_node: 8,
        nic_gbits: 400.0,
        doc: "NVIDIA DGX H100: 8 x H100 SXM 80GB, 8 x 400 Gb/s NDR InfiniBand",
    },
    NodePreset {
        name: "dgx-h200",
        device: "h200",
        gpus_per_node: 8,
        nics_per_node: 8,
        nic_gbits: 400.0,
        doc: "NVIDIA DGX H200: 8 x H200 141GB, 8 x 400 Gb/s NDR InfiniBand",
    },
    NodePreset {
        name: "p4d",
        device: "a100-40g",
        gpus_per_node: 8,
        nics_per_node: 4,
        nic_gbits: 100.0,
        doc: "AWS p4d.24xlarge: 8 x A100 40GB, 4 x 100 Gb/s EFA (two GPUs per adapter)",
    },
    NodePreset {
        name: "p4de",
        device: "a100-80g",
        gpus_per_node: 8,
        nics_per_node: 4,
        nic_gbits: 100.0,
        doc: "AWS p4de.24xlarge: 8 x A100 80GB, 4 x 100 Gb/s EFA (two GPUs per adapter)",
    },
];

/// The node preset called `name`.
pub fn node_preset(name: &str) -> Option<&'static NodePreset> {
    NODE_PRESETS.iter().find(|n| n.name == name)
}

/// Every preset name a cluster may start from: the devices, then the nodes.
pub fn cluster_preset_names() -> String {
    PRESET_NAMES
        .iter()
        .copied()
        .chain(NODE_PRESETS.iter().map(|n| n.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A homogeneous cluster: `nodes` nodes of `gpus_per_node` GPUs, NVLink inside a node, the
/// nodes joined by `network`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    /// Name (informational).
    pub name: String,
    /// Number of nodes.
    pub nodes: u64,
    /// GPUs per node.
    pub gpus_per_node: u64,
    /// The GPU model.
    pub device: Device,
    /// The adapters between nodes.
    pub network: Network,
}

/// Effective cost parameters of the links a communication group uses.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    /// Start-up latency (alpha) of one collective or transfer, s: the device's, paid once
    /// (it stands for NCCL's base latency and the launch); each ring step adds its own.
    pub latency: f64,
    /// Achieved bus bandwidth per GPU and direction (1 / beta) of the ring and tree collectives
    /// (all-reduce, all-gather, reduce-scatter), bytes/s.
    pub bandwidth: f64,
    /// Achieved bandwidth of one GPU's own transfers (all-to-all, point-to-point), bytes/s.
    pub pairwise_bandwidth: f64,
    /// Nodes the group spans (1: inside one node).
    pub nodes: u64,
}

impl Link {
    /// Whether the group spans several nodes.
    pub fn internode(&self) -> bool {
        self.nodes > 1
    }
}

impl Cluster {
    /// The cluster `nodes x gpus_per_node` of a device or node preset, with the preset's
    /// network (a device preset: [`Network::default_for`]). A node preset fixes its GPUs per
    /// node unless `gpus_per_node` says otherwise; a device preset needs it.
    pub fn from_preset(
        name: &str,
        preset_name: &str,
        nodes: u64,
        gpus_per_node: Option<u64>,
    ) -> Result<Cluster, String> {
        let (device, gpn, network) = if let Some(node) = node_preset(preset_name) {
            let device = preset(node.device).ok_or_else(|| {
                format!(
                    "node preset `{preset_name}` names an unknown device `{}`",
                    node.device
                )
            })?;
            let network = Network {
                nics_per_node: node.nics_per_node,
                nic_bandwidth: node.nic_gbits * Network::GBIT,
            };
            (device, gpus_per_node.unwrap_or(node.gpus_per_node), network)
        } else if let Some(device) = preset(preset_name) {
            let gpn = gpus_per_node.ok_or_else(|| {
                format!(
                    "`{preset_name}` is a GPU, so the GPUs per node must be given (a node preset \
                     such as {} carries its own)",
                    NODE_PRESETS[0].name
                )
            })?;
            (device, gpn, Network::default_for(preset_name, gpn))
        } else {
            return Err(format!(
                "unknown preset `{preset_name}` (known: {})",
                cluster_preset_names()
            ));
        };
        let cluster = Cluster {
            name: name.to_string(),
            nodes,
            gpus_per_node: gpn,
            device,
            network,
        };
        cluster.check_size()?;
        Ok(cluster)
    }

    /// Total number of GPUs.
    pub fn gpus(&self) -> u64 {
        self.nodes.saturating_mul(self.gpus_per_node)
    }

    /// Checks the size against [`crate::limits::MAX_GPUS`].
    pub fn check_size(&self) -> Result<(), String> {
        if self.gpus() > crate::limits::MAX_GPUS {
            return Err(format!(
                "{} x {} = {} GPUs, more than the {} autopar plans for",
                self.nodes,
                self.gpus_per_node,
                self.gpus(),
                crate::limits::MAX_GPUS
            ));
        }
        Ok(())
    }

    /// Network bandwidth one GPU achieves when every GPU of its node sends across nodes at
    /// once (what SPMD training does: every rank of a layout is in a data-parallel group, and
    /// all of a stage's ranks send its activations together): the node's adapters shared by its
    /// GPUs, at the collectives' efficiency. Two GPUs per adapter (AWS p4d) get half an
    /// adapter each.
    pub fn network_share(&self) -> f64 {
        let node = self.network.nics_per_node as f64
            * self.network.nic_bandwidth
            * self.device.internode_efficiency;
        node / self.gpus_per_node.max(1) as f64
    }

    /// Link of a group of `size` ranks `stride` apart, ranks being numbered node by node (the
    /// Megatron-LM order: tensor-parallel ranks adjacent, then data-parallel, then pipeline). The
    /// group stays inside a node when it spans at most one node's worth of consecutive ranks.
    ///
    /// A group that spans nodes with `k` of its ranks on each node runs its ring and tree
    /// collectives over the network share of those `k` GPUs at once (NCCL spreads its channels
    /// over every adapter it finds; NCCL's maintainers measure 192 GB/s all-reduce bus bandwidth
    /// between DGX A100 nodes of eight 25 GB/s adapters, NVIDIA/nccl#812), up to what NVLink
    /// inside the node carries. All-to-all and point-to-point transfers cannot aggregate
    /// adapters (NVIDIA/nccl-tests#267): each GPU's own traffic to another node goes through its
    /// own share. The start-up latency is paid once; the link records the nodes the group
    /// spans, from which `analytic::collective_time` counts the ring's steps on each kind of
    /// link (or the depth of NCCL's trees for an all-reduce).
    pub fn group_link(&self, stride: u64, size: u64) -> Link {
        let d = &self.device;
        let nvlink = d.nvlink_bandwidth * d.nvlink_efficiency;
        let gpn = self.gpus_per_node.max(1);
        if stride.saturating_mul(size) <= gpn {
            Link {
                latency: d.nvlink_latency,
                bandwidth: nvlink,
                pairwise_bandwidth: nvlink,
                nodes: 1,
            }
        } else {
            let share = self.network_share();
            let per_node = (gpn / stride.max(1)).clamp(1, size);
            let nodes = size.div_ceil(per_node).max(2);
            Link {
                latency: d.internode_latency,
                bandwidth: (share * per_node as f64).min(nvlink.max(share)),
                pairwise_bandwidth: share,
                nodes,
            }
        }
    }

    /// Link between ranks `from` and `to` (a point-to-point transfer).
    pub fn p2p_link(&self, from: u64, to: u64) -> Link {
        let same_node = from / self.gpus_per_node == to / self.gpus_per_node;
        if same_node {
            self.group_link(1, 1)
        } else {
            self.group_link(self.gpus_per_node, 2)
        }
    }
}

/// Parses the cluster shorthand `PRESET:NODESxGPUS` (e.g. `a100-80g:48x8`), or `NODE:NODES` for
/// a node preset (e.g. `dgx-h100:16`).
pub fn parse_cluster_shorthand(s: &str) -> Result<Cluster, String> {
    let (preset_name, shape) = s.split_once(':').ok_or_else(|| {
        format!("`{s}` is not of the form PRESET:NODESxGPUS (or NODE-PRESET:NODES)")
    })?;
    let parse = |v: &str, what: &str| -> Result<u64, String> {
        match v.parse::<u64>() {
            Ok(0) | Err(_) => Err(format!("{what} must be a positive integer, found `{v}`")),
            Ok(x) => Ok(x),
        }
    };
    let (nodes, gpus) = match shape.split_once('x') {
        Some((n, g)) => (
            parse(n, "the number of nodes")?,
            Some(parse(g, "GPUs per node")?),
        ),
        None if node_preset(preset_name).is_some() => (parse(shape, "the number of nodes")?, None),
        None if preset(preset_name).is_some() => {
            return Err(format!("`{shape}` is not of the form NODESxGPUS"));
        }
        // Unknown presets are reported as such below.
        None => (parse(shape, "the number of nodes")?, None),
    };
    Cluster::from_preset(s, preset_name, nodes, gpus)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_has_sane_numbers() {
        for name in PRESET_NAMES {
            let mut d = preset(name).expect("preset exists");
            for f in DEVICE_FIELDS {
                let v = *(f.field)(&mut d);
                assert!(f.domain.contains(v), "{name}.{} = {v}", f.key);
            }
        }
    }

    #[test]
    fn shorthand_parses_and_rejects() {
        let c = parse_cluster_shorthand("a100-80g:48x8").expect("valid");
        assert_eq!((c.nodes, c.gpus_per_node, c.gpus()), (48, 8, 384));
        assert!(parse_cluster_shorthand("a100-80g:0x8").is_err());
        assert!(parse_cluster_shorthand("tpu:1x8").is_err());
        assert!(parse_cluster_shorthand("a100-80g").is_err());
    }

    #[test]
    fn groups_inside_a_node_use_nvlink() {
        let c = parse_cluster_shorthand("h100-sxm:4x8").expect("valid");
        assert!(!c.group_link(1, 8).internode());
        assert!(!c.group_link(2, 4).internode());
        assert!(c.group_link(8, 4).internode());
        assert!(c.group_link(1, 16).internode());
        assert!(!c.p2p_link(3, 4).internode());
        assert!(c.p2p_link(7, 8).internode());
    }

    #[test]
    fn groups_across_nodes_aggregate_the_adapters_of_their_ranks_on_each_node() {
        let c = parse_cluster_shorthand("a100-80g:4x8").expect("valid");
        let nic = 25e9 * 0.9;
        let nvlink = 300e9 * 0.77;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-3 * b;
        // One rank per node (data parallelism under tp 8): one adapter each.
        let l = c.group_link(8, 4);
        assert!(close(l.bandwidth, nic) && close(l.pairwise_bandwidth, nic));
        // Two, four ranks per node: two, four adapters.
        assert!(close(c.group_link(4, 8).bandwidth, 2.0 * nic));
        assert!(close(c.group_link(2, 16).bandwidth, 4.0 * nic));
        // Eight: eight adapters (180 GB/s), under NVLink's 231 GB/s.
        let l = c.group_link(1, 32);
        assert!(close(l.bandwidth, 8.0 * nic));
        // All-to-all and point-to-point still go through one adapter per GPU.
        assert!(close(l.pairwise_bandwidth, nic));
        assert!(close(c.p2p_link(7, 8).pairwise_bandwidth, nic));
        // NVLink caps the aggregate: 16 adapters of 25 GB/s would exceed it.
        let mut wide = c.clone();
        wide.gpus_per_node = 16;
        wide.network.nics_per_node = 16;
        assert!(close(wide.group_link(1, 32).bandwidth, nvlink));
        // Inside a node both are NVLink.
        let l = c.group_link(1, 8);
        assert!(close(l.bandwidth, nvlink) && close(l.pairwise_bandwidth, nvlink));
    }

    #[test]
    fn gpus_that_share_an_adapter_share_its_bandwidth() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-3 * b;
        // p4d: four 100 Gb/s adapters for eight GPUs, 5.625 GB/s achieved per GPU.
        let p4d = parse_cluster_shorthand("p4d:4").expect("valid");
        assert_eq!((p4d.nodes, p4d.gpus_per_node), (4, 8));
        assert_eq!(p4d.device.name, "a100-40g");
        let share = 4.0 * 12.5e9 * 0.9 / 8.0;
        assert!(close(p4d.network_share(), share));
        // One rank per node: its share; a whole node's ranks: the node's four adapters.
        let l = p4d.group_link(8, 4);
        assert!(close(l.bandwidth, share) && close(l.pairwise_bandwidth, share));
        assert!(close(p4d.group_link(1, 32).bandwidth, 8.0 * share));
        // The same GPUs on a DGX (eight 200 Gb/s adapters) get four times as much.
        let dgx = parse_cluster_shorthand("dgx-a100-40g:4").expect("valid");
        assert_eq!(dgx.device, p4d.device);
        assert!(close(dgx.group_link(8, 4).bandwidth, 4.0 * share));
        // A bare device preset gets the DGX network of its generation.
        let bare = parse_cluster_shorthand("a100-40g:4x8").expect("valid");
        assert_eq!(bare.network, dgx.network);
        assert_eq!(bare.group_link(8, 4), dgx.group_link(8, 4));
    }

    #[test]
    fn a_group_knows_the_nodes_it_spans() {
        let c = parse_cluster_shorthand("dgx-h100:64").expect("valid");
        let nodes = |stride, size| c.group_link(stride, size).nodes;
        assert_eq!(nodes(1, 8), 1);
        assert_eq!(nodes(8, 2), 2);
        assert_eq!(nodes(8, 3), 3);
        assert_eq!(nodes(8, 64), 64);
        assert_eq!(nodes(1, 512), 64);
        // Two ranks of each node (stride 4): 16 ranks on 8 nodes.
        assert_eq!(nodes(4, 16), 8);
        // The start-up is paid once, whatever the nodes; ring steps add the rest.
        assert_eq!(c.group_link(8, 64).latency, c.device.internode_latency);
        assert_eq!(c.group_link(1, 8).latency, c.device.nvlink_latency);
    }

    proptest::proptest! {
        #[test]
        fn shorthand_never_panics_and_sizes_what_it_accepts(
            name in "(dgx-a100|p4d|a100-80g|h200|cpu|x)",
            nodes in "[0-9]{0,8}",
            gpus in proptest::option::of("[0-9]{0,4}"),
        ) {
            let text = match &gpus {
                Some(g) => format!("{name}:{nodes}x{g}"),
                None => format!("{name}:{nodes}"),
            };
            if let Ok(c) = parse_cluster_shorthand(&text) {
                proptest::prop_assert_eq!(c.nodes.to_string(), nodes.trim_start_matches('0'));
                proptest::prop_assert!(c.gpus() <= crate::limits::MAX_GPUS);
                proptest::prop_assert!(c.network_share() > 0.0);
            }
        }

        #[test]
        fn arbitrary_shorthand_never_panics(text in "\\PC{0,40}") {
            let _ = parse_cluster_shorthand(&text);
        }
    }

    #[test]
    fn node_presets_resolve_and_device_presets_need_their_node_size() {
        for n in NODE_PRESETS {
            let c = Cluster::from_preset(n.name, n.name, 2, None).expect("node preset");
            assert_eq!(c.gpus_per_node, n.gpus_per_node);
            assert_eq!(c.network.nics_per_node, n.nics_per_node);
            assert!(preset(n.device).is_some(), "{}", n.name);
        }
        let h = parse_cluster_shorthand("dgx-h100:2x4").expect("fewer GPUs per node");
        assert_eq!((h.gpus_per_node, h.network.nics_per_node), (4, 8));
        let e = parse_cluster_shorthand("a100-80g:4").expect_err("needs GPUs per node");
        assert!(e.contains("NODESxGPUS"), "{e}");
        let e = Cluster::from_preset("x", "a100-80g", 4, None).expect_err("needs GPUs per node");
        assert!(e.contains("GPUs per node must be given"), "{e}");
        let e = parse_cluster_shorthand("dgx-b300:4").expect_err("unknown");
        assert!(e.contains("dgx-a100") && e.contains("h100-sxm"), "{e}");
    }
}
