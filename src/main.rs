//! The `tollgate` command line: parse arguments, set up logging, call into the library.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tollgate::config::{EnvOverrides, GatewayConfig};

/// mimalloc instead of the system allocator: hyper allocates a few small buffers per request
/// and glibc malloc's bookkeeping showed up in the request-path profile (see README,
/// "Performance"). Only the binary sets it; the library leaves the choice to its embedder.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "tollgate", version, about = "A rate-limiting HTTP reverse proxy")]
struct Cli {
    /// Log format: human on a TTY, JSON otherwise, unless set.
    #[arg(long, global = true, value_enum)]
    log_format: Option<LogFormat>,
    #[command(subcommand)]
    command: Option<Command>,
    /// Gateway config, for every sub-command (`run` is implied when none is given); default
    /// `config/gateway.yaml`. For `demo`, a config of your own instead of the built-in one.
    #[arg(long, global = true, env = "TOLLGATE_CONFIG")]
    config: Option<PathBuf>,
}

/// Where the gateway config is when `--config` and `TOLLGATE_CONFIG` are both absent.
const DEFAULT_CONFIG: &str = "config/gateway.yaml";

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Human,
    Json,
}

#[derive(Subcommand)]
enum Command {
    /// Serve (the default).
    Run,
    /// Serve only the Envoy rate-limit service (`rls:` in the gateway file; `rls.listen`,
    /// default 0.0.0.0:8081) and the admin API: no proxy listener.
    Rls,
    /// Validate the gateway config, rules and keys; print a summary.
    Check,
    /// Print the settings in force (environment overrides applied, secrets hidden), each with
    /// where its value came from: `file:line:col`, an environment variable, or the default.
    Config,
    /// Show the identity, matching rules and store keys for a request.
    Explain {
        /// Method.
        #[arg(long, default_value = "GET")]
        method: String,
        /// Path (query allowed).
        #[arg(long)]
        path: String,
        /// Request header, `Name: value` (repeatable).
        #[arg(long = "header")]
        headers: Vec<String>,
        /// Peer IP.
        #[arg(long, default_value = "127.0.0.1")]
        ip: std::net::IpAddr,
    },
    /// Print the SHA-256 line to paste into keys.yaml.
    #[command(
        after_help = "Without KEY the key is read from standard input (one line), which keeps it out of \
                      the shell history and the process list: `tollgate hash-key < key.txt`. An empty key \
                      is refused."
    )]
    HashKey {
        /// The API key; read from standard input when omitted (preferred: argv is visible to
        /// other users of the machine and lands in shell history).
        key: Option<String>,
    },
    /// Run the embedded demo (echo upstream + gateway on the memory store). Works from any
    /// directory: the demo config is built into the binary.
    Demo {
        /// Proxy address (default 127.0.0.1:8080).
        #[arg(long)]
        listen: Option<std::net::SocketAddr>,
        /// Admin address (default 127.0.0.1:9090; loopback only).
        #[arg(long)]
        admin_listen: Option<std::net::SocketAddr>,
    },
}

/// The log filter when `RUST_LOG` is not set. rustls and the Redis client are held to errors:
/// rustls warns on every handshake of a client that sends an IP address as SNI (an illegal but
/// common extension tollgate ignores), and the Redis client's warnings carry its build paths;
/// tollgate logs the store's failures itself (throttled, with the shard).
const DEFAULT_LOG_FILTER: &str = "info,rustls=error,redis=error";

/// Logs to standard error; with `otlp`, tollgate's own background work (rules reloads) is also
/// exported as spans through `tracing-opentelemetry` (`telemetry::ops_layer`).
fn init_logs(format: Option<LogFormat>, otlp: Option<&tollgate::config::otlp::OtlpConfig>) {
    use std::io::IsTerminal;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(DEFAULT_LOG_FILTER));
    let json = match format {
        Some(LogFormat::Json) => true,
        Some(LogFormat::Human) => false,
        None => !std::io::stderr().is_terminal(),
    };
    // A registry with the filter and the fmt layer (what `tracing_subscriber::fmt()` builds),
    // so the OTLP layer can carry a filter of its own.
    let registry = tracing_subscriber::registry().with(filter);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let mut failed = None;
    let done = if json {
        let sub = registry.with(fmt.json().flatten_event(true));
        let layer = otlp.map(tollgate::telemetry::ops_layer).transpose();
        let layer = layer.unwrap_or_else(|e| {
            failed = Some(e);
            None
        });
        sub.with(layer).try_init()
    } else {
        let sub = registry.with(fmt);
        let layer = otlp.map(tollgate::telemetry::ops_layer).transpose();
        let layer = layer.unwrap_or_else(|e| {
            failed = Some(e);
            None
        });
        sub.with(layer).try_init()
    };
    if let Err(e) = done {
        eprintln!("tollgate: cannot set up logging: {e}");
    }
    if let Some(e) = failed {
        tracing::warn!(error = %e, "tracing.otlp: background spans are not exported");
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let given = cli.config;
    let config = given.clone().unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG));
    match cli.command.unwrap_or(Command::Run) {
        Command::HashKey { key } => hash_key(key),
        Command::Check => check(&config),
        Command::Config => effective(&config),
        Command::Explain {
            method,
            path,
            headers,
            ip,
        } => explain(&config, &method, &path, &headers, ip),
        Command::Run => {
            let loaded = GatewayConfig::load(&config, &EnvOverrides::from_env());
            init_logs(cli.log_format, loaded.as_ref().ok().and_then(|c| c.otlp.as_ref()));
            let cfg = match loaded {
                Ok(cfg) => cfg,
                Err(e) => {
                    // A log line, so it is JSON when the logs are (a crash-looping pod's reason
                    // reaches the log pipeline like any other line).
                    tracing::error!(error = %e, config = %config.display(), "tollgate: cannot start: the configuration was refused (`tollgate check --config` gives the same answer)");
                    return ExitCode::FAILURE;
                }
            };
            if !cfg.proxied {
                tracing::error!(config = %config.display(), "tollgate: cannot start: the gateway file has no `upstream:` for the proxy (`tollgate rls --config` serves the rate-limit service alone)");
                return ExitCode::FAILURE;
            }
            let single = cfg.server.runtime == tollgate::config::Runtime::ThreadPerCore;
            runtime_of(single, async move {
                let running = tollgate::server::start(cfg).await.map_err(|e| e.to_string())?;
                tollgate::demo::shutdown_signal().await;
                tracing::info!("signal received");
                running.drain_then_stop().await;
                Ok(())
            })
        }
        Command::Rls => {
            let loaded = GatewayConfig::load(&config, &EnvOverrides::from_env());
            init_logs(cli.log_format, loaded.as_ref().ok().and_then(|c| c.otlp.as_ref()));
            let cfg = match loaded {
                Ok(cfg) => cfg,
                Err(e) => {
                    tracing::error!(error = %e, config = %config.display(), "tollgate rls: cannot start: the configuration was refused (`tollgate check --config` gives the same answer)");
                    return ExitCode::FAILURE;
                }
            };
            runtime(async move {
                let running = tollgate::server::start_rls_only(cfg).await.map_err(|e| e.to_string())?;
                tollgate::demo::shutdown_signal().await;
                tracing::info!("signal received");
                running.drain_then_stop().await;
                Ok(())
            })
        }
        Command::Demo { listen, admin_listen } => {
            init_logs(cli.log_format.or(Some(LogFormat::Human)), None);
            runtime(async move {
                tollgate::demo::run(given.as_deref(), listen, admin_listen)
                    .await
                    .map_err(|e| e.to_string())
            })
        }
    }
}

/// `tollgate config`: the settings in force, with where each came from.
fn effective(config: &std::path::Path) -> ExitCode {
    let env = EnvOverrides::from_env();
    let raw = tollgate::config::parse_file::<tollgate::config::raw::RawGateway>(config);
    let cfg = GatewayConfig::load(config, &env);
    match (raw, cfg) {
        (Ok(raw), Ok(cfg)) => {
            let rows = tollgate::config::effective::settings(config, &raw, &cfg, &env);
            let width = rows
                .iter()
                .map(|r| r.name.len() + r.value.len())
                .max()
                .unwrap_or(0)
                .min(60)
                + 3;
            for r in rows {
                let pad = width.saturating_sub(r.name.len() + r.value.len());
                println!("{}: {}{:pad$}# {}", r.name, r.value, "", r.source);
            }
            ExitCode::SUCCESS
        }
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate hash-key [KEY]`: the key from argv, or one line of standard input.
fn hash_key(key: Option<String>) -> ExitCode {
    let key = match key {
        Some(k) => k,
        None => {
            let mut line = String::new();
            if let Err(e) = std::io::stdin().read_line(&mut line) {
                eprintln!("tollgate hash-key: cannot read standard input: {e}");
                return ExitCode::FAILURE;
            }
            line.trim_end_matches(['\n', '\r']).to_string()
        }
    };
    if key.is_empty() {
        eprintln!("tollgate hash-key: refusing an empty key (pass it as an argument or on standard input)");
        return ExitCode::FAILURE;
    }
    println!("    sha256: {}", tollgate::identity::keys::hash_key(&key));
    ExitCode::SUCCESS
}

fn runtime(f: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    // The demo's config has the default `server.runtime`.
    runtime_of(
        tollgate::config::Runtime::default() == tollgate::config::Runtime::ThreadPerCore,
        f,
    )
}

/// Run `f` on a current-thread runtime when `single` (thread-per-core: the server starts the
/// other workers' runtimes itself) or when there is one worker, else on a multi-thread one.
fn runtime_of(single: bool, f: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    // One worker (TOKIO_WORKER_THREADS=1): a current-thread runtime has no work-stealing
    // machinery or cross-thread wake-ups to pay for; otherwise a multi-thread runtime with
    // TOKIO_WORKER_THREADS (default: one per core) workers.
    let one = single || tollgate::config::Runtime::workers() == 1;
    let built = if one {
        tokio::runtime::Builder::new_current_thread().enable_all().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().enable_all().build()
    };
    let rt = match built {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tollgate: cannot start runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(f) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "tollgate: stopped with an error");
            ExitCode::FAILURE
        }
    }
}

fn load_all(config: &std::path::Path) -> Result<(GatewayConfig, tollgate::state::Snapshot), String> {
    let cfg = GatewayConfig::load(config, &EnvOverrides::from_env()).map_err(|e| e.to_string())?;
    let metrics = tollgate::metrics::Metrics::new();
    let snap = tollgate::state::load_snapshot(&cfg, &metrics).map_err(|e| e.to_string())?;
    if let Some(r) = &cfg.rls {
        tollgate::rls::config::load_dir(&r.config_dir, r.failure).map_err(|e| {
            e.named_in(&cfg.path, "rls.config_dir", Some(r.config_dir_at))
                .to_string()
        })?;
    }
    Ok((cfg, snap))
}

fn check(config: &std::path::Path) -> ExitCode {
    use tollgate::describe;
    match load_all(config) {
        Ok((cfg, snap)) => {
            println!("{}: ok", config.display());
            if cfg.proxied {
                println!(
                    "  listen {}{}",
                    cfg.listen,
                    if cfg.tls.is_some() { " (TLS)" } else { "" }
                );
            } else {
                println!("  no proxy: no upstream (for `tollgate rls`, the rate-limit service alone)");
            }
            let access = match (&cfg.admin.token_env, &cfg.admin.token_file, cfg.admin.insecure) {
                (Some(env), Some(_), _) => format!("token from ${env}, and the tokens of admin.token_file"),
                (Some(env), None, _) => format!("token from ${env}"),
                (None, Some(_), _) => "the tokens of admin.token_file (re-read when it changes)".to_string(),
                (None, None, true) => "no token, admin.insecure: true".to_string(),
                (None, None, false) => "no token, loopback only".to_string(),
            };
            println!("  admin  {} ({access})", cfg.admin_listen);
            let targets: Vec<String> = cfg.upstream.targets.iter().map(|t| t.url.to_string()).collect();
            if cfg.proxied {
                println!(
                    "  upstream {} ({}, connect timeout {}, request timeout {})",
                    targets.join(", "),
                    cfg.upstream.protocol.as_str(),
                    humantime::format_duration(cfg.upstream.connect_timeout),
                    humantime::format_duration(cfg.upstream.request_timeout)
                );
            }
            println!("  store {}", describe::store(&cfg));
            if cfg.proxied || cfg.rules_file.exists() {
                println!(
                    "  rules {} ({} rules, version {})",
                    cfg.rules_file.display(),
                    snap.rules.rules.len(),
                    snap.rules.version
                );
            } else {
                println!("  rules: none");
            }
            for r in &snap.rules.rules {
                println!("    {}", describe::rule(r));
            }
            match &cfg.keys_file {
                Some(k) => println!("  keys {} ({} keys)", k.display(), snap.keys.len()),
                None => println!("  keys: none"),
            }
            if let Some(r) = &cfg.rls {
                let listen = r.listen.map_or_else(
                    || "off for run; tollgate rls: 0.0.0.0:8081".to_string(),
                    |l| l.to_string(),
                );
                println!("  rls {listen}, config {}", r.config_dir.display());
                if let Ok(d) = tollgate::rls::config::load_dir(&r.config_dir, r.failure) {
                    let mut names: Vec<_> = d.by_name.values().collect();
                    names.sort_by(|a, b| a.name.cmp(&b.name));
                    for dom in names {
                        println!(
                            "    domain {} ({} descriptors with limits, {})",
                            dom.name,
                            dom.limits,
                            dom.file.display()
                        );
                    }
                }
            }
            for n in &cfg.notes {
                println!("  note: {n}");
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

fn explain(config: &std::path::Path, method: &str, path: &str, headers: &[String], ip: std::net::IpAddr) -> ExitCode {
    let (cfg, snap) = match load_all(config) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    let mut h = http::HeaderMap::new();
    for line in headers {
        let Some((k, v)) = line.split_once(':') else {
            eprintln!("--header wants 'Name: value', got {line:?}");
            return ExitCode::FAILURE;
        };
        match (
            http::HeaderName::from_bytes(k.trim().as_bytes()),
            http::HeaderValue::from_str(v.trim()),
        ) {
            (Ok(k), Ok(v)) => {
                h.append(k, v);
            }
            _ => {
                eprintln!("invalid header {line:?}");
                return ExitCode::FAILURE;
            }
        }
    }
    let Ok(m) = http::Method::from_bytes(method.to_ascii_uppercase().as_bytes()) else {
        eprintln!("invalid method {method:?}");
        return ExitCode::FAILURE;
    };
    let keys = tollgate::state::key_builder(&cfg);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // The CLI reads no store: runtime overrides are not shown (the admin API's /explain is).
    let runtime = tollgate::rules::runtime::RuntimeOverrides::default();
    let probe = tollgate::admin::Probe {
        method: &m,
        path,
        headers: &h,
        ip,
        now_secs: now,
    };
    let v = tollgate::admin::explain(&cfg, &keys, &snap, &runtime, probe);
    println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    ExitCode::SUCCESS
}
