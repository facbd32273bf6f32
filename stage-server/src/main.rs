//! The `stage-server` command line: `run` (the pipeline with its API), `serve` (one stage), `generate`, `chat`, `inspect`.

use std::io::Write;
use std::net::SocketAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use net_io_blocking::TrustedProxies;
use net_io_sys::signal::SignalWatch;
use stage_server::driver::{self, Chain, ChainOptions};
use stage_server::frontend::ApiConfig;
use stage_server::launch::{LocalPipeline, PipelineOptions};
use stage_server::model::{
    self, GenerateOptions, ModelFile, Pipeline, Sampler, SamplingParams, StageOptions,
};
use stage_server::serve::{LinkShape, StageConfig, StageProcess, Topology};
use stage_server::telemetry::{self, LogFormat, names};
use stage_server::tokenizer::StreamDecoder;
use stage_server::tokenizer::chat::{ChatMessage, ChatTemplate};
use stage_server::wire::{ClusterKey, CodecPolicy};

/// Runs layer ranges of GGUF language models.
#[derive(Debug, Parser)]
#[command(name = "stage-server", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a local pipeline: N stage processes on loopback and the OpenAI-compatible API on stage 0.
    Run(RunArgs),
    /// Chat with a running API in the terminal (streams the reply; /reset, /quit; Ctrl-C stops a reply).
    Chat(ChatArgs),
    /// Generate text from a prompt, optionally split into in-process stages, or as stage 0 of a chain of
    /// stage processes (`--layers 0..K --next ADDR`).
    Generate(GenerateArgs),
    /// Serve a layer range of a model to the stage before this one (stage 1 and later).
    Serve(ServeArgs),
    /// Describe a GGUF model file: architecture, sizes, tokenizer, tensor types.
    Inspect {
        /// The GGUF file.
        file: PathBuf,
    },
}

#[derive(Debug, Args)]
struct RunArgs {
    /// Stage processes, this one (stage 0, with the API) included; the layers are split evenly.
    #[arg(long, default_value_t = 3)]
    stages: usize,
    /// The GGUF model (default: SmolLM2, fetched into the model directory on first use).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Where the API listens.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: SocketAddr,
    /// Generations at a time (each stage keeps a KV cache lane for each).
    #[arg(long, default_value_t = 4)]
    lanes: usize,
    /// Requests that may wait for a lane (default: twice the lanes); more get 429.
    #[arg(long)]
    queue: Option<usize>,
    /// Seconds a request may wait for a lane before it gets 429.
    #[arg(long, default_value_t = 30.0)]
    queue_timeout: f64,
    /// Rows of one forward pass of stage 0 at most (the whole model with --stages 1): every running stream's
    /// next token, then chunks of newly admitted prompts in what is left.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u64).range(1..=65_536))]
    batch_tokens: u64,
    /// While streams decode, the most a pass that also runs rows of a newly admitted prompt may take, as a
    /// multiple of a pass of the streams alone (the prompt rows are cut to fit, by the costs measured so far;
    /// the rest of the prompt follows in the next passes). 2 keeps every stream's token gap within about twice
    /// its usual, at the price of the admitted request's time to first token; 0 (the default): no bound,
    /// prompt rows up to --batch-tokens however long the streams wait.
    #[arg(long, default_value_t = 0.0, value_parser = parse_stretch)]
    decode_stretch: f64,
    /// The most decode passes a newly admitted prompt waits for running streams that end within them, instead of
    /// stalling them for its prefill (only while every running stream ends that soon, and no longer than the
    /// prompt's rows would add to a pass, by the costs measured so far); 0 never waits. Keeps requests queued
    /// behind full lanes from admitting, and ending, out of step with the streams beside them. For the whole
    /// model (--stages 1) only: a chain's stage 0 does not wait yet; and off with --decode-stretch, which bounds
    /// what a prompt adds to a pass anyway.
    #[arg(long, default_value_t = stage_server::model::PROMPT_HOLD_STEPS)]
    prompt_hold_steps: usize,
    /// In front of a chain (--stages 2 or more, or --next): how many steps' streams may be out down the chain
    /// at once before a stream whose token came back waits for the others, so streams that went down together
    /// run together at every stage. 1 keeps one batch going round (best when the stages share this host's
    /// cores); the stage count keeps every stage busy when each has its own host; 0 never waits (streams
    /// drift apart into one-row passes).
    #[arg(long, default_value_t = 1)]
    batches_in_flight: usize,
    /// Connections one client address may hold open at once; more are refused at admission. Raise it behind
    /// a reverse proxy, where every request comes from the proxy's address.
    #[arg(long, default_value_t = stage_server::frontend::MAX_PER_SOURCE_DEFAULT,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    max_connections_per_source: usize,
    /// Compute threads per stage process (default: this host's cores shared among the stage processes, at
    /// least one each; all of them for --stages 1).
    #[arg(long)]
    threads: Option<usize>,
    /// Context tokens per lane (default: the model's).
    #[arg(long)]
    context_length: Option<usize>,
    /// The model id the API serves (default: the file's stem).
    #[arg(long)]
    model_id: Option<String>,
    /// A bearer key every route but /health requires (the /v1 routes and their unprefixed aliases,
    /// /metrics, /tokenize, /detokenize).
    #[arg(long, conflicts_with = "api_key_file")]
    api_key: Option<String>,
    /// A file holding the bearer key (its first line).
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// How activations cross the stage links.
    #[arg(long, value_parser = parse_codec, default_value = "f32")]
    codec: CodecPolicy,
    /// Seconds Ctrl-C lets running generations finish.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// Serve in front of a chain started elsewhere (`stage-server serve` on other hosts): the first stage's
    /// address. Needs --layers 0..K, stage 0's share; no stage processes are started.
    #[arg(long, requires = "layers")]
    next: Option<SocketAddr>,
    /// Stage 0's layers when serving in front of an external chain (--next).
    #[arg(long, value_parser = parse_layers, requires = "next")]
    layers: Option<Range<usize>>,
    /// Give each stage process a metrics listener (`GET /metrics`, Prometheus text): stage 1 at this address,
    /// each later stage at the next port (127.0.0.1:9100 gives 9100, 9101, …); port 0 gives each any free
    /// port. The ready output names every one. Stage 0's metrics are on the API's /metrics.
    #[arg(long, conflicts_with = "next")]
    stage_metrics: Option<SocketAddr>,
    /// Milliseconds of one-way delay added to each direction of every stage link, and to the last stage's
    /// prediction returns (tests and benchmarks: a WAN on loopback; each stage process started gets it too).
    /// With --next only stage 0's own link is shaped (give the chain's stages their own --link-delay); with
    /// --stages 1 there is no link, and it is refused.
    #[arg(long, default_value_t = 0.0)]
    link_delay: f64,
    /// The rate of every stage link in Mbit/s, as --link-delay (tests and benchmarks; default unlimited).
    #[arg(long)]
    link_rate: Option<f64>,
    #[command(flatten)]
    checks: ChainCheckArgs,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

/// Logs and telemetry export, for `run` and `serve`.
#[derive(Debug, Args)]
struct TelemetryArgs {
    /// How log lines on stderr look: text or json (RUST_LOG filters them; default info).
    #[arg(long, value_parser = LogFormat::parse, default_value = "text")]
    log_format: LogFormat,
    /// Export traces and metrics over OTLP/HTTP (protobuf) to this collector, e.g. http://127.0.0.1:4318
    /// (default: $OTEL_EXPORTER_OTLP_ENDPOINT; STAGE_SERVER_OTLP_FILTER picks the spans, default info).
    #[arg(long)]
    otlp_endpoint: Option<String>,
}

impl TelemetryArgs {
    /// Installs the subscriber and, with a collector, the exporter.
    fn init(&self, identity: telemetry::Identity) -> telemetry::Telemetry {
        let endpoint = telemetry::otlp_endpoint(self.otlp_endpoint.as_deref());
        telemetry::init(telemetry::TelemetryOptions {
            log_format: self.log_format,
            otlp: endpoint.map(telemetry::OtlpConfig::new),
            identity,
        })
    }

    /// The same flags for a stage process `run` starts.
    fn stage_args(&self) -> Vec<std::ffi::OsString> {
        let mut args = vec![
            "--log-format".into(),
            match self.log_format {
                LogFormat::Text => "text",
                LogFormat::Json => "json",
            }
            .into(),
        ];
        if let Some(endpoint) = telemetry::otlp_endpoint(self.otlp_endpoint.as_deref()) {
            args.push("--otlp-endpoint".into());
            args.push(endpoint.into());
        }
        args
    }
}

#[derive(Debug, Args)]
struct ChatArgs {
    /// The API's address.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The bearer key, if the API wants one.
    #[arg(long)]
    api_key: Option<String>,
    /// A system message that opens the conversation.
    #[arg(long)]
    system: Option<String>,
    /// Tokens per reply at most.
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Sampling temperature.
    #[arg(long)]
    temperature: Option<f32>,
}

#[derive(Debug, Args)]
struct GenerateArgs {
    /// The GGUF model (default: SmolLM2 in the model directory `cargo xtask fetch-models` fills).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The prompt text.
    #[arg(
        long,
        conflicts_with = "prompt_ids",
        required_unless_present = "prompt_ids"
    )]
    prompt: Option<String>,
    /// The prompt as comma-separated token ids (no tokenizer involved).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Nucleus sampling threshold (1: off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens below this fraction of the top probability (0: off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Random seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    /// Presence penalty.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Frequency penalty.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Compute threads (sets CANDLE_NUM_THREADS and RAYON_NUM_THREADS).
    #[arg(long)]
    threads: Option<usize>,
    /// Split into in-process stages at these layers: `10,20` runs [0,10) [10,20) [20,end).
    #[arg(long, value_delimiter = ',')]
    split: Vec<usize>,
    /// Context limit (default: the model's).
    #[arg(long)]
    context_length: Option<usize>,
    /// Write each generated step's raw logits (little-endian f32, one vocabulary row per step) here.
    #[arg(long)]
    logits_out: Option<PathBuf>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Run as stage 0 of a chain: only these layers here (`0..K`), the rest on the stage at `--next`.
    #[arg(long, value_parser = parse_layers, requires = "next")]
    layers: Option<Range<usize>>,
    /// The first stage process of the chain (with `--layers 0..K`).
    #[arg(long, requires = "layers")]
    next: Option<SocketAddr>,
    /// A topology file listing every stage: stage 0's layers and the first stage's address come from it.
    #[arg(long, conflicts_with_all = ["layers", "next", "split"])]
    topology: Option<PathBuf>,
    /// How activations go down the chain: f32, f16, bf16 or auto-lossless.
    #[arg(long, value_parser = parse_codec, default_value = "f32")]
    codec: CodecPolicy,
    /// Non-final prefill chunks stage 0 sends ahead of the chain's acknowledgements.
    #[arg(long, default_value_t = 1)]
    reply_credits: usize,
    /// The most prompt tokens stage 0 sends down the chain in one prefill chunk, 1 to 512: smaller chunks cost
    /// more passes and round trips, but every stage then holds only about (reply credits + 2) chunks of
    /// activation rows at once instead of most of a long prompt.
    #[arg(long, default_value_t = model::PREFILL_CHUNK, value_parser = parse_prefill_chunk)]
    prefill_chunk: usize,
    /// The cluster's shared key file (every stage of the chain needs the same one).
    #[arg(long)]
    cluster_key: Option<PathBuf>,
    /// Milliseconds of one-way delay added to each direction of stage 0's link to stage 1 (tests and
    /// benchmarks).
    #[arg(long, default_value_t = 0.0)]
    link_delay: f64,
    /// Stage 0's link rate in Mbit/s (tests and benchmarks; default unlimited).
    #[arg(long)]
    link_rate: Option<f64>,
    /// How tokens come back from the chain's last stage: `direct` (over a link stage 0 opens to it, when the
    /// chain names one) or `relayed` (back up the chain through every stage).
    #[arg(long, value_enum, default_value_t = PredictionReturn::Direct)]
    prediction_return: PredictionReturn,
    #[command(flatten)]
    checks: ChainCheckArgs,
}

/// How stage 0 tells a slow chain from a stopped one, for `generate` and `run` in front of a chain.
#[derive(Debug, Args)]
struct ChainCheckArgs {
    /// Milliseconds stage 0 waits in silence for the chain before it sends a ping through it (every stage passes
    /// a ping on as it reads it, even while it computes); 0: no ping, a silent chain is given up only at
    /// --reply-timeout.
    #[arg(long, value_name = "MS", default_value_t = driver::SILENCE_PROBE.as_millis() as u64)]
    probe_after: u64,
    /// Milliseconds a ping may go unanswered before the generation fails naming the stage (at least four times
    /// what opening the link to stage 1 took). Raise it for links so slow that one frame takes longer.
    #[arg(long, value_name = "MS", default_value_t = driver::PROBE_TIMEOUT.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    probe_timeout: u64,
    /// Seconds stage 0 gives the connect to stage 1; the chain's answer to its hello (which comes once every
    /// later stage has opened its own link) gets twice as long.
    #[arg(long, value_name = "SECONDS", default_value_t = ChainOptions::default().connect_timeout.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..))]
    connect_timeout: u64,
    /// Seconds stage 0 waits for any answer from the chain before it gives up on it.
    #[arg(long, value_name = "SECONDS", default_value_t = driver::REPLY_TIMEOUT.as_secs(),
          value_parser = clap::value_parser!(u64).range(1..))]
    reply_timeout: u64,
}

impl ChainCheckArgs {
    /// `options` with these checks.
    fn apply(&self, options: ChainOptions) -> ChainOptions {
        ChainOptions {
            silence_probe: std::time::Duration::from_millis(self.probe_after),
            probe_timeout: std::time::Duration::from_millis(self.probe_timeout),
            reply_timeout: std::time::Duration::from_secs(self.reply_timeout),
            connect_timeout: std::time::Duration::from_secs(self.connect_timeout),
            ..options
        }
    }
}

/// How a chain's tokens come back to stage 0 (`--prediction-return`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum PredictionReturn {
    /// Straight from the last stage.
    Direct,
    /// Up the chain, stage by stage.
    Relayed,
}

#[derive(Debug, Args)]
struct ServeArgs {
    /// The GGUF model (default: SmolLM2 in the model directory `cargo xtask fetch-models` fills).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The layers this stage serves, `A..B` (A > 0: layers from 0 belong to stage 0).
    #[arg(long, value_parser = parse_layers, required_unless_present = "topology")]
    layers: Option<Range<usize>>,
    /// A topology file listing every stage (address and layers); with `--stage I` it sets this stage's
    /// layers, its bind address and the next stage.
    #[arg(long, requires = "stage", conflicts_with_all = ["layers", "next"])]
    topology: Option<PathBuf>,
    /// Where to listen for the stage before this one.
    #[arg(long, default_value = "127.0.0.1:0")]
    bind: SocketAddr,
    /// The next stage (required unless this stage serves the model's last layers).
    #[arg(long)]
    next: Option<SocketAddr>,
    /// This stage's place in the chain, for the ready line and messages.
    #[arg(long)]
    stage: Option<u16>,
    /// Concurrent sessions, each with its own KV cache.
    #[arg(long, default_value_t = 4)]
    lanes: usize,
    /// Context limit per lane (default: the model's).
    #[arg(long)]
    context_length: Option<usize>,
    /// The cluster's shared key file; links without it are refused.
    #[arg(long)]
    cluster_key: Option<PathBuf>,
    /// Only these addresses may connect: comma-separated CIDRs or addresses.
    #[arg(long, value_delimiter = ',')]
    allow_from: Vec<String>,
    /// How activations go to the next stage: f32, f16, bf16 or auto-lossless.
    #[arg(long, value_parser = parse_codec, default_value = "f32")]
    codec: CodecPolicy,
    /// Seconds a SIGTERM or SIGINT gives in-flight generations to finish.
    #[arg(long, default_value_t = 30)]
    drain_timeout: u64,
    /// Milliseconds a link keeps trying to reach the next stage (refused, timed out, or closed before it
    /// answered), waiting 25 ms, then twice as long each time up to 400 ms, before it refuses the stage before
    /// it; 0: one attempt.
    #[arg(long, default_value_t = 1000)]
    connect_retry_timeout: u64,
    /// Compute threads (sets CANDLE_NUM_THREADS and RAYON_NUM_THREADS).
    #[arg(long)]
    threads: Option<usize>,
    /// Milliseconds of one-way delay added to each direction of the link to the next stage, or at the last
    /// stage to the tokens it sends stage 0 directly (tests and benchmarks).
    #[arg(long, default_value_t = 0.0)]
    link_delay: f64,
    /// The link to the next stage's rate in Mbit/s (tests and benchmarks; default unlimited).
    #[arg(long)]
    link_rate: Option<f64>,
    /// MiB each link may hold for the next stage (rows computing, queued or unsent) and read ahead of its
    /// answers. Past it the link hands no further chunk to compute and stops reading the stage before it
    /// until the next stage catches up (back-pressure, not a refusal), so a slow next link cannot make a
    /// stage hold a whole prompt. Default: lanes + 2 prefill chunks of 512 rows at the model's width in f32,
    /// at least 64 MiB.
    #[arg(long, value_name = "MIB")]
    link_buffer_mib: Option<u64>,
    /// At the last stage: the address stage 0 opens prediction-return links to (named in the hellos up the
    /// chain); default: the address each upstream link reached this stage at.
    #[arg(long)]
    advertise: Option<SocketAddr>,
    /// Serve this stage's metrics as Prometheus text on `GET /metrics` at this address.
    #[arg(long)]
    metrics: Option<SocketAddr>,
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

/// A link shape from `--link-delay MS` and `--link-rate MBIT`.
fn link_shape(delay_ms: f64, rate_mbit: Option<f64>) -> anyhow::Result<LinkShape> {
    if !(delay_ms.is_finite() && delay_ms >= 0.0) {
        bail!("--link-delay {delay_ms} is not a delay in milliseconds (0 or more)");
    }
    if let Some(rate) = rate_mbit
        && !(rate.is_finite() && rate > 0.0)
    {
        bail!("--link-rate {rate} is not a rate in Mbit/s (above 0)");
    }
    Ok(LinkShape {
        delay: std::time::Duration::from_secs_f64(delay_ms / 1000.0),
        rate_bits_per_second: rate_mbit.map(|rate| (rate * 1_000_000.0) as u64),
    })
}

/// The most `--link-buffer-mib` takes: 1 TiB, far past any host's memory, and small enough that its bytes
/// fit a `usize` on every 64-bit target.
const LINK_BUFFER_MIB_MAX: u64 = 1 << 20;

/// The link buffer in bytes from `--link-buffer-mib MIB` (`None`: the stage's default).
fn link_buffer(mib: Option<u64>) -> anyhow::Result<Option<usize>> {
    let Some(mib) = mib else {
        return Ok(None);
    };
    if !(1..=LINK_BUFFER_MIB_MAX).contains(&mib) {
        bail!(
            "--link-buffer-mib {mib} is not a buffer this stage can keep to; give 1 to {LINK_BUFFER_MIB_MAX} MiB (a link holds at least one chunk whatever the buffer, and the default fits the model)"
        );
    }
    usize::try_from(mib << 20).map(Some).map_err(|_| {
        anyhow::anyhow!("--link-buffer-mib {mib} does not fit this machine's memory; give less")
    })
}

/// `A..B` as a range of layers.
fn parse_layers(text: &str) -> Result<Range<usize>, String> {
    let (start, end) = text.split_once("..").ok_or_else(|| {
        format!("`{text}` is not a layer range; write it as A..B, for example 10..20")
    })?;
    let start: usize = start
        .trim()
        .parse()
        .map_err(|_| format!("`{start}` in `{text}` is not a layer number"))?;
    let end: usize = end
        .trim()
        .parse()
        .map_err(|_| format!("`{end}` in `{text}` is not a layer number"))?;
    if start >= end {
        return Err(format!(
            "the layer range {start}..{end} is empty; the end must be above the start"
        ));
    }
    Ok(start..end)
}

fn parse_codec(text: &str) -> Result<CodecPolicy, String> {
    match text {
        "f32" => Ok(CodecPolicy::F32),
        "f16" => Ok(CodecPolicy::F16),
        "bf16" => Ok(CodecPolicy::Bf16),
        "auto-lossless" => Ok(CodecPolicy::AutoLossless),
        other => Err(format!(
            "`{other}` is not an activation codec; use f32, f16, bf16 or auto-lossless"
        )),
    }
}

/// A decode stretch: 0 (off) or a number of at least 1.
fn parse_stretch(text: &str) -> Result<f64, String> {
    let stretch: f64 = text.trim().parse().map_err(|_| {
        format!("`{text}` is not a number; give a multiple such as 2 or 1.5, or 0 for no bound")
    })?;
    if stretch == 0.0 || (stretch.is_finite() && stretch >= 1.0) {
        Ok(stretch)
    } else {
        Err(format!(
            "a decode stretch of {text} cannot hold: a pass with prompt rows takes at least as long as one without; give 1 or more, or 0 for no bound"
        ))
    }
}

/// A prefill chunk size: 1 to [`model::PREFILL_CHUNK`] prompt tokens.
fn parse_prefill_chunk(text: &str) -> Result<usize, String> {
    let most = model::PREFILL_CHUNK;
    let size: usize = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number of tokens; give 1 to {most}"))?;
    if (1..=most).contains(&size) {
        Ok(size)
    } else {
        Err(format!(
            "a prefill chunk of {size} tokens cannot be sent: a chunk carries at least 1 prompt token, and {most} (the default) is the largest stage 0 sends; give 1 to {most}"
        ))
    }
}

fn load_key(path: &Option<PathBuf>) -> anyhow::Result<Option<ClusterKey>> {
    path.as_ref()
        .map(|path| ClusterKey::load(path).map_err(anyhow::Error::from))
        .transpose()
}

fn main() {
    let cli = Cli::parse();
    let threads = match &cli.command {
        Command::Run(args) => run_threads(args),
        Command::Chat(_) => None,
        Command::Generate(args) => args.threads,
        Command::Serve(args) => args.threads,
        Command::Inspect { .. } => None,
    };
    let mut environment: Vec<(&str, String)> = Vec::new();
    if let Some(threads) = threads {
        let wanted = threads.max(1).to_string();
        environment.push(("CANDLE_NUM_THREADS", wanted.clone()));
        environment.push(("RAYON_NUM_THREADS", wanted));
    }
    // Our compute pool spins between the ops of a pass and parks when it ends; candle's barrier pool, which
    // still runs the products our kernels do not cover (float weights, Q2_K, Q3_K, which no shipped model has; gemma-3's K-quants until
    // session 25) and candle's large element-wise ops, spins
    // 25,000 times after each before it parks, on the cores our pool's next op (or, on one host, the next
    // stage process) needs: gemma-3 decoded 48 to 52 tok/s so against 61 to 65 with 2,000. Set for every
    // command (and inherited by `run`'s stages), unless the caller chose a limit.
    if std::env::var_os(SPIN_LIMIT_VARIABLE).is_none() {
        environment.push((SPIN_LIMIT_VARIABLE, CANDLE_SPIN_LIMIT.to_string()));
    }
    if let Some(code) = reexec_with(&environment) {
        std::process::exit(code);
    }
    let result = match cli.command {
        Command::Run(args) => run(args),
        Command::Chat(args) => chat(args),
        Command::Generate(args) => generate(args),
        Command::Serve(args) => serve(args),
        Command::Inspect { file } => inspect(&file),
    };
    if let Err(error) = result {
        eprintln!("stage-server: {error:#}");
        std::process::exit(1);
    }
}

/// The compute threads of each process of `run`: `--threads`, or, when several stage processes share this host
/// and the caller set no thread count in the environment, the host's cores shared among them (at least one
/// each). Every stage process sizes its pool to the whole machine otherwise, and pools that wait for each other
/// at every op while other processes hold the cores convoy: 3 stages of SmolLM2 on 2 cores streamed 15 to 28
/// tok/s with 2 threads each against 57 to 72 with 1 (1 and 4 streams, interleaved runs, loaded host).
fn run_threads(args: &RunArgs) -> Option<usize> {
    let caller_chose = ["CANDLE_NUM_THREADS", "RAYON_NUM_THREADS"]
        .iter()
        .any(|name| std::env::var_os(name).is_some_and(|value| !value.is_empty()));
    if args.threads.is_some() || args.stages <= 1 || args.next.is_some() || caller_chose {
        return args.threads;
    }
    let cores = std::thread::available_parallelism().map_or(1, |cores| cores.get());
    Some((cores / args.stages).max(1))
}

/// The variable candle's barrier pool reads its spin count from.
const SPIN_LIMIT_VARIABLE: &str = "CANDLE_BARRIER_POOL_SPIN_LIMIT";
/// The spin count of candle's barrier pool in our processes (before our own pool, it also let 3 stages of
/// SmolLM2 on 2 cores decode 80 tok/s instead of 42; `docs/PERFORMANCE.md`).
const CANDLE_SPIN_LIMIT: u32 = 2000;

/// candle sizes its thread pools from the environment when it first computes, and changing the
/// environment of a running process is unsafe, so `--threads` (and the spin limit of `run`'s stages)
/// replace this process with the binary run again with it set (exec, not a child: signals sent to this
/// process then reach the real one). Returns only when that failed (the exit code to use), or `None` when
/// the environment already matches.
fn reexec_with(environment: &[(&str, String)]) -> Option<i32> {
    use std::os::unix::process::CommandExt;
    let matches = environment
        .iter()
        .all(|(name, value)| std::env::var(name).ok().as_deref() == Some(value.as_str()));
    if matches {
        return None;
    }
    let executable = std::env::current_exe().ok()?;
    let error = std::process::Command::new(executable)
        .args(std::env::args_os().skip(1))
        .envs(
            environment
                .iter()
                .map(|(name, value)| (*name, value.as_str())),
        )
        .exec();
    eprintln!("stage-server: could not run itself again with its compute environment: {error}");
    Some(1)
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(path) => path.clone(),
        None => model::find_model(model::SMOLLM2_FILE).map_err(anyhow::Error::msg)?,
    };
    let file = ModelFile::open(&path)?;
    let tokenizer = stage_server::tokenizer::Tokenizer::from_gguf(file.content());
    let prompt: Vec<u32> = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, Some(text)) => {
            let tokenizer = tokenizer
                .as_ref()
                .map_err(|error| anyhow::anyhow!("{error}"))?;
            if args.chat {
                let template = ChatTemplate::from_gguf(file.content())
                    .map_err(|error| anyhow::anyhow!("{error}"))?
                    .context("the model has no chat template; drop --chat")?;
                let rendered = template
                    .render(&[ChatMessage::new("user", text.as_str())], true)
                    .map_err(|error| anyhow::anyhow!("{error}"))?;
                // A template that writes BOS itself must not get a second one from the tokenizer.
                let starts_with_bos = tokenizer
                    .bos()
                    .and_then(|bos| tokenizer.token_text(bos))
                    .is_some_and(|bos| rendered.starts_with(bos));
                tokenizer
                    .encode(&rendered, !starts_with_bos, true)
                    .map_err(|error| anyhow::anyhow!("{error}"))?
            } else {
                tokenizer
                    .encode(text, true, false)
                    .map_err(|error| anyhow::anyhow!("{error}"))?
            }
        }
        (None, None) => bail!("pass --prompt or --prompt-ids"),
    };
    if prompt.is_empty() {
        bail!("the prompt has no tokens");
    }
    let sampling = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        repeat_penalty: args.repeat_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        penalty_last_n: 64,
    };
    let generate_options = GenerateOptions {
        max_tokens: args.max_tokens,
        stop_tokens: match &tokenizer {
            Ok(tokenizer) => tokenizer.end_of_generation_ids(),
            Err(_) => stop_tokens(&file),
        },
        keep_logits: args.logits_out.is_some(),
    };
    let stream = !args.json;
    let mut stdout = std::io::stdout().lock();
    let mut decoder = tokenizer.as_ref().ok().map(StreamDecoder::new);
    let mut text = String::new();
    let mut on_token = |token: u32| {
        let piece = match decoder.as_mut() {
            Some(decoder) => decoder.push(token),
            None => format!("{token} "),
        };
        if stream {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
        text.push_str(&piece);
    };
    let (chain_layers, chain_next) = match &args.topology {
        Some(file) => {
            let topology = Topology::load(file)?;
            let name = file.display().to_string();
            (
                Some(topology.stage(0, &name)?.layers.clone()),
                topology.next_of(0),
            )
        }
        None => (args.layers.clone(), args.next),
    };
    // Over a chain: where tokens came back from directly, if they did, and how many did.
    let mut returned: Option<(Option<SocketAddr>, u64)> = None;
    let generation = match (&chain_layers, chain_next) {
        (Some(layers), Some(next)) => {
            if args.logits_out.is_some() {
                bail!(
                    "--logits-out needs the logits, which stay at the chain's last stage; drop it with --next"
                );
            }
            if layers.start != 0 {
                bail!(
                    "stage 0 runs the layers from 0 (with the embeddings): --layers must be 0..K, not {}..{}",
                    layers.start,
                    layers.end
                );
            }
            let options = args.checks.apply(ChainOptions {
                codec: args.codec,
                credits: args.reply_credits,
                prefill_chunk: args.prefill_chunk,
                cluster_key: load_key(&args.cluster_key)?,
                shape: link_shape(args.link_delay, args.link_rate)?,
                direct_return: args.prediction_return == PredictionReturn::Direct,
                ..ChainOptions::default()
            });
            let mut chain = Chain::connect(&file, layers.end, next, options)?;
            let generation = chain.generate(&prompt, sampling, &generate_options, |predicted| {
                on_token(predicted.token)
            })?;
            returned = Some((chain.direct_return(), chain.direct_tokens()));
            generation
        }
        _ => {
            let options = StageOptions {
                lane_count: 1,
                context_length: args.context_length,
            };
            let mut pipeline = Pipeline::from_file(&file, &args.split, options)?;
            let mut sampler = Sampler::new(sampling);
            pipeline.generate(0, &prompt, &mut sampler, &generate_options, on_token)?
        }
    };
    if let Some(decoder) = decoder.as_mut() {
        let rest = decoder.finish();
        if stream {
            write!(stdout, "{rest}")?;
        }
        text.push_str(&rest);
    }
    if let Some(out) = &args.logits_out {
        let bytes = model::encode_activations(&generation.logits);
        std::fs::write(out, bytes).with_context(|| format!("writing {}", out.display()))?;
    }
    let prompt_rate = rate(prompt.len(), generation.prompt_time);
    let decode_rate = rate(
        generation.tokens.len().saturating_sub(1),
        generation.decode_time,
    );
    if args.json {
        let mut object = serde_json::json!({
            "prompt_tokens": prompt,
            "tokens": generation.tokens,
            "text": text,
            "prompt_tokens_per_second": prompt_rate,
            "decode_tokens_per_second": decode_rate,
        });
        if let Some((direct, count)) = returned {
            object["prediction_return"] =
                serde_json::json!(direct.map(|address| address.to_string()));
            object["tokens_returned_directly"] = serde_json::json!(count);
        }
        writeln!(stdout, "{object}")?;
    } else {
        writeln!(stdout)?;
        eprintln!(
            "prompt: {} tokens at {prompt_rate:.1} tokens/s; decode: {} tokens at {decode_rate:.1} tokens/s",
            prompt.len(),
            generation.tokens.len(),
        );
    }
    Ok(())
}

/// How long a stage process's wait for SIGTERM or SIGINT lasts before it looks at the signal counts again.
const SIGNAL_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Runs a stage process until SIGTERM or SIGINT, then drains it within `--drain-timeout`.
fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let path = match &args.model {
        Some(path) => path.clone(),
        None => model::find_model(model::SMOLLM2_FILE).map_err(anyhow::Error::msg)?,
    };
    let allow_from = if args.allow_from.is_empty() {
        None
    } else {
        Some(
            TrustedProxies::parse(&args.allow_from)
                .map_err(|error| anyhow::anyhow!("--allow-from: {error}"))?,
        )
    };
    // Refusals and link failures are logged on stderr (RUST_LOG overrides the level).
    let mut telemetry = args.telemetry.init(telemetry::Identity {
        stage_index: args.stage,
        layers: args.layers.clone(),
        model_id: path
            .file_stem()
            .map(|stem| stem.to_string_lossy().into_owned()),
    });
    // Installed before the stage starts, so a signal that comes while it loads is not lost.
    let terminate = SignalWatch::install(libc::SIGTERM).context("watching SIGTERM")?;
    let interrupt = SignalWatch::install(libc::SIGINT).context("watching SIGINT")?;
    let (layers, bind, next) = match &args.topology {
        Some(file) => {
            let topology = Topology::load(file)?;
            let index = usize::from(args.stage.unwrap_or(0));
            let name = file.display().to_string();
            let stage = topology.stage(index, &name)?;
            (stage.layers.clone(), stage.address, topology.next_of(index))
        }
        None => (
            args.layers.clone().context("--layers or --topology")?,
            args.bind,
            args.next,
        ),
    };
    let mut config = StageConfig::new(path.clone(), layers.clone(), bind);
    config.next = next;
    config.lanes = args.lanes;
    config.context_length = args.context_length;
    config.cluster_key = load_key(&args.cluster_key)?;
    config.allow_from = allow_from;
    config.codec = args.codec;
    config.shape = link_shape(args.link_delay, args.link_rate)?;
    config.link_buffer = link_buffer(args.link_buffer_mib)?;
    config.connect_retry_timeout = std::time::Duration::from_millis(args.connect_retry_timeout);
    config.stage_index = args.stage;
    config.advertise = args.advertise;
    let stage = StageProcess::start(config).with_context(|| {
        format!(
            "starting the stage for layers {}..{} of {}",
            layers.start,
            layers.end,
            path.display()
        )
    })?;
    let name = args
        .stage
        .map_or_else(|| "stage".to_owned(), |index| format!("stage {index}"));
    println!(
        "{name} serving layers {}..{} on {} (width {})",
        layers.start,
        layers.end,
        stage.local_addr(),
        stage.hello().width
    );
    let metrics = match args.metrics {
        Some(address) => Some(
            telemetry::MetricsListener::start(address)
                .with_context(|| format!("starting the metrics listener on {address}"))?,
        ),
        None => None,
    };
    if let Some(metrics) = &metrics {
        println!("{name} metrics on http://{}/metrics", metrics.local_addr());
    }
    let _ = std::io::stdout().flush();
    let reason = loop {
        // The counts decide, the wake only shortens the wait: the task runtime's manager thread (started for
        // the retry and shaping timers) watches and drains the same signal eventfd, so a wake can be taken
        // before this thread sees it, and an unbounded wait would then miss the SIGTERM.
        let _ = net_io_sys::wait::wait_readable(
            net_io_sys::signal::wake_descriptor()?,
            Some(SIGNAL_POLL),
        );
        let _ = net_io_sys::signal::drain_wake();
        if terminate.take_count() > 0 {
            break "SIGTERM";
        }
        if interrupt.take_count() > 0 {
            break "SIGINT";
        }
    };
    eprintln!("{name}: draining (at most {} s)", args.drain_timeout);
    let report = stage.shutdown_because(
        std::time::Instant::now() + std::time::Duration::from_secs(args.drain_timeout),
        reason,
    );
    eprintln!(
        "{name}: stopped ({} links closed gracefully, {} cut at the deadline)",
        report.graceful, report.killed
    );
    drop(metrics);
    tracing::info!(
        stage_index = args.stage,
        reason,
        "{}",
        names::EVENT_STAGE_EXIT
    );
    telemetry.shutdown();
    Ok(())
}

/// Runs the local pipeline until Ctrl-C (or SIGTERM), or until a stage process dies.
fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut telemetry = args.telemetry.init(telemetry::Identity {
        stage_index: Some(0),
        layers: args.layers.clone(),
        model_id: args.model_id.clone().or_else(|| {
            args.model
                .as_ref()
                .and_then(|path| path.file_stem())
                .map(|stem| stem.to_string_lossy().into_owned())
        }),
    });
    let terminate = SignalWatch::install(libc::SIGTERM).context("watching SIGTERM")?;
    let interrupt = SignalWatch::install(libc::SIGINT).context("watching SIGINT")?;
    let path = match &args.model {
        Some(path) => path.clone(),
        None => model::find_model(model::SMOLLM2_FILE).map_err(anyhow::Error::msg)?,
    };
    let api_key = match (&args.api_key, &args.api_key_file) {
        (Some(key), _) => Some(key.clone()),
        (None, Some(file)) => Some(
            std::fs::read_to_string(file)
                .with_context(|| format!("reading the API key from {}", file.display()))?
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned(),
        ),
        (None, None) => None,
    };
    if api_key.as_deref() == Some("") {
        bail!("the API key is empty");
    }
    if !(args.queue_timeout > 0.0 && args.queue_timeout.is_finite()) {
        bail!(
            "--queue-timeout must be a positive number of seconds, not {}",
            args.queue_timeout
        );
    }
    let mut api = ApiConfig::new(args.http);
    api.lanes = args.lanes.max(1);
    api.queue = args.queue;
    api.queue_timeout = std::time::Duration::from_secs_f64(args.queue_timeout);
    api.batch_tokens = args.batch_tokens as usize;
    api.decode_stretch = (args.decode_stretch > 0.0).then_some(args.decode_stretch);
    api.prompt_hold_steps = args.prompt_hold_steps;
    api.batches_in_flight = args.batches_in_flight;
    api.max_per_source = args.max_connections_per_source;
    api.context_length = args.context_length;
    api.model_id = args.model_id.clone();
    api.api_key = api_key.clone();
    let shape = link_shape(args.link_delay, args.link_rate)?;
    if shape.is_shaped() && args.stages == 1 && args.next.is_none() {
        bail!(
            "--link-delay and --link-rate shape the links between stages, and --stages 1 has none; give --stages 2 or more"
        );
    }
    let mut stage_args = args.telemetry.stage_args();
    if shape.is_shaped() {
        stage_args.push("--link-delay".into());
        stage_args.push(args.link_delay.to_string().into());
        if let Some(rate) = args.link_rate {
            stage_args.push("--link-rate".into());
            stage_args.push(rate.to_string().into());
        }
    }
    let options = PipelineOptions {
        model: path.clone(),
        stages: args.stages,
        api,
        // `main` put the thread count `run_threads` chose (or the caller's) in this process's environment.
        threads: args.threads.or_else(|| {
            std::env::var("CANDLE_NUM_THREADS")
                .ok()
                .and_then(|value| value.parse().ok())
        }),
        codec: args.codec,
        executable: std::env::current_exe().context("finding this program to run the stages")?,
        load_timeout: std::time::Duration::from_secs(300),
        external: match (&args.layers, args.next) {
            (Some(layers), Some(next)) => {
                if layers.start != 0 {
                    bail!(
                        "stage 0 runs the layers from 0 (with the embeddings): --layers must be 0..K, not {}..{}",
                        layers.start,
                        layers.end
                    );
                }
                Some((layers.end, next))
            }
            _ => None,
        },
        stage_args,
        stage_metrics: args.stage_metrics,
        shape,
        chain_checks: args.checks.apply(ChainOptions::default()),
    };
    match options.external {
        Some((end, next)) => eprintln!(
            "stage-server: stage 0 (layers 0..{end} of {}) in front of the chain at {next}",
            path.display()
        ),
        None => eprintln!(
            "stage-server: starting {} stages of {}",
            args.stages,
            path.display()
        ),
    }
    let mut pipeline = LocalPipeline::start(options)?;
    let address = pipeline.api().local_addr();
    let ready = pipeline
        .api()
        .wait_ready(std::time::Duration::from_secs(300));
    if let Err(error) = ready {
        let _ = pipeline.shutdown(std::time::Instant::now(), || {});
        bail!("the pipeline did not become ready: {error}");
    }
    let ranges: Vec<String> = pipeline
        .layers()
        .iter()
        .map(|range| format!("{}..{}", range.start, range.end))
        .collect();
    let auth = api_key.as_ref().map_or(String::new(), |_| {
        " -H \"Authorization: Bearer $KEY\"".to_owned()
    });
    match args.next {
        Some(next) => println!(
            "stage-server: serving {} on http://{address}/v1 (stage 0: layers {}; the chain at {next}: layers {}; {} lanes)",
            pipeline.api().model_id(),
            ranges[0],
            ranges[1..].join(", "),
            args.lanes.max(1)
        ),
        None => println!(
            "stage-server: serving {} on http://{address}/v1 ({} stages: layers {}; {} lanes)",
            pipeline.api().model_id(),
            ranges.len(),
            ranges.join(", "),
            args.lanes.max(1)
        ),
    }
    println!(
        "  curl http://{address}/v1/chat/completions{auth} -H 'Content-Type: application/json' -d '{{\"messages\":[{{\"role\":\"user\",\"content\":\"Hello!\"}}]}}'"
    );
    let stage_metrics = pipeline.stage_metrics();
    if !stage_metrics.is_empty() {
        println!("  stage 0 metrics: http://{address}/metrics");
    }
    for (index, metrics) in stage_metrics {
        println!("  stage {index} metrics: http://{metrics}/metrics");
    }
    println!("  stage-server chat --url http://{address}");
    println!("  Ctrl-C stops every stage.");
    let _ = std::io::stdout().flush();
    let mut failure = None;
    let reason;
    loop {
        let _ = net_io_sys::wait::wait_readable(
            net_io_sys::signal::wake_descriptor()?,
            Some(std::time::Duration::from_millis(250)),
        );
        let _ = net_io_sys::signal::drain_wake();
        let signals = (terminate.take_count(), interrupt.take_count());
        if signals.0 + signals.1 > 0 {
            eprintln!("stage-server: draining (at most {} s)", args.drain_timeout);
            reason = if signals.0 > 0 { "SIGTERM" } else { "SIGINT" };
            break;
        }
        if let Some(ended) = pipeline.ended_stage() {
            eprintln!("stage-server: {ended}; stopping the others");
            failure = Some(ended);
            reason = "a stage process ended";
            break;
        }
    }
    tracing::info!(
        reason,
        drain_timeout_millis = args.drain_timeout.saturating_mul(1000),
        "{}",
        names::EVENT_PIPELINE_DRAIN
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(args.drain_timeout);
    // Stage 0's last export goes while the stage processes make theirs, so a collector that does not answer
    // costs the exit one export deadline rather than two in a row.
    let report = pipeline.shutdown(deadline, || telemetry.shutdown());
    tracing::info!(
        connections_graceful = report.graceful,
        connections_killed = report.killed,
        elapsed_millis = u64::try_from(report.elapsed.as_millis()).unwrap_or(u64::MAX),
        "{}",
        names::EVENT_PIPELINE_DRAINED
    );
    eprintln!(
        "stage-server: stopped ({} connections closed gracefully, {} cut at the deadline)",
        report.graceful, report.killed
    );
    match failure {
        Some(ended) => bail!("{ended}"),
        None => Ok(()),
    }
}

/// The terminal chat client.
fn chat(args: ChatArgs) -> anyhow::Result<()> {
    stage_server::client::run_chat(stage_server::client::ChatOptions {
        url: args.url,
        api_key: args.api_key,
        system: args.system,
        max_tokens: args.max_tokens,
        temperature: args.temperature,
    })
}

/// Tokens per second; 0 when nothing was timed.
fn rate(tokens: usize, time: std::time::Duration) -> f64 {
    let seconds = time.as_secs_f64();
    if tokens == 0 || seconds == 0.0 {
        0.0
    } else {
        tokens as f64 / seconds
    }
}

/// End-of-generation ids from the metadata: EOS and, when present, end-of-turn.
fn stop_tokens(file: &ModelFile) -> Vec<u32> {
    let mut tokens = Vec::new();
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(value) = file.content().metadata.get(key)
            && let Ok(id) = value.to_u32()
            && !tokens.contains(&id)
        {
            tokens.push(id);
        }
    }
    tokens
}

fn inspect(path: &Path) -> anyhow::Result<()> {
    let file = ModelFile::open(path)?;
    let config = file.config();
    let mut out = std::io::stdout().lock();
    writeln!(out, "file: {}", path.display())?;
    if let Some(name) = file.metadata_string("general.name") {
        writeln!(out, "name: {name}")?;
    }
    writeln!(out, "architecture: {}", config.architecture.name())?;
    writeln!(out, "layers: {}", config.block_count)?;
    writeln!(out, "embedding width: {}", config.embedding_length)?;
    writeln!(out, "feed-forward width: {}", config.feed_forward_length)?;
    writeln!(
        out,
        "heads: {} query, {} key/value, head width {}",
        config.head_count, config.head_count_kv, config.key_length
    )?;
    writeln!(out, "context length: {}", config.context_length)?;
    writeln!(out, "vocabulary: {}", config.vocab_size)?;
    writeln!(
        out,
        "rope base: {} (local {}), rms epsilon: {}",
        config.rope_base, config.rope_base_local, config.rms_epsilon
    )?;
    if let Some(window) = config.sliding_window {
        writeln!(out, "sliding window: {window}")?;
    }
    writeln!(
        out,
        "tokenizer: {} (pre-tokenizer {})",
        file.metadata_string("tokenizer.ggml.model")
            .unwrap_or("none"),
        file.metadata_string("tokenizer.ggml.pre").unwrap_or("none"),
    )?;
    writeln!(
        out,
        "chat template: {}",
        if file.metadata_string("tokenizer.chat_template").is_some() {
            "present"
        } else {
            "absent"
        }
    )?;
    writeln!(
        out,
        "output head: {}",
        if file.has_tensor("output.weight") {
            "separate"
        } else {
            "tied to token_embd"
        }
    )?;
    writeln!(out, "tensor types:")?;
    for summary in file.tensor_types() {
        writeln!(
            out,
            "  {:<6} {:>4} tensors {:>12} bytes",
            summary.type_name, summary.count, summary.bytes
        )?;
    }
    Ok(())
}
