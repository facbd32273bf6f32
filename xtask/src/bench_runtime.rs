//! `cargo xtask bench runtime`: task-runtime side by side with tokio, rayon, std threads and a crossbeam pool.
//!
//! Builds and runs `task-runtime/examples/bench_runtime.rs` in release through `$CARGO`, prints its
//! markdown table and writes it, with the machine, kernel, commit and method, to
//! `docs/performance/runtime.md`.

use std::env;
use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result, bail};

/// Runs the runtime benchmarks; extra arguments are passed to the example.
pub fn run(arguments: &[String]) -> Result<()> {
    let root = crate::workspace_root();
    let program = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!("xtask: cargo run --release -p task-runtime --example bench_runtime");
    let output = Command::new(program)
        .current_dir(&root)
        .args([
            "run",
            "--quiet",
            "--release",
            "-p",
            "task-runtime",
            "--example",
            "bench_runtime",
            "--",
        ])
        .args(arguments)
        .output()
        .context("running the bench_runtime example")?;
    if !output.status.success() {
        bail!(
            "the bench_runtime example failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let table = String::from_utf8(output.stdout).context("the benchmark printed non-UTF-8")?;
    print!("{table}");
    let report = report(&root, &table);
    let path = root.join("docs/performance/runtime.md");
    std::fs::create_dir_all(path.parent().unwrap_or(&root)).context("creating docs/performance")?;
    std::fs::write(&path, report).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("xtask: wrote {}", path.display());
    Ok(())
}

fn report(root: &Path, table: &str) -> String {
    let capture = |program: &str, arguments: &[&str]| -> String {
        Command::new(program)
            .current_dir(root)
            .args(arguments)
            .output()
            .ok()
            .map(|output| String::from_utf8_lossy(&output.stdout).trim().to_string())
            .unwrap_or_else(|| "unknown".into())
    };
    let machine: String = capture("lscpu", &[])
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
        .collect();
    let mut text = String::new();
    let _ = writeln!(text, "# task-runtime performance\n");
    let _ = writeln!(
        text,
        "Command: `cargo xtask bench runtime` (release build of `task-runtime/examples/bench_runtime.rs`).\n"
    );
    let _ = writeln!(
        text,
        "- Commit: `{}`",
        capture("git", &["rev-parse", "--short", "HEAD"])
    );
    let _ = writeln!(text, "- Kernel: `{}`", capture("uname", &["-r"]));
    let _ = writeln!(text, "- Machine (lscpu):\n\n{machine}");
    let _ = writeln!(
        text,
        "Method: every runtime runs with 2 workers in the same process at the same moment (tokio \
         multi-thread with 2 workers and 2 blocking threads, rayon with 2 threads, a crossbeam-channel \
         pool of 2 threads, task-runtime with `cores(2)`). Closed loop. Batch rows: spawn 100,000 \
         computes from the main thread, then join them in order; median of 5 runs after one warm-up \
         (tokio spawn_blocking 10,000 and std threads 2,000, because they cost a thread hand-off each). \
         Round trip: one spawn and join from outside the pool, median of 2,000 after 200 warm-ups. \
         Sleep rows: wall time from spawn to join minus the requested time, 300 samples after 10 \
         warm-ups; task-runtime precise mode (timer fires 150 us early, the worker spins the rest) \
         and relaxed mode. Idle CPU: /proc/self/stat utime+stime over 2 s after 1.5 s of quiet, \
         whole process with all runtimes idle (10 ms tick resolution). Memory: a fresh child process \
         per runtime spawns 1,000,000 sleeps of 600 s, keeps every handle, and reports the VmRSS \
         growth divided by 1,000,000.\n"
    );
    let _ = writeln!(
        text,
        "Caveat: the machine is a shared 2-core VM on which other builds were running, so absolute \
         figures are noisy (tail latencies especially); compare the ratios within one run.\n"
    );
    let _ = writeln!(text, "{table}");
    text
}
