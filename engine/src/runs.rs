//! Measured training runs, as a team records them: one run per CSV row or JSON line, with the
//! layout it ran and what it measured (`autopar validate`, README "Validating predictions").
//!
//! Columns (CSV header, or JSON keys; a missing optional column takes its default):
//!
//! | column        | required | meaning |
//! |---------------|----------|---------|
//! | `model`       | yes      | a workspace model, or a model file (relative to the working directory or to the runs file) |
//! | `cluster`     | yes      | a workspace cluster, `PRESET:NODESxGPUS`, or `NODE-PRESET:NODES` (`dgx-h100:4`) |
//! | `tp` `pp` `dp`| yes      | tensor-, pipeline- and data-parallel degrees |
//! | `mbs` `gbs`   | yes      | micro-batch and global batch, sequences |
//! | `step_time_s` | yes      | measured seconds per step, or `oom` for a run that ran out of memory |
//! | `cp`          | no (1)   | context-parallel degree |
//! | `cp_comm`     | no (p2p) | `p2p`, `a2a`, `allgather` or `a2a+p2p` (Megatron-Core's `--cp-comm-type`) |
//! | `ep` `etp`    | no (1)   | expert- and expert-tensor-parallel degrees |
//! | `vp`          | no (1)   | model chunks per pipeline stage |
//! | `seq`         | no       | sequence length (default: the model's) |
//! | `sp`          | no (false) | sequence parallelism (`true`/`false`/`1`/`0`) |
//! | `recompute`   | no (none) | `none`, `selective`, `full` or `selective-op` (torchtitan's `op` policy) |
//! | `recompute_layers` | no (all) | under `full`: blocks recomputed per pipeline stage, or per model chunk with `vp` (Megatron-LM's `--recompute-method block --recompute-num-layers N`; torchtitan's every-other-block checkpointing of L blocks on one stage is L/2) |
//! | `zero`        | no (0)   | ZeRO stage, or the distributed optimizer as stage 1 |
//! | `runtime`     | no (megatron-core) | the runtime preset ([`Runtime`]) |
//! | `precision`   | no       | `bf16`, `fp16` or `fp32` (default: the runtime's) |
//! | `attention`   | no       | `flash`, `flash-triton` or `unfused` (default: the runtime's) |
//! | `grad_reduce_in_fp32` `overlap_grad_reduce` `overlap_param_gather` `fp32_loss` `tp_comm_overlap` | no | `true`/`false` (default: the runtime's) |
//! | `backward_prefetch` | no | `pre`, `post` or `none`: when ZeRO-3 gathers a block's weights for its backward ([`BackwardPrefetch`]; default: the runtime's) |
//! | `memory_gib`  | no       | measured peak memory per GPU, GiB |
//! | `source` `note` | no     | free text, ignored |
//!
//! CSV lines starting with `#` are comments; blank lines are skipped.

use crate::diagnostic::Diagnostic;
use crate::error::EngineError;
use autopar_rules::cost::context_parallel::CpComm;
use autopar_rules::cost::memory::Precision;
use autopar_rules::limits;
use autopar_rules::model::frontend::Attention;
use autopar_rules::plan::estimate::{Estimate, Estimator};
use autopar_rules::plan::layout::{BackwardPrefetch, Layout, LayoutError, Recompute};
use autopar_rules::plan::runtime::{GivenSettings, Runtime};
use std::collections::BTreeMap;
use std::path::Path;

/// Every column a runs file may have.
pub const COLUMNS: [&str; 32] = [
    "model",
    "cluster",
    "tp",
    "pp",
    "dp",
    "cp",
    "cp_comm",
    "ep",
    "etp",
    "vp",
    "mbs",
    "gbs",
    "seq",
    "sp",
    "recompute",
    "recompute_layers",
    "zero",
    "runtime",
    "precision",
    "attention",
    "grad_reduce_in_fp32",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "fp32_loss",
    "eager_elementwise",
    "fp8",
    "tp_comm_overlap",
    "backward_prefetch",
    "step_time_s",
    "memory_gib",
    "source",
    "note",
];

/// What a run measured of its step time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum MeasuredTime {
    /// It ran: seconds per step.
    Seconds(f64),
    /// It ran out of memory.
    OutOfMemory,
}

/// One measured run.
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredRun {
    /// 1-based line of the file it came from.
    pub line: usize,
    /// Model: workspace name or file.
    pub model: String,
    /// Cluster: workspace name or shorthand.
    pub cluster: String,
    /// The layout it ran.
    pub layout: Layout,
    /// Sequence length, when given.
    pub seq: Option<u64>,
    /// Runtime preset.
    pub runtime: Runtime,
    /// Precision, when given (else the runtime's).
    pub precision: Option<Precision>,
    /// Attention kernel, when given (else the runtime's).
    pub attention: Option<Attention>,
    /// The runtime settings the run states (the others are the runtime's).
    pub settings: GivenSettings,
    /// Under full recomputation, how many blocks of each stage are recomputed (all when
    /// absent).
    pub recompute_layers: Option<u64>,
    /// Measured step time.
    pub step_time: MeasuredTime,
    /// Measured peak memory per GPU, GiB.
    pub memory_gib: Option<f64>,
}

impl MeasuredRun {
    /// The run priced by `est` as it ran: its layout split evenly, recomputing the blocks it
    /// says.
    pub fn price(&self, est: &Estimator<'_>) -> Result<Estimate, LayoutError> {
        match self.recompute_layers {
            Some(n) => est.evaluate_recomputing(&self.layout, n as usize),
            None => est.evaluate(&self.layout),
        }
    }
}

/// Reads the runs of `path`: JSON lines when its name ends in `.jsonl` or `.json`, CSV
/// otherwise.
pub fn load(path: &Path) -> Result<Vec<MeasuredRun>, EngineError> {
    let text = crate::input::read_text(path)?;
    let json = path
        .extension()
        .is_some_and(|e| e == "jsonl" || e == "json");
    parse(path, &text, json)
}

/// An input error at `line` of `path`.
pub(crate) fn bad(
    path: &Path,
    line: usize,
    field: &str,
    expected: impl Into<String>,
    found: impl Into<String>,
) -> EngineError {
    EngineError::config(Diagnostic {
        file: path.to_path_buf(),
        line: Some(line),
        column: None,
        field: field.to_string(),
        expected: expected.into(),
        found: found.into(),
    })
}

/// One record: its line and its cells by column, as text.
type Record = (usize, BTreeMap<String, String>);

/// Parses the runs in `text` (the contents of `path`), CSV or JSON lines.
pub fn parse(path: &Path, text: &str, json: bool) -> Result<Vec<MeasuredRun>, EngineError> {
    let records = if json {
        json_records(path, text)?
    } else {
        csv_records(path, text)?
    };
    if records.is_empty() {
        return Err(bad(path, 1, "runs", "at least one measured run", "none"));
    }
    records
        .into_iter()
        .map(|(line, cells)| run(path, line, &cells))
        .collect()
}

fn check_column(path: &Path, line: usize, name: &str) -> Result<(), EngineError> {
    if COLUMNS.contains(&name) {
        Ok(())
    } else {
        Err(bad(
            path,
            line,
            name,
            format!("a known column ({})", COLUMNS.join(", ")),
            format!("`{name}`"),
        ))
    }
}

fn csv_records(path: &Path, text: &str) -> Result<Vec<Record>, EngineError> {
    let mut reader = csv::ReaderBuilder::new()
        .comment(Some(b'#'))
        .trim(csv::Trim::All)
        .from_reader(text.as_bytes());
    // The reader's own line count skips blank lines, and a record's position is where the
    // reader began it (before the blank and comment lines it skipped): count from there, by
    // binary search in the offsets of the line starts.
    let starts: Vec<usize> = std::iter::once(0)
        .chain(text.match_indices('\n').map(|(i, _)| i + 1))
        .collect();
    let line_of = |p: &csv::Position| {
        let at = (p.byte() as usize).min(text.len());
        let mut line = starts.partition_point(|&s| s <= at);
        while let (Some(&from), Some(&next)) = (starts.get(line - 1), starts.get(line)) {
            let this = &text[from..next - 1];
            if !(this.trim().is_empty() || this.starts_with('#')) {
                break;
            }
            line += 1;
        }
        line
    };
    let csv_error = |e: csv::Error| {
        let line = e.position().map_or(1, line_of);
        let found = match e.kind() {
            csv::ErrorKind::UnequalLengths {
                expected_len, len, ..
            } => format!("{len} fields where the header has {expected_len}"),
            csv::ErrorKind::Utf8 { .. } => "text that is not UTF-8".to_string(),
            _ => e.to_string(),
        };
        bad(
            path,
            line,
            "row",
            "one comma-separated value per column",
            found,
        )
    };
    let header_record = reader.headers().map_err(csv_error)?.clone();
    let header_line = header_record.position().map_or(1, line_of);
    let header: Vec<String> = header_record.iter().map(str::to_string).collect();
    for name in &header {
        check_column(path, header_line, name)?;
    }
    let mut out = Vec::new();
    for record in reader.records() {
        let record = record.map_err(csv_error)?;
        let line = record.position().map_or(0, line_of);
        let cells = header
            .iter()
            .zip(record.iter())
            .filter(|(_, v)| !v.is_empty())
            .map(|(k, v)| (k.clone(), v.to_string()))
            .collect();
        out.push((line, cells));
    }
    Ok(out)
}

fn json_records(path: &Path, text: &str) -> Result<Vec<Record>, EngineError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let raw = raw.trim();
        if raw.is_empty() || raw.starts_with('#') {
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(raw)
            .map_err(|e| bad(path, line, "run", "one JSON object per line", e.to_string()))?;
        let serde_json::Value::Object(map) = value else {
            return Err(bad(
                path,
                line,
                "run",
                "a JSON object",
                raw.chars().take(40).collect::<String>(),
            ));
        };
        let mut cells = BTreeMap::new();
        for (k, v) in map {
            check_column(path, line, &k)?;
            let text = match v {
                serde_json::Value::Null => continue,
                serde_json::Value::String(s) => s,
                serde_json::Value::Bool(b) => b.to_string(),
                serde_json::Value::Number(n) => n.to_string(),
                other => {
                    return Err(bad(
                        path,
                        line,
                        &k,
                        "a number, string or boolean",
                        other.to_string(),
                    ));
                }
            };
            cells.insert(k, text);
        }
        out.push((line, cells));
    }
    Ok(out)
}

/// The run of one record.
fn run(
    path: &Path,
    line: usize,
    cells: &BTreeMap<String, String>,
) -> Result<MeasuredRun, EngineError> {
    let text = |name: &str| -> Result<String, EngineError> {
        cells.get(name).cloned().ok_or_else(|| {
            bad(
                path,
                line,
                name,
                "a value (the column is required)",
                "nothing",
            )
        })
    };
    let int = |name: &str, default: Option<u64>, max: u64| -> Result<u64, EngineError> {
        match (cells.get(name), default) {
            (None, Some(d)) => Ok(d),
            (None, None) => Err(bad(
                path,
                line,
                name,
                "a value (the column is required)",
                "nothing",
            )),
            (Some(v), _) => v
                .parse::<u64>()
                .ok()
                .filter(|n| (1..=max).contains(n))
                .ok_or_else(|| {
                    bad(
                        path,
                        line,
                        name,
                        format!("an integer in 1..={max}"),
                        format!("`{v}`"),
                    )
                }),
        }
    };
    let flag = |name: &str| -> Result<Option<bool>, EngineError> {
        match cells.get(name).map(String::as_str) {
            None => Ok(None),
            Some("false" | "0" | "no") => Ok(Some(false)),
            Some("true" | "1" | "yes") => Ok(Some(true)),
            Some(v) => Err(bad(path, line, name, "true or false", format!("`{v}`"))),
        }
    };
    let sp = flag("sp")?.unwrap_or(false);
    let recompute = match cells.get("recompute") {
        None => Recompute::None,
        Some(v) => Recompute::parse(v).ok_or_else(|| {
            bad(
                path,
                line,
                "recompute",
                "none, selective, full or selective-op",
                format!("`{v}`"),
            )
        })?,
    };
    let recompute_layers = match cells.get("recompute_layers") {
        None => None,
        Some(v) if recompute != Recompute::Full => {
            return Err(bad(
                path,
                line,
                "recompute_layers",
                "nothing unless `recompute` is full",
                format!("`{v}` with recompute {}", recompute.name()),
            ));
        }
        Some(_) => Some(int("recompute_layers", None, limits::MAX_LAYERS)?),
    };
    let zero = match cells.get("zero") {
        None => 0,
        Some(v) => v
            .parse::<u8>()
            .ok()
            .filter(|z| *z <= 3)
            .ok_or_else(|| bad(path, line, "zero", "0, 1, 2 or 3", format!("`{v}`")))?,
    };
    // A value of column `name` that is none of `names`.
    let not_one_of = |name: &str, names: String, v: &str| {
        bad(
            path,
            line,
            name,
            format!("one of {names}"),
            format!("`{v}`"),
        )
    };
    let runtime = cells
        .get("runtime")
        .map(|v| Runtime::parse(v).ok_or_else(|| not_one_of("runtime", Runtime::names(), v)))
        .transpose()?
        .unwrap_or_default();
    let precision = match cells.get("precision").map(String::as_str) {
        None => None,
        Some("bf16") => Some(Precision::Bf16),
        Some("fp16") => Some(Precision::Fp16),
        Some("fp32") => Some(Precision::Fp32),
        Some(v) => {
            return Err(bad(
                path,
                line,
                "precision",
                "bf16, fp16 or fp32",
                format!("`{v}`"),
            ));
        }
    };
    let attention = cells
        .get("attention")
        .map(|v| Attention::parse(v).ok_or_else(|| not_one_of("attention", Attention::names(), v)))
        .transpose()?;
    let backward_prefetch = cells
        .get("backward_prefetch")
        .map(|v| {
            BackwardPrefetch::parse(v)
                .ok_or_else(|| not_one_of("backward_prefetch", BackwardPrefetch::names(), v))
        })
        .transpose()?;
    let step_time = match text("step_time_s")?.as_str() {
        "oom" | "OOM" => MeasuredTime::OutOfMemory,
        v => MeasuredTime::Seconds(
            v.parse::<f64>()
                .ok()
                .filter(|t| t.is_finite() && *t > 0.0)
                .ok_or_else(|| {
                    bad(
                        path,
                        line,
                        "step_time_s",
                        "seconds > 0, or oom",
                        format!("`{v}`"),
                    )
                })?,
        ),
    };
    let memory_gib = match cells.get("memory_gib") {
        None => None,
        Some(v) => Some(
            v.parse::<f64>()
                .ok()
                .filter(|m| m.is_finite() && *m > 0.0)
                .ok_or_else(|| bad(path, line, "memory_gib", "GiB > 0", format!("`{v}`")))?,
        ),
    };
    Ok(MeasuredRun {
        line,
        model: text("model")?,
        cluster: text("cluster")?,
        layout: Layout {
            cp: int("cp", Some(1), limits::MAX_GPUS)?,
            cp_comm: match cells.get("cp_comm") {
                None => CpComm::default(),
                Some(v) => CpComm::parse(v)
                    .ok_or_else(|| bad(path, line, "cp_comm", CpComm::names(), format!("`{v}`")))?,
            },
            tp: int("tp", None, limits::MAX_GPUS)?,
            pp: int("pp", None, limits::MAX_GPUS)?,
            dp: int("dp", None, limits::MAX_GPUS)?,
            micro_batch: int("mbs", None, limits::MAX_BATCH)?,
            global_batch: int("gbs", None, limits::MAX_BATCH)?,
            interleave: int("vp", Some(1), limits::MAX_LAYERS)?,
            sequence_parallel: sp,
            recompute,
            zero,
            ep: int("ep", Some(1), limits::MAX_GPUS)?,
            etp: int("etp", Some(1), limits::MAX_GPUS)?,
        },
        seq: cells
            .get("seq")
            .map(|_| int("seq", None, limits::MAX_SEQ))
            .transpose()?,
        runtime,
        precision,
        attention,
        settings: GivenSettings {
            grad_accumulation_fusion: None,
            grad_reduce_in_fp32: flag("grad_reduce_in_fp32")?,
            overlap_grad_reduce: flag("overlap_grad_reduce")?,
            overlap_param_gather: flag("overlap_param_gather")?,
            fp32_loss: flag("fp32_loss")?,
            eager_elementwise: flag("eager_elementwise")?,
            fp8: flag("fp8")?,
            tp_comm_overlap: flag("tp_comm_overlap")?,
            backward_prefetch,
        },
        recompute_layers,
        step_time,
        memory_gib,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const HEADER: &str = "model,cluster,tp,pp,dp,mbs,gbs,step_time_s";

    fn csv(text: &str) -> Result<Vec<MeasuredRun>, EngineError> {
        parse(Path::new("runs.csv"), text, false)
    }

    #[test]
    fn csv_with_defaults_comments_and_every_optional_column() {
        let runs = csv(&format!(
            "# a comment\n{HEADER},seq,sp,recompute,zero,vp,runtime,precision,attention,memory_gib,cp,ep,source\n\
             gpt,a100-80g:2x8,8,2,1,1,64,12.5,2048,true,selective,1,2,megatron-2021,fp16,flash,61.5,1,1,paper\n\
             \n\
             gpt,a100-80g:2x8,8,2,1,1,64,oom,,,,,,,,,,,,\n\
             gpt,a100-80g:2x8,8,2,1,1,64,9.5,,,,,,llm-foundry,,flash-triton,,,,\n"
        ))
        .expect("parses");
        assert_eq!(runs.len(), 3);
        assert_eq!(runs[2].attention, Some(Attention::FlashTriton));
        assert_eq!(runs[2].settings.backward_prefetch, None);
        let post = csv(&format!(
            "{HEADER},backward_prefetch\ngpt,c,1,1,8,1,8,2.5,post\n"
        ))
        .expect("parses");
        assert_eq!(
            post[0].settings.backward_prefetch,
            Some(BackwardPrefetch::Post)
        );
        let r = &runs[0];
        assert_eq!(r.line, 3);
        assert_eq!((r.layout.tp, r.layout.pp, r.layout.dp), (8, 2, 1));
        assert_eq!((r.layout.interleave, r.layout.zero), (2, 1));
        assert!(r.layout.sequence_parallel);
        assert_eq!(r.layout.recompute, Recompute::Selective);
        assert_eq!(r.seq, Some(2048));
        assert_eq!(r.runtime, Runtime::Megatron2021);
        assert_eq!(r.precision, Some(Precision::Fp16));
        assert_eq!(r.attention, Some(Attention::Flash));
        assert_eq!(r.step_time, MeasuredTime::Seconds(12.5));
        assert_eq!(r.memory_gib, Some(61.5));
        let d = &runs[1];
        assert_eq!(d.line, 5);
        assert_eq!(d.step_time, MeasuredTime::OutOfMemory);
        assert_eq!((d.layout.interleave, d.layout.zero, d.seq), (1, 0, None));
        assert_eq!(d.runtime, Runtime::MegatronCore);
        assert_eq!((d.memory_gib, d.attention), (None, None));
    }

    #[test]
    fn json_lines_read_like_csv() {
        let runs = parse(
            Path::new("runs.jsonl"),
            "{\"model\":\"gpt\",\"cluster\":\"a100-80g:2x8\",\"tp\":8,\"pp\":2,\"dp\":1,\"mbs\":1,\"gbs\":64,\"step_time_s\":12.5,\"sp\":true,\"memory_gib\":null}\n\n\
             {\"model\":\"gpt\",\"cluster\":\"c\",\"tp\":1,\"pp\":1,\"dp\":16,\"mbs\":1,\"gbs\":64,\"step_time_s\":\"oom\"}\n",
            true,
        )
        .expect("parses");
        assert_eq!(runs.len(), 2);
        assert!(runs[0].layout.sequence_parallel);
        assert_eq!(runs[1].line, 3);
        assert_eq!(runs[1].step_time, MeasuredTime::OutOfMemory);
    }

    /// The message of an input error.
    fn message(r: Result<Vec<MeasuredRun>, EngineError>) -> String {
        match r {
            Ok(runs) => panic!("expected an error, got {runs:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn bad_input_names_line_field_expected_and_found() {
        let row = "gpt,c,8,2,1,1,64,12.5";
        for (text, want) in [
            (
                format!("{HEADER}\n{}", row.replace("12.5", "fast")),
                "runs.csv:2: field `step_time_s`: expected seconds > 0, or oom, found `fast`",
            ),
            (
                format!("{HEADER}\n{}", row.replace(",8,", ",0,")),
                "runs.csv:2: field `tp`: expected an integer in 1..=",
            ),
            (
                format!("{HEADER},ep\n{row},0"),
                "runs.csv:2: field `ep`: expected an integer in 1..=",
            ),
            (
                format!("{HEADER},cp,cp_comm\n{row},2,ring"),
                "runs.csv:2: field `cp_comm`: expected p2p, a2a, allgather, a2a+p2p, found `ring`",
            ),
            (
                format!("{HEADER},attention\n{row},triton"),
                "runs.csv:2: field `attention`: expected one of flash, flash-triton, fused, auto, unfused, found `triton`",
            ),
            (
                format!("{HEADER},backward_prefetch\n{row},BACKWARD_POST"),
                "runs.csv:2: field `backward_prefetch`: expected one of pre, post, none, found `BACKWARD_POST`",
            ),
            (
                format!("{HEADER},mb\n{row},2"),
                "runs.csv:1: field `mb`: expected a known column",
            ),
            (
                format!("{HEADER}\n{row},9"),
                "runs.csv:2: field `row`: expected one comma-separated value per column, found 9 fields where the header has 8",
            ),
            (
                format!("{HEADER},runtime\n{row},megatron"),
                "field `runtime`: expected one of megatron-core, nemo",
            ),
            (
                "model,cluster,tp,pp,dp,mbs,gbs\ngpt,c,1,1,1,1,1".to_string(),
                "runs.csv:2: field `step_time_s`: expected a value (the column is required), found nothing",
            ),
            (
                format!("# only a header\n{HEADER}\n"),
                "field `runs`: expected at least one measured run, found none",
            ),
        ] {
            let m = message(csv(&text));
            assert!(m.contains(want), "{text:?}\n  gave {m}\n  want {want}");
        }
        let m = message(parse(Path::new("r.jsonl"), "{\"tp\": [1]}\n", true));
        assert!(
            m.contains("r.jsonl:1: field `tp`: expected a number, string or boolean, found [1]"),
            "{m}"
        );
        let m = message(parse(Path::new("r.jsonl"), "\n[1, 2]\n", true));
        assert!(
            m.contains("r.jsonl:2: field `run`: expected a JSON object"),
            "{m}"
        );
    }

    proptest! {
        /// Any text, as CSV or as JSON lines, parses or is refused with a located error:
        /// never a panic.
        #[test]
        fn any_text_parses_or_is_refused(text in "[a-z0-9_,.#\"{}:\\[\\] \n-]{0,300}") {
            for json in [false, true] {
                if let Err(e) = parse(Path::new("f"), &text, json) {
                    prop_assert!(e.is_input_error(), "{e}");
                }
            }
        }

        /// A valid row with any degrees reads back what was written.
        #[test]
        fn written_rows_read_back(tp in 1u64..64, pp in 1u64..64, dp in 1u64..64, mbs in 1u64..16, t in 0.001f64..1e4) {
            let runs = csv(&format!("{HEADER}\ngpt,c,{tp},{pp},{dp},{mbs},{},{t}\n", mbs * dp))
                .expect("parses");
            prop_assert_eq!((runs[0].layout.tp, runs[0].layout.pp, runs[0].layout.dp), (tp, pp, dp));
            prop_assert_eq!(runs[0].step_time, MeasuredTime::Seconds(t));
        }
    }
}
