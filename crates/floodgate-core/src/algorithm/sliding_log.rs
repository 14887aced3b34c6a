//! `sliding_log`: exact. Keeps every admitted `(time, hits)` of the last
//! window (entries at the same microsecond merged): allow iff the hits in
//! `(now - W, now]` plus `hits` do not exceed the limit.

use crate::{Decision, Limit, State};

/// `force` (a late charge): admitted whatever the sum, which may pass the
/// limit (debt, for as long as the charge stays in the window). The log
/// still keeps at most `limit` entries: a forced charge on a full log joins
/// its newest entry, stamped now (its hits leave later: stricter, never
/// looser).
pub(super) fn apply(limit: &Limit, state: &mut State, now: u64, hits: u64, force: bool) -> Decision {
    let w = limit.window_us();
    let l = limit.limit();
    let log = state.log();
    let mut now = now;
    if let Some(&(newest, _)) = log.entries.back() {
        now = now.max(newest);
    }
    while let Some(&(t, h)) = log.entries.front() {
        if t.saturating_add(w) > now {
            break;
        }
        log.sum -= h;
        log.entries.pop_front();
    }
    let reset = |log: &crate::state::Log| log.entries.back().map_or(0, |&(t, _)| t + w - now);
    match log.sum.checked_add(hits) {
        Some(next) if next <= l || hits == 0 || force => {
            let next = next.min(crate::MAX_LIMIT);
            let hits = next - log.sum;
            if hits > 0 {
                let full = log.entries.len() as u64 >= l;
                match log.entries.back_mut() {
                    Some((t, h)) if *t == now || (force && full) => {
                        *t = now;
                        *h += hits;
                    }
                    _ => {
                        if log.entries.capacity() == 0 {
                            log.entries.reserve(usize::try_from(l.min(16)).unwrap_or(16));
                        }
                        log.entries.push_back((now, hits));
                    }
                }
                log.sum = next;
            }
            Decision::allow(l, l.saturating_sub(log.sum), reset(log))
        }
        _ => {
            // Wait for the oldest entries to leave until the request fits.
            let retry = (hits <= l).then(|| {
                let mut need = log.sum + hits - l;
                let mut at = now;
                for &(t, h) in &log.entries {
                    at = t + w;
                    need = need.saturating_sub(h);
                    if need == 0 {
                        break;
                    }
                }
                at - now
            });
            Decision::deny(l, l.saturating_sub(log.sum), reset(log), retry)
        }
    }
}

/// Give back `hits` from a state brought to now ([`Limit::give_back`]):
/// the newest entries first.
pub(super) fn give_back(state: &mut State, hits: u64) {
    let log = state.log();
    let mut left = hits;
    while left > 0
        && let Some((_, h)) = log.entries.back_mut()
    {
        let take = left.min(*h);
        *h -= take;
        log.sum -= take;
        left -= take;
        if *h == 0 {
            log.entries.pop_back();
        }
    }
}

/// Give back `hits` admitted at `at`, now: from the entry that recorded
/// them, the oldest at or after `at` (a request is logged at `at`, or at the
/// newest entry's time if the clock had stepped back) — unless it may have
/// left the window already.
pub(super) fn refund(limit: &Limit, state: &mut State, at: u64, now: u64, hits: u64) {
    if at.saturating_add(limit.window_us()) <= now {
        return;
    }
    let log = state.log();
    let i = log.entries.partition_point(|&(t, _)| t < at);
    if let Some((_, h)) = log.entries.get_mut(i) {
        let take = hits.min(*h);
        *h -= take;
        log.sum -= take;
        if *h == 0 {
            log.entries.remove(i);
        }
    }
}
