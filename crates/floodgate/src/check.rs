//! `floodgate check`: one decision from a running server over gRPC.

use std::fmt::Write as _;
use std::io::Write;
use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use floodgate_core::parse_duration;
use serde_json::json;

use crate::cli::CheckArgs;
use crate::exit::{self, Failure};

/// `key=value,key=value` into entries.
pub(crate) fn parse_descriptor(s: &str) -> Result<Vec<Entry>, Failure> {
    s.split(',')
        .map(|kv| match kv.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok(Entry { key: k.to_owned(), value: v.to_owned() }),
            _ => Err(Failure::usage(format!(
                "--descriptor `{s}`: write key=value entries separated by commas, e.g. user=alice,method=POST"
            ))),
        })
        .collect()
}

/// `host:port` or a URL into the URL tonic connects to.
pub(crate) fn endpoint(server: &str) -> String {
    if server.contains("://") { server.to_owned() } else { format!("http://{server}") }
}

pub(crate) fn run(args: &CheckArgs) -> Result<(), Failure> {
    let timeout = parse_duration(&args.timeout).map_err(|e| Failure::usage(format!("--timeout: {e}")))?;
    // A request-level `hits_addend` of 0 is proto3's "unset", which Envoy
    // and the server read as 1: a peek sets each descriptor's own
    // `hits_addend` to 0, which is a peek on every server.
    let peek = (args.hits == 0).then_some(UInt64Value { value: 0 });
    let descriptors = args
        .descriptors
        .iter()
        .map(|d| Ok(RateLimitDescriptor { entries: parse_descriptor(d)?, hits_addend: peek, ..Default::default() }))
        .collect::<Result<Vec<_>, Failure>>()?;
    let req = RateLimitRequest { domain: args.domain.clone(), descriptors, hits_addend: args.hits };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start the runtime: {e}")))?;
    let resp = rt.block_on(ask(&endpoint(&args.server), req, timeout))?;
    let allowed = resp.overall_code == Code::Ok as i32;
    let out = if args.json { format!("{}\n", as_json(&resp)) } else { as_text(&resp) };
    let _ = std::io::stdout().write_all(out.as_bytes());
    if allowed { Ok(()) } else { Err(Failure::quiet(exit::DENIED)) }
}

async fn ask(url: &str, req: RateLimitRequest, timeout: Duration) -> Result<RateLimitResponse, Failure> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_owned())
        .map_err(|e| Failure::usage(format!("--server `{url}`: {e}")))?
        .connect_timeout(timeout)
        .timeout(timeout)
        .connect()
        .await
        .map_err(|e| Failure::runtime(format!("cannot connect to {url}: {e}")))?;
    let mut client = RateLimitServiceClient::new(channel);
    match client.should_rate_limit(req).await {
        Ok(r) => Ok(r.into_inner()),
        Err(s) if s.code() == tonic::Code::InvalidArgument => {
            Err(Failure::usage(format!("the server refused the request: {}", s.message())))
        }
        Err(s) => Err(Failure::runtime(format!("{url}: {} ({:?})", s.message(), s.code()))),
    }
}

fn code(c: i32) -> &'static str {
    Code::try_from(c).map(|c| c.as_str_name()).unwrap_or("UNKNOWN")
}

fn as_text(r: &RateLimitResponse) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "{}", code(r.overall_code));
    for (i, s) in r.statuses.iter().enumerate() {
        let _ = write!(out, "  descriptor {i}: {}", code(s.code));
        if let Some(l) = &s.current_limit {
            let unit =
                envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit::try_from(l.unit)
                    .map(|u| u.as_str_name().to_lowercase())
                    .unwrap_or_default();
            let _ = write!(out, ", limit {} per {unit}", l.requests_per_unit);
            if !l.name.is_empty() {
                let _ = write!(out, " ({})", l.name);
            }
            let _ = write!(out, ", remaining {}", s.limit_remaining);
            if let Some(d) = &s.duration_until_reset {
                let _ = write!(out, ", reset in {:.3}s", d.seconds as f64 + f64::from(d.nanos) / 1e9);
            }
        } else {
            let _ = write!(out, ", no limit applies");
        }
        out.push('\n');
    }
    for h in &r.response_headers_to_add {
        let _ = writeln!(out, "  {}: {}", h.key, h.value);
    }
    out
}

fn as_json(r: &RateLimitResponse) -> serde_json::Value {
    json!({
        "overall_code": code(r.overall_code),
        "statuses": r.statuses.iter().map(|s| json!({
            "code": code(s.code),
            "limit": s.current_limit.as_ref().map(|l| json!({"name": l.name, "requests_per_unit": l.requests_per_unit, "unit": l.unit})),
            "remaining": s.limit_remaining,
            "reset_after_ms": s.duration_until_reset.as_ref().map(|d| d.seconds * 1000 + i64::from(d.nanos).div_euclid(1_000_000) + i64::from(d.nanos % 1_000_000 != 0)),
        })).collect::<Vec<_>>(),
        "headers": r.response_headers_to_add.iter().map(|h| (h.key.clone(), serde_json::Value::from(h.value.clone()))).collect::<serde_json::Map<_, _>>(),
    })
}
