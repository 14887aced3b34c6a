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

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use crate::Headline;

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

/// A header mode that is not one of the four.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown header mode `{0}`: use none, x-ratelimit, ietf or both")]
pub struct UnknownHeaderMode(pub String);

impl FromStr for HeaderMode {
    type Err = UnknownHeaderMode;

    fn from_str(s: &str) -> Result<Self, UnknownHeaderMode> {
        match s {
            "none" => Ok(Self::None),
            "x-ratelimit" => Ok(Self::XRateLimit),
            "ietf" => Ok(Self::Ietf),
            "both" => Ok(Self::Both),
            _ => Err(UnknownHeaderMode(s.to_owned())),
        }
    }
}

/// One rate-limit header field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// `retry-after`
    RetryAfter,
    /// `x-ratelimit-limit`
    XRateLimitLimit,
    /// `x-ratelimit-remaining`
    XRateLimitRemaining,
    /// `x-ratelimit-reset`
    XRateLimitReset,
    /// `ratelimit-policy`
    RateLimitPolicy,
    /// `ratelimit`
    RateLimit,
}

impl Field {
    /// The field's name, in lower case.
    pub const fn name(self) -> &'static str {
        match self {
            Field::RetryAfter => "retry-after",
            Field::XRateLimitLimit => "x-ratelimit-limit",
            Field::XRateLimitRemaining => "x-ratelimit-remaining",
            Field::XRateLimitReset => "x-ratelimit-reset",
            Field::RateLimitPolicy => "ratelimit-policy",
            Field::RateLimit => "ratelimit",
        }
    }
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
    headline: Option<&Headline>,
    mode: HeaderMode,
) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    write_rate_limit_headers(allowed, retry_after, headline, mode, |field, value| {
        out.push((field.name(), value.to_string()));
    });
    out
}

/// The same headers, each handed to `emit` as its field and value, so a
/// caller can write every value into one buffer ([`Value::write_to`]; the
/// tower layer does: one allocation for all of a response's values).
pub fn write_rate_limit_headers(
    allowed: bool,
    retry_after: Option<Duration>,
    headline: Option<&Headline>,
    mode: HeaderMode,
    mut emit: impl FnMut(Field, Value<'_>),
) {
    if !allowed && let Some(wait) = retry_after {
        emit(Field::RetryAfter, Value::Number(ceil_secs(wait).max(1)));
    }
    let Some(h) = headline else { return };
    let reset = ceil_secs(h.decision.reset_after);
    if matches!(mode, HeaderMode::XRateLimit | HeaderMode::Both) {
        emit(Field::XRateLimitLimit, Value::Number(h.requests_per_unit));
        emit(Field::XRateLimitRemaining, Value::Number(h.decision.remaining));
        emit(Field::XRateLimitReset, Value::Number(reset));
    }
    if matches!(mode, HeaderMode::Ietf | HeaderMode::Both) {
        let name = h.name.as_deref().unwrap_or("default");
        emit(
            Field::RateLimitPolicy,
            Value::Item { name, params: [('q', h.requests_per_unit), ('w', ceil_secs(h.window))] },
        );
        emit(Field::RateLimit, Value::Item { name, params: [('r', h.decision.remaining), ('t', reset)] });
    }
}

/// One header value, written by [`Value::write_to`] (or `Display`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value<'a> {
    /// A decimal number.
    Number(u64),
    /// An RFC 8941 item: the name as an sf-string, then two integer
    /// parameters (`"name";q=10;w=60`).
    Item {
        /// The limit's name.
        name: &'a str,
        /// The parameters, in order.
        params: [(char, u64); 2],
    },
}

impl Value<'_> {
    /// Append the value to `out`, without `core::fmt` (a header value is
    /// written for every response).
    pub fn write_to(&self, out: &mut Vec<u8>) {
        match *self {
            Value::Number(n) => write_u64(n, out),
            Value::Item { name, params } => {
                write_sf_string(name, out);
                for (key, n) in params {
                    out.push(b';');
                    let mut k = [0u8; 4];
                    out.extend_from_slice(key.encode_utf8(&mut k).as_bytes());
                    out.push(b'=');
                    write_u64(n, out);
                }
            }
        }
    }
}

impl fmt::Display for Value<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut out = Vec::with_capacity(32);
        self.write_to(&mut out);
        // Only ASCII is ever written.
        f.write_str(std::str::from_utf8(&out).map_err(|_| fmt::Error)?)
    }
}

/// "00" to "99": two digits per division.
const PAIRS: &[u8; 200] = b"0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// `n` in decimal, two digits at a time (a response carries up to five
/// numbers, written on every request).
fn write_u64(n: u64, out: &mut Vec<u8>) {
    out.extend_from_slice(Decimal::of(n).as_bytes());
}

/// A number's decimal digits, written without `fmt` (header values and
/// counter keys are built on every decision).
pub(crate) struct Decimal {
    digits: [u8; 20],
    start: usize,
}

impl Decimal {
    /// `n`'s digits, two at a time.
    #[inline]
    pub(crate) fn of(mut n: u64) -> Self {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        while n >= 100 {
            let pair = 2 * (n % 100) as usize;
            n /= 100;
            i -= 2;
            digits[i..i + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
        }
        if n >= 10 {
            let pair = 2 * n as usize;
            i -= 2;
            digits[i..i + 2].copy_from_slice(&PAIRS[pair..pair + 2]);
        } else {
            i -= 1;
            digits[i] = b'0' + n as u8;
        }
        Decimal { digits, start: i }
    }

    /// The digits, as bytes.
    #[inline]
    pub(crate) fn as_bytes(&self) -> &[u8] {
        &self.digits[self.start..]
    }

    /// The digits, as text.
    #[inline]
    pub(crate) fn as_str(&self) -> &str {
        // Only ASCII digits are ever written.
        std::str::from_utf8(self.as_bytes()).unwrap_or_default()
    }
}

/// `s` as an RFC 8941 sf-string: printable ASCII in quotes, `"` and `\`
/// escaped; anything else replaced by `_` (one per character).
fn write_sf_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    if s.bytes().all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\') {
        out.extend_from_slice(s.as_bytes());
    } else {
        for c in s.chars() {
            match c {
                '"' | '\\' => out.extend_from_slice(&[b'\\', c as u8]),
                ' '..='~' => out.push(c as u8),
                _ => out.push(b'_'),
            }
        }
    }
    out.push(b'"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Decision;

    #[test]
    fn numbers_are_written_as_decimal_at_every_length() {
        let mut n = 1u64;
        let mut cases = vec![0, u64::MAX, u64::MAX - 1];
        while let Some(next) = n.checked_mul(10) {
            cases.extend([n - 1, n, n + 1, n * 5 + 3]);
            n = next;
        }
        cases.extend([n - 1, n, n + 1]);
        for n in cases {
            let mut out = vec![b'x'];
            write_u64(n, &mut out);
            assert_eq!(out, format!("x{n}").into_bytes(), "{n}");
        }
    }

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
            name: Some("per \"user\"".into()),
            requests_per_unit: 10,
            window: Duration::from_secs(60),
            decision: d,
        };
        let h = rate_limit_headers(false, d.retry_after, Some(&headline), HeaderMode::Both);
        let get = |n: &str| h.iter().find(|(k, _)| *k == n).map(|(_, v)| v.as_str());
        assert_eq!(get("retry-after"), Some("1"));
        assert_eq!(get("x-ratelimit-reset"), Some("2"));
        assert_eq!(get("ratelimit-policy"), Some("\"per \\\"user\\\"\";q=10;w=60"));
        assert_eq!(get("ratelimit"), Some("\"per \\\"user\\\"\";r=0;t=2"));
        // No wait helps: no Retry-After.
        assert!(rate_limit_headers(false, None, None, HeaderMode::None).is_empty());
        // Non-ASCII becomes `_`, one per character.
        let headline = Headline { name: Some("caf\u{e9} \\".into()), ..headline };
        let h = rate_limit_headers(true, None, Some(&headline), HeaderMode::Ietf);
        assert_eq!(h[0], ("ratelimit-policy", "\"caf_ \\\\\";q=10;w=60".to_owned()));
        assert_eq!(Value::Number(u64::MAX).to_string(), "18446744073709551615");
        assert_eq!(Value::Number(0).to_string(), "0");
        // Allowed: no Retry-After even with a wait.
        let h = rate_limit_headers(true, Some(Duration::from_secs(3)), Some(&headline), HeaderMode::XRateLimit);
        assert_eq!(h.len(), 3);
    }
}
