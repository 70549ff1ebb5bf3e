//! Exact composition of layer ranges (ALGORITHMS.md §3): the shortest path through per-layer
//! boundary tables equals the intra-op optimum of the whole range, which the property tests
//! of `rules` check against exhaustive search.

use autopar_rules::model::graph::Graph;
use autopar_rules::solve::intra::chain::{
    ChainError, Entry, Extension, LayerTable, best_path, boundary_bytes, compose, decode_range,
    extend_along, extend_linked, layer_table, link, range_tables, ranking, start, steady,
};
use autopar_rules::solve::intra::stage::{
    Phase, SolverChoice, StageModel, StageOptions, StagePlan,
};
use autopar_rules::solve::pipeline::layer_classes;
use autopar_tests::TempWorkspace;
use autopar_tests::sharding::{assert_decoded_as_priced, lower, lower_text, mesh, opaque_mlp};
use std::ops::Range;

fn opts() -> StageOptions<'static> {
    StageOptions {
        microbatches: 4,
        inflight: 2,
        ..StageOptions::default()
    }
}

/// [`opts`] with gradient buffers in fp32 (a wider gradient makes other plans optimal: the
/// gather of a layer's entering activation into its weight-gradient products was once priced
/// differently in a layer's table than in the whole range, and only fp32 buffers showed it).
fn fp32_grads() -> StageOptions<'static> {
    StageOptions {
        grad_reduce_in_fp32: true,
        ..opts()
    }
}

fn whole(g: &Graph, layers: Range<usize>, a: u64, b: u64, opts: StageOptions) -> f64 {
    let (m, c) = mesh(a, b);
    let model = StageModel::build(g, layers.clone(), m, &c.device, opts)
        .unwrap_or_else(|e| panic!("{layers:?}: {e}"));
    model
        .solve()
        .unwrap_or_else(|e| panic!("{layers:?}: {e}"))
        .objective
}

/// The chain's optimum over the range's tables; the plan decoded from its path (each layer
/// solved again with its boundary pinned) must reach the same cost and memory.
fn chained(
    g: &Graph,
    layers: Range<usize>,
    a: u64,
    b: u64,
    opts: StageOptions,
) -> Result<f64, ChainError> {
    let (m, c) = mesh(a, b);
    let tables = range_tables(g, layers.clone(), m, &c.device, opts)?;
    let best = compose(&tables)?;
    // Identical layers share one table, as in the pipeline search.
    let classes = layer_classes(g);
    let refs: Vec<&LayerTable> = layers
        .clone()
        .map(|l| {
            let first = layers
                .clone()
                .find(|&k| classes[k] == classes[l])
                .unwrap_or(l);
            &tables[first - layers.start]
        })
        .collect();
    let (_, states) = best_path(&refs)?.expect("a finite path");
    let plan = decode_range(g, layers.clone(), m, &c.device, opts, &refs, &states)?;
    assert_decoded_as_priced(&plan, &best, &format!("{layers:?} on {a}x{b}"));
    assert_eq!(plan.layers, [layers.start, layers.end]);
    // Identical layers pinned alike are solved once and renamed: the same plan, name for
    // name, as each layer decoded on its own.
    let alone = layers
        .clone()
        .zip(refs.iter().zip(&states))
        .map(|(l, (t, s))| decode_range(g, l..l + 1, m, &c.device, opts, &[t], &[*s]))
        .collect::<Result<Vec<_>, _>>()?;
    let alone = StagePlan::join(alone).expect("layers");
    assert_eq!(plan.ops, alone.ops, "{layers:?} on {a}x{b}");
    assert_eq!(plan.parameters, alone.parameters, "{layers:?} on {a}x{b}");
    assert_eq!(plan.collectives, alone.collectives, "{layers:?} on {a}x{b}");
    // What recomputing the range costs and keeps, read from the tables along the path: the
    // decoded plan's forward pass and activations; the inputs of each layer, sharded at most
    // over the whole mesh (unsharded on one device).
    let (path, _) = best_path(&refs)?.expect("a finite path");
    let per_layer: Vec<_> = refs
        .iter()
        .zip(&states)
        .map(|(t, &[b, a])| t.entry(b, a))
        .collect();
    let sum = per_layer.iter().fold(Entry::ZERO, |x, y| x.plus(*y));
    for (what, got, want) in [
        ("forward", path.forward, plan.forward),
        ("forward per layer", sum.forward, plan.forward),
        ("per-step terms", path.step, plan.step),
        ("per-step collectives", path.sync, step_collectives(&plan)),
        (
            "activations",
            path.activations * opts.inflight as f64,
            plan.memory.activations,
        ),
    ] {
        assert!(
            (got - want).abs() <= 1e-9 * want.abs().max(1e-30),
            "{layers:?} on {a}x{b}: {what} {got} vs the decoded plan's {want}"
        );
    }
    let bytes = boundary_bytes(g);
    for (l, e) in layers.clone().zip(&per_layer) {
        let entering = l.checked_sub(1).map_or(0.0, |p| bytes[p][0]);
        let lowest = entering / (a * b) as f64;
        assert!(
            e.checkpoint >= lowest * (1.0 - 1e-12) && e.checkpoint <= entering * (1.0 + 1e-12),
            "layer {l} on {a}x{b}: checkpoint {} outside [{lowest}, {entering}]",
            e.checkpoint
        );
        if a * b == 1 {
            assert_eq!(e.checkpoint, entering, "layer {l}");
        }
        assert_eq!(e.peak_layer, e.activations);
    }
    Ok(best.cost)
}

/// The seconds of a plan's per-step collectives (gradient sync, updated-weight gathers).
fn step_collectives(plan: &StagePlan) -> f64 {
    plan.collectives
        .iter()
        .filter(|c| c.phase == Phase::Step)
        .map(|c| c.seconds)
        .sum()
}

/// A model file, its micro-batch, the layer ranges and the meshes to compare on.
type Case = (&'static str, u64, Vec<Range<usize>>, Vec<(u64, u64)>);

#[test]
fn chained_layer_tables_equal_the_whole_range_optimum() {
    let mut cases: Vec<Case> = vec![
        (
            "tiny-mlp.graph.json",
            1,
            vec![0..2, 1..3, 2..4, 0..4],
            vec![(1, 1), (1, 2), (2, 1), (2, 2)],
        ),
        (
            "tiny-mlp.graph.json",
            2,
            vec![1..3, 0..4],
            vec![(1, 2), (2, 1)],
        ),
        (
            "gpt2-small.json",
            2,
            vec![0..2, 1..3, 1..5, 12..14],
            vec![(1, 1), (1, 2), (2, 1)],
        ),
    ];
    for mb in [1, 2] {
        cases.push((
            "llama2-7b.json",
            mb,
            vec![0..2, 1..4, 31..34, 0..34],
            vec![(1, 2), (2, 1)],
        ));
    }
    cases.push(("llama2-7b.json", 1, vec![31..33, 32..34], vec![(2, 2)]));
    let mut worst = 0.0f64;
    for (file, mb, ranges, meshes) in cases {
        let g = lower(file, mb, Some(128), 4);
        for ((a, b), o) in meshes
            .iter()
            .flat_map(|&m| [(m, opts()), (m, fp32_grads())])
        {
            let grads = if o.grad_reduce_in_fp32 {
                "fp32"
            } else {
                "bf16"
            };
            for layers in &ranges {
                let case = format!("{file} mb {mb} {a}x{b} {layers:?} {grads} gradients");
                let w = whole(&g, layers.clone(), a, b, o);
                let c =
                    chained(&g, layers.clone(), a, b, o).unwrap_or_else(|e| panic!("{case}: {e}"));
                let rel = (w - c).abs() / w;
                worst = worst.max(rel);
                assert!(rel < 1e-9, "{case}: whole range {w:e}, chained {c:e}");
            }
        }
    }
    println!("worst relative difference: {worst:e}");
}

/// Ops of kinds autopar does not know are never split inside, so their gradients crossing a
/// boundary come in fewer specs than the layer reading them accepts: the chain still reaches
/// the whole range's optimum.
#[test]
fn opaque_ops_chain_to_the_whole_range_optimum() {
    // As for tiny-mlp above: a micro-batch of 2 on the 2x2 mesh has plans tied to the last
    // bit in cost (halving the batch or the sequence) that hold different memory.
    for (mb, meshes) in [(1, vec![(1, 2), (2, 1), (2, 2)]), (2, vec![(1, 2), (2, 1)])] {
        let g = lower_text(&opaque_mlp(), mb, 128);
        for &(a, b) in &meshes {
            for layers in [0..2, 1..3, 2..4, 0..4] {
                let case = format!("mb {mb} {a}x{b} {layers:?}");
                let w = whole(&g, layers.clone(), a, b, opts());
                let c = chained(&g, layers.clone(), a, b, opts())
                    .unwrap_or_else(|e| panic!("{case}: {e}"));
                assert!(
                    (w - c).abs() <= 1e-9 * w,
                    "{case}: whole range {w:e}, chained {c:e}"
                );
            }
        }
    }
}

#[test]
fn identical_blocks_have_identical_tables() {
    let g = lower("llama2-7b.json", 1, Some(128), 4);
    let (m, c) = mesh(1, 2);
    let t1 = layer_table(&g, 1, m, &c.device, opts()).expect("block 1");
    let t2 = layer_table(&g, 7, m, &c.device, opts()).expect("block 7");
    assert_eq!(t1.before, t2.before);
    assert_eq!(t1.after, t2.after);
    assert_eq!(t1.entries, t2.entries);
    // Two crossing tensors (the activation and its gradient) per boundary.
    assert!(t1.before.iter().all(|s| s.len() == 2));
    assert!(t1.before.len() > 1 && t1.after.len() > 1);
}

/// A run of identical blocks reaches its steady state within a few blocks; from there on,
/// extending along the repeated predecessors gives exactly the full extension's entries, bit
/// for bit, and the full extension keeps choosing the same predecessors.
#[test]
fn a_steady_chain_extends_along_its_predecessors_exactly() {
    for (a, b) in [(1, 2), (2, 2), (1, 4)] {
        let g = lower("llama2-7b.json", 1, Some(128), a * b);
        let (m, c) = mesh(a, b);
        let table = |l: usize| layer_table(&g, l, m, &c.device, opts()).expect("table");
        let (embedding, block) = (table(0), table(1));
        let into = link(&embedding, &block).expect("embedding -> block");
        let repeat = link(&block, &block).expect("block -> block");
        let rank = ranking(&block);
        let mut step = Extension::default();
        extend_linked(&start(&embedding), &into, &block, &rank, &mut step);
        let mut best = step.best.clone();
        let mut found: Option<(usize, Vec<usize>)> = None;
        let mut along_best = Vec::new();
        for j in 2..=24 {
            extend_linked(&best, &repeat, &block, &rank, &mut step);
            let (full, from) = (step.best.clone(), step.from.clone());
            match &found {
                Some((_, along)) => {
                    assert_eq!(&from, along, "{a}x{b}, block {j}");
                    extend_along(&best, along, &repeat, &block, &mut along_best);
                    assert_eq!(along_best, full, "{a}x{b}, block {j}");
                }
                None if steady(&best, &full) => found = Some((j, from)),
                None => {}
            }
            best = full;
        }
        let at = found.map(|(j, _)| j);
        assert!(at.is_some_and(|j| j <= 8), "{a}x{b}: steady at {at:?}");
    }
}

/// Steady means every state that has a path grew by one cost and one memory, and the same
/// states have paths.
#[test]
fn steady_needs_one_growth_for_every_state() {
    let e = |cost: f64, memory: f64| Entry {
        cost,
        memory,
        ..Entry::ZERO
    };
    let prev = [e(1.0, 10.0), e(2.0, 30.0), Entry::NONE];
    assert!(steady(&prev, &[e(1.5, 12.0), e(2.5, 32.0), Entry::NONE]));
    // Another cost growth, another memory growth, a state gaining or losing its path, or
    // another number of states.
    assert!(!steady(&prev, &[e(1.5, 12.0), e(2.6, 32.0), Entry::NONE]));
    assert!(!steady(&prev, &[e(1.5, 12.0), e(2.5, 33.0), Entry::NONE]));
    assert!(!steady(&prev, &[e(1.5, 12.0), e(2.5, 32.0), e(9.0, 9.0)]));
    assert!(!steady(&prev, &[e(1.5, 12.0), Entry::NONE, Entry::NONE]));
    assert!(!steady(&prev, &[e(1.5, 12.0), e(2.5, 32.0)]));
    // No path at all is not a state to extend along.
    assert!(!steady(&[Entry::NONE], &[Entry::NONE]));
}

#[test]
fn tied_weights_are_not_a_chain() {
    let g = lower("gpt2-small.json", 1, Some(128), 4);
    let n = g.layers.len();
    match chained(&g, 0..n, 1, 2, opts()) {
        Err(ChainError::NotAChain {
            first,
            second,
            tensor,
        }) => {
            assert_eq!((first, second), (0, n - 1));
            assert_eq!(tensor, "embedding.word");
        }
        other => panic!("expected NotAChain, got {other:?}"),
    }
    // Without both ends the range is a chain.
    assert!(chained(&g, 0..n - 1, 1, 2, opts()).is_ok());
}

#[test]
fn conditioning_on_the_entering_specs_gives_the_same_table() {
    let g = lower("tiny-mlp.graph.json", 1, Some(128), 4);
    let (m, c) = mesh(2, 2);
    let reference = layer_table(&g, 1, m, &c.device, opts()).expect("layer 1");
    assert_eq!(reference.solves, 1);
    let mut conditioned = 0;
    // One elimination keeping every boundary spec stores about 1e5 factor entries, each of the
    // 81 pinned ones about 3.6e4: the middle caps leave only pinning, the last neither.
    for cap in [1e6, 7e4, 4e4, 3e4] {
        // The exact elimination alone (`Auto` would fill a table too wide for it by D-Rec).
        let small = StageOptions {
            max_exact_entries: cap,
            solver: SolverChoice::Exact,
            ..opts()
        };
        match layer_table(&g, 1, m, &c.device, small) {
            Ok(t) => {
                if t.solves > 1 {
                    conditioned += 1;
                }
                assert_eq!(t.before, reference.before);
                assert_eq!(t.after, reference.after);
                for (a, b) in t.entries.iter().zip(&reference.entries) {
                    assert!(
                        (a.cost - b.cost).abs() <= 1e-12 * b.cost.abs(),
                        "cap {cap}: {a:?} vs {b:?}"
                    );
                    assert_eq!(a.activations <= a.memory, b.activations <= b.memory);
                }
            }
            Err(ChainError::TooWide(_)) => {}
            Err(e) => panic!("cap {cap}: {e}"),
        }
    }
    assert!(
        conditioned > 0,
        "no cap made the table condition on its entering specs"
    );
}

#[test]
fn solve_sharding_chain_reports_the_composed_cost() {
    let ws = TempWorkspace::default_copy();
    let args = |model: &'static str, layers: &'static str| {
        [
            "solve", "sharding", "--model", model, "--mesh", "1x2", "--layers", layers, "--seq",
            "128", "--chain", "--json",
        ]
    };
    let j = ws.run(&args("models/llama2-7b.json", "0..3")).json();
    let objective = j["objective"].as_f64().expect("objective");
    let chained = j["chain"]["objective"].as_f64().expect("chain.objective");
    assert!((objective - chained).abs() <= 1e-9 * objective, "{j}");
    let layers = j["chain"]["layers"].as_array().expect("chain.layers");
    assert_eq!(layers.len(), 3);
    assert_eq!(layers[0]["states_before"], 1, "{j}");
    assert!(layers[1]["states_before"].as_u64() > Some(1), "{j}");
    let text = ws.run(&args("models/gpt2-small.json", "0..14")[..11]);
    assert_eq!(text.code, 0, "{}", text.stderr);
    assert!(
        text.stdout.contains(
            "chained layer tables: not composed: layers 0 and 13 share tensor `embedding.word`"
        ),
        "{}",
        text.stdout
    );
}
