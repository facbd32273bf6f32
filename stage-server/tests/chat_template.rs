//! Chat template rendering: SmolLM2's ChatML template, the built-in gemma template, Python string methods and errors.

use std::io::Cursor;

use candle_core::quantized::gguf_file::{self, Content, Value};
use stage_server::model::SMOLLM2_FILE;
use stage_server::model::testing::real_model;
use stage_server::tokenizer::Tokenizer;
use stage_server::tokenizer::chat::{ChatError, ChatMessage, ChatTemplate, TemplateSource};

/// `tokenizer.chat_template` of SmolLM2-135M-Instruct (Apache-2.0), as stored in its GGUF file.
const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "  Answer briefly.  "),
        ChatMessage::new("user", "What is the capital of France?"),
        ChatMessage::new("assistant", "Paris."),
        ChatMessage::new("user", "And of Italy?"),
    ]
}

/// Writes metadata as a GGUF file in memory and reads it back.
fn gguf(metadata: Vec<(&str, Value)>) -> Content {
    let mut bytes = Cursor::new(Vec::new());
    let pairs: Vec<(&str, &Value)> = metadata.iter().map(|(key, value)| (*key, value)).collect();
    gguf_file::write(&mut bytes, &pairs, &[]).expect("an in-memory GGUF file is written");
    bytes.set_position(0);
    Content::read(&mut bytes).expect("the written GGUF file reads back")
}

#[test]
fn smollm2_chatml_renders_a_conversation() {
    let template = ChatTemplate::from_source(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>")
        .expect("SmolLM2's template compiles");
    let rendered = template.render(&conversation(), true).unwrap();
    insta::assert_snapshot!("smollm2_chatml", rendered);
}

#[test]
fn smollm2_chatml_adds_its_default_system_prompt() {
    let template =
        ChatTemplate::from_source(SMOLLM2_TEMPLATE, "<|im_start|>", "<|im_end|>").unwrap();
    let rendered = template
        .render(&[ChatMessage::new("user", "Hi")], false)
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
        "the template's default system turn or the user turn is wrong"
    );
}

#[test]
fn gemma_files_get_the_built_in_turn_format() {
    let tokens = ["<pad>", "<eos>", "<bos>"].map(|t| Value::String(t.to_string()));
    let content = gguf(vec![
        ("general.architecture", Value::String("gemma3".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens.to_vec())),
        ("tokenizer.ggml.bos_token_id", Value::U32(2)),
        ("tokenizer.ggml.eos_token_id", Value::U32(1)),
    ]);
    let template = ChatTemplate::from_gguf(&content)
        .unwrap()
        .expect("a gemma architecture always has a template");
    assert_eq!(template.source(), TemplateSource::BuiltIn);
    let rendered = template.render(&conversation(), true).unwrap();
    assert_eq!(
        rendered,
        "<start_of_turn>user\nAnswer briefly.\n\nWhat is the capital of France?<end_of_turn>\n\
         <start_of_turn>model\nParis.<end_of_turn>\n\
         <start_of_turn>user\nAnd of Italy?<end_of_turn>\n<start_of_turn>model\n",
        "the gemma turn format differs from llama.cpp's built-in gemma template"
    );
    insta::assert_snapshot!("gemma_built_in", rendered);
}

#[test]
fn a_file_without_a_template_has_none() {
    let content = gguf(vec![(
        "general.architecture",
        Value::String("llama".into()),
    )]);
    assert!(ChatTemplate::from_gguf(&content).unwrap().is_none());
}

#[test]
fn templates_can_call_python_string_methods_and_see_bos() {
    let source = "{{ bos_token }}{% for m in messages %}{% if m.content.startswith('!') %}[cmd]{% endif %}{{ m.content.strip().upper() }}|{{ m.role.capitalize() }}{% endfor %}{{ eos_token }}";
    let template = ChatTemplate::from_source(source, "<s>", "</s>").unwrap();
    let rendered = template
        .render(
            &[
                ChatMessage::new("user", "  hi "),
                ChatMessage::new("assistant", "!go"),
            ],
            false,
        )
        .unwrap();
    assert_eq!(rendered, "<s>HI|User[cmd]!GO|Assistant</s>");
}

#[test]
fn raise_exception_and_syntax_errors_are_clear_errors() {
    let strict = ChatTemplate::from_source(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation roles must start with user') }}{% endif %}",
        "",
        "",
    )
    .unwrap();
    let raised = strict
        .render(&[ChatMessage::new("assistant", "hello")], false)
        .expect_err("the template raises on an assistant-first conversation");
    assert!(matches!(raised, ChatError::Render(_)));
    let broken = ChatTemplate::from_source("{% for m in messages %}", "", "")
        .expect_err("an unclosed for block does not compile");
    assert!(matches!(broken, ChatError::Syntax(_)));
    insta::assert_snapshot!("chat_errors", format!("{raised}\n{broken}"));
}

#[test]
fn smollm2_file_template_renders_to_its_control_token_ids() {
    let Some(path) = real_model(SMOLLM2_FILE) else {
        return;
    };
    let content = Content::read(&mut std::fs::File::open(path).unwrap()).unwrap();
    let template = ChatTemplate::from_gguf(&content)
        .unwrap()
        .expect("SmolLM2 ships a chat template");
    assert_eq!(template.source(), TemplateSource::File);
    let rendered = template
        .render(&[ChatMessage::new("user", "Hi")], true)
        .unwrap();
    let tokenizer = Tokenizer::from_gguf(&content).unwrap();
    let ids = tokenizer
        .encode(&rendered, tokenizer.add_bos(), true)
        .unwrap();
    let starts: Vec<usize> = ids
        .iter()
        .enumerate()
        .filter(|(_, id)| **id == 1)
        .map(|(index, _)| index)
        .collect();
    assert_eq!(
        starts.len(),
        3,
        "expected system, user and assistant <|im_start|> tokens in {ids:?}"
    );
    assert_eq!(
        ids.iter().filter(|id| **id == 2).count(),
        2,
        "expected two <|im_end|> tokens"
    );
    assert_eq!(
        ids[0], 1,
        "the prompt starts with <|im_start|>, with no BOS"
    );
}

#[test]
fn a_template_that_writes_bos_does_not_double_the_tokenizers_bos() {
    let mut tokens: Vec<Value> = ["<unk>", "<s>", "</s>"]
        .iter()
        .map(|t| Value::String(t.to_string()))
        .collect();
    let mut types = vec![Value::I32(2), Value::I32(3), Value::I32(3)];
    for byte in 0..=255u8 {
        tokens.push(Value::String(format!("<0x{byte:02X}>")));
        types.push(Value::I32(6));
    }
    let content = gguf(vec![
        ("general.architecture", Value::String("llama".into())),
        ("tokenizer.ggml.model", Value::String("llama".into())),
        ("tokenizer.ggml.tokens", Value::Array(tokens)),
        ("tokenizer.ggml.token_type", Value::Array(types)),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
        (
            "tokenizer.chat_template",
            Value::String(
                "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}".into(),
            ),
        ),
    ]);
    let tokenizer = Tokenizer::from_gguf(&content).unwrap();
    let template = ChatTemplate::from_gguf(&content).unwrap().unwrap();
    assert_eq!(
        template
            .render(&[ChatMessage::new("user", "A")], false)
            .unwrap(),
        "<s>A"
    );
    let ids = template
        .prompt_ids(&tokenizer, &[ChatMessage::new("user", "A")], false)
        .unwrap();
    assert_eq!(
        ids.iter().filter(|&&id| id == 1).count(),
        1,
        "expected exactly one BOS in {ids:?}"
    );
    assert_eq!(ids[0], 1, "BOS comes first");
}
