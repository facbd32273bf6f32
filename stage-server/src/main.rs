//! The `stage-server` command line: `generate` runs a model (optionally split into in-process stages), `inspect` describes a GGUF file.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::{Args, Parser, Subcommand};
use stage_server::chat::{ChatMessage, ChatTemplate};
use stage_server::model::{
    self, GenerateOptions, ModelFile, Pipeline, Sampler, SamplingParams, StageOptions,
};
use stage_server::tokenizer::StreamDecoder;

/// Runs layer ranges of GGUF language models.
#[derive(Debug, Parser)]
#[command(name = "stage-server", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text from a prompt, optionally split into in-process stages.
    Generate(GenerateArgs),
    /// Describe a GGUF model file: architecture, sizes, tokenizer, tensor types.
    Inspect {
        /// The GGUF file.
        file: PathBuf,
    },
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
}

fn main() {
    let cli = Cli::parse();
    if let Command::Generate(GenerateArgs {
        threads: Some(threads),
        ..
    }) = &cli.command
        && let Some(code) = reexec_with_threads(*threads)
    {
        std::process::exit(code);
    }
    let result = match cli.command {
        Command::Generate(args) => generate(args),
        Command::Inspect { file } => inspect(&file),
    };
    if let Err(error) = result {
        eprintln!("stage-server: {error:#}");
        std::process::exit(1);
    }
}

/// candle sizes its thread pool from the environment when it first computes, and changing the
/// environment of a running process is unsafe, so `--threads` re-runs the binary with it set.
/// Returns the child's exit code, or `None` when the environment already matches.
fn reexec_with_threads(threads: usize) -> Option<i32> {
    let wanted = threads.max(1).to_string();
    if std::env::var("CANDLE_NUM_THREADS").ok().as_deref() == Some(wanted.as_str()) {
        return None;
    }
    let executable = std::env::current_exe().ok()?;
    let status = std::process::Command::new(executable)
        .args(std::env::args_os().skip(1))
        .env("CANDLE_NUM_THREADS", &wanted)
        .env("RAYON_NUM_THREADS", &wanted)
        .status()
        .ok()?;
    Some(status.code().unwrap_or(1))
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
    let options = StageOptions {
        lane_count: 1,
        context_length: args.context_length,
    };
    let mut pipeline = Pipeline::from_file(&file, &args.split, options)?;
    let mut sampler = Sampler::new(SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
        repeat_penalty: args.repeat_penalty,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        penalty_last_n: 64,
    });
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
    let generation = pipeline.generate(0, &prompt, &mut sampler, &generate_options, |token| {
        let piece = match decoder.as_mut() {
            Some(decoder) => decoder.push(token),
            None => format!("{token} "),
        };
        if stream {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
        text.push_str(&piece);
    })?;
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
        let object = serde_json::json!({
            "prompt_tokens": prompt,
            "tokens": generation.tokens,
            "text": text,
            "prompt_tokens_per_second": prompt_rate,
            "decode_tokens_per_second": decode_rate,
        });
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
