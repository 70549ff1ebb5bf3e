//! Input errors that point at a place in a file: path, line, column, field, expected, found.

use autopar_rules::error::FieldError;
use autopar_rules::model::frontend::locate::{line_col, offset_of};
use std::fmt;
use std::path::{Path, PathBuf};

/// An error in an input file, located precisely enough to fix it without guessing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostic {
    /// The file.
    pub file: PathBuf,
    /// 1-based line, if known.
    pub line: Option<usize>,
    /// 1-based column, if known.
    pub column: Option<usize>,
    /// The field (dotted path, e.g. `target.global_batch`).
    pub field: String,
    /// What a valid value looks like.
    pub expected: String,
    /// What the file holds.
    pub found: String,
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
            if let Some(col) = self.column {
                write!(f, ":{col}")?;
            }
        }
        write!(
            f,
            ": field `{}`: expected {}, found {}",
            self.field, self.expected, self.found
        )
    }
}

impl Diagnostic {
    /// A diagnostic at byte `offset` of `text` (the contents of `file`).
    pub fn at(
        file: &Path,
        text: &str,
        offset: Option<usize>,
        field: impl Into<String>,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        let (line, column) = match offset.map(|o| line_col(text, o)) {
            Some((l, c)) => (Some(l), Some(c)),
            None => (None, None),
        };
        Diagnostic {
            file: file.to_path_buf(),
            line,
            column,
            field: field.into(),
            expected: expected.into(),
            found: found.into(),
        }
    }

    /// A [`FieldError`] from a parser in `rules`, placed in `file`. `prefix` names the document
    /// part the parser saw (empty for a whole file).
    pub fn from_field(file: &Path, text: &str, e: FieldError, prefix: &str) -> Self {
        let field = if prefix.is_empty() {
            e.field
        } else {
            format!("{prefix}.{}", e.field)
        };
        Diagnostic::at(file, text, e.offset, field, e.expected, e.found)
    }

    /// A TOML parse or type error, with serde's message split into expected and found.
    pub fn from_toml(file: &Path, text: &str, e: &toml::de::Error) -> Self {
        let offset = e.span().map(|s| s.start);
        let section = offset.map(|o| section_at(text, o)).unwrap_or_default();
        let key_here = offset.and_then(|o| key_at(text, o));
        let qualify = |key: &str| {
            if section.is_empty() {
                key.to_string()
            } else {
                format!("{section}.{key}")
            }
        };
        let (field, expected, found) = match classify(e.message().trim()) {
            Classified::Named {
                field,
                expected,
                found,
            } => (qualify(&field), expected, found),
            Classified::Value { expected, found } => (
                qualify(key_here.as_deref().unwrap_or("(value)")),
                expected,
                found,
            ),
            // A syntax error in a key's value names that key; elsewhere (a table header, a
            // line without a key) the document.
            Classified::Other(msg) => (
                key_here
                    .as_deref()
                    .map_or_else(|| "(document)".to_string(), qualify),
                "valid TOML".to_string(),
                msg,
            ),
        };
        Diagnostic::at(file, text, offset, field, expected, found)
    }

    /// A YAML parse or type error (`yaml_serde` prefixes its message with the field path and
    /// ends it with the location).
    pub fn from_yaml(file: &Path, text: &str, e: &yaml_serde::Error) -> Self {
        let offset = e.location().map(|l| l.index());
        let full = e.to_string();
        let msg = full
            .rsplit_once(" at line ")
            .map_or(full.as_str(), |(m, _)| m)
            .trim();
        let (path, rest) = match msg.split_once(": ") {
            Some((p, r)) if !p.contains(' ') => (p, r),
            _ => ("", msg),
        };
        let (field, expected, found) = at_path(path, rest, "valid YAML");
        Diagnostic::at(file, text, offset, field, expected, found)
    }

    /// A JSON parse or type error met at `path`, the field path `serde_path_to_error` reports
    /// (`.` for the document itself, `?` before any field).
    pub fn from_json(file: &Path, text: &str, path: &str, e: &serde_json::Error) -> Self {
        let offset = (e.line() > 0).then(|| offset_of(text, e.line(), e.column()));
        let full = e.to_string();
        let msg = full
            .rsplit_once(" at line ")
            .map_or(full.as_str(), |(m, _)| m)
            .trim();
        // `.` is the document itself; `?` a place the error came before any field.
        let path = if path == "." || path == "?" { "" } else { path };
        let (field, expected, found) = at_path(path, msg, "valid JSON");
        Diagnostic::at(file, text, offset, field, expected, found)
    }
}

/// Field, expected and found of serde's message `msg` about the value at `path` (empty: the
/// document); `syntax` is what a message that is not about a field expected.
fn at_path(path: &str, msg: &str, syntax: &str) -> (String, String, String) {
    // A path may already end at the named field (an unknown key is part of its path).
    let join = |f: &str| match (path.is_empty(), f.is_empty()) {
        (true, true) => "(document)".to_string(),
        (true, false) => f.to_string(),
        (false, true) => path.to_string(),
        (false, false) if path == f || path.ends_with(&format!(".{f}")) => path.to_string(),
        (false, false) => format!("{path}.{f}"),
    };
    match classify(msg) {
        Classified::Named {
            field,
            expected,
            found,
        } => (join(&field), expected, found),
        Classified::Value { expected, found } => (join(""), expected, found),
        Classified::Other(m) => (join(""), syntax.to_string(), m),
    }
}

/// A serde error message taken apart.
enum Classified {
    /// About a named field (unknown or missing).
    Named {
        field: String,
        expected: String,
        found: String,
    },
    /// About the value at the error's position.
    Value { expected: String, found: String },
    /// Anything else (syntax errors).
    Other(String),
}

/// Recognises serde's standard messages: unknown field, missing field, invalid type or value,
/// unknown variant.
fn classify(msg: &str) -> Classified {
    if let Some(rest) = msg.strip_prefix("unknown field ") {
        let (name, expected) = split_expected(rest);
        let name = name.trim_matches('`').to_string();
        return Classified::Named {
            found: format!("unknown field `{name}`"),
            field: name,
            expected: expected.unwrap_or_else(|| "a known field".to_string()),
        };
    }
    if let Some(rest) = msg.strip_prefix("missing field ") {
        return Classified::Named {
            field: rest.trim_matches('`').to_string(),
            expected: "a value".to_string(),
            found: "nothing (the field is missing)".to_string(),
        };
    }
    if let Some(rest) = msg
        .strip_prefix("invalid type: ")
        .or_else(|| msg.strip_prefix("invalid value: "))
        .or_else(|| msg.strip_prefix("unknown variant "))
    {
        let (found, expected) = split_expected(rest);
        return Classified::Value {
            expected: expected.unwrap_or_else(|| "a valid value".to_string()),
            found: found.to_string(),
        };
    }
    Classified::Other(msg.to_string())
}

/// Splits serde's `"X, expected Y"` into `("X", Some("Y"))`.
fn split_expected(s: &str) -> (&str, Option<String>) {
    match s.rsplit_once(", expected ") {
        Some((found, expected)) => (found, Some(expected.to_string())),
        None => (s, None),
    }
}

/// Name of the table header (`model`, `target.search`, ...) that the byte `offset` lies under
/// (or on: serde reports a missing field at the header of its table).
fn section_at(text: &str, offset: usize) -> String {
    let offset = offset.min(text.len());
    let line_end = text
        .get(offset..)
        .and_then(|rest| rest.find('\n'))
        .map_or(text.len(), |p| offset + p);
    let before = text.get(..line_end).unwrap_or("");
    before
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_matches(|c| c == '[' || c == ']').trim().to_string())
        .unwrap_or_default()
}

/// The key of the `key = value` line containing `offset`, if any.
fn key_at(text: &str, offset: usize) -> Option<String> {
    let offset = offset.min(text.len());
    let start = text.get(..offset)?.rfind('\n').map_or(0, |p| p + 1);
    let line = text.get(start..)?.lines().next()?;
    let (key, _) = line.split_once('=')?;
    let key = key.trim().trim_matches('"');
    // An inline table: the key inside it is closer to the offset than the line's first key.
    let inner = text.get(start..offset)?;
    let nearest = inner
        .rsplit([',', '{'])
        .next()
        .and_then(|seg| seg.split_once('='))
        .map(|(k, _)| k.trim().trim_matches('"').to_string());
    match nearest {
        Some(k) if !k.is_empty() && k != key => Some(format!("{key}.{k}")),
        _ => (!key.is_empty()).then(|| key.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct T {
        name: String,
        global_batch: u64,
    }

    #[derive(serde::Deserialize, Debug)]
    #[allow(dead_code)]
    struct W {
        target: Vec<T>,
    }

    fn diag(text: &str) -> Diagnostic {
        let e = toml::from_str::<W>(text).expect_err("invalid");
        Diagnostic::from_toml(Path::new("w.toml"), text, &e)
    }

    #[test]
    fn type_errors_name_field_expected_and_found() {
        let d = diag("[[target]]\nname = \"a\"\nglobal_batch = \"x\"\n");
        assert_eq!(
            d.to_string(),
            "w.toml:3:16: field `target.global_batch`: expected u64, found string \"x\""
        );
    }

    #[test]
    fn unknown_and_missing_fields() {
        let d = diag("[[target]]\nname = \"a\"\nglobal_batch = 3\nbatch = 1\n");
        assert_eq!((d.line, d.column), (Some(4), Some(1)));
        assert_eq!(d.field, "target.batch");
        assert_eq!(d.found, "unknown field `batch`");
        assert!(d.expected.contains("global_batch"), "{d}");
        let d = diag("[[target]]\nname = \"a\"\n");
        assert_eq!(d.field, "target.global_batch");
        assert_eq!(d.found, "nothing (the field is missing)");
    }

    #[test]
    fn syntax_errors_are_located() {
        let d = diag("[[target]\nname");
        assert_eq!(d.line, Some(1));
        assert_eq!(d.expected, "valid TOML");
    }
}
