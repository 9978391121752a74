//! What one simulation does: the settings `idem simulate`'s flags become.

/// What one simulation does, validated.
#[derive(Debug, Clone)]
pub struct SimulateConfig {
    /// Payment intents per rate.
    pub requests: u64,
    /// The answer-loss rates, each in `[0, 1)`, in the order they run.
    pub losses: Vec<f64>,
    /// The seed of the fault schedule and the client's jitter.
    pub seed: u64,
    /// Intents in flight at once (at least 1).
    pub concurrency: u64,
    /// `sqlite://PATH`, or `None` for a fresh file in a temporary folder.
    pub database: Option<String>,
}

impl SimulateConfig {
    /// `requests` intents at each of `losses`, with seed 42, 32 in flight, a fresh database.
    pub fn new(requests: u64, losses: Vec<f64>) -> Self {
        Self {
            requests,
            losses,
            seed: 42,
            concurrency: 32,
            database: None,
        }
    }
}
