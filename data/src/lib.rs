//! `hlo-data` owns what a model is trained on, up to the rows a step takes:
//! tokenizers (HF `tokenizer.json`, and the byte-level one of the `tiny`
//! model), chat templates rendered as transformers renders them
//! ([`chat`]), readers of JSONL training data in its four shapes
//! (`{"text"}`, `{"prompt", "completion"}`, `{"messages"}`,
//! `{"input_ids"}`) and the bundled demo task ([`reader`]), and the
//! [`Loader`]: rows cut or padded to a length, packed or not, shuffled by a
//! seed, with a cursor to resume from; prompt files for generation
//! ([`prompts`]); and preference pairs for DPO and its kin, read as TRL
//! reads them ([`pairs`]).
//!
//! It knows no model, device or program: a batch is plain vectors, which
//! `hlo-engine` places on the devices. Its only workspace dependency is
//! `hlo-ir`, for the shared seeded generator.
//!
//! ```
//! use hlo_data::{demo_examples, Loader, Tokenizer};
//! let examples = demo_examples(&Tokenizer::bytes(), Some(hlo_data::tokenizer::BYTE_EOS), 32, 0);
//! let mut loader = Loader::new(examples, 16, 4, 0);
//! let batch = loader.next_batch().unwrap();
//! assert_eq!(batch.ids.len(), 4 * 16);
//! assert_eq!(loader.cursor, 4);
//! ```

pub mod chat;
mod error;
pub mod loader;
pub mod lock;
pub mod pairs;
pub mod prompts;
pub mod reader;
pub mod reward;
pub mod tokenizer;
pub mod tokens;
pub mod unpaired;

pub use chat::{ChatTemplate, Message};
pub use error::DataError;
pub use loader::{eval_batches, eval_pair_batches, Batch, Loader};
pub use pairs::{
    demo_pairs, eos_token_text, first_row, is_preference_data, is_preference_row,
    special_token_text, PreferencePair,
};
pub use prompts::{jsonl_lines, read_prompts, Prompt, PromptLine};
pub use reader::{
    alpaca_prompt, data_files, demo_examples, demo_prompt_rows, is_parquet, parse_line, stats,
    ChatData, DataStats, Example, Reader,
};
pub use reward::RewardPair;
pub use tokenizer::Tokenizer;
pub use tokens::{is_token_dir, TokenShards};
pub use unpaired::Unpaired;
