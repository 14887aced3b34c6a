//! Deciding: a request's checks grouped by hash slot, and on a single
//! server the per-thread batch queues whose requests go to Redis together
//! in one script call.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::Instant;

use floodgate_core::{Check, Decision, Op as CoreOp, StoreError};
use redis::cluster_routing::Slot;
use tokio::sync::{mpsc, oneshot};

use super::{BATCH_CHECKS, BATCHES_IN_FLIGHT, CallError, Client, ClockSource, ConnSlot, Inner, RedisStore, join_all};
use crate::conn::Packed;
use crate::script::{self, CheckArgs, Op, Reply};

impl RedisStore {
    /// One script call for `requests`: the reply's values.
    pub(super) async fn run(
        &self,
        requests: &[script::Request<'_>],
        op: Op,
        gated: bool,
        deadline: Option<tokio::time::Instant>,
        slot: &ConnSlot,
    ) -> Result<Vec<i64>, CallError> {
        let cmd = script::command(false, requests, op);
        let eval = || script::command(true, requests, op);
        let value = self.call(Packed::One(&cmd), Some(&eval), gated, deadline, slot, None).await?;
        redis::FromRedisValue::from_redis_value(value).map_err(|e| CallError::Reply(e.to_string()))
    }

    /// One script call for one request's checks in one slot.
    pub(super) async fn run_one(
        &self,
        keys: &[String],
        checks: &[&Check<'_>],
        now: Option<u64>,
        op: Op,
    ) -> Result<Reply, CallError> {
        let args: Vec<CheckArgs> =
            checks.iter().map(|c| CheckArgs::of(c, op).with_global(self.global_args(c, now))).collect();
        let values = self.run(&[(now, keys, &args, None)], op, true, None, &self.inner.conn).await?;
        if let Op::Refund(_) = op {
            // A slot taken by another call, given back by this one.
            for c in checks.iter().filter(|c| c.takes_back_on_denial() && c.limit.is_concurrency()) {
                self.inner.leases.record(c.limit.fingerprint(), 0, c.hits, 0);
            }
            return Ok(Reply {
                now_us: values.first().copied().unwrap_or(0).max(0) as u64,
                denied: false,
                decisions: vec![],
            });
        }
        script::reply(&values, checks, &self.inner.leases).map_err(|e| CallError::Reply(e.0))
    }

    /// One request's checks through the batch queue (one server). Gives the
    /// keys back with the reply. No timer of its own: the batch answers
    /// by the request's deadline (its call is bounded by its requests'
    /// earliest one), and a request still queued at its deadline is not
    /// sent.
    pub(super) async fn queued(
        &self,
        keys: Vec<String>,
        checks: &[&Check<'_>],
        now: Option<u64>,
    ) -> (Vec<String>, Result<Reply, CallError>) {
        let args = checks.iter().map(|c| CheckArgs::of(c, Op::Apply).with_global(self.global_args(c, now))).collect();
        match self.queued_raw(keys, args, now, None).await {
            (keys, Ok(values)) => {
                let reply = script::reply(&values, checks, &self.inner.leases).map_err(|e| CallError::Reply(e.0));
                (keys, reply)
            }
            (keys, Err(e)) => (keys, Err(e)),
        }
    }

    /// One request through the batch queue (one server): its reply's
    /// values, with its keys given back. `head`: a reserve's or a settle's
    /// header (`script::Request`).
    pub(super) async fn queued_raw(
        &self,
        keys: Vec<String>,
        args: Vec<CheckArgs>,
        now: Option<u64>,
        head: Option<String>,
    ) -> (Vec<String>, Result<Vec<i64>, CallError>) {
        if !self.permit() {
            return (keys, Err(CallError::Open));
        }
        let (tx, rx) = oneshot::channel();
        let deadline = tokio::time::Instant::now() + self.inner.config.timeout;
        self.enqueue(Queued { now, keys, args, head, deadline, reply: tx });
        match rx.await {
            Ok(reply) => reply,
            // The batching task's runtime shut down.
            Err(_) => (Vec::new(), Err(CallError::Reply("the request was dropped unsent".to_owned()))),
        }
    }

    /// Put a request on this thread's batch queue, starting its batching
    /// task (on the current runtime) when there is none or its runtime is
    /// gone. Per thread: on per-core runtimes, a request, its batch and the
    /// connection stay on one thread (no cross-thread wake-ups).
    pub(super) fn enqueue(&self, q: Queued) {
        let thread = std::thread::current().id();
        let mut lanes = self.inner.lanes.lock().unwrap_or_else(PoisonError::into_inner);
        let mut q = match lanes.iter().position(|l| l.thread == thread) {
            Some(i) => match lanes[i].tx.send(q) {
                Ok(()) => return,
                Err(mpsc::error::SendError(q)) => q,
            },
            None => q,
        };
        lanes.retain(|l| !l.tx.is_closed());
        if lanes.len() >= MAX_LANES {
            // More deciding threads than that: this one uses a random lane.
            let hash = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), thread);
            let i = (hash % lanes.len() as u64) as usize;
            match lanes[i].tx.send(q) {
                Ok(()) => return,
                Err(mpsc::error::SendError(back)) => q = back,
            }
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let conn = Arc::new(Mutex::new(None));
        tokio::spawn(batcher(Arc::downgrade(&self.inner), rx, Arc::clone(&conn)));
        // A fresh channel's receiver is alive: the send succeeds.
        let _ = tx.send(q);
        lanes.push(Lane { thread, tx });
    }

    /// Send one batch and hand each request its part of the reply.
    pub(super) async fn send_batch(&self, batch: Vec<Queued>, slot: &ConnSlot) {
        let requests: Vec<script::Request<'_>> =
            batch.iter().map(|q| (q.now, &q.keys[..], &q.args[..], q.head.as_deref())).collect();
        let deadline = batch.iter().map(|q| q.deadline).min();
        let result = self.run(&requests, Op::Apply, false, deadline, slot).await;
        drop(requests);
        let parts = result.and_then(|values| {
            let parts = script::split(&values, batch.iter().map(|q| q.args.len()), Op::Apply)
                .map_err(|e| CallError::Reply(e.0))?;
            Ok(parts.into_iter().map(<[i64]>::to_vec).collect::<Vec<_>>())
        });
        match parts {
            Ok(parts) => {
                for (q, part) in batch.into_iter().zip(parts) {
                    let _ = q.reply.send((q.keys, Ok(part)));
                }
            }
            Err(e) => {
                for q in batch {
                    let _ = q.reply.send((q.keys, Err(e.clone())));
                }
            }
        }
    }

    pub(super) fn now(&self, now: Option<u64>) -> Option<u64> {
        use floodgate_core::Clock;
        match (now, self.inner.config.clock) {
            (Some(t), _) => Some(t),
            (None, ClockSource::Local) => Some(self.inner.clock.now_us()),
            (None, ClockSource::Redis) => None,
        }
    }

    pub(super) async fn decide(
        &self,
        checks: &[Check<'_>],
        now: Option<u64>,
        out: &mut Vec<Result<Decision, StoreError>>,
    ) {
        out.clear();
        if checks.is_empty() {
            return;
        }
        let i = &self.inner;
        // The local over-limit cache works in real time: not for replays.
        let cache = i.config.cache_denials && now.is_none();
        let now = self.now(now);
        let sent = Instant::now();
        let mut keys: Vec<String> =
            checks.iter().map(|c| script::redis_key(&i.config.key_prefix, c.key, c.limit)).collect();

        // Every check a one-hit request on a key known to be over its limit:
        // answer here.
        if cache {
            let cached: Option<Vec<Decision>> =
                keys.iter().zip(checks).map(|(k, c)| if cacheable(c) { i.denied.get(k, sent) } else { None }).collect();
            if let Some(cached) = cached {
                i.cached_denials.fetch_add(1, Ordering::Relaxed);
                out.extend(cached.into_iter().map(Ok));
                return;
            }
        }

        if cache {
            for (k, c) in keys.iter().zip(checks) {
                if matches!(c.op, CoreOp::Refund | CoreOp::Return { .. }) {
                    i.denied.forget(k);
                }
            }
        }
        let groups = self.groups(&keys);
        let replies = if matches!(i.client, Client::Single(_)) {
            let refs: Vec<&Check<'_>> = checks.iter().collect();
            let (back, reply) = self.queued(std::mem::take(&mut keys), &refs, now).await;
            keys = back;
            vec![reply]
        } else {
            // Boxed: the cluster's calls and refunds would otherwise make
            // every decision's future (moved at each await level) larger.
            Box::pin(self.across_slots(&keys, checks, now, &groups)).await
        };

        out.resize_with(checks.len(), || Ok(Decision::default()));
        for (g, r) in groups.iter().zip(replies) {
            match r {
                Ok(r) => {
                    for (&j, d) in g.iter().zip(r.decisions) {
                        if cache
                            && !d.allowed
                            && cacheable(&checks[j])
                            && checks[j].enforce
                            && let Some(key) = keys.get(j)
                        {
                            i.denied.put(key, sent, &d);
                        }
                        out[j] = Ok(d);
                    }
                }
                Err(e) => {
                    let e = e.store_error(i.config.timeout);
                    for &j in g {
                        out[j] = Err(e.clone());
                    }
                }
            }
        }
    }

    /// A Redis Cluster's calls for one request: one per hash slot,
    /// concurrently; when a slot denied, the slots that allowed are refunded.
    pub(super) async fn across_slots(
        &self,
        keys: &[String],
        checks: &[Check<'_>],
        now: Option<u64>,
        groups: &[Vec<usize>],
    ) -> Vec<Result<Reply, CallError>> {
        let replies = if groups.len() == 1 {
            let refs: Vec<&Check<'_>> = checks.iter().collect();
            vec![self.run_one(keys, &refs, now, Op::Apply).await]
        } else {
            let calls = groups.iter().map(|g| {
                let ks: Vec<String> = g.iter().map(|&j| keys[j].clone()).collect();
                let cs: Vec<&Check<'_>> = g.iter().map(|&j| &checks[j]).collect();
                async move { self.run_one(&ks, &cs, now, Op::Apply).await }
            });
            join_all(calls.collect()).await
        };

        // All or nothing across slots: a slot that allowed gives its hits
        // back when another denied (each slot already did so within itself).
        let denied_somewhere = replies.iter().any(|r| matches!(r, Ok(r) if r.denied));
        if denied_somewhere && groups.len() > 1 {
            let answered: Vec<Option<&Reply>> = replies.iter().map(|r| r.as_ref().ok()).collect();
            self.refund_allowed(keys, checks, groups, &answered, now).await;
        }
        replies
    }

    /// A request denied in one slot: every other slot's checks that allowed
    /// give their hits back (`replies`: each slot's answer, if any).
    pub(super) async fn refund_allowed(
        &self,
        keys: &[String],
        checks: &[Check<'_>],
        groups: &[Vec<usize>],
        replies: &[Option<&Reply>],
        now: Option<u64>,
    ) {
        let i = &self.inner;
        let refunds = groups.iter().zip(replies).filter_map(|(g, r)| {
            let r = r.filter(|r| !r.denied)?;
            let (ks, cs): (Vec<String>, Vec<&Check<'_>>) = g
                .iter()
                .zip(&r.decisions)
                .filter(|&(&j, d)| d.allowed && checks[j].takes_back_on_denial())
                .map(|(&j, _)| (keys[j].clone(), &checks[j]))
                .unzip();
            (!cs.is_empty()).then_some((ks, cs, r.now_us))
        });
        let calls: Vec<_> = refunds
            .map(|(ks, cs, at)| async move {
                i.cross_slot_refunds.fetch_add(1, Ordering::Relaxed);
                if let Err(e) = self.run_one(&ks, &cs, now, Op::Refund(at)).await {
                    tracing::warn!(error = %e.store_error(i.config.timeout), "cross-slot refund failed: those limits keep this request's hits");
                }
            })
            .collect();
        join_all(calls).await;
    }

    /// Indices of the checks, grouped by hash slot (one group on a single
    /// server).
    pub(super) fn groups(&self, keys: &[String]) -> Vec<Vec<usize>> {
        if matches!(self.inner.client, Client::Single(_)) || keys.len() == 1 {
            return vec![(0..keys.len()).collect()];
        }
        let mut groups: Vec<(Slot, Vec<usize>)> = Vec::new();
        for (j, k) in keys.iter().enumerate() {
            let slot = Slot::for_key(k);
            match groups.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, g)) => g.push(j),
                None => groups.push((slot, vec![j])),
            }
        }
        groups.into_iter().map(|(_, g)| g).collect()
    }
}

/// Whether a check's denial may be answered from (and kept in) the local
/// over-limit cache: one hit taken before the work (a late charge is never
/// denied; a refund never is), not a slot of a concurrency limit.
fn cacheable(c: &Check<'_>) -> bool {
    // Not a concurrency limit's: a release frees a slot at any time.
    c.hits == 1 && c.takes_back_on_denial() && !c.limit.is_concurrency()
}

/// A queued request's part of a batch's reply, with its keys given back.
pub(super) type BatchReply = (Vec<String>, Result<Vec<i64>, CallError>);

/// Batch queues at most: past that, threads share them.
pub(super) const MAX_LANES: usize = 16;

/// One thread's batch queue.
pub(super) struct Lane {
    thread: std::thread::ThreadId,
    tx: mpsc::UnboundedSender<Queued>,
}

/// A request waiting on a single server's batch queue: its time, keys and
/// checks, and where its part of the reply goes (with its keys, given back).
pub(super) struct Queued {
    now: Option<u64>,
    keys: Vec<String>,
    args: Vec<CheckArgs>,
    head: Option<String>,
    deadline: tokio::time::Instant,
    reply: oneshot::Sender<BatchReply>,
}

/// The batching task of a single server: takes the requests queued while
/// [`BATCHES_IN_FLIGHT`] calls were out and sends them as one call. Ends
/// when the store is dropped.
pub(super) async fn batcher(inner: Weak<Inner>, mut rx: mpsc::UnboundedReceiver<Queued>, conn: Arc<ConnSlot>) {
    let slots = Arc::new(tokio::sync::Semaphore::new(BATCHES_IN_FLIGHT));
    let mut next: Option<Queued> = None;
    loop {
        let Ok(slot) = Arc::clone(&slots).acquire_owned().await else { return };
        let first = match next.take() {
            Some(q) => q,
            None => match rx.recv().await {
                Some(q) => q,
                None => return,
            },
        };
        let mut checks = first.keys.len();
        let mut batch = vec![first];
        while let Ok(q) = rx.try_recv() {
            if checks + q.keys.len() > BATCH_CHECKS {
                next = Some(q);
                break;
            }
            checks += q.keys.len();
            batch.push(q);
        }
        let Some(inner) = inner.upgrade() else { return };
        // A request whose caller is gone is not decided, nor one whose
        // deadline passed in the queue.
        let now = tokio::time::Instant::now();
        batch.retain(|q| !q.reply.is_closed());
        for q in batch.extract_if(.., |q| q.deadline <= now) {
            inner.timeouts.fetch_add(1, Ordering::Relaxed);
            inner.errors.fetch_add(1, Ordering::Relaxed);
            let _ = q.reply.send((q.keys, Err(CallError::Timeout)));
        }
        if batch.is_empty() {
            continue;
        }
        let conn = Arc::clone(&conn);
        tokio::spawn(async move {
            RedisStore { inner }.send_batch(batch, &conn).await;
            drop(slot);
        });
    }
}
