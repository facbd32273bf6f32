//! Chat templates from `tokenizer.chat_template`, rendered with minijinja.
//!
//! Hugging Face templates are Jinja2 run with `trim_blocks` and `lstrip_blocks`, given `messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token` and a `raise_exception` function, and they call Python
//! string methods (`.strip()`, `.startswith()` ...), which minijinja-contrib's pycompat layer supplies.
//! Gemma files carry no template; like llama.cpp, a gemma architecture gets a built-in one.
//!
//! The rendered text holds control tokens as text: encode it with `parse_special = true`.
//! [`ChatTemplate::prompt_ids`] does what llama.cpp does: render, drop a leading BOS text when the tokenizer
//! adds BOS itself (and a trailing EOS text when it adds EOS), then encode with `add_special` and
//! `parse_special`, so a template that writes `{{ bos_token }}` does not yield two BOS tokens.

use candle_core::quantized::gguf_file::{Content, Value};
use minijinja::{Environment, ErrorKind};
use serde::Serialize;

use crate::tokenizer::{Tokenizer, TokenizerError};

/// Why a chat template could not be loaded or rendered.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChatError {
    /// The template text is not valid Jinja.
    #[error(
        "the chat template does not parse: {0}; the model file's `tokenizer.chat_template` is broken, use --prompt without --chat"
    )]
    Syntax(String),
    /// The template failed while rendering, or rejected the conversation with `raise_exception`.
    #[error("the chat template could not render this conversation: {0}")]
    Render(String),
    /// The rendered prompt could not be tokenized.
    #[error("the rendered chat prompt could not be tokenized: {0}")]
    Tokenize(#[from] TokenizerError),
    /// A metadata key holds a value of the wrong type.
    #[error("metadata key `{key}` should be {expected}; the file is malformed")]
    WrongType {
        /// The key.
        key: &'static str,
        /// What it should hold.
        expected: &'static str,
    },
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (templates may know others, such as `tool`).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message from `role` saying `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Where a template came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TemplateSource {
    /// The file's `tokenizer.chat_template`.
    File,
    /// This crate's built-in template for an architecture whose files carry none (gemma).
    BuiltIn,
}

/// A compiled chat template with the model's BOS and EOS texts.
///
/// ```
/// use stage_server::tokenizer::chat::{ChatMessage, ChatTemplate};
///
/// let template = ChatTemplate::from_source(
///     "{{ bos_token }}{% for message in messages %}[{{ message.role }}] {{ message.content | trim }}\n{% endfor %}",
///     "<s>",
///     "</s>",
/// )?;
/// let conversation = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", " Hi ")];
/// assert_eq!(template.render(&conversation, false)?, "<s>[system] Be brief.\n[user] Hi\n");
/// # Ok::<(), stage_server::tokenizer::chat::ChatError>(())
/// ```
#[derive(Debug)]
pub struct ChatTemplate {
    environment: Environment<'static>,
    source: TemplateSource,
    bos_token: String,
    eos_token: String,
}

/// The Gemma turn format (`<start_of_turn>role\n...<end_of_turn>\n`, assistant called `model`, system
/// text folded into the first user turn, contents trimmed), written for this crate after llama.cpp's
/// built-in gemma behaviour.
const GEMMA_TEMPLATE: &str = concat!(
    "{%- set ns = namespace(system='') -%}",
    "{%- for message in messages -%}",
    "{%- if message.role == 'system' -%}",
    "{%- set ns.system = ns.system ~ (message.content | trim) -%}",
    "{%- else -%}",
    "{%- set role = 'model' if message.role == 'assistant' else message.role -%}",
    "{{- '<start_of_turn>' ~ role ~ '\\n' -}}",
    "{%- if ns.system and role != 'model' -%}",
    "{{- ns.system ~ '\\n\\n' -}}",
    "{%- set ns.system = '' -%}",
    "{%- endif -%}",
    "{{- (message.content | trim) ~ '<end_of_turn>\\n' -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}",
);

const TEMPLATE_NAME: &str = "chat";

impl ChatTemplate {
    /// The model's template: `tokenizer.chat_template` if present, the built-in gemma template for a
    /// gemma architecture, otherwise `None`.
    pub fn from_gguf(content: &Content) -> Result<Option<Self>, ChatError> {
        let metadata = &content.metadata;
        let token_text = |key: &'static str| -> Result<String, ChatError> {
            let Some(id) = metadata.get(key) else {
                return Ok(String::new());
            };
            let id = id.to_u32().map_err(|_| ChatError::WrongType {
                key,
                expected: "an integer token id",
            })?;
            Ok(match metadata.get("tokenizer.ggml.tokens") {
                Some(Value::Array(tokens)) => match tokens.get(id as usize) {
                    Some(Value::String(text)) => text.clone(),
                    _ => String::new(),
                },
                _ => String::new(),
            })
        };
        let bos_token = token_text("tokenizer.ggml.bos_token_id")?;
        let eos_token = token_text("tokenizer.ggml.eos_token_id")?;
        match metadata.get("tokenizer.chat_template") {
            Some(Value::String(template)) => Self::new(
                template.clone(),
                &bos_token,
                &eos_token,
                TemplateSource::File,
            )
            .map(Some),
            Some(_) => Err(ChatError::WrongType {
                key: "tokenizer.chat_template",
                expected: "a string",
            }),
            None => {
                let architecture = match metadata.get("general.architecture") {
                    Some(Value::String(name)) => name.as_str(),
                    _ => "",
                };
                if architecture.starts_with("gemma") {
                    Self::new(
                        GEMMA_TEMPLATE.to_string(),
                        &bos_token,
                        &eos_token,
                        TemplateSource::BuiltIn,
                    )
                    .map(Some)
                } else {
                    Ok(None)
                }
            }
        }
    }

    /// Compiles a template given as text, with the BOS and EOS texts it may refer to.
    pub fn from_source(
        template: impl Into<String>,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<Self, ChatError> {
        Self::new(template.into(), bos_token, eos_token, TemplateSource::File)
    }

    fn new(
        template: String,
        bos_token: &str,
        eos_token: &str,
        source: TemplateSource,
    ) -> Result<Self, ChatError> {
        let mut environment = Environment::new();
        // Jinja2 as transformers configures it.
        environment.set_trim_blocks(true);
        environment.set_lstrip_blocks(true);
        environment
            .set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        environment.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        environment
            .add_template_owned(TEMPLATE_NAME, template)
            .map_err(|error| ChatError::Syntax(describe(&error)))?;
        Ok(Self {
            environment,
            source,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders a conversation; `add_generation_prompt` appends the opening of the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let template = self
            .environment
            .get_template(TEMPLATE_NAME)
            .map_err(|error| ChatError::Render(describe(&error)))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|error| ChatError::Render(describe(&error)))
    }

    /// Renders the conversation and tokenizes it as llama.cpp's chat path does (see the module docs).
    pub fn prompt_ids(
        &self,
        tokenizer: &Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ChatError> {
        let rendered = self.render(messages, add_generation_prompt)?;
        let mut prompt = rendered.as_str();
        if tokenizer.add_bos() && !self.bos_token.is_empty() {
            prompt = prompt
                .strip_prefix(self.bos_token.as_str())
                .unwrap_or(prompt);
        }
        if tokenizer.add_eos() && !self.eos_token.is_empty() {
            prompt = prompt
                .strip_suffix(self.eos_token.as_str())
                .unwrap_or(prompt);
        }
        Ok(tokenizer.encode(prompt, true, true)?)
    }

    /// Whether the template came from the file or is built in.
    pub fn source(&self) -> TemplateSource {
        self.source
    }
}

/// The error's message with its causes, on one line.
fn describe(error: &minijinja::Error) -> String {
    let mut text = error.to_string();
    let mut cause = std::error::Error::source(error);
    while let Some(inner) = cause {
        text.push_str(": ");
        text.push_str(&inner.to_string());
        cause = inner.source();
    }
    text
}
