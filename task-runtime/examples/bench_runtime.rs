//! Side-by-side benchmark: task-runtime against tokio, rayon, std threads and a crossbeam pool, 2 workers each.
//!
//! Run with `cargo xtask bench runtime` (release). Prints a markdown table, then one `method key=value ...`
//! line with every count the run used and the CPU time it took, from which the xtask writes the method and
//! how busy the rest of the machine was (so the report states what this run did, not what it once did);
//! `--memory-child NAME` is the internal mode that measures one runtime's memory per parked task in a fresh
//! process.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use task_runtime::{Compute, Runtime, Sleep, TaskHandle};

const WORKERS: usize = 2;
const BATCH: usize = 100_000;
/// Measured runs of a batch row, after one warm-up run.
const BATCH_RUNS: usize = 5;
/// The batch of `spawn_blocking` and of std threads, which cost a thread hand-off per task ...
const BLOCKING_BATCH: usize = 10_000;
const THREAD_BATCH: usize = 2_000;
/// ... and their measured runs, fewer because each run is slow.
const HAND_OFF_RUNS: usize = 3;
const ROUND_TRIPS: usize = 2_000;
/// Round trips through a fresh std thread, which cost a thread start each.
const THREAD_ROUND_TRIPS: usize = 200;
const SLEEP_SAMPLES: usize = 300;
/// Sleeps run before the measured ones.
const WARM_UPS: usize = 10;
/// Quiet before the idle window, and the window.
const IDLE_SETTLE: Duration = Duration::from_millis(1500);
const IDLE_WINDOW: Duration = Duration::from_secs(2);
const PARKED: usize = 1_000_000;

fn main() {
    let arguments: Vec<String> = std::env::args().collect();
    if arguments.get(1).map(String::as_str) == Some("--memory-child") {
        let name = arguments.get(2).map(String::as_str).unwrap_or("ours");
        println!("{}", memory_child(name));
        return;
    }
    Runtime::builder()
        .cores(WORKERS)
        .init()
        .expect("init task-runtime");
    if arguments.get(1).map(String::as_str) == Some("--spawn-only") {
        // For profiling: only our 100k batch, repeated.
        for _ in 0..20 {
            let handles: Vec<TaskHandle<u64>> = (0..BATCH as u64)
                .map(|index| Runtime::task(Compute::compute(move |()| index ^ 1)).spawn())
                .collect();
            for handle in handles {
                std::hint::black_box(handle.join().expect("join"));
            }
        }
        return;
    }
    let tokio = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(WORKERS)
        .max_blocking_threads(WORKERS)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let rayon = rayon::ThreadPoolBuilder::new()
        .num_threads(WORKERS)
        .build()
        .expect("rayon pool");
    let crossbeam = CrossbeamPool::new(WORKERS);

    let mut rows: Vec<Row> = Vec::new();

    // 1. Spawn plus join of 100,000 computes, per task (median of BATCH_RUNS runs after a warm-up).
    let ours = median_of(BATCH_RUNS, || {
        let started = Instant::now();
        let handles: Vec<TaskHandle<u64>> = (0..BATCH as u64)
            .map(|index| Runtime::task(Compute::compute(move |()| index ^ 1)).spawn())
            .collect();
        for handle in handles {
            std::hint::black_box(handle.join().expect("join"));
        }
        started.elapsed() / BATCH as u32
    });
    let tokio_spawn = median_of(BATCH_RUNS, || {
        tokio.block_on(async {
            let started = Instant::now();
            let handles: Vec<_> = (0..BATCH as u64)
                .map(|index| tokio::spawn(async move { index ^ 1 }))
                .collect();
            for handle in handles {
                std::hint::black_box(handle.await.expect("join"));
            }
            started.elapsed() / BATCH as u32
        })
    });
    let tokio_blocking = median_of(HAND_OFF_RUNS, || {
        tokio.block_on(async {
            let started = Instant::now();
            let handles: Vec<_> = (0..BLOCKING_BATCH as u64)
                .map(|index| tokio::task::spawn_blocking(move || index ^ 1))
                .collect();
            for handle in handles {
                std::hint::black_box(handle.await.expect("join"));
            }
            started.elapsed() / BLOCKING_BATCH as u32
        })
    });
    let rayon_spawn = median_of(BATCH_RUNS, || {
        let sum = AtomicU64::new(0);
        let started = Instant::now();
        rayon.scope(|scope| {
            for index in 0..BATCH as u64 {
                let sum = &sum;
                scope.spawn(move |_| {
                    sum.fetch_add(index ^ 1, Ordering::Relaxed);
                });
            }
        });
        std::hint::black_box(sum.load(Ordering::Relaxed));
        started.elapsed() / BATCH as u32
    });
    let threads = median_of(HAND_OFF_RUNS, || {
        let started = Instant::now();
        let handles: Vec<_> = (0..THREAD_BATCH as u64)
            .map(|index| std::thread::spawn(move || index ^ 1))
            .collect();
        for handle in handles {
            std::hint::black_box(handle.join().expect("join"));
        }
        started.elapsed() / THREAD_BATCH as u32
    });
    let crossbeam_batch = median_of(BATCH_RUNS, || {
        let started = Instant::now();
        let receivers: Vec<_> = (0..BATCH as u64)
            .map(|index| crossbeam.submit(move || index ^ 1))
            .collect();
        for receiver in receivers {
            std::hint::black_box(receiver.recv().expect("result"));
        }
        started.elapsed() / BATCH as u32
    });
    let blocking_label = format!(
        "tokio spawn_blocking ({}, median of {HAND_OFF_RUNS})",
        thousands(BLOCKING_BATCH)
    );
    let threads_label = format!(
        "std thread spawn+join ({}, median of {HAND_OFF_RUNS})",
        thousands(THREAD_BATCH)
    );
    rows.push(Row::durations(
        &format!(
            "spawn + join, {} computes (per task, median of {BATCH_RUNS})",
            thousands(BATCH)
        ),
        ours,
        tokio_spawn,
        &[
            (blocking_label.as_str(), tokio_blocking),
            ("rayon scope spawn", rayon_spawn),
            (threads_label.as_str(), threads),
            ("crossbeam pool", crossbeam_batch),
        ],
    ));

    // 2. One spawn-to-join round trip from outside the pool (median, warm pool).
    let ours = median_samples(ROUND_TRIPS, || {
        let started = Instant::now();
        Runtime::task(Compute::compute(|()| 1u8))
            .spawn()
            .join()
            .expect("join");
        started.elapsed()
    });
    let tokio_trip = median_samples(ROUND_TRIPS, || {
        let started = Instant::now();
        tokio.block_on(async { tokio::spawn(async { 1u8 }).await.expect("join") });
        started.elapsed()
    });
    let rayon_trip = median_samples(ROUND_TRIPS, || {
        let started = Instant::now();
        std::hint::black_box(rayon.install(|| 1u8));
        started.elapsed()
    });
    let crossbeam_trip = median_samples(ROUND_TRIPS, || {
        let started = Instant::now();
        crossbeam.submit(|| 1u64).recv().expect("result");
        started.elapsed()
    });
    let thread_trip = median_samples(THREAD_ROUND_TRIPS, || {
        let started = Instant::now();
        std::thread::spawn(|| 1u8).join().expect("join");
        started.elapsed()
    });
    rows.push(Row::durations(
        "round trip from outside the pool (median)",
        ours,
        tokio_trip,
        &[
            ("rayon install", rayon_trip),
            ("crossbeam submit+recv", crossbeam_trip),
            (
                format!("std thread spawn+join (median of {THREAD_ROUND_TRIPS})").as_str(),
                thread_trip,
            ),
        ],
    ));

    // 3. Sleep accuracy: overshoot past the requested time, median and p99.
    for requested in [Duration::from_micros(100), Duration::from_millis(1)] {
        // The sleep's own output says how much of the overshoot lies inside the task (the timer and the
        // worker that spins to the deadline); the rest is the hand-offs of the spawn and the join.
        let mut in_task = Vec::new();
        let ours = overshoot(requested, || {
            let slept = Runtime::task(Sleep::sleep(requested))
                .spawn()
                .join()
                .expect("sleep");
            in_task.push(slept.saturating_sub(requested));
        });
        let in_task = median_and_p99(in_task.split_off(WARM_UPS));
        let relaxed = overshoot(requested, || {
            Runtime::task(Sleep::sleep(requested).relaxed())
                .spawn()
                .join()
                .expect("sleep");
        });
        let tokio_sleep = overshoot(requested, || {
            tokio.block_on(async { tokio::time::sleep(requested).await });
        });
        let std_sleep = overshoot(requested, || std::thread::sleep(requested));
        let label = format!("{} µs", requested.as_micros());
        rows.push(Row::durations(
            &format!("sleep {label}: median overshoot"),
            ours.0,
            tokio_sleep.0,
            &[
                ("ours relaxed", relaxed.0),
                ("std::thread::sleep", std_sleep.0),
                ("ours, inside the task", in_task.0),
            ],
        ));
        rows.push(Row::durations(
            &format!("sleep {label}: p99 overshoot"),
            ours.1,
            tokio_sleep.1,
            &[
                ("ours relaxed", relaxed.1),
                ("std::thread::sleep", std_sleep.1),
                ("ours, inside the task", in_task.1),
            ],
        ));
    }

    // 4. Idle CPU over the window after the work above, whole process (all runtimes idle at once).
    std::thread::sleep(IDLE_SETTLE);
    let before = cpu_time();
    std::thread::sleep(IDLE_WINDOW);
    let idle = cpu_time() - before;
    rows.push(Row {
        label: format!(
            "idle CPU over {} ms (whole process, all four idle)",
            IDLE_WINDOW.as_millis()
        ),
        ours: format!("{} ms", idle.as_millis()),
        tokio: "(same process)".into(),
        ratio: "-".into(),
        others: String::new(),
    });

    // 5. Memory per live parked task at 1,000,000, each in a fresh child process.
    let ours = memory_in_child("ours");
    let tokio_memory = memory_in_child("tokio");
    rows.push(Row {
        label: format!("RSS per live parked task at {}", thousands(PARKED)),
        ours: format!("{ours} B"),
        tokio: format!("{tokio_memory} B"),
        ratio: format!("{:.2}", ours as f64 / tokio_memory.max(1) as f64),
        others: String::new(),
    });

    println!("| measurement | task-runtime | tokio | ratio (ours / tokio) | others |");
    println!("|---|---|---|---|---|");
    for row in rows {
        println!(
            "| {} | {} | {} | {} | {} |",
            row.label, row.ours, row.tokio, row.ratio, row.others
        );
    }
    // The memory children have been waited for, so their CPU time is in the children's share.
    println!(
        "method workers={WORKERS} batch={BATCH} batch_runs={BATCH_RUNS} blocking_batch={BLOCKING_BATCH} \
         thread_batch={THREAD_BATCH} hand_off_runs={HAND_OFF_RUNS} round_trips={ROUND_TRIPS} \
         round_trip_warm_ups={} thread_round_trips={THREAD_ROUND_TRIPS} thread_round_trip_warm_ups={} \
         sleep_samples={SLEEP_SAMPLES} sleep_warm_ups={WARM_UPS} idle_settle_ms={} idle_window_ms={} \
         parked={PARKED} cpu_ms={}",
        ROUND_TRIPS / 10,
        THREAD_ROUND_TRIPS / 10,
        IDLE_SETTLE.as_millis(),
        IDLE_WINDOW.as_millis(),
        (cpu_time() + children_cpu_time()).as_millis()
    );
    Runtime::shutdown();
}

struct Row {
    label: String,
    ours: String,
    tokio: String,
    ratio: String,
    others: String,
}

impl Row {
    fn durations(label: &str, ours: Duration, tokio: Duration, others: &[(&str, Duration)]) -> Row {
        Row {
            label: label.to_string(),
            ours: show(ours),
            tokio: show(tokio),
            ratio: format!("{:.2}", ours.as_secs_f64() / tokio.as_secs_f64().max(1e-12)),
            others: others
                .iter()
                .map(|(name, value)| format!("{name}: {}", show(*value)))
                .collect::<Vec<_>>()
                .join("; "),
        }
    }
}

fn show(duration: Duration) -> String {
    let nanos = duration.as_nanos();
    if nanos < 10_000 {
        format!("{nanos} ns")
    } else if nanos < 10_000_000 {
        format!("{:.1} µs", nanos as f64 / 1000.0)
    } else {
        format!("{:.2} ms", nanos as f64 / 1e6)
    }
}

fn median_of(runs: usize, mut measure: impl FnMut() -> Duration) -> Duration {
    measure();
    let mut samples: Vec<Duration> = (0..runs).map(|_| measure()).collect();
    samples.sort();
    samples[samples.len() / 2]
}

/// The median of `count` samples after `count / 10` warm-ups (the `round_trip_warm_ups` of the method line).
fn median_samples(count: usize, mut measure: impl FnMut() -> Duration) -> Duration {
    for _ in 0..count / 10 {
        measure();
    }
    let mut samples: Vec<Duration> = (0..count).map(|_| measure()).collect();
    samples.sort();
    samples[samples.len() / 2]
}

fn overshoot(requested: Duration, mut sleep: impl FnMut()) -> (Duration, Duration) {
    for _ in 0..WARM_UPS {
        sleep();
    }
    let samples: Vec<Duration> = (0..SLEEP_SAMPLES)
        .map(|_| {
            let started = Instant::now();
            sleep();
            started.elapsed().saturating_sub(requested)
        })
        .collect();
    median_and_p99(samples)
}

fn median_and_p99(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    (
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100],
    )
}

fn status_kib(name: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|line| {
            line.strip_prefix(name)?
                .strip_prefix(':')?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

/// This process's user plus system CPU time (utime and stime of /proc/self/stat, 10 ms ticks).
fn cpu_time() -> Duration {
    stat_ticks(11, 12)
}

/// The CPU time of the children this process has waited for (cutime and cstime).
fn children_cpu_time() -> Duration {
    stat_ticks(13, 14)
}

/// The sum of two tick fields of /proc/self/stat, counted from the field after the command name.
fn stat_ticks(first: usize, second: usize) -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let Some(close) = stat.rfind(')') else {
        return Duration::ZERO;
    };
    let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    let field = |index: usize| -> u64 {
        fields
            .get(index)
            .and_then(|value| value.parse().ok())
            .unwrap_or(0)
    };
    Duration::from_millis((field(first) + field(second)) * 10)
}

/// A count with thousands separators, as the table labels write it (100,000).
fn thousands(count: usize) -> String {
    let digits = count.to_string();
    let mut text = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            text.push(',');
        }
        text.push(digit);
    }
    text
}

fn memory_in_child(name: &str) -> u64 {
    let output = std::process::Command::new(std::env::current_exe().expect("current exe"))
        .args(["--memory-child", name])
        .output()
        .expect("run memory child");
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// Runs in a fresh process: RSS growth per live parked sleep (with its handle held).
fn memory_child(name: &str) -> u64 {
    match name {
        "tokio" => {
            let tokio = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(WORKERS)
                .enable_all()
                .build()
                .expect("tokio");
            tokio.block_on(async {
                let before = status_kib("VmRSS");
                let handles: Vec<_> = (0..PARKED)
                    .map(|_| tokio::spawn(tokio::time::sleep(Duration::from_secs(600))))
                    .collect();
                tokio::task::yield_now().await;
                tokio::time::sleep(Duration::from_millis(500)).await;
                let after = status_kib("VmRSS");
                handles.iter().for_each(|handle| handle.abort());
                (after.saturating_sub(before) * 1024) / PARKED as u64
            })
        }
        _ => {
            Runtime::builder().cores(WORKERS).init().expect("init");
            let before = status_kib("VmRSS");
            let handles: Vec<_> = (0..PARKED)
                .map(|_| Runtime::task(Sleep::sleep(Duration::from_secs(600))).spawn())
                .collect();
            while Runtime::pool().queued > 0 {
                std::thread::sleep(Duration::from_millis(20));
            }
            let after = status_kib("VmRSS");
            let per_task = (after.saturating_sub(before) * 1024) / PARKED as u64;
            std::mem::forget(handles);
            per_task
        }
    }
}

/// A minimal crossbeam-channel thread pool: boxed jobs on a bounded queue, a result channel per job.
struct CrossbeamPool {
    jobs: crossbeam_channel::Sender<Box<dyn FnOnce() + Send>>,
    _workers: Vec<std::thread::JoinHandle<()>>,
}

impl CrossbeamPool {
    fn new(workers: usize) -> Self {
        let (jobs, queue) = crossbeam_channel::bounded::<Box<dyn FnOnce() + Send>>(1024);
        let queue = Arc::new(queue);
        let workers = (0..workers)
            .map(|_| {
                let queue = Arc::clone(&queue);
                std::thread::spawn(move || {
                    while let Ok(job) = queue.recv() {
                        job();
                    }
                })
            })
            .collect();
        CrossbeamPool {
            jobs,
            _workers: workers,
        }
    }

    fn submit<T: Send + 'static>(
        &self,
        job: impl FnOnce() -> T + Send + 'static,
    ) -> crossbeam_channel::Receiver<T> {
        let (sender, receiver) = crossbeam_channel::bounded(1);
        let _ = self.jobs.send(Box::new(move || {
            let _ = sender.send(job());
        }));
        receiver
    }
}
