//! The command line: parses arguments into each command's options and calls
//! the library. Errors are printed with their whole chain; the exit code is
//! 1 for a failed run, 2 for a usage error and 130 for a run stopped by
//! Ctrl-C or SIGTERM after saving its work.

mod check;
mod data;
mod dataset_flags;
mod eval;
mod generate;
mod listen_flags;
mod merge;
mod peft_flags;
mod pipeline;
mod reward;
mod score;
mod serve;
mod sft;
mod study;
mod train;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Fast RLHF for Hugging Face causal language models.
#[derive(Debug, Parser)]
#[command(name = "rloo", version, about, propagate_version = true)]
pub struct Cli {
    /// Log more (-v: debug, -vv: trace). RUST_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Check(check::CheckArgs),
    /// Datasets: `rloo data inspect`, `rloo data prepare`.
    #[command(subcommand)]
    Data(data::DataCommand),
    Eval(eval::EvalArgs),
    Generate(generate::GenerateArgs),
    Merge(merge::MergeArgs),
    Pipeline(pipeline::PipelineArgs),
    /// Reward models: `rloo reward train`.
    #[command(subcommand)]
    Reward(reward::RewardCommand),
    Score(score::ScoreArgs),
    Serve(serve::ServeArgs),
    Sft(sft::SftArgs),
    Study(study::StudyArgs),
    Train(train::TrainArgs),
}

pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Check(args) => check::run(args),
        Command::Data(cmd) => data::run(cmd),
        Command::Eval(args) => eval::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Merge(args) => merge::run(args),
        Command::Pipeline(args) => pipeline::run(args),
        Command::Reward(cmd) => reward::run(cmd),
        Command::Score(args) => score::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Sft(args) => sft::run(args),
        Command::Study(args) => study::run(args),
        Command::Train(args) => train::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err}");
            for cause in err.chain().skip(1) {
                eprintln!("  caused by: {cause}");
            }
            let interrupted = err.chain().any(|c| matches!(c.downcast_ref(), Some(rloo::Error::Interrupted(_))));
            if interrupted {
                ExitCode::from(rloo::train::stop::EXIT_INTERRUPTED)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// A progress bar on stderr that hides itself when stderr is not a terminal.
pub(crate) fn progress_bar(len: u64, unit: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    let template = format!(
        "{{spinner}} [{{elapsed_precise}}] {{bar:40}} {{pos}}/{{len}} {unit} ({{per_sec}}, eta {{eta}}) {{msg}}"
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(&template) {
        bar.set_style(style);
    }
    bar
}
