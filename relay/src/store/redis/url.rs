//! Redis URLs: telling a cluster URL from a single-server one, turning the
//! seeds of a `redis-cluster://` URL into one `redis://` URL per node, and
//! removing credentials before a URL is shown. It never connects, and never
//! puts a password into an error message or a `Debug` output.

/// The URL scheme of a Redis Cluster: `redis-cluster://host1:port1,host2:port2`.
const CLUSTER_SCHEME: &str = "redis-cluster://";
/// Port of a cluster seed given without one.
const DEFAULT_PORT: u16 = 6379;

/// A URL that may carry credentials: `Debug` and `Display` show it with the
/// password replaced by `***`; [`RedactedUrl::as_str`]
/// gives the URL itself, to connect with.
#[derive(Clone, PartialEq, Eq)]
pub struct RedactedUrl<S: AsRef<str> = String>(pub S);

impl<S: AsRef<str>> RedactedUrl<S> {
    /// The URL, credentials included.
    pub fn as_str(&self) -> &str {
        self.0.as_ref()
    }
}

impl<S: AsRef<str>> std::fmt::Debug for RedactedUrl<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(&redact_url(self.as_str()), f)
    }
}

impl<S: AsRef<str>> std::fmt::Display for RedactedUrl<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&redact_url(self.as_str()))
    }
}

/// URLs that may carry credentials: shown redacted by `Debug`.
pub(super) struct RedactedUrls(pub(super) Vec<String>);

impl std::fmt::Debug for RedactedUrls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(RedactedUrl))
            .finish()
    }
}

/// Query parameters whose value is a credential (the redis crate reads
/// `pass` on `redis+unix://` URLs).
const SECRET_PARAMS: [&str; 2] = ["pass", "password"];

/// A URL with its credentials replaced by `***`, before it goes into an error
/// message or a `Debug` output: the password of the user info
/// (`redis://user:***@host:6379/0`) and the value of a `pass=` or
/// `password=` query parameter. Scheme, user, hosts, ports, path and the
/// other parameters stay. A URL whose `@` does not end a plain user info (an
/// unencoded `/`, `?` or `#` before it) is shown as `scheme://***`: nothing
/// in it can be told apart from a password.
pub(super) fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return if url.contains(['@', '?', ':']) {
            "***".to_owned()
        } else {
            url.to_owned()
        };
    };
    let (user, tail) = match rest.rsplit_once('@') {
        Some((userinfo, _)) if userinfo.contains(['/', '?', '#']) => {
            return format!("{scheme}://***");
        }
        Some((userinfo, tail)) => match userinfo.split_once(':') {
            Some((user, _)) => (format!("{user}:***@"), tail),
            None => (format!("{userinfo}@"), tail),
        },
        None => (String::new(), rest),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((key, _)) if SECRET_PARAMS.iter().any(|s| key.eq_ignore_ascii_case(s)) => {
                        format!("{key}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    format!("{scheme}://{user}{tail}")
}

/// The kind and address of the store at `url`, without credentials, as
/// `check-config` prints it: `memory`, `redis redis://host:6379/0` (a
/// password shown as `***`), or `redis cluster host1:7001,host2:7002` (the
/// seeds). A cluster URL whose seeds do not parse is shown redacted.
pub fn describe_store_url(url: &str) -> String {
    if url == "memory" {
        return "memory".to_owned();
    }
    if !is_cluster_url(url) {
        return format!("redis {}", redact_url(url));
    }
    match cluster_seed_urls(url) {
        Ok(seeds) => {
            let hosts: Vec<&str> = seeds
                .iter()
                .map(|s| {
                    let rest = s.strip_prefix("redis://").unwrap_or(s);
                    rest.rsplit_once('@').map_or(rest, |(_, host)| host)
                })
                .collect();
            format!("redis cluster {}", hosts.join(","))
        }
        Err(_) => format!("redis cluster {}", redact_url(url)),
    }
}

/// Whether `url` names a Redis Cluster (`redis-cluster://`, any case).
pub(super) fn is_cluster_url(url: &str) -> bool {
    url.get(..CLUSTER_SCHEME.len())
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case(CLUSTER_SCHEME))
}

/// The seed nodes of `redis-cluster://[user:password@]host1:port1,host2:port2[/]`
/// as `redis://[user:password@]host:port` URLs: the credentials given on the
/// first host apply to every node. A host without a port gets 6379; IPv6
/// addresses go in brackets. The error never quotes the credentials.
pub(super) fn cluster_seed_urls(url: &str) -> Result<Vec<String>, String> {
    let rest = url
        .get(CLUSTER_SCHEME.len()..)
        .filter(|_| is_cluster_url(url))
        .ok_or("not a redis-cluster:// URL")?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (credentials, hosts) = match rest.rsplit_once('@') {
        Some((credentials, hosts)) => (Some(credentials), hosts),
        None => (None, rest),
    };
    if credentials.is_some_and(|c| c.contains(',')) {
        return Err(
            "credentials go before the first host only (user:password@host:port,host:port)".into(),
        );
    }
    if hosts.contains(['/', '?', '#']) {
        return Err("a cluster URL has no database, path or query: \
             redis-cluster://[user:password@]host:port,host:port,..."
            .into());
    }
    let prefix = credentials.map_or(String::new(), |c| format!("{c}@"));
    hosts
        .split(',')
        .map(|seed| {
            let (host, port) = if let Some(v6) = seed.strip_prefix('[') {
                let (addr, after) = v6
                    .split_once(']')
                    .ok_or_else(|| format!("seed {seed:?}: unclosed '['"))?;
                let port = match after {
                    "" => None,
                    after => Some(
                        after
                            .strip_prefix(':')
                            .ok_or_else(|| format!("seed {seed:?}: ':' expected after ']'"))?,
                    ),
                };
                (format!("[{addr}]"), port)
            } else {
                match seed.rsplit_once(':') {
                    Some((host, port)) => (host.to_owned(), Some(port)),
                    None => (seed.to_owned(), None),
                }
            };
            if host.is_empty() || host == "[]" {
                return Err(format!("seed {seed:?}: no host"));
            }
            let port = match port {
                None => DEFAULT_PORT,
                Some(p) => p
                    .parse::<u16>()
                    .ok()
                    .filter(|&p| p != 0)
                    .ok_or_else(|| format!("seed {seed:?}: bad port"))?,
            };
            Ok(format!("redis://{prefix}{host}:{port}"))
        })
        .collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_redacted() {
        assert_eq!(
            redact_url("redis://user:secret@h:6379/0"),
            "redis://user:***@h:6379/0"
        );
        assert_eq!(
            redact_url("redis+unix:///tmp/r.sock?db=1&pass=secret"),
            "redis+unix:///tmp/r.sock?db=1&pass=***"
        );
        assert_eq!(redact_url("redis://:pw@h"), "redis://:***@h");
        assert_eq!(redact_url("redis://user@h:1/"), "redis://user@h:1/");
        assert_eq!(
            redact_url("redis-cluster://u:secret@h1:7000,h2:7001"),
            "redis-cluster://u:***@h1:7000,h2:7001"
        );
        assert_eq!(redact_url("redis://:se/cret@h/0"), "redis://***");
        assert_eq!(redact_url("memory"), "memory");
        assert_eq!(redact_url("user:secret@h"), "***");
        assert_eq!(redact_url("redis://h:6379/"), "redis://h:6379/");
    }

    #[test]
    fn redacted_url_debug_hides_the_password() {
        for url in [
            "redis://:hunter2@127.0.0.1:6379/",
            "redis-cluster://user:hunter2@h1:7001,h2:7002",
        ] {
            let shown = format!("{:?} {}", RedactedUrl(url), RedactedUrl(url));
            assert!(!shown.contains("hunter2"), "{shown}");
            assert_eq!(RedactedUrl(url).as_str(), url);
        }
        let list = format!("{:?}", RedactedUrls(vec!["redis://u:hunter2@h:1".into()]));
        assert_eq!(list, r#"["redis://u:***@h:1"]"#);
    }

    #[test]
    fn store_urls_are_described_without_credentials() {
        assert_eq!(describe_store_url("memory"), "memory");
        assert_eq!(
            describe_store_url("redis://:secret@10.0.0.5:6379/0"),
            "redis redis://:***@10.0.0.5:6379/0"
        );
        assert_eq!(
            describe_store_url("redis-cluster://u:secret@h1:7001,h2:7002,[::1]:7003"),
            "redis cluster h1:7001,h2:7002,[::1]:7003"
        );
        assert_eq!(
            describe_store_url("redis-cluster://u:secret@h1:x"),
            "redis cluster redis-cluster://u:***@h1:x"
        );
    }

    #[test]
    fn cluster_urls_name_the_seeds() {
        assert!(is_cluster_url("redis-cluster://h:1"));
        assert!(is_cluster_url("Redis-Cluster://h:1"));
        assert!(!is_cluster_url("redis://h:1"));
        assert_eq!(
            cluster_seed_urls("redis-cluster://127.0.0.1:7000,127.0.0.1:7001,h3").unwrap(),
            vec![
                "redis://127.0.0.1:7000",
                "redis://127.0.0.1:7001",
                "redis://h3:6379"
            ]
        );
        assert_eq!(
            cluster_seed_urls("redis-cluster://user:p%40ss@a:1,[::1]:2,[::2]/").unwrap(),
            vec![
                "redis://user:p%40ss@a:1",
                "redis://user:p%40ss@[::1]:2",
                "redis://user:p%40ss@[::2]:6379"
            ]
        );
        for bad in [
            "redis-cluster://",
            "redis-cluster://a:1,",
            "redis-cluster://a:1,u:p@b:2",
            "redis-cluster://a:x",
            "redis-cluster://a:0",
            "redis-cluster://a:1/0",
            "redis-cluster://a:1?protocol=resp3",
            "redis-cluster://[::1",
            "redis-cluster://[::1]x",
            "redis://a:1",
        ] {
            let e = cluster_seed_urls(bad).unwrap_err();
            assert!(!e.contains("secret"), "{e}");
        }
        let e = cluster_seed_urls("redis-cluster://u:secret@a:1,u:secret@b:2").unwrap_err();
        assert!(!e.contains("secret"), "{e}");
    }
}
