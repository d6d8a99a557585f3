//! Unpaired completions for KTO, read as TRL 1.16's `KTOTrainer` reads
//! its datasets (`_prepare_dataset`, `unpair_preference_dataset`,
//! `DataCollatorForUnpairedPreference`), JSONL or Parquet:
//!
//! 1. `{"prompt", "completion", "label"}`: strings (the tokenizer's EOS
//!    text appended to the completion unless it ends with it) or message
//!    lists (rendered with the chat template, the prompt with the
//!    generation prompt); `label` true for a desirable completion;
//! 2. pre-tokenized `{"prompt_ids", "completion_ids", "label"}`, used as
//!    given;
//! 3. preference pairs (any shape [`crate::pairs`] reads), unpaired as
//!    TRL unpairs them: in blocks of 1000 rows (`datasets`' `map` batch),
//!    the chosen completion of each row of the block (label true), then
//!    the rejected ones (label false).
//!
//! Each example is tokenized alone: the prompt, and the prompt with its
//! completion, the prompt ending where the two diverge (TRL's
//! `common_prefix_length`).

use serde_json::{Map, Value};

use crate::pairs::{
    is_preference_row, join, part, present_fields, split_messages, split_text, Eos, Part, ID_FIELDS,
};
use crate::reader::{collect_path, id_list, Example, Reader};
use crate::DataError;

/// One unpaired example: a prompt and its completion (learned), and
/// whether the completion is desirable.
#[derive(Clone, Debug, PartialEq)]
pub struct Unpaired {
    pub example: Example,
    pub desirable: bool,
}

/// What an unpaired row is expected to hold.
const EXPECTED: &str = "expected an unpaired row {\"prompt\", \"completion\", \"label\"} (strings or message lists, label true or false), {\"prompt_ids\", \"completion_ids\", \"label\"}, or a preference pair";

/// The rows `datasets` maps at a time: TRL unpairs a block of them
/// (chosen completions first, then rejected).
const UNPAIR_BLOCK: usize = 1000;

/// A row read: one unpaired example, or a pair's two (chosen, rejected).
enum Row {
    One(Unpaired),
    Pair(Unpaired, Unpaired),
}

impl Reader<'_> {
    /// Reads unpaired examples from a data file or a folder of them, in
    /// TRL's order; a bad row is an error naming the file and the line or
    /// row. `eos_token` as for [`Reader::read_pairs`].
    pub fn read_unpaired(
        &self,
        path: &std::path::Path,
        eos_token: Option<&str>,
    ) -> Result<Vec<Unpaired>, DataError> {
        let rows = collect_path(path, |row| self.parse_unpaired_row(row, eos_token))?;
        let mut out = Vec::with_capacity(rows.len());
        let mut block: Vec<(Unpaired, Unpaired)> = Vec::new();
        let flush = |block: &mut Vec<(Unpaired, Unpaired)>, out: &mut Vec<Unpaired>| {
            let (chosen, rejected): (Vec<_>, Vec<_>) = block.drain(..).unzip();
            out.extend(chosen.into_iter().chain(rejected));
        };
        for row in rows {
            match row {
                Row::One(u) => {
                    flush(&mut block, &mut out);
                    out.push(u)
                }
                Row::Pair(c, r) => {
                    block.push((c, r));
                    if block.len() == UNPAIR_BLOCK {
                        flush(&mut block, &mut out);
                    }
                }
            }
        }
        flush(&mut block, &mut out);
        Ok(out)
    }

    /// Reads one row (see [`crate::unpaired`]); a null field is an absent
    /// one.
    fn parse_unpaired_row(&self, row: &Value, eos_token: Option<&str>) -> Result<Row, String> {
        let obj = present_fields(row)?;
        let eos = self.eos_of(eos_token);
        if is_preference_row(row) {
            if obj.contains_key("label") {
                return Err("holds `label` and a pair: a row is one labelled completion or a pair, not both".into());
            }
            let (chosen, rejected) = self.unpaired_pair(&obj, eos)?;
            return Ok(Row::Pair(chosen, rejected));
        }
        let desirable = match obj.get("label") {
            Some(Value::Bool(b)) => *b,
            Some(other) => return Err(format!("`label` is {other}, not true or false")),
            None => return Err(format!("no `label`: {EXPECTED}")),
        };
        let example = match (obj.contains_key("completion"), obj.contains_key("completion_ids")) {
            (true, true) => return Err("holds both `completion` and `completion_ids`: a completion is text or token ids, not both (drop one)".into()),
            (false, false) => return Err(format!("no `completion`: {EXPECTED}")),
            (false, true) => self.unpaired_ids(&obj)?,
            (true, false) => {
                if !obj.contains_key("prompt") {
                    return Err("no `prompt`: an unpaired completion needs its prompt".into());
                }
                self.unpaired_text(part(&obj, "prompt")?, part(&obj, "completion")?, eos)?
            }
        };
        self.check_unpaired(&example)?;
        Ok(Row::One(Unpaired { example, desirable }))
    }

    /// A pre-tokenized example: `prompt_ids + completion_ids`.
    fn unpaired_ids(&self, obj: &Map<String, Value>) -> Result<Example, String> {
        let field = |key: &str| match obj.get(key) {
            Some(v) => id_list(v, key),
            None => Err(format!(
                "no `{key}`: pre-tokenized rows have prompt_ids, completion_ids and label"
            )),
        };
        let (prompt, completion) = (field("prompt_ids")?, field("completion_ids")?);
        if completion.is_empty() {
            return Err("`completion_ids` is empty: nothing to learn".into());
        }
        Ok(join(&prompt, &completion))
    }

    /// A prompt and completion of one kind, tokenized as TRL does.
    fn unpaired_text(&self, prompt: Part, completion: Part, eos: Eos) -> Result<Example, String> {
        let (p, mut seqs) = match (prompt, completion) {
            (Part::Text(p), Part::Text(c)) => {
                if c.is_empty() {
                    return Err("`completion` is empty: nothing to learn".into());
                }
                self.string_sequences(&p, &[c.as_str()], eos)?
            }
            (Part::Messages(p), Part::Messages(c)) => self.conversation_sequences(p, vec![c])?,
            (p, c) => {
                return Err(format!(
                    "`prompt` is {} but `completion` is {}: both strings or both message lists",
                    p.kind(),
                    c.kind()
                ))
            }
        };
        Ok(split_alone(&p, seqs.pop().unwrap_or_default()))
    }

    /// A preference row's two completions, each tokenized alone with the
    /// row's prompt (explicit, or the shared start as TRL's
    /// `extract_prompt` takes it); a pre-tokenized pair as given.
    fn unpaired_pair(
        &self,
        obj: &Map<String, Value>,
        eos: Eos,
    ) -> Result<(Unpaired, Unpaired), String> {
        if ID_FIELDS.iter().any(|k| obj.contains_key(*k)) {
            let pair = self.parse_pair_row(&Value::Object(obj.clone()), None)?;
            return Ok(labelled(pair.chosen, pair.rejected));
        }
        for key in ["chosen", "rejected"] {
            if !obj.contains_key(key) {
                return Err(format!("no `{key}`: {EXPECTED}"));
            }
        }
        let (c, r) = (part(obj, "chosen")?, part(obj, "rejected")?);
        let (prompt, chosen, rejected) = match (obj.contains_key("prompt"), c, r) {
            (true, c, r) => (part(obj, "prompt")?, c, r),
            (false, Part::Text(c), Part::Text(r)) => {
                let (p, c, r) = split_text(&c, &r)?;
                (Part::Text(p), Part::Text(c), Part::Text(r))
            }
            (false, Part::Messages(c), Part::Messages(r)) => {
                let (p, c, r) = split_messages(c, r)?;
                (Part::Messages(p), Part::Messages(c), Part::Messages(r))
            }
            _ => return Err("a pair's fields are all strings or all message lists".into()),
        };
        let chosen = self.unpaired_text(prompt.clone(), chosen, eos)?;
        let rejected = self.unpaired_text(prompt, rejected, eos)?;
        for e in [&chosen, &rejected] {
            self.check_unpaired(e)?;
        }
        Ok(labelled(chosen, rejected))
    }

    /// Refuses an example a step cannot use: fewer than two tokens, no
    /// learned token, or an id outside the vocabulary.
    fn check_unpaired(&self, e: &Example) -> Result<(), String> {
        if e.ids.len() < 2 {
            return Err(
                "the completion with its prompt is fewer than two tokens: nothing to predict"
                    .into(),
            );
        }
        if !e.target.iter().any(|&t| t) {
            return Err("the completion adds no tokens after the prompt".into());
        }
        if let Some(bad) = e.ids.iter().find(|&&t| t as i64 >= self.vocab) {
            return Err(format!(
                "token id {bad} is outside the vocabulary (size {})",
                self.vocab
            ));
        }
        Ok(())
    }
}

/// Preference pairs as unpaired examples, each pair's chosen side
/// (desirable) then its rejected side: the demo task's (a file of pairs
/// is unpaired as TRL unpairs it, [`Reader::read_unpaired`]), so each
/// batch holds both labels.
pub fn interleaved(pairs: Vec<crate::PreferencePair>) -> Vec<Unpaired> {
    pairs
        .into_iter()
        .flat_map(|p| {
            let (c, r) = labelled(p.chosen, p.rejected);
            [c, r]
        })
        .collect()
}

/// A pair's sides as a desirable and an undesirable example.
fn labelled(chosen: Example, rejected: Example) -> (Unpaired, Unpaired) {
    (
        Unpaired {
            example: chosen,
            desirable: true,
        },
        Unpaired {
            example: rejected,
            desirable: false,
        },
    )
}

/// `sequence` learned after the leading tokens it shares with `prompt`.
fn split_alone(prompt: &[u32], sequence: Vec<u32>) -> Example {
    let n = prompt
        .iter()
        .zip(&sequence)
        .take_while(|(a, b)| a == b)
        .count();
    let target = (0..sequence.len()).map(|i| i >= n).collect();
    Example {
        ids: sequence,
        target,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pairs::join;
    use crate::tokenizer::{Tokenizer, BYTE_BOS, BYTE_EOS, BYTE_VOCAB};
    use crate::Loader;
    use serde_json::json;

    fn reader(t: &Tokenizer) -> Reader<'_> {
        Reader {
            tokenizer: Some(t),
            eos: Some(BYTE_EOS),
            vocab: BYTE_VOCAB,
            chat: None,
            max_tokens: None,
        }
    }

    fn one(r: &Reader, row: Value) -> Result<Unpaired, String> {
        match r.parse_unpaired_row(&row, None)? {
            Row::One(u) => Ok(u),
            Row::Pair(..) => Err("a pair".into()),
        }
    }

    #[test]
    fn unpaired_rows_are_tokenized_as_trl_does_and_keep_their_label() {
        let t = Tokenizer::bytes();
        let r = reader(&t);
        let got = one(
            &r,
            json!({"prompt": "ab", "completion": "c", "label": false}),
        )
        .unwrap();
        assert_eq!(got.example, join(&[BYTE_BOS, 97, 98], &[99, BYTE_EOS]));
        assert!(!got.desirable);
        let ids = json!({"prompt_ids": [5, 6], "completion_ids": [7], "label": true});
        let got = one(&r, ids).unwrap();
        assert_eq!((got.example, got.desirable), (join(&[5, 6], &[7]), true));
    }

    #[test]
    fn broken_rows_are_refused_naming_the_field() {
        let t = Tokenizer::bytes();
        let r = reader(&t);
        for (row, says) in [
            (json!({"prompt": "a", "completion": "b"}), "no `label`"),
            (
                json!({"prompt": "a", "completion": "b", "label": 1}),
                "not true or false",
            ),
            (json!({"completion": "b", "label": true}), "no `prompt`"),
            (
                json!({"prompt": "a", "completion": "", "label": true}),
                "empty",
            ),
            (
                json!({"prompt": "a", "chosen": "b", "rejected": "c", "label": true}),
                "not both",
            ),
            (
                json!({"prompt_ids": [1], "completion_ids": [999], "label": true}),
                "vocabulary",
            ),
        ] {
            let err = r.parse_unpaired_row(&row, None).err().unwrap_or_default();
            assert!(err.contains(says), "{row}: {err}");
        }
    }

    #[test]
    fn pairs_are_unpaired_in_blocks_chosen_first_then_rejected() {
        let dir = std::env::temp_dir().join(format!("unpaired-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pairs.jsonl");
        let rows = [
            "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}",
            "{\"prompt\": \"d\", \"chosen\": \"e\", \"rejected\": \"f\"}",
        ];
        std::fs::write(&path, rows.join("\n")).unwrap();
        let t = Tokenizer::bytes();
        let got = reader(&t).read_unpaired(&path, None).unwrap();
        let completions: Vec<(u32, bool)> = got
            .iter()
            .map(|u| (u.example.ids[2], u.desirable))
            .collect();
        assert_eq!(
            completions,
            [(98, true), (101, true), (99, false), (102, false)]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_kto_batch_holds_its_examples_then_each_prompt_with_the_previous_completion() {
        // Five examples, batches of two: the fifth is past the last whole
        // batch; KL rows rotate within a batch.
        let rows: Vec<Unpaired> = (0..5u32)
            .map(|k| Unpaired {
                example: join(&[10 + k], &[20 + k, 30 + k]),
                desirable: k % 2 == 0,
            })
            .collect();
        let mut loader = Loader::unpaired(rows.clone(), 4, 2, true);
        let row = |b: &crate::Batch, r: usize| b.ids[r * 4..r * 4 + 3].to_vec();
        for first in [0i32, 2, 0] {
            let b = loader.next_batch().unwrap();
            let (a, c) = (first, first + 1);
            assert_eq!(row(&b, 0), [10 + a, 20 + a, 30 + a]);
            assert_eq!(row(&b, 1), [10 + c, 20 + c, 30 + c]);
            assert_eq!(
                row(&b, 2),
                [10 + a, 20 + c, 30 + c],
                "prompt {a}, completion {c}"
            );
            assert_eq!(row(&b, 3), [10 + c, 20 + a, 30 + a]);
            assert_eq!(b.desirable, [1.0, 0.0, 1.0, 0.0]);
            assert_eq!(&b.loss_mask[..4], [1.0, 1.0, 0.0, 0.0]);
        }
        // Without the KL estimate, the examples alone.
        let b = Loader::unpaired(rows, 4, 2, false).next_batch().unwrap();
        assert_eq!((b.ids.len(), b.desirable.len()), (8, 2));
    }
}
