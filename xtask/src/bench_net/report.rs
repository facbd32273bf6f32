//! The markdown report: the echo, open-loop, idle and churn tables, the ratios against tokio, the floor and the targets.

use std::fmt::Write as _;
use std::thread;
use std::time::Duration;

use super::measure::SystemCalls;
use super::processes::command_output;
use super::procfs::Load;
use super::summary::{
    ChurnPick, KindMedians, cpu_per_round_trip, echo_rates, echo_series, medians, summarise,
};
use super::{
    CHURN_TARGET, CHURN_THREADS, IDLE_SLACK, KindRound, OPEN_CONNECTIONS, Options, SERVER_KINDS,
    STRACE_ROUND_TRIPS, ServerKind,
};
use crate::figures::{PairedRatios, Spread, median};

pub(super) fn ratio(value: f64, base: Option<f64>) -> String {
    match base {
        Some(base) if base > 0.0 && value.is_finite() => format!("{:.2}x", value / base),
        _ => "-".to_owned(),
    }
}

/// The open-loop echo table: latency at a fixed offered rate, medians over the rounds, with p99 against tokio's.
pub(super) fn render_open(
    out: &mut String,
    options: &Options,
    summary: &[(ServerKind, KindMedians)],
) {
    let tokio_p99 = summary
        .iter()
        .find(|(kind, _)| kind.name == "tokio")
        .and_then(|(_, medians)| medians.open.as_ref())
        .map(|open| open.p99_microseconds);
    let _ = writeln!(
        out,
        "\n## Echo, 64 B, open loop: {} messages/s over {OPEN_CONNECTIONS} connections\n",
        options.open_rate
    );
    let _ = writeln!(
        out,
        "| Server | Sent/s | p50 (us) | p99 (us) | p99.9 (us) | Max (us) | Unanswered | Client behind schedule, max (us) | \
         Server CPU per message (us) | Cores busy, client + server | p99 vs tokio |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for (kind, medians) in summary {
        let Some(open) = &medians.open else {
            continue;
        };
        let _ = writeln!(
            out,
            "| {} | {:.0} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.2} | {:.2} | {} |",
            kind.label,
            open.sent_per_second,
            open.p50_microseconds,
            open.p99_microseconds,
            open.p999_microseconds,
            open.max_microseconds,
            open.unanswered,
            open.behind_max_microseconds,
            open.server_cpu_microseconds_per_message,
            open.cores_busy,
            ratio(open.p99_microseconds, tokio_p99),
        );
    }
    let _ = writeln!(
        out,
        "\nThe closed-loop latency above is what a client that waits for each echo sees; it hides how long a \
         message would have waited had it been sent on time (coordinated omission). Here messages leave on a \
         fixed schedule whatever the replies do, and each latency runs from the message's scheduled time, so a \
         stall shows in every message scheduled during it. Lower is better; a p99 ratio under 1.00x beats \
         tokio. The client's own lateness (column \"behind\") is part of the figure: on two shared cores a \
         server that keeps the CPU longer delays the client's writer too."
    );
}

/// The echo table: medians of every kind at every measured connection count, with the ratios of medians.
pub(super) fn render_echo(
    out: &mut String,
    options: &Options,
    summary: &[(ServerKind, KindMedians)],
) {
    let peer = |name: &str, connections: u32| {
        summary
            .iter()
            .find(|(kind, _)| kind.name == name)
            .and_then(|(_, medians)| medians.echo_at(connections))
    };
    let _ = writeln!(out, "## Echo, 64 B, closed loop\n");
    let _ = writeln!(
        out,
        "| Server | Connections | Round trips/s | p50 (us) | p99 (us) | Server CPU per round trip (us) | \
         Server context switches per round trip | Client CPU per round trip (us) | Client context switches per \
         round trip | Cores busy, client + server | rt/s vs std | rt/s vs tokio | p50 vs std |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for connections in &options.echo_connections {
        let std_echo = peer("std", *connections);
        let tokio_echo = peer("tokio", *connections);
        for (kind, medians) in summary {
            let Some(echo) = medians.echo_at(*connections) else {
                continue;
            };
            let _ = writeln!(
                out,
                "| {} | {connections} | {:.0} | {:.1} | {:.1} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {} | {} |",
                kind.label,
                echo.round_trips_per_second,
                echo.p50_microseconds,
                echo.p99_microseconds,
                echo.server_cpu_microseconds_per_round_trip,
                echo.server_context_switches_per_round_trip,
                echo.client_cpu_microseconds_per_round_trip,
                echo.client_context_switches_per_round_trip,
                echo.cores_busy,
                ratio(
                    echo.round_trips_per_second,
                    std_echo.map(|echo| echo.round_trips_per_second)
                ),
                ratio(
                    echo.round_trips_per_second,
                    tokio_echo.map(|echo| echo.round_trips_per_second)
                ),
                ratio(
                    echo.p50_microseconds,
                    std_echo.map(|echo| echo.p50_microseconds)
                ),
            );
        }
    }
    let cores = thread::available_parallelism().map_or(2, |count| count.get());
    let _ = writeln!(
        out,
        "\nHow to read the added columns: the CPU columns are user plus system time over the timed window from \
         `/proc/PID/stat` (the client's too, since it runs on the same {cores} cores), divided by the round \
         trips in the window; context switches are `voluntary_ctxt_switches` plus `nonvoluntary_ctxt_switches` \
         summed over the server's threads (`/proc/PID/task/*/status`), read at the same moments. Cores busy is \
         client plus server CPU time over the window's wall time. Near {cores}, the two filled the machine: \
         throughput is then bounded by the CPU, every microsecond the client spends per round trip is one the \
         server cannot show, and a server goes faster only by costing less CPU per round trip, so server CPU \
         and context switches per round trip are the steadier comparison. Well below {cores}, either client \
         and server waited on each other (one connection: each wakes the other once per round trip, about one \
         context switch each) or other work took the rest (see the load average above). A server that blocks a \
         thread once per round trip shows about one context switch per round trip and pays for each in CPU. \
         The client's context switches count how often its threads slept (a lock-step client sleeps when the \
         echo it reads next has not come) or were preempted: each sleep costs a wake-up that a server's `send` \
         pays for, and that may take the server's core (see `floor.md`)."
    );
}

/// Round trips/s of every kind against tokio's in the same round, with the median, lowest and highest ratio.
pub(super) fn render_ratios_against_tokio(
    out: &mut String,
    options: &Options,
    results: &[Vec<KindRound>],
) {
    let Some(tokio_index) = options.kinds.iter().position(|kind| kind.name == "tokio") else {
        return;
    };
    let tokio_rounds = &results[tokio_index];
    let _ = writeln!(out, "\n## Round trips/s against tokio, round by round\n");
    let _ = writeln!(
        out,
        "Each round measures every kind once (order rotated by one each round), so a kind's round pairs with \
         tokio's round of the same number. The headline ratio, in the echo table's `rt/s vs tokio` column and \
         in the targets below, stays the **ratio of medians** (a kind's median round trips/s over tokio's), as \
         in every earlier run, so that figures stay comparable across runs. The per-round ratios beside it show \
         how firm that headline is: their lowest and highest give the range a single round could have reported, \
         and their median cancels a slow phase of the machine that hit both sides of a round, if the phase \
         lasted longer than the time between the two measurements (the column \"apart\"; every load a run \
         selects lengthens it, so `--loads echo256` pairs them closest). A kind's own spread (highest minus \
         lowest round trips/s, as a share of its median) shows how much the machine moved under it. When the \
         range of ratios straddles a target, one run of this length cannot settle it.\n\n\
         Why a ratio is what it is: round trips/s equal the cores client and server kept busy divided by the \
         CPU one round trip cost them both, so each round's ratio is the product of two ratios, whose medians \
         over the rounds close the table. **From cores busy** is how much more of the machine the pair used \
         than tokio's pair: above 1 where tokio's workers and the client waited on each other, or where other \
         work took the cores while tokio was measured; and under competing load, a server with more runnable \
         threads wins a larger share of the cores from the scheduler, which shows here and not as efficiency. **From CPU per round trip** is how much less client \
         plus server CPU a round trip cost than with tokio (tokio's cost over this kind's): the server's own \
         efficiency, plus what its way of replying saved or cost the client. The second is the steadier one \
         on a shared machine.\n"
    );
    let _ = writeln!(
        out,
        "| Server | Connections | Round trips/s per round | Own spread | Apart from tokio's, at most (s) | \
         vs tokio per round | Median of ratios | Lowest | Highest | Ratio of medians (headline) | \
         From cores busy | From CPU per round trip |"
    );
    let _ = writeln!(
        out,
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"
    );
    let times = |value: f64| {
        if value.is_finite() {
            format!("{value:.2}x")
        } else {
            "-".to_owned()
        }
    };
    for connections in &options.echo_connections {
        let tokio_rates = echo_rates(tokio_rounds, *connections);
        for (kind, rounds) in options.kinds.iter().zip(results) {
            let rates = echo_rates(rounds, *connections);
            let own = Spread::of(&rates);
            let listed = rates
                .iter()
                .map(|rate| format!("{rate:.0}"))
                .collect::<Vec<_>>()
                .join(", ");
            if kind.name == "tokio" {
                let _ = writeln!(
                    out,
                    "| {} | {connections} | {listed} | {:.0}% | - | - | - | - | - | - | - | - |",
                    kind.label,
                    own.range_of_median() * 100.0
                );
                continue;
            }
            let paired = PairedRatios::new(&rates, &tokio_rates);
            let per_round = paired
                .per_round
                .iter()
                .map(|ratio| times(*ratio))
                .collect::<Vec<_>>()
                .join(", ");
            let apart = rounds
                .iter()
                .zip(tokio_rounds)
                .map(|(ours, tokio)| ours.started.abs_diff(tokio.started).as_secs_f64())
                .fold(0.0, f64::max);
            // Round trips/s = cores busy / CPU per round trip, so each round's ratio is the product of these two
            // ratios (up to the few milliseconds between the client's window and the xtask's readings).
            let from_cores = PairedRatios::new(
                &echo_series(rounds, *connections, |echo| echo.cores_busy),
                &echo_series(tokio_rounds, *connections, |echo| echo.cores_busy),
            );
            let from_cost = PairedRatios::new(
                &echo_series(tokio_rounds, *connections, cpu_per_round_trip),
                &echo_series(rounds, *connections, cpu_per_round_trip),
            );
            let _ = writeln!(
                out,
                "| {} | {connections} | {listed} | {:.0}% | {apart:.0} | {per_round} | {} | {} | {} | {} | {} | {} |",
                kind.label,
                own.range_of_median() * 100.0,
                times(paired.median),
                times(paired.lowest),
                times(paired.highest),
                times(median(&rates) / median(&tokio_rates)),
                times(from_cores.median),
                times(from_cost.median),
            );
        }
    }
}

pub(super) fn render_report(
    options: &Options,
    results: &[Vec<KindRound>],
    system_calls: &[(ServerKind, SystemCalls)],
    elapsed: Duration,
    load: &Load,
    arguments: &[String],
) -> String {
    let summary: Vec<(ServerKind, KindMedians)> = options
        .kinds
        .iter()
        .zip(results)
        .map(|(kind, rounds)| (*kind, medians(rounds)))
        .collect();
    let find = |name: &str| {
        summary
            .iter()
            .find(|(kind, _)| kind.name == name)
            .map(|(_, m)| m)
    };
    let std_medians = find("std");
    let tokio_medians = find("tokio");

    let mut out = String::new();
    let _ = writeln!(
        out,
        "# net-io-blocking beside std and tokio: echo, idle memory, churn\n"
    );
    let _ = writeln!(
        out,
        "Produced by `cargo xtask bench net{}{}`; every figure is the median of {} round{}, and every ratio compares \
         stacks measured in this same run on this same machine.\n",
        if arguments.is_empty() { "" } else { " " },
        arguments.join(" "),
        options.rounds,
        if options.rounds == 1 { "" } else { "s" },
    );
    let _ = writeln!(out, "## Machine\n");
    let cpu_model = command_output("lscpu", &[])
        .and_then(|text| {
            text.lines()
                .find(|line| line.starts_with("Model name:"))
                .map(|line| line.trim_start_matches("Model name:").trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let cores = thread::available_parallelism().map_or(0, |count| count.get());
    let kernel = command_output("uname", &["-r"]).unwrap_or_else(|| "unknown".to_owned());
    let commit = command_output("git", &["rev-parse", "--short", "HEAD"])
        .unwrap_or_else(|| "unknown".to_owned());
    let dirty = command_output("git", &["status", "--porcelain", "--untracked-files=no"])
        .is_some_and(|text| !text.is_empty());
    let _ = writeln!(out, "- CPU: {cpu_model}, {cores} logical cores");
    let _ = writeln!(out, "- Kernel: {kernel}");
    let _ = writeln!(
        out,
        "- Commit: {commit}{}",
        if dirty {
            " (with uncommitted changes)"
        } else {
            ""
        }
    );
    let _ = writeln!(
        out,
        "- Load average (1, 5, 15 min) before: {}; after: {} (the figure after can jump \
         with the benchmark's own momentary wake-ups, such as 5,000 workers stopping at once). Run took {:.0} s.",
        load.before,
        load.after,
        elapsed.as_secs_f64()
    );
    let _ = writeln!(out, "- {}\n", load.describe(cores));

    if !options.echo_connections.is_empty() {
        render_echo(&mut out, options, &summary);
        render_ratios_against_tokio(&mut out, options, results);
    }
    if options.open {
        render_open(&mut out, options, &summary);
    }

    if options.idle {
        let _ = writeln!(out, "\n## Idle memory\n");
        let _ = writeln!(
            out,
            "| Server | RSS growth per idle connection (KiB) | Whole RSS / idle connections (KiB) | Idle connections served |"
        );
        let _ = writeln!(out, "|---|---:|---:|---:|");
        for (kind, medians) in &summary {
            let _ = writeln!(
                out,
                "| {} | {:.1} | {:.1} | {:.0} of {} |",
                kind.label,
                medians.idle_kib_per_connection,
                medians.idle_total_kib_per_connection,
                medians.idle_served,
                options.idle_connections,
            );
        }
    }

    if options.churn {
        let _ = writeln!(out, "\n## Connect-and-close churn\n");
        let churns: [(&str, ChurnPick); 2] = [
            ("Paced at the offered rate", |medians| &medians.churn_paced),
            ("Saturated (unpaced)", |medians| &medians.churn_saturated),
        ];
        let _ = writeln!(
            out,
            "| Server | Churn | Connects/s | Server accepts/s | Stalled connects (> 500 ms) | Listen overflows | Connect errors | p99 connect (us) | Slowest connect (ms) | vs std | vs tokio |"
        );
        let _ = writeln!(
            out,
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
        );
        for (name, pick) in churns {
            let name = if name.starts_with("Paced") {
                format!("paced, {} offered/s", options.churn_rate)
            } else {
                name.to_lowercase()
            };
            for (kind, medians) in &summary {
                let churn = pick(medians);
                let _ = writeln!(
                    out,
                    "| {} | {name} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {} | {} |",
                    kind.label,
                    churn.per_second,
                    churn.server_accepts_per_second,
                    churn.stalled,
                    churn.listen_overflows,
                    churn.errors,
                    churn.p99_microseconds,
                    churn.slowest_milliseconds,
                    ratio(churn.per_second, std_medians.map(|m| pick(m).per_second)),
                    ratio(churn.per_second, tokio_medians.map(|m| pick(m).per_second)),
                );
            }
        }
    }

    if !system_calls.is_empty() {
        let _ = writeln!(
            out,
            "\n## System calls per round trip, counted from outside\n\n\
             `strace -c -f` attached to the server (all its threads) after the client's one connection was open, \
             over {STRACE_ROUND_TRIPS} round trips of 64 B, with 2 workers for the net-io-blocking kinds (attaching \
             interrupts every idle worker's wait once, which a large pool would add to the count); the client's \
             own calls are not counted. strace slows \
             every call, which can change how often an event loop finds nothing ready, so read this as a count, \
             not a speed.\n"
        );
        let _ = writeln!(
            out,
            "| Server | Calls per round trip | Most frequent (per round trip) |"
        );
        let _ = writeln!(out, "|---|---:|---|");
        for (kind, counted) in system_calls {
            let top = counted
                .top
                .iter()
                .map(|(name, count)| format!("{name} {count:.2}"))
                .collect::<Vec<_>>()
                .join(", ");
            let _ = writeln!(
                out,
                "| {} | {:.2} | {top} |",
                kind.label, counted.per_round_trip
            );
        }
    }

    let rounds_of = |name: &str| {
        options
            .kinds
            .iter()
            .position(|kind| kind.name == name)
            .map(|index| results[index].as_slice())
    };
    let tokio_rounds = rounds_of("tokio");
    if options.has_round_loads() {
        let _ = writeln!(out, "\n## Targets of issue 2, checked against this run\n");
        let mut any_target = false;
        for name in ["handler", "handler-loop", "sessions", "sessions-loop"] {
            let (Some(ours), Some(ours_rounds)) = (find(name), rounds_of(name)) else {
                continue;
            };
            any_target = true;
            let label = SERVER_KINDS
                .iter()
                .find(|kind| kind.name == name)
                .map_or(name, |kind| kind.label);
            let _ = writeln!(out, "{label}:\n");
            let peers = Peers {
                std: std_medians,
                tokio: tokio_medians,
                tokio_rounds,
            };
            for line in target_lines(ours, ours_rounds, &peers, options) {
                let _ = writeln!(out, "- {line}");
            }
            let _ = writeln!(out);
        }
        if !any_target {
            let _ = writeln!(out, "No net-io-blocking kind was measured in this run.\n");
        }
        for line in floor_lines(&find, tokio_medians) {
            let _ = writeln!(out, "{line}");
        }
    } else {
        let _ = writeln!(out);
    }

    let _ = writeln!(out, "## Method\n");
    let threads = options.client_threads;
    let _ = writeln!(
        out,
        "- Servers (`net-io-blocking/examples/bench_server.rs`), each its own process bound to 127.0.0.1 port 0: \
         **std**, a thread per connection (default stack) with `TCP_NODELAY` and a 4 KiB buffer; **tokio**, a \
         multi-thread runtime with 2 workers and a task per connection with a 4 KiB buffer; **floor**, a yardstick \
         rather than a peer: one loop thread per core with its own level-triggered epoll, one `read` and one \
         `write` per round trip and nothing else (no deadlines, limits, kills, gate, events or statistics), so \
         it shows what the kernel's path alone allows here; **handler** and \
         **sessions**, net-io-blocking with a blocking handler (4 KiB buffer on the worker stack) and with a \
         sans-IO session echoing what they read, 320 workers (so 256 connections fit beside those still closing), \
         a 4 KiB read buffer, the per-source cap raised to the global cap (every client is 127.0.0.1) and a \
         10-minute idle timeout (std and tokio have none); every other limit is the default (backlog 1,024). \
         **handler-loop** runs the same handler on a coroutine per connection over one event-loop thread per \
         core (`HandlerDriver::Coroutines`, 256 KiB of stack address space each) and **sessions-loop** the same \
         session on the event-loop driver; both cap connections at 8,192 by default. \
         A fresh server process is started for the echo loads, for the idle figure and for the churn.\n\
         - Echo client (`bench_client echo`): closed loop, one 64 B message in flight per connection. It opens \
         the connections (one round trip each, so all are served), then splits them over 1, {threads} and {threads} client threads for \
         1, 16 and 256 connections; each thread writes one message on each of its connections, then reads each \
         echo in order, with blocking sockets. A round trip's latency runs from its write to the end of its \
         read; all round trips inside the window are sampled. Warm-up {} ms, timed window {} ms. Closed-loop p99 \
         understates the latency an open-loop load would see (coordinated omission). How to read the latency \
         at 16 and 256 connections: in a lock-step round a message also waits for the client to write and read \
         the others of its thread, so p50 there is mostly the client's round time; and by Little's law a closed \
         loop with N messages in flight has a mean latency of N divided by its throughput, so with 256 \
         connections a p99 under 2 ms needs well over 128,000 round trips/s, which client and server sharing \
         two cores cannot reach here. `--client-threads` changes the split (256 gives one thread per \
         connection).\n\
         - Open-loop echo (`bench_client open`, load `open256`, a fresh server): 256 connections, one writer \
         thread sending 64 B messages round robin on a fixed schedule of `--open-rate` per second (several may be \
         in flight on one connection) and one reader thread taking the echoes through epoll; a latency runs from \
         the message's scheduled time to the end of its echo, for every message scheduled in the timed window \
         (same warm-up and window as the closed loop); echoes missing 1 s after the writer's last message are \
         unanswered. Server CPU per message is read as for the closed loop.\n\
         - Server CPU per round trip: utime + stime of the server from `/proc/PID/stat` at the start and end of \
         the timed window (10 ms ticks, so at low rates it is coarse), divided by the round trips in the window. \
         Client CPU per round trip is read the same way from the client's `/proc/PID/stat`, and server context \
         switches per round trip from the voluntary and involuntary counts of every server thread in \
         `/proc/PID/task/*/status`, at the same two moments. Cores busy is the client's and the server's CPU \
         time together over the wall time between the two readings.\n\
         - Idle memory: the server's `VmRSS` from `/proc/PID/status` before and 300 ms after the client opened \
         {} connections one after the other (each doing one 8 B round trip, then staying open), divided by the \
         connections it served; and the whole RSS with them open divided by the same count, which also \
         charges the pre-spawned worker pool of the net-io-blocking kinds (started with {} + {IDLE_SLACK} \
         workers for this measurement, since a blocking worker holds each open connection) and the base \
         process of every kind.\n\
         - Churn (`bench_client churn`): {CHURN_THREADS} client threads connect and close for {} ms; every close \
         is an RST (`SO_LINGER` 0) so no TIME_WAIT piles up on either side. Each kind runs it twice, each time \
         against a fresh server. **Paced**: the threads share a fixed schedule of {} connects/s (open loop; a \
         thread more than 5 ms behind skips the missed slots instead of bursting), which asks whether the \
         server sustains that rate. **Saturated**: every thread connects as fast as it can. On loopback a \
         connect completes in the kernel without the server, so the saturated client offers whatever its own \
         CPU share allows, and any server it out-runs for long enough fills its accept queue: the kernel then \
         drops a SYN (`TcpExtListenOverflows`) and that client thread waits for the 1 s SYN retransmit. With \
         {CHURN_THREADS} threads a server the client out-runs therefore shows about {CHURN_THREADS} stalls per \
         second however fast it is, and its rate mostly measures those waits: read it as overload behaviour, \
         and the paced figure as the capacity check (see docs/performance/netbench-churn.md). Connects per second run \
         over the whole time until the last connect ended; a connect over 500 ms counts as stalled; p99 is of \
         the successful connects' own durations. Server accepts/s is the count the server reports at exit over \
         the same time; listen overflows is the growth of `TcpExtListenOverflows` in `/proc/net/netstat` \
         during the churn (machine-wide, so another helper's server could add to it). std and tokio listen \
         with their default backlog (128 from `TcpListener::bind`), net-io-blocking with 1,024.\n\
         - Client and server share the same two cores, so from 16 connections on the client takes a large share \
         of the CPU and the throughput figures are partly client-bound; the client CPU and cores busy columns \
         show how much in each measurement.\n\
         - Each round runs every kind once, with the order rotated by one each round; the medians over rounds \
         are reported, and the throughput against tokio also round by round (a kind's round over tokio's round \
         of the same number). `--loads` selects the loads (for example `--loads echo256 --rounds 9` for the \
         spread of one figure). Raw per-round figures follow; per round trip, `server` is the server's CPU \
         and context switches (`cs`), `client` the client's CPU, and `cores` the cores the two kept busy.",
        options.echo_warmup.as_millis(),
        options.echo_duration.as_millis(),
        options.idle_connections,
        options.idle_connections,
        options.churn_duration.as_millis(),
        options.churn_rate,
    );

    let _ = writeln!(out, "\n## Per-round figures\n");
    let _ = writeln!(out, "```text");
    for (kind, rounds) in options.kinds.iter().zip(results) {
        for (index, round) in rounds.iter().enumerate() {
            let _ = writeln!(
                out,
                "{:8} round {}: {}",
                kind.name,
                index + 1,
                summarise(round, options)
            );
        }
    }
    let _ = writeln!(out, "```");
    out
}

/// What the targets compare a net-io-blocking kind against.
#[derive(Debug, Clone, Copy)]
pub(super) struct Peers<'a> {
    pub(super) std: Option<&'a KindMedians>,
    pub(super) tokio: Option<&'a KindMedians>,
    /// Tokio's rounds, to pair with ours round by round.
    pub(super) tokio_rounds: Option<&'a [KindRound]>,
}

/// What the bare epoll echo (`floor`) reached, if this run measured it: its throughput against tokio's is
/// the most any epoll server with one `recv` and one `send` per round trip could show here, and each
/// net-io-blocking kind's share of it is what its driver costs.
pub(super) fn floor_lines<'a>(
    find: &dyn Fn(&str) -> Option<&'a KindMedians>,
    tokio: Option<&KindMedians>,
) -> Vec<String> {
    let Some(floor) = find("floor") else {
        return Vec::new();
    };
    let mut lines = vec!["## Against the floor\n".to_owned()];
    for connections in [1, 16, 256] {
        let Some(floor_echo) = floor.echo_at(connections) else {
            continue;
        };
        let floor_rate = floor_echo.round_trips_per_second;
        let mut parts = vec![format!("{floor_rate:.0} rt/s for the floor")];
        if let Some(tokio_echo) = tokio.and_then(|tokio| tokio.echo_at(connections)) {
            parts.push(format!(
                "{:.2}x tokio's",
                floor_rate / tokio_echo.round_trips_per_second
            ));
        }
        for name in ["handler", "handler-loop", "sessions", "sessions-loop"] {
            if let Some(echo) = find(name).and_then(|ours| ours.echo_at(connections)) {
                parts.push(format!(
                    "{name} {:.0}% of it",
                    echo.round_trips_per_second / floor_rate * 100.0
                ));
            }
        }
        let noun = if connections == 1 {
            "connection"
        } else {
            "connections"
        };
        lines.push(format!("- {connections} {noun}: {}", parts.join(", ")));
    }
    lines.push(String::new());
    lines
}

/// The issue's targets that this run measured, each with the measured figure and whether this run met it.
///
/// The throughput targets are judged on the ratio of medians, as in every earlier run; the per-round ratios
/// follow in brackets so that a verdict resting on one lucky or unlucky round shows as such.
pub(super) fn target_lines(
    ours: &KindMedians,
    ours_rounds: &[KindRound],
    peers: &Peers<'_>,
    options: &Options,
) -> Vec<String> {
    let verdict = |met: bool| if met { "met" } else { "missed" };
    let mut lines = Vec::new();
    if let (Some(ours_echo), Some(std_echo)) =
        (ours.echo_at(1), peers.std.and_then(|std| std.echo_at(1)))
    {
        let ours_p50 = ours_echo.p50_microseconds;
        let std_p50 = std_echo.p50_microseconds;
        lines.push(format!(
            "1 connection, p50 within 5% of std's: {ours_p50:.1} us vs {std_p50:.1} us ({:+.1}%): {}",
            (ours_p50 / std_p50 - 1.0) * 100.0,
            verdict(ours_p50 <= std_p50 * 1.05)
        ));
    }
    if let (Some(tokio), Some(tokio_rounds)) = (peers.tokio, peers.tokio_rounds) {
        for connections in [16, 256] {
            let (Some(ours_echo), Some(tokio_echo)) =
                (ours.echo_at(connections), tokio.echo_at(connections))
            else {
                continue;
            };
            let headline = ours_echo.round_trips_per_second / tokio_echo.round_trips_per_second;
            let paired = PairedRatios::new(
                &echo_rates(ours_rounds, connections),
                &echo_rates(tokio_rounds, connections),
            );
            let rounds_met = paired
                .per_round
                .iter()
                .filter(|ratio| **ratio >= 1.2)
                .count();
            lines.push(format!(
                "{connections} connections, at least 1.2x tokio's round trips/s: {headline:.2}x (ratio of \
                 medians; per round median {:.2}x, lowest {:.2}x, highest {:.2}x, at least 1.2x in {rounds_met} \
                 of {} rounds): {}",
                paired.median,
                paired.lowest,
                paired.highest,
                paired.per_round.len(),
                verdict(headline >= 1.2)
            ));
        }
    }
    if let Some(echo) = ours.echo_at(256) {
        let p99 = echo.p99_microseconds;
        lines.push(format!(
            "256 connections, p99 under 2 ms: {:.2} ms: {}",
            p99 / 1_000.0,
            verdict(p99 < 2_000.0)
        ));
    }
    if options.churn {
        let paced = ours.churn_paced;
        lines.push(format!(
            "churn at least {CHURN_TARGET:.0} connects/s with no stalled connect, offered {}/s on a \
             schedule: {:.0}/s, {:.0} stalled: {}",
            options.churn_rate,
            paced.per_second,
            paced.stalled,
            verdict(paced.per_second >= CHURN_TARGET && paced.stalled == 0.0)
        ));
    }
    if options.idle {
        // A blocking worker holds each idle connection, and the pool was spawned before the "before" reading,
        // so only the whole-process figure charges the connections for their threads.
        lines.push(format!(
            "idle memory at most 16 KiB per connection, counting the whole process with the workers that hold \
             the connections: {:.1} KiB ({:.1} KiB of growth after the pool was up): {}",
            ours.idle_total_kib_per_connection,
            ours.idle_kib_per_connection,
            verdict(ours.idle_total_kib_per_connection <= 16.0)
        ));
    }
    lines.push(
        "2 system calls and 0 allocations per round trip: checked by the `syscalls` and `allocations` tests of \
         net-io-blocking, not here"
            .to_owned(),
    );
    lines
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench_net::EchoResult;
    use crate::bench_net::options::parse_options;

    /// One kind's rounds with the given round trips/s at 256 connections, begun `offset` seconds into
    /// rounds that start every 30 s.
    fn rounds_at_256(rates: &[f64], offset: u64) -> Vec<KindRound> {
        rates
            .iter()
            .enumerate()
            .map(|(round, rate)| KindRound {
                started: Duration::from_secs(round as u64 * 30 + offset),
                echo: vec![EchoResult {
                    connections: 256,
                    round_trips_per_second: *rate,
                    p50_microseconds: 1_000.0,
                    p99_microseconds: 1_900.0,
                    server_cpu_microseconds_per_round_trip: 6.0,
                    server_context_switches_per_round_trip: 0.25,
                    client_context_switches_per_round_trip: 0.5,
                    client_cpu_microseconds_per_round_trip: 8.0,
                    cores_busy: 1.9,
                }],
                ..KindRound::default()
            })
            .collect()
    }

    #[test]
    fn the_report_shows_each_rounds_ratio_against_tokio_beside_the_ratio_of_medians() {
        let arguments: Vec<String> = [
            "--loads",
            "echo256",
            "--kinds",
            "tokio,sessions-loop",
            "--no-write",
        ]
        .iter()
        .map(|word| (*word).to_owned())
        .collect();
        let options = parse_options(&arguments).unwrap();
        // Tokio's fast second round pairs with ours: per round 1.20x, 1.05x, 1.13x (median 1.13x), while
        // the ratio of medians is 120,000 over 100,000, 1.20x.
        let mut results = vec![
            rounds_at_256(&[100_000.0, 200_000.0, 80_000.0], 0),
            rounds_at_256(&[120_000.0, 210_000.0, 90_000.0], 12),
        ];
        // Tokio's pair kept half the cores busy (a factor of 2 from cores busy), and a round trip cost our
        // server 3 us instead of 6 (11 us against 14 with the client's 8: a factor of 14 / 11 = 1.27).
        for round in &mut results[0] {
            round.echo[0].cores_busy = 0.95;
        }
        for round in &mut results[1] {
            round.echo[0].server_cpu_microseconds_per_round_trip = 3.0;
        }
        let report = render_report(
            &options,
            &results,
            &[],
            Duration::from_secs(1),
            &Load::default(),
            &arguments,
        );
        assert!(
            report.contains(
                "| net-io-blocking sessions, event loop | 256 | 120000, 210000, 90000 | 100% | 12 | 1.20x, \
                 1.05x, 1.12x | 1.12x | 1.05x | 1.20x | 1.20x | 2.00x | 1.27x |"
            ),
            "the ratio table lost the per-round ratios, their statistics or the two factors:\n{report}"
        );
        assert!(
            report
                .contains("| tokio multi-thread, 2 workers | 256 | 100000, 200000, 80000 | 120% |"),
            "tokio's own spread should be listed:\n{report}"
        );
        assert!(
            report.contains(
                "256 connections, at least 1.2x tokio's round trips/s: 1.20x (ratio of medians; per round \
                 median 1.12x, lowest 1.05x, highest 1.20x, at least 1.2x in 1 of 3 rounds): met"
            ),
            "the target line should keep the ratio of medians as its verdict and show the rounds:\n{report}"
        );
        assert!(
            report.contains("| 0.25 | 8.00 | 0.50 | 1.90 |"),
            "the echo table lost the context switch, client CPU, client context switch or cores busy column:\n{report}"
        );
        assert!(
            !report.contains("## Idle memory") && !report.contains("## Connect-and-close churn"),
            "loads that were not selected must not be reported:\n{report}"
        );
        assert!(
            !report.contains("churn at least") && !report.contains("idle memory at most"),
            "targets of loads that were not measured must not be judged:\n{report}"
        );
    }
}
