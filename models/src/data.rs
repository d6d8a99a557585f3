//! Training data: JSONL examples tokenized into fixed-length rows with a
//! loss mask, shuffled deterministically, batched, with a cursor to resume.
//!
//! Each row is `seq` token ids and a mask: `loss_mask[t] = 1` when position
//! `t` predicts a token that counts (`t + 1` is a completion or text token,
//! not prompt or padding). Padding is token 0 with mask 0.

use std::path::Path;

use serde_json::Value;

use crate::chat::{ChatTemplate, Message};
use crate::tokenizer::Tokenizer;
use crate::ModelError;

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
) -> Result<Vec<Example>, ModelError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ModelError::Io(format!("cannot read {}: {e}", path.display())))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            return Err(ModelError::Io(format!(
                "{}:{}: empty line",
                path.display(),
                i + 1
            )));
        }
        out.push(
            parse_line_with(line, tokenizer, eos, vocab, chat)
                .map_err(|e| ModelError::Io(format!("{}:{}: {e}", path.display(), i + 1)))?,
        );
    }
    if out.is_empty() {
        return Err(ModelError::Io(format!(
            "{} has no examples",
            path.display()
        )));
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
    let mut rng = crate::rng::Rng::new(seed);
    (0..count)
        .map(|_| {
            let len = 3 + (rng.next_u64() % 4) as usize;
            let word: String = (0..len).map(|_| (b'a' + (rng.next_u64() % 26) as u8) as char).collect();
            let line = serde_json::json!({"prompt": format!("{word}="), "completion": word.to_uppercase()}).to_string();
            parse_line(&line, Some(tokenizer), eos, i64::MAX).expect("demo lines are valid")
        })
        .collect()
}

/// A batch: `ids`, `loss_mask`, `positions` and `segment_ids`, each
/// `[batch, seq]` row-major (segment 0 is padding; unpacked rows hold one
/// segment).
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub ids: Vec<i32>,
    pub loss_mask: Vec<f32>,
    pub positions: Vec<i32>,
    pub segment_ids: Vec<i32>,
    /// Tokens whose prediction counts.
    pub targets: usize,
}

impl Batch {
    fn empty(rows: usize, seq: usize) -> Batch {
        Batch {
            ids: vec![0; rows * seq],
            loss_mask: vec![0.0; rows * seq],
            positions: vec![0; rows * seq],
            segment_ids: vec![0; rows * seq],
            targets: 0,
        }
    }

    /// Writes `ex` (cut to what is left of the row) at slot `at` of row
    /// `row` as segment `segment`: position t predicts token t + 1 of the
    /// same sample. Returns the slots used.
    fn put(&mut self, ex: &Example, row: usize, at: usize, seq: usize, segment: i32) -> usize {
        let len = ex.ids.len().min(seq - at);
        let base = row * seq + at;
        for t in 0..len {
            self.ids[base + t] = ex.ids[t] as i32;
            self.positions[base + t] = t as i32;
            self.segment_ids[base + t] = segment;
            if t + 1 < len && ex.target[t + 1] {
                self.loss_mask[base + t] = 1.0;
                self.targets += 1;
            }
        }
        len
    }

    /// Slots holding a real token, over all slots.
    pub fn fill(&self) -> f64 {
        self.segment_ids.iter().filter(|&&s| s > 0).count() as f64 / self.ids.len().max(1) as f64
    }
}

/// Every example once, in file order, as batches of `batch` rows (the last
/// one padded with empty rows, which count nothing): the held-out set.
pub fn eval_batches(examples: &[Example], seq: usize, batch: usize) -> Vec<Batch> {
    examples
        .chunks(batch)
        .map(|chunk| {
            let mut b = Batch::empty(batch, seq);
            for (row, ex) in chunk.iter().enumerate() {
                b.put(ex, row, 0, seq, 1);
            }
            b
        })
        .collect()
}

/// Examples cut or padded to `seq`, in a seeded order, epoch after epoch.
pub struct Loader {
    examples: Vec<Example>,
    seq: usize,
    batch: usize,
    seed: u64,
    /// Several samples per row (see [`Loader::packed`]).
    packing: bool,
    /// Examples handed out so far (the resume cursor; with packing a batch
    /// takes as many as fit, so the cursor alone fixes what comes next).
    pub cursor: u64,
}

impl Loader {
    pub fn new(examples: Vec<Example>, seq: usize, batch: usize, seed: u64) -> Loader {
        Loader {
            examples,
            seq,
            batch,
            seed,
            packing: false,
            cursor: 0,
        }
    }

    /// Packs rows: each takes whole samples, in order, while they fit (a
    /// sample longer than a row is cut and fills one alone).
    pub fn packed(mut self, packing: bool) -> Loader {
        self.packing = packing;
        self
    }

    /// Mean sample length (tokens), for deciding whether to pack.
    pub fn mean_len(&self) -> f64 {
        self.examples.iter().map(|e| e.ids.len()).sum::<usize>() as f64
            / self.examples.len().max(1) as f64
    }

    pub fn len(&self) -> usize {
        self.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// The permutation of epoch `epoch` (Fisher–Yates, seeded by seed and epoch).
    fn order(&self, epoch: u64) -> Vec<usize> {
        let mut rng = crate::rng::Rng::new(self.seed.wrapping_mul(0x9e37_79b9).wrapping_add(epoch));
        let mut idx: Vec<usize> = (0..self.examples.len()).collect();
        for i in (1..idx.len()).rev() {
            let j = (rng.next_u64() % (i as u64 + 1)) as usize;
            idx.swap(i, j);
        }
        idx
    }

    /// The example at cursor position `k` (epochs reshuffled).
    fn at(&self, k: u64, cache: &mut (u64, Vec<usize>)) -> &Example {
        let n = self.examples.len() as u64;
        let (epoch, pos) = (k / n, (k % n) as usize);
        if cache.0 != epoch || cache.1.is_empty() {
            *cache = (epoch, self.order(epoch));
        }
        &self.examples[cache.1[pos]]
    }

    /// The next batch; the cursor advances by the examples it holds
    /// (`batch` of them, unpacked).
    pub fn next_batch(&mut self) -> Batch {
        let (seq, rows) = (self.seq, self.batch);
        let mut out = Batch::empty(rows, seq);
        let mut cache = (u64::MAX, Vec::new());
        let mut k = self.cursor;
        for row in 0..rows {
            let mut at = 0;
            let mut segment = 1;
            loop {
                let ex = self.at(k, &mut cache);
                let len = ex.ids.len().min(seq);
                if at > 0 && at + len > seq {
                    break;
                }
                at += out.put(ex, row, at, seq, segment);
                segment += 1;
                k += 1;
                if !self.packing || at >= seq {
                    break;
                }
            }
        }
        self.cursor = k;
        out
    }
}
