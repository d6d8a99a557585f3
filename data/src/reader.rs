//! Training examples from JSONL lines: `{"text"}`, `{"prompt",
//! "completion"}` (loss on the completion), `{"messages"}` (rendered with
//! the chat template, loss on the assistant's replies) and `{"input_ids"}`,
//! each tokenized into ids with a per-token target flag; and the bundled
//! demo task.

use std::path::Path;

use serde_json::Value;

use crate::chat::{ChatTemplate, Message};
use crate::tokenizer::Tokenizer;
use crate::DataError;

/// One tokenized example: ids, and which of them are targets.
#[derive(Clone, Debug, PartialEq)]
pub struct Example {
    pub ids: Vec<u32>,
    /// `target[i]`: token `i` is predicted and counted in the loss.
    pub target: Vec<bool>,
}

/// How `{"messages"}` lines become examples.
pub struct ChatData<'a> {
    /// The model's chat template.
    pub template: &'a ChatTemplate,
    /// Tokens that end a turn as EOS does (the config's EOS ids): an
    /// assistant turn that does not end with one gets `eos` appended.
    pub stop: Vec<u32>,
    /// Count every token in the loss, not only the assistant's.
    pub train_on_inputs: bool,
}

/// Parses one JSONL line: `{"text"}`, `{"prompt", "completion"}` or
/// `{"input_ids"}`. Text gets BOS (from the tokenizer) and EOS appended.
pub fn parse_line(
    line: &str,
    tokenizer: Option<&Tokenizer>,
    eos: Option<u32>,
    vocab: i64,
) -> Result<Example, String> {
    parse_line_with(line, tokenizer, eos, vocab, None)
}

/// A conversation rendered with the chat template: the text is cut where
/// each assistant reply starts and ends (rendering the conversation up to
/// it with and without the reply), each piece tokenized on its own, and
/// only the replies' tokens (with their end-of-turn tokens) are targets.
fn chat_example(
    messages: &[Message],
    tokenizer: &Tokenizer,
    eos: Option<u32>,
    chat: &ChatData,
) -> Result<Example, String> {
    if messages.is_empty() {
        return Err("messages is empty".into());
    }
    let render = |upto: usize, generation: bool| {
        chat.template
            .render(&messages[..upto], generation)
            .map_err(|e| e.to_string())
    };
    // (text, trained) pieces, in order.
    let mut pieces: Vec<(String, bool)> = Vec::new();
    let mut done = String::new();
    let mut cut = |text: String, trained: bool, pieces: &mut Vec<(String, bool)>| {
        let rest = text
            .strip_prefix(done.as_str())
            .ok_or("the chat template does not render a conversation's prefix as a prefix of it")?;
        if !rest.is_empty() {
            pieces.push((rest.to_string(), trained));
        }
        done = text;
        Ok::<(), String>(())
    };
    for (i, m) in messages.iter().enumerate() {
        if m.role == "assistant" {
            cut(render(i, true)?, chat.train_on_inputs, &mut pieces)?;
            cut(render(i + 1, false)?, true, &mut pieces)?;
        }
    }
    cut(
        render(messages.len(), false)?,
        chat.train_on_inputs,
        &mut pieces,
    )?;
    if !pieces.iter().any(|p| p.1) {
        return Err("no assistant turn to learn from".into());
    }
    let mut ids = Vec::new();
    let mut target = Vec::new();
    for (text, trained) in pieces {
        let mut t = tokenizer.encode(&text, false).map_err(|e| e.to_string())?;
        // A reply the template does not end with EOS gets one, so the
        // finetuned model learns to stop.
        if trained && !t.last().is_some_and(|x| chat.stop.contains(x)) {
            if let Some(e) = eos {
                t.push(e);
            }
        }
        target.extend(t.iter().map(|_| trained));
        ids.extend(t);
    }
    Ok(Example { ids, target })
}

/// [`parse_line`], also taking `{"messages": [{"role", "content"}, ...]}`
/// lines when `chat` is given.
pub fn parse_line_with(
    line: &str,
    tokenizer: Option<&Tokenizer>,
    eos: Option<u32>,
    vocab: i64,
    chat: Option<&ChatData>,
) -> Result<Example, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    let tok = || tokenizer.ok_or("text needs a tokenizer (--tokenizer FILE), or give input_ids");
    let with_eos = |mut ids: Vec<u32>| {
        if let Some(e) = eos {
            ids.push(e);
        }
        ids
    };
    let ex = if let Some(m) = obj.get("messages") {
        let chat =
            chat.ok_or("messages lines need the model's chat template (tokenizer_config.json)")?;
        let messages: Vec<Message> =
            serde_json::from_value(m.clone()).map_err(|e| format!("messages: {e}"))?;
        chat_example(&messages, tok()?, eos, chat)?
    } else if let Some(ids) = obj.get("input_ids") {
        let ids: Vec<u32> = ids
            .as_array()
            .ok_or("input_ids is not a list")?
            .iter()
            .map(|t| {
                t.as_u64()
                    .filter(|&t| t <= u32::MAX as u64)
                    .map(|t| t as u32)
                    .ok_or("input_ids holds a non-integer")
            })
            .collect::<Result<_, _>>()?;
        let n = ids.len();
        Example {
            ids,
            target: (0..n).map(|i| i > 0).collect(),
        }
    } else if let (Some(p), Some(c)) = (obj.get("prompt"), obj.get("completion")) {
        let (p, c) = (
            p.as_str().ok_or("prompt is not a string")?,
            c.as_str().ok_or("completion is not a string")?,
        );
        let t = tok()?;
        let prompt = t.encode(p, true).map_err(|e| e.to_string())?;
        let completion = with_eos(t.encode(c, false).map_err(|e| e.to_string())?);
        let target = prompt
            .iter()
            .map(|_| false)
            .chain(completion.iter().map(|_| true))
            .collect();
        Example {
            ids: prompt.into_iter().chain(completion).collect(),
            target,
        }
    } else if let Some(text) = obj.get("text") {
        let text = text.as_str().ok_or("text is not a string")?;
        let ids = with_eos(tok()?.encode(text, true).map_err(|e| e.to_string())?);
        let n = ids.len();
        Example {
            ids,
            target: (0..n).map(|i| i > 0).collect(),
        }
    } else {
        return Err(
            "expected {\"text\"}, {\"prompt\", \"completion\"}, {\"messages\"} or {\"input_ids\"}"
                .into(),
        );
    };
    if ex.ids.len() < 2 {
        return Err("fewer than two tokens: nothing to predict".into());
    }
    if let Some(bad) = ex.ids.iter().find(|&&t| t as i64 >= vocab) {
        return Err(format!(
            "token id {bad} is outside the vocabulary (size {vocab})"
        ));
    }
    Ok(ex)
}

/// Reads a JSONL file; a bad line is an error naming the file and line.
pub fn read_jsonl(
    path: &Path,
    tokenizer: Option<&Tokenizer>,
    eos: Option<u32>,
    vocab: i64,
    chat: Option<&ChatData>,
) -> Result<Vec<Example>, DataError> {
    let text = std::fs::read_to_string(path).map_err(|cause| DataError::Read {
        path: path.to_path_buf(),
        cause,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            return Err(DataError::Line {
                path: path.to_path_buf(),
                line: i + 1,
                message: "empty line".into(),
            });
        }
        out.push(
            parse_line_with(line, tokenizer, eos, vocab, chat).map_err(|message| {
                DataError::Line {
                    path: path.to_path_buf(),
                    line: i + 1,
                    message,
                }
            })?,
        );
    }
    if out.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// The bundled demo task, learnable by `tiny` in a minute on a CPU: write a
/// lowercase word in capitals (`prompt` "cat=" → `completion` "CAT").
pub fn demo_examples(
    tokenizer: &Tokenizer,
    eos: Option<u32>,
    count: usize,
    seed: u64,
) -> Vec<Example> {
    let mut rng = hlo_ir::rng::Rng::new(seed);
    (0..count)
        .map(|_| {
            let len = 3 + (rng.next_u64() % 4) as usize;
            let word: String = (0..len).map(|_| (b'a' + (rng.next_u64() % 26) as u8) as char).collect();
            let line = serde_json::json!({"prompt": format!("{word}="), "completion": word.to_uppercase()}).to_string();
            parse_line(&line, Some(tokenizer), eos, i64::MAX).expect("demo lines are valid")
        })
        .collect()
}
