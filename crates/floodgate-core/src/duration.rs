//! Human durations: `250ms`, `1s`, `90s`, `1m`, `1h`, `1d`, `1w`, `1500us`.

use std::fmt;
use std::time::Duration;

/// Why a duration did not parse; the message says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    /// Nothing to parse.
    #[error("empty duration: write a number and a unit, e.g. 250ms, 1s, 90s, 1m, 1h, 1d")]
    Empty,
    /// A number without a unit.
    #[error("duration `{0}` has no unit: write e.g. {0}s or {0}ms (units: us, ms, s, m, h, d, w)")]
    NoUnit(String),
    /// The text does not start with a whole number.
    #[error("duration `{0}` must start with a whole number, e.g. 250ms, 1s, 90s, 1m, 1h, 1d")]
    NoNumber(String),
    /// The unit is not one we know.
    #[error("duration `{text}` has unknown unit `{unit}`: use us, ms, s, m, h, d or w")]
    UnknownUnit {
        /// The whole input.
        text: String,
        /// The unit as written.
        unit: String,
    },
    /// The value does not fit.
    #[error("duration `{0}` is too large")]
    Overflow(String),
}

/// Parse a duration: a whole number followed by one unit — `us`, `ms`, `s`,
/// `m`, `h`, `d` (24 h) or `w` (7 d).
///
/// ```
/// use floodgate_core::parse_duration;
/// use std::time::Duration;
/// assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
/// assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
/// assert!(parse_duration("90").is_err());
/// ```
pub fn parse_duration(text: &str) -> Result<Duration, DurationError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(DurationError::Empty);
    }
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return Err(DurationError::NoNumber(t.to_owned()));
    }
    let n: u64 = num.parse().map_err(|_| DurationError::Overflow(t.to_owned()))?;
    let micros_per: u64 = match unit.trim() {
        "" => return Err(DurationError::NoUnit(t.to_owned())),
        "us" | "µs" => 1,
        "ms" => 1_000,
        "s" => 1_000_000,
        "m" => 60_000_000,
        "h" => 3_600_000_000,
        "d" => 86_400_000_000,
        "w" => 604_800_000_000,
        other => {
            return Err(DurationError::UnknownUnit { text: t.to_owned(), unit: other.to_owned() });
        }
    };
    n.checked_mul(micros_per).map(Duration::from_micros).ok_or_else(|| DurationError::Overflow(t.to_owned()))
}

/// Displays a duration in the largest unit that divides it exactly, in the
/// syntax [`parse_duration`] reads (`90s`, `1h`, `1500us`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl fmt::Display for HumanDuration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let us = crate::clock::micros(self.0);
        for (unit, per) in [
            ("w", 604_800_000_000u64),
            ("d", 86_400_000_000),
            ("h", 3_600_000_000),
            ("m", 60_000_000),
            ("s", 1_000_000),
            ("ms", 1_000),
        ] {
            if us != 0 && us.is_multiple_of(per) {
                return write!(f, "{}{unit}", us / per);
            }
        }
        write!(f, "{us}us")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        let cases = [
            ("1500us", 1_500),
            ("250ms", 250_000),
            ("1s", 1_000_000),
            ("90s", 90_000_000),
            ("1m", 60_000_000),
            ("1h", 3_600_000_000),
            ("1d", 86_400_000_000),
            ("2w", 1_209_600_000_000),
            (" 5 s ", 5_000_000),
        ];
        for (text, us) in cases {
            assert_eq!(parse_duration(text), Ok(Duration::from_micros(us)), "{text}");
        }
    }

    #[test]
    fn rejects_with_a_hint() {
        assert_eq!(parse_duration(""), Err(DurationError::Empty));
        assert!(matches!(parse_duration("90"), Err(DurationError::NoUnit(_))));
        assert!(matches!(parse_duration("s"), Err(DurationError::NoNumber(_))));
        assert!(matches!(parse_duration("-1s"), Err(DurationError::NoNumber(_))));
        assert!(matches!(parse_duration("1.5s"), Err(DurationError::UnknownUnit { .. })));
        assert!(matches!(parse_duration("3y"), Err(DurationError::UnknownUnit { .. })));
        assert!(matches!(parse_duration("99999999999999999999s"), Err(DurationError::Overflow(_))));
        assert!(matches!(parse_duration("99999999999w"), Err(DurationError::Overflow(_))));
        let msg = parse_duration("90").unwrap_err().to_string();
        assert!(msg.contains("90s"), "{msg}");
    }

    #[test]
    fn displays_round_trip() {
        for text in ["1500us", "250ms", "90s", "1m", "1h", "1d", "2w"] {
            let d = parse_duration(text).unwrap();
            assert_eq!(HumanDuration(d).to_string(), text);
        }
    }
}
