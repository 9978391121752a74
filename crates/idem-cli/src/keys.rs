//! `idem keys`: operators see each key's state, age, lease, fingerprint and outcome, and can
//! act on one, on every store: `idem serve`'s database and `idem proxy`'s store, Redis too.

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Subcommand;
use idem_core::{
    AccountId, Clock, Record, RecordEvent, RecordState, Scope, SystemClock, Timestamp,
};
use idem_gateway::Secret;
use idem_store::{AdminStore, PgStore, RecordFilter, RedisStore, SharedSecret, SqliteStore};

use crate::admin::{self, KeyState, Resolution, ResolveError, Resolved};
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
    /// A gateway caller's credential, as it sends it in the Authorization header (`Bearer
    /// sk_…`): its keys are found under the account `idem proxy` derives from it, in place of
    /// an ACCOUNT (or --account). Only for a proxy that scopes by that header alone (no
    /// --scope-header, no cookie credential).
    #[arg(long, global = true, value_name = "VALUE")]
    pub credential: Option<String>,
    /// With --credential: the proxy's secret (its --secret; also read from IDEM_PROXY_SECRET).
    /// Without it, the secret the proxies keep in the store.
    #[arg(long, global = true, env = "IDEM_PROXY_SECRET", hide_env_values = true)]
    pub secret: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub action: KeysAction,
}

/// One record, named on the command line: `ACCOUNT KEY`, or `KEY` alone with --credential.
#[derive(Debug, Clone, clap::Args)]
pub struct KeyArgs {
    /// The account, as `list` shows it (behind `idem proxy`, `hmac:…`, derived from the
    /// caller's credential); with --credential, leave it out and give the key alone.
    #[arg(value_name = "ACCOUNT")]
    account: String,
    /// The key.
    #[arg(value_name = "KEY")]
    key: Option<String>,
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
        /// Only keys in this state: `in-progress` (every key in progress, those of unknown
        /// outcome included), `unknown` (in progress, the lease run out: its worker crashed or
        /// stalled) or `completed`.
        #[arg(long, value_enum)]
        state: Option<KeyState>,
        /// The same as --state in-progress.
        #[arg(long, conflicts_with_all = ["completed", "state"])]
        in_progress: bool,
        /// The same as --state completed.
        #[arg(long, conflicts_with = "state")]
        completed: bool,
        /// At most this many.
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Show one key; the stored body only with --body.
    Show {
        /// The record.
        #[command(flatten)]
        record: KeyArgs,
        /// Print the stored response body too.
        #[arg(long)]
        body: bool,
    },
    /// Delete one key's record, whatever its state: its next request runs afresh.
    Purge {
        /// The record.
        #[command(flatten)]
        record: KeyArgs,
    },
    /// Resolve a key in progress or of unknown outcome: complete it with a known answer,
    /// which its retries then replay (kept for the retention from now), or release it with
    /// --release, so its next copy runs. A completed key is refused.
    #[command(visible_alias = "complete")]
    Resolve {
        /// The record.
        #[command(flatten)]
        record: KeyArgs,
        /// The status to replay.
        #[arg(long, required_unless_present = "release")]
        status: Option<u16>,
        /// A header to replay, `Name: value`; repeatable.
        #[arg(long = "header", value_name = "NAME: VALUE", value_parser = admin::parse_header)]
        headers: Vec<(String, String)>,
        /// The body to replay: JSON, unless a Content-Type header says otherwise.
        #[arg(long, default_value = "")]
        body: String,
        /// Delete the in-progress record instead, so the key's next copy runs: for work known
        /// not to have happened.
        #[arg(long, conflicts_with_all = ["status", "headers", "body"])]
        release: bool,
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
            act(&store, args).await
        }
        StoreUrl::Postgres(url) => {
            let store = PgStore::connect(&url)
                .await
                .with_context(|| format!("cannot open {}", redact(&url)))?;
            act(&store, args).await
        }
        StoreUrl::Redis(url) => {
            let store = RedisStore::connect(&url, args.redis_prefix.clone())
                .await
                .with_context(|| format!("cannot open {}", redact(&url)))?;
            act(&store, args).await
        }
    }
}

/// The account `--credential` names: derived as `idem proxy` derives it, with `--secret` or
/// the secret the proxies keep in `store`.
async fn credential_account<S: SharedSecret>(
    store: &S,
    credential: &str,
    secret: Option<&str>,
) -> anyhow::Result<AccountId> {
    let secret = match secret {
        Some(given) => Secret::new(given.as_bytes()).context("--secret")?,
        None => Secret::stored(store)
            .await
            .context("cannot read the proxies' secret from the store")?
            .context(
                "the store holds no proxy secret (no `idem proxy` without --secret has run on \
                 it): give the proxy's --secret",
            )?,
    };
    Ok(secret.header_credential_account(credential.as_bytes()))
}

/// The account and key `record` names, the account from `--credential` when it is given.
async fn named<S: SharedSecret>(
    store: &S,
    args: &KeysArgs,
    record: KeyArgs,
) -> anyhow::Result<(String, String)> {
    match (&args.credential, record.key) {
        (Some(credential), None) => {
            let account = credential_account(store, credential, args.secret.as_deref()).await?;
            Ok((account.as_str().to_owned(), record.account))
        }
        (None, Some(key)) => Ok((record.account, key)),
        (Some(_), Some(_)) => {
            anyhow::bail!("with --credential, give the KEY alone: the credential names the account")
        }
        (None, None) => anyhow::bail!("give ACCOUNT KEY, or KEY with --credential"),
    }
}

fn scope(account: &str, key: &str) -> anyhow::Result<Scope> {
    admin::scope(account, key).context("not a valid key")
}

async fn act<S: AdminStore + SharedSecret>(store: &S, args: KeysArgs) -> anyhow::Result<ExitCode> {
    let now = SystemClock.now();
    match args.action.clone() {
        KeysAction::List {
            account,
            state,
            in_progress,
            completed,
            limit,
        } => {
            let account = match (account, &args.credential) {
                (Some(_), Some(_)) => anyhow::bail!("give --account or --credential, not both"),
                (Some(account), None) => Some(AccountId::new(account)),
                (None, Some(credential)) => {
                    Some(credential_account(store, credential, args.secret.as_deref()).await?)
                }
                (None, None) => None,
            };
            let state = match (state, in_progress, completed) {
                (Some(state), _, _) => Some(state),
                (None, true, _) => Some(KeyState::InProgress),
                (None, _, true) => Some(KeyState::Completed),
                (None, false, false) => None,
            };
            list(store, &admin::filter(state, account, limit, now), now).await
        }
        KeysAction::Show { record, body } => {
            let (account, key) = named(store, &args, record).await?;
            show(store, &account, &key, body, now).await
        }
        KeysAction::Purge { record } => {
            let (account, key) = named(store, &args, record).await?;
            purge(store, &account, &key).await
        }
        KeysAction::Resolve {
            record,
            status,
            headers,
            body,
            release,
        } => {
            let (account, key) = named(store, &args, record).await?;
            let resolution = match status {
                Some(status) if !release => {
                    Resolution::complete(status, headers, body.into_bytes())?
                }
                _ => Resolution::Release,
            };
            resolve(store, &account, &key, &resolution, now).await
        }
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
    let events = store.events(&scope).await?;
    let Some(record) = store.get(&scope, now).await? else {
        eprintln!("no record for key {key:?} of account {account:?}");
        // A released key's history outlives its record.
        print_history(&events, now);
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
    print_history(&events, now);
    Ok(ExitCode::SUCCESS)
}

/// The key's history as the store keeps it, oldest first: one `history` line per event, with
/// how long ago (by this machine's clock; the event's time is its writer's) and who.
fn print_history(events: &[RecordEvent], now: Timestamp) {
    for event in events {
        println!(
            "history      {} ago: {}, by {} (at {} ms)",
            age(event.at, now),
            event.what,
            event.by,
            event.at.0
        );
    }
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

/// `idem keys resolve` (and its alias `complete`): completes or releases an in-progress key,
/// 1 if it is not in progress.
async fn resolve<S: AdminStore>(
    store: &S,
    account: &str,
    key: &str,
    resolution: &Resolution,
    now: Timestamp,
) -> anyhow::Result<ExitCode> {
    let scope = scope(account, key)?;
    match admin::resolve(store, &scope, resolution, now, admin::BY_CLI).await {
        Ok(Resolved::Completed) => {
            let Resolution::Complete(response) = resolution else {
                unreachable!("only a completion completes")
            };
            println!(
                "completed key {key:?} of account {account:?} with {}",
                response.status
            );
            Ok(ExitCode::SUCCESS)
        }
        Ok(Resolved::Released) => {
            println!("released key {key:?} of account {account:?}: its next copy runs");
            Ok(ExitCode::SUCCESS)
        }
        Err(ResolveError::NoRecord) => {
            eprintln!("no record for key {key:?} of account {account:?}");
            Ok(ExitCode::from(1))
        }
        Err(ResolveError::Completed) => {
            eprintln!(
                "key {key:?} of account {account:?} is not in progress: it is completed, and \
                 its answer is replayed (purge deletes it)"
            );
            Ok(ExitCode::from(1))
        }
        Err(e @ ResolveError::Changed) => {
            eprintln!("key {key:?} of account {account:?}: {e}");
            Ok(ExitCode::from(1))
        }
        Err(e) => Err(e.into()),
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
            let state = KeyState::of(record, now).name();
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
