//! How a layer table's entries are stored: one column per field of [`Entry`], each value as
//! its eight little-endian bytes, all in one byte string. A 2D mesh's table holds tens of
//! thousands of entries and a build reads hundreds of tables from the cache: as one byte
//! string they decode in one pass over the columns instead of a call per field.

use super::Entry;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;
use std::fmt;

/// Fields of an [`Entry`], in the order the columns are stored.
const FIELDS: usize = 9;

/// Each field of an entry, in column order.
pub(super) const COLUMNS: [fn(&Entry) -> f64; FIELDS] = [
    |e| e.cost,
    |e| e.memory,
    |e| e.activations,
    |e| e.forward,
    |e| e.checkpoint,
    |e| e.peak_layer,
    |e| e.step,
    |e| e.sync,
    |e| e.working,
];

/// The entry of fields `f` in column order ([`COLUMNS`]'s).
pub(super) fn entry(f: [f64; FIELDS]) -> Entry {
    Entry {
        cost: f[0],
        memory: f[1],
        activations: f[2],
        forward: f[3],
        checkpoint: f[4],
        peak_layer: f[5],
        step: f[6],
        sync: f[7],
        working: f[8],
    }
}

/// Serializes `entries` as their columns.
pub fn serialize<S: Serializer>(entries: &[Entry], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(&encode(entries))
}

/// Deserializes entries stored by [`serialize`].
pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Entry>, D::Error> {
    d.deserialize_bytes(Columns)
}

/// The columns of `entries` as bytes.
fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = Vec::with_capacity(entries.len() * FIELDS * 8);
    for column in COLUMNS {
        for e in entries {
            out.extend_from_slice(&column(e).to_le_bytes());
        }
    }
    out
}

/// The entries whose columns are `bytes`; `None` when they are not whole columns.
fn decode(bytes: &[u8]) -> Option<Vec<Entry>> {
    if bytes.len() % (FIELDS * 8) != 0 {
        return None;
    }
    let n = bytes.len() / (FIELDS * 8);
    let columns: [&[u8]; FIELDS] = std::array::from_fn(|f| &bytes[f * n * 8..(f + 1) * n * 8]);
    // Entry by entry, each column read in order.
    let value = |f: usize, i: usize| {
        let b = &columns[f][i * 8..i * 8 + 8];
        f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
    };
    Some(
        (0..n)
            .map(|i| entry(std::array::from_fn(|f| value(f, i))))
            .collect(),
    )
}

/// Reads the byte string (or, from formats without one, a sequence of bytes).
struct Columns;

impl<'de> Visitor<'de> for Columns {
    type Value = Vec<Entry>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(
            f,
            "a layer table's entries as {FIELDS} columns of 8-byte floats"
        )
    }

    fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<Self::Value, E> {
        decode(bytes).ok_or_else(|| E::invalid_length(bytes.len(), &self))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut bytes = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(b) = seq.next_element::<u8>()? {
            bytes.push(b);
        }
        self.visit_bytes(&bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(serde::Serialize, serde::Deserialize, PartialEq, Debug)]
    struct Table {
        #[serde(with = "super")]
        entries: Vec<Entry>,
    }

    fn arbitrary_entry() -> impl Strategy<Value = Entry> {
        proptest::array::uniform9(prop_oneof![
            any::<f64>().prop_filter("not NaN", |x| !x.is_nan()),
            Just(f64::INFINITY),
        ])
        .prop_map(entry)
    }

    proptest! {
        /// Every table's entries come back bit for bit, through postcard (the cache's
        /// encoding) and JSON.
        #[test]
        fn entries_round_trip(entries in proptest::collection::vec(arbitrary_entry(), 0..40)) {
            let t = Table { entries };
            let bytes = postcard::to_allocvec(&t).expect("encode");
            prop_assert_eq!(&postcard::from_bytes::<Table>(&bytes).expect("decode"), &t);
            let json = serde_json::to_string(&t).expect("encode");
            prop_assert_eq!(&serde_json::from_str::<Table>(&json).expect("decode"), &t);
        }

        /// Bytes that are not whole columns are an error, never a panic.
        #[test]
        fn partial_columns_are_refused(len in 0usize..300) {
            let bytes = postcard::to_allocvec(&serde_bytes_of(len)).expect("encode");
            let decoded = postcard::from_bytes::<Table>(&bytes);
            prop_assert_eq!(decoded.is_ok(), len % (FIELDS * 8) == 0);
        }
    }

    /// A byte string of `len` bytes, serialized as the entries' field is.
    fn serde_bytes_of(len: usize) -> impl serde::Serialize {
        struct Bytes(Vec<u8>);
        impl serde::Serialize for Bytes {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(&self.0)
            }
        }
        Bytes(vec![7; len])
    }
}
