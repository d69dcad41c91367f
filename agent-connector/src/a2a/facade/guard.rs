//! Browser safety: the checks every facade request passes before any route
//! runs, so a web page open on the host cannot drive the facade.
//!
//! - A request with more than one `Host` or more than one `Origin` header
//!   line is refused with 400 (RFC 9112 §3.2 for `Host`; RFC 6454 gives
//!   `Origin` one value): which copy a check reads must not matter.
//! - `Host` must name a loopback host (`localhost`, `127.0.0.0/8`, `[::1]`,
//!   any port) or the host of the configured `public_url`; anything else is
//!   refused with 421 (a DNS-rebinding page reaches the facade under its own
//!   host name).
//! - A present `Origin` must be a loopback origin or the `public_url`'s
//!   origin, and `Sec-Fetch-Site: cross-site` without such an `Origin` is
//!   refused too; both with 403 (a cross-site `fetch`, form or no-cors
//!   request).
//! - When a [`FacadeToken`] is configured, `Authorization: Bearer <token>`
//!   must carry it (compared in constant time); else 401 with
//!   `WWW-Authenticate: Bearer`.
//!
//! The JSON-RPC route also requires `Content-Type: application/json` (see
//! `rpc`), and the HTTP+JSON routes a JSON media type on any body or
//! declared `Content-Type` (see `rest`), which a browser cannot send
//! cross-site without a CORS preflight that the facade never answers. A
//! cross-site request without a body (a `GET`, a body-less `fetch`) is
//! refused by the `Origin` and `Sec-Fetch-Site` checks above.
//!
//! Never: logs the token, or answers a refused request with anything but the
//! refusal.

use std::net::IpAddr;
use std::path::Path;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use oab_wire::Digest;

use super::RouterState;

/// The local bearer token the facade may require. Its `Debug` never shows
/// the token.
#[derive(Clone)]
pub struct FacadeToken(Digest);

impl std::fmt::Debug for FacadeToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FacadeToken(..)")
    }
}

/// Why a token could not be had.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    /// The file could not be read.
    #[error("cannot read the facade token file {path}: {source}")]
    Read {
        /// File.
        path: String,
        /// Error.
        source: std::io::Error,
    },
    /// Group or others may read the file.
    #[error("the facade token file {path} has mode {mode:o}; it must be 0600 (chmod 600 {path})")]
    Mode {
        /// File.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// The token is empty or not visible ASCII.
    #[error("the facade token {0} is empty or holds characters other than visible ASCII")]
    Malformed(String),
}

impl FacadeToken {
    /// The token `secret` (surrounding whitespace removed). It must be
    /// visible ASCII, as an `Authorization` header carries it.
    pub fn new(secret: &str) -> Result<FacadeToken, TokenError> {
        let secret = secret.trim();
        if secret.is_empty() || !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TokenError::Malformed("value".into()));
        }
        Ok(FacadeToken(Digest::of(secret.as_bytes())))
    }

    /// The token held in `path`, a file only its owner may read (0600 or
    /// stricter).
    pub fn from_file(path: &Path) -> Result<FacadeToken, TokenError> {
        let shown = path.display().to_string();
        let read = |source| TokenError::Read {
            path: shown.clone(),
            source,
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            let mode = std::fs::metadata(path).map_err(read)?.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(TokenError::Mode { path: shown, mode });
            }
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        FacadeToken::new(&text).map_err(|_| TokenError::Malformed(format!("in {shown}")))
    }

    /// Whether `presented` is the token, in time that does not depend on
    /// where they differ (both are compared as SHA-256 digests).
    fn matches(&self, presented: &str) -> bool {
        let other = Digest::of(presented.as_bytes());
        self.0
            .0
            .iter()
            .zip(other.0.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

/// The host part of an authority (`host`, `host:port`, `[v6]:port`),
/// lower case, without brackets or a trailing dot.
fn host_of(authority: &str) -> Option<String> {
    let authority = authority.trim();
    let host = if let Some(rest) = authority.strip_prefix('[') {
        let (v6, after) = rest.split_once(']')?;
        if !(after.is_empty() || after.starts_with(':')) {
            return None;
        }
        v6
    } else {
        match authority.split_once(':') {
            Some((h, _port)) => h,
            None => authority,
        }
    };
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    (!host.is_empty()).then_some(host)
}

fn is_loopback_host(host: &str) -> bool {
    if host == "localhost" {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// `scheme://authority` of a URL or an `Origin`, lower case.
fn origin_of(url: &str) -> Option<(String, String)> {
    let (scheme, rest) = url.trim().split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    if authority.is_empty() || authority.contains('@') {
        return None;
    }
    Some((scheme.to_ascii_lowercase(), authority.to_ascii_lowercase()))
}

/// What the checks allow, from the facade's options.
struct Allowed<'a> {
    public_url: Option<&'a str>,
}

impl Allowed<'_> {
    fn host(&self, authority: &str) -> bool {
        let Some(host) = host_of(authority) else {
            return false;
        };
        is_loopback_host(&host)
            || self
                .public_url
                .and_then(origin_of)
                .and_then(|(_, a)| host_of(&a))
                .is_some_and(|h| h == host)
    }

    fn origin(&self, origin: &str) -> bool {
        let Some((scheme, authority)) = origin_of(origin) else {
            return false; // `null`, or not an origin
        };
        if !(scheme == "http" || scheme == "https") {
            return false;
        }
        host_of(&authority).is_some_and(|h| is_loopback_host(&h))
            || self
                .public_url
                .and_then(origin_of)
                .is_some_and(|p| p == (scheme, authority))
    }
}

fn refuse(status: StatusCode, message: &str) -> Response {
    (status, format!("{message}\n")).into_response()
}

/// Why a request is refused, or `None` when it may go on.
fn check(options: &super::FacadeOptions, req: &Request) -> Option<Response> {
    let allowed = Allowed {
        public_url: options.public_url.as_deref(),
    };
    let headers = req.headers();
    for (name, shown) in [(header::HOST, "Host"), (header::ORIGIN, "Origin")] {
        if headers.get_all(&name).iter().nth(1).is_some() {
            return Some(refuse(
                StatusCode::BAD_REQUEST,
                &format!("more than one {shown} header; a request carries at most one"),
            ));
        }
    }
    let authority = req
        .uri()
        .authority()
        .map(|a| a.as_str().to_string())
        .or_else(|| {
            headers
                .get(header::HOST)
                .and_then(|h| h.to_str().ok())
                .map(str::to_string)
        });
    if !authority.as_deref().is_some_and(|a| allowed.host(a)) {
        return Some(refuse(
            StatusCode::MISDIRECTED_REQUEST,
            "the Host header must name a loopback host (localhost, 127.0.0.1, [::1]) or the \
             facade's public_url; this request looks like DNS rebinding",
        ));
    }
    let origin = headers.get(header::ORIGIN);
    if let Some(o) = origin
        && !o.to_str().is_ok_and(|o| allowed.origin(o))
    {
        return Some(refuse(
            StatusCode::FORBIDDEN,
            "cross-origin request refused: Origin must be a loopback origin or the facade's \
             public_url",
        ));
    }
    if origin.is_none() && sec_fetch_site(headers) == Some("cross-site") {
        return Some(refuse(
            StatusCode::FORBIDDEN,
            "cross-site request refused (Sec-Fetch-Site: cross-site)",
        ));
    }
    if let Some(token) = &options.token {
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                let (scheme, rest) = v.trim().split_once(' ')?;
                scheme.eq_ignore_ascii_case("bearer").then(|| rest.trim())
            });
        if !presented.is_some_and(|p| token.matches(p)) {
            let mut resp = refuse(
                StatusCode::UNAUTHORIZED,
                "this facade requires Authorization: Bearer <token> (a2a.facade_token_file or \
                 OAB_CONNECTOR_FACADE_TOKEN)",
            );
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return Some(resp);
        }
    }
    None
}

fn sec_fetch_site(headers: &HeaderMap) -> Option<&str> {
    headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
}

/// The middleware in front of every facade route.
pub(super) async fn guard(State(ctx): State<RouterState>, req: Request, next: Next) -> Response {
    match check(&ctx.inner.options, &req) {
        Some(refusal) => refusal,
        None => next.run(req).await,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn hosts() {
        let a = Allowed {
            public_url: Some("http://agents.internal:8080/"),
        };
        for ok in [
            "localhost",
            "localhost:7070",
            "LOCALHOST.:1",
            "127.0.0.1:7070",
            "127.8.9.1",
            "[::1]:7070",
            "[::1]",
            "agents.internal",
            "agents.internal:9",
        ] {
            assert!(a.host(ok), "{ok}");
        }
        for bad in [
            "evil.example:7070",
            "localhost.evil.example",
            "127.0.0.1.evil.example",
            "10.0.0.1",
            "[::2]:1",
            "[::1]x",
            "",
        ] {
            assert!(!a.host(bad), "{bad}");
        }
    }

    #[test]
    fn origins() {
        let a = Allowed {
            public_url: Some("https://agents.internal:8443/base"),
        };
        for ok in [
            "http://localhost:3000",
            "http://127.0.0.1:7070",
            "http://[::1]:7070",
            "https://agents.internal:8443",
        ] {
            assert!(a.origin(ok), "{ok}");
        }
        for bad in [
            "null",
            "http://evil.example",
            "https://agents.internal",
            "http://agents.internal:8443",
            "file://",
            "chrome-extension://abc",
        ] {
            assert!(!a.origin(bad), "{bad}");
        }
    }

    #[test]
    fn token_debug_hides_the_secret_and_compares() {
        let t = FacadeToken::new(" s3cret\n").unwrap();
        assert!(!format!("{t:?}").contains("s3cret"));
        assert!(t.matches("s3cret"));
        assert!(!t.matches("s3cre"));
        assert!(FacadeToken::new("  ").is_err());
    }

    #[cfg(unix)]
    #[test]
    fn token_file_must_be_private() {
        use std::os::unix::fs::PermissionsExt as _;
        let path = std::env::temp_dir().join(format!("oab-facade-token-{}", std::process::id()));
        std::fs::write(&path, "file-secret\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = FacadeToken::from_file(&path).unwrap_err();
        assert!(matches!(e, TokenError::Mode { mode: 0o644, .. }), "{e}");
        assert!(!e.to_string().contains("file-secret"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let t = FacadeToken::from_file(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(t.matches("file-secret"));
    }
}
