//! The byte layout of a cached result, the same in the local store and on the remote: the key
//! the result was stored under, a blake3 over key and payload, then the payload.
//!
//! Binding the key into the hashed bytes is what makes a cache unable to serve a wrong result:
//! bytes that are intact but belong to another key (a shuffled database page, a remote that
//! answers `ac/<A>` with the entry of `<B>`, a teammate's token used to overwrite an entry)
//! are rejected exactly like damaged bytes.

/// Marks a record of this layout. `APV1` was the previous layout (payload hash only).
const MAGIC: &[u8; 4] = b"APV2";
/// The layout before keys were bound into records.
const OLD_MAGIC: &[u8; 4] = b"APV1";
/// Magic, key, then the blake3 of key and payload.
const HEADER: usize = 4 + 32 + 32;

/// A cache key: the blake3 of a result's canonical inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub [u8; 32]);

impl Key {
    /// Lower-case hex.
    pub fn hex(&self) -> String {
        crate::hex(&self.0)
    }
}

/// Why stored bytes are not the result asked for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Too short, or bytes that do not hash to their recorded digest.
    #[error("the bytes do not match their hash")]
    Damaged,
    /// An intact record of another key.
    #[error("it holds the result of another key ({})", .0.hex())]
    OtherKey(Key),
    /// A record written by an earlier autopar, without a bound key.
    #[error("it was written by an earlier version of autopar")]
    OldLayout,
}

fn digest(key: &Key, payload: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&key.0);
    h.update(payload);
    *h.finalize().as_bytes()
}

/// The record of `payload` stored under `key`.
pub fn seal(key: &Key, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + payload.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&key.0);
    out.extend_from_slice(&digest(key, payload));
    out.extend_from_slice(payload);
    out
}

/// The payload of `bytes` if they are an intact record of `key`.
pub fn open<'b>(key: &Key, bytes: &'b [u8]) -> Result<&'b [u8], RecordError> {
    if bytes.len() >= OLD_MAGIC.len() && &bytes[..4] == OLD_MAGIC {
        return Err(RecordError::OldLayout);
    }
    if bytes.len() < HEADER || &bytes[..4] != MAGIC {
        return Err(RecordError::Damaged);
    }
    let mut stored = [0u8; 32];
    stored.copy_from_slice(&bytes[4..36]);
    let stored = Key(stored);
    let payload = &bytes[HEADER..];
    if digest(&stored, payload) != bytes[36..HEADER] {
        return Err(RecordError::Damaged);
    }
    if stored != *key {
        return Err(RecordError::OtherKey(stored));
    }
    Ok(payload)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_record_opens_under_its_own_key_only() {
        let (a, b) = (Key([1; 32]), Key([2; 32]));
        let r = seal(&a, b"payload");
        assert_eq!(open(&a, &r), Ok(&b"payload"[..]));
        assert_eq!(open(&b, &r), Err(RecordError::OtherKey(a)));
        assert_eq!(open(&a, &r[..10]), Err(RecordError::Damaged));
        assert_eq!(open(&a, b""), Err(RecordError::Damaged));
        assert_eq!(open(&a, b"APV1 old bytes"), Err(RecordError::OldLayout));
        // Swapping the key in the header without rehashing is damage, not another key.
        let mut forged = r.clone();
        forged[4..36].copy_from_slice(&b.0);
        assert_eq!(open(&b, &forged), Err(RecordError::Damaged));
    }

    proptest! {
        #[test]
        fn any_flipped_bit_is_rejected(payload in proptest::collection::vec(any::<u8>(), 0..200), at in any::<prop::sample::Index>(), bit in 0u8..8) {
            let k = Key([9; 32]);
            let mut r = seal(&k, &payload);
            let i = at.index(r.len());
            r[i] ^= 1 << bit;
            prop_assert!(open(&k, &r).is_err());
        }

        #[test]
        fn arbitrary_bytes_never_open(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            prop_assert!(open(&Key([0; 32]), &bytes).is_err());
        }
    }
}
