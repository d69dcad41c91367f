//! A small HTTP/1.1 client for the admin endpoints (`oab-relay status`,
//! `oab-connector status`): one `GET` over plain TCP to an address the
//! operator names (normally loopback), with a deadline and a cap on the
//! answer's size. No TLS: the admin listeners serve plain HTTP.
//!
//! Never: follows redirects, keeps a connection, or reads more than
//! [`MAX_RESPONSE_BYTES`].

use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// The largest answer read (headers and body): a `/status` of thousands of
/// peers stays far below it.
pub const MAX_RESPONSE_BYTES: usize = 8 * 1024 * 1024;

/// Why a `GET` failed.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// The URL is not `http://host:port[/path]`.
    #[error("{0}: expected host:port or http://host:port[/path]")]
    BadUrl(String),
    /// Connecting, writing or reading failed.
    #[error("{url}: {error}")]
    Io {
        /// The URL.
        url: String,
        /// The error.
        error: std::io::Error,
    },
    /// No full answer within the deadline.
    #[error("{0}: no answer within the deadline")]
    Timeout(String),
    /// The answer is not HTTP/1.x, or over [`MAX_RESPONSE_BYTES`].
    #[error("{url}: {message}")]
    BadResponse {
        /// The URL.
        url: String,
        /// What was wrong.
        message: String,
    },
}

/// An answer: status code and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status code.
    pub status: u16,
    /// The body (chunked encoding removed).
    pub body: Vec<u8>,
}

/// Splits `http://host:port/path` into the address and the path.
fn split_url(url: &str) -> Option<(String, String)> {
    let rest = url.strip_prefix("http://")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (rest.get(..i)?, rest.get(i..)?),
        None => (rest, "/"),
    };
    if authority.is_empty() || authority.contains('@') {
        return None;
    }
    let addr = if authority
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        && !authority.ends_with(']')
    {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    Some((addr, path.to_string()))
}

/// `GET base` joined with `path` (`base` may end in `/`): `http://127.0.0.1:9443` + `/status`.
/// A `base` without a scheme (`127.0.0.1:9443`, the form of
/// `relay.admin_listen` and `admin.listen` in the configuration files) is
/// taken as `http://`.
pub fn join(base: &str, path: &str) -> String {
    let base = base.trim_end_matches('/');
    if base.contains("://") {
        format!("{base}{path}")
    } else {
        format!("http://{base}{path}")
    }
}

/// The admin URL to ask for a listener address from a configuration file
/// (`relay.admin_listen`, `admin.listen`): an unspecified address
/// (`0.0.0.0`, `::`) is asked on loopback, where the listener answers too.
pub fn url_of_listen(addr: std::net::SocketAddr) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => {
            std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
        }
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => {
            std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST)
        }
        ip => ip,
    };
    format!("http://{}", std::net::SocketAddr::new(ip, addr.port()))
}

/// What `oab-relay status` and `oab-connector status` do first: `GET
/// <admin>/status` on a runtime of its own, within 10 s. Returns the URL and
/// the body of a 200 answer; otherwise a message that names the URL, with
/// `hint` (where to look) after a failure to get any answer.
pub fn fetch_status(admin: &str, hint: &str) -> Result<(String, Vec<u8>), String> {
    let (url, resp) = fetch(admin, "/status", hint)?;
    if resp.status != 200 {
        return Err(format!(
            "{url}: HTTP {}: {}",
            resp.status,
            String::from_utf8_lossy(&resp.body)
        ));
    }
    Ok((url, resp.body))
}

/// `GET <admin><path>` on a runtime of its own, within 10 s: the URL and the
/// answer, whatever its status; a message that names the URL, with `hint`
/// (where to look), when no answer came.
pub fn fetch(admin: &str, path: &str, hint: &str) -> Result<(String, Response), String> {
    let url = join(admin, path);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))?;
    let resp = runtime
        .block_on(get(&url, Duration::from_secs(10)))
        .map_err(|e| format!("{e} ({hint})"))?;
    Ok((url, resp))
}

/// `text` percent-encoded for a URL query value: every byte but
/// `A-Z a-z 0-9 - . _ ~` as `%XX`.
pub fn query_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Sends `GET url` and reads the whole answer within `timeout`.
pub async fn get(url: &str, timeout: Duration) -> Result<Response, AdminError> {
    let (addr, path) = split_url(url).ok_or_else(|| AdminError::BadUrl(url.to_string()))?;
    let io = |error| AdminError::Io {
        url: url.to_string(),
        error,
    };
    let exchange = async {
        let mut tcp = tokio::net::TcpStream::connect(&addr).await.map_err(io)?;
        let req = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\nConnection: close\r\n\r\n"
        );
        tcp.write_all(req.as_bytes()).await.map_err(io)?;
        let mut buf = Vec::new();
        let mut limited = (&mut tcp).take(MAX_RESPONSE_BYTES as u64 + 1);
        limited.read_to_end(&mut buf).await.map_err(io)?;
        Ok::<_, AdminError>(buf)
    };
    let raw = tokio::time::timeout(timeout, exchange)
        .await
        .map_err(|_| AdminError::Timeout(url.to_string()))??;
    parse(&raw).map_err(|message| AdminError::BadResponse {
        url: url.to_string(),
        message,
    })
}

fn parse(raw: &[u8]) -> Result<Response, String> {
    if raw.len() > MAX_RESPONSE_BYTES {
        return Err(format!("answer over {MAX_RESPONSE_BYTES} bytes"));
    }
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or("no end of headers")?;
    let head = std::str::from_utf8(raw.get(..end).unwrap_or_default())
        .map_err(|_| "headers are not UTF-8")?;
    let body = raw.get(end + 4..).unwrap_or_default();
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.split(' ');
    if !parts.next().is_some_and(|v| v.starts_with("HTTP/1.")) {
        return Err(format!("not an HTTP/1.x answer: {status_line:?}"));
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("no status code in {status_line:?}"))?;
    let mut chunked = false;
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        let (name, value) = (name.trim().to_ascii_lowercase(), value.trim());
        if name == "transfer-encoding" && value.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        } else if name == "content-length" {
            length = value.parse::<usize>().ok();
        }
    }
    let body = if chunked {
        dechunk(body)?
    } else if let Some(n) = length {
        body.get(..n)
            .ok_or("body shorter than its content-length")?
            .to_vec()
    } else {
        body.to_vec()
    };
    Ok(Response { status, body })
}

fn dechunk(mut rest: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = rest
            .windows(2)
            .position(|w| w == b"\r\n")
            .ok_or("chunk size line without an end")?;
        let size_line = std::str::from_utf8(rest.get(..eol).unwrap_or_default())
            .map_err(|_| "chunk size is not UTF-8")?;
        let size_hex = size_line.split(';').next().unwrap_or_default().trim();
        let size = usize::from_str_radix(size_hex, 16)
            .map_err(|_| format!("bad chunk size {size_hex:?}"))?;
        rest = rest.get(eol + 2..).unwrap_or_default();
        if size == 0 {
            return Ok(out);
        }
        out.extend_from_slice(rest.get(..size).ok_or("chunk shorter than its size")?);
        rest = rest.get(size + 2..).unwrap_or_default();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_query_value_keeps_unreserved_bytes_and_encodes_the_rest() {
        assert_eq!(
            query_value("acme/bot#req-1.a_b~"),
            "acme%2Fbot%23req-1.a_b~"
        );
        assert_eq!(query_value("a b&c=é"), "a%20b%26c%3D%C3%A9");
    }

    #[test]
    fn urls_split_into_address_and_path() {
        assert_eq!(
            split_url("http://127.0.0.1:9443/status"),
            Some(("127.0.0.1:9443".into(), "/status".into()))
        );
        assert_eq!(
            split_url("http://localhost"),
            Some(("localhost:80".into(), "/".into()))
        );
        assert_eq!(
            split_url("http://[::1]:9443/x"),
            Some(("[::1]:9443".into(), "/x".into()))
        );
        assert_eq!(split_url("https://h:1/"), None);
        assert_eq!(split_url("http://user@h:1/"), None);
        assert_eq!(join("http://h:1/", "/status"), "http://h:1/status");
        // The configuration files' scheme-less form is taken as http://.
        assert_eq!(
            join("127.0.0.1:9443", "/status"),
            "http://127.0.0.1:9443/status"
        );
        assert_eq!(join("[::1]:9443/", "/status"), "http://[::1]:9443/status");
        assert_eq!(
            url_of_listen("0.0.0.0:9443".parse().unwrap()),
            "http://127.0.0.1:9443"
        );
        assert_eq!(url_of_listen("[::]:1".parse().unwrap()), "http://[::1]:1");
        assert_eq!(
            url_of_listen("10.0.0.5:9443".parse().unwrap()),
            "http://10.0.0.5:9443"
        );
    }

    #[test]
    fn answers_with_a_length_chunks_or_neither_are_read() {
        let r = parse(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
        let r = parse(b"HTTP/1.1 503 Service Unavailable\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (503, &b"abcde"[..]));
        let r = parse(b"HTTP/1.0 200 OK\r\n\r\nall").unwrap();
        assert_eq!(r.body, b"all");
        assert!(parse(b"SSH-2.0-OpenSSH\r\n\r\n").is_err());
        assert!(parse(b"HTTP/1.1 200 OK\r\n").is_err());
    }
}
