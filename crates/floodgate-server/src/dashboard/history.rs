//! A few series sampled once a second, kept over three ranges in fixed
//! memory: the last 5 minutes by the second, the last hour by 10 seconds and
//! the last day by 5 minutes. Each series says how a coarser bucket sums up
//! its seconds ([`Fold`]): decisions add up, a gauge (a lag, a queue) keeps
//! its highest second, so a spike still shows on the day's chart.

use serde_json::{Value, json};

/// The ranges kept: `(name, seconds per bucket, buckets)`.
pub const RANGES: [(&str, u32, usize); 3] = [("5m", 1, 300), ("1h", 10, 360), ("1d", 300, 288)];

/// Buckets in all ranges together.
pub const BUCKETS: usize = RANGES[0].2 + RANGES[1].2 + RANGES[2].2;

/// How a coarser bucket holds its seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fold {
    /// Their sum (counts: the chart shows sum / seconds, a rate).
    Sum,
    /// Their highest (gauges).
    Max,
}

/// One range's ring of buckets.
#[derive(Debug)]
struct Ring<const N: usize> {
    step_s: u32,
    buckets: Box<[[u32; N]]>,
    /// Where the next closed bucket goes.
    next: usize,
    /// Closed buckets held, up to `buckets.len()`.
    filled: usize,
    /// The bucket being filled, and its seconds so far.
    open: [u32; N],
    open_s: u32,
}

impl<const N: usize> Ring<N> {
    fn new(step_s: u32, len: usize) -> Self {
        Ring { step_s, buckets: vec![[0; N]; len].into_boxed_slice(), next: 0, filled: 0, open: [0; N], open_s: 0 }
    }

    fn push(&mut self, second: [u32; N], folds: &[Fold; N]) {
        for ((o, v), f) in self.open.iter_mut().zip(second).zip(folds) {
            *o = match (f, self.open_s) {
                (_, 0) => v,
                (Fold::Sum, _) => o.saturating_add(v),
                (Fold::Max, _) => (*o).max(v),
            };
        }
        self.open_s += 1;
        if self.open_s == self.step_s {
            let len = self.buckets.len();
            self.buckets[self.next] = self.open;
            self.next = (self.next + 1) % len;
            self.filled = (self.filled + 1).min(len);
            self.open_s = 0;
        }
    }

    /// Series `i`, oldest closed bucket first.
    fn series(&self, i: usize) -> Vec<u32> {
        let len = self.buckets.len();
        let start = (self.next + len - self.filled) % len;
        (0..self.filled).map(|j| self.buckets[(start + j) % len][i]).collect()
    }
}

/// `N` series over the three [`RANGES`].
#[derive(Debug)]
pub struct History<const N: usize> {
    rings: [Ring<N>; 3],
    /// The last second pushed, in Unix seconds (its end).
    last_s: u64,
}

impl<const N: usize> History<N> {
    /// Empty.
    pub fn new() -> Self {
        History { rings: RANGES.map(|(_, step, len)| Ring::new(step, len)), last_s: 0 }
    }

    /// Bytes held at most (the buckets are allocated once, whole).
    pub const fn bytes() -> usize {
        std::mem::size_of::<Self>() + BUCKETS * std::mem::size_of::<[u32; N]>()
    }

    /// One second's values, ending at `now_s` (Unix seconds). Seconds
    /// skipped since the last push (a late tick) are pushed empty first, so
    /// every bucket stays where its time says (the late tick's values land
    /// in its own second).
    pub fn push(&mut self, second: [u32; N], folds: &[Fold; N], now_s: u64) {
        if self.last_s > 0 && now_s > self.last_s + 1 {
            let missed = (now_s - self.last_s - 1).min(RANGES[2].1 as u64 * RANGES[2].2 as u64);
            for _ in 0..missed {
                for r in &mut self.rings {
                    r.push([0; N], folds);
                }
            }
        }
        for r in &mut self.rings {
            r.push(second, folds);
        }
        self.last_s = now_s;
    }

    /// The series of range `range` (an index into [`RANGES`]) named by
    /// `names`: `{"step_s", "end_unix_s", name: [oldest closed bucket first]}`.
    /// The last bucket ends at `end_unix_s`; the one being filled is left
    /// out (a partial bucket would read as a drop).
    pub fn to_json(&self, range: usize, names: &[&str; N]) -> Value {
        let r = &self.rings[range.min(2)];
        let end = self.last_s.saturating_sub(u64::from(r.open_s));
        let mut o = serde_json::Map::new();
        o.insert("step_s".into(), json!(r.step_s));
        o.insert("end_unix_s".into(), json!(end));
        for (i, name) in names.iter().enumerate() {
            o.insert((*name).to_owned(), json!(r.series(i)));
        }
        Value::Object(o)
    }
}

impl<const N: usize> Default for History<N> {
    fn default() -> Self {
        Self::new()
    }
}

/// The index in [`RANGES`] of a range's name (`5m`, `1h`, `1d`).
pub fn range_named(name: &str) -> Option<usize> {
    RANGES.iter().position(|(n, ..)| *n == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FOLDS: [Fold; 2] = [Fold::Sum, Fold::Max];

    #[test]
    fn each_range_folds_its_seconds() {
        let mut h = History::<2>::new();
        for s in 1..=25u32 {
            h.push([s, s % 7], &FOLDS, 1_000 + u64::from(s));
        }
        let fine = h.to_json(0, &["n", "g"]);
        assert_eq!(fine["step_s"], 1);
        assert_eq!(fine["end_unix_s"], 1_025);
        assert_eq!(fine["n"].as_array().unwrap().len(), 25);
        let hour = h.to_json(1, &["n", "g"]);
        // Seconds 1..=10 and 11..=20 closed; 21..=25 still open.
        assert_eq!(hour["n"], json!([55, 155]));
        assert_eq!(hour["g"], json!([6, 6]));
        assert_eq!(hour["end_unix_s"], 1_020);
        assert_eq!(h.to_json(2, &["n", "g"])["n"], json!([]));
    }

    #[test]
    fn a_full_ring_keeps_its_last_buckets_in_order() {
        let mut h = History::<2>::new();
        let n = 86_400 + 600;
        for s in 0..n {
            h.push([1, (s % 1_000) as u32], &FOLDS, s as u64 + 1);
        }
        let day = h.to_json(2, &["n", "g"]);
        let counts = day["n"].as_array().unwrap();
        assert_eq!(counts.len(), 288);
        assert!(counts.iter().all(|c| c == 300));
        assert_eq!(day["end_unix_s"], n as u64);
        let fine = h.to_json(0, &["n", "g"]);
        assert_eq!(fine["g"].as_array().unwrap().last().unwrap(), ((n - 1) % 1_000) as u64);
    }

    #[test]
    fn a_late_tick_keeps_the_buckets_on_time() {
        let mut h = History::<2>::new();
        h.push([1, 0], &FOLDS, 100);
        h.push([5, 0], &FOLDS, 104); // three seconds missed
        assert_eq!(h.to_json(0, &["n", "g"])["n"], json!([1, 0, 0, 0, 5]));
        assert_eq!(h.to_json(0, &["n", "g"])["end_unix_s"], 104);
    }

    #[test]
    fn the_memory_is_what_the_budget_says() {
        assert_eq!(BUCKETS, 948);
        assert!(History::<4>::bytes() < 16 * 1024, "{}", History::<4>::bytes());
    }
}
