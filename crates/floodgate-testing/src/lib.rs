//! What floodgate's tests share, in every crate (a dev-dependency, never
//! published): throwaway Redis servers and clusters on free ports
//! ([`redis`]), and temp dirs removed on drop ([`TempDir`]).

#![allow(clippy::missing_panics_doc)]

pub mod openai;
pub mod redis;

use std::fs;
use std::path::PathBuf;

pub use redis::{RedisCluster, RedisServer, free_port};

/// A fresh directory under the system temp dir, removed on drop.
#[derive(Debug)]
pub struct TempDir(pub PathBuf);

impl TempDir {
    /// A new empty directory named after `name` and this process.
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("floodgate-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    /// `name` inside the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Write `name` (creating its parent directories).
    pub fn write(&self, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let path = self.0.join(name);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, bytes).unwrap();
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The output of `fut`, which must be ready at its first poll (a decision
/// over stores that answer at once: the in-memory store).
///
/// # Panics
/// When `fut` is pending.
#[track_caller]
pub fn at_once<F: std::future::Future>(fut: F) -> F::Output {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match std::pin::pin!(fut).poll(&mut cx) {
        std::task::Poll::Ready(out) => out,
        std::task::Poll::Pending => panic!("pending: expected an answer at once"),
    }
}
