//! Measured costs (profiles): kernels identified by their op signature and collectives by kind,
//! group size and link, mapped to measured times that override the analytic cost model.
//!
//! An op signature is what determines a kernel's time: the op, forward or backward, the dtype
//! and the per-device shapes of its operands and results (tensor parallelism shows in the
//! shapes). A measured op replaces the roofline time of every op with that signature. A
//! collective is measured at several payload sizes; its time at another size is interpolated
//! linearly between the two nearest measurements (extrapolated from the last two beyond them),
//! as `nccl-tests` tables are read.
//!
//! The canonical file (`autopar-graph/1`-style JSON, documented in `docs/profile-format.md`):
//!
//! ```json
//! {
//!   "format": "autopar-profile/1",
//!   "device": "h100-sxm",
//!   "ops": [
//!     {"op": "matmul", "pass": "forward", "dtype": "bf16",
//!      "inputs": [[2048, 4096], [4096, 1536]], "outputs": [[2048, 1536]], "time_us": 61.5}
//!   ],
//!   "collectives": [
//!     {"collective": "all_reduce", "ranks": 8, "link": "nvlink", "bytes": 16777216, "time_us": 92.0}
//!   ]
//! }
//! ```

use crate::cost::analytic::Collective;
use crate::error::FieldError;
use crate::model::frontend::locate::{PathSeg, locate, offset_of};
use crate::model::graph::{DType, OpKind, Pass};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Value of the `format` field of a canonical profile.
pub const PROFILE_FORMAT: &str = "autopar-profile/1";

/// The kernel an op runs, as a profile identifies it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct OpSignature {
    /// Op name with its variant (`matmul`, `matmul_tb`, `flash_attention_causal`, ...).
    pub op: String,
    /// Forward or backward kernel.
    pub pass: Pass,
    /// Compute dtype.
    pub dtype: DType,
    /// Per-device shapes of the operands.
    pub inputs: Vec<Vec<u64>>,
    /// Per-device shapes of the results.
    pub outputs: Vec<Vec<u64>>,
}

fn shapes(s: &[Vec<u64>]) -> String {
    s.iter()
        .map(|d| {
            format!(
                "[{}]",
                d.iter().map(u64::to_string).collect::<Vec<_>>().join(",")
            )
        })
        .collect::<Vec<_>>()
        .join("x")
}

impl fmt::Display for OpSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} {} {} {} -> {}",
            self.op,
            pass_name(self.pass),
            dtype_name(self.dtype),
            shapes(&self.inputs),
            shapes(&self.outputs)
        )
    }
}

/// A collective as a profile identifies it (times are measured per payload size).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CollectiveSignature {
    /// Which collective.
    pub collective: CollectiveName,
    /// Ranks in the group.
    pub ranks: u64,
    /// The group spans nodes (network) rather than one node (NVLink).
    pub internode: bool,
}

/// [`Collective`] with an order, for sorted profiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CollectiveName {
    /// All-reduce.
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-to-all.
    AllToAll,
}

impl From<Collective> for CollectiveName {
    fn from(c: Collective) -> Self {
        match c {
            Collective::AllReduce => CollectiveName::AllReduce,
            Collective::AllGather => CollectiveName::AllGather,
            Collective::ReduceScatter => CollectiveName::ReduceScatter,
            Collective::AllToAll => CollectiveName::AllToAll,
        }
    }
}

impl CollectiveName {
    /// The name profiles and reports use (`all_reduce`, ...).
    pub fn name(self) -> &'static str {
        match self {
            CollectiveName::AllReduce => "all_reduce",
            CollectiveName::AllGather => "all_gather",
            CollectiveName::ReduceScatter => "reduce_scatter",
            CollectiveName::AllToAll => "all_to_all",
        }
    }
}

impl fmt::Display for CollectiveSignature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} x{} {}",
            self.collective.name(),
            self.ranks,
            if self.internode { "network" } else { "nvlink" }
        )
    }
}

/// One measurement of a profile.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum EntryId {
    /// A kernel.
    Op(OpSignature),
    /// A collective at a payload size in bytes.
    Collective(CollectiveSignature, u64),
}

impl fmt::Display for EntryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EntryId::Op(s) => write!(f, "{s}"),
            EntryId::Collective(s, bytes) => write!(f, "{s} {bytes} B"),
        }
    }
}

/// A measured time an estimate used: the entry and its value as the file holds it, in
/// microseconds (bit-exact, so a key built from reads changes exactly when a read value does).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProfileRead {
    /// The entry.
    pub entry: EntryId,
    /// Its time, us.
    pub time_us: f64,
}

/// A set of measurements for one device model. Times are kept in microseconds, as files hold
/// them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    /// Device model the measurements were taken on (a preset name or the cluster's label).
    pub device: String,
    ops: BTreeMap<OpSignature, f64>,
    collectives: BTreeMap<CollectiveSignature, BTreeMap<u64, f64>>,
}

/// How two profiles differ (times in microseconds).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ProfileDiff {
    /// Entries in both with different times: (entry, old, new).
    pub changed: Vec<(EntryId, f64, f64)>,
    /// Entries only in the second.
    pub added: Vec<(EntryId, f64)>,
    /// Entries only in the first.
    pub removed: Vec<(EntryId, f64)>,
}

impl ProfileDiff {
    /// Every entry that differs.
    pub fn entries(&self) -> impl Iterator<Item = &EntryId> {
        self.changed
            .iter()
            .map(|c| &c.0)
            .chain(self.added.iter().map(|a| &a.0))
            .chain(self.removed.iter().map(|r| &r.0))
    }

    /// Whether the profiles hold the same measurements.
    pub fn is_empty(&self) -> bool {
        self.changed.is_empty() && self.added.is_empty() && self.removed.is_empty()
    }
}

/// Name of an op in profiles: the kind with its variant.
pub fn kernel_name(kind: OpKind) -> String {
    match kind {
        OpKind::MatMul { transpose_b: true } => "matmul_tb".to_string(),
        OpKind::BatchMatMul { transpose_b: true } => "batch_matmul_tb".to_string(),
        // A profile measures the kernel its runtime runs, whichever implementation that is.
        OpKind::FlashAttention { causal: true, .. } => "flash_attention_causal".to_string(),
        other => other.name().to_string(),
    }
}

/// Whether `tile` can be a device's tile of a tensor of `shape` on a mesh of `mesh` devices:
/// the same rank, and each dimension the tensor's divided by 1, either axis or both.
fn tiles(tile: &[u64], shape: &[u64], mesh: [u64; 2]) -> bool {
    let ways = [1, mesh[0], mesh[1], mesh[0] * mesh[1]];
    tile.len() == shape.len()
        && tile
            .iter()
            .zip(shape)
            .all(|(&t, &s)| t > 0 && ways.iter().any(|&w| t * w == s))
}

impl Profile {
    /// An empty profile for `device`.
    pub fn new(device: impl Into<String>) -> Self {
        Profile {
            device: device.into(),
            ..Profile::default()
        }
    }

    /// Number of measurements.
    pub fn len(&self) -> usize {
        self.ops.len() + self.collectives.values().map(BTreeMap::len).sum::<usize>()
    }

    /// Whether the profile holds no measurement.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Records a kernel time in microseconds (replacing an earlier one).
    pub fn insert_op(&mut self, sig: OpSignature, time_us: f64) {
        self.ops.insert(sig, time_us);
    }

    /// Records a collective time at `bytes` in microseconds (replacing an earlier one).
    pub fn insert_collective(&mut self, sig: CollectiveSignature, bytes: u64, time_us: f64) {
        self.collectives
            .entry(sig)
            .or_default()
            .insert(bytes, time_us);
    }

    /// Every measurement with its time in microseconds, sorted.
    pub fn entries(&self) -> Vec<(EntryId, f64)> {
        let mut out: Vec<(EntryId, f64)> = self
            .ops
            .iter()
            .map(|(s, &t)| (EntryId::Op(s.clone()), t))
            .collect();
        for (sig, points) in &self.collectives {
            out.extend(
                points
                    .iter()
                    .map(|(&b, &t)| (EntryId::Collective(*sig, b), t)),
            );
        }
        out
    }

    /// The measured time of a kernel, s, with the measurement read.
    pub fn op_time(&self, sig: &OpSignature) -> Option<(f64, ProfileRead)> {
        self.ops.get(sig).map(|&time_us| {
            (
                time_us * 1e-6,
                ProfileRead {
                    entry: EntryId::Op(sig.clone()),
                    time_us,
                },
            )
        })
    }

    /// The measured kernels of the op named `op` (forward or backward, in `dtype`) whose
    /// operands could be its tiles on a mesh of `mesh` devices (see [`tiles`]): every entry
    /// the intra-op problem may read for it, whatever its strategy.
    pub fn tilings(
        &self,
        op: &str,
        pass: Pass,
        dtype: DType,
        operands: (&[&[u64]], &[&[u64]]),
        mesh: [u64; 2],
    ) -> Vec<ProfileRead> {
        let (inputs, outputs) = operands;
        let all = |tiles_: &[Vec<u64>], shapes: &[&[u64]]| {
            tiles_.len() == shapes.len()
                && tiles_.iter().zip(shapes).all(|(t, s)| tiles(t, s, mesh))
        };
        self.ops
            .iter()
            .filter(|(sig, _)| {
                sig.op == op
                    && sig.pass == pass
                    && sig.dtype == dtype
                    && all(&sig.inputs, inputs)
                    && all(&sig.outputs, outputs)
            })
            .map(|(sig, &time_us)| ProfileRead {
                entry: EntryId::Op(sig.clone()),
                time_us,
            })
            .collect()
    }

    /// Every measurement of a collective on a group of `ranks` ranks within one node
    /// (`internode` false) or across nodes.
    pub fn collective_points(&self, ranks: u64, internode: bool) -> Vec<ProfileRead> {
        self.collectives
            .iter()
            .filter(|(sig, _)| sig.ranks == ranks && sig.internode == internode)
            .flat_map(|(sig, points)| {
                points.iter().map(|(&bytes, &time_us)| ProfileRead {
                    entry: EntryId::Collective(*sig, bytes),
                    time_us,
                })
            })
            .collect()
    }

    /// The time of a collective of `bytes`, s, interpolated from the measurements of its
    /// signature, with the measurements it read; `None` if the signature was never measured.
    pub fn collective_time(
        &self,
        sig: &CollectiveSignature,
        bytes: f64,
    ) -> Option<(f64, Vec<ProfileRead>)> {
        let points = self.collectives.get(sig)?;
        let read = |(&b, &t): (&u64, &f64)| ProfileRead {
            entry: EntryId::Collective(*sig, b),
            time_us: t,
        };
        let mut it = points.iter();
        let first = it.next()?;
        let Some(second) = it.next() else {
            // One measurement: scale its bandwidth, keep nothing of a latency it hides.
            let (b, t) = first;
            let time = if *b == 0 { *t } else { t * bytes / *b as f64 };
            return Some((time.max(0.0) * 1e-6, vec![read(first)]));
        };
        // The segment holding `bytes`, or the first/last one to extrapolate from.
        let below = points.range(..=bytes.max(0.0) as u64).next_back();
        let above = points.range(bytes.max(0.0).ceil() as u64..).next();
        let (lo, hi) = match (below, above) {
            (Some(a), Some(b)) if a.0 == b.0 => return Some((*a.1 * 1e-6, vec![read(a)])),
            (Some(a), Some(b)) => (a, b),
            (None, _) => (first, second),
            (Some(_), None) => {
                let mut last = points.iter().rev();
                let hi = last.next()?;
                let lo = last.next()?;
                (lo, hi)
            }
        };
        let (b0, t0, b1, t1) = (*lo.0 as f64, *lo.1, *hi.0 as f64, *hi.1);
        let time = t0 + (t1 - t0) * (bytes - b0) / (b1 - b0);
        Some((time.max(0.0) * 1e-6, vec![read(lo), read(hi)]))
    }

    /// This profile with `other`'s measurements added, `other` winning where both measured.
    pub fn overlaid(&self, other: &Profile) -> Profile {
        let mut out = self.clone();
        for (sig, &t) in &other.ops {
            out.ops.insert(sig.clone(), t);
        }
        for (sig, points) in &other.collectives {
            let mine = out.collectives.entry(*sig).or_default();
            for (&b, &t) in points {
                mine.insert(b, t);
            }
        }
        out
    }

    /// What changed from `self` to `other`.
    pub fn diff(&self, other: &Profile) -> ProfileDiff {
        let a: BTreeMap<EntryId, f64> = self.entries().into_iter().collect();
        let b: BTreeMap<EntryId, f64> = other.entries().into_iter().collect();
        let mut d = ProfileDiff::default();
        for (id, &t) in &a {
            match b.get(id) {
                Some(&u) if u.to_bits() != t.to_bits() => d.changed.push((id.clone(), t, u)),
                Some(_) => {}
                None => d.removed.push((id.clone(), t)),
            }
        }
        for (id, &u) in &b {
            if !a.contains_key(id) {
                d.added.push((id.clone(), u));
            }
        }
        d
    }

    /// The canonical file: entries sorted, times in microseconds.
    pub fn to_canonical_json(&self) -> String {
        let ops: Vec<CanonOp> = self
            .ops
            .iter()
            .map(|(s, &t)| CanonOp {
                op: s.op.clone(),
                pass: pass_name(s.pass).to_string(),
                dtype: dtype_name(s.dtype).to_string(),
                inputs: s.inputs.clone(),
                outputs: s.outputs.clone(),
                time_us: t,
            })
            .collect();
        let mut collectives = Vec::new();
        for (sig, points) in &self.collectives {
            for (&bytes, &t) in points {
                collectives.push(CanonCollective {
                    collective: sig.collective.name().to_string(),
                    ranks: sig.ranks,
                    link: if sig.internode { "network" } else { "nvlink" }.to_string(),
                    bytes,
                    time_us: t,
                });
            }
        }
        // One entry per line: readable, and a change shows as one line in a diff.
        let lines = |entries: Vec<String>| -> String {
            if entries.is_empty() {
                "[]".to_string()
            } else {
                format!("[\n    {}\n  ]", entries.join(",\n    "))
            }
        };
        format!(
            "{{\n  \"format\": {},\n  \"device\": {},\n  \"ops\": {},\n  \"collectives\": {}\n}}\n",
            serde_json::Value::from(PROFILE_FORMAT),
            serde_json::Value::from(self.device.as_str()),
            lines(ops.iter().map(one_line).collect()),
            lines(collectives.iter().map(one_line).collect()),
        )
    }
}

fn pass_name(p: Pass) -> &'static str {
    match p {
        Pass::Forward => "forward",
        Pass::Backward => "backward",
    }
}

fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
        DType::I32 => "i32",
        DType::U8 => "u8",
        DType::F8 => "f8",
    }
}

/// An entry as one line of JSON.
fn one_line<T: Serialize>(v: &T) -> String {
    serde_json::to_string(v).unwrap_or_default()
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CanonFile {
    format: String,
    device: String,
    #[serde(default)]
    ops: Vec<CanonOp>,
    #[serde(default)]
    collectives: Vec<CanonCollective>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CanonOp {
    op: String,
    pass: String,
    dtype: String,
    inputs: Vec<Vec<u64>>,
    outputs: Vec<Vec<u64>>,
    time_us: f64,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct CanonCollective {
    collective: String,
    ranks: u64,
    link: String,
    bytes: u64,
    time_us: f64,
}

/// Op names a signature may carry: the graph's op kinds and their variants.
pub const OP_NAMES: &[&str] = &[
    "embedding",
    "embedding_grad",
    "matmul",
    "matmul_tb",
    "batch_matmul",
    "batch_matmul_tb",
    "layernorm",
    "rmsnorm",
    "softmax",
    "gelu",
    "silu",
    "swiglu",
    "add",
    "mul",
    "dropout",
    "dropout_add",
    "rope",
    "flash_attention",
    "flash_attention_causal",
    "cross_entropy",
    "slice",
    "transpose",
];

fn parse_pass(s: &str) -> Option<Pass> {
    match s {
        "forward" | "fwd" => Some(Pass::Forward),
        "backward" | "bwd" => Some(Pass::Backward),
        _ => None,
    }
}

fn parse_dtype(s: &str) -> Option<DType> {
    match s {
        "f32" | "fp32" => Some(DType::F32),
        "bf16" => Some(DType::Bf16),
        "f16" | "fp16" => Some(DType::F16),
        "i32" => Some(DType::I32),
        "u8" => Some(DType::U8),
        "f8" | "fp8" => Some(DType::F8),
        _ => None,
    }
}

fn parse_collective(s: &str) -> Option<CollectiveName> {
    match s.replace('-', "_").as_str() {
        "all_reduce" | "allreduce" => Some(CollectiveName::AllReduce),
        "all_gather" | "allgather" => Some(CollectiveName::AllGather),
        "reduce_scatter" | "reducescatter" => Some(CollectiveName::ReduceScatter),
        "all_to_all" | "alltoall" => Some(CollectiveName::AllToAll),
        _ => None,
    }
}

fn parse_link(s: &str) -> Option<bool> {
    match s {
        "nvlink" | "intranode" => Some(false),
        "network" | "internode" => Some(true),
        _ => None,
    }
}

/// Reads a canonical profile file. Every field is checked; errors carry the offset of the
/// offending value.
pub fn parse_profile(text: &str) -> Result<Profile, FieldError> {
    let file: CanonFile = serde_json::from_str(text).map_err(|e| {
        FieldError::new(
            "(document)",
            "an autopar-profile/1 JSON document",
            e.to_string(),
        )
        .at(Some(offset_of(text, e.line(), e.column())))
    })?;
    let err = |path: &[PathSeg<'_>], field: String, expected: String, found: String| {
        FieldError::new(field, expected, found).at(locate(text, path))
    };
    if file.format != PROFILE_FORMAT {
        return Err(err(
            &[PathSeg::Key("format")],
            "format".into(),
            format!("\"{PROFILE_FORMAT}\" (convert other files with `autopar profile import`)"),
            format!("\"{}\"", file.format),
        ));
    }
    let mut profile = Profile::new(file.device);
    for (i, o) in file.ops.iter().enumerate() {
        let at = |k: &'static str| {
            (
                [PathSeg::Key("ops"), PathSeg::Index(i), PathSeg::Key(k)],
                format!("ops[{i}].{k}"),
            )
        };
        let bad = |k: &'static str, expected: String, found: String| {
            let (path, field) = at(k);
            err(&path, field, expected, found)
        };
        if !OP_NAMES.contains(&o.op.as_str()) {
            return Err(bad(
                "op",
                format!("one of {}", OP_NAMES.join(", ")),
                format!("\"{}\"", o.op),
            ));
        }
        let pass = parse_pass(&o.pass).ok_or_else(|| {
            bad(
                "pass",
                "forward or backward".into(),
                format!("\"{}\"", o.pass),
            )
        })?;
        let dtype = parse_dtype(&o.dtype).ok_or_else(|| {
            bad(
                "dtype",
                "one of f32, bf16, f16, i32, u8".into(),
                format!("\"{}\"", o.dtype),
            )
        })?;
        check_time(o.time_us).map_err(|found| bad("time_us", time_expected(), found))?;
        let sig = OpSignature {
            op: o.op.clone(),
            pass,
            dtype,
            inputs: o.inputs.clone(),
            outputs: o.outputs.clone(),
        };
        if profile.ops.contains_key(&sig) {
            return Err(bad(
                "op",
                "each signature once".into(),
                format!("{sig} again"),
            ));
        }
        profile.insert_op(sig, o.time_us);
    }
    for (i, c) in file.collectives.iter().enumerate() {
        let bad = |k: &'static str, expected: String, found: String| {
            err(
                &[
                    PathSeg::Key("collectives"),
                    PathSeg::Index(i),
                    PathSeg::Key(k),
                ],
                format!("collectives[{i}].{k}"),
                expected,
                found,
            )
        };
        let collective = parse_collective(&c.collective).ok_or_else(|| {
            bad(
                "collective",
                "one of all_reduce, all_gather, reduce_scatter, all_to_all".into(),
                format!("\"{}\"", c.collective),
            )
        })?;
        let internode = parse_link(&c.link).ok_or_else(|| {
            bad(
                "link",
                "nvlink or network".into(),
                format!("\"{}\"", c.link),
            )
        })?;
        if c.ranks < 2 {
            return Err(bad("ranks", "at least 2".into(), c.ranks.to_string()));
        }
        check_time(c.time_us).map_err(|found| bad("time_us", time_expected(), found))?;
        let sig = CollectiveSignature {
            collective,
            ranks: c.ranks,
            internode,
        };
        if profile
            .collectives
            .get(&sig)
            .is_some_and(|p| p.contains_key(&c.bytes))
        {
            return Err(bad(
                "bytes",
                "each size once per collective".into(),
                format!("{} B again for {sig}", c.bytes),
            ));
        }
        profile.insert_collective(sig, c.bytes, c.time_us);
    }
    Ok(profile)
}

/// Whether `t` µs is a plausible measured time: zero is a real measurement (a view, the forward
/// of `slice`, runs no kernel); more than [`crate::limits::MAX_MEASURED_US`] is a typo or a unit
/// mix-up, and would overflow the step-time arithmetic.
fn plausible_time(t: f64) -> bool {
    t.is_finite() && (0.0..=crate::limits::MAX_MEASURED_US).contains(&t)
}

fn check_time(t: f64) -> Result<(), String> {
    if plausible_time(t) {
        Ok(())
    } else {
        Err(t.to_string())
    }
}

/// What a time field must hold.
fn time_expected() -> String {
    format!(
        "a time in microseconds from 0 to {} (one hour)",
        crate::limits::MAX_MEASURED_US
    )
}

/// Reads a profile in a looser form and returns it canonical: times as `time_s`, `time_ms` or
/// `time_us`; shapes as arrays or `"2048x4096"` strings; `pass` as `fwd`/`bwd` too;
/// collective names with dashes; `link` as `intranode`/`internode` too. `device` names the
/// device when the file does not.
pub fn import_profile(text: &str, device: Option<&str>) -> Result<Profile, FieldError> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
        FieldError::new("(document)", "a JSON document", e.to_string()).at(Some(offset_of(
            text,
            e.line(),
            e.column(),
        )))
    })?;
    let err = |path: &[PathSeg<'_>], field: String, expected: &str, found: String| {
        FieldError::new(field, expected, found).at(locate(text, path))
    };
    let device = match (value.get("device").and_then(|d| d.as_str()), device) {
        (_, Some(d)) => d.to_string(),
        (Some(d), None) => d.to_string(),
        (None, None) => {
            return Err(FieldError::new(
                "device",
                "the device the profile was measured on (in the file or with --device)",
                "nothing",
            ));
        }
    };
    let mut profile = Profile::new(device);
    let list = |key: &str| -> Vec<serde_json::Value> {
        value
            .get(key)
            .and_then(|v| v.as_array())
            .cloned()
            .unwrap_or_default()
    };
    let time = |v: &serde_json::Value| -> Option<f64> {
        let get = |k: &str| v.get(k).and_then(serde_json::Value::as_f64);
        match (get("time_s"), get("time_ms"), get("time_us")) {
            (Some(s), None, None) => Some(s * 1e6),
            (None, Some(ms), None) => Some(ms * 1e3),
            (None, None, Some(us)) => Some(us),
            _ => None,
        }
    };
    let shape_list = |v: Option<&serde_json::Value>| -> Option<Vec<Vec<u64>>> {
        v?.as_array()?
            .iter()
            .map(|s| match s {
                serde_json::Value::String(s) => s
                    .split(['x', 'X', '*'])
                    .map(|d| d.trim().parse::<u64>().ok())
                    .collect(),
                serde_json::Value::Array(dims) => dims.iter().map(|d| d.as_u64()).collect(),
                _ => None,
            })
            .collect()
    };
    for (i, o) in list("ops").iter().enumerate() {
        let path = |k: &'static str| [PathSeg::Key("ops"), PathSeg::Index(i), PathSeg::Key(k)];
        let field = |k: &str| format!("ops[{i}].{k}");
        let text_of = |k: &str| {
            o.get(k)
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_string()
        };
        let op = text_of("op").replace('-', "_");
        if !OP_NAMES.contains(&op.as_str()) {
            return Err(err(
                &path("op"),
                field("op"),
                "an op name (see docs/profile-format.md)",
                format!("\"{op}\""),
            ));
        }
        let pass = parse_pass(&text_of("pass")).ok_or_else(|| {
            err(
                &path("pass"),
                field("pass"),
                "forward or backward",
                format!("\"{}\"", text_of("pass")),
            )
        })?;
        let dtype = parse_dtype(&text_of("dtype")).ok_or_else(|| {
            err(
                &path("dtype"),
                field("dtype"),
                "one of f32, bf16, f16, i32, u8",
                format!("\"{}\"", text_of("dtype")),
            )
        })?;
        let inputs = shape_list(o.get("inputs")).ok_or_else(|| {
            err(
                &path("inputs"),
                field("inputs"),
                "a list of shapes",
                o.get("inputs").map_or("nothing".into(), |v| v.to_string()),
            )
        })?;
        let outputs = shape_list(o.get("outputs")).ok_or_else(|| {
            err(
                &path("outputs"),
                field("outputs"),
                "a list of shapes",
                o.get("outputs").map_or("nothing".into(), |v| v.to_string()),
            )
        })?;
        let t = time(o).filter(|&t| plausible_time(t)).ok_or_else(|| {
            err(
                &[PathSeg::Key("ops"), PathSeg::Index(i)],
                format!("ops[{i}]"),
                "exactly one time_s, time_ms or time_us, from 0 to one hour",
                o.to_string(),
            )
        })?;
        profile.insert_op(
            OpSignature {
                op,
                pass,
                dtype,
                inputs,
                outputs,
            },
            t,
        );
    }
    for (i, c) in list("collectives").iter().enumerate() {
        let path = |k: &'static str| {
            [
                PathSeg::Key("collectives"),
                PathSeg::Index(i),
                PathSeg::Key(k),
            ]
        };
        let field = |k: &str| format!("collectives[{i}].{k}");
        let text_of = |k: &str| {
            c.get(k)
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_string()
        };
        let collective = parse_collective(&text_of("collective")).ok_or_else(|| {
            err(
                &path("collective"),
                field("collective"),
                "one of all_reduce, all_gather, reduce_scatter, all_to_all",
                format!("\"{}\"", text_of("collective")),
            )
        })?;
        let internode = parse_link(&text_of("link")).ok_or_else(|| {
            err(
                &path("link"),
                field("link"),
                "nvlink or network",
                format!("\"{}\"", text_of("link")),
            )
        })?;
        let ranks = c
            .get("ranks")
            .and_then(|v| v.as_u64())
            .filter(|&r| r >= 2)
            .ok_or_else(|| {
                err(
                    &path("ranks"),
                    field("ranks"),
                    "a group of at least 2 ranks",
                    c.get("ranks").map_or("nothing".into(), |v| v.to_string()),
                )
            })?;
        let bytes = c.get("bytes").and_then(|v| v.as_u64()).ok_or_else(|| {
            err(
                &path("bytes"),
                field("bytes"),
                "a payload size in bytes",
                c.get("bytes").map_or("nothing".into(), |v| v.to_string()),
            )
        })?;
        let t = time(c).filter(|&t| plausible_time(t)).ok_or_else(|| {
            err(
                &[PathSeg::Key("collectives"), PathSeg::Index(i)],
                format!("collectives[{i}]"),
                "exactly one time_s, time_ms or time_us, from 0 to one hour",
                c.to_string(),
            )
        })?;
        profile.insert_collective(
            CollectiveSignature {
                collective,
                ranks,
                internode,
            },
            bytes,
            t,
        );
    }
    Ok(profile)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sig(n: u64) -> OpSignature {
        OpSignature {
            op: "matmul".into(),
            pass: Pass::Forward,
            dtype: DType::Bf16,
            inputs: vec![vec![n, 64], vec![64, 32]],
            outputs: vec![vec![n, 32]],
        }
    }

    fn coll() -> CollectiveSignature {
        CollectiveSignature {
            collective: CollectiveName::AllReduce,
            ranks: 8,
            internode: false,
        }
    }

    #[test]
    fn canonical_file_round_trips() {
        let mut p = Profile::new("h100-sxm");
        p.insert_op(sig(128), 12.5);
        p.insert_op(sig(64), 7.0);
        p.insert_collective(coll(), 1 << 20, 20.0);
        p.insert_collective(coll(), 1 << 24, 110.3);
        let text = p.to_canonical_json();
        let back = parse_profile(&text).expect("parses");
        assert!(p.diff(&back).is_empty(), "{:?}", p.diff(&back));
        assert_eq!(
            back.to_canonical_json(),
            text,
            "canonical form is a fixed point"
        );
        assert_eq!(back.len(), 4);
    }

    #[test]
    fn collectives_interpolate_between_measurements() {
        let mut p = Profile::new("x");
        p.insert_collective(coll(), 1000, 10.0);
        p.insert_collective(coll(), 3000, 30.0);
        p.insert_collective(coll(), 5000, 40.0);
        let at = |b: f64| p.collective_time(&coll(), b).expect("measured").0;
        assert!((at(2000.0) - 20e-6).abs() < 1e-15);
        assert!((at(3000.0) - 30e-6).abs() < 1e-15);
        assert!((at(4000.0) - 35e-6).abs() < 1e-15);
        // Beyond the measurements: the nearest segment's slope.
        assert!((at(7000.0) - 50e-6).abs() < 1e-15);
        assert!((at(500.0) - 5e-6).abs() < 1e-15);
        let (_, reads) = p.collective_time(&coll(), 2500.0).expect("measured");
        assert_eq!(reads.len(), 2, "the two bracketing measurements are read");
        let other = CollectiveSignature { ranks: 4, ..coll() };
        assert!(p.collective_time(&other, 1.0).is_none());
    }

    #[test]
    fn diff_lists_changed_added_and_removed_entries() {
        let mut a = Profile::new("x");
        a.insert_op(sig(1), 1.0);
        a.insert_op(sig(2), 2.0);
        let mut b = a.clone();
        b.insert_op(sig(2), 3.0);
        b.insert_op(sig(3), 1.0);
        b.ops.remove(&sig(1));
        let d = a.diff(&b);
        assert_eq!(d.changed, vec![(EntryId::Op(sig(2)), 2.0, 3.0)]);
        assert_eq!(d.added, vec![(EntryId::Op(sig(3)), 1.0)]);
        assert_eq!(d.removed, vec![(EntryId::Op(sig(1)), 1.0)]);
    }

    #[test]
    fn bad_entries_are_located() {
        let text = r#"{
  "format": "autopar-profile/1",
  "device": "h100-sxm",
  "ops": [
    {"op": "matmul", "pass": "forward", "dtype": "bf16", "inputs": [[2, 2]], "outputs": [[2, 2]], "time_us": -1}
  ]
}"#;
        let e = parse_profile(text).expect_err("negative time");
        assert_eq!(e.field, "ops[0].time_us");
        assert_eq!(e.found, "-1");
        assert!(e.offset.is_some());
        // Finite, but no kernel takes 10^302 seconds.
        let e = parse_profile(&text.replace("-1}", "1e308}")).expect_err("absurd time");
        assert_eq!(e.field, "ops[0].time_us");
        assert!(e.expected.contains("one hour"), "{}", e.expected);
        assert!(import_profile(&text.replace("-1}", "1e308}"), None).is_err());
        let e = parse_profile(&text.replace("\"matmul\"", "\"matmull\"")).expect_err("op");
        assert_eq!(e.field, "ops[0].op");
        let e = parse_profile(&text.replace("autopar-profile/1", "v2")).expect_err("format");
        assert_eq!(e.field, "format");
    }

    #[test]
    fn import_accepts_other_units_and_shape_strings() {
        let text = r#"{"device": "a100-80g",
            "ops": [{"op": "matmul", "pass": "fwd", "dtype": "bf16", "inputs": ["2048x64", [64, 32]], "outputs": ["2048x32"], "time_ms": 0.5}],
            "collectives": [{"collective": "all-reduce", "ranks": 8, "link": "intranode", "bytes": 1024, "time_s": 1e-5}]}"#;
        let p = import_profile(text, None).expect("imports");
        let s = OpSignature {
            op: "matmul".into(),
            pass: Pass::Forward,
            dtype: DType::Bf16,
            inputs: vec![vec![2048, 64], vec![64, 32]],
            outputs: vec![vec![2048, 32]],
        };
        assert_eq!(p.op_time(&s).map(|r| r.1.time_us), Some(500.0));
        let (t, reads) = p.collective_time(&coll(), 1024.0).expect("measured");
        assert!((t - 1e-5).abs() < 1e-18);
        assert_eq!(reads[0].time_us, 10.0);
        let e = import_profile(
            &text.replace("\"time_ms\": 0.5", "\"time_ms\": 0.5, \"time_us\": 1"),
            None,
        )
        .expect_err("two times");
        assert_eq!(e.field, "ops[0]");
    }

    proptest! {
        #[test]
        fn mutated_profiles_never_panic(pos in 0usize..400, ch in proptest::char::any()) {
            let mut p = Profile::new("h100-sxm");
            p.insert_op(sig(128), 12.5);
            p.insert_collective(coll(), 1 << 20, 20.0);
            let mut s: Vec<char> = p.to_canonical_json().chars().collect();
            let i = pos % s.len();
            s[i] = ch;
            let text: String = s.into_iter().collect();
            let _ = parse_profile(&text);
            let _ = import_profile(&text, None);
        }

        #[test]
        fn renumbered_profiles_never_panic(which in 0usize..64, number in prop_oneof![
            "[0-9]{1,25}", "-[0-9]{1,5}", "[0-9]\\.[0-9]{1,5}e[0-9]{1,3}", Just("1e400".to_string())
        ]) {
            let mut p = Profile::new("h100-sxm");
            p.insert_op(sig(128), 12.5);
            p.insert_collective(coll(), 1 << 20, 20.0);
            let text = p.to_canonical_json();
            let starts: Vec<usize> = text
                .char_indices()
                .filter(|&(i, c)| c.is_ascii_digit() && !text[..i].ends_with(|q: char| q.is_ascii_digit() || q == '.'))
                .map(|(i, _)| i)
                .collect();
            let at = starts[which % starts.len()];
            let end = at + text[at..].find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(0);
            let edited = format!("{}{number}{}", &text[..at], &text[end..]);
            if let Ok(parsed) = parse_profile(&edited) {
                // Whatever is accepted is a plausible measurement.
                for (_, t) in parsed.entries() {
                    prop_assert!(t.is_finite() && (0.0..=crate::limits::MAX_MEASURED_US).contains(&t), "{t}");
                }
            }
            let _ = import_profile(&edited, None);
        }
    }
}
