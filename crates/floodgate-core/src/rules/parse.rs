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

use super::model::{
    Action, DescNode, Domain, FailureMode, PSEUDO_HEADERS, RequestDescriptor, Rule, Source, Tier, Unit,
};
use super::yaml::{self, Bounds, Node};
use super::{ConfigError, ConfigErrors, Pos};
use crate::region::{Scope, SyncMode, parse_overshoot};
use crate::{Algorithm, AlgorithmKind, LeakyMode, Limit, LimitError, parse_duration};

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
const ACTION_KEYS: &[&str] = &["remote_address", "request_headers", "generic_key"];
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
        };
        if let Some(list) = descriptors {
            self.descriptors(&mut domain, 0, list, "descriptors", &name);
        }
        if let Some(map) = tiers {
            domain.tiers = self.tiers(map);
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

    /// `tiers:` (floodgate): plan name -> a `rate_limit` block or a list of
    /// them, the limits of every per-key entry that names the plan.
    fn tiers(&mut self, map: &Node) -> HashMap<Box<str>, Tier> {
        let mut out = HashMap::new();
        let Some(entries) = self.map(map, "tiers") else { return out };
        for (k, v) in entries {
            let Some(name) = self.string(k, "tiers") else { continue };
            let field = format!("tiers.{name}");
            if let Err(m) = check_tier_name(&name) {
                self.error(k.pos(), &field, m.to_string());
                continue;
            }
            let stats_key = format!("tier:{name}");
            let mut rules = Vec::new();
            match v {
                Node::Seq { items, .. } if !items.is_empty() => {
                    for (i, item) in items.iter().enumerate() {
                        rules.extend(self.rule(item, &format!("{field}[{i}]"), &stats_key, Flags::default()));
                    }
                }
                Node::Map { .. } => rules.extend(self.rule(v, &field, &stats_key, Flags::default())),
                other => {
                    self.error(
                        other.pos(),
                        &field,
                        format!(
                            "expected a rate_limit block (`{{unit: second, requests_per_unit: 10}}`) or a list of them, found {}",
                            other.kind()
                        ),
                    );
                    continue;
                }
            }
            if let Some(r) = rules.iter().find(|r| r.scope != Scope::Region) {
                self.error(
                    r.source.pos,
                    &field,
                    "a tier's limits are per region: remove `scope` (global per-key limits are not supported yet)",
                );
            }
            self.rules += rules.len();
            if self.rules > self.opts.max_rules {
                self.error(k.pos(), &field, format!("more than {} rules in the rule set", self.opts.max_rules));
                return out;
            }
            if out.insert(Box::from(name.as_str()), Tier { rules, pos: k.pos() }).is_some() {
                self.error(k.pos(), &field, format!("tier `{name}` is defined twice: keep one"));
            }
        }
        out
    }

    /// `request_descriptors:` (floodgate): a list of `- actions: [...]`.
    fn request_descriptors(&mut self, list: &Node) -> Vec<RequestDescriptor> {
        const FIELD: &str = "request_descriptors";
        let Node::Seq { items, .. } = list else {
            self.error(list.pos(), FIELD, format!("expected a list of `- actions: [...]`, found {}", list.kind()));
            return Vec::new();
        };
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let field = format!("{FIELD}[{i}]");
            let Some(entries) = self.map(item, &field) else { continue };
            let mut actions = None;
            for (k, v) in entries {
                if self.key(k, v, &field, REQUEST_DESCRIPTOR_KEYS).is_some() {
                    actions = self.actions(v, &format!("{field}.actions"));
                }
            }
            match actions {
                Some(actions) => out.push(RequestDescriptor { actions, pos: item.pos() }),
                None if !self.errors.iter().any(|e| e.field.starts_with(&field)) => {
                    self.error(item.pos(), &field, "missing actions: write e.g. `- actions: [{remote_address: {}}]`");
                }
                None => {}
            }
        }
        out
    }

    fn actions(&mut self, list: &Node, field: &str) -> Option<Vec<Action>> {
        let items = match list {
            Node::Seq { items, .. } if !items.is_empty() => items,
            other => {
                self.error(
                    other.pos(),
                    field,
                    format!("expected a non-empty list of actions (`- remote_address: {{}}`), found {}", other.kind()),
                );
                return None;
            }
        };
        let before = self.errors.len();
        let mut out = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let field = format!("{field}[{i}]");
            let Some(entries) = self.map(item, &field) else { continue };
            if entries.len() != 1 {
                self.error(
                    item.pos(),
                    &field,
                    format!("an action names exactly one of {}, found {} keys", ACTION_KEYS.join(", "), entries.len()),
                );
                continue;
            }
            let (k, v) = &entries[0];
            let Some(name) = self.key(k, v, &field, ACTION_KEYS) else { continue };
            let field = format!("{field}.{name}");
            if let Some(action) = self.action(&name, v, &field) {
                out.push(action);
            }
        }
        (self.errors.len() == before).then_some(out)
    }

    fn action(&mut self, name: &str, v: &Node, field: &str) -> Option<Action> {
        if name == "remote_address" {
            return match v {
                Node::Map { entries, .. } if entries.is_empty() => Some(Action::RemoteAddress),
                _ if v.is_null() => Some(Action::RemoteAddress),
                other => {
                    self.error(
                        other.pos(),
                        field,
                        format!("takes no fields: write `remote_address: {{}}`, found {}", describe(other)),
                    );
                    None
                }
            };
        }
        let entries = if v.is_null() { &[][..] } else { self.map(v, field)? };
        let known = if name == "request_headers" { REQUEST_HEADERS_KEYS } else { GENERIC_KEY_KEYS };
        let (mut header, mut key, mut value, mut skip) = (None, None, None, false);
        for (k, v) in entries {
            let Some(f) = self.key(k, v, field, known) else { continue };
            let sub = format!("{field}.{f}");
            match f.as_str() {
                "header_name" => header = self.string(v, &sub).map(|s| (s, v.pos())),
                "descriptor_key" => key = self.string(v, &sub).map(|s| (s, v.pos())),
                "descriptor_value" => value = self.string(v, &sub).map(|s| (s, v.pos())),
                _ => skip = self.boolean(v, &sub).unwrap_or(false),
            }
        }
        let required = |this: &mut Self, got: Option<(String, Pos)>, f: &str, example: &str| match got {
            Some((s, _)) if !s.is_empty() => Some(s),
            Some((_, pos)) => {
                this.error(pos, &format!("{field}.{f}"), format!("must not be empty: write e.g. {f}: {example}"));
                None
            }
            None => {
                this.error(v.pos(), field, format!("missing {f}: add e.g. {f}: {example}"));
                None
            }
        };
        if name == "generic_key" {
            let value = required(self, value, "descriptor_value", "all")?;
            let key = match key {
                None => "generic_key".to_owned(),
                some => required(self, some, "descriptor_key", "class")?,
            };
            return Some(Action::GenericKey { key, value });
        }
        let header_pos = header.as_ref().map(|h| h.1).unwrap_or(v.pos());
        let header = required(self, header, "header_name", "x-api-key")?.to_ascii_lowercase();
        let key = required(self, key, "descriptor_key", "api_key")?;
        let valid = if header.starts_with(':') {
            PSEUDO_HEADERS.contains(&header.as_str())
        } else {
            header.bytes().all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
        };
        if !valid {
            self.error(
                header_pos,
                &format!("{field}.header_name"),
                format!(
                    "`{header}` is not an HTTP header name: write a token such as x-api-key, or one of {}",
                    PSEUDO_HEADERS.join(", ")
                ),
            );
            return None;
        }
        Some(Action::RequestHeader { header, key, skip_if_absent: skip })
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

    fn rule(&mut self, node: &Node, field: &str, stats_key: &str, flags: Flags) -> Option<Rule> {
        let entries = self.map(node, field)?;
        let before = self.errors.len();
        let mut f = RateLimitFields::default();
        for (k, v) in entries {
            let Some(key) = self.key(k, v, field, RATE_LIMIT_KEYS) else { continue };
            let at = format!("{field}.{key}");
            let pos = v.pos();
            match key.as_str() {
                "requests_per_unit" => f.rpu = self.integer(v, &at, u64::from(u32::MAX)).unwrap_or(0),
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
        let (limit, local_limit) = if f.unlimited {
            self.check_unlimited(&f, field);
            (None, None)
        } else {
            let limit = self.limited(&f, node, field)?;
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
        })
    }

    /// An unlimited rule takes no unit (a valid one is an error, an invalid
    /// one is ignored with a warning, as envoy does) and none of floodgate's
    /// limit parameters.
    fn check_unlimited(&mut self, f: &RateLimitFields, field: &str) {
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
    fn limited(&mut self, f: &RateLimitFields, node: &Node, field: &str) -> Option<Limit> {
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
        let (Some(window), Some(kind)) = (window, kind) else { return None };
        let algorithm =
            Algorithm::from_parts(kind, f.burst.map(|b| b.0), f.granularity.map(|g| g.0), mode.map(|m| m.0));
        match algorithm.and_then(|a| Limit::new(a, f.rpu, window)) {
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
    fn scope(&mut self, f: &RateLimitFields, field: &str) -> Scope {
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
    fn local_limit(
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
                Limit::new(algorithm, u64::try_from(local).unwrap_or(u64::MAX), limit.window()).ok()
            }
            (_, Some((_, pos))) => {
                self.warn(pos, &format!("{field}.local_share"), "local_share only applies with failure_mode: local");
                None
            }
            _ => None,
        }
    }

    fn replaces(&mut self, node: &Node, field: &str) -> Vec<String> {
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
    fn share(&mut self, node: &Node, field: &str) -> Option<u32> {
        let text = match node {
            Node::Scalar { value, plain: true, .. } => value.as_str(),
            other => {
                self.error(other.pos(), field, format!("expected a number in (0, 1], found {}", describe(other)));
                return None;
            }
        };
        let ppm = parse_ppm(text);
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
fn parse_ppm(text: &str) -> Option<u32> {
    let (int, frac) = text.split_once('.').unwrap_or((text, ""));
    if int.is_empty() && frac.is_empty() || frac.len() > 6 {
        return None;
    }
    if !int.bytes().all(|b| b.is_ascii_digit()) || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let int: u32 = if int.is_empty() { 0 } else { int.parse().ok()? };
    let frac: u32 = format!("{frac:0<6}").parse().ok()?;
    int.checked_mul(1_000_000)?.checked_add(frac)
}

fn where_key_belongs(name: &str) -> &'static str {
    match name {
        "domain" => "at the top of the file",
        "unit" | "requests_per_unit" | "unlimited" | "name" | "replaces" => "inside rate_limit",
        _ => "on a descriptor (next to key:)",
    }
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
