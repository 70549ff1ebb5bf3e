//! Finding where a value sits in JSON text, so errors found after parsing (a field that is
//! valid JSON but an impossible number) can still point at a line and column.
//!
//! `serde_json` reports positions only for syntax and type errors; this small scanner walks the
//! raw text along a path of keys and indices. It never panics: on text it cannot follow it
//! returns `None`.

/// One step of a path into a JSON document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PathSeg<'a> {
    /// A key of an object.
    Key(&'a str),
    /// An index of an array.
    Index(usize),
}

/// Byte offset of the value at `path` (for a key: of the key itself) in `text`.
pub fn locate(text: &str, path: &[PathSeg<'_>]) -> Option<usize> {
    let b = text.as_bytes();
    let (pos, last_key_pos) = walk(b, skip_ws(b, 0), path)?;
    match path.last() {
        Some(PathSeg::Key(_)) => last_key_pos,
        _ => Some(pos),
    }
}

/// Byte offsets of the items of the array at `path`, followed from the value at `start` (the
/// document when `None`), found in one pass: a file of many ops is located in linear time.
/// Empty when there is no array there.
pub fn item_offsets(text: &str, start: Option<usize>, path: &[PathSeg<'_>]) -> Vec<usize> {
    let b = text.as_bytes();
    let mut out = Vec::new();
    let Some((mut pos, _)) = walk(b, start.unwrap_or_else(|| skip_ws(b, 0)), path) else {
        return out;
    };
    if b.get(pos) != Some(&b'[') {
        return out;
    }
    pos = skip_ws(b, pos + 1);
    while b.get(pos).is_some_and(|&c| c != b']') {
        out.push(pos);
        let Some(end) = skip_value(b, pos) else {
            break;
        };
        pos = skip_ws(b, end);
        match b.get(pos) {
            Some(b',') => pos = skip_ws(b, pos + 1),
            _ => break,
        }
    }
    out
}

/// Follows `path` from the value at `pos`: the offset of the value reached, and of its key
/// when the last step was one.
fn walk(b: &[u8], mut pos: usize, path: &[PathSeg<'_>]) -> Option<(usize, Option<usize>)> {
    let mut last_key_pos = None;
    for seg in path {
        match *seg {
            PathSeg::Key(key) => {
                if b.get(pos) != Some(&b'{') {
                    return None;
                }
                pos = skip_ws(b, pos + 1);
                loop {
                    if b.get(pos) == Some(&b'}') {
                        return None;
                    }
                    let key_start = pos;
                    let (k, after) = read_string(b, pos)?;
                    pos = skip_ws(b, after);
                    if b.get(pos) != Some(&b':') {
                        return None;
                    }
                    pos = skip_ws(b, pos + 1);
                    if k == key {
                        last_key_pos = Some(key_start);
                        break;
                    }
                    pos = skip_ws(b, skip_value(b, pos)?);
                    match b.get(pos) {
                        Some(b',') => pos = skip_ws(b, pos + 1),
                        _ => return None,
                    }
                }
            }
            PathSeg::Index(i) => {
                if b.get(pos) != Some(&b'[') {
                    return None;
                }
                pos = skip_ws(b, pos + 1);
                for _ in 0..i {
                    if b.get(pos) == Some(&b']') {
                        return None;
                    }
                    pos = skip_ws(b, skip_value(b, pos)?);
                    match b.get(pos) {
                        Some(b',') => pos = skip_ws(b, pos + 1),
                        _ => return None,
                    }
                }
                if b.get(pos) == Some(&b']') {
                    return None;
                }
                last_key_pos = None;
            }
        }
    }
    Some((pos, last_key_pos))
}

/// 1-based line and column of a byte offset.
pub fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = &text.as_bytes()[..offset];
    let line = before.iter().filter(|&&c| c == b'\n').count() + 1;
    let line_start = before
        .iter()
        .rposition(|&c| c == b'\n')
        .map_or(0, |p| p + 1);
    let col = String::from_utf8_lossy(&before[line_start..])
        .chars()
        .count()
        + 1;
    (line, col)
}

/// Byte offset of a 1-based line and column (as `serde_json` reports them).
pub fn offset_of(text: &str, line: usize, column: usize) -> usize {
    let mut offset = 0;
    for (i, l) in text.split_inclusive('\n').enumerate() {
        if i + 1 == line {
            let col_bytes: usize = l
                .chars()
                .take(column.saturating_sub(1))
                .map(char::len_utf8)
                .sum();
            return offset + col_bytes;
        }
        offset += l.len();
    }
    text.len()
}

fn skip_ws(b: &[u8], mut pos: usize) -> usize {
    while matches!(b.get(pos), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        pos += 1;
    }
    pos
}

/// Reads a string starting at `pos` (which must be `"`); returns its raw content and the offset
/// after the closing quote. Escapes are kept raw, which is enough to compare plain keys.
fn read_string(b: &[u8], pos: usize) -> Option<(&str, usize)> {
    if b.get(pos) != Some(&b'"') {
        return None;
    }
    let mut i = pos + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => {
                let s = std::str::from_utf8(&b[pos + 1..i]).ok()?;
                return Some((s, i + 1));
            }
            _ => i += 1,
        }
    }
    None
}

/// Offset just after the value starting at `pos`.
fn skip_value(b: &[u8], pos: usize) -> Option<usize> {
    match b.get(pos)? {
        b'"' => read_string(b, pos).map(|(_, e)| e),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = pos;
            while i < b.len() {
                match b[i] {
                    b'"' => {
                        i = read_string(b, i)?.1;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth = depth.checked_sub(1)?;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        _ => {
            let mut i = pos;
            while i < b.len() && !matches!(b[i], b',' | b'}' | b']' | b' ' | b'\n' | b'\r' | b'\t')
            {
                i += 1;
            }
            (i > pos).then_some(i)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const DOC: &str = "{\n  \"a\": 1,\n  \"list\": [ {\"x\": \"}\"}, {\"y\": [1, 2]} ],\n  \"b\": {\"c\": true}\n}";

    #[test]
    fn item_offsets_are_where_locate_finds_each_item() {
        let list = [PathSeg::Key("list")];
        let items = item_offsets(DOC, None, &list);
        assert_eq!(items.len(), 2);
        for (i, &at) in items.iter().enumerate() {
            assert_eq!(
                Some(at),
                locate(DOC, &[PathSeg::Key("list"), PathSeg::Index(i)])
            );
        }
        // From an item onwards: the array inside the second one.
        let inner = item_offsets(DOC, Some(items[1]), &[PathSeg::Key("y")]);
        assert_eq!(
            inner.first().copied(),
            locate(
                DOC,
                &[
                    PathSeg::Key("list"),
                    PathSeg::Index(1),
                    PathSeg::Key("y"),
                    PathSeg::Index(0)
                ]
            )
        );
        assert_eq!(inner.len(), 2);
        assert!(item_offsets(DOC, None, &[PathSeg::Key("a")]).is_empty());
        assert!(item_offsets("[", None, &[]).is_empty());
    }

    #[test]
    fn finds_keys_and_indices() {
        let at = |p: &[PathSeg]| locate(DOC, p).map(|o| line_col(DOC, o));
        assert_eq!(at(&[PathSeg::Key("a")]), Some((2, 3)));
        assert_eq!(at(&[PathSeg::Key("b"), PathSeg::Key("c")]), Some((4, 9)));
        assert_eq!(
            at(&[PathSeg::Key("list"), PathSeg::Index(1), PathSeg::Key("y")]),
            Some((3, 26))
        );
        assert_eq!(at(&[PathSeg::Key("list"), PathSeg::Index(2)]), None);
        assert_eq!(at(&[PathSeg::Key("missing")]), None);
    }

    #[test]
    fn offsets_round_trip_through_line_and_column() {
        for off in 0..DOC.len() {
            let (l, c) = line_col(DOC, off);
            assert_eq!(offset_of(DOC, l, c), off);
        }
    }

    proptest! {
        #[test]
        fn never_panics(text in ".{0,200}", key in "[a-z]{0,3}", idx in 0usize..4) {
            let _ = locate(&text, &[PathSeg::Key(&key), PathSeg::Index(idx), PathSeg::Key(&key)]);
            let _ = line_col(&text, idx * 7);
            let _ = offset_of(&text, idx, idx);
        }
    }
}
