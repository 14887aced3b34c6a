//! `sliding_buckets`: exact over `g` epoch-aligned sub-windows ("buckets") of
//! `W / g`: the count is the current bucket plus the `g - 1` before it.
//! State is a ring `[last bucket id, sum, count per bucket...]`.

use crate::{Decision, Limit, State};

/// `force` (a late charge): admitted whatever the sum (debt, for as long as
/// the charge's bucket stays in the window).
pub(super) fn apply(limit: &Limit, granularity: u32, state: &mut State, now: u64, hits: u64, force: bool) -> Decision {
    let g = u64::from(granularity);
    let size = limit.bucket_div().get();
    let slot = |id: u64| limit.granularity_div().div_rem(id).1 as usize;
    let l = limit.limit();
    let mut now = now;
    let mut bid = limit.bucket_div().div(now);
    let ring = state.buckets(granularity as usize, bid);
    let Some(([last, sum], counts)) = ring.split_first_chunk_mut::<2>() else {
        unreachable!("the ring has two header words")
    };
    if bid < *last {
        bid = *last;
        now = bid * size;
    }
    // Drop the buckets that slid out since the last call.
    if bid - *last >= g {
        counts.fill(0);
        *sum = 0;
    } else {
        for id in *last + 1..=bid {
            let c = &mut counts[slot(id)];
            *sum -= *c;
            *c = 0;
        }
    }
    *last = bid;
    // Bucket `id` stops counting when bucket `id + g` begins.
    let gone_at = |id: u64| (id + g) * size - now;
    let oldest = (bid + 1).saturating_sub(g);
    let reset = |counts: &[u64], sum: u64| {
        if sum == 0 {
            return 0;
        }
        (oldest..=bid).rev().find(|&id| counts[slot(id)] > 0).map_or(0, gone_at)
    };
    match sum.checked_add(hits) {
        Some(next) if next <= l || hits == 0 || force => {
            let next = next.min(crate::MAX_LIMIT);
            counts[slot(bid)] += next - *sum;
            *sum = next;
            Decision::allow(l, l.saturating_sub(next), reset(counts, next))
        }
        _ => {
            let retry = (hits <= l).then(|| {
                let mut need = *sum + hits - l;
                let mut at = gone_at(bid);
                for id in oldest..=bid {
                    need = need.saturating_sub(counts[slot(id)]);
                    if need == 0 {
                        at = gone_at(id);
                        break;
                    }
                }
                at
            });
            Decision::deny(l, l.saturating_sub(*sum), reset(counts, *sum), retry)
        }
    }
}

/// Give back `hits` from a state brought to now ([`Limit::give_back`]):
/// the newest bucket first, then the older ones still in the window.
pub(super) fn give_back(limit: &Limit, granularity: u32, state: &mut State, hits: u64) {
    let g = u64::from(granularity);
    // The peek before made the ring (the id given is only for a new one).
    let ring = state.buckets(granularity as usize, 0);
    let Some(([last, sum], counts)) = ring.split_first_chunk_mut::<2>() else {
        unreachable!("the ring has two header words")
    };
    let mut left = hits.min(*sum);
    *sum -= left;
    for id in ((*last + 1).saturating_sub(g)..=*last).rev() {
        let c = &mut counts[limit.granularity_div().div_rem(id).1 as usize];
        let take = left.min(*c);
        *c -= take;
        left -= take;
        if left == 0 {
            break;
        }
    }
}

/// Give back `hits` admitted at `at`, if its bucket is still in the ring.
pub(super) fn refund(limit: &Limit, granularity: u32, state: &mut State, at: u64, hits: u64) {
    let bid = limit.bucket_div().div(at);
    let slot = limit.granularity_div().div_rem(bid).1 as usize;
    let ring = state.buckets(granularity as usize, bid);
    let Some(([last, sum], counts)) = ring.split_first_chunk_mut::<2>() else {
        unreachable!("the ring has two header words")
    };
    if bid <= *last && *last - bid < u64::from(granularity) {
        let take = hits.min(counts[slot]);
        counts[slot] -= take;
        *sum -= take;
    }
}
