//! A rule's scope: this region alone, or one limit shared by every region.

/// Which regions a limit spans (`scope:` inside `rate_limit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Scope {
    /// This region's store alone (every instance on one Redis, or one
    /// instance with the memory store): the default, exact as ever.
    #[default]
    Region,
    /// One limit across every region; each decides locally and usage is
    /// shared asynchronously.
    Global(SyncMode),
}

/// How a `global` limit's regions stay in step (`sync:`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum SyncMode {
    /// Over-admission bounded only by staleness (the default).
    #[default]
    Eventual,
    /// A hard cap of `(1 + overshoot) × limit` per window under any
    /// schedule: each region admits only while its usage that not every
    /// peer has acknowledged stays within its slice.
    Bounded {
        /// `overshoot` as parts per million of the limit (5% = 50 000).
        overshoot_ppm: u32,
    },
}

impl Scope {
    /// The configuration name: `region` or `global`.
    pub fn as_str(self) -> &'static str {
        match self {
            Scope::Region => "region",
            Scope::Global(_) => "global",
        }
    }

    /// Whether usage is shared between regions.
    pub fn is_global(self) -> bool {
        matches!(self, Scope::Global(_))
    }
}

impl SyncMode {
    /// The configuration name: `eventual` or `bounded`.
    pub fn as_str(self) -> &'static str {
        match self {
            SyncMode::Eventual => "eventual",
            SyncMode::Bounded { .. } => "bounded",
        }
    }
}

/// An overshoot [`parse_overshoot`] cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("overshoot `{0}`: write a percentage in (0%, 100%] such as 5% or 0.5%, or a fraction such as 0.05")]
pub struct BadOvershoot(pub String);

/// Most parts per million `overshoot` may be: 100%.
pub const MAX_OVERSHOOT_PPM: u32 = 1_000_000;

/// Parse an overshoot: a percentage (`5%`, `0.5%`, up to 4 decimals) or a
/// fraction (`0.05`, up to 6 decimals), in (0, 100%]; parts per million.
pub fn parse_overshoot(text: &str) -> Result<u32, BadOvershoot> {
    let bad = || BadOvershoot(text.to_owned());
    let text = text.trim();
    let (digits, scale) = match text.strip_suffix('%') {
        Some(p) => (p.trim(), 4),
        None => (text, 6),
    };
    let (int, frac) = digits.split_once('.').unwrap_or((digits, ""));
    if (int.is_empty() && frac.is_empty())
        || frac.len() > scale
        || !int.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(bad());
    }
    let int: u64 = if int.is_empty() { 0 } else { int.parse().map_err(|_| bad())? };
    let frac: u64 = format!("{frac:0<scale$}").parse().map_err(|_| bad())?;
    let ppm = int.checked_mul(10u64.pow(scale as u32)).and_then(|i| i.checked_add(frac)).ok_or_else(bad)?;
    match u32::try_from(ppm) {
        Ok(p) if p > 0 && p <= MAX_OVERSHOOT_PPM => Ok(p),
        _ => Err(bad()),
    }
}

/// A bounded rule's slice, per region: `floor(overshoot × capacity /
/// regions)` hits, where capacity is the limit (window algorithms) or the
/// burst (the GCRA family).
pub fn slice(overshoot_ppm: u32, capacity: u64, regions: usize) -> u64 {
    let n = u128::from(u64::try_from(regions.max(1)).unwrap_or(u64::MAX));
    let s = u128::from(overshoot_ppm) * u128::from(capacity) / 1_000_000 / n;
    u64::try_from(s).unwrap_or(u64::MAX)
}

/// The least capacity whose slice is at least one hit for `regions` at
/// `overshoot_ppm`: `ceil(regions / overshoot)`.
pub fn min_capacity(overshoot_ppm: u32, regions: usize) -> u64 {
    let n = u128::from(u64::try_from(regions.max(1)).unwrap_or(u64::MAX));
    let p = u128::from(overshoot_ppm.max(1));
    u64::try_from((n * 1_000_000).div_ceil(p)).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overshoots_parse_as_percentages_or_fractions() {
        assert_eq!(parse_overshoot("5%"), Ok(50_000));
        assert_eq!(parse_overshoot("0.5%"), Ok(5_000));
        assert_eq!(parse_overshoot("0.0001%"), Ok(1));
        assert_eq!(parse_overshoot("100%"), Ok(1_000_000));
        assert_eq!(parse_overshoot("0.05"), Ok(50_000));
        assert_eq!(parse_overshoot(" 1 "), Ok(1_000_000));
        for bad in ["0%", "0", "101%", "1.5", "-5%", "five", "", "%", "5%%", "0.00001%", "0.0000001"] {
            assert!(parse_overshoot(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn slices_and_their_minimum() {
        assert_eq!(slice(50_000, 60, 3), 1);
        assert_eq!(slice(50_000, 59, 3), 0);
        assert_eq!(min_capacity(50_000, 3), 60, "the issue's example: 60 for 3 regions at 5%");
        assert_eq!(slice(50_000, 1_000, 3), 16);
        assert_eq!(min_capacity(1_000_000, 1), 1);
        assert_eq!(slice(1_000_000, u64::MAX, 1), u64::MAX);
    }
}
