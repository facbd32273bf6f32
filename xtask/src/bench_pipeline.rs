//! `cargo xtask bench pipeline`: stage-server decode and prefill speed with the model split across stage
//! processes on loopback, beside the same model unsplit and beside llama.cpp's own RPC backend, in one run.
//!
//! For each real model in the cache, every round runs, back to back:
//! - unsplit: `stage-server generate --prompt-ids <P ids> --max-tokens 65 --threads 2 --json`;
//! - 2 processes: stage 0 (`generate --layers 0..half --next`) and one `serve` for the rest;
//! - 3 processes: stage 0 and two `serve`s at a third and two thirds of the layers;
//! - 3 processes with tokens relayed back up the chain (`--prediction-return relayed`) instead of returned
//!   straight from the last stage;
//! - 3 processes with `--link-delay 5` on every link, each way (stage 0's and stage 1's links to the next
//!   stage, and the last stage's prediction returns), tokens returned directly and relayed;
//! - llama.cpp whole (`llama-server`) and llama.cpp with every layer on two `ggml-rpc-server` processes on
//!   loopback, the same prompt and lengths, timed by llama-server's own `timings` ([`llama`]);
//! - a 2,048-token prompt (four prefill chunks) unsplit and through 3 processes with `--reply-credits` 0, 1
//!   and 2, prefill only.
//!
//! Decode tok/s covers the steps after the first token; prefill tok/s the whole prompt. The time a hop adds
//! to a decode step is `(1 / split rate - 1 / unsplit rate) / hops`, the step time beyond the unsplit compute
//! divided over the hops (medians of each). Every process starts fresh for its generation (its model load is
//! not timed) and is stopped after it.
//!
//! Then the telemetry rows ([`telemetry`]): `stage-server run --stages 3` with telemetry off, exporting to a
//! live loopback OTLP/HTTP receiver, exporting to a black hole, and off again, in blocks of fresh pipelines
//! (`--rounds N` is the number of blocks for these rows).
//! `--only-telemetry` runs just those (and keeps the layout tables already in the report); `--model NAME`
//! picks one model; `--otlp-filter FILTER` sets the exported spans' filter (default `info`).

mod llama;
mod report;
mod telemetry;

use std::ffi::OsStr;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use crate::bench_model::{block_count, generate_command, prompt_ids, target_dir};
use crate::figures::load_average;
use crate::models::{self, MODELS};
use crate::{cargo, llama_ref};

use llama::PEERS;
use report::{render_model, write_report};

/// Prompt length of the layout rows: one prefill chunk.
const PROMPT_TOKENS: usize = 512;
/// Decode steps timed.
const DECODE_TOKENS: usize = 64;
/// Compute threads of every process.
const THREADS: &str = "2";
/// The one-way delay of the WAN-like runs, in milliseconds.
const LINK_DELAY_MS: f64 = 5.0;
/// stage-server's prefill chunk (`stage_server::model::PREFILL_CHUNK`; xtask does not link stage-server).
const CHUNK_TOKENS: usize = 512;
/// Prompt length of the credit rows: four chunks, so up to three non-final chunks can wait for credits.
const LONG_PROMPT_TOKENS: usize = 4 * CHUNK_TOKENS;
/// Tokens the credit rows generate: one, so they time the prefill (up to the first token) and little else.
const LONG_MAX_TOKENS: usize = 1;
/// The activation codec every split stage is given: the f32 the rows have always measured, named so a
/// change of stage-server's default does not change what the rows mean.
const CODEC: &str = "f32";

/// One way of running the model.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    Unsplit,
    /// `count` processes, each stage link (and the last stage's return link) delayed `delay_ms` each way;
    /// `relayed`: tokens come back up the chain instead of straight from the last stage.
    Processes {
        count: usize,
        delay_ms: f64,
        relayed: bool,
    },
}

impl Layout {
    fn label(self) -> String {
        match self {
            Layout::Unsplit => "unsplit, one process".to_owned(),
            Layout::Processes {
                count,
                delay_ms,
                relayed,
            } => {
                let link = if delay_ms > 0.0 {
                    format!("{delay_ms} ms per hop")
                } else {
                    "on loopback".to_owned()
                };
                let tokens = if relayed { ", tokens relayed" } else { "" };
                format!("{count} processes, {link}{tokens}")
            }
        }
    }

    fn hops(self) -> usize {
        match self {
            Layout::Unsplit => 0,
            Layout::Processes { count, .. } => count - 1,
        }
    }
}

const LAYOUTS: [Layout; 6] = [
    Layout::Unsplit,
    Layout::Processes {
        count: 2,
        delay_ms: 0.0,
        relayed: false,
    },
    Layout::Processes {
        count: 3,
        delay_ms: 0.0,
        relayed: false,
    },
    Layout::Processes {
        count: 3,
        delay_ms: 0.0,
        relayed: true,
    },
    Layout::Processes {
        count: 3,
        delay_ms: LINK_DELAY_MS,
        relayed: false,
    },
    Layout::Processes {
        count: 3,
        delay_ms: LINK_DELAY_MS,
        relayed: true,
    },
];

/// A row of the 2,048-token prefill table.
#[derive(Clone, Copy, Debug, PartialEq)]
enum LongRow {
    Unsplit,
    /// 3 processes on loopback, stage 0 with `--reply-credits N`.
    Credits(usize),
}

impl LongRow {
    fn label(self) -> String {
        match self {
            LongRow::Unsplit => Layout::Unsplit.label(),
            LongRow::Credits(credits) => format!("{}, reply credits {credits}", LONG_SPLIT.label()),
        }
    }

    fn layout(self) -> Layout {
        match self {
            LongRow::Unsplit => Layout::Unsplit,
            LongRow::Credits(_) => LONG_SPLIT,
        }
    }

    fn credits(self) -> Option<usize> {
        match self {
            LongRow::Unsplit => None,
            LongRow::Credits(credits) => Some(credits),
        }
    }
}

/// The split the credit rows run through.
const LONG_SPLIT: Layout = Layout::Processes {
    count: 3,
    delay_ms: 0.0,
    relayed: false,
};

const LONG_ROWS: [LongRow; 4] = [
    LongRow::Unsplit,
    LongRow::Credits(0),
    LongRow::Credits(1),
    LongRow::Credits(2),
];

/// What one timed generation asks for.
#[derive(Clone, Copy, Debug)]
struct Request<'a> {
    prompt: &'a [u64],
    /// Tokens to generate, the first one (from the prompt's last chunk) included.
    max_tokens: usize,
    /// Stage 0's `--reply-credits`; `None` leaves stage-server's default.
    credits: Option<usize>,
}

/// What one timed generation measured.
#[derive(Debug, Default)]
struct Timed {
    /// Prompt tokens per second, up to the first token.
    prefill: f64,
    /// Decode steps after the first token per second.
    decode: f64,
    /// Prompt tokens the run reports it evaluated.
    prompt_tokens: usize,
    /// Decode steps the decode rate covers.
    decode_steps: usize,
    /// The commands (and, for llama.cpp, the request) as they ran, for the report.
    commands: Vec<String>,
    /// Lines of a server's log worth quoting (where llama.cpp put the weights).
    notes: Vec<String>,
}

/// The rates of one row over the rounds.
#[derive(Debug, Default)]
struct Samples {
    prefill: Vec<f64>,
    decode: Vec<f64>,
    prompt_tokens: Vec<usize>,
    decode_steps: Vec<usize>,
    /// The first round's commands.
    commands: Vec<String>,
    /// The first round's notes.
    notes: Vec<String>,
    /// Why the row stopped being measured, if it did.
    failure: Option<String>,
}

impl Samples {
    fn push(&mut self, timed: Timed) {
        self.prefill.push(timed.prefill);
        self.decode.push(timed.decode);
        self.prompt_tokens.push(timed.prompt_tokens);
        self.decode_steps.push(timed.decode_steps);
        if self.commands.is_empty() {
            self.commands = timed.commands;
            self.notes = timed.notes;
        }
    }
}

/// Everything one model's rows measured.
#[derive(Debug)]
struct ModelRows {
    model_file: String,
    blocks: usize,
    layouts: Vec<Samples>,
    peers: Vec<Samples>,
    long: Vec<Samples>,
    /// Wall time of the layout rows, the llama.cpp rows and the credit rows, starts and loads included.
    layout_time: Duration,
    peer_time: Duration,
    long_time: Duration,
}

/// A `stage-server serve` child, killed when dropped.
struct Served(Child, SocketAddr);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub fn run(arguments: &[String]) -> Result<()> {
    let started = Instant::now();
    let mut rounds = 3;
    let mut only_telemetry = false;
    let mut only_model: Option<String> = None;
    let mut span_filter: Option<String> = None;
    let mut iterator = arguments.iter();
    while let Some(argument) = iterator.next() {
        match argument.as_str() {
            "--rounds" => {
                rounds = iterator
                    .next()
                    .and_then(|value| value.parse().ok())
                    .filter(|&value: &usize| value > 0)
                    .context("--rounds needs a positive count")?;
            }
            "--only-telemetry" => only_telemetry = true,
            "--model" => {
                let name = iterator.next().context("--model needs a model name")?;
                ensure!(
                    MODELS.iter().any(|model| model.short_name == name),
                    "unknown model `{name}`; --model takes one of: {}",
                    MODELS.map(|model| model.short_name).join(", ")
                );
                only_model = Some(name.clone());
            }
            "--otlp-filter" => {
                span_filter = Some(
                    iterator
                        .next()
                        .context("--otlp-filter needs a filter such as stage_server=trace")?
                        .clone(),
                );
            }
            other => bail!(
                "unknown argument `{other}` to `cargo xtask bench pipeline` (takes --rounds N, --only-telemetry, \
                 --model smollm2|gemma3, --otlp-filter FILTER)"
            ),
        }
    }
    let model_dir = models::model_dir()?;
    let present: Vec<_> = MODELS
        .iter()
        .filter(|model| {
            only_model
                .as_deref()
                .is_none_or(|name| model.short_name == name)
        })
        .filter(|model| model_dir.join(model.file_name).exists())
        .collect();
    ensure!(
        !present.is_empty(),
        "no real model in {}; run `cargo xtask fetch-models` first",
        model_dir.display()
    );
    cargo(&["build", "--release", "-p", "stage-server"])?;
    let binary = target_dir().join("release/stage-server");
    ensure!(binary.exists(), "cargo built no {}", binary.display());
    // The llama.cpp rows are a peer, not the subject: if its binaries cannot be had, our rows still run and
    // the report says why the peer's are missing.
    let peer_binaries: Result<PathBuf, String> = if only_telemetry {
        Err("not run (--only-telemetry)".to_owned())
    } else {
        llama_ref::ensure_server_built()
            .and_then(|server| {
                server
                    .parent()
                    .map(Path::to_path_buf)
                    .context("llama-server's path has no folder")
            })
            .map_err(|error| format!("{error:#}"))
    };
    let load_before = load_average();
    let mut tables = String::new();
    let mut telemetry_tables = String::new();
    let run = Run {
        rounds,
        only_telemetry,
        span_filter: span_filter.clone(),
        model: only_model.clone(),
        started,
        llama_version: peer_binaries.as_deref().ok().map(llama::version),
    };
    let log_dir = target_dir().join("bench-pipeline");
    for model in present {
        let path = model_dir.join(model.file_name);
        let stream = prompt_ids(model.short_name)?;
        // The fixture stream, repeated to a 512-token prompt (one prefill chunk) and to 2,048 (four).
        let prompt: Vec<u64> = stream.iter().copied().cycle().take(PROMPT_TOKENS).collect();
        let long_prompt: Vec<u64> = stream
            .iter()
            .copied()
            .cycle()
            .take(LONG_PROMPT_TOKENS)
            .collect();
        if !only_telemetry {
            let inputs = ModelInputs {
                binary: &binary,
                path: &path,
                prompt: &prompt,
                long_prompt: &long_prompt,
                peer_binaries: peer_binaries.as_deref().map_err(String::as_str),
                log_dir: &log_dir,
            };
            let rows = model_rows(&inputs, model.short_name, rounds)?;
            let table = render_model(&rows);
            println!("{table}");
            tables.push_str(&table);
            tables.push('\n');
            write_report(&run, &load_before, &tables, &telemetry_tables)?;
        }
        eprintln!("xtask: {} telemetry rows", model.short_name);
        let telemetry_started = Instant::now();
        let measured =
            telemetry::measure(&binary, &path, rounds, span_filter.as_deref(), &log_dir)?;
        eprintln!(
            "xtask: {} telemetry rows took {:.0} s",
            model.short_name,
            telemetry_started.elapsed().as_secs_f64()
        );
        let table = telemetry::render(model.file_name, &measured);
        println!("{table}");
        telemetry_tables.push_str(&table);
        telemetry_tables.push('\n');
        write_report(&run, &load_before, &tables, &telemetry_tables)?;
    }
    Ok(())
}

/// What the report says about the command and the run.
struct Run {
    rounds: usize,
    only_telemetry: bool,
    span_filter: Option<String>,
    model: Option<String>,
    started: Instant,
    /// `llama-server --version`'s line, when its binaries were there.
    llama_version: Option<String>,
}

impl Run {
    fn command(&self) -> String {
        let mut command = format!("cargo xtask bench pipeline --rounds {}", self.rounds);
        if self.only_telemetry {
            command.push_str(" --only-telemetry");
        }
        if let Some(model) = &self.model {
            let _ = write!(command, " --model {model}");
        }
        if let Some(filter) = &self.span_filter {
            let _ = write!(command, " --otlp-filter {filter}");
        }
        command
    }
}

/// What every row of one model runs with.
struct ModelInputs<'a> {
    binary: &'a Path,
    path: &'a Path,
    prompt: &'a [u64],
    long_prompt: &'a [u64],
    /// llama.cpp's `bin` folder, or why there is none.
    peer_binaries: Result<&'a Path, &'a str>,
    log_dir: &'a Path,
}

/// Every row of one model, once per round, in the order of the report's tables.
fn model_rows(inputs: &ModelInputs<'_>, short_name: &str, rounds: usize) -> Result<ModelRows> {
    let model_file = inputs
        .path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let blocks = block_count(inputs.path)?;
    let mut rows = ModelRows {
        model_file,
        blocks,
        layouts: LAYOUTS.iter().map(|_| Samples::default()).collect(),
        peers: PEERS.iter().map(|_| Samples::default()).collect(),
        long: LONG_ROWS.iter().map(|_| Samples::default()).collect(),
        layout_time: Duration::ZERO,
        peer_time: Duration::ZERO,
        long_time: Duration::ZERO,
    };
    if let Err(reason) = inputs.peer_binaries {
        for samples in &mut rows.peers {
            samples.failure = Some(format!("llama.cpp's binaries are not there: {reason}"));
        }
    }
    let request = Request {
        prompt: inputs.prompt,
        max_tokens: DECODE_TOKENS + 1,
        credits: None,
    };
    for round in 0..rounds {
        eprintln!("xtask: {short_name} round {}/{rounds}", round + 1);
        let layouts_started = Instant::now();
        for (index, layout) in LAYOUTS.iter().enumerate() {
            let timed = run_layout(inputs.binary, inputs.path, blocks, *layout, request)?;
            rows.layouts[index].push(timed);
        }
        rows.layout_time += layouts_started.elapsed();
        let peers_started = Instant::now();
        if let Ok(binary_dir) = inputs.peer_binaries {
            let peer_inputs = llama::Inputs {
                binary_dir,
                model: inputs.path,
                prompt: inputs.prompt,
                max_tokens: DECODE_TOKENS + 1,
                threads: THREADS,
                blocks,
                log_dir: inputs.log_dir,
            };
            for (index, peer) in PEERS.iter().enumerate() {
                let samples = &mut rows.peers[index];
                if samples.failure.is_some() {
                    continue;
                }
                match llama::run(&peer_inputs, *peer) {
                    Ok(timed) => samples.push(timed),
                    Err(error) => {
                        // One failure ends the row, so its rounds stay paired with ours by index.
                        eprintln!("xtask: {} failed: {error:#}", peer.label());
                        samples.failure = Some(format!("round {}: {error:#}", round + 1));
                    }
                }
            }
        }
        rows.peer_time += peers_started.elapsed();
        let long_started = Instant::now();
        for (index, row) in LONG_ROWS.iter().enumerate() {
            let long_request = Request {
                prompt: inputs.long_prompt,
                max_tokens: LONG_MAX_TOKENS,
                credits: row.credits(),
            };
            let timed = run_layout(
                inputs.binary,
                inputs.path,
                blocks,
                row.layout(),
                long_request,
            )?;
            rows.long[index].push(timed);
        }
        rows.long_time += long_started.elapsed();
        eprintln!(
            "xtask: {short_name} round {}/{rounds} so far: our layouts {:.0} s, llama.cpp {:.0} s, \
             {LONG_PROMPT_TOKENS}-token rows {:.0} s",
            round + 1,
            rows.layout_time.as_secs_f64(),
            rows.peer_time.as_secs_f64(),
            rows.long_time.as_secs_f64()
        );
    }
    Ok(rows)
}

/// The layers where a split into `count` processes cuts the model's `blocks`.
fn boundaries(blocks: usize, count: usize) -> Vec<usize> {
    (1..count).map(|part| part * blocks / count).collect()
}

/// Runs one generation in `layout`; returns what it measured.
fn run_layout(
    binary: &Path,
    model: &Path,
    blocks: usize,
    layout: Layout,
    request: Request<'_>,
) -> Result<Timed> {
    let mut command = generate_command(binary, model, request.prompt, request.max_tokens, THREADS);
    let mut stages = Vec::new();
    let mut commands = Vec::new();
    if let Layout::Processes {
        count,
        delay_ms,
        relayed,
    } = layout
    {
        let boundaries = boundaries(blocks, count);
        let mut edges = boundaries.clone();
        edges.push(blocks);
        let mut next: Option<SocketAddr> = None;
        for window in edges.windows(2).rev() {
            // The last stage's delay is on the tokens it returns straight to stage 0 (a relayed token crosses
            // the delayed stage links back up instead).
            let (served, shown_serve) = serve(binary, model, window[0]..window[1], next, delay_ms)?;
            commands.push(shown_serve);
            next = Some(served.1);
            stages.push(served);
        }
        let first = next.context("a chain has a first stage")?;
        command.args([
            "--layers",
            &format!("0..{}", boundaries[0]),
            "--next",
            &first.to_string(),
            "--link-delay",
            &delay_ms.to_string(),
            "--codec",
            CODEC,
        ]);
        if let Some(credits) = request.credits {
            command.args(["--reply-credits", &credits.to_string()]);
        }
        if relayed {
            command.args(["--prediction-return", "relayed"]);
        }
    }
    commands.push(shown(&command));
    let output = command
        .output()
        .with_context(|| format!("could not run {}", binary.display()))?;
    drop(stages);
    if !output.status.success() {
        bail!(
            "stage-server generate ({}) failed with {}: {}",
            layout.label(),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let reply: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or_default())
        .with_context(|| format!("stage-server printed unexpected output: {text}"))?;
    let count = |key: &str| reply[key].as_array().map_or(0, Vec::len);
    Ok(Timed {
        prefill: reply["prompt_tokens_per_second"]
            .as_f64()
            .context("no prompt_tokens_per_second")?,
        decode: reply["decode_tokens_per_second"]
            .as_f64()
            .context("no decode_tokens_per_second")?,
        prompt_tokens: count("prompt_tokens"),
        // stage-server's decode rate counts the tokens after the first.
        decode_steps: count("tokens").saturating_sub(1),
        commands,
        notes: Vec::new(),
    })
}

/// Starts `stage-server serve` for `layers` and waits for its ready line; returns it with its command line.
fn serve(
    binary: &Path,
    model: &Path,
    layers: std::ops::Range<usize>,
    next: Option<SocketAddr>,
    delay_ms: f64,
) -> Result<(Served, String)> {
    let mut command = Command::new(binary);
    command
        .arg("serve")
        .arg("--model")
        .arg(model)
        .args([
            "--layers",
            &format!("{}..{}", layers.start, layers.end),
            "--bind",
            "127.0.0.1:0",
            "--threads",
            THREADS,
            "--link-delay",
            &delay_ms.to_string(),
            "--codec",
            CODEC,
        ])
        .env("CANDLE_NUM_THREADS", THREADS)
        .env("RAYON_NUM_THREADS", THREADS)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(next) = next {
        command.args(["--next", &next.to_string()]);
    }
    let shown_command = shown(&command);
    let mut child = command
        .spawn()
        .context("could not start stage-server serve")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = sender.send(line);
    });
    let line = receiver
        .recv_timeout(Duration::from_secs(120))
        .unwrap_or_default();
    let address = ready_address(&line);
    match address {
        Some(address) => Ok((Served(child, address), shown_command)),
        None => {
            let _ = child.kill();
            bail!("stage-server serve for layers {layers:?} printed no ready line: {line:?}")
        }
    }
}

/// The address in a ready line `stage serving layers A..B on ADDR (width W)`.
fn ready_address(line: &str) -> Option<SocketAddr> {
    line.trim()
        .rsplit_once(" on ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|address| address.parse().ok())
}

/// A command as the report shows it: the variables it sets, the program's file name and its arguments, with
/// the model reduced to its file name and a list of prompt ids to its length (`<512 ids>`).
fn shown(command: &Command) -> String {
    let file_name = |text: &OsStr| {
        Path::new(text)
            .file_name()
            .unwrap_or(text)
            .to_string_lossy()
            .into_owned()
    };
    let mut parts: Vec<String> = command
        .get_envs()
        .filter_map(|(name, value)| {
            Some(format!(
                "{}={}",
                name.to_string_lossy(),
                value?.to_string_lossy()
            ))
        })
        .collect();
    parts.push(file_name(command.get_program()));
    let mut previous = String::new();
    for argument in command.get_args() {
        let text = argument.to_string_lossy().into_owned();
        let part = match previous.as_str() {
            "--model" | "-m" => file_name(argument),
            "--prompt-ids" => format!("<{} ids>", text.split(',').count()),
            _ => text.clone(),
        };
        parts.push(part);
        previous = text;
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ready_line_gives_the_stage_address() {
        assert_eq!(
            ready_address("stage serving layers 10..20 on 127.0.0.1:4567 (width 576)\n"),
            Some("127.0.0.1:4567".parse().unwrap())
        );
        assert_eq!(ready_address("nothing here"), None);
    }

    #[test]
    fn a_shown_command_names_the_model_file_and_counts_the_prompt_ids() {
        let mut command = Command::new("/work/target/release/stage-server");
        command
            .args(["generate", "--model", "/cache/models/m.gguf"])
            .args(["--prompt-ids", "1,2,3", "--json"])
            .env("RAYON_NUM_THREADS", "2");
        assert_eq!(
            shown(&command),
            "RAYON_NUM_THREADS=2 stage-server generate --model m.gguf --prompt-ids <3 ids> --json"
        );
    }
}
