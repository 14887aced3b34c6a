//! The admin API calls of `floodgate keys`: HTTP/1.1 to a running server's
//! admin address, one connection kept for the whole command.

use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use crate::exit::Failure;

/// How long one call may take (an import batch of 10 000 entries included).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// A server's admin API.
pub(super) struct Admin {
    base: String,
    token: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Admin {
    /// `addr` as `host:port` or `http://host:port`.
    pub(super) fn new(addr: &str, token: Option<String>) -> Result<Self, Failure> {
        let rest = crate::cli::http_authority("admin-addr", addr, "127.0.0.1:9090")?;
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new()).build(connector);
        Ok(Self { base: format!("http://{rest}"), token, client })
    }

    /// Call `method path` with a JSON body; the status and the JSON answer.
    pub(super) async fn call(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> Result<(StatusCode, Value), Failure> {
        let mut req = Request::builder().method(method).uri(format!("{}{path}", self.base));
        if body.is_some() {
            req = req.header(CONTENT_TYPE, "application/json");
        }
        if let Some(t) = &self.token {
            req = req.header(AUTHORIZATION, format!("Bearer {t}"));
        }
        let req = req
            .body(Full::new(Bytes::from(body.unwrap_or_default())))
            .map_err(|e| Failure::usage(format!("a bad request: {e}")))?;
        let call = async {
            let resp = self.client.request(req).await.map_err(|e| {
                Failure::runtime(format!("cannot reach the admin API at {}: {e}; is the server running?", self.base))
            })?;
            let status = resp.status();
            let bytes = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| Failure::runtime(format!("the admin API's answer broke off: {e}")))?
                .to_bytes();
            let value = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
            Ok((status, value))
        };
        tokio::time::timeout(CALL_TIMEOUT, call).await.map_err(|_| {
            Failure::runtime(format!("the admin API at {} did not answer within {CALL_TIMEOUT:?}", self.base))
        })?
    }

    /// [`Admin::call`], with any status but 2xx an error saying what the
    /// server said (`what` names the call).
    pub(super) async fn ok(
        &self,
        method: Method,
        path: &str,
        body: Option<Vec<u8>>,
        what: &str,
    ) -> Result<Value, Failure> {
        let (status, value) = self.call(method, path, body).await?;
        if status.is_success() {
            return Ok(value);
        }
        let said = value.get("error").and_then(Value::as_str).map_or_else(|| value.to_string(), str::to_owned);
        let field = value.get("field").and_then(Value::as_str).filter(|f| !f.is_empty());
        let said = match field {
            Some(f) => format!("{f}: {said}"),
            None => said,
        };
        let message = format!("{what}: the server answered {status}: {said}");
        Err(if status.is_client_error() && status != StatusCode::NOT_FOUND {
            Failure::usage(message)
        } else {
            Failure::runtime(message)
        })
    }
}

/// `s` escaped for a URL query.
pub(super) fn query_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
