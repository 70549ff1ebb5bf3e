//! The analytic cost model: a roofline for kernels and alpha-beta formulas for collectives
//! (ALGORITHMS.md §3 and §6).

use crate::cost::cluster::{Device, Link};
use crate::model::graph::{DType, FlashKernel, Op, OpKind, Pass, TensorId};

/// A collective operation over a communication group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// Sum over the group, result on every rank.
    AllReduce,
    /// Concatenation of every rank's shard on every rank.
    AllGather,
    /// Sum over the group, each rank keeping one shard.
    ReduceScatter,
    /// Every rank sends a distinct shard to every other rank.
    AllToAll,
}

/// Time of a collective over `n` ranks whose full payload (the reduced tensor, or the gathered
/// result) is `bytes`, on links with start-up latency alpha and bus bandwidth 1/beta:
///
/// ```text
/// all-reduce      alpha + min(ring, tree)
/// all-gather      alpha + ring,  ring = min over protocols of steps + (n-1)/n * bytes * beta / f
/// reduce-scatter  alpha + ring
/// all-to-all      alpha + (n-1)/n^2 * bytes * beta
/// ```
///
/// The ring and tree terms follow NCCL's own tuning model (`ring_time`, `tree_time`): each
/// of a ring's `n - 1` steps (twice that for an all-reduce) pays a hop's latency, and NCCL runs
/// each call with whichever protocol is fastest for its size. All-to-all runs at the link's
/// pairwise bandwidth, every pair at once, so it pays the start-up only.
pub fn collective_time(kind: Collective, n: u64, bytes: f64, link: Link) -> f64 {
    if n <= 1 || bytes <= 0.0 {
        return 0.0;
    }
    let f = (n as f64 - 1.0) / n as f64;
    let wire = |volume: f64| volume * bytes / link.bandwidth;
    link.latency
        + match kind {
            Collective::AllToAll => f / n as f64 * bytes / link.pairwise_bandwidth,
            Collective::AllGather | Collective::ReduceScatter => {
                ring_time(n, link.nodes, 1, wire(f))
            }
            Collective::AllReduce => {
                ring_time(n, link.nodes, 2, wire(2.0 * f)).min(tree_time(n, link.nodes, wire(2.0)))
            }
        }
}

/// One of NCCL's three protocols as its tuning model prices it (NVIDIA/nccl,
/// `src/graph/tuning.cc`, `ncclTopoTuneModel`: the `hwLat` table and the bandwidth
/// refinements of the releases with NVLS). LL and LL128 trade bandwidth for shorter steps,
/// so small payloads take them and large ones take Simple.
struct Protocol {
    /// Fraction of the bus bandwidth a ring reaches: an all-gather or reduce-scatter inside a
    /// node; an all-reduce inside a node, or any ring across nodes; a ring across nodes with
    /// fewer than two ranks per node, whose GPUs send and receive through one adapter.
    ring_bandwidth: [f64; 3],
    /// Latency of one ring step over NVLink and over the network, s.
    ring_step: [f64; 2],
    /// Fraction of the bus bandwidth a tree reaches: inside a node, and across nodes.
    tree_bandwidth: [f64; 2],
    /// Latency of one tree hop over NVLink and over the network, s.
    tree_step: [f64; 2],
    /// Floor on a ring step inside a node when the ring also crosses nodes: every step then
    /// posts network work (NCCL's `getNetOverhead`, 1 us on x86; three times that for Simple).
    net_overhead: f64,
}

/// LL, LL128 and Simple. LL128 is NCCL's default on NVLink nodes whose adapters sit on the
/// GPUs' PCIe switches (every DGX and HGX node); trees reach 92% of the bus bandwidth.
const PROTOCOLS: [Protocol; 3] = [
    Protocol {
        ring_bandwidth: [1.0 / 3.0, 1.0 / 4.0, 1.0 / 4.0],
        ring_step: [0.6e-6, 2.7e-6],
        tree_bandwidth: [0.92 / 3.8, 0.92 / 3.8],
        tree_step: [0.6e-6, 5.0e-6],
        net_overhead: 1e-6,
    },
    Protocol {
        ring_bandwidth: [0.92, 0.92, 0.7],
        ring_step: [1.9e-6, 4.0e-6],
        tree_bandwidth: [0.92 * 7.0 / 9.0, 0.92 * 120.0 / 128.0],
        tree_step: [1.25e-6, 8.5e-6],
        net_overhead: 1e-6,
    },
    Protocol {
        ring_bandwidth: [1.0, 1.0, 1.0],
        ring_step: [3.4e-6, 14.0e-6],
        tree_bandwidth: [0.92, 0.92],
        tree_step: [28e-6, 28e-6],
        net_overhead: 3e-6,
    },
];

/// Time past the start-up of a ring collective of `passes` passes (1: all-gather or
/// reduce-scatter, 2: all-reduce) over `n` ranks on `nodes` nodes, whose bytes take `wire`
/// seconds at the full bus bandwidth: each pass is `n - 1` steps, `nodes - 1` of which cross
/// the network (NCCL counts `2 nodes` for an all-reduce), at the fastest protocol.
fn ring_time(n: u64, nodes: u64, passes: u64, wire: f64) -> f64 {
    let placement = match (nodes > 1, passes) {
        (true, _) if n < 2 * nodes => 2,
        (true, _) | (false, 2..) => 1,
        (false, _) => 0,
    };
    let steps = (passes * (n - 1)) as f64;
    let inter = match (nodes > 1, passes) {
        (false, _) => 0.0,
        (true, 1) => (nodes - 1) as f64,
        (true, _) => (passes * nodes) as f64,
    };
    PROTOCOLS
        .iter()
        .map(|p| {
            let bandwidth = p.ring_bandwidth[placement];
            let intra = if nodes > 1 {
                p.ring_step[0].max(p.net_overhead)
            } else {
                p.ring_step[0]
            };
            (steps - inter).max(0.0) * intra + inter * p.ring_step[1] + wire / bandwidth
        })
        .fold(f64::INFINITY, f64::min)
}

/// Time past the start-up of an all-reduce on NCCL's trees over `n` ranks on `nodes` nodes
/// (a chain inside each node, a binary tree of depth `log2 nodes` between them, up and down),
/// whose bytes take `wire` seconds at the full bus bandwidth (a tree sends each byte twice
/// per rank: its algorithm bandwidth is half the bus bandwidth).
fn tree_time(n: u64, nodes: u64, wire: f64) -> f64 {
    let across = usize::from(nodes > 1);
    let per_node = (n / nodes.max(1)).max(1) as f64;
    let depth = (nodes.max(1) as f64).log2().floor();
    PROTOCOLS
        .iter()
        .map(|p| {
            2.0 * ((per_node - 1.0) * p.tree_step[0] + depth * p.tree_step[1])
                + wire / p.tree_bandwidth[across]
        })
        .fold(f64::INFINITY, f64::min)
}

/// Time to send `bytes` from one rank to another, at the link's pairwise bandwidth.
pub fn p2p_time(bytes: f64, link: Link) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    link.latency + bytes / link.pairwise_bandwidth
}

/// Bytes a kernel reads and writes, given the per-device size of each tensor it touches.
///
/// Most kernels stream every operand once, including what they write besides their outputs (a
/// dropout mask, the fp32 probabilities a loss keeps). The exceptions: a view (the forward of
/// `slice`) moves nothing; an embedding lookup reads only the gathered rows of the table; its
/// gradient clears the dense table gradient, then reads the output gradient and
/// read-modify-writes as many table rows.
pub fn op_traffic(op: &Op, size: impl Fn(TensorId) -> f64) -> f64 {
    let sum = |ids: &[TensorId]| ids.iter().map(|&t| size(t)).sum::<f64>();
    let implicit: f64 = op
        .saves
        .iter()
        .filter(|t| !op.inputs.contains(t) && !op.outputs.contains(t))
        .map(|&t| size(t))
        .sum();
    let streamed = match (op.kind, op.pass) {
        (OpKind::Slice, Pass::Forward) => 0.0,
        (OpKind::Embedding, _) => size(op.inputs[0]) + 2.0 * sum(&op.outputs),
        (OpKind::EmbeddingGrad, _) => {
            size(op.inputs[0]) + 3.0 * size(op.inputs[1]) + sum(&op.outputs)
        }
        _ => sum(&op.inputs) + sum(&op.outputs),
    };
    let factor = if op.eager {
        eager_traffic_factor(op.kind, op.pass)
    } else {
        1.0
    };
    factor * (streamed + implicit)
}

/// How many times the bytes of its fused kernel an op moves when eager PyTorch runs it as a
/// composite of elementwise kernels ([`Op::eager`]), counted kernel by kernel from the code
/// that runs (torchtitan's `RMSNorm`, `apply_rotary_emb` and `FeedForward`, and the autograd
/// formulas of each step), for a bf16 activation of `n` elements; the fused kernel reads and
/// writes each operand once. Views cost nothing; per-row and per-position vectors (the norm's
/// reciprocal root, the rotary table) are left out, and where autograd could take two kernels
/// one is counted, so these are lower bounds.
///
/// * RMSNorm forward, `(y * rsqrt(y.pow(2).mean(-1) + eps)).type_as(x) * weight` with
///   `y = x.float()`: cast to fp32 (2n read, 4n written), `pow` (4n, 4n), `mean` (4n), the product
///   with the root (4n, 4n), the cast back (4n, 2n), the weight's product (2n, 2n): 36n bytes
///   against the fused 4n, 9x. Backward: the weight's product (4n for the input's gradient,
///   8n for the weight's), the cast (6n), the product with the root (8n and 16n for the
///   root's gradient), `mean` (4n), `pow` (12n), adding the input's two gradients (12n), the
///   cast (6n): 76n against the fused 6n (the output gradient and the input read, the input
///   gradient written), 76/6.
/// * RoPE, forward and backward alike: an fp32 copy (2n, 4n), the complex product (4n, 4n),
///   the cast back (4n, 2n): 20n against 4n, 5x.
/// * SwiGLU `silu(a) * b` over `n` elements per half: forward `silu` (2n, 2n) and the product
///   (4n, 2n), 10n against the fused 6n; backward the product's two gradients (6n each) and
///   `silu`'s (6n), 18n against the fused 10n.
pub fn eager_traffic_factor(kind: OpKind, pass: Pass) -> f64 {
    match (kind, pass) {
        (OpKind::RmsNorm, Pass::Forward) => 36.0 / 4.0,
        (OpKind::RmsNorm, Pass::Backward) => 76.0 / 6.0,
        (OpKind::Rope, _) => 20.0 / 4.0,
        (OpKind::SwiGlu, Pass::Forward) => 10.0 / 6.0,
        (OpKind::SwiGlu, Pass::Backward) => 18.0 / 10.0,
        _ => 1.0,
    }
}

/// Dimensions of a matrix product as one device runs it: `batch` independent products of
/// `[m, k] x [k, n]`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmShape {
    /// Independent products (heads of a batched product).
    pub batch: f64,
    /// Rows of the result.
    pub m: f64,
    /// Columns of the result.
    pub n: f64,
}

/// Output tile shapes of the large-GEMM kernels cuBLAS/CUTLASS pick from on Ampere and Hopper.
const GEMM_TILES: [(f64, f64); 3] = [(256.0, 128.0), (128.0, 256.0), (128.0, 128.0)];

/// Fraction of the GPU a matrix product keeps busy given tile and wave quantisation (NVIDIA,
/// *Matrix Multiplication Background User's Guide*): the result is cut into tiles, one per SM
/// at a time, so partial tiles and a partial last wave of tiles waste the rest. The best of the
/// usual tile shapes is taken, as the library's heuristics would.
pub fn wave_efficiency(shape: GemmShape, sm_count: f64) -> f64 {
    if shape.m <= 0.0 || shape.n <= 0.0 || sm_count <= 0.0 {
        return 1.0;
    }
    GEMM_TILES
        .iter()
        .map(|&(tm, tn)| {
            let tiles = shape.batch * (shape.m / tm).ceil() * (shape.n / tn).ceil();
            let waves = (tiles / sm_count).ceil();
            (shape.batch * shape.m * shape.n / (waves * sm_count * tm * tn)).min(1.0)
        })
        .fold(0.0, f64::max)
}

/// Fraction of a matrix product's main-loop rate that it sustains with a reduction of `k`
/// elements per output tile on a kernel that spends `depth` elements' worth of it per tile
/// outside the main loop ([`Device::gemm_pipeline_depth`]).
pub fn depth_efficiency(k: f64, depth: f64) -> f64 {
    if !(k > 0.0 && k.is_finite()) || depth <= 0.0 {
        return 1.0;
    }
    k / (k + depth)
}

/// How many times more reduction elements an FP8 product's k tile holds than a 16-bit one's,
/// and so how much deeper its pipeline is in elements ([`Device::gemm_pipeline_depth`] is given
/// for 16-bit operands). A Hopper k tile is 128 bytes of each row, the width of the TMA's
/// 128-byte swizzle: CUTLASS's Hopper FP8 kernels tile 128x128x128 or 256x128x128
/// (`examples/54_hopper_fp8_warp_specialized_gemm`, `57_hopper_grouped_gemm`), its 16-bit ones
/// 128x128x64. Filling the stages and writing the 16-bit output tile take the same time in
/// both, while the main loop runs through the reduction at twice the rate, so the same time
/// outside it is worth twice the elements.
pub const FP8_K_TILE_WIDENING: f64 = 2.0;

/// How fast FlashAttention written in Triton runs, relative to FlashAttention-2's CUDA kernels
/// (a device's [`Device::attention_efficiency`]): Dao (*FlashAttention-2*, 2023, §4.1)
/// measures FlashAttention-2 1.3-2.5x faster than the Triton implementation, forward plus
/// backward on A100, over sequence lengths 512-16k and head dimensions 64 and 128; the
/// geometric middle of that range, 1.8x, is taken.
pub const TRITON_FLASH_ATTENTION_SPEED: f64 = 1.0 / 1.8;

/// Fraction of the tensor-core peak that the fused attention kernel `kernel` reaches on
/// `device`, forward plus backward.
pub fn flash_kernel_efficiency(kernel: FlashKernel, device: &Device) -> f64 {
    match kernel {
        FlashKernel::Cuda => device.attention_efficiency,
        FlashKernel::Triton => device.attention_efficiency * TRITON_FLASH_ATTENTION_SPEED,
        FlashKernel::Cudnn => device.fused_attention(),
        FlashKernel::Auto => device.attention_efficiency.max(device.fused_attention()),
    }
}

/// The dtype op `op`'s kernel runs in when the model trains in `dtype`: FP8 for an FP8 product
/// ([`Op::fp8`]), which a profile names as such.
pub fn kernel_dtype(op: &Op, dtype: DType) -> DType {
    if op.fp8 { DType::F8 } else { dtype }
}

/// How many times longer an FP8 product of the backward pass (an input or a weight gradient)
/// takes than its forward product at the same FLOPs: FP8 training recipes accumulate those
/// products with cuBLASLt's split accumulator, which periodically promotes the tensor cores'
/// partial sums to fp32 on the CUDA cores (`CUBLASLT_MATMUL_DESC_FAST_ACCUM` off).
/// Transformer Engine's linear layers set `_2X_ACC_DGRAD` and `_2X_ACC_WGRAD` (and not
/// `_2X_ACC_FPROP`); torchao's float8 training turns `use_fast_accum` on in the forward only.
/// Fast accumulation is measured 1.1-1.2x faster on H100 (pytorch/ao#2377); the geometric
/// middle, 1.15, is taken.
pub const FP8_SPLIT_ACCUMULATION_SLOWDOWN: f64 = 1.15;

/// Roofline time of one kernel on one device: the larger of its compute time (FLOPs at the peak
/// of the unit it runs on, times that unit's achievable efficiency, times the wave and depth
/// efficiencies of a matrix product of shape `gemm`, its reduction length being FLOPs / (2
/// batch m n)) and its memory time (bytes at the achievable memory bandwidth), plus a fixed
/// launch overhead. A view (no FLOPs, no bytes) costs nothing.
pub fn kernel_time(
    kind: OpKind,
    flops: f64,
    bytes: f64,
    device: &Device,
    dtype: DType,
    gemm: Option<GemmShape>,
) -> f64 {
    roofline(kind, flops, bytes, device, dtype, gemm, 1.0)
}

/// [`kernel_time`] of op `op`'s own kernel when the model trains in `dtype`: in the dtype it
/// runs in ([`kernel_dtype`]), and for a backward FP8 product with the split accumulator's
/// slowdown ([`FP8_SPLIT_ACCUMULATION_SLOWDOWN`]).
pub fn op_kernel_time(
    op: &Op,
    flops: f64,
    bytes: f64,
    device: &Device,
    dtype: DType,
    gemm: Option<GemmShape>,
) -> f64 {
    let slowdown = if op.fp8 && op.pass == Pass::Backward {
        FP8_SPLIT_ACCUMULATION_SLOWDOWN
    } else {
        1.0
    };
    roofline(
        op.kind,
        flops,
        bytes,
        device,
        kernel_dtype(op, dtype),
        gemm,
        slowdown,
    )
}

/// [`kernel_time`] with the compute time stretched `slowdown` times.
fn roofline(
    kind: OpKind,
    flops: f64,
    bytes: f64,
    device: &Device,
    dtype: DType,
    gemm: Option<GemmShape>,
    slowdown: f64,
) -> f64 {
    if flops <= 0.0 && bytes <= 0.0 {
        return 0.0;
    }
    // An FP8 product runs at the FP8 peak with the efficiency of the device's products: on
    // H100 cuBLASLt's FP8 GEMM of 8192^3 reaches 1,600-1,630 of 1,979 TFLOP/s (0.81; a public
    // cross-check report, gitea.d-robotics.cc/han.zhao/test_gpu_scripts,
    // `reports_cublaslt_fp8_crosscheck_20260524.md`), the fraction mamf-finder's best bf16
    // shape reaches of the bf16 peak (0.80).
    let tensor_peak = match dtype {
        DType::F32 => device.peak_fp32_flops,
        DType::F8 => device.peak_fp8_flops,
        _ => device.peak_bf16_flops,
    };
    let rate = match kind {
        OpKind::MatMul { .. } | OpKind::BatchMatMul { .. } => {
            let shape = gemm.map_or(1.0, |g| {
                let outputs = g.batch * g.m * g.n;
                let k = if outputs > 0.0 {
                    flops / (2.0 * outputs)
                } else {
                    0.0
                };
                let depth = match dtype {
                    DType::F8 => device.gemm_pipeline_depth * FP8_K_TILE_WIDENING,
                    _ => device.gemm_pipeline_depth,
                };
                wave_efficiency(g, device.sm_count) * depth_efficiency(k, depth)
            });
            tensor_peak * device.matmul_efficiency * shape
        }
        OpKind::FlashAttention { kernel, .. } => {
            tensor_peak * flash_kernel_efficiency(kernel, device)
        }
        _ => device.peak_fp32_flops,
    };
    let compute = slowdown * flops / rate;
    let memory = bytes / (device.hbm_bandwidth * device.hbm_efficiency);
    compute.max(memory) + device.kernel_overhead
}

/// Bytes per element that Transformer Engine's `cast_transpose` moves to cast a 16-bit tensor
/// to FP8 for a product: the input read (2), the FP8 copy and its transpose written (1 + 1),
/// the layout the weight-gradient product reads (`fp8_cast_transpose_fused` in TE's linear
/// layers; Hopper's FP8 products take only the TN layout).
pub const FP8_CAST_BYTES_PER_ELEMENT: f64 = 4.0;

/// Time of the kernel that casts `elements` elements to FP8 ([`FP8_CAST_BYTES_PER_ELEMENT`])
/// before an FP8 product reads them: memory-bound, with one launch.
pub fn fp8_cast_time(elements: f64, device: &Device) -> f64 {
    if elements <= 0.0 {
        return 0.0;
    }
    kernel_time(
        OpKind::Transpose,
        0.0,
        FP8_CAST_BYTES_PER_ELEMENT * elements,
        device,
        DType::Bf16,
        None,
    )
}

/// What accumulating a fresh weight gradient of `elements` elements (`fresh` bytes each)
/// into a gradient buffer of `buffer` bytes per element costs: when the product `fused`s it
/// (Megatron-LM's `--gradient-accumulation-fusion`, matrix products only) the extra traffic
/// of reading and writing the buffer instead of writing the fresh gradient, bytes, and no
/// separate kernel; otherwise no extra traffic and the time of the separate add kernel.
pub fn gradient_accumulation(
    elements: f64,
    fresh: f64,
    buffer: f64,
    fused: bool,
    device: &Device,
    dtype: DType,
) -> (f64, f64) {
    let read_write = 2.0 * buffer;
    if fused {
        (elements * (read_write - fresh), 0.0)
    } else {
        let add = kernel_time(
            OpKind::Add,
            elements,
            elements * (fresh + read_write),
            device,
            dtype,
            None,
        );
        (0.0, add)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::cluster::preset;

    fn link() -> Link {
        Link {
            latency: 1e-5,
            bandwidth: 100e9,
            pairwise_bandwidth: 100e9,
            nodes: 1,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-6)
    }

    #[test]
    fn large_payloads_take_simple_rings_of_n_minus_one_steps() {
        // 1 GB inside a node: Simple, 3.4 us per step, at the full bus bandwidth.
        let b = 1e9;
        let ag = collective_time(Collective::AllGather, 4, b, link());
        assert!(close(ag, 1e-5 + 3.0 * 3.4e-6 + 0.75 * b / 100e9), "{ag}");
        let rs = collective_time(Collective::ReduceScatter, 8, b, link());
        assert!(
            close(rs, 1e-5 + 7.0 * 3.4e-6 + 7.0 / 8.0 * b / 100e9),
            "{rs}"
        );
        // An all-reduce is a reduce-scatter and an all-gather: twice the steps and the bytes.
        let ar = collective_time(Collective::AllReduce, 8, b, link());
        assert!(
            close(ar, 1e-5 + 14.0 * 3.4e-6 + 2.0 * 7.0 / 8.0 * b / 100e9),
            "{ar}"
        );
        let a2a = collective_time(Collective::AllToAll, 4, b, link());
        assert!(close(a2a, 1e-5 + 3.0 / 16.0 * b / 100e9));
        assert_eq!(collective_time(Collective::AllReduce, 1, b, link()), 0.0);
        assert_eq!(collective_time(Collective::AllGather, 8, 0.0, link()), 0.0);
    }

    #[test]
    fn small_payloads_take_the_low_latency_protocol() {
        // 4 KB inside a node: LL's 0.6 us steps at a third of the bus bandwidth beat Simple's
        // 3.4 us steps.
        let b = 4096.0;
        let ag = collective_time(Collective::AllGather, 8, b, link());
        assert!(
            close(ag, 1e-5 + 7.0 * 0.6e-6 + 7.0 / 8.0 * b / (100e9 / 3.0)),
            "{ag}"
        );
        // Across 16 nodes, 8 ranks each: 112 steps inside nodes (each at least the 1 us of
        // posting network work) and 15 on the network (2.7 us), at a quarter of the bandwidth.
        let wide = Link {
            nodes: 16,
            ..link()
        };
        let ag = collective_time(Collective::AllGather, 128, b, wide);
        let ring = 112.0 * 1e-6 + 15.0 * 2.7e-6 + 127.0 / 128.0 * b / 25e9;
        assert!(close(ag, 1e-5 + ring), "{ag}");
    }

    #[test]
    fn ll128_slows_down_with_one_rank_per_node() {
        // 16 ranks on 16 nodes, 100 us of wire at the full bandwidth: LL128's 15 network steps
        // of 4 us at 70% of the bandwidth beat LL (2.7 us, a quarter) and Simple (14 us).
        let wire = 100e-6;
        let bytes = wire * 100e9 * 16.0 / 15.0;
        let one_per_node = Link {
            nodes: 16,
            ..link()
        };
        let t = collective_time(Collective::AllGather, 16, bytes, one_per_node);
        assert!(close(t, 1e-5 + 15.0 * 4e-6 + wire / 0.7), "{t}");
        // Two ranks per node: 92%, and 16 steps inside nodes (each at least the 1 us of
        // posting network work) besides the 15 across.
        let two_per_node = Link {
            nodes: 16,
            ..link()
        };
        let bytes = wire * 100e9 * 32.0 / 31.0;
        let t = collective_time(Collective::AllGather, 32, bytes, two_per_node);
        assert!(
            close(t, 1e-5 + 16.0 * 1.9e-6 + 15.0 * 4e-6 + wire / 0.92),
            "{t}"
        );
    }

    #[test]
    fn small_all_reduces_across_many_nodes_take_the_trees() {
        // 512 ranks on 64 nodes: a ring of 1,022 steps against a tree of depth 6 between
        // nodes and a chain of 8 inside each, up and down, on LL.
        let b = 4096.0;
        let wide = Link {
            nodes: 64,
            ..link()
        };
        let ar = collective_time(Collective::AllReduce, 512, b, wide);
        let tree = 2.0 * (7.0 * 0.6e-6 + 6.0 * 5.0e-6) + 2.0 * b / (100e9 * 0.92 / 3.8);
        assert!(close(ar, 1e-5 + tree), "{ar}");
        // A large one still takes the ring: its bandwidth beats the tree's 92%.
        let big = 1e10;
        let ar = collective_time(Collective::AllReduce, 512, big, wide);
        let ring =
            2.0 * (511.0 - 64.0) * 3.4e-6 + 128.0 * 14e-6 + 2.0 * 511.0 / 512.0 * big / 100e9;
        assert!(close(ar, 1e-5 + ring), "{ar}");
    }

    #[test]
    fn collectives_never_get_faster_with_more_bytes_or_ranks() {
        for kind in [
            Collective::AllReduce,
            Collective::AllGather,
            Collective::ReduceScatter,
        ] {
            for nodes in [1, 2, 16] {
                let l = Link { nodes, ..link() };
                let mut last = 0.0;
                for e in 0..40 {
                    let t = collective_time(kind, 8 * nodes, 2f64.powi(e), l);
                    assert!(
                        t >= last,
                        "{kind:?} {nodes} nodes, 2^{e} bytes: {t} < {last}"
                    );
                    last = t;
                }
            }
            for b in [1e3, 1e6, 1e9] {
                let t: Vec<f64> = (1..=6)
                    .map(|k| {
                        collective_time(
                            kind,
                            8 << k,
                            b,
                            Link {
                                nodes: 1 << k,
                                ..link()
                            },
                        )
                    })
                    .collect();
                assert!(t.windows(2).all(|w| w[1] >= w[0]), "{kind:?} {b}: {t:?}");
            }
        }
    }

    #[test]
    fn roofline_picks_the_binding_resource() {
        let d = preset("a100-80g").expect("preset");
        // 8192^3 GEMM: compute bound at the matmul efficiency.
        let f = 2.0 * 8192f64.powi(3);
        let t = kernel_time(
            OpKind::MatMul { transpose_b: false },
            f,
            3.0 * 8192.0 * 8192.0 * 2.0,
            &d,
            DType::Bf16,
            None,
        );
        let expect = f / (312e12 * d.matmul_efficiency) + d.kernel_overhead;
        assert!((t - expect).abs() / expect < 1e-12);
        // An elementwise op over 1 GB is memory bound.
        let t = kernel_time(OpKind::Gelu, 4e8, 1e9, &d, DType::Bf16, None);
        let expect = 1e9 / (2.039e12 * 0.9) + d.kernel_overhead;
        assert!((t - expect).abs() / expect < 1e-12);
        assert_eq!(
            kernel_time(OpKind::Slice, 0.0, 0.0, &d, DType::Bf16, None),
            0.0
        );
    }

    #[test]
    fn fp8_products_run_at_the_fp8_peak_after_a_memory_bound_cast() {
        let d = preset("h100-sxm").expect("preset");
        let matmul = OpKind::MatMul { transpose_b: false };
        let f = 2.0 * 8192f64.powi(3);
        let bf16 = kernel_time(matmul, f, 0.0, &d, DType::Bf16, None) - d.kernel_overhead;
        let fp8 = kernel_time(matmul, f, 0.0, &d, DType::F8, None) - d.kernel_overhead;
        assert!((fp8 - f / (1979e12 * d.matmul_efficiency)).abs() / fp8 < 1e-12);
        assert!((bf16 / fp8 - 1979.0 / 989.0).abs() < 1e-9);
        // The cast reads 2 bytes and writes 2 per element (the copy and its transpose).
        let n = 8192.0 * 8192.0;
        let cast = fp8_cast_time(n, &d);
        let expect = 4.0 * n / (3.35e12 * 0.9) + d.kernel_overhead;
        assert!((cast - expect).abs() / expect < 1e-12);
        assert_eq!(fp8_cast_time(0.0, &d), 0.0);
        // A device without FP8 tensor cores has no FP8 peak to run at.
        assert_eq!(preset("a100-80g").expect("preset").peak_fp8_flops, 0.0);
    }

    #[test]
    fn backward_fp8_products_pay_the_split_accumulator() {
        let d = preset("h100-sxm").expect("preset");
        let product = |pass, fp8| Op {
            name: "product".into(),
            kind: OpKind::MatMul { transpose_b: false },
            pass,
            inputs: vec![TensorId(0), TensorId(1)],
            outputs: vec![TensorId(2)],
            saves: vec![],
            layer: 0,
            attention_core: false,
            eager: false,
            fp8,
            flops: 0.0,
            grad_of: None,
        };
        let f = 2.0 * 8192f64.powi(3);
        let time = |pass, fp8| {
            op_kernel_time(&product(pass, fp8), f, 0.0, &d, DType::Bf16, None) - d.kernel_overhead
        };
        let forward = time(Pass::Forward, true);
        assert!((forward - f / (1979e12 * d.matmul_efficiency)).abs() / forward < 1e-12);
        let backward = time(Pass::Backward, true);
        assert!((backward / forward - FP8_SPLIT_ACCUMULATION_SLOWDOWN).abs() < 1e-12);
        // A 16-bit product accumulates the same way in both passes.
        assert_eq!(time(Pass::Backward, false), time(Pass::Forward, false));
        // A memory-bound kernel is not slowed: the accumulator stretches the main loop only.
        let bytes = 1e12;
        let op = product(Pass::Backward, true);
        let memory_bound = op_kernel_time(&op, 1e6, bytes, &d, DType::Bf16, None);
        let expect = bytes / (d.hbm_bandwidth * d.hbm_efficiency) + d.kernel_overhead;
        assert!((memory_bound - expect).abs() / expect < 1e-12);
    }

    #[test]
    fn eager_composites_move_their_counted_bytes() {
        let op = |kind, pass, eager| Op {
            name: "op".into(),
            kind,
            pass,
            inputs: vec![TensorId(0), TensorId(1)],
            outputs: vec![TensorId(2)],
            saves: vec![],
            layer: 0,
            attention_core: false,
            eager,
            fp8: false,
            flops: 0.0,
            grad_of: None,
        };
        let size = |t: TensorId| [100.0, 10.0, 100.0][t.0 as usize];
        for (kind, pass, factor) in [
            (OpKind::RmsNorm, Pass::Forward, 9.0),
            (OpKind::RmsNorm, Pass::Backward, 76.0 / 6.0),
            (OpKind::Rope, Pass::Backward, 5.0),
            (OpKind::SwiGlu, Pass::Forward, 10.0 / 6.0),
            (OpKind::SwiGlu, Pass::Backward, 1.8),
            (OpKind::Gelu, Pass::Forward, 1.0),
        ] {
            let fused = op_traffic(&op(kind, pass, false), size);
            assert_eq!(fused, 210.0);
            let eager = op_traffic(&op(kind, pass, true), size);
            assert!((eager / fused - factor).abs() < 1e-12, "{kind:?} {pass:?}");
        }
    }

    #[test]
    fn each_attention_kernel_runs_at_its_devices_documented_fraction_of_peak() {
        for (name, auto) in [
            ("a100-80g", FlashKernel::Cuda),
            ("h100-sxm", FlashKernel::Cudnn),
        ] {
            let d = preset(name).expect("preset");
            let time = |kernel| {
                let kind = OpKind::FlashAttention {
                    causal: true,
                    kernel,
                };
                kernel_time(kind, 1e12, 1e6, &d, DType::Bf16, None) - d.kernel_overhead
            };
            let at = |efficiency: f64| 1e12 / (d.peak_bf16_flops * efficiency);
            let close = |a: f64, b: f64| (a - b).abs() / b < 1e-12;
            let cuda = time(FlashKernel::Cuda);
            assert!(close(cuda, at(d.attention_efficiency)), "{name}");
            assert!(close(time(FlashKernel::Triton) / cuda, 1.8), "{name}");
            assert!(close(
                time(FlashKernel::Cudnn),
                at(d.fused_attention_efficiency)
            ));
            // Transformer Engine's choice: flash-attn on Ampere, cuDNN on Hopper.
            assert_eq!(time(FlashKernel::Auto), time(auto), "{name}");
            assert!(
                time(FlashKernel::Auto) < time(FlashKernel::Cuda).max(time(FlashKernel::Cudnn))
            );
        }
    }

    /// `[65536 x k] x [k x n]` in `dtype` on `d`, with 16-bit operands' bytes: the time
    /// `kernel_time` gives it (less the launch), per unit of its time at the full-depth rate
    /// (`peak` x the device's matmul efficiency x wave quantisation).
    fn time_over_full_depth(d: &Device, n: f64, k: f64, dtype: DType, peak: f64) -> f64 {
        let shape = GemmShape {
            batch: 1.0,
            m: 65536.0,
            n,
        };
        let flops = 2.0 * shape.m * shape.n * k;
        let bytes = 2.0 * (shape.m * k + k * shape.n + shape.m * shape.n);
        let matmul = OpKind::MatMul { transpose_b: false };
        let time = kernel_time(matmul, flops, bytes, d, dtype, Some(shape)) - d.kernel_overhead;
        time * peak * d.matmul_efficiency * wave_efficiency(shape, d.sm_count) / flops
    }

    #[test]
    fn an_fp8_product_fills_a_pipeline_twice_as_deep_in_elements() {
        let d = preset("h100-sxm").expect("preset");
        for k in [1024.0, 4096.0] {
            // Per element of work: k + 192 for bf16, k + 384 for FP8, each at its own peak.
            let bf16 = time_over_full_depth(&d, 4224.0, k, DType::Bf16, 989e12);
            let fp8 = time_over_full_depth(&d, 4224.0, k, DType::F8, 1979e12);
            assert!((bf16 - (k + 192.0) / k).abs() < 1e-12, "k = {k}: {bf16}");
            assert!((fp8 - (k + 384.0) / k).abs() < 1e-12, "k = {k}: {fp8}");
        }
    }

    #[test]
    fn a_short_reduction_pays_for_filling_and_draining_the_pipeline() {
        let d = preset("a100-80g").expect("preset");
        // [65536 x k] x [k x 2304]: full waves of 128x256 tiles, compute bound for both k.
        let ratio = |k: f64| time_over_full_depth(&d, 2304.0, k, DType::Bf16, 312e12);
        for k in [768.0, 8192.0] {
            let expect = (k + d.gemm_pipeline_depth) / k;
            assert!((ratio(k) - expect).abs() / expect < 1e-12, "k = {k}");
        }
        // Per unit of work, the 768-wide reduction is 22% slower than the 8192-wide one.
        let slower = ratio(768.0) / ratio(8192.0) - 1.0;
        assert!((slower - (960.0 / 768.0) / (8384.0 / 8192.0) + 1.0).abs() < 1e-12);
        assert!((0.2..0.23).contains(&slower), "{slower}");
        // Degenerate shapes, and devices without the cost, keep the plain rate.
        assert_eq!(depth_efficiency(0.0, 192.0), 1.0);
        assert_eq!(depth_efficiency(f64::INFINITY, 192.0), 1.0);
        assert_eq!(depth_efficiency(768.0, 0.0), 1.0);
        let cpu = preset("cpu").expect("preset");
        let matmul = OpKind::MatMul { transpose_b: false };
        let shape = GemmShape {
            batch: 1.0,
            m: 65536.0,
            n: 2304.0,
        };
        let flops = 2.0 * shape.m * shape.n * 768.0;
        let on_cpu = kernel_time(matmul, flops, 0.0, &cpu, DType::F32, Some(shape));
        let plain = flops / (cpu.peak_fp32_flops * cpu.matmul_efficiency) + cpu.kernel_overhead;
        assert!((on_cpu - plain).abs() / plain < 1e-12);
    }

    #[test]
    fn wave_quantisation() {
        let g = |m: f64, n: f64| GemmShape { batch: 1.0, m, n };
        // 8 x 54 tiles of 256x128 = 432 = 4 full waves on 108 SMs.
        assert_eq!(wave_efficiency(g(2048.0, 6912.0), 108.0), 1.0);
        // [2048 x 2304]: best is 128x128, 288 tiles in 3 waves of 108.
        let e = wave_efficiency(g(2048.0, 2304.0), 108.0);
        assert!((e - 288.0 / 324.0).abs() < 1e-12, "{e}");
        // A partial tile wastes its padding.
        let e = wave_efficiency(g(100.0, 128.0), 108.0);
        assert!(
            (e - 100.0 * 128.0 / (108.0 * 128.0 * 128.0)).abs() < 1e-12,
            "{e}"
        );
    }
}
