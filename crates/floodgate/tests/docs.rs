//! The README's and the guide's code blocks, run, so that an example cannot
//! rot (issue 45). Every fenced block of `README.md` and `docs/*.md` is one
//! of:
//!
//! * ```` ```sh ```` — run. `$ ` starts a command (continued onto the next
//!   line after a trailing ` \`); the lines after it, up to the next
//!   command, are its expected output (stdout and stderr), compared line by
//!   line with trailing spaces ignored; `…` inside a line matches any text,
//!   and a line that is only `…` any number of lines. A command shown
//!   without output must exit 0. Every `sh` block of a file runs in order
//!   in one bash session, in a fresh directory, with `floodgate` on `PATH`;
//!   a command ending in ` &` starts a background process, waited for until
//!   it serves (see [`wait_for`]) and killed at the file's end. As root,
//!   each file runs in its own network namespace, so the examples' default
//!   ports never meet anything else on the machine.
//! * ```` ```sh not-run: REASON ```` (any language) — shown only; the
//!   reason is required. A `yaml` one is still parsed.
//! * ```` ```LANG file=PATH ```` — written to PATH (in the file's directory)
//!   when reached, for the commands after it.
//! * ```` ```rust ```` — a doctest: the file must be included in a crate's
//!   doctests (`#[doc = include_str!(…)]` under `#[cfg(doctest)]`).
//! * ```` ```text ```` — a picture in text, not run.
//!
//! Any other fence is an error, so a new example is run or says why not.
//!
//! Every relative link of those files and of `BENCHMARKS.md` (`[text](path)`,
//! `![alt](path)`, `[label]: path`, with or without `#anchor`) must name a
//! file that exists and, with an anchor into Markdown, one of its headings
//! (GitHub's anchors: see [`anchor`]).

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use floodgate_testing::TempDir;

/// The workspace's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the workspace root")
}

/// The Markdown files whose blocks are run: the README and the guide.
fn documents() -> Vec<PathBuf> {
    let root = root();
    let mut files = vec![root.join("README.md")];
    let mut guide: Vec<PathBuf> = std::fs::read_dir(root.join("docs"))
        .expect("docs/")
        .map(|e| e.expect("a docs/ entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    guide.sort();
    files.extend(guide);
    files
}

/// One fenced block: where it starts (1-based line of the fence), its info
/// string split into language and the rest, and its text.
#[derive(Debug)]
struct Block {
    line: usize,
    lang: String,
    attrs: String,
    text: String,
}

/// The fenced blocks of a Markdown text (``` fences; a longer fence closes
/// only on as many backticks).
fn blocks(md: &str) -> Result<Vec<Block>, String> {
    let mut out = Vec::new();
    let mut lines = md.lines().enumerate();
    while let Some((i, line)) = lines.next() {
        let trimmed = line.trim_start();
        let ticks = trimmed.chars().take_while(|&c| c == '`').count();
        if ticks < 3 {
            continue;
        }
        let indent = line.len() - trimmed.len();
        let info = trimmed[ticks..].trim();
        let (lang, attrs) = info.split_once(char::is_whitespace).unwrap_or((info, ""));
        let mut text = String::new();
        let mut closed = false;
        for (_, l) in lines.by_ref() {
            let t = l.trim_start();
            if t.chars().take_while(|&c| c == '`').count() >= ticks && t.trim_matches('`').trim().is_empty() {
                closed = true;
                break;
            }
            text.push_str(l.get(indent.min(l.len() - t.len())..).unwrap_or(l));
            text.push('\n');
        }
        if !closed {
            return Err(format!("{}: a block opened here is never closed", i + 1));
        }
        out.push(Block { line: i + 1, lang: lang.to_owned(), attrs: attrs.trim().to_owned(), text });
    }
    Ok(out)
}

/// One command of an `sh` block and the output the text shows for it.
#[derive(Debug)]
struct Step {
    line: usize,
    command: String,
    expected: Vec<String>,
}

/// The commands of an `sh` block starting at `line` (its fence).
fn steps(block: &str, line: usize) -> Result<Vec<Step>, String> {
    let mut steps: Vec<Step> = Vec::new();
    let mut continuing = false;
    for (i, l) in block.lines().enumerate() {
        let at = line + 1 + i;
        if continuing {
            let step = steps.last_mut().expect("a command being continued");
            step.command.push('\n');
            step.command.push_str(l);
            continuing = l.ends_with('\\');
        } else if let Some(cmd) = l.strip_prefix("$ ") {
            steps.push(Step { line: at, command: cmd.to_owned(), expected: Vec::new() });
            continuing = cmd.ends_with('\\');
        } else if let Some(step) = steps.last_mut() {
            step.expected.push(l.trim_end().to_owned());
        } else if !l.trim().is_empty() {
            return Err(format!("{at}: output before any command (a command starts with `$ `)"));
        }
    }
    if continuing {
        return Err(format!("{line}: the block ends inside a command (a trailing `\\`)"));
    }
    for s in &mut steps {
        while s.expected.last().is_some_and(String::is_empty) {
            s.expected.pop();
        }
    }
    Ok(steps)
}

/// Whether `text` matches `pattern`, where `…` matches any run of text.
fn line_matches(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('…').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let (first, last) = (parts[0], parts[parts.len() - 1]);
    if !text.starts_with(first) || text.len() < first.len() + last.len() || !text.ends_with(last) {
        return false;
    }
    let mut rest = &text[first.len()..text.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    true
}

/// Whether the output's lines match the expected ones, where a line that is
/// only `…` matches any number of lines.
fn lines_match(expected: &[String], got: &[&str]) -> bool {
    match expected.split_first() {
        None => got.is_empty(),
        Some((e, rest)) if e == "…" => (0..=got.len()).any(|skip| lines_match(rest, &got[skip..])),
        Some((e, rest)) => {
            got.split_first().is_some_and(|(g, more)| line_matches(e, g.trim_end()) && lines_match(rest, more))
        }
    }
}

/// What to wait for after a background command, so that the next command
/// finds it serving: a `floodgate serve`'s HTTP API (`/healthz`), a
/// `floodgate proxy`'s listener, a `redis-server`'s `PING`, else the first
/// `:PORT` or `--port PORT` of the command. Empty when nothing says.
fn wait_for(command: &str) -> String {
    let words: Vec<&str> = command.split_whitespace().collect();
    let flag = |name: &str| words.windows(2).find(|w| w[0] == name).map(|w| w[1].to_owned());
    let port_of = |addr: &str| addr.rsplit(':').next().unwrap_or(addr).to_owned();
    if words.contains(&"serve") && command.contains("floodgate") {
        let http = flag("--http-addr").unwrap_or_else(|| "127.0.0.1:8080".into());
        return format!("__wait_http {}", port_of(&http));
    }
    if words.contains(&"proxy") && command.contains("floodgate") {
        let listen = flag("--listen").unwrap_or_else(|| "0.0.0.0:8000".into());
        return format!("__wait_tcp {}", port_of(&listen));
    }
    if command.contains("redis-server") {
        return format!("__wait_redis {}", flag("--port").unwrap_or_else(|| "6379".into()));
    }
    if let Some(port) = flag("--port") {
        return format!("__wait_tcp {port}");
    }
    let port = words.iter().find_map(|w| {
        let p = w.rsplit(':').next()?;
        (p.len() >= 2 && p.chars().all(|c| c.is_ascii_digit()) && (w.contains(':') || w.len() >= 4))
            .then(|| p.to_owned())
    });
    port.map(|p| format!("__wait_tcp {p}")).unwrap_or_default()
}

/// The bash script that runs a file's blocks: each command's output to
/// `out/N`, its status to `out/N.rc`.
const PREAMBLE: &str = r#"
__wait_http() { for _ in $(seq 400); do curl -sf "http://127.0.0.1:$1/healthz" >/dev/null 2>&1 && return 0; sleep 0.05; done; echo "waited 20 s for 127.0.0.1:$1/healthz" >&2; }
__wait_tcp() { for _ in $(seq 400); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0; sleep 0.05; done; echo "waited 20 s for port $1" >&2; }
__wait_redis() { for _ in $(seq 400); do [ "$(redis-cli -p "$1" ping 2>/dev/null)" = PONG ] && return 0; sleep 0.05; done; echo "waited 20 s for redis on $1" >&2; }
trap 'kill $(jobs -p) 2>/dev/null; wait 2>/dev/null' EXIT
"#;

/// One checked command in the script, by its number.
struct Check {
    line: usize,
    command: String,
    expected: Vec<String>,
}

/// A document's script and the checks of its commands, or what is wrong
/// with its blocks.
fn script(doc: &Path, blocks: &[Block], crates_docs: &str) -> Result<(String, Vec<Check>), Vec<String>> {
    let mut errors = Vec::new();
    let mut script = String::from(PREAMBLE);
    let mut checks = Vec::new();
    for b in blocks {
        let at = format!("{}:{}", doc.display(), b.line);
        if let Some(reason) = b.attrs.strip_prefix("not-run:") {
            if reason.trim().is_empty() {
                errors.push(format!("{at}: `not-run:` needs a reason (`not-run: needs Envoy`)"));
            }
            if b.lang == "yaml"
                && let Err(e) = parse_yaml(&b.text)
            {
                errors.push(format!("{at}: the YAML does not parse: {e}"));
            }
            continue;
        }
        if let Some(path) = b.attrs.strip_prefix("file=") {
            let path = path.trim();
            if path.is_empty() || path.starts_with('/') || path.contains("..") {
                errors
                    .push(format!("{at}: `file=` takes a relative path inside the example's directory, not `{path}`"));
                continue;
            }
            script.push_str(&format!(
                "mkdir -p \"$(dirname '{path}')\"\ncat > '{path}' <<'__FLOODGATE_DOCS_EOF'\n{}__FLOODGATE_DOCS_EOF\n",
                b.text
            ));
            continue;
        }
        match (b.lang.as_str(), b.attrs.as_str()) {
            ("sh", "") => match steps(&b.text, b.line) {
                Ok(steps) => {
                    for s in steps {
                        let n = checks.len();
                        let cmd = s.command.trim_end();
                        if let Some(bg) = cmd.strip_suffix('&') {
                            script.push_str(&format!("{bg} > out/{n} 2>&1 &\necho 0 > out/{n}.rc\n{}\n", wait_for(bg)));
                        } else {
                            script.push_str(&format!("{{ {cmd}\n}} > out/{n} 2>&1 < /dev/null\necho $? > out/{n}.rc\n"));
                        }
                        checks.push(Check { line: s.line, command: s.command, expected: s.expected });
                    }
                }
                Err(e) => errors.push(format!("{}:{e}", doc.display())),
            },
            (lang, _) if lang.split(',').next() == Some("rust") => {
                // Included from a crate's `src/lib.rs`: three folders up is
                // the workspace's root.
                if !crates_docs.contains(&format!("\"../../../{}\")", doc.display())) {
                    errors.push(format!(
                        "{at}: a Rust block in a file no crate runs as doctests: include `{}` in a crate's docs (`#[cfg(doctest)] #[doc = include_str!(…)]`)",
                        doc.display()
                    ));
                }
            }
            ("text", "") => {}
            (lang, attrs) => errors.push(format!(
                "{at}: a ```{lang} {attrs}``` block is neither run nor excused: write ```sh (run), ```LANG file=PATH (written for the commands), or ```LANG not-run: REASON"
            )),
        }
    }
    if errors.is_empty() { Ok((script, checks)) } else { Err(errors) }
}

/// Parses YAML as the rules loader does, for the blocks shown only.
fn parse_yaml(text: &str) -> Result<(), String> {
    let mut parser = saphyr_parser::Parser::new_from_str(text);
    loop {
        match parser.next_event() {
            Some(Ok((saphyr_parser::Event::StreamEnd, _))) | None => return Ok(()),
            Some(Ok(_)) => {}
            Some(Err(e)) => return Err(e.to_string()),
        }
    }
}

/// The `#[doc = include_str!(…)]` lines of every crate's sources, to check
/// that the Rust blocks are run as doctests.
fn crates_docs() -> String {
    let mut all = String::new();
    for entry in std::fs::read_dir(root().join("crates")).expect("crates/") {
        let lib = entry.expect("a crate").path().join("src/lib.rs");
        if let Ok(text) = std::fs::read_to_string(lib) {
            all.extend(text.lines().filter(|l| l.contains("include_str!")).map(|l| format!("{l}\n")));
        }
    }
    all
}

/// Whether this process may make network namespaces (`unshare --net`:
/// root, or a user namespace allowed).
fn namespaces() -> bool {
    Command::new("unshare").args(["--net", "true"]).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

/// Runs a document's script in `dir` (in a network namespace of its own
/// when `own_namespace`), bounded in time.
fn run(dir: &Path, script: &str, own_namespace: bool) -> Result<(), String> {
    std::fs::create_dir_all(dir.join("out")).map_err(|e| e.to_string())?;
    std::fs::write(dir.join("script.sh"), script).map_err(|e| e.to_string())?;
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_floodgate")).parent().expect("the binary's directory").to_owned();
    let path = format!("{}:{}", bin_dir.display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = if own_namespace {
        let mut c = Command::new("unshare");
        c.args(["--net", "bash", "-c", "ip link set lo up && exec bash script.sh"]);
        c
    } else {
        let mut c = Command::new("bash");
        c.arg("script.sh");
        c
    };
    cmd.current_dir(dir).env("PATH", path).env("FLOODGATE_STATE_DIR", dir.join("state")).env("HOME", dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("FLOODGATE_") && k != "FLOODGATE_STATE_DIR" {
            cmd.env_remove(k);
        }
    }
    // Its own process group: on a timeout, whatever the examples started
    // is killed with it (while the shell still holds the group).
    let mut child =
        cmd.process_group(0).stdout(Stdio::null()).stderr(Stdio::null()).spawn().map_err(|e| format!("bash: {e}"))?;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            // The script's own exit trap has stopped what it started (its
            // group may be gone, and its number taken by another).
            return if status.success() { Ok(()) } else { Err(format!("the examples' shell exited {status}")) };
        }
        if Instant::now() > deadline {
            let group = format!("-{}", child.id());
            let _ = Command::new("kill").args(["-9", &group]).stderr(Stdio::null()).status();
            let _ = child.wait();
            return Err("the examples ran over 180 s".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn every_block_of_the_readme_and_the_guide_runs_or_says_why_not() {
    let crates_docs = crates_docs();
    let own_namespace = namespaces();
    let mut failures = Vec::new();
    for doc in documents() {
        let md = std::fs::read_to_string(&doc).expect("a readable document");
        let shown = doc.strip_prefix(root()).unwrap_or(&doc).to_owned();
        let blocks = match blocks(&md) {
            Ok(b) => b,
            Err(e) => {
                failures.push(format!("{}:{e}", shown.display()));
                continue;
            }
        };
        let (script, checks) = match script(&shown, &blocks, &crates_docs) {
            Ok(s) => s,
            Err(errors) => {
                failures.extend(errors);
                continue;
            }
        };
        if checks.is_empty() {
            continue;
        }
        let dir = TempDir::new("docs");
        if let Err(e) = run(&dir.0, &script, own_namespace) {
            failures.push(format!("{}: {e}", shown.display()));
        }
        for (n, c) in checks.iter().enumerate() {
            let out = std::fs::read_to_string(dir.0.join(format!("out/{n}"))).unwrap_or_default();
            let rc = std::fs::read_to_string(dir.0.join(format!("out/{n}.rc"))).unwrap_or_default();
            let got: Vec<&str> = out.lines().collect();
            let at = format!("{}:{}: `{}`", shown.display(), c.line, c.command);
            if rc.trim().is_empty() {
                failures.push(format!("{at}: never ran"));
            } else if c.expected.iter().all(|l| l.is_empty()) {
                if rc.trim() != "0" {
                    failures.push(format!(
                        "{at}: exited {} (a command shown without output must succeed):\n{out}",
                        rc.trim()
                    ));
                }
            } else if !lines_match(&c.expected, &got) {
                failures.push(format!(
                    "{at}: the output differs from the text\n--- the text shows:\n{}\n--- it printed:\n{out}",
                    c.expected.join("\n")
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{} problems in the docs' examples:\n\n{}", failures.len(), failures.join("\n\n"));
}

/// GitHub's anchor for a heading's text: lower case, every character but
/// letters, digits, `-`, `_` and spaces dropped (so `` ` ``, `:`, `(`, `.`),
/// spaces turned into `-`. A repeated heading gets `-1`, `-2`, … (see
/// [`anchors`]).
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown text's headings (`#` lines outside blocks).
fn anchors(md: &str) -> Vec<String> {
    let mut seen: Vec<String> = Vec::new();
    for (_, line) in prose(md) {
        let Some(h) = line.trim_start().strip_prefix('#') else { continue };
        let h = h.trim_start_matches('#');
        if !h.starts_with(' ') {
            continue;
        }
        let a = anchor(h);
        let n = seen.iter().filter(|s| **s == a || s.strip_prefix(a.as_str()).is_some_and(is_suffix)).count();
        seen.push(if n == 0 { a } else { format!("{a}-{n}") });
    }
    seen
}

/// `-N`: the suffix GitHub gives a repeated heading.
fn is_suffix(rest: &str) -> bool {
    rest.strip_prefix('-').is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// The lines of a Markdown text outside fenced blocks, with their numbers.
fn prose(md: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<usize> = None;
    for (i, line) in md.lines().enumerate() {
        let t = line.trim_start();
        let ticks = t.chars().take_while(|&c| c == '`').count();
        match fence {
            Some(n) if ticks >= n && t.trim_matches('`').trim().is_empty() => fence = None,
            Some(_) => {}
            None if ticks >= 3 => fence = Some(ticks),
            None => out.push((i + 1, line)),
        }
    }
    out
}

/// The link targets of a Markdown text, with their line numbers: inline
/// `](target)` outside code spans, and `[label]: target` definitions.
fn links(md: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(md) {
        let t = line.trim_start();
        if let Some(rest) = t.strip_prefix('[').and_then(|r| r.split_once("]: ")) {
            out.push((n, rest.1.split_whitespace().next().unwrap_or("").to_owned()));
            continue;
        }
        // Code spans hide what looks like a link: drop them first.
        let mut plain = String::new();
        for (k, part) in line.split('`').enumerate() {
            if k % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].split_whitespace().next().unwrap_or("");
            out.push((n, target.trim_start_matches('<').trim_end_matches('>').to_owned()));
            rest = &after[end..];
        }
    }
    out
}

/// What is wrong with a relative link of `doc` (None: it resolves).
fn broken(doc: &Path, target: &str) -> Option<String> {
    if target.contains("://") || target.starts_with("mailto:") {
        return None;
    }
    let (path, fragment) = target.split_once('#').unwrap_or((target, ""));
    let file = if path.is_empty() { doc.to_owned() } else { doc.parent().expect("a document's folder").join(path) };
    if !file.exists() {
        return Some(format!("no such file: {}", file.display()));
    }
    if fragment.is_empty() || file.extension().is_none_or(|e| e != "md") {
        return None;
    }
    let md = std::fs::read_to_string(&file).ok()?;
    if anchors(&md).iter().any(|a| a == fragment) {
        None
    } else {
        Some(format!("no heading with the anchor #{fragment} in {}", file.display()))
    }
}

#[test]
fn every_relative_link_of_the_readme_the_guide_and_the_benchmarks_resolves() {
    let mut docs = documents();
    docs.push(root().join("BENCHMARKS.md"));
    let mut failures = Vec::new();
    let mut count = 0;
    for doc in docs {
        let md = std::fs::read_to_string(&doc).expect("a readable document");
        let shown = doc.strip_prefix(root()).unwrap_or(&doc).display().to_string();
        for (line, target) in links(&md) {
            count += 1;
            if let Some(why) = broken(&doc, &target) {
                failures.push(format!("{shown}:{line}: ({target}): {why}"));
            }
        }
    }
    assert!(count > 50, "only {count} links found: is the link reader broken?");
    assert!(failures.is_empty(), "{} broken links:\n{}", failures.len(), failures.join("\n"));
}

/// The README stays a page a newcomer reads (≤ 200 lines) and BENCHMARKS.md
/// today's figures (≤ 600 lines; the history is in git): issue 45.
#[test]
fn the_readme_and_the_benchmarks_stay_short() {
    for (file, most) in [("README.md", 200), ("BENCHMARKS.md", 600)] {
        let lines = std::fs::read_to_string(root().join(file)).expect("readable").lines().count();
        assert!(
            lines <= most,
            "{file} has {lines} lines, more than {most}: move the detail into docs/ (or, for runs, out: git keeps them)"
        );
    }
}

#[test]
fn anchors_and_links_are_read_as_github_does() {
    assert_eq!(anchor("Tower layer vs `tower_governor` (issue 7)"), "tower-layer-vs-tower_governor-issue-7");
    assert_eq!(anchor("Core: memory per key"), "core-memory-per-key");
    assert_eq!(anchor("`sync: eventual` and `sync: bounded`"), "sync-eventual-and-sync-bounded");
    assert_eq!(anchors("# A\n## B\n```sh\n# B\n```\n### B\n#nope\n"), ["a", "b", "b-1"]);
    let l = links("see [x](a.md#b) and `[y](z.md)`\n![p](img/p.png \"t\")\n[r]: docs/r.md\n```sh\n[q](no.md)\n```\n");
    assert_eq!(l, [(1, "a.md#b".to_owned()), (2, "img/p.png".to_owned()), (3, "docs/r.md".to_owned())]);
}

#[test]
fn the_output_patterns_match_as_the_docs_say() {
    assert!(line_matches("a … c", "a b b c"));
    assert!(line_matches("…", ""));
    assert!(!line_matches("a … c", "a b"));
    assert!(line_matches("x…", "xyz") && !line_matches("x…", "yz"));
    let e = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    assert!(lines_match(&e(&["a", "…", "z"]), &["a", "b", "c", "z"]));
    assert!(lines_match(&e(&["a", "…", "z"]), &["a", "z"]));
    assert!(!lines_match(&e(&["a", "z"]), &["a", "b", "z"]));
    let s = steps("$ echo a \\\n  b\na b\n\n$ true\n", 1).unwrap();
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].command, "echo a \\\n  b");
    assert_eq!(s[0].expected, ["a b"]);
    assert_eq!(wait_for("floodgate serve --config rules --http-addr 127.0.0.1:18080 "), "__wait_http 18080");
    assert_eq!(wait_for("floodgate serve"), "__wait_http 8080");
    assert_eq!(wait_for("floodgate proxy --upstream http://127.0.0.1:3000"), "__wait_tcp 8000");
    assert_eq!(wait_for("python3 -m http.server 3000 "), "__wait_tcp 3000");
    let b = blocks("x\n```sh not-run: needs Envoy\n$ envoy\n```\n```yaml file=rules/a.yaml\na: 1\n```\n").unwrap();
    assert_eq!((b[0].lang.as_str(), b[0].attrs.as_str(), b[0].line), ("sh", "not-run: needs Envoy", 2));
    assert_eq!((b[1].attrs.as_str(), b[1].text.as_str()), ("file=rules/a.yaml", "a: 1\n"));
}
