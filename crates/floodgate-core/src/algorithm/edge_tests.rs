//! Named edge cases, one scenario each, with the numbers worked out by hand.

use std::time::Duration;

use crate::{Algorithm, LeakyMode, Limit, MAX_LIMIT, State};

const SEC: u64 = 1_000_000;

fn limit(algorithm: Algorithm, l: u64, window_us: u64) -> Limit {
    Limit::new(algorithm, l, Duration::from_micros(window_us)).unwrap()
}

fn us(d: Option<Duration>) -> Option<u64> {
    d.map(|d| u64::try_from(d.as_micros()).unwrap())
}

#[test]
fn fixed_window_counts_per_epoch_aligned_window() {
    let l = limit(Algorithm::FixedWindow, 3, SEC);
    let mut s = State::default();
    let t = 7 * SEC + 400_000;
    for left in [2, 1, 0] {
        let d = l.apply(&mut s, t, 1);
        assert!(d.allowed);
        assert_eq!(d.remaining, left);
        assert_eq!(d.reset_after, Duration::from_millis(600));
    }
    let d = l.apply(&mut s, t + 100_000, 1);
    assert!(!d.allowed);
    assert_eq!(us(d.retry_after), Some(500_000));
    assert!(l.apply(&mut s, 8 * SEC, 3).allowed, "the next window starts at 8s, not 8.4s");
}

#[test]
fn hits_zero_is_a_peek_that_consumes_nothing() {
    for a in [Algorithm::FixedWindow, Algorithm::SlidingLog, Algorithm::Gcra { burst: None }] {
        let l = limit(a, 2, SEC);
        let mut s = State::default();
        assert!(l.apply(&mut s, 0, 2).allowed);
        let peek = l.apply(&mut s, 1, 0);
        assert!(peek.allowed, "{a:?}: a peek is always allowed");
        assert_eq!(peek.remaining, 0);
        assert_eq!(peek.retry_after, None);
        assert!(!l.apply(&mut s, 1, 1).allowed);
    }
}

#[test]
fn hits_above_capacity_are_denied_without_retry() {
    for a in [
        Algorithm::FixedWindow,
        Algorithm::SlidingLog,
        Algorithm::SlidingWindow,
        Algorithm::SlidingBuckets { granularity: 10 },
        Algorithm::Gcra { burst: Some(4) },
        Algorithm::LeakyBucket { burst: Some(3), mode: LeakyMode::Shape },
    ] {
        let l = limit(a, 4, SEC);
        let mut s = State::default();
        let d = l.apply(&mut s, 0, 5);
        assert!(!d.allowed, "{a:?}");
        assert_eq!(d.retry_after, None, "{a:?}: no wait can help");
        assert_eq!(d.remaining, 4, "{a:?}: nothing was consumed");
        let d = l.apply(&mut s, 0, u64::MAX);
        assert!(!d.allowed && d.retry_after.is_none(), "{a:?}: u64::MAX hits");
    }
}

#[test]
fn limit_zero_denies_everything() {
    let l = limit(Algorithm::Gcra { burst: None }, 0, SEC);
    let mut s = State::default();
    let d = l.apply(&mut s, 5, 1);
    assert!(!d.allowed);
    assert_eq!((d.remaining, d.retry_after, d.reset_after), (0, None, Duration::ZERO));
    assert!(l.apply(&mut s, 5, 0).allowed);
}

#[test]
fn gcra_emission_interval_is_an_exact_fraction() {
    // 3 per second: T = 333 333 + 1/3 µs. Rounding T would drift by a
    // microsecond every three requests.
    let l = limit(Algorithm::Gcra { burst: Some(3_000) }, 3, SEC);
    let mut s = State::default();
    for _ in 0..3_000 {
        assert!(l.apply(&mut s, 0, 1).allowed);
    }
    // 3000 emission intervals are exactly 1000 s; T rounded down would give
    // 999.999 s, rounded up 1000.001 s.
    let d = l.apply(&mut s, 0, 1);
    assert_eq!(d.reset_after, Duration::from_secs(1_000));
    assert_eq!(us(d.retry_after), Some(333_334), "ceil(T)");
    let d = l.apply(&mut s, 333_333, 1);
    assert!(!d.allowed, "T = 333 333.33 µs: one microsecond early");
    assert!(l.apply(&mut s, 333_334, 1).allowed);
}

#[test]
fn gcra_allows_the_burst_then_the_rate() {
    let l = limit(Algorithm::TokenBucket { burst: Some(5) }, 10, SEC);
    let mut s = State::default();
    for left in (0..5).rev() {
        assert_eq!(l.apply(&mut s, 0, 1).remaining, left);
    }
    let d = l.apply(&mut s, 0, 1);
    assert_eq!(us(d.retry_after), Some(100_000));
    assert_eq!(d.reset_after, Duration::from_millis(500));
    assert!(!l.apply(&mut s, 99_999, 1).allowed);
    assert!(l.apply(&mut s, 100_000, 1).allowed);
    // Weighted: 3 units need 3 tokens.
    let d = l.apply(&mut s, 200_000, 3);
    assert_eq!(us(d.retry_after), Some(200_000));
}

#[test]
fn leaky_shaper_delays_instead_of_denying() {
    // 2 per second, queue of 2: one now, two queued at 0.5 s and 1 s.
    let l = limit(Algorithm::LeakyBucket { burst: Some(2), mode: LeakyMode::Shape }, 2, SEC);
    let mut s = State::default();
    let delays: Vec<_> = (0..3).map(|_| l.apply(&mut s, 0, 1)).map(|d| (d.allowed, d.delay)).collect();
    assert_eq!(delays, [(true, Duration::ZERO), (true, Duration::from_millis(500)), (true, Duration::from_secs(1))]);
    let d = l.apply(&mut s, 0, 1);
    assert!(!d.allowed);
    assert_eq!(us(d.retry_after), Some(500_000));
    assert_eq!(d.delay, Duration::ZERO);
}

#[test]
fn sliding_window_weights_the_previous_window() {
    let l = limit(Algorithm::SlidingWindow, 10, SEC);
    let mut s = State::default();
    assert!(l.apply(&mut s, 0, 10).allowed);
    // 25% into the next window, 75% of the previous 10 still count: 7.5.
    let d = l.apply(&mut s, SEC + 250_000, 2);
    assert!(d.allowed);
    assert_eq!(d.remaining, 0, "floor(10 - 7.5 - 2)");
    let d = l.apply(&mut s, SEC + 250_000, 1);
    assert!(!d.allowed);
    // Needs the previous window's weight to fall to 7 of 10: at 30%.
    assert_eq!(us(d.retry_after), Some(50_000));
}

#[test]
fn sliding_log_waits_for_the_oldest_entries() {
    let l = limit(Algorithm::SlidingLog, 3, SEC);
    let mut s = State::default();
    assert!(l.apply(&mut s, 100, 1).allowed);
    assert!(l.apply(&mut s, 200, 2).allowed);
    let d = l.apply(&mut s, 300, 2);
    // The first entry (1 hit) leaving is not enough; the second (2 hits) is.
    assert_eq!(us(d.retry_after), Some(200 + SEC - 300));
    assert_eq!(d.reset_after, Duration::from_micros(200 + SEC - 300));
}

#[test]
fn sliding_buckets_drop_whole_buckets() {
    let l = limit(Algorithm::SlidingBuckets { granularity: 4 }, 4, SEC);
    let mut s = State::default();
    assert!(l.apply(&mut s, 0, 2).allowed);
    assert!(l.apply(&mut s, 600_000, 2).allowed);
    let d = l.apply(&mut s, 700_000, 1);
    assert!(!d.allowed);
    // Bucket 0 (2 hits) leaves when bucket 4 begins, at 1 s.
    assert_eq!(us(d.retry_after), Some(300_000));
    assert!(l.apply(&mut s, SEC, 2).allowed);
}

#[test]
fn extreme_values_do_not_overflow() {
    let year = 365 * 86_400 * SEC;
    let far = u64::MAX - 10 * year;
    for a in [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingBuckets { granularity: 3_600 },
        Algorithm::Gcra { burst: None },
        Algorithm::LeakyBucket { burst: None, mode: LeakyMode::Shape },
    ] {
        for (lim, w) in [(MAX_LIMIT, year), (MAX_LIMIT, 1_000), (1, year), (1, 3_600_000)] {
            let Ok(l) = Limit::new(a, lim, Duration::from_micros(w)) else {
                continue; // granularity that does not divide the window
            };
            for now in [0, 1, far, u64::MAX / 2] {
                let mut s = State::default();
                for hits in [0, 1, lim, lim, u64::MAX] {
                    let d = l.apply(&mut s, now, hits);
                    assert!(d.remaining <= lim.max(l.burst()) + 1, "{a:?} {lim} {w} {now} {hits}: {d:?}");
                }
            }
        }
    }
}

#[test]
fn a_state_written_by_another_algorithm_starts_fresh() {
    let fixed = limit(Algorithm::FixedWindow, 1, SEC);
    let gcra = limit(Algorithm::Gcra { burst: None }, 1, SEC);
    let mut s = State::default();
    assert!(fixed.apply(&mut s, 0, 1).allowed);
    assert!(gcra.apply(&mut s, 0, 1).allowed);
    assert!(!gcra.apply(&mut s, 0, 1).allowed);
}
