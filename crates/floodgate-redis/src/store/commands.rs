//! Typed commands for what other crates keep in the store's Redis beside
//! the decisions (the per-key entries: hashes, a sorted index, versions,
//! and a script of their own), on the connection each kind of call needs.
//! Every call goes through the breaker and a timeout; a reply of the wrong
//! type is a [`StoreError::Unavailable`] naming the command.

use std::time::Duration;

use floodgate_core::StoreError;
use redis::FromRedisValue;

use super::RedisStore;

/// Which connection a command takes, and its timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// The calling thread's own connection and the decisions' timeout:
    /// short reads on the decision path (a per-key miss). On a per-core
    /// runtime the command and its reply stay on the thread.
    Decisions,
    /// The administrative connection with this timeout: writes, listings
    /// and counts, kept off the decisions' connections so that they never
    /// queue ahead of a decision.
    Admin(Duration),
}

/// A Lua script of another crate's, sent by its SHA1 (`EVALSHA`) and in
/// full once a server does not know it (`NOSCRIPT`: a restarted or new
/// node).
#[derive(Debug)]
pub struct Script {
    source: &'static str,
    sha: String,
}

impl Script {
    /// The script `source` (its `KEYS` and `ARGV` contract at its top, as
    /// the store's own scripts have it).
    pub fn new(source: &'static str) -> Self {
        Self { source, sha: redis::Script::new(source).get_hash().to_owned() }
    }
}

fn typed<T: FromRedisValue>(what: &str, v: Result<redis::Value, StoreError>) -> Result<T, StoreError> {
    FromRedisValue::from_redis_value(v?)
        .map_err(|e| StoreError::Unavailable(format!("Redis answered {what} with an unexpected reply: {e}")))
}

impl RedisStore {
    async fn on(&self, cmd: &redis::Cmd, via: Via) -> Result<redis::Value, StoreError> {
        self.one_via(cmd, None, via).await
    }

    /// `HMGET` of several hashes at once, one answer per `(hash, fields)`
    /// in order, each a value per field. With [`Via::Decisions`] on one
    /// server they go as one pipeline (one call for the client); on a
    /// cluster, or with [`Via::Admin`], concurrently. A hash Redis refuses
    /// (not a hash) fails its own answer only.
    pub async fn hmget_each(
        &self,
        reads: &[(&str, Vec<&str>)],
        via: Via,
    ) -> Vec<Result<Vec<Option<Vec<u8>>>, StoreError>> {
        let mut pipe = redis::Pipeline::with_capacity(reads.len());
        for (hash, fields) in reads {
            let cmd = pipe.cmd("HMGET").arg(*hash);
            for f in fields {
                cmd.arg(*f);
            }
        }
        let replies = match via {
            Via::Decisions => self.raw_here_each(&pipe).await,
            Via::Admin(_) => super::join_all(pipe.cmd_iter().map(|cmd| self.on(cmd, via)).collect()).await,
        };
        replies
            .into_iter()
            .zip(reads)
            .map(|(v, (_, fields))| {
                let values: Vec<Option<Vec<u8>>> = typed("HMGET", v)?;
                if values.len() == fields.len() {
                    Ok(values)
                } else {
                    Err(StoreError::Unavailable("Redis answered HMGET with the wrong count".into()))
                }
            })
            .collect()
    }

    /// `HGET hash field`.
    pub async fn hget(&self, hash: &str, field: &str, via: Via) -> Result<Option<Vec<u8>>, StoreError> {
        let mut cmd = redis::cmd("HGET");
        cmd.arg(hash).arg(field);
        typed("HGET", self.on(&cmd, via).await)
    }

    /// `HGETALL` of a hash of counters: each field with its number.
    pub async fn hash_counts(&self, hash: &str, via: Via) -> Result<Vec<(String, u64)>, StoreError> {
        let mut cmd = redis::cmd("HGETALL");
        cmd.arg(hash);
        typed("HGETALL", self.on(&cmd, via).await)
    }

    /// `ZRANGEBYLEX key min max LIMIT 0 count`: the members of a sorted set
    /// (of equal scores) from `min` to `max` (`[` inclusive, `(` exclusive,
    /// `-` / `+` the ends), at most `count`.
    pub async fn range_by_lex(
        &self,
        key: &str,
        min: &[u8],
        max: &[u8],
        count: usize,
        via: Via,
    ) -> Result<Vec<String>, StoreError> {
        let mut cmd = redis::cmd("ZRANGEBYLEX");
        cmd.arg(key).arg(min).arg(max).arg("LIMIT").arg(0).arg(count);
        typed("ZRANGEBYLEX", self.on(&cmd, via).await)
    }

    /// `GET` of a number (`None` when the key does not exist).
    pub async fn get_number(&self, key: &str, via: Via) -> Result<Option<u64>, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(key);
        typed("GET", self.on(&cmd, via).await)
    }

    /// Whether `key` exists.
    pub async fn exists(&self, key: &str, via: Via) -> Result<bool, StoreError> {
        let mut cmd = redis::cmd("EXISTS");
        cmd.arg(key);
        typed::<i64>("EXISTS", self.on(&cmd, via).await).map(|n| n == 1)
    }

    /// `SET key value`.
    pub async fn set(&self, key: &str, value: &str, via: Via) -> Result<(), StoreError> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(key).arg(value);
        typed("SET", self.on(&cmd, via).await)
    }

    /// Run `script` with `keys` and `args`; its reply is a list of
    /// integers. By SHA1 (`EVALSHA`), and in full (`EVAL`) on the same
    /// connection when the server answers `NOSCRIPT`.
    pub async fn run_script(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
        via: Via,
    ) -> Result<Vec<i64>, StoreError> {
        let call = |verb: &str, body: &str| {
            let mut cmd = redis::cmd(verb);
            cmd.arg(body).arg(keys.len());
            for k in keys {
                cmd.arg(*k);
            }
            for a in args {
                cmd.arg(*a);
            }
            cmd
        };
        let by_sha = call("EVALSHA", &script.sha);
        let eval = || call("EVAL", script.source);
        typed("the script", self.one_via(&by_sha, Some(&eval), via).await)
    }
}
