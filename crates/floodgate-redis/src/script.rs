//! The one Lua script the store loads: `scripts/lib.lua`, one file per
//! algorithm and `scripts/entry.lua`, concatenated (`entry.lua` has the
//! `KEYS`/`ARGV` contract). Builds its arguments and reads its reply.

use std::sync::LazyLock;
use std::time::Duration;

use floodgate_core::{Algorithm, Check, Decision, LeakyMode, Limit};

/// The script's source.
pub static SOURCE: LazyLock<String> = LazyLock::new(|| {
    [
        include_str!("../scripts/lib.lua"),
        include_str!("../scripts/fixed_window.lua"),
        include_str!("../scripts/sliding_window.lua"),
        include_str!("../scripts/sliding_buckets.lua"),
        include_str!("../scripts/sliding_log.lua"),
        include_str!("../scripts/gcra.lua"),
        include_str!("../scripts/concurrency.lua"),
        include_str!("../scripts/global.lua"),
        include_str!("../scripts/entry.lua"),
    ]
    .join("\n")
});

/// The script's SHA-1, as `EVALSHA` wants it.
pub(crate) static SHA: LazyLock<String> = LazyLock::new(|| redis::Script::new(&SOURCE).get_hash().to_owned());

/// Values per check in the reply: allowed, remaining, reset, retry, delay.
const REPLY_STRIDE: usize = 5;

/// What the script is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Decide, all or nothing.
    Apply,
    /// Give back hits taken at the given time.
    Refund(u64),
}

/// The algorithm code and its parameter (burst or granularity).
pub(crate) fn algorithm(limit: &Limit) -> (&'static str, u64) {
    match limit.algorithm() {
        Algorithm::FixedWindow => ("fw", 0),
        Algorithm::SlidingLog => ("sl", 0),
        Algorithm::SlidingWindow => ("sw", 0),
        Algorithm::SlidingBuckets { granularity } => ("sb", u64::from(*granularity)),
        Algorithm::TokenBucket { .. }
        | Algorithm::Gcra { .. }
        | Algorithm::LeakyBucket { mode: LeakyMode::Meter, .. } => ("gc", limit.burst()),
        Algorithm::LeakyBucket { mode: LeakyMode::Shape, .. } => ("sh", limit.burst()),
        Algorithm::Concurrency => ("cc", 0),
    }
}

/// Whether `limit`'s state in Redis is a window algorithm's string of its
/// own counts (fixed_window `"<window> <count>"`, sliding_window `"<window>
/// <previous> <current>"`): what the sync reads without the script
/// (`own_counts`), what a global decision marks when no peer counts for
/// its key and a merge that brings some unmarks (`scripts/lib.lua`,
/// `marked`).
pub(crate) fn window_string_state(limit: &Limit) -> bool {
    matches!(limit.algorithm(), Algorithm::FixedWindow | Algorithm::SlidingWindow)
}

/// The Redis key of a check: the prefix, then the descriptor's counter key as
/// the hash tag (without a trailing `#<rule index>`, so the limits of one
/// descriptor share a slot), then the limit's fingerprint (a changed limit
/// starts a new counter, as in the memory store).
pub fn redis_key(prefix: &str, key: &str, limit: &Limit) -> String {
    let tag_len = match key.rfind('#') {
        Some(i) if i + 1 < key.len() && key[i + 1..].bytes().all(|b| b.is_ascii_digit()) => i,
        _ => key.len(),
    };
    let (tag, rest) = key.split_at(tag_len);
    format!("{prefix}{{{tag}}}{rest}:{:08x}", limit.fingerprint())
}

/// The base of a counter key's global state (`scripts/global.lua`): the
/// prefix, the descriptor's counter key as the hash tag, then `:g` — no
/// limit fingerprint, so peers, which do not know this region's limit,
/// find it.
pub fn global_base(prefix: &str, key: &str) -> String {
    global_key(prefix, key, "")
}

/// `global_base` followed by `suffix` (e.g. `":x"`), made in one
/// allocation: a global decision names its G:x this way.
pub(crate) fn global_key(prefix: &str, key: &str, suffix: &str) -> String {
    let tag_len = match key.rfind('#') {
        Some(i) if i + 1 < key.len() && key[i + 1..].bytes().all(|b| b.is_ascii_digit()) => i,
        _ => key.len(),
    };
    let (tag, rest) = key.split_at(tag_len);
    let mut out = String::with_capacity(prefix.len() + key.len() + 4 + suffix.len());
    out.push_str(prefix);
    out.push('{');
    out.push_str(tag);
    out.push('}');
    out.push_str(rest);
    out.push_str(":g");
    out.push_str(suffix);
    out
}

/// One check's arguments, owned: a request queued for a batch outlives the
/// checks it was made from.
#[derive(Debug, Clone)]
pub(crate) struct CheckArgs {
    code: &'static str,
    limit: u64,
    window: u64,
    param: u64,
    hits: u64,
    flag: u64,
    /// For a global check in a region: what the script needs beyond the
    /// algorithm: the key's G:x (`scripts/global.lua`, read with the
    /// states; empty for a quiet check, whose G:x the script names only
    /// when it reads it: "=" in the arguments) and `GlobalArgs`, formatted.
    global: Option<(String, std::sync::Arc<str>)>,
    /// For a concurrency limit: its lease operation (`entry.lua`).
    lease: Option<LeaseArg>,
}

/// A concurrency check's lease operation, sent in place of the global
/// arguments (`entry.lua`: "a<id>", "r<id>", "r", "e<id>").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseArg {
    Acquire(u64),
    Release(Option<u64>),
    Extend(u64),
}

impl LeaseArg {
    /// The argument's text: an id as 16 hex digits.
    fn text(self) -> String {
        match self {
            Self::Acquire(id) => format!("a{id:016x}"),
            Self::Release(Some(id)) => format!("r{id:016x}"),
            Self::Release(None) => "r".to_owned(),
            Self::Extend(id) => format!("e{id:016x}"),
        }
    }
}

/// A global check's extra arguments (entry.lua: G:x, then "U H S P W R F
/// C Z[ D]").
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GlobalArgs {
    pub(crate) slot_us: u64,
    pub(crate) horizon: u64,
    pub(crate) slice: u64,
    pub(crate) peers: u64,
    pub(crate) warm: u64,
    pub(crate) retry_us: u64,
    pub(crate) fingerprint: u64,
    /// Hits dead incarnations may have taken (window algorithms).
    pub(crate) charge: u64,
    /// Admit nothing beyond the algorithm's answer (bounded: not recorded
    /// by every peer yet; eventual: cold).
    pub(crate) closed: bool,
    /// The GCRA family's crash debts, `<dead_us>:<hits>,...`.
    pub(crate) debts: String,
}

impl GlobalArgs {
    /// The "U H S P W R F" argument, formatted once per thread for a run of
    /// checks with the same arguments (a rule's checks, between changes of
    /// the region's warming), not once per check.
    pub(crate) fn text(&self) -> std::sync::Arc<str> {
        thread_local! {
            static LAST: std::cell::RefCell<Option<(GlobalArgs, std::sync::Arc<str>)>> =
                const { std::cell::RefCell::new(None) };
        }
        LAST.with_borrow_mut(|last| {
            if let Some((args, text)) = last
                && args == self
            {
                return text.clone();
            }
            let mut text = format!(
                "{} {} {} {} {} {} {} {} {}",
                self.slot_us,
                self.horizon,
                self.slice,
                self.peers,
                self.warm,
                self.retry_us,
                self.fingerprint,
                self.charge,
                u8::from(self.closed)
            );
            if !self.debts.is_empty() {
                text.push(' ');
                text.push_str(&self.debts);
            }
            let text: std::sync::Arc<str> = text.into();
            *last = Some((self.clone(), text.clone()));
            text
        })
    }
}

/// The least flag that is a return's time (µs): the other flags are below
/// 8 (`entry.lua`).
pub(crate) const RETURN_FLAG_MIN: u64 = 1 << 32;

impl CheckArgs {
    /// With the global arguments of a check the region decides as global.
    pub(crate) fn with_global(mut self, global: Option<(String, GlobalArgs)>) -> Self {
        self.global = global.map(|(x, g)| (x, g.text()));
        self
    }

    pub(crate) fn of(c: &Check<'_>, op: Op) -> Self {
        let (code, param) = algorithm(c.limit);
        let after = c.limit.charge() == floodgate_core::Charge::After;
        // Every `hits` above the capacity is denied alike (with no retry
        // time), so at most capacity + 1 is sent: every argument stays below
        // 2^53 (exact in Lua).
        Self {
            code,
            limit: c.limit.limit(),
            window: c.limit.window_us(),
            param,
            // A refund or a return gives back, and a late charge takes, up
            // to 2^53 - 1.
            hits: match c.op {
                floodgate_core::Op::Release { .. } | floodgate_core::Op::Extend { .. } => 0,
                floodgate_core::Op::Take | floodgate_core::Op::Acquire { .. } if !after => {
                    c.hits.min(c.limit.capacity() + 1)
                }
                _ => c.hits.min(floodgate_core::MAX_LIMIT),
            },
            flag: match (op, c.op) {
                // 2: a refund (`entry.lua`), which never denies.
                (Op::Apply, floodgate_core::Op::Refund) => 2,
                // A time (µs, above 2^32): a return of hits taken then,
                // which never denies.
                (Op::Apply, floodgate_core::Op::Return { taken_at_us }) => taken_at_us.max(RETURN_FLAG_MIN),
                // 4: a late charge (what a limit charged after the work
                // makes of every hit), never denied.
                (Op::Apply, floodgate_core::Op::Late) => {
                    if c.hits > 0 {
                        4
                    } else {
                        0
                    }
                }
                // 4 + enforce: a limit charged after the work. (Beside a
                // concurrency limit, a rate takes as usual.)
                (Op::Apply, floodgate_core::Op::Take | floodgate_core::Op::Acquire { .. }) => {
                    u64::from(c.enforce) + if after { 4 } else { 0 }
                }
                // A release or an extend beside a concurrency limit: a rate
                // only peeks (hits 0 below).
                (Op::Apply, floodgate_core::Op::Release { .. } | floodgate_core::Op::Extend { .. }) => {
                    u64::from(c.enforce)
                }
                (Op::Refund(at), _) => at,
            },
            global: None,
            lease: match c.op {
                // Lease 0 is anonymous: taken as any algorithm takes hits.
                floodgate_core::Op::Acquire { lease } if lease != 0 && c.op.on_leases(c.limit) => {
                    Some(LeaseArg::Acquire(lease))
                }
                floodgate_core::Op::Release { lease } if c.op.on_leases(c.limit) => Some(LeaseArg::Release(lease)),
                floodgate_core::Op::Extend { lease } if c.op.on_leases(c.limit) => Some(LeaseArg::Extend(lease)),
                _ => None,
            },
        }
    }
}

/// One request of a call: its time (`None`: the server's `TIME`), its
/// counter keys (a reserve's description key after them), its checks'
/// arguments, and a reserve's or a settle's header in place of its time
/// (`entry.lua`, "Reservations").
pub(crate) type Request<'a> = (Option<u64>, &'a [String], &'a [CheckArgs], Option<&'a str>);

/// An `EVALSHA` (or, with `eval`, `EVAL`) of the script deciding
/// `requests` in order (see `entry.lua`).
pub(crate) fn command(eval: bool, requests: &[Request<'_>], op: Op) -> redis::Cmd {
    let mut cmd = redis::cmd(if eval { "EVAL" } else { "EVALSHA" });
    if eval {
        cmd.arg(SOURCE.as_str());
    } else {
        cmd.arg(SHA.as_str());
    }
    cmd.arg(requests.iter().map(|r| r.1.len()).sum::<usize>());
    for (_, keys, _, _) in requests {
        cmd.arg(*keys);
    }
    cmd.arg(match op {
        Op::Apply => "apply",
        Op::Refund(_) => "refund",
    });
    for (now, _, checks, head) in requests {
        match (head, now) {
            (Some(head), _) => cmd.arg(*head),
            (None, Some(now)) => cmd.arg(*now),
            (None, None) => cmd.arg(""),
        };
        cmd.arg(checks.len());
        for c in *checks {
            cmd.arg(c.code).arg(c.limit).arg(c.window).arg(c.param).arg(c.hits).arg(c.flag);
            match (&c.global, c.lease) {
                (Some((x, text)), _) => cmd.arg(if x.is_empty() { "=" } else { x }).arg(&**text),
                (None, Some(lease)) => cmd.arg("").arg(lease.text()),
                (None, None) => cmd.arg("").arg(""),
            };
        }
    }
    cmd
}

/// What this instance's calls did to concurrency limits' slots, by limit
/// fingerprint: acquired, released and found expired (counts of this
/// instance's calls; the slots held now are Redis's, across instances).
#[derive(Debug, Default)]
pub(crate) struct LeaseAccounts(
    std::sync::Mutex<std::collections::HashMap<u32, floodgate_core::store::memory::LeaseStats>>,
);

impl LeaseAccounts {
    /// A check found `expired` slots ended, then held `before`, then `after`.
    pub(crate) fn record(&self, fingerprint: u32, expired: u64, before: u64, after: u64) {
        let mut map = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        map.entry(fingerprint).or_default().record(expired, before, after);
    }

    /// Every limit's accounts, by fingerprint.
    pub(crate) fn all(&self) -> Vec<(u32, floodgate_core::store::memory::LeaseStats)> {
        let map = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut out: Vec<(u32, floodgate_core::store::memory::LeaseStats)> =
            map.iter().map(|(fp, s)| (*fp, *s)).collect();
        out.sort_unstable_by_key(|(fp, _)| *fp);
        out
    }
}

/// A script's reply that is not what the call expects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct BadReply(pub(crate) String);

/// Cut a call's reply into one reply per request: `counts` are the
/// requests' numbers of checks; an apply answers `2 + 5 * n` values per
/// request, a refund 1.
pub(crate) fn split(
    values: &[i64],
    counts: impl Iterator<Item = usize> + Clone,
    op: Op,
) -> Result<Vec<&[i64]>, BadReply> {
    let len = |n: usize| match op {
        Op::Apply => 2 + REPLY_STRIDE * n,
        Op::Refund(_) => 1,
    };
    let expected: usize = counts.clone().map(len).sum();
    if values.len() != expected {
        return Err(BadReply(format!("the script answered {} values, not {expected}", values.len())));
    }
    let mut rest = values;
    Ok(counts
        .map(|n| {
            let (head, tail) = rest.split_at(len(n));
            rest = tail;
            head
        })
        .collect())
}

/// The reply to an apply: the time the script decided at, whether an
/// enforced check denied (and the script gave back the others), and one
/// decision per check.
#[derive(Debug)]
pub(crate) struct Reply {
    pub(crate) now_us: u64,
    pub(crate) denied: bool,
    pub(crate) decisions: Vec<Decision>,
}

/// Read an apply's reply for `checks`, a concurrency limit's accounts
/// (what each check did to its slots) into `leases`.
pub(crate) fn reply(values: &[i64], checks: &[&Check<'_>], leases: &LeaseAccounts) -> Result<Reply, BadReply> {
    let expected = 2 + REPLY_STRIDE * checks.len();
    if values.len() != expected {
        return Err(BadReply(format!("the script answered {} values, not {expected}", values.len())));
    }
    let num = |v: i64| u64::try_from(v).map_err(|_| BadReply(format!("the script answered a negative value {v}")));
    let decisions = values[2..]
        .chunks_exact(REPLY_STRIDE)
        .zip(checks)
        .map(|(v, c)| {
            let mut delay = num(v[4])?;
            if c.limit.is_concurrency() {
                // Its account, not a delay (`cc_account` in concurrency.lua).
                const B: u64 = 1 << 18;
                leases.record(c.limit.fingerprint(), delay / (B * B), delay / B % B, delay % B);
                delay = 0;
            }
            Ok(Decision {
                allowed: v[0] == 1,
                limit: c.limit.limit(),
                remaining: num(v[1])?,
                reset_after: Duration::from_micros(num(v[2])?),
                retry_after: if v[3] < 0 { None } else { Some(Duration::from_micros(num(v[3])?)) },
                delay: Duration::from_micros(delay),
            })
        })
        .collect::<Result<_, BadReply>>()?;
    Ok(Reply { now_us: num(values[0])?, denied: values[1] == 1, decisions })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_share_a_slot_per_descriptor() {
        let l = Limit::new(Algorithm::FixedWindow, 1, Duration::from_secs(1)).unwrap();
        let a = redis_key("fg:", "3:api|4:user5:alice", &l);
        let b = redis_key("fg:", "3:api|4:user5:alice#1", &l);
        assert!(a.starts_with("fg:{3:api|4:user5:alice}:"), "{a}");
        assert!(b.starts_with("fg:{3:api|4:user5:alice}#1:"), "{b}");
        let c = redis_key("fg:", "3:api|4:user4:a#bc", &l);
        assert!(c.starts_with("fg:{3:api|4:user4:a#bc}:"), "a # in a value is kept: {c}");
        assert_eq!(redis::cluster_routing::Slot::for_key(&a), redis::cluster_routing::Slot::for_key(&b));
    }
}
