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
use std::io::Read;
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

/// Metadata value types of GGUF (the `gguf_type` enum of ggml's `gguf.h`).
mod gguf_type {
    pub(super) const UINT8: u32 = 0;
    pub(super) const INT8: u32 = 1;
    pub(super) const UINT16: u32 = 2;
    pub(super) const INT16: u32 = 3;
    pub(super) const UINT32: u32 = 4;
    pub(super) const INT32: u32 = 5;
    pub(super) const FLOAT32: u32 = 6;
    pub(super) const BOOL: u32 = 7;
    pub(super) const STRING: u32 = 8;
    pub(super) const ARRAY: u32 = 9;
    pub(super) const UINT64: u32 = 10;
    pub(super) const INT64: u32 = 11;
    pub(super) const FLOAT64: u32 = 12;
}

/// The longest metadata string this reader keeps (keys and the architecture name); longer ones are skipped
/// unread, so a damaged length cannot make it allocate gigabytes.
const GGUF_KEPT_STRING: u64 = 64 * 1024;

/// The layer count of the GGUF model at `path`, for the three-way split: its `<architecture>.block_count`,
/// read from the file's metadata at run time (a count written into this file went stale with a new model).
pub(crate) fn block_count(path: &Path) -> Result<usize> {
    let file =
        fs::File::open(path).with_context(|| format!("could not open {}", path.display()))?;
    let count = gguf_block_count(&mut std::io::BufReader::new(file))
        .with_context(|| format!("could not read the layer count of {}", path.display()))?;
    usize::try_from(count).context("the layer count does not fit in usize")
}

/// Reads a GGUF header (version 2 or 3) up to its metadata and returns `<general.architecture>.block_count`.
fn gguf_block_count(reader: &mut impl Read) -> Result<u64> {
    let mut magic = [0_u8; 4];
    reader
        .read_exact(&mut magic)
        .context("the file ends before its magic")?;
    ensure!(
        &magic == b"GGUF",
        "the file does not start with the GGUF magic"
    );
    let version = read_u32(reader)?;
    ensure!(
        matches!(version, 2 | 3),
        "GGUF version {version} is not one this reader knows (2 or 3)"
    );
    let _tensors = read_u64(reader)?;
    let entries = read_u64(reader)?;
    let mut architecture = None;
    let mut block_counts = BTreeMap::new();
    for _ in 0..entries {
        let key = read_kept_string(reader)?;
        let kind = read_u32(reader)?;
        if key == "general.architecture" && kind == gguf_type::STRING {
            architecture = Some(read_kept_string(reader)?);
        } else if key.ends_with(".block_count") {
            block_counts.insert(key, read_integer(reader, kind)?);
        } else {
            skip_value(reader, kind, 0)?;
        }
        if let Some(architecture) = &architecture
            && let Some(count) = block_counts.get(&format!("{architecture}.block_count"))
        {
            return Ok(*count);
        }
    }
    let architecture = architecture.context("the metadata has no general.architecture")?;
    bail!("the metadata has no {architecture}.block_count")
}

fn read_u32(reader: &mut impl Read) -> Result<u32> {
    let mut bytes = [0_u8; 4];
    reader
        .read_exact(&mut bytes)
        .context("the GGUF header ends early")?;
    Ok(u32::from_le_bytes(bytes))
}

fn read_u64(reader: &mut impl Read) -> Result<u64> {
    let mut bytes = [0_u8; 8];
    reader
        .read_exact(&mut bytes)
        .context("the GGUF header ends early")?;
    Ok(u64::from_le_bytes(bytes))
}

/// A metadata string the reader keeps: a u64 length, then that many UTF-8 bytes.
fn read_kept_string(reader: &mut impl Read) -> Result<String> {
    let length = read_u64(reader)?;
    ensure!(
        length <= GGUF_KEPT_STRING,
        "a metadata key or name of {length} bytes is longer than any real one"
    );
    let mut bytes = vec![0_u8; length as usize];
    reader
        .read_exact(&mut bytes)
        .context("the GGUF header ends inside a string")?;
    String::from_utf8(bytes).context("a metadata string is not UTF-8")
}

/// An integer metadata value of any integer type.
fn read_integer(reader: &mut impl Read, kind: u32) -> Result<u64> {
    let width = match kind {
        gguf_type::UINT8 | gguf_type::INT8 => 1,
        gguf_type::UINT16 | gguf_type::INT16 => 2,
        gguf_type::UINT32 | gguf_type::INT32 => 4,
        gguf_type::UINT64 | gguf_type::INT64 => 8,
        other => bail!("a block count of metadata type {other} is not an integer"),
    };
    let mut bytes = [0_u8; 8];
    reader
        .read_exact(&mut bytes[..width])
        .context("the GGUF header ends inside a value")?;
    Ok(u64::from_le_bytes(bytes))
}

/// Reads past one metadata value of type `kind`; `depth` bounds arrays of arrays.
fn skip_value(reader: &mut impl Read, kind: u32, depth: usize) -> Result<()> {
    let width = match kind {
        gguf_type::UINT8 | gguf_type::INT8 | gguf_type::BOOL => 1,
        gguf_type::UINT16 | gguf_type::INT16 => 2,
        gguf_type::UINT32 | gguf_type::INT32 | gguf_type::FLOAT32 => 4,
        gguf_type::UINT64 | gguf_type::INT64 | gguf_type::FLOAT64 => 8,
        gguf_type::STRING => read_u64(reader)?,
        gguf_type::ARRAY => {
            ensure!(depth < 4, "metadata arrays nest deeper than any real file");
            let element = read_u32(reader)?;
            let count = read_u64(reader)?;
            for _ in 0..count {
                skip_value(reader, element, depth + 1)?;
            }
            return Ok(());
        }
        other => bail!("metadata type {other} is not a GGUF type"),
    };
    let skipped = std::io::copy(&mut reader.take(width), &mut std::io::sink())?;
    ensure!(skipped == width, "the GGUF header ends inside a value");
    Ok(())
}

/// How many CPU variants (`libggml-cpu-*.so`) the llama.cpp library folder holds, for "best variant".
fn cpu_variant_count(folder: &Path) -> Option<usize> {
    let entries = fs::read_dir(folder).ok()?;
    Some(
        entries
            .filter_map(Result::ok)
            .filter(|entry| {
                entry
                    .file_name()
                    .to_str()
                    .is_some_and(|name| name.starts_with("libggml-cpu-") && name.ends_with(".so"))
            })
            .count(),
    )
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
        let blocks = block_count(&path)?;
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
         - Every runner uses {THREADS} threads. Figures are medians over {rounds} rounds; each round runs every runner once.\n\
         - Ours: `stage-server generate --prompt-ids <{PROMPT_TOKENS} ids> --max-tokens {} --threads {THREADS} --json`, \
         a fresh process per run (model load not timed). Prompt tokens/s is the {PROMPT_TOKENS}-token prefill \
         as one chunk; decode tokens/s covers the {DECODE_TOKENS} single-token steps after the first token, \
         so it runs at context {PROMPT_TOKENS} to {}. The split run uses `--split` at a third and two \
         thirds of the layers as each file's metadata counts them (`<architecture>.block_count`), three \
         in-process stages passing f32 activation bytes.\n\
         - llama.cpp: `llama_ref bench --pp {PROMPT_TOKENS} --tg {DECODE_TOKENS}` (our C API driver, \
         xtask/llama-ref/llama_ref.cpp): one warm-up, then pp as one batch from an empty cache and tg one \
         token at a time from an empty cache, like llama-bench. \"best variant\" lets ggml pick among {}; \
         \"AVX2 forced\" loads from a folder holding only `libggml-cpu-haswell.so`.\n\
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
        describe_cpu_variants(cpu_variant_count(&llama_ref::library_dir())),
    );
    let destination = workspace_root().join("docs/performance/model.md");
    fs::create_dir_all(destination.parent().context("docs path has no parent")?)?;
    fs::write(&destination, report)
        .with_context(|| format!("could not write {}", destination.display()))?;
    eprintln!("xtask: wrote {}", destination.display());
    Ok(())
}

/// `stage-server generate --model M --prompt-ids P --max-tokens N --threads T --json`, with the thread count
/// already in the environment, so the CLI does not re-run itself to apply `--threads` and the measured process
/// is the one doing the work.
pub(crate) fn generate_command(
    binary: &Path,
    model: &Path,
    prompt: &[u64],
    max_tokens: usize,
    threads: &str,
) -> Command {
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
            &max_tokens.to_string(),
            "--threads",
            threads,
            "--json",
        ])
        .env("CANDLE_NUM_THREADS", threads)
        .env("RAYON_NUM_THREADS", threads);
    command
}

/// Runs our CLI once; returns prompt tokens/s, decode tokens/s and the peak resident set in KiB.
fn run_ours(
    binary: &Path,
    model: &Path,
    prompt: &[u64],
    split: Option<&str>,
) -> Result<(f64, f64, u64)> {
    let mut command = generate_command(binary, model, prompt, DECODE_TOKENS + 1, THREADS);
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
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
pub(crate) fn prompt_ids(short_name: &str) -> Result<Vec<u64>> {
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

/// What "best variant" chooses among, from the CPU variants counted in the library folder.
fn describe_cpu_variants(count: Option<usize>) -> String {
    match count {
        Some(count) if count > 0 => {
            format!("the {count} CPU builds (`libggml-cpu-*.so`) in the library folder")
        }
        _ => "the CPU builds in the library folder (which could not be counted)".to_owned(),
    }
}

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
pub(crate) fn machine() -> String {
    let text = command_output("lscpu", &[]);
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .map(|rest| rest.trim().to_owned())
            .unwrap_or_default()
    };
    format!("{} ({} CPUs)", field("Model name:"), field("CPU(s):"))
}

pub(crate) fn command_output(program: &str, arguments: &[&str]) -> String {
    Command::new(program)
        .args(arguments)
        .output()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_owned())
        .unwrap_or_else(|_| format!("({program} unavailable)"))
}

/// Cargo's target directory: `$CARGO_TARGET_DIR` or `<workspace>/target`.
pub(crate) fn target_dir() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR")
        .filter(|value| !value.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GGUF version 3 header with `entries`, each a key and its already encoded type and value.
    fn gguf(entries: &[(&str, Vec<u8>)]) -> Vec<u8> {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend(3_u32.to_le_bytes());
        bytes.extend(0_u64.to_le_bytes());
        bytes.extend((entries.len() as u64).to_le_bytes());
        for (key, value) in entries {
            bytes.extend(string(key));
            bytes.extend(value);
        }
        bytes
    }

    fn string(text: &str) -> Vec<u8> {
        let mut bytes = (text.len() as u64).to_le_bytes().to_vec();
        bytes.extend(text.as_bytes());
        bytes
    }

    fn string_value(text: &str) -> Vec<u8> {
        let mut bytes = gguf_type::STRING.to_le_bytes().to_vec();
        bytes.extend(string(text));
        bytes
    }

    fn u32_value(value: u32) -> Vec<u8> {
        let mut bytes = gguf_type::UINT32.to_le_bytes().to_vec();
        bytes.extend(value.to_le_bytes());
        bytes
    }

    #[test]
    fn the_layer_count_is_the_block_count_of_the_file_s_architecture() {
        let mut tokens = gguf_type::ARRAY.to_le_bytes().to_vec();
        tokens.extend(gguf_type::STRING.to_le_bytes());
        tokens.extend(3_u64.to_le_bytes());
        for token in ["<s>", "hello", "world"] {
            tokens.extend(string(token));
        }
        let mut scale = gguf_type::FLOAT32.to_le_bytes().to_vec();
        scale.extend(1.5_f32.to_le_bytes());
        let file = gguf(&[
            ("general.architecture", string_value("gemma3")),
            ("tokenizer.ggml.tokens", tokens),
            ("gemma3.rope.scale", scale),
            // Another architecture's count must not be taken for this one's.
            ("llama.block_count", u32_value(30)),
            ("gemma3.block_count", u32_value(18)),
        ]);
        assert_eq!(
            gguf_block_count(&mut file.as_slice()).expect("a well-formed header"),
            18,
            "the count under the file's own architecture should be read"
        );
    }

    #[test]
    fn a_header_without_the_count_or_not_gguf_is_an_error_that_says_so() {
        let cases = [
            (
                gguf(&[("general.architecture", string_value("llama"))]),
                "no llama.block_count",
            ),
            (
                gguf(&[("llama.block_count", u32_value(30))]),
                "no general.architecture",
            ),
            (
                gguf(&[("general.architecture", string_value("llama"))])[..20].to_vec(),
                "ends",
            ),
            (b"GGML and more bytes".to_vec(), "GGUF magic"),
        ];
        for (file, expected) in cases {
            let error = gguf_block_count(&mut file.as_slice())
                .expect_err("a bad header must not give a count");
            assert!(
                format!("{error:#}").contains(expected),
                "the error should say `{expected}`, got `{error:#}`"
            );
        }
    }

    #[test]
    fn the_best_variant_names_the_cpu_builds_it_counted() {
        let folder =
            std::env::temp_dir().join(format!("xtask-cpu-variants-{}", std::process::id()));
        fs::create_dir_all(&folder).expect("create a scratch folder");
        for name in [
            "libggml-cpu-haswell.so",
            "libggml-cpu-skylakex.so",
            "libggml-base.so",
            "libllama.so",
        ] {
            fs::write(folder.join(name), b"").expect("write a scratch library");
        }
        let count = cpu_variant_count(&folder);
        let _ = fs::remove_dir_all(&folder);
        assert_eq!(
            count,
            Some(2),
            "only libggml-cpu-*.so files are CPU variants"
        );
        assert_eq!(
            describe_cpu_variants(count),
            "the 2 CPU builds (`libggml-cpu-*.so`) in the library folder",
            "the sentence should give the count"
        );
        assert!(
            describe_cpu_variants(None).contains("could not be counted"),
            "an unreadable folder is said to be uncounted"
        );
    }

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
