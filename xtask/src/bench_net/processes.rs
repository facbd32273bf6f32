//! The benchmark's child processes: building the examples, starting servers and clients, reading their lines, stopping them.

use std::collections::HashMap;
use std::env;
use std::fs;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use super::ServerKind;

/// The longest any child may take to print an expected line.
pub(super) const LINE_TIMEOUT: Duration = Duration::from_secs(60);

/// A child process with its stdout lines arriving on a channel.
#[derive(Debug)]
pub(super) struct Running {
    pub(super) child: Child,
    pub(super) stdin: Option<ChildStdin>,
    pub(super) lines: Receiver<String>,
    pub(super) what: String,
    /// The address a server printed; empty for clients.
    pub(super) address: String,
}

/// Paths of the two built examples.
#[derive(Debug)]
pub(super) struct Binaries {
    pub(super) server: PathBuf,
    pub(super) client: PathBuf,
}

/// Builds both examples once in release mode and returns their paths.
pub(super) fn build_examples() -> Result<Binaries> {
    let program = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let arguments = [
        "build",
        "--release",
        "-p",
        "net-io-blocking",
        "--example",
        "bench_server",
        "--example",
        "bench_client",
    ];
    eprintln!("xtask: cargo {}", arguments.join(" "));
    let status = Command::new(program)
        .args(arguments)
        .current_dir(workspace_root())
        .status()
        .context("could not start cargo to build the benchmark examples")?;
    if !status.success() {
        bail!("building the benchmark examples failed with {status}");
    }
    let target = env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|path| {
            if path.is_absolute() {
                path
            } else {
                workspace_root().join(path)
            }
        })
        .unwrap_or_else(|| workspace_root().join("target"));
    let examples = target.join("release").join("examples");
    let binaries = Binaries {
        server: examples.join("bench_server"),
        client: examples.join("bench_client"),
    };
    for path in [&binaries.server, &binaries.client] {
        if !path.exists() {
            bail!(
                "{} is missing after the build; is CARGO_TARGET_DIR the same for xtask and cargo?",
                path.display()
            );
        }
    }
    Ok(binaries)
}

/// The workspace this run belongs to, found at run time by asking cargo from the current directory.
///
/// `crate::workspace_root` is fixed when xtask is compiled; with a target directory shared between two
/// checkouts of the same sources, cargo reuses a binary built in the other checkout, and the benchmark
/// would then build, measure and write the report there.
pub(super) fn workspace_root() -> PathBuf {
    static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    ROOT.get_or_init(|| {
        let program = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        Command::new(program)
            .args(["locate-project", "--workspace", "--message-format", "plain"])
            .output()
            .ok()
            .filter(|output| output.status.success())
            .and_then(|output| {
                let manifest = PathBuf::from(String::from_utf8_lossy(&output.stdout).trim());
                manifest.parent().map(PathBuf::from)
            })
            .unwrap_or_else(crate::workspace_root)
    })
    .clone()
}

/// Raises this process's soft `RLIMIT_NOFILE` (children inherit it) with `prlimit` when it is below `needed`.
pub(super) fn raise_descriptor_limit(needed: u64) -> Result<()> {
    let limits = fs::read_to_string("/proc/self/limits").unwrap_or_default();
    let Some((soft, hard)) = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .and_then(|line| {
            let mut numbers = line
                .split_whitespace()
                .filter_map(|word| word.parse::<u64>().ok());
            Some((numbers.next()?, numbers.next()?))
        })
    else {
        return Ok(());
    };
    if soft >= needed {
        return Ok(());
    }
    let target = needed.min(hard.max(needed));
    let status = Command::new("prlimit")
        .arg("--pid")
        .arg(std::process::id().to_string())
        .arg(format!("--nofile={target}:{}", hard.max(target)))
        .status();
    match status {
        Ok(status) if status.success() => Ok(()),
        _ => bail!(
            "the descriptor limit is {soft} but the idle test needs {needed}; run `ulimit -n {needed}` first"
        ),
    }
}

/// Starts a server with its default settings.
pub(super) fn start_server(binaries: &Binaries, kind: ServerKind) -> Result<Running> {
    start_server_with(binaries, kind, &[])
}

/// Starts a server with extra arguments and reads the `listening on ADDR` line it prints once bound.
pub(super) fn start_server_with(
    binaries: &Binaries,
    kind: ServerKind,
    arguments: &[&str],
) -> Result<Running> {
    let mut server = spawn(
        Command::new(&binaries.server)
            .args(["--kind", kind.name, "--addr", "127.0.0.1:0"])
            .args(arguments),
        &format!("bench_server --kind {}", kind.name),
        true,
    )?;
    let line = expect_line(&server, |line| line.starts_with("listening on "))?;
    server.address = line.trim_start_matches("listening on ").trim().to_owned();
    Ok(server)
}

/// Starts a child with its stdout read line by line on a thread; `keep_stdin` gives it a pipe to close later.
pub(super) fn spawn(command: &mut Command, what: &str, keep_stdin: bool) -> Result<Running> {
    let mut child = command
        .stdin(if keep_stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("could not start {what}"))?;
    let stdout = child
        .stdout
        .take()
        .context("the child has no stdout pipe")?;
    let stdin = child.stdin.take();
    let (sender, lines) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if sender.send(line).is_err() {
                return;
            }
        }
    });
    Ok(Running {
        child,
        stdin,
        lines,
        what: what.to_owned(),
        address: String::new(),
    })
}

/// Waits for the first stdout line that `wanted` accepts, skipping others.
pub(super) fn expect_line(running: &Running, wanted: impl Fn(&str) -> bool) -> Result<String> {
    let deadline = Instant::now() + LINE_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match running.lines.recv_timeout(left) {
            Ok(line) if wanted(&line) => return Ok(line),
            Ok(_) => continue,
            Err(RecvTimeoutError::Timeout) => {
                bail!(
                    "{} printed no expected line within {LINE_TIMEOUT:?}",
                    running.what
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                bail!("{} ended before printing the expected line", running.what)
            }
        }
    }
}

/// Waits for a client to exit on its own and checks it succeeded.
pub(super) fn finish(mut running: Running) -> Result<()> {
    drop(running.stdin.take());
    let status = wait_with_deadline(&mut running.child, LINE_TIMEOUT)?;
    if !status.success() {
        bail!("{} failed with {status}", running.what);
    }
    Ok(())
}

/// Asks a server to stop by closing its stdin (killing it, by its own pid, if it has not exited in 10 s) and
/// returns the count from its `served connections=N` line.
pub(super) fn stop(mut running: Running) -> Result<Option<u64>> {
    drop(running.stdin.take());
    let status = wait_with_deadline(&mut running.child, Duration::from_secs(10))?;
    if !status.success() {
        bail!("{} exited with {status} when asked to stop", running.what);
    }
    let served = running
        .lines
        .try_iter()
        .chain(running.lines.recv_timeout(Duration::from_secs(1)))
        .find_map(|line| {
            line.strip_prefix("served connections=")
                .and_then(|count| count.trim().parse().ok())
        });
    Ok(served)
}

pub(super) fn wait_with_deadline(
    child: &mut Child,
    timeout: Duration,
) -> Result<std::process::ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let status = child.wait()?;
            bail!(
                "process {} did not exit within {timeout:?}; killed it ({status})",
                child.id()
            );
        }
        thread::sleep(Duration::from_millis(20));
    }
}

pub(super) fn command_output(program: &str, arguments: &[&str]) -> Option<String> {
    let output = Command::new(program)
        .args(arguments)
        .current_dir(workspace_root())
        .output()
        .ok()?;
    output
        .status
        .success()
        .then(|| String::from_utf8_lossy(&output.stdout).trim().to_owned())
}

/// Splits `word key=value key=value` into a map.
pub(super) fn fields(line: &str) -> HashMap<String, String> {
    line.split_whitespace()
        .filter_map(|word| word.split_once('='))
        .map(|(key, value)| (key.to_owned(), value.to_owned()))
        .collect()
}

pub(super) fn number(fields: &HashMap<String, String>, key: &str) -> Result<f64> {
    fields
        .get(key)
        .and_then(|value| value.parse().ok())
        .with_context(|| format!("the client printed no number for `{key}`"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_result_lines_split_into_numbers() {
        let parsed = fields("echo connections=16 rt_per_s=1234 p50_us=9.5");
        assert_eq!(
            number(&parsed, "rt_per_s").unwrap(),
            1234.0,
            "rt_per_s was not parsed"
        );
        assert_eq!(
            number(&parsed, "p50_us").unwrap(),
            9.5,
            "p50_us was not parsed"
        );
        assert!(
            number(&parsed, "p99_us").is_err(),
            "a missing key must be an error"
        );
    }
}
