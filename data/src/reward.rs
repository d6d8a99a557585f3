//! A reward model's pairs, as TRL 1.16's `RewardTrainer` reads them:
//!
//! 1. strings `{"prompt", "chosen", "rejected"}` (or without `prompt`:
//!    each side whole): the EOS text appended to each completion unless
//!    it ends with it, then prompt + completion tokenized as one string
//!    with special tokens;
//! 2. message lists, the prompt's (if any) followed by each completion's,
//!    each conversation rendered whole by the chat template;
//! 3. pre-tokenized `{"chosen_ids", "rejected_ids"}`, each a whole
//!    sequence, used as given (TRL's processed form; a `prompt_ids`
//!    beside them, which TRL would ignore, is refused).
//!
//! A row may give its pair's `margin` (a number); then every row does.
//! Unlike DPO's pairs, nothing is masked: a sequence is scored whole, at
//! its last token.

use serde_json::{Map, Value};

use crate::pairs::{part, present_fields, split_messages, Part};
use crate::reader::{collect_path, id_list, Reader};
use crate::DataError;

/// A reward model's pair: the chosen and the rejected sequence, and the
/// margin the chosen should win by.
#[derive(Clone, Debug, PartialEq)]
pub struct RewardPair {
    pub chosen: Vec<u32>,
    pub rejected: Vec<u32>,
    pub margin: Option<f64>,
}

const EXPECTED: &str = "expected a reward pair: {\"chosen\", \"rejected\"} (strings or message lists, with an optional \"prompt\") or {\"chosen_ids\", \"rejected_ids\"}, and an optional \"margin\"";

impl Reader<'_> {
    /// Reads a reward model's pairs from a data file or a folder of them;
    /// a bad row is an error naming the file and the line or row.
    /// `eos_token`: the text appended to string completions (the
    /// tokenizer's EOS token), else the EOS id.
    pub fn read_reward_pairs(
        &self,
        path: &std::path::Path,
        eos_token: Option<&str>,
    ) -> Result<Vec<RewardPair>, DataError> {
        let pairs = collect_path(path, |row| self.parse_reward_row(row, eos_token))?;
        let with = pairs.iter().filter(|p| p.margin.is_some()).count();
        if with != 0 && with != pairs.len() {
            return Err(DataError::Rows {
                path: path.to_path_buf(),
                message: format!(
                    "{with} of {} pairs give a `margin`: give one for every pair or none",
                    pairs.len()
                ),
            });
        }
        Ok(pairs)
    }

    /// One row (see [`crate::reward`]); a null field is an absent one.
    fn parse_reward_row(&self, row: &Value, eos_token: Option<&str>) -> Result<RewardPair, String> {
        let obj = present_fields(row)?;
        let margin = match obj.get("margin") {
            None => None,
            Some(v) => Some(
                v.as_f64()
                    .filter(|m| m.is_finite())
                    .ok_or_else(|| format!("`margin` is {v}, not a finite number"))?,
            ),
        };
        let (chosen, rejected) =
            if obj.contains_key("chosen_ids") || obj.contains_key("rejected_ids") {
                self.reward_ids(&obj)?
            } else {
                self.reward_text(&obj, eos_token)?
            };
        for (side, ids) in [("chosen", &chosen), ("rejected", &rejected)] {
            if ids.is_empty() {
                return Err(format!("`{side}` has no tokens"));
            }
            if let Some(bad) = ids.iter().find(|&&t| t as i64 >= self.vocab) {
                return Err(format!(
                    "`{side}`: token id {bad} is outside the vocabulary (size {})",
                    self.vocab
                ));
            }
        }
        Ok(RewardPair {
            chosen,
            rejected,
            margin,
        })
    }

    /// A pre-tokenized pair: each side whole.
    fn reward_ids(&self, obj: &Map<String, Value>) -> Result<(Vec<u32>, Vec<u32>), String> {
        for key in ["prompt", "chosen", "rejected", "prompt_ids"] {
            if obj.contains_key(key) {
                return Err(format!(
                    "holds `{key}` beside `chosen_ids`: pre-tokenized reward pairs are whole sequences, {{\"chosen_ids\", \"rejected_ids\"}} (prepend a prompt's ids to each)"
                ));
            }
        }
        let side = |key: &str| match obj.get(key) {
            Some(v) => id_list(v, key),
            None => Err(format!("no `{key}`: {EXPECTED}")),
        };
        Ok((side("chosen_ids")?, side("rejected_ids")?))
    }

    /// A pair of strings or of message lists, tokenized as TRL does.
    fn reward_text(
        &self,
        obj: &Map<String, Value>,
        eos_token: Option<&str>,
    ) -> Result<(Vec<u32>, Vec<u32>), String> {
        for key in ["chosen", "rejected"] {
            if !obj.contains_key(key) {
                return Err(format!("no `{key}`: {EXPECTED}"));
            }
        }
        let prompt = match obj.contains_key("prompt") {
            true => Some(part(obj, "prompt")?),
            false => None,
        };
        let (c, r) = (part(obj, "chosen")?, part(obj, "rejected")?);
        let eos = self.eos_of(eos_token);
        let mut seqs = match (prompt, c, r) {
            (None, Part::Text(c), Part::Text(r)) => {
                self.string_sequences("", &[c.as_str(), r.as_str()], eos)?.1
            }
            (Some(Part::Text(p)), Part::Text(c), Part::Text(r)) => {
                self.string_sequences(&p, &[c.as_str(), r.as_str()], eos)?.1
            }
            (None, Part::Messages(c), Part::Messages(r)) => {
                let (p, c, r) = split_messages(c, r)?;
                self.conversation_sequences(p, vec![c, r])?.1
            }
            (Some(Part::Messages(p)), Part::Messages(c), Part::Messages(r)) => {
                self.conversation_sequences(p, vec![c, r])?.1
            }
            _ => return Err("a pair's fields are all strings or all message lists".into()),
        };
        let rejected = seqs.pop().unwrap_or_default();
        let chosen = seqs.pop().unwrap_or_default();
        Ok((chosen, rejected))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn reader() -> Reader<'static> {
        Reader {
            tokenizer: None,
            eos: Some(1),
            vocab: 16,
            chat: None,
            max_tokens: None,
        }
    }

    #[test]
    fn pre_tokenized_pairs_are_whole_sequences_with_their_margin() {
        let r = reader();
        let p = r
            .parse_reward_row(
                &json!({"chosen_ids": [0, 3, 1], "rejected_ids": [0, 4], "margin": 0.5}),
                None,
            )
            .unwrap();
        assert_eq!(
            (p.chosen, p.rejected, p.margin),
            (vec![0, 3, 1], vec![0, 4], Some(0.5))
        );
        for (row, says) in [
            (
                json!({"chosen_ids": [0], "rejected_ids": [0], "prompt_ids": [2]}),
                "holds `prompt_ids`",
            ),
            (json!({"chosen_ids": [0]}), "no `rejected_ids`"),
            (
                json!({"chosen_ids": [], "rejected_ids": [0]}),
                "`chosen` has no tokens",
            ),
            (
                json!({"chosen_ids": [0], "rejected_ids": [16]}),
                "outside the vocabulary",
            ),
            (
                json!({"chosen_ids": [0], "rejected_ids": [1], "margin": "x"}),
                "not a finite number",
            ),
            (json!({"rejected": "a"}), "no `chosen`"),
        ] {
            let e = r.parse_reward_row(&row, None).unwrap_err();
            assert!(e.contains(says), "{row}: {e}");
        }
    }
}
