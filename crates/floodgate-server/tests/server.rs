//! The service end to end, through real sockets and the real protocols: a
//! tonic client built from the same Envoy protos, HTTP/1.1 for the JSON
//! endpoints and the admin API.

use std::fs;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use floodgate_server::serve::{Config, prepare};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::sync::oneshot;
use tonic::transport::Channel;

use floodgate_testing::TempDir;

const RULES: &str = r#"
domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 3, name: per_user}
  - key: tier
    value: free
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: vip
    rate_limit: {unlimited: true}
  - key: sliding
    rate_limit: {algorithm: sliding_log, window: 90s, requests_per_unit: 2}
  - key: load
    rate_limit: {unit: second, requests_per_unit: 1000000000}
"#;

pub(crate) struct Server {
    pub(crate) grpc: SocketAddr,
    pub(crate) http: SocketAddr,
    pub(crate) admin: SocketAddr,
    dir: TempDir,
    stop: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    pub(crate) async fn start(name: &str, token: Option<&str>) -> Server {
        Self::start_with(name, token, 0).await
    }

    async fn start_with(name: &str, token: Option<&str>, grpc_threads: usize) -> Server {
        Self::start_config(name, |c| {
            c.admin_token = token.map(str::to_owned);
            c.grpc_threads = grpc_threads;
        })
        .await
    }

    pub(crate) async fn start_config(name: &str, f: impl FnOnce(&mut Config)) -> Server {
        let dir = TempDir::new(name);
        dir.write("rules/api.yaml", RULES);
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        let config = Config {
            rules: dir.0.join("rules").into(),
            grpc_addr: Some(any),
            http_addr: Some(any),
            admin_addr: any,
            overrides: floodgate_server::instance::OverridesFile::At(dir.0.join("overrides.redb")),
            body_limit: 4096,
            ..Config::default()
        };
        let mut config = config;
        f(&mut config);
        let bound = prepare(config).unwrap().bind().await.unwrap();
        let (grpc, http, admin) = (bound.grpc_addr().unwrap(), bound.http_addr().unwrap(), bound.admin_addr());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            bound
                .run(async {
                    let _ = rx.await;
                })
                .await
                .unwrap();
        });
        Server { grpc, http, admin, dir, stop: Some(tx), task }
    }

    /// Its `/metrics` text.
    pub(crate) async fn metrics(&self) -> String {
        let (_, _, text) = call(&http(), "GET", format!("http://{}/metrics", self.http), "", None).await;
        text.as_str().unwrap_or_default().to_owned()
    }

    pub(crate) async fn grpc(&self) -> RateLimitServiceClient<Channel> {
        RateLimitServiceClient::connect(format!("http://{}", self.grpc)).await.unwrap()
    }

    pub(crate) async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        tokio::time::timeout(Duration::from_secs(10), &mut self.task).await.expect("stops within 10 s").unwrap();
    }
}

pub(crate) fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries.iter().map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() }).collect(),
        ..Default::default()
    }
}

pub(crate) fn req(domain: &str, descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
    RateLimitRequest { domain: domain.into(), descriptors, hits_addend: hits }
}

pub(crate) async fn ask(c: &mut RateLimitServiceClient<Channel>, r: RateLimitRequest) -> RateLimitResponse {
    c.should_rate_limit(r).await.unwrap().into_inner()
}

fn header<'a>(r: &'a RateLimitResponse, name: &str) -> Option<&'a str> {
    r.response_headers_to_add.iter().find(|h| h.key == name).map(|h| h.value.as_str())
}

pub(crate) type Http = Client<HttpConnector, Full<Bytes>>;

pub(crate) fn http() -> Http {
    Client::builder(TokioExecutor::new()).build_http()
}

/// One HTTP call: status, headers, body as JSON (or a JSON string of the text).
pub(crate) async fn call(
    c: &Http,
    method: &str,
    url: String,
    body: &str,
    auth: Option<&str>,
) -> (u16, hyper::HeaderMap, Value) {
    let mut b = hyper::Request::builder().method(method).uri(url).header("content-type", "application/json");
    if let Some(t) = auth {
        b = b.header("authorization", format!("Bearer {t}"));
    }
    let resp = c.request(b.body(Full::new(Bytes::from(body.to_owned()))).unwrap()).await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, headers, v)
}

async fn eventually<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond().await {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn rls_decides_reports_and_sets_headers() {
    let s = Server::start("rls", None).await;
    let mut c = s.grpc().await;
    for remaining in [2, 1, 0] {
        let r = ask(&mut c, req("api", vec![desc(&[("user", "alice")])], 0)).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
        let st = &r.statuses[0];
        assert_eq!(st.limit_remaining, remaining);
        let l = st.current_limit.as_ref().unwrap();
        assert_eq!((l.requests_per_unit, l.unit, l.name.as_str()), (3, Unit::Minute as i32, "per_user"));
        assert!(st.duration_until_reset.unwrap().seconds <= 60);
    }
    let denied = ask(&mut c, req("api", vec![desc(&[("user", "alice")])], 1)).await;
    assert_eq!(denied.overall_code, Code::OverLimit as i32);
    assert_eq!(denied.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(header(&denied, "x-ratelimit-limit"), Some("3"));
    assert_eq!(header(&denied, "x-ratelimit-remaining"), Some("0"));
    assert_eq!(header(&denied, "ratelimit-policy"), Some("\"per_user\";q=3;w=60"));
    let retry: u64 = header(&denied, "retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry));
    // Another user is independent; no rule matches: OK without a limit.
    assert_eq!(ask(&mut c, req("api", vec![desc(&[("user", "bob")])], 1)).await.overall_code, Code::Ok as i32);
    let none = ask(&mut c, req("api", vec![desc(&[("nothing", "x")])], 1)).await;
    assert_eq!(none.overall_code, Code::Ok as i32);
    assert!(none.statuses[0].current_limit.is_none());
    assert_eq!(ask(&mut c, req("nodomain", vec![desc(&[("user", "x")])], 1)).await.overall_code, Code::Ok as i32);
    // Unlimited: OK with no limit, whatever the hits.
    let vip = ask(&mut c, req("api", vec![desc(&[("vip", "x")])], 1_000_000)).await;
    assert_eq!(vip.overall_code, Code::Ok as i32);
    // A window that is not an envoy unit: UNKNOWN with the window as name.
    let sliding = ask(&mut c, req("api", vec![desc(&[("sliding", "x")])], 1)).await;
    let l = sliding.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!((l.unit, l.name.as_str()), (Unit::Unknown as i32, "90s"));
    s.stop().await;
}

#[tokio::test]
async fn hits_addend_shadow_mode_and_all_or_nothing() {
    let s = Server::start("hits", None).await;
    let mut c = s.grpc().await;
    // Request-level hits: 3 at once takes the whole limit.
    assert_eq!(ask(&mut c, req("api", vec![desc(&[("user", "h")])], 3)).await.overall_code, Code::Ok as i32);
    // Per-descriptor hits_addend 0: a check only.
    let mut peek = desc(&[("user", "h")]);
    peek.hits_addend = Some(UInt64Value { value: 0 });
    let r = ask(&mut c, req("api", vec![peek], 5)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (Code::Ok as i32, 0));
    // Shadow mode: over the limit, answered OK.
    for _ in 0..3 {
        assert_eq!(ask(&mut c, req("api", vec![desc(&[("shadow", "s")])], 1)).await.overall_code, Code::Ok as i32);
    }
    // All or nothing: tier=free (1/min) denies, so user=z keeps nothing.
    let two = || req("api", vec![desc(&[("user", "z")]), desc(&[("tier", "free")])], 1);
    assert_eq!(ask(&mut c, two()).await.overall_code, Code::Ok as i32);
    for _ in 0..3 {
        let r = ask(&mut c, two()).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32);
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
        assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
    }
    let r = ask(&mut c, req("api", vec![desc(&[("user", "z")])], 1)).await;
    assert_eq!(r.statuses[0].limit_remaining, 1, "denied requests took nothing from user=z");
    // A limit carried by the request replaces the rules' (envoy's descriptor limit).
    let mut own = desc(&[("user", "own")]);
    own.limit = Some(RateLimitOverride { requests_per_unit: 1, unit: Unit::Hour as i32 });
    let r = ask(&mut c, req("api", vec![own.clone()], 1)).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().unit, Unit::Hour as i32);
    assert_eq!(ask(&mut c, req("api", vec![own], 1)).await.overall_code, Code::OverLimit as i32);
    // Malformed requests: INVALID_ARGUMENT with the field named.
    let e = c.should_rate_limit(req("", vec![desc(&[("user", "x")])], 1)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("domain"), "{}", e.message());
    let e = c.should_rate_limit(req("api", vec![], 1)).await.unwrap_err();
    assert!(e.message().contains("descriptors"), "{}", e.message());
    let e = c.should_rate_limit(req("api", vec![desc(&[])], 1)).await.unwrap_err();
    assert!(e.message().contains("descriptors[0].entries"), "{}", e.message());
    s.stop().await;
}

#[tokio::test]
async fn grpc_health_service_reports_serving() {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    let s = Server::start("health", None).await;
    let channel =
        tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc)).unwrap().connect().await.unwrap();
    let mut h = HealthClient::new(channel);
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService"] {
        let r = h.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
        assert_eq!(r.status, 1, "SERVING for `{service}`");
    }
    s.stop().await;
}

#[tokio::test]
async fn json_endpoints_and_bad_input() {
    let s = Server::start("json", None).await;
    let c = http();
    let url = |p: &str| format!("http://{}{p}", s.http);
    let body = r#"{"domain":"api","descriptors":[{"entries":[{"key":"tier","value":"free"}]}]}"#;
    let (st, _, v) = call(&c, "POST", url("/json"), body, None).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["overallCode"], "OK");
    assert_eq!(v["statuses"][0]["currentLimit"], json!({"requestsPerUnit": 1, "unit": "MINUTE"}));
    assert!(v["statuses"][0].get("limitRemaining").is_none(), "zero values are left out: {v}");
    let (st, _, v) = call(&c, "POST", url("/json"), body, None).await;
    assert_eq!((st, v["overallCode"].as_str()), (429, Some("OVER_LIMIT")));

    let (st, h, v) =
        call(&c, "POST", url("/v1/check"), r#"{"domain":"api","descriptors":[{"user":"carol"}],"hits":2}"#, None).await;
    assert_eq!(st, 200);
    assert_eq!(v["allowed"], true);
    assert_eq!(v["descriptors"][0]["remaining"], 1);
    assert_eq!(v["descriptors"][0]["window_ms"], 60_000);
    assert_eq!(h["x-ratelimit-remaining"], "1");
    let (_, _, v) =
        call(&c, "POST", url("/v1/check"), r#"{"domain":"api","descriptors":[{"user":"carol"}],"hits":2}"#, None).await;
    assert_eq!(v["allowed"], false);
    assert!(v["retry_after_ms"].as_u64().unwrap() > 0);

    // Bad input: a JSON error naming the field, never a panic.
    let cases: &[(&str, &str, u16, &str)] = &[
        ("/json", "{", 400, ""),
        ("/json", r#"{"domain":"api","descriptors":[{"entries":[{"key":1}]}]}"#, 400, "descriptors[0].entries[0].key"),
        ("/json", r#"{"domain":"api","descriptors":[{"entries":[{"key":"user","value":"x"}]}],"bogus":1}"#, 400, ""),
        ("/json", r#"{"descriptors":[{"entries":[{"key":"user","value":"x"}]}]}"#, 400, "domain"),
        ("/json", r#"{"domain":"api"}"#, 400, "descriptors"),
        ("/v1/check", r#"{"domain":"api","descriptors":[["user","x"]]}"#, 400, "descriptors[0]"),
        // (A negative `hits` is a refund since issue 46: see refunds.rs.)
        ("/v1/check", r#"{"domain":"api","descriptors":[{"user":"x"}],"hits":1.5}"#, 400, "hits"),
        ("/v1/check", r#"{"domain":"api","descriptors":[{"user":"x"}],"hits":-9007199254740992}"#, 400, "hits"),
        ("/v1/check", r#"{"descriptors":[]}"#, 400, ""),
    ];
    for (path, body, status, field) in cases {
        let (st, _, v) = call(&c, "POST", url(path), body, None).await;
        assert_eq!(st, *status, "{path} {body}: {v}");
        assert!(v["error"].is_string(), "{v}");
        if !field.is_empty() {
            assert_eq!(v["field"], *field, "{path} {body}: {v}");
        }
    }
    let big = format!(r#"{{"domain":"api","descriptors":[{{"user":"{}"}}]}}"#, "x".repeat(10_000));
    let (st, _, v) = call(&c, "POST", url("/v1/check"), &big, None).await;
    assert_eq!(st, 413, "{v}");
    let (st, _, _) = call(&c, "GET", url("/json"), "", None).await;
    assert_eq!(st, 405);
    let (st, _, v) = call(&c, "GET", url("/nope"), "", None).await;
    assert_eq!(st, 404);
    assert!(v["error"].is_string());
    let resp = c
        .request(
            hyper::Request::post(url("/json"))
                .header("content-type", "application/xml")
                .body(Full::new(Bytes::from("<x/>")))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 415);

    // Health, readiness, metrics.
    assert_eq!(call(&c, "GET", url("/healthz"), "", None).await.0, 200);
    assert_eq!(call(&c, "GET", url("/healthcheck"), "", None).await.0, 200);
    let (st, _, v) = call(&c, "GET", url("/readyz"), "", None).await;
    assert_eq!(st, 200);
    assert_eq!((v["ready"].as_bool(), v["rules"]["rules"].as_u64()), (Some(true), Some(6)));
    let (st, _, v) = call(&c, "GET", url("/metrics"), "", None).await;
    assert_eq!(st, 200);
    let text = v.as_str().unwrap();
    assert!(text.contains(r#"floodgate_decisions_total{domain="api",rule="per_user",result="ok"} 1"#), "{text}");
    assert!(text.contains(r#"floodgate_requests_total{protocol="json",result="over_limit"} 1"#), "{text}");
    assert!(text.contains("floodgate_request_duration_seconds_bucket"), "{text}");
    assert!(text.contains(r#"floodgate_store_errors_total{kind="unavailable"} 0"#), "{text}");
    assert!(text.contains("floodgate_config_reloads_total 0"), "{text}");
    assert!(!text.contains("carol"), "client values never become labels");
    s.stop().await;
}

#[tokio::test]
async fn admin_api_needs_its_token_and_manages_overrides() {
    let s = Server::start("admin", Some("s3cret")).await;
    let c = http();
    let url = |p: &str| format!("http://{}{p}", s.admin);
    for token in [None, Some("wrong")] {
        let (st, h, v) = call(&c, "GET", url("/admin/v1/rules"), "", token).await;
        assert_eq!(st, 401, "{v}");
        assert_eq!(h["www-authenticate"], "Bearer");
    }
    let auth = Some("s3cret");
    let (st, _, v) = call(&c, "GET", url("/admin/v1/rules"), "", auth).await;
    assert_eq!(st, 200);
    assert_eq!(v["domains"][0]["domain"], "api");
    assert!(v["domains"][0]["rules"][0]["at"].as_str().unwrap().ends_with("api.yaml:5:17"), "{v}");
    let rule = &v["domains"][0]["rules"][0];
    assert_eq!((rule["charge"].as_str(), rule["scope"].as_str()), (Some("before"), Some("region")), "{v}");

    // An override of user=dave: 1 per hour instead of 3 per minute.
    let set = r#"{"domain":"api","descriptor":[{"key":"user","value":"dave"}],"limits":{"unit":"hour","requests_per_unit":1}}"#;
    let (st, _, v) = call(&c, "PUT", url("/admin/v1/overrides"), set, auth).await;
    assert_eq!(st, 200, "{v}");
    let mut g = s.grpc().await;
    let dave = || req("api", vec![desc(&[("user", "dave")])], 1);
    let r = ask(&mut g, dave()).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().unit, Unit::Hour as i32);
    assert_eq!(ask(&mut g, dave()).await.overall_code, Code::OverLimit as i32);
    let (_, _, v) = call(&c, "GET", url("/admin/v1/overrides"), "", auth).await;
    assert_eq!(v["overrides"].as_array().unwrap().len(), 1);
    // Counters of one descriptor, read without taking anything.
    let who = r#"{"domain":"api","descriptor":[{"key":"user","value":"dave"}]}"#;
    let (st, _, v) = call(&c, "POST", url("/admin/v1/counters"), who, auth).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!((v["limits"][0]["limit"].as_u64(), v["limits"][0]["remaining"].as_u64()), (Some(1), Some(0)));
    // Bad overrides: the field and what is wrong.
    let bad = r#"{"domain":"api","descriptor":[{"key":"user","value":"x"}],"limits":{"unit":"fortnight","requests_per_unit":1}}"#;
    let (st, _, v) = call(&c, "PUT", url("/admin/v1/overrides"), bad, auth).await;
    assert_eq!(st, 400, "{v}");
    assert!(v["error"].as_str().unwrap().contains("fortnight"), "{v}");
    let (st, _, v) = call(&c, "PUT", url("/admin/v1/overrides"), r#"{"domain":"api"}"#, auth).await;
    assert_eq!(st, 400, "{v}");
    // Delete: back to the file rule.
    let (st, _, _) = call(&c, "DELETE", url("/admin/v1/overrides"), who, auth).await;
    assert_eq!(st, 200);
    let (st, _, _) = call(&c, "DELETE", url("/admin/v1/overrides"), who, auth).await;
    assert_eq!(st, 404);
    let r = ask(&mut g, dave()).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().unit, Unit::Minute as i32);

    // Reload: a bad edit is refused with every error and the rules stay.
    fs::write(
        s.dir.0.join("rules/api.yaml"),
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight}\n",
    )
    .unwrap();
    let (st, _, v) = call(&c, "POST", url("/admin/v1/reload"), "", auth).await;
    assert_eq!(st, 422, "{v}");
    assert!(v["errors"][0].as_str().unwrap().contains("api.yaml:4"), "{v}");
    let (_, _, v) = call(&c, "GET", format!("http://{}/readyz", s.http), "", None).await;
    assert_eq!(v["ready"], true, "the last good rules still serve: {v}");
    assert!(v["rules"]["last_error"].as_str().unwrap().contains("fortnight"), "{v}");
    s.stop().await;
}

#[tokio::test]
async fn rules_reload_while_serving() {
    let s = Server::start("reload", None).await;
    let mut g = s.grpc().await;
    let limit = |r: RateLimitResponse| r.statuses[0].current_limit.as_ref().map(|l| l.requests_per_unit);
    assert_eq!(limit(ask(&mut g, req("api", vec![desc(&[("user", "erin")])], 1)).await), Some(3));
    fs::write(
        s.dir.0.join("rules/api.yaml"),
        "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 7}\n",
    )
    .unwrap();
    eventually("the new limit serves", || {
        let mut g = g.clone();
        async move { limit(ask(&mut g, req("api", vec![desc(&[("user", "erin")])], 0)).await) == Some(7) }
    })
    .await;
    s.stop().await;
}

#[tokio::test]
async fn shutdown_finishes_requests_in_flight() {
    shutdown_with(0).await;
}

#[tokio::test]
async fn per_thread_grpc_runtimes_serve_and_shut_down() {
    let s = Server::start_with("threads", None, 2).await;
    // Several connections land on both runtimes; each answers from the one store.
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(s.grpc().await);
    }
    for (i, c) in clients.iter_mut().enumerate() {
        let r = ask(c, req("api", vec![desc(&[("user", "shared")])], 1)).await;
        let expected = if i < 3 { Code::Ok } else { Code::OverLimit };
        assert_eq!(r.overall_code, expected as i32, "request {i}");
    }
    s.stop().await;
    shutdown_with(2).await;
}

async fn shutdown_with(grpc_threads: usize) {
    let s = Server::start_with(&format!("shutdown{grpc_threads}"), None, grpc_threads).await;
    let g = s.grpc().await;
    // 32 clients keep requests in flight while the server is told to stop.
    let mut tasks = Vec::new();
    for i in 0..32 {
        let mut g = g.clone();
        tasks.push(tokio::spawn(async move {
            let (mut ok, mut refused) = (0u32, 0u32);
            for _ in 0..200 {
                // Decided by the store, and never over its limit: a fast
                // client must not run out before the server stops.
                match g.should_rate_limit(req("api", vec![desc(&[("load", &format!("u{i}"))])], 0)).await {
                    Ok(r) => {
                        assert_eq!(r.into_inner().overall_code, Code::Ok as i32);
                        ok += 1;
                    }
                    // After shutdown the connection is closed: the client is
                    // refused cleanly, never handed a half answer. Cancelled
                    // is hyper's "connection closed" for a request still
                    // queued in the client, never sent.
                    Err(e) => {
                        assert!(
                            matches!(
                                e.code(),
                                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
                            ),
                            "{e}"
                        );
                        refused += 1;
                        break;
                    }
                }
            }
            (ok, refused)
        }));
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    s.stop().await;
    let mut answered = 0;
    for t in tasks {
        answered += t.await.unwrap().0;
    }
    assert!(answered > 0);
}

/// Issue 23, resource attacks: no metric series grows with client input.
/// After one request of every kind, a thousand more with new domains, keys,
/// values, descriptor shapes, hits and overrides of the limit (gRPC and
/// HTTP, allowed, denied and refused) add no series: every label comes
/// from the rules or a fixed set.
#[tokio::test]
async fn no_metric_series_grows_with_client_input() {
    let s = Server::start("cardinality", None).await;
    let mut g = s.grpc().await;
    let c = http();
    let url = |p: &str| format!("http://{}{p}", s.http);
    let series = |text: &str| -> Vec<String> {
        let mut names: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .map(|l| l.rsplit_once(' ').map_or(l, |(name, _)| name).to_owned())
            .collect();
        names.sort();
        names
    };
    let round = |i: usize| {
        let (user, domain, key) = (format!("user-{i}"), format!("domain-{i}"), format!("key-{i}"));
        let mut over = desc(&[("tier", "free")]);
        over.limit = Some(RateLimitOverride { requests_per_unit: 1 + i as u32, unit: Unit::Second as i32 });
        (
            vec![
                req("api", vec![desc(&[("user", &user)])], 1 + (i % 3) as u32),
                req("api", vec![desc(&[("user", &user), (&key, &user)]), desc(&[("shadow", &user)])], 1),
                req(&domain, vec![desc(&[(&key, &user)])], 1),
                req("api", vec![desc(&[(&key, "")])], 1),
                req("api", vec![over], 2),
            ],
            json!({"domain": "api", "descriptors": [{"user": user, "sliding": key}], "hits": i % 4}).to_string(),
            json!({"domain": domain, "descriptors": [{"entries": [{"key": key, "value": user}]}]}).to_string(),
        )
    };
    let mut send = async |i: usize| {
        let (grpcs, check, pb) = round(i);
        for r in grpcs {
            // Refusals (an empty value) are answers too.
            let _ = g.should_rate_limit(r).await;
        }
        call(&c, "POST", url("/v1/check"), &check, None).await;
        call(&c, "POST", url("/json"), &pb, None).await;
    };
    for i in 0..3 {
        send(i).await;
    }
    let (st, _, before) = call(&c, "GET", url("/metrics"), "", None).await;
    assert_eq!(st, 200);
    let before = series(before.as_str().unwrap());
    for i in 3..1_003 {
        send(i).await;
    }
    let (_, _, after) = call(&c, "GET", url("/metrics"), "", None).await;
    let after = series(after.as_str().unwrap());
    assert_eq!(before, after, "series added by client input");
    assert!(before.iter().any(|s| s.starts_with("floodgate_decisions_total{domain=\"api\"")), "{before:#?}");
    s.stop().await;
}

/// Issue 23, resource attacks: slow clients. Connections beyond
/// `max_connections` wait to be accepted (the bound holds, and others are
/// answered once a place frees); a client trickling its request head is cut
/// off at `header_timeout` however steadily it trickles; gRPC keeps
/// answering while the HTTP API is full.
#[tokio::test]
async fn slow_clients_are_bounded_and_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    let s = Server::start_config("slow", |c| {
        c.max_connections = 4;
        c.header_timeout = Duration::from_secs(30);
    })
    .await;
    let get = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    // Four idle connections fill the HTTP API.
    let mut idle = Vec::new();
    for _ in 0..4 {
        let mut c = TcpStream::connect(s.http).await.unwrap();
        c.write_all(b"GET /healthz HTTP/1.1\r\nHo").await.unwrap();
        idle.push(c);
    }
    // A fifth waits: not accepted, so not answered.
    let mut fifth = TcpStream::connect(s.http).await.unwrap();
    fifth.write_all(get).await.unwrap();
    let mut buf = [0u8; 64];
    let early = tokio::time::timeout(Duration::from_millis(700), fifth.read(&mut buf)).await;
    assert!(early.is_err(), "answered beyond the bound: {early:?}");
    // gRPC is another listener: it answers meanwhile.
    let mut g = s.grpc().await;
    assert_eq!(ask(&mut g, req("api", vec![desc(&[("user", "slow")])], 1)).await.overall_code, Code::Ok as i32);
    // One idle client leaves: the fifth is accepted and answered.
    drop(idle.pop());
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), fifth.read_to_end(&mut answer))
        .await
        .expect("answered once a place is free")
        .unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer));
    drop(idle);
    s.stop().await;

    // A trickler: one byte of its head every 100 ms, cut off at 1 s.
    let s = Server::start_config("trickle", |c| c.header_timeout = Duration::from_secs(1)).await;
    let mut c = TcpStream::connect(s.admin).await.unwrap();
    let started = Instant::now();
    let head = b"GET /admin/v1/status HTTP/1.1\r\nX-Slow: ".iter().chain(std::iter::repeat(&b'a'));
    let mut cut = false;
    for b in head.take(600) {
        if c.write_all(&[*b]).await.is_err() {
            cut = true;
            break;
        }
        // A closed connection shows as a read of 0 (or an error) too.
        let mut one = [0u8; 256];
        if let Ok(r) = tokio::time::timeout(Duration::from_millis(100), c.read(&mut one)).await {
            assert!(!matches!(r, Ok(n) if n > 0 && !one.starts_with(b"HTTP/1.1 408")), "answered a partial head");
            cut = true;
            break;
        }
    }
    assert!(cut, "a trickling client was not cut off within 60 s");
    assert!(started.elapsed() >= Duration::from_millis(900), "cut before the header timeout");
    // Others are answered.
    let c2 = http();
    let (st, _, _) = call(&c2, "GET", format!("http://{}/admin/v1/status", s.admin), "", None).await;
    assert_eq!(st, 200);
    s.stop().await;
}

/// Issue 23, resource attacks: an HTTP/2 rapid-reset flood (streams opened
/// and cancelled at once, CVE-2023-44487) against gRPC and against the HTTP
/// API: 10 connections in turn, 5 000 streams each. The service keeps
/// answering another client while the flood runs, and after. (h2 sends
/// GOAWAY when resets pile up before streams are accepted; a service that
/// accepts them as fast as they come drops each cancelled request at once.)
#[tokio::test]
async fn http2_rapid_reset_floods_leave_the_service_answering() {
    let s = Server::start("reset", None).await;
    for (addr, path) in
        [(s.grpc, "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"), (s.http, "/v1/check")]
    {
        let flood = tokio::spawn(async move {
            let (mut streams, mut cut) = (0u64, 0u64);
            for _ in 0..10 {
                let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
                let Ok((mut client, conn)) = h2::client::handshake(tcp).await else {
                    cut += 1;
                    continue;
                };
                let driver = tokio::spawn(conn);
                for _ in 0..5_000 {
                    let Ok(ready) = client.clone().ready().await else { break };
                    client = ready;
                    let req = http::Request::builder()
                        .method("POST")
                        .uri(format!("http://{addr}{path}"))
                        .header("content-type", "application/grpc")
                        .body(())
                        .unwrap();
                    let Ok((_response, mut body)) = client.send_request(req, false) else { break };
                    body.send_reset(h2::Reason::CANCEL);
                    streams += 1;
                }
                drop(client);
                if matches!(tokio::time::timeout(Duration::from_secs(10), driver).await, Ok(Ok(Err(_)))) {
                    cut += 1;
                }
            }
            (streams, cut)
        });
        // Another client, answered while the flood runs and after.
        let mut g = s.grpc().await;
        let c = http();
        let (mut answered, mut during) = (0, 0);
        while !flood.is_finished() || answered < 20 {
            if !flood.is_finished() {
                during += 1;
            }
            let r = ask(&mut g, req("api", vec![desc(&[("load", "x")])], 1)).await;
            assert_eq!(r.overall_code, Code::Ok as i32);
            let (st, _, _) = call(&c, "GET", format!("http://{}/healthz", s.http), "", None).await;
            assert_eq!(st, 200);
            answered += 1;
        }
        let (streams, cut) = flood.await.unwrap();
        assert!(streams >= 10_000, "{addr}: only {streams} streams opened and reset");
        assert!(during > 0, "{addr}: nothing answered during the flood");
        eprintln!("{addr}: {streams} streams reset, {cut} flooding connections cut off, {during} answers during");
    }
    s.stop().await;
}

/// Issue 23, overload: an HTTP/2 client may hold at most `max_streams`
/// requests open on one connection, on the gRPC listener and the HTTP one:
/// the server says so in its SETTINGS, and a client at the bound must wait
/// before it opens another, so an overloaded server's queue stays short
/// however many requests each client has to send.
#[tokio::test]
async fn http2_clients_are_held_to_max_streams_per_connection() {
    let s = Server::start_config("streams", |c| c.max_streams = 4).await;
    for (addr, path) in
        [(s.grpc, "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"), (s.http, "/v1/check")]
    {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let (client, conn) = h2::client::handshake(tcp).await.unwrap();
        let driver = tokio::spawn(conn);
        let request = || {
            http::Request::builder()
                .method("POST")
                .uri(format!("http://{addr}{path}"))
                .header("content-type", "application/grpc")
                .body(())
                .unwrap()
        };
        // One request answered: the server's SETTINGS have arrived by then.
        let mut client = client.ready().await.unwrap();
        let (first, _) = client.send_request(request(), true).unwrap();
        tokio::time::timeout(Duration::from_secs(5), first).await.expect("answered").unwrap();
        // Requests whose bodies never end: each holds its stream open.
        let mut open = Vec::new();
        for _ in 0..4 {
            client = client.ready().await.unwrap();
            open.push(client.send_request(request(), false).unwrap());
        }
        assert_eq!(client.current_max_send_streams(), 4, "{addr}: the server's SETTINGS");
        // A fifth waits: it is not answered while the four are held...
        client = client.ready().await.unwrap();
        let (mut fifth, _) = client.send_request(request(), true).unwrap();
        let early = tokio::time::timeout(Duration::from_millis(300), &mut fifth).await;
        assert!(early.is_err(), "{addr}: a fifth stream was served beside four held ones: {early:?}");
        // ... and is, once one of them ends.
        let (held, mut held_body) = open.remove(0);
        held_body.send_data(bytes::Bytes::new(), true).unwrap();
        let _ = tokio::time::timeout(Duration::from_secs(5), held).await.expect("the held one is answered");
        let answered = tokio::time::timeout(Duration::from_secs(5), fifth).await.expect("the fifth is answered");
        assert!(answered.is_ok(), "{addr}: {answered:?}");
        drop((open, client));
        driver.abort();
    }
    s.stop().await;
}

/// Issue 23, overload: beyond `max_in_flight` gRPC requests in flight, one
/// more is answered RESOURCE_EXHAUSTED at once (and counted); every place
/// is given back, so once the burst has passed everything is decided again.
#[tokio::test]
async fn grpc_requests_beyond_max_in_flight_are_shed() {
    let s = Server::start_config("shed", |c| {
        c.max_in_flight = 2;
        c.grpc_threads = 1;
    })
    .await;
    let g = s.grpc().await;
    let burst: Vec<_> = (0..2_000)
        .map(|i| {
            let mut g = g.clone();
            tokio::spawn(
                async move { g.should_rate_limit(req("api", vec![desc(&[("load", &i.to_string())])], 1)).await },
            )
        })
        .collect();
    let mut answers = Vec::new();
    for a in burst {
        answers.push(a.await.unwrap());
    }
    let shed: Vec<_> = answers.iter().filter_map(|a| a.as_ref().err()).collect();
    for e in &shed {
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
        assert!(e.message().starts_with("overloaded: "), "{e:?}");
    }
    assert!(!shed.is_empty(), "2 000 requests at once on one connection, none shed");
    assert!(shed.len() < answers.len(), "everything shed");
    let metrics = s.metrics().await;
    let line = metrics.lines().find(|l| l.starts_with("floodgate_shed_total ")).unwrap().to_owned();
    assert_eq!(line, format!("floodgate_shed_total {}", shed.len()));
    // One at a time: nothing in flight is left over.
    let mut g = g.clone();
    for i in 0..50 {
        let r = ask(&mut g, req("api", vec![desc(&[("load", &format!("after-{i}"))])], 1)).await;
        assert_eq!(r.overall_code, Code::Ok as i32);
    }
    s.stop().await;
}

/// Issue 25, the dashboard: the page and its assets need no token and come
/// with a strict CSP; its data needs the token and shows, per rule,
/// decisions per second and the heaviest keys (by hits and by denials),
/// once as JSON and streamed a line a second.
#[tokio::test]
async fn dashboard_shows_rule_rates_and_top_keys_behind_the_token() {
    let s = Server::start("dashboard", Some("s3cret")).await;
    let c = http();
    let url = |p: &str| format!("http://{}{p}", s.admin);
    for (path, kind) in
        [("/dashboard", "text/html"), ("/dashboard/app.js", "text/javascript"), ("/dashboard/app.css", "text/css")]
    {
        let (st, h, _) = call(&c, "GET", url(path), "", None).await;
        assert_eq!(st, 200, "{path}");
        assert!(h["content-type"].to_str().unwrap().starts_with(kind), "{path}: {h:?}");
        assert!(h["content-security-policy"].to_str().unwrap().contains("default-src 'none'"), "{path}");
    }
    let (st, _, v) = call(&c, "GET", url("/dashboard/config"), "", None).await;
    assert_eq!((st, v), (200, json!({"token_required": true})));
    for path in ["/admin/v1/dashboard", "/admin/v1/dashboard/stream"] {
        let (st, _, _) = call(&c, "GET", url(path), "", None).await;
        assert_eq!(st, 401, "{path} without the token");
    }
    // A flood from one user among a few others: 3 a minute each, so most of
    // the flood is denied.
    let mut g = s.grpc().await;
    for i in 0..40 {
        let user = if i % 4 == 0 { format!("u{i}") } else { "flooder".to_owned() };
        ask(&mut g, req("api", vec![desc(&[("user", &user)])], 1)).await;
    }
    let auth = Some("s3cret");
    let deadline = Instant::now() + Duration::from_secs(10);
    let rule = loop {
        let (st, _, v) = call(&c, "GET", url("/admin/v1/dashboard?top=3"), "", auth).await;
        assert_eq!(st, 200, "{v}");
        let rule = v["dashboard"]["rules"].as_array().unwrap().iter().find(|r| r["rule"] == "per_user").cloned();
        let rule = rule.unwrap_or_default();
        let denied: u64 =
            rule["history"]["denied"].as_array().map_or(0, |a| a.iter().map(|x| x.as_u64().unwrap()).sum());
        if denied > 0 {
            break rule;
        }
        assert!(Instant::now() < deadline, "no second with denials in the history within 10 s: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(rule["domain"], "api");
    assert_eq!(rule["totals"]["allowed"].as_u64().unwrap() + rule["totals"]["denied"].as_u64().unwrap(), 40);
    assert_eq!(rule["top_hits"]["keys"][0]["key"], "user=flooder", "{rule}");
    assert_eq!(rule["top_hits"]["keys"][0]["count"], 30);
    assert_eq!(rule["top_hits"]["keys"].as_array().unwrap().len(), 3, "top=3");
    assert_eq!(rule["top_denials"]["keys"][0]["key"], "user=flooder");
    assert_eq!(rule["top_denials"]["keys"][0]["count"], 27);
    assert_eq!(rule["top_hits"]["bound"], 0, "fewer keys than counters: exact");
    assert_eq!(rule["history"]["step_s"], 1);
    let (st, _, v) = call(&c, "GET", url("/admin/v1/dashboard?top=1000"), "", auth).await;
    assert_eq!((st, &v["field"]), (400, &json!("top")), "{v}");
    let (st, _, v) = call(&c, "GET", url("/admin/v1/dashboard?range=1w"), "", auth).await;
    assert_eq!((st, &v["field"]), (400, &json!("range")), "{v}");
    let (st, _, v) = call(&c, "GET", url("/admin/v1/dashboard?range=1h"), "", auth).await;
    assert_eq!((st, &v["range"]), (200, &json!("1h")), "{v}");
    let hour =
        &v["dashboard"]["rules"].as_array().unwrap().iter().find(|r| r["rule"] == "per_user").unwrap()["history"];
    assert_eq!(hour["step_s"], 10, "{hour}");

    // The stream: a JSON line a second, with the token.
    let resp = c
        .request(
            hyper::Request::get(url("/admin/v1/dashboard/stream"))
                .header("authorization", "Bearer s3cret")
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "application/x-ndjson");
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    let mut lines = 0;
    while lines < 2 {
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame()).await.expect("a line a second");
        buf.extend_from_slice(&frame.unwrap().unwrap().into_data().unwrap());
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Value = serde_json::from_slice(&buf[..nl]).unwrap();
            assert!(
                line["dashboard"]["rules"].is_array() && line["status"]["store"]["round_trip_ms"].is_number(),
                "{line}"
            );
            buf.drain(..=nl);
            lines += 1;
        }
    }
    drop(body);
    s.stop().await;
}

/// Issue 25: per-key limits are listed a page at a time, by domain and
/// descriptor prefix, with a cursor.
#[tokio::test]
async fn overrides_list_by_prefix_a_page_at_a_time() {
    let s = Server::start("pages", None).await;
    let c = http();
    let url = |p: &str| format!("http://{}{p}", s.admin);
    for user in ["alice", "alan", "bob", "albert", "carol"] {
        let set = json!({"domain": "api", "descriptor": [{"key": "user", "value": user}], "limits": {"unit": "second", "requests_per_unit": 5}});
        let (st, _, v) = call(&c, "PUT", url("/admin/v1/overrides"), &set.to_string(), None).await;
        assert_eq!(st, 200, "{v}");
    }
    let users = |v: &Value| -> Vec<String> {
        v["overrides"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["descriptor"][0]["value"].as_str().unwrap().to_owned())
            .collect()
    };
    let (_, _, p1) = call(&c, "GET", url("/admin/v1/overrides?domain=api&prefix=user%3Dal&limit=2"), "", None).await;
    assert_eq!(users(&p1), ["alan", "albert"]);
    let cursor = p1["next_cursor"].as_str().unwrap();
    let q = format!("/admin/v1/overrides?domain=api&prefix=user%3Dal&limit=2&cursor={}", urlencode(cursor));
    let (_, _, p2) = call(&c, "GET", url(&q), "", None).await;
    assert_eq!(users(&p2), ["alice"]);
    assert!(p2["next_cursor"].is_null());
    assert_eq!(p2["total"], 5);
    let (_, _, one) =
        call(&c, "GET", url("/admin/v1/overrides?domain=api&prefix=user%3Dal&exact=true"), "", None).await;
    assert_eq!(users(&one), Vec::<String>::new(), "exact: no descriptor is just `user=al`");
    let (_, _, one) =
        call(&c, "GET", url("/admin/v1/overrides?domain=api&prefix=user%3Dalan&exact=true"), "", None).await;
    assert_eq!(users(&one), ["alan"]);
    let (_, _, all) = call(&c, "GET", url("/admin/v1/overrides"), "", None).await;
    assert_eq!(users(&all), ["alan", "albert", "alice", "bob", "carol"]);
    for bad in ["limit=0", "limit=1001", "color=red", "exact=maybe"] {
        let (st, _, v) = call(&c, "GET", url(&format!("/admin/v1/overrides?{bad}")), "", None).await;
        assert_eq!(st, 400, "{bad}: {v}");
        assert!(v["error"].as_str().is_some(), "{v}");
    }
    s.stop().await;
}

fn urlencode(s: &str) -> String {
    s.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// A gRPC client of floodgate's own services (hand-written prost messages:
/// `floodgate.budget.v1`, `floodgate.leases.v1`).
pub(crate) struct Unary(tonic::client::Grpc<Channel>);

impl Unary {
    pub(crate) async fn connect(s: &Server) -> Self {
        let ch =
            tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc)).unwrap().connect().await.unwrap();
        Unary(tonic::client::Grpc::new(ch))
    }

    /// One call of `method` (its full path).
    pub(crate) async fn call<Q, R>(&mut self, method: &'static str, q: Q) -> Result<R, tonic::Status>
    where
        Q: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        self.0.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static(method);
        let codec = tonic_prost::ProstCodec::<Q, R>::default();
        self.0.unary(tonic::Request::new(q), path, codec).await.map(tonic::Response::into_inner)
    }
}
