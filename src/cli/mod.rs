//! The command line: parses arguments into each command's options and calls
//! the library. Errors are printed with their whole chain; the exit code is
//! 1 for a failed run, 2 for a usage error and 130 for a run stopped by
//! Ctrl-C or SIGTERM after saving its work.

mod check;
mod config_flags;
mod data;
mod dataset_flags;
mod eval;
mod generate;
mod launch;
mod listen_flags;
mod merge;
mod pipeline;
mod reward;
mod score;
mod serve;
mod sft;
mod study;
mod supervised;
mod train;

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

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
    Launch(launch::LaunchArgs),
    Merge(merge::MergeArgs),
    Pipeline(pipeline::PipelineArgs),
    /// Reward models: `rloo reward train`, `rloo reward serve`.
    #[command(subcommand)]
    Reward(reward::RewardCommand),
    Score(score::ScoreArgs),
    Serve(serve::ServeArgs),
    /// Fine-tune a causal LM on demonstrations (cross-entropy on completion tokens).
    ///
    /// Rows are `{"prompt", "completion"}` (strings or chat messages),
    /// `{"messages": [...]}` (the last assistant message is the completion), or
    /// `{"text"}`. An EOS token ends text completions. Options come from a TOML
    /// file, then `--set key=value`, then flags.
    Sft(sft::SftArgs),
    Study(study::StudyArgs),
    /// Train a policy with REINFORCE Leave-One-Out (or PPO): a TOML file, `--set` overrides and TRL's flags.
    Train(train::TrainArgs),
}

pub fn main() -> ExitCode {
    let mut cmd = both_spellings(Cli::command());
    let matches = cmd.get_matches_mut();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| {
        // Errors found while reading the flags show the usage of the command given.
        let (mut given, mut m) = (cmd.clone(), &matches);
        while let Some((name, sub)) = m.subcommand() {
            let Some(c) = given.find_subcommand(name) else { break };
            (given, m) = (c.clone(), sub);
        }
        e.format(&mut given).exit()
    });
    init_logging(cli.verbose);
    let result = match cli.command {
        Command::Check(args) => check::run(args),
        Command::Data(cmd) => data::run(cmd),
        Command::Eval(args) => eval::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Launch(args) => launch::run(args),
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
            // In a data-parallel job every rank reports its own failure.
            let rank = rloo::dist::rank_from_env().map_or(String::new(), |(rank, _)| format!("[rank {rank}] "));
            eprintln!("{rank}error: {err}");
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

/// Every long flag of every command under both spellings, `--max_length`
/// and `--max-length`, as TRL's scripts and the seeds' commands use both.
fn both_spellings(cmd: clap::Command) -> clap::Command {
    let cmd = cmd.mut_args(|arg| {
        let Some(long) = arg.get_long() else { return arg };
        let other = if long.contains('_') { long.replace('_', "-") } else { long.replace('-', "_") };
        if other == long {
            arg
        } else {
            arg.alias(other)
        }
    });
    let names: Vec<String> = cmd.get_subcommands().map(|s| s.get_name().to_string()).collect();
    names.iter().fold(cmd, |cmd, name| cmd.mut_subcommand(name, both_spellings))
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        // The other ranks of a data-parallel job say only what goes wrong.
        0 if rloo::dist::rank_from_env().is_some_and(|(rank, _)| rank > 0) => "warn",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_flag_takes_both_spellings_without_clashes() {
        let cmd = both_spellings(Cli::command());
        cmd.clone().debug_assert();
        for args in [
            &["rloo", "generate", "--model", "m", "--prompts", "p", "--output", "o", "--ignore_eos"][..],
            &["rloo", "generate", "--model", "m", "--prompts", "p", "--output", "o", "--ignore-eos"],
            &["rloo", "serve", "--model", "m", "--api_key_env", "KEY", "--max-body-mib", "8"],
        ] {
            if let Err(e) = cmd.clone().try_get_matches_from(args) {
                panic!("{args:?}: {e}");
            }
        }
    }
}
