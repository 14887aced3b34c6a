//! Descriptors built from an HTTP request by the rules' `request_descriptors`
//! actions (envoy's route rate-limit actions).

use std::net::IpAddr;

use floodgate_core::rules::{Action, RequestDescriptor, RuleSet};
use http::{HeaderMap, Method, Uri};

/// One descriptor: `(key, value)` entries in order.
pub type Entries = Vec<(String, String)>;

/// What the layer knows of a request when it builds descriptors.
#[derive(Debug, Clone, Copy)]
pub struct RequestFacts<'a> {
    /// The method.
    pub method: &'a Method,
    /// The URI (path and query; scheme and authority for absolute URIs).
    pub uri: &'a Uri,
    /// The headers.
    pub headers: &'a HeaderMap,
    /// The client's address (peer, or the trusted forwarding hop); `None`
    /// when the server did not record the peer address.
    pub client_ip: Option<IpAddr>,
    /// The request's JSON body, when it was read (the metering layer reads
    /// it in a domain that needs it); `body_field` actions read it.
    pub body: Option<&'a serde_json::Value>,
}

/// A request's descriptors could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescriptorError {
    /// A `remote_address` action, and no peer address on the request.
    #[error(
        "no client address: the server did not record the peer address (serve with axum's \
         `into_make_service_with_connect_info::<SocketAddr>()`, or insert the peer's `SocketAddr` \
         into the request extensions)"
    )]
    NoPeerAddress,
}

/// The descriptor used when a domain has no `request_descriptors`: the
/// client's address, as envoy's `remote_address` action names it.
pub fn default_descriptors() -> &'static [RequestDescriptor] {
    static DEFAULT: std::sync::OnceLock<[RequestDescriptor; 1]> = std::sync::OnceLock::new();
    DEFAULT.get_or_init(|| [RequestDescriptor { actions: vec![Action::RemoteAddress], pos: Default::default() }])
}

/// How `domain` of `rules` builds descriptors from a request: its
/// `request_descriptors`, else [`default_descriptors`].
pub fn templates<'r>(rules: &'r RuleSet, domain: &str) -> &'r [RequestDescriptor] {
    match rules.domain(domain).map(|d| d.request_descriptors()) {
        Some(t) if !t.is_empty() => t,
        _ => default_descriptors(),
    }
}

/// Build the descriptors of `facts` by `templates`, in order. A descriptor
/// whose `request_headers` header is missing is left out (unless the action
/// says `skip_if_absent`: then only that entry is), and so is one left with
/// no entries — as envoy does.
pub fn build(templates: &[RequestDescriptor], facts: &RequestFacts<'_>) -> Result<Vec<Entries>, DescriptorError> {
    let mut out = Vec::with_capacity(templates.len());
    'descriptor: for t in templates {
        let mut entries = Vec::with_capacity(t.actions.len());
        for action in &t.actions {
            match action {
                Action::RemoteAddress => {
                    let ip = facts.client_ip.ok_or(DescriptorError::NoPeerAddress)?;
                    entries.push(("remote_address".to_owned(), crate::ip_str(ip, &mut [0; 48]).to_owned()));
                }
                Action::GenericKey { key, value } => entries.push((key.clone(), value.clone())),
                Action::RequestHeader { header, key, skip_if_absent } => match header_value(facts, header) {
                    Some(v) => entries.push((key.clone(), v)),
                    None if *skip_if_absent => {}
                    None => continue 'descriptor,
                },
                Action::BodyField { field, key, skip_if_absent } => match body_value(facts, field) {
                    Some(v) => entries.push((key.clone(), v)),
                    None if *skip_if_absent => {}
                    None => continue 'descriptor,
                },
            }
        }
        if !entries.is_empty() {
            out.push(entries);
        }
    }
    Ok(out)
}

/// A header's value (lossy for non-UTF-8 bytes; several lines joined with
/// `,`), or a pseudo-header's.
/// The longest body value taken as a descriptor value (a longer one reads
/// as missing: a request cannot make counters of any size).
const MAX_BODY_VALUE: usize = 256;

/// A top-level string, number or boolean of the request's JSON body.
fn body_value(facts: &RequestFacts<'_>, field: &str) -> Option<String> {
    let v = match facts.body?.get(field)? {
        serde_json::Value::String(s) => s.clone(),
        n @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)) => n.to_string(),
        _ => return None,
    };
    (!v.is_empty() && v.len() <= MAX_BODY_VALUE).then_some(v)
}

fn header_value(facts: &RequestFacts<'_>, header: &str) -> Option<String> {
    match header {
        ":method" => Some(facts.method.as_str().to_owned()),
        ":path" => Some(facts.uri.path().to_owned()),
        ":scheme" => Some(facts.uri.scheme_str().unwrap_or("http").to_owned()),
        ":authority" => facts.uri.authority().map(|a| a.as_str().to_owned()).or_else(|| {
            facts.headers.get(http::header::HOST).map(|h| String::from_utf8_lossy(h.as_bytes()).into_owned())
        }),
        name => {
            let mut values = facts.headers.get_all(name).iter();
            let first = values.next()?;
            let mut v = String::from_utf8_lossy(first.as_bytes()).into_owned();
            for more in values {
                v.push(',');
                v.push_str(&String::from_utf8_lossy(more.as_bytes()));
            }
            Some(v)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_build_envoy_descriptors() {
        let rules = RuleSet::from_yaml(
            "p.yaml",
            r#"domain: p
request_descriptors:
  - actions: [{remote_address: {}}]
  - actions:
      - request_headers: {header_name: x-api-key, descriptor_key: api_key}
      - request_headers: {header_name: ":method", descriptor_key: method}
  - actions:
      - generic_key: {descriptor_value: all, descriptor_key: class}
      - request_headers: {header_name: x-tenant, descriptor_key: tenant, skip_if_absent: true}
      - request_headers: {header_name: ":path", descriptor_key: path}
descriptors: []
"#,
        )
        .unwrap();
        let templates = rules.domain("p").unwrap().request_descriptors();
        let uri: Uri = "/v1/items?x=1".parse().unwrap();
        let headers = HeaderMap::new();
        let ip: IpAddr = "203.0.113.9".parse().unwrap();
        let facts =
            RequestFacts { method: &Method::POST, uri: &uri, headers: &headers, client_ip: Some(ip), body: None };
        let e = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        // No x-api-key: that descriptor is left out; no x-tenant: only that entry.
        assert_eq!(
            build(templates, &facts).unwrap(),
            vec![vec![e("remote_address", "203.0.113.9")], vec![e("class", "all"), e("path", "/v1/items")]]
        );
        let mut headers = headers.clone();
        headers.insert("x-api-key", "k1".parse().unwrap());
        headers.insert("x-tenant", "t9".parse().unwrap());
        let facts = RequestFacts { headers: &headers, ..facts };
        let got = build(templates, &facts).unwrap();
        assert_eq!(got[1], vec![e("api_key", "k1"), e("method", "POST")]);
        assert_eq!(got[2], vec![e("class", "all"), e("tenant", "t9"), e("path", "/v1/items")]);
        // remote_address without a peer address is an error, not a free pass.
        // A body field: a string, number or boolean at the top; anything
        // else, or too long, reads as missing.
        let body_rules = RuleSet::from_yaml(
            "b.yaml",
            "domain: b\nrequest_descriptors:\n  - actions: [{body_field: {field: model, descriptor_key: model}}]\n  - actions: [{generic_key: {descriptor_value: all}}, {body_field: {field: n, descriptor_key: n, skip_if_absent: true}}]\ndescriptors: []\n",
        )
        .unwrap();
        let body_templates = body_rules.domain("b").unwrap().request_descriptors();
        let with_body = |json: &str| {
            let v: serde_json::Value = serde_json::from_str(json).unwrap();
            build(body_templates, &RequestFacts { body: Some(&v), ..facts }).unwrap()
        };
        assert_eq!(
            with_body(r#"{"model": "gpt-x", "n": 3}"#),
            vec![vec![e("model", "gpt-x")], vec![e("generic_key", "all"), e("n", "3")]]
        );
        assert_eq!(with_body(r#"{"model": true}"#)[0], vec![e("model", "true")]);
        let long = format!(r#"{{"model": "{}"}}"#, "m".repeat(300));
        for missing in [r#"{"model": {"a": 1}}"#, r#"{"model": null}"#, r#"{"model": ""}"#, "[1]", &long] {
            assert_eq!(with_body(missing), vec![vec![e("generic_key", "all")]], "{missing}");
        }
        assert_eq!(build(body_templates, &facts).unwrap(), vec![vec![e("generic_key", "all")]], "no body read");
        let facts = RequestFacts { client_ip: None, ..facts };
        assert_eq!(build(templates, &facts), Err(DescriptorError::NoPeerAddress));
        assert_eq!(build(default_descriptors(), &RequestFacts { client_ip: Some(ip), ..facts }).unwrap().len(), 1);
    }
}
