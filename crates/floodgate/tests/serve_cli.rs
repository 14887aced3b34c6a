//! `floodgate serve`, `check` and `bench` through the real binary: exit
//! codes, settings refused before any port is bound, SIGTERM, and the two
//! clients against a live server.

use crate::cli;

use std::net::TcpListener;

use cli::{Served, bench, run};
use floodgate_testing::TempDir;
use serde_json::Value;

const RULES: &str =
    "domain: bench\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

#[test]
fn check_and_bench_against_a_live_server_then_sigterm_exits_0() {
    let s = Served::start("live", RULES, &[]);
    let check = |hits: &str| {
        run(&["check", "--server", &s.grpc, "--domain", "bench", "--descriptor", "user=a", "--hits", hits])
    };
    let (code, out, err) = check("1");
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with("OK\n") && out.contains("limit 2 per minute, remaining 1"), "{out}");
    // Regression (issue 46): `--hits 0` reads the counters and takes
    // nothing, however often (it was sent as the request's hits_addend 0,
    // which counts as 1).
    for _ in 0..3 {
        let (code, out, err) = check("0");
        assert_eq!(code, Some(0), "{out}{err}");
        assert!(out.contains("remaining 1"), "a peek takes nothing: {out}");
    }
    let (code, out, _) = check("2");
    assert_eq!(code, Some(1), "denied exits 1: {out}");
    assert!(out.starts_with("OVER_LIMIT"), "{out}");
    let (code, out, _) = run(&["check", "--server", &s.grpc, "--domain", "bench", "--descriptor", "user=b", "--json"]);
    assert_eq!(code, Some(0));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["statuses"][0]["remaining"], 1);

    for (protocol, server) in [("grpc", &s.grpc), ("json", &s.http)] {
        let args = ["--duration", "500ms", "--concurrency", "4", "--keys", "100", "--distribution", "zipf"];
        let v = bench(server, protocol, &args);
        let requests = v["requests"].as_u64().unwrap();
        assert!(requests > 0, "{v}");
        assert_eq!(v["errors"], 0, "{v}");
        assert_eq!(v["allowed"].as_u64().unwrap() + v["denied"].as_u64().unwrap(), requests);
        assert!(v["latency_ms"]["p99"].as_f64().unwrap() > 0.0);
        assert!(v["generator_lag_ms"].is_null() && v["service_latency_ms"].is_null(), "no schedule: {v}");
    }
    // A plain GET of any path (the proxy's benchmark): 2xx is allowed.
    let v = bench(&s.http, "get", &["--path", "/healthz", "--duration", "300ms", "--concurrency", "2"]);
    assert!(v["requests"].as_u64().unwrap() > 0, "{v}");
    assert_eq!((&v["allowed"], &v["errors"]), (&v["requests"], &serde_json::json!(0)), "{v}");
    // Open loop on two sending threads: the schedule sets the count (200/s
    // for as long as it ran, give or take the one due at the start and the
    // pacer noticing the end), and the generator's own lag is reported.
    for (protocol, server) in [("grpc", &s.grpc), ("json", &s.http)] {
        let args = ["--duration", "1s", "--rate", "200", "--threads", "2", "--concurrency", "8", "--keys", "1000"];
        let v = bench(server, protocol, &args);
        assert_eq!(v["errors"], 0, "{v}");
        assert_eq!(v["threads"], 2, "{v}");
        let (requests, seconds) = (v["requests"].as_f64().unwrap(), v["seconds"].as_f64().unwrap());
        assert!((requests - 200.0 * seconds).abs() <= 4.0, "{protocol}: {requests} requests at 200/s: {v}");
        assert!(v["generator_lag_ms"]["max"].as_f64().unwrap() > 0.0, "{v}");
        let (service, due) = (&v["service_latency_ms"], &v["latency_ms"]);
        assert!(service["p50"].as_f64().unwrap() > 0.0, "{v}");
        assert!(service["max"].as_f64().unwrap() <= due["max"].as_f64().unwrap() + 0.01, "{v}");
    }
    assert_eq!(s.terminate(), Some(0));
}

#[test]
fn bench_exits_2_when_no_server_answers_and_64_on_bad_flags() {
    let (_held, addr) = cli::refusing_addr();
    for protocol in ["grpc", "json", "get"] {
        let (code, _, err) = run(&["bench", "--server", &addr, "--protocol", protocol, "--duration", "1s"]);
        assert_eq!(code, Some(2), "{protocol}: {err}");
        assert!(err.contains("cannot connect"), "{err}");
    }
    for (flag, value) in [
        ("--threads", "0"),
        ("--rate", "0"),
        ("--timeout", "0s"),
        ("--server", "https://h:1"),
        ("--protocol", "udp"),
        ("--distribution", "zipf:-1"),
    ] {
        let (code, _, err) = run(&["bench", "--server", &addr, flag, value]);
        assert_eq!(code, Some(64), "{flag} {value}: {err}");
        assert!(err.contains(flag), "{flag}: {err}");
    }
    let (code, _, err) = run(&["bench", "--server", &addr, "--protocol", "get", "--path", "healthz"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("--path `healthz`: give an absolute path"), "{err}");
}

#[test]
fn check_exits_2_when_no_server_answers() {
    let (_held, addr) = cli::refusing_addr();
    let (code, _, err) = run(&["check", "--server", &addr, "--domain", "d", "--descriptor", "k=v", "--timeout", "2s"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot connect"), "{err}");
    let (code, _, err) = run(&["check", "--server", &addr, "--domain", "d", "--descriptor", "novalue"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("key=value"), "{err}");
}

#[test]
fn bad_settings_exit_64_before_binding() {
    let dir = TempDir::new("bad");
    dir.write(
        "rules/a.yaml",
        "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n",
    );
    let rules = dir.0.join("rules");
    let rules = rules.to_str().unwrap();
    // A port we hold: if serve bound anything before refusing, it would
    // fail differently (exit 2), not with its config error.
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let held = held.local_addr().unwrap().to_string();
    let cases: &[(&[&str], &str)] = &[
        (&["--config", rules], "a.yaml:4"),
        (&["--grpc-addr", "nonsense"], "--grpc-addr"),
        (&["--admin-addr", "0.0.0.0:0"], "admin-token"),
        (&["--store", "redis://:notaport"], "redis://HOST:PORT"),
        (&["--store", "postgres://x"], "--store"),
        (&["--store", "redis://127.0.0.1:1", "--redis-timeout", "0s"], "--redis-timeout"),
        (&["--response-headers", "all"], "--response-headers"),
        (&["--log-format", "xml"], "--log-format"),
        (&["--key-cache", "0"], "--key-cache"),
        (&["--key-cache", "18446744073709551615"], "at most 1073741824"),
        (&["--shutdown-grace", "soon"], "--shutdown-grace"),
        (&["--region", "a", "--peers", "b=http://127.0.0.1:1"], "--sync-addr"),
        (&["--region", "a", "--peers", "b=http://127.0.0.1:1", "--sync-addr", "0.0.0.0:0"], "--sync-token"),
        (
            &["--region", "a", "--peers", "b=http://127.0.0.1:1", "--sync-addr", "127.0.0.1:0", "--sync-lazy", "soon"],
            "--sync-lazy",
        ),
        (
            &[
                "--region",
                "a",
                "--peers",
                "b=http://127.0.0.1:1",
                "--sync-addr",
                "127.0.0.1:0",
                "--sync-interval",
                "0s",
            ],
            "--sync-interval",
        ),
        (&["--region", "a", "--peers", "a=http://127.0.0.1:1", "--sync-addr", "127.0.0.1:0"], "its own peers"),
        (&["--region", "a", "--peers", "b=ftp://127.0.0.1:1", "--sync-addr", "127.0.0.1:0"], "http://"),
    ];
    for (args, says) in cases {
        let mut all = vec!["serve"];
        for flag in ["--grpc-addr", "--http-addr"] {
            if !args.contains(&flag) {
                all.extend_from_slice(&[flag, &held]);
            }
        }
        all.extend_from_slice(args);
        let (code, _, err) = run(&all);
        assert_eq!(code, Some(64), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?} should say {says}: {err}");
    }
}

#[test]
fn a_taken_port_exits_2() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let held = held.local_addr().unwrap().to_string();
    let dir = TempDir::new("taken");
    let (code, _, err) = run(&[
        "serve",
        "--grpc-addr",
        &held,
        "--http-addr",
        "127.0.0.1:0",
        "--admin-addr",
        "127.0.0.1:0",
        "--overrides-file",
        dir.0.join("o.redb").to_str().unwrap(),
    ]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot bind the gRPC address"), "{err}");
}

/// `bench --protocol lease` (issue 49): Envoy's acquire and stream-end
/// release as one request; every slot is free again when it stops.
#[test]
fn bench_acquires_and_releases_leases() {
    let rules = "domain: bench\ndescriptors:\n  - key: user\n    rate_limit: {concurrency: 2, name: in_flight}\n";
    let s = Served::start("lease-bench", rules, &[]);
    let v = bench(&s.grpc, "lease", &["--duration", "500ms", "--concurrency", "8", "--keys", "100"]);
    assert!(v["allowed"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    let (_, metrics) = cli::http_get(&s.http, "/metrics");
    let held = metrics.lines().find(|l| l.starts_with("floodgate_leases_in_flight{")).unwrap_or_default().to_owned();
    assert!(held.ends_with(" 0"), "every lease released: {held}");
    let acquired = metrics.lines().find(|l| l.starts_with("floodgate_leases_acquired_total{")).unwrap_or_default();
    assert!(!acquired.ends_with(" 0"), "{acquired}");
}
