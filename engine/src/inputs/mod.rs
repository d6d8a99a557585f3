//! What a run reads: the model (weights, tokenizer, chat template:
//! [`model`]) and the data, tokenized as its objective needs it
//! ([`dataset`]).

pub mod dataset;
pub mod model;
