//! Running the `floodgate` binary in tests: one command, or a live
//! `floodgate serve` on free ports.

#![allow(dead_code, unreachable_pub)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use floodgate_testing::TempDir;

/// The binary, with no `FLOODGATE_*` settings from the environment (tests
/// set everything with flags).
pub fn floodgate() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_floodgate"));
    for (k, _) in std::env::vars() {
        if k.starts_with("FLOODGATE_") {
            c.env_remove(k);
        }
    }
    c
}

/// An address that refuses connections for as long as the returned socket
/// lives: bound but not listening, so no other test (or process) can be
/// given the port meanwhile. A port taken from a dropped listener can be
/// handed to the next server a parallel test starts, which then answers.
pub fn refusing_addr() -> (tokio::net::TcpSocket, String) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = socket.local_addr().unwrap().to_string();
    (socket, addr)
}

/// Run to the end: (exit code, stdout, stderr).
pub fn run(args: &[&str]) -> (Option<i32>, String, String) {
    let Output { status, stdout, stderr } = floodgate().args(args).output().unwrap();
    (status.code(), String::from_utf8_lossy(&stdout).into_owned(), String::from_utf8_lossy(&stderr).into_owned())
}

/// `floodgate bench --json --warmup 0s --connections 2` against `server`
/// over `protocol` with `args` more; it must exit 0. Its report.
pub fn bench(server: &str, protocol: &str, args: &[&str]) -> Value {
    let mut all = vec!["bench", "--json", "--warmup", "0s", "--connections", "2"];
    all.extend_from_slice(&["--server", server, "--protocol", protocol]);
    all.extend_from_slice(args);
    let (code, out, err) = run(&all);
    assert_eq!(code, Some(0), "{err}");
    serde_json::from_str(&out).unwrap()
}

/// A running `floodgate serve` on free ports, its addresses read from its
/// log; killed on drop.
pub struct Served {
    child: Child,
    pub grpc: String,
    pub http: String,
    pub admin: String,
    /// The proxy's address (`floodgate proxy` only).
    pub proxy: String,
    log: Arc<Mutex<Vec<String>>>,
    _dir: TempDir,
}

impl Served {
    /// Serve `rules` (YAML documents separated by `---` lines, one file
    /// each) with an overrides file of its own, plus `args`.
    pub fn start(name: &str, rules: &str, args: &[&str]) -> Served {
        Self::launch(name, rules, &["serve", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"], args)
    }

    /// `floodgate proxy` in front of `upstream` on free ports (with the
    /// HTTP API on for metrics), the rules as for [`Served::start`].
    pub fn proxy(name: &str, rules: &str, upstream: &str, args: &[&str]) -> Served {
        let head = ["proxy", "--listen", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--upstream", upstream];
        Self::launch(name, rules, &head, args)
    }

    fn launch(name: &str, rules: &str, head: &[&str], args: &[&str]) -> Served {
        let dir = TempDir::new(name);
        for (i, doc) in rules.split("---\n").enumerate() {
            dir.write(&format!("rules/{i}.yaml"), doc);
        }
        let mut cmd = floodgate();
        cmd.args(head)
            .args(["--log-format", "json", "--admin-addr", "127.0.0.1:0", "--config"])
            .arg(dir.0.join("rules"))
            .arg("--overrides-file")
            .arg(dir.0.join("overrides.redb"))
            .args(args);
        Self::spawn(cmd, dir)
    }

    /// Run `cmd` (a `serve` or `proxy` command logging JSON) until it logs
    /// that it is serving; `dir` lives as long as it does.
    pub fn spawn(mut cmd: Command, dir: TempDir) -> Served {
        let mut child = cmd.stderr(Stdio::piped()).spawn().unwrap();
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let log = Arc::new(Mutex::new(Vec::new()));
        let serving = loop {
            let line = lines.next().expect("serve logs that it is serving").unwrap();
            let v: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
            log.lock().unwrap().push(line);
            if v["fields"]["message"] == "floodgate serving" {
                break v;
            }
        };
        // Keep draining the log so the server never blocks on a full pipe.
        let kept = log.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                kept.lock().unwrap().push(line);
            }
        });
        let field = |k: &str| serving["fields"][k].as_str().unwrap().to_owned();
        Served {
            grpc: field("grpc_addr"),
            http: field("http_addr"),
            admin: field("admin_addr"),
            proxy: field("proxy_addr"),
            child,
            log,
            _dir: dir,
        }
    }

    /// The rules directory it watches.
    pub fn rules_dir(&self) -> std::path::PathBuf {
        self._dir.0.join("rules")
    }

    /// The log lines (JSON) so far that contain `text`.
    pub fn logged(&self, text: &str) -> Vec<String> {
        self.log.lock().unwrap().iter().filter(|l| l.contains(text)).cloned().collect()
    }

    /// SIGTERM, then the exit code (within 10 s).
    pub fn terminate(mut self) -> Option<i32> {
        let pid = self.child.id().to_string();
        assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(Instant::now() < deadline, "serve did not stop within 10 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A plain HTTP/1.1 GET: (status, body).
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    http(addr, "GET", path, "")
}

/// A plain HTTP/1.1 request with a JSON body: (status, body).
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    let (code, _, body) = http_full(addr, method, path, body);
    (code, body)
}

/// A plain HTTP/1.1 request with a JSON body: (status, head, body).
pub fn http_full(addr: &str, method: &str, path: &str, body: &str) -> (u16, String, String) {
    http_with(addr, method, path, body, "")
}

/// [`http_full`] with `extra` header lines (each ending in `\r\n`).
pub fn http_with(addr: &str, method: &str, path: &str, body: &str, extra: &str) -> (u16, String, String) {
    use std::io::Read;
    let mut s = send(addr, method, path, body, extra);
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let code = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    (code, head.to_owned(), body.to_owned())
}

/// Send a plain HTTP/1.1 request (`Connection: close`, a JSON body, `extra`
/// header lines) on a new connection, its answer left to the caller (read
/// whole, in part, or not at all; reads time out after 5 s).
pub fn send(addr: &str, method: &str, path: &str, body: &str, extra: &str) -> std::net::TcpStream {
    use std::io::Write;
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s
}

/// Wait for `cond`, checking every 50 ms; fails the test with `what` after
/// `within`.
pub fn eventually(what: &str, within: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    while !cond() {
        assert!(Instant::now() < deadline, "not within {within:?}: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Try `n` sources at once (`admit(i)`: one request from source `i`,
/// whether it was admitted) until none has been admitted for 1.5 s (a
/// bounded key's small slices admit a few per acknowledgement round trip),
/// at most 20 s: the requests admitted.
pub fn flood(n: usize, admit: impl Fn(usize) -> bool + Sync) -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    let start = Instant::now();
    let (admitted, last_ms) = (AtomicU64::new(0), AtomicU64::new(0));
    let done = || {
        let now = start.elapsed();
        now > Duration::from_secs(20)
            || now.saturating_sub(Duration::from_millis(last_ms.load(Ordering::SeqCst))) > Duration::from_millis(1_500)
    };
    std::thread::scope(|s| {
        for i in 0..n {
            let (admitted, last_ms, done, admit) = (&admitted, &last_ms, &done, &admit);
            s.spawn(move || {
                while !done() {
                    if admit(i) {
                        admitted.fetch_add(1, Ordering::SeqCst);
                        last_ms.store(start.elapsed().as_millis() as u64, Ordering::SeqCst);
                    }
                }
            });
        }
    });
    admitted.into_inner()
}
