//! The telemetry rows of `cargo xtask bench pipeline`: decode tok/s of `stage-server run --stages 3` with
//! telemetry off, exporting to a live loopback OTLP/HTTP sink, exporting to a black hole, and off again (the
//! control: what two starts of the same pipeline differ by), in one run.
//!
//! ```text
//!   block b:  start ─▶ warm up ─▶ time R requests ─▶ stop      one pipeline alive at a time,
//!             mode (b + 0) % 4, then (b + 1) % 4, ...          the order rotated every block
//!
//!   xtask ──stream──▶ run (mode) ──▶ stages 1, 2 ──OTLP/HTTP──▶ Sink (live: reads, answers 200;
//!                                                                     black hole: accepts, never reads)
//! ```
//!
//! Why blocks of fresh processes, one at a time: with the four pipelines side by side for the whole run,
//! two identical "off" pipelines differed by 4.7% (session 9), more than the 2% to be shown. Each start of a
//! process lands its buffers and threads somewhere new, and an idle "on" pipeline's periodic export ran while
//! another was timed. Here every mode gets a fresh start in every block and runs alone, so a start's luck
//! becomes noise between blocks (which the interval over blocks shows) instead of a bias of one row, and an
//! exporter's background work is charged to its own row. Decode tok/s is the client's view: completion tokens
//! after the first over the time from the first content delta to the last. Beside it, the CPU time (user and
//! system) the pipeline's processes spent per completion token while the request ran: on a shared machine
//! wall-clock rates move with whatever else runs, while the CPU a token costs moves much less, and it is what
//! telemetry would add.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench_serve::client::{self, Load};
use crate::figures::{PairedRatios, median, median_interval};

/// Completion tokens per timed request.
pub(crate) const TOKENS: usize = 128;
/// Compute threads of every process (as the other rows).
const THREADS: &str = "2";
/// How long a pipeline may take to load and pass its first health check.
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// The worker number of the untimed warm-up request (no timed request uses it, so prompts differ).
const WARM_UP_WORKER: usize = 1000;
/// Timed requests per pipeline start.
pub(crate) const REQUESTS_PER_BLOCK: usize = 5;

/// How a pipeline exports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Mode {
    Off,
    Live,
    BlackHole,
    /// A second pipeline with telemetry off: how far two identical pipelines differ in this run, the floor
    /// under which an "on" row's difference from "off" means nothing.
    OffControl,
}

pub(crate) const MODES: [Mode; 4] = [Mode::Off, Mode::Live, Mode::BlackHole, Mode::OffControl];

impl Mode {
    fn label(self) -> &'static str {
        match self {
            Mode::Off => "telemetry off",
            Mode::Live => "on, live loopback receiver (answers 200)",
            Mode::BlackHole => "on, black-hole endpoint (accepts, never answers)",
            Mode::OffControl => "off again, a second pipeline (control)",
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Mode::Off => "off",
            Mode::Live => "live",
            Mode::BlackHole => "black-hole",
            Mode::OffControl => "off-control",
        }
    }
}

/// What a sink does with a connection.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Answer {
    /// Reads the request and answers `200 OK` with an empty body.
    Ok,
    /// Accepts and holds the connection, never reading or answering.
    Never,
}

/// A tiny OTLP/HTTP collector on loopback: it counts what arrives and does not decode it.
struct Sink {
    address: SocketAddr,
    /// Connections accepted.
    connections: Arc<AtomicU64>,
    /// Requests read and answered (a black hole answers none).
    answered: Arc<AtomicU64>,
    /// Body bytes read.
    bytes: Arc<AtomicU64>,
}

impl Sink {
    fn start(answer: Answer) -> Result<Sink> {
        let listener =
            TcpListener::bind("127.0.0.1:0").context("could not bind the OTLP sink's port")?;
        let address = listener.local_addr()?;
        let sink = Sink {
            address,
            connections: Arc::default(),
            answered: Arc::default(),
            bytes: Arc::default(),
        };
        let (connections, answered, bytes) = (
            Arc::clone(&sink.connections),
            Arc::clone(&sink.answered),
            Arc::clone(&sink.bytes),
        );
        thread::Builder::new()
            .name(format!("otlp-sink-{answer:?}"))
            .spawn(move || {
                // A black hole keeps its connections open (never read) until the benchmark ends.
                let mut held = Vec::new();
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    connections.fetch_add(1, Ordering::Relaxed);
                    match answer {
                        Answer::Never => held.push(stream),
                        Answer::Ok => {
                            let (answered, bytes) = (Arc::clone(&answered), Arc::clone(&bytes));
                            thread::spawn(move || answer_requests(stream, &answered, &bytes));
                        }
                    }
                }
            })
            .context("could not start the OTLP sink's thread")?;
        Ok(sink)
    }

    fn url(&self) -> String {
        format!("http://{}", self.address)
    }
}

/// The live sink's answer to every request.
const OK_ANSWER: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n";

/// Reads requests off `stream` (Content-Length bodies) and answers each `200 OK`, until the client closes.
fn answer_requests(stream: TcpStream, answered: &AtomicU64, bytes: &AtomicU64) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(writer) = stream.try_clone() else {
        return;
    };
    let mut writer = writer;
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0usize;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            if header.trim().is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.trim().eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        bytes.fetch_add(length as u64, Ordering::Relaxed);
        answered.fetch_add(1, Ordering::Relaxed);
        if writer.write_all(OK_ANSWER).is_err() {
            return;
        }
    }
}

/// A `stage-server run --stages 3` child, interrupted (then killed) when dropped.
struct Pipeline {
    child: Child,
    address: SocketAddr,
    log: PathBuf,
}

impl Pipeline {
    fn start(
        binary: &Path,
        model: &Path,
        endpoint: Option<&str>,
        span_filter: Option<&str>,
        log: PathBuf,
    ) -> Result<Pipeline> {
        let address = TcpListener::bind("127.0.0.1:0")?.local_addr()?;
        // Appended to: every block starts a pipeline of each mode, and an earlier block's log is as telling.
        let output = File::options()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("could not open {}", log.display()))?;
        let mut command = Command::new(binary);
        command
            .arg("run")
            .args(["--stages", "3", "--lanes", "1", "--threads", THREADS])
            .arg("--model")
            .arg(model)
            .args(["--http", &address.to_string()])
            .env("CANDLE_NUM_THREADS", THREADS)
            .env("RAYON_NUM_THREADS", THREADS)
            // Off means off: no collector from the environment either.
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdin(Stdio::null())
            .stdout(output.try_clone()?)
            .stderr(output);
        if let Some(endpoint) = endpoint {
            command.args(["--otlp-endpoint", endpoint]);
            if let Some(filter) = span_filter {
                command.env("STAGE_SERVER_OTLP_FILTER", filter);
            }
        }
        let child = command
            .spawn()
            .with_context(|| format!("could not start {}", binary.display()))?;
        let mut pipeline = Pipeline {
            child,
            address,
            log,
        };
        pipeline.wait_ready()?;
        Ok(pipeline)
    }

    fn wait_ready(&mut self) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "stage-server run exited with {status} before it was ready; see {}",
                    self.log.display()
                );
            }
            if matches!(client::health(self.address), Ok(200)) {
                return Ok(());
            }
            thread::sleep(Duration::from_millis(200));
        }
        bail!(
            "stage-server run was not ready within {} s; see {}",
            READY_TIMEOUT.as_secs(),
            self.log.display()
        )
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The decode rates of one mode over the blocks.
#[derive(Debug, Default)]
pub(crate) struct Rates {
    /// Decode tok/s of every timed request.
    pub(crate) decode: Vec<f64>,
    pub(crate) tokens: Vec<f64>,
    /// CPU milliseconds of the pipeline's processes per completion token, every timed request.
    pub(crate) cpu_per_token_ms: Vec<f64>,
    /// The median decode tok/s of each block (one pipeline start), in block order: what pairs across modes.
    pub(crate) block_decode: Vec<f64>,
    /// The median CPU milliseconds per token of each block.
    pub(crate) block_cpu_per_token_ms: Vec<f64>,
}

/// What one telemetry measurement found.
#[derive(Debug)]
pub(crate) struct Measured {
    pub(crate) rates: Vec<Rates>,
    /// The live sink's answered requests and body bytes.
    pub(crate) live_requests: u64,
    pub(crate) live_bytes: u64,
    /// Connections the black hole accepted (and never answered).
    pub(crate) black_hole_connections: u64,
    /// The span filter of the "on" pipelines (`None`: the default, `info`).
    pub(crate) span_filter: Option<String>,
}

/// Runs `blocks` blocks: in each, every mode in turn (rotated) starts a fresh pipeline of `model`, warms it up,
/// times [`REQUESTS_PER_BLOCK`] requests and stops it.
pub(crate) fn measure(
    binary: &Path,
    model: &Path,
    blocks: usize,
    span_filter: Option<&str>,
    log_dir: &Path,
) -> Result<Measured> {
    let live = Sink::start(Answer::Ok)?;
    let black_hole = Sink::start(Answer::Never)?;
    std::fs::create_dir_all(log_dir)?;
    let log_of = |mode: Mode| log_dir.join(format!("telemetry-{}.log", mode.slug()));
    for mode in MODES {
        // Each run's logs start empty; the blocks of this run append to them.
        File::create(log_of(mode))
            .with_context(|| format!("could not create {}", log_of(mode).display()))?;
    }
    let mut rates: Vec<Rates> = MODES.iter().map(|_| Rates::default()).collect();
    for block in 0..blocks {
        for step in 0..MODES.len() {
            // Rotated so that no mode always starts first (or right after another's shutdown).
            let index = (block + step) % MODES.len();
            let mode = MODES[index];
            let endpoint = match mode {
                Mode::Off | Mode::OffControl => None,
                Mode::Live => Some(live.url()),
                Mode::BlackHole => Some(black_hole.url()),
            };
            let pipeline = Pipeline::start(
                binary,
                model,
                endpoint.as_deref(),
                span_filter,
                log_of(mode),
            )?;
            let load = Load {
                address: pipeline.address,
                model: client::served_model(pipeline.address)?,
                concurrency: 1,
                requests_per_worker: 1,
                max_tokens: TOKENS,
                temperature: 0.0,
            };
            client::stream_completion(&load, WARM_UP_WORKER, 0)
                .with_context(|| format!("a warm-up request failed ({})", mode.label()))?;
            let pid = pipeline.child.id();
            let mut decode_rates = Vec::with_capacity(REQUESTS_PER_BLOCK);
            let mut cpu_rates = Vec::with_capacity(REQUESTS_PER_BLOCK);
            for request in 0..REQUESTS_PER_BLOCK {
                // The same prompts for every mode in a block, different ones in each block.
                let prompt = block * REQUESTS_PER_BLOCK + request;
                let cpu_before = tree_cpu_seconds(pid);
                let record = client::stream_completion(&load, prompt, 0)
                    .with_context(|| format!("a timed request failed ({})", mode.label()))?;
                let cpu = tree_cpu_seconds(pid) - cpu_before;
                cpu_rates.push(cpu * 1e3 / record.tokens.max(1) as f64);
                let elapsed: f64 = record.gaps.iter().map(Duration::as_secs_f64).sum();
                decode_rates.push(if elapsed > 0.0 && record.tokens > 1 {
                    (record.tokens - 1) as f64 / elapsed
                } else {
                    0.0
                });
                rates[index].tokens.push(record.tokens as f64);
            }
            drop(pipeline);
            rates[index].block_decode.push(median(&decode_rates));
            rates[index].block_cpu_per_token_ms.push(median(&cpu_rates));
            rates[index].decode.extend(decode_rates);
            rates[index].cpu_per_token_ms.extend(cpu_rates);
        }
        let line: Vec<String> = MODES
            .iter()
            .zip(&rates)
            .map(|(mode, rates)| {
                format!(
                    "{} {:.1}",
                    mode.slug(),
                    rates.block_decode.last().copied().unwrap_or(0.0)
                )
            })
            .collect();
        eprintln!(
            "xtask: telemetry block {}/{blocks}: median decode tok/s {}",
            block + 1,
            line.join(", ")
        );
    }
    Ok(Measured {
        rates,
        live_requests: live.answered.load(Ordering::Relaxed),
        live_bytes: live.bytes.load(Ordering::Relaxed),
        black_hole_connections: black_hole.connections.load(Ordering::Relaxed),
        span_filter: span_filter.map(str::to_owned),
    })
}

/// User and system CPU seconds of process `root` and its descendants (`run` and its stage processes), from
/// `/proc/<pid>/stat` in clock ticks of 1/100 s (Linux's `USER_HZ` on every architecture we run on); 0 where
/// `/proc` cannot be read. Threads count in their process's figure.
fn tree_cpu_seconds(root: u32) -> f64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    let processes: Vec<(u32, u32, u64)> = entries
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            let (ppid, used) = parse_stat(&stat)?;
            Some((pid, ppid, used))
        })
        .collect();
    let mut tree = vec![root];
    let mut ticks = 0u64;
    while let Some(parent) = tree.pop() {
        for &(pid, ppid, used) in &processes {
            if pid == parent {
                ticks += used;
            }
            if ppid == parent {
                tree.push(pid);
            }
        }
    }
    ticks as f64 / 100.0
}

/// The parent pid and `utime + stime` of a `/proc/<pid>/stat` line (the command name, in parentheses, may
/// hold spaces, so fields are counted from its closing parenthesis).
fn parse_stat(stat: &str) -> Option<(u32, u64)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state (3), ppid (4), ... utime (14), stime (15), counting from 1 as proc(5) does.
    let ppid = fields.get(1)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((ppid, utime + stime))
}

/// The telemetry section of the report: a table per model, then how to read it.
pub(crate) fn render(model: &str, measured: &Measured) -> String {
    let off = median(&measured.rates[0].decode);
    let mut table = format!(
        "### {model}: telemetry\n\n| Telemetry | decode tok/s (median) | vs off | paired vs off | paired 95% interval | range over requests | CPU ms per token (median) | vs off | paired CPU vs off | paired CPU 95% interval | tokens per request |\n|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    let off_cpu = median(&measured.rates[0].cpu_per_token_ms);
    for (mode, rates) in MODES.iter().zip(&measured.rates) {
        let decode = median(&rates.decode);
        let low = rates.decode.iter().copied().fold(f64::INFINITY, f64::min);
        let high = rates.decode.iter().copied().fold(0.0, f64::max);
        let versus = if off > 0.0 {
            format!("{:+.1}%", (decode / off - 1.0) * 100.0)
        } else {
            "".to_owned()
        };
        // Each block's median over the same block's "off" median (pipelines started a minute apart at most),
        // then the median over blocks and its bootstrap interval: the interval, not the median alone, says
        // whether a 2% difference is resolved.
        let (paired, paired_interval) =
            paired_columns(&rates.block_decode, &measured.rates[0].block_decode);
        let cpu = median(&rates.cpu_per_token_ms);
        let cpu_versus = if off_cpu > 0.0 {
            format!("{:+.1}%", (cpu / off_cpu - 1.0) * 100.0)
        } else {
            "".to_owned()
        };
        let (cpu_paired, cpu_interval) = paired_columns(
            &rates.block_cpu_per_token_ms,
            &measured.rates[0].block_cpu_per_token_ms,
        );
        let _ = writeln!(
            table,
            "| {} | {decode:.1} | {versus} | {paired} | {paired_interval} | {low:.1} to {high:.1} | {cpu:.2} | {cpu_versus} | {cpu_paired} | {cpu_interval} | {:.0} |",
            mode.label(),
            median(&rates.tokens),
        );
    }
    let _ = write!(
        table,
        "\nExported spans: {}. The live receiver answered {} OTLP requests ({} bytes of protobuf); the black hole \
         accepted {} connections and answered none.\n",
        match &measured.span_filter {
            None => "the default filter (`info`: request, generation and stage sessions; no per-token spans)"
                .to_owned(),
            Some(filter) => format!("`STAGE_SERVER_OTLP_FILTER={filter}`"),
        },
        measured.live_requests,
        measured.live_bytes,
        measured.black_hole_connections,
    );
    table
}

/// The median of `on[i] / off[i]` (block by block) as a signed percentage and its 95% bootstrap interval, or
/// empty cells when no block pairs.
fn paired_columns(on: &[f64], off: &[f64]) -> (String, String) {
    let paired = PairedRatios::new(on, off);
    if paired.median.is_nan() {
        return (String::new(), String::new());
    }
    let percent = |ratio: f64| format!("{:+.1}%", (ratio - 1.0) * 100.0);
    // `median_interval` leaves out the blocks without a usable "off" figure, as the median does.
    let (low, high) = median_interval(&paired.per_round);
    (
        percent(paired.median),
        format!("{} to {}", percent(low), percent(high)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_live_sink_answers_every_request_on_a_kept_alive_connection() {
        let sink = Sink::start(Answer::Ok).unwrap();
        let mut stream = TcpStream::connect(sink.address).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        for _ in 0..2 {
            stream
                .write_all(b"POST /v1/traces HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
                .unwrap();
            let mut answer = vec![0u8; OK_ANSWER.len()];
            stream.read_exact(&mut answer).unwrap();
            assert!(
                answer.starts_with(b"HTTP/1.1 200 OK\r\n"),
                "the sink answered {:?}",
                String::from_utf8_lossy(&answer)
            );
        }
        assert_eq!(sink.answered.load(Ordering::Relaxed), 2);
        assert_eq!(sink.bytes.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn the_table_gives_each_mode_against_off() {
        let measured = Measured {
            rates: vec![
                Rates {
                    decode: vec![100.0, 102.0, 98.0],
                    tokens: vec![128.0; 3],
                    cpu_per_token_ms: vec![10.0],
                    block_decode: vec![100.0, 50.0],
                    block_cpu_per_token_ms: vec![10.0, 20.0],
                },
                Rates {
                    decode: vec![99.0],
                    tokens: vec![128.0],
                    cpu_per_token_ms: vec![10.5],
                    block_decode: vec![99.0, 49.5],
                    block_cpu_per_token_ms: vec![10.5, 21.0],
                },
                Rates {
                    decode: vec![95.0],
                    tokens: vec![128.0],
                    cpu_per_token_ms: vec![10.0],
                    block_decode: vec![95.0, 47.5],
                    block_cpu_per_token_ms: vec![10.0, 20.0],
                },
            ],
            live_requests: 4,
            live_bytes: 1000,
            black_hole_connections: 2,
            span_filter: None,
        };
        let table = render("m.gguf", &measured);
        assert!(
            table.contains(
                "| telemetry off | 100.0 | +0.0% | +0.0% | +0.0% to +0.0% | 98.0 to 102.0 | 10.00 | +0.0% | +0.0% | +0.0% to +0.0% | 128 |"
            ),
            "{table}"
        );
        // Paired block by block (99 / 100 and 49.5 / 50), however far the blocks' levels differ.
        assert!(
            table.contains("| -1.0% | -1.0% | -1.0% to -1.0% |"),
            "{table}"
        );
        assert!(
            table.contains("| 10.50 | +5.0% | +5.0% | +5.0% to +5.0% |"),
            "{table}"
        );
        assert!(
            table.contains("| -5.0% | -5.0% | -5.0% to -5.0% |"),
            "{table}"
        );
    }

    #[test]
    fn a_stat_line_gives_the_parent_and_the_cpu_ticks_even_with_spaces_in_the_name() {
        let line =
            "27991 (stage server) R 27988 27988 25951 0 -1 4194304 126 0 0 0 7 3 0 0 20 0 1 0";
        assert_eq!(parse_stat(line), Some((27988, 10)));
        assert_eq!(parse_stat("garbage"), None);
    }
}
