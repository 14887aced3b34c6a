//! What a file declares beside its descriptors: `tiers` and
//! `request_descriptors` (the actions that make descriptors from HTTP
//! requests).

use std::collections::HashMap;

use super::{
    ACTION_KEYS, BODY_FIELD_KEYS, FileParser, Flags, GENERIC_KEY_KEYS, REQUEST_DESCRIPTOR_KEYS, REQUEST_HEADERS_KEYS,
    check_tier_name, describe, is_header_token,
};
use crate::region::Scope;
use crate::rules::Pos;
use crate::rules::model::{Action, PSEUDO_HEADERS, RequestDescriptor, Tier};
use crate::rules::yaml::Node;

impl FileParser<'_> {
    /// `tiers:` (floodgate): plan name -> a `rate_limit` block or a list of
    /// them, the limits of every per-key entry that names the plan.
    pub(super) fn tiers(&mut self, map: &Node) -> HashMap<Box<str>, Tier> {
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
    pub(super) fn request_descriptors(&mut self, list: &Node) -> Vec<RequestDescriptor> {
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

    pub(super) fn actions(&mut self, list: &Node, field: &str) -> Option<Vec<Action>> {
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

    pub(super) fn action(&mut self, name: &str, v: &Node, field: &str) -> Option<Action> {
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
        let known = match name {
            "request_headers" => REQUEST_HEADERS_KEYS,
            "body_field" => BODY_FIELD_KEYS,
            _ => GENERIC_KEY_KEYS,
        };
        let (mut header, mut key, mut value, mut skip, mut body) = (None, None, None, false, None);
        for (k, v) in entries {
            let Some(f) = self.key(k, v, field, known) else { continue };
            let sub = format!("{field}.{f}");
            match f.as_str() {
                "header_name" => header = self.string(v, &sub).map(|s| (s, v.pos())),
                "descriptor_key" => key = self.string(v, &sub).map(|s| (s, v.pos())),
                "descriptor_value" => value = self.string(v, &sub).map(|s| (s, v.pos())),
                "field" => body = self.string(v, &sub).map(|s| (s, v.pos())),
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
        if name == "body_field" {
            let field_name = required(self, body, "field", "model")?;
            let key = required(self, key, "descriptor_key", "model")?;
            return Some(Action::BodyField { field: field_name, key, skip_if_absent: skip });
        }
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
        let valid =
            if header.starts_with(':') { PSEUDO_HEADERS.contains(&header.as_str()) } else { is_header_token(&header) };
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
}
