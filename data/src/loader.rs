//! Rows of fixed length from tokenized examples: cut or padded to `seq`,
//! optionally packed (several samples a row, kept apart by segment ids and
//! restarting positions), shuffled by a seed epoch after epoch, batched, and
//! with a cursor that fixes what comes next (so a resumed run sees the same
//! data).
//!
//! Each row is `seq` token ids and a mask: `loss_mask[t] = 1` when position
//! `t` predicts a token that counts (`t + 1` is a completion or text token,
//! not prompt or padding). Padding is token 0 with mask 0.

use hlo_ir::rng::Rng;

use crate::reader::Example;

/// A batch: `ids`, `loss_mask`, `positions` and `segment_ids`, each
/// `[batch, seq]` row-major (segment 0 is padding; unpacked rows hold one
/// segment).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub ids: Vec<i32>,
    pub loss_mask: Vec<f32>,
    pub positions: Vec<i32>,
    pub segment_ids: Vec<i32>,
    /// Tokens whose prediction counts.
    pub targets: usize,
}

impl Batch {
    fn empty(rows: usize, seq: usize) -> Batch {
        Batch {
            ids: vec![0; rows * seq],
            loss_mask: vec![0.0; rows * seq],
            positions: vec![0; rows * seq],
            segment_ids: vec![0; rows * seq],
            targets: 0,
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

    /// Slots holding a real token, over all slots.
    pub fn fill(&self) -> f64 {
        self.segment_ids.iter().filter(|&&s| s > 0).count() as f64 / self.ids.len().max(1) as f64
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

/// Examples cut or padded to `seq`, in a seeded order, epoch after epoch.
pub struct Loader {
    examples: Vec<Example>,
    seq: usize,
    batch: usize,
    seed: u64,
    /// Several samples per row (see [`Loader::packed`]).
    packing: bool,
    /// Examples handed out so far (the resume cursor; with packing a batch
    /// takes as many as fit, so the cursor alone fixes what comes next).
    pub cursor: u64,
}

impl Loader {
    pub fn new(examples: Vec<Example>, seq: usize, batch: usize, seed: u64) -> Loader {
        Loader {
            examples,
            seq,
            batch,
            seed,
            packing: false,
            cursor: 0,
        }
    }

    /// Packs rows: each takes whole samples, in order, while they fit (a
    /// sample longer than a row is cut and fills one alone).
    pub fn packed(mut self, packing: bool) -> Loader {
        self.packing = packing;
        self
    }

    /// Mean sample length (tokens), for deciding whether to pack.
    pub fn mean_len(&self) -> f64 {
        self.examples.iter().map(|e| e.ids.len()).sum::<usize>() as f64
            / self.examples.len().max(1) as f64
    }

    pub fn len(&self) -> usize {
        self.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// The permutation of epoch `epoch` (Fisher–Yates, seeded by seed and epoch).
    fn order(&self, epoch: u64) -> Vec<usize> {
        let mut rng = Rng::new(self.seed.wrapping_mul(0x9e37_79b9).wrapping_add(epoch));
        let mut idx: Vec<usize> = (0..self.examples.len()).collect();
        for i in (1..idx.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            idx.swap(i, j);
        }
        idx
    }

    /// The example at cursor position `k` (epochs reshuffled).
    fn at(&self, k: u64, cache: &mut (u64, Vec<usize>)) -> &Example {
        let n = self.examples.len() as u64;
        let (epoch, pos) = (k / n, (k % n) as usize);
        if cache.0 != epoch || cache.1.is_empty() {
            *cache = (epoch, self.order(epoch));
        }
        &self.examples[cache.1[pos]]
    }

    /// The next batch; the cursor advances by the examples it holds
    /// (`batch` of them, unpacked).
    pub fn next_batch(&mut self) -> Batch {
        let (seq, rows) = (self.seq, self.batch);
        let mut out = Batch::empty(rows, seq);
        let mut cache = (u64::MAX, Vec::new());
        let mut k = self.cursor;
        for row in 0..rows {
            let mut at = 0;
            let mut segment = 1;
            loop {
                let ex = self.at(k, &mut cache);
                let len = ex.ids.len().min(seq);
                if at > 0 && at + len > seq {
                    break;
                }
                at += out.put(ex, row, at, seq, segment);
                segment += 1;
                k += 1;
                if !self.packing || at >= seq {
                    break;
                }
            }
        }
        self.cursor = k;
        out
    }
}
