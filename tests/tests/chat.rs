//! Chat templates rendered by minijinja equal jinja2's rendering in HF's
//! mode (fixtures from scripts/make_chat_fixture.py), errors included.

use std::path::{Path, PathBuf};

use hlo_data::chat::{ChatTemplate, Message};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/chat")
}

#[test]
fn templates_render_as_jinja2_does() {
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("expected.json")).unwrap())
            .unwrap();
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 12);
    for case in cases {
        let template =
            ChatTemplate::from_dir(&fixtures().join(case["template"].as_str().unwrap())).unwrap();
        assert_eq!(template.eos_token, "<|eot_id|>");
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let got = template.render(&messages, case["add_generation_prompt"].as_bool().unwrap());
        match (case.get("text"), case.get("error")) {
            (Some(want), _) => assert_eq!(&got.unwrap(), want.as_str().unwrap(), "{case}"),
            (None, Some(want)) => {
                let err = got.unwrap_err().to_string();
                assert!(err.contains(want.as_str().unwrap()), "{err}");
            }
            _ => unreachable!(),
        }
    }
}

/// The Qwen2.5, Qwen3, Gemma 3 and Mistral v0.3 templates (as their Hub
/// repos ship them, in `chat_template.jinja`) render the fixture
/// conversations as transformers' `apply_chat_template` does
/// (`scripts/make_family_fixtures.py`).
#[test]
fn family_templates_render_as_transformers_apply_chat_template() {
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("families.json")).unwrap())
            .unwrap();
    let cases = cases.as_array().unwrap();
    assert_eq!(cases.len(), 24);
    for case in cases {
        let dir = fixtures().join(case["template"].as_str().unwrap());
        let template = ChatTemplate::from_dir(&dir).unwrap();
        let messages: Vec<Message> = serde_json::from_value(case["messages"].clone()).unwrap();
        let got = template
            .render(&messages, case["add_generation_prompt"].as_bool().unwrap())
            .unwrap();
        assert_eq!(got, case["text"].as_str().unwrap(), "{case}");
    }
}

#[test]
fn a_folder_without_a_template_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("hlo-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        "{\"bos_token\": \"<s>\"}",
    )
    .unwrap();
    let err = ChatTemplate::from_dir(&dir).unwrap_err().to_string();
    assert!(err.contains("has no chat_template"), "{err}");
    let err = ChatTemplate::from_dir(Path::new("/nonexistent"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("cannot read /nonexistent/tokenizer_config.json"),
        "{err}"
    );
}

mod training_data {
    use super::*;
    use hlo_data::tokenizer::{Tokenizer, BYTE_EOS};
    use hlo_data::{ChatData, Reader};

    fn example(line: &serde_json::Value, train_on_inputs: bool) -> hlo_data::Example {
        let template = ChatTemplate::from_dir(&fixtures().join("llama_style")).unwrap();
        let chat = ChatData {
            template: &template,
            stop: vec![BYTE_EOS],
            train_on_inputs,
        };
        let t = Tokenizer::bytes();
        Reader {
            tokenizer: Some(&t),
            eos: Some(BYTE_EOS),
            vocab: 1 << 20,
            chat: Some(&chat),
            max_tokens: None,
        }
        .parse_line(&line.to_string())
        .unwrap()
    }

    /// The fixture BPE tokenizer, whose `<|end_of_text|>` (id 1) ends turns.
    fn bpe() -> Tokenizer {
        Tokenizer::from_file(
            &Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tokenizer/tokenizer.json"),
        )
        .unwrap()
    }

    /// `line` read with the fixture BPE tokenizer and `template`, turns
    /// ending at `<|end_of_text|>`.
    fn bpe_example(template: &ChatTemplate, line: &serde_json::Value) -> hlo_data::Example {
        let t = bpe();
        let chat = ChatData {
            template,
            stop: vec![1],
            train_on_inputs: false,
        };
        Reader {
            tokenizer: Some(&t),
            eos: Some(1),
            vocab: t.vocab_size() as i64,
            chat: Some(&chat),
            max_tokens: None,
        }
        .parse_line(&line.to_string())
        .unwrap()
    }

    /// Each family's template: the reply is learned up to and including
    /// its end-of-turn token (a special token of the tokenizer), nothing
    /// the user wrote is.
    #[test]
    fn family_templates_mark_each_reply() {
        // The fixture BPE tokenizer with the families' turn tokens added.
        let mut json: Value = serde_json::from_str(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tokenizer/tokenizer.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let specials = [
            "<|im_start|>",
            "<|im_end|>",
            "<start_of_turn>",
            "<end_of_turn>",
            "<bos>",
            "<s>",
            "</s>",
        ];
        let added = json["added_tokens"].as_array_mut().unwrap();
        let first = 1000;
        for (k, t) in specials.iter().enumerate() {
            added.push(
                serde_json::json!({"id": first + k, "content": t, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
            );
        }
        let dir = std::env::temp_dir().join(format!("hlo-chat-families-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), json.to_string()).unwrap();
        let t = Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        let id = |s: &str| match t.encode(s, false).unwrap()[..] {
            [one] => one,
            ref many => panic!("{s} is {many:?}, not one token"),
        };
        let line = serde_json::json!({"messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": "hi"},
        ]});
        for (name, end, reply) in [
            ("qwen2.5", "<|im_end|>", "hi<|im_end|>"),
            ("qwen3", "<|im_end|>", "<think>\n\n</think>\n\nhi<|im_end|>"),
            ("gemma3", "<end_of_turn>", "hi<end_of_turn>"),
            // Mistral's template puts the system prompt into the last user
            // turn only, so a reply's conversation is cut from the whole
            // rendering (without it, as `apply_chat_template` renders it).
            ("mistral-v0.3", "</s>", "hi</s>"),
        ] {
            let template = ChatTemplate::from_dir(&fixtures().join(name)).unwrap();
            let chat = ChatData {
                template: &template,
                stop: vec![id(end)],
                train_on_inputs: false,
            };
            let reader = Reader {
                tokenizer: Some(&t),
                eos: Some(id(end)),
                vocab: 2000,
                chat: Some(&chat),
                max_tokens: None,
            };
            let e = reader.parse_line(&line.to_string()).unwrap();
            assert_eq!(
                t.decode_with_special(&learned(&e)).unwrap(),
                reply,
                "{name}"
            );
            assert_eq!(*learned(&e).last().unwrap(), id(end), "{name}");
        }
        // Qwen3 renders an earlier reply without its reasoning block once
        // a later question follows: the replies are cut from the whole
        // conversation as `apply_chat_template` renders it.
        let template = ChatTemplate::from_dir(&fixtures().join("qwen3")).unwrap();
        let end = id("<|im_end|>");
        let chat = ChatData {
            template: &template,
            stop: vec![end],
            train_on_inputs: false,
        };
        let reader = Reader {
            tokenizer: Some(&t),
            eos: Some(end),
            vocab: 2000,
            chat: Some(&chat),
            max_tokens: None,
        };
        let turns = [
            ("user", "a"),
            ("assistant", "b"),
            ("user", "c"),
            ("assistant", "d"),
        ];
        let messages: Vec<Message> = turns.iter().map(|(r, c)| Message::new(r, c)).collect();
        let line = serde_json::json!({ "messages": messages });
        let e = reader.parse_line(&line.to_string()).unwrap();
        let whole = template.render(&messages, false).unwrap();
        assert_eq!(t.decode_with_special(&e.ids).unwrap(), whole);
        assert!(!whole.contains("<think>\n\n</think>\n\nb"), "{whole}");
        assert_eq!(
            t.decode_with_special(&learned(&e)).unwrap(),
            "b<|im_end|>d<|im_end|>"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A template that writes a separator after each end-of-turn token.
    fn separator_template() -> ChatTemplate {
        ChatTemplate {
            source: "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}; {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}".into(),
            bos_token: "<|begin_of_text|>".into(),
            eos_token: "<|end_of_text|>".into(),
        }
    }

    /// The ids an example learns, in order.
    fn learned(e: &hlo_data::Example) -> Vec<u32> {
        e.ids
            .iter()
            .zip(&e.target)
            .filter(|(_, &t)| t)
            .map(|(&i, _)| i)
            .collect()
    }

    #[test]
    fn only_assistant_replies_are_learned_and_end_with_eos() {
        let line = serde_json::json!({"messages": [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6"},
        ]});
        let ex = example(&line, false);
        let t = Tokenizer::bytes();
        // The learned tokens are the two replies with their end of turn,
        // each followed by EOS (the template ends turns with <|eot_id|>,
        // which is not this tokenizer's EOS).
        let mut want = t.encode("4<|eot_id|>", false).unwrap();
        want.push(BYTE_EOS);
        want.extend(t.encode("6<|eot_id|>", false).unwrap());
        want.push(BYTE_EOS);
        assert_eq!(learned(&ex), want);
        // Without the EOS tokens, the ids are the rendered conversation.
        let text: Vec<u32> = ex.ids.iter().copied().filter(|&i| i != BYTE_EOS).collect();
        let rendered = ChatTemplate::from_dir(&fixtures().join("llama_style"))
            .unwrap()
            .render(
                &serde_json::from_value::<Vec<Message>>(line["messages"].clone()).unwrap(),
                false,
            )
            .unwrap();
        assert_eq!(text, t.encode(&rendered, false).unwrap());
        // --train-on-inputs learns everything.
        assert!(example(&line, true).target.iter().all(|&t| t));
    }

    #[test]
    fn a_user_turn_changes_no_label() {
        let with = |question: &str| {
            example(
                &serde_json::json!({"messages": [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": "Paris."},
                ]}),
                false,
            )
        };
        let (a, b) = (with("Capital of France?"), with("Where is the Louvre?"));
        // Same learned tokens; every user token is unlearned.
        assert_eq!(learned(&a), learned(&b));
        let n = a.target.iter().filter(|&&t| !t).count();
        assert_eq!(
            b.target.iter().filter(|&&t| !t).count() as i64 - n as i64,
            b.ids.len() as i64 - a.ids.len() as i64
        );
    }

    #[test]
    fn a_separator_after_the_end_of_turn_is_not_learned() {
        let (t, template) = (bpe(), separator_template());
        let line = serde_json::json!({"messages": [
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": "jumps over the lazy dog"},
        ]});
        let ex = bpe_example(&template, &line);
        // Exactly the reply and one end of turn: not the "; " after it,
        // and no second EOS.
        let mut want = t.encode("jumps over the lazy dog", false).unwrap();
        want.push(1);
        assert_eq!(learned(&ex), want);
        assert_eq!(
            ex.ids.iter().filter(|&&i| i == 1).count(),
            2,
            "{:?}",
            ex.ids
        );
        // The ids are the rendered conversation, nothing added.
        let rendered = template
            .render(
                &serde_json::from_value::<Vec<Message>>(line["messages"].clone()).unwrap(),
                false,
            )
            .unwrap();
        assert_eq!(ex.ids, t.encode(&rendered, false).unwrap());
    }

    #[test]
    fn a_conversation_may_open_with_a_reply() {
        // Like many real templates, this one refuses to render an empty
        // conversation, so the text before an opening reply cannot be had
        // by rendering the conversation before it.
        let t = bpe();
        let template = ChatTemplate {
            source: "{% if messages | length == 0 %}{{ raise_exception('no messages') }}{% endif %}{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}; {% endfor %}{% if add_generation_prompt %}assistant: {% endif %}".into(),
            bos_token: "<|begin_of_text|>".into(),
            eos_token: "<|end_of_text|>".into(),
        };
        assert!(template.render(&[], true).is_err());
        let line = serde_json::json!({"messages": [
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "the quick brown fox"},
            {"role": "assistant", "content": "jumps"},
        ]});
        let ex = bpe_example(&template, &line);
        let mut want = t.encode("hello", false).unwrap();
        want.push(1);
        want.extend(t.encode("jumps", false).unwrap());
        want.push(1);
        assert_eq!(learned(&ex), want);
    }
}

mod reading {
    use hlo_data::tokenizer::{Tokenizer, BYTE_EOS, BYTE_VOCAB};
    use hlo_data::{stats, Reader};

    fn reader(t: &Tokenizer, max_tokens: Option<usize>) -> Reader<'_> {
        Reader {
            tokenizer: Some(t),
            eos: Some(BYTE_EOS),
            vocab: BYTE_VOCAB,
            chat: None,
            max_tokens,
        }
    }

    fn file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("hlo-reading-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        p
    }

    #[test]
    fn bom_crlf_and_blank_lines_read_as_datasets_reads_them() {
        let t = Tokenizer::bytes();
        let plain = file("plain.jsonl", b"{\"text\": \"ab\"}\n{\"text\": \"cd\"}\n");
        let messy = file(
            "messy.jsonl",
            b"\xef\xbb\xbf{\"text\": \"ab\"}\r\n\r\n   \n{\"text\": \"cd\"}\r\n\n",
        );
        let r = reader(&t, None);
        assert_eq!(r.read_jsonl(&plain).unwrap(), r.read_jsonl(&messy).unwrap());
    }

    #[test]
    fn labels_mark_what_is_learned() {
        let t = Tokenizer::bytes();
        let r = reader(&t, None);
        let ex = r
            .parse_line(r#"{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}"#)
            .unwrap();
        assert_eq!(ex.target, vec![false, false, true, true]);
        let err = r
            .parse_line(r#"{"input_ids": [5, 6, 7], "labels": [-100, 9, 7]}"#)
            .unwrap_err();
        assert!(
            err.contains("labels[1] is 9 but input_ids[1] is 6"),
            "{err}"
        );
        let err = r
            .parse_line(r#"{"input_ids": [5, 6, 7], "labels": [-100, 6]}"#)
            .unwrap_err();
        assert!(err.contains("labels has 2 entries, input_ids 3"), "{err}");
    }

    #[test]
    fn long_text_is_cut_before_tokenizing_and_counted() {
        let t = Tokenizer::bytes();
        let long = "x".repeat(1 << 20);
        let line = serde_json::json!({"prompt": long, "completion": "Y"}).to_string();
        let cut = reader(&t, Some(32)).parse_line(&line).unwrap();
        // A row of 32 tokens keeps nothing of the completion either way.
        assert!(
            cut.ids.len() < 2048 && cut.ids.len() > 32,
            "{}",
            cut.ids.len()
        );
        let s = stats(std::slice::from_ref(&cut), 32);
        assert_eq!((s.samples, s.cut, s.no_signal, s.learned), (1, 1, 1, 0));
        // A short prompt keeps its completion within the row.
        let ok = reader(&t, Some(32))
            .parse_line(r#"{"prompt": "cat=", "completion": "CAT"}"#)
            .unwrap();
        let s = stats(&[ok], 32);
        assert_eq!((s.cut, s.no_signal, s.learned), (0, 0, 4));
    }
}
