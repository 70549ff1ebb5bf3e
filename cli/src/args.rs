//! Command-line interface definition.

use autopar_rules::cost::context_parallel::CpComm;
use autopar_rules::cost::memory::Precision;
use autopar_rules::limits;
use autopar_rules::model::frontend::Attention;
use autopar_rules::plan::layout::{BackwardPrefetch, Recompute};
use autopar_rules::plan::runtime::Runtime;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::path::PathBuf;

/// Automatic parallel-training plans (tensor, pipeline, data parallelism, micro-batching,
/// recomputation, ZeRO), built like a build system.
#[derive(Debug, Parser)]
#[command(
    name = "autopar",
    version,
    after_help = "Exit codes: 0 success, 1 infeasible plan or failed command, 2 usage or input error, 3 some targets failed."
)]
pub struct Cli {
    /// Workspace file.
    #[arg(
        short,
        long,
        global = true,
        env = "AUTOPAR_WORKSPACE",
        default_value = "workspace.toml"
    )]
    pub workspace: PathBuf,
    /// More log output (-v info, -vv debug, -vvv trace); RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,
    /// Local cache directory (default: `[workspace] cache`, else .autopar/cache next to the
    /// workspace file).
    #[arg(long, global = true, env = "AUTOPAR_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Remote cache base URL, in the Bazel HTTP cache layout (default: `[cache] remote`).
    #[arg(long, global = true, env = "AUTOPAR_REMOTE_CACHE")]
    pub remote_cache: Option<String>,
    /// Read and upload (rw), or only read (ro).
    #[arg(long, global = true, env = "AUTOPAR_REMOTE_CACHE_MODE", value_enum)]
    pub remote_cache_mode: Option<RemoteMode>,
    /// File with the remote cache's bearer token (`AUTOPAR_REMOTE_TOKEN` takes precedence).
    #[arg(long, global = true, env = "AUTOPAR_REMOTE_TOKEN_FILE")]
    pub remote_token_file: Option<PathBuf>,
    /// Remote read timeout in milliseconds: how long the server may take to start answering
    /// (default 1000; transfers get 1 s per MiB more).
    #[arg(long, global = true, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub remote_timeout_ms: Option<u64>,
    /// Remote connect timeout in milliseconds (default 1000).
    #[arg(long, global = true, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub remote_connect_timeout_ms: Option<u64>,
    /// Instance prefix on the remote (`{url}/{instance}/ac/...`).
    #[arg(long, global = true)]
    pub remote_instance: Option<String>,
    /// PEM file of the certificates to trust for an https remote (a team's own CA; default:
    /// the public roots).
    #[arg(long, global = true, env = "AUTOPAR_REMOTE_CA_FILE")]
    pub remote_ca_file: Option<PathBuf>,
    /// Directory to write plans and traces to instead of `[workspace] plans` (any
    /// directory; created when missing).
    #[arg(long, global = true)]
    pub plans_dir: Option<PathBuf>,
    /// The command.
    #[command(subcommand)]
    pub command: Command,
}

/// Commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Plan the workspace's targets (all, or those named) and write plans/<target>.json.
    Build(BuildArgs),
    /// Price a layout chosen by hand, as Megatron-LM users pick --tensor-model-parallel-size etc.
    Estimate(EstimateArgs),
    /// Print a model's op graph: ops, parameters, FLOPs per token, per-layer summary.
    Graph(GraphArgs),
    /// Inspect stored plans.
    Plan {
        /// Plan subcommand.
        #[command(subcommand)]
        command: PlanCommand,
    },
    /// Solve a planning subproblem from numbers you bring (Alpa stage costs, SAPP profiles).
    Solve {
        /// Solver.
        #[command(subcommand)]
        command: SolveCommand,
    },
    /// Say, for every result the last build of a target recomputed, which input changed.
    Explain {
        /// Target.
        target: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Inspect or prune the local cache.
    Cache {
        /// Cache subcommand.
        #[command(subcommand)]
        command: CacheCommand,
    },
    /// Remove the plans, traces and build records of the workspace (and with --cache, every
    /// cached result).
    Clean {
        /// Also empty the local cache.
        #[arg(long)]
        cache: bool,
    },
    /// Work with profiles (measured op and collective times).
    Profile {
        /// Profile subcommand.
        #[command(subcommand)]
        command: ProfileCommand,
    },
    /// Build, then rebuild whenever the workspace or a file it reads changes.
    Watch(WatchArgs),
    /// Execute a plan's training steps on synthetic data (CPU threads as virtual devices) and
    /// compare the measured step time with the prediction; --check compares with one device.
    Run(RunArgs),
    /// Price every run of a file of measured runs (CSV or JSON lines) and report how far the
    /// predictions are: time and memory errors, rank correlation, out-of-memory verdicts.
    Validate(ValidateArgs),
    /// Fit the device numbers (efficiencies, kernel overhead) to measured runs by bounded least
    /// squares on log step time, report them with leave-one-out errors, and write them as a
    /// calibration file a cluster reads.
    Calibrate(CalibrateArgs),
    /// Write a plan as the launch configuration of a training framework (Megatron-LM script,
    /// NeMo YAML, torchtitan TOML, DeepSpeed JSON, Megatron-DeepSpeed script); what the
    /// framework cannot express is an error naming it.
    Export(ExportArgs),
    /// Print a shell completion script (`autopar completions bash > /etc/bash_completion.d/autopar`).
    Completions {
        /// The shell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Print the manual page in roff (`autopar man > autopar.1; man ./autopar.1`).
    Man,
    /// Price a layout you have in mind for a target (its model, cluster, batch, options and
    /// profile, as the build priced its plan) and set it beside the plan, component by
    /// component, with the main reason for the difference. Flags left out keep the plan's.
    Whatif(WhatifArgs),
    /// Write a target's plan as one self-contained HTML page (inline SVG charts: step time,
    /// memory per stage, the pipeline schedule, the layouts searched, the layer split, and
    /// what the last build recomputed).
    Report(ReportArgs),
}

/// `autopar report`.
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The target whose plan is shown.
    pub target: String,
    /// Where to write the page (default: `plans/<target>.html`).
    #[arg(short, long)]
    pub output: Option<std::path::PathBuf>,
}

/// `autopar whatif`.
#[derive(Debug, Args)]
pub struct WhatifArgs {
    /// The target whose plan the layout is compared with.
    pub target: String,
    /// Tensor-parallel size.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub tp: Option<u64>,
    /// Pipeline-parallel size.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub pp: Option<u64>,
    /// Data-parallel size (default: GPUs / (tp x cp x pp) when tp, cp or pp changes).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub dp: Option<u64>,
    /// Context-parallel size: ranks each sequence is split over.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub cp: Option<u64>,
    /// How context-parallel ranks exchange keys and values.
    #[arg(long, value_enum)]
    pub cp_comm_type: Option<CpCommArg>,
    /// Expert-parallel size (mixture-of-experts models).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub ep: Option<u64>,
    /// Expert tensor-parallel size (mixture-of-experts models).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub etp: Option<u64>,
    /// Micro-batch size.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub mbs: Option<u64>,
    /// Model chunks per pipeline stage.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_LAYERS))]
    pub vp: Option<u64>,
    /// Sequence parallelism, `true` or `false`.
    #[arg(long, value_name = "BOOL")]
    pub sp: Option<bool>,
    /// Activation recomputation.
    #[arg(long, value_enum)]
    pub recompute: Option<RecomputeArg>,
    /// ZeRO stage.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: Option<u8>,
    /// Print JSON (`plan`, `alternative`, `delta`, `reason`) instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `autopar export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Target whose plan (plans/<target>.json) is exported.
    #[arg(required_unless_present = "plan", conflicts_with = "plan")]
    pub target: Option<String>,
    /// A plan file to export instead of a target's.
    #[arg(long, value_name = "FILE")]
    pub plan: Option<PathBuf>,
    /// The framework.
    #[arg(long, value_enum)]
    pub format: FormatArg,
    /// Write here instead of to stdout.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Export the plan's best Megatron-LM layout where the plan chose an ILP pipeline that
    /// Megatron-LM's layouts cannot express.
    #[arg(long)]
    pub megatron_layout: bool,
    /// The DeepSpeed config file the Megatron-DeepSpeed script names.
    #[arg(long, value_name = "FILE", default_value = "ds_config.json")]
    pub deepspeed_config: String,
}

/// Frameworks of `autopar export`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum FormatArg {
    /// Megatron-LM: `torchrun ... pretrain_gpt.py`, one argument per line.
    Megatron,
    /// NeMo (Megatron-Core GPT): the model YAML.
    Nemo,
    /// torchtitan: the job TOML.
    Torchtitan,
    /// DeepSpeed: the config JSON.
    Deepspeed,
    /// Megatron-DeepSpeed: `pretrain_gpt.py` reading the DeepSpeed config.
    MegatronDeepspeed,
    /// JAX: a self-contained Python program running the plan through XLA (every tensor's
    /// sharding, stages as jitted functions in the schedule's order).
    Jax,
}

impl FormatArg {
    /// The framework whose launch configuration is written (`None`: a JAX program).
    pub fn framework(self) -> Option<autopar_engine::export::Framework> {
        use autopar_engine::export::Framework;
        match self {
            FormatArg::Megatron => Some(Framework::Megatron),
            FormatArg::Nemo => Some(Framework::Nemo),
            FormatArg::Torchtitan => Some(Framework::Torchtitan),
            FormatArg::Deepspeed => Some(Framework::Deepspeed),
            FormatArg::MegatronDeepspeed => Some(Framework::MegatronDeepspeed),
            FormatArg::Jax => None,
        }
    }
}

/// `autopar calibrate`.
#[derive(Debug, Args)]
pub struct CalibrateArgs {
    /// Measured runs, as `validate` reads them.
    pub runs: PathBuf,
    /// Write the calibration file here (a `[[cluster]]` reads it with `calibration = FILE`).
    #[arg(short = 'o', long = "output")]
    pub output: PathBuf,
    /// The device preset to fit, when the runs ran on several.
    #[arg(long)]
    pub device: Option<String>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `autopar validate`.
#[derive(Debug, Args)]
pub struct ValidateArgs {
    /// Measured runs: CSV with a header, or JSON lines (`.jsonl`); columns in the README's
    /// "Validating predictions".
    pub runs: PathBuf,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// Backends of `autopar run`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum BackendArg {
    /// One thread per virtual device, f32, in-process collectives.
    Cpu,
    /// NVIDIA GPUs (CUDA, cuBLAS, NVRTC, NCCL loaded at run time).
    Cuda,
    /// The plan exported as a JAX program and run by XLA on the devices JAX sees (virtual CPU
    /// devices, or GPUs through CUDA and NCCL); needs a Python with JAX.
    Jax,
}

impl From<BackendArg> for autopar_engine::executor::Backend {
    fn from(b: BackendArg) -> Self {
        match b {
            BackendArg::Cpu => Self::Cpu,
            BackendArg::Cuda => Self::Cuda,
            BackendArg::Jax => Self::Jax,
        }
    }
}

/// `autopar run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Target whose plan (plans/<target>.json) runs.
    #[arg(required_unless_present = "plan", conflicts_with = "plan")]
    pub target: Option<String>,
    /// A plan file to run instead of a target's.
    #[arg(long, value_name = "FILE")]
    pub plan: Option<PathBuf>,
    /// Backend.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendArg,
    /// Training steps (the first is a warm-up: the step time is the median of the others).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1000))]
    pub steps: u64,
    /// Seed of the random weights and synthetic data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also run the plan's model on one device and compare the loss of every step, every
    /// gradient and the updated weights (relative tolerance 1e-4); with `--backend jax`, also
    /// with autopar's CPU executor.
    #[arg(long)]
    pub check: bool,
    /// The Python with JAX that `--backend jax` runs (default: $AUTOPAR_PYTHON, else python3).
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Remote cache access.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RemoteMode {
    /// Read and upload.
    Rw,
    /// Read only.
    Ro,
}

/// `autopar cache ...`.
#[derive(Debug, Subcommand)]
pub enum CacheCommand {
    /// Entries and bytes per kind of result.
    Stats {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Check the database and every entry against its key and hash; remove what is damaged,
    /// bound to another key or incomplete, and say what was found (a damaged database is moved
    /// aside and replaced).
    Verify {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove least recently used entries until the cache holds at most --max-size.
    Gc {
        /// Size to shrink to: bytes, or with a suffix K, M, G (powers of 1024).
        #[arg(long)]
        max_size: String,
    },
    /// Run a remote cache server (Bazel HTTP cache layout) for a team.
    Serve(Box<ServeArgs>),
}

/// `autopar cache serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Directory to keep the blobs in.
    #[arg(long)]
    pub dir: PathBuf,
    /// Address to listen on (port 0 picks a free port and prints it).
    #[arg(long, default_value = "127.0.0.1:9092")]
    pub listen: String,
    /// Tokens file: one `read <token>` or `readwrite <token>` per line. Without it and without
    /// --htpasswd, anyone who can connect may read and write.
    #[arg(long)]
    pub tokens: Option<PathBuf>,
    /// htpasswd file of users who may read and write with HTTP basic auth (bcrypt, from
    /// `htpasswd -B`, or SHA-1, from `htpasswd -s`).
    #[arg(long)]
    pub htpasswd: Option<PathBuf>,
    /// Allow reads without credentials even when tokens or users are configured.
    #[arg(long)]
    pub allow_anonymous_read: bool,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key).
    #[arg(long, requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Most bytes of uploads in progress at once, with a suffix K, M, G; more are answered 503.
    #[arg(long, default_value = "1G")]
    pub max_inflight: String,
    /// Close a connection that sends or reads nothing for this long, or whose request headers
    /// take longer, in milliseconds.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    pub idle_timeout_ms: u64,
    /// Total size kept, with a suffix K, M, G; least recently used entries are evicted past it.
    #[arg(long, default_value = "10G")]
    pub max_size: String,
    /// Largest blob accepted, with a suffix K, M, G.
    #[arg(long, default_value = "256M")]
    pub max_blob: String,
}

/// `autopar profile ...`.
#[derive(Debug, Subcommand)]
pub enum ProfileCommand {
    /// Entries that differ between two profiles, and the cached results they invalidate.
    Diff {
        /// Old profile: a file or a workspace [[profile]] name.
        old: String,
        /// New profile: a file or a workspace [[profile]] name.
        new: String,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Every kernel and collective a target's search prices, with modelled times: a profile
    /// to fill in with measurements.
    Template {
        /// Target.
        target: String,
        /// Where to write it (default: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
    /// Measure every kernel and collective the targets training MODEL on CLUSTER price, on
    /// this machine, and write them as a profile.
    Run(ProfileRunArgs),
    /// Convert a profile (any time unit, shapes as strings) into the canonical file.
    Import {
        /// The profile to convert.
        input: PathBuf,
        /// Where to write the canonical file (default: standard output).
        #[arg(short, long)]
        output: Option<PathBuf>,
        /// The device it was measured on, when the file does not say.
        #[arg(long)]
        device: Option<String>,
    },
}

/// `autopar profile run`.
#[derive(Debug, Args)]
pub struct ProfileRunArgs {
    /// Model whose kernels are measured (with the shapes of the targets training it on
    /// --cluster).
    #[arg(long)]
    pub model: String,
    /// Cluster of those targets.
    #[arg(long)]
    pub cluster: String,
    /// Backend that runs the kernels.
    #[arg(long, value_enum, default_value = "cpu")]
    pub backend: BackendArg,
    /// The Python with JAX that `--backend jax` runs (default: $AUTOPAR_PYTHON, else python3).
    #[arg(long, value_name = "PATH")]
    pub python: Option<PathBuf>,
    /// Where to write the profile (default: standard output, the summary then goes to
    /// standard error).
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Kernels listed in the summary, slowest first.
    #[arg(long, default_value_t = 10)]
    pub top: usize,
    /// Print the summary as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `autopar watch`.
#[derive(Debug, Args)]
pub struct WatchArgs {
    /// Targets to build (default: all).
    pub targets: Vec<String>,
    /// How often to look at the files, in milliseconds.
    #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(10..=60_000))]
    pub interval_ms: u64,
}

/// `autopar solve ...`.
#[derive(Debug, Subcommand)]
pub enum SolveCommand {
    /// Alpa's stage-construction DP on profiled stage costs (Alpa's layout, as JSON).
    Stages {
        /// JSON with num_microbatches, submesh_choices, compute_cost[L][L][S][C],
        /// max_n_succ_stages[L][L][S][C], and num_devices or num_hosts + devices_per_host.
        #[arg(long)]
        input: PathBuf,
        /// Print JSON {"cost", "stages"}.
        #[arg(long)]
        json: bool,
    },
    /// SAPP pipeline balancing of layers and recomputation from a MindSpore SAPP yaml.
    Balance(BalanceArgs),
    /// Intra-operator auto-sharding (Alpa's ILP) of a layer range on a 2D device mesh.
    Sharding(ShardingArgs),
    /// Alpa's two levels on a model and cluster: per-layer intra-op tables chained into stage
    /// costs, then the stage DP over submeshes and logical meshes.
    Pipeline(PipelineArgs),
}

/// `autopar solve pipeline`.
#[derive(Debug, Args)]
pub struct PipelineArgs {
    /// Workspace model name, or a path to a HuggingFace config.json or a graph file.
    #[arg(long)]
    pub model: String,
    /// Workspace cluster name, PRESET:NODESxGPUS or NODE-PRESET:NODES.
    #[arg(long)]
    pub cluster: String,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub mbs: u64,
    /// Sequences per step (a multiple of --mbs).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub gbs: u64,
    /// Per-device memory budget, GiB (default: the device's memory less 10%).
    #[arg(long)]
    pub memory_gib: Option<f64>,
    /// Multi-node submeshes only of a power-of-two number of nodes.
    #[arg(long)]
    pub powers_of_two: bool,
    /// Logical mesh shapes stages may use, e.g. `2x2,1x4` (default: every factorisation of
    /// every submesh).
    #[arg(long, value_delimiter = ',')]
    pub logical_meshes: Vec<String>,
    /// Never recompute layers (by default a stage that fits only with activation
    /// checkpointing recomputes the fewest seconds of layers that fit).
    #[arg(long)]
    pub no_recompute: bool,
    /// What fills the layer tables: `auto` eliminates exactly and uses D-Rec for a layer too
    /// large for that, `exact` leaves such a layer off its mesh, `drec` uses D-Rec for
    /// every layer (not proven optimal).
    #[arg(long, value_enum, default_value_t = TableSolverArg::Auto)]
    pub solver: TableSolverArg,
    /// Model options.
    #[command(flatten)]
    pub model_options: ModelOptions,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// What fills the layer tables of `autopar solve pipeline`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum TableSolverArg {
    /// The exact elimination; D-Rec for a layer too large for it.
    Auto,
    /// Only the exact elimination (a layer too large for it is left off that mesh).
    Exact,
    /// D-Rec for every layer: linear time, not proven optimal.
    Drec,
}

/// Solver of `autopar solve sharding`.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ShardingSolverArg {
    /// The exact solver when the graph allows, else the ILP; D-Rec above 5,000 variables.
    Auto,
    /// Only the exact (variable-elimination) solver.
    Exact,
    /// Only the ILP (good_lp / microlp).
    Ilp,
    /// D-Rec (MindSpore's symbolic double-recursive partitioning): linear time, not proven
    /// optimal.
    Drec,
}

/// `autopar solve sharding`.
#[derive(Debug, Args)]
pub struct ShardingArgs {
    /// Workspace model name, or a path to a HuggingFace config.json or a graph file.
    #[arg(long)]
    pub model: String,
    /// Device mesh AxB: A nodes of B GPUs (as Alpa's meshes; 1x8 is one 8-GPU node, 8x1 one
    /// GPU on each of 8 nodes).
    #[arg(long)]
    pub mesh: String,
    /// Workspace cluster name, PRESET:NODESxGPUS, NODE-PRESET:NODES, or a preset name sized to the mesh.
    #[arg(long, default_value = autopar_engine::sharding::DEFAULT_PRESET)]
    pub cluster: String,
    /// Layers I..J (J excluded), I..=J or I, as `autopar graph` numbers them (default: the
    /// first transformer block).
    #[arg(long)]
    pub layers: Option<String>,
    /// Per-device memory budget, GiB (default: the device's memory).
    #[arg(long)]
    pub memory_gib: Option<f64>,
    /// Sequences per micro-batch (split across the mesh as the plan chooses).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub mbs: u64,
    /// Micro-batches per step: per-step costs (gradient synchronisation, optimizer) count
    /// 1/B against every micro-batch.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub microbatches: u64,
    /// Micro-batches whose activations are live at the memory peak (1F1B: stages - stage).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub inflight: u64,
    /// Solver.
    #[arg(long, value_enum, default_value = "auto")]
    pub solver: ShardingSolverArg,
    /// ILP time limit in seconds (the incumbent and its gap are reported when it is hit).
    #[arg(long, default_value_t = 60.0)]
    pub time_limit: f64,
    /// Also solve each layer once for every boundary state and chain the tables (the exact
    /// composition the build will use), and print the chained cost next to the range's.
    #[arg(long)]
    pub chain: bool,
    /// Model options.
    #[command(flatten)]
    pub model_options: ModelOptions,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `autopar solve balance` (SAPP's flags: -s, -mb, -i, -mem, -t).
#[derive(Debug, Args)]
pub struct BalanceArgs {
    /// SAPP yaml (pipeline_config, time_config, recompute_config, memory_usage).
    #[arg(long)]
    pub sapp: PathBuf,
    /// Pipeline stages.
    #[arg(short = 's', long, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub stages: u64,
    /// Micro-batches (SAPP: -mb).
    #[arg(long = "mb", value_parser = clap::value_parser!(u64).range(1..=1 << 20))]
    pub microbatches: u64,
    /// Chunks per stage (pipeline interleave).
    #[arg(short = 'i', long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub interleave: u64,
    /// Memory cap per stage in MB (SAPP: -mem).
    #[arg(long = "mem")]
    pub memory_mb: f64,
    /// Solver time limit in seconds.
    #[arg(short = 't', long, default_value_t = 60.0)]
    pub time_limit: f64,
    /// Write the simulated timeline as a Chrome trace to this file.
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Price the plans of this file next to the balanced one (SAPP: -manual): SAPP's
    /// `offset`, `recompute`, `select_recompute`, `select_comm_recompute` lists, named
    /// plans or one plan at the top level.
    #[arg(long, value_name = "PLAN.yaml")]
    pub manual: Option<PathBuf>,
    /// Price the even split too (SAPP: -naive [1]): under the yaml's recomputation, with
    /// none, and with every layer recomputed.
    #[arg(long, num_args = 0..=1, default_value = "false", default_missing_value = "true",
          value_parser = parse_switch)]
    pub naive: bool,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// A switch written SAPP's way (`1`/`0`) or clap's (`true`/`false`).
fn parse_switch(s: &str) -> Result<bool, String> {
    match s {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        _ => Err("expected 1 or 0 (true or false)".to_string()),
    }
}

/// `autopar build`.
#[derive(Debug, Args)]
pub struct BuildArgs {
    /// Targets to build (default: all).
    pub targets: Vec<String>,
    /// Print a JSON report instead of text.
    #[arg(long)]
    pub json: bool,
    /// Show what would be solved and what is cached, without solving or writing anything.
    #[arg(long)]
    pub dry_run: bool,
    /// Also write each planned target's HTML report (`plans/<target>.html`, as `autopar
    /// report` writes it).
    #[arg(long, conflicts_with = "dry_run")]
    pub report: bool,
}

/// Precision on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum PrecisionArg {
    /// bf16 mixed precision.
    Bf16,
    /// fp16 mixed precision.
    Fp16,
    /// fp32.
    Fp32,
}

impl From<PrecisionArg> for Precision {
    fn from(p: PrecisionArg) -> Self {
        match p {
            PrecisionArg::Bf16 => Precision::Bf16,
            PrecisionArg::Fp16 => Precision::Fp16,
            PrecisionArg::Fp32 => Precision::Fp32,
        }
    }
}

/// Attention implementation on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum AttentionArg {
    /// FlashAttention-2's CUDA kernels (flash-attn, PyTorch's scaled_dot_product_attention).
    Flash,
    /// Fused flash attention written in Triton (llm-foundry's `attn_impl: triton`).
    FlashTriton,
    /// cuDNN's fused attention (Megatron-Core's `--attention-backend fused`).
    Fused,
    /// Transformer Engine's choice: cuDNN on Hopper, flash-attn on Ampere (`--attention-backend auto`).
    Auto,
    /// Separate score, softmax, dropout and context kernels.
    Unfused,
}

impl From<AttentionArg> for Attention {
    fn from(a: AttentionArg) -> Self {
        match a {
            AttentionArg::Flash => Attention::Flash,
            AttentionArg::FlashTriton => Attention::FlashTriton,
            AttentionArg::Fused => Attention::Fused,
            AttentionArg::Auto => Attention::Auto,
            AttentionArg::Unfused => Attention::Unfused,
        }
    }
}

/// Context-parallel communication on the command line (Megatron-Core's `--cp-comm-type`).
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum CpCommArg {
    /// A ring of point-to-point transfers overlapped with blockwise attention.
    P2p,
    /// All-to-all between a sequence split and a head split (DeepSpeed-Ulysses).
    A2a,
    /// All-gather of keys and values.
    Allgather,
    /// All-to-all inside a node, a ring across nodes (hierarchical).
    #[value(name = "a2a+p2p")]
    A2aP2p,
}

impl From<CpCommArg> for CpComm {
    fn from(c: CpCommArg) -> Self {
        match c {
            CpCommArg::P2p => CpComm::P2p,
            CpCommArg::A2a => CpComm::A2a,
            CpCommArg::Allgather => CpComm::AllGather,
            CpCommArg::A2aP2p => CpComm::A2aP2p,
        }
    }
}

/// Recomputation on the command line.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum RecomputeArg {
    /// No recomputation.
    None,
    /// Recompute the attention core.
    Selective,
    /// Recompute whole blocks.
    Full,
    /// torchtitan's `op` policy: keep attention outputs and every other linear output.
    SelectiveOp,
}

impl From<RecomputeArg> for Recompute {
    fn from(r: RecomputeArg) -> Self {
        match r {
            RecomputeArg::None => Recompute::None,
            RecomputeArg::Selective => Recompute::Selective,
            RecomputeArg::Full => Recompute::Full,
            RecomputeArg::SelectiveOp => Recompute::SelectiveOp,
        }
    }
}

/// Options shared by commands that instantiate a model.
#[derive(Debug, Args)]
pub struct ModelOptions {
    /// Sequence length (default: the model's maximum).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_SEQ))]
    pub seq: Option<u64>,
    /// Training runtime whose defaults apply (megatron-core, nemo, megatron-deepspeed,
    /// megatron-2021, torchtitan, llm-foundry): precision, attention kernel, weight-gradient
    /// accumulation fusion.
    #[arg(long, default_value = "megatron-core", value_parser = parse_runtime)]
    pub runtime: Runtime,
    /// Numeric precision (default: the runtime's).
    #[arg(long, value_enum)]
    pub precision: Option<PrecisionArg>,
    /// Attention-core implementation (default: the runtime's).
    #[arg(long, value_enum)]
    pub attention: Option<AttentionArg>,
}

impl ModelOptions {
    /// The precision given, else the runtime's.
    pub fn precision(&self) -> Precision {
        self.precision
            .map_or_else(|| self.runtime.precision(), Into::into)
    }

    /// The attention kernel given, else the runtime's.
    pub fn attention(&self) -> Attention {
        self.attention
            .map_or_else(|| self.runtime.attention(), Into::into)
    }
}

fn parse_backward_prefetch(s: &str) -> Result<BackwardPrefetch, String> {
    BackwardPrefetch::parse(s)
        .ok_or_else(|| format!("expected one of {}", BackwardPrefetch::names()))
}

fn parse_runtime(s: &str) -> Result<Runtime, String> {
    Runtime::parse(s).ok_or_else(|| format!("expected one of {}", Runtime::names()))
}

/// `autopar estimate`.
#[derive(Debug, Args)]
pub struct EstimateArgs {
    /// Workspace model name, or a path to a HuggingFace config.json or a graph file.
    #[arg(long)]
    pub model: String,
    /// Workspace cluster name, or PRESET:NODESxGPUS (e.g. a100-80g:48x8).
    #[arg(long)]
    pub cluster: String,
    /// Tensor-parallel size.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub tp: u64,
    /// Pipeline-parallel size.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub pp: u64,
    /// Data-parallel size (default: GPUs / (tp x cp x pp)).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub dp: Option<u64>,
    /// Context-parallel size: ranks each sequence is split over (Megatron-Core's
    /// `--context-parallel-size`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub cp: u64,
    /// How context-parallel ranks exchange keys and values (Megatron-Core's `--cp-comm-type`).
    #[arg(long, value_enum, default_value = "p2p")]
    pub cp_comm_type: CpCommArg,
    /// Expert-parallel size of the mixture-of-experts layers (Megatron-Core's
    /// `--expert-model-parallel-size`).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub ep: u64,
    /// Expert tensor-parallel size (Megatron-Core's `--expert-tensor-parallel-size`; default:
    /// tp for a mixture-of-experts model, as in Megatron-Core, 1 for a dense one).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_GPUS))]
    pub etp: Option<u64>,
    /// Micro-batch size.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub mbs: u64,
    /// Global batch size.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub gbs: u64,
    /// Model chunks per pipeline stage (interleaved schedule).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_LAYERS))]
    pub vp: u64,
    /// Sequence parallelism.
    #[arg(long)]
    pub sp: bool,
    /// Activation recomputation.
    #[arg(long, value_enum, default_value = "none")]
    pub recompute: RecomputeArg,
    /// Under `--recompute full`: recompute only the first N blocks of each pipeline stage
    /// (model chunk under interleaving), as Megatron-LM's `--recompute-method block
    /// --recompute-num-layers N`.
    #[arg(long, value_name = "N", conflicts_with = "balance",
          value_parser = clap::value_parser!(u64).range(1..=limits::MAX_LAYERS))]
    pub recompute_num_layers: Option<u64>,
    /// ZeRO stage.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero: u8,
    /// Model options.
    #[command(flatten)]
    pub model_options: ModelOptions,
    /// Weight gradients are added to the gradient buffer by a separate kernel every
    /// micro-batch (Megatron-LM before --gradient-accumulation-fusion).
    #[arg(long)]
    pub no_grad_accumulation_fusion: bool,
    /// Gradients accumulated and reduced in fp32, `true` or `false` (default: the
    /// runtime's; Megatron's `--accumulate-allreduce-grads-in-fp32`).
    #[arg(long, value_name = "BOOL")]
    pub grad_reduce_in_fp32: Option<bool>,
    /// The data-parallel gradient reduction overlaps the backward, `true` or `false`
    /// (default: the runtime's; Megatron-Core's `--overlap-grad-reduce`).
    #[arg(long, value_name = "BOOL")]
    pub overlap_grad_reduce: Option<bool>,
    /// The all-gather of updated weights under a sharded optimizer overlaps the next forward,
    /// `true` or `false` (default: the runtime's; Megatron-Core's `--overlap-param-gather`).
    #[arg(long, value_name = "BOOL")]
    pub overlap_param_gather: Option<bool>,
    /// The loss is PyTorch's unfused cross-entropy on fp32 logits, whose backward holds two
    /// more fp32 logit-sized tensors, `true` or `false` (default: the runtime's; torchtitan's).
    #[arg(long, value_name = "BOOL")]
    pub fp32_loss: Option<bool>,
    /// RMSNorm, RoPE and SwiGLU run as eager PyTorch composites of elementwise kernels,
    /// `true` or `false` (default: the runtime's; torchtitan's).
    #[arg(long, value_name = "BOOL")]
    pub eager_elementwise: Option<bool>,
    /// Transformer Engine's userbuffers overlap the tensor-parallel all-gathers and
    /// reduce-scatters of sequence parallelism with the products next to them, `true` or
    /// `false` (default: the runtime's; Megatron-Core's `--tp-comm-overlap`, on in NeMo's
    /// recipes).
    #[arg(long, value_name = "BOOL")]
    pub tp_comm_overlap: Option<bool>,
    /// When ZeRO-3 gathers each block's weights for its backward: `pre` (issued before the
    /// block the backward is in computes its gradients), `post` (after) or `none` (when
    /// autograd reaches the block); default: the runtime's, `pre` in every preset (PyTorch
    /// FSDP's `backward_prefetch`; Composer defaults to `post`).
    #[arg(long, value_name = "WHEN", value_parser = parse_backward_prefetch)]
    pub backward_prefetch: Option<BackwardPrefetch>,
    /// Transformer Engine's FP8 training (Megatron-LM's `--fp8-format hybrid`): the blocks'
    /// products with a weight run on the FP8 tensor cores (Hopper or later).
    #[arg(long)]
    pub fp8: bool,
    /// Fraction of device memory kept free.
    #[arg(long, default_value_t = autopar_engine::workspace::DEFAULT_MEMORY_HEADROOM)]
    pub memory_headroom: f64,
    /// Split the layers as `build` does (even, Alpa's DP, SAPP balancing; the fastest that
    /// fits) instead of evenly; with full recomputation, recompute only as many blocks per
    /// chunk as memory needs.
    #[arg(long)]
    pub balance: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `autopar graph`.
#[derive(Debug, Args)]
pub struct GraphArgs {
    /// Workspace model name, or a path to a HuggingFace config.json or a graph file.
    pub model: String,
    /// Micro-batch size the graph is instantiated with.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=limits::MAX_BATCH))]
    pub mbs: u64,
    /// Model options.
    #[command(flatten)]
    pub model_options: ModelOptions,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// `autopar plan ...`.
#[derive(Debug, Subcommand)]
pub enum PlanCommand {
    /// Print a stored plan.
    Show {
        /// Target name.
        target: String,
        /// Print the plan file's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Set two plan files side by side: the inputs that differ, each plan's step time, and
    /// their Megatron-LM layouts component by component.
    Diff {
        /// The first plan file.
        a: std::path::PathBuf,
        /// The second plan file.
        b: std::path::PathBuf,
        /// Print JSON (`inputs`, `step_time_s`, `space`, `delta`, `reason`).
        #[arg(long)]
        json: bool,
    },
}
