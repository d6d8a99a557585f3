//! Training examples from JSONL lines: `{"text"}`, `{"prompt",
//! "completion"}` (loss on the completion), `{"messages"}` (rendered with
//! the chat template, loss on the assistant's replies), `{"input_ids"}`
//! (with optional HF `labels`, `-100` = not learned), each tokenized into
//! ids with a per-token target flag; the bundled demo task; and what a
//! data set holds (samples, tokens, learned tokens, cut samples).
//!
//! Files are read as `datasets` and pandas read JSONL: a UTF-8 byte-order
//! mark, CRLF line ends and blank lines are accepted. Text is cut (by
//! characters, with a wide margin) to what the row length can use before
//! it is tokenized, so one enormous line costs little memory.

use std::io::BufRead;
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

impl Example {
    /// Whether a row of `seq` tokens keeps at least one learned token of
    /// this example (the first token is never predicted).
    pub fn learns_within(&self, seq: usize) -> bool {
        self.target
            .iter()
            .take(seq.min(self.ids.len()))
            .skip(1)
            .any(|&t| t)
    }

    /// The predictions a row holding this example's first `len` tokens
    /// counts: its learned tokens among them, the first never predicted.
    pub(crate) fn learned_within(&self, len: usize) -> usize {
        let end = len.min(self.target.len());
        self.target[..end].iter().skip(1).filter(|&&t| t).count()
    }
}

/// How `{"messages"}` lines become examples.
pub struct ChatData<'a> {
    /// The model's chat template.
    pub template: &'a ChatTemplate,
    /// The end-of-turn tokens (the model's EOS ids): an assistant reply is
    /// learned up to and including the first of them, and one is appended
    /// when the template emits none.
    pub stop: Vec<u32>,
    /// Count every token in the loss, not only the assistant's.
    pub train_on_inputs: bool,
}

/// Characters kept of a text field per token of the row: far more than a
/// token spans in practice, so cutting never changes the row.
const CHARS_PER_TOKEN_MARGIN: usize = 32;

/// How lines are read: the tokenizer, the end-of-sequence id appended to
/// text, the vocabulary every id must fit, the chat template for
/// `messages`, and the row length (text beyond what it can use is cut
/// before tokenizing).
pub struct Reader<'a> {
    pub tokenizer: Option<&'a Tokenizer>,
    pub eos: Option<u32>,
    pub vocab: i64,
    pub chat: Option<&'a ChatData<'a>>,
    pub max_tokens: Option<usize>,
}

/// What a data set holds for rows of some length.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DataStats {
    pub samples: usize,
    /// Tokens in all samples (before cutting).
    pub tokens: usize,
    /// Learned tokens within the row length (what the loss counts).
    pub learned: usize,
    /// Samples longer than a row (cut).
    pub cut: usize,
    /// Samples with no learned token within a row: they teach nothing.
    pub no_signal: usize,
}

/// The statistics of `examples` for rows of `seq` tokens.
pub fn stats(examples: &[Example], seq: usize) -> DataStats {
    let mut s = DataStats {
        samples: examples.len(),
        ..DataStats::default()
    };
    for e in examples {
        s.tokens += e.ids.len();
        let kept = e.ids.len().min(seq);
        s.learned += e.learned_within(kept);
        s.cut += usize::from(e.ids.len() > seq);
        s.no_signal += usize::from(!e.learns_within(seq));
    }
    s
}

/// `text` cut to `limit` characters (at a character boundary).
pub(crate) fn cut_text(text: &str, limit: Option<usize>) -> &str {
    match limit.and_then(|n| text.char_indices().nth(n)) {
        Some((at, _)) => &text[..at],
        None => text,
    }
}

/// Marks where an assistant's reply goes when a template cannot render
/// the conversation before it (a conversation that opens with a reply).
const REPLY_MARK: &str = "\u{e000}hlo-train-reply\u{e000}";

impl Reader<'_> {
    /// Characters of a text field worth tokenizing.
    pub(crate) fn char_limit(&self) -> Option<usize> {
        self.max_tokens
            .map(|n| n.saturating_mul(CHARS_PER_TOKEN_MARGIN).max(1024))
    }

    pub(crate) fn tokenizer(&self) -> Result<&Tokenizer, String> {
        self.tokenizer
            .ok_or_else(|| "text needs a tokenizer (--tokenizer FILE), or give input_ids".into())
    }

    /// Parses one JSONL line.
    pub fn parse_line(&self, line: &str) -> Result<Example, String> {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        self.parse_row(&v)
    }

    /// Reads one row (a JSONL line's object, or a Parquet row as JSON):
    /// the four shapes of [`Reader`], plus alpaca rows (`instruction`,
    /// `input`, `output`: read as the prompt and completion of
    /// [`alpaca_prompt`]) and sharegpt rows (`conversations` of `{"from",
    /// "value"}`: read as `messages`).
    pub(crate) fn parse_row(&self, row: &Value) -> Result<Example, String> {
        // A null field is an absent one: a table of rows of several shapes
        // (a Parquet file `datasets` made from mixed JSONL) has a column
        // for every field, null where a row lacks it.
        let without_nulls;
        let row = match row.as_object() {
            Some(obj) if obj.values().any(Value::is_null) => {
                without_nulls = Value::Object(
                    obj.iter()
                        .filter(|(_, v)| !v.is_null())
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                );
                &without_nulls
            }
            _ => row,
        };
        let converted;
        let row = match common_shape(row)? {
            Some(v) => {
                converted = v;
                &converted
            }
            None => row,
        };
        let obj = row.as_object().ok_or("not a JSON object")?;
        // Two shapes in one row: which one is meant cannot be guessed.
        let has = |k: &str| obj.get(k).is_some_and(|v| !v.is_null());
        let shapes: Vec<&str> = [
            ("text", has("text")),
            ("prompt/completion", has("prompt") || has("completion")),
            ("messages", has("messages")),
        ]
        .iter()
        .filter(|(_, h)| *h)
        .map(|(s, _)| *s)
        .collect();
        if shapes.len() > 1 && !has("input_ids") {
            return Err(format!(
                "holds both {} and {}: a row is one shape (drop the other column)",
                shapes[0], shapes[1]
            ));
        }
        let ex = self.example_of(obj)?;
        if ex.ids.len() < 2 {
            return Err("fewer than two tokens: nothing to predict".into());
        }
        if let Some(bad) = ex.ids.iter().find(|&&t| t as i64 >= self.vocab) {
            return Err(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.vocab
            ));
        }
        Ok(ex)
    }

    /// The example of a row of one shape (its nulls dropped, a common
    /// shape converted).
    fn example_of(&self, obj: &serde_json::Map<String, Value>) -> Result<Example, String> {
        let limit = self.char_limit();
        let with_eos = |mut ids: Vec<u32>| {
            if let Some(e) = self.eos {
                ids.push(e);
            }
            ids
        };
        let ex = if let Some(m) = obj.get("messages") {
            let chat = self.chat.ok_or(
                "messages lines need the model's chat template: a checkpoint whose tokenizer_config.json has one, or --chat-template DIR",
            )?;
            let mut messages: Vec<Message> =
                serde_json::from_value(m.clone()).map_err(|e| format!("messages: {e}"))?;
            crate::chat::check_roles(&messages, "messages")?;
            for m in &mut messages {
                m.content = cut_text(&m.content, limit).to_string();
            }
            self.chat_example(&messages, chat)?
        } else if let Some(ids) = obj.get("input_ids") {
            let ids = id_list(ids, "input_ids")?;
            let target = match obj.get("labels") {
                None => (0..ids.len()).map(|i| i > 0).collect(),
                Some(labels) => labels_target(&ids, labels)?,
            };
            Example { ids, target }
        } else if let (Some(p), Some(c)) = (obj.get("prompt"), obj.get("completion")) {
            let (p, c) = (
                p.as_str().ok_or("prompt is not a string")?,
                c.as_str().ok_or("completion is not a string")?,
            );
            let t = self.tokenizer()?;
            let prompt = t
                .encode(cut_text(p, limit), true)
                .map_err(|e| e.to_string())?;
            let completion = with_eos(
                t.encode(cut_text(c, limit), false)
                    .map_err(|e| e.to_string())?,
            );
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
            let ids = with_eos(
                self.tokenizer()?
                    .encode(cut_text(text, limit), true)
                    .map_err(|e| e.to_string())?,
            );
            let n = ids.len();
            Example {
                ids,
                target: (0..n).map(|i| i > 0).collect(),
            }
        } else {
            return Err(
                "expected {\"text\"}, {\"prompt\", \"completion\"}, {\"messages\"}, {\"input_ids\"}, alpaca's {\"instruction\", \"output\"} or sharegpt's {\"conversations\"}"
                    .into(),
            );
        };
        Ok(ex)
    }

    /// A conversation rendered with the chat template: the text is cut
    /// where each assistant reply starts and ends (rendering the
    /// conversation up to it with and without the reply), each piece
    /// tokenized on its own. A reply is learned up to and including its
    /// first end-of-turn token; what the template puts after that token
    /// (a separator, say) is not learned. Templates that render an earlier
    /// turn differently once later turns follow are cut by
    /// [`Reader::marked_pieces`] instead.
    fn chat_example(&self, messages: &[Message], chat: &ChatData) -> Result<Example, String> {
        if messages.is_empty() {
            return Err("messages is empty".into());
        }
        let tokenizer = self.tokenizer()?;
        let pieces = match Self::prefix_pieces(messages, chat)? {
            Some(pieces) => pieces,
            None => self.marked_pieces(messages, chat)?,
        };
        if !pieces.iter().any(|p| p.1) {
            return Err("no assistant turn to learn from".into());
        }
        let mut ids = Vec::new();
        let mut target = Vec::new();
        for (text, reply) in pieces {
            let t = tokenizer.encode(&text, false).map_err(|e| e.to_string())?;
            if !reply {
                target.extend(t.iter().map(|_| chat.train_on_inputs));
                ids.extend(t);
                continue;
            }
            // The reply with its end of turn: learned. A template that
            // emits none gets one, so the finetuned model learns to stop.
            let end = t.iter().position(|x| chat.stop.contains(x));
            let (learned, after) = match end {
                Some(k) => t.split_at(k + 1),
                None => (&t[..], &[][..]),
            };
            ids.extend_from_slice(learned);
            target.extend(learned.iter().map(|_| true));
            if end.is_none() {
                if let Some(e) = self.eos {
                    ids.push(e);
                    target.push(true);
                }
            }
            ids.extend_from_slice(after);
            target.extend(after.iter().map(|_| chat.train_on_inputs));
        }
        Ok(Example { ids, target })
    }

    /// The pieces of a conversation (text, is a reply) cut by rendering it
    /// up to each reply with the generation prompt and with the reply;
    /// None when the template does not render a conversation's prefix as
    /// a prefix of it.
    fn prefix_pieces(
        messages: &[Message],
        chat: &ChatData,
    ) -> Result<Option<Vec<(String, bool)>>, String> {
        let render = |upto: usize, generation: bool| {
            chat.template
                .render(&messages[..upto], generation)
                .map_err(|e| e.to_string())
        };
        // The text before reply `i`: the conversation so far with the
        // generation prompt; for a reply that opens the conversation,
        // where a marker put in its place lands.
        let before_reply = |i: usize| -> Result<String, String> {
            match render(i, true) {
                Ok(text) if i > 0 => Ok(text),
                first => {
                    let mut marked = messages[..=i].to_vec();
                    marked[i].content = REPLY_MARK.into();
                    let text = chat
                        .template
                        .render(&marked, false)
                        .map_err(|e| e.to_string())?;
                    match text.find(REPLY_MARK) {
                        Some(at) => Ok(text[..at].to_string()),
                        None => first.map_err(|e| {
                            format!("the chat template cannot render the text before a reply: {e}")
                        }),
                    }
                }
            }
        };
        let mut pieces: Vec<(String, bool)> = Vec::new();
        let mut done = String::new();
        // Appends what `text` adds to the text so far; false when it does
        // not extend it.
        let mut cut = |text: String, reply: bool, pieces: &mut Vec<(String, bool)>| {
            let Some(rest) = text.strip_prefix(done.as_str()) else {
                return false;
            };
            if !rest.is_empty() {
                pieces.push((rest.to_string(), reply));
            }
            done = text;
            true
        };
        for (i, m) in messages.iter().enumerate() {
            if m.role == "assistant"
                && !(cut(before_reply(i)?, false, &mut pieces)
                    && cut(render(i + 1, false)?, true, &mut pieces))
            {
                return Ok(None);
            }
        }
        Ok(cut(render(messages.len(), false)?, false, &mut pieces).then_some(pieces))
    }

    /// The pieces of a conversation whose template renders an earlier
    /// turn differently once later turns follow (Qwen3 drops earlier
    /// replies' reasoning; Mistral v0.3 puts the system prompt in the last
    /// user turn only): the whole conversation rendered once, as
    /// `apply_chat_template` renders it, and each reply found where that
    /// text and the text with the reply replaced by a marker differ. A
    /// reply piece runs from there through the first end-of-turn token
    /// after it (or ends with the reply, so an EOS is appended).
    fn marked_pieces(
        &self,
        messages: &[Message],
        chat: &ChatData,
    ) -> Result<Vec<(String, bool)>, String> {
        let render = |m: &[Message]| chat.template.render(m, false).map_err(|e| e.to_string());
        let text = render(messages)?;
        let tokenizer = self.tokenizer()?;
        let stops: Vec<String> = chat
            .stop
            .iter()
            .filter_map(|&id| tokenizer.decode_with_special(&[id]).ok())
            .filter(|s| !s.is_empty())
            .collect();
        // Each reply's span: the first and last characters where the text
        // and the text with the reply replaced by a marker differ.
        let mut spans = Vec::new();
        for (i, m) in messages.iter().enumerate() {
            if m.role != "assistant" {
                continue;
            }
            let mut marked = messages.to_vec();
            marked[i].content = REPLY_MARK.into();
            let other = render(&marked)?;
            let start = text
                .char_indices()
                .zip(other.chars())
                .find(|((_, a), b)| a != b)
                .map_or(text.len().min(other.len()), |((at, _), _)| at);
            let common_end: usize = text
                .chars()
                .rev()
                .zip(other.chars().rev())
                .take_while(|(a, b)| a == b)
                .map(|(a, _)| a.len_utf8())
                .sum();
            spans.push((start, (text.len() - common_end).max(start)));
        }
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err("the chat template renders replies out of order".into());
        }
        let mut pieces = Vec::new();
        let mut cursor = 0;
        for (k, &(start, end)) in spans.iter().enumerate() {
            // Through the first end-of-turn token after the reply, before
            // the next one.
            let next = spans.get(k + 1).map_or(text.len(), |s| s.0);
            let tail = stops
                .iter()
                .filter_map(|s| text[end..next].find(s.as_str()).map(|at| at + s.len()))
                .min()
                .unwrap_or(0);
            pieces.push((text[cursor..start].to_string(), false));
            pieces.push((text[start..end + tail].to_string(), true));
            cursor = end + tail;
        }
        pieces.push((text[cursor..].to_string(), false));
        pieces.retain(|(t, _)| !t.is_empty());
        Ok(pieces)
    }

    /// Reads a data file or a folder of them: `.parquet` files as Parquet
    /// (the shards `datasets` exports), anything else as JSONL; a folder's
    /// `*.parquet` and `*.jsonl` files in name order (`train-00000-of-00002`
    /// before `train-00001-of-00002`).
    pub fn read_path(&self, path: &Path) -> Result<Vec<Example>, DataError> {
        let files = data_files(path)?;
        let mut out = Vec::new();
        for file in &files {
            out.extend(if is_parquet(file) {
                self.read_parquet(file)?
            } else {
                self.read_jsonl(file)?
            });
        }
        Ok(out)
    }

    /// Reads a Parquet file a row group at a time (a file larger than
    /// memory is read in bounded memory: only its examples, cut to the row
    /// length, are kept). Columns are the JSONL fields; a bad row is an
    /// error naming the file and row (counted from 1).
    pub(crate) fn read_parquet(&self, path: &Path) -> Result<Vec<Example>, DataError> {
        collect_rows(path, visit_parquet, |row| self.parse_row(row))
    }

    /// Reads a JSONL file, a line at a time; a bad line is an error naming
    /// the file and line.
    pub fn read_jsonl(&self, path: &Path) -> Result<Vec<Example>, DataError> {
        collect_rows(path, visit_jsonl, |row| self.parse_row(row))
    }
}

/// What each row of a data file is passed to: Ok(false) stops reading;
/// an error is the row's.
pub(crate) type RowFn<'a> = dyn FnMut(&Value) -> Result<bool, String> + 'a;

/// A reader of a data file's rows (JSONL, Parquet, or either by name).
pub(crate) type VisitFn = fn(&Path, &mut RowFn) -> Result<(), DataError>;

/// Reads a data file's rows with `visit` (JSONL or Parquet), each through
/// `parse`; an error when the file holds none.
pub(crate) fn collect_rows<T>(
    path: &Path,
    visit: VisitFn,
    parse: impl Fn(&Value) -> Result<T, String>,
) -> Result<Vec<T>, DataError> {
    let mut out = Vec::new();
    visit(path, &mut |row| {
        out.push(parse(row)?);
        Ok(true)
    })?;
    if out.is_empty() {
        return Err(DataError::Empty {
            path: path.to_path_buf(),
        });
    }
    Ok(out)
}

/// Every row of a data path (a file, or a folder's data files in order)
/// parsed by `parse`, an error naming the file and the line or row.
pub(crate) fn collect_path<T>(
    path: &Path,
    parse: impl Fn(&Value) -> Result<T, String>,
) -> Result<Vec<T>, DataError> {
    let mut out = Vec::new();
    for file in data_files(path)? {
        out.extend(collect_rows(&file, visit_rows, &parse)?);
    }
    Ok(out)
}

/// Passes each row of a data file, as JSON, to `each` until it returns
/// false: `.parquet` files as Parquet, anything else as JSONL.
pub(crate) fn visit_rows(path: &Path, each: &mut RowFn) -> Result<(), DataError> {
    if is_parquet(path) {
        visit_parquet(path, each)
    } else {
        visit_jsonl(path, each)
    }
}

/// Passes each row of a Parquet file (a row group at a time) to `each`
/// until it returns false; a row that cannot be read, holds a binary
/// column, or that `each` refuses is an error naming the file and row
/// (counted from 1).
pub(crate) fn visit_parquet(path: &Path, each: &mut RowFn) -> Result<(), DataError> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file = std::fs::File::open(path).map_err(|cause| DataError::Read {
        path: path.to_path_buf(),
        cause,
    })?;
    let not_parquet = |cause: parquet::errors::ParquetError| DataError::Parquet {
        path: path.to_path_buf(),
        message: cause.to_string(),
    };
    let reader = SerializedFileReader::new(file).map_err(not_parquet)?;
    let rows = reader.get_row_iter(None).map_err(not_parquet)?;
    for (i, row) in rows.enumerate() {
        let bad = |message: String| DataError::Row {
            path: path.to_path_buf(),
            row: i + 1,
            message,
        };
        let row = row.map_err(|e| bad(format!("cannot read: {e}")))?;
        if let Some(column) = binary_column(&row) {
            return Err(bad(format!(
                "column `{column}` is binary (bytes with no string type), not text: write it as a string column"
            )));
        }
        if !each(&row.to_json_value()).map_err(bad)? {
            break;
        }
    }
    Ok(())
}

/// Passes each line of a JSONL file, parsed, to `each` until it returns
/// false (a byte-order mark and blank lines are skipped); a line that is
/// not JSON or that `each` refuses is an error naming the file and line.
pub(crate) fn visit_jsonl(path: &Path, each: &mut RowFn) -> Result<(), DataError> {
    let file = std::fs::File::open(path).map_err(|cause| DataError::Read {
        path: path.to_path_buf(),
        cause,
    })?;
    for (i, line) in std::io::BufReader::new(file).lines().enumerate() {
        let bad = |message: String| DataError::Line {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let line = line.map_err(|e| bad(format!("cannot read: {e}")))?;
        let line = if i == 0 {
            line.trim_start_matches('\u{feff}')
        } else {
            &line
        };
        if line.trim().is_empty() {
            continue;
        }
        let row: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        if !each(&row).map_err(bad)? {
            break;
        }
    }
    Ok(())
}

/// Whether `path` names a Parquet file (by its extension).
pub fn is_parquet(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("parquet"))
}

/// The files a data path stands for: itself, or a folder's `*.parquet`
/// and `*.jsonl` files in name order (an error when it has none).
pub fn data_files(path: &Path) -> Result<Vec<std::path::PathBuf>, DataError> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let read = |cause| DataError::Read {
        path: path.to_path_buf(),
        cause,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path).map_err(read)? {
        let p = entry.map_err(read)?.path();
        let data = p
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("parquet") || e.eq_ignore_ascii_case("jsonl"));
        if data && p.is_file() {
            files.push(p);
        }
    }
    if files.is_empty() {
        return Err(DataError::NoDataFiles {
            path: path.to_path_buf(),
        });
    }
    files.sort();
    Ok(files)
}

/// The prompt of an alpaca row, as Stanford Alpaca trained on it (the
/// completion is the `output`, then EOS). An empty or missing `input`
/// takes the shorter form.
pub fn alpaca_prompt(instruction: &str, input: &str) -> String {
    if input.is_empty() {
        format!(
            "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:"
        )
    } else {
        format!(
            "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
        )
    }
}

/// An alpaca or sharegpt row in the reader's own shapes (`{"prompt",
/// "completion"}`, `{"messages"}`); None for any other row. The shapes of
/// [`Reader`] come first: a row with `messages`, `input_ids` or `prompt`
/// is read as that. An alpaca row is read as alpaca even when it also
/// has `text` (tatsu-lab/alpaca has both), so only the output is learned.
fn common_shape(row: &Value) -> Result<Option<Value>, String> {
    let Some(obj) = row.as_object() else {
        return Ok(None);
    };
    if ["messages", "input_ids", "prompt"]
        .iter()
        .any(|k| obj.contains_key(*k))
    {
        return Ok(None);
    }
    if let Some(turns) = obj.get("conversations") {
        let turns = turns.as_array().ok_or("conversations is not a list")?;
        let messages = turns
            .iter()
            .enumerate()
            .map(|(i, turn)| sharegpt_message(i, turn))
            .collect::<Result<Vec<Value>, String>>()?;
        return Ok(Some(serde_json::json!({ "messages": messages })));
    }
    if let (Some(instruction), Some(output)) = (obj.get("instruction"), obj.get("output")) {
        let text = |v: &Value, what: &str| {
            v.as_str()
                .map(str::to_string)
                .ok_or(format!("{what} is not a string"))
        };
        let input = match obj.get("input") {
            None => String::new(),
            Some(v) => text(v, "input")?,
        };
        return Ok(Some(serde_json::json!({
            "prompt": alpaca_prompt(&text(instruction, "instruction")?, &input),
            "completion": text(output, "output")?,
        })));
    }
    Ok(None)
}

/// One sharegpt turn as a chat message: `from` system, human (or user),
/// gpt (or assistant).
fn sharegpt_message(i: usize, turn: &Value) -> Result<Value, String> {
    let field = |key: &str| {
        turn.get(key)
            .and_then(Value::as_str)
            .ok_or(format!("conversations[{i}] has no string `{key}`"))
    };
    // A per-turn weight changes what is learned; it is not read, so it
    // is refused rather than ignored.
    if turn.get("weight").is_some_and(|w| !w.is_null()) {
        return Err(format!(
            "conversations[{i}] sets `weight`, which hlo-train does not read (the learned turns are the assistant's; --train-on-inputs learns all)"
        ));
    }
    let role = match field("from")? {
        "system" => "system",
        "human" | "user" => "user",
        "gpt" | "assistant" => "assistant",
        other => {
            return Err(format!(
                "conversations[{i}] is from `{other}`; sharegpt turns are from system, human or gpt"
            ))
        }
    };
    Ok(serde_json::json!({"role": role, "content": field("value")?}))
}

/// The first column of a Parquet row (or of a row nested in it) holding
/// raw bytes: JSON would carry them as base64, which no one means to
/// train on.
fn binary_column(row: &parquet::record::Row) -> Option<String> {
    use parquet::record::Field;
    fn binary(f: &Field) -> bool {
        match f {
            Field::Bytes(_) => true,
            Field::Group(row) => binary_column(row).is_some(),
            Field::ListInternal(list) => list.elements().iter().any(binary),
            Field::MapInternal(map) => map.entries().iter().any(|(k, v)| binary(k) || binary(v)),
            _ => false,
        }
    }
    row.get_column_iter()
        .find(|(_, f)| binary(f))
        .map(|(name, _)| name.clone())
}

/// A list of token ids; one that is not, named with its position.
pub(crate) fn id_list(v: &Value, what: &str) -> Result<Vec<u32>, String> {
    v.as_array()
        .ok_or(format!("{what} is not a list"))?
        .iter()
        .enumerate()
        .map(|(i, t)| match (t.as_u64(), t.as_i64()) {
            (Some(id), _) => u32::try_from(id).map_err(|_| {
                format!("{what}[{i}] is {id}, beyond any vocabulary (token ids are 32-bit)")
            }),
            (None, Some(id)) => Err(format!("{what}[{i}] is {id}: a token id is not negative")),
            _ => Err(format!("{what}[{i}] is {t}, not a token id")),
        })
        .collect()
}

/// Targets from HF `labels`: one per input id, `-100` where nothing is
/// learned, else the id itself (the model predicts each token from the
/// ones before it, so a label can only be its own position's token).
fn labels_target(ids: &[u32], labels: &Value) -> Result<Vec<bool>, String> {
    let labels = labels.as_array().ok_or("labels is not a list")?;
    if labels.len() != ids.len() {
        return Err(format!(
            "labels has {} entries, input_ids {}",
            labels.len(),
            ids.len()
        ));
    }
    labels
        .iter()
        .zip(ids)
        .enumerate()
        .map(|(i, (l, &id))| match l.as_i64() {
            Some(-100) => Ok(false),
            Some(l) if l == id as i64 => Ok(i > 0),
            Some(l) => Err(format!(
                "labels[{i}] is {l} but input_ids[{i}] is {id}: a label is its token or -100"
            )),
            None => Err("labels holds a non-integer".into()),
        })
        .collect()
}

/// Parses one JSONL line: `{"text"}`, `{"prompt", "completion"}` or
/// `{"input_ids"}`. Text gets BOS (from the tokenizer) and EOS appended.
pub fn parse_line(
    line: &str,
    tokenizer: Option<&Tokenizer>,
    eos: Option<u32>,
    vocab: i64,
) -> Result<Example, String> {
    Reader {
        tokenizer,
        eos,
        vocab,
        chat: None,
        max_tokens: None,
    }
    .parse_line(line)
}

/// A word of the demo task: 3 to 6 lowercase letters.
pub(crate) fn demo_word(rng: &mut hlo_ir::rng::Rng) -> String {
    let len = 3 + (rng.next_u64() % 4) as usize;
    (0..len)
        .map(|_| (b'a' + (rng.next_u64() % 26) as u8) as char)
        .collect()
}

/// The demo task's prompts for online RL: `{"prompt": "word=", "answer":
/// "WORD"}` rows drawn as [`demo_examples`] draws its words.
pub fn demo_prompt_rows(count: usize, seed: u64) -> Vec<serde_json::Value> {
    let mut rng = hlo_ir::rng::Rng::new(seed);
    (0..count)
        .map(|_| {
            let word = demo_word(&mut rng);
            serde_json::json!({"prompt": format!("{word}="), "answer": word.to_uppercase()})
        })
        .collect()
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
            let word = demo_word(&mut rng);
            let line = serde_json::json!({"prompt": format!("{word}="), "completion": word.to_uppercase()}).to_string();
            parse_line(&line, Some(tokenizer), eos, i64::MAX).expect("demo lines are valid")
        })
        .collect()
}
