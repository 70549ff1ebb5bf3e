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
//!
//! A ring step's transfer hides behind the step's attention block; only its excess is exposed.
//! The all-to-alls and gathers are on the critical path. Gradients of the weights are reduced
//! over the data- and context-parallel ranks together, and the distributed optimizer shards
//! over that group (Megatron-Core's `data_parallel_group_with_cp`).

use crate::cost::analytic::{Collective, collective_time, p2p_time};
use crate::cost::cluster::Link;
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
}

impl CpComm {
    /// Every type, in the order of Megatron-Core's documentation.
    pub const ALL: [CpComm; 3] = [CpComm::P2p, CpComm::A2a, CpComm::AllGather];

    /// Name as Megatron-Core's `--cp-comm-type` spells it.
    pub fn name(self) -> &'static str {
        match self {
            CpComm::P2p => "p2p",
            CpComm::A2a => "a2a",
            CpComm::AllGather => "allgather",
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
/// holds, and the context-parallel group's link.
pub fn attention(
    cfg: CpConfig,
    fwd_local: f64,
    bwd_local: f64,
    bytes: AttentionBytes,
    link: Link,
) -> CpAttention {
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
            internode: true,
        }
    }

    const BYTES: AttentionBytes = AttentionBytes {
        q: 8e6,
        kv: 4e6,
        out: 8e6,
    };

    #[test]
    fn one_rank_is_the_plain_attention() {
        let a = attention(CpConfig::NONE, 1e-3, 2.5e-3, BYTES, link());
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
        let slow = attention(cfg, 1e-3, 2.5e-3, BYTES, link());
        assert_eq!((slow.fwd_compute, slow.bwd_compute), (4e-3, 1e-2));
        assert_eq!((slow.fwd_comm, slow.bwd_comm), (0.0, 0.0));
        let fast = attention(cfg, 5e-5, 1e-4, BYTES, link());
        assert!((fast.fwd_comm - 3.0 * (9e-5 - 5e-5)).abs() < 1e-15);
        assert!((fast.bwd_comm - 3.0 * (1e-5 + 8e6 / 50e9 - 1e-4)).abs() < 1e-15);
    }

    #[test]
    fn ulysses_moves_three_quarters_of_each_tensor_away() {
        let cfg = CpConfig {
            c: 4,
            comm: CpComm::A2a,
        };
        let a = attention(cfg, 1e-3, 2.5e-3, BYTES, link());
        // Each all-to-all sends 3/4 of the rank's share at the pairwise bandwidth.
        let want = 3.0 * 1e-5 + 0.75 * (8e6 + 4e6 + 8e6) / 50e9;
        assert!((a.fwd_comm - want).abs() < 1e-15, "{}", a.fwd_comm);
        assert_eq!(a.fwd_comm, a.bwd_comm);
    }

    #[test]
    fn names_round_trip() {
        for c in CpComm::ALL {
            assert_eq!(CpComm::parse(c.name()), Some(c));
        }
        assert_eq!(CpComm::parse("ring"), None);
    }
}
