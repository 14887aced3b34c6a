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
//! of writes costs one reload, plus a periodic check of every rules file's
//! size and modification time that catches what events miss (a ConfigMap's
//! symlink swap, an overflowing event queue, a directory replaced whole).
//! Only rules files count (`*.yaml`, `*.yml`, and the directories and
//! symlinks that lead to them): a log file written in the directory causes
//! no reload, and a reload that finds the same files as the last one
//! changes nothing and logs at debug.
//!
//! Rules compiled into the program ([`RulesSource::Embedded`]) are never
//! watched; their messages name them `<embedded>/FILE`.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use floodgate_core::rules::{ConfigErrors, LoadOptions, RuleSet, Sources, is_rules_file, rule_files};
use notify::{RecursiveMode, Watcher as _};

/// Where [`Rules`] come from.
#[derive(Debug, Clone)]
pub enum RulesSource {
    /// A directory of rules files, which [`watch`] can follow.
    Dir(PathBuf),
    /// Files compiled into the program, `(name, text)`: named
    /// `<embedded>/name` in messages, never watched.
    Embedded(&'static [(&'static str, &'static str)]),
}

impl RulesSource {
    fn read(&self, opts: &LoadOptions) -> Result<Sources, ConfigErrors> {
        match self {
            Self::Dir(dir) => Sources::read_dir(dir, opts),
            Self::Embedded(files) => Ok(Sources::embedded(files)),
        }
    }

    /// The directory, for rules read from one.
    pub fn dir(&self) -> Option<&Path> {
        match self {
            Self::Dir(d) => Some(d),
            Self::Embedded(_) => None,
        }
    }
}

impl std::fmt::Display for RulesSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dir(d) => write!(f, "{}", d.display()),
            Self::Embedded(_) => f.write_str("<embedded>"),
        }
    }
}

impl From<PathBuf> for RulesSource {
    fn from(dir: PathBuf) -> Self {
        Self::Dir(dir)
    }
}

impl From<&Path> for RulesSource {
    fn from(dir: &Path) -> Self {
        Self::Dir(dir.to_owned())
    }
}

impl From<&PathBuf> for RulesSource {
    fn from(dir: &PathBuf) -> Self {
        Self::Dir(dir.clone())
    }
}

/// Called with the new rules after each reload that changed them.
type OnReload = Box<dyn Fn(&RuleSet) + Send + Sync>;

/// What a rule set must also pass on this instance (e.g. global rules need
/// peer regions): every problem, positioned.
type Check = Box<dyn Fn(&RuleSet) -> Vec<floodgate_core::rules::ConfigError> + Send + Sync>;

/// The live rule set of a directory (or of embedded files), and how its
/// reloads went.
pub struct Rules {
    source: RulesSource,
    opts: LoadOptions,
    current: ArcSwap<RuleSet>,
    status: Mutex<Status>,
    /// The digest of the files the last reload read ([`Sources::digest`]),
    /// and whether that reload succeeded.
    seen: Mutex<(u64, bool)>,
    on_reload: Mutex<Vec<OnReload>>,
    checks: Mutex<Vec<Check>>,
    /// Domains an adapter decides in (the proxy's), and which adapter.
    required: Mutex<Vec<(String, &'static str)>>,
    reloads: AtomicU64,
    failures: AtomicU64,
}

impl std::fmt::Debug for Rules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rules").field("source", &self.source).finish_non_exhaustive()
    }
}

/// How the last reload went.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    /// The errors of the last failed reload, cleared by a successful one.
    pub last_error: Option<String>,
    /// The same errors, one per entry (`file:line:col: what`).
    pub last_errors: Vec<String>,
    /// When the rules in use were loaded.
    pub loaded_at: Option<SystemTime>,
    /// When a reload last failed.
    pub failed_at: Option<SystemTime>,
}

impl Rules {
    /// Load a directory (or embedded files); fails (touching nothing) when
    /// they are not valid.
    pub fn load(source: impl Into<RulesSource>, opts: LoadOptions) -> Result<Arc<Rules>, ConfigErrors> {
        let source = source.into();
        let sources = source.read(&opts)?;
        let digest = sources.digest();
        let set = RuleSet::build(sources, &opts)?;
        for w in set.warnings() {
            tracing::warn!("rules: {w}");
        }
        Ok(Arc::new(Rules {
            source,
            opts,
            current: ArcSwap::from_pointee(set),
            status: Mutex::new(Status { loaded_at: Some(SystemTime::now()), ..Status::default() }),
            seen: Mutex::new((digest, true)),
            on_reload: Mutex::new(Vec::new()),
            checks: Mutex::new(Vec::new()),
            required: Mutex::new(Vec::new()),
            reloads: AtomicU64::new(0),
            failures: AtomicU64::new(0),
        }))
    }

    /// Note that `by` (e.g. "the proxy") decides every request in `domain`:
    /// while the rules have no rule there, a warning names it, in the log
    /// now and after each reload, and in [`Rules::warnings`].
    pub fn require_domain(self: &Arc<Self>, domain: &str, by: &'static str) {
        if let Some(w) = missing_domain(&self.current(), domain, by) {
            tracing::warn!("{w}");
        }
        self.required.lock().unwrap_or_else(PoisonError::into_inner).push((domain.to_owned(), by));
        let domain = domain.to_owned();
        self.on_reload(move |set| {
            if let Some(w) = missing_domain(set, &domain, by) {
                tracing::warn!("{w}");
            }
        });
    }

    /// What is wrong but not fatal about the rules in use: a required
    /// domain with no rules, and the loader's warnings (a file with nothing
    /// in it, keys envoy ignores).
    pub fn warnings(&self) -> Vec<String> {
        let set = self.current();
        let required = self.required.lock().unwrap_or_else(PoisonError::into_inner);
        let missing = required.iter().filter_map(|(d, by)| missing_domain(&set, d, by));
        missing.chain(set.warnings().iter().map(ToString::to_string)).collect()
    }

    /// Hold every rule set, the one in use now and each reload's, to `check`
    /// as well (besides the checks added before): a reload it refuses keeps
    /// the last good rules, as any bad reload does. Fails (installing
    /// nothing) when the rules in use fail it.
    pub fn add_check(
        &self,
        check: impl Fn(&RuleSet) -> Vec<floodgate_core::rules::ConfigError> + Send + Sync + 'static,
    ) -> Result<(), ConfigErrors> {
        let errors = check(&self.current());
        if !errors.is_empty() {
            return Err(ConfigErrors(errors));
        }
        self.checks.lock().unwrap_or_else(PoisonError::into_inner).push(Box::new(check));
        Ok(())
    }

    /// Call `f` with the new rules after every reload that changes them
    /// (not now: the caller has [`Rules::current`]).
    pub fn on_reload(&self, f: impl Fn(&RuleSet) + Send + Sync + 'static) {
        self.on_reload.lock().unwrap_or_else(PoisonError::into_inner).push(Box::new(f));
    }

    /// The rules in use.
    pub fn current(&self) -> Arc<RuleSet> {
        self.current.load_full()
    }

    /// Where the rules come from.
    pub fn source(&self) -> &RulesSource {
        &self.source
    }

    /// Read the files again and, when they differ from the last read (or
    /// that read failed), build the whole rule set and swap it in; on errors
    /// keep the rules in use and record why. `Ok(false)`: the files are
    /// those of the rules in use, nothing changed (logged at debug).
    pub fn reload(&self) -> Result<bool, ConfigErrors> {
        let built = self.source.read(&self.opts).and_then(|sources| {
            let digest = sources.digest();
            let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
            if *seen == (digest, true) {
                return Ok(None);
            }
            let set = RuleSet::build(sources, &self.opts).and_then(|set| {
                let checks = self.checks.lock().unwrap_or_else(PoisonError::into_inner);
                let errors: Vec<_> = checks.iter().flat_map(|c| c(&set)).collect();
                if errors.is_empty() { Ok(set) } else { Err(ConfigErrors(errors)) }
            });
            *seen = (digest, set.is_ok());
            set.map(Some)
        });
        match built {
            Ok(None) => {
                tracing::debug!(source = %self.source, "rules files unchanged: nothing to reload");
                Ok(false)
            }
            Ok(Some(set)) => {
                for w in set.warnings() {
                    tracing::warn!("rules: {w}");
                }
                tracing::info!(
                    source = %self.source,
                    domains = set.domains().count(),
                    rules = set.rule_count(),
                    "rules reloaded"
                );
                // The status changes first and the rules swap in under its
                // lock: whoever sees the new rules, then asks the status,
                // never reads the error they fixed.
                let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
                status.last_error = None;
                status.last_errors.clear();
                status.loaded_at = Some(SystemTime::now());
                let set = Arc::new(set);
                self.current.store(set.clone());
                self.reloads.fetch_add(1, Ordering::Relaxed);
                drop(status);
                for f in self.on_reload.lock().unwrap_or_else(PoisonError::into_inner).iter() {
                    f(&set);
                }
                Ok(true)
            }
            Err(errors) => {
                for e in &errors.0 {
                    tracing::error!("rules reload failed, keeping the last good rules: {e}");
                }
                // Counted once the error is in the status, as above.
                let mut status = self.status.lock().unwrap_or_else(PoisonError::into_inner);
                status.last_error = Some(errors.to_string());
                status.last_errors = errors.0.iter().map(ToString::to_string).collect();
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

/// The warning for `domain` when `set` has no rule in it.
fn missing_domain(set: &RuleSet, domain: &str, by: &str) -> Option<String> {
    let rules = set.domain(domain).map_or(0, |d| d.rules().count());
    (rules == 0).then(|| {
        format!(
            "{by} decides in domain `{domain}`, which has no rules: every request passes unlimited, with no rate-limit headers; add a rules file with `domain: {domain}` (see examples/config/proxy.yaml) or choose another domain with --domain"
        )
    })
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
pub enum WatchError {
    /// The watching thread could not start.
    #[error("cannot watch {dir}: {source}")]
    Thread {
        /// The directory.
        dir: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The rules are compiled in: there is nothing to watch.
    #[error("the embedded rules are not watched: give --config DIR to serve rules from files")]
    Embedded,
}

/// Reload `rules` whenever its directory changes. File events are the fast
/// path; if they cannot be set up (e.g. inotify limits), polling alone still
/// reloads, and a warning says so.
pub fn watch(rules: Arc<Rules>, opts: WatchOptions) -> Result<Watcher, WatchError> {
    let dir = rules.source().dir().ok_or(WatchError::Embedded)?.to_owned();
    let (tx, rx) = mpsc::channel::<Msg>();
    let events_tx = tx.clone();
    let events = opts.events.then(|| {
        notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            // Only what can change the rules wakes the watcher: a log file
            // written in the directory must not (it could be our own log).
            if res.is_ok_and(|e| !e.kind.is_access() && e.paths.iter().any(|p| may_lead_to_rules(p))) {
                let _ = events_tx.send(Msg::Changed);
            }
        })
        .and_then(|mut w| w.watch(&dir, RecursiveMode::Recursive).map(|()| w))
    });
    let events = match events {
        None => None,
        Some(Ok(w)) => Some(w),
        Some(Err(e)) => {
            tracing::warn!(dir = %dir.display(), "file events unavailable ({e}); polling every {:?}", opts.poll);
            None
        }
    };
    let max_files = rules.opts.max_files;
    let mut seen = fingerprint(&dir, max_files);
    let rules_dir = dir.clone();
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
                let current = fingerprint(&dir, max_files);
                if polled && current == seen {
                    continue;
                }
                seen = current;
                let _ = rules.reload();
            }
        })
        .map_err(|source| WatchError::Thread { dir: rules_dir, source })?;
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

/// Whether a file event on `path` may change the rules: a rules file, or a
/// directory or symlink (a Kubernetes ConfigMap swaps its `..data`
/// symlink), or something gone whose name has no extension (a removed
/// directory or symlink; a removed `app.log` does not count).
fn may_lead_to_rules(path: &Path) -> bool {
    if is_rules_file(path) {
        return true;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => meta.is_dir() || meta.file_type().is_symlink(),
        Err(_) => path.extension().is_none(),
    }
}

/// Every rules file's path, size, modification time and inode (symlinks
/// followed), as the loader finds them: equal fingerprints mean no rules
/// file visibly changed.
fn fingerprint(dir: &Path, max_files: usize) -> Vec<(PathBuf, u64, Option<SystemTime>, u64)> {
    use std::os::unix::fs::MetadataExt;
    let files = rule_files(dir, max_files).unwrap_or_default();
    files
        .into_iter()
        .map(|path| {
            let meta = std::fs::metadata(&path).ok();
            let (len, modified, ino) = meta.map_or((0, None, 0), |m| (m.len(), m.modified().ok(), m.ino()));
            (path, len, modified, ino)
        })
        .collect()
}
