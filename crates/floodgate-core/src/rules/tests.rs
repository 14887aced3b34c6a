//! Rules: envoyproxy/ratelimit's own cases (re-written from what its config
//! tests specify), floodgate's extensions, and every kind of bad input.

use std::time::Duration;

use super::*;
use crate::{Algorithm, LeakyMode};

const BASIC: &str = r#"
domain: test-domain
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit:
          unit: second
          requests_per_unit: 5
      - key: subkey1
        value: subvalue1
        rate_limit:
          unit: second
          requests_per_unit: 10
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: key2
    value: value2
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: key2
    value: value3
  - key: key3
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: key4
    rate_limit: {name: key4_rate_limit, unit: day, requests_per_unit: 1}
  - key: key5
    value: value5
    rate_limit: {unit: day, requests_per_unit: 15}
    descriptors:
      - {key: subkey5, value: subvalue5, rate_limit: {unit: day, requests_per_unit: 25}}
  - key: key6
    rate_limit: {unlimited: true}
  - key: key7
    detailed_metric: true
    rate_limit: {unit: minute, requests_per_unit: 70}
"#;

fn load(text: &str) -> RuleSet {
    RuleSet::from_yaml("test.yaml", text).unwrap_or_else(|e| panic!("{e}"))
}

fn errors(text: &str) -> Vec<String> {
    RuleSet::from_yaml("test.yaml", text).expect_err("should not load").0.iter().map(ToString::to_string).collect()
}

fn one_error(text: &str, want: &str) {
    let errs = errors(text);
    assert!(errs.iter().any(|e| e.contains(want)), "want `{want}` in {errs:#?}");
}

/// (limit, window) of the single rule matched, or None.
fn limit_of(set: &RuleSet, entries: &[(&str, &str)]) -> Option<(u64, Duration)> {
    set.matches("test-domain", entries).map(|m| {
        let l = m.rules[0].limit.as_ref().expect("limited");
        (l.limit(), l.window())
    })
}

const S: Duration = Duration::from_secs(1);
const MIN: Duration = Duration::from_secs(60);

#[test]
fn envoy_basic_matching() {
    let set = load(BASIC);
    assert!(set.matches("foo_domain", &[("key1", "value1")]).is_none());
    assert!(set.matches("test-domain", &[] as &[(&str, &str)]).is_none());
    assert_eq!(limit_of(&set, &[("key1", "something")]), None, "no key-only rule for key1");
    assert_eq!(limit_of(&set, &[("key1", "value1")]), None, "a node with children but no limit");
    assert_eq!(limit_of(&set, &[("key2", "value2"), ("subkey", "subvalue")]), None, "intermediate limits do not apply");
    assert_eq!(limit_of(&set, &[("key5", "value5"), ("subkey5", "subvalue")]), None, "no backtracking to the parent");
    assert_eq!(limit_of(&set, &[("key1", "value1"), ("subkey1", "something")]), Some((5, S)));
    assert_eq!(limit_of(&set, &[("key1", "value1"), ("subkey1", "subvalue1")]), Some((10, S)), "exact beats key-only");
    assert_eq!(limit_of(&set, &[("key2", "something")]), Some((20, MIN)));
    assert_eq!(limit_of(&set, &[("key2", "value2")]), Some((30, MIN)));
    assert_eq!(limit_of(&set, &[("key2", "value3")]), None, "the exact whitelist node wins over key-only");
    assert_eq!(limit_of(&set, &[("key3", "foo")]), Some((1, Duration::from_secs(3600))));
    let m = set.matches("test-domain", &[("key4", "foo")]).unwrap();
    assert_eq!(m.rules[0].name.as_deref(), Some("key4_rate_limit"));
    let m = set.matches("test-domain", &[("key5", "value5")]).unwrap();
    assert_eq!(m.rules[0].limit.as_ref().unwrap().limit(), 15, "a request that stops at an inner node gets its limit");
    let m = set.matches("test-domain", &[("key6", "foo")]).unwrap();
    assert!(m.rules[0].limit.is_none(), "unlimited");
    let m = set.matches("test-domain", &[("key7", "x")]).unwrap();
    assert!(m.rules[0].detailed_metric);
    assert_eq!(m.rules[0].stats_key, "test-domain.key7");
    let m = set.matches("test-domain", &[("key1", "value1"), ("subkey1", "subvalue1")]).unwrap();
    assert_eq!(m.rules[0].stats_key, "test-domain.key1_value1.subkey1_subvalue1");
    assert_eq!(m.rules[0].unit, Some(Unit::Second));
    assert_eq!(*m.rules[0].limit.as_ref().unwrap().algorithm(), Algorithm::FixedWindow, "envoy's algorithm");
}

#[test]
fn key_only_rules_count_each_value_apart() {
    let set = load(BASIC);
    let a = set.matches("test-domain", &[("key2", "alice")]).unwrap().counter_key(0);
    let b = set.matches("test-domain", &[("key2", "bob")]).unwrap().counter_key(0);
    assert_ne!(a, b);
    assert_eq!(a, set.matches("test-domain", &[("key2", "alice")]).unwrap().counter_key(0));
    // Length prefixes: no value can forge another descriptor's key.
    let set = load(
        "domain: d\ndescriptors:\n  - key: a\n    descriptors:\n      - key: b\n        rate_limit: {unit: second, requests_per_unit: 1}\n  - key: a\n    value: x|1:b1:y\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    );
    let two = set.matches("d", &[("a", "x"), ("b", "y")]).unwrap().counter_key(0);
    assert!(set.matches("d", &[("a", "x|1:b1:y")]).is_some_and(|m| m.counter_key(0) != two));
}

const WILDCARD: &str = r#"
domain: test-domain
descriptors:
  - key: wild
    value: foo*
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: noWild
    value: foo
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: nestedWild
    value: val1
    descriptors:
      - key: wild
        value: goo*
        rate_limit: {unit: minute, requests_per_unit: 20}
  - key: midWild
    value: bar*b
    rate_limit: {unit: minute, requests_per_unit: 30}
  - key: multiWild
    value: foo*bar*baz
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: files
    value: files/*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: file
    value: test1
    rate_limit: {unit: minute, requests_per_unit: 50}
  - key: file
    value: test*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 100}
"#;

#[test]
fn envoy_wildcards() {
    let set = load(WILDCARD);
    assert_eq!(limit_of(&set, &[("wild", "foo1")]), Some((20, MIN)));
    assert_eq!(limit_of(&set, &[("wild", "foo2")]), Some((20, MIN)));
    assert_eq!(limit_of(&set, &[("wild", "bar")]), None);
    assert_eq!(limit_of(&set, &[("noWild", "foo1")]), None, "no prefix matching without *");
    assert_eq!(limit_of(&set, &[("nestedWild", "val1"), ("wild", "goo2")]), Some((20, MIN)));
    for v in ["barab", "bar123b", "barb"] {
        assert_eq!(limit_of(&set, &[("midWild", v)]), Some((30, MIN)), "{v}");
    }
    for v in ["bara", "xbarb"] {
        assert_eq!(limit_of(&set, &[("midWild", v)]), None, "{v}");
    }
    assert_eq!(limit_of(&set, &[("multiWild", "foo123bar456baz")]), Some((10, MIN)));
    assert_eq!(limit_of(&set, &[("multiWild", "foo123baz")]), None);
    // Plain wildcards count each value apart; shared ones share a counter.
    let k = |e: &[(&str, &str)]| set.matches("test-domain", e).unwrap().counter_key(0);
    assert_ne!(k(&[("wild", "foo1")]), k(&[("wild", "foo2")]));
    assert_eq!(k(&[("files", "files/a.pdf")]), k(&[("files", "files/b.csv")]));
    assert_eq!(k(&[("file", "test2")]), k(&[("file", "test23")]));
    assert_eq!(limit_of(&set, &[("file", "test1")]), Some((50, MIN)), "exact beats the shared wildcard");
    assert_ne!(k(&[("file", "test1")]), k(&[("file", "test2")]));
}

#[test]
fn envoy_accepts_what_envoy_accepts() {
    // requests_per_unit missing or 0: loads, and denies everything.
    let set = load("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second}\n");
    assert_eq!(set.matches("d", &[("k", "v")]).unwrap().rules[0].limit.as_ref().unwrap().limit(), 0);
    // unlimited with requests_per_unit and no unit.
    let set = load("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, requests_per_unit: 5}\n");
    assert!(set.matches("d", &[("k", "v")]).unwrap().rules[0].limit.is_none());
    // unlimited with an invalid unit: loads, with a warning.
    let set = load("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: foo}\n");
    assert_eq!(set.warnings().len(), 1);
    // Units ignore case; week, month and year exist.
    for (u, secs) in [("MINUTE", 60), ("Minute", 60), ("week", 604_800), ("month", 2_592_000), ("year", 31_536_000)] {
        let set = load(&format!(
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: {u}, requests_per_unit: 1}}\n"
        ));
        let l = set.matches("d", &[("k", "v")]).unwrap().rules[0].limit.clone().unwrap();
        assert_eq!(l.window(), Duration::from_secs(secs), "{u}");
    }
    // A descriptor with neither rate_limit nor descriptors, numbers as
    // values, YAML 1.1 booleans, metadata of any shape, replaces of unknown
    // names.
    let set = load(
        "domain: d\ndescriptors:\n  - key: white\n  - key: port\n    value: 8080\n    shadow_mode: yes\n    metadata: {a: [1, 2.5, {b: c}]}\n    rate_limit: {unit: second, requests_per_unit: 3, name: p, replaces: [{name: ghost}]}\n",
    );
    let m = set.matches("d", &[("port", "8080")]).unwrap();
    assert!(m.rules[0].shadow_mode);
    assert_eq!(m.rules[0].replaces, ["ghost"]);
    // envoy's keys at the wrong level: ignored there, so loaded with a warning.
    let set = load(
        "domain: d\ndescriptors:\n  - key: k\n    unit: second\n    rate_limit: {unit: second, requests_per_unit: 1}\n",
    );
    assert!(set.warnings()[0].message.contains("belongs inside rate_limit"), "{:?}", set.warnings());
}

#[test]
fn envoy_rejects_what_envoy_rejects() {
    one_error("descriptors: []\n", "missing domain");
    one_error("domain: ''\ndescriptors: []\n", "empty domain");
    one_error("", "empty file");
    one_error("domain: d\ndescriptors:\n  - key: ''\n", "empty key");
    one_error("domain: d\ndescriptors:\n  - value: v\n", "missing key");
    one_error(
        "domain: d\ndescriptors:\n  - {key: key1, value: value1}\n  - {key: key1, value: value1}\n",
        "test.yaml:4:5: descriptors[1]: duplicate descriptor `key1_value1` (first at line 3)",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: foo, requests_per_unit: 1}\n",
        "descriptors[0].rate_limit.unit: invalid unit `foo`: use second, minute, hour, day, week, month or year",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minutes, requests_per_unit: 1}\n",
        "invalid unit `minutes`",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {name: a, replaces: [{name: a}], unit: second}\n",
        "cannot replace itself",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {replaces: [{name: }], unit: second}\n",
        "empty replaces entry",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {replaces: [foo], unit: second}\n",
        "expected a mapping",
    );
    one_error("domain: d\n'''\n", "YAML syntax error");
    one_error("domain: d\ndescriptors:\n  - key: k\n    ratelimit: {unit: second}\n", "unknown field `ratelimit`");
    one_error("domain: d\ndescriptors:\n  - key: k\n    ratelimit: {unit: second}\n", "did you mean `rate_limit`?");
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requestsperunit: 5}\n",
        "unknown field `requestsperunit`",
    );
    one_error("domain: d\ndescriptors:\n  - key: k\n    0.25: x\n", "key `0.25` is not a string");
    one_error("domain: d\ndescriptors:\n  - a\n  - b\n", "descriptors[0]: expected a mapping");
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unlimited: true, unit: second}\n",
        "unlimited takes no unit",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    share_threshold: true\n    value: foo\n",
        "share_threshold needs a wildcard",
    );
    one_error("domain: d\ndescriptors:\n  - key: k\n    value: 1.5\n", "`1.5` reads as a number with a fraction");
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: -1}\n",
        "-1 is negative",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 1.5}\n",
        "expected a whole number",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 010}\n",
        "test.yaml:4:51: descriptors[0].rate_limit.requests_per_unit: `010` has a leading zero, which envoyproxy/ratelimit reads as octal (8): write 10",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: '5'}\n",
        "remove the quotes",
    );
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 4294967296}\n",
        "too large",
    );
    one_error("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {requests_per_unit: 5}\n", "missing unit");
    one_error("domain: d\ndescriptors:\n  - key: k\n    shadow_mode: maybe\n", "expected true or false");
    one_error("domain: d\nunknown: 1\n", "unknown field `unknown`: expected one of domain, descriptors");
}

#[test]
fn every_error_is_reported_at_once_with_its_position() {
    let errs = errors(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight, requests_per_unit: 1}\n  - key: b\n    rate_limit: {algorithm: gcra2, window: 1s}\n  - key: c\n    colour: red\n",
    );
    assert_eq!(errs.len(), 3, "{errs:#?}");
    assert!(
        errs[0].starts_with("test.yaml:4:24: descriptors[0].rate_limit.unit: invalid unit `fortnight`"),
        "{}",
        errs[0]
    );
    assert!(
        errs[1].starts_with("test.yaml:6:29: descriptors[1].rate_limit.algorithm: unknown algorithm `gcra2`"),
        "{}",
        errs[1]
    );
    assert!(errs[2].starts_with("test.yaml:8:5: descriptors[2].colour: unknown field `colour`"), "{}", errs[2]);
}

#[test]
fn floodgate_extensions() {
    let set = load(
        r#"
domain: api
descriptors:
  - key: user
    rate_limits:
      - {algorithm: gcra, window: 1s, requests_per_unit: 5, burst: 10, name: burst}
      - {unit: day, requests_per_unit: 10000, failure_mode: local, local_share: 0.25}
  - key: ip
    rate_limit: {algorithm: sliding_buckets, window: 90s, granularity: 9, requests_per_unit: 100, failure_mode: closed}
  - key: upload
    rate_limit: {algorithm: leaky_bucket, mode: shape, window: 1m, requests_per_unit: 60, burst: 5}
"#,
    );
    let m = set.matches("api", &[("user", "alice")]).unwrap();
    assert_eq!(m.rules.len(), 2);
    let burst = m.rules[0].limit.as_ref().unwrap();
    assert_eq!(*burst.algorithm(), Algorithm::Gcra { burst: Some(10) });
    assert_eq!(m.rules[0].unit, Some(Unit::Second));
    let daily = &m.rules[1];
    assert_eq!(daily.failure_mode, FailureMode::Local);
    assert_eq!(daily.local_limit.as_ref().unwrap().limit(), 2_500);
    assert_ne!(m.counter_key(0), m.counter_key(1));
    let ip = set.matches("api", &[("ip", "10.0.0.1")]).unwrap();
    assert_eq!(*ip.rules[0].limit.as_ref().unwrap().algorithm(), Algorithm::SlidingBuckets { granularity: 9 });
    assert_eq!(ip.rules[0].unit, None, "90s is none of envoy's units");
    assert_eq!(ip.rules[0].failure_mode, FailureMode::Closed);
    let up = set.matches("api", &[("upload", "x")]).unwrap();
    assert_eq!(
        *up.rules[0].limit.as_ref().unwrap().algorithm(),
        Algorithm::LeakyBucket { burst: Some(5), mode: LeakyMode::Shape }
    );
}

#[test]
fn extension_errors_say_what_to_write() {
    let rl = |body: &str| format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{{body}}}\n");
    one_error(&rl("window: 1s, requests_per_unit: 1, burst: 3"), "rate_limit.burst: fixed_window has no burst");
    one_error(&rl("algorithm: sliding_log, window: 1s, requests_per_unit: 20000"), "capped at 10000");
    one_error(&rl("algorithm: sliding_buckets, window: 1s, requests_per_unit: 1, granularity: 7"), "e.g. 8");
    one_error(&rl("algorithm: sliding_buckets, window: 1s, requests_per_unit: 1"), "needs granularity");
    one_error(&rl("window: 90, requests_per_unit: 1"), "has no unit: write e.g. 90s");
    one_error(&rl("window: 500us, requests_per_unit: 1"), "too short");
    one_error(&rl("unit: second, window: 1s"), "both unit and window");
    one_error(&rl("window: 1s, mode: shape"), "fixed_window has no mode");
    one_error(&rl("algorithm: leaky_bucket, mode: queue, window: 1s"), "unknown mode `queue`");
    one_error(&rl("window: 1s, failure_mode: maybe"), "use open, closed or local");
    one_error(&rl("window: 1s, failure_mode: local, local_share: 1.5"), "must be a number in (0, 1]");
    one_error(&rl("window: 1s, failure_mode: local, local_share: 0"), "must be a number in (0, 1]");
    one_error(&rl("unlimited: true, algorithm: gcra"), "unlimited takes no algorithm");
    one_error(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second}\n    rate_limits: [{unit: day}]\n",
        "both rate_limit and rate_limits",
    );
    one_error("domain: d\ndescriptors:\n  - key: k\n    window: 1s\n", "`window` belongs inside rate_limit");
}

#[test]
fn merge_keys_load_as_envoy_reads_them() {
    let set = load(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: &std {unit: minute, requests_per_unit: 5}\n  - key: b\n    rate_limit:\n      <<: *std\n      requests_per_unit: 9\n",
    );
    let limit = |k: &str| set.matches("d", &[(k, "x")]).unwrap().rules[0].limit.clone().unwrap();
    assert_eq!((limit("a").limit(), limit("a").window()), (5, Duration::from_secs(60)));
    assert_eq!((limit("b").limit(), limit("b").window()), (9, Duration::from_secs(60)));
}

#[test]
fn charge_after_is_read_and_checked() {
    let rl = |body: &str| format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{{body}}}\n");
    let set = load(&rl("unit: minute, requests_per_unit: 100, charge: after"));
    let m = set.matches("d", &[("k", "x")]).unwrap();
    let limit = m.rules[0].limit.as_ref().unwrap();
    assert_eq!(limit.charge(), crate::Charge::After);
    let before = load(&rl("unit: minute, requests_per_unit: 100, charge: before"));
    let b = before.matches("d", &[("k", "x")]).unwrap().rules[0].limit.clone().unwrap();
    assert_eq!(b.charge(), crate::Charge::Before);
    assert_ne!(b.fingerprint(), limit.fingerprint(), "a key's state starts fresh when its charge changes");
    // The local fallback is charged as its limit is.
    let local = load(&rl("unit: minute, requests_per_unit: 100, charge: after, failure_mode: local, local_share: 0.5"));
    let l = local.matches("d", &[("k", "x")]).unwrap().rules[0].local_limit.clone().unwrap();
    assert_eq!((l.limit(), l.charge()), (50, crate::Charge::After));
    one_error(
        &rl("unit: minute, charge: later"),
        "rate_limit.charge: unknown charge `later`: use before (the default) or after",
    );
    one_error(
        &rl("algorithm: leaky_bucket, mode: shape, unit: second, requests_per_unit: 5, charge: after"),
        "rate_limit.charge: charge: after counts work already done",
    );
    one_error(&rl("unlimited: true, charge: after"), "unlimited takes no charge");
    one_error(
        &rl("unit: minute, requests_per_unit: 5, charge: after, scope: global"),
        "charge: after with scope: global needs sliding_window, sliding_buckets or gcra",
    );
    for algorithm in ["sliding_window", "sliding_buckets, granularity: 10", "gcra", "token_bucket"] {
        let doc =
            rl(&format!("algorithm: {algorithm}, unit: minute, requests_per_unit: 60, charge: after, scope: global"));
        let set = load(&doc);
        let l = set.matches("d", &[("k", "x")]).unwrap().rules[0].limit.clone().unwrap();
        assert_eq!(l.charge(), crate::Charge::After, "{algorithm}");
    }
}

#[test]
fn concurrency_limits_are_read_and_checked() {
    let rl = |body: &str| format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{{body}}}\n");
    let set = load(&rl("concurrency: 10, name: in_flight"));
    let l = set.matches("d", &[("k", "x")]).unwrap().rules[0].limit.clone().unwrap();
    assert_eq!(
        (*l.algorithm(), l.limit(), l.window()),
        (crate::Algorithm::Concurrency, 10, 60 * S),
        "default lease: a minute"
    );
    let set = load(&rl("concurrency: 3, lease_ttl: 10m, failure_mode: closed"));
    let r = &set.matches("d", &[("k", "x")]).unwrap().rules[0];
    assert_eq!(r.limit.as_ref().unwrap().window(), 10 * MIN);
    one_error(&rl("concurrency: 3, failure_mode: local"), "rate_limit.failure_mode: failure_mode: local keeps a rate");
    // Beside a rate, in a rate_limits list.
    let both = load(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: minute, requests_per_unit: 100}\n      - {concurrency: 5}\n",
    );
    assert_eq!(both.matches("d", &[("k", "x")]).unwrap().rules.len(), 2);
    assert_eq!(both.domain("d").unwrap().metering().map(|m| m.leases), Some(true), "held until responses end");
    one_error(
        &rl("concurrency: 5, scope: global"),
        "test.yaml:4:41: descriptors[0].rate_limit.scope: a concurrency limit cannot be global",
    );
    one_error(
        &rl("concurrency: 5, requests_per_unit: 10"),
        "rate_limit.requests_per_unit: a concurrency limit takes no requests_per_unit",
    );
    one_error(&rl("concurrency: 5, unit: second"), "a concurrency limit takes no unit");
    one_error(&rl("concurrency: 5, charge: after"), "a concurrency limit takes no charge");
    one_error(
        &rl("concurrency: 0"),
        "rate_limit.concurrency: concurrency 0: write the requests in flight at once per key, from 1 to 100000",
    );
    one_error(&rl("concurrency: 200000"), "concurrency 200000");
    one_error(&rl("concurrency: 5, lease_ttl: 0s"), "rate_limit.lease_ttl: `0s`");
    one_error(&rl("concurrency: 5, lease_ttl: 2d"), "write a duration from 1s to 24h");
    one_error(&rl("unlimited: true, concurrency: 5"), "unlimited takes no concurrency");
}

#[test]
fn costs_are_read_and_checked() {
    use crate::rules::cost::{Actual, EstimateFrom, Metering};
    let rl = |body: &str| format!("domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{{body}}}\n");
    let set = load(&rl(
        "unit: hour, requests_per_unit: 100000, cost: {estimate: {body: [max_completion_tokens, max_tokens], default: 4096, times: 0.6, plus: 300}, actual: {usage: {prompt_tokens: 0.15, completion_tokens: 0.6}}}",
    ));
    let m = set.matches("d", &[("k", "x")]).unwrap();
    let cost = m.rules[0].cost.as_deref().unwrap();
    assert_eq!(
        cost.estimate.from,
        EstimateFrom::Body(std::sync::Arc::from([
            std::sync::Arc::from("max_completion_tokens"),
            std::sync::Arc::from("max_tokens")
        ]))
    );
    assert_eq!((cost.estimate.default, cost.estimate.times, cost.estimate.plus), (4096, 600_000, 300));
    assert!(matches!(&cost.actual, Actual::Usage(w) if w.len() == 2 && w[0].1 == 150_000));
    assert!(cost.include_usage, "asked by default when usage is read");
    assert_eq!(
        set.domain("d").unwrap().metering(),
        Some(Metering { body: true, usage: true, include_usage: true, leases: false })
    );
    let header = load(&rl("unit: hour, requests_per_unit: 9, cost: {estimate: 5, actual: {header: X-Cost}}"));
    let m = header.matches("d", &[("k", "x")]).unwrap();
    let cost = m.rules[0].cost.as_deref().unwrap();
    assert_eq!((&cost.estimate.from, cost.estimate.default), (&EstimateFrom::Constant, 5));
    assert_eq!(cost.actual, Actual::Header(std::sync::Arc::from("x-cost")), "header names are kept lowercase");
    assert_eq!(
        header.domain("d").unwrap().metering(),
        Some(Metering { body: false, usage: false, include_usage: false, leases: false })
    );
    assert_eq!(load(&rl("unit: hour, requests_per_unit: 9")).domain("d").unwrap().metering(), None);
    for (cost, want) in [
        ("{actual: {usage: total_tokens}}", "rate_limit.cost.estimate: missing estimate"),
        ("{estimate: 5}", "rate_limit.cost.actual: missing actual"),
        (
            "{estimate: {body: max_tokens}, actual: {usage: total_tokens}}",
            "rate_limit.cost.estimate.default: missing default",
        ),
        ("{estimate: {default: 5}, actual: {usage: total_tokens}}", "say where the estimate is read"),
        ("{estimate: {header: x, body: y, default: 1}, actual: {usage: a}}", "an estimate reads one place"),
        ("{estimate: 5, actual: {usage: {total_tokens: -1}}}", "expected a number from 0 to 1000000"),
        ("{estimate: 5, actual: {usage: {}}}", "name at least one usage field"),
        ("{estimate: 5, actual: {header: \"a b\"}}", "is not a header name"),
        ("{estimate: 5, actual: {headr: x}}", "unknown field `headr`"),
        ("{estimate: 5, actual: {usage: a, header: b}}", "keep header or usage"),
        ("{estimate: 5.5, actual: {usage: a}}", "expected a whole number"),
    ] {
        one_error(&rl(&format!("unit: hour, requests_per_unit: 9, cost: {cost}")), want);
    }
    one_error(
        &rl("unit: hour, requests_per_unit: 9, charge: after, cost: {estimate: 5, actual: {usage: a}}"),
        "rate_limit.cost: cost reserves an estimate before the work",
    );
    one_error(
        &rl(
            "algorithm: leaky_bucket, mode: shape, unit: second, requests_per_unit: 5, cost: {estimate: 5, actual: {usage: a}}",
        ),
        "a shaper (mode: shape) cannot take a cost",
    );
    one_error(&rl("unlimited: true, cost: {estimate: 5, actual: {usage: a}}"), "unlimited takes no cost");
    one_error(
        &rl("unit: hour, requests_per_unit: 9, scope: global, cost: {estimate: 5, actual: {usage: a}}"),
        "cost with scope: global needs sliding_window, sliding_buckets or gcra",
    );
    load(&rl(
        "algorithm: gcra, unit: hour, requests_per_unit: 9, scope: global, cost: {estimate: 5, actual: {usage: a}}",
    ));
}

#[test]
fn body_fields_are_read_and_make_their_domain_read_bodies() {
    let doc = |action: &str| format!("domain: d\nrequest_descriptors:\n  - actions: [{action}]\ndescriptors: []\n");
    let set = load(&doc("{body_field: {field: model, descriptor_key: model, skip_if_absent: true}}"));
    let d = set.domain("d").unwrap();
    assert_eq!(
        d.request_descriptors()[0].actions,
        vec![Action::BodyField { field: "model".into(), key: "model".into(), skip_if_absent: true }]
    );
    assert_eq!(d.metering().map(|m| m.body), Some(true), "a body_field makes its domain's bodies read");
    one_error(&doc("{body_field: {descriptor_key: model}}"), "missing field: add e.g. field: model");
    one_error(&doc("{body_field: {field: model}}"), "missing descriptor_key");
    one_error(&doc("{body_field: {field: model, descriptor_key: m, header_name: x}}"), "unknown field `header_name`");
}

#[test]
fn bounds_are_errors_not_crashes() {
    let deep = format!(
        "domain: d\ndescriptors:\n{}",
        (0..100)
            .map(|i| format!("{}- key: k{i}\n{}  descriptors:\n", "  ".repeat(2 * i), "  ".repeat(2 * i)))
            .collect::<String>()
    );
    one_error(&deep, "nested deeper than 64 levels");
    let many: String = (0..20).map(|i| format!("  - {{key: k{i}, rate_limit: {{unit: second}}}}\n")).collect();
    let opts = LoadOptions { max_rules: 10, ..LoadOptions::default() };
    let err =
        RuleSet::from_sources(vec![("x.yaml".into(), format!("domain: d\ndescriptors:\n{many}"))], &opts).unwrap_err();
    assert!(err.to_string().contains("more than 10 rules"), "{err}");
}

#[test]
fn ten_thousand_rules_match_by_lookup() {
    let mut text = String::from("domain: big\ndescriptors:\n");
    for i in 0..10_000 {
        text.push_str(&format!(
            "  - key: tenant\n    value: t{i}\n    rate_limit: {{unit: minute, requests_per_unit: {}}}\n",
            i + 1
        ));
    }
    let set = load(&text);
    assert_eq!(set.rule_count(), 10_000);
    for i in (0..10_000).step_by(997) {
        let m = set.matches("big", &[("tenant", format!("t{i}"))]).unwrap();
        assert_eq!(m.rules[0].limit.as_ref().unwrap().limit(), i + 1);
    }
    assert!(set.matches("big", &[("tenant", "t10000")]).is_none());
}

#[test]
fn duplicate_domains_across_files() {
    let a = ("a.yaml".into(), "domain: d\ndescriptors: []\n".to_owned());
    let b = ("b.yaml".into(), "\ndomain: d\ndescriptors: []\n".to_owned());
    let err = RuleSet::from_sources(vec![a, b], &LoadOptions::default()).unwrap_err().to_string();
    assert!(err.contains("b.yaml:2:9: domain `d` is already defined in a.yaml:1:9"), "{err}");
}

#[test]
fn replaces_applies_across_the_request() {
    let set = load(
        r#"
domain: d
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        rate_limit: {name: general, unit: second, requests_per_unit: 100}
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        rate_limit: {name: specific, unit: second, requests_per_unit: 10, replaces: [{name: general}]}
  - key: a
    rate_limit: {name: a, unit: second, requests_per_unit: 1, replaces: [{name: b}]}
  - key: b
    rate_limit: {name: b, unit: second, requests_per_unit: 1, replaces: [{name: a}]}
  - key: vip
    rate_limit: {unlimited: true, replaces: [{name: general}]}
"#,
    );
    let d1: &[(&str, &str)] = &[("key_1", "value_1"), ("user", "bkthomps")];
    let d2: &[(&str, &str)] = &[("key_2", "value_2"), ("user", "bkthomps")];
    let m = set.match_request("d", [d1, d2]);
    assert_eq!(m.applicable(0).count(), 0, "general is replaced");
    assert_eq!(m.applicable(1).next().unwrap().1.name.as_deref(), Some("specific"));
    // Alone, the general limit applies.
    assert_eq!(set.match_request("d", [d1]).applicable(0).count(), 1);
    // Mutual replacement drops both.
    let a: &[(&str, &str)] = &[("a", "x")];
    let b: &[(&str, &str)] = &[("b", "x")];
    let m = set.match_request("d", [a, b]);
    assert_eq!(m.applicable(0).count() + m.applicable(1).count(), 0);
    // An unlimited rule can replace too.
    let vip: &[(&str, &str)] = &[("vip", "x")];
    assert_eq!(set.match_request("d", [d1, vip]).applicable(0).count(), 0);
    // Unmatched descriptors have nothing.
    let none: &[(&str, &str)] = &[("nope", "x")];
    assert_eq!(set.match_request("d", [none]).applicable(0).count(), 0);
}

#[test]
fn request_descriptors_parse_envoy_actions() {
    let rules = load(
        r#"
domain: proxy
request_descriptors:
  - actions:
      - remote_address: {}
  - actions:
      - request_headers: {header_name: X-Api-Key, descriptor_key: api_key}
      - request_headers: {header_name: ":path", descriptor_key: path, skip_if_absent: true}
      - generic_key: {descriptor_value: reads}
descriptors:
  - key: remote_address
    rate_limit: {unit: second, requests_per_unit: 5}
"#,
    );
    let d = rules.domain("proxy").unwrap().request_descriptors();
    assert_eq!(d.len(), 2);
    assert_eq!(d[0].actions, vec![Action::RemoteAddress]);
    assert_eq!(
        d[1].actions,
        vec![
            Action::RequestHeader { header: "x-api-key".into(), key: "api_key".into(), skip_if_absent: false },
            Action::RequestHeader { header: ":path".into(), key: "path".into(), skip_if_absent: true },
            Action::GenericKey { key: "generic_key".into(), value: "reads".into() },
        ]
    );
    // A file without the section has none.
    assert!(load(BASIC).domain("test-domain").unwrap().request_descriptors().is_empty());
}

#[test]
fn bad_request_descriptors_are_positioned() {
    let text = r#"domain: proxy
request_descriptors:
  - actions:
      - remote_adress: {}
  - actions: []
  - actions:
      - request_headers: {header_name: "x api", descriptor_key: k}
      - request_headers: {header_name: ":host", descriptor_key: k}
      - request_headers: {descriptor_key: k}
      - generic_key: {descriptor_value: ""}
      - {remote_address: {}, generic_key: {descriptor_value: v}}
  - nothing: 1
"#;
    let errs = errors(text);
    let has = |needle: &str| errs.iter().any(|e| e.contains(needle));
    assert!(has("4:9: request_descriptors[0].actions[0].remote_adress: unknown field"), "{errs:#?}");
    assert!(has("did you mean `remote_address`?"), "{errs:#?}");
    assert!(has("5:14: request_descriptors[1].actions: expected a non-empty list"), "{errs:#?}");
    assert!(has("7:40: request_descriptors[2].actions[0].request_headers.header_name: `x api` is not"), "{errs:#?}");
    assert!(has("`:host` is not an HTTP header name"), "{errs:#?}");
    assert!(has("request_descriptors[2].actions[2].request_headers: missing header_name"), "{errs:#?}");
    assert!(has("actions[3].generic_key.descriptor_value: must not be empty"), "{errs:#?}");
    assert!(has("actions[4]: an action names exactly one of"), "{errs:#?}");
    assert!(has("12:5: request_descriptors[3].nothing: unknown field"), "{errs:#?}");
    assert!(has("request_descriptors[3]: missing actions") || has("request_descriptors[3].nothing"), "{errs:#?}");
    let list = errors("domain: p\nrequest_descriptors: 3\n");
    assert!(list[0].contains("2:22: request_descriptors: expected a list"), "{list:#?}");
}

#[test]
fn scope_sync_and_overshoot() {
    use crate::region::{Scope, SyncMode};
    let set = load(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 60, scope: global}\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 600, scope: global, sync: bounded, overshoot: 5%}\n  - key: c\n    rate_limit: {unit: minute, requests_per_unit: 6, scope: region}\n  - key: e\n    rate_limit: {unit: minute, requests_per_unit: 6}\n",
    );
    let scope = |k: &str| set.matches("d", &[(k, "x")]).unwrap().rules[0].scope;
    assert_eq!(scope("a"), Scope::Global(SyncMode::Eventual));
    assert_eq!(scope("b"), Scope::Global(SyncMode::Bounded { overshoot_ppm: 50_000 }));
    assert_eq!(scope("c"), Scope::Region);
    assert_eq!(scope("e"), Scope::Region, "the default");

    let rl = |extra: &str| {
        format!(
            "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {{unit: minute, requests_per_unit: 60, {extra}}}\n"
        )
    };
    one_error(&rl("scope: planet"), "test.yaml:4:62: descriptors[0].rate_limit.scope: unknown scope `planet`");
    one_error(&rl("sync: bounded, overshoot: 5%"), "sync applies only to scope: global");
    one_error(&rl("scope: region, overshoot: 5%"), "overshoot applies only to scope: global");
    one_error(&rl("scope: global, sync: bounded"), "sync: bounded needs overshoot");
    one_error(&rl("scope: global, overshoot: 5%"), "overshoot applies only to sync: bounded");
    one_error(&rl("scope: global, sync: strict"), "unknown sync `strict`: use eventual");
    one_error(&rl("scope: global, sync: bounded, overshoot: 150%"), "overshoot `150%`");
    one_error(
        "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unlimited: true, scope: global}\n",
        "unlimited takes no scope",
    );
}

#[test]
fn tiers_are_named_plans_of_any_limits() {
    let set = load(
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 2}\ntiers:\n  free: {unit: minute, requests_per_unit: 60}\n  pro:\n    - {algorithm: gcra, window: 1s, requests_per_unit: 50, burst: 100}\n    - {name: pro-daily, unit: day, requests_per_unit: 1000000}\n",
    );
    let api = set.domain("api").unwrap();
    let free = api.tier("free").unwrap();
    assert_eq!(free.rules.len(), 1);
    assert_eq!(free.rules[0].stats_key, "tier:free");
    assert_eq!(free.rules[0].limit.as_ref().unwrap().limit(), 60);
    assert_eq!((free.pos.line, free.pos.col), (6, 3));
    let pro = api.tier("pro").unwrap();
    assert_eq!(pro.rules.len(), 2);
    assert_eq!(pro.rules[1].name.as_deref(), Some("pro-daily"));
    assert!(api.tier("enterprise").is_none());
    assert_eq!(api.tiers().count(), 2);
    // Tiers are not descriptors: nothing matches them.
    assert!(set.matches("api", &[("free", "x")]).is_none());
}

#[test]
fn tier_errors_say_what_to_write() {
    one_error("domain: api\ntiers:\n  free: 60\n", "tiers.free");
    one_error("domain: api\ntiers:\n  free: 60\n", "a rate_limit block");
    one_error("domain: api\ntiers:\n  free: {unit: fortnight, requests_per_unit: 1}\n", "tiers.free.unit");
    one_error("domain: api\ntiers:\n  \"a b\": {unit: second, requests_per_unit: 1}\n", "letters, digits");
    one_error(
        "domain: api\ntiers:\n  free: {unit: second, requests_per_unit: 1, scope: global}\n",
        "a tier's limits are per region",
    );
    one_error("domain: api\ntiers: [free]\n", "tiers");
}
