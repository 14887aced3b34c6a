//! The limiter: decides every limit one request matched, against one store,
//! all or nothing, and applies each rule's failure policy when the store
//! cannot answer. Every adapter (RLS, HTTP, proxy, tower) goes through it, so
//! policy lives here once.

use std::time::Duration;

use crate::reservation::{ReservationError, ReservationId};
use crate::rules::cost::Cost;
use crate::rules::{FailureMode, Rule};
use crate::store::{Check, Op};
use crate::{Decision, Limit, MemoryStore, Store, StoreError};

/// One matched rule to decide for a request.
#[derive(Debug, Clone, Copy)]
pub struct RuleCheck<'a> {
    /// The counter key.
    pub key: &'a str,
    /// The rule (its limit, shadow mode and failure policy).
    pub rule: &'a Rule,
    /// Units to take (0 = peek), or to give back.
    pub hits: u64,
    /// Whether the check takes or gives back.
    pub op: Op,
}

/// What one rule decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// The decision; `None` for an `unlimited` rule.
    pub decision: Option<Decision>,
    /// The rule is in shadow mode: a denial is reported, never enforced.
    pub shadow: bool,
    /// The store failed and the rule's failure policy made the decision.
    pub failure: Option<(StoreError, FailureMode)>,
}

impl Verdict {
    /// Whether this rule denies the request (not in shadow mode, denied).
    pub fn denies(&self) -> bool {
        !self.shadow && self.over_limit()
    }

    /// Whether the limit said no (shadow or not).
    pub fn over_limit(&self) -> bool {
        self.decision.is_some_and(|d| !d.allowed)
    }
}

/// The request's answer: allowed iff no enforced rule denied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Whether the request may go ahead.
    pub allowed: bool,
    /// One verdict per check, in order.
    pub verdicts: Vec<Verdict>,
}

impl Outcome {
    /// The outcome borrowed (what its other methods read).
    pub fn view(&self) -> OutcomeView<'_> {
        OutcomeView { allowed: self.allowed, verdicts: &self.verdicts }
    }

    /// See [`OutcomeView::headline`].
    pub fn headline(&self) -> Option<&Decision> {
        self.view().headline()
    }

    /// See [`OutcomeView::headline_index`].
    pub fn headline_index(&self) -> Option<usize> {
        self.view().headline_index()
    }

    /// See [`OutcomeView::delay`].
    pub fn delay(&self) -> Duration {
        self.view().delay()
    }

    /// See [`OutcomeView::retry_after`].
    pub fn retry_after(&self) -> Option<Duration> {
        self.view().retry_after()
    }
}

/// A request's answer over borrowed verdicts: an [`Outcome`]'s, or one
/// verdict held elsewhere (with `std::slice::from_ref`).
#[derive(Debug, Clone, Copy)]
pub struct OutcomeView<'a> {
    /// Whether the request may go ahead.
    pub allowed: bool,
    /// One verdict per check, in order.
    pub verdicts: &'a [Verdict],
}

impl<'a> OutcomeView<'a> {
    /// The decision the rate-limit headers describe: that of
    /// [`most_restrictive`] among all the verdicts. `None` when no limited
    /// rule applied.
    pub fn headline(&self) -> Option<&'a Decision> {
        self.headline_index().and_then(|i| self.verdicts[i].decision.as_ref())
    }

    /// The index of the verdict [`OutcomeView::headline`] describes.
    pub fn headline_index(&self) -> Option<usize> {
        if let [one] = self.verdicts {
            return one.decision.is_some().then_some(0);
        }
        most_restrictive(self.verdicts)
    }

    /// For an allowed request: how long to hold it before passing it on,
    /// the longest `delay` of its shaping limits (zero without any).
    pub fn delay(&self) -> Duration {
        if !self.allowed {
            return Duration::ZERO;
        }
        self.verdicts.iter().filter_map(|v| v.decision.map(|d| d.delay)).max().unwrap_or_default()
    }

    /// `Retry-After` for a denied request: the largest wait among the denying
    /// limits, `None` when allowed or when one of them has no wait that
    /// helps (the request is larger than that limit's capacity).
    pub fn retry_after(&self) -> Option<Duration> {
        if self.allowed {
            return None;
        }
        let mut max = Duration::ZERO;
        for v in self.verdicts.iter().filter(|v| v.denies()) {
            max = max.max(v.decision?.retry_after?);
        }
        Some(max)
    }
}

/// The verdict of a check whose rule has no limit (`unlimited: true`).
fn unlimited(c: &RuleCheck<'_>) -> Verdict {
    Verdict { decision: None, shadow: c.rule.shadow_mode, failure: None }
}

/// The store's checks of `checks`: those with a limit, in order.
fn store_checks<'a>(checks: &[RuleCheck<'a>]) -> Vec<Check<'a>> {
    checks
        .iter()
        .filter_map(|c| {
            let limit = c.rule.limit.as_ref()?;
            Some(Check { key: c.key, limit, hits: c.hits, op: c.op, enforce: !c.rule.shadow_mode, scope: c.rule.scope })
        })
        .collect()
}

/// The position of the most restrictive of `verdicts`: a denying one if any
/// deny, then the least `remaining`, then the longest reset (ties: the
/// first). Verdicts without a decision (unlimited rules) are never chosen.
pub fn most_restrictive<'a>(verdicts: impl IntoIterator<Item = &'a Verdict>) -> Option<usize> {
    verdicts
        .into_iter()
        .enumerate()
        .filter_map(|(i, v)| v.decision.map(|d| ((!v.denies(), d.remaining, std::cmp::Reverse(d.reset_after)), i)))
        .min_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, i)| i)
}

/// Decides requests against a store, with an in-memory store for rules whose
/// failure policy is `local`.
#[derive(Debug)]
pub struct Limiter<S> {
    store: S,
    local: MemoryStore,
    leases: LeaseIds,
}

/// Lease ids: unique in this process (a seeded bijective mix of a counter)
/// and never 0 (the anonymous lease). Not a secret: one id reveals the
/// others, and a release without an id frees a lease of its key anyway.
#[derive(Debug)]
struct LeaseIds {
    seed: u64,
    next: std::sync::atomic::AtomicU64,
}

impl LeaseIds {
    fn new() -> Self {
        use std::hash::BuildHasher;
        let seed = foldhash::fast::RandomState::default().hash_one(std::time::SystemTime::now());
        Self { seed, next: std::sync::atomic::AtomicU64::new(1) }
    }

    /// splitmix64 of the seeded counter: a bijection, so ids repeat only
    /// after 2^64 of them.
    fn next(&self) -> u64 {
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut z = self.seed.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)).max(1)
    }
}

/// A metered request's outcome ([`Limiter::meter`]): its reservation, or
/// the slots it holds.
#[derive(Debug)]
pub struct Metered {
    /// The decision.
    pub outcome: Outcome,
    /// The reservation to settle (`None`: nothing kept).
    pub reservation: Option<ReservationId>,
    /// The slots held on concurrency limits, to release when the response
    /// ends.
    pub held: Option<Held>,
}

/// The slots a request holds on its concurrency limits (lease `lease` on
/// each counter key and limit in `parts`), released by
/// [`Limiter::release`] when its work ends, or by themselves when their
/// lease does.
#[derive(Debug, Clone, PartialEq)]
pub struct Held {
    /// The lease's id.
    pub lease: u64,
    /// The counter key and limit of each concurrency limit that took a slot.
    pub parts: Vec<(String, Limit)>,
}

impl Held {
    /// The slots `checks` took as lease `lease` (their ops set by
    /// [`acquire_ops`]), given their `outcome`: when the request is allowed,
    /// the concurrency limits the store answered and allowed (a denied
    /// request holds none: all or nothing). `None` when they took none.
    pub fn of(lease: u64, checks: &[RuleCheck<'_>], outcome: &Outcome) -> Option<Held> {
        if !outcome.allowed {
            return None;
        }
        let parts: Vec<(String, Limit)> = checks
            .iter()
            .zip(&outcome.verdicts)
            .filter(|(c, v)| {
                matches!(c.op, Op::Acquire { .. }) && v.failure.is_none() && v.decision.is_some_and(|d| d.allowed)
            })
            .filter_map(|(c, _)| {
                Some((c.key.to_owned(), c.rule.limit.as_ref().filter(|l| l.is_concurrency())?.clone()))
            })
            .collect();
        (!parts.is_empty()).then_some(Held { lease, parts })
    }
}

/// When some of `checks` is a concurrency limit: every check that takes
/// acquires one new lease (its id from `new_id`, asked only then) instead
/// ([`Op::Acquire`]: a rate beside it takes as usual, all or nothing), and
/// the answer is that id and the shortest `lease_ttl` among them. `None`
/// (and nothing changed) without one.
pub fn acquire_ops(checks: &mut [RuleCheck<'_>], new_id: impl FnOnce() -> u64) -> Option<(u64, Duration)> {
    let ttl =
        checks.iter().filter_map(|c| c.rule.limit.as_ref().filter(|l| l.is_concurrency())).map(Limit::window).min()?;
    let lease = new_id();
    for c in checks.iter_mut().filter(|c| c.op == Op::Take && c.hits > 0) {
        c.op = Op::Acquire { lease };
    }
    Some((lease, ttl))
}

impl<S: Store> Limiter<S> {
    /// A limiter over `store`; `local` serves `failure_mode: local` rules
    /// while `store` fails.
    pub fn new(store: S, local: MemoryStore) -> Self {
        Self { store, local, leases: LeaseIds::new() }
    }

    /// A new lease id (unique in this process, never 0).
    pub fn next_lease(&self) -> u64 {
        self.leases.next()
    }

    /// Release the slots of `held`. A store that fails leaves them to end
    /// with their lease.
    pub async fn release(&self, held: &Held) {
        let checks: Vec<Check<'_>> = held
            .parts
            .iter()
            .map(|(key, limit)| Check {
                key,
                limit,
                hits: 1,
                op: Op::Release { lease: Some(held.lease) },
                enforce: false,
                scope: crate::region::Scope::Region,
            })
            .collect();
        let mut out = Vec::with_capacity(checks.len());
        self.store.apply_all(&checks, &mut out).await;
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// Decide one request: every check against the store, all or nothing (a
    /// denied request keeps nothing in any counter). When the store fails
    /// for a rule, its failure policy decides: `open` allows, `closed`
    /// denies (with no retry time), `local` asks the in-memory store for the
    /// rule's local share of the limit (and allows if that fails too).
    ///
    /// ```
    /// use floodgate_core::limiter::{Limiter, RuleCheck};
    /// use floodgate_core::rules::RuleSet;
    /// use floodgate_core::{MemoryStore, Op};
    /// let rules = RuleSet::from_yaml("a.yaml", "domain: a\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 1}\n").unwrap();
    /// let m = rules.matches("a", &[("user", "alice")]).unwrap();
    /// let key = m.counter_key(0);
    /// let limiter = Limiter::new(MemoryStore::new(), MemoryStore::new());
    /// let check = [RuleCheck { key: &key, rule: &m.rules[0], hits: 1, op: Op::Take }];
    /// let first = block_on(limiter.check(&check));
    /// assert!(first.allowed);
    /// assert!(!block_on(limiter.check(&check)).allowed);
    /// # fn block_on<F: std::future::Future>(f: F) -> F::Output {
    /// #     let waker = std::task::Waker::noop();
    /// #     let mut cx = std::task::Context::from_waker(&waker);
    /// #     let mut f = std::pin::pin!(f);
    /// #     loop { if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) { return v; } }
    /// # }
    /// ```
    pub async fn check(&self, checks: &[RuleCheck<'_>]) -> Outcome {
        let store_checks = store_checks(checks);
        let mut results = Vec::with_capacity(store_checks.len());
        if !store_checks.is_empty() {
            self.store.apply_all(&store_checks, &mut results).await;
        }
        self.outcome(checks, results)
    }

    /// Reserve: [`Limiter::check`] through [`Store::reserve`], each rule
    /// giving its `reservation_ttl`: the outcome and, when the request is
    /// allowed, the reservation's id (`None` when nothing was kept: a
    /// rule whose store failed, answered by its failure policy, keeps
    /// nothing).
    pub async fn reserve(
        &self,
        checks: &[RuleCheck<'_>],
    ) -> Result<(Outcome, Option<ReservationId>), ReservationError> {
        let store_checks = store_checks(checks);
        let ttls: Vec<u64> = checks
            .iter()
            .filter(|c| c.rule.limit.is_some())
            .map(|c| u64::try_from(c.rule.reservation_ttl.as_micros()).unwrap_or(u64::MAX))
            .collect();
        let mut results = Vec::with_capacity(store_checks.len());
        let id =
            if store_checks.is_empty() { None } else { self.store.reserve(&store_checks, &ttls, &mut results).await? };
        let outcome = self.outcome(checks, results);
        let id = id.filter(|_| outcome.allowed);
        Ok((outcome, id))
    }

    /// Meter a request (the proxy's and the tower layer's): each check whose
    /// rule has a `cost` asks `estimate(cost)`; when one does, the checks
    /// are reserved ([`Limiter::reserve`]); else — or when the store cannot
    /// keep reservations (down, or without support) — they are decided as an
    /// ordinary request, by each rule's failure policy, and nothing is kept.
    ///
    /// A request matching a concurrency limit acquires one lease for it
    /// ([`acquire_ops`]) in the same call, all or nothing: the slots it took
    /// are in [`Metered::held`], to release ([`Limiter::release`]) when its
    /// response ends; its costs are reserved beside them (the slots are no
    /// part of the reservation).
    pub async fn meter(&self, checks: &mut [RuleCheck<'_>], estimate: &(dyn Fn(&Cost) -> u64 + Sync)) -> Metered {
        let mut metered = false;
        for c in checks.iter_mut() {
            if let Some(cost) = &c.rule.cost {
                c.hits = estimate(cost);
                metered = true;
            }
        }
        let lease = acquire_ops(checks, || self.next_lease()).map(|(lease, _)| lease);
        let kept = if metered { self.reserve(checks).await.ok() } else { None };
        let (outcome, reservation) = match kept {
            Some(kept) => kept,
            None => (self.check(checks).await, None),
        };
        let held = lease.and_then(|lease| Held::of(lease, checks, &outcome));
        Metered { outcome, reservation, held }
    }

    /// The outcome of `checks` from the store's `results` for those with a
    /// limit, in order.
    fn outcome(&self, checks: &[RuleCheck<'_>], results: Vec<Result<Decision, StoreError>>) -> Outcome {
        let mut results = results.into_iter();
        let verdicts: Vec<Verdict> = checks
            .iter()
            .map(|c| match c.rule.limit {
                None => unlimited(c),
                Some(_) => self.verdict(c, results.next().expect("the store answers every check")),
            })
            .collect();
        let allowed = !verdicts.iter().any(Verdict::denies);
        Outcome { allowed, verdicts }
    }

    /// The verdict of a check with a limit from the store's result (from a
    /// call of your own, e.g. [`Store::apply_bytes`]): a store failure
    /// goes to the rule's failure policy.
    pub fn verdict(&self, c: &RuleCheck<'_>, result: Result<Decision, StoreError>) -> Verdict {
        let shadow = c.rule.shadow_mode;
        match result {
            Ok(d) => Verdict { decision: Some(d), shadow, failure: None },
            Err(e) => {
                let mode = c.rule.failure_mode;
                let limit = c.rule.limit.as_ref().map_or(0, Limit::limit);
                Verdict { decision: Some(self.fail(c, limit, mode)), shadow, failure: Some((e, mode)) }
            }
        }
    }

    fn fail(&self, c: &RuleCheck<'_>, limit: u64, mode: FailureMode) -> Decision {
        let open = Decision { allowed: true, limit, remaining: limit, ..Decision::default() };
        if !matches!(c.op, Op::Take | Op::Acquire { .. }) {
            // A refund (or a return, a late charge, a release or an extend)
            // the store could not take is lost (the store error is counted
            // and logged by the caller); it denies nothing, whatever the
            // rule's policy. (A concurrency limit never has a local one.)
            return open;
        }
        match mode {
            FailureMode::Open => open,
            FailureMode::Closed => Decision { allowed: false, limit, remaining: 0, ..Decision::default() },
            FailureMode::Local => {
                let local = c.rule.local_limit.as_ref().or(c.rule.limit.as_ref());
                local.and_then(|l| self.local.apply_sync(c.key, l, c.hits).ok()).unwrap_or(open)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rules::RuleSet;
    use crate::{ManualClock, OnFull};

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        let mut f = std::pin::pin!(f);
        loop {
            if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
                return v;
            }
        }
    }

    const RULES: &str = "domain: d
descriptors:
  - key: a
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: b
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: s
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: u
    rate_limit: {unlimited: true}
  - key: closed
    rate_limit: {unit: minute, requests_per_unit: 5, failure_mode: closed}
  - key: local
    rate_limit: {unit: minute, requests_per_unit: 4, failure_mode: local, local_share: 0.5}
";

    struct Req<'a> {
        keys: Vec<String>,
        rules: Vec<&'a Rule>,
    }

    fn req<'a>(rules: &'a RuleSet, descs: &[(&str, &str)]) -> Req<'a> {
        let mut r = Req { keys: vec![], rules: vec![] };
        for &(k, v) in descs {
            let m = rules.matches("d", &[(k, v)]).unwrap();
            r.keys.push(m.counter_key(0));
            r.rules.push(&m.rules[0]);
        }
        r
    }

    fn check<S: Store>(l: &Limiter<S>, r: &Req<'_>, hits: u64) -> Outcome {
        let checks: Vec<RuleCheck<'_>> =
            r.keys.iter().zip(&r.rules).map(|(key, rule)| RuleCheck { key, rule, hits, op: Op::Take }).collect();
        block_on(l.check(&checks))
    }

    fn limiter(store: MemoryStore<ManualClock>) -> Limiter<MemoryStore<ManualClock>> {
        Limiter::new(store, MemoryStore::new())
    }

    #[test]
    fn a_denied_request_keeps_nothing_in_any_counter() {
        let rules = RuleSet::from_yaml("d.yaml", RULES).unwrap();
        let l = limiter(MemoryStore::builder().clock(ManualClock::new(0)).build());
        let both = req(&rules, &[("a", "x"), ("b", "x")]);
        assert!(check(&l, &both, 1).allowed);
        // b is spent: the next two requests are denied and take nothing from a.
        for _ in 0..2 {
            let o = check(&l, &both, 1);
            assert!(!o.allowed);
            assert!(o.verdicts[0].decision.unwrap().allowed && o.verdicts[1].denies());
            assert_eq!(o.headline().unwrap().limit, 1, "headers describe the denying limit");
        }
        // a still has 2 of 3.
        let a = req(&rules, &[("a", "x")]);
        assert_eq!(check(&l, &a, 0).verdicts[0].decision.unwrap().remaining, 2);
    }

    #[test]
    fn shadow_mode_reports_but_never_denies() {
        let rules = RuleSet::from_yaml("d.yaml", RULES).unwrap();
        let l = limiter(MemoryStore::builder().clock(ManualClock::new(0)).build());
        let r = req(&rules, &[("s", "x"), ("a", "x")]);
        assert!(check(&l, &r, 1).allowed);
        let o = check(&l, &r, 1);
        assert!(o.allowed && o.verdicts[0].over_limit() && !o.verdicts[0].denies());
        assert_eq!(o.retry_after(), None);
        // Allowed requests are counted in full, shadow limit included.
        assert_eq!(check(&l, &req(&rules, &[("a", "x")]), 0).verdicts[0].decision.unwrap().remaining, 1);
    }

    #[test]
    fn unlimited_rules_have_no_decision() {
        let rules = RuleSet::from_yaml("d.yaml", RULES).unwrap();
        let l = limiter(MemoryStore::builder().clock(ManualClock::new(0)).build());
        let o = check(&l, &req(&rules, &[("u", "x")]), 1_000_000);
        assert!(o.allowed && o.verdicts[0].decision.is_none() && o.headline().is_none());
    }

    #[test]
    fn retry_after_is_the_longest_wait_or_none() {
        let rules = RuleSet::from_yaml("d.yaml", RULES).unwrap();
        let l = limiter(MemoryStore::builder().clock(ManualClock::new(30_000_000)).build());
        let both = req(&rules, &[("a", "x"), ("b", "x")]);
        assert!(check(&l, &both, 1).allowed);
        assert_eq!(check(&l, &both, 1).retry_after(), Some(Duration::from_secs(30)));
        // 2 hits: b can never take them; no wait helps.
        assert_eq!(check(&l, &both, 2).retry_after(), None);
    }

    #[test]
    fn failure_policies_decide_when_the_store_fails() {
        let rules = RuleSet::from_yaml("d.yaml", RULES).unwrap();
        // A store that holds one key and refuses others fails every new key.
        let store = MemoryStore::builder().clock(ManualClock::new(0)).max_keys(1).on_full(OnFull::Refuse).build();
        let l = limiter(store);
        assert!(check(&l, &req(&rules, &[("a", "first")]), 1).allowed);
        let open = check(&l, &req(&rules, &[("a", "new")]), 1);
        assert!(open.allowed && matches!(open.verdicts[0].failure, Some((StoreError::Full { .. }, FailureMode::Open))));
        let closed = check(&l, &req(&rules, &[("closed", "new")]), 1);
        assert!(!closed.allowed && closed.retry_after().is_none());
        // local: half of 4 per instance.
        let local = req(&rules, &[("local", "new")]);
        let admitted = (0..5).filter(|_| check(&l, &local, 1).allowed).count();
        assert_eq!(admitted, 2);
    }

    /// A refund the store could not take is lost and denies nothing,
    /// whatever the rule's failure policy (budgets.md, "Refunds").
    #[test]
    fn a_refund_the_store_cannot_take_is_answered_open_whatever_the_policy() {
        let rules = RuleSet::from_yaml("d.yaml", RULES).unwrap();
        let l = limiter(MemoryStore::builder().clock(ManualClock::new(0)).build());
        for key in ["a", "closed", "local"] {
            let r = req(&rules, &[(key, "x")]);
            let refund = RuleCheck { key: &r.keys[0], rule: r.rules[0], hits: 2, op: Op::Refund };
            let v = l.verdict(&refund, Err(StoreError::Unavailable("down".into())));
            assert!(!v.denies(), "{key}: a refund denies nothing");
            assert!(v.failure.is_some(), "{key}: the store's failure is reported");
        }
    }
}
