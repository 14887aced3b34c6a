//! A fake OpenAI-compatible upstream for tests: `POST` any path with a chat
//! completion request and it answers as the API does, with usage.
//!
//! * `"stream": true`: an event stream of `completion` one-token chunks, then
//!   (only when the request asks with `stream_options.include_usage`) the
//!   usage chunk, then `data: [DONE]`; otherwise one JSON body with `usage`.
//! * Usage: `prompt_tokens` from the request header `x-fake-prompt`
//!   (default 10), `completion_tokens` from `x-fake-completion` (default 20).
//! * `x-fake: slow`: 20 ms between chunks; `x-fake: cut`: the connection is
//!   closed half-way through the stream (or the body); `x-fake: error`: `500`
//!   with an OpenAI-style error body and no usage; `x-fake: no-usage`: a
//!   JSON body without usage.
//!
//! Each connection is a thread (keep-alive); every request body is kept for
//! the test to read ([`FakeOpenAi::bodies`]).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The running fake; stopped when dropped.
pub struct FakeOpenAi {
    /// Where it listens.
    pub addr: SocketAddr,
    bodies: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
}

impl FakeOpenAi {
    /// Start on a free loopback port.
    pub fn start() -> FakeOpenAi {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the fake upstream");
        let addr = listener.local_addr().expect("its address");
        let bodies = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let (b, s) = (Arc::clone(&bodies), Arc::clone(&stop));
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let b = Arc::clone(&b);
                std::thread::spawn(move || serve(conn, &b));
            }
        });
        FakeOpenAi { addr, bodies, stop }
    }

    /// `http://<addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The request bodies received so far, in order.
    pub fn bodies(&self) -> Vec<String> {
        self.bodies.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl Drop for FakeOpenAi {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop.
        let _ = TcpStream::connect(self.addr);
    }
}

/// One request as read.
struct Req {
    headers: Vec<(String, String)>,
    body: String,
}

impl Req {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    fn number(&self, name: &str, default: u64) -> u64 {
        self.header(name).and_then(|v| v.parse().ok()).unwrap_or(default)
    }
}

fn serve(conn: TcpStream, bodies: &Mutex<Vec<String>>) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(mut out) = conn.try_clone() else { return };
    let mut r = BufReader::new(conn);
    while let Some(req) = read_request(&mut r) {
        bodies.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(req.body.clone());
        if respond(&req, &mut out).is_err() {
            return;
        }
    }
}

fn read_request(r: &mut BufReader<TcpStream>) -> Option<Req> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (n, v) = h.split_once(':')?;
        headers.push((n.trim().to_owned(), v.trim().to_owned()));
    }
    let mut req = Req { headers, body: String::new() };
    let mut body = Vec::new();
    if let Some(len) = req.header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(len, 0);
        r.read_exact(&mut body).ok()?;
    } else if req.header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).ok()?;
            let size = usize::from_str_radix(size.trim(), 16).ok()?;
            let mut chunk = vec![0; size + 2];
            r.read_exact(&mut chunk).ok()?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    req.body = String::from_utf8_lossy(&body).into_owned();
    Some(req)
}

fn respond(req: &Req, out: &mut TcpStream) -> std::io::Result<()> {
    let json: serde_like::Json = serde_like::Json(&req.body);
    let (prompt, completion) = (req.number("x-fake-prompt", 10), req.number("x-fake-completion", 20));
    let usage = format!(
        "{{\"prompt_tokens\":{prompt},\"completion_tokens\":{completion},\"total_tokens\":{}}}",
        prompt + completion
    );
    let mode = req.header("x-fake").unwrap_or("");
    if mode == "error" {
        let body = r#"{"error":{"message":"the fake upstream failed","type":"server_error"}}"#;
        return write!(
            out,
            "HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
    }
    if !json.is_true("stream") {
        let usage = if mode == "no-usage" { String::new() } else { format!(",\"usage\":{usage}") };
        let body = format!(
            "{{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion\",\"choices\":[{{\"index\":0,\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}},\"finish_reason\":\"stop\"}}]{usage}}}",
            "tok ".repeat(usize::try_from(completion).unwrap_or(0))
        );
        if mode == "cut" {
            write!(out, "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n", body.len())?;
            out.write_all(&body.as_bytes()[..body.len() / 2])?;
            return Err(std::io::Error::other("cut"));
        }
        return write!(
            out,
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        );
    }
    out.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")?;
    let chunk = |out: &mut TcpStream, data: &str| -> std::io::Result<()> {
        let event = format!("data: {data}\n\n");
        write!(out, "{:x}\r\n{event}\r\n", event.len())?;
        out.flush()
    };
    for i in 0..completion {
        if mode == "cut" && i == completion / 2 {
            return Err(std::io::Error::other("cut"));
        }
        if mode == "slow" {
            std::thread::sleep(Duration::from_millis(20));
        }
        chunk(
            out,
            r#"{"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok "}}]}"#,
        )?;
    }
    if json.is_true("include_usage") {
        chunk(
            out,
            &format!("{{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{usage}}}"),
        )?;
    }
    chunk(out, "[DONE]")?;
    out.write_all(b"0\r\n\r\n")?;
    out.flush()
}

/// Just enough JSON reading for the fake (no dependency): whether
/// `"name": true` appears.
mod serde_like {
    pub(super) struct Json<'a>(pub(super) &'a str);

    impl Json<'_> {
        pub(super) fn is_true(&self, name: &str) -> bool {
            let key = format!("\"{name}\"");
            let mut rest = self.0;
            while let Some(at) = rest.find(&key) {
                rest = &rest[at + key.len()..];
                let after = rest.trim_start().strip_prefix(':').map(str::trim_start);
                if after.is_some_and(|a| a.starts_with("true")) {
                    return true;
                }
            }
            false
        }
    }
}
