//! Collectives of compiled HLO: what XLA's SPMD partitioner inserted, counted by kind so that
//! they can be set beside the plan's.

use std::collections::BTreeMap;

/// HLO collective instructions and the plan's names for them (an asynchronous pair,
/// `all-gather-start` / `all-gather-done`, counts once, by its start).
const KINDS: &[(&str, &str)] = &[
    ("all-reduce", "all_reduce"),
    ("all-gather", "all_gather"),
    ("reduce-scatter", "reduce_scatter"),
    ("all-to-all", "all_to_all"),
    ("collective-permute", "collective_permute"),
];

/// The collectives of an HLO module's text, by the plan's names: every instruction whose
/// opcode is a collective (`%x = f32[..] all-reduce(...)`, or its `-start` half). An all-reduce
/// whose every use is a dynamic slice of its result is a reduce-scatter: XLA's SPMD partitioner
/// writes reduce-scatters that way, and GPU backends fuse the pair into one (CPU backends
/// decompose reduce-scatters into it too).
pub fn collectives(text: &str) -> BTreeMap<String, usize> {
    let instructions: Vec<(&str, &str, &str)> = text
        .lines()
        .filter_map(|line| {
            let (lhs, rhs) = line.split_once(" = ")?;
            let name = lhs.trim().trim_start_matches("ROOT ").trim();
            let op = opcode(rhs)?;
            Some((name, op, rhs))
        })
        .collect();
    let sliced_only = |name: &str| sliced_only(&instructions, name, 0);
    let mut out = BTreeMap::new();
    for &(name, op, _) in &instructions {
        let op = op.strip_suffix("-start").unwrap_or(op);
        let Some((_, kind)) = KINDS.iter().find(|(k, _)| *k == op) else {
            continue;
        };
        let kind = if *kind == "all_reduce" && sliced_only(name) {
            "reduce_scatter"
        } else {
            kind
        };
        *out.entry(kind.to_string()).or_insert(0) += 1;
    }
    out
}

/// Whether every use of `name` is a dynamic slice of it, seen through copies and bitcasts
/// (a sharding constraint lowers to a copy).
fn sliced_only(instructions: &[(&str, &str, &str)], name: &str, depth: usize) -> bool {
    let mut uses = instructions
        .iter()
        .filter(|(_, _, rhs)| operands(rhs).any(|o| o == name))
        .peekable();
    uses.peek().is_some()
        && depth < 8
        && uses.all(|&(user, op, _)| match op {
            "dynamic-slice" => true,
            "copy" | "bitcast" => sliced_only(instructions, user, depth + 1),
            _ => false,
        })
}

/// The operand names (`%x`) an instruction's right-hand side reads, attributes left out.
fn operands(rhs: &str) -> impl Iterator<Item = &str> {
    let list = opcode(rhs)
        .and_then(|op| rhs.find(&format!(" {op}(")).map(|i| i + op.len() + 2))
        .map_or("", |from| {
            // Up to the `)` that closes the operand list.
            let mut depth = 1;
            let end = rhs[from..]
                .char_indices()
                .find(|&(_, c)| {
                    depth += match c {
                        '(' => 1,
                        ')' => -1,
                        _ => 0,
                    };
                    depth == 0
                })
                .map_or(rhs.len(), |(j, _)| from + j);
            &rhs[from..end]
        });
    list.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| t.starts_with('%'))
}

/// The opcode of an instruction's right-hand side: the word before the first `(` that opens
/// an operand list (a tuple shape, `(f32[2], f32[4]) all-gather-start(`, opens with one too).
fn opcode(rhs: &str) -> Option<&str> {
    rhs.match_indices('(').find_map(|(i, _)| {
        let head = &rhs[..i];
        let word = &head[head.rfind(' ').map_or(0, |s| s + 1)..];
        let is_word = !word.is_empty()
            && word
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
        is_word.then_some(word)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_all_reduce_only_sliced_is_a_reduce_scatter() {
        let text = r#"
ENTRY %main {
  %p = f32[4,8]{1,0} parameter(0)
  %i = s32[] partition-id()
  %all-reduce = f32[4,8]{1,0} all-reduce(%p), channel_id=1, to_apply=%add
  %ds = f32[2,8]{1,0} dynamic-slice(%all-reduce, %i, %i), dynamic_slice_sizes={2,8}
  %all-reduce.1 = f32[4,8]{1,0} all-reduce(%p), channel_id=2, to_apply=%add
  %ds.1 = f32[2,8]{1,0} dynamic-slice(%all-reduce.1, %i, %i), dynamic_slice_sizes={2,8}
  %all-reduce.2 = f32[4,8]{1,0} all-reduce(%p), channel_id=3, to_apply=%add
  %sharding_constraint = f32[4,8]{1,0} copy(%all-reduce.2)
  %ds.2 = f32[2,8]{1,0} dynamic-slice(%sharding_constraint, %i, %i), dynamic_slice_sizes={2,8}
  ROOT %t = (f32[2,8]{1,0}, f32[4,8]{1,0}, f32[2,8]{1,0}, f32[2,8]{1,0}) tuple(%ds, %all-reduce.1, %ds.1, %ds.2)
}
"#;
        let c = collectives(text);
        assert_eq!(c.get("reduce_scatter"), Some(&2));
        assert_eq!(c.get("all_reduce"), Some(&1));
    }

    #[test]
    fn counts_collectives_by_opcode_and_async_pairs_once() {
        let text = r#"
HloModule jit_forward
%region_0 (a: f32[], b: f32[]) -> f32[] {
  ROOT %add = f32[] add(f32[] %a, f32[] %b)
}
ENTRY %main {
  %p = f32[4,8]{1,0} parameter(0)
  %all-reduce = f32[4,8]{1,0} all-reduce(%p), channel_id=1, replica_groups={{0,1}}, to_apply=%region_0
  %ag = (f32[4,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%p), dimensions={0}
  %agd = f32[8,8]{1,0} all-gather-done(%ag)
  %rs = f32[2,8]{1,0} reduce-scatter(%all-reduce), dimensions={0}, to_apply=%region_0
  %m = f32[4,8]{1,0} multiply(%p, %p), metadata={op_name="all-reduce(x)"}
  ROOT %cp = f32[4,8]{1,0} collective-permute(%m), source_target_pairs={{0,1},{1,0}}
}
"#;
        let c = collectives(text);
        assert_eq!(c.get("all_reduce"), Some(&1));
        assert_eq!(c.get("all_gather"), Some(&1));
        assert_eq!(c.get("reduce_scatter"), Some(&1));
        assert_eq!(c.get("collective_permute"), Some(&1));
        assert_eq!(c.get("all_to_all"), None);
    }
}
