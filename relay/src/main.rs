//! `oab-relay`: run the relay, or check a configuration.
//!
//! It owns the command line (flags, `--set`, environment overrides), the
//! runtime, binding the listeners, choosing the store and the shutdown signals,
//! and the process's allocator; the relay itself is `oab_relay::run`.
//!
//! Never: serves with a configuration that failed validation: the file, the
//! flags and the environment are merged and validated first
//! (`Config::from_toml_with_overrides`).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use oab_relay::config::{Config, TlsMode, env_overrides};
use oab_relay::store::EventStore as _;
use oab_relay::store::{MemoryStore, RedisStore};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The relay's allocator: jemalloc, with background threads that return
/// freed pages to the system (`dirty_decay_ms`, 10 s). With glibc's malloc,
/// the memory of a reconnect storm's sessions stayed with the process after
/// they closed (15,000 idle sessions: 365 MiB open, 233 MiB 10 s after all
/// closed, against 52 MiB before, of which 61 MiB was live heap): freed
/// chunks stayed in the per-thread arenas. Measured in BENCHMARKS.md,
/// "Sessions".
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// The OAB relay: connectors of two OAB hosts dial out to it over WSS and
/// delegate tasks to each other through it.
///
/// With no --config, runs a development relay: on first run it writes a
/// self-signed certificate, two development identities (dev/alice, dev/bob)
/// and a config into --dev-dir, prints where they are, and serves with the
/// in-memory store. A field of a plain section can be overridden with
/// `--set section.field=value` or `OAB_RELAY__SECTION__FIELD=value`
/// (not entries of `[[peers]]` or `[[routes]]`).
///
/// Several instances over one Redis (or Redis Cluster) form a fleet behind an
/// L4 load balancer: give each its own `--set fleet.node=NAME`, the same
/// config otherwise (docs/scale-out.md).
#[derive(Debug, Parser)]
#[command(version = oab_ops::build::LONG_VERSION, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Validate a configuration file without starting; names every bad field.
    CheckConfig {
        /// The TOML file.
        file: PathBuf,
    },
    /// Print a running relay's status (peers online, open delegations per
    /// route, fleet members, store health) from its admin port's `/status`:
    /// the address given with --admin, else `relay.admin_listen` of
    /// --config, else the development relay's (127.0.0.1:9443).
    Status {
        /// The relay's admin address (`relay.admin_listen`): `host:port` or
        /// `http://host:port`.
        #[arg(long, env = "OAB_RELAY_ADMIN_URL")]
        admin: Option<String>,
        /// Print the JSON as served instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Show where one delegation is, from a running relay's admin port
    /// (`/delegation`): its parties and the instance serving each, its state
    /// and times, the last sequence stored, acknowledged and delivered in
    /// each direction, follow-ups and cancels, its store keys and what it
    /// waits for. The relay is found as for `status`. Exit code 1 when no
    /// delegation has the id.
    Inspect {
        /// The delegation: its key (`<caller peer>#<request id>`), the A2A
        /// task id the facade gave it (`task-<32 hex>`), or the delegation
        /// id an OpenAB runtime gave it at a connector's CP endpoint.
        id: String,
        /// The relay's admin address (`relay.admin_listen`): `host:port` or
        /// `http://host:port`.
        #[arg(long, env = "OAB_RELAY_ADMIN_URL")]
        admin: Option<String>,
        /// Print the JSON as served instead of text.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Configuration file (TOML). Without it, a development relay runs.
    /// With `status` and `inspect`: the relay whose `relay.admin_listen` to ask.
    #[arg(long, short, env = "OAB_RELAY_CONFIG", global = true)]
    config: Option<PathBuf>,
    /// Folder for the development setup (used without --config).
    #[arg(long, env = "OAB_RELAY_DEV_DIR", default_value = ".oab-dev")]
    dev_dir: PathBuf,
    /// Override relay.listen.
    #[arg(long, env = "OAB_RELAY_LISTEN")]
    listen: Option<String>,
    /// Override relay.admin_listen.
    #[arg(long, env = "OAB_RELAY_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Override store.url: `memory`, `redis://host:port/`,
    /// `redis+unix:///path/redis.sock` or `redis-cluster://h1:p1,h2:p2,...`.
    #[arg(long, env = "OAB_RELAY_STORE")]
    store: Option<String>,
    /// Override a field of a plain section: `section.field=value`
    /// (repeatable). Entries of `[[peers]]` and `[[routes]]` are not reachable:
    /// edit the file for those.
    #[arg(long = "set", value_name = "PATH=VALUE")]
    set: Vec<String>,
    /// Async worker threads (default: one per CPU). One thread avoids
    /// cross-thread wake-ups on the frame path (lower latency at low load);
    /// more threads raise throughput.
    #[arg(long, env = "OAB_RELAY_WORKER_THREADS", value_parser = parse_threads)]
    worker_threads: Option<Threads>,
    /// Busy polling, in microseconds (0, the default: off): after each
    /// frame batch a session reads, one async task keeps polling the
    /// sockets for this long instead of letting its worker sleep, so a frame
    /// arriving within it does not wait for an idle CPU to wake. Costs up to
    /// that much CPU per batch; most useful with --worker-threads 1. At most
    /// 10000.
    #[arg(long, env = "OAB_RELAY_BUSY_POLL_US", value_parser = oab_ops::busy_poll::parse_window)]
    busy_poll_us: Option<std::time::Duration>,
    /// Log format.
    #[arg(long, env = "OAB_LOG_FORMAT", default_value = "text")]
    log_format: oab_ops::logging::LogFormat,
}

/// A worker thread count; empty (an empty environment variable) means the default.
#[derive(Debug, Clone, Copy)]
struct Threads(Option<usize>);

fn parse_threads(s: &str) -> Result<Threads, String> {
    if s.trim().is_empty() {
        return Ok(Threads(None));
    }
    match s.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(Threads(Some(n))),
        _ => Err(format!("expected a positive number of threads, got {s:?}")),
    }
}

fn overrides(args: &RunArgs) -> anyhow::Result<Vec<(String, String)>> {
    let mut out = env_overrides();
    for (path, v) in [
        ("relay.listen", &args.listen),
        ("relay.admin_listen", &args.admin_listen),
        ("store.url", &args.store),
    ] {
        if let Some(v) = v {
            out.push((path.to_string(), v.clone()));
        }
    }
    for s in &args.set {
        out.push(oab_ops::overrides::parse_set(s)?);
    }
    Ok(out)
}

/// The admin address `oab-relay status` asks, and where to look when it
/// does not answer: `--admin`, else `relay.admin_listen` of `--config` (with
/// the overrides), else the development relay's.
fn status_target(admin: Option<&str>, run: &RunArgs) -> anyhow::Result<(String, String)> {
    if let Some(admin) = admin {
        return Ok((
            admin.to_string(),
            "is the relay running, and is --admin its relay.admin_listen?".into(),
        ));
    }
    let Some(path) = &run.config else {
        return Ok((
            "http://127.0.0.1:9443".into(),
            "is the relay running? Without --config or --admin this asks the development \
             relay's admin port; pass --config <relay.toml> or --admin <relay.admin_listen>"
                .into(),
        ));
    };
    let shown = path.display().to_string();
    let text = read_config(path)?;
    let config = Config::from_toml_with_overrides(&text, &shown, &overrides(run)?)?;
    Ok((
        oab_ops::admin_client::url_of_listen(config.relay.admin_listen),
        format!("is the relay of {shown} running? This is its relay.admin_listen"),
    ))
}

/// The configuration file's text; a file that cannot be read is a refused
/// configuration (exit code 2).
fn read_config(path: &std::path::Path) -> Result<String, oab_relay::config::ConfigError> {
    std::fs::read_to_string(path).map_err(|error| oab_relay::config::ConfigError::Read {
        path: path.display().to_string(),
        error,
    })
}

/// `oab-relay status`: fetches `/status` and prints it.
#[allow(clippy::print_stdout)]
fn print_status(admin: Option<&str>, run: &RunArgs, json: bool) -> anyhow::Result<()> {
    let (admin, hint) = status_target(admin, run)?;
    let (url, body) =
        oab_ops::admin_client::fetch_status(&admin, &hint).map_err(anyhow::Error::msg)?;
    if json {
        println!("{}", String::from_utf8_lossy(&body));
        return Ok(());
    }
    let status: oab_relay::status::RelayStatus = serde_json::from_slice(&body)
        .with_context(|| format!("{url}: not the /status of this relay version"))?;
    print!("{}", status.render());
    Ok(())
}

/// `oab-relay inspect`: fetches `/delegation?id=` and prints it.
#[allow(clippy::print_stdout)]
fn print_inspection(
    id: &str,
    admin: Option<&str>,
    run: &RunArgs,
    json: bool,
) -> anyhow::Result<()> {
    let (admin, hint) = status_target(admin, run)?;
    let path = format!("/delegation?id={}", oab_ops::admin_client::query_value(id));
    let (url, resp) =
        oab_ops::admin_client::fetch(&admin, &path, &hint).map_err(anyhow::Error::msg)?;
    if resp.status != 200 {
        let error = serde_json::from_slice::<serde_json::Value>(&resp.body)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&resp.body).into_owned());
        anyhow::bail!("{error} (HTTP {} from {url})", resp.status);
    }
    if json {
        println!("{}", String::from_utf8_lossy(&resp.body));
        return Ok(());
    }
    let inspection: oab_relay::inspect::Inspection = serde_json::from_slice(&resp.body)
        .with_context(|| format!("{url}: not the /delegation of this relay version"))?;
    print!("{}", inspection.render());
    Ok(())
}

/// Runs the command; an error is printed once, as one line of causes
/// (`oab_ops::logging::error_line`, never a backtrace, whatever `RUST_BACKTRACE` says), with exit
/// code 2 when the configuration was refused (unreadable or invalid) and 1
/// otherwise.
fn main() -> std::process::ExitCode {
    match run_command() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("oab-relay: {}", oab_ops::logging::error_line(e.chain()));
            if e.downcast_ref::<oab_relay::config::ConfigError>().is_some() {
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
    oab_relay::tls::install_crypto_provider();
    if let Some(Command::Status { admin, json }) = &cli.command {
        if let Err(e) = print_status(admin.as_deref(), &cli.run, *json) {
            eprintln!("oab-relay status: {e:#}");
            std::process::exit(1);
        }
        return Ok(());
    }
    if let Some(Command::Inspect { id, admin, json }) = &cli.command {
        if let Err(e) = print_inspection(id, admin.as_deref(), &cli.run, *json) {
            eprintln!("oab-relay inspect: {e:#}");
            std::process::exit(1);
        }
        return Ok(());
    }
    if let Some(Command::CheckConfig { file }) = &cli.command {
        let text = read_config(file)?;
        let shown = file.display().to_string();
        match Config::from_toml_with_overrides(&text, &shown, &overrides(&cli.run)?) {
            Ok(c) => {
                println!(
                    "{shown}: ok ({} peers, {} routes, store {})",
                    c.peers.len(),
                    c.routes.len(),
                    oab_relay::store::redis::describe_store_url(&c.store.url)
                );
                // Values that pass but can lock peers out: said, exit 0.
                for w in oab_relay::lockout::warnings(&c, oab_wire::identity::now_ms()) {
                    eprintln!("warning: {w}");
                }
                // The TLS files when it finds them on this host (the file
                // may be checked elsewhere than where the relay runs: files
                // that are not here are not said): warnings.
                if c.relay.tls_mode == TlsMode::Terminate
                    && let (Some(cert), Some(key)) = (&c.relay.tls_cert, &c.relay.tls_key)
                    && cert.exists()
                    && key.exists()
                {
                    match oab_relay::tls::load_server_config(cert, key) {
                        Err(e) => eprintln!("warning: {e} (the relay does not start with it)"),
                        Ok(_) => {
                            let now = i64::try_from(oab_wire::identity::now_ms() / 1_000)
                                .unwrap_or(i64::MAX);
                            if let Some(w) = oab_relay::tls::validity_warning(cert, now) {
                                eprintln!("warning: {w}");
                            }
                        }
                    }
                }
                return Ok(());
            }
            Err(e) => {
                eprintln!("{e}");
                std::process::exit(2);
            }
        }
    }
    if oab_ops::logging::init(cli.run.log_format, false) {
        // The Redis client's `log` records, rate-limited (oab_relay::client_log).
        let _ = oab_relay::client_log::install();
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(Threads(Some(n))) = cli.run.worker_threads {
        builder.worker_threads(n);
    }
    let runtime = builder
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(serve(cli.run))
}

/// Prints a line of the startup banner on stdout. A stdout whose reader went
/// away (`oab-relay | head -1`, a closed pipe) does not stop the relay: unlike
/// `println!`, which panics, a failed write is ignored.
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout(), $($arg)*);
    }};
}

async fn serve(args: RunArgs) -> anyhow::Result<()> {
    let path = match &args.config {
        Some(p) => p.clone(),
        None => {
            let dev = oab_relay::dev::prepare(&args.dev_dir)
                .context("preparing the development setup")?;
            say!(
                "development relay ({}) in {}",
                if dev.created { "created" } else { "reused" },
                dev.dir.display()
            );
            say!("  config:      {}", dev.config.display());
            say!(
                "  certificate: {} (self-signed; trust it in connectors)",
                dev.cert.display()
            );
            for (peer, file) in &dev.identities {
                say!("  identity:    {peer} -> {}", file.display());
            }
            for file in &dev.connector_configs {
                say!("  connector:   {}", file.display());
            }
            for loose in &dev.loose_secrets {
                tracing::warn!("{loose}");
            }
            say!("  try it:      cargo run -p oab-connector -- demo  (or demo --a2a)");
            dev.config
        }
    };
    let shown = path.display().to_string();
    let text = read_config(&path)?;
    let overrides = overrides(&args)?;
    let config = Arc::new(Config::from_toml_with_overrides(&text, &shown, &overrides)?);
    // SIGHUP reloads the file with the same overrides (as `POST /reload` on
    // the admin listener does).
    let reload = oab_relay::server::Reload {
        source: oab_relay::reload::ConfigSource {
            path: path.clone(),
            overrides,
        },
        trigger: Arc::new(tokio::sync::Notify::new()),
    };
    spawn_reload_signal(reload.trigger.clone());
    for w in oab_relay::lockout::warnings(&config, oab_wire::identity::now_ms()) {
        tracing::warn!(field = %w.field, "{}", w.message);
    }
    let tls = match config.relay.tls_mode {
        TlsMode::Terminate => {
            let (Some(cert), Some(key)) = (&config.relay.tls_cert, &config.relay.tls_key) else {
                anyhow::bail!("relay.tls_cert and relay.tls_key are required");
            };
            let tls = oab_relay::tls::load_server_config(cert, key)?;
            let now_secs = i64::try_from(oab_wire::identity::now_ms() / 1_000).unwrap_or(i64::MAX);
            if let Some(w) = oab_relay::tls::validity_warning(cert, now_secs) {
                tracing::warn!(field = "relay.tls_cert", "{w}");
            }
            Some(tls)
        }
        TlsMode::BehindLoadBalancer => None,
    };
    // The store before the listeners: a relay that cannot reach it says so
    // and exits, without having said it listens.
    let retention = config.retention();
    let store = if config.store.url == "memory" {
        Store::Memory(Arc::new(MemoryStore::new(retention)))
    } else {
        let url = &config.store.url;
        match RedisStore::connect(url, retention).await {
            Ok(s) => Store::Redis(Arc::new(s)),
            Err(e) => {
                let reason = match &e {
                    oab_relay::store::StoreError::Unavailable { cause, .. } => cause.clone(),
                    other => other.to_string(),
                };
                anyhow::bail!(
                    "store: cannot reach {} ({reason}); is Redis running? (store.url)",
                    oab_relay::store::redis::RedactedUrl(url)
                );
            }
        }
    };
    let listener = TcpListener::bind(config.relay.listen)
        .await
        .with_context(|| format!("binding relay.listen {}", config.relay.listen))?;
    let admin = TcpListener::bind(config.relay.admin_listen)
        .await
        .with_context(|| format!("binding relay.admin_listen {}", config.relay.admin_listen))?;
    let scheme = if tls.is_some() { "wss" } else { "ws" };
    say!(
        "relay {} listening on {scheme}://{}",
        config.relay.id,
        listener.local_addr()?
    );
    say!(
        "admin (metrics, health) on http://{}/metrics",
        admin.local_addr()?
    );
    if let Some(window) = args.busy_poll_us
        && oab_ops::busy_poll::start(window)
    {
        let us = u64::try_from(window.as_micros()).unwrap_or(u64::MAX);
        let workers = tokio::runtime::Handle::current().metrics().num_workers();
        tracing::info!(
            window_us = us,
            workers,
            "busy polling after each frame batch"
        );
        if workers > 1 {
            tracing::warn!(
                workers,
                "busy polling with more than one async worker: an idle worker can take the wake-ups the poller was to save, and the spinning costs throughput (see BENCHMARKS.md); --worker-threads 1 is the setting it is meant for"
            );
        }
    }
    tokio::spawn(oab_relay::client_log::flush_every());
    let shutdown = CancellationToken::new();
    let trigger = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("shutdown signal received");
        trigger.cancel();
    });
    match store {
        Store::Memory(store) => {
            say!("store: memory (lost on restart; set store.url to a redis:// URL for durability)");
            oab_relay::server::run_reloadable(
                listener,
                Some(admin),
                config,
                store,
                tls,
                shutdown,
                Some(reload),
            )
            .await?;
        }
        Store::Redis(store) => {
            say!("store: {}", store.kind());
            oab_relay::server::run_reloadable(
                listener,
                Some(admin),
                config,
                store,
                tls,
                shutdown,
                Some(reload),
            )
            .await?;
        }
    }
    Ok(())
}

/// The store the relay serves with, connected before anything listens.
enum Store {
    Memory(Arc<MemoryStore>),
    Redis(Arc<RedisStore>),
}

/// Notifies `trigger` at each `SIGHUP` (Unix only).
fn spawn_reload_signal(trigger: Arc<tokio::sync::Notify>) {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::hangup()) {
            Ok(mut hup) => {
                tokio::spawn(async move {
                    while hup.recv().await.is_some() {
                        tracing::info!("SIGHUP: reloading the configuration");
                        trigger.notify_one();
                    }
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP; reload with POST /reload")
            }
        }
    }
    #[cfg(not(unix))]
    drop(trigger);
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let (Ok(mut term), Ok(mut int)) = (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
