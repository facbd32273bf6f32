//! Stable-toolchain twin of the PROXY fuzz target: its body over seeded mutations of the seed corpus, for a bounded time.
//!
//! cargo-fuzz needs nightly, which CI does not have, so the target's body (`fuzz/checks/proxy.rs`, compiled into
//! both) also runs here. Inputs come from a fixed seed: the committed corpus headers with bytes flipped, cut,
//! repeated or extended, and random bytes after each protocol's signature. The loop stops after its case count
//! or its time budget, whichever comes first, so a loaded machine runs fewer cases instead of a longer test.

#[path = "../fuzz/checks/proxy.rs"]
mod checks;

use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::time::{Duration, Instant};

/// Wall-clock budget: long enough for hundreds of thousands of cases, short enough for every `cargo test`.
const BUDGET: Duration = Duration::from_secs(3);
/// Most cases run (reached in well under the budget on an idle machine).
const MAXIMUM_CASES: usize = 1_000_000;
/// The PROXY v2 signature.
const V2_SIGNATURE: &[u8] = b"\r\n\r\n\0\r\nQUIT\n";

/// SplitMix64: a seeded, dependency-free source of the case bytes.
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..bound` (`bound` > 0).
    fn below(&mut self, bound: usize) -> usize {
        (self.next() % bound as u64) as usize
    }

    fn byte(&mut self) -> u8 {
        self.next() as u8
    }
}

/// The committed seed headers of `fuzz/corpus/proxy`.
fn corpus() -> Vec<Vec<u8>> {
    let directory = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/proxy");
    let mut seeds: Vec<Vec<u8>> = std::fs::read_dir(&directory)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", directory.display()))
        .map(|entry| std::fs::read(entry.expect("a corpus entry").path()).expect("a seed file"))
        .collect();
    seeds.sort();
    seeds
}

/// One input: a mutated seed (with a random first byte half the time, since it sets the body limit), or random
/// bytes after the v1 prefix or the v2 signature.
fn input(seeds: &[Vec<u8>], random: &mut Random) -> Vec<u8> {
    let mut bytes = match random.below(4) {
        0 => {
            let mut bytes = b"PROXY ".to_vec();
            bytes.extend((0..random.below(120)).map(|_| random.byte()));
            return bytes;
        }
        1 => {
            let mut bytes = V2_SIGNATURE.to_vec();
            bytes.extend((0..random.below(96)).map(|_| random.byte()));
            return bytes;
        }
        _ => seeds[random.below(seeds.len())].clone(),
    };
    for _ in 0..=random.below(3) {
        if bytes.is_empty() {
            break;
        }
        let at = random.below(bytes.len());
        match random.below(5) {
            0 => bytes[at] ^= 1 << random.below(8),
            1 => bytes[at] = random.byte(),
            2 => bytes.truncate(at),
            3 => {
                let tail = bytes[at..].to_vec();
                bytes.extend_from_slice(&tail);
            }
            _ => bytes.extend((0..random.below(16)).map(|_| random.byte())),
        }
    }
    if random.below(2) == 0 && !bytes.is_empty() {
        bytes[0] = random.byte();
    }
    bytes
}

#[test]
fn the_proxy_target_holds_on_mutated_seed_headers() {
    let seeds = corpus();
    assert!(
        seeds.len() >= 5,
        "the PROXY seed corpus holds {} files, fewer than its five seeds",
        seeds.len()
    );
    for seed in &seeds {
        checks::check(seed);
    }
    let seed = 0x70_726f_7879;
    let mut random = Random(seed);
    let started = Instant::now();
    let mut cases = 0;
    while cases < MAXIMUM_CASES && started.elapsed() < BUDGET {
        let bytes = input(&seeds, &mut random);
        // The body keeps no state between cases, so a panic cannot leave anything half-updated.
        if let Err(payload) = std::panic::catch_unwind(AssertUnwindSafe(|| checks::check(&bytes))) {
            eprintln!(
                "seed {seed:#x}, case {cases}: the PROXY body panicked on the input {bytes:02x?}"
            );
            std::panic::resume_unwind(payload);
        }
        cases += 1;
    }
    eprintln!("proxy twin: {cases} inputs");
}
