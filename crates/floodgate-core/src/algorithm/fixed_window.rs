//! `fixed_window`: a count per epoch-aligned window.

use crate::{Decision, Limit, State};

pub(super) fn apply(limit: &Limit, state: &mut State, now: u64, hits: u64) -> Decision {
    let w = limit.window_us();
    let l = limit.limit();
    let (id, count) = state.window();
    let (mut wid, mut e) = limit.window_div().div_rem(now);
    if wid < *id {
        wid = *id;
        e = 0;
    }
    if wid != *id {
        *id = wid;
        *count = 0;
    }
    let until_end = w - e;
    let reset = |c: u64| if c == 0 { 0 } else { until_end };
    match count.checked_add(hits) {
        Some(next) if next <= l || hits == 0 => {
            *count = next;
            Decision::allow(l, l.saturating_sub(next), reset(next))
        }
        // Allowed at the next window unless the request alone is too big.
        _ => Decision::deny(l, l.saturating_sub(*count), reset(*count), (hits <= l).then_some(until_end)),
    }
}

/// Give back `hits` from a state brought to now ([`Limit::give_back`]).
pub(super) fn give_back(state: &mut State, hits: u64) {
    let (_, count) = state.window();
    *count -= hits.min(*count);
}

/// Give back `hits` admitted at `at`, if its window is still the current one.
pub(super) fn refund(limit: &Limit, state: &mut State, at: u64, hits: u64) {
    let (id, count) = state.window();
    if limit.window_div().div(at) == *id {
        *count -= hits.min(*count);
    }
}
