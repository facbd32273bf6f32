//! The gate of the real-model tests: an absent model skips outside CI and fails under it, and every such test uses it.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Command;

use stage_server::model::testing::{
    MissingModel, REQUIRE_MODELS_VARIABLE, real_model, real_model_in,
};
use stage_server::model::{KNOWN_MODELS, MODEL_DIR_VARIABLE, SMOLLM2_FILE};

/// The name of the probe test this binary runs in a child process.
const PROBE: &str = "probe_asks_the_gate_for_a_real_model";

/// A fresh, empty scratch directory for one test.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stage-server-gate-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    dir
}

/// Runs [`PROBE`] in a child copy of this test binary with a model directory and the given CI variables,
/// and returns whether it passed and what it printed.
fn run_probe(model_dir: &Path, ci: Option<&str>, require_models: Option<&str>) -> (bool, String) {
    let mut command = probe_command();
    command.env(MODEL_DIR_VARIABLE, model_dir);
    if let Some(value) = ci {
        command.env("CI", value);
    }
    if let Some(value) = require_models {
        command.env(REQUIRE_MODELS_VARIABLE, value);
    }
    probe_outcome(command)
}

/// A command that runs [`PROBE`] alone in a child copy of this test binary, with neither CI variable set.
fn probe_command() -> Command {
    let mut command = Command::new(std::env::current_exe().expect("the test binary's path"));
    command
        .args([
            "--exact",
            PROBE,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env_remove("CI")
        .env_remove(REQUIRE_MODELS_VARIABLE);
    command
}

/// Runs a probe command; whether it passed, and what it printed.
fn probe_outcome(mut command: Command) -> (bool, String) {
    let output = command.output().expect("could not run the probe test");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), printed)
}

/// The message a panic carried, if it was text.
fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| {
            payload
                .downcast_ref::<&str>()
                .map(|text| (*text).to_owned())
        })
        .unwrap_or_default()
}

/// The (short name, file name, sha256) of each entry of xtask's `MODELS` table, read from its source as text.
fn xtask_pins() -> Vec<[String; 3]> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../xtask/src/models.rs");
    let source = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("could not read {}: {error}", path.display()));
    let quoted = |line: &str, field: &str| -> Option<String> {
        let rest = line.trim().strip_prefix(field)?.trim().strip_prefix('"')?;
        Some(rest.split('"').next()?.to_owned())
    };
    let mut pins = Vec::new();
    let (mut short_name, mut file_name) = (None, None);
    for line in source.lines() {
        if let Some(name) = quoted(line, "short_name:") {
            short_name = Some(name);
        } else if let Some(name) = quoted(line, "file_name:") {
            file_name = Some(name);
        } else if let Some(digest) = quoted(line, "sha256:") {
            let (Some(short_name), Some(file_name)) = (short_name.take(), file_name.take()) else {
                panic!(
                    "{}: a sha256 comes before its short_name and file_name",
                    path.display()
                );
            };
            pins.push([short_name, file_name, digest]);
        }
    }
    pins
}

#[test]
#[ignore = "run in a child process by the tests below, with the environment they set"]
fn probe_asks_the_gate_for_a_real_model() {
    match real_model(SMOLLM2_FILE) {
        Some(path) => println!("probe: found {}", path.display()),
        None => println!("probe: returned without a model"),
    }
}

#[test]
fn ci_or_the_require_variable_turns_a_missing_model_into_a_failure() {
    let cases: [(Option<&str>, Option<&str>, MissingModel); 7] = [
        (None, None, MissingModel::Skip),
        (Some(""), None, MissingModel::Skip),
        (None, Some("0"), MissingModel::Skip),
        (None, Some(""), MissingModel::Skip),
        (Some("true"), None, MissingModel::Fail),
        (Some("1"), Some("0"), MissingModel::Fail),
        (None, Some("1"), MissingModel::Fail),
    ];
    for (ci, require_models, expected) in cases {
        assert_eq!(
            MissingModel::from_variables(ci.map(OsStr::new), require_models.map(OsStr::new)),
            expected,
            "CI={ci:?} {REQUIRE_MODELS_VARIABLE}={require_models:?} chose the wrong policy"
        );
    }
}

#[test]
fn a_missing_model_skips_when_skipping_is_allowed() {
    let dir = scratch_dir("skip");
    assert_eq!(
        real_model_in(&dir, "absent.gguf", MissingModel::Skip),
        None,
        "an absent model must give None so that the test returns"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_missing_model_fails_the_test_naming_the_file_and_the_fetch_command() {
    let dir = scratch_dir("fail");
    let outcome =
        std::panic::catch_unwind(|| real_model_in(&dir, "absent.gguf", MissingModel::Fail));
    let _ = std::fs::remove_dir_all(&dir);
    let Err(payload) = outcome else {
        panic!("an absent model under MissingModel::Fail returned instead of failing the test");
    };
    let message = panic_text(&*payload);
    let missing = dir.join("absent.gguf");
    assert!(
        message.contains(&missing.display().to_string()),
        "the failure does not name the missing file {}: {message}",
        missing.display()
    );
    assert!(
        message.contains("cargo xtask fetch-models"),
        "the failure does not name the command that fetches the models: {message}"
    );
}

#[test]
fn a_present_model_is_returned_whatever_the_policy() {
    let dir = scratch_dir("present");
    let path = dir.join("present.gguf");
    std::fs::write(&path, b"GGUF").expect("writing a stand-in model file");
    for missing in [MissingModel::Skip, MissingModel::Fail] {
        assert_eq!(
            real_model_in(&dir, "present.gguf", missing),
            Some(path.clone()),
            "a present model was not returned under {missing:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_environment_decides_in_a_real_test_process() {
    // Through a child process, so the real variables (not a value passed in) are what the gate reads.
    let empty = scratch_dir("environment");
    let (passed, printed) = run_probe(&empty, None, None);
    assert!(
        passed && printed.contains("skipping:") && printed.contains("cargo xtask fetch-models"),
        "outside CI a missing model should skip with the fetch command, but the probe printed:\n{printed}"
    );
    for (ci, require_models) in [(Some("true"), None), (None, Some("1"))] {
        let (passed, printed) = run_probe(&empty, ci, require_models);
        assert!(
            !passed
                && printed.contains(SMOLLM2_FILE)
                && printed.contains("cargo xtask fetch-models"),
            "with CI={ci:?} {REQUIRE_MODELS_VARIABLE}={require_models:?} a missing model should fail the probe \
             naming the file and the fetch command, but it printed:\n{printed}"
        );
    }
    let _ = std::fs::remove_dir_all(&empty);
}

#[test]
fn an_empty_model_dir_variable_counts_as_unset() {
    // Shells leave `VAR=` set but empty; the models are then in the default directory under HOME, as
    // `cargo xtask fetch-models` (which has the same rule) put them, not in the current directory.
    let home = scratch_dir("empty-variable");
    let models = home.join(".cache/stage-server/models");
    std::fs::create_dir_all(&models).expect("creating the default model directory");
    std::fs::write(models.join(SMOLLM2_FILE), b"GGUF").expect("writing a stand-in model");
    let mut command = probe_command();
    command
        .env(MODEL_DIR_VARIABLE, "")
        .env("HOME", &home)
        .env(REQUIRE_MODELS_VARIABLE, "1");
    let (passed, printed) = probe_outcome(command);
    let _ = std::fs::remove_dir_all(&home);
    let expected = models.join(SMOLLM2_FILE);
    assert!(
        passed && printed.contains(&format!("probe: found {}", expected.display())),
        "with {MODEL_DIR_VARIABLE} empty the gate should find {} under HOME, but the probe printed:\n{printed}",
        expected.display()
    );
}

#[test]
fn every_real_model_test_goes_through_the_gate() {
    // A test that finds its model some other way would skip silently again under CI. The patterns are the ways
    // the tests used to do it (their own lookup, the variable, a `skipping:` note); skips for other reasons,
    // such as a CPU without some instructions, are worded differently.
    let tests = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let this_file = Path::new(file!())
        .file_name()
        .expect("this file has a name");
    let mut offenders = Vec::new();
    for entry in std::fs::read_dir(&tests).expect("the tests directory is readable") {
        let path = entry.expect("a directory entry").path();
        if path.extension() != Some(OsStr::new("rs")) || path.file_name() == Some(this_file) {
            continue;
        }
        let source = std::fs::read_to_string(&path).expect("a test source is readable");
        for (index, line) in source.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            let bypasses = ["find_model(", MODEL_DIR_VARIABLE, "\"skipping:"]
                .iter()
                .any(|pattern| line.contains(pattern))
                && !line.contains("real_model");
            let names_a_model = KNOWN_MODELS
                .iter()
                .any(|model| line.contains(&format!("\"{}\"", model.file_name)));
            if bypasses || names_a_model {
                offenders.push(format!("{}:{}: {}", path.display(), index + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "these lines find or name a real model without `stage_server::model::testing::real_model` (use it, and \
         the model constants, so that CI fails instead of skipping):\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_known_models_are_the_ones_xtask_pins_and_fetches() {
    let ours: Vec<[String; 3]> = KNOWN_MODELS
        .iter()
        .map(|model| [model.short_name, model.file_name, model.sha256].map(str::to_owned))
        .collect();
    assert_eq!(
        xtask_pins(),
        ours,
        "stage_server::model::KNOWN_MODELS and xtask/src/models.rs MODELS disagree on the models' names, \
         files or sha256; change both together"
    );
}
