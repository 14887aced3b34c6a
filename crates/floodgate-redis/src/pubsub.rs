//! [`Subscription`]: one Pub/Sub channel, for change notices between
//! instances (per-key entries).
//!
//! Pub/Sub delivers at most once: a message published while a subscriber
//! is disconnected is lost to it. The subscriber therefore learns of every
//! gap: the subscription ends when its connection closes or when a `PING`
//! (every [`PING_EVERY`]) goes unanswered within the store's timeout, and
//! whoever resubscribes must assume it missed messages.
//!
//! A Redis Cluster broadcasts `PUBLISH` to every node, so one node's
//! subscription hears the whole cluster: the seed nodes are tried in order.

use std::time::Duration;

use floodgate_core::StoreError;
use redis::aio::{PubSubSink, PubSubStream};
use tokio_stream::StreamExt;

use crate::{RedisStore, Target};

/// How often an idle subscription checks that Redis still answers.
pub const PING_EVERY: Duration = Duration::from_secs(2);

/// A live subscription to one channel.
pub struct Subscription {
    sink: PubSubSink,
    stream: PubSubStream,
    timeout: Duration,
    ping: tokio::time::Interval,
}

impl std::fmt::Debug for Subscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Subscription").finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Subscribe to `channel` (on a connection of its own; for a cluster,
    /// on the first seed node that answers). Bounded by the store's
    /// timeout per node.
    pub async fn subscribe(&self, channel: &str) -> Result<Subscription, StoreError> {
        let timeout = self.config().timeout;
        let urls = match &self.config().target {
            Target::Single(url) => std::slice::from_ref(url),
            Target::Cluster(urls) => urls.as_slice(),
        };
        let mut last = String::from("no node to subscribe on");
        for url in urls {
            let attempt = async {
                let client = redis::Client::open(url.as_str())?;
                let mut pubsub = client.get_async_pubsub().await?;
                pubsub.subscribe(channel).await?;
                Ok::<_, redis::RedisError>(pubsub)
            };
            match tokio::time::timeout(timeout, attempt).await {
                Ok(Ok(pubsub)) => {
                    let (sink, stream) = pubsub.split();
                    let mut ping = tokio::time::interval(PING_EVERY);
                    ping.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                    ping.reset();
                    return Ok(Subscription { sink, stream, timeout, ping });
                }
                Ok(Err(e)) => last = format!("Redis: {e}"),
                Err(_) => last = format!("Redis did not answer within {timeout:?}"),
            }
        }
        Err(StoreError::Unavailable(last))
    }
}

impl Subscription {
    /// The next message's payload; `None` once the subscription is lost
    /// (the connection closed, or a ping went unanswered): messages may
    /// have been missed, subscribe again.
    pub async fn next(&mut self) -> Option<Vec<u8>> {
        loop {
            tokio::select! {
                msg = self.stream.next() => return msg.map(|m| m.get_payload_bytes().to_vec()),
                _ = self.ping.tick() => {
                    let pong = tokio::time::timeout(self.timeout, self.sink.ping::<redis::Value>()).await;
                    if !matches!(pong, Ok(Ok(_))) {
                        return None;
                    }
                }
            }
        }
    }
}
