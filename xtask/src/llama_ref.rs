//! `cargo xtask llama-ref`: installs llama.cpp's prebuilt libraries from npm, builds our `llama_ref` driver and
//! writes the llama.cpp agreement fixtures.
//!
//! Layout (all outside version control):
//!
//! ```text
//! $LLAMA_CPP_NPM_DIR (default <workspace>/target/llama-ref)
//!   node_modules/@node-llama-cpp/linux-x64/bins/linux-x64/   libllama, libggml*, 13 libggml-cpu-<variant>.so
//!   node_modules/node-llama-cpp/llama/gitRelease.bundle     the matching llama.cpp source, as a git bundle
//!   llama.cpp-src/                                          its clone: the headers, and the server's source
//! <workspace>/target/llama-ref/
//!   llama_ref                                               built from xtask/llama-ref/llama_ref.cpp
//!   variants/haswell/libggml-cpu-haswell.so                 a folder with one variant, to force AVX2 only
//!   server-build/bin/{llama-server,ggml-rpc-server}         built from llama.cpp-src with cmake (`server`)
//! ```

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

use crate::models::{self, MODELS, ModelFile, run_checked};
use crate::workspace_root;

/// The pinned npm package carrying llama.cpp's prebuilt libraries and its source bundle.
pub const NPM_PACKAGE: &str = "node-llama-cpp@3.21.1";
/// What the libraries are, for reports and fixtures.
pub const LLAMA_CPP_VERSION: &str =
    "llama.cpp v0.4.0 (commit 80fb11ac) from npm node-llama-cpp 3.21.1";
/// The environment variable naming the folder where `node_modules` lives.
pub const NPM_DIR_VARIABLE: &str = "LLAMA_CPP_NPM_DIR";

/// The token count generated greedily for every fixture prompt.
const GENERATED_TOKENS: usize = 64;
/// How many of the highest logits each fixture position keeps.
const TOP_COUNT: usize = 32;
/// The fixture prompts: a fact, code, a list and a longer sentence.
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "A shopping list for a picnic:\n1.",
    "After the long winter, the villagers gathered in the square to decide how they would rebuild the old \
     stone bridge, and the eldest among them said",
];

/// The cmake options of the llama-server build: tuned for this CPU, with the RPC backend for split runs, and
/// without the network libraries a loopback benchmark does not need (and this machine may not have).
///
/// Tuned for this CPU except for AMX: on a Sapphire Rapids guest (`amx_int8` in /proc/cpuinfo) the server of
/// this llama.cpp version, built with `-march=native`, dies with SIGSEGV in `ggml_backend_amx_mul_mat` on
/// its warm-up pass over SmolLM2's Q4_1 weights, before it answers `/health` (seen in session 12, gdb
/// backtrace in docs/PERFORMANCE.md). `-mno-amx-*` keeps every other native extension (AVX-512, VNNI, BF16)
/// and leaves its AVX-512 kernels to do the work; on a CPU without AMX the flags change nothing.
const SERVER_CMAKE_OPTIONS: [&str; 7] = [
    "-DGGML_NATIVE=ON",
    "-DGGML_RPC=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
];
/// The server binaries built, in `server-build/bin`.
const SERVER_TARGETS: [&str; 2] = ["llama-server", "ggml-rpc-server"];

/// Dispatches `cargo xtask llama-ref <install|build|fixtures|server>`.
pub fn run(arguments: &[String]) -> Result<()> {
    match arguments.first().map(String::as_str) {
        Some("install") => install(),
        Some("build") => build().map(|binary| eprintln!("xtask: built {}", binary.display())),
        Some("fixtures") => fixtures(),
        Some("server") => {
            ensure_server_built().map(|binary| eprintln!("xtask: built {}", binary.display()))
        }
        _ => bail!("`cargo xtask llama-ref` takes one of: install, build, fixtures, server"),
    }
}

/// The folder holding `node_modules`: `$LLAMA_CPP_NPM_DIR`, or `<workspace>/target/llama-ref`.
pub fn npm_dir() -> PathBuf {
    env::var_os(NPM_DIR_VARIABLE)
        .filter(|value| !value.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(output_dir)
}

/// Where the driver and the forced-variant folders are built.
fn output_dir() -> PathBuf {
    workspace_root().join("target/llama-ref")
}

/// The folder with the prebuilt libraries and every CPU variant.
pub fn library_dir() -> PathBuf {
    npm_dir().join("node_modules/@node-llama-cpp/linux-x64/bins/linux-x64")
}

/// Runs the npm install and unpacks the headers.
fn install() -> Result<()> {
    let directory = npm_dir();
    fs::create_dir_all(&directory)
        .with_context(|| format!("could not create {}", directory.display()))?;
    if !directory.join("package.json").exists() {
        run_checked(
            Command::new("npm")
                .args(["init", "-y"])
                .current_dir(&directory),
            "npm init -y (is npm installed?)",
        )?;
    }
    eprintln!(
        "xtask: npm i -E {NPM_PACKAGE} in {} (about a minute, 700 MB with the optional GPU packages)",
        directory.display()
    );
    run_checked(
        Command::new("npm")
            .args(["i", "-E", NPM_PACKAGE, "--no-audit", "--no-fund"])
            .current_dir(&directory),
        &format!("npm i -E {NPM_PACKAGE}"),
    )?;
    headers_dir()?;
    eprintln!("xtask: llama.cpp libraries in {}", library_dir().display());
    Ok(())
}

/// The llama.cpp source clone holding the headers, cloned from the npm package's bundle when missing.
fn headers_dir() -> Result<PathBuf> {
    let source = npm_dir().join("llama.cpp-src");
    if source.join("include/llama.h").exists() {
        return Ok(source);
    }
    let bundle = npm_dir().join("node_modules/node-llama-cpp/llama/gitRelease.bundle");
    ensure!(
        bundle.exists(),
        "{} is missing; run `cargo xtask llama-ref install` (or set {NPM_DIR_VARIABLE} to a folder where \
         `npm i -E {NPM_PACKAGE}` was run)",
        bundle.display()
    );
    run_checked(
        Command::new("git")
            .args(["clone", "--quiet"])
            .arg(&bundle)
            .arg(&source),
        "git clone of the llama.cpp bundle",
    )?;
    Ok(source)
}

/// Compiles `xtask/llama-ref/llama_ref.cpp` with the system g++ and returns the binary's path.
pub fn build() -> Result<PathBuf> {
    let libraries = library_dir();
    ensure!(
        libraries.join("libllama.v0.4.0.so").exists(),
        "llama.cpp's prebuilt libraries are not in {}; run `cargo xtask llama-ref install` first",
        libraries.display()
    );
    let headers = headers_dir()?;
    let source = workspace_root().join("xtask/llama-ref/llama_ref.cpp");
    let output = output_dir();
    fs::create_dir_all(&output)?;
    let binary = output.join("llama_ref");
    run_checked(
        Command::new("g++")
            .args(["-O2", "-std=c++17", "-Wall", "-Wextra"])
            .arg(&source)
            .arg(format!("-I{}", headers.join("include").display()))
            .arg(format!("-I{}", headers.join("ggml/include").display()))
            .arg(format!("-L{}", libraries.display()))
            .args([
                "-l:libllama.v0.4.0.so",
                "-l:libggml.v0.4.0.so",
                "-l:libggml-base.so",
            ])
            .arg(format!("-Wl,-rpath,{}", libraries.display()))
            .arg("-o")
            .arg(&binary),
        "g++ llama_ref.cpp (is g++ installed?)",
    )?;
    // The AVX2-only comparison point the model benchmark needs.
    forced_variant_dir("haswell")?;
    Ok(binary)
}

/// Builds the driver unless it is newer than its source.
pub fn ensure_built() -> Result<PathBuf> {
    let binary = output_dir().join("llama_ref");
    let source = workspace_root().join("xtask/llama-ref/llama_ref.cpp");
    let modified = |path: &Path| {
        fs::metadata(path)
            .and_then(|metadata| metadata.modified())
            .ok()
    };
    match (modified(&binary), modified(&source)) {
        (Some(built), Some(written)) if built >= written => Ok(binary),
        _ => build(),
    }
}

/// Builds `llama-server` and `ggml-rpc-server` from the npm package's llama.cpp source unless both are there;
/// returns the path of `llama-server`.
///
/// The build takes about 15 minutes on two cores, so it runs under `nice -n 15` (the machine is shared with
/// other builds) with its progress on the terminal. The version is pinned by [`NPM_PACKAGE`], so binaries
/// that exist are taken as current; delete `target/llama-ref/server-build` to rebuild.
pub fn ensure_server_built() -> Result<PathBuf> {
    let build_dir = output_dir().join("server-build");
    let binary_dir = build_dir.join("bin");
    if SERVER_TARGETS
        .iter()
        .all(|target| binary_dir.join(target).exists())
    {
        return Ok(binary_dir.join("llama-server"));
    }
    let found_cmake = Command::new("cmake")
        .arg("--version")
        .stdout(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success());
    ensure!(
        found_cmake,
        "cmake is not installed; install it (Debian: `apt-get install -y cmake`) and run          `cargo xtask llama-ref server` again"
    );
    let bundle = npm_dir().join("node_modules/node-llama-cpp/llama/gitRelease.bundle");
    if !bundle.exists() {
        install()?;
    }
    let source = headers_dir()?;
    eprintln!(
        "xtask: building {} from {} into {} (about 15 minutes on two cores)",
        SERVER_TARGETS.join(" and "),
        source.display(),
        build_dir.display()
    );
    let mut configure = Command::new("nice");
    configure
        .args(["-n", "15", "cmake", "-S"])
        .arg(&source)
        .arg("-B")
        .arg(&build_dir)
        .args(SERVER_CMAKE_OPTIONS);
    run_visible(&mut configure, "cmake configure of llama.cpp")?;
    let mut compile = Command::new("nice");
    compile
        .args(["-n", "15", "cmake", "--build"])
        .arg(&build_dir)
        .args(["-j2", "--target"])
        .args(SERVER_TARGETS);
    run_visible(&mut compile, "cmake --build of llama-server")?;
    let binary = binary_dir.join("llama-server");
    ensure!(
        binary.exists(),
        "the llama.cpp build finished but left no {}",
        binary.display()
    );
    Ok(binary)
}

/// Runs a long command with its output on the terminal, so a build's progress shows while it runs.
fn run_visible(command: &mut Command, what: &str) -> Result<()> {
    let status = command
        .status()
        .with_context(|| format!("could not start {what}"))?;
    ensure!(
        status.success(),
        "{what} failed with {status} (its output is above)"
    );
    Ok(())
}

/// A folder holding only `libggml-cpu-<variant>.so`, so ggml can load nothing else.
pub fn forced_variant_dir(variant: &str) -> Result<PathBuf> {
    let file_name = format!("libggml-cpu-{variant}.so");
    let original = library_dir().join(&file_name);
    ensure!(original.exists(), "{} does not exist", original.display());
    let folder = output_dir().join("variants").join(variant);
    fs::create_dir_all(&folder)?;
    let copy = folder.join(&file_name);
    if !copy.exists() {
        fs::copy(&original, &copy).with_context(|| {
            format!(
                "could not copy {} into {}",
                original.display(),
                folder.display()
            )
        })?;
    }
    Ok(folder)
}

/// Runs the driver with the given backend folder and arguments, returning its JSON line.
pub fn invoke(
    binary: &Path,
    backends: &Path,
    model: &Path,
    arguments: &[&str],
) -> Result<serde_json::Value> {
    let output = Command::new(binary)
        .arg("--backends")
        .arg(backends)
        .arg("--model")
        .arg(model)
        .args(arguments)
        .output()
        .with_context(|| format!("could not start {}", binary.display()))?;
    if !output.status.success() {
        bail!(
            "llama_ref {} failed with {}: {}",
            arguments.join(" "),
            output.status,
            String::from_utf8_lossy(&output.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&output.stdout);
    serde_json::from_str(text.trim())
        .with_context(|| format!("llama_ref printed unexpected output: {text}"))
}

/// Writes `stage-server/tests/fixtures/llama_cpp/<short name>.json` for every model in the cache.
fn fixtures() -> Result<()> {
    let binary = ensure_built()?;
    let model_dir = models::model_dir()?;
    let fixture_dir = workspace_root().join("stage-server/tests/fixtures/llama_cpp");
    fs::create_dir_all(&fixture_dir)?;
    for model in MODELS {
        let path = model_dir.join(model.file_name);
        if !path.exists() {
            eprintln!(
                "xtask: {} is missing; run `cargo xtask fetch-models` (skipping its fixture)",
                path.display()
            );
            continue;
        }
        let text = fixture_for(&binary, &model, &path)?;
        let destination = fixture_dir.join(format!("{}.json", model.short_name));
        fs::write(&destination, text)
            .with_context(|| format!("could not write {}", destination.display()))?;
        eprintln!("xtask: wrote {}", destination.display());
    }
    Ok(())
}

/// Runs every prompt through llama.cpp (best variant, 2 threads) and renders the fixture JSON.
fn fixture_for(binary: &Path, model: &ModelFile, path: &Path) -> Result<String> {
    let scratch = env::temp_dir().join(format!("xtask-logits-{}.f32", std::process::id()));
    let generate = GENERATED_TOKENS.to_string();
    let scratch_text = scratch.to_string_lossy().into_owned();
    let mut variant = String::new();
    let mut vocabulary = 0;
    let mut cases = Vec::new();
    for prompt in PROMPTS {
        let reply = invoke(
            binary,
            &library_dir(),
            path,
            &[
                "--threads",
                "2",
                "run",
                "--prompt",
                prompt,
                "--generate",
                &generate,
                "--logits-out",
                &scratch_text,
            ],
        )?;
        variant = reply["variant"].as_str().unwrap_or("unknown").to_owned();
        vocabulary = reply["vocabulary"]
            .as_u64()
            .context("llama_ref gave no vocabulary")? as usize;
        let ids = |key: &str| -> Result<Vec<u64>> {
            reply[key]
                .as_array()
                .with_context(|| format!("llama_ref gave no {key}"))?
                .iter()
                .map(|id| id.as_u64().context("a token id is not a number"))
                .collect()
        };
        let prompt_ids = ids("prompt_ids")?;
        let generated_ids = ids("generated_ids")?;
        let generated_margins: Vec<f64> = reply["generated_margins"]
            .as_array()
            .context("llama_ref gave no generated_margins")?
            .iter()
            .map(|margin| margin.as_f64().context("a margin is not a number"))
            .collect::<Result<_>>()?;
        let bytes =
            fs::read(&scratch).with_context(|| format!("could not read {}", scratch.display()))?;
        let _ = fs::remove_file(&scratch);
        let rows = prompt_ids.len() + generated_ids.len();
        ensure!(
            bytes.len() == rows * vocabulary * 4,
            "llama_ref wrote {} bytes of logits, expected {rows} rows of {vocabulary} f32",
            bytes.len()
        );
        let logits: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
            .collect();
        let positions: Vec<String> = logits.chunks_exact(vocabulary).map(position_json).collect();
        cases.push(format!(
            "{{\"prompt\":{},\"prompt_ids\":{},\"generated_ids\":{},\"generated_margins\":{},\
             \"positions\":[\n{}\n]}}",
            serde_json::to_string(prompt)?,
            serde_json::to_string(&prompt_ids)?,
            serde_json::to_string(&generated_ids)?,
            serde_json::to_string(&generated_margins)?,
            positions.join(",\n")
        ));
    }
    Ok(format!(
        "{{\"model\":{},\"model_sha256\":\"{}\",\"reference\":{},\"cpu_variant\":\"{variant}\",\"threads\":2,\
         \"vocabulary\":{vocabulary},\"top_count\":{TOP_COUNT},\
         \"method\":\"greedy generation of {GENERATED_TOKENS} tokens (end-of-generation ignored), then the \
         whole stream teacher-forced in one batch; one position per stream token, giving the logits that \
         predict the next token; generated_margins are the top-2 margins of the incremental greedy steps\",\"cases\":[\n{}\n]}}\n",
        serde_json::to_string(model.file_name)?,
        model.sha256,
        serde_json::to_string(LLAMA_CPP_VERSION)?,
        cases.join(",\n")
    ))
}

/// One position's summary: argmax, top-2 margin, logsumexp (in f64) and the top (id, logit) pairs.
fn position_json(row: &[f32]) -> String {
    let summary = summarize(row, TOP_COUNT);
    let mut text = format!(
        "{{\"argmax\":{},\"margin\":{:.4},\"logsumexp\":{:.4},\"top\":[",
        summary.top[0].0, summary.margin, summary.logsumexp
    );
    for (index, (id, logit)) in summary.top.iter().enumerate() {
        let separator = if index == 0 { "" } else { "," };
        let _ = write!(text, "{separator}[{id},{logit:.4}]");
    }
    text.push_str("]}");
    text
}

/// The summary of one row of logits.
#[derive(Debug)]
struct Summary {
    top: Vec<(usize, f32)>,
    margin: f32,
    logsumexp: f64,
}

/// Sorts out the `count` largest logits (ties by lower id) and the log-sum-exp over the whole row.
fn summarize(row: &[f32], count: usize) -> Summary {
    let mut order: Vec<usize> = (0..row.len()).collect();
    let count = count.min(row.len());
    order.select_nth_unstable_by(count.saturating_sub(1), |&a, &b| {
        row[b].total_cmp(&row[a]).then(a.cmp(&b))
    });
    let mut top: Vec<(usize, f32)> = order[..count].iter().map(|&id| (id, row[id])).collect();
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    let maximum = f64::from(top[0].1);
    let sum: f64 = row
        .iter()
        .map(|&logit| (f64::from(logit) - maximum).exp())
        .sum();
    let margin = if top.len() > 1 {
        top[0].1 - top[1].1
    } else {
        f32::INFINITY
    };
    Summary {
        top,
        margin,
        logsumexp: maximum + sum.ln(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_summary_orders_the_top_logits_and_measures_the_margin() {
        let row = [0.5_f32, 3.0, -1.0, 2.0, 3.0, 1.0];
        let summary = summarize(&row, 3);
        assert_eq!(
            summary.top,
            vec![(1, 3.0), (4, 3.0), (3, 2.0)],
            "the top three must be sorted by logit, ties by lower id"
        );
        assert_eq!(summary.margin, 0.0, "a tie at the top has margin zero");
        let expected: f64 = row.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        assert!(
            (summary.logsumexp - expected).abs() < 1e-12,
            "logsumexp {} differs from the direct sum {expected}",
            summary.logsumexp
        );
    }

    #[test]
    fn a_position_renders_as_one_json_object() {
        let text = position_json(&[1.0, 4.0, 2.5]);
        let value: serde_json::Value =
            serde_json::from_str(&text).expect("position JSON must parse");
        assert_eq!(value["argmax"], 1, "the argmax of [1, 4, 2.5] is id 1");
        assert_eq!(value["margin"].as_f64(), Some(1.5), "the margin is 4 - 2.5");
        assert_eq!(
            value["top"].as_array().map(Vec::len),
            Some(3),
            "all three entries are kept"
        );
    }
}
