//! The byte layout of a cached result, the same in the local store and on the remote: the key
//! the result was stored under, a blake3 over key and payload, then the payload.
//!
//! Binding the key into the hashed bytes is what makes a cache unable to serve a wrong result:
//! bytes that are intact but belong to another key (a shuffled database page, a remote that
//! answers `ac/<A>` with the entry of `<B>`, a teammate's token used to overwrite an entry)
//! are rejected exactly like damaged bytes.
//!
//! A payload above [`COMPRESS_ABOVE`] bytes is stored compressed with Zstandard (`APS2`) when
//! that is smaller: a layer table of a 2D mesh is 1.5 MB of f64 columns that compress to an
//! eighth, and every build that opens the store, and every teammate who fetches it, reads the
//! stored bytes. The hash covers the stored bytes, so damage is found before anything is
//! decompressed, and decompressing stops at [`MAX_PAYLOAD`] bytes (a remote cannot hand over
//! a decompression bomb). Records that earlier versions deflated (`APZ2`) still open.

use flate2::read::DeflateDecoder;
use std::borrow::Cow;
use std::io::Read;

/// Marks a record of this layout. `APV1` was the previous layout (payload hash only).
const MAGIC: &[u8; 4] = b"APV2";
/// Marks a record of this layout whose stored payload is compressed with Zstandard.
const ZSTD_MAGIC: &[u8; 4] = b"APS2";
/// Marks a record of this layout whose stored payload is deflated (written by earlier
/// versions, which did not compress with Zstandard; still read).
const DEFLATED_MAGIC: &[u8; 4] = b"APZ2";
/// The layout before keys were bound into records.
const OLD_MAGIC: &[u8; 4] = b"APV1";
/// Magic, key, then the blake3 of key and stored payload.
const HEADER: usize = 4 + 32 + 32;

/// Payloads larger than this are stored compressed.
pub const COMPRESS_ABOVE: usize = 64 * 1024;

/// Zstandard's level for records: its fastest regular level, which on layer tables compresses
/// further than deflate's fastest (8.5 against 7.4 to one) and decompresses in half the CPU.
const ZSTD_LEVEL: i32 = 1;

/// Largest payload a compressed record may decompress to.
pub const MAX_PAYLOAD: u64 = 1 << 30;

/// A cache key: the blake3 of a result's canonical inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub [u8; 32]);

impl Key {
    /// Lower-case hex.
    pub fn hex(&self) -> String {
        crate::hex(&self.0)
    }

    /// Parses 64 hex digits (what [`Key::hex`] writes), with blake3's own parser.
    pub fn from_hex(s: &str) -> Option<Key> {
        blake3::Hash::from_hex(s).ok().map(|h| Key(*h.as_bytes()))
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

/// The hash a record of layout `magic` holds: over the key and the stored payload, and for a
/// compressed record its magic too (so damage that turns one layout's magic into another's is
/// found like any other).
fn digest(magic: &[u8; 4], key: &Key, stored: &[u8]) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(&key.0);
    if magic != MAGIC {
        h.update(magic);
    }
    h.update(stored);
    *h.finalize().as_bytes()
}

/// The record of `payload` stored under `key`.
pub fn seal(key: &Key, payload: &[u8]) -> Vec<u8> {
    match compress(payload) {
        Some(compressed) if compressed.len() < payload.len() => frame(ZSTD_MAGIC, key, &compressed),
        _ => frame(MAGIC, key, payload),
    }
}

fn frame(magic: &[u8; 4], key: &Key, stored: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + stored.len());
    out.extend_from_slice(magic);
    out.extend_from_slice(&key.0);
    out.extend_from_slice(&digest(magic, key, stored));
    out.extend_from_slice(stored);
    out
}

/// `payload` compressed, when it is large enough to be worth it.
fn compress(payload: &[u8]) -> Option<Vec<u8>> {
    if payload.len() <= COMPRESS_ABOVE {
        return None;
    }
    zstd::bulk::compress(payload, ZSTD_LEVEL).ok()
}

/// The payload of `bytes` if they are an intact record of `key`.
pub fn open<'b>(key: &Key, bytes: &'b [u8]) -> Result<Cow<'b, [u8]>, RecordError> {
    if bytes.len() >= OLD_MAGIC.len() && &bytes[..4] == OLD_MAGIC {
        return Err(RecordError::OldLayout);
    }
    if bytes.len() < HEADER {
        return Err(RecordError::Damaged);
    }
    let magic = match &bytes[..4] {
        m if m == MAGIC => MAGIC,
        m if m == ZSTD_MAGIC => ZSTD_MAGIC,
        m if m == DEFLATED_MAGIC => DEFLATED_MAGIC,
        _ => return Err(RecordError::Damaged),
    };
    let mut stored = [0u8; 32];
    stored.copy_from_slice(&bytes[4..36]);
    let stored = Key(stored);
    let payload = &bytes[HEADER..];
    if digest(magic, &stored, payload) != bytes[36..HEADER] {
        return Err(RecordError::Damaged);
    }
    if stored != *key {
        return Err(RecordError::OtherKey(stored));
    }
    let out = match magic {
        MAGIC => return Ok(Cow::Borrowed(payload)),
        ZSTD_MAGIC => match zstd::zstd_safe::get_frame_content_size(payload) {
            // A frame that gives its size (as `seal` writes them) decompresses in one pass
            // into a buffer of that size, and fails if it holds more.
            Ok(Some(size)) if size <= MAX_PAYLOAD => {
                zstd::bulk::decompress(payload, size as usize).map_err(|_| RecordError::Damaged)?
            }
            Ok(Some(_)) => return Err(RecordError::Damaged),
            _ => {
                let decoder = zstd::stream::read::Decoder::with_buffer(payload)
                    .map_err(|_| RecordError::Damaged)?;
                read_limited(decoder, payload.len())?
            }
        },
        _ => read_limited(DeflateDecoder::new(payload), payload.len())?,
    };
    Ok(Cow::Owned(out))
}

/// Everything `decoder` decompresses `stored` bytes to; damage when it fails or passes
/// [`MAX_PAYLOAD`].
fn read_limited(decoder: impl Read, stored: usize) -> Result<Vec<u8>, RecordError> {
    // Room for a four-fold expansion to start with (the tables expand about eight-fold).
    let mut out = Vec::with_capacity((stored as u64 * 4).min(MAX_PAYLOAD) as usize);
    decoder
        .take(MAX_PAYLOAD + 1)
        .read_to_end(&mut out)
        .map_err(|_| RecordError::Damaged)?;
    if out.len() as u64 > MAX_PAYLOAD {
        return Err(RecordError::Damaged);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flate2::Compression;
    use flate2::write::DeflateEncoder;
    use proptest::prelude::*;
    use std::io::Write;

    #[test]
    fn a_record_opens_under_its_own_key_only() {
        let (a, b) = (Key([1; 32]), Key([2; 32]));
        let r = seal(&a, b"payload");
        assert_eq!(open(&a, &r).as_deref(), Ok(&b"payload"[..]));
        assert_eq!(open(&b, &r), Err(RecordError::OtherKey(a)));
        assert_eq!(open(&a, &r[..10]), Err(RecordError::Damaged));
        assert_eq!(open(&a, b""), Err(RecordError::Damaged));
        assert_eq!(open(&a, b"APV1 old bytes"), Err(RecordError::OldLayout));
        // Swapping the key in the header without rehashing is damage, not another key.
        let mut forged = r.clone();
        forged[4..36].copy_from_slice(&b.0);
        assert_eq!(open(&b, &forged), Err(RecordError::Damaged));
    }

    /// A layer table's shape: f64s that repeat.
    fn table_like() -> Vec<u8> {
        (0..40_000u64)
            .flat_map(|i| ((i % 97) as f64 * 1e-3).to_le_bytes())
            .collect()
    }

    #[test]
    fn a_large_payload_is_stored_compressed_and_opens_to_itself() {
        let k = Key([3; 32]);
        let payload = table_like();
        let r = seal(&k, &payload);
        assert_eq!(&r[..4], ZSTD_MAGIC);
        assert!(r.len() < payload.len() / 4, "{} bytes", r.len());
        assert_eq!(open(&k, &r).as_deref(), Ok(&payload[..]));
        // Damage to the compressed bytes is found by the hash, before decompressing; so is a
        // record relabelled as another layout.
        let mut damaged = r.clone();
        let last = damaged.len() - 1;
        damaged[last] ^= 0x40;
        assert_eq!(open(&k, &damaged), Err(RecordError::Damaged));
        for other in [MAGIC, DEFLATED_MAGIC] {
            let mut relabelled = r.clone();
            relabelled[..4].copy_from_slice(other);
            assert_eq!(open(&k, &relabelled), Err(RecordError::Damaged));
        }
        // Bytes that do not compress are stored as they are.
        let noise = crate::noise(1, 100_000);
        let r = seal(&k, &noise);
        assert_eq!(&r[..4], MAGIC);
        assert_eq!(open(&k, &r).as_deref(), Ok(&noise[..]));
    }

    /// A record as earlier versions sealed a large payload: deflated, under `APZ2`.
    fn deflated_record(key: &Key, payload: &[u8]) -> Vec<u8> {
        let mut encoder = DeflateEncoder::new(Vec::new(), Compression::fast());
        encoder.write_all(payload).expect("deflate");
        frame(DEFLATED_MAGIC, key, &encoder.finish().expect("deflate"))
    }

    #[test]
    fn a_record_deflated_by_an_earlier_version_still_opens() {
        let k = Key([5; 32]);
        let payload = table_like();
        let r = deflated_record(&k, &payload);
        assert_eq!(open(&k, &r).as_deref(), Ok(&payload[..]));
        assert_eq!(
            open(&Key([6; 32]), &r),
            Err(RecordError::OtherKey(k)),
            "bound to its key like any record"
        );
        let mut relabelled = r.clone();
        relabelled[..4].copy_from_slice(ZSTD_MAGIC);
        assert_eq!(open(&k, &relabelled), Err(RecordError::Damaged));
    }

    #[test]
    fn a_compressed_record_that_decompresses_past_the_limit_is_refused() {
        let k = Key([4; 32]);
        // 1 GiB + 1 of zeros compresses to a few kilobytes (Zstandard: a frame that declares
        // its size, and one that does not) or about a megabyte (deflate).
        let mut deflate = DeflateEncoder::new(Vec::new(), Compression::fast());
        let mut unsized_zstd = zstd::stream::write::Encoder::new(Vec::new(), 1).expect("zstd");
        let mut sized_zstd = zstd::stream::write::Encoder::new(Vec::new(), 1).expect("zstd");
        sized_zstd
            .set_pledged_src_size(Some(MAX_PAYLOAD + 1))
            .expect("zstd");
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..1024 {
            deflate.write_all(&zeros).expect("deflate");
            unsized_zstd.write_all(&zeros).expect("zstd");
            sized_zstd.write_all(&zeros).expect("zstd");
        }
        deflate.write_all(&[0]).expect("deflate");
        unsized_zstd.write_all(&[0]).expect("zstd");
        sized_zstd.write_all(&[0]).expect("zstd");
        let sized = sized_zstd.finish().expect("zstd");
        assert_eq!(
            zstd::zstd_safe::get_frame_content_size(&sized).ok(),
            Some(Some(MAX_PAYLOAD + 1))
        );
        let bombs = [
            frame(DEFLATED_MAGIC, &k, &deflate.finish().expect("deflate")),
            frame(ZSTD_MAGIC, &k, &unsized_zstd.finish().expect("zstd")),
            frame(ZSTD_MAGIC, &k, &sized),
        ];
        for bomb in bombs {
            assert_eq!(open(&k, &bomb), Err(RecordError::Damaged));
        }
        // Bytes under the compressed layout's magic that are not a Zstandard frame, hashed
        // as a writer would hash them, are damage too.
        let junk = frame(ZSTD_MAGIC, &k, b"not a zstandard frame");
        assert_eq!(open(&k, &junk), Err(RecordError::Damaged));
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
