//! `cargo xtask bench lifecycle`: kill, door, drain and idle-CPU figures of every net-io-blocking driver against net-io's targets.
//!
//! The benchmark builds the `bench_lifecycle` example of `net-io-blocking` once in release mode, then runs
//! each (driver, load) pair as a fresh process, several rounds, with the drivers' order rotated each round:
//!
//! ```text
//!   xtask ──spawn──> bench_lifecycle --kind K --load kill|door|drain|shutdown|idle [--control]
//!                      │ server in-process (ServerBuilder), clients on threads or in a child process
//!                      └──> prints `result kind=K load=L key=value ...`
//! ```
//!
//! The report gives the median of the rounds for every figure, the spread of the headline figure, and for
//! each of net-io's lifecycle targets whether the median met it: B-11 / NFR-19 (kill to RST under 1 ms
//! p99), NFR-20 (`close_door` under 1 ms p99), B-12 (drain of 10,000 idle connections under 100 ms) and
//! NFR-4 / B-6 (no CPU and no wake-up while connections idle, without and with a control line). Beside them
//! it measures `Server::shutdown`'s abortive drain and, for the kill, a std thread-per-connection yardstick.

use std::collections::HashMap;
use std::env;
use std::fmt::Write as _;
use std::fs;
use std::io::Read as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::figures::{PairedRatios, Spread, load_average, median};

const USAGE: &str = "\
usage: cargo xtask bench lifecycle [--quick] [--rounds N] [--kinds handler,handler-loop,sessions,sessions-loop,std]
                                   [--loads kill,door,drain,shutdown,idle,idle-control] [--output PATH | --no-write]

  --quick        one round with small counts, for a smoke test (does not write the report unless --output is
                 given)
  --rounds N     rounds of every (driver, load) pair, order rotated each round; medians are reported
                 (default 3)
  --kinds LIST   drivers to measure (default: all four, and std, a thread-per-connection yardstick that
                 runs the kill load only)
  --loads LIST   loads to measure (default: all six; shutdown is the drain of Server::shutdown, whose
                 idle closes are abortive, beside the graceful drain; idle-control is the idle load with
                 a control line set)
  --output PATH  where to write the markdown report (default docs/performance/lifecycle.md)
  --no-write     print the report only
";

/// The longest one measurement process may run before it is killed and the run fails.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// The target of B-11 / NFR-19 and of NFR-20, in microseconds (1 ms at the 99th percentile).
const LATENCY_TARGET_MICROSECONDS: f64 = 1_000.0;

/// The target of B-12: a drain of this many idle connections ...
const DRAIN_TARGET_CONNECTIONS: f64 = 10_000.0;

/// ... in under this many milliseconds.
const DRAIN_TARGET_MILLISECONDS: f64 = 100.0;

/// A driver the benchmark can measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Driver {
    /// The `--kind` value of `bench_lifecycle`.
    name: &'static str,
    /// How the report names it.
    label: &'static str,
    /// The loads it runs.
    loads: &'static [&'static str],
}

const DRIVERS: [Driver; 5] = [
    Driver {
        name: "handler",
        label: "handler, worker threads",
        loads: &LOADS,
    },
    Driver {
        name: "handler-loop",
        label: "handler, coroutines on event loops",
        loads: &LOADS,
    },
    Driver {
        name: "sessions",
        label: "sessions, worker threads",
        loads: &LOADS,
    },
    Driver {
        name: "sessions-loop",
        label: "sessions, event loops",
        loads: &LOADS,
    },
    // A yardstick, not a driver: what a kill costs a plain thread per connection on this machine right now.
    Driver {
        name: "std",
        label: "std thread per connection (yardstick)",
        loads: &["kill"],
    },
];

/// The loads, by their `--load` name, in the order a round measures them.
const LOADS: [&str; 6] = ["kill", "door", "drain", "shutdown", "idle", "idle-control"];

/// Idle connections of the `idle-control` load when no `--count` is given: its question is whether a tick
/// runs, which does not depend on the count, and fewer connections keep the run short.
const IDLE_CONTROL_CONNECTIONS: u32 = 1_000;

/// Options of one run.
#[derive(Debug, Clone)]
struct Options {
    rounds: usize,
    drivers: Vec<Driver>,
    loads: Vec<&'static str>,
    /// `--count` passed to every run of a load, when set (the quick run's small counts).
    counts: HashMap<&'static str, u32>,
    output: Option<PathBuf>,
}

/// One result line: its driver, its load and its numeric fields.
#[derive(Debug, Clone, PartialEq)]
struct Measurement {
    kind: String,
    load: String,
    figures: HashMap<String, f64>,
}

impl Measurement {
    /// A figure, or NaN when the line did not carry it (so that it can never read as a measured zero).
    fn figure(&self, key: &str) -> f64 {
        self.figures.get(key).copied().unwrap_or(f64::NAN)
    }
}

/// Whether a median met its target.
#[derive(Debug, Clone, PartialEq)]
enum Verdict {
    Met,
    Missed,
    /// Not measured as the target states it (too few connections, or no figure), with the reason.
    NotComparable(String),
}

impl Verdict {
    fn text(&self) -> String {
        match self {
            Verdict::Met => "met".to_owned(),
            Verdict::Missed => "**missed**".to_owned(),
            Verdict::NotComparable(reason) => format!("not comparable: {reason}"),
        }
    }
}

/// What one run measured, and how busy the machine was meanwhile.
#[derive(Debug, Default)]
struct Run {
    /// measurements[(driver name, load)] = one per round.
    measurements: HashMap<(String, String), Vec<Measurement>>,
    /// The 1-minute load average at the start of each measurement.
    load_samples: Vec<f64>,
    /// The machine's busy CPU share in a pause before each load of each round, with no benchmark process
    /// running: the other work on the machine.
    busy_samples: Vec<f64>,
}

/// The pause before each load of each round in which the other work on the machine is read.
const QUIET_WINDOW: Duration = Duration::from_millis(500);

/// Runs the benchmark with the command-line `arguments` after `bench lifecycle`.
pub fn run(arguments: &[String]) -> Result<()> {
    let options = parse_options(arguments)?;
    let binary = build_release_example("net-io-blocking", "bench_lifecycle")?;
    let load_before = load_average();
    let started = Instant::now();
    let mut run = Run::default();
    for round in 0..options.rounds {
        for load in &options.loads {
            run.busy_samples.extend(busy_share_over(QUIET_WINDOW));
            for offset in 0..options.drivers.len() {
                let driver = options.drivers[(round + offset) % options.drivers.len()];
                if !driver.loads.contains(load) {
                    continue;
                }
                eprintln!(
                    "xtask: round {}/{}: {} {}",
                    round + 1,
                    options.rounds,
                    driver.name,
                    load
                );
                run.load_samples.extend(one_minute_load());
                let measurement = measure(&binary, driver, load, options.counts.get(load))
                    .with_context(|| {
                        format!("measuring {} {load} in round {}", driver.name, round + 1)
                    })?;
                run.measurements
                    .entry((driver.name.to_owned(), (*load).to_owned()))
                    .or_default()
                    .push(measurement);
            }
        }
    }
    let report = render_report(
        &options,
        &run,
        &Machine::describe(),
        &load_before,
        &load_average(),
        started.elapsed(),
        arguments,
    );
    println!("{report}");
    if let Some(path) = &options.output {
        let path = if path.is_absolute() {
            path.clone()
        } else {
            crate::workspace_root().join(path)
        };
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)
                .with_context(|| format!("could not create {}", parent.display()))?;
        }
        fs::write(&path, &report).with_context(|| format!("could not write {}", path.display()))?;
        eprintln!("xtask: wrote {}", path.display());
    }
    Ok(())
}

fn parse_options(arguments: &[String]) -> Result<Options> {
    let mut options = Options {
        rounds: 3,
        drivers: DRIVERS.to_vec(),
        loads: LOADS.to_vec(),
        counts: HashMap::new(),
        output: Some(PathBuf::from("docs/performance/lifecycle.md")),
    };
    let mut quick = false;
    let mut output_given = false;
    let mut no_write = false;
    let mut iterator = arguments.iter();
    while let Some(flag) = iterator.next() {
        let mut value = || {
            iterator
                .next()
                .with_context(|| format!("{flag} needs a value\n{USAGE}"))
        };
        match flag.as_str() {
            "--quick" => quick = true,
            "--rounds" => {
                let text = value()?;
                options.rounds = match text.parse::<usize>() {
                    Ok(rounds) if rounds > 0 => rounds,
                    _ => bail!("--rounds takes a positive whole number, not `{text}`"),
                };
            }
            "--kinds" => {
                let mut drivers = Vec::new();
                for name in value()?.split(',').map(str::trim) {
                    let Some(driver) = DRIVERS.iter().find(|driver| driver.name == name) else {
                        bail!(
                            "unknown driver `{name}` in --kinds; the drivers are handler, handler-loop, sessions, sessions-loop, std"
                        );
                    };
                    if !drivers.contains(driver) {
                        drivers.push(*driver);
                    }
                }
                options.drivers = drivers;
            }
            "--loads" => {
                let mut loads = Vec::new();
                for name in value()?.split(',').map(str::trim) {
                    let Some(load) = LOADS.iter().find(|load| **load == name) else {
                        bail!(
                            "unknown load `{name}` in --loads; the loads are kill, door, drain, shutdown, idle, idle-control"
                        );
                    };
                    if !loads.contains(load) {
                        loads.push(*load);
                    }
                }
                // Keep the report's order whatever order the list gave.
                loads.sort_by_key(|load| LOADS.iter().position(|known| known == load));
                options.loads = loads;
            }
            "--output" => {
                options.output = Some(PathBuf::from(value()?));
                output_given = true;
            }
            "--no-write" => no_write = true,
            "--help" | "-h" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag `{other}`\n{USAGE}"),
        }
    }
    if quick {
        options.rounds = 1;
        options.counts = HashMap::from([
            ("kill", 200),
            ("door", 30),
            ("drain", 1_000),
            ("shutdown", 1_000),
            ("idle", 1_000),
            ("idle-control", 1_000),
        ]);
        if !output_given {
            options.output = None;
        }
    }
    if no_write {
        options.output = None;
    }
    Ok(options)
}

/// Builds `example` of `package` once in release mode and returns its path (the runtime benchmark runs its
/// example the same way, so that no build shares the machine with the measurement).
pub(crate) fn build_release_example(package: &str, example: &str) -> Result<PathBuf> {
    let arguments = ["build", "--release", "-p", package, "--example", example];
    crate::cargo(&arguments).with_context(|| format!("building the {example} example failed"))?;
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|path| {
            if path.is_absolute() {
                path
            } else {
                crate::workspace_root().join(path)
            }
        })
        .unwrap_or_else(|| crate::workspace_root().join("target"));
    let binary = target.join("release").join("examples").join(example);
    if !binary.exists() {
        bail!(
            "{} is missing after the build; is CARGO_TARGET_DIR the same for xtask and cargo?",
            binary.display()
        );
    }
    Ok(binary)
}

/// Runs one (driver, load) process and parses its result line.
fn measure(
    binary: &PathBuf,
    driver: Driver,
    load: &str,
    count: Option<&u32>,
) -> Result<Measurement> {
    let mut command = Command::new(binary);
    // `idle-control` is the idle load with a control line set.
    let example_load = if load == "idle-control" { "idle" } else { load };
    command.args(["--kind", driver.name, "--load", example_load]);
    if load == "idle-control" {
        command.arg("--control");
    }
    let count = count
        .copied()
        .or((load == "idle-control").then_some(IDLE_CONTROL_CONNECTIONS));
    if let Some(count) = count {
        command.args(["--count", &count.to_string()]);
    }
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("could not start {}", binary.display()))?;
    let deadline = Instant::now() + RUN_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "bench_lifecycle --kind {} --load {load} ran over {} s and was killed",
                driver.name,
                RUN_TIMEOUT.as_secs()
            );
        }
        thread::sleep(Duration::from_millis(20));
    };
    let mut output = String::new();
    if let Some(mut stdout) = child.stdout.take() {
        stdout.read_to_string(&mut output)?;
    }
    if !status.success() {
        bail!(
            "bench_lifecycle --kind {} --load {load} failed with {status}",
            driver.name
        );
    }
    let line = output
        .lines()
        .find(|line| line.starts_with("result "))
        .with_context(|| format!("no result line in the output:\n{output}"))?;
    eprintln!("xtask:   {line}");
    let measurement = parse_result_line(line)?;
    if measurement.kind != driver.name || measurement.load != example_load {
        bail!(
            "asked for kind {} and load {example_load}, but the result line says kind {} and load {}",
            driver.name,
            measurement.kind,
            measurement.load
        );
    }
    Ok(measurement)
}

/// Parses `result kind=K load=L key=value ...`; every value but the kind and the load must be a number
/// (`nan` included, for a figure with no samples).
fn parse_result_line(line: &str) -> Result<Measurement> {
    let mut words = line.split_whitespace();
    if words.next() != Some("result") {
        bail!("`{line}` is not a result line: it should start with `result`");
    }
    let (mut kind, mut load) = (None, None);
    let mut figures = HashMap::new();
    for word in words {
        let Some((key, value)) = word.split_once('=') else {
            bail!("`{word}` in `{line}` is not a key=value pair");
        };
        match key {
            "kind" => kind = Some(value.to_owned()),
            "load" => load = Some(value.to_owned()),
            _ => {
                let number: f64 = value
                    .parse()
                    .with_context(|| format!("`{value}` of `{key}` in `{line}` is not a number"))?;
                figures.insert(key.to_owned(), number);
            }
        }
    }
    Ok(Measurement {
        kind: kind.with_context(|| format!("`{line}` has no kind"))?,
        load: load.with_context(|| format!("`{line}` has no load"))?,
        figures,
    })
}

/// Whether `value` is under `target`; NaN is not comparable.
fn verdict_below(value: f64, target: f64) -> Verdict {
    if value.is_nan() {
        Verdict::NotComparable("no figure".to_owned())
    } else if value < target {
        Verdict::Met
    } else {
        Verdict::Missed
    }
}

/// B-12: a drain of 10,000 idle connections under 100 ms. Fewer connections are not the target's shape, and
/// a drain's time grows with the connections, so a smaller run is reported but not judged.
fn drain_verdict(connections: f64, milliseconds: f64) -> Verdict {
    if connections.is_nan() || connections < DRAIN_TARGET_CONNECTIONS {
        return Verdict::NotComparable(format!(
            "{} connections, not 10,000",
            if connections.is_nan() {
                "no count of".to_owned()
            } else {
                format!("{connections:.0}")
            }
        ));
    }
    verdict_below(milliseconds, DRAIN_TARGET_MILLISECONDS)
}

/// NFR-4 / B-6: zero idle CPU with no periodic tick. Met only when no server thread ran at all in the window.
fn idle_verdict(cpu_microseconds: f64, switches: f64) -> Verdict {
    if cpu_microseconds.is_nan() || switches.is_nan() {
        Verdict::NotComparable("no figure".to_owned())
    } else if cpu_microseconds == 0.0 && switches == 0.0 {
        Verdict::Met
    } else {
        Verdict::Missed
    }
}

/// The median of one figure over the rounds of one (driver, load).
fn median_of(measurements: &[Measurement], key: &str) -> f64 {
    let values: Vec<f64> = measurements
        .iter()
        .map(|measurement| measurement.figure(key))
        .filter(|value| !value.is_nan())
        .collect();
    median(&values)
}

/// The sum of one figure over the rounds (outcome counts such as timeouts).
fn sum_of(measurements: &[Measurement], key: &str) -> f64 {
    measurements
        .iter()
        .map(|measurement| measurement.figure(key))
        .filter(|value| !value.is_nan())
        .sum()
}

/// The median over rounds of `key` divided by the yardstick's `key` of the same round, as `1.23x`.
fn ratio_to_yardstick(rounds: &[Measurement], yardstick: &[Measurement], key: &str) -> String {
    let series = |measurements: &[Measurement]| -> Vec<f64> {
        measurements
            .iter()
            .map(|measurement| measurement.figure(key))
            .collect()
    };
    let ratios = PairedRatios::new(&series(rounds), &series(yardstick));
    if ratios.median.is_nan() {
        "no yardstick".to_owned()
    } else {
        format!("{:.2}x", ratios.median)
    }
}

/// The spread of one figure over the rounds, as `lowest to highest`.
fn spread_of(measurements: &[Measurement], key: &str, decimals: usize) -> String {
    let values: Vec<f64> = measurements
        .iter()
        .map(|measurement| measurement.figure(key))
        .filter(|value| !value.is_nan())
        .collect();
    let spread = Spread::of(&values);
    format!(
        "{:.decimals$} to {:.decimals$}",
        spread.lowest, spread.highest
    )
}

/// What the report says about the machine.
#[derive(Debug, Clone)]
struct Machine {
    cpu: String,
    cores: usize,
    kernel: String,
    commit: String,
}

impl Machine {
    fn describe() -> Machine {
        let cpu = command_output("lscpu", &[])
            .and_then(|text| {
                text.lines()
                    .find(|line| line.starts_with("Model name:"))
                    .map(|line| line.trim_start_matches("Model name:").trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".to_owned());
        let dirty = command_output("git", &["status", "--porcelain", "--untracked-files=no"])
            .is_some_and(|text| !text.is_empty());
        let commit = command_output("git", &["rev-parse", "--short", "HEAD"])
            .map(|commit| {
                if dirty {
                    format!("{commit} (with uncommitted changes)")
                } else {
                    commit
                }
            })
            .unwrap_or_else(|| "unknown".to_owned());
        Machine {
            cpu,
            cores: thread::available_parallelism().map_or(0, |count| count.get()),
            kernel: command_output("uname", &["-r"]).unwrap_or_else(|| "unknown".to_owned()),
            commit,
        }
    }
}

/// Renders the markdown report.
fn render_report(
    options: &Options,
    run: &Run,
    machine: &Machine,
    load_before: &str,
    load_after: &str,
    elapsed: Duration,
    arguments: &[String],
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# net-io-blocking lifecycle: kill, door, drain and idle CPU against net-io's targets\n"
    );
    let _ = writeln!(
        out,
        "Produced by `cargo xtask bench lifecycle{}{}`; every figure is the median of {} round{} (one fresh \
         process per driver, load and round; drivers in an order rotated each round).\n",
        if arguments.is_empty() { "" } else { " " },
        arguments.join(" "),
        options.rounds,
        if options.rounds == 1 { "" } else { "s" },
    );
    let _ = writeln!(out, "## Machine\n");
    let _ = writeln!(
        out,
        "- CPU: {}, {} logical cores",
        machine.cpu, machine.cores
    );
    let _ = writeln!(out, "- Kernel: {}", machine.kernel);
    let _ = writeln!(out, "- Commit: {}", machine.commit);
    let _ = writeln!(
        out,
        "- Load average (1, 5, 15 min) before: {load_before}; after: {load_after}. Run took {:.0} s.",
        elapsed.as_secs_f64()
    );
    let _ = writeln!(out, "- {}", describe_load(&run.load_samples, machine.cores));
    let _ = writeln!(out, "- {}", describe_busy(&run.busy_samples));
    let _ = writeln!(
        out,
        "- {}\n",
        describe_descriptor_limits(descriptor_limits(run))
    );

    let _ = writeln!(out, "## Targets\n");
    let _ = writeln!(
        out,
        "| Driver | Kill to RST, p99 under 1 ms (B-11, NFR-19) | `close_door`, p99 under 1 ms (NFR-20) | Drain of 10,000 idle under 100 ms (B-12) | Zero idle CPU, no tick (NFR-4, B-6) | The same with a control line set |"
    );
    let _ = writeln!(out, "|---|---|---|---|---|---|");
    for driver in &options.drivers {
        let rounds = |load: &str| {
            run.measurements
                .get(&(driver.name.to_owned(), load.to_owned()))
                .map(Vec::as_slice)
                .unwrap_or(&[])
        };
        let cell = |load: &str, verdict: Verdict, figure: String| {
            if !driver.loads.contains(&load) {
                "not applicable".to_owned()
            } else if options.loads.contains(&load) {
                format!("{} ({figure})", verdict.text())
            } else {
                "not run".to_owned()
            }
        };
        let kill = rounds("kill");
        let door = rounds("door");
        let drain = rounds("drain");
        let idle = rounds("idle");
        let kill_p99 = median_of(kill, "p99_us");
        let door_p99 = median_of(door, "p99_us");
        let drain_connections = median_of(drain, "n");
        let drain_ms = median_of(drain, "drain_ms");
        let idle_cpu = median_of(idle, "cpu_us");
        let idle_switches = median_of(idle, "switches");
        let idle_control = rounds("idle-control");
        let control_cpu = median_of(idle_control, "cpu_us");
        let control_switches = median_of(idle_control, "switches");
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            driver.label,
            cell(
                "kill",
                verdict_below(kill_p99, LATENCY_TARGET_MICROSECONDS),
                format!("{kill_p99:.0} µs")
            ),
            cell(
                "door",
                verdict_below(door_p99, LATENCY_TARGET_MICROSECONDS),
                format!("{door_p99:.0} µs")
            ),
            cell(
                "drain",
                drain_verdict(drain_connections, drain_ms),
                format!("{drain_ms:.0} ms at {drain_connections:.0}")
            ),
            cell(
                "idle",
                idle_verdict(idle_cpu, idle_switches),
                format!("{idle_cpu:.0} µs CPU, {idle_switches:.0} switches in the window")
            ),
            cell(
                "idle-control",
                idle_verdict(control_cpu, control_switches),
                format!("{control_cpu:.0} µs CPU, {control_switches:.0} switches in the window")
            ),
        );
    }
    let _ = writeln!(out);

    let table =
        |out: &mut String, load: &str, header: &str, row: &dyn Fn(&[Measurement]) -> String| {
            if !options.loads.contains(&load) {
                return;
            }
            let _ = writeln!(out, "{header}");
            for driver in &options.drivers {
                let Some(rounds) = run
                    .measurements
                    .get(&(driver.name.to_owned(), load.to_owned()))
                else {
                    continue;
                };
                let _ = writeln!(out, "| {} | {} |", driver.label, row(rounds));
            }
            let _ = writeln!(out);
        };

    if options.loads.contains(&"kill") {
        let _ = writeln!(out, "## Kill\n\n{KILL_METHOD}\n");
    }
    let yardstick_kills = run
        .measurements
        .get(&("std".to_owned(), "kill".to_owned()))
        .map_or(&[][..], Vec::as_slice);
    table(
        &mut out,
        "kill",
        "| Driver | Kills | p50 (µs) | p99 (µs) | p99 range over rounds | p99 over std's, same round (median) | max (µs) | `kill` call p99 (µs) | Ended by RST / FIN / timeout / other |\n|---|---:|---:|---:|---|---:|---:|---:|---|",
        &|rounds| {
            format!(
                "{:.0} | {:.1} | {:.1} | {} | {} | {:.0} | {:.1} | {:.0} / {:.0} / {:.0} / {:.0}",
                median_of(rounds, "n"),
                median_of(rounds, "p50_us"),
                median_of(rounds, "p99_us"),
                spread_of(rounds, "p99_us", 1),
                ratio_to_yardstick(rounds, yardstick_kills, "p99_us"),
                median_of(rounds, "max_us"),
                median_of(rounds, "call_p99_us"),
                sum_of(rounds, "reset"),
                sum_of(rounds, "eof"),
                sum_of(rounds, "timeout"),
                sum_of(rounds, "other"),
            )
        },
    );
    if options.loads.contains(&"door") {
        let pause =
            median_over_drivers(run, &DRIVERS.map(|driver| driver.name), "door", "pause_us");
        let _ = writeln!(out, "## Door\n\n{}\n", door_method(pause));
    }
    table(
        &mut out,
        "door",
        "| Driver | Samples | p50 (µs) | p99 (µs) | p99 range over rounds | max (µs) | `close_door` call p99 (µs) | Admitted 10 to 15 ms after | Reopen failed | Mean gap between connects (µs) |\n|---|---:|---:|---:|---|---:|---:|---:|---:|---:|",
        &|rounds| {
            format!(
                "{:.0} | {:.1} | {:.1} | {} | {:.0} | {:.1} | {:.0} | {:.0} | {:.0}",
                median_of(rounds, "n"),
                median_of(rounds, "p50_us"),
                median_of(rounds, "p99_us"),
                spread_of(rounds, "p99_us", 1),
                median_of(rounds, "max_us"),
                median_of(rounds, "call_p99_us"),
                sum_of(rounds, "late"),
                sum_of(rounds, "reopen_failed"),
                median_of(rounds, "arrival_gap_us"),
            )
        },
    );
    if options.loads.contains(&"drain") {
        let threaded = median_over_drivers(run, &["handler", "sessions"], "drain", "n");
        let limit = descriptor_limits(run).map(|(lowest, _)| lowest);
        let _ = writeln!(out, "## Drain\n\n{}\n", drain_method(limit, threaded));
    }
    table(
        &mut out,
        "drain",
        "| Driver | Idle connections | Drain report (ms) | Range over rounds (ms) | Per connection (µs) | Last client saw its close (ms) | Graceful / killed | Clients: FIN / RST / never closed |\n|---|---:|---:|---|---:|---:|---|---|",
        &|rounds| {
            let connections = median_of(rounds, "n");
            let milliseconds = median_of(rounds, "drain_ms");
            format!(
                "{connections:.0} | {milliseconds:.1} | {} | {:.1} | {:.1} | {:.0} / {:.0} | {:.0} / {:.0} / {:.0}",
                spread_of(rounds, "drain_ms", 1),
                milliseconds * 1e3 / connections,
                median_of(rounds, "client_last_ms"),
                median_of(rounds, "graceful"),
                median_of(rounds, "killed"),
                sum_of(rounds, "eof"),
                sum_of(rounds, "reset"),
                sum_of(rounds, "unclosed"),
            )
        },
    );
    if options.loads.contains(&"shutdown") {
        let _ = writeln!(out, "## Shutdown\n\n{SHUTDOWN_METHOD}\n");
    }
    table(
        &mut out,
        "shutdown",
        "| Driver | Idle connections | Drain report (ms) | Range over rounds (ms) | Per connection (µs) | `shutdown` returned (ms) | Last client saw its close (ms) | Clients: FIN / RST / never closed |\n|---|---:|---:|---|---:|---:|---:|---|",
        &|rounds| {
            let connections = median_of(rounds, "n");
            let milliseconds = median_of(rounds, "drain_ms");
            format!(
                "{connections:.0} | {milliseconds:.1} | {} | {:.1} | {:.1} | {:.1} | {:.0} / {:.0} / {:.0}",
                spread_of(rounds, "drain_ms", 1),
                milliseconds * 1e3 / connections,
                median_of(rounds, "call_ms"),
                median_of(rounds, "client_last_ms"),
                sum_of(rounds, "eof"),
                sum_of(rounds, "reset"),
                sum_of(rounds, "unclosed"),
            )
        },
    );
    if options.loads.contains(&"idle") {
        let _ = writeln!(out, "## Idle CPU\n\n{IDLE_METHOD}\n");
    }
    table(
        &mut out,
        "idle",
        "| Driver | Idle connections | Server threads | Window (ms) | CPU in the window (µs) | Context switches | Threads woken | CPU since start (ms) |\n|---|---:|---:|---:|---:|---:|---:|---:|",
        &|rounds| {
            format!(
                "{:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0} | {:.1}",
                median_of(rounds, "n"),
                median_of(rounds, "threads"),
                median_of(rounds, "window_ms"),
                median_of(rounds, "cpu_us"),
                median_of(rounds, "switches"),
                median_of(rounds, "woken_threads"),
                median_of(rounds, "lifetime_cpu_ms"),
            )
        },
    );
    if options.loads.contains(&"idle-control") {
        let _ = writeln!(
            out,
            "## Idle CPU with a control line\n\n{IDLE_CONTROL_METHOD}\n"
        );
    }
    table(
        &mut out,
        "idle-control",
        "| Driver | Idle connections | Server threads | Window (ms) | CPU in the window (µs) | Context switches | Threads woken | CPU since start (ms) |\n|---|---:|---:|---:|---:|---:|---:|---:|",
        &|rounds| {
            format!(
                "{:.0} | {:.0} | {:.0} | {:.1} | {:.0} | {:.0} | {:.1}",
                median_of(rounds, "n"),
                median_of(rounds, "threads"),
                median_of(rounds, "window_ms"),
                median_of(rounds, "cpu_us"),
                median_of(rounds, "switches"),
                median_of(rounds, "woken_threads"),
                median_of(rounds, "lifetime_cpu_ms"),
            )
        },
    );
    out
}

const KILL_METHOD: &str = "Method: connections one after the other (the Kills column gives how many per round). The client \
connects with a std `TcpStream`, sends one byte and reads the 8-byte connection id the server answers with; the \
benchmark then calls `ServerHandle::kill(id, 7)` and the client's blocking `read` waits for the result. The time \
runs from just before the `kill` call to the `read`'s return, so it is the kill-to-RST time plus the client's \
wake-up: an upper bound on the time to the RST on the wire. `Killed(code)` is an abortive reason, so the server \
closes with linger 0: an RST, which the client sees as `ECONNRESET` (the column counts any FIN, timeout over 2 s \
or other error apart). The std row is a yardstick measured in the same run: a std thread per connection, killed \
as any blocking server must kill from another thread (`shutdown(SHUT_RD)` on a clone of the socket wakes the \
thread's `read`, which then closes with linger 0). Its tail shows what the machine's scheduling alone adds.";

const SHUTDOWN_METHOD: &str = "Method: as for the drain, but through `Server::shutdown(now + 5 s)`. Its idle closes carry \
`Shutdown`, an abortive reason: an RST at once and no linger, so the clients see `ECONNRESET` and nothing waits \
for their FIN. Set beside the drain it shows what the graceful close costs. \"Drain report\" is the report's \
`elapsed`; \"`shutdown` returned\" adds stopping the accept threads and joining every worker or loop thread. Not \
a net-io target; for reference only.";

const IDLE_METHOD: &str = "Method: the same child process opens the idle connections (the table gives how many) with one \
round trip each; 200 ms after the server counts them all open, the benchmark sums, over every server thread (all \
but the main thread, which only sleeps and reads /proc), the CPU time from `/proc/self/task/*/schedstat` (in \
nanoseconds) and the voluntary plus involuntary context switches from `/proc/self/task/*/status`, at the start \
and the end of a window (the table gives its length). The idle timeout is 10 minutes, so no deadline falls in \
the window; any CPU or switch there is a periodic tick or a stray wake-up. \"CPU since start\" shows that the \
reading works.";

const IDLE_CONTROL_METHOD: &str = "Method: as for the idle CPU, with fewer idle connections by default (the table gives how \
many; the question is whether a tick runs, which does not depend on the count) and a `ControlLine` given to \
`ServerBuilder::control`. Nothing polls the line: each `ControlLine::set` wakes the accept threads that watch it, \
and the benchmark never sets it, so no wake-up is expected in the window, as without the line.";

/// Descriptors one worker-thread connection needs in the server process: its socket and the two its worker
/// thread holds.
const DESCRIPTORS_PER_THREADED_CONNECTION: f64 = 3.0;

/// The door's method, with the pause between connects the runs reported (`pause_us`), if they did.
fn door_method(pause_microseconds: Option<f64>) -> String {
    let pause = match pause_microseconds {
        Some(pause) if pause > 0.0 => format!("pausing {pause:.0} µs after each connect"),
        Some(_) => "connecting flat out, with no pause".to_owned(),
        None => {
            "pausing `--pause-us` after each connect (the runs did not report how long)".to_owned()
        }
    };
    format!(
        "Method: `close_door` does not close the listening socket (its documentation: the listeners stay \
         bound and new connections wait in the kernel backlog), so no connect is ever *refused* by the kernel \
         after it; the connect completes and waits. The benchmark therefore measures when the server stops \
         *admitting*: a client thread connects and resets (`SO_LINGER` 0), {pause} (the mean gap, the \
         connect's own time included, is in the table), a gate records the time of each admission on the \
         accept thread, and a sample is the time from the `close_door` call to the last admission after it \
         (0 when none came after the call). The Samples column gives the samples per round; between samples \
         the door is opened again and the sample waits for a new admission, which checks that the door \
         accepts again. \"Admitted 10 to 15 ms after\" counts admissions long after a close (should be 0). \
         A pause keeps the client thread from taking a whole core from the accept thread on a small machine; \
         `bench_lifecycle --load door --pause-us 0` connects flat out. The accept thread checks the door \
         before each `accept4` of a batch, so a close that lands inside a batch leaves the rest of it in the \
         backlog; only an accept already under way when `close_door` is called can still admit."
    )
}

/// The drain's method, with the descriptor limit the runs reported and the connections the worker-thread
/// drivers drained (the median over their rounds), when they ran.
fn drain_method(descriptor_limit: Option<f64>, threaded_connections: Option<f64>) -> String {
    let limit = descriptor_limit.map_or_else(
        || "a limit the runs did not report".to_owned(),
        show_descriptor_limit,
    );
    let mut text = format!(
        "Method: a child process (so that client and server each have the whole descriptor limit, {limit} in \
         this run, the soft limit raised to the hard one) opens the idle connections one after the other, each \
         with one round trip so that it is served, and registers them with its own epoll. The benchmark then \
         writes `go` to the child and calls `drain(now + 5 s)`. \"Drain report\" is the `DrainReport`'s \
         `elapsed` (until the server's open count is 0); the child's clock starts when it reads `go` and stops \
         when the last of its connections saw its close (it reads the FIN and closes the socket, as a client \
         would, which ends the server's graceful linger), so that column includes the client's own work on \
         the same machine."
    );
    if let Some(connections) = threaded_connections {
        let needed = DRAIN_TARGET_CONNECTIONS * DESCRIPTORS_PER_THREADED_CONNECTION;
        let fits = match descriptor_limit {
            Some(limit) if limit < needed => format!(
                ", over this run's limit of {}",
                show_descriptor_limit(limit)
            ),
            Some(limit) => format!(
                ", within this run's limit of {} (the smaller count keeps runs comparable across machines)",
                show_descriptor_limit(limit)
            ),
            None => String::new(),
        };
        let judged = if connections < DRAIN_TARGET_CONNECTIONS {
            "their figure is therefore not judged against B-12"
        } else {
            "at 10,000 their figure is judged against B-12 like the others"
        };
        let _ = write!(
            text,
            " The worker-thread drivers drained {} connections: each connection holds a worker \
             thread and each worker two descriptors besides its socket, so 10,000 of them would need about \
             {} descriptors in one process{fits}; {judged}.",
            with_separators(connections),
            with_separators(needed)
        );
    }
    text
}

/// The descriptor limit every result line reported (`descriptor_limit`), lowest and highest.
fn descriptor_limits(run: &Run) -> Option<(f64, f64)> {
    let limits: Vec<f64> = run
        .measurements
        .values()
        .flatten()
        .map(|measurement| measurement.figure("descriptor_limit"))
        .filter(|limit| !limit.is_nan())
        .collect();
    let spread = Spread::of(&limits);
    (!limits.is_empty()).then_some((spread.lowest, spread.highest))
}

/// A sentence on the descriptor limit the measuring processes ran under.
fn describe_descriptor_limits(limits: Option<(f64, f64)>) -> String {
    match limits {
        None => "The measuring processes did not report their descriptor limit.".to_owned(),
        Some((lowest, highest)) if lowest == highest => format!(
            "Descriptor limit of every measuring process, its soft limit raised to the hard one: {}.",
            show_descriptor_limit(lowest)
        ),
        Some((lowest, highest)) => format!(
            "Descriptor limit of the measuring processes, each soft limit raised to the hard one: from {} to {}.",
            show_descriptor_limit(lowest),
            show_descriptor_limit(highest)
        ),
    }
}

/// A descriptor limit as the report writes it: `RLIM_INFINITY` (reported as `u64::MAX`) is "unlimited".
fn show_descriptor_limit(limit: f64) -> String {
    if limit >= u64::MAX as f64 {
        "unlimited".to_owned()
    } else {
        with_separators(limit)
    }
}

/// A whole number with thousands separators, as the report writes counts (30,000).
fn with_separators(value: f64) -> String {
    let digits = format!("{value:.0}");
    let mut text = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && digit.is_ascii_digit() && (digits.len() - index).is_multiple_of(3) {
            text.push(',');
        }
        text.push(digit);
    }
    text
}

/// The median over the rounds of one figure of every given driver's load, when any of them ran it.
fn median_over_drivers(run: &Run, drivers: &[&str], load: &str, key: &str) -> Option<f64> {
    let values: Vec<f64> = drivers
        .iter()
        .filter_map(|driver| {
            run.measurements
                .get(&((*driver).to_owned(), load.to_owned()))
        })
        .flatten()
        .map(|measurement| measurement.figure(key))
        .filter(|value| !value.is_nan())
        .collect();
    (!values.is_empty()).then(|| median(&values))
}

/// A sentence giving the 1-minute load average at the start of each measurement.
fn describe_load(samples: &[f64], cores: usize) -> String {
    if samples.is_empty() {
        return "The load average could not be read during the run.".to_owned();
    }
    let spread = Spread::of(samples);
    format!(
        "1-minute load average at the start of each of the {} measurements: lowest {:.2}, median {:.2}, \
         highest {:.2} on {cores} logical cores. It counts the benchmark's own threads too (the worker-thread \
         drivers make thousands of threads runnable at once when their server stops), so read the busy share \
         below for the other work.",
        samples.len(),
        spread.lowest,
        spread.median,
        spread.highest
    )
}

/// A sentence saying how busy other work kept the machine, from the busy shares of the quiet pauses.
fn describe_busy(samples: &[f64]) -> String {
    if samples.is_empty() {
        return "The machine's busy share could not be read from /proc/stat.".to_owned();
    }
    let spread = Spread::of(samples);
    // A pause with no benchmark process running sees only the other work, and a sample is the share of
    // all cores that work kept busy.
    let verdict = if spread.median > 0.5 {
        "other work held more than half the machine during most measurements, so tail figures carry scheduling delays that a quiet machine would not show"
    } else if spread.highest > 0.5 {
        "other work held more than half the machine at times; compare the ranges over rounds"
    } else {
        "other work left most of the machine to the benchmark"
    };
    format!(
        "Other work's share of all cores, read from /proc/stat in a {} ms pause before each load of each \
         round (no benchmark process running): lowest {:.0}%, median {:.0}%, highest {:.0}%: {verdict}.",
        QUIET_WINDOW.as_millis(),
        spread.lowest * 100.0,
        spread.median * 100.0,
        spread.highest * 100.0
    )
}

/// The busy and total ticks of the whole machine from the text of `/proc/stat` (its `cpu` line: user,
/// nice, system, idle, iowait, irq, softirq, steal; idle and iowait are not busy). Steal counts as busy:
/// on a virtual machine it is time another guest took from these cores.
pub(crate) fn machine_ticks(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|line| line.starts_with("cpu "))?;
    let values: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|word| word.parse().ok())
        .collect::<Option<_>>()?;
    if values.len() < 8 {
        return None;
    }
    let total: u64 = values.iter().sum();
    let idle = values[3] + values[4];
    Some((total - idle, total))
}

/// The machine's busy share over `window`, sleeping meanwhile.
fn busy_share_over(window: Duration) -> Option<f64> {
    let before = machine_ticks(&fs::read_to_string("/proc/stat").ok()?)?;
    thread::sleep(window);
    let after = machine_ticks(&fs::read_to_string("/proc/stat").ok()?)?;
    let total = after.1.checked_sub(before.1)?;
    let busy = after.0.checked_sub(before.0)?;
    (total > 0).then(|| busy as f64 / total as f64)
}

/// The 1-minute load average from `/proc/loadavg`.
fn one_minute_load() -> Option<f64> {
    fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

fn command_output(program: &str, arguments: &[&str]) -> Option<String> {
    let output = Command::new(program)
        .args(arguments)
        .current_dir(crate::workspace_root())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_result_line_gives_its_kind_load_and_numbers() {
        let measurement = parse_result_line(
            "result kind=sessions-loop load=kill n=2000 p50_us=20.1 p99_us=31.6 max_us=nan",
        )
        .expect("a well-formed line should parse");
        assert_eq!(
            measurement.kind, "sessions-loop",
            "the kind is taken as text"
        );
        assert_eq!(measurement.load, "kill", "the load is taken as text");
        assert_eq!(measurement.figure("n"), 2000.0, "n should be 2000");
        assert_eq!(measurement.figure("p99_us"), 31.6, "p99_us should be 31.6");
        assert!(
            measurement.figure("max_us").is_nan(),
            "a `nan` figure stays NaN so it cannot pass for a measurement"
        );
        assert!(
            measurement.figure("absent").is_nan(),
            "a missing figure must read as NaN, not 0"
        );
    }

    #[test]
    fn malformed_result_lines_are_errors_that_name_the_problem() {
        let cases = [
            ("served connections=3", "should start with `result`"),
            ("result kind=handler load=kill n", "is not a key=value pair"),
            ("result kind=handler load=kill n=many", "is not a number"),
            ("result load=kill n=1", "has no kind"),
            ("result kind=handler n=1", "has no load"),
        ];
        for (line, expected) in cases {
            let error = parse_result_line(line).expect_err("a malformed line must not parse");
            assert!(
                format!("{error:#}").contains(expected),
                "the error for `{line}` should say `{expected}`, got `{error:#}`"
            );
        }
    }

    #[test]
    fn latency_verdicts_are_met_only_strictly_under_the_target() {
        assert_eq!(
            verdict_below(999.9, 1_000.0),
            Verdict::Met,
            "under 1 ms meets"
        );
        assert_eq!(
            verdict_below(1_000.0, 1_000.0),
            Verdict::Missed,
            "exactly 1 ms is not under it"
        );
        assert!(
            matches!(verdict_below(f64::NAN, 1_000.0), Verdict::NotComparable(_)),
            "no figure must not be judged"
        );
    }

    #[test]
    fn a_drain_is_judged_only_at_ten_thousand_connections() {
        assert_eq!(
            drain_verdict(10_000.0, 80.0),
            Verdict::Met,
            "80 ms at 10,000 meets"
        );
        assert_eq!(
            drain_verdict(10_000.0, 350.0),
            Verdict::Missed,
            "350 ms at 10,000 misses"
        );
        let Verdict::NotComparable(reason) = drain_verdict(5_000.0, 50.0) else {
            panic!("a drain of 5,000 must not be judged against a target for 10,000");
        };
        assert!(
            reason.contains("5000"),
            "the reason should give the count: {reason}"
        );
        assert!(
            matches!(drain_verdict(f64::NAN, 50.0), Verdict::NotComparable(_)),
            "no count must not be judged"
        );
    }

    #[test]
    fn idle_is_met_only_with_no_cpu_and_no_switch() {
        assert_eq!(idle_verdict(0.0, 0.0), Verdict::Met, "nothing ran: met");
        assert_eq!(idle_verdict(12.0, 0.0), Verdict::Missed, "some CPU misses");
        assert_eq!(idle_verdict(0.0, 3.0), Verdict::Missed, "a wake-up misses");
        assert!(
            matches!(idle_verdict(f64::NAN, 0.0), Verdict::NotComparable(_)),
            "no figure must not be judged"
        );
    }

    #[test]
    fn machine_ticks_count_idle_and_iowait_as_not_busy() {
        let stat = "cpu  100 5 50 800 20 3 7 15 0 0\ncpu0 50 2 25 400 10 1 3 7 0 0\n";
        assert_eq!(
            machine_ticks(stat),
            Some((180, 1_000)),
            "busy is user+nice+system+irq+softirq+steal = 180 of 1000 ticks"
        );
        assert_eq!(
            machine_ticks("cpu0 1 2 3\n"),
            None,
            "no `cpu` line gives nothing"
        );
        assert_eq!(
            machine_ticks("cpu  1 2 3\n"),
            None,
            "a short line gives nothing"
        );
    }

    #[test]
    fn the_busy_share_verdict_names_heavy_other_work() {
        assert!(
            describe_busy(&[0.7, 0.8, 0.6]).contains("more than half the machine during most"),
            "a median over half is heavy other work"
        );
        assert!(
            describe_busy(&[0.1, 0.9, 0.2]).contains("at times"),
            "a single busy pause is named as such"
        );
        assert!(
            describe_busy(&[0.1, 0.2]).contains("left most of the machine"),
            "a quiet machine is called quiet"
        );
    }

    #[test]
    fn the_report_gives_medians_and_verdicts_per_driver() {
        let line = |text: &str| parse_result_line(text).expect("test lines parse");
        let mut run = Run::default();
        run.measurements.insert(
            ("sessions-loop".to_owned(), "kill".to_owned()),
            vec![
                line("result kind=sessions-loop load=kill n=2000 p50_us=20 p99_us=30 max_us=90 call_p99_us=8 reset=2000 eof=0 timeout=0 other=0 descriptor_limit=20000"),
                line("result kind=sessions-loop load=kill n=2000 p50_us=22 p99_us=1500 max_us=2000 call_p99_us=9 reset=2000 eof=0 timeout=0 other=0"),
                line("result kind=sessions-loop load=kill n=2000 p50_us=21 p99_us=40 max_us=95 call_p99_us=8 reset=1999 eof=1 timeout=0 other=0"),
            ],
        );
        run.measurements.insert(
            ("sessions-loop".to_owned(), "drain".to_owned()),
            vec![line(
                "result kind=sessions-loop load=drain n=10000 drain_ms=350 client_last_ms=400 graceful=10000 killed=0 eof=10000 reset=0 unclosed=0",
            )],
        );
        run.measurements.insert(
            ("std".to_owned(), "kill".to_owned()),
            vec![line(
                "result kind=std load=kill n=2000 p50_us=15 p99_us=60 max_us=900 call_p99_us=20 reset=2000 eof=0 timeout=0 other=0",
            )],
        );
        let options = Options {
            rounds: 3,
            drivers: vec![DRIVERS[3], DRIVERS[4]],
            loads: vec!["kill", "drain"],
            counts: HashMap::new(),
            output: None,
        };
        let machine = Machine {
            cpu: "Test CPU".to_owned(),
            cores: 2,
            kernel: "6.0".to_owned(),
            commit: "abc1234".to_owned(),
        };
        let report = render_report(
            &options,
            &run,
            &machine,
            "1 1 1",
            "2 2 2",
            Duration::from_secs(9),
            &[],
        );
        assert!(
            report.contains("| sessions, event loops | met (40 µs) | not run | **missed** (350 ms at 10000) | not run | not run |"),
            "the targets row should judge the median p99 (40 µs) and the drain:\n{report}"
        );
        assert!(
            report.contains(
                "| std thread per connection (yardstick) | met (60 µs) | not applicable | not applicable | not applicable | not applicable |"
            ),
            "the yardstick is judged on the kill only:\n{report}"
        );
        assert!(
            report.contains("| 2000 | 21.0 | 40.0 | 30.0 to 1500.0 | 0.50x |"),
            "the kill row should give medians and the p99 range:\n{report}"
        );
        assert!(
            report.contains("5999 / 1 / 0 / 0"),
            "the kill outcomes should be summed over the rounds:\n{report}"
        );
        assert!(
            report.contains("Test CPU, 2 logical cores"),
            "the machine is named:\n{report}"
        );
        assert!(
            !report.contains("## Door"),
            "a load not run has no section:\n{report}"
        );
        assert!(
            report.contains(
                "Descriptor limit of every measuring process, its soft limit raised to the hard one: 20,000."
            ),
            "the machine section should give the descriptor limit the runs reported:\n{report}"
        );
        assert!(
            report.contains("the whole descriptor limit, 20,000 in this run"),
            "the drain method should give the run's descriptor limit:\n{report}"
        );
        assert!(
            !report.contains("this machine") && !report.contains("polls it"),
            "the report should state no fixed machine fact and no control-line poll:\n{report}"
        );
    }

    #[test]
    fn the_control_line_method_says_nothing_polls_the_line() {
        let options = Options {
            rounds: 1,
            drivers: vec![DRIVERS[3]],
            loads: vec!["idle-control"],
            counts: HashMap::new(),
            output: None,
        };
        let machine = Machine {
            cpu: "Test CPU".to_owned(),
            cores: 2,
            kernel: "6.0".to_owned(),
            commit: "abc1234".to_owned(),
        };
        let report = render_report(
            &options,
            &Run::default(),
            &machine,
            "1 1 1",
            "1 1 1",
            Duration::from_secs(1),
            &[],
        );
        assert!(
            report.contains("Nothing polls the line") && !report.contains("every 100 ms"),
            "a control-line change wakes the accept threads; the method must not describe a poll:\n{report}"
        );
    }

    #[test]
    fn the_drain_method_sets_the_worker_thread_count_beside_the_run_s_descriptor_limit() {
        let tight = drain_method(Some(20_000.0), Some(5_000.0));
        assert!(
            tight.contains("drained 5,000 connections")
                && tight.contains("over this run's limit of 20,000")
                && tight.contains("not judged against B-12"),
            "under a 20,000 limit, 30,000 descriptors are over it and 5,000 are not judged: {tight}"
        );
        let roomy = drain_method(Some(1_048_576.0), Some(5_000.0));
        assert!(
            roomy.contains("within this run's limit of 1,048,576"),
            "under a limit of a million, 30,000 descriptors fit: {roomy}"
        );
        let judged = drain_method(Some(1_048_576.0), Some(10_000.0));
        assert!(
            judged.contains("judged against B-12 like the others"),
            "10,000 worker-thread connections are judged: {judged}"
        );
        let unlimited = drain_method(Some(u64::MAX as f64), None);
        assert!(
            unlimited.contains("the whole descriptor limit, unlimited in this run")
                && !unlimited.contains("worker-thread drivers"),
            "no limit reads as unlimited, and with no worker-thread run there is no sentence on it: {unlimited}"
        );
        assert!(
            drain_method(None, Some(5_000.0)).contains("a limit the runs did not report"),
            "an unreported limit is said to be unknown"
        );
    }

    #[test]
    fn the_door_method_gives_the_pause_the_runs_reported() {
        assert!(
            door_method(Some(100.0)).contains("pausing 100 µs after each connect"),
            "a reported pause of 100 µs should be named"
        );
        assert!(
            door_method(Some(0.0)).contains("connecting flat out"),
            "a zero pause connects flat out"
        );
        assert!(
            door_method(None).contains("did not report"),
            "an unreported pause is said to be unknown"
        );
        assert!(
            door_method(Some(100.0)).contains("checks the door before each `accept4`"),
            "the door is checked before each accept, not once per batch"
        );
    }

    #[test]
    fn the_descriptor_limit_sentence_follows_what_the_runs_reported() {
        let line = |text: &str| parse_result_line(text).expect("test lines parse");
        let mut run = Run::default();
        assert_eq!(
            describe_descriptor_limits(descriptor_limits(&run)),
            "The measuring processes did not report their descriptor limit.",
            "no run, no limit"
        );
        run.measurements.insert(
            ("handler".to_owned(), "kill".to_owned()),
            vec![
                line("result kind=handler load=kill n=1 descriptor_limit=20000"),
                line("result kind=handler load=kill n=1 descriptor_limit=65536"),
            ],
        );
        assert!(
            describe_descriptor_limits(descriptor_limits(&run)).contains("from 20,000 to 65,536"),
            "differing limits should be given as a range"
        );
    }
}
