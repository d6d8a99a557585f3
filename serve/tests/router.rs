//! The public router in process (`tower::ServiceExt::oneshot`, no socket,
//! no binary), over a real batcher of the `tiny` preset on the CPU plugin:
//! the model list and adapters loaded at run time, `/health`, `/metrics`
//! counting what was served; greedy completions and chat completions,
//! whole and streamed, against the engine's one-request `Generator`;
//! keep-alive comments while a stream waits for a slot; a client that
//! leaves, queued or mid-stream, cancelling its request in the batcher;
//! and each bad request's status with an OpenAI error object.
//!
//! One batcher (its programs compiled once) and one reference generation
//! serve every test of the binary.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, Method, Request, StatusCode};
use axum::response::Response;
use axum::Router;
use futures_util::StreamExt;
use hlo_engine::data::{ChatTemplate, Message, Prompt, Tokenizer};
use hlo_engine::device::backend::{Backend, BackendOptions};
use hlo_engine::infer::batcher::Event as EngineEvent;
use hlo_engine::infer::batcher::{Batcher, BatcherHandle, BatcherOptions, GenerationRequest};
use hlo_engine::infer::generator::{Generator, Sampling};
use hlo_engine::inputs::model::{Model, ModelSource};
use hlo_engine::ir::DType;
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::decoder::LoraConfig;
use hlo_engine::runtime::Mode;
use hlo_serve::{router, ServerConfig, DEFAULT_SSE_KEEP_ALIVE};
use serde_json::{json, Value};
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::mpsc::UnboundedReceiver;
use tower::ServiceExt;

const MODEL: &str = "tiny";
const ADAPTER: &str = "lora-a";
/// Decode slots of the shared batcher (the keep-alive test holds them all).
const SLOTS: usize = 2;
/// The tiny preset's positions: room for the chat prompt (~200 byte
/// tokens) and for streams long enough to outlast a client's first read.
const MAX_LEN: i64 = 512;
const PROMPT: &str = "The capital of";
const USER: &str = "Name a colour.";
/// Tokens of the greedy completions compared with the generator.
const N: usize = 12;
/// No single wait of a test may take longer (the machine is shared).
const PATIENCE: Duration = Duration::from_secs(180);

fn model() -> Model {
    Model::open(&ModelSource::Preset(MODEL.into())).expect("the tiny preset")
}

fn chat_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat/llama_style")
}

fn template() -> ChatTemplate {
    ChatTemplate::from_dir(&chat_dir()).expect("the chat fixture")
}

struct Fixture {
    batcher: BatcherHandle,
    /// A PEFT folder of a fresh adapter: B is zero, so its tokens are the
    /// base model's.
    adapter_dir: PathBuf,
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let m = model();
        let lora = LoraConfig::new(4, 8.0, &["q_proj", "v_proj"], false).expect("lora config");
        let adapter_dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("router-adapter");
        let _ = std::fs::remove_dir_all(&adapter_dir);
        Adapter::init(&m.config, &lora, 3)
            .save(&adapter_dir, None)
            .expect("save the adapter");
        let options = BatcherOptions {
            max_batch_size: SLOTS,
            max_loras: 2,
            max_cpu_loras: 2,
            max_lora_rank: 8,
            max_model_len: MAX_LEN,
            max_queue: 64,
            select: None,
            dtype: DType::F32,
            // The smallest budget: three step programs to compile.
            max_num_batched_tokens: 16,
            background_compile: false,
            prefix_caching: true,
        };
        let batcher = Batcher::spawn(
            BackendOptions::cpu(),
            m,
            options,
            &[(ADAPTER.into(), adapter_dir.clone())],
            0,
        )
        .expect("start the batcher");
        Fixture {
            batcher,
            adapter_dir,
        }
    })
}

/// Greedy tokens of the engine's generator (its own programs, one batch)
/// for the completion prompt and the chat prompt, stopping at EOS as the
/// server does.
struct Reference {
    completion_prompt: Vec<u32>,
    completion: Vec<u32>,
    chat_prompt: Vec<u32>,
    chat: Vec<u32>,
}

fn reference() -> &'static Reference {
    static R: OnceLock<Reference> = OnceLock::new();
    R.get_or_init(|| {
        let tok = Tokenizer::bytes();
        let completion_prompt = Prompt::Text(PROMPT.into())
            .encode(Some(&tok), None)
            .expect("encode");
        let chat_prompt = Prompt::Messages(vec![Message::new("user", USER)])
            .encode(Some(&tok), Some(&template()))
            .expect("render");
        let m = model();
        let backend = Backend::open(&BackendOptions::cpu()).expect("the CPU plugin");
        let g = Generator::new(&backend, &m.config, DType::F32, None, Mode::Jit, |name| {
            m.weight(name, DType::F32, 0)
        })
        .expect("generator");
        let mut out = g
            .complete_batch(
                &[completion_prompt.clone(), chat_prompt.clone()],
                N,
                &Sampling::default(),
                &m.eos_ids(),
            )
            .expect("generate");
        let chat = out.pop().expect("two rows");
        let completion = out.pop().expect("two rows");
        Reference {
            completion_prompt,
            completion,
            chat_prompt,
            chat,
        }
    })
}

/// The text a client should see for `tokens` (a byte-level tokenizer and
/// an ASCII prompt: the completion's bytes decoded on their own).
fn text_of(tokens: &[u32]) -> String {
    Tokenizer::bytes().decode(tokens).expect("decode")
}

/// The finish reason of a generation of at most N tokens.
fn finish_of(tokens: &[u32]) -> &'static str {
    let eos = model().eos_ids();
    if tokens.last().is_some_and(|t| eos.contains(t)) {
        "stop"
    } else {
        assert_eq!(tokens.len(), N);
        "length"
    }
}

fn app_with(keep_alive: Duration, api_key: Option<&str>) -> Router {
    let f = fixture();
    router(
        f.batcher.clone(),
        ServerConfig {
            model_name: MODEL.into(),
            api_key: api_key.map(str::to_string),
            eos_ids: model().eos_ids(),
            tokenizer: Some(Tokenizer::bytes()),
            chat_template: Some(template()),
            sse_keep_alive: keep_alive,
        },
    )
}

fn app() -> Router {
    app_with(DEFAULT_SSE_KEEP_ALIVE, None)
}

fn post(path: &str, body: &Value) -> Request<Body> {
    Request::post(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_string()))
        .expect("request")
}

fn get(path: &str) -> Request<Body> {
    Request::get(path).body(Body::empty()).expect("request")
}

async fn send(app: &Router, request: Request<Body>) -> Response {
    let answer = app.clone().oneshot(request);
    match tokio::time::timeout(PATIENCE, answer).await {
        Ok(Ok(r)) => r,
        Ok(Err(never)) => match never {},
        Err(_) => panic!("no answer in {PATIENCE:?}"),
    }
}

async fn body_text(response: Response) -> String {
    let read = axum::body::to_bytes(response.into_body(), usize::MAX);
    let bytes = tokio::time::timeout(PATIENCE, read)
        .await
        .expect("the body in time")
        .expect("the body");
    String::from_utf8(bytes.to_vec()).expect("UTF-8 body")
}

/// Status, content type and JSON body.
async fn call(app: &Router, request: Request<Body>) -> (StatusCode, String, Value) {
    let r = send(app, request).await;
    let status = r.status();
    let kind = content_type(&r);
    let text = body_text(r).await;
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    (status, kind, v)
}

fn content_type(r: &Response) -> String {
    r.headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string()
}

/// An SSE body's events as they are on the wire: comments (`:`), or the
/// payload of exactly one `data: ` line.
#[derive(Debug, PartialEq)]
enum Sse {
    Comment,
    Data(String),
}

fn parse_sse(body: &str) -> Vec<Sse> {
    assert!(body.ends_with("\n\n"), "an unterminated event: {body:?}");
    body.trim_end_matches('\n')
        .split("\n\n")
        .map(|event| {
            if event.starts_with(':') && !event.contains('\n') {
                return Sse::Comment;
            }
            match event.strip_prefix("data: ") {
                Some(d) if !d.contains('\n') => Sse::Data(d.to_string()),
                _ => panic!("not a one-line data event: {event:?}"),
            }
        })
        .collect()
}

/// The JSON chunks of a stream that ends with `data: [DONE]` and nothing
/// after it.
fn json_chunks(events: &[Sse]) -> Vec<Value> {
    let data: Vec<&String> = events
        .iter()
        .filter_map(|e| match e {
            Sse::Data(d) => Some(d),
            Sse::Comment => None,
        })
        .collect();
    assert_eq!(
        data.last().map(|d| d.as_str()),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(
        matches!(events.last(), Some(Sse::Data(d)) if d == "[DONE]"),
        "{events:?}"
    );
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).expect("a JSON chunk"))
        .collect()
}

/// A streamed choice's text, its finish reason, and the usage chunk.
fn streamed(chunks: &[Value], chat: bool) -> (String, Option<String>, Option<Value>) {
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    for c in chunks {
        let choices = c["choices"].as_array().expect("choices");
        if choices.is_empty() {
            usage = Some(c["usage"].clone());
            continue;
        }
        let choice = &choices[0];
        let piece = if chat {
            &choice["delta"]["content"]
        } else {
            &choice["text"]
        };
        text.push_str(piece.as_str().unwrap_or_default());
        if let Some(f) = choice["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (text, finish, usage)
}

fn usage_of(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion})
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("token ids")
        .iter()
        .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()).expect("id"))
        .collect()
}

#[tokio::test]
async fn models_health_and_adapters_loaded_at_run_time() {
    let f = fixture();
    let app = app();
    let (status, _, _) = call(&app, get("/health")).await;
    assert_eq!(status, StatusCode::OK);

    let listed = |v: &Value| -> Vec<String> {
        v["data"]
            .as_array()
            .expect("data")
            .iter()
            .map(|m| m["id"].as_str().expect("id").to_string())
            .collect()
    };
    let (status, _, v) = call(&app, get("/v1/models")).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "list");
    assert_eq!(listed(&v), [MODEL, ADAPTER]);
    assert_eq!(v["data"][0]["max_model_len"], MAX_LEN);
    assert_eq!(v["data"][1]["parent"], MODEL);
    assert_eq!(
        v["data"][1]["root"],
        f.adapter_dir.display().to_string().as_str()
    );

    // Loaded at run time: listed, refused a second time, then unloaded.
    let load = json!({"lora_name": "lora-b", "lora_path": f.adapter_dir});
    let (status, _, v) = call(&app, post("/v1/load_lora_adapter", &load)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (_, _, v) = call(&app, get("/v1/models")).await;
    assert_eq!(listed(&v), [MODEL, ADAPTER, "lora-b"]);
    let (status, _, v) = call(&app, post("/v1/load_lora_adapter", &load)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "lora_path");
    let unload = json!({"lora_name": "lora-b"});
    let (status, _, v) = call(&app, post("/v1/unload_lora_adapter", &unload)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let (status, _, v) = call(&app, post("/v1/unload_lora_adapter", &unload)).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(v["error"]["type"], "not_found_error");
    let (_, _, v) = call(&app, get("/v1/models")).await;
    assert_eq!(listed(&v), [MODEL, ADAPTER]);

    // With an API key, /v1/ needs it; /health does not.
    let locked = app_with(DEFAULT_SSE_KEEP_ALIVE, Some("secret"));
    let (status, _, v) = call(&locked, get("/v1/models")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(v["error"]["type"], "authentication_error");
    let keyed = Request::get("/v1/models")
        .header(header::AUTHORIZATION, "Bearer secret")
        .body(Body::empty())
        .expect("request");
    assert_eq!(call(&locked, keyed).await.0, StatusCode::OK);
    assert_eq!(call(&locked, get("/health")).await.0, StatusCode::OK);
}

#[tokio::test]
async fn greedy_completions_whole_and_streamed_are_the_generators() {
    let r = reference();
    let app = app();

    // Completions, whole.
    let ask = json!({"model": MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                     "return_token_ids": true});
    let (status, _, v) = call(&app, post("/v1/completions", &ask)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], MODEL);
    let choice = &v["choices"][0];
    assert_eq!(ids(&choice["token_ids"]), r.completion);
    assert_eq!(choice["text"], text_of(&r.completion).as_str());
    assert_eq!(choice["finish_reason"], finish_of(&r.completion));
    let usage = usage_of(r.completion_prompt.len(), r.completion.len());
    assert_eq!(v["usage"], usage);

    // Completions, streamed: the same text, the usage chunk, then [DONE].
    let mut ask_stream = ask.clone();
    ask_stream["stream"] = json!(true);
    ask_stream["stream_options"] = json!({"include_usage": true});
    ask_stream["return_token_ids"] = json!(false);
    let response = send(&app, post("/v1/completions", &ask_stream)).await;
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(content_type(&response), "text/event-stream");
    let events = parse_sse(&body_text(response).await);
    let chunks = json_chunks(&events);
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    let (text, finish, streamed_usage) = streamed(&chunks, false);
    assert_eq!(text, text_of(&r.completion));
    assert_eq!(finish.as_deref(), Some(finish_of(&r.completion)));
    assert_eq!(streamed_usage, Some(usage.clone()));

    // Streamed with token ids: one chunk per token, in order.
    let mut ask_ids = ask_stream.clone();
    ask_ids["return_token_ids"] = json!(true);
    ask_ids["stream_options"] = json!({"include_usage": false});
    let response = send(&app, post("/v1/completions", &ask_ids)).await;
    let chunks = json_chunks(&parse_sse(&body_text(response).await));
    let streamed_ids: Vec<u32> = chunks
        .iter()
        .filter(|c| c["choices"][0].get("token_ids").is_some())
        .flat_map(|c| ids(&c["choices"][0]["token_ids"]))
        .collect();
    assert_eq!(streamed_ids, r.completion);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));

    // A fresh adapter (B = 0) answers as the base model.
    let mut on_adapter = ask.clone();
    on_adapter["model"] = json!(ADAPTER);
    let (status, _, v) = call(&app, post("/v1/completions", &on_adapter)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["model"], ADAPTER);
    assert_eq!(ids(&v["choices"][0]["token_ids"]), r.completion);

    // max_tokens is honoured past EOS with ignore_eos: the generator's
    // tokens up to its first EOS, then as many more as asked.
    let short = json!({"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                       "ignore_eos": true, "return_token_ids": true});
    let (status, _, v) = call(&app, post("/v1/completions", &short)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let got = ids(&v["choices"][0]["token_ids"]);
    assert_eq!(got.len(), 3);
    let same = r.completion.len().min(3);
    assert_eq!(got[..same], r.completion[..same]);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);

    // Chat, whole.
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": USER}],
                      "max_tokens": N, "temperature": 0, "return_token_ids": true});
    let (status, _, v) = call(&app, post("/v1/chat/completions", &chat)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    let choice = &v["choices"][0];
    assert_eq!(ids(&choice["token_ids"]), r.chat);
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], text_of(&r.chat).as_str());
    assert_eq!(choice["finish_reason"], finish_of(&r.chat));
    let chat_usage = usage_of(r.chat_prompt.len(), r.chat.len());
    assert_eq!(v["usage"], chat_usage);

    // Chat, streamed: the role first, then the same text.
    let mut chat_stream = chat.clone();
    chat_stream["stream"] = json!(true);
    chat_stream["return_token_ids"] = json!(false);
    chat_stream["stream_options"] = json!({"include_usage": true});
    let response = send(&app, post("/v1/chat/completions", &chat_stream)).await;
    assert_eq!(response.status(), StatusCode::OK);
    let chunks = json_chunks(&parse_sse(&body_text(response).await));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    let (text, finish, streamed_usage) = streamed(&chunks, true);
    assert_eq!(text, text_of(&r.chat));
    assert_eq!(finish.as_deref(), Some(finish_of(&r.chat)));
    assert_eq!(streamed_usage, Some(chat_usage));
}

/// A metric's value in a `/metrics` text, None when absent.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(name)
            .and_then(|v| v.strip_prefix(' '))
            .and_then(|v| v.trim().parse().ok())
    })
}

async fn metrics(app: &Router) -> String {
    let r = send(app, get("/metrics")).await;
    assert_eq!(r.status(), StatusCode::OK);
    assert!(content_type(&r).starts_with("text/plain"));
    body_text(r).await
}

#[tokio::test]
async fn metrics_count_what_was_served() {
    let app = app();
    let served = "hlo_train_requests_total{model=\"tiny\",status=\"200\"}";
    let before = metrics(&app).await;
    assert_eq!(metric(&before, served), None);
    assert_eq!(
        metric(&before, "hlo_train_time_to_first_token_seconds_count"),
        Some(0.0)
    );
    let n = 4;
    // A charset parameter is still JSON.
    let request = Request::post("/v1/completions")
        .header(header::CONTENT_TYPE, "application/json; charset=utf-8")
        .body(Body::from(
            json!({"model": MODEL, "prompt": PROMPT, "max_tokens": n, "ignore_eos": true})
                .to_string(),
        ))
        .expect("request");
    let (status, _, v) = call(&app, request).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let prompt = v["usage"]["prompt_tokens"].as_f64().expect("usage");
    assert_eq!(v["usage"]["completion_tokens"], n);
    let after = metrics(&app).await;
    assert_eq!(metric(&after, served), Some(1.0));
    let tokens = |which: &str| {
        metric(
            &after,
            &format!("hlo_train_{which}_tokens_total{{model=\"tiny\"}}"),
        )
    };
    assert_eq!(tokens("prompt"), Some(prompt));
    assert_eq!(tokens("completion"), Some(n as f64));
    // One first token, and a gap before each of the others.
    assert_eq!(
        metric(&after, "hlo_train_time_to_first_token_seconds_count"),
        Some(1.0)
    );
    assert_eq!(
        metric(&after, "hlo_train_inter_token_latency_seconds_count"),
        Some((n - 1) as f64)
    );
}

/// A bad request: path, content type, body; the status, error type and
/// param it must get.
type Case<'a> = (&'a str, &'a str, String, u16, &'a str, Option<&'a str>);

#[tokio::test]
async fn bad_requests_get_their_status_and_an_openai_error() {
    let app = app();
    let long = "a".repeat(MAX_LEN as usize + 10);
    let prompt_len = Tokenizer::bytes()
        .encode(PROMPT, true)
        .expect("encode")
        .len();
    let room = MAX_LEN as usize - prompt_len;
    let chat = |extra: Value| {
        let mut v = json!({"messages": [{"role": "user", "content": USER}]});
        for (k, x) in extra.as_object().expect("object") {
            v[k] = x.clone();
        }
        v.to_string()
    };
    let c = "/v1/completions";
    let cc = "/v1/chat/completions";
    let json_type = "application/json";
    let cases: Vec<Case> = vec![
        (
            c,
            json_type,
            r#"{"prompt": "a", "max_tokens": "#.into(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            c,
            json_type,
            "[1, 2]".into(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            cc,
            json_type,
            "{".into(),
            400,
            "invalid_request_error",
            None,
        ),
        (
            c,
            json_type,
            json!({"model": "nope", "prompt": "a"}).to_string(),
            404,
            "not_found_error",
            Some("model"),
        ),
        // More prompts than the queue can ever hold (64): the request's
        // fault, not a load to retry.
        (
            c,
            json_type,
            json!({"prompt": vec!["a"; 65], "max_tokens": 1}).to_string(),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            cc,
            json_type,
            chat(json!({"model": "no-such-adapter"})),
            404,
            "not_found_error",
            Some("model"),
        ),
        (
            c,
            json_type,
            json!({"prompt": []}).to_string(),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            c,
            json_type,
            json!({"prompt": [[]]}).to_string(),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            cc,
            json_type,
            json!({"messages": []}).to_string(),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            c,
            json_type,
            json!({"prompt": "a", "max_tokens": 0}).to_string(),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            c,
            json_type,
            json!({"prompt": "a", "max_tokens": -3}).to_string(),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            cc,
            json_type,
            chat(json!({"max_completion_tokens": 0})),
            400,
            "invalid_request_error",
            Some("max_completion_tokens"),
        ),
        (
            c,
            json_type,
            json!({"prompt": long}).to_string(),
            400,
            "invalid_request_error",
            Some("prompt"),
        ),
        (
            c,
            json_type,
            json!({"prompt": PROMPT, "max_tokens": room + 1}).to_string(),
            400,
            "invalid_request_error",
            Some("max_tokens"),
        ),
        (
            cc,
            json_type,
            json!({"messages": [{"role": "user", "content": long}]}).to_string(),
            400,
            "invalid_request_error",
            Some("messages"),
        ),
        (
            c,
            json_type,
            json!({"prompt": "a", "n": 2}).to_string(),
            400,
            "invalid_request_error",
            Some("n"),
        ),
        (
            c,
            json_type,
            json!({"prompt": "a", "frobnicate": 1}).to_string(),
            400,
            "invalid_request_error",
            Some("frobnicate"),
        ),
        (
            c,
            json_type,
            json!({"prompt": "a", "temperature": -1}).to_string(),
            400,
            "invalid_request_error",
            Some("temperature"),
        ),
        (
            c,
            "text/plain",
            json!({"prompt": "a"}).to_string(),
            415,
            "invalid_request_error",
            None,
        ),
        (
            cc,
            "application/x-www-form-urlencoded",
            chat(json!({})),
            415,
            "invalid_request_error",
            None,
        ),
    ];
    let check =
        |what: &str, status: StatusCode, kind: &str, v: &Value, want: (u16, &str, Option<&str>)| {
            assert_eq!(status.as_u16(), want.0, "{what}: {v}");
            assert_eq!(kind, "application/json", "{what}");
            let e = &v["error"];
            assert!(
                e["message"].as_str().is_some_and(|m| !m.is_empty()),
                "{what}: {v}"
            );
            assert_eq!(e["type"], want.1, "{what}: {v}");
            assert_eq!(e["param"].as_str(), want.2, "{what}: {v}");
            assert_eq!(e["code"], want.0, "{what}: {v}");
        };
    for (path, ct, body, status, kind, param) in &cases {
        let request = Request::post(*path)
            .header(header::CONTENT_TYPE, *ct)
            .body(Body::from(body.clone()))
            .expect("request");
        let (got, got_kind, v) = call(&app, request).await;
        check(
            &format!("{path} {ct} {body:.80}"),
            got,
            &got_kind,
            &v,
            (*status, kind, *param),
        );
    }
    // Routes and methods that do not exist answer as OpenAI errors too.
    let (got, kind, v) = call(&app, get("/v1/nothing")).await;
    check(
        "GET /v1/nothing",
        got,
        &kind,
        &v,
        (404, "not_found_error", None),
    );
    let wrong_method = Request::builder()
        .method(Method::GET)
        .uri(c)
        .body(Body::empty())
        .expect("request");
    let (got, kind, v) = call(&app, wrong_method).await;
    check(
        "GET /v1/completions",
        got,
        &kind,
        &v,
        (405, "invalid_request_error", None),
    );

    // Each refused completion was counted, by status.
    let text = metrics(&app).await;
    let counted: f64 = text
        .lines()
        .filter(|l| l.starts_with("hlo_train_requests_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(counted, cases.len() as f64, "{text}");
    // And nothing was generated for them.
    assert!(
        !text.contains("hlo_train_completion_tokens_total{"),
        "{text}"
    );
}

/// Reads an SSE body frame by frame until `stop` says so; returns what
/// was read.
async fn read_until(
    body: &mut (impl futures_util::Stream<Item = Result<Bytes, axum::Error>> + Unpin),
    mut stop: impl FnMut(&Bytes) -> bool,
) -> Vec<Bytes> {
    let mut seen = Vec::new();
    loop {
        let frame = tokio::time::timeout(PATIENCE, body.next())
            .await
            .expect("a frame in time");
        let Some(frame) = frame else {
            return seen;
        };
        let frame = frame.expect("a frame");
        let done = stop(&frame);
        seen.push(frame);
        if done {
            return seen;
        }
    }
}

fn is_comment(frame: &Bytes) -> bool {
    frame.starts_with(b":") && frame.ends_with(b"\n\n")
}

/// Waits until the batcher has cancelled more than `before` requests.
async fn cancelled_past(batcher: &BatcherHandle, before: u64) {
    let started = std::time::Instant::now();
    while batcher.stats().cancelled.load(Ordering::SeqCst) <= before {
        assert!(started.elapsed() < PATIENCE, "never cancelled");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Whether a request's channel has not yet seen its end (its events so
/// far are read and dropped).
fn still_running(rx: &mut UnboundedReceiver<EngineEvent>) -> bool {
    loop {
        match rx.try_recv() {
            Ok(EngineEvent::Token { .. }) => {}
            Ok(_) | Err(TryRecvError::Disconnected) => return false,
            Err(TryRecvError::Empty) => return true,
        }
    }
}

#[tokio::test]
async fn keep_alive_fills_a_wait_and_a_client_that_leaves_cancels_its_request() {
    let f = fixture();
    let r = reference();
    // Keep-alive comments after 1 ms of silence.
    let app = app_with(Duration::from_millis(1), None);
    let stream_ask = |max_tokens: usize, ignore_eos: bool| {
        json!({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": true,
               "ignore_eos": ignore_eos})
    };
    let cancelled = || f.batcher.stats().cancelled.load(Ordering::SeqCst);

    // Every slot taken by requests that run to the end of the context:
    // streams sent after them wait (the queue is first come, first
    // served) and have nothing to send but keep-alive comments.
    let mut holds: Vec<_> = (0..SLOTS)
        .map(|_| {
            f.batcher
                .submit(GenerationRequest {
                    prompt: vec![256, 97],
                    adapter: None,
                    max_tokens: MAX_LEN as usize - 2,
                    sampling: Sampling::default(),
                    stop_ids: Vec::new(),
                })
                .expect("submit")
        })
        .collect();

    // A client that leaves while it waits frees its place in the queue.
    let before = cancelled();
    let leaving = send(&app, post("/v1/completions", &stream_ask(N, false))).await;
    assert_eq!(leaving.status(), StatusCode::OK);
    let mut body = leaving.into_body().into_data_stream();
    let first = read_until(&mut body, |_| true).await;
    assert!(is_comment(&first[0]), "{first:?}");
    drop(body);
    cancelled_past(&f.batcher, before).await;
    // Seen while it waited, not once a slot freed up.
    for hold in &mut holds {
        assert!(still_running(hold), "a hold finished first");
    }

    // A client that stays sees comments, then the whole completion once
    // the slots free up.
    let waiting = send(&app, post("/v1/completions", &stream_ask(N, false))).await;
    let mut body = waiting.into_body().into_data_stream();
    let mut frames = read_until(&mut body, |_| true).await;
    assert!(is_comment(&frames[0]), "{frames:?}");
    drop(holds);
    frames.extend(read_until(&mut body, |_| false).await);
    let text: String = frames
        .iter()
        .map(|b| std::str::from_utf8(b).expect("UTF-8 frame"))
        .collect();
    let events = parse_sse(&text);
    let (streamed_text, finish, _) = streamed(&json_chunks(&events), false);
    assert_eq!(streamed_text, text_of(&r.completion));
    assert_eq!(finish.as_deref(), Some(finish_of(&r.completion)));

    // A client that leaves mid-stream cancels the rest of its tokens.
    let before = cancelled();
    let long = MAX_LEN as usize - r.completion_prompt.len();
    let leaving = send(&app, post("/v1/completions", &stream_ask(long, true))).await;
    let mut body = leaving.into_body().into_data_stream();
    let read = read_until(&mut body, |frame| frame.starts_with(b"data: ")).await;
    assert!(read.last().is_some_and(|f| f.starts_with(b"data: {")));
    drop(body);
    cancelled_past(&f.batcher, before).await;
}
