//! JSON shapes of a request and its answer:
//!
//! * `POST /json`: the protobuf JSON mapping of the RLS request and response,
//!   as envoyproxy/ratelimit's JSON endpoint reads and writes them
//!   (`protojson`): camelCase or proto field names, 64-bit integers as
//!   numbers or strings, enums by name or number, unknown fields rejected,
//!   zero values left out of the response, durations as `"1.5s"`.
//! * `POST /v1/check`: a friendlier shape, documented in docs/service.md ("The HTTP API"):
//!   `{"domain": "api", "descriptors": [{"user": "alice"}], "hits": 1}` in,
//!   `{"allowed": true, "retry_after_ms": null, "descriptors": [...], "headers": {...}}` out.

use std::fmt;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde_json::{Map, Value, json};

use crate::protocol::grpc::unit_from_proto;
use crate::service::{Decided, Descriptor, LEASE_ENTRY, LimitOverride, Request, lease_text, parse_lease};
use floodgate_core::MAX_LIMIT;
use floodgate_core::headers::HeaderMode;

/// A body that is not a valid request: the field path and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest {
    /// The JSON path of the offending field (`descriptors[0].entries`), or
    /// empty for the body as a whole.
    pub field: String,
    /// What is wrong and what to send instead.
    pub message: String,
}

/// Parse a JSON body; an error names the path of the offending field.
pub fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, BadRequest> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let value: T = serde_path_to_error::deserialize(&mut *de).map_err(|e| {
        let field = e.path().to_string();
        let field = if field == "." { String::new() } else { field };
        BadRequest { field, message: e.into_inner().to_string() }
    })?;
    // Whitespace may follow the value; anything else (a second request
    // pasted after the first, garbage) is refused, not ignored.
    de.end().map_err(|e| BadRequest {
        field: String::new(),
        message: format!("{e}: send one JSON object per request, with nothing after it"),
    })?;
    Ok(value)
}

// ---- POST /json: the protobuf JSON mapping ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PjRequest {
    #[serde(default)]
    domain: String,
    #[serde(default)]
    descriptors: Vec<PjDescriptor>,
    #[serde(default, alias = "hits_addend", rename = "hitsAddend", deserialize_with = "pj_u64")]
    hits_addend: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PjDescriptor {
    #[serde(default)]
    entries: Vec<PjEntry>,
    #[serde(default)]
    limit: Option<PjLimit>,
    #[serde(default, alias = "hits_addend", rename = "hitsAddend", deserialize_with = "pj_opt_u64")]
    hits_addend: Option<u64>,
    #[serde(default, alias = "is_negative_hits", rename = "isNegativeHits")]
    is_negative_hits: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PjEntry {
    #[serde(default)]
    key: String,
    #[serde(default)]
    value: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PjLimit {
    #[serde(default, alias = "requests_per_unit", rename = "requestsPerUnit", deserialize_with = "pj_u32")]
    requests_per_unit: u32,
    #[serde(default, deserialize_with = "pj_unit")]
    unit: i32,
}

/// Parse a `/json` body (the protobuf JSON mapping of `RateLimitRequest`).
pub fn parse_pb_request(body: &[u8]) -> Result<Request, BadRequest> {
    let r: PjRequest = parse(body)?;
    let mut descriptors = Vec::with_capacity(r.descriptors.len());
    for (i, d) in r.descriptors.into_iter().enumerate() {
        let limit = d.limit.and_then(|l| {
            Some(LimitOverride { requests_per_unit: l.requests_per_unit, unit: unit_from_proto(l.unit)? })
        });
        let entries = d.entries.into_iter().map(|e| (e.key, e.value)).collect();
        descriptors.push(
            Descriptor::rls(entries, d.hits_addend, d.is_negative_hits, limit)
                .map_err(|message| BadRequest { field: format!("descriptors[{i}].entries.{LEASE_ENTRY}"), message })?,
        );
    }
    Ok(Request { domain: r.domain, hits_addend: r.hits_addend, descriptors })
}

/// The protobuf JSON mapping of the RLS response for `answer`, zero values
/// left out as `protojson` does.
pub fn pb_response(a: &Decided, mode: HeaderMode) -> Value {
    let resp = crate::protocol::grpc::to_proto(a, mode);
    let code = |c: i32| {
        if c == 2 {
            "OVER_LIMIT"
        } else if c == 1 {
            "OK"
        } else {
            "UNKNOWN"
        }
    };
    let statuses: Vec<Value> = resp
        .statuses
        .iter()
        .map(|s| {
            let mut o = Map::new();
            o.insert("code".into(), code(s.code).into());
            if let Some(l) = &s.current_limit {
                let mut lim = Map::new();
                if !l.name.is_empty() {
                    lim.insert("name".into(), l.name.clone().into());
                }
                if l.requests_per_unit != 0 {
                    lim.insert("requestsPerUnit".into(), l.requests_per_unit.into());
                }
                if l.unit != 0 {
                    let unit =
                        envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit::try_from(
                            l.unit,
                        );
                    lim.insert("unit".into(), unit.map(|u| u.as_str_name()).unwrap_or("UNKNOWN").into());
                }
                o.insert("currentLimit".into(), lim.into());
            }
            if s.limit_remaining != 0 {
                o.insert("limitRemaining".into(), s.limit_remaining.into());
            }
            if let Some(d) = &s.duration_until_reset {
                let d = Duration::new(u64::try_from(d.seconds).unwrap_or(0), u32::try_from(d.nanos).unwrap_or(0));
                o.insert("durationUntilReset".into(), crate::protocol::grpc::duration_text(d).into());
            }
            o.into()
        })
        .collect();
    let mut o = Map::new();
    o.insert("overallCode".into(), code(resp.overall_code).into());
    if !statuses.is_empty() {
        o.insert("statuses".into(), statuses.into());
    }
    let headers: Vec<Value> =
        resp.response_headers_to_add.iter().map(|h| json!({"key": h.key, "value": h.value})).collect();
    if !headers.is_empty() {
        o.insert("responseHeadersToAdd".into(), headers.into());
    }
    o.into()
}

/// protojson reads 64-bit integers as numbers or decimal strings.
fn pj_u64<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum N {
        Num(u64),
        Str(String),
    }
    match N::deserialize(d).map_err(|_| de::Error::custom("expected a non-negative integer (number or string)"))? {
        N::Num(n) => Ok(n),
        N::Str(s) => s.parse().map_err(|_| de::Error::custom(format!("`{s}` is not a non-negative integer"))),
    }
}

fn pj_opt_u64<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    pj_u64(d).map(Some)
}

fn pj_u32<'de, D: Deserializer<'de>>(d: D) -> Result<u32, D::Error> {
    let v = pj_u64(d)?;
    u32::try_from(v).map_err(|_| de::Error::custom(format!("{v} is above the uint32 maximum 4294967295")))
}

/// An enum by name (`"SECOND"`) or number.
fn pj_unit<'de, D: Deserializer<'de>>(d: D) -> Result<i32, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum U {
        Num(i32),
        Str(String),
    }
    match U::deserialize(d).map_err(|_| de::Error::custom("expected a unit name such as \"SECOND\""))? {
        U::Num(n) => Ok(n),
        U::Str(s) => {
            envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit::from_str_name(&s)
                .map(|u| u as i32)
                .ok_or_else(|| {
                    de::Error::custom(format!("unknown unit `{s}`: use SECOND, MINUTE, HOUR, DAY, WEEK, MONTH or YEAR"))
                })
        }
    }
}

// ---- POST /v1/check ----

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckRequest {
    domain: String,
    descriptors: Vec<Entries>,
    /// Units to take; 0 a peek; negative a refund of that many (a
    /// release, on a concurrency limit).
    #[serde(default)]
    hits: Option<i64>,
    /// The lease a release (negative `hits`) or `/v1/extend` names.
    #[serde(default)]
    lease: Option<String>,
}

/// A JSON object read as ordered `(key, value)` entries (document order:
/// descriptor entries are matched in order).
pub(crate) struct Entries(pub(crate) Vec<(String, String)>);

impl<'de> Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an object of string entries in order, e.g. {\"user\": \"alice\"}")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<String, String>()? {
                    if out.iter().any(|(seen, _): &(String, String)| *seen == k) {
                        return Err(de::Error::custom(format!("entry `{k}` appears twice")));
                    }
                    out.push((k, v));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(V)
    }
}

/// Parse a `/v1/check` body.
pub fn parse_check_request(body: &[u8]) -> Result<Request, BadRequest> {
    let r: CheckRequest = parse(body)?;
    let hits = r.hits.unwrap_or(1);
    let amount = hits.unsigned_abs();
    if amount > MAX_LIMIT {
        return Err(BadRequest {
            field: "hits".into(),
            message: format!(
                "{hits} is out of range: send a whole number from -{MAX_LIMIT} to {MAX_LIMIT} (2^53 - 1, the largest \
                 count every store keeps exactly); a negative number gives that many back"
            ),
        });
    }
    let lease = match r.lease.as_deref().map(parse_lease).transpose() {
        Ok(l) => l,
        Err(message) => return Err(BadRequest { field: "lease".into(), message }),
    };
    Ok(Request {
        domain: r.domain,
        hits_addend: amount,
        descriptors: r
            .descriptors
            .into_iter()
            .map(|e| Descriptor { entries: e.0, hits_addend: Some(amount), refund: hits < 0, limit: None, lease })
            .collect(),
    })
}

/// Whole milliseconds, rounded up.
pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_micros().div_ceil(1000)).unwrap_or(u64::MAX)
}

/// The `/v1/check` answer.
pub fn check_response(a: &Decided, mode: HeaderMode) -> Value {
    let descriptors: Vec<Value> = a
        .statuses
        .iter()
        .map(|s| match (&s.limit, &s.decision) {
            (Some(info), Some(d)) => json!({
                "allowed": !s.over_limit,
                "limited": true,
                "name": info.name.as_deref(),
                "algorithm": info.algorithm,
                "limit": info.requests_per_unit,
                "window_ms": ms(info.window),
                "remaining": d.remaining,
                "reset_after_ms": ms(d.reset_after),
                "retry_after_ms": d.retry_after.filter(|_| s.over_limit).map(ms),
            }),
            _ => json!({ "allowed": true, "limited": false }),
        })
        .collect();
    let headers: Map<String, Value> =
        a.answer.headers(mode).into_iter().map(|(k, v)| (k.to_owned(), v.into())).collect();
    let lease = a.lease.map(|l| json!({ "id": lease_text(l.id), "ttl_ms": ms(l.ttl) }));
    let a = &a.answer;
    let mut v = json!({
        "allowed": a.allowed,
        "retry_after_ms": a.retry_after.filter(|_| !a.allowed).map(ms),
        "descriptors": descriptors,
        "headers": headers,
    });
    // Only when a concurrency limit took a lease: release it with
    // `"hits": -1, "lease": id`, extend it on /v1/extend.
    if let Some(lease) = lease {
        v["lease"] = lease;
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protojson_names_numbers_and_strings() {
        let r = parse_pb_request(
            br#"{"domain":"d","hits_addend":2,"descriptors":[{"entries":[{"key":"k","value":"v"}],"hitsAddend":"7","limit":{"requests_per_unit":"5","unit":"MINUTE"}}]}"#,
        )
        .unwrap();
        assert_eq!(r.hits_addend, 2);
        assert_eq!(r.descriptors[0].hits_addend, Some(7));
        assert_eq!(r.descriptors[0].limit.unwrap().requests_per_unit, 5);
    }

    #[test]
    fn errors_name_the_field() {
        let e = parse_pb_request(br#"{"domain":"d","descriptors":[{"entries":[{"key":1}]}]}"#).unwrap_err();
        assert_eq!(e.field, "descriptors[0].entries[0].key");
        let e = parse_pb_request(br#"{"domain":"d","descriptor":[]}"#).unwrap_err();
        assert!(e.message.contains("unknown field `descriptor`"), "{}", e.message);
        let e = parse_pb_request(br#"{"domain":"d","descriptors":[{"limit":{"unit":"FORTNIGHT"}}]}"#).unwrap_err();
        assert_eq!(e.field, "descriptors[0].limit.unit");
        let e = parse_check_request(br#"{"domain":"d","descriptors":[{"a":"1","a":"2"}]}"#).unwrap_err();
        assert!(e.message.contains("twice"), "{}", e.message);
        assert!(parse_check_request(b"{").is_err());
    }

    /// Found by the `http` fuzz target: a body with bytes after its JSON
    /// object was decided on the object alone.
    #[test]
    fn fuzz_trailing_bytes_after_the_json_are_refused() {
        let one = br#"{"domain":"d","descriptors":[{"entries":[{"key":"k","value":"v"}]}]}"#;
        assert!(parse_pb_request(one).is_ok());
        assert!(parse_pb_request(&[one.as_slice(), b" \n\t"].concat()).is_ok());
        for tail in [b"\xffc".as_slice(), b"{}", b"x"] {
            let e = parse_pb_request(&[one.as_slice(), tail].concat()).unwrap_err();
            assert!(
                e.message.contains("trailing characters") && e.message.contains("one JSON object"),
                "{}",
                e.message
            );
            let e = parse_check_request(&[br#"{"domain":"d","descriptors":[{"k":"v"}]}"#.as_slice(), tail].concat())
                .unwrap_err();
            assert!(e.message.contains("nothing after it"), "{}", e.message);
        }
    }

    #[test]
    fn check_entries_keep_their_order() {
        let r = parse_check_request(br#"{"domain":"d","descriptors":[{"z":"1","a":"2"}],"hits":0}"#).unwrap();
        assert_eq!(r.descriptors[0].entries, vec![("z".into(), "1".into()), ("a".into(), "2".into())]);
        assert_eq!(r.descriptors[0].hits_addend, Some(0));
    }

    #[test]
    fn durations_as_protojson_writes_them() {
        assert_eq!(crate::protocol::grpc::duration_text(Duration::from_secs(1)), "1s");
        assert_eq!(crate::protocol::grpc::duration_text(Duration::from_millis(1500)), "1.500s");
        assert_eq!(crate::protocol::grpc::duration_text(Duration::from_micros(1)), "0.000001s");
        assert_eq!(crate::protocol::grpc::duration_text(Duration::from_nanos(1)), "0.000000001s");
    }
}
