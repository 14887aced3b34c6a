//! Exact integer helpers shared by the algorithms.
//!
//! Every product that can exceed 64 bits is computed in `u128`; divisions take
//! a 64-bit fast path when both operands fit, because a 128-bit division is a
//! library call several times slower than the hardware's 64-bit one.

/// `a / b` for `b > 0`, with a 64-bit fast path.
#[inline]
pub(crate) fn div(a: u128, b: u128) -> u128 {
    debug_assert!(b > 0);
    if let (Ok(a64), Ok(b64)) = (u64::try_from(a), u64::try_from(b)) { u128::from(a64 / b64) } else { a / b }
}

/// Narrow to `u64`, saturating (values that large are beyond any horizon we
/// report, e.g. a wait longer than 500 000 years).
#[inline]
pub(crate) fn sat64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn division_paths_agree() {
        for (a, b) in [(0u128, 1u128), (7, 2), (u128::from(u64::MAX), 3), (u128::MAX, 7), (1 << 70, 1 << 65)] {
            assert_eq!(div(a, b), a / b);
        }
    }
}

/// Division by a constant fixed when a limit is built (window, limit, bucket
/// size), by multiplication: `m = floor((2^64 - 1) / d)` makes
/// `floor(n * m / 2^64)` at most 2 below `floor(n / d)` for every 64-bit `n`,
/// and two cheap corrections make it exact. A hardware 64-bit division costs
/// 26–90 cycles and stalls the pipeline on the hot path; this costs ~5.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Divisor {
    d: u64,
    m: u64,
}

impl Divisor {
    pub(crate) const fn new(d: u64) -> Self {
        assert!(d > 0, "division by zero");
        Self { d, m: u64::MAX / d }
    }

    pub(crate) const fn get(self) -> u64 {
        self.d
    }

    /// `(n / d, n % d)`.
    #[inline]
    pub(crate) fn div_rem(self, n: u64) -> (u64, u64) {
        let mut q = ((u128::from(n) * u128::from(self.m)) >> 64) as u64;
        let mut r = n - q * self.d;
        // At most two corrections (see the type's docs).
        if r >= self.d {
            q += 1;
            r -= self.d;
            if r >= self.d {
                q += 1;
                r -= self.d;
            }
        }
        (q, r)
    }

    /// `n / d`.
    #[inline]
    pub(crate) fn div(self, n: u64) -> u64 {
        self.div_rem(n).0
    }

    /// `n / d` for a 128-bit `n`, fast when it fits 64 bits.
    #[inline]
    pub(crate) fn div_wide(self, n: u128) -> u128 {
        match u64::try_from(n) {
            Ok(n) => u128::from(self.div(n)),
            Err(_) => n / u128::from(self.d),
        }
    }

    /// `ceil(n / d)` for a 128-bit `n`.
    #[inline]
    pub(crate) fn div_ceil_wide(self, n: u128) -> u128 {
        match u64::try_from(n) {
            Ok(n) => {
                let (q, r) = self.div_rem(n);
                u128::from(q + u64::from(r > 0))
            }
            Err(_) => n.div_ceil(u128::from(self.d)),
        }
    }
}

#[cfg(test)]
mod divisor_tests {
    use super::Divisor;
    use proptest::prelude::*;

    #[test]
    fn edges() {
        for d in [1u64, 2, 3, 7, 1_000, 1_000_000, 3_600_000_000, (1 << 53) - 1, 1 << 63, u64::MAX - 1, u64::MAX] {
            let dv = Divisor::new(d);
            for n in [0u64, 1, d - 1, d, d.wrapping_add(1), u64::MAX - 1, u64::MAX, u64::MAX / 2, u64::MAX - d] {
                assert_eq!(dv.div_rem(n), (n / d, n % d), "{n} / {d}");
            }
            let wide = u128::from(u64::MAX) * 5 + 3;
            assert_eq!(dv.div_wide(wide), wide / u128::from(d));
            assert_eq!(dv.div_ceil_wide(wide), wide.div_ceil(u128::from(d)));
        }
    }

    proptest! {
        #[test]
        fn matches_hardware_division(d in 1u64.., n: u64, small in 1u64..100_000) {
            prop_assert_eq!(Divisor::new(d).div_rem(n), (n / d, n % d));
            prop_assert_eq!(Divisor::new(small).div_rem(n), (n / small, n % small));
            prop_assert_eq!(Divisor::new(d).div_ceil_wide(u128::from(n)), u128::from(n.div_ceil(d)));
        }
    }
}
