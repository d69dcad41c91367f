//! Reading the relay URL: the scheme (`wss://` or `ws://`), the host and
//! the port to dial.
//!
//! Never dials and never resolves names; a URL it refuses stops the link
//! for good (retrying cannot fix it).

pub(super) struct UrlParts {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) tls: bool,
}

pub(super) fn url_parts(url: &str) -> Result<UrlParts, String> {
    let (tls, rest) = if let Some(r) = url.strip_prefix("wss://") {
        (true, r)
    } else if let Some(r) = url.strip_prefix("ws://") {
        (false, r)
    } else {
        return Err(format!(
            "relay url {url:?} must start with wss:// (or ws://)"
        ));
    };
    let authority = rest.split('/').next().unwrap_or_default();
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse::<u16>()
                .map_err(|_| format!("relay url {url:?}: bad port"))?,
        ),
        None => (authority, if tls { 443 } else { 80 }),
    };
    if host.is_empty() {
        return Err(format!("relay url {url:?} has no host"));
    }
    Ok(UrlParts {
        host: host.trim_matches(['[', ']']).to_string(),
        port,
        tls,
    })
}
