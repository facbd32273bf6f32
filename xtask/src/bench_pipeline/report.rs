//! The report of `cargo xtask bench pipeline`: the tables of one model's rows, what ran, and
//! `docs/performance/pipeline.md` with its method, every figure and count taken from the run.

use std::fmt::Write as _;
use std::fs;

use anyhow::{Context, Result};

use super::llama::{self, PEERS, Peer};
use super::{
    CHUNK_TOKENS, CODEC, DECODE_TOKENS, LAYOUTS, LINK_DELAY_MS, LONG_MAX_TOKENS,
    LONG_PROMPT_TOKENS, LONG_ROWS, LONG_SPLIT, ModelRows, PROMPT_TOKENS, Run, Samples, THREADS,
    boundaries, telemetry,
};
use crate::bench_model::{command_output, machine};
use crate::figures::{PairedRatios, load_average, median};
use crate::workspace_root;

/// The heading the telemetry section of the report starts with (`--only-telemetry` replaces from there).
const TELEMETRY_HEADING: &str = "## Telemetry overhead";

/// One model's section: the layout table as it always was, then llama.cpp's rows beside ours, the credit
/// rows and what ran.
pub(super) fn render_model(rows: &ModelRows) -> String {
    let mut text = render_table(&rows.model_file, PROMPT_TOKENS, &rows.layouts);
    text.push('\n');
    text.push_str(&render_peers(&rows.layouts, &rows.peers));
    text.push('\n');
    text.push_str(&render_long(&rows.long));
    text.push('\n');
    text.push_str(&render_details(rows));
    text
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
        .map(|(layout, samples)| format!("{}: {}", layout.label(), range(&samples.decode)))
        .collect();
    let _ = write!(
        table,
        "\nDecode range over rounds: {}.\n",
        ranges.join("; ")
    );
    table
}

/// llama.cpp's rows, and our decode over theirs: 2 and 3 processes over the RPC backend, unsplit over whole.
fn render_peers(layouts: &[Samples], peers: &[Samples]) -> String {
    let whole_decode = median(&peers[0].decode);
    let whole_prefill = median(&peers[0].prefill);
    let mut text = format!(
        "#### llama.cpp in the same rounds\n\n| Layout | prefill tok/s ({PROMPT_TOKENS} tokens) | decode tok/s | \
         decode vs llama.cpp whole | prefill vs llama.cpp whole |\n|---|---|---|---|---|\n"
    );
    let mut failures = String::new();
    for (peer, samples) in PEERS.iter().zip(peers) {
        if let Some(failure) = &samples.failure {
            let _ = writeln!(
                failures,
                "- {} stopped after {} rounds: {}",
                peer.label(),
                samples.decode.len(),
                failure.replace('\n', " ")
            );
        }
        if samples.decode.is_empty() {
            let _ = writeln!(text, "| {} | no figures | | | |", peer.label());
            continue;
        }
        let prefill = median(&samples.prefill);
        let decode = median(&samples.decode);
        let _ = writeln!(
            text,
            "| {} | {prefill:.1} | {decode:.1} | {:.3}x | {:.3}x |",
            peer.label(),
            ratio(decode, whole_decode),
            ratio(prefill, whole_prefill),
        );
    }
    let ranges: Vec<String> = PEERS
        .iter()
        .zip(peers)
        .filter(|(_, samples)| !samples.decode.is_empty())
        .map(|(peer, samples)| format!("{}: {}", peer.label(), range(&samples.decode)))
        .collect();
    if !ranges.is_empty() {
        let _ = writeln!(text, "\nDecode range over rounds: {}.", ranges.join("; "));
    }
    if !failures.is_empty() {
        let _ = write!(text, "\n{failures}");
    }
    // Ours over the peer that runs the same way: the splits over the RPC backend, unsplit over whole.
    let pairs = [
        (LAYOUTS[1], &layouts[1], Peer::Rpc, &peers[1]),
        (LAYOUTS[2], &layouts[2], Peer::Rpc, &peers[1]),
        (LAYOUTS[0], &layouts[0], Peer::Whole, &peers[0]),
    ];
    let mut ratios = String::new();
    for (layout, ours, peer, theirs) in pairs {
        if theirs.decode.is_empty() {
            continue;
        }
        let paired = PairedRatios::new(&ours.decode, &theirs.decode);
        let _ = writeln!(
            ratios,
            "| {} over {} | {:.3}x | {:.3}x ({:.3}x to {:.3}x) | {:.3}x |",
            layout.label(),
            peer.label(),
            ratio(median(&ours.decode), median(&theirs.decode)),
            paired.median,
            paired.lowest,
            paired.highest,
            ratio(median(&ours.prefill), median(&theirs.prefill)),
        );
    }
    if !ratios.is_empty() {
        let _ = write!(
            text,
            "\n| Ours over llama.cpp | decode, ratio of medians | decode, per round: median (lowest to highest) | \
             prefill, ratio of medians |\n|---|---|---|---|\n{ratios}"
        );
    }
    text
}

/// The 2,048-token prefill rows: unsplit, and 3 processes by reply credits, each against unsplit.
fn render_long(long: &[Samples]) -> String {
    let unsplit = median(&long[0].prefill);
    let chunks = LONG_PROMPT_TOKENS.div_ceil(CHUNK_TOKENS);
    let mut text = format!(
        "#### Prefill of {LONG_PROMPT_TOKENS} tokens ({chunks} chunks of {CHUNK_TOKENS}) by reply credits\n\n\
         | Layout | prefill tok/s ({LONG_PROMPT_TOKENS} tokens) | vs unsplit | paired vs unsplit: median (lowest to \
         highest) | range over rounds |\n|---|---|---|---|---|\n"
    );
    for (row, samples) in LONG_ROWS.iter().zip(long) {
        let prefill = median(&samples.prefill);
        let paired = PairedRatios::new(&samples.prefill, &long[0].prefill);
        let _ = writeln!(
            text,
            "| {} | {prefill:.1} | {:.3}x | {:.3}x ({:.3}x to {:.3}x) | {} |",
            row.label(),
            ratio(prefill, unsplit),
            paired.median,
            paired.lowest,
            paired.highest,
            range(&samples.prefill),
        );
    }
    text
}

/// What ran for one model, from the run itself: layer ranges, counts, time, commands and llama.cpp's
/// placement lines.
fn render_details(rows: &ModelRows) -> String {
    let blocks = rows.blocks;
    let ranges = |count: usize| {
        let mut edges = vec![0];
        edges.extend(boundaries(blocks, count));
        edges.push(blocks);
        edges
            .windows(2)
            .map(|window| format!("{}..{}", window[0], window[1]))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (first, second) = llama::tensor_split(blocks);
    let mut text = format!(
        "#### What ran\n\n\
         - `{}` has {blocks} blocks (`<architecture>.block_count`): 2 processes held layers {}; 3 processes {}; \
         llama.cpp's RPC run got `-ts {first},{second}` over its {} servers.\n",
        rows.model_file,
        ranges(2),
        ranges(3),
        llama::RPC_SERVERS,
    );
    let all = rows.layouts.iter().chain(&rows.peers);
    let generations: usize = all
        .clone()
        .chain(&rows.long)
        .map(|samples| samples.decode.len())
        .sum();
    let _ = writeln!(
        text,
        "- Timed generations: {generations}. Prompt tokens evaluated per generation: {} in the {PROMPT_TOKENS}-token \
         rows (llama.cpp's from `timings.prompt_n`), {} in the {LONG_PROMPT_TOKENS}-token rows. Decode steps \
         after the first token per generation: {} in our rows, {} in llama.cpp's (`timings.predicted_n` - 1).",
        count_range(all.clone().flat_map(|samples| &samples.prompt_tokens)),
        count_range(rows.long.iter().flat_map(|samples| &samples.prompt_tokens)),
        count_range(
            rows.layouts
                .iter()
                .flat_map(|samples| &samples.decode_steps)
        ),
        count_range(rows.peers.iter().flat_map(|samples| &samples.decode_steps)),
    );
    let _ = writeln!(
        text,
        "- Wall time over the rounds, process starts and model loads included: our {} layouts {:.0} s, \
         llama.cpp's {} rows {:.0} s, the {} {LONG_PROMPT_TOKENS}-token rows {:.0} s.",
        LAYOUTS.len(),
        rows.layout_time.as_secs_f64(),
        PEERS.len(),
        rows.peer_time.as_secs_f64(),
        LONG_ROWS.len(),
        rows.long_time.as_secs_f64(),
    );
    let _ = write!(
        text,
        "\nCommands of the first round, each row's processes in the order they started (ports differ every \
         round):\n\n```text\n"
    );
    let labelled = LAYOUTS
        .iter()
        .map(|layout| layout.label())
        .zip(&rows.layouts)
        .chain(PEERS.iter().map(|peer| peer.label()).zip(&rows.peers))
        .chain(
            LONG_ROWS
                .iter()
                .map(|row| format!("{LONG_PROMPT_TOKENS} tokens, {}", row.label()))
                .zip(&rows.long),
        );
    for (label, samples) in labelled {
        let _ = writeln!(text, "# {label}");
        for command in &samples.commands {
            let _ = writeln!(text, "{command}");
        }
    }
    text.push_str("```\n");
    for (peer, samples) in PEERS.iter().zip(&rows.peers) {
        if samples.notes.is_empty() {
            continue;
        }
        let _ = write!(
            text,
            "\nllama-server's log ({}, first round): its CPU build, and where the weights, the KV cache and the \
             compute went:\n\n```text\n{}\n```\n",
            peer.label(),
            samples.notes.join("\n")
        );
    }
    text
}

/// `lowest to highest` of some samples, one decimal each.
fn range(values: &[f64]) -> String {
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(0.0, f64::max);
    format!("{low:.1} to {high:.1}")
}

/// The counts seen, as `N` when all are equal, `N to M` otherwise, `none` without any.
fn count_range<'a>(counts: impl Iterator<Item = &'a usize>) -> String {
    let counts: Vec<usize> = counts.copied().collect();
    match (counts.iter().min(), counts.iter().max()) {
        (Some(low), Some(high)) if low == high => low.to_string(),
        (Some(low), Some(high)) => format!("{low} to {high}"),
        _ => "none".to_owned(),
    }
}

fn ratio(numerator: f64, denominator: f64) -> f64 {
    if denominator > 0.0 {
        numerator / denominator
    } else {
        0.0
    }
}

/// The commit, with how many paths `git status` lists as changed or untracked: the release binary is built
/// from the work tree, so a dirty tree is part of what was measured.
fn commit() -> String {
    let commit = command_output("git", &["rev-parse", "--short", "HEAD"]);
    let status = command_output("git", &["status", "--porcelain"]);
    match status.lines().count() {
        0 => format!("commit {commit} (clean work tree)"),
        changed => format!(
            "commit {commit} plus a work tree with {changed} changed or untracked paths (`git status --porcelain`)"
        ),
    }
}

/// Writes `docs/performance/pipeline.md`: the layout tables (kept from the file as it was when this run has
/// none, as with `--only-telemetry`) and then the telemetry section.
pub(super) fn write_report(
    run: &Run,
    load_before: &str,
    tables: &str,
    telemetry_tables: &str,
) -> Result<()> {
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
        let order: Vec<String> = LAYOUTS
            .iter()
            .map(|layout| layout.label())
            .chain(PEERS.iter().map(|peer| peer.label()))
            .chain(
                LONG_ROWS
                    .iter()
                    .map(|row| format!("{LONG_PROMPT_TOKENS} tokens {}", row.label())),
            )
            .collect();
        let credits: Vec<String> = LONG_ROWS
            .iter()
            .filter_map(|row| row.credits())
            .map(|credits| credits.to_string())
            .collect();
        let _ = write!(
            report,
            "# Pipeline speed: a model split across stage processes\n\n\
             Command: `{}`.\n\n\
             Machine: {}; kernel {}; {}; {}; 1/5/15-minute load average {load_before} before and {} at the \
             latest write, {:.0} s after the command started.\n\n\
             ## Method\n\n\
             - Every process was started with {THREADS} compute threads (`--threads {THREADS}` and \
             `CANDLE_NUM_THREADS`/`RAYON_NUM_THREADS` for ours, `-t {THREADS}` for llama.cpp's), on the machine's \
             CPUs above. The exact commands of each model's first round are under its tables.\n\
             - Each of the {} rounds ran every row once, in this order: {}. Each generation ran in processes \
             started for it and stopped after it; their start and model load are outside the timed figures. \
             Figures are medians over the rounds.\n\
             - Ours: `stage-server generate --prompt-ids <P ids> --max-tokens {} --threads {THREADS} --json`, as \
             stage 0 with `--layers 0..K --next ADDR --codec {CODEC}` when split, and `stage-server serve \
             --codec {CODEC}` processes for the other layer ranges, cut at `i * block_count / processes`. Prefill \
             and decode tok/s are the `prompt_tokens_per_second` and `decode_tokens_per_second` it prints: the \
             prompt over the time up to the first token, and the tokens after the first over the time after it.\n\
             - Split layouts return tokens straight from the last stage to stage 0 unless marked \"tokens \
             relayed\" (`--prediction-return relayed`: back up the chain, stage by stage).\n\
             - The delayed layouts add {LINK_DELAY_MS} ms one way to each direction of stage 0's and stage 1's \
             links to the next stage and to the last stage's prediction returns (`--link-delay` on every \
             process, applied in the process), so a decode step crosses three delayed hops with tokens returned \
             directly (two down, one back) and four relayed (two down, two back up).\n\
             - Added per hop: `(1/split decode - 1/unsplit decode) / (processes - 1)`, from the medians: the \
             step time beyond the unsplit compute per stage link.\n\
             - llama.cpp ({}): `llama-server -m F --host 127.0.0.1 --port P -np 1 -c {} -t {THREADS} --fit \
             off -lv {}` alone (\"whole\"; `-lv {}` so that its log names where the layers went), and with `--rpc A,B -ngl 99 -ts K,L` driving {} `ggml-rpc-server -H \
             127.0.0.1 -p P -t {THREADS}` processes (\"RPC\"): `-ngl 99` offloads every layer to them, `-ts` puts \
             the first half of the blocks on the first (the log lines under each model show where they went). One \
             non-streaming `POST /completion` per round with the same prompt ids, `n_predict` {}, temperature \
             0, `cache_prompt: false` and `ignore_eos: true`; prefill and decode tok/s are its \
             `timings.prompt_per_second` and `timings.predicted_per_second` (the latter over the steps after the \
             first token, `predicted_n - 1`, as ours). The timed request is the first each llama-server answers \
             after its own warm-up at load.\n\
             - Ours over llama.cpp: the ratio of the two medians, and the median, lowest and highest of the \
             per-round ratios (ours and llama.cpp's of the same round).\n\
             - The {LONG_PROMPT_TOKENS}-token rows: the same fixture stream repeated to {LONG_PROMPT_TOKENS} ids \
             ({} prefill chunks of {CHUNK_TOKENS}), `--max-tokens {LONG_MAX_TOKENS}`, unsplit and through \
             {} with stage 0's `--reply-credits` {}; \"vs unsplit\" divides by the unsplit \
             {LONG_PROMPT_TOKENS}-token row of the same run.\n\n\
             ## Results\n\n{tables}",
            run.command(),
            machine(),
            command_output("uname", &["-r"]),
            commit(),
            command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            load_average(),
            run.started.elapsed().as_secs_f64(),
            run.rounds,
            order.join("; "),
            DECODE_TOKENS + 1,
            run.llama_version
                .as_deref()
                .unwrap_or("binaries missing, rows not run"),
            llama::CONTEXT,
            llama::LOG_VERBOSITY,
            llama::LOG_VERBOSITY,
            llama::RPC_SERVERS,
            DECODE_TOKENS + 1,
            LONG_PROMPT_TOKENS.div_ceil(CHUNK_TOKENS),
            LONG_SPLIT.label(),
            credits.join(", "),
        );
    }
    if !telemetry_tables.is_empty() {
        let _ = write!(
            report,
            "{TELEMETRY_HEADING}\n\n\
             Command: `{}`. Machine: {}; kernel {}; commit {}; {}; 1/5/15-minute load average {load_before} before \
             and {} at the latest write.\n\n\
             - Four kinds of `stage-server run --stages 3 --lanes 1 --threads {THREADS}` pipeline of the same \
             model: telemetry off; `--otlp-endpoint` to a loopback OTLP/HTTP receiver in xtask that reads every \
             request and answers 200; `--otlp-endpoint` to a black hole that accepts connections and never reads \
             or answers; off again (the control). Every process of an \"on\" pipeline exports (spans and metrics \
             every 5 s).\n\
             - The run is {} blocks. In each block every kind in turn, in an order rotated every block, starts a \
             fresh pipeline, which runs alone: one untimed warm-up request, then {} timed streamed chat \
             completions of {} tokens (temperature 0, the same prompts for every kind in a block), then it is \
             stopped. Closed loop, one request at a time. Fresh starts make a start's luck (where its buffers and \
             threads land) noise between blocks rather than a bias of one row, and charge an exporter's \
             background work to its own row.\n\
             - Decode tok/s is the client's: completion tokens after the first over the time from the first content \
             delta to the last. CPU ms per token: the user and system CPU time of the `run` process and its stage \
             processes (from `/proc`) while the request ran, over its completion tokens; on a shared machine it \
             moves much less than wall time. \"vs off\" compares the medians over every timed request; \"paired \
             vs off\" is the median over blocks of each block's median over that block's \"off\" median, with \
             its 95% bootstrap interval. The control row's interval is what two starts of the same pipeline \
             differ by.\n\n\
             {telemetry_tables}",
            run.command(),
            machine(),
            command_output("uname", &["-r"]),
            command_output("git", &["rev-parse", "--short", "HEAD"]),
            command_output("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
            load_average(),
            run.rounds,
            telemetry::REQUESTS_PER_BLOCK,
            telemetry::TOKENS,
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

    fn samples(prefill: f64, decode: f64) -> Samples {
        Samples {
            prefill: vec![prefill],
            decode: vec![decode],
            ..Samples::default()
        }
    }

    #[test]
    fn the_table_reports_ratios_and_the_time_each_hop_adds() {
        let samples = vec![
            samples(100.0, 100.0),
            samples(90.0, 80.0),
            samples(80.0, 50.0),
            samples(50.0, 40.0),
            samples(40.0, 20.0),
            samples(30.0, 16.0),
        ];
        let table = render_table("m.gguf", 128, &samples);
        // 1/80 - 1/100 = 2.5 ms over one hop; 1/50 - 1/100 = 10 ms over two hops.
        assert!(
            table
                .contains("| 2 processes, on loopback | 90.0 | 80.0 | 0.800x | 0.900x | 2500 µs |"),
            "{table}"
        );
        assert!(
            table
                .contains("| 3 processes, on loopback | 80.0 | 50.0 | 0.500x | 0.800x | 5000 µs |"),
            "{table}"
        );
        // Relayed tokens cross the same two stage links: 1/40 - 1/100 = 15 ms over two.
        assert!(
            table.contains(
                "| 3 processes, on loopback, tokens relayed | 50.0 | 40.0 | 0.400x | 0.500x | 7500 µs |"
            ),
            "{table}"
        );
        assert!(
            table.contains(
                "| 3 processes, 5 ms per hop, tokens relayed | 30.0 | 16.0 | 0.160x | 0.300x |"
            ),
            "{table}"
        );
    }

    #[test]
    fn our_splits_are_divided_by_the_rpc_backend_and_unsplit_by_llama_cpp_whole() {
        let layouts = vec![
            samples(300.0, 90.0),
            samples(270.0, 72.0),
            samples(280.0, 66.0),
            samples(250.0, 26.0),
            samples(240.0, 20.0),
            samples(230.0, 18.0),
        ];
        let peers = vec![samples(600.0, 100.0), samples(400.0, 48.0)];
        let text = render_peers(&layouts, &peers);
        assert!(
            text.contains("| llama.cpp RPC, 2 processes | 400.0 | 48.0 | 0.480x | 0.667x |"),
            "the RPC row must compare with llama.cpp whole:\n{text}"
        );
        assert!(
            text.contains(
                "| 2 processes, on loopback over llama.cpp RPC, 2 processes | 1.500x | 1.500x (1.500x to 1.500x) | 0.675x |"
            ),
            "2 processes over the RPC backend: 72 / 48 decode, 270 / 400 prefill:\n{text}"
        );
        assert!(
            text.contains("| 3 processes, on loopback over llama.cpp RPC, 2 processes | 1.375x |"),
            "3 processes over the RPC backend: 66 / 48:\n{text}"
        );
        assert!(
            text.contains("| unsplit, one process over llama.cpp whole | 0.900x |"),
            "unsplit over whole: 90 / 100:\n{text}"
        );
    }

    #[test]
    fn a_peer_that_failed_is_reported_and_left_out_of_the_ratios() {
        let layouts: Vec<Samples> = (0..LAYOUTS.len()).map(|_| samples(100.0, 50.0)).collect();
        let mut failed = Samples {
            failure: Some("round 1: ggml-rpc-server exited".to_owned()),
            ..Samples::default()
        };
        failed.commands.push("ggml-rpc-server".to_owned());
        let peers = vec![samples(200.0, 100.0), failed];
        let text = render_peers(&layouts, &peers);
        assert!(
            text.contains("| llama.cpp RPC, 2 processes | no figures | | | |"),
            "{text}"
        );
        assert!(
            text.contains(
                "- llama.cpp RPC, 2 processes stopped after 0 rounds: round 1: ggml-rpc-server exited"
            ),
            "{text}"
        );
        assert!(
            !text.contains("over llama.cpp RPC"),
            "no ratio against a peer without figures:\n{text}"
        );
    }

    #[test]
    fn the_credit_rows_are_divided_by_unsplit_prefill_of_the_same_prompt() {
        let long = vec![
            samples(200.0, 0.0),
            samples(150.0, 0.0),
            samples(180.0, 0.0),
            samples(190.0, 0.0),
        ];
        let text = render_long(&long);
        assert!(
            text.contains("(4 chunks of 512)"),
            "the heading names the chunks:\n{text}"
        );
        assert!(
            text.contains("| 3 processes, on loopback, reply credits 0 | 150.0 | 0.750x |"),
            "{text}"
        );
        assert!(
            text.contains("| 3 processes, on loopback, reply credits 2 | 190.0 | 0.950x |"),
            "{text}"
        );
    }

    #[test]
    fn counts_read_as_one_number_when_every_generation_agrees() {
        assert_eq!(count_range([64, 64].iter()), "64");
        assert_eq!(count_range([12, 64].iter()), "12 to 64");
        assert_eq!(count_range([].iter()), "none");
    }
}
