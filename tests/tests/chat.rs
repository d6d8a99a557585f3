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
    use hlo_data::{parse_line_with, ChatData};

    fn example(line: &serde_json::Value, train_on_inputs: bool) -> hlo_data::Example {
        let template = ChatTemplate::from_dir(&fixtures().join("llama_style")).unwrap();
        let chat = ChatData {
            template: &template,
            stop: vec![BYTE_EOS],
            train_on_inputs,
        };
        let t = Tokenizer::bytes();
        parse_line_with(
            &line.to_string(),
            Some(&t),
            Some(BYTE_EOS),
            1 << 20,
            Some(&chat),
        )
        .unwrap()
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
        let learned: Vec<u32> = ex
            .ids
            .iter()
            .zip(&ex.target)
            .filter(|(_, &t)| t)
            .map(|(&i, _)| i)
            .collect();
        let mut want = t.encode("4<|eot_id|>", false).unwrap();
        want.push(BYTE_EOS);
        want.extend(t.encode("6<|eot_id|>", false).unwrap());
        want.push(BYTE_EOS);
        assert_eq!(learned, want);
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
        let learned = |e: &hlo_data::Example| -> Vec<u32> {
            e.ids
                .iter()
                .zip(&e.target)
                .filter(|(_, &t)| t)
                .map(|(&i, _)| i)
                .collect()
        };
        assert_eq!(learned(&a), learned(&b));
        let n = a.target.iter().filter(|&&t| !t).count();
        assert_eq!(
            b.target.iter().filter(|&&t| !t).count() as i64 - n as i64,
            b.ids.len() as i64 - a.ids.len() as i64
        );
    }
}
