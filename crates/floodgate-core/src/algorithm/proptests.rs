//! Property tests of every algorithm against a brute-force reference model on
//! a manual clock.
//!
//! The models are written from the definitions in DESIGN.md, independently of
//! the implementations: each is a function of the history of admitted
//! `(time, hits)` and answers "would `hits` be allowed at `t`?". The GCRA
//! family is checked against a token bucket with exact scaled tokens (a
//! different formulation from the implementation's theoretical arrival time).
//! `remaining`, `retry_after` and `reset_after` are then checked by brute
//! force: scanning every unit and every microsecond. Tiny windows (1–12 µs)
//! make that scan cheap; a second test checks the same at real scale
//! (epoch-sized times, windows up to a year, limits up to 2^53 - 1) by
//! probing the exact boundary: allowed at `now + retry`, not at one less.

use proptest::prelude::*;

use crate::{Algorithm, Charge, Decision, LeakyMode, Limit, MAX_LIMIT, State};

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Fixed,
    Log,
    Sliding,
    Buckets(u32),
    Gcra(u64),
    Token(u64),
    Meter(u64),
    Shaper(u64),
}

impl Kind {
    fn algorithm(self) -> Algorithm {
        match self {
            Kind::Fixed => Algorithm::FixedWindow,
            Kind::Log => Algorithm::SlidingLog,
            Kind::Sliding => Algorithm::SlidingWindow,
            Kind::Buckets(g) => Algorithm::SlidingBuckets { granularity: g },
            Kind::Gcra(b) => Algorithm::Gcra { burst: Some(b) },
            Kind::Token(b) => Algorithm::TokenBucket { burst: Some(b) },
            Kind::Meter(b) => Algorithm::LeakyBucket { burst: Some(b), mode: LeakyMode::Meter },
            Kind::Shaper(b) => Algorithm::LeakyBucket { burst: Some(b), mode: LeakyMode::Shape },
        }
    }
}

/// The reference model: the definition, evaluated over the admitted history.
struct Model {
    kind: Kind,
    l: u64,
    w: u64,
    /// Admitted `(time, hits)`; for `fixed_window` and the GCRA family a
    /// refund is a negative entry (the sliding ones take refunds out of the
    /// entries instead).
    hist: Vec<(u64, i128)>,
}

impl Model {
    fn capacity(&self) -> u64 {
        match self.kind {
            Kind::Fixed | Kind::Log | Kind::Sliding | Kind::Buckets(_) => self.l,
            Kind::Gcra(b) | Kind::Token(b) | Kind::Meter(b) => b,
            Kind::Shaper(b) => b + 1,
        }
    }

    fn sum(&self, keep: impl Fn(u64) -> bool) -> u128 {
        self.hist.iter().filter(|(t, _)| keep(*t)).map(|&(_, h)| u128::try_from(h).expect("a count")).sum()
    }

    /// Whether hits taken at `ti` still count at `t` (window algorithms).
    fn counts(&self, ti: u64, t: u64) -> bool {
        let w = self.w;
        match self.kind {
            Kind::Fixed => ti / w == t / w,
            Kind::Log => ti + w > t,
            Kind::Buckets(g) => {
                let size = w / u64::from(g);
                ti / size + u64::from(g) > t / size
            }
            // The current window and the one before.
            Kind::Sliding => ti / w + 1 >= t / w,
            _ => unreachable!("a window algorithm"),
        }
    }

    /// A refund at `t`, by the definition: window algorithms give back the
    /// newest hits that still count, never below zero; the GCRA family
    /// gains `hits` tokens, never beyond its capacity.
    fn give_back(&mut self, t: u64, hits: u64) {
        if self.l == 0 {
            return;
        }
        if let Kind::Fixed | Kind::Gcra(_) | Kind::Token(_) | Kind::Meter(_) | Kind::Shaper(_) = self.kind {
            self.hist.push((t, -i128::from(hits)));
            return;
        }
        let mut left = i128::from(hits);
        for i in (0..self.hist.len()).rev() {
            if left == 0 {
                break;
            }
            if self.counts(self.hist[i].0, t) {
                let take = left.min(self.hist[i].1);
                self.hist[i].1 -= take;
                left -= take;
            }
        }
    }

    /// A late charge at `t` (never denied): recorded like an admission,
    /// except that `sliding_log` keeps at most `l` entries: on a full log
    /// the charge joins the newest entry, stamped `t`.
    fn charge(&mut self, t: u64, hits: u64) {
        if self.l == 0 {
            return;
        }
        if self.kind == Kind::Log {
            let live: Vec<usize> =
                (0..self.hist.len()).filter(|&i| self.hist[i].1 > 0 && self.counts(self.hist[i].0, t)).collect();
            let mut times: Vec<u64> = live.iter().map(|&i| self.hist[i].0).collect();
            times.dedup();
            if times.len() as u64 >= self.l {
                let newest = times[times.len() - 1];
                let mut moved = i128::from(hits);
                for i in live {
                    if self.hist[i].0 == newest {
                        moved += self.hist[i].1;
                        self.hist[i].1 = 0;
                    }
                }
                self.hist.push((t, moved));
                return;
            }
        }
        self.hist.push((t, i128::from(hits)));
    }

    /// `fixed_window`'s count at `t`: each window's hits, plus what is left
    /// of the count before it after paying `l` per window passed; refunds
    /// (negative entries) never below zero.
    fn fixed_count(&self, t: u64) -> u128 {
        let (w, l) = (self.w, i128::from(self.l));
        let mut c: i128 = 0;
        let mut window = None;
        for &(ti, hi) in self.hist.iter().filter(|(ti, _)| *ti <= t) {
            let id = ti / w;
            if let Some(p) = window {
                c = (c - l * i128::from(id - p)).max(0);
            }
            window = Some(id);
            c = (c + hi).max(0);
        }
        if let Some(p) = window {
            c = (c - l * i128::from(t / w - p)).max(0);
        }
        u128::try_from(c).expect("a count")
    }

    /// Tokens at `t`, scaled by W (exact): a bucket of `capacity` refilled
    /// at `l` per `w`, starting full, paying `hits` for each admission
    /// (below zero for a late charge: debt).
    fn tokens(&self, t: u64) -> i128 {
        let (l, w) = (i128::from(self.l), i128::from(self.w));
        let cap = i128::from(self.capacity()) * w;
        let mut ts = cap;
        let mut last: Option<u64> = None;
        for &(ti, hi) in &self.hist {
            if let Some(lt) = last {
                ts = cap.min(ts + i128::from(ti - lt) * l);
            }
            ts = cap.min(ts - hi * w);
            last = Some(ti);
        }
        if let Some(lt) = last {
            ts = cap.min(ts + i128::from(t - lt) * l);
        }
        ts
    }

    /// (weighted usage numerator, cap numerator) of sliding_window at t.
    fn sliding(&self, t: u64) -> (u128, u128, u128) {
        let w = self.w;
        let id = t / w;
        let e = u128::from(t - id * w);
        let prev = if id == 0 { 0 } else { self.sum(|ti| ti / w == id - 1) };
        let cur = self.sum(|ti| ti / w == id);
        (prev, cur, e)
    }

    fn allows(&self, t: u64, h: u64) -> bool {
        if h == 0 {
            return true;
        }
        if self.l == 0 {
            return false;
        }
        let (w, h128, l128) = (self.w, u128::from(h), u128::from(self.l));
        match self.kind {
            Kind::Fixed => self.fixed_count(t) + h128 <= l128,
            Kind::Log | Kind::Buckets(_) => self.sum(|ti| self.counts(ti, t)) + h128 <= l128,
            Kind::Sliding => {
                let (prev, cur, e) = self.sliding(t);
                let w = u128::from(w);
                prev * (w - e) + (cur + h128) * w <= l128 * w
            }
            _ => self.tokens(t) >= i128::from(h) * i128::from(w),
        }
    }

    fn empty(&self, t: u64) -> bool {
        let w = self.w;
        match self.kind {
            Kind::Fixed => self.fixed_count(t) == 0,
            Kind::Log | Kind::Buckets(_) => self.sum(|ti| self.counts(ti, t)) == 0,
            Kind::Sliding => {
                let (prev, cur, _) = self.sliding(t);
                prev == 0 && cur == 0
            }
            _ => self.l == 0 || self.tokens(t) == i128::from(self.capacity()) * i128::from(w),
        }
    }

    fn remaining(&self, t: u64) -> u64 {
        if self.l == 0 {
            return 0;
        }
        (1..=self.capacity() + 1).take_while(|&k| self.allows(t, k)).last().unwrap_or(0)
    }

    fn delay(&self, t: u64) -> u64 {
        let cap = i128::from(self.capacity()) * i128::from(self.w);
        let backlog = u128::try_from(cap - self.tokens(t)).expect("a shaper has no debt");
        u64::try_from(backlog.div_ceil(u128::from(self.l))).unwrap()
    }
}

/// How a decision was asked for.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Asked {
    /// `apply` of a limit charged before the work (hits 0: a peek).
    Before,
    /// `apply` of a limit charged after: a late charge, or (hits 0) the gate.
    After,
}

/// Check one decision against the model by brute force; commit it.
fn check(model: &mut Model, d: &Decision, now: u64, hits: u64, asked: Asked) {
    let gate = asked == Asked::After && hits == 0;
    let late = asked == Asked::After && hits > 0;
    let allowed = if gate { model.l > 0 && model.allows(now, 1) } else { late || model.allows(now, hits) };
    assert_eq!(d.allowed, allowed, "allowed at {now} hits {hits}, history {:?}", model.hist);
    assert_eq!(d.limit, model.l);
    if let Kind::Shaper(_) = model.kind
        && allowed
        && hits > 0
    {
        assert_eq!(d.delay.as_micros(), u128::from(model.delay(now)), "delay at {now}");
    } else {
        assert_eq!(d.delay, std::time::Duration::ZERO);
    }
    if late {
        model.charge(now, hits);
    } else if allowed && hits > 0 {
        model.hist.push((now, i128::from(hits)));
    }
    assert_eq!(d.remaining, model.remaining(now), "remaining at {now}, history {:?}", model.hist);
    let wanted = if gate { 1 } else { hits };
    let retry = if allowed || wanted > model.capacity() || model.l == 0 {
        None
    } else {
        Some((1..100_000).find(|&dt| model.allows(now + dt, wanted)).expect("some wait helps"))
    };
    assert_eq!(d.retry_after_us(), retry, "retry_after at {now} hits {hits}, history {:?}", model.hist);
    let reset = (0..100_000).find(|&dt| model.empty(now + dt)).expect("state empties");
    assert_eq!(d.reset_after_us(), reset, "reset_after at {now}, history {:?}", model.hist);
}

fn kind_strategy() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Fixed),
        Just(Kind::Log),
        Just(Kind::Sliding),
        (1u32..=4).prop_map(Kind::Buckets),
        (1u64..=8).prop_map(Kind::Gcra),
        (1u64..=8).prop_map(Kind::Token),
        (1u64..=8).prop_map(Kind::Meter),
        (1u64..=8).prop_map(Kind::Shaper),
    ]
}

/// Run `ops` (`(dt, hits, refund)`) through the algorithm and its model,
/// the limit charged `charge`.
fn run(kind: Kind, l: u64, w: u64, start: u64, ops: &[(u64, u64, bool)], charge: Charge) {
    // Buckets need a window the granularity divides.
    let w = match kind {
        Kind::Buckets(g) => w * u64::from(g),
        _ => w,
    };
    let limit = Limit::checked(kind.algorithm(), l, w).unwrap().with_charge(charge).unwrap();
    let asked = if charge == Charge::After { Asked::After } else { Asked::Before };
    let mut model = Model { kind, l, w, hist: Vec::new() };
    let mut state = State::default();
    let mut now = start;
    for &(dt, hits, refund) in ops {
        now += dt;
        if refund {
            let d = limit.give_back(&mut state, now, hits);
            model.give_back(now, hits);
            check(&mut model, &d, now, 0, Asked::Before);
            continue;
        }
        let before = state.clone();
        let d = limit.apply(&mut state, now, hits);
        if !d.allowed {
            assert_eq!(
                normalised(&limit, before, now),
                normalised(&limit, state.clone(), now),
                "a denial changed state"
            );
        }
        check(&mut model, &d, now, hits, asked);
    }
}

/// Two states are the same state if they answer every future question alike;
/// compare their answers to a peek, which is every observable.
fn normalised(limit: &Limit, mut s: State, now: u64) -> Decision {
    limit.apply(&mut s, now, 0)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

    #[test]
    fn every_algorithm_matches_its_reference_model(
        kind in kind_strategy(),
        l in 0u64..=6,
        w in 1u64..=12,
        start in 0u64..40,
        ops in prop::collection::vec((0u64..=14, 0u64..=5), 1..40),
    ) {
        let ops: Vec<_> = ops.into_iter().map(|(dt, h)| (dt, h, false)).collect();
        run(kind, l, w, start, &ops, Charge::Before);
    }

    /// Refunds (Envoy's `is_negative_hits`) among the requests: each gives
    /// back what the definition says ([`Limit::give_back`]) and answers as a
    /// peek does afterwards.
    #[test]
    fn refunds_match_the_reference_model(
        kind in kind_strategy(),
        l in 0u64..=6,
        w in 1u64..=12,
        start in 0u64..40,
        ops in prop::collection::vec((0u64..=14, 0u64..=5, prop::bool::weighted(0.3)), 1..40),
    ) {
        run(kind, l, w, start, &ops, Charge::Before);
    }

    /// A limit charged after the work: late charges (never denied, into
    /// debt), gates (hits 0: denied once nothing is left) and refunds, each
    /// as the definition says — `fixed_window` carries debt into the next
    /// windows, the GCRA family drains it at the rate, the sliding ones
    /// count a charge while it stays in their window.
    #[test]
    fn late_charges_and_gates_match_the_reference_model(
        kind in kind_strategy().prop_filter("a shaper is charged before", |k| !matches!(k, Kind::Shaper(_))),
        l in 0u64..=6,
        w in 1u64..=12,
        start in 0u64..40,
        ops in prop::collection::vec((0u64..=14, 0u64..=9, prop::bool::weighted(0.15)), 1..40),
    ) {
        run(kind, l, w, start, &ops, Charge::After);
    }

    #[test]
    fn gcra_token_bucket_and_leaky_meter_agree(
        l in 1u64..=1_000,
        w_ms in 1u64..=10_000,
        burst in 1u64..=50,
        start in 0u64..1_000_000_000,
        ops in prop::collection::vec((0u64..=200_000, 0u64..=60), 1..80),
    ) {
        let w = Limit::checked(Algorithm::FixedWindow, 1, w_ms * 1000).unwrap().window();
        let limits = [
            Limit::new(Algorithm::Gcra { burst: Some(burst) }, l, w).unwrap(),
            Limit::new(Algorithm::TokenBucket { burst: Some(burst) }, l, w).unwrap(),
            Limit::new(Algorithm::LeakyBucket { burst: Some(burst), mode: LeakyMode::Meter }, l, w).unwrap(),
        ];
        let mut states = [State::default(), State::default(), State::default()];
        let mut now = start;
        for (dt, hits) in ops {
            now += dt;
            let d: Vec<Decision> = limits.iter().zip(states.iter_mut()).map(|(l, s)| l.apply(s, now, hits)).collect();
            prop_assert_eq!(d[0], d[1]);
            prop_assert_eq!(d[0], d[2]);
        }
    }

    /// At real scale, probe the boundaries instead of scanning: the request is
    /// allowed exactly `retry_after` later and not a microsecond sooner; the
    /// state is empty exactly `reset_after` later and not sooner.
    #[test]
    fn boundaries_are_exact_at_scale(
        kind in prop_oneof![
            Just(Kind::Fixed), Just(Kind::Sliding), Just(Kind::Log),
            prop_oneof![Just(10u32), Just(60), Just(3600)].prop_map(Kind::Buckets),
            prop_oneof![1u64..=100, 1u64..=MAX_LIMIT].prop_map(Kind::Gcra),
            (1u64..=1_000_000).prop_map(Kind::Shaper),
        ],
        l in prop_oneof![1u64..=10, 1u64..=10_000, 1u64..=MAX_LIMIT],
        w in prop_oneof![Just(1_000u64), Just(1_000_000), Just(86_400_000_000), Just(31_536_000_000_000), 1_000u64..=31_536_000_000_000],
        start in 1_700_000_000_000_000u64..1_900_000_000_000_000,
        ops in prop::collection::vec((0u64..=2_000_000, prop_oneof![0u64..=3, 0u64..=MAX_LIMIT]), 1..12),
    ) {
        let l = if kind == Kind::Log { l.min(crate::MAX_LOG_LIMIT) } else { l };
        let w = match kind {
            Kind::Buckets(g) => (w / u64::from(g)).max(1) * u64::from(g),
            _ => w,
        };
        let limit = Limit::checked(kind.algorithm(), l, w);
        prop_assume!(!matches!(limit, Err(crate::LimitError::RefillTooLong { .. })));
        let limit = limit.unwrap();
        let mut model = Model { kind, l, w, hist: Vec::new() };
        let mut state = State::default();
        let mut now = start;
        for (dt, hits) in ops {
            now += dt;
            let d = limit.apply(&mut state, now, hits);
            prop_assert_eq!(d.allowed, model.allows(now, hits));
            if d.allowed && hits > 0 {
                model.hist.push((now, i128::from(hits)));
            }
            let rem = d.remaining;
            prop_assert!(rem == 0 || model.allows(now, rem), "remaining {} not admissible", rem);
            prop_assert!(!model.allows(now, rem + 1), "remaining {} is not the most", rem);
            match d.retry_after_us() {
                Some(r) => {
                    prop_assert!(!d.allowed);
                    prop_assert!(model.allows(now + r, hits), "not allowed after retry_after {}", r);
                    prop_assert!(!model.allows(now + r - 1, hits), "allowed before retry_after {}", r);
                }
                None => prop_assert!(d.allowed || hits > model.capacity()),
            }
            let reset = d.reset_after_us();
            prop_assert!(model.empty(now + reset), "not empty after reset_after {}", reset);
            prop_assert!(reset == 0 || !model.empty(now + reset - 1), "empty before reset_after {}", reset);
        }
    }
}

fn window_for(kind: Kind, w: u64) -> u64 {
    match kind {
        Kind::Buckets(g) => w * u64::from(g),
        _ => w,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1_000, ..ProptestConfig::default() })]

    /// A request refunded right after it was admitted leaves no trace: every
    /// later decision is the one it would have been without it.
    #[test]
    fn a_refund_right_away_undoes_the_request(
        kind in kind_strategy(),
        l in 1u64..=6,
        w in 1u64..=12,
        start in 0u64..40,
        ops in prop::collection::vec((0u64..=14, 0u64..=5, prop::option::of(1u64..=5)), 1..40),
    ) {
        let limit = Limit::checked(kind.algorithm(), l, window_for(kind, w)).unwrap();
        let (mut a, mut b) = (State::default(), State::default());
        let mut now = start;
        for (dt, hits, extra) in ops {
            now += dt;
            if let Some(e) = extra && limit.apply(&mut b, now, e).allowed {
                limit.refund(&mut b, now, now, e);
            }
            prop_assert_eq!(limit.apply(&mut a, now, hits), limit.apply(&mut b, now, hits), "at {}", now);
        }
    }

    /// A refund that comes late (other requests in between, time passing)
    /// never leaves more room than the request took: until the two histories
    /// part, the one with the refunded request admits nothing the one without
    /// it would not.
    #[test]
    fn a_late_refund_never_gives_more_than_it_took(
        kind in kind_strategy(),
        l in 1u64..=6,
        w in 1u64..=12,
        start in 0u64..40,
        extra in 1u64..=5,
        refund_after in 0usize..6,
        ops in prop::collection::vec((0u64..=14, 0u64..=5), 1..30),
    ) {
        let limit = Limit::checked(kind.algorithm(), l, window_for(kind, w)).unwrap();
        let (mut a, mut b) = (State::default(), State::default());
        let mut now = start;
        let taken = limit.apply(&mut b, now, extra).allowed;
        for (i, (dt, hits)) in ops.into_iter().enumerate() {
            now += dt;
            if taken && i == refund_after {
                limit.refund(&mut b, start, now, extra);
            }
            let (pa, pb) = (limit.apply(&mut a, now, 0), limit.apply(&mut b, now, 0));
            prop_assert!(pb.remaining <= pa.remaining, "more room after the refund at {}: {:?} vs {:?}", now, pb, pa);
            let (da, db) = (limit.apply(&mut a, now, hits), limit.apply(&mut b, now, hits));
            if da.allowed != db.allowed {
                prop_assert!(da.allowed, "admitted only with the refund at {}", now);
                break;
            }
        }
    }
}

#[test]
fn clock_stepping_back_never_rewinds_state() {
    for kind in [Kind::Fixed, Kind::Log, Kind::Sliding, Kind::Buckets(4), Kind::Gcra(3), Kind::Shaper(3)] {
        let limit = Limit::checked(kind.algorithm(), 3, 1_000).unwrap();
        let mut state = State::default();
        let mut admitted = 0;
        for _ in 0..10 {
            admitted += u64::from(limit.apply(&mut state, 10_500, 1).allowed);
        }
        // Times before the ones already seen admit nothing more.
        for t in [10_400, 10_000, 9_999, 5_000, 0] {
            admitted += u64::from(limit.apply(&mut state, t, 1).allowed);
        }
        assert_eq!(admitted, limit.burst().max(3) + u64::from(matches!(kind, Kind::Shaper(_))), "{kind:?}");
    }
}
