//! `--recipe FILE.yaml`: a run's flags kept as a YAML file, as axolotl,
//! torchtune and LLM Foundry keep theirs. Every flag of `train`, `bench`,
//! `plan` and `serve` is a key (`lora_rank` or `lora-rank`); a flag given
//! on the command line wins over its key. The recipe is turned into flags
//! before the command line is parsed, so a recipe's values are checked
//! exactly as flags are.
//!
//! A key no recipe command knows is an error naming it and the file (and,
//! for a TRL or transformers name, the key that means it: `hints`); a key
//! of another recipe command is left to that command (a train recipe can
//! be planned, and `steps` does not change a plan). `train --out DIR`
//! writes the run's effective `recipe.yaml` there: every setting, defaults
//! resolved, which reproduces the run's losses.

use std::collections::BTreeSet;
use std::ffi::OsString;
use std::path::Path;

use anyhow::{bail, Context, Result};
use clap::ArgAction;
use hlo_engine::objectives::Objective;
use serde_json::Value;

/// The commands that take `--recipe`.
pub const RECIPE_COMMANDS: [&str; 4] = ["train", "bench", "plan", "serve"];

/// Flags of which the command line's one replaces the recipe's others.
const EXCLUSIVE: [&[&str]; 2] = [&["model", "config", "checkpoint"], &["jit", "eager"]];

/// Flags a written recipe leaves out: where the run's outputs go (the new
/// run names its own), and clap's own.
const NOT_RECORDED: [&str; 15] = [
    "recipe",
    // How this process was launched is not part of the run's recipe.
    "num-processes",
    "process-id",
    "coordinator",
    "init-timeout",
    // A secret: never written to a file.
    "run-token",
    "out",
    "overwrite",
    "resume",
    "metrics",
    "tensorboard",
    "dump-hlo",
    "trace-values",
    "help",
    "version",
];

/// The long flag of a recipe key: `lora_rank` and `lora-rank` are
/// `--lora-rank`.
fn flag_of(key: &str) -> String {
    key.replace('_', "-")
}

/// The long flags the command line gives (`--flag` or `--flag=value`).
fn given_flags(args: &[OsString]) -> BTreeSet<String> {
    args.iter()
        .filter_map(|a| a.to_str())
        .take_while(|a| *a != "--")
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| a.split('=').next().unwrap_or(a).to_string())
        .collect()
}

/// The value of `--recipe` in `args`, if any.
fn recipe_path(args: &[OsString]) -> Option<OsString> {
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let Some(s) = a.to_str() else { continue };
        if s == "--" {
            return None;
        }
        if s == "--recipe" {
            return it.next().cloned();
        }
        if let Some(v) = s.strip_prefix("--recipe=") {
            return Some(v.into());
        }
    }
    None
}

/// A recipe file's keys and values, in file order. A folder is a run's:
/// its `recipe.yaml` (so `plan --recipe RUN` plans the step RUN took).
fn read(path: &Path) -> Result<Vec<(String, Value)>> {
    let file;
    let path = if path.is_dir() {
        file = path.join("recipe.yaml");
        file.as_path()
    } else {
        path
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read recipe {}", path.display()))?;
    let value: serde_norway::Value = serde_norway::from_str(&text)
        .map_err(|e| anyhow::anyhow!("recipe {}: not YAML: {e}", path.display()))?;
    let mapping = match value {
        serde_norway::Value::Null => return Ok(Vec::new()),
        serde_norway::Value::Mapping(m) => m,
        _ => bail!(
            "recipe {}: expected a mapping of settings (`lora_rank: 8`)",
            path.display()
        ),
    };
    let mut out = Vec::new();
    for (k, v) in mapping {
        let Some(key) = k.as_str() else {
            bail!("recipe {}: a key is not a string: {k:?}", path.display());
        };
        // JSON has no infinity or NaN: converted, they would become null,
        // which reads as "not set" and leaves the flag's default.
        if let Some(x) = non_finite(&v) {
            bail!(
                "recipe {}: key `{key}` is {x}, not a finite number",
                path.display()
            );
        }
        let v: Value = serde_json::to_value(&v)
            .with_context(|| format!("recipe {}: key `{key}`", path.display()))?;
        out.push((key.to_string(), v));
    }
    Ok(out)
}

/// The first non-finite number in `v` (a scalar or a list), as YAML
/// spells it.
fn non_finite(v: &serde_norway::Value) -> Option<&'static str> {
    match v {
        serde_norway::Value::Number(n) => match n.as_f64() {
            Some(x) if x.is_nan() => Some(".nan"),
            Some(x) if x == f64::INFINITY => Some(".inf"),
            Some(x) if x == f64::NEG_INFINITY => Some("-.inf"),
            _ => None,
        },
        serde_norway::Value::Sequence(items) => items.iter().find_map(non_finite),
        _ => None,
    }
}

/// `argv` (`hlo-train COMMAND ...`, whose flags `cli` defines) with the
/// settings of its `--recipe` put in as flags before the command line's
/// own (which win); `argv` itself when there is no recipe.
pub fn expand(argv: &[OsString], cli: &clap::Command) -> Result<Vec<OsString>> {
    let Some(command) = argv.get(1).and_then(|c| c.to_str()) else {
        return Ok(argv.to_vec());
    };
    if !RECIPE_COMMANDS.contains(&command) {
        return Ok(argv.to_vec());
    }
    let Some(path) = recipe_path(&argv[2..]) else {
        return Ok(argv.to_vec());
    };
    let path = Path::new(&path);
    let known_elsewhere = recipe_settings(cli);
    let Some(sub) = cli.find_subcommand(command) else {
        return Ok(argv.to_vec());
    };
    let given = given_settings(&argv[2..]);
    let flags = recipe_flags(path, sub, &known_elsewhere, &given)?;
    let mut out: Vec<OsString> = argv[..2].to_vec();
    out.extend(flags);
    out.extend(argv[2..].iter().cloned());
    Ok(out)
}

/// Whether `a` is a setting a recipe may hold: clap's own --help and
/// --version are none.
fn is_setting(a: &clap::Arg) -> bool {
    !matches!(a.get_long(), None | Some("help" | "version"))
}

/// The long flags of every recipe command's settings.
fn recipe_settings(cli: &clap::Command) -> BTreeSet<String> {
    RECIPE_COMMANDS
        .iter()
        .filter_map(|c| cli.find_subcommand(c))
        .flat_map(|c| {
            c.get_arguments()
                .filter(|a| is_setting(a))
                .filter_map(|a| a.get_long())
        })
        .map(str::to_string)
        .collect()
}

/// The settings the command line `args` gives: its long flags, and with
/// one of a group of [`EXCLUSIVE`] flags the whole group.
fn given_settings(args: &[OsString]) -> BTreeSet<String> {
    let mut given = given_flags(args);
    for group in EXCLUSIVE {
        if group.iter().any(|f| given.contains(*f)) {
            given.extend(group.iter().map(|f| f.to_string()));
        }
    }
    given
}

/// The flags of the recipe at `path` for command `sub`: each key's, in
/// file order, but for keys of another recipe command
/// (`known_elsewhere`) and settings the command line gives (`given`).
fn recipe_flags(
    path: &Path,
    sub: &clap::Command,
    known_elsewhere: &BTreeSet<String>,
    given: &BTreeSet<String>,
) -> Result<Vec<OsString>> {
    let mut flags: Vec<OsString> = Vec::new();
    // The key each flag came from: `lora_rank` and `lora-rank` are one.
    let mut seen: std::collections::BTreeMap<String, String> = Default::default();
    for (key, value) in read(path)? {
        let flag = flag_of(&key);
        if let Some(first) = seen.insert(flag.clone(), key.clone()) {
            bail!(
                "recipe {}: keys `{first}` and `{key}` both set --{flag}; keep one",
                path.display()
            );
        }
        let arg = sub
            .get_arguments()
            .filter(|a| is_setting(a))
            .find(|a| a.get_long() == Some(flag.as_str()));
        let Some(arg) = arg else {
            if known_elsewhere.contains(&flag) {
                continue; // another command's setting
            }
            // A TRL or transformers name: the key that means it.
            let hint = crate::hints::find(&key).filter(|h| {
                crate::hints::flags_named(h)
                    .iter()
                    .all(|f| known_elsewhere.contains(*f))
            });
            if let Some(h) = hint {
                bail!(
                    "recipe {}: unknown key `{key}`: {}",
                    path.display(),
                    crate::hints::answer(h, true)
                );
            }
            bail!(
                "recipe {}: unknown key `{key}` (no command of {} has --{flag})",
                path.display(),
                RECIPE_COMMANDS.join(", ")
            );
        };
        if flag == "recipe" {
            bail!(
                "recipe {}: `recipe` cannot be set in a recipe",
                path.display()
            );
        }
        // Recipes are shared and committed; a secret does not belong there.
        if flag == "run-token" {
            bail!(
                "recipe {}: key `{key}`: a run token is a secret and is not read from a recipe; set HLO_TRAIN_RUN_TOKEN",
                path.display()
            );
        }
        if given.contains(&flag) {
            continue;
        }
        flags.extend(setting_flags(path, &key, arg, &value)?);
    }
    Ok(flags)
}

/// Key `key`'s `value` as the flags of setting `arg`: a switch's `--flag`
/// when true, a list as one value per flag of an appending setting and
/// comma-separated otherwise, YAML's true/false as on/off where the
/// setting takes those; nothing for null.
fn setting_flags(path: &Path, key: &str, arg: &clap::Arg, value: &Value) -> Result<Vec<OsString>> {
    let flag = flag_of(key);
    let bad = |what: &str| anyhow::anyhow!("recipe {}: key `{key}` {what}", path.display());
    let switch = matches!(arg.get_action(), ArgAction::SetTrue);
    // YAML's true/false for an on/off setting (`packing: true`).
    let on_off = arg
        .get_possible_values()
        .iter()
        .any(|p| p.get_name() == "on");
    let scalar = |v: &Value| -> Result<String> {
        match v {
            Value::String(s) => Ok(s.clone()),
            Value::Number(n) => Ok(n.to_string()),
            Value::Bool(b) if on_off => Ok(if *b { "on" } else { "off" }.into()),
            Value::Bool(b) => Ok(b.to_string()),
            _ => Err(bad("must be a number, a string, or a list of them")),
        }
    };
    let mut flags: Vec<OsString> = Vec::new();
    match (value, switch) {
        (Value::Null, _) => {}
        (Value::Bool(true), true) => flags.push(format!("--{flag}").into()),
        (Value::Bool(false), true) => {}
        (_, true) => return Err(bad("is a switch: true or false")),
        (Value::Array(items), false) => {
            if matches!(arg.get_action(), ArgAction::Append) {
                for item in items {
                    flags.extend([format!("--{flag}").into(), scalar(item)?.into()]);
                }
            } else {
                let parts = items.iter().map(scalar).collect::<Result<Vec<_>>>()?;
                flags.extend([format!("--{flag}").into(), parts.join(",").into()]);
            }
        }
        (v, false) => flags.extend([format!("--{flag}").into(), scalar(v)?.into()]),
    }
    Ok(flags)
}

/// The effective recipe of a `train` run whose flags (`train`, the
/// subcommand) were read as `sub`: every flag but where its outputs go,
/// with `resolved` values (the run's settings: defaults decided, paths
/// absolute) replacing the flags'. Keys are written as flags are named,
/// `_` for `-`.
pub fn effective(
    train: &clap::Command,
    sub: &clap::ArgMatches,
    resolved: &[(String, Value)],
) -> String {
    let resolved_keys: BTreeSet<&str> = resolved.iter().map(|(k, _)| k.as_str()).collect();
    let model_flag = EXCLUSIVE[0]
        .iter()
        .find(|f| resolved_keys.contains(**f))
        .copied();
    // The settings of other objectives are not the run's (a DPO recipe
    // lists no GRPO setting).
    let objective: Objective = resolved
        .iter()
        .find(|(k, _)| k == "objective")
        .and_then(|(_, v)| v.as_str()?.parse().ok())
        .unwrap_or_default();
    let mut text = String::from(
        "# hlo-train train recipe: every setting of the run, defaults resolved.\n\
         # Run it again with: hlo-train train --recipe recipe.yaml --out NEW_DIR\n",
    );
    for arg in train.get_arguments() {
        let Some(flag) = arg.get_long() else { continue };
        if NOT_RECORDED.contains(&flag) || !objective.reads(flag) {
            continue;
        }
        // One way of naming the model: the one the run used.
        if EXCLUSIVE[0].contains(&flag) && model_flag.is_some_and(|m| m != flag) {
            continue;
        }
        let value = match resolved.iter().find(|(k, _)| k == flag) {
            Some((_, v)) => v.clone(),
            None => {
                let id = arg.get_id().as_str();
                if matches!(arg.get_action(), ArgAction::SetTrue) {
                    Value::Bool(sub.get_flag(id))
                } else {
                    match sub.get_raw(id) {
                        Some(raw) => {
                            let parts: Vec<String> = raw
                                .map(|v| v.to_string_lossy().into_owned())
                                .map(|v| absolute(flag, v))
                                .collect();
                            Value::String(parts.join(","))
                        }
                        None => Value::Null,
                    }
                }
            }
        };
        text.push_str(&format!(
            "{}: {}\n",
            flag.replace('-', "_"),
            yaml_scalar(&value)
        ));
    }
    text
}

/// Flags whose value may name a file or folder: written absolute when it
/// does, so the recipe runs from any folder (its own run folder too).
const PATH_FLAGS: [&str; 2] = ["eval-data", "plugin"];

/// `value` of `flag` as an absolute path when it names an existing file or
/// folder (`--plugin cpu` stays a word).
fn absolute(flag: &str, value: String) -> String {
    if !PATH_FLAGS.contains(&flag) || !Path::new(&value).exists() {
        return value;
    }
    std::fs::canonicalize(&value).map_or(value, |p| p.display().to_string())
}

/// A YAML scalar: numbers and booleans as they are; a string plain when
/// YAML reads it back as the same flag value (a word, a path, a whole
/// number), else quoted as JSON quotes it (a valid YAML double-quoted
/// scalar).
fn yaml_scalar(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(s) => {
            let word = s.starts_with(|c: char| c.is_ascii_alphabetic() || c == '/')
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_./,=-".contains(c));
            let special = matches!(
                s.to_ascii_lowercase().as_str(),
                "null" | "true" | "false" | "yes" | "no" | "on" | "off" | "y" | "n"
            );
            if (word && !special) || s.parse::<i64>().is_ok() {
                s.clone()
            } else {
                v.to_string()
            }
        }
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn argv(s: &str) -> Vec<OsString> {
        s.split_whitespace().map(OsString::from).collect()
    }

    /// The expanded command line of `s`, as strings.
    fn expanded(s: &str) -> Vec<String> {
        expand(&argv(s), &crate::Cli::command())
            .unwrap()
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    fn recipe(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("hlo-recipe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn keys_become_flags_before_the_command_lines_own() {
        let r = recipe(
            "a.yaml",
            "lora_rank: 4\nlora-alpha: 8.5\npacking: true\nfull: false\nlora_targets: [q_proj, v_proj]\nlr: 2.0e-3\nsteps: 7\n",
        );
        let got = expanded(&format!(
            "hlo-train train --recipe {} --lora-rank 16",
            r.display()
        ));
        let want = format!(
            "hlo-train train --lora-alpha 8.5 --packing on --lora-targets q_proj,v_proj --lr 0.002 --steps 7 --recipe {} --lora-rank 16",
            r.display()
        );
        assert_eq!(got.join(" "), want);
        // plan takes a train recipe: `steps` and `lr` are train's alone.
        let plan = expanded(&format!("hlo-train plan --recipe {}", r.display()));
        assert!(!plan.contains(&"--steps".to_string()), "{plan:?}");
        assert!(plan.contains(&"--lora-rank".to_string()), "{plan:?}");
    }

    #[test]
    fn a_model_flag_replaces_the_recipes_model() {
        let r = recipe("m.yaml", "checkpoint: /x\nseq: 32\n");
        let got = expanded(&format!(
            "hlo-train train --recipe {} --model tiny",
            r.display()
        ));
        assert!(!got.contains(&"--checkpoint".to_string()), "{got:?}");
        assert!(got.contains(&"--seq".to_string()), "{got:?}");
    }

    #[test]
    fn a_written_recipe_names_its_files_by_absolute_path() {
        use clap::Args;
        // A path relative to the test's folder (the crate's): one that
        // exists, so it must come out absolute.
        let train = crate::commands::train::TrainArgs::augment_args(clap::Command::new("train"));
        let sub = train
            .clone()
            .try_get_matches_from(["train", "--eval-data", "Cargo.toml"])
            .unwrap();
        let text = effective(&train, &sub, &[]);
        let want = std::fs::canonicalize("Cargo.toml").unwrap();
        assert!(
            text.contains(&format!("eval_data: {}\n", want.display())),
            "{text}"
        );
        assert!(text.contains("plugin: cpu\n"), "{text}");
        // A run token is a secret: never written, whether from the flag or
        // the environment.
        let sub = train
            .clone()
            .try_get_matches_from(["train", "--run-token", "hunter2"])
            .unwrap();
        let text = effective(&train, &sub, &[]);
        assert!(
            !text.contains("hunter2") && !text.contains("run_token"),
            "{text}"
        );
    }

    #[test]
    fn bad_recipes_are_one_line_naming_the_key_and_file() {
        for (text, want) in [
            ("lora_rnak: 4\n", "unknown key `lora_rnak`"),
            ("full: 3\n", "key `full` is a switch"),
            ("seq: {a: 1}\n", "key `seq` must be a number"),
            ("- a\n- b\n", "expected a mapping"),
            ("recipe: x.yaml\n", "`recipe` cannot be set"),
            (
                "run_token: hunter2\n",
                "key `run_token`: a run token is a secret and is not read from a recipe",
            ),
            ("seq: [1, 2\n", "not YAML"),
            (
                "learning_rate: 1.0e-4\n",
                "unknown key `learning_rate`: hlo-train's key for TRL's learning_rate is `lr`",
            ),
            (
                "max-steps: 10\n",
                "unknown key `max-steps`: hlo-train's key for transformers' max_steps is `steps`",
            ),
            ("lr: .inf\n", "key `lr` is .inf, not a finite number"),
            ("lr: -.inf\n", "key `lr` is -.inf"),
            ("lr: .nan\n", "key `lr` is .nan"),
            (
                "lora_targets: [q_proj, .inf]\n",
                "key `lora_targets` is .inf",
            ),
            (
                "lora_rank: 4\nlora-rank: 8\n",
                "keys `lora_rank` and `lora-rank` both set --lora-rank",
            ),
        ] {
            let r = recipe("bad.yaml", text);
            let err = expand(
                &argv(&format!("hlo-train train --recipe {}", r.display())),
                &crate::Cli::command(),
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains(want), "{text:?}: {err}");
            assert!(err.contains("bad.yaml"), "{err}");
            assert!(!err.contains('\n'), "{err}");
        }
        let err = expand(
            &argv("hlo-train train --recipe /nonexistent/r.yaml"),
            &crate::Cli::command(),
        )
        .unwrap_err();
        assert!(
            format!("{err:#}").contains("cannot read recipe /nonexistent/r.yaml"),
            "{err:#}"
        );
    }
}
