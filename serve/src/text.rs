//! A completion's text as tokens arrive: what follows the prompt's text,
//! held back while it ends inside a UTF-8 character or might be the start
//! of a stop string, and cut before the first stop string.

use std::sync::Arc;

use hlo_engine::data::Tokenizer;

/// Prompt tokens decoded with the completion, so that the completion's
/// first word keeps its leading space (`" Paris"`).
const CONTEXT: usize = 6;

/// The text of one completion, token by token.
pub(crate) struct TextStream {
    tokenizer: Option<Arc<Tokenizer>>,
    context: Vec<u32>,
    context_text: String,
    generated: Vec<u32>,
    stops: Vec<String>,
    /// Bytes of the text already handed out.
    sent: usize,
    /// Set once a stop string was found: the final text's length.
    stopped_at: Option<usize>,
}

impl TextStream {
    pub fn new(tokenizer: Option<Arc<Tokenizer>>, prompt: &[u32], stops: Vec<String>) -> Self {
        let context = prompt[prompt.len().saturating_sub(CONTEXT)..].to_vec();
        let context_text = tokenizer
            .as_ref()
            .and_then(|t| t.decode(&context).ok())
            .unwrap_or_default();
        TextStream {
            tokenizer,
            context,
            context_text,
            generated: Vec::new(),
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            sent: 0,
            stopped_at: None,
        }
    }

    /// decode(prompt + completion) minus decode(prompt) (over the prompt's
    /// last few tokens); decode(completion) should the first not extend
    /// the second.
    fn full(&self) -> String {
        let Some(t) = &self.tokenizer else {
            return String::new();
        };
        let mut ids = self.context.clone();
        ids.extend(&self.generated);
        match t.decode(&ids) {
            Ok(all) if all.starts_with(&self.context_text) => {
                all[self.context_text.len()..].to_string()
            }
            _ => t.decode(&self.generated).unwrap_or_default(),
        }
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped_at.is_some()
    }

    pub fn tokens(&self) -> &[u32] {
        &self.generated
    }

    /// Adds a token; returns the text that can be handed out now.
    pub fn push(&mut self, token: u32) -> String {
        if self.stopped() {
            return String::new();
        }
        self.generated.push(token);
        let full = self.full();
        let from = self.sent.saturating_sub(self.longest_stop());
        let hit = self
            .stops
            .iter()
            .filter_map(|s| {
                full[floor(&full, from)..]
                    .find(s.as_str())
                    .map(|i| i + floor(&full, from))
            })
            .min();
        if let Some(at) = hit {
            self.stopped_at = Some(at);
            return self.take(&full, at);
        }
        // Hold back a broken character, and what could begin a stop string.
        let mut end = full.len();
        if full.ends_with('\u{FFFD}') {
            end = full.trim_end_matches('\u{FFFD}').len();
        }
        end = floor(
            &full,
            end.saturating_sub(self.longest_stop().saturating_sub(1)),
        );
        self.take(&full, end)
    }

    /// The rest of the text, once the completion has ended.
    pub fn finish(&mut self) -> String {
        let full = self.full();
        let end = self.stopped_at.unwrap_or(full.len());
        self.take(&full, end)
    }

    fn take(&mut self, full: &str, end: usize) -> String {
        if end <= self.sent {
            return String::new();
        }
        let out = full[self.sent..end].to_string();
        self.sent = end;
        out
    }

    fn longest_stop(&self) -> usize {
        self.stops.iter().map(String::len).max().unwrap_or(0)
    }
}

/// The largest char boundary of `s` at or below `i`.
fn floor(s: &str, i: usize) -> usize {
    let mut i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes() -> Option<Arc<Tokenizer>> {
        Some(Arc::new(Tokenizer::bytes()))
    }

    fn stream(t: &mut TextStream, text: &[u8]) -> Vec<String> {
        let mut out: Vec<String> = text.iter().map(|&b| t.push(b as u32)).collect();
        out.push(t.finish());
        out
    }

    #[test]
    fn a_character_split_over_tokens_is_held_back_until_whole() {
        let mut t = TextStream::new(bytes(), &[256, b'a' as u32], vec![]);
        let parts = stream(&mut t, "é!".as_bytes());
        assert_eq!(parts, vec!["", "é", "!", ""]);
    }

    #[test]
    fn text_stops_before_the_first_stop_string_and_never_shows_it() {
        let mut t = TextStream::new(bytes(), &[256], vec!["END".into(), "xy".into()]);
        let parts = stream(&mut t, b"abcENDdef");
        assert_eq!(parts.concat(), "abc");
        assert!(t.stopped());
        // Nothing of a stop string leaks out while it is being matched.
        assert!(parts.iter().all(|p| !p.contains('E')));
        let mut t = TextStream::new(bytes(), &[256], vec!["END".into()]);
        assert_eq!(stream(&mut t, b"abEcEN").concat(), "abEcEN");
        assert!(!t.stopped());
    }

    #[test]
    fn without_a_tokenizer_the_text_is_empty() {
        let mut t = TextStream::new(None, &[1], vec![]);
        assert_eq!(stream(&mut t, b"ab").concat(), "");
        assert_eq!(t.tokens(), &[b'a' as u32, b'b' as u32]);
    }
}
