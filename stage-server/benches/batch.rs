//! Batched decode: one `Stage::forward_batch` step of 1, 2, 4 and 8 lanes on the real models, to show what a
//! row costs once the weights are read for the batch. Needs `cargo xtask fetch-models`; a missing model is
//! named and skipped (a benchmark has no CI gate to obey). Threads as for the kernels bench: `RAYON_NUM_THREADS=2`.
//!
//! Every lane holds a 64-token prompt; each iteration decodes one token on each lane of the batch and trims the
//! lanes back, so every step runs at the same context length.

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput};
use stage_server::model::{
    BatchEntry, GEMMA3_FILE, Logits, ModelFile, SMOLLM2_FILE, Stage, StageInput, StageOptions,
    StageSpec, find_model,
};

const PROMPT: usize = 64;
const BATCHES: [usize; 4] = [1, 2, 4, 8];

fn bench_model(criterion: &mut Criterion, file_name: &str, short: &str) {
    let path = match find_model(file_name) {
        Ok(path) => path,
        Err(explanation) => {
            eprintln!("skipping {short}: {explanation}");
            return;
        }
    };
    let block_count = ModelFile::open(&path)
        .expect("open the model")
        .config()
        .block_count;
    let mut stage = Stage::load(
        &path,
        StageSpec::whole(block_count),
        StageOptions {
            lane_count: 8,
            context_length: None,
        },
    )
    .expect("load the model");
    let prompt: Vec<u32> = (0..PROMPT as u32).map(|index| 300 + index * 7).collect();
    for lane in 0..8 {
        stage
            .forward(lane, 0, StageInput::Tokens(&prompt), Logits::Last)
            .expect("prefill");
    }
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "default".into());
    let mut group = criterion.benchmark_group(format!("decode-step/{short}/threads-{threads}"));
    group.measurement_time(Duration::from_secs(4));
    group.sample_size(20);
    let tokens: Vec<[u32; 1]> = (0..8u32).map(|lane| [1000 + lane]).collect();
    for lanes in BATCHES {
        group.throughput(Throughput::Elements(lanes as u64));
        group.bench_with_input(
            BenchmarkId::from_parameter(lanes),
            &lanes,
            |bencher, &lanes| {
                bencher.iter(|| {
                    let entries: Vec<BatchEntry> = (0..lanes)
                        .map(|lane| BatchEntry {
                            lane,
                            position: PROMPT,
                            input: StageInput::Tokens(&tokens[lane]),
                            logits: Logits::Last,
                        })
                        .collect();
                    for result in stage.forward_batch(&entries) {
                        result.expect("a decode step");
                    }
                    for lane in 0..lanes {
                        stage.trim(lane, PROMPT).expect("trim back");
                    }
                });
            },
        );
    }
    group.finish();
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    bench_model(&mut criterion, SMOLLM2_FILE, "smollm2");
    bench_model(&mut criterion, GEMMA3_FILE, "gemma3");
    criterion.final_summary();
}
