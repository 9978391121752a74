//! Group commit: SQLite's single writer commits the writes of many requests at once.
//!
//! With `synchronous = FULL` every commit waits for the disk (an `fsync` of the WAL), and
//! SQLite has one writer: one commit per request makes that wait the writer's limit. So one
//! task, the committer, holds the writer connection for a *group* of requests. It opens one
//! transaction, lends the connection to each waiting request in turn (a request in
//! transaction mode writes inside a savepoint of its own, so its rollback leaves the others'
//! writes alone), and commits once, when no request is left waiting or the group is full.
//! A request hears that its writes committed only after that commit: nothing is acknowledged
//! before it is durable, and a crash loses only writes nobody was told about, as before.
//!
//! Written here because no maintained crate does group commit over sqlx's SQLite connection;
//! sqlx's own `Transaction` cannot be shared by requests one after another.

use std::fmt;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use sqlx::pool::PoolConnection;
use sqlx::{Sqlite, SqliteConnection, SqlitePool};
use tokio::sync::{mpsc, oneshot};

use crate::{Error, Result};

/// At most this many requests share one commit: bounds how long the first of them waits.
const MAX_GROUP: usize = 64;

/// Opens a request's savepoint. It is sent in one round trip with the request's first
/// statement (sqlx runs each `;`-separated statement of a query in turn).
pub(super) const SAVEPOINT: &str = "SAVEPOINT idem_request;";
/// Ends a request's savepoint, keeping its writes in the group's transaction.
pub(super) const RELEASE: &str = "RELEASE idem_request;";
/// Undoes a request's writes and ends its savepoint.
const ROLLBACK: &str = "ROLLBACK TO idem_request; RELEASE idem_request;";

/// Why a group's commit failed; every request of the group gets the same cause.
#[derive(Debug, thiserror::Error)]
#[error("the group commit of SQLite's writer failed; nothing in it was committed")]
pub struct GroupCommitFailed(#[source] Arc<sqlx::Error>);

/// A request asking for its turn at the writer.
struct Turn {
    lend: oneshot::Sender<Result<SqliteTx, sqlx::Error>>,
}

/// How a request ended its turn.
enum Ending {
    /// Its writes are in the group's transaction: tell it when they are committed.
    Commit(oneshot::Sender<Result<(), Arc<sqlx::Error>>>),
    /// It wrote nothing that stays (it rolled its savepoint back).
    Nothing,
    /// It was dropped during its turn (a cancelled request): undo its savepoint, if open.
    Abandoned { savepoint: bool },
    /// A statement failed in a way that may have ended the group's transaction: undo the
    /// savepoint if open, then end the group now and tell each request whether it committed.
    Failed { savepoint: bool },
    /// Its writes cannot be undone alone and must not commit: roll the whole group back.
    Poisoned,
}

/// The connection coming back to the committer.
struct Returned {
    conn: PoolConnection<Sqlite>,
    ending: Ending,
}

/// A handle on the task that holds SQLite's writer for groups of requests.
#[derive(Debug, Clone)]
pub(super) struct GroupCommitter {
    turns: mpsc::UnboundedSender<Turn>,
    /// The runtime on the writer's thread, where the committer runs.
    runtime: tokio::runtime::Handle,
    /// Whether the committer is still getting the writer for its next group (the pool's one
    /// connection, then `BEGIN IMMEDIATE`): a turn that waits then waits on the database, not
    /// on another request.
    opening: Arc<AtomicBool>,
}

impl GroupCommitter {
    /// Starts the committer on the writer `pool` (a pool of one connection, which the
    /// committer takes only while a group is open, so the store's other writers get it
    /// between groups).
    pub(super) fn spawn(pool: SqlitePool) -> std::io::Result<Self> {
        let (turns, waiting) = mpsc::unbounded_channel();
        let opening = Arc::new(AtomicBool::new(false));
        // The sections that run here may do I/O of their own (a handler's HTTP call).
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let committer = commit_groups(pool, waiting, opening.clone());
        std::thread::Builder::new()
            .name("idem-sqlite-w".into())
            .spawn(move || runtime.block_on(committer))?;
        Ok(Self {
            turns,
            opening,
            runtime: handle,
        })
    }

    /// The runtime on the writer's thread.
    pub(super) fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Whether the writer is held up by the database (another process's lock, the pool's
    /// connection busy elsewhere) rather than by a group of requests.
    pub(super) fn waiting_on_the_database(&self) -> bool {
        self.opening.load(Ordering::Relaxed)
    }

    /// Waits for this request's turn at the writer, inside the current group's transaction.
    pub(super) async fn turn(&self) -> Result<SqliteTx> {
        let (lend, lent) = oneshot::channel();
        let gone = || Error::Unavailable(Box::new(sqlx::Error::WorkerCrashed));
        self.turns.send(Turn { lend }).map_err(|_| gone())?;
        Ok(lent.await.map_err(|_| gone())??)
    }
}

async fn commit_groups(
    pool: SqlitePool,
    mut waiting: mpsc::UnboundedReceiver<Turn>,
    opening: Arc<AtomicBool>,
) {
    while let Some(first) = waiting.recv().await {
        opening.store(true, Ordering::Relaxed);
        let opened = open_group(&pool).await;
        opening.store(false, Ordering::Relaxed);
        let conn = match opened {
            Ok(conn) => conn,
            Err(e) => {
                let _ = first.lend.send(Err(e));
                continue;
            }
        };
        let Some(group) = lend_turns(conn, first, &mut waiting).await else {
            return;
        };
        group.end().await;
        // The connection goes back to the pool here, between groups.
    }
}

/// A group whose turns are over: the writer's connection inside the group's transaction, and
/// the requests whose writes wait for its commit.
struct Group {
    conn: PoolConnection<Sqlite>,
    members: Vec<oneshot::Sender<Result<(), Arc<sqlx::Error>>>>,
    /// Whether the group must roll back instead of committing.
    roll_back: bool,
}

/// Lends `conn` to `first`, then to each request that waits meanwhile, until a turn's ending
/// ends the group or the group is full. `None` if a turn never handed the connection back
/// (the group's members have then been told).
async fn lend_turns(
    mut conn: PoolConnection<Sqlite>,
    first: Turn,
    waiting: &mut mpsc::UnboundedReceiver<Turn>,
) -> Option<Group> {
    let mut members = Vec::new();
    let mut roll_back = false;
    let mut next = Some(first);
    while let Some(turn) = next.take() {
        let (back, returned) = oneshot::channel();
        // A request that stopped waiting drops its turn at once, and dropping hands the
        // connection back as abandoned.
        let _ = turn.lend.send(Ok(SqliteTx::lend(conn, back)));
        let Ok(Returned {
            conn: lent_back,
            ending,
        }) = returned.await
        else {
            // Only a leaked SqliteTx gets here; its connection is gone with it.
            tracing::error!("a turn at SQLite's writer never handed its connection back");
            fail_all(members, sqlx::Error::WorkerCrashed);
            return None;
        };
        conn = lent_back;
        let ends_group = match ending {
            Ending::Commit(done) => {
                members.push(done);
                false
            }
            Ending::Nothing | Ending::Abandoned { savepoint: false } => false,
            // A savepoint that cannot be undone may hold writes nobody will answer for:
            // they must not commit, so the whole group rolls back (its requests hear of
            // it and retry).
            Ending::Abandoned { savepoint: true } => {
                roll_back = run(&mut conn, ROLLBACK).await.is_err();
                roll_back
            }
            Ending::Failed { savepoint } => {
                roll_back = savepoint && run(&mut conn, ROLLBACK).await.is_err();
                true
            }
            Ending::Poisoned => {
                roll_back = true;
                true
            }
        };
        if ends_group || members.len() >= MAX_GROUP {
            break;
        }
        next = waiting.try_recv().ok();
    }
    Some(Group {
        conn,
        members,
        roll_back,
    })
}

impl Group {
    /// Commits the group (or rolls it back) and tells each member how it ended.
    async fn end(mut self) {
        let result = if self.roll_back {
            Err(sqlx::Error::Protocol(
                "a request's writes could not be undone alone; its group was rolled back".into(),
            ))
        } else {
            run(&mut self.conn, "COMMIT").await
        };
        if let Err(e) = result {
            // SQLite may have ended the transaction itself (a full disk, an I/O error); make
            // sure it is over, and do not give the pool a connection in an unknown state.
            let _ = run(&mut self.conn, "ROLLBACK").await;
            self.conn.close_on_drop();
            tracing::error!(error = %e, members = self.members.len(), "a group commit failed");
            fail_all(self.members, e);
        } else {
            for done in self.members {
                let _ = done.send(Ok(()));
            }
        }
    }
}

async fn open_group(pool: &SqlitePool) -> Result<PoolConnection<Sqlite>, sqlx::Error> {
    let mut conn = pool.acquire().await?;
    run(&mut conn, "BEGIN IMMEDIATE").await?;
    Ok(conn)
}

async fn run(conn: &mut SqliteConnection, sql: &'static str) -> Result<(), sqlx::Error> {
    sqlx::query(sql).execute(conn).await.map(drop)
}

fn fail_all(members: Vec<oneshot::Sender<Result<(), Arc<sqlx::Error>>>>, e: sqlx::Error) {
    let e = Arc::new(e);
    for done in members {
        let _ = done.send(Err(e.clone()));
    }
}

/// A request's turn at SQLite's single writer, inside the transaction of its group: the
/// transaction a handler writes through in transaction mode.
///
/// It dereferences to the connection, so queries run on it as on any sqlx connection
/// (`.execute(&mut **tx)` from idem-tower's `Tx<SqliteTx>`). Its writes run in a savepoint
/// of their own; [`SqliteTx::commit`] returns once they are committed with the group's,
/// [`SqliteTx::rollback`] (or dropping it) undoes them alone. Nest with `SAVEPOINT`
/// statements of your own: sqlx's `begin` on it would try to open a second transaction.
pub struct SqliteTx {
    conn: Option<PoolConnection<Sqlite>>,
    back: Option<oneshot::Sender<Returned>>,
    /// Whether this request's savepoint is open (so that dropping it must undo its writes).
    pub(super) savepoint: bool,
}

impl SqliteTx {
    fn lend(conn: PoolConnection<Sqlite>, back: oneshot::Sender<Returned>) -> Self {
        Self {
            conn: Some(conn),
            back: Some(back),
            savepoint: false,
        }
    }

    /// Commits this request's writes with its group's; returns once they are durable.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] when the group's commit fails (its cause is a
    /// [`GroupCommitFailed`]) or the committer has stopped, and [`Error::Database`] when SQLite
    /// refuses to release the savepoint. Nothing of this request is committed then.
    pub async fn commit(mut self) -> Result<()> {
        self.end_savepoint(RELEASE).await?;
        self.commit_with_group().await
    }

    /// Undoes this request's writes, leaving the rest of its group alone.
    ///
    /// # Errors
    ///
    /// [`Error::Unavailable`] or [`Error::Database`] when SQLite cannot roll the savepoint
    /// back; the turn ends and the group commits without this request's writes.
    pub async fn rollback(mut self) -> Result<()> {
        self.end_savepoint(ROLLBACK).await?;
        self.hand_back(Ending::Nothing);
        Ok(())
    }

    /// Undoes this request's writes, then waits for the group's commit: for a turn that
    /// read what may be an earlier request's uncommitted writes.
    pub(super) async fn rollback_then_wait_for_group(mut self) -> Result<()> {
        self.end_savepoint(ROLLBACK).await?;
        self.commit_with_group().await
    }

    /// Ends the savepoint, if open, with `sql`; a failure ends the turn.
    async fn end_savepoint(&mut self, sql: &'static str) -> Result<()> {
        if !self.savepoint {
            return Ok(());
        }
        match run(self, sql).await {
            Ok(()) => {
                self.savepoint = false;
                Ok(())
            }
            Err(e) => {
                let savepoint = self.savepoint;
                self.hand_back(Ending::Failed { savepoint });
                Err(e.into())
            }
        }
    }

    /// Ends the turn (the savepoint, if any, already released) and waits for the group's
    /// commit. Also for a turn that only read: what it read may be an earlier request's
    /// uncommitted writes, which must not be answered with before they are durable.
    pub(super) async fn commit_with_group(mut self) -> Result<()> {
        let (done, committed) = oneshot::channel();
        self.hand_back(Ending::Commit(done));
        match committed.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Error::Unavailable(Box::new(GroupCommitFailed(e)))),
            Err(_) => Err(Error::Unavailable(Box::new(sqlx::Error::WorkerCrashed))),
        }
    }

    /// Ends the turn after a failed statement: the group commits at once, without this
    /// request's savepoint.
    pub(super) fn fail(mut self) {
        let savepoint = self.savepoint;
        self.hand_back(Ending::Failed { savepoint });
    }

    /// Ends the turn with the whole group rolled back: this request's writes are already
    /// part of the group's transaction and must not commit.
    pub(super) fn poison(mut self) {
        self.hand_back(Ending::Poisoned);
    }

    fn hand_back(&mut self, ending: Ending) {
        if let (Some(conn), Some(back)) = (self.conn.take(), self.back.take()) {
            // The committer is gone only when the runtime is shutting down; the connection
            // closes with it.
            let _ = back.send(Returned { conn, ending });
        }
    }
}

impl Drop for SqliteTx {
    fn drop(&mut self) {
        let savepoint = self.savepoint;
        self.hand_back(Ending::Abandoned { savepoint });
    }
}

impl Deref for SqliteTx {
    type Target = SqliteConnection;

    fn deref(&self) -> &SqliteConnection {
        self.conn
            .as_deref()
            .expect("a turn holds its connection until it ends")
    }
}

impl DerefMut for SqliteTx {
    fn deref_mut(&mut self) -> &mut SqliteConnection {
        self.conn
            .as_deref_mut()
            .expect("a turn holds its connection until it ends")
    }
}

impl fmt::Debug for SqliteTx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteTx")
            .field("savepoint", &self.savepoint)
            .finish_non_exhaustive()
    }
}
