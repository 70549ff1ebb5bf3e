//! Context parallelism: every sequence split over `cp` ranks, as Megatron-Core's
//! `--context-parallel-size` does it.
//!
//! Each rank holds `seq / cp` tokens of every activation, so everything but the attention core
//! runs on its share of the tokens and saves `1 / cp` of the activations. With causal
//! attention the sequence is cut into `2 cp` chunks and rank `i` holds chunks `i` and
//! `2 cp - 1 - i` (Megatron-Core's load balancing), so every rank does the same attention work:
//! its queries against all the keys before them, `cp` times the work of causal attention over
//! its own `seq / cp` tokens. What moves between the ranks depends on `--cp-comm-type`:
//!
//! | type        | forward                                     | backward                                   |
//! |-------------|---------------------------------------------|--------------------------------------------|
//! | `p2p`       | a ring: `cp - 1` steps, each sending this rank's K and V block to the next rank while the current block is attended (Liu et al. 2023, Ring Attention; Megatron-Core's `AttnFuncWithCPAndKVP2P`) | the same ring with K, V and their gradients, each step overlapped with one block's backward |
//! | `a2a`       | all-to-all of Q, K and V (tokens split -> heads split) and of the output back (Jacobs et al. 2023, DeepSpeed-Ulysses) | the same four all-to-alls on the gradients |
//! | `allgather` | all-gather of K and V                        | all-gather of K and V again, reduce-scatter of their gradients |
//! | `a2a+p2p`   | Ulysses inside each node's share of the group, then a ring over those shares (Megatron-Core's hierarchical context parallelism; Fang and Zhao 2024, USP) | both, on the gradients |
//!
//! A ring step's transfer hides behind the step's attention block; only its excess is exposed.
//! The all-to-alls and gathers are on the critical path. Gradients of the weights are reduced
//! over the data- and context-parallel ranks together, and the distributed optimizer shards
//! over that group (Megatron-Core's `data_parallel_group_with_cp`).

use crate::cost::analytic::{Collective, collective_time, p2p_time};
use crate::cost::cluster::{Cluster, Link};
use serde::{Deserialize, Serialize};

/// How context-parallel ranks exchange keys and values (Megatron-Core's `--cp-comm-type`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub enum CpComm {
    /// A ring of point-to-point transfers overlapped with blockwise attention.
    #[default]
    #[serde(rename = "p2p")]
    P2p,
    /// All-to-all between a sequence split and a head split (Ulysses).
    #[serde(rename = "a2a")]
    A2a,
    /// All-gather of keys and values.
    #[serde(rename = "allgather")]
    AllGather,
    /// All-to-all inside a node, a ring across nodes (hierarchical).
    #[serde(rename = "a2a+p2p")]
    A2aP2p,
}

impl CpComm {
    /// Every type, in the order of Megatron-Core's documentation.
    pub const ALL: [CpComm; 4] = [CpComm::P2p, CpComm::A2a, CpComm::AllGather, CpComm::A2aP2p];

    /// Name as Megatron-Core's `--cp-comm-type` spells it.
    pub fn name(self) -> &'static str {
        match self {
            CpComm::P2p => "p2p",
            CpComm::A2a => "a2a",
            CpComm::AllGather => "allgather",
            CpComm::A2aP2p => "a2a+p2p",
        }
    }

    /// Parses `p2p`, `a2a` or `allgather`.
    pub fn parse(s: &str) -> Option<CpComm> {
        CpComm::ALL.into_iter().find(|c| c.name() == s)
    }

    /// The accepted names, for error messages.
    pub fn names() -> String {
        CpComm::ALL.map(CpComm::name).join(", ")
    }
}

/// The context-parallel part of a layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct CpConfig {
    /// Ranks each sequence is split over.
    pub c: u64,
    /// How they exchange keys and values.
    pub comm: CpComm,
}

impl CpConfig {
    /// No context parallelism.
    pub const NONE: CpConfig = CpConfig {
        c: 1,
        comm: CpComm::P2p,
    };
}

/// Where a context-parallel group's ranks sit: Megatron-Core places them `tp` apart
/// (tp-cp-dp-pp rank order), so the group crosses nodes when `tp x cp` exceeds a node.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CpGroups {
    /// Links of the whole group: the ring of `p2p`, the all-to-alls of `a2a`, the gathers.
    pub all: Link,
    /// Under `a2a+p2p`: ranks of each all-to-all (the group's ranks inside one node, Megatron-
    /// Core's first `--hierarchical-context-parallel-sizes` level).
    pub inner: u64,
    /// Their link.
    pub inner_link: Link,
    /// The link of the ring over the all-to-all groups.
    pub outer_link: Link,
}

impl CpGroups {
    /// No context parallelism: every link `link` (never used).
    pub fn alone(link: Link) -> CpGroups {
        CpGroups {
            all: link,
            inner: 1,
            inner_link: link,
            outer_link: link,
        }
    }

    /// The groups of `cp` ranks, `tp` apart, on `cluster`.
    pub fn on(cluster: &Cluster, tp: u64, cp: u64) -> CpGroups {
        let inner = hierarchical_inner(tp, cp, cluster.gpus_per_node);
        CpGroups {
            all: cluster.group_link(tp, cp),
            inner,
            inner_link: cluster.group_link(tp, inner),
            outer_link: cluster.group_link(tp.saturating_mul(inner), cp / inner.max(1)),
        }
    }
}

/// The all-to-all level of hierarchical context parallelism: the largest divisor of `cp`
/// whose ranks, `tp` apart, fit in a node of `gpus_per_node`.
pub fn hierarchical_inner(tp: u64, cp: u64, gpus_per_node: u64) -> u64 {
    (1..=cp.max(1))
        .rev()
        .find(|a| cp % a == 0 && tp.saturating_mul(*a) <= gpus_per_node.max(1))
        .unwrap_or(1)
}

/// One attention core on one rank, as [`attention`] prices it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpAttention {
    /// Forward kernel time over all the keys, s.
    pub fwd_compute: f64,
    /// Backward kernel time over all the keys, s.
    pub bwd_compute: f64,
    /// Forward communication not hidden behind the kernels, s.
    pub fwd_comm: f64,
    /// Backward communication not hidden behind the kernels, s.
    pub bwd_comm: f64,
}

/// Bytes one rank holds of an attention core's operands (its `seq / cp` tokens, its
/// tensor-parallel share of the heads).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionBytes {
    /// Queries.
    pub q: f64,
    /// Keys and values together.
    pub kv: f64,
    /// The output.
    pub out: f64,
}

/// The attention core of one rank under `cfg`, from its kernel times over the rank's own
/// tokens (`fwd_local`, `bwd_local`: causal attention over `seq / cp` tokens), the bytes it
/// holds, and where the context-parallel group's ranks sit.
pub fn attention(
    cfg: CpConfig,
    fwd_local: f64,
    bwd_local: f64,
    bytes: AttentionBytes,
    groups: CpGroups,
) -> CpAttention {
    let link = groups.all;
    let c = cfg.c.max(1);
    let cf = c as f64;
    let (fwd_compute, bwd_compute) = (fwd_local * cf, bwd_local * cf);
    if c == 1 {
        return CpAttention {
            fwd_compute,
            bwd_compute,
            fwd_comm: 0.0,
            bwd_comm: 0.0,
        };
    }
    let steps = cf - 1.0;
    let (fwd_comm, bwd_comm) = match cfg.comm {
        // Each of the `cp` ring steps attends one block (a `1 / cp` share of the work) while
        // the next block travels.
        CpComm::P2p => (
            steps * (p2p_time(bytes.kv, link) - fwd_local).max(0.0),
            steps * (p2p_time(2.0 * bytes.kv, link) - bwd_local).max(0.0),
        ),
        // A rank's share of a tensor is 1/cp of what the all-to-all moves in all.
        CpComm::A2a => {
            let a2a = |b: f64| collective_time(Collective::AllToAll, c, b * cf, link);
            let four = a2a(bytes.q) + a2a(bytes.kv) + a2a(bytes.out);
            (four, four)
        }
        CpComm::AllGather => {
            let gather = collective_time(Collective::AllGather, c, bytes.kv * cf, link);
            let scatter = collective_time(Collective::ReduceScatter, c, bytes.kv * cf, link);
            (gather, gather + scatter)
        }
        // Ulysses over the `a` ranks inside a node (each then holds a/cp of the tokens and
        // 1/a of the heads: as many bytes as before), then a ring of `cp / a` steps, each
        // attending `a` of the rank's own blocks while the next travels.
        CpComm::A2aP2p => {
            let a = groups.inner.clamp(1, c);
            let af = a as f64;
            let a2a = |b: f64| collective_time(Collective::AllToAll, a, b * af, groups.inner_link);
            let four = a2a(bytes.q) + a2a(bytes.kv) + a2a(bytes.out);
            let ring = (c / a) as f64 - 1.0;
            let out = groups.outer_link;
            (
                four + ring * (p2p_time(bytes.kv, out) - af * fwd_local).max(0.0),
                four + ring * (p2p_time(2.0 * bytes.kv, out) - af * bwd_local).max(0.0),
            )
        }
    };
    CpAttention {
        fwd_compute,
        bwd_compute,
        fwd_comm,
        bwd_comm,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> Link {
        Link {
            latency: 1e-5,
            bandwidth: 100e9,
            pairwise_bandwidth: 50e9,
            nodes: 2,
        }
    }

    fn groups(inner: u64) -> CpGroups {
        CpGroups {
            all: link(),
            inner,
            inner_link: link(),
            outer_link: link(),
        }
    }

    const BYTES: AttentionBytes = AttentionBytes {
        q: 8e6,
        kv: 4e6,
        out: 8e6,
    };

    #[test]
    fn one_rank_is_the_plain_attention() {
        let a = attention(CpConfig::NONE, 1e-3, 2.5e-3, BYTES, groups(1));
        assert_eq!((a.fwd_compute, a.bwd_compute), (1e-3, 2.5e-3));
        assert_eq!((a.fwd_comm, a.bwd_comm), (0.0, 0.0));
    }

    #[test]
    fn a_ring_hides_what_a_block_outlasts() {
        let cfg = CpConfig {
            c: 4,
            comm: CpComm::P2p,
        };
        // A block's transfer takes 1e-5 + 4e6 / 50e9 = 9e-5 s.
        let slow = attention(cfg, 1e-3, 2.5e-3, BYTES, groups(1));
        assert_eq!((slow.fwd_compute, slow.bwd_compute), (4e-3, 1e-2));
        assert_eq!((slow.fwd_comm, slow.bwd_comm), (0.0, 0.0));
        let fast = attention(cfg, 5e-5, 1e-4, BYTES, groups(1));
        assert!((fast.fwd_comm - 3.0 * (9e-5 - 5e-5)).abs() < 1e-15);
        assert!((fast.bwd_comm - 3.0 * (1e-5 + 8e6 / 50e9 - 1e-4)).abs() < 1e-15);
    }

    #[test]
    fn ulysses_moves_three_quarters_of_each_tensor_away() {
        let cfg = CpConfig {
            c: 4,
            comm: CpComm::A2a,
        };
        let a = attention(cfg, 1e-3, 2.5e-3, BYTES, groups(1));
        // Each all-to-all sends 3/4 of the rank's share at the pairwise bandwidth.
        let want = 3.0 * 1e-5 + 0.75 * (8e6 + 4e6 + 8e6) / 50e9;
        assert!((a.fwd_comm - want).abs() < 1e-15, "{}", a.fwd_comm);
        assert_eq!(a.fwd_comm, a.bwd_comm);
    }

    #[test]
    fn hierarchical_is_ulysses_or_a_ring_at_its_ends() {
        let at = |comm, inner| attention(CpConfig { c: 4, comm }, 5e-5, 1e-4, BYTES, groups(inner));
        // Every rank in one node: all-to-all only; one rank per node: a ring only.
        assert_eq!(at(CpComm::A2aP2p, 4), at(CpComm::A2a, 4));
        assert_eq!(at(CpComm::A2aP2p, 1), at(CpComm::P2p, 1));
        // Two levels of two: one all-to-all level of 2, one ring step hidden behind two blocks.
        let h = at(CpComm::A2aP2p, 2);
        let a2a = 3.0 * 1e-5 + 0.5 * (8e6 + 4e6 + 8e6) / 50e9;
        assert!((h.fwd_comm - a2a).abs() < 1e-15, "{}", h.fwd_comm);
        // cp 4 with ranks tp apart in nodes of 8: all inside a node at tp 2, pairs at tp 4,
        // one per node at tp 8.
        assert_eq!(hierarchical_inner(2, 4, 8), 4);
        assert_eq!(hierarchical_inner(4, 4, 8), 2);
        assert_eq!(hierarchical_inner(8, 4, 8), 1);
    }

    #[test]
    fn names_round_trip() {
        for c in CpComm::ALL {
            assert_eq!(CpComm::parse(c.name()), Some(c));
        }
        assert_eq!(CpComm::parse("ring"), None);
    }
}
