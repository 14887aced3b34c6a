//! Three regions as separate hosts — network namespaces joined by veth
//! pairs, every region-to-region connection through a delaying relay (the
//! issue's latencies: a–b 30 ms, a–c 70 ms, b–c 120 ms). Regions a and c
//! are a `floodgate serve` each with the memory store; region b is two
//! `floodgate serve` instances on one `redis-server`, all in b's host. The
//! bounded cap holds, nothing is lost or counted twice after a cut link
//! heals, after a memory region restarts with its state lost, or after the
//! Redis region's Redis does, and decisions never wait for another region.
//! Through crashes (SIGKILL): the bounded cap holds through a crash loop of
//! the memory region and of the Redis region with its Redis restarted
//! empty; the regions agree again after a crash during a partition; a
//! Redis region's instance that dies before sending a key's first hits
//! loses nothing and leaves no bounded key blocked.
//!
//! Skips, saying why, only where namespaces cannot be made (not root).

use crate::cli;
use crate::net;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use cli::{Served, http, http_get};
use floodgate_testing::TempDir;
use net::{Host, Relay};
use serde_json::Value;

const TOKEN: &str = "regions-test-token";
const SYNC_PORT: u16 = 7000;
const HTTP_PORT: u16 = 8080;
const NAMES: [&str; 3] = ["a", "b", "c"];

/// Windows of a year: a window edge (where every count starts again) falls
/// inside a test run about never (an hour's did, once a run in ~400).
const RULES: &str = "domain: g
descriptors:
  - key: user
    rate_limit: {window: 365d, requests_per_unit: 1000, scope: global}
  - key: small
    rate_limit: {window: 365d, requests_per_unit: 60, scope: global}
  - key: team
    rate_limit: {window: 365d, requests_per_unit: 600, scope: global, sync: bounded, overshoot: 50%}
  - key: capped
    rate_limit: {window: 365d, requests_per_unit: 120, scope: global, sync: bounded, overshoot: 5%}
";
/// `capped`'s cap: 120 and 5% over (a slice of 2 per region).
const CAP: u64 = 126;
const WINDOW_MS: u64 = 365 * 86_400_000;

/// One-way latency between regions `i` and `j`, ms.
fn latency(i: usize, j: usize) -> u64 {
    match (i.min(j), i.max(j)) {
        (0, 1) => 30,
        (0, 2) => 70,
        _ => 120,
    }
}

struct Region {
    served: Option<Served>,
    http: String,
    /// Region b's second instance (same Redis).
    second: Option<Served>,
}

/// A `redis-server` inside a host's namespace, on 127.0.0.1:6379 there.
struct NsRedis {
    child: std::process::Child,
    dir: TempDir,
}

impl NsRedis {
    fn start(host: &Host, dir: TempDir) -> NsRedis {
        let child = host
            .command("redis-server")
            .args(["--port", "6379", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir"])
            .arg(&dir.0)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("redis-server on the PATH (scripts/test installs it)");
        let ok = (0..200).any(|_| {
            std::thread::sleep(Duration::from_millis(25));
            host.command("redis-cli").args(["-p", "6379", "PING"]).output().is_ok_and(|o| o.stdout.starts_with(b"PONG"))
        });
        assert!(ok, "redis-server in {} did not answer", host.ns);
        NsRedis { child, dir }
    }
}

impl Drop for NsRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = &self.dir;
    }
}

struct World {
    regions: Vec<Region>,
    redis: Option<NsRedis>,
    /// relays[i][j]: region i's connections to region j.
    relays: Vec<Vec<Option<Relay>>>,
    hosts: Vec<Host>,
    rules: TempDir,
    rt: tokio::runtime::Runtime,
}

impl World {
    fn start_region(&self, i: usize) -> Served {
        self.start_instance(i, 0)
    }

    /// Instance `n` of region `i` (region b, index 1, runs on its Redis).
    fn start_instance(&self, i: usize, n: u16) -> Served {
        let host = &self.hosts[i];
        let peers: Vec<String> = (0..3)
            .filter(|&j| j != i)
            .map(|j| format!("{}=http://{}", NAMES[j], self.relays[i][j].as_ref().unwrap().addr))
            .collect();
        let mut cmd = host.command(env!("CARGO_BIN_EXE_floodgate"));
        for (k, _) in std::env::vars() {
            if k.starts_with("FLOODGATE_") {
                cmd.env_remove(k);
            }
        }
        cmd.args(["serve", "--log-format", "json", "--grpc-addr", "none"])
            .args(["--http-addr", &format!("{}:{}", host.addr, HTTP_PORT + n), "--admin-addr", "127.0.0.1:0"])
            .args(["--region", NAMES[i], "--peers", &peers.join(",")])
            .args(["--sync-addr", &format!("{}:{}", host.addr, SYNC_PORT + n), "--sync-token", TOKEN])
            .args(["--sync-interval", "100ms", "--overrides-file", "none"])
            .arg("--config")
            .arg(&self.rules.0);
        if i == 1 {
            cmd.args(["--store", "redis://127.0.0.1:6379", "--redis-timeout", "500ms"]);
        }
        Served::spawn(cmd, TempDir::new(&format!("region-{}-{}", NAMES[i], std::process::id())))
    }

    fn check(&self, i: usize, key: &str, value: &str, hits: i64) -> Value {
        self.check_at(&self.regions[i].http, key, value, hits)
    }

    fn check_at(&self, addr: &str, key: &str, value: &str, hits: i64) -> Value {
        let body = format!(r#"{{"domain": "g", "descriptors": [{{"{key}": "{value}"}}], "hits": {hits}}}"#);
        let (code, text) = http(addr, "POST", "/v1/check", &body);
        assert_eq!(code, 200, "{text}");
        serde_json::from_str(&text).unwrap()
    }

    fn remaining(&self, i: usize, key: &str, value: &str) -> u64 {
        self.check(i, key, value, 0)["descriptors"][0]["remaining"].as_u64().unwrap()
    }

    fn ready(&self, i: usize) -> Value {
        let (_, text) = http_get(&self.regions[i].http, "/readyz");
        serde_json::from_str(&text).unwrap()
    }

    /// Whether region `i` admits on bounded rules (every peer has recorded
    /// its incarnation).
    fn bounded_open(&self, i: usize) -> bool {
        self.ready(i)["regions"]["bounded_open"] == true
    }

    /// Kill memory region `i` (SIGKILL: nothing it had not sent survives)
    /// and start it again with the same flags.
    fn crash(&mut self, i: usize) {
        drop(self.regions[i].served.take());
        let served = self.start_region(i);
        self.regions[i].http = served.http.clone();
        self.regions[i].served = Some(served);
    }

    /// Kill region b's instances and its Redis, which starts again empty;
    /// then its instances.
    fn crash_b_with_its_redis(&mut self, tag: &str, n: usize) {
        drop(self.regions[1].served.take());
        drop(self.regions[1].second.take());
        drop(self.redis.take());
        self.redis = Some(NsRedis::start(&self.hosts[1], TempDir::new(&format!("region-b-redis-crash{n}-{tag}"))));
        let served = self.start_instance(1, 0);
        self.regions[1].http = served.http.clone();
        self.regions[1].served = Some(served);
        self.regions[1].second = Some(self.start_instance(1, 1));
    }

    /// Single hits of `key`/`value` at every region at once (see
    /// [`cli::flood`]): the hits admitted.
    fn flood(&self, key: &str, value: &str) -> u64 {
        cli::flood(3, |i| self.check(i, key, value, 1)["allowed"] == true)
    }

    /// Cut (or heal) the link between regions `i` and `j`, both ways.
    fn cut(&self, i: usize, j: usize, cut: bool) {
        for (x, y) in [(i, j), (j, i)] {
            let relay = self.relays[x][y].as_ref().unwrap();
            if cut { relay.cut() } else { relay.heal() }
        }
    }
}

/// Wait up to 20 s for `cond`.
fn eventually(what: &str, cond: impl FnMut() -> bool) {
    cli::eventually(what, Duration::from_secs(20), cond);
}

#[test]
fn three_regions_share_global_limits_over_a_wan() {
    if let Err(why) = net::namespaces_available() {
        eprintln!(
            "SKIPPED three_regions_share_global_limits_over_a_wan: cannot make network namespaces here ({why}); run the tests as root with iproute2"
        );
        return;
    }
    let tag = format!("{}", std::process::id() % 100_000);
    let subnet = 100 + (std::process::id() % 100) as u8;
    let hosts: Vec<Host> = (1..=3).map(|n| Host::new(&tag, subnet, n).expect("a test host")).collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let rules = TempDir::new(&format!("regions-rules-{tag}"));
    rules.write("g.yaml", RULES);
    // Region i reaches region j at relay (i, j): on i's gateway, port
    // 7100 + j, forwarding to j's sync address after the one-way latency.
    let relays: Vec<Vec<Option<Relay>>> = (0..3)
        .map(|i| {
            (0..3)
                .map(|j| {
                    (i != j).then(|| {
                        let listen = SocketAddr::from((hosts[i].gateway, 7100 + j as u16));
                        let target = SocketAddr::from((hosts[j].addr, SYNC_PORT));
                        rt.block_on(Relay::start(listen, target, Duration::from_millis(latency(i, j))))
                    })
                })
                .collect()
        })
        .collect();
    let mut world = World { regions: Vec::new(), redis: None, relays, hosts, rules, rt };
    world.redis = Some(NsRedis::start(&world.hosts[1], TempDir::new(&format!("region-b-redis-{tag}"))));
    for i in 0..3 {
        let served = world.start_region(i);
        let http = served.http.clone();
        let second = (i == 1).then(|| world.start_instance(1, 1));
        world.regions.push(Region { served: Some(served), http, second });
    }
    eventually("every region has every peer's full state", || {
        (0..3).all(|i| world.ready(i)["regions"]["warming"] == false)
    });

    // 1. Bounded: 600 an hour, overshoot 50%: every region floods one
    //    key at once; together they admit at least the limit and at most
    //    (1 + 50%) x 600 per window.
    let world = Arc::new(world);
    let admitted: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|i| {
                let w = world.clone();
                s.spawn(move || {
                    let mut windows = Vec::new();
                    let until = Instant::now() + Duration::from_secs(4);
                    while Instant::now() < until {
                        let d = w.check(i, "team", "t1", 1);
                        if d["allowed"] == true {
                            // The window this admission belongs to: its end.
                            let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
                            let end = now + d["descriptors"][0]["reset_after_ms"].as_u64().unwrap();
                            windows.push((end + WINDOW_MS / 2) / WINDOW_MS);
                        }
                    }
                    windows
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut per_window = std::collections::BTreeMap::<u64, u64>::new();
    for w in admitted.iter().flatten() {
        *per_window.entry(*w).or_default() += 1;
    }
    for (w, n) in &per_window {
        assert!(*n <= 900, "window {w}: {n} admitted, above (1 + 50%) x 600");
    }
    let total: u64 = per_window.values().sum();
    assert!(total >= 600, "the regions together reach the limit: {total} ({per_window:?})");

    // 2. Eventual, below the limit: 3 x 40 requests (region b's through
    //    both its instances), all admitted; once the sync settles every
    //    region, and both of b's instances, count exactly 120.
    std::thread::scope(|s| {
        for i in 0..3 {
            let w = world.clone();
            s.spawn(move || {
                for n in 0..40 {
                    let at = match (i, &w.regions[1].second) {
                        (1, Some(b2)) if n % 2 == 1 => b2.http.clone(),
                        _ => w.regions[i].http.clone(),
                    };
                    assert_eq!(w.check_at(&at, "user", "u1", 1)["allowed"], true);
                    std::thread::sleep(Duration::from_millis(5));
                }
            });
        }
    });
    eventually("every region counts 120 of u1", || (0..3).all(|i| world.remaining(i, "user", "u1") == 880));
    let b2 = world.regions[1].second.as_ref().unwrap().http.clone();
    assert_eq!(
        world.check_at(&b2, "user", "u1", 0)["descriptors"][0]["remaining"],
        880,
        "b's instances share one count"
    );
    // Refunds cross regions as exactly as the hits: a memory region (a)
    // gives back 15 of its 40, the Redis region (b) 10 of its, through its
    // second instance; every region then counts 95.
    assert_eq!(world.check(0, "user", "u1", -15)["descriptors"][0]["remaining"], 895);
    assert_eq!(world.check_at(&b2, "user", "u1", -10)["allowed"], true);
    eventually("every region counts 95 of u1 after the refunds", || {
        (0..3).all(|i| world.remaining(i, "user", "u1") == 905)
    });
    // Reservations too (user r1): the memory region (a) reserves 30 and
    // settles at 12 (18 given back as never taken); the Redis region (b)
    // reserves 20 through one instance and settles at 25 through the other
    // (5 charged late). Every region then counts 12 + 25 = 37.
    let reserve = |addr: &str, hits: u64| {
        let body = format!(r#"{{"domain": "g", "descriptors": [{{"user": "r1"}}], "hits": {hits}}}"#);
        let (code, text) = http(addr, "POST", "/v1/reserve", &body);
        assert_eq!(code, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        v["reservation"].as_str().unwrap_or_else(|| panic!("no reservation: {text}")).to_owned()
    };
    let settle = |addr: &str, id: &str, actual: u64| {
        let (code, text) =
            http(addr, "POST", "/v1/settle", &format!(r#"{{"reservation": "{id}", "actual": {actual}}}"#));
        assert_eq!(code, 200, "{text}");
        serde_json::from_str::<Value>(&text).unwrap()
    };
    let id = reserve(&world.regions[0].http, 30);
    assert_eq!(settle(&world.regions[0].http, &id, 12)["limits"][0]["returned"], 18);
    let id = reserve(&world.regions[1].http, 20);
    assert_eq!(settle(&b2, &id, 25)["limits"][0]["charged_late"], 5);
    eventually("every region counts 37 of r1 after the reservations", || {
        (0..3).all(|i| world.remaining(i, "user", "r1") == 963)
    });

    // 3. A small limit, flooded: it is reached everywhere.
    std::thread::scope(|s| {
        for i in 0..3 {
            let w = world.clone();
            s.spawn(move || {
                for _ in 0..40 {
                    w.check(i, "small", "s1", 1);
                }
            });
        }
    });
    eventually("every region has spent small/s1", || (0..3).all(|i| world.remaining(i, "small", "s1") == 0));

    // 4. Cut a-b both ways: decisions go on at once on both sides; c, still
    //    linked to both, sees everything; after the heal all agree, each hit
    //    counted once.
    for (i, j) in [(0, 1), (1, 0)] {
        world.relays[i][j].as_ref().unwrap().cut();
    }
    for i in [0, 1] {
        for _ in 0..30 {
            let t = Instant::now();
            assert_eq!(world.check(i, "user", "u2", 1)["allowed"], true);
            assert!(t.elapsed() < Duration::from_secs(1), "a decision waited for a cut-off region");
        }
    }
    eventually("c sees 60 of u2", || world.remaining(2, "user", "u2") == 940);
    eventually("a sees b as unreachable, and stays ready", || {
        let r = world.ready(0);
        r["ready"] == true && r["regions"]["peers"][0]["reachable"] == false
    });
    assert_eq!(world.remaining(0, "user", "u2"), 970, "a does not see b's 30 while cut off");
    for (i, j) in [(0, 1), (1, 0)] {
        world.relays[i][j].as_ref().unwrap().heal();
    }
    eventually("after the heal every region counts 60 of u2", || {
        (0..3).all(|i| world.remaining(i, "user", "u2") == 940)
    });

    // 5. c restarts with its state lost: a new incarnation, which learns
    //    every count back from its peers (its own old usage included) and
    //    is counted once everywhere.
    let mut world = Arc::try_unwrap(world).unwrap_or_else(|_| panic!("threads are done"));
    let served = world.regions[2].served.take().unwrap();
    drop(served);
    let served = world.start_region(2);
    world.regions[2].http = served.http.clone();
    world.regions[2].served = Some(served);
    eventually("c is back, with every peer's full state", || world.ready(2)["regions"]["warming"] == false);
    eventually("c knows u1 and u2 again", || {
        world.remaining(2, "user", "u1") == 905 && world.remaining(2, "user", "u2") == 940
    });
    assert_eq!(world.check(2, "user", "u1", 5)["allowed"], true);
    eventually("5 more, counted once everywhere", || (0..3).all(|i| world.remaining(i, "user", "u1") == 900));

    // 6. Region b's Redis restarts empty: a new incarnation for b, which
    //    learns every count back from a and c; nothing counted twice.
    let dir = TempDir::new(&format!("region-b-redis2-{tag}"));
    drop(world.redis.take());
    world.redis = Some(NsRedis::start(&world.hosts[1], dir));
    eventually("b knows u1 and u2 again after its Redis restarted", || {
        world.remaining(1, "user", "u1") == 900 && world.remaining(1, "user", "u2") == 940
    });
    // Knowing nothing, it admitted nothing until its peers' state arrived.
    eventually("b has every peer's full state again", || world.ready(1)["regions"]["warming"] == false);
    assert_eq!(world.check(1, "user", "u1", 5)["allowed"], true);
    eventually("5 more from b, counted once everywhere", || (0..3).all(|i| world.remaining(i, "user", "u1") == 895));

    // 7. A crash loop (a memory region): c, warm, spends its slice of a
    //    bounded key in a burst and is killed at once (SIGKILL), five
    //    times; what it admitted never reached a peer. Each dead
    //    incarnation costs every bounded decision a slice, so all three
    //    flooding the key afterwards admit, with c's bursts, at most the
    //    cap (it was 129-134 before the crash charges).
    let mut bursts = 0;
    for _ in 0..5 {
        eventually("c admits on bounded rules", || world.bounded_open(2));
        for _ in 0..6 {
            bursts += u64::from(world.check(2, "capped", "k1", 1)["allowed"] == true);
        }
        world.crash(2);
    }
    assert!(bursts >= 5, "c admitted {bursts} in its five bursts: each at least one");
    eventually("c admits on bounded rules", || world.bounded_open(2));
    for i in 0..3 {
        eventually("every region knows c's five dead incarnations", || {
            world.ready(i)["regions"]["dead_incarnations"].as_u64().unwrap() >= 5
        });
    }
    let dead = world.ready(0)["regions"]["dead_incarnations"].as_u64().unwrap();
    let flooded = world.flood("capped", "k1");
    eprintln!(
        "crash loop of c: {bursts} admitted in its bursts, {flooded} in the flood; {dead} dead incarnations; cap {CAP}"
    );
    assert!(bursts + flooded <= CAP, "{bursts} + {flooded} admitted, above the cap of {CAP}");
    // Each dead incarnation (c's and b's so far) costs at most two slices
    // of the limit: its charge, and its usage if that arrives too.
    assert!(
        bursts + flooded >= 120 - 2 * 2 * dead,
        "{bursts} + {flooded}: the limit is reached, less the charges of {dead} dead incarnations"
    );

    // 8. A crash during a partition (eventual): b-c cut, 10 hits in each
    //    region, c killed while still cut off from b, the cut healed, c
    //    back. a passes c's hits on to b (what a learns from a third
    //    region goes on to every peer but the sender), so every region
    //    agrees on 30 (b stayed at 20 before).
    world.cut(1, 2, true);
    for i in 0..3 {
        for _ in 0..10 {
            assert_eq!(world.check(i, "user", "u3", 1)["allowed"], true);
        }
    }
    eventually("a sees every region's 10", || world.remaining(0, "user", "u3") == 970);
    drop(world.regions[2].served.take());
    world.cut(1, 2, false);
    world.crash(2);
    eventually("every region counts 30 of u3 after c's crash", || {
        (0..3).all(|i| world.remaining(i, "user", "u3") == 970)
    });

    // 9. A Redis region's instance (not its Redis) dies right after a
    //    key's first hits, before it sent them: Redis kept them, and the
    //    next instance's full state lists every global rule's keys, so
    //    they reach every peer, and the bounded key's slice is free again
    //    once they are acknowledged (b denied every hit before).
    let before: Vec<u64> = (0..3).map(|i| world.remaining(i, "capped", "k3")).collect();
    let b2 = world.regions[1].second.take().unwrap();
    for _ in 0..2 {
        assert_eq!(world.check_at(&b2.http, "capped", "k3", 1)["allowed"], true);
    }
    for _ in 0..5 {
        assert_eq!(world.check_at(&b2.http, "user", "u5", 1)["allowed"], true);
    }
    drop(b2);
    world.regions[1].second = Some(world.start_instance(1, 1));
    eventually("a and c see the dead instance's hits", || {
        [0, 2]
            .iter()
            .all(|&i| world.remaining(i, "user", "u5") == 995 && world.remaining(i, "capped", "k3") == before[i] - 2)
    });
    eventually("b admits on the bounded key again", || world.check(1, "capped", "k3", 1)["allowed"] == true);

    // 10. Region b's instances die with its Redis, which restarts empty:
    //     three times, each after a burst on a bounded key (the crash
    //     loop for a Redis region); then every region floods it.
    let mut bursts = 0;
    for n in 0..3 {
        eventually("b admits on bounded rules", || world.bounded_open(1));
        for _ in 0..6 {
            bursts += u64::from(world.check(1, "capped", "k4", 1)["allowed"] == true);
        }
        world.crash_b_with_its_redis(&tag, n);
    }
    assert!(bursts >= 3, "b admitted {bursts} in its three bursts: each at least one");
    eventually("b admits on bounded rules", || world.bounded_open(1));
    let flooded = world.flood("capped", "k4");
    eprintln!("crash loop of b with its Redis: {bursts} admitted in its bursts, {flooded} in the flood; cap {CAP}");
    assert!(bursts + flooded <= CAP, "{bursts} + {flooded} admitted, above the cap of {CAP}");

    // 11. And during a partition: b cut off from c, 10 hits in each
    //     region, b dies with its Redis while cut off, the cut heals:
    //     every region agrees on 30 (a passes b's hits on to c, and back
    //     to b's new incarnation).
    world.cut(1, 2, true);
    for i in 0..3 {
        for _ in 0..10 {
            assert_eq!(world.check(i, "user", "u6", 1)["allowed"], true);
        }
    }
    eventually("a sees every region's 10", || world.remaining(0, "user", "u6") == 970);
    world.crash_b_with_its_redis(&tag, 3);
    world.cut(1, 2, false);
    eventually("every region counts 30 of u6 after b's crash", || {
        (0..3).all(|i| world.remaining(i, "user", "u6") == 970)
    });
    drop(world.regions);
    drop(world.redis);
    drop(world.relays);
    drop(world.hosts);
    world.rt.shutdown_background();
}
