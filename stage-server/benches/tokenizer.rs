//! Encode and decode throughput of the real models' tokenizers on an English paragraph and a mixed-script one.

use std::hint::black_box;
use std::time::Instant;

use candle_core::quantized::gguf_file::Content;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use stage_server::model::find_model;
use stage_server::tokenizer::{StreamDecoder, Tokenizer};

const ENGLISH: &str = "The stage server runs one contiguous layer range of a language model and hands the \
activations to the next stage. Each stage loads only the tensors its range needs, keeps a key-value cache \
per lane, and answers prefill and decode requests at absolute positions. In 2024 the first prototype ran \
3 stages on 2 cores; it reached 127 tokens per second after the kernels for Q4_1, Q5_0 and Q5_1 were added.\n\n\
    fn main() { println!(\"hello, world\"); }\n";

const MIXED: &str = "Café naïve résumé — 你好，世界！日本語のテキスト、한국어 텍스트. Ελληνικά, Русский текст, \
עברית, العربية, हिन्दी. Emoji: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 and ∀x∈ℝ: x² ≥ 0.";

/// The tokenizer of a real model, or `None` with a note when it is absent (a benchmark has no CI gate to obey).
fn load(name: &str) -> Option<Tokenizer> {
    let path = match find_model(name) {
        Ok(path) => path,
        Err(explanation) => {
            eprintln!("skipping {name}: {explanation}");
            return None;
        }
    };
    let mut file = std::fs::File::open(&path).ok()?;
    let content = Content::read(&mut file).ok()?;
    let started = Instant::now();
    let tokenizer = Tokenizer::from_gguf(&content).ok()?;
    eprintln!("{name}: Tokenizer::from_gguf took {:?}", started.elapsed());
    Some(tokenizer)
}

fn bench_tokenizers(criterion: &mut Criterion) {
    for (label, name) in [
        ("smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
        ("gemma3", "gemma-3-270m-q4_k_m.gguf"),
    ] {
        let Some(tokenizer) = load(name) else {
            continue;
        };
        let mut group = criterion.benchmark_group(format!("tokenizer/{label}"));
        // Markup is the worst case for the special-token partition: gemma has thousands of `<...>` tokens.
        let markup = "<div class=\"note\"><p>Some <b>bold</b> text &amp; a <a href=\"/x\">link</a>.</p></div>\n"
            .repeat(64);
        for (text_label, text) in [
            ("english", ENGLISH),
            ("mixed", MIXED),
            ("markup", markup.as_str()),
        ] {
            group.throughput(Throughput::Bytes(text.len() as u64));
            group.bench_function(format!("encode/{text_label}"), |bencher| {
                bencher.iter(|| tokenizer.encode(black_box(text), true, true).unwrap())
            });
            let ids = tokenizer.encode(text, false, false).unwrap();
            group.bench_function(format!("stream_decode/{text_label}"), |bencher| {
                bencher.iter(|| {
                    let mut stream = StreamDecoder::new(&tokenizer);
                    let mut length = 0;
                    for &id in black_box(&ids) {
                        length += stream.push(id).len();
                    }
                    length
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, bench_tokenizers);
criterion_main!(benches);
