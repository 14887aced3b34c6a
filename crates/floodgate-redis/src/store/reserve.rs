//! Reservations on Redis and Redis Cluster (`floodgate_core::reservation`):
//! each part lives beside its counter (`<counter key>:r:<id>`, the same
//! hash slot), so a reserve keeps them and a settle adjusts and records
//! them in the script call that decides (`entry.lua`, "reserve" and
//! "settle"): atomic per hash slot, a settle applied once whatever
//! instance sends it.
//!
//! A settle needs the parts' keys and limits: the instance that reserved
//! remembers them until they are settled (a bounded map, so a settle there
//! is one call), and
//! every reserve leaves their description in Redis (`<prefix>r:<id>`,
//! kept as long as the parts), read first by a settle through another
//! instance. On one server the description is written by the reserve's own
//! call; on a cluster it lives in another slot, so it is a second command
//! after an allowed reserve.
//!
//! When Redis fails: a reserve follows the rules' failure policy (no
//! reservation is kept, so nothing is to settle); a settle fails with
//! [`ReservationError::Store`] and may be sent again (it is applied once).
//! A Redis that restarts empty loses its reservations: a settle is then
//! "unknown", and the estimates went with the counters.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use floodgate_core::region::{Scope, SyncMode};
use floodgate_core::reservation::{Held, ReservationError, ReservationId, Settled, SettledPart};
use floodgate_core::{Algorithm, AlgorithmKind, Charge, Check, Decision, LeakyMode, Limit, Op as CoreOp, StoreError};

use super::{Client, RedisStore};
use crate::script::{self, CheckArgs, Op};
use crate::store::commands::Via;

/// Parts remembered by the instance that reserved, at most.
const REMEMBERED: usize = 1 << 16;

/// The parts of the reservations this instance made, until they may no
/// longer be settled (bounded: past [`REMEMBERED`], a settle reads the
/// description from Redis).
#[derive(Debug, Default)]
pub(crate) struct Remembered(Mutex<Memos>);

#[derive(Debug, Default)]
struct Memos {
    map: HashMap<ReservationId, Memo>,
    /// When full: not swept again before this time (µs), so a full map
    /// costs one scan a second, not one per reserve.
    next_sweep_us: u64,
}

/// A reservation's parts, and until when (µs) they may be settled.
type Memo = (Arc<[Held]>, u64);

impl Remembered {
    fn put(&self, id: ReservationId, parts: Arc<[Held]>, until_us: u64, now_us: u64) {
        let mut m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if m.map.len() >= REMEMBERED && now_us >= m.next_sweep_us {
            m.map.retain(|_, (_, until)| *until > now_us);
            m.next_sweep_us = now_us + 1_000_000;
        }
        if m.map.len() < REMEMBERED {
            m.map.insert(id, (parts, until_us));
        }
    }

    /// Forget a settled reservation: a settle again reads its description.
    fn forget(&self, id: ReservationId) {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).map.remove(&id);
    }

    fn get(&self, id: ReservationId) -> Option<Arc<[Held]>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).map.get(&id).map(|(p, _)| p.clone())
    }
}

/// One part's description: `<limit>\t<scope>\t<counter key>`, the limit as
/// `<algorithm> <limit> <window us> <burst|-> <granularity|-> <mode|-> <charge>`
/// and the scope `region`, `eventual` or `bounded <overshoot ppm>`.
fn describe(h: &Held) -> String {
    let l = &h.limit;
    let (burst, granularity, mode) = match *l.algorithm() {
        Algorithm::SlidingBuckets { granularity } => (None, Some(granularity), None),
        Algorithm::TokenBucket { burst } | Algorithm::Gcra { burst } => (burst, None, None),
        Algorithm::LeakyBucket { burst, mode } => (burst, None, Some(mode)),
        _ => (None, None, None),
    };
    let opt = |v: Option<String>| v.unwrap_or_else(|| "-".to_owned());
    let scope = match h.scope {
        Scope::Region => "region".to_owned(),
        Scope::Global(SyncMode::Eventual) => "eventual".to_owned(),
        Scope::Global(SyncMode::Bounded { overshoot_ppm }) => format!("bounded {overshoot_ppm}"),
    };
    format!(
        "{} {} {} {} {} {} {}\t{scope}\t{}",
        l.algorithm().kind().as_str(),
        l.limit(),
        l.window_us(),
        opt(burst.map(|b| b.to_string())),
        opt(granularity.map(|g| g.to_string())),
        opt(mode.map(|m| m.as_str().to_owned())),
        l.charge().as_str(),
        h.key.replace('\\', "\\\\").replace('\n', "\\n")
    )
}

/// A key written by [`describe`], read back.
fn unescape(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    let mut chars = key.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        out.push(match chars.next() {
            Some('n') => '\n',
            Some(other) => other,
            None => '\\',
        });
    }
    out
}

/// A part read back from [`describe`]'s line.
fn read_part(line: &str) -> Option<Held> {
    let mut cols = line.splitn(3, '\t');
    let (spec, scope, key) = (cols.next()?, cols.next()?, cols.next()?);
    let w: Vec<&str> = spec.split(' ').collect();
    let [kind, limit, window, burst, granularity, mode, charge] = w[..] else { return None };
    fn opt(s: &str) -> Option<&str> {
        (s != "-").then_some(s)
    }
    let kind: AlgorithmKind = kind.parse().ok()?;
    let burst = opt(burst).map(str::parse::<u64>).transpose().ok()?;
    let granularity = opt(granularity).map(str::parse::<u32>).transpose().ok()?;
    let mode = opt(mode).map(str::parse::<LeakyMode>).transpose().ok()?;
    let algorithm = Algorithm::from_parts(kind, burst, granularity, mode).ok()?;
    let limit = Limit::new(algorithm, limit.parse().ok()?, Duration::from_micros(window.parse().ok()?))
        .ok()?
        .with_charge(charge.parse::<Charge>().ok()?)
        .ok()?;
    let scope = match scope.split_once(' ') {
        None if scope == "region" => Scope::Region,
        None if scope == "eventual" => Scope::Global(SyncMode::Eventual),
        Some(("bounded", ppm)) => Scope::Global(SyncMode::Bounded { overshoot_ppm: ppm.parse().ok()? }),
        _ => return None,
    };
    Some(Held { key: unescape(key).into(), limit, scope })
}

/// The parts a description's text keeps: `<mask>\n` then a line per check
/// of the reserve, the mask's `1`s marking the kept ones.
fn read_description(text: &str) -> Option<Vec<Held>> {
    let (mask, rest) = text.split_once('\n')?;
    let lines: Vec<&str> = rest.split('\n').collect();
    if mask.len() != lines.len() {
        return None;
    }
    mask.bytes().zip(lines).filter(|(m, _)| *m == b'1').map(|(_, l)| read_part(l)).collect()
}

/// The key of a reservation's description.
fn description_key(prefix: &str, id: ReservationId) -> String {
    format!("{prefix}r:{id}")
}

/// Values per part in a settle's reply: flags (1 again, 2 expired), late,
/// returned, remaining, reset (`entry.lua`); a conflict's: the amount
/// settled, then zeros.
const SETTLE_STRIDE: usize = 5;

impl RedisStore {
    /// [`floodgate_core::Store::reserve`] at `now` (µs; `None`: Redis's
    /// clock, as every decision of the service): for replays and tests.
    pub async fn reserve_at(
        &self,
        checks: &[Check<'_>],
        ttls_us: &[u64],
        now: Option<u64>,
        out: &mut Vec<Result<Decision, StoreError>>,
    ) -> Result<Option<ReservationId>, ReservationError> {
        out.clear();
        if checks.is_empty() {
            return Ok(None);
        }
        let i = &self.inner;
        let id = ReservationId::new();
        let rid = id.to_string();
        let keys: Vec<String> =
            checks.iter().map(|c| script::redis_key(&i.config.key_prefix, c.key, c.limit)).collect();
        let lines: Vec<String> = checks
            .iter()
            .map(|c| describe(&Held { key: c.key.into(), limit: c.limit.clone(), scope: c.scope }))
            .collect();
        let groups = self.groups(&keys);
        let single = matches!(i.client, Client::Single(_));
        let longest = ttls_us.iter().copied().max().unwrap_or(0);
        let dkey = description_key(&i.config.key_prefix, id);
        let replies = {
            let calls = groups.iter().map(|g| {
                let (ks, args) = self.group_args(g, &keys, checks, now);
                // First how long the reservation is kept: twice its
                // longest ttl (as the memory store's), then each check's.
                let ttls: Vec<String> = std::iter::once(2 * longest)
                    .chain(g.iter().map(|&j| ttls_us.get(j).copied().unwrap_or(0)))
                    .map(|t| t.to_string())
                    .collect();
                let desc = if single { lines.join("\n") } else { String::new() };
                let refs: Vec<&Check<'_>> = g.iter().map(|&j| &checks[j]).collect();
                let (rid, dkey) = (&rid, &dkey);
                async move {
                    let mut ks = ks;
                    if !desc.is_empty() {
                        ks.push(dkey.clone());
                    }
                    let at = now.map(|n| n.to_string()).unwrap_or_default();
                    let head = format!("r{at}|{rid}|{}|{desc}", ttls.join(" "));
                    let values = self.run_reservation(ks, args, head).await?;
                    script::reply(&values, &refs, &self.inner.leases).map_err(|e| StoreError::Unavailable(e.0))
                }
            });
            super::join_all(calls.collect()).await
        };
        out.resize_with(checks.len(), || Ok(Decision::default()));
        let mut denied = false;
        for (g, r) in groups.iter().zip(&replies) {
            match r {
                Ok(r) => {
                    denied |= r.denied;
                    for (&j, d) in g.iter().zip(&r.decisions) {
                        out[j] = Ok(*d);
                    }
                }
                Err(e) => {
                    for &j in g {
                        out[j] = Err(e.clone());
                    }
                }
            }
        }
        if groups.len() > 1 && denied {
            // All or nothing across slots: the slots that allowed give
            // their hits back; their parts are never named (the id is not
            // answered) and expire.
            let answered: Vec<Option<&script::Reply>> = replies.iter().map(|r| r.as_ref().ok()).collect();
            self.refund_allowed(&keys, checks, &groups, &answered, now).await;
            return Ok(None);
        }
        let failed = replies.iter().any(Result::is_err);
        let kept: Vec<usize> =
            (0..checks.len()).filter(|&j| checks[j].reserves() && out[j].as_ref().is_ok_and(|d| d.allowed)).collect();
        if denied || failed || kept.is_empty() {
            // A slot that failed follows its rules' failure policy; its
            // parts were not kept, so no reservation is answered.
            return Ok(None);
        }
        let now = replies.iter().find_map(|r| r.as_ref().ok().map(|r| r.now_us)).unwrap_or(0);
        if !single {
            let mask: String = (0..checks.len()).map(|j| if kept.contains(&j) { '1' } else { '0' }).collect();
            let mut cmd = redis::cmd("SET");
            cmd.arg(&dkey).arg(format!("{mask}\n{}", lines.join("\n"))).arg("PX").arg((2 * longest / 1000).max(1));
            if let Err(e) = self.one_via(&cmd, None, Via::Decisions).await {
                // The parts are kept: this instance can settle them; another
                // cannot find them.
                tracing::warn!(error = %e, "reservation {id}: its description was not written; settle it through this instance");
            }
        }
        let parts: Arc<[Held]> = kept
            .iter()
            .map(|&j| Held { key: checks[j].key.into(), limit: checks[j].limit.clone(), scope: checks[j].scope })
            .collect();
        self.inner.reservations.put(id, parts, now.saturating_add(2 * longest), now);
        Ok(Some(id))
    }

    /// [`floodgate_core::Store::settle`] at `now` (see
    /// [`RedisStore::reserve_at`]).
    pub async fn settle_at(
        &self,
        id: ReservationId,
        actual: &[u64],
        now: Option<u64>,
    ) -> Result<Settled, ReservationError> {
        let i = &self.inner;
        let parts = match i.reservations.get(id) {
            Some(p) => p,
            None => {
                let mut cmd = redis::cmd("GET");
                cmd.arg(description_key(&i.config.key_prefix, id));
                let v = self.one_via(&cmd, None, Via::Decisions).await?;
                let text: Option<String> = redis::FromRedisValue::from_redis_value(v).map_err(|e| {
                    StoreError::Unavailable(format!("Redis answered GET with an unexpected reply: {e}"))
                })?;
                let text = text.ok_or(ReservationError::Unknown)?;
                read_description(&text)
                    .ok_or_else(|| StoreError::Unavailable(format!("a malformed reservation description for {id}")))?
                    .into()
            }
        };
        let amounts = floodgate_core::reservation::amounts(parts.len(), actual)?;
        let rid = id.to_string();
        let keys: Vec<String> =
            parts.iter().map(|p| script::redis_key(&i.config.key_prefix, &p.key, &p.limit)).collect();
        let checks: Vec<Check<'_>> = parts
            .iter()
            .zip(&amounts)
            .map(|(p, &a)| Check {
                key: &p.key,
                limit: &p.limit,
                hits: a,
                op: CoreOp::Late,
                enforce: false,
                scope: p.scope,
            })
            .collect();
        let groups = self.groups(&keys);
        let calls = groups.iter().map(|g| {
            let (ks, args) = self.group_args(g, &keys, &checks, now);
            let at = now.map(|n| n.to_string()).unwrap_or_default();
            let head = format!("s{at}|{rid}");
            async move { self.run_reservation(ks, args, head).await }
        });
        let replies = super::join_all(calls.collect()).await;
        let mut settled: Vec<Option<SettledPart>> = vec![None; parts.len()];
        let mut again = true;
        let mut conflict: Option<Vec<u64>> = None;
        for (g, r) in groups.iter().zip(replies) {
            let values = r?;
            let bad = || StoreError::Unavailable(format!("the settle script answered {values:?}"));
            if values.len() != 2 + SETTLE_STRIDE * g.len() {
                return Err(bad().into());
            }
            match values[1] {
                0 => {
                    for (&j, v) in g.iter().zip(values[2..].chunks_exact(SETTLE_STRIDE)) {
                        let n = |x: i64| u64::try_from(x).unwrap_or(0);
                        let (late, returned) = (n(v[1]), n(v[2]));
                        again &= v[0] & 1 == 1;
                        settled[j] = Some(SettledPart {
                            key: parts[j].key.clone(),
                            limit: parts[j].limit.clone(),
                            scope: parts[j].scope,
                            estimate: (amounts[j] + returned).saturating_sub(late),
                            actual: amounts[j],
                            charged_late: late,
                            returned,
                            expired: v[0] & 2 == 2,
                            decision: Ok(Decision {
                                allowed: true,
                                limit: parts[j].limit.limit(),
                                remaining: n(v[3]),
                                reset_after: Duration::from_micros(n(v[4])),
                                ..Decision::default()
                            }),
                        });
                    }
                }
                2 => return Err(ReservationError::Unknown),
                3 => {
                    let c = conflict.get_or_insert_with(|| amounts.to_vec());
                    for (&j, v) in g.iter().zip(values[2..].chunks_exact(SETTLE_STRIDE)) {
                        c[j] = u64::try_from(v[0]).unwrap_or(0);
                    }
                }
                _ => return Err(bad().into()),
            }
        }
        if let Some(settled) = conflict {
            return Err(ReservationError::Conflict { settled });
        }
        let parts = settled.into_iter().map(|p| p.expect("every group answered its parts")).collect();
        i.reservations.forget(id);
        Ok(Settled { parts, again })
    }

    /// The keys and script arguments of one slot's checks (`g`: their
    /// positions).
    fn group_args(
        &self,
        g: &[usize],
        keys: &[String],
        checks: &[Check<'_>],
        now: Option<u64>,
    ) -> (Vec<String>, Vec<CheckArgs>) {
        g.iter()
            .map(|&j| {
                let args = CheckArgs::of(&checks[j], Op::Apply).with_global(self.global_args(&checks[j], now));
                (keys[j].clone(), args)
            })
            .unzip()
    }

    /// One reserve or settle request of one slot's checks, with its
    /// header (`head`: "r|…" or "s|…", the time Redis's): on one server
    /// through the batch queue, with the decisions of the moment; on a
    /// cluster, a call of its own.
    async fn run_reservation(
        &self,
        keys: Vec<String>,
        args: Vec<CheckArgs>,
        head: String,
    ) -> Result<Vec<i64>, StoreError> {
        let t = self.inner.config.timeout;
        if matches!(self.inner.client, Client::Single(_)) {
            return self.queued_raw(keys, args, None, Some(head)).await.1.map_err(|e| e.store_error(t));
        }
        let requests = [(None, &keys[..], &args[..], Some(head.as_str()))];
        self.run(&requests, Op::Apply, true, None, &self.inner.conn).await.map_err(|e| e.store_error(t))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_description_reads_back_every_algorithm_and_scope() {
        let s = Duration::from_secs(60);
        let limits = [
            Limit::new(Algorithm::FixedWindow, 10, s).unwrap(),
            Limit::new(Algorithm::SlidingLog, 10, s).unwrap(),
            Limit::new(Algorithm::SlidingWindow, 10, s).unwrap().with_charge(Charge::After).unwrap(),
            Limit::new(Algorithm::SlidingBuckets { granularity: 6 }, 10, s).unwrap(),
            Limit::new(Algorithm::TokenBucket { burst: Some(3) }, 10, s).unwrap(),
            Limit::new(Algorithm::Gcra { burst: None }, 10, s).unwrap(),
            Limit::new(Algorithm::LeakyBucket { burst: Some(4), mode: LeakyMode::Shape }, 10, s).unwrap(),
        ];
        let scopes = [
            Scope::Region,
            Scope::Global(SyncMode::Eventual),
            Scope::Global(SyncMode::Bounded { overshoot_ppm: 50_000 }),
        ];
        let parts: Vec<Held> = limits
            .iter()
            .enumerate()
            .map(|(i, l)| Held {
                key: format!("3:llm|6:tenant{i}:a\tb\n\\n").into(),
                limit: l.clone(),
                scope: scopes[i % 3],
            })
            .collect();
        let mask: String = (0..parts.len()).map(|i| if i == 1 { '0' } else { '1' }).collect();
        let lines: Vec<String> = parts.iter().map(describe).collect();
        let back = read_description(&format!("{mask}\n{}", lines.join("\n"))).unwrap();
        let want: Vec<Held> = parts.iter().enumerate().filter(|(i, _)| *i != 1).map(|(_, p)| p.clone()).collect();
        assert_eq!(back, want);
        for p in &back {
            let orig = parts.iter().find(|q| q.key == p.key).unwrap();
            assert_eq!(p.limit.fingerprint(), orig.limit.fingerprint(), "the same counter");
        }
        assert!(read_description("1\nnonsense").is_none());
        assert!(read_description("11\nfixed_window 1 1000000 - - - before\tregion\tk").is_none());
    }
}
