//! Listing the entries, in key order, a page at a time.

use crate::entries::value::{self, Stored};
use crate::{KeyError, KeySpec, PerKey};

/// A page of a listing.
#[derive(Debug)]
pub struct Page {
    /// The entries, in (domain, descriptor) order.
    pub entries: Vec<(KeySpec, u64)>,
    /// Give it as `cursor` for the next page (`None` at the end).
    pub next_cursor: Option<String>,
}

/// What one page of a listing reads.
pub(crate) enum Scan {
    /// One lookup key (an exact descriptor).
    Exact(String),
    /// Keys from `start` (inclusive or not) while they start with `within`.
    Range { start: String, inclusive: bool, within: String },
    /// Nothing (past an exact descriptor's page).
    Nothing,
}

impl Scan {
    /// The read of a listing of `domain` (all when `None`) under `prefix`
    /// (exactly it with `exact`), after `cursor`.
    fn of(domain: Option<&str>, prefix: &str, exact: bool, cursor: Option<&str>) -> Result<Self, KeyError> {
        let within = match domain {
            Some(d) => value::listing_start(d, prefix)?,
            None if prefix.is_empty() => String::new(),
            None => return Err(KeyError::Invalid("prefix: give domain too".into())),
        };
        let after = cursor.map(unhex).transpose()?;
        Ok(match after {
            Some(a) if exact && a >= within => Self::Nothing,
            _ if exact => Self::Exact(within),
            Some(a) if a >= within => Self::Range { start: a, inclusive: false, within },
            _ => Self::Range { start: within.clone(), inclusive: true, within },
        })
    }
}

pub(crate) fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Result<String, KeyError> {
    let bad = || KeyError::Invalid("cursor: give a page's next_cursor as it was".into());
    if !s.len().is_multiple_of(2) {
        return Err(bad());
    }
    let bytes: Vec<u8> = (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16))
        .collect::<Result<_, _>>()
        .map_err(|_| bad())?;
    String::from_utf8(bytes).map_err(|_| bad())
}

impl PerKey {
    /// One page of entries in (domain, descriptor) order: of `domain` (all
    /// domains when `None`) whose descriptor, written `key=value, key=value`,
    /// starts with `prefix` (or is exactly `prefix` with `exact`), after
    /// `cursor` (a page's `next_cursor`). Up to `limit`: with Redis a page
    /// may hold fewer while more follow (`next_cursor` says).
    pub async fn list(
        &self,
        domain: Option<&str>,
        prefix: &str,
        exact: bool,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, KeyError> {
        let Some(sharded) = self.sharded.get() else { return self.page(domain, prefix, exact, cursor, limit) };
        let (rows, more) = match Scan::of(domain, prefix, exact, cursor)? {
            Scan::Exact(k) => (sharded.get(&k).await?.map(|v| vec![(k, v)]).unwrap_or_default(), false),
            Scan::Range { start, inclusive, within } => sharded.page(&start, inclusive, &within, limit).await?,
            Scan::Nothing => (Vec::new(), false),
        };
        self.page_of(rows, more)
    }

    /// [`PerKey::list`] on disk (not for entries kept in Redis).
    pub fn page(
        &self,
        domain: Option<&str>,
        prefix: &str,
        exact: bool,
        cursor: Option<&str>,
        limit: usize,
    ) -> Result<Page, KeyError> {
        let (rows, more) = match Scan::of(domain, prefix, exact, cursor)? {
            Scan::Exact(k) => (self.disk.get(&k)?.map(|v| vec![(k, v)]).unwrap_or_default(), false),
            Scan::Range { start, inclusive, within } => self.disk.page(&start, inclusive, &within, limit)?,
            Scan::Nothing => (Vec::new(), false),
        };
        self.page_of(rows, more)
    }

    /// A page of stored rows (one that does not decode is skipped, logged).
    pub(crate) fn page_of(&self, rows: Vec<(String, Vec<u8>)>, more: bool) -> Result<Page, KeyError> {
        let next_cursor = if more { rows.last().map(|(k, _)| hex(k)) } else { None };
        let entries = rows
            .into_iter()
            .filter_map(|(k, v)| match Stored::decode(&v) {
                Ok(s) => {
                    let at = s.updated_at;
                    Some((s.spec(&k), at))
                }
                Err(e) => {
                    tracing::warn!(entry = %k.replace(['\u{0}', '\u{1}'], " "), "a stored entry that does not decode is not listed: {e}");
                    None
                }
            })
            .collect();
        Ok(Page { entries, next_cursor })
    }
}
