//! Content hashes of canonical encodings: what cache keys are made of (DESIGN.md "Cache keys").
//!
//! A value is encoded with postcard (fields in declaration order, integers as varints, floats
//! as their bit patterns, sequences in order; no maps with unspecified order are ever encoded)
//! and hashed with blake3. A result's key is the hash of its named components, each itself a
//! hash, under the rules version salt: so `explain` can say which component changed.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A blake3 hash. Human-readable formats (the JSON of plans and build records) write it as
/// 64 hex digits; binary ones (postcard: cache values and key encodings) as its 32 bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        if serializer.is_human_readable() {
            serializer.serialize_str(&self.hex())
        } else {
            // What `#[derive(Serialize)]` writes, so keys hashed before are unchanged.
            serializer.serialize_newtype_struct("Digest", &self.0)
        }
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        /// Hex digits, or (records written before digests were hex) 32 byte values.
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Digest;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a blake3 digest: 64 hex digits or 32 bytes")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Digest, E> {
                Digest::from_hex(s)
                    .ok_or_else(|| E::invalid_value(serde::de::Unexpected::Str(s), &self))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Digest, A::Error> {
                let mut bytes = [0u8; 32];
                for (i, b) in bytes.iter_mut().enumerate() {
                    *b = seq
                        .next_element()?
                        .ok_or_else(|| serde::de::Error::invalid_length(i, &self))?;
                }
                if seq.next_element::<u8>()?.is_some() {
                    return Err(serde::de::Error::invalid_length(33, &self));
                }
                Ok(Digest(bytes))
            }
        }
        if deserializer.is_human_readable() {
            deserializer.deserialize_any(Visit)
        } else {
            <[u8; 32]>::deserialize(deserializer).map(Digest)
        }
    }
}

impl Digest {
    /// Lower-case hex.
    pub fn hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// Parses 64 hex digits, with blake3's own parser.
    pub fn from_hex(s: &str) -> Option<Digest> {
        blake3::Hash::from_hex(s)
            .ok()
            .map(|h| Digest(*h.as_bytes()))
    }

    /// The hash of raw bytes.
    pub fn of_bytes(bytes: &[u8]) -> Digest {
        Digest(*blake3::hash(bytes).as_bytes())
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.hex())
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", &self.hex()[..16])
    }
}

/// Feeds postcard's output straight into a hasher.
struct HashWriter<'a>(&'a mut blake3::Hasher);

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The canonical encoding of `value`.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Vec<u8> {
    // Our types only use what postcard supports; an encoding failure would be a bug in a
    // type, and hashing its message keeps keys deterministic all the same.
    postcard::to_allocvec(value).unwrap_or_else(|e| format!("unencodable: {e}").into_bytes())
}

/// The hash of `value`'s canonical encoding.
pub fn digest<T: Serialize + ?Sized>(value: &T) -> Digest {
    let mut h = blake3::Hasher::new();
    {
        // postcard writes a field at a time, mostly a few bytes: the hasher takes them in
        // blocks (the same bytes in the same order, so the same digest), which for large
        // values (a model's layer costs) is several times faster than byte-sized updates.
        let mut buffered = std::io::BufWriter::with_capacity(DIGEST_BLOCK, HashWriter(&mut h));
        let encoded = postcard::to_io(value, &mut buffered).map(|_| ());
        // Writing into a hasher cannot fail.
        let _ = std::io::Write::flush(&mut buffered);
        drop(buffered);
        if let Err(e) = encoded {
            h.update(format!("unencodable: {e}").as_bytes());
        }
    }
    Digest(*h.finalize().as_bytes())
}

/// Bytes [`digest`] collects before it feeds the hasher.
const DIGEST_BLOCK: usize = 16 * 1024;

/// The named components of a result's key. The key is the hash of the rules version salt, the
/// result kind and every (name, component hash) in order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeyParts {
    /// Kind of result (`layer-cost`, `plan`, ...).
    pub kind: String,
    /// Components, in a fixed order.
    pub parts: Vec<(String, Digest)>,
}

impl KeyParts {
    /// Components of a result of `kind`, starting with the rules version salt.
    pub fn new(kind: &str) -> Self {
        KeyParts {
            kind: kind.to_string(),
            parts: vec![("rules".to_string(), digest(crate::RULES_VERSION))],
        }
    }

    /// Adds a component: the hash of `value`'s canonical encoding.
    pub fn with<T: Serialize + ?Sized>(mut self, name: &str, value: &T) -> Self {
        self.parts.push((name.to_string(), digest(value)));
        self
    }

    /// Adds a component whose hash is already known.
    pub fn with_digest(mut self, name: &str, d: Digest) -> Self {
        self.parts.push((name.to_string(), d));
        self
    }

    /// The key.
    pub fn key(&self) -> Digest {
        digest(&(&self.kind, &self.parts))
    }

    /// Names of the components that differ from `old` (present in one only, or with different
    /// hashes), in this key's order.
    pub fn changed_since(&self, old: &KeyParts) -> Vec<String> {
        let mut out: Vec<String> = self
            .parts
            .iter()
            .filter(|(n, d)| !old.parts.iter().any(|(m, e)| m == n && e == d))
            .map(|(n, _)| n.clone())
            .collect();
        for (n, _) in &old.parts {
            if !self.parts.iter().any(|(m, _)| m == n) {
                out.push(n.clone());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct S {
        a: u64,
        b: f64,
        c: Vec<String>,
    }

    #[test]
    fn digests_are_stable_and_field_sensitive() {
        let s = S {
            a: 1,
            b: 0.5,
            c: vec!["x".into()],
        };
        assert_eq!(digest(&s), digest(&s));
        assert_eq!(digest(&s), Digest::of_bytes(&encode(&s)));
        // Past the block `digest` buffers, in several blocks: still the encoding's hash.
        let large: Vec<f64> = (0..3 * DIGEST_BLOCK / 4).map(|i| i as f64 * 0.5).collect();
        assert_eq!(digest(&large), Digest::of_bytes(&encode(&large)));
        let t = S { b: -0.5, ..s };
        assert_ne!(digest(&t), digest(&S { b: 0.5, ..t }));
        // Floats by bit pattern: 0.0 and -0.0 differ.
        assert_ne!(digest(&0.0f64), digest(&-0.0f64));
    }

    #[test]
    fn keys_name_the_changed_component() {
        let a = KeyParts::new("plan")
            .with("model", &1u64)
            .with("cluster", &2u64);
        let b = KeyParts::new("plan")
            .with("model", &1u64)
            .with("cluster", &3u64);
        assert_ne!(a.key(), b.key());
        assert_eq!(b.changed_since(&a), ["cluster"]);
        assert!(a.changed_since(&a.clone()).is_empty());
        let hex = a.key().hex();
        assert_eq!(Digest::from_hex(&hex), Some(a.key()));
        assert_eq!(Digest::from_hex("zz"), None);
    }

    #[test]
    fn digests_are_hex_in_json_and_raw_bytes_in_postcard() {
        let d = digest("x");
        // postcard: the 32 bytes alone, as the derived encoding wrote them (keys unchanged).
        assert_eq!(encode(&d), d.0.to_vec());
        assert_eq!(postcard::from_bytes::<Digest>(&encode(&d)).ok(), Some(d));
        let json = serde_json::to_string(&d).unwrap_or_default();
        assert_eq!(json, format!("\"{}\"", d.hex()));
        assert_eq!(serde_json::from_str::<Digest>(&json).ok(), Some(d));
        // Records written before digests were hex still read.
        let old = serde_json::to_string(&d.0.to_vec()).unwrap_or_default();
        assert_eq!(serde_json::from_str::<Digest>(&old).ok(), Some(d));
        for bad in ["\"zz\"", "[1,2]", "3"] {
            assert!(serde_json::from_str::<Digest>(bad).is_err(), "{bad}");
        }
        let long = serde_json::to_string(&vec![0u8; 33]).unwrap_or_default();
        assert!(serde_json::from_str::<Digest>(&long).is_err());
    }
}
