//! The `dispatchctl` binary: parses the command line, runs the command on
//! a single-threaded runtime and turns the outcome into an exit code (see
//! `dispatchctl --help`). All logic lives in the `dispatchctl` library.

use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use dispatchctl::{EXIT_ERROR, EXIT_OK, EXIT_USAGE, Io, cli::Cli};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print to stdout and succeed; usage
            // errors get their own code so that 2 keeps meaning
            // "dispatcher unreachable".
            let code = if e.use_stderr() { EXIT_USAGE } else { EXIT_OK };
            let _ = e.print();
            return ExitCode::from(code);
        }
    };
    match run(cli) {
        Ok(code) => ExitCode::from(code),
        Err(err) => match err.downcast_ref::<dispatchctl::Error>() {
            Some(e) if e.is_broken_pipe() => ExitCode::from(EXIT_OK),
            Some(e) => {
                eprintln!("error: {e}");
                ExitCode::from(e.exit_code())
            }
            None => {
                eprintln!("error: {err:#}");
                ExitCode::from(EXIT_ERROR)
            }
        },
    }
}

fn run(cli: Cli) -> anyhow::Result<u8> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr();
    let mut io = Io {
        out: &mut stdout,
        err: &mut stderr,
    };
    Ok(runtime.block_on(dispatchctl::run(cli, &mut io))?)
}
