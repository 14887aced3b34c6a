//! A WebDriver client for the browser tests: headless Chromium driven by
//! Debian's `chromedriver` over the W3C WebDriver protocol (JSON over
//! HTTP/1.1 on loopback), the few calls the tests make and nothing else.
//! `scripts/test` installs `chromium` and `chromium-driver` when missing.

#![allow(unreachable_pub)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// A running chromedriver with one headless Chromium session.
pub struct Browser {
    driver: Child,
    addr: String,
    session: String,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn which(names: &[&str]) -> Option<String> {
    names.iter().find_map(|n| {
        std::env::var_os("PATH")?
            .to_str()?
            .split(':')
            .map(|d| format!("{d}/{n}"))
            .find(|p| std::path::Path::new(p).is_file())
    })
}

/// One WebDriver call: the `value` of its JSON answer, or the error's
/// message.
fn call(addr: &str, method: &str, path: &str, body: Option<&Value>) -> Result<Value, String> {
    let mut s = TcpStream::connect(addr).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let body = body.map(Value::to_string).unwrap_or_default();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    // chromedriver keeps the connection open: read the head, then as many
    // bytes as it says.
    let mut raw = Vec::new();
    let mut chunk = [0u8; 64 * 1024];
    let (head_end, length) = loop {
        let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("chromedriver closed the connection".into());
        }
        raw.extend_from_slice(&chunk[..n]);
        if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
            let length = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .ok_or("no Content-Length")?;
            break (end + 4, length);
        }
    };
    while raw.len() < head_end + length {
        let n = s.read(&mut chunk).map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("chromedriver closed the connection mid-answer".into());
        }
        raw.extend_from_slice(&chunk[..n]);
    }
    let json = String::from_utf8_lossy(&raw[head_end..head_end + length]).into_owned();
    let v: Value = serde_json::from_str(&json).map_err(|e| format!("{e}: {json}"))?;
    match v["value"].get("error") {
        Some(e) => Err(format!("{e}: {}", v["value"]["message"])),
        None => Ok(v["value"].clone()),
    }
}

impl Browser {
    /// Start chromedriver and a headless Chromium `width` x `height`.
    pub fn start(width: u32, height: u32) -> Browser {
        let driver_bin = which(&["chromedriver"]).expect(
            "chromedriver not found: the browser tests need Debian's chromium and chromium-driver (scripts/test installs them)",
        );
        let chromium = which(&["chromium", "chromium-browser", "google-chrome"]).expect("chromium not found");
        let port = free_port();
        let driver = Command::new(driver_bin)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let addr = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(20);
        while call(&addr, "GET", "/status", None).map(|v| v["ready"] != json!(true)).unwrap_or(true) {
            assert!(Instant::now() < deadline, "chromedriver did not start within 20 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        let caps = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--hide-scrollbars", format!("--window-size={width},{height}")],
            },
            "goog:loggingPrefs": {"browser": "ALL"},
        }}});
        let mut b = Browser { driver, addr, session: String::new() };
        let v = b.post("/session", &caps).expect("a Chromium session");
        b.session = v["sessionId"].as_str().unwrap().to_owned();
        b
    }

    fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        call(&self.addr, "POST", path, Some(body))
    }

    fn session_path(&self, rest: &str) -> String {
        format!("/session/{}{rest}", self.session)
    }

    /// Load `url` (waits for the page's load event).
    pub fn goto(&self, url: &str) {
        self.post(&self.session_path("/url"), &json!({ "url": url })).unwrap();
    }

    /// Run `script` (a function body; `arguments` are `args`) in the page.
    pub fn run(&self, script: &str, args: Value) -> Value {
        self.post(&self.session_path("/execute/sync"), &json!({ "script": script, "args": args }))
            .unwrap_or_else(|e| panic!("script failed: {e}\n{script}"))
    }

    /// Poll `script` until it returns something truthy (that value), or
    /// fail after `secs` with `what` and its last answer.
    pub fn wait_for(&self, what: &str, secs: u64, script: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let v = self.run(script, json!([]));
            if !(v.is_null() || v == json!(false) || v == json!(0) || v == json!("")) {
                return v;
            }
            assert!(Instant::now() < deadline, "not within {secs} s: {what} (last: {v})");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The browser's console messages so far at `SEVERE` (errors).
    pub fn console_errors(&self) -> Vec<String> {
        let log = call(&self.addr, "POST", &self.session_path("/se/log"), Some(&json!({"type": "browser"})))
            .expect("chromedriver's browser log");
        log.as_array()
            .into_iter()
            .flatten()
            .filter(|e| e["level"] == "SEVERE")
            .map(|e| e["message"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    /// Make the window `width` x `height`.
    pub fn resize(&self, width: u32, height: u32) {
        self.post(&self.session_path("/window/rect"), &json!({ "width": width, "height": height })).unwrap();
    }

    /// A PNG of the window.
    pub fn screenshot(&self) -> Vec<u8> {
        let v = call(&self.addr, "GET", &self.session_path("/screenshot"), None).unwrap();
        base64(v.as_str().unwrap())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = call(&self.addr, "DELETE", &self.session_path(""), None);
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

/// Standard base64 (WebDriver's screenshots).
fn base64(text: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0);
    for v in text.bytes().filter_map(value) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}
