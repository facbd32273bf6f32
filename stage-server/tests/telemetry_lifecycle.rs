//! A `serve` process's lifecycle events as JSON log lines (`--log-format json`): loading, ready, the links from
//! the stage before, drain and exit after a SIGTERM, each with the fields that identify it, beside the
//! unchanged ready line on stdout.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc::channel;
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use serde_json::Value;
use stage_server::model::testing::TinyModel;
use stage_server::telemetry::names;

const BINARY: &str = env!("CARGO_BIN_EXE_stage-server");
/// Generous bound for a stage process to load a tiny model and listen on a loaded 2-core machine.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// Generous bound for a drained stage with no open sessions to exit.
const EXIT_TIMEOUT: Duration = Duration::from_secs(40);
/// The drain timeout the stage is given (seconds).
const DRAIN_TIMEOUT_SECONDS: u64 = 7;

fn tiny_llama(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "stage-server-lifecycle-{}-{name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("a scratch directory in the temp dir");
    TinyModel::llama(GgmlDType::Q4_1)
        .write_to_dir(&dir)
        .expect("writing the tiny model")
}

/// What one `serve` run printed: its ready line and every JSON log line on stderr, parsed.
struct Served {
    ready_line: String,
    address: SocketAddr,
    events: Vec<Value>,
}

impl Served {
    /// The events whose message is `name`.
    fn named(&self, name: &str) -> Vec<&Value> {
        self.events
            .iter()
            .filter(|event| event["fields"]["message"] == name)
            .collect()
    }

    /// The one event named `name`, with its position among all events.
    fn one(&self, name: &str) -> (usize, &Value) {
        let found: Vec<(usize, &Value)> = self
            .events
            .iter()
            .enumerate()
            .filter(|(_, event)| event["fields"]["message"] == name)
            .collect();
        assert_eq!(
            found.len(),
            1,
            "expected one {name} event, got {}: {:#?}",
            found.len(),
            self.events
        );
        found[0]
    }
}

/// Runs `serve --stage 1 --layers 2..4` of `model` with JSON logs filtered by `filter`, runs one generation
/// through it from a `generate` stage 0, then SIGTERMs it and collects what it wrote.
fn serve_generate_and_terminate(model: &Path, filter: &str) -> Served {
    let mut child = Command::new(BINARY)
        .args(["serve", "--model"])
        .arg(model)
        .args([
            "--layers",
            "2..4",
            "--stage",
            "1",
            "--threads",
            "1",
            "--log-format",
            "json",
            "--drain-timeout",
            &DRAIN_TIMEOUT_SECONDS.to_string(),
        ])
        .env("RUST_LOG", filter)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning stage-server serve");
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let (lines, ready) = channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = lines.send(line);
    });
    let reader = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<String>>()
    });
    let ready_line = ready.recv_timeout(START_TIMEOUT).unwrap_or_default();
    let Some(address) = ready_line
        .trim()
        .rsplit_once(" on ")
        .and_then(|(_, rest)| rest.split_whitespace().next())
        .and_then(|address| address.parse::<SocketAddr>().ok())
    else {
        let _ = child.kill();
        let _ = child.wait();
        panic!(
            "the stage printed no ready line: {ready_line:?}; stderr: {:?}",
            reader.join()
        );
    };
    let generated = Command::new(BINARY)
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args(["--json", "--threads", "1", "--prompt-ids", "1,300"])
        .args(["--max-tokens", "2", "--layers", "0..2", "--next"])
        .arg(address.to_string())
        .output()
        .expect("running stage-server generate");
    assert!(
        generated.status.success(),
        "a generation through the stage failed: {}",
        String::from_utf8_lossy(&generated.stderr)
    );
    let sent = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("running kill");
    assert!(sent.success(), "kill -TERM of the stage failed");
    let deadline = Instant::now() + EXIT_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the stage") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the stage did not exit within {EXIT_TIMEOUT:?} of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        status.success(),
        "a drained stage should exit 0, got {status}"
    );
    let stderr = reader.join().expect("the stderr reader");
    // Every log line is JSON; the plain lines the stage also writes (draining, stopped) are kept as they were.
    let events: Vec<Value> = stderr
        .iter()
        .filter(|line| line.starts_with('{'))
        .map(|line| {
            serde_json::from_str(line)
                .unwrap_or_else(|error| panic!("a log line is not JSON ({error}): {line}"))
        })
        .collect();
    assert!(
        stderr
            .iter()
            .any(|line| line.starts_with("stage 1: draining")),
        "the plain draining line should stay on stderr: {stderr:?}"
    );
    Served {
        ready_line,
        address,
        events,
    }
}

#[test]
fn a_terminated_stage_logs_its_ready_drain_and_exit_events_as_json_with_their_fields() {
    let model = tiny_llama("info");
    let served = serve_generate_and_terminate(&model, "info");
    let model_id = model.file_stem().unwrap().to_string_lossy().into_owned();
    assert!(
        served
            .ready_line
            .starts_with("stage 1 serving layers 2..4 on "),
        "the ready line on stdout should be unchanged: {:?}",
        served.ready_line
    );

    let (loading_at, loading) = served.one(names::EVENT_STAGE_LOADING);
    assert_eq!(
        loading["level"], "INFO",
        "loading is a lifecycle event at info"
    );
    assert_eq!(loading["fields"]["stage_index"], 1);
    assert_eq!(loading["fields"]["layer_start"], 2);
    assert_eq!(loading["fields"]["layer_end"], 4);
    assert_eq!(loading["fields"]["model_id"], model_id.as_str());

    let (ready_at, ready) = served.one(names::EVENT_STAGE_READY);
    let fields = &ready["fields"];
    assert_eq!(ready["level"], "INFO", "ready is a lifecycle event at info");
    assert_eq!(fields["stage_index"], 1, "ready names the stage: {ready}");
    assert_eq!(fields["layer_start"], 2, "ready names the layers: {ready}");
    assert_eq!(fields["layer_end"], 4, "ready names the layers: {ready}");
    assert_eq!(
        fields["address"],
        served.address.to_string().as_str(),
        "ready names the address of the ready line: {ready}"
    );
    let width = served
        .ready_line
        .trim()
        .strip_suffix(')')
        .and_then(|line| line.rsplit_once("(width "))
        .and_then(|(_, width)| width.parse::<u64>().ok())
        .expect("the ready line ends with its width");
    assert_eq!(fields["width"], width, "ready carries the width: {ready}");
    assert_eq!(
        fields["model_id"],
        model_id.as_str(),
        "ready names the model: {ready}"
    );
    assert_eq!(fields["lanes"], 4, "ready carries the lanes: {ready}");
    assert!(
        fields.get("next").is_none(),
        "the last stage has no next stage: {ready}"
    );

    let (drain_at, drain) = served.one(names::EVENT_STAGE_DRAIN);
    let fields = &drain["fields"];
    assert_eq!(drain["level"], "INFO", "drain is a lifecycle event at info");
    assert_eq!(fields["stage_index"], 1);
    assert_eq!(fields["reason"], "SIGTERM", "the drain says why: {drain}");
    assert_eq!(fields["address"], served.address.to_string().as_str());
    let timeout = fields["drain_timeout_millis"]
        .as_u64()
        .expect("the drain carries its timeout in milliseconds");
    assert!(
        timeout <= DRAIN_TIMEOUT_SECONDS * 1000 && timeout > DRAIN_TIMEOUT_SECONDS * 1000 - 1000,
        "the drain's timeout should be about --drain-timeout: {drain}"
    );
    assert_eq!(
        fields["sessions_open"], 0,
        "the generation had stopped its session before the drain: {drain}"
    );

    let (drained_at, drained) = served.one(names::EVENT_STAGE_DRAINED);
    let fields = &drained["fields"];
    assert_eq!(fields["stage_index"], 1);
    assert_eq!(fields["sessions_finished"], 0, "{drained}");
    assert_eq!(
        fields["sessions_stopped"], 0,
        "no session was stopped at the deadline: {drained}"
    );
    assert_eq!(fields["links_killed"], 0, "no link was cut: {drained}");
    assert!(
        fields["links_graceful"].is_u64() && fields["elapsed_millis"].is_u64(),
        "the drain reports its links and time: {drained}"
    );

    let (exit_at, exit) = served.one(names::EVENT_STAGE_EXIT);
    assert_eq!(exit["fields"]["reason"], "SIGTERM", "{exit}");
    assert_eq!(exit["fields"]["stage_index"], 1, "{exit}");

    assert!(
        loading_at < ready_at
            && ready_at < drain_at
            && drain_at < drained_at
            && drained_at < exit_at,
        "the lifecycle events should come in order: {:#?}",
        served.events
    );
    assert!(
        served.named(names::EVENT_UPSTREAM_ACCEPTED).is_empty(),
        "link events are at debug, below RUST_LOG=info"
    );
}

#[test]
fn at_debug_a_stage_logs_the_link_from_the_stage_before_accepted_and_closed_with_its_reason() {
    let model = tiny_llama("debug");
    let served = serve_generate_and_terminate(&model, "info,stage_server=debug");
    let accepted = served.named(names::EVENT_UPSTREAM_ACCEPTED);
    let closed = served.named(names::EVENT_UPSTREAM_CLOSED);
    assert!(
        !accepted.is_empty(),
        "the generation's link should be logged as accepted: {:#?}",
        served.events
    );
    for event in &accepted {
        assert_eq!(event["level"], "DEBUG", "link events are at debug: {event}");
        assert!(
            event["fields"]["peer"]
                .as_str()
                .is_some_and(|peer| peer.starts_with("127.0.0.1:")),
            "an accepted link names its peer: {event}"
        );
        let id = &event["fields"]["connection_id"];
        assert!(
            id.is_u64(),
            "an accepted link has its connection id: {event}"
        );
        let its_close = closed
            .iter()
            .find(|close| close["fields"]["connection_id"] == *id)
            .unwrap_or_else(|| panic!("link {id} was accepted but never closed: {closed:#?}"));
        assert_eq!(
            its_close["fields"]["peer"], event["fields"]["peer"],
            "the close names the same peer: {its_close}"
        );
        assert_eq!(
            its_close["fields"]["stage_index"], 1,
            "the close names this stage's index on the link: {its_close}"
        );
        assert!(
            its_close["fields"]["reason"]
                .as_str()
                .is_some_and(|reason| !reason.is_empty()),
            "the close says why: {its_close}"
        );
        assert_eq!(
            its_close["fields"]["sessions_stopped"], 0,
            "the generation stopped its session before its link closed: {its_close}"
        );
    }
}
