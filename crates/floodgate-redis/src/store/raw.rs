//! The store's plain commands beside its decisions, for this crate: a
//! Redis region's bookkeeping (`raw`, public too, for tests and tools) and
//! what the typed commands of `commands.rs` are made of (`raw_here`,
//! `raw_here_each`, `bulk`); and the listing of keys over every primary
//! (`SCAN`, the cluster's topology).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use floodgate_core::StoreError;

use super::{CallError, Client, ConnSlot, MAX_LANES, RedisStore, Via, join_all};
use crate::conn::Packed;
use crate::target::Target;

impl RedisStore {
    /// One plain command through the breaker and the timeout (a region's
    /// own bookkeeping: its incarnation, `SCAN`).
    pub async fn raw(&self, cmd: &redis::Cmd) -> Result<redis::Value, StoreError> {
        self.raw_call(cmd).await
    }

    /// [`RedisStore::raw`] on a connection of this thread's own, made on
    /// the current runtime: on a per-core runtime the command, its
    /// connection's driver and the reply stay on one thread (no
    /// cross-thread wake-ups; a per-key miss's read). Beyond 16 threads,
    /// the shared connection.
    pub(crate) async fn raw_here(&self, cmd: &redis::Cmd) -> Result<redis::Value, StoreError> {
        self.one_via(cmd, None, Via::Decisions).await
    }

    /// Each command of `pipe`, answered in order, on this thread's own
    /// connection as [`RedisStore::raw_here`]. On one server they go as one
    /// pipeline: one call through the breaker and the timeout, one write,
    /// one reply to wait for (a batch of per-key misses, a command per
    /// shard, costs what one command does). On a cluster each goes to its
    /// own node, all together. A command that Redis refuses fails its own
    /// answer; a call that fails (a timeout, a lost connection, the breaker
    /// open) fails them all.
    pub(crate) async fn raw_here_each(&self, pipe: &redis::Pipeline) -> Vec<Result<redis::Value, StoreError>> {
        if matches!(self.inner.client, Client::Cluster(_)) {
            return join_all(pipe.cmd_iter().map(|cmd| self.raw_here(cmd)).collect()).await;
        }
        let slot = self.here();
        let slot = slot.as_deref().unwrap_or(&self.inner.conn);
        let timeout = self.inner.config.timeout;
        match self.call(Packed::Many(pipe), None, true, None, slot, None).await {
            Ok(redis::Value::Array(replies)) if replies.len() == pipe.len() => replies
                .into_iter()
                .map(|v| v.extract_error().map_err(|e| CallError::Redis(e).store_error(timeout)))
                .collect(),
            Ok(_) => {
                let e = CallError::Reply("a pipeline answered with the wrong count".to_owned());
                pipe.cmd_iter().map(|_| Err(e.store_error(timeout))).collect()
            }
            Err(e) => pipe.cmd_iter().map(|_| Err(e.store_error(timeout))).collect(),
        }
    }

    /// One command through the breaker on the connection `via` names, with
    /// its timeout: this thread's own and the decisions' timeout, or the
    /// administrative one and its own. With `eval`, a script command
    /// (`EVALSHA`, then `eval()` on `NOSCRIPT`).
    pub(super) async fn one_via(
        &self,
        cmd: &redis::Cmd,
        eval: Option<&(dyn Fn() -> redis::Cmd + Sync)>,
        via: Via,
    ) -> Result<redis::Value, StoreError> {
        match via {
            Via::Decisions => {
                let slot = self.here();
                let slot = slot.as_deref().unwrap_or(&self.inner.conn);
                self.call(Packed::One(cmd), eval, true, None, slot, None)
                    .await
                    .map_err(|e| e.store_error(self.inner.config.timeout))
            }
            Via::Admin(timeout) => {
                let deadline = tokio::time::Instant::now() + timeout;
                self.call(Packed::One(cmd), eval, true, Some(deadline), &self.inner.bulk, None)
                    .await
                    .map_err(|e| e.store_error(timeout))
            }
        }
    }

    /// This thread's own connection slot (`None` beyond [`MAX_LANES`]
    /// threads: the shared connection then).
    pub(super) fn here(&self) -> Option<Arc<ConnSlot>> {
        let thread = std::thread::current().id();
        let mut here = self.inner.here.lock().unwrap_or_else(PoisonError::into_inner);
        match here.iter().find(|(t, _)| *t == thread) {
            Some((_, slot)) => Some(Arc::clone(slot)),
            None if here.len() < MAX_LANES => {
                let slot: Arc<ConnSlot> = Arc::new(Mutex::new(None));
                here.push((thread, Arc::clone(&slot)));
                Some(slot)
            }
            None => None,
        }
    }

    /// One administrative command (a bulk write, a listing) through the
    /// breaker, bounded by `timeout` instead of the decisions' timeout, on a
    /// connection of its own.
    pub(crate) async fn bulk(&self, cmd: &redis::Cmd, timeout: Duration) -> Result<redis::Value, StoreError> {
        self.one_via(cmd, None, Via::Admin(timeout)).await
    }

    /// Every key matching `pattern` (`SCAN … MATCH`, 1 000 a call), each
    /// call through the breaker, bounded by `timeout`, on the bulk
    /// connection; each key once. As with `SCAN` itself, a key that exists
    /// throughout is given, one written meanwhile may not be.
    ///
    /// On a cluster: one `SCAN` walk per primary, each routed by a slot it
    /// serves as `CLUSTER SLOTS` lists them. When the listing differs after
    /// the walks (a slot moved, a replica took over), a key may have moved
    /// past a walk: the walks run again, up to three times in all; a
    /// cluster still changing after that gives what the last walks found.
    pub async fn scan(&self, pattern: &str, timeout: Duration) -> Result<Vec<String>, StoreError> {
        let mut keys = std::collections::HashSet::new();
        if let Target::Single(_) = self.inner.config.target {
            // SCAN itself may give a key twice (while the server rehashes).
            keys.extend(self.scan_node(pattern, None, timeout).await?);
            return Ok(keys.into_iter().collect());
        }
        let mut before = self.topology(timeout).await?;
        for _ in 0..3 {
            keys.clear();
            // One walk per primary, routed by the first slot it serves.
            let mut walked: Vec<&redis::Value> = Vec::new();
            for (first, _, primary) in &before {
                if walked.contains(&primary) {
                    continue;
                }
                walked.push(primary);
                keys.extend(self.scan_node(pattern, Some(*first), timeout).await?);
            }
            let after = self.topology(timeout).await?;
            if after == before {
                break;
            }
            before = after;
        }
        Ok(keys.into_iter().collect())
    }

    /// One `SCAN` walk: of the server, or of the primary serving slot `at`.
    pub(super) async fn scan_node(
        &self,
        pattern: &str,
        at: Option<u16>,
        timeout: Duration,
    ) -> Result<Vec<String>, StoreError> {
        let mut keys = Vec::new();
        let mut cursor = "0".to_owned();
        loop {
            let mut scan = redis::cmd("SCAN");
            scan.arg(&cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000);
            let deadline = tokio::time::Instant::now() + timeout;
            let v = self
                .call(Packed::One(&scan), None, true, Some(deadline), &self.inner.bulk, at)
                .await
                .map_err(|e| e.store_error(timeout))?;
            let (next, found): (String, Vec<String>) = redis::FromRedisValue::from_redis_value(v)
                .map_err(|e| StoreError::Unavailable(format!("Redis: a SCAN reply: {e}")))?;
            keys.extend(found);
            if next == "0" {
                return Ok(keys);
            }
            cursor = next;
        }
    }

    /// The cluster's slot ranges as `CLUSTER SLOTS` gives them, ordered:
    /// `(first slot, last slot, primary's address and id)`.
    pub(super) async fn topology(&self, timeout: Duration) -> Result<Vec<(u16, u16, redis::Value)>, StoreError> {
        let mut slots = redis::cmd("CLUSTER");
        slots.arg("SLOTS");
        let v = self.bulk(&slots, timeout).await?;
        let bad = |what: &str| StoreError::Unavailable(format!("Redis: a CLUSTER SLOTS reply {what}"));
        let redis::Value::Array(ranges) = v else { return Err(bad("that is not an array")) };
        let mut out = Vec::with_capacity(ranges.len());
        for r in ranges {
            let redis::Value::Array(f) = r else { return Err(bad("with a range that is not an array")) };
            let (Some(redis::Value::Int(first)), Some(redis::Value::Int(last)), Some(redis::Value::Array(primary))) =
                (f.first(), f.get(1), f.get(2))
            else {
                return Err(bad("with a range without its slots and primary"));
            };
            let slot = |n: &i64| u16::try_from(*n).map_err(|_| bad("with a slot beyond 16383"));
            out.push((slot(first)?, slot(last)?, redis::Value::Array(primary.iter().take(3).cloned().collect())));
        }
        out.sort_by_key(|r| r.0);
        Ok(out)
    }

    /// One command through the breaker and the timeout (for [`SharedMap`](crate::SharedMap)).
    pub(crate) async fn raw_call(&self, cmd: &redis::Cmd) -> Result<redis::Value, StoreError> {
        self.call(Packed::One(cmd), None, true, None, &self.inner.conn, None)
            .await
            .map_err(|e| e.store_error(self.inner.config.timeout))
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use floodgate_testing::{RedisCluster, RedisServer};

    use crate::{RedisConfig, RedisStore};

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Runtime::new().unwrap()
    }

    /// A store on `url` whose calls wait at most `timeout`.
    fn store(url: &str, timeout: Duration) -> RedisStore {
        RedisStore::new(RedisConfig { timeout, ..RedisConfig::new(url.parse().unwrap()) }).unwrap()
    }

    /// `raw_here_each`: the commands of a pipeline answered in order, one
    /// that Redis refuses failing alone (a per-key read batch: one shard's
    /// failure must not fail the others'), and a hung Redis failing them all
    /// within the timeout; the same on a cluster, where each command goes to
    /// its own node.
    #[test]
    fn a_pipeline_answers_each_command_and_fails_one_alone() {
        let server = RedisServer::start();
        let rt = runtime();
        let s = store(&server.url(), Duration::from_millis(200));
        server.cli(&["HSET", "h", "a", "1"]);
        server.cli(&["SET", "str", "x"]);
        let mut pipe = redis::pipe();
        pipe.cmd("HMGET").arg("h").arg("a").arg("b");
        pipe.cmd("HMGET").arg("str").arg("a");
        pipe.cmd("GET").arg("str");
        rt.block_on(async {
            let got = s.raw_here_each(&pipe).await;
            assert_eq!(got.len(), 3);
            let first: Vec<Option<String>> = redis::FromRedisValue::from_redis_value(got[0].clone().unwrap()).unwrap();
            assert_eq!(first, [Some("1".to_owned()), None]);
            let e = got[1].as_ref().unwrap_err().to_string();
            assert!(e.contains("WRONGTYPE"), "the refused command fails alone: {e}");
            let third: String = redis::FromRedisValue::from_redis_value(got[2].clone().unwrap()).unwrap();
            assert_eq!(third, "x");
            assert!(!s.stats().breaker_open, "a refused command is a reply, not a fault");

            server.pause();
            let t = Instant::now();
            let got = s.raw_here_each(&pipe).await;
            assert!(got.iter().all(Result::is_err), "a hung Redis fails every command");
            assert!(t.elapsed() < Duration::from_millis(800), "within the timeout: {:?}", t.elapsed());
            server.resume();
        });
        let cluster = RedisCluster::start();
        let c = store(&cluster.url(), Duration::from_secs(2));
        rt.block_on(async {
            let mut pipe = redis::pipe();
            for k in ["{a}x", "{b}y", "{c}z"] {
                pipe.cmd("SET").arg(k).arg(k);
            }
            for k in ["{a}x", "{b}y", "{c}z"] {
                pipe.cmd("GET").arg(k);
            }
            let got = c.raw_here_each(&pipe).await;
            let values: Vec<String> =
                got[3..].iter().map(|v| redis::FromRedisValue::from_redis_value(v.clone().unwrap()).unwrap()).collect();
            assert_eq!(values, ["{a}x", "{b}y", "{c}z"], "each to its own node");
        });
    }
}
