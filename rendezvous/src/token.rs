//! The run token: a secret every process of a run holds, with which each
//! proves to process 0 (and process 0 to each) that it belongs to the run,
//! without the secret ever crossing the wire.
//!
//! Each connection to the rendezvous starts with a challenge: the server
//! sends a random nonce, the client answers with a nonce of its own and
//! HMAC-SHA256(token, "client" label ‖ server nonce ‖ client nonce); the
//! server checks it in constant time and answers with the same MAC under a
//! "server" label, which the client checks in turn. Distinct labels keep
//! either side's proof from being replayed as the other's, and fresh nonces
//! keep a recorded proof from being replayed on another connection.

use std::fmt;
use std::fs::File;
use std::io::{self, Read};
use std::str::FromStr;

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce and of a proof (an HMAC-SHA256 tag).
pub(crate) const PROOF_BYTES: usize = 32;

/// What the client's proof is computed under.
pub(crate) const CLIENT_LABEL: &[u8] = b"hlo-train rendezvous: client proof";
/// What the server's proof is computed under.
pub(crate) const SERVER_LABEL: &[u8] = b"hlo-train rendezvous: server proof";

/// The environment variable that holds the run token.
pub const RUN_TOKEN_ENV: &str = "HLO_TRAIN_RUN_TOKEN";

type HmacSha256 = Hmac<Sha256>;

/// A run's shared secret (`--run-token` or `HLO_TRAIN_RUN_TOKEN`). It has
/// no `Display`, and its `Debug` hides it, so that it is never printed or
/// logged by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct RunToken(String);

impl fmt::Debug for RunToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RunToken(<hidden>)")
    }
}

/// Why a token was refused. Its message never includes the token.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("a run token must not be empty")]
pub struct EmptyToken;

impl RunToken {
    /// A token from its text; an empty one is refused, since it would
    /// protect nothing while looking set.
    pub fn new(text: impl Into<String>) -> Result<RunToken, EmptyToken> {
        let text = text.into();
        if text.is_empty() {
            return Err(EmptyToken);
        }
        Ok(RunToken(text))
    }

    /// The MAC of `label ‖ server_nonce ‖ client_nonce` under this token.
    fn mac(
        &self,
        label: &[u8],
        server_nonce: &[u8; PROOF_BYTES],
        client_nonce: &[u8; PROOF_BYTES],
    ) -> HmacSha256 {
        // HMAC takes a key of any length (a long one is hashed first), so
        // this cannot fail whatever the token.
        let mut mac = <HmacSha256 as Mac>::new_from_slice(self.0.as_bytes())
            .expect("HMAC accepts keys of any length");
        mac.update(label);
        mac.update(server_nonce);
        mac.update(client_nonce);
        mac
    }

    /// The proof of holding this token for one connection's nonces.
    pub(crate) fn proof(
        &self,
        label: &[u8],
        server_nonce: &[u8; PROOF_BYTES],
        client_nonce: &[u8; PROOF_BYTES],
    ) -> [u8; PROOF_BYTES] {
        self.mac(label, server_nonce, client_nonce)
            .finalize()
            .into_bytes()
            .into()
    }

    /// Whether `proof` is this token's for these nonces, compared in
    /// constant time so that timing tells nothing about the right proof.
    pub(crate) fn verify(
        &self,
        label: &[u8],
        server_nonce: &[u8; PROOF_BYTES],
        client_nonce: &[u8; PROOF_BYTES],
        proof: &[u8; PROOF_BYTES],
    ) -> bool {
        self.mac(label, server_nonce, client_nonce)
            .verify_slice(proof)
            .is_ok()
    }
}

impl FromStr for RunToken {
    type Err = EmptyToken;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RunToken::new(s)
    }
}

/// A fresh nonce from the OS's random source.
pub(crate) fn nonce() -> io::Result<[u8; PROOF_BYTES]> {
    let mut bytes = [0u8; PROOF_BYTES];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .map_err(|e| io::Error::new(e.kind(), format!("cannot read /dev/urandom: {e}")))?;
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_depend_on_token_label_and_both_nonces() {
        let t = RunToken::new("s3cret").unwrap();
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let p = t.proof(CLIENT_LABEL, &a, &b);
        assert!(t.verify(CLIENT_LABEL, &a, &b, &p));
        assert!(!t.verify(SERVER_LABEL, &a, &b, &p));
        assert!(!t.verify(CLIENT_LABEL, &b, &a, &p));
        let other = RunToken::new("s3creT").unwrap();
        assert!(!other.verify(CLIENT_LABEL, &a, &b, &p));
        assert_ne!(nonce().unwrap(), nonce().unwrap());
        assert_eq!(format!("{t:?}"), "RunToken(<hidden>)");
        assert_eq!(RunToken::new(""), Err(EmptyToken));
    }
}
