//! Issue 25: the dashboard in a real browser (headless Chromium through
//! chromedriver), against the real binary: it loads with no console error,
//! asks for the token, shows a rule's rate rising while `floodgate bench`
//! loads it, a flooding key at the top of its rule's list, a bad rules edit
//! with its file:line (and the fix clearing it), and an edit made through
//! the page in the admin API. It also takes the guide's screenshots (the
//! dashboard, and a `simulate --plot` picture): into `target/screenshots/`,
//! or `docs/` with `FLOODGATE_SCREENSHOTS=docs` (`scripts/screenshots`).

use crate::browser;
use crate::cli;

use std::path::PathBuf;

use browser::Browser;
use cli::{Served, floodgate, http_full, http_with};
use serde_json::{Value, json};

const TOKEN: &str = "dash-t0ken";

const RULES: &str = "domain: bench
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000000000, name: bench_users}
---
domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 5, name: api_users}
";

fn shots_dir() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = match std::env::var("FLOODGATE_SCREENSHOTS").as_deref() {
        Ok("docs") => root.join("docs"),
        _ => root.join("target/screenshots"),
    };
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn admin(s: &Served, method: &str, path: &str, body: &str) -> (u16, Value) {
    let (code, _, body) = http_with(&s.admin, method, path, body, &format!("Authorization: Bearer {TOKEN}\r\n"));
    (code, serde_json::from_str(&body).unwrap_or(Value::Null))
}

/// The value of `[data-rule=rule] .rate-allowed` (0 while absent).
fn allowed_rate(rule: &str) -> String {
    format!(
        "const e = document.querySelector('[data-rule=\"{rule}\"] .rate-allowed'); return e ? Number(e.dataset.value) : 0;"
    )
}

#[test]
fn dashboard_in_a_real_browser() {
    let s = Served::start("browser", RULES, &["--admin-token", TOKEN]);
    let b = Browser::start(1280, 1500);
    let page = format!("http://{}/dashboard", s.admin);
    b.goto(&page);

    // The page asks for the token (nothing was refused: it asked first).
    b.wait_for("the token form", 10, "return !document.getElementById('login').hidden;");
    b.run(
        "document.getElementById('token').value = arguments[0]; document.getElementById('login').requestSubmit();",
        json!([TOKEN]),
    );
    b.wait_for(
        "the live view",
        10,
        "return !document.getElementById('main').hidden && document.getElementById('live').textContent === 'live';",
    );
    b.wait_for("the loaded rules with file:line", 10, "return [...document.querySelectorAll('#loaded td.at')].some(td => /1\\.yaml:\\d+:\\d+$/.test(td.textContent));");
    // Limits in words, with thousands separators, and no burst on a fixed window.
    let limits = b.run(
        "return [...document.querySelectorAll('#loaded tbody tr')].map(tr => tr.children[3].textContent).sort();",
        json!([]),
    );
    assert_eq!(limits, json!(["1,000,000,000 per second", "5 per minute"]), "{limits}");

    // A rule's rate rises while bench loads it.
    assert_eq!(b.run(&allowed_rate("bench/bench_users"), json!([])), json!(0), "no traffic yet");
    let mut bench = floodgate()
        .args(["bench", "--server", &s.grpc, "--domain", "bench", "--key", "user", "--keys", "100"])
        .args(["--rate", "500", "--duration", "8s", "--json", "--warmup", "0s"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let rate = b.wait_for(
        "bench/bench_users' allowed rate above 100/s",
        15,
        &format!("const v = (() => {{ {} }})(); return v > 100 ? v : 0;", allowed_rate("bench/bench_users")),
    );
    assert!(rate.as_f64().unwrap() > 100.0, "{rate}");

    // A key flooding a rule tops its lists.
    for i in 0..60 {
        let user = if i % 6 == 0 { format!("other{i}") } else { "flooder".to_owned() };
        let body = json!({"domain": "api", "descriptors": [{"entries": [{"key": "user", "value": user}]}]}).to_string();
        let (code, _, _) = http_full(&s.http, "POST", "/json", &body);
        assert!(code == 200 || code == 429, "{code}");
    }
    let top = b.wait_for("user=flooder first by hits and by denials", 10, "const h = document.querySelector('[data-rule=\"api/api_users\"] .top-hits li'); const d = document.querySelector('[data-rule=\"api/api_users\"] .top-denials li'); return h && d && h.dataset.key === 'user=flooder' && d.dataset.key === 'user=flooder' && h.textContent;");
    assert!(top.as_str().unwrap().contains("— 50"), "{top}");

    let _ = bench.wait();
    std::fs::write(shots_dir().join("dashboard.png"), b.screenshot()).unwrap();

    // On a phone's width and a narrow window, nothing scrolls sideways (the
    // tables scroll in their own boxes), and no count breaks mid-digit.
    for width in [400, 820] {
        b.resize(width, 1500);
        b.wait_for(&format!("a window {width} px wide"), 10, &format!("return window.innerWidth <= {width};"));
        let wide = b.wait_for(
            &format!("the page within {width} px"),
            10,
            "const d = document.documentElement; return d.scrollWidth <= d.clientWidth ? 'fits' : d.scrollWidth;",
        );
        assert_eq!(wide, json!("fits"), "at {width} px");
        let breaking = b.run(
            "return [...document.querySelectorAll('.top li, .rule .name, dd')].filter(e => getComputedStyle(e).wordBreak === 'break-all').length;",
            json!([]),
        );
        assert_eq!(breaking, json!(0), "nothing breaks words anywhere");
    }
    b.resize(1280, 1500);

    // A bad rules edit shows its error with file:line; the fix clears it.
    let rules_file = s.rules_dir().join("1.yaml");
    let good = std::fs::read_to_string(&rules_file).unwrap();
    std::fs::write(&rules_file, good.replace("unit: minute", "unit: fortnight")).unwrap();
    let shown = b.wait_for(
        "the reload error",
        15,
        "const e = document.getElementById('reload-error'); return e && e.textContent;",
    );
    assert!(shown.as_str().unwrap().contains("1.yaml:4:"), "{shown}");
    assert!(shown.as_str().unwrap().contains("fortnight"), "{shown}");
    std::fs::write(&rules_file, &good).unwrap();
    b.wait_for("the error cleared", 15, "return !document.getElementById('reload-error');");

    // An edit made through the page shows in the admin API.
    b.run(
        "document.getElementById('edit-domain').value = 'api';
         document.getElementById('edit-descriptor').value = 'user=vip-from-page';
         document.getElementById('edit-limits').value = '{\"unit\": \"second\", \"requests_per_unit\": 7}';
         document.getElementById('keys-edit').requestSubmit();",
        json!([]),
    );
    b.wait_for("the edit confirmed", 10, "return document.getElementById('edit-result').textContent === 'set';");
    let (code, v) = admin(&s, "GET", "/admin/v1/overrides?domain=api&prefix=user%3Dvip", "");
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["overrides"][0]["descriptor"], json!([{"key": "user", "value": "vip-from-page"}]), "{v}");
    assert_eq!(v["overrides"][0]["limits"]["requests_per_unit"], 7, "{v}");
    b.wait_for(
        "the page lists it",
        10,
        "return [...document.querySelectorAll('#keys td')].some(td => td.textContent === 'user=vip-from-page');",
    );

    let errors = b.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");

    // A simulate --plot picture: the fixed window's double burst at an edge.
    let trace: String = (0..10)
        .map(|i| 900 + i * 9)
        .chain((0..10).map(|i| 1000 + i * 9))
        .chain((0..20).map(|i| 1100 + i * 100))
        .map(|at| format!("{{\"at_ms\": {at}, \"key\": \"alice\"}}\n"))
        .collect();
    let dir = floodgate_testing::TempDir::new("plot");
    let svg = dir.path("plot.svg");
    let mut sim = floodgate()
        .args(["simulate", "--report", "--limit", "10", "--window", "1s", "--plot"])
        .arg(&svg)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut sim.stdin.take().unwrap(), trace.as_bytes()).unwrap();
    assert!(sim.wait().unwrap().success());
    b.goto(&format!("file://{}", svg.display()));
    let text = b.wait_for("the plot", 10, "return document.documentElement.textContent;");
    assert!(text.as_str().unwrap().contains("fixed_window"), "{text}");
    assert!(text.as_str().unwrap().contains("most in a window: 20"), "the fixed window's double burst: {text}");
    std::fs::write(shots_dir().join("simulate-plot.png"), b.screenshot()).unwrap();
    std::fs::copy(&svg, shots_dir().join("simulate-plot.svg")).unwrap();
    assert!(b.console_errors().is_empty());
}
