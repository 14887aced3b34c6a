//! What the layer asks for each request: the [`Decide`] trait, and the two
//! deciders this crate offers — [`RulesDecider`] (a rules domain, its
//! `request_descriptors`, any store) and [`KeyedLimit`] (one limit per key,
//! as `governor` users know it).

use std::borrow::Cow;
use std::future::Future;
use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use floodgate_core::limiter::{Held, Limiter, OutcomeView, RuleCheck, Verdict};
use floodgate_core::reservation::ReservationId;
use floodgate_core::rules::cost::Metering;
use floodgate_core::rules::{self, Planned, Rule, RuleSet};
use floodgate_core::{Charge, Decision, Limit, MemoryStore, Op, Store, StoreError};
use http::HeaderName;

use crate::descriptors::{self, DescriptorError, RequestFacts};
use crate::layer::{Meter, Reserved, estimate};

pub use floodgate_core::{Answer, Headline};

/// A decision could not be made; the layer answers with `status` and the
/// message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct DecideError {
    /// The HTTP status to answer with (500 for a server misconfiguration,
    /// 400 for a request the decider refuses).
    pub status: http::StatusCode,
    /// What went wrong, for the response body and the log.
    pub message: String,
}

impl From<DescriptorError> for DecideError {
    fn from(e: DescriptorError) -> Self {
        DecideError { status: http::StatusCode::INTERNAL_SERVER_ERROR, message: e.to_string() }
    }
}

/// Decides HTTP requests. Implemented by [`RulesDecider`], [`KeyedLimit`]
/// and the service's rule engine (overrides, metrics) in `floodgate-server`.
pub trait Decide: Send + Sync + 'static {
    /// Decide one request. Store failures are the rules' failure policies'
    /// business and do not surface here.
    fn decide(&self, facts: &RequestFacts<'_>) -> impl Future<Output = Result<Answer, DecideError>> + Send;

    /// Whether every [`Decide::decide`] future is ready at its first poll
    /// (its stores answer at once: the in-memory store). The layer then
    /// polls it once in its `call`, with no allocation, and boxes it
    /// otherwise. A decider that says so and pends anyway is decided again
    /// in a box (what the first try counted is counted twice). The default
    /// is `false`.
    fn answers_at_once(&self) -> bool {
        false
    }

    /// What metering this decider's requests need ([`MeterLayer`]): `None`
    /// (the default) when no limit has a `cost`, and such requests are only
    /// decided.
    ///
    /// [`MeterLayer`]: crate::MeterLayer
    fn metering(&self) -> Option<Metering> {
        None
    }

    /// Decide a request of a metered domain ([`Decide::metering`]): each
    /// limit with a `cost` asks its [`estimate`](crate::estimate) (from the
    /// request's headers or its JSON body, `facts.body`), the others as [`Decide::decide`]
    /// does; when it is allowed and some limit has a cost, what each took is
    /// kept as a reservation to settle. The default decides without
    /// reserving.
    fn reserve(&self, facts: &RequestFacts<'_>) -> impl Future<Output = Result<Reserved, DecideError>> + Send {
        let decided = self.decide(facts);
        async move { decided.await.map(Reserved::unmetered) }
    }

    /// Settle a reservation made by [`Decide::reserve`] at `actual` (one
    /// amount per part, in order). Failures are the decider's to report.
    fn settle(&self, id: ReservationId, actual: &[u64]) -> impl Future<Output = ()> + Send {
        let _ = (id, actual);
        std::future::ready(())
    }

    /// Release the slots a request held on concurrency limits
    /// ([`Reserved::held`]), when its response has ended (or was dropped:
    /// the client gone, a panic, a cancellation). Failures leave them to
    /// end with their lease.
    fn release(&self, held: Held) -> impl Future<Output = ()> + Send {
        let _ = held;
        std::future::ready(())
    }
}

/// One rules domain over a store: each request's descriptors are built by
/// the domain's `request_descriptors` (by default the one descriptor
/// `remote_address = <client IP>`) and decided against its rules, all or
/// nothing. The rules can be replaced at run time.
pub struct RulesDecider<S> {
    rules: ArcSwap<RuleSet>,
    domain: String,
    limiter: Limiter<S>,
}

impl<S> std::fmt::Debug for RulesDecider<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RulesDecider").field("domain", &self.domain).finish_non_exhaustive()
    }
}

impl<S: Store> RulesDecider<S> {
    /// Decide `domain` of `rules` against `store`; `failure_mode: local`
    /// rules fall back to a private in-memory store.
    pub fn new(rules: RuleSet, domain: impl Into<String>, store: S) -> Self {
        Self::with_limiter(rules, domain, Limiter::new(store, MemoryStore::new()))
    }

    /// The same with a limiter of your own.
    pub fn with_limiter(rules: RuleSet, domain: impl Into<String>, limiter: Limiter<S>) -> Self {
        Self { rules: ArcSwap::from_pointee(rules), domain: domain.into(), limiter }
    }

    /// Swap in new rules; requests in flight finish on the old ones. Counters
    /// live in the store, keyed by descriptor and limit, so an unchanged
    /// limit keeps its count.
    pub fn replace_rules(&self, rules: RuleSet) {
        self.rules.store(Arc::new(rules));
    }

    /// The store.
    pub fn store(&self) -> &S {
        self.limiter.store()
    }
}

impl<S: Store> RulesDecider<S> {
    /// The checks of a request: its descriptors' counter keys and rules.
    /// `Ok(None)`: nothing limits it.
    fn plan<'r>(&self, rules: &'r RuleSet, facts: &RequestFacts<'_>) -> Result<Option<Vec<Planned<'r>>>, DecideError> {
        if rules.domain(&self.domain).is_none() {
            return Ok(None);
        }
        let descs = descriptors::build(descriptors::templates(rules, &self.domain), facts)?;
        let planned = rules.plan(&self.domain, descs.iter().map(Vec::as_slice), |_| None);
        Ok((!planned.is_empty()).then_some(planned))
    }
}

/// What a request passing through asks of `limit`: one hit, or on a limit
/// charged after the work (`charge: after`) only the gate (hits 0): its
/// cost is charged by whoever learns it (the service's APIs, Envoy's
/// stream-end call), not by a request passing through.
fn passing_hits(limit: &Limit) -> u64 {
    u64::from(limit.charge() == Charge::Before)
}

/// Every planned limit's check for a request passing through, and the
/// first of its rules that is a concurrency limit (seen in the same pass).
fn checks_of<'a>(planned: &'a [Planned<'a>]) -> (Vec<RuleCheck<'a>>, Option<&'a Rule>) {
    let mut checks = rules::checks_of(planned, |_| (1, Op::Take));
    let mut leased = None;
    for c in &mut checks {
        if let Some(l) = &c.rule.limit {
            c.hits = passing_hits(l);
            if l.is_concurrency() {
                leased = leased.or(Some(c.rule));
            }
        }
    }
    (checks, leased)
}

/// A request decided by the plain layer that matches concurrency limit
/// `rule`: its slot could never be released (that takes the response's
/// end: the metered layer's).
fn leases_need_metering(rule: &Rule) -> DecideError {
    DecideError {
        status: http::StatusCode::INTERNAL_SERVER_ERROR,
        message: format!(
            "rule `{}` is a concurrency limit, whose slot is released when the response ends: serve this domain \
             through RateLimitLayer::metered()",
            rule.label()
        ),
    }
}

impl<S: Store + 'static> Decide for RulesDecider<S> {
    async fn decide(&self, facts: &RequestFacts<'_>) -> Result<Answer, DecideError> {
        // A guard, not a reference count (shared by every core); held
        // across a store's wait, it falls back to one by itself.
        let rules = self.rules.load();
        let Some(planned) = self.plan(&rules, facts)? else { return Ok(Answer::unlimited()) };
        let (checks, leased) = checks_of(&planned);
        if let Some(rule) = leased {
            return Err(leases_need_metering(rule));
        }
        let outcome = self.limiter.check(&checks).await;
        Ok(Answer::of(&checks, outcome.view()))
    }

    fn answers_at_once(&self) -> bool {
        self.limiter.store().answers_at_once()
    }

    fn metering(&self) -> Option<Metering> {
        self.rules.load().domain(&self.domain)?.metering()
    }

    async fn reserve(&self, facts: &RequestFacts<'_>) -> Result<Reserved, DecideError> {
        let rules = self.rules.load();
        let Some(planned) = self.plan(&rules, facts)? else { return Ok(Reserved::unmetered(Answer::unlimited())) };
        let (mut checks, _) = checks_of(&planned);
        let estimate = |cost: &rules::cost::Cost| estimate(cost, facts.headers, facts.body);
        let m = self.limiter.meter(&mut checks, &estimate).await;
        let meter = m.reservation.map(|id| Meter::of(id, &checks, &m.outcome.verdicts));
        Ok(Reserved { answer: Answer::of(&checks, m.outcome.view()), meter, held: m.held })
    }

    async fn settle(&self, id: ReservationId, actual: &[u64]) {
        // A failed settle leaves the reservation to expire at its estimate.
        let _ = self.limiter.store().settle(id, actual).await;
    }

    async fn release(&self, held: Held) {
        self.limiter.release(&held).await;
    }
}

/// A function giving a request's key.
pub type KeyFn = Arc<dyn Fn(&RequestFacts<'_>) -> Option<String> + Send + Sync>;

/// Where a [`KeyedLimit`] takes each request's key from.
#[derive(Clone)]
pub enum Key {
    /// The client's IP address (peer, or trusted forwarding hop).
    ClientIp,
    /// A request header's value; requests without it are not limited.
    Header(HeaderName),
    /// Your function; `None` leaves the request unlimited.
    Custom(KeyFn),
}

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Key::ClientIp => f.write_str("ClientIp"),
            Key::Header(h) => f.debug_tuple("Header").field(h).finish(),
            Key::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

impl Key {
    /// A key computed by `f`.
    pub fn custom(f: impl Fn(&RequestFacts<'_>) -> Option<String> + Send + Sync + 'static) -> Self {
        Key::Custom(Arc::new(f))
    }

    /// The key of a request as bytes, an IP address written into `buf` by
    /// `write_ip` (no allocation): `ip_text` for stores keyed by text
    /// (Redis keys stay readable; the bytes go through [`key_text`]),
    /// [`ip_bytes`] for a store keyed by bytes ([`Store::keys_by_bytes`]: the
    /// in-memory store). A header's value and a custom key are
    /// the same bytes for every store.
    #[inline]
    fn of<'a>(
        &self,
        facts: &'a RequestFacts<'_>,
        buf: &'a mut [u8; 48],
        write_ip: fn(std::net::IpAddr, &mut [u8; 48]) -> &[u8],
    ) -> Result<Option<Cow<'a, [u8]>>, DescriptorError> {
        Ok(match self {
            Key::ClientIp => Some(Cow::Borrowed(write_ip(facts.client_ip.ok_or(DescriptorError::NoPeerAddress)?, buf))),
            Key::Header(h) => facts.headers.get(h).map(|v| Cow::Borrowed(v.as_bytes())),
            Key::Custom(f) => f(facts).map(|k| Cow::Owned(k.into_bytes())),
        })
    }
}

/// `ip` as its 4 (IPv4) or 16 (IPv6) bytes in `buf`: the in-memory store's
/// key for an address (its text took a tenth of an allowed request). The two
/// lengths keep the families apart.
fn ip_bytes(ip: std::net::IpAddr, buf: &mut [u8; 48]) -> &[u8] {
    match ip {
        std::net::IpAddr::V4(v4) => {
            buf[..4].copy_from_slice(&v4.octets());
            &buf[..4]
        }
        std::net::IpAddr::V6(v6) => {
            buf[..16].copy_from_slice(&v6.octets());
            &buf[..16]
        }
    }
}

/// A key as text, for stores keyed by text: an IP address or a custom key as
/// it is, a header value that is not UTF-8 with its bad bytes replaced.
fn key_text(key: &[u8]) -> Cow<'_, str> {
    String::from_utf8_lossy(key)
}

/// The decimal text of each octet (up to 3 digits) and its length.
const OCTETS: [([u8; 4], u8); 256] = {
    let mut t = [([0u8; 4], 0u8); 256];
    let mut i = 0;
    while i < 256 {
        let (h, d, o) = ((i / 100) as u8, (i / 10 % 10) as u8, (i % 10) as u8);
        t[i] = if i >= 100 {
            ([b'0' + h, b'0' + d, b'0' + o, b'.'], 3)
        } else if i >= 10 {
            ([b'0' + d, b'0' + o, b'.', 0], 2)
        } else {
            ([b'0' + o, b'.', 0, 0], 1)
        };
        i += 1;
    }
    t
};

/// `ip` as text in `buf`, as `Display` writes it, without `Display`'s cost
/// (see `ip_text`): for descriptor values and forwarding headers.
pub fn ip_str(ip: std::net::IpAddr, buf: &mut [u8; 48]) -> &str {
    // Always ASCII.
    std::str::from_utf8(ip_text(ip, buf)).unwrap_or_default()
}

/// `ip` as text in `buf` (an IPv6 address is at most 45 bytes). IPv4, the
/// common case, is written from a table, four bytes per octet (the spare
/// ones overwritten by the next): `Display` costs a tenth of a request.
fn ip_text(ip: std::net::IpAddr, buf: &mut [u8; 48]) -> &[u8] {
    let len = match ip {
        std::net::IpAddr::V4(v4) => {
            let mut n = 0;
            for octet in v4.octets() {
                let (text, len) = OCTETS[usize::from(octet)];
                buf[n..n + 4].copy_from_slice(&text);
                n += usize::from(len) + 1;
            }
            // Without the last octet's dot.
            n - 1
        }
        std::net::IpAddr::V6(_) => {
            let mut w = &mut buf[..];
            let _ = write!(w, "{ip}");
            48 - w.len()
        }
    };
    &buf[..len]
}

/// One limit, one counter per key: the simplest decider.
///
/// ```
/// use floodgate_core::{Algorithm, Limit, MemoryStore};
/// use floodgate_tower::{Key, KeyedLimit};
/// use std::time::Duration;
/// // 10 requests a second per client address, bursts of 20.
/// let limit = Limit::new(Algorithm::Gcra { burst: Some(20) }, 10, Duration::from_secs(1)).unwrap();
/// let decider = KeyedLimit::new(limit, Key::ClientIp, MemoryStore::new());
/// ```
pub struct KeyedLimit<S> {
    rule: Rule,
    key: Key,
    limiter: Limiter<S>,
    /// What a request asks ([`passing_hits`]).
    hits: u64,
}

impl<S> std::fmt::Debug for KeyedLimit<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyedLimit").field("limit", &self.rule.limit).field("key", &self.key).finish_non_exhaustive()
    }
}

impl<S: Store> KeyedLimit<S> {
    /// `limit` per distinct `key`, counted in `store` (fails open when the
    /// store fails; use a rules file for other failure modes). Each request
    /// takes one hit; on a limit charged after the work
    /// ([`Charge::After`]) it only asks the gate, and the cost is charged
    /// into `store` by whoever learns it.
    pub fn new(limit: Limit, key: Key, store: S) -> Self {
        let hits = passing_hits(&limit);
        Self {
            rule: Rule::from_limit(limit, "tower".to_owned()),
            key,
            limiter: Limiter::new(store, MemoryStore::new()),
            hits,
        }
    }

    /// Name the limit (the IETF headers' policy name).
    #[must_use]
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.rule.name = Some(Arc::from(name.into()));
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        self.limiter.store()
    }
}

impl<S: Store> KeyedLimit<S> {
    /// The answer of the limit's decision (one limit: no verdicts to weigh).
    /// A struct literal with no other way in, so it is written where the
    /// caller wants it (an answer built in a temporary and copied out costs
    /// a `memcpy` call whose loads stall on the stores just made).
    #[inline(always)]
    fn answer(&self, d: Decision) -> Answer {
        let limit = self.limit();
        Answer {
            allowed: d.allowed,
            retry_after: if d.allowed { None } else { d.retry_after },
            delay: if d.allowed { d.delay } else { Duration::ZERO },
            headline: Some(Headline {
                name: self.rule.name.clone(),
                requests_per_unit: limit.limit(),
                window: limit.window(),
                decision: d,
            }),
        }
    }

    /// The answer of a store failure: the limiter's failure policy (open),
    /// given the key as text, as it is given every key (a store keyed by
    /// bytes was given an address's bytes): a `custom` key as it was
    /// computed, the others written again from the request.
    #[cold]
    #[inline(never)]
    fn answer_failed(&self, facts: &RequestFacts<'_>, custom: Option<Vec<u8>>, error: StoreError) -> Answer {
        let mut text = [0u8; 48];
        let key = match custom {
            Some(key) => key,
            None => self.key.of(facts, &mut text, ip_text).ok().flatten().map(Cow::into_owned).unwrap_or_default(),
        };
        let key = key_text(&key);
        let check = RuleCheck { key: &key, rule: &self.rule, hits: self.hits, op: Op::Take };
        answer_of_one(&check, &self.limiter.verdict(&check, Err(error)))
    }

    fn limit(&self) -> &Limit {
        self.rule.limit.as_ref().expect("a KeyedLimit's rule has its limit")
    }
}

impl<S: Store + 'static> Decide for KeyedLimit<S> {
    // Not an `async fn`: the key is written and the store asked here, and
    // only the store's answer is awaited, by a future whose `poll` is
    // always inlined. So the layer's `call`, which polls it once over the
    // in-memory store, inlines all of it, and the answer is built where the
    // call reads it (an `async` block's `poll` is only hinted inline, stays
    // out of line, and its answer is copied out by a `memcpy` call whose
    // loads stall on the stores just made).
    #[inline(always)]
    fn decide(&self, facts: &RequestFacts<'_>) -> impl Future<Output = Result<Answer, DecideError>> + Send {
        let store = self.limiter.store();
        let mut buf = [0u8; 48];
        let write_ip = if store.keys_by_bytes() { ip_bytes } else { ip_text };
        // A custom key is kept for the failure policy (it is not asked
        // twice); the other keys are written again from the request.
        let (asked, applied, custom) = match self.key.of(facts, &mut buf, write_ip) {
            Ok(Some(Cow::Borrowed(key))) => (Asked::Store, Some(store.apply_bytes(key, self.limit(), self.hits)), None),
            Ok(Some(Cow::Owned(key))) => {
                (Asked::Store, Some(store.apply_bytes(&key, self.limit(), self.hits)), Some(key))
            }
            Ok(None) => (Asked::Unlimited, None, None),
            Err(e) => (Asked::Refused(e), None, None),
        };
        KeyedDecision { decider: self, facts, asked, custom, applied }
    }

    fn answers_at_once(&self) -> bool {
        self.limiter.store().answers_at_once()
    }
}

/// What a [`KeyedLimit`] did with a request when it was asked.
enum Asked {
    /// Asked the store (the answer is awaited).
    Store,
    /// Nothing limits the request (it has no key).
    Unlimited,
    /// The key could not be taken from the request.
    Refused(DescriptorError),
    /// Answered (polled after it completed).
    Done,
}

pin_project_lite::pin_project! {
    /// A [`KeyedLimit`]'s decision: the store was asked when it was made;
    /// this waits for its answer.
    struct KeyedDecision<'d, 'f, 'r, S, F> {
        decider: &'d KeyedLimit<S>,
        facts: &'f RequestFacts<'r>,
        asked: Asked,
        custom: Option<Vec<u8>>,
        #[pin]
        applied: Option<F>,
    }
}

impl<S: Store, F: Future<Output = Result<Decision, StoreError>>> Future for KeyedDecision<'_, '_, '_, S, F> {
    type Output = Result<Answer, DecideError>;

    #[inline(always)]
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = self.project();
        // Each answer is built in its `Poll` (not moved into one).
        match std::mem::replace(this.asked, Asked::Done) {
            Asked::Store => {
                let applied = this.applied.as_pin_mut().expect("a store's future while it is asked");
                match applied.poll(cx) {
                    Poll::Ready(Ok(d)) => Poll::Ready(Ok(this.decider.answer(d))),
                    Poll::Ready(Err(e)) => {
                        Poll::Ready(Ok(this.decider.answer_failed(this.facts, this.custom.take(), e)))
                    }
                    Poll::Pending => {
                        *this.asked = Asked::Store;
                        Poll::Pending
                    }
                }
            }
            Asked::Unlimited => Poll::Ready(Ok(Answer::unlimited())),
            Asked::Refused(e) => Poll::Ready(Err(e.into())),
            Asked::Done => panic!("a KeyedLimit's decision polled after it completed"),
        }
    }
}

fn answer_of_one(check: &RuleCheck<'_>, verdict: &Verdict) -> Answer {
    let outcome = OutcomeView { allowed: !verdict.denies(), verdicts: std::slice::from_ref(verdict) };
    Answer::of(std::slice::from_ref(check), outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use floodgate_testing::at_once;

    #[test]
    fn header_keys_are_their_bytes_in_the_memory_store() {
        let limit = Limit::new(floodgate_core::Algorithm::FixedWindow, 1, Duration::from_secs(3600)).unwrap();
        let decider = KeyedLimit::new(limit, Key::Header(HeaderName::from_static("x-user")), MemoryStore::new());
        let (method, uri) = (http::Method::GET, http::Uri::from_static("/"));
        let allowed = |value: &[u8]| {
            let mut headers = http::HeaderMap::new();
            headers.insert("x-user", http::HeaderValue::from_bytes(value).unwrap());
            let facts = RequestFacts { method: &method, uri: &uri, headers: &headers, client_ip: None, body: None };
            at_once(decider.decide(&facts)).unwrap().allowed
        };
        assert!(allowed(b"alice"));
        assert!(!allowed(b"alice"));
        // Two values that are not UTF-8 and would read alike as lossy text
        // are two clients, not one.
        assert!(allowed(b"\xff"));
        assert!(allowed(b"\xfe"));
        assert!(!allowed(b"\xff"));
        // The key is the header's text: the same counter as the store's.
        let limit = decider.limit().clone();
        assert!(!decider.store().apply_sync("alice", &limit, 1).unwrap().allowed);
    }

    #[test]
    fn client_ips_are_their_address_bytes_in_the_memory_store() {
        let limit = Limit::new(floodgate_core::Algorithm::FixedWindow, 1, Duration::from_secs(3600)).unwrap();
        let decider = KeyedLimit::new(limit, Key::ClientIp, MemoryStore::new());
        let (method, uri, headers) = (http::Method::GET, http::Uri::from_static("/"), http::HeaderMap::new());
        let allowed = |ip: &str| {
            let facts =
                RequestFacts { method: &method, uri: &uri, headers: &headers, client_ip: ip.parse().ok(), body: None };
            at_once(decider.decide(&facts)).unwrap().allowed
        };
        for ip in ["10.0.0.1", "10.0.0.2", "::1", "::ffff:10.0.0.1", "2001:db8::a00:1"] {
            assert!(allowed(ip), "{ip}: its own counter");
            assert!(!allowed(ip), "{ip}: spent");
        }
        // The keys are the addresses' bytes: four for IPv4, sixteen for IPv6
        // (the store's own counters, spent above).
        assert_eq!(decider.store().len(), 5);
        let limit = decider.limit().clone();
        let allowed_by_key = |key: &[u8]| at_once(decider.store().apply_bytes(key, &limit, 1)).unwrap().allowed;
        let mut v6_loopback = [0u8; 16];
        v6_loopback[15] = 1;
        assert!(!allowed_by_key(&[10, 0, 0, 1]));
        assert!(!allowed_by_key(&v6_loopback));
        assert!(allowed_by_key(&[10, 0, 0, 3]));
    }

    #[test]
    fn a_keyed_limit_fails_open_when_its_store_refuses() {
        use floodgate_core::OnFull;
        let store = MemoryStore::builder().shards(1).max_keys(1).on_full(OnFull::Refuse).build();
        let limit = Limit::new(floodgate_core::Algorithm::FixedWindow, 5, Duration::from_secs(60)).unwrap();
        let decider = KeyedLimit::new(limit, Key::ClientIp, store);
        let (method, uri, headers) = (http::Method::GET, http::Uri::from_static("/"), http::HeaderMap::new());
        let answer = |ip: &str| {
            let facts =
                RequestFacts { method: &method, uri: &uri, headers: &headers, client_ip: ip.parse().ok(), body: None };
            at_once(decider.decide(&facts)).unwrap()
        };
        let first = answer("10.0.0.1");
        assert_eq!(first.headline.as_ref().map(|h| h.decision.remaining), Some(4));
        // The store is full and refuses a second key: the limit fails open,
        // and says so with its whole limit remaining.
        let refused = answer("10.0.0.2");
        assert!(refused.allowed);
        assert_eq!(refused.retry_after, None);
        let h = refused.headline.expect("the limit still heads the answer");
        assert_eq!((h.requests_per_unit, h.decision.remaining), (5, 5));
        assert_eq!(decider.store().len(), 1);
    }

    /// A limit charged after the work is only gated by a request passing
    /// through: it takes nothing, and shuts once the cost charged elsewhere
    /// (here straight into the store) uses the budget up.
    #[test]
    fn a_limit_charged_after_the_work_is_gated_not_charged() {
        let yaml = "domain: api\nrequest_descriptors:\n  - actions: [{request_headers: {header_name: x-tenant, descriptor_key: tenant}}]\ndescriptors:\n  - key: tenant\n    rate_limit: {unit: hour, requests_per_unit: 2, charge: after}\n";
        let rules = RuleSet::from_yaml("api.yaml", yaml).unwrap();
        let m = rules.matches("api", &[("tenant", "acme")]).unwrap();
        let (key, limit) = (m.counter_key(0), m.rules[0].limit.clone().unwrap());
        let decider = RulesDecider::new(rules, "api", MemoryStore::new());
        gated_not_charged(&decider, "x-tenant", "acme", || {
            assert!(decider.limiter.store().apply_sync(&key, &limit, 3).unwrap().allowed, "a late charge: debt");
        });
    }

    #[test]
    fn a_keyed_limit_charged_after_the_work_is_gated_not_charged() {
        let limit = Limit::new(floodgate_core::Algorithm::FixedWindow, 2, Duration::from_secs(3600)).unwrap();
        let limit = limit.with_charge(Charge::After).unwrap();
        let decider =
            KeyedLimit::new(limit.clone(), Key::Header(HeaderName::from_static("x-user")), MemoryStore::new());
        gated_not_charged(&decider, "x-user", "alice", || {
            assert!(decider.store().apply_sync("alice", &limit, 2).unwrap().allowed, "the cost, charged after");
        });
    }

    /// Requests with `header: value` through `decider`, whose limit is
    /// charged after the work: they pass its gate and take nothing; once
    /// `charge` spends the budget in the store, the gate shuts.
    fn gated_not_charged(decider: &impl Decide, header: &'static str, value: &'static str, charge: impl FnOnce()) {
        let (method, uri) = (http::Method::GET, http::Uri::from_static("/"));
        let mut headers = http::HeaderMap::new();
        headers.insert(header, http::HeaderValue::from_static(value));
        let facts = RequestFacts { method: &method, uri: &uri, headers: &headers, client_ip: None, body: None };
        for _ in 0..5 {
            assert!(at_once(decider.decide(&facts)).unwrap().allowed, "a gate takes nothing");
        }
        charge();
        assert!(!at_once(decider.decide(&facts)).unwrap().allowed, "the gate shuts on the debt");
    }

    #[test]
    fn ip_text_matches_display() {
        let mut buf = [0u8; 48];
        for ip in ["0.0.0.0", "10.0.0.1", "192.168.100.255", "1.22.3.44", "::1", "2001:db8::ffff:1:2", "::ffff:1.2.3.4"]
        {
            let ip: std::net::IpAddr = ip.parse().unwrap();
            assert_eq!(ip_text(ip, &mut buf), ip.to_string().as_bytes());
            assert_eq!(ip_str(ip, &mut buf), ip.to_string());
        }
        let long: std::net::IpAddr = "ffff:ffff:ffff:ffff:ffff:ffff:255.255.255.255".parse().unwrap();
        assert_eq!(ip_text(long, &mut buf), long.to_string().as_bytes());
    }
}
