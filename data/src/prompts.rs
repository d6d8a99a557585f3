//! Prompts to complete: one given as text, ids or a conversation, or a
//! JSONL file of them (`{"prompt"}`, `{"input_ids"}`, `{"messages"}`),
//! each line kept to be echoed back with its completion.

use std::path::Path;

use serde_json::Value;

use crate::chat::{ChatTemplate, Message};
use crate::tokenizer::Tokenizer;
use crate::DataError;

/// One prompt, before tokenizing.
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Ids(Vec<u32>),
    Messages(Vec<Message>),
}

/// A line of a prompt file: the line as read, and its prompt.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLine {
    /// Its line number in the file (from 1).
    pub number: usize,
    pub line: Value,
    pub prompt: Prompt,
}

impl Prompt {
    /// Token ids: text is encoded with the tokenizer's special tokens, or
    /// (with `chat`) rendered as a user message first; messages need `chat`.
    pub fn encode(
        &self,
        tokenizer: Option<&Tokenizer>,
        chat: Option<&ChatTemplate>,
    ) -> Result<Vec<u32>, DataError> {
        let tok = || tokenizer.ok_or(DataError::NoTokenizer);
        match (self, chat) {
            (Prompt::Ids(ids), _) => Ok(ids.clone()),
            (Prompt::Text(text), None) => tok()?.encode(text, true),
            (Prompt::Text(text), Some(c)) => {
                Prompt::Messages(vec![Message::new("user", text)]).encode(tokenizer, Some(c))
            }
            // A rendered chat template carries its own BOS.
            (Prompt::Messages(m), Some(c)) => tok()?.encode(&c.render(m, true)?, false),
            (Prompt::Messages(_), None) => Err(DataError::NoChatTemplate),
        }
    }
}

/// The lines of a JSONL text worth reading, with their indexes (from 0),
/// as `datasets` reads JSONL: a byte-order mark and blank lines are fine
/// (CRLF ends are taken off by `lines`).
pub fn jsonl_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(n, l)| {
            (
                n,
                if n == 0 {
                    l.trim_start_matches('\u{feff}')
                } else {
                    l
                },
            )
        })
        .filter(|(_, l)| !l.trim().is_empty())
}

/// Reads a prompt file; a bad line is an error naming the file and line.
pub fn read_prompts(path: &Path) -> Result<Vec<PromptLine>, DataError> {
    let text = std::fs::read_to_string(path).map_err(|cause| DataError::Read {
        path: path.to_path_buf(),
        cause,
    })?;
    let mut out = Vec::new();
    for (n, line) in jsonl_lines(&text) {
        let bad = |message: String| DataError::Line {
            path: path.to_path_buf(),
            line: n + 1,
            message,
        };
        let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        // `prompt_ids` as TRL's prompt datasets spell it.
        let ids = v
            .get("input_ids")
            .or_else(|| v.get("prompt_ids"))
            .and_then(Value::as_array);
        let prompt = if let Some(ids) = ids {
            Prompt::Ids(
                ids.iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| {
                        bad("input_ids (prompt_ids) must be non-negative integers".into())
                    })?,
            )
        } else if let Some(p) = v.get("prompt").and_then(Value::as_str) {
            Prompt::Text(p.to_string())
        } else if let Some(m) = v.get("messages") {
            let messages: Vec<Message> =
                serde_json::from_value(m.clone()).map_err(|e| bad(format!("messages: {e}")))?;
            crate::chat::check_roles(&messages, "messages").map_err(bad)?;
            Prompt::Messages(messages)
        } else {
            return Err(bad(
                "expected {\"prompt\"}, {\"input_ids\"} ({\"prompt_ids\"}) or {\"messages\"}"
                    .into(),
            ));
        };
        out.push(PromptLine {
            number: n + 1,
            line: v,
            prompt,
        });
    }
    if out.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}
