//! Hot-reloaded rules.
//!
//! [`Rules`] holds the current [`RuleSet`]; readers take it without locking
//! (`arc-swap`). A reload builds and validates the whole new set from the
//! directory and swaps it in at once; a bad edit keeps the last good rules,
//! logs every error, counts the failure and keeps the message for the health
//! endpoint. Counters survive reloads because counter keys depend only on
//! the descriptor and the limit's position, and the store resets a key whose
//! limit parameters changed.
//!
//! [`watch`] reloads on change: file events (inotify) debounced so a burst
//! of writes costs one reload, plus a periodic check of every file's size
//! and modification time that catches what events miss (a ConfigMap's
//! symlink swap, an overflowing event queue, a directory replaced whole).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use floodgate_core::rules::{ConfigErrors, LoadOptions, RuleSet};
use notify::{RecursiveMode, Watcher as _};

/// The live rule set of a directory, and how its reloads went.
pub struct Rules {
    dir: PathBuf,
    opts: LoadOptions,
    current: ArcSwap<RuleSet>,
    status: Mutex<Status>,
    reloads: AtomicU64,
    failures: AtomicU64,
}

/// How the last reload went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    /// The errors of the last failed reload, cleared by a successful one.
    pub last_error: Option<String>,
    /// When the rules in use were loaded.
    pub loaded_at: Option<SystemTime>,
    /// When a reload last failed.
    pub failed_at: Option<SystemTime>,
}

impl Rules {
    /// Load a directory; fails (touching nothing) when it is not valid.
    pub fn load(dir: impl Into<PathBuf>, opts: LoadOptions) -> Result<Arc<Rules>, ConfigErrors> {
        let dir = dir.into();
        let set = RuleSet::load_dir(&dir, &opts)?;
        for w in set.warnings() {
            tracing::warn!("rules: {w}");
        }
        Ok(Arc::new(Rules {
            dir,
            opts,
            current: ArcSwap::from_pointee(set),
            status: Mutex::new(Status { loaded_at: Some(SystemTime::now()), ..Status::default() }),
            reloads: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }))
    }

    /// The rules in use.
    pub fn current(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// The directory the rules come from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Build the whole rule set again and swap it in; on errors keep the
    /// rules in use and record why.
    pub fn reload(&self) -> Result<(), ConfigErrors> {
        match RuleSet::load_dir(&self.dir, &self.opts) {
            Ok(set) => {
                for w in set.warnings() {
                    tracing::warn!("rules: {w}");
                }
                tracing::info!(
                    dir = %self.dir.display(),
                    domains = set.domains().count(),
                    rules = set.rule_count(),
                    "rules reloaded"
                );
                // The status changes first and the rules swap in under its
                // lock: whoever sees the new rules, then asks the status,
                // never reads the error they fixed.
                let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
                status.last_error = None;
                status.loaded_at = Some(SystemTime::now());
                self.current.store(Arc::new(set));
                self.reloads.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(errors) => {
                for e in &errors.0 {
                    tracing::error!("rules reload failed, keeping the last good rules: {e}");
                }
                // Counted once the error is in the status, as above.
                let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
                status.last_error = Some(errors.to_string());
                status.failed_at = Some(SystemTime::now());
                self.failures.fetch_add(1, Ordering::Relaxed);
                Err(errors)
            }
        }
    }

    /// How the last reload went.
    pub fn status(&self) -> Status {
        self.status.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Successful reloads since start.
    pub fn reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// Failed reloads since start.
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }
}

/// How [`watch`] notices changes.
#[derive(Debug, Clone, Copy)]
pub struct WatchOptions {
    /// Quiet time after the last file event before reloading (default 250 ms).
    pub debounce: Duration,
    /// How often every file's size and mtime are compared, to catch what
    /// events miss (default 5 s).
    pub poll: Duration,
    /// Use file events (default true); without them, polling alone (for
    /// file systems without inotify, e.g. NFS).
    pub events: bool,
}

impl Default for WatchOptions {
    fn default() -> Self {
        Self { debounce: Duration::from_millis(250), poll: Duration::from_secs(5), events: true }
    }
}

/// A running watcher; dropping it stops watching.
pub struct Watcher {
    stop: Option<mpsc::Sender<Msg>>,
    thread: Option<JoinHandle<()>>,
    _events: Option<notify::RecommendedWatcher>,
}

enum Msg {
    Changed,
    Stop,
}

/// Why watching could not start.
#[derive(Debug, thiserror::Error)]
#[error("cannot watch {dir}: {source}")]
pub struct WatchError {
    dir: PathBuf,
    #[source]
    source: std::io::Error,
}

/// Reload `rules` whenever its directory changes. File events are the fast
/// path; if they cannot be set up (e.g. inotify limits), polling alone still
/// reloads, and a warning says so.
pub fn watch(rules: Arc<Rules>, opts: WatchOptions) -> Result<Watcher, WatchError> {
    let (tx, rx) = mpsc::channel::<Msg>();
    let events_tx = tx.clone();
    let events = opts.events.then(|| {
        notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            if res.is_ok_and(|e| !e.kind.is_access()) {
                let _ = events_tx.send(Msg::Changed);
            }
        })
        .and_then(|mut w| w.watch(rules.dir(), RecursiveMode::Recursive).map(|()| w))
    });
    let events = match events {
        None => None,
        Some(Ok(w)) => Some(w),
        Some(Err(e)) => {
            tracing::warn!(dir = %rules.dir().display(), "file events unavailable ({e}); polling every {:?}", opts.poll);
            None
        }
    };
    let mut seen = fingerprint(rules.dir());
    let dir = rules.dir().to_owned();
    let thread = std::thread::Builder::new()
        .name("floodgate-rules-watch".into())
        .spawn(move || {
            loop {
                let polled = match rx.recv_timeout(opts.poll) {
                    Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                    Ok(Msg::Changed) => {
                        // Debounce: wait for a quiet period.
                        loop {
                            match rx.recv_timeout(opts.debounce) {
                                Ok(Msg::Changed) => continue,
                                Ok(Msg::Stop) | Err(RecvTimeoutError::Disconnected) => return,
                                Err(RecvTimeoutError::Timeout) => break,
                            }
                        }
                        false
                    }
                    Err(RecvTimeoutError::Timeout) => true,
                };
                let current = fingerprint(rules.dir());
                if polled && current == seen {
                    continue;
                }
                seen = current;
                let _ = rules.reload();
            }
        })
        .map_err(|source| WatchError { dir, source })?;
    Ok(Watcher { stop: Some(tx), thread: Some(thread), _events: events })
}

impl Drop for Watcher {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(Msg::Stop);
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Every file's path, size and modification time (symlinks followed),
/// sorted: equal fingerprints mean nothing visible changed.
fn fingerprint(dir: &Path) -> Vec<(PathBuf, u64, Option<SystemTime>)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, u64, Option<SystemTime>)>, depth: usize) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(meta) = std::fs::metadata(&path) else { continue };
            if meta.is_dir() {
                if depth < 16 {
                    walk(&path, out, depth + 1);
                }
            } else {
                out.push((path, meta.len(), meta.modified().ok()));
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, &mut out, 0);
    out.sort();
    out
}
