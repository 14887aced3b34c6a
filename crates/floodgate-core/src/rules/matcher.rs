//! Matching a request's descriptor against the rule tree, exactly as
//! envoyproxy/ratelimit does:
//!
//! * each request entry `(key, value)` looks up `key_value` among the
//!   current node's children; failing that the first wildcard child (file
//!   order) whose pattern matches `key_value`; failing that the key-only
//!   child `key` (one counter per distinct value);
//! * no backtracking: a level's choice is final;
//! * the rules that apply are those of the node matched by the **last**
//!   entry; a walk that ends early, or on a node without rules, matches
//!   nothing.
//!
//! Matching is hash lookups along the request's entries (plus the wildcard
//! patterns of the nodes on the path), never a scan of all rules.

use super::model::{DescNode, Rule, RuleSet};

/// The rules one request descriptor matched, and the counter key of each.
#[derive(Debug, Clone)]
pub struct Match<'a> {
    /// The rules (one per limit on the matched descriptor).
    pub rules: &'a [Rule],
    key: String,
}

impl Match<'_> {
    /// The counter key of `rules[i]`: the domain and the request's entries
    /// (a `share_threshold` wildcard's pattern instead of the value, so all
    /// matching values share one counter), plus the rule's index when the
    /// descriptor has several limits. Length-prefixed, so no key or value
    /// can make two different descriptors collide.
    pub fn counter_key(&self, i: usize) -> String {
        limit_key(self.key.clone(), i)
    }
}

/// The counter key of limit `i` of a descriptor whose counter key is
/// `base`: `base` itself for the first limit, `base#i` for the others (a
/// descriptor with several limits in its rules file, or a per-key entry
/// with several). Written onto `base`.
pub fn limit_key(mut base: String, i: usize) -> String {
    if i > 0 {
        use std::fmt::Write as _;
        let _ = write!(base, "#{i}");
    }
    base
}

/// The counter key of a limit a request carries itself (RLS's
/// `descriptor.limit`): the exact descriptor's key with the limit, so that
/// each distinct carried limit counts apart from the files' rules and from
/// every other carried limit.
pub fn carried_key<K: AsRef<str>, V: AsRef<str>>(
    domain: &str,
    entries: &[(K, V)],
    requests_per_unit: u64,
    unit: &str,
) -> String {
    use std::fmt::Write as _;
    let mut key = counter_key(domain, entries);
    let _ = write!(key, "@rls:{requests_per_unit}/{unit}");
    key
}

impl RuleSet {
    /// The rules that apply to one descriptor (its `(key, value)` entries) of
    /// a request in `domain`; `None` when nothing applies.
    ///
    /// ```
    /// use floodgate_core::rules::RuleSet;
    /// let rules = RuleSet::from_yaml("api.yaml", "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 2}\n").unwrap();
    /// let m = rules.matches("api", &[("user", "alice")]).unwrap();
    /// assert_eq!(m.rules[0].limit.as_ref().unwrap().limit(), 2);
    /// assert!(rules.matches("api", &[("ip", "10.0.0.1")]).is_none());
    /// ```
    pub fn matches<K: AsRef<str>, V: AsRef<str>>(&self, domain: &str, entries: &[(K, V)]) -> Option<Match<'_>> {
        let d = self.domains.get(domain)?;
        let mut node = &d.nodes[0];
        let mut shared: Vec<Option<&str>> = Vec::new();
        let mut composite = String::new();
        for (i, (k, v)) in entries.iter().enumerate() {
            let (k, v) = (k.as_ref(), v.as_ref());
            composite.clear();
            composite.push_str(k);
            composite.push('_');
            composite.push_str(v);
            let mut via_wildcard = false;
            let next = node
                .children
                .get(composite.as_str())
                .or_else(|| {
                    let hit =
                        node.wildcards.iter().find(|(parts, _)| wildcard_match(parts, &composite)).map(|(_, idx)| idx);
                    via_wildcard = hit.is_some();
                    hit
                })
                .or_else(|| node.children.get(k))?;
            let child: &DescNode = &d.nodes[*next as usize];
            if via_wildcard && let Some(p) = &child.share_pattern {
                shared.resize(i, None);
                shared.push(Some(p));
            }
            if i + 1 == entries.len() {
                if child.rules.is_empty() {
                    return None;
                }
                return Some(Match { rules: &child.rules, key: counter_key_shared(domain, entries, &shared) });
            }
            if child.children.is_empty() {
                return None;
            }
            node = child;
        }
        None
    }
}

/// The matches of every descriptor of one request, with envoy's `replaces`
/// applied across them: a rule whose `name` another matched rule (even an
/// unlimited one) `replaces` does not apply; mutual replacement drops both.
#[derive(Debug, Clone)]
pub struct RequestMatch<'a> {
    /// One entry per request descriptor, in order.
    pub descriptors: Vec<Option<Match<'a>>>,
    replaced: Vec<&'a str>,
}

impl<'a> RequestMatch<'a> {
    /// Whether `rule` is replaced by another rule of this request.
    pub fn is_replaced(&self, rule: &Rule) -> bool {
        rule.name.as_deref().is_some_and(|n| self.replaced.contains(&n))
    }

    /// The rules that apply to descriptor `d`, with their index (for
    /// [`Match::counter_key`]).
    pub fn applicable(&self, d: usize) -> impl Iterator<Item = (usize, &'a Rule)> + '_ {
        self.descriptors
            .get(d)
            .and_then(Option::as_ref)
            .into_iter()
            .flat_map(|m| m.rules.iter().enumerate())
            .filter(|(_, r)| !self.is_replaced(r))
    }

    /// The rules that apply to descriptor `d`, each with its counter key
    /// (none when `d` matched nothing).
    pub fn keyed(&self, d: usize) -> impl Iterator<Item = (String, &'a Rule)> + '_ {
        let m = self.descriptors.get(d).and_then(Option::as_ref);
        self.applicable(d).filter_map(move |(i, rule)| Some((m?.counter_key(i), rule)))
    }
}

impl RuleSet {
    /// Match every descriptor of a request in `domain`, then apply
    /// `replaces` across them.
    pub fn match_request<'d, K, V, D>(&self, domain: &str, descriptors: D) -> RequestMatch<'_>
    where
        K: AsRef<str> + 'd,
        V: AsRef<str> + 'd,
        D: IntoIterator<Item = &'d [(K, V)]>,
    {
        let descriptors: Vec<Option<Match<'_>>> = descriptors.into_iter().map(|d| self.matches(domain, d)).collect();
        let replaced = descriptors
            .iter()
            .flatten()
            .flat_map(|m| m.rules.iter())
            .flat_map(|r| r.replaces.iter().map(String::as_str))
            .collect();
        RequestMatch { descriptors, replaced }
    }
}

/// The counter key of a descriptor's exact entries in `domain` (no shared
/// wildcard): what [`Match::counter_key`] gives for rule 0 of a descriptor
/// matched without `share_threshold`.
pub fn counter_key<K: AsRef<str>, V: AsRef<str>>(domain: &str, entries: &[(K, V)]) -> String {
    counter_key_shared(domain, entries, &[])
}

fn counter_key_shared<K: AsRef<str>, V: AsRef<str>>(
    domain: &str,
    entries: &[(K, V)],
    shared: &[Option<&str>],
) -> String {
    let mut key = String::with_capacity(16 + domain.len() + entries.len() * 16);
    push_len_prefixed(&mut key, domain);
    for (i, (k, v)) in entries.iter().enumerate() {
        let (k, v) = (k.as_ref(), shared.get(i).copied().flatten().unwrap_or(v.as_ref()));
        key.push('|');
        push_len_prefixed(&mut key, k);
        push_len_prefixed(&mut key, v);
    }
    key
}

/// `{len}:{s}` (built on every decision: `write!` cost a tenth of one).
fn push_len_prefixed(key: &mut String, s: &str) {
    key.push_str(crate::headers::Decimal::of(s.len() as u64).as_str());
    key.push(':');
    key.push_str(s);
}

/// envoy's `*` matching over the whole `key_value` text: each `*` stands for
/// any run of characters (possibly empty); the parts between are matched
/// left to right, first occurrence first.
fn wildcard_match(parts: &[Box<str>], s: &str) -> bool {
    let [first, middle @ .., last] = parts else {
        return parts.first().is_some_and(|p| **p == *s);
    };
    if s.len() < first.len() + last.len() || !s.starts_with(&**first) || !s.ends_with(&**last) {
        return false;
    }
    let mut rest = &s[first.len()..s.len() - last.len()];
    for part in middle {
        match rest.find(&**part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::{counter_key, counter_key_shared, wildcard_match};

    #[test]
    fn counter_keys_keep_their_text() {
        // Counters in Redis outlive a version: the text may not change.
        let long = "v".repeat(123);
        assert_eq!(counter_key("d", &[("ab", "x"), ("k", long.as_str())]), format!("1:d|2:ab1:x|1:k123:{long}"));
        assert_eq!(counter_key::<&str, &str>("", &[]), "0:");
        assert_eq!(counter_key_shared("dom", &[("a", "1"), ("b", "2")], &[None, Some("*")]), "3:dom|1:a1:1|1:b1:*");
    }

    fn m(pattern: &str, s: &str) -> bool {
        let parts: Vec<Box<str>> = pattern.split('*').map(Box::from).collect();
        wildcard_match(&parts, s)
    }

    #[test]
    fn wildcards_anywhere() {
        assert!(m("wild_foo*", "wild_foo1") && m("wild_foo*", "wild_foo"));
        assert!(!m("wild_foo*", "wild_bar"));
        assert!(m("midWild_bar*b", "midWild_barab") && m("midWild_bar*b", "midWild_barb"));
        assert!(!m("midWild_bar*b", "midWild_bara") && !m("midWild_bar*b", "midWild_xbarb"));
        assert!(m("m_foo*bar*baz", "m_foo123bar456baz") && m("m_foo*bar*baz", "m_foobarbaz"));
        assert!(!m("m_foo*bar*baz", "m_foo123baz"));
        assert!(m("k_*", "k_") && m("k_*", "k_anything"));
        assert!(m("exact", "exact") && !m("exact", "exactly"));
        // The prefix and suffix may not overlap.
        assert!(!m("ab*ba", "aba"));
    }
}
