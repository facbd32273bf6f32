//! `cargo xtask bench model`: stage-server prompt and decode speed side by side with llama.cpp.
//!
//! For each real model in the cache, every round runs, back to back on the same machine:
//! - ours, unsplit: `stage-server generate --model F --prompt-ids <128 ids> --max-tokens 65 --threads 2 --json`
//!   (prompt tokens/s over the 128-token prefill; decode tokens/s over the 64 steps after the first token);
//! - ours, split into three in-process stages (`--split` at a third and two thirds of the layers);
//! - llama.cpp through `llama_ref bench --pp 128 --tg 64 --repeats 1` (one warm-up inside), with the CPU variant
//!   ggml picks as best, and with the AVX2-only `haswell` variant forced.
//!
//! The prompt is a natural-text token stream from the llama.cpp fixture, repeated to 128 ids. Ours decodes after
//! the 128-token prompt, llama.cpp's tg starts from an empty cache (as llama-bench does); at these lengths the
//! attention cost is small beside the matmuls. The figures are medians over the rounds. Peak resident memory
//! (VmHWM, polled from /proc) is reported for our processes; the CLI has no single-stage mode, so the resident
//! size of a middle stage alone is not measured here.

use std::collections::BTreeMap;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};

use crate::figures::{load_average, median};
use crate::llama_ref;
use crate::models::{self, MODELS};
use crate::{cargo, workspace_root};

/// Prompt length for prompt processing.
const PROMPT_TOKENS: usize = 128;
/// Decode steps timed.
const DECODE_TOKENS: usize = 64;
/// Compute threads for every runner.
const THREADS: &str = "2";

/// Layer counts of the real models, for the three-way split.
fn block_count(short_name: &str) -> usize {
    match short_name {
        "smollm2" => 30,
        _ => 18,
    }
}

/// One runner's figures over the rounds.
#[derive(Debug, Default)]
struct Samples {
    label: String,
    variant: String,
    prompt: Vec<f64>,
    decode: Vec<f64>,
    peak_rss_kib: Vec<u64>,
}

/// Runs the model benchmarks. Arguments: `--rounds N` (default 5).
pub fn run(arguments: &[String]) -> Result<()> {
    let mut rounds = 5;
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
            other => {
                bail!("unknown argument `{other}` to `cargo xtask bench model` (takes --rounds N)")
            }
        }
    }
    let model_dir = models::model_dir()?;
    let present: Vec<_> = MODELS
        .iter()
        .filter(|model| model_dir.join(model.file_name).exists())
        .collect();
    ensure!(
        !present.is_empty(),
        "no real model in {}; run `cargo xtask fetch-models` first",
        model_dir.display()
    );

    cargo(&["build", "--release", "-p", "stage-server"])?;
    let ours = target_dir().join("release/stage-server");
    ensure!(ours.exists(), "cargo built no {}", ours.display());
    let reference = llama_ref::ensure_built()?;
    let best_backends = llama_ref::library_dir();
    let haswell_backends = llama_ref::forced_variant_dir("haswell")?;

    let load_before = load_average();
    let mut tables = String::new();
    for model in present {
        let path = model_dir.join(model.file_name);
        let prompt = prompt_ids(model.short_name)?;
        let blocks = block_count(model.short_name);
        let split = format!("{},{}", blocks / 3, 2 * blocks / 3);
        let mut runners: BTreeMap<usize, Samples> = BTreeMap::new();
        for round in 0..rounds {
            eprintln!("xtask: {} round {}/{rounds}", model.short_name, round + 1);
            for (index, split_argument) in [None, Some(split.as_str())].into_iter().enumerate() {
                let samples = runners.entry(index).or_default();
                samples.label = match split_argument {
                    None => "stage-server, unsplit".to_owned(),
                    Some(split) => format!("stage-server, 3 stages (--split {split})"),
                };
                samples.variant = "candle + own kernels".to_owned();
                let (prompt_rate, decode_rate, rss) =
                    run_ours(&ours, &path, &prompt, split_argument)?;
                samples.prompt.push(prompt_rate);
                samples.decode.push(decode_rate);
                samples.peak_rss_kib.push(rss);
            }
            for (index, backends) in [(2, &best_backends), (3, &haswell_backends)] {
                let reply = llama_ref::invoke(
                    &reference,
                    backends,
                    &path,
                    &[
                        "--threads",
                        THREADS,
                        "bench",
                        "--pp",
                        &PROMPT_TOKENS.to_string(),
                        "--tg",
                        &DECODE_TOKENS.to_string(),
                        "--repeats",
                        "1",
                    ],
                )?;
                let samples = runners.entry(index).or_default();
                samples.variant = reply["variant"].as_str().unwrap_or("unknown").to_owned();
                samples.label = if index == 2 {
                    "llama.cpp, best variant".to_owned()
                } else {
                    "llama.cpp, AVX2 forced".to_owned()
                };
                samples.prompt.push(
                    reply["pp_median"]
                        .as_f64()
                        .context("llama_ref gave no pp_median")?,
                );
                samples.decode.push(
                    reply["tg_median"]
                        .as_f64()
                        .context("llama_ref gave no tg_median")?,
                );
            }
        }
        let table = render_table(model.file_name, &runners);
        println!("{table}");
        tables.push_str(&table);
        tables.push('\n');
        write_report(rounds, &load_before, &tables)?;
    }
    Ok(())
}

/// Writes docs/performance/model.md with the tables so far (called after every model, so a long run that is
/// cut short still leaves its finished models on disk).
fn write_report(rounds: usize, load_before: &str, tables: &str) -> Result<()> {
    let mut report = String::new();
    let _ = write!(
        report,
        "# Model speed: stage-server beside llama.cpp\n\n\
         Command: `cargo xtask bench model --rounds {rounds}` (llama.cpp libraries: {}).\n\n\
         Machine: {}; kernel {}; commit {}; {}; 1/5/15-minute load average {load_before} before and \
         {} at the latest write.\n\
         {} The runners were interleaved round by round, so the ratios are fairer than the absolutes. \
         When the load average is far above the core count, every runner is starved and the figures measure \
         contention rather than speed (spinning thread pools suffer most); rerun on a quiet machine \
         before drawing conclusions.\n\n\
         ## Method\n\n\
         - Every runner uses 2 threads. Figures are medians over {rounds} rounds; each round runs every runner once.\n\
         - Ours: `stage-server generate --prompt-ids <{PROMPT_TOKENS} ids> --max-tokens {} --threads 2 --json`, \
         a fresh process per run (model load not timed). Prompt tokens/s is the {PROMPT_TOKENS}-token prefill \
         as one chunk; decode tokens/s covers the {DECODE_TOKENS} single-token steps after the first token, \
         so it runs at context {PROMPT_TOKENS} to {}. The split run uses `--split` at a third and two \
         thirds of the layers (three in-process stages passing f32 activation bytes).\n\
         - llama.cpp: `llama_ref bench --pp {PROMPT_TOKENS} --tg {DECODE_TOKENS}` (our C API driver, \
         xtask/llama-ref/llama_ref.cpp): one warm-up, then pp as one batch from an empty cache and tg one \
         token at a time from an empty cache, like llama-bench. \"best variant\" lets ggml pick among its 13 CPU \
         builds; \"AVX2 forced\" loads from a folder holding only `libggml-cpu-haswell.so`.\n\
         - The prompt is natural text: the longest llama.cpp fixture stream for the model, repeated to \
         {PROMPT_TOKENS} ids.\n\
         - Peak RSS is the process's VmHWM (whole pipeline, all stages). The CLI has no single-stage mode, so a \
         middle stage's own resident size is not measured by this command.\n\
         - Ratios are ours divided by llama.cpp with the AVX2 (haswell) variant, the issue's target \
         (decode at least 1.0x, prompt at least 0.5x), and split decode over unsplit decode (target at least 0.95).\n\n\
         ## Results\n\n{tables}",
        llama_ref::LLAMA_CPP_VERSION,
        machine(),
        command_output("uname", &["-r"]),
        command_output("git", &["rev-parse", "--short", "HEAD"]),
        command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        load_average(),
        load_verdict(load_before, &load_average()),
        DECODE_TOKENS + 1,
        PROMPT_TOKENS + DECODE_TOKENS,
    );
    let destination = workspace_root().join("docs/performance/model.md");
    fs::create_dir_all(destination.parent().context("docs path has no parent")?)?;
    fs::write(&destination, report)
        .with_context(|| format!("could not write {}", destination.display()))?;
    eprintln!("xtask: wrote {}", destination.display());
    Ok(())
}

/// Runs our CLI once; returns prompt tokens/s, decode tokens/s and the peak resident set in KiB.
fn run_ours(
    binary: &Path,
    model: &Path,
    prompt: &[u64],
    split: Option<&str>,
) -> Result<(f64, f64, u64)> {
    let ids: Vec<String> = prompt.iter().map(u64::to_string).collect();
    let mut command = Command::new(binary);
    command
        .arg("generate")
        .arg("--model")
        .arg(model)
        .arg("--prompt-ids")
        .arg(ids.join(","))
        .args([
            "--max-tokens",
            &(DECODE_TOKENS + 1).to_string(),
            "--threads",
            THREADS,
            "--json",
        ])
        // Already set, so the CLI does not re-run itself to apply --threads and the measured process is the
        // one doing the work.
        .env("CANDLE_NUM_THREADS", THREADS)
        .env("RAYON_NUM_THREADS", THREADS)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(split) = split {
        command.args(["--split", split]);
    }
    let child = command
        .spawn()
        .with_context(|| format!("could not start {}", binary.display()))?;
    let status_path = PathBuf::from(format!("/proc/{}/status", child.id()));
    let watcher = thread::spawn(move || {
        let mut peak = 0;
        while let Ok(status) = fs::read_to_string(&status_path) {
            if let Some(value) = status
                .lines()
                .find_map(|line| line.strip_prefix("VmHWM:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
            {
                peak = peak.max(value);
            } else {
                break; // A zombie has no memory lines: the process has finished.
            }
            thread::sleep(Duration::from_millis(20));
        }
        peak
    });
    let output = child.wait_with_output()?;
    let peak = watcher.join().unwrap_or(0);
    if !output.status.success() {
        bail!(
            "stage-server generate failed with {}: {}",
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().last().unwrap_or_default();
    let reply: serde_json::Value = serde_json::from_str(line)
        .with_context(|| format!("stage-server printed unexpected output: {text}"))?;
    let generated = reply["tokens"].as_array().map_or(0, Vec::len);
    if generated < DECODE_TOKENS + 1 {
        eprintln!(
            "xtask: note: stage-server stopped after {generated} tokens (an end-of-generation token)"
        );
    }
    Ok((
        reply["prompt_tokens_per_second"]
            .as_f64()
            .context("no prompt_tokens_per_second in --json output")?,
        reply["decode_tokens_per_second"]
            .as_f64()
            .context("no decode_tokens_per_second in --json output")?,
        peak,
    ))
}

/// 128 natural-text ids: the longest fixture stream for the model, repeated.
fn prompt_ids(short_name: &str) -> Result<Vec<u64>> {
    let path = workspace_root().join(format!(
        "stage-server/tests/fixtures/llama_cpp/{short_name}.json"
    ));
    let text = fs::read_to_string(&path).with_context(|| {
        format!(
            "could not read {}; run `cargo xtask llama-ref fixtures`",
            path.display()
        )
    })?;
    let fixture: serde_json::Value = serde_json::from_str(&text)?;
    let cases = fixture["cases"]
        .as_array()
        .context("the fixture has no cases")?;
    let mut longest: Vec<u64> = Vec::new();
    for case in cases {
        let stream: Vec<u64> = ["prompt_ids", "generated_ids"]
            .iter()
            .filter_map(|key| case[*key].as_array())
            .flatten()
            .filter_map(serde_json::Value::as_u64)
            .collect();
        if stream.len() > longest.len() {
            longest = stream;
        }
    }
    ensure!(
        !longest.is_empty(),
        "the fixture {} has no token stream",
        path.display()
    );
    Ok(longest
        .iter()
        .copied()
        .cycle()
        .take(PROMPT_TOKENS)
        .collect())
}

/// The markdown table for one model: medians, ratios against the AVX2 llama.cpp, split against unsplit.
fn render_table(model: &str, runners: &BTreeMap<usize, Samples>) -> String {
    let median_of = |index: usize, pick: fn(&Samples) -> &Vec<f64>| {
        runners
            .get(&index)
            .map_or(0.0, |samples| median(pick(samples)))
    };
    let haswell_prompt = median_of(3, |samples| &samples.prompt);
    let haswell_decode = median_of(3, |samples| &samples.decode);
    let unsplit_decode = median_of(0, |samples| &samples.decode);
    let mut table = format!(
        "### {model}\n\n\
         | Runner | CPU variant | pp{PROMPT_TOKENS} tok/s | tg{DECODE_TOKENS} tok/s | pp vs llama.cpp AVX2 | \
         tg vs llama.cpp AVX2 | Peak RSS |\n|---|---|---|---|---|---|---|\n"
    );
    for (index, samples) in runners {
        let prompt = median(&samples.prompt);
        let decode = median(&samples.decode);
        let rss = if samples.peak_rss_kib.is_empty() {
            "n/a".to_owned()
        } else {
            let mut values = samples.peak_rss_kib.clone();
            values.sort_unstable();
            format!("{:.0} MiB", values[values.len() / 2] as f64 / 1024.0)
        };
        let _ = writeln!(
            table,
            "| {} | {} | {prompt:.1} | {decode:.1} | {:.2}x | {:.2}x | {rss} |",
            samples.label,
            samples.variant,
            ratio(prompt, haswell_prompt),
            ratio(decode, haswell_decode),
        );
        if *index == 1 {
            let _ = writeln!(
                table,
                "| (3-stage decode / unsplit decode) | | | | | {:.3}x | |",
                ratio(decode, unsplit_decode)
            );
        }
    }
    let spread = |pick: fn(&Samples) -> &Vec<f64>| -> String {
        runners
            .values()
            .map(|samples| {
                let values = pick(samples);
                let low = values.iter().copied().fold(f64::INFINITY, f64::min);
                let high = values.iter().copied().fold(0.0, f64::max);
                format!("{}: {low:.1} to {high:.1}", samples.label)
            })
            .collect::<Vec<_>>()
            .join("; ")
    };
    let _ = write!(
        table,
        "\nRange over rounds, pp: {}.\nRange over rounds, tg: {}.\n",
        spread(|samples| &samples.prompt),
        spread(|samples| &samples.decode)
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

/// The first three fields of /proc/loadavg: how busy the machine was.
/// One sentence on how busy the machine was, from the 1-minute load averages before the run and at the write,
/// measured against the CPU count (a fixed sentence went stale whenever the machine was quiet or busier).
fn load_verdict(before: &str, now: &str) -> String {
    let cores = thread::available_parallelism().map_or(1, |count| count.get());
    let one_minute = |text: &str| {
        text.split_whitespace()
            .next()
            .and_then(|value| value.parse::<f64>().ok())
    };
    let (Some(before), Some(now)) = (one_minute(before), one_minute(now)) else {
        return "The load average could not be read, so how busy the machine was is unknown."
            .to_owned();
    };
    let highest = before.max(now);
    // Each runner keeps `--threads` (2) threads busy, which the load average counts.
    if highest <= 1.5 * cores as f64 {
        format!(
            "The 1-minute load average stayed at or below {highest:.2} on {cores} CPUs, which counts the runners' \
             own threads: little else was running."
        )
    } else {
        format!(
            "The 1-minute load average reached {highest:.2} on {cores} CPUs: other work shared the CPUs during \
             the run, so absolute figures are noisy."
        )
    }
}

/// The CPU model and count, from lscpu.
fn machine() -> String {
    let text = command_output("lscpu", &[]);
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .map(|rest| rest.trim().to_owned())
            .unwrap_or_default()
    };
    format!("{} ({} CPUs)", field("Model name:"), field("CPU(s):"))
}

fn command_output(program: &str, arguments: &[&str]) -> String {
    Command::new(program)
        .args(arguments)
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
        .unwrap_or_else(|_| format!("({program} unavailable)"))
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` or `<workspace>/target`.
fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR")
        .filter(|value| !value.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_benchmark_prompt_is_128_fixture_ids() {
        let ids = prompt_ids("smollm2").expect("the SmolLM2 fixture is committed");
        assert_eq!(
            ids.len(),
            PROMPT_TOKENS,
            "the prompt must be {PROMPT_TOKENS} ids long"
        );
        assert!(
            ids.iter().all(|&id| id < 49_152),
            "every id must be inside SmolLM2's vocabulary"
        );
    }
}
