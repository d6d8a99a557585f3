//! The subcommands, one module each (`data prepare` in `prepare.rs`): a
//! command's flags (its args struct) and its `run`, which parses them,
//! calls the engine and prints. The flag groups, printing and saved-run
//! reading that several commands share live beside this folder (`args.rs`,
//! `console.rs`, `outputs.rs`, `saved_run.rs`, ...), not in it.

pub(crate) mod bench;
pub(crate) mod compile;
pub(crate) mod data;
pub(crate) mod devices;
pub(crate) mod dump_hlo;
pub(crate) mod eval;
pub(crate) mod export;
pub(crate) mod generate;
pub(crate) mod init;
pub(crate) mod merge;
pub(crate) mod plan;
pub(crate) mod plot;
pub(crate) mod prepare;
pub(crate) mod score;
pub(crate) mod serve;
pub(crate) mod train;
