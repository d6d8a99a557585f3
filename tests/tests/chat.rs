//! Chat templates rendered by minijinja equal jinja2's rendering in HF's
//! mode (fixtures from scripts/make_chat_fixture.py), errors included.

use std::path::{Path, PathBuf};

use hlo_models::chat::{ChatTemplate, Message};
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
