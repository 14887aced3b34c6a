//! YAML rules → [`Domain`], validated, every problem reported with its
//! position.
//!
//! Compatibility with envoyproxy/ratelimit: every file it accepts loads and
//! matches the same; every file it rejects is rejected. Its valid keys at a
//! level where it ignores them (e.g. `unit` on a descriptor) load with a
//! warning, since envoy loads them too; floodgate's own keys in the wrong
//! place, and unknown keys, are errors.

use std::collections::HashMap;
use std::path::Path;

use super::model::{DescNode, Domain, Rule};
use super::yaml::{self, Bounds, Node};
use super::{ConfigError, ConfigErrors, Pos};

mod cost;
mod limits;
mod requests;

/// Bounds on what a rules directory may hold. Inputs beyond them are errors,
/// never a crash or an unbounded allocation.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    /// Largest rules file, in bytes (default 4 MiB).
    pub max_file_bytes: u64,
    /// Deepest YAML nesting (default 64).
    pub max_depth: usize,
    /// Most YAML nodes per file, aliases expanded (default 1 000 000).
    pub max_nodes: usize,
    /// Most rules in the whole set (default 100 000).
    pub max_rules: usize,
    /// Most files in the directory (default 10 000).
    pub max_files: usize,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self { max_file_bytes: 4 << 20, max_depth: 64, max_nodes: 1_000_000, max_rules: 100_000, max_files: 10_000 }
    }
}

/// The keys envoy accepts at any level (it checks one flat set).
const ENVOY_KEYS: [&str; 16] = [
    "domain",
    "key",
    "value",
    "descriptors",
    "rate_limit",
    "unit",
    "requests_per_unit",
    "unlimited",
    "shadow_mode",
    "quota_mode",
    "name",
    "replaces",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];

const TOP_KEYS: &[&str] = &["domain", "descriptors", "request_descriptors", "tiers"];
const REQUEST_DESCRIPTOR_KEYS: &[&str] = &["actions"];
const ACTION_KEYS: &[&str] = &["remote_address", "request_headers", "generic_key", "body_field"];
const BODY_FIELD_KEYS: &[&str] = &["field", "descriptor_key", "skip_if_absent"];
const REQUEST_HEADERS_KEYS: &[&str] = &["header_name", "descriptor_key", "skip_if_absent"];
const GENERIC_KEY_KEYS: &[&str] = &["descriptor_value", "descriptor_key"];
const DESCRIPTOR_KEYS: &[&str] = &[
    "key",
    "value",
    "rate_limit",
    "rate_limits",
    "descriptors",
    "shadow_mode",
    "quota_mode",
    "detailed_metric",
    "value_to_metric",
    "share_threshold",
    "metadata",
];
const RATE_LIMIT_KEYS: &[&str] = &[
    "requests_per_unit",
    "unit",
    "unlimited",
    "name",
    "replaces",
    "algorithm",
    "window",
    "burst",
    "granularity",
    "mode",
    "failure_mode",
    "local_share",
    "scope",
    "sync",
    "overshoot",
    "charge",
    "reservation_ttl",
    "cost",
    "concurrency",
    "lease_ttl",
];
const REPLACES_KEYS: &[&str] = &["name"];

pub(crate) struct FileParser<'a> {
    file: u32,
    path: &'a Path,
    opts: &'a LoadOptions,
    pub(crate) errors: Vec<ConfigError>,
    pub(crate) warnings: Vec<ConfigError>,
    /// Rules counted so far across the set (bounded by `max_rules`).
    pub(crate) rules: usize,
    /// The file's domain and where it is named, even when the file has
    /// other errors (so duplicate domains are still reported).
    pub(crate) domain: Option<(String, Pos)>,
}

/// The fields of one `rate_limit` block as written (with the position of
/// each, for messages), before they are checked together.
#[derive(Default)]
struct RateLimitFields {
    rpu: u64,
    rpu_pos: Option<Pos>,
    /// `concurrency: N` (a limit on requests in flight) and `lease_ttl`.
    concurrency: Option<(u64, Pos)>,
    lease_ttl: Option<(String, Pos)>,
    unit: Option<(String, Pos)>,
    unlimited: bool,
    name: Option<String>,
    replaces: Vec<String>,
    algorithm: Option<(String, Pos)>,
    window: Option<(String, Pos)>,
    burst: Option<(u64, Pos)>,
    granularity: Option<(u32, Pos)>,
    mode: Option<(String, Pos)>,
    failure_mode: Option<(String, Pos)>,
    local_share: Option<(u32, Pos)>,
    scope: Option<(String, Pos)>,
    sync: Option<(String, Pos)>,
    overshoot: Option<(String, Pos)>,
    charge: Option<(String, Pos)>,
    reservation_ttl: Option<(String, Pos)>,
    cost: Option<(std::sync::Arc<crate::rules::cost::Cost>, Pos)>,
}

/// The descriptor-level flags a rule inherits from its descriptor.
#[derive(Default, Clone, Copy)]
struct Flags {
    shadow_mode: bool,
    quota_mode: bool,
    detailed_metric: bool,
}

impl<'a> FileParser<'a> {
    pub(crate) fn new(file: u32, path: &'a Path, opts: &'a LoadOptions, rules: usize) -> Self {
        Self { file, path, opts, errors: Vec::new(), warnings: Vec::new(), rules, domain: None }
    }

    fn entry(&self, pos: Pos, field: &str, message: impl Into<String>) -> ConfigError {
        ConfigError { file: self.path.to_owned(), pos, field: field.to_owned(), message: message.into() }
    }

    fn error(&mut self, pos: Pos, field: &str, message: impl Into<String>) {
        let e = self.entry(pos, field, message);
        self.errors.push(e);
    }

    fn warn(&mut self, pos: Pos, field: &str, message: impl Into<String>) {
        let w = self.entry(pos, field, message);
        self.warnings.push(w);
    }

    /// Parse one file's text into a domain (`None` when it has errors).
    pub(crate) fn parse(&mut self, text: &str) -> Option<Domain> {
        let bounds = Bounds { max_depth: self.opts.max_depth, max_nodes: self.opts.max_nodes };
        let root = match yaml::parse(text, bounds) {
            Ok(Some(root)) => root,
            Ok(None) => {
                self.error(Pos::default(), "", "empty file: a rules file needs `domain:` and `descriptors:`");
                return None;
            }
            Err(e) => {
                self.error(e.pos, "", e.message);
                return None;
            }
        };
        let before = self.errors.len();
        let entries = self.map(&root, "")?;
        let mut domain_name = None;
        let mut descriptors = None;
        let mut request_descriptors = Vec::new();
        let mut tiers = None;
        for (k, v) in entries {
            match self.key(k, v, "", TOP_KEYS).as_deref() {
                Some("domain") => domain_name = self.string(v, "domain").map(|s| (s, v.pos())),
                Some("descriptors") => descriptors = Some(v),
                Some("request_descriptors") => request_descriptors = self.request_descriptors(v),
                Some("tiers") => tiers = Some(v),
                _ => {}
            }
        }
        self.domain = domain_name.clone().filter(|(n, _)| !n.is_empty());
        let (name, pos) = match domain_name {
            Some((name, pos)) if !name.is_empty() => (name, pos),
            Some((_, pos)) => {
                self.error(pos, "domain", "empty domain: write the domain name, e.g. domain: api");
                return None;
            }
            None => {
                self.error(root.pos(), "domain", "missing domain: add a line `domain: <name>` at the top");
                return None;
            }
        };
        let mut domain = Domain {
            name: name.clone(),
            file: self.file,
            pos,
            nodes: vec![DescNode::default()],
            request_descriptors,
            tiers: HashMap::new(),
            metering: None,
        };
        if let Some(list) = descriptors {
            self.descriptors(&mut domain, 0, list, "descriptors", &name);
        }
        if let Some(map) = tiers {
            domain.tiers = self.tiers(map);
        }
        domain.metering = crate::rules::cost::Metering::of(
            domain.rules().chain(domain.tiers.values().flat_map(|t| t.rules.iter())).filter_map(|r| r.cost.as_deref()),
        );
        // A descriptor read from the body: such requests have their body read.
        let reads_body = domain
            .request_descriptors
            .iter()
            .any(|d| d.actions.iter().any(|a| matches!(a, crate::rules::Action::BodyField { .. })));
        if reads_body {
            domain.metering = Some(crate::rules::cost::Metering { body: true, ..domain.metering.unwrap_or_default() });
        }
        // A concurrency limit: its slots are held until responses end.
        let leases = domain
            .rules()
            .chain(domain.tiers.values().flat_map(|t| t.rules.iter()))
            .any(|r| r.limit.as_ref().is_some_and(crate::Limit::is_concurrency));
        if leases {
            domain.metering =
                Some(crate::rules::cost::Metering { leases: true, ..domain.metering.unwrap_or_default() });
        }
        (self.errors.len() == before).then_some(domain)
    }

    /// Check a mapping key against the keys known at this level; returns the
    /// key when it is one of them.
    fn key(&mut self, k: &Node, v: &Node, at: &str, known: &[&str]) -> Option<String> {
        let field = |name: &str| if at.is_empty() { name.to_owned() } else { format!("{at}.{name}") };
        let name = match k {
            Node::Scalar { value, plain, .. }
                if !(*plain && (is_number(value) || k.is_null() || yaml_bool(value).is_some())) =>
            {
                value.clone()
            }
            _ => {
                self.error(k.pos(), at, format!("key {} is not a string: write a field name", describe(k)));
                return None;
            }
        };
        if known.contains(&name.as_str()) {
            return Some(name);
        }
        if ENVOY_KEYS.contains(&name.as_str()) {
            self.check_leaves(v, &field(&name));
            self.warn(
                k.pos(),
                &field(&name),
                format!("`{name}` is ignored here (envoy ignores it too): it belongs {}", where_key_belongs(&name)),
            );
            return None;
        }
        let hint = if known.contains(&"rate_limit") && RATE_LIMIT_KEYS.contains(&name.as_str()) {
            format!("; `{name}` belongs inside rate_limit")
        } else {
            closest(&name, known).map(|c| format!("; did you mean `{c}`?")).unwrap_or_default()
        };
        self.error(
            k.pos(),
            &field(&name),
            format!("unknown field `{name}`: expected one of {}{hint}", known.join(", ")),
        );
        None
    }

    fn map<'n>(&mut self, node: &'n Node, field: &str) -> Option<&'n [(Node, Node)]> {
        match node {
            Node::Map { entries, .. } => Some(entries),
            other => {
                self.error(
                    other.pos(),
                    field,
                    format!("expected a mapping (`field: value` lines), found {}", other.kind()),
                );
                None
            }
        }
    }

    /// A scalar as text (null is the empty string, as in envoy); floats are
    /// rejected, as envoy does.
    fn string(&mut self, node: &Node, field: &str) -> Option<String> {
        match node {
            Node::Scalar { value, plain, pos } => {
                if *plain && is_float(value) {
                    self.error(
                        *pos,
                        field,
                        format!("`{value}` reads as a number with a fraction: quote it, e.g. \"{value}\""),
                    );
                    return None;
                }
                Some(if node.is_null() { String::new() } else { value.clone() })
            }
            other => {
                self.error(other.pos(), field, format!("expected text, found {}", other.kind()));
                None
            }
        }
    }

    fn boolean(&mut self, node: &Node, field: &str) -> Option<bool> {
        match node {
            Node::Scalar { plain: true, .. } if node.is_null() => Some(false),
            Node::Scalar { value, plain: true, .. } => yaml_bool(value).or_else(|| {
                self.error(node.pos(), field, format!("expected true or false, found `{value}`"));
                None
            }),
            other => {
                self.error(other.pos(), field, format!("expected true or false, found {}", describe(other)));
                None
            }
        }
    }

    /// A whole number in `0..=max`.
    fn integer(&mut self, node: &Node, field: &str, max: u64) -> Option<u64> {
        let (value, plain) = match node {
            Node::Scalar { value, plain, .. } => (value.as_str(), *plain),
            other => {
                self.error(other.pos(), field, format!("expected a whole number, found {}", other.kind()));
                return None;
            }
        };
        let digits = value.strip_prefix('+').unwrap_or(value);
        if !plain {
            self.error(
                node.pos(),
                field,
                format!("expected a whole number, found the text \"{value}\": remove the quotes"),
            );
            return None;
        }
        if value.starts_with('-') && value[1..].bytes().all(|b| b.is_ascii_digit()) && value.len() > 1 {
            self.error(node.pos(), field, format!("{value} is negative: write a whole number from 0 to {max}"));
            return None;
        }
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            self.error(node.pos(), field, format!("expected a whole number from 0 to {max}, found `{value}`"));
            return None;
        }
        if digits.len() > 1 && digits.starts_with('0') {
            // YAML 1.1 (envoyproxy/ratelimit's yaml.v2) reads a leading 0 as
            // octal: the same file would mean another number there.
            let trimmed = digits.trim_start_matches('0');
            let trimmed = if trimmed.is_empty() { "0" } else { trimmed };
            let message = match u64::from_str_radix(digits, 8) {
                Ok(octal) => format!(
                    "`{value}` has a leading zero, which envoyproxy/ratelimit reads as octal ({octal}): write {trimmed}, or {octal} if you meant octal"
                ),
                Err(_) => format!(
                    "`{value}` has a leading zero, which envoyproxy/ratelimit refuses (not an octal number): write {trimmed}"
                ),
            };
            self.error(node.pos(), field, message);
            return None;
        }
        match digits.parse::<u64>() {
            Ok(n) if n <= max => Some(n),
            _ => {
                self.error(node.pos(), field, format!("{value} is too large: the largest is {max}"));
                None
            }
        }
    }

    /// Reject what envoy rejects in leaves it does not read (floats,
    /// non-mapping list items), so a file valid here is valid there.
    fn check_leaves(&mut self, node: &Node, field: &str) {
        match node {
            Node::Scalar { value, plain: true, pos } if is_float(value) => {
                self.error(*pos, field, format!("`{value}` reads as a number with a fraction: quote it"));
            }
            Node::Seq { items, .. } => {
                for (i, item) in items.iter().enumerate() {
                    if !matches!(item, Node::Map { .. }) {
                        self.error(item.pos(), &format!("{field}[{i}]"), "list items must be mappings");
                    } else {
                        self.check_leaves(item, &format!("{field}[{i}]"));
                    }
                }
            }
            Node::Map { entries, .. } => {
                for (_, v) in entries {
                    self.check_leaves(v, field);
                }
            }
            Node::Scalar { .. } => {}
        }
    }

    fn descriptors(&mut self, domain: &mut Domain, parent: u32, list: &Node, field: &str, stats: &str) {
        if list.is_null() {
            return;
        }
        let Node::Seq { items, .. } = list else {
            self.error(
                list.pos(),
                field,
                format!("expected a list of descriptors (`- key: ...`), found {}", list.kind()),
            );
            return;
        };
        for (i, item) in items.iter().enumerate() {
            self.descriptor(domain, parent, item, &format!("{field}[{i}]"), stats);
        }
    }

    fn descriptor(&mut self, domain: &mut Domain, parent: u32, node: &Node, field: &str, stats: &str) {
        let Some(entries) = self.map(node, field) else { return };
        let (mut key, mut value) = (None, String::new());
        let (mut rate_limit, mut rate_limits, mut children) = (None, None, None);
        let mut flags = Flags::default();
        let mut share = None;
        for (k, v) in entries {
            let Some(name) = self.key(k, v, field, DESCRIPTOR_KEYS) else { continue };
            let f = format!("{field}.{name}");
            match name.as_str() {
                "key" => key = self.string(v, &f).map(|s| (s, v.pos())),
                "value" => value = self.string(v, &f).unwrap_or_default(),
                "rate_limit" => rate_limit = Some((k.pos(), v)),
                "rate_limits" => rate_limits = Some((k.pos(), v)),
                "descriptors" => children = Some(v),
                "shadow_mode" => flags.shadow_mode = self.boolean(v, &f).unwrap_or(false),
                "quota_mode" => flags.quota_mode = self.boolean(v, &f).unwrap_or(false),
                "detailed_metric" => flags.detailed_metric = self.boolean(v, &f).unwrap_or(false),
                "value_to_metric" => {
                    // Metric naming only; validated here, used by the service.
                    self.boolean(v, &f);
                }
                "share_threshold" => share = self.boolean(v, &f).map(|b| (b, k.pos())),
                _ => {} // metadata: free-form, returned as is, never validated
            }
        }
        let key = match key {
            Some((k, _)) if !k.is_empty() => k,
            Some((_, pos)) => {
                self.error(pos, &format!("{field}.key"), "empty key: write the descriptor key, e.g. key: user");
                return;
            }
            None => {
                self.error(node.pos(), &format!("{field}.key"), "missing key: every descriptor needs `key:`");
                return;
            }
        };
        let composite = if value.is_empty() { key.clone() } else { format!("{key}_{value}") };
        if let Some(&other) = domain.nodes[parent as usize].children.get(composite.as_str()) {
            let first = domain.nodes[other as usize].pos;
            self.error(
                node.pos(),
                field,
                format!(
                    "duplicate descriptor `{composite}` (first at line {}): merge them, or give them different values",
                    first.line
                ),
            );
            return;
        }
        let stats_key = format!("{stats}.{composite}");
        let idx = u32::try_from(domain.nodes.len()).unwrap_or(u32::MAX);
        domain.nodes.push(DescNode { pos: node.pos(), ..DescNode::default() });
        if let Some((true, pos)) = share {
            if composite.contains('*') {
                let pattern = if value.is_empty() { composite.clone() } else { value.clone() };
                domain.nodes[idx as usize].share_pattern = Some(pattern.into());
            } else {
                self.error(
                    pos,
                    &format!("{field}.share_threshold"),
                    format!("share_threshold needs a wildcard value (containing `*`), but `{composite}` has none"),
                );
            }
        }
        let mut rules = Vec::new();
        match (rate_limit, rate_limits) {
            (Some((pos, _)), Some(_)) => self.error(
                pos,
                &format!("{field}.rate_limit"),
                "both rate_limit and rate_limits: move the single limit into the rate_limits list",
            ),
            (Some((_, v)), None) if !v.is_null() => {
                if let Some(r) = self.rule(v, &format!("{field}.rate_limit"), &stats_key, flags) {
                    rules.push(r);
                }
            }
            (None, Some((_, list))) => match list {
                Node::Seq { items, .. } => {
                    for (i, item) in items.iter().enumerate() {
                        if let Some(r) = self.rule(item, &format!("{field}.rate_limits[{i}]"), &stats_key, flags) {
                            rules.push(r);
                        }
                    }
                }
                other if other.is_null() => {}
                other => self.error(
                    other.pos(),
                    &format!("{field}.rate_limits"),
                    format!(
                        "expected a list of rate_limit blocks (`- requests_per_unit: ...`), found {}",
                        other.kind()
                    ),
                ),
            },
            _ => {}
        }
        self.rules += rules.len();
        if self.rules > self.opts.max_rules {
            self.error(node.pos(), field, format!("more than {} rules in the rule set", self.opts.max_rules));
            return;
        }
        domain.nodes[idx as usize].rules = rules;
        if let Some(list) = children {
            self.descriptors(domain, idx, list, &format!("{field}.descriptors"), &stats_key);
        }
        let parent = &mut domain.nodes[parent as usize];
        if composite.contains('*') {
            let parts: Box<[Box<str>]> = composite.split('*').map(Box::from).collect();
            parent.wildcards.push((parts, idx));
        }
        parent.children.insert(composite.into(), idx);
    }
}

/// Parse limits given on their own — one `rate_limit` block or a list of
/// them, as YAML or JSON (JSON is YAML) — with exactly the validation of a
/// rules file: the form runtime overrides take. `label` names the source in
/// messages; `stats_key` is recorded on each rule.
///
/// ```
/// use floodgate_core::rules::parse_limits;
/// let rules = parse_limits("override", r#"{"unit": "second", "requests_per_unit": 5}"#, "api.user_alice").unwrap();
/// assert_eq!(rules[0].limit.as_ref().unwrap().limit(), 5);
/// assert!(parse_limits("override", r#"{"unit": "fortnight"}"#, "x").is_err());
/// ```
pub fn parse_limits(label: &str, text: &str, stats_key: &str) -> Result<Vec<Rule>, ConfigErrors> {
    let opts = LoadOptions::default();
    let path = Path::new(label);
    let mut p = FileParser::new(u32::MAX, path, &opts, 0);
    let bounds = Bounds { max_depth: 8, max_nodes: 10_000 };
    let mut rules = Vec::new();
    match yaml::parse(text, bounds) {
        Err(e) => p.error(e.pos, "", e.message),
        Ok(None) => p.error(
            Pos::default(),
            "",
            "no limits: give a rate_limit block, e.g. {\"unit\": \"second\", \"requests_per_unit\": 5}",
        ),
        Ok(Some(Node::Seq { items, .. })) => {
            if items.is_empty() {
                p.error(Pos::default(), "", "an empty list of limits: give at least one");
            }
            for (i, item) in items.iter().enumerate() {
                rules.extend(p.rule(item, &format!("rate_limits[{i}]"), stats_key, Flags::default()));
            }
        }
        Ok(Some(node)) => rules.extend(p.rule(&node, "rate_limit", stats_key, Flags::default())),
    }
    if p.errors.is_empty() { Ok(rules) } else { Err(ConfigErrors(p.errors)) }
}

/// Whether `name` can name a tier: 1 to 64 bytes of ASCII letters, digits,
/// `_`, `-` and `.` (it appears in metrics labels and CSV files).
pub fn check_tier_name(name: &str) -> Result<(), BadTierName> {
    if name.is_empty() || name.len() > 64 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.".contains(&b)) {
        return Err(BadTierName(name.to_owned()));
    }
    Ok(())
}

/// A name [`check_tier_name`] refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tier name `{}` must be 1 to 64 letters, digits, `_`, `-` or `.`, e.g. pro", .0.escape_debug())]
pub struct BadTierName(pub String);

fn where_key_belongs(name: &str) -> &'static str {
    match name {
        "domain" => "at the top of the file",
        "unit" | "requests_per_unit" | "unlimited" | "name" | "replaces" => "inside rate_limit",
        _ => "on a descriptor (next to key:)",
    }
}

/// An HTTP header name: a non-empty token (RFC 9110 5.6.2).
fn is_header_token(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

fn describe(node: &Node) -> String {
    match node {
        Node::Scalar { value, .. } if !node.is_null() => format!("`{value}`"),
        other => other.kind().to_owned(),
    }
}

/// A YAML 1.1 plain scalar that resolves to an integer or a float.
fn is_number(s: &str) -> bool {
    let t = s.strip_prefix(['-', '+']).unwrap_or(s);
    (!t.is_empty() && t.bytes().all(|b| b.is_ascii_digit())) || is_float(s)
}

/// A YAML 1.1 boolean (what envoy's yaml.v2 reads as one).
fn yaml_bool(s: &str) -> Option<bool> {
    match s {
        "y" | "Y" | "yes" | "Yes" | "YES" | "on" | "On" | "ON" | "true" | "True" | "TRUE" => Some(true),
        "n" | "N" | "no" | "No" | "NO" | "off" | "Off" | "OFF" | "false" | "False" | "FALSE" => Some(false),
        _ => None,
    }
}

/// YAML 1.1's float forms: `1.5`, `-.5`, `1e3` with a dot, `.inf`, `.nan`.
fn is_float(s: &str) -> bool {
    let t = s.strip_prefix(['-', '+']).unwrap_or(s);
    if matches!(t, ".inf" | ".Inf" | ".INF") || matches!(s, ".nan" | ".NaN" | ".NAN") {
        return true;
    }
    let (mantissa, exp) = match t.find(['e', 'E']) {
        Some(i) => (&t[..i], Some(&t[i + 1..])),
        None => (t, None),
    };
    let Some((int, frac)) = mantissa.split_once('.') else { return false };
    let digits = |x: &str| x.bytes().all(|b| b.is_ascii_digit() || b == b'_');
    let exp_ok = exp.is_none_or(|e| {
        let e = e.strip_prefix(['-', '+']).unwrap_or(e);
        !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit())
    });
    !(int.is_empty() && frac.is_empty()) && digits(int) && digits(frac) && exp_ok
}

/// The known key nearest to `name` (edit distance at most 3).
fn closest<'k>(name: &str, known: &[&'k str]) -> Option<&'k str> {
    known.iter().map(|k| (edit_distance(name, k), *k)).filter(|(d, _)| *d <= 3).min_by_key(|(d, _)| *d).map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let cur = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb)).min(row[j] + 1).min(cur + 1);
            prev = cur;
        }
    }
    row[b.len()]
}
