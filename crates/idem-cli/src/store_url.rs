//! [`StoreUrl`]: where records live, as `--database` or `--store` names it, told apart once.

use std::path::PathBuf;

/// A database or store URL, by kind. The URL is kept whole: each store parses its own options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `sqlite://PATH` (or `sqlite:PATH`, with `?options`).
    Sqlite(String),
    /// `postgres://…` or `postgresql://…`.
    Postgres(String),
    /// `redis://…`, `rediss://…` or `redis+cluster://…` (the gateway's store, and `idem keys`).
    Redis(String),
}

impl StoreUrl {
    /// Tells a store URL apart by its scheme (`--store` of `idem proxy`, `--database` of
    /// `idem keys`: Redis too).
    pub fn parse(url: &str) -> anyhow::Result<Self> {
        Self::by_scheme(url).ok_or_else(|| {
            anyhow::anyhow!(
                "unsupported store URL {:?}: expected sqlite://PATH, postgres://… or redis://…",
                redact(url)
            )
        })
    }

    /// Tells a database URL apart (`--database`: SQLite or PostgreSQL, where business tables
    /// live beside the keys).
    pub fn parse_database(url: &str) -> anyhow::Result<Self> {
        match Self::by_scheme(url) {
            Some(Self::Redis(_)) | None => anyhow::bail!(
                "unsupported database URL {:?}: expected sqlite://PATH or postgres://USER@HOST/DB",
                redact(url)
            ),
            Some(other) => Ok(other),
        }
    }

    fn by_scheme(url: &str) -> Option<Self> {
        let scheme = url.split_once(':').map_or("", |(scheme, _)| scheme);
        Some(match scheme.to_ascii_lowercase().as_str() {
            "sqlite" => Self::Sqlite(url.to_owned()),
            "postgres" | "postgresql" => Self::Postgres(url.to_owned()),
            "redis" | "rediss" | "redis+cluster" => Self::Redis(url.to_owned()),
            _ => return None,
        })
    }

    /// The SQLite file this names (`None` for other stores and for in-memory databases).
    pub fn sqlite_file(&self) -> Option<PathBuf> {
        let Self::Sqlite(url) = self else {
            return None;
        };
        let rest = url.split_once(':').map_or("", |(_, rest)| rest);
        let path = rest.strip_prefix("//").unwrap_or(rest);
        let path = path.split_once('?').map_or(path, |(path, _)| path);
        (!path.is_empty() && path != ":memory:").then(|| PathBuf::from(path))
    }
}

/// A database URL without its password, for messages (the user name stays, so the message
/// still says who connected).
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let credentials = &url[scheme + 3..at];
            match credentials.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_and_its_file() {
        let sqlite = StoreUrl::parse("sqlite://data/idem.db?mode=rwc").unwrap();
        assert_eq!(sqlite.sqlite_file(), Some(PathBuf::from("data/idem.db")));
        assert_eq!(
            StoreUrl::parse("sqlite:idem.db").unwrap().sqlite_file(),
            Some(PathBuf::from("idem.db"))
        );
        assert_eq!(
            StoreUrl::parse("sqlite:///var/lib/idem.db")
                .unwrap()
                .sqlite_file(),
            Some(PathBuf::from("/var/lib/idem.db"))
        );
        assert_eq!(
            StoreUrl::parse("sqlite::memory:").unwrap().sqlite_file(),
            None
        );
        assert!(matches!(
            StoreUrl::parse("postgresql://u@h/db").unwrap(),
            StoreUrl::Postgres(_)
        ));
        assert!(matches!(
            StoreUrl::parse("REDIS://h").unwrap(),
            StoreUrl::Redis(_)
        ));
    }

    #[test]
    fn unknown_schemes_and_redis_as_a_database_are_refused_without_the_password() {
        let refused = StoreUrl::parse("mysql://root:hunter2@h/db").unwrap_err();
        assert!(
            refused.to_string().contains("unsupported store URL"),
            "{refused}"
        );
        assert!(!refused.to_string().contains("hunter2"), "{refused}");
        let refused = StoreUrl::parse_database("redis://127.0.0.1").unwrap_err();
        assert!(
            refused.to_string().contains("unsupported database URL"),
            "{refused}"
        );
    }
}
