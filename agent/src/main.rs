//! The node agent's command line. Each subcommand is a thin shell over the
//! library: `agent topology` prints what [`agent::topology`] discovers.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use agent::topology::{self, MachineTopology, SysfsReader};

/// The node agent of the topology-aware cluster job dispatcher.
#[derive(Debug, Parser)]
#[command(name = "agent", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Discover the machine's CPU topology and print it as a tree or JSON.
    Topology(TopologyArgs),
    /// Supervise one job (internal: the executor starts it; see
    /// `agent::exec::shim`).
    #[command(hide = true)]
    Shim(ShimArgs),
}

#[derive(Debug, Args)]
struct ShimArgs {
    /// The job directory holding `spec.json`.
    #[arg(long, value_name = "DIR")]
    job_dir: PathBuf,
}

#[derive(Debug, Args)]
struct TopologyArgs {
    /// Read `<DIR>/sys/devices/system/...` instead of the live `/sys` (a
    /// captured tree of another machine).
    #[arg(long, value_name = "DIR", conflicts_with = "topology")]
    sysfs_root: Option<PathBuf>,

    /// Describe a synthetic machine from an engine spec instead of reading
    /// sysfs, e.g. `2s:22c:2t` or `4s:10c:8t:linear`.
    #[arg(long, value_name = "SPEC")]
    topology: Option<String>,

    /// Print the JSON summary instead of the tree.
    #[arg(long)]
    json: bool,

    /// Restrict to these CPUs (a CPU list such as `0-3,8`). By default the
    /// agent uses its own affinity when the root has a `proc/self/status`
    /// (the live machine), and every online CPU otherwise.
    #[arg(long, value_name = "CPULIST", conflicts_with_all = ["all_cpus", "topology"])]
    cpus: Option<String>,

    /// Ignore the process's affinity: describe every online CPU.
    #[arg(long, conflicts_with = "topology")]
    all_cpus: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Topology(args) => cmd_topology(&args),
        Command::Shim(args) => return agent::exec::shim::main(&args.job_dir),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("agent: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn cmd_topology(args: &TopologyArgs) -> Result<()> {
    let machine = load_topology(args)?;
    // Check that the engine accepts what was discovered before printing it.
    machine
        .to_sched()
        .context("building the scheduling-domain tree")?;
    if args.json {
        let json = machine
            .summary()
            .to_json()
            .context("serialising the summary")?;
        println!("{json}");
    } else {
        print!("{}", machine.tree());
    }
    Ok(())
}

fn load_topology(args: &TopologyArgs) -> Result<MachineTopology> {
    if let Some(spec) = &args.topology {
        return topology::synthetic(spec).with_context(|| format!("synthetic topology {spec:?}"));
    }
    let reader = SysfsReader::new(
        args.sysfs_root
            .clone()
            .unwrap_or_else(|| PathBuf::from("/")),
    );
    let allowed = if let Some(list) = &args.cpus {
        Some(topology::parse_cpulist(list).with_context(|| format!("--cpus {list:?}"))?)
    } else if args.all_cpus {
        None
    } else {
        reader
            .default_allowed()
            .context("reading this process's CPU affinity")?
    };
    reader
        .read(allowed.as_deref())
        .with_context(|| format!("reading the topology under {}", reader.root().display()))
}
