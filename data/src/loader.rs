//! Rows of fixed length from tokenized examples: cut or padded to `seq`,
//! optionally packed (several samples a row, kept apart by segment ids and
//! restarting positions), shuffled by a seed epoch after epoch, batched, and
//! with a cursor that fixes what comes next (so a resumed run sees the same
//! data).
//!
//! Each row is `seq` token ids and a mask: `loss_mask[t] = 1` when position
//! `t` predicts a token that counts (`t + 1` is a completion or text token,
//! not prompt or padding). Padding is token 0 with mask 0.

use std::borrow::Cow;
use std::sync::Arc;

use hlo_ir::rng::Rng;

use crate::pairs::PreferencePair;
use crate::reader::Example;
use crate::tokens::mixture::Mixture;
use crate::tokens::order::Permutation;
use crate::tokens::TokenShards;
use crate::unpaired::Unpaired;
use crate::DataError;

/// A batch: `ids`, `loss_mask`, `positions` and `segment_ids`, each
/// `[batch, seq]` row-major (segment 0 is padding; unpacked rows hold one
/// segment).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub ids: Vec<i32>,
    pub loss_mask: Vec<f32>,
    pub positions: Vec<i32>,
    pub segment_ids: Vec<i32>,
    /// A preference batch's reference log-probabilities, one per row
    /// (empty unless computed before training).
    pub ref_logps: Vec<f32>,
    /// A GRPO batch's advantage of each row (empty otherwise).
    pub advantages: Vec<f32>,
    /// A GRPO batch's per-token log-probabilities of the policy when the
    /// rollouts were made, and of the reference, `[batch, seq]` aligned
    /// as `loss_mask` (empty unless the loss reads them).
    pub old_logps: Vec<f32>,
    pub ref_token_logps: Vec<f32>,
    /// A KTO batch's label of each row, 1 desirable or 0 (empty
    /// otherwise).
    pub desirable: Vec<f32>,
    /// A reward model's batch: each pair's margin on both its rows (empty
    /// unless the data gives margins).
    pub margin: Vec<f32>,
    /// Tokens whose prediction counts.
    pub targets: usize,
    /// Slots of rows another process fills that hold a real token
    /// (counted, not written: see [`Loader::with_owned_rows`]).
    pub filled_elsewhere: usize,
}

impl Batch {
    /// `rows` rows of `seq` padding tokens, no field filled.
    pub fn empty(rows: usize, seq: usize) -> Batch {
        Batch {
            ids: vec![0; rows * seq],
            loss_mask: vec![0.0; rows * seq],
            positions: vec![0; rows * seq],
            segment_ids: vec![0; rows * seq],
            ref_logps: Vec::new(),
            advantages: Vec::new(),
            old_logps: Vec::new(),
            ref_token_logps: Vec::new(),
            desirable: Vec::new(),
            margin: Vec::new(),
            targets: 0,
            filled_elsewhere: 0,
        }
    }

    /// Writes `ex` (cut to what is left of the row) at slot `at` of row
    /// `row` as segment `segment`: position t predicts token t + 1 of the
    /// same sample. Returns the slots used.
    fn put(&mut self, ex: &Example, row: usize, at: usize, seq: usize, segment: i32) -> usize {
        let len = ex.ids.len().min(seq - at);
        let base = row * seq + at;
        for t in 0..len {
            self.ids[base + t] = ex.ids[t] as i32;
            self.positions[base + t] = t as i32;
            self.segment_ids[base + t] = segment;
            if t + 1 < len && ex.target[t + 1] {
                self.loss_mask[base + t] = 1.0;
                self.targets += 1;
            }
        }
        len
    }

    /// Writes `ex` alone at the start of row `row` of a batch of rows of
    /// `seq` tokens (cut to the row), as one segment.
    pub fn put_row(&mut self, ex: &Example, row: usize, seq: usize) {
        self.put(ex, row, 0, seq, 1);
    }

    /// Slots holding a real token, over all slots (those of rows another
    /// process fills too).
    pub fn fill(&self) -> f64 {
        let here = self.segment_ids.iter().filter(|&&s| s > 0).count();
        (here + self.filled_elsewhere) as f64 / self.ids.len().max(1) as f64
    }
}

/// Every example once, in file order, as batches of `batch` rows (the last
/// one padded with empty rows, which count nothing): the held-out set.
pub fn eval_batches(examples: &[Example], seq: usize, batch: usize) -> Vec<Batch> {
    examples
        .chunks(batch)
        .map(|chunk| {
            let mut b = Batch::empty(batch, seq);
            for (row, ex) in chunk.iter().enumerate() {
                b.put(ex, row, 0, seq, 1);
            }
            b
        })
        .collect()
}

/// Preference pairs once, in file order, as batches of `pairs` pairs
/// (rows as [`Loader::pairs`] lays them out; the last batch filled with
/// empty pairs, which count nothing): the held-out set.
/// `reference`: each pair's reference log-probabilities (chosen, rejected),
/// when computed before training.
pub fn eval_pair_batches(
    pairs: &[PreferencePair],
    seq: usize,
    per_batch: usize,
    reference: Option<&[[f32; 2]]>,
) -> Vec<Batch> {
    pairs
        .chunks(per_batch)
        .enumerate()
        .map(|(k, chunk)| {
            let mut b = Batch::empty(2 * per_batch, seq);
            if reference.is_some() {
                b.ref_logps = vec![0.0; 2 * per_batch];
            }
            for (row, pair) in chunk.iter().enumerate() {
                b.put(&pair.chosen, row, 0, seq, 1);
                b.put(&pair.rejected, per_batch + row, 0, seq, 1);
                if let Some(r) = reference {
                    let [c, j] = r[k * per_batch + row];
                    (b.ref_logps[row], b.ref_logps[per_batch + row]) = (c, j);
                }
            }
            b
        })
        .collect()
}

/// Examples cut or padded to `seq`, in a seeded order, epoch after epoch;
/// or preference pairs, each step's batch their chosen sides then their
/// rejected sides (see [`Loader::pairs`]).
pub struct Loader {
    examples: Vec<Example>,
    /// Each pair's rejected side, beside its chosen side in `examples`
    /// (empty unless loading pairs).
    rejected: Vec<Example>,
    /// Each pair's reference log-probabilities (chosen, rejected), when
    /// computed before training (else empty).
    reference: Vec<[f32; 2]>,
    seq: usize,
    batch: usize,
    seed: u64,
    /// Several samples per row (see [`Loader::packed`]).
    packing: bool,
    /// Each example's label (KTO's unpaired examples, read in order;
    /// empty otherwise): see [`Loader::unpaired`].
    labels: Vec<bool>,
    /// Each pair's margin (a reward model's pairs; empty otherwise): see
    /// [`Loader::with_margins`].
    margins: Vec<f32>,
    /// Every epoch in file order (see [`Loader::in_file_order`]).
    sequential: bool,
    /// Samples read from prepared token shards, in place of `examples`
    /// (see [`Loader::from_shards`], [`Loader::from_mixture`]).
    shards: Option<Arc<Mixture>>,
    /// Tokens and samples each set of a mixture gave the last batch
    /// (every row's).
    set_tokens: Vec<(usize, usize)>,
    /// The rows this process fills (None: all); see
    /// [`Loader::with_owned_rows`].
    owned: Option<Vec<bool>>,
    /// Examples handed out so far (the resume cursor; with packing a batch
    /// takes as many as fit, so the cursor alone fixes what comes next).
    pub cursor: u64,
}

impl Loader {
    pub fn new(examples: Vec<Example>, seq: usize, batch: usize, seed: u64) -> Loader {
        Loader {
            examples,
            rejected: Vec::new(),
            reference: Vec::new(),
            seq,
            batch,
            seed,
            packing: false,
            labels: Vec::new(),
            margins: Vec::new(),
            sequential: false,
            shards: None,
            set_tokens: Vec::new(),
            owned: None,
            cursor: 0,
        }
    }

    /// Samples of prepared token shards (memory-mapped, read one sample
    /// at a time), in a seeded global order epoch after epoch: a Feistel
    /// permutation of all the samples, computed one index at a time, so
    /// the loader's memory does not grow with the data (see
    /// [`crate::tokens::order`]). The cursor counts samples, as for
    /// examples in memory.
    pub fn from_shards(shards: Arc<TokenShards>, seq: usize, batch: usize, seed: u64) -> Loader {
        Loader::from_mixture(Arc::new(Mixture::single(shards)), seq, batch, seed)
    }

    /// Samples of several prepared sets in their proportions (see
    /// [`crate::tokens::mixture`]): each set walked in its own seeded
    /// order, the cursor counting draws over all of them.
    pub fn from_mixture(mixture: Arc<Mixture>, seq: usize, batch: usize, seed: u64) -> Loader {
        Loader {
            set_tokens: vec![(0, 0); mixture.sets.len()],
            shards: Some(mixture),
            ..Loader::new(Vec::new(), seq, batch, seed)
        }
    }

    /// Each set's tokens and samples in the last batch, by name (a
    /// mixture of more than one set; else none): what the metrics report
    /// per set. `share` is the set's share of the batch's tokens,
    /// `draws` its share of the samples drawn (what the proportions fix;
    /// a set of longer samples takes a larger share of the tokens).
    pub fn set_figures(&self) -> Vec<(String, f64)> {
        match &self.shards {
            Some(m) if m.sets.len() > 1 => {
                let tokens: usize = self.set_tokens.iter().map(|t| t.0).sum();
                let samples: usize = self.set_tokens.iter().map(|t| t.1).sum();
                m.sets
                    .iter()
                    .zip(&self.set_tokens)
                    .flat_map(|((name, _), &(t, n))| {
                        [
                            (format!("data/{name}/tokens"), t as f64),
                            (
                                format!("data/{name}/share"),
                                t as f64 / tokens.max(1) as f64,
                            ),
                            (format!("data/{name}/samples"), n as f64),
                            (
                                format!("data/{name}/draws"),
                                n as f64 / samples.max(1) as f64,
                            ),
                        ]
                    })
                    .collect()
            }
            _ => Vec::new(),
        }
    }

    /// Fills only the rows `owned` marks (one flag a row of a batch):
    /// this process's share of each global batch. The other rows are left
    /// empty, their samples still taken in order (told apart by their
    /// lengths alone, which packing needs), so every process's loader
    /// walks the same global sequence whatever the number of processes.
    /// Their learned tokens and filled slots are still counted (from the
    /// loss masks alone), so a batch's `targets` and `fill` are the global
    /// batch's in every process.
    pub fn with_owned_rows(mut self, owned: Vec<bool>) -> Loader {
        assert_eq!(owned.len(), self.batch, "one flag a row");
        self.owned = Some(owned);
        self
    }

    /// KTO's unpaired examples in file order (TRL's sequential sampling,
    /// epoch after epoch), `per_batch` a batch: rows `0..per_batch` the
    /// examples, and with `kl` the rows after them each prompt with the
    /// completion of the example before it in its batch (the batch's
    /// first with its last), TRL's KL rows. The examples past the last
    /// whole batch are left out (TRL's last, shorter batch has no place in
    /// a step of fixed shape). The cursor counts examples.
    pub fn unpaired(rows: Vec<Unpaired>, seq: usize, per_batch: usize, kl: bool) -> Loader {
        let whole = rows.len() - rows.len() % per_batch.max(1);
        let (examples, labels): (Vec<Example>, Vec<bool>) = rows
            .into_iter()
            .take(whole)
            .map(|u| (u.example, u.desirable))
            .unzip();
        let mismatched = match kl {
            true => kl_rows(&examples, per_batch),
            false => Vec::new(),
        };
        Loader {
            rejected: mismatched,
            labels,
            ..Loader::new(examples, seq, per_batch, 0)
        }
    }

    /// Preference pairs in a seeded order, `per_batch` pairs a batch of
    /// `2 · per_batch` rows: rows `0..per_batch` the pairs' prompt and
    /// chosen completion, the rows after them the same pairs' prompt and
    /// rejected completion, each cut to `seq` (keeping its start, as TRL
    /// 1.16 cuts) and right-padded; `segment_ids` is 1 on real tokens. The
    /// cursor counts pairs.
    pub fn pairs(pairs: Vec<PreferencePair>, seq: usize, per_batch: usize, seed: u64) -> Loader {
        let (chosen, rejected) = pairs.into_iter().map(|p| (p.chosen, p.rejected)).unzip();
        Loader {
            rejected,
            ..Loader::new(chosen, seq, per_batch, seed)
        }
    }

    /// Pairs with their margins (a reward model's `margin` column), one
    /// per pair in the order given to [`Loader::pairs`]: batches then
    /// carry each on both of its pair's rows, in `margin`.
    pub fn with_margins(mut self, margins: Vec<f32>) -> Loader {
        assert_eq!(margins.len(), self.examples.len(), "one per pair");
        self.margins = margins;
        self
    }

    /// Packs rows: each takes whole samples, in order, while they fit (a
    /// sample longer than a row is cut and fills one alone).
    pub fn packed(mut self, packing: bool) -> Loader {
        self.packing = packing;
        self
    }

    /// The share of a row's slots a sample fills unpacked, each sample
    /// cut to the row (a pair's two sides both counted; a mixture's sets
    /// by their shares of the draws): what decides `--packing auto`, and
    /// what packing is compared with.
    pub fn unpacked_fill(&self) -> f64 {
        if let Some(m) = &self.shards {
            return m.unpacked_fill(self.seq);
        }
        let seq = self.seq.max(1);
        let sides = self.examples.iter().chain(&self.rejected);
        let kept: usize = sides.map(|e| e.ids.len().min(seq)).sum();
        let n = self.examples.len() + self.rejected.len();
        kept as f64 / (n.max(1) * seq) as f64
    }

    pub fn len(&self) -> usize {
        match &self.shards {
            Some(s) => s.len(),
            None => self.examples.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every epoch in file order (`sequential`: transformers'
    /// `train_sampling_strategy="sequential"`), not a seeded shuffle.
    pub fn in_file_order(mut self, sequential: bool) -> Loader {
        self.sequential = sequential;
        self
    }

    /// The permutation of epoch `epoch` (Fisher–Yates, seeded by seed and
    /// epoch; the identity in file order).
    fn order(&self, epoch: u64) -> Vec<usize> {
        if self.sequential {
            return (0..self.examples.len()).collect();
        }
        let mut rng = Rng::new(self.seed.wrapping_mul(0x9e37_79b9).wrapping_add(epoch));
        let mut idx: Vec<usize> = (0..self.examples.len()).collect();
        for i in (1..idx.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            idx.swap(i, j);
        }
        idx
    }

    /// Each example beside its second row (a pair's rejected side, a KTO
    /// example's KL row; itself where it has none), in the order
    /// [`Loader::with_reference`] takes their scores.
    pub fn scored_sides(&self) -> Vec<PreferencePair> {
        let second = |i: usize| self.rejected.get(i).unwrap_or(&self.examples[i]).clone();
        (0..self.examples.len())
            .map(|i| PreferencePair {
                chosen: self.examples[i].clone(),
                rejected: second(i),
            })
            .collect()
    }

    /// Pairs with their reference log-probabilities (chosen, rejected),
    /// one per pair in the order given to [`Loader::pairs`]: batches then
    /// carry them in `ref_logps`.
    /// (KTO's unpaired examples: each example's and its KL row's.)
    pub fn with_reference(mut self, reference: Vec<[f32; 2]>) -> Loader {
        assert_eq!(
            reference.len(),
            self.examples.len(),
            "one per pair or example"
        );
        self.reference = reference;
        self
    }

    /// The set and sample of draw `k` (epochs reshuffled): of a mixture
    /// of prepared sets, the set the schedule gives and the next sample
    /// of that set's own order; else the example's index.
    fn pick(&self, k: u64, cache: &mut Draws) -> (usize, usize) {
        let Some(m) = &self.shards else {
            return (0, self.index_at(k, &mut cache.order));
        };
        let (set, c) = m.draw(k, self.seed, &mut cache.block);
        let n = m.sets[set].1.len() as u64;
        let (epoch, pos) = (c / n, c % n);
        if self.sequential {
            return (set, pos as usize);
        }
        // (Set 0's order is that of a set alone.)
        let seed = self.seed.wrapping_mul(0x9e37_79b9).wrapping_add(epoch)
            ^ (set as u64).wrapping_mul(0xa24b_aed4_963e_e407);
        (set, Permutation::new(n, seed).at(pos) as usize)
    }

    /// The index of the example at cursor position `k` (epochs
    /// reshuffled).
    fn index_at(&self, k: u64, cache: &mut (u64, Vec<usize>)) -> usize {
        let n = self.examples.len() as u64;
        let (epoch, pos) = (k / n, (k % n) as usize);
        if cache.0 != epoch || cache.1.is_empty() {
            *cache = (epoch, self.order(epoch));
        }
        cache.1[pos]
    }

    /// The length of sample `i` of set `set`, in tokens.
    fn sample_len(&self, (set, i): (usize, usize)) -> usize {
        match &self.shards {
            Some(m) => m.sets[set].1.sample_len(i),
            None => self.examples[i].ids.len(),
        }
    }

    /// The predictions a row holding the first `len` tokens of sample
    /// `i` of set `set` counts (as [`Batch::put`] counts them).
    fn learned_within(&self, (set, i): (usize, usize), len: usize) -> Result<usize, DataError> {
        match &self.shards {
            Some(m) => m.sets[set].1.learned_within(i, len),
            None => Ok(self.examples[i].learned_within(len)),
        }
    }

    /// Sample `i` of set `set` (from shards: its first `seq` tokens, read
    /// now).
    fn sample(&self, (set, i): (usize, usize)) -> Result<Cow<'_, Example>, DataError> {
        match &self.shards {
            Some(m) => Ok(Cow::Owned(m.sets[set].1.sample(i, self.seq)?)),
            None => Ok(Cow::Borrowed(&self.examples[i])),
        }
    }

    /// Whether this process fills row `row`.
    fn owns(&self, row: usize) -> bool {
        self.owned.as_ref().is_none_or(|o| o[row])
    }

    /// The next batch of pairs.
    fn next_pairs(&mut self) -> Batch {
        let (seq, pairs) = (self.seq, self.batch);
        let mut out = Batch::empty(2 * pairs, seq);
        if !self.reference.is_empty() {
            out.ref_logps = vec![0.0; 2 * pairs];
        }
        if !self.margins.is_empty() {
            out.margin = vec![0.0; 2 * pairs];
        }
        let mut cache = (u64::MAX, Vec::new());
        for row in 0..pairs {
            let i = self.index_at(self.cursor, &mut cache);
            out.put(&self.examples[i], row, 0, seq, 1);
            out.put(&self.rejected[i], pairs + row, 0, seq, 1);
            if let Some(&m) = self.margins.get(i) {
                (out.margin[row], out.margin[pairs + row]) = (m, m);
            }
            if let Some(&[c, r]) = self.reference.get(i) {
                (out.ref_logps[row], out.ref_logps[pairs + row]) = (c, r);
            }
            self.cursor += 1;
        }
        out
    }

    /// The next batch of unpaired examples (see [`Loader::unpaired`]).
    fn next_unpaired(&mut self) -> Batch {
        let (seq, n) = (self.seq, self.batch);
        let kl = !self.rejected.is_empty();
        let rows = if kl { 2 * n } else { n };
        let mut out = Batch::empty(rows, seq);
        out.desirable = vec![0.0; rows];
        if !self.reference.is_empty() {
            out.ref_logps = vec![0.0; rows];
        }
        for row in 0..n {
            let i = (self.cursor % self.examples.len().max(1) as u64) as usize;
            out.put(&self.examples[i], row, 0, seq, 1);
            let label = if self.labels[i] { 1.0 } else { 0.0 };
            out.desirable[row] = label;
            let reference = self.reference.get(i);
            if let Some(&[r, _]) = reference {
                out.ref_logps[row] = r;
            }
            if kl {
                out.put(&self.rejected[i], n + row, 0, seq, 1);
                out.desirable[n + row] = label;
                if let Some(&[_, r]) = reference {
                    out.ref_logps[n + row] = r;
                }
            }
            self.cursor += 1;
        }
        out
    }

    /// The next batch; the cursor advances by the examples it holds
    /// (`batch` of them, unpacked; `batch` pairs of them). An error only
    /// from prepared shards: a shard found damaged when first read.
    pub fn next_batch(&mut self) -> Result<Batch, DataError> {
        if !self.labels.is_empty() {
            return Ok(self.next_unpaired());
        }
        if !self.rejected.is_empty() {
            return Ok(self.next_pairs());
        }
        let (seq, rows) = (self.seq, self.batch);
        let mut out = Batch::empty(rows, seq);
        let mut cache = Draws::default();
        self.set_tokens.iter_mut().for_each(|t| *t = (0, 0));
        let mut k = self.cursor;
        for row in 0..rows {
            let own = self.owns(row);
            let mut at = 0;
            let mut segment = 1;
            loop {
                let i = self.pick(k, &mut cache);
                let len = self.sample_len(i).min(seq);
                if at > 0 && at + len > seq {
                    break;
                }
                if let Some(t) = self.set_tokens.get_mut(i.0) {
                    *t = (t.0 + len, t.1 + 1);
                }
                if own {
                    let sample = self.sample(i)?;
                    out.put(&sample, row, at, seq, segment);
                } else {
                    let used = len.min(seq - at);
                    out.targets += self.learned_within(i, used)?;
                    out.filled_elsewhere += used;
                }
                at += len;
                segment += 1;
                k += 1;
                if !self.packing || at >= seq {
                    break;
                }
            }
        }
        self.cursor = k;
        Ok(out)
    }
}

/// What draws computed last, kept while a batch is made: an epoch's
/// order of examples in memory, a block of a mixture's schedule.
struct Draws {
    order: (u64, Vec<usize>),
    block: (u64, Vec<(u16, u32)>),
}

impl Default for Draws {
    fn default() -> Draws {
        Draws {
            order: (u64::MAX, Vec::new()),
            block: (u64::MAX, Vec::new()),
        }
    }
}

/// KTO's KL rows of `examples` in batches of `per_batch` (TRL's): each
/// example's prompt with the completion of the example before it in its
/// batch, the batch's first with its last.
fn kl_rows(examples: &[Example], per_batch: usize) -> Vec<Example> {
    examples
        .chunks(per_batch.max(1))
        .flat_map(|c| (0..c.len()).map(move |k| kl_example(&c[k], &c[(k + c.len() - 1) % c.len()])))
        .collect()
}

/// `prompt`'s prompt followed by `other`'s completion (a KL row).
fn kl_example(prompt: &Example, other: &Example) -> Example {
    let cut = |e: &Example| e.target.iter().position(|&t| t).unwrap_or(e.ids.len());
    let (p, o) = (cut(prompt), cut(other));
    Example {
        ids: prompt.ids[..p]
            .iter()
            .chain(&other.ids[o..])
            .copied()
            .collect(),
        target: (0..p)
            .map(|_| false)
            .chain(other.target[o..].iter().copied())
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A side of a pair: `prompt` unlearned tokens, then `completion`
    /// learned ones (ids counting up from `first`).
    fn side(prompt: usize, completion: usize, first: u32) -> Example {
        let n = prompt + completion;
        Example {
            ids: (first..first + n as u32).collect(),
            target: (0..n).map(|t| t >= prompt).collect(),
        }
    }

    /// Two processes each filling half the rows of examples in memory:
    /// together the global batch, and each counts its learned tokens and
    /// fill.
    #[test]
    fn owned_rows_split_a_batch_and_each_process_counts_the_whole() {
        let examples: Vec<Example> = (0..10)
            .map(|k| side(1 + k % 3, 2 + k % 4, 10 * k as u32))
            .collect();
        let (seq, rows) = (8, 4);
        for packing in [false, true] {
            let make = || Loader::new(examples.clone(), seq, rows, 3).packed(packing);
            let mut global = make();
            let mut halves: Vec<Loader> = (0..2)
                .map(|p| make().with_owned_rows((0..rows).map(|r| r / 2 == p).collect()))
                .collect();
            for _ in 0..5 {
                let want = global.next_batch().unwrap();
                for (p, half) in halves.iter_mut().enumerate() {
                    let got = half.next_batch().unwrap();
                    let mine = 2 * p * seq..2 * (p + 1) * seq;
                    assert_eq!(got.ids[mine.clone()], want.ids[mine.clone()]);
                    assert_eq!(got.loss_mask[mine.clone()], want.loss_mask[mine]);
                    assert_eq!((got.targets, got.fill()), (want.targets, want.fill()));
                }
            }
        }
    }

    /// Samples of 4 and 12 tokens in rows of 8: unpacked, the second is
    /// cut to 8, so 12 of 16 slots hold tokens (their mean length, 8,
    /// would say every slot); a pair counts both its sides.
    #[test]
    fn the_unpacked_fill_counts_samples_as_cut_to_the_row() {
        let examples = vec![side(1, 3, 0), side(2, 10, 50)];
        assert_eq!(Loader::new(examples.clone(), 8, 2, 0).unpacked_fill(), 0.75);
        let pairs = vec![PreferencePair {
            chosen: side(1, 1, 0),
            rejected: side(2, 10, 9),
        }];
        assert_eq!(Loader::pairs(pairs, 8, 1, 0).unpacked_fill(), 10.0 / 16.0);
        // Filled whole, the rows hold what the figure says.
        let b = Loader::new(examples, 8, 2, 0).next_batch().unwrap();
        assert_eq!(b.fill(), 0.75);
    }

    #[test]
    fn a_pair_batch_holds_the_chosen_rows_then_the_same_pairs_rejected_rows() {
        let pairs: Vec<PreferencePair> = (0..3)
            .map(|k| PreferencePair {
                chosen: side(2, 1 + k, 100 * k as u32 + 1),
                rejected: side(2, 3, 100 * k as u32 + 50),
            })
            .collect();
        let seq = 6;
        let mut loader = Loader::pairs(pairs.clone(), seq, 2, 7);
        let mut seen = Vec::new();
        for _ in 0..3 {
            let b = loader.next_batch().unwrap();
            assert_eq!(b.ids.len(), 4 * seq);
            for row in 0..2 {
                // Row `row` and row `2 + row` are one pair's two sides.
                let chosen = &b.ids[row * seq..(row + 1) * seq];
                let rejected = &b.ids[(2 + row) * seq..(3 + row) * seq];
                let k = (chosen[0] / 100) as usize;
                assert_eq!(rejected[0], 100 * k as i32 + 50, "{b:?}");
                let len = pairs[k].chosen.ids.len();
                assert!(chosen[len..].iter().all(|&t| t == 0));
                // Learned: positions predicting the completion's tokens.
                let mask = &b.loss_mask[row * seq..(row + 1) * seq];
                let want: Vec<f32> = (0..seq)
                    .map(|t| f32::from(u8::from(t + 1 >= 2 && t + 1 < len)))
                    .collect();
                assert_eq!(mask, want.as_slice());
                let real = &b.segment_ids[row * seq..(row + 1) * seq];
                assert_eq!(real.iter().filter(|&&s| s == 1).count(), len);
                seen.push(k);
            }
        }
        // Two epochs' worth of draws: each pair twice, in a seeded order.
        assert_eq!(loader.cursor, 6);
        let mut sorted = seen.clone();
        sorted.sort();
        assert_eq!(sorted, [0, 0, 1, 1, 2, 2]);
    }

    #[test]
    fn held_out_pairs_fill_the_last_batch_with_empty_pairs() {
        let pairs = vec![
            PreferencePair {
                chosen: side(1, 2, 1),
                rejected: side(1, 1, 9),
            };
            3
        ];
        let b = eval_pair_batches(&pairs, 4, 2, None);
        assert_eq!(b.len(), 2);
        // The second batch: one pair (rows 0 and 2), rows 1 and 3 empty.
        let last = &b[1];
        let row = |r: usize| &last.segment_ids[r * 4..(r + 1) * 4];
        assert_eq!(row(0), [1, 1, 1, 0]);
        assert_eq!(row(2), [1, 1, 0, 0]);
        assert!(row(1).iter().chain(row(3)).all(|&s| s == 0));
        assert_eq!(last.targets, 3);
    }
}
