//! `stage-server run` as its users start it: the API in front of a chain started elsewhere (`--layers 0..K
//! --next ADDR`), and a local pipeline whose links are shaped (`--link-delay`), each a real process on 127.0.0.1.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use stage_server::model::testing::TinyModel;

mod support;
use support::http;

const BINARY: &str = env!("CARGO_BIN_EXE_stage-server");
/// Generous bound for processes to load a tiny model and listen on a loaded 2-core machine.
const START_TIMEOUT: Duration = Duration::from_secs(60);

fn tiny(name: &str) -> (PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("stage-server-run-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = TinyModel::llama(GgmlDType::Q4_1)
        .write_to_dir(&dir)
        .unwrap();
    (dir, model)
}

/// A child process killed (SIGKILL) when dropped, with its stdout lines.
struct Process {
    child: Child,
    lines: Receiver<String>,
}

impl Process {
    fn start(arguments: &[&str], model: &Path) -> Process {
        let mut child = Command::new(BINARY)
            .args(arguments)
            .arg("--model")
            .arg(model)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawning stage-server");
        let stdout = child.stdout.take().unwrap();
        let (sender, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = sender.send(line);
            }
        });
        Process { child, lines }
    }

    /// The first stdout line that `pick` makes something of.
    fn line<T>(&self, what: &str, mut pick: impl FnMut(&str) -> Option<T>) -> (String, T) {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let line = self
                .lines
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
                .unwrap_or_else(|_| panic!("no {what} line in time"));
            if let Some(found) = pick(&line) {
                return (line, found);
            }
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Sends `signal` (a name such as `STOP`) without waiting for its effect.
    fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([format!("-{signal}"), self.child.id().to_string()])
            .status()
            .expect("running kill");
        assert!(sent.success(), "kill -{signal} failed");
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A `serve` stage for `layers` and its address (from its ready line).
fn serve(
    model: &Path,
    layers: &str,
    next: Option<SocketAddr>,
    extra: &[&str],
) -> (Process, SocketAddr) {
    let next = next.map(|address| address.to_string());
    let mut arguments = vec![
        "serve",
        "--layers",
        layers,
        "--bind",
        "127.0.0.1:0",
        "--threads",
        "1",
    ];
    if let Some(next) = &next {
        arguments.extend(["--next", next.as_str()]);
    }
    arguments.extend(extra);
    let stage = Process::start(&arguments, model);
    let (_, address) = stage.line("ready", |line| {
        line.rsplit_once(" on ")
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .and_then(|address| address.parse().ok())
    });
    (stage, address)
}

/// `run` with `arguments`, its ready line and its API address.
fn run(model: &Path, arguments: &[&str]) -> (Process, String, SocketAddr) {
    let mut all = vec![
        "run",
        "--http",
        "127.0.0.1:0",
        "--lanes",
        "1",
        "--threads",
        "1",
    ];
    all.extend(arguments);
    let api = Process::start(&all, model);
    let (line, address) = api.line("serving", |line| {
        line.split_once(" on http://")
            .and_then(|(_, rest)| rest.split('/').next())
            .and_then(|address| address.parse().ok())
    });
    (api, line, address)
}

/// The text of a greedy completion of 8 tokens of `1, 300, 301` through the API at `address`.
fn completion(address: SocketAddr) -> (u16, String) {
    let request = r#"{"prompt":[1,300,301],"max_tokens":8,"temperature":0}"#;
    let (status, body) = http(address, "POST", "/v1/completions", request);
    if status != 200 {
        return (status, body);
    }
    let value: serde_json::Value = serde_json::from_str(&body).expect("a JSON completion");
    (
        status,
        value["choices"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_owned(),
    )
}

/// The same generation unsplit, in one process.
fn unsplit_text(model: &Path) -> String {
    let output = Command::new(BINARY)
        .args(["generate", "--model"])
        .arg(model)
        .args([
            "--prompt-ids",
            "1,300,301",
            "--max-tokens",
            "8",
            "--threads",
            "1",
            "--json",
        ])
        .output()
        .expect("running stage-server generate");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let value: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    value["text"].as_str().unwrap().to_owned()
}

#[test]
fn run_with_next_serves_the_api_in_front_of_the_chain_it_names_and_starts_no_stage_of_its_own() {
    let (dir, model) = tiny("front");
    let (mut last, last_address) = serve(&model, "2..4", None, &[]);
    let next = last_address.to_string();
    let (_api, line, address) = run(&model, &["--layers", "0..2", "--next", &next]);
    assert!(
        line.contains("stage 0: layers 0..2")
            && line.contains(&format!("the chain at {next}: layers 2..4")),
        "the ready line should say what runs where: {line}"
    );
    assert_eq!(
        completion(address),
        (200, unsplit_text(&model)),
        "the API in front of the chain should answer as the model unsplit"
    );
    // The chain it serves is the one at --next: without it, the API has nothing to serve with.
    last.kill();
    let (status, body) = completion(address);
    assert_eq!(status, 503, "with the chain's stage gone: {body}");
    assert!(
        body.contains("stage 1"),
        "the error should name the stage: {body}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_api_refuses_a_prompt_longer_than_the_chains_shortest_lane_with_a_400_and_stops_there_by_length()
 {
    let (dir, model) = tiny("front-context");
    let (_last, last_address) = serve(&model, "2..4", None, &["--context-length", "24"]);
    let next = last_address.to_string();
    let (_api, _, address) = run(&model, &["--layers", "0..2", "--next", &next]);
    let long: Vec<String> = (0..30).map(|index| (280 + index).to_string()).collect();
    for stream in [false, true] {
        let request = format!(
            r#"{{"prompt":[{}],"max_tokens":4,"stream":{stream}}}"#,
            long.join(",")
        );
        let (status, body) = http(address, "POST", "/v1/completions", &request);
        assert_eq!(status, 400, "stream {stream}: {body}");
        assert!(
            body.contains("context_length_exceeded") && body.contains("24 tokens"),
            "the refusal should name the chain's context: {body}"
        );
    }
    // A prompt that fits runs to the shortest lane's end: a length stop, not a stage's error.
    let (status, body) = http(
        address,
        "POST",
        "/v1/completions",
        r#"{"prompt":[1,300,301,302],"max_tokens":100,"temperature":0}"#,
    );
    assert_eq!(status, 200, "{body}");
    let value: serde_json::Value = serde_json::from_str(&body).expect("a JSON completion");
    assert_eq!(value["choices"][0]["finish_reason"], "length", "{body}");
    assert_eq!(value["usage"]["completion_tokens"], 20, "{body}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_with_next_refuses_a_stage_zero_with_no_layers_or_all_of_them_naming_the_flag_and_why() {
    let (dir, model) = tiny("front-refused");
    for (layers, expected) in [
        ("0..0", "the layer range 0..0 is empty"),
        ("0..4", "the model has 4 layers"),
    ] {
        let output = Command::new(BINARY)
            .args(["run", "--http", "127.0.0.1:0", "--model"])
            .arg(&model)
            .args(["--layers", layers, "--next", "127.0.0.1:9"])
            .output()
            .expect("running stage-server run");
        assert!(!output.status.success(), "--layers {layers} was accepted");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("--layers") && stderr.contains(layers) && stderr.contains(expected),
            "the error should name the flag and say why: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn runs_probe_flags_set_how_soon_a_request_to_a_stopped_stage_fails() {
    let (dir, model) = tiny("probe-flags");
    let (last, last_address) = serve(&model, "2..4", None, &[]);
    let next = last_address.to_string();
    let (_api, _, address) = run(
        &model,
        &[
            "--layers",
            "0..2",
            "--next",
            &next,
            "--probe-after",
            "200",
            "--probe-timeout",
            "500",
        ],
    );
    assert_eq!(completion(address).0, 200);
    last.signal("STOP");
    let started = Instant::now();
    let (status, body) = completion(address);
    let took = started.elapsed();
    last.signal("CONT");
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains("stage 1") && body.contains("stopped answering"),
        "the error should name the stage and say it stopped answering: {body}"
    );
    // 200 ms of silence, 500 ms for the ping, and slack for a loaded machine: under the 4 s the defaults (1 s
    // and 3 s) would take, so the flags must have reached the chain's lanes.
    assert!(
        took < Duration::from_millis(2500),
        "the request took {took:?} to fail with --probe-after 200 --probe-timeout 500: {body}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn run_with_a_link_delay_shapes_every_stage_link_and_changes_no_token() {
    let (dir, model) = tiny("shaped");
    let (_api, _, address) = run(&model, &["--stages", "3", "--link-delay", "20"]);
    let started = Instant::now();
    let answer = completion(address);
    let took = started.elapsed();
    assert_eq!(
        answer,
        (200, unsplit_text(&model)),
        "shaping must not change a token"
    );
    // Each of the 8 steps crosses stage 0's shaped link to stage 1 and stage 1's to stage 2 (and the last
    // stage's shaped return): at least 40 ms a step.
    assert!(
        took >= Duration::from_millis(8 * 40),
        "8 tokens over two 20 ms hops each took only {took:?}: the stage links are not shaped"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_link_delay_on_a_whole_model_is_refused_since_there_is_no_link() {
    let output = Command::new(BINARY)
        .args([
            "run",
            "--http",
            "127.0.0.1:0",
            "--stages",
            "1",
            "--link-delay",
            "5",
        ])
        .args(["--model", "/nonexistent/model.gguf"])
        .output()
        .expect("running stage-server run");
    assert!(
        !output.status.success(),
        "--link-delay with --stages 1 was accepted"
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--link-delay") && stderr.contains("--stages 1 has none"),
        "the error should name the flags and say why: {stderr}"
    );
}
