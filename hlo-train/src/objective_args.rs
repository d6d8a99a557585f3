//! What `plan` and `bench` take of an objective beyond its settings
//! (which are its spec's fields, flattened into `train`'s flags from
//! `hlo_engine::objectives::ObjectiveSpecs`): the reference they plan with, and a
//! teacher named by a preset, a folder or a config.

use std::path::PathBuf;

use anyhow::{bail, Result};
use hlo_engine::models::preference::Reference;
use hlo_engine::objectives::Objective;

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

/// A teacher as `plan` and `bench` take one: a preset's name, an HF
/// checkpoint folder, or a `config.json` (random weights).
pub fn teacher_model(source: &str) -> Result<hlo_engine::inputs::model::Model> {
    use hlo_engine::inputs::model::ModelSource;
    let path = PathBuf::from(source);
    let source = if path.is_dir() {
        ModelSource::Checkpoint(path)
    } else if path.is_file() {
        ModelSource::Config(path)
    } else {
        ModelSource::Preset(source.to_string())
    };
    Ok(hlo_engine::inputs::model::Model::open(&source)?)
}
