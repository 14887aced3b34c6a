//! A hash index of the entries on disk, beside the database: a miss reads
//! one 256-byte bucket with one `pread` (about a microsecond from the OS
//! page cache) instead of descending redb's B-tree (3–5 µs: a 4 KiB page
//! copied, redb's page cache and LRU, a binary search per level).
//!
//! The index is derived, never the truth: the database is. It is built
//! from one read transaction (a snapshot at one commit: the file's *stamp*
//! is that commit's random id), in the background, and answers only for
//! keys not written since:
//!
//! * every commit notes its keys as *dirty* (with the commit's number)
//!   before it returns; a lookup of a dirty key reads the database;
//! * past [`MAX_DIRTY`] written keys the index is dropped (every miss reads
//!   the database) until a rebuild;
//! * a rebuild starts once writes have been quiet for [`QUIET`] and the
//!   index is missing or [`REBUILD_AT`] keys are dirty; when it is swapped
//!   in, the keys written after its snapshot stay dirty;
//! * at open, the file is used only when its stamp is the database's last
//!   commit's id; otherwise (a write after the build, a crash during one) it is
//!   rebuilt in the background, and misses read the database meanwhile.
//!
//! So an answer from the index is always the database's answer, and losing
//! the index (deleted, corrupt, a failed build) only makes misses slower.
//!
//! ## The file
//!
//! A 4 KiB header (magic, stamp, bucket count, entries, a checksum), then
//! `buckets + TAIL` buckets of [`BUCKET`] bytes. A key's home bucket is its
//! 64-bit hash scaled to the bucket count; an entry lies in its home bucket
//! or, when that was full, in the first later bucket with room, and every
//! bucket it passed has its overflow flag set (linear probing by bucket).
//! A bucket is a flags byte, then records until a zero byte:
//!
//! * `[key len 1..=254][value len][key][value]`: an entry;
//! * `[255][hash: u64 LE]`: an entry too large for a bucket (read it from
//!   the database).
//!
//! Buckets are filled to about [`FILL`] on average, so a lookup reads a
//! second bucket rarely. The file takes about `entries × (record + 2) /
//! FILL` bytes: 0.6 GB for 10 million tier entries (the database: 1.1 GB).
//!
//! ## Building
//!
//! One pass over the database writes each record to one of a few spill
//! files by its hash's top bits; then each spill file is placed into its
//! range of buckets in memory (at most ~32 MiB at a time) and written out
//! in order. The new file is written beside the old, synced, and renamed
//! over it. A build of 10 million entries takes tens of seconds on a
//! loaded 2-core machine, and stops at once when the store is dropped.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use arc_swap::ArcSwapOption;

/// Bytes a bucket.
pub(crate) const BUCKET: usize = 256;
/// The header's size: the buckets start on a page.
const HEADER: u64 = 4096;
const MAGIC: &[u8; 8] = b"fgkidx01";
/// Average fill of a bucket's record space the build aims at.
const FILL: f64 = 0.6;
/// Buckets past the last home bucket, for the last ones' overflow.
const TAIL: u64 = 64;
/// Flags byte: an entry whose probe passed this bucket lies further on.
const OVERFLOW: u8 = 1;
/// Key length byte of a record too large for a bucket.
const BIG: u8 = 255;
/// Keys written since the index was built that are remembered; beyond,
/// the index is dropped until rebuilt.
pub(crate) const MAX_DIRTY: usize = 65_536;
/// Dirty keys that make a rebuild worth its cost.
pub(crate) const REBUILD_AT: usize = 4_096;
/// How long writes must have stopped before a rebuild starts (an import's
/// batches are not chased one by one).
pub(crate) const QUIET: Duration = Duration::from_secs(2);
/// After a failed build, how long before the next try.
const RETRY: Duration = Duration::from_secs(300);
/// Largest in-memory section while building.
const SECTION_BYTES: u64 = 32 << 20;

/// A key's 64-bit hash: FNV-1a, then a finalizer that spreads its bits
/// (the home bucket uses the top bits). Stable across builds and versions
/// of the file.
pub(crate) fn hash(key: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// A hash's home among `buckets` (monotonic in the hash).
fn home(h: u64, buckets: u64) -> u64 {
    ((u128::from(h) * u128::from(buckets)) >> 64) as u64
}

/// What the index says of a key.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Answer<'a> {
    /// The key's value.
    Value(&'a [u8]),
    /// No entry.
    Absent,
    /// Read the database (dirty, no index, too large, or a bad read).
    AskDb,
}

/// One built index file.
#[derive(Debug)]
pub(crate) struct IndexFile {
    file: File,
    buckets: u64,
}

struct Header {
    stamp: u64,
    buckets: u64,
    entries: u64,
}

impl Header {
    fn bytes(&self) -> [u8; 48] {
        let mut out = [0u8; 48];
        out[..8].copy_from_slice(MAGIC);
        out[8..16].copy_from_slice(&self.stamp.to_le_bytes());
        out[16..24].copy_from_slice(&self.buckets.to_le_bytes());
        out[24..32].copy_from_slice(&TAIL.to_le_bytes());
        out[32..40].copy_from_slice(&self.entries.to_le_bytes());
        let sum = hash(&out[..40]);
        out[40..48].copy_from_slice(&sum.to_le_bytes());
        out
    }

    fn parse(b: &[u8; 48]) -> Option<Self> {
        let word = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        (&b[..8] == MAGIC && word(24) == TAIL && word(40) == hash(&b[..40]) && word(16) > 0).then(|| Self {
            stamp: word(8),
            buckets: word(16),
            entries: word(32),
        })
    }
}

/// Open `path` to read, without updating its access time on every read
/// where the system allows it (Linux's `O_NOATIME`, for the file's owner:
/// the time check alone was a tenth of a miss's `pread`); else as usual.
fn open_noatime(path: &Path) -> std::io::Result<File> {
    #[cfg(all(target_os = "linux", not(any(target_arch = "sparc", target_arch = "sparc64"))))]
    {
        use std::os::unix::fs::OpenOptionsExt;
        /// Linux's `O_NOATIME` (the same on every architecture Rust builds
        /// for but sparc's).
        const O_NOATIME: i32 = 0o1_000_000;
        if let Ok(f) = std::fs::OpenOptions::new().read(true).custom_flags(O_NOATIME).open(path) {
            return Ok(f);
        }
    }
    File::open(path)
}

impl IndexFile {
    /// The index at `path` if it is whole and was built at `stamp`.
    fn open(path: &Path, stamp: u64) -> Option<Self> {
        let file = open_noatime(path).ok()?;
        let mut head = [0u8; 48];
        file.read_exact_at(&mut head, 0).ok()?;
        let h = Header::parse(&head)?;
        let len = HEADER + (h.buckets + TAIL) * BUCKET as u64;
        (h.stamp == stamp && file.metadata().ok()?.len() == len).then_some(Self { file, buckets: h.buckets })
    }

    /// Look `key` up, reading its buckets into `buf`.
    fn find<'a>(&self, key: &[u8], buf: &'a mut [u8; BUCKET]) -> std::io::Result<Answer<'a>> {
        let h = hash(key);
        let mut at = home(h, self.buckets);
        loop {
            if at >= self.buckets + TAIL {
                return Ok(Answer::AskDb);
            }
            self.file.read_exact_at(buf, HEADER + at * BUCKET as u64)?;
            match scan(buf, key, h) {
                Found::Value(start, end) => return Ok(Answer::Value(&buf[start..end])),
                Found::Big => return Ok(Answer::AskDb),
                Found::No if buf[0] & OVERFLOW == 0 => return Ok(Answer::Absent),
                Found::No => at += 1,
                Found::Bad => return Ok(Answer::AskDb),
            }
        }
    }
}

enum Found {
    Value(usize, usize),
    Big,
    No,
    Bad,
}

/// Look for `key` (hash `h`) among one bucket's records.
fn scan(bucket: &[u8; BUCKET], key: &[u8], h: u64) -> Found {
    let mut i = 1;
    while i < BUCKET {
        match bucket[i] {
            0 => return Found::No,
            BIG => {
                let Some(word) = bucket.get(i + 1..i + 9) else { return Found::Bad };
                if u64::from_le_bytes(word.try_into().unwrap_or_default()) == h {
                    return Found::Big;
                }
                i += 9;
            }
            klen => {
                let Some(&vlen) = bucket.get(i + 1) else { return Found::Bad };
                let k = i + 2;
                let v = k + usize::from(klen);
                let end = v + usize::from(vlen);
                if end > BUCKET {
                    return Found::Bad;
                }
                if &bucket[k..v] == key {
                    return Found::Value(v, end);
                }
                i = end;
            }
        }
    }
    Found::No
}

/// The record of one entry.
fn record(key: &[u8], value: &[u8], h: u64, out: &mut Vec<u8>) {
    out.clear();
    match (u8::try_from(key.len()), u8::try_from(value.len())) {
        (Ok(k), Ok(v)) if k > 0 && k < BIG && 2 + key.len() + value.len() < BUCKET => {
            out.extend_from_slice(&[k, v]);
            out.extend_from_slice(key);
            out.extend_from_slice(value);
        }
        _ => {
            out.push(BIG);
            out.extend_from_slice(&h.to_le_bytes());
        }
    }
}

/// Why a build stopped.
#[derive(Debug)]
pub(crate) enum BuildError {
    /// The store is being dropped.
    Stopped,
    /// What failed.
    Failed(String),
}

impl<E: std::fmt::Display> From<E> for BuildError {
    fn from(e: E) -> Self {
        Self::Failed(e.to_string())
    }
}

/// Builds one index file.
pub(crate) struct Builder<'a> {
    path: &'a Path,
    stamp: u64,
    shift: u32,
    spills: Vec<BufWriter<File>>,
    spill_dir: PathBuf,
    entries: u64,
    bytes: u64,
    rec: Vec<u8>,
    stop: &'a AtomicBool,
}

impl<'a> Builder<'a> {
    /// A build of the index at `path` from the snapshot `stamp`, of about
    /// `entries` entries; `stop` set aborts it.
    pub(crate) fn new(path: &'a Path, stamp: u64, entries: u64, stop: &'a AtomicBool) -> Result<Self, BuildError> {
        // ~40 bytes a record, at FILL: sections of at most SECTION_BYTES.
        let estimate = (entries.saturating_mul(40) as f64 / FILL) as u64;
        let sections = estimate.div_ceil(SECTION_BYTES).clamp(1, 1024).next_power_of_two();
        let spill_dir = with_suffix(path, ".build");
        let _ = std::fs::remove_dir_all(&spill_dir);
        std::fs::create_dir_all(&spill_dir)?;
        let spills = (0..sections)
            .map(|s| Ok(BufWriter::with_capacity(64 << 10, File::create(spill_dir.join(s.to_string()))?)))
            .collect::<Result<Vec<_>, std::io::Error>>()?;
        Ok(Self {
            path,
            stamp,
            shift: 64 - sections.trailing_zeros(),
            spills,
            spill_dir,
            entries: 0,
            bytes: 0,
            rec: Vec::with_capacity(BUCKET),
            stop,
        })
    }

    fn section(&self, h: u64) -> usize {
        if self.shift == 64 { 0 } else { (h >> self.shift) as usize }
    }

    /// Add one entry (each key once).
    pub(crate) fn add(&mut self, key: &[u8], value: &[u8]) -> Result<(), BuildError> {
        if self.entries.is_multiple_of(4096) && self.stop.load(Relaxed) {
            return Err(BuildError::Stopped);
        }
        let h = hash(key);
        record(key, value, h, &mut self.rec);
        let s = self.section(h);
        let w = &mut self.spills[s];
        w.write_all(&h.to_le_bytes())?;
        w.write_all(&[self.rec.len() as u8])?;
        w.write_all(&self.rec)?;
        self.entries += 1;
        self.bytes += self.rec.len() as u64;
        Ok(())
    }

    /// Entries added so far.
    pub(crate) fn entries(&self) -> u64 {
        self.entries
    }

    /// Place the records into buckets, write the file and open it.
    pub(crate) fn finish(mut self) -> Result<IndexFile, BuildError> {
        let result = self.write();
        let _ = std::fs::remove_dir_all(&self.spill_dir);
        result
    }

    fn write(&mut self) -> Result<IndexFile, BuildError> {
        for w in &mut self.spills {
            w.flush()?;
        }
        let room = (BUCKET - 1) as f64 * FILL;
        let buckets = ((self.bytes as f64 / room).ceil() as u64).max(1);
        let tmp = with_suffix(self.path, ".tmp");
        let mut out = BufWriter::with_capacity(1 << 20, File::create(&tmp)?);
        out.write_all(&[0u8; HEADER as usize])?;
        let sections = self.spills.len();
        // Records that ran past their section: (home, record).
        let mut carry: Vec<(u64, Vec<u8>)> = Vec::new();
        for s in 0..sections {
            if self.stop.load(Relaxed) {
                return Err(BuildError::Stopped);
            }
            let lo = if s == 0 { 0 } else { home((s as u64) << self.shift, buckets) };
            let hi = if s + 1 == sections { buckets + TAIL } else { home(((s + 1) as u64) << self.shift, buckets) };
            let mut part = Section::new(lo, hi);
            for (at, rec) in std::mem::take(&mut carry) {
                if !part.place(at, &rec) {
                    carry.push((at, rec));
                }
            }
            let mut spill = Vec::new();
            BufReader::new(File::open(self.spill_dir.join(s.to_string()))?).read_to_end(&mut spill)?;
            let mut i = 0;
            while i + 9 <= spill.len() {
                let h = u64::from_le_bytes(spill[i..i + 8].try_into().unwrap_or_default());
                let len = usize::from(spill[i + 8]);
                let rec = spill.get(i + 9..i + 9 + len).ok_or("a spill file ends early")?;
                let at = home(h, buckets);
                if !part.place(at, rec) {
                    carry.push((at, rec.to_vec()));
                }
                i += 9 + len;
            }
            out.write_all(&part.bytes)?;
        }
        if !carry.is_empty() {
            return Err(BuildError::Failed(format!(
                "{} entries found no bucket (the file's tail is full)",
                carry.len()
            )));
        }
        let mut file = out.into_inner().map_err(|e| e.into_error())?;
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&Header { stamp: self.stamp, buckets, entries: self.entries }.bytes())?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&tmp, self.path)?;
        IndexFile::open(self.path, self.stamp)
            .ok_or_else(|| BuildError::Failed("the index just written does not read back".into()))
    }
}

/// Buckets `lo..hi` being filled.
struct Section {
    lo: u64,
    bytes: Vec<u8>,
    fill: Vec<u16>,
}

impl Section {
    fn new(lo: u64, hi: u64) -> Self {
        let n = (hi - lo) as usize;
        Self { lo, bytes: vec![0; n * BUCKET], fill: vec![1; n] }
    }

    /// Put `rec` in the first bucket from `home` with room, flagging the
    /// buckets passed; false when it ran past this section (the caller
    /// carries it into the next).
    fn place(&mut self, home: u64, rec: &[u8]) -> bool {
        let mut b = home.saturating_sub(self.lo) as usize;
        while b < self.fill.len() {
            let at = usize::from(self.fill[b]);
            if at + rec.len() <= BUCKET {
                let start = b * BUCKET + at;
                self.bytes[start..start + rec.len()].copy_from_slice(rec);
                self.fill[b] += rec.len() as u16;
                return true;
            }
            self.bytes[b * BUCKET] |= OVERFLOW;
            b += 1;
        }
        false
    }
}

/// `path` with `suffix` appended to its file name.
pub(crate) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// The index of one database: the file in use, the keys written since it
/// was built, and what wakes its builder.
#[derive(Debug)]
pub(crate) struct Index {
    path: PathBuf,
    current: ArcSwapOption<IndexFile>,
    dirty_len: AtomicUsize,
    state: Mutex<State>,
    wake: Condvar,
    /// Misses the index answered.
    pub(crate) answered: crate::Striped,
    /// Builds finished and swapped in.
    pub(crate) builds: AtomicU64,
    /// Set when the store is dropped: a build in progress stops.
    pub(crate) stopping: AtomicBool,
}

#[derive(Debug)]
struct State {
    /// Written key → the commit that wrote it last.
    dirty: HashMap<Box<str>, u64>,
    /// The commit at which `dirty` overflowed: an index built before it
    /// cannot be used.
    lost_at: Option<u64>,
    last_write: Instant,
    retry_at: Option<Instant>,
}

/// What the builder should do next.
pub(crate) enum Next {
    /// Build from a snapshot now.
    Build,
    /// The store is dropped.
    Stop,
}

impl Index {
    /// The index at `path`, used if built at the database's last commit
    /// `stamp`.
    pub(crate) fn open(path: PathBuf, stamp: u64) -> Self {
        let current = IndexFile::open(&path, stamp).map(Arc::new);
        Self {
            path,
            current: ArcSwapOption::new(current),
            dirty_len: AtomicUsize::new(0),
            state: Mutex::new(State {
                dirty: HashMap::new(),
                lost_at: None,
                last_write: Instant::now(),
                retry_at: None,
            }),
            wake: Condvar::new(),
            answered: crate::Striped::default(),
            builds: AtomicU64::new(0),
            stopping: AtomicBool::new(false),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The file's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Whether an index file is in use.
    pub(crate) fn is_built(&self) -> bool {
        self.current.load().is_some()
    }

    /// Look `key` up.
    pub(crate) fn find<'a>(&self, key: &str, buf: &'a mut [u8; BUCKET]) -> Answer<'a> {
        // With keys dirty, the file and the dirty set are read together
        // (a swap prunes the set); with none, a write that lands meanwhile
        // is the race every cached read has, settled by the cache's guard.
        // A guard, not a clone: no reference count that every miss on
        // every thread would write.
        let file = if self.dirty_len.load(Acquire) == 0 {
            self.current.load()
        } else {
            let state = self.state();
            if state.dirty.contains_key(key) {
                return Answer::AskDb;
            }
            self.current.load()
        };
        let Some(file) = file.as_ref() else { return Answer::AskDb };
        match file.find(key.as_bytes(), buf) {
            Ok(a) => {
                if a != Answer::AskDb {
                    self.answered.add(1);
                }
                a
            }
            Err(e) => {
                tracing::warn!(file = %self.path.display(), "the per-key index could not be read: {e}; reading the database");
                self.current.store(None);
                Answer::AskDb
            }
        }
    }

    /// Note keys written by commit `generation` (before the commit's
    /// caller drops them from the cache).
    pub(crate) fn written<'k>(&self, keys: impl Iterator<Item = &'k str>, generation: u64) {
        let mut state = self.state();
        for k in keys {
            state.dirty.insert(Box::from(k), generation);
        }
        if state.dirty.len() > MAX_DIRTY {
            // Dropped first: a lookup that sees the set empty sees no file.
            self.current.store(None);
            state.dirty = HashMap::new();
            state.lost_at = Some(generation);
        }
        self.dirty_len.store(state.dirty.len(), Release);
        state.last_write = Instant::now();
        state.retry_at = None;
        drop(state);
        self.wake.notify_all();
    }

    /// Wait until a build is due (writes quiet, and no index or enough
    /// dirty keys) or the store is dropped. `has_entries` says whether the
    /// database holds any (an empty one needs no index).
    pub(crate) fn next(&self, has_entries: impl Fn() -> bool) -> Next {
        let mut state = self.state();
        loop {
            // Read under the lock `stop` takes before it notifies: no
            // wake-up is lost.
            if self.stopping.load(Relaxed) {
                return Next::Stop;
            }
            let due = !self.is_built() || state.dirty.len() >= REBUILD_AT;
            let quiet = state.last_write.elapsed() >= QUIET;
            let retry = state.retry_at.is_none_or(|t| Instant::now() >= t);
            if due && quiet && retry && has_entries() {
                return Next::Build;
            }
            let wait = if due && !quiet { QUIET.saturating_sub(state.last_write.elapsed()) } else { QUIET };
            state = self.wake.wait_timeout(state, wait).unwrap_or_else(PoisonError::into_inner).0;
        }
    }

    /// Swap in `file`, built from a snapshot at commit number
    /// `generation`: the keys written after it stay dirty. Not used if the
    /// dirty set overflowed since.
    pub(crate) fn built(&self, file: IndexFile, generation: u64) {
        let mut state = self.state();
        if state.lost_at.is_some_and(|l| l > generation) {
            return;
        }
        state.lost_at = None;
        state.dirty.retain(|_, g| *g > generation);
        self.current.store(Some(Arc::new(file)));
        self.dirty_len.store(state.dirty.len(), Release);
        self.builds.fetch_add(1, Relaxed);
    }

    /// A build failed: try again after [`RETRY`] or the next write.
    pub(crate) fn failed(&self) {
        self.state().retry_at = Some(Instant::now() + RETRY);
    }

    /// Stop the builder (the store is being dropped).
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Relaxed);
        // Taken and let go: a builder between its check and its wait is
        // waiting by now, and the notice reaches it.
        drop(self.state());
        self.wake.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(dir: &Path, rows: &[(String, Vec<u8>)], stamp: u64) -> IndexFile {
        let stop = AtomicBool::new(false);
        let path = dir.join("i.index");
        let mut b = Builder::new(&path, stamp, rows.len() as u64, &stop).unwrap();
        for (k, v) in rows {
            b.add(k.as_bytes(), v).unwrap();
        }
        b.finish().unwrap()
    }

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("fg-index-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn every_key_is_found_and_no_other() {
        let dir = tempdir("all");
        let mut rows: Vec<(String, Vec<u8>)> =
            (0..50_000).map(|i| (format!("api\0user\u{1}{i}"), format!("v{i}").into_bytes())).collect();
        // Large entries, and one at the limit of a record.
        rows.push(("big\0k\u{1}x".into(), vec![7; 400]));
        rows.push((format!("edge\0k\u{1}{}", "y".repeat(200)), vec![1; 50]));
        let file = build(&dir, &rows, 9);
        let mut buf = [0u8; BUCKET];
        for (k, v) in &rows {
            match file.find(k.as_bytes(), &mut buf).unwrap() {
                Answer::Value(got) => assert_eq!(got, v.as_slice(), "{k}"),
                Answer::AskDb => assert!(2 + k.len() + v.len() >= BUCKET, "{k} should be inline"),
                Answer::Absent => panic!("{k} not found"),
            }
        }
        for i in 50_000..60_000 {
            assert_eq!(file.find(format!("api\0user\u{1}{i}").as_bytes(), &mut buf).unwrap(), Answer::Absent);
        }
        assert!(IndexFile::open(&dir.join("i.index"), 9).is_some());
        assert!(IndexFile::open(&dir.join("i.index"), 10).is_none(), "another stamp is not used");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_full_neighbourhood_overflows_into_later_buckets() {
        // Few buckets, records near a bucket's size: most overflow.
        let dir = tempdir("overflow");
        let rows: Vec<(String, Vec<u8>)> = (0..300).map(|i| (format!("k{i}"), vec![b'v'; 120])).collect();
        let file = build(&dir, &rows, 1);
        let mut buf = [0u8; BUCKET];
        for (k, v) in &rows {
            assert_eq!(file.find(k.as_bytes(), &mut buf).unwrap(), Answer::Value(v.as_slice()), "{k}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_damaged_file_is_not_used() {
        let dir = tempdir("damaged");
        let rows = vec![("a".to_owned(), b"1".to_vec())];
        drop(build(&dir, &rows, 3));
        let path = dir.join("i.index");
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[20] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        assert!(IndexFile::open(&path, 3).is_none(), "a bad checksum");
        bytes[20] ^= 1;
        bytes.truncate(bytes.len() - 1);
        std::fs::write(&path, &bytes).unwrap();
        assert!(IndexFile::open(&path, 3).is_none(), "a short file");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn dirty_keys_read_the_database_until_a_newer_build() {
        let dir = tempdir("dirty");
        let rows = vec![("a".to_owned(), b"1".to_vec()), ("b".to_owned(), b"2".to_vec())];
        drop(build(&dir, &rows, 5));
        let index = Index::open(dir.join("i.index"), 5);
        let mut buf = [0u8; BUCKET];
        assert_eq!(index.find("a", &mut buf), Answer::Value(b"1"));
        index.written(["a"].into_iter(), 6);
        assert_eq!(index.find("a", &mut buf), Answer::AskDb);
        assert_eq!(index.find("b", &mut buf), Answer::Value(b"2"));
        // A build from a snapshot before the write keeps it dirty.
        index.built(build(&dir, &rows, 5), 5);
        assert_eq!(index.find("a", &mut buf), Answer::AskDb);
        index.built(build(&dir, &[("a".to_owned(), b"9".to_vec())], 6), 6);
        assert_eq!(index.find("a", &mut buf), Answer::Value(b"9"));
        assert_eq!(index.find("b", &mut buf), Answer::Absent);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn too_many_writes_drop_the_index_until_a_build_after_them() {
        let dir = tempdir("lost");
        drop(build(&dir, &[("a".to_owned(), b"1".to_vec())], 1));
        let index = Index::open(dir.join("i.index"), 1);
        let keys: Vec<String> = (0..=MAX_DIRTY).map(|i| format!("k{i}")).collect();
        index.written(keys.iter().map(String::as_str), 2);
        assert!(!index.is_built());
        let mut buf = [0u8; BUCKET];
        assert_eq!(index.find("a", &mut buf), Answer::AskDb);
        index.built(build(&dir, &[("a".to_owned(), b"1".to_vec())], 1), 1);
        assert!(!index.is_built(), "built before the writes it lost track of");
        index.built(build(&dir, &[("a".to_owned(), b"2".to_vec())], 2), 2);
        assert_eq!(index.find("a", &mut buf), Answer::Value(b"2"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
