//! Tokenizers: HF `tokenizer.json` through the `tokenizers` crate, and the
//! byte-level tokenizer of the `tiny` model.

use std::path::Path;

use crate::DataError;

/// Vocabulary of the byte-level tokenizer: 256 bytes, then specials, padded
/// to a multiple of 8 (so it shards over common meshes).
pub const BYTE_VOCAB: i64 = 264;
pub const BYTE_BOS: u32 = 256;
pub const BYTE_EOS: u32 = 257;

pub enum Tokenizer {
    Hf(Box<tokenizers::Tokenizer>),
    /// One token per byte; BOS 256, EOS 257.
    Bytes,
}

impl Tokenizer {
    /// Reads an HF `tokenizer.json`.
    pub fn from_file(path: &Path) -> Result<Tokenizer, DataError> {
        tokenizers::Tokenizer::from_file(path)
            .map(|t| Tokenizer::Hf(Box::new(t)))
            .map_err(|e| DataError::Tokenizer(format!("cannot read {}: {e}", path.display())))
    }

    pub fn bytes() -> Tokenizer {
        Tokenizer::Bytes
    }

    /// Token ids of `text`, with the tokenizer's special tokens (BOS) if
    /// `special` is set.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<u32>, DataError> {
        match self {
            Tokenizer::Hf(t) => t
                .encode(text, special)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| DataError::Tokenizer(e.to_string())),
            Tokenizer::Bytes => {
                let mut ids: Vec<u32> = if special { vec![BYTE_BOS] } else { Vec::new() };
                ids.extend(text.bytes().map(u32::from));
                Ok(ids)
            }
        }
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Tokenizer::Hf(t) => t
                .decode(ids, true)
                .map_err(|e| DataError::Tokenizer(e.to_string())),
            Tokenizer::Bytes => {
                let bytes: Vec<u8> = ids.iter().filter(|&&i| i < 256).map(|&i| i as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }

    /// Text of `ids` with special tokens written out (`<|bos|>`,
    /// `<|eos|>` for the byte-level tokenizer).
    pub fn decode_with_special(&self, ids: &[u32]) -> Result<String, DataError> {
        match self {
            Tokenizer::Hf(t) => t
                .decode(ids, false)
                .map_err(|e| DataError::Tokenizer(e.to_string())),
            Tokenizer::Bytes => {
                let mut out = String::new();
                let mut bytes = Vec::new();
                for &i in ids {
                    if i < 256 {
                        bytes.push(i as u8);
                        continue;
                    }
                    out.push_str(&String::from_utf8_lossy(&bytes));
                    bytes.clear();
                    out.push_str(match i {
                        BYTE_BOS => "<|bos|>",
                        BYTE_EOS => "<|eos|>",
                        _ => "<|special|>",
                    });
                }
                out.push_str(&String::from_utf8_lossy(&bytes));
                Ok(out)
            }
        }
    }

    /// The tokenizer's identity: FNV-1a of its `tokenizer.json` as the
    /// `tokenizers` crate writes it back (`bytes` for the byte-level one),
    /// what a prepared token set is checked against.
    pub fn fingerprint(&self) -> String {
        match self {
            Tokenizer::Hf(t) => {
                let json = t.to_string(false).unwrap_or_default();
                format!("{:016x}", hlo_ir::rng::fnv1a(json.as_bytes()))
            }
            Tokenizer::Bytes => "bytes".into(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Hf(t) => t.get_vocab_size(true),
            Tokenizer::Bytes => BYTE_VOCAB as usize,
        }
    }
}
