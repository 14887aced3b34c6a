//! A request's answer, one type for every adapter (RLS, the HTTP API, the
//! proxy, the tower layer): whether it may go ahead, the limit its
//! rate-limit headers describe, the wait after a denial, and a shaping
//! delay.

use std::sync::Arc;
use std::time::Duration;

use crate::Decision;
use crate::headers::{HeaderMode, rate_limit_headers};
use crate::limiter::{OutcomeView, RuleCheck};

/// The answer for one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    /// Whether the request may go ahead.
    pub allowed: bool,
    /// For a denial: the wait after which the same request could pass
    /// (`None` when no wait helps).
    pub retry_after: Option<Duration>,
    /// For an allowed request under a shaping limit: how long the proxy or
    /// the tower layer holds it (RLS has no such field and ignores it).
    pub delay: Duration,
    /// The limit the rate-limit headers describe (`None`: no limit applied).
    pub headline: Option<Headline>,
}

/// The limit the rate-limit headers describe, and its decision.
#[derive(Debug, Clone, PartialEq)]
pub struct Headline {
    /// The rule's `name` (shared with the rule: no copy per answer; the
    /// IETF fields say `default` without one).
    pub name: Option<Arc<str>>,
    /// Requests per window (`X-RateLimit-Limit`, `q=`).
    pub requests_per_unit: u64,
    /// The window (`w=`).
    pub window: Duration,
    /// The decision (remaining and reset).
    pub decision: Decision,
}

impl Answer {
    /// The answer of a limiter's `outcome` for `checks` (for one check and
    /// its verdict: `std::slice::from_ref` of each).
    pub fn of(checks: &[RuleCheck<'_>], outcome: OutcomeView<'_>) -> Self {
        let headline = outcome.headline_index().and_then(|i| {
            let limit = checks[i].rule.limit.as_ref()?;
            Some(Headline {
                name: checks[i].rule.name.clone(),
                requests_per_unit: limit.limit(),
                window: limit.window(),
                decision: outcome.verdicts[i].decision?,
            })
        });
        Answer { allowed: outcome.allowed, retry_after: outcome.retry_after(), delay: outcome.delay(), headline }
    }

    /// An allowed answer with no limit (nothing matched).
    pub fn unlimited() -> Self {
        Answer { allowed: true, ..Answer::default() }
    }

    /// Its rate-limit headers in `mode`, as lower-case `(name, value)`
    /// pairs ([`rate_limit_headers`]).
    pub fn headers(&self, mode: HeaderMode) -> Vec<(&'static str, String)> {
        rate_limit_headers(self.allowed, self.retry_after, self.headline.as_ref(), mode)
    }
}
