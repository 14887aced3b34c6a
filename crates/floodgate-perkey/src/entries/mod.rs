//! The entries: what one is (a descriptor with a tier or its own limits),
//! how it is checked and built, and the write that stores it.

pub(crate) mod value;

pub use value::{MAX_TIER_NAMES, lookup_key};

use std::sync::Arc;

use floodgate_core::rules::{Rule, RuleSet, check_tier_name, counter_key};
use serde::{Deserialize, Serialize};

use crate::{KeyError, MAX_ENTRIES, MAX_TEXT};
use value::{Stored, check_text, own_limits};

/// One `(key, value)` of a descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// The descriptor key.
    pub key: String,
    /// The value (exact; no wildcards).
    pub value: String,
}

/// An entry as written: the domain, the exact descriptor, and either a
/// tier of the domain or its own limits.
///
/// ```
/// use floodgate_perkey::KeySpec;
/// let s: KeySpec = serde_json::from_str(
///     r#"{"domain": "api", "descriptor": [{"key": "user", "value": "alice"}], "tier": "pro"}"#,
/// ).unwrap();
/// assert_eq!(s.tier.as_deref(), Some("pro"));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySpec {
    /// The domain.
    pub domain: String,
    /// The exact descriptor.
    pub descriptor: Vec<Entry>,
    /// A tier of the domain's rules file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<String>,
    /// Its own limits: one `rate_limit` block, or a list of them, as in a
    /// rules file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<serde_json::Value>,
    /// The metrics label of its own limits (default `per-key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl KeySpec {
    /// The descriptor as `(key, value)` pairs.
    pub fn entries(&self) -> Vec<(&str, &str)> {
        self.descriptor.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect()
    }
}

/// What an entry's limits are: what a lookup answers.
#[derive(Debug, Clone)]
pub enum Limits {
    /// The named tier of the domain, as the rules in use define it (one
    /// copy of each name per process).
    Tier(&'static str),
    /// Its own, validated.
    Own(Arc<[Rule]>),
}

impl Limits {
    /// Its limits under the rules `set` for an entry of `domain`: its own,
    /// or its tier's (`None` when the domain has no such tier).
    pub fn rules_in<'a>(&'a self, set: &'a RuleSet, domain: &str) -> Option<&'a [Rule]> {
        match self {
            Self::Own(rules) => Some(rules),
            Self::Tier(t) => tier_of(set, domain, t).map(|t| t.rules.as_slice()),
        }
    }

    /// The counter key of its `i`th limit, for the descriptor whose own
    /// counter key is `base`: the descriptor's counters, numbered as a
    /// file rule's (`base`, `base#1`, …). A limit that differs from the
    /// one that counted there before starts afresh (both stores keep state
    /// by the limit's fingerprint), so moving a key to another tier, or
    /// giving it its own limits, starts its counters anew, and a tier whose
    /// limits did not change keeps them. The key is no longer than the
    /// files' own: the in-memory store keeps keys of up to 22 bytes inline.
    pub fn counter_key(&self, base: &str, i: usize) -> String {
        floodgate_core::rules::limit_key(base.to_owned(), i)
    }
}

/// An entry as written, validated.
#[derive(Debug, Clone)]
pub struct KeyEntry {
    /// As written.
    pub spec: KeySpec,
    /// Its limits.
    pub limits: Limits,
    /// Seconds since the Unix epoch.
    pub updated_at: u64,
}

impl KeyEntry {
    /// The counter key of its `i`th limit ([`Limits::counter_key`]).
    pub fn counter_key(&self, i: usize) -> String {
        self.limits.counter_key(&counter_key(&self.spec.domain, &self.spec.entries()), i)
    }

    /// Its limits under the rules `set` ([`Limits::rules_in`]).
    pub fn rules_in<'a>(&'a self, set: &'a RuleSet) -> Option<&'a [Rule]> {
        self.limits.rules_in(set, &self.spec.domain)
    }
}

/// The tier `tier` of `domain` in the rules `set`, if defined.
pub(crate) fn tier_of<'a>(set: &'a RuleSet, domain: &str, tier: &str) -> Option<&'a floodgate_core::rules::Tier> {
    set.domain(domain)?.tier(tier)
}

/// One write of a batch: a lookup key and its new value (`None` deletes).
pub(crate) struct Write {
    pub(crate) key: String,
    pub(crate) value: Option<Vec<u8>>,
}

impl Write {
    pub(crate) fn put(key: String, stored: &Stored) -> Self {
        Self { key, value: Some(stored.encode()) }
    }

    /// The write setting `spec`, updated at `updated_at`; `None` when its
    /// descriptor holds a separator (no entry built by [`build`] does).
    pub(crate) fn of(spec: &KeySpec, updated_at: u64) -> Option<Self> {
        Some(Self::put(lookup_key(&spec.domain, &spec.entries())?, &Stored::of(spec, updated_at)))
    }

    /// The write of an entry as builds before tiers stored it (redb's
    /// `overrides` table, Redis's shared map): the JSON of
    /// `{"spec": {domain, descriptor, limits}, "updated_at"}`.
    pub(crate) fn legacy(text: &str) -> Result<Self, BadLegacy> {
        #[derive(Deserialize)]
        struct Legacy {
            spec: KeySpec,
            updated_at: u64,
        }
        let old: Legacy = serde_json::from_str(text).map_err(BadLegacy::Parse)?;
        Self::of(&old.spec, old.updated_at).ok_or(BadLegacy::Separator)
    }
}

/// Why an entry written by an older build cannot be moved (it is dropped,
/// with a warning).
#[derive(Debug, thiserror::Error)]
pub(crate) enum BadLegacy {
    #[error("it does not parse: {0}")]
    Parse(serde_json::Error),
    #[error("a control character in its descriptor")]
    Separator,
}

/// The writes of validated entries.
pub(crate) fn writes_of(entries: &[KeyEntry]) -> Result<Vec<Write>, KeyError> {
    entries
        .iter()
        .map(|e| {
            Write::of(&e.spec, e.updated_at)
                .ok_or_else(|| KeyError::Invalid("a control character in the descriptor".into()))
        })
        .collect()
}

/// Check a spec and build its entry (a tier is not checked against the
/// rules here: [`PerKey::validate`](crate::PerKey::validate) does that).
pub(crate) fn build(spec: KeySpec, updated_at: u64) -> Result<KeyEntry, KeyError> {
    let bad = |m: String| Err(KeyError::Invalid(m));
    if spec.domain.is_empty() || spec.domain.len() > MAX_TEXT {
        return bad(format!("domain must be 1 to {MAX_TEXT} bytes"));
    }
    check_text("domain", &spec.domain)?;
    if spec.descriptor.is_empty() || spec.descriptor.len() > MAX_ENTRIES {
        return bad(format!(
            "descriptor must have 1 to {MAX_ENTRIES} entries, e.g. [{{\"key\": \"user\", \"value\": \"alice\"}}]"
        ));
    }
    for (i, e) in spec.descriptor.iter().enumerate() {
        if e.key.is_empty() || e.key.len() > MAX_TEXT || e.value.len() > MAX_TEXT {
            return bad(format!("descriptor[{i}]: key must be 1 to {MAX_TEXT} bytes and value at most {MAX_TEXT}"));
        }
        check_text(&format!("descriptor[{i}]"), &e.key)?;
        check_text(&format!("descriptor[{i}]"), &e.value)?;
    }
    if let Some(n) = &spec.name
        && (n.is_empty() || n.len() > 64)
    {
        return bad("name must be 1 to 64 bytes (it labels the entry's decisions in metrics)".into());
    }
    let limits = match (&spec.tier, &spec.limits) {
        (Some(t), None) => {
            check_tier_name(t).map_err(|e| KeyError::Invalid(e.to_string()))?;
            Limits::Tier(value::intern_tier(t)?)
        }
        (None, Some(limits)) => own_limits(limits, spec.name.as_deref())?,
        (Some(_), Some(_)) => return bad("give either tier or limits, not both".into()),
        (None, None) => {
            return bad(
                "give tier (a tier of the domain's rules file, e.g. \"tier\": \"pro\") or limits (e.g. \"limits\": {\"unit\": \"second\", \"requests_per_unit\": 5})"
                    .into(),
            );
        }
    };
    Ok(KeyEntry { spec, limits, updated_at })
}
