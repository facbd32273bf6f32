//! `cargo xtask api-tests`: the OpenAI API conformance suite (`stage-server/tests/api`) run with the official client.
//!
//! Steps, each skipped when already done:
//! 1. a virtual environment at `target/api-venv` (`python3 -m venv`);
//! 2. `pip install -r stage-server/tests/api/requirements.txt` into it, remembered by a stamp holding the
//!    requirements file's sha256, so a changed pin reinstalls and an unchanged one costs nothing;
//! 3. the SmolLM2 model in the cache (`cargo xtask fetch-models smollm2`), unless `STAGE_SERVER_MODEL` names one;
//! 4. `cargo build -p stage-server --bin stage-server` (debug: the suite checks the API, not speed);
//! 5. `pytest -q stage-server/tests/api` with `STAGE_SERVER_BIN` and `STAGE_SERVER_MODEL` set.
//!
//! `STAGE_SERVER_STAGES` (for example `3` or `1`) passes through to pytest and narrows the stage counts.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::{cargo, models, target_directory, workspace_root};

/// The suite's directory, relative to the workspace root.
const SUITE: &str = "stage-server/tests/api";
/// The stamp inside the virtual environment: the sha256 of the requirements it was installed from.
const STAMP: &str = "requirements.sha256";

/// Prepares the Python environment, builds the server and runs the suite; fails when any test fails.
pub fn run() -> Result<()> {
    let root = workspace_root();
    let requirements = root.join(SUITE).join("requirements.txt");
    let environment = target_directory().join("api-venv");
    let python = ensure_environment(&environment, &requirements)?;
    let model = match env::var_os("STAGE_SERVER_MODEL").filter(|value| !value.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => {
            models::fetch(&["smollm2".to_owned()]).context(
                "the suite needs SmolLM2; set STAGE_SERVER_MODEL to use a model already on disk",
            )?;
            models::model_dir()?.join(models::MODELS[0].file_name)
        }
    };
    cargo(&["build", "-p", "stage-server", "--bin", "stage-server"])?;
    let binary = target_directory().join("debug").join("stage-server");
    eprintln!(
        "xtask: pytest -q {SUITE} (server {}, model {})",
        binary.display(),
        model.display()
    );
    let status = Command::new(&python)
        .args(["-m", "pytest", "-q", SUITE])
        .current_dir(&root)
        .env("STAGE_SERVER_BIN", &binary)
        .env("STAGE_SERVER_MODEL", &model)
        // No __pycache__ in the source tree.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status()
        .with_context(|| format!("could not start {} -m pytest", python.display()))?;
    match status.code() {
        Some(0) => Ok(()),
        Some(1) => bail!("the API conformance suite has failing tests (listed above by pytest)"),
        Some(5) => bail!("pytest collected no tests under {SUITE}; is the suite there?"),
        Some(code) => bail!(
            "pytest stopped with exit code {code} (2: interrupted, 3: internal error, 4: usage error); see above"
        ),
        None => bail!("pytest was killed by a signal ({status})"),
    }
}

/// Creates the virtual environment when missing and installs the pinned requirements when they changed.
///
/// Returns the environment's python.
fn ensure_environment(environment: &Path, requirements: &Path) -> Result<PathBuf> {
    let python = environment.join("bin").join("python");
    if !python.exists() {
        eprintln!("xtask: creating {}", environment.display());
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(environment)
            .status()
            .context(
                "could not start python3; the API suite needs Python 3 with the venv module",
            )?;
        if !status.success() {
            bail!(
                "`python3 -m venv {}` failed ({status}); on Debian install python3-venv",
                environment.display()
            );
        }
    }
    let digest = models::sha256_file(requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let stamp = environment.join(STAMP);
    if fs::read_to_string(&stamp).is_ok_and(|installed| installed.trim() == digest) {
        return Ok(python);
    }
    eprintln!("xtask: pip install -r {}", requirements.display());
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-q",
            "-r",
        ])
        .arg(requirements)
        .status()
        .with_context(|| format!("could not start {} -m pip", python.display()))?;
    if !status.success() {
        bail!(
            "installing the API suite's requirements failed ({status}); PyPI must be reachable, or delete {} to start afresh",
            environment.display()
        );
    }
    // Written only after a successful install, so a failed one is retried next time.
    fs::write(&stamp, format!("{digest}\n"))
        .with_context(|| format!("writing {}", stamp.display()))?;
    Ok(python)
}
