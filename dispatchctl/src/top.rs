//! `dispatchctl top`: a live view of the cluster.
//!
//! Every interval it fetches the nodes and the active jobs (pending,
//! assigned, running) into a [`Snapshot`], then draws it full-screen with
//! ratatui on crossterm: a header with cluster totals, one row per node
//! with a bar of busy CPUs and its free CPUs per level, and the queues
//! split by latency class (latency-nice < 0 vs >= 0). `--once` prints the
//! same snapshot as text with [`render_text`] instead, so the view works
//! without a terminal and can be tested.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use proto::v1 as pb;
use ratatui::Frame;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::layout::{Alignment, Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Cell, Paragraph, Row, Table as TuiTable};

use crate::cli::TopArgs;
use crate::client::Client;
use crate::commands::now_ms;
use crate::output::{Column, Table, human_duration_ms, truncate, utc_time};
use crate::view::{FreeView, JobStateView, NodeStateView, node_cpus};
use crate::{EXIT_OK, Error, Io, Result};

/// Width of a node's busy bar, inside the brackets.
pub const BAR_WIDTH: usize = 20;

/// One node's line.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRow {
    pub name: String,
    pub state: NodeStateView,
    pub zone: String,
    pub rack: String,
    pub cpus: u32,
    /// `None` until the node reports load.
    pub busy: Option<u32>,
    pub free: Option<FreeView>,
    pub running: u32,
    pub waiting: u32,
    /// GPUs, and those no job holds.
    pub gpus: u32,
    pub gpus_free: u32,
    /// The gangs with a member holding the node (`j-N`).
    pub gangs: Vec<String>,
}

/// Active jobs by state and latency class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Queues {
    /// `[pending, assigned, running][latency (< 0), normal (>= 0)]`.
    pub counts: [[u64; 2]; 3],
}

impl Queues {
    /// Counts `jobs`; jobs in other states are ignored.
    pub fn count(jobs: &[pb::Job]) -> Self {
        let mut q = Queues::default();
        for j in jobs {
            let row = match JobStateView::from_i32(j.state) {
                JobStateView::Pending => 0,
                JobStateView::Assigned => 1,
                JobStateView::Running => 2,
                _ => continue,
            };
            let latency = j.spec.as_ref().is_some_and(|s| s.latency_nice < 0);
            q.counts[row][if latency { 0 } else { 1 }] += 1;
        }
        q
    }

    fn total(&self, row: usize) -> u64 {
        self.counts[row][0] + self.counts[row][1]
    }
}

/// What one refresh shows.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshot {
    pub server: String,
    pub time_ms: i64,
    pub nodes: Vec<NodeRow>,
    pub queues: Queues,
}

impl Snapshot {
    /// Builds a snapshot from API messages.
    pub fn new(server: &str, time_ms: i64, nodes: &[pb::Node], jobs: &[pb::Job]) -> Self {
        let nodes = nodes
            .iter()
            .map(|n| {
                let load = n.load.as_ref();
                NodeRow {
                    name: n.name.clone(),
                    state: NodeStateView::from_i32(n.state),
                    zone: n.zone.clone(),
                    rack: n.rack.clone(),
                    cpus: node_cpus(n),
                    busy: load.map(|l| l.cpus.iter().filter(|c| c.busy).count() as u32),
                    free: load.and_then(|l| l.free.as_ref()).map(FreeView::from),
                    running: load.map_or(0, |l| l.running_jobs),
                    waiting: load.map_or(0, |l| l.waiting_jobs),
                    gpus: n.gpus,
                    gpus_free: n.gpus_free,
                    gangs: n.gangs.clone(),
                }
            })
            .collect();
        Snapshot {
            server: server.to_string(),
            time_ms,
            nodes,
            queues: Queues::count(jobs),
        }
    }

    /// Fetches the nodes and the active jobs.
    pub async fn fetch(client: &mut Client) -> Result<Self> {
        let nodes = client.list_nodes().await?;
        let filter = pb::ListJobsRequest {
            states: vec![
                pb::JobState::Pending as i32,
                pb::JobState::Assigned as i32,
                pb::JobState::Running as i32,
            ],
            page_size: 5000,
            ..Default::default()
        };
        let jobs = client.list_all_jobs(&filter, None).await?;
        Ok(Snapshot::new(client.addr(), now_ms(), &nodes, &jobs))
    }

    /// The header's summary line: node count by state, busy CPUs, queues.
    pub fn summary(&self) -> String {
        let mut by_state: Vec<(NodeStateView, usize)> = Vec::new();
        for n in &self.nodes {
            match by_state.iter_mut().find(|(s, _)| *s == n.state) {
                Some((_, c)) => *c += 1,
                None => by_state.push((n.state, 1)),
            }
        }
        by_state.sort();
        let states: Vec<String> = by_state.iter().map(|(s, c)| format!("{c} {s}")).collect();
        let cpus: u64 = self.nodes.iter().map(|n| u64::from(n.cpus)).sum();
        let busy: u64 = self
            .nodes
            .iter()
            .map(|n| u64::from(n.busy.unwrap_or(0)))
            .sum();
        let pct = (busy * 100).checked_div(cpus).unwrap_or(0);
        let q = &self.queues;
        let gangs: std::collections::BTreeSet<&str> = self
            .nodes
            .iter()
            .flat_map(|n| n.gangs.iter().map(String::as_str))
            .collect();
        let gang_nodes = self.nodes.iter().filter(|n| !n.gangs.is_empty()).count();
        let gangs = if gangs.is_empty() {
            String::new()
        } else {
            format!(
                "   gangs: {} on {gang_nodes} node{}",
                gangs.len(),
                if gang_nodes == 1 { "" } else { "s" }
            )
        };
        format!(
            "nodes: {}{}   cpus: {busy}/{cpus} busy ({pct}%)   jobs: {} pending, {} assigned, {} running{gangs}",
            self.nodes.len(),
            if states.is_empty() {
                String::new()
            } else {
                format!(" ({})", states.join(", "))
            },
            q.total(0),
            q.total(1),
            q.total(2),
        )
    }

    /// One line per rack (zone/rack, in name order): nodes, busy CPUs,
    /// GPUs free/total, and the gangs with a member in it (each once).
    pub fn racks(&self) -> Vec<RackRow> {
        let mut racks: std::collections::BTreeMap<(&str, &str), RackRow> = Default::default();
        let mut gangs: std::collections::BTreeMap<(&str, &str), std::collections::BTreeSet<&str>> =
            Default::default();
        for n in &self.nodes {
            let key = (n.zone.as_str(), n.rack.as_str());
            let r = racks.entry(key).or_insert_with(|| RackRow {
                zone: n.zone.clone(),
                rack: n.rack.clone(),
                ..RackRow::default()
            });
            r.nodes += 1;
            r.cpus += n.cpus;
            r.busy += n.busy.unwrap_or(0);
            r.gpus += n.gpus;
            r.gpus_free += n.gpus_free;
            gangs
                .entry(key)
                .or_default()
                .extend(n.gangs.iter().map(String::as_str));
        }
        racks
            .into_iter()
            .map(|(key, mut r)| {
                r.gangs = gangs.get(&key).map_or(0, |g| g.len() as u32);
                r
            })
            .collect()
    }
}

/// One rack's line in `top --once`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RackRow {
    pub zone: String,
    pub rack: String,
    pub nodes: u32,
    pub cpus: u32,
    pub busy: u32,
    pub gpus: u32,
    pub gpus_free: u32,
    /// Gangs with a member in the rack, each once.
    pub gangs: u32,
}

/// `[||||||      ]`: `busy` of `total` over `width` characters, rounded
/// up so that any load shows.
pub fn bar(busy: u32, total: u32, width: usize) -> String {
    let filled = if total == 0 {
        0
    } else {
        let b = u64::from(busy.min(total));
        ((b * width as u64).div_ceil(u64::from(total))) as usize
    };
    format!(
        "[{}{}]",
        "|".repeat(filled),
        " ".repeat(width - filled.min(width))
    )
}

fn node_cells(n: &NodeRow) -> Vec<String> {
    let busy = match n.busy {
        Some(b) => format!("{} {b}/{}", bar(b, n.cpus, BAR_WIDTH), n.cpus),
        None => format!("{} -/{}", bar(0, n.cpus, BAR_WIDTH), n.cpus),
    };
    let dash = |s: &str| {
        if s.is_empty() {
            "-".to_string()
        } else {
            s.to_string()
        }
    };
    let mut row = vec![
        truncate(&n.name, 24),
        n.state.to_string(),
        truncate(&dash(&n.zone), 12),
        truncate(&dash(&n.rack), 12),
        busy,
        if n.gpus == 0 {
            "-".to_string()
        } else {
            format!("{}/{}", n.gpus_free, n.gpus)
        },
        n.gangs.len().to_string(),
    ];
    match n.free {
        Some(f) => row.extend([f.core, f.llc, f.numa, f.package, f.any].map(|v| v.to_string())),
        None => row.extend(std::iter::repeat_n("-".to_string(), 5)),
    }
    row.push(n.running.to_string());
    row.push(n.waiting.to_string());
    row
}

const NODE_HEADERS: [&str; 14] = [
    "NODE",
    "STATE",
    "ZONE",
    "RACK",
    "BUSY",
    "GPUS",
    "GANGS",
    "FREE:CORE",
    "LLC",
    "NUMA",
    "PKG",
    "ANY",
    "RUN",
    "WAIT",
];
const QUEUE_NAMES: [&str; 3] = ["pending", "assigned", "running"];
const QUEUE_HEADERS: [&str; 4] = ["QUEUE", "LATENCY(<0)", "NORMAL(>=0)", "TOTAL"];

fn queue_cells(q: &Queues) -> Vec<Vec<String>> {
    (0..3)
        .map(|i| {
            vec![
                QUEUE_NAMES[i].to_string(),
                q.counts[i][0].to_string(),
                q.counts[i][1].to_string(),
                q.total(i).to_string(),
            ]
        })
        .collect()
}

/// The `--once` text snapshot.
pub fn render_text(s: &Snapshot) -> String {
    let mut out = format!(
        "dispatchctl top   {}   {}\n{}\n\n",
        s.server,
        utc_time(s.time_ms),
        s.summary()
    );
    if s.nodes.is_empty() {
        out.push_str("No nodes: no agent has registered with this dispatcher yet.\n");
    } else {
        let mut t = Table::new(
            NODE_HEADERS
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    if i < 5 {
                        Column::left(h)
                    } else {
                        Column::right(h)
                    }
                })
                .collect(),
        );
        for n in &s.nodes {
            t.row(node_cells(n));
        }
        out.push_str(&t.render());
        out.push('\n');
        let mut r = Table::new(vec![
            Column::left("ZONE"),
            Column::left("RACK"),
            Column::right("NODES"),
            Column::right("BUSY"),
            Column::right("GPUS"),
            Column::right("GANGS"),
        ]);
        for rack in s.racks() {
            let dash = |s: &str| {
                if s.is_empty() {
                    "-".to_string()
                } else {
                    s.to_string()
                }
            };
            r.row(vec![
                dash(&rack.zone),
                dash(&rack.rack),
                rack.nodes.to_string(),
                format!("{}/{}", rack.busy, rack.cpus),
                if rack.gpus == 0 {
                    "-".to_string()
                } else {
                    format!("{}/{}", rack.gpus_free, rack.gpus)
                },
                rack.gangs.to_string(),
            ]);
        }
        out.push_str(&r.render());
    }
    out.push('\n');
    let mut q = Table::new(
        QUEUE_HEADERS
            .iter()
            .enumerate()
            .map(|(i, h)| {
                if i == 0 {
                    Column::left(h)
                } else {
                    Column::right(h)
                }
            })
            .collect(),
    );
    for r in queue_cells(&s.queues) {
        q.row(r);
    }
    out.push_str(&q.render());
    out
}

/// Bar color by load.
fn load_color(busy: Option<u32>, cpus: u32) -> Color {
    match busy {
        None => Color::DarkGray,
        Some(_) if cpus == 0 => Color::DarkGray,
        Some(b) if b * 10 >= cpus * 9 => Color::Red,
        Some(b) if b * 2 >= cpus => Color::Yellow,
        Some(_) => Color::Green,
    }
}

fn state_color(s: NodeStateView) -> Color {
    match s {
        NodeStateView::Ready => Color::Green,
        NodeStateView::Cordoned | NodeStateView::Draining => Color::Yellow,
        NodeStateView::Down => Color::Red,
        _ => Color::DarkGray,
    }
}

/// The live view's state between frames.
#[derive(Debug, Default)]
pub struct View {
    pub snapshot: Option<Snapshot>,
    /// The last refresh's error, shown in the footer.
    pub error: Option<String>,
    /// First node row shown.
    pub scroll: usize,
}

/// A right-aligned (numeric) cell.
fn right(text: String) -> Cell<'static> {
    Cell::from(Line::from(text).alignment(Alignment::Right))
}

/// Draws one frame.
pub fn draw(frame: &mut Frame, view: &View) {
    let queue_height = 3 + 2 + 1;
    let [head, nodes_area, queues_area, foot] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Min(4),
        Constraint::Length(queue_height),
        Constraint::Length(1),
    ])
    .areas(frame.area());

    let bold = Style::default().add_modifier(Modifier::BOLD);
    let (title, summary) = match &view.snapshot {
        Some(s) => (
            format!("dispatchctl top   {}   {}", s.server, utc_time(s.time_ms)),
            s.summary(),
        ),
        None => ("dispatchctl top".to_string(), "loading…".to_string()),
    };
    frame.render_widget(
        Paragraph::new(vec![
            Line::from(Span::styled(title, bold)),
            Line::from(summary),
        ]),
        head,
    );

    let widths = [
        Constraint::Min(8),
        Constraint::Length(9),
        Constraint::Length(8),
        Constraint::Length(8),
        Constraint::Length(BAR_WIDTH as u16 + 12),
        Constraint::Length(5),
        Constraint::Length(5),
        Constraint::Length(9),
        Constraint::Length(4),
        Constraint::Length(4),
        Constraint::Length(4),
        Constraint::Length(4),
        Constraint::Length(4),
        Constraint::Length(4),
    ];
    let header = Row::new(NODE_HEADERS.iter().enumerate().map(|(i, h)| {
        if i > 4 {
            right(h.to_string())
        } else {
            Cell::from(*h)
        }
    }))
    .style(bold);
    let rows: Vec<Row> = view
        .snapshot
        .iter()
        .flat_map(|s| s.nodes.iter())
        .skip(view.scroll)
        .map(|n| {
            let cells = node_cells(n);
            let color = load_color(n.busy, n.cpus);
            Row::new(cells.into_iter().enumerate().map(|(i, c)| match i {
                1 => Cell::from(c).style(Style::default().fg(state_color(n.state))),
                4 => Cell::from(c).style(Style::default().fg(color)),
                i if i > 4 => right(c),
                _ => Cell::from(c),
            }))
        })
        .collect();
    let node_count = view.snapshot.as_ref().map_or(0, |s| s.nodes.len());
    frame.render_widget(
        TuiTable::new(rows, widths).header(header).block(
            Block::default()
                .borders(Borders::ALL)
                .title(format!(" Nodes ({node_count}) ")),
        ),
        nodes_area,
    );

    let q_rows: Vec<Row> = view
        .snapshot
        .as_ref()
        .map(|s| queue_cells(&s.queues))
        .unwrap_or_default()
        .into_iter()
        .map(|r| {
            Row::new(r.into_iter().enumerate().map(
                |(i, c)| {
                    if i > 0 { right(c) } else { Cell::from(c) }
                },
            ))
        })
        .collect();
    frame.render_widget(
        TuiTable::new(
            q_rows,
            [
                Constraint::Length(10),
                Constraint::Length(12),
                Constraint::Length(12),
                Constraint::Length(8),
            ],
        )
        .header(
            Row::new(QUEUE_HEADERS.iter().enumerate().map(|(i, h)| {
                if i > 0 {
                    right(h.to_string())
                } else {
                    Cell::from(*h)
                }
            }))
            .style(bold),
        )
        .block(
            Block::default()
                .borders(Borders::ALL)
                .title(" Queues by latency class "),
        ),
        queues_area,
    );

    let footer = match &view.error {
        Some(e) => Line::from(Span::styled(
            format!("error: {e}"),
            Style::default().fg(Color::Red),
        )),
        None => Line::from("q quit   ↑/↓ PgUp/PgDn scroll"),
    };
    frame.render_widget(Paragraph::new(footer), foot);
}

/// `dispatchctl top`.
pub async fn top(client: &mut Client, a: &TopArgs, io: &mut Io<'_>) -> Result<u8> {
    if a.once {
        let s = Snapshot::fetch(client).await?;
        io.out.write_all(render_text(&s).as_bytes())?;
        return Ok(EXIT_OK);
    }
    // The first fetch happens before the screen is taken, so that an
    // unreachable dispatcher or a refused call prints a normal error.
    let first = Snapshot::fetch(client).await?;
    let mut terminal = ratatui::try_init().map_err(Error::Terminal)?;
    let result = live(client, a, &mut terminal, first).await;
    ratatui::restore();
    result
}

enum Input {
    Quit,
    Scroll(isize),
    Redraw,
}

/// Reads keys on a thread (crossterm's reads block) until `stop`.
fn spawn_input(stop: Arc<AtomicBool>) -> tokio::sync::mpsc::UnboundedReceiver<Input> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match event::poll(Duration::from_millis(100)) {
                Ok(true) => {}
                Ok(false) => continue,
                Err(_) => break,
            }
            let input = match event::read() {
                Ok(Event::Key(k)) if k.kind != KeyEventKind::Release => match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => Input::Quit,
                    KeyCode::Char('c') if k.modifiers.contains(KeyModifiers::CONTROL) => {
                        Input::Quit
                    }
                    KeyCode::Up | KeyCode::Char('k') => Input::Scroll(-1),
                    KeyCode::Down | KeyCode::Char('j') => Input::Scroll(1),
                    KeyCode::PageUp => Input::Scroll(-10),
                    KeyCode::PageDown => Input::Scroll(10),
                    KeyCode::Home => Input::Scroll(isize::MIN),
                    _ => continue,
                },
                Ok(Event::Resize(..)) => Input::Redraw,
                Ok(_) => continue,
                Err(_) => break,
            };
            if tx.send(input).is_err() {
                break;
            }
        }
    });
    rx
}

async fn live(
    client: &mut Client,
    a: &TopArgs,
    terminal: &mut ratatui::DefaultTerminal,
    first: Snapshot,
) -> Result<u8> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut keys = spawn_input(stop.clone());
    let mut view = View {
        snapshot: Some(first),
        ..View::default()
    };
    let interval = a.interval.max(Duration::from_millis(100));
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticker.tick().await;
    let result = loop {
        if let Err(e) = terminal.draw(|f| draw(f, &view)) {
            break Err(Error::Terminal(e));
        }
        tokio::select! {
            _ = ticker.tick() => {
                let timeout = interval.max(Duration::from_secs(5));
                match tokio::time::timeout(timeout, Snapshot::fetch(client)).await {
                    Ok(Ok(s)) => {
                        view.snapshot = Some(s);
                        view.error = None;
                    }
                    Ok(Err(e)) => view.error = Some(e.to_string()),
                    Err(_) => view.error = Some(format!(
                        "no answer from {} in {}", client.addr(),
                        human_duration_ms(i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX))
                    )),
                }
            }
            key = keys.recv() => match key {
                None | Some(Input::Quit) => break Ok(EXIT_OK),
                Some(Input::Scroll(d)) => {
                    let max = view.snapshot.as_ref().map_or(0, |s| s.nodes.len().saturating_sub(1));
                    view.scroll = view.scroll.saturating_add_signed(d).min(max);
                }
                Some(Input::Redraw) => {}
            },
        }
    };
    stop.store(true, Ordering::Relaxed);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars() {
        assert_eq!(bar(0, 64, 10), "[          ]");
        assert_eq!(bar(1, 64, 10), "[|         ]");
        assert_eq!(bar(32, 64, 10), "[|||||     ]");
        assert_eq!(bar(64, 64, 10), "[||||||||||]");
        assert_eq!(bar(99, 64, 10), "[||||||||||]");
        assert_eq!(bar(0, 0, 4), "[    ]");
    }
}
