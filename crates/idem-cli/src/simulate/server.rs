//! The in-process `idem serve` the simulation's clients talk to (through the fault injector).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::serve::{ServeConfig, serve};

/// An in-process `idem serve` on a thread and a Tokio runtime of its own.
///
/// Its own thread, because the service logs every stored key at INFO: tens of thousands of
/// lines in a run would bury the progress bar and the table. A current-thread runtime runs
/// every task the server spawns on that one thread, so a thread-local subscriber that shows
/// only warnings and errors (or what `RUST_LOG` asks for) covers all of the server, and
/// nothing else in the process. It also keeps the server's work apart from the client's and
/// the fault injector's, much as a separate process would.
pub(super) struct Server {
    pub(super) addr: SocketAddr,
    stop: oneshot::Sender<()>,
    done: oneshot::Receiver<anyhow::Result<()>>,
}

impl Server {
    pub(super) async fn start(config: ServeConfig) -> anyhow::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let (finished, mut done) = oneshot::channel();
        std::thread::Builder::new()
            .name("idem-serve".into())
            .spawn(move || {
                let filter = tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
                let subscriber = tracing_subscriber::fmt()
                    .with_env_filter(filter)
                    .with_writer(std::io::stderr)
                    .finish();
                let _quiet = tracing::subscriber::set_default(subscriber);
                let result = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .context("cannot start the server's runtime")
                    .and_then(|runtime| {
                        runtime.block_on(async {
                            let listener = TcpListener::from_std(listener)?;
                            serve(listener, config, async {
                                let _ = stopped.await;
                            })
                            .await
                        })
                    });
                let _ = finished.send(result);
            })
            .context("cannot start the server's thread")?;

        // The listener is bound already, so this request waits until the database is open;
        // if opening fails the server returns and the connection is refused.
        let health = reqwest::Client::builder()
            .no_proxy()
            .build()?
            .get(format!("http://{addr}/healthz"))
            .timeout(Duration::from_secs(60))
            .send();
        tokio::select! {
            answer = health => {
                let healthy = answer.is_ok_and(|a| a.status().is_success());
                anyhow::ensure!(healthy, "the in-process idem serve did not become healthy");
            }
            ended = &mut done => {
                ended.context("idem serve panicked")??;
                anyhow::bail!("idem serve stopped at start");
            }
        }
        Ok(Self { addr, stop, done })
    }

    pub(super) async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.done.await.context("idem serve panicked")?
    }
}
