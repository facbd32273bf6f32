//! What several test binaries share: a tiny model in a scratch directory, a `stage-server serve` child, and one
//! plain HTTP/1.1 exchange.
// Each test binary compiles this module and uses only part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

/// The binary under test.
pub const BINARY: &str = env!("CARGO_BIN_EXE_stage-server");
/// Generous bound for a stage process to load a model and listen on a loaded 2-core machine.
pub const START_TIMEOUT: Duration = Duration::from_secs(60);

/// A scratch directory of the test binary's process for `name`.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "stage-server-processes-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("a scratch directory in the temp dir");
    dir
}

/// `model` written to the scratch directory for `name`.
/// Asserts that `chain` serves a greedy generation of 4 tokens from `1, 300, 301` (its lanes are free down
/// the chain), saying `what` when it does not.
pub fn serves_four_tokens(chain: &mut stage_server::driver::Chain, what: &str) {
    let options = stage_server::model::GenerateOptions {
        max_tokens: 4,
        stop_tokens: Vec::new(),
        keep_logits: false,
    };
    let generation = chain
        .generate(
            &[1, 300, 301],
            stage_server::model::SamplingParams::default(),
            &options,
            |_| {},
        )
        .unwrap_or_else(|error| panic!("{what}: {error}"));
    assert_eq!(generation.tokens.len(), 4, "{what}");
}

pub fn tiny(name: &str, model: &stage_server::model::testing::TinyModel) -> PathBuf {
    model
        .write_to_dir(&scratch_dir(name))
        .expect("writing the tiny model")
}

/// One HTTP/1.1 request with `Connection: close` and a JSON body: the status and the body.
pub fn http(address: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(address).expect("the API listens");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, body)| body.to_owned());
    (status, body)
}

/// A running `stage-server serve` child, killed (SIGKILL) when dropped.
pub struct StageChild {
    child: Option<Child>,
    /// Where it serves.
    pub address: SocketAddr,
    /// Its stderr lines (drained for its whole life: a full pipe would stop it at its next log line).
    pub stderr: Receiver<String>,
}

impl StageChild {
    /// Starts a stage of `model` for `layers` and waits for its ready line.
    pub fn start(
        model: &Path,
        layers: &str,
        next: Option<SocketAddr>,
        extra: &[&str],
    ) -> StageChild {
        Self::start_on(model, layers, "127.0.0.1:0", next, extra)
    }

    pub fn start_on(
        model: &Path,
        layers: &str,
        bind: &str,
        next: Option<SocketAddr>,
        extra: &[&str],
    ) -> StageChild {
        let mut command = Command::new(BINARY);
        command
            .args(["serve", "--model"])
            .arg(model)
            .args(["--layers", layers, "--bind", bind, "--threads", "1"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(next) = next {
            command.args(["--next", &next.to_string()]);
        }
        let mut child = command.spawn().expect("spawning stage-server serve");
        let stdout = child.stdout.take().expect("piped stdout");
        let stderr = child.stderr.take().expect("piped stderr");
        let (lines, ready) = channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = lines.send(line);
        });
        let (errors, stderr_lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = errors.send(line);
            }
        });
        let line = ready.recv_timeout(START_TIMEOUT).unwrap_or_default();
        let address = line
            .trim()
            .rsplit_once(" on ")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|address| address.parse().ok())
            .unwrap_or_else(|| {
                let _ = child.kill();
                let errors: Vec<String> = stderr_lines.try_iter().collect();
                panic!("stage {layers} printed no ready line: {line:?}; stderr: {errors:?}")
            });
        assert!(
            line.contains(&format!("serving layers {layers} on")),
            "the ready line should name the layers: {line:?}"
        );
        StageChild {
            child: Some(child),
            address,
            stderr: stderr_lines,
        }
    }

    /// Sends `signal` (a number, or a name such as `STOP`) without waiting for its effect.
    pub fn signal(&self, signal: &str) {
        let pid = self.pid();
        let sent = Command::new("kill")
            .args([format!("-{signal}"), pid.to_string()])
            .status()
            .expect("running kill");
        assert!(sent.success(), "kill -{signal} {pid} failed");
    }

    /// Sends `signal` and waits (bounded) for the exit status.
    pub fn signal_and_wait(mut self, signal: i32) -> std::process::ExitStatus {
        self.signal(&signal.to_string());
        let mut child = self.child.take().expect("the child is running");
        let deadline = Instant::now() + Duration::from_secs(40);
        loop {
            if let Some(status) = child.try_wait().expect("waiting for the stage") {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("the stage did not exit within 40 s of signal {signal}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// A stage process started some other way (its stderr not kept), killed when dropped as any other.
    pub fn adopt(child: Child, address: SocketAddr) -> StageChild {
        StageChild {
            child: Some(child),
            address,
            stderr: channel().1,
        }
    }

    /// Waits up to `timeout` for a line of its stderr that holds every one of `words`, and gives it; the lines
    /// read on the way are used up.
    pub fn logged(&self, words: &[&str], timeout: Duration) -> Option<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let line = self.stderr.recv_timeout(left).ok()?;
            if words.iter().all(|word| line.contains(word)) {
                return Some(line);
            }
        }
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("the stage is running").id()
    }

    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for StageChild {
    fn drop(&mut self) {
        self.kill();
    }
}
