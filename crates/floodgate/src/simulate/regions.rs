//! `floodgate simulate --regions`: regions sharing a `scope: global` limit
//! over a simulated WAN ([`floodgate_core::region::sim`]), and `--goals`,
//! the many-regions goals table.

use std::io::{self, Write};

use floodgate_core::region::goals::{GoalRow, goals as run_goals};
use floodgate_core::region::sim::{Pattern, Report, Spec, Wan, run as simulate};
use floodgate_core::region::{SyncMode, parse_overshoot};
use floodgate_core::{Algorithm, AlgorithmKind, LeakyMode, Limit, parse_duration};
use serde_json::json;

use crate::cli::SimulateArgs;
use crate::exit::{DENIED, Failure};

fn us(flag: &str, s: &str) -> Result<u64, Failure> {
    let d = parse_duration(s).map_err(|e| Failure::usage(format!("--{flag}: {e}")))?;
    u64::try_from(d.as_micros()).map_err(|_| Failure::usage(format!("--{flag}: too long")))
}

/// `1%`, `0.5%` or a fraction `0.01`, as parts per million in [0, 100%].
fn ppm(flag: &str, s: &str) -> Result<u32, Failure> {
    let bad =
        || Failure::usage(format!("--{flag} `{s}`: give a percentage such as 1% or 0.5%, or a fraction such as 0.01"));
    let (text, scale) = match s.trim().strip_suffix('%') {
        Some(p) => (p.trim(), 10_000.0),
        None => (s.trim(), 1_000_000.0),
    };
    let v: f64 = text.parse().map_err(|_| bad())?;
    if !(0.0..=1_000_000.0 / scale).contains(&v) {
        return Err(bad());
    }
    Ok((v * scale).round() as u32)
}

fn wan(args: &SimulateArgs, names: &[String]) -> Result<Wan, Failure> {
    let r = &args.regions;
    let n = names.len();
    let default = if names == ["a", "b", "c"] { None } else { Some(50_000) };
    let mut latency = vec![vec![default.unwrap_or(0); n]; n];
    if default.is_none() {
        latency = Wan::three_continents().latency_us;
    }
    for (i, row) in latency.iter_mut().enumerate() {
        row[i] = 0;
    }
    if let Some(pairs) = &r.latency {
        for pair in pairs.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let bad = || Failure::usage(format!("--latency `{pair}`: write FROM-TO=DURATION, e.g. a-b=30ms"));
            let (ends, d) = pair.split_once('=').ok_or_else(bad)?;
            let (a, b) = ends.split_once('-').ok_or_else(bad)?;
            let find = |x: &str| {
                names.iter().position(|n| n == x.trim()).ok_or_else(|| {
                    Failure::usage(format!("--latency `{pair}`: `{x}` is not among --regions {}", names.join(",")))
                })
            };
            let (i, j) = (find(a)?, find(b)?);
            let v = us("latency", d)?;
            latency[i][j] = v;
            latency[j][i] = v;
        }
    }
    Ok(Wan {
        names: names.to_vec(),
        latency_us: latency,
        jitter_us: us("jitter", &r.jitter)?,
        loss_ppm: ppm("loss", &r.loss)?,
        dup_ppm: ppm("dup", &r.dup)?,
        reorder_ppm: ppm("reorder", &r.reorder)?,
    })
}

fn limit(args: &SimulateArgs) -> Result<Limit, Failure> {
    let (Some(n), Some(window)) = (args.limit, args.window.as_deref()) else {
        return Err(Failure::usage("--regions needs --limit and --window"));
    };
    let window = parse_duration(window).map_err(|e| Failure::usage(format!("--window: {e}")))?;
    let kind: AlgorithmKind = args
        .algorithm
        .as_deref()
        .unwrap_or("fixed_window")
        .parse()
        .map_err(|e| Failure::usage(format!("--algorithm: {e}")))?;
    if kind == AlgorithmKind::SlidingLog {
        return Err(Failure::usage(
            "--algorithm sliding_log cannot be global (its exactness needs every admitted request's time in every region): simulate sliding_buckets or gcra",
        ));
    }
    let mode = args
        .mode
        .as_deref()
        .map(str::parse::<LeakyMode>)
        .transpose()
        .map_err(|e| Failure::usage(format!("--mode: {e}")))?;
    let algorithm = Algorithm::from_parts(kind, args.burst, args.granularity, mode)
        .map_err(|e| Failure::usage(format!("--algorithm: {e}")))?;
    Limit::new(algorithm, n, window).map_err(|e| Failure::usage(format!("--limit/--window: {e}")))
}

fn sync_mode(args: &SimulateArgs) -> Result<SyncMode, Failure> {
    let r = &args.regions;
    match (r.sync_mode.as_str(), &r.overshoot) {
        ("eventual", None) => Ok(SyncMode::Eventual),
        ("eventual", Some(_)) => Err(Failure::usage("--overshoot applies to --sync bounded")),
        ("bounded", Some(o)) => parse_overshoot(o)
            .map(|overshoot_ppm| SyncMode::Bounded { overshoot_ppm })
            .map_err(|e| Failure::usage(format!("--overshoot: {e}"))),
        ("bounded", None) => Err(Failure::usage("--sync bounded needs --overshoot, e.g. 5%")),
        (other, _) => Err(Failure::usage(format!("--sync `{other}`: use eventual or bounded"))),
    }
}

/// The `--regions` spec from the flags.
fn spec(args: &SimulateArgs) -> Result<Spec, Failure> {
    let r = &args.regions;
    let names: Vec<String> = r
        .regions
        .as_deref()
        .unwrap_or_default()
        .split(',')
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .collect();
    if names.len() < 2 {
        return Err(Failure::usage("--regions: name at least two regions, e.g. a,b,c"));
    }
    let wan = wan(args, &names)?;
    let split = match &r.split {
        None => vec![1.0; names.len()],
        Some(s) => {
            let w: Vec<f64> = s
                .split(',')
                .map(|x| x.trim().parse::<f64>())
                .collect::<Result<_, _>>()
                .map_err(|_| Failure::usage(format!("--split `{s}`: give one weight per region, e.g. 70,20,10")))?;
            if w.len() != names.len() || w.iter().any(|x| !x.is_finite() || *x < 0.0) || w.iter().sum::<f64>() <= 0.0 {
                return Err(Failure::usage(format!(
                    "--split `{s}`: give {} non-negative weights, one per region, not all zero",
                    names.len()
                )));
            }
            w
        }
    };
    let pattern = Pattern::parse(&r.pattern).ok_or_else(|| {
        let all: Vec<&str> = Pattern::ALL.iter().map(|p| p.as_str()).collect();
        Failure::usage(format!("--pattern `{}`: use one of {}", r.pattern, all.join(", ")))
    })?;
    let limit = limit(args)?;
    let mode = sync_mode(args)?;
    if let SyncMode::Bounded { overshoot_ppm } = mode {
        let capacity = if matches!(
            limit.algorithm(),
            Algorithm::FixedWindow | Algorithm::SlidingWindow | Algorithm::SlidingBuckets { .. }
        ) {
            limit.limit()
        } else {
            limit.burst()
        };
        if floodgate_core::region::slice(overshoot_ppm, capacity, names.len()) == 0 {
            return Err(Failure::usage(format!(
                "a bounded limit of {capacity} gives each of {} regions a slice below 1 hit at this overshoot: use at least {}",
                names.len(),
                floodgate_core::region::min_capacity(overshoot_ppm, names.len())
            )));
        }
    }
    if pattern == Pattern::ManyKeys && limit.limit() > 1_000 {
        return Err(Failure::usage(
            "--pattern many-keys runs 2.5 batches of keys at 2x the limit each: use --limit 1000 or less",
        ));
    }
    if !(r.offered.is_finite() && r.offered > 0.0 && r.offered <= 100.0) {
        return Err(Failure::usage("--offered: give a load in (0, 100] limits per window"));
    }
    Ok(Spec {
        wan,
        interval_us: us("sync-interval", &r.sync_interval)?.max(1),
        batch_items: r.batch.max(1),
        limit,
        mode,
        pattern,
        split,
        offered: r.offered,
        windows: r.windows.clamp(1, 1_000),
        keys: r.keys.max(1),
        seed: r.seed,
        trace: None,
        crashes: r.crashes,
    })
}

pub(crate) fn run(args: &SimulateArgs) -> Result<(), Failure> {
    let spec = spec(args)?;
    let seeds = args.regions.seeds.clamp(1, 100_000);
    let reports: Vec<Report> =
        (0..seeds).map(|i| simulate(&Spec { seed: spec.seed.wrapping_add(i), ..spec.clone() })).collect();
    let mut out = io::stdout().lock();
    let text = if args.regions.json { json_of(&spec, &reports) } else { text_of(&spec, &reports) };
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| Failure::runtime(format!("writing stdout: {e}")))?;
    let broken = reports.iter().filter(|r| !r.cap_held).count();
    if broken > 0 {
        return Err(Failure::with_code(
            DENIED,
            format!("the bounded cap was broken in {broken} of {} seeds", reports.len()),
        ));
    }
    Ok(())
}

fn sum(reports: &[Report], f: impl Fn(&Report) -> u64) -> u64 {
    reports.iter().map(f).sum()
}

fn text_of(spec: &Spec, reports: &[Report]) -> String {
    let l = &spec.limit;
    let mode = match spec.mode {
        SyncMode::Eventual => "eventual".to_owned(),
        SyncMode::Bounded { overshoot_ppm } => format!("bounded, overshoot {}%", f64::from(overshoot_ppm) / 10_000.0),
    };
    let admitted = sum(reports, |r| r.admitted);
    let exact = sum(reports, |r| r.exact);
    let worst = reports.iter().map(|r| r.worst_over).max().unwrap_or(0);
    let s = reports.iter().map(|r| r.staleness).fold(0.0, f64::max);
    let fd = sum(reports, |r| r.false_denials);
    let by_region: Vec<String> = spec
        .wan
        .names
        .iter()
        .enumerate()
        .map(|(i, n)| format!("{n} {}", reports.iter().map(|r| r.by_region[i]).sum::<u64>()))
        .collect();
    let mut t = format!(
        "regions {} · {} · {} {}/{} · {mode} · {} seed(s) from {}\n",
        spec.wan.names.join(","),
        spec.pattern.as_str(),
        l.algorithm().kind().as_str(),
        l.limit(),
        floodgate_core::HumanDuration(l.window()),
        reports.len(),
        spec.seed
    );
    t += &format!("admitted        {admitted} ({}), the exact global answer {exact}\n", by_region.join(", "));
    t += &format!(
        "over-admission  worst window {worst}, total {}; staleness bound S = {s:.1} (1.25 S = {:.1})\n",
        sum(reports, |r| r.over),
        1.25 * s
    );
    t += &format!("false denials   {fd} ({:.2}% of the exact answer)\n", 100.0 * fd as f64 / exact.max(1) as f64);
    if spec.pattern == Pattern::Budget {
        t += &format!(
            "settled         {} hits given back, {} charged after the work\n",
            sum(reports, |r| r.refunded),
            sum(reports, |r| r.late)
        );
    }
    if let Some(cap) = reports.first().and_then(|r| r.cap) {
        let held = reports.iter().filter(|r| r.cap_held).count();
        t += &format!(
            "bounded cap     {cap} per window (GCRA: (1 + overshoot) x burst + rate); held in {held} of {} seeds\n",
            reports.len()
        );
    }
    if let Some(rate) = reports.first().and_then(|r| r.slice_rate) {
        t += &format!("slice rate      {rate:.0} hits/s per region (slice / acknowledgement round trip)\n");
    }
    if let Some(r) = reports.iter().filter_map(|r| r.rounds_to_90).max() {
        t += &format!("after the shift back to 90% of the limit's rate within {r} sync round(s)\n");
    }
    if reports.iter().any(|r| r.convergence_bound_us > 0) {
        let worst = reports.iter().map(|r| r.convergence_us.unwrap_or(u64::MAX)).max().unwrap_or(0);
        let bound = reports[0].convergence_bound_us;
        let within = reports.iter().filter(|r| r.convergence_us.is_some_and(|c| c <= bound)).count();
        let after = match spec.pattern {
            Pattern::PartitionCrash => "after c's return",
            Pattern::InstanceCrash => "after the death ",
            Pattern::Budget => "after the last settle,",
            _ => "after the heal ",
        };
        t += &format!(
            "{after} every region agrees within {} (bound {}), in {within} of {} seeds\n",
            if worst == u64::MAX { "never".to_owned() } else { format!("{} ms", worst.div_ceil(1_000)) },
            format_args!("{} ms", bound / 1_000),
            reports.len()
        );
    }
    t += &format!(
        "sync            {} batches, {} keys sent; {} messages lost, {} duplicated\n",
        sum(reports, |r| r.batches),
        sum(reports, |r| r.items),
        sum(reports, |r| r.lost),
        sum(reports, |r| r.duplicated)
    );
    t
}

fn json_of(spec: &Spec, reports: &[Report]) -> String {
    let runs: Vec<_> = reports
        .iter()
        .enumerate()
        .map(|(i, r)| {
            json!({
                "seed": spec.seed.wrapping_add(i as u64),
                "admitted": r.admitted, "exact": r.exact, "by_region": r.by_region,
                "over_admission": r.over, "worst_window_over_admission": r.worst_over,
                "false_denials": r.false_denials, "staleness_bound": r.staleness,
                "given_back": r.refunded, "charged_late": r.late,
                "cap": r.cap, "cap_held": r.cap_held, "slice_rate_per_s": r.slice_rate,
                "convergence_ms": r.convergence_us.map(|c| c as f64 / 1e3),
                "convergence_bound_ms": (r.convergence_bound_us > 0).then(|| r.convergence_bound_us as f64 / 1e3),
                "rounds_to_90pct": r.rounds_to_90,
                "batches": r.batches, "keys_sent": r.items, "lost": r.lost, "duplicated": r.duplicated,
            })
        })
        .collect();
    let v = json!({
        "regions": spec.wan.names,
        "pattern": spec.pattern.as_str(),
        "algorithm": spec.limit.algorithm().kind().as_str(),
        "limit": spec.limit.limit(),
        "window_ms": spec.limit.window().as_millis() as u64,
        "sync": spec.mode.as_str(),
        "runs": runs,
    });
    format!("{v}\n")
}

/// `--goals`: the table, with progress on stderr.
pub(crate) fn goals(args: &SimulateArgs) -> Result<(), Failure> {
    let seeds = args.regions.goals_seeds.clamp(1, 10_000);
    let eventual = seeds.min(20);
    let mut err = io::stderr().lock();
    let rows = run_goals(seeds, eventual, |r| {
        let _ = writeln!(
            err,
            "{} {} {}s {}: {}",
            r.mode,
            r.algorithm,
            r.window.as_secs(),
            r.pattern,
            if r.pass { "ok" } else { "FAILED" }
        );
    });
    let mut out = io::stdout().lock();
    let table = table(&rows, seeds, eventual);
    out.write_all(table.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| Failure::runtime(format!("writing stdout: {e}")))?;
    if rows.iter().all(|r| r.pass) { Ok(()) } else { Err(Failure::runtime("some goals were not met (see the table)")) }
}

fn table(rows: &[GoalRow], seeds: u64, eventual: u64) -> String {
    let mut t = format!(
        "The issue's setting: regions a, b, c; one-way latency a-b 30 ms, a-c 70 ms, b-c 120 ms, ±10 ms jitter; 1% loss, duplicates and reorders; sync every 100 ms; 2x the limit offered, split 70/20/10. Bounded rows: {seeds} seeds each; eventual rows: {eventual}.\n\n"
    );
    t += "| sync | algorithm | window | pattern | limit | admitted / exact | worst over-admission (bound) | false denials | cap held | after a heal (bound) | rounds to 90% | slice rate /s | goals |\n";
    t += "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
    for r in rows {
        let bound = r.over_bound.map_or(String::new(), |b| format!(" (≤ {b:.1})"));
        let cap = r.cap_held.map_or("-".to_owned(), |h| format!("{h}/{}", r.seeds));
        let heal = r.converged.map_or("-".to_owned(), |(within, slowest, bound)| {
            let slow = if slowest == u64::MAX { "never".to_owned() } else { format!("{} ms", slowest.div_ceil(1_000)) };
            format!("{slow} ({} ms; {within}/{} seeds)", bound / 1_000, r.seeds)
        });
        let rounds = r.rounds_to_90.map_or("-".to_owned(), |x| x.to_string());
        let rate = r.slice_rate.map_or("-".to_owned(), |x| format!("{x:.0}"));
        let goal = if r.pass { "ok".to_owned() } else { format!("**no**: {}", r.note) };
        t += &format!(
            "| {} | {} | {} | {} | {} | {} / {} | {}{bound} | {:.2}% | {cap} | {heal} | {rounds} | {rate} | {goal} |\n",
            r.mode,
            r.algorithm,
            floodgate_core::HumanDuration(r.window),
            r.pattern,
            r.limit,
            r.admitted,
            r.exact,
            r.worst_over,
            100.0 * r.false_denials
        );
    }
    t
}
