//! Error types shared by the parsers and validators of `rules`.

/// A field of an input document with a wrong or impossible value.
///
/// `offset` is the byte offset of the value in the source text when the parser knows it, so the
/// caller (which knows the file name) can print a line and column.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("field `{field}`: expected {expected}, found {found}")]
pub struct FieldError {
    /// Name of the field as written in the document.
    pub field: String,
    /// What a valid value looks like.
    pub expected: String,
    /// What the document holds.
    pub found: String,
    /// Byte offset of the field in the source text, if known.
    pub offset: Option<usize>,
}

impl FieldError {
    /// A field error without a known position.
    pub fn new(
        field: impl Into<String>,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> Self {
        FieldError {
            field: field.into(),
            expected: expected.into(),
            found: found.into(),
            offset: None,
        }
    }

    /// The same error, located at `offset` in the source text.
    pub fn at(mut self, offset: Option<usize>) -> Self {
        self.offset = offset;
        self
    }
}
