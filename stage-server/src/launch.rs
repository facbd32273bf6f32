//! The one-command pipeline (`stage-server run`): stage processes on loopback, the API on stage 0 here.
//!
//! ```text
//!   stage-server run --stages 3
//!     ├─ child: serve --layers 20..30 --bind 127.0.0.1:0                 (started first: it needs no --next)
//!     ├─ child: serve --layers 10..20 --bind 127.0.0.1:0 --next <last>
//!     └─ this process: layers 0..10 + the HTTP API, one link per lane to the first child
//! ```
//!
//! Each child prints its address once it serves (and, with `--stage-metrics`, its metrics listener's); the
//! children get SIGTERM if this process ends, however it ends. A child that dies is reported and the rest are
//! shut down.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::ops::Range;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::driver::ChainOptions;
use crate::frontend::{ApiConfig, ApiServer, Backend};
use crate::model::ModelFile;
use crate::telemetry::names;
use crate::wire::CodecPolicy;

/// How `run` lays out its pipeline.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    /// The GGUF model.
    pub model: PathBuf,
    /// Stage processes, this one included (1: the whole model here).
    pub stages: usize,
    /// The API's settings (its lanes are every stage's lanes).
    pub api: ApiConfig,
    /// Compute threads per stage process.
    pub threads: Option<usize>,
    /// How activations cross the links.
    pub codec: CodecPolicy,
    /// Delay and rate on stage 0's link to the chain (tests and benchmarks; each stage process started here
    /// gets the same through `stage_args`).
    pub shape: crate::serve::LinkShape,
    /// The program to run the stages with (this binary).
    pub executable: PathBuf,
    /// How long a stage may take to load.
    pub load_timeout: Duration,
    /// Serve in front of a chain started elsewhere (other hosts) instead of starting one: stage 0 keeps
    /// layers `0..end` and links to the first stage at the address. `stages` is then ignored.
    pub external: Option<(usize, SocketAddr)>,
    /// Arguments every stage process gets besides its own (telemetry: `--log-format`, `--otlp-endpoint`).
    pub stage_args: Vec<std::ffi::OsString>,
    /// Where the stage processes serve `/metrics`: stage 1 at this address, each later stage at the next
    /// port; port 0 gives every stage a free port of its own. `None`: no metrics listener on them.
    pub stage_metrics: Option<SocketAddr>,
    /// How stage 0 checks its chain: the `connect_timeout`, `reply_timeout`, `silence_probe` and `probe_timeout`
    /// of these options (the rest is ignored: the fields above set the codec and the shape).
    pub chain_checks: ChainOptions,
}

/// Splits `block_count` layers into `stages` consecutive ranges as evenly as possible (earlier ranges get
/// the extra layers). `stages` must be between 1 and `block_count`.
pub fn split_layers(block_count: usize, stages: usize) -> Result<Vec<Range<usize>>, String> {
    if stages == 0 || stages > block_count {
        return Err(format!(
            "--stages {stages} does not fit a model of {block_count} layers: give 1 to {block_count}"
        ));
    }
    let (base, extra) = (block_count / stages, block_count % stages);
    let mut start = 0;
    Ok((0..stages)
        .map(|index| {
            let length = base + usize::from(index < extra);
            let range = start..start + length;
            start += length;
            range
        })
        .collect())
}

/// Where stage process `index` (1 or later) serves its metrics when the stage processes start from `base`:
/// consecutive ports from `base`'s (stage 1 on it), or any free port when `base`'s is 0.
pub fn stage_metrics_address(base: SocketAddr, index: usize) -> Result<SocketAddr, String> {
    if base.port() == 0 {
        return Ok(base);
    }
    let port = index
        .checked_sub(1)
        .and_then(|offset| u16::try_from(offset).ok())
        .and_then(|offset| base.port().checked_add(offset))
        .ok_or_else(|| {
            format!(
                "--stage-metrics {base}: stage {index} would need a port above 65535; start from a lower port or give port 0"
            )
        })?;
    let mut address = base;
    address.set_port(port);
    Ok(address)
}

/// A stage process `run` started.
#[derive(Debug)]
struct StageChild {
    index: usize,
    layers: Range<usize>,
    child: Child,
    /// Where it serves `/metrics`, if it does.
    metrics: Option<SocketAddr>,
}

/// A running local pipeline.
#[derive(Debug)]
pub struct LocalPipeline {
    api: ApiServer,
    children: Vec<StageChild>,
    layers: Vec<Range<usize>>,
}

impl LocalPipeline {
    /// Starts the stage processes (the last first, each told where the next listens), then the API with
    /// stage 0 here. Returns once the API listens; [`ApiServer::wait_ready`] says when it serves.
    pub fn start(options: PipelineOptions) -> anyhow::Result<LocalPipeline> {
        let file = ModelFile::open(&options.model)?;
        let block_count = file.config().block_count;
        drop(file);
        let chain = ChainOptions {
            codec: options.codec,
            shape: options.shape,
            silence_probe: options.chain_checks.silence_probe,
            probe_timeout: options.chain_checks.probe_timeout,
            reply_timeout: options.chain_checks.reply_timeout,
            connect_timeout: options.chain_checks.connect_timeout,
            ..ChainOptions::default()
        };
        if let Some((end, next)) = options.external {
            // In front of a chain started elsewhere: no stage process here (the chain's hello checks that it
            // starts at layer `end`).
            if end == 0 || end >= block_count {
                anyhow::bail!(
                    "--layers 0..{end} leaves stage 0 {}: give 0..K with K from 1 to {} (the model has {block_count} layers)",
                    if end == 0 {
                        "no layer"
                    } else {
                        "no layer for the chain at --next"
                    },
                    block_count - 1
                );
            }
            let backend = Backend::Chain {
                layers_end: end,
                next,
                options: chain,
            };
            let api = ApiServer::start(&options.model, backend, options.api.clone())?;
            return Ok(LocalPipeline {
                api,
                children: Vec::new(),
                layers: vec![0..end, end..block_count],
            });
        }
        let layers = split_layers(block_count, options.stages).map_err(anyhow::Error::msg)?;
        let mut children: Vec<StageChild> = Vec::new();
        let mut next: Option<SocketAddr> = None;
        for (index, range) in layers.iter().enumerate().skip(1).rev() {
            match spawn_stage(&options, index, range, next) {
                Ok((child, address)) => {
                    children.push(child);
                    next = Some(address);
                }
                Err(error) => {
                    stop_children(&mut children, Duration::from_secs(5));
                    return Err(error);
                }
            }
        }
        children.reverse();
        let backend = match next {
            None => Backend::Whole,
            Some(next) => Backend::Chain {
                layers_end: layers[0].end,
                next,
                options: chain,
            },
        };
        let api = match ApiServer::start(&options.model, backend, options.api.clone()) {
            Ok(api) => api,
            Err(error) => {
                stop_children(&mut children, Duration::from_secs(5));
                return Err(error.into());
            }
        };
        Ok(LocalPipeline {
            api,
            children,
            layers,
        })
    }

    /// The API.
    pub fn api(&self) -> &ApiServer {
        &self.api
    }

    /// Each stage's layers, stage 0 first (in front of an external chain: stage 0's and the chain's).
    pub fn layers(&self) -> &[Range<usize>] {
        &self.layers
    }

    /// Each stage process's index and the address of its `/metrics` (with `--stage-metrics`), stage 1 first.
    pub fn stage_metrics(&self) -> Vec<(usize, SocketAddr)> {
        self.children
            .iter()
            .filter_map(|stage| Some((stage.index, stage.metrics?)))
            .collect()
    }

    /// A stage process that ended, with its status, if one did (an error event each time it is found).
    pub fn ended_stage(&mut self) -> Option<String> {
        for stage in &mut self.children {
            if let Ok(Some(status)) = stage.child.try_wait() {
                tracing::error!(
                    stage_index = stage.index,
                    layer_start = stage.layers.start,
                    layer_end = stage.layers.end,
                    pid = stage.child.id(),
                    status = describe(status),
                    "{}",
                    names::EVENT_PIPELINE_STAGE_EXITED
                );
                return Some(format!(
                    "stage {} (layers {}..{}, pid {}) ended: {}",
                    stage.index,
                    stage.layers.start,
                    stage.layers.end,
                    stage.child.id(),
                    describe(status)
                ));
            }
        }
        None
    }

    /// Drains the API (running generations get until `deadline`), then stops the stage processes, running
    /// `alongside` while they stop. `run` flushes stage 0's telemetry there, so its last export (up to
    /// [`SHUTDOWN_TIMEOUT`](crate::telemetry::SHUTDOWN_TIMEOUT) behind a collector that does not answer)
    /// overlaps the stage processes' own instead of adding to it.
    pub fn shutdown(
        mut self,
        deadline: Instant,
        alongside: impl FnOnce(),
    ) -> net_io_blocking::DrainReport {
        let report = self.api.shutdown(deadline);
        signal_children(&self.children);
        alongside();
        wait_children(&mut self.children, Duration::from_secs(10));
        report
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}

/// SIGTERM to every child (they drain), then SIGKILL to any still running after `grace`.
fn stop_children(children: &mut [StageChild], grace: Duration) {
    signal_children(children);
    wait_children(children, grace);
}

/// SIGTERM to every child: they drain and flush their telemetry at the same time.
fn signal_children(children: &[StageChild]) {
    for stage in children {
        // The pid is our unreaped child, so it cannot have been reused.
        if let Ok(process) = net_io_sys::pidfd::PidFd::open(stage.child.id()) {
            let _ = process.send_signal(libc::SIGTERM);
        }
    }
}

/// Waits for every child to exit, SIGKILLing any still running `grace` from now.
fn wait_children(children: &mut [StageChild], grace: Duration) {
    let deadline = Instant::now() + grace;
    for stage in children.iter_mut() {
        loop {
            match stage.child.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if Instant::now() >= deadline => {
                    let _ = stage.child.kill();
                    let _ = stage.child.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// Starts stage `index` serving `layers` and waits for the line with its address.
fn spawn_stage(
    options: &PipelineOptions,
    index: usize,
    layers: &Range<usize>,
    next: Option<SocketAddr>,
) -> anyhow::Result<(StageChild, SocketAddr)> {
    let mut command = Command::new(&options.executable);
    command
        .arg("serve")
        .arg("--model")
        .arg(&options.model)
        .arg("--layers")
        .arg(format!("{}..{}", layers.start, layers.end))
        .arg("--bind")
        .arg("127.0.0.1:0")
        .arg("--stage")
        .arg(index.to_string())
        .arg("--lanes")
        .arg(options.api.lanes.max(1).to_string())
        .arg("--codec")
        .arg(options.codec.as_str());
    if let Some(context) = options.api.context_length {
        command.arg("--context-length").arg(context.to_string());
    }
    if let Some(next) = next {
        command.arg("--next").arg(next.to_string());
    }
    if let Some(threads) = options.threads {
        command.arg("--threads").arg(threads.to_string());
    }
    let metrics_wanted = options
        .stage_metrics
        .map(|base| stage_metrics_address(base, index))
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if let Some(address) = metrics_wanted {
        command.arg("--metrics").arg(address.to_string());
    }
    command.args(&options.stage_args);
    command.stdin(Stdio::null()).stdout(Stdio::piped());
    net_io_sys::process::terminate_with_parent(&mut command);
    let mut child = command.spawn().map_err(|error| {
        anyhow::anyhow!(
            "stage {index} ({}) did not start: {error}",
            options.executable.display()
        )
    })?;
    tracing::debug!(
        stage_index = index,
        layer_start = layers.start,
        layer_end = layers.end,
        pid = child.id(),
        "{}",
        names::EVENT_PIPELINE_STAGE_SPAWNED
    );
    let stdout = child.stdout.take();
    let (lines, received) = mpsc::channel();
    if let Some(stdout) = stdout {
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // Once the address is known the child's output goes on to ours.
                if lines.send(line.clone()).is_err() {
                    println!("{line}");
                }
            }
        });
    }
    let deadline = Instant::now() + options.load_timeout;
    let mut stage = StageChild {
        index,
        layers: layers.clone(),
        child,
        metrics: None,
    };
    let mut served = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match received.recv_timeout(left.min(Duration::from_millis(200))) {
            Ok(line) => {
                if let Some(address) = served_address(&line) {
                    served = Some(address);
                } else if let Some(address) = metrics_address(&line) {
                    stage.metrics = Some(address);
                }
                // The stage prints its metrics line right after the one it serves on.
                if let Some(address) = served
                    && (metrics_wanted.is_none() || stage.metrics.is_some())
                {
                    tracing::info!(
                        stage_index = index,
                        layer_start = layers.start,
                        layer_end = layers.end,
                        pid = stage.child.id(),
                        address = %address,
                        metrics_address = stage.metrics.map(tracing::field::display),
                        "{}",
                        names::EVENT_PIPELINE_STAGE_READY
                    );
                    return Ok((stage, address));
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {}
        }
        if let Ok(Some(status)) = stage.child.try_wait() {
            anyhow::bail!(
                "stage {index} (layers {}..{}) ended before it served: {} (its error is above)",
                layers.start,
                layers.end,
                describe(status)
            );
        }
        if Instant::now() >= deadline {
            let _ = stage.child.kill();
            let _ = stage.child.wait();
            anyhow::bail!(
                "stage {index} (layers {}..{}) did not serve within {:?}",
                layers.start,
                layers.end,
                options.load_timeout
            );
        }
    }
}

/// The address in a stage's "… serving layers A..B on ADDR (width W)" line.
fn served_address(line: &str) -> Option<SocketAddr> {
    let (_, rest) = line.split_once(" serving layers ")?;
    let (_, rest) = rest.split_once(" on ")?;
    rest.split_whitespace().next()?.parse().ok()
}

/// The address in a stage's "… metrics on http://ADDR/metrics" line.
fn metrics_address(line: &str) -> Option<SocketAddr> {
    let (_, rest) = line.split_once(" metrics on http://")?;
    rest.strip_suffix("/metrics")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_split_evenly_with_the_extra_ones_first() {
        assert_eq!(split_layers(30, 3).unwrap(), vec![0..10, 10..20, 20..30]);
        assert_eq!(
            split_layers(18, 4).unwrap(),
            vec![0..5, 5..10, 10..14, 14..18]
        );
        assert_eq!(split_layers(5, 1).unwrap(), vec![0..5]);
    }

    #[test]
    fn a_split_into_no_stages_or_more_stages_than_layers_is_refused_with_the_numbers() {
        let error = split_layers(30, 31).unwrap_err();
        assert!(error.contains("31") && error.contains("30"), "{error}");
        assert!(split_layers(30, 0).is_err());
    }

    #[test]
    fn the_address_is_read_from_a_stage_line() {
        assert_eq!(
            served_address("stage 2 serving layers 20..30 on 127.0.0.1:4567 (width 576)"),
            Some("127.0.0.1:4567".parse().unwrap())
        );
        assert_eq!(served_address("loading"), None);
        assert_eq!(
            metrics_address("stage 2 metrics on http://127.0.0.1:9101/metrics"),
            Some("127.0.0.1:9101".parse().unwrap())
        );
        assert_eq!(
            metrics_address("stage 2 serving layers 20..30 on 127.0.0.1:4567 (width 576)"),
            None
        );
    }

    #[test]
    fn stage_metrics_take_consecutive_ports_from_stage_one_or_any_port_from_zero() {
        let base: SocketAddr = "127.0.0.1:9100".parse().unwrap();
        let ports: Vec<u16> = (1..4)
            .map(|index| stage_metrics_address(base, index).unwrap().port())
            .collect();
        assert_eq!(ports, vec![9100, 9101, 9102]);
        let any: SocketAddr = "0.0.0.0:0".parse().unwrap();
        assert_eq!(stage_metrics_address(any, 3).unwrap(), any);
        let high: SocketAddr = "127.0.0.1:65535".parse().unwrap();
        let error = stage_metrics_address(high, 2).unwrap_err();
        assert!(
            error.contains("65535") && error.contains("port 0"),
            "{error}"
        );
    }
}
