//! Loading a directory of rules files.

use std::collections::HashMap;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use super::model::RuleSet;
use super::parse::{FileParser, LoadOptions};
use super::{ConfigError, ConfigErrors, Pos};

/// Rules files read but not yet parsed: each file's name and text, and
/// the files that could not be read. Compare two reads with
/// [`Sources::digest`] to tell whether anything a reload would see changed.
#[derive(Debug, Clone, Default)]
pub struct Sources {
    /// Where they came from (for messages): a directory, or `<embedded>`.
    pub origin: PathBuf,
    /// `(path, text)` of every file, sorted by path.
    pub files: Vec<(PathBuf, String)>,
    /// Files that could not be read, each with why.
    pub errors: Vec<ConfigError>,
}

impl Sources {
    /// Read every `*.yaml` / `*.yml` file under `dir` (recursively; hidden
    /// files and directories skipped; symlinks followed). Fails only when
    /// the directory itself cannot be listed; a file that cannot be read is
    /// kept as an error, reported with the others at build time.
    pub fn read_dir(dir: &Path, opts: &LoadOptions) -> Result<Sources, ConfigErrors> {
        let files = rule_files(dir, opts.max_files)
            .map_err(|m| ConfigErrors(vec![error(dir, Pos::default(), m.to_string())]))?;
        let mut sources = Sources { origin: dir.to_owned(), ..Sources::default() };
        for path in files {
            match read_bounded(&path, opts.max_file_bytes) {
                Ok(text) => sources.files.push((path, text)),
                Err(message) => sources.errors.push(error(&path, Pos::default(), message.to_string())),
            }
        }
        Ok(sources)
    }

    /// Files compiled into a program, `(name, text)`: each is named
    /// `<embedded>/name` in messages and listings.
    pub fn embedded(files: &[(&str, &str)]) -> Sources {
        let origin = PathBuf::from("<embedded>");
        let mut files: Vec<(PathBuf, String)> =
            files.iter().map(|(name, text)| (origin.join(name), (*text).to_owned())).collect();
        files.sort();
        Sources { origin, files, errors: Vec::new() }
    }

    /// A hash of every file's path and text and of every read error: equal
    /// digests mean a reload would build the same rules.
    pub fn digest(&self) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.files.hash(&mut h);
        for e in &self.errors {
            e.to_string().hash(&mut h);
        }
        h.finish()
    }
}

impl RuleSet {
    /// Load every `*.yaml` / `*.yml` file under `dir` (recursively; hidden
    /// files and directories skipped), one domain per file. All problems of
    /// all files are reported at once; nothing is returned unless every file
    /// is valid.
    pub fn load_dir(dir: &Path, opts: &LoadOptions) -> Result<RuleSet, ConfigErrors> {
        RuleSet::build(Sources::read_dir(dir, opts)?, opts)
    }

    /// Build from files already read: every read error and every parse
    /// error at once, or the rules.
    pub fn build(sources: Sources, opts: &LoadOptions) -> Result<RuleSet, ConfigErrors> {
        let Sources { origin, files, mut errors } = sources;
        match RuleSet::from_sources(files, opts) {
            Err(ConfigErrors(mut more)) => {
                errors.append(&mut more);
                Err(ConfigErrors::sorted(errors))
            }
            Ok(_) if !errors.is_empty() => Err(ConfigErrors::sorted(errors)),
            Ok(mut set) => {
                if set.files.is_empty() {
                    set.warnings.push(error(
                        &origin,
                        Pos::default(),
                        "no rules files (*.yaml, *.yml) here: nothing is limited".into(),
                    ));
                }
                Ok(set)
            }
        }
    }

    /// Build from `(path, text)` pairs (the path is for messages).
    pub fn from_sources(sources: Vec<(PathBuf, String)>, opts: &LoadOptions) -> Result<RuleSet, ConfigErrors> {
        let mut set = RuleSet::default();
        let mut errors = Vec::new();
        let mut rules = 0;
        let mut seen: HashMap<String, (PathBuf, Pos)> = HashMap::new();
        for (i, (path, text)) in sources.into_iter().enumerate() {
            let file = u32::try_from(i).unwrap_or(u32::MAX);
            let mut parser = FileParser::new(file, &path, opts, rules);
            let domain = parser.parse(&text);
            rules = parser.rules;
            errors.append(&mut parser.errors);
            set.warnings.append(&mut parser.warnings);
            set.files.push(path.clone());
            if let Some((name, at)) = parser.domain.take() {
                if let Some((other, pos)) = seen.get(&name) {
                    errors.push(error(
                        &path,
                        at,
                        format!(
                            "domain `{name}` is already defined in {}:{pos}: put each domain in one file",
                            other.display()
                        ),
                    ));
                    continue;
                }
                seen.insert(name, (path.clone(), at));
            }
            if let Some(domain) = domain {
                set.domains.insert(domain.name.clone(), domain);
            }
        }
        if errors.is_empty() { Ok(set) } else { Err(ConfigErrors::sorted(errors)) }
    }

    /// Build from one file's text (tests, examples, embedding).
    pub fn from_yaml(path: impl Into<PathBuf>, text: &str) -> Result<RuleSet, ConfigErrors> {
        RuleSet::from_sources(vec![(path.into(), text.to_owned())], &LoadOptions::default())
    }
}

fn error(path: &Path, pos: Pos, message: String) -> ConfigError {
    ConfigError { file: path.to_owned(), pos, field: String::new(), message }
}

/// The rules files under `dir`, sorted, as [`Sources::read_dir`] reads
/// them (at most `max`): what a watcher should look at.
pub fn rule_files(dir: &Path, max: usize) -> Result<Vec<PathBuf>, RulesDirError> {
    let mut files = Vec::new();
    collect(dir, &mut files, max)?;
    files.sort();
    Ok(files)
}

/// Whether `path` names a rules file (`*.yaml`, `*.yml`).
pub fn is_rules_file(path: &Path) -> bool {
    matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml"))
}

/// Why the rules directory cannot be listed.
#[derive(Debug, thiserror::Error)]
pub enum RulesDirError {
    /// The directory (or one below it) cannot be read.
    #[error("cannot read the rules directory: {0}")]
    Read(std::io::Error),
    /// An entry's type cannot be read.
    #[error("{}: {error}", .path.display())]
    Entry {
        /// The entry.
        path: PathBuf,
        /// What the system said (in the message, not a source: said once).
        error: std::io::Error,
    },
    /// More files than the bound.
    #[error("more than {0} rules files: raise the bound or split the directory")]
    TooMany(usize),
}

/// Why a rules file cannot be read (it is reported with its path).
#[derive(Debug, thiserror::Error)]
enum FileError {
    #[error("cannot read: {0}")]
    Read(std::io::Error),
    #[error("larger than {0} bytes: split it, or raise the file size bound")]
    TooLarge(u64),
    #[error("not valid UTF-8 at line {line} (byte {at}): save the file as UTF-8")]
    NotUtf8 { line: usize, at: usize },
}

fn collect(dir: &Path, out: &mut Vec<PathBuf>, max: usize) -> Result<(), RulesDirError> {
    let entries = fs::read_dir(dir).map_err(RulesDirError::Read)?;
    for entry in entries {
        let entry = entry.map_err(RulesDirError::Read)?;
        let path = entry.path();
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let kind = entry.file_type().map_err(|error| RulesDirError::Entry { path: path.clone(), error })?;
        // Follow symlinks (Kubernetes ConfigMaps are symlinks) by stat-ing.
        let meta = if kind.is_symlink() { fs::metadata(&path).ok() } else { None };
        let is_dir = meta.as_ref().map_or(kind.is_dir(), fs::Metadata::is_dir);
        if is_dir {
            collect(&path, out, max)?;
        } else if is_rules_file(&path) {
            out.push(path);
            if out.len() > max {
                return Err(RulesDirError::TooMany(max));
            }
        }
    }
    Ok(())
}

/// Read at most `max` bytes; larger files, invalid UTF-8 and I/O failures
/// become messages.
fn read_bounded(path: &Path, max: u64) -> Result<String, FileError> {
    let file = fs::File::open(path).map_err(FileError::Read)?;
    let mut bytes = Vec::new();
    file.take(max + 1).read_to_end(&mut bytes).map_err(FileError::Read)?;
    if bytes.len() as u64 > max {
        return Err(FileError::TooLarge(max));
    }
    String::from_utf8(bytes).map_err(|e| {
        let at = e.utf8_error().valid_up_to();
        let prefix = &e.as_bytes()[..at];
        let line = prefix.iter().filter(|&&b| b == b'\n').count() + 1;
        FileError::NotUtf8 { line, at }
    })
}
