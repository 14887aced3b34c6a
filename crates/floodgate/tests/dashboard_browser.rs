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
    rate_limit: {unit: day, requests_per_unit: 5, name: api_users}
  - key: path
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2, name: api_paths}
  - key: job
    rate_limit: {concurrency: 3, lease_ttl: 10m, name: api_jobs}
tiers:
  pro: {unit: minute, requests_per_unit: 100, name: api_pro}
";

/// A domain of 60 rules (`many.k0` … `many.k59`), more than a page shows.
fn many_rules() -> String {
    let mut y = "---\ndomain: many\ndescriptors:\n".to_owned();
    for i in 0..60 {
        y.push_str(&format!("  - key: k{i}\n    rate_limit: {{unit: second, requests_per_unit: 10}}\n"));
    }
    y
}

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

/// `POST /json` for `user=value` (or another key) in domain api: its code.
fn ask_api(s: &Served, key: &str, value: &str) -> u16 {
    let body = json!({"domain": "api", "descriptors": [{"entries": [{"key": key, "value": value}]}]}).to_string();
    let (code, _, _) = http_full(&s.http, "POST", "/json", &body);
    assert!(code == 200 || code == 429, "{code}");
    code
}

/// Nothing wider than the window, at `width` px.
fn fits(b: &Browser, width: u32) {
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
    assert_eq!(breaking, json!(0), "nothing breaks words anywhere at {width} px");
    // Every chart is drawn at its box's width (not stretched), within the window.
    let charts = b.wait_for(
        &format!("charts within {width} px"),
        10,
        "const c = [...document.querySelectorAll('svg.chart')].filter(s => s.getBoundingClientRect().width > 0);
         return c.length && c.every(s => s.getBoundingClientRect().right <= window.innerWidth + 1 && !s.hasAttribute('preserveAspectRatio')) ? c.length : 0;",
    );
    assert!(charts.as_u64().unwrap() >= 1, "{charts}");
}

#[test]
fn dashboard_in_a_real_browser() {
    let sync_port = floodgate_testing::redis::free_port().to_string();
    let peer = format!("us=http://127.0.0.1:{}", floodgate_testing::redis::free_port());
    let rules = format!("{RULES}{}", many_rules());
    let s = Served::start(
        "browser",
        &rules,
        &["--admin-token", TOKEN, "--region", "eu", "--peers", &peer, "--sync-addr", &format!("127.0.0.1:{sync_port}")],
    );
    // A per-key entry on a tier, before the page opens.
    let put = json!({"domain": "api", "descriptor": [{"key": "user", "value": "vip"}], "tier": "pro"}).to_string();
    assert_eq!(admin(&s, "PUT", "/admin/v1/keys", &put).0, 200);
    let b = Browser::start(1400, 1500);
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
        "return [...document.querySelectorAll('#loaded tbody tr')].filter(tr => tr.children[0].textContent !== 'many').map(tr => tr.children[3].textContent).sort();",
        json!([]),
    );
    assert_eq!(
        limits,
        json!([
            "1,000,000,000 per second",
            "2 per minute",
            "3 in flight per key, leases end after 10 min",
            "5 per day"
        ]),
        "{limits}"
    );
    // Tiers are listed with file:line and how many entries use each, not the entries.
    let tier = b.wait_for(
        "the pro tier with its entry count",
        10,
        "const r = document.querySelector('#tiers tr[data-tier=\"api/pro\"]'); return r && [...r.children].map(td => td.textContent);",
    );
    assert_eq!(tier[1], "pro");
    assert_eq!(tier[2], "100 per minute");
    assert_eq!(tier[3], "1", "{tier}");
    assert!(tier[4].as_str().unwrap().contains("1.yaml:"), "{tier}");
    // Before any traffic: empty states that say why; the per-key table is
    // listed without asking, its limits in words.
    let empty = b.wait_for(
        "the empty rules list",
        10,
        "const e = document.querySelector('#rules p.empty'); return e && e.textContent;",
    );
    assert!(empty.as_str().unwrap().contains("No decisions"), "{empty}");
    let entry = b.wait_for(
        "the per-key entry listed",
        10,
        "const r = [...document.querySelectorAll('#keys tbody tr')].find(tr => tr.children[1].textContent === 'user=vip'); return r && r.children[2].textContent;",
    );
    assert_eq!(entry, json!("tier pro"));

    // A rule's rate rises while bench loads it, in the overview too.
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
    let overall = b.run("return Number(document.getElementById('ov-rate').dataset.value);", json!([]));
    assert!(overall.as_f64().unwrap() > 100.0, "the overview's decisions/s: {overall}");

    // A key flooding a rule tops its lists; a shadow rule and a per-key
    // tier show as such.
    for i in 0..60 {
        let user = if i % 6 == 0 { format!("other{i}") } else { "flooder".to_owned() };
        ask_api(&s, "user", &user);
    }
    for _ in 0..4 {
        ask_api(&s, "path", "/x");
        ask_api(&s, "user", "vip");
    }
    // Two jobs in flight (RLS acquires whose stream ends never come).
    for _ in 0..2 {
        ask_api(&s, "job", "nightly");
    }
    let top = b.wait_for("user=flooder first by hits and by denials", 10, "const h = document.querySelector('[data-rule=\"api/api_users\"] .top-hits li'); const d = document.querySelector('[data-rule=\"api/api_users\"] .top-denials li'); return h && d && h.dataset.key === 'user=flooder' && d.dataset.key === 'user=flooder' && h.textContent;");
    assert_eq!(top, json!("user=flooder — 50"), "exact while the table holds every key");
    let note =
        b.run("return document.querySelector('[data-rule=\"api/api_users\"] .top-hits .note').textContent;", json!([]));
    assert!(note.as_str().unwrap().starts_with("exact"), "{note}");
    // Totals per rule over the range: 45 of 60 denied.
    let totals = b.wait_for(
        "api_users' denials over 5 minutes",
        10,
        "const t = document.querySelector('[data-rule=\"api/api_users\"] .totals'); return t && t.dataset.decisions === '60' && t.textContent;",
    );
    assert!(totals.as_str().unwrap().contains("45 of 60 (75%)"), "{totals}");
    let tags = b.wait_for(
        "the shadow and per-key tags",
        10,
        "const s = document.querySelector('[data-rule=\"api/api_paths\"] .tag'); const p = document.querySelector('[data-rule=\"api/api_pro\"] .tag'); return s && p && [s.textContent, p.textContent];",
    );
    assert_eq!(tags, json!(["shadow", "per-key tier pro"]));
    let at = b.run("return document.querySelector('[data-rule=\"api/api_pro\"] .at').textContent;", json!([]));
    assert!(at.as_str().unwrap().contains("1.yaml:"), "a tier's limit has its file:line: {at}");
    let in_flight = b.wait_for(
        "a concurrency limit's slots in flight",
        10,
        "const e = document.querySelector('[data-rule=\"api/api_jobs\"] .in-flight'); return e && e.textContent;",
    );
    assert_eq!(in_flight, json!("in flight now: 2 (up to 3 per key)"));
    let most_denied = b.wait_for(
        "the most denied key across rules",
        10,
        "const l = document.querySelector('#ov-top li[data-key]'); return l && l.dataset.key;",
    );
    assert_eq!(most_denied, json!("user=flooder"));

    // Many keys over the bench rule: only what the sketch guarantees is named.
    let _ = bench.wait();
    let honest = b.wait_for(
        "the bench rule's top keys with their guarantee",
        10,
        "const n = document.querySelector('[data-rule=\"bench/bench_users\"] .top-hits .note'); return n && n.textContent;",
    );
    assert!(honest.as_str().unwrap().contains("every key with more than"), "{honest}");
    let noise = b.run(
        "return [...document.querySelectorAll('.top li')].filter(l => /±|none/.test(l.textContent)).length;",
        json!([]),
    );
    assert_eq!(noise, json!(0));

    // Charts: two lanes (each its own scale), a time axis, grid lines,
    // values on hover.
    let chart = b.run(
        "const s = document.querySelector('[data-rule=\"api/api_users\"] svg.chart');
         return [s.querySelectorAll('text.lane').length, s.querySelectorAll('text.xlabel').length, s.querySelectorAll('line.grid').length,
                 [...s.parentElement.querySelectorAll('.legend .item')].map(i => i.textContent.trim())];",
        json!([]),
    );
    assert_eq!(chart[0], 2, "{chart}");
    assert!(chart[1].as_u64().unwrap() >= 3 && chart[2].as_u64().unwrap() >= 6, "{chart}");
    assert_eq!(chart[3], json!(["denied", "shadow-denied", "failure policy"]), "the refused lane's legend");
    let hover = b.run(
        "const s = document.querySelector('[data-rule=\"api/api_users\"] svg.chart'); const r = s.getBoundingClientRect();
         s.dispatchEvent(new PointerEvent('pointermove', {clientX: r.right - 12, clientY: r.top + 30, bubbles: true}));
         const t = document.getElementById('tip'); const text = t.hidden ? '' : t.textContent;
         s.dispatchEvent(new PointerEvent('pointerleave', {bubbles: true})); return text;",
        json!([]),
    );
    assert!(hover.as_str().unwrap().contains("allowed: ") && hover.as_str().unwrap().contains("denied: "), "{hover}");
    // Zoom by dragging across a chart — slowly, across the page's redraws
    // of every second — then back.
    let drag = "const s = document.querySelector('[data-rule=\"api/api_users\"] svg.chart'); const r = s.getBoundingClientRect();
         s.dispatchEvent(new PointerEvent(arguments[0], {clientX: r.left + r.width * arguments[1], clientY: r.top + 30, pointerId: 1, bubbles: true}));";
    b.run(drag, json!(["pointerdown", 0.5]));
    std::thread::sleep(std::time::Duration::from_millis(1_500));
    b.run(drag, json!(["pointermove", 0.98]));
    b.run(drag, json!(["pointerup", 0.98]));
    let zoomed = b.run(
        "return !document.getElementById('unzoom').hidden && document.getElementById('rules-title').textContent;",
        json!([]),
    );
    assert!(zoomed.as_str().unwrap_or_default().contains(':'), "a zoom names its span: {zoomed}");
    b.run("document.getElementById('unzoom').click();", json!([]));
    // The hour's range: 10-second buckets, said in words.
    b.run("document.querySelector('.range button[data-range=\"1h\"]').click();", json!([]));
    b.wait_for(
        "the hour's range",
        10,
        "return document.getElementById('rules-title').textContent.includes('the last hour') && document.querySelector('[data-rule=\"api/api_users\"]');",
    );
    b.run("document.querySelector('.range button[data-range=\"5m\"]').click();", json!([]));
    // A filter that matches nothing says so.
    b.run(
        "const f = document.getElementById('filter'); f.value = 'no-such-rule'; f.dispatchEvent(new Event('input'));",
        json!([]),
    );
    let none = b.wait_for(
        "the filter's empty state",
        10,
        "const e = document.querySelector('#rules p.empty'); return e && e.textContent;",
    );
    assert!(none.as_str().unwrap().contains("No rule matches \"no-such-rule\""), "{none}");
    b.run("const f = document.getElementById('filter'); f.value = ''; f.dispatchEvent(new Event('input'));", json!([]));

    // The peer region over the range: unreachable all along.
    let peer = b.wait_for(
        "the peer region's chart",
        10,
        "const c = document.querySelector('[data-peer=\"us\"] svg.chart'); return c && c.querySelectorAll('text.lane').length;",
    );
    assert_eq!(peer, json!(3));

    // More rules than a page: 50 shown, and the page says so; the order
    // stays put while the traffic shifts.
    for i in 0..60 {
        let body = json!({"domain": "many", "descriptors": [{"entries": [{"key": format!("k{i}"), "value": "x"}]}]})
            .to_string();
        http_full(&s.http, "POST", "/json", &body);
    }
    let more = b.wait_for(
        "the page's count of rules",
        10,
        "const m = document.getElementById('rules-more'); return m.textContent.includes('of 65 rules') && m.textContent;",
    );
    assert!(more.as_str().unwrap().starts_with("Showing 50 of 65 rules"), "{more}");
    let order = "return [...document.querySelectorAll('#rules .rule')].map(r => r.dataset.rule);";
    let before = b.run(order, json!([]));
    for _ in 0..30 {
        let body = json!({"domain": "many", "descriptors": [{"entries": [{"key": "k42", "value": "x"}]}]}).to_string();
        http_full(&s.http, "POST", "/json", &body);
    }
    std::thread::sleep(std::time::Duration::from_millis(2_500));
    assert_eq!(b.run(order, json!([])), before, "rows keep their places");
    b.run("document.getElementById('show-more').click();", json!([]));
    b.wait_for("every rule shown", 10, "return document.querySelectorAll('#rules .rule').length === 65;");

    // Any key's state, as /v1/check with hits 0 says: an idle key, and the
    // flooder (limited now). (A day's window: no edge passes during the test
    // but once a day.)
    for _ in 0..2 {
        ask_api(&s, "user", "idle-alice");
    }
    for (user, limited) in [("idle-alice", false), ("flooder", true)] {
        b.run(
            "document.getElementById('lookup-domain').value = 'api';
             document.getElementById('lookup-descriptor').value = arguments[0];
             document.getElementById('lookup').requestSubmit();",
            json!([format!("user={user}")]),
        );
        let shown = b.wait_for(
            "the key's state",
            10,
            &format!("const r = document.querySelector('#lookup-table tr[data-rule=\"api_users\"]'); const v = document.getElementById('lookup-verdict'); return r && v.textContent.startsWith('user={user}') && [Number(r.dataset.remaining), Number(r.dataset.resetUs), v.dataset.limited];"),
        );
        let check = json!({"domain": "api", "descriptors": [{"user": user}], "hits": 0}).to_string();
        let (code, _, body) = http_full(&s.http, "POST", "/v1/check", &check);
        assert_eq!(code, 200);
        let v: Value = serde_json::from_str(&body).unwrap();
        let d = &v["descriptors"][0];
        assert_eq!(shown[0], d["remaining"], "{user}: {shown} vs {v}");
        let reset_ms = d["reset_after_ms"].as_f64().unwrap();
        assert!((shown[1].as_f64().unwrap() / 1e3 - reset_ms).abs() < 2_000.0, "{user}: {shown} vs {v}");
        assert_eq!(shown[2], json!(limited.to_string()), "{user}");
        assert_eq!(d["remaining"] == json!(0), limited, "{v}");
    }

    // A rule's own page: a larger chart, its definition with file:line, its
    // keys with their counters now, and its top keys over time.
    b.run("document.querySelector('[data-rule=\"api/api_users\"] a.name').click();", json!([]));
    let def = b.wait_for("the rule's page", 10, "const v = document.getElementById('rule-view'); return !v.hidden && document.getElementById('rv-def').textContent;");
    assert!(def.as_str().unwrap().contains("5 per day") && def.as_str().unwrap().contains("1.yaml:"), "{def}");
    let used = b.wait_for(
        "the flooder's counters on the rule's page",
        10,
        "const r = document.querySelector('#rv-keys tr[data-key=\"user=flooder\"]'); return r && r.children[3].textContent !== '…' && [...r.children].map(td => td.textContent);",
    );
    assert_eq!(used[3], "5 of 5", "{used}");
    assert_eq!(used[4], "0", "{used}");
    b.wait_for("its keys over time", 10, "return document.querySelector('#rv-keys-chart svg.chart');");
    b.wait_for("the big chart", 10, "return document.querySelector('#rv-chart svg.chart');");
    std::fs::write(shots_dir().join("dashboard-rule.png"), b.screenshot()).unwrap();
    fits(&b, 400);
    b.resize(1400, 1500);
    b.run("location.hash = '';", json!([]));
    b.wait_for("back to the list", 10, "return !document.getElementById('list-view').hidden;");

    // The guide's picture: the busiest rules first, zoomed on the last
    // minute, where the load was.
    b.run(
        "const o = document.getElementById('order'); o.value = 'busy'; o.dispatchEvent(new Event('change'));",
        json!([]),
    );
    b.wait_for(
        "the busiest first",
        10,
        "const r = document.querySelector('#rules .rule'); return r && r.dataset.rule === 'bench/bench_users';",
    );
    b.run("setZoom([Date.now() / 1000 - 60, Date.now() / 1000]);", json!([]));
    b.wait_for("the zoom", 10, "return !document.getElementById('unzoom').hidden;");
    std::fs::write(shots_dir().join("dashboard.png"), b.screenshot()).unwrap();
    b.run("setZoom(null); const o = document.getElementById('order'); o.value = 'name'; o.dispatchEvent(new Event('change'));", json!([]));
    // On a phone's width and a narrow window, nothing scrolls sideways (the
    // tables scroll in their own boxes), and no count breaks mid-digit.
    for width in [1400, 820, 400] {
        fits(&b, width);
    }
    std::fs::write(shots_dir().join("dashboard-phone.png"), b.screenshot()).unwrap();
    b.resize(1400, 1500);

    // A bad rules edit shows each error on a line of its own, with
    // file:line; the fix clears it.
    let rules_file = s.rules_dir().join("1.yaml");
    let good = std::fs::read_to_string(&rules_file).unwrap();
    std::fs::write(&rules_file, good.replace("unit: minute", "unit: fortnight")).unwrap();
    let shown = b.wait_for(
        "the reload errors",
        15,
        "const l = [...document.querySelectorAll('#reload-error li.error-line')].map(l => l.textContent); return l.length && l;",
    );
    let lines = shown.as_array().unwrap();
    assert!(lines.len() >= 2, "one line per error: {shown}");
    assert!(lines.iter().all(|l| l.as_str().unwrap().contains("1.yaml:")), "{shown}");
    assert!(lines.iter().any(|l| l.as_str().unwrap().contains("1.yaml:7:")), "{shown}");
    assert!(lines.iter().any(|l| l.as_str().unwrap().contains("fortnight")), "{shown}");
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
    assert_eq!(v["overrides"][1]["descriptor"], json!([{"key": "user", "value": "vip-from-page"}]), "{v}");
    assert_eq!(v["overrides"][1]["limits"]["requests_per_unit"], 7, "{v}");
    let words = b.wait_for(
        "the page lists it in words",
        10,
        "const r = [...document.querySelectorAll('#keys tbody tr')].find(tr => tr.children[1].textContent === 'user=vip-from-page'); return r && r.children[2].textContent;",
    );
    assert_eq!(words, json!("7 per second"));
    // Delete asks first: one click arms it, the second deletes.
    b.run(
        "[...document.querySelectorAll('#keys tbody tr')].find(tr => tr.children[1].textContent === 'user=vip-from-page').querySelector('button.delete').click();",
        json!([]),
    );
    let armed = b.run("return document.querySelector('#keys button.delete.armed').textContent;", json!([]));
    assert!(armed.as_str().unwrap().contains("user=vip-from-page?"), "{armed}");
    assert_eq!(admin(&s, "GET", "/admin/v1/keys?domain=api", "").1["entries"].as_array().unwrap().len(), 2, "not yet");
    b.run("document.querySelector('#keys button.delete.armed').click();", json!([]));
    b.wait_for("deleted", 10, "return document.getElementById('edit-result').textContent.startsWith('deleted');");
    assert_eq!(admin(&s, "GET", "/admin/v1/keys?domain=api", "").1["entries"].as_array().unwrap().len(), 1);

    // The memory budget the page states is the README's.
    let budget = b.run("return document.getElementById('budget').textContent;", json!([]));
    let readme = std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../README.md")).unwrap();
    let mib = format!("{:.1} MiB", floodgate_server::dashboard::budget_bytes() as f64 / 1_048_576.0);
    assert!(readme.contains(&format!("at most {mib}")), "the README states the dashboard's {mib}");
    let guide =
        std::fs::read_to_string(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md")).unwrap();
    assert!(guide.contains(&format!("at most {mib}")), "the guide states the dashboard's {mib}");
    // The page's figure counts the peer region's history too.
    let with_peer = floodgate_server::dashboard::budget_bytes() + floodgate_server::dashboard::peer_bytes();
    assert!(
        budget.as_str().unwrap().contains(&format!("at most {:.1} MiB", with_peer as f64 / 1_048_576.0)),
        "{budget}"
    );

    let errors = b.console_errors();
    assert!(errors.is_empty(), "console errors: {errors:?}");

    // The server dies with the page open: within 3 s nothing reads as live.
    drop(s);
    let stale = b.wait_for(
        "the page to show the data as stale",
        3,
        "const r = document.querySelector('#store-status dd[data-k=\"reachable\"]');
         return document.body.classList.contains('stale') && r.textContent.startsWith('unknown') && document.getElementById('live').textContent;",
    );
    assert!(stale.as_str().unwrap().starts_with("disconnected for"), "{stale}");
    let grey = b.run("return getComputedStyle(document.getElementById('overview')).opacity;", json!([]));
    assert_eq!(grey, json!("0.45"));
    // The only errors since: the browser's own notes of the cut stream and the refused retries.
    let errors = b.console_errors();
    assert!(
        errors.iter().all(|e| e.contains("ERR_CONNECTION_REFUSED") || e.contains("ERR_INCOMPLETE_CHUNKED_ENCODING")),
        "{errors:?}"
    );

    // With the data off, the page says so rather than "no decisions".
    let off = Served::start("browser-off", RULES, &["--dashboard", "off"]);
    for _ in 0..3 {
        let body = json!({"domain": "api", "descriptors": [{"entries": [{"key": "user", "value": "x"}]}]}).to_string();
        http_full(&off.http, "POST", "/json", &body);
    }
    b.goto(&format!("http://{}/dashboard", off.admin));
    let said = b.wait_for(
        "the data-off state",
        10,
        "const e = document.querySelector('#rules p.empty'); return e && e.textContent;",
    );
    assert!(said.as_str().unwrap().contains("--dashboard off"), "{said}");

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
