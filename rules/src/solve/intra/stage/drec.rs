//! D-Rec on a layer range: what each strategy of the range's variables cuts on each mesh
//! axis, and the plan read back ([`crate::solve::intra::drec`]).

use super::{IntraError, Realized, SolveInfo, StageModel, StagePlan};
use crate::cost::sharding::Spec;
use crate::model::graph::Op;
use crate::solve::intra::drec::{self, Cut};
use std::time::Instant;

/// Warnings listed one by one; the rest are counted.
const LISTED_WARNINGS: usize = 10;

/// A mesh axis's code in D-Rec's cuts: `0` for none, else the tensor or loop dimension + 1.
fn code(axis: Option<usize>) -> Cut {
    axis.map_or(0, |i| i as Cut + 1)
}

/// What an operator's strategies cut on each mesh axis: their loop dimensions.
pub(super) fn op_cuts(realized: &[Realized]) -> Vec<[Cut; 2]> {
    realized
        .iter()
        .map(|r| [code(r.assign[0]), code(r.assign[1])])
        .collect()
}

/// What a parameter's strategies cut on each mesh axis: its weight's and its states' tensor
/// axes.
pub(super) fn param_cuts(choices: &[(Spec, Spec)]) -> Vec<[Cut; 2]> {
    choices
        .iter()
        .map(|(w, o)| [0, 1].map(|a| code(w.axis_on(a)) | (code(o.axis_on(a)) << 8)))
        .collect()
}

/// What an entering tensor's specs cut on each mesh axis: its tensor axes.
pub(super) fn source_cuts(specs: &[Spec]) -> Vec<[Cut; 2]> {
    specs
        .iter()
        .map(|spec| [0, 1].map(|a| code(spec.axis_on(a))))
        .collect()
}

impl StageModel<'_> {
    /// Per variable, per strategy, per mesh axis: what the strategy cuts (the loop dimension
    /// of an operator; the tensor axes of a parameter's weight and states; the tensor axis of
    /// an entering tensor), and per variable whether it is an operator. Recorded as the
    /// model made the strategies, where reading them back would walk every strategy's
    /// specs again (20 ms of D-Rec's 150 on a 20,000-op graph on 2x4).
    pub(crate) fn drec_cuts(&self) -> (&[Vec<[Cut; 2]>], &[bool]) {
        (&self.cuts, &self.forced)
    }

    /// The mesh axes D-Rec cuts, the slowest link first (across nodes, then inside them).
    pub(crate) fn drec_levels(&self) -> Vec<usize> {
        let mut axes: Vec<usize> = (0..2).filter(|&a| self.mesh.shape[a] > 1).collect();
        axes.sort_by(|&a, &b| {
            self.mesh.links[a]
                .bandwidth
                .total_cmp(&self.mesh.links[b].bandwidth)
                .then(a.cmp(&b))
        });
        axes
    }

    /// D-Rec's plan with variable `v` limited to `allowed[v]`.
    pub(super) fn solve_drec(
        &self,
        allowed: &[Vec<usize>],
        start: Instant,
    ) -> Result<StagePlan, IntraError> {
        let everything = allowed
            .iter()
            .zip(&self.var_sizes)
            .all(|(a, &k)| a.len() == k);
        let restricted;
        let full = if everything {
            &self.problem
        } else {
            restricted = self.problem.restricted(allowed);
            &restricted
        };
        let (all_cuts, forced) = self.drec_cuts();
        let narrowed: Vec<Vec<[Cut; 2]>>;
        let cuts = if everything {
            all_cuts
        } else {
            narrowed = all_cuts
                .iter()
                .zip(allowed)
                .map(|(c, within)| within.iter().map(|&i| c[i]).collect())
                .collect();
            &narrowed
        };
        let levels = self.drec_levels();
        let outcome = drec::solve(&drec::Input {
            problem: full,
            cuts,
            forced,
            levels: &levels,
            neighbourhoods: true,
        })
        .ok_or_else(|| self.no_fit())?;
        let warnings = self.drec_warnings(&outcome);
        let seconds = start.elapsed().as_secs_f64();
        let choice: Vec<usize> = outcome
            .choice
            .iter()
            .zip(allowed)
            .map(|(&c, within)| within[c])
            .collect();
        Ok(self.decode_drec(&choice, warnings, seconds))
    }

    /// What D-Rec's `outcome` on this range warns of: operators no dimension of which
    /// divides a mesh axis (the first few named), axes left uncut, a repair.
    pub(crate) fn drec_warnings(&self, outcome: &drec::Outcome) -> Vec<String> {
        let g = self.graph;
        // Each variable's op, found in one pass.
        let mut op_of: Vec<Option<&Op>> = Vec::new();
        if !outcome.uncut.is_empty() {
            op_of = vec![None; self.var_sizes.len()];
            for n in self.nodes.iter().filter(|n| n.leader.is_none()) {
                op_of[n.var].get_or_insert(g.op(n.op));
            }
        }
        let uncut: Vec<(&Op, usize)> = outcome
            .uncut
            .iter()
            .filter_map(|&(v, axis)| Some((op_of.get(v).copied().flatten()?, axis)))
            .collect();
        let mut warnings: Vec<String> = uncut
            .iter()
            .take(LISTED_WARNINGS)
            .map(|&(op, axis)| {
                format!(
                    "op `{}` ({}): no dimension divides mesh axis {axis} ({} devices); kept \
                     replicated on it",
                    op.name,
                    op.kind.name(),
                    self.mesh.shape[axis]
                )
            })
            .collect();
        if uncut.len() > LISTED_WARNINGS {
            warnings.push(format!(
                "and {} more ops kept replicated on a mesh axis",
                uncut.len() - LISTED_WARNINGS
            ));
        }
        for &axis in &outcome.skipped {
            warnings.push(format!(
                "no op is cut on mesh axis {axis} ({} devices): the range is replicated \
                 across it",
                self.mesh.shape[axis]
            ));
        }
        if outcome.repaired > 0 {
            warnings.push(format!(
                "D-Rec's plan exceeded the memory budget: {} variables moved to leaner \
                 strategies",
                outcome.repaired
            ));
        }
        warnings
    }

    /// The plan of D-Rec's `choice` (a strategy per variable of the range's problem), found
    /// in `seconds` with `warnings`: not proven optimal.
    pub(crate) fn decode_drec(
        &self,
        choice: &[usize],
        warnings: Vec<String>,
        seconds: f64,
    ) -> StagePlan {
        let p = &self.problem;
        let info = SolveInfo {
            solver: "drec".into(),
            optimal: false,
            gap: 0.0,
            seconds,
            cost: p.evaluate(choice).0,
            variables: p.vars.len(),
            strategies: p.vars.iter().map(|v| v.cost.len()).sum(),
            undominated: p.vars.iter().map(|v| v.cost.len()).sum(),
            edges: p.edges.len(),
            width: 0.0,
            warnings,
        };
        self.decode(choice, info)
    }
}
