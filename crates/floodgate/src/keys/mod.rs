//! `floodgate keys`: per-key limits on a running server, through its admin
//! API (`/admin/v1/keys`, `/admin/v1/keys/import`, `/admin/v1/tiers`).

mod admin;
mod file;

use std::fs::File;
use std::io::{BufReader, BufWriter, IsTerminal, Write};
use std::time::{Duration, Instant};

use floodgate_perkey::{Entry, KeySpec, MAX_BATCH};
use hyper::Method;
use serde_json::{Value, json};

use crate::cli::{KeyRef, KeysAction, KeysArgs};
use crate::exit::{DENIED, Failure};
use admin::{Admin, query_escape};
use file::{Format, Reader, Writer};

pub(crate) fn run(args: &KeysArgs) -> Result<(), Failure> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Failure::runtime(format!("cannot start a runtime: {e}")))?;
    let admin = Admin::new(&args.admin_addr, args.admin_token.clone())?;
    rt.block_on(async {
        match &args.action {
            KeysAction::Get(key) => get(&admin, key).await,
            KeysAction::Set { key, tier, limits, name } => set(&admin, key, tier, limits, name).await,
            KeysAction::Delete(key) => delete(&admin, key).await,
            KeysAction::Import { file, format, batch } => import(&admin, file, format.as_deref(), *batch).await,
            KeysAction::Export { domain, prefix, format, output } => {
                export(&admin, domain.as_deref(), prefix, format.as_deref(), output.as_deref()).await
            }
            KeysAction::Tiers => tiers(&admin).await,
        }
    })
}

/// `--descriptor KEY=VALUE`s as entries.
fn descriptor(key: &KeyRef) -> Result<Vec<Entry>, Failure> {
    key.descriptor
        .iter()
        .map(|d| {
            let (k, v) = d.split_once('=').ok_or_else(|| {
                Failure::usage(format!("--descriptor `{d}`: write KEY=VALUE, e.g. --descriptor user=alice"))
            })?;
            Ok(Entry { key: k.to_owned(), value: v.to_owned() })
        })
        .collect()
}

#[allow(clippy::print_stdout)] // the command's output
fn print(v: &Value) {
    println!("{}", serde_json::to_string_pretty(v).unwrap_or_default());
}

async fn get(admin: &Admin, key: &KeyRef) -> Result<(), Failure> {
    let entries = descriptor(key)?;
    let text: Vec<String> = entries.iter().map(|e| format!("{}={}", e.key, e.value)).collect();
    let path = format!(
        "/admin/v1/keys?domain={}&prefix={}&exact=true",
        query_escape(&key.domain),
        query_escape(&text.join(", "))
    );
    let v = admin.ok(Method::GET, &path, None, "get").await?;
    match v.get("entries").and_then(Value::as_array).and_then(|a| a.first()) {
        Some(e) => {
            print(e);
            Ok(())
        }
        None => {
            eprintln!("no entry for {} in domain {}", text.join(", "), key.domain);
            Err(Failure::quiet(DENIED))
        }
    }
}

async fn set(
    admin: &Admin,
    key: &KeyRef,
    tier: &Option<String>,
    limits: &Option<String>,
    name: &Option<String>,
) -> Result<(), Failure> {
    let limits = limits
        .as_deref()
        .map(|l| serde_json::from_str::<Value>(l).map_err(|e| Failure::usage(format!("--limits: not JSON: {e}"))))
        .transpose()?;
    let spec = KeySpec {
        domain: key.domain.clone(),
        descriptor: descriptor(key)?,
        tier: tier.clone(),
        limits,
        name: name.clone(),
    };
    let body = serde_json::to_vec(&spec).map_err(|e| Failure::runtime(e.to_string()))?;
    print(&admin.ok(Method::PUT, "/admin/v1/keys", Some(body), "set").await?);
    Ok(())
}

async fn delete(admin: &Admin, key: &KeyRef) -> Result<(), Failure> {
    let body = serde_json::to_vec(&json!({ "domain": key.domain, "descriptor": descriptor(key)? }))
        .map_err(|e| Failure::runtime(e.to_string()))?;
    let (status, v) = admin.call(Method::DELETE, "/admin/v1/keys", Some(body)).await?;
    if status == hyper::StatusCode::NOT_FOUND && v.get("field").and_then(Value::as_str) == Some("descriptor") {
        eprintln!("no such entry");
        return Err(Failure::quiet(DENIED));
    }
    if !status.is_success() {
        return Err(Failure::runtime(format!("delete: the server answered {status}: {v}")));
    }
    print(&v);
    Ok(())
}

async fn tiers(admin: &Admin) -> Result<(), Failure> {
    print(&admin.ok(Method::GET, "/admin/v1/tiers", None, "tiers").await?);
    Ok(())
}

/// Progress on standard error: a line rewritten in place on a terminal,
/// else one every 10 s.
struct Progress {
    started: Instant,
    last: Instant,
    size: Option<u64>,
    terminal: bool,
}

impl Progress {
    fn new(size: Option<u64>) -> Self {
        let now = Instant::now();
        Self { started: now, last: now, size, terminal: std::io::stderr().is_terminal() }
    }

    fn show(&mut self, written: u64, read_bytes: u64, done: bool) {
        let every = if self.terminal { Duration::from_millis(250) } else { Duration::from_secs(10) };
        if !done && self.last.elapsed() < every {
            return;
        }
        self.last = Instant::now();
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let share = self
            .size
            .filter(|s| *s > 0)
            .map(|s| format!(" {:5.1}%", (read_bytes as f64 * 100.0 / s as f64).min(100.0)))
            .unwrap_or_default();
        let line = format!("imported {written} entries{share} ({:.0}/s, {secs:.1} s)", written as f64 / secs);
        if self.terminal {
            eprint!("\r{line}{}", if done { "\n" } else { "" });
        } else {
            eprintln!("{line}");
        }
    }
}

/// Counts the bytes read through it (for the progress).
struct Counted<R> {
    inner: R,
    read: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

async fn import(admin: &Admin, path: &str, format: Option<&str>, batch: usize) -> Result<(), Failure> {
    if !(1..=MAX_BATCH).contains(&batch) {
        return Err(Failure::usage(format!("--batch: give 1 to {MAX_BATCH}")));
    }
    let format = Format::choose(format, Some(path)).map_err(Failure::usage)?;
    let (input, size): (Box<dyn std::io::Read>, Option<u64>) = if path == "-" {
        (Box::new(std::io::stdin()), None)
    } else {
        let f = File::open(path).map_err(|e| Failure::runtime(format!("{path}: {e}")))?;
        let size = f.metadata().ok().map(|m| m.len());
        (Box::new(f), size)
    };
    let read = std::rc::Rc::new(std::cell::Cell::new(0));
    let counted = Counted { inner: input, read: read.clone() };
    let mut reader = Reader::new(BufReader::with_capacity(1 << 20, counted), format)
        .map_err(|e| Failure::usage(format!("{path}:1: {e}")))?;
    let mut progress = Progress::new(size);
    let mut written = 0u64;
    loop {
        // One batch: every line read and checked here, then sent as one
        // transaction; any bad line (here or on the server) stops it all.
        let mut specs = Vec::with_capacity(batch);
        let mut lines = Vec::with_capacity(batch);
        let mut bad = Vec::new();
        while specs.len() + bad.len() < batch {
            match reader.next_entry() {
                Ok(None) => break,
                Ok(Some((line, spec))) => {
                    lines.push(line);
                    specs.push(spec);
                }
                Err((line, why)) => bad.push(format!("{path}:{line}: {why}")),
            }
        }
        if !bad.is_empty() {
            return Err(stopped(&bad, written));
        }
        if specs.is_empty() {
            break;
        }
        let n = specs.len() as u64;
        let body = serde_json::to_vec(&json!({ "entries": specs })).map_err(|e| Failure::runtime(e.to_string()))?;
        let (status, v) = admin.call(Method::POST, "/admin/v1/keys/import", Some(body)).await?;
        if status == hyper::StatusCode::BAD_REQUEST
            && let Some(errors) = v.get("errors").and_then(Value::as_array)
        {
            let bad: Vec<String> = errors
                .iter()
                .map(|e| {
                    let i = e.get("index").and_then(Value::as_u64).unwrap_or(0) as usize;
                    let why = e.get("error").and_then(Value::as_str).unwrap_or("refused");
                    format!("{path}:{}: {why}", lines.get(i).copied().unwrap_or(0))
                })
                .collect();
            return Err(stopped(&bad, written));
        }
        if !status.is_success() {
            let said = v.get("error").and_then(Value::as_str).map_or_else(|| v.to_string(), str::to_owned);
            return Err(Failure::runtime(format!(
                "import: the server answered {status}: {said}; {written} entries were written before this batch (lines {}-{} not written)",
                lines.first().copied().unwrap_or(0),
                lines.last().copied().unwrap_or(0)
            )));
        }
        written += n;
        progress.show(written, read.get(), false);
    }
    progress.show(written, read.get(), true);
    Ok(())
}

/// The failure of an import stopped by bad lines (the first 20 listed).
fn stopped(bad: &[String], written: u64) -> Failure {
    let mut m = bad.iter().take(20).cloned().collect::<Vec<_>>().join("\n");
    if bad.len() > 20 {
        m.push_str(&format!("\n... and {} more", bad.len() - 20));
    }
    Failure::usage(format!(
        "{m}\nnothing of that batch was written; {written} entries of the batches before it were (importing again is harmless)"
    ))
}

async fn export(
    admin: &Admin,
    domain: Option<&str>,
    prefix: &str,
    format: Option<&str>,
    output: Option<&str>,
) -> Result<(), Failure> {
    let format = Format::choose(format, output).map_err(Failure::usage)?;
    let out: Box<dyn Write> = match output {
        Some(p) => Box::new(File::create(p).map_err(|e| Failure::runtime(format!("{p}: {e}")))?),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut writer = Writer::new(BufWriter::with_capacity(1 << 20, out), format);
    let mut cursor: Option<String> = None;
    loop {
        let mut path = format!("/admin/v1/keys?limit=1000&prefix={}", query_escape(prefix));
        if let Some(d) = domain {
            path.push_str(&format!("&domain={}", query_escape(d)));
        }
        if let Some(c) = &cursor {
            path.push_str(&format!("&cursor={}", query_escape(c)));
        }
        let v = admin.ok(Method::GET, &path, None, "export").await?;
        for e in v.get("entries").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default() {
            let mut e = e.clone();
            if let Some(o) = e.as_object_mut() {
                o.remove("updated_at_unix_s");
            }
            let spec: KeySpec = serde_json::from_value(e)
                .map_err(|err| Failure::runtime(format!("export: an entry the server sent does not parse: {err}")))?;
            writer.write(&spec).map_err(|e| {
                if e.contains("--format jsonl") { Failure::usage(e) } else { Failure::runtime(format!("writing: {e}")) }
            })?;
        }
        match v.get("next_cursor").and_then(Value::as_str) {
            Some(c) => cursor = Some(c.to_owned()),
            None => break,
        }
    }
    writer.finish().map_err(|e| Failure::runtime(format!("writing: {e}")))
}
