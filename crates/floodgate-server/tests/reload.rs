//! Hot reload with real files being rewritten, renamed and deleted.

use std::fs;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use floodgate_core::rules::LoadOptions;
use floodgate_core::{ManualClock, MemoryStore};
use floodgate_server::rules::reload::{Rules, WatchOptions, watch};

use floodgate_testing::TempDir;

fn rules_file(domain: &str, limit: u32) -> String {
    format!(
        "domain: {domain}\ndescriptors:\n  - key: user\n    rate_limit: {{unit: minute, requests_per_unit: {limit}}}\n"
    )
}

/// The limit the rules in use give `user=alice` in `domain`.
fn limit_of(rules: &Rules, domain: &str) -> Option<u64> {
    let set = rules.current();
    set.matches(domain, &[("user", "alice")]).map(|m| m.rules[0].limit.as_ref().unwrap().limit())
}

/// Wait up to 10 s for `cond`.
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn fast() -> WatchOptions {
    WatchOptions { debounce: Duration::from_millis(100), poll: Duration::from_millis(500), events: true }
}

fn start(dir: &Path) -> (Arc<Rules>, floodgate_server::rules::reload::Watcher) {
    let rules = Rules::load(dir, LoadOptions::default()).unwrap();
    let watcher = watch(rules.clone(), fast()).unwrap();
    (rules, watcher)
}

#[test]
fn rewritten_renamed_and_deleted_files_are_picked_up() {
    let dir = TempDir::new("edits");
    fs::write(dir.path("api.yaml"), rules_file("api", 5)).unwrap();
    let (rules, _w) = start(&dir.0);
    assert_eq!(limit_of(&rules, "api"), Some(5));

    // Rewritten in place.
    fs::write(dir.path("api.yaml"), rules_file("api", 6)).unwrap();
    eventually("a rewrite is picked up", || limit_of(&rules, "api") == Some(6));

    // Written aside and renamed over (what editors and ConfigMaps do).
    fs::write(dir.path(".api.yaml.tmp"), rules_file("api", 7)).unwrap();
    fs::rename(dir.path(".api.yaml.tmp"), dir.path("api.yaml")).unwrap();
    eventually("a rename is picked up", || limit_of(&rules, "api") == Some(7));

    // A new file, then the old one deleted.
    fs::write(dir.path("web.yaml"), rules_file("web", 8)).unwrap();
    eventually("a new file is picked up", || limit_of(&rules, "web") == Some(8));
    fs::remove_file(dir.path("api.yaml")).unwrap();
    eventually("a deleted file's domain goes", || limit_of(&rules, "api").is_none());
    assert_eq!(limit_of(&rules, "web"), Some(8));
    assert_eq!(rules.failures(), 0);
}

#[test]
fn a_bad_edit_keeps_the_last_good_rules_until_fixed() {
    let dir = TempDir::new("bad");
    fs::write(dir.path("api.yaml"), rules_file("api", 5)).unwrap();
    let (rules, _w) = start(&dir.0);
    fs::write(dir.path("api.yaml"), "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: fortnight}\n")
        .unwrap();
    eventually("the failure is recorded", || rules.failures() >= 1);
    assert_eq!(limit_of(&rules, "api"), Some(5), "the last good rules stay");
    let err = rules.status().last_error.unwrap();
    assert!(err.contains("api.yaml:4:23") || err.contains("invalid unit `fortnight`"), "{err}");
    fs::write(dir.path("api.yaml"), rules_file("api", 9)).unwrap();
    eventually("the fix is picked up", || limit_of(&rules, "api") == Some(9));
    assert_eq!(rules.status().last_error, None);
}

#[test]
fn a_burst_of_writes_costs_few_reloads() {
    let dir = TempDir::new("burst");
    fs::write(dir.path("api.yaml"), rules_file("api", 1)).unwrap();
    let rules = Rules::load(&dir.0, LoadOptions::default()).unwrap();
    let opts = WatchOptions { debounce: Duration::from_millis(300), poll: Duration::from_secs(60), events: true };
    let _w = watch(rules.clone(), opts).unwrap();
    for i in 2..=50 {
        fs::write(dir.path("api.yaml"), rules_file("api", i)).unwrap();
    }
    eventually("the last write wins", || limit_of(&rules, "api") == Some(50));
    assert!(rules.reloads() <= 5, "{} reloads for 49 writes", rules.reloads());
}

#[test]
fn polling_alone_catches_changes() {
    // No events at all (as when inotify is exhausted): the periodic check.
    let dir = TempDir::new("poll");
    fs::write(dir.path("api.yaml"), rules_file("api", 5)).unwrap();
    let rules = Rules::load(&dir.0, LoadOptions::default()).unwrap();
    let _w = watch(rules.clone(), WatchOptions { events: false, ..fast() }).unwrap();
    fs::write(dir.path("api.yaml"), rules_file("api", 123)).unwrap();
    eventually("the change is seen", || limit_of(&rules, "api") == Some(123));
}

#[test]
fn counters_of_unchanged_rules_survive_a_reload() {
    let dir = TempDir::new("counters");
    let two = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: ip\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";
    fs::write(dir.path("api.yaml"), two).unwrap();
    let (rules, _w) = start(&dir.0);
    let store = MemoryStore::builder().clock(ManualClock::new(0)).build();
    let hit = |key: &str| {
        let set = rules.current();
        let m = set.matches("api", &[(key, "x")]).unwrap();
        store.apply_sync(&m.counter_key(0), m.rules[0].limit.as_ref().unwrap(), 1).unwrap().allowed
    };
    assert!(hit("user") && hit("user") && !hit("user"));
    assert!(hit("ip") && hit("ip") && !hit("ip"));
    // Change only the ip rule (and add a file).
    let changed = two.replace(
        "key: ip\n    rate_limit: {unit: minute, requests_per_unit: 2}",
        "key: ip\n    rate_limit: {unit: minute, requests_per_unit: 3}",
    );
    assert_ne!(changed, two);
    fs::write(dir.path("api.yaml"), changed).unwrap();
    eventually("the new ip limit is in", || {
        rules.current().matches("api", &[("ip", "x")]).is_some_and(|m| m.rules[0].limit.as_ref().unwrap().limit() == 3)
    });
    assert!(!hit("user"), "the unchanged rule keeps its counter");
    assert!(hit("ip"), "the changed rule starts fresh");
}

/// Issue 23, defect 3: appending to a log file inside the rules directory
/// made the service reload its rules, each reload logged at info; with the
/// service's own log there, every reload's line triggered the next. Only
/// rules files count now, and a reload that finds the same files changes
/// nothing (debug log, not counted).
#[test]
fn regression_a_log_file_in_the_rules_directory_causes_no_reload() {
    let dir = TempDir::new("logfile");
    fs::write(dir.path("api.yaml"), rules_file("api", 5)).unwrap();
    let (rules, _w) = start(&dir.0);
    {
        use std::io::Write;
        let mut log = fs::OpenOptions::new().create(true).append(true).open(dir.path("floodgate.log")).unwrap();
        // Each line after more than the debounce (100 ms): each would have
        // been a reload of its own.
        for i in 0..8 {
            writeln!(log, "line {i}: rules reloaded").unwrap();
            log.sync_all().unwrap();
            std::thread::sleep(Duration::from_millis(150));
        }
    }
    // The same text written again (a new mtime): not a change either.
    fs::write(dir.path("api.yaml"), rules_file("api", 5)).unwrap();
    std::thread::sleep(Duration::from_millis(150));
    // A real change is still picked up, as the first reload.
    fs::write(dir.path("api.yaml"), rules_file("api", 6)).unwrap();
    eventually("the change is picked up", || limit_of(&rules, "api") == Some(6));
    assert_eq!(rules.reloads(), 1, "only the real change reloaded");
    assert!(!rules.reload().unwrap(), "nothing changed since");
    assert_eq!(rules.reloads(), 1);
}

/// A Kubernetes ConfigMap update: the files are symlinks through `..data`,
/// a symlink to a timestamped directory that is swapped for a new one.
#[test]
fn a_configmap_symlink_swap_is_picked_up() {
    let dir = TempDir::new("configmap");
    let symlink = |to: &str, at: &str| std::os::unix::fs::symlink(to, dir.path(at)).unwrap();
    dir.write("..2026_01_01_00_00_00.1/api.yaml", rules_file("api", 5));
    symlink("..2026_01_01_00_00_00.1", "..data");
    symlink("..data/api.yaml", "api.yaml");
    let (rules, _w) = start(&dir.0);
    assert_eq!(limit_of(&rules, "api"), Some(5));
    // What the kubelet does: a new directory, a new `..data_tmp` link
    // renamed over `..data`, the old directory removed.
    dir.write("..2026_01_01_00_01_00.2/api.yaml", rules_file("api", 7));
    symlink("..2026_01_01_00_01_00.2", "..data_tmp");
    fs::rename(dir.path("..data_tmp"), dir.path("..data")).unwrap();
    fs::remove_dir_all(dir.path("..2026_01_01_00_00_00.1")).unwrap();
    eventually("the swap is picked up", || limit_of(&rules, "api") == Some(7));
    assert_eq!(rules.failures(), 0);
}
