//! Where a server listens, who may call it, and how much it takes on: the
//! same flags for `rloo serve` and `rloo reward serve`.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use rloo::service::server::{Access, Limits, Listen};

#[derive(Debug, Args)]
pub struct ListenFlags {
    /// Address to listen on (0.0.0.0: every interface, which needs --api-key-env or --insecure-no-api-key).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Environment variable holding a token that clients must send as `Authorization: Bearer <token>`.
    #[arg(long)]
    pub api_key_env: Option<String>,
    /// Listen beyond loopback without a token: anyone who reaches the port can use the server.
    #[arg(long)]
    pub insecure_no_api_key: bool,
    /// Host names the server answers to besides loopback names and IP addresses (comma-separated;
    /// `.example.com`: that name and its subdomains; `*`: any).
    #[arg(long, value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Origins of web pages allowed to call the API, e.g. http://localhost:3000 (comma-separated);
    /// requests from other pages are refused.
    #[arg(long, value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// Open connections at most, idle ones included; one more is answered 503.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_connections: u64,
    /// Largest request line and headers in KiB.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=16384))]
    pub max_header_kib: u64,
    /// Seconds a request's head and body have to arrive, and a client to take each part of an answer.
    #[arg(long, default_value_t = 30.0)]
    pub request_timeout_s: f64,
    /// Seconds an idle connection is kept open.
    #[arg(long, default_value_t = 15.0)]
    pub keep_alive_s: f64,
    /// Seconds the work in flight gets to finish after Ctrl-C or SIGTERM; what is left is then cancelled.
    #[arg(long, default_value_t = 10.0)]
    pub shutdown_grace_s: f64,
}

impl ListenFlags {
    /// The resolved settings, with the command's own body limit and
    /// counts of requests handled and waiting; refuses a host beyond
    /// loopback without a token here, before any model is loaded.
    pub fn listen(&self, max_body_mib: u64, workers: u64, max_queue: usize) -> Result<Listen> {
        let token = match &self.api_key_env {
            Some(var) => Some(std::env::var(var).with_context(|| format!("--api-key-env: `{var}` is not set"))?),
            None => None,
        };
        if token.as_deref().is_some_and(|t| t.trim().is_empty()) {
            anyhow::bail!("--api-key-env: `{}` is empty", self.api_key_env.as_deref().unwrap_or_default());
        }
        let seconds = |flag: &str, s: f64| -> Result<Duration> {
            anyhow::ensure!(
                s.is_finite() && s > 0.0 && s <= 86_400.0,
                "--{flag} must be in (0, 86400] seconds, got {s}"
            );
            Ok(Duration::from_secs_f64(s))
        };
        let listen = Listen {
            host: self.host.clone(),
            port: self.port,
            access: Access {
                token,
                allowed_hosts: self.allowed_hosts.clone(),
                allowed_origins: self.allowed_origins.iter().map(|o| o.trim_end_matches('/').to_string()).collect(),
            },
            insecure_no_api_key: self.insecure_no_api_key,
            limits: Limits {
                max_body_bytes: (max_body_mib as usize) << 20,
                max_header_bytes: (self.max_header_kib as usize) << 10,
                workers: workers as usize,
                max_queue,
                max_connections: self.max_connections as usize,
                request_timeout: seconds("request-timeout-s", self.request_timeout_s)?,
                keep_alive: seconds("keep-alive-s", self.keep_alive_s)?,
                shutdown_grace: seconds("shutdown-grace-s", self.shutdown_grace_s)?,
            },
        };
        listen.access.check_bind(&listen.host, listen.port, listen.insecure_no_api_key)?;
        Ok(listen)
    }
}
