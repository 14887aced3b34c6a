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

/// `ceil(a / b)` for `b > 0`.
#[inline]
pub(crate) fn div_ceil(a: u128, b: u128) -> u128 {
    let q = div(a, b);
    if q * b < a { q + 1 } else { q }
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
            assert_eq!(div_ceil(a, b), a.div_ceil(b));
        }
    }
}
