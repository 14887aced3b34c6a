//! `serve` and `proxy` on their defaults, as a new user runs them: the
//! rules compiled into the binary, instance-local files that never collide,
//! and a proxy that limits per client address out of the box (issue 23's
//! defects 2, 4 and 5).

use crate::cli;

use std::path::Path;
use std::process::Command;

use cli::{Served, floodgate, http, http_full, http_get};
use floodgate_testing::TempDir;
use serde_json::Value;

/// `floodgate serve` from `cwd` on free ports with no rules or overrides
/// flags, its state under `state`.
fn serve_in(cwd: &Path, state: &Path, name: &str) -> Served {
    let mut cmd = floodgate();
    cmd.current_dir(cwd)
        .env("XDG_STATE_HOME", state)
        .args(["serve", "--log-format", "json", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--admin-addr", "127.0.0.1:0"]);
    Served::spawn(cmd, TempDir::new(name))
}

const VIP: &str = r#"{"domain": "api", "descriptor": [{"key": "user", "value": "vip"}], "limits": {"unit": "hour", "requests_per_unit": 3}}"#;

fn has_vip(s: &Served) -> bool {
    let (code, body) = http_get(&s.admin, "/admin/v1/overrides");
    assert_eq!(code, 200, "{body}");
    body.contains("vip")
}

/// Issue 23, defect 2: a second instance started from the same directory
/// exited with "Database already open. Cannot acquire lock", because both
/// defaulted to `./floodgate-overrides.redb`.
#[test]
fn regression_two_instances_from_one_directory_run_side_by_side() {
    let home = TempDir::new("side-by-side");
    let (cwd, state) = (home.path("cwd"), home.path("state"));
    std::fs::create_dir_all(&cwd).unwrap();
    let a = serve_in(&cwd, &state, "side-a");
    let b = serve_in(&cwd, &state, "side-b");
    assert_eq!(http_get(&a.http, "/readyz").0, 200);
    assert_eq!(http_get(&b.http, "/readyz").0, 200);
    // Each has its own overrides: one set on A is not B's.
    let (code, body) = http(&a.admin, "PUT", "/admin/v1/overrides", VIP);
    assert_eq!(code, 200, "{body}");
    assert!(has_vip(&a) && !has_vip(&b));
    assert!(!cwd.join("floodgate-overrides.redb").exists(), "nothing written to the working directory");
    // Both admin ports are 0, so both are `admin-127.0.0.1-0`: the second
    // took the next name, and said so.
    assert!(state.join("floodgate/admin-127.0.0.1-0/overrides.redb").is_file());
    assert!(state.join("floodgate/admin-127.0.0.1-0-2/overrides.redb").is_file());
    assert!(!b.logged("trying the next name").is_empty());

    // A restarted finds its overrides again.
    assert_eq!(a.terminate(), Some(0));
    let a = serve_in(&cwd, &state, "side-a2");
    assert!(has_vip(&a), "the override survived the restart");
    drop(b);
}

/// The old default, `floodgate-overrides.redb` in the working directory,
/// keeps its overrides: the first instance that starts moves it into its
/// own state directory, with a log line.
#[test]
fn regression_the_old_default_overrides_file_is_moved_not_lost() {
    let home = TempDir::new("legacy");
    let (cwd, state) = (home.path("cwd"), home.path("state"));
    std::fs::create_dir_all(&cwd).unwrap();
    // An older instance's file, made by naming it.
    let mut cmd = floodgate();
    cmd.current_dir(&cwd).args(["serve", "--log-format", "json", "--grpc-addr", "none", "--http-addr", "none"]).args([
        "--admin-addr",
        "127.0.0.1:0",
        "--overrides-file",
        "floodgate-overrides.redb",
    ]);
    let old = Served::spawn(cmd, TempDir::new("legacy-old"));
    assert_eq!(http(&old.admin, "PUT", "/admin/v1/overrides", VIP).0, 200);
    assert_eq!(old.terminate(), Some(0));
    assert!(cwd.join("floodgate-overrides.redb").is_file());

    let new = serve_in(&cwd, &state, "legacy-new");
    assert!(has_vip(&new), "the old file's override is served");
    assert!(!cwd.join("floodgate-overrides.redb").exists(), "moved, not copied");
    assert!(!new.logged("moved the overrides file").is_empty());
}

/// Issue 23, defect 4: `floodgate proxy` on the bundled rules forwarded
/// everything unlimited, without a word, for want of a `proxy` domain.
#[test]
fn regression_the_proxy_limits_each_client_on_the_bundled_rules() {
    let up = Served::start("defaults-up", "domain: none\ndescriptors: []\n", &[]);
    let home = TempDir::new("proxy-defaults");
    let proxy = |domain: &str, name: &str| {
        let mut cmd = floodgate();
        cmd.current_dir(home.0.as_path())
            .env("XDG_STATE_HOME", home.path("state"))
            .args(["proxy", "--log-format", "json", "--listen", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
            .args(["--admin-addr", "127.0.0.1:0", "--upstream", &format!("http://{}", up.http), "--domain", domain]);
        Served::spawn(cmd, TempDir::new(name))
    };
    let p = proxy("proxy", "defaults-proxy");
    let (code, head, _) = http_full(&p.proxy, "GET", "/healthz", "");
    assert_eq!(code, 200, "{head}");
    assert!(head.to_ascii_lowercase().contains("x-ratelimit-limit: 20"), "limited per client: {head}");
    // The bundled limit: a burst of 40 at 20/s; 60 at once meet a 429.
    let codes: Vec<u16> = (0..60).map(|_| http_get(&p.proxy, "/healthz").0).collect();
    assert!(codes.contains(&429), "{codes:?}");
    assert!(p.logged("which has no rules").is_empty());
    let (_, status) = http_get(&p.admin, "/admin/v1/status");
    let v: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(v["warnings"], Value::Array(vec![]), "{status}");

    // A domain with no rules: a warning naming it, in the log, on the admin
    // address and in /readyz's body.
    let q = proxy("nothing-here", "defaults-proxy-empty");
    let warned = q.logged("which has no rules");
    assert!(warned.iter().any(|l| l.contains("`nothing-here`")), "{warned:?}");
    let (_, status) = http_get(&q.admin, "/admin/v1/status");
    assert!(status.contains("domain `nothing-here`, which has no rules"), "{status}");
    let (code, ready) = http_get(&q.http, "/readyz");
    assert_eq!(code, 200, "still ready: it forwards");
    assert!(ready.contains("domain `nothing-here`, which has no rules"), "{ready}");
}

/// Issue 23, defect 5: with no `--config`, `serve` looked for
/// `examples/config` in the working directory, then where the source tree
/// was at build time: a binary installed elsewhere had no rules. The rules
/// are compiled in now. The binary is copied out of the build tree and run
/// from an empty directory in a mount namespace where the source tree (and
/// the build tree) is hidden under an empty tmpfs.
#[test]
fn regression_the_bundled_rules_serve_from_any_directory() {
    let home = TempDir::new("installed");
    let bin = home.path("bin/floodgate");
    std::fs::create_dir_all(bin.parent().unwrap()).unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_floodgate"), &bin).unwrap();
    let empty = home.path("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let source_tree = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap();
    let hidden = Command::new("unshare")
        .args(["-m", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs none '{}' && test ! -e '{}'",
            source_tree.display(),
            source_tree.join("examples").display()
        ))
        .status()
        .is_ok_and(|s| s.success());
    let mut cmd = if hidden {
        let mut c = Command::new("unshare");
        c.args(["-m", "sh", "-c"]).arg(format!(
            "mount -t tmpfs none '{}' && exec '{}' \"$@\"",
            source_tree.display(),
            bin.display()
        ));
        c.arg("floodgate");
        c
    } else {
        eprintln!("no mount namespace here (needs root): running the copied binary from an empty directory only");
        Command::new(&bin)
    };
    for (k, _) in std::env::vars() {
        if k.starts_with("FLOODGATE_") {
            cmd.env_remove(k);
        }
    }
    cmd.current_dir(&empty)
        .env("XDG_STATE_HOME", home.path("state"))
        .args(["serve", "--log-format", "json", "--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"])
        .args(["--admin-addr", "127.0.0.1:0"]);
    let s = Served::spawn(cmd, TempDir::new("installed-run"));
    let (code, rules) = http_get(&s.admin, "/admin/v1/rules");
    assert_eq!(code, 200, "{rules}");
    assert!(rules.contains("<embedded>/api.yaml:"), "embedded rules named so: {rules}");
    assert!(rules.contains("\"proxy\""), "{rules}");
    let body = r#"{"domain": "signup", "descriptors": [{"remote_address": "203.0.113.9"}]}"#;
    let (code, answer) = http(&s.http, "POST", "/v1/check", body);
    assert_eq!(code, 200, "{answer}");
    assert!(answer.contains("\"limited\":true") || answer.contains("\"limited\": true"), "{answer}");
    let (_, ready) = http_get(&s.http, "/readyz");
    assert!(ready.contains("<embedded>"), "{ready}");
    // Not watched: nothing to watch, and no warning about it.
    assert!(s.logged("not watching").is_empty());
}

/// A global limit needs peer regions, from the admin API as from a file:
/// refused with what to do, not decided as a regional one in silence.
#[test]
fn a_global_override_on_an_instance_without_regions_is_refused() {
    let home = TempDir::new("global-override");
    let s = serve_in(&home.0, &home.path("state"), "global-override-run");
    let spec = r#"{"domain": "api", "descriptor": [{"key": "user", "value": "x"}], "limits": {"unit": "hour", "requests_per_unit": 60, "scope": "global"}}"#;
    let (code, body) = http(&s.admin, "PUT", "/admin/v1/overrides", spec);
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("--region") && body.contains("scope: region"), "{body}");
}
