//! What the dashboard shows, kept whether or not anyone looks, in one fixed
//! memory budget:
//!
//! * per rule, its decisions (allowed, denied, shadow-denied, decided by
//!   the failure policy) over the last 5 minutes by the second, the last
//!   hour by 10 s and the last day by 5 minutes ([`history`]): a tick a
//!   second reads the rule's Prometheus counters and keeps the
//!   differences, so the decision path pays nothing for them;
//! * per rule, its heaviest keys by hits and by denials since it was first
//!   watched ([`TopKeys`]), the one thing counted on the decision path: a
//!   hash of the counter key and a `try_lock` (a busy table skips the hit
//!   and counts it in `unsketched`, rather than make a decision wait);
//! * per peer region, its lag, round trip, queue and unreachable seconds
//!   over the same ranges (sampled by the same tick).
//!
//! Both are kept only for rules that see traffic, at most
//! [`MAX_WATCHED_RULES`] at once (beyond, a rule's decisions are counted in
//! the metrics as always but it has no chart or top keys until a watched
//! rule has been idle for [`IDLE_RELEASE_SECONDS`] and gives its place
//! back). Keys are never metric labels: they appear only here, on the admin
//! address. With `--dashboard off` nothing of this is kept.

pub mod history;
pub mod page;
pub mod topkeys;

use std::collections::BTreeMap;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

use serde_json::{Value, json};

use crate::dashboard::history::{Fold, History};
use crate::dashboard::topkeys::TopKeys;

/// A watched rule idle this long (the longest range) gives its place back.
pub const IDLE_RELEASE_SECONDS: usize = 86_400;
/// Rules with a history and top keys at once, at most.
pub const MAX_WATCHED_RULES: usize = 1_000;
/// The series of a rule's history, in order.
pub const SERIES: [&str; 4] = ["allowed", "denied", "shadow_denied", "failure_policy"];
/// A rule's series are counts.
const RULE_FOLDS: [Fold; 4] = [Fold::Sum; 4];
/// The series of a peer region's history, in order: its lag and round
/// trip in milliseconds and queued keys (each the highest second of a
/// bucket), and the seconds it was unreachable (summed).
pub const PEER_SERIES: [&str; 4] = ["lag_ms", "rtt_ms", "queued_keys", "down_s"];
const PEER_FOLDS: [Fold; 4] = [Fold::Max, Fold::Max, Fold::Max, Fold::Sum];

/// Bytes one watched rule holds at most: two top-key tables and its
/// history.
pub const fn rule_bytes() -> usize {
    2 * TopKeys::max_bytes() + std::mem::size_of::<Tops>() + History::<4>::bytes()
}

/// The most the dashboard's rule data holds, in bytes: [`rule_bytes`]
/// times [`MAX_WATCHED_RULES`] (rule names are the rules'; keys are cut).
/// Each peer region adds a history ([`peer_bytes`]).
pub const fn budget_bytes() -> usize {
    MAX_WATCHED_RULES * rule_bytes()
}

/// Bytes one peer region's history holds.
pub const fn peer_bytes() -> usize {
    History::<4>::bytes()
}

/// The dashboard's switch, its share of the budget in use, and the peer
/// regions' history.
#[derive(Debug)]
pub struct Dashboard {
    on: bool,
    watched: AtomicUsize,
    /// Decisions of rules that found no place while the budget was full.
    refused: AtomicU64,
    hasher: foldhash::fast::RandomState,
    peers: Mutex<BTreeMap<String, History<4>>>,
}

impl Dashboard {
    /// Keep the dashboard's data (`on`) or nothing.
    pub fn new(on: bool) -> Self {
        Self {
            on,
            watched: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            hasher: Default::default(),
            peers: Mutex::default(),
        }
    }

    /// Whether the data is kept.
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// A place for one more rule, if the budget has one.
    fn take(&self) -> bool {
        if self.watched.load(Relaxed) >= MAX_WATCHED_RULES {
            self.refused.fetch_add(1, Relaxed);
            return false;
        }
        if self.watched.fetch_add(1, Relaxed) >= MAX_WATCHED_RULES {
            self.watched.fetch_sub(1, Relaxed);
            self.refused.fetch_add(1, Relaxed);
            return false;
        }
        true
    }

    fn give_back(&self) {
        self.watched.fetch_sub(1, Relaxed);
    }

    /// The peer regions' second, from the regions' health
    /// (`/admin/v1/status`'s `regions`): each peer's lag, round trip, queue
    /// and whether it was reachable.
    pub fn tick_peers(&self, regions: &Value, now_s: u64) {
        let Some(list) = regions["peers"].as_array() else { return };
        let mut peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        for p in list {
            let Some(name) = p["region"].as_str() else { continue };
            let num = |v: &Value| u32::try_from(v.as_f64().unwrap_or(0.0).round() as u64).unwrap_or(u32::MAX);
            let second = [
                num(&p["lag_ms"]),
                num(&p["rtt_ms"]),
                num(&p["queued_keys"]),
                u32::from(p["reachable"] != json!(true)),
            ];
            if !peers.contains_key(name) {
                peers.insert(name.to_owned(), History::new());
            }
            if let Some(h) = peers.get_mut(name) {
                h.push(second, &PEER_FOLDS, now_s);
            }
        }
    }

    /// Every peer region's history over `range` (an index into
    /// [`history::RANGES`]).
    pub fn peers_json(&self, range: usize) -> Value {
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        let list: Vec<Value> = peers
            .iter()
            .map(|(name, h)| {
                let mut v = h.to_json(range, &PEER_SERIES);
                v["region"] = json!(name);
                v
            })
            .collect();
        Value::Array(list)
    }

    /// The budget, as the dashboard's JSON shows it.
    pub fn budget(&self) -> Value {
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner).len();
        json!({
            "on": self.on,
            "rules_watched": self.watched.load(Relaxed),
            "max_rules": MAX_WATCHED_RULES,
            "refused": self.refused.load(Relaxed),
            "max_bytes": budget_bytes() + peers * peer_bytes(),
            "rule_bytes": rule_bytes(),
            "peer_bytes": peer_bytes(),
            "idle_release_seconds": IDLE_RELEASE_SECONDS,
            "ranges": history::RANGES.map(|(name, step, len)| json!({"name": name, "step_s": step, "buckets": len})),
            "top_keys_per_table": crate::dashboard::topkeys::TOP_KEYS,
            "key_bytes": crate::dashboard::topkeys::KEY_BYTES,
        })
    }
}

impl Default for Dashboard {
    /// On: the server's default (`--dashboard on`).
    fn default() -> Self {
        Dashboard::new(true)
    }
}

/// The key a decision was for: its counter key (hashed) and its
/// descriptor's entries (the display text, made only when the key takes a
/// place in a table).
#[derive(Debug, Clone, Copy)]
pub struct KeyRef<'a> {
    /// The store's counter key.
    pub counter_key: &'a str,
    /// The descriptor's `(key, value)` entries.
    pub entries: &'a [(String, String)],
}

impl KeyRef<'_> {
    /// `key=value, key=value` into `out`, stopping once past the bytes kept.
    fn display(&self, out: &mut String) {
        for (i, (k, v)) in self.entries.iter().enumerate() {
            if i > 0 {
                out.push_str(", ");
            }
            out.push_str(k);
            out.push('=');
            out.push_str(v);
            if out.len() > crate::dashboard::topkeys::KEY_BYTES {
                break;
            }
        }
    }
}

#[derive(Debug, Default)]
struct Tops {
    hits: TopKeys,
    denials: TopKeys,
    /// When the rule was first watched (Unix seconds): the tables count
    /// from then.
    since_s: u64,
}

/// A rule's history, and its counters' totals at the last tick (kept for
/// every rule, so a rule's first second of traffic is in its history).
#[derive(Debug, Default)]
struct Ticked {
    last: [u64; 4],
    history: Option<Box<History<4>>>,
    /// Seconds in a row without a decision.
    idle: usize,
}

/// One rule's dashboard data (none until it sees traffic).
#[derive(Debug, Default)]
pub struct RuleWatch {
    tops: Mutex<Option<Box<Tops>>>,
    history: Mutex<Ticked>,
    /// Hits not counted in the top keys: the table was busy.
    unsketched: AtomicU64,
}

/// Seconds since the Unix epoch now (0 before it).
pub fn unix_now_s() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl RuleWatch {
    /// Count `hits` of `key` (and as denials when `denied`): the decision
    /// path's part.
    pub fn record(&self, dash: &Dashboard, key: KeyRef<'_>, hits: u64, denied: bool) {
        let Ok(mut tops) = self.tops.try_lock() else {
            self.unsketched.fetch_add(hits, Relaxed);
            return;
        };
        let t = match &mut *tops {
            Some(t) => t,
            None if dash.take() => tops.insert(Box::new(Tops { since_s: unix_now_s(), ..Tops::default() })),
            None => return,
        };
        let h = dash.hasher.hash_one(key.counter_key);
        t.hits.record(h, hits, |out| key.display(out));
        if denied {
            t.denials.record(h, hits, |out| key.display(out));
        }
    }

    /// One second's tick, ending at `now_s`: add the counters' growth since
    /// the last one (`totals`, in [`SERIES`] order) to the history; a rule
    /// idle for [`IDLE_RELEASE_SECONDS`] gives its place back.
    pub fn tick(&self, dash: &Dashboard, totals: [u64; 4], now_s: u64) {
        let watched = self.tops.lock().unwrap_or_else(PoisonError::into_inner).is_some();
        let mut ticked = self.history.lock().unwrap_or_else(PoisonError::into_inner);
        let mut second = [0u32; 4];
        for (i, s) in second.iter_mut().enumerate() {
            *s = u32::try_from(totals[i].saturating_sub(ticked.last[i])).unwrap_or(u32::MAX);
        }
        ticked.last = totals;
        if !watched {
            ticked.history = None;
            return;
        }
        ticked.history.get_or_insert_with(Box::default).push(second, &RULE_FOLDS, now_s);
        ticked.idle = if second == [0; 4] { ticked.idle + 1 } else { 0 };
        if ticked.idle >= IDLE_RELEASE_SECONDS {
            ticked.history = None;
            ticked.idle = 0;
            *self.tops.lock().unwrap_or_else(PoisonError::into_inner) = None;
            self.unsketched.store(0, Relaxed);
            dash.give_back();
        }
    }

    /// This rule's dashboard JSON (`null` when not watched): its series over
    /// `range` (an index into [`history::RANGES`]) and the `top` heaviest
    /// keys of each table.
    pub fn to_json(&self, top: usize, range: usize) -> Value {
        let tops = self.tops.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(t) = tops.as_ref() else { return Value::Null };
        let table = |k: &TopKeys| json!({ "seen": k.seen(), "bound": k.bound(), "keys": k.top(top) });
        let (hits, denials, since) = (table(&t.hits), table(&t.denials), t.since_s);
        drop(tops);
        let ticked = self.history.lock().unwrap_or_else(PoisonError::into_inner);
        let history = match ticked.history.as_ref() {
            Some(h) => h.to_json(range, &SERIES),
            None => History::<4>::new().to_json(range, &SERIES),
        };
        json!({
            "history": history,
            "top_hits": hits,
            "top_denials": denials,
            "top_since_unix_s": since,
            "unsketched": self.unsketched.load(Relaxed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(ck: &'a str, entries: &'a [(String, String)]) -> KeyRef<'a> {
        KeyRef { counter_key: ck, entries }
    }

    #[test]
    fn a_rule_is_watched_from_its_first_decision_and_released_when_idle() {
        let dash = Dashboard::new(true);
        let w = RuleWatch::default();
        assert!(w.to_json(5, 0).is_null());
        let e = vec![("user".to_owned(), "alice".to_owned())];
        w.record(&dash, key("k-alice", &e), 3, true);
        assert_eq!(dash.watched.load(Relaxed), 1);
        w.tick(&dash, [10, 3, 0, 0], 100);
        w.tick(&dash, [15, 4, 0, 1], 101);
        let j = w.to_json(5, 0);
        assert_eq!(j["history"]["allowed"], json!([10, 5]), "the first second counts from the rule's start");
        assert_eq!(j["history"]["denied"], json!([3, 1]));
        assert_eq!(j["history"]["failure_policy"], json!([0, 1]));
        assert_eq!(j["history"]["end_unix_s"], 101);
        assert_eq!(j["top_hits"]["keys"][0]["key"], "user=alice");
        assert_eq!(j["top_denials"]["keys"][0]["count"], 3);
        for s in 0..IDLE_RELEASE_SECONDS as u64 {
            w.tick(&dash, [15, 4, 0, 1], 102 + s);
        }
        assert!(w.to_json(5, 0).is_null(), "idle for the whole history: released");
        assert_eq!(dash.watched.load(Relaxed), 0);
    }

    #[test]
    fn the_history_keeps_the_last_seconds_in_order() {
        let dash = Dashboard::new(true);
        let w = RuleWatch::default();
        w.record(&dash, key("k", &[]), 1, false);
        let fine = history::RANGES[0].2;
        for s in 0..(fine as u64 + 10) {
            w.tick(&dash, [s * (s + 1) / 2, 0, 0, 0], s); // s more each second
        }
        let allowed = w.to_json(1, 0)["history"]["allowed"].as_array().unwrap().clone();
        assert_eq!(allowed.len(), fine);
        assert_eq!(allowed[0], 10);
        assert_eq!(allowed[fine - 1], fine as u64 + 9);
    }

    #[test]
    fn beyond_the_budget_rules_are_counted_but_not_watched() {
        let dash = Dashboard::new(true);
        let rules: Vec<RuleWatch> = (0..MAX_WATCHED_RULES + 5).map(|_| RuleWatch::default()).collect();
        for r in &rules {
            r.record(&dash, key("k", &[]), 1, false);
        }
        assert_eq!(dash.watched.load(Relaxed), MAX_WATCHED_RULES);
        assert_eq!(dash.refused.load(Relaxed), 5);
        assert!(rules[MAX_WATCHED_RULES].to_json(1, 0).is_null());
        assert!(budget_bytes() < 32 * 1024 * 1024, "{}", budget_bytes());
    }

    #[test]
    fn peer_regions_are_kept_over_each_range() {
        let dash = Dashboard::new(true);
        let health = |up: bool, lag: u64| json!({"peers": [{"region": "us", "reachable": up, "lag_ms": lag, "rtt_ms": 70.4, "queued_keys": 3}]});
        for s in 0..20u64 {
            dash.tick_peers(&health(s % 4 != 0, s), 1_000 + s);
        }
        let peers = dash.peers_json(1);
        assert_eq!(peers[0]["region"], "us");
        // Seconds 0..=9 and 10..=19: the lag's highest, the seconds down.
        assert_eq!(peers[0]["lag_ms"], json!([9, 19]));
        assert_eq!(peers[0]["rtt_ms"], json!([70, 70]));
        assert_eq!(peers[0]["down_s"], json!([3, 2]));
        assert_eq!(dash.budget()["max_bytes"], budget_bytes() + peer_bytes());
    }
}
