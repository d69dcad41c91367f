//! Reading the relay URL: the scheme (`wss://` or `ws://`), the host and
//! the port to dial, taken from the URI of the WebSocket upgrade request
//! (so an IPv6 literal such as `wss://[::1]/` reads as host `::1`, port 443).
//!
//! Never dials and never resolves names; a URL it refuses stops the link
//! for good (retrying cannot fix it).

use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
use tokio_tungstenite::tungstenite::error::{Error, UrlError};
use tokio_tungstenite::tungstenite::handshake::client::Request;

/// `url` as logs and errors show it: user info (a user name and password,
/// or a token, before `@`) replaced by `***`.
pub(crate) fn redacted(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    match authority.rsplit_once('@') {
        Some((_, host)) => format!("{scheme}://***@{host}{tail}"),
        None => url.to_string(),
    }
}

/// Where to dial the relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RelayUrl {
    /// Host name or IP address (an IPv6 literal without its brackets).
    pub(super) host: String,
    /// The URL's port, else 443 for `wss://` and 80 for `ws://`.
    pub(super) port: u16,
    /// `wss://`: TLS to the relay.
    pub(super) tls: bool,
}

/// The WebSocket upgrade request for the relay URL, and where to dial it.
/// Errors name the URL and what is wrong with it.
pub(super) fn relay_request(url: &str) -> Result<(Request, RelayUrl), String> {
    let shown = redacted(url);
    let no_host = || format!("relay url {shown:?} has no host");
    let request = url.into_client_request().map_err(|e| match e {
        Error::Url(UrlError::NoHostName | UrlError::EmptyHostName) => no_host(),
        // The URI parser's errors name no part: an empty authority
        // (`wss://`, `wss:///`) is told as the missing host it is.
        _ if url
            .split_once("://")
            .is_some_and(|(_, rest)| rest.starts_with(['/', '?', '#']) || rest.is_empty()) =>
        {
            no_host()
        }
        e => format!("relay url {shown:?} is not a valid wss:// (or ws://) URL: {e}"),
    })?;
    let uri = request.uri();
    let tls = match uri.scheme_str() {
        Some("wss") => true,
        Some("ws") => false,
        _ => {
            return Err(format!(
                "relay url {shown:?} must start with wss:// (or ws://)"
            ));
        }
    };
    let authority = uri.authority().ok_or_else(no_host)?;
    // [userinfo@]host[:port]; the host of an IPv6 literal keeps its brackets.
    let host_port = authority
        .as_str()
        .rsplit_once('@')
        .map_or(authority.as_str(), |(_, h)| h);
    if host_port.is_empty() {
        return Err(no_host());
    }
    let host = authority.host();
    if host.is_empty() {
        return Err(no_host());
    }
    // A port that is there must be a u16: `Authority::port` would read a bad
    // one as absent, and the default would be dialled instead.
    let port = match host_port.get(host.len()..).unwrap_or_default() {
        "" => {
            if tls {
                443
            } else {
                80
            }
        }
        rest => rest
            .strip_prefix(':')
            .and_then(|p| p.parse::<u16>().ok())
            .ok_or_else(|| format!("relay url {shown:?}: bad port"))?,
    };
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_string();
    Ok((request, RelayUrl { host, port, tls }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::unwrap_used)]
    fn user_info_is_never_shown() {
        for (url, shown) in [
            (
                "wss://u:s3cret@relay.example:7443/x",
                "wss://***@relay.example:7443/x",
            ),
            ("wss://t0ken@relay.example/", "wss://***@relay.example/"),
            ("wss://relay.example/a@b", "wss://relay.example/a@b"),
            ("wss://relay.example:7443/", "wss://relay.example:7443/"),
        ] {
            assert_eq!(redacted(url), shown);
        }
        let e = relay_request("wss://u:s3cret@relay.example:99999/").unwrap_err();
        assert!(!e.contains("s3cret"), "{e}");
        let settings = super::super::LinkSettings::new(
            "wss://u:s3cret@relay.example/",
            crate::trust::RelayTrust::WebPki,
            oab_wire::identity::Identity::generate(
                oab_wire::PeerId::new("acme/a").unwrap(),
                oab_wire::KeyId::new("k1").unwrap(),
            ),
        );
        let debug = format!("{settings:?}");
        assert!(!debug.contains("s3cret"), "{debug}");
        assert!(debug.contains("relay.example"), "{debug}");
    }

    #[test]
    fn host_port_and_scheme() {
        for (url, host, port, tls) in [
            ("wss://[::1]/", "::1", 443, true),
            ("wss://[::1]", "::1", 443, true),
            ("wss://[::1]:8443/relay", "::1", 8443, true),
            ("ws://[fe80::1]/", "fe80::1", 80, false),
            ("wss://relay.example/", "relay.example", 443, true),
            ("wss://relay.example:7443", "relay.example", 7443, true),
            ("ws://127.0.0.1:8080/", "127.0.0.1", 8080, false),
            ("ws://relay.internal", "relay.internal", 80, false),
        ] {
            let (request, parsed) = relay_request(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(
                parsed,
                RelayUrl {
                    host: host.to_string(),
                    port,
                    tls
                },
                "{url}"
            );
            assert_eq!(
                request.uri().to_string().trim_end_matches('/'),
                url.trim_end_matches('/')
            );
        }
    }

    #[test]
    fn refusals_say_what_is_wrong() {
        for (url, says) in [
            (
                "https://relay.example/",
                "must start with wss:// (or ws://)",
            ),
            ("relay.example:443", "must start with wss:// (or ws://)"),
            ("", "is not a valid wss:// (or ws://) URL"),
            ("wss://", "has no host"),
            ("wss:///", "has no host"),
            ("wss://:443/", "has no host"),
            ("wss://relay.example:99999/", "bad port"),
            ("wss://relay.example:/", "bad port"),
        ] {
            match relay_request(url) {
                Ok((_, parsed)) => panic!("{url:?} accepted as {parsed:?}"),
                Err(e) => assert!(e.contains(says), "{url:?}: {e:?} does not say {says:?}"),
            }
        }
    }
}
