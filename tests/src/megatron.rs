//! Megatron-LM 2021 weak-scaling results (Narayanan et al., "Efficient Large-Scale Language
//! Model Training on GPU Clusters Using Megatron-LM", SC'21, Table 1): GPT models trained with
//! tensor, pipeline and data parallelism on DGX A100 80GB nodes (Selene), sequence length 2048,
//! vocabulary 51,200, full activation recomputation, mixed precision (fp16).

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
        tflops: 137.0,
    },
    Row {
        model: "gpt-3.6b.json",
        tp: 2,
        pp: 1,
        gpus: 64,
        global_batch: 512,
        tflops: 138.0,
    },
    Row {
        model: "gpt-7.5b.json",
        tp: 4,
        pp: 1,
        gpus: 128,
        global_batch: 512,
        tflops: 142.0,
    },
    Row {
        model: "gpt-18.4b.json",
        tp: 8,
        pp: 1,
        gpus: 256,
        global_batch: 1024,
        tflops: 135.0,
    },
    Row {
        model: "gpt-39.1b.json",
        tp: 8,
        pp: 2,
        gpus: 512,
        global_batch: 1536,
        tflops: 138.0,
    },
    Row {
        model: "gpt-76.1b.json",
        tp: 8,
        pp: 4,
        gpus: 1024,
        global_batch: 1792,
        tflops: 140.0,
    },
    Row {
        model: "gpt-145.6b.json",
        tp: 8,
        pp: 8,
        gpus: 1536,
        global_batch: 2304,
        tflops: 148.0,
    },
    Row {
        model: "gpt-310.1b.json",
        tp: 8,
        pp: 16,
        gpus: 1920,
        global_batch: 2160,
        tflops: 155.0,
    },
    Row {
        model: "gpt-529.6b.json",
        tp: 8,
        pp: 35,
        gpus: 2520,
        global_batch: 2520,
        tflops: 163.0,
    },
    Row {
        model: "gpt-1t.json",
        tp: 8,
        pp: 64,
        gpus: 3072,
        global_batch: 3072,
        tflops: 163.0,
    },
];

impl Row {
    /// Data-parallel size.
    pub fn dp(&self) -> u64 {
        self.gpus / (self.tp * self.pp)
    }

    /// The `autopar estimate` flags for this row. The paper does not list micro-batch
    /// sizes; 1 is the only size at which every row meets Megatron-LM's interleaving rule
    /// (micro-batches divisible by pp), and the software of the time ran unfused attention and
    /// accumulated weight gradients in a separate kernel.
    pub fn estimate_args(&self, interleave: u64) -> Vec<String> {
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
            "1",
            "--gbs",
            &self.global_batch.to_string(),
            "--vp",
            &interleave.to_string(),
        ]
        .iter()
        .chain(&SOFTWARE_2021)
        .map(|s| s.to_string())
        .collect()
    }
}
