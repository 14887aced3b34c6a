//! Command-line definitions.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// floodgate: a rate limiter you can run as a service or link as a library.
#[derive(Debug, Parser)]
#[command(name = "floodgate", version, about, long_about = None)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Replay a trace of requests (JSON lines on stdin) through an algorithm.
    ///
    /// Each input line is {"at_ms": 1200, "key": "alice", "hits": 1} (hits
    /// optional, default 1; at_ms non-decreasing, read as the clock, so
    /// windows align to at_ms = 0). Each output line is the decision:
    /// {"allowed": true, "remaining": 4, "reset_after_ms": 800,
    /// "retry_after_ms": null}, with waits rounded up to whole milliseconds.
    ///
    /// With --report, runs every algorithm on the trace instead and prints
    /// how often each disagrees with sliding_log, the exact answer.
    Simulate(SimulateArgs),
    /// Check a rules directory: every error with file:line:col and what to
    /// write instead (exit 64), or a summary of what it holds (exit 0).
    Validate(ValidateArgs),
}

#[derive(Debug, Args)]
pub(crate) struct ValidateArgs {
    /// Directory of rules files (*.yaml, *.yml; searched recursively).
    pub(crate) dir: PathBuf,
}

#[derive(Debug, Args)]
pub(crate) struct SimulateArgs {
    /// fixed_window, sliding_log, sliding_window, sliding_buckets,
    /// token_bucket, gcra or leaky_bucket (optional with --report).
    #[arg(long, required_unless_present = "report")]
    pub(crate) algorithm: Option<String>,
    /// Requests (units) per window.
    #[arg(long)]
    pub(crate) limit: u64,
    /// Window: 250ms, 1s, 90s, 1m, 1h, 1d...
    #[arg(long)]
    pub(crate) window: String,
    /// Capacity of token_bucket, gcra, leaky_bucket (default: the limit).
    #[arg(long)]
    pub(crate) burst: Option<u64>,
    /// Sub-windows of sliding_buckets (with --report, default: about 10).
    #[arg(long)]
    pub(crate) granularity: Option<u32>,
    /// leaky_bucket mode: meter (default) or shape (adds "delay_ms").
    #[arg(long)]
    pub(crate) mode: Option<String>,
    /// Compare every algorithm with the exact sliding_log instead of printing
    /// decisions.
    #[arg(long)]
    pub(crate) report: bool,
}
