//! Token ids and decoded text against llama.cpp's, over the committed fixture of awkward strings, on the real models.

use candle_core::quantized::gguf_file::Content;
use serde::Deserialize;
use stage_server::model::testing::real_model;
use stage_server::model::{GEMMA3_FILE, SMOLLM2_FILE};
use stage_server::tokenizer::{SpecialTokens, StreamDecoder, Tokenizer};

#[derive(Deserialize)]
struct Fixture {
    models: std::collections::BTreeMap<String, ModelCases>,
}

#[derive(Deserialize)]
struct ModelCases {
    bos: u32,
    eos: u32,
    end_of_generation: Vec<u32>,
    control_tokens: usize,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    parse_special: bool,
    ids: Vec<u32>,
    detokenized: String,
}

fn fixture() -> Fixture {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/tokenizer/llama_cpp_ids.json"
    );
    let text = std::fs::read_to_string(path).expect("the tokenizer fixture is committed");
    serde_json::from_str(&text).expect("the tokenizer fixture is valid JSON")
}

/// The tokenizer of a real model, or `None` when the file has not been fetched and this run skips missing models.
fn load(name: &str) -> Option<Tokenizer> {
    let path = real_model(name)?;
    let mut file = std::fs::File::open(&path)
        .unwrap_or_else(|error| panic!("could not open {}: {error}", path.display()));
    let content = Content::read(&mut file).expect("the model file is a valid GGUF");
    Some(Tokenizer::from_gguf(&content).expect("the model's tokenizer loads"))
}

fn check_model(name: &str) {
    let fixture = fixture();
    let expected = &fixture.models[name];
    let Some(tokenizer) = load(name) else { return };
    assert_eq!(
        tokenizer.bos(),
        Some(expected.bos),
        "BOS id differs from llama.cpp's"
    );
    assert_eq!(
        tokenizer.eos(),
        Some(expected.eos),
        "EOS id differs from llama.cpp's"
    );
    assert_eq!(
        tokenizer.end_of_generation_ids(),
        expected.end_of_generation,
        "the end-of-generation ids differ from llama.cpp's"
    );
    let control = (0..tokenizer.vocab_size() as u32)
        .filter(|&id| tokenizer.is_control(id))
        .count();
    assert_eq!(
        control, expected.control_tokens,
        "the number of control tokens differs from llama.cpp's"
    );
    let mut mismatches = Vec::new();
    for case in &expected.cases {
        let ids = tokenizer
            .encode(&case.text, false, case.parse_special)
            .expect("fixture text encodes");
        if ids != case.ids {
            mismatches.push(format!(
                "{:?} (parse_special {}): ours {:?}, llama.cpp {:?}",
                case.text, case.parse_special, ids, case.ids
            ));
        }
        let special = if case.parse_special {
            SpecialTokens::Render
        } else {
            SpecialTokens::Skip
        };
        let decoded = tokenizer.decode_with(&case.ids, special);
        if decoded != case.detokenized {
            mismatches.push(format!(
                "decode of {:?}: ours {:?}, llama.cpp {:?}",
                case.ids, decoded, case.detokenized
            ));
        }
        let mut stream = StreamDecoder::with_special(&tokenizer, special);
        let mut streamed: String = case.ids.iter().map(|&id| stream.push(id)).collect();
        streamed.push_str(&stream.finish());
        assert_eq!(
            streamed, decoded,
            "streaming decode of {:?} differs from decode",
            case.text
        );
    }
    assert!(
        mismatches.is_empty(),
        "{} of {} cases differ from llama.cpp for {name}:\n{}",
        mismatches.len(),
        expected.cases.len(),
        mismatches.join("\n")
    );
}

#[test]
fn smollm2_ids_equal_llama_cpp_on_every_fixture_string() {
    check_model(SMOLLM2_FILE);
}

#[test]
fn gemma3_ids_equal_llama_cpp_on_every_fixture_string() {
    check_model(GEMMA3_FILE);
}

/// Random id sequences over a real vocabulary: the stream equals the whole decode, piece by piece.
fn stream_matches_decode_on_random_ids(name: &str) {
    use proptest::test_runner::{Config, TestRunner};
    let Some(tokenizer) = load(name) else { return };
    let vocab = tokenizer.vocab_size() as u32;
    let mut runner = TestRunner::new(Config {
        cases: 200,
        ..Config::default()
    });
    let ids = proptest::collection::vec(0..vocab, 0..48);
    runner
        .run(&ids, |ids| {
            let mut stream = StreamDecoder::new(&tokenizer);
            let mut joined: String = ids.iter().map(|&id| stream.push(id)).collect();
            joined.push_str(&stream.finish());
            proptest::prop_assert_eq!(joined, tokenizer.decode(&ids));
            Ok(())
        })
        .unwrap();
}

#[test]
fn smollm2_streaming_random_ids_equals_decode() {
    stream_matches_decode_on_random_ids(SMOLLM2_FILE);
}

#[test]
fn gemma3_streaming_random_ids_equals_decode() {
    stream_matches_decode_on_random_ids(GEMMA3_FILE);
}

/// The reference prompt with `add_special`: SmolLM2 adds no BOS, gemma does (ids from the llama.cpp notes).
#[test]
fn the_reference_prompt_encodes_with_each_models_bos_rule() {
    let prompt = "The capital of France is";
    if let Some(tokenizer) = load(SMOLLM2_FILE) {
        assert!(!tokenizer.add_bos(), "SmolLM2 sets add_bos_token = false");
        assert_eq!(
            tokenizer.encode(prompt, true, false).unwrap(),
            [504, 3575, 282, 4649, 314]
        );
        assert!(
            tokenizer.is_end_of_generation(2),
            "<|im_end|> ends a SmolLM2 turn"
        );
    }
    if let Some(tokenizer) = load(GEMMA3_FILE) {
        assert!(tokenizer.add_bos(), "gemma adds BOS");
        assert_eq!(
            tokenizer.encode(prompt, true, false).unwrap(),
            [2, 818, 5279, 529, 7001, 563]
        );
        assert!(
            tokenizer.is_end_of_generation(106),
            "<end_of_turn> ends a gemma turn"
        );
        assert!(tokenizer.is_end_of_generation(1), "<eos> ends generation");
    }
}
