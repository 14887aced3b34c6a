//! Per-key entries kept in Redis (and a Redis Cluster), sharded by key:
//! every instance sees every entry, one change reaches every instance's
//! cache within a second through Pub/Sub, a lost subscription drops the
//! cache, misses are read in batches (one read per key however many wait),
//! listings page in key order across the shards, and a dead Redis leaves
//! the cached answers serving and the misses on the files' rules.

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_core::rules::RuleSet;
use floodgate_perkey::{CacheOptions, Entry, KeySpec, Limits, PerKey, SHARDS};
use floodgate_redis::{RedisConfig, RedisStore};
use floodgate_testing::{RedisCluster, RedisServer};
use std::sync::atomic::Ordering::Relaxed;

use floodgate_testing::TempDir;

/// Domain `api` with tiers `free` and `pro`.
const TIERED: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 10}\ntiers:\n  free: {unit: minute, requests_per_unit: 60}\n  pro: {unit: second, requests_per_unit: 50}\n";

fn rules() -> RuleSet {
    RuleSet::from_yaml("api.yaml", TIERED).expect("the test's rules")
}

fn tiered(user: &str, tier: &str) -> KeySpec {
    KeySpec {
        domain: "api".into(),
        descriptor: vec![Entry { key: "user".into(), value: user.into() }],
        tier: Some(tier.into()),
        limits: None,
        name: None,
    }
}

fn store(url: &str) -> RedisStore {
    let mut config = RedisConfig::new(url.parse().expect("a Redis URL"));
    // Well over a read's time on a loaded 2-core machine (the file's tests
    // run side by side, some with a cluster of six servers), under the
    // 2 s a dead Redis's miss is allowed.
    config.timeout = Duration::from_secs(1);
    RedisStore::new(config).expect("a store")
}

/// An instance: its own database file (unused once shared), the entries
/// in Redis, a long time to live (so only a change notice can explain a
/// fresh answer).
fn instance(dir: &TempDir, name: &str, url: &str) -> Arc<PerKey> {
    let cache = CacheOptions { entries: 10_000, ttl: Some(Duration::from_secs(600)) };
    let k = Arc::new(PerKey::open_with(dir.0.join(format!("{name}.redb")), cache).expect("a store"));
    tokio::spawn(k.share(store(url)));
    k
}

fn tier(l: Option<Limits>) -> Option<String> {
    match l? {
        Limits::Tier(t) => Some(t.to_string()),
        Limits::Own(_) => Some("own".into()),
    }
}

async fn lookup(k: &PerKey, user: &str) -> Option<String> {
    tier(k.lookup("api", &[("user", user)]).await)
}

/// Wait up to `within` for `f` to hold; how long it took.
async fn until(within: Duration, what: &str, mut f: impl AsyncFnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f().await {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    start.elapsed()
}

/// Every user of domain `api` under `prefix`, listed `page` at a time
/// through the cursor, and how many pages it took.
async fn listed(k: &PerKey, prefix: &str, page: usize) -> (Vec<String>, usize) {
    let (mut users, mut pages, mut cursor) = (Vec::new(), 0, None::<String>);
    loop {
        let p = k.list(Some("api"), prefix, false, cursor.as_deref(), page).await.unwrap();
        assert!(p.entries.len() <= page);
        users.extend(p.entries.iter().map(|(s, _)| s.descriptor[0].value.clone()));
        pages += 1;
        match p.next_cursor {
            Some(c) => cursor = Some(c),
            None => return (users, pages),
        }
    }
}

/// Wait until `k` follows the change notices.
async fn ready(k: &PerKey) {
    until(Duration::from_secs(10), "subscribed", async || k.stats().subscribed.load(Relaxed) > 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_instance_sees_every_entry_and_each_change_within_a_second() {
    let redis = RedisServer::start();
    let dir = TempDir::new("pk-redis");
    let (a, b) = (instance(&dir, "a", &redis.url()), instance(&dir, "b", &redis.url()));
    ready(&a).await;
    ready(&b).await;
    let set = rules();
    a.put(tiered("alice", "free"), &set, |_| None).await.unwrap();
    // B may have read Redis's per-domain counts before this first entry of
    // `api`: it answers "no entry" without a read (nothing cached) until
    // A's notice adds the domain, within a round trip.
    until(Duration::from_secs(1), "B reads A's entry from Redis", async || {
        lookup(&b, "alice").await.as_deref() == Some("free")
    })
    .await;
    assert_eq!(lookup(&b, "bob").await, None, "no entry: cached as none");
    let misses = b.stats().misses.get();
    assert_eq!(lookup(&b, "alice").await.as_deref(), Some("free"));
    assert_eq!(b.stats().misses.get(), misses, "the second lookup is a cache hit");

    // A change on A reaches B's cache (its time to live is 10 minutes).
    a.put(tiered("alice", "pro"), &set, |_| None).await.unwrap();
    let took = until(Duration::from_secs(1), "B sees alice's new tier", async || {
        lookup(&b, "alice").await.as_deref() == Some("pro")
    })
    .await;
    eprintln!("a change reached the other instance in {took:?}");
    // A new entry for a key B cached as none, and a deletion.
    b.put(tiered("bob", "pro"), &set, |_| None).await.unwrap();
    until(Duration::from_secs(1), "A sees bob", async || lookup(&a, "bob").await.is_some()).await;
    assert!(b.remove("api", &[("user", "alice")]).await.unwrap());
    assert!(!b.remove("api", &[("user", "alice")]).await.unwrap(), "already gone");
    until(Duration::from_secs(1), "A sees alice deleted", async || lookup(&a, "alice").await.is_none()).await;

    // Counts per (domain, tier) are Redis's, on both.
    until(Duration::from_secs(6), "B's counts", async || b.counts() == [("api".into(), "pro".into(), 1)]).await;
    assert_eq!(a.counts(), [("api".to_owned(), "pro".to_owned(), 1)]);
    assert_eq!(redis.cli(&["HGET", "fg:{keys:00}:c", "x"]).trim(), "", "counts live in the shards' hashes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_misses_for_one_key_cost_one_read_and_misses_are_batched() {
    let redis = RedisServer::start();
    let dir = TempDir::new("pk-batch");
    let a = instance(&dir, "a", &redis.url());
    ready(&a).await;
    let set = rules();
    let specs: Vec<KeySpec> = (0..500).map(|i| tiered(&format!("u{i}"), "free")).collect();
    let built = PerKey::validate(specs, &set, |_| None).unwrap();
    a.put_all(&built).await.unwrap();
    let b = instance(&dir, "b", &redis.url());
    ready(&b).await;
    let batches = b.read_batches();
    let same: Vec<_> = (0..64)
        .map(|_| {
            let b = b.clone();
            tokio::spawn(async move { lookup(&b, "u7").await })
        })
        .collect();
    for j in same {
        assert_eq!(j.await.unwrap().as_deref(), Some("free"));
    }
    assert_eq!(b.stats().misses.get(), 1, "64 concurrent lookups of one key: one read");
    // 499 other keys at once: batched, far fewer calls than keys.
    let many: Vec<_> = (0..500)
        .map(|i| {
            let b = b.clone();
            tokio::spawn(async move { lookup(&b, &format!("u{i}")).await })
        })
        .collect();
    for j in many {
        assert_eq!(j.await.unwrap().as_deref(), Some("free"));
    }
    let batches = b.read_batches() - batches;
    eprintln!("500 distinct misses read in {batches} batches");
    assert!(batches < 100, "{batches} batches for 500 misses: not batched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_subscription_drops_the_cache_and_a_dead_redis_keeps_cached_answers() {
    let mut redis = RedisServer::start();
    let dir = TempDir::new("pk-lost");
    let a = instance(&dir, "a", &redis.url());
    ready(&a).await;
    // A's own write comes back as a notice, which drops the key again: wait
    // for it, so that what is cached next stays (the notice once came after
    // the lookup under load, and the lookup after it read the change below).
    put_seen(&a, tiered("alice", "free")).await;
    assert_eq!(lookup(&a, "alice").await.as_deref(), Some("free"));
    // A change A never hears of (written behind its back, no notice, no
    // version bump): A's cache keeps the old answer...
    write_behind(&redis, "alice", "pro", false).await;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(lookup(&a, "alice").await.as_deref(), Some("free"), "no notice, no version: the cached answer stays");
    // ...until its subscription is lost and made again: the cache is dropped.
    let subscribed = a.stats().subscribed.load(Relaxed);
    redis.cli(&["CLIENT", "KILL", "TYPE", "pubsub"]);
    until(Duration::from_secs(5), "resubscribed", async || a.stats().subscribed.load(Relaxed) > subscribed).await;
    assert_eq!(lookup(&a, "alice").await.as_deref(), Some("pro"), "after resubscribing, the cache was dropped");

    // Redis dies: the cached answer serves, a miss gets the files' rules
    // (none) within the timeout, counted, and is not cached.
    redis.kill();
    assert_eq!(lookup(&a, "alice").await.as_deref(), Some("pro"), "cached answers serve while Redis is down");
    let started = Instant::now();
    assert_eq!(lookup(&a, "zed").await, None);
    assert!(started.elapsed() < Duration::from_secs(2), "a miss waits at most the Redis timeout");
    assert!(a.stats().read_errors.load(Relaxed) >= 1);
    let err = a.put(tiered("zed", "free"), &rules(), |_| None).await.unwrap_err().to_string();
    assert!(err.contains("kept in Redis, which failed"), "{err}");
    // Redis is back (empty): A resubscribes, drops its cache, and reads
    // what Redis now holds.
    redis.restart();
    until(Duration::from_secs(10), "A follows Redis again", async || lookup(&a, "alice").await.is_none()).await;
}

/// Write `tier` for `user` straight into Redis, as if the write's notice
/// were lost: the value, and (with `bump`) the shard's version as every
/// write script bumps it.
async fn write_behind(redis: &RedisServer, user: &str, tier: &str, bump: bool) {
    let key = format!("api\u{0}user\u{1}{user}");
    let mut conn = redis::Client::open(redis.url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let mut shard = None;
    for s in 0..SHARDS {
        let held: bool =
            redis::cmd("HEXISTS").arg(format!("fg:{{keys:{s:02}}}:e")).arg(&key).query_async(&mut conn).await.unwrap();
        if held {
            shard = Some(s);
        }
    }
    let shard = shard.expect("the user's shard");
    let mut value = vec![1u8];
    value.extend_from_slice(&0u64.to_le_bytes());
    value.extend_from_slice(tier.as_bytes());
    let () = redis::cmd("HSET")
        .arg(format!("fg:{{keys:{shard:02}}}:e"))
        .arg(&key)
        .arg(value)
        .query_async(&mut conn)
        .await
        .unwrap();
    if bump {
        let _: u64 = redis::cmd("INCR").arg(format!("fg:{{keys:{shard:02}}}:v")).query_async(&mut conn).await.unwrap();
    }
}

/// A write through `k`, its own change notice awaited (a notice that came
/// after a later lookup would drop what that lookup cached).
async fn put_seen(k: &PerKey, spec: KeySpec) {
    let notices = k.stats().notices.load(Relaxed);
    k.put(spec, &rules(), |_| None).await.unwrap();
    until(Duration::from_secs(5), "the write's own notice", async || k.stats().notices.load(Relaxed) > notices).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_in_use_is_read_again_before_it_expires_and_an_unused_one_expires() {
    let redis = RedisServer::start();
    let dir = TempDir::new("pk-refresh");
    // A 2 s time to live: an answer expires 1.6 to 2 s after its read, and
    // falls due for its refresh 1 s before.
    let cache = CacheOptions { entries: 10_000, ttl: Some(Duration::from_secs(2)) };
    let a = Arc::new(PerKey::open_with(dir.0.join("a.redb"), cache).expect("a store"));
    tokio::spawn(a.share(store(&redis.url())));
    ready(&a).await;
    put_seen(&a, tiered("alice", "free")).await;
    put_seen(&a, tiered("bob", "free")).await;
    assert_eq!(lookup(&a, "alice").await.as_deref(), Some("free"));
    assert_eq!(lookup(&a, "bob").await.as_deref(), Some("free"));
    // Both change behind A's back (no notice, no version bump): only a
    // read of Redis can see it.
    write_behind(&redis, "alice", "pro", false).await;
    write_behind(&redis, "bob", "pro", false).await;
    // Alice is in use, looked up every 10 ms for 5 s (2.5 times to live):
    // her answer never expires, and its refreshes read the change.
    let misses = a.stats().misses.get();
    let started = Instant::now();
    let mut seen_pro = None;
    while started.elapsed() < Duration::from_secs(5) {
        match a.cached_answer("api", &[("user", "alice")]) {
            Ok(l) => {
                if seen_pro.is_none() && tier(l).as_deref() == Some("pro") {
                    seen_pro = Some(started.elapsed());
                }
            }
            Err(floodgate_perkey::NeedsRead) => {
                panic!("alice's answer expired in use, {:?} in", started.elapsed())
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    eprintln!("a refresh read the change {seen_pro:?} in");
    assert!(seen_pro.is_some(), "the refreshes read Redis: alice's change was seen");
    assert_eq!(a.stats().misses.get(), misses, "an answer in use is read again before it expires, not on a miss");
    let refreshed = a.stats().refreshed.load(Relaxed);
    assert!(
        (3..=15).contains(&refreshed),
        "{refreshed} refreshes in 5 s: about one every 0.6 to 1 s, not one a lookup"
    );
    // Bob was not used: his answer expired, and a lookup reads him again.
    assert!(a.cached_answer("api", &[("user", "bob")]).is_err(), "an unused answer expires");
    assert_eq!(lookup(&a, "bob").await.as_deref(), Some("pro"));
    assert_eq!(a.stats().misses.get(), misses + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_whose_notice_was_lost_is_caught_by_the_shards_versions() {
    let redis = RedisServer::start();
    let dir = TempDir::new("pk-versions");
    let a = instance(&dir, "a", &redis.url());
    ready(&a).await;
    // The write's own notice first (under load it can come after the
    // lookup, drop the answer, and the change below would then be read
    // without the version read this test is about).
    put_seen(&a, tiered("alice", "free")).await;
    assert_eq!(lookup(&a, "alice").await.as_deref(), Some("free"));
    // Its notice never came, but the shard's version moved: within a few
    // version reads (every second) the answer is read again.
    write_behind(&redis, "alice", "pro", true).await;
    let took = until(Duration::from_secs(5), "the version read catches the change", async || {
        lookup(&a, "alice").await.as_deref() == Some("pro")
    })
    .await;
    eprintln!("a change with no notice was caught in {took:?}");
    assert!(a.stats().missed_notices.load(Relaxed) >= 1);
    assert_eq!(a.stats().subscribed.load(Relaxed), 1, "caught without resubscribing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listings_page_in_key_order_across_the_shards() {
    let redis = RedisServer::start();
    let dir = TempDir::new("pk-list");
    let a = instance(&dir, "a", &redis.url());
    ready(&a).await;
    let set = rules();
    let mut specs: Vec<KeySpec> =
        (0..2_500).map(|i| tiered(&format!("u{i:05}"), if i % 3 == 0 { "pro" } else { "free" })).collect();
    specs.push(KeySpec { domain: "api".into(), ..tiered("x", "free") });
    let built = PerKey::validate(specs, &set, |_| None).unwrap();
    assert_eq!(a.put_all(&built).await.unwrap(), 2_501);
    let (seen, pages) = listed(&a, "user=u", 100).await;
    let want: Vec<String> = (0..2_500).map(|i| format!("u{i:05}")).collect();
    assert_eq!(seen, want, "every entry once, in order, over {pages} pages");
    let one = a.list(Some("api"), "user=u00042", true, None, 10).await.unwrap();
    assert_eq!(one.entries.len(), 1);
    assert_eq!(one.entries[0].0.tier.as_deref(), Some("pro"));
    until(Duration::from_secs(6), "counts", async || {
        a.counts() == [("api".into(), "free".into(), 1_667), ("api".into(), "pro".into(), 834)]
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_overrides_of_older_builds_move_into_the_sharded_layout() {
    let redis = RedisServer::start();
    // As builds before tiers wrote them: a hash and a version in one slot.
    let old = r#"{"spec":{"domain":"api","descriptor":[{"key":"user","value":"old"}],"limits":{"unit":"second","requests_per_unit":3}},"updated_at":5}"#;
    redis.cli(&["HSET", "fg:{overrides}", "api|user=old", old]);
    redis.cli(&["SET", "fg:{overrides}:version", "1"]);
    let dir = TempDir::new("pk-migrate");
    let a = instance(&dir, "a", &redis.url());
    until(Duration::from_secs(10), "the old override moved", async || {
        lookup(&a, "old").await.as_deref() == Some("own")
    })
    .await;
    assert_eq!(redis.cli(&["GET", "fg:keys:layout"]).trim(), "1");
    let page = a.list(None, "", false, None, 10).await.unwrap();
    assert_eq!(page.entries.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_cluster_holds_the_entries_sharded_and_notices_reach_every_instance() {
    let cluster = RedisCluster::start();
    let dir = TempDir::new("pk-cluster");
    let (a, b) = (instance(&dir, "a", &cluster.url()), instance(&dir, "b", &cluster.url()));
    ready(&a).await;
    ready(&b).await;
    let set = rules();
    let specs: Vec<KeySpec> = (0..300).map(|i| tiered(&format!("c{i:03}"), "free")).collect();
    let built = PerKey::validate(specs, &set, |_| None).unwrap();
    a.put_all(&built).await.unwrap();
    assert_eq!(lookup(&b, "c123").await.as_deref(), Some("free"));
    a.put(tiered("c123", "pro"), &set, |_| None).await.unwrap();
    until(Duration::from_secs(1), "B sees the change", async || lookup(&b, "c123").await.as_deref() == Some("pro"))
        .await;
    let n = listed(&b, "", 50).await.0.len();
    assert_eq!(n, 300);
    // The entries spread over the primaries (sharded by key).
    let holding =
        cluster.nodes.iter().filter(|node| node.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap_or(0) > 0).count();
    assert!(holding >= 3, "entries on {holding} nodes");
}
