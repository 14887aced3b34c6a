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

use std::fmt::{self, Write as _};
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
    write_rate_limit_headers(allowed, retry_after, headline, mode, |name, value| out.push((name, value.to_string())));
    out
}

/// The same headers, each handed to `emit` as its name and formatting
/// arguments, so a caller can write every value into one buffer (the tower
/// layer does: one allocation for all of a response's values).
pub fn write_rate_limit_headers(
    allowed: bool,
    retry_after: Option<Duration>,
    headline: Option<Headline<'_>>,
    mode: HeaderMode,
    mut emit: impl FnMut(&'static str, fmt::Arguments<'_>),
) {
    if !allowed && let Some(wait) = retry_after {
        emit("retry-after", format_args!("{}", ceil_secs(wait).max(1)));
    }
    let Some(h) = headline else { return };
    let reset = ceil_secs(h.decision.reset_after);
    if matches!(mode, HeaderMode::XRateLimit | HeaderMode::Both) {
        emit("x-ratelimit-limit", format_args!("{}", h.requests_per_unit));
        emit("x-ratelimit-remaining", format_args!("{}", h.decision.remaining));
        emit("x-ratelimit-reset", format_args!("{reset}"));
    }
    if matches!(mode, HeaderMode::Ietf | HeaderMode::Both) {
        let name = SfString(h.name.unwrap_or("default"));
        emit("ratelimit-policy", format_args!("{name};q={};w={}", h.requests_per_unit, ceil_secs(h.window)));
        emit("ratelimit", format_args!("{name};r={};t={reset}", h.decision.remaining));
    }
}

/// An RFC 8941 sf-string: printable ASCII in quotes, `"` and `\` escaped;
/// anything else replaced by `_`.
struct SfString<'a>(&'a str);

impl fmt::Display for SfString<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_char('"')?;
        for c in self.0.chars() {
            match c {
                '"' | '\\' => {
                    f.write_char('\\')?;
                    f.write_char(c)?;
                }
                ' '..='~' => f.write_char(c)?,
                _ => f.write_char('_')?,
            }
        }
        f.write_char('"')
    }
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
