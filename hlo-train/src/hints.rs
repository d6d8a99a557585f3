//! Names users bring from TRL, transformers and PEFT (`--learning-rate`,
//! `max_steps: 500` in a recipe), answered with hlo-train's flag that
//! means the same, from one table ([`HINTS`]) that the command line's
//! usage errors and the recipe reader's unknown keys both read. A name
//! matches however it is spelled: `--learning-rate`, `--learning_rate`,
//! `learning_rate` or `learning-rate`.

use std::ffi::OsString;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use hlo_engine::models::kto::KtoLossType;
use hlo_engine::named::Named;

/// A setting of another trainer and hlo-train's way of saying it.
pub struct Hint {
    /// The name as its owner spells it: a field of TRL's configs,
    /// transformers' `TrainingArguments` or PEFT's `LoraConfig`.
    pub name: &'static str,
    /// Whose name it is, possessive: `TRL's`, `transformers'`, `PEFT's`.
    pub origin: &'static str,
    /// hlo-train's flag that means it (`--lr`, or with a value:
    /// `--dtype bf16`); None where hlo-train has no such setting.
    pub flag: Option<&'static str>,
    /// How ours differs, or (no flag) what to do instead; empty when
    /// nothing needs saying.
    pub note: &'static str,
}

const fn hint(
    name: &'static str,
    origin: &'static str,
    flag: &'static str,
    note: &'static str,
) -> Hint {
    Hint {
        name,
        origin,
        flag: Some(flag),
        note,
    }
}

/// The names of TRL 1.16's configs (with transformers' `TrainingArguments`
/// under them, and TRL's `ModelConfig` and `ScriptArguments`) and PEFT's
/// `LoraConfig` that hlo-train spells otherwise. Names hlo-train shares
/// (`weight_decay`, `beta`, `lora_alpha`, `num_generations`, ...) are not
/// here: they are flags already.
pub const HINTS: &[Hint] = &[
    hint("learning_rate", "TRL's", "--lr", ""),
    hint("max_steps", "transformers'", "--steps", ""),
    hint(
        "per_device_train_batch_size",
        "transformers'",
        "--batch",
        "a micro-batch over every device: TRL's value times the GPUs",
    ),
    hint(
        "gradient_accumulation_steps",
        "transformers'",
        "--grad-accum",
        "",
    ),
    Hint {
        name: "num_train_epochs",
        origin: "transformers'",
        flag: None,
        note: "a run counts optimizer steps, not epochs: for E epochs of N samples (pairs, examples) give --steps E × ceil(N / (B × K)), B and K being --batch and --grad-accum (transformers' count); `hlo-train data` prints the epochs a --steps makes",
    },
    hint("max_length", "TRL's", "--seq", ""),
    hint("max_seq_length", "older TRL's", "--seq", ""),
    hint("output_dir", "transformers'", "--out", ""),
    hint("model_name_or_path", "TRL's", "--checkpoint", "an HF folder or hub id"),
    hint("lora_r", "TRL's", "--lora-rank", ""),
    hint("r", "PEFT's", "--lora-rank", ""),
    hint("lora_target_modules", "TRL's", "--lora-targets", "comma-separated"),
    hint("target_modules", "PEFT's", "--lora-targets", "comma-separated"),
    Hint {
        name: "lora_dropout",
        origin: "TRL's",
        flag: None,
        note: "hlo-train's LoRA has no dropout (PEFT's default, 0); leave it out",
    },
    Hint {
        name: "use_peft",
        origin: "TRL's",
        flag: None,
        note: "LoRA is the default here; --full trains every weight instead",
    },
    hint(
        "lr_scheduler_type",
        "transformers'",
        "--schedule",
        "constant or cosine; transformers' linear decay has no equivalent",
    ),
    hint(
        "warmup_steps",
        "transformers'",
        "--warmup",
        "whole steps: a value below 1, a share of the run, times --steps",
    ),
    hint(
        "warmup_ratio",
        "transformers'",
        "--warmup",
        "whole steps: the ratio times --steps",
    ),
    hint("max_grad_norm", "transformers'", "--clip-norm", ""),
    hint("optim", "transformers'", "--optimizer", "adamw or sgd"),
    hint("logging_steps", "TRL's", "--log-every", ""),
    hint("eval_steps", "transformers'", "--eval-every", ""),
    hint("save_steps", "transformers'", "--save-every", ""),
    hint(
        "resume_from_checkpoint",
        "transformers'",
        "--resume",
        "the run's folder",
    ),
    hint("bf16", "TRL's", "--dtype bf16", ""),
    hint(
        "gradient_checkpointing",
        "TRL's",
        "--remat layers",
        "auto chooses by the device's memory",
    ),
    hint("load_in_4bit", "TRL's", "--quantize nf4", ""),
    hint("use_bnb_nested_quant", "TRL's", "--double-quant", ""),
    hint(
        "dataset_name",
        "TRL's",
        "--data",
        "a local JSONL or Parquet file or folder: the Hub's Parquet files once downloaded",
    ),
    hint("precompute_ref_log_probs", "TRL's", "--precompute-ref", ""),
    hint("teacher_model_name_or_path", "TRL's", "--teacher", ""),
];

/// TRL's `loss_type` values that are not GRPO's (`--loss-type` is
/// GRPO's), with hlo-train's way of choosing that loss. KTO's
/// (`--kto-loss-type`) come from the engine's own list.
pub const LOSS_TYPES: &[(&str, &str, &str)] = &[
    ("sigmoid", "DPOConfig", "--objective dpo"),
    ("ipo", "DPOConfig", "--objective ipo"),
    ("simpo", "CPOConfig", "--objective simpo"),
];

/// `name` as the table spells names: `--learning-rate` and
/// `learning-rate` are `learning_rate`.
fn normal(name: &str) -> String {
    name.trim_start_matches('-')
        .split('=')
        .next()
        .unwrap_or_default()
        .replace('-', "_")
        .to_ascii_lowercase()
}

/// The row for `name` (a flag or a recipe key, however spelled).
pub fn find(name: &str) -> Option<&'static Hint> {
    let name = normal(name);
    HINTS.iter().find(|h| h.name == name)
}

/// The long flag (no dashes) a row suggests: `--dtype bf16`'s is `dtype`.
pub fn flag_name(suggestion: &str) -> &str {
    suggestion
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .trim_start_matches('-')
}

/// The row's answer: `hlo-train's flag for TRL's learning_rate is --lr`,
/// as a recipe key (`key`: `is \`lr\``) or a flag.
pub fn answer(h: &Hint, key: bool) -> String {
    let Some(flag) = h.flag else {
        let what = if key { "key" } else { "flag" };
        return format!(
            "{} {} has no hlo-train {what}: {}",
            h.origin, h.name, h.note
        );
    };
    let ours = if key {
        let mut words = flag.split_whitespace();
        let name = words.next().unwrap_or_default().trim_start_matches('-');
        let value: Vec<&str> = words.collect();
        if value.is_empty() {
            format!(
                "key for {} {} is `{}`",
                h.origin,
                h.name,
                name.replace('-', "_")
            )
        } else {
            format!(
                "key for {} {} is `{}: {}`",
                h.origin,
                h.name,
                name.replace('-', "_"),
                value.join(" ")
            )
        }
    } else {
        format!("flag for {} {} is {flag}", h.origin, h.name)
    };
    if h.note.is_empty() {
        format!("hlo-train's {ours}")
    } else {
        format!("hlo-train's {ours} ({})", h.note)
    }
}

/// Whether `cmd` has the long flag `flag` (no dashes).
fn has_flag(cmd: &clap::Command, flag: &str) -> bool {
    cmd.get_arguments().any(|a| a.get_long() == Some(flag))
}

/// Whether `cmd` has what the row suggests (every flag its answer names).
fn fits(h: &Hint, cmd: &clap::Command) -> bool {
    flags_named(h).iter().all(|f| has_flag(cmd, f))
}

/// Every long flag (no dashes) row `h` names: its flag's and those of its
/// note.
pub fn flags_named(h: &Hint) -> Vec<&'static str> {
    let mut flags: Vec<&'static str> = h.flag.map(flag_name).into_iter().collect();
    flags.extend(flags_in(h.note));
    flags
}

/// The `--flag`s a text names, without their dashes.
pub fn flags_in(text: &'static str) -> Vec<&'static str> {
    text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '-'))
        .filter_map(|w| w.strip_prefix("--"))
        .filter(|w| !w.is_empty())
        .collect()
}

/// The subcommand `argv` (`hlo-train COMMAND [SUBCOMMAND] ...`) runs.
fn subcommand<'a>(cli: &'a clap::Command, argv: &[OsString]) -> &'a clap::Command {
    let mut cmd = cli;
    for a in argv.iter().skip(1) {
        match a.to_str().and_then(|a| cmd.find_subcommand(a)) {
            Some(sub) => cmd = sub,
            None => break,
        }
    }
    cmd
}

/// A string of the error's context `kind`.
fn context(e: &clap::Error, kind: ContextKind) -> Option<&str> {
    match e.get(kind)? {
        ContextValue::String(s) => Some(s),
        _ => None,
    }
}

/// The one line (without `error: `) a usage error of `argv` gets when it
/// is a name from TRL, transformers or PEFT, or one of ours spelled with
/// `_`: None for the others, which clap's message serves.
pub fn usage_hint(e: &clap::Error, argv: &[OsString], cli: &clap::Command) -> Option<String> {
    let cmd = subcommand(cli, argv);
    let arg = context(e, ContextKind::InvalidArg)?;
    match e.kind() {
        ErrorKind::UnknownArgument => {
            let given = arg.split('=').next().unwrap_or(arg);
            let long = given.strip_prefix("--")?;
            let said = format!("unexpected argument '{given}'");
            if let Some(h) = find(long).filter(|h| fits(h, cmd)) {
                return Some(format!("{said}: {}", answer(h, false)));
            }
            // One of ours with `_` for `-` (argparse takes both).
            let dashed = long.replace('_', "-");
            if dashed != long && has_flag(cmd, &dashed) {
                return Some(format!(
                    "{said}: hlo-train's flags are spelled with dashes: --{dashed}"
                ));
            }
            None
        }
        ErrorKind::InvalidValue => {
            let flag = arg.split_whitespace().next()?;
            let value = context(e, ContextKind::InvalidValue)?;
            if flag == "--objective" && value == "reward" && cmd.get_name() == "eval" {
                return Some(
                    "eval --objective reward: held-out scoring of a reward model is not built into eval; `hlo-train score` gives its scores of held-out pairs and the share it ranks as they do".into(),
                );
            }
            if flag != "--loss-type" {
                return None;
            }
            let said = format!("invalid value '{value}' for '--loss-type' (GRPO's loss)");
            if KtoLossType::from_name(value).is_some() && has_flag(cmd, "kto-loss-type") {
                return Some(format!(
                    "{said}: KTO's loss_type (TRL's KTOConfig) is --kto-loss-type {value}"
                ));
            }
            let (_, config, ours) = LOSS_TYPES.iter().find(|(v, _, _)| *v == value)?;
            has_flag(cmd, flag_name(ours))
                .then(|| format!("{said}: TRL's {config} loss_type {value} is {ours} here"))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn train() -> clap::Command {
        crate::Cli::command()
            .find_subcommand("train")
            .expect("train")
            .clone()
    }

    /// `hlo-train train` with `args` parses as far as its flags go: a flag
    /// it does not have is the only failure that counts.
    fn parses(args: &[&str]) -> Result<(), String> {
        let mut argv = vec!["hlo-train", "train"];
        argv.extend(args);
        match crate::Cli::command().try_get_matches_from(&argv) {
            Ok(_) => Ok(()),
            // A flag without its value: the flag exists.
            Err(e) if args.len() == 1 && e.kind() != ErrorKind::UnknownArgument => Ok(()),
            Err(e) => Err(format!("{argv:?}: {}", e.render())),
        }
    }

    #[test]
    fn every_suggested_flag_is_a_flag_of_train() {
        for h in HINTS {
            if let Some(flag) = h.flag {
                let words: Vec<&str> = flag.split_whitespace().collect();
                parses(&words).unwrap();
            } else {
                assert!(!h.note.is_empty(), "{}: no flag and no note", h.name);
            }
            for f in flags_named(h) {
                let f = format!("--{f}");
                parses(&[&f]).unwrap();
            }
            assert!(fits(h, &train()), "{}", h.name);
        }
        for (value, _, ours) in LOSS_TYPES {
            let words: Vec<&str> = ours.split_whitespace().collect();
            parses(&words).unwrap();
            // Not one of GRPO's (whose values would be accepted).
            assert!(
                parses(&["--loss-type", value]).is_err(),
                "{value} is GRPO's"
            );
        }
        parses(&["--kto-loss-type", "apo_zero_unpaired"]).unwrap();
    }

    #[test]
    fn no_foreign_name_is_one_of_ours() {
        let ours: Vec<String> = train()
            .get_arguments()
            .filter_map(|a| a.get_long())
            .map(normal)
            .collect();
        for (i, h) in HINTS.iter().enumerate() {
            assert_eq!(
                normal(h.name),
                h.name,
                "{}: spelled as a config field",
                h.name
            );
            assert!(!ours.contains(&normal(h.name)), "--{} is ours", h.name);
            assert!(
                HINTS[..i].iter().all(|o| o.name != h.name),
                "{} twice",
                h.name
            );
        }
    }

    #[test]
    fn answers_read_as_one_line() {
        let lr = find("--learning-rate").unwrap();
        assert_eq!(
            answer(lr, false),
            "hlo-train's flag for TRL's learning_rate is --lr"
        );
        assert_eq!(
            answer(lr, true),
            "hlo-train's key for TRL's learning_rate is `lr`"
        );
        assert_eq!(
            answer(find("bf16").unwrap(), true),
            "hlo-train's key for TRL's bf16 is `dtype: bf16`"
        );
        assert!(find("learning-rate").is_some() && find("--max_steps").is_some());
        assert!(find("--lr").is_none());
        for h in HINTS {
            for key in [false, true] {
                assert!(!answer(h, key).contains('\n'), "{}", h.name);
            }
        }
    }
}
