//! Where the pieces of a tensor live on a stage's logical mesh, and the collectives that move a
//! tensor from one placement to another.
//!
//! Along each mesh axis a tensor is replicated, split along one of its axes, or (an
//! intermediate state only) a partial sum that a reduction completes. A split axis may be made of *parts*, e.g. the fused QKV output
//! `[q | k | v]`: rank `r` then holds the `r`-th slice of every part, so each rank keeps whole
//! heads of q, k and v rather than the `r`-th contiguous block of the fused axis.

use super::tensor::Tensor;
use serde::{Deserialize, Serialize};

/// The state of a value along one mesh axis (on the ranks of a group along it).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum State {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Rank `r` holds slice `r` of every part of `axis`.
    Split {
        /// The divided axis.
        axis: usize,
        /// Lengths of the parts of that axis (whole tensor); their sum is the axis length.
        parts: Vec<usize>,
    },
    /// Every rank holds a summand of the tensor.
    Partial,
}

impl State {
    /// Split along `axis` of a tensor of shape `shape`, in one part.
    pub fn split(axis: usize, shape: &[u64]) -> State {
        State::Split {
            axis,
            parts: vec![shape.get(axis).copied().unwrap_or(1) as usize],
        }
    }

    /// The split axis, if any.
    pub fn axis(&self) -> Option<usize> {
        match self {
            State::Split { axis, .. } => Some(*axis),
            _ => None,
        }
    }
}

/// A value's placement on a stage's logical mesh: its state along every mesh axis (axis 0
/// major, as Alpa's specs number them). A tensor axis split over several mesh axes is divided
/// major first: on an `n0 x n1` mesh the device at `(i, j)` holds piece `i * n1 + j` of it
/// (Alpa's `S01`). Megatron-LM's layouts are the one-axis case, the mesh being the
/// tensor-parallel group.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Placement(pub Vec<State>);

impl std::fmt::Display for Placement {
    /// One entry per mesh axis: `R` replicated, `P` a partial sum, `Sk` tensor axis `k` split,
    /// e.g. `[S1 R]`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let entries: Vec<String> = self
            .0
            .iter()
            .map(|s| match s {
                State::Replicated => "R".to_string(),
                State::Partial => "P".to_string(),
                State::Split { axis, .. } => format!("S{axis}"),
            })
            .collect();
        write!(f, "[{}]", entries.join(" "))
    }
}

impl Placement {
    /// Replicated along each of `axes` mesh axes.
    pub fn replicated(axes: usize) -> Placement {
        Placement(vec![State::Replicated; axes])
    }

    /// Whether every device holds the whole value.
    pub fn is_replicated(&self) -> bool {
        self.0.iter().all(|s| *s == State::Replicated)
    }

    /// The same placement with every partial sum completed (what a gradient flowing back into a
    /// partial result is: the gradient of the sum, on every device).
    pub fn completed(&self) -> Placement {
        Placement(
            self.0
                .iter()
                .map(|s| match s {
                    State::Partial => State::Replicated,
                    s => s.clone(),
                })
                .collect(),
        )
    }

    /// Devices that tensor axis `dim` is divided over on `mesh`, leaving out the mesh axes
    /// `except`.
    fn pieces(&self, dim: usize, mesh: &[usize], except: &[usize]) -> usize {
        self.0
            .iter()
            .enumerate()
            .filter(|&(a, s)| !except.contains(&a) && s.axis() == Some(dim))
            .map(|(a, _)| mesh.get(a).copied().unwrap_or(1))
            .product()
    }

    /// Why the placement cannot hold a tensor of `shape` on `mesh`, if it cannot: a mesh axis
    /// it does not have, a split of an axis the tensor lacks, or parts that do not divide
    /// over the devices splitting them.
    pub fn misfit(&self, shape: &[usize], mesh: &[usize]) -> Option<String> {
        if self.0.len() != mesh.len() {
            return Some(format!(
                "{} mesh axis state(s) on a mesh of {} axes",
                self.0.len(),
                mesh.len()
            ));
        }
        for s in &self.0 {
            if let State::Split { axis, parts } = s {
                let Some(&len) = shape.get(*axis) else {
                    return Some(format!(
                        "a split of axis {axis} of a rank-{} tensor",
                        shape.len()
                    ));
                };
                let n = self.pieces(*axis, mesh, &[]);
                if parts.iter().sum::<usize>() != len || parts.iter().any(|p| p % n != 0) {
                    return Some(format!(
                        "axis {axis} of {shape:?} (parts {parts:?}) does not divide {n} ways"
                    ));
                }
            }
        }
        None
    }

    /// The shape of one device's piece of a tensor of whole shape `shape`.
    pub fn local_shape(&self, shape: &[usize], mesh: &[usize]) -> Vec<usize> {
        let mut s = shape.to_vec();
        for (a, st) in self.0.iter().enumerate() {
            if let Some(d) = st.axis().and_then(|k| s.get_mut(k)) {
                *d /= mesh.get(a).copied().unwrap_or(1).max(1);
            }
        }
        s
    }

    /// The split of `state` as the group along mesh axes `axes` holds it when the other axes
    /// splitting the same tensor axis are those of `self`: its parts divided by their devices.
    fn group_split(&self, state: &State, axes: &[usize], mesh: &[usize]) -> State {
        match state {
            State::Split { axis, parts } => {
                let n = self.pieces(*axis, mesh, axes).max(1);
                State::Split {
                    axis: *axis,
                    parts: parts.iter().map(|p| p / n).collect(),
                }
            }
            s => s.clone(),
        }
    }
}

/// A collective that changes a value's state along one mesh axis, in the groups of devices
/// that differ only in their coordinate on that axis. A split's parts are those of the value as
/// the group holds it together (before a slice, after a gather).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Conversion {
    /// Keep this rank's slice of a replicated value (no communication).
    Slice {
        /// Mesh axis.
        axis: usize,
        /// Target state.
        to: State,
    },
    /// Assemble the whole value from the slices of every rank.
    AllGather {
        /// Mesh axis.
        axis: usize,
        /// Source state.
        from: State,
    },
    /// Sum the partial values of every rank.
    AllReduce {
        /// Mesh axis.
        axis: usize,
    },
    /// Sum the partial values and keep this rank's slice.
    ReduceScatter {
        /// Mesh axis.
        axis: usize,
        /// Target state.
        to: State,
    },
    /// Exchange slices so that a value split along one tensor axis ends split along another:
    /// every rank sends rank `j` the `j`-th slice, along the new axis, of its piece. The group
    /// may span several mesh axes, when a tensor axis split over all of them moves to another
    /// tensor axis as a whole (Alpa's `S01` on one tensor axis to `S01` on another): one
    /// all-to-all over the whole group, as XLA's SPMD partitioner issues it, not a gather and a
    /// slice per axis.
    AllToAll {
        /// Mesh axes of the group, consecutive and major first; the group's ranks are numbered
        /// major first, as a split over those axes divides.
        axes: Vec<usize>,
        /// Source state.
        from: State,
        /// Target state.
        to: State,
    },
}

impl Conversion {
    /// Short name for reports.
    pub fn name(&self) -> &'static str {
        match self {
            Conversion::Slice { .. } => "slice",
            Conversion::AllGather { .. } => "all_gather",
            Conversion::AllReduce { .. } => "all_reduce",
            Conversion::ReduceScatter { .. } => "reduce_scatter",
            Conversion::AllToAll { .. } => "all_to_all",
        }
    }

    /// Whether the conversion communicates.
    pub fn communicates(&self) -> bool {
        !matches!(self, Conversion::Slice { .. })
    }

    /// The mesh axes it runs along, major first.
    pub fn axes(&self) -> Vec<usize> {
        match self {
            Conversion::Slice { axis, .. }
            | Conversion::AllGather { axis, .. }
            | Conversion::AllReduce { axis }
            | Conversion::ReduceScatter { axis, .. } => vec![*axis],
            Conversion::AllToAll { axes, .. } => axes.clone(),
        }
    }

    /// The mesh axes it runs along, as a bit mask (bit `a` for mesh axis `a`); the CPU
    /// backend looks its group up by it for every conversion it runs, so it allocates nothing.
    pub fn mask(&self) -> usize {
        match self {
            Conversion::Slice { axis, .. }
            | Conversion::AllGather { axis, .. }
            | Conversion::AllReduce { axis }
            | Conversion::ReduceScatter { axis, .. } => 1 << axis,
            Conversion::AllToAll { axes, .. } => axes.iter().fold(0, |m, &a| m | 1 << a),
        }
    }
}

/// The conversions that take a value from `from` to `to` on `mesh`, in order; `None` when
/// impossible (nothing turns a complete value back into a partial sum).
///
/// Splits are undone minor axis first and made major axis first, so that a tensor axis split
/// over several mesh axes is always divided major first; a split that must change takes the
/// splits of the same tensor axis on minor mesh axes with it (gathered first, made again
/// after). A partial sum becomes a split by a reduce-scatter. A split that moves to another
/// tensor axis on the same mesh axes, no minor mesh axis splitting either tensor axis, is one
/// all-to-all over those axes.
pub fn conversions(from: &Placement, to: &Placement, mesh: &[usize]) -> Option<Vec<Conversion>> {
    let n = mesh.len();
    if from.0.len() != n || to.0.len() != n {
        return None;
    }
    if to
        .0
        .iter()
        .zip(&from.0)
        .any(|(t, f)| *t == State::Partial && *f != State::Partial)
    {
        return None;
    }
    // Splits that move between tensor axes no minor mesh axis splits: one all-to-all per run of
    // consecutive mesh axes that all move the same split to the same other one. (A major
    // axis splitting the same tensor axis leaves each group a contiguous block of it, which
    // the all-to-all exchanges as a whole: hierarchical context parallelism's heads-for-tokens
    // exchange inside each ring rank's share.)
    let alone = |a: usize, d: Option<usize>| {
        (a + 1..n).all(|b| from.0[b].axis() != d && to.0[b].axis() != d)
    };
    let moved = |a: usize| match (from.0[a].axis(), to.0[a].axis()) {
        (Some(x), Some(y)) if x != y => Some((x, y)),
        _ => None,
    };
    // `run_end[a]`: the last mesh axis of the all-to-all that mesh axis `a` takes part in.
    let mut run_end: Vec<Option<usize>> = vec![None; n];
    let mut a = 0;
    while a < n {
        let Some((x, y)) = moved(a) else {
            a += 1;
            continue;
        };
        let mut last = a;
        while last + 1 < n && from.0[last + 1] == from.0[a] && to.0[last + 1] == to.0[a] {
            last += 1;
        }
        if alone(last, Some(x)) && alone(last, Some(y)) {
            run_end[a..=last].fill(Some(last));
        }
        a = last + 1;
    }
    let swap: Vec<bool> = run_end.iter().map(Option::is_some).collect();
    // Mesh axes whose split goes: those that change, and minor ones splitting the same tensor
    // axis as a split that goes or is made.
    let mut undo: Vec<bool> = (0..n)
        .map(|a| !swap[a] && from.0[a].axis().is_some() && from.0[a] != to.0[a])
        .collect();
    loop {
        let mut grew = false;
        for a in (0..n).filter(|&a| !swap[a]) {
            let moves = undo[a] || (to.0[a] != from.0[a] && to.0[a].axis().is_some());
            let dims = [from.0[a].axis(), to.0[a].axis()];
            if !moves {
                continue;
            }
            for (b, state) in from.0.iter().enumerate().skip(a + 1) {
                if !undo[b] && state.axis().is_some() && dims.contains(&state.axis()) {
                    undo[b] = true;
                    grew = true;
                }
            }
        }
        if !grew {
            break;
        }
    }
    let mut cur = from.clone();
    let mut out = Vec::new();
    for a in (0..n).rev().filter(|&a| undo[a]) {
        let state = cur.group_split(&cur.0[a], &[a], mesh);
        out.push(Conversion::AllGather {
            axis: a,
            from: state,
        });
        cur.0[a] = State::Replicated;
    }
    for (a, &end) in run_end.iter().enumerate() {
        if cur.0[a] == to.0[a] {
            continue;
        }
        // The mesh axes this step settles.
        let mut settled = a..=a;
        match (&cur.0[a], &to.0[a], end) {
            (State::Partial, State::Replicated, _) => out.push(Conversion::AllReduce { axis: a }),
            (State::Partial, t @ State::Split { .. }, _) => {
                let state = cur.group_split(t, &[a], mesh);
                out.push(Conversion::ReduceScatter { axis: a, to: state });
            }
            (State::Replicated, t @ State::Split { .. }, _) => {
                let state = cur.group_split(t, &[a], mesh);
                out.push(Conversion::Slice { axis: a, to: state });
            }
            (f @ State::Split { .. }, t @ State::Split { .. }, Some(last)) => {
                settled = a..=last;
                let axes: Vec<usize> = settled.clone().collect();
                out.push(Conversion::AllToAll {
                    from: cur.group_split(f, &axes, mesh),
                    to: cur.group_split(t, &axes, mesh),
                    axes,
                });
            }
            _ => return None,
        }
        for b in settled {
            cur.0[b] = to.0[b].clone();
        }
    }
    Some(out)
}

/// Ranges of the whole axis that rank `rank` of `ranks` holds, in order.
fn ranges(parts: &[usize], rank: usize, ranks: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(parts.len());
    let mut offset = 0;
    for &p in parts {
        let w = p / ranks;
        out.push((offset + rank * w, offset + (rank + 1) * w));
        offset += p;
    }
    out
}

/// Rank `rank`'s slice (of `ranks`) of the whole tensor `whole` split as `axis`/`parts`.
pub fn slice(whole: &Tensor, axis: usize, parts: &[usize], rank: usize, ranks: usize) -> Tensor {
    let outer: usize = whole.shape[..axis].iter().product();
    let len = whole.shape[axis];
    let inner: usize = whole.shape[axis + 1..].iter().product();
    let spans = ranges(parts, rank, ranks);
    let local: usize = spans.iter().map(|(a, b)| b - a).sum();
    let mut data = Vec::with_capacity(outer * local * inner);
    for o in 0..outer {
        for &(a, b) in &spans {
            let start = (o * len + a) * inner;
            data.extend_from_slice(&whole.data[start..start + (b - a) * inner]);
        }
    }
    let mut shape = whole.shape.clone();
    shape[axis] = local;
    Tensor { shape, data }
}

/// The whole tensor from the slices of every rank (in rank order): the inverse of [`slice`].
pub fn gather(pieces: &[&Tensor], axis: usize, parts: &[usize]) -> Tensor {
    let ranks = pieces.len();
    let first = pieces[0];
    let outer: usize = first.shape[..axis].iter().product();
    let inner: usize = first.shape[axis + 1..].iter().product();
    let len: usize = parts.iter().sum();
    let mut shape = first.shape.clone();
    shape[axis] = len;
    let mut data = vec![0.0f32; outer * len * inner];
    for (rank, piece) in pieces.iter().enumerate() {
        let spans = ranges(parts, rank, ranks);
        let local: usize = spans.iter().map(|(a, b)| b - a).sum();
        for o in 0..outer {
            let mut src = o * local * inner;
            for &(a, b) in &spans {
                let n = (b - a) * inner;
                let dst = (o * len + a) * inner;
                data[dst..dst + n].copy_from_slice(&piece.data[src..src + n]);
                src += n;
            }
        }
    }
    Tensor { shape, data }
}

/// The piece of the whole tensor `whole` that the device at mesh coordinates `at` holds in
/// `placement` (partial sums are not a placement a whole tensor is cut into: such axes keep
/// it whole).
pub fn shard(whole: &Tensor, placement: &Placement, at: &[usize], mesh: &[usize]) -> Tensor {
    let mut cur = Placement::replicated(mesh.len());
    let mut t = whole.clone();
    for (a, state) in placement.0.iter().enumerate() {
        if let State::Split { axis, .. } = state {
            if let State::Split { parts, .. } = cur.group_split(state, &[a], mesh) {
                t = slice(&t, *axis, &parts, at[a], mesh[a]);
            }
            cur.0[a] = state.clone();
        }
    }
    t
}

/// The whole tensor from every device's piece (`pieces[i]`: the device of linear mesh index
/// `i`, axis 0 major) in `placement`: splits gathered, partial sums added, replicas read once.
/// The inverse of [`shard`].
pub fn assemble(pieces: &[&Tensor], placement: &Placement, mesh: &[usize]) -> Tensor {
    let mut cur = placement.clone();
    let mut level: Vec<Tensor> = pieces.iter().map(|t| (*t).clone()).collect();
    for a in (0..mesh.len()).rev() {
        let n = mesh[a].max(1);
        let state = cur.group_split(&cur.0[a], &[a], mesh);
        level = level
            .chunks(n)
            .map(|group| match &state {
                State::Split { axis, parts } if group.len() > 1 => {
                    let refs: Vec<&Tensor> = group.iter().collect();
                    gather(&refs, *axis, parts)
                }
                State::Partial => {
                    let mut sum = group[0].clone();
                    for t in &group[1..] {
                        sum.add_assign(t);
                    }
                    sum
                }
                _ => group[0].clone(),
            })
            .collect();
        cur.0[a] = State::Replicated;
    }
    level.into_iter().next().unwrap_or(Tensor {
        shape: vec![],
        data: vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use autopar_rules::cost::analytic::Collective;
    use autopar_rules::cost::cluster::Link;
    use autopar_rules::cost::profile::CollectiveName;
    use autopar_rules::cost::sharding::{
        Mesh, Spec, Step, reduce_steps, reshard_steps, valid_specs,
    };

    #[test]
    fn gather_inverts_slice_with_parts() {
        let shape = vec![2, 12, 3];
        let whole = Tensor {
            data: (0..72).map(|x| x as f32).collect(),
            shape,
        };
        for parts in [vec![12], vec![4, 4, 4], vec![8, 2, 2]] {
            let pieces: Vec<Tensor> = (0..2).map(|r| slice(&whole, 1, &parts, r, 2)).collect();
            let refs: Vec<&Tensor> = pieces.iter().collect();
            assert_eq!(gather(&refs, 1, &parts), whole);
        }
        // Rank 1 of [q q q q | k k | v v] holds the second half of each part.
        let row = Tensor {
            shape: vec![8],
            data: (0..8).map(|x| x as f32).collect(),
        };
        assert_eq!(
            slice(&row, 0, &[4, 2, 2], 1, 2).data,
            vec![2.0, 3.0, 5.0, 7.0]
        );
    }

    fn whole(shape: Vec<usize>) -> Tensor {
        let n = shape.iter().product::<usize>();
        Tensor {
            shape,
            data: (0..n).map(|x| x as f32).collect(),
        }
    }

    fn split(axis: usize, parts: Vec<usize>) -> State {
        State::Split { axis, parts }
    }

    /// Every device's piece after running `convs` from `from`, computed with whole-tensor
    /// collectives over the mesh's axis groups (devices numbered axis 0 major).
    fn run(pieces: Vec<Tensor>, convs: &[Conversion], mesh: &[usize]) -> Vec<Tensor> {
        let coords = |i: usize| -> Vec<usize> {
            let mut c = vec![0; mesh.len()];
            let mut rest = i;
            for a in (0..mesh.len()).rev() {
                c[a] = rest % mesh[a];
                rest /= mesh[a];
            }
            c
        };
        let mut pieces = pieces;
        for c in convs {
            let axes = c.axes();
            // The group's size, and a device's rank in it (major first).
            let size: usize = axes.iter().map(|&a| mesh[a]).product();
            let rank = |i: usize| axes.iter().fold(0, |r, &a| r * mesh[a] + coords(i)[a]);
            let group_of = |i: usize| -> Vec<usize> {
                let mut g: Vec<usize> = (0..pieces.len())
                    .filter(|&k| {
                        let (ck, ci) = (coords(k), coords(i));
                        (0..mesh.len()).all(|b| axes.contains(&b) || ck[b] == ci[b])
                    })
                    .collect();
                g.sort_by_key(|&k| rank(k));
                g
            };
            pieces = (0..pieces.len())
                .map(|i| {
                    let r = rank(i);
                    let g = group_of(i);
                    match c {
                        Conversion::Slice {
                            to: State::Split { axis, parts },
                            ..
                        } => slice(&pieces[i], *axis, parts, r, size),
                        Conversion::AllGather {
                            from: State::Split { axis, parts },
                            ..
                        } => {
                            let refs: Vec<&Tensor> = g.iter().map(|&k| &pieces[k]).collect();
                            gather(&refs, *axis, parts)
                        }
                        Conversion::AllToAll {
                            from:
                                State::Split {
                                    axis: fa,
                                    parts: fp,
                                },
                            to:
                                State::Split {
                                    axis: ta,
                                    parts: tp,
                                },
                            ..
                        } => {
                            let refs: Vec<&Tensor> = g.iter().map(|&k| &pieces[k]).collect();
                            slice(&gather(&refs, *fa, fp), *ta, tp, r, size)
                        }
                        Conversion::AllReduce { .. } | Conversion::ReduceScatter { .. } => {
                            let mut sum = Tensor::zeros(pieces[i].shape.clone());
                            for &k in &g {
                                sum.add_assign(&pieces[k]);
                            }
                            match c {
                                Conversion::ReduceScatter {
                                    to: State::Split { axis, parts },
                                    ..
                                } => slice(&sum, *axis, parts, r, size),
                                _ => sum,
                            }
                        }
                        _ => panic!("malformed conversion {c:?}"),
                    }
                })
                .collect();
        }
        pieces
    }

    #[test]
    fn every_conversion_on_a_2x2_mesh_keeps_the_value() {
        // Every placement of a [4, 8] tensor on a 2 x 2 mesh, from every other: the pieces
        // after the conversions are the target placement's shards of the same tensor.
        let mesh = [2, 2];
        let t = whole(vec![4, 8]);
        let states = [
            State::Replicated,
            split(0, vec![4]),
            split(1, vec![8]),
            split(1, vec![4, 4]),
        ];
        let mut placements = Vec::new();
        for a in &states {
            for b in &states {
                let p = Placement(vec![a.clone(), b.clone()]);
                if p.misfit(&t.shape, &mesh).is_none() {
                    placements.push(p);
                }
            }
        }
        assert!(placements.len() >= 12);
        for from in &placements {
            let start: Vec<Tensor> = (0..4)
                .map(|i| shard(&t, from, &[i / 2, i % 2], &mesh))
                .collect();
            let refs: Vec<&Tensor> = start.iter().collect();
            assert_eq!(assemble(&refs, from, &mesh), t, "{from:?}");
            for to in &placements {
                let convs = conversions(from, to, &mesh).expect("possible");
                let got = run(start.clone(), &convs, &mesh);
                for (i, piece) in got.iter().enumerate() {
                    assert_eq!(
                        *piece,
                        shard(&t, to, &[i / 2, i % 2], &mesh),
                        "{from:?} -> {to:?} by {convs:?}, device {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn every_conversion_on_a_2x2x2_mesh_keeps_the_value() {
        // Every placement of an [8, 8] tensor on a 2 x 2 x 2 mesh (each mesh axis replicated or
        // splitting either tensor axis), from every other: all-to-alls over one, two and
        // three mesh axes, with and without a major axis keeping its split.
        let mesh = [2, 2, 2];
        let t = whole(vec![8, 8]);
        let states = [State::Replicated, split(0, vec![8]), split(1, vec![8])];
        let mut placements = Vec::new();
        for a in &states {
            for b in &states {
                for c in &states {
                    placements.push(Placement(vec![a.clone(), b.clone(), c.clone()]));
                }
            }
        }
        let at = |i: usize| [i / 4, i / 2 % 2, i % 2];
        let mut widths = std::collections::BTreeSet::new();
        for from in &placements {
            let start: Vec<Tensor> = (0..8).map(|i| shard(&t, from, &at(i), &mesh)).collect();
            for to in &placements {
                let convs = conversions(from, to, &mesh).expect("possible");
                for c in convs.iter().filter(|c| c.name() == "all_to_all") {
                    widths.insert(c.axes());
                }
                let got = run(start.clone(), &convs, &mesh);
                for (i, piece) in got.iter().enumerate() {
                    assert_eq!(
                        *piece,
                        shard(&t, to, &at(i), &mesh),
                        "{from:?} -> {to:?} by {convs:?}, device {i}"
                    );
                }
            }
        }
        let widths: Vec<Vec<usize>> = widths.into_iter().collect();
        assert_eq!(
            widths,
            [
                vec![0],
                vec![0, 1],
                vec![0, 1, 2],
                vec![1],
                vec![1, 2],
                vec![2]
            ]
        );
    }

    /// The placement of a cost-model spec on a 2-axis mesh, partial along the axes of
    /// `partial`.
    fn placement_of(spec: &Spec, partial: u8, shape: &[u64]) -> Placement {
        Placement(
            (0..2)
                .map(|a| match spec.axis_on(a) {
                    _ if partial & (1 << a) != 0 => State::Partial,
                    Some(k) => State::split(k, shape),
                    None => State::Replicated,
                })
                .collect(),
        )
    }

    /// Communicating collectives as (name, mesh axes), sorted: a whole-mesh all-to-all, which
    /// the cost model prices as one step per axis, is one entry.
    fn calls(steps: &[Step]) -> Vec<(&'static str, Vec<usize>)> {
        let name = |k: Collective| CollectiveName::from(k).name();
        let a2a = steps
            .iter()
            .filter(|s| s.kind == Collective::AllToAll)
            .count();
        let mut out: Vec<(&'static str, Vec<usize>)> = steps
            .iter()
            .filter(|s| s.kind != Collective::AllToAll || a2a == 1)
            .map(|s| (name(s.kind), vec![s.axis]))
            .collect();
        if a2a == 2 {
            out.push(("all_to_all", vec![0, 1]));
        }
        out.sort();
        out
    }

    #[test]
    fn the_cost_model_prices_the_collectives_the_executor_runs() {
        // Every pair of specs of a [4, 8, 6] tensor, from a complete or a partial sum, on
        // meshes with one and two usable axes: the reshard and reduction steps the ILP prices
        // are the executor's conversions, collective for collective.
        let link = Link {
            latency: 1e-5,
            bandwidth: 1e11,
            pairwise_bandwidth: 1e11,
            nodes: 1,
        };
        let shape = [4u64, 8, 6];
        let mut compared = 0;
        for dims in [[2u64, 2], [2, 4], [1, 4], [4, 2]] {
            let mesh = Mesh {
                shape: dims,
                links: [link, link],
            };
            let on: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
            let specs = valid_specs(&shape, &mesh);
            for partial in [0u8, 0b01, 0b10, 0b11] {
                if (0..2).any(|a| partial & (1 << a) != 0 && dims[a] == 1) {
                    continue;
                }
                for from in specs.iter().filter(|s| s.axes() & partial == 0) {
                    for to in &specs {
                        let priced = if partial == 0 {
                            reshard_steps(1e6, from, to, &mesh)
                        } else {
                            reduce_steps(1e6, partial, from, to, &mesh)
                        };
                        let (f, t) = (
                            placement_of(from, partial, &shape),
                            placement_of(to, 0, &shape),
                        );
                        let run = conversions(&f, &t, &on).expect("possible");
                        let mut ran: Vec<(&'static str, Vec<usize>)> = run
                            .iter()
                            .filter(|c| c.communicates())
                            .map(|c| (c.name(), c.axes()))
                            .collect();
                        ran.sort();
                        assert_eq!(
                            calls(&priced),
                            ran,
                            "{from} (partial {partial:02b}) -> {to} on {dims:?}: {run:?}"
                        );
                        compared += 1;
                    }
                }
            }
        }
        assert!(compared > 700, "{compared}");
    }

    #[test]
    fn partial_sums_reduce_into_any_placement() {
        let mesh = [2, 2];
        let t = whole(vec![4, 8]);
        // The devices hold 1/2, 1/4, 1/8 and 1/8 of the tensor (sums exact in binary).
        let from = Placement(vec![State::Partial, State::Partial]);
        let pieces: Vec<Tensor> = [0.5f32, 0.25, 0.125, 0.125]
            .iter()
            .map(|f| Tensor {
                shape: t.shape.clone(),
                data: t.data.iter().map(|x| x * f).collect(),
            })
            .collect();
        for to in [
            Placement(vec![split(0, vec![4]), split(0, vec![4])]),
            Placement(vec![State::Replicated, split(1, vec![8])]),
            Placement(vec![split(1, vec![8]), State::Partial]),
        ] {
            let convs = conversions(&from, &to, &mesh).expect("possible");
            let got = run(pieces.clone(), &convs, &mesh);
            let refs: Vec<&Tensor> = got.iter().collect();
            assert_eq!(assemble(&refs, &to, &mesh), t, "{to:?}");
        }
        assert!(conversions(&Placement::replicated(2), &from, &mesh).is_none());
        // A split moving between tensor axes is one all-to-all; with the other mesh axis on
        // one of those tensor axes it is a gather and a slice.
        let names = |from: Vec<State>, to: Vec<State>| -> Vec<&'static str> {
            conversions(&Placement(from), &Placement(to), &mesh)
                .expect("possible")
                .iter()
                .map(Conversion::name)
                .collect()
        };
        let (rows, cols) = (split(0, vec![4]), split(1, vec![8]));
        assert_eq!(
            names(
                vec![rows.clone(), State::Replicated],
                vec![cols.clone(), State::Replicated]
            ),
            ["all_to_all"]
        );
        assert_eq!(
            names(
                vec![rows.clone(), cols.clone()],
                vec![cols.clone(), State::Replicated]
            ),
            ["all_gather", "all_gather", "slice"]
        );
        // Rows split over both mesh axes moving to columns split over both: one all-to-all
        // over the whole mesh, as XLA issues it.
        let whole_mesh = conversions(
            &Placement(vec![rows.clone(), rows.clone()]),
            &Placement(vec![cols.clone(), cols.clone()]),
            &mesh,
        );
        assert_eq!(
            whole_mesh,
            Some(vec![Conversion::AllToAll {
                axes: vec![0, 1],
                from: rows,
                to: cols
            }])
        );
        let one = Placement(vec![split(1, vec![2, 2])]);
        assert_eq!(
            conversions(&Placement(vec![State::Partial]), &one, &[2]),
            Some(vec![Conversion::ReduceScatter {
                axis: 0,
                to: split(1, vec![2, 2])
            }])
        );
    }
}
