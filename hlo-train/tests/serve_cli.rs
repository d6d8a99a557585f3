//! `hlo-train serve` end to end, through a real HTTP client on 127.0.0.1:
//! greedy completions of adapters of different ranks and targets, sent
//! concurrently and interleaved, equal `hlo-train generate --adapter` and
//! HF+PEFT token for token; streamed chunks make the whole text; an adapter
//! loaded at run time answers as one given at start; every bad input gets
//! its status code and the server keeps answering; SIGTERM finishes the
//! requests in flight and exits 0.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{expected, family, fixture, fixture_tensor, greedy_ids, scratch};
use hlo_engine::ir::{DType, Literal, TensorType};
use hlo_engine::models::adapter::Adapter;
use hlo_engine::models::decoder::{LoraConfig, ModelConfig};
use serde_json::{json, Value};

/// A running server, killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_hlo-train"))
            .arg("serve")
            .args(["--port", "0"])
            .args(args)
            .env_remove("HLO_TRAIN_PLUGIN")
            .env_remove("HLO_TRAIN_API_KEY")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start hlo-train serve");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = match line.split("http://").nth(1) {
            Some(a) => a.trim().to_string(),
            None => {
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("the server did not start: {line} {err}");
            }
        };
        Server { child, addr }
    }

    fn request(&self, method: &str, path: &str, body: &str, headers: &[&str]) -> (u16, String) {
        http(&self.addr, method, path, body, headers)
    }

    fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, text) = self.request("POST", path, &body.to_string(), &[]);
        let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, v)
    }

    /// A metric's value from `/metrics`.
    fn metric(&self, name: &str) -> f64 {
        let (_, text) = self.request("GET", "/metrics", "", &[]);
        text.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok()))
            .unwrap_or_else(|| panic!("no metric {name}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request (`Connection: close`); the status and the body
/// (chunked bodies joined).
fn http(addr: &str, method: &str, path: &str, body: &str, headers: &[&str]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for h in headers {
        req.push_str(h);
        req.push_str("\r\n");
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").expect("a response");
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    (status, body)
}

fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

/// The `data:` payloads of a server-sent event stream.
fn events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn gqa() -> PathBuf {
    fixture("gqa_llama3")
}

/// A random PEFT adapter for `config` (rank, alpha, targets), B not zero.
fn random_adapter(dir: &Path, config: &ModelConfig, rank: i64, targets: &[&str], seed: u64) {
    let lora = LoraConfig::new(rank, 2.0 * rank as f64, targets, false).unwrap();
    let mut a = Adapter::init(config, &lora, seed);
    let mut rng = hlo_engine::ir::rng::Rng::new(seed + 1);
    for (n, t) in &mut a.tensors {
        if n.ends_with(".lora_b") {
            let v: Vec<f64> = (0..t.ty.element_count())
                .map(|_| 0.3 * rng.normal())
                .collect();
            *t = Literal::from_f64s(TensorType::new(DType::F32, t.ty.dims.clone()), &v);
        }
    }
    a.save(dir, None).unwrap();
}

fn gqa_config() -> ModelConfig {
    ModelConfig::from_file(&gqa().join("config.json")).unwrap()
}

fn generate_ids(adapter: Option<&Path>, prompt: &str, n: usize) -> Vec<u64> {
    greedy_ids(&gqa(), adapter, prompt, n, &[])
}

#[test]
fn adapters_served_together_answer_as_generate_and_peft() {
    let dir = scratch("serve", "adapters");
    let config = ModelConfig::from_file(&gqa().join("config.json")).unwrap();
    let qv = dir.join("qv");
    random_adapter(&qv, &config, 2, &["q_proj", "v_proj"], 5);
    let mlp = dir.join("mlp");
    random_adapter(&mlp, &config, 6, &["gate_proj", "down_proj"], 6);
    let peft = gqa().join("adapter");
    let patterns = gqa().join("variant_patterns");
    let arg = |n: &str, p: &Path| format!("{n}={}", p.display());
    let server = Server::start(&[
        "--checkpoint",
        gqa().to_str().unwrap(),
        "--served-model-name",
        "base",
        "--adapter",
        &arg("peft", &peft),
        "--adapter",
        &arg("qv", &qv),
        "--adapter",
        &arg("patterns", &patterns),
        "--max-batch-size",
        "4",
        "--max-loras",
        "2",
    ]);
    let (status, models) = server.request("GET", "/v1/models", "", &[]);
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    let names: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["base", "patterns", "peft", "qv"]);

    // HF's greedy tokens (transformers, and PEFT for the adapter).
    let want_base = ids_of(&expected("gqa_llama3", "greedy"));
    let want_peft = ids_of(&expected("gqa_llama3", "greedy_adapter"));
    let hf_prompt: Vec<u64> = want_base[..5].to_vec();

    // "mlp" is loaded at run time; it must answer as if given at start.
    let (status, text) = server.post(
        "/v1/load_lora_adapter",
        &json!({"lora_name": "mlp", "lora_path": mlp.to_str().unwrap()}),
    );
    assert_eq!(status, 200, "{text}");

    let prompts: [&[u64]; 3] = [
        &[1, 5, 9, 12, 7, 3],
        &[1, 40, 3],
        &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17],
    ];
    let models: [(&str, Option<&Path>); 5] = [
        ("base", None),
        ("peft", Some(&peft)),
        ("qv", Some(&qv)),
        ("patterns", Some(&patterns)),
        ("mlp", Some(&mlp)),
    ];
    // Every (model, prompt), all sent at once, models interleaved.
    let mut work = Vec::new();
    for (j, p) in prompts.iter().enumerate() {
        for (k, (m, dir)) in models.iter().enumerate() {
            work.push((
                m.to_string(),
                dir.map(Path::to_path_buf),
                p.to_vec(),
                3 + (j + k) % 6,
            ));
        }
    }
    work.push(("base".into(), None, hf_prompt.clone(), 32));
    work.push(("peft".into(), Some(peft.clone()), hf_prompt.clone(), 32));
    let addr = server.addr.clone();
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let handles: Vec<_> = work
            .iter()
            .map(|(m, _, p, n)| {
                let addr = addr.clone();
                let body = json!({"model": m, "prompt": p, "max_tokens": n, "temperature": 0,
                                  "ignore_eos": true, "return_token_ids": true});
                s.spawn(move || {
                    let (status, text) =
                        http(&addr, "POST", "/v1/completions", &body.to_string(), &[]);
                    (status, serde_json::from_str(&text).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for ((m, dir, p, n), (status, v)) in work.iter().zip(&answers) {
        assert_eq!(*status, 200, "{v}");
        let got = ids(&v["choices"][0]["token_ids"]);
        let prompt: Vec<String> = p.iter().map(u64::to_string).collect();
        assert_eq!(
            got,
            generate_ids(dir.as_deref(), &prompt.join(","), *n),
            "{m} {p:?}"
        );
        assert_eq!(v["usage"]["prompt_tokens"], p.len());
        assert_eq!(v["usage"]["completion_tokens"], *n);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        if *p == hf_prompt {
            let want = if m == "base" { &want_base } else { &want_peft };
            assert_eq!(got, want[5..], "{m}: HF");
        }
    }
    // Two table entries for four adapters: loads and evictions happened.
    assert!(server.metric("hlo_train_adapter_evictions_total") >= 1.0);

    // Unloaded, the adapter is an unknown model; loaded again, it answers.
    let (status, _) = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "mlp"}));
    assert_eq!(status, 200);
    let ask = json!({"model": "mlp", "prompt": [1, 2, 3], "max_tokens": 2});
    assert_eq!(server.post("/v1/completions", &ask).0, 404);
    let (status, _) = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "mlp"}));
    assert_eq!(status, 404);
    std::fs::remove_dir_all(dir).unwrap();
}

fn ids_of(l: &Literal) -> Vec<u64> {
    l.to_i128s().into_iter().map(|v| v as u64).collect()
}

#[test]
fn streamed_text_is_the_whole_text_and_follows_the_prompt() {
    let server = Server::start(&["--model", "tiny", "--max-batch-size", "4"]);
    for chat in [false, true] {
        let (path, mut body) = if chat {
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "Hi"}]}),
            )
        } else {
            ("/v1/completions", json!({"prompt": "The capital of"}))
        };
        body["model"] = json!("tiny");
        body["max_tokens"] = json!(40);
        body["seed"] = json!(3);
        body["temperature"] = json!(0.8);
        body["ignore_eos"] = json!(true);
        body["return_token_ids"] = json!(true);
        let (status, whole) = server.post(path, &body);
        if chat {
            // The tiny preset has no chat template: a clear 400.
            assert_eq!(status, 400, "{whole}");
            assert!(whole["error"]["message"]
                .as_str()
                .unwrap()
                .contains("chat template"));
            continue;
        }
        assert_eq!(status, 200, "{whole}");
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let (status, text) = server.request("POST", path, &body.to_string(), &[]);
        assert_eq!(status, 200);
        let events = events(&text);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> = events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let streamed: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str())
            .collect();
        let choice = &whole["choices"][0];
        assert_eq!(streamed, choice["text"].as_str().unwrap());
        // Same seed, same tokens, one chunk per token; usage in the last
        // chunk.
        let streamed_ids: Vec<u64> = chunks
            .iter()
            .filter_map(|c| c["choices"][0].get("token_ids"))
            .flat_map(ids)
            .collect();
        assert_eq!(streamed_ids, ids(&choice["token_ids"]));
        let per_token = chunks
            .iter()
            .filter(|c| c["choices"][0].get("token_ids").is_some())
            .count();
        assert_eq!(per_token, 40);
        assert_eq!(chunks.last().unwrap()["usage"], whole["usage"]);
        // The byte-level tokenizer: the text is the bytes after the
        // prompt's, whole characters only in every chunk.
        let bytes: Vec<u8> = ids(&choice["token_ids"])
            .iter()
            .filter(|&&t| t < 256)
            .map(|&t| t as u8)
            .collect();
        assert_eq!(
            choice["text"].as_str().unwrap(),
            String::from_utf8_lossy(&bytes)
        );
    }
    // A stop string ends the text before it; greedy text is reproducible.
    let greedy = json!({"prompt": "ab", "max_tokens": 30, "temperature": 0, "ignore_eos": true});
    let (_, full) = server.post("/v1/completions", &greedy);
    let full = full["choices"][0]["text"].as_str().unwrap().to_string();
    let cut: String = full.chars().skip(3).take(2).collect();
    let mut stopped = greedy.clone();
    stopped["stop"] = json!([cut]);
    let (_, v) = server.post("/v1/completions", &stopped);
    let at = full.find(&cut).unwrap();
    assert_eq!(v["choices"][0]["text"].as_str().unwrap(), &full[..at]);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[test]
fn bad_input_gets_its_status_and_the_server_keeps_answering() {
    let dir = scratch("serve", "bad");
    let server = Server::start(&[
        "--checkpoint",
        gqa().to_str().unwrap(),
        "--max-lora-rank",
        "4",
        "--max-model-len",
        "32",
        "--api-key",
        "sesame",
    ]);
    let key = "Authorization: Bearer sesame";
    let post = |path: &str, body: &str, auth: bool| {
        let headers: &[&str] = if auth { &[key] } else { &[] };
        server.request("POST", path, body, headers)
    };
    let good = r#"{"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}"#;
    let cases: Vec<(&str, String, u16)> = vec![
        ("no key", good.to_string(), 401),
        ("malformed JSON", "{\"prompt\": [1,".to_string(), 400),
        ("not an object", "[1]".to_string(), 400),
        (
            "max_tokens 0",
            r#"{"prompt": [1], "max_tokens": 0}"#.into(),
            400,
        ),
        (
            "negative temperature",
            r#"{"prompt": [1], "temperature": -0.5}"#.into(),
            400,
        ),
        ("top_p 0", r#"{"prompt": [1], "top_p": 0}"#.into(), 400),
        ("n 2", r#"{"prompt": [1], "n": 2}"#.into(), 400),
        (
            "unknown parameter",
            r#"{"prompt": [1], "best_off": 2}"#.into(),
            400,
        ),
        (
            "penalty",
            r#"{"prompt": [1], "presence_penalty": 0.5}"#.into(),
            400,
        ),
        (
            "token outside the vocabulary",
            r#"{"prompt": [1, 999]}"#.into(),
            400,
        ),
        (
            "text without a tokenizer",
            r#"{"prompt": "hello"}"#.into(),
            400,
        ),
        ("empty prompt", r#"{"prompt": []}"#.into(), 400),
        (
            "prompt too long",
            format!(r#"{{"prompt": {:?}, "max_tokens": 1}}"#, vec![1; 32]),
            400,
        ),
        (
            "prompt + max_tokens too long",
            r#"{"prompt": [1, 2], "max_tokens": 31}"#.into(),
            400,
        ),
        (
            "unknown model",
            r#"{"model": "nope", "prompt": [1]}"#.into(),
            404,
        ),
        // Numbers past what the server computes with: refused by name,
        // never wrapped or cut.
        (
            "max_tokens i64::MAX",
            format!(r#"{{"prompt": [1, 2], "max_tokens": {}}}"#, i64::MAX),
            400,
        ),
        (
            "max_tokens past u64",
            r#"{"prompt": [1, 2], "max_tokens": 18446744073709551616}"#.into(),
            400,
        ),
        (
            "top_k 2^32 + 1",
            r#"{"prompt": [1, 2], "top_k": 4294967297}"#.into(),
            400,
        ),
        (
            "temperature past f32",
            r#"{"prompt": [1, 2], "temperature": 1e300}"#.into(),
            400,
        ),
        (
            "seventeen stop strings",
            format!(r#"{{"prompt": [1, 2], "stop": {:?}}}"#, vec!["x"; 17]),
            400,
        ),
        (
            "a 2 kB stop string",
            format!(r#"{{"prompt": [1, 2], "stop": "{}"}}"#, "y".repeat(2048)),
            400,
        ),
    ];
    for (what, body, status) in &cases {
        let auth = *what != "no key";
        let (got, text) = post("/v1/completions", body, auth);
        assert_eq!(got, *status, "{what}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|_| panic!("{what}: {text}"));
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}: {v}"
        );
        assert_eq!(v["error"]["code"], *status, "{what}");
        // And the server still answers.
        let (ok_status, ok_text) = post("/v1/completions", good, true);
        assert_eq!(ok_status, 200, "after {what}: {ok_text}");
    }
    assert_eq!(server.request("GET", "/v1/models", "", &[]).0, 401);
    assert_eq!(server.request("GET", "/health", "", &[]).0, 200);

    // Adapters that cannot be served: 400, and the server goes on.
    let corrupt = dir.join("corrupt");
    std::fs::create_dir_all(&corrupt).unwrap();
    std::fs::copy(
        gqa().join("adapter/adapter_config.json"),
        corrupt.join("adapter_config.json"),
    )
    .unwrap();
    std::fs::write(
        corrupt.join("adapter_model.safetensors"),
        b"not safetensors",
    )
    .unwrap();
    let other_base = dir.join("other_base");
    let tiny = ModelConfig::preset("tiny").unwrap();
    random_adapter(&other_base, &tiny, 2, &["q_proj"], 1);
    // NaN in one weight of an otherwise good adapter.
    let nan = dir.join("nan");
    let mut a = Adapter::load(&gqa().join("adapter"), &gqa_config()).unwrap();
    let (_, t) = &mut a.tensors[0];
    let mut v = t.to_f64s();
    v[3] = f64::NAN;
    *t = Literal::from_f64s(t.ty.clone(), &v);
    a.save(&nan, None).unwrap();
    for (what, path) in [
        ("missing", dir.join("missing")),
        ("corrupt", corrupt),
        ("NaN weights", nan),
        ("rank above --max-lora-rank", gqa().join("variant_patterns")),
        ("another base model", other_base),
        ("modules_to_save", gqa().join("variant_lm_head")),
    ] {
        let body = json!({"lora_name": what, "lora_path": path.to_str().unwrap()}).to_string();
        let (status, text) = post("/v1/load_lora_adapter", &body, true);
        assert_eq!(status, 400, "{what}: {text}");
        assert!(text.contains("\"error\""), "{what}: {text}");
    }
    let body = json!({"lora_name": "peft", "lora_path": gqa().join("adapter").to_str().unwrap()});
    assert_eq!(
        post("/v1/load_lora_adapter", &body.to_string(), true).0,
        200
    );
    // The same name twice is refused.
    assert_eq!(
        post("/v1/load_lora_adapter", &body.to_string(), true).0,
        400
    );
    let (status, _) = post(
        "/v1/completions",
        r#"{"model": "peft", "prompt": [1, 2, 3], "max_tokens": 3}"#,
        true,
    );
    assert_eq!(status, 200);
    let metrics = server.request("GET", "/metrics", "", &[]).1;
    assert!(
        metrics.contains("hlo_train_requests_total{model=\"\",status=\"401\"}"),
        "{metrics}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_full_queue_is_429_a_client_that_leaves_frees_its_slot_and_sigterm_finishes_in_flight_work() {
    // A random model of the byte vocabulary (text prompts work) slow enough
    // that the 8000-token stream below outlasts the client's steps before it
    // hangs up even on a loaded machine (10–20 ms a token; `tiny` takes
    // about 1 ms, which raced; 500 tokens raced too while the servers of
    // the tests beside it compiled their step programs).
    let dir = scratch("serve", "queue");
    let config = dir.join("config.json");
    let slow = json!({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 264, "hidden_size": 512, "intermediate_size": 1024,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 8192, "tie_word_embeddings": false,
        "bos_token_id": 256, "eos_token_id": 257});
    std::fs::write(&config, slow.to_string()).unwrap();
    let server = Server::start(&[
        "--config",
        config.to_str().unwrap(),
        "--max-batch-size",
        "1",
        "--max-queue",
        "1",
        "--max-model-len",
        "8192",
    ]);
    let long = json!({"prompt": "a", "max_tokens": 8000, "temperature": 0, "ignore_eos": true, "stream": true});
    // A streaming client that reads one chunk and hangs up.
    let mut s = TcpStream::connect(&server.addr).unwrap();
    let body = long.to_string();
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    let _ = s.read(&mut first).unwrap();
    // The stream's headers come while it may still be queued: wait until
    // it holds the slot, so that the queue is empty for the next one.
    let started = Instant::now();
    while server.metric("hlo_train_running_slots") < 1.0
        || server.metric("hlo_train_queue_depth") > 0.0
    {
        assert!(started.elapsed() < Duration::from_secs(60), "never running");
        std::thread::sleep(Duration::from_millis(5));
    }
    // While it streams, the queue holds one more; the next is refused.
    let started = Instant::now();
    let addr = server.addr.clone();
    let queued = std::thread::spawn(move || {
        let body = json!({"prompt": "b", "max_tokens": 5, "temperature": 0}).to_string();
        http(&addr, "POST", "/v1/completions", &body, &[])
    });
    while server.metric("hlo_train_queue_depth") < 1.0 {
        assert!(started.elapsed() < Duration::from_secs(60), "never queued");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (status, text) = server.post("/v1/completions", &json!({"prompt": "c", "max_tokens": 5}));
    assert_eq!(status, 429, "{text}");
    drop(s);
    // The slot is freed without generating the other ~8000 tokens.
    let (status, _) = queued.join().unwrap();
    assert_eq!(status, 200);
    assert!(server.metric("hlo_train_cancelled_total") >= 1.0);
    assert!(server.metric("hlo_train_decode_steps_total") < 8000.0);

    // SIGTERM with a request in flight: it completes, then exit code 0.
    let addr = server.addr.clone();
    let inflight = std::thread::spawn(move || {
        let body = json!({"prompt": "d", "max_tokens": 200, "temperature": 0, "ignore_eos": true});
        http(&addr, "POST", "/v1/completions", &body.to_string(), &[])
    });
    while server.metric("hlo_train_running_slots") < 1.0 {
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut server = server;
    let pid = server.child.id().to_string();
    assert!(Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let (status, text) = inflight.join().unwrap();
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 200);
    let code = server.child.wait().unwrap();
    assert_eq!(code.code(), Some(0));
    // It said what it was doing while it compiled, and how it ended.
    let mut err = String::new();
    server
        .child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(
        err.starts_with("starting: placing ")
            && err.contains("weights and compiling its serving programs (")
            && err.contains("stopped: every request finished"),
        "{err}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn each_family_is_served_as_hf_generates() {
    // The mixtures of experts too, with adapters on their attention.
    for name in [
        "qwen2",
        "qwen3",
        "mistral",
        "gemma3",
        "qwen3_moe",
        "mixtral",
        "gpt_oss",
        "qwen2_moe",
        "glm4_moe",
        "deepseek_v3",
    ] {
        let dir = family(name);
        let adapter = format!("peft={}", dir.join("adapter").display());
        let server = Server::start(&[
            "--checkpoint",
            dir.to_str().unwrap(),
            "--served-model-name",
            "base",
            "--adapter",
            &adapter,
            "--max-batch-size",
            "2",
        ]);
        let want = |key: &str| ids_of(&fixture_tensor(&dir, "expected.safetensors", key));
        let addr = server.addr.clone();
        let answers: Vec<Vec<u64>> = std::thread::scope(|s| {
            [("base", want("greedy")), ("peft", want("greedy_adapter"))]
                .map(|(model, hf)| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        let body = json!({"model": model, "prompt": &hf[..7], "max_tokens": 24,
                                          "temperature": 0, "ignore_eos": true,
                                          "return_token_ids": true});
                        let (status, text) =
                            http(&addr, "POST", "/v1/completions", &body.to_string(), &[]);
                        assert_eq!(status, 200, "{name} {model}: {text}");
                        let v: Value = serde_json::from_str(&text).unwrap();
                        let got = ids(&v["choices"][0]["token_ids"]);
                        assert_eq!(got, hf[7..], "{name} {model}: HF's greedy tokens");
                        got
                    })
                })
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect()
        });
        assert_eq!(answers.len(), 2);
    }
}

#[test]
fn a_chat_longer_than_the_context_is_400_and_the_next_request_is_served() {
    // Without max_tokens a chat reply may take the rest of the context;
    // a conversation that leaves none once panicked the batcher.
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat/llama_style");
    let server = Server::start(&[
        "--model",
        "tiny",
        "--max-model-len",
        "256",
        "--chat-template",
        template.to_str().unwrap(),
    ]);
    let short = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
        "temperature": 0, "return_token_ids": true});
    let (status, before) = server.post("/v1/chat/completions", &short);
    assert_eq!(status, 200, "{before}");
    // "Hi" renders to about 200 tokens with this template's system text.
    let long = json!({"messages": [{"role": "user", "content": "x".repeat(300)}]});
    let (status, v) = server.post("/v1/chat/completions", &long);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages", "{v}");
    let mut huge = short.clone();
    huge["max_completion_tokens"] = json!(i64::MAX);
    let (status, v) = server.post("/v1/chat/completions", &huge);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "max_completion_tokens", "{v}");
    let (status, after) = server.post("/v1/chat/completions", &short);
    assert_eq!(status, 200, "{after}");
    assert_eq!(
        after["choices"][0]["token_ids"],
        before["choices"][0]["token_ids"]
    );
    assert_eq!(server.request("GET", "/health", "", &[]).0, 200);
}

#[test]
fn a_failed_batcher_makes_health_503_and_the_server_exit_non_zero() {
    // The test hook makes the scheduling thread panic on a prompt holding
    // token 77, as a bug would.
    let mut child = Command::new(env!("CARGO_BIN_EXE_hlo-train"))
        .args(["serve", "--port", "0", "--model", "tiny"])
        .env("HLO_TRAIN_TEST_FAIL_ON_TOKEN", "77")
        .env_remove("HLO_TRAIN_PLUGIN")
        .env_remove("HLO_TRAIN_API_KEY")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start hlo-train serve");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line
        .split("http://")
        .nth(1)
        .expect("listening")
        .trim()
        .to_string();
    let server = Server { child, addr };
    let (status, v) = server.post(
        "/v1/completions",
        &json!({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(server.request("GET", "/health", "", &[]).0, 200);
    let (status, v) = server.post(
        "/v1/completions",
        &json!({"prompt": [1, 77, 3], "max_tokens": 3}),
    );
    assert_eq!(status, 500, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("batcher failed"),
        "{v}"
    );
    // Not ready from now on, then gone.
    let (status, text) = server.request("GET", "/health", "", &[]);
    assert_eq!(status, 503, "{text}");
    let (status, _) = server.post(
        "/v1/completions",
        &json!({"prompt": [1, 2], "max_tokens": 2}),
    );
    assert_eq!(status, 503);
    let mut server = server;
    let started = Instant::now();
    let code = loop {
        if let Some(code) = server.child.try_wait().unwrap() {
            break code;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the server did not exit"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(code.code(), Some(2), "{code:?}");
    let mut err = String::new();
    server
        .child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(err.contains("batcher failed"), "{err}");
}
