//! MosaicML's published training throughput of its MPT models (llm-foundry,
//! `scripts/train/benchmarking/README.md`): PyTorch FSDP with full sharding, bf16, Triton flash
//! attention, on A100 40GB, A100 80GB and H100 80GB nodes of eight GPUs. Every row with
//! sequences of at most 2048 tokens from the three bf16 tables; the GPU presets' matmul
//! efficiencies are calibrated on a fixed subset of them ([`Row::calibrates`]).

/// One MPT model size, as its llm-foundry yaml defines it (expansion ratio 4, vocabulary
/// 50,368, tied embeddings).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Mpt {
    /// Name in the tables (`mpt-7b`, ...).
    pub name: &'static str,
    /// Hidden size (`d_model`).
    pub hidden: u64,
    /// Transformer blocks (`n_layers`).
    pub layers: u64,
    /// Attention heads (`n_heads`).
    pub heads: u64,
    /// Nominal parameter count.
    pub params: f64,
}

impl Mpt {
    /// The model's config in the repository (`models/mpt-*.json`, a GPT-2 style HuggingFace
    /// config whose parameter count matches the tables' `NumParams` at sequence 2048), as a
    /// path relative to a copy of the default workspace.
    pub fn path(&self) -> String {
        format!("models/{}.json", self.name)
    }
}

const fn mpt(name: &'static str, hidden: u64, layers: u64, heads: u64, params: f64) -> Mpt {
    Mpt {
        name,
        hidden,
        layers,
        heads,
        params,
    }
}

const M125: Mpt = mpt("mpt-125m", 768, 12, 12, 125e6);
const M350: Mpt = mpt("mpt-350m", 1024, 24, 16, 350e6);
const M760: Mpt = mpt("mpt-760m", 1536, 24, 12, 760e6);
const B1: Mpt = mpt("mpt-1b", 2048, 24, 16, 1e9);
const B3: Mpt = mpt("mpt-3b", 2560, 32, 20, 3e9);
const B7: Mpt = mpt("mpt-7b", 4096, 32, 32, 7e9);
const B13: Mpt = mpt("mpt-13b", 5120, 40, 40, 13e9);
const B30: Mpt = mpt("mpt-30b", 7168, 48, 64, 30e9);
const B70: Mpt = mpt("mpt-70b", 8192, 80, 64, 70e9);

/// One published run.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    /// autopar preset of the GPU.
    pub gpu: &'static str,
    /// Model.
    pub model: Mpt,
    /// Sequence length.
    pub seq: u64,
    /// GPUs (eight per node).
    pub gpus: u64,
    /// Micro-batch size per GPU.
    pub micro_batch: u64,
    /// Global batch size, sequences.
    pub global_batch: u64,
    /// Published throughput, tokens/s per GPU.
    pub tokens_per_gpu: f64,
    /// Activation checkpointing (every block recomputed in the backward).
    pub checkpointing: bool,
}

impl Row {
    /// Whether the row is one the matmul efficiency is calibrated on: the runs whose time goes
    /// to matrix products, i.e. models of 7B parameters or more with activation checkpointing
    /// (large micro-batches, so FSDP's gathers are small next to the compute).
    pub fn calibrates(&self) -> bool {
        self.model.params >= 7e9 && self.checkpointing && self.seq <= 2048
    }

    /// Nodes of eight GPUs.
    pub fn nodes(&self) -> u64 {
        self.gpus / 8
    }

    /// Whether the run reduced gradients in fp32: the tables' "MP Mode" is `DEFAULT`
    /// (Composer's FSDP mixed precision with `reduce_dtype` fp32) on the H100 rows and the
    /// A100 80GB rows below 70B, `PURE` (bf16) elsewhere.
    pub fn grad_reduce_in_fp32(&self) -> bool {
        self.gpu == "h100-sxm" || (self.gpu == "a100-80g" && self.model.name != "mpt-70b")
    }

    /// `autopar estimate` arguments for the run on the cluster named `cluster`, with the model
    /// written at `model_path`: llm-foundry's runtime, the run's reduction dtype.
    pub fn estimate_args(&self, model_path: &str, cluster: &str) -> Vec<String> {
        [
            "--runtime",
            "llm-foundry",
            "--grad-reduce-in-fp32",
            if self.grad_reduce_in_fp32() {
                "true"
            } else {
                "false"
            },
            "--model",
            model_path,
            "--cluster",
            cluster,
            "--mbs",
            &self.micro_batch.to_string(),
            "--gbs",
            &self.global_batch.to_string(),
            "--zero",
            "3",
            "--recompute",
            if self.checkpointing { "full" } else { "none" },
            "--seq",
            &self.seq.to_string(),
            // The published runs ran, so they fit; autopar's headroom would refuse some.
            "--memory-headroom",
            "0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }
}

#[allow(clippy::too_many_arguments)]
const fn row(
    gpu: &'static str,
    model: Mpt,
    seq: u64,
    gpus: u64,
    micro_batch: u64,
    global_batch: u64,
    tokens_per_gpu: f64,
    checkpointing: bool,
) -> Row {
    Row {
        gpu,
        model,
        seq,
        gpus,
        micro_batch,
        global_batch,
        tokens_per_gpu,
        checkpointing,
    }
}

/// The rows: GPU, model, sequence, GPUs, micro-batch, global batch, tokens/s per GPU,
/// checkpointing.
pub const ROWS: [Row; 107] = [
    row("a100-80g", B70, 2048, 64, 8, 2048, 410.0, true),
    row("a100-80g", B70, 2048, 32, 2, 1024, 373.0, true),
    row("a100-80g", B30, 2048, 8, 3, 504, 916.0, true),
    row("a100-80g", B30, 1024, 8, 6, 1008, 946.0, true),
    row("a100-80g", B30, 512, 8, 12, 2016, 967.0, true),
    row("a100-80g", B13, 2048, 8, 2, 48, 2262.0, false),
    row("a100-80g", B13, 1024, 8, 40, 960, 2330.0, true),
    row("a100-80g", B7, 2048, 8, 6, 96, 4641.0, false),
    row("a100-80g", B7, 1024, 8, 64, 1024, 4357.0, true),
    row("a100-80g", B3, 2048, 8, 10, 160, 10811.0, false),
    row("a100-80g", B3, 1024, 8, 20, 960, 11580.0, false),
    row("a100-80g", B3, 512, 8, 40, 1920, 12127.0, false),
    row("a100-80g", B1, 2048, 8, 14, 448, 20513.0, false),
    row("a100-80g", B1, 1024, 8, 18, 576, 22112.0, false),
    row("a100-80g", B1, 512, 8, 56, 1792, 23148.0, false),
    row("a100-80g", M760, 2048, 8, 24, 384, 32434.0, false),
    row("a100-80g", M760, 1024, 8, 48, 768, 29765.0, false),
    row("a100-80g", M760, 512, 8, 96, 1536, 29446.0, false),
    row("a100-80g", M350, 2048, 8, 32, 512, 58782.0, false),
    row("a100-80g", M350, 1024, 8, 64, 1024, 64813.0, false),
    row("a100-80g", M350, 512, 8, 128, 2048, 69330.0, false),
    row("a100-80g", M125, 2048, 8, 40, 640, 142830.0, false),
    row("a100-80g", M125, 2048, 8, 32, 512, 141737.0, false),
    row("a100-80g", M125, 1024, 8, 64, 1024, 156468.0, false),
    row("a100-80g", M125, 512, 8, 128, 2048, 165681.0, false),
    row("a100-40g", B70, 2048, 128, 4, 512, 376.0, true),
    row("a100-40g", B70, 2048, 64, 2, 128, 276.0, true),
    row("a100-40g", B30, 2048, 128, 6, 768, 865.0, true),
    row("a100-40g", B30, 2048, 32, 4, 128, 857.0, true),
    row("a100-40g", B13, 2048, 128, 16, 2048, 1972.0, true),
    row("a100-40g", B13, 2048, 64, 16, 1024, 1976.0, true),
    row("a100-40g", B13, 2048, 32, 14, 448, 1998.0, true),
    row("a100-40g", B13, 2048, 16, 10, 160, 1993.0, true),
    row("a100-40g", B13, 2048, 8, 4, 512, 1668.0, true),
    row("a100-40g", B13, 1024, 8, 8, 1024, 1727.0, true),
    row("a100-40g", B13, 512, 8, 16, 2048, 1763.0, true),
    row("a100-40g", B7, 2048, 128, 18, 2304, 3623.0, true),
    row("a100-40g", B7, 2048, 64, 18, 1152, 3665.0, true),
    row("a100-40g", B7, 2048, 32, 18, 576, 3725.0, true),
    row("a100-40g", B7, 2048, 16, 16, 256, 3645.0, true),
    row("a100-40g", B7, 2048, 8, 12, 384, 3679.0, true),
    row("a100-40g", B7, 1024, 8, 24, 768, 3854.0, true),
    row("a100-40g", B7, 512, 8, 48, 1536, 3895.0, true),
    row("a100-40g", B3, 2048, 128, 6, 768, 9538.0, false),
    row("a100-40g", B3, 2048, 64, 6, 384, 9736.0, false),
    row("a100-40g", B3, 2048, 32, 6, 192, 9914.0, false),
    row("a100-40g", B3, 2048, 16, 5, 80, 9750.0, false),
    row("a100-40g", B3, 2048, 8, 5, 320, 10065.0, false),
    row("a100-40g", B3, 1024, 8, 10, 640, 10731.0, false),
    row("a100-40g", B3, 512, 8, 20, 1280, 11324.0, false),
    row("a100-40g", B1, 2048, 128, 10, 1280, 18647.0, false),
    row("a100-40g", B1, 2048, 64, 10, 640, 19001.0, false),
    row("a100-40g", B1, 2048, 32, 10, 320, 15555.0, false),
    row("a100-40g", B1, 2048, 16, 8, 128, 19085.0, false),
    row("a100-40g", B1, 2048, 8, 8, 512, 19271.0, false),
    row("a100-40g", B1, 1024, 8, 16, 1024, 20959.0, false),
    row("a100-40g", B1, 512, 8, 32, 2048, 21782.0, false),
    row("a100-40g", M760, 2048, 128, 12, 1536, 28940.0, false),
    row("a100-40g", M760, 2048, 64, 12, 768, 29344.0, false),
    row("a100-40g", M760, 2048, 32, 12, 384, 29648.0, false),
    row("a100-40g", M760, 2048, 16, 12, 192, 29607.0, false),
    row("a100-40g", M760, 2048, 8, 12, 384, 30173.0, false),
    row("a100-40g", M760, 1024, 8, 24, 768, 33422.0, false),
    row("a100-40g", M760, 512, 8, 48, 1536, 34938.0, false),
    row("a100-40g", M350, 2048, 128, 18, 2304, 51934.0, false),
    row("a100-40g", M350, 2048, 64, 18, 1152, 52689.0, false),
    row("a100-40g", M350, 2048, 32, 18, 576, 53811.0, false),
    row("a100-40g", M350, 2048, 16, 18, 288, 55413.0, false),
    row("a100-40g", M350, 2048, 8, 16, 512, 55995.0, false),
    row("a100-40g", M350, 1024, 8, 32, 1024, 62523.0, false),
    row("a100-40g", M350, 512, 8, 64, 2048, 66284.0, false),
    row("a100-40g", M125, 2048, 128, 26, 3328, 123936.0, false),
    row("a100-40g", M125, 2048, 64, 26, 1664, 125234.0, false),
    row("a100-40g", M125, 2048, 32, 26, 832, 127122.0, false),
    row("a100-40g", M125, 2048, 16, 26, 416, 130535.0, false),
    row("a100-40g", M125, 2048, 8, 26, 624, 136334.0, false),
    row("a100-40g", M125, 1024, 8, 52, 1248, 148289.0, false),
    row("a100-40g", M125, 512, 8, 104, 2496, 156735.0, false),
    row("h100-sxm", B70, 2048, 64, 8, 2048, 1039.0, true),
    row("h100-sxm", B70, 2048, 32, 2, 1024, 882.0, true),
    row("h100-sxm", B30, 2048, 32, 14, 1344, 2308.0, true),
    row("h100-sxm", B30, 2048, 16, 10, 480, 2263.0, true),
    row("h100-sxm", B30, 2048, 8, 3, 504, 2002.0, true),
    row("h100-sxm", B30, 1024, 8, 6, 1008, 2084.0, true),
    row("h100-sxm", B13, 2048, 64, 2, 128, 4800.0, false),
    row("h100-sxm", B13, 2048, 32, 2, 64, 4811.0, false),
    row("h100-sxm", B13, 2048, 16, 2, 32, 4767.0, false),
    row("h100-sxm", B13, 2048, 8, 2, 16, 4792.0, false),
    row("h100-sxm", B13, 1024, 8, 40, 960, 5502.0, true),
    row("h100-sxm", B7, 2048, 8, 6, 48, 10643.0, false),
    row("h100-sxm", B7, 1024, 8, 64, 1024, 10203.0, true),
    row("h100-sxm", B3, 2048, 64, 6, 1152, 22525.0, false),
    row("h100-sxm", B3, 2048, 32, 6, 576, 23021.0, false),
    row("h100-sxm", B3, 2048, 16, 10, 480, 24142.0, false),
    row("h100-sxm", B3, 1024, 8, 20, 960, 27046.0, false),
    row("h100-sxm", B3, 512, 8, 40, 1920, 27965.0, false),
    row("h100-sxm", B1, 2048, 64, 20, 1280, 44402.0, false),
    row("h100-sxm", B1, 2048, 32, 20, 640, 45130.0, false),
    row("h100-sxm", B1, 2048, 16, 20, 320, 46037.0, false),
    row("h100-sxm", B1, 2048, 8, 14, 112, 45455.0, false),
    row("h100-sxm", B1, 1024, 8, 18, 576, 48910.0, false),
    row("h100-sxm", B1, 512, 8, 56, 1792, 52275.0, false),
    row("h100-sxm", M760, 2048, 32, 24, 768, 67971.0, false),
    row("h100-sxm", M760, 2048, 16, 24, 384, 68551.0, false),
    row("h100-sxm", M760, 2048, 8, 24, 384, 63147.0, false),
    row("h100-sxm", M760, 1024, 8, 48, 768, 78581.0, false),
    row("h100-sxm", M760, 512, 8, 96, 1536, 83749.0, false),
];
