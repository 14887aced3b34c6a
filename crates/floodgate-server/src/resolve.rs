//! Which limits apply to a request descriptor: a runtime override of exactly
//! that descriptor if there is one, else the rules files' match.

use std::sync::Arc;

use floodgate_core::rules::{Match, Rule, RuleSet};

use crate::overrides::{Override, Overrides};

/// The limits that apply to one descriptor, and where they come from.
#[derive(Debug, Clone)]
pub enum Resolved<'a> {
    /// A runtime override (takes precedence over the files).
    Override(Arc<Override>),
    /// The rules files.
    File(Match<'a>),
}

impl Resolved<'_> {
    /// The rules (one per limit).
    pub fn rules(&self) -> &[Rule] {
        match self {
            Resolved::Override(o) => &o.rules,
            Resolved::File(m) => m.rules,
        }
    }

    /// The counter key of `rules()[i]`.
    pub fn counter_key(&self, i: usize) -> String {
        match self {
            Resolved::Override(o) => o.counter_key(i),
            Resolved::File(m) => m.counter_key(i),
        }
    }
}

/// Resolve one descriptor of a request in `domain`.
pub fn resolve<'a, K: AsRef<str>, V: AsRef<str>>(
    rules: &'a RuleSet,
    overrides: &Overrides,
    domain: &str,
    entries: &[(K, V)],
) -> Option<Resolved<'a>> {
    if let Some(o) = overrides.get(domain, entries) {
        return Some(Resolved::Override(o));
    }
    rules.matches(domain, entries).map(Resolved::File)
}
