//! The OpenAI (and vLLM) request bodies, read strictly: a parameter that
//! would change the result and is not honoured is refused by name, never
//! ignored.

use hlo_engine::data::Message;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// `prompt`: a text, texts, token ids, or lists of token ids.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub(crate) enum StopInput {
    One(String),
    Many(Vec<String>),
}

#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// What completions and chat completions share.
#[derive(Clone, Debug, Default, Deserialize)]
pub(crate) struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<i64>,
    pub stop: Option<StopInput>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub logit_bias: Option<Value>,
    /// OpenAI's id of the end user: accepted, read by nothing (it
    /// changes nothing generated).
    #[allow(dead_code)]
    pub user: Option<String>,
    /// vLLM's: keep generating past the model's end-of-sequence tokens.
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's: also return each choice's token ids (`token_ids`).
    #[serde(default)]
    pub return_token_ids: bool,
}

/// `POST /v1/completions`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct CompletionRequest {
    #[serde(flatten)]
    pub common: Common,
    pub prompt: PromptInput,
    pub echo: Option<bool>,
    pub logprobs: Option<Value>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
}

/// A chat message's `content`: a text, or parts of which only text ones
/// are read.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Clone, Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
pub(crate) struct ChatMessage {
    pub role: String,
    pub content: Content,
    pub name: Option<String>,
}

impl ChatMessage {
    /// The message for the chat template: its text parts joined; other
    /// parts, and `name`, refused.
    pub fn message(&self) -> Result<Message, ApiError> {
        let content = match &self.content {
            Content::Text(t) => t.clone(),
            Content::Parts(parts) => {
                let mut text = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return Err(ApiError::bad(
                            format!("content parts of type `{}` are not supported", p.kind),
                            Some("messages"),
                        ));
                    }
                    text.push_str(p.text.as_deref().unwrap_or_default());
                }
                text
            }
        };
        if self.name.is_some() {
            return Err(ApiError::bad(
                "a message's `name` is not supported: chat templates here do not read it",
                Some("messages"),
            ));
        }
        Ok(Message::new(&self.role, &content))
    }
}

/// `POST /v1/chat/completions`.
#[derive(Clone, Debug, Deserialize)]
pub(crate) struct ChatRequest {
    #[serde(flatten)]
    pub common: Common,
    pub messages: Vec<ChatMessage>,
    pub max_completion_tokens: Option<i64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
}

/// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AdapterRequest {
    pub lora_name: String,
    pub lora_path: Option<String>,
    /// vLLM's; reloading in place is not offered.
    pub load_inplace: Option<bool>,
}

const COMMON: [&str; 16] = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "user",
    "ignore_eos",
    "return_token_ids",
];

/// Parses a JSON body whose keys are `COMMON` plus `own`; an unknown key
/// is refused by name.
pub fn parse<T: for<'de> Deserialize<'de>>(body: &[u8], own: &[&str]) -> Result<T, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the body is not valid JSON: {e}"), None))?;
    let Value::Object(map) = &value else {
        return Err(ApiError::bad("the body must be a JSON object", None));
    };
    for key in map.keys() {
        if !COMMON.contains(&key.as_str()) && !own.contains(&key.as_str()) {
            return Err(ApiError::bad(
                format!("unsupported parameter `{key}`"),
                Some(key),
            ));
        }
    }
    serde_json::from_value(value).map_err(|e| ApiError::bad(format!("invalid request: {e}"), None))
}

pub(crate) const COMPLETION_KEYS: [&str; 5] = ["prompt", "echo", "logprobs", "best_of", "suffix"];
pub(crate) const CHAT_KEYS: [&str; 4] = [
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
];

/// Refuses `param` when `set` (a setting the server does not compute).
fn refuse(set: bool, param: &str, why: &str) -> Result<(), ApiError> {
    if set {
        Err(ApiError::bad(
            format!("`{param}` is not supported: {why}"),
            Some(param),
        ))
    } else {
        Ok(())
    }
}

/// Stop strings a request may give, and the longest one (in bytes): each
/// is searched for in the text after every token.
pub(crate) const MAX_STOPS: usize = 16;
pub(crate) const MAX_STOP_BYTES: usize = 1024;

impl Common {
    /// Checks every value in exact arithmetic (a number the server would
    /// have to narrow is refused, never cast); refuses what is not
    /// computed.
    pub fn check(&self) -> Result<(), ApiError> {
        if let Some(t) = self.temperature {
            // The sampler divides by it in f32.
            if !(t >= 0.0 && (t as f32).is_finite()) {
                return Err(ApiError::bad(
                    format!("temperature must be a number >= 0 (and below 3.4e38), got {t}"),
                    Some("temperature"),
                ));
            }
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::bad(
                    format!("top_p must be in (0, 1], got {p}"),
                    Some("top_p"),
                ));
            }
        }
        if let Some(k) = self.top_k {
            if k < -1 || i32::try_from(k).is_err() {
                return Err(ApiError::bad(
                    format!(
                        "top_k must be -1 (all), 0 (all) or a positive count up to {}, got {k}",
                        i32::MAX
                    ),
                    Some("top_k"),
                ));
            }
        }
        if let Some(m) = self.max_tokens {
            if m < 1 {
                return Err(ApiError::bad(
                    format!("max_tokens must be at least 1, got {m}"),
                    Some("max_tokens"),
                ));
            }
        }
        let stops = self.stops();
        if stops.len() > MAX_STOPS {
            return Err(ApiError::bad(
                format!(
                    "stop holds {} strings; at most {MAX_STOPS} are taken",
                    stops.len()
                ),
                Some("stop"),
            ));
        }
        if let Some(long) = stops.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::bad(
                format!(
                    "a stop string is {} bytes long; at most {MAX_STOP_BYTES} are taken",
                    long.len()
                ),
                Some("stop"),
            ));
        }
        refuse(self.n.is_some_and(|n| n != 1), "n", "one choice per prompt")?;
        refuse(
            self.presence_penalty.is_some_and(|p| p != 0.0),
            "presence_penalty",
            "penalties are not applied",
        )?;
        refuse(
            self.frequency_penalty.is_some_and(|p| p != 0.0),
            "frequency_penalty",
            "penalties are not applied",
        )?;
        refuse(
            self.logit_bias
                .as_ref()
                .is_some_and(|b| !b.is_null() && b.as_object().is_none_or(|o| !o.is_empty())),
            "logit_bias",
            "biases are not applied",
        )?;
        Ok(())
    }

    /// The sampler's top-k: None for all (-1 or 0). Checked first.
    pub fn top_k(&self) -> Option<u32> {
        self.top_k
            .filter(|&k| k > 0)
            .and_then(|k| u32::try_from(k).ok())
    }

    /// The request's seed as the sampler's 64 bits: the same bits for a
    /// negative one (a bijection, so distinct seeds draw differently).
    pub fn seed(&self) -> Option<u64> {
        self.seed.map(i64::cast_unsigned)
    }

    /// The stop strings.
    pub fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        }
    }
}

impl CompletionRequest {
    pub fn check(&self) -> Result<(), ApiError> {
        self.common.check()?;
        refuse(self.echo == Some(true), "echo", "the prompt is not echoed")?;
        refuse(
            self.logprobs.as_ref().is_some_and(|v| !v.is_null()),
            "logprobs",
            "log-probabilities are not returned",
        )?;
        refuse(
            self.best_of.is_some_and(|b| b != 1),
            "best_of",
            "one choice per prompt",
        )?;
        refuse(self.suffix.is_some(), "suffix", "insertion is not offered")
    }
}

impl ChatRequest {
    pub fn check(&self) -> Result<(), ApiError> {
        self.common.check()?;
        if let Some(m) = self.max_completion_tokens {
            if m < 1 {
                return Err(ApiError::bad(
                    format!("max_completion_tokens must be at least 1, got {m}"),
                    Some("max_completion_tokens"),
                ));
            }
        }
        refuse(
            self.logprobs == Some(true),
            "logprobs",
            "log-probabilities are not returned",
        )?;
        refuse(
            self.top_logprobs.is_some(),
            "top_logprobs",
            "log-probabilities are not returned",
        )?;
        if self.messages.is_empty() {
            return Err(ApiError::bad("messages is empty", Some("messages")));
        }
        Ok(())
    }
}
