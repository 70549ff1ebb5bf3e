//! Profiles for a target: the template of what to measure.

use crate::workspace::{Target, Workspace};
use autopar_rules::estimate::Estimator;
use autopar_rules::profile::Profile;
use autopar_rules::search::pricing_combinations;

/// Every kernel and tensor-parallel collective `t`'s search prices, with the times the
/// analytic model gives them: measure these and put the results in a profile.
pub fn template(ws: &Workspace, t: &Target) -> Profile {
    let model = &ws.models[t.model];
    let cluster = &ws.clusters[t.cluster];
    let est = Estimator::new(&model.name, &model.def, cluster, t.options);
    let mut out = Profile::new(cluster.device.name.clone());
    for (mb, tp, sp) in pricing_combinations(&t.search, cluster.gpus(), t.global_batch) {
        // Combinations that cannot run have nothing to measure.
        if let Ok(p) = est.modelled_profile(mb, tp, sp) {
            out = out.overlaid(&p);
        }
    }
    out
}
