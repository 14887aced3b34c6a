//! Which keys `floodgate bench` requests carry: uniform or zipf over a key
//! space, from a small deterministic generator per sender.

use std::sync::Arc;

use crate::exit::Failure;

/// Which keys requests carry.
#[derive(Debug, Clone)]
pub(super) enum Keys {
    Uniform(u64),
    /// Cumulative probabilities of keys 0..n.
    Zipf(Arc<[f64]>),
}

/// Largest key space for zipf (its table costs 8 bytes a key).
const MAX_ZIPF_KEYS: u64 = 10_000_000;

impl Keys {
    pub(super) fn parse(n: u64, dist: &str) -> Result<Keys, Failure> {
        if n == 0 {
            return Err(Failure::usage("--keys: give at least 1"));
        }
        let s = match dist {
            "uniform" => return Ok(Keys::Uniform(n)),
            "zipf" => 1.0,
            d => match d.strip_prefix("zipf:").and_then(|s| s.parse::<f64>().ok()) {
                Some(s) if s > 0.0 && s.is_finite() => s,
                _ => {
                    return Err(Failure::usage(format!(
                        "--distribution `{dist}`: use uniform, zipf or zipf:S with S > 0"
                    )));
                }
            },
        };
        if n > MAX_ZIPF_KEYS {
            return Err(Failure::usage(format!("--keys {n}: zipf takes at most {MAX_ZIPF_KEYS} keys")));
        }
        let mut cdf: Vec<f64> = Vec::with_capacity(n as usize);
        let mut sum = 0.0;
        for k in 1..=n {
            sum += 1.0 / (k as f64).powf(s);
            cdf.push(sum);
        }
        for c in &mut cdf {
            *c /= sum;
        }
        Ok(Keys::Zipf(cdf.into()))
    }

    pub(super) fn pick(&self, rng: &mut Rng) -> u64 {
        match self {
            Keys::Uniform(n) => rng.next() % n,
            Keys::Zipf(cdf) => {
                let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
                cdf.partition_point(|&c| c < u) as u64
            }
        }
    }

    pub(super) fn describe(&self, n: u64, dist: &str) -> String {
        let plural = if n == 1 { "" } else { "s" };
        format!("{n} key{plural} ({dist})")
    }
}

/// splitmix64: fast, good enough to spread keys; no dependency.
pub(super) struct Rng(pub(super) u64);

impl Rng {
    pub(super) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}
