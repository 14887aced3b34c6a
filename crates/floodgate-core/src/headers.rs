//! Rate-limit response headers, one implementation for every adapter (RLS
//! `response_headers_to_add`, the HTTP APIs, the reverse proxy and the tower
//! layer).
//!
//! * `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`
//!   (seconds, rounded up): what envoyproxy/ratelimit sends.
//! * `RateLimit-Policy: "name";q=Q;w=W` and `RateLimit: "name";r=R;t=T`: the
//!   IETF httpapi draft's structured fields (`name` is the rule's `name`, else
//!   `default`).
//! * `Retry-After` (seconds, rounded up, at least 1) on a denial when some
//!   wait helps.
//!
//! The values describe the *headline* limit: the most restrictive one
//! ([`most_restrictive`](crate::limiter::most_restrictive)).

use std::str::FromStr;
use std::time::Duration;

use crate::Decision;

/// Which rate-limit headers to send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeaderMode {
    /// None (only `Retry-After` on denials).
    None,
    /// `X-RateLimit-*`.
    XRateLimit,
    /// The IETF draft's `RateLimit` and `RateLimit-Policy`.
    Ietf,
    /// Both.
    #[default]
    Both,
}

impl FromStr for HeaderMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Self::None),
            "x-ratelimit" => Ok(Self::XRateLimit),
            "ietf" => Ok(Self::Ietf),
            "both" => Ok(Self::Both),
            _ => Err(format!("unknown header mode `{s}`: use none, x-ratelimit, ietf or both")),
        }
    }
}

/// The limit the headers describe, and its decision.
#[derive(Debug, Clone, Copy)]
pub struct Headline<'a> {
    /// The rule's `name` (the IETF fields say `default` without one).
    pub name: Option<&'a str>,
    /// Requests per window (`X-RateLimit-Limit`, `q=`).
    pub requests_per_unit: u64,
    /// The window (`w=`).
    pub window: Duration,
    /// The decision (remaining and reset).
    pub decision: &'a Decision,
}

/// Whole seconds, rounded up.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The headers of one answer, as lower-case `(name, value)` pairs:
/// `Retry-After` when `allowed` is false and `retry_after` is known, then
/// the `mode`'s fields for `headline`.
pub fn rate_limit_headers(
    allowed: bool,
    retry_after: Option<Duration>,
    headline: Option<Headline<'_>>,
    mode: HeaderMode,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if !allowed && let Some(wait) = retry_after {
        out.push(("retry-after", ceil_secs(wait).max(1).to_string()));
    }
    let Some(h) = headline else { return out };
    let reset = ceil_secs(h.decision.reset_after);
    if matches!(mode, HeaderMode::XRateLimit | HeaderMode::Both) {
        out.push(("x-ratelimit-limit", h.requests_per_unit.to_string()));
        out.push(("x-ratelimit-remaining", h.decision.remaining.to_string()));
        out.push(("x-ratelimit-reset", reset.to_string()));
    }
    if matches!(mode, HeaderMode::Ietf | HeaderMode::Both) {
        let name = sf_string(h.name.unwrap_or("default"));
        out.push(("ratelimit-policy", format!("{name};q={};w={}", h.requests_per_unit, ceil_secs(h.window))));
        out.push(("ratelimit", format!("{name};r={};t={reset}", h.decision.remaining)));
    }
    out
}

/// An RFC 8941 sf-string: printable ASCII in quotes, `"` and `\` escaped;
/// anything else replaced by `_`.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            ' '..='~' => out.push(c),
            _ => out.push('_'),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn denial_headers_round_up_and_quote() {
        let d = Decision {
            allowed: false,
            limit: 10,
            remaining: 0,
            reset_after: Duration::from_millis(1500),
            retry_after: Some(Duration::from_micros(1)),
            delay: Duration::ZERO,
        };
        let headline = Headline {
            name: Some("per \"user\""),
            requests_per_unit: 10,
            window: Duration::from_secs(60),
            decision: &d,
        };
        let h = rate_limit_headers(false, d.retry_after, Some(headline), HeaderMode::Both);
        let get = |n: &str| h.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str());
        assert_eq!(get("retry-after"), Some("1"));
        assert_eq!(get("x-ratelimit-reset"), Some("2"));
        assert_eq!(get("ratelimit-policy"), Some("\"per \\\"user\\\"\";q=10;w=60"));
        assert_eq!(get("ratelimit"), Some("\"per \\\"user\\\"\";r=0;t=2"));
        // No wait helps: no Retry-After.
        assert!(rate_limit_headers(false, None, None, HeaderMode::None).is_empty());
        // Allowed: no Retry-After even with a wait.
        let h = rate_limit_headers(true, Some(Duration::from_secs(3)), Some(headline), HeaderMode::XRateLimit);
        assert_eq!(h.len(), 3);
    }
}
