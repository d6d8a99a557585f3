//! Any text as a line of training data: an example or an error, never a
//! panic; every token id of an example is inside the vocabulary.
#![no_main]

use hlo_data::parse_line;
use hlo_data::Tokenizer;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|line: &str| {
    let tokenizer = Tokenizer::bytes();
    let vocab = hlo_data::tokenizer::BYTE_VOCAB;
    if let Ok(example) = parse_line(line, Some(&tokenizer), Some(1), vocab) {
        assert!(example.ids.iter().all(|&t| (t as i64) < vocab));
        assert_eq!(example.ids.len(), example.target.len());
    }
});
