//! Megatron-LM 2021 weak-scaling results (Narayanan et al., "Efficient Large-Scale Language
//! Model Training on GPU Clusters Using Megatron-LM", SC'21, Table 1): GPT models trained with
//! tensor, pipeline and data parallelism on DGX A100 80GB nodes (Selene), sequence length 2048,
//! vocabulary 51,200, full activation recomputation, mixed precision (fp16).
//!
//! The paper gives t, p, GPUs and global batch; NVIDIA's scripts that produced the table
//! (`examples/sc21/run_table_1.sh` and `CONFIG.sh` in the Megatron-LM repository) give the rest:
//! each row's micro-batch size and layers per virtual pipeline stage, `--fp16`,
//! `--seq-length 2048`, `--recompute-method uniform` (every block recomputed), run in NGC's
//! PyTorch 20.12 container.

/// `autopar estimate` arguments for how the 2021 Megatron-LM runs executed: fp16, unfused
/// attention, weight gradients accumulated in a separate kernel, full recomputation, sequence
/// 2048.
pub const SOFTWARE_2021: [&str; 9] = [
    "--precision",
    "fp16",
    "--attention",
    "unfused",
    "--no-grad-accumulation-fusion",
    "--recompute",
    "full",
    "--seq",
    "2048",
];

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct Row {
    /// Model file under `models/`.
    pub model: &'static str,
    /// Tensor-parallel size.
    pub tp: u64,
    /// Pipeline-parallel size.
    pub pp: u64,
    /// GPUs.
    pub gpus: u64,
    /// Global batch size.
    pub global_batch: u64,
    /// Micro-batch size (`MBS` in `run_table_1.sh`).
    pub micro_batch: u64,
    /// Model chunks per pipeline stage: layers / (pp x `--num-layers-per-virtual-pipeline-stage`),
    /// 1 where the script does not interleave.
    pub interleave: u64,
    /// Published achieved teraFLOP/s per GPU.
    pub tflops: f64,
}

/// The ten rows.
pub const TABLE1: [Row; 10] = [
    Row {
        model: "gpt-1.7b.json",
        tp: 1,
        pp: 1,
        gpus: 32,
        global_batch: 512,
        micro_batch: 16,
        interleave: 1,
        tflops: 137.0,
    },
    Row {
        model: "gpt-3.6b.json",
        tp: 2,
        pp: 1,
        gpus: 64,
        global_batch: 512,
        micro_batch: 16,
        interleave: 1,
        tflops: 138.0,
    },
    Row {
        model: "gpt-7.5b.json",
        tp: 4,
        pp: 1,
        gpus: 128,
        global_batch: 512,
        micro_batch: 16,
        interleave: 1,
        tflops: 142.0,
    },
    Row {
        model: "gpt-18.4b.json",
        tp: 8,
        pp: 1,
        gpus: 256,
        global_batch: 1024,
        micro_batch: 8,
        interleave: 1,
        tflops: 135.0,
    },
    Row {
        model: "gpt-39.1b.json",
        tp: 8,
        pp: 2,
        gpus: 512,
        global_batch: 1536,
        micro_batch: 4,
        interleave: 1,
        tflops: 138.0,
    },
    Row {
        model: "gpt-76.1b.json",
        tp: 8,
        pp: 4,
        gpus: 1024,
        global_batch: 1792,
        micro_batch: 2,
        interleave: 3,
        tflops: 140.0,
    },
    Row {
        model: "gpt-145.6b.json",
        tp: 8,
        pp: 8,
        gpus: 1536,
        global_batch: 2304,
        micro_batch: 2,
        interleave: 2,
        tflops: 148.0,
    },
    Row {
        model: "gpt-310.1b.json",
        tp: 8,
        pp: 16,
        gpus: 1920,
        global_batch: 2160,
        micro_batch: 1,
        interleave: 2,
        tflops: 155.0,
    },
    Row {
        model: "gpt-529.6b.json",
        tp: 8,
        pp: 35,
        gpus: 2520,
        global_batch: 2520,
        micro_batch: 1,
        interleave: 3,
        tflops: 163.0,
    },
    Row {
        model: "gpt-1t.json",
        tp: 8,
        pp: 64,
        gpus: 3072,
        global_batch: 3072,
        micro_batch: 1,
        interleave: 1,
        tflops: 163.0,
    },
];

impl Row {
    /// Data-parallel size.
    pub fn dp(&self) -> u64 {
        self.gpus / (self.tp * self.pp)
    }

    /// The `autopar estimate` flags for this row as NVIDIA ran it.
    pub fn estimate_args(&self) -> Vec<String> {
        [
            "--model",
            &format!("models/{}", self.model),
            "--cluster",
            &format!("a100-80g:{}x8", self.gpus / 8),
            "--tp",
            &self.tp.to_string(),
            "--pp",
            &self.pp.to_string(),
            "--dp",
            &self.dp().to_string(),
            "--mbs",
            &self.micro_batch.to_string(),
            "--gbs",
            &self.global_batch.to_string(),
            "--vp",
            &self.interleave.to_string(),
        ]
        .iter()
        .chain(&SOFTWARE_2021)
        .map(|s| s.to_string())
        .collect()
    }
}
