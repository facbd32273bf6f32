//! The `stage-server` command line.

fn main() {
    eprintln!("stage-server: no subcommands yet");
    std::process::exit(2);
}
