//! The container image and the Debian package, built and run (issue 50).
//!
//! The image (`scripts/image`, a static binary on `scratch`): a rules
//! directory mounted read-only, decisions over HTTP and gRPC, a rules edit
//! on the host picked up, SIGTERM ending it with exit 0, a non-root user,
//! no shell, and two containers sharing one host `redis-server`'s counts.
//! The package (`scripts/deb`): installed with `dpkg -i` and purged again
//! where the test runs as root and floodgate is not installed already (a
//! throwaway CI machine), else unpacked into a temp dir; the installed
//! binary validates `/etc/floodgate` and serves as the package's user.
//!
//! The image test skips, saying why, where no container can run (no podman
//! and no docker daemon; `scripts/test` installs podman). Both build with
//! their own cargo target dir (`target/image`), so they never wait on the
//! lock of the cargo running these tests; at nice 19, so the tests beside
//! them keep their timing. Every container, the image and the package are
//! removed when the test ends, failed or not.

use crate::cli;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use cli::{eventually, run};
use floodgate_testing::{RedisServer, TempDir, free_port};
use serde_json::Value;

/// The longest a build (the static binary from cold, then the image or the
/// package) may take.
const BUILD_DEADLINE: Duration = Duration::from_secs(30 * 60);

/// What every container runs with: the runtime and limits this machine
/// allows (podman's default crun refuses its cgroups; higher limits are
/// refused).
const RUN_FLAGS: [&str; 6] = ["--runtime", "runc", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"];

/// The rules the containers serve: two an hour per user, exact (a sliding
/// log has no window edge for a test to straddle).
fn rules(per_hour: u32) -> String {
    format!(
        "domain: deploy\ndescriptors:\n  - key: user\n    rate_limit: {{algorithm: sliding_log, window: 1h, requests_per_unit: {per_hour}, failure_mode: closed}}\n"
    )
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.trim_ascii() == b"0")
}

/// A name no other run of these tests uses.
fn unique(what: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().subsec_nanos();
    format!("floodgate-test-{what}-{}-{nanos}-{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed))
}

/// Run `cmd` to the end, at most `within` (then it is killed and the test
/// fails), its output kept in `log`: (exit code, stdout, stderr).
fn run_bounded(mut cmd: Command, within: Duration, log: &TempDir) -> (Option<i32>, String, String) {
    let name = unique("log");
    let (out, err) = (log.path(&format!("{name}.out")), log.path(&format!("{name}.err")));
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{cmd:?} did not finish within {within:?}; its stderr:\n{}", std::fs::read_to_string(&err).unwrap());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    (status.code(), std::fs::read_to_string(out).unwrap(), std::fs::read_to_string(err).unwrap())
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A plain HTTP/1.1 request that fails softly (for waiting on a server
/// still starting): (status, body), or `None` when nothing answered.
fn try_http(addr: &str, method: &str, path: &str, body: &str, extra: &str) -> Option<(u16, String)> {
    let addr = addr.parse().ok()?;
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split(' ').nth(1)?.parse().ok()?;
    Some((code, text.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned()))
}

/// One `/v1/check` for `user` in domain `deploy`: (allowed, the limit).
fn decide(http: &str, user: &str) -> (bool, u64) {
    let body = format!(r#"{{"domain": "deploy", "descriptors": [{{"user": "{user}"}}]}}"#);
    let (code, body) = try_http(http, "POST", "/v1/check", &body, "").expect("the HTTP API answers");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    (v["allowed"].as_bool().unwrap(), v["descriptors"][0]["limit"].as_u64().unwrap_or(0))
}

/// One decision over gRPC (`floodgate check`, as Envoy asks): allowed?
fn decide_grpc(grpc: &str, user: &str) -> bool {
    let (code, out, err) =
        run(&["check", "--server", grpc, "--domain", "deploy", "--descriptor", &format!("user={user}")]);
    assert!(matches!(code, Some(0 | 1)), "check: {out}{err}");
    code == Some(0)
}

/// The container engine: podman, or docker where its daemon answers.
struct Engine {
    program: &'static str,
    log: TempDir,
}

impl Engine {
    /// The engine, or why there is none (the test then skips).
    fn find() -> Result<Engine, String> {
        let works = |program: &str| Command::new(program).arg("info").output();
        match works("podman") {
            Ok(o) if o.status.success() => return Ok(Engine { program: "podman", log: TempDir::new("deploy-log") }),
            Ok(o) => return Err(format!("`podman info` fails: {}", tail(&String::from_utf8_lossy(&o.stderr), 3))),
            Err(_) => {}
        }
        match works("docker") {
            Ok(o) if o.status.success() => Ok(Engine { program: "docker", log: TempDir::new("deploy-log") }),
            _ => Err("no podman and no docker daemon (scripts/test installs podman and runc)".into()),
        }
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new(self.program);
        c.args(args);
        c
    }

    /// Run an engine command to its end (at most `within`).
    fn output(&self, args: &[&str], within: Duration) -> (Option<i32>, String, String) {
        run_bounded(self.cmd(args), within, &self.log)
    }

    /// Run an engine command that must succeed: its stdout.
    fn ok(&self, args: &[&str]) -> String {
        let (code, out, err) = self.output(args, Duration::from_secs(60));
        assert_eq!(code, Some(0), "{} {args:?}: {out}{err}", self.program);
        out
    }
}

/// An image built for this test, removed on drop.
struct Image<'e> {
    engine: &'e Engine,
    tag: String,
}

impl<'e> Image<'e> {
    /// `scripts/image TAG`, timed.
    fn build(engine: &'e Engine) -> Image<'e> {
        let tag = format!("localhost/{}:t", unique("image"));
        let mut cmd = Command::new("nice");
        cmd.args(["-n", "19", "bash", "scripts/image", &tag])
            .current_dir(root())
            .env("CARGO_TARGET_DIR", root().join("target/image"))
            .env("FLOODGATE_ENGINE", engine.program);
        let started = Instant::now();
        let (code, out, err) = run_bounded(cmd, BUILD_DEADLINE, &engine.log);
        let image = Image { engine, tag };
        assert_eq!(code, Some(0), "scripts/image failed:\n{}", tail(&err, 40));
        eprintln!("deploy: {} in {:.0?}", out.trim(), started.elapsed());
        image
    }

    /// Start a container from this image: `flags` before the image, `args`
    /// after (none: its CMD).
    fn start(&self, flags: &[&str], args: &[&str]) -> Container<'e> {
        let name = unique("ctr");
        let mut all = vec!["run", "--detach", "--name", &name];
        all.extend(RUN_FLAGS);
        all.extend(flags);
        all.push(&self.tag);
        all.extend(args);
        let container = Container { engine: self.engine, name: name.clone() };
        self.engine.ok(&all);
        container
    }

    /// Run a container from this image to its end: (exit code, stdout, stderr).
    fn run(&self, flags: &[&str], args: &[&str]) -> (Option<i32>, String, String) {
        let mut all = vec!["run", "--rm"];
        all.extend(RUN_FLAGS);
        all.extend(flags);
        all.push(&self.tag);
        all.extend(args);
        self.engine.output(&all, Duration::from_secs(60))
    }
}

impl Drop for Image<'_> {
    fn drop(&mut self) {
        let _ = self.engine.cmd(&["rmi", "--force", &self.tag]).output();
    }
}

/// A running container, killed and removed on drop.
struct Container<'e> {
    engine: &'e Engine,
    name: String,
}

impl Container<'_> {
    fn logs(&self) -> String {
        let (_, out, err) = self.engine.output(&["logs", &self.name], Duration::from_secs(30));
        out + &err
    }

    /// Wait (at most 30 s) until its HTTP API at `http` says ready.
    fn wait_ready(&self, http: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while try_http(http, "GET", "/readyz", "", "").is_none_or(|(code, _)| code != 200) {
            assert!(Instant::now() < deadline, "{} not ready at {http} within 30 s:\n{}", self.name, self.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn inspect(&self, format: &str) -> String {
        self.engine.ok(&["inspect", "--format", format, &self.name]).trim().to_owned()
    }
}

impl Drop for Container<'_> {
    fn drop(&mut self) {
        let _ = self.engine.cmd(&["kill", &self.name]).output();
        let _ = self.engine.cmd(&["rm", "--force", &self.name]).output();
    }
}

#[test]
fn container_image_serves_reloads_stops_and_shares_redis() {
    let engine = match Engine::find() {
        Ok(e) => e,
        Err(why) => {
            eprintln!("deploy: SKIPPED the container image test: {why}");
            return;
        }
    };
    let started = Instant::now();
    let image = Image::build(&engine);
    let (code, out, err) = image.run(&[], &["--version"]);
    if code != Some(0) && err.contains("OCI") {
        eprintln!("deploy: SKIPPED the container image test: no container can run here: {}", tail(&err, 3));
        return;
    }
    assert_eq!((code, out.split_whitespace().next()), (Some(0), Some("floodgate")), "{out}{err}");

    image_is_small_and_holds_only_the_binary(&image);
    serves_mounted_rules_reloads_and_stops_on_sigterm(&image);
    any_user_of_group_0_can_run_it(&image);
    two_containers_share_one_redis(&image);
    eprintln!("deploy: the container image test took {:.0?}", started.elapsed());
}

/// ≤ 30 MB, nothing but the binary and its two directories (no shell to
/// run), labelled, and its user not root.
fn image_is_small_and_holds_only_the_binary(image: &Image) {
    let e = image.engine;
    let size: u64 = e.ok(&["image", "inspect", "--format", "{{.Size}}", &image.tag]).trim().parse().unwrap();
    assert!(size <= 30_000_000, "the image takes {size} bytes");
    let user = e.ok(&["image", "inspect", "--format", "{{.Config.User}}", &image.tag]);
    assert_eq!(user.trim(), "65532:65532");
    let labels = e.ok(&["image", "inspect", "--format", "{{json .Config.Labels}}", &image.tag]);
    let labels: Value = serde_json::from_str(&labels).unwrap();
    assert_eq!(labels["org.opencontainers.image.licenses"], "Apache-2.0", "{labels}");
    assert_eq!(labels["org.opencontainers.image.version"], env!("CARGO_PKG_VERSION"), "{labels}");
    assert!(labels["org.opencontainers.image.source"].is_string(), "{labels}");

    let (code, _, err) = image.run(&["--entrypoint", "/bin/sh"], &["-c", "true"]);
    assert_ne!(code, Some(0), "a shell ran in the image");
    assert!(err.contains("/bin/sh") && err.contains("no such file or directory"), "{err}");
    // Its files, whole: what a created container exports (the engine adds
    // its own mount points: /etc's name files, /dev, /proc, /sys, /run).
    let created = Container { engine: e, name: unique("export") };
    e.ok(&["create", "--name", &created.name, &image.tag]);
    let tar = e.log.path(&format!("{}.tar", created.name));
    e.ok(&["export", "--output", tar.to_str().unwrap(), &created.name]);
    let listing = Command::new("tar").arg("-tf").arg(&tar).output().unwrap();
    let files: Vec<String> = String::from_utf8_lossy(&listing.stdout)
        .lines()
        .map(|l| l.trim_start_matches("./").to_owned())
        .filter(|l| !l.ends_with('/') && !l.is_empty())
        .filter(|l| !["etc/", "dev/", "proc/", "sys/", "run/", ".dockerenv"].iter().any(|p| l.starts_with(p)))
        .collect();
    assert_eq!(files, ["usr/bin/floodgate"], "the image's files");
}

/// The image's own defaults (gRPC and HTTP on 0.0.0.0) published on free
/// host ports, its rules from a host directory mounted read-only, the
/// admin API opened with a token through the environment.
fn serves_mounted_rules_reloads_and_stops_on_sigterm(image: &Image) {
    let e = image.engine;
    let dir = TempDir::new("deploy-rules");
    dir.write("rules/deploy.yaml", rules(2));
    let mount = format!("{}:/etc/floodgate:ro", dir.path("rules").display());
    let (http_port, grpc_port, admin_port) = (free_port(), free_port(), free_port());
    let publish = [
        format!("127.0.0.1:{http_port}:8080"),
        format!("127.0.0.1:{grpc_port}:8081"),
        format!("127.0.0.1:{admin_port}:9090"),
    ];
    let c = image.start(
        &[
            "--volume",
            &mount,
            "--publish",
            &publish[0],
            "--publish",
            &publish[1],
            "--publish",
            &publish[2],
            "--env",
            "FLOODGATE_CONFIG=/etc/floodgate",
            "--env",
            "FLOODGATE_ADMIN_ADDR=0.0.0.0:9090",
            "--env",
            "FLOODGATE_ADMIN_TOKEN=s3cret",
        ],
        &[],
    );
    let (http, grpc, admin) =
        (format!("127.0.0.1:{http_port}"), format!("127.0.0.1:{grpc_port}"), format!("127.0.0.1:{admin_port}"));
    c.wait_ready(&http);
    let logs = c.logs();
    assert!(logs.contains("grpc_addr=0.0.0.0:8081 http_addr=0.0.0.0:8080 admin_addr=0.0.0.0:9090"), "{logs}");
    assert!(logs.contains("rules=/etc/floodgate"), "{logs}");
    assert!(logs.contains("/var/lib/floodgate/admin-0.0.0.0-9090/overrides.redb"), "the state directory: {logs}");

    // Non-root: the process's own ids, as the kernel has them (the same
    // inside and out where the engine runs as root, with no user namespace).
    if is_root() {
        let pid = c.inspect("{{.State.Pid}}");
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let uid = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
        assert_eq!(uid.split_whitespace().skip(1).collect::<Vec<_>>(), ["65532"; 4], "{uid}");
    }

    // One key's two an hour, shared by HTTP and gRPC.
    assert_eq!(decide(&http, "ann"), (true, 2));
    assert!(decide_grpc(&grpc, "ann"));
    assert_eq!(decide(&http, "ann"), (false, 2));
    assert!(!decide_grpc(&grpc, "ann"));
    let bearer = "Authorization: Bearer s3cret\r\n";
    assert_eq!(try_http(&admin, "GET", "/admin/v1/status", "", bearer).map(|r| r.0), Some(200));
    assert_eq!(try_http(&admin, "GET", "/admin/v1/status", "", "").map(|r| r.0), Some(401));

    // An edit on the host, written whole and renamed in as editors and
    // deploy tools do, is picked up by the running container.
    dir.write("rules/.deploy.yaml.new", rules(5));
    std::fs::rename(dir.path("rules/.deploy.yaml.new"), dir.path("rules/deploy.yaml")).unwrap();
    eventually("the container reloads the edited rules", Duration::from_secs(20), || decide(&http, "bob").1 == 5);
    assert_eq!(decide(&http, "ann"), (true, 5), "ann is admitted again under the new limit");

    // SIGTERM (the engine's stop): exit 0, well within the grace period
    // (10 s), so the engine never needs its SIGKILL (30 s here).
    let stopping = Instant::now();
    e.ok(&["stop", "--time", "30", &c.name]);
    let took = stopping.elapsed();
    assert_eq!(c.inspect("{{.State.ExitCode}}"), "0", "{}", c.logs());
    assert!(took < Duration::from_secs(10), "stopped in {took:?}");
    assert!(c.logs().contains("SIGTERM received"), "{}", c.logs());
}

/// Any user of group 0 (`--user 4242`; OpenShift's arbitrary uids) writes
/// the state directory; a non-loopback admin address without a token is
/// refused (exit 64), as outside the image.
fn any_user_of_group_0_can_run_it(image: &Image) {
    let http_port = free_port();
    let publish = format!("127.0.0.1:{http_port}:8080");
    let c = image.start(&["--user", "4242", "--publish", &publish], &[]);
    c.wait_ready(&format!("127.0.0.1:{http_port}"));
    assert!(c.logs().contains("/var/lib/floodgate/admin-127.0.0.1-9090/overrides.redb"), "{}", c.logs());

    let (code, _, err) = image.run(&["--env", "FLOODGATE_ADMIN_ADDR=0.0.0.0:9090"], &[]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("no --admin-token is set"), "{err}");
}

/// Two containers on the host network against one `redis-server` started
/// here: one limit of ten, taken in turn, admits exactly ten.
fn two_containers_share_one_redis(image: &Image) {
    let redis = RedisServer::start();
    let dir = TempDir::new("deploy-redis-rules");
    dir.write("rules/deploy.yaml", rules(10));
    let mount = format!("{}:/etc/floodgate:ro", dir.path("rules").display());
    let store = format!("FLOODGATE_STORE={}", redis.url());
    let instances: Vec<(Container, String, String)> = (0..2)
        .map(|_| {
            let (http, grpc, admin) = (free_port(), free_port(), free_port());
            let env = [
                format!("FLOODGATE_HTTP_ADDR=127.0.0.1:{http}"),
                format!("FLOODGATE_GRPC_ADDR=127.0.0.1:{grpc}"),
                format!("FLOODGATE_ADMIN_ADDR=127.0.0.1:{admin}"),
            ];
            let c = image.start(
                &[
                    "--network",
                    "host",
                    "--volume",
                    &mount,
                    "--env",
                    "FLOODGATE_CONFIG=/etc/floodgate",
                    "--env",
                    &store,
                    "--env",
                    "FLOODGATE_REDIS_TIMEOUT=2s",
                    "--env",
                    &env[0],
                    "--env",
                    &env[1],
                    "--env",
                    &env[2],
                ],
                &[],
            );
            (c, format!("127.0.0.1:{http}"), format!("127.0.0.1:{grpc}"))
        })
        .collect();
    for (c, http, _) in &instances {
        c.wait_ready(http);
    }
    let answers: Vec<bool> = (0..12).map(|i| decide(&instances[i % 2].1, "carol").0).collect();
    assert_eq!(answers, [[true; 10].as_slice(), &[false; 2]].concat(), "ten in all, whichever container asks");
    for (_, _, grpc) in &instances {
        assert!(!decide_grpc(grpc, "carol"), "gRPC sees the shared count too");
    }
    assert!(!redis.cli(&["--scan", "--pattern", "fg:*"]).trim().is_empty(), "the counters live in Redis");
}

/// The package installed (or unpacked) and its binary run from there.
#[test]
fn debian_package_installs_validates_and_serves() {
    if Command::new("dpkg-deb").arg("--version").output().is_err() {
        eprintln!("deploy: SKIPPED the Debian package test: no dpkg-deb here");
        return;
    }
    let out = TempDir::new("deploy-deb");
    let mut cmd = Command::new("nice");
    cmd.args(["-n", "19", "bash", "scripts/deb"])
        .arg(out.path("deb"))
        .current_dir(root())
        .env("CARGO_TARGET_DIR", root().join("target/image"));
    let started = Instant::now();
    let (code, stdout, err) = run_bounded(cmd, BUILD_DEADLINE, &out);
    assert_eq!(code, Some(0), "scripts/deb failed:\n{}", tail(&err, 40));
    let deb = stdout.lines().last().expect("scripts/deb prints the package's path").to_owned();
    eprintln!("deploy: {deb} built in {:.0?}", started.elapsed());

    let dpkg_deb = |args: &[&str]| {
        let o = Command::new("dpkg-deb").args(args).arg(&deb).output().unwrap();
        assert!(o.status.success(), "dpkg-deb {args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    assert_eq!(dpkg_deb(&["--field"]).lines().next(), Some("Package: floodgate"));
    let contents = dpkg_deb(&["--contents"]);
    for path in ["./usr/bin/floodgate", "./usr/lib/systemd/system/floodgate.service", "./etc/floodgate/api.yaml"] {
        assert!(contents.contains(path), "{path} in:\n{contents}");
    }
    let conffiles = Command::new("dpkg-deb").args(["--info", &deb, "conffiles"]).output().unwrap();
    let conffiles = String::from_utf8_lossy(&conffiles.stdout);
    assert!(
        conffiles.contains("/etc/floodgate/api.yaml") && conffiles.contains("/etc/default/floodgate"),
        "{conffiles}"
    );

    let installed_already = Command::new("dpkg-query")
        .args(["--show", "--showformat", "${Status}", "floodgate"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(" installed"));
    if is_root() && !installed_already {
        let installed = Installed::install(&deb, &out);
        runs_from(Path::new("/"));
        serves_as_the_package_user();
        if Command::new("systemd-analyze").arg("--version").output().is_ok() {
            let (code, o, e) = run_bounded(
                cmd_of("systemd-analyze", &["verify", "/usr/lib/systemd/system/floodgate.service"]),
                Duration::from_secs(60),
                &out,
            );
            assert_eq!(code, Some(0), "systemd-analyze verify: {o}{e}");
        }
        drop(installed);
        for gone in ["/usr/bin/floodgate", "/etc/floodgate", "/var/lib/floodgate"] {
            assert!(!Path::new(gone).exists(), "{gone} after the purge");
        }
    } else {
        eprintln!(
            "deploy: the package is unpacked, not installed (dpkg -i only as root, where floodgate is not installed)"
        );
        let unpacked = out.path("root");
        let o = Command::new("dpkg-deb").arg("--extract").arg(&deb).arg(&unpacked).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        runs_from(&unpacked);
    }
}

fn cmd_of(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    c
}

/// `floodgate --version` and `floodgate validate /etc/floodgate` from the
/// package's files under `root`.
fn runs_from(root: &Path) {
    let bin = root.join("usr/bin/floodgate");
    let o = Command::new(&bin).arg("--version").output().unwrap();
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), concat!("floodgate ", env!("CARGO_PKG_VERSION")));
    let o = Command::new(&bin).arg("validate").arg(root.join("etc/floodgate")).output().unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{text}{}", String::from_utf8_lossy(&o.stderr));
    assert!(text.contains("5 files, 5 domains"), "{text}");
}

/// The installed binary as the service runs it (its user, the unit's
/// environment, no home): serving, then exit 0 on SIGTERM.
fn serves_as_the_package_user() {
    let passwd = Command::new("getent").args(["passwd", "floodgate"]).output().unwrap();
    let passwd = String::from_utf8_lossy(&passwd.stdout);
    assert!(passwd.contains(":/var/lib/floodgate:") && passwd.trim_end().ends_with("nologin"), "{passwd}");
    let (http, grpc, admin) = (free_port(), free_port(), free_port());
    let mut child = Command::new("setpriv")
        .args(["--reuid", "floodgate", "--regid", "floodgate", "--init-groups", "--reset-env", "--"])
        .args(["env", "FLOODGATE_CONFIG=/etc/floodgate", "FLOODGATE_STATE_DIR=/var/lib/floodgate"])
        .args(["/usr/bin/floodgate", "serve", "--http-addr", &format!("127.0.0.1:{http}")])
        .args(["--grpc-addr", &format!("127.0.0.1:{grpc}"), "--admin-addr", &format!("127.0.0.1:{admin}")])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let http = format!("127.0.0.1:{http}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while try_http(&http, "GET", "/readyz", "", "").is_none_or(|(code, _)| code != 200) {
        if Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the installed floodgate did not serve as its user within 20 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(Path::new(&format!("/var/lib/floodgate/admin-127.0.0.1-{admin}/overrides.redb")).is_file());
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the installed floodgate did not stop within 10 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(0));
}

/// The package installed with `dpkg -i`; purged on drop, and its user
/// removed when this test made it.
struct Installed {
    user_existed: bool,
}

impl Installed {
    fn install(deb: &str, log: &TempDir) -> Installed {
        let user_existed = Command::new("getent").args(["passwd", "floodgate"]).output().unwrap().status.success();
        let installed = Installed { user_existed };
        let (code, o, e) = run_bounded(cmd_of("dpkg", &["--install", deb]), Duration::from_secs(300), log);
        assert_eq!(code, Some(0), "dpkg --install: {o}{e}");
        installed
    }
}

impl Drop for Installed {
    fn drop(&mut self) {
        let purged: Output = Command::new("dpkg").args(["--purge", "floodgate"]).output().unwrap();
        if !purged.status.success() {
            eprintln!("deploy: dpkg --purge floodgate failed: {}", String::from_utf8_lossy(&purged.stderr));
        }
        if !self.user_existed {
            let _ = Command::new("userdel").arg("floodgate").output();
            let _ = Command::new("groupdel").arg("floodgate").output();
        }
    }
}
