//! Layer costs through the cache: every layer's cost is looked up under the key of exactly what
//! it depends on (its canonical subgraph, parallelism, device, kernel options and the profile
//! measurements it reads), so identical blocks, other targets and later builds share it.

use crate::cache::{Cache, Source, kind};
use crate::record::LayerRecord;
use autopar_rules::canonical::{Digest, digest};
use autopar_rules::cost::layer_cost::{LayerCost, LayerCostContext, Pricing};
use autopar_rules::plan::estimate::CostSource;
use autopar_store::EntryMeta;
use std::collections::HashSet;
use std::sync::Mutex;

/// A [`CostSource`] backed by a [`Cache`], remembering what each distinct layer cost did.
pub struct CachedCosts<'c> {
    cache: &'c Cache,
    model: String,
    records: Mutex<Vec<LayerRecord>>,
    seen: Mutex<HashSet<(String, Digest)>>,
}

impl<'c> CachedCosts<'c> {
    /// Layer costs of model `model` (named in descriptions) through `cache`.
    pub fn new(cache: &'c Cache, model: &str) -> Self {
        CachedCosts {
            cache,
            model: model.to_string(),
            records: Mutex::new(Vec::new()),
            seen: Mutex::new(HashSet::new()),
        }
    }

    /// One record per distinct (slot, key) asked for so far, in request order (taken: a
    /// second call returns only what was asked for since).
    pub fn take_records(&self) -> Vec<LayerRecord> {
        std::mem::take(&mut *lock(&self.records))
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CostSource for CachedCosts<'_> {
    fn layer_costs(&self, ctx: &LayerCostContext<'_>, p: &Pricing<'_>) -> Vec<LayerCost> {
        let g = ctx.graph();
        let parallel = format!(
            "mb {} · tp {}{}{}",
            g.micro_batch,
            p.tp.t,
            if p.tp.sp { " sp" } else { "" },
            if p.cp.c > 1 {
                format!(" · cp {} {}", p.cp.c, p.cp.comm.name())
            } else {
                String::new()
            }
        );
        (0..g.layers.len())
            .map(|li| {
                let parts = ctx.key_parts(li, p);
                let key = parts.key();
                let layer = &g.layers[li];
                let (mut cost, source) = self.cache.get_or_solve(
                    kind::LAYER_COST,
                    key,
                    || {
                        let (ops, colls) = ctx.signatures(li, p);
                        let mut reads: Vec<[u8; 32]> = ops.iter().map(|s| digest(s).0).collect();
                        reads.extend(colls.iter().map(|s| digest(s).0));
                        EntryMeta {
                            kind: "layer-cost".into(),
                            description: format!(
                                "{} ({}) of {} · {parallel} · {}",
                                layer.name,
                                layer.kind.name(),
                                self.model,
                                p.device.name
                            ),
                            reads,
                            ..EntryMeta::default()
                        }
                    },
                    || ctx.cost(li, p),
                );
                // Which layer owns a borrowed weight depends on where this layer sits, which
                // its key leaves out.
                cost.borrowed_params = ctx.borrowed(li, p.tp);
                // One record per distinct cost in each parallel setting: the first layer that
                // asked names the slot.
                let slot_kind = format!("{} · {parallel}", layer.kind.name());
                if lock(&self.seen).insert((slot_kind, key)) {
                    lock(&self.records).push(LayerRecord {
                        slot: format!("{} · {parallel}", layer.name),
                        parts,
                        reads: ctx.profile_reads(li, p),
                        source,
                        reasons: Vec::new(),
                    });
                }
                if source == Source::Solved {
                    tracing::debug!(layer = %layer.name, %parallel, "layer cost solved");
                }
                cost
            })
            .collect()
    }
}
