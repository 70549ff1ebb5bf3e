//! The readers of `autopar solve` inputs (Alpa's stage costs as JSON, MindSpore SAPP's yaml) on
//! edited copies of the shipped examples: each returns a result or a located error, and never
//! panics.

use autopar_engine::EngineError;
use autopar_engine::{alpa, sapp};
use proptest::prelude::*;
use std::path::{Path, PathBuf};

fn example(name: &str) -> (PathBuf, String) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../examples")
        .join(name);
    let text = std::fs::read_to_string(&path).expect("shipped example");
    (path, text)
}

/// A located input error, or an infeasible instance; anything else is a bug.
fn acceptable(r: Result<(), EngineError>) {
    match r {
        Ok(()) | Err(EngineError::Infeasible(_)) => {}
        Err(EngineError::Config(d)) => {
            assert!(
                !d.field.is_empty() && !d.expected.is_empty() && !d.found.is_empty(),
                "{d}"
            );
        }
        Err(other) => panic!("unexpected error kind: {other}"),
    }
}

/// `text` with the character at `pos` (modulo its length) replaced by `ch`, or removed.
fn edit(text: &str, pos: usize, ch: char, delete: bool) -> String {
    let mut chars: Vec<char> = text.chars().collect();
    let p = pos % chars.len();
    if delete {
        chars.remove(p);
    } else {
        chars[p] = ch;
    }
    chars.into_iter().collect()
}

/// `text` with one of its digits (chosen by `pos`) replaced by `digits`.
fn edit_number(text: &str, pos: usize, digits: &str) -> String {
    let at: Vec<usize> = text
        .match_indices(|c: char| c.is_ascii_digit())
        .map(|(i, _)| i)
        .collect();
    let p = at[pos % at.len()];
    format!("{}{digits}{}", &text[..p], &text[p + 1..])
}

fn stages(text: &str) {
    let (path, _) = example("alpa-stage-costs.json");
    acceptable(alpa::solve_text(&path, text).map(|_| ()));
}

fn balance(text: &str) {
    let (path, _) = example("sapp-balance.yaml");
    acceptable(sapp::parse(&path, text).map(|_| ()));
}

#[test]
fn the_examples_read() {
    let (path, text) = example("alpa-stage-costs.json");
    alpa::solve_text(&path, &text).expect("stage costs");
    let (path, text) = example("sapp-balance.yaml");
    sapp::parse(&path, &text).expect("SAPP yaml");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn edited_stage_costs_never_panic(pos in any::<usize>(), ch in prop::sample::select(
        "0123456789-.,:[]{} \"en".chars().collect::<Vec<_>>()), delete in any::<bool>()) {
        stages(&edit(&example("alpa-stage-costs.json").1, pos, ch, delete));
    }

    #[test]
    fn renumbered_stage_costs_never_panic(pos in any::<usize>(), digits in prop_oneof![
        Just("0".to_string()), Just("-1".into()), Just("1e308".into()), Just("99999999999999999999".into()),
        "[0-9]{1,12}"]) {
        stages(&edit_number(&example("alpa-stage-costs.json").1, pos, &digits));
    }

    #[test]
    fn edited_sapp_yaml_never_panics(pos in any::<usize>(), ch in any::<char>(), delete in any::<bool>()) {
        balance(&edit(&example("sapp-balance.yaml").1, pos, ch, delete));
    }

    #[test]
    fn renumbered_sapp_yaml_never_panics(pos in any::<usize>(), digits in prop_oneof![
        Just("0".to_string()), Just("-1".into()), Just("1e308".into()), Just(".nan".into()),
        "[0-9]{1,12}"]) {
        balance(&edit_number(&example("sapp-balance.yaml").1, pos, &digits));
    }
}
