//! A Redis region's global state in Redis, beside the decisions (which
//! `scripts/global.lua` makes in the same call as the regional checks):
//! [`RedisStore::merge`] stores a peer's batch, [`RedisStore::read_global`]
//! gives what to send, [`RedisStore::ack_global`] records what a peer
//! acknowledged. Moving them between regions is [`super::RedisRegion`]'s.

use std::collections::HashMap;

use floodgate_core::region::{Batch, Component, Item, Shape, SyncMode, fingerprint, shape_of};
use floodgate_core::{Limit, StoreError};
use redis::cluster_routing::Slot;

use crate::script::{SHA, SOURCE, algorithm, global_base, global_key, redis_key, window_string_state};
use crate::store::RedisStore;

/// What storing a peer's batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MergeStats {
    /// Components that changed something.
    pub merged: u64,
    /// Components that changed nothing.
    pub unchanged: u64,
    /// Components too old to count.
    pub stale: u64,
    /// Keys whose limits differ from this region's.
    pub mismatched: u64,
    /// The batch's items (indices) in which a component the sender relays
    /// (not its own current one) raised this region's: to send on to every
    /// other peer.
    pub relay: Vec<usize>,
}

impl RedisStore {
    /// The base key of a counter key's global state.
    fn base(&self, key: &str) -> String {
        global_base(&self.config().key_prefix, key)
    }

    /// Group the indices `of` (into `keys`, counter keys) by their global
    /// state's hash slot (one group on one server).
    fn by_slot_of<K: AsRef<str>>(&self, keys: &[K], of: &[usize]) -> Vec<Vec<usize>> {
        if !matches!(self.config().target, crate::Target::Cluster(_)) {
            return vec![of.to_vec()];
        }
        let bases: Vec<String> = of.iter().map(|&i| self.base(keys[i].as_ref())).collect();
        self.by_slot(&bases).into_iter().map(|g| g.into_iter().map(|j| of[j]).collect()).collect()
    }

    /// Group `keys`' indices by hash slot (one group on one server).
    fn by_slot(&self, bases: &[String]) -> Vec<Vec<usize>> {
        if !matches!(self.config().target, crate::Target::Cluster(_)) {
            return vec![(0..bases.len()).collect()];
        }
        let mut groups: Vec<(Slot, Vec<usize>)> = Vec::new();
        for (i, b) in bases.iter().enumerate() {
            let s = Slot::for_key(b);
            match groups.iter_mut().find(|(x, _)| *x == s) {
                Some((_, g)) => g.push(i),
                None => groups.push((s, vec![i])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }

    async fn op(&self, keys: &[&str], args: &[String]) -> Result<redis::Value, StoreError> {
        let build = |eval: bool| {
            let mut cmd = redis::cmd(if eval { "EVAL" } else { "EVALSHA" });
            cmd.arg(if eval { SOURCE.as_str() } else { SHA.as_str() }).arg(keys.len());
            for k in keys {
                cmd.arg(*k);
            }
            for a in args {
                cmd.arg(a.as_str());
            }
            cmd
        };
        let eval = || build(true);
        self.script_call(&build(false), &eval).await
    }

    /// One script call per `(keys, args)`, their replies in the same order.
    /// On a cluster (a call per hash slot) they go at once, pipelined on
    /// the cluster's connections; any failure fails them all (each call is
    /// idempotent: a merge by maximum, a read, an acknowledgement).
    async fn ops(&self, calls: &[(Vec<&str>, Vec<String>)]) -> Result<Vec<redis::Value>, StoreError> {
        crate::join_all(calls.iter().map(|(keys, args)| self.op(keys, args)).collect()).await.into_iter().collect()
    }

    /// Store a peer's batch: each component merged by maximum (GCRA
    /// debt poured into the bucket), this region's own current component
    /// skipped. `rules`: this region's global rules by their fingerprint
    /// (`fingerprint(limit, mode)`, as items carry it), so the merge names
    /// the state keys of its window rules: a decision on a state marked as
    /// having no peers' counts does not read them (`scripts/lib.lua`,
    /// `marked`), and the merge that brings some removes the mark. `now`:
    /// `None` for Redis `TIME`.
    pub async fn merge(
        &self,
        batch: &Batch,
        rules: &HashMap<u64, Limit>,
        me: &str,
        incarnation: u64,
        now: Option<u64>,
    ) -> Result<MergeStats, StoreError> {
        let bases: Vec<String> = batch.items.iter().map(|i| self.base(&i.key)).collect();
        let mut calls = Vec::new();
        for group in self.by_slot(&bases) {
            let keys: Vec<&str> = group.iter().map(|&i| bases[i].as_str()).collect();
            let mut args = vec![
                "merge".to_owned(),
                now.map_or_else(String::new, |n| n.to_string()),
                me.to_owned(),
                incarnation.to_string(),
                batch.from.clone(),
                batch.from_incarnation.to_string(),
            ];
            for &i in &group {
                let item = &batch.items[i];
                let (kind, u, h) = match item.shape {
                    Shape::Windowed { slot_us, horizon } => (1, slot_us, u64::from(horizon)),
                    Shape::Gcra { slot_us } => (2, slot_us, item.shape.horizon()),
                };
                args.extend([kind.to_string(), u.to_string(), h.to_string(), item.fingerprint.to_string()]);
                args.push(match rules.get(&item.fingerprint) {
                    Some(l) if window_string_state(l) => redis_key(&self.config().key_prefix, &item.key, l),
                    _ => String::new(),
                });
                args.push(item.components.len().to_string());
                for c in &item.components {
                    let region = batch.regions.get(c.region as usize).cloned().unwrap_or_default();
                    args.extend([
                        region,
                        c.incarnation.to_string(),
                        c.slot.to_string(),
                        c.count.to_string(),
                        c.back.to_string(),
                    ]);
                }
            }
            calls.push((keys, args, group));
        }
        let mut stats = MergeStats::default();
        let groups: Vec<Vec<usize>> = calls.iter().map(|c| c.2.clone()).collect();
        let calls: Vec<(Vec<&str>, Vec<String>)> = calls.into_iter().map(|(k, a, _)| (k, a)).collect();
        for (reply, group) in self.ops(&calls).await?.into_iter().zip(groups) {
            let v: Vec<u64> = redis::FromRedisValue::from_redis_value(reply)
                .map_err(|e| StoreError::Unavailable(format!("Redis: {e}")))?;
            if let [m, u, s, x, ref relay @ ..] = v[..] {
                stats.merged += m;
                stats.unchanged += u;
                stats.stale += s;
                stats.mismatched += x;
                // 1-based positions in this call's keys.
                stats.relay.extend(relay.iter().filter_map(|&r| group.get((r as usize).checked_sub(1)?).copied()));
            }
        }
        Ok(stats)
    }

    /// What this region holds of `keys` (counter keys) to send a peer: its
    /// own counts (component region 0, incarnation `incarnation`), and for
    /// the keys whose `every` is set (as many as `keys`, or fewer: the rest
    /// unset) every other component too (a full state transfer, or what this
    /// region relays), their regions numbered in `regions` (extended as
    /// needed; index 0 is this region). `None` for a key nothing is known
    /// of.
    ///
    /// `rules` (as many as `keys`, or empty) are the keys' rules where the
    /// caller knows them: the read records each on the key's global state,
    /// which is where a window algorithm's rule is recorded (its decisions
    /// leave that to this read; see `scripts/global.lua`). A key read
    /// without its rule is read by the rule recorded there, if any.
    ///
    /// A window key (fixed or sliding window) read for its own counts with
    /// its rule, the common case of every batch, is read with a plain
    /// `MGET` of its state and its record `G:r`, no script; those whose
    /// record is missing, of another rule or due go through the script,
    /// which records it, and so do those that gave hits back (their record
    /// is marked `b`: the script sends them beside the hits taken).
    pub async fn read_global<K: AsRef<str> + Sync>(
        &self,
        keys: &[K],
        rules: &[Option<(&Limit, SyncMode)>],
        every: &[bool],
        incarnation: u64,
        regions: &mut Vec<String>,
        now: Option<u64>,
    ) -> Result<Vec<Option<Item>>, StoreError> {
        let mut out: Vec<Option<Item>> = vec![None; keys.len()];
        let plain = |i: usize| -> Option<(&Limit, SyncMode)> {
            let (limit, mode) = rules.get(i).copied().flatten()?;
            (window_string_state(limit) && !every.get(i).copied().unwrap_or(false) && shape_of(limit).is_some())
                .then_some((limit, mode))
        };
        let (fast, mut rest): (Vec<usize>, Vec<usize>) = (0..keys.len()).partition(|&i| plain(i).is_some());
        if !fast.is_empty() {
            let prefix = &self.config().key_prefix;
            let now_us = now.unwrap_or_else(|| self.local_now_us());
            let groups = self.by_slot_of(keys, &fast);
            let calls: Vec<_> = groups
                .iter()
                .map(|g| {
                    let mut cmd = redis::cmd("MGET");
                    for &i in g {
                        let (limit, _) = plain(i).unwrap_or_else(|| unreachable!("fast keys are plain"));
                        let key = keys[i].as_ref();
                        cmd.arg(redis_key(prefix, key, limit)).arg(global_key(prefix, key, ":r"));
                    }
                    cmd
                })
                .collect();
            let replies = crate::join_all(calls.iter().map(|c| self.raw(c)).collect()).await;
            for (group, reply) in groups.iter().zip(replies) {
                let redis::Value::Array(v) = reply? else {
                    return Err(StoreError::Unavailable("Redis: MGET answered no array".into()));
                };
                let text = |n: usize| match v.get(n) {
                    Some(redis::Value::BulkString(b)) => std::str::from_utf8(b).unwrap_or(""),
                    _ => "",
                };
                for (n, &i) in group.iter().enumerate() {
                    let (limit, mode) = plain(i).unwrap_or_else(|| unreachable!("fast keys are plain"));
                    let fp = fingerprint(limit, mode);
                    // (A key that gave hits back has a record marked so,
                    // which is not `recorded`: the script sends them.)
                    if recorded(text(2 * n + 1), fp, now_us)
                        && let Some(shape) = shape_of(limit)
                    {
                        let components = own_counts(text(2 * n), limit, incarnation);
                        out[i] = Some(Item { key: keys[i].as_ref().to_owned(), fingerprint: fp, shape, components });
                    } else {
                        rest.push(i);
                    }
                }
            }
        }
        if rest.is_empty() {
            return Ok(out);
        }
        let bases: Vec<String> = keys.iter().map(|k| self.base(k.as_ref())).collect();
        let groups = self.by_slot_of(keys, &rest);
        let prefix = &self.config().key_prefix;
        let calls: Vec<(Vec<&str>, Vec<String>)> = groups
            .iter()
            .map(|g| {
                let mut args = Vec::with_capacity(3 + 3 * g.len());
                args.extend(["read".to_owned(), now.map_or_else(String::new, |n| n.to_string()), "0".to_owned()]);
                // A batch's keys mostly share a rule: its text is made once.
                let mut last: Option<(u64, String)> = None;
                for &i in g {
                    match rules.get(i).copied().flatten().and_then(|(l, m)| shape_of(l).map(|s| (l, m, s))) {
                        Some((limit, mode, shape)) => {
                            args.push(redis_key(prefix, keys[i].as_ref(), limit));
                            let fp = fingerprint(limit, mode);
                            match &last {
                                Some((f, text)) if *f == fp => args.push(text.clone()),
                                _ => {
                                    let (code, param) = algorithm(limit);
                                    let kind = if matches!(shape, Shape::Gcra { .. }) { 2 } else { 1 };
                                    let text = format!(
                                        "{code} {} {} {param} {fp} {kind} {} {}",
                                        limit.limit(),
                                        limit.window_us(),
                                        shape.slot_us(),
                                        shape.horizon()
                                    );
                                    args.push(text.clone());
                                    last = Some((fp, text));
                                }
                            }
                        }
                        None => args.extend([String::new(), String::new()]),
                    }
                    args.push(if every.get(i).copied().unwrap_or(false) { "1" } else { "0" }.to_owned());
                }
                (g.iter().map(|&i| bases[i].as_str()).collect(), args)
            })
            .collect();
        let replies = self.ops(&calls).await?;
        for (group, reply) in groups.iter().zip(replies) {
            let v: Vec<redis::Value> = redis::FromRedisValue::from_redis_value(reply)
                .map_err(|e| StoreError::Unavailable(format!("Redis: {e}")))?;
            let text =
                |x: &redis::Value| -> String { redis::FromRedisValue::from_redis_value(x.clone()).unwrap_or_default() };
            let num = |x: &redis::Value| -> u64 { text(x).parse().unwrap_or(0) };
            let mut at = 0;
            for &i in group {
                if v.get(at).is_some_and(|x| text(x) == "=") {
                    // A window key read with its rule: its state string.
                    let state = v.get(at + 1).map(text).unwrap_or_default();
                    at += 2;
                    if let Some((limit, mode)) = rules.get(i).copied().flatten()
                        && let Some(shape) = shape_of(limit)
                    {
                        let components = own_counts(&state, limit, incarnation);
                        out[i] = Some(Item {
                            key: keys[i].as_ref().to_owned(),
                            fingerprint: fingerprint(limit, mode),
                            shape,
                            components,
                        });
                    }
                    continue;
                }
                let head =
                    v.get(at..at + 5).ok_or_else(|| StoreError::Unavailable("Redis: a short read reply".into()))?;
                let (fp, kind, u, h, n) = (num(&head[0]), num(&head[1]), num(&head[2]), num(&head[3]), num(&head[4]));
                at += 5;
                let mut components = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    let c =
                        v.get(at..at + 5).ok_or_else(|| StoreError::Unavailable("Redis: a short read reply".into()))?;
                    at += 5;
                    let region = text(&c[0]);
                    let (region, inc) = if region.is_empty() {
                        (0, incarnation)
                    } else {
                        let idx = regions.iter().position(|r| *r == region).unwrap_or_else(|| {
                            regions.push(region.clone());
                            regions.len() - 1
                        });
                        (u32::try_from(idx).unwrap_or(u32::MAX), num(&c[1]))
                    };
                    components.push(Component {
                        region,
                        incarnation: inc,
                        slot: num(&c[2]),
                        count: num(&c[3]),
                        back: num(&c[4]),
                    });
                }
                let shape = match kind {
                    1 => Shape::Windowed { slot_us: u, horizon: u32::try_from(h).unwrap_or(1) },
                    2 => Shape::Gcra { slot_us: u },
                    _ => continue,
                };
                out[i] = Some(Item { key: keys[i].as_ref().to_owned(), fingerprint: fp, shape, components });
            }
        }
        Ok(out)
    }

    /// Peer `peer` acknowledged own counts: `(counter key, [(slot, count)])`.
    pub async fn ack_global(
        &self,
        peer: usize,
        acked: &[(String, Vec<(u64, u64)>)],
        now: Option<u64>,
    ) -> Result<(), StoreError> {
        let bases: Vec<String> = acked.iter().map(|(k, _)| self.base(k)).collect();
        let mut calls = Vec::new();
        for group in self.by_slot(&bases) {
            let keys: Vec<&str> = group.iter().map(|&i| bases[i].as_str()).collect();
            let mut args = vec!["ack".to_owned(), now.map_or_else(String::new, |n| n.to_string()), peer.to_string()];
            for &i in &group {
                let slots = &acked[i].1;
                args.push(slots.len().to_string());
                for (s, c) in slots {
                    args.extend([s.to_string(), c.to_string()]);
                }
            }
            calls.push((keys, args));
        }
        self.ops(&calls).await?;
        Ok(())
    }
}

/// This region's own counts in a fixed_window or sliding_window state
/// string, as `own_slots` in `scripts/global.lua` reads them: fixed_window
/// `"<window id> <count>"`, sliding_window `"<window id> <previous count>
/// <current count>"`; nothing for another algorithm or a malformed state.
/// Whether `record` (a key's `G:r`, `"<fingerprint> <due>"`) holds rule
/// `fp` and is not due at `now` (this instance's clock): then the key's
/// rule is on `G:m`, and reading its state is all a batch needs. (`G:m`
/// lives twice as long as its record is due, so a clock behind Redis's by
/// less than a minute only delays its refresh.)
fn recorded(record: &str, fp: u64, now: u64) -> bool {
    let Some((f, due)) = record.split_once(' ') else { return false };
    f.parse() == Ok(fp) && due.parse::<u64>().is_ok_and(|d| d > now)
}

fn own_counts(state: &str, limit: &Limit, incarnation: u64) -> Vec<Component> {
    let digits = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
    let nums: Option<Vec<u64>> = state.split(' ').map(|n| if digits(n) { n.parse().ok() } else { None }).collect();
    let own = |slot, count| Component { region: 0, incarnation, slot, count, back: 0 };
    let mut out = Vec::new();
    match (limit.algorithm(), nums.as_deref()) {
        (floodgate_core::Algorithm::FixedWindow, Some(&[id, count])) if count > 0 => out.push(own(id, count)),
        (floodgate_core::Algorithm::SlidingWindow, Some(&[id, prev, cur])) => {
            if prev > 0 {
                out.push(own(id.saturating_sub(1), prev));
            }
            if cur > 0 {
                out.push(own(id, cur));
            }
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use floodgate_core::{Algorithm, Limit};

    use super::{own_counts, recorded};

    #[test]
    fn own_counts_read_a_state_as_the_script_does() {
        let s = Duration::from_secs(1);
        let fw = Limit::new(Algorithm::FixedWindow, 10, s).unwrap();
        let sw = Limit::new(Algorithm::SlidingWindow, 10, s).unwrap();
        let counts = |state: &str, l: &Limit| -> Vec<(u64, u64)> {
            own_counts(state, l, 7).iter().map(|c| (c.slot, c.count)).collect()
        };
        assert_eq!(counts("12 3", &fw), [(12, 3)]);
        assert_eq!(counts("12 0", &fw), []);
        assert_eq!(counts("", &fw), []);
        assert_eq!(counts("12 3 4", &fw), [], "not a fixed window's state");
        assert_eq!(counts("12 3x", &fw), []);
        assert_eq!(counts("12 3 4", &sw), [(11, 3), (12, 4)]);
        assert_eq!(counts("12 0 4", &sw), [(12, 4)]);
        assert_eq!(counts("12 3", &sw), []);
        assert!(own_counts("12 3", &fw, 7).iter().all(|c| c.region == 0 && c.incarnation == 7));
    }

    #[test]
    fn a_record_lets_a_read_skip_the_script_only_for_its_rule_until_due() {
        assert!(recorded("123 5000", 123, 4_999));
        assert!(!recorded("123 5000 b", 123, 4_999), "gave hits back: read by the script");
        assert!(!recorded("123 5000", 123, 5_000), "due: the script records it again");
        assert!(!recorded("124 5000", 123, 0), "another rule");
        assert!(!recorded("", 123, 0), "none yet");
        assert!(!recorded("123", 123, 0));
        assert!(!recorded("123 x", 123, 0));
    }
}
