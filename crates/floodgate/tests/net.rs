//! Test hosts for regions: network namespaces joined to this (root)
//! namespace by veth pairs, and a delaying TCP relay (`tc netem` is not
//! available here) that carries every region-to-region connection, and can
//! cut it and heal it.

#![allow(dead_code, unreachable_pub)]

use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// One host: a namespace with `lo` and one veth end, `10.S.N.2/24`, whose
/// other end in the root namespace is `10.S.N.1`.
pub struct Host {
    pub ns: String,
    /// The host's own address.
    pub addr: Ipv4Addr,
    /// The root namespace's address on the host's link (where relays for
    /// this host listen).
    pub gateway: Ipv4Addr,
    root_if: String,
}

impl Host {
    /// Make host `n` (1..) of subnet `s`.
    pub fn new(tag: &str, s: u8, n: u8) -> Result<Host, String> {
        let ns = format!("fg-{tag}-{n}");
        let root_if = format!("fg{s}h{n}r");
        let host_if = format!("fg{s}h{n}n");
        let _ = ip(&["netns", "del", &ns]);
        let _ = ip(&["link", "del", &root_if]);
        ip(&["netns", "add", &ns])?;
        let host = Host {
            ns: ns.clone(),
            addr: Ipv4Addr::new(10, s, n, 2),
            gateway: Ipv4Addr::new(10, s, n, 1),
            root_if: root_if.clone(),
        };
        ip(&["link", "add", &root_if, "type", "veth", "peer", "name", &host_if])?;
        ip(&["link", "set", &host_if, "netns", &ns])?;
        ip(&["addr", "add", &format!("{}/24", host.gateway), "dev", &root_if])?;
        ip(&["link", "set", &root_if, "up"])?;
        ip(&["-n", &ns, "addr", "add", &format!("{}/24", host.addr), "dev", &host_if])?;
        ip(&["-n", &ns, "link", "set", &host_if, "up"])?;
        ip(&["-n", &ns, "link", "set", "lo", "up"])?;
        Ok(host)
    }

    /// A command run inside the host's namespace.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns, program]);
        c
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = ip(&["link", "del", &self.root_if]);
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

/// Whether this machine lets the test make namespaces (root, iproute2).
pub fn namespaces_available() -> Result<(), String> {
    let probe = format!("fg-probe-{}", std::process::id());
    ip(&["netns", "add", &probe])?;
    ip(&["netns", "del", &probe])
}

/// A one-way-delaying TCP relay: every byte is forwarded `delay` after it
/// arrived, in order, both ways. `cut` drops every connection and refuses
/// new ones (a partition); `heal` ends that.
pub struct Relay {
    cut: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    pub addr: SocketAddr,
}

impl Relay {
    pub async fn start(listen: SocketAddr, target: SocketAddr, delay: Duration) -> Relay {
        let listener = TcpListener::bind(listen).await.unwrap_or_else(|e| panic!("relay on {listen}: {e}"));
        let addr = listener.local_addr().unwrap();
        let cut = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let (c2, k2) = (cut.clone(), conns.clone());
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else { continue };
                if c2.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let task = tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(target).await else { return };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    // In this task, so cutting (aborting it) closes both.
                    tokio::join!(pipe(cr, sw, delay), pipe(sr, cw, delay));
                });
                k2.lock().unwrap().push(task.abort_handle());
            }
        });
        Relay { cut, conns, addr }
    }

    /// Partition: drop every connection, refuse new ones.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }

    /// End the partition.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

/// Copy `from` to `to`, each chunk `delay` after it was read.
async fn pipe(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.send((Instant::now() + delay, buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, bytes)) = rx.recv().await {
            tokio::time::sleep_until(due.into()).await;
            if to.write_all(&bytes).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
