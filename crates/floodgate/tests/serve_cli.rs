//! `floodgate serve`, `check` and `bench` through the real binary: exit
//! codes, settings refused before any port is bound, SIGTERM, and the two
//! clients against a live server.

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::TempDir;
use serde_json::Value;

const RULES: &str =
    "domain: bench\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";

fn floodgate() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_floodgate"));
    // Settings come from flags in these tests, never from the environment.
    for (k, _) in std::env::vars() {
        if k.starts_with("FLOODGATE_") {
            c.env_remove(k);
        }
    }
    c
}

fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let Output { status, stdout, stderr } = floodgate().args(args).output().unwrap();
    (status.code(), String::from_utf8_lossy(&stdout).into_owned(), String::from_utf8_lossy(&stderr).into_owned())
}

/// A running `floodgate serve` on free ports, its addresses read from its log.
struct Served {
    child: Child,
    grpc: String,
    http: String,
    _dir: TempDir,
}

impl Served {
    fn start(name: &str) -> Served {
        let dir = TempDir::new(name);
        dir.write("rules/bench.yaml", RULES);
        let overrides = dir.0.join("overrides.redb");
        let mut child = floodgate()
            .args(["serve", "--log-format", "json", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args(["--admin-addr", "127.0.0.1:0", "--config"])
            .arg(dir.0.join("rules"))
            .arg("--overrides-file")
            .arg(overrides)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let serving = loop {
            let line = lines.next().expect("serve logs that it is serving").unwrap();
            let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            if v["fields"]["message"] == "floodgate serving" {
                break v;
            }
        };
        // Keep draining the log so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let field = |k: &str| serving["fields"][k].as_str().unwrap().to_owned();
        Served { grpc: field("grpc_addr"), http: field("http_addr"), child, _dir: dir }
    }

    /// SIGTERM, then the exit code (within 10 s).
    fn terminate(mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(Instant::now() < deadline, "serve did not stop within 10 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

#[test]
fn check_and_bench_against_a_live_server_then_sigterm_exits_0() {
    let s = Served::start("live");
    let check = |hits: &str| {
        run(&["check", "--server", &s.grpc, "--domain", "bench", "--descriptor", "user=a", "--hits", hits])
    };
    let (code, out, err) = check("1");
    assert_eq!(code, Some(0), "{out}{err}");
    assert!(out.starts_with("OK\n") && out.contains("limit 2 per minute, remaining 1"), "{out}");
    let (code, out, _) = check("2");
    assert_eq!(code, Some(1), "denied exits 1: {out}");
    assert!(out.starts_with("OVER_LIMIT"), "{out}");
    let (code, out, _) = run(&["check", "--server", &s.grpc, "--domain", "bench", "--descriptor", "user=b", "--json"]);
    assert_eq!(code, Some(0));
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["statuses"][0]["remaining"], 1);

    for (protocol, server) in [("grpc", &s.grpc), ("json", &s.http)] {
        let (code, out, err) = run(&[
            "bench",
            "--server",
            server,
            "--protocol",
            protocol,
            "--duration",
            "500ms",
            "--warmup",
            "0s",
            "--concurrency",
            "4",
            "--connections",
            "2",
            "--keys",
            "100",
            "--distribution",
            "zipf",
            "--json",
        ]);
        assert_eq!(code, Some(0), "{err}");
        let v: Value = serde_json::from_str(&out).unwrap();
        let requests = v["requests"].as_u64().unwrap();
        assert!(requests > 0, "{v}");
        assert_eq!(v["errors"], 0, "{v}");
        assert_eq!(v["allowed"].as_u64().unwrap() + v["denied"].as_u64().unwrap(), requests);
        assert!(v["latency_ms"]["p99"].as_f64().unwrap() > 0.0);
    }
    assert_eq!(s.terminate(), Some(0));
}

#[test]
fn check_exits_2_when_no_server_answers() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
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
        (&["--shutdown-grace", "soon"], "--shutdown-grace"),
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
