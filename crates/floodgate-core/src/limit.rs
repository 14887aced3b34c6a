//! A validated limit: algorithm, count and window. Invalid limits cannot be
//! constructed; every bound is checked once, here, with a message that says
//! what to write instead.

use std::fmt;
use std::hash::BuildHasher;
use std::str::FromStr;
use std::time::Duration;

use crate::duration::HumanDuration;
use crate::math::Divisor;

/// Mixed into the fingerprint of a limit charged after the work.
const AFTER_SALT: u32 = 0x6166_7472;

/// Largest `limit` or `burst`: 2^53 − 1. Redis runs its arithmetic in Lua
/// doubles, exact only below 2^53; one bound for every store keeps a rule set
/// that is valid on one store valid on all.
pub const MAX_LIMIT: u64 = (1 << 53) - 1;
/// Shortest window: 1 ms.
pub const MIN_WINDOW: Duration = Duration::from_millis(1);
/// Longest window: 365 days (envoy's `year`).
pub const MAX_WINDOW: Duration = Duration::from_secs(365 * 86_400);
/// Largest `limit` of `sliding_log`, which keeps one entry per admitted
/// request (up to 16 bytes each) for a whole window.
pub const MAX_LOG_LIMIT: u64 = 10_000;
/// Largest `concurrency` (leases held at once per key), which keeps one
/// 24-byte lease per slot held.
pub const MAX_CONCURRENCY: u64 = 100_000;
/// Largest `granularity` of `sliding_buckets` (one 8-byte counter each).
pub const MAX_GRANULARITY: u32 = 3_600;

/// How `leaky_bucket` treats a request that fits the bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum LeakyMode {
    /// Admit or deny now; the same answers as `gcra`.
    #[default]
    Meter,
    /// Admit up to `burst` requests beyond the one in service and return the
    /// `delay` to hold each for (nginx `limit_req` without `nodelay`).
    Shape,
}

impl LeakyMode {
    /// The configuration name: `meter` or `shape`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Meter => "meter",
            Self::Shape => "shape",
        }
    }
}

impl FromStr for LeakyMode {
    type Err = LimitError;
    fn from_str(s: &str) -> Result<Self, LimitError> {
        match s {
            "meter" => Ok(Self::Meter),
            "shape" => Ok(Self::Shape),
            other => Err(LimitError::UnknownMode(other.to_owned())),
        }
    }
}

/// When a limit's hits are charged: before the work (the request asks, and
/// is denied when they do not fit), or after it (`charge: after`: the cost
/// is known only once the work is done — tokens, bytes, rows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Charge {
    /// Hits are taken only if they fit; a denial takes nothing.
    #[default]
    Before,
    /// Hits ≥ 1 are a **late charge**: never denied, always counted, into
    /// debt beyond the limit if need be (counts saturate at
    /// [`MAX_LIMIT`]). Hits 0 is the **gate** a request asks at its start:
    /// denied once nothing is left, debt included.
    After,
}

impl Charge {
    /// The configuration name: `before` or `after`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Before => "before",
            Self::After => "after",
        }
    }
}

impl FromStr for Charge {
    type Err = LimitError;
    fn from_str(s: &str) -> Result<Self, LimitError> {
        match s {
            "before" => Ok(Self::Before),
            "after" => Ok(Self::After),
            other => Err(LimitError::UnknownCharge(other.to_owned())),
        }
    }
}

/// The algorithm names, without parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AlgorithmKind {
    /// See [`Algorithm::FixedWindow`].
    FixedWindow,
    /// See [`Algorithm::SlidingLog`].
    SlidingLog,
    /// See [`Algorithm::SlidingWindow`].
    SlidingWindow,
    /// See [`Algorithm::SlidingBuckets`].
    SlidingBuckets,
    /// See [`Algorithm::TokenBucket`].
    TokenBucket,
    /// See [`Algorithm::Gcra`].
    Gcra,
    /// See [`Algorithm::LeakyBucket`].
    LeakyBucket,
    /// See [`Algorithm::Concurrency`] (not a rate: not in [`AlgorithmKind::ALL`]).
    Concurrency,
}

impl AlgorithmKind {
    /// Every rate algorithm, in documentation order (a concurrency limit is
    /// written `concurrency: N`, not named as an algorithm).
    pub const ALL: [AlgorithmKind; 7] = [
        Self::FixedWindow,
        Self::SlidingLog,
        Self::SlidingWindow,
        Self::SlidingBuckets,
        Self::TokenBucket,
        Self::Gcra,
        Self::LeakyBucket,
    ];

    /// The configuration name, e.g. `sliding_window`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FixedWindow => "fixed_window",
            Self::SlidingLog => "sliding_log",
            Self::SlidingWindow => "sliding_window",
            Self::SlidingBuckets => "sliding_buckets",
            Self::TokenBucket => "token_bucket",
            Self::Gcra => "gcra",
            Self::LeakyBucket => "leaky_bucket",
            Self::Concurrency => "concurrency",
        }
    }

    /// Whether the algorithm takes `burst`.
    pub fn takes_burst(self) -> bool {
        matches!(self, Self::TokenBucket | Self::Gcra | Self::LeakyBucket)
    }
}

impl fmt::Display for AlgorithmKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for AlgorithmKind {
    type Err = LimitError;
    fn from_str(s: &str) -> Result<Self, LimitError> {
        Self::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| LimitError::UnknownAlgorithm(s.to_owned()))
    }
}

/// An algorithm and only the parameters it uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    /// Count per epoch-aligned window; allow iff `count + hits <= limit`.
    FixedWindow,
    /// Exact: the hits admitted in `(now - window, now]` plus `hits` must
    /// not exceed `limit`. Memory per key grows with the limit
    /// ([`MAX_LOG_LIMIT`]).
    SlidingLog,
    /// Cloudflare's two-window estimate: the previous window's count weighted
    /// by how much of it still overlaps the sliding window. Not exact.
    SlidingWindow,
    /// Exact over `granularity` epoch-aligned sub-windows of
    /// `window / granularity` each.
    SlidingBuckets {
        /// Number of sub-windows; divides the window in microseconds.
        granularity: u32,
    },
    /// Capacity `burst` (default: `limit`), refilled continuously at `limit`
    /// per `window`; the same answers as [`Algorithm::Gcra`].
    TokenBucket {
        /// Capacity; `None` means `limit`.
        burst: Option<u64>,
    },
    /// Generic cell rate algorithm: emission interval `window / limit`,
    /// tolerance of `burst` (default: `limit`) requests.
    Gcra {
        /// Burst; `None` means `limit`.
        burst: Option<u64>,
    },
    /// Leaky bucket, as a meter (the same answers as `gcra`) or a shaper.
    LeakyBucket {
        /// Queue depth; `None` means `limit`.
        burst: Option<u64>,
        /// Meter or shape.
        mode: LeakyMode,
    },
    /// At most `limit` requests in flight: each holds a lease (an id and an
    /// expiry `window` after it was taken or extended) until released or
    /// expired. See [`Limit::acquire`].
    Concurrency,
}

impl Algorithm {
    /// Build from a name and the optional parameters, rejecting parameters the
    /// algorithm does not use.
    pub fn from_parts(
        kind: AlgorithmKind,
        burst: Option<u64>,
        granularity: Option<u32>,
        mode: Option<LeakyMode>,
    ) -> Result<Self, LimitError> {
        if burst.is_some() && !kind.takes_burst() {
            return Err(LimitError::BurstNotSupported(kind));
        }
        if granularity.is_some() && kind != AlgorithmKind::SlidingBuckets {
            return Err(LimitError::GranularityNotSupported(kind));
        }
        if mode.is_some() && kind != AlgorithmKind::LeakyBucket {
            return Err(LimitError::ModeNotSupported(kind));
        }
        Ok(match kind {
            AlgorithmKind::FixedWindow => Self::FixedWindow,
            AlgorithmKind::SlidingLog => Self::SlidingLog,
            AlgorithmKind::SlidingWindow => Self::SlidingWindow,
            AlgorithmKind::SlidingBuckets => {
                Self::SlidingBuckets { granularity: granularity.ok_or(LimitError::GranularityMissing)? }
            }
            AlgorithmKind::TokenBucket => Self::TokenBucket { burst },
            AlgorithmKind::Gcra => Self::Gcra { burst },
            AlgorithmKind::LeakyBucket => Self::LeakyBucket { burst, mode: mode.unwrap_or_default() },
            AlgorithmKind::Concurrency => Self::Concurrency,
        })
    }

    /// The algorithm's name.
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            Self::FixedWindow => AlgorithmKind::FixedWindow,
            Self::SlidingLog => AlgorithmKind::SlidingLog,
            Self::SlidingWindow => AlgorithmKind::SlidingWindow,
            Self::SlidingBuckets { .. } => AlgorithmKind::SlidingBuckets,
            Self::TokenBucket { .. } => AlgorithmKind::TokenBucket,
            Self::Gcra { .. } => AlgorithmKind::Gcra,
            Self::LeakyBucket { .. } => AlgorithmKind::LeakyBucket,
            Self::Concurrency => AlgorithmKind::Concurrency,
        }
    }

    fn granularity(&self) -> u32 {
        match *self {
            Self::SlidingBuckets { granularity } => granularity,
            _ => 0,
        }
    }

    fn mode(&self) -> Option<LeakyMode> {
        match *self {
            Self::LeakyBucket { mode, .. } => Some(mode),
            _ => None,
        }
    }

    fn burst(&self) -> Option<u64> {
        match *self {
            Self::TokenBucket { burst } | Self::Gcra { burst } | Self::LeakyBucket { burst, .. } => burst,
            _ => None,
        }
    }
}

/// Why a limit cannot be honoured; each message says what to write instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LimitError {
    /// `limit` above [`MAX_LIMIT`].
    #[error(
        "limit {0} is too large: the largest limit is {MAX_LIMIT} (2^53 - 1, the largest count every store keeps exactly); use a longer window instead"
    )]
    LimitTooLarge(u64),
    /// `burst` of zero.
    #[error("burst 0 admits nothing: write burst >= 1, or limit: 0 to deny every request")]
    BurstZero,
    /// `burst` above [`MAX_LIMIT`].
    #[error("burst {0} is too large: the largest burst is {MAX_LIMIT} (2^53 - 1)")]
    BurstTooLarge(u64),
    /// Window below [`MIN_WINDOW`].
    #[error("window {} is too short: the shortest window is 1ms", HumanDuration(*.0))]
    WindowTooShort(Duration),
    /// Window above [`MAX_WINDOW`].
    #[error("window {} is too long: the longest window is 365d", HumanDuration(*.0))]
    WindowTooLong(Duration),
    /// A bucket that takes longer than [`MAX_WINDOW`] to refill.
    #[error(
        "burst {burst} at {limit} per {} takes longer than 365d to refill: lower burst, raise limit, or shorten the window",
        HumanDuration(*.window)
    )]
    RefillTooLong {
        /// The burst.
        burst: u64,
        /// The limit.
        limit: u64,
        /// The window.
        window: Duration,
    },
    /// Window with a fraction of a microsecond.
    #[error("window {0:?} is not a whole number of microseconds")]
    WindowNotWholeMicros(Duration),
    /// `sliding_log` above [`MAX_LOG_LIMIT`].
    #[error(
        "sliding_log keeps one entry per admitted request, so its limit is capped at {MAX_LOG_LIMIT}, not {0}: use sliding_buckets (exact at its granularity) or sliding_window for larger limits"
    )]
    LogLimitTooLarge(u64),
    /// `concurrency` above [`MAX_CONCURRENCY`].
    #[error(
        "concurrency {0} is too large: a key holds one lease per slot, so the most is {MAX_CONCURRENCY}; split the key (a descriptor per backend shard) instead"
    )]
    ConcurrencyTooLarge(u64),
    /// `charge: after` on a concurrency limit.
    #[error("a concurrency limit takes its slot before the work and frees it after: remove charge")]
    ChargeAfterConcurrency,
    /// `sliding_buckets` without `granularity`.
    #[error("sliding_buckets needs granularity: the number of sub-windows, e.g. granularity: 10")]
    GranularityMissing,
    /// Granularity outside `1..=MAX_GRANULARITY`.
    #[error("granularity {0} is out of range: write a whole number from 1 to {MAX_GRANULARITY}")]
    GranularityOutOfRange(u32),
    /// Window not divisible by the granularity.
    #[error(
        "granularity {granularity} does not divide the window {}: pick a granularity that divides {} microseconds, e.g. {suggestion}",
        HumanDuration(*.window), .window.as_micros()
    )]
    GranularityDoesNotDivide {
        /// The window.
        window: Duration,
        /// The granularity asked for.
        granularity: u32,
        /// The nearest granularity that divides the window.
        suggestion: u32,
    },
    /// `burst` on an algorithm without one.
    #[error("{0} has no burst: remove burst, or use token_bucket, gcra or leaky_bucket")]
    BurstNotSupported(AlgorithmKind),
    /// `granularity` on an algorithm other than `sliding_buckets`.
    #[error("{0} has no granularity: remove granularity, or use sliding_buckets")]
    GranularityNotSupported(AlgorithmKind),
    /// `mode` on an algorithm other than `leaky_bucket`.
    #[error("{0} has no mode: remove mode, or use leaky_bucket")]
    ModeNotSupported(AlgorithmKind),
    /// An unknown algorithm name.
    #[error(
        "unknown algorithm `{0}`: use fixed_window, sliding_log, sliding_window, sliding_buckets, token_bucket, gcra or leaky_bucket"
    )]
    UnknownAlgorithm(String),
    /// An unknown leaky bucket mode.
    #[error("unknown mode `{0}`: use meter or shape")]
    UnknownMode(String),
    /// An unknown `charge`.
    #[error("unknown charge `{0}`: use before (the default) or after")]
    UnknownCharge(String),
    /// `charge: after` on a `leaky_bucket` shaper.
    #[error(
        "charge: after counts work already done, and a shaper delays requests before it: use mode: meter (or another algorithm)"
    )]
    ChargeAfterShaper,
}

/// A validated limit: `limit` units per `window` under `algorithm`.
///
/// ```
/// use floodgate_core::{Algorithm, Limit};
/// use std::time::Duration;
/// let l = Limit::new(Algorithm::Gcra { burst: Some(20) }, 10, Duration::from_secs(1)).unwrap();
/// assert_eq!(l.burst(), 20);
/// assert!(Limit::new(Algorithm::SlidingLog, 1_000_000, Duration::from_secs(1)).is_err());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Limit {
    algorithm: Algorithm,
    limit: u64,
    /// Capacity of the GCRA family (burst, resolved); unused otherwise.
    burst: u64,
    /// `window_us / limit` and `window_us % limit` (emission interval as
    /// `q + r / limit`), precomputed so the hot path divides nothing.
    interval_q: u64,
    interval_r: u64,
    /// The window in microseconds, with its reciprocal (the hot path
    /// divides by it).
    window_div: Divisor,
    /// Reciprocals of the other divisors the hot path uses.
    limit_div: Divisor,
    /// `sliding_buckets`: bucket size and granularity (1 otherwise).
    bucket_div: Divisor,
    granularity_div: Divisor,
    /// When hits are charged ([`Limit::with_charge`]).
    charge: Charge,
    /// Identifies the parameters: a store that finds state written under
    /// other parameters starts the key fresh.
    fingerprint: u32,
}

impl Limit {
    /// Validate and build a limit.
    pub fn new(algorithm: Algorithm, limit: u64, window: Duration) -> Result<Self, LimitError> {
        if !window.subsec_nanos().is_multiple_of(1_000) {
            return Err(LimitError::WindowNotWholeMicros(window));
        }
        if window < MIN_WINDOW {
            return Err(LimitError::WindowTooShort(window));
        }
        if window > MAX_WINDOW {
            return Err(LimitError::WindowTooLong(window));
        }
        Self::checked(algorithm, limit, crate::clock::micros(window))
    }

    /// Build without the window bounds (any window of at least 1 µs): for
    /// property tests that scan every microsecond of tiny windows.
    pub(crate) fn checked(algorithm: Algorithm, limit: u64, window_us: u64) -> Result<Self, LimitError> {
        assert!(window_us > 0, "window must be positive");
        if limit > MAX_LIMIT {
            return Err(LimitError::LimitTooLarge(limit));
        }
        match algorithm {
            Algorithm::SlidingLog if limit > MAX_LOG_LIMIT => return Err(LimitError::LogLimitTooLarge(limit)),
            Algorithm::Concurrency if limit > MAX_CONCURRENCY => return Err(LimitError::ConcurrencyTooLarge(limit)),
            Algorithm::SlidingBuckets { granularity } => {
                if granularity == 0 || granularity > MAX_GRANULARITY {
                    return Err(LimitError::GranularityOutOfRange(granularity));
                }
                if !window_us.is_multiple_of(u64::from(granularity)) {
                    let suggestion = (1..=MAX_GRANULARITY)
                        .filter(|g| window_us.is_multiple_of(u64::from(*g)))
                        .min_by_key(|g| g.abs_diff(granularity))
                        .unwrap_or(1);
                    return Err(LimitError::GranularityDoesNotDivide {
                        window: Duration::from_micros(window_us),
                        granularity,
                        suggestion,
                    });
                }
            }
            _ => {}
        }
        let burst = match algorithm.burst() {
            Some(0) => return Err(LimitError::BurstZero),
            Some(b) if b > MAX_LIMIT => return Err(LimitError::BurstTooLarge(b)),
            Some(b) => b,
            None => limit,
        };
        // No state may outlive the longest window: a full refill of the
        // bucket (burst * window / limit) must fit in it. This also keeps
        // every theoretical arrival time below 2^53 microseconds.
        if limit > 0
            && algorithm.kind().takes_burst()
            && u128::from(burst) * u128::from(window_us) > u128::from(limit) * MAX_WINDOW.as_micros()
        {
            return Err(LimitError::RefillTooLong { burst, limit, window: Duration::from_micros(window_us) });
        }
        let (interval_q, interval_r) = window_us.checked_div(limit).map_or((0, 0), |q| (q, window_us % limit));
        let fingerprint = {
            let h = foldhash::fast::FixedState::with_seed(0x666c_6f6f_6467_6174).hash_one((
                algorithm.kind(),
                limit,
                window_us,
                burst,
                algorithm.granularity(),
                algorithm.mode(),
            ));
            // Keep the high half: foldhash mixes best there.
            u32::try_from(h >> 32).unwrap_or(0)
        };
        let granularity = u64::from(algorithm.granularity().max(1));
        Ok(Self {
            algorithm,
            limit,
            burst,
            interval_q,
            interval_r,
            window_div: Divisor::new(window_us),
            limit_div: Divisor::new(limit.max(1)),
            bucket_div: Divisor::new(window_us / granularity),
            granularity_div: Divisor::new(granularity),
            charge: Charge::Before,
            fingerprint,
        })
    }

    /// This limit with its hits charged `charge` ([`Charge`]). A shaper
    /// (`leaky_bucket`, `mode: shape`) is charged only before.
    ///
    /// ```
    /// use floodgate_core::{Algorithm, Charge, Limit, State};
    /// use std::time::Duration;
    /// let l = Limit::new(Algorithm::FixedWindow, 100, Duration::from_secs(60)).unwrap();
    /// let l = l.with_charge(Charge::After).unwrap();
    /// let mut s = State::default();
    /// assert!(l.apply(&mut s, 0, 0).allowed); // the gate: 100 left
    /// let late = l.apply(&mut s, 1, 250); // the work cost 250: counted
    /// assert!(late.allowed);
    /// assert_eq!(late.remaining, 0);
    /// assert!(!l.apply(&mut s, 2, 0).allowed); // the gate is shut
    /// ```
    pub fn with_charge(mut self, charge: Charge) -> Result<Self, LimitError> {
        if charge == Charge::After && matches!(self.algorithm, Algorithm::LeakyBucket { mode: LeakyMode::Shape, .. }) {
            return Err(LimitError::ChargeAfterShaper);
        }
        if charge == Charge::After && self.algorithm == Algorithm::Concurrency {
            return Err(LimitError::ChargeAfterConcurrency);
        }
        if charge != self.charge {
            // Two values: the salt toggles, so `Before` keeps the
            // fingerprint every earlier release wrote.
            self.fingerprint ^= AFTER_SALT;
            self.charge = charge;
        }
        Ok(self)
    }

    /// When this limit's hits are charged.
    pub fn charge(&self) -> Charge {
        self.charge
    }

    /// The algorithm and its parameters.
    pub fn algorithm(&self) -> &Algorithm {
        &self.algorithm
    }

    /// Whether this limit bounds requests in flight (`concurrency`) rather
    /// than a rate.
    pub fn is_concurrency(&self) -> bool {
        self.algorithm == Algorithm::Concurrency
    }

    /// Units per window.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// The window.
    pub fn window(&self) -> Duration {
        Duration::from_micros(self.window_us())
    }

    /// The window in microseconds.
    pub fn window_us(&self) -> u64 {
        self.window_div.get()
    }

    /// The capacity of `token_bucket`, `gcra` and `leaky_bucket` (the
    /// configured burst, or the limit); equal to the limit for the others.
    pub fn burst(&self) -> u64 {
        self.burst
    }

    /// The most units one request can ever be admitted: the burst (the
    /// limit, for the window algorithms), plus one for a `leaky_bucket`
    /// shaper (one now and `burst` queued). A larger `hits` is always denied,
    /// with no retry time.
    pub fn capacity(&self) -> u64 {
        let shaper = matches!(self.algorithm, Algorithm::LeakyBucket { mode: LeakyMode::Shape, .. });
        self.burst + u64::from(shaper)
    }

    /// A 32-bit digest of the parameters (stable across processes).
    pub fn fingerprint(&self) -> u32 {
        self.fingerprint
    }

    pub(crate) fn interval(&self) -> (u64, u64) {
        (self.interval_q, self.interval_r)
    }

    pub(crate) fn window_div(&self) -> Divisor {
        self.window_div
    }

    pub(crate) fn limit_div(&self) -> Divisor {
        self.limit_div
    }

    pub(crate) fn bucket_div(&self) -> Divisor {
        self.bucket_div
    }

    pub(crate) fn granularity_div(&self) -> Divisor {
        self.granularity_div
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.algorithm.kind(), self.limit, HumanDuration(self.window()))?;
        match self.algorithm {
            Algorithm::SlidingBuckets { granularity } => write!(f, " granularity {granularity}"),
            Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. } => write!(f, " burst {}", self.burst),
            Algorithm::LeakyBucket { mode, .. } => write!(f, " burst {} {}", self.burst, mode.as_str()),
            _ => Ok(()),
        }?;
        if self.charge == Charge::After { write!(f, " charged {}", self.charge.as_str()) } else { Ok(()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    #[test]
    fn bounds_are_enforced_with_hints() {
        assert_eq!(
            Limit::new(Algorithm::FixedWindow, MAX_LIMIT + 1, SEC),
            Err(LimitError::LimitTooLarge(MAX_LIMIT + 1))
        );
        assert!(Limit::new(Algorithm::FixedWindow, MAX_LIMIT, SEC).is_ok());
        assert!(Limit::new(Algorithm::FixedWindow, 0, SEC).is_ok(), "limit 0 is legal: deny all");
        assert_eq!(
            Limit::new(Algorithm::FixedWindow, 1, Duration::from_micros(999)),
            Err(LimitError::WindowTooShort(Duration::from_micros(999)))
        );
        assert!(Limit::new(Algorithm::FixedWindow, 1, MIN_WINDOW).is_ok());
        assert!(Limit::new(Algorithm::FixedWindow, 1, MAX_WINDOW).is_ok());
        assert!(matches!(Limit::new(Algorithm::FixedWindow, 1, MAX_WINDOW + SEC), Err(LimitError::WindowTooLong(_))));
        assert!(matches!(
            Limit::new(Algorithm::FixedWindow, 1, Duration::from_nanos(1_000_500)),
            Err(LimitError::WindowNotWholeMicros(_))
        ));
        assert_eq!(Limit::new(Algorithm::SlidingLog, 10_001, SEC), Err(LimitError::LogLimitTooLarge(10_001)));
        assert_eq!(Limit::new(Algorithm::Gcra { burst: Some(0) }, 1, SEC), Err(LimitError::BurstZero));
        let day = Duration::from_secs(86_400);
        assert!(Limit::new(Algorithm::Gcra { burst: Some(365) }, 1, day).is_ok());
        assert_eq!(
            Limit::new(Algorithm::Gcra { burst: Some(366) }, 1, day),
            Err(LimitError::RefillTooLong { burst: 366, limit: 1, window: day })
        );
        assert!(Limit::new(Algorithm::Gcra { burst: Some(366) }, 0, day).is_ok(), "limit 0 never refills: fine");
        assert_eq!(
            Limit::new(Algorithm::SlidingBuckets { granularity: 0 }, 1, SEC),
            Err(LimitError::GranularityOutOfRange(0))
        );
        let err = Limit::new(Algorithm::SlidingBuckets { granularity: 7 }, 1, SEC).unwrap_err();
        assert_eq!(err, LimitError::GranularityDoesNotDivide { window: SEC, granularity: 7, suggestion: 8 });
        assert!(err.to_string().contains("e.g. 8"), "{err}");
    }

    #[test]
    fn parts_reject_unused_parameters() {
        use AlgorithmKind as K;
        assert_eq!(
            Algorithm::from_parts(K::FixedWindow, Some(3), None, None),
            Err(LimitError::BurstNotSupported(K::FixedWindow))
        );
        assert_eq!(
            Algorithm::from_parts(K::Gcra, None, Some(3), None),
            Err(LimitError::GranularityNotSupported(K::Gcra))
        );
        assert_eq!(
            Algorithm::from_parts(K::Gcra, None, None, Some(LeakyMode::Shape)),
            Err(LimitError::ModeNotSupported(K::Gcra))
        );
        assert_eq!(Algorithm::from_parts(K::SlidingBuckets, None, None, None), Err(LimitError::GranularityMissing));
        assert_eq!(
            Algorithm::from_parts(K::LeakyBucket, Some(2), None, None),
            Ok(Algorithm::LeakyBucket { burst: Some(2), mode: LeakyMode::Meter })
        );
        for k in AlgorithmKind::ALL {
            assert_eq!(k.as_str().parse::<AlgorithmKind>(), Ok(k));
        }
        assert!("gcra2".parse::<AlgorithmKind>().unwrap_err().to_string().contains("token_bucket"));
    }

    #[test]
    fn burst_defaults_to_limit_and_fingerprints_differ() {
        let a = Limit::new(Algorithm::Gcra { burst: None }, 10, SEC).unwrap();
        let b = Limit::new(Algorithm::Gcra { burst: Some(10) }, 10, SEC).unwrap();
        assert_eq!(a.burst(), 10);
        assert_ne!(a.fingerprint(), Limit::new(Algorithm::Gcra { burst: None }, 11, SEC).unwrap().fingerprint());
        assert_eq!(a.fingerprint(), b.fingerprint(), "the same capacity is the same limit");
        let c = Limit::new(Algorithm::TokenBucket { burst: None }, 10, SEC).unwrap();
        assert_ne!(a.fingerprint(), c.fingerprint());
        assert_eq!(a.to_string(), "gcra 10/1s burst 10");
        assert_eq!(a.capacity(), 10);
        let shaper = Limit::new(Algorithm::LeakyBucket { burst: Some(4), mode: LeakyMode::Shape }, 10, SEC).unwrap();
        assert_eq!(shaper.capacity(), 5, "one now and four queued");
        assert_eq!(Limit::new(Algorithm::SlidingLog, 7, SEC).unwrap().capacity(), 7);
    }
}
