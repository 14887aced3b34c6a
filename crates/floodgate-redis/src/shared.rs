//! [`SharedMap`]: a small map every instance shares through Redis: a hash
//! and a version counter in one hash slot, so a change is one atomic call
//! and the other instances notice it by polling the version (one `GET`).
//! Runtime overrides were shared this way before per-key entries were
//! sharded (the `floodgate-perkey` crate); the server now only reads
//! such a map once, to move its entries into the shards.

use floodgate_core::StoreError;

use crate::RedisStore;

const LOAD: &str = "return {redis.call('GET', KEYS[2]) or '0', redis.call('HGETALL', KEYS[1])}";
const SET: &str = "redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) return redis.call('INCR', KEYS[2])";
const REMOVE: &str = "redis.call('HDEL', KEYS[1], ARGV[1]) return redis.call('INCR', KEYS[2])";

/// A map of strings shared through Redis, with a version that grows on
/// every change.
#[derive(Debug, Clone)]
pub struct SharedMap {
    store: RedisStore,
    hash: String,
    version: String,
}

impl RedisStore {
    /// The shared map `name` (keys `<prefix>{name}` and
    /// `<prefix>{name}:version`).
    pub fn shared_map(&self, name: &str) -> SharedMap {
        let p = &self.config().key_prefix;
        SharedMap { store: self.clone(), hash: format!("{p}{{{name}}}"), version: format!("{p}{{{name}}}:version") }
    }
}

impl SharedMap {
    async fn eval<T: redis::FromRedisValue>(&self, script: &str, args: &[&str]) -> Result<T, StoreError> {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(script).arg(2).arg(&self.hash).arg(&self.version);
        for a in args {
            cmd.arg(*a);
        }
        let v = self.store.raw_call(&cmd).await?;
        redis::FromRedisValue::from_redis_value(v).map_err(|e| StoreError::Unavailable(format!("Redis: {e}")))
    }

    /// The current version (0 before the first change).
    pub async fn version(&self) -> Result<u64, StoreError> {
        let mut cmd = redis::cmd("GET");
        cmd.arg(&self.version);
        let v = self.store.raw_call(&cmd).await?;
        let v: Option<u64> =
            redis::FromRedisValue::from_redis_value(v).map_err(|e| StoreError::Unavailable(format!("Redis: {e}")))?;
        Ok(v.unwrap_or(0))
    }

    /// The version and every entry, read atomically.
    pub async fn load(&self) -> Result<(u64, Vec<(String, String)>), StoreError> {
        let (version, flat): (u64, Vec<String>) = self.eval(LOAD, &[]).await?;
        let mut entries = Vec::with_capacity(flat.len() / 2);
        let mut it = flat.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            entries.push((k, v));
        }
        Ok((version, entries))
    }

    /// Set one entry; the new version.
    pub async fn set(&self, key: &str, value: &str) -> Result<u64, StoreError> {
        self.eval(SET, &[key, value]).await
    }

    /// Remove one entry; the new version.
    pub async fn remove(&self, key: &str) -> Result<u64, StoreError> {
        self.eval(REMOVE, &[key]).await
    }
}
