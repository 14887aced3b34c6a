//! A rule's `cost:`: what a request metered by the reverse proxy or the
//! tower layer reserves when it starts (the estimate) and settles when its
//! response ends (the actual amount, read from the response).
//!
//! ```yaml
//! rate_limits:
//!   - name: tokens per tenant
//!     unit: minute
//!     requests_per_unit: 100000
//!     cost:
//!       estimate: {body: [max_completion_tokens, max_tokens], default: 4096}
//!       actual: {usage: total_tokens}
//!   - name: micro-dollars per tenant
//!     unit: day
//!     requests_per_unit: 5000000
//!     cost:
//!       estimate: {body: max_tokens, default: 4096, times: 0.6, plus: 300}
//!       actual: {usage: {prompt_tokens: 0.15, completion_tokens: 0.6}}
//! ```
//!
//! Only the proxy and the tower layer read it (they see the response); the
//! service's APIs take their amounts from the caller.

use std::sync::Arc;

/// What a metered request reserves and settles on a rule (`cost:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cost {
    /// What the request reserves.
    pub estimate: Estimate,
    /// What the response settles it at.
    pub actual: Actual,
    /// Ask an OpenAI-compatible upstream to end a streamed response with its
    /// usage (`stream_options.include_usage`) when the request streams
    /// without asking (default true, when `actual` reads usage).
    pub include_usage: bool,
}

/// A request's estimate on a rule: read from `from`, then `× times + plus`;
/// `default` when it cannot be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Estimate {
    /// Where it is read.
    pub from: EstimateFrom,
    /// The estimate when `from` has no value (a constant estimate's value).
    pub default: u64,
    /// The factor, in millionths (1 000 000: × 1).
    pub times: Weight,
    /// Added after the factor.
    pub plus: u64,
}

/// Where an estimate is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EstimateFrom {
    /// Nowhere: always `default`.
    Constant,
    /// A request header holding a whole number (its name, lowercase).
    Header(Arc<str>),
    /// A whole-number field at the top of the request's JSON body: the first
    /// present of these names (`[max_completion_tokens, max_tokens]`).
    Body(Arc<[Arc<str>]>),
}

/// Where the actual amount is read from the response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Actual {
    /// A response header holding a whole number (its name, lowercase).
    Header(Arc<str>),
    /// The `usage` object of an OpenAI-compatible response (a JSON body, or
    /// the chunk of an event stream that carries it): the weighted sum of
    /// these fields, rounded up (`{usage: total_tokens}` is weight 1).
    Usage(Weights),
}

/// Usage fields and their weights.
pub type Weights = Arc<[(Arc<str>, Weight)]>;

/// A non-negative decimal factor in millionths (`0.15` is 150 000).
pub type Weight = u64;

/// One, as a [`Weight`].
pub const ONE: Weight = 1_000_000;

/// The largest weight: a million.
pub const MAX_WEIGHT: Weight = 1_000_000 * ONE;

impl Estimate {
    /// The estimate given the value read (`None`: nothing read).
    pub fn of(&self, read: Option<u64>) -> u64 {
        match read {
            Some(v) if self.from != EstimateFrom::Constant => weighted([(v, self.times)]).saturating_add(self.plus),
            _ => self.default,
        }
    }
}

impl Actual {
    /// Whether the amount is read from a `usage` object.
    pub fn reads_usage(&self) -> bool {
        matches!(self, Actual::Usage(_))
    }

    /// The amount of a `usage` object, given how to read one of its fields
    /// (`None` when none of the weighted fields is present).
    pub fn of_usage(&self, field: impl Fn(&str) -> Option<u64>) -> Option<u64> {
        let Actual::Usage(weights) = self else { return None };
        let mut any = false;
        let sum = weighted(weights.iter().filter_map(|(name, w)| {
            let v = field(name)?;
            any = true;
            Some((v, *w))
        }));
        any.then_some(sum)
    }
}

/// What metering a domain's requests needs: some rule of it has a `cost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Metering {
    /// Some estimate reads the request's JSON body, or a rule asks streams
    /// for their usage (the body is rewritten).
    pub body: bool,
    /// Some actual amount reads the response's `usage`.
    pub usage: bool,
    /// Some rule asks streamed responses for their usage.
    pub include_usage: bool,
    /// Some limit is a concurrency limit: a request holds its slot until its
    /// response ends (a lease, released then).
    pub leases: bool,
}

impl Metering {
    /// The metering of these costs (`None`: there are none).
    pub fn of<'c>(costs: impl Iterator<Item = &'c Cost>) -> Option<Metering> {
        costs.fold(None, |m, c| {
            let m: Metering = m.unwrap_or_default();
            Some(Metering {
                // Asking for usage rewrites the body: it is read.
                body: m.body || matches!(c.estimate.from, EstimateFrom::Body(_)) || c.include_usage,
                usage: m.usage || c.actual.reads_usage(),
                include_usage: m.include_usage || c.include_usage,
                leases: m.leases,
            })
        })
    }
}

/// Σ value × weight, rounded up once at the end (saturating).
fn weighted(terms: impl IntoIterator<Item = (u64, Weight)>) -> u64 {
    let millionths: u128 = terms.into_iter().map(|(v, w)| u128::from(v) * u128::from(w)).sum();
    u64::try_from(millionths.div_ceil(u128::from(ONE))).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weighted_sums_round_up_once() {
        let money = Actual::Usage(Arc::from([
            (Arc::from("prompt_tokens"), 150_000),
            (Arc::from("completion_tokens"), 600_000),
        ]));
        let usage = |p: u64, c: u64| {
            move |f: &str| (f == "prompt_tokens").then_some(p).or((f == "completion_tokens").then_some(c))
        };
        // 0.15 × 1000 + 0.6 × 7 = 154.2: 155 micro-units.
        assert_eq!(money.of_usage(usage(1000, 7)), Some(155));
        assert_eq!(money.of_usage(usage(0, 0)), Some(0));
        assert_eq!(money.of_usage(|_| None), None, "no weighted field: no amount");
        let double = Actual::Usage(Arc::from([(Arc::from("prompt_tokens"), 2 * ONE)]));
        assert_eq!(double.of_usage(usage(u64::MAX, 0)), Some(u64::MAX), "saturates");
        let est = Estimate {
            from: EstimateFrom::Body(Arc::from([Arc::from("max_tokens")])),
            default: 4096,
            times: 600_000,
            plus: 300,
        };
        assert_eq!(est.of(Some(1000)), 900);
        assert_eq!(est.of(None), 4096);
        let constant = Estimate { from: EstimateFrom::Constant, ..est };
        assert_eq!(constant.of(Some(1)), 4096);
    }
}
