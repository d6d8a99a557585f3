//! Hugging Face Hub ids (`ORG/NAME`, `ORG/NAME@REVISION`) in place of local
//! paths: found in the Hugging Face cache exactly as `huggingface_hub`
//! lays it out, and downloaded into it with `hf-hub` when missing.
//!
//! The cache is `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`. A
//! repo lives in `models--ORG--NAME/`: `refs/REVISION` holds the commit a
//! branch, tag or `refs/pr/N` pointed at, `snapshots/COMMIT/` the files of
//! that commit as relative links into `blobs/`. A cached snapshot is used
//! without asking the Hub whether the branch has moved on.
//!
//! `hlo-hub` owns that layout (reading it, and after a download making it
//! exactly `huggingface_hub`'s) and the choice of files per use
//! ([`HubFiles`]); `hf-hub` fetches the files (blobs, snapshot links) and
//! decides nothing else. A local path that exists always wins over an id.

use std::ffi::OsString;
use std::fmt;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use hf_hub::api::sync::{Api, ApiBuilder, ApiError};
use hf_hub::api::RepoInfo;
use hf_hub::{Cache, Repo, RepoType};

/// The Hub's address when `HF_ENDPOINT` is not set.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

const INDEX: &str = "model.safetensors.index.json";
const TOKENIZER_FILES: [&str; 3] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// What a caller needs from a repo: decides which file proves a cached
/// snapshot usable and which files a download fetches. Only files at the
/// repo's top level are fetched, never `.bin`, `.pt`, `.gguf` or
/// `original/`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HubFiles {
    /// A transformers model: `config.json`, `generation_config.json`, the
    /// safetensors weights (only the shards its index names, when it has
    /// one), the tokenizer and the chat template.
    Model,
    /// A PEFT LoRA adapter: `adapter_config.json`,
    /// `adapter_model.safetensors`, and the tokenizer files and chat
    /// template when the repo has them.
    Adapter,
    /// A tokenizer: `tokenizer.json`, `tokenizer_config.json`,
    /// `special_tokens_map.json`.
    Tokenizer,
    /// A chat template: `tokenizer_config.json`, `chat_template.jinja`.
    ChatTemplate,
}

impl HubFiles {
    /// The file whose presence makes a snapshot usable. A download fetches
    /// it last, so an interrupted download leaves no usable snapshot.
    pub fn required(self) -> &'static str {
        match self {
            HubFiles::Model => "config.json",
            HubFiles::Adapter => "adapter_config.json",
            HubFiles::Tokenizer => "tokenizer.json",
            HubFiles::ChatTemplate => "tokenizer_config.json",
        }
    }

    /// Whether a download fetches the repo file `name` (a path in the repo).
    pub(crate) fn wants(self, name: &str) -> bool {
        if name.contains('/') {
            return false;
        }
        let tokenizer = TOKENIZER_FILES.contains(&name);
        match self {
            HubFiles::Model => {
                tokenizer
                    || name.ends_with(".safetensors")
                    || matches!(
                        name,
                        "config.json" | "generation_config.json" | INDEX | "chat_template.jinja"
                    )
            }
            HubFiles::Adapter => {
                tokenizer
                    || matches!(
                        name,
                        "adapter_config.json" | "adapter_model.safetensors" | "chat_template.jinja"
                    )
            }
            HubFiles::Tokenizer => tokenizer,
            HubFiles::ChatTemplate => {
                matches!(name, "tokenizer_config.json" | "chat_template.jinja")
            }
        }
    }

    /// Why a repo without the required file cannot serve this use.
    fn missing_hint(self) -> &'static str {
        match self {
            HubFiles::Model => "it is not a transformers model repo",
            HubFiles::Adapter => "it is not a PEFT adapter repo",
            HubFiles::Tokenizer => "hlo-train reads a fast tokenizer's tokenizer.json",
            HubFiles::ChatTemplate => "the chat template is read from tokenizer_config.json",
        }
    }
}

/// A Hub model id with its revision (a branch, tag, `refs/pr/N` or
/// 40-hex commit; `main` when not given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HubId {
    /// `ORG/NAME`.
    pub repo: String,
    /// What follows `@`, or `main`.
    pub revision: String,
}

impl HubId {
    /// Reads `ORG/NAME` or `ORG/NAME@REVISION`; `None` for anything else
    /// (absolute paths, `./x/y`, `../x`, more or fewer than one `/`).
    pub fn parse(spec: &str) -> Option<HubId> {
        let (repo, revision) = match spec.split_once('@') {
            Some((repo, revision)) => (repo, revision),
            None => (spec, "main"),
        };
        let (org, name) = repo.split_once('/')?;
        if !is_id_part(org) || !is_id_part(name) {
            return None;
        }
        let revision_ok = !revision.is_empty()
            && !revision.chars().any(|c| c.is_whitespace() || c == '\\')
            && revision
                .split('/')
                .all(|part| !part.is_empty() && part != "." && part != "..");
        revision_ok.then(|| HubId {
            repo: repo.to_owned(),
            revision: revision.to_owned(),
        })
    }

    /// The repo's folder in the cache: `models--ORG--NAME`.
    pub(crate) fn folder_name(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }
}

impl fmt::Display for HubId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}@{}", self.repo, self.revision)
    }
}

fn is_id_part(part: &str) -> bool {
    !part.is_empty()
        && !part.starts_with(['.', '-'])
        && !part.contains("..")
        && part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// A full commit sha as the Hub writes it: 40 lowercase hex digits.
fn is_commit(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// The settings that `huggingface_hub` reads from the environment, passed
/// explicitly so that resolution can be tested without touching it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubEnv {
    /// `HF_HUB_CACHE` (or the older `HUGGINGFACE_HUB_CACHE`).
    pub hub_cache: Option<PathBuf>,
    /// `HF_HOME`.
    pub hf_home: Option<PathBuf>,
    /// `XDG_CACHE_HOME`.
    pub xdg_cache_home: Option<PathBuf>,
    /// `HOME`.
    pub home: Option<PathBuf>,
    /// `HF_HUB_OFFLINE` is 1, ON, YES or TRUE: never touch the network.
    pub offline: bool,
    /// `HF_TOKEN`, else `HUGGING_FACE_HUB_TOKEN`, else the token file
    /// `huggingface-cli login` wrote (`HF_TOKEN_PATH`, else
    /// `$HF_HOME/token`).
    pub token: Option<String>,
    /// `HF_ENDPOINT` without a trailing `/`, else [`DEFAULT_ENDPOINT`].
    pub endpoint: String,
    /// Draw download progress bars on stderr: when it is a terminal and
    /// `HF_HUB_DISABLE_PROGRESS_BARS` is not set.
    pub progress: bool,
}

impl Default for HubEnv {
    /// No variables set: no cache folder known, online, the public Hub.
    fn default() -> Self {
        HubEnv {
            hub_cache: None,
            hf_home: None,
            xdg_cache_home: None,
            home: None,
            offline: false,
            token: None,
            endpoint: DEFAULT_ENDPOINT.to_owned(),
            progress: false,
        }
    }
}

impl HubEnv {
    /// Reads this process's environment (and the token file).
    pub fn from_env() -> HubEnv {
        let mut env = HubEnv::from_vars(|key| std::env::var_os(key));
        env.progress &= std::io::stderr().is_terminal();
        env
    }

    /// Reads the settings through `var` (an environment lookup); empty
    /// values count as unset, a leading `~/` is the home folder.
    pub(crate) fn from_vars(var: impl Fn(&str) -> Option<OsString>) -> HubEnv {
        let get = |key: &str| var(key).filter(|v| !v.is_empty());
        let text = |key: &str| get(key).and_then(|v| v.into_string().ok());
        let truthy = |key: &str| {
            text(key).is_some_and(|v| {
                matches!(
                    v.trim().to_ascii_uppercase().as_str(),
                    "1" | "ON" | "YES" | "TRUE"
                )
            })
        };
        let home = get("HOME").map(PathBuf::from);
        let path = |key: &str| get(key).map(|v| expand_home(PathBuf::from(v), home.as_deref()));
        let mut env = HubEnv {
            hub_cache: path("HF_HUB_CACHE").or_else(|| path("HUGGINGFACE_HUB_CACHE")),
            hf_home: path("HF_HOME"),
            xdg_cache_home: path("XDG_CACHE_HOME"),
            home: home.clone(),
            offline: truthy("HF_HUB_OFFLINE"),
            token: None,
            endpoint: text("HF_ENDPOINT")
                .map(|e| e.trim_end_matches('/').to_owned())
                .unwrap_or_else(|| DEFAULT_ENDPOINT.to_owned()),
            progress: !truthy("HF_HUB_DISABLE_PROGRESS_BARS"),
        };
        let token_file =
            path("HF_TOKEN_PATH").or_else(|| env.hf_home_dir().map(|h| h.join("token")));
        env.token = text("HF_TOKEN")
            .or_else(|| text("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let token = std::fs::read_to_string(token_file?).ok()?;
                let token = token.trim();
                (!token.is_empty()).then(|| token.to_owned())
            })
            .map(|t| t.trim().to_owned());
        env
    }

    /// `HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else
    /// `~/.cache/huggingface`.
    fn hf_home_dir(&self) -> Option<PathBuf> {
        self.hf_home.clone().or_else(|| {
            let cache = self
                .xdg_cache_home
                .clone()
                .or_else(|| Some(self.home.as_ref()?.join(".cache")))?;
            Some(cache.join("huggingface"))
        })
    }

    /// The hub cache folder: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`;
    /// `None` when none of them is set.
    pub(crate) fn cache_dir(&self) -> Option<PathBuf> {
        self.hub_cache
            .clone()
            .or_else(|| Some(self.hf_home_dir()?.join("hub")))
    }
}

fn expand_home(path: PathBuf, home: Option<&Path>) -> PathBuf {
    match (path.strip_prefix("~"), home) {
        (Ok(rest), Some(home)) => home.join(rest),
        _ => path,
    }
}

/// Why a Hub id could not be resolved, in one line a user can act on.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// No variable names a cache folder.
    #[error("cannot find the Hugging Face cache for {id}: none of HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME or HOME is set")]
    NoCache { id: String },
    /// Offline, and the repo or revision was never downloaded.
    #[error("{id} is not in the Hugging Face cache (searched {}) and HF_HUB_OFFLINE is set; download it first or unset HF_HUB_OFFLINE", searched.display())]
    NotCached { id: String, searched: PathBuf },
    /// Offline, and a ref names a commit whose snapshot is gone.
    #[error("{id}: {} points at commit {commit} but {} is missing and HF_HUB_OFFLINE is set; download it again or unset HF_HUB_OFFLINE", ref_file.display(), snapshot.display())]
    MissingSnapshot {
        id: String,
        ref_file: PathBuf,
        commit: String,
        snapshot: PathBuf,
    },
    /// Offline, and the snapshot lacks the file the use needs.
    #[error("{id}: the cached snapshot {} has no {file} and HF_HUB_OFFLINE is set; download it again or unset HF_HUB_OFFLINE", snapshot.display())]
    IncompleteSnapshot {
        id: String,
        snapshot: PathBuf,
        file: &'static str,
    },
    /// Offline, and a ref file holds no commit.
    #[error("{id}: {} should hold a 40-hex commit but holds `{content}` and HF_HUB_OFFLINE is set; delete it and download again", ref_file.display())]
    BadRef {
        id: String,
        ref_file: PathBuf,
        content: String,
    },
    /// The repo exists but lacks a file the use needs.
    #[error("{id} on {endpoint} has no {file}: {hint}")]
    MissingInRepo {
        id: String,
        endpoint: String,
        file: String,
        hint: String,
    },
    /// Listing or downloading failed (network, HTTP status, disk).
    #[error("cannot download {id} from {endpoint}: {cause}")]
    Download {
        id: String,
        endpoint: String,
        cause: String,
    },
    /// The cache could not be read or written.
    #[error("cannot {action} {}: {cause}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        cause: std::io::Error,
    },
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> HubError {
    let path = path.to_path_buf();
    move |cause| HubError::Io {
        action,
        path,
        cause,
    }
}

/// Resolves `spec` against this process's environment; see
/// [`resolve_with`].
pub fn resolve(spec: &Path, files: HubFiles) -> Result<PathBuf, HubError> {
    if spec.exists() {
        return Ok(spec.to_path_buf());
    }
    resolve_with(spec, files, &HubEnv::from_env())
}

/// Turns a `--checkpoint`-like argument into a path. A `spec` that exists
/// on disk, or that is no Hub id, comes back unchanged. A Hub id comes
/// back as its snapshot folder (for [`HubFiles::Tokenizer`], the
/// `tokenizer.json` in it), from the cache when the snapshot there has
/// [`HubFiles::required`], else downloaded (unless `env.offline`).
pub fn resolve_with(spec: &Path, files: HubFiles, env: &HubEnv) -> Result<PathBuf, HubError> {
    if spec.exists() {
        return Ok(spec.to_path_buf());
    }
    let Some(id) = spec.to_str().and_then(HubId::parse) else {
        return Ok(spec.to_path_buf());
    };
    let cache = env
        .cache_dir()
        .ok_or_else(|| HubError::NoCache { id: id.to_string() })?;
    let repo_dir = cache.join(id.folder_name());
    let required = files.required();
    let snapshot = match lookup(&repo_dir, &id.revision, required)? {
        Cached::Usable(snapshot) => snapshot,
        cached if env.offline => return Err(offline_error(&id, &repo_dir, cached, required)),
        _ => {
            let attempt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                download(&id, files, env, &cache, &repo_dir)
            }));
            attempt.unwrap_or_else(|_| {
                Err(HubError::Download {
                    id: id.to_string(),
                    endpoint: env.endpoint.clone(),
                    cause: "hf-hub panicked on the Hub's answer".to_owned(),
                })
            })?
        }
    };
    Ok(match files {
        HubFiles::Tokenizer => snapshot.join(required),
        _ => snapshot,
    })
}

/// What the cache holds for one revision.
#[derive(Debug)]
enum Cached {
    /// The snapshot with the required file.
    Usable(PathBuf),
    /// No ref by that name (or no repo folder), and no snapshot of that
    /// commit.
    Absent,
    BadRef {
        ref_file: PathBuf,
        content: String,
    },
    NoSnapshot {
        ref_file: PathBuf,
        commit: String,
        snapshot: PathBuf,
    },
    NoFile {
        snapshot: PathBuf,
    },
}

/// Reads the cache as `huggingface_hub` does: `refs/REVISION` names the
/// commit if it exists, else a 40-hex revision is the commit.
fn lookup(repo_dir: &Path, revision: &str, required: &str) -> Result<Cached, HubError> {
    let ref_file = repo_dir.join("refs").join(revision);
    let (commit, ref_file) = if ref_file.is_file() {
        let content = std::fs::read_to_string(&ref_file).map_err(io_error("read", &ref_file))?;
        let commit = content.trim();
        if !is_commit(commit) {
            return Ok(Cached::BadRef {
                ref_file,
                content: commit.chars().take(80).collect(),
            });
        }
        (commit.to_owned(), Some(ref_file))
    } else if is_commit(revision) {
        (revision.to_owned(), None)
    } else {
        return Ok(Cached::Absent);
    };
    let snapshot = repo_dir.join("snapshots").join(&commit);
    if !snapshot.is_dir() {
        return Ok(match ref_file {
            Some(ref_file) => Cached::NoSnapshot {
                ref_file,
                commit,
                snapshot,
            },
            None => Cached::Absent,
        });
    }
    // `is_file` follows the link into blobs/: a dangling link is missing.
    Ok(if snapshot.join(required).is_file() {
        Cached::Usable(snapshot)
    } else {
        Cached::NoFile { snapshot }
    })
}

fn offline_error(id: &HubId, repo_dir: &Path, cached: Cached, required: &'static str) -> HubError {
    let id = id.to_string();
    match cached {
        Cached::Usable(_) | Cached::Absent => HubError::NotCached {
            id,
            searched: repo_dir.to_path_buf(),
        },
        Cached::BadRef { ref_file, content } => HubError::BadRef {
            id,
            ref_file,
            content,
        },
        Cached::NoSnapshot {
            ref_file,
            commit,
            snapshot,
        } => HubError::MissingSnapshot {
            id,
            ref_file,
            commit,
            snapshot,
        },
        Cached::NoFile { snapshot } => HubError::IncompleteSnapshot {
            id,
            snapshot,
            file: required,
        },
    }
}

/// Lists the revision, then downloads the wanted files of the commit it
/// names (pinned, so a branch moving meanwhile cannot mix two commits), the
/// required file last; then writes `refs/REVISION` as `huggingface_hub`
/// does. Files already in the snapshot are not fetched again.
fn download(
    id: &HubId,
    files: HubFiles,
    env: &HubEnv,
    cache: &Path,
    repo_dir: &Path,
) -> Result<PathBuf, HubError> {
    let failed = |cause: String| HubError::Download {
        id: id.to_string(),
        endpoint: env.endpoint.clone(),
        cause: one_line(&cause),
    };
    let missing = |file: &str, hint: &str| HubError::MissingInRepo {
        id: id.to_string(),
        endpoint: env.endpoint.clone(),
        file: file.to_owned(),
        hint: hint.to_owned(),
    };
    let api = ApiBuilder::from_cache(Cache::new(cache.to_path_buf()))
        .with_endpoint(env.endpoint.clone())
        .with_token(env.token.clone())
        .with_progress(env.progress)
        .with_retries(2)
        .with_user_agent("hlo-train", env!("CARGO_PKG_VERSION"))
        .build()
        .map_err(|e| failed(describe(e, id, env)))?;
    let (commit, names) = list_revision(&api, id, env, &failed)?;
    let required = files.required();
    if !names.iter().any(|n| n == required) {
        return Err(missing(required, files.missing_hint()));
    }

    let snapshot = repo_dir.join("snapshots").join(&commit);
    let pinned = api.repo(Repo::with_revision(
        id.repo.clone(),
        RepoType::Model,
        commit.clone(),
    ));
    let fetch = |name: &str| -> Result<(), HubError> {
        if snapshot.join(name).is_file() {
            return Ok(());
        }
        pinned
            .get(name)
            .map(drop)
            .map_err(|e| failed(format!("{name}: {}", describe(e, id, env))))
    };
    let index = if files == HubFiles::Model && names.iter().any(|n| n == INDEX) {
        fetch(INDEX)?;
        let path = snapshot.join(INDEX);
        Some(std::fs::read_to_string(&path).map_err(io_error("read", &path))?)
    } else {
        None
    };
    let wanted = select(files, &names, index.as_deref()).map_err(|e| match e {
        Selection::Missing { file, hint } => missing(&file, &hint),
        Selection::BadIndex(cause) => {
            failed(format!("{INDEX} is not a safetensors index: {cause}"))
        }
    })?;
    for name in &wanted {
        fetch(name)?;
    }
    finish_refs(repo_dir, &id.revision, &commit)?;
    if !snapshot.join(required).is_file() {
        return Err(failed(format!(
            "the download finished but {} is missing",
            snapshot.join(required).display()
        )));
    }
    Ok(snapshot)
}

/// The commit `id`'s revision names now and the files of its repo, as
/// the Hub lists them; `failed` words an error of the download.
fn list_revision(
    api: &Api,
    id: &HubId,
    env: &HubEnv,
    failed: &dyn Fn(String) -> HubError,
) -> Result<(String, Vec<String>), HubError> {
    let listing = api.repo(Repo::with_revision(
        id.repo.clone(),
        RepoType::Model,
        id.revision.clone(),
    ));
    let answer = listing
        .info_request()
        .call()
        .map_err(|e| failed(describe(ApiError::RequestError(Box::new(e)), id, env)))?;
    let info: RepoInfo = answer
        .into_json()
        .map_err(|e| failed(format!("the repo listing is not the Hub's JSON: {e}")))?;
    if !is_commit(&info.sha) {
        return Err(failed(format!(
            "the repo listing names commit `{}`, not a 40-hex sha",
            info.sha
        )));
    }
    let names = info.siblings.into_iter().map(|s| s.rfilename).collect();
    Ok((info.sha, names))
}

/// Why the files to fetch could not be chosen.
#[derive(Debug, PartialEq)]
enum Selection {
    Missing { file: String, hint: String },
    BadIndex(String),
}

/// The repo files to fetch, in order: the others, then the weights, then
/// the required file. With a safetensors index (its JSON in `index`), only
/// the shards it names are weights: other `.safetensors` at the top level
/// (Mistral's `consolidated.safetensors`) repeat them.
fn select(
    files: HubFiles,
    names: &[String],
    index: Option<&str>,
) -> Result<Vec<String>, Selection> {
    let required = files.required();
    let is_weights = |n: &str| n.ends_with(".safetensors");
    let mut wanted: Vec<String> = names
        .iter()
        .filter(|n| files.wants(n) && *n != required && !is_weights(n))
        .cloned()
        .collect();
    match (files, index) {
        (HubFiles::Model, Some(index)) => {
            #[derive(serde::Deserialize)]
            struct Index {
                weight_map: std::collections::BTreeMap<String, String>,
            }
            let index: Index =
                serde_json::from_str(index).map_err(|e| Selection::BadIndex(e.to_string()))?;
            let shards: std::collections::BTreeSet<String> =
                index.weight_map.into_values().collect();
            for shard in shards {
                if !files.wants(&shard) || !is_weights(&shard) {
                    return Err(Selection::BadIndex(format!("it names the shard `{shard}`")));
                }
                if !names.contains(&shard) {
                    return Err(Selection::Missing {
                        file: shard,
                        hint: format!("its {INDEX} names it"),
                    });
                }
                wanted.push(shard);
            }
        }
        (HubFiles::Model, None) => {
            let before = wanted.len();
            wanted.extend(
                names
                    .iter()
                    .filter(|n| files.wants(n) && is_weights(n))
                    .cloned(),
            );
            if wanted.len() == before {
                return Err(Selection::Missing {
                    file: "*.safetensors weights".to_owned(),
                    hint: "hlo-train reads safetensors, not .bin, .pt or .gguf".to_owned(),
                });
            }
        }
        (HubFiles::Adapter, _) => {
            let weights = "adapter_model.safetensors";
            if !names.iter().any(|n| n == weights) {
                return Err(Selection::Missing {
                    file: weights.to_owned(),
                    hint: "hlo-train reads adapter_model.safetensors, not adapter_model.bin"
                        .to_owned(),
                });
            }
            wanted.push(weights.to_owned());
        }
        _ => {}
    }
    wanted.push(required.to_owned());
    Ok(wanted)
}

/// Makes the refs `huggingface_hub`'s: `refs/REVISION` holds the commit
/// (unless the revision is that commit), and no `refs/COMMIT` naming
/// itself, which `hf-hub` writes when asked for a commit.
fn finish_refs(repo_dir: &Path, revision: &str, commit: &str) -> Result<(), HubError> {
    let refs = repo_dir.join("refs");
    if revision != commit {
        let ref_file = refs.join(revision);
        let current = std::fs::read_to_string(&ref_file).unwrap_or_default();
        if current.trim() != commit {
            if let Some(parent) = ref_file.parent() {
                std::fs::create_dir_all(parent).map_err(io_error("create", parent))?;
            }
            std::fs::write(&ref_file, commit).map_err(io_error("write", &ref_file))?;
        }
    }
    let self_ref = refs.join(commit);
    if std::fs::read_to_string(&self_ref).is_ok_and(|c| c.trim() == commit) {
        std::fs::remove_file(&self_ref).map_err(io_error("remove", &self_ref))?;
        // Only succeeds when empty, as when the revision was a commit.
        let _ = std::fs::remove_dir(&refs);
    }
    Ok(())
}

/// One line on what a Hub request's failure means for the user.
fn describe(err: ApiError, id: &HubId, env: &HubEnv) -> String {
    match err {
        ApiError::RequestError(e) => {
            let text = e.to_string();
            match (*e).into_response() {
                Some(answer) => {
                    let code = answer.header("x-error-code").unwrap_or_default().to_owned();
                    status_cause(answer.status(), answer.status_text(), &code, id, env)
                }
                // ureq writes `URL: what failed`; the message names the
                // endpoint already.
                None => match text.split_once(": ") {
                    Some((url, rest)) if url.starts_with(&env.endpoint) => rest.to_owned(),
                    _ => text,
                },
            }
        }
        ApiError::TooManyRetries(inner) => describe(*inner, id, env),
        other => other.to_string(),
    }
}

fn status_cause(status: u16, text: &str, code: &str, id: &HubId, env: &HubEnv) -> String {
    let token = if env.token.is_some() {
        "the token in HF_TOKEN has no access to it"
    } else {
        "set HF_TOKEN to a token with access (none is set)"
    };
    let repo = &id.repo;
    match (status, code) {
        (401 | 403, "GatedRepo") => format!(
            "HTTP {status}: {repo} is gated; accept its terms on its Hub page, then {}",
            if env.token.is_some() {
                "make sure HF_TOKEN belongs to that account"
            } else {
                "set HF_TOKEN to a token of that account"
            }
        ),
        (401 | 403, _) => {
            format!("HTTP {status}: {repo} does not exist, or it is private or gated and {token}")
        }
        (404, "RevisionNotFound") => {
            format!("HTTP 404: {repo} has no revision `{}`", id.revision)
        }
        (404, "EntryNotFound") => "HTTP 404: the file does not exist in that revision".to_owned(),
        (404, _) => format!(
            "HTTP 404: {repo} or its revision `{}` does not exist",
            id.revision
        ),
        _ => format!("HTTP {status} {text}"),
    }
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    const SHA: &str = "0123456789abcdef0123456789abcdef01234567";
    const SHA2: &str = "fedcba9876543210fedcba9876543210fedcba98";

    /// A unique folder under the temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> TempDir {
            static N: AtomicUsize = AtomicUsize::new(0);
            let dir = std::env::temp_dir().join(format!(
                "hlo-hub-test-{}-{name}-{}",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn env_with_cache(cache: &Path, offline: bool) -> HubEnv {
        HubEnv {
            hub_cache: Some(cache.to_path_buf()),
            offline,
            ..HubEnv::default()
        }
    }

    /// Lays out a snapshot as huggingface_hub does: blobs, relative links,
    /// and `refs/REF` when given.
    fn put_snapshot(cache: &Path, repo: &str, rf: Option<&str>, commit: &str, files: &[&str]) {
        let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
        let snapshot = repo_dir.join("snapshots").join(commit);
        std::fs::create_dir_all(&snapshot).unwrap();
        std::fs::create_dir_all(repo_dir.join("blobs")).unwrap();
        for (i, file) in files.iter().enumerate() {
            let blob = format!("{commit}{i:04}");
            std::fs::write(repo_dir.join("blobs").join(&blob), format!("{file}\n")).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(file)).unwrap();
        }
        if let Some(rf) = rf {
            let ref_file = repo_dir.join("refs").join(rf);
            std::fs::create_dir_all(ref_file.parent().unwrap()).unwrap();
            std::fs::write(ref_file, commit).unwrap();
        }
    }

    #[test]
    fn parses_ids() {
        let id = HubId::parse("meta-llama/Llama-3.2-1B").unwrap();
        assert_eq!(id.repo, "meta-llama/Llama-3.2-1B");
        assert_eq!(id.revision, "main");
        assert_eq!(id.to_string(), "meta-llama/Llama-3.2-1B@main");
        assert_eq!(id.folder_name(), "models--meta-llama--Llama-3.2-1B");
        let id = HubId::parse("Qwen/Qwen2.5-0.5B_x@v1.0").unwrap();
        assert_eq!(
            (id.repo.as_str(), id.revision.as_str()),
            ("Qwen/Qwen2.5-0.5B_x", "v1.0")
        );
        let id = HubId::parse("org/name@refs/pr/1").unwrap();
        assert_eq!(id.revision, "refs/pr/1");
        assert_eq!(
            HubId::parse(&format!("org/name@{SHA}")).unwrap().revision,
            SHA
        );
        for bad in [
            "name",
            "/abs/path",
            "./x/y",
            "../x",
            "x/y/z",
            "org/",
            "/name",
            ".org/name",
            "-org/name",
            "org/.name",
            "org/-name",
            "org/na..me",
            "org/na me",
            "org/na+me",
            "org/name@",
            "org/name@a b",
            "org/name@../x",
            "org/name@refs//1",
            "org/name@refs/",
            "",
            "checkpoints/run1.safetensors/",
        ] {
            assert_eq!(HubId::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn cache_dir_precedence() {
        let vars = |pairs: &[(&str, &str)]| {
            let map: HashMap<String, OsString> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), OsString::from(v)))
                .collect();
            HubEnv::from_vars(move |k| map.get(k).cloned())
        };
        let all = [
            ("HF_HUB_CACHE", "/a/hub"),
            ("HF_HOME", "/b"),
            ("XDG_CACHE_HOME", "/c"),
            ("HOME", "/d"),
        ];
        let dir = |n: usize| vars(&all[n..]).cache_dir();
        assert_eq!(dir(0), Some(PathBuf::from("/a/hub")));
        assert_eq!(dir(1), Some(PathBuf::from("/b/hub")));
        assert_eq!(dir(2), Some(PathBuf::from("/c/huggingface/hub")));
        assert_eq!(dir(3), Some(PathBuf::from("/d/.cache/huggingface/hub")));
        assert_eq!(dir(4), None);
        assert_eq!(
            vars(&[("HF_HOME", "~/hf"), ("HOME", "/d")]).cache_dir(),
            Some(PathBuf::from("/d/hf/hub"))
        );
        assert_eq!(
            vars(&[("HF_HUB_CACHE", ""), ("HOME", "/d")]).cache_dir(),
            Some(PathBuf::from("/d/.cache/huggingface/hub"))
        );

        let env = vars(&[]);
        assert_eq!(env.endpoint, DEFAULT_ENDPOINT);
        assert!(!env.offline);
        assert_eq!(env.token, None);
        for on in ["1", "on", "Yes", "TRUE"] {
            assert!(vars(&[("HF_HUB_OFFLINE", on)]).offline, "{on}");
        }
        for off in ["0", "no", "false", ""] {
            assert!(!vars(&[("HF_HUB_OFFLINE", off)]).offline, "{off}");
        }
        let env = vars(&[
            ("HF_ENDPOINT", "http://mirror.local/"),
            ("HUGGING_FACE_HUB_TOKEN", "old"),
        ]);
        assert_eq!(env.endpoint, "http://mirror.local");
        assert_eq!(env.token.as_deref(), Some("old"));
        let env = vars(&[("HF_TOKEN", "new"), ("HUGGING_FACE_HUB_TOKEN", "old")]);
        assert_eq!(env.token.as_deref(), Some("new"));

        let home = TempDir::new("token");
        std::fs::write(home.0.join("token"), "hf_file\n").unwrap();
        let env = vars(&[("HF_HOME", home.0.to_str().unwrap())]);
        assert_eq!(env.token.as_deref(), Some("hf_file"));
    }

    #[test]
    fn resolves_by_ref_and_by_commit() {
        let tmp = TempDir::new("resolve");
        let env = env_with_cache(&tmp.0, true);
        let files = ["config.json", "model.safetensors", "tokenizer.json"];
        put_snapshot(&tmp.0, "org/model", Some("main"), SHA, &files);
        put_snapshot(&tmp.0, "org/model", Some("refs/pr/1"), SHA2, &files);
        let snapshots = tmp.0.join("models--org--model").join("snapshots");

        let got = resolve_with(Path::new("org/model"), HubFiles::Model, &env).unwrap();
        assert_eq!(got, snapshots.join(SHA));
        let got = resolve_with(Path::new("org/model@refs/pr/1"), HubFiles::Model, &env).unwrap();
        assert_eq!(got, snapshots.join(SHA2));
        let by_commit = format!("org/model@{SHA2}");
        let got = resolve_with(Path::new(&by_commit), HubFiles::Model, &env).unwrap();
        assert_eq!(got, snapshots.join(SHA2));
        let got = resolve_with(Path::new("org/model"), HubFiles::Tokenizer, &env).unwrap();
        assert_eq!(got, snapshots.join(SHA).join("tokenizer.json"));
        assert_eq!(std::fs::read_to_string(got).unwrap(), "tokenizer.json\n");
    }

    #[test]
    fn local_paths_and_non_ids_come_back_unchanged() {
        let tmp = TempDir::new("local");
        let env = env_with_cache(&tmp.0, true);
        // `cargo test` runs in the crate's folder, where `src/lib.rs` reads
        // as an id and exists: the local file wins over the cached repo.
        put_snapshot(&tmp.0, "src/lib.rs", Some("main"), SHA, &["config.json"]);
        let local = Path::new("src/lib.rs");
        assert!(local.exists());
        assert_eq!(resolve_with(local, HubFiles::Model, &env).unwrap(), local);
        let cached = resolve_with(Path::new("src/lib.rs@main"), HubFiles::Model, &env).unwrap();
        assert_eq!(
            cached,
            tmp.0.join("models--src--lib.rs/snapshots").join(SHA)
        );
        for spec in ["/no/such/file", "./x/y", "no-slash", "a/b/c", "../x"] {
            let got = resolve_with(Path::new(spec), HubFiles::Model, &env).unwrap();
            assert_eq!(got, Path::new(spec));
        }
    }

    #[test]
    fn offline_errors_name_what_is_missing() {
        let tmp = TempDir::new("offline");
        let env = env_with_cache(&tmp.0, true);

        let err =
            resolve_with(Path::new("meta-llama/Llama-3.2-1B"), HubFiles::Model, &env).unwrap_err();
        let searched = tmp.0.join("models--meta-llama--Llama-3.2-1B");
        assert_eq!(
            err.to_string(),
            format!(
                "meta-llama/Llama-3.2-1B@main is not in the Hugging Face cache (searched {}) and HF_HUB_OFFLINE is set; download it first or unset HF_HUB_OFFLINE",
                searched.display()
            )
        );

        // A ref naming a snapshot that is gone.
        let repo_dir = tmp.0.join("models--org--gone");
        std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
        std::fs::write(repo_dir.join("refs/main"), format!("{SHA}\n")).unwrap();
        let err = resolve_with(Path::new("org/gone"), HubFiles::Model, &env).unwrap_err();
        assert!(matches!(err, HubError::MissingSnapshot { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains(SHA) && text.contains("org/gone@main"),
            "{text}"
        );
        assert!(!text.contains('\n'));

        // A snapshot without the required file; a commit never fetched.
        put_snapshot(&tmp.0, "org/tok", Some("main"), SHA, &["tokenizer.json"]);
        let err = resolve_with(Path::new("org/tok"), HubFiles::Adapter, &env).unwrap_err();
        assert!(matches!(err, HubError::IncompleteSnapshot { .. }), "{err}");
        assert!(err.to_string().contains("adapter_config.json"), "{err}");
        let other = format!("org/tok@{SHA2}");
        let err = resolve_with(Path::new(&other), HubFiles::Tokenizer, &env).unwrap_err();
        assert!(matches!(err, HubError::NotCached { .. }), "{err}");

        // A dangling link into blobs/ does not count.
        let blob = tmp
            .0
            .join("models--org--tok/blobs")
            .join(format!("{SHA}0000"));
        std::fs::remove_file(blob).unwrap();
        let err = resolve_with(Path::new("org/tok"), HubFiles::Tokenizer, &env).unwrap_err();
        assert!(matches!(err, HubError::IncompleteSnapshot { .. }), "{err}");

        // A ref holding no commit.
        std::fs::write(tmp.0.join("models--org--tok/refs/main"), "garbage").unwrap();
        let err = resolve_with(Path::new("org/tok"), HubFiles::Tokenizer, &env).unwrap_err();
        assert!(matches!(err, HubError::BadRef { .. }), "{err}");

        let err =
            resolve_with(Path::new("org/x"), HubFiles::Model, &HubEnv::default()).unwrap_err();
        assert!(matches!(err, HubError::NoCache { .. }), "{err}");
    }

    #[test]
    fn selects_files_per_use() {
        let names: Vec<String> = [
            "config.json",
            "generation_config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
            "consolidated.safetensors",
            INDEX,
            "pytorch_model.bin",
            "model.gguf",
            "original/params.json",
            "original/consolidated.00.pth",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
            "README.md",
        ]
        .map(String::from)
        .to_vec();
        let index = r#"{"metadata": {}, "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
            "c": "model-00002-of-00002.safetensors"}}"#;
        let got = select(HubFiles::Model, &names, Some(index)).unwrap();
        assert_eq!(
            got,
            [
                "generation_config.json",
                INDEX,
                "tokenizer.json",
                "tokenizer_config.json",
                "special_tokens_map.json",
                "chat_template.jinja",
                "model-00001-of-00002.safetensors",
                "model-00002-of-00002.safetensors",
                "config.json",
            ]
        );
        let got = select(HubFiles::Model, &names, None).unwrap();
        assert!(got.contains(&"consolidated.safetensors".to_owned()));
        assert_eq!(got.last().unwrap(), "config.json");
        let bad = r#"{"weight_map": {"a": "missing.safetensors"}}"#;
        assert!(matches!(
            select(HubFiles::Model, &names, Some(bad)),
            Err(Selection::Missing { .. })
        ));
        let bad = r#"{"weight_map": {"a": "../x.safetensors"}}"#;
        assert!(matches!(
            select(HubFiles::Model, &names, Some(bad)),
            Err(Selection::BadIndex(_))
        ));
        let bins = ["config.json", "pytorch_model.bin"]
            .map(String::from)
            .to_vec();
        assert!(matches!(
            select(HubFiles::Model, &bins, None),
            Err(Selection::Missing { .. })
        ));
        assert_eq!(
            select(HubFiles::Tokenizer, &names, None).unwrap(),
            [
                "tokenizer_config.json",
                "special_tokens_map.json",
                "tokenizer.json"
            ]
        );
        assert_eq!(
            select(HubFiles::ChatTemplate, &names, None).unwrap(),
            ["chat_template.jinja", "tokenizer_config.json"]
        );
        let adapter = [
            "adapter_config.json",
            "adapter_model.safetensors",
            "tokenizer.json",
            "training_args.bin",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            select(HubFiles::Adapter, &adapter, None).unwrap(),
            [
                "tokenizer.json",
                "adapter_model.safetensors",
                "adapter_config.json"
            ]
        );
    }

    #[test]
    fn closed_port_is_one_line_error() {
        let port = {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let tmp = TempDir::new("closed");
        let env = HubEnv {
            endpoint: format!("http://127.0.0.1:{port}"),
            ..env_with_cache(&tmp.0, false)
        };
        let start = std::time::Instant::now();
        let err =
            resolve_with(Path::new("meta-llama/Llama-3.2-1B"), HubFiles::Model, &env).unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, HubError::Download { .. }), "{text}");
        let prefix =
            format!("cannot download meta-llama/Llama-3.2-1B@main from http://127.0.0.1:{port}: ");
        assert!(text.starts_with(&prefix), "{text}");
        assert!(!text.contains('\n'), "{text}");
        assert!(!text[prefix.len()..].starts_with("http"), "{text}");
        assert!(start.elapsed().as_secs() < 20, "{:?}", start.elapsed());
    }

    /// A loopback stand-in for the Hub: `org/model` at commit SHA, `org/gated`
    /// gated, every other repo missing. Records each file download.
    struct MockHub {
        endpoint: String,
        fetched: Arc<Mutex<Vec<String>>>,
    }

    fn mock_hub(files: Vec<(&'static str, Vec<u8>)>) -> MockHub {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let fetched = Arc::new(Mutex::new(Vec::new()));
        let log = fetched.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                answer(stream, &files, &log);
            }
        });
        MockHub { endpoint, fetched }
    }

    fn answer(mut stream: TcpStream, files: &[(&'static str, Vec<u8>)], log: &Mutex<Vec<String>>) {
        let mut request = Vec::new();
        let mut byte = [0u8; 1];
        while !request.ends_with(b"\r\n\r\n") {
            match stream.read(&mut byte) {
                Ok(1) => request.push(byte[0]),
                _ => return,
            }
        }
        let request = String::from_utf8_lossy(&request).to_string();
        let path = request.split(' ').nth(1).unwrap_or("").to_owned();
        let range_start = request
            .lines()
            .find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("range: bytes=")
                    .map(str::to_owned)
            })
            .and_then(|r| r.split('-').next()?.parse::<usize>().ok());
        let reply = |status: &str, headers: &[String], body: &[u8]| {
            let mut head = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
                body.len()
            );
            for h in headers {
                head.push_str(h);
                head.push_str("\r\n");
            }
            head.push_str("\r\n");
            let mut out = head.into_bytes();
            out.extend_from_slice(body);
            out
        };
        let out = if path.starts_with("/api/models/org/gated/") || path.starts_with("/org/gated/") {
            reply(
                "401 Unauthorized",
                &["X-Error-Code: GatedRepo".into()],
                b"gated",
            )
        } else if let Some(rev) = path.strip_prefix("/api/models/org/model/revision/") {
            if rev == "main" || rev == SHA || rev == "refs%2Fpr%2F1" {
                let siblings: Vec<_> = files
                    .iter()
                    .map(|(n, _)| serde_json::json!({ "rfilename": n }))
                    .collect();
                let body = serde_json::json!({ "sha": SHA, "siblings": siblings }).to_string();
                reply(
                    "200 OK",
                    &["Content-Type: application/json".into()],
                    body.as_bytes(),
                )
            } else {
                reply(
                    "404 Not Found",
                    &["X-Error-Code: RevisionNotFound".into()],
                    b"no",
                )
            }
        } else if let Some(name) = path.strip_prefix(&format!("/org/model/resolve/{SHA}/")) {
            match files.iter().position(|(n, _)| *n == name) {
                Some(i) => {
                    let data = &files[i].1;
                    let start = range_start.unwrap_or(0).min(data.len());
                    let end = if request.contains("bytes=0-0") {
                        1
                    } else {
                        data.len()
                    };
                    if end > 1 {
                        log.lock().unwrap().push(name.to_owned());
                    }
                    let headers = [
                        format!("ETag: \"{i:040x}\""),
                        format!("X-Repo-Commit: {SHA}"),
                        format!("Content-Range: bytes {start}-{}/{}", end - 1, data.len()),
                    ];
                    reply("206 Partial Content", &headers, &data[start..end])
                }
                None => reply(
                    "404 Not Found",
                    &["X-Error-Code: EntryNotFound".into()],
                    b"no",
                ),
            }
        } else {
            reply(
                "404 Not Found",
                &["X-Error-Code: RepoNotFound".into()],
                b"no",
            )
        };
        let _ = stream.write_all(&out);
    }

    #[test]
    fn downloads_into_huggingface_hub_layout() {
        let files = vec![
            ("config.json", b"{\"model_type\": \"llama\"}".to_vec()),
            ("model.safetensors", vec![7u8; 1000]),
            ("tokenizer.json", b"{}".to_vec()),
            ("pytorch_model.bin", vec![1u8; 10]),
            ("original/consolidated.00.pth", vec![2u8; 10]),
            ("README.md", b"# model".to_vec()),
        ];
        let hub = mock_hub(files);
        let tmp = TempDir::new("download");
        let env = HubEnv {
            endpoint: hub.endpoint.clone(),
            ..env_with_cache(&tmp.0, false)
        };
        let repo_dir = tmp.0.join("models--org--model");

        let got = resolve_with(Path::new("org/model"), HubFiles::Model, &env).unwrap();
        check_first_download(&hub, &got, &repo_dir);
        check_cached_snapshot_is_reused(&hub, &got, &env);
        check_other_revision_of_same_commit(&hub, &got, &env, &repo_dir);
        check_by_commit_writes_no_ref(&env);
        check_download_errors(&hub, &env);
    }

    /// The first download fetches only the model's files, small ones first,
    /// into a snapshot whose files link into blobs/ as huggingface_hub's do,
    /// and records the branch's commit under refs/.
    fn check_first_download(hub: &MockHub, got: &Path, repo_dir: &Path) {
        assert_eq!(got, repo_dir.join("snapshots").join(SHA));
        assert_eq!(
            *hub.fetched.lock().unwrap(),
            ["tokenizer.json", "model.safetensors", "config.json"]
        );
        assert_eq!(
            std::fs::read(got.join("model.safetensors")).unwrap(),
            vec![7u8; 1000]
        );
        // Relative links into blobs/ named by the etag, as huggingface_hub.
        let link = std::fs::read_link(got.join("config.json")).unwrap();
        assert_eq!(link, Path::new("../../blobs").join(format!("{:040x}", 0)));
        assert_eq!(
            std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(),
            SHA
        );
        assert!(!repo_dir.join("refs").join(SHA).exists());
        assert!(!got.join("pytorch_model.bin").exists());
        assert!(!got.join("original").exists());
        assert!(!got.join("README.md").exists());
    }

    /// Cached now: offline works, and online asks nothing more.
    fn check_cached_snapshot_is_reused(hub: &MockHub, got: &Path, env: &HubEnv) {
        let offline = HubEnv {
            offline: true,
            ..env.clone()
        };
        assert_eq!(
            resolve_with(Path::new("org/model"), HubFiles::Model, &offline).unwrap(),
            got
        );
        assert_eq!(
            resolve_with(Path::new("org/model"), HubFiles::Model, env).unwrap(),
            got
        );
        assert_eq!(hub.fetched.lock().unwrap().len(), 3);
    }

    /// Another revision of the same commit downloads nothing again, but
    /// gets a ref of its own.
    fn check_other_revision_of_same_commit(
        hub: &MockHub,
        got: &Path,
        env: &HubEnv,
        repo_dir: &Path,
    ) {
        let pr = resolve_with(Path::new("org/model@refs/pr/1"), HubFiles::Model, env).unwrap();
        assert_eq!(pr, got);
        assert_eq!(hub.fetched.lock().unwrap().len(), 3);
        assert_eq!(
            std::fs::read_to_string(repo_dir.join("refs/refs/pr/1")).unwrap(),
            SHA
        );
    }

    /// By commit, into a fresh cache: the snapshot is made, no ref is written.
    fn check_by_commit_writes_no_ref(env: &HubEnv) {
        let tmp2 = TempDir::new("download-commit");
        let env2 = HubEnv {
            hub_cache: Some(tmp2.0.clone()),
            ..env.clone()
        };
        let by_commit = format!("org/model@{SHA}");
        let got = resolve_with(Path::new(&by_commit), HubFiles::Tokenizer, &env2).unwrap();
        assert_eq!(
            got,
            tmp2.0
                .join("models--org--model/snapshots")
                .join(SHA)
                .join("tokenizer.json")
        );
        assert!(!tmp2.0.join("models--org--model/refs").exists());
    }

    /// Wrong use of a repo, unknown revision, unknown repo, gated repo: each
    /// one line that names what is wrong.
    fn check_download_errors(hub: &MockHub, env: &HubEnv) {
        let err = resolve_with(Path::new("org/model"), HubFiles::Adapter, env).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "org/model@main on {} has no adapter_config.json: it is not a PEFT adapter repo",
                hub.endpoint
            )
        );
        let err = resolve_with(Path::new("org/model@v9"), HubFiles::Model, env).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "cannot download org/model@v9 from {}: HTTP 404: org/model has no revision `v9`",
                hub.endpoint
            )
        );
        let err = resolve_with(Path::new("org/none"), HubFiles::Model, env).unwrap_err();
        assert!(
            err.to_string()
                .ends_with("HTTP 404: org/none or its revision `main` does not exist"),
            "{err}"
        );
        let err = resolve_with(Path::new("org/gated"), HubFiles::Model, env).unwrap_err();
        assert!(
            err.to_string().contains("is gated") && err.to_string().contains("HF_TOKEN"),
            "{err}"
        );
    }
}
