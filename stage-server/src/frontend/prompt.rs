//! A request's prompt as tokens: the chat template rendered and tokenized, or text tokenized, or ids checked,
//! and the room the context leaves. Done on a lane's thread, so a large prompt never stalls an event loop.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::api::ApiError;
use crate::tokenizer::Tokenizer;
use crate::tokenizer::chat::{ChatMessage, ChatTemplate};

/// What the lanes need to know of the model to turn requests into tokens and tokens into text.
#[derive(Debug)]
pub(crate) struct TextModel {
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, if the model has a usable one.
    pub template: Option<ChatTemplate>,
    /// Tokens that end a generation (EOS, end of turn).
    pub stop_tokens: Vec<u32>,
    /// Tokens per lane of this process: prompt and generation together.
    pub context_length: usize,
    /// In front of a chain, the least context length its stages said in their hellos (`usize::MAX` until a
    /// link opened; set by every link that opens), so a prompt too long for any stage is refused here, before
    /// a lane starts it, rather than failed by that stage midway.
    pub chain_context: Arc<AtomicUsize>,
    /// The vocabulary's size (token ids are below it).
    pub vocab_size: usize,
}

/// A prompt as the request gave it.
#[derive(Debug)]
pub(crate) enum PromptSource {
    /// A conversation for the chat template.
    Chat(Vec<ChatMessage>),
    /// Text to tokenize (with the model's BOS).
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
}

impl PromptSource {
    /// The request field the prompt came in, for errors.
    pub(crate) fn param(&self) -> &'static str {
        match self {
            PromptSource::Chat(_) => "messages",
            PromptSource::Text(_) | PromptSource::Tokens(_) => "prompt",
        }
    }
}

impl TextModel {
    /// Token ids outside the vocabulary are a 400 naming the first one.
    pub(crate) fn check_ids(&self, tokens: &[u32], param: &str) -> Result<(), ApiError> {
        match tokens
            .iter()
            .position(|&token| token as usize >= self.vocab_size)
        {
            Some(index) => Err(ApiError::invalid(
                &format!("{param}[{index}]"),
                format!(
                    "token id {} is not in the model's vocabulary of {} tokens",
                    tokens[index], self.vocab_size
                ),
            )),
            None => Ok(()),
        }
    }

    /// The prompt's tokens and the most tokens the generation may add (`max_tokens`, capped by what the
    /// context leaves); a prompt that does not leave room for one token is a 400 naming both numbers.
    pub(crate) fn prepare(
        &self,
        source: &PromptSource,
        max_tokens: Option<usize>,
    ) -> Result<(Vec<u32>, usize), ApiError> {
        let param = source.param();
        let prompt = match source {
            PromptSource::Chat(messages) => {
                let Some(template) = &self.template else {
                    return Err(ApiError::invalid(
                        "messages",
                        "the model has no chat template; use /v1/completions",
                    ));
                };
                template
                    .prompt_ids(&self.tokenizer, messages, true)
                    .map_err(|failure| {
                        ApiError::invalid(
                            "messages",
                            format!("the chat template failed: {failure}"),
                        )
                    })?
            }
            PromptSource::Text(text) => self
                .tokenizer
                .encode(text, true, false)
                .map_err(|failure| ApiError::invalid("prompt", failure.to_string()))?,
            PromptSource::Tokens(tokens) => {
                self.check_ids(tokens, "prompt")?;
                tokens.clone()
            }
        };
        if prompt.is_empty() {
            return Err(ApiError::invalid(param, "the prompt has no tokens"));
        }
        let context = self
            .context_length
            .min(self.chain_context.load(Ordering::Relaxed));
        if prompt.len() >= context {
            return Err(ApiError::context_exceeded(param, prompt.len(), context));
        }
        let room = context - prompt.len();
        Ok((prompt, max_tokens.unwrap_or(room).min(room)))
    }
}
