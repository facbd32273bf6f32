//! Quantised matmul speed: our kernels against candle's `QMatMul` on the shapes of SmolLM2 and gemma-3.
//!
//! The thread count is process-wide (candle's pool is sized once from `RAYON_NUM_THREADS`), so run the bench once
//! per count: `RAYON_NUM_THREADS=1 cargo bench -p stage-server --bench kernels` and again with 2. Benchmark names
//! carry the count.
//!
//! With one thread the bench measures the process's CPU time, not wall time: on a shared, overloaded machine wall
//! time mostly measures the scheduler. With more threads it measures wall time (CPU time would count the pool's
//! spinning), so those figures carry the machine's load.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};
use criterion::measurement::{Measurement, ValueFormatter, WallTime};
use criterion::{BenchmarkId, Criterion, Throughput};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use stage_server::kernels::{
    ActivationPrecision, QuantizedMatrix, SimdLevel, Threads, WeightFormat,
};

/// (format, out_features, in_features, input rows, what it is).
const CASES: [(WeightFormat, usize, usize, usize, &str); 26] = [
    (WeightFormat::Q5_K, 640, 2048, 1, "q5_k-ffn-down"),
    (WeightFormat::Q4_K, 640, 1024, 1, "gemma-attn-output"),
    (WeightFormat::Q4_K, 640, 2048, 1, "gemma-ffn-down"),
    (WeightFormat::Q4_K, 640, 2048, 4, "gemma-ffn-down-batch-4"),
    (WeightFormat::Q6_K, 640, 2048, 1, "gemma-ffn-down"),
    (WeightFormat::Q6_K, 640, 2048, 4, "gemma-ffn-down-batch-4"),
    (WeightFormat::Q4_1, 1536, 576, 1, "smollm2-ffn-up"),
    (WeightFormat::Q4_1, 1536, 576, 2, "smollm2-ffn-up-batch-2"),
    (WeightFormat::Q4_1, 1536, 576, 4, "smollm2-ffn-up-batch-4"),
    (WeightFormat::Q4_1, 1536, 576, 8, "smollm2-ffn-up-batch-8"),
    (WeightFormat::Q4_1, 576, 1536, 1, "smollm2-ffn-down"),
    (WeightFormat::Q4_1, 576, 576, 1, "smollm2-attn-q"),
    (WeightFormat::Q5_0, 2048, 640, 1, "gemma-ffn-up"),
    (WeightFormat::Q5_1, 1536, 576, 1, "q5_1-ffn-up"),
    (WeightFormat::Q4_0, 1536, 576, 1, "q4_0-ffn-up"),
    (WeightFormat::Q8_0, 49152, 576, 1, "smollm2-head"),
    (WeightFormat::Q8_0, 49152, 576, 4, "smollm2-head-batch-4"),
    (
        WeightFormat::Q4_1,
        1536 * 64,
        576,
        1,
        "smollm2-64-ffn-up-cold",
    ),
    (
        WeightFormat::Q5_0,
        2048 * 32,
        640,
        1,
        "gemma-32-ffn-up-cold",
    ),
    (WeightFormat::Q8_0, 262144, 640, 1, "gemma-head"),
    (WeightFormat::Q4_1, 1536, 576, 128, "smollm2-ffn-up-prefill"),
    (WeightFormat::Q5_0, 2048, 640, 128, "gemma-ffn-up-prefill"),
    (WeightFormat::Q8_0, 1536, 576, 128, "q8_0-ffn-up-prefill"),
    (WeightFormat::Q4_0, 1536, 576, 128, "q4_0-ffn-up-prefill"),
    (WeightFormat::Q8_0, 2048, 1536, 1, "q8_0-candle-repacked"),
    (
        WeightFormat::Q8_0,
        2048,
        1536,
        128,
        "q8_0-candle-repacked-prefill",
    ),
];

fn random_tensor(format: WeightFormat, rows: usize, columns: usize, rng: &mut StdRng) -> QTensor {
    let mut bytes = vec![0u8; format.bytes_of(rows * columns)];
    rng.fill(bytes.as_mut_slice());
    // Where each ggml block keeps its f16 scales (random bytes elsewhere are valid values).
    let scales: &[usize] = match format {
        WeightFormat::Q4_1 | WeightFormat::Q5_1 | WeightFormat::Q4_K | WeightFormat::Q5_K => {
            &[0, 2]
        }
        WeightFormat::Q6_K => &[208],
        _ => &[0],
    };
    for block in bytes.chunks_exact_mut(format.ggml_block_bytes()) {
        for &at in scales {
            let value = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
            block[at..at + 2].copy_from_slice(&value.to_bits().to_le_bytes());
        }
    }
    let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, format.ggml()).unwrap();
    QTensor::new(storage, (rows, columns)).unwrap()
}

/// CPU time consumed by the whole process (`CLOCK_PROCESS_CPUTIME_ID`).
struct CpuTime;

/// Prints nanosecond values in the unit that suits them.
struct NanosecondFormatter;

impl Measurement for CpuTime {
    type Intermediate = Duration;
    type Value = Duration;

    fn start(&self) -> Duration {
        process_cpu_time()
    }
    fn end(&self, start: Duration) -> Duration {
        process_cpu_time().saturating_sub(start)
    }
    fn add(&self, a: &Duration, b: &Duration) -> Duration {
        *a + *b
    }
    fn zero(&self) -> Duration {
        Duration::ZERO
    }
    fn to_f64(&self, value: &Duration) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        &NanosecondFormatter
    }
}

impl ValueFormatter for NanosecondFormatter {
    fn scale_values(&self, typical: f64, values: &mut [f64]) -> &'static str {
        let (factor, unit) = if typical < 1e3 {
            (1.0, "ns")
        } else if typical < 1e6 {
            (1e-3, "µs")
        } else if typical < 1e9 {
            (1e-6, "ms")
        } else {
            (1e-9, "s")
        };
        for value in values {
            *value *= factor;
        }
        unit
    }
    fn scale_throughputs(
        &self,
        _typical: f64,
        throughput: &Throughput,
        values: &mut [f64],
    ) -> &'static str {
        let Throughput::Bytes(bytes) = throughput else {
            return "per ns";
        };
        for value in values {
            // value is ns per iteration: GB/s = bytes / ns.
            *value = *bytes as f64 / *value;
        }
        "GB/s"
    }
    fn scale_for_machines(&self, _values: &mut [f64]) -> &'static str {
        "ns"
    }
}

fn process_cpu_time() -> Duration {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes one timespec through a valid pointer; CLOCK_PROCESS_CPUTIME_ID always exists
    // on Linux.
    let status = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut now) };
    assert_eq!(status, 0, "clock_gettime(CLOCK_PROCESS_CPUTIME_ID) failed");
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

fn matmul<M: Measurement>(criterion: &mut Criterion<M>) {
    let threads = candle_core::utils::get_num_threads();
    let best = SimdLevel::detect();
    let mut rng = StdRng::seed_from_u64(7);
    for (format, rows, columns, batch, name) in CASES {
        let tensor = Arc::new(random_tensor(format, rows, columns, &mut rng));
        let ours = QuantizedMatrix::new(tensor.clone()).unwrap();
        let candle = QMatMul::from_arc(tensor).unwrap();
        let input: Vec<f32> = (0..batch * columns)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        let input_tensor = Tensor::from_vec(input.clone(), (batch, columns), &Device::Cpu).unwrap();
        let mut output = vec![0f32; batch * rows];

        let mut group = criterion.benchmark_group(format!(
            "{name}-{format:?}-{rows}x{columns}-m{batch}-t{threads}"
        ));
        group.throughput(Throughput::Bytes(format.bytes_of(rows * columns) as u64));
        group.bench_function("candle", |bencher| {
            bencher.iter(|| candle.forward(&input_tensor).unwrap())
        });
        for level in [SimdLevel::Avx2, best] {
            if !level.is_available() {
                continue;
            }
            group.bench_function(BenchmarkId::new("ours", format!("{level:?}")), |bencher| {
                bencher.iter(|| {
                    ours.matmul(&input, batch, &mut output, level, Threads::Pool)
                        .unwrap()
                })
            });
            if best == SimdLevel::Avx2 {
                break;
            }
        }
        // Wide activations (a residual byte per value): their cost beside one byte.
        {
            let wide = ours.clone().with_precision(ActivationPrecision::Wide);
            group.bench_function(
                BenchmarkId::new("ours-wide", format!("{best:?}")),
                |bencher| {
                    bencher.iter(|| {
                        wide.matmul(&input, batch, &mut output, best, Threads::Pool)
                            .unwrap()
                    })
                },
            );
        }
        group.finish();
    }
}

fn main() {
    let configure = |criterion: Criterion<WallTime>| {
        criterion
            .sample_size(20)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(2))
            .configure_from_args()
    };
    if candle_core::utils::get_num_threads() == 1 {
        let mut criterion = configure(Criterion::default()).with_measurement(CpuTime);
        matmul(&mut criterion);
        criterion.final_summary();
    } else {
        let mut criterion = configure(Criterion::default());
        matmul(&mut criterion);
        criterion.final_summary();
    }
}
