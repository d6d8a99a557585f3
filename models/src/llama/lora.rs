//! LoRA as PEFT defines it: rank, alpha, target modules, scale.

use crate::LoraError;

/// The projections PEFT targets by default in hlo-train.
pub const DEFAULT_TARGETS: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// A LoRA configuration: `y = x·Wᵀ + scale·(x·A)·B` on each target module.
///
/// ```
/// let l = hlo_models::llama::LoraConfig::new(8, 16.0, &["q_proj", "v_proj"], false).unwrap();
/// assert_eq!(l.scale(), 2.0);
/// assert!(l.targets("v_proj") && !l.targets("o_proj"));
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    pub rank: i64,
    pub alpha: f64,
    pub target_modules: Vec<String>,
    /// PEFT's rank-stabilised scale `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
}

impl LoraConfig {
    pub fn new(
        rank: i64,
        alpha: f64,
        targets: &[&str],
        use_rslora: bool,
    ) -> Result<Self, LoraError> {
        if rank < 1 {
            return Err(LoraError::Rank(rank));
        }
        if !alpha.is_finite() || alpha <= 0.0 {
            return Err(LoraError::Alpha(alpha));
        }
        for t in targets {
            if !DEFAULT_TARGETS.contains(t) {
                return Err(LoraError::UnknownTarget {
                    target: t.to_string(),
                    known: DEFAULT_TARGETS.join(", "),
                });
            }
        }
        if targets.is_empty() {
            return Err(LoraError::NoTargets);
        }
        Ok(LoraConfig {
            rank,
            alpha,
            // A set, as PEFT reads it: a repeated name counts once.
            target_modules: targets.iter().fold(Vec::new(), |mut v, t| {
                if !v.iter().any(|x: &String| x == t) {
                    v.push(t.to_string());
                }
                v
            }),
            use_rslora,
        })
    }

    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// Whether module `short` (`q_proj`, ...) gets an adapter.
    pub fn targets(&self, short: &str) -> bool {
        self.target_modules.iter().any(|t| t == short)
    }
}
