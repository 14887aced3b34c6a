//! The protocol-neutral rate-limit service: a request of descriptors in, one
//! status per descriptor and the overall answer out. The gRPC, JSON and
//! `/v1/check` adapters translate to and from these types and nothing else.

use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_core::limiter::{Held, Limiter, Outcome, RuleCheck, Verdict, acquire_ops, most_restrictive};
use floodgate_core::reservation::{ReservationError, ReservationId, Settled};
use floodgate_core::rules::cost::Cost;
use floodgate_core::rules::{self, Planned, Rule, RuleSet, Unit, carried_key, counter_key};
use floodgate_core::{Algorithm, Answer, Decision, Limit, Op, Store};

use crate::dashboard::KeyRef;
use crate::metrics::{Metrics, Protocol};
use crate::rules::reload::Rules;
use floodgate_perkey::{Limits, PerKey};

/// Most descriptors one request may carry (envoy sends a handful).
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 32;

/// The metrics label of limits carried by requests (envoy's descriptor
/// `limit`), whatever their value.
pub const REQUEST_LIMIT_RULE: &str = "request_limit";

/// One rate-limit request: a domain and its descriptors.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// The rules domain.
    pub domain: String,
    /// The descriptors, each decided against the rules.
    pub descriptors: Vec<Descriptor>,
    /// Hits for every descriptor without its own; 0 counts as 1 (envoy).
    pub hits_addend: u64,
}

/// One descriptor of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Descriptor {
    /// `(key, value)` entries, in order.
    pub entries: Vec<(String, String)>,
    /// Hits for this descriptor, used as is when set (0 = check only).
    pub hits_addend: Option<u64>,
    /// The hits are given back, not taken (envoy's `is_negative_hits`, a
    /// negative `hits` on `/v1/check`): a refund ([`Op::Refund`]).
    pub refund: bool,
    /// A limit carried by the request itself (envoy's descriptor `limit`),
    /// used instead of the rules' when the domain exists.
    pub limit: Option<LimitOverride>,
    /// The lease a release or an extend names (the [`LEASE_ENTRY`] entry,
    /// taken out before matching, or the API's `lease`).
    pub lease: Option<u64>,
}

/// The descriptor entry that carries a lease's id back: Envoy's stream-end
/// descriptor reads it from the RLS answer's dynamic metadata. It is taken
/// out of the descriptor before matching.
pub const LEASE_ENTRY: &str = "lease_id";

/// A lease's id as text (16 hex digits): in the RLS answer's dynamic
/// metadata, the HTTP API and the headers.
pub fn lease_text(id: u64) -> String {
    format!("{id:016x}")
}

/// A lease's id from its text ([`lease_text`]); the error says what to send.
pub fn parse_lease(text: &str) -> Result<u64, String> {
    match u64::from_str_radix(text, 16) {
        Ok(id) if id != 0 && text.len() <= 16 => Ok(id),
        _ => Err(format!("`{text}` is not a lease id: send the 16 hex digits an acquire answered")),
    }
}

impl Descriptor {
    /// An RLS descriptor (gRPC or `/json`): a descriptor that gives hits
    /// back (`refund`: a stream-end release) has its [`LEASE_ENTRY`] taken
    /// out before matching, as the lease it releases; elsewhere the entry is
    /// an ordinary one. The error says what is wrong with the lease id.
    pub fn rls(
        mut entries: Vec<(String, String)>,
        hits_addend: Option<u64>,
        refund: bool,
        limit: Option<LimitOverride>,
    ) -> Result<Descriptor, String> {
        let mut lease = None;
        if refund && let Some(i) = entries.iter().position(|(k, _)| k == LEASE_ENTRY) {
            let (_, v) = entries.remove(i);
            lease = Some(parse_lease(&v)?);
        }
        Ok(Descriptor { entries, hits_addend, refund, limit, lease })
    }
}

/// A lease taken by a request that concurrency limits allowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Its id: release or extend it by this ([`lease_text`] on the wire).
    pub id: u64,
    /// How long it lasts unless released or extended (the shortest
    /// `lease_ttl` of the request's concurrency limits).
    pub ttl: Duration,
}

/// A limit carried in a request: `requests_per_unit` per `unit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitOverride {
    /// Requests per unit.
    pub requests_per_unit: u32,
    /// The unit.
    pub unit: Unit,
}

/// A request the service refuses to decide.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// `domain` is empty.
    #[error("domain: must not be empty (the rules domain to check against)")]
    EmptyDomain,
    /// No descriptors.
    #[error("descriptors: must not be empty (give at least one descriptor with entries)")]
    NoDescriptors,
    /// Too many descriptors.
    #[error("descriptors: {0} given, at most {MAX_DESCRIPTORS} allowed")]
    TooManyDescriptors(usize),
    /// A descriptor with no entries or too many.
    #[error("descriptors[{0}].entries: must hold 1 to {MAX_ENTRIES} entries")]
    BadEntries(usize),
    /// A reserve's descriptor that gives back.
    #[error(
        "descriptors[{0}]: a reserve takes its estimate; give back with a settle or cancel of the reservation, or a refund on /v1/check"
    )]
    RefundInReserve(usize),
    /// A reserve whose descriptor matches a concurrency limit.
    #[error(
        "descriptors[{0}]: it matches a concurrency limit, whose slot a reservation cannot hold: take it with \
         /v1/check (the answer's lease), release it when the work ends, and reserve the cost apart"
    )]
    LeaseInReserve(usize),
    /// An extend whose descriptor names no lease.
    #[error("descriptors[{0}]: an extend names the lease it extends: send the lease id an acquire answered")]
    NoLease(usize),
}

/// What the service answered for one descriptor.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DescriptorStatus {
    /// Whether this descriptor is over its limit (never for shadow-mode or
    /// unlimited rules).
    pub over_limit: bool,
    /// The limit the status reports (the most restrictive of the
    /// descriptor's limits); `None` when no limited rule applied.
    pub limit: Option<LimitInfo>,
    /// The reported limit's decision.
    pub decision: Option<Decision>,
}

/// A limit as reported to clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitInfo {
    /// The rule's `name`, if any.
    pub name: Option<std::sync::Arc<str>>,
    /// Requests per window.
    pub requests_per_unit: u64,
    /// The window, when it is exactly one of envoy's units.
    pub unit: Option<Unit>,
    /// The window.
    pub window: Duration,
    /// The algorithm's name.
    pub algorithm: &'static str,
}

impl LimitInfo {
    fn of(rule: &Rule, limit: &Limit) -> Self {
        LimitInfo {
            name: rule.name.clone(),
            requests_per_unit: limit.limit(),
            unit: rule.unit,
            window: limit.window(),
            algorithm: limit.algorithm().kind().as_str(),
        }
    }
}

/// Where a limit that applies to a descriptor comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitFrom {
    /// The rules files' match.
    Rules,
    /// The descriptor's per-key entry, naming this tier of its domain.
    Tier(&'static str),
    /// The descriptor's per-key entry, with limits of its own.
    PerKey,
    /// The request carried it (envoy's descriptor `limit`).
    Request,
}

/// One limit of [`Service::peek`]: its counters now and where it comes
/// from.
#[derive(Debug, Clone)]
pub struct Peeked {
    /// The store's counter key.
    pub counter_key: String,
    /// The limit, its capacity ([`Limit::burst`]) and what a request of 0
    /// hits is answered now; `None` for an unlimited rule; the store's
    /// error when it could not answer (the rule's failure policy decides).
    pub counters: Option<Result<(LimitInfo, u64, Decision), floodgate_core::StoreError>>,
    /// The rule's label in the metrics and the dashboard (its name, else
    /// its stats key).
    pub rule: String,
    /// Where the rule is written (`file:line:col`): for the files' rules
    /// and tiers.
    pub at: Option<String>,
    /// Where it comes from.
    pub from: LimitFrom,
    /// Counted and reported, never denying.
    pub shadow: bool,
}

/// One concurrency rule's slots ([`Service::leases`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleLeases {
    /// The rules domain.
    pub domain: String,
    /// The rule's label (its name, else its stats key).
    pub rule: String,
    /// Its `concurrency`.
    pub concurrency: u64,
    /// Held now, and acquired, released and expired since the start.
    pub stats: floodgate_core::store::memory::LeaseStats,
    /// The slots live in a store other instances share (Redis): `stats`
    /// counts this instance's calls (acquired, released, found expired),
    /// and its `held` is not the slots held now.
    pub shared: bool,
}

impl RuleLeases {
    /// The slots held now, when this instance knows them (not for leases
    /// a shared store keeps).
    pub fn in_flight(&self) -> Option<u64> {
        (!self.shared).then_some(self.stats.held)
    }
}

/// A decided request: its answer (the one every adapter gives, with the
/// limit its rate-limit headers describe), and RLS's status per
/// descriptor beside it (the HTTP API reports them too).
#[derive(Debug, Clone, PartialEq)]
pub struct Decided {
    /// The answer.
    pub answer: Answer,
    /// One status per request descriptor, in order.
    pub statuses: Vec<DescriptorStatus>,
    /// The lease taken when a concurrency limit allowed the request.
    pub lease: Option<Lease>,
}

/// A reserve's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Reserved {
    /// The decision of the estimate.
    pub decided: Decided,
    /// The reservation, when the request was allowed and a limit took
    /// from the store.
    pub id: Option<ReservationId>,
    /// How long it may give back what it does not use (the longest
    /// `reservation_ttl` of its limits).
    pub ttl: Option<Duration>,
    /// What each limit of the reservation took and reads its actual amount
    /// from (its `cost`), for a settle made by the proxy.
    pub meter: Option<floodgate_tower::Meter>,
    /// The slots a metered request holds on concurrency limits (the proxy
    /// releases them when the response ends).
    pub held: Option<Held>,
}

/// Why a reserve was not decided.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    /// The request is malformed.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The store keeps no reservations, or failed.
    #[error(transparent)]
    Reservation(#[from] ReservationError),
}

/// Rules, per-key entries, a store and metrics: everything a decision
/// needs.
pub struct Service<S> {
    rules: Arc<Rules>,
    keys: Option<Arc<PerKey>>,
    limiter: Limiter<S>,
    metrics: Arc<Metrics>,
}

impl<S> std::fmt::Debug for Service<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Service").field("rules", &self.rules.source()).finish_non_exhaustive()
    }
}

impl<S: Store> Service<S> {
    /// A service deciding with `limiter` against `rules` (and the per-key
    /// entries in `keys`, which take precedence for the exact descriptors
    /// they name).
    pub fn new(rules: Arc<Rules>, keys: Option<Arc<PerKey>>, limiter: Limiter<S>, metrics: Arc<Metrics>) -> Self {
        Self { rules, keys, limiter, metrics }
    }

    /// The hot-reloaded rules.
    pub fn rules(&self) -> &Arc<Rules> {
        &self.rules
    }

    /// The per-key entries, when enabled.
    pub fn keys(&self) -> Option<&Arc<PerKey>> {
        self.keys.as_ref()
    }

    /// The store.
    pub fn store(&self) -> &S {
        self.limiter.store()
    }

    /// The metrics.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Decide one request, recording metrics for `protocol`. Ready at its
    /// first poll when [`Service::answers_at_once`].
    pub async fn decide(&self, req: &Request, protocol: Protocol) -> Result<Decided, RequestError> {
        let started = Instant::now();
        let result = self.decide_inner(req).await;
        self.record(protocol, &result, started);
        result
    }

    /// Whether every [`Service::decide`] is ready at its first poll: the
    /// store answers at once and per-key entries are not read from Redis.
    pub fn answers_at_once(&self) -> bool {
        self.limiter.store().answers_at_once() && self.keys.as_deref().is_none_or(PerKey::answers_at_once)
    }

    /// Reserve: decide `req` (its descriptors' hits the estimate), and
    /// when it is allowed keep what each limit took as one reservation,
    /// to settle or cancel later through any instance of the region
    /// ([`Service::settle`]). A reserve gives nothing back: a refund
    /// descriptor is refused.
    pub async fn reserve(&self, req: &Request) -> Result<Reserved, ReserveError> {
        self.reserve_as(req, None, Protocol::Reserve).await
    }

    /// Meter `req` for the proxy: each limit with a `cost` asks
    /// `estimate(cost)`, the others the request's hits; kept as a
    /// reservation only when some limit has a cost (else decided as an
    /// ordinary request). A store that cannot keep reservations (down, or
    /// without support) decides it as an ordinary request, by the rules'
    /// failure policies, unmetered.
    pub async fn meter(
        &self,
        req: &Request,
        estimate: &(dyn Fn(&Cost) -> u64 + Sync),
    ) -> Result<Reserved, ReserveError> {
        self.reserve_as(req, Some(estimate), Protocol::Proxy).await
    }

    async fn reserve_as(
        &self,
        req: &Request,
        estimate: Option<&(dyn Fn(&Cost) -> u64 + Sync)>,
        protocol: Protocol,
    ) -> Result<Reserved, ReserveError> {
        let started = Instant::now();
        if let Some(i) = req.descriptors.iter().position(|d| d.refund) {
            return Err(RequestError::RefundInReserve(i).into());
        }
        let sources = self.sources(req).await?;
        let planned = plan(req, &sources, self.keys.as_deref());
        let mut checks = checks_of(req, &planned);
        let (outcome, id, held) = match estimate {
            Some(estimate) => {
                let m = self.limiter.meter(&mut checks, estimate).await;
                (m.outcome, m.reservation, m.held)
            }
            None => {
                if let Some(p) = planned.iter().find(|p| is_concurrency(p.2)) {
                    return Err(RequestError::LeaseInReserve(p.0).into());
                }
                match self.limiter.reserve(&checks).await {
                    Ok((outcome, id)) => (outcome, id, None),
                    Err(e) => {
                        self.metrics.request(protocol, None, started.elapsed());
                        return Err(e.into());
                    }
                }
            }
        };
        let decided = self.answer(req, &planned, &checks, &outcome);
        self.metrics.request(protocol, Some(decided.answer.allowed), started.elapsed());
        let ttl =
            id.and_then(|_| checks.iter().filter(|c| c.rule.limit.is_some()).map(|c| c.rule.reservation_ttl).max());
        let meter = id.map(|id| floodgate_tower::Meter::of(id, &checks, &outcome.verdicts));
        Ok(Reserved { decided, id, ttl, meter, held })
    }

    /// Each concurrency rule's slots now, from the store's accounts: its
    /// domain, label, `concurrency`, and held / acquired / released /
    /// expired (rules of the same limit share their counts).
    pub fn leases(&self) -> Vec<RuleLeases>
    where
        S: crate::Backend,
    {
        let set = self.rules.current();
        let mut rules = Vec::new();
        for domain in set.domains() {
            let tiers = domain.tiers().flat_map(|(_, t)| t.rules.iter());
            for rule in domain.rules().chain(tiers) {
                if let Some(limit) = rule.limit.as_ref().filter(|l| l.is_concurrency()) {
                    rules.push((domain.name(), rule.label(), limit));
                }
            }
        }
        // The store's accounts are read (every shard) only when some rule
        // holds leases.
        if rules.is_empty() {
            return Vec::new();
        }
        let stats = self.limiter.store().lease_stats();
        let shared = self.limiter.store().leases_shared();
        rules
            .into_iter()
            .filter_map(|(domain, rule, limit)| {
                let i = stats.binary_search_by_key(&limit.fingerprint(), |(fp, _)| *fp).ok()?;
                Some(RuleLeases {
                    domain: domain.to_owned(),
                    rule: rule.to_owned(),
                    concurrency: limit.limit(),
                    stats: stats[i].1,
                    shared,
                })
            })
            .collect()
    }

    /// Release the slots a metered request held ([`Reserved::held`]) when
    /// its response ends. A store that fails leaves them to end with their
    /// lease.
    pub async fn release(&self, held: &Held) {
        self.limiter.release(held).await;
    }

    /// Settle reservation `id` at `actual` (one amount for all its limits,
    /// or one per limit in the reserve's order; a cancel settles at 0):
    /// the excess over the estimate charged after the work, what was not
    /// used given back as if never taken (see
    /// [`floodgate_core::reservation`]).
    pub async fn settle(&self, id: ReservationId, actual: &[u64]) -> Result<Settled, ReservationError> {
        let result = self.limiter.store().settle(id, actual).await;
        self.metrics.settle(&result);
        result
    }

    /// A decided request (or a refused one) in the metrics.
    fn record(&self, protocol: Protocol, result: &Result<Decided, RequestError>, started: Instant) {
        self.metrics.request(protocol, result.as_ref().ok().map(|d| d.answer.allowed), started.elapsed());
    }

    /// The current counters of every limit applying to the request's
    /// descriptors, taking nothing (each limit peeked with 0 hits), and
    /// where each limit comes from.
    pub async fn peek(&self, req: &Request) -> Result<Vec<Peeked>, RequestError> {
        let sources = self.sources(req).await?;
        let mut out = Vec::new();
        for (d, key, rule) in plan(req, &sources, self.keys.as_deref()) {
            let from = match (sources.inline.get(d), keyed(&sources, &req.domain, d)) {
                (Some(Some(_)), _) => LimitFrom::Request,
                (_, Some((Limits::Tier(t), _))) => LimitFrom::Tier(t),
                (_, Some((Limits::Own(_), _))) => LimitFrom::PerKey,
                _ => LimitFrom::Rules,
            };
            let at = match from {
                LimitFrom::Rules | LimitFrom::Tier(_) => {
                    sources.rules.domain(&req.domain).map(|dm| sources.rules.at(dm, rule.source.pos))
                }
                LimitFrom::PerKey | LimitFrom::Request => None,
            };
            let counters = match &rule.limit {
                Some(limit) => Some(
                    self.limiter
                        .store()
                        .apply(&key, limit, 0)
                        .await
                        .map(|decision| (LimitInfo::of(rule, limit), limit.burst(), decision)),
                ),
                None => None,
            };
            out.push(Peeked {
                counter_key: key,
                counters,
                rule: rule.label().to_owned(),
                at,
                from,
                shadow: rule.shadow_mode,
            });
        }
        Ok(out)
    }

    /// Validate `req` and gather what its descriptors resolve against,
    /// waiting for per-key entries that must be read from Redis. Each
    /// descriptor is looked up once (and counted once in the per-key hits
    /// and misses).
    async fn sources(&self, req: &Request) -> Result<Sources, RequestError> {
        validate(req)?;
        let mut keyed = Vec::new();
        if let Some(k) = self.keys.as_deref().filter(|k| !k.is_empty()) {
            keyed.reserve(req.descriptors.len());
            for d in &req.descriptors {
                keyed.push(k.lookup(&req.domain, &d.entries).await);
            }
        }
        Ok(self.sources_of(req, keyed))
    }

    /// The sources of a valid `req` with its per-key entries `keyed`.
    fn sources_of(&self, req: &Request, keyed: Vec<Option<Limits>>) -> Sources {
        let rules = self.rules.current();
        let inline = inline_rules(&rules, req);
        Sources { rules, keyed, inline }
    }

    async fn decide_inner(&self, req: &Request) -> Result<Decided, RequestError> {
        self.decide_leases(req, false).await
    }

    /// Extend the lease each descriptor names ([`Descriptor::lease`]) on
    /// the concurrency limits it matches, to their `lease_ttl` from now:
    /// allowed while every named lease was held; denied when one is gone
    /// (acquire again). The other limits are only read.
    pub async fn extend(&self, req: &Request, protocol: Protocol) -> Result<Decided, RequestError> {
        let started = Instant::now();
        let result = match req.descriptors.iter().position(|d| d.lease.is_none()) {
            Some(i) => Err(RequestError::NoLease(i)),
            None => self.decide_leases(req, true).await,
        };
        self.record(protocol, &result, started);
        result
    }

    /// Decide `req`, its checks' ops set for the leases of its concurrency
    /// limits ([`lease_ops`]), extending the leases named when `extend`.
    async fn decide_leases(&self, req: &Request, extend: bool) -> Result<Decided, RequestError> {
        let sources = self.sources(req).await?;
        let planned = plan(req, &sources, self.keys.as_deref());
        let mut checks = checks_of(req, &planned);
        let lease = lease_ops(req, &planned, &mut checks, extend, || self.limiter.next_lease());
        let outcome = self.limiter.check(&checks).await;
        let mut decided = self.answer(req, &planned, &checks, &outcome);
        // A lease is answered only when a concurrency limit took it.
        decided.lease = lease.filter(|_| {
            decided.answer.allowed
                && checks.iter().zip(&outcome.verdicts).any(|(c, v)| {
                    matches!(c.op, Op::Acquire { .. })
                        && is_concurrency(c.rule)
                        && v.failure.is_none()
                        && v.decision.is_some_and(|d| d.allowed)
                })
        });
        Ok(decided)
    }

    /// The answer to `req` from the outcome of its planned checks (their
    /// verdicts counted in the metrics).
    fn answer(
        &self,
        req: &Request,
        planned: &[(usize, String, &Rule)],
        checks: &[RuleCheck<'_>],
        outcome: &Outcome,
    ) -> Decided {
        for ((d, _, _), (check, verdict)) in planned.iter().zip(checks.iter().zip(&outcome.verdicts)) {
            let key = KeyRef { counter_key: check.key, entries: &req.descriptors[*d].entries };
            self.metrics.verdict(&req.domain, check.rule, verdict, key, check.hits, check.op);
        }
        // `plan` lists each descriptor's checks together, in descriptor order.
        let statuses = (0..req.descriptors.len())
            .map(|d| {
                let mine = planned.partition_point(|p| p.0 < d)..planned.partition_point(|p| p.0 <= d);
                let Some(i) = most_restrictive(&outcome.verdicts[mine.clone()]).map(|i| mine.start + i) else {
                    return DescriptorStatus::default();
                };
                let verdict = &outcome.verdicts[i];
                let (info, decision) = reported(&checks[i], verdict).unzip();
                DescriptorStatus { over_limit: verdict.denies(), limit: info, decision }
            })
            .collect();
        Decided { answer: Answer::of(checks, outcome.view()), statuses, lease: None }
    }
}

/// The checks of the planned limits, each with its descriptor's hits,
/// taken or (a refund) given back.
fn checks_of<'a>(req: &Request, planned: &'a [Planned<'a>]) -> Vec<RuleCheck<'a>> {
    let default_hits = req.hits_addend.max(1);
    rules::checks_of(planned, |d| {
        let d = &req.descriptors[d];
        (d.hits_addend.unwrap_or(default_hits), if d.refund { Op::Refund } else { Op::Take })
    })
}

/// Whether `rule` bounds requests in flight.
fn is_concurrency(rule: &Rule) -> bool {
    rule.limit.as_ref().is_some_and(Limit::is_concurrency)
}

/// Set the ops of a request's checks for the leases of its concurrency
/// limits, and answer the lease an acquire takes:
///
/// * with `extend`: every check of a descriptor extends the lease it names
///   (the other limits only peek);
/// * a descriptor that gives hits back (`is_negative_hits`) and matches a
///   concurrency limit **releases**: the lease it names, or without one
///   the key's earliest-expiring lease; its other limits keep their hits
///   (they only peek);
/// * otherwise, when the request matches a concurrency limit, every check
///   that takes acquires one new lease for the request (a rate takes as
///   usual beside it; all or nothing: a refused request holds no slot).
///
/// Nothing changes for a request without a concurrency limit.
fn lease_ops(
    req: &Request,
    planned: &[Planned<'_>],
    checks: &mut [RuleCheck<'_>],
    extend: bool,
    new_id: impl FnOnce() -> u64,
) -> Option<Lease> {
    if extend {
        // Every limit only reads, but a concurrency limit extends its lease.
        for (c, p) in checks.iter_mut().zip(planned) {
            c.op = Op::Extend { lease: req.descriptors[p.0].lease.unwrap_or(0) };
        }
        return None;
    }
    if !checks.iter().any(|c| is_concurrency(c.rule)) {
        return None;
    }
    let releases = |d: usize| req.descriptors[d].refund && planned.iter().any(|p| p.0 == d && is_concurrency(p.2));
    for (c, p) in checks.iter_mut().zip(planned) {
        if releases(p.0) {
            c.op = Op::Release { lease: req.descriptors[p.0].lease };
        }
    }
    // The rest acquires one lease for the request (the releasing
    // descriptors' checks are no longer takes).
    acquire_ops(checks, new_id).map(|(id, ttl)| Lease { id, ttl })
}

/// What a request's descriptors resolve against: the rules in use, the
/// per-key entries of its exact descriptors and the limits it carries (each
/// empty when none apply).
struct Sources {
    rules: Arc<RuleSet>,
    keyed: Vec<Option<Limits>>,
    inline: Vec<Option<Rule>>,
}

/// The `(descriptor index, counter key, rule)` of every limit that applies,
/// grouped by descriptor in order ([`RuleSet::plan`]): a request-carried
/// limit, else a per-key entry of the exact descriptor (it takes precedence
/// over the files; one naming a tier the rules lack is noted in `keys` and
/// gets the files' rules), else the files' match with `replaces` applied
/// across the request.
fn plan<'a>(req: &Request, sources: &'a Sources, keys: Option<&PerKey>) -> Vec<Planned<'a>> {
    let Sources { rules, keyed: entries, inline } = sources;
    let domain = req.domain.as_str();
    let own = |d: usize| {
        let desc = &req.descriptors[d];
        if let Some(Some(rule)) = inline.get(d) {
            let l = desc.limit.map(|l| (l.requests_per_unit, l.unit.as_str())).unwrap_or_default();
            return Some((carried_key(domain, &desc.entries, u64::from(l.0), l.1), std::slice::from_ref(rule)));
        }
        if let Some((_, limits)) = keyed(sources, domain, d) {
            return Some((counter_key(domain, &desc.entries), limits));
        }
        if let (Some(k), Some(Some(l))) = (keys, entries.get(d)) {
            k.unknown_tier(domain, l);
        }
        None
    };
    rules.plan(domain, req.descriptors.iter().map(|d| d.entries.as_slice()), own)
}

/// Descriptor `d`'s per-key entry and its limits under the rules in use
/// (`None` without an entry, or when its tier is not in the domain's rules).
fn keyed<'a>(sources: &'a Sources, domain: &str, d: usize) -> Option<(&'a Limits, &'a [Rule])> {
    let l = sources.keyed.get(d)?.as_ref()?;
    Some((l, l.rules_in(&sources.rules, domain)?))
}

/// The rules of request-carried limits, one per descriptor (empty when no
/// descriptor carries one: the common case costs nothing).
fn inline_rules(rules: &RuleSet, req: &Request) -> Vec<Option<Rule>> {
    if req.descriptors.iter().all(|d| d.limit.is_none()) {
        return Vec::new();
    }
    req.descriptors.iter().map(|d| inline_rule(rules, &req.domain, d)).collect()
}

/// The rule for a descriptor that carries its own limit (envoy's descriptor
/// `limit`): a fixed window of `requests_per_unit` per `unit`, honoured when
/// the domain exists, as envoy does.
fn inline_rule(rules: &RuleSet, domain: &str, d: &Descriptor) -> Option<Rule> {
    let o = d.limit?;
    rules.domain(domain)?;
    let limit = Limit::new(Algorithm::FixedWindow, u64::from(o.requests_per_unit), o.unit.window()).ok()?;
    // One metrics label for every request-carried limit: clients choose them.
    Some(Rule::from_limit(limit, REQUEST_LIMIT_RULE.to_owned()))
}

fn validate(req: &Request) -> Result<(), RequestError> {
    if req.domain.is_empty() {
        return Err(RequestError::EmptyDomain);
    }
    if req.descriptors.is_empty() {
        return Err(RequestError::NoDescriptors);
    }
    if req.descriptors.len() > MAX_DESCRIPTORS {
        return Err(RequestError::TooManyDescriptors(req.descriptors.len()));
    }
    if let Some(i) = req.descriptors.iter().position(|d| d.entries.is_empty() || d.entries.len() > MAX_ENTRIES) {
        return Err(RequestError::BadEntries(i));
    }
    Ok(())
}

/// The limit and decision a status or the headers report for one check
/// (`None` for an unlimited rule).
fn reported(check: &RuleCheck<'_>, verdict: &Verdict) -> Option<(LimitInfo, Decision)> {
    Some((LimitInfo::of(check.rule, check.rule.limit.as_ref()?), verdict.decision?))
}
