//! Writes: entries validated against the rules, stored (on disk or in
//! Redis), then dropped from the cache.

use std::collections::HashSet;
use std::sync::PoisonError;
use std::sync::atomic::Ordering::Relaxed;

use floodgate_core::rules::{Rule, RuleSet};

use crate::cache::CacheKey;
use crate::entries::value::{self, lookup_key};
use crate::entries::{Write, build, writes_of};
use crate::{KeyEntry, KeyError, KeySpec, Limits, PerKey, unix_now};

impl PerKey {
    /// Validate `specs` against the rules `set` (tiers must exist there;
    /// `check_rule` refuses limits this server cannot honour) and build them.
    /// Every error, with the index of its spec.
    pub fn validate(
        specs: Vec<KeySpec>,
        set: &RuleSet,
        check_rule: impl Fn(&Rule) -> Option<String>,
    ) -> Result<Vec<KeyEntry>, Vec<(usize, KeyError)>> {
        let now = unix_now();
        let mut built = Vec::with_capacity(specs.len());
        let mut errors = Vec::new();
        for (i, spec) in specs.into_iter().enumerate() {
            let e = build(spec, now).and_then(|e| {
                match &e.limits {
                    Limits::Tier(t) => {
                        let Some(domain) = set.domain(&e.spec.domain) else {
                            return Err(KeyError::Invalid(format!(
                                "tier `{t}`: domain `{}` has no rules file here, and tiers are defined in it (under `tiers:`)",
                                e.spec.domain
                            )));
                        };
                        if domain.tier(t).is_none() {
                            let mut known: Vec<&str> = domain.tiers().map(|(n, _)| n).collect();
                            known.sort_unstable();
                            let known = if known.is_empty() { "none".to_owned() } else { known.join(", ") };
                            return Err(KeyError::Invalid(format!(
                                "unknown tier `{t}` in domain `{}` (its tiers: {known}): name one of them, or define it under `tiers:` in the domain's rules file",
                                e.spec.domain
                            )));
                        }
                    }
                    Limits::Own(rules) => {
                        if let Some(why) = rules.iter().find_map(&check_rule) {
                            return Err(KeyError::Invalid(format!("limits: {why}")));
                        }
                    }
                }
                Ok(e)
            });
            match e {
                Ok(e) => built.push(e),
                Err(e) => errors.push((i, e)),
            }
        }
        if errors.is_empty() { Ok(built) } else { Err(errors) }
    }

    /// Write validated entries ([`PerKey::validate`]): in one transaction
    /// on disk; in Redis, see `sharded`.
    pub async fn put_all(&self, entries: &[KeyEntry]) -> Result<usize, KeyError> {
        self.commit(writes_of(entries)?).await?;
        Ok(entries.len())
    }

    /// Write validated entries on disk, in one transaction (not for entries
    /// kept in Redis: [`PerKey::put_all`]).
    pub fn write_all(&self, entries: &[KeyEntry]) -> Result<usize, KeyError> {
        self.commit_disk(&writes_of(entries)?)?;
        Ok(entries.len())
    }

    /// Apply writes to the store, then refresh the counts and drop the
    /// written keys from the cache (in that order: a lookup after the drop
    /// reads the new state, and sees its domain). Whether each key held an
    /// entry before.
    pub(crate) async fn commit(&self, writes: Vec<Write>) -> Result<Vec<bool>, KeyError> {
        let Some(sharded) = self.sharded.get() else { return self.commit_disk(&writes) };
        let _guard = self.shared_write.lock().await;
        let before = sharded.apply(&writes).await?;
        if let Err(e) = self.refresh_counts().await {
            tracing::debug!("per-key counts not read after a write: {e}");
        }
        self.forget(writes.iter().map(|w| w.key.as_str()));
        Ok(before)
    }

    pub(crate) fn commit_disk(&self, writes: &[Write]) -> Result<Vec<bool>, KeyError> {
        if self.is_shared() {
            return Err(KeyError::Invalid(
                "per-key entries are kept in Redis here: write them through the admin API".into(),
            ));
        }
        let _guard = self.write.lock().unwrap_or_else(PoisonError::into_inner);
        let before = self.disk.apply(writes, |_| Ok(()))?;
        self.set_counts(self.disk.counts()?);
        self.forget(writes.iter().map(|w| w.key.as_str()));
        Ok(before)
    }

    /// Drop these lookup keys from the cache, and note their domains as
    /// having entries (so lookups no longer skip them).
    pub(crate) fn forget<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let mut new_domains: Vec<Box<str>> = Vec::new();
        self.dropping(|| {
            let domains = self.domains.load();
            for k in keys {
                // Not while a miss of this key reads (`lookup_disk`).
                let _reading = self.stripe(k);
                self.compact.remove(self.compact.place(k));
                self.cache.remove(&CacheKey::new(k));
                let d = value::domain_of(k);
                if !domains.contains(d) && !new_domains.iter().any(|n| &**n == d) {
                    new_domains.push(Box::from(d));
                }
            }
        });
        if !new_domains.is_empty() {
            self.noticed.fetch_add(1, Relaxed);
            self.domains.rcu(|old| {
                let mut set = HashSet::clone(old);
                set.extend(new_domains.iter().cloned());
                set
            });
        }
    }

    /// [`PerKey::validate`] of one spec: the entry, or why not.
    pub(crate) fn validate_one(
        spec: KeySpec,
        set: &RuleSet,
        check_rule: impl Fn(&Rule) -> Option<String>,
    ) -> Result<KeyEntry, KeyError> {
        match Self::validate(vec![spec], set, check_rule) {
            Ok(mut built) => Ok(built.remove(0)),
            Err(mut errors) => Err(errors.remove(0).1),
        }
    }

    /// Set one entry (validated against `set`; `check_rule` refuses limits
    /// this server cannot honour, as for [`PerKey::validate`]).
    pub async fn put(
        &self,
        spec: KeySpec,
        set: &RuleSet,
        check_rule: impl Fn(&Rule) -> Option<String>,
    ) -> Result<KeyEntry, KeyError> {
        let e = Self::validate_one(spec, set, check_rule)?;
        self.put_all(std::slice::from_ref(&e)).await?;
        Ok(e)
    }

    /// Set one entry on disk (validated against `set`); durable when this
    /// returns.
    pub fn set(&self, spec: KeySpec, set: &RuleSet) -> Result<KeyEntry, KeyError> {
        let e = Self::validate_one(spec, set, |_| None)?;
        self.write_all(std::slice::from_ref(&e))?;
        Ok(e)
    }

    /// Delete one entry on disk; `false` when there was none.
    pub fn delete(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Result<bool, KeyError> {
        let Some(key) = lookup_key(domain, entries) else { return Ok(false) };
        Ok(self.commit_disk(&[Write { key, value: None }])?.first().copied().unwrap_or(false))
    }

    /// Delete one entry from the store; `false` when there was none.
    pub async fn remove(&self, domain: &str, entries: &[(impl AsRef<str>, impl AsRef<str>)]) -> Result<bool, KeyError> {
        let Some(key) = lookup_key(domain, entries) else { return Ok(false) };
        Ok(self.commit(vec![Write { key, value: None }]).await?.first().copied().unwrap_or(false))
    }
}
