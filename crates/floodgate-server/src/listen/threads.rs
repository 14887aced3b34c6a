//! Serving on per-thread single-threaded runtimes (gRPC and the proxy): one
//! task accepts and hands each connection to the next runtime in turn; each
//! runtime serves its connections alone, so a request never wakes another
//! thread and nothing is stolen between workers.

use std::future::Future;

use tokio::net::TcpListener;
use tokio::sync::mpsc::unbounded_channel;
use tokio::sync::watch;

use super::{ConnLimit, Handed, ServerError, accept};

/// Serve `listener` on `n` threads named `{name}-{i}`, each a
/// current-thread runtime running `serve(its connections)` (called on that
/// thread, so per-thread state such as a connection pool is made there).
/// Accepts until `stop`; returns when every runtime has drained.
pub(crate) async fn on_threads<F, Fut>(
    n: usize,
    name: &'static str,
    listener: TcpListener,
    bound: ConnLimit,
    stop: watch::Receiver<bool>,
    serve: F,
) -> Result<(), ServerError>
where
    F: Fn(Handed) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<(), ServerError>>,
{
    let mut senders = Vec::with_capacity(n);
    let mut done = Vec::with_capacity(n);
    for i in 0..n {
        let (tx, rx) = unbounded_channel();
        let (done_tx, done_rx) = tokio::sync::oneshot::channel::<Result<(), ServerError>>();
        let serve = serve.clone();
        let thread = std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || {
            let result = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt.block_on(serve(rx)),
                Err(source) => Err(ServerError::Start { name, what: "runtime", index: i, source }),
            };
            let _ = done_tx.send(result);
        });
        thread.map_err(|source| ServerError::Start { name, what: "thread", index: i, source })?;
        senders.push(tx);
        done.push(done_rx);
    }
    accept(listener, senders, bound, stop).await;
    for d in done {
        d.await.map_err(|_| ServerError::Stopped(name))??;
    }
    Ok(())
}
