//! The loaded rule tree.

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use super::{ConfigError, Pos};
use crate::Limit;
use crate::region::Scope;

/// envoy's `rate_limit.unit`: a fixed window of this length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3600 s.
    Hour,
    /// 86 400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days.
    Month,
    /// 365 days.
    Year,
}

impl Unit {
    /// Every unit, shortest first.
    pub const ALL: [Unit; 7] = [Unit::Second, Unit::Minute, Unit::Hour, Unit::Day, Unit::Week, Unit::Month, Unit::Year];

    /// The unit's name, lower case.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }

    /// Parse a unit name, ignoring case (as envoy does).
    pub fn parse(s: &str) -> Option<Unit> {
        Unit::ALL.into_iter().find(|u| u.as_str().eq_ignore_ascii_case(s))
    }

    /// The unit's window.
    pub fn window(self) -> Duration {
        Duration::from_secs(match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3_600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        })
    }

    /// The unit whose window is exactly `window`, if any.
    pub fn of_window(window: Duration) -> Option<Unit> {
        Unit::ALL.into_iter().find(|u| u.window() == window)
    }
}

/// What a rule does when its store cannot answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum FailureMode {
    /// Allow the request (and count it in a metric): envoy's behaviour.
    #[default]
    Open,
    /// Deny the request.
    Closed,
    /// Decide with the in-memory store, on `local_share` of the limit.
    Local,
}

impl FailureMode {
    /// The configuration name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Closed => "closed",
            Self::Local => "local",
        }
    }
}

/// Where something was defined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Source {
    /// Index into [`RuleSet::files`](super::RuleSet::files).
    pub file: u32,
    /// Position in that file.
    pub pos: Pos,
}

/// One limit attached to a descriptor (a `rate_limit` block, or one entry of
/// `rate_limits`).
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// `name`, used by `replaces` (shared: answers carry it without a copy).
    pub name: Option<std::sync::Arc<str>>,
    /// The limit; `None` for `unlimited: true`.
    pub limit: Option<Limit>,
    /// The envoy unit when the window is exactly one (for RLS responses).
    pub unit: Option<Unit>,
    /// Names of rules this one replaces within a request.
    pub replaces: Vec<String>,
    /// Count and report, but never deny.
    pub shadow_mode: bool,
    /// envoy's quota mode.
    pub quota_mode: bool,
    /// Per-value metrics (envoy's `detailed_metric`).
    pub detailed_metric: bool,
    /// What to do when the store fails.
    pub failure_mode: FailureMode,
    /// For `failure_mode: local`: the limit used locally,
    /// `max(1, floor(limit * local_share))`.
    pub local_limit: Option<Limit>,
    /// Which regions share the limit (`scope`, `sync`, `overshoot`).
    pub scope: Scope,
    /// envoy's stats key for the descriptor (`domain.key1_value1.subkey1`).
    pub stats_key: String,
    /// Where the rule is defined.
    pub source: Source,
    /// How long a reservation's part of this rule may return what it did
    /// not use; after that it keeps its estimate (`reservation_ttl`,
    /// [`DEFAULT_RESERVATION_TTL`]).
    pub reservation_ttl: std::time::Duration,
    /// What a request metered by the proxy or the tower layer reserves and
    /// settles (`cost:`); `None`: one hit.
    pub cost: Option<std::sync::Arc<super::cost::Cost>>,
}

/// A rule's `reservation_ttl` when it names none: 5 minutes.
pub const DEFAULT_RESERVATION_TTL: std::time::Duration = std::time::Duration::from_secs(300);

/// A concurrency limit's `lease_ttl` when it names none: a minute.
pub const DEFAULT_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(60);

/// The longest `lease_ttl`: a day.
pub const MAX_LEASE_TTL: std::time::Duration = std::time::Duration::from_secs(86_400);

/// The longest `reservation_ttl`: a day.
pub const MAX_RESERVATION_TTL: std::time::Duration = std::time::Duration::from_secs(86_400);

impl Rule {
    /// The rule's label in metrics and the dashboard: its `name`, else its
    /// stats key.
    pub fn label(&self) -> &str {
        self.name.as_deref().unwrap_or(&self.stats_key)
    }

    /// A rule made of a limit alone (no name, not shadowed, failure mode
    /// `open`): e.g. the limit an RLS request's descriptor carries.
    pub fn from_limit(limit: Limit, stats_key: String) -> Rule {
        Rule {
            name: None,
            unit: Unit::of_window(limit.window()),
            limit: Some(limit),
            replaces: Vec::new(),
            shadow_mode: false,
            quota_mode: false,
            detailed_metric: false,
            failure_mode: FailureMode::Open,
            local_limit: None,
            scope: Scope::Region,
            stats_key,
            source: Source { file: u32::MAX, pos: Pos::default() },
            reservation_ttl: DEFAULT_RESERVATION_TTL,
            cost: None,
        }
    }
}

/// A node of a domain's descriptor tree.
#[derive(Debug, Clone, Default)]
pub(crate) struct DescNode {
    pub(crate) rules: Vec<Rule>,
    /// Children by composite key (`key` or `key_value`).
    pub(crate) children: HashMap<Box<str>, u32>,
    /// Children whose composite key holds `*`, in file order: the pattern
    /// split at `*`, the child.
    pub(crate) wildcards: Vec<(Box<[Box<str>]>, u32)>,
    /// The composite key pattern, for `share_threshold`.
    pub(crate) share_pattern: Option<Box<str>>,
    /// Where the descriptor is defined.
    pub(crate) pos: Pos,
}

/// One domain: its file and its descriptor tree.
#[derive(Debug, Clone)]
pub struct Domain {
    pub(crate) name: String,
    pub(crate) file: u32,
    /// Where `domain:` is.
    pub(crate) pos: Pos,
    /// Node 0 is the root (the domain itself).
    pub(crate) nodes: Vec<DescNode>,
    /// How the reverse proxy and the tower layer build this domain's
    /// descriptors from an HTTP request (`request_descriptors:`).
    pub(crate) request_descriptors: Vec<RequestDescriptor>,
    /// Named plans for per-key entries (`tiers:`).
    pub(crate) tiers: HashMap<Box<str>, Tier>,
    /// What metering its requests needs, when some rule has a `cost`.
    pub(crate) metering: Option<super::cost::Metering>,
}

/// A named plan (`tiers:`): the limits of every per-key entry naming it.
#[derive(Debug, Clone)]
pub struct Tier {
    /// The limits, labelled `tier:<name>` in metrics (or by their `name`).
    pub rules: Vec<Rule>,
    /// Where the tier's name is written.
    pub pos: Pos,
}

/// One descriptor built from an HTTP request: an entry per action, in order
/// (envoy's route `rate_limits[].actions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestDescriptor {
    /// The actions, each giving one entry.
    pub actions: Vec<Action>,
    /// Where the descriptor is written.
    pub pos: Pos,
}

/// How one descriptor entry is taken from an HTTP request (a subset of
/// envoy's rate-limit actions, with envoy's names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `remote_address: {}`: the entry `("remote_address", <client IP>)`.
    RemoteAddress,
    /// `request_headers: {header_name, descriptor_key, skip_if_absent}`: the
    /// entry `(key, <header value>)`. `header` is lower case; the
    /// pseudo-headers `:method`, `:path` (without the query), `:authority`
    /// and `:scheme` name parts of the request line. When the header is
    /// missing, the whole descriptor is left out, or with `skip_if_absent`
    /// only this entry.
    RequestHeader {
        /// The header (lower case) or pseudo-header.
        header: String,
        /// The descriptor key.
        key: String,
        /// Leave out only this entry when the header is missing.
        skip_if_absent: bool,
    },
    /// `generic_key: {descriptor_value, descriptor_key}`: the constant entry
    /// `(key, value)`; `key` defaults to `generic_key`.
    GenericKey {
        /// The descriptor key.
        key: String,
        /// The value.
        value: String,
    },
    /// `body_field: {field, descriptor_key, skip_if_absent}` (floodgate):
    /// the entry `(key, <field of the request's JSON body>)` — a top-level
    /// string, number or boolean, e.g. an OpenAI request's `model`. Read by
    /// the proxy and the tower layer's metering layer (which read the body
    /// of such a domain's requests); when it is missing, as for a header.
    BodyField {
        /// The field at the top of the body.
        field: String,
        /// The descriptor key.
        key: String,
        /// Leave out only this entry when the field is missing.
        skip_if_absent: bool,
    },
}

/// The pseudo-headers a `request_headers` action may name.
pub const PSEUDO_HEADERS: [&str; 4] = [":method", ":path", ":authority", ":scheme"];

impl Domain {
    /// The domain's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Where `domain:` is written in its file.
    pub fn pos(&self) -> Pos {
        self.pos
    }

    /// Index of the domain's file in [`RuleSet::files`].
    pub fn file(&self) -> usize {
        self.file as usize
    }

    /// Every rule of the domain, in file order.
    pub fn rules(&self) -> impl Iterator<Item = &Rule> {
        self.nodes.iter().flat_map(|n| n.rules.iter())
    }

    /// What metering the proxy and the tower layer do for this domain's
    /// requests: `None` when no rule (or tier) has a `cost`.
    pub fn metering(&self) -> Option<super::cost::Metering> {
        self.metering
    }

    /// A tier by name.
    pub fn tier(&self, name: &str) -> Option<&Tier> {
        self.tiers.get(name)
    }

    /// The tiers, by name (in no order).
    pub fn tiers(&self) -> impl Iterator<Item = (&str, &Tier)> {
        self.tiers.iter().map(|(k, v)| (&**k, v))
    }

    /// How to build this domain's descriptors from an HTTP request (empty
    /// when the file has no `request_descriptors:`).
    pub fn request_descriptors(&self) -> &[RequestDescriptor] {
        &self.request_descriptors
    }
}

/// A validated set of domains, ready to match.
#[derive(Debug, Clone, Default)]
pub struct RuleSet {
    pub(crate) domains: HashMap<String, Domain>,
    pub(crate) files: Vec<PathBuf>,
    pub(crate) warnings: Vec<ConfigError>,
}

impl RuleSet {
    /// The domains, by name.
    pub fn domains(&self) -> impl Iterator<Item = &Domain> {
        self.domains.values()
    }

    /// One domain.
    pub fn domain(&self, name: &str) -> Option<&Domain> {
        self.domains.get(name)
    }

    /// The files the rules came from.
    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }

    /// `file:line:col` of position `pos` in `domain`'s file.
    pub fn at(&self, domain: &Domain, pos: Pos) -> String {
        let file = self.files.get(domain.file()).map(|p| p.display().to_string()).unwrap_or_default();
        format!("{file}:{}:{}", pos.line, pos.col)
    }

    /// Things that loaded but probably do not do what was meant (e.g. an
    /// envoy field at the wrong level, which envoy ignores too).
    pub fn warnings(&self) -> &[ConfigError] {
        &self.warnings
    }

    /// Total number of rules.
    pub fn rule_count(&self) -> usize {
        self.domains.values().map(|d| d.rules().count()).sum()
    }
}
