//! `dispatchctl`: the user's command-line tool for the dispatcher.
//!
//! The binary (`src/main.rs`) only parses the command line and maps errors
//! to exit codes; everything else lives here so it can be tested:
//!
//! - [`cli`]: clap types (commands, flags, help texts, exit codes);
//! - [`config`]: which dispatcher to talk to (flag > env > file > default);
//! - [`parse`]: sizes, durations, `KEY=VALUE` pairs;
//! - [`client`]: the gRPC connection, with a clear error when the
//!   dispatcher cannot be reached;
//! - [`view`]: serde views of the API messages for JSON / YAML;
//! - [`output`]: tables and formatters;
//! - [`commands`]: one function per command, taking a client;
//! - [`top`]: the live view.

pub mod cli;
pub mod client;
pub mod commands;
pub mod config;
pub mod output;
pub mod parse;
pub mod top;
pub mod view;

use std::io::Write;

pub use client::Client;

/// Exit code: success.
pub const EXIT_OK: u8 = 0;
/// Exit code: an error (refused request, unknown id, bad config file).
pub const EXIT_ERROR: u8 = 1;
/// Environment variable holding the bearer token (`--token-file` /
/// `DISPATCH_TOKEN_FILE` wins).
pub const TOKEN_ENV: &str = "DISPATCH_TOKEN";
/// Exit code: the dispatcher cannot be reached.
pub const EXIT_UNREACHABLE: u8 = 2;
/// Exit code: bad command line.
pub const EXIT_USAGE: u8 = 64;

/// Everything that can go wrong in a command.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No connection to the dispatcher (refused, timed out, name unknown,
    /// or the connection broke and could not be re-established).
    #[error(
        "cannot reach the dispatcher at {addr} ({cause}): is it running? start one with \
         `dispatcher --dev` or set --server / DISPATCH_SERVER"
    )]
    Unreachable { addr: String, cause: String },
    /// The TLS options or the token cannot be used.
    #[error(transparent)]
    Security(#[from] proto::client_security::SecurityError),
    /// The dispatcher answered with an error status.
    #[error("{}", client::describe_status(.0))]
    Rpc(tonic::Status),
    /// Config file or server address.
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    /// JSON / YAML encoding.
    #[error(transparent)]
    Output(#[from] output::OutputError),
    /// Writing to stdout / stderr.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The terminal could not be set up for `top`.
    #[error("cannot use the terminal: {0} (try `dispatchctl top --once`)")]
    Terminal(std::io::Error),
    /// A combination of flags that cannot be served.
    #[error("{0}")]
    Usage(String),
    /// The dispatcher's answer lacks something the API promises.
    #[error("unexpected answer from the dispatcher: {0}")]
    Protocol(String),
}

impl Error {
    /// The process exit code for this error (see [`cli::EXIT_CODES`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Unreachable { .. } | Error::Security(_) => EXIT_UNREACHABLE,
            Error::Usage(_) => EXIT_USAGE,
            _ => EXIT_ERROR,
        }
    }

    /// Writing failed because the reader went away (`dispatchctl ls | head`):
    /// not worth a message.
    pub fn is_broken_pipe(&self) -> bool {
        matches!(self, Error::Io(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
    }
}

/// Result of a command: its exit code.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Where commands write: stdout for results, stderr for notes.
pub struct Io<'a> {
    pub out: &'a mut dyn Write,
    pub err: &'a mut dyn Write,
}

/// Runs a parsed command line: resolves the server (from `--server`, the
/// process environment and the config file), connects unless the command
/// needs no dispatcher, and runs the command. Returns the exit code.
pub async fn run(cli: cli::Cli, io: &mut Io<'_>) -> Result<u8> {
    let env = |k: &str| std::env::var(k).ok();
    let server = config::resolve_server(cli.server.as_deref(), &env)?;
    if let cli::Command::Config(args) = &cli.command {
        return commands::config(&server, args, io);
    }
    let tls = proto::client_security::ClientTls {
        ca: cli.tls_ca.clone(),
        ..Default::default()
    };
    let token =
        proto::client_security::load_token(cli.token_file.as_deref(), env(TOKEN_ENV).as_deref())?;
    let bearer = proto::client_security::Bearer::new(token.as_deref())?;
    let mut client = Client::connect_leader(&server.url, &tls, bearer).await?;
    commands::dispatch(&mut client, &server, cli.command, io).await
}
