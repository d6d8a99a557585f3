//! The data formats of the ecosystem read as their equivalents: Parquet
//! (single files and folders of shards, as HF `datasets` exports them)
//! as the same rows in JSONL, alpaca rows as Stanford Alpaca's prompt and
//! completion, sharegpt rows as chat messages. The fixtures are made by
//! `scripts/make_data_fixtures.py` with `datasets` and pyarrow; the
//! equivalent rows are written there from the formats' own definitions.

use std::path::{Path, PathBuf};

use hlo_data::chat::ChatTemplate;
use hlo_data::tokenizer::{Tokenizer, BYTE_EOS, BYTE_VOCAB};
use hlo_data::{ChatData, Example, Reader};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/data")
        .join(name)
}

/// Reads `name` with the byte tokenizer and the llama-style fixture
/// template (replies end at the byte EOS).
fn read(name: &str) -> Result<Vec<Example>, String> {
    let template = ChatTemplate::from_dir(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/chat/llama_style"),
    )
    .unwrap();
    let chat = ChatData {
        template: &template,
        stop: vec![BYTE_EOS],
        train_on_inputs: false,
    };
    let t = Tokenizer::bytes();
    Reader {
        tokenizer: Some(&t),
        eos: Some(BYTE_EOS),
        vocab: BYTE_VOCAB,
        chat: Some(&chat),
        max_tokens: Some(4096),
    }
    .read_path(&fixture(name))
    .map_err(|e| e.to_string())
}

#[test]
fn parquet_rows_read_as_the_same_rows_in_jsonl() {
    for (jsonl, parquet) in [
        ("rows.jsonl", "rows.parquet"),
        ("ids.jsonl", "ids.parquet"),
        ("alpaca.jsonl", "alpaca.parquet"),
        ("sharegpt.jsonl", "sharegpt.parquet"),
    ] {
        let want = read(jsonl).unwrap();
        assert!(want.len() >= 2, "{jsonl}");
        assert_eq!(read(parquet).unwrap(), want, "{parquet}");
    }
    // The mixed file holds text rows (every token learned) and
    // prompt/completion rows (the completion only): nulls are absent fields.
    let rows = read("rows.parquet").unwrap();
    assert_eq!(rows.len(), 24);
    assert!(rows[0].target[1..].iter().all(|&t| t));
    assert!(!rows[1].target[1]);
}

#[test]
fn a_folder_of_shards_reads_as_the_whole_file() {
    let whole = read("rows.parquet").unwrap();
    assert_eq!(read("shards").unwrap(), whole);
    let files = hlo_data::data_files(&fixture("shards")).unwrap();
    let names: Vec<_> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "train-00000-of-00002.parquet",
            "train-00001-of-00002.parquet"
        ]
    );
}

#[test]
fn alpaca_rows_are_stanford_alpacas_prompt_and_completion() {
    let alpaca = read("alpaca.jsonl").unwrap();
    assert_eq!(alpaca, read("alpaca_as_prompt_completion.jsonl").unwrap());
    // Only the output (and its EOS) is learned.
    let learned: Vec<u8> = alpaca[0]
        .ids
        .iter()
        .zip(&alpaca[0].target)
        .filter(|(_, &t)| t)
        .map(|(&id, _)| id as u8)
        .collect();
    assert_eq!(&learned[..3], b"CAT");
    assert_eq!(learned.len(), 4);
}

#[test]
fn sharegpt_rows_are_their_chat_messages() {
    let sharegpt = read("sharegpt.jsonl").unwrap();
    assert_eq!(sharegpt, read("sharegpt_as_messages.jsonl").unwrap());
    assert!(sharegpt[0].target.iter().any(|&t| t));
}

#[test]
fn bad_rows_and_files_are_errors_naming_them() {
    let err = read("bad_row.parquet").unwrap_err();
    assert!(
        err.contains("bad_row.parquet: row 3: expected"),
        "unexpected error: {err}"
    );
    let dir = std::env::temp_dir().join(format!("hlo-data-formats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // JSONL under a Parquet name.
    let fake = dir.join("fake.parquet");
    std::fs::copy(fixture("rows.jsonl"), &fake).unwrap();
    let t = Tokenizer::bytes();
    let reader = byte_reader(&t);
    let err = reader.read_path(&fake).unwrap_err().to_string();
    assert!(
        err.contains("fake.parquet: not a readable Parquet file"),
        "{err}"
    );
    // A folder without data files.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let err = reader.read_path(&empty).unwrap_err().to_string();
    assert!(err.contains("holds no *.parquet or *.jsonl files"), "{err}");
    // sharegpt turns from other roles, and per-turn weights, are refused.
    for (row, want) in [
        (
            r#"{"conversations": [{"from": "tool", "value": "x"}]}"#,
            "conversations[0] is from `tool`",
        ),
        (
            r#"{"conversations": [{"from": "gpt", "value": "x", "weight": 0}]}"#,
            "conversations[0] sets `weight`",
        ),
        (
            r#"{"instruction": "a", "input": 3, "output": "b"}"#,
            "input is not a string",
        ),
        // One row, two shapes: which is meant cannot be guessed.
        (
            r#"{"text": "a", "prompt": "b", "completion": "c"}"#,
            "holds both text and prompt/completion",
        ),
        (
            r#"{"text": "a", "messages": [{"role": "user", "content": "b"}]}"#,
            "holds both text and messages",
        ),
        // Ids out of range, named as such (and where).
        (
            r#"{"input_ids": [5, -1]}"#,
            "input_ids[1] is -1: a token id is not negative",
        ),
        (
            r#"{"input_ids": [4294967297, 5]}"#,
            "input_ids[0] is 4294967297, beyond any vocabulary",
        ),
        (
            r#"{"input_ids": [5, 1.5]}"#,
            "input_ids[1] is 1.5, not a token id",
        ),
    ] {
        let err = reader.parse_line(row).unwrap_err();
        assert!(err.contains(want), "{row}: {err}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A reader of byte-tokenized rows, with no chat template or cut.
fn byte_reader(t: &Tokenizer) -> Reader<'_> {
    Reader {
        tokenizer: Some(t),
        eos: Some(BYTE_EOS),
        vocab: BYTE_VOCAB,
        chat: None,
        max_tokens: None,
    }
}

/// Writes a Parquet file of one column `text` stored as plain bytes (no
/// string type), as a writer that forgets the UTF-8 annotation leaves it.
fn binary_text_parquet(path: &Path) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let schema = parse_message_type("message rows { required binary text; }").unwrap();
    let file = std::fs::File::create(path).unwrap();
    let props = std::sync::Arc::new(WriterProperties::builder().build());
    let mut writer = SerializedFileWriter::new(file, schema.into(), props).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let mut column = group.next_column().unwrap().unwrap();
    let values = [
        ByteArray::from("cat=CAT"),
        ByteArray::from(vec![0xffu8, 0xfe]),
    ];
    column
        .typed::<ByteArrayType>()
        .write_batch(&values, None, None)
        .unwrap();
    column.close().unwrap();
    group.close().unwrap();
    writer.close().unwrap();
}

#[test]
fn a_binary_parquet_column_is_refused_naming_it_and_the_row() {
    let dir = std::env::temp_dir().join(format!("hlo-data-binary-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("binary.parquet");
    binary_text_parquet(&path);
    let t = Tokenizer::bytes();
    let reader = byte_reader(&t);
    let err = reader.read_path(&path).unwrap_err().to_string();
    assert!(
        err.contains("binary.parquet: row 1: column `text` is binary"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
