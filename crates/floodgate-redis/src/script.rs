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
fn algorithm(limit: &Limit) -> (&'static str, u64) {
    match limit.algorithm() {
        Algorithm::FixedWindow => ("fw", 0),
        Algorithm::SlidingLog => ("sl", 0),
        Algorithm::SlidingWindow => ("sw", 0),
        Algorithm::SlidingBuckets { granularity } => ("sb", u64::from(*granularity)),
        Algorithm::TokenBucket { .. }
        | Algorithm::Gcra { .. }
        | Algorithm::LeakyBucket { mode: LeakyMode::Meter, .. } => ("gc", limit.burst()),
        Algorithm::LeakyBucket { mode: LeakyMode::Shape, .. } => ("sh", limit.burst()),
    }
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

/// An `EVALSHA` (or, with `eval`, `EVAL`) of the script for `checks`.
pub(crate) fn command(eval: bool, keys: &[String], checks: &[&Check<'_>], now_us: Option<u64>, op: Op) -> redis::Cmd {
    let mut cmd = redis::cmd(if eval { "EVAL" } else { "EVALSHA" });
    if eval {
        cmd.arg(SOURCE.as_str());
    } else {
        cmd.arg(SHA.as_str());
    }
    cmd.arg(keys.len()).arg(keys);
    match now_us {
        Some(now) => cmd.arg(now),
        None => cmd.arg(""),
    };
    cmd.arg(match op {
        Op::Apply => "apply",
        Op::Refund(_) => "refund",
    });
    // Every `hits` above the capacity is denied alike (with no retry time),
    // so at most capacity + 1 is sent: every argument stays below 2^53
    // (exact in Lua).
    for c in checks {
        let (code, param) = algorithm(c.limit);
        let flag = match op {
            Op::Apply => u64::from(c.enforce),
            Op::Refund(at) => at,
        };
        cmd.arg(code)
            .arg(c.limit.limit())
            .arg(c.limit.window_us())
            .arg(param)
            .arg(c.hits.min(c.limit.capacity() + 1))
            .arg(flag);
    }
    cmd
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

/// Read an apply's reply for `checks`.
pub(crate) fn reply(values: &[i64], checks: &[&Check<'_>]) -> Result<Reply, String> {
    let expected = 2 + REPLY_STRIDE * checks.len();
    if values.len() != expected {
        return Err(format!("the script answered {} values, not {expected}", values.len()));
    }
    let num = |v: i64| u64::try_from(v).map_err(|_| format!("the script answered a negative value {v}"));
    let decisions = values[2..]
        .chunks_exact(REPLY_STRIDE)
        .zip(checks)
        .map(|(v, c)| {
            Ok(Decision {
                allowed: v[0] == 1,
                limit: c.limit.limit(),
                remaining: num(v[1])?,
                reset_after: Duration::from_micros(num(v[2])?),
                retry_after: if v[3] < 0 { None } else { Some(Duration::from_micros(num(v[3])?)) },
                delay: Duration::from_micros(num(v[4])?),
            })
        })
        .collect::<Result<_, String>>()?;
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
