//! A reference model inside a traced step, as the preference losses and
//! KTO compare with one: the base with the adapter off, or a frozen
//! adapter whose tensors the step reads under `ref.` names (in the
//! trained adapter's LoRA form, or its own), never differentiated. Where
//! the policy equals its reference (a fresh adapter against the base, the
//! adapter training starts from against its frozen copy) the policy's own
//! log-probabilities are reused, so the rewards are exactly 0 and tie as
//! TRL's do, whatever order two compiled forwards happen to sum in.

use hlo_ir::{DType, Inputs, Tensor, TensorType};

use crate::decoder::{Decoder, LoraConfig, ModelConfig};
use crate::loss::TokenStats;
use crate::preference::{reference_name, Reference};
use crate::train::{lora_types, model, token_stats_of, TrainConfig};
use crate::ModelError;

/// The reference of a step whose loss compares with one.
pub(crate) struct ReferenceModel<'a> {
    /// A frozen adapter's tensors (`ref.` inputs), not the base.
    by_adapter: bool,
    /// That adapter's own LoRA settings, where not the trained adapter's.
    own: Option<&'a LoraConfig>,
    /// The trained adapter's tensors, and the reference adapter's.
    lora_params: Vec<(String, TensorType)>,
    ref_params: Vec<(String, TensorType)>,
    base: Decoder<'a>,
    frozen: Decoder<'a>,
}

impl<'a> ReferenceModel<'a> {
    /// The reference `reference` of a step under `tc` (`own`: a reference
    /// adapter's own settings), adding its `ref.` tensors to `inputs`.
    pub fn new(
        config: &'a ModelConfig,
        tc: &'a TrainConfig,
        reference: Reference,
        own: Option<&'a LoraConfig>,
        inputs: &mut Vec<(String, TensorType)>,
    ) -> Result<ReferenceModel<'a>, ModelError> {
        let by_adapter = reference == Reference::Adapter;
        let own = own.filter(|_| by_adapter);
        let lora_params = lora_types(config, tc, tc.lora.as_ref())?;
        let ref_params = match own {
            Some(l) => lora_types(config, tc, Some(l))?,
            None => lora_params.clone(),
        };
        if by_adapter {
            inputs.extend(
                ref_params
                    .iter()
                    .map(|(n, t)| (reference_name(n), t.clone())),
            );
        }
        Ok(ReferenceModel {
            by_adapter,
            own,
            lora_params,
            ref_params,
            base: Decoder {
                lora: None,
                ..model(config, tc)
            },
            frozen: Decoder {
                lora: own,
                ..model(config, tc)
            },
        })
    }

    /// The reference's token statistics of the batch in `i`
    /// (`policy_stats`: the policy's forward, which a reference adapter in
    /// the policy's form runs on its own tensors).
    pub fn stats(
        &self,
        i: &Inputs,
        tc: &TrainConfig,
        policy_stats: impl Fn(&Inputs) -> TokenStats,
    ) -> TokenStats {
        let frozen = || -> Vec<(String, Tensor)> {
            self.ref_params
                .iter()
                .map(|(n, _)| (n.clone(), i[reference_name(n).as_str()]))
                .collect()
        };
        match (self.by_adapter, self.own) {
            // The policy's form, on the reference's LoRA tensors.
            (true, None) => policy_stats(&i.with_overrides(&frozen())),
            // The adapter's own form, on its tensors.
            (true, Some(_)) => token_stats_of(&self.frozen, &i.with_overrides(&frozen()), tc, 1.0),
            (false, _) => token_stats_of(&self.base, i, tc, 1.0),
        }
    }

    /// 1 where the policy's LoRA tensors in `i` equal the reference's
    /// (its `ref.` copies, else the base's: every B zero), else 0; None
    /// when they can never be equal (a reference adapter of other
    /// settings) or there is nothing to compare. Decided on the devices,
    /// each step.
    pub fn same(&self, i: &Inputs) -> Option<Tensor> {
        if self.own.is_some() {
            return None;
        }
        self.lora_params
            .iter()
            .filter(|(n, _)| self.by_adapter || n.ends_with(".lora_b"))
            .map(|(n, _)| {
                let policy = i[n.as_str()].stop_gradient();
                let other = match self.by_adapter {
                    true => i[reference_name(n).as_str()],
                    false => policy.scalar_like(0.0).broadcast_to(&policy.dims()),
                };
                let all: Vec<i64> = (0..policy.rank() as i64).collect();
                policy.eq(other).cast(DType::F32).min(&all)
            })
            .reduce(|a, b| a.minimum(b))
    }
}

/// `mine` (without gradient) where `same` is 1, else `theirs`.
pub(crate) fn where_same(same: Tensor, mine: Tensor, theirs: Tensor) -> Tensor {
    let s = same.broadcast_in_dim(&mine.dims(), &[]);
    s.gt(s.scalar_like(0.5))
        .where_(mine.stop_gradient(), theirs)
}

/// A reference adapter's own LoRA settings beside a trained adapter of
/// settings `trained`: kept where they differ (another rank, alpha or
/// target set, as a PEFT model holding two adapters allows), else None
/// (the reference runs in the trained adapter's form).
pub(crate) fn own_lora(
    trained: Option<&LoraConfig>,
    reference: Option<&LoraConfig>,
) -> Option<LoraConfig> {
    reference.filter(|&r| Some(r) != trained).cloned()
}
