//! Two and three memory-store regions over real gRPC on loopback: usage
//! flows both ways and is acknowledged, a wrong token or a bad batch is
//! refused, and a peer that is down costs no decision anything.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use floodgate_core::region::{GlobalTable, RegionConfig, SyncMode};
use floodgate_core::{Algorithm, Clock, Limit, SystemClock};
use floodgate_sync::proto::{SyncAck, SyncBatch, SyncItem};
use floodgate_sync::{LinkConfig, Peer, SyncServer, SyncStats, run_links};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::sync::watch;

struct Node {
    table: Arc<GlobalTable>,
    url: String,
    stats: Arc<SyncStats>,
}

async fn node(name: &str, peers: &[&str]) -> (Node, TcpListener) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let peers: Vec<String> = peers.iter().map(|p| (*p).to_owned()).collect();
    let mut cfg = RegionConfig::new(name, peers.clone(), rand_incarnation());
    cfg.interval_us = 20_000;
    let table = Arc::new(GlobalTable::new(cfg).unwrap());
    let stats = Arc::new(SyncStats::new(peers.len()));
    (Node { table, url, stats }, listener)
}

fn rand_incarnation() -> u64 {
    std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), std::time::SystemTime::now())
}

fn serve(n: &Node, listener: TcpListener, token: Option<&str>, stop: watch::Receiver<bool>) {
    let svc = SyncServer::new(n.table.clone(), token.map(str::to_owned), n.stats.clone());
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let mut stop2 = stop.clone();
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stop2.wait_for(|s| *s).await;
            })
            .await
            .unwrap();
    });
}

fn links(n: &Node, peers: Vec<Peer>, token: Option<&str>, stop: watch::Receiver<bool>) {
    let cfg = LinkConfig {
        interval: Duration::from_millis(20),
        timeout: Duration::from_millis(500),
        token: token.map(str::to_owned),
    };
    tokio::spawn(run_links(n.table.clone(), peers, cfg, n.stats.clone(), stop));
}

async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "not within 10 s: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn limit() -> Limit {
    Limit::new(Algorithm::FixedWindow, 100, Duration::from_secs(3_600)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_flows_between_regions_and_is_acknowledged() {
    let (stop_tx, stop) = watch::channel(false);
    let (a, la) = node("a", &["b", "c"]).await;
    let (b, lb) = node("b", &["a", "c"]).await;
    let (c, lc) = node("c", &["a", "b"]).await;
    let peer = |name: &str, n: &Node| Peer { name: name.into(), url: n.url.clone() };
    links(&a, vec![peer("b", &b), peer("c", &c)], None, stop.clone());
    links(&b, vec![peer("a", &a), peer("c", &c)], None, stop.clone());
    // c is down at first: nothing waits for it.
    serve(&a, la, None, stop.clone());
    serve(&b, lb, None, stop.clone());
    let clock = SystemClock::new();
    let (l, e) = (limit(), SyncMode::Eventual);
    // A region that knows nothing yet admits nothing on eventual rules
    // until a peer's full state arrives (c's is not needed).
    eventually("a has b's full state", || !a.table.cold()).await;
    let t = Instant::now();
    for _ in 0..30 {
        a.table.apply("k", &l, e, 1, clock.now_us()).unwrap();
    }
    assert!(t.elapsed() < Duration::from_millis(500), "decisions never wait for a peer");
    eventually("b sees a's 30", || b.table.apply("k", &l, e, 0, clock.now_us()).unwrap().remaining == 70).await;
    // c comes up and catches up; then everyone agrees.
    links(&c, vec![peer("a", &a), peer("b", &b)], None, stop.clone());
    serve(&c, lc, None, stop.clone());
    eventually("c has a peer's full state", || !c.table.cold()).await;
    for _ in 0..10 {
        c.table.apply("k", &l, e, 1, clock.now_us()).unwrap();
    }
    eventually("every region sees 40", || {
        [&a, &b, &c].iter().all(|n| n.table.apply("k", &l, e, 0, clock.now_us()).unwrap().remaining == 60)
    })
    .await;
    // A bounded key's usage is acknowledged by both peers.
    let bounded = SyncMode::Bounded { overshoot_ppm: 300_000 };
    for _ in 0..5 {
        assert!(a.table.apply("kb", &l, bounded, 1, clock.now_us()).unwrap().allowed);
    }
    assert_eq!(a.table.unacked("kb"), 5);
    eventually("a's bounded usage acknowledged by both", || a.table.unacked("kb") == 0).await;
    assert!(a.stats.peer(0).bytes_sent.load(Ordering::Relaxed) > 0);
    eventually("full state exchanged: nobody warming", || {
        !a.table.warming() && !b.table.warming() && !c.table.warming()
    })
    .await;
    let _ = stop_tx.send(true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_token_or_a_bad_batch_is_refused() {
    let (stop_tx, stop) = watch::channel(false);
    let (a, la) = node("a", &["b"]).await;
    serve(&a, la, Some("s3cret"), stop.clone());
    let ch = tonic::transport::Endpoint::from_shared(a.url.clone()).unwrap().connect().await.unwrap();
    let call = |msg: SyncBatch, token: Option<&str>| {
        let ch = ch.clone();
        let token = token.map(str::to_owned);
        async move {
            let mut grpc = tonic::client::Grpc::new(ch);
            grpc.ready().await.unwrap();
            let mut req = tonic::Request::new(msg);
            if let Some(t) = token {
                req.metadata_mut().insert("authorization", format!("Bearer {t}").parse().unwrap());
            }
            let codec = tonic_prost::ProstCodec::<SyncBatch, SyncAck>::default();
            grpc.unary(req, http::uri::PathAndQuery::from_static(floodgate_sync::PUSH), codec).await
        }
    };
    let good = SyncBatch { from: "b".into(), seq: 1, ..SyncBatch::default() };
    assert_eq!(call(good.clone(), None).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    assert_eq!(call(good.clone(), Some("guess")).await.unwrap_err().code(), tonic::Code::Unauthenticated);
    let ack = call(good, Some("s3cret")).await.unwrap().into_inner();
    assert_eq!((ack.region.as_str(), ack.seq), ("a", 1));
    let bad = SyncBatch {
        from: "b".into(),
        items: vec![SyncItem { key: "k".into(), kind: 7, slot_us: 1, ..SyncItem::default() }],
        ..SyncBatch::default()
    };
    let e = call(bad, Some("s3cret")).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("items[0].kind"), "{}", e.message());
    assert_eq!(a.stats.rejected.load(Ordering::Relaxed), 3);
    let _ = stop_tx.send(true);
}

/// A relay to `target` that can fall silent: its connections stay open
/// but nothing passes either way any more (a paused peer, or a link that
/// drops every packet), which only a timeout notices.
async fn freezing_relay(target: &str) -> (String, Arc<AtomicBool>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let frozen = Arc::new(AtomicBool::new(false));
    let f = frozen.clone();
    let target = target.trim_start_matches("http://").to_owned();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(&target).await else { continue };
            let ((cr, cw), (sr, sw)) = (client.into_split(), server.into_split());
            tokio::spawn(pipe(cr, sw, f.clone()));
            tokio::spawn(pipe(sr, cw, f.clone()));
        }
    });
    (url, frozen)
}

/// Copy `from` to `to` until `frozen`; then swallow everything.
async fn pipe(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, frozen: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) if !frozen.load(Ordering::SeqCst) => {
                if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
            Ok(_) => {}
        }
    }
}

/// A peer that falls silent is shown down at most an interval plus the
/// sync timeout after its last acknowledgement: an idle link sends a
/// heartbeat every interval (it sent one a second, so it took ~1.5 s
/// here), and each call gives up after the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_peer_is_down_within_an_interval_and_the_timeout_of_its_last_ack() {
    let (stop_tx, stop) = watch::channel(false);
    let (a, _la) = node("a", &["b"]).await;
    let (b, lb) = node("b", &["a"]).await;
    serve(&b, lb, None, stop.clone());
    let (url, frozen) = freezing_relay(&b.url).await;
    let (interval, timeout) = (Duration::from_millis(100), Duration::from_millis(300));
    let cfg = LinkConfig { interval, timeout, token: None };
    tokio::spawn(run_links(a.table.clone(), vec![Peer { name: "b".into(), url }], cfg, a.stats.clone(), stop));
    let up = || a.stats.peer(0).up.load(Ordering::Relaxed);
    eventually("a reaches b", up).await;
    // Idle for a while: only heartbeats keep the link up.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(up(), "heartbeats keep an idle link up");
    frozen.store(true, Ordering::SeqCst);
    eventually("a sees b down", || !up()).await;
    let clock = SystemClock::new();
    let since_ack = Duration::from_micros(clock.now_us().saturating_sub(a.table.link_stats(0).last_ack_us));
    // The bound, plus room for a busy machine's scheduling (under the
    // second an old heartbeat period alone added).
    assert!(
        since_ack <= interval + timeout + Duration::from_millis(400),
        "b shown down {since_ack:?} after its last acknowledgement (bound: {:?})",
        interval + timeout
    );
    let _ = stop_tx.send(true);
}
