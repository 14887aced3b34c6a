//! A Redis region's record of incarnations, in its Redis so every instance
//! shares it (see `floodgate_core::region::Incarnations` for what it is
//! for): the hash `<prefix>region:<name>:i`, a field `<region>=<incarnation>`
//! per incarnation known (`=` cannot be in a region's name), its value
//! `"<recorded us> <dead us> <count>"` (dead 0: alive, or dead since a later
//! one of its region was recorded). Written once per incarnation
//! (`HSETNX`: the first instance to learn it records when), read back by
//! every instance once per sync interval. A Redis that restarts empty loses
//! it with the rest of the region's state, and learns it back from its
//! peers' full state transfers before it admits on bounded rules.

use std::sync::{Mutex, PoisonError};

use floodgate_core::StoreError;
use floodgate_core::region::Incarnation;

use crate::RedisStore;

/// The record's key and the region names its indices stand for.
pub(super) struct Record {
    key: String,
    /// Index 0 is this region; others as they are met.
    names: Mutex<Vec<String>>,
}

impl Record {
    /// The record of region `me` under `prefix`.
    pub(super) fn new(prefix: &str, me: &str) -> Self {
        Self { key: format!("{prefix}region:{me}:i"), names: Mutex::new(vec![me.to_owned()]) }
    }

    /// The index standing for region `name`.
    pub(super) fn index(&self, name: &str) -> u32 {
        let mut names = self.names.lock().unwrap_or_else(PoisonError::into_inner);
        match names.iter().position(|n| n == name) {
            Some(i) => u32::try_from(i).unwrap_or(u32::MAX),
            None => {
                names.push(name.to_owned());
                u32::try_from(names.len() - 1).unwrap_or(u32::MAX)
            }
        }
    }

    /// The name index `i` stands for.
    pub(super) fn name(&self, i: u32) -> Option<String> {
        self.names.lock().unwrap_or_else(PoisonError::into_inner).get(i as usize).cloned()
    }

    fn field(&self, r: &Incarnation) -> Option<String> {
        Some(format!("{}={}", self.name(r.region)?, r.incarnation))
    }

    /// Every record in Redis (malformed fields skipped).
    pub(super) async fn read(&self, store: &RedisStore) -> Result<Vec<Incarnation>, StoreError> {
        let mut get = redis::cmd("HGETALL");
        get.arg(&self.key);
        let v = store.raw(&get).await?;
        let map: std::collections::HashMap<String, String> =
            redis::FromRedisValue::from_redis_value(v).unwrap_or_default();
        let mut out = Vec::with_capacity(map.len());
        for (field, value) in map {
            let Some((region, inc)) = field.rsplit_once('=') else { continue };
            let Ok(incarnation) = inc.parse::<u64>() else { continue };
            let nums: Vec<u64> = value.split(' ').filter_map(|n| n.parse().ok()).collect();
            let [recorded_us, dead_us, count] = nums[..] else { continue };
            out.push(Incarnation {
                region: self.index(region),
                incarnation,
                recorded_us,
                dead_us,
                count: count.max(1),
            });
        }
        Ok(out)
    }

    /// Record `recs` where they are not recorded yet.
    pub(super) async fn add(&self, store: &RedisStore, recs: &[Incarnation]) -> Result<(), StoreError> {
        for r in recs {
            let Some(field) = self.field(r) else { continue };
            let mut set = redis::cmd("HSETNX");
            set.arg(&self.key).arg(field).arg(format!("{} {} {}", r.recorded_us, r.dead_us, r.count.max(1)));
            store.raw(&set).await?;
        }
        Ok(())
    }

    /// Forget `recs` (dead long enough that nothing counts them).
    pub(super) async fn remove(&self, store: &RedisStore, recs: &[Incarnation]) -> Result<(), StoreError> {
        let fields: Vec<String> = recs.iter().filter_map(|r| self.field(r)).collect();
        if fields.is_empty() {
            return Ok(());
        }
        let mut del = redis::cmd("HDEL");
        del.arg(&self.key).arg(fields);
        store.raw(&del).await.map(drop)
    }
}
