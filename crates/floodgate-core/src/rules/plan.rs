//! A request's plan: every limit that applies to its descriptors, each with
//! its counter key, and the checks that decide them. Written once for
//! every adapter (the service's RLS, HTTP and proxy paths, the tower layer).

use super::matcher::limit_key;
use super::{Rule, RuleSet};
use crate::limiter::RuleCheck;
use crate::store::Op;

/// One limit of a plan: the descriptor it applies to (its index in the
/// request), its counter key, and its rule.
pub type Planned<'a> = (usize, String, &'a Rule);

impl RuleSet {
    /// Every limit that applies to a request's `descriptors` in `domain`,
    /// grouped by descriptor, in order. `own(d)` gives descriptor `d`'s own
    /// limits when it has some (a limit the request carries, a per-key
    /// entry): its base counter key and its rules, which take precedence
    /// over the files (limit `i` counts under [`limit_key`]`(base, i)`).
    /// The other descriptors get the files' match, with `replaces` applied
    /// across the whole request.
    pub fn plan<'a, 'd, K, V>(
        &'a self,
        domain: &str,
        descriptors: impl ExactSizeIterator<Item = &'d [(K, V)]>,
        mut own: impl FnMut(usize) -> Option<(String, &'a [Rule])>,
    ) -> Vec<Planned<'a>>
    where
        K: AsRef<str> + 'd,
        V: AsRef<str> + 'd,
    {
        let n = descriptors.len();
        let matched = self.match_request(domain, descriptors);
        let mut out = Vec::with_capacity(n);
        for d in 0..n {
            if let Some((mut base, rules)) = own(d) {
                for (i, rule) in rules.iter().enumerate() {
                    // The last limit's key is written onto the base itself.
                    let b = if i + 1 == rules.len() { std::mem::take(&mut base) } else { base.clone() };
                    out.push((d, limit_key(b, i), rule));
                }
                continue;
            }
            out.extend(matched.keyed(d).map(|(key, rule)| (d, key, rule)));
        }
        out
    }
}

/// The checks of a plan's limits, each taking (or giving back) what
/// `hits(descriptor)` says.
pub fn checks_of<'a>(planned: &'a [Planned<'a>], hits: impl Fn(usize) -> (u64, Op)) -> Vec<RuleCheck<'a>> {
    planned
        .iter()
        .map(|(d, key, rule)| {
            let (hits, op) = hits(*d);
            RuleCheck { key, rule, hits, op }
        })
        .collect()
}
