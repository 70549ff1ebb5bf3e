//! `autopar estimate`: price a layout chosen by hand.

use super::print_json;
use crate::Failure;
use crate::args::EstimateArgs;
use crate::output::out;
use crate::render;
use autopar_engine::EngineError;
use autopar_engine::session::Session;
use autopar_engine::workspace::DEFAULT_VOCAB_MULTIPLE;
use autopar_rules::plan::estimate::Estimator;
use autopar_rules::plan::layout::{Layout, Recompute};
use autopar_rules::plan::runtime::GivenSettings;
use serde_json::json;

pub fn run(session: &Session, a: &EstimateArgs) -> Result<(), Failure> {
    let (name, def) = session.model(&a.model)?;
    let cluster = session.cluster(&a.cluster)?;
    if !(0.0..1.0).contains(&a.memory_headroom) {
        return Err(Failure::Input(anyhow::anyhow!(
            "--memory-headroom: expected a fraction in [0, 1), found {}",
            a.memory_headroom
        )));
    }
    let seq = match (a.model_options.seq, def.max_seq()) {
        (Some(s), _) => s,
        (None, Some(m)) => m,
        (None, None) => {
            return Err(Failure::Input(anyhow::anyhow!(
                "--seq: expected a sequence length (the model does not declare max_seq), found nothing"
            )));
        }
    };
    let opts = a.model_options.runtime.options(
        seq,
        Some(a.model_options.precision()),
        Some(a.model_options.attention()),
        a.memory_headroom,
        DEFAULT_VOCAB_MULTIPLE,
        GivenSettings {
            grad_accumulation_fusion: a.no_grad_accumulation_fusion.then_some(false),
            grad_reduce_in_fp32: a.grad_reduce_in_fp32,
            overlap_grad_reduce: a.overlap_grad_reduce,
            overlap_param_gather: a.overlap_param_gather,
            fp32_loss: a.fp32_loss,
            eager_elementwise: a.eager_elementwise,
            fp8: a.fp8.then_some(true),
            tp_comm_overlap: a.tp_comm_overlap,
            backward_prefetch: a.backward_prefetch,
        },
    );
    let gpus = cluster.gpus();
    let dp = match a.dp {
        Some(dp) => dp,
        // The default must use the cluster exactly (clap bounds tp and pp, so the product
        // cannot overflow); say so here rather than report a zero dp from the layout check.
        None if gpus % (a.tp * a.cp * a.pp) == 0 => gpus / (a.tp * a.cp * a.pp),
        None => {
            return Err(Failure::Input(anyhow::anyhow!(
                "--tp {} x --cp {} x --pp {}: expected a product that divides the {gpus} GPUs \
                 of `{}`, found {}; pass --dp, or degrees that fit",
                a.tp,
                a.cp,
                a.pp,
                a.cluster,
                a.tp * a.cp * a.pp
            )));
        }
    };
    let moe = def.transformer().is_some_and(|c| c.moe.is_some());
    let layout = Layout {
        cp: a.cp,
        cp_comm: a.cp_comm_type.into(),
        ep: a.ep,
        etp: a.etp.unwrap_or(if moe { a.tp } else { 1 }),
        tp: a.tp,
        pp: a.pp,
        dp,
        micro_batch: a.mbs,
        global_batch: a.gbs,
        interleave: a.vp,
        sequence_parallel: a.sp,
        recompute: a.recompute.into(),
        zero: a.zero,
    };
    // A workspace cluster's measured times price the layout as `autopar build` prices it.
    let measured = if a.cluster.contains(':') {
        None
    } else {
        session.workspace()?.cluster_profile(&a.cluster)
    };
    let est =
        Estimator::new(&name, &def, &cluster, opts).with_profile(measured.as_ref().map(|(_, p)| p));
    let (e, attempts) = match (a.balance, a.recompute_num_layers) {
        (true, _) => {
            let r = est.refine(&layout).map_err(EngineError::from)?;
            (r.estimate, r.attempts)
        }
        (false, Some(n)) => {
            if layout.recompute != Recompute::Full {
                return Err(Failure::Input(anyhow::anyhow!(
                    "--recompute-num-layers: expected --recompute full with it, found \
                     --recompute {}",
                    layout.recompute.name()
                )));
            }
            (
                est.evaluate_recomputing(&layout, n as usize)
                    .map_err(EngineError::from)?,
                Vec::new(),
            )
        }
        (false, None) => (
            est.evaluate(&layout).map_err(EngineError::from)?,
            Vec::new(),
        ),
    };
    if a.json {
        let mut value = serde_json::to_value(&e).map_err(|err| Failure::Failed(err.into()))?;
        if let Some(obj) = value.as_object_mut() {
            obj.insert("model".into(), json!(name));
            obj.insert("cluster".into(), json!(cluster.name));
            obj.insert("seq".into(), json!(seq));
            if a.balance {
                obj.insert("partitions".into(), json!(attempts));
            }
            let names = measured.as_ref().map_or(Vec::new(), |(n, _)| n.clone());
            obj.insert("profiles".into(), json!(names));
        }
        print_json(&value)?;
    } else {
        let mut out = format!(
            "{name} on {}, global batch {} x {seq} tokens, {}\n",
            render::cluster(&cluster),
            a.gbs,
            opts.precision_label()
        );
        out.push_str(&format!(
            "  runtime   {}: {}\n",
            a.model_options.runtime.name(),
            render::runtime_settings(&opts, a.zero)
        ));
        if let Some((names, _)) = &measured {
            out.push_str(&format!(
                "  profiles  {} (measured times where they have the kernel, the model elsewhere)\n",
                names.join(", ")
            ));
        }
        render::estimate(&mut out, &e);
        render::stages(&mut out, &e);
        render::attempts(&mut out, &attempts);
        out!("{out}");
    }
    if e.fits {
        Ok(())
    } else {
        Err(Failure::Failed(anyhow::anyhow!(
            "the layout needs {:.1} GiB per device but {} has {:.1} GiB usable",
            e.memory_per_device_gib,
            cluster.device.name,
            e.memory_capacity / autopar_rules::cost::cluster::GIB
        )))
    }
}
