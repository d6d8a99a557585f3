//! The run behind an adapter: a run folder holds its adapter and its
//! `train_state/`, whose settings say how the run computed (base model,
//! tokenizer, NF4, dtype, attention). The commands that read an adapter
//! (`eval`, `generate`, `serve`, `merge`) take those where their own flags
//! are silent, so `eval --adapter RUN` scores what the run's own held-out
//! loss scored, and say on stderr what they took.

use std::cell::RefCell;
use std::fmt::Debug;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use hlo_engine::inputs::model::{DtypeSpec, ModelSource, ModelSpec, QuantizeSpec, TokenizerSpec};
use hlo_engine::ir::DType;
use hlo_engine::models::attention::AttentionKind;
use hlo_engine::models::nf4::Nf4Config;
use hlo_engine::run::spec::RunSpec;
use hlo_engine::step::{AttentionChoice, StepSpec};

use crate::args::named;

/// The saved runs of the adapters a command reads (those without a
/// `train_state/` have none), and the settings taken from them so far.
pub struct AdapterRuns {
    runs: Vec<(PathBuf, RunSpec)>,
    taken: RefCell<Vec<String>>,
}

impl AdapterRuns {
    /// Reads the saved run, if any, beside each of `adapters`.
    pub fn read<'a>(adapters: impl IntoIterator<Item = &'a Path>) -> Result<AdapterRuns> {
        let mut runs = Vec::new();
        for dir in adapters {
            if let Some(spec) = RunSpec::saved_in(dir)? {
                runs.push((dir.to_path_buf(), spec));
            }
        }
        Ok(AdapterRuns {
            runs,
            taken: RefCell::new(Vec::new()),
        })
    }

    /// The base model the runs trained on, None without a run.
    pub fn model(&self) -> Result<Option<ModelSource>> {
        // Named by the flag that chooses it (runs of another kind differ
        // in the value anyway).
        let kind = match self.runs.first().map(|(_, s)| &s.model) {
            Some(ModelSource::Config(_)) => "config",
            Some(ModelSource::Checkpoint(_)) => "checkpoint",
            _ => "model",
        };
        self.agreed(kind, |s| s.model.clone(), show_source)
    }

    /// The runs' `setting`, read by `get`: None without a run; refused
    /// when two adapters' runs differ in it (the caller's flag decides).
    fn agreed<T: PartialEq + Debug>(
        &self,
        setting: &str,
        get: impl Fn(&RunSpec) -> T,
        show: impl Fn(&T) -> String,
    ) -> Result<Option<T>> {
        let Some((first_dir, first)) = self.runs.first() else {
            return Ok(None);
        };
        let value = get(first);
        let label = |v: &T| match show(v) {
            t if t.is_empty() => "none".to_string(),
            t => t,
        };
        for (dir, spec) in &self.runs[1..] {
            let other = get(spec);
            if other != value {
                bail!(
                    "the adapters' runs differ in --{setting}: {} in {}, {} in {}; give --{setting} to choose",
                    label(&value),
                    first_dir.display(),
                    label(&other),
                    dir.display()
                );
            }
        }
        // Nothing to say of a setting the run left at its default.
        let shown = show(&value);
        if !shown.is_empty() {
            self.taken.borrow_mut().push(format!("--{setting} {shown}"));
        }
        Ok(Some(value))
    }

    /// One line on stderr naming every setting taken from the runs.
    pub fn announce(&self, command: &str) {
        let taken = self.taken.borrow();
        if let (Some((dir, _)), false) = (self.runs.first(), taken.is_empty()) {
            eprintln!(
                "{command}: as the run in {} computed: {}",
                dir.display(),
                taken.join(" ")
            );
        }
    }
}

impl AdapterRuns {
    /// The model `flags` name, else the adapters' run's base, else the
    /// tiny preset.
    pub fn model_for(&self, flags: &ModelSpec) -> Result<ModelSource> {
        if flags.given() {
            return Ok(flags.source());
        }
        Ok(self.model()?.unwrap_or_else(|| flags.source()))
    }

    /// `--tokenizer`, else the run's.
    pub fn tokenizer_for(&self, flags: &TokenizerSpec) -> Result<Option<PathBuf>> {
        if flags.tokenizer.is_some() {
            return Ok(flags.tokenizer.clone());
        }
        let tokenizer = self.agreed(
            "tokenizer",
            |s| s.tokenizer.clone(),
            |t| {
                t.as_ref()
                    .map_or(String::new(), |p| p.display().to_string())
            },
        )?;
        Ok(tokenizer.flatten())
    }

    /// `--quantize`'s NF4, else the base as the run held it.
    pub fn nf4_for(&self, flags: &QuantizeSpec) -> Result<Option<Nf4Config>> {
        if flags.quantize.is_some() {
            return Ok(flags.nf4());
        }
        let show = |q: &Option<Nf4Config>| match q {
            Some(Nf4Config { double_quant: true }) => "nf4 --double-quant".to_string(),
            Some(_) => "nf4".to_string(),
            None => String::new(),
        };
        Ok(self.agreed("quantize", |s| s.quantize, show)?.flatten())
    }

    /// `--dtype`, else the run's, else by plugin (f32 on the CPU).
    pub fn dtype_for(&self, flags: &DtypeSpec, cpu: bool) -> Result<DType> {
        if flags.dtype.is_some() {
            return Ok(flags.dtype(cpu));
        }
        let show = |d: &Option<DType>| d.map_or(String::new(), |d| d.to_string());
        Ok(self
            .agreed("dtype", |s| s.dtype, show)?
            .flatten()
            .unwrap_or_else(|| flags.dtype(cpu)))
    }
}

fn show_source(s: &ModelSource) -> String {
    match s {
        ModelSource::Preset(name) => name.clone(),
        ModelSource::Config(p) | ModelSource::Checkpoint(p) => p.display().to_string(),
    }
}

/// `--attention` and `--attention-block` of a command that reads a run's
/// adapter (`eval`): unset, they are the run's.
#[derive(Args, Clone, Debug)]
pub struct AttentionArgs {
    /// How attention is computed: `naive`, `blockwise` (memory linear in
    /// --seq), `cudnn` (CUDA) or auto (on the CPU blockwise from 256
    /// tokens; on a GPU naive while one layer's scores take at most a
    /// quarter of the device). Default: the adapter's run's, else auto.
    #[arg(long, value_parser = named::<AttentionChoice>())]
    pub attention: Option<AttentionChoice>,

    /// Queries and keys per block of blockwise attention, dividing --seq;
    /// implies blockwise under --attention auto.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    pub attention_block: Option<i64>,
}

impl AttentionArgs {
    /// The attention of rows of `seq` tokens: these flags' when either is
    /// given, else as the run chose it (its form and block); None when
    /// neither says (`auto`: the device decides).
    pub fn kind_for(&self, seq: i64, runs: &AdapterRuns) -> Result<Option<AttentionKind>> {
        let (attention, attention_block) =
            if self.attention.is_some() || self.attention_block.is_some() {
                (
                    self.attention.unwrap_or(AttentionChoice::Auto),
                    self.attention_block,
                )
            } else {
                runs.agreed(
                    "attention",
                    |s| (s.step.attention, s.step.attention_block),
                    |(a, b)| match b {
                        Some(b) => format!("{a:?} --attention-block {b}").to_lowercase(),
                        None => format!("{a:?}").to_lowercase(),
                    },
                )?
                .unwrap_or_default()
            };
        let step = StepSpec {
            seq,
            attention,
            attention_block,
            ..StepSpec::default()
        };
        Ok(step.attention_fixed()?)
    }
}
