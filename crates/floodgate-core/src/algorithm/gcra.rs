//! The GCRA family: `gcra`, `token_bucket` and `leaky_bucket` (meter and
//! shaper).
//!
//! State is the theoretical arrival time `TAT = us + rem / L` microseconds,
//! an exact fraction: the emission interval `T = W / L` is never rounded.
//! Everything is computed on the *backlog* `L * (max(TAT, now) - now)`, an
//! integer in units of `1 / L` microseconds:
//!
//! * meter: allow iff `backlog + hits * W <= burst * W`; a token bucket of
//!   capacity `burst` refilled at `L` per `W` admits exactly the same.
//! * shaper: capacity `burst + 1` (one in service, `burst` queued), and an
//!   admitted request is held for `delay = max(0, TAT - now)`.

use crate::math::sat64;
use crate::{Decision, Limit, State};

/// `force` (a late charge): admitted whatever the backlog, with no delay
/// (on a shaper too: the work is done); the debt drains at the rate like
/// any backlog. The TAT saturates
/// at 2^53 - 1 microseconds (the year 2255).
#[inline(always)]
pub(super) fn apply(limit: &Limit, state: &mut State, now: u64, hits: u64, shape: bool, force: bool) -> Decision {
    let l = limit.limit();
    let w = limit.window_us();
    let (l128, w128) = (u128::from(l), u128::from(w));
    let slots = u128::from(limit.burst()) + u128::from(shape);
    let cap = slots * w128;
    let (us, rem) = state.tat();
    let backlog = if *us >= now { u128::from(*us - now) * l128 + u128::from(*rem) } else { 0 };
    let remaining = |backlog: u128| sat64(limit.window_div().div_wide(cap.saturating_sub(backlog)));
    // ceil(backlog / L): the wait until the bucket is full (empty queue).
    let reset = |us: u64, rem: u64| if us >= now { us - now + u64::from(rem > 0) } else { 0 };
    let cost = u128::from(hits) * w128;
    if hits == 0 {
        return Decision::allow(l, remaining(backlog), reset(*us, *rem));
    }
    if backlog + cost > cap && !force {
        let retry = (cost <= cap).then(|| sat64(limit.limit_div().div_ceil_wide(backlog + cost - cap)));
        return Decision::deny(l, remaining(backlog), reset(*us, *rem), retry);
    }
    // A late charge waits for nothing: its work is done.
    let delay = if shape && !force { reset(*us, *rem) } else { 0 };
    if backlog == 0 {
        *us = now;
        *rem = 0;
    }
    let (add_us, add_rem) = cost_of(limit, hits);
    let mut new_rem = *rem + add_rem;
    let mut new_us = u128::from(*us) + add_us;
    if new_rem >= l {
        new_rem -= l;
        new_us += 1;
    }
    // Bounded by now + burst * W / L + 1 <= now + 2^53 * 365d: fits u64
    // (a late charge's debt: saturated below 2^53, exact in Lua too).
    if new_us > u128::from(crate::MAX_LIMIT) {
        (new_us, new_rem) = (u128::from(crate::MAX_LIMIT), 0);
    }
    *us = sat64(new_us);
    *rem = new_rem;
    let mut d = Decision::allow(l, remaining(backlog + cost), reset(*us, *rem));
    d.delay = std::time::Duration::from_micros(delay);
    d
}

/// `hits * T` as `(us, rem / L)`, with `T = q + r / L`.
#[inline]
fn cost_of(limit: &Limit, hits: u64) -> (u128, u64) {
    let (q, r) = limit.interval();
    if hits == 1 {
        return (u128::from(q), r);
    }
    let hr = u128::from(hits) * u128::from(r);
    let carry = limit.limit_div().div_wide(hr);
    (u128::from(hits) * u128::from(q) + carry, sat64(hr - carry * u128::from(limit.limit())))
}

/// Give back `hits` admitted at `at`, now: `TAT -= hits * T`, less what
/// has elapsed since `at`. Until `at + hits * T` the TAT cannot have been
/// clamped up to the present in between (it stays at or above that time), so
/// the whole cost comes back exactly; after that, only the part not yet
/// elapsed, so a late refund never leaves more room than the request took.
pub(super) fn refund(limit: &Limit, state: &mut State, at: u64, now: u64, hits: u64) {
    let (us, rem) = state.tat();
    let l = u128::from(limit.limit());
    // In units of 1/L microseconds.
    let cost = u128::from(hits) * u128::from(limit.window_us());
    let back = cost.saturating_sub(u128::from(now.saturating_sub(at)) * l);
    let tat = (u128::from(*us) * l + u128::from(*rem)).saturating_sub(back);
    let q = limit.limit_div().div_wide(tat);
    *us = sat64(q);
    *rem = sat64(tat - q * l);
}
