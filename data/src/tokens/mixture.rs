//! Several prepared token sets drawn in fixed proportions, as LLM
//! Foundry's `streams` with their `proportion`s: a mixture file names
//! them,
//!
//! ```json
//! {"streams": {"web": {"local": "web-tokens", "proportion": 0.7},
//!              "code": {"local": "code-tokens", "proportion": 0.3}}}
//! ```
//!
//! (`local` relative to the file's folder), and each draw of the loader
//! takes its next sample from one of them.
//!
//! Which set a draw takes is fixed by the seed alone, in blocks of
//! [`BLOCK`] draws: each set has its whole share of a block (the
//! proportions rounded to whole draws, largest remainders first), placed
//! in the block by a seeded permutation. So every block holds the
//! proportions exactly, any draw's set and its place in that set's own
//! order are computed from the draw's number (a resumed run, or a run of
//! another process count, continues the same sequence), and each set is
//! walked in its own seeded order, epoch after epoch, as a set alone is.

use std::path::Path;
use std::sync::Arc;

use super::order::Permutation;
use super::TokenShards;
use crate::DataError;

/// Draws a block of the schedule holds.
pub const BLOCK: usize = 1024;

/// Named token sets and their draws a block.
pub struct Mixture {
    pub sets: Vec<(String, Arc<TokenShards>)>,
    /// Each set's draws in a block of [`BLOCK`].
    per_block: Vec<usize>,
    /// The proportions' sum as the file gives them (1 for one set).
    pub given_sum: f64,
}

impl Mixture {
    /// One set, every draw its own.
    pub fn single(shards: Arc<TokenShards>) -> Mixture {
        Mixture {
            sets: vec![("data".into(), shards)],
            per_block: vec![BLOCK],
            given_sum: 1.0,
        }
    }

    /// Whether `path` is a mixture file (a small JSON file with
    /// `streams`; a large `.json` data file is not read to tell).
    pub fn is_mixture(path: &Path) -> bool {
        path.extension().is_some_and(|e| e == "json")
            && std::fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() < 1 << 20)
            && std::fs::read_to_string(path)
                .ok()
                .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
                .is_some_and(|v| v.get("streams").is_some())
    }

    /// Reads a mixture file and opens its sets. Proportions are relative
    /// weights, normalised to sum to 1 (the sum given is kept in
    /// [`Mixture::given_sum`]); each must be finite and above 0, and so
    /// must their sum. Keys we do not read are refused.
    pub fn read(path: &Path) -> Result<Mixture, DataError> {
        let bad = |message: String| DataError::Rows {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|cause| DataError::Read {
            path: path.to_path_buf(),
            cause,
        })?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|cause| DataError::Json {
                path: path.to_path_buf(),
                cause,
            })?;
        only_keys(&v, &["streams"], "the mixture file").map_err(bad)?;
        let streams = v["streams"]
            .as_object()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| bad("`streams` must name one set or more: {\"NAME\": {\"local\": DIR, \"proportion\": P}}".into()))?;
        let folder = path.parent().unwrap_or(Path::new("."));
        let mut sets = Vec::new();
        let mut weights = Vec::new();
        for (name, s) in streams {
            only_keys(s, &["local", "proportion"], &format!("stream `{name}`")).map_err(bad)?;
            let local = s["local"]
                .as_str()
                .ok_or_else(|| bad(format!("stream `{name}` has no `local` folder")))?;
            let p = s["proportion"]
                .as_f64()
                .filter(|p| p.is_finite() && *p > 0.0)
                .ok_or_else(|| {
                    bad(format!(
                        "stream `{name}`'s `proportion` must be a finite number above 0"
                    ))
                })?;
            sets.push((
                name.clone(),
                Arc::new(TokenShards::open(&folder.join(local))?),
            ));
            weights.push(p);
        }
        let given_sum: f64 = weights.iter().sum();
        if !given_sum.is_finite() {
            return Err(bad(
                "its proportions sum past the largest number: give relative weights such as 0.7 and 0.3".into(),
            ));
        }
        let tokenizers: Vec<&str> = sets
            .iter()
            .map(|(_, s)| s.manifest.tokenizer.as_str())
            .collect();
        if tokenizers.iter().any(|t| *t != tokenizers[0]) {
            return Err(bad(
                "its streams were prepared with different tokenizers".into()
            ));
        }
        let per_block = shares(&weights, BLOCK);
        if let Some(k) = per_block.iter().position(|&n| n == 0) {
            return Err(bad(format!(
                "stream `{}`'s proportion is below one draw in {BLOCK}",
                sets[k].0
            )));
        }
        Ok(Mixture {
            sets,
            per_block,
            given_sum,
        })
    }

    /// The streams and their shares of the draws, and whether the
    /// proportions given were normalised: `web 0.700, code 0.300`.
    pub fn describe(&self) -> String {
        let shares: Vec<String> = self
            .sets
            .iter()
            .zip(self.proportions())
            .map(|((name, _), p)| format!("{name} {p:.3}"))
            .collect();
        let note = match (self.given_sum - 1.0).abs() > 1e-9 {
            true => format!(
                " (the proportions given sum to {}; normalised)",
                self.given_sum
            ),
            false => String::new(),
        };
        format!("{}{note}", shares.join(", "))
    }

    /// Each set's share of the draws (its draws a block over the block).
    pub fn proportions(&self) -> Vec<f64> {
        self.per_block
            .iter()
            .map(|&n| n as f64 / BLOCK as f64)
            .collect()
    }

    /// Samples in all the sets.
    pub fn len(&self) -> usize {
        self.sets.iter().map(|(_, s)| s.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The share of a row of `seq` slots a sample fills unpacked (each
    /// cut to the row), over the mixture as drawn: each set's by its
    /// share of the draws.
    pub fn unpacked_fill(&self, seq: usize) -> f64 {
        self.sets
            .iter()
            .zip(self.proportions())
            .map(|((_, s), p)| p * s.unpacked_fill(seq))
            .sum()
    }

    /// What the sets hold for rows of `seq` tokens, summed.
    pub fn stats(&self, seq: usize) -> crate::DataStats {
        self.sets
            .iter()
            .fold(crate::DataStats::default(), |mut a, (_, s)| {
                let b = s.stats(seq);
                a.samples += b.samples;
                a.tokens += b.tokens;
                a.learned += b.learned;
                a.cut += b.cut;
                a
            })
    }

    /// The mixture's identity: each set's, its name and share.
    pub fn fingerprint(&self) -> String {
        if let [(_, s)] = &self.sets[..] {
            return s.fingerprint();
        }
        let parts: Vec<String> = self
            .sets
            .iter()
            .zip(&self.per_block)
            .map(|((name, s), n)| format!("{name}:{n}:{}", s.fingerprint()))
            .collect();
        format!(
            "mixture:{:016x}",
            hlo_ir::rng::fnv1a(parts.join(",").as_bytes())
        )
    }

    /// The sets of block `block`'s draws, with each draw's count of earlier
    /// draws of its set in the block.
    pub(crate) fn block(&self, block: u64, seed: u64) -> Vec<(u16, u32)> {
        let order = Permutation::new(
            BLOCK as u64,
            seed ^ 0x6d69_7874 ^ block.wrapping_mul(0x9e37_79b9),
        );
        let bounds: Vec<usize> = self
            .per_block
            .iter()
            .scan(0, |acc, &n| {
                *acc += n;
                Some(*acc)
            })
            .collect();
        let mut seen = vec![0u32; self.sets.len()];
        (0..BLOCK as u64)
            .map(|p| {
                let slot = order.at(p) as usize;
                let set = bounds.partition_point(|&b| b <= slot);
                seen[set] += 1;
                (set as u16, seen[set] - 1)
            })
            .collect()
    }

    /// Draw `k`'s set and its number among that set's draws.
    pub(crate) fn draw(
        &self,
        k: u64,
        seed: u64,
        cache: &mut (u64, Vec<(u16, u32)>),
    ) -> (usize, u64) {
        // One set takes every draw.
        if self.sets.len() == 1 {
            return (0, k);
        }
        let (block, at) = (k / BLOCK as u64, (k % BLOCK as u64) as usize);
        if cache.0 != block || cache.1.is_empty() {
            *cache = (block, self.block(block, seed));
        }
        let (set, before) = cache.1[at];
        let set = set as usize;
        (set, block * self.per_block[set] as u64 + u64::from(before))
    }
}

/// Refuses a key of `v` (an object) that is not in `known`, naming
/// `what` and the keys read.
fn only_keys(v: &serde_json::Value, known: &[&str], what: &str) -> Result<(), String> {
    let Some(o) = v.as_object() else {
        return Err(format!("{what} must be a JSON object"));
    };
    match o.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(format!(
            "{what} has the key `{k}`, which hlo-train does not read (it reads {})",
            known
                .iter()
                .map(|k| format!("`{k}`"))
                .collect::<Vec<_>>()
                .join(", ")
        )),
        None => Ok(()),
    }
}

/// `weights` as whole shares of `total`: each its floor, then one more to
/// the largest remainders (the first on ties) until they sum to `total`.
fn shares(weights: &[f64], total: usize) -> Vec<usize> {
    let sum: f64 = weights.iter().sum();
    let exact: Vec<f64> = weights.iter().map(|w| w / sum * total as f64).collect();
    let mut n: Vec<usize> = exact.iter().map(|e| e.floor() as usize).collect();
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| (exact[b] - exact[b].floor()).total_cmp(&(exact[a] - exact[a].floor())));
    let short = total - n.iter().sum::<usize>();
    for &k in order.iter().take(short) {
        n[k] += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_sum_to_the_block_and_follow_the_weights() {
        assert_eq!(shares(&[0.7, 0.3], 1024), vec![717, 307]);
        assert_eq!(shares(&[1.0, 1.0, 1.0], 1024), vec![342, 341, 341]);
        assert_eq!(shares(&[2.0], 1024), vec![1024]);
    }
}
