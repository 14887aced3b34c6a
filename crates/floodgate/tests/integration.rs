//! The command line's integration tests, one binary for all of them (one
//! link instead of ten; ripgrep does the same): each module drives the real
//! `floodgate` binary.

// What the tests share: running the binary, a WebDriver client, test hosts.
mod browser;
mod cli;
mod net;

mod dashboard_browser;
mod defaults_cli;
mod deploy;
mod docs;
mod keys_cli;
mod metering_cli;
mod proxy_cli;
mod redis_cli;
mod regions_cli;
mod regions_cluster_cli;
mod serve_cli;
mod simulate_cli;
mod validate_cli;
