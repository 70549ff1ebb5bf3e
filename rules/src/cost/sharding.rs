//! Sharding specs on a 2D logical device mesh (ALGORITHMS.md §3): per tensor axis, replicated
//! (`R`) or split over mesh axis 0, 1 or both (`S0`, `S1`, `S01`); the tiles a spec leaves on
//! each device; and the cost of changing a tensor from one spec to another.

use crate::cost::analytic::{Collective, collective_time};
use crate::cost::cluster::{Cluster, Link};
use serde::{Deserialize, Serialize};
use std::fmt;

/// A logical mesh of `shape[0] x shape[1]` devices. As Alpa lays device meshes on a cluster,
/// mesh `a x b` is `a` nodes of `b` GPUs each when `b` GPUs fit in a node (axis 0 runs across
/// nodes, axis 1 inside one), else `a * b` consecutive GPUs numbered row-major.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Mesh {
    /// Devices along each mesh axis.
    pub shape: [u64; 2],
    /// Collective costs along each axis.
    pub links: [Link; 2],
}

impl Mesh {
    /// The mesh `a x b` on `cluster`, or why it does not fit there.
    pub fn on(cluster: &Cluster, a: u64, b: u64) -> Result<Mesh, String> {
        let gpn = cluster.gpus_per_node;
        if a == 0 || b == 0 {
            return Err(format!(
                "a mesh needs at least one device per axis, found {a}x{b}"
            ));
        }
        let fits = if b <= gpn {
            a <= cluster.nodes
        } else {
            b % gpn == 0 && a.saturating_mul(b) <= cluster.gpus()
        };
        if !fits {
            return Err(format!(
                "mesh {a}x{b} does not fit a cluster of {} nodes x {gpn} GPUs (expected {a} nodes \
                 of at least {b} GPUs, or {b} a multiple of {gpn} and {a}x{b} GPUs in all)",
                cluster.nodes
            ));
        }
        let stride = if b <= gpn { gpn } else { b };
        Ok(Mesh {
            shape: [a, b],
            links: [cluster.group_link(stride, a), cluster.group_link(1, b)],
        })
    }

    /// Logical mesh `shape` over the devices of a submesh of `submesh.0` whole nodes (or part
    /// of one node) of `submesh.1` GPUs, numbered node by node: axis 1 runs over consecutive
    /// devices, axis 0 over blocks of `shape[1]` of them (Alpa's logical meshes of a
    /// physical one). `shape` must multiply to the submesh's devices.
    pub fn logical(cluster: &Cluster, submesh: (u64, u64), shape: [u64; 2]) -> Mesh {
        debug_assert_eq!(shape[0] * shape[1], submesh.0 * submesh.1);
        Mesh {
            shape,
            links: [
                cluster.group_link(shape[1], shape[0]),
                cluster.group_link(1, shape[1]),
            ],
        }
    }

    /// Devices in the mesh.
    pub fn devices(&self) -> u64 {
        self.shape[0] * self.shape[1]
    }

    /// Devices along mesh axis `a`.
    pub fn size(&self, a: usize) -> u64 {
        self.shape[a]
    }
}

/// How one tensor axis is distributed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum AxisSplit {
    /// Every device holds the whole axis.
    R,
    /// Split over mesh axis 0.
    S0,
    /// Split over mesh axis 1.
    S1,
    /// Split over both mesh axes (0 major).
    S01,
}

impl AxisSplit {
    /// The split over a set of mesh axes (bit 0: axis 0, bit 1: axis 1).
    pub fn from_axes(mask: u8) -> AxisSplit {
        match mask & 3 {
            0 => AxisSplit::R,
            1 => AxisSplit::S0,
            2 => AxisSplit::S1,
            _ => AxisSplit::S01,
        }
    }

    /// The mesh axes it uses, as a bit mask.
    pub fn axes(self) -> u8 {
        match self {
            AxisSplit::R => 0,
            AxisSplit::S0 => 1,
            AxisSplit::S1 => 2,
            AxisSplit::S01 => 3,
        }
    }

    /// Devices the axis is divided over.
    pub fn parts(self, mesh: &Mesh) -> u64 {
        let m = self.axes();
        (if m & 1 != 0 { mesh.shape[0] } else { 1 }) * (if m & 2 != 0 { mesh.shape[1] } else { 1 })
    }
}

/// A tensor's distribution: one [`AxisSplit`] per axis, each mesh axis used at most once.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Spec(pub Vec<AxisSplit>);

impl fmt::Display for Spec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for s in &self.0 {
            f.write_str(match s {
                AxisSplit::R => "R",
                AxisSplit::S0 => "S0",
                AxisSplit::S1 => "S1",
                AxisSplit::S01 => "S01",
            })?;
        }
        Ok(())
    }
}

impl std::str::FromStr for Spec {
    type Err = String;

    /// A spec as [`fmt::Display`] writes it (`S0RS1`: axis 0 over mesh axis 0, axis 2 over mesh
    /// axis 1); mesh axes used twice are not checked here ([`Spec::valid_for`] does).
    fn from_str(text: &str) -> Result<Spec, String> {
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let (split, len) = if rest.starts_with("S01") {
                (AxisSplit::S01, 3)
            } else if rest.starts_with("S0") {
                (AxisSplit::S0, 2)
            } else if rest.starts_with("S1") {
                (AxisSplit::S1, 2)
            } else if rest.starts_with('R') {
                (AxisSplit::R, 1)
            } else {
                return Err(format!(
                    "`{text}` is not a spec: expected one of R, S0, S1, S01 per tensor axis, \
                     found `{rest}`"
                ));
            };
            out.push(split);
            rest = &rest[len..];
        }
        Ok(Spec(out))
    }
}

impl Spec {
    /// Replicated on every axis.
    pub fn replicated(rank: usize) -> Spec {
        Spec(vec![AxisSplit::R; rank])
    }

    /// The mesh axes used, as a bit mask.
    pub fn axes(&self) -> u8 {
        self.0.iter().fold(0, |m, s| m | s.axes())
    }

    /// Whether each mesh axis is used at most once and every split divides its axis of
    /// `shape` into parts of at least one element.
    pub fn valid_for(&self, shape: &[u64], mesh: &Mesh) -> bool {
        if self.0.len() != shape.len() {
            return false;
        }
        let mut used = 0u8;
        for (s, &n) in self.0.iter().zip(shape) {
            if used & s.axes() != 0 {
                return false;
            }
            used |= s.axes();
            let parts = s.parts(mesh);
            if parts > 1 && (n < parts || n % parts != 0) {
                return false;
            }
        }
        true
    }

    /// Devices the tensor is divided over (a device holds `1/tiles` of it).
    pub fn tiles(&self, mesh: &Mesh) -> u64 {
        self.0.iter().map(|s| s.parts(mesh)).product()
    }

    /// The shape of one device's tile.
    pub fn tile_shape(&self, shape: &[u64], mesh: &Mesh) -> Vec<u64> {
        shape
            .iter()
            .zip(&self.0)
            .map(|(&n, s)| n / s.parts(mesh).max(1))
            .collect()
    }

    /// The tensor axis split over mesh axis `a`, if any.
    pub fn axis_on(&self, a: usize) -> Option<usize> {
        self.0.iter().position(|s| s.axes() & (1 << a) != 0)
    }
}

/// Every valid spec of a tensor of `shape` on `mesh`, replicated first. Mesh axes of size 1 are
/// never split on (it would change nothing).
pub fn valid_specs(shape: &[u64], mesh: &Mesh) -> Vec<Spec> {
    let usable: Vec<u8> = (0..2u8)
        .filter(|&a| mesh.shape[a as usize] > 1)
        .map(|a| 1 << a)
        .collect();
    let mut out = vec![Spec::replicated(shape.len())];
    // Choices per mesh axis: unused or on one tensor axis; both axes on one tensor axis is S01.
    let choices = shape.len() + 1;
    let combos = choices.pow(usable.len() as u32);
    for c in 1..combos {
        let mut spec = Spec::replicated(shape.len());
        let mut code = c;
        for &bit in &usable {
            let pick = code % choices;
            code /= choices;
            if pick > 0 {
                let s = &mut spec.0[pick - 1];
                *s = AxisSplit::from_axes(s.axes() | bit);
            }
        }
        if spec.valid_for(shape, mesh) && !out.contains(&spec) {
            out.push(spec);
        }
    }
    out
}

/// One collective of a resharding or a reduction.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Step {
    /// The collective.
    pub kind: Collective,
    /// The mesh axis it runs over.
    pub axis: usize,
    /// Its payload as [`collective_time`] takes it (the reduced tile, or the gathered result).
    pub bytes: f64,
    /// Its time, s.
    pub seconds: f64,
}

impl Step {
    /// The collective `kind` of `bytes` over mesh axis `axis`, timed.
    pub fn on(kind: Collective, axis: usize, bytes: f64, mesh: &Mesh) -> Step {
        Step {
            kind,
            axis,
            bytes,
            seconds: collective_time(kind, mesh.shape[axis], bytes, mesh.links[axis]),
        }
    }
}

/// Total time of `steps`.
pub fn steps_time(steps: &[Step]) -> f64 {
    steps.iter().map(|s| s.seconds).sum()
}

/// The collectives that change a tensor of `bytes` from spec `from` to spec `to`
/// (ALGORITHMS.md §3): [`reduce_steps`] of a complete tensor.
pub fn reshard_steps(bytes: f64, from: &Spec, to: &Spec, mesh: &Mesh) -> Vec<Step> {
    if from == to {
        return Vec::new();
    }
    reduce_steps(bytes, 0, from, to, mesh)
}

/// What it costs to change a tensor of `bytes` from spec `from` to spec `to`: the time of
/// [`reshard_steps`].
pub fn reshard_time(bytes: f64, from: &Spec, to: &Spec, mesh: &Mesh) -> f64 {
    steps_time(&reshard_steps(bytes, from, to, mesh))
}

/// A tensor's state along one mesh axis, as the conversion rules see it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Along {
    Replicated,
    Partial,
    Split(usize),
}

impl Along {
    fn axis(self) -> Option<usize> {
        match self {
            Along::Split(i) => Some(i),
            _ => None,
        }
    }
}

/// The collectives that turn a partial sum (complete once added over the mesh axes in
/// `partial`) of a tensor of `bytes`, held as `from`, into the complete tensor held as `to`,
/// as the executor's conversion rules run them and XLA's SPMD partitioner issues them
/// (`engine/src/executor/placement.rs`; a test there checks every pair of specs):
///
/// - A partial sum is reduce-scattered where `to` splits the tensor along its mesh axis, else
///   all-reduced.
/// - A split that moves to another tensor axis is an all-to-all along its mesh axis when no
///   minor mesh axis splits either tensor axis: then the groups along it hold whole blocks of
///   both. A tensor axis split over both mesh axes that moves to another split over both
///   (`S01` to `S01`) is one all-to-all over the whole mesh.
/// - Otherwise a split that goes is gathered, and so is a split of the same tensor axis on the
///   minor axis when the major axis's changes (gathering or scattering along the major axis a
///   block that the minor axis divides would leave each device a strided piece); what `to`
///   splits is then sliced (free).
///
/// Payloads are the tile sizes along the way. The gathers are priced major axis first, the
/// smaller payload crossing the major axis's (slower, inter-node) link, as a hierarchical
/// all-gather runs them; on one kind of link the order does not change the volume. A
/// whole-mesh all-to-all (each device sending `1/n` of its tile to each of the other `n - 1`,
/// `n = n0 n1`) is priced as one step per mesh axis holding the messages that cross that
/// axis's links: the `(n0 - 1) n1` peers with another axis-0 coordinate take `(n0 - 1) / n0`
/// of the tile over axis 0's link, the `n1 - 1` peers that differ only along axis 1 take
/// `(n1 - 1) / n` over axis 1's; on one kind of link that is the flat all-to-all's
/// `(n - 1) / n` of the tile.
pub fn reduce_steps(bytes: f64, partial: u8, from: &Spec, to: &Spec, mesh: &Mesh) -> Vec<Step> {
    let state = |s: &Spec, partial: u8, a: usize| {
        if mesh.shape[a] <= 1 {
            Along::Replicated
        } else if partial & (1 << a) != 0 {
            Along::Partial
        } else {
            s.axis_on(a).map_or(Along::Replicated, Along::Split)
        }
    };
    let f = [0, 1].map(|a| state(from, partial, a));
    let t = [0, 1].map(|a| state(to, 0, a));
    let moved = |a: usize| matches!((f[a], t[a]), (Along::Split(x), Along::Split(y)) if x != y);
    let whole_mesh = moved(0) && f[1] == f[0] && t[1] == t[0];
    let minor_shares = |dims: [Option<usize>; 2]| {
        [f[1].axis(), t[1].axis()]
            .iter()
            .any(|d| d.is_some() && dims.contains(d))
    };
    let swap = [
        whole_mesh || (moved(0) && !minor_shares([f[0].axis(), t[0].axis()])),
        whole_mesh || moved(1),
    ];
    let mut undo = [0, 1].map(|a| !swap[a] && f[a].axis().is_some() && f[a] != t[a]);
    let major_moves = !swap[0] && f[0] != t[0] && (undo[0] || t[0].axis().is_some());
    if major_moves && f[1].axis().is_some() && [f[0].axis(), t[0].axis()].contains(&f[1].axis()) {
        undo[1] = true;
    }
    let mut steps = Vec::new();
    // Current tile size, bytes, as collectives run.
    let mut tile = bytes / from.tiles(mesh) as f64;
    let mut now = f;
    for a in (0..2).filter(|&a| undo[a]) {
        let n = mesh.shape[a] as f64;
        steps.push(Step::on(Collective::AllGather, a, tile * n, mesh));
        tile *= n;
        now[a] = Along::Replicated;
    }
    for a in 0..2 {
        let n = mesh.shape[a] as f64;
        match (now[a], t[a]) {
            (Along::Partial, Along::Replicated) => {
                steps.push(Step::on(Collective::AllReduce, a, tile, mesh));
            }
            (Along::Partial, Along::Split(_)) => {
                steps.push(Step::on(Collective::ReduceScatter, a, tile, mesh));
                tile /= n;
            }
            (Along::Replicated, Along::Split(_)) => tile /= n,
            (Along::Split(x), Along::Split(y)) if x != y && whole_mesh => {
                // `collective_time` sends `(n - 1) / n^2` of the payload: on axis 1 the
                // payload is the tile times `n1 / n0`.
                let payload = if a == 0 {
                    tile * n
                } else {
                    tile * n / mesh.shape[0] as f64
                };
                steps.push(Step::on(Collective::AllToAll, a, payload, mesh));
            }
            (Along::Split(x), Along::Split(y)) if x != y => {
                steps.push(Step::on(Collective::AllToAll, a, tile * n, mesh));
            }
            _ => {}
        }
    }
    steps
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mesh(a: u64, b: u64) -> Mesh {
        let link = Link {
            latency: 1e-5,
            bandwidth: 1e11,
            pairwise_bandwidth: 1e11,
            nodes: 1,
        };
        Mesh {
            shape: [a, b],
            links: [link, link],
        }
    }

    #[test]
    fn specs_parse_as_they_are_written() {
        for spec in valid_specs(&[8, 6, 4], &mesh(2, 4)) {
            assert_eq!(spec.to_string().parse::<Spec>(), Ok(spec.clone()), "{spec}");
        }
        assert_eq!("".parse::<Spec>(), Ok(Spec(vec![])));
        for bad in ["S2", "S", "X", "RS", "S0S"] {
            assert!(bad.parse::<Spec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn specs_split_each_mesh_axis_once_and_only_where_it_divides() {
        let m = mesh(2, 4);
        let specs = valid_specs(&[8, 6], &m);
        let names: Vec<String> = specs.iter().map(|s| s.to_string()).collect();
        // 6 is not divisible by 4, nor by 8; 8 takes either or both axes.
        assert_eq!(names, ["RR", "S0R", "RS0", "S1R", "S01R", "S1S0"]);
        assert!(specs.iter().all(|s| s.valid_for(&[8, 6], &m)));
        // Size-1 mesh axes are never used.
        let flat = valid_specs(&[8, 8], &mesh(1, 8));
        assert_eq!(flat.len(), 3);
        assert!(flat.iter().all(|s| s.axes() & 1 == 0));
    }

    #[test]
    fn tiles_and_reshards() {
        let m = mesh(2, 4);
        let s = Spec(vec![AxisSplit::S01, AxisSplit::R]);
        assert_eq!(s.tiles(&m), 8);
        assert_eq!(s.tile_shape(&[16, 3], &m), vec![2, 3]);
        let r = Spec::replicated(2);
        let bytes = 16.0 * 4.0 * 2.0;
        // R -> S is a slice; S -> R gathers.
        assert_eq!(reshard_time(bytes, &r, &s, &m), 0.0);
        assert!(reshard_time(bytes, &s, &r, &m) > 0.0);
        // Moving the split to another axis is an all-to-all, cheaper than gathering.
        let moved = Spec(vec![AxisSplit::R, AxisSplit::S1]);
        let on1 = Spec(vec![AxisSplit::S1, AxisSplit::R]);
        let a2a = reshard_time(bytes, &on1, &moved, &m);
        let gather = reshard_time(bytes, &on1, &r, &m);
        assert!(a2a > 0.0 && a2a < gather);
    }

    #[test]
    fn a_split_over_both_mesh_axes_moves_by_one_whole_mesh_all_to_all() {
        // On links of one kind, S01 -> S01 of another tensor axis costs what the flat
        // all-to-all over all 8 devices costs, plus one more start-up latency for its second
        // step; each device keeps 1/8 of its tile and sends the rest.
        let m = mesh(2, 4);
        let bytes = 16.0 * 8.0 * 4.0;
        let rows = Spec(vec![AxisSplit::S01, AxisSplit::R]);
        let cols = Spec(vec![AxisSplit::R, AxisSplit::S01]);
        let steps = reshard_steps(bytes, &rows, &cols, &m);
        assert_eq!(steps.len(), 2);
        let link = m.links[0];
        let flat = collective_time(Collective::AllToAll, 8, bytes, link);
        let tile = bytes / 8.0;
        assert!((flat - (link.latency + 7.0 / 8.0 * tile / link.pairwise_bandwidth)).abs() < 1e-18);
        assert!((steps_time(&steps) - (flat + link.latency)).abs() < 1e-15);
        // Across nodes, axis 0's link carries what an all-to-all along axis 0 alone would.
        let along_0 = Spec(vec![AxisSplit::S0, AxisSplit::R]);
        let moved_0 = Spec(vec![AxisSplit::R, AxisSplit::S0]);
        let alone = reshard_steps(bytes / 4.0, &along_0, &moved_0, &m);
        assert_eq!(alone[0].seconds, steps[0].seconds);
    }

    #[test]
    fn a_split_moves_by_all_to_all_only_where_the_minor_axis_leaves_it_whole_blocks() {
        let m = mesh(2, 4);
        let bytes = 16.0 * 8.0 * 4.0;
        let kinds = |from: &str, to: &str| -> Vec<(Collective, usize)> {
            let (from, to) = (from.parse::<Spec>(), to.parse::<Spec>());
            let (Ok(from), Ok(to)) = (from, to) else {
                panic!("specs");
            };
            reshard_steps(bytes, &from, &to, &m)
                .iter()
                .map(|s| (s.kind, s.axis))
                .collect()
        };
        use Collective::{AllGather, AllToAll};
        // Rows over both axes to columns over axis 0, rows over axis 1: the groups along axis
        // 0 hold rows i and 4 + i, not a block, so every split is gathered and sliced again.
        assert_eq!(kinds("S01R", "S1S0"), [(AllGather, 0), (AllGather, 1)]);
        // Rows over both to rows over axis 0, columns over axis 1: the minor axis moves alone.
        assert_eq!(kinds("S01R", "S0S1"), [(AllToAll, 1)]);
        // Axis 0 moves rows to columns while axis 1 keeps splitting rows: gathered.
        assert_eq!(kinds("S0S1", "S1S0"), [(AllGather, 0), (AllGather, 1)]);
        // Nothing on the minor axis: one all-to-all along axis 0.
        assert_eq!(kinds("S0R", "RS0"), [(AllToAll, 0)]);
        // Both axes: one all-to-all over the whole mesh, priced as a step per axis.
        assert_eq!(kinds("S01R", "RS01"), [(AllToAll, 0), (AllToAll, 1)]);
    }

    #[test]
    fn partial_sums_reduce_scatter_into_a_split_and_all_reduce_otherwise() {
        let m = mesh(2, 4);
        let bytes = 16.0 * 8.0 * 2.0;
        let r = Spec::replicated(2);
        let kinds = |to: &Spec| -> Vec<(Collective, usize)> {
            reduce_steps(bytes, 0b10, &r, to, &m)
                .iter()
                .map(|s| (s.kind, s.axis))
                .collect()
        };
        assert_eq!(kinds(&r), [(Collective::AllReduce, 1)]);
        let split = Spec(vec![AxisSplit::S1, AxisSplit::R]);
        assert_eq!(kinds(&split), [(Collective::ReduceScatter, 1)]);
        // A split on the other axis is a slice after the all-reduce: no further collective.
        let other = Spec(vec![AxisSplit::S0, AxisSplit::R]);
        assert_eq!(kinds(&other), [(Collective::AllReduce, 1)]);
        // Partial along axis 0, rows split along axis 1, wanted over both: the rows are
        // gathered along axis 1, reduce-scattered along axis 0, then sliced again.
        let rows_1 = Spec(vec![AxisSplit::S1, AxisSplit::R]);
        let both = Spec(vec![AxisSplit::S01, AxisSplit::R]);
        let steps = reduce_steps(bytes, 0b01, &rows_1, &both, &m);
        let kinds: Vec<(Collective, usize)> = steps.iter().map(|s| (s.kind, s.axis)).collect();
        assert_eq!(
            kinds,
            [(Collective::AllGather, 1), (Collective::ReduceScatter, 0)]
        );
        assert_eq!(steps[1].bytes, bytes);
        // Rows split along axis 0 and the partial sum along axis 1: scattered in place.
        let rows_0 = Spec(vec![AxisSplit::S0, AxisSplit::R]);
        let steps = reduce_steps(bytes, 0b10, &rows_0, &both, &m);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].kind, Collective::ReduceScatter);
    }
}
