//! `oab-connector`: make an identity, check a configuration, or run the
//! connector beside an OAB host.
//!
//! It owns the command line, reading the configuration and the identity, and
//! wiring the connector, the A2A driver (callee side) and the A2A facade
//! (caller side) for `run`.
//!
//! Never: runs on a configuration that failed validation, and never overwrites
//! an identity file (`keygen` refuses an existing one).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use std::sync::Arc;

use oab_connector::a2a::{
    A2aDriver, DelegationDefaults, DriverOptions, Facade, FacadeOptions, FacadeToken,
};
use oab_connector::authority::{Grant, Policy};
use oab_connector::callee::{CalleeOptions, LivePolicy};
use oab_connector::config::ConnectorConfig;
use oab_connector::link::LinkSettings;
use oab_connector::openab::{OpenAbEndpoint, RuntimeKeys};
use oab_connector::trust::RelayTrust;
use oab_connector::{Connector, ConnectorOptions, Reconfiguration};
use oab_wire::identity::Identity;
use oab_wire::{Digest, KeyId, PeerId};

/// The connector's allocator: jemalloc. Under the A2A path's load glibc's
/// `malloc`, `free` and `malloc_consolidate` were about a tenth of the callee
/// connector's CPU (BENCHMARKS.md, "A2A blocking calls"), and a connector
/// runs for months beside its host, where jemalloc's background threads give
/// freed pages back to the system (as they do for the relay).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The OAB connector: dials out to an OAB relay, keeps the session alive,
/// and delegates tasks to (and serves tasks from) other OAB hosts.
///
/// Any config value can be overridden with `--set section.field=value` or
/// `OAB_CONNECTOR__SECTION__FIELD=value` (`run` and `check-config`).
#[derive(Debug, Parser)]
#[command(version = oab_ops::build::LONG_VERSION, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
    /// Log format (on stderr).
    #[arg(long, global = true, env = "OAB_LOG_FORMAT", default_value = "text")]
    log_format: oab_ops::logging::LogFormat,
}

/// Config overrides: `OAB_CONNECTOR__*` variables, then each `--set` in order.
fn overrides(sets: &[String]) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = oab_ops::overrides::env_overrides(oab_connector::config::ENV_PREFIX);
    for s in sets {
        out.push(oab_ops::overrides::parse_set(s)?);
    }
    Ok(out)
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Make a new identity file (mode 0600) and print the public key line
    /// to put in the relay's and the other peers' configuration.
    Keygen {
        /// The peer id, `namespace/name` (lower case).
        #[arg(long)]
        peer: String,
        /// The key id (e.g. the month it was made: `2026-11`).
        #[arg(long)]
        key_id: String,
        /// Where to write the identity (refuses to overwrite).
        #[arg(long)]
        out: PathBuf,
    },
    /// Validate a configuration file; names every bad field. Warns (exit 0)
    /// about values that cannot delegate or lock callers out.
    CheckConfig {
        /// The TOML file.
        file: PathBuf,
        /// Override any value: `section.field=value` (repeatable).
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        /// Also check it against the relay's configuration: this host and
        /// its peers (and their keys) known there, routes to and from it,
        /// route ceilings against `[policy]` and the capabilities asked for.
        #[arg(long)]
        relay_config: Option<PathBuf>,
        /// This host's peer id, for --relay-config (default: from the
        /// identity file `connector.identity`, whose key is then compared
        /// with the relay's too).
        #[arg(long, requires = "relay_config")]
        peer: Option<String>,
    },
    /// Print a running connector's status (link, relay, published
    /// descriptor, open delegations) from its admin endpoint's `/status`
    /// (`[admin] listen` in its configuration).
    Status {
        /// The connector's admin address (`admin.listen`): `host:port` or
        /// `http://host:port`. Default: `admin.listen` of --config, else
        /// 127.0.0.1:9444.
        #[arg(long, env = "OAB_CONNECTOR_ADMIN_URL")]
        admin: Option<String>,
        /// The connector's configuration file: its `admin.listen` is asked.
        #[arg(long, short, env = "OAB_CONNECTOR_CONFIG")]
        config: Option<PathBuf>,
        /// Override any value of --config: `section.field=value` (repeatable).
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        /// Print the JSON as served instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Delegate one task from `dev/alice` to `dev/bob` through a running
    /// development relay (`cargo run -p oab-relay` in this folder first) and
    /// print its progress and its verified result.
    Demo {
        /// The folder the development relay wrote.
        #[arg(long, default_value = ".oab-dev")]
        dev_dir: PathBuf,
        /// The relay URL (default: `wss://localhost:<port>/` from the
        /// folder's `relay.toml`).
        #[arg(long)]
        relay_url: Option<String>,
        /// The same through the A2A facade and driver: dev/alice's facade
        /// (from `dev-alice.connector.toml`), dev/bob's driver towards a demo
        /// A2A agent (at the address of `dev-bob.connector.toml`'s
        /// `a2a.driver_url`), the demo as an A2A client of the facade.
        #[arg(long)]
        a2a: bool,
        /// With --a2a: keep the facade up after the delegation, for any A2A
        /// client, until Ctrl-C.
        #[arg(long, requires = "a2a")]
        keep: bool,
        /// With --a2a: where the facade listens (default: dev/alice's
        /// `a2a.facade_listen`, 127.0.0.1:7070).
        #[arg(long, requires = "a2a")]
        facade_listen: Option<std::net::SocketAddr>,
        /// With --a2a: where the demo A2A agent listens (default: the address
        /// of dev/bob's `a2a.driver_url`, 127.0.0.1:7080).
        #[arg(long, requires = "a2a")]
        agent_listen: Option<std::net::SocketAddr>,
    },
    /// Run the connector with a configuration file until SIGTERM/SIGINT.
    Run {
        /// The TOML file.
        #[arg(long, short, env = "OAB_CONNECTOR_CONFIG")]
        config: PathBuf,
        /// Override any value: `section.field=value` (repeatable).
        #[arg(long = "set", value_name = "PATH=VALUE")]
        set: Vec<String>,
        /// Async worker threads (default: one per CPU).
        #[arg(long, env = "OAB_CONNECTOR_WORKER_THREADS", value_parser = parse_threads)]
        worker_threads: Option<usize>,
        /// Busy polling, in microseconds (0, the default: off): after each
        /// frame batch from the relay, one async task keeps polling the
        /// sockets for this long instead of letting its worker sleep, so the
        /// next frame does not wait for an idle CPU to wake. Costs up to that
        /// much CPU per batch; meant for --worker-threads 1. At most 10000.
        #[arg(long, env = "OAB_CONNECTOR_BUSY_POLL_US", value_parser = oab_ops::busy_poll::parse_window)]
        busy_poll_us: Option<std::time::Duration>,
    },
}

/// A worker thread count (`0` or empty: one per CPU).
fn parse_threads(s: &str) -> Result<usize, String> {
    if s.trim().is_empty() {
        return Ok(0);
    }
    s.trim()
        .parse::<usize>()
        .map_err(|_| format!("expected a number of threads, got {s:?}"))
}

/// Runs the command; an error is printed once, as one line of causes
/// (`oab_ops::logging::error_line`, never a backtrace, whatever `RUST_BACKTRACE` says), with exit
/// code 2 when the configuration was refused (unreadable or invalid) and 1
/// otherwise.
fn main() -> std::process::ExitCode {
    match run_command() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oab-connector: {}", oab_ops::logging::error_line(e.chain()));
            if e.downcast_ref::<oab_connector::config::ConfigError>()
                .is_some()
            {
                std::process::ExitCode::from(2)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}

#[allow(clippy::print_stdout)]
fn run_command() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let _ = rustls::crypto::ring::default_provider().install_default();
    match cli.command {
        Cmd::Keygen { peer, key_id, out } => {
            let peer = PeerId::new(&peer)?;
            let key_id = KeyId::new(&key_id)?;
            let id = Identity::generate(peer, key_id);
            oab_connector::keyfile::save(&id, &out)?;
            println!("wrote {} (keep it private)", out.display());
            println!("[[peers]]");
            println!("id = \"{}\"", id.peer);
            println!(
                "keys = [{{ key_id = \"{}\", public_key = \"{}\" }}]",
                id.key_id,
                id.public_key()
            );
            Ok(())
        }
        Cmd::Status {
            admin,
            config,
            set,
            json,
        } => {
            let done = status_target(admin, config.as_deref(), &set)
                .and_then(|(admin, hint)| print_status(&admin, &hint, json));
            if let Err(e) = done {
                eprintln!("oab-connector status: {e:#}");
                std::process::exit(1);
            }
            Ok(())
        }
        Cmd::CheckConfig {
            file,
            set,
            relay_config,
            peer,
        } => match ConnectorConfig::load_with_overrides(&file, &overrides(&set)?) {
            Ok(c) => {
                println!("{}: ok ({} peers)", file.display(), c.peers.len());
                // Valid, but cannot delegate or locks callers out: said, exit 0.
                let mut warnings =
                    oab_connector::lockout::warnings(&c, oab_wire::identity::now_ms());
                if let Some(relay) = relay_config {
                    match against_relay(&c, &relay, peer.as_deref()) {
                        Ok(w) => warnings.extend(w),
                        Err(e) => {
                            eprintln!("{e:#}");
                            std::process::exit(2);
                        }
                    }
                }
                // The files it finds on this host (the file may be checked
                // elsewhere than where the connector runs: a file that is
                // not here is not said): warnings.
                let here = "(the connector does not start with it)";
                if c.connector.identity.exists()
                    && let Err(e) = load_identity(&c.connector.identity)
                {
                    warnings.push(format!("{e:#} {here}"));
                }
                if let Some(ca) = c.connector.relay_ca.as_ref().filter(|ca| ca.exists())
                    && let Err(e) = load_ca_certs(ca)
                {
                    warnings.push(format!("{e:#} {here}"));
                }
                for w in warnings {
                    eprintln!("warning: {w}");
                }
                Ok(())
            }
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        },
        Cmd::Demo {
            dev_dir,
            relay_url,
            a2a,
            keep,
            facade_listen,
            agent_listen,
        } => {
            let options = oab_connector::demo::DemoOptions {
                dev_dir,
                relay_url,
                facade_listen,
                agent_listen,
            };
            let runtime = tokio::runtime::Runtime::new().context("starting the async runtime")?;
            let mut out = std::io::stdout();
            let done = runtime.block_on(async {
                // Ctrl-C (or SIGTERM) at any point is the demo's: it says
                // it stopped instead of vanishing.
                let stop = tokio_util::sync::CancellationToken::new();
                let signal = Arc::new(std::sync::OnceLock::<&'static str>::new());
                let mut signals = Signals::new();
                let (stop_on_signal, seen) = (stop.clone(), signal.clone());
                tokio::spawn(async move {
                    loop {
                        if let Signal::Stop(name) = signals.next().await {
                            let _ = seen.set(if name == "SIGINT" { "Ctrl-C" } else { name });
                            stop_on_signal.cancel();
                            return;
                        }
                    }
                });
                let stopped = move || signal.get().copied().unwrap_or("Ctrl-C").to_string();
                if a2a {
                    oab_connector::demo::a2a::run(&options, keep, stop, stopped, &mut out).await
                } else {
                    tokio::select! {
                        biased;
                        r = oab_connector::demo::run(&options, &mut out) => r,
                        () = stop.cancelled() => Err(oab_connector::demo::DemoError::Interrupted {
                            signal: stopped(),
                        }),
                    }
                }
            });
            match done {
                Ok(()) => {}
                Err(e @ oab_connector::demo::DemoError::Interrupted { .. }) => {
                    eprintln!("demo {e}");
                    std::process::exit(130);
                }
                Err(e) => {
                    eprintln!("demo failed: {e}");
                    std::process::exit(1);
                }
            }
            Ok(())
        }
        Cmd::Run {
            config,
            set,
            worker_threads,
            busy_poll_us,
        } => {
            oab_ops::logging::init(cli.log_format, true);
            let overrides = overrides(&set)?;
            let mut builder = tokio::runtime::Builder::new_multi_thread();
            if let Some(n) = worker_threads.filter(|&n| n > 0) {
                builder.worker_threads(n);
            }
            let runtime = builder
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime.block_on(async {
                if let Some(window) = busy_poll_us
                    && oab_ops::busy_poll::start(window)
                {
                    let workers = tokio::runtime::Handle::current().metrics().num_workers();
                    tracing::info!(
                        window_us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX),
                        workers,
                        "busy polling after each frame batch from the relay"
                    );
                    if workers > 1 {
                        tracing::warn!(
                            workers,
                            "busy polling with more than one async worker: an idle worker can take the wake-ups the poller was to save; --worker-threads 1 is the setting it is meant for"
                        );
                    }
                }
                run(config, overrides).await
            })
        }
    }
}

/// The admin address `oab-connector status` asks, and where to look when
/// it does not answer: `--admin`, else `admin.listen` of `--config` (with
/// the overrides), else 127.0.0.1:9444.
fn status_target(
    admin: Option<String>,
    config: Option<&std::path::Path>,
    set: &[String],
) -> anyhow::Result<(String, String)> {
    if let Some(admin) = admin {
        return Ok((
            admin,
            "is the connector running with [admin] listen set, and is --admin that address?".into(),
        ));
    }
    let Some(path) = config else {
        return Ok((
            "http://127.0.0.1:9444".into(),
            "is the connector running with [admin] listen set? Without --config or --admin \
             this asks 127.0.0.1:9444; pass --config <connector.toml> or --admin <admin.listen>"
                .into(),
        ));
    };
    let c = ConnectorConfig::load_with_overrides(path, &overrides(set)?)?;
    let shown = path.display();
    let Some(listen) = c.admin.listen else {
        anyhow::bail!(
            "{shown}: admin.listen is not set, so the connector serves no /status; add \
             `[admin]` with `listen = \"127.0.0.1:9444\"` to it and restart the connector"
        );
    };
    Ok((
        oab_ops::admin_client::url_of_listen(listen),
        format!("is the connector of {shown} running? This is its admin.listen"),
    ))
}

/// `oab-connector status`: fetches `/status` and prints it.
#[allow(clippy::print_stdout)]
fn print_status(admin: &str, hint: &str, json: bool) -> anyhow::Result<()> {
    let (url, body) =
        oab_ops::admin_client::fetch_status(admin, hint).map_err(anyhow::Error::msg)?;
    if json {
        println!("{}", String::from_utf8_lossy(&body));
        return Ok(());
    }
    let status: oab_connector::status::ConnectorStatus = serde_json::from_slice(&body)
        .with_context(|| format!("{url}: not the /status of this connector version"))?;
    print!("{}", status.render());
    Ok(())
}

/// `check-config --relay-config`: `config` against the relay's file, as
/// `peer` (else the identity file's peer, and its key).
fn against_relay(
    config: &ConnectorConfig,
    relay: &std::path::Path,
    peer: Option<&str>,
) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(relay)
        .with_context(|| format!("--relay-config: cannot read {}", relay.display()))?;
    let (me, key) = match peer {
        Some(p) => (PeerId::new(p).context("--peer")?.to_string(), None),
        None => {
            let id =
                oab_connector::keyfile::load(&config.connector.identity).with_context(|| {
                    "--relay-config needs this host's peer id: pass --peer, or run where \
                 connector.identity is readable"
                })?;
            (
                id.peer.to_string(),
                Some((id.key_id.to_string(), id.public_key().to_string())),
            )
        }
    };
    let key = key.as_ref().map(|(i, k)| (i.as_str(), k.as_str()));
    oab_connector::lockout::against_relay(config, &me, key, &text)
        .map_err(|e| anyhow::anyhow!("--relay-config {}: {e}", relay.display()))
}

async fn run(path: PathBuf, overrides: Vec<(String, String)>) -> anyhow::Result<()> {
    // First: a SIGHUP before its handler exists would end the process.
    let mut signals = Signals::new();
    let config = ConnectorConfig::load_with_overrides(&path, &overrides)?;
    for w in oab_connector::lockout::warnings(&config, oab_wire::identity::now_ms()) {
        tracing::warn!("{w}");
    }
    let c = &config.connector;
    let identity = load_identity(&c.identity)?;
    let mut link = LinkSettings::new(c.relay_url.clone(), relay_trust_of(&config)?, identity);
    link.relay_id = c.relay_id.clone();
    link.challenge_only = c.challenge_only_binding;
    let p = &config.policy;
    let policy = policy_of(&config)?;
    // The callee side's policy, replaced by a reload.
    let callee_policy = Arc::new(LivePolicy::new(policy.clone()));
    // Callee side: the A2A driver forwards delegations to the local A2A
    // server; without one, incoming delegations get a signed `rejected`.
    let driver = match &config.a2a.driver_url {
        Some(url) => {
            let mut options = DriverOptions::new(url.clone());
            if let Some(ms) = config.a2a.input_timeout_ms {
                options.input_timeout = Duration::from_millis(ms);
            }
            options.binding = config.a2a.driver_binding;
            Some(A2aDriver::new(options)?)
        }
        None => None,
    };
    // The OpenAB endpoint: local OAB runtimes register there; with
    // `[[openab.serve]]` its workers serve incoming delegations.
    let openab = match config.openab.listen {
        Some(_) => Some(OpenAbEndpoint::new(
            config.openab.clone(),
            RuntimeKeys::load(&config.openab)?,
        )),
        None => None,
    };
    let executor: Option<Arc<dyn oab_connector::TaskExecutor>> = match (&driver, &openab) {
        (Some(d), _) => Some(Arc::new(d.clone())),
        (None, Some(o)) if config.openab.serves() => Some(Arc::new(o.executor())),
        _ => None,
    };
    let callee = executor.map(|executor| CalleeOptions {
        executor,
        policy: callee_policy.clone(),
        max_concurrent: p.max_concurrent,
        max_concurrent_per_peer: p.max_concurrent_per_peer,
        max_live_requests_per_peer: p.max_live_requests_per_peer,
        replay_window_ms: p.replay_window_ms,
    });
    let connector = Connector::start(ConnectorOptions {
        link,
        trust: config.trust(),
        grant: Grant {
            capabilities: policy.allowed_capabilities.clone(),
            remaining: policy.budgets,
        },
        caller_policy: policy,
        callee,
        audit: None,
        state: match &c.state_dir {
            Some(dir) => Some(oab_connector::state::FileState::open(dir)?),
            None => None,
        },
    })?;
    // Caller side: the A2A facade for local A2A clients, made before the
    // admin endpoint so `/metrics` shows its push deliveries.
    let facade = match config.a2a.facade_listen {
        None => None,
        Some(addr) => {
            let base = DelegationDefaults::default();
            let defaults = DelegationDefaults {
                capabilities: config.a2a.default_capabilities.clone(),
                timeout: config
                    .a2a
                    .default_timeout_ms
                    .map_or(base.timeout, Duration::from_millis),
                ..base
            };
            let token = match std::env::var("OAB_CONNECTOR_FACADE_TOKEN") {
                Ok(secret) => {
                    Some(FacadeToken::new(&secret).context("OAB_CONNECTOR_FACADE_TOKEN")?)
                }
                Err(_) => match &config.a2a.facade_token_file {
                    Some(file) => Some(FacadeToken::from_file(file)?),
                    None => None,
                },
            };
            let options = FacadeOptions {
                public_url: config.a2a.public_url.clone(),
                token,
                defaults,
                push: config.a2a.push_options(),
                header_read_timeout: Duration::from_millis(config.a2a.facade_header_timeout_ms),
                ..FacadeOptions::default()
            };
            let options_have_token = options.token.is_some();
            Some((
                addr,
                options_have_token,
                Facade::new(connector.caller().clone(), options),
            ))
        }
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    if let Some(addr) = config.admin.listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding admin.listen {addr}"))?;
        if !addr.ip().is_loopback() {
            tracing::warn!(%addr, "admin endpoint off loopback: /status names peers and delegations");
        }
        tracing::info!(%addr, "admin endpoint listening (/metrics, /healthz, /readyz, /status)");
        let sources = oab_connector::admin::AdminSources::new(connector.link().clone())
            .with_facade(facade.as_ref().map(|(_, _, f)| f.clone()));
        tokio::spawn(oab_connector::admin::serve(
            listener,
            sources,
            shutdown.child_token(),
        ));
    }
    if let (Some(endpoint), Some(addr)) = (&openab, config.openab.listen) {
        endpoint.set_caller(connector.caller().clone());
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding openab.listen {addr}"))?;
        tracing::info!(%addr, runtimes = config.openab.runtimes.len(), "OpenAB control-plane endpoint listening");
        tokio::spawn(oab_connector::openab::serve(
            listener,
            endpoint.clone(),
            shutdown.child_token(),
        ));
    }
    if let Some((addr, options_have_token, facade)) = facade {
        // Delegations an earlier process left open get their tasks back
        // before the first client asks.
        let restored = facade
            .restore()
            .await
            .context("restoring delegations from connector.state_dir")?;
        if restored > 0 {
            tracing::info!(
                restored,
                "took back delegations left open by an earlier run"
            );
        }
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding a2a.facade_listen {addr}"))?;
        tracing::info!(
            %addr,
            bearer_token = options_have_token,
            "A2A facade listening (agents under /peers/<namespace>/<name>/)"
        );
        tokio::spawn(oab_connector::a2a::serve(
            listener,
            facade,
            shutdown.child_token(),
        ));
    }
    {
        // Waits for the first connection (at most 30 s, then goes on); then
        // the card is published once the local A2A server answers, however
        // long after this connector it starts. Signals are taken all along:
        // SIGHUP reloads, SIGTERM/SIGINT stop (and stop the retries).
        let connected = connector.connected();
        let patience = tokio::time::sleep(Duration::from_secs(30));
        let published = async {
            if let Some(d) = &driver {
                oab_connector::a2a::publish_card(&connector, d).await;
            }
        };
        tokio::pin!(connected, patience, published);
        let mut running = config.clone();
        let (mut connecting, mut publishing) = (true, true);
        loop {
            tokio::select! {
                r = &mut connected, if connecting => {
                    connecting = false;
                    r?;
                    tracing::info!("connected to the relay");
                }
                () = &mut patience, if connecting => {
                    connecting = false;
                    tracing::warn!("still connecting to the relay");
                }
                () = &mut published, if publishing && !connecting => publishing = false,
                signal = signals.next() => match signal {
                    Signal::Stop(name) => {
                        let stats = connector.link().stats();
                        use oab_connector::link::stats::Side;
                        tracing::info!(
                            signal = name,
                            open_as_caller = stats.open(Side::Caller),
                            open_as_callee = stats.open(Side::Callee),
                            unacked_frames = stats.unacked(),
                            "stopping: closing the listeners, then the relay link; open \
                             delegations stay open at the relay"
                        );
                        break;
                    }
                    Signal::Reload => reload(&path, &overrides, &mut running, &connector, &callee_policy),
                },
            }
        }
    }
    shutdown.cancel();
    connector.shutdown().await;
    tracing::info!("connector stopped");
    Ok(())
}

/// How the relay's certificate is trusted (`relay_ca`, `relay_pin_sha256`,
/// or WebPKI); reads the CA file.
fn relay_trust_of(config: &ConnectorConfig) -> anyhow::Result<RelayTrust> {
    let c = &config.connector;
    Ok(match (&c.relay_ca, &c.relay_pin_sha256) {
        (Some(ca), _) => RelayTrust::Ca(load_ca_certs(ca)?),
        (None, Some(pin)) => RelayTrust::Pin(Digest::parse(pin).context("relay_pin_sha256")?),
        (None, None) => RelayTrust::WebPki,
    })
}

/// `[policy]`: the callee side's policy, and the caller side's own grant.
fn policy_of(config: &ConnectorConfig) -> anyhow::Result<Policy> {
    Ok(config.policy.policy()?)
}

/// Re-reads the configuration file (`SIGHUP`) and applies what a reload
/// applies (`config::RELOADABLE`): the peers' keys, `[policy]`'s
/// capabilities, writes and deadline, and the relay trust. A file that fails
/// validation, or a CA file that cannot be read, changes nothing; changed
/// fields that need a restart are logged and not applied.
fn reload(
    path: &std::path::Path,
    overrides: &[(String, String)],
    running: &mut ConnectorConfig,
    connector: &Connector,
    callee_policy: &LivePolicy,
) {
    let refused = |e: &dyn std::fmt::Display| {
        tracing::warn!(error = %e, "configuration reload refused; the old configuration keeps serving");
    };
    let new = match ConnectorConfig::load_with_overrides(path, overrides) {
        Ok(c) => c,
        Err(e) => return refused(&e),
    };
    let (policy, relay_trust) = match policy_of(&new).and_then(|p| Ok((p, relay_trust_of(&new)?))) {
        Ok(x) => x,
        Err(e) => return refused(&format!("{e:#}")),
    };
    let update = Reconfiguration {
        trust: new.trust(),
        grant: Grant {
            capabilities: policy.allowed_capabilities.clone(),
            remaining: policy.budgets,
        },
        caller_policy: policy.clone(),
        relay_trust,
    };
    if let Err(e) = connector.reload(update) {
        return refused(&e);
    }
    callee_policy.set(policy);
    for field in running.needs_restart(&new) {
        tracing::warn!(%field, "configuration reload: this field changed and needs a restart; not applied");
    }
    running.peers = new.peers;
    running.connector.relay_ca = new.connector.relay_ca;
    running.connector.relay_pin_sha256 = new.connector.relay_pin_sha256;
    running.policy.allowed_capabilities = new.policy.allowed_capabilities;
    running.policy.allow_writes = new.policy.allow_writes;
    running.policy.max_deadline_ms = new.policy.max_deadline_ms;
    tracing::info!(peers = running.peers.len(), "configuration reloaded");
}

/// What an I/O error on a configured file means for the operator.
fn io_problem(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file; check the path".into(),
        std::io::ErrorKind::PermissionDenied => {
            "permission denied; the connector's user cannot read it".into()
        }
        _ => e.to_string(),
    }
}

/// `connector.identity`, named with the field and the fix when it cannot
/// be used.
fn load_identity(path: &std::path::Path) -> anyhow::Result<Identity> {
    use oab_connector::keyfile::KeyFileError;
    oab_connector::keyfile::load(path).map_err(|e| {
        let shown = path.display();
        match e {
            KeyFileError::Io { error, .. } if error.kind() == std::io::ErrorKind::NotFound => {
                anyhow::anyhow!(
                    "connector.identity ({shown}): no such file; make one with \
                     `oab-connector keygen --peer <namespace/name> --key-id <id> --out {shown}` \
                     and put the key line it prints in the relay's [[peers]]"
                )
            }
            KeyFileError::Io { error, .. } => {
                anyhow::anyhow!("connector.identity ({shown}): {}", io_problem(&error))
            }
            other => anyhow::anyhow!("connector.identity: {other}"),
        }
    })
}

fn load_ca_certs(
    path: &std::path::Path,
) -> anyhow::Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::pem::PemObject as _;
    let shown = path.display();
    let text = std::fs::read(path)
        .map_err(|e| anyhow::anyhow!("connector.relay_ca ({shown}): {}", io_problem(&e)))?;
    let certs: Result<Vec<_>, _> =
        rustls::pki_types::CertificateDer::pem_slice_iter(&text).collect();
    let certs = certs.map_err(|e| anyhow::anyhow!("connector.relay_ca ({shown}): {e}"))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "connector.relay_ca ({shown}): no CERTIFICATE block; give the PEM certificate of the \
         CA that signed the relay's certificate"
    );
    Ok(certs)
}

enum Signal {
    /// SIGTERM, SIGINT (Ctrl-C): which one.
    Stop(&'static str),
    /// SIGHUP.
    Reload,
}

/// The process signals `run` acts on, registered once.
struct Signals {
    #[cfg(unix)]
    unix: Option<(
        tokio::signal::unix::Signal,
        tokio::signal::unix::Signal,
        tokio::signal::unix::Signal,
    )>,
}

impl Signals {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let unix = match (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
                signal(SignalKind::hangup()),
            ) {
                (Ok(t), Ok(i), Ok(h)) => Some((t, i, h)),
                _ => None,
            };
            Signals { unix }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    async fn next(&mut self) -> Signal {
        #[cfg(unix)]
        if let Some((term, int, hup)) = &mut self.unix {
            return tokio::select! {
                _ = term.recv() => Signal::Stop("SIGTERM"),
                _ = int.recv() => Signal::Stop("SIGINT"),
                _ = hup.recv() => Signal::Reload,
            };
        }
        let _ = tokio::signal::ctrl_c().await;
        Signal::Stop("Ctrl-C")
    }
}
