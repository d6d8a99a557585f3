//! LoRA as PEFT defines it: rank, alpha, target modules, scale, PEFT's
//! per-module `rank_pattern`/`alpha_pattern`, and `modules_to_save` (whole
//! modules the adapter replaces and trains).

use regex::Regex;

use crate::LoraError;

/// The projections PEFT targets by default in hlo-train: every linear
/// projection of a layer.
pub const DEFAULT_TARGETS: [&str; 7] = crate::projections::LAYER_PROJECTIONS;

/// A LoRA configuration: `y = x·Wᵀ + scale·(x·A)·B` on each target module.
///
/// ```
/// let l = hlo_models::decoder::LoraConfig::new(8, 16.0, &["q_proj", "v_proj"], false).unwrap();
/// assert_eq!(l.scale(), 2.0);
/// assert!(l.targets("v_proj") && !l.targets("o_proj"));
/// ```
#[derive(Clone, Debug)]
pub struct LoraConfig {
    pub rank: i64,
    pub alpha: f64,
    pub target_modules: Vec<String>,
    /// PEFT's rank-stabilised scale `alpha / sqrt(r)` instead of `alpha / r`.
    pub use_rslora: bool,
    /// PEFT's `rank_pattern`: (pattern, rank) pairs; a module whose path
    /// matches `(.*\.)?(pattern)$` gets that rank (the first pattern that
    /// matches), others `rank`.
    pub rank_pattern: Vec<(String, i64)>,
    /// PEFT's `alpha_pattern`, matched as `rank_pattern`.
    pub alpha_pattern: Vec<(String, f64)>,
    /// PEFT's `modules_to_save`: modules (`lm_head`, `embed_tokens`) whose
    /// whole weight the adapter carries, replacing the base's, and trains.
    pub modules_to_save: Vec<String>,
    /// PEFT's `target_parameters`: LoRA on a mixture of experts' fused
    /// expert tensors (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`),
    /// one A and B per expert (see [`EXPERT_PARAMETERS`]).
    pub target_parameters: Vec<String>,
}

/// Two configurations are equal as PEFT compares them: the module lists
/// (`target_modules`, `target_parameters`, `modules_to_save`) as sets,
/// since PEFT writes `target_modules` from a set in no fixed order; the
/// patterns in order, since the first that matches wins.
///
/// ```
/// use hlo_models::decoder::LoraConfig;
/// let a = LoraConfig::new(4, 8.0, &["q_proj", "v_proj"], false).unwrap();
/// let b = LoraConfig::new(4, 8.0, &["v_proj", "q_proj"], false).unwrap();
/// let c = LoraConfig::new(2, 8.0, &["v_proj", "q_proj"], false).unwrap();
/// assert!(a == b && a != c);
/// ```
impl PartialEq for LoraConfig {
    fn eq(&self, other: &LoraConfig) -> bool {
        fn set(v: &[String]) -> std::collections::BTreeSet<&str> {
            v.iter().map(String::as_str).collect()
        }
        self.rank == other.rank
            && self.alpha == other.alpha
            && self.use_rslora == other.use_rslora
            && self.rank_pattern == other.rank_pattern
            && self.alpha_pattern == other.alpha_pattern
            && set(&self.target_modules) == set(&other.target_modules)
            && set(&self.modules_to_save) == set(&other.modules_to_save)
            && set(&self.target_parameters) == set(&other.target_parameters)
    }
}

/// The fused expert tensors LoRA may target, in the order transformers
/// declares them (PEFT nests its wrappers in this order).
pub const EXPERT_PARAMETERS: [&str; 2] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"];

/// The modules `modules_to_save` may name: `lm_head`, `embed_tokens`, a
/// sequence classifier's head `score` (PEFT's `SEQ_CLS` task saves it),
/// and a mixture of experts' router (`gate`: Qwen3-MoE's and Mixtral's
/// `mlp.gate`; `router`: gpt-oss's `mlp.router`, bias included), which
/// is then trained whole, as PEFT trains a module to save.
pub const MODULES_TO_SAVE: [&str; 5] = ["lm_head", "embed_tokens", "gate", "router", "score"];

/// The module to save (of [`MODULES_TO_SAVE`]) that base weight `name`
/// belongs to, if any; a stacked layer weight (`model.layers.mlp.gate.weight`)
/// as each layer's.
///
/// ```
/// use hlo_models::decoder::module_to_save_of;
/// assert_eq!(module_to_save_of("model.layers.3.mlp.gate.weight"), Some("gate"));
/// assert_eq!(module_to_save_of("model.layers.3.mlp.gate_proj.weight"), None);
/// ```
pub fn module_to_save_of(name: &str) -> Option<&'static str> {
    match name {
        "lm_head.weight" => return Some("lm_head"),
        "score.weight" => return Some("score"),
        "model.embed_tokens.weight" => return Some("embed_tokens"),
        _ => {}
    }
    let rest = name.strip_prefix("model.layers.")?;
    let rest = match rest.split_once('.') {
        Some((layer, r)) if layer.parse::<i64>().is_ok() => r,
        _ => rest,
    };
    match rest {
        // PEFT matches `modules_to_save` as a suffix of the module's
        // name, so `gate` takes Qwen2-MoE's `shared_expert_gate` too.
        "mlp.gate.weight" | "mlp.shared_expert_gate.weight" => Some("gate"),
        "mlp.router.weight" | "mlp.router.bias" => Some("router"),
        _ => None,
    }
}

/// The first of `keys` that PEFT's `get_pattern_key` matches against
/// `module`: `re.match(rf"(.*\.)?({key})$", module)`.
fn pattern_key<'a>(keys: impl Iterator<Item = &'a str>, module: &str) -> Option<&'a str> {
    keys.into_iter()
        .find(|key| Regex::new(&format!("^(?:.*\\.)?(?:{key})$")).is_ok_and(|r| r.is_match(module)))
}

impl LoraConfig {
    /// Rank, alpha and targets: module names ([`DEFAULT_TARGETS`]), and on
    /// a mixture of experts its fused expert tensors
    /// ([`EXPERT_PARAMETERS`], PEFT's `target_parameters`).
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
        // Fused expert tensors (PEFT's `target_parameters`) among them.
        let (parameters, modules): (Vec<&str>, Vec<&str>) =
            targets.iter().partition(|t| t.contains("experts."));
        let latent = crate::projections::LATENT_PROJECTIONS;
        for t in &modules {
            if !(DEFAULT_TARGETS.contains(t) || latent.contains(t)) {
                return Err(LoraError::UnknownTarget {
                    target: t.to_string(),
                    known: format!(
                        "{}, {}, {}",
                        DEFAULT_TARGETS.join(", "),
                        latent.join(", "),
                        EXPERT_PARAMETERS.join(", ")
                    ),
                });
            }
        }
        if targets.is_empty() {
            return Err(LoraError::NoTargets);
        }
        let parameters: Vec<String> = parameters.iter().map(|p| p.to_string()).collect();
        LoraConfig {
            rank,
            alpha,
            // A set, as PEFT reads it: a repeated name counts once.
            target_modules: modules.iter().fold(Vec::new(), |mut v, t| {
                if !v.iter().any(|x: &String| x == t) {
                    v.push(t.to_string());
                }
                v
            }),
            use_rslora,
            rank_pattern: Vec::new(),
            alpha_pattern: Vec::new(),
            modules_to_save: Vec::new(),
            target_parameters: Vec::new(),
        }
        .with_target_parameters(&parameters)
    }

    /// [`Self::new`] for PEFT's lists read apart: `target_modules`
    /// (`modules`, module names) and `target_parameters` (`parameters`,
    /// fused expert tensors, matched by their path's end as PEFT does:
    /// `gate_up_proj` names `mlp.experts.gate_up_proj`).
    pub fn of_peft(
        rank: i64,
        alpha: f64,
        modules: &[&str],
        parameters: &[String],
        use_rslora: bool,
    ) -> Result<Self, LoraError> {
        match modules.is_empty() {
            // Any module stands in for the check of the rank and alpha.
            true => Self::new(rank, alpha, &["q_proj"], use_rslora).map(|mut l| {
                l.target_modules.clear();
                l
            }),
            false => Self::new(rank, alpha, modules, use_rslora),
        }?
        .with_target_parameters(parameters)
    }

    /// This config with PEFT's `target_parameters`: each must name one of
    /// [`EXPERT_PARAMETERS`] (PEFT matches a parameter's path by its end,
    /// so `experts.down_proj` and a full path name the same tensors).
    pub(crate) fn with_target_parameters(mut self, names: &[String]) -> Result<Self, LoraError> {
        let mut targeted = Vec::new();
        for name in names {
            let known = EXPERT_PARAMETERS.iter().find(|p| {
                name == *p || p.ends_with(&format!(".{name}")) || name.ends_with(&format!(".{p}"))
            });
            match known {
                Some(p) if !targeted.contains(&p.to_string()) => targeted.push(p.to_string()),
                Some(_) => {}
                None => {
                    return Err(LoraError::UnknownTarget {
                        target: name.clone(),
                        known: EXPERT_PARAMETERS.join(", "),
                    })
                }
            }
        }
        // Declaration order, whatever order they were listed in.
        targeted.sort_by_key(|t| EXPERT_PARAMETERS.iter().position(|p| p == t));
        self.target_parameters = targeted;
        Ok(self)
    }

    /// Whether the fused expert tensor `parameter` (one of
    /// [`EXPERT_PARAMETERS`]) carries LoRA.
    pub(crate) fn targets_parameter(&self, parameter: &str) -> bool {
        self.target_parameters.iter().any(|p| p == parameter)
    }

    /// The same with PEFT's per-module patterns (keys are regexes).
    pub fn with_patterns(
        mut self,
        rank_pattern: Vec<(String, i64)>,
        alpha_pattern: Vec<(String, f64)>,
    ) -> Result<Self, LoraError> {
        for (key, r) in &rank_pattern {
            Regex::new(key).map_err(|e| LoraError::Pattern {
                key: key.clone(),
                reason: e.to_string(),
            })?;
            if *r < 1 {
                return Err(LoraError::Rank(*r));
            }
        }
        for (key, a) in &alpha_pattern {
            Regex::new(key).map_err(|e| LoraError::Pattern {
                key: key.clone(),
                reason: e.to_string(),
            })?;
            if !a.is_finite() || *a <= 0.0 {
                return Err(LoraError::Alpha(*a));
            }
        }
        self.rank_pattern = rank_pattern;
        self.alpha_pattern = alpha_pattern;
        Ok(self)
    }

    /// The same with PEFT's `modules_to_save` (see [`MODULES_TO_SAVE`]).
    pub fn with_modules_to_save(mut self, modules: Vec<String>) -> Result<Self, LoraError> {
        for m in &modules {
            if !MODULES_TO_SAVE.contains(&m.as_str()) {
                return Err(LoraError::ModuleToSave(m.clone()));
            }
        }
        self.modules_to_save = modules;
        Ok(self)
    }

    /// Every module to save is one of `config`'s (a tied head is not: it
    /// is the embeddings).
    pub fn check_modules_to_save(&self, config: &super::ModelConfig) -> Result<(), LoraError> {
        let names: Vec<String> = config
            .parameter_shapes()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        match self.modules_to_save.iter().find(|m| {
            !names
                .iter()
                .any(|n| module_to_save_of(n) == Some(m.as_str()))
        }) {
            Some(m) => Err(LoraError::ModuleNotInModel(m.clone())),
            None if config.kept_in_f32("mlp.gate.weight") && self.saves_module("gate") => {
                Err(LoraError::NotUniform(format!(
                    "modules_to_save `gate` on {}'s sigmoid router is not implemented (PEFT saves its e_score_correction_bias buffer with it)",
                    config.family.architecture()
                )))
            }
            None => Ok(()),
        }
    }

    /// This config as PEFT 0.21 reads it on `config`'s model. On the
    /// families whose experts transformers 5 fuses from per-expert
    /// `nn.Linear`s (Qwen3-MoE, GLM-4.5, DeepSeek-V3: PEFT's `qwen2_moe`
    /// conversion, which Qwen2-MoE itself does not get), `gate_proj` and
    /// `up_proj` among `target_modules` become the experts'
    /// `gate_up_proj` (rank and alpha doubled, as
    /// `rank_pattern`/`alpha_pattern` `.*\.gate_up_proj`) and `down_proj`
    /// the experts' `down_proj`; none stays a module target, so neither
    /// the dense layers' nor the shared experts' projections carry LoRA.
    /// One of `gate_proj` and `up_proj` without the other is refused, as
    /// PEFT refuses it. Other models: the config as it is.
    pub fn for_model(mut self, config: &super::ModelConfig) -> Result<Self, LoraError> {
        use super::Family::*;
        let fused =
            config.moe.is_some() && matches!(config.family, Qwen3Moe | Glm4Moe | DeepseekV3);
        let names = |t: &str, m: &String| m == t || m.ends_with(&format!(".{t}"));
        let has = |t: &str| self.target_modules.iter().any(|m| names(t, m));
        let (gate, up, down) = (has("gate_proj"), has("up_proj"), has("down_proj"));
        if !fused || !(gate || up || down) {
            return Ok(self);
        }
        if gate != up {
            return Err(LoraError::NotUniform(format!(
                "on {} PEFT fuses the experts' gate_proj and up_proj into gate_up_proj: target both or neither",
                config.family.architecture()
            )));
        }
        self.target_modules.retain(|m| {
            !["gate_proj", "up_proj", "down_proj"]
                .iter()
                .any(|t| names(t, m))
        });
        let mut parameters = self.target_parameters.clone();
        for (on, p) in [(gate, EXPERT_PARAMETERS[0]), (down, EXPERT_PARAMETERS[1])] {
            if on {
                parameters.push(p.to_string());
            }
        }
        if gate {
            let key = r".*\.gate_up_proj".to_string();
            self.rank_pattern.retain(|(k, _)| *k != key);
            self.alpha_pattern.retain(|(k, _)| *k != key);
            self.rank_pattern.push((key.clone(), 2 * self.rank));
            self.alpha_pattern.push((key, 2.0 * self.alpha));
        }
        self.with_target_parameters(&parameters)
    }

    /// Whether `module` (of [`MODULES_TO_SAVE`]) is saved whole.
    fn saves_module(&self, module: &str) -> bool {
        self.modules_to_save.iter().any(|m| m == module)
    }

    /// The rank of the module at `module` (`model.layers.3.self_attn.q_proj`).
    pub fn rank_of(&self, module: &str) -> i64 {
        pattern_key(self.rank_pattern.iter().map(|(k, _)| k.as_str()), module)
            .and_then(|k| self.rank_pattern.iter().find(|(p, _)| p == k))
            .map_or(self.rank, |(_, r)| *r)
    }

    /// The alpha of the module at `module`.
    pub(crate) fn alpha_of(&self, module: &str) -> f64 {
        pattern_key(self.alpha_pattern.iter().map(|(k, _)| k.as_str()), module)
            .and_then(|k| self.alpha_pattern.iter().find(|(p, _)| p == k))
            .map_or(self.alpha, |(_, a)| *a)
    }

    /// The scale of the module at `module`: alpha/r, or alpha/sqrt(r)
    /// with rsLoRA, with its own rank and alpha.
    ///
    /// ```
    /// use hlo_models::decoder::LoraConfig;
    /// let l = LoraConfig::new(4, 8.0, &["q_proj", "v_proj"], false).unwrap()
    ///     .with_patterns(vec![("q_proj".into(), 8)], vec![("v_proj".into(), 32.0)]).unwrap();
    /// assert_eq!(l.scale_of("model.layers.0.self_attn.q_proj"), 1.0);
    /// assert_eq!(l.scale_of("model.layers.0.self_attn.v_proj"), 8.0);
    /// assert_eq!(l.rank_of("model.layers.1.self_attn.v_proj"), 4);
    /// ```
    pub fn scale_of(&self, module: &str) -> f64 {
        let (r, alpha) = (self.rank_of(module) as f64, self.alpha_of(module));
        if self.use_rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        }
    }

    /// The scale of a module without patterns: alpha/r (alpha/sqrt(r)).
    pub fn scale(&self) -> f64 {
        if self.use_rslora {
            self.alpha / (self.rank as f64).sqrt()
        } else {
            self.alpha / self.rank as f64
        }
    }

    /// With the layers run as one scan, every layer must have the same
    /// ranks and alphas (a pattern naming one layer breaks that).
    pub(crate) fn check_uniform(&self, layers: i64) -> Result<(), LoraError> {
        for group in ["self_attn", "mlp"] {
            for short in &self.target_modules {
                let at = |l: i64| format!("model.layers.{l}.{group}.{short}");
                let first = (self.rank_of(&at(0)), self.alpha_of(&at(0)));
                if (1..layers).any(|l| (self.rank_of(&at(l)), self.alpha_of(&at(l))) != first) {
                    return Err(LoraError::NotUniform(format!(
                        "rank_pattern or alpha_pattern gives the layers' {short} different ranks or alphas; run the layers unrolled (--scan-layers off)"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Whether the adapter carries the whole weight `name` (a module to
    /// save).
    pub fn saves_weight(&self, name: &str) -> bool {
        module_to_save_of(name).is_some_and(|m| self.modules_to_save.iter().any(|x| x == m))
    }

    /// Whether module `short` (`q_proj`, ...) gets an adapter.
    pub fn targets(&self, short: &str) -> bool {
        self.target_modules.iter().any(|t| t == short)
    }
}
