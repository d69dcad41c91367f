//! The webhook client of push notifications: one HTTP/1.1 `POST` per
//! notification over a fresh connection (`Connection: close`), plain TCP for
//! `http://` and TLS (rustls with ring, the Web PKI roots) for `https://`.
//! Only the status line of the answer is read: a `2xx` confirms the
//! notification, anything else (or no answer within the timeout) is a
//! failed attempt that the delivery loop retries.
//!
//! Also owns the URL rule ([`WebhookUrl::parse`]): `https://` to any host,
//! `http://` only to a loopback host (`localhost`, `127.0.0.0/8`, `[::1]`)
//! unless `allow_plain_http` is set, since the notification carries the
//! config's token and credentials in clear. No user info, no fragment, at
//! most [`MAX_URL_BYTES`].
//!
//! Never: follows a redirect, sends a token to a host other than the URL's,
//! or reads more than [`MAX_STATUS_LINE_BYTES`] of an answer.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// The longest webhook URL accepted (bytes).
pub(crate) const MAX_URL_BYTES: usize = 2_048;

/// How much of an answer is read looking for the status line: the
/// `HTTP/1.1 204 No Content` line fits many times over.
const MAX_STATUS_LINE_BYTES: usize = 1_024;

/// A checked webhook URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WebhookUrl {
    pub(crate) tls: bool,
    /// Host as written (brackets removed for IPv6).
    pub(crate) host: String,
    pub(crate) port: u16,
    /// Path and query, starting with `/`.
    pub(crate) target: String,
    /// The `Host` header value.
    authority: String,
}

fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl WebhookUrl {
    /// Checks `url` against the rule in the module's opening comment; the
    /// error says what is wrong.
    pub(crate) fn parse(url: &str, allow_plain_http: bool) -> Result<WebhookUrl, String> {
        if url.len() > MAX_URL_BYTES {
            return Err(format!("url is longer than {MAX_URL_BYTES} bytes"));
        }
        if url.bytes().any(|b| !b.is_ascii_graphic()) {
            return Err("url must be printable ASCII without spaces".into());
        }
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| "url must be an absolute http:// or https:// URL".to_string())?;
        let tls = match scheme.to_ascii_lowercase().as_str() {
            "https" => true,
            "http" => false,
            other => {
                return Err(format!(
                    "url scheme {:?} is not http or https",
                    other.chars().take(16).collect::<String>()
                ));
            }
        };
        if rest.contains('#') {
            return Err("url must not have a fragment".into());
        }
        let split = rest.find(['/', '?']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(split);
        if authority.contains('@') {
            return Err("url must not carry user info".into());
        }
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| "url has an unclosed [IPv6] host".to_string())?;
            let port = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| "url has junk after its [IPv6] host".to_string())?,
                ),
            };
            (h, port)
        } else {
            match authority.split_once(':') {
                Some((h, p)) => (h, Some(p)),
                None => (authority, None),
            }
        };
        if host.is_empty() {
            return Err("url has no host".into());
        }
        let port = match port {
            None => {
                if tls {
                    443
                } else {
                    80
                }
            }
            Some(p) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| "url has an invalid port".to_string())?,
        };
        if !tls && !allow_plain_http && !is_loopback(host) {
            return Err(
                "an http:// webhook must be on a loopback host (localhost, 127.0.0.1, [::1]); \
                 use https:// for any other host"
                    .into(),
            );
        }
        let target = if tail.is_empty() {
            "/".to_string()
        } else if tail.starts_with('?') {
            format!("/{tail}")
        } else {
            tail.to_string()
        };
        Ok(WebhookUrl {
            tls,
            host: host.to_string(),
            port,
            target,
            authority: authority.to_string(),
        })
    }
}

/// Sends notifications; cheap to clone.
#[derive(Clone)]
pub(crate) struct WebhookClient {
    tls: Result<tokio_rustls::TlsConnector, String>,
    timeout: Duration,
}

impl std::fmt::Debug for WebhookClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookClient")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl WebhookClient {
    /// A client whose every attempt (connect, TLS, request, status line)
    /// ends within `timeout`.
    pub(crate) fn new(timeout: Duration) -> WebhookClient {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        // The ring provider supports the default protocol versions, so this
        // never fails; if it did, https attempts would fail with the reason.
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map(|b| {
                let mut cfg = b.with_root_certificates(roots).with_no_client_auth();
                cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
                tokio_rustls::TlsConnector::from(Arc::new(cfg))
            })
            .map_err(|e| e.to_string());
        WebhookClient { tls, timeout }
    }

    /// One attempt: `POST` `body` to `url` with `headers`; the answer's
    /// status code, or why there is none.
    pub(crate) async fn post(
        &self,
        url: &WebhookUrl,
        headers: &[(&str, String)],
        body: &[u8],
    ) -> Result<u16, String> {
        match tokio::time::timeout(self.timeout, self.attempt(url, headers, body)).await {
            Ok(r) => r,
            Err(_) => Err(format!("no answer within {:?}", self.timeout)),
        }
    }

    async fn attempt(
        &self,
        url: &WebhookUrl,
        headers: &[(&str, String)],
        body: &[u8],
    ) -> Result<u16, String> {
        let tcp = TcpStream::connect((url.host.as_str(), url.port))
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let _ = tcp.set_nodelay(true);
        if url.tls {
            let name =
                ServerName::try_from(url.host.clone()).map_err(|e| format!("server name: {e}"))?;
            let connector = self.tls.as_ref().map_err(|e| format!("tls: {e}"))?;
            let tls = connector
                .connect(name, tcp)
                .await
                .map_err(|e| format!("tls: {e}"))?;
            exchange(tls, url, headers, body).await
        } else {
            exchange(tcp, url, headers, body).await
        }
    }
}

/// Writes the request and reads the status code.
async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    url: &WebhookUrl,
    headers: &[(&str, String)],
    body: &[u8],
) -> Result<u16, String> {
    let mut head = format!(
        "POST {} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\nUser-Agent: oab-connector\r\n",
        url.target,
        url.authority,
        body.len()
    );
    for (k, v) in headers {
        head.push_str(k);
        head.push_str(": ");
        head.push_str(v);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");
    let io = |e: std::io::Error| format!("write: {e}");
    s.write_all(head.as_bytes()).await.map_err(io)?;
    s.write_all(body).await.map_err(io)?;
    s.flush().await.map_err(io)?;
    let mut buf = Vec::with_capacity(128);
    let mut chunk = [0u8; 256];
    loop {
        if let Some(end) = buf.windows(2).position(|w| w == b"\r\n") {
            return status_code(buf.get(..end).unwrap_or_default());
        }
        if buf.len() >= MAX_STATUS_LINE_BYTES {
            return Err("the answer's status line is too long".into());
        }
        let n = s.read(&mut chunk).await.map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("the webhook closed the connection without an answer".into());
        }
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
    }
}

/// The code of a status line (`HTTP/1.1 204 No Content`).
fn status_code(line: &[u8]) -> Result<u16, String> {
    let line = std::str::from_utf8(line).map_err(|_| "a status line that is not text")?;
    let mut parts = line.split(' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(format!(
            "not an HTTP/1.x answer: {:?}",
            line.chars().take(40).collect::<String>()
        ));
    }
    parts
        .next()
        .and_then(|c| c.parse::<u16>().ok())
        .filter(|c| (100..1000).contains(c))
        .ok_or_else(|| "a status line without a code".to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn urls_follow_the_rule() {
        let u = WebhookUrl::parse("http://127.0.0.1:8080/hook?x=1", false).unwrap();
        assert_eq!((u.tls, u.host.as_str(), u.port), (false, "127.0.0.1", 8080));
        assert_eq!(u.target, "/hook?x=1");
        let u = WebhookUrl::parse("https://example.com", false).unwrap();
        assert_eq!((u.tls, u.port, u.target.as_str()), (true, 443, "/"));
        let u = WebhookUrl::parse("http://[::1]:9/h", false).unwrap();
        assert_eq!(u.host, "::1");
        assert!(WebhookUrl::parse("http://localhost/h", false).is_ok());
        for bad in [
            "ftp://example.com/",
            "example.com/hook",
            "http://example.com/hook",
            "https://user:pw@example.com/",
            "https://example.com/#frag",
            "https://:443/",
            "https://example.com:0/",
            "https://example.com:99999/",
            "https://exa mple.com/",
            "http://[::1/",
        ] {
            assert!(WebhookUrl::parse(bad, false).is_err(), "{bad}");
        }
        assert!(WebhookUrl::parse("http://example.com/hook", true).is_ok());
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_BYTES));
        assert!(WebhookUrl::parse(&long, false).is_err());
    }

    #[test]
    fn status_lines() {
        assert_eq!(status_code(b"HTTP/1.1 204 No Content"), Ok(204));
        assert_eq!(status_code(b"HTTP/1.0 500"), Ok(500));
        assert!(status_code(b"SSH-2.0-OpenSSH").is_err());
        assert!(status_code(b"HTTP/1.1 abc").is_err());
    }
}
