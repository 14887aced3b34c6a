//! `floodgate simulate` through the real binary: output, exit codes, errors.

use std::io::Write;
use std::process::{Child, Command, Output, Stdio};

fn spawn(args: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_floodgate"))
        .arg("simulate")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

fn simulate(args: &[&str], stdin: &str) -> Output {
    let mut child = spawn(args);
    let mut input = child.stdin.take().unwrap();
    let _ = input.write_all(stdin.as_bytes());
    drop(input);
    child.wait_with_output().unwrap()
}

#[test]
fn replays_a_trace() {
    let trace = "{\"at_ms\": 0, \"key\": \"alice\"}\n{\"at_ms\": 100, \"key\": \"alice\", \"hits\": 2}\n{\"at_ms\": 200, \"key\": \"alice\"}\n{\"at_ms\": 1000, \"key\": \"alice\"}\n";
    let out = simulate(&["--algorithm", "fixed_window", "--limit", "3", "--window", "1s"], trace);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 4);
    assert_eq!(lines[2], "{\"allowed\": false, \"remaining\": 0, \"reset_after_ms\": 800, \"retry_after_ms\": 800}");
    for line in lines {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(v["allowed"].is_boolean());
    }
}

#[test]
fn bad_usage_and_bad_input_exit_64_with_a_message() {
    let cases: &[(&[&str], &str, &str)] = &[
        (&["--algorithm", "nope", "--limit", "3", "--window", "1s"], "", "unknown algorithm `nope`"),
        (&["--algorithm", "gcra", "--limit", "3", "--window", "90"], "", "has no unit"),
        (&["--algorithm", "fixed_window", "--limit", "3", "--window", "1s", "--burst", "2"], "", "has no burst"),
        (&["--algorithm", "sliding_log", "--limit", "20000", "--window", "1s"], "", "capped at 10000"),
        (
            &["--algorithm", "gcra", "--limit", "3", "--window", "1s"],
            "{\"at_ms\": 5}\n",
            "line 1, column 12: missing field `key`",
        ),
        (&["--limit", "3", "--window", "1s"], "", "--algorithm"),
        (&["--report", "--limit", "20000", "--window", "1s"], "", "up to 10000"),
    ];
    for (args, stdin, want) in cases {
        let out = simulate(args, stdin);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }
}

#[test]
fn report_prints_a_table() {
    let trace: String = (0..50).map(|i| format!("{{\"at_ms\": {}, \"key\": \"k{}\"}}\n", i * 10, i % 3)).collect();
    let out = simulate(&["--report", "--limit", "5", "--window", "1s"], &trace);
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(stdout.starts_with("50 requests; limit 5 per 1s"), "{stdout}");
    for name in [
        "sliding_log (exact)",
        "fixed_window",
        "sliding_window",
        "sliding_buckets (g=10)",
        "gcra",
        "leaky_bucket (shape)",
    ] {
        assert!(stdout.contains(name), "{name} missing: {stdout}");
    }
}

#[test]
fn a_closed_stdout_is_not_an_error() {
    // `floodgate simulate ... | head -1` must not fail or panic.
    let trace: String = (0..200_000).map(|i| format!("{{\"at_ms\": {i}, \"key\": \"k\"}}\n")).collect();
    let mut child = spawn(&["--algorithm", "gcra", "--limit", "5", "--window", "1s"]);
    let mut input = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || {
        let _ = input.write_all(trace.as_bytes());
    });
    drop(child.stdout.take()); // the reader goes away at once
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}

/// The crash loop: 120 a minute, bounded at 5% (a slice of 2 per
/// region, a cap of 126); the last region takes its slice and dies with its
/// state lost K times a window. The cap holds in every one of 100 seeds,
/// and the command says so (it exits 1 when a seed breaks it).
#[test]
fn the_bounded_cap_holds_through_a_crashloop_in_100_seeds() {
    let runs: Vec<(u32, Child)> = [1u32, 2, 5, 10]
        .into_iter()
        .map(|k| {
            let k_text = k.to_string();
            let args = [
                "--regions",
                "a,b,c",
                "--split",
                "70,20,10",
                "--pattern",
                "crashloop",
                "--crashes",
                &k_text,
                "--limit",
                "120",
                "--window",
                "1m",
                "--windows",
                "2",
                "--sync",
                "bounded",
                "--overshoot",
                "5%",
                "--seeds",
                "100",
                "--json",
            ];
            (k, spawn(&args))
        })
        .collect();
    for (k, child) in runs {
        let out = child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "K={k}: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let runs = v["runs"].as_array().unwrap();
        assert_eq!(runs.len(), 100);
        for r in runs {
            assert_eq!(r["cap"], 126, "K={k}");
            assert_eq!(r["cap_held"], true, "K={k}: {r}");
        }
    }
    let out = simulate(&["--regions", "a,b,c", "--pattern", "crashloop", "--crashes", "0"], "");
    assert_eq!(out.status.code(), Some(64), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--crashes"));
}

/// Budgets across regions: requests reserve an estimate and settle within a
/// tenth of a window (the rest given back, the excess charged late). Bounded,
/// the cap on what is admitted at request time holds in every seed; eventual,
/// every region agrees once the traffic stops, refunds included.
#[test]
fn refunds_and_late_charges_keep_the_cap_and_converge_across_regions() {
    let common = ["--regions", "a,b,c", "--split", "70,20,10", "--pattern", "budget", "--limit", "1000"];
    let out = simulate(
        &[&common[..], &["--window", "1m", "--sync", "bounded", "--overshoot", "5%", "--seeds", "10"]].concat(),
        "",
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("held in 10 of 10 seeds"), "{text}");
    assert!(text.contains("hits given back") && text.contains("charged after the work"), "{text}");
    let out = simulate(&[&common[..], &["--window", "10s", "--seeds", "5", "--json"]].concat(), "");
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for r in v["runs"].as_array().unwrap() {
        assert!(r["given_back"].as_u64().unwrap() > 0 && r["charged_late"].as_u64().unwrap() > 0, "{r}");
        let (c, bound) = (r["convergence_ms"].as_f64(), r["convergence_bound_ms"].as_f64().unwrap());
        assert!(c.is_some_and(|c| c <= bound), "{r}");
    }
}

/// `--budget`: a trace of starts and ends, replayed three ways. Two
/// requests in flight on a limit of 100: peek-then-charge admits both (the
/// budget is unused when each starts) and goes 60 over; reserve-then-settle
/// admits the first only (its estimate leaves no room), as the exact answer
/// does. A bad line exits 64 with its number.
#[test]
fn budget_replays_starts_and_ends_three_ways() {
    let trace = "{\"at_ms\": 0, \"key\": \"acme\", \"start\": \"r1\", \"estimate\": 90}\n\
                 {\"at_ms\": 10, \"key\": \"acme\", \"start\": \"r2\", \"estimate\": 90}\n\
                 {\"at_ms\": 500, \"key\": \"acme\", \"end\": \"r1\", \"actual\": 80}\n\
                 {\"at_ms\": 600, \"key\": \"acme\", \"end\": \"r2\", \"actual\": 80}\n";
    let out = simulate(&["--budget", "--limit", "100", "--window", "1m"], trace);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let row = |name: &str| {
        let line = stdout.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {stdout}"));
        line[name.len()..].split_whitespace().map(str::to_owned).collect::<Vec<_>>()
    };
    assert_eq!(row("exact (knows each cost)")[..3], ["1", "80", "0"], "{stdout}");
    assert_eq!(row("peek, then charge after")[..3], ["2", "160", "60"], "{stdout}");
    assert_eq!(row("reserve, then settle")[..3], ["1", "80", "0"], "{stdout}");
    let bad = simulate(
        &["--budget", "--limit", "100", "--window", "1m"],
        "{\"at_ms\": 0, \"key\": \"a\", \"end\": \"x\", \"actual\": 1}\n",
    );
    assert_eq!(bad.status.code(), Some(64));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("line 1: request `x` ends but never started"));
}
