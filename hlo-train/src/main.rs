//! `hlo-train`, the command line (the contract is `docs/cli.md`). Each
//! command parses its flags, calls `hlo-engine` (`serve` also `hlo-serve`;
//! `train` and `plot` write a run's report through `hlo-report`), and
//! prints: no command builds shardings or executables itself.
//!
//! Errors are printed as one line (the whole `anyhow` chain joined by `: `,
//! a multi-line plugin message joined by `; `) with exit code 2; nothing here
//! panics on user input.

mod args;
mod commands;
mod console;
mod hints;
mod objective_args;
mod outputs;
mod recipe;
mod saved_run;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::BTreeSet;
use std::ffi::OsString;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

use commands::{
    bench, compile, data, devices, dump_hlo, eval, export, generate, init, merge, plan, plot,
    score, serve, train,
};

#[derive(Parser)]
#[command(
    name = "hlo-train",
    version,
    about = "Finetune LLMs by building XLA programs in Rust and running them through PJRT plugins"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Show the plugin, its platform and PJRT API version, and its devices.
    Devices(devices::DevicesArgs),
    /// Write the program hlo-train compiles (train step or forward pass) as
    /// StableHLO and/or HLO text, from abstract shapes.
    DumpHlo(Box<dump_hlo::DumpHloArgs>),
    /// Finetune a model (LoRA by default), one compiled step over the mesh.
    Train(Box<train::TrainArgs>),
    /// Complete a prompt with a model (and PEFT adapters).
    Generate(Box<generate::GenerateArgs>),
    /// The masked mean loss and perplexity of a model (and adapter) on
    /// data: what `train` reports as eval_loss.
    Eval(Box<eval::EvalArgs>),
    /// Show training data as the model will see it (learned tokens
    /// marked) and what it holds: samples, tokens, learned tokens, cuts;
    /// `data prepare` tokenizes it once into shards a run streams.
    #[command(args_conflicts_with_subcommands = true)]
    Data(Box<data::DataArgs>),
    /// Fold a PEFT adapter into a model's weights and write an HF folder.
    Merge(merge::MergeArgs),
    /// Write a full-training run's saved state as an HF model folder
    /// (weights streamed from every process's shards).
    Export(export::ExportArgs),
    /// Write an HF model folder of a config's weights made as
    /// transformers initialises a new model (train --init random's start).
    Init(Box<init::InitArgs>),
    /// A reward model's scores of preference pairs (each side whole), and
    /// how often it ranks the chosen side higher.
    Score(Box<score::ScoreArgs>),
    /// Time the compiled train step: tokens/s, MFU, compile time, memory.
    Bench(Box<bench::BenchArgs>),
    /// What the train step needs in each device's memory, and whether it fits.
    Plan(Box<plan::PlanArgs>),
    /// Compile the train step `train` runs with the same flags, once, for
    /// --target's devices (a GPU's own XLA compiler needs no GPU), into a
    /// file `train --executable` loads instead of compiling.
    Compile(Box<compile::CompileArgs>),
    /// Draw the train and eval loss of a metrics file as an SVG chart.
    Plot(plot::PlotArgs),
    /// Serve a model and many LoRA adapters over an OpenAI-compatible HTTP
    /// API, all requests in one continuous batch.
    Serve(Box<serve::ServeArgs>),
}

/// A failed allocation (a file far too large for memory, say) ends the
/// process like any other error: one line and exit code 2, instead of
/// Rust's abort.
struct OneLineOnOutOfMemory;

#[global_allocator]
static ALLOCATOR: OneLineOnOutOfMemory = OneLineOnOutOfMemory;

// SAFETY: every call is forwarded to the system allocator unchanged; a
// null result ends the process instead of being returned.
unsafe impl GlobalAlloc for OneLineOnOutOfMemory {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        checked(System.alloc(layout), layout.size())
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        checked(System.alloc_zeroed(layout), layout.size())
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        checked(System.realloc(ptr, layout, new_size), new_size)
    }
}

fn checked(ptr: *mut u8, size: usize) -> *mut u8 {
    if ptr.is_null() {
        out_of_memory(size);
    }
    ptr
}

/// Prints one line without allocating, and exits with code 2.
fn out_of_memory(size: usize) -> ! {
    static ONCE: AtomicBool = AtomicBool::new(false);
    if ONCE.swap(true, Ordering::SeqCst) {
        std::process::abort();
    }
    let mut line = [0u8; 96];
    let head = b"error: out of memory: an allocation of ";
    let tail = b" bytes failed\n";
    line[..head.len()].copy_from_slice(head);
    let mut at = head.len();
    let mut digits = [0u8; 20];
    let (mut n, mut k) = (size, digits.len());
    loop {
        k -= 1;
        digits[k] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    line[at..at + digits.len() - k].copy_from_slice(&digits[k..]);
    at += digits.len() - k;
    line[at..at + tail.len()].copy_from_slice(tail);
    at += tail.len();
    let _ = std::io::Write::write_all(&mut std::io::stderr(), &line[..at]);
    std::process::exit(2)
}

fn main() -> ExitCode {
    // XLA logs through absl to stderr; its INFO and ERROR lines would repeat,
    // less clearly, what PJRT returns to us and we print. Set before any
    // plugin loads (and before any thread starts); a user can override it.
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    }
    let argv: Vec<OsString> = std::env::args_os().collect();
    // A recipe's settings become flags before anything is parsed.
    let argv = match recipe::expand(&argv, &Cli::command()) {
        Ok(argv) => argv,
        Err(e) => {
            eprintln!("error: {}", one_line(&format!("{e:#}")));
            return ExitCode::from(2);
        }
    };
    let parsed = Cli::command()
        .try_get_matches_from(&argv)
        .and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            // --help and --version are not errors.
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // A TRL or transformers name gets the flag that means it.
            match hints::usage_hint(&e, &argv, &Cli::command()) {
                Some(hint) => eprintln!("error: {hint}"),
                None => eprintln!("{}", args::usage_error(&e)),
            }
            return ExitCode::from(2);
        }
    };
    // A run over several processes that cannot be is refused by every
    // process before any of them loads anything or waits for the others.
    let launch = match &cli.command {
        Command::Devices(a) => a.plugin.check_launch("devices"),
        Command::DumpHlo(a) => a.plugin.check_launch("dump-hlo"),
        Command::Train(a) => a.plugin.check_launch("train"),
        Command::Compile(a) => a.train.plugin.check_launch("compile"),
        Command::Generate(a) => a.plugin.check_launch("generate"),
        Command::Eval(a) => a.plugin.check_launch("eval"),
        Command::Score(a) => a.plugin.check_launch("score"),
        Command::Bench(a) => a.plugin.check_launch("bench"),
        Command::Serve(a) => a.plugin.check_launch("serve"),
        Command::Data(_)
        | Command::Merge(_)
        | Command::Export(_)
        | Command::Init(_)
        | Command::Plan(_)
        | Command::Plot(_) => Ok(()),
    };
    if let Err(e) = launch {
        eprintln!("error: {}", one_line(&format!("{e:#}")));
        return ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Devices(args) => devices::run(&args),
        Command::DumpHlo(args) => dump_hlo::run(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Eval(args) => eval::run(&args),
        Command::Score(args) => score::run(&args),
        Command::Data(args) => data::run(&args),
        Command::Serve(args) => serve::run(&args),
        Command::Train(args) => train::run(*args, &given_flags(&matches, "train"), &argv),
        Command::Compile(args) => compile::run(&args, &given_flags(&matches, "compile")),
        Command::Merge(args) => merge::run(&args),
        Command::Export(args) => export::run(&args),
        Command::Init(args) => init::run(&args),
        // A step that does not fit exits 1, its report printed.
        Command::Plan(args) => match plan::run(&args) {
            Ok(false) => return ExitCode::from(1),
            other => other.map(|_| ()),
        },
        Command::Plot(args) => plot::run(&args),
        Command::Bench(args) => bench::run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", one_line(&format!("{e:#}")));
            ExitCode::from(2)
        }
    }
}

/// The flags of `command` the command line (or the environment) gives,
/// not their defaults: what `train --resume` takes anew.
fn given_flags(matches: &clap::ArgMatches, command: &str) -> BTreeSet<String> {
    let Some(m) = matches.subcommand_matches(command) else {
        return BTreeSet::new();
    };
    m.ids()
        .filter(|id| {
            matches!(
                m.value_source(id.as_str()),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        })
        .map(|id| id.as_str().to_string())
        .collect()
}

/// Joins a multi-line message (an MLIR diagnostic, say) into one line.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}
