//! `floodgate validate DIR`: load a rules directory and report every problem.

use std::fmt::Write as _;
use std::io::Write;
use std::path::Path;

use floodgate_core::rules::{LoadOptions, RuleSet};

use crate::cli::ValidateArgs;
use crate::exit::Failure;

pub(crate) fn run(args: &ValidateArgs) -> Result<(), Failure> {
    let set = load(&args.dir)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} files, {} domains, {} rules",
        args.dir.display(),
        set.files().len(),
        set.domains().count(),
        set.rule_count()
    );
    let mut domains: Vec<_> = set.domains().collect();
    domains.sort_by_key(|d| d.name());
    for d in domains {
        let file = set.files().get(d.file()).map(|f| f.display().to_string()).unwrap_or_default();
        let _ = writeln!(out, "  {:<20} {:>6} rules  {file}", d.name(), d.rules().count());
    }
    for w in set.warnings() {
        let _ = writeln!(out, "warning: {w}");
    }
    std::io::stdout().write_all(out.as_bytes()).map_err(|e| Failure::runtime(format!("writing stdout: {e}")))
}

/// Load rules, turning every error into one bad-config failure (exit 64).
pub(crate) fn load(dir: &Path) -> Result<RuleSet, Failure> {
    RuleSet::load_dir(dir, &LoadOptions::default()).map_err(|errors| {
        let n = errors.0.len();
        Failure::usage(format!("{errors}\n{n} error{} in {}", if n == 1 { "" } else { "s" }, dir.display()))
    })
}
