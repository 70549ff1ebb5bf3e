//! Who may do what on `autopar cache serve`: bearer tokens with a read or read-write scope, and
//! users of an htpasswd file (HTTP basic auth, as bazel-remote's `--htpasswd_file`), who may
//! read and write. Secrets are compared in constant time and never printed.

use axum::http::HeaderMap;
use base64::Engine as _;
use sha2::{Digest as _, Sha256};
use std::collections::HashSet;
use std::sync::Mutex;
use subtle::ConstantTimeEq;

/// What a credential may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// GET and HEAD.
    Read,
    /// GET, HEAD and PUT.
    ReadWrite,
}

/// A bearer token and its scope.
#[derive(Clone)]
pub struct Token {
    /// The secret.
    pub secret: String,
    /// What it allows.
    pub scope: Scope,
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret.
        write!(f, "Token({:?})", self.scope)
    }
}

/// Reads a tokens file: one `read <token>` or `readwrite <token>` per line; `#` comments and
/// blank lines are ignored. Errors are (line number, message).
pub fn parse_tokens(text: &str) -> Result<Vec<Token>, (usize, String)> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        let scope = match parts.next() {
            Some("read") => Scope::Read,
            Some("readwrite") => Scope::ReadWrite,
            Some(other) => {
                return Err((
                    i + 1,
                    format!("expected `read` or `readwrite` before the token, found `{other}`"),
                ));
            }
            None => continue,
        };
        let Some(secret) = parts.next() else {
            return Err((
                i + 1,
                "expected a token after the scope, found nothing".into(),
            ));
        };
        if parts.next().is_some() {
            return Err((i + 1, "expected `<scope> <token>`, found more words".into()));
        }
        out.push(Token {
            secret: secret.to_string(),
            scope,
        });
    }
    Ok(out)
}

/// How an htpasswd file stores a password.
#[derive(Clone)]
enum PasswordHash {
    /// `$2a$`, `$2b$`, `$2y$`: bcrypt (`htpasswd -B`).
    Bcrypt(String),
    /// `{SHA}` + base64 of the SHA-1 (`htpasswd -s`).
    Sha1([u8; 20]),
}

/// A user of an htpasswd file.
#[derive(Clone)]
pub struct User {
    /// The user name.
    pub name: String,
    hash: PasswordHash,
}

impl std::fmt::Debug for User {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the hash.
        write!(f, "User({})", self.name)
    }
}

/// Reads an htpasswd file (`user:hash` per line, `#` comments), with bcrypt (`htpasswd -B`) or
/// SHA-1 (`htpasswd -s`) hashes. Errors are (line number, message); the MD5 (`$apr1$`) and
/// crypt hashes that Apache also writes are refused by name rather than never matching.
pub fn parse_htpasswd(text: &str) -> Result<Vec<User>, (usize, String)> {
    let mut out: Vec<User> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, hash)) = line.split_once(':') else {
            return Err((i + 1, "expected `user:hash`, found no `:`".into()));
        };
        if name.is_empty() {
            return Err((
                i + 1,
                "expected a user name before `:`, found nothing".into(),
            ));
        }
        if out.iter().any(|u| u.name == name) {
            return Err((i + 1, format!("user `{name}` is listed twice")));
        }
        let hash = if ["$2a$", "$2b$", "$2y$"].iter().any(|p| hash.starts_with(p)) {
            PasswordHash::Bcrypt(hash.to_string())
        } else if let Some(b64) = hash.strip_prefix("{SHA}") {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .ok()
                .and_then(|b| <[u8; 20]>::try_from(b).ok())
                .ok_or_else(|| {
                    (
                        i + 1,
                        format!("user `{name}`: `{{SHA}}` must be followed by a base64 SHA-1"),
                    )
                })?;
            PasswordHash::Sha1(bytes)
        } else {
            let kind = if hash.starts_with("$apr1$") {
                "an MD5 (`$apr1$`) hash"
            } else {
                "a hash of a kind autopar does not check"
            };
            return Err((
                i + 1,
                format!(
                    "user `{name}` has {kind}; expected bcrypt (`htpasswd -B`) or SHA-1 \
                     (`htpasswd -s`)"
                ),
            ));
        };
        out.push(User {
            name: name.to_string(),
            hash,
        });
    }
    Ok(out)
}

/// Most verified basic-auth credentials remembered (bcrypt takes tens of milliseconds by
/// design, too long to pay on every request of a build).
const REMEMBERED: usize = 4096;

/// The credentials a server accepts.
pub(crate) struct Credentials {
    tokens: Vec<Token>,
    users: Vec<User>,
    /// SHA-256 of `user:password` pairs that verified.
    verified: Mutex<HashSet<[u8; 32]>>,
}

impl Credentials {
    pub(crate) fn new(tokens: Vec<Token>, users: Vec<User>) -> Self {
        Credentials {
            tokens,
            users,
            verified: Mutex::new(HashSet::new()),
        }
    }

    /// Whether anyone may do anything (no tokens and no users configured).
    pub(crate) fn open(&self) -> bool {
        self.tokens.is_empty() && self.users.is_empty()
    }

    /// The scope the request's credentials grant (`None`: none, or not valid).
    pub(crate) fn scope(&self, headers: &HeaderMap) -> Option<Scope> {
        if self.open() {
            return Some(Scope::ReadWrite);
        }
        let given = headers.get("authorization")?.to_str().ok()?;
        if let Some(token) = given.strip_prefix("Bearer ") {
            // Compare against every token, in constant time per comparison.
            let mut found = None;
            for t in &self.tokens {
                if bool::from(t.secret.as_bytes().ct_eq(token.as_bytes())) {
                    found = Some(t.scope);
                }
            }
            return found;
        }
        let encoded = given.strip_prefix("Basic ")?;
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .ok()?;
        let pair = String::from_utf8(decoded).ok()?;
        let (name, password) = pair.split_once(':')?;
        self.check_user(name, password).then_some(Scope::ReadWrite)
    }

    fn check_user(&self, name: &str, password: &str) -> bool {
        let user = self.users.iter().find(|u| u.name == name);
        let fingerprint: [u8; 32] = Sha256::new()
            .chain_update(name.as_bytes())
            .chain_update([0u8])
            .chain_update(password.as_bytes())
            .finalize()
            .into();
        let lock = || self.verified.lock().unwrap_or_else(|e| e.into_inner());
        if user.is_some() && lock().contains(&fingerprint) {
            return true;
        }
        let ok = match user.map(|u| &u.hash) {
            Some(PasswordHash::Bcrypt(h)) => bcrypt::verify(password, h).unwrap_or(false),
            Some(PasswordHash::Sha1(h)) => {
                use sha1::Digest as _;
                let d: [u8; 20] = sha1::Sha1::digest(password.as_bytes()).into();
                bool::from(d.ct_eq(h))
            }
            None => false,
        };
        if ok {
            let mut seen = lock();
            if seen.len() >= REMEMBERED {
                seen.clear();
            }
            seen.insert(fingerprint);
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_file() {
        let t = parse_tokens("# team\nread r0\n\nreadwrite w0\n").expect("parses");
        assert_eq!(t.len(), 2);
        assert_eq!(t[1].scope, Scope::ReadWrite);
        assert_eq!(
            format!("{:?}", t[1]),
            "Token(ReadWrite)",
            "the secret is never printed"
        );
        assert_eq!(parse_tokens("write x").expect_err("scope").0, 1);
        assert_eq!(parse_tokens("\nread").expect_err("token").0, 2);
    }

    fn basic(user: &str, password: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        let v = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        h.insert(
            "authorization",
            format!("Basic {v}").parse().expect("header value"),
        );
        h
    }

    #[test]
    fn htpasswd_users_sign_in_with_basic_auth() {
        // `htpasswd -nbB alice s3cret` (cost 4 to keep the test fast) and `htpasswd -nbs bob
        // hunter2`.
        let bcrypt_line = format!(
            "alice:{}",
            bcrypt::hash_with_result("s3cret", 4)
                .expect("hash")
                .format_for_version(bcrypt::Version::TwoY)
        );
        let text = format!("# team\n{bcrypt_line}\nbob:{{SHA}}87u9ZqY9S/F0eUBXjsPQEDUw4h0=\n");
        let users = parse_htpasswd(&text).expect("parses");
        assert_eq!(format!("{:?}", users[0]), "User(alice)");
        let c = Credentials::new(Vec::new(), users);
        assert!(!c.open());
        assert_eq!(c.scope(&basic("alice", "s3cret")), Some(Scope::ReadWrite));
        assert_eq!(
            c.scope(&basic("alice", "s3cret")),
            Some(Scope::ReadWrite),
            "remembered"
        );
        assert_eq!(c.scope(&basic("alice", "wrong")), None);
        assert_eq!(c.scope(&basic("bob", "hunter2")), Some(Scope::ReadWrite));
        assert_eq!(c.scope(&basic("bob", "hunter3")), None);
        assert_eq!(c.scope(&basic("carol", "s3cret")), None);
        assert_eq!(c.scope(&HeaderMap::new()), None);
    }

    #[test]
    fn unsupported_or_malformed_htpasswd_lines_are_located() {
        let e = parse_htpasswd("a:$apr1$lZL6V/ci$eIMz/iKDkbtys/uU7LEK00").expect_err("md5");
        assert_eq!(e.0, 1);
        assert!(
            e.1.contains("MD5") && e.1.contains("htpasswd -B"),
            "{}",
            e.1
        );
        assert_eq!(parse_htpasswd("\nno-colon").expect_err("colon").0, 2);
        assert_eq!(parse_htpasswd("a:{SHA}notbase64!").expect_err("sha").0, 1);
        let e = parse_htpasswd(
            "a:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=\na:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=",
        )
        .expect_err("twice");
        assert_eq!(e.0, 2);
    }
}
