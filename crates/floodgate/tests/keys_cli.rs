//! `floodgate keys` against a running server: import (CSV and JSON lines,
//! bad lines by number, a failed batch applies nothing), export round trip,
//! get, set, delete, tiers, and decisions under the imported tiers.

use crate::cli;

use cli::{Served, http_get, run};
use floodgate_testing::TempDir;
use serde_json::Value;

const RULES: &str = "domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 30}
tiers:
  free: {unit: minute, requests_per_unit: 60}
  pro:
    - {algorithm: gcra, window: 1s, requests_per_unit: 50, burst: 100}
    - {unit: day, requests_per_unit: 1000000, name: pro-daily}
  enterprise: {unit: second, requests_per_unit: 1000}
";

fn keys(s: &Served, args: &[&str]) -> (Option<i32>, String, String) {
    let mut all = vec!["keys", "--admin-addr", s.admin.as_str()];
    all.extend_from_slice(args);
    run(&all)
}

fn tiers(s: &Served) -> Value {
    let (code, body) = http_get(&s.admin, "/admin/v1/tiers");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The limit the server reports for `user`.
fn limit_of(s: &Served, user: &str) -> u64 {
    let body = format!(r#"{{"domain": "api", "descriptor": [{{"key": "user", "value": "{user}"}}]}}"#);
    let (code, out) = cli::http(&s.admin, "POST", "/admin/v1/counters", &body);
    assert_eq!(code, 200, "{out}");
    let v: Value = serde_json::from_str(&out).unwrap();
    v["limits"][0]["limit"].as_u64().unwrap()
}

#[test]
fn import_export_get_set_delete_through_the_admin_api() {
    let s = Served::start("keys-cli", RULES, &[]);
    let dir = TempDir::new("keys-cli-files");
    // 25 000 users in three tiers, in three batches of 10 000.
    let mut csv = String::from("domain,user,tier\n");
    for i in 0..25_000 {
        let tier = ["free", "free", "pro", "enterprise"][i % 4];
        csv.push_str(&format!("api,user{i},{tier}\n"));
    }
    let file = dir.write("users.csv", &csv);
    let (code, _, err) = keys(&s, &["import", file.to_str().unwrap(), "--batch", "10000"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("imported 25000 entries"), "{err}");
    let t = tiers(&s);
    assert_eq!(t["total"], 25_000, "{t}");
    let count =
        |tier: &str| t["tiers"].as_array().unwrap().iter().find(|r| r["tier"] == tier).unwrap()["entries"].clone();
    assert_eq!((count("free"), count("pro"), count("enterprise")), (12_500.into(), 6_250.into(), 6_250.into()));
    // Decisions follow each user's tier; a user with no entry, the files.
    assert_eq!(limit_of(&s, "user2"), 50);
    assert_eq!(limit_of(&s, "user3"), 1_000);
    assert_eq!(limit_of(&s, "nobody"), 30);

    // get, set, delete.
    let (code, out, err) = keys(&s, &["get", "--domain", "api", "-d", "user=user0"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(serde_json::from_str::<Value>(&out).unwrap()["tier"], "free");
    let (code, _, err) = keys(&s, &["set", "--domain", "api", "-d", "user=user0", "--tier", "enterprise"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(limit_of(&s, "user0"), 1_000, "the cache saw the write");
    let (code, _, err) = keys(
        &s,
        &[
            "set",
            "--domain",
            "api",
            "-d",
            "user=big",
            "--limits",
            r#"{"unit":"second","requests_per_unit":5000}"#,
            "--name",
            "big",
        ],
    );
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(limit_of(&s, "big"), 5_000);
    let (code, _, err) = keys(&s, &["set", "--domain", "api", "-d", "user=x", "--tier", "gold"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("unknown tier `gold` in domain `api` (its tiers: enterprise, free, pro)"), "{err}");
    let (code, _, _) = keys(&s, &["delete", "--domain", "api", "-d", "user=big"]);
    assert_eq!(code, Some(0));
    let (code, _, _) = keys(&s, &["delete", "--domain", "api", "-d", "user=big"]);
    assert_eq!(code, Some(1), "already gone");
    let (code, _, _) = keys(&s, &["get", "--domain", "api", "-d", "user=big"]);
    assert_eq!(code, Some(1));

    // Export, as CSV and as JSON lines, reads back the same entries.
    let out_csv = dir.path("out.csv");
    let (code, _, err) = keys(&s, &["export", "--domain", "api", "--output", out_csv.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let text = std::fs::read_to_string(&out_csv).unwrap();
    assert_eq!(text.lines().count(), 25_001, "a header and every entry");
    assert!(text.starts_with("domain,user,tier,limits,name\n"), "{}", &text[..60]);
    assert!(text.contains("api,user0,enterprise,,\n"));
    let (code, jsonl, err) = keys(&s, &["export", "--prefix", "user=user1", "--domain", "api"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(jsonl.lines().count(), 11_111, "user1, user10-19, user100-199, ... user10000-19999");
    let first: Value = serde_json::from_str(jsonl.lines().next().unwrap()).unwrap();
    assert_eq!(first["descriptor"][0]["value"], "user1");
    // Importing the export again changes nothing.
    let (code, _, err) = keys(&s, &["import", out_csv.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(tiers(&s)["total"], 25_000);
}

#[test]
fn a_bad_line_stops_the_import_by_its_number_and_its_batch_writes_nothing() {
    let s = Served::start("keys-cli-bad", RULES, &[]);
    let dir = TempDir::new("keys-cli-bad-files");
    // Batches of 100: the bad lines are in the third.
    let mut jsonl = String::new();
    for i in 0..300 {
        let line = match i {
            250 => {
                "{\"domain\": \"api\", \"descriptor\": [{\"key\": \"user\", \"value\": \"u250\"}], \"tier\": \"gold\"}"
                    .to_owned()
            }
            260 => "{\"domain\": \"api\", \"descriptr\": []}".to_owned(),
            _ => format!(
                "{{\"domain\": \"api\", \"descriptor\": [{{\"key\": \"user\", \"value\": \"u{i}\"}}], \"tier\": \"free\"}}"
            ),
        };
        jsonl.push_str(&line);
        jsonl.push('\n');
    }
    let file = dir.write("users.jsonl", &jsonl);
    let (code, _, err) = keys(&s, &["import", file.to_str().unwrap(), "--batch", "100"]);
    assert_eq!(code, Some(64), "{err}");
    // The syntax error is found first, here, without a call.
    assert!(err.contains("users.jsonl:261: unknown field `descriptr`"), "{err}");
    assert!(err.contains("200 entries of the batches before it were"), "{err}");
    assert_eq!(tiers(&s)["total"], 200);
    // Fixed syntax: the server refuses the unknown tier, by line number.
    std::fs::write(
        &file,
        jsonl.replace(
            "\"descriptr\": []",
            "\"descriptor\": [{\"key\": \"user\", \"value\": \"u260\"}], \"tier\": \"pro\"",
        ),
    )
    .unwrap();
    let (code, _, err) = keys(&s, &["import", file.to_str().unwrap(), "--batch", "100"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("users.jsonl:251: unknown tier `gold`"), "{err}");
    assert_eq!(tiers(&s)["total"], 200, "nothing of the failed batch");
    let (code, _, _) = keys(&s, &["get", "--domain", "api", "-d", "user=u260"]);
    assert_eq!(code, Some(1));
    // A CSV without the columns it needs is refused at its header.
    let bad = dir.write("bad.csv", "user,tier\nalice,pro\n");
    let (code, _, err) = keys(&s, &["import", bad.to_str().unwrap()]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("bad.csv:1: the CSV header has no `domain` column"), "{err}");
    // No server: a clear error, exit 2.
    let (code, _, err) = run(&["keys", "--admin-addr", "127.0.0.1:1", "tiers"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(err.contains("cannot reach the admin API"), "{err}");
}

/// Issue 24: an entry whose tier is gone when the server starts (the rules
/// edited while it was stopped) never stops it: its key gets the files'
/// rules, the log says so, and reloads are not refused for it.
#[test]
fn a_tier_missing_at_startup_does_not_stop_the_server() {
    let dir = TempDir::new("keys-cli-startup");
    let db = dir.path("keys.redb");
    let start = |rules: &str, name: &str| {
        let rules_dir = dir.path(&format!("{name}-rules"));
        std::fs::create_dir_all(&rules_dir).unwrap();
        std::fs::write(rules_dir.join("api.yaml"), rules).unwrap();
        let mut cmd = cli::floodgate();
        cmd.args(["serve", "--log-format", "json", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args(["--admin-addr", "127.0.0.1:0", "--config"])
            .arg(&rules_dir)
            .arg("--overrides-file")
            .arg(&db);
        Served::spawn(cmd, TempDir::new(name))
    };
    let s = start(RULES, "keys-cli-startup-1");
    let (code, _, err) = keys(&s, &["set", "--domain", "api", "-d", "user=alice", "--tier", "free"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(s.terminate(), Some(0));
    let without_free = RULES.replace("  free: {unit: minute, requests_per_unit: 60}\n", "");
    let s = start(&without_free, "keys-cli-startup-2");
    assert!(!s.logged("name a tier the rules do not define").is_empty());
    assert_eq!(limit_of(&s, "alice"), 30, "the files' rule");
    let (code, body) = cli::http(&s.admin, "POST", "/admin/v1/reload", "");
    assert_eq!(code, 200, "{body}");
}

#[test]
fn with_a_redis_store_an_import_on_one_instance_serves_on_every_instance() {
    let redis = floodgate_testing::RedisServer::start();
    let a = Served::start("keys-redis-a", RULES, &["--store", &redis.url()]);
    let b = Served::start("keys-redis-b", RULES, &["--store", &redis.url()]);
    let dir = TempDir::new("keys-redis-files");
    let mut csv = String::from("domain,user,tier\n");
    for i in 0..3_000 {
        csv.push_str(&format!("api,user{i:04},{}\n", ["free", "pro"][i % 2]));
    }
    let file = dir.write("users.csv", &csv);
    let (code, _, err) = keys(&a, &["import", file.to_str().unwrap(), "--batch", "1000"]);
    assert_eq!(code, Some(0), "{err}");
    // B never saw a write: it reads the entries from Redis.
    assert_eq!(limit_of(&b, "user0001"), 50);
    assert_eq!(limit_of(&b, "user0002"), 60);
    assert_eq!(limit_of(&b, "nobody"), 30);
    // B's export is A's import, in order, over the shards.
    let out = dir.0.join("export.csv");
    let (code, _, err) = keys(&b, &["export", "--domain", "api", "--output", out.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{err}");
    let exported = std::fs::read_to_string(&out).unwrap();
    let rows: Vec<&str> = exported.lines().skip(1).map(|l| l.trim_end_matches(',')).collect();
    assert_eq!(rows, csv.lines().skip(1).collect::<Vec<_>>(), "the export lists every entry once, in order");
    // A change on A reaches B's cache (which holds user0001 now).
    let (code, _, err) = keys(&a, &["set", "--domain", "api", "-d", "user=user0001", "--tier", "enterprise"]);
    assert_eq!(code, Some(0), "{err}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
    while limit_of(&b, "user0001") != 1_000 {
        assert!(std::time::Instant::now() < deadline, "B's cache kept the old tier");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // B's counts follow the notices (read again at most every 250 ms).
    while tiers(&b)["total"] != 3_000 {
        assert!(std::time::Instant::now() < deadline + std::time::Duration::from_secs(2), "{}", tiers(&b));
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
