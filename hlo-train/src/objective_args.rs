//! The objectives' flag groups: each objective's own settings as
//! `train` (and `eval`, `plan`, `bench` where they read them) takes
//! them, and the engine's settings they make ([`ObjectiveSpecs`]). Adding
//! an objective with settings of its own adds its group here, flattened
//! into `TrainArgs`, and its line in `TrainArgs::objective_specs`.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use hlo_engine::grpo::GrpoSpec;
use hlo_engine::models::grpo::{GrpoLossType, ImportanceSampling, ScaleRewards};
use hlo_engine::models::kto::KtoLossType;
use hlo_engine::models::preference::Reference;
use hlo_engine::objectives::{DistillSpec, KtoSpec, RewardModelSpec, RlooSpec};
use hlo_engine::rollouts::{
    RewardSpec, RewardWeight, RolloutDefaults, RolloutSpec, DEFAULT_REWARD_TIMEOUT,
};
use hlo_engine::{Objective, PreferenceSpec};

use crate::args::named;

/// The reference `bench` and `plan` take for `objective`: computed before
/// training with `--precompute-ref` (refused for an objective without a
/// reference), else the base (a fresh adapter's).
pub fn planned_reference(objective: Objective, precompute_ref: bool) -> Result<Reference> {
    let reads = objective.reads("precompute-ref");
    match (precompute_ref, reads) {
        (true, false) => {
            bail!("--precompute-ref: {objective} compares with no reference model; leave it out")
        }
        (true, true) => Ok(Reference::Precomputed),
        (false, _) => Ok(Reference::Base),
    }
}

/// The preference losses' settings, as `train` and `eval` take them.
#[derive(Args, Clone, Debug)]
pub struct PreferenceArgs {
    /// The preference loss's β: DPO's and IPO's (the reference's weight),
    /// SimPO's reward scale, ORPO's λ, KTO's (default 0.1); GRPO's KL
    /// penalty weight (default 0: no reference model) and RLOO's (default
    /// 0.05).
    #[arg(long, value_parser = crate::args::non_negative)]
    pub beta: Option<f64>,

    /// SimPO's target reward margin γ.
    #[arg(long, default_value_t = 0.5, allow_negative_numbers = true)]
    pub simpo_gamma: f64,

    /// SimPO's label smoothing ε (TRL's label_smoothing): the loss mixes
    /// in ε of the loss with chosen and rejected swapped.
    #[arg(long, default_value_t = 0.0, value_parser = crate::args::label_smoothing)]
    pub label_smoothing: f64,

    /// SimPO's weight of the chosen completions' NLL (TRL's cpo_alpha;
    /// 0: the paper's SimPO).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::non_negative)]
    pub cpo_alpha: f64,

    /// The reference model of DPO, IPO, KTO and of GRPO's and RLOO's KL
    /// penalty: this PEFT adapter on the base (same
    /// LoRA settings as the trained one). Default: the policy as training
    /// starts (the base for a fresh adapter, a frozen copy of
    /// --init-adapter).
    #[arg(long, value_parser = crate::args::hub_adapter)]
    pub ref_adapter: Option<PathBuf>,
}

impl PreferenceArgs {
    /// The engine's settings (β 0.1 unless given; `precompute_ref` off).
    pub fn spec(&self) -> PreferenceSpec {
        PreferenceSpec {
            beta: self.beta.unwrap_or(0.1),
            simpo_gamma: self.simpo_gamma,
            label_smoothing: self.label_smoothing,
            cpo_alpha: self.cpo_alpha,
            ref_adapter: self.ref_adapter.clone(),
            ..Default::default()
        }
    }
}

/// The rollout settings (TRL's `GRPOConfig` names, shared by
/// `RLOOConfig` and `DistillationConfig`), as `train` takes them.
#[derive(Args, Clone, Debug)]
pub struct RolloutArgs {
    /// GRPO, RLOO: completions per prompt, one group (TRL's
    /// num_generations; default 8 for grpo, 2 for rloo).
    #[arg(long, value_parser = clap::value_parser!(u32).range(2..))]
    pub num_generations: Option<u32>,

    /// GRPO, RLOO: the importance ratio is clipped to [1 − ε, 1 + ε_high].
    #[arg(long, default_value_t = 0.2, value_parser = crate::args::non_negative)]
    pub epsilon: f64,

    /// GRPO, RLOO: the upper clip ε_high (default: --epsilon; DAPO uses 0.28).
    #[arg(long, value_parser = crate::args::non_negative)]
    pub epsilon_high: Option<f64>,

    /// GRPO, RLOO: steps trained on each batch of rollouts (μ), against the
    /// policy's log-probabilities from when they were made.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub num_iterations: u32,

    /// GRPO, RLOO, distillation: tokens a completion has at most.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_completion_length: u32,

    /// GRPO, RLOO, distillation: the sampling temperature (the loss divides the logits by it
    /// too, as TRL does).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::positive)]
    pub temperature: f64,

    /// GRPO, RLOO, distillation: sample from the smallest set of tokens with this much
    /// probability (1: all).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::positive)]
    pub top_p: f64,

    /// GRPO, RLOO, distillation: sample from the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: u32,

    /// GRPO, RLOO: a reward, NAME or NAME:WEIGHT, repeatable (summed with their
    /// weights): accuracy (the completion's final answer, its last
    /// \boxed{} or number or word, equals the row's --answer-column),
    /// format (matches --format-regex), length (−tokens/max), command
    /// (--reward-command's answer), http (--reward-url's).
    #[arg(long)]
    pub reward: Vec<RewardSpec>,

    /// GRPO, RLOO, distillation: train on logged rollouts, one JSON object a line
    /// {"prompt_ids", "completion_ids", "reward"} (consecutive lines of a
    /// prompt form its group), instead of generating.
    #[arg(long, conflicts_with = "data")]
    pub rollouts: Option<PathBuf>,

    /// GRPO, RLOO: the weights of the named rewards logged rollouts give as
    /// {"rewards": {NAME: value, ...}}: NAME:WEIGHT for each, comma
    /// separated (TRL's reward_weights; default: each 1). The advantage is
    /// of their weighted sum.
    #[arg(long, value_delimiter = ',')]
    pub reward_weights: Vec<RewardWeight>,

    /// GRPO, RLOO: the prompts' column --reward accuracy compares with.
    #[arg(long, default_value = "answer")]
    pub answer_column: String,

    /// GRPO, RLOO: the regular expression --reward format looks for.
    #[arg(long)]
    pub format_regex: Option<String>,

    /// GRPO, RLOO: the command --reward command starts once (by `sh -c`); it
    /// reads one JSON object per line (prompt, completion, their ids, the
    /// prompt's row) and answers one number per line.
    #[arg(long)]
    pub reward_command: Option<String>,

    /// GRPO, RLOO: the endpoint --reward http posts each batch of completions
    /// to, as a JSON array of objects (as --reward-command's lines); it
    /// answers a JSON array of as many numbers.
    #[arg(long)]
    pub reward_url: Option<String>,

    /// GRPO, RLOO: the reward model --reward model scores each prompt and
    /// completion with: a sequence classifier's folder (`hlo-train merge`
    /// of a reward run, or an HF reward model), run in this process on
    /// the same devices.
    #[arg(long)]
    pub reward_model: Option<PathBuf>,

    /// GRPO, RLOO: the longest wait, in seconds, for one answer of
    /// --reward-command (a line) or --reward-url (a response); past it the
    /// run stops, naming the reward.
    #[arg(long, default_value_t = DEFAULT_REWARD_TIMEOUT)]
    pub reward_timeout: f64,

    /// GRPO, RLOO, distillation: show this many completions with their rewards every
    /// --log-every steps (in the log and the metrics file).
    #[arg(long, default_value_t = 0)]
    pub log_completions: u32,
}

impl RolloutArgs {
    /// The engine's settings, with the KL penalty's weight `beta` (the
    /// shared `--beta`); `defaults` are the objective's β and completions
    /// per prompt where not given.
    pub fn spec(&self, beta: Option<f64>, defaults: RolloutDefaults) -> RolloutSpec {
        RolloutSpec {
            num_generations: self
                .num_generations
                .map_or(defaults.num_generations, |n| n as usize),
            beta: beta.unwrap_or(defaults.beta),
            epsilon: self.epsilon,
            epsilon_high: self.epsilon_high,
            num_iterations: self.num_iterations as usize,
            max_completion_length: self.max_completion_length as usize,
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            rewards: self.reward.clone(),
            rollouts: self.rollouts.clone(),
            reward_weights: self.reward_weights.clone(),
            answer_column: self.answer_column.clone(),
            format_regex: self.format_regex.clone(),
            reward_command: self.reward_command.clone(),
            reward_url: self.reward_url.clone(),
            reward_model: self.reward_model.clone(),
            reward_timeout: self.reward_timeout,
            log_completions: self.log_completions as usize,
        }
    }
}

/// GRPO's own settings (TRL's `GRPOConfig` names: its loss's), as `train`
/// takes them.
#[derive(Args, Clone, Debug)]
pub struct GrpoArgs {
    /// GRPO: how rewards become advantages: less the group's mean, over
    /// the group's standard deviation (group), the batch's (batch), or
    /// not scaled (none).
    #[arg(long, value_parser = named::<ScaleRewards>(), default_value = "group")]
    pub scale_rewards: ScaleRewards,

    /// GRPO: the loss, as TRL's loss_type: the clipped ratio pooled per
    /// completion (grpo), over completions × --max-completion-length
    /// (dr_grpo), over the batch's completion tokens (dapo, bnpo); cispo
    /// (each token's log-probability weighted by its ratio clipped above
    /// at --epsilon-high, without gradient); sapo (a soft gate of the
    /// ratio at --sapo-temperature-pos or -neg).
    #[arg(long, value_parser = named::<GrpoLossType>(), default_value = "dapo")]
    pub loss_type: GrpoLossType,

    /// GRPO: the importance ratio of each token (token), or one of each
    /// completion, its tokens' mean log-ratio (sequence: GSPO), as TRL's
    /// importance_sampling_level.
    #[arg(long, value_parser = named::<ImportanceSampling>(), default_value = "token")]
    pub importance_sampling_level: ImportanceSampling,

    /// GRPO: weight the KL estimate by the importance ratio (TRL's
    /// use_bias_correction_kl); false leaves it unweighted.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub use_bias_correction_kl: bool,

    /// GRPO with --loss-type sapo: the temperature of a positive advantage.
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::positive)]
    pub sapo_temperature_pos: f64,

    /// GRPO with --loss-type sapo: the temperature of a non-positive advantage.
    #[arg(long, default_value_t = 1.05, value_parser = crate::args::positive)]
    pub sapo_temperature_neg: f64,
}

impl GrpoArgs {
    /// The engine's settings.
    pub fn spec(&self) -> GrpoSpec {
        GrpoSpec {
            scale_rewards: self.scale_rewards,
            loss_type: self.loss_type,
            importance_sampling: self.importance_sampling_level,
            bias_correction_kl: self.use_bias_correction_kl,
            sapo_temperature_pos: self.sapo_temperature_pos,
            sapo_temperature_neg: self.sapo_temperature_neg,
        }
    }
}

/// KTO's settings (TRL's `KTOConfig` names), as `train` takes them (β
/// and the reference adapter are the preference objectives' flags).
#[derive(Args, Clone, Debug)]
pub struct KtoArgs {
    /// KTO: its loss, as TRL's loss_type: kto (with the KL estimate from
    /// mismatched prompt/completion pairs) or apo_zero_unpaired.
    #[arg(long, value_parser = named::<KtoLossType>(), default_value = "kto")]
    pub kto_loss_type: KtoLossType,

    /// KTO: the weight of a desirable example's loss.
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::non_negative)]
    pub desirable_weight: f64,

    /// KTO: the weight of an undesirable example's loss.
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::non_negative)]
    pub undesirable_weight: f64,
}

impl KtoArgs {
    /// The engine's settings.
    pub fn spec(&self) -> KtoSpec {
        KtoSpec {
            loss_type: self.kto_loss_type,
            desirable_weight: self.desirable_weight,
            undesirable_weight: self.undesirable_weight,
        }
    }
}

/// RLOO's own settings (TRL's `RLOOConfig` names), as `train` takes them;
/// its rollouts take GRPO's flags, its KL penalty `--beta` (default 0.05)
/// and `--ref-adapter`.
#[derive(Args, Clone, Debug)]
pub struct RlooArgs {
    /// RLOO: standardise the advantages over the batch (mean 0, standard
    /// deviation 1), as TRL's normalize_advantages.
    #[arg(long)]
    pub normalize_advantages: bool,

    /// RLOO: clamp each reward to MIN,MAX before the KL penalty (TRL's
    /// reward_clip_range).
    #[arg(long, value_parser = clip_range, allow_hyphen_values = true)]
    pub reward_clip_range: Option<(f64, f64)>,
}

impl RlooArgs {
    /// The engine's settings.
    pub fn spec(&self) -> RlooSpec {
        RlooSpec {
            normalize_advantages: self.normalize_advantages,
            reward_clip_range: self.reward_clip_range,
        }
    }
}

/// `MIN,MAX`: two finite numbers, the least first.
fn clip_range(s: &str) -> std::result::Result<(f64, f64), String> {
    let bad = || format!("`{s}` is not MIN,MAX (two finite numbers, the least first)");
    let (lo, hi) = s.split_once(',').ok_or_else(bad)?;
    let num = |x: &str| x.trim().parse::<f64>().ok().filter(|v| v.is_finite());
    match (num(lo), num(hi)) {
        (Some(lo), Some(hi)) if lo <= hi => Ok((lo, hi)),
        _ => Err(bad()),
    }
}

/// A reward model's settings (TRL's `RewardConfig` names), as `train`
/// takes them.
#[derive(Args, Clone, Debug)]
pub struct RewardArgs {
    /// Reward model: add this weight times the mean squared sum of each
    /// pair's rewards to the loss, keeping them centred on 0 (TRL's
    /// center_rewards_coefficient; default none).
    #[arg(long, allow_negative_numbers = true, value_parser = crate::args::finite)]
    pub center_rewards_coefficient: Option<f64>,
}

impl RewardArgs {
    /// The engine's settings.
    pub fn spec(&self) -> RewardModelSpec {
        RewardModelSpec {
            center_rewards_coefficient: self.center_rewards_coefficient,
        }
    }
}

/// Distillation's settings (TRL's `DistillationConfig` names), as `train`
/// takes them; its β (default 1.0), temperature, completion length and
/// sampling are the shared flags.
#[derive(Args, Clone, Debug)]
pub struct DistillArgs {
    /// Distillation: the teacher's checkpoint folder (TRL's
    /// teacher_model): a causal LM of the student's vocabulary, any size,
    /// held frozen on the same devices.
    #[arg(long)]
    pub teacher: Option<PathBuf>,
}

/// A teacher as `plan` and `bench` take one: a preset's name, an HF
/// checkpoint folder, or a `config.json` (random weights).
pub fn teacher_model(source: &str) -> Result<hlo_engine::Model> {
    use hlo_engine::ModelSource;
    let path = PathBuf::from(source);
    let source = if path.is_dir() {
        ModelSource::Checkpoint(path)
    } else if path.is_file() {
        ModelSource::Config(path)
    } else {
        ModelSource::Preset(source.to_string())
    };
    Ok(hlo_engine::Model::open(&source)?)
}

impl DistillArgs {
    /// The engine's settings.
    pub fn spec(&self) -> DistillSpec {
        DistillSpec {
            teacher: self.teacher.clone(),
            teacher_config: None,
        }
    }
}
