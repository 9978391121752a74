//! The small worlds that are checked.

use std::time::Duration;

use idem_core::Policy;

/// The request bodies clients send, all `POST /payouts` under one key. The first two are the
/// same request written two ways (their fingerprints are equal: canonical JSON); the third is a
/// different request reusing the key.
pub const BODIES: [&str; 3] = [
    r#"{"amount":100,"currency":"EUR"}"#,
    r#"{ "currency": "EUR", "amount": 100 }"#,
    r#"{"amount":250,"currency":"EUR"}"#,
];

/// How the layer makes the claim and the work atomic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `IdempotencyLayer::transactional`: the key row and the business write commit together.
    Transaction,
    /// `IdempotencyLayer::leased`.
    Lease {
        /// Takes over a claim whose lease ran out (`leased`), or never does
        /// (`without_takeover`).
        takeover: bool,
        /// A reconciler resolves stale records (`with_reconciliation`).
        reconciler: bool,
    },
}

/// How the downstream system the work calls treats a repeated key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Downstream {
    /// It dedupes by key: a second call with the key answers the first call's charge. It may
    /// act on a call any time, even after its caller gave up.
    Dedupe,
    /// Every call it acts on is a new charge. As the contract requires of such a system, it
    /// never acts on a call after its caller's timeout.
    NoDedupe,
}

/// A client: which body it sends, and how many attempts it makes at most.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientSpec {
    /// An index into [`BODIES`].
    pub body: u8,
    /// Its attempts.
    pub attempts: u8,
}

impl ClientSpec {
    /// A client sending `body` up to `attempts` times.
    pub const fn new(body: u8, attempts: u8) -> Self {
        Self { body, attempts }
    }
}

/// Which faults may be injected, and how many in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Faults {
    /// How many faults one run may have, of any kinds below (crashes, lost answers, ...).
    pub budget: u8,
    /// An instance stalls mid-section, so its lease runs out while it still works (a GC pause,
    /// a frozen VM). Left out where the contract's promise rests on live instances renewing in
    /// time.
    pub stalls: bool,
}

/// One configuration: a small world and the promises checked in it.
#[derive(Clone, Debug)]
pub struct Config {
    /// Its name on the command line.
    pub name: &'static str,
    /// One line on what it is.
    pub summary: &'static str,
    /// The mode.
    pub mode: Mode,
    /// The downstream (lease mode).
    pub downstream: Downstream,
    /// The clients (at most three), all with the same key.
    pub clients: Vec<ClientSpec>,
    /// Faults.
    pub faults: Faults,
    /// The layer reads the record before claiming (SQL stores; off for Redis).
    pub replay_read: bool,
    /// Lease (whole seconds), downstream timeout and retention: the policy.
    pub lease: u8,
    /// `Policy::downstream_timeout`, in seconds.
    pub downstream_timeout: u8,
    /// `Policy::retention`, in seconds.
    pub retention: u8,
    /// Clients send and faults happen only before this second; afterwards time runs on only
    /// while a lease or a call is pending, so every run ends.
    pub active_until: u8,
    /// No run goes past this second (the property "horizon" checks it was never needed).
    pub horizon: u8,
}

impl Config {
    /// The policy the layer runs with: idem-core's own `Policy`, whose `lease_hold` and
    /// retention the model uses for every lease and expiry.
    pub fn policy(&self) -> Policy {
        Policy {
            lease: Duration::from_secs(self.lease.into()),
            downstream_timeout: Duration::from_secs(self.downstream_timeout.into()),
            retention: Duration::from_secs(self.retention.into()),
            ..Policy::default()
        }
    }

    /// Whether a claim whose lease ran out is taken over.
    pub fn takeover(&self) -> bool {
        matches!(self.mode, Mode::Lease { takeover: true, .. })
    }

    /// Whether a reconciler runs.
    pub fn reconciler(&self) -> bool {
        matches!(
            self.mode,
            Mode::Lease {
                reconciler: true,
                ..
            }
        )
    }

    /// The configurations `check` runs, each where the contract promises what it checks.
    pub fn all() -> Vec<Config> {
        vec![
            Self::transaction(),
            Self::lease_takeover_dedupe(),
            Self::lease_reconciler(),
            Self::lease_reconciler_mismatch(),
            Self::lease_reconciler_dedupe(),
        ]
    }

    /// Smaller worlds of the same kinds, for the debug-build tests: at most two clients, the
    /// second sending once, and one fault.
    pub fn small() -> Vec<Config> {
        Self::all().into_iter().map(Config::shrunk).collect()
    }

    /// This world with at most two clients (two attempts, then one) and one fault.
    pub fn shrunk(mut self) -> Config {
        self.clients.truncate(2);
        for (client, most) in self.clients.iter_mut().zip([2, 1]) {
            client.attempts = client.attempts.min(most);
        }
        self.faults.budget = self.faults.budget.min(1);
        self
    }

    /// A configuration by name, among [`Config::all`] and the extra ones.
    pub fn by_name(name: &str) -> Option<Config> {
        Self::all()
            .into_iter()
            .chain(Self::extra())
            .find(|c| c.name == name)
    }

    /// Configurations outside the contract's promises, run only by name: they show where a
    /// promise stops.
    pub fn extra() -> Vec<Config> {
        vec![
            Self::lease_reconciler_stalls(),
            Self::key_reuse_after_retention(),
        ]
    }

    /// Transaction mode: two instances, a client retrying its intent, a second client reusing
    /// the key for another request.
    pub fn transaction() -> Config {
        Config {
            name: "transaction",
            summary: "transaction mode; one intent sent as two bodies, another request reusing the key",
            mode: Mode::Transaction,
            downstream: Downstream::NoDedupe,
            clients: vec![
                ClientSpec::new(0, 3),
                ClientSpec::new(1, 2),
                ClientSpec::new(2, 2),
            ],
            faults: Faults {
                budget: 3,
                stalls: false,
            },
            replay_read: true,
            lease: 2,
            downstream_timeout: 1,
            retention: 3,
            active_until: 5,
            horizon: 9,
        }
    }

    /// Lease mode with takeover over a downstream that dedupes by key, instances that may stall.
    pub fn lease_takeover_dedupe() -> Config {
        Config {
            name: "lease-takeover-dedupe",
            summary: "lease mode with takeover, deduping downstream, stalls; one intent sent as two bodies",
            mode: Mode::Lease {
                takeover: true,
                reconciler: false,
            },
            downstream: Downstream::Dedupe,
            clients: vec![ClientSpec::new(0, 3), ClientSpec::new(1, 2)],
            faults: Faults {
                budget: 2,
                stalls: true,
            },
            replay_read: true,
            lease: 1,
            downstream_timeout: 2,
            retention: 5,
            active_until: 7,
            horizon: 14,
        }
    }

    /// Lease mode without takeover, with the reconciler, over a downstream that does not dedupe.
    pub fn lease_reconciler() -> Config {
        Config {
            name: "lease-reconciler",
            summary: "lease mode without takeover, reconciler, non-deduping downstream; one intent sent as two bodies",
            mode: Mode::Lease {
                takeover: false,
                reconciler: true,
            },
            downstream: Downstream::NoDedupe,
            clients: vec![ClientSpec::new(0, 3), ClientSpec::new(1, 2)],
            faults: Faults {
                budget: 2,
                stalls: false,
            },
            replay_read: true,
            lease: 1,
            downstream_timeout: 2,
            retention: 5,
            active_until: 7,
            horizon: 14,
        }
    }

    /// [`Config::lease_reconciler`] with another request reusing the key while the first
    /// one's record is kept (the retention outlasts the run): mismatches, and two requests
    /// racing for one key.
    pub fn lease_reconciler_mismatch() -> Config {
        Config {
            name: "lease-reconciler-mismatch",
            summary: "lease-reconciler with another request reusing the key within its retention",
            clients: vec![ClientSpec::new(0, 3), ClientSpec::new(2, 2)],
            retention: 60,
            ..Self::lease_reconciler()
        }
    }

    /// Lease mode without takeover, with the reconciler, over a deduping downstream, with
    /// stalls.
    pub fn lease_reconciler_dedupe() -> Config {
        Config {
            name: "lease-reconciler-dedupe",
            summary: "lease mode without takeover, reconciler, deduping downstream, stalls; no replay read",
            mode: Mode::Lease {
                takeover: false,
                reconciler: true,
            },
            downstream: Downstream::Dedupe,
            clients: vec![ClientSpec::new(0, 3), ClientSpec::new(1, 2)],
            faults: Faults {
                budget: 2,
                stalls: true,
            },
            replay_read: false,
            lease: 1,
            downstream_timeout: 2,
            retention: 5,
            active_until: 7,
            horizon: 14,
        }
    }

    /// [`Config::lease_reconciler`] with stalls: outside the promise, which rests on a live
    /// instance renewing its lease in time. Shows what a stall longer than the lease does.
    pub fn lease_reconciler_stalls() -> Config {
        Config {
            name: "lease-reconciler-stalls",
            summary: "lease-reconciler with stalls: beyond the contract (a non-deduping downstream needs renewals in time)",
            faults: Faults {
                budget: 1,
                stalls: true,
            },
            clients: vec![ClientSpec::new(0, 2)],
            // Past the run: what it shows is the stall's doing, not retention's.
            retention: 60,
            ..Self::lease_reconciler()
        }
    }

    /// [`Config::lease_reconciler`] where the other request reuses the key after the first
    /// one's retention, which the contract treats as new. The key passed downstream is the
    /// same (idem serve derives it from the scope alone), so the downstream's lookup by key
    /// can answer the old request's charge.
    pub fn key_reuse_after_retention() -> Config {
        Config {
            name: "key-reuse-after-retention",
            summary: "lease-reconciler where another request reuses the key after its retention: beyond what the downstream key tells apart",
            clients: vec![ClientSpec::new(0, 2), ClientSpec::new(2, 2)],
            faults: Faults {
                budget: 1,
                stalls: false,
            },
            ..Self::lease_reconciler()
        }
    }
}
