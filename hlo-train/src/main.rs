//! `hlo-train`, the command line (the contract is `docs/cli.md`). Each
//! command parses its flags, calls `hlo-engine`, and prints: no command
//! builds shardings or executables itself.
//!
//! Errors are printed as one line (the whole `anyhow` chain joined by `: `,
//! a multi-line plugin message joined by `; `) with exit code 2; nothing here
//! panics on user input.

mod args;
mod bench;
mod console;
mod devices;
mod dump_hlo;
mod generate;
mod merge;
mod plan;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "hlo-train",
    version,
    about = "Finetune LLMs by building XLA programs in Rust and running them through PJRT plugins"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the plugin, its platform and PJRT API version, and its devices.
    Devices(devices::DevicesArgs),
    /// Write the program hlo-train compiles (train step or forward pass) as
    /// StableHLO and/or HLO text, from abstract shapes.
    DumpHlo(Box<dump_hlo::DumpHloArgs>),
    /// Finetune a Llama model (LoRA by default), one compiled step over the mesh.
    Train(Box<train::TrainArgs>),
    /// Complete a prompt with a Llama model (and PEFT adapters).
    Generate(Box<generate::GenerateArgs>),
    /// Fold a PEFT adapter into a model's weights and write an HF folder.
    Merge(merge::MergeArgs),
    /// Time the compiled train step: tokens/s, MFU, compile time, memory.
    Bench(Box<bench::BenchArgs>),
    /// What the train step needs in each device's memory, and whether it fits.
    Plan(Box<plan::PlanArgs>),
}

fn main() -> ExitCode {
    // XLA logs through absl to stderr; its INFO and ERROR lines would repeat,
    // less clearly, what PJRT returns to us and we print. Set before any
    // plugin loads (and before any thread starts); a user can override it.
    if std::env::var_os("TF_CPP_MIN_LOG_LEVEL").is_none() {
        std::env::set_var("TF_CPP_MIN_LOG_LEVEL", "3");
    }
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version are not errors.
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // A usage error, like every other, is one line.
            let text = e.render().to_string();
            let message: Vec<&str> = text
                .lines()
                .take_while(|l| !l.trim().is_empty() && !l.starts_with("Usage:"))
                .map(str::trim)
                .collect();
            eprintln!("{} (see --help)", message.join(" "));
            return ExitCode::from(2);
        }
    };
    let result = match cli.command {
        Command::Devices(args) => devices::run(&args),
        Command::DumpHlo(args) => dump_hlo::run(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Train(args) => train::run(&args),
        Command::Merge(args) => merge::run(&args),
        Command::Plan(args) => plan::run(&args),
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

/// Joins a multi-line message (an MLIR diagnostic, say) into one line.
fn one_line(message: &str) -> String {
    message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
}
