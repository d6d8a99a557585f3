//! What is checked of a request before it is queued, and of an adapter's
//! declared base before it is registered.

use std::path::Path;

use hlo_models::decoder::ModelConfig;

use super::{GenerationRequest, SubmitError};
use crate::error::{EngineError, Result};
use crate::inputs::model::Model;

/// Checks a request against the model and the cache in exact arithmetic:
/// a prompt of known tokens that leaves room for at least one generated
/// token, and `max_tokens` that fits what is left.
pub(super) fn check_request(
    request: &GenerationRequest,
    config: &ModelConfig,
    max_model_len: i64,
) -> Result<(), SubmitError> {
    let len = request.prompt.len();
    if len == 0 {
        return Err(SubmitError::Invalid("prompt", "the prompt is empty".into()));
    }
    if let Some(&bad) = request
        .prompt
        .iter()
        .find(|&&t| i64::from(t) >= config.vocab_size)
    {
        return Err(SubmitError::Invalid(
            "prompt",
            format!(
                "token id {bad} is outside the vocabulary (size {})",
                config.vocab_size
            ),
        ));
    }
    let max_len = usize::try_from(max_model_len).unwrap_or(usize::MAX);
    if len >= max_len {
        return Err(SubmitError::Invalid(
            "prompt",
            format!(
                "the prompt has {len} tokens; this model's maximum context length is {max_len}, which must also hold at least one generated token"
            ),
        ));
    }
    if request.max_tokens == 0 {
        return Err(SubmitError::Invalid(
            "max_tokens",
            "max_tokens must be at least 1".into(),
        ));
    }
    if len
        .checked_add(request.max_tokens)
        .is_none_or(|total| total > max_len)
    {
        return Err(SubmitError::Invalid(
            "max_tokens",
            format!(
                "this model's maximum context length is {max_len} tokens; the prompt has {len} and max_tokens is {}: at most {} can be generated",
                request.max_tokens,
                max_len - len
            ),
        ));
    }
    Ok(())
}

/// The names a served model answers to, as an adapter's
/// `base_model_name_or_path` may give them: how the user named it, its
/// folder (resolved), and the hub id of a hub cache snapshot
/// (`.../models--ORG--NAME/snapshots/REV`).
pub(super) fn base_names(model: &Model) -> Vec<String> {
    let mut names = vec![model.name.clone()];
    if let Some(c) = &model.checkpoint {
        let dir = std::fs::canonicalize(&c.dir).unwrap_or_else(|_| c.dir.clone());
        names.push(dir.display().to_string());
        let parts: Vec<String> = dir
            .components()
            .map(|p| p.as_os_str().to_string_lossy().into_owned())
            .collect();
        if let [.., repo, snapshots, _] = parts.as_slice() {
            if let (Some(id), "snapshots") = (repo.strip_prefix("models--"), snapshots.as_str()) {
                names.push(id.replacen("--", "/", 1));
            }
        }
    }
    names
}

/// Refuses an adapter (`dir`) whose declared base is not the served model
/// (`served`, `config`) when that base's `config.json` can be read here
/// (a folder, or a hub id in the local cache: nothing is downloaded) and
/// describes another architecture or other shapes. A base that cannot be
/// read is accepted: its shapes were checked against the served model's.
pub(super) fn check_declared_base(
    dir: &Path,
    declared: &str,
    served: &[String],
    config: &ModelConfig,
) -> Result<()> {
    let same_path =
        |p: &Path| std::fs::canonicalize(p).is_ok_and(|p| served.iter().any(|s| Path::new(s) == p));
    if served.iter().any(|s| s == declared) || same_path(Path::new(declared)) {
        return Ok(());
    }
    let env = crate::hub::HubEnv {
        offline: true,
        ..crate::hub::HubEnv::from_env()
    };
    let Ok(folder) =
        crate::hub::resolve_with(Path::new(declared), crate::hub::HubFiles::Model, &env)
    else {
        return Ok(());
    };
    let file = folder.join("config.json");
    if !file.is_file() || same_path(&folder) {
        return Ok(());
    }
    let refuse = |why: String| EngineError::AdapterBase {
        dir: dir.to_path_buf(),
        declared: declared.to_string(),
        why,
    };
    let theirs = ModelConfig::from_file(&file).map_err(|e| {
        refuse(format!(
            "whose config.json is not a served architecture ({e})"
        ))
    })?;
    let shape = |c: &ModelConfig| {
        (
            c.family.model_type(),
            [
                c.vocab_size,
                c.hidden_size,
                c.intermediate_size,
                c.num_hidden_layers,
                c.num_attention_heads,
                c.num_key_value_heads,
                c.head_dim,
            ],
        )
    };
    let (ours, base) = (shape(config), shape(&theirs));
    if ours.0 != base.0 {
        return Err(refuse(format!(
            "a {} model, and the served model is {}",
            base.0, ours.0
        )));
    }
    if ours.1 != base.1 {
        return Err(refuse(format!(
            "whose shapes (vocabulary, hidden, intermediate, layers, heads, key/value heads, head size) are {:?}, the served model's {:?}",
            base.1, ours.1
        )));
    }
    Ok(())
}
