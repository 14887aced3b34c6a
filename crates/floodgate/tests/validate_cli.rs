//! `floodgate validate` through the real binary, on real directories.

use std::path::Path;
use std::process::{Command, Output};

use floodgate_testing::TempDir;

fn validate(dir: &Path) -> (Option<i32>, String, String) {
    let Output { status, stdout, stderr } =
        Command::new(env!("CARGO_BIN_EXE_floodgate")).arg("validate").arg(dir).output().unwrap();
    (status.code(), String::from_utf8_lossy(&stdout).into_owned(), String::from_utf8_lossy(&stderr).into_owned())
}

const GOOD: &str = "domain: api\ndescriptors:\n  - key: user\n    rate_limit: {unit: second, requests_per_unit: 5}\n";

#[test]
fn the_bundled_examples_are_valid() {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/config");
    let (code, out, err) = validate(&examples);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("5 domains"), "{out}");
    assert!(!out.contains("warning"), "{out}");
}

#[test]
fn a_clean_directory_prints_a_summary() {
    let dir = TempDir::new("clean");
    dir.write("api.yaml", GOOD);
    dir.write("nested/more/web.yml", GOOD.replace("api", "web"));
    dir.write(".hidden.yaml", "not: [valid");
    dir.write("api.yaml.swp", "not: [valid");
    dir.write("README.md", "# not a rules file");
    let (code, out, err) = validate(&dir.0);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("2 files, 2 domains, 2 rules"), "{out}");
}

#[cfg(unix)]
#[test]
fn symlinked_files_and_directories_are_followed() {
    // Kubernetes mounts ConfigMaps as symlinks to a hidden `..data` dir.
    let dir = TempDir::new("symlink");
    dir.write("..data/api.yaml", GOOD);
    std::os::unix::fs::symlink(dir.0.join("..data/api.yaml"), dir.0.join("api.yaml")).unwrap();
    let (code, out, err) = validate(&dir.0);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("1 files, 1 domains"), "{out}");
}

#[test]
fn every_error_of_every_file_is_reported_and_exits_64() {
    let dir = TempDir::new("bad");
    dir.write("a.yaml", "domain: a\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight}\n");
    dir.write("b.yaml", b"domain: b\ndescriptors:\n  - key: \xff\n".as_slice());
    dir.write("c.yaml", "domain: a\ndescriptors: []\n");
    dir.write("d.yaml", "");
    dir.write("e.yaml", "domain: e\ndescriptors: [\n");
    dir.write("f.yaml", format!("domain: f\n# {}\n", "x".repeat(5 << 20)));
    let (code, out, err) = validate(&dir.0);
    assert_eq!(code, Some(64), "{out}{err}");
    for want in [
        "a.yaml:4:24: descriptors[0].rate_limit.unit: invalid unit `fortnight`",
        "b.yaml: not valid UTF-8 at line 3",
        "c.yaml:1:9: domain `a` is already defined in",
        "d.yaml: empty file",
        "e.yaml:3:1: YAML syntax error",
        "f.yaml: larger than 4194304 bytes",
        "6 errors in",
    ] {
        assert!(err.contains(want), "want `{want}` in:\n{err}");
    }
    assert!(!err.contains("panicked"));
}

#[test]
fn a_missing_directory_exits_64() {
    let (code, _, err) = validate(Path::new("/nonexistent/floodgate/rules"));
    assert_eq!(code, Some(64));
    assert!(err.contains("cannot read the rules directory"), "{err}");
}
