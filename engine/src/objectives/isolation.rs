//! The objective seam, checked on the source: each objective's folder
//! names no other objective's module, only the machinery objectives
//! share (the rollouts, and the reference as the preference objectives
//! choose it), and the shared machinery names no objective. This is what
//! lets an objective be added, or removed, as one folder, one arm of the
//! loss match and one flag group.

use std::path::Path;

/// The objectives' folders here and in `hlo-models`, by module name.
const OBJECTIVES: &[&str] = &[
    "preference",
    "cpo",
    "grpo",
    "kto",
    "rloo",
    "reward",
    "distill",
];

/// What each folder may name besides itself: the shared rollouts, or
/// (KTO, CPO) the preference objectives' reference, β and pair helpers.
fn may_name(folder: &str, other: &str) -> bool {
    matches!(
        (folder, other),
        ("grpo" | "rloo" | "distill", "rollouts") | ("kto" | "cpo", "preference")
    )
}

/// The modules a folder's source names, as `super::NAME`,
/// `objectives::NAME` or `crate::NAME` (the models crate's spelling).
fn named_modules(dir: &Path, crate_level: bool) -> Vec<(String, String)> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for name in OBJECTIVES.iter().chain(&["rollouts"]) {
            let mut spellings = vec![format!("super::{name}"), format!("objectives::{name}")];
            if crate_level {
                spellings.push(format!("crate::{name}::"));
            }
            if spellings.iter().any(|s| {
                text.match_indices(s.as_str()).any(|(at, _)| {
                    // A whole module name: `super::rloo`, not `crate::rollouts`
                    // for `super::rol…`.
                    let rest = &text[at + s.len()..];
                    !rest.starts_with(|c: char| c.is_alphanumeric() || c == '_')
                        || s.ends_with("::")
                })
            }) {
                found.push((name.to_string(), path.display().to_string()));
            }
        }
    }
    found
}

#[test]
fn each_objective_folder_names_only_shared_machinery() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let models = root.join("../models/src");
    for folder in OBJECTIVES {
        for (dir, crate_level) in [
            (root.join("src/objectives").join(folder), false),
            (models.join(folder), true),
        ] {
            for (other, file) in named_modules(&dir, crate_level) {
                // In `hlo-models` the preference losses are one enum, CPO's
                // loss one of its variants.
                let shared_in_models = crate_level
                    && (other == "preference"
                        || (*folder, other.as_str()) == ("preference", "cpo"));
                assert!(
                    other == *folder || may_name(folder, &other) || shared_in_models,
                    "{file} names the {other} objective's module"
                );
            }
        }
    }
    for (other, file) in named_modules(&root.join("src/rollouts"), false) {
        assert_eq!(
            other, "rollouts",
            "{file}: the shared rollouts name {other}"
        );
    }
}
