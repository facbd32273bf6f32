//! `cargo xtask bench serve`: an HTTP load benchmark of stage 0's OpenAI API beside llama.cpp's llama-server,
//! on the same model and machine in one run.
//!
//! Each server in turn is started on a free loopback port, waited for until `GET /health` answers 200, warmed
//! with one request, then loaded at every concurrency (1, 2, 4 and 8 by default) with the closed-loop client
//! of [`client`]: C workers, each posting a streaming `/v1/chat/completions` and sending its next only after
//! `[DONE]`. While it still runs, the shaped [`scenarios`] follow (unless `--skip-scenarios`): prefix reuse
//! (the time to first token of a request whose ~1,000-token system prompt the previous request sent, against
//! the cold one's) and admission under load (the inter-token gaps of three streams when a ~512-token prompt
//! arrives, against without it). Then it is stopped (SIGINT, then kill). The servers:
//! - ours whole: `stage-server run --stages 1 --model F --http ADDR --lanes 4 --threads 2`;
//! - ours as three stages: the same with `--stages 3`;
//! - llama.cpp: `llama-server -m F --host 127.0.0.1 --port P -np 4 -c 8192 -t 2`, built from the source in
//!   the pinned npm package (`cargo xtask llama-ref server`).
//!
//! A server that does not start is reported as such and the others still run.

pub(crate) mod client;
mod scenarios;

use std::fmt::Write as _;
use std::fs::{self, File};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::bench_model::{command_output, target_dir};
use crate::figures::load_average;
use crate::models::{self, MODELS};
use crate::{cargo, llama_ref, workspace_root};

use client::{LevelFigures, Load};
use scenarios::ScenarioFigures;

/// Compute threads of every server.
const THREADS: &str = "2";
/// Requests in flight at once inside a server: our lanes, llama-server's slots.
const LANES_DEFAULT: usize = 4;
/// llama-server's context per slot: `-c` is this times the slots, as each of ours gets the model's whole.
const LLAMA_CONTEXT_PER_SLOT: usize = 2048;
/// llama-server's whole context, shared by its slots (2048 each).
/// How long a server may take to load its model and answer `/health` with 200.
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// How long a server may take to exit after SIGINT before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// The worker number of the warm-up request's prompt.
const WARM_UP_WORKER: usize = 1000;
/// Lines of a server's log shown when it fails to start.
const LOG_TAIL_LINES: usize = 20;

/// The servers this benchmark can run.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Server {
    /// `stage-server run` with its model in `stages` stages.
    Ours { stages: usize },
    /// llama.cpp's `llama-server`.
    Llama,
}

/// Which servers to leave out.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Skip {
    Nothing,
    Ours,
    Llama,
}

/// Whether the shaped scenarios run after each server's concurrency levels.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Scenarios {
    Run,
    Skip,
}

/// The command line of `cargo xtask bench serve`.
#[derive(Debug, Clone, PartialEq)]
struct Options {
    model: &'static str,
    concurrencies: Vec<usize>,
    requests_per_worker: usize,
    max_tokens: usize,
    skip: Skip,
    scenarios: Scenarios,
    /// Our layouts to run: stage processes per pipeline (1: the whole model).
    stages: Vec<usize>,
    /// `--decode-stretch` for our servers, as given (`None`: their default).
    decode_stretch: Option<String>,
    /// Generations each server runs at once (ours `--lanes`, llama-server's `-np` slots).
    lanes: usize,
    /// `--link-delay` in milliseconds for our pipelines of more than one stage, as given (`None`: loopback as
    /// it is): every stage link, and the last stage's returns, delayed that much each way.
    link_delay: Option<String>,
    /// `--batches-in-flight` for our pipelines of more than one stage, as given (`None`: their default).
    batches_in_flight: Option<usize>,
    /// `--prompt-hold-steps` for our servers, as given (`None`: their default).
    prompt_hold_steps: Option<usize>,
    /// `temperature` of every request, as given (`None`: 0, greedy). Above 0 both servers sample with their
    /// default cuts (top-k 40, top-p 0.95, min-p 0.05: the same in both), as an OpenAI client that sets no
    /// temperature gets from ours (0.8).
    temperature: Option<f64>,
}

/// One concurrency's figures for one server.
#[derive(Debug, Clone)]
struct Level {
    concurrency: usize,
    figures: LevelFigures,
    /// The 1-minute load average when the level ended: on a shared machine, how much else was running.
    load_after: String,
}

/// One server's figures, or why it has none.
#[derive(Debug)]
struct ServerResult {
    server: Server,
    levels: Result<Vec<Level>, String>,
    /// The shaped scenarios' figures; `None` when they were skipped or the server never got that far.
    scenarios: Option<ScenarioFigures>,
}

/// A running server child with its log file; stopped when dropped.
#[derive(Debug)]
struct Running {
    child: Child,
    address: SocketAddr,
    log: PathBuf,
}

impl Server {
    fn label(self) -> String {
        match self {
            Server::Ours { stages: 1 } => "stage-server, whole".to_owned(),
            Server::Ours { stages } => format!("stage-server, {stages} stages"),
            Server::Llama => "llama-server".to_owned(),
        }
    }

    /// A file-name-safe name for the server's log.
    fn slug(self) -> String {
        match self {
            Server::Ours { stages } => format!("ours-{stages}"),
            Server::Llama => "llama".to_owned(),
        }
    }
}

impl Options {
    fn parse(arguments: &[String]) -> Result<Options> {
        let mut options = Options {
            model: "smollm2",
            concurrencies: vec![1, 2, 4, 8],
            requests_per_worker: 4,
            max_tokens: 128,
            skip: Skip::Nothing,
            scenarios: Scenarios::Run,
            stages: vec![1, 3],
            decode_stretch: None,
            lanes: LANES_DEFAULT,
            link_delay: None,
            batches_in_flight: None,
            prompt_hold_steps: None,
            temperature: None,
        };
        let mut iterator = arguments.iter();
        while let Some(argument) = iterator.next() {
            let mut value = |what: &str| {
                iterator
                    .next()
                    .with_context(|| format!("{argument} needs {what}"))
            };
            match argument.as_str() {
                "--model" => {
                    let name = value("a model name")?;
                    options.model = MODELS
                        .iter()
                        .find(|model| model.short_name == name)
                        .map(|model| model.short_name)
                        .with_context(|| {
                            format!(
                                "unknown model `{name}`; --model takes one of: {}",
                                MODELS.map(|model| model.short_name).join(", ")
                            )
                        })?;
                }
                "--concurrency" => {
                    options.concurrencies = value("a list such as 1,2,4,8")?
                        .split(',')
                        .map(|level| level.trim().parse().ok().filter(|&level: &usize| level > 0))
                        .collect::<Option<_>>()
                        .context("--concurrency takes positive counts separated by commas")?;
                }
                "--requests-per-worker" => {
                    options.requests_per_worker = positive(value("a count")?, argument)?;
                }
                "--tokens" => options.max_tokens = positive(value("a count")?, argument)?,
                "--skip-llama" => options.skip = Skip::Llama,
                "--skip-ours" => options.skip = Skip::Ours,
                "--skip-scenarios" => options.scenarios = Scenarios::Skip,
                "--stages" => {
                    options.stages = value("a list such as 1,3")?
                        .split(',')
                        .map(|count| count.trim().parse().ok().filter(|&count: &usize| count > 0))
                        .collect::<Option<_>>()
                        .context("--stages takes positive stage counts separated by commas")?;
                }
                "--decode-stretch" => {
                    let text = value("a multiple such as 2, or 0 for no bound")?;
                    let stretch: f64 = text
                        .parse()
                        .ok()
                        .filter(|stretch: &f64| {
                            *stretch == 0.0 || (stretch.is_finite() && *stretch >= 1.0)
                        })
                        .with_context(|| {
                            format!(
                                "--decode-stretch takes 0 or a number of at least 1, not `{text}`"
                            )
                        })?;
                    options.decode_stretch = Some(stretch.to_string());
                }
                "--lanes" => options.lanes = positive(value("a count")?, argument)?,
                "--link-delay" => {
                    let text = value("milliseconds such as 5")?;
                    let delay: f64 = text
                        .parse()
                        .ok()
                        .filter(|delay: &f64| delay.is_finite() && *delay >= 0.0)
                        .with_context(|| {
                            format!("--link-delay takes milliseconds (0 or more), not `{text}`")
                        })?;
                    options.link_delay = (delay > 0.0).then(|| delay.to_string());
                }
                "--batches-in-flight" => {
                    let text = value("a count such as 1, or 0 for no hold")?;
                    options.batches_in_flight = Some(text.parse().ok().with_context(|| {
                        format!("--batches-in-flight takes a count (0 or more), not `{text}`")
                    })?);
                }
                "--prompt-hold-steps" => {
                    let text = value("a count such as 16, or 0 for no hold")?;
                    options.prompt_hold_steps = Some(text.parse().ok().with_context(|| {
                        format!("--prompt-hold-steps takes a count (0 or more), not `{text}`")
                    })?);
                }
                "--temperature" => {
                    let text = value("a temperature such as 0.8")?;
                    let temperature: f64 = text
                        .parse()
                        .ok()
                        .filter(|temperature: &f64| (0.0..=2.0).contains(temperature))
                        .with_context(|| {
                            format!("--temperature takes a number from 0 to 2, not `{text}`")
                        })?;
                    options.temperature = (temperature > 0.0).then_some(temperature);
                }
                other => bail!(
                    "unknown argument `{other}` to `cargo xtask bench serve` (takes --model smollm2|gemma3, \
                     --concurrency 1,2,4,8, --requests-per-worker N, --tokens N, --stages 1,3, \
                     --decode-stretch X, --lanes N, --link-delay MS, --batches-in-flight N, --prompt-hold-steps N, --temperature T, --skip-llama, \
                     --skip-ours, --skip-scenarios)"
                ),
            }
        }
        Ok(options)
    }

    /// The command that reproduces this run, for the report.
    fn command(&self) -> String {
        let levels: Vec<String> = self.concurrencies.iter().map(usize::to_string).collect();
        let skip = match self.skip {
            Skip::Nothing => "",
            Skip::Ours => " --skip-ours",
            Skip::Llama => " --skip-llama",
        };
        let scenarios = match self.scenarios {
            Scenarios::Run => "",
            Scenarios::Skip => " --skip-scenarios",
        };
        let stages: Vec<String> = self.stages.iter().map(usize::to_string).collect();
        let stages = if stages == ["1", "3"] {
            String::new()
        } else {
            format!(" --stages {}", stages.join(","))
        };
        let stretch = self
            .decode_stretch
            .as_ref()
            .map(|stretch| format!(" --decode-stretch {stretch}"))
            .unwrap_or_default();
        let lanes = if self.lanes == LANES_DEFAULT {
            String::new()
        } else {
            format!(" --lanes {}", self.lanes)
        };
        let delay = self
            .link_delay
            .as_ref()
            .map(|delay| format!(" --link-delay {delay}"))
            .unwrap_or_default();
        let in_flight = self
            .batches_in_flight
            .map(|count| format!(" --batches-in-flight {count}"))
            .unwrap_or_default();
        let hold = self
            .prompt_hold_steps
            .map(|count| format!(" --prompt-hold-steps {count}"))
            .unwrap_or_default();
        let temperature = self
            .temperature
            .as_ref()
            .map(|temperature| format!(" --temperature {temperature}"))
            .unwrap_or_default();
        format!(
            "cargo xtask bench serve --model {} --concurrency {} --requests-per-worker {} --tokens \
             {}{stages}{stretch}{lanes}{delay}{in_flight}{hold}{temperature}{skip}{scenarios}",
            self.model,
            levels.join(","),
            self.requests_per_worker,
            self.max_tokens
        )
    }
}

impl Running {
    /// Waits until `GET /health` answers 200, the child exits or the timeout passes.
    fn wait_ready(&mut self, server: Server) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let mut last = String::from("no answer yet");
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                bail!(
                    "{} exited with {status} before it was ready; the end of {}:\n{}",
                    server.label(),
                    self.log.display(),
                    log_tail(&self.log)
                );
            }
            match client::health(self.address) {
                Ok(200) => return Ok(()),
                Ok(status) => last = format!("GET /health answered {status}"),
                Err(error) => last = format!("{error:#}"),
            }
            thread::sleep(Duration::from_millis(200));
        }
        bail!(
            "{} was not ready within {} s ({last}); the end of {}:\n{}",
            server.label(),
            READY_TIMEOUT.as_secs(),
            self.log.display(),
            log_tail(&self.log)
        )
    }
}

impl Drop for Running {
    /// SIGINT first so the server can close its listener and children; kill if it lingers.
    fn drop(&mut self) {
        let interrupted = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        let deadline = Instant::now() + STOP_TIMEOUT;
        while interrupted && Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs `cargo xtask bench serve [options]`.
pub fn run(arguments: &[String]) -> Result<()> {
    let options = Options::parse(arguments)?;
    let model = MODELS
        .iter()
        .find(|model| model.short_name == options.model)
        .context("the parsed model is one of MODELS")?;
    let model_path = models::model_dir()?.join(model.file_name);
    ensure!(
        model_path.exists(),
        "{} is missing; run `cargo xtask fetch-models {}` first",
        model_path.display(),
        model.short_name
    );
    let mut servers = Vec::new();
    let mut ours = None;
    if options.skip != Skip::Ours {
        cargo(&["build", "--release", "-p", "stage-server"])?;
        let binary = target_dir().join("release/stage-server");
        ensure!(binary.exists(), "cargo built no {}", binary.display());
        ours = Some(binary);
        servers.extend(options.stages.iter().map(|&stages| Server::Ours { stages }));
    }
    let mut llama = None;
    if options.skip != Skip::Llama {
        llama = Some(llama_ref::ensure_server_built()?);
        servers.push(Server::Llama);
    }
    ensure!(
        !servers.is_empty(),
        "nothing to run: --skip-ours and --skip-llama together leave no server"
    );
    let log_dir = target_dir().join("bench-serve");
    fs::create_dir_all(&log_dir)
        .with_context(|| format!("could not create {}", log_dir.display()))?;
    let load_before = load_average();
    let mut results = Vec::new();
    for server in servers {
        let binary = match server {
            Server::Ours { .. } => ours.as_deref(),
            Server::Llama => llama.as_deref(),
        }
        .context("a server is only listed once its binary is built")?;
        eprintln!("xtask: {} on {}", server.label(), model.file_name);
        let (levels, scenarios) = match measure(server, binary, &model_path, &options, &log_dir) {
            Ok((levels, scenarios)) => (Ok(levels), scenarios),
            Err(error) => {
                eprintln!("xtask: {} gave no figures: {error:#}", server.label());
                (Err(format!("{error:#}")), None)
            }
        };
        results.push(ServerResult {
            server,
            levels,
            scenarios,
        });
        write_report(&options, model.file_name, &load_before, &results)?;
    }
    println!(
        "{}{}",
        render_results(&options, &results),
        scenarios::render(&results)
    );
    Ok(())
}

/// Starts `server`, loads it at every concurrency, runs the scenarios unless they are skipped, and stops it.
fn measure(
    server: Server,
    binary: &Path,
    model: &Path,
    options: &Options,
    log_dir: &Path,
) -> Result<(Vec<Level>, Option<ScenarioFigures>)> {
    let mut running = start(server, binary, model, log_dir, options)?;
    running.wait_ready(server)?;
    let mut load = Load {
        address: running.address,
        model: client::served_model(running.address)?,
        concurrency: 1,
        requests_per_worker: 1,
        max_tokens: options.max_tokens,
        temperature: options.temperature.unwrap_or(0.0),
    };
    // One untimed request: first-touch page faults of the weights and lazily built state stay out of the
    // figures. Its worker number is one no load level uses, so its prompt is not repeated later.
    client::stream_completion(&load, WARM_UP_WORKER, 0).context("the warm-up request failed")?;
    let mut levels = Vec::new();
    for &concurrency in &options.concurrencies {
        load.concurrency = concurrency;
        load.requests_per_worker = options.requests_per_worker;
        let figures = client::run_level(&load).figures();
        eprintln!(
            "xtask:   concurrency {concurrency}: {:.1} tok/s, TTFT p50 {:.0} ms, ITL p50 {:.1} ms, {} done, {} errors",
            figures.tokens_per_second,
            figures.first_token_p50_ms,
            figures.gap_p50_ms,
            figures.completed,
            figures.errors
        );
        levels.push(Level {
            concurrency,
            figures,
            load_after: one_minute_load(),
        });
    }
    let scenarios = match options.scenarios {
        Scenarios::Run => Some(scenarios::run(&load)),
        Scenarios::Skip => None,
    };
    drop(running);
    Ok((levels, scenarios))
}

/// The 1-minute load average now: on a shared machine, how much else is running.
fn one_minute_load() -> String {
    load_average()
        .split_whitespace()
        .next()
        .unwrap_or("unknown")
        .to_owned()
}

/// Spawns `server` on a free loopback port with its output in `<log_dir>/<slug>.log`, with `options.lanes`
/// generations at a time; ours get `--decode-stretch` where given, and our pipelines `--link-delay`.
fn start(
    server: Server,
    binary: &Path,
    model: &Path,
    log_dir: &Path,
    options: &Options,
) -> Result<Running> {
    let lanes = options.lanes.to_string();
    let address = free_address()?;
    let log = log_dir.join(format!("{}.log", server.slug()));
    let output =
        File::create(&log).with_context(|| format!("could not create {}", log.display()))?;
    let mut command = Command::new(binary);
    match server {
        Server::Ours { stages } => {
            command
                .arg("run")
                .args(["--stages", &stages.to_string(), "--model"])
                .arg(model)
                .args([
                    "--http",
                    &address.to_string(),
                    "--lanes",
                    &lanes,
                    "--threads",
                    THREADS,
                ])
                .env("CANDLE_NUM_THREADS", THREADS)
                .env("RAYON_NUM_THREADS", THREADS);
            if let Some(stretch) = &options.decode_stretch {
                command.args(["--decode-stretch", stretch]);
            }
            if let Some(delay) = options.link_delay.as_ref().filter(|_| stages > 1) {
                command.args(["--link-delay", delay]);
            }
            if let Some(count) = options.batches_in_flight.filter(|_| stages > 1) {
                command.args(["--batches-in-flight", &count.to_string()]);
            }
            if let Some(count) = options.prompt_hold_steps {
                command.args(["--prompt-hold-steps", &count.to_string()]);
            }
        }
        Server::Llama => {
            command
                .arg("-m")
                .arg(model)
                .args(["--host", "127.0.0.1", "--port", &address.port().to_string()])
                .args([
                    "-np",
                    &lanes,
                    "-c",
                    &(LLAMA_CONTEXT_PER_SLOT * options.lanes).to_string(),
                ])
                .args(["-t", THREADS]);
        }
    }
    let child = command
        .stdin(Stdio::null())
        .stdout(output.try_clone()?)
        .stderr(output)
        .spawn()
        .with_context(|| format!("could not start {}", binary.display()))?;
    Ok(Running {
        child,
        address,
        log,
    })
}

/// A loopback port nothing listens on now. The listener is dropped before the server binds, so another
/// process could take the port in between; on a benchmark machine that race is not worth a retry loop.
fn free_address() -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("could not bind a loopback port")?;
    Ok(listener.local_addr()?)
}

/// The last lines of a server's log, indented for an error message.
fn log_tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..]
        .iter()
        .map(|line| format!("  {line}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// `positive` parses a count above zero for `flag`.
fn positive(value: &str, flag: &str) -> Result<usize> {
    value
        .parse()
        .ok()
        .filter(|&count: &usize| count > 0)
        .with_context(|| format!("{flag} needs a positive count, not `{value}`"))
}

/// The machine as `nproc` and `/proc/cpuinfo` describe it.
fn machine() -> String {
    let cpuinfo = fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == "model name").then(|| value.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    format!("{model}, {} CPUs (nproc)", command_output("nproc", &[]))
}

/// The results table and the ratios against llama-server.
fn render_results(options: &Options, results: &[ServerResult]) -> String {
    let mut text = String::from(
        "| Server | concurrency | completed | errors | output tok/s | tokens/request | TTFT p50 ms | \
         TTFT p99 ms | ITL p50 ms | ITL p99 ms | load after |\n|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut failures = String::new();
    for result in results {
        match &result.levels {
            Ok(levels) => {
                for level in levels {
                    let (concurrency, figures) = (level.concurrency, &level.figures);
                    let _ = writeln!(
                        text,
                        "| {} | {concurrency} | {} | {} | {:.1} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {} |",
                        result.server.label(),
                        figures.completed,
                        figures.errors,
                        figures.tokens_per_second,
                        figures.tokens_per_request,
                        figures.first_token_p50_ms,
                        figures.first_token_p99_ms,
                        figures.gap_p50_ms,
                        figures.gap_p99_ms,
                        level.load_after,
                    );
                    if let Some(error) = &figures.first_error {
                        let _ = writeln!(
                            failures,
                            "- {} at concurrency {concurrency}, first error: {}",
                            result.server.label(),
                            error.replace('\n', " ")
                        );
                    }
                }
            }
            Err(error) => {
                let _ = writeln!(
                    failures,
                    "- {} gave no figures:\n\n```text\n{}\n```",
                    result.server.label(),
                    error.trim()
                );
            }
        }
    }
    let ratios = render_ratios(options, results);
    if !ratios.is_empty() {
        let _ = write!(
            text,
            "\n### Ours over llama-server\n\nAbove 1 is better for throughput, below 1 is better for \
             latencies.\n\n{ratios}"
        );
    }
    if !failures.is_empty() {
        let _ = write!(text, "\n### Failures\n\n{failures}");
    }
    text
}

/// Per concurrency: each of our layouts' throughput and latencies divided by llama-server's.
fn render_ratios(options: &Options, results: &[ServerResult]) -> String {
    let figures_of = |server: Server, concurrency: usize| {
        results
            .iter()
            .find(|result| result.server == server)
            .and_then(|result| result.levels.as_ref().ok())
            .and_then(|levels| levels.iter().find(|level| level.concurrency == concurrency))
            .map(|level| &level.figures)
    };
    let mut text = String::new();
    for result in results {
        let Server::Ours { .. } = result.server else {
            continue;
        };
        for &concurrency in &options.concurrencies {
            let (Some(ours), Some(peer)) = (
                figures_of(result.server, concurrency),
                figures_of(Server::Llama, concurrency),
            ) else {
                continue;
            };
            let _ = writeln!(
                text,
                "| {} | {concurrency} | {:.2}x | {:.2}x | {:.2}x |",
                result.server.label(),
                ours.tokens_per_second / peer.tokens_per_second,
                ours.first_token_p50_ms / peer.first_token_p50_ms,
                ours.gap_p50_ms / peer.gap_p50_ms,
            );
        }
    }
    if text.is_empty() {
        return text;
    }
    format!(
        "| Server | concurrency | output tok/s | TTFT p50 | ITL p50 |\n|---|---|---|---|---|\n{text}"
    )
}

/// Writes `docs/performance/serve.md` with what has been measured so far.
fn write_report(
    options: &Options,
    model: &str,
    load_before: &str,
    results: &[ServerResult],
) -> Result<()> {
    let mut report = String::new();
    let lanes = options.lanes;
    let context = LLAMA_CONTEXT_PER_SLOT * lanes;
    let delay = options
        .link_delay
        .as_ref()
        .map(|delay| format!(" `--link-delay {delay}`: every stage link and the last stage's returns {delay} ms slower each way"))
        .unwrap_or_default();
    let _ = write!(
        report,
        "# Serving under load: stage 0's OpenAI API beside llama-server\n\n\
         Command: `{}`.\n\n\
         Machine: {}; kernel {}; commit {}; {}; 1/5/15-minute load average {load_before} before and {} at the \
         latest write. Model: `{model}`.{}\n\n\
         ## Method\n\n\
         - Closed loop: C worker threads, each with one request in flight; a worker sends its next request only \
         after the previous stream's `data: [DONE]`. {} requests per worker per concurrency, one new TCP \
         connection per request (`Connection: close`); the servers run one after another on the same machine, \
         never at the same time.\n\
         - Every request: `POST /v1/chat/completions` with the `model` id the server lists first in \
         `GET /v1/models`, `stream: true`, `stream_options.include_usage`, \
         `max_tokens` {}, `temperature` {}, and a user prompt of about 100 tokens asking for a long explanation. \
         The prompt starts with the worker and request numbers and one of eight topics, so a prompt cache can \
         reuse at most the chat template's prefix. No `ignore_eos`: the tokens actually streamed are counted.\n\
         - Servers: ours whole `stage-server run --stages 1 --model F --http ADDR --lanes {lanes} --threads \
         {THREADS}`, ours in three stages (`--stages 3`{delay}), and `llama-server -m F --host 127.0.0.1 --port P -np \
         {lanes} -c {context} -t {THREADS}`. Each starts fresh, is ready when `GET /health` answers \
         200, gets one untimed warm-up request, then runs every concurrency and after them the shaped scenarios \
         (below); it is stopped with SIGINT after.\n\
         - Output tok/s: the completion tokens of every completed request (the usage chunk's \
         `completion_tokens`, else the content deltas counted) over the wall time from the first worker's start \
         to the last one's end. TTFT: from writing the request to the read that carried the first non-empty \
         content delta (prefill, queueing and connection set-up included). ITL: the time between reads carrying \
         consecutive content deltas, pooled over all requests. Percentiles by nearest rank, so with fewer than 100 \
         requests the TTFT p99 is the slowest one.\n\
         - Every server computes on {THREADS} threads and the client's threads share the same cores. On a shared \
         machine the figures swing with whatever else runs (with compilers running beside it, llama-server was \
         seen decoding one request at 3 tok/s and the next at 40); `load after` is the 1-minute load average \
         when the level ended.\n\
         - An error is a request that failed: a status other than 200, an error event, a stream ending without \
         `[DONE]` or without any content, or no bytes for 120 s.\n{}\n\
         ## Results\n\n{}{}",
        options.command(),
        machine(),
        command_output("uname", &["-r"]),
        command_output("git", &["rev-parse", "--short", "HEAD"]),
        command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        load_average(),
        match options.skip {
            Skip::Llama => String::new(),
            _ => format!(
                " llama-server: {}, built from source with `cargo xtask llama-ref server`.",
                llama_ref::LLAMA_CPP_VERSION
            ),
        },
        options.requests_per_worker,
        options.max_tokens,
        options.temperature.map_or_else(
            || "0".to_owned(),
            |temperature| format!(
                "{temperature} (both servers' default cuts: top-k 40, top-p 0.95, min-p 0.05; each \
                 draws with its own generator, so the streams and their lengths differ; the prefix-reuse \
                 scenario's requests and the admission scenario's late request stay at 0)"
            )
        ),
        match options.scenarios {
            Scenarios::Run => scenarios::method(),
            Scenarios::Skip =>
                "- The shaped scenarios (prefix reuse, admission under load) were left out \
                 (`--skip-scenarios`).\n"
                    .to_owned(),
        },
        render_results(options, results),
        scenarios::render(results),
    );
    let destination = workspace_root().join("docs/performance/serve.md");
    fs::write(&destination, report)
        .with_context(|| format!("could not write {}", destination.display()))?;
    eprintln!("xtask: wrote {}", destination.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arguments(text: &str) -> Vec<String> {
        text.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn the_options_parse_and_print_back_as_the_same_command() {
        let options = Options::parse(&arguments(
            "--model gemma3 --concurrency 1,4 --requests-per-worker 2 --tokens 64 --stages 1 \
             --decode-stretch 3 --lanes 6 --link-delay 5 --temperature 0.8 --skip-ours --skip-scenarios",
        ))
        .expect("valid options parse");
        assert_eq!(options.model, "gemma3");
        assert_eq!(options.concurrencies, vec![1, 4]);
        assert_eq!(options.skip, Skip::Ours);
        assert_eq!(options.scenarios, Scenarios::Skip);
        assert_eq!(
            options.command(),
            "cargo xtask bench serve --model gemma3 --concurrency 1,4 --requests-per-worker 2 --tokens 64 \
             --stages 1 --decode-stretch 3 --lanes 6 --link-delay 5 --temperature 0.8 --skip-ours \
             --skip-scenarios"
        );
        assert!(
            Options::parse(&arguments("--temperature 2.5")).is_err(),
            "a temperature above 2 must be refused"
        );
        assert_eq!(
            Options::parse(&arguments("--temperature 0"))
                .expect("a temperature of 0 parses")
                .command(),
            Options::parse(&[]).expect("no arguments parse").command(),
            "a temperature of 0 is the default, greedy"
        );
        assert_eq!(options.stages, vec![1]);
        assert!(
            Options::parse(&arguments("--decode-stretch 0.5")).is_err(),
            "a stretch below one must be refused"
        );
        let defaults = Options::parse(&[]).expect("no arguments parse");
        assert_eq!(
            defaults.concurrencies,
            vec![1, 2, 4, 8],
            "the default concurrencies"
        );
        assert_eq!(
            defaults.scenarios,
            Scenarios::Run,
            "the scenarios run unless skipped"
        );
        let unknown = Options::parse(&arguments("--skip-prefix")).unwrap_err();
        assert!(
            unknown.to_string().contains("--skip-scenarios"),
            "the unknown-argument message must list --skip-scenarios: {unknown}"
        );
        assert!(
            Options::parse(&arguments("--concurrency 1,0")).is_err(),
            "a concurrency of zero must be refused"
        );
        assert!(
            Options::parse(&arguments("--model llama")).is_err(),
            "an unknown model must be refused"
        );
    }

    #[test]
    fn the_ratios_divide_ours_by_llama_server_at_each_concurrency() {
        let figures = |tokens_per_second, first_token_p50_ms, gap_p50_ms| LevelFigures {
            completed: 4,
            errors: 0,
            first_error: None,
            tokens_per_second,
            tokens_per_request: 128.0,
            first_token_p50_ms,
            first_token_p99_ms: first_token_p50_ms,
            gap_p50_ms,
            gap_p99_ms: gap_p50_ms,
        };
        let level = |figures| Level {
            concurrency: 1,
            figures,
            load_after: "0.50".to_owned(),
        };
        let options = Options::parse(&arguments("--concurrency 1")).unwrap();
        let results = vec![
            ServerResult {
                server: Server::Ours { stages: 1 },
                levels: Ok(vec![level(figures(50.0, 300.0, 20.0))]),
                scenarios: None,
            },
            ServerResult {
                server: Server::Ours { stages: 3 },
                levels: Err("stage-server exited".to_owned()),
                scenarios: None,
            },
            ServerResult {
                server: Server::Llama,
                levels: Ok(vec![level(figures(100.0, 100.0, 10.0))]),
                scenarios: None,
            },
        ];
        let text = render_results(&options, &results);
        assert!(
            text.contains("| stage-server, whole | 1 | 0.50x | 3.00x | 2.00x |"),
            "the ratio row is wrong:\n{text}"
        );
        assert!(
            text.contains("- stage-server, 3 stages gave no figures"),
            "a server that did not start must be listed under failures:\n{text}"
        );
    }
}
