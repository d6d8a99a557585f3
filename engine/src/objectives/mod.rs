//! What each objective adds to a run beyond the step `hlo-models` traces
//! for it: its data source, reference, settings (their table, checks and
//! record) and batches. SFT's samples and a preference objective's pairs
//! are rows of a dataset (`sft`); a preference objective may compute its
//! reference before training ([`preference`]); GRPO makes its batches by
//! generating and rewarding ([`grpo`]).

pub mod grpo;
pub mod preference;
pub(crate) mod sft;

use hlo_data::{DataStats, Tokenizer};
use hlo_models::adapter::Adapter;

use crate::error::Result;
use crate::inputs::model::Model;
use crate::run::spec::{Objective, RunSpec};

/// The folder of a run's reference adapter, as TRL chooses the
/// reference: `ref_adapter`, else a frozen copy of the adapter training
/// starts from (read again on resume); None: the base with the adapter
/// off.
pub(crate) fn reference_dir(spec: &RunSpec) -> Option<&std::path::PathBuf> {
    spec.preference
        .ref_adapter
        .as_ref()
        .or(spec.init_adapter.as_ref())
}

/// An objective's data for a run, read and checked before anything
/// compiles.
pub(crate) enum RunInputs {
    /// SFT's examples, a preference objective's pairs.
    Rows(sft::RowInputs),
    /// GRPO's prompts, or its logged rollouts.
    Rollouts(grpo::RolloutInputs),
}

impl RunInputs {
    /// Reads the data `spec`'s objective trains on.
    pub fn read(spec: &RunSpec, model: &Model, tokenizer: Option<&Tokenizer>) -> Result<RunInputs> {
        Ok(match spec.objective {
            Objective::Grpo => {
                RunInputs::Rollouts(grpo::RolloutInputs::read(spec, model, tokenizer)?)
            }
            Objective::Sft
            | Objective::Dpo
            | Objective::Ipo
            | Objective::Simpo
            | Objective::Orpo => RunInputs::Rows(sft::RowInputs::read(spec, model)?),
        })
    }

    /// The data's identity, recorded with the run.
    pub fn fingerprint(&self) -> &str {
        match self {
            RunInputs::Rows(r) => r.fingerprint(),
            RunInputs::Rollouts(r) => &r.fingerprint,
        }
    }

    /// What the data holds, for the run's header.
    pub fn stats(&self) -> DataStats {
        match self {
            RunInputs::Rows(r) => r.stats(),
            RunInputs::Rollouts(r) => r.stats,
        }
    }

    /// The objective's reference adapter (None: the base with the adapter
    /// off, or no reference): DPO's and IPO's, or GRPO's KL reference.
    pub fn reference(&self, spec: &RunSpec, model: &Model) -> Result<Option<Adapter>> {
        match self {
            RunInputs::Rows(_) => preference::reference_adapter(spec, model),
            RunInputs::Rollouts(_) => grpo::RolloutInputs::reference(spec, model),
        }
    }
}
