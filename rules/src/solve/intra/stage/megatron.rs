//! Megatron-LM's layout as one point of the intra-op space: on a `dp x tp` logical mesh (axis
//! 0 data-parallel, axis 1 tensor-parallel), every op, parameter and entering tensor pinned to
//! the spec Megatron-LM gives it (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence
//! parallelism; Rajbhandari et al. 2020 for the distributed optimizer).
//!
//! A tensor's spec as an op sees it: the batch axis of every activation and gradient split
//! over the data-parallel axis; over the tensor-parallel axis, the axis the tensor's split
//! names as that op reads or writes it ([`divided_axis_in_op`]): model-split tensors always,
//! sequence-split ones under sequence parallelism outside the model-parallel ops (which read
//! them gathered and write them reduced). Weights are replicated over the data-parallel axis;
//! their optimizer states too, or split over it under the distributed optimizer.

use super::StageModel;
use crate::cost::sharding::{AxisSplit, Spec};
use crate::cost::tensor_parallel::{TpConfig, divided_axis_in_op, stored_divided_axis};
use crate::model::graph::{Op, OpKind, TensorId, TensorKind};

/// Megatron-LM's options that decide its sharding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MegatronSharding {
    /// Sequence parallelism.
    pub sp: bool,
    /// Optimizer states split over the data-parallel group (`--use-distributed-optimizer`,
    /// ZeRO-1).
    pub distributed_optimizer: bool,
}

/// Why Megatron-LM's layout is not a point of this problem.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PinError {
    /// No strategy of an op reads and writes Megatron-LM's specs.
    #[error(
        "op `{op}` has no strategy with Megatron-LM's specs (reads {inputs}, writes {outputs})"
    )]
    Op {
        /// Op name.
        op: String,
        /// The specs wanted for its operands.
        inputs: String,
        /// The specs wanted for its results.
        outputs: String,
    },
    /// Megatron-LM's spec of an operand splits a dimension by more than it holds (a
    /// tensor-parallel degree above the number of KV heads, say): Megatron-LM refuses such a
    /// layout too.
    #[error(
        "op `{op}`: Megatron-LM would split `{tensor}` {shape} as {spec}, which does not divide it \
         on this mesh"
    )]
    Indivisible {
        /// Op name.
        op: String,
        /// The operand.
        tensor: String,
        /// Its shape.
        shape: String,
        /// The spec wanted.
        spec: String,
    },
    /// A parameter cannot be held as Megatron-LM holds it.
    #[error("parameter `{name}` cannot be held as {spec} on this mesh")]
    Parameter {
        /// Parameter name.
        name: String,
        /// The spec wanted.
        spec: String,
    },
    /// A tensor entering the range cannot arrive as Megatron-LM has it.
    #[error("tensor `{name}` cannot enter the range as {spec} on this mesh")]
    Source {
        /// Tensor name.
        name: String,
        /// The spec wanted.
        spec: String,
    },
}

fn joined(specs: &[Spec]) -> String {
    specs
        .iter()
        .map(|s| s.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl StageModel<'_> {
    /// The tensor-parallel configuration the mesh stands for.
    fn tp_config(&self, m: MegatronSharding) -> TpConfig {
        TpConfig::dense(self.mesh.shape[1], m.sp)
    }

    /// Megatron-LM's spec of `t` with `divided` its axis split over the tensor-parallel group.
    fn megatron_spec(&self, t: TensorId, divided: Option<usize>) -> Spec {
        let tensor = self.graph.tensor(t);
        let mut spec = Spec::replicated(tensor.shape.len());
        let weight = matches!(
            tensor.kind,
            TensorKind::Parameter | TensorKind::WeightGradient
        );
        // The batch axis, where there is one (not the scalar loss).
        if self.mesh.shape[0] > 1 && !weight && !spec.0.is_empty() {
            spec.0[0] = AxisSplit::S0;
            if !spec.valid_for(&tensor.shape, &self.mesh) {
                spec.0[0] = AxisSplit::R;
            }
        }
        if self.mesh.shape[1] > 1
            && let Some(a) = divided
            && let Some(s) = spec.0.get_mut(a)
        {
            *s = AxisSplit::from_axes(s.axes() | 2);
        }
        spec
    }

    /// Megatron-LM's spec of `t` as `op` reads or writes it.
    fn spec_in_op(&self, op: &Op, t: TensorId, m: MegatronSharding) -> Spec {
        let divided = divided_axis_in_op(self.graph, op, t, self.tp_config(m));
        self.megatron_spec(t, divided)
    }

    /// Megatron-LM's spec of result `t` of `op` as it leaves the op: a sum the op reduces
    /// itself is reduced into the stored spec (reduce-scattered into sequence shards under
    /// sequence parallelism); one its consumer reduces is as the op writes it.
    fn output_spec(&self, op: &Op, t: TensorId, m: MegatronSharding) -> Spec {
        // An opaque op writes whole results; its consumers slice them.
        if self.deferred.contains(&t) || matches!(op.kind, OpKind::Opaque { .. }) {
            self.spec_in_op(op, t, m)
        } else {
            self.stored_spec(t, m)
        }
    }

    /// Megatron-LM's specs of `op`'s operands as it reads them and of its results as they
    /// leave it.
    fn wanted(&self, op: &Op, m: MegatronSharding) -> (Vec<Spec>, Vec<Spec>) {
        let inputs = op.inputs.iter().map(|&t| self.spec_in_op(op, t, m));
        let outputs = op.outputs.iter().map(|&t| self.output_spec(op, t, m));
        (inputs.collect(), outputs.collect())
    }

    /// Megatron-LM's spec of `t` between ops (as it is stored).
    fn stored_spec(&self, t: TensorId, m: MegatronSharding) -> Spec {
        self.megatron_spec(t, stored_divided_axis(self.graph, t, m.sp))
    }

    /// The choice of every variable that runs the range as Megatron-LM does on this mesh
    /// (read as `dp x tp`), for [`StageModel::decode`].
    pub fn megatron_choice(&self, m: MegatronSharding) -> Result<Vec<usize>, PinError> {
        let g = self.graph;
        let mut choice = vec![usize::MAX; self.var_sizes.len()];
        let no_strategy = |op: &Op, inputs: &[Spec], outputs: &[Spec]| {
            let operands = op
                .inputs
                .iter()
                .zip(inputs)
                .chain(op.outputs.iter().zip(outputs));
            for (&t, spec) in operands {
                let tensor = g.tensor(t);
                if !spec.valid_for(&tensor.shape, &self.mesh) {
                    return PinError::Indivisible {
                        op: op.name.clone(),
                        tensor: tensor.name.clone(),
                        shape: format!("{:?}", tensor.shape),
                        spec: spec.to_string(),
                    };
                }
            }
            PinError::Op {
                op: op.name.clone(),
                inputs: joined(inputs),
                outputs: joined(outputs),
            }
        };
        for node in self.nodes.iter().filter(|n| n.leader.is_none()) {
            let op = g.op(node.op);
            let (inputs, outputs) = self.wanted(op, m);
            // Data every rank holds (token ids, labels) is sliced for free to whatever the op
            // reads, where no strategy reads it as stored.
            let writes = |r: &super::Realized| r.outputs[..outputs.len()] == outputs[..];
            let sliced = |r: &super::Realized| {
                r.inputs
                    .iter()
                    .zip(&inputs)
                    .zip(&op.inputs)
                    .all(|((have, want), &t)| have == want || g.tensor(t).kind == TensorKind::Input)
            };
            let found = node
                .realized
                .iter()
                .position(|r| r.inputs == inputs && writes(r))
                .or_else(|| node.realized.iter().position(|r| sliced(r) && writes(r)));
            choice[node.var] = found.ok_or_else(|| no_strategy(op, &inputs, &outputs))?;
        }
        // Followers take their leader's choice; it must give them Megatron-LM's specs too.
        for node in self.nodes.iter().filter(|n| n.leader.is_some()) {
            let op = g.op(node.op);
            let r = &node.realized[choice[node.var]];
            let (inputs, outputs) = self.wanted(op, m);
            if r.outputs[..outputs.len()] != outputs[..] {
                return Err(no_strategy(op, &inputs, &outputs));
            }
        }
        for p in &self.params {
            let weight = self.stored_spec(p.tensor, m);
            let states = if m.distributed_optimizer {
                self.zero_states(p.tensor, &weight)
            } else {
                Some(weight.clone())
            };
            let found = states.and_then(|states| {
                p.choices
                    .iter()
                    .position(|(w, o)| *w == weight && *o == states)
            });
            choice[p.var] = found.ok_or_else(|| PinError::Parameter {
                name: g.tensor(p.tensor).name.clone(),
                spec: weight.to_string(),
            })?;
        }
        for s in &self.sources {
            let spec = self.stored_spec(s.tensor, m);
            choice[s.var] =
                s.specs
                    .iter()
                    .position(|x| *x == spec)
                    .ok_or_else(|| PinError::Source {
                        name: g.tensor(s.tensor).name.clone(),
                        spec: spec.to_string(),
                    })?;
        }
        Ok(choice)
    }

    /// The weight's spec with the data-parallel axis added on the first tensor axis where it
    /// divides (the distributed optimizer's shard; which axis does not change its cost).
    fn zero_states(&self, t: TensorId, weight: &Spec) -> Option<Spec> {
        if self.mesh.shape[0] <= 1 {
            return Some(weight.clone());
        }
        let shape = &self.graph.tensor(t).shape;
        (0..weight.0.len()).find_map(|a| {
            let mut s = weight.clone();
            s.0[a] = AxisSplit::from_axes(s.0[a].axes() | 1);
            s.valid_for(shape, &self.mesh).then_some(s)
        })
    }

    /// The range run as Megatron-LM runs it on this mesh, priced by the intra-op model.
    pub fn megatron_plan(&self, m: MegatronSharding) -> Result<super::StagePlan, PinError> {
        let start = std::time::Instant::now();
        let choice = self.megatron_choice(m)?;
        let (cost, _) = self.problem.evaluate(&choice);
        let strategies = self.problem.vars.iter().map(|v| v.cost.len()).sum();
        let info = super::SolveInfo {
            solver: "megatron".into(),
            optimal: false,
            gap: 0.0,
            seconds: start.elapsed().as_secs_f64(),
            cost,
            variables: self.problem.vars.len(),
            strategies,
            undominated: strategies,
            edges: self.problem.edges.len(),
            width: 0.0,
            warnings: Vec::new(),
        };
        Ok(self.decode(&choice, info))
    }
}
