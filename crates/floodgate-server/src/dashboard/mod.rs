//! What the dashboard shows, kept whether or not anyone looks, in one fixed
//! memory budget:
//!
//! * per rule, decisions per second over the last [`HISTORY_SECONDS`]
//!   (allowed, denied, shadow-denied, decided by the failure policy): a
//!   tick a second reads the rule's Prometheus counters and keeps the
//!   differences, so the decision path pays nothing for them;
//! * per rule, its heaviest keys by hits and by denials ([`TopKeys`]), the
//!   one thing counted on the decision path: a hash of the counter key
//!   and a `try_lock` (a busy table skips the hit and counts it in
//!   `unsketched`, rather than make a decision wait).
//!
//! Both are kept only for rules that see traffic, at most
//! [`MAX_WATCHED_RULES`] at once (beyond, a rule's decisions are counted in
//! the metrics as always but it has no chart or top keys until a watched
//! rule has been idle for [`HISTORY_SECONDS`] and gives its place back).
//! Keys are never metric labels: they appear only here, on the admin
//! address. With `--dashboard off` nothing of this is kept.

pub mod page;
pub mod topkeys;

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::{Mutex, PoisonError};

use serde_json::{Value, json};

use crate::dashboard::topkeys::TopKeys;

/// Seconds of per-second history kept per rule.
pub const HISTORY_SECONDS: usize = 300;
/// Rules with a history and top keys at once, at most.
pub const MAX_WATCHED_RULES: usize = 1_000;
/// The series of a rule's history, in order.
pub const SERIES: [&str; 4] = ["allowed", "denied", "shadow_denied", "failure_policy"];

/// The most the dashboard's data holds, in bytes: its fixed part per
/// watched rule (two top-key tables and the history) times
/// [`MAX_WATCHED_RULES`]. Rule names are the rules'; keys are cut.
pub const fn budget_bytes() -> usize {
    MAX_WATCHED_RULES
        * (2 * TopKeys::max_bytes()
            + std::mem::size_of::<History>()
            + std::mem::size_of::<[[u32; 4]; HISTORY_SECONDS]>())
}

/// The dashboard's switch and its share of the budget in use.
#[derive(Debug)]
pub struct Dashboard {
    on: bool,
    watched: AtomicUsize,
    /// Rules that saw traffic while the budget was full.
    refused: AtomicU64,
    hasher: foldhash::fast::RandomState,
}

impl Dashboard {
    /// Keep the dashboard's data (`on`) or nothing.
    pub fn new(on: bool) -> Self {
        Self { on, watched: AtomicUsize::new(0), refused: AtomicU64::new(0), hasher: Default::default() }
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

    /// The budget, as the dashboard's JSON shows it.
    pub fn budget(&self) -> Value {
        json!({
            "on": self.on,
            "rules_watched": self.watched.load(Relaxed),
            "max_rules": MAX_WATCHED_RULES,
            "refused": self.refused.load(Relaxed),
            "max_bytes": budget_bytes(),
            "history_seconds": HISTORY_SECONDS,
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
}

/// One rule's recent decisions per second, oldest first once full.
#[derive(Debug)]
struct History {
    per_second: Box<[[u32; 4]; HISTORY_SECONDS]>,
    /// Where the next second goes.
    next: usize,
    /// Seconds recorded, up to [`HISTORY_SECONDS`].
    filled: usize,
    /// Seconds in a row without a decision.
    idle: usize,
}

/// A rule's history, and its counters' totals at the last tick (kept for
/// every rule, so a rule's first second of traffic is in its history).
#[derive(Debug, Default)]
struct Ticked {
    last: [u64; 4],
    history: Option<History>,
}

/// One rule's dashboard data (none until it sees traffic).
#[derive(Debug, Default)]
pub struct RuleWatch {
    tops: Mutex<Option<Box<Tops>>>,
    history: Mutex<Ticked>,
    /// Hits not counted in the top keys: the table was busy.
    unsketched: AtomicU64,
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
            None if dash.take() => tops.insert(Box::default()),
            None => return,
        };
        let h = dash.hasher.hash_one(key.counter_key);
        t.hits.record(h, hits, |out| key.display(out));
        if denied {
            t.denials.record(h, hits, |out| key.display(out));
        }
    }

    /// One second's tick: add the counters' growth since the last one
    /// (`totals`, in [`SERIES`] order) to the history; a rule idle for
    /// [`HISTORY_SECONDS`] gives its place back.
    pub fn tick(&self, dash: &Dashboard, totals: [u64; 4]) {
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
        let h = ticked.history.get_or_insert_with(|| History {
            per_second: Box::new([[0; 4]; HISTORY_SECONDS]),
            next: 0,
            filled: 0,
            idle: 0,
        });
        h.per_second[h.next] = second;
        h.next = (h.next + 1) % HISTORY_SECONDS;
        h.filled = (h.filled + 1).min(HISTORY_SECONDS);
        h.idle = if second == [0; 4] { h.idle + 1 } else { 0 };
        if h.idle >= HISTORY_SECONDS {
            ticked.history = None;
            *self.tops.lock().unwrap_or_else(PoisonError::into_inner) = None;
            self.unsketched.store(0, Relaxed);
            dash.give_back();
        }
    }

    /// This rule's dashboard JSON (`null` when not watched): per-second
    /// series, oldest first, and the `top` heaviest keys of each table.
    pub fn to_json(&self, top: usize) -> Value {
        let tops = self.tops.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(t) = tops.as_ref() else { return Value::Null };
        let table = |k: &TopKeys| json!({ "seen": k.seen(), "bound": k.bound(), "keys": k.top(top) });
        let (hits, denials) = (table(&t.hits), table(&t.denials));
        drop(tops);
        let ticked = self.history.lock().unwrap_or_else(PoisonError::into_inner);
        let mut series = serde_json::Map::new();
        for (i, name) in SERIES.iter().enumerate() {
            let values: Vec<u32> = match ticked.history.as_ref() {
                Some(h) => {
                    let start = (h.next + HISTORY_SECONDS - h.filled) % HISTORY_SECONDS;
                    (0..h.filled).map(|j| h.per_second[(start + j) % HISTORY_SECONDS][i]).collect()
                }
                None => Vec::new(),
            };
            series.insert((*name).to_owned(), json!(values));
        }
        json!({
            "per_second": series,
            "top_hits": hits,
            "top_denials": denials,
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
        assert!(w.to_json(5).is_null());
        let e = vec![("user".to_owned(), "alice".to_owned())];
        w.record(&dash, key("k-alice", &e), 3, true);
        assert_eq!(dash.watched.load(Relaxed), 1);
        w.tick(&dash, [10, 3, 0, 0]);
        w.tick(&dash, [15, 4, 0, 1]);
        let j = w.to_json(5);
        assert_eq!(j["per_second"]["allowed"], json!([10, 5]), "the first second counts from the rule's start");
        assert_eq!(j["per_second"]["denied"], json!([3, 1]));
        assert_eq!(j["per_second"]["failure_policy"], json!([0, 1]));
        assert_eq!(j["top_hits"]["keys"][0]["key"], "user=alice");
        assert_eq!(j["top_denials"]["keys"][0]["count"], 3);
        for _ in 0..HISTORY_SECONDS {
            w.tick(&dash, [15, 4, 0, 1]);
        }
        assert!(w.to_json(5).is_null(), "idle for the whole history: released");
        assert_eq!(dash.watched.load(Relaxed), 0);
    }

    #[test]
    fn the_history_keeps_the_last_seconds_in_order() {
        let dash = Dashboard::new(true);
        let w = RuleWatch::default();
        w.record(&dash, key("k", &[]), 1, false);
        for s in 0..(HISTORY_SECONDS as u64 + 10) {
            w.tick(&dash, [s * (s + 1) / 2, 0, 0, 0]); // s more each second
        }
        let allowed = w.to_json(1)["per_second"]["allowed"].as_array().unwrap().clone();
        assert_eq!(allowed.len(), HISTORY_SECONDS);
        assert_eq!(allowed[0], 10);
        assert_eq!(allowed[HISTORY_SECONDS - 1], HISTORY_SECONDS as u64 + 9);
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
        assert!(rules[MAX_WATCHED_RULES].to_json(1).is_null());
        assert!(budget_bytes() < 16 * 1024 * 1024, "{}", budget_bytes());
    }
}
