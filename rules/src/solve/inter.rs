//! Inter-operator stage construction: Alpa's dynamic program (ALGORITHMS.md §2).
//!
//! Layers `0..L` are cut into contiguous stages `[k, i]` (inclusive); each stage runs on a
//! submesh (a shape `n x m` of devices) with one of `C` logical-mesh configurations, at the cost
//! `T[k, i, s, c]` per micro-batch. The submeshes must use all `D` devices, and a stage with `s`
//! stages from it to the end (itself included) keeps `s` micro-batches in flight under 1F1B,
//! which it must fit in memory: `s - 1 <= max_n_succ_stages[k, i, s, c]`. The pipeline costs
//! `sum of stage costs + (B - 1) * max stage cost`.
//!
//! For a bound `t_max` on stage costs the DP is
//!
//! ```text
//! F(0, L, 0) = 0, every other F = +inf
//! F(s, k, d) = min over i in [k, L-1], submesh σ with |σ| <= d, config c of
//!              T[k, i, σ, c] + F(s - 1, i + 1, d - |σ|)
//!              subject to T[k, i, σ, c] <= t_max and s - 1 <= max_n_succ_stages[k, i, σ, c]
//! ```
//!
//! and the answer is the best `F(s, 0, D) + (B - 1) * (largest chosen stage cost)` over `s` and
//! over `t_max` among the sorted distinct stage costs, searched without evaluating the bounds
//! that cannot win (see [`crate::solve::bottleneck`]). The implementation is exact and fast: each `F(s, k, ·)` row
//! is computed only over the device counts a solution can have there (at least what the layers
//! after `k` need, at most what the layers before `k` leave), as one vectorised min-plus update
//! per (end, submesh), over only the submeshes whose cheapest configuration admitting `s`
//! stages fits the bound (listed once per stage count and group, not looked up per range);
//! the argmins are re-derived along the optimal path only. Ranges holding
//! the same sequence of layers share one set of configurations per submesh ([`RangeGroups`]),
//! so a model of identical blocks is priced over O(L) groups, not O(L^2) ranges.

use crate::limits::MAX_DP_ENTRIES;
use crate::solve::bottleneck;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// An instance in Alpa's layout (`compute_cost[L][L][S][C]`, `max_n_succ_stages[L][L][S][C]`).
#[derive(Clone, Debug, PartialEq)]
pub struct StageProblem {
    /// Layers `L`.
    pub layers: usize,
    /// Submesh shapes `(hosts, devices per host)`.
    pub submeshes: Vec<(u64, u64)>,
    /// Logical-mesh configurations per submesh `C`.
    pub configs: usize,
    /// `cost[((k * L + i) * S + s) * C + c]`: seconds per micro-batch; `+inf` when infeasible.
    pub cost: Vec<f64>,
    /// Same layout: the most stages that may follow the stage; negative when infeasible.
    pub max_succ: Vec<i64>,
    /// Devices the stages must use in total.
    pub devices: u64,
    /// Micro-batches `B`.
    pub microbatches: u64,
}

/// A stage of the solution.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct StageChoice {
    /// First layer.
    pub start: usize,
    /// Last layer (inclusive).
    pub end: usize,
    /// Index into the submesh choices.
    pub submesh: usize,
    /// Index of the logical-mesh configuration.
    pub config: usize,
    /// Its cost per micro-batch, s.
    pub cost: f64,
}

/// The optimal pipeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StagePlan {
    /// `sum of stage costs + (B - 1) * max stage cost`.
    pub cost: f64,
    /// Stages in order.
    pub stages: Vec<StageChoice>,
    /// `t_max` values the DP was run for.
    pub bounds_evaluated: usize,
}

/// Options of the search.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StageOptions {
    /// Skip a `t_max` candidate within this much of the last one evaluated (Alpa's
    /// `max_stage_cost` gap). Zero keeps the search exact.
    pub bound_gap: f64,
}

impl Default for StageOptions {
    fn default() -> Self {
        StageOptions { bound_gap: 0.0 }
    }
}

/// Why an instance has no solution.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InterError {
    /// The tables do not have the shape the sizes say.
    #[error("{0}")]
    Shape(String),
    /// The DP's table for this many layers and devices would not fit in memory.
    #[error(
        "the stage DP for {layers} layers on {devices} devices needs {entries} table entries, \
         more than the {limit} it allows: is the device count a typo?"
    )]
    TooLarge {
        /// Layers.
        layers: usize,
        /// Devices.
        devices: u64,
        /// Entries the table would need (saturated).
        entries: u64,
        /// Most entries allowed.
        limit: u64,
    },
    /// No set of stages uses all devices within the memory limits.
    #[error(
        "no pipeline covers the {layers} layers with submeshes using exactly {devices} devices \
         within the memory limits"
    )]
    Infeasible {
        /// Layers.
        layers: usize,
        /// Devices.
        devices: u64,
    },
}

impl StageProblem {
    fn idx(&self, k: usize, i: usize, s: usize, c: usize) -> usize {
        ((k * self.layers + i) * self.submeshes.len() + s) * self.configs + c
    }

    /// Checks the tables' sizes and normalises infeasible entries (NaN, negative costs) to
    /// `+inf`; [`StageProblem::choices`] checks the rest (submesh shapes, devices,
    /// micro-batches, the DP's size).
    pub fn validate(mut self) -> Result<Self, InterError> {
        let want = self.layers * self.layers * self.submeshes.len() * self.configs;
        if self.layers == 0 || self.submeshes.is_empty() || self.configs == 0 {
            return Err(InterError::Shape(
                "layers, submesh choices and configurations must be non-empty".into(),
            ));
        }
        if self.cost.len() != want || self.max_succ.len() != want {
            return Err(InterError::Shape(format!(
                "compute_cost and max_n_succ_stages must hold {} x {} x {} x {} = {want} entries, \
                 found {} and {}",
                self.layers,
                self.layers,
                self.submeshes.len(),
                self.configs,
                self.cost.len(),
                self.max_succ.len()
            )));
        }
        for k in 0..self.layers {
            for i in 0..self.layers {
                for s in 0..self.submeshes.len() {
                    for c in 0..self.configs {
                        let x = self.idx(k, i, s, c);
                        let bad = i < k
                            || !self.cost[x].is_finite()
                            || self.cost[x] < 0.0
                            || self.max_succ[x] < 0;
                        if bad {
                            self.cost[x] = f64::INFINITY;
                            self.max_succ[x] = -1;
                        }
                    }
                }
            }
        }
        Ok(self)
    }

    /// The instance as the DP reads it, its dominated configurations left out (see
    /// [`StageChoices`]); every range is a group of its own.
    pub fn choices(&self) -> Result<StageChoices, InterError> {
        self.choices_grouped(&RangeGroups::new(self.layers, |k, i| k * self.layers + i))
    }

    /// [`StageProblem::choices`] with the ranges grouped by `groups` (for the same layers),
    /// each group's configurations read at its first range: exact when every range of a
    /// group has the same tables' entries.
    pub fn choices_grouped(&self, groups: &RangeGroups) -> Result<StageChoices, InterError> {
        let per_submesh: Vec<SubmeshChoices> = (0..self.submeshes.len())
            .map(|s| {
                SubmeshChoices::new(groups, |g, out| {
                    let (k, i) = groups.range(g);
                    out.extend((0..self.configs).map(|c| {
                        let x = self.idx(k, i, s, c);
                        (self.cost[x], self.max_succ[x], c as u32)
                    }))
                })
            })
            .collect();
        StageChoices::new(
            groups,
            &self.submeshes,
            &per_submesh,
            self.devices,
            self.microbatches,
        )
    }

    /// Devices of submesh `s`.
    pub fn size(&self, s: usize) -> u64 {
        self.submeshes[s].0.saturating_mul(self.submeshes[s].1)
    }
}

/// Which ranges `[k, i]` (`i >= k`) have the same configurations on every submesh, so that
/// the DP reads one set of them per group: ranges holding the same sequence of layers cost
/// the same wherever they start, and a model of identical blocks has O(L) such sequences,
/// not O(L^2).
#[derive(Clone, Debug, PartialEq)]
pub struct RangeGroups {
    layers: usize,
    /// Per range `k * L + i`, its group; [`NO_GROUP`] when `i < k`.
    of: Vec<u32>,
    /// Per group, its first range `(k, i)` in row-major order.
    first: Vec<(usize, usize)>,
}

/// The group of a range that ends before it starts.
const NO_GROUP: u32 = u32::MAX;

impl RangeGroups {
    /// The ranges of `layers` layers grouped by `key(k, i)` (below `layers^2`): ranges with
    /// equal keys share a group. Groups are numbered by their first range in row-major order.
    pub fn new(layers: usize, mut key: impl FnMut(usize, usize) -> usize) -> Self {
        let mut group_of_key = vec![NO_GROUP; layers * layers];
        let mut of = vec![NO_GROUP; layers * layers];
        let mut first = Vec::new();
        for k in 0..layers {
            for i in k..layers {
                let slot = &mut group_of_key[key(k, i)];
                if *slot == NO_GROUP {
                    *slot = first.len() as u32;
                    first.push((k, i));
                }
                of[k * layers + i] = *slot;
            }
        }
        RangeGroups { layers, of, first }
    }

    /// The ranges of a model whose layer `l` is of class `classes[l]`, grouped by the sequence
    /// of classes they hold. The sequences are numbered as nodes of a trie (a sequence is its
    /// parent's node and its last class), in O(L^2) steps rather than by hashing every
    /// range's sequence whole.
    pub fn by_sequence(classes: &[usize]) -> Self {
        let layers = classes.len();
        // Keyed by the parent's node (+1; 0 for none) and the last class.
        let mut node: HashMap<(usize, usize), usize> = HashMap::new();
        let mut at = vec![0; layers * layers];
        for k in 0..layers {
            let mut parent = 0;
            for i in k..layers {
                let next = node.len();
                let n = *node.entry((parent, classes[i])).or_insert(next);
                at[k * layers + i] = n;
                parent = n + 1;
            }
        }
        Self::new(layers, |k, i| at[k * layers + i])
    }

    /// Layers `L`.
    pub fn layers(&self) -> usize {
        self.layers
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    /// Whether there are no groups (no layers).
    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// Range `[k, i]`'s group, `None` when `i < k`.
    pub fn of(&self, k: usize, i: usize) -> Option<usize> {
        let g = self.of[k * self.layers + i];
        (g != NO_GROUP).then_some(g as usize)
    }

    /// Group `g`'s first range `(k, i)`, in row-major order.
    pub fn range(&self, g: usize) -> (usize, usize) {
        self.first[g]
    }
}

/// A configuration of a range on a submesh as the DP reads it: `(cost per micro-batch, most
/// stages that may follow, configuration index)`. (16 bytes: the most following stages never
/// exceed the layers, so `i32` holds them after clamping.)
pub type Choice = (f64, i32, u32);

/// One submesh's usable configurations of every group of ranges ([`RangeGroups`]): by cost,
/// then configuration, each kept only if it allows more following stages than every cheaper
/// one. The first whose `max_succ` admits a stage count is then the cheapest configuration
/// for it, and every configuration left out is dominated (no cheaper, no more stages after
/// it), so the DP over these is the DP over all of them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SubmeshChoices {
    choices: Vec<Choice>,
    /// One offset into `choices` per group, and one past the last.
    offsets: Vec<usize>,
}

impl SubmeshChoices {
    /// The usable configurations of every group of `groups`: `candidates(g, out)` appends
    /// group `g`'s `(cost, max_succ, config)`. Infinite, NaN or negative costs and negative
    /// `max_succ` are not usable.
    pub fn new(
        groups: &RangeGroups,
        mut candidates: impl FnMut(usize, &mut Vec<(f64, i64, u32)>),
    ) -> Self {
        let mut choices = Vec::new();
        let mut offsets = Vec::with_capacity(groups.len() + 1);
        offsets.push(0);
        let mut found = Vec::new();
        let mut usable: Vec<Choice> = Vec::new();
        for g in 0..groups.len() {
            found.clear();
            candidates(g, &mut found);
            usable.clear();
            usable.extend(found.iter().filter_map(|&(cost, succ, c)| {
                (cost.is_finite() && cost >= 0.0 && succ >= 0).then_some((
                    cost,
                    succ.min(i64::from(i32::MAX)) as i32,
                    c,
                ))
            }));
            usable.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.2.cmp(&b.2)));
            let mut most = -1;
            for &choice in &usable {
                if choice.1 > most {
                    most = choice.1;
                    choices.push(choice);
                }
            }
            offsets.push(choices.len());
        }
        SubmeshChoices { choices, offsets }
    }

    /// Group `g`'s usable configurations.
    fn group(&self, g: usize) -> &[Choice] {
        &self.choices[self.offsets[g]..self.offsets[g + 1]]
    }
}

/// A stage-construction instance as the DP reads it: what [`StageProblem`] holds with every
/// dominated configuration left out ([`SubmeshChoices`]) and ranges of the same layers read
/// once ([`RangeGroups`]), so that an instance of many submeshes and logical meshes is never
/// held whole (the dense tables of GPT-3 175B on 128 nodes are half a gigabyte per
/// micro-batch size, half of it ranges that end before they start).
#[derive(Clone, Debug, PartialEq)]
pub struct StageChoices {
    /// The ranges' groups.
    groups: RangeGroups,
    /// Devices of each submesh.
    sizes: Vec<u64>,
    /// Per `(group, submesh)` (row-major), the group's usable configurations: slices of
    /// `choices` between `offsets`.
    choices: Vec<Choice>,
    offsets: Vec<usize>,
    /// Devices the stages must use in total.
    devices: u64,
    /// Micro-batches `B`.
    microbatches: u64,
}

impl StageChoices {
    /// The instance of the ranges `groups` whose submesh `s` has shape `submeshes[s]` and
    /// usable configurations `per_submesh[s]` ([`SubmeshChoices::new`] with the same groups).
    pub fn new(
        groups: &RangeGroups,
        submeshes: &[(u64, u64)],
        per_submesh: &[SubmeshChoices],
        devices: u64,
        microbatches: u64,
    ) -> Result<Self, InterError> {
        let layers = groups.layers();
        if layers == 0 || submeshes.is_empty() {
            return Err(InterError::Shape(
                "layers and submesh choices must be non-empty".into(),
            ));
        }
        if per_submesh.len() != submeshes.len()
            || per_submesh
                .iter()
                .any(|c| c.offsets.len() != groups.len() + 1)
        {
            return Err(InterError::Shape(format!(
                "the configurations of {} submeshes over {} groups of ranges of {layers} layers \
                 were expected, found {} submeshes' over {:?} groups",
                submeshes.len(),
                groups.len(),
                per_submesh.len(),
                per_submesh
                    .iter()
                    .map(|c| c.offsets.len().saturating_sub(1))
                    .collect::<Vec<_>>()
            )));
        }
        if submeshes.iter().any(|&(n, m)| n == 0 || m == 0) || devices == 0 {
            return Err(InterError::Shape(
                "submesh shapes and the device count must be positive".into(),
            ));
        }
        let sizes: Vec<u64> = submeshes
            .iter()
            .map(|&(n, m)| n.saturating_mul(m))
            .collect();
        let entries = dp_entries(layers, &sizes, devices);
        if entries > MAX_DP_ENTRIES {
            return Err(InterError::TooLarge {
                layers,
                devices,
                entries,
                limit: MAX_DP_ENTRIES,
            });
        }
        if microbatches == 0 {
            return Err(InterError::Shape(
                "num_microbatches must be positive".into(),
            ));
        }
        let total = per_submesh.iter().map(|c| c.choices.len()).sum();
        let mut choices = Vec::with_capacity(total);
        let mut offsets = Vec::with_capacity(groups.len() * sizes.len() + 1);
        offsets.push(0);
        for g in 0..groups.len() {
            for c in per_submesh {
                choices.extend_from_slice(c.group(g));
                offsets.push(choices.len());
            }
        }
        Ok(StageChoices {
            groups: groups.clone(),
            sizes,
            choices,
            offsets,
            devices,
            microbatches,
        })
    }
}

/// Most stages a solution can have: every stage holds a layer and a smallest submesh.
fn max_stages(layers: usize, sizes: &[u64], devices: u64) -> u64 {
    let smallest = sizes.iter().copied().min().unwrap_or(1).max(1);
    (layers as u64).min(devices / smallest)
}

/// Entries of the DP table, `(stages + 1) x (layers + 1) x (devices + 1)`, saturated.
fn dp_entries(layers: usize, sizes: &[u64], devices: u64) -> u64 {
    (max_stages(layers, sizes, devices) + 1)
        .saturating_mul(layers as u64 + 1)
        .saturating_mul(devices.saturating_add(1))
}

/// An empty range of device counts.
const NOTHING: (usize, usize) = (1, 0);

thread_local! {
    /// The DP table this thread last used (the largest it needed), kept for its next DP
    /// ([`table`]).
    static TABLE: std::cell::Cell<Vec<f64>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A DP table of at least `entries` entries, never cleared: `run` reads only what it wrote
/// for the bound (`written`). A new one is allocated zeroed, so the pages no stage reaches are
/// never touched (the table is ~100 MB for a 1,024-device cluster); one this thread used
/// before is taken back as it is, its pages already mapped: a build runs a DP per micro-batch
/// size, and mapping the table's pages again was a tenth of a rebuild's CPU time.
fn table(entries: usize) -> Vec<f64> {
    let mut f = TABLE.take();
    if f.len() < entries {
        drop(f);
        f = vec![0.0; entries];
    }
    // What a DP before left must never be read: in tests, it reads as NaN, which no
    // comparison of `run` lets through to a finite optimum.
    #[cfg(test)]
    f.fill(f64::NAN);
    f
}

/// Reusable buffers and per-instance tables of the DP.
struct Dp {
    l: usize,
    d: usize,
    sizes: Vec<usize>,
    /// `F[(s * (L + 1) + k) * (D + 1) + d]`, valid inside `written` of its row only.
    f: Vec<f64>,
    /// Per row `(s, k)` (`s * (L + 1) + k`), the device counts `F` holds for the current
    /// bound, `lo > hi` when none: inside `band[k]`, only where some stage reaches, so
    /// neither the rest of the band nor rows nothing reaches are ever written. Outside it, `F`
    /// is `+inf`.
    written: Vec<(usize, usize)>,
    /// Per `k`: the device counts a suffix starting at `k` can have, for the current bound.
    band: Vec<(usize, usize)>,
    /// Most stages any solution can have.
    s_max: usize,
    /// Per range `k * L + i`, its group ([`RangeGroups`]).
    group: Vec<u32>,
    /// Per `(group, submesh)` (row-major), the group's usable configurations (see
    /// [`SubmeshChoices`]): slices of `choices` between `offsets`.
    choices: Vec<Choice>,
    offsets: Vec<usize>,
    /// For the stage count and bound `run` is filling, per group `g` of more than one range:
    /// the submeshes with a usable configuration that admits that many stages from it to the
    /// end, with the cheapest one's cost (`usable_len[g]` of them from `usable[g * S]`),
    /// listed when a row first reads the group at that stage count (`listed_for[g]`, 0 when
    /// not yet).
    usable: Vec<(usize, f64)>,
    usable_len: Vec<usize>,
    listed_for: Vec<usize>,
    /// Per group, whether it holds more than one range.
    shared: Vec<bool>,
}

impl Drop for Dp {
    /// Gives the table back to this thread's next DP.
    fn drop(&mut self) {
        TABLE.set(std::mem::take(&mut self.f));
    }
}

impl Dp {
    fn new(p: StageChoices) -> Self {
        let l = p.groups.layers();
        let d = p.devices as usize;
        let groups = p.groups.len();
        let mut ranges = vec![0u32; groups];
        for &g in p.groups.of.iter().filter(|&&g| g != NO_GROUP) {
            ranges[g as usize] += 1;
        }
        let shared = ranges.iter().map(|&n| n > 1).collect();
        // Bounded by `StageChoices::new`'s table-size check.
        let s_max = max_stages(l, &p.sizes, p.devices) as usize;
        Dp {
            l,
            d,
            sizes: p.sizes.iter().map(|&n| n as usize).collect(),
            f: table((s_max + 1) * (l + 1) * (d + 1)),
            written: vec![NOTHING; (s_max + 1) * (l + 1)],
            band: vec![(1, 0); l + 1],
            s_max,
            group: p.groups.of,
            // Zeroed, so the entries of groups of one range are never touched.
            usable: vec![(0, 0.0); p.offsets.len() - 1],
            usable_len: vec![0; groups],
            listed_for: vec![0; groups],
            shared,
            choices: p.choices,
            offsets: p.offsets,
        }
    }

    /// Lists shared group `g`'s usable submeshes for `s` stages within `t_max` (see
    /// `usable`), once per stage count (`s` only grows between [`Dp::rewind`]s); returns where
    /// the list starts in `usable` and its length.
    fn list(&mut self, g: usize, s: usize, t_max: f64) -> (usize, usize) {
        let first = g * self.sizes.len();
        if self.listed_for[g] != s {
            let mut len = 0;
            for sm in 0..self.sizes.len() {
                if let Some((cost, _)) = self.best(g, sm, s, t_max) {
                    self.usable[first + len] = (sm, cost);
                    len += 1;
                }
            }
            self.listed_for[g] = s;
            self.usable_len[g] = len;
        }
        (first, self.usable_len[g])
    }

    /// Starts the stage counts of [`Dp::list`] again from 1, for a new bound.
    fn rewind(&mut self) {
        self.listed_for.fill(0);
    }

    /// Stage `[k, i]`'s group of ranges, `None` when `i < k`.
    fn group(&self, k: usize, i: usize) -> Option<usize> {
        let g = self.group[k * self.l + i];
        (g != NO_GROUP).then_some(g as usize)
    }

    /// The usable configurations of group `g` on submesh `sm` (see `choices`).
    fn configs(&self, g: usize, sm: usize) -> &[Choice] {
        let r = g * self.sizes.len() + sm;
        &self.choices[self.offsets[r]..self.offsets[r + 1]]
    }

    /// Index of row `(s, k)` among the rows (into `written`).
    fn slot(&self, s: usize, k: usize) -> usize {
        s * (self.l + 1) + k
    }

    /// Index of row `(s, k)`'s first entry in `f`.
    fn row(&self, s: usize, k: usize) -> usize {
        self.slot(s, k) * (self.d + 1)
    }

    /// `F(s, k, d)`: `+inf` outside what its row holds.
    fn at(&self, s: usize, k: usize, d: usize) -> f64 {
        let (lo, hi) = self.written[self.slot(s, k)];
        if (lo..=hi).contains(&d) {
            self.f[self.row(s, k) + d]
        } else {
            f64::INFINITY
        }
    }

    /// Cheapest configuration of a stage of group `g` on submesh `sm` within `t_max` that fits
    /// with `s` stages from it to the end.
    fn best(&self, g: usize, sm: usize, s: usize, t_max: f64) -> Option<(f64, usize)> {
        let &(cost, _, c) = self
            .configs(g, sm)
            .iter()
            .find(|(_, succ, _)| s as i64 - 1 <= i64::from(*succ))?;
        (cost <= t_max).then_some((cost, c as usize))
    }

    /// Computes, for bound `t_max`, the device counts each suffix can have: at least the fewest
    /// devices that cover it, at most what the fewest-device cover of the prefix leaves.
    fn bands(&mut self, t_max: f64) {
        let (l, d) = (self.l, self.d);
        let usable = |k: usize, i: usize, sm: usize| {
            self.group(k, i).is_some_and(|g| {
                self.configs(g, sm)
                    .first()
                    .is_some_and(|&(cost, _, _)| cost <= t_max)
            })
        };
        const NONE: usize = usize::MAX;
        let mut suffix = vec![NONE; l + 1];
        suffix[l] = 0;
        for k in (0..l).rev() {
            for i in k..l {
                if suffix[i + 1] == NONE {
                    continue;
                }
                for sm in 0..self.sizes.len() {
                    if usable(k, i, sm) {
                        suffix[k] = suffix[k].min(suffix[i + 1] + self.sizes[sm]);
                    }
                }
            }
        }
        let mut prefix = vec![NONE; l + 1];
        prefix[0] = 0;
        for i in 0..l {
            for k in 0..=i {
                if prefix[k] == NONE {
                    continue;
                }
                for sm in 0..self.sizes.len() {
                    if usable(k, i, sm) {
                        prefix[i + 1] = prefix[i + 1].min(prefix[k] + self.sizes[sm]);
                    }
                }
            }
        }
        for k in 0..=l {
            self.band[k] = if suffix[k] == NONE || prefix[k] == NONE || prefix[k] > d {
                (1, 0)
            } else {
                (suffix[k], d - prefix[k])
            };
        }
    }

    /// Lowers row `(s, k)` (at `row` in `f`, `here` in `written`; device counts `band`) by the
    /// stage of cost `cost` on `n` devices followed by the row at `src`, which holds the
    /// device counts `held`; whether it reached the row.
    // Inlined into both loops of `run`, whose hot path it is.
    #[inline(always)]
    fn relax(
        &mut self,
        (row, here): (usize, usize),
        (lo, hi): (usize, usize),
        (src, (slo, shi)): (usize, (usize, usize)),
        n: usize,
        cost: f64,
    ) -> bool {
        // d ranges over the band of the row whose source d - n the row after holds.
        let from = lo.max(slo + n);
        let to = hi.min(shi + n);
        if from > to {
            return false;
        }
        // What the row did not hold yet starts at +inf.
        self.written[here] = match self.written[here] {
            (wlo, whi) if wlo <= whi => {
                let (nlo, nhi) = (from.min(wlo), to.max(whi));
                self.f[row + nlo..row + wlo].fill(f64::INFINITY);
                self.f[row + whi + 1..=row + nhi].fill(f64::INFINITY);
                (nlo, nhi)
            }
            _ => {
                self.f[row + from..=row + to].fill(f64::INFINITY);
                (from, to)
            }
        };
        // Rows of s - 1 stages precede rows of s stages (see `row`), so the source lies
        // entirely before the destination row.
        let (before, from_row) = self.f.split_at_mut(row);
        let dst = &mut from_row[from..=to];
        let srcs = &before[src + from - n..=src + to - n];
        // A select, not a branch, so it vectorises to one `min` per lane (no NaN reaches
        // here: costs are finite and `F` holds finite values or +inf).
        for (x, &y) in dst.iter_mut().zip(srcs) {
            let cand = cost + y;
            *x = if cand < *x { cand } else { *x };
        }
        true
    }

    /// Fills `F` for bound `t_max`; returns the best `(sum, stages)` reaching `F(s, 0, D)`.
    fn run(&mut self, t_max: f64) -> Option<(f64, usize)> {
        self.bands(t_max);
        let (l, d) = (self.l, self.d);
        if self.band[0].0 > d || self.band[0].1 < d {
            return None;
        }
        // Row (0, L) holds F(0, L, 0) = 0 alone: no stage left, no device left; any other
        // count of devices left over is infeasible.
        let r0 = self.row(0, l);
        self.f[r0] = 0.0;
        let s0 = self.slot(0, l);
        self.written[s0] = (0, 0);
        let mut best: Option<(f64, usize)> = None;
        self.rewind();
        for s in 1..=self.s_max {
            let mut any = false;
            for k in (0..l).rev() {
                let (lo, hi) = self.band[k];
                let row = self.row(s, k);
                let here = self.slot(s, k);
                self.written[here] = NOTHING;
                if lo > hi || s > l - k {
                    continue;
                }
                // The last stage (s = 1) must end at the last layer.
                let first_end = if s == 1 { l - 1 } else { k };
                for i in first_end..l {
                    if s - 1 > l - i - 1 {
                        break;
                    }
                    let (slo, shi) = self.written[self.slot(s - 1, i + 1)];
                    if slo > shi {
                        continue;
                    }
                    let src = self.row(s - 1, i + 1);
                    let Some(g) = self.group(k, i) else {
                        continue;
                    };
                    // `best(g, sm, s, t_max)` for every submesh that has one: listed once
                    // per stage count for a group of many ranges, looked up for a range of
                    // its own (read once per stage count).
                    let (band, held) = ((lo, hi), (slo, shi));
                    if self.shared[g] {
                        let (first, len) = self.list(g, s, t_max);
                        for u in first..first + len {
                            let (sm, cost) = self.usable[u];
                            any |= self.relax((row, here), band, (src, held), self.sizes[sm], cost);
                        }
                    } else {
                        for sm in 0..self.sizes.len() {
                            if let Some((cost, _)) = self.best(g, sm, s, t_max) {
                                let n = self.sizes[sm];
                                any |= self.relax((row, here), band, (src, held), n, cost);
                            }
                        }
                    }
                }
            }
            let total = self.at(s, 0, d);
            if total.is_finite() && best.is_none_or(|(b, _)| total < b) {
                best = Some((total, s));
            }
            if !any {
                break;
            }
        }
        best
    }

    /// Walks the argmins from `F(s, 0, D)` back to `F(0, L, 0)`.
    fn reconstruct(&self, s_total: usize, t_max: f64) -> Option<Vec<StageChoice>> {
        let mut stages = Vec::with_capacity(s_total);
        let (mut s, mut k, mut d) = (s_total, 0usize, self.d);
        while s > 0 {
            let here = self.at(s, k, d);
            let first_end = if s == 1 { self.l - 1 } else { k };
            let mut found = None;
            'search: for i in first_end..self.l {
                // As in `run`: rows of more stages than layers left are never filled.
                if s - 1 > self.l - i - 1 {
                    break;
                }
                let Some(g) = self.group(k, i) else {
                    continue;
                };
                for sm in 0..self.sizes.len() {
                    let n = self.sizes[sm];
                    if n > d {
                        continue;
                    }
                    if let Some((cost, c)) = self.best(g, sm, s, t_max) {
                        let prev = self.at(s - 1, i + 1, d - n);
                        if cost + prev == here {
                            found = Some((i, sm, c, cost, n));
                            break 'search;
                        }
                    }
                }
            }
            let (i, sm, c, cost, n) = found?;
            stages.push(StageChoice {
                start: k,
                end: i,
                submesh: sm,
                config: c,
                cost,
            });
            s -= 1;
            k = i + 1;
            d -= n;
        }
        // The walk ends exactly at F(0, L, 0).
        (k == self.l && d == 0).then_some(stages)
    }
}

/// Solves a stage-construction instance exactly: the DP for each `t_max` bound, searched with
/// [`crate::solve::bottleneck::minimize`] (which evaluates only the bounds that can still win).
pub fn solve(problem: StageProblem, options: StageOptions) -> Result<StagePlan, InterError> {
    let choices = problem.validate()?.choices()?;
    solve_choices(choices, options)
}

/// [`solve`] on an instance given as its usable configurations.
pub fn solve_choices(
    problem: StageChoices,
    options: StageOptions,
) -> Result<StagePlan, InterError> {
    let infeasible = InterError::Infeasible {
        layers: problem.groups.layers(),
        devices: problem.devices,
    };
    let weight = problem.microbatches as f64 - 1.0;
    let mut dp = Dp::new(problem);
    // Only the configurations the DP keeps can be a solution's largest stage.
    let bounds = bottleneck::candidates(dp.choices.iter().map(|c| c.0));
    let best = bottleneck::minimize(&bounds, weight, options.bound_gap, |t| {
        let (sum, s) = dp.run(t)?;
        let stages = dp.reconstruct(s, t)?;
        let max = stages.iter().map(|st| st.cost).fold(0.0, f64::max);
        Some(bottleneck::Bounded {
            sum,
            max,
            solution: stages,
        })
    })
    .ok_or(infeasible)?;
    Ok(StagePlan {
        cost: best.total,
        stages: best.solution,
        bounds_evaluated: best.evaluated,
    })
}

/// Submesh shapes of an `N x M` cluster (ALGORITHMS.md §2): `(1, 1), (1, 2), (1, 4), ...` up to
/// `(1, M)`, then `(n, M)` for `n = 2..N` (all `n`, or only powers of two).
pub fn submesh_choices(hosts: u64, per_host: u64, powers_of_two_only: bool) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut w = 1;
    while w < per_host {
        out.push((1, w));
        w *= 2;
    }
    out.push((1, per_host));
    for n in 2..=hosts {
        if !powers_of_two_only || n.is_power_of_two() {
            out.push((n, per_host));
        }
    }
    out
}

/// Places the chosen submeshes on an `N x M` cluster, largest first: whole-host shapes take
/// consecutive hosts, smaller ones fill hosts first-fit. Returns `(first device, devices)` per
/// stage, or `None` if they do not tile the cluster.
pub fn place(stages: &[(u64, u64)], hosts: u64, per_host: u64) -> Option<Vec<(u64, u64)>> {
    let mut order: Vec<usize> = (0..stages.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(stages[i].0 * stages[i].1));
    let mut free_in_host = vec![per_host; hosts as usize];
    let mut placement = vec![(0, 0); stages.len()];
    for i in order {
        let (n, m) = stages[i];
        if n > 1 || m == per_host {
            // Whole hosts: the first run of n completely free hosts.
            let run = (0..hosts as usize)
                .find(|&h| (h..h + n as usize).all(|x| free_in_host.get(x) == Some(&per_host)))?;
            free_in_host[run..run + n as usize].fill(0);
            placement[i] = (run as u64 * per_host, n * m);
        } else {
            let h = free_in_host.iter().position(|&f| f >= m)?;
            let first = h as u64 * per_host + (per_host - free_in_host[h]);
            free_in_host[h] -= m;
            placement[i] = (first, m);
        }
    }
    free_in_host.iter().all(|&f| f == 0).then_some(placement)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Exhaustive search: every contiguous partition, every submesh and config per stage.
    fn brute_force(p: &StageProblem) -> Option<f64> {
        let l = p.layers;
        let b = p.microbatches as f64;
        let mut best: Option<f64> = None;
        // Bit i of `cuts` set: a stage ends after layer i.
        for cuts in 0u32..(1 << (l - 1)) {
            let mut ranges = Vec::new();
            let mut start = 0;
            for i in 0..l {
                if i == l - 1 || cuts & (1 << i) != 0 {
                    ranges.push((start, i));
                    start = i + 1;
                }
            }
            let n = ranges.len();
            let choices = p.submeshes.len() * p.configs;
            let combos = (choices as u64).pow(n as u32);
            for mut code in 0..combos {
                let (mut sum, mut max, mut devices, mut ok) = (0.0, 0.0f64, 0u64, true);
                for (q, &(k, i)) in ranges.iter().enumerate() {
                    let pick = (code % choices as u64) as usize;
                    code /= choices as u64;
                    let (sm, c) = (pick / p.configs, pick % p.configs);
                    let x = p.idx(k, i, sm, c);
                    let after = (n - q - 1) as i64;
                    if !p.cost[x].is_finite() || after > p.max_succ[x] {
                        ok = false;
                        break;
                    }
                    sum += p.cost[x];
                    max = max.max(p.cost[x]);
                    devices += p.size(sm);
                }
                if ok && devices == p.devices {
                    let total = sum + (b - 1.0) * max;
                    if best.is_none_or(|bt| total < bt) {
                        best = Some(total);
                    }
                }
            }
        }
        best
    }

    fn instance() -> impl Strategy<Value = StageProblem> {
        (1usize..=5, 1usize..=2, 1u64..=3, 1u64..=8)
            .prop_flat_map(|(l, c, hosts, b)| {
                let submeshes = submesh_choices(hosts, 2, false);
                let s = submeshes.len();
                let n = l * l * s * c;
                (
                    Just((l, c, hosts, b, submeshes)),
                    proptest::collection::vec(
                        prop_oneof![1 => Just(-1.0f64), 8 => 0.5f64..10.0],
                        n,
                    ),
                    proptest::collection::vec(-1i64..5, n),
                )
            })
            .prop_map(|((l, c, hosts, b, submeshes), cost, max_succ)| {
                let cost = cost.into_iter().map(|x| (x * 4.0).round() / 4.0).collect();
                StageProblem {
                    layers: l,
                    submeshes,
                    configs: c,
                    cost,
                    max_succ,
                    devices: hosts * 2,
                    microbatches: b,
                }
            })
    }

    #[test]
    fn the_random_instances_exercise_the_dp() {
        use proptest::strategy::ValueTree;
        use proptest::test_runner::TestRunner;
        let mut runner = TestRunner::deterministic();
        let (mut feasible, mut multi_stage, mut mixed_submeshes) = (0, 0, 0);
        for _ in 0..400 {
            let p = instance().new_tree(&mut runner).expect("tree").current();
            if let Ok(plan) = solve(p, StageOptions::default()) {
                feasible += 1;
                multi_stage += (plan.stages.len() > 1) as usize;
                let first = plan.stages[0].submesh;
                mixed_submeshes += plan.stages.iter().any(|s| s.submesh != first) as usize;
            }
        }
        println!("{feasible} feasible, {multi_stage} multi-stage, {mixed_submeshes} mixed");
        assert!(feasible >= 200, "{feasible} feasible of 400");
        assert!(multi_stage >= 100, "{multi_stage} multi-stage");
        assert!(
            mixed_submeshes >= 30,
            "{mixed_submeshes} with mixed submeshes"
        );
    }

    /// `p` made to price every range by the sequence of `classes` it holds (each range takes
    /// the costs of the first range holding the same sequence), and its ranges grouped by
    /// that sequence.
    fn priced_by_sequence(mut p: StageProblem, classes: &[usize]) -> (StageProblem, RangeGroups) {
        let l = p.layers;
        let groups = RangeGroups::by_sequence(classes);
        for k in 0..l {
            for i in k..l {
                let (k0, i0) = groups.range(groups.of(k, i).expect("a range"));
                for s in 0..p.submeshes.len() {
                    for c in 0..p.configs {
                        let (to, from) = (p.idx(k, i, s, c), p.idx(k0, i0, s, c));
                        p.cost[to] = p.cost[from];
                        p.max_succ[to] = p.max_succ[from];
                    }
                }
            }
        }
        (p, groups)
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]

        #[test]
        fn dp_equals_exhaustive_search(p in instance()) {
            let expect = brute_force(&p.clone().validate().expect("valid"));
            let got = solve(p.clone(), StageOptions::default());
            match (expect, got) {
                (None, Err(InterError::Infeasible { .. })) => {}
                (Some(e), Ok(plan)) => {
                    prop_assert!((plan.cost - e).abs() < 1e-9, "dp {} vs exhaustive {e}", plan.cost);
                    // The plan is what it claims: contiguous, covering, exact devices, fits.
                    let mut next = 0;
                    let mut devices = 0;
                    let n = plan.stages.len();
                    for (q, st) in plan.stages.iter().enumerate() {
                        prop_assert_eq!(st.start, next);
                        next = st.end + 1;
                        devices += p.size(st.submesh);
                        let x = p.idx(st.start, st.end, st.submesh, st.config);
                        prop_assert!((n - q - 1) as i64 <= p.max_succ[x]);
                    }
                    prop_assert_eq!(next, p.layers);
                    prop_assert_eq!(devices, p.devices);
                }
                (e, g) => prop_assert!(false, "exhaustive {e:?} vs dp {g:?}"),
            }
        }

        #[test]
        fn grouped_ranges_solve_as_the_dense_instance(
            p in instance(),
            classes in proptest::collection::vec(0usize..2, 5),
        ) {
            let layers = p.layers;
            let (p, groups) = priced_by_sequence(p, &classes[..layers]);
            let p = p.validate().expect("valid");
            let expect = brute_force(&p);
            let grouped = p.choices_grouped(&groups).expect("valid");
            match (expect, solve_choices(grouped, StageOptions::default())) {
                (None, Err(InterError::Infeasible { .. })) => {}
                (Some(e), Ok(plan)) => {
                    prop_assert!((plan.cost - e).abs() < 1e-9, "dp {} vs exhaustive {e}", plan.cost);
                }
                (e, g) => prop_assert!(false, "exhaustive {e:?} vs dp {g:?}"),
            }
        }
    }

    #[test]
    fn the_walk_uses_the_next_start_not_the_current_one() {
        // Two layers, one device each, two stages: the only solution is [0,0] then [1,1]; the
        // widely copied bug (looking up F(s - 1, k, ..)) finds nothing.
        let p = StageProblem {
            layers: 2,
            submeshes: vec![(1, 1)],
            configs: 1,
            cost: vec![1.0, f64::INFINITY, f64::INFINITY, 2.0],
            max_succ: vec![1, -1, -1, 0],
            devices: 2,
            microbatches: 4,
        };
        let plan = solve(p, StageOptions::default()).expect("feasible");
        assert_eq!(plan.cost, 1.0 + 2.0 + 3.0 * 2.0);
        assert_eq!(
            plan.stages
                .iter()
                .map(|s| (s.start, s.end))
                .collect::<Vec<_>>(),
            vec![(0, 0), (1, 1)]
        );
    }

    #[test]
    fn memory_limits_restrict_early_stages() {
        // Stage [0,0] cannot be followed by another stage (max_succ 0): one stage must hold
        // both layers, although splitting would be cheaper.
        let mut cost = vec![f64::INFINITY; 4];
        let mut max_succ = vec![-1; 4];
        let idx = |k: usize, i: usize| k * 2 + i;
        cost[idx(0, 0)] = 1.0;
        max_succ[idx(0, 0)] = 0;
        cost[idx(1, 1)] = 1.0;
        max_succ[idx(1, 1)] = 0;
        cost[idx(0, 1)] = 5.0;
        max_succ[idx(0, 1)] = 0;
        let p = StageProblem {
            layers: 2,
            submeshes: vec![(1, 2)],
            configs: 1,
            cost,
            max_succ,
            devices: 2,
            microbatches: 8,
        };
        let plan = solve(p, StageOptions::default()).expect("feasible");
        assert_eq!(plan.stages.len(), 1);
        assert_eq!(plan.cost, 5.0 + 7.0 * 5.0);
    }

    #[test]
    fn infeasible_when_devices_cannot_be_used_exactly() {
        let p = StageProblem {
            layers: 1,
            submeshes: vec![(1, 2)],
            configs: 1,
            cost: vec![1.0],
            max_succ: vec![0],
            devices: 3,
            microbatches: 1,
        };
        assert!(matches!(
            solve(p, StageOptions::default()),
            Err(InterError::Infeasible { .. })
        ));
    }

    #[test]
    fn only_dominated_configurations_are_left_out() {
        // Range [0, 0] of one layer: configuration 3 (cost 2, up to 1 stage after) is
        // dominated by 1 (cost 1, up to 2 after); 0 has no following stage, 2 is unusable,
        // 4 is the only one allowing 5 following stages.
        let found = SubmeshChoices::new(&RangeGroups::new(1, |_, _| 0), |_, out| {
            out.extend([
                (0.5, 0, 0),
                (1.0, 2, 1),
                (f64::NAN, 9, 2),
                (2.0, 1, 3),
                (3.0, 5, 4),
                (-1.0, 9, 5),
            ])
        });
        assert_eq!(found.group(0), [(0.5, 0, 0), (1.0, 2, 1), (3.0, 5, 4)]);
        // Each group is asked for once; ranges ending before they start are in none.
        let groups = RangeGroups::new(2, |k, i| k * 2 + i);
        let asked = std::cell::RefCell::new(Vec::new());
        let _ = SubmeshChoices::new(&groups, |g, _| asked.borrow_mut().push(groups.range(g)));
        assert_eq!(asked.into_inner(), [(0, 0), (0, 1), (1, 1)]);
        assert_eq!(groups.of(1, 0), None);
    }

    #[test]
    fn ranges_holding_one_sequence_share_a_group() {
        // Layers of classes [a, b, b, b, c], grouped by the sequence they hold.
        let classes = [0, 1, 1, 1, 4];
        let groups = RangeGroups::by_sequence(&classes);
        // a b^j (j = 0..3), a b^3 c, b^j (j = 1..3), b^j c (j = 1..3), c.
        assert_eq!(groups.len(), 12);
        assert_eq!(groups.of(1, 2), groups.of(2, 3));
        assert_eq!(groups.of(2, 2), groups.of(3, 3));
        assert_ne!(groups.of(1, 4), groups.of(2, 4));
        assert_eq!(groups.range(groups.of(3, 4).expect("a range")), (3, 4));
        for g in 0..groups.len() {
            let (k, i) = groups.range(g);
            assert_eq!(groups.of(k, i), Some(g));
        }
    }

    #[test]
    fn stage_choices_must_match_their_submeshes() {
        let two = RangeGroups::new(2, |k, i| k * 2 + i);
        let one = SubmeshChoices::new(&two, |_, out| out.push((1.0, 1, 0)));
        assert!(StageChoices::new(&two, &[(1, 1)], std::slice::from_ref(&one), 2, 1).is_ok());
        let three = RangeGroups::new(3, |k, i| k * 3 + i);
        for bad in [
            StageChoices::new(&two, &[(1, 1), (1, 2)], std::slice::from_ref(&one), 2, 1),
            StageChoices::new(&three, &[(1, 1)], std::slice::from_ref(&one), 2, 1),
            StageChoices::new(&two, &[(1, 1)], std::slice::from_ref(&one), 2, 0),
            StageChoices::new(&two, &[(0, 1)], std::slice::from_ref(&one), 2, 1),
        ] {
            assert!(matches!(bad, Err(InterError::Shape(_))), "{bad:?}");
        }
    }

    #[test]
    fn submeshes_tile_the_cluster() {
        let shapes = submesh_choices(4, 8, false);
        assert_eq!(shapes[..4], [(1, 1), (1, 2), (1, 4), (1, 8)]);
        assert_eq!(shapes.len(), 4 + 3);
        assert_eq!(submesh_choices(8, 8, true).len(), 4 + 3);
        let placed = place(&[(1, 2), (2, 8), (1, 4), (1, 2), (1, 8)], 4, 8).expect("tiles");
        assert_eq!(placed[1], (0, 16));
        assert_eq!(placed[4], (16, 8));
        assert!(place(&[(1, 4), (1, 4), (1, 4)], 2, 6).is_none());
    }
}
