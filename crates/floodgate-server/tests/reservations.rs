//! Reservations through the service (issue 47): reserve an estimate,
//! settle the actual amount, cancel; over HTTP (`/v1/reserve`,
//! `/v1/settle`, `/v1/cancel`) and gRPC (`floodgate.budget.v1.Budget`).
//! What a settle does to each algorithm's counter is checked against the
//! reference models in floodgate-core and per store in floodgate-redis;
//! these check the wiring and the pinned rules: the excess charged late,
//! the rest returned, a late settle after expiry returns nothing, a settle
//! once (the same again answers the first result, another is a conflict),
//! several dimensions all or nothing.

use floodgate_server::protocol::budget_grpc::{
    CancelRequest, Entry, PbDescriptor, ReserveRequest, ReserveResponse, SettleRequest, SettleResponse,
};
use serde_json::{Value, json};

use crate::server::{Server, Unary, call, http};

/// Token budgets per tenant, in three dimensions, and a short ttl.
const RULES: &str = r#"
domain: llm
descriptors:
  - key: tenant
    descriptors:
      - key: usage
        value: input
        rate_limit: {unit: hour, requests_per_unit: 1000, name: input_tokens}
      - key: usage
        value: output
        rate_limit: {unit: hour, requests_per_unit: 2000, name: output_tokens}
      - key: usage
        value: usd_micros
        rate_limit: {algorithm: sliding_window, unit: day, requests_per_unit: 5000000, name: spend}
  - key: short
    rate_limit: {unit: hour, requests_per_unit: 100, reservation_ttl: 1s}
"#;

async fn server(name: &str) -> Server {
    Server::start_config(name, |c| {
        if let floodgate_server::rules::reload::RulesSource::Dir(dir) = &c.rules {
            std::fs::write(dir.join("llm.yaml"), RULES).unwrap();
        }
    })
    .await
}

struct Api {
    h: crate::server::Http,
    base: String,
}

impl Api {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let (st, _, v) = call(&self.h, "POST", format!("{}{path}", self.base), &body.to_string(), None).await;
        (st, v)
    }

    /// Reserve `hits` (one for all, or one per descriptor). (`json!` sorts
    /// keys: "tenant" comes before "usage", the order the rules match.)
    async fn reserve(&self, descriptors: Value, hits: Value) -> (u16, Value) {
        self.post("/v1/reserve", json!({"domain": "llm", "descriptors": descriptors, "hits": hits})).await
    }

    async fn settle(&self, id: &Value, actual: Value) -> (u16, Value) {
        self.post("/v1/settle", json!({"reservation": id, "actual": actual})).await
    }

    /// What remains of tenant `t`'s dimension, by a reserve of 0 cancelled.
    async fn remaining(&self, t: &str, dim: &str) -> u64 {
        let (st, v) = self.reserve(json!([{"tenant": t, "usage": dim}]), json!(0)).await;
        assert_eq!(st, 200, "{v}");
        let left = v["descriptors"][0]["remaining"].as_u64().unwrap();
        let (st, _) = self.post("/v1/cancel", json!({"reservation": v["reservation"]})).await;
        assert_eq!(st, 200);
        left
    }
}

async fn reservations_over_http(s: &Server) {
    let api = Api { h: http(), base: format!("http://{}", s.http) };
    let input = |t: &str| json!([{"tenant": t, "usage": "input"}]);

    // Reserve 400 of 1000: allowed, with an id and the rule's ttl.
    let (st, v) = api.reserve(input("a"), json!(400)).await;
    assert_eq!((st, &v["allowed"], &v["descriptors"][0]["remaining"]), (200, &json!(true), &json!(600)), "{v}");
    assert_eq!(v["reservation_ttl_ms"], json!(300_000), "the default ttl: 5 minutes");
    let id = v["reservation"].clone();
    assert_eq!(id.as_str().map(str::len), Some(32), "{v}");

    // Settle at 250: 150 returned as never taken.
    let (st, v) = api.settle(&id, json!(250)).await;
    assert_eq!(st, 200, "{v}");
    let part = &v["limits"][0];
    assert_eq!((&part["returned"], &part["charged_late"], &part["remaining"]), (&json!(150), &json!(0), &json!(750)));
    assert_eq!(v["again"], json!(false));
    // The same settle again answers the first result, and does nothing.
    let (st, again) = api.settle(&id, json!(250)).await;
    assert_eq!((st, &again["again"], &again["limits"]), (200, &json!(true), &v["limits"]));
    assert_eq!(api.remaining("a", "input").await, 750);
    // Another amount: a conflict.
    let (st, v) = api.settle(&id, json!(300)).await;
    assert_eq!((st, &v["field"]), (409, &json!("actual")), "{v}");

    // Settle above the estimate: the excess is charged late, into debt.
    let (_, v) = api.reserve(input("a"), json!(700)).await;
    assert_eq!(v["descriptors"][0]["remaining"], json!(50));
    let (_, v) = api.settle(&v["reservation"], json!(900)).await;
    assert_eq!((&v["limits"][0]["charged_late"], &v["limits"][0]["remaining"]), (&json!(200), &json!(0)), "{v}");
    // 1150 of 1000 used: an estimate that does not fit is denied, keeps nothing.
    let (st, v) = api.reserve(input("a"), json!(1)).await;
    assert_eq!((st, &v["allowed"], &v["reservation"]), (200, &json!(false), &Value::Null), "{v}");
    assert!(v["retry_after_ms"].as_u64().unwrap() > 0, "{v}");

    // Cancel: the whole estimate back.
    let (_, v) = api.reserve(input("b"), json!(300)).await;
    let (st, v) = api.post("/v1/cancel", json!({"reservation": v["reservation"]})).await;
    assert_eq!((st, &v["limits"][0]["returned"]), (200, &json!(300)), "{v}");
    assert_eq!(api.remaining("b", "input").await, 1000);

    // Several dimensions at once, each its own estimate, all or nothing:
    // the output estimate does not fit, so nothing is reserved anywhere.
    let dims = json!([{"tenant": "c", "usage": "input"}, {"tenant": "c", "usage": "output"}, {"tenant": "c", "usage": "usd_micros"}]);
    let (_, v) = api.reserve(dims.clone(), json!([500, 2500, 30_000])).await;
    assert_eq!((&v["allowed"], &v["reservation"]), (&json!(false), &Value::Null), "{v}");
    assert_eq!(api.remaining("c", "input").await, 1000, "a denied reserve takes nothing");
    let (_, v) = api.reserve(dims, json!([500, 1500, 30_000])).await;
    assert_eq!(v["allowed"], json!(true), "{v}");
    // Settled per dimension, in the reserve's order.
    let (_, v) = api.settle(&v["reservation"], json!([320, 1700, 21_000])).await;
    let got: Vec<(u64, u64, u64)> = v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (p["charged_late"].as_u64().unwrap(), p["returned"].as_u64().unwrap(), p["remaining"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(got, [(0, 180, 680), (200, 0, 300), (0, 9_000, 4_979_000)], "{v}");
    // One amount for three limits is one for each; two is an error.
    let (_, v) =
        api.reserve(json!([{"tenant": "d", "usage": "input"}, {"tenant": "d", "usage": "output"}]), json!(10)).await;
    let (st, e) = api.settle(&v["reservation"], json!([1, 2, 3])).await;
    assert_eq!((st, &e["field"]), (400, &json!("actual")), "{e}");

    // A reservation that outlived its ttl kept its estimate: a settle
    // below it returns nothing; one above it is still charged.
    let short = json!([{"short": "x"}]);
    let (_, low) = api.reserve(short.clone(), json!(40)).await;
    let (_, high) = api.reserve(short, json!(10)).await;
    assert_eq!(high["reservation_ttl_ms"], json!(1000));
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let (_, v) = api.settle(&low["reservation"], json!(5)).await;
    assert_eq!((&v["limits"][0]["returned"], &v["limits"][0]["expired"]), (&json!(0), &json!(true)), "{v}");
    let (_, v) = api.settle(&high["reservation"], json!(25)).await;
    assert_eq!((&v["limits"][0]["charged_late"], &v["limits"][0]["remaining"]), (&json!(15), &json!(35)), "{v}");

    // Bad input: an unknown id, a malformed one, a refund in a reserve.
    let (st, v) = api.settle(&json!("0123456789abcdef0123456789abcdef"), json!(1)).await;
    assert_eq!((st, &v["field"]), (404, &json!("reservation")), "{v}");
    let (st, v) = api.settle(&json!("nope"), json!(1)).await;
    assert_eq!((st, &v["field"]), (400, &json!("reservation")), "{v}");
    let (st, v) = api.reserve(input("a"), json!(-1)).await;
    assert_eq!((st, &v["field"]), (400, &json!("hits")), "{v}");

    // Counted.
    let (_, _, m) = call(&api.h, "GET", format!("{}/metrics", api.base), "", None).await;
    let m = m.as_str().unwrap_or_default().to_owned();
    for line in [
        "floodgate_settles_total{result=\"again\"} 1",
        "floodgate_settles_total{result=\"conflict\"} 1",
        "floodgate_settles_total{result=\"unknown\"} 1",
    ] {
        assert!(m.lines().any(|l| l == line), "{line} not in\n{m}");
    }
}

/// A gRPC client of `floodgate.budget.v1.Budget` (hand-written messages).
struct Budget(Unary);

impl Budget {
    async fn connect(s: &Server) -> Self {
        Budget(Unary::connect(s).await)
    }

    async fn unary<Q, R>(&mut self, method: &'static str, q: Q) -> Result<R, tonic::Status>
    where
        Q: prost::Message + Send + Sync + 'static,
        R: prost::Message + Default + Send + Sync + 'static,
    {
        self.0.call(method, q).await
    }

    async fn reserve(&mut self, tenant: &str, hits: u64) -> ReserveResponse {
        let d = PbDescriptor {
            entries: [("tenant", tenant), ("usage", "input")]
                .iter()
                .map(|(k, v)| Entry { key: (*k).into(), value: (*v).into() })
                .collect(),
            hits: None,
        };
        let q = ReserveRequest { domain: "llm".into(), descriptors: vec![d], hits };
        self.unary("/floodgate.budget.v1.Budget/Reserve", q).await.unwrap()
    }

    async fn settle(&mut self, id: &str, actual: Vec<u64>) -> Result<SettleResponse, tonic::Status> {
        self.unary("/floodgate.budget.v1.Budget/Settle", SettleRequest { reservation: id.into(), actual }).await
    }
}

async fn reservations_over_grpc(s: &Server) {
    let mut c = Budget::connect(s).await;
    let r = c.reserve("g", 600).await;
    assert!(r.allowed && r.reservation.len() == 32, "{r:?}");
    assert_eq!(r.descriptors[0].remaining, 400);
    let settled = c.settle(&r.reservation, vec![650]).await.unwrap();
    assert_eq!((settled.limits[0].charged_late, settled.limits[0].remaining), (50, 350));
    assert!(c.settle(&r.reservation, vec![650]).await.unwrap().again);
    let conflict = c.settle(&r.reservation, vec![1]).await.unwrap_err();
    assert_eq!(conflict.code(), tonic::Code::FailedPrecondition, "{conflict:?}");
    let unknown = c.settle("0123456789abcdef0123456789abcdef", vec![1]).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    let bad = c.settle("zz", vec![1]).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    let none = c.settle(&r.reservation, vec![]).await.unwrap_err();
    assert_eq!(none.code(), tonic::Code::InvalidArgument);
    // Denied: no reservation.
    let r = c.reserve("g", 500).await;
    assert!(!r.allowed && r.reservation.is_empty() && r.retry_after_ms > 0, "{r:?}");
    // Cancel.
    let r = c.reserve("g", 300).await;
    let q = CancelRequest { reservation: r.reservation.clone() };
    let v: SettleResponse = c.unary("/floodgate.budget.v1.Budget/Cancel", q).await.unwrap();
    assert_eq!((v.limits[0].returned, v.limits[0].remaining), (300, 350));
}

#[tokio::test]
async fn reservations_in_memory() {
    let s = server("reservations-mem").await;
    reservations_over_http(&s).await;
    reservations_over_grpc(&s).await;
    s.stop().await;
}

async fn redis_server(name: &str, url: &str) -> Server {
    let url = url.to_owned();
    Server::start_config(name, move |c| {
        if let floodgate_server::rules::reload::RulesSource::Dir(dir) = &c.rules {
            std::fs::write(dir.join("llm.yaml"), RULES).unwrap();
        }
        c.redis = Some(floodgate_redis::RedisConfig::new(url.parse().unwrap()));
    })
    .await
}

/// A reservation lives in the region's store: made through one instance,
/// settled through another, once.
async fn settled_through_another_instance(a: &Server, b: &Server) {
    let (one, two) =
        (Api { h: http(), base: format!("http://{}", a.http) }, Api { h: http(), base: format!("http://{}", b.http) });
    let dims = json!([{"tenant": "x", "usage": "input"}, {"tenant": "x", "usage": "usd_micros"}]);
    let (_, v) = one.reserve(dims, json!([100, 5_000])).await;
    let id = v["reservation"].clone();
    assert!(id.is_string(), "{v}");
    let (st, v) = two.settle(&id, json!([40, 7_000])).await;
    assert_eq!(st, 200, "{v}");
    let got: Vec<(u64, u64, u64)> = v["limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (p["returned"].as_u64().unwrap(), p["charged_late"].as_u64().unwrap(), p["remaining"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(got, [(60, 0, 960), (0, 2_000, 4_993_000)], "{v}");
    // Once, wherever it is sent again.
    let (_, again) = one.settle(&id, json!([40, 7_000])).await;
    assert_eq!((&again["again"], &again["limits"]), (&json!(true), &v["limits"]), "{again}");
    let (st, _) = one.settle(&id, json!([41, 7_000])).await;
    assert_eq!(st, 409);
    assert_eq!(two.remaining("x", "input").await, 960);
}

#[tokio::test]
async fn reservations_on_redis() {
    let redis = floodgate_testing::RedisServer::start();
    let s = redis_server("reservations-redis", &redis.url()).await;
    let other = redis_server("reservations-redis-2", &redis.url()).await;
    reservations_over_http(&s).await;
    reservations_over_grpc(&s).await;
    settled_through_another_instance(&s, &other).await;
    s.stop().await;
    other.stop().await;
}

#[tokio::test]
async fn reservations_on_a_redis_cluster() {
    let cluster = floodgate_testing::RedisCluster::start();
    let s = redis_server("reservations-cluster", &cluster.url()).await;
    let other = redis_server("reservations-cluster-2", &cluster.url()).await;
    reservations_over_http(&s).await;
    reservations_over_grpc(&s).await;
    settled_through_another_instance(&s, &other).await;
    s.stop().await;
    other.stop().await;
}
