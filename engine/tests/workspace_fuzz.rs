//! The workspace loader on mutated and arbitrary input: it returns a located error or a
//! workspace, and never panics.

use autopar_engine::EngineError;
use autopar_engine::workspace::load_str;
use proptest::prelude::*;
use std::path::PathBuf;

fn default_workspace() -> (PathBuf, String) {
    let path = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../workspace.toml"));
    let text = std::fs::read_to_string(&path).expect("default workspace");
    (path, text)
}

fn check(path: &std::path::Path, text: &str) {
    match load_str(path, text) {
        Ok(_) => {}
        Err(EngineError::Config(d)) => {
            // Every diagnostic names a field and says what it expected and found.
            assert!(
                !d.field.is_empty() && !d.expected.is_empty() && !d.found.is_empty(),
                "{d}"
            );
        }
        Err(other) => panic!("unexpected error kind: {other}"),
    }
}

#[test]
fn the_default_workspace_loads() {
    let (path, text) = default_workspace();
    let ws = load_str(&path, &text).expect("default workspace is valid");
    for required in ["gpt3-175b", "llama2-70b", "llama3-8b"] {
        assert!(ws.target(required).is_some(), "{required}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn single_character_edits_never_panic(pos in 0usize..10_000, ch in proptest::char::any(), delete in any::<bool>()) {
        let (path, text) = default_workspace();
        let mut chars: Vec<char> = text.chars().collect();
        let p = pos % chars.len();
        if delete { chars.remove(p); } else { chars[p] = ch; }
        check(&path, &chars.into_iter().collect::<String>());
    }

    #[test]
    fn digit_edits_never_panic(pos in 0usize..10_000, digits in "[0-9]{1,25}") {
        let (path, text) = default_workspace();
        let positions: Vec<usize> = text.match_indices(|c: char| c.is_ascii_digit()).map(|(i, _)| i).collect();
        let p = positions[pos % positions.len()];
        let edited = format!("{}{}{}", &text[..p], digits, &text[p + 1..]);
        check(&path, &edited);
    }

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,400}") {
        let (path, _) = default_workspace();
        check(&path, &text);
    }
}
