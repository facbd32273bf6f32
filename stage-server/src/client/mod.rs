//! `stage-server chat`: an interactive terminal client for the OpenAI-compatible API of `stage-server run`.
//!
//! ```text
//!  stdin thread ──lines──▶ chat loop ──POST /v1/chat/completions──▶ server
//!                            │  ▲                                     │
//!        SIGINT count ───────┘  └── http (framing) ◀── sse ◀── bytes ─┘
//!                               │
//!                               └── protocol: deltas to stdout, usage to the summary line
//! ```
//!
//! The pieces, by concern:
//! - [`chunked`] and [`sse`] are sans-IO decoders of the response body (chunked coding, then events),
//!   fed bytes in whatever pieces the socket gives;
//! - [`protocol`] is the conversation, the request body and what each event says, all pure JSON;
//! - [`http`] moves bytes: one blocking connection per request, reads that wake up to look for Ctrl-C;
//! - `repl` is the loop: prompt, commands (`/reset`, `/quit`), streaming to stdout, the speed line.
//!
//! Ctrl-C is counted by `net_io_sys::signal`'s handler instead of killing the process. While a reply
//! streams, a press closes the connection (the server frees the lane when it sees the close) and keeps
//! the text that arrived as the assistant's turn; at the prompt, a press ends the chat.

pub mod chunked;
pub mod http;
pub mod protocol;
mod repl;
pub mod sse;

/// How `stage-server chat` reaches the server and what it asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// The server's root URL, `http://HOST[:PORT]` (routes such as `/v1/chat/completions` go under it).
    pub url: String,
    /// Sent as `Authorization: Bearer KEY` when the server was started with `--api-key`.
    pub api_key: Option<String>,
    /// A system prompt put before every request's messages.
    pub system: Option<String>,
    /// The most tokens a reply may have; the server's default when `None`.
    pub max_tokens: Option<usize>,
    /// The sampling temperature; the server's default when `None`.
    pub temperature: Option<f32>,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:8080".to_owned(),
            api_key: None,
            system: None,
            max_tokens: None,
            temperature: None,
        }
    }
}

/// Runs the interactive chat until `/quit`, end of input, or Ctrl-C at the prompt.
///
/// Replies stream to stdout as they arrive; prompts, notes, errors and the speed line after each reply go
/// to stderr, so stdout piped to a file holds only the assistant's text. A server error (an OpenAI error
/// envelope, a refused connection) is printed and the chat goes on; only a bad URL, a failure to watch
/// SIGINT or a failure to read stdin ends it with an error.
pub fn run_chat(options: ChatOptions) -> anyhow::Result<()> {
    repl::run(options)
}
