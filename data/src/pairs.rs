//! Preference pairs (for DPO and its kin) read as TRL 1.16 reads its
//! preference datasets, JSONL or Parquet, in three shapes:
//!
//! 1. `{"prompt", "chosen", "rejected"}` strings (`prompt` may be left
//!    out: the shared leading text is the prompt);
//! 2. conversational rows: `chosen` and `rejected` message lists, with a
//!    `prompt` message list or without (the shared leading messages are
//!    the prompt), rendered with the model's chat template;
//! 3. pre-tokenized `{"prompt_ids", "chosen_ids", "rejected_ids"}`, used
//!    as given (no BOS or EOS added).
//!
//! Each side of a pair is an [`Example`] marked as `{"prompt",
//! "completion"}` rows are: the prompt's tokens not learned, the
//! completion's tokens learned, so the SFT loss mask applies unchanged.
//!
//! What TRL 1.16 does, and so what is done here (`trl/trainer/
//! dpo_trainer.py`, `DPOTrainer._prepare_dataset` and its `tokenize_fn`;
//! `trl/data_utils.py`, `extract_prompt`, `_tokenize`,
//! `common_prefix_length`; `DataCollatorForPreference.torch_call`):
//!
//! - Without `prompt`, `extract_prompt` splits `chosen` and `rejected` at
//!   their first difference (characters of strings, whole messages of
//!   lists). For strings, a space just before the difference goes to the
//!   completions. When neither differs before the shorter one ends, the
//!   split is one element before that end. A split at 0 leaves an empty
//!   prompt; TRL then misreads string rows whose `chosen` ends with a
//!   space, and cannot render an empty conversation: both are refused.
//! - String rows get the tokenizer's `eos_token` text appended to `chosen`
//!   and to `rejected` unless they already end with it (conversational
//!   rows get nothing: the template ends the turn).
//! - Strings are tokenized as `tokenizer(text)`, so with the tokenizer's
//!   special tokens (BOS where it adds one): the prompt alone, prompt +
//!   chosen and prompt + rejected, each concatenated as text first.
//!   Conversations are rendered with `apply_chat_template` and tokenized
//!   without special tokens (the template writes BOS): the prompt with
//!   the generation prompt, prompt + chosen and prompt + rejected without.
//! - The prompt is the longest run of leading tokens that the prompt's
//!   ids share with both prompt + chosen and prompt + rejected (not always
//!   all of the prompt's ids: tokens can merge across the boundary, and
//!   some templates render a prompt alone differently); each completion
//!   is the rest of its own sequence. So `chosen.ids` is exactly the
//!   tokenized prompt + chosen.
//! - No `max_prompt_length` or `max_completion_length` exists in 1.16:
//!   `max_length` (default 1024) cuts each sequence keeping its start
//!   (`truncation_mode="keep_start"`; `"keep_end"` is deprecated), and a
//!   pair whose prompt alone fills `max_length` is dropped. Pairs are kept
//!   whole here; [`PreferencePair::learns_within`] is that filter, and
//!   cutting a row to its first `seq` tokens is the loader's usual cut.
//! - Pre-tokenized rows: the names are those the tokenize step writes and
//!   `DataCollatorForPreference` reads; a sequence is `prompt_ids +
//!   chosen_ids`, learned over `chosen_ids`. (`_prepare_dataset` itself
//!   would run `extract_prompt` on such rows; the collator takes them.)
//!
//! Text fields are cut (by characters, with the reader's wide margin) to
//! what the row length can use, as the other shapes are: what is cut lies
//! beyond the row, where `keep_start` truncation drops it anyway.

use std::path::Path;

use serde_json::{Map, Value};

use crate::chat::Message;
use crate::reader::{collect_path, cut_text, data_files, id_list, visit_rows, Example, Reader};
use crate::DataError;

/// One preference pair: the same prompt followed by the preferred
/// (`chosen`) and the dispreferred (`rejected`) completion. Each side is
/// the prompt's ids then its completion's, `target` true exactly on the
/// completion's tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct PreferencePair {
    pub chosen: Example,
    pub rejected: Example,
}

impl PreferencePair {
    /// The number of prompt tokens (the tokens before the first learned
    /// one), the same on both sides.
    pub fn prompt_len(&self) -> usize {
        let e = &self.chosen;
        e.target.iter().position(|&t| t).unwrap_or(e.ids.len())
    }

    /// Whether rows of `seq` tokens keep a completion token of the pair:
    /// TRL's filter (`len(prompt_ids) < max_length`), which drops a pair
    /// whose prompt alone fills the row.
    pub fn learns_within(&self, seq: usize) -> bool {
        self.prompt_len() < seq
    }
}

/// The fields that make a row a preference row.
const TEXT_FIELDS: [&str; 3] = ["prompt", "chosen", "rejected"];
pub(crate) const ID_FIELDS: [&str; 3] = ["prompt_ids", "chosen_ids", "rejected_ids"];

/// What a preference row is expected to hold.
const EXPECTED: &str = "expected a preference row: {\"prompt\", \"chosen\", \"rejected\"} (strings or message lists; without \"prompt\" the shared start is the prompt) or {\"prompt_ids\", \"chosen_ids\", \"rejected_ids\"}";

/// Whether a row (a JSONL line's object or a Parquet row as JSON) is a
/// preference row: it has `chosen`, `rejected`, `chosen_ids` or
/// `rejected_ids` (not null).
pub fn is_preference_row(row: &Value) -> bool {
    row.as_object().is_some_and(|obj| {
        ["chosen", "rejected", "chosen_ids", "rejected_ids"]
            .iter()
            .any(|k| obj.get(*k).is_some_and(|v| !v.is_null()))
    })
}

/// The first row of a data path (a file, or a folder's first data file),
/// as JSON; None when that file holds no rows. For telling the data's
/// shape (SFT rows or preference pairs) before reading it all.
pub fn first_row(path: &Path) -> Result<Option<Value>, DataError> {
    let files = data_files(path)?;
    let mut first = None;
    if let Some(file) = files.first() {
        visit_rows(file, &mut |row| {
            first = Some(row.clone());
            Ok(false)
        })?;
    }
    Ok(first)
}

/// Whether the first row of a data path is a preference row (see
/// [`is_preference_row`]); false for an empty file.
pub fn is_preference_data(path: &Path) -> Result<bool, DataError> {
    Ok(first_row(path)?.is_some_and(|row| is_preference_row(&row)))
}

/// The `eos_token` text of a tokenizer folder's `tokenizer_config.json`
/// (a string or an AddedToken object): what TRL appends to string
/// completions. None when the file names none.
pub fn eos_token_text(dir: &Path) -> Result<Option<String>, DataError> {
    special_token_text(dir, "eos_token")
}

/// The text of special token `key` (`eos_token`, `pad_token`, ...) in a
/// tokenizer folder's `tokenizer_config.json` (a string or an AddedToken
/// object); None when the file names none.
pub fn special_token_text(dir: &Path, key: &str) -> Result<Option<String>, DataError> {
    let path = dir.join("tokenizer_config.json");
    let text = std::fs::read_to_string(&path).map_err(|cause| DataError::Read {
        path: path.clone(),
        cause,
    })?;
    let config: Value =
        serde_json::from_str(&text).map_err(|cause| DataError::Json { path, cause })?;
    let text = match config.get(key) {
        Some(Value::String(s)) => Some(s.as_str()),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str),
        _ => None,
    };
    Ok(text.filter(|t| !t.is_empty()).map(String::from))
}

/// A field of a text row: a string or a message list.
#[derive(Clone)]
pub(crate) enum Part {
    Text(String),
    Messages(Vec<Message>),
}

impl Part {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Part::Text(_) => "a string",
            Part::Messages(_) => "a message list",
        }
    }
}

/// `obj[key]` as a string or a non-empty message list.
pub(crate) fn part(obj: &Map<String, Value>, key: &str) -> Result<Part, String> {
    match obj.get(key).unwrap_or(&Value::Null) {
        Value::String(s) => Ok(Part::Text(s.clone())),
        Value::Array(list) if list.is_empty() => Err(format!("`{key}` is an empty list")),
        Value::Array(list) => list
            .iter()
            .enumerate()
            .map(|(i, m)| {
                serde_json::from_value(m.clone()).map_err(|e| {
                    format!(
                        "`{key}[{i}]` is not a message ({{\"role\", \"content\"}} strings): {e}"
                    )
                })
            })
            .collect::<Result<Vec<Message>, _>>()
            .and_then(|m| crate::chat::check_roles(&m, key).map(|_| Part::Messages(m))),
        other => Err(format!(
            "`{key}` is {}, not a string or a message list",
            json_kind(other)
        )),
    }
}

/// What kind of JSON value `v` is, for messages.
fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// How string completions end: the tokenizer's EOS text (TRL's way), or
/// where the tokenizer has no text for it, its id after tokenizing.
#[derive(Clone, Copy)]
pub(crate) enum Eos<'a> {
    Text(&'a str),
    Id(u32),
    None,
}

/// A row's fields that are not null (a null field is an absent one: a
/// Parquet table of rows of several shapes has every column).
pub(crate) fn present_fields(row: &Value) -> Result<Map<String, Value>, String> {
    Ok(row
        .as_object()
        .ok_or("not a JSON object")?
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect())
}

impl Reader<'_> {
    /// What ends a string completion: `eos_token` (the tokenizer's EOS
    /// text), else the EOS id, else nothing.
    pub(crate) fn eos_of<'a>(&self, eos_token: Option<&'a str>) -> Eos<'a> {
        match (eos_token, self.eos) {
            (Some(t), _) => Eos::Text(t),
            (None, Some(id)) => Eos::Id(id),
            (None, None) => Eos::None,
        }
    }
}

impl Reader<'_> {
    /// Reads preference pairs from a data file or a folder of them
    /// (Parquet or JSONL, as [`Reader::read_path`]); a bad row is an
    /// error naming the file and the line or row. `eos_token` is the
    /// tokenizer's EOS text (see [`eos_token_text`]), appended to string
    /// completions as TRL appends it; None appends the reader's `eos` id
    /// after tokenizing instead (for the byte tokenizer, whose EOS has no
    /// text).
    pub fn read_pairs(
        &self,
        path: &Path,
        eos_token: Option<&str>,
    ) -> Result<Vec<PreferencePair>, DataError> {
        collect_path(path, |row| self.parse_pair_row(row, eos_token))
    }

    /// Reads one preference row (a JSONL line's object, or a Parquet row
    /// as JSON) in any of the three shapes of [`crate::pairs`]; a null
    /// field is an absent one (a Parquet table of mixed rows). Ambiguous
    /// or broken rows are refused naming the field.
    pub(crate) fn parse_pair_row(
        &self,
        row: &Value,
        eos_token: Option<&str>,
    ) -> Result<PreferencePair, String> {
        let obj = present_fields(row)?;
        let text = TEXT_FIELDS.iter().find(|k| obj.contains_key(**k));
        let ids = ID_FIELDS.iter().find(|k| obj.contains_key(**k));
        let pair = match (text, ids) {
            (Some(t), Some(i)) => {
                return Err(format!(
                    "holds both `{t}` and `{i}`: a pair is text or token ids, not both (drop one)"
                ))
            }
            (None, None) => return Err(EXPECTED.into()),
            (None, Some(_)) => self.id_pair(&obj)?,
            (Some(_), None) => {
                for key in ["chosen", "rejected"] {
                    if !obj.contains_key(key) {
                        return Err(format!("no `{key}`: {EXPECTED}"));
                    }
                }
                let eos = self.eos_of(eos_token);
                self.text_pair(&obj, eos)?
            }
        };
        self.check_pair(&pair)?;
        Ok(pair)
    }

    /// A pre-tokenized pair: `prompt_ids + chosen_ids` and `prompt_ids +
    /// rejected_ids`, nothing added.
    fn id_pair(&self, obj: &Map<String, Value>) -> Result<PreferencePair, String> {
        let field = |key: &str| match obj.get(key) {
            Some(v) => id_list(v, key),
            None => Err(format!(
                "no `{key}`: pre-tokenized pairs have prompt_ids, chosen_ids and rejected_ids"
            )),
        };
        let prompt = field("prompt_ids")?;
        let side = |key: &str| -> Result<Example, String> {
            let completion = field(key)?;
            if completion.is_empty() {
                return Err(format!("`{key}` is empty: nothing to learn"));
            }
            Ok(join(&prompt, &completion))
        };
        Ok(PreferencePair {
            chosen: side("chosen_ids")?,
            rejected: side("rejected_ids")?,
        })
    }

    /// A pair of strings or of conversations, with an explicit prompt or
    /// the shared start as the prompt.
    fn text_pair(&self, obj: &Map<String, Value>, eos: Eos) -> Result<PreferencePair, String> {
        let chosen = part(obj, "chosen")?;
        let rejected = part(obj, "rejected")?;
        let prompt = match obj.contains_key("prompt") {
            true => Some(part(obj, "prompt")?),
            false => None,
        };
        // One kind throughout: TRL decides string or conversation from one
        // field it happens to pick, so a mixed row is read by chance.
        let first = prompt
            .as_ref()
            .map_or(("chosen", &chosen), |p| ("prompt", p));
        for (key, p) in [("chosen", &chosen), ("rejected", &rejected)] {
            if p.kind() != first.1.kind() {
                return Err(format!(
                    "`{}` is {} but `{key}` is {}: a pair's fields are all strings or all message lists{}",
                    first.0,
                    first.1.kind(),
                    p.kind(),
                    if first.0 == "prompt" {
                        " (drop `prompt` to take the shared leading messages as the prompt)"
                    } else {
                        ""
                    }
                ));
            }
        }
        match (prompt, chosen, rejected) {
            (None, Part::Text(c), Part::Text(r)) => {
                let (p, c, r) = split_text(&c, &r)?;
                self.string_pair(&p, &c, &r, eos)
            }
            (Some(Part::Text(p)), Part::Text(c), Part::Text(r)) => {
                for (key, s) in [("chosen", &c), ("rejected", &r)] {
                    if s.is_empty() {
                        return Err(format!("`{key}` is empty: nothing to learn"));
                    }
                }
                self.string_pair(&p, &c, &r, eos)
            }
            (None, Part::Messages(c), Part::Messages(r)) => {
                let (p, c, r) = split_messages(c, r)?;
                self.conversation_pair(p, c, r)
            }
            (Some(Part::Messages(p)), Part::Messages(c), Part::Messages(r)) => {
                self.conversation_pair(p, c, r)
            }
            _ => Err("a pair's fields are all strings or all message lists".into()),
        }
    }

    /// A string pair as TRL tokenizes it (see [`Reader::string_sequences`]).
    fn string_pair(
        &self,
        prompt: &str,
        chosen: &str,
        rejected: &str,
        eos: Eos,
    ) -> Result<PreferencePair, String> {
        let (p, mut seqs) = self.string_sequences(prompt, &[chosen, rejected], eos)?;
        let rejected = seqs.pop().unwrap_or_default();
        let chosen = seqs.pop().unwrap_or_default();
        split_at_prompt(&p, chosen, rejected)
    }

    /// The tokenized prompt and each prompt + completion as TRL tokenizes
    /// string rows: EOS appended to each completion unless it ends with
    /// it, then the prompt and each prompt + completion tokenized with
    /// special tokens.
    pub(crate) fn string_sequences(
        &self,
        prompt: &str,
        completions: &[&str],
        eos: Eos,
    ) -> Result<(Vec<u32>, Vec<Vec<u32>>), String> {
        let t = self.tokenizer()?;
        let limit = self.char_limit();
        let prompt = cut_text(prompt, limit);
        let encode = |text: &str| t.encode(text, true).map_err(|e| e.to_string());
        let sequence = |completion: &&str| -> Result<Vec<u32>, String> {
            let completion = cut_text(completion, limit);
            Ok(match eos {
                Eos::Text(e) if !completion.ends_with(e) => {
                    encode(&format!("{prompt}{completion}{e}"))?
                }
                Eos::Id(id) => {
                    let mut ids = encode(&format!("{prompt}{completion}"))?;
                    if ids.last() != Some(&id) {
                        ids.push(id);
                    }
                    ids
                }
                _ => encode(&format!("{prompt}{completion}"))?,
            })
        };
        let seqs = completions.iter().map(sequence).collect::<Result<_, _>>()?;
        Ok((encode(prompt)?, seqs))
    }

    /// A conversation pair as TRL tokenizes it (see
    /// [`Reader::conversation_sequences`]).
    fn conversation_pair(
        &self,
        prompt: Vec<Message>,
        chosen: Vec<Message>,
        rejected: Vec<Message>,
    ) -> Result<PreferencePair, String> {
        let (p, mut seqs) = self.conversation_sequences(prompt, vec![chosen, rejected])?;
        let rejected = seqs.pop().unwrap_or_default();
        let chosen = seqs.pop().unwrap_or_default();
        split_at_prompt(&p, chosen, rejected)
    }

    /// The tokenized prompt and each prompt + completion as TRL tokenizes
    /// conversations: the prompt rendered with the generation prompt,
    /// each prompt + completion without, each tokenized without special
    /// tokens. Only the chat data's template is used: everything after
    /// the prompt is learned, as TRL learns it (its `stop` and
    /// `train_on_inputs` are SFT's).
    pub(crate) fn conversation_sequences(
        &self,
        mut prompt: Vec<Message>,
        mut completions: Vec<Vec<Message>>,
    ) -> Result<(Vec<u32>, Vec<Vec<u32>>), String> {
        let chat = self.chat.ok_or(
            "message lists need the model's chat template: a checkpoint whose tokenizer_config.json has one, or --chat-template DIR",
        )?;
        let t = self.tokenizer()?;
        let limit = self.char_limit();
        for m in prompt.iter_mut().chain(completions.iter_mut().flatten()) {
            m.content = cut_text(&m.content, limit).to_string();
        }
        let tokens = |messages: &[Message], generation: bool| -> Result<Vec<u32>, String> {
            let text = chat
                .template
                .render(messages, generation)
                .map_err(|e| e.to_string())?;
            t.encode(&text, false).map_err(|e| e.to_string())
        };
        let whole = |completion: Vec<Message>| {
            let mut all = prompt.clone();
            all.extend(completion);
            tokens(&all, false)
        };
        let seqs = completions
            .into_iter()
            .map(whole)
            .collect::<Result<_, _>>()?;
        Ok((tokens(&prompt, true)?, seqs))
    }

    /// Refuses a pair a step cannot use: a side of fewer than two tokens
    /// or with no learned token, or an id outside the vocabulary.
    fn check_pair(&self, pair: &PreferencePair) -> Result<(), String> {
        for (key, e) in [("chosen", &pair.chosen), ("rejected", &pair.rejected)] {
            if e.ids.len() < 2 {
                return Err(format!(
                    "`{key}` with its prompt is fewer than two tokens: nothing to predict"
                ));
            }
            if !e.target.iter().any(|&t| t) {
                return Err(format!("`{key}` adds no tokens after the prompt"));
            }
            if let Some(bad) = e.ids.iter().find(|&&t| t as i64 >= self.vocab) {
                return Err(format!(
                    "`{key}`: token id {bad} is outside the vocabulary (size {})",
                    self.vocab
                ));
            }
        }
        Ok(())
    }
}

/// `prompt` then `completion`, the completion learned.
pub(crate) fn join(prompt: &[u32], completion: &[u32]) -> Example {
    Example {
        ids: prompt.iter().chain(completion).copied().collect(),
        target: prompt
            .iter()
            .map(|_| false)
            .chain(completion.iter().map(|_| true))
            .collect(),
    }
}

/// The pair of two tokenized sequences and their tokenized prompt: the
/// prompt is as many leading tokens as the prompt's ids share with both
/// sequences (TRL's `common_prefix_length`), each completion the rest of
/// its sequence.
fn split_at_prompt(
    prompt: &[u32],
    chosen: Vec<u32>,
    rejected: Vec<u32>,
) -> Result<PreferencePair, String> {
    let shared = |seq: &[u32]| prompt.iter().zip(seq).take_while(|(a, b)| a == b).count();
    let n = shared(&chosen).min(shared(&rejected));
    let side = |ids: Vec<u32>| {
        let target = (0..ids.len()).map(|i| i >= n).collect();
        Example { ids, target }
    };
    Ok(PreferencePair {
        chosen: side(chosen),
        rejected: side(rejected),
    })
}

/// Where TRL's `extract_prompt` splits `chosen` and `rejected`: at the
/// first position where they differ, or, when the shorter ends first,
/// one position before its end.
fn split_index<T: PartialEq>(chosen: &[T], rejected: &[T]) -> Option<usize> {
    let n = chosen.len().min(rejected.len());
    if n == 0 {
        return None;
    }
    Some((0..n).find(|&i| chosen[i] != rejected[i]).unwrap_or(n - 1))
}

/// A string pair without `prompt` split as TRL's `extract_prompt` splits
/// it (by characters; a space before the split goes to the completions).
pub(crate) fn split_text(chosen: &str, rejected: &str) -> Result<(String, String, String), String> {
    let c: Vec<char> = chosen.chars().collect();
    let r: Vec<char> = rejected.chars().collect();
    for (key, s) in [("chosen", &c), ("rejected", &r)] {
        if s.is_empty() {
            return Err(format!("`{key}` is empty: nothing to learn"));
        }
    }
    let mut at = split_index(&c, &r).unwrap_or(0);
    let differs = c.get(at) != r.get(at);
    if differs && at == 0 && c.last() == Some(&' ') {
        // TRL looks at `chosen[-1]` here and splits one character from
        // the end: a prompt of nearly all of `chosen`.
        return Err(
            "`chosen` and `rejected` share no leading text and `chosen` ends with a space, which TRL 1.16's extract_prompt misreads: give `prompt`"
                .into(),
        );
    }
    if differs && at > 0 && c[at - 1] == ' ' {
        at -= 1;
    }
    let text = |s: &[char]| s.iter().collect::<String>();
    Ok((text(&c[..at]), text(&c[at..]), text(&r[at..])))
}

/// A conversation's prompt, chosen and rejected messages.
pub(crate) type Split = (Vec<Message>, Vec<Message>, Vec<Message>);

/// A conversation pair without `prompt` split as TRL's `extract_prompt`
/// splits it: the shared leading messages are the prompt.
pub(crate) fn split_messages(
    mut chosen: Vec<Message>,
    mut rejected: Vec<Message>,
) -> Result<Split, String> {
    let at = split_index(&chosen, &rejected).unwrap_or(0);
    if at == 0 {
        return Err(
            "`chosen` and `rejected` share no leading messages, so there is no prompt: give `prompt`"
                .into(),
        );
    }
    let chosen_rest = chosen.split_off(at);
    let rejected_rest = rejected.split_off(at);
    Ok((chosen, chosen_rest, rejected_rest))
}

/// The bundled preference task, the demo task's pairs: a lowercase word,
/// the prompt `word=`, the chosen completion the word in capitals, the
/// rejected one the word echoed as it was (same length, so neither side
/// is favoured by length). `eos` ends both completions.
pub fn demo_pairs(
    tokenizer: &crate::Tokenizer,
    eos: Option<u32>,
    count: usize,
    seed: u64,
) -> Vec<PreferencePair> {
    let mut rng = hlo_ir::rng::Rng::new(seed ^ 0x5eed_9a12);
    (0..count)
        .map(|_| {
            let word = crate::reader::demo_word(&mut rng);
            // The prompt with the tokenizer's BOS, as the demo's SFT rows.
            let encode = |t: &str, special| tokenizer.encode(t, special).unwrap_or_default();
            let prompt = encode(&format!("{word}="), true);
            let side = |c: &str| {
                let mut completion = encode(c, false);
                completion.extend(eos);
                join(&prompt, &completion)
            };
            PreferencePair {
                chosen: side(&word.to_uppercase()),
                rejected: side(&word),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::ChatTemplate;
    use crate::reader::ChatData;
    use crate::tokenizer::{Tokenizer, BYTE_BOS, BYTE_EOS, BYTE_VOCAB};
    use serde_json::json;

    /// A template whose turns are `[role]content|`, and whose generation
    /// prompt is `[assistant]` then `gen`.
    fn template(gen: &str) -> ChatTemplate {
        ChatTemplate {
            source: format!(
                "{{% for m in messages %}}[{{{{ m.role }}}}]{{{{ m.content }}}}|{{% endfor %}}{{% if add_generation_prompt %}}[assistant]{gen}{{% endif %}}"
            ),
            bos_token: String::new(),
            eos_token: String::new(),
        }
    }

    fn reader<'a>(t: &'a Tokenizer, chat: Option<&'a ChatData<'a>>) -> Reader<'a> {
        Reader {
            tokenizer: Some(t),
            eos: Some(BYTE_EOS),
            vocab: BYTE_VOCAB,
            chat,
            max_tokens: None,
        }
    }

    fn bytes(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    /// An example of `prompt` ids then `completion` ids, the latter learned.
    fn ex(prompt: &[u32], completion: &[u32]) -> Example {
        join(prompt, completion)
    }

    fn pair(r: &Reader, row: Value) -> Result<PreferencePair, String> {
        r.parse_pair_row(&row, None)
    }

    #[test]
    fn string_pairs_get_bos_on_the_prompt_and_eos_on_each_completion() {
        let t = Tokenizer::bytes();
        let r = reader(&t, None);
        let got = pair(&r, json!({"prompt": "ab", "chosen": "c", "rejected": "de"})).unwrap();
        let p = [BYTE_BOS, 97, 98];
        assert_eq!(got.chosen, ex(&p, &[99, BYTE_EOS]));
        assert_eq!(got.rejected, ex(&p, &[100, 101, BYTE_EOS]));
        assert_eq!(got.chosen.target, [false, false, false, true, true]);
        assert_eq!(got.prompt_len(), 3);
        assert!(got.learns_within(4) && !got.learns_within(3));
        // An empty prompt string is TRL's too: the prompt is BOS alone.
        let got = pair(&r, json!({"prompt": "", "chosen": "c", "rejected": "d"})).unwrap();
        assert_eq!(got.chosen, ex(&[BYTE_BOS], &[99, BYTE_EOS]));
    }

    #[test]
    fn string_eos_text_is_appended_unless_the_completion_ends_with_it() {
        let t = Tokenizer::bytes();
        let r = reader(&t, None);
        let row = json!({"prompt": "a", "chosen": "b", "rejected": "c</s>"});
        let got = r.parse_pair_row(&row, Some("</s>")).unwrap();
        assert_eq!(got.chosen, ex(&[BYTE_BOS, 97], &bytes("b</s>")));
        assert_eq!(got.rejected, ex(&[BYTE_BOS, 97], &bytes("c</s>")));
        // The id form: not appended twice either.
        let got = pair(&r, json!({"prompt": "a", "chosen": "b", "rejected": "c"})).unwrap();
        assert_eq!(got.chosen, ex(&[BYTE_BOS, 97], &[98, BYTE_EOS]));
        // No EOS at all: nothing appended.
        let r = Reader { eos: None, ..r };
        let got = pair(&r, json!({"prompt": "a", "chosen": "b", "rejected": "c"})).unwrap();
        assert_eq!(got.chosen, ex(&[BYTE_BOS, 97], &[98]));
    }

    /// The fixture BPE tokenizer: `t` + `he` merge into one token, and
    /// `<|end_of_text|>` (id 1) is a special token matched in text.
    #[test]
    fn tokens_that_merge_across_the_boundary_belong_to_the_completion() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/tokenizer/tokenizer.json");
        let t = Tokenizer::from_file(&path).unwrap();
        let one = |s: &str| {
            let ids = t.encode(s, false).unwrap();
            assert_eq!(ids.len(), 1, "{s}");
            ids[0]
        };
        let (the, tk, x) = (one("the"), one("t"), one("x"));
        let r = Reader {
            vocab: t.vocab_size() as i64,
            ..reader(&t, None)
        };
        let row = json!({"prompt": "t", "chosen": "he", "rejected": "x"});
        let got = r.parse_pair_row(&row, Some("<|end_of_text|>")).unwrap();
        // The prompt's ids are [BOS, t]; prompt + chosen is [BOS, the]:
        // the prompt is what both share, [BOS].
        assert_eq!(got.chosen, ex(&[0], &[the, 1]));
        assert_eq!(got.rejected, ex(&[0], &[tk, x, 1]));
    }

    #[test]
    fn without_a_prompt_the_shared_leading_text_is_the_prompt() {
        let t = Tokenizer::bytes();
        let r = reader(&t, None);
        // Split at the first difference, the space before it going to
        // the completions.
        let got = pair(&r, json!({"chosen": "Sky? Blue", "rejected": "Sky? Green"})).unwrap();
        let p = [vec![BYTE_BOS], bytes("Sky?")].concat();
        assert_eq!(
            got.chosen,
            ex(&p, &[bytes(" Blue"), vec![BYTE_EOS]].concat())
        );
        assert_eq!(
            got.rejected,
            ex(&p, &[bytes(" Green"), vec![BYTE_EOS]].concat())
        );
        // One a prefix of the other: split one character before the
        // shorter one's end.
        let got = pair(&r, json!({"chosen": "abc", "rejected": "abcd"})).unwrap();
        assert_eq!(got.chosen, ex(&[BYTE_BOS, 97, 98], &[99, BYTE_EOS]));
        assert_eq!(got.rejected, ex(&[BYTE_BOS, 97, 98], &[99, 100, BYTE_EOS]));
        // Nothing shared: an empty prompt.
        let got = pair(&r, json!({"chosen": "x", "rejected": "y"})).unwrap();
        assert_eq!(got.chosen, ex(&[BYTE_BOS], &[120, BYTE_EOS]));
    }

    #[test]
    fn conversations_render_through_the_chat_template() {
        let t = Tokenizer::bytes();
        let template = template("");
        let chat = ChatData {
            template: &template,
            stop: vec![BYTE_EOS],
            train_on_inputs: true,
        };
        let r = reader(&t, Some(&chat));
        let user = json!({"role": "user", "content": "hi"});
        let reply = |c: &str| json!({"role": "assistant", "content": c});
        let explicit =
            json!({"prompt": [user], "chosen": [reply("yo")], "rejected": [reply("no!")]});
        let implicit = json!({"chosen": [user, reply("yo")], "rejected": [user, reply("no!")]});
        let p = bytes("[user]hi|[assistant]");
        let want = PreferencePair {
            chosen: ex(&p, &bytes("yo|")),
            rejected: ex(&p, &bytes("no!|")),
        };
        // No BOS or EOS added: the template writes what it writes, and
        // everything after the prompt is learned (train_on_inputs aside).
        assert_eq!(pair(&r, explicit).unwrap(), want);
        assert_eq!(pair(&r, implicit).unwrap(), want);
        // Several turns shared: all of them are the prompt; a completion
        // of several turns is learned whole.
        let row = json!({
            "chosen": [user, reply("a"), user, reply("b")],
            "rejected": [user, reply("a"), user, reply("c"), user, reply("d")],
        });
        let got = pair(&r, row).unwrap();
        let p = bytes("[user]hi|[assistant]a|[user]hi|[assistant]");
        assert_eq!(got.chosen, ex(&p, &bytes("b|")));
        assert_eq!(got.rejected, ex(&p, &bytes("c|[user]hi|[assistant]d|")));
    }

    #[test]
    fn a_prompt_rendered_differently_alone_ends_where_the_sequences_diverge() {
        // The generation prompt ends with `<t>`, which the whole
        // conversation does not render: the completion starts after
        // `[assistant]`.
        let t = Tokenizer::bytes();
        let template = template("<t>");
        let chat = ChatData {
            template: &template,
            stop: vec![],
            train_on_inputs: false,
        };
        let r = reader(&t, Some(&chat));
        let row = json!({
            "prompt": [{"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "yo"}],
            "rejected": [{"role": "assistant", "content": "<no"}],
        });
        let got = pair(&r, row).unwrap();
        let p = bytes("[user]hi|[assistant]");
        assert_eq!(got.chosen, ex(&p, &bytes("yo|")));
        // `<` is shared with the prompt alone, but not with chosen.
        assert_eq!(got.rejected, ex(&p, &bytes("<no|")));
    }

    #[test]
    fn pre_tokenized_pairs_are_used_as_given() {
        let t = Tokenizer::bytes();
        let r = reader(&t, None);
        let row = json!({"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]});
        let got = pair(&r, row).unwrap();
        assert_eq!(got.chosen, ex(&[1, 2, 3], &[4, 5]));
        assert_eq!(got.rejected, ex(&[1, 2, 3], &[6]));
        // No tokenizer needed; an empty prompt is allowed.
        let r = Reader {
            tokenizer: None,
            ..r
        };
        let got = pair(
            &r,
            json!({"prompt_ids": [], "chosen_ids": [4, 5], "rejected_ids": [6, 7]}),
        );
        assert_eq!(got.unwrap().rejected, ex(&[], &[6, 7]));
    }

    #[test]
    fn broken_and_ambiguous_rows_are_refused_naming_the_field() {
        let t = Tokenizer::bytes();
        let template = template("");
        let chat = ChatData {
            template: &template,
            stop: vec![],
            train_on_inputs: false,
        };
        let r = reader(&t, Some(&chat));
        let u = json!({"role": "user", "content": "hi"});
        let a = json!({"role": "assistant", "content": "yo"});
        for (row, want) in [
            (json!({"prompt": "a", "chosen": "b", "rejected": "c", "chosen_ids": [1]}), "holds both `prompt` and `chosen_ids`"),
            (json!({"prompt": "a", "chosen": "b"}), "no `rejected`"),
            (json!({"text": "a"}), "expected a preference row"),
            (json!([1, 2]), "not a JSON object"),
            (json!({"prompt": "a", "chosen": "", "rejected": "c"}), "`chosen` is empty"),
            (json!({"chosen": "", "rejected": "c"}), "`chosen` is empty"),
            (json!({"prompt": "a", "chosen": "b", "rejected": []}), "`rejected` is an empty list"),
            (json!({"prompt": "a", "chosen": "b", "rejected": [a]}), "`prompt` is a string but `rejected` is a message list"),
            (json!({"prompt": "q", "chosen": [u, a], "rejected": [u]}), "`prompt` is a string but `chosen` is a message list: a pair's fields are all strings or all message lists (drop `prompt`"),
            (json!({"chosen": [a], "rejected": "x"}), "`chosen` is a message list but `rejected` is a string"),
            (json!({"prompt": "a", "chosen": 5, "rejected": "c"}), "`chosen` is a number, not a string or a message list"),
            (json!({"prompt": [u], "chosen": ["yo"], "rejected": [a]}), "`chosen[0]` is not a message"),
            (json!({"chosen": [a], "rejected": [u]}), "share no leading messages"),
            (json!({"chosen": [u, a], "rejected": [u]}), "share no leading messages"),
            (json!({"chosen": "yes ", "rejected": "no"}), "ends with a space"),
            (json!({"prompt_ids": [1], "chosen_ids": [2]}), "no `rejected_ids`"),
            (json!({"prompt_ids": [1], "chosen_ids": [], "rejected_ids": [2]}), "`chosen_ids` is empty"),
            (json!({"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [-2]}), "rejected_ids[0] is -2: a token id is not negative"),
            (json!({"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [264]}), "`rejected`: token id 264 is outside the vocabulary (size 264)"),
            (json!({"prompt_ids": [], "chosen_ids": [2], "rejected_ids": [3, 4]}), "`chosen` with its prompt is fewer than two tokens"),
        ] {
            let err = pair(&r, row.clone()).unwrap_err();
            assert!(err.contains(want), "{row}: {err}");
        }
        let r = reader(&t, None);
        let err = pair(&r, json!({"prompt": [u], "chosen": [a], "rejected": [a]})).unwrap_err();
        assert!(err.contains("need the model's chat template"), "{err}");
    }

    #[test]
    fn preference_rows_and_files_are_told_apart() {
        assert!(is_preference_row(&json!({"chosen": "a", "rejected": "b"})));
        assert!(is_preference_row(
            &json!({"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]})
        ));
        assert!(!is_preference_row(
            &json!({"prompt": "a", "completion": "b"})
        ));
        assert!(!is_preference_row(&json!({"text": "a", "chosen": null})));
        let dir = std::env::temp_dir().join(format!("hlo-data-pairs-kind-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pairs = dir.join("pairs.jsonl");
        std::fs::write(
            &pairs,
            "\u{feff}\n{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\nnot json\n",
        )
        .unwrap();
        let sft = dir.join("sft.jsonl");
        std::fs::write(&sft, "{\"text\": \"a\"}\n").unwrap();
        assert!(is_preference_data(&pairs).unwrap());
        assert!(!is_preference_data(&sft).unwrap());
        // The whole file is read, and its bad line named.
        let t = Tokenizer::bytes();
        let err = reader(&t, None)
            .read_pairs(&pairs, None)
            .unwrap_err()
            .to_string();
        assert!(
            err.ends_with("pairs.jsonl:3: not JSON: expected ident at line 1 column 2"),
            "{err}"
        );
        std::fs::write(&pairs, "{\"prompt\": \"a\", \"chosen\": \"b\"}\n").unwrap();
        let err = reader(&t, None)
            .read_pairs(&pairs, None)
            .unwrap_err()
            .to_string();
        assert!(err.ends_with("pairs.jsonl:1: no `rejected`: expected a preference row: {\"prompt\", \"chosen\", \"rejected\"} (strings or message lists; without \"prompt\" the shared start is the prompt) or {\"prompt_ids\", \"chosen_ids\", \"rejected_ids\"}"), "{err}");
        std::fs::write(&pairs, "\n").unwrap();
        assert!(!is_preference_data(&pairs).unwrap());
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn eos_token_text_is_read_from_the_tokenizer_config() {
        let dir = std::env::temp_dir().join(format!("hlo-data-pairs-eos-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("tokenizer_config.json");
        for (text, want) in [
            (r#"{"eos_token": "</s>"}"#, Some("</s>")),
            (
                r#"{"eos_token": {"content": "<|eot_id|>", "special": true}}"#,
                Some("<|eot_id|>"),
            ),
            (r#"{"eos_token": null}"#, None),
            ("{}", None),
        ] {
            std::fs::write(&config, text).unwrap();
            assert_eq!(eos_token_text(&dir).unwrap().as_deref(), want, "{text}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A Parquet file of two conversational rows as `datasets` writes a
    /// table of mixed rows: `chosen`/`rejected` message lists, and
    /// `prompt`, `prompt_ids`, `chosen_ids`, `rejected_ids` columns that
    /// are null in both rows (so the shared leading messages are the
    /// prompt).
    fn write_parquet(path: &Path) {
        use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
        use parquet::file::properties::WriterProperties;
        use parquet::file::writer::SerializedFileWriter;
        use parquet::schema::parser::parse_message_type;
        let messages = |name: &str| {
            format!("required group {name} (LIST) {{ repeated group list {{ required group element {{ required binary role (UTF8); required binary content (UTF8); }} }} }}")
        };
        let ids = |name: &str| {
            format!("optional group {name} (LIST) {{ repeated group list {{ required int64 element; }} }}")
        };
        let schema = format!(
            "message pairs {{ optional binary prompt (UTF8); {} {} {} {} {} }}",
            messages("chosen"),
            messages("rejected"),
            ids("prompt_ids"),
            ids("chosen_ids"),
            ids("rejected_ids"),
        );
        let schema = parse_message_type(&schema).unwrap();
        let file = std::fs::File::create(path).unwrap();
        let props = std::sync::Arc::new(WriterProperties::builder().build());
        let mut writer = SerializedFileWriter::new(file, schema.into(), props).unwrap();
        let mut group = writer.next_row_group().unwrap();
        let strings = |v: &[&str]| v.iter().map(|s| ByteArray::from(*s)).collect::<Vec<_>>();
        let mut column = |write: &mut dyn FnMut(&mut parquet::column::writer::ColumnWriter)| {
            let mut c = group.next_column().unwrap().unwrap();
            write(c.untyped());
            c.close().unwrap();
        };
        // prompt: null in both rows (the implicit prompt is used).
        column(&mut |c| {
            let w = parquet::column::writer::get_typed_column_writer_mut::<ByteArrayType>(c);
            w.write_batch(&[], Some(&[0, 0]), None).unwrap();
        });
        // chosen and rejected: role, then content, each with one list
        // entry per message (repetition 0 opens a row).
        let convs: [[&[&str]; 2]; 2] = [
            [
                &["user", "hi", "assistant", "yo"],
                &["user", "hi", "assistant", "no"],
            ],
            [
                &["user", "ok", "assistant", "a"],
                &["user", "ok", "assistant", "bc"],
            ],
        ];
        for side in 0..2 {
            for field in 0..2 {
                let values: Vec<&str> = convs
                    .iter()
                    .flat_map(|row| row[side].iter().skip(field).step_by(2).copied())
                    .collect();
                column(&mut |c| {
                    let w =
                        parquet::column::writer::get_typed_column_writer_mut::<ByteArrayType>(c);
                    w.write_batch(&strings(&values), Some(&[1, 1, 1, 1]), Some(&[0, 1, 0, 1]))
                        .unwrap();
                });
            }
        }
        // The id columns: null in both rows.
        for _ in 0..3 {
            column(&mut |c| {
                let w = parquet::column::writer::get_typed_column_writer_mut::<Int64Type>(c);
                w.write_batch(&[], Some(&[0, 0]), Some(&[0, 0])).unwrap();
            });
        }
        group.close().unwrap();
        writer.close().unwrap();
    }

    #[test]
    fn parquet_rows_read_as_the_same_rows_in_jsonl() {
        let dir =
            std::env::temp_dir().join(format!("hlo-data-pairs-parquet-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let parquet = dir.join("pairs.parquet");
        write_parquet(&parquet);
        let m = |role: &str, content: &str| json!({"role": role, "content": content});
        let jsonl = dir.join("pairs.jsonl");
        let lines = [
            json!({"chosen": [m("user", "hi"), m("assistant", "yo")], "rejected": [m("user", "hi"), m("assistant", "no")]}),
            json!({"chosen": [m("user", "ok"), m("assistant", "a")], "rejected": [m("user", "ok"), m("assistant", "bc")]}),
        ];
        std::fs::write(&jsonl, lines.map(|l| l.to_string()).join("\n")).unwrap();
        let t = Tokenizer::bytes();
        let template = template("");
        let chat = ChatData {
            template: &template,
            stop: vec![],
            train_on_inputs: false,
        };
        let r = reader(&t, Some(&chat));
        let got = r.read_pairs(&parquet, None).unwrap();
        assert_eq!(got, r.read_pairs(&jsonl, None).unwrap());
        let p = bytes("[user]ok|[assistant]");
        assert_eq!(got[1].chosen, ex(&p, &bytes("a|")));
        assert_eq!(got[1].rejected, ex(&p, &bytes("bc|")));
        assert!(is_preference_data(&parquet).unwrap());
        assert_eq!(
            first_row(&parquet).unwrap().unwrap()["chosen"][1],
            m("assistant", "yo")
        );
        // A folder reads its files in name order.
        assert_eq!(r.read_pairs(&dir, None).unwrap().len(), 4);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_demo_pairs_prefer_the_word_in_capitals_over_the_word_echoed() {
        let t = crate::Tokenizer::bytes();
        let pairs = demo_pairs(&t, Some(crate::tokenizer::BYTE_EOS), 50, 3);
        assert_eq!(pairs.len(), 50);
        for p in &pairs {
            let n = p.prompt_len();
            let text = |e: &Example| -> Vec<u8> {
                e.ids[n..e.ids.len() - 1].iter().map(|&i| i as u8).collect()
            };
            // BOS, the word, `=`.
            let word: Vec<u8> = p.chosen.ids[1..n - 1].iter().map(|&i| i as u8).collect();
            assert_eq!(text(&p.chosen), word.to_ascii_uppercase());
            assert_eq!(text(&p.rejected), word);
            assert_eq!(p.rejected.ids[..n], p.chosen.ids[..n]);
            assert_eq!(*p.chosen.ids.last().unwrap(), crate::tokenizer::BYTE_EOS);
        }
        assert_eq!(demo_pairs(&t, None, 5, 3), demo_pairs(&t, None, 5, 3));
    }
}
