//! Property: corrupt model files (flipped bytes, cut lengths) give errors, never panics.

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::GgmlDType;
use proptest::prelude::*;
use stage_server::model::testing::TinyModel;
use stage_server::model::{Logits, Stage, StageInput, StageOptions, StageSpec};

/// The pristine tiny model's bytes, written once per test binary.
fn pristine() -> &'static [u8] {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| {
        let dir = scratch_dir();
        let path = TinyModel::llama(GgmlDType::Q4_1)
            .write_to_dir(&dir)
            .expect("writing the tiny model failed");
        let bytes = std::fs::read(&path).expect("reading the tiny model");
        let _ = std::fs::remove_file(&path);
        bytes
    })
}

fn scratch_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stage-server-corrupt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("cannot create a scratch directory in the temp dir");
    dir
}

/// Opens and, if that works, runs one token through the whole model; any outcome but a panic is fine.
fn exercise(bytes: &[u8], case: u64) {
    let path = scratch_dir().join(format!("case-{case}.gguf"));
    std::fs::write(&path, bytes).expect("writing the corrupt model");
    if let Ok(mut stage) = Stage::load(&path, StageSpec::whole(4), StageOptions::default()) {
        let _ = stage.forward(0, 0, StageInput::Tokens(&[1, 5]), Logits::Last);
    }
    let _ = std::fs::remove_file(&path);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn flipped_header_bytes_never_panic(flips in prop::collection::vec((0usize..12_288, any::<u8>()), 1..6), case in any::<u64>()) {
        let mut bytes = pristine().to_vec();
        let header = bytes.len().min(12_288);
        for (offset, value) in flips {
            bytes[offset % header] = value;
        }
        exercise(&bytes, case);
    }

    #[test]
    fn files_cut_anywhere_never_panic(fraction in 0.0f64..1.0, case in any::<u64>()) {
        let bytes = pristine();
        let length = (bytes.len() as f64 * fraction) as usize;
        exercise(&bytes[..length], case);
    }
}
