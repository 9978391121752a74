//! [`Primary`]: which of several PostgreSQL hosts takes writes, found again when it moves.
//!
//! Why by hand: sqlx connects to one host and knows no `target_session_attrs`
//! (launchbadge/sqlx#2290). What it does have is used as it is: `Pool::set_connect_options`
//! points the pool's new connections at another host, `after_connect` vets each new
//! connection, `before_acquire` retires an old one. Written here is only what libpq does and
//! sqlx does not: ask the hosts, in order, which one takes writes; and ask again when the one
//! in use stops answering or refuses a write, so the store follows a failover without a
//! restart.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures_util::future::join_all;
use sqlx::Connection as _;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPool};
use tokio::sync::watch;
use tokio::time::Instant;

use super::session::{self, Sessions};
use super::url::PgHost;

/// Whether the session takes writes: neither a standby (in recovery) nor read-only by setting
/// (`default_transaction_read_only`, which a primary being demoted or fenced may be given).
const WRITABLE: &str =
    "SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'";

/// How long a host may take to accept a connection and answer [`WRITABLE`]. A host that is
/// gone without refusing connections (a machine down, a partition) would otherwise hold a
/// search for as long as the kernel resends a SYN.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The first pause between two rounds of questions that found no writable host; it doubles up
/// to [`MAX_PAUSE`].
const MIN_PAUSE: Duration = Duration::from_millis(100);

/// The longest pause between two rounds: once a standby is promoted, the store finds it within
/// about this long.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// How long one search goes on. A statement that fails after it gave up starts another, so a
/// store whose every host is down asks no one while nobody uses it.
const SEARCH_FOR: Duration = Duration::from_secs(60);

/// The least time from the start of one search to the start of the next, so that the
/// statements failing on connections still open to the old host do not each start one.
const SEARCH_SPACING: Duration = Duration::from_secs(1);

/// No host of a URL took writes when asked; the error lists what each one answered.
#[derive(Debug, thiserror::Error)]
#[error("no PostgreSQL host takes writes ({0})")]
pub struct NoPrimary(String);

/// A new connection reached a host that takes no writes. Only sqlx's pool sees it: it logs
/// it, closes the connection and connects again.
#[derive(Debug, thiserror::Error)]
#[error("{0} takes no writes (a standby, or read-only): the pool needs the primary")]
struct ReadOnlyHost(String);

/// The hosts of a multi-host URL and the one the store's pool connects to now.
#[derive(Debug)]
pub(crate) struct Primary {
    hosts: Vec<PgHost>,
    /// Index in `hosts` of the host new connections go to; listeners watch it to move along.
    current: watch::Sender<usize>,
    /// When the pool was last pointed at another host: a connection older than that leads to
    /// the old one.
    moved_at: Mutex<Option<std::time::Instant>>,
    searching: AtomicBool,
}

impl Primary {
    /// Asks `hosts` which one takes writes, again and again for up to `within`.
    pub(crate) async fn find(hosts: Vec<PgHost>, within: Duration) -> Result<Self, NoPrimary> {
        let at = rounds(&hosts, Instant::now() + within).await?;
        Ok(Self {
            hosts,
            current: watch::Sender::new(at),
            moved_at: Mutex::new(None),
            searching: AtomicBool::new(false),
        })
    }

    /// Asks, on the host in use, whether sessions are direct or lent by a pooler
    /// ([`session::settle`](super::session::settle)); where they are direct, every host's
    /// connections carry the session settings from now on.
    pub(crate) async fn settle(&mut self) -> Result<Sessions, sqlx::Error> {
        let at = *self.current.borrow();
        let (_, sessions) = session::settle(self.hosts[at].options.clone()).await?;
        for host in &mut self.hosts {
            let plain = session::without_refused_parameters(host.options.clone());
            host.options = match sessions {
                Sessions::Direct => session::with_session_settings(plain),
                Sessions::Pooled => plain,
            };
        }
        Ok(sessions)
    }

    /// The options of the host in use.
    pub(crate) fn options(&self) -> PgConnectOptions {
        self.hosts[*self.current.borrow()].options.clone()
    }

    /// Tells of every move of the pool to another host (its index in the URL's list).
    pub(crate) fn moves(&self) -> watch::Receiver<usize> {
        self.current.subscribe()
    }

    /// Looks for the primary again, in the background, unless a search is under way; points
    /// `pool` at it if it is not the host in use.
    pub(crate) fn search(self: &Arc<Self>, pool: &PgPool) {
        if self.searching.swap(true, Ordering::AcqRel) {
            return;
        }
        let (primary, pool) = (Arc::clone(self), pool.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            match rounds(&primary.hosts, started + SEARCH_FOR).await {
                Ok(at) => primary.point(&pool, at),
                Err(e) => tracing::warn!(
                    error = %e,
                    "stopped looking for the PostgreSQL primary; the next failed statement looks again"
                ),
            }
            tokio::time::sleep_until(started + SEARCH_SPACING).await;
            primary.searching.store(false, Ordering::Release);
        });
    }

    /// Points the pool's new connections at host `at`, if they go elsewhere now.
    fn point(&self, pool: &PgPool, at: usize) {
        let was = *self.current.borrow();
        if at == was {
            return;
        }
        pool.set_connect_options(self.hosts[at].options.clone());
        // Stamped after the switch, so a connection to the old host is older than the stamp.
        *self.moved_at.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(std::time::Instant::now());
        self.current.send_replace(at);
        tracing::warn!(
            from = %self.hosts[was].label,
            to = %self.hosts[at].label,
            "the PostgreSQL primary moved; new connections go to it"
        );
    }

    /// For `before_acquire`: whether a pooled connection `age` old was opened before the pool
    /// last moved, so leads to the old host. (A std Mutex: nothing awaits while it is held.)
    pub(crate) fn leads_elsewhere(&self, age: Duration) -> bool {
        self.moved_at
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some_and(|moved_at| age > moved_at.elapsed())
    }

    /// For `after_connect`: refuses a new connection to a host that takes no writes, so the
    /// pool never hands one out. sqlx then connects again until its acquire timeout, to the
    /// host a search may have found meanwhile.
    pub(crate) async fn vet(&self, conn: &mut PgConnection) -> Result<(), sqlx::Error> {
        // A simple query: nothing prepared, safe behind a pooler too.
        let row = sqlx::raw_sql(WRITABLE).fetch_one(&mut *conn).await?;
        if sqlx::Row::try_get::<bool, _>(&row, 0)? {
            return Ok(());
        }
        let label = self.hosts[*self.current.borrow()].label.clone();
        // The URL's target is wrong for now, which is what sqlx's configuration error says.
        Err(sqlx::Error::Configuration(Box::new(ReadOnlyHost(label))))
    }
}

/// The pauses between rounds: doubling, capped.
fn pauses() -> impl Iterator<Item = Duration> {
    std::iter::successors(Some(MIN_PAUSE), |pause| Some((*pause * 2).min(MAX_PAUSE)))
}

/// Asks every host, round after round, until one takes writes or `deadline` passes; the index
/// of the first in the URL's order that does.
async fn rounds(hosts: &[PgHost], deadline: Instant) -> Result<usize, NoPrimary> {
    let mut waits = pauses();
    loop {
        let answers = join_all(hosts.iter().map(probe)).await;
        if let Some(at) = answers.iter().position(|a| matches!(a, Answer::Writable)) {
            return Ok(at);
        }
        let pause = waits.next().expect("the pauses never run out");
        if Instant::now() + pause >= deadline {
            let answers: Vec<String> = hosts
                .iter()
                .zip(&answers)
                .map(|(host, answer)| format!("{}: {answer}", host.label))
                .collect();
            return Err(NoPrimary(answers.join("; ")));
        }
        tokio::time::sleep(pause).await;
    }
}

/// What a host answered.
#[derive(Debug)]
enum Answer {
    Writable,
    ReadOnly,
    Unreachable(String),
}

impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Writable => f.write_str("takes writes"),
            Self::ReadOnly => f.write_str("takes no writes"),
            Self::Unreachable(why) => f.write_str(why),
        }
    }
}

/// Asks one host, on a connection of its own (asked all at once, so a host that does not
/// answer delays the others by [`PROBE_TIMEOUT`] at most; the URL's order decides).
async fn probe(host: &PgHost) -> Answer {
    let asked = tokio::time::timeout(PROBE_TIMEOUT, async {
        let mut conn = PgConnection::connect_with(&host.options).await?;
        let row = sqlx::raw_sql(WRITABLE).fetch_one(&mut conn).await?;
        let writable = sqlx::Row::try_get::<bool, _>(&row, 0)?;
        // The answer is in; a failure to say goodbye changes nothing.
        let _ = conn.close().await;
        Ok::<_, sqlx::Error>(writable)
    })
    .await;
    match asked {
        Ok(Ok(true)) => Answer::Writable,
        Ok(Ok(false)) => Answer::ReadOnly,
        Ok(Err(e)) => Answer::Unreachable(e.to_string()),
        Err(_elapsed) => Answer::Unreachable(format!("no answer within {PROBE_TIMEOUT:?}")),
    }
}

#[cfg(all(test, feature = "conformance"))]
mod tests {
    use std::net::SocketAddr;

    use idem_core::{
        AccountId, FencingToken, Fingerprint, IdempotencyKey, KeyLimits, Policy, RequestParts,
        Scope, Timestamp,
    };
    use sqlx::{AssertSqlSafe, Executor as _};

    use super::*;
    use crate::{ClaimOutcome, Error, NewClaim, PgStore, Store, is_unavailable};
    use idem_testkit::fault_relay::FaultRelay;
    use idem_testkit::postgres::{PgTestDatabase, with_hosts};

    /// The tests' clock, standing still: what they read needs no time to pass.
    const T0: Timestamp = Timestamp(1_800_000_000_000);

    /// Far above the time a search takes to find a host that answers at once.
    const PATIENCE: Duration = Duration::from_secs(10);

    fn scope(key: &str) -> Scope {
        Scope::new(
            AccountId::new("acct_failover"),
            IdempotencyKey::new(key, KeyLimits::default()).expect("valid test key"),
        )
    }

    fn claim(scope: &Scope) -> NewClaim {
        let fingerprint = Fingerprint::compute(&RequestParts {
            account: "acct_failover",
            method: "POST",
            route: "/payments",
            query: "",
            content_type: "application/json",
            body: b"{}",
        })
        .expect("valid test body");
        NewClaim::new(
            scope.clone(),
            fingerprint,
            FencingToken(1),
            T0,
            &Policy::default(),
        )
    }

    /// A relay to the test server, as a host of its own.
    async fn host_for(db: &PgTestDatabase) -> FaultRelay {
        let direct: PgConnectOptions = db.url().parse().expect("the test URL");
        FaultRelay::start_to(direct.get_host(), direct.get_port(), 0)
            .await
            .expect("a relay")
    }

    /// A loopback address nothing listens on: connections to it are refused.
    fn refusing_host() -> SocketAddr {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
    }

    async fn admin(db: &PgTestDatabase) -> PgConnection {
        PgConnection::connect(db.url()).await.expect("connect")
    }

    /// New sessions of the test's database take no writes (`on`), or do again.
    async fn set_read_only(db: &PgTestDatabase, on: bool) {
        let setting = if on {
            "SET default_transaction_read_only = on"
        } else {
            "RESET ALL"
        };
        let mut admin = admin(db).await;
        // This session is one of the database's, and ALTER DATABASE is a write.
        admin
            .execute("SET default_transaction_read_only = off")
            .await
            .expect("a writable session");
        admin
            .execute(AssertSqlSafe(format!(
                "ALTER DATABASE {} {setting}",
                db.name()
            )))
            .await
            .expect("alter the database");
    }

    /// Ends every other session of the test's database, as a restart of the server would.
    async fn end_sessions(db: &PgTestDatabase) {
        sqlx::query(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = $1 AND pid <> pg_backend_pid()",
        )
        .bind(db.name())
        .execute(&mut admin(db).await)
        .await
        .expect("end the sessions");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_first_host_that_takes_writes_is_used() {
        let db = PgTestDatabase::create().await;
        let writable = host_for(&db).await;
        let url = with_hosts(db.url(), &[refusing_host(), writable.addr()], "");
        let store = PgStore::connect(&url).await.unwrap();
        assert_eq!(store.primary_moves().map(|moves| *moves.borrow()), Some(1));
        assert_eq!(store.get(&scope("first-writable"), T0).await.unwrap(), None);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lost_primary_is_found_again_without_a_new_store() {
        let db = PgTestDatabase::create().await;
        let (a, b) = (host_for(&db).await, host_for(&db).await);
        let store = PgStore::connect(&with_hosts(db.url(), &[a.addr(), b.addr()], ""))
            .await
            .unwrap();
        let mut moves = store.primary_moves().expect("several hosts");
        assert_eq!(*moves.borrow_and_update(), 0);
        let key = scope("moved-key-0001");
        assert_eq!(
            store.claim(&claim(&key)).await.unwrap(),
            ClaimOutcome::Claimed
        );

        a.cut().await;
        // The statement that finds the host gone answers unavailable and sets off the search.
        assert!(matches!(
            store.get(&key, T0).await,
            Err(Error::Unavailable(_))
        ));
        tokio::time::timeout(PATIENCE, moves.changed())
            .await
            .expect("a move")
            .unwrap();
        assert_eq!(*moves.borrow(), 1);
        let record = store
            .get(&key, T0)
            .await
            .unwrap()
            .expect("the record, through b");
        assert_eq!(record.scope, key);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_host_that_takes_no_writes_is_never_used() {
        let db = PgTestDatabase::create().await;
        let host = host_for(&db).await;
        let url = with_hosts(db.url(), &[host.addr()], "target_session_attrs=read-write");
        drop(
            crate::PgStore::from_pool(db.pool(1).await)
                .await
                .expect("migrate the test database"),
        );
        set_read_only(&db, true).await;
        let refused = PgStore::connect(&url).await.unwrap_err();
        assert!(
            matches!(&refused, Error::Unavailable(e) if e.to_string().contains("takes no writes")),
            "{refused:?}"
        );

        set_read_only(&db, false).await;
        let store = PgStore::connect(&url).await.unwrap();
        let key = scope("read-only-0001");
        assert_eq!(store.get(&key, T0).await.unwrap(), None);
        // The primary turns read-only and its sessions end (a demotion): the pool's new
        // connections are refused, so no statement runs on a node that takes no writes.
        set_read_only(&db, true).await;
        end_sessions(&db).await;
        // Each pooled connection fails once (its session was ended) and is dropped; then the
        // wait for a new one runs out, since every one the pool opens is refused.
        let mut ended = 0;
        loop {
            match store.get(&key, T0).await {
                Err(Error::Unavailable(e))
                    if matches!(e.downcast_ref(), Some(sqlx::Error::PoolTimedOut)) =>
                {
                    break;
                }
                Err(Error::Unavailable(_)) if ended < 10 => ended += 1,
                other => panic!("a statement ran on a read-only host: {other:?}"),
            }
        }
        set_read_only(&db, false).await;
        assert_eq!(store.get(&key, T0).await.unwrap(), None);
    }

    #[test]
    fn connections_opened_before_a_move_lead_elsewhere() {
        let primary = Primary {
            hosts: Vec::new(),
            current: watch::Sender::new(0),
            moved_at: Mutex::new(None),
            searching: AtomicBool::new(false),
        };
        let old = Duration::from_secs(3600);
        assert!(!primary.leads_elsewhere(old), "no move yet");
        *primary.moved_at.lock().unwrap() = Some(std::time::Instant::now());
        assert!(primary.leads_elsewhere(old));
        assert!(!primary.leads_elsewhere(Duration::ZERO));
    }

    #[test]
    fn rounds_pause_longer_and_longer_up_to_a_second() {
        let pauses: Vec<u128> = pauses().take(7).map(|p| p.as_millis()).collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1000, 1000, 1000]);
    }

    #[tokio::test]
    async fn a_write_refused_by_a_read_only_session_is_unavailable() {
        let db = PgTestDatabase::create().await;
        let mut conn = admin(&db).await;
        conn.execute("SET default_transaction_read_only = on")
            .await
            .unwrap();
        let refused = conn.execute("CREATE TABLE t (x int)").await.unwrap_err();
        let code = refused.as_database_error().and_then(|e| e.code());
        assert_eq!(code.as_deref(), Some("25006"));
        assert!(is_unavailable(&refused));
    }
}
