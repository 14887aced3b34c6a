//! floodgate command line.
//!
//! Exit codes, for every command: 0 success, 1 denied (`check`), 2 runtime
//! failure, 64 bad usage, bad config or bad input.

mod bench;
mod check;
mod cli;
mod exit;
mod keys;
mod serve;
mod simulate;
mod validate;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and succeed; the rest is
            // bad usage.
            let code = if e.use_stderr() { exit::USAGE } else { exit::OK };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    let result = match cli.command {
        cli::Command::Simulate(args) => simulate::run(&args),
        cli::Command::Validate(args) => validate::run(&args),
        cli::Command::Serve(args) => serve::run(&args),
        cli::Command::Proxy(args) => serve::run_proxy(&args),
        cli::Command::Check(args) => check::run(&args),
        cli::Command::Bench(args) => bench::run(&args),
        cli::Command::Keys(args) => keys::run(&args),
    };
    match result {
        Ok(()) => ExitCode::from(exit::OK),
        Err(e) => {
            if !e.to_string().is_empty() {
                eprintln!("floodgate: {e}");
            }
            ExitCode::from(e.code)
        }
    }
}
