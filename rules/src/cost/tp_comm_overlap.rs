//! Tensor-parallel communication overlapped with the products next to it: Transformer Engine's
//! userbuffers (Megatron-Core's `--tp-comm-overlap`, NeMo's `tp_comm_overlap`), which need
//! sequence parallelism (the all-gathers and reduce-scatters it brings; an all-reduce is never
//! overlapped).
//!
//! Transformer Engine runs each of a transformer block's tensor-parallel products with its
//! collective in one of two ways (`transformer_engine/common/comm_gemm_overlap`, and the
//! per-layer methods of NeMo's `tp_overlap_configs/userbuffers.py`):
//!
//! | collective                                          | method          | what hides it |
//! |-----------------------------------------------------|-----------------|---------------|
//! | all-gather of a column-parallel product's input (`qkv_fprop`, `fc1_fprop`) | ring exchange | the product itself |
//! | all-gather of a row-parallel product's output gradient (`proj_dgrad`, `fc2_dgrad`) | ring exchange | the input-gradient product |
//! | reduce-scatter of a row-parallel product's output (`proj_fprop`, `fc2_fprop`) | ring exchange or pipelined chunks | the product itself |
//! | reduce-scatter of a column-parallel product's input gradient (`qkv_dgrad`, `fc1_dgrad`) | bulk | the weight-gradient product |
//! | all-gather of a column-parallel product's saved input for its weight gradient (`qkv_wgrad`, `fc1_wgrad`) | bulk | the input-gradient product (priced so with or without userbuffers: Megatron-LM issues it asynchronously) |
//!
//! A **ring exchange** over `n` ranks splits the product into `n` chunks: the rank computes the
//! chunk it holds while the next arrives from its neighbour, so `n - 1` steps each take the
//! longer of a chunk's product and one step's transfer, and the last chunk's product follows.
//! The transfers run on the copy engines (one SM at most, not priced). A **bulk** overlap runs
//! the whole collective beside an independent product: only what the collective takes beyond
//! that product is exposed. The SMs a bulk or pipelined collective takes from the product it
//! runs beside (2 to 24 of an H100's 132 in NeMo's configurations) are not priced, nor is a
//! chunk's lower matrix-unit efficiency: both make these figures a lower bound.

/// How userbuffers overlap a collective with a product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Userbuffers {
    /// Split into one chunk per rank, each step's transfer beside a chunk's product.
    RingExchange,
    /// The whole collective beside an independent product.
    Bulk,
}

impl Userbuffers {
    /// What a collective taking `comm` seconds over `ranks` ranks leaves exposed beside a
    /// product of `product` seconds.
    pub fn exposed(self, comm: f64, product: f64, ranks: u64) -> f64 {
        match self {
            Userbuffers::Bulk => (comm - product).max(0.0),
            Userbuffers::RingExchange if ranks > 1 => {
                let steps = (ranks - 1) as f64;
                let chunk = product / ranks as f64;
                steps * (comm / steps - chunk).max(0.0)
            }
            Userbuffers::RingExchange => comm,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ring exchange step by step: chunk `k`'s product starts once it has arrived and the
    /// previous chunk's product is done; chunk `k + 1` arrives one transfer after chunk `k`.
    fn simulated_ring(comm: f64, product: f64, ranks: u64) -> f64 {
        let steps = (ranks - 1) as f64;
        let (transfer, chunk) = (comm / steps, product / ranks as f64);
        let (mut arrived, mut done) = (0.0f64, 0.0f64);
        for k in 0..ranks {
            if k > 0 {
                arrived += transfer;
            }
            done = done.max(arrived) + chunk;
        }
        done - product
    }

    #[test]
    fn the_ring_exchange_exposes_what_a_step_by_step_ring_leaves() {
        for ranks in [2u64, 4, 8] {
            for (comm, product) in [(1.0, 0.1), (1.0, 1.0), (0.2, 1.0), (1.0, 3.0), (0.0, 1.0)] {
                let exposed = Userbuffers::RingExchange.exposed(comm, product, ranks);
                let simulated = simulated_ring(comm, product, ranks);
                assert!(
                    (exposed - simulated).abs() < 1e-12,
                    "{ranks} ranks, comm {comm}, product {product}: {exposed} vs {simulated}"
                );
                assert!(exposed <= comm + 1e-12);
            }
        }
        // A product long enough hides the transfers but the first chunk's; none hides a
        // ring of one rank.
        assert_eq!(Userbuffers::RingExchange.exposed(0.3, 8.0, 4), 0.0);
        assert_eq!(Userbuffers::RingExchange.exposed(0.3, 8.0, 1), 0.3);
    }

    #[test]
    fn a_bulk_overlap_exposes_what_outlasts_the_product() {
        assert_eq!(Userbuffers::Bulk.exposed(1.0, 0.25, 4), 0.75);
        assert_eq!(Userbuffers::Bulk.exposed(0.5, 2.0, 4), 0.0);
    }
}
