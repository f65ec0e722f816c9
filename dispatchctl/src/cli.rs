//! The command line: clap derive types for every command and flag, with the
//! help texts users read. Parsing only; the work is in
//! [`crate::commands`].

use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::output::Format;
use crate::parse::{KeyValue, parse_duration, parse_key_value, parse_size};

/// Exit codes, shown at the end of `dispatchctl --help`.
pub const EXIT_CODES: &str = "\
Exit codes:
  0    success
  1    error: the dispatcher refused the request (its message names the bad
       field; also a missing or unknown token, or a role that may not), an
       unknown id, or a bad config file
  2    the dispatcher cannot be reached (not running, wrong --server, TLS
       failure or unusable --tls-ca / token)
  64   bad command line (unknown flag, invalid value)
  With `submit --wait` / `--follow`, the job's own result instead:
  0    succeeded
  N    exited with status N
  128+S  killed by signal S (e.g. 137 = SIGKILL, also a timeout's kill)
  124  timed out without a signal
  130  cancelled (128+S when the cancel killed it with signal S)
  3    lost with its node, no retries left
  For an array, the first element (by index) that did not succeed decides.";

const SERVER_HELP: &str = "\
Dispatcher address [default: http://127.0.0.1:50051]
Also from the DISPATCH_SERVER variable, or the \"server\" key of the config file \
($DISPATCH_CONFIG, else ~/.config/dispatch/config.json); this flag wins, then the \
variable, then the file.";

/// dispatchctl: submit jobs to the topology-aware dispatcher and follow them.
#[derive(Debug, Parser)]
#[command(
    name = "dispatchctl",
    version,
    about = "Submit, inspect and follow jobs on a topology-aware cluster dispatcher",
    long_about = "dispatchctl is the command-line client of the dispatcher: it submits jobs \
(commands with CPU, memory and placement needs), lists and follows them, and shows the \
cluster's nodes with their topology and free CPUs per level (core, LLC, NUMA node, \
package).\n\nStart a single-machine dispatcher with `dispatcher --dev`, then e.g.:\n  \
dispatchctl submit --cpus 4 --align llc --wait -- make -j4\n  \
dispatchctl ls --state running\n  dispatchctl nodes",
    after_help = "See `dispatchctl help <command>` for each command's flags.",
    after_long_help = EXIT_CODES,
    disable_help_subcommand = false
)]
pub struct Cli {
    #[arg(long, global = true, value_name = "URL", help = "Dispatcher address (or DISPATCH_SERVER, or the config file)",
          long_help = SERVER_HELP, help_heading = "Global options", display_order = 1000)]
    pub server: Option<String>,

    /// Verify an https:// dispatcher against this PEM CA certificate.
    #[arg(
        long,
        global = true,
        env = "DISPATCH_TLS_CA",
        value_name = "FILE",
        help_heading = "Global options",
        display_order = 1001
    )]
    pub tls_ca: Option<std::path::PathBuf>,

    /// Send the bearer token in FILE with every call (else the
    /// DISPATCH_TOKEN variable's).
    #[arg(
        long,
        global = true,
        env = "DISPATCH_TOKEN_FILE",
        value_name = "FILE",
        help_heading = "Global options",
        display_order = 1002
    )]
    pub token_file: Option<std::path::PathBuf>,

    #[command(subcommand)]
    pub command: Command,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Submit a job: `dispatchctl submit [flags] -- CMD ARGS...`
    #[command(
        long_about = "Submit a job: the command after `--` runs on a node the dispatcher \
chooses, on CPUs its agent chooses within the job's alignment.\n\nPrints the job's id \
(for an array, one id per element; for a gang, the gang's id, then one id per member), \
or the job as JSON/YAML with -o. With --wait, waits \
for the job to end and exits with its exit code; with --follow, also streams its stdout \
(then the ids go to stderr).",
        after_long_help = "Examples:\n  \
dispatchctl submit -- ./simulate --steps 1000\n  \
dispatchctl submit --name build --cpus 8 --align llc --memory 16G --wait -- make -j8\n  \
dispatchctl submit --latency-nice -10 --selector zone=z1 --follow -- ./serve-batch\n  \
dispatchctl submit --array 100 --group sweep --timeout 30m -- ./run-shard\n  \
dispatchctl submit --nodes 4 --within rack --cpus 16 --timeout 2h -- ./mpi-rank\n  \
dispatchctl submit --nodes 8 --within rack --preferred --relax-after 10m --gang-retry replace -- ./train\n\n\
Exit codes with --wait: the job's exit status; 128+S if killed by signal S; 124 timed out \
(no signal); 130 cancelled; 3 lost. See `dispatchctl --help`."
    )]
    Submit(SubmitArgs),

    /// Show one job in detail: node, CPUs, state, placement reason, why it waits, times, exit
    #[command(visible_alias = "describe")]
    Get(GetArgs),

    /// List jobs (newest first), with filters
    #[command(
        visible_alias = "list",
        long_about = "List jobs, newest first: ID, NAME, STATE, NODE, CPUS, AGE (since submit), \
DURATION (run time), EXIT and REASON (for a waiting job why it waits, as `kind: message`, \
e.g. `queued_behind: waiting behind 2 jobs in node-3's queue`; else the placement decision \
or why the job ended; cut to 48 columns, use -o wide for all of it). Pages through the dispatcher's results as needed.",
        after_long_help = "Examples:\n  dispatchctl ls --state running --state pending\n  \
dispatchctl ls --state failed,lost --group nightly -o json\n  dispatchctl ls --node node-3 --limit 20"
    )]
    Ls(LsArgs),

    /// Cancel jobs (an array's or gang's id cancels all its elements or members)
    #[command(
        long_about = "Cancel jobs by id; an array's id cancels all its elements. Cancelling a \
job that has already ended is not an error: its state is shown unchanged. Every id is \
tried; the exit code is 1 if any failed."
    )]
    Cancel(CancelArgs),

    /// Print a job's stdout (or stderr); -f follows it until the job ends
    Logs(LogsArgs),

    /// Print one line per job state change (all jobs, or the given ones)
    #[command(
        long_about = "Print one line per job state change: time, id, previous -> new state, \
node and reason. Without ids it follows all jobs until interrupted (with --current, it \
first prints every job's current state). With ids, it starts with their current states \
and exits once all of them have ended."
    )]
    Watch(WatchArgs),

    /// List nodes: topology, state, free CPUs per level, jobs
    #[command(
        long_about = "List nodes: NAME, STATE, ZONE, RACK, SOCKETS, NUMA (nodes), LLC (last-level \
caches), CORES, T/C (threads per core), CPUS, BUSY (CPUs running a task), then the free \
CPUs per alignment level: the largest number of idle CPUs inside one core, LLC, NUMA node \
or package, and on the whole node (ANY) — what the node can give a job with that \
alignment — then RUN and WAIT (jobs running, and started but waiting for CPUs)."
    )]
    Nodes(NodesArgs),

    /// Inspect or administer one node: show, drain, cordon, uncordon
    Node(NodeArgs),

    /// Live view of nodes and queues (q to quit); --once prints one snapshot
    #[command(
        long_about = "A live full-screen view, refreshed every second: one bar per node (busy \
CPUs out of its CPUs) with its free CPUs per level, and the job queues (pending, assigned, \
running) split by latency class (latency-nice < 0 vs >= 0). Keys: q or Esc to quit, \
Up/Down and PgUp/PgDn to scroll the nodes.\n\nWith --once, prints one text snapshot to \
stdout and exits (for scripts, or without a terminal)."
    )]
    Top(TopArgs),

    /// Show which dispatcher address is used and where it came from
    #[command(
        long_about = "Show the dispatcher address dispatchctl would use and where it came from \
(--server, DISPATCH_SERVER, the config file, or the default). Does not contact the \
dispatcher."
    )]
    Config(ConfigArgs),
}

/// `-o` for commands that print jobs or nodes.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Output format
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// `--align`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum AlignArg {
    /// Hardware threads of one core
    Core,
    /// CPUs sharing one last-level cache
    Llc,
    /// One NUMA node
    Numa,
    /// One package (socket)
    Package,
    /// Anywhere on one node
    Any,
}

/// `--within`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WithinArg {
    /// All members in one rack
    Rack,
    /// All members in one zone
    Zone,
    /// Anywhere in the cluster
    Any,
}

/// `--gang-retry`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GangRetryArg {
    /// Stop every member and start the whole gang again
    Restart,
    /// Start only the lost member again, on a free node of the gang's domain
    /// (restart all when none has room)
    Replace,
}

/// `--policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    /// Emptiest node / idle core first
    Spread,
    /// Fill few nodes (lowest-numbered with room) so the rest can idle
    Pack,
}

/// `--state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StateArg {
    Pending,
    Assigned,
    Running,
    Succeeded,
    Failed,
    Cancelled,
    Lost,
}

#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {
    /// Job name shown by `ls` (at most 256 bytes)
    #[arg(long, short = 'J', alias = "job-name")]
    pub name: Option<String>,

    /// CPUs the job needs
    #[arg(long, short = 'c', default_value_t = 1, value_name = "N", alias = "cpus-per-task",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub cpus: u32,

    /// GPUs the job needs on its node (chosen by the agent near its CPUs;
    /// the job sees them in CUDA_VISIBLE_DEVICES)
    #[arg(long, short = 'G', default_value_t = 0, value_name = "K")]
    pub gpus: u32,

    /// Memory limit: bytes or with a unit (512M, 4G, 1.5GiB; powers of 1024)
    #[arg(long, visible_alias = "mem", value_name = "SIZE", value_parser = parse_size)]
    pub memory: Option<u64>,

    /// Where the job's CPUs must be relative to each other [default: any]
    #[arg(long, value_enum, value_name = "LEVEL")]
    pub align: Option<AlignArg>,

    /// How to choose among places with room [default: spread]
    #[arg(long, value_enum)]
    pub policy: Option<PolicyArg>,

    /// Node label the node must carry, KEY=VALUE (repeatable, or comma-separated)
    #[arg(long, short = 'l', value_name = "KEY=VALUE", value_parser = parse_key_value,
          value_delimiter = ',', action = clap::ArgAction::Append)]
    pub selector: Vec<KeyValue>,

    /// Environment variable for the job, KEY=VALUE (repeatable); the job starts
    /// from an empty environment plus PATH and HOME
    #[arg(long, short = 'e', value_name = "KEY=VALUE", value_parser = parse_key_value,
          action = clap::ArgAction::Append)]
    pub env: Vec<KeyValue>,

    /// Working directory on the node [default: the job's own directory]
    #[arg(long, visible_alias = "chdir", value_name = "DIR")]
    pub cwd: Option<String>,

    /// Latency-nice, -20..19: negative puts the job in the latency class, picked first when fair
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub latency_nice: Option<i32>,

    /// Nice, -20..19: the job's weight when CPUs are time-sliced
    #[arg(long, value_name = "N", allow_negative_numbers = true,
          value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub nice: Option<i32>,

    /// The job that released this one (parent / previous stage), for wake-affine placement
    #[arg(long, value_name = "JOB_ID")]
    pub waker: Option<String>,

    /// Group, for listing and filtering (`ls --group`)
    #[arg(long, short = 'g')]
    pub group: Option<String>,

    /// Times to retry the job if its node is lost (0..100)
    #[arg(long, value_name = "N")]
    pub retries: Option<u32>,

    /// Wall-clock limit (30s, 5m, 1h30m, 2d, HH:MM:SS); the job is killed past it
    #[arg(long, short = 't', visible_alias = "time", value_name = "DURATION", value_parser = parse_duration)]
    pub timeout: Option<Duration>,

    /// Submit an array of N jobs (ids <id>.0 .. <id>.N-1)
    #[arg(long, value_name = "N")]
    pub array: Option<u32>,

    /// Run as a gang of N members on N distinct nodes, each with --cpus/--memory/--align;
    /// all start together or none does (ids <id>.0 .. <id>.N-1; <id> is the gang)
    #[arg(long, short = 'N', value_name = "N", conflicts_with = "array",
          value_parser = clap::value_parser!(u32).range(1..))]
    pub nodes: Option<u32>,

    /// The domain that must hold all of a gang's members [default: any]
    #[arg(long, value_enum, value_name = "LEVEL", requires = "nodes")]
    pub within: Option<WithinArg>,

    /// --within is a preference: after --relax-after the gang may be placed anywhere
    #[arg(long, requires = "within")]
    pub preferred: bool,

    /// How long a --preferred gang waits for its domain before it relaxes (Slurm's
    /// --switches=N@time) [default: 5m]
    #[arg(long, value_name = "DURATION", value_parser = parse_duration, requires = "preferred")]
    pub relax_after: Option<Duration>,

    /// What a gang does when a member's node is lost (each retry counts against --retries)
    /// [default: restart]
    #[arg(long, value_enum, value_name = "POLICY", requires = "nodes")]
    pub gang_retry: Option<GangRetryArg>,

    /// Wait for the job to end and exit with its exit code
    #[arg(long)]
    pub wait: bool,

    /// Stream the job's stdout while waiting (implies --wait)
    #[arg(long, short = 'f')]
    pub follow: bool,

    #[command(flatten)]
    pub output: OutputArgs,

    /// The command and its arguments (after `--`)
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct GetArgs {
    /// Job id (e.g. j-42 or j-42.3)
    pub id: String,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct LsArgs {
    /// Only jobs in these states (repeatable or comma-separated)
    #[arg(long, short = 's', value_enum, value_delimiter = ',', action = clap::ArgAction::Append)]
    pub state: Vec<StateArg>,

    /// Only jobs on this node
    #[arg(long)]
    pub node: Option<String>,

    /// Only jobs of this group
    #[arg(long, short = 'g')]
    pub group: Option<String>,

    /// Only elements of this array (the array's id)
    #[arg(long, value_name = "ARRAY_ID")]
    pub array: Option<String>,

    /// Only members of this gang (the gang's id)
    #[arg(long, value_name = "GANG_ID")]
    pub gang: Option<String>,

    /// Show at most N jobs [default: all]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: Option<u64>,

    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct CancelArgs {
    /// Job or array ids
    #[arg(required = true, value_name = "ID")]
    pub ids: Vec<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct LogsArgs {
    /// Job id
    pub id: String,
    /// Show stderr instead of stdout
    #[arg(long)]
    pub stderr: bool,
    /// Keep printing new output until the job ends
    #[arg(long, short = 'f')]
    pub follow: bool,
}

#[derive(Debug, Clone, Args)]
pub struct WatchArgs {
    /// Only these jobs (then exit when all have ended)
    #[arg(value_name = "ID")]
    pub ids: Vec<String>,
    /// Without ids: first print every job's current state
    #[arg(long)]
    pub current: bool,
    /// Output format (json: one object per line)
    #[arg(short = 'o', long = "output", value_enum, default_value_t = WatchFormat::Text)]
    pub format: WatchFormat,
}

/// `watch -o`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WatchFormat {
    /// One line per change
    Text,
    /// One JSON object per change (JSON lines)
    Json,
}

#[derive(Debug, Clone, Args)]
pub struct NodesArgs {
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct NodeArgs {
    #[command(subcommand)]
    pub action: NodeAction,
}

/// `node` subcommands.
#[derive(Debug, Clone, Subcommand)]
pub enum NodeAction {
    /// Show one node: labels, topology (CPU groups per level), load
    #[command(visible_alias = "get")]
    Show {
        /// Node name
        name: String,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Stop placing jobs on the node and let its jobs finish
    Drain {
        /// Node name
        name: String,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Stop placing new jobs on the node
    Cordon {
        /// Node name
        name: String,
        #[command(flatten)]
        output: OutputArgs,
    },
    /// Place jobs on the node again
    Uncordon {
        /// Node name
        name: String,
        #[command(flatten)]
        output: OutputArgs,
    },
}

#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// Print one text snapshot to stdout and exit
    #[arg(long)]
    pub once: bool,
    /// Refresh interval (e.g. 1s, 500ms)
    #[arg(long, default_value = "1s", value_parser = parse_duration, value_name = "DURATION")]
    pub interval: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct ConfigArgs {
    #[command(flatten)]
    pub output: OutputArgs,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("dispatchctl").chain(args.iter().copied()))
    }

    #[test]
    fn submit_flags() {
        let cli = parse(&[
            "submit",
            "--cpus",
            "4",
            "--memory",
            "4G",
            "--gpus",
            "2",
            "--align",
            "llc",
            "--latency-nice",
            "-5",
            "--nice",
            "3",
            "-l",
            "zone=z1,rack=r2",
            "--selector",
            "gpu=no",
            "-e",
            "A=1,2",
            "--timeout",
            "1h30m",
            "--array",
            "10",
            "--wait",
            "--",
            "sh",
            "-c",
            "echo --cpus",
        ])
        .expect("parses");
        let Command::Submit(s) = cli.command else {
            panic!("not submit")
        };
        assert_eq!(s.cpus, 4);
        assert_eq!(s.memory, Some(4 << 30));
        assert_eq!(s.gpus, 2);
        assert_eq!(s.align, Some(AlignArg::Llc));
        assert_eq!(s.latency_nice, Some(-5));
        assert_eq!(s.nice, Some(3));
        let sel: Vec<_> = s.selector.iter().map(|kv| kv.key.as_str()).collect();
        assert_eq!(sel, ["zone", "rack", "gpu"]);
        assert_eq!(s.env.len(), 1);
        assert_eq!(s.env[0].value, "1,2");
        assert_eq!(s.timeout, Some(Duration::from_secs(5400)));
        assert_eq!(s.array, Some(10));
        assert!(s.wait);
        assert_eq!(s.command, ["sh", "-c", "echo --cpus"]);
    }

    #[test]
    fn bad_values_are_refused() {
        for bad in [
            &["submit", "--cpus", "0", "--", "x"][..],
            &["submit", "--latency-nice", "-21", "--", "x"],
            &["submit", "--nice", "20", "--", "x"],
            &["submit", "--memory", "4X", "--", "x"],
            &["submit", "--timeout", "30", "--", "x"],
            &["submit", "--env", "NOEQUALS", "--", "x"],
            &["submit", "--align", "socket", "--", "x"],
            &["submit", "--cpus", "2"],
            &["ls", "--state", "bogus"],
            &["cancel"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} should be refused");
        }
    }

    #[test]
    fn global_server_flag_anywhere() {
        let cli = parse(&["ls", "--server", "http://x:1", "-s", "running,failed"]).expect("ok");
        assert_eq!(cli.server.as_deref(), Some("http://x:1"));
        let Command::Ls(ls) = cli.command else {
            panic!("not ls")
        };
        assert_eq!(ls.state, [StateArg::Running, StateArg::Failed]);
    }
}
