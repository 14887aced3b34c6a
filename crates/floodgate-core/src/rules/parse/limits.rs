//! A descriptor's limits: `rate_limit` and `rate_limits` (algorithm,
//! window, burst, shadow mode, failure policy, scope and sync), `unlimited`,
//! `replaces` and the `share` of a local fallback.

use super::{FileParser, Flags, RATE_LIMIT_KEYS, REPLACES_KEYS, RateLimitFields, describe};
use crate::region::{Scope, SyncMode, parse_overshoot};
use crate::rules::Pos;
use crate::rules::model::{
    DEFAULT_LEASE_TTL, DEFAULT_RESERVATION_TTL, FailureMode, MAX_LEASE_TTL, MAX_RESERVATION_TTL, Rule, Source, Unit,
};
use crate::rules::yaml::Node;
use crate::{Algorithm, AlgorithmKind, Charge, LeakyMode, Limit, LimitError, parse_duration};

impl FileParser<'_> {
    pub(super) fn rule(&mut self, node: &Node, field: &str, stats_key: &str, flags: Flags) -> Option<Rule> {
        let entries = self.map(node, field)?;
        let before = self.errors.len();
        let mut f = RateLimitFields::default();
        for (k, v) in entries {
            let Some(key) = self.key(k, v, field, RATE_LIMIT_KEYS) else { continue };
            let at = format!("{field}.{key}");
            let pos = v.pos();
            match key.as_str() {
                "requests_per_unit" => {
                    f.rpu = self.integer(v, &at, u64::from(u32::MAX)).unwrap_or(0);
                    f.rpu_pos = Some(pos);
                }
                "concurrency" => f.concurrency = self.integer(v, &at, u64::MAX).map(|n| (n, pos)),
                "lease_ttl" => f.lease_ttl = self.string(v, &at).map(|s| (s, pos)),
                "unit" => f.unit = self.string(v, &at).map(|s| (s, pos)),
                "unlimited" => f.unlimited = self.boolean(v, &at).unwrap_or(false),
                "name" => f.name = self.string(v, &at).filter(|s| !s.is_empty()),
                "replaces" => f.replaces = self.replaces(v, &at),
                "algorithm" => f.algorithm = self.string(v, &at).map(|s| (s, pos)),
                "window" => f.window = self.string(v, &at).map(|s| (s, pos)),
                "burst" => f.burst = self.integer(v, &at, crate::MAX_LIMIT).map(|b| (b, pos)),
                "granularity" => {
                    f.granularity = self.integer(v, &at, u64::from(u32::MAX)).map(|g| (g as u32, pos));
                }
                "mode" => f.mode = self.string(v, &at).map(|s| (s, pos)),
                "failure_mode" => f.failure_mode = self.string(v, &at).map(|s| (s, pos)),
                "scope" => f.scope = self.string(v, &at).map(|s| (s, pos)),
                "sync" => f.sync = self.string(v, &at).map(|s| (s, pos)),
                "overshoot" => f.overshoot = self.string(v, &at).map(|s| (s, pos)),
                "charge" => f.charge = self.string(v, &at).map(|s| (s, pos)),
                "reservation_ttl" => f.reservation_ttl = self.string(v, &at).map(|s| (s, pos)),
                "cost" => f.cost = self.cost(v, &at).map(|c| (std::sync::Arc::new(c), pos)),
                _ => f.local_share = self.share(v, &at).map(|s| (s, pos)),
            }
        }
        if let Some(n) = &f.name
            && f.replaces.iter().any(|r| r == n)
        {
            self.error(node.pos(), &format!("{field}.replaces"), format!("a rule cannot replace itself (`{n}`)"));
        }
        let failure_mode = match &f.failure_mode {
            None => FailureMode::Open,
            Some((s, pos)) => match s.as_str() {
                "open" => FailureMode::Open,
                "closed" => FailureMode::Closed,
                "local" => FailureMode::Local,
                _ => {
                    self.error(
                        *pos,
                        &format!("{field}.failure_mode"),
                        format!("unknown failure_mode `{s}`: use open, closed or local"),
                    );
                    FailureMode::Open
                }
            },
        };
        let scope = self.scope(&f, field);
        let reservation_ttl = self.reservation_ttl(&f, field);
        let (limit, local_limit) = if f.unlimited {
            self.check_unlimited(&f, field);
            (None, None)
        } else if let Some((n, pos)) = f.concurrency {
            if let Scope::Global(_) = scope {
                self.error(
                    f.scope.as_ref().map_or(pos, |s| s.1),
                    &format!("{field}.scope"),
                    "a concurrency limit cannot be global: a slot is claimed and freed in an instant, and a \
                     cross-region slot would need a round trip to every region on each acquire (or slices that \
                     strand slots in idle regions); limit each region's backends with scope: region (the default)",
                );
            }
            if let (FailureMode::Local, Some((_, at))) = (failure_mode, &f.failure_mode) {
                self.error(
                    *at,
                    &format!("{field}.failure_mode"),
                    "failure_mode: local keeps a rate in this instance while the store fails; a slot taken there \
                     could not be released through the store: use open or closed",
                );
            }
            (Some(self.concurrency(&f, n, pos, field)?), None)
        } else {
            let limit = self.limited(&f, node, field)?;
            if let (Charge::After, Scope::Global(_), Some((_, pos)), crate::Algorithm::FixedWindow) =
                (limit.charge(), scope, &f.charge, limit.algorithm())
            {
                // The regions count per window and forget a window once it
                // ends; a fixed window's debt lasts into the windows after.
                self.error(
                    *pos,
                    &format!("{field}.charge"),
                    "charge: after with scope: global needs sliding_window, sliding_buckets or gcra (a fixed window carries its debt into later windows, which the regions' per-window counts cannot carry): set algorithm, or use scope: region",
                );
            }
            self.check_cost(&f, &limit, scope, field);
            let local = self.local_limit(&limit, failure_mode, f.local_share, field);
            (Some(limit), local)
        };
        (self.errors.len() == before).then(|| Rule {
            name: f.name.map(std::sync::Arc::from),
            unit: limit.as_ref().and_then(|l| Unit::of_window(l.window())),
            limit,
            replaces: f.replaces,
            shadow_mode: flags.shadow_mode,
            quota_mode: flags.quota_mode,
            detailed_metric: flags.detailed_metric,
            failure_mode,
            local_limit,
            scope,
            stats_key: stats_key.to_owned(),
            source: Source { file: self.file, pos: node.pos() },
            reservation_ttl,
            cost: f.cost.map(|c| c.0),
        })
    }

    /// A concurrency limit: `concurrency: N` slots, each lease lasting
    /// `lease_ttl` (default [`DEFAULT_LEASE_TTL`]) unless released or
    /// extended first. It takes none of a rate's fields.
    fn concurrency(&mut self, f: &RateLimitFields, n: u64, pos: Pos, field: &str) -> Option<Limit> {
        let rate_fields = [
            ("requests_per_unit", f.rpu_pos),
            ("unit", f.unit.as_ref().map(|u| u.1)),
            ("window", f.window.as_ref().map(|w| w.1)),
            ("algorithm", f.algorithm.as_ref().map(|a| a.1)),
            ("burst", f.burst.map(|b| b.1)),
            ("granularity", f.granularity.map(|g| g.1)),
            ("mode", f.mode.as_ref().map(|m| m.1)),
            ("charge", f.charge.as_ref().map(|c| c.1)),
            ("reservation_ttl", f.reservation_ttl.as_ref().map(|r| r.1)),
            ("cost", f.cost.as_ref().map(|c| c.1)),
            ("sync", f.sync.as_ref().map(|s| s.1)),
            ("overshoot", f.overshoot.as_ref().map(|o| o.1)),
        ];
        let before = self.errors.len();
        for (k, at) in rate_fields {
            if let Some(at) = at {
                self.error(
                    at,
                    &format!("{field}.{k}"),
                    format!(
                        "a concurrency limit takes no {k}: it bounds requests in flight, not per unit of time; \
                         put a rate beside it in a rate_limits list, or remove {k}"
                    ),
                );
            }
        }
        if n == 0 || n > crate::MAX_CONCURRENCY {
            self.error(
                pos,
                &format!("{field}.concurrency"),
                format!(
                    "concurrency {n}: write the requests in flight at once per key, from 1 to {}",
                    crate::MAX_CONCURRENCY
                ),
            );
        }
        let ttl = self.ttl(
            &f.lease_ttl,
            &format!("{field}.lease_ttl"),
            (DEFAULT_LEASE_TTL, MAX_LEASE_TTL),
            "longer than the longest request it counts (a holder that never releases keeps its slot this long; \
             default 60s)",
        );
        if self.errors.len() > before {
            return None;
        }
        Limit::new(Algorithm::Concurrency, n, ttl)
            .map_err(|e| self.error(pos, &format!("{field}.concurrency"), e.to_string()))
            .ok()
    }

    /// `reservation_ttl`: a duration from 1s to a day (default 5 minutes).
    fn reservation_ttl(&mut self, f: &RateLimitFields, field: &str) -> std::time::Duration {
        self.ttl(
            &f.reservation_ttl,
            &format!("{field}.reservation_ttl"),
            (DEFAULT_RESERVATION_TTL, MAX_RESERVATION_TTL),
            "(how long a reservation may give back what it did not use; default 5m)",
        )
    }

    /// A duration field from 1s to `bounds.1` (`bounds.0` when absent or
    /// wrong); `what` says what it is for in the error.
    fn ttl(
        &mut self,
        value: &Option<(String, Pos)>,
        at: &str,
        bounds: (std::time::Duration, std::time::Duration),
        what: &str,
    ) -> std::time::Duration {
        let Some((text, pos)) = value else { return bounds.0 };
        match parse_duration(text) {
            Ok(d) if d >= std::time::Duration::from_secs(1) && d <= bounds.1 => d,
            r => {
                let why = r.err().map(|e| format!(" ({e})")).unwrap_or_default();
                self.error(*pos, at, format!("`{text}`{why}: write a duration from 1s to 24h {what}"));
                bounds.0
            }
        }
    }

    /// An unlimited rule takes no unit (a valid one is an error, an invalid
    /// one is ignored with a warning, as envoy does) and none of floodgate's
    /// limit parameters.
    pub(super) fn check_unlimited(&mut self, f: &RateLimitFields, field: &str) {
        if let Some((u, pos)) = &f.unit {
            if Unit::parse(u).is_some() {
                self.error(*pos, &format!("{field}.unit"), "unlimited takes no unit: remove unit, or remove unlimited");
            } else {
                self.warn(*pos, &format!("{field}.unit"), format!("unit `{u}` is ignored on an unlimited rule"));
            }
        }
        let extensions = [
            ("algorithm", f.algorithm.as_ref().map(|a| a.1)),
            ("window", f.window.as_ref().map(|w| w.1)),
            ("burst", f.burst.map(|b| b.1)),
            ("granularity", f.granularity.map(|g| g.1)),
            ("mode", f.mode.as_ref().map(|m| m.1)),
            ("scope", f.scope.as_ref().map(|m| m.1)),
            ("sync", f.sync.as_ref().map(|m| m.1)),
            ("overshoot", f.overshoot.as_ref().map(|m| m.1)),
            ("charge", f.charge.as_ref().map(|m| m.1)),
            ("reservation_ttl", f.reservation_ttl.as_ref().map(|m| m.1)),
            ("cost", f.cost.as_ref().map(|m| m.1)),
            ("concurrency", f.concurrency.map(|m| m.1)),
            ("lease_ttl", f.lease_ttl.as_ref().map(|m| m.1)),
        ];
        for (k, pos) in extensions {
            if let Some(pos) = pos {
                self.error(
                    pos,
                    &format!("{field}.{k}"),
                    format!("unlimited takes no {k}: remove it, or remove unlimited"),
                );
            }
        }
    }

    /// The limit of a rule that is not unlimited.
    pub(super) fn limited(&mut self, f: &RateLimitFields, node: &Node, field: &str) -> Option<Limit> {
        let window = match (&f.unit, &f.window) {
            (Some((_, pos)), Some(_)) => {
                self.error(
                    *pos,
                    &format!("{field}.unit"),
                    "both unit and window: keep one (window: 90s, or unit: minute)",
                );
                None
            }
            (Some((u, pos)), None) => {
                match Unit::parse(u) {
                    Some(v) => Some(v.window()),
                    None => {
                        self.error(
                        *pos,
                        &format!("{field}.unit"),
                        format!("invalid unit `{u}`: use second, minute, hour, day, week, month or year (or window: 90s)"),
                    );
                        None
                    }
                }
            }
            (None, Some((w, pos))) => match parse_duration(w) {
                Ok(d) => Some(d),
                Err(e) => {
                    self.error(*pos, &format!("{field}.window"), e.to_string());
                    None
                }
            },
            (None, None) => {
                self.error(
                    node.pos(),
                    field,
                    "missing unit: add unit: second|minute|hour|day|week|month|year, or window: <duration> (e.g. 90s)",
                );
                None
            }
        };
        let kind = match &f.algorithm {
            None => Some(AlgorithmKind::FixedWindow),
            Some((a, pos)) => a
                .parse::<AlgorithmKind>()
                .map_err(|e| self.error(*pos, &format!("{field}.algorithm"), e.to_string()))
                .ok(),
        };
        let mode = match &f.mode {
            None => None,
            Some((m, pos)) => match m.parse::<LeakyMode>() {
                Ok(m) => Some((m, *pos)),
                Err(e) => {
                    self.error(*pos, &format!("{field}.mode"), e.to_string());
                    None
                }
            },
        };
        let charge = match &f.charge {
            None => Some(Charge::Before),
            Some((c, pos)) => {
                c.parse::<Charge>().map_err(|e| self.error(*pos, &format!("{field}.charge"), e.to_string())).ok()
            }
        };
        let (Some(window), Some(kind), Some(charge)) = (window, kind, charge) else { return None };
        let algorithm =
            Algorithm::from_parts(kind, f.burst.map(|b| b.0), f.granularity.map(|g| g.0), mode.map(|m| m.0));
        match algorithm.and_then(|a| Limit::new(a, f.rpu, window)).and_then(|l| l.with_charge(charge)) {
            Ok(l) => Some(l),
            Err(e) => {
                let (name, pos) = match &e {
                    LimitError::BurstNotSupported(_) | LimitError::BurstZero | LimitError::BurstTooLarge(_) => {
                        ("burst", f.burst.map(|b| b.1))
                    }
                    LimitError::GranularityNotSupported(_)
                    | LimitError::GranularityOutOfRange(_)
                    | LimitError::GranularityDoesNotDivide { .. } => ("granularity", f.granularity.map(|g| g.1)),
                    LimitError::ModeNotSupported(_) => ("mode", mode.map(|m| m.1)),
                    LimitError::ChargeAfterShaper => ("charge", f.charge.as_ref().map(|c| c.1)),
                    LimitError::LimitTooLarge(_) | LimitError::LogLimitTooLarge(_) => ("requests_per_unit", None),
                    _ => ("", None),
                };
                let at = if name.is_empty() { field.to_owned() } else { format!("{field}.{name}") };
                self.error(pos.unwrap_or(node.pos()), &at, e.to_string());
                None
            }
        }
    }

    /// `scope`, `sync` and `overshoot`, checked together. Whether the
    /// regions exist, and whether a bounded rule's slice is at least one
    /// hit, depend on how the service runs: `serve` checks those.
    pub(super) fn scope(&mut self, f: &RateLimitFields, field: &str) -> Scope {
        let global = match &f.scope {
            None => false,
            Some((s, pos)) => match s.as_str() {
                "region" => false,
                "global" => true,
                _ => {
                    self.error(
                        *pos,
                        &format!("{field}.scope"),
                        format!("unknown scope `{s}`: use region (this region's store alone, the default) or global (one limit across every region)"),
                    );
                    return Scope::Region;
                }
            },
        };
        if !global {
            for (k, pos) in [("sync", f.sync.as_ref().map(|s| s.1)), ("overshoot", f.overshoot.as_ref().map(|s| s.1))] {
                if let Some(pos) = pos {
                    self.error(
                        pos,
                        &format!("{field}.{k}"),
                        format!("{k} applies only to scope: global: add scope: global, or remove {k}"),
                    );
                }
            }
            return Scope::Region;
        }
        let overshoot = f.overshoot.as_ref().and_then(|(o, pos)| {
            parse_overshoot(o).map_err(|e| self.error(*pos, &format!("{field}.overshoot"), e.to_string())).ok()
        });
        let mode = match f.sync.as_ref().map(|(s, pos)| (s.as_str(), *pos)) {
            None | Some(("eventual", _)) => {
                if let Some((_, pos)) = &f.overshoot {
                    self.error(
                        *pos,
                        &format!("{field}.overshoot"),
                        "overshoot applies only to sync: bounded: add sync: bounded, or remove overshoot",
                    );
                }
                SyncMode::Eventual
            }
            Some(("bounded", pos)) => match (overshoot, &f.overshoot) {
                (Some(overshoot_ppm), _) => SyncMode::Bounded { overshoot_ppm },
                (None, Some(_)) => SyncMode::Eventual,
                (None, None) => {
                    self.error(
                        pos,
                        &format!("{field}.overshoot"),
                        "sync: bounded needs overshoot, the most the regions together may admit beyond the limit: e.g. overshoot: 5%",
                    );
                    SyncMode::Eventual
                }
            },
            Some((other, pos)) => {
                self.error(
                    pos,
                    &format!("{field}.sync"),
                    format!("unknown sync `{other}`: use eventual (the default) or bounded (with overshoot: 5%)"),
                );
                SyncMode::Eventual
            }
        };
        Scope::Global(mode)
    }

    /// For `failure_mode: local`, the limit kept locally:
    /// `max(1, floor(limit * local_share))` (burst scaled alike).
    pub(super) fn local_limit(
        &mut self,
        limit: &Limit,
        failure_mode: FailureMode,
        local_share: Option<(u32, Pos)>,
        field: &str,
    ) -> Option<Limit> {
        match (failure_mode, local_share) {
            (FailureMode::Local, share) => {
                let ppm = share.map_or(1_000_000, |s| s.0);
                let local = (u128::from(limit.limit()) * u128::from(ppm) / 1_000_000).max(1);
                let burst = local_burst(limit, ppm);
                let algorithm = with_burst(*limit.algorithm(), burst);
                Limit::new(algorithm, u64::try_from(local).unwrap_or(u64::MAX), limit.window())
                    .and_then(|l| l.with_charge(limit.charge()))
                    .ok()
            }
            (_, Some((_, pos))) => {
                self.warn(pos, &format!("{field}.local_share"), "local_share only applies with failure_mode: local");
                None
            }
            _ => None,
        }
    }

    pub(super) fn replaces(&mut self, node: &Node, field: &str) -> Vec<String> {
        let Node::Seq { items, .. } = node else {
            if !node.is_null() {
                self.error(node.pos(), field, format!("expected a list (`- name: other_rule`), found {}", node.kind()));
            }
            return Vec::new();
        };
        let mut names = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let f = format!("{field}[{i}]");
            let Some(entries) = self.map(item, &f) else { continue };
            let mut name = None;
            for (k, v) in entries {
                if self.key(k, v, &f, REPLACES_KEYS).is_some() {
                    name = self.string(v, &format!("{f}.name"));
                }
            }
            match name {
                Some(n) if !n.is_empty() => names.push(n),
                _ => self.error(
                    item.pos(),
                    &format!("{f}.name"),
                    "empty replaces entry: write the name of the rule to replace",
                ),
            }
        }
        names
    }

    /// `local_share` in (0, 1], as parts per million (exact, no float).
    pub(super) fn share(&mut self, node: &Node, field: &str) -> Option<u32> {
        let text = match node {
            Node::Scalar { value, plain: true, .. } => value.as_str(),
            other => {
                self.error(other.pos(), field, format!("expected a number in (0, 1], found {}", describe(other)));
                return None;
            }
        };
        let ppm = parse_ppm(text).and_then(|p| u32::try_from(p).ok());
        match ppm {
            Some(p) if p > 0 && p <= 1_000_000 => Some(p),
            _ => {
                self.error(
                    node.pos(),
                    field,
                    format!("local_share `{text}` must be a number in (0, 1] with at most 6 decimals, e.g. 0.5"),
                );
                None
            }
        }
    }
}

/// The burst the local fallback keeps: the configured one scaled by the
/// same share (at least 1), or the default (the local limit).
fn local_burst(limit: &Limit, ppm: u32) -> Option<u64> {
    match limit.algorithm() {
        Algorithm::TokenBucket { burst: Some(b) }
        | Algorithm::Gcra { burst: Some(b) }
        | Algorithm::LeakyBucket { burst: Some(b), .. } => {
            Some(u64::try_from((u128::from(*b) * u128::from(ppm) / 1_000_000).max(1)).unwrap_or(u64::MAX))
        }
        _ => None,
    }
}

fn with_burst(a: Algorithm, burst: Option<u64>) -> Algorithm {
    match a {
        Algorithm::TokenBucket { .. } => Algorithm::TokenBucket { burst },
        Algorithm::Gcra { .. } => Algorithm::Gcra { burst },
        Algorithm::LeakyBucket { mode, .. } => Algorithm::LeakyBucket { burst, mode },
        other => other,
    }
}

/// "0.25" → 250 000; "1" → 1 000 000.
pub(super) fn parse_ppm(text: &str) -> Option<u64> {
    let (int, frac) = text.split_once('.').unwrap_or((text, ""));
    if int.is_empty() && frac.is_empty() || frac.len() > 6 {
        return None;
    }
    if !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let int: u64 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let frac: u64 = format!("{frac:0<6}").parse().ok()?;
    int.checked_mul(1_000_000)?.checked_add(frac)
}
