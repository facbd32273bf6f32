//! `cargo xtask bench runtime`: task-runtime side by side with tokio, rayon, std threads and a crossbeam pool.
//!
//! Builds `task-runtime/examples/bench_runtime.rs` in release through `$CARGO`, runs it, prints its
//! markdown table and writes it to `docs/performance/runtime.md` with the machine, kernel and commit, the
//! method as the run reported it (its `method` line: every count it used), and how much of the machine other
//! work took meanwhile (the machine's busy time less the benchmark's own CPU time).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::bench_lifecycle::{build_release_example, machine_ticks};
use crate::figures::load_average;

/// The counts the example reports on its `method` line, in the order the method paragraph uses them.
const METHOD_KEYS: [&str; 15] = [
    "workers",
    "batch",
    "batch_runs",
    "blocking_batch",
    "thread_batch",
    "hand_off_runs",
    "round_trips",
    "round_trip_warm_ups",
    "thread_round_trips",
    "thread_round_trip_warm_ups",
    "sleep_samples",
    "sleep_warm_ups",
    "idle_settle_ms",
    "idle_window_ms",
    "parked",
];

/// Milliseconds per tick of /proc/stat and /proc/self/stat (`USER_HZ`, 100 on Linux).
const MILLISECONDS_PER_TICK: f64 = 10.0;

/// What the example printed: its table, and the numbers of its `method` line.
#[derive(Debug, Clone, PartialEq)]
struct Output {
    table: String,
    method: HashMap<String, f64>,
}

/// What the report says about the machine and the run around the figures.
#[derive(Debug, Clone)]
struct Surroundings {
    commit: String,
    kernel: String,
    /// The lscpu lines that describe the CPU, one per line, indented.
    cpu: String,
    cores: usize,
    load_before: String,
    load_after: String,
    elapsed: Duration,
    /// Other work's share of all cores over the run, when /proc/stat could be read.
    other_share: Option<f64>,
}

/// Runs the runtime benchmarks; extra arguments are passed to the example.
pub fn run(arguments: &[String]) -> Result<()> {
    let root = crate::workspace_root();
    // Built first, so that the build is over before the machine's busy time is read.
    let binary = build_release_example("task-runtime", "bench_runtime")?;
    eprintln!("xtask: {}", binary.display());
    let load_before = load_average();
    let ticks_before = machine_ticks_now();
    let started = Instant::now();
    let output = Command::new(&binary)
        .current_dir(&root)
        .args(arguments)
        .output()
        .context("running the bench_runtime example")?;
    let elapsed = started.elapsed();
    let ticks_after = machine_ticks_now();
    let load_after = load_average();
    if !output.status.success() {
        bail!(
            "the bench_runtime example failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let text = String::from_utf8(output.stdout).context("the benchmark printed non-UTF-8")?;
    let output = parse_output(&text)?;
    print!("{}", output.table);
    let other_share = match (ticks_before, ticks_after) {
        (Some(before), Some(after)) => {
            other_work_share(before, after, output.method.get("cpu_ms").copied())
        }
        _ => None,
    };
    let surroundings = Surroundings {
        commit: capture(&root, "git", &["rev-parse", "--short", "HEAD"]),
        kernel: capture(&root, "uname", &["-r"]),
        cpu: cpu_lines(&capture(&root, "lscpu", &[])),
        cores: thread::available_parallelism().map_or(0, |count| count.get()),
        load_before,
        load_after,
        elapsed,
        other_share,
    };
    let report = render_report(&surroundings, &output)?;
    let path = root.join("docs/performance/runtime.md");
    fs::create_dir_all(path.parent().unwrap_or(&root)).context("creating docs/performance")?;
    fs::write(&path, report).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("xtask: wrote {}", path.display());
    Ok(())
}

/// Splits the example's output into its table and its `method key=value ...` line.
fn parse_output(text: &str) -> Result<Output> {
    let mut table = String::new();
    let mut method = None;
    for line in text.lines() {
        let Some(pairs) = line.strip_prefix("method ") else {
            table.push_str(line);
            table.push('\n');
            continue;
        };
        let mut values = HashMap::new();
        for pair in pairs.split_whitespace() {
            let Some((key, value)) = pair.split_once('=') else {
                bail!("`{pair}` in the method line `{line}` is not a key=value pair");
            };
            let number: f64 = value
                .parse()
                .with_context(|| format!("`{value}` of `{key}` in `{line}` is not a number"))?;
            values.insert(key.to_owned(), number);
        }
        method = Some(values);
    }
    let method = method.context(
        "the bench_runtime example printed no `method` line, so the report could not say how it measured",
    )?;
    Ok(Output { table, method })
}

/// Other work's share of all cores between two readings of the machine's (busy, total) ticks: the busy
/// ticks less the benchmark's own CPU time (`cpu_ms`, its children included), over all the ticks.
fn other_work_share(
    before: (u64, u64),
    after: (u64, u64),
    own_milliseconds: Option<f64>,
) -> Option<f64> {
    let busy = after.0.checked_sub(before.0)? as f64;
    let total = after.1.checked_sub(before.1)? as f64;
    let own = own_milliseconds? / MILLISECONDS_PER_TICK;
    (total > 0.0).then(|| ((busy - own) / total).clamp(0.0, 1.0))
}

/// The method paragraph, from the counts the run reported.
fn method_paragraph(method: &HashMap<String, f64>) -> Result<String> {
    let mut values = HashMap::new();
    for key in METHOD_KEYS {
        let value = method
            .get(key)
            .with_context(|| format!("the method line gives no `{key}`"))?;
        values.insert(key, thousands(*value));
    }
    let value = |key: &str| values[key].as_str();
    let workers = value("workers");
    Ok(format!(
        "Method: every runtime runs with {workers} workers in the same process at the same moment (tokio \
         multi-thread with {workers} workers and {workers} blocking threads, rayon with {workers} threads, a \
         crossbeam-channel pool of {workers} threads, task-runtime with `cores({workers})`). Closed loop. Batch \
         rows: spawn {} computes from the main thread, then join them in order; median of {} runs after one \
         warm-up run (tokio spawn_blocking {} and std threads {}, median of {} runs after one warm-up run, \
         because they cost a thread hand-off each). Round trip: one spawn and join from outside the pool, \
         median of {} after {} warm-ups (std threads: {} after {}). Sleep rows: wall time from spawn to join \
         minus the requested time, {} samples after {} warm-ups; task-runtime precise mode (its timer fires \
         early and the worker spins to the deadline) and relaxed mode. Idle CPU: /proc/self/stat utime+stime \
         over {} ms after {} ms of quiet, whole process with all runtimes idle (10 ms tick resolution). \
         Memory: a fresh child process per runtime spawns {} sleeps of 600 s, keeps every handle, and reports \
         the VmRSS growth divided by their count.",
        value("batch"),
        value("batch_runs"),
        value("blocking_batch"),
        value("thread_batch"),
        value("hand_off_runs"),
        value("round_trips"),
        value("round_trip_warm_ups"),
        value("thread_round_trips"),
        value("thread_round_trip_warm_ups"),
        value("sleep_samples"),
        value("sleep_warm_ups"),
        value("idle_window_ms"),
        value("idle_settle_ms"),
        value("parked"),
    ))
}

/// A sentence on how much of the machine other work took during the run, and what that means for the
/// figures.
fn describe_other_work(share: Option<f64>, cores: usize, own_milliseconds: Option<f64>) -> String {
    let Some(share) = share else {
        return "How busy other work kept the machine could not be measured (/proc/stat or the benchmark's \
                own CPU time could not be read); compare the ratios within one run rather than the absolute \
                figures."
            .to_owned();
    };
    let verdict = if share > 0.5 {
        "other work held more than half the machine, so the absolute figures (tail latencies especially) \
         carry its scheduling delays; compare the ratios within one run"
    } else if share > 0.1 {
        "other work took a noticeable share, so the ratios within one run are steadier than the absolute \
         figures"
    } else {
        "other work left the machine to the benchmark"
    };
    format!(
        "Other work's share of all {cores} logical cores during the run: {:.0}% (the machine's busy time in \
         /proc/stat over the run, less the benchmark's own CPU time of {:.0} ms, its children's included): \
         {verdict}.",
        share * 100.0,
        own_milliseconds.unwrap_or(f64::NAN)
    )
}

fn render_report(surroundings: &Surroundings, output: &Output) -> Result<String> {
    let mut text = String::new();
    let _ = writeln!(text, "# task-runtime performance\n");
    let _ = writeln!(
        text,
        "Command: `cargo xtask bench runtime` (release build of `task-runtime/examples/bench_runtime.rs`).\n"
    );
    let _ = writeln!(text, "- Commit: `{}`", surroundings.commit);
    let _ = writeln!(text, "- Kernel: `{}`", surroundings.kernel);
    let _ = writeln!(text, "- Machine (lscpu):\n\n{}", surroundings.cpu);
    let _ = writeln!(
        text,
        "- Load average (1, 5, 15 min) before: {}; after: {}. The run took {:.0} s.",
        surroundings.load_before,
        surroundings.load_after,
        surroundings.elapsed.as_secs_f64()
    );
    let _ = writeln!(
        text,
        "- {}\n",
        describe_other_work(
            surroundings.other_share,
            surroundings.cores,
            output.method.get("cpu_ms").copied()
        )
    );
    let _ = writeln!(text, "{}\n", method_paragraph(&output.method)?);
    let _ = writeln!(text, "{}", output.table);
    Ok(text)
}

/// The lscpu lines that describe the CPU, indented for the report.
fn cpu_lines(lscpu: &str) -> String {
    lscpu
        .lines()
        .filter(|line| {
            [
                "Architecture",
                "CPU(s):",
                "Model name",
                "Thread(s) per core",
                "L3",
            ]
            .iter()
            .any(|key| line.trim_start().starts_with(key))
        })
        .map(|line| format!("    {}\n", line.trim()))
        .collect()
}

/// The machine's (busy, total) ticks now, from /proc/stat.
fn machine_ticks_now() -> Option<(u64, u64)> {
    machine_ticks(&fs::read_to_string("/proc/stat").ok()?)
}

fn capture(root: &Path, program: &str, arguments: &[&str]) -> String {
    Command::new(program)
        .current_dir(root)
        .args(arguments)
        .output()
        .ok()
        .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// A whole count with thousands separators (100,000); anything else as it is.
fn thousands(value: f64) -> String {
    if value.fract() != 0.0 || !(0.0..1e15).contains(&value) {
        return value.to_string();
    }
    let digits = format!("{value:.0}");
    let mut text = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            text.push(',');
        }
        text.push(digit);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE_OUTPUT: &str = "\
| measurement | task-runtime | tokio | ratio (ours / tokio) | others |
|---|---|---|---|---|
| spawn + join, 100,000 computes (per task, median of 5) | 90 ns | 120 ns | 0.75 | rayon scope spawn: 60 ns |
method workers=2 batch=100000 batch_runs=5 blocking_batch=10000 thread_batch=2000 hand_off_runs=3 round_trips=2000 round_trip_warm_ups=200 thread_round_trips=200 thread_round_trip_warm_ups=20 sleep_samples=300 sleep_warm_ups=10 idle_settle_ms=1500 idle_window_ms=2000 parked=1000000 cpu_ms=41230
";

    #[test]
    fn the_method_line_is_split_from_the_table() {
        let output = parse_output(EXAMPLE_OUTPUT).expect("the example output parses");
        assert!(
            !output.table.contains("method ") && output.table.contains("| measurement |"),
            "the table should keep its rows and lose the method line: {}",
            output.table
        );
        assert_eq!(
            output.method.get("cpu_ms"),
            Some(&41_230.0),
            "the CPU time should be read from the method line"
        );
        let error = parse_output("| measurement |\n").expect_err("no method line must be an error");
        assert!(
            format!("{error:#}").contains("no `method` line"),
            "the error should say the method line is missing: {error:#}"
        );
        let error = parse_output("method batch=many\n").expect_err("a non-number must be an error");
        assert!(
            format!("{error:#}").contains("is not a number"),
            "the error should name the bad value: {error:#}"
        );
    }

    #[test]
    fn the_method_gives_the_run_counts_each_row_used() {
        let output = parse_output(EXAMPLE_OUTPUT).expect("the example output parses");
        let method = method_paragraph(&output.method).expect("every count is there");
        assert!(
            method.contains("spawn 100,000 computes")
                && method.contains("median of 5 runs after one warm-up run (tokio spawn_blocking 10,000 and std threads 2,000, median of 3 runs"),
            "the batch rows' counts should come from the method line, 3 runs for the hand-off rows: {method}"
        );
        assert!(
            method.contains("median of 2,000 after 200 warm-ups (std threads: 200 after 20)"),
            "the round trips' counts should come from the method line: {method}"
        );
        assert!(
            method.contains("over 2,000 ms after 1,500 ms of quiet"),
            "the idle window should come from the method line: {method}"
        );
        let mut short = output.method.clone();
        short.remove("hand_off_runs");
        let error = method_paragraph(&short).expect_err("a missing count must be an error");
        assert!(
            format!("{error:#}").contains("`hand_off_runs`"),
            "the error should name the missing count: {error:#}"
        );
    }

    #[test]
    fn other_work_is_the_machine_s_busy_time_less_the_benchmark_s_own() {
        // 1,000 busy ticks of 2,000, of which the benchmark's 5,000 ms are 500 ticks.
        let share = other_work_share((100, 1_000), (1_100, 3_000), Some(5_000.0))
            .expect("readings that grow give a share");
        assert!(
            (share - 0.25).abs() < 1e-9,
            "500 of 2,000 ticks are other work, got {share}"
        );
        assert_eq!(
            other_work_share((100, 1_000), (100, 1_000), Some(0.0)),
            None,
            "no ticks between the readings gives no share"
        );
        assert_eq!(
            other_work_share((100, 1_000), (1_100, 3_000), None),
            None,
            "without the benchmark's own CPU time the share is unknown"
        );
    }

    #[test]
    fn the_other_work_sentence_follows_the_measured_share() {
        assert!(
            describe_other_work(Some(0.7), 2, Some(1_000.0)).contains("more than half the machine"),
            "70% is heavy other work"
        );
        assert!(
            describe_other_work(Some(0.2), 2, Some(1_000.0)).contains("noticeable share"),
            "20% is a noticeable share"
        );
        assert!(
            describe_other_work(Some(0.02), 2, Some(1_000.0))
                .contains("left the machine to the benchmark"),
            "2% is a quiet machine"
        );
        assert!(
            describe_other_work(None, 2, None).contains("could not be measured"),
            "an unmeasured share is said to be unknown"
        );
    }

    #[test]
    fn the_report_states_the_measured_machine_and_method() {
        let output = parse_output(EXAMPLE_OUTPUT).expect("the example output parses");
        let surroundings = Surroundings {
            commit: "abc1234".to_owned(),
            kernel: "6.0".to_owned(),
            cpu: "    Model name: Test CPU\n".to_owned(),
            cores: 2,
            load_before: "0.50 0.40 0.30".to_owned(),
            load_after: "1.90 0.80 0.40".to_owned(),
            elapsed: Duration::from_secs(95),
            other_share: Some(0.05),
        };
        let report = render_report(&surroundings, &output).expect("the report renders");
        for expected in [
            "before: 0.50 0.40 0.30; after: 1.90 0.80 0.40. The run took 95 s.",
            "Other work's share of all 2 logical cores during the run: 5%",
            "own CPU time of 41230 ms",
            "median of 3 runs",
            "| spawn + join, 100,000 computes (per task, median of 5) |",
        ] {
            assert!(
                report.contains(expected),
                "the report should contain `{expected}`:\n{report}"
            );
        }
        assert!(
            !report.contains("other builds were running"),
            "the report must not assume other builds ran:\n{report}"
        );
    }
}
