//! `fixed_window`: a count per epoch-aligned window.
//!
//! A count above the limit (debt, from late charges) carries into the next
//! windows, a limit's worth paid off per window: a budget overspent by a
//! late charge is paid back from the windows after it, so over time the
//! limit holds. Without late charges a count never exceeds the limit and
//! each window starts at zero.

use crate::{Decision, Limit, State};

pub(super) fn apply(limit: &Limit, state: &mut State, now: u64, hits: u64, force: bool) -> Decision {
    let w = limit.window_us();
    let l = limit.limit();
    let (id, count) = state.window();
    let (mut wid, mut e) = limit.window_div().div_rem(now);
    if wid < *id {
        wid = *id;
        e = 0;
    }
    if wid != *id {
        // Debt carries: a limit's worth is paid off per window passed.
        *count = count.saturating_sub(l.saturating_mul(wid - *id));
        *id = wid;
    }
    let until_end = w - e;
    // Until the count is paid off: this window, then one per limit's worth
    // beyond it (at most 2^53 - 1 us, as every wait a store reports).
    let later = |windows: u64| until_end.saturating_add(windows.saturating_mul(w)).min(crate::MAX_LIMIT);
    let reset = |c: u64| if c == 0 { 0 } else { later((c - 1) / l) };
    match count.checked_add(hits) {
        Some(next) if next <= l || hits == 0 || force => {
            *count = next.min(crate::MAX_LIMIT);
            Decision::allow(l, l.saturating_sub(*count), reset(*count))
        }
        None if force => {
            *count = crate::MAX_LIMIT;
            Decision::allow(l, 0, reset(*count))
        }
        // Allowed once enough windows have passed (the next one, without
        // debt) unless the request alone is too big.
        _ => {
            let retry = (hits <= l).then(|| {
                // Windows to wait: the least k with count - k * l + hits <= l,
                // ceil((count + hits - l) / l).
                later((*count + hits - 1) / l - 1)
            });
            Decision::deny(l, l.saturating_sub(*count), reset(*count), retry)
        }
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
