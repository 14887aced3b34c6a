//! `floodgate simulate`: replay a trace through one algorithm, or compare all
//! of them with the exact `sliding_log` (`--report`).

use std::io::{self, BufRead, BufWriter, Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use floodgate::trace::{Event, for_each_event};
use floodgate_core::{
    Algorithm, AlgorithmKind, Decision, LeakyMode, Limit, LimitError, MAX_GRANULARITY, ManualClock, MemoryStore,
    parse_duration,
};

use crate::cli::SimulateArgs;
use crate::exit::Failure;

/// A store per algorithm, keyed like the trace; unbounded (a simulation
/// should not evict) and fed explicit times.
type SimStore = MemoryStore<ManualClock>;

fn store() -> SimStore {
    MemoryStore::builder().clock(ManualClock::new(0)).max_keys(usize::MAX >> 1).build()
}

mod budget;
mod plot;
mod regions;

pub(crate) fn run(args: &SimulateArgs) -> Result<(), Failure> {
    if args.regions.goals {
        return regions::goals(args);
    }
    if args.regions.regions.is_some() {
        return regions::run(args);
    }
    let (Some(limit), Some(window)) = (args.limit, args.window.as_deref()) else {
        return Err(Failure::usage("give --limit and --window"));
    };
    let window = parse_duration(window).map_err(|e| Failure::usage(format!("--window: {e}")))?;
    if args.budget {
        let stdout = BufWriter::new(io::stdout().lock());
        return match args.table {
            true => budget::table(stdout, limit, window, 1),
            false => budget::run(io::stdin().lock(), stdout, limit, window),
        };
    }
    let mode = args.mode.as_deref().map(str::parse::<LeakyMode>).transpose().map_err(usage("--mode"))?;
    let stdout = BufWriter::with_capacity(1 << 16, io::stdout().lock());
    // With --plot the trace is read whole first: it is replayed once for
    // the decisions or the table, once for the picture.
    let plot_to = args.plot.as_deref().map(plot_target).transpose()?;
    let mut trace = Vec::new();
    if plot_to.is_some() {
        io::stdin().lock().read_to_end(&mut trace).map_err(|e| Failure::runtime(format!("reading stdin: {e}")))?;
    }
    let input: Box<dyn BufRead> = if plot_to.is_some() { Box::new(&trace[..]) } else { Box::new(io::stdin().lock()) };
    let (result, plotted) = if args.report {
        let limits = report_limits(args, limit, window, mode)?;
        (report(input, stdout, &limits), limits)
    } else {
        let name = args.algorithm.as_deref().unwrap_or_default();
        let kind: AlgorithmKind = name.parse().map_err(usage("--algorithm"))?;
        let algorithm =
            Algorithm::from_parts(kind, args.burst, args.granularity, mode).map_err(usage("--algorithm"))?;
        let limit = Limit::new(algorithm, limit, window).map_err(usage("--limit/--window"))?;
        // The picture sets the exact answer beside the chosen algorithm.
        let mut plotted = Vec::new();
        if plot_to.is_some() {
            if kind != AlgorithmKind::SlidingLog {
                let exact = Limit::new(Algorithm::SlidingLog, limit.limit(), window)
                    .map_err(usage("--plot needs sliding_log's limits"))?;
                plotted.push(("sliding_log (exact)".to_owned(), exact));
            }
            plotted.push((name.to_owned(), limit.clone()));
        }
        (replay(input, stdout, &limit), plotted)
    };
    let result = match (result, plot_to) {
        (Ok(()) | Err(Failure { code: crate::exit::OK, .. }), Some((path, html))) => {
            let picture = plot::plot(&trace, &plotted, html)?;
            std::fs::write(&path, picture)
                .map_err(|e| Failure::runtime(format!("--plot {}: cannot write: {e}", path.display())))
        }
        (other, _) => other,
    };
    match result {
        Err(Failure { code: crate::exit::OK, .. }) => Ok(()),
        other => other,
    }
}

/// `--plot`'s file and whether it is HTML (`.html`, `.htm`) or SVG (`.svg`).
fn plot_target(path: &str) -> Result<(PathBuf, bool), Failure> {
    let lower = path.to_ascii_lowercase();
    if lower.ends_with(".svg") {
        Ok((PathBuf::from(path), false))
    } else if lower.ends_with(".html") || lower.ends_with(".htm") {
        Ok((PathBuf::from(path), true))
    } else {
        Err(Failure::usage(format!("--plot {path}: name a .svg or .html file")))
    }
}

fn usage(flag: &'static str) -> impl Fn(LimitError) -> Failure {
    move |e| Failure::usage(format!("{flag}: {e}"))
}

/// Print one decision line per event.
fn replay(input: impl BufRead, mut out: impl Write, limit: &Limit) -> Result<(), Failure> {
    let store = store();
    let shape = matches!(limit.algorithm(), Algorithm::LeakyBucket { mode: LeakyMode::Shape, .. });
    for_each_event(input, |ev| {
        let d = decide(&store, limit, ev)?;
        write!(
            out,
            "{{\"allowed\": {}, \"remaining\": {}, \"reset_after_ms\": {}, \"retry_after_ms\": ",
            d.allowed,
            d.remaining,
            ms(d.reset_after)
        )
        .and_then(|()| match d.retry_after {
            Some(r) => write!(out, "{}", ms(r)),
            None => out.write_all(b"null"),
        })
        .and_then(|()| if shape { writeln!(out, ", \"delay_ms\": {}}}", ms(d.delay)) } else { out.write_all(b"}\n") })
        .map_err(write_failed)
    })?;
    out.flush().map_err(write_failed)
}

fn decide(store: &SimStore, limit: &Limit, ev: &Event<'_>) -> Result<Decision, Failure> {
    let now = ev.at_ms.saturating_mul(1_000);
    store.apply_at(&ev.key, limit, ev.hits, now).map_err(|e| Failure::runtime(e.to_string()))
}

/// Milliseconds, rounded up: a wait is never reported shorter than it is.
fn ms(d: Duration) -> u128 {
    d.as_micros().div_ceil(1_000)
}

/// Stdout closed (e.g. piped into `head`): stop quietly, as a filter does.
fn write_failed(e: io::Error) -> Failure {
    if e.kind() == io::ErrorKind::BrokenPipe {
        Failure::stop()
    } else {
        Failure::runtime(format!("writing stdout: {e}"))
    }
}

/// The algorithms `--report` compares, first the exact reference.
fn report_limits(
    args: &SimulateArgs,
    limit: u64,
    window: Duration,
    mode: Option<LeakyMode>,
) -> Result<Vec<(String, Limit)>, Failure> {
    if args.algorithm.is_some() || mode.is_some() {
        return Err(Failure::usage("--report runs every algorithm: drop --algorithm and --mode"));
    }
    if limit > floodgate_core::MAX_LOG_LIMIT {
        return Err(Failure::usage(format!(
            "--report compares with sliding_log, which supports limits up to {}; scale the trace down",
            floodgate_core::MAX_LOG_LIMIT
        )));
    }
    let window_us = window.as_micros();
    let granularity = args.granularity.unwrap_or_else(|| {
        (1..=MAX_GRANULARITY)
            .filter(|g| window_us.is_multiple_of(u128::from(*g)))
            .min_by_key(|g| g.abs_diff(10))
            .unwrap_or(1)
    });
    let burst = args.burst;
    let algorithms = [
        ("sliding_log (exact)".to_owned(), Algorithm::SlidingLog),
        ("fixed_window".to_owned(), Algorithm::FixedWindow),
        ("sliding_window".to_owned(), Algorithm::SlidingWindow),
        (format!("sliding_buckets (g={granularity})"), Algorithm::SlidingBuckets { granularity }),
        ("token_bucket".to_owned(), Algorithm::TokenBucket { burst }),
        ("gcra".to_owned(), Algorithm::Gcra { burst }),
        ("leaky_bucket (meter)".to_owned(), Algorithm::LeakyBucket { burst, mode: LeakyMode::Meter }),
        ("leaky_bucket (shape)".to_owned(), Algorithm::LeakyBucket { burst, mode: LeakyMode::Shape }),
    ];
    algorithms
        .into_iter()
        .map(|(name, a)| {
            Limit::new(a, limit, window).map(|l| (name.clone(), l)).map_err(|e| Failure::usage(format!("{name}: {e}")))
        })
        .collect()
}

#[derive(Default)]
struct Tally {
    admitted: u64,
    denied: u64,
    wrongly_allowed: u64,
    wrongly_denied: u64,
    delay_us: u128,
}

/// Run every algorithm on the trace; print a table.
fn report(input: impl BufRead, mut out: impl Write, limits: &[(String, Limit)]) -> Result<(), Failure> {
    let stores: Vec<SimStore> = limits.iter().map(|_| store()).collect();
    let mut tallies: Vec<Tally> = limits.iter().map(|_| Tally::default()).collect();
    let mut events = 0u64;
    for_each_event(input, |ev| {
        events += 1;
        let mut exact = true;
        for (i, ((_, limit), store)) in limits.iter().zip(&stores).enumerate() {
            let d = decide(store, limit, ev)?;
            let t = &mut tallies[i];
            if i == 0 {
                exact = d.allowed;
            }
            if d.allowed {
                t.admitted += 1;
                t.delay_us += d.delay.as_micros();
            } else {
                t.denied += 1;
            }
            match (d.allowed, exact) {
                (true, false) => t.wrongly_allowed += 1,
                (false, true) => t.wrongly_denied += 1,
                _ => {}
            }
        }
        Ok::<(), Failure>(())
    })?;
    let (_, reference) = &limits[0];
    let mut text = format!(
        "{events} requests; limit {} per {}{}\n\n{:<28} {:>10} {:>10} {:>16} {:>16} {:>10}\n",
        reference.limit(),
        floodgate_core::HumanDuration(reference.window()),
        limits.get(4).map(|(_, l)| format!(", burst {}", l.burst())).unwrap_or_default(),
        "algorithm",
        "admitted",
        "denied",
        "wrongly allowed",
        "wrongly denied",
        "agreement",
    );
    for ((name, _), t) in limits.iter().zip(&tallies) {
        let agree = if events == 0 {
            100.0
        } else {
            100.0 * (events - t.wrongly_allowed - t.wrongly_denied) as f64 / events as f64
        };
        text.push_str(&format!(
            "{name:<28} {:>10} {:>10} {:>16} {:>16} {:>9.3}%\n",
            t.admitted, t.denied, t.wrongly_allowed, t.wrongly_denied, agree
        ));
    }
    let shaper = &tallies[tallies.len() - 1];
    if shaper.admitted > 0 {
        text.push_str(&format!(
            "\nleaky_bucket (shape) queues instead of denying: mean delay of admitted requests {:.1} ms\n",
            shaper.delay_us as f64 / shaper.admitted as f64 / 1_000.0
        ));
    }
    text.push_str("\nwrongly allowed/denied: decisions that differ from sliding_log's on the same trace.\n");
    out.write_all(text.as_bytes()).and_then(|()| out.flush()).map_err(write_failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(a: Algorithm, l: u64, w: &str) -> Limit {
        Limit::new(a, l, parse_duration(w).unwrap()).unwrap()
    }

    fn replayed(input: &str, limit: &Limit) -> Result<String, Failure> {
        let mut out = Vec::new();
        replay(input.as_bytes(), &mut out, limit)?;
        Ok(String::from_utf8(out).unwrap())
    }

    #[test]
    fn prints_one_decision_per_line() {
        let trace = "{\"at_ms\": 200, \"key\": \"alice\"}\n{\"at_ms\": 300, \"key\": \"alice\", \"hits\": 5}\n\n{\"at_ms\": 300, \"key\": \"bob\"}\n";
        let out = replayed(trace, &limit(Algorithm::FixedWindow, 5, "1s")).unwrap();
        assert_eq!(
            out,
            "{\"allowed\": true, \"remaining\": 4, \"reset_after_ms\": 800, \"retry_after_ms\": null}\n\
             {\"allowed\": false, \"remaining\": 4, \"reset_after_ms\": 700, \"retry_after_ms\": 700}\n\
             {\"allowed\": true, \"remaining\": 4, \"reset_after_ms\": 700, \"retry_after_ms\": null}\n"
        );
    }

    #[test]
    fn the_shaper_reports_its_delay() {
        let trace = "{\"at_ms\": 0, \"key\": \"a\"}\n{\"at_ms\": 0, \"key\": \"a\"}\n";
        let l = limit(Algorithm::LeakyBucket { burst: Some(1), mode: LeakyMode::Shape }, 4, "1s");
        let out = replayed(trace, &l).unwrap();
        assert!(out.lines().nth(1).unwrap().ends_with("\"delay_ms\": 250}"), "{out}");
    }

    #[test]
    fn bad_lines_stop_with_their_number() {
        let l = limit(Algorithm::FixedWindow, 5, "1s");
        let cases = [
            ("{\"at_ms\": 1, \"key\": \"a\"}\n{\"at_ms\": 1}\n", "stdin line 2, column 12: missing field `key`"),
            ("{\"at_ms\": 1, \"key\": \"a\", \"hit\": 2}\n", "stdin line 1, column 30: unknown field `hit`"),
            ("{\"at_ms\": -1, \"key\": \"a\"}\n", "stdin line 1"),
            ("not json\n", "stdin line 1, column 2: expected ident"),
            (
                "{\"at_ms\": 5, \"key\": \"a\"}\n{\"at_ms\": 4, \"key\": \"a\"}\n",
                "at_ms 4 is before the previous line's 5",
            ),
            ("{\"at_ms\": 5, \"key\": \"a\", \"hits\": 1.5}\n", "stdin line 1"),
        ];
        for (input, want) in cases {
            let err = replayed(input, &l).unwrap_err();
            assert_eq!(err.code, crate::exit::USAGE);
            assert!(err.to_string().contains(want), "{input:?}: {err}");
        }
        let bad_utf8: &[u8] = b"{\"at_ms\": 1, \"key\": \"\xff\"}\n";
        let err = replay(bad_utf8, Vec::new(), &l).unwrap_err();
        assert!(err.to_string().contains("line 1: not valid UTF-8"), "{err}");
    }

    #[test]
    fn report_counts_disagreements_with_the_exact_log() {
        // 2 per second; a burst of 2 at the end of one window and 2 at the
        // start of the next: fixed_window admits all 4 (wrongly 2), the log 2.
        let trace = "{\"at_ms\": 900, \"key\": \"k\"}\n{\"at_ms\": 900, \"key\": \"k\"}\n{\"at_ms\": 1000, \"key\": \"k\"}\n{\"at_ms\": 1000, \"key\": \"k\"}\n";
        let args = SimulateArgs {
            algorithm: None,
            limit: Some(2),
            window: Some("1s".into()),
            burst: None,
            granularity: None,
            mode: None,
            report: true,
            plot: None,
            budget: false,
            table: false,
            regions: crate::cli::RegionSimArgs::default(),
        };
        let limits = report_limits(&args, 2, Duration::from_secs(1), None).unwrap();
        let mut out = Vec::new();
        report(trace.as_bytes(), &mut out, &limits).unwrap();
        let out = String::from_utf8(out).unwrap();
        let row =
            |name: &str| out.lines().find(|l| l.starts_with(name)).unwrap().split_whitespace().collect::<Vec<_>>();
        assert_eq!(row("sliding_log")[2..5], ["2", "2", "0"]);
        assert_eq!(row("fixed_window")[1..4], ["4", "0", "2"], "{out}");
        assert!(out.contains("sliding_buckets (g=10)"));
    }
}
