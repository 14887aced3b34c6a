//! Where an instance keeps its own files (today: the per-key entries'
//! database, which holds the runtime overrides too), so that several instances started from one directory never
//! share one, and a restarted instance finds its own again.
//!
//! * The **state directory** (`--state-dir`, `FLOODGATE_STATE_DIR`):
//!   `$XDG_STATE_HOME/floodgate`, else `$HOME/.local/state/floodgate`, else
//!   (no home: a container's or a system user's) `floodgate-<uid>` in the
//!   temp dir; see [`default_state_dir`].
//! * The **instance name** (`--instance`, `FLOODGATE_INSTANCE`): by default
//!   `admin-<IP>-<PORT>` of the configured admin address. Two instances
//!   running at once cannot share an admin address, so they get different
//!   names; a restart with the same settings gets the same name.
//! * An instance's overrides live in `<state dir>/<instance>/overrides.redb`.
//!   When that file is open in another process (two instances with the
//!   admin port 0, whose names match), the next free `<instance>-2`,
//!   `-3`, … is used, and logged.
//! * The old default, `floodgate-overrides.redb` in the working directory,
//!   is moved to the first instance that starts without one of its own
//!   (logged); while another process has it open it stays where it is.
//!
//! With a Redis store, every instance still keeps its own local copy of the
//! shared overrides, so it can start (and serve the last overrides it saw)
//! while Redis is down.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use floodgate_perkey::{CacheOptions, KeyError, PerKey};

/// The old default overrides file, in the working directory.
pub const LEGACY_OVERRIDES_FILE: &str = "floodgate-overrides.redb";

/// Instances with the same name tried before giving up.
const MAX_SLOTS: u32 = 16;

/// Where the runtime overrides persist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OverridesFile {
    /// No overrides (the admin API's override calls answer 404).
    Off,
    /// This file, as given.
    At(PathBuf),
    /// The instance's own file under the state directory.
    Instance {
        /// The state directory.
        state_dir: PathBuf,
        /// The instance name.
        instance: String,
    },
}

/// The default state directory, from the environment:
/// `$XDG_STATE_HOME/floodgate`, else `$HOME/.local/state/floodgate`, else
/// `floodgate-<uid>` in the temp dir (`$TMPDIR`, else `/tmp`).
///
/// A user without a home gets the last: `HOME` unset, relative, `/` (what
/// podman and docker set for a user the image does not name) or not a
/// directory (Debian's system users' `/nonexistent`). Its files then last
/// until the temp dir is cleaned (a reboot, often): give `--state-dir` where
/// they matter (the container image and the Debian package do). The uid
/// keeps two such users on one machine apart.
pub fn default_state_dir() -> PathBuf {
    use std::os::unix::fs::MetadataExt;
    // `/proc/self` belongs to this process's (effective) user.
    let uid = std::fs::metadata("/proc/self").ok().map(|m| m.uid());
    state_dir_from(|k| std::env::var_os(k), &std::env::temp_dir(), uid)
}

/// [`default_state_dir`] with its environment passed in.
fn state_dir_from(var: impl Fn(&str) -> Option<OsString>, temp: &Path, uid: Option<u32>) -> PathBuf {
    let var = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(xdg) = var("XDG_STATE_HOME").filter(|p| p.is_absolute()) {
        return xdg.join("floodgate");
    }
    if let Some(home) = var("HOME").filter(|p| p.is_absolute() && p != Path::new("/") && p.is_dir()) {
        return home.join(".local/state/floodgate");
    }
    temp.join(uid.map_or_else(|| "floodgate".to_owned(), |uid| format!("floodgate-{uid}")))
}

/// The default instance name for an admin address: `admin-127.0.0.1-9090`
/// (an IPv6 address with its colons as `_`).
pub fn instance_for(admin: SocketAddr) -> String {
    format!("admin-{}-{}", admin.ip().to_string().replace(':', "_"), admin.port())
}

/// Check an instance name: 1 to 64 of `A-Z a-z 0-9 . _ -`, not starting
/// with a dot (it names a directory).
pub fn check_instance_name(name: &str) -> Result<(), BadInstanceName> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok { Ok(()) } else { Err(BadInstanceName(name.to_owned())) }
}

/// A name [`check_instance_name`] refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("instance name `{0}`: use 1 to 64 letters, digits, `.`, `_` or `-`, not starting with `.` (e.g. api-eu-1)")]
pub struct BadInstanceName(pub String);

/// Why the per-key store could not be opened: each says what to change.
#[derive(Debug, thiserror::Error)]
pub enum OpenKeysError {
    /// The file `--overrides-file` names.
    #[error("--overrides-file {}: {source}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        source: KeyError,
    },
    /// The instance's state directory cannot be made.
    #[error("cannot create the state directory {}: {source}; give a writable --state-dir", dir.display())]
    StateDir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The instance's file cannot be opened.
    #[error("overrides file {}: {source}", path.display())]
    Instance {
        /// The file.
        path: PathBuf,
        /// Why.
        source: KeyError,
    },
    /// Every name the instance may take is open in another process.
    #[error(
        "the overrides files of instance `{0}` and of {MAX_SLOTS} numbered names after it are all open in other processes: give this one its own --instance NAME"
    )]
    AllInUse(String),
}

/// Open the per-key store `file` says (with this cache), migrating the old
/// default when it applies. `Ok(None)` when per-key entries are off.
pub fn open_keys(file: &OverridesFile, cache: CacheOptions) -> Result<Option<PerKey>, OpenKeysError> {
    match file {
        OverridesFile::Off => Ok(None),
        OverridesFile::At(path) => {
            let o =
                PerKey::open_with(path, cache).map_err(|source| OpenKeysError::File { path: path.clone(), source })?;
            tracing::info!(file = %path.display(), "per-key entries (runtime overrides) persist here");
            Ok(Some(o))
        }
        OverridesFile::Instance { state_dir, instance } => {
            for slot in 1..=MAX_SLOTS {
                let name = if slot == 1 { instance.clone() } else { format!("{instance}-{slot}") };
                let dir = state_dir.join(&name);
                std::fs::create_dir_all(&dir).map_err(|source| OpenKeysError::StateDir { dir: dir.clone(), source })?;
                let path = dir.join("overrides.redb");
                if !path.exists() {
                    migrate_legacy(Path::new(LEGACY_OVERRIDES_FILE), &path);
                }
                match PerKey::open_with(&path, cache) {
                    Ok(o) => {
                        tracing::info!(file = %path.display(), instance = %name, "per-key entries (runtime overrides) persist here");
                        return Ok(Some(o));
                    }
                    Err(KeyError::InUse(_)) => {
                        tracing::info!(file = %path.display(), "open in another instance; trying the next name");
                    }
                    Err(source) => return Err(OpenKeysError::Instance { path, source }),
                }
            }
            Err(OpenKeysError::AllInUse(instance.clone()))
        }
    }
}

/// Move the old default overrides file to `to`, unless another process has
/// it open or it is absent. Logs what it did; a failure leaves it in place
/// (the instance starts with the file at `to`, empty).
fn migrate_legacy(legacy: &Path, to: &Path) {
    if !legacy.is_file() {
        return;
    }
    // redb locks an open database: opening it here tells whether an older
    // instance still uses it.
    match redb::Database::open(legacy) {
        Ok(db) => drop(db),
        Err(redb::DatabaseError::DatabaseAlreadyOpen) => {
            tracing::warn!(
                legacy = %legacy.display(),
                "the old default overrides file is open in another process: left in place; this instance uses {}",
                to.display()
            );
            return;
        }
        Err(e) => {
            tracing::warn!(legacy = %legacy.display(), "the old default overrides file cannot be read ({e}): left in place");
            return;
        }
    }
    let moved = std::fs::rename(legacy, to).or_else(|_| {
        // Another file system: copy, make it durable, then remove; a copy
        // that fails halfway is removed.
        let copied = std::fs::copy(legacy, to).and_then(|_| std::fs::File::open(to)?.sync_all());
        if let Err(e) = copied {
            let _ = std::fs::remove_file(to);
            return Err(e);
        }
        std::fs::remove_file(legacy)
    });
    match moved {
        Ok(()) => tracing::info!(
            from = %legacy.display(),
            to = %to.display(),
            "moved the overrides file from its old default place to this instance's state directory"
        ),
        Err(e) => {
            tracing::warn!(legacy = %legacy.display(), "could not move the old default overrides file ({e}): left in place")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: a non-root `serve` with `HOME=/` (a container's user)
    /// or no `HOME` exited "cannot create the state directory
    /// /.local/state/floodgate/…".
    #[test]
    fn regression_state_dir_without_a_home_is_in_the_temp_dir() {
        let temp = Path::new("/tmp");
        let home = std::env::temp_dir();
        let at = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, OsString)> = vars.iter().map(|(k, v)| ((*k).to_owned(), (*v).into())).collect();
            state_dir_from(|k| vars.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()), temp, Some(65532))
        };
        let fallback = PathBuf::from("/tmp/floodgate-65532");
        assert_eq!(at(&[]), fallback);
        for no_home in ["/", "", "relative/home", "/nonexistent/floodgate-test-home"] {
            assert_eq!(at(&[("HOME", no_home)]), fallback, "HOME={no_home}");
        }
        let h = home.to_str().unwrap();
        assert_eq!(at(&[("HOME", h)]), home.join(".local/state/floodgate"));
        assert_eq!(at(&[("HOME", h), ("XDG_STATE_HOME", "/srv/state")]), PathBuf::from("/srv/state/floodgate"));
        assert_eq!(
            at(&[("HOME", "/"), ("XDG_STATE_HOME", "relative")]),
            fallback,
            "a relative XDG_STATE_HOME is ignored"
        );
        assert_eq!(state_dir_from(|_| None, temp, None), PathBuf::from("/tmp/floodgate"));
    }

    #[test]
    fn instance_names_come_from_the_admin_address() {
        assert_eq!(instance_for("127.0.0.1:9090".parse().unwrap()), "admin-127.0.0.1-9090");
        assert_eq!(instance_for("[::1]:9091".parse().unwrap()), "admin-__1-9091");
        assert!(check_instance_name(&instance_for("[fe80::1]:0".parse().unwrap())).is_ok());
        for bad in ["", ".hidden", "a/b", "..", "x y", &"n".repeat(65)] {
            assert!(check_instance_name(bad).is_err(), "{bad:?}");
        }
    }
}
