//! Beyond one process: `idem serve` instances sharing one PostgreSQL database, and the gateway
//! on one Redis against a Redis Cluster of three primaries (docs/scaling.md).
//!
//! Every instance is a server of its own with a pool of its own, as separate processes would
//! be, but they run in the bench's process on the same cores: on a machine of two cores more
//! instances cannot add CPU, so these rows show what more instances and more primaries cost or
//! give when the cores are shared, not how far they scale on more machines.

use super::{Comparison, Env, Prepared, StoreUrl, ready, redis_up, servers};
use crate::servers::payment_post;

/// `idem serve` instances on one database, each row against one instance.
pub(super) const SCALE_POSTGRES: &[Comparison] = &[
    Comparison::new(
        "scale-serve-2",
        "2 idem serve instances, one PostgreSQL",
        "serve-1",
        "serve-2",
        None,
    ),
    Comparison::new(
        "scale-serve-4",
        "4 idem serve instances, one PostgreSQL",
        "serve-1",
        "serve-4",
        None,
    ),
];

/// The gateway on a Redis Cluster against one Redis.
pub(super) const SCALE_REDIS: &[Comparison] = &[Comparison::new(
    "scale-redis-cluster",
    "gateway, 3 Redis primaries vs 1",
    "redis-1",
    "redis-3",
    None,
)];

/// 1, 2 and 4 `idem serve` instances on one throwaway database; the load is spread over the
/// instances' URLs, connection by connection.
pub(super) async fn scale_postgres(env: &Env) -> anyhow::Result<Prepared> {
    super::postgres_up().await?;
    let db = idem_testkit::postgres::PgTestDatabase::create().await;
    let mut prepared = Prepared::default();
    let mut urls = Vec::new();
    for _ in 0..4 {
        let instance = servers::idem_serve(
            &env.runtimes.subject,
            db.url(),
            idem_store::DEFAULT_POOL_SIZE,
        )
        .await?;
        urls.push(instance.url("/payments"));
        prepared.teardown.servers.push(instance);
    }
    for (id, n) in [("serve-1", 1), ("serve-2", 2), ("serve-4", 4)] {
        let mut target = payment_post(&urls[0]);
        target.more_uris = urls[1..n]
            .iter()
            .map(|url| url.parse().expect("a server's URL"))
            .collect();
        let label = match n {
            1 => "1 idem serve instance".to_owned(),
            n => format!("{n} idem serve instances"),
        };
        prepared.variants.push(ready(id, label, target));
    }
    prepared.teardown.keep(db);
    Ok(prepared)
}

/// `idem proxy` in front of one upstream, on the Redis server of the settings and on a
/// throwaway Redis Cluster of three primaries (no replicas), started here from the machine's
/// `redis-server`.
pub(super) async fn scale_redis(env: &Env) -> anyhow::Result<Prepared> {
    let single = env.settings.redis_url.clone();
    redis_up(&single).await?;
    let mut prepared = Prepared::default();
    prepared.teardown.clean_up_redis(env);
    let upstream = servers::upstream(&env.runtimes.upstream).await?;
    let prefix = format!("idem-bench:{}:scale", env.tag);
    let one = servers::gateway(
        &env.runtimes.subject,
        StoreUrl::Redis(single, prefix.clone()),
        &upstream.url(""),
    )
    .await?;
    prepared.variants.push(ready(
        "redis-1",
        "idem proxy, 1 Redis",
        payment_post(&one.url("/payments")),
    ));
    prepared.teardown.servers.push(one);
    let cluster = tokio::task::spawn_blocking(|| {
        std::panic::catch_unwind(|| idem_testkit::redis_cluster::RedisCluster::start(3, 0))
    })
    .await?;
    let three = match cluster {
        Ok(cluster) => {
            let store = StoreUrl::Redis(cluster.url(), prefix);
            let proxy = servers::gateway(&env.runtimes.subject, store, &upstream.url("")).await?;
            let target = payment_post(&proxy.url("/payments"));
            prepared.teardown.servers.push(proxy);
            prepared.teardown.keep(cluster);
            Ok(super::Variant::http(
                "redis-3",
                "idem proxy, Redis Cluster of 3 primaries",
                target,
            ))
        }
        Err(_) => Err("no Redis Cluster could be started (redis-server and redis-cli)".to_owned()),
    };
    prepared.variants.push(("redis-3", three));
    prepared.teardown.servers.push(upstream);
    Ok(prepared)
}
