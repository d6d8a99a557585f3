//! The objective seam, checked on the source: each objective's folder
//! names no other objective's module, only the machinery objectives
//! share (the rollouts, and the reference as the preference objectives
//! choose it), and the shared machinery names no objective. This is what
//! lets an objective be added, or removed, as one folder, one arm of the
//! loss match and one flag group.

use std::path::Path;

/// The objectives' folders: every folder of `engine/src/objectives`
/// (each objective's, or the preference objectives' shared one).
fn objective_folders() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/objectives");
    let mut folders: Vec<String> = std::fs::read_dir(&root)
        .expect("src/objectives")
        .flatten()
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    folders.sort();
    folders
}

/// What each folder may name besides itself: the shared rollouts, and
/// the preference objectives' reference, β and pair helpers.
fn may_name(other: &str) -> bool {
    other == "rollouts" || other == "preference"
}

/// The methods `hlo-models`' `PreferenceLoss` enum holds, by module name:
/// its variants in lower case (the preference losses' module names each).
fn preference_losses(models: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(models.join("preference/mod.rs")).expect("preference");
    let body = &text[text
        .find("pub enum PreferenceLoss {")
        .expect("PreferenceLoss")..];
    let body = &body[..body.find("\n}").expect("its end")];
    body.lines()
        .map(str::trim)
        .filter(|l| l.starts_with(|c: char| c.is_ascii_uppercase()))
        .map(|l| {
            l.chars()
                .take_while(|c| c.is_alphanumeric())
                .collect::<String>()
                .to_lowercase()
        })
        .collect()
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
        for name in objective_folders()
            .iter()
            .map(String::as_str)
            .chain(["rollouts"])
        {
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
    let folders = objective_folders();
    assert!(folders.len() >= 7, "{folders:?}");
    let in_preference_loss = preference_losses(&models);
    assert!(
        in_preference_loss.contains(&"dpo".to_string()),
        "{in_preference_loss:?}"
    );
    for folder in &folders {
        for (dir, crate_level) in [
            (root.join("src/objectives").join(folder), false),
            (models.join(folder), true),
        ] {
            for (other, file) in named_modules(&dir, crate_level) {
                // In `hlo-models` the preference losses are one enum, a
                // method with its own folder (CPO's) one of its variants.
                let shared_in_models =
                    crate_level && folder == "preference" && in_preference_loss.contains(&other);
                assert!(
                    other == *folder || may_name(&other) || shared_in_models,
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
