//! `cargo xtask bench pipeline`: stage-server decode and prefill speed with the model split across stage
//! processes on loopback, beside the same model unsplit in one process, in the same run.
//!
//! For each real model in the cache, every round runs, back to back:
//! - unsplit: `stage-server generate --prompt-ids <P ids> --max-tokens 65 --threads 2 --json`;
//! - 2 processes: stage 0 (`generate --layers 0..half --next`) and one `serve` for the rest;
//! - 3 processes: stage 0 and two `serve`s at a third and two thirds of the layers;
//! - 3 processes with `--link-delay 5` on both hops (stage 0's and stage 1's downstream links).
//!
//! Decode tok/s covers the 64 steps after the first token; prefill tok/s the whole prompt as one chunk. The
//! time a hop adds to a decode step is `(1 / split rate - 1 / unsplit rate) / hops`, the step time beyond the
//! unsplit compute divided over the hops (medians of each). The stage processes start fresh for each round
//! (their model load is not timed) and are stopped after it.
//!
//! Then the telemetry rows ([`telemetry`]): `stage-server run --stages 3` with telemetry off, exporting to a
//! live loopback OTLP/HTTP receiver, and exporting to a black hole, side by side in the same run.
//! `--only-telemetry` runs just those (and keeps the layout tables already in the report); `--model NAME`
//! picks one model; `--otlp-filter FILTER` sets the exported spans' filter (default `info`).

mod telemetry;

use std::fmt::Write as _;
use std::fs;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::bench_model::{
    block_count, command_output, generate_command, machine, prompt_ids, target_dir,
};
use crate::figures::{load_average, median};
use crate::models::{self, MODELS};
use crate::{cargo, workspace_root};

/// Prompt length: one prefill chunk.
const PROMPT_TOKENS: usize = 512;
/// Decode steps timed.
const DECODE_TOKENS: usize = 64;
/// Compute threads of every process.
const THREADS: &str = "2";
/// The one-way delay of the WAN-like runs, in milliseconds.
const LINK_DELAY_MS: f64 = 5.0;

/// One way of running the model.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Layout {
    Unsplit,
    Processes { count: usize, delay_ms: f64 },
}

impl Layout {
    fn label(self) -> String {
        match self {
            Layout::Unsplit => "unsplit, one process".to_owned(),
            Layout::Processes { count, delay_ms } if delay_ms > 0.0 => {
                format!("{count} processes, {delay_ms} ms per hop")
            }
            Layout::Processes { count, .. } => format!("{count} processes on loopback"),
        }
    }

    fn hops(self) -> usize {
        match self {
            Layout::Unsplit => 0,
            Layout::Processes { count, .. } => count - 1,
        }
    }
}

const LAYOUTS: [Layout; 4] = [
    Layout::Unsplit,
    Layout::Processes {
        count: 2,
        delay_ms: 0.0,
    },
    Layout::Processes {
        count: 3,
        delay_ms: 0.0,
    },
    Layout::Processes {
        count: 3,
        delay_ms: LINK_DELAY_MS,
    },
];

/// The rates of one layout over the rounds.
#[derive(Default)]
struct Samples {
    prefill: Vec<f64>,
    decode: Vec<f64>,
}

/// A `stage-server serve` child, killed when dropped.
struct Served(Child, SocketAddr);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The heading the telemetry section of the report starts with (`--only-telemetry` replaces from there).
const TELEMETRY_HEADING: &str = "## Telemetry overhead";

pub fn run(arguments: &[String]) -> Result<()> {
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
    let load_before = load_average();
    let mut tables = String::new();
    let mut telemetry_tables = String::new();
    let run = Run {
        rounds,
        only_telemetry,
        span_filter: span_filter.clone(),
        model: only_model.clone(),
    };
    for model in present {
        let path = model_dir.join(model.file_name);
        // The fixture stream, repeated to a 512-token prompt (one prefill chunk).
        let prompt: Vec<u64> = prompt_ids(model.short_name)?
            .into_iter()
            .cycle()
            .take(PROMPT_TOKENS)
            .collect();
        if !only_telemetry {
            let table = layout_rows(&binary, &path, model.short_name, &prompt, rounds)?;
            println!("{table}");
            tables.push_str(&table);
            tables.push('\n');
            write_report(&run, &load_before, &tables, &telemetry_tables)?;
        }
        eprintln!("xtask: {} telemetry rows", model.short_name);
        let measured = telemetry::measure(
            &binary,
            &path,
            rounds,
            span_filter.as_deref(),
            &target_dir().join("bench-pipeline"),
        )?;
        let table = telemetry::render(model.file_name, &measured);
        println!("{table}");
        telemetry_tables.push_str(&table);
        telemetry_tables.push('\n');
        write_report(&run, &load_before, &tables, &telemetry_tables)?;
    }
    Ok(())
}

/// What the report says about the command.
struct Run {
    rounds: usize,
    only_telemetry: bool,
    span_filter: Option<String>,
    model: Option<String>,
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

/// The layout rows of one model: every layout once per round.
fn layout_rows(
    binary: &Path,
    path: &Path,
    short_name: &str,
    prompt: &[u64],
    rounds: usize,
) -> Result<String> {
    let model_file = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_default();
    let blocks = block_count(path)?;
    let mut samples: Vec<Samples> = LAYOUTS.iter().map(|_| Samples::default()).collect();
    for round in 0..rounds {
        eprintln!("xtask: {short_name} round {}/{rounds}", round + 1);
        for (index, layout) in LAYOUTS.iter().enumerate() {
            let (prefill, decode) = run_layout(binary, path, prompt, blocks, *layout)?;
            samples[index].prefill.push(prefill);
            samples[index].decode.push(decode);
        }
    }
    Ok(render_table(&model_file, prompt.len(), &samples))
}

/// The variable candle's barrier pool reads its spin count from.
const SPIN_LIMIT_VARIABLE: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
/// The spin count `stage-server run` gives stages that share a host (candle's default, 25,000, let a stage
/// that had finished its pass spin on the cores the next stage needed); the split layouts here use it too,
/// the unsplit one keeps candle's default, as `run --stages 1` does.
const SHARED_HOST_SPIN_LIMIT: &str = "2000";

/// Runs one generation in `layout`; returns prefill and decode tokens/s.
fn run_layout(
    binary: &Path,
    model: &Path,
    prompt: &[u64],
    blocks: usize,
    layout: Layout,
) -> Result<(f64, f64)> {
    let mut command = generate_command(binary, model, prompt, DECODE_TOKENS + 1, THREADS);
    let mut stages = Vec::new();
    if let Layout::Processes { count, delay_ms } = layout {
        let boundaries: Vec<usize> = (1..count).map(|part| part * blocks / count).collect();
        let mut edges = boundaries.clone();
        edges.push(blocks);
        let mut next: Option<SocketAddr> = None;
        for window in edges.windows(2).rev() {
            let is_last = next.is_none();
            let delay = if is_last { 0.0 } else { delay_ms };
            let served = serve(binary, model, window[0]..window[1], next, delay)?;
            next = Some(served.1);
            stages.push(served);
        }
        let first = next.context("a chain has a first stage")?;
        command.env(SPIN_LIMIT_VARIABLE, SHARED_HOST_SPIN_LIMIT);
        command.args([
            "--layers",
            &format!("0..{}", boundaries[0]),
            "--next",
            &first.to_string(),
            "--link-delay",
            &delay_ms.to_string(),
        ]);
    }
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
    Ok((
        reply["prompt_tokens_per_second"]
            .as_f64()
            .context("no prompt_tokens_per_second")?,
        reply["decode_tokens_per_second"]
            .as_f64()
            .context("no decode_tokens_per_second")?,
    ))
}

/// Starts `stage-server serve` for `layers` and waits for its ready line.
fn serve(
    binary: &Path,
    model: &Path,
    layers: std::ops::Range<usize>,
    next: Option<SocketAddr>,
    delay_ms: f64,
) -> Result<Served> {
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
        ])
        .env("CANDLE_NUM_THREADS", THREADS)
        .env("RAYON_NUM_THREADS", THREADS)
        .env(SPIN_LIMIT_VARIABLE, SHARED_HOST_SPIN_LIMIT)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    if let Some(next) = next {
        command.args(["--next", &next.to_string()]);
    }
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
        Some(address) => Ok(Served(child, address)),
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

fn render_table(model: &str, prompt_tokens: usize, samples: &[Samples]) -> String {
    let unsplit_decode = median(&samples[0].decode);
    let unsplit_prefill = median(&samples[0].prefill);
    let mut table = format!(
        "### {model}\n\n| Layout | prefill tok/s ({prompt_tokens} tokens) | decode tok/s | decode vs unsplit | \
         prefill vs unsplit | added per hop per decode step |\n|---|---|---|---|---|---|\n"
    );
    for (layout, samples) in LAYOUTS.iter().zip(samples) {
        let prefill = median(&samples.prefill);
        let decode = median(&samples.decode);
        let per_hop = if layout.hops() > 0 && decode > 0.0 && unsplit_decode > 0.0 {
            let added = (1.0 / decode - 1.0 / unsplit_decode) / layout.hops() as f64;
            format!("{:.0} µs", added * 1e6)
        } else {
            "".to_owned()
        };
        let _ = writeln!(
            table,
            "| {} | {prefill:.1} | {decode:.1} | {:.3}x | {:.3}x | {per_hop} |",
            layout.label(),
            ratio(decode, unsplit_decode),
            ratio(prefill, unsplit_prefill),
        );
    }
    let ranges: Vec<String> = LAYOUTS
        .iter()
        .zip(samples)
        .map(|(layout, samples)| {
            let low = samples.decode.iter().copied().fold(f64::INFINITY, f64::min);
            let high = samples.decode.iter().copied().fold(0.0, f64::max);
            format!("{}: {low:.1} to {high:.1}", layout.label())
        })
        .collect();
    let _ = write!(
        table,
        "\nDecode range over rounds: {}.\n",
        ranges.join("; ")
    );
    table
}

fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 {
        numerator / denominator
    } else {
        0.0
    }
}

/// Writes `docs/performance/pipeline.md`: the layout tables (kept from the file as it was when this run has
/// none, as with `--only-telemetry`) and then the telemetry section.
fn write_report(run: &Run, load_before: &str, tables: &str, telemetry_tables: &str) -> Result<()> {
    let destination = workspace_root().join("docs/performance/pipeline.md");
    let mut report = String::new();
    if tables.is_empty() {
        let existing = fs::read_to_string(&destination).unwrap_or_default();
        let kept = existing
            .split_once(TELEMETRY_HEADING)
            .map_or(existing.as_str(), |(before, _)| before);
        report.push_str(kept.trim_end());
        report.push_str("\n\n");
    } else {
        let _ = write!(
            report,
            "# Pipeline speed: a model split across stage processes\n\n\
             Command: `{}`.\n\n\
             Machine: {}; kernel {}; commit {}; {}; 1/5/15-minute load average {load_before} before and {} at the \
             latest write.\n\n\
             ## Method\n\n\
             - Every process uses {THREADS} compute threads; all of them share the machine's cores, and only one \
             stage computes at a time for one generation.\n\
             - Each round runs every layout once, in the order of the table; figures are medians over {} rounds.\n\
             - Unsplit: `stage-server generate --prompt-ids <P ids> --max-tokens {} --threads {THREADS} --json`. \
             Split: the same command as stage 0 with `--layers 0..K --next ADDR`, and `stage-server serve` processes \
             for the other layer ranges, split evenly by the file's `<architecture>.block_count`; f32 activations; \
             tokens relayed back up the chain.\n\
             - The delayed layout adds {LINK_DELAY_MS} ms one way to stage 0's and stage 1's downstream links \
             (`--link-delay`, applied in the process), so a decode step crosses two delayed hops.\n\
             - Added per hop: `(1/split decode - 1/unsplit decode) / hops`, from the medians.\n\
             - Not in this run: llama.cpp's RPC backend (`ggml-rpc-server`) on the same split, which needs a build of \
             llama.cpp from source.\n\n\
             ## Results\n\n{tables}",
            run.command(),
            machine(),
            command_output("uname", &["-r"]),
            command_output("git", &["rev-parse", "--short", "HEAD"]),
            command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            load_average(),
            run.rounds,
            DECODE_TOKENS + 1,
        );
    }
    if !telemetry_tables.is_empty() {
        let _ = write!(
            report,
            "{TELEMETRY_HEADING}\n\n\
             Command: `{}`. Machine: {}; kernel {}; commit {}; {}; 1/5/15-minute load average {load_before} before \
             and {} at the latest write.\n\n\
             - Three `stage-server run --stages 3 --lanes 1 --threads {THREADS}` pipelines of the same model run side \
             by side: telemetry off; `--otlp-endpoint` to a loopback OTLP/HTTP receiver in xtask that reads every \
             request and answers 200; `--otlp-endpoint` to a black hole that accepts connections and never reads \
             or answers. Every process of an \"on\" pipeline exports (spans and metrics every 5 s).\n\
             - Each round streams one chat completion of {} tokens (temperature 0, the same prompt for the three) \
             on each pipeline in turn, the order rotated every round; one untimed warm-up request each first. \
             Closed loop, one request at a time; the idle pipelines wait meanwhile.\n\
             - Decode tok/s is the client's: completion tokens after the first over the time from the first content \
             delta to the last. CPU ms per token: the user and system CPU time of the `run` process and its stage \
             processes (from `/proc`) while the request ran, over its completion tokens; on a shared machine it \
             moves much less than wall time. Figures are medians over {} rounds; \"vs off\" compares the \
             medians, \"paired vs off\" is the median over rounds of each round's rate over that round's \
             \"off\" rate (measured seconds apart, so slow drifts of the machine's load cancel).\n\n\
             {telemetry_tables}",
            run.command(),
            machine(),
            command_output("uname", &["-r"]),
            command_output("git", &["rev-parse", "--short", "HEAD"]),
            command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            load_average(),
            telemetry::TOKENS,
            run.rounds,
        );
    }
    fs::write(&destination, report.trim_end().to_owned() + "\n")
        .with_context(|| format!("could not write {}", destination.display()))?;
    eprintln!("xtask: wrote {}", destination.display());
    Ok(())
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
    fn the_table_reports_ratios_and_the_time_each_hop_adds() {
        let samples = vec![
            Samples {
                prefill: vec![100.0],
                decode: vec![100.0],
            },
            Samples {
                prefill: vec![90.0],
                decode: vec![80.0],
            },
            Samples {
                prefill: vec![80.0],
                decode: vec![50.0],
            },
            Samples {
                prefill: vec![50.0],
                decode: vec![40.0],
            },
        ];
        let table = render_table("m.gguf", 128, &samples);
        // 1/80 - 1/100 = 2.5 ms over one hop; 1/50 - 1/100 = 10 ms over two hops.
        assert!(
            table.contains("| 2 processes on loopback | 90.0 | 80.0 | 0.800x | 0.900x | 2500 µs |"),
            "{table}"
        );
        assert!(
            table.contains("| 3 processes on loopback | 80.0 | 50.0 | 0.500x | 0.800x | 5000 µs |"),
            "{table}"
        );
    }
}
