//! The llama.cpp rows of `cargo xtask bench pipeline`: `llama-server` whole, and `llama-server` with every layer
//! on two `ggml-rpc-server` processes on loopback, each timed by the server's own `timings`.
//!
//! ```text
//!   whole:  xtask ──POST /completion──▶ llama-server (all layers, -t 2)
//!
//!   RPC:    xtask ──POST /completion──▶ llama-server (embeddings, sampling; -ngl 99 -ts A,B)
//!                                          ├──RPC──▶ ggml-rpc-server 1 (-t 2): blocks 0..A
//!                                          └──RPC──▶ ggml-rpc-server 2 (-t 2): blocks A.., output layer
//! ```
//!
//! Every process starts fresh for its round, as our stage processes do, and the timed request is the first
//! one the server answers (its own warm-up pass at load is not timed). The request is non-streaming with
//! `cache_prompt: false`, so the whole prompt is evaluated; the rates are llama-server's
//! `timings.prompt_per_second` and `timings.predicted_per_second`, which counts the decode steps after the
//! first token (that one comes from the prompt's last batch), as our decode rate does.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

use super::{Timed, shown};
use crate::bench_serve::client::{self, Progress, ResponseDecoder};

/// How llama.cpp runs the model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Peer {
    /// One `llama-server` computing every layer.
    Whole,
    /// `llama-server` offloading every layer to [`RPC_SERVERS`] `ggml-rpc-server` processes.
    Rpc,
}

/// The llama.cpp rows, in the order each round runs them.
pub(crate) const PEERS: [Peer; 2] = [Peer::Whole, Peer::Rpc];

/// The `ggml-rpc-server` processes of the split run: two, as our 2-process layout.
pub(crate) const RPC_SERVERS: usize = 2;
/// llama-server's context (one slot): the 512-token prompt and its 65 tokens fit with room to spare.
pub(crate) const CONTEXT: &str = "4096";
/// How long llama-server may take to load (and, split, to send every layer to the RPC servers).
const READY_TIMEOUT: Duration = Duration::from_secs(180);
/// How long an RPC server may take to listen.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a process may take to exit after SIGINT before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the timed request may take (gemma3's prompt through RPC is the slowest case).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(600);
/// The largest response accepted: a completion of 65 tokens with its settings is a few kilobytes.
const RESPONSE_LIMIT: usize = 1 << 20;
/// llama-server's log verbosity: 4 (trace) is the lowest that lets libllama's load messages through (it
/// logs them at its info level, which llama.cpp's common log maps to trace), so the report can show where
/// the layers went. At this level the server adds lines per request, not per token (its per-token lines
/// are debug, level 5).
pub(crate) const LOG_VERBOSITY: &str = "4";
/// What the lines of llama-server's log worth quoting contain: its CPU build (`system_info`: threads, and
/// whether its threads are OpenMP's), and where the weights, the KV cache and the compute went.
const PLACEMENT_MARKERS: [&str; 8] = [
    "system_info",
    "using device",
    "offloaded",
    "model buffer size",
    "KV buffer size",
    "compute buffer size",
    "graph splits",
    "pipeline parallelism",
];
/// Lines of a log shown when a process fails.
const LOG_TAIL_LINES: usize = 15;

/// What one llama.cpp row needs.
pub(crate) struct Inputs<'a> {
    /// `target/llama-ref/server-build/bin`, holding `llama-server` and `ggml-rpc-server`.
    pub(crate) binary_dir: &'a Path,
    pub(crate) model: &'a Path,
    pub(crate) prompt: &'a [u64],
    /// Tokens to predict, the first one included.
    pub(crate) max_tokens: usize,
    pub(crate) threads: &'a str,
    /// The model's `block_count`: the split puts the first half of the blocks on the first RPC server.
    pub(crate) blocks: usize,
    /// Where the processes' logs go.
    pub(crate) log_dir: &'a Path,
}

/// A child process with its log file, interrupted (then killed) when dropped.
struct Process {
    child: Child,
    log: PathBuf,
    name: &'static str,
}

impl Peer {
    pub(crate) fn label(self) -> String {
        match self {
            Peer::Whole => "llama.cpp whole".to_owned(),
            Peer::Rpc => format!("llama.cpp RPC, {RPC_SERVERS} processes"),
        }
    }

    fn slug(self) -> &'static str {
        match self {
            Peer::Whole => "whole",
            Peer::Rpc => "rpc",
        }
    }
}

impl Process {
    fn spawn(command: &mut Command, log: PathBuf, name: &'static str) -> Result<Process> {
        let output =
            File::create(&log).with_context(|| format!("could not create {}", log.display()))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(output.try_clone()?)
            .stderr(output)
            .spawn()
            .with_context(|| format!("could not start {name}"))?;
        Ok(Process { child, log, name })
    }

    /// An error naming the process and the end of its log if it has exited.
    fn check_running(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "{} exited with {status}; the end of {}:\n{}",
                self.name,
                self.log.display(),
                log_tail(&self.log)
            );
        }
        Ok(())
    }
}

impl Drop for Process {
    /// SIGINT first so llama-server can close its RPC connections; kill if it lingers.
    fn drop(&mut self) {
        let interrupted = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|status| status.success());
        let deadline = Instant::now() + STOP_TIMEOUT;
        while interrupted && Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The proportions `-ts` gets so that the first RPC server holds blocks `0..blocks/2` (our 2-process
/// boundary) and the second the rest with the output layer: llama.cpp spreads `blocks + 1` layers (the
/// output layer counts as one) over the devices by these proportions, in `--rpc` order.
pub(crate) fn tensor_split(blocks: usize) -> (usize, usize) {
    let first = blocks / 2;
    (first, blocks + 1 - first)
}

/// `llama-server --version`'s version line, for the report.
pub(crate) fn version(binary_dir: &Path) -> String {
    Command::new(binary_dir.join("llama-server"))
        .arg("--version")
        .output()
        .ok()
        .and_then(|output| {
            let text = String::from_utf8_lossy(&output.stdout).into_owned()
                + &String::from_utf8_lossy(&output.stderr);
            text.lines()
                .find(|line| line.starts_with("version:"))
                .map(|line| line.trim().to_owned())
        })
        .unwrap_or_else(|| "version: unknown (llama-server --version printed none)".to_owned())
}

/// Runs one timed request on `peer`, in processes started for it and stopped after it.
pub(crate) fn run(inputs: &Inputs<'_>, peer: Peer) -> Result<Timed> {
    fs::create_dir_all(inputs.log_dir)
        .with_context(|| format!("could not create {}", inputs.log_dir.display()))?;
    let mut commands = Vec::new();
    // Declared before the server, so they are dropped after it: llama-server lets go of them first.
    let mut rpc_servers = Vec::new();
    let mut server_command = Command::new(inputs.binary_dir.join("llama-server"));
    let address = free_address()?;
    server_command
        .arg("-m")
        .arg(inputs.model)
        .args(["--host", "127.0.0.1", "--port", &address.port().to_string()])
        .args([
            "-np",
            "1",
            "-c",
            CONTEXT,
            "-t",
            inputs.threads,
            "--fit",
            "off",
            "-lv",
            LOG_VERBOSITY,
        ]);
    if peer == Peer::Rpc {
        let mut endpoints = Vec::new();
        for index in 0..RPC_SERVERS {
            let endpoint = free_address()?;
            let mut command = Command::new(inputs.binary_dir.join("ggml-rpc-server"));
            command.args([
                "-H",
                "127.0.0.1",
                "-p",
                &endpoint.port().to_string(),
                "-t",
                inputs.threads,
            ]);
            commands.push(shown(&command));
            let log = inputs.log_dir.join(format!("llama-rpc-server-{index}.log"));
            let mut process = Process::spawn(&mut command, log, "ggml-rpc-server")?;
            wait_listening(&mut process, endpoint)?;
            rpc_servers.push(process);
            endpoints.push(endpoint.to_string());
        }
        let (first, second) = tensor_split(inputs.blocks);
        server_command.args([
            "--rpc",
            &endpoints.join(","),
            "-ngl",
            "99",
            "-ts",
            &format!("{first},{second}"),
        ]);
    }
    commands.push(shown(&server_command));
    let log = inputs
        .log_dir
        .join(format!("llama-server-{}.log", peer.slug()));
    let mut server = Process::spawn(&mut server_command, log, "llama-server")?;
    wait_healthy(&mut server, &mut rpc_servers, address)?;
    let body = serde_json::json!({
        "prompt": inputs.prompt,
        "n_predict": inputs.max_tokens,
        "temperature": 0.0,
        "cache_prompt": false,
        "ignore_eos": true,
        "stream": false,
    });
    let mut shown_body = body.clone();
    shown_body["prompt"] = format!("<{} ids>", inputs.prompt.len()).into();
    commands.push(format!("POST /completion {shown_body}"));
    let (status, reply) = post_json(address, "/completion", &body.to_string())?;
    let text = String::from_utf8_lossy(&reply);
    ensure!(
        status == 200,
        "llama-server answered POST /completion with {status}: {}",
        text.trim()
    );
    let reply: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("llama-server answered with no JSON: {text}"))?;
    let timings = &reply["timings"];
    let number = |key: &str| {
        timings[key]
            .as_f64()
            .with_context(|| format!("llama-server's timings have no {key}: {timings}"))
    };
    let timed = Timed {
        prefill: number("prompt_per_second")?,
        decode: number("predicted_per_second")?,
        prompt_tokens: number("prompt_n")? as usize,
        // Its rate counts the steps after the first token, as ours does.
        decode_steps: (number("predicted_n")? as usize).saturating_sub(1),
        commands,
        notes: placement_lines(&fs::read_to_string(&server.log).unwrap_or_default()),
    };
    drop(server);
    drop(rpc_servers);
    Ok(timed)
}

/// Waits until an RPC server accepts a connection. It serves one client at a time and takes a closed
/// connection as a client that left, so the probe is gone before llama-server connects.
fn wait_listening(process: &mut Process, endpoint: SocketAddr) -> Result<()> {
    let deadline = Instant::now() + LISTEN_TIMEOUT;
    while Instant::now() < deadline {
        process.check_running()?;
        if TcpStream::connect_timeout(&endpoint, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        thread::sleep(Duration::from_millis(100));
    }
    bail!(
        "ggml-rpc-server did not listen on {endpoint} within {} s; the end of {}:\n{}",
        LISTEN_TIMEOUT.as_secs(),
        process.log.display(),
        log_tail(&process.log)
    )
}

/// Waits until llama-server answers `GET /health` with 200, failing early if it or an RPC server exits.
fn wait_healthy(
    server: &mut Process,
    rpc_servers: &mut [Process],
    address: SocketAddr,
) -> Result<()> {
    let deadline = Instant::now() + READY_TIMEOUT;
    let mut last = String::from("no answer yet");
    while Instant::now() < deadline {
        server.check_running()?;
        for rpc_server in rpc_servers.iter_mut() {
            rpc_server.check_running()?;
        }
        match client::health(address) {
            Ok(200) => return Ok(()),
            Ok(status) => last = format!("GET /health answered {status}"),
            Err(error) => last = format!("{error:#}"),
        }
        thread::sleep(Duration::from_millis(200));
    }
    bail!(
        "llama-server was not ready within {} s ({last}); the end of {}:\n{}",
        READY_TIMEOUT.as_secs(),
        server.log.display(),
        log_tail(&server.log)
    )
}

/// One `POST` of a JSON body on a fresh connection; returns the status and the whole body.
fn post_json(address: SocketAddr, path: &str, body: &str) -> Result<(u16, Vec<u8>)> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(10))
        .with_context(|| format!("could not connect to llama-server at {address}"))?;
    stream
        .set_read_timeout(Some(REQUEST_TIMEOUT))
        .context("could not set a read timeout")?;
    stream
        .write_all(
            format!(
                "POST {path} HTTP/1.1\r\nHost: {address}\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .with_context(|| format!("could not send POST {path}"))?;
    let mut response = ResponseDecoder::new();
    let mut reply = Vec::new();
    let mut buffer = [0_u8; 16 * 1024];
    loop {
        let read = stream
            .read(&mut buffer)
            .with_context(|| format!("reading the answer to POST {path} failed"))?;
        if read == 0 {
            response.finish()?;
            break;
        }
        if response.push(&buffer[..read], &mut reply)? == Progress::Complete {
            break;
        }
        ensure!(
            reply.len() <= RESPONSE_LIMIT,
            "llama-server's answer to POST {path} is longer than {RESPONSE_LIMIT} bytes"
        );
    }
    let status = response
        .status()
        .with_context(|| format!("POST {path} was answered without a status line"))?;
    Ok((status, reply))
}

/// The lines of llama-server's log that [`PLACEMENT_MARKERS`] pick out, trimmed.
fn placement_lines(log: &str) -> Vec<String> {
    log.lines()
        .filter(|line| PLACEMENT_MARKERS.iter().any(|marker| line.contains(marker)))
        .map(|line| line.trim().to_owned())
        .collect()
}

/// A loopback port nothing listens on now. The listener is dropped before the server binds, so another
/// process could take the port in between; on a benchmark machine that race is not worth a retry loop.
fn free_address() -> Result<SocketAddr> {
    let listener = TcpListener::bind("127.0.0.1:0").context("could not bind a loopback port")?;
    Ok(listener.local_addr()?)
}

/// The last lines of a log, indented for an error message.
fn log_tail(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..]
        .iter()
        .map(|line| format!("  {line}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tensor_split_puts_our_two_process_boundary_between_the_rpc_servers() {
        // SmolLM2 has 30 blocks: 15 on the first server; 15 and the output layer on the second.
        assert_eq!(tensor_split(30), (15, 16));
        // gemma3 1B has 26.
        assert_eq!(tensor_split(26), (13, 14));
        // An odd count: our boundary is 31 / 2 = 15.
        assert_eq!(tensor_split(31), (15, 17));
    }

    #[test]
    fn the_placement_lines_are_picked_out_of_the_log() {
        let log = "common_param: system_info: n_threads = 2 (n_threads_batch = 2) / 2 | OPENMP = 1 |\n\
                   main: loading model\n\
                   llama_model_load_from_file_impl: using device RPC0 (127.0.0.1:5000) - 1000 MiB free\n\
                   load_tensors: offloaded 31/31 layers to GPU\n\
                   load_tensors: RPC0[127.0.0.1:5000] model buffer size =    40.00 MiB\n\
                   llama_kv_cache:  RPC1[127.0.0.1:5001] KV buffer size =    45.00 MiB\n\
                   srv  update_slots: all slots are idle\n";
        let lines = placement_lines(log);
        assert_eq!(
            lines.len(),
            5,
            "the build line and four lines on where things went: {lines:?}"
        );
        assert!(
            lines[2].starts_with("load_tensors: offloaded 31/31"),
            "{lines:?}"
        );
    }
}
