//! What the benchmark reads from /proc: CPU time, resident memory, context switches, listen overflows and the load average.

use std::fs;

use anyhow::{Context, Result};

use super::processes::command_output;
use crate::figures::median;

/// `TcpExtListenOverflows` from `/proc/net/netstat`: SYNs dropped because an accept queue was full.
pub(super) fn listen_overflows() -> Option<u64> {
    let text = fs::read_to_string("/proc/net/netstat").ok()?;
    let mut lines = text.lines().filter(|line| line.starts_with("TcpExt:"));
    let names = lines.next()?;
    let values = lines.next()?;
    names
        .split_whitespace()
        .zip(values.split_whitespace())
        .find(|(name, _)| *name == "ListenOverflows")
        .and_then(|(_, value)| value.parse().ok())
}

/// User plus system CPU time of a process, in clock ticks, from `/proc/PID/stat` (fields 14 and 15).
pub(super) fn cpu_ticks(pid: u32) -> Result<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat"))
        .with_context(|| format!("could not read /proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces; count fields after its closing parenthesis.
    let rest = text
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .context("unexpected /proc/PID/stat format")?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let user: u64 = fields
        .get(11)
        .and_then(|field| field.parse().ok())
        .context("no utime")?;
    let system: u64 = fields
        .get(12)
        .and_then(|field| field.parse().ok())
        .context("no stime")?;
    Ok(user + system)
}

/// Context switches, voluntary plus involuntary, summed over every thread of a process from
/// `/proc/PID/task/*/status`; a thread that exits between the listing and its read is left out.
pub(super) fn context_switches(pid: u32) -> Result<u64> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task"))
        .with_context(|| format!("could not list /proc/{pid}/task"))?;
    let mut total = 0;
    for task in tasks {
        let Ok(task) = task else { continue };
        let Ok(status) = fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        total += context_switches_in(&status).with_context(|| {
            format!(
                "no context switch counts in {}",
                task.path().join("status").display()
            )
        })?;
    }
    Ok(total)
}

/// `voluntary_ctxt_switches` plus `nonvoluntary_ctxt_switches` from the text of one `/proc/.../status`.
pub(super) fn context_switches_in(status: &str) -> Option<u64> {
    let count = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))
            .and_then(|value| value.trim().parse::<u64>().ok())
    };
    Some(count("voluntary_ctxt_switches")? + count("nonvoluntary_ctxt_switches")?)
}

/// Resident set size of a process in bytes, from `VmRSS` in `/proc/PID/status`.
pub(super) fn resident_bytes(pid: u32) -> Result<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("could not read /proc/{pid}/status"))?;
    let kilobytes: u64 = text
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|field| field.parse().ok())
        .context("no VmRSS line in /proc/PID/status")?;
    Ok(kilobytes * 1024)
}

pub(super) fn clock_ticks_per_second() -> f64 {
    command_output("getconf", &["CLK_TCK"])
        .and_then(|text| text.trim().parse().ok())
        .unwrap_or(100.0)
}

/// The 1-minute load average from `/proc/loadavg`.
pub(super) fn one_minute_load() -> Option<f64> {
    fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The load averages of one run: before, after, and the 1-minute figure at each measurement.
#[derive(Debug, Clone, Default)]
pub(super) struct Load {
    pub(super) before: String,
    pub(super) after: String,
    pub(super) samples: Vec<f64>,
}

impl Load {
    /// A sentence saying how loaded the machine was, from the samples, against its core count.
    pub(super) fn describe(&self, cores: usize) -> String {
        if self.samples.is_empty() {
            return "The load average could not be read during the run.".to_owned();
        }
        let lowest = self.samples.iter().copied().fold(f64::INFINITY, f64::min);
        let highest = self
            .samples
            .iter()
            .copied()
            .fold(f64::NEG_INFINITY, f64::max);
        let middle = median(&self.samples);
        // The load average counts the benchmark's own threads: two client threads plus the server's busy
        // threads, and for a moment the thousands of idle-connection workers being stopped. On a machine doing
        // nothing else a quiet run here read a median of 3.8 and a highest of 5.1 on 2 cores, so only figures
        // above three per core point to other work.
        let competing = 3.0 * cores as f64;
        let verdict = if middle > competing {
            "other work was competing for the cores during most measurements, so absolute figures are low \
             and noisy; compare the ratios, which come from the same run"
        } else if highest > competing {
            "other work competed for the cores during some measurements; compare the ratios and the \
             per-round figures"
        } else {
            "no more than the benchmark's own client and server threads (the figure counts them)"
        };
        format!(
            "1-minute load average at the start of each of the {} measurements: lowest {lowest:.2}, median \
             {middle:.2}, highest {highest:.2} on {cores} logical cores: {verdict}.",
            self.samples.len()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;
    use std::time::Duration;

    #[test]
    fn the_load_sentence_reports_the_measured_spread_and_what_it_means() {
        let busy = Load {
            samples: vec![7.5, 8.25, 3.0],
            ..Load::default()
        };
        let text = busy.describe(2);
        assert!(
            text.contains("lowest 3.00, median 7.50, highest 8.25 on 2 logical cores"),
            "the sentence lost the measured figures: {text}"
        );
        assert!(
            text.contains("during most measurements"),
            "a median load of 7.5 on 2 cores should be called competing work: {text}"
        );
        let quiet = Load {
            samples: vec![0.5, 1.25],
            ..Load::default()
        };
        assert!(
            quiet
                .describe(2)
                .contains("no more than the benchmark's own"),
            "a load under the core count should be called quiet: {}",
            quiet.describe(2)
        );
        assert!(
            Load::default().describe(2).contains("could not be read"),
            "no samples must not be reported as a quiet machine"
        );
    }

    #[test]
    fn context_switches_are_the_sum_of_the_voluntary_and_involuntary_counts() {
        let status = "\
Name:\tbench_server
State:\tS (sleeping)
Threads:\t3
voluntary_ctxt_switches:\t1500
nonvoluntary_ctxt_switches:\t42
";
        assert_eq!(
            context_switches_in(status),
            Some(1542),
            "1500 voluntary and 42 involuntary switches make 1542"
        );
        assert_eq!(
            context_switches_in("Name:\tx\nvoluntary_ctxt_switches:\t7\n"),
            None,
            "a status without the involuntary count must not read as a number"
        );
        assert_eq!(
            context_switches_in("voluntary_ctxt_switches:\tmany\nnonvoluntary_ctxt_switches:\t1\n"),
            None,
            "a count that is not a number must not read as zero"
        );
    }

    #[test]
    fn this_process_context_switches_count_every_thread() {
        // Each sleep blocks the thread, a voluntary switch the kernel counts on that thread's own status. Other
        // test threads may start and end meanwhile, so the process-wide sum is only compared with this one
        // thread's own count, read while it is still alive: the sum over all threads can never be smaller.
        let (own, whole) = thread::spawn(|| {
            for _ in 0..20 {
                thread::sleep(Duration::from_millis(1));
            }
            let own = fs::read_to_string("/proc/thread-self/status")
                .ok()
                .and_then(|status| context_switches_in(&status));
            let whole = context_switches(std::process::id());
            (own, whole)
        })
        .join()
        .expect("the sleeping thread panicked");
        let own = own.expect("could not read this thread's own context switches");
        let whole = whole.expect("could not read this process's context switches");
        assert!(
            own >= 20,
            "20 sleeps should count at least 20 switches on the sleeping thread, read {own}"
        );
        assert!(
            whole >= own,
            "the sum over the threads ({whole}) is below one thread's own count ({own}): a thread was missed"
        );
    }

    #[test]
    fn this_process_cpu_time_and_memory_are_readable_from_proc() {
        let pid = std::process::id();
        assert!(
            resident_bytes(pid).unwrap() > 0,
            "VmRSS of this process read as zero"
        );
        cpu_ticks(pid).expect("could not read this process's CPU time");
    }
}
