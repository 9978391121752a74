//! [`PgUrl`]: a PostgreSQL URL with one host or several, read once.
//!
//! libpq takes several hosts, `postgres://u@a:5432,b:5433/db?target_session_attrs=read-write`
//! (or `postgres://u@/db?host=a,b&port=5432,5433`), and tries them in order; sqlx reads one
//! (launchbadge/sqlx#2290). So only the host list is split off here, by hand: each host gets
//! the URL it would have on its own, and sqlx reads that, as it reads any URL (user, password,
//! the password in `~/.pgpass` for that host, database, TLS settings). A URL with one host and
//! no `target_session_attrs` goes to sqlx whole, as before.

use std::fmt;
use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;

/// A PostgreSQL URL, parsed: its hosts in order, and whether a host must take writes.
#[derive(Clone)]
pub(crate) struct PgUrl {
    /// At least one.
    pub(crate) hosts: Vec<PgHost>,
    /// `target_session_attrs=read-write`, the default with several hosts: a host is used only
    /// while it takes writes, and the store looks for another when it stops.
    pub(crate) read_write: bool,
}

/// One host of a URL, with the options sqlx connects to it with.
#[derive(Clone)]
pub(crate) struct PgHost {
    /// `host:port` or the socket directory: for messages, without credentials.
    pub(crate) label: String,
    pub(crate) options: PgConnectOptions,
}

// By hand, so that no password is ever printed: sqlx's options hold it.
impl fmt::Debug for PgHost {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.label)
    }
}

impl fmt::Debug for PgUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PgUrl")
            .field("hosts", &self.hosts)
            .field("read_write", &self.read_write)
            .finish()
    }
}

/// Why a PostgreSQL URL cannot be used. No message repeats the URL, which may hold a password.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgUrlError {
    /// An entry of the host list is empty or its port is not a number.
    #[error("a host in the PostgreSQL URL's host list is not HOST or HOST:PORT: {0:?}")]
    Host(String),
    /// `port=` lists neither one port nor one per host.
    #[error("the PostgreSQL URL lists {ports} ports for {hosts} hosts: give one, or one per host")]
    Ports {
        /// How many hosts the URL names.
        hosts: usize,
        /// How many ports `port=` lists.
        ports: usize,
    },
    /// Hosts both before the path and in `?host=`, or ports both after hosts and in `?port=`.
    #[error("the PostgreSQL URL names its {0} twice: before the path and in the query")]
    Twice(&'static str),
    /// A `target_session_attrs` other than `read-write` (or, with one host, `any`).
    #[error(
        "target_session_attrs={0:?} does not fit idem, which writes: use read-write (the default \
         with several hosts) or, with one host, any"
    )]
    TargetSessionAttrs(String),
    /// sqlx refused the URL of a host (a malformed URL, an unknown `sslmode`…).
    #[error("invalid PostgreSQL connection options")]
    Options(#[source] sqlx::Error),
    /// tokio-postgres refused the URL ([`TokioPgStore`](crate::TokioPgStore) reads it whole).
    #[cfg(feature = "tokio-postgres")]
    #[error("invalid PostgreSQL connection options for tokio-postgres")]
    Client(#[source] tokio_postgres::Error),
}

impl FromStr for PgUrl {
    type Err = PgUrlError;

    fn from_str(s: &str) -> Result<Self, PgUrlError> {
        let Some(parts) = Parts::split(s) else {
            return Self::whole(s);
        };
        let read_write = match parts.target_session_attrs {
            None => None,
            Some("read-write") => Some(true),
            Some("any") => Some(false),
            Some(other) => return Err(PgUrlError::TargetSessionAttrs(other.to_owned())),
        };
        let hosts = parts.host_urls()?;
        match (read_write, hosts.len()) {
            // What every URL was before several hosts: sqlx reads it whole.
            (None, 1) => Self::whole(s),
            (Some(false), 2..) => Err(PgUrlError::TargetSessionAttrs("any".into())),
            (read_write, _) => Ok(Self {
                hosts: hosts
                    .iter()
                    .map(|url| host(url))
                    .collect::<Result<_, _>>()?,
                read_write: read_write.unwrap_or(true),
            }),
        }
    }
}

impl PgUrl {
    /// A URL sqlx reads as it is.
    fn whole(url: &str) -> Result<Self, PgUrlError> {
        Ok(Self {
            hosts: vec![host(url)?],
            read_write: false,
        })
    }
}

fn host(url: &str) -> Result<PgHost, PgUrlError> {
    let options = PgConnectOptions::from_str(url).map_err(PgUrlError::Options)?;
    let label = match options.get_socket() {
        Some(socket) => socket.display().to_string(),
        // sqlx keeps an IPv6 address from a URL's authority in its brackets.
        None if options.get_host().contains(':') && !options.get_host().starts_with('[') => {
            format!("[{}]:{}", options.get_host(), options.get_port())
        }
        None => format!("{}:{}", options.get_host(), options.get_port()),
    };
    Ok(PgHost { label, options })
}

/// A URL cut where the host list and the parameters about hosts are.
#[derive(Debug)]
struct Parts<'a> {
    /// `postgres://user:password@`.
    head: &'a str,
    /// What stands between `@` (or `//`) and the path: `a:5432,b:5433`.
    listed: &'a str,
    /// The path, `/db`.
    path: &'a str,
    /// The query's other parameters, as written (still percent-encoded).
    params: Vec<&'a str>,
    /// `?host=`, `?port=` and `?target_session_attrs=`, as written.
    hosts: Option<&'a str>,
    ports: Option<&'a str>,
    target_session_attrs: Option<&'a str>,
    /// `#…`, if any.
    fragment: &'a str,
}

impl<'a> Parts<'a> {
    /// `None` when `s` is no `scheme://` URL: sqlx says what is wrong with it.
    fn split(s: &'a str) -> Option<Self> {
        let (s, fragment) = s.split_at(s.find('#').unwrap_or(s.len()));
        let (s, query) = match s.split_once('?') {
            Some((s, query)) => (s, query),
            None => (s, ""),
        };
        let authority = s.find("://")? + 3;
        let path = s[authority..].find('/').map_or(s.len(), |i| authority + i);
        let at = s[..path].rfind('@').map_or(authority, |i| i + 1);
        let mut parts = Self {
            head: &s[..at],
            listed: &s[at..path],
            path: &s[path..],
            params: Vec::new(),
            hosts: None,
            ports: None,
            target_session_attrs: None,
            fragment,
        };
        for param in query.split('&').filter(|p| !p.is_empty()) {
            match param.split_once('=') {
                Some(("host", value)) => parts.hosts = Some(value),
                Some(("port", value)) => parts.ports = Some(value),
                Some(("target_session_attrs", value)) => parts.target_session_attrs = Some(value),
                _ => parts.params.push(param),
            }
        }
        Some(parts)
    }

    /// One URL per host, in order, each naming its host and port and nothing about the
    /// others. A URL that names no host has one, without a host: sqlx's default applies.
    fn host_urls(&self) -> Result<Vec<String>, PgUrlError> {
        let in_query = self.hosts.is_some();
        if in_query && !self.listed.is_empty() {
            return Err(PgUrlError::Twice("hosts"));
        }
        let hosts: Vec<&str> = match self.hosts.or(Some(self.listed).filter(|l| !l.is_empty())) {
            Some(list) => list.split(',').collect(),
            None => return Ok(vec![self.url_of("", self.ports, false)]),
        };
        let ports = self.ports(hosts.len())?;
        hosts
            .iter()
            .zip(ports)
            .map(|(host, port)| {
                let own_port = check_host(host, in_query)?;
                match (own_port, port) {
                    (true, Some(_)) => Err(PgUrlError::Twice("ports")),
                    _ => Ok(self.url_of(host, port, in_query)),
                }
            })
            .collect()
    }

    /// The port of each of `hosts` hosts that `?port=` gives.
    fn ports(&self, hosts: usize) -> Result<Vec<Option<&'a str>>, PgUrlError> {
        let Some(list) = self.ports else {
            return Ok(vec![None; hosts]);
        };
        let ports: Vec<&str> = list.split(',').collect();
        match ports.len() {
            1 => Ok(vec![Some(ports[0]); hosts]),
            n if n == hosts => Ok(ports.into_iter().map(Some).collect()),
            n => Err(PgUrlError::Ports { hosts, ports: n }),
        }
    }

    /// The URL of one host. A host from `?host=` moves into the authority (a URL with a user
    /// needs a host there), unless it is a socket directory, which stays in the query.
    fn url_of(&self, host: &str, port: Option<&str>, in_query: bool) -> String {
        let mut params: Vec<String> = self.params.iter().map(|p| (*p).to_owned()).collect();
        let socket = in_query
            && (host.starts_with('/')
                || host.get(..3).is_some_and(|h| h.eq_ignore_ascii_case("%2f")));
        let authority = if socket {
            params.push(format!("host={host}"));
            // sqlx connects to the socket whatever the authority says; libpq, too, reads the
            // `~/.pgpass` lines of a socket connection as `localhost`'s.
            if self.head.ends_with('@') {
                "localhost".to_owned()
            } else {
                String::new()
            }
        } else if in_query && host.contains(':') {
            format!("[{host}]")
        } else {
            host.to_owned()
        };
        if let Some(port) = port {
            params.push(format!("port={port}"));
        }
        let query = if params.is_empty() {
            String::new()
        } else {
            format!("?{}", params.join("&"))
        };
        format!(
            "{}{authority}{}{query}{}",
            self.head, self.path, self.fragment
        )
    }
}

/// Checks one entry of a host list; whether it names its own port (`host:5432`,
/// `[::1]:5432`). Entries of `?host=` name none: there, a colon is part of the host.
fn check_host(entry: &str, in_query: bool) -> Result<bool, PgUrlError> {
    let bad = || PgUrlError::Host(entry.to_owned());
    if entry.is_empty() {
        return Err(bad());
    }
    if in_query {
        return Ok(false);
    }
    let port = match entry.strip_prefix('[') {
        Some(v6) => match v6.split_once(']').ok_or_else(bad)? {
            (_, "") => None,
            (_, rest) => Some(rest.strip_prefix(':').ok_or_else(bad)?),
        },
        None => entry.split_once(':').map(|(_, port)| port),
    };
    match port {
        None => Ok(false),
        Some(port) if port.parse::<u16>().is_ok() => Ok(true),
        Some(_) => Err(bad()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(url: &str) -> PgUrl {
        url.parse().unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    fn labels(url: &PgUrl) -> Vec<&str> {
        url.hosts.iter().map(|h| h.label.as_str()).collect()
    }

    #[test]
    fn a_plain_url_is_read_by_sqlx_whole_and_takes_any_session() {
        let url = parsed("postgres://postgres:secret@db.example:6432/idem?sslmode=disable");
        assert_eq!(labels(&url), ["db.example:6432"]);
        assert!(!url.read_write);
        let options = &url.hosts[0].options;
        assert_eq!(options.get_database(), Some("idem"));
        assert_eq!(options.get_username(), "postgres");
    }

    #[test]
    fn several_hosts_in_the_authority_each_get_their_own_url() {
        let url = parsed(
            "postgresql://app:p%40ss@a.example:5432,b.example:5433,[::1]:5434/idem\
             ?application_name=idem&target_session_attrs=read-write",
        );
        assert_eq!(
            labels(&url),
            ["a.example:5432", "b.example:5433", "[::1]:5434"]
        );
        assert!(url.read_write);
        for host in &url.hosts {
            assert_eq!(host.options.get_database(), Some("idem"));
            assert_eq!(host.options.get_username(), "app");
            assert_eq!(host.options.get_application_name(), Some("idem"));
        }
    }

    #[test]
    fn several_hosts_want_a_writable_one_by_default() {
        let url = parsed("postgres://u@a,b:5433/db");
        assert!(url.read_write);
        assert_eq!(labels(&url), ["a:5432", "b:5433"]);
    }

    #[test]
    fn hosts_and_ports_in_the_query_as_libpq_allows() {
        let url = parsed("postgres://u@/db?host=a,b&port=5432,5433&sslmode=disable");
        assert_eq!(labels(&url), ["a:5432", "b:5433"]);
        let url = parsed("postgres:///db?host=a,b&port=6000");
        assert_eq!(labels(&url), ["a:6000", "b:6000"]);
        let url = parsed("postgres:///db?host=%2Fvar%2Frun%2Fpostgresql,b&port=5432");
        assert_eq!(labels(&url), ["/var/run/postgresql", "b:5432"]);
    }

    #[test]
    fn no_host_at_all_is_sqlx_s_default_host() {
        let url = parsed("postgres:///db?port=6000&target_session_attrs=read-write");
        assert_eq!(url.hosts.len(), 1);
        assert_eq!(url.hosts[0].options.get_port(), 6000);
        assert!(url.read_write);
    }

    #[test]
    fn one_host_may_ask_for_a_writable_session() {
        let url = parsed("postgres://u@a:5432/db?target_session_attrs=read-write");
        assert_eq!(labels(&url), ["a:5432"]);
        assert!(url.read_write);
        let url = parsed("postgres://u@a:5432/db?target_session_attrs=any");
        assert!(!url.read_write);
    }

    #[test]
    fn what_does_not_fit_is_refused_without_the_password() {
        for (url, expected) in [
            (
                "postgres://u:hunter2@a,b/db?target_session_attrs=any",
                "target_session_attrs",
            ),
            (
                "postgres://u:hunter2@a,b/db?target_session_attrs=standby",
                "target_session_attrs",
            ),
            ("postgres://u:hunter2@a,,b/db", "host list"),
            ("postgres://u:hunter2@a:x,b/db", "host list"),
            ("postgres://u:hunter2@[::1,b/db", "host list"),
            (
                "postgres://u:hunter2@a,b/db?port=1,2,3",
                "3 ports for 2 hosts",
            ),
            ("postgres://u:hunter2@a/db?host=b,c", "hosts twice"),
            ("postgres://u:hunter2@a:1,b/db?port=2", "ports twice"),
            (
                "postgres://u:hunter2@a,b/db?sslmode=sometimes",
                "connection options",
            ),
        ] {
            let refused = url.parse::<PgUrl>().unwrap_err().to_string();
            assert!(refused.contains(expected), "{url}: {refused}");
            assert!(!refused.contains("hunter2"), "{url}: {refused}");
        }
    }

    #[test]
    fn debug_shows_hosts_not_passwords() {
        let url = parsed("postgres://u:hunter2@a,b/db");
        let shown = format!("{url:?}");
        assert!(
            shown.contains("a:5432") && !shown.contains("hunter2"),
            "{shown}"
        );
    }
}
