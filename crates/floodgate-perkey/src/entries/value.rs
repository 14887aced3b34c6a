//! An entry's stored value, the same bytes on disk and in Redis: what the
//! entry maps to, not its descriptor (the lookup key holds that).
//!
//! * tier: `[1][updated_at: u64 LE][tier name, UTF-8]`;
//! * own limits: `[2][updated_at: u64 LE][JSON {"limits": …, "name": …}]`.
//!
//! A miss on the decision path reads the tier without parsing anything
//! ([`limits_of`]). Databases written by the first per-key build hold JSON
//! (`{"tier": …, "updated_at": …}`, starting `{`): read as well, rewritten
//! as binary by their next write. The Redis write script reads the first
//! byte and the tier the same way (`scripts/write.lua`).

use floodgate_core::rules::parse_limits;
use serde::{Deserialize, Serialize};

use crate::{Entry, KeyError, KeySpec, Limits, PER_KEY_LABEL};

const TIER: u8 = 1;
const OWN: u8 = 2;
/// The kind byte and `updated_at`.
const HEAD: usize = 9;

/// An entry's value, decoded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct Stored {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) tier: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) limits: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) name: Option<String>,
    #[serde(default)]
    pub(crate) updated_at: u64,
}

/// The JSON part of an own-limits value.
#[derive(Serialize, Deserialize)]
struct Own {
    limits: serde_json::Value,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    name: Option<String>,
}

fn bad(e: impl std::fmt::Display) -> KeyError {
    KeyError::Storage(format!("a stored entry: {e}"))
}

impl Stored {
    pub(crate) fn of(spec: &KeySpec, updated_at: u64) -> Self {
        Self { tier: spec.tier.clone(), limits: spec.limits.clone(), name: spec.name.clone(), updated_at }
    }

    /// The spec this value and its lookup key describe.
    pub(crate) fn spec(self, key: &str) -> KeySpec {
        let (domain, descriptor) = split_lookup_key(key);
        KeySpec { domain, descriptor, tier: self.tier, limits: self.limits, name: self.name }
    }

    /// The stored bytes.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEAD + self.tier.as_ref().map_or(64, String::len));
        match &self.tier {
            Some(t) => {
                out.push(TIER);
                out.extend_from_slice(&self.updated_at.to_le_bytes());
                out.extend_from_slice(t.as_bytes());
            }
            None => {
                out.push(OWN);
                out.extend_from_slice(&self.updated_at.to_le_bytes());
                let own = Own { limits: self.limits.clone().unwrap_or_default(), name: self.name.clone() };
                // A `Value` and an optional string always serialize.
                out.extend_from_slice(&serde_json::to_vec(&own).unwrap_or_default());
            }
        }
        out
    }

    /// Decode stored bytes (binary, or the first build's JSON).
    pub(crate) fn decode(bytes: &[u8]) -> Result<Self, KeyError> {
        match bytes.first() {
            Some(b'{') => serde_json::from_slice(bytes).map_err(bad),
            Some(&TIER) if bytes.len() > HEAD => {
                let tier = std::str::from_utf8(&bytes[HEAD..]).map_err(bad)?;
                Ok(Self { tier: Some(tier.to_owned()), limits: None, name: None, updated_at: updated_at(bytes) })
            }
            Some(&OWN) if bytes.len() > HEAD => {
                let own: Own = serde_json::from_slice(&bytes[HEAD..]).map_err(bad)?;
                Ok(Self { tier: None, limits: Some(own.limits), name: own.name, updated_at: updated_at(bytes) })
            }
            _ => Err(bad("an unknown format (written by a newer floodgate?)")),
        }
    }
}

fn updated_at(bytes: &[u8]) -> u64 {
    let mut at = [0; 8];
    at.copy_from_slice(&bytes[1..HEAD]);
    u64::from_le_bytes(at)
}

/// The tier a stored value names (`""` for its own limits or an unreadable
/// value): the `tier_counts` row it counts in, as the Redis script reads it.
pub(crate) fn tier_of(bytes: &[u8]) -> &str {
    match bytes.first() {
        Some(&TIER) if bytes.len() > HEAD => std::str::from_utf8(&bytes[HEAD..]).unwrap_or(""),
        Some(b'{') => {
            #[derive(Deserialize)]
            struct T<'a> {
                #[serde(borrow)]
                tier: Option<&'a str>,
            }
            serde_json::from_slice::<T<'_>>(bytes).ok().and_then(|t| t.tier).unwrap_or("")
        }
        _ => "",
    }
}

/// Most distinct tier names one process keeps.
pub const MAX_TIER_NAMES: usize = 65_536;

/// The one copy of a tier name, for the life of the process: a cached
/// answer holds a plain reference (no reference count that every decision
/// on every thread would touch). Tier names are few (each is defined in a
/// rules file); past [`MAX_TIER_NAMES`] distinct ones, an entry naming a
/// new one is refused (written) or ignored (read, counted as bad).
pub(crate) fn intern_tier(name: &str) -> Result<&'static str, KeyError> {
    if let Some((t, _)) = TIERS.load().get_key_value(name) {
        return Ok(t);
    }
    let _writing = INTERNING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let tiers = TIERS.load_full();
    if let Some((t, _)) = tiers.get_key_value(name) {
        return Ok(t);
    }
    if tiers.len() >= MAX_TIER_NAMES {
        return Err(KeyError::Invalid(format!(
            "tier `{name}`: this server already knows {MAX_TIER_NAMES} distinct tier names; name one of the tiers the rules define"
        )));
    }
    let t: &'static str = Box::leak(Box::from(name));
    let id = tiers.len() as u32;
    let _ = TIER_NAMES[id as usize].set(t);
    let mut more = Tiers::clone(&tiers);
    more.insert(t, id);
    TIERS.store(std::sync::Arc::new(more));
    Ok(t)
}

type Tiers = std::collections::HashMap<&'static str, u32, foldhash::fast::RandomState>;

/// The interned tier names, by name: their ids. Read on every per-key
/// miss, from every deciding thread, without a lock (a lock's count would
/// be one cache line every miss writes); a new name (rare: tier names are
/// defined in rules files) replaces the map.
static TIERS: std::sync::LazyLock<arc_swap::ArcSwap<Tiers>> = std::sync::LazyLock::new(Default::default);

/// Held while a new name is added to [`TIERS`].
static INTERNING: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The interned tier names, by id: read without a lock (a cached answer
/// names its tier by id, see `compact`).
static TIER_NAMES: [std::sync::OnceLock<&'static str>; MAX_TIER_NAMES] =
    [const { std::sync::OnceLock::new() }; MAX_TIER_NAMES];

/// The id of an interned tier name.
pub(crate) fn tier_id(name: &str) -> Option<u32> {
    TIERS.load().get(name).copied()
}

/// The interned tier name of an id.
pub(crate) fn tier_named(id: u32) -> Option<&'static str> {
    TIER_NAMES.get(id as usize)?.get().copied()
}

/// The limits a stored value gives, for the decision path: a tier's name
/// ([`intern_tier`]), or own limits parsed and validated.
pub(crate) fn limits_of(bytes: &[u8]) -> Result<Limits, KeyError> {
    if bytes.first() == Some(&TIER) && bytes.len() > HEAD {
        let tier = std::str::from_utf8(&bytes[HEAD..]).map_err(bad)?;
        return Ok(Limits::Tier(intern_tier(tier)?));
    }
    let stored = Stored::decode(bytes)?;
    match (stored.tier, stored.limits) {
        (Some(t), _) => Ok(Limits::Tier(intern_tier(&t)?)),
        (None, Some(limits)) => own_limits(&limits, stored.name.as_deref()),
        (None, None) => Err(bad("neither a tier nor limits")),
    }
}

/// Validate own limits (a `rate_limit` block or a list of them, as JSON),
/// labelled `name` (default `per-key`) in metrics.
pub(crate) fn own_limits(limits: &serde_json::Value, name: Option<&str>) -> Result<Limits, KeyError> {
    let text = serde_json::to_string(limits).map_err(bad)?;
    let rules = parse_limits("limits", &text, name.unwrap_or(PER_KEY_LABEL)).map_err(KeyError::Limits)?;
    Ok(Limits::Own(rules.into()))
}

/// Separates the domain and the entries of a lookup key.
pub(crate) const ENTRY_SEP: char = '\u{0}';
/// Separates an entry's key from its value.
pub(crate) const KV_SEP: char = '\u{1}';

/// The lookup key of (domain, descriptor): the domain, then each `key` and
/// `value`, separated by control characters no entry may contain, so that
/// key order is (domain, descriptor) order and a domain or a descriptor
/// prefix is one range. `None` when a part holds one of them
/// (`check_text` refuses them in entries).
pub fn lookup_key<K: AsRef<str>, V: AsRef<str>>(domain: &str, entries: &[(K, V)]) -> Option<String> {
    let mut key = String::with_capacity(domain.len() + entries.len() * 16);
    lookup_key_into(&mut key, domain, entries).then_some(key)
}

/// [`lookup_key`] into `key` (cleared first); `false` when a part holds a
/// separator.
pub(crate) fn lookup_key_into<K: AsRef<str>, V: AsRef<str>>(
    key: &mut String,
    domain: &str,
    entries: &[(K, V)],
) -> bool {
    key.clear();
    let clean = |part: &str| !part.contains([ENTRY_SEP, KV_SEP]);
    if !clean(domain) || !entries.iter().all(|(k, v)| clean(k.as_ref()) && clean(v.as_ref())) {
        return false;
    }
    key.push_str(domain);
    for (k, v) in entries {
        key.push(ENTRY_SEP);
        key.push_str(k.as_ref());
        key.push(KV_SEP);
        key.push_str(v.as_ref());
    }
    true
}

/// Whether an entry's domain, key or value may be stored.
pub(crate) fn check_text(what: &str, text: &str) -> Result<(), KeyError> {
    if text.contains([ENTRY_SEP, KV_SEP]) {
        return Err(KeyError::Invalid(format!("{what} must not contain the control characters U+0000 or U+0001")));
    }
    Ok(())
}

/// The domain of a lookup key.
pub(crate) fn domain_of(key: &str) -> &str {
    key.split(ENTRY_SEP).next().unwrap_or_default()
}

/// The lookup key's domain and descriptor.
pub(crate) fn split_lookup_key(key: &str) -> (String, Vec<Entry>) {
    let mut parts = key.split(ENTRY_SEP);
    let domain = parts.next().unwrap_or_default().to_owned();
    let descriptor = parts
        .map(|p| {
            let (k, v) = p.split_once(KV_SEP).unwrap_or((p, ""));
            Entry { key: k.to_owned(), value: v.to_owned() }
        })
        .collect();
    (domain, descriptor)
}

/// The first lookup key of a listing: `domain`, then the descriptor written
/// `key=value, key=value` (a prefix of one: `user=al` lists every `user`
/// value starting `al`).
pub(crate) fn listing_start(domain: &str, prefix: &str) -> Result<String, KeyError> {
    check_text("domain", domain)?;
    check_text("prefix", prefix)?;
    let mut key = domain.to_owned();
    key.push(ENTRY_SEP);
    for (i, part) in prefix.split(", ").enumerate().filter(|(_, p)| !p.is_empty()) {
        if i > 0 {
            key.push(ENTRY_SEP);
        }
        match part.split_once('=') {
            Some((k, v)) => {
                key.push_str(k);
                key.push(KV_SEP);
                key.push_str(v);
            }
            None => key.push_str(part),
        }
    }
    Ok(key)
}

/// The `tier_counts` row of a value under a lookup key: `domain \0 tier`.
pub(crate) fn count_key(key: &str, value: &[u8]) -> String {
    format!("{}{ENTRY_SEP}{}", domain_of(key), tier_of(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_keys_order_by_domain_then_descriptor_and_split_back() {
        let a = lookup_key("api", &[("user", "alice")]).unwrap();
        let b = lookup_key("api", &[("user", "alice"), ("path", "/x")]).unwrap();
        let c = lookup_key("api", &[("user", "bob")]).unwrap();
        let d = lookup_key("api2", &[("user", "alice")]).unwrap();
        assert!(a < b && b < c && c < d, "{a:?} {b:?} {c:?} {d:?}");
        assert!(b.starts_with(&listing_start("api", "user=al").unwrap()));
        assert!(a.starts_with(&listing_start("api", "").unwrap()));
        assert!(!d.starts_with(&listing_start("api", "").unwrap()), "api2 is another domain");
        assert_eq!(listing_start("api", "user=alice").unwrap(), a, "a whole descriptor is its lookup key");
        let (domain, entries) = split_lookup_key(&b);
        assert_eq!(domain, "api");
        assert_eq!(entries[1], Entry { key: "path".into(), value: "/x".into() });
        assert!(lookup_key("api", &[("user", "a\u{0}b")]).is_none());
    }

    #[test]
    fn values_round_trip_and_the_first_builds_json_still_reads() {
        let tier = Stored { tier: Some("pro".into()), limits: None, name: None, updated_at: 42 };
        let own = Stored {
            tier: None,
            limits: Some(serde_json::json!({"unit": "second", "requests_per_unit": 5})),
            name: Some("vip".into()),
            updated_at: 7,
        };
        for s in [&tier, &own] {
            assert_eq!(&Stored::decode(&s.encode()).unwrap(), s);
        }
        assert_eq!(tier_of(&tier.encode()), "pro");
        assert_eq!(tier_of(&own.encode()), "");
        let old = br#"{"tier":"pro","updated_at":42}"#;
        assert_eq!(Stored::decode(old).unwrap(), tier);
        assert_eq!(tier_of(old), "pro");
        assert!(
            matches!(limits_of(&tier.encode()), Ok(Limits::Tier(t)) if std::ptr::eq(t, intern_tier("pro").unwrap()))
        );
        assert!(matches!(limits_of(&own.encode()), Ok(Limits::Own(r)) if r.len() == 1));
        assert!(Stored::decode(&[9, 0]).is_err());
        assert!(Stored::decode(&[]).is_err());
        assert_eq!(count_key(&lookup_key("api", &[("user", "a")]).unwrap(), &tier.encode()), "api\u{0}pro");
    }
}
