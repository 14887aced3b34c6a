//! Rate-limit response headers, from the limit with the least remaining
//! (ties: the longest reset) — or, when the request is denied, from the most
//! restrictive denying limit.
//!
//! * `X-RateLimit-Limit`, `X-RateLimit-Remaining`, `X-RateLimit-Reset`
//!   (seconds, rounded up): what envoyproxy/ratelimit sends.
//! * `RateLimit-Policy: "name";q=Q;w=W` and `RateLimit: "name";r=R;t=T`: the
//!   IETF httpapi draft's structured fields (`name` is the rule's `name`, else
//!   `default`).
//! * `Retry-After` (seconds, rounded up) on a denial when some wait helps.

use std::str::FromStr;
use std::time::Duration;

use crate::service::Answer;

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

/// Whole seconds, rounded up.
pub fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// The headers for `answer`, as `(name, value)` pairs.
pub fn headers(answer: &Answer, mode: HeaderMode) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if !answer.allowed
        && let Some(wait) = answer.retry_after
    {
        out.push(("retry-after", ceil_secs(wait).max(1).to_string()));
    }
    let Some((info, d)) = &answer.headline else { return out };
    let reset = ceil_secs(d.reset_after);
    if matches!(mode, HeaderMode::XRateLimit | HeaderMode::Both) {
        out.push(("x-ratelimit-limit", info.requests_per_unit.to_string()));
        out.push(("x-ratelimit-remaining", d.remaining.to_string()));
        out.push(("x-ratelimit-reset", reset.to_string()));
    }
    if matches!(mode, HeaderMode::Ietf | HeaderMode::Both) {
        let name = sf_string(info.name.as_deref().unwrap_or("default"));
        out.push(("ratelimit-policy", format!("{name};q={};w={}", info.requests_per_unit, ceil_secs(info.window))));
        out.push(("ratelimit", format!("{name};r={};t={reset}", d.remaining)));
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
    use crate::service::LimitInfo;
    use floodgate_core::Decision;

    fn answer(allowed: bool, retry: Option<Duration>) -> Answer {
        let info = LimitInfo {
            name: Some("per \"user\"".into()),
            requests_per_unit: 10,
            unit: None,
            window: Duration::from_secs(60),
            algorithm: "fixed_window",
        };
        let d = Decision {
            allowed,
            limit: 10,
            remaining: 0,
            reset_after: Duration::from_millis(1500),
            retry_after: retry,
            delay: Duration::ZERO,
        };
        Answer { allowed, statuses: vec![], headline: Some((info, d)), retry_after: retry }
    }

    #[test]
    fn denial_headers_round_up_and_quote() {
        let h = headers(&answer(false, Some(Duration::from_micros(1))), HeaderMode::Both);
        let get = |n: &str| h.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str());
        assert_eq!(get("retry-after"), Some("1"));
        assert_eq!(get("x-ratelimit-reset"), Some("2"));
        assert_eq!(get("ratelimit-policy"), Some("\"per \\\"user\\\"\";q=10;w=60"));
        assert_eq!(get("ratelimit"), Some("\"per \\\"user\\\"\";r=0;t=2"));
        // No wait helps: no Retry-After.
        assert!(headers(&answer(false, None), HeaderMode::None).is_empty());
    }
}
