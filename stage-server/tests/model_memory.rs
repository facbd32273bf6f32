//! Resident memory of a middle stage against the whole model (its own test binary: it reads process RSS).

use std::path::Path;

use stage_server::model::testing::real_model;
use stage_server::model::{SMOLLM2_FILE, Stage, StageOptions, StageSpec};

/// Resident set size of this process in bytes, from /proc/self/status.
fn resident_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("reading /proc/self/status");
    let line = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .expect("VmRSS is in /proc/self/status");
    let kilobytes: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|value| value.parse().ok())
        .expect("VmRSS holds a number of kB");
    kilobytes * 1024
}

/// Memory a stage adds to the process while it is loaded.
fn stage_footprint(path: &Path, spec: StageSpec) -> u64 {
    let before = resident_bytes();
    let stage = Stage::load(path, spec, StageOptions::default()).expect("load the stage");
    let after = resident_bytes();
    drop(stage);
    after.saturating_sub(before)
}

#[test]
fn a_middle_stage_of_a_third_of_the_layers_holds_under_45_percent_of_the_whole_model() {
    let Some(path) = real_model(SMOLLM2_FILE) else {
        return;
    };
    let middle = stage_footprint(
        &path,
        StageSpec {
            layers: 10..20,
            first: false,
            last: false,
        },
    );
    let whole = stage_footprint(&path, StageSpec::whole(30));
    eprintln!(
        "SmolLM2 resident: middle stage 10..20 {:.1} MB, whole model {:.1} MB ({:.0}%)",
        middle as f64 / 1e6,
        whole as f64 / 1e6,
        100.0 * middle as f64 / whole as f64
    );
    assert!(
        whole > 50_000_000,
        "the whole model should hold at least 50 MB, measured {whole} bytes"
    );
    assert!(
        middle * 100 <= whole * 45,
        "the middle stage holds {middle} bytes, more than 45% of the whole model's {whole}"
    );
}
