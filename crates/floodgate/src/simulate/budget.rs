//! `floodgate simulate --budget`: requests whose cost is known only when
//! they end (LLM calls), replayed on one limit three ways — the exact
//! answer (a request is admitted when its actual cost fits: an oracle),
//! "peek, then charge after" (admitted while the budget is not used up,
//! charged at its end: `charge: after` and its gate), and "reserve, then
//! settle" (its estimate reserved at its start, settled at its end) — each
//! through the memory store's own code, on a clock the trace drives.
//!
//! The input is JSON lines sorted by time, a start and an end per request:
//!
//! ```text
//! {"at_ms": 0, "key": "acme", "start": "r1", "estimate": 500}
//! {"at_ms": 2300, "key": "acme", "end": "r1", "actual": 430}
//! ```
//!
//! A request that never ends keeps its estimate (reserve) or is never
//! charged (peek), as a crashed caller would. The report: per way, the
//! requests and cost admitted, and the cost admitted beyond the limit in
//! the windows they started in (over-admission), against the exact answer.
//!
//! `--table` generates the traces instead: `n` callers in a closed loop
//! (each starts its next request when the last ends, so `n` are in flight),
//! costs drawn from 50 to 150, estimates off by a fixed error, and prints
//! the over-admission of both ways by `n` and error beside its bound.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::Arc;
use std::time::Duration;

use floodgate_core::{Algorithm, Charge, Check, Limit, ManualClock, MemoryStore, Op, Store, region::Scope};
use serde::Deserialize;

use crate::exit::Failure;

/// One input line.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    at_ms: u64,
    key: String,
    start: Option<String>,
    end: Option<String>,
    estimate: Option<u64>,
    actual: Option<u64>,
}

/// One request of a trace.
#[derive(Debug, Clone)]
pub(crate) struct Req {
    key: String,
    start_us: u64,
    /// When it ended and what it cost (`None`: it never ended).
    end: Option<(u64, u64)>,
    estimate: u64,
}

impl Req {
    /// What it really used: its actual cost, or (never ended) its estimate.
    fn cost(&self) -> u64 {
        self.end.map_or(self.estimate, |e| e.1)
    }
}

/// Read a trace: its requests in start order, or the first bad line.
pub(crate) fn read(input: impl BufRead) -> Result<Vec<Req>, Failure> {
    let mut reqs: Vec<Req> = Vec::new();
    let mut open: HashMap<String, usize> = HashMap::new();
    let mut last = 0;
    for (i, line) in input.lines().enumerate() {
        let n = i + 1;
        let line = line.map_err(|e| Failure::runtime(format!("reading stdin: {e}")))?;
        if line.trim().is_empty() {
            continue;
        }
        let bad = |why: String| Failure::usage(format!("line {n}: {why}"));
        let l: Line = serde_json::from_str(&line).map_err(|e| {
            bad(format!(
                "{e}: write {{\"at_ms\": 0, \"key\": \"acme\", \"start\": \"r1\", \"estimate\": 500}} or {{\"at_ms\": 900, \"key\": \"acme\", \"end\": \"r1\", \"actual\": 430}}"
            ))
        })?;
        if l.at_ms < last {
            return Err(bad(format!("at_ms {} is before the line above ({last}): sort the trace by time", l.at_ms)));
        }
        last = l.at_ms;
        let at = l.at_ms.saturating_mul(1_000);
        match (l.start, l.end, l.estimate, l.actual) {
            (Some(id), None, Some(estimate), None) => {
                if open.contains_key(&id) {
                    return Err(bad(format!(
                        "request `{id}` started again before it ended: give each request its own id"
                    )));
                }
                open.insert(id, reqs.len());
                reqs.push(Req { key: l.key, start_us: at, end: None, estimate });
            }
            (None, Some(id), None, Some(actual)) => {
                let Some(r) = open.remove(&id) else {
                    return Err(bad(format!("request `{id}` ends but never started (or ended already)")));
                };
                if reqs[r].key != l.key {
                    return Err(bad(format!(
                        "request `{id}` started on key `{}` and ends on `{}`",
                        reqs[r].key, l.key
                    )));
                }
                reqs[r].end = Some((at, actual));
            }
            _ => {
                return Err(bad(
                    "a line is a start (\"start\": id with \"estimate\") or an end (\"end\": id with \"actual\")"
                        .into(),
                ));
            }
        }
    }
    Ok(reqs)
}

/// How a request is admitted and charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Way {
    /// Admitted when its actual cost fits, charged it then (an oracle).
    Exact,
    /// Admitted while the budget is not used up, charged at its end.
    PeekThenCharge,
    /// Its estimate reserved at its start, settled at its end.
    ReserveThenSettle,
}

impl Way {
    const ALL: [Way; 3] = [Way::Exact, Way::PeekThenCharge, Way::ReserveThenSettle];

    fn name(self) -> &'static str {
        match self {
            Way::Exact => "exact (knows each cost)",
            Way::PeekThenCharge => "peek, then charge after",
            Way::ReserveThenSettle => "reserve, then settle",
        }
    }
}

/// What one way admitted.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Outcome {
    /// Requests admitted.
    pub(crate) admitted: u64,
    /// What they used.
    pub(crate) cost: u64,
    /// Per key and window (by start): the cost admitted beyond the limit,
    /// summed.
    pub(crate) over: u64,
    /// The largest of those in one key's window.
    pub(crate) worst_over: u64,
}

/// Replay `reqs` on `limit` (a fixed window) one way.
pub(crate) fn replay(reqs: &[Req], limit: &Limit, way: Way) -> Result<Outcome, Failure> {
    let clock = Arc::new(ManualClock::new(0));
    let store = MemoryStore::builder().clock(Arc::clone(&clock)).max_keys(usize::MAX >> 1).build();
    let after = limit.clone().with_charge(Charge::After).map_err(|e| Failure::usage(e.to_string()))?;
    // Every start and end, in time order (an end before a start at the
    // same time: its budget is back for the start).
    let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * reqs.len());
    for (i, r) in reqs.iter().enumerate() {
        events.push((r.start_us, true, i));
        if let Some((end, _)) = r.end {
            events.push((end, false, i));
        }
    }
    events.sort_by_key(|&(at, start, i)| (at, start, i));
    let mut admitted = vec![None; reqs.len()];
    let ttl = [u64::try_from(floodgate_core::rules::DEFAULT_RESERVATION_TTL.as_micros()).unwrap_or(u64::MAX)];
    let failed = |e: &dyn std::fmt::Display| Failure::runtime(format!("the simulated store: {e}"));
    for (at, start, i) in events {
        clock.set(at);
        let r = &reqs[i];
        let check = |limit, hits| Check { key: &r.key, limit, hits, op: Op::Take, enforce: true, scope: Scope::Region };
        if start {
            admitted[i] = match way {
                Way::Exact => {
                    store.apply_sync(&r.key, limit, r.cost()).map_err(|e| failed(&e))?.allowed.then_some(None)
                }
                Way::PeekThenCharge => {
                    store.apply_sync(&r.key, &after, 0).map_err(|e| failed(&e))?.allowed.then_some(None)
                }
                Way::ReserveThenSettle => {
                    let mut out = Vec::with_capacity(1);
                    let id =
                        at_once(store.reserve(&[check(limit, r.estimate)], &ttl, &mut out)).map_err(|e| failed(&e))?;
                    let allowed = out.first().is_some_and(|d| d.as_ref().is_ok_and(|d| d.allowed));
                    allowed.then_some(id)
                }
            };
            continue;
        }
        let Some(id) = &admitted[i] else { continue };
        let actual = r.end.map_or(0, |e| e.1);
        match way {
            Way::Exact => {}
            Way::PeekThenCharge => {
                store.apply_sync(&r.key, &after, actual).map_err(|e| failed(&e))?;
            }
            Way::ReserveThenSettle => {
                if let Some(id) = id {
                    at_once(store.settle(*id, &[actual])).map_err(|e| failed(&e))?;
                }
            }
        }
    }
    // The cost admitted per key and window of its start.
    let window = u64::try_from(limit.window().as_micros()).unwrap_or(u64::MAX).max(1);
    let mut used: HashMap<(&str, u64), u64> = HashMap::new();
    let mut out = Outcome::default();
    for (r, a) in reqs.iter().zip(&admitted) {
        if a.is_some() {
            out.admitted += 1;
            out.cost += r.cost();
            *used.entry((&r.key, r.start_us / window)).or_default() += r.cost();
        }
    }
    for u in used.values() {
        let over = u.saturating_sub(limit.limit());
        out.over += over;
        out.worst_over = out.worst_over.max(over);
    }
    Ok(out)
}

/// A store future that is ready at once (the memory store's).
fn at_once<F: std::future::Future>(f: F) -> F::Output {
    match floodgate_core::store::ready_at_once(f) {
        std::task::Poll::Ready(v) => v,
        std::task::Poll::Pending => unreachable!("the memory store answers at once"),
    }
}

/// `simulate --budget`: replay the trace on stdin three ways and print the
/// report.
pub(crate) fn run(input: impl BufRead, mut out: impl Write, limit: u64, window: Duration) -> Result<(), Failure> {
    let limit = Limit::new(Algorithm::FixedWindow, limit, window)
        .map_err(|e| Failure::usage(format!("--limit/--window: {e}")))?;
    let reqs = read(input)?;
    let w = |e: std::io::Error| Failure::runtime(format!("writing stdout: {e}"));
    writeln!(out, "{} requests, limit {} per {:?} (fixed_window)", reqs.len(), limit.limit(), window).map_err(w)?;
    writeln!(out, "{:<26} {:>9} {:>12} {:>14} {:>16}", "way", "admitted", "cost", "over (total)", "worst window +")
        .map_err(w)?;
    for way in Way::ALL {
        let o = replay(&reqs, &limit, way)?;
        let pct = 100.0 * o.worst_over as f64 / limit.limit() as f64;
        writeln!(out, "{:<26} {:>9} {:>12} {:>14} {:>15.1}%", way.name(), o.admitted, o.cost, o.over, pct)
            .map_err(w)?;
    }
    Ok(())
}

/// A closed-loop trace: `n` callers on one key for `windows` windows of
/// `window`, each request costing 50 to 150 (100 on average), its estimate
/// off by `error` (−0.5: half; +1.0: double), lasting 0.5 to 1.5 times
/// what makes the callers offer twice `limit` per window.
pub(crate) fn closed_loop(n: u32, error: f64, limit: u64, window: Duration, windows: u64, seed: u64) -> Vec<Req> {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move |below: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % below
    };
    let window_us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
    let end = window_us.saturating_mul(windows);
    // n callers × (window / d) requests × 100 = 2 × limit.
    let d = (u64::from(n).saturating_mul(window_us).saturating_mul(50) / limit.max(1)).max(2);
    let mut reqs = Vec::new();
    for _ in 0..n {
        let mut at = next(d);
        while at < end {
            let cost = 50 + next(101);
            // Rounded up: an estimate is never further below than the error.
            let estimate = ((cost as f64) * (1.0 + error)).ceil().max(0.0) as u64;
            let took = d / 2 + next(d + 1);
            reqs.push(Req { key: "k".into(), start_us: at, end: Some((at + took, cost)), estimate });
            at += took;
        }
    }
    reqs.sort_by_key(|r| r.start_us);
    reqs
}

/// `simulate --budget --table`: over-admission by requests in flight and
/// estimate error, measured and bounded.
pub(crate) fn table(mut out: impl Write, limit: u64, window: Duration, seed: u64) -> Result<(), Failure> {
    let limit = Limit::new(Algorithm::FixedWindow, limit, window)
        .map_err(|e| Failure::usage(format!("--limit/--window: {e}")))?;
    let w = |e: std::io::Error| Failure::runtime(format!("writing stdout: {e}"));
    let windows = 10;
    writeln!(
        out,
        "limit {} per {:?}, {windows} windows, twice the limit offered; costs 50..150 (mean c = 100); the worst \
         window's cost admitted beyond the limit (the exact answer: 0)",
        limit.limit(),
        window
    )
    .map_err(w)?;
    writeln!(
        out,
        "| in flight n | estimate error e | peek, then charge after | n × c | reserve, then settle | n × c × max(0, −e) |"
    )
    .map_err(w)?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|").map_err(w)?;
    for n in [1u32, 4, 16, 64] {
        for error in [-0.5, -0.2, 0.0, 0.2, 1.0] {
            let reqs = closed_loop(n, error, limit.limit(), window, windows, seed);
            let peek = replay(&reqs, &limit, Way::PeekThenCharge)?;
            let reserve = replay(&reqs, &limit, Way::ReserveThenSettle)?;
            let formula = |e: f64| (f64::from(n) * 100.0 * e).round();
            writeln!(
                out,
                "| {n} | {:+.0}% | {} | {} | {} | {} |",
                error * 100.0,
                peek.worst_over,
                formula(1.0),
                reserve.worst_over,
                formula(if error < 0.0 { -error } else { 0.0 })
            )
            .map_err(w)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traces_read_or_say_which_line_is_wrong() {
        let good = "{\"at_ms\": 0, \"key\": \"a\", \"start\": \"r1\", \"estimate\": 5}\n{\"at_ms\": 9, \"key\": \"a\", \"end\": \"r1\", \"actual\": 3}\n";
        let reqs = read(good.as_bytes()).unwrap();
        assert_eq!((reqs.len(), reqs[0].end, reqs[0].estimate), (1, Some((9_000, 3)), 5));
        for (bad, says) in [
            (
                "{\"at_ms\": 0, \"key\": \"a\", \"end\": \"r1\", \"actual\": 3}",
                "line 1: request `r1` ends but never started",
            ),
            (
                "{\"at_ms\": 5, \"key\": \"a\", \"start\": \"r1\", \"estimate\": 5}\n{\"at_ms\": 1, \"key\": \"a\", \"start\": \"r2\", \"estimate\": 5}",
                "line 2: at_ms 1 is before",
            ),
            ("{\"at_ms\": 0, \"key\": \"a\", \"start\": \"r1\"}", "line 1: a line is a start"),
            (
                "{\"at_ms\": 0, \"key\": \"a\", \"start\": \"r1\", \"estimate\": 5}\n{\"at_ms\": 0, \"key\": \"a\", \"start\": \"r1\", \"estimate\": 5}",
                "started again",
            ),
            (
                "{\"at_ms\": 0, \"key\": \"a\", \"start\": \"r1\", \"estimate\": 5}\n{\"at_ms\": 1, \"key\": \"b\", \"end\": \"r1\", \"actual\": 5}",
                "started on key `a` and ends on `b`",
            ),
            ("{\"at\": 0}", "line 1: unknown field"),
        ] {
            let e = read(bad.as_bytes()).unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
        }
    }

    /// The bounds the docs publish hold on every generated trace: the
    /// exact answer never goes over; peek-then-charge goes over by at most
    /// a request per caller in flight; reserve-then-settle only by what the
    /// estimates miss.
    #[test]
    fn over_admission_stays_within_its_bounds() {
        let limit = Limit::new(Algorithm::FixedWindow, 10_000, Duration::from_secs(60)).unwrap();
        for seed in 1..4 {
            for n in [1u32, 4, 16, 64] {
                for error in [-0.5, -0.2, 0.0, 0.2, 1.0] {
                    let reqs = closed_loop(n, error, 10_000, Duration::from_secs(60), 4, seed);
                    assert_eq!(replay(&reqs, &limit, Way::Exact).unwrap().over, 0);
                    let peek = replay(&reqs, &limit, Way::PeekThenCharge).unwrap();
                    assert!(peek.worst_over <= 150 * u64::from(n), "n {n}: {peek:?}");
                    let reserve = replay(&reqs, &limit, Way::ReserveThenSettle).unwrap();
                    let bound = (f64::from(n) * 150.0 * (-error).max(0.0)).ceil() as u64;
                    assert!(reserve.worst_over <= bound, "n {n} error {error}: {reserve:?}");
                }
            }
        }
    }
}
