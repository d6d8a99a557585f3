//! What each input of a step is. Donation, checkpoints, initialisation,
//! sharding and memory accounting read these roles; none of them parses a
//! tensor's name.

use hlo_ir::Function;

/// One field of a training batch, each `[batch, seq]` (with a leading
/// micro-batch axis under gradient accumulation).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BatchField {
    /// Token ids (i32).
    InputIds,
    /// 1 where position `t`'s prediction of token `t + 1` counts (f32).
    LossMask,
    /// Each token's position within its sample (packed rows only).
    Positions,
    /// Which sample of the row a token belongs to, 0 for padding (packed
    /// rows only).
    SegmentIds,
    /// A preference batch's reference log-probabilities, computed before
    /// training: one f32 per row (`[rows]`, not `[rows, seq]`).
    RefLogps,
    /// A GRPO batch's advantage of each completion (`[rows]`, f32).
    Advantages,
    /// A GRPO batch's per-token log-probabilities of the policy when the
    /// rollouts were made (`[rows, seq]` f32, aligned as the loss mask).
    OldLogps,
    /// A GRPO batch's per-token log-probabilities of the reference model
    /// (`[rows, seq]` f32, aligned as the loss mask).
    RefTokenLogps,
    /// A KTO batch's label of each row: 1 desirable, 0 undesirable
    /// (`[rows]`, f32).
    Desirable,
    /// A reward model's pair margin, on each of the pair's rows (`[rows]`
    /// f32; the loss reads the chosen rows').
    Margin,
}

impl BatchField {
    /// The step input's name (also the partition rules' key).
    pub fn name(self) -> &'static str {
        match self {
            BatchField::InputIds => "input_ids",
            BatchField::LossMask => "loss_mask",
            BatchField::Positions => "positions",
            BatchField::SegmentIds => "segment_ids",
            BatchField::RefLogps => "ref_logps",
            BatchField::Advantages => "advantages",
            BatchField::OldLogps => "old_logps",
            BatchField::RefTokenLogps => "ref_token_logps",
            BatchField::Desirable => "desirable",
            BatchField::Margin => "pair_margin",
        }
    }
}

/// AdamW's first or second moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Moment {
    /// `m`, the running mean of gradients.
    First,
    /// `v`, the running mean of squared gradients.
    Second,
}

/// What a step input is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// A model weight the step reads and does not change (the frozen base
    /// weights under LoRA; every parameter of a generation program).
    Weight,
    /// A parameter the step trains, returned updated under the same name:
    /// the LoRA tensors, or every base weight when finetuning fully.
    Trainable,
    /// Optimizer state of the trainable input named `of`.
    OptimizerState { of: String, moment: Moment },
    /// One field of the batch.
    Batch(BatchField),
    /// Optimizer steps taken so far (drives the schedule and AdamW's bias
    /// correction).
    StepCounter,
    /// A layer's key or value cache (generation), updated in place.
    KvCache,
    /// The sampler's random state (generation), updated in place.
    RngState,
    /// A table of adapters served together (one entry per resident
    /// adapter), read by serving programs and updated in place by the
    /// program that loads an adapter.
    AdapterTable,
    /// A small per-call input of generation: new tokens, padding offsets,
    /// the cache position, sampling settings.
    Control,
}

impl Role {
    /// Saved in a training checkpoint: what the run has learned so far.
    pub fn is_checkpointed(&self) -> bool {
        matches!(
            self,
            Role::Trainable | Role::OptimizerState { .. } | Role::StepCounter
        )
    }
}

/// One input of a step: its role, and whether it carries a leading axis
/// the partition rules do not describe (the layers of a scan over stacked
/// parameters, the micro-batches of gradient accumulation), which stays
/// unsplit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepInput {
    pub role: Role,
    pub leading_axis: bool,
}

/// A traced program and what each of its inputs is.
#[derive(Clone, Debug)]
pub struct Step {
    pub function: Function,
    /// One per input of `function`, in order.
    pub inputs: Vec<StepInput>,
    /// (input, output) pairs whose buffers the step updates in place.
    pub donated: Vec<(usize, usize)>,
}

impl Step {
    /// `function` with the roles given by `role(name)` and donation of
    /// every input that has an output of the same name (state the step
    /// updates).
    pub fn new(function: Function, role: impl Fn(&str) -> StepInput) -> Step {
        let inputs = function.inputs.iter().map(|b| role(&b.name)).collect();
        let donated = function
            .inputs
            .iter()
            .enumerate()
            .filter_map(|(k, b)| {
                function
                    .outputs
                    .iter()
                    .position(|o| o.name == b.name)
                    .map(|j| (k, j))
            })
            .collect();
        Step {
            function,
            inputs,
            donated,
        }
    }

    /// The same step with `function` replaced by an equivalent one with
    /// the same inputs and outputs (a simplified copy, say).
    pub fn with_function(&self, function: Function) -> Step {
        debug_assert_eq!(function.inputs.len(), self.function.inputs.len());
        Step {
            function,
            inputs: self.inputs.clone(),
            donated: self.donated.clone(),
        }
    }

    /// The input with role `role`.
    pub fn input(&self, role: &Role) -> Option<usize> {
        self.inputs.iter().position(|i| &i.role == role)
    }

    /// The batch input `field`, if the step takes it.
    pub fn batch_input(&self, field: BatchField) -> Option<usize> {
        self.input(&Role::Batch(field))
    }

    /// Inputs whose role satisfies `keep`, in order.
    pub fn inputs_where(&self, keep: impl Fn(&Role) -> bool) -> Vec<usize> {
        (0..self.inputs.len())
            .filter(|&k| keep(&self.inputs[k].role))
            .collect()
    }

    /// The output named `name`.
    pub fn output(&self, name: &str) -> Option<usize> {
        self.function.outputs.iter().position(|b| b.name == name)
    }

    /// The names of the inputs (and of the outputs that update them) that
    /// carry a leading axis the rules do not describe.
    pub fn leading_axis_names(&self) -> std::collections::HashSet<&str> {
        self.function
            .inputs
            .iter()
            .zip(&self.inputs)
            .filter(|(_, i)| i.leading_axis)
            .map(|(b, _)| b.name.as_str())
            .collect()
    }
}
