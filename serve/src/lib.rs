//! `hlo-serve`: an OpenAI-compatible HTTP server (tokio + axum) over the
//! engine's continuous [`Batcher`](hlo_engine::infer::batcher::Batcher), serving one base
//! model and many LoRA adapters in one batch.
//!
//! It owns the HTTP side: routes (`/v1/models`, `/v1/completions`,
//! `/v1/chat/completions`, vLLM's `/v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, `/health`, `/metrics`), reading requests
//! strictly ([`api`]), OpenAI error objects, prompts encoded with the
//! tokenizer's special tokens, text that follows the prompt's text and is
//! streamed only as whole characters ([`text`]), stop strings, server-sent
//! events, Prometheus metrics ([`metrics`]), the API key and a graceful
//! stop on SIGTERM. It does not batch, schedule or run programs (the
//! engine does) and parses no command line (the `hlo-train` CLI does).

pub mod api;
pub mod error;
pub mod metrics;
pub mod text;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use hlo_engine::data::{ChatTemplate, Prompt, Tokenizer};
use hlo_engine::infer::batcher::fresh_seed;
use hlo_engine::infer::batcher::{
    BatcherHandle, Event, FinishReason, GenerationRequest, SubmitError,
};
use hlo_engine::infer::generator::Sampling;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use crate::api::{AdapterRequest, ChatRequest, Common, CompletionRequest, PromptInput};
pub use crate::error::{ApiError, ServeError};
use crate::metrics::Metrics;
use crate::text::TextStream;

/// What the server needs besides the batcher.
pub struct ServerConfig {
    /// The name clients use for the base model.
    pub model_name: String,
    /// Requests to `/v1/...` must carry `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// The model's end-of-sequence tokens.
    pub eos_ids: Vec<u32>,
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    /// How long a stream may send nothing before a keep-alive comment
    /// (`:`) goes out, so that proxies and clients with idle timeouts keep
    /// it open through a wait for a slot or a long prefill
    /// ([`DEFAULT_SSE_KEEP_ALIVE`] in service).
    pub sse_keep_alive: Duration,
}

/// Keep-alive interval of streams when none is chosen: shorter than the
/// idle timeouts of common proxies (nginx and most load balancers: 60 s).
pub const DEFAULT_SSE_KEEP_ALIVE: Duration = Duration::from_secs(15);

struct AppState {
    batcher: BatcherHandle,
    config: ServerConfig,
    tokenizer: Option<Arc<Tokenizer>>,
    metrics: Metrics,
    requests: AtomicU64,
    started: u64,
}

type Shared = Arc<AppState>;

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The router of every endpoint, over `batcher`.
pub fn router(batcher: BatcherHandle, mut config: ServerConfig) -> Router {
    let tokenizer = config.tokenizer.take().map(Arc::new);
    let state = Arc::new(AppState {
        batcher,
        config,
        tokenizer,
        metrics: Metrics::default(),
        requests: AtomicU64::new(0),
        started: now(),
    });
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/load_lora_adapter", post(load_adapter))
        .route("/v1/unload_lora_adapter", post(unload_adapter))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such endpoint", None) })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "this endpoint does not take that method",
                None,
            )
        })
        .with_state(state)
}

/// How long a server whose batcher failed keeps answering (`/health` 503,
/// requests 503) before it exits, so that probes see why.
const FAILED_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// Serves on `addr` until SIGTERM or Ctrl-C, then stops taking
/// connections, lets in-flight requests finish, stops the batcher and
/// returns. `ready` is called with the address bound (port 0 picks one).
/// If the batcher fails, the server answers 503 for [`FAILED_GRACE`],
/// then stops and returns [`ServeError::BatcherFailed`]: a server that
/// cannot generate must not look alive.
pub fn run(
    batcher: BatcherHandle,
    config: ServerConfig,
    addr: SocketAddr,
    ready: impl FnOnce(SocketAddr),
) -> Result<(), ServeError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let app = router(batcher.clone(), config);
    let watched = batcher.clone();
    let result: Result<(), ServeError> = runtime.block_on(async move {
        let listener =
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|cause| ServeError::Bind {
                    addr: addr.to_string(),
                    cause,
                })?;
        ready(listener.local_addr()?);
        let failed = async move {
            while watched.failure().is_none() {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            tokio::time::sleep(FAILED_GRACE).await;
        };
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                tokio::select! {
                    _ = stop_signal() => {},
                    _ = failed => {},
                }
            })
            .await?;
        Ok(())
    });
    batcher.shutdown();
    result?;
    match batcher.failure() {
        Some(why) => Err(ServeError::BatcherFailed(why)),
        None => Ok(()),
    }
}

async fn stop_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

impl AppState {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.config.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if given == Some(key.as_str()) {
            Ok(())
        } else {
            Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or wrong API key (Authorization: Bearer <key>)",
                None,
            ))
        }
    }

    /// A body declared as anything but JSON is refused (415) rather than
    /// read as JSON regardless; one with no `Content-Type` is read as JSON,
    /// as FastAPI (vLLM) reads it.
    fn json_body(headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(value) = headers.get(header::CONTENT_TYPE) else {
            return Ok(());
        };
        let given = String::from_utf8_lossy(value.as_bytes());
        let mime = given
            .split(';')
            .next()
            .unwrap_or_default()
            .trim()
            .to_ascii_lowercase();
        let json = mime == "application/json"
            || (mime.starts_with("application/") && mime.ends_with("+json"));
        if json {
            Ok(())
        } else {
            Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!("the body must be JSON (Content-Type: application/json), got `{given}`"),
                None,
            ))
        }
    }

    /// The adapter `model` names: None for the base model.
    fn adapter(&self, model: Option<&str>) -> Result<Option<String>, ApiError> {
        match model {
            None => Ok(None),
            Some(m) if m == self.config.model_name => Ok(None),
            Some(m) if self.batcher.adapters().iter().any(|a| a == m) => Ok(Some(m.to_string())),
            Some(m) => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("the model `{m}` does not exist"),
                Some("model"),
            )),
        }
    }

    fn tokenizer(&self) -> Result<&Tokenizer, ApiError> {
        self.tokenizer.as_deref().ok_or_else(|| {
            ApiError::bad(
                "this model has no tokenizer: send the prompt as token ids",
                Some("prompt"),
            )
        })
    }
}

/// 200 while the batcher runs; 503 with the reason once it has failed.
async fn health(State(s): State<Shared>) -> Response {
    match s.batcher.failure() {
        None => StatusCode::OK.into_response(),
        Some(why) => ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            format!("the batcher failed: {why}"),
            None,
        )
        .into_response(),
    }
}

async fn metrics(State(s): State<Shared>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(s.batcher.stats()),
    )
        .into_response()
}

async fn models(State(s): State<Shared>, headers: HeaderMap) -> Response {
    if let Err(e) = s.authorize(&headers) {
        return e.into_response();
    }
    let base = &s.config.model_name;
    let mut data = vec![json!({
        "id": base, "object": "model", "created": s.started, "owned_by": "hlo-train",
        "root": base, "parent": null,
        "max_model_len": s.batcher.options().max_model_len,
    })];
    // As vLLM: an adapter's root is its folder, its parent the base it
    // is served on; and the base it declares it was trained for.
    for a in s.batcher.adapter_infos() {
        data.push(json!({
            "id": a.name, "object": "model", "created": s.started, "owned_by": "hlo-train",
            "root": a.path.display().to_string(), "parent": base,
            "base_model_name_or_path": a.declared_base,
        }));
    }
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn load_adapter(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        s.authorize(&headers)?;
        AppState::json_body(&headers)?;
        let r: AdapterRequest = serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad(format!("invalid request: {e}"), None))?;
        if r.load_inplace == Some(true) {
            return Err(ApiError::bad(
                "`load_inplace` is not supported: unload the adapter, then load it",
                Some("load_inplace"),
            ));
        }
        let path = r
            .lora_path
            .ok_or_else(|| ApiError::bad("lora_path is required", Some("lora_path")))?;
        if r.lora_name.is_empty() || r.lora_name == s.config.model_name {
            return Err(ApiError::bad(
                format!("`{}` cannot name an adapter", r.lora_name),
                Some("lora_name"),
            ));
        }
        let batcher = s.batcher.clone();
        let name = r.lora_name.clone();
        let declared = tokio::task::spawn_blocking(move || {
            batcher.load_adapter(&name, std::path::Path::new(&path))
        })
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string(), None))?
        .map_err(|e| ApiError::bad(e.to_string(), Some("lora_path")))?;
        eprintln!(
            "loaded adapter {} (declared base: {})",
            r.lora_name,
            declared.as_deref().unwrap_or("none")
        );
        Ok(format!(
            "Success: LoRA adapter '{}' added successfully.",
            r.lora_name
        ))
    }
    .await;
    respond_text(&s, "", result)
}

async fn unload_adapter(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let result = async {
        s.authorize(&headers)?;
        AppState::json_body(&headers)?;
        let r: AdapterRequest = serde_json::from_slice(&body)
            .map_err(|e| ApiError::bad(format!("invalid request: {e}"), None))?;
        if s.batcher.unload_adapter(&r.lora_name) {
            Ok(format!(
                "Success: LoRA adapter '{}' removed successfully.",
                r.lora_name
            ))
        } else {
            Err(ApiError::new(
                StatusCode::NOT_FOUND,
                format!("the adapter `{}` is not loaded", r.lora_name),
                Some("lora_name"),
            ))
        }
    }
    .await;
    respond_text(&s, "", result)
}

fn respond_text(s: &AppState, model: &str, result: Result<String, ApiError>) -> Response {
    match result {
        Ok(text) => {
            s.metrics.request(model, 200);
            text.into_response()
        }
        Err(e) => {
            s.metrics.request(model, e.status.as_u16());
            e.into_response()
        }
    }
}

/// One prompt's completion in progress.
struct Job {
    rx: UnboundedReceiver<Event>,
    text: TextStream,
    prompt_tokens: usize,
    finish: Option<&'static str>,
    /// When the request arrived (time to first token counts from here).
    arrived: Instant,
}

/// What a request asks for, checked, with its prompts encoded.
struct Plan {
    model: String,
    adapter: Option<String>,
    prompts: Vec<Vec<u32>>,
    common: Common,
    max_tokens: Option<i64>,
    /// The field `max_tokens` came from, for errors.
    max_tokens_field: &'static str,
    chat: bool,
    arrived: Instant,
}

impl AppState {
    /// The plan of a checked request, prompts to come: its `model` names
    /// the base model (also when absent) or an adapter.
    fn plan(&self, common: Common, chat: bool, arrived: Instant) -> Result<Plan, ApiError> {
        Ok(Plan {
            adapter: self.adapter(common.model.as_deref())?,
            model: common
                .model
                .clone()
                .unwrap_or(self.config.model_name.clone()),
            prompts: Vec::new(),
            max_tokens: common.max_tokens,
            max_tokens_field: "max_tokens",
            common,
            chat,
            arrived,
        })
    }

    /// Submits every prompt of `plan`; the first refusal is the answer.
    fn submit(&self, plan: &Plan) -> Result<Vec<Job>, ApiError> {
        let c = &plan.common;
        let max_len = self.batcher.options().max_model_len;
        let sampling = sampling_of(c);
        let stop_ids = if c.ignore_eos {
            Vec::new()
        } else {
            self.config.eos_ids.clone()
        };
        self.check_queue_holds(plan)?;
        let mut jobs = Vec::new();
        for prompt in &plan.prompts {
            let max_tokens = max_tokens_for(plan, prompt.len(), max_len)?;
            let rx = self
                .batcher
                .submit(GenerationRequest {
                    prompt: prompt.clone(),
                    adapter: plan.adapter.clone(),
                    max_tokens,
                    sampling: sampling.clone(),
                    stop_ids: stop_ids.clone(),
                })
                .map_err(|e| submit_error(e, plan.max_tokens_field))?;
            jobs.push(Job {
                rx,
                text: TextStream::new(self.tokenizer.clone(), prompt, c.stops()),
                prompt_tokens: prompt.len(),
                finish: None,
                arrived: plan.arrived,
            });
        }
        Ok(jobs)
    }

    /// More prompts than the queue holds can never be accepted, however
    /// long the client waits: the request's fault, not the load's, so it
    /// is refused before any prompt is submitted.
    fn check_queue_holds(&self, plan: &Plan) -> Result<(), ApiError> {
        let max_queue = self.batcher.options().max_queue;
        if plan.prompts.len() > max_queue {
            return Err(ApiError::bad(
                format!(
                    "the request has {} prompts and the queue holds at most {max_queue} (--max-queue); send at most {max_queue} a request",
                    plan.prompts.len()
                ),
                Some(prompt_field(plan)),
            ));
        }
        Ok(())
    }
}

/// The sampling settings a request asks for, with OpenAI's temperature
/// default (1.0) and a fresh seed when it names none.
fn sampling_of(c: &Common) -> Sampling {
    Sampling {
        temperature: Some(c.temperature.unwrap_or(1.0)),
        top_k: c.top_k(),
        top_p: c.top_p,
        seed: c.seed().unwrap_or_else(fresh_seed),
    }
}

/// The request field that holds the prompts, for errors about them.
fn prompt_field(plan: &Plan) -> &'static str {
    if plan.chat {
        "messages"
    } else {
        "prompt"
    }
}

/// How many tokens a prompt of `len` tokens may generate under a context
/// of `max_len`: the request's own limit, or OpenAI's default, refused when
/// the prompt leaves no room or the limit asks for more than is left.
fn max_tokens_for(plan: &Plan, len: usize, max_len: i64) -> Result<usize, ApiError> {
    let field_name = plan.max_tokens_field;
    let room = usize::try_from(max_len)
        .unwrap_or(usize::MAX)
        .saturating_sub(len);
    if room == 0 {
        return Err(ApiError::bad(
            format!(
                "this model's maximum context length is {max_len} tokens, and the prompt has {len}: no room is left to generate"
            ),
            Some(prompt_field(plan)),
        ));
    }
    // OpenAI's defaults: 16 tokens for a completion, the rest of
    // the context for a chat reply. Checked >= 1 already.
    let max_tokens = match plan.max_tokens {
        Some(m) => usize::try_from(m).unwrap_or(usize::MAX),
        None if plan.chat => room,
        None => 16.min(room),
    };
    if max_tokens > room {
        return Err(ApiError::bad(
            format!(
                "this model's maximum context length is {max_len} tokens; the prompt has {len}, so {field_name} can be at most {room}, got {max_tokens}"
            ),
            Some(field_name),
        ));
    }
    Ok(max_tokens)
}

/// The HTTP answer to a batcher's refusal: a full queue is the load's
/// fault (429), a stopping or failed engine is unavailable (503), and an
/// invalid `max_tokens` is reported under the field it came from.
fn submit_error(e: SubmitError, field_name: &'static str) -> ApiError {
    match e {
        SubmitError::QueueFull(_) => {
            ApiError::new(StatusCode::TOO_MANY_REQUESTS, e.to_string(), None)
        }
        SubmitError::ShuttingDown | SubmitError::Failed(_) => {
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string(), None)
        }
        SubmitError::UnknownAdapter(_) => {
            ApiError::new(StatusCode::NOT_FOUND, e.to_string(), Some("model"))
        }
        SubmitError::Invalid(field, m) => ApiError::bad(
            m,
            Some(if field == "max_tokens" {
                field_name
            } else {
                field
            }),
        ),
    }
}

impl AppState {
    /// Runs `job` to its end, handing `emit` each token with the text it
    /// releases (often nothing: held back), then the rest of the text with
    /// no token (false from `emit`: the client is gone, stop). Records
    /// latencies.
    async fn drive(
        &self,
        job: &mut Job,
        mut emit: impl FnMut(&str, Option<u32>) -> bool,
    ) -> Result<(), String> {
        let mut last: Option<Instant> = None;
        loop {
            match job.rx.recv().await {
                Some(Event::Token { id: t, at }) => {
                    match last {
                        None => self
                            .metrics
                            .time_to_first_token(at.duration_since(job.arrived).as_secs_f64()),
                        Some(l) => self
                            .metrics
                            .inter_token_latency(at.duration_since(l).as_secs_f64()),
                    }
                    last = Some(at);
                    let piece = job.text.push(t);
                    if !emit(&piece, Some(t)) {
                        return Err("the client went away".into());
                    }
                    if job.text.stopped() {
                        // Dropping the channel frees the slot.
                        job.rx.close();
                        job.finish = Some("stop");
                        return Ok(());
                    }
                }
                Some(Event::Finished(reason)) => {
                    let piece = job.text.finish();
                    emit(&piece, None);
                    job.finish = Some(match reason {
                        FinishReason::Stop => "stop",
                        FinishReason::Length => "length",
                    });
                    return Ok(());
                }
                Some(Event::Failed(m)) => return Err(m),
                None => return Err("the batcher stopped".into()),
            }
        }
    }
}

async fn completions(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let arrived = Instant::now();
    let plan = (|| {
        s.authorize(&headers)?;
        AppState::json_body(&headers)?;
        let r: CompletionRequest = api::parse(&body, &api::COMPLETION_KEYS)?;
        r.check()?;
        let mut plan = s.plan(r.common, false, arrived)?;
        let text = |t: &String| -> Result<Vec<u32>, ApiError> {
            Prompt::Text(t.clone())
                .encode(Some(s.tokenizer()?), None)
                .map_err(|e| ApiError::bad(e.to_string(), Some("prompt")))
        };
        plan.prompts = match &r.prompt {
            PromptInput::Text(t) => vec![text(t)?],
            PromptInput::Texts(ts) => ts.iter().map(text).collect::<Result<_, _>>()?,
            PromptInput::Ids(ids) => vec![ids.clone()],
            PromptInput::IdLists(l) => l.clone(),
        };
        if plan.prompts.is_empty() || plan.prompts.iter().any(Vec::is_empty) {
            return Err(ApiError::bad("the prompt is empty", Some("prompt")));
        }
        Ok(plan)
    })();
    answer(s, plan).await
}

async fn chat_completions(State(s): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let arrived = Instant::now();
    let plan = (|| {
        s.authorize(&headers)?;
        AppState::json_body(&headers)?;
        let r: ChatRequest = api::parse(&body, &api::CHAT_KEYS)?;
        r.check()?;
        let mut plan = s.plan(r.common, true, arrived)?;
        if r.max_completion_tokens.is_some() {
            plan.max_tokens = r.max_completion_tokens;
            plan.max_tokens_field = "max_completion_tokens";
        }
        let template = s.config.chat_template.as_ref().ok_or_else(|| {
            ApiError::bad(
                "this model has no chat template (tokenizer_config.json's chat_template; --chat-template DIR)",
                Some("messages"),
            )
        })?;
        let messages = r
            .messages
            .iter()
            .map(api::ChatMessage::message)
            .collect::<Result<Vec<_>, _>>()?;
        // A rendered template carries its own BOS.
        let ids = Prompt::Messages(messages)
            .encode(Some(s.tokenizer()?), Some(template))
            .map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?;
        if ids.is_empty() {
            return Err(ApiError::bad(
                "the conversation renders to nothing",
                Some("messages"),
            ));
        }
        plan.prompts = vec![ids];
        Ok(plan)
    })();
    answer(s, plan).await
}

/// Runs a checked request and answers it, whole or streamed.
async fn answer(s: Shared, plan: Result<Plan, ApiError>) -> Response {
    let plan = match plan {
        Ok(p) => p,
        Err(e) => {
            s.metrics.request("", e.status.as_u16());
            return e.into_response();
        }
    };
    let jobs = match s.submit(&plan) {
        Ok(j) => j,
        Err(e) => {
            s.metrics.request(&plan.model, e.status.as_u16());
            return e.into_response();
        }
    };
    let n = s.requests.fetch_add(1, Ordering::Relaxed);
    let id = format!("{}-{n}", if plan.chat { "chatcmpl" } else { "cmpl" });
    if plan.common.stream {
        return stream(s, plan, jobs, id);
    }
    let mut jobs = jobs;
    let mut choices = Vec::new();
    for (index, job) in jobs.iter_mut().enumerate() {
        let mut text = String::new();
        if let Err(m) = s
            .drive(job, |piece, _| {
                text.push_str(piece);
                true
            })
            .await
        {
            let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, m, None);
            s.metrics.request(&plan.model, 500);
            return e.into_response();
        }
        let mut choice = if plan.chat {
            json!({"index": index, "message": {"role": "assistant", "content": text},
                   "logprobs": null, "finish_reason": job.finish})
        } else {
            json!({"index": index, "text": text, "logprobs": null, "finish_reason": job.finish})
        };
        if plan.common.return_token_ids {
            choice["token_ids"] = json!(job.text.tokens());
        }
        choices.push(choice);
    }
    let usage = usage(&s, &plan, &jobs);
    s.metrics.request(&plan.model, 200);
    Json(json!({
        "id": id,
        "object": if plan.chat { "chat.completion" } else { "text_completion" },
        "created": now(),
        "model": plan.model,
        "choices": choices,
        "usage": usage,
    }))
    .into_response()
}

/// Token counts (and the metrics' token counters).
fn usage(s: &AppState, plan: &Plan, jobs: &[Job]) -> Value {
    let prompt: usize = jobs.iter().map(|j| j.prompt_tokens).sum();
    let completion: usize = jobs.iter().map(|j| j.text.tokens().len()).sum();
    s.metrics.tokens(&plan.model, prompt, completion);
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion})
}

/// Server-sent events through axum's [`Sse`]: a chunk per piece of text,
/// a last chunk per choice with its finish reason, usage if asked, then
/// `data: [DONE]`; between them a keep-alive comment whenever nothing was
/// sent for `sse_keep_alive`. A task generates into a channel whose other
/// end the response body holds: a client that goes away drops the body,
/// the task sees its channel closed and ends, and dropping its jobs'
/// receivers cancels them in the batcher.
fn stream(s: Shared, plan: Plan, mut jobs: Vec<Job>, id: String) -> Response {
    let (tx, rx) = unbounded_channel::<SseEvent>();
    let keep_alive = KeepAlive::new().interval(s.config.sse_keep_alive);
    let created = now();
    let object = if plan.chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let send = |tx: &UnboundedSender<SseEvent>, v: Value| -> bool {
        tx.send(SseEvent::default().data(v.to_string())).is_ok()
    };
    let model = plan.model.clone();
    let chunk = move |choices: Value| -> Value {
        json!({"id": id, "object": object, "created": created, "model": model, "choices": choices})
    };
    tokio::spawn(async move {
        s.metrics.request(&plan.model, 200);
        for (index, job) in jobs.iter_mut().enumerate() {
            // A chunk per piece of text; with `return_token_ids`, one per
            // token too, carrying it.
            let with_ids = plan.common.return_token_ids;
            let piece = |text: &str, token: Option<u32>| -> Option<Value> {
                if text.is_empty() && !(with_ids && token.is_some()) {
                    return None;
                }
                let mut c = if plan.chat {
                    json!({"index": index, "delta": {"content": text}, "logprobs": null, "finish_reason": null})
                } else {
                    json!({"index": index, "text": text, "logprobs": null, "finish_reason": null})
                };
                if let (true, Some(t)) = (with_ids, token) {
                    c["token_ids"] = json!([t]);
                }
                Some(json!([c]))
            };
            if plan.chat
                && !send(
                    &tx,
                    chunk(
                        json!([{"index": index, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": null, "finish_reason": null}]),
                    ),
                )
            {
                return;
            }
            let result = tokio::select! {
                r = s.drive(job, |text, token| match piece(text, token) {
                    Some(p) => send(&tx, chunk(p)),
                    None => true,
                }) => r,
                // A client gone while nothing is due (waiting for a slot,
                // a long prefill) is seen now, not at the next token.
                () = tx.closed() => return,
            };
            if let Err(m) = result {
                let e = ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, m, None);
                send(&tx, e.body());
                let _ = tx.send(SseEvent::default().data("[DONE]"));
                return;
            }
            let last = if plan.chat {
                json!({"index": index, "delta": {}, "logprobs": null, "finish_reason": job.finish})
            } else {
                json!({"index": index, "text": "", "logprobs": null, "finish_reason": job.finish})
            };
            if !send(&tx, chunk(json!([last]))) {
                return;
            }
        }
        let usage = usage(&s, &plan, &jobs);
        if plan
            .common
            .stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
        {
            let mut c = chunk(json!([]));
            c["usage"] = usage;
            send(&tx, c);
        }
        let _ = tx.send(SseEvent::default().data("[DONE]"));
    });
    let events = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|e| (Ok::<SseEvent, Infallible>(e), rx))
    });
    Sse::new(events).keep_alive(keep_alive).into_response()
}
