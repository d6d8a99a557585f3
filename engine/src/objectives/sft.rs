//! SFT, and the preference objectives' pairs: rows of a dataset read
//! whole before anything compiles, batched by the data crate's `Loader`
//! (examples packed when that fills rows better; pairs never packed), a
//! held-out set scored in the same form.

use hlo_data::{eval_batches, eval_pair_batches, Batch, DataStats, Loader, PreferencePair};
use hlo_models::adapter::Adapter;
use hlo_models::train::TrainConfig;

use hlo_models::preference::Reference;
use hlo_models::train::Loss;

use super::{Data, ObjectiveDef, ObjectiveSpecs};
use crate::device::backend::Backend;
use crate::error::Result;
use crate::inputs::dataset::{DataSpec, Dataset, SamplingStrategy};
use crate::inputs::model::Model;
use crate::objectives::RunView;
use crate::step::Toggle;

/// Supervised finetuning: the causal-LM loss over samples.
pub(crate) struct Sft;

pub(crate) static SFT: Sft = Sft;

impl ObjectiveDef for Sft {
    fn name(&self) -> &'static str {
        "sft"
    }

    fn data(&self) -> Data {
        Data::Samples
    }

    fn reads(&self, _name: &str) -> bool {
        false
    }

    fn loss(&self, _specs: &ObjectiveSpecs, _reference: Reference) -> Loss {
        Loss::CausalLm
    }
}

/// A row objective's data, read and checked.
pub(crate) struct RowInputs {
    data: Dataset,
    held_out: Option<Dataset>,
}

/// What a row objective feeds the trainer, once its step is decided.
pub(crate) struct RowFeed {
    /// Its batches, packed or not (the trainer's source).
    pub loader: Loader,
    pub eval: Vec<Batch>,
    /// Whether the run has a held-out set (its batches may be none).
    pub has_eval: bool,
    /// Samples (or pairs) with something to learn within a row.
    pub learning: usize,
    /// How full an unpacked row is on average, 0 to 1.
    pub unpacked_fill: f64,
}

impl RowInputs {
    /// Reads the run's data (pairs for a preference objective) and its
    /// held-out set.
    pub fn read(spec: &RunView, model: &Model) -> Result<RowInputs> {
        let data_spec = DataSpec {
            path: spec.data.path.clone(),
            chat: spec.data.chat.clone(),
            seq: spec.step.seq as usize,
            pairs: spec.objective.is_preference(),
            unpaired: spec.objective.data() == Data::Unpaired,
            whole_pairs: spec.objective.def().classifier(),
        };
        let data = Dataset::read(model, &data_spec, spec.seed)?;
        let held_out = Dataset::held_out(model, &data_spec, spec.eval_data, spec.seed)?;
        Ok(RowInputs { data, held_out })
    }

    pub fn fingerprint(&self) -> &str {
        &self.data.fingerprint
    }

    pub fn stats(&self) -> DataStats {
        self.data.stats
    }

    /// A mixture's streams and their shares of the draws (None for one
    /// set or data read from files).
    pub fn streams(&self) -> Option<String> {
        let m = self.data.shards.as_ref().filter(|m| m.sets.len() > 1)?;
        Some(m.describe())
    }

    /// The loader and held-out batches of step `tc`, whose packing is
    /// decided here when `auto`; a precomputed reference (`reference`)
    /// scores the pairs first.
    pub fn feed(
        self,
        spec: &RunView,
        (backend, model): (&Backend, &Model),
        tc: &mut TrainConfig,
        reference: Option<&Adapter>,
    ) -> Result<RowFeed> {
        let seq = spec.step.seq as usize;
        let per_batch = spec.step.batch as usize;
        let score = |pairs: &[PreferencePair]| {
            super::preference::reference_scores(backend, model, tc, reference, pairs, spec.seed)
        };
        if spec.objective.data() == Data::Unpaired {
            return self.unpaired_feed(spec, (backend, model), tc, reference);
        }
        if self.data.whole {
            return self.whole_pairs_feed(spec);
        }
        let preference = spec.objective.is_preference();
        let (loader, learning) = if preference {
            // Pairs whose prompt fills the row are left out (TRL's filter).
            let pairs = self.data.learning_pairs(seq)?;
            let n = pairs.len();
            let scores = score(&pairs)?;
            let loader = Loader::pairs(pairs, seq, per_batch, spec.seed);
            let loader = match scores {
                Some(s) => loader.with_reference(s),
                None => loader,
            };
            (loader, n)
        } else if let Some(shards) = self.data.shards.clone() {
            // Prepared tokens: every sample, in a global order computed
            // one index at a time.
            let n = shards.len();
            (
                Loader::from_mixture(shards, seq, tc.rows() as usize, spec.seed),
                n,
            )
        } else {
            // Samples with nothing to learn within a row are left out.
            let examples = self.data.learning(seq)?;
            let n = examples.len();
            // A step takes `grad_accum` micro-batches of `batch` rows.
            (Loader::new(examples, seq, tc.rows() as usize, spec.seed), n)
        };
        let has_eval = self.held_out.is_some();
        let eval = match self.held_out {
            Some(e) if preference => {
                let scores = score(&e.pairs)?;
                eval_pair_batches(&e.pairs, seq, per_batch, scores.as_deref())
            }
            Some(e) => eval_batches(&e.first_examples(usize::MAX, seq)?, seq, per_batch),
            None => Vec::new(),
        };
        let unpacked_fill = loader.unpacked_fill();
        if spec.step.packing == Toggle::Auto && !preference {
            tc.packing = crate::step::auto_packing(unpacked_fill);
        }
        Ok(RowFeed {
            loader: loader
                .packed(tc.packing)
                .in_file_order(spec.data.sampling == SamplingStrategy::Sequential),
            eval,
            has_eval,
            learning,
            unpacked_fill,
        })
    }

    /// The loader of a reward model's pairs: those whose sides both fit
    /// in a row (TRL's filter), each pair's margin on its rows (0 where
    /// the data gives none); no held-out set yet.
    fn whole_pairs_feed(self, spec: &RunView) -> Result<RowFeed> {
        let (seq, per_batch) = (spec.step.seq as usize, spec.step.batch as usize);
        let (pairs, mut margins) = self.data.fitting_pairs(seq)?;
        let learning = pairs.len();
        if margins.is_empty() {
            margins = vec![0.0; learning];
        }
        let loader = Loader::pairs(pairs, seq, per_batch, spec.seed)
            .with_margins(margins)
            .in_file_order(spec.data.sampling == SamplingStrategy::Sequential);
        let unpacked_fill = loader.unpacked_fill();
        Ok(RowFeed {
            loader,
            eval: Vec::new(),
            has_eval: false,
            learning,
            unpacked_fill,
        })
    }

    /// The loader of unpaired examples, in file order (see
    /// `Loader::unpaired`), the step's rows telling whether each example
    /// brings a KL row; a precomputed reference scores each example and
    /// its KL row first; no held-out set.
    fn unpaired_feed(
        self,
        spec: &RunView,
        (backend, model): (&Backend, &Model),
        tc: &TrainConfig,
        reference: Option<&Adapter>,
    ) -> Result<RowFeed> {
        let (seq, per_batch) = (spec.step.seq as usize, spec.step.batch as usize);
        let rows = self.data.learning_unpaired(seq)?;
        if rows.len() < per_batch {
            return Err(crate::error::EngineError::Objective {
                objective: spec.objective.name(),
                why: format!(
                    "the data holds {} examples with something to learn within --seq {seq}, fewer than a batch of {per_batch}",
                    rows.len()
                ),
            });
        }
        let kl = tc.loss.step_loss().rows_per_example() == 2;
        let loader = Loader::unpaired(rows, seq, per_batch, kl);
        let loader = match tc.loss.step_loss().reference() {
            Some(Reference::Precomputed) => {
                let sides = loader.scored_sides();
                // Scored `per_batch` examples at a time, two rows each.
                let scoring = TrainConfig {
                    batch: 2 * per_batch as i64,
                    ..tc.clone()
                };
                let scores = super::preference::reference::precompute(
                    backend, model, &scoring, reference, &sides, spec.seed,
                )?;
                loader.with_reference(scores)
            }
            _ => loader,
        };
        let unpacked_fill = loader.unpacked_fill();
        // The examples of whole batches, those the loader keeps.
        let learning = loader.len();
        Ok(RowFeed {
            loader,
            eval: Vec::new(),
            has_eval: false,
            learning,
            unpacked_fill,
        })
    }
}
