//! `idem keys`: operators see each key's state, age, lease, fingerprint and outcome, and can
//! act on one, on every store: `idem serve`'s database and `idem proxy`'s store, Redis too.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Subcommand;
use idem_core::{
    AccountId, Clock, IdempotencyKey, KeyLimits, Record, RecordState, Scope, StoredResponse,
    SystemClock, Timestamp,
};
use idem_store::{AdminStore, PgStore, RecordFilter, RedisStore, SqliteStore};

use crate::store_url::{StoreUrl, redact};

/// `idem keys` flags.
#[derive(Debug, Clone, clap::Args)]
pub struct KeysArgs {
    /// Where the records are: `idem serve`'s database (`sqlite://PATH` or `postgres://…`) or
    /// `idem proxy`'s store, which may also be Redis (`redis://HOST:PORT`, or a Redis Cluster,
    /// `redis+cluster://HOST:PORT,HOST:PORT,…`, with --redis-prefix). Before or after the
    /// subcommand.
    #[arg(long, global = true, default_value = "sqlite://idem.db")]
    pub database: String,
    /// On Redis: the key prefix the proxy was given (its --redis-prefix).
    #[arg(long, global = true, default_value = "idem")]
    pub redis_prefix: String,
    /// What to do.
    #[command(subcommand)]
    pub action: KeysAction,
}

/// What `idem keys` does.
#[derive(Debug, Clone, Subcommand)]
pub enum KeysAction {
    /// List keys, newest first.
    ///
    /// On Redis the listing reads every record of the state asked for (of the account, if
    /// one is given) to find the newest, a page at a time, so requests go on between pages.
    List {
        /// Only this account's keys.
        #[arg(long)]
        account: Option<String>,
        /// Only keys still in progress (stuck ones have a lease in the past).
        #[arg(long, conflicts_with = "completed")]
        in_progress: bool,
        /// Only completed keys.
        #[arg(long)]
        completed: bool,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Show one key; the stored body only with --body.
    Show {
        /// The account, as `list` shows it (behind `idem proxy`, `hmac:…`, derived from the
        /// caller's credential).
        account: String,
        /// The key.
        key: String,
        /// Print the stored response body too.
        #[arg(long)]
        body: bool,
    },
    /// Delete one key's record: its next request runs afresh.
    Purge {
        /// The account, as `list` shows it (behind `idem proxy`, `hmac:…`, derived from the
        /// caller's credential).
        account: String,
        /// The key.
        key: String,
    },
    /// Complete an in-progress key with a known outcome, which its retries then replay; it is
    /// kept for the retention from now.
    Complete {
        /// The account, as `list` shows it (behind `idem proxy`, `hmac:…`, derived from the
        /// caller's credential).
        account: String,
        /// The key.
        key: String,
        /// The status to replay.
        #[arg(long)]
        status: u16,
        /// The JSON body to replay.
        #[arg(long, default_value = "")]
        body: String,
    },
}

/// Runs `idem keys`.
pub async fn run(args: KeysArgs) -> anyhow::Result<ExitCode> {
    let url = StoreUrl::parse(&args.database)?;
    // Opening a file that is not there would create an empty database and list no keys: a
    // wrong directory would pass for "nothing stuck".
    if let Some(file) = url.sqlite_file() {
        anyhow::ensure!(
            file.exists(),
            "no database at {} (idem serve creates it on first start); give --database sqlite://PATH",
            file.display()
        );
    }
    match url {
        StoreUrl::Sqlite(url) => {
            let store = SqliteStore::connect(&url)
                .await
                .with_context(|| format!("cannot open {url}"))?;
            act(&store, args.action).await
        }
        StoreUrl::Postgres(url) => {
            let store = PgStore::connect(&url)
                .await
                .with_context(|| format!("cannot open {}", redact(&url)))?;
            act(&store, args.action).await
        }
        StoreUrl::Redis(url) => {
            let store = RedisStore::connect(&url, args.redis_prefix)
                .await
                .with_context(|| format!("cannot open {}", redact(&url)))?;
            act(&store, args.action).await
        }
    }
}

fn scope(account: &str, key: &str) -> anyhow::Result<Scope> {
    let limits = KeyLimits {
        min_len: 1,
        max_len: usize::MAX,
    };
    // Either form the API accepts: `order-1042` or the sf-string `"order-1042"`.
    let key = IdempotencyKey::parse(key.as_bytes(), limits).context("not a valid key")?;
    Ok(Scope::new(AccountId::new(account), key))
}

async fn act<S: AdminStore>(store: &S, action: KeysAction) -> anyhow::Result<ExitCode> {
    let now = SystemClock.now();
    match action {
        KeysAction::List {
            account,
            in_progress,
            completed,
            limit,
        } => {
            let filter = RecordFilter {
                account: account.map(AccountId::new),
                in_progress: match (in_progress, completed) {
                    (true, _) => Some(true),
                    (_, true) => Some(false),
                    _ => None,
                },
                lease_expired_by: None,
                limit,
            };
            list(store, &filter, now).await
        }
        KeysAction::Show { account, key, body } => show(store, &account, &key, body, now).await,
        KeysAction::Purge { account, key } => purge(store, &account, &key).await,
        KeysAction::Complete {
            account,
            key,
            status,
            body,
        } => complete(store, &account, &key, status, body, now).await,
    }
}

/// `idem keys list`: one line per record, a long key wrapped in its column.
async fn list<S: AdminStore>(
    store: &S,
    filter: &RecordFilter,
    now: Timestamp,
) -> anyhow::Result<ExitCode> {
    let records = store.list(filter, now).await?;
    println!(
        "{:<20} {:<KEY_COLUMN$} {:<12} {:>8} {:<14} {:<16} OUTCOME",
        "ACCOUNT", "KEY", "STATE", "AGE", "LEASE", "FINGERPRINT"
    );
    for record in &records {
        let (state, lease, outcome) = describe(record, now);
        // A key longer than its column (up to 255 characters) wraps onto lines of its
        // own below, so the other columns stay aligned.
        let mut key = wrapped(record.scope.key.as_str(), KEY_COLUMN);
        println!(
            "{:<20} {:<KEY_COLUMN$} {:<12} {:>8} {:<14} {:<16} {}",
            record.scope.account.as_str(),
            key.next().unwrap_or_default(),
            state,
            age(record.created_at, now),
            lease,
            &record.fingerprint.to_string()[..16],
            outcome
        );
        for rest in key {
            println!("{:<20} {rest}", "");
        }
    }
    println!("{} keys", records.len());
    Ok(ExitCode::SUCCESS)
}

/// `idem keys show`: every field of one record; its stored body only with `--body`.
async fn show<S: AdminStore>(
    store: &S,
    account: &str,
    key: &str,
    body: bool,
    now: Timestamp,
) -> anyhow::Result<ExitCode> {
    let scope = scope(account, key)?;
    let Some(record) = store.get(&scope, now).await? else {
        eprintln!("no record for key {key:?} of account {account:?}");
        return Ok(ExitCode::from(1));
    };
    let (state, lease, outcome) = describe(&record, now);
    println!("account      {}", record.scope.account.as_str());
    println!("key          {}", record.scope.key.as_str());
    println!("state        {state}");
    println!("age          {}", age(record.created_at, now));
    match record.state {
        // An unknown outcome is kept until it is resolved; its retention counts from then.
        RecordState::InProgress { .. } => println!("expires in   never while in progress"),
        RecordState::Completed(_) => println!("expires in   {}", age(now, record.expires_at)),
    }
    println!("lease        {lease}");
    println!("fingerprint  {}", record.fingerprint);
    println!("outcome      {outcome}");
    if let RecordState::Completed(response) = &record.state {
        for (name, value) in &response.headers {
            println!("header       {name}: {value}");
        }
        if body {
            println!("body         {}", String::from_utf8_lossy(&response.body));
        } else {
            println!(
                "body         ({} bytes; --body to show)",
                response.body.len()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `idem keys purge`: deletes one record, 1 if there was none.
async fn purge<S: AdminStore>(store: &S, account: &str, key: &str) -> anyhow::Result<ExitCode> {
    if store.purge(&scope(account, key)?).await? {
        println!("purged key {key:?} of account {account:?}");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("no record for key {key:?} of account {account:?}");
        Ok(ExitCode::from(1))
    }
}

/// `idem keys complete`: stores `status` and `body` as an in-progress key's outcome, 1 if the
/// key is not in progress.
async fn complete<S: AdminStore>(
    store: &S,
    account: &str,
    key: &str,
    status: u16,
    body: String,
    now: Timestamp,
) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(
        (100..600).contains(&status),
        "--status must be an HTTP status"
    );
    let response = StoredResponse {
        status,
        headers: if body.is_empty() {
            vec![]
        } else {
            vec![("content-type".into(), "application/json".into())]
        },
        body: body.into_bytes(),
        body_omitted: false,
    };
    if store
        .force_complete(&scope(account, key)?, &response, now)
        .await?
    {
        println!("completed key {key:?} of account {account:?} with {status}");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("key {key:?} of account {account:?} is not in progress");
        Ok(ExitCode::from(1))
    }
}

/// The width of `idem keys list`'s KEY column.
const KEY_COLUMN: usize = 36;

/// `key` in pieces of at most `width` characters (keys are visible ASCII, one byte each).
fn wrapped(key: &str, width: usize) -> impl Iterator<Item = &str> {
    key.as_bytes()
        .chunks(width)
        .map(|piece| std::str::from_utf8(piece).expect("keys are ASCII"))
}

fn describe(record: &Record, now: Timestamp) -> (&'static str, String, String) {
    match &record.state {
        RecordState::InProgress { lease_until, token } => {
            let lease = if *lease_until > now {
                format!("{} left", age(now, *lease_until).trim_start_matches('-'))
            } else {
                format!("ran out {} ago", age(*lease_until, now))
            };
            let state = if *lease_until > now {
                "in_progress"
            } else {
                "stale"
            };
            (state, lease, format!("unknown (token {})", token.0))
        }
        RecordState::Completed(response) => (
            "completed",
            "-".into(),
            format!(
                "{}{}",
                response.status,
                if response.body_omitted {
                    " (body omitted)"
                } else {
                    ""
                }
            ),
        ),
    }
}

/// A short human duration from `from` to `to`.
fn age(from: Timestamp, to: Timestamp) -> String {
    let secs = (to.0 - from.0) / 1000;
    let sign = if secs < 0 { "-" } else { "" };
    let secs = secs.abs();
    match secs {
        0..60 => format!("{sign}{secs}s"),
        60..3600 => format!("{sign}{}m{}s", secs / 60, secs % 60),
        3600..86400 => format!("{sign}{}h{}m", secs / 3600, secs % 3600 / 60),
        _ => format!("{sign}{}d{}h", secs / 86400, secs % 86400 / 3600),
    }
}
