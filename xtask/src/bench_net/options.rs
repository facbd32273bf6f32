//! The command line of `cargo xtask bench net`: its usage text, its flags and the `--loads` list.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::{ECHO_CONNECTIONS, Options, SERVER_KINDS, WORKLOADS, Workload};

pub(super) const USAGE: &str = "\
usage: cargo xtask bench net [--quick] [--rounds N] [--kinds std,tokio,floor,handler,handler-loop,sessions,sessions-loop]
                             [--loads echo1,echo16,echo256,open256,idle,churn,syscalls]
                             [--duration-ms MS] [--warmup-ms MS] [--churn-ms MS] [--churn-rate N] [--open-rate N]
                             [--idle N]
                             [--client-threads N]
                             [--output PATH | --no-write] [--no-strace]

  --quick        one short round for a smoke test (does not write the report unless --output is given)
  --rounds N     rounds per kind, order rotated each round; medians are reported (default 3)
  --kinds LIST   server kinds to measure (default: all six)
  --loads LIST   loads to measure (default: all): echo1, echo16 and echo256 are the closed-loop echo at 1, 16
                 and 256 connections, open256 the open-loop echo at 256 connections, idle the idle memory,
                 churn both connect-and-close churns, syscalls the strace count; e.g. `--loads echo256
                 --rounds 9` repeats one load to show its spread
  --duration-ms  timed window of each echo load (default 2000)
  --warmup-ms    warm-up before each echo window (default 500)
  --churn-ms     length of each connect-and-close churn (default 3000)
  --churn-rate N connects per second offered by the paced churn (default 21000, 5% over the issue's target)
  --open-rate N  messages per second offered by the open-loop echo (default 50000)
  --idle N       idle connections held for the memory figure (default 5000)
  --client-threads N  echo client threads at 16 and 256 connections (default 2; 1 at one connection)
  --output PATH  where to write the markdown report (default docs/performance/netbench.md)
  --no-strace    skip the system-call count with `strace -c -f` (done by default when strace is installed)
";

pub(super) fn parse_options(arguments: &[String]) -> Result<Options> {
    let mut options = Options {
        rounds: 3,
        kinds: SERVER_KINDS.to_vec(),
        echo_connections: ECHO_CONNECTIONS.to_vec(),
        open: true,
        open_rate: 50_000,
        idle: true,
        churn: true,
        echo_duration: Duration::from_millis(2_000),
        echo_warmup: Duration::from_millis(500),
        churn_duration: Duration::from_millis(3_000),
        churn_rate: 21_000,
        idle_connections: 5_000,
        client_threads: 2,
        output: Some(PathBuf::from("docs/performance/netbench.md")),
        strace: true,
    };
    let mut quick = false;
    let mut output_given = false;
    let mut no_write = false;
    let mut no_strace = false;
    let mut iterator = arguments.iter();
    while let Some(flag) = iterator.next() {
        let mut value = || {
            iterator
                .next()
                .with_context(|| format!("{flag} needs a value\n{USAGE}"))
        };
        let mut count = |flag: &str| -> Result<u64> {
            let text = value()?;
            match text.parse::<u64>() {
                Ok(number) if number > 0 => Ok(number),
                _ => bail!("{flag} takes a positive whole number, not `{text}`"),
            }
        };
        match flag.as_str() {
            "--quick" => quick = true,
            "--rounds" => options.rounds = count("--rounds")? as usize,
            "--duration-ms" => {
                options.echo_duration = Duration::from_millis(count("--duration-ms")?)
            }
            "--warmup-ms" => options.echo_warmup = Duration::from_millis(count("--warmup-ms")?),
            "--churn-ms" => options.churn_duration = Duration::from_millis(count("--churn-ms")?),
            "--churn-rate" => options.churn_rate = count("--churn-rate")?,
            "--open-rate" => options.open_rate = count("--open-rate")?,
            "--idle" => options.idle_connections = count("--idle")? as u32,
            "--client-threads" => options.client_threads = count("--client-threads")? as u32,
            "--output" => {
                options.output = Some(PathBuf::from(value()?));
                output_given = true;
            }
            "--no-write" => no_write = true,
            "--no-strace" => no_strace = true,
            "--loads" => {
                let loads = parse_loads(value()?)?;
                options.echo_connections = ECHO_CONNECTIONS
                    .into_iter()
                    .filter(|connections| loads.contains(&Workload::Echo(*connections)))
                    .collect();
                options.open = loads.contains(&Workload::Open);
                options.idle = loads.contains(&Workload::Idle);
                options.churn = loads.contains(&Workload::Churn);
                options.strace = loads.contains(&Workload::SystemCalls);
            }
            "--kinds" => {
                let list = value()?;
                let mut kinds = Vec::new();
                for name in list.split(',') {
                    let Some(kind) = SERVER_KINDS.iter().find(|kind| kind.name == name) else {
                        bail!(
                            "unknown server kind `{name}`; the kinds are std, tokio, floor, handler, handler-loop, sessions, sessions-loop"
                        );
                    };
                    kinds.push(*kind);
                }
                options.kinds = kinds;
            }
            "--help" | "-h" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown flag `{other}`\n{USAGE}"),
        }
    }
    if quick {
        options.rounds = 1;
        options.echo_duration = Duration::from_millis(500);
        options.echo_warmup = Duration::from_millis(200);
        options.churn_duration = Duration::from_millis(1_000);
        options.idle_connections = options.idle_connections.min(1_000);
        if !output_given {
            options.output = None;
        }
    }
    if no_write {
        options.output = None;
    }
    if no_strace {
        options.strace = false;
    }
    Ok(options)
}

/// Reads a `--loads` list such as `echo256,churn`; an unknown name is an error naming it and the valid ones.
pub(super) fn parse_loads(list: &str) -> Result<Vec<Workload>> {
    let mut loads = Vec::new();
    for name in list.split(',').map(str::trim) {
        let Some((_, load)) = WORKLOADS.iter().find(|(known, _)| *known == name) else {
            let known: Vec<&str> = WORKLOADS.iter().map(|(known, _)| *known).collect();
            bail!(
                "unknown load `{name}` in --loads; the loads are {}",
                known.join(", ")
            );
        };
        if !loads.contains(load) {
            loads.push(*load);
        }
    }
    Ok(loads)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_loads_list_selects_what_a_run_measures() {
        let arguments: Vec<String> = ["--loads", "echo256,churn", "--no-write"]
            .iter()
            .map(|word| (*word).to_owned())
            .collect();
        let options = parse_options(&arguments).unwrap();
        assert_eq!(
            options.echo_connections,
            [256],
            "only the 256-connection echo was asked for"
        );
        assert!(
            options.churn && !options.idle && !options.strace,
            "churn was asked for, idle and syscalls were not: {options:?}"
        );
        let everything = parse_options(&[]).unwrap();
        assert!(
            everything.echo_connections == ECHO_CONNECTIONS
                && everything.idle
                && everything.churn
                && everything.strace,
            "without --loads every load should run: {everything:?}"
        );
        let strace_only = parse_options(&["--loads".to_owned(), "syscalls".to_owned()]).unwrap();
        assert!(
            !strace_only.has_round_loads() && strace_only.strace,
            "syscalls alone needs no rounds: {strace_only:?}"
        );
        let vetoed = parse_options(&[
            "--loads".to_owned(),
            "syscalls".to_owned(),
            "--no-strace".to_owned(),
        ])
        .unwrap();
        assert!(
            !vetoed.strace,
            "--no-strace must win over --loads syscalls whatever the order"
        );
    }

    #[test]
    fn an_unknown_load_is_named_with_the_valid_ones() {
        let error = parse_loads("echo256,echo64").unwrap_err().to_string();
        assert_eq!(
            error,
            "unknown load `echo64` in --loads; the loads are echo1, echo16, echo256, open256, idle, churn, syscalls",
            "the error should name the bad load and list the good ones"
        );
        assert_eq!(
            parse_loads("idle,idle,echo1").unwrap(),
            [Workload::Idle, Workload::Echo(1)],
            "a repeated load is measured once"
        );
    }
}
