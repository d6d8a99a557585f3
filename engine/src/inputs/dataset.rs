//! A model's training data: JSONL or Parquet files (or folders of them) read with the model's tokenizer and chat
//! template (or the bundled demo task), its statistics for a row length,
//! and its identity for resuming.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use hlo_data::tokens::mixture::Mixture;
use hlo_data::{
    data_files, demo_examples, demo_pairs, is_preference_data, is_token_dir, stats, ChatData,
    ChatTemplate, DataStats, Example, PreferencePair, Reader, RewardPair, TokenShards, Unpaired,
};

/// A folder of prepared tokens, or a mixture file naming several.
fn open_sets(path: &Path) -> Result<Mixture> {
    Ok(match Mixture::is_mixture(path) {
        true => Mixture::read(path)?,
        false => Mixture::single(Arc::new(TokenShards::open(path)?)),
    })
}

/// [`open_sets`] for reading: each set's shards checked ahead, on a
/// thread of their own.
fn token_sets(path: &Path) -> Result<Mixture> {
    let sets = open_sets(path)?;
    for (_, s) in &sets.sets {
        s.check_ahead();
    }
    Ok(sets)
}

use clap::Args;
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};
use crate::files::file_fingerprint;
use crate::inputs::model::Model;
use crate::settings;

/// Where a run's training data comes from, and how it is read: `train`'s
/// flags, each declared once here and recorded by a run under the flag's
/// name (paths absolute).
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataSource {
    /// Training data: a JSONL or Parquet file, or a folder of their shards;
    /// rows of text, prompt/completion, messages, input_ids, alpaca or
    /// sharegpt (default: the bundled demo task); or a folder of token
    /// shards `data prepare` made, streamed from memory-mapped files, or a
    /// JSON file of `streams` mixing several in proportions.
    #[arg(long = "data", id = "data", value_name = "DATA")]
    #[serde(rename = "data", serialize_with = "settings::absolute_path")]
    pub path: Option<PathBuf>,

    /// How `{"messages"}` rows are read.
    #[command(flatten)]
    #[serde(flatten)]
    pub chat: ChatSpec,

    /// The order a run takes its samples (or pairs) in: a seeded shuffle
    /// of each epoch (random), or the file's, epoch after epoch
    /// (sequential), as transformers' train_sampling_strategy.
    #[arg(long = "train-sampling-strategy", id = "train_sampling_strategy",
          value_name = "TRAIN_SAMPLING_STRATEGY", default_value = "random",
          value_parser = settings::named::<SamplingStrategy>())]
    #[serde(rename = "train-sampling-strategy", with = "settings::by_name")]
    pub sampling: SamplingStrategy,
}

/// `--chat-template` and `--train-on-inputs`: how `{"messages"}` data is
/// read (`train`, `data`, `eval`, `data prepare`).
#[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ChatSpec {
    /// The folder whose tokenizer_config.json holds the chat template for
    /// `{"messages"}` data (default: the checkpoint's).
    #[arg(long)]
    #[serde(serialize_with = "settings::absolute_path")]
    pub chat_template: Option<PathBuf>,

    /// With `{"messages"}` data, count system and user turns in the loss
    /// too (by default only the assistant's replies are learned).
    #[arg(long)]
    pub train_on_inputs: bool,
}

impl Default for DataSource {
    /// The demo task.
    fn default() -> DataSource {
        settings::defaults()
    }
}

impl Default for ChatSpec {
    fn default() -> ChatSpec {
        settings::defaults()
    }
}

impl ChatSpec {
    /// How to read `data` (None: the demo task) with these settings for
    /// rows of `seq` tokens, as SFT rows.
    pub fn data_spec(&self, data: Option<PathBuf>, seq: i64) -> DataSpec {
        DataSpec {
            path: data,
            chat: self.clone(),
            seq: seq as usize,
            pairs: false,
            unpaired: false,
            whole_pairs: false,
        }
    }
}

/// The order a run takes its examples (or pairs) in, as transformers'
/// `train_sampling_strategy` names it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SamplingStrategy {
    /// A seeded shuffle of each epoch.
    #[default]
    Random,
    /// The file's order, epoch after epoch.
    Sequential,
}

impl crate::named::Named for SamplingStrategy {
    const ALL: &'static [SamplingStrategy] =
        &[SamplingStrategy::Random, SamplingStrategy::Sequential];
    fn name(self) -> &'static str {
        match self {
            SamplingStrategy::Random => "random",
            SamplingStrategy::Sequential => "sequential",
        }
    }
}

/// Which data, read how.
#[derive(Clone, Debug)]
pub struct DataSpec {
    /// A JSONL or Parquet file, or a folder of them; None: the bundled
    /// demo task.
    pub path: Option<PathBuf>,
    /// How `{"messages"}` lines are read.
    pub chat: ChatSpec,
    /// The row length: text beyond what it can use is not tokenized.
    pub seq: usize,
    /// Read preference pairs (for a preference objective), not SFT rows.
    pub pairs: bool,
    /// Read unpaired labelled completions (KTO's; preference pairs are
    /// unpaired as TRL unpairs them).
    pub unpaired: bool,
    /// With `pairs`: a reward model's pairs, each side a whole sequence
    /// (scored at its end, nothing masked), with optional margins.
    pub whole_pairs: bool,
}

/// The identity of a data file, or of a folder's data files (their
/// names and contents, in the order they are read), or of a prepared
/// token set (its manifest's tokenizer and shard checksums).
pub(crate) fn data_fingerprint(path: &Path) -> Result<String> {
    if is_token_dir(path) || Mixture::is_mixture(path) {
        return Ok(open_sets(path)?.fingerprint());
    }
    if !path.is_dir() {
        return file_fingerprint(path);
    }
    let mut parts = Vec::new();
    for file in data_files(path)? {
        let name = file.file_name().map(|n| n.to_string_lossy().into_owned());
        parts.push(format!(
            "{}={}",
            name.unwrap_or_default(),
            file_fingerprint(&file)?
        ));
    }
    Ok(parts.join(","))
}

/// Refuses data whose shape is not the objective's: pairs for SFT, SFT
/// rows for a preference objective (told by the first row).
fn check_shape(path: &Path, pairs: bool) -> Result<()> {
    let holds_pairs = is_preference_data(path)?;
    let why = match (pairs, holds_pairs) {
        (false, true) => "holds preference pairs (chosen/rejected); train on them with a preference objective (--objective dpo; train --help lists the others)",
        (true, false) => "holds no preference pairs: a preference objective reads rows of {\"prompt\", \"chosen\", \"rejected\"} (strings or message lists) or {\"prompt_ids\", \"chosen_ids\", \"rejected_ids\"}",
        _ => return Ok(()),
    };
    Err(EngineError::DataForObjective {
        path: path.to_path_buf(),
        why: why.into(),
    })
}

/// The items that `learns` keeps (TRL's filter of a prompt that fills the
/// row); an error when none is kept.
fn kept_within<T>(items: Vec<T>, seq: usize, learns: impl Fn(&T) -> bool) -> Result<Vec<T>> {
    let total = items.len();
    let kept: Vec<T> = items.into_iter().filter(|i| learns(i)).collect();
    if kept.is_empty() {
        return Err(EngineError::NothingToLearn {
            samples: total,
            seq,
            earliest: None,
        });
    }
    Ok(kept)
}

/// Examples the demo task draws for training, and for holding out.
const DEMO_SAMPLES: usize = 2000;
const DEMO_HELD_OUT: usize = 256;

/// Tokenized examples and what they hold.
pub struct Dataset {
    /// SFT rows; for pairs, each pair's chosen then rejected side (what
    /// the statistics count).
    pub examples: Vec<Example>,
    /// Preference pairs (empty unless read as pairs).
    pub pairs: Vec<PreferencePair>,
    /// Unpaired labelled examples (empty unless read so).
    pub unpaired: Vec<Unpaired>,
    /// Each pair's margin (a reward model's pairs that give one; else
    /// empty).
    pub margins: Vec<f32>,
    /// The pairs are whole sequences (a reward model's): kept when both
    /// sides fit in a row.
    pub whole: bool,
    pub stats: DataStats,
    /// The file's FNV-1a fingerprint (`demo` for the demo task).
    pub fingerprint: String,
    /// Prepared token sets (one, or a mixture), memory-mapped, in place
    /// of `examples`.
    pub shards: Option<Arc<Mixture>>,
}

impl Dataset {
    /// Reads `spec`'s data for `model` (the demo task is drawn with
    /// `seed`).
    pub fn read(model: &Model, spec: &DataSpec, seed: u64) -> Result<Dataset> {
        Self::read_file(model, spec, spec.path.as_deref(), seed, DEMO_SAMPLES)
    }

    /// The held-out set: `path`, or for the demo task a fresh draw of it
    /// (None when training on a file with no held-out file).
    pub(crate) fn held_out(
        model: &Model,
        spec: &DataSpec,
        path: Option<&Path>,
        seed: u64,
    ) -> Result<Option<Dataset>> {
        match (path, &spec.path) {
            (Some(p), _) => Ok(Some(Self::read_file(model, spec, Some(p), 0, 0)?)),
            (None, None) => Ok(Some(Self::read_file(
                model,
                spec,
                None,
                seed.wrapping_add(1),
                DEMO_HELD_OUT,
            )?)),
            (None, Some(_)) => Ok(None),
        }
    }

    fn read_file(
        model: &Model,
        spec: &DataSpec,
        path: Option<&Path>,
        seed: u64,
        demo: usize,
    ) -> Result<Dataset> {
        if let Some(path) = path.filter(|p| is_token_dir(p) || Mixture::is_mixture(p)) {
            return Self::of_tokens(model, spec, path);
        }
        let tokenizer = model.tokenizer(None)?;
        let eos = model.eos_ids().first().copied();
        let (examples, fingerprint) = match path {
            Some(path) => {
                let read = |reader: &Reader, _: Option<&ChatTemplate>| {
                    Self::of_file(model, spec, path, reader)
                };
                return with_reader(model, spec, tokenizer.as_ref(), Some(spec.seq), read);
            }
            None if spec.unpaired => {
                let t = tokenizer.as_ref().ok_or(EngineError::DemoNeedsTokenizer)?;
                let rows = hlo_data::unpaired::interleaved(demo_pairs(t, eos, demo, seed));
                return Ok(Self::of_unpaired(rows, spec.seq, "demo".into()));
            }
            None if spec.pairs => {
                let t = tokenizer.as_ref().ok_or(EngineError::DemoNeedsTokenizer)?;
                let pairs = demo_pairs(t, eos, demo, seed);
                // A reward model scores each side whole: prompt and completion.
                let whole = spec.whole_pairs;
                return Ok(Dataset {
                    whole,
                    ..Self::of_pairs(pairs, spec.seq, "demo".into())
                });
            }
            None => {
                let t = tokenizer.as_ref().ok_or(EngineError::DemoNeedsTokenizer)?;
                (demo_examples(t, eos, demo, seed), "demo".to_string())
            }
        };
        Ok(Self::of_examples(examples, spec.seq, fingerprint))
    }

    /// `path`'s rows read by `reader` as `spec` asks: SFT rows, pairs
    /// (whole, for a reward model) or unpaired labelled examples.
    fn of_file(model: &Model, spec: &DataSpec, path: &Path, reader: &Reader) -> Result<Dataset> {
        let fingerprint = data_fingerprint(path)?;
        if spec.unpaired {
            let rows = reader.read_unpaired(path, model.eos_token_text()?.as_deref())?;
            return Ok(Self::of_unpaired(rows, spec.seq, fingerprint));
        }
        check_shape(path, spec.pairs)?;
        if spec.whole_pairs {
            let pairs = reader.read_reward_pairs(path, model.eos_token_text()?.as_deref())?;
            return Ok(Self::of_reward_pairs(pairs, spec.seq, fingerprint));
        }
        if spec.pairs {
            let pairs = reader.read_pairs(path, model.eos_token_text()?.as_deref())?;
            return Ok(Self::of_pairs(pairs, spec.seq, fingerprint));
        }
        Ok(Self::of_examples(
            reader.read_path(path)?,
            spec.seq,
            fingerprint,
        ))
    }

    /// SFT examples, with their statistics.
    fn of_examples(examples: Vec<Example>, seq: usize, fingerprint: String) -> Dataset {
        Dataset {
            stats: stats(&examples, seq),
            examples,
            pairs: Vec::new(),
            unpaired: Vec::new(),
            margins: Vec::new(),
            whole: false,
            fingerprint,
            shards: None,
        }
    }

    /// A prepared token set (`hlo-train data prepare`): SFT samples,
    /// memory-mapped, prepared with the model's tokenizer and the run's
    /// way of reading conversations, every id in the model's vocabulary.
    fn of_tokens(model: &Model, spec: &DataSpec, path: &Path) -> Result<Dataset> {
        let refuse = |why: String| EngineError::DataForObjective {
            path: path.to_path_buf(),
            why,
        };
        if spec.pairs || spec.unpaired {
            return Err(refuse(
                "is a prepared token set, which holds samples for --objective sft; pairs and labelled examples are read from JSONL or Parquet".into(),
            ));
        }
        let sets = token_sets(path)?;
        for (_, shards) in &sets.sets {
            check_tokens(model, spec, path, shards)?;
        }
        Ok(Dataset {
            examples: Vec::new(),
            pairs: Vec::new(),
            unpaired: Vec::new(),
            margins: Vec::new(),
            whole: false,
            stats: sets.stats(spec.seq),
            fingerprint: sets.fingerprint(),
            shards: Some(Arc::new(sets)),
        })
    }

    /// The first `n` samples in memory, in file order (of prepared
    /// tokens: read from their shards, each cut to `seq`, each shard
    /// checked whole as it is first read).
    pub fn first_examples(&self, n: usize, seq: usize) -> Result<Vec<Example>> {
        match &self.shards {
            Some(m) => Ok(m
                .sets
                .iter()
                .flat_map(|(_, s)| (0..s.len()).map(move |i| s.sample(i, seq)))
                .take(n)
                .collect::<std::result::Result<_, _>>()?),
            None => Ok(self.examples.iter().take(n).cloned().collect()),
        }
    }

    /// Unpaired examples, with their statistics.
    fn of_unpaired(unpaired: Vec<Unpaired>, seq: usize, fingerprint: String) -> Dataset {
        let examples: Vec<Example> = unpaired.iter().map(|u| u.example.clone()).collect();
        Dataset {
            stats: stats(&examples, seq),
            examples,
            pairs: Vec::new(),
            unpaired,
            margins: Vec::new(),
            whole: false,
            fingerprint,
            shards: None,
        }
    }

    /// The unpaired examples that keep a completion token within a row
    /// (TRL's filter, as for pairs); an error when none does.
    pub(crate) fn learning_unpaired(self, seq: usize) -> Result<Vec<Unpaired>> {
        kept_within(self.unpaired, seq, |u| {
            let prompt = u.example.target.iter().position(|&t| t);
            prompt.is_some_and(|p| p < seq)
        })
    }

    /// Pairs, with the statistics of their sides.
    fn of_pairs(pairs: Vec<PreferencePair>, seq: usize, fingerprint: String) -> Dataset {
        let examples: Vec<Example> = pairs
            .iter()
            .flat_map(|p| [p.chosen.clone(), p.rejected.clone()])
            .collect();
        Dataset {
            stats: stats(&examples, seq),
            examples,
            pairs,
            unpaired: Vec::new(),
            margins: Vec::new(),
            whole: false,
            fingerprint,
            shards: None,
        }
    }

    /// A reward model's pairs: each side a whole sequence, every token
    /// counted (nothing is masked), with their margins.
    fn of_reward_pairs(pairs: Vec<RewardPair>, seq: usize, fingerprint: String) -> Dataset {
        let whole = |ids: Vec<u32>| Example {
            target: vec![true; ids.len()],
            ids,
        };
        let margins = pairs
            .iter()
            .filter_map(|p| p.margin.map(|m| m as f32))
            .collect();
        let pairs = pairs
            .into_iter()
            .map(|p| PreferencePair {
                chosen: whole(p.chosen),
                rejected: whole(p.rejected),
            })
            .collect();
        Dataset {
            margins,
            whole: true,
            ..Self::of_pairs(pairs, seq, fingerprint)
        }
    }

    /// A reward model's pairs whose sides both fit in a row (TRL's
    /// `max_length` filter), with their margins (empty when the data
    /// gives none); an error when none fits.
    pub(crate) fn fitting_pairs(self, seq: usize) -> Result<(Vec<PreferencePair>, Vec<f32>)> {
        let margins = self.margins;
        let indexed: Vec<(usize, PreferencePair)> = self.pairs.into_iter().enumerate().collect();
        let fits = |(_, p): &(usize, PreferencePair)| {
            p.chosen.ids.len() <= seq && p.rejected.ids.len() <= seq
        };
        let kept = kept_within(indexed, seq, fits)?;
        let margins = match margins.is_empty() {
            true => Vec::new(),
            false => kept.iter().map(|(k, _)| margins[*k]).collect(),
        };
        Ok((kept.into_iter().map(|(_, p)| p).collect(), margins))
    }

    /// The pairs that keep a completion token within a row (TRL's
    /// filter: a pair whose prompt alone fills the row is dropped); an
    /// error when none does.
    pub fn learning_pairs(self, seq: usize) -> Result<Vec<PreferencePair>> {
        kept_within(self.pairs, seq, |p| p.learns_within(seq))
    }

    /// The examples that teach something within a row (at least one
    /// learned token); an error when none does.
    /// (Prepared tokens are read into memory, each sample cut to `seq`:
    /// what a held-out set or `eval` scores.)
    pub fn learning(self, seq: usize) -> Result<Vec<Example>> {
        if self.shards.is_some() {
            let examples = self.first_examples(usize::MAX, seq)?;
            return Self::of_examples(examples, seq, self.fingerprint).learning(seq);
        }
        if self.stats.no_signal == self.stats.samples {
            let earliest = self
                .examples
                .iter()
                .filter_map(|e| e.target.iter().skip(1).position(|&t| t))
                .min()
                .map(|k| k + 1);
            return Err(EngineError::NothingToLearn {
                samples: self.stats.samples,
                seq,
                earliest,
            });
        }
        Ok(self
            .examples
            .into_iter()
            .filter(|e| e.learns_within(seq))
            .collect())
    }
}

/// Refuses a prepared set `shards` (of `path`) the run cannot read as it
/// was prepared: another tokenizer than the model's, another way of
/// reading conversations, an id outside the model's vocabulary.
fn check_tokens(model: &Model, spec: &DataSpec, path: &Path, shards: &TokenShards) -> Result<()> {
    let refuse = |why: String| EngineError::DataForObjective {
        path: path.to_path_buf(),
        why,
    };
    let m = &shards.manifest;
    let ours = model.tokenizer(None)?.map(|t| t.fingerprint());
    if ours.as_deref() != Some(m.tokenizer.as_str()) {
        return Err(refuse(format!(
            "was prepared with another tokenizer ({}) than the model's ({}); prepare it again with this model",
            m.tokenizer,
            ours.as_deref().unwrap_or("none")
        )));
    }
    if spec.chat.chat_template.is_some() || spec.chat.train_on_inputs != m.source.train_on_inputs {
        return Err(refuse(
            "fixed how conversations are read when it was prepared; leave out --chat-template and --train-on-inputs, or prepare it again with them".into(),
        ));
    }
    if i64::from(m.max_id) >= model.config.vocab_size {
        return Err(refuse(format!(
            "holds token id {}, outside the model's vocabulary of {}",
            m.max_id, model.config.vocab_size
        )));
    }
    Ok(())
}

/// How `hlo-train data prepare` tokenizes: into which folder, how many
/// source rows a shard, on how many threads.
#[derive(Clone, Debug)]
pub struct PrepareSpec {
    pub out: PathBuf,
    pub rows_per_shard: u64,
    pub threads: usize,
}

/// Tokenizes `spec`'s data (a JSONL or Parquet file, or a folder of them)
/// with `model`'s tokenizer and chat template, as `train --data` reads it
/// but whole (a run cuts to its `--seq`), into prepared token shards
/// ([`hlo_data::tokens`]); `report` gets the manifest after each shard.
/// Resumes an interrupted preparation of the same data; a complete one is
/// left as it is.
pub fn prepare_tokens(
    model: &Model,
    spec: &DataSpec,
    prepare: &PrepareSpec,
    report: &mut dyn FnMut(&hlo_data::tokens::Manifest),
) -> Result<hlo_data::tokens::Manifest> {
    let path = spec
        .path
        .as_deref()
        .ok_or_else(|| EngineError::Internal("prepare without data".into()))?;
    let tokenizer = model
        .tokenizer(None)?
        .ok_or(EngineError::Data(hlo_data::DataError::NoTokenizer))?;
    // Samples whole: a run cuts them to its --seq.
    with_reader(model, spec, Some(&tokenizer), None, |reader, template| {
        let source = hlo_data::tokens::Source {
            path: path.display().to_string(),
            fingerprint: data_fingerprint(path)?,
            chat_template: template
                .map(|t| format!("{:016x}", hlo_ir::rng::fnv1a(t.source.as_bytes()))),
            train_on_inputs: spec.chat.train_on_inputs,
            eos: reader.eos,
        };
        let options = hlo_data::tokens::PrepareOptions {
            out: prepare.out.clone(),
            source,
            tokenizer: tokenizer.fingerprint(),
            rows_per_shard: prepare.rows_per_shard.max(1),
            threads: prepare.threads.max(1),
        };
        let files = data_files(path)?;
        Ok(hlo_data::tokens::prepare(&files, reader, &options, report)?)
    })
}

/// Runs `read` with `model`'s way of reading `spec`'s rows: `tokenizer`,
/// the model's EOS (appended to text) and vocabulary, its chat template
/// (also passed to `read`) with `spec`'s `train_on_inputs`, text cut to
/// what `max_tokens` can use (None: whole).
fn with_reader<T>(
    model: &Model,
    spec: &DataSpec,
    tokenizer: Option<&hlo_data::Tokenizer>,
    max_tokens: Option<usize>,
    read: impl FnOnce(&Reader, Option<&ChatTemplate>) -> Result<T>,
) -> Result<T> {
    let template = model.chat_template(spec.chat.chat_template.as_deref())?;
    let chat = template.as_ref().map(|template| ChatData {
        template,
        stop: model.eos_ids(),
        train_on_inputs: spec.chat.train_on_inputs,
    });
    let reader = Reader {
        tokenizer,
        eos: model.eos_ids().first().copied(),
        vocab: model.config.vocab_size,
        chat: chat.as_ref(),
        max_tokens,
    };
    read(&reader, template.as_ref())
}
