//! A rule's `cost:` block (see [`crate::rules::cost`]): every field checked,
//! with what to write instead.

use std::sync::Arc;

use super::limits::parse_ppm;
use super::{FileParser, RateLimitFields, describe, is_header_token};
use crate::region::Scope;
use crate::rules::cost::{Actual, Cost, Estimate, EstimateFrom, MAX_WEIGHT, ONE, Weight, Weights};
use crate::rules::yaml::Node;
use crate::{Algorithm, Charge, LeakyMode, Limit, MAX_LIMIT};

const COST_KEYS: &[&str] = &["estimate", "actual", "include_usage"];
const ESTIMATE_KEYS: &[&str] = &["header", "body", "default", "times", "plus"];
const ACTUAL_KEYS: &[&str] = &["header", "usage"];

impl FileParser<'_> {
    /// `cost: {estimate, actual, include_usage}`.
    pub(super) fn cost(&mut self, node: &Node, field: &str) -> Option<Cost> {
        let entries = self.map(node, field)?;
        let before = self.errors.len();
        let (mut estimate, mut actual, mut include_usage) = (None, None, None);
        for (k, v) in entries {
            let Some(key) = self.key(k, v, field, COST_KEYS) else { continue };
            let at = format!("{field}.{key}");
            match key.as_str() {
                "estimate" => estimate = self.estimate(v, &at),
                "actual" => actual = self.actual(v, &at),
                _ => include_usage = self.boolean(v, &at).map(|b| (b, v.pos())),
            }
        }
        if self.errors.len() == before && estimate.is_none() {
            self.error(
                node.pos(),
                &format!("{field}.estimate"),
                "missing estimate (what a request reserves): write e.g. estimate: {body: max_tokens, default: 4096}, \
                 estimate: {header: x-estimated-cost, default: 100}, or estimate: 1000",
            );
        }
        if self.errors.len() == before && actual.is_none() {
            self.error(
                node.pos(),
                &format!("{field}.actual"),
                "missing actual (what the response says it cost): write e.g. actual: {usage: total_tokens}, \
                 actual: {usage: {prompt_tokens: 0.15, completion_tokens: 0.6}}, or actual: {header: x-cost}",
            );
        }
        let (estimate, actual) = (estimate?, actual?);
        if let (Some((_, pos)), Actual::Header(_)) = (include_usage, &actual) {
            self.warn(pos, &format!("{field}.include_usage"), "include_usage only applies when actual reads usage");
        }
        let include_usage = actual.reads_usage() && include_usage.is_none_or(|(b, _)| b);
        (self.errors.len() == before).then_some(Cost { estimate, actual, include_usage })
    }

    /// A whole number (a constant estimate), or `{header | body, default,
    /// times, plus}`.
    fn estimate(&mut self, node: &Node, field: &str) -> Option<Estimate> {
        let entries = match node {
            Node::Map { entries, .. } => entries,
            _ => {
                let default = self.integer(node, field, MAX_LIMIT)?;
                return Some(Estimate { from: EstimateFrom::Constant, default, times: ONE, plus: 0 });
            }
        };
        let before = self.errors.len();
        let (mut from, mut default, mut times, mut plus) = (None, None, ONE, 0);
        for (k, v) in entries {
            let Some(key) = self.key(k, v, field, ESTIMATE_KEYS) else { continue };
            let at = format!("{field}.{key}");
            let read = match key.as_str() {
                "header" => self.header_name(v, &at).map(EstimateFrom::Header),
                "body" => self.body_fields(v, &at).map(EstimateFrom::Body),
                "default" => {
                    default = self.integer(v, &at, MAX_LIMIT);
                    continue;
                }
                "times" => {
                    times = self.weight(v, &at).unwrap_or(ONE);
                    continue;
                }
                _ => {
                    plus = self.integer(v, &at, MAX_LIMIT).unwrap_or(0);
                    continue;
                }
            };
            if from.is_some() {
                self.error(k.pos(), &at, "an estimate reads one place: keep header or body");
            }
            from = read.or(from);
        }
        let Some(from) = from else {
            if self.errors.len() == before {
                self.error(
                    node.pos(),
                    field,
                    "say where the estimate is read: header: <name> or body: <field> (with default: N), or write a \
                     whole number for a constant estimate",
                );
            }
            return None;
        };
        let Some(default) = default else {
            if self.errors.len() == before {
                self.error(
                    node.pos(),
                    &format!("{field}.default"),
                    "missing default: the estimate when the request does not carry one, e.g. default: 4096",
                );
            }
            return None;
        };
        (self.errors.len() == before).then_some(Estimate { from, default, times, plus })
    }

    /// `{header: name}` or `{usage: field}` / `{usage: {field: weight, …}}`.
    fn actual(&mut self, node: &Node, field: &str) -> Option<Actual> {
        let entries = self.map(node, field)?;
        let before = self.errors.len();
        let mut actual = None;
        for (k, v) in entries {
            let Some(key) = self.key(k, v, field, ACTUAL_KEYS) else { continue };
            let at = format!("{field}.{key}");
            let read = match key.as_str() {
                "header" => self.header_name(v, &at).map(Actual::Header),
                _ => self.usage_weights(v, &at).map(Actual::Usage),
            };
            if actual.is_some() {
                self.error(k.pos(), &at, "an actual amount is read from one place: keep header or usage");
            }
            actual = read.or(actual);
        }
        if actual.is_none() && self.errors.len() == before {
            self.error(node.pos(), field, "say where the amount is read: usage: total_tokens, or header: x-cost");
        }
        actual.filter(|_| self.errors.len() == before)
    }

    /// A usage field (weight 1), or a mapping of usage fields to weights.
    fn usage_weights(&mut self, node: &Node, field: &str) -> Option<Weights> {
        let Node::Map { entries, .. } = node else {
            let name = self.field_name(node, field)?;
            return Some(Arc::from([(name, ONE)]));
        };
        let before = self.errors.len();
        let mut weights = Vec::with_capacity(entries.len());
        for (k, v) in entries {
            let Some(name) = self.field_name(k, field) else { continue };
            if weights.iter().any(|(n, _): &(Arc<str>, Weight)| *n == name) {
                self.error(k.pos(), &format!("{field}.{name}"), format!("`{name}` is weighted twice: keep one"));
            }
            if let Some(w) = self.weight(v, &format!("{field}.{name}")) {
                weights.push((name, w));
            }
        }
        if weights.is_empty() && self.errors.len() == before {
            self.error(node.pos(), field, "name at least one usage field, e.g. {completion_tokens: 1}");
        }
        (self.errors.len() == before).then(|| Arc::from(weights))
    }

    /// A decimal factor from 0 to a million with at most 6 decimals.
    fn weight(&mut self, node: &Node, field: &str) -> Option<Weight> {
        let parsed = match node {
            Node::Scalar { value, plain: true, .. } => parse_ppm(value).filter(|w| *w <= MAX_WEIGHT),
            _ => None,
        };
        if parsed.is_none() {
            self.error(
                node.pos(),
                field,
                format!(
                    "expected a number from 0 to 1000000 with at most 6 decimals (e.g. 0.15), found {}",
                    describe(node)
                ),
            );
        }
        parsed
    }

    /// One JSON field name, or a list of them (the first present is read).
    fn body_fields(&mut self, node: &Node, field: &str) -> Option<Arc<[Arc<str>]>> {
        let names: Vec<Arc<str>> = match node {
            Node::Seq { items, .. } => items.iter().filter_map(|n| self.field_name(n, field)).collect(),
            _ => vec![self.field_name(node, field)?],
        };
        if names.is_empty() {
            self.error(node.pos(), field, "name a field of the request's JSON body, e.g. body: max_tokens");
            return None;
        }
        Some(Arc::from(names))
    }

    /// A JSON field name: non-empty text.
    fn field_name(&mut self, node: &Node, field: &str) -> Option<Arc<str>> {
        let name = self.string(node, field)?;
        if name.is_empty() {
            self.error(node.pos(), field, "a field name cannot be empty: write e.g. total_tokens");
            return None;
        }
        Some(Arc::from(name))
    }

    /// An HTTP header name (kept lowercase).
    fn header_name(&mut self, node: &Node, field: &str) -> Option<Arc<str>> {
        let name = self.string(node, field)?;
        if !is_header_token(&name) {
            self.error(
                node.pos(),
                field,
                format!("`{name}` is not a header name: write letters, digits and - only, e.g. x-cost"),
            );
            return None;
        }
        Some(Arc::from(name.to_ascii_lowercase()))
    }

    /// A cost on a limit that cannot reserve it: one charged after the work
    /// (nothing is reserved at request time) or a shaper (it holds requests,
    /// it does not count amounts back).
    pub(super) fn check_cost(&mut self, f: &RateLimitFields, limit: &Limit, scope: Scope, field: &str) {
        let Some((_, pos)) = &f.cost else { return };
        let at = format!("{field}.cost");
        if limit.charge() == Charge::After {
            self.error(
                *pos,
                &at,
                "cost reserves an estimate before the work; charge: after charges only after it: remove one \
                 (a metered request settles its reservation when the response ends)",
            );
        }
        if matches!(scope, Scope::Global(_)) && *limit.algorithm() == Algorithm::FixedWindow {
            // As for charge: after: a settle's excess is a late charge, and
            // the regions cannot carry a fixed window's debt.
            self.error(
                *pos,
                &at,
                "cost with scope: global needs sliding_window, sliding_buckets or gcra (a settle charges its excess \
                 late, and a fixed window's debt cannot be carried by the regions' per-window counts): set \
                 algorithm, or use scope: region",
            );
        }
        if matches!(limit.algorithm(), Algorithm::LeakyBucket { mode: LeakyMode::Shape, .. }) {
            self.error(
                *pos,
                &at,
                "a shaper (mode: shape) cannot take a cost: it delays requests, it cannot give back an estimate; use \
                 mode: meter or another algorithm",
            );
        }
    }
}
