//! `sliding_window`: Cloudflare's two-counter estimate. The previous window's
//! count is weighted by the share of it that the sliding window still covers:
//! allow iff `prev * (W - e) + (cur + hits) * W <= limit * W`, with `e` the time
//! since the current window started. Exact integers, no floats.

use crate::math::{div, sat64};
use crate::{Decision, Limit, State};

/// `force` (a late charge): admitted whatever the estimate (debt, weighing
/// on the estimate for as long as its window does: two windows at most).
pub(super) fn apply(limit: &Limit, state: &mut State, now: u64, hits: u64, force: bool) -> Decision {
    let w = limit.window_us();
    let l = limit.limit();
    let (id, prev, cur) = state.sliding();
    let (mut wid, mut e) = limit.window_div().div_rem(now);
    if wid < *id {
        wid = *id;
        e = 0;
    }
    if wid != *id {
        *prev = if wid == *id + 1 { *cur } else { 0 };
        *cur = 0;
        *id = wid;
    }
    let (w128, l128) = (u128::from(w), u128::from(l));
    // The previous window's weight, in units of 1/W.
    let weighted_prev = u128::from(*prev) * u128::from(w - e);
    let used = weighted_prev + u128::from(*cur) * w128;
    let cap = l128 * w128;
    let remaining = |used: u128| sat64(limit.window_div().div_wide(cap.saturating_sub(used)));
    let reset = |prev: u64, cur: u64| {
        if cur > 0 {
            2 * w - e
        } else if prev > 0 {
            w - e
        } else {
            0
        }
    };
    let cost = u128::from(hits) * w128;
    if hits == 0 || used + cost <= cap || force {
        let add = hits.min(crate::MAX_LIMIT - (*cur).min(crate::MAX_LIMIT));
        *cur += add;
        let used = used + u128::from(add) * w128;
        return Decision::allow(l, remaining(used), reset(*prev, *cur));
    }
    let retry = (hits <= l).then(|| {
        let (p, c, h) = (u128::from(*prev), u128::from(*cur), u128::from(hits));
        if c + h <= l128 {
            // Later in this window, once enough of `prev` has slid out
            // (denied now, so prev > 0): prev * (W - e - d) <= (L - cur - hits) * W.
            let m = div((l128 - c - h) * w128, p);
            sat64(u128::from(w - e) - m.min(u128::from(w - e)))
        } else {
            // Next window: prev' = cur > 0, cur' = 0; allowed from e' with
            // cur * (W - e') <= (L - hits) * W, at the latest at e' = W.
            let m = div((l128 - h) * w128, c);
            let e_next = w128 - m.min(w128);
            sat64(u128::from(w - e) + e_next)
        }
    });
    Decision::deny(l, remaining(used), reset(*prev, *cur), retry)
}

/// Give back `hits` from a state brought to now ([`Limit::give_back`]):
/// the current window's count first, then the previous one's.
pub(super) fn give_back(state: &mut State, hits: u64) {
    let (_, prev, cur) = state.sliding();
    let from_cur = hits.min(*cur);
    *cur -= from_cur;
    *prev -= (hits - from_cur).min(*prev);
}

/// Give back `hits` admitted at `at`: from the current window's count, or
/// from the previous one's if the window has moved on by one since.
pub(super) fn refund(limit: &Limit, state: &mut State, at: u64, hits: u64) {
    let (id, prev, cur) = state.sliding();
    let wid = limit.window_div().div(at);
    if wid == *id {
        *cur -= hits.min(*cur);
    } else if wid + 1 == *id {
        *prev -= hits.min(*prev);
    }
}
