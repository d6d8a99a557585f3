//! How an objective's settings are declared: once, as the fields of its
//! spec (a struct deriving `clap::Args`, `Serialize` and `Deserialize`).
//! A field's `#[arg]` gives its flag (kebab-case of the field's name, as
//! TRL's config field reads), its default and its check; its doc comment
//! is its `--help` line and docs/cli.md's; serde (`rename_all =
//! "kebab-case"`) records it under the flag's name. From that one
//! declaration follow the spec's `Default` ([`defaults`]), what a run
//! records ([`record`]), what a resumed run takes back ([`restore`]),
//! which settings a command line gave ([`given`]) and their names
//! ([`names`]). Nothing here names an objective or a setting.
//!
//! ```
//! use clap::Args;
//! use hlo_engine::settings::{defaults, names, record, non_negative};
//! use serde::{Deserialize, Serialize};
//!
//! /// An objective's settings, as each objective declares its own.
//! #[derive(Args, Clone, Debug, PartialEq, Serialize, Deserialize)]
//! #[serde(rename_all = "kebab-case")]
//! struct ExampleSpec {
//!     /// The weight of a chosen example's loss.
//!     #[arg(long, default_value_t = 1.0, value_parser = non_negative)]
//!     chosen_weight: f64,
//! }
//!
//! let spec: ExampleSpec = defaults();
//! assert_eq!(spec.chosen_weight, 1.0);
//! assert_eq!(names::<ExampleSpec>(), ["chosen-weight"]);
//! assert_eq!(record(&spec)["chosen-weight"], 1.0);
//! ```

use std::path::{Path, PathBuf};

use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, Command, FromArgMatches};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

use crate::named::Named;

/// A spec's values with no flag given: the defaults its `#[arg]`s
/// declare. Each spec's `Default` is this.
pub fn defaults<T: Args + FromArgMatches>() -> T {
    let command = T::augment_args(Command::new("defaults").no_binary_name(true));
    // A spec whose defaults do not parse is a defect of its declaration
    // (every spec's default is checked by a test), never a user's input.
    let matches = command
        .try_get_matches_from(std::iter::empty::<String>())
        .unwrap_or_else(|e| panic!("a spec's defaults do not parse: {e}"));
    T::from_arg_matches(&matches).unwrap_or_else(|e| panic!("a spec's defaults do not parse: {e}"))
}

/// The names of a spec's settings (its flags' long names).
pub fn names<T: Args>() -> Vec<String> {
    T::augment_args(Command::new("names"))
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect()
}

/// A spec's settings by name, as a run records them: a setting that is
/// not set (None) is left out.
pub fn record<T: Serialize>(spec: &T) -> Map<String, Value> {
    match serde_json::to_value(spec) {
        Ok(Value::Object(map)) => map.into_iter().filter(|(_, v)| !v.is_null()).collect(),
        // Specs are structs of plain values: an object, always.
        _ => Map::new(),
    }
}

/// The names of `spec`'s settings whose values are not the defaults'.
pub fn given<T: Serialize + Args + FromArgMatches>(spec: &T) -> Vec<String> {
    let (now, default) = (record(spec), record(&defaults::<T>()));
    let mut keys: Vec<String> = now.keys().chain(default.keys()).cloned().collect();
    keys.sort_unstable();
    keys.dedup();
    keys.retain(|k| now.get(k) != default.get(k));
    keys
}

/// `spec` with each saved setting `take` accepts (by name) put back;
/// Err names the first saved value that is not of its setting's kind.
pub fn restore<T: Serialize + DeserializeOwned>(
    spec: &T,
    saved: &Map<String, Value>,
    take: impl Fn(&str) -> bool,
) -> Result<T, String> {
    let mut merged = record(spec);
    let known: Vec<String> = names_of(&serde_json::to_value(spec).unwrap_or_default());
    for (key, value) in saved {
        if known.contains(key) && take(key) {
            let mut one = merged.clone();
            one.insert(key.clone(), value.clone());
            // Each value alone first, so the one that does not fit is named.
            serde_json::from_value::<T>(Value::Object(one)).map_err(|_| key.clone())?;
            merged.insert(key.clone(), value.clone());
        }
    }
    serde_json::from_value(Value::Object(merged)).map_err(|e| e.to_string())
}

fn names_of(value: &Value) -> Vec<String> {
    value
        .as_object()
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

/// The value parser of a setting among a few names ([`Named`]).
pub fn named<T: Named>() -> impl TypedValueParser<Value = T> {
    PossibleValuesParser::new(T::ALL.iter().map(|v| v.name()))
        .try_map(|s| T::from_name(&s).ok_or_else(|| format!("`{s}` is not one of its values")))
}

/// A finite number.
pub fn finite(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() => Ok(v),
        Ok(_) => Err("must be a finite number".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A finite number >= 0.
pub fn non_negative(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        Ok(_) => Err("must be a finite number >= 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A finite number > 0.
pub fn positive(s: &str) -> Result<f64, String> {
    match non_negative(s) {
        Ok(v) if v > 0.0 => Ok(v),
        Ok(_) => Err("must be > 0".into()),
        Err(e) => Err(e),
    }
}

/// A learning rate: >= 0 and small enough that the schedule, computed in
/// f32 on the device, stays finite.
pub fn learning_rate(s: &str) -> Result<f64, String> {
    match non_negative(s) {
        Ok(v) if v <= 1e30 => Ok(v),
        Ok(_) => Err("must be at most 1e30 (the schedule is computed in f32)".into()),
        Err(e) => Err(e),
    }
}

/// A comma-separated list of names, each trimmed (empty: none).
pub fn comma_list(s: &str) -> Result<Vec<String>, String> {
    Ok(s.split(',')
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect())
}

/// A label smoothing in [0, 0.5] (above a half the labels swap).
pub fn label_smoothing(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|_| format!("`{s}` is not a number"))?;
    if !(0.0..=0.5).contains(&v) {
        return Err("must be between 0 and 0.5".into());
    }
    Ok(v)
}

/// `MIN,MAX`: two finite numbers, the least first.
pub(crate) fn clip_range(s: &str) -> Result<(f64, f64), String> {
    let bad = || format!("`{s}` is not MIN,MAX (two finite numbers, the least first)");
    let (lo, hi) = s.split_once(',').ok_or_else(bad)?;
    let num = |x: &str| x.trim().parse::<f64>().ok().filter(|v| v.is_finite());
    match (num(lo), num(hi)) {
        (Some(lo), Some(hi)) if lo <= hi => Ok((lo, hi)),
        _ => Err(bad()),
    }
}

/// A path flag that also takes a Hugging Face hub id
/// `ORG/NAME[@REVISION]` of an adapter: a path that exists is itself; an
/// id is its snapshot in the HF cache, downloaded there when missing
/// (never with `HF_HUB_OFFLINE=1`).
pub fn hub_adapter(s: &str) -> Result<PathBuf, String> {
    hub_path(s, hlo_hub::HubFiles::Adapter)
}

/// [`hub_adapter`] for a model folder (`--checkpoint`).
pub fn hub_model(s: &str) -> Result<PathBuf, String> {
    hub_path(s, hlo_hub::HubFiles::Model)
}

/// [`hub_adapter`] for a folder with a chat template's
/// tokenizer_config.json (`--chat-template`).
pub fn hub_chat_template(s: &str) -> Result<PathBuf, String> {
    hub_path(s, hlo_hub::HubFiles::ChatTemplate)
}

/// [`hub_adapter`] for a `tokenizer.json` (`--tokenizer`).
pub fn hub_tokenizer(s: &str) -> Result<PathBuf, String> {
    hub_path(s, hlo_hub::HubFiles::Tokenizer)
}

fn hub_path(s: &str, files: hlo_hub::HubFiles) -> Result<PathBuf, String> {
    hlo_hub::resolve(Path::new(s), files).map_err(|e| e.to_string())
}

/// A setting among a few names, recorded by its name
/// (`#[serde(with = "by_name")]`).
pub mod by_name {
    use super::*;

    pub fn serialize<T: Named, S: Serializer>(value: &T, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(value.name())
    }

    pub fn deserialize<'de, T: Named, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
        let name = String::deserialize(d)?;
        T::from_name(&name).ok_or_else(|| serde::de::Error::custom(format!("`{name}`")))
    }
}

/// A setting among a few names or none, recorded by its name
/// (`#[serde(with = "opt_by_name")]`).
pub mod opt_by_name {
    use super::*;

    pub fn serialize<T: Named, S: Serializer>(value: &Option<T>, s: S) -> Result<S::Ok, S::Error> {
        match value {
            Some(v) => s.serialize_str(v.name()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, T: Named, D: Deserializer<'de>>(d: D) -> Result<Option<T>, D::Error> {
        match Option::<String>::deserialize(d)? {
            None => Ok(None),
            Some(name) => T::from_name(&name)
                .map(Some)
                .ok_or_else(|| serde::de::Error::custom(format!("`{name}`"))),
        }
    }
}

/// A list of settings each recorded as the flag spells it
/// (`#[serde(with = "as_written")]`: `--reward accuracy:2`).
pub mod as_written {
    use super::*;

    pub fn serialize<T: std::fmt::Display, S: Serializer>(
        items: &[T],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(items.iter().map(|t| t.to_string()))
    }

    pub fn deserialize<'de, T: std::str::FromStr, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<T>, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|s| {
                s.parse()
                    .map_err(|_| serde::de::Error::custom(format!("`{s}`")))
            })
            .collect()
    }
}

/// A list of names recorded as the flag writes it, comma-separated
/// (`#[serde(with = "as_comma_list")]`: `--lora-targets q_proj,v_proj`).
pub mod as_comma_list {
    use super::*;

    pub fn serialize<S: Serializer>(items: &[String], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&items.join(","))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        comma_list(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }
}

/// `--xla-option`'s value: `KEY=VALUE`.
pub fn xla_option(s: &str) -> Result<(String, hlo_runtime::XlaOption), String> {
    hlo_runtime::parse_xla_option(s).map_err(|e| e.to_string())
}

/// XLA options recorded as `--xla-option` spells each (`#[serde(with =
/// "xla_options_written")]`), so a recipe and a resume read them back.
pub mod xla_options_written {
    use super::*;
    use hlo_runtime::XlaOption;

    pub fn serialize<S: Serializer>(
        options: &[(String, XlaOption)],
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.collect_seq(options.iter().map(|(k, v)| format!("{k}={v}")))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Vec<(String, XlaOption)>, D::Error> {
        Vec::<String>::deserialize(d)?
            .iter()
            .map(|o| xla_option(o).map_err(serde::de::Error::custom))
            .collect()
    }
}

/// A path recorded absolute, so a resumed run finds it from anywhere
/// (`#[serde(serialize_with = "absolute_path")]`).
pub fn absolute_path<S: Serializer>(path: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
    match path {
        Some(p) => s.serialize_str(&absolute(p)),
        None => s.serialize_none(),
    }
}

/// A path of what the run writes, recorded absolute (from the working
/// folder where it does not exist yet: a metrics file), so a resumed run
/// writes there from anywhere (`#[serde(serialize_with =
/// "absolute_new_path")]`).
pub fn absolute_new_path<S: Serializer>(path: &Option<PathBuf>, s: S) -> Result<S::Ok, S::Error> {
    match path {
        Some(p) => s.serialize_str(&absolute_new(p).map_err(serde::ser::Error::custom)?),
        None => s.serialize_none(),
    }
}

/// An absolute path for `p`, which may not exist yet.
pub(crate) fn absolute_new(p: &Path) -> std::io::Result<String> {
    if p.exists() {
        return Ok(absolute(p));
    }
    Ok(std::env::current_dir()?.join(p).display().to_string())
}

/// `p` made absolute where it exists (else as given).
pub(crate) fn absolute(p: &Path) -> String {
    std::fs::canonicalize(p)
        .unwrap_or_else(|_| p.to_path_buf())
        .display()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objectives::ObjectiveSpecs;

    #[test]
    fn every_setting_records_and_restores_what_it_declares() {
        let specs = ObjectiveSpecs::default();
        assert!(given(&specs).is_empty());
        let saved = record(&specs);
        let back = restore(&ObjectiveSpecs::default(), &saved, |_| true).unwrap();
        assert_eq!(back, specs);
        // The record's keys are the flags'.
        let mut flags = names::<ObjectiveSpecs>();
        flags.sort_unstable();
        for key in saved.keys() {
            assert!(
                flags.binary_search(key).is_ok(),
                "{key} is recorded, not a flag"
            );
        }
    }

    #[test]
    fn a_value_of_another_kind_is_named() {
        let specs = ObjectiveSpecs::default();
        let saved = record(&specs);
        assert!(saved.len() > 20, "{saved:?}");
        // An object is no setting's kind: each is refused by its name.
        for name in saved.keys() {
            let bad: Map<String, Value> = [(name.clone(), Value::Object(Map::new()))]
                .into_iter()
                .collect();
            assert_eq!(restore(&specs, &bad, |_| true).unwrap_err(), *name);
        }
    }
}
