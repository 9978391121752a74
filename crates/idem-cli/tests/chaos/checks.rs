//! The checker: the contract asserted from the log and the database once the chaos is over.

use super::*;

/// The checker's findings.
#[derive(Debug, Default)]
pub(crate) struct Findings {
    pub(crate) failures: Vec<String>,
    pub(crate) duplicates: usize,
    pub(crate) lost_acks: HashSet<u32>,
}

impl Findings {
    pub(crate) fn fail(&mut self, what: String) {
        self.failures.push(what);
    }
}

impl Attempt {
    /// The id of the payment the answer is about.
    pub(crate) fn id(&self) -> Option<String> {
        let body: serde_json::Value = serde_json::from_slice(&self.raw).ok()?;
        body["id"].as_str().map(str::to_owned)
    }
}

/// The payments in the database, by key.
pub(crate) async fn payments_by_key(
    db: &mut PgConnection,
) -> (HashMap<String, Vec<String>>, usize) {
    let rows: Vec<(Option<String>, String)> =
        sqlx::query_as("SELECT idem_key, id FROM payments ORDER BY created_at")
            .fetch_all(&mut *db)
            .await
            .expect("read the payments");
    let total = rows.len();
    let mut by_key: HashMap<String, Vec<String>> = HashMap::new();
    for (key, id) in rows {
        by_key
            .entry(key.unwrap_or_else(|| "<no key>".into()))
            .or_default()
            .push(id);
    }
    (by_key, total)
}

pub(crate) async fn count(db: &mut PgConnection, sql: &'static str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&mut *db)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
}

/// The checks on the log and the database, after the chaos and the settling.
pub(crate) async fn check(load: &Load, cluster: &Cluster, findings: &mut Findings) -> Vec<Attempt> {
    let during = load.journal.attempts();
    let answered = check_answers(load, &during, findings);
    let mut db = PgConnection::connect(&cluster.url)
        .await
        .expect("connect to the cluster");
    check_database(load, &mut db, &answered, findings).await;
    check_in_progress(&mut db, cluster, findings).await;
    let finals = check_final_replays(load, &mut db, &answered, findings).await;
    check_no_idle_transaction(&mut db, findings).await;
    db.close().await.expect("close");
    finals
}

/// What the run's answers say, for the checks of the database after them.
struct Answered<'a> {
    /// The keys sent.
    keys: BTreeMap<u32, ()>,
    /// Each acknowledged key's first acknowledgement.
    acked: BTreeMap<u32, &'a Attempt>,
}

/// The answers during the run: none outside the contract, every copy its `201`, one fresh
/// `201` per key, every `2xx` of a key the same bytes.
fn check_answers<'a>(load: &Load, during: &'a [Attempt], findings: &mut Findings) -> Answered<'a> {
    // No answer outside the contract, at any time.
    let bad: Vec<&Attempt> = during.iter().filter(|a| !a.allowed()).collect();
    if !bad.is_empty() {
        findings.fail(format!(
            "{} answers outside the contract ({:?}); the first ones:\n{}",
            bad.len(),
            tally(bad.iter().copied()),
            bad.iter()
                .take(5)
                .map(|a| format!("  {a:?}"))
                .collect::<Vec<_>>()
                .join("\n")
        ));
    }

    // Every copy got its 201, and every 2xx of a key carried the same bytes.
    let mut copies: HashSet<(u32, u8)> = HashSet::new();
    let mut created: HashSet<(u32, u8)> = HashSet::new();
    let mut acked: BTreeMap<u32, &Attempt> = BTreeMap::new();
    for a in during {
        copies.insert((a.key, a.copy));
        if a.created() && a.via == Via::Http {
            created.insert((a.key, a.copy));
        }
        if a.acknowledged() {
            let first = acked.entry(a.key).or_insert(a);
            if first.raw != a.raw {
                findings.lost_acks.insert(a.key);
                findings.fail(format!(
                    "key {} acknowledged with different bodies: {:?} then {:?}",
                    load.key_name(a.key),
                    first.body,
                    a.body
                ));
            }
        }
    }
    // A fresh 201 is the answer of the request that paid: two for one key are two payments
    // (or one answered twice), whatever the database says now.
    let mut fresh: BTreeMap<u32, usize> = BTreeMap::new();
    for a in during.iter().filter(|a| a.created() && !a.replayed) {
        *fresh.entry(a.key).or_default() += 1;
    }
    let twice: Vec<String> = fresh
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(key, n)| format!("{} ({n})", load.key_name(*key)))
        .collect();
    if !twice.is_empty() {
        findings.fail(format!("keys with more than one fresh 201: {twice:?}"));
    }
    let unfinished: Vec<_> = copies.difference(&created).collect();
    if !unfinished.is_empty() {
        findings.fail(format!(
            "{} copies got no 201 within {SETTLE:?} after the chaos, such as {:?}",
            unfinished.len(),
            &unfinished[..unfinished.len().min(5)]
        ));
    }
    let keys: BTreeMap<u32, ()> = copies.iter().map(|(k, _)| (*k, ())).collect();
    Answered { keys, acked }
}

/// The database as the chaos left it.
async fn check_database(
    load: &Load,
    db: &mut PgConnection,
    Answered { keys, acked }: &Answered<'_>,
    findings: &mut Findings,
) {
    // The database as the chaos left it: at most one payment per key, the acknowledged one.
    let (stored, _) = payments_by_key(db).await;
    for (key, ids) in &stored {
        if ids.len() > 1 {
            findings.duplicates += ids.len() - 1;
            findings.fail(format!("key {key} has {} payments: {ids:?}", ids.len()));
        }
    }
    let sent: HashSet<String> = keys.keys().map(|k| load.key_name(*k)).collect();
    let strangers: Vec<&String> = stored.keys().filter(|k| !sent.contains(*k)).collect();
    if !strangers.is_empty() {
        findings.fail(format!("payments for keys never sent: {strangers:?}"));
    }
    for (key, ack) in acked {
        let ids = stored
            .get(&load.key_name(*key))
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        if ids.len() != 1 || ack.id().as_deref() != Some(ids[0].as_str()) {
            findings.lost_acks.insert(*key);
            findings.fail(format!(
                "key {} was acknowledged with {:?} but the database holds {ids:?}",
                load.key_name(*key),
                ack.body
            ));
        }
    }
}

/// No key in progress after one sweep.
async fn check_in_progress(db: &mut PgConnection, cluster: &Cluster, findings: &mut Findings) {
    // One sweep (it deletes nothing within the retention), then no key in progress. In
    // transaction mode a claim commits together with its outcome, so a committed in-progress
    // row is a bug at once; there is no lease to wait out.
    let store = PgStore::connect(&cluster.url).await.expect("a store");
    store
        .sweep(SystemClock.now(), 1000)
        .await
        .expect("one sweep");
    store.pool().close().await;
    let in_progress = count(
        db,
        "SELECT count(*) FROM idempotency_keys WHERE status = 'in_progress'",
    )
    .await;
    if in_progress != 0 {
        findings.fail(format!("{in_progress} keys left in progress"));
    }
}

/// Every key replayed once more after the run, and the database's figures after that.
async fn check_final_replays(
    load: &Load,
    db: &mut PgConnection,
    Answered { keys, acked }: &Answered<'_>,
    findings: &mut Findings,
) -> Vec<Attempt> {
    // Every key once more, through both instances: the acknowledged ones must replay byte for
    // byte; the others (none, if every copy finished) may pay now, once.
    let finals: Vec<Attempt> = futures_util::stream::iter(keys.keys().copied())
        .map(|key| final_replay(load, key))
        .buffer_unordered(32)
        .collect()
        .await;
    for replay in &finals {
        match acked.get(&replay.key) {
            _ if !replay.created() => findings.fail(format!(
                "the final replay of key {} got {:?}",
                load.key_name(replay.key),
                replay
            )),
            Some(ack) if !replay.replayed || replay.raw != ack.raw => {
                findings.lost_acks.insert(replay.key);
                findings.fail(format!(
                    "key {} acknowledged with {:?} at {:.0} ms; the final replay got {} {:?}",
                    load.key_name(replay.key),
                    ack.body,
                    ack.done_ms,
                    replay.label(),
                    replay.body
                ));
            }
            _ => {}
        }
    }
    let (after, total) = payments_by_key(db).await;
    if after.len() != keys.len() || total != keys.len() {
        findings.fail(format!(
            "after the final replays: {total} payments for {} keys, {} keys sent",
            after.len(),
            keys.len()
        ));
    }
    let completed = count(
        db,
        "SELECT count(*) FROM idempotency_keys WHERE status = 'completed'",
    )
    .await;
    if completed as usize != keys.len() {
        findings.fail(format!(
            "{completed} completed key rows for {} keys",
            keys.len()
        ));
    }

    finals
}

/// No session left inside a transaction once the services settle.
async fn check_no_idle_transaction(db: &mut PgConnection, findings: &mut Findings) {
    // No session left inside a transaction once the services settle. A request's transaction
    // shows as idle in transaction between its statements; none runs now, so a few seconds
    // are a generous margin.
    let settle_by = Instant::now() + Duration::from_secs(10);
    loop {
        let idle: Vec<(i32, String, String, String)> = sqlx::query_as(
            "SELECT pid, state, coalesce(application_name, ''), query FROM pg_stat_activity
             WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()",
        )
        .fetch_all(&mut *db)
        .await
        .expect("read pg_stat_activity");
        if idle.is_empty() {
            break;
        }
        if Instant::now() >= settle_by {
            findings.fail(format!("sessions left idle in a transaction: {idle:?}"));
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the instances' logs say that no client could see: a `500` written to a socket a cut
/// had closed shows there only. `safety_net=true` is the payments table's unique index
/// stopping a second payment the idempotency layer let through.
pub(crate) fn scan_instance_logs(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let logs = std::fs::read_dir(dir).expect("read the run's directory");
    for entry in logs {
        let path = entry.expect("a directory entry").path();
        if !path.to_string_lossy().ends_with(".log") || path.ends_with("postgres.log") {
            continue;
        }
        let log = without_colours(&std::fs::read_to_string(&path).expect("read a log"));
        for line in log.lines() {
            if line.contains("safety_net=true") || line.contains("panicked") {
                found.push(format!("{}: {line}", path.display()));
            }
        }
    }
    found
}

/// `text` without ANSI colour sequences (`ESC [ … m`), which split `field=value` in tracing's
/// coloured output.
pub(crate) fn without_colours(text: &str) -> String {
    let mut plain = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            // Up to and including the sequence's final letter.
            chars.by_ref().find(char::is_ascii_alphabetic);
        } else {
            plain.push(c);
        }
    }
    plain
}

/// The checker's replay of `key`, retried briefly should an instance still be reconnecting
/// to the restarted database.
pub(crate) async fn final_replay(load: &Load, key: u32) -> Attempt {
    let slot = (key % 2) as usize;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let route = load
            .fleet
            .get(slot)
            .expect("both instances run after the chaos");
        let seen = load.send(key, 0, attempt, Via::Final, &route).await;
        if seen.created() || attempt >= 5 || !seen.allowed() {
            return seen;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
