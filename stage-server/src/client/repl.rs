//! The chat loop: read a line, send the conversation, stream the reply to stdout, print the speed.

use std::io::{self, BufRead, IsTerminal, Write};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;
use net_io_sys::signal::SignalWatch;

use super::ChatOptions;
use super::http::{BodyRead, Client, ClientError, ClientOptions, Endpoint, Response};
use super::protocol::{ApiError, Conversation, Sampling, StreamEvent, Usage};
use super::sse::{SseEvent, SseParser};

/// The chat completions route, under the server URL's prefix.
const CHAT_PATH: &str = "/v1/chat/completions";
/// The most bytes of an error response kept; envelopes are a few hundred.
const ERROR_BODY_LIMIT: usize = 1 << 20;
/// How many lines the stdin reader may read ahead of the loop (typed while a reply streams).
const LINE_BACKLOG: usize = 16;

/// What the user typed at the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Command {
    /// A message to send.
    Say(String),
    /// `/reset`: forget the conversation.
    Reset,
    /// `/quit` or `/exit`.
    Quit,
    /// `/help` or an unknown `/word`.
    Help,
    /// A blank line.
    Nothing,
}

/// What the stdin reader thread hands over.
#[derive(Debug)]
enum Input {
    Line(String),
    End,
    Failed(io::Error),
}

/// What waiting at the prompt gave.
enum Prompted {
    Line(String),
    End,
    Interrupted,
}

/// How a reply ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ending {
    /// The server finished it (`finish_reason`, or `[DONE]` without one).
    Finished(Option<String>),
    /// Ctrl-C stopped it.
    Stopped,
    /// The server or the connection failed after it began.
    Failed(String),
}

/// What one turn produced.
struct Reply {
    text: String,
    /// Content deltas received: the token count when no usage chunk came (each delta is about one token).
    deltas: u64,
    usage: Option<Usage>,
    /// From sending the request to the first content delta.
    first_token_after: Option<Duration>,
    /// From sending the request to the end of the reply.
    total: Duration,
    ending: Ending,
}

/// The Ctrl-C watch: counts SIGINTs so that none kills the process while the client holds a connection.
struct Interrupts {
    watch: SignalWatch,
}

/// The loop's state: the server, the conversation and the terminal.
struct Session {
    client: Client,
    bearer: Option<String>,
    sampling: Sampling,
    conversation: Conversation,
    interrupts: Interrupts,
    interactive: bool,
}

impl Interrupts {
    fn install() -> anyhow::Result<Self> {
        let watch = SignalWatch::install(libc::SIGINT).context("watching SIGINT for Ctrl-C")?;
        Ok(Self { watch })
    }

    /// Forgets Ctrl-C presses that came before now (one that stopped a reply must not also quit).
    fn clear(&self) {
        self.watch.take_count();
    }

    /// Whether Ctrl-C was pressed since the last look.
    fn pressed(&self) -> bool {
        self.watch.take_count() > 0
    }
}

impl Session {
    fn prompt(&self) {
        if self.interactive {
            eprint!("> ");
            let _ = io::stderr().flush();
        }
    }

    /// Sends the conversation with `text` added and streams the answer; every failure is printed here.
    fn turn(&mut self, text: String) {
        self.conversation.push_user(text);
        let body = self.conversation.request_body(self.sampling);
        self.interrupts.clear();
        let started = Instant::now();
        let interrupts = &self.interrupts;
        let mut stop = || interrupts.pressed();
        let response =
            match self
                .client
                .post_json(CHAT_PATH, self.bearer.as_deref(), &body, &mut stop)
            {
                Ok(Some(response)) => response,
                Ok(None) => {
                    eprintln!("[stopped before the reply began]");
                    self.conversation.withdraw_user();
                    return;
                }
                Err(error) => {
                    eprintln!("error: {error}");
                    self.conversation.withdraw_user();
                    return;
                }
            };
        if response.status != 200 {
            print_refusal(response);
            self.conversation.withdraw_user();
            return;
        }
        let reply = stream_reply(response, started, &mut stop);
        if reply.text.is_empty() {
            // Nothing to keep: an unanswered user turn would only confuse the next request.
            self.conversation.withdraw_user();
        } else {
            self.conversation.push_assistant(reply.text.clone());
        }
        match &reply.ending {
            Ending::Finished(_) => {}
            Ending::Stopped => eprintln!("[stopped]"),
            Ending::Failed(message) => eprintln!("error: {message}"),
        }
        eprintln!("{}", summary(&reply));
    }
}

/// Runs the chat loop until `/quit`, end of input, or Ctrl-C at the prompt.
pub(super) fn run(options: ChatOptions) -> anyhow::Result<()> {
    let endpoint = Endpoint::parse(&options.url)?;
    // Installed first, so a Ctrl-C at any point after this is counted rather than killing the process.
    let interrupts = Interrupts::install()?;
    let interactive = io::stdin().is_terminal();
    let mut session = Session {
        client: Client::new(endpoint, ClientOptions::default()),
        bearer: options.api_key,
        sampling: Sampling {
            max_tokens: options.max_tokens,
            temperature: options.temperature,
        },
        conversation: Conversation::new(options.system),
        interrupts,
        interactive,
    };
    if interactive {
        eprintln!(
            "chatting with {} (/reset clears the conversation, /quit or Ctrl-D exits, Ctrl-C stops a reply)",
            options.url
        );
    }
    let lines = spawn_stdin_reader();
    loop {
        session.prompt();
        let line = match next_line(&lines, &session.interrupts)? {
            Prompted::Line(line) => line,
            Prompted::End | Prompted::Interrupted => {
                if session.interactive {
                    println!();
                }
                return Ok(());
            }
        };
        match parse_command(&line) {
            Command::Say(text) => session.turn(text),
            Command::Reset => {
                session.conversation.reset();
                eprintln!("[conversation cleared]");
            }
            Command::Quit => return Ok(()),
            Command::Help => eprintln!(
                "/reset clears the conversation; /quit exits; Ctrl-C stops a reply, or exits at the prompt"
            ),
            Command::Nothing => {}
        }
    }
}

/// Reads the streamed reply, printing each delta as it arrives.
fn stream_reply(mut response: Response, started: Instant, stop: &mut dyn FnMut() -> bool) -> Reply {
    let mut reply = Reply {
        text: String::new(),
        deltas: 0,
        usage: None,
        first_token_after: None,
        total: Duration::ZERO,
        ending: Ending::Failed("the stream ended without [DONE]".to_owned()),
    };
    let mut parser = SseParser::new();
    let mut events: Vec<SseEvent> = Vec::new();
    let mut finish_reason = None;
    let stdout = io::stdout();
    let mut out = stdout.lock();
    'reading: loop {
        let bytes = match response.read_body(stop) {
            Ok(BodyRead::Data(bytes)) => bytes,
            Ok(BodyRead::End) => break,
            Ok(BodyRead::Stopped) => {
                // Dropping the response below closes the connection, which is what frees the server's lane.
                reply.ending = Ending::Stopped;
                break;
            }
            Err(error) => {
                reply.ending = Ending::Failed(error.to_string());
                break;
            }
        };
        if let Err(error) = parser.feed(&bytes, &mut events) {
            reply.ending = Ending::Failed(error.to_string());
            break;
        }
        for event in events.drain(..) {
            match StreamEvent::parse(&event.data) {
                Ok(StreamEvent::Chunk(chunk)) => {
                    if let Some(content) = chunk.content.filter(|content| !content.is_empty()) {
                        reply
                            .first_token_after
                            .get_or_insert_with(|| started.elapsed());
                        reply.deltas += 1;
                        reply.text.push_str(&content);
                        let _ = out.write_all(content.as_bytes());
                        let _ = out.flush();
                    }
                    finish_reason = chunk.finish_reason.or(finish_reason);
                    reply.usage = chunk.usage.or(reply.usage);
                }
                Ok(StreamEvent::Done) => {
                    reply.ending = Ending::Finished(finish_reason.take());
                    break 'reading;
                }
                Ok(StreamEvent::Error(error)) => {
                    reply.ending = Ending::Failed(error.to_string());
                    break 'reading;
                }
                Err(error) => {
                    reply.ending = Ending::Failed(error.to_string());
                    break 'reading;
                }
            }
        }
    }
    drop(response);
    reply.total = started.elapsed();
    if !reply.text.is_empty() && !reply.text.ends_with('\n') {
        let _ = out.write_all(b"\n");
    }
    let _ = out.flush();
    reply
}

/// Prints a non-200 answer: its envelope when it has one, with the Retry-After a 429 carries.
fn print_refusal(mut response: Response) {
    let retry_after = response
        .header("retry-after")
        .and_then(|value| value.trim().parse().ok());
    let status = response.status;
    let body = match response.read_to_end(ERROR_BODY_LIMIT) {
        Ok(body) => body,
        Err(ClientError::BodyTooLarge { .. }) => b"(an error body too large to show)".to_vec(),
        Err(error) => format!("(the error body could not be read: {error})").into_bytes(),
    };
    eprintln!(
        "error: {}",
        ApiError::from_response(status, retry_after, &body)
    );
}

/// The line printed after a reply: tokens, the decode speed, and the wait for the first token.
///
/// The speed counts the tokens after the first over the time after the first: the wait before the first
/// token is the prompt's prefill, which has its own figure, and mixing the two would make a long
/// conversation look like slow decoding.
fn summary(reply: &Reply) -> String {
    let (tokens, source) = match reply.usage {
        Some(usage) => (usage.completion_tokens, ""),
        None => (reply.deltas, " (counted from the stream)"),
    };
    let mut line = format!("[{tokens} tokens{source}");
    if let Some(usage) = reply.usage {
        line.push_str(&format!(", prompt {}", usage.prompt_tokens));
    }
    if let Some(first) = reply.first_token_after {
        let decoding = reply.total.saturating_sub(first).as_secs_f64();
        if tokens > 1 && decoding > 0.0 {
            line.push_str(&format!(", {:.1} tokens/s", (tokens - 1) as f64 / decoding));
        }
        line.push_str(&format!(", first token after {:.2} s", first.as_secs_f64()));
    }
    if let Ending::Finished(Some(reason)) = &reply.ending
        && reason != "stop"
    {
        line.push_str(&format!(", finished by {reason}"));
    }
    line.push(']');
    line
}

fn parse_command(line: &str) -> Command {
    let trimmed = line.trim();
    if trimmed.is_empty() {
        return Command::Nothing;
    }
    match trimmed {
        "/reset" => Command::Reset,
        "/quit" | "/exit" => Command::Quit,
        _ if trimmed.starts_with('/') && !trimmed.contains(char::is_whitespace) => Command::Help,
        // The line is sent as typed, less its line ending: leading spaces may be meant (code).
        _ => Command::Say(line.trim_end_matches(['\r', '\n']).to_owned()),
    }
}

/// Reads stdin on its own thread, so the loop can wait for a line and for Ctrl-C at once.
///
/// The thread is never joined: when the loop ends it may be blocked in a read of the terminal, and the
/// process exiting is what ends it. Lines are read as bytes and decoded lossily, so one bad byte in a
/// pasted text does not end the chat.
fn spawn_stdin_reader() -> Receiver<Input> {
    let (sender, receiver) = mpsc::sync_channel(LINE_BACKLOG);
    thread::spawn(move || {
        let stdin = io::stdin();
        let mut input = stdin.lock();
        loop {
            let mut bytes = Vec::new();
            let message = match input.read_until(b'\n', &mut bytes) {
                Ok(0) => Input::End,
                Ok(_) => Input::Line(String::from_utf8_lossy(&bytes).into_owned()),
                Err(error) if error.kind() == io::ErrorKind::Interrupted => continue,
                Err(error) => Input::Failed(error),
            };
            let last = !matches!(message, Input::Line(_));
            if sender.send(message).is_err() || last {
                return;
            }
        }
    });
    receiver
}

/// Waits for the next line, looking for Ctrl-C every poll interval.
fn next_line(lines: &Receiver<Input>, interrupts: &Interrupts) -> anyhow::Result<Prompted> {
    let poll_interval = ClientOptions::default().poll_interval;
    loop {
        if interrupts.pressed() {
            return Ok(Prompted::Interrupted);
        }
        match lines.recv_timeout(poll_interval) {
            Ok(Input::Line(line)) => return Ok(Prompted::Line(line)),
            Ok(Input::End) | Err(RecvTimeoutError::Disconnected) => return Ok(Prompted::End),
            Ok(Input::Failed(error)) => return Err(error).context("reading standard input"),
            Err(RecvTimeoutError::Timeout) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Command, Ending, Reply, parse_command, summary};
    use crate::client::protocol::Usage;
    use std::time::Duration;

    #[test]
    fn commands_are_recognised_and_other_lines_are_said_as_typed() {
        assert_eq!(parse_command("/reset\n"), Command::Reset);
        assert_eq!(parse_command("  /quit  "), Command::Quit);
        assert_eq!(parse_command("/exit"), Command::Quit);
        assert_eq!(parse_command("/unknown"), Command::Help);
        assert_eq!(parse_command("   \n"), Command::Nothing);
        assert_eq!(
            parse_command("  indented code\r\n"),
            Command::Say("  indented code".to_owned())
        );
        assert_eq!(
            parse_command("/usr/bin is a path"),
            Command::Say("/usr/bin is a path".to_owned()),
            "a slash followed by words is a message, not a command"
        );
    }

    fn reply(usage: Option<Usage>, ending: Ending) -> Reply {
        Reply {
            text: "x".to_owned(),
            deltas: 9,
            usage,
            first_token_after: Some(Duration::from_millis(500)),
            total: Duration::from_millis(1500),
            ending,
        }
    }

    #[test]
    fn the_summary_gives_the_decode_speed_after_the_first_token() {
        let usage = Usage {
            prompt_tokens: 20,
            completion_tokens: 11,
        };
        assert_eq!(
            summary(&reply(Some(usage), Ending::Finished(Some("stop".into())))),
            "[11 tokens, prompt 20, 10.0 tokens/s, first token after 0.50 s]"
        );
        assert_eq!(
            summary(&reply(Some(usage), Ending::Finished(Some("length".into())))),
            "[11 tokens, prompt 20, 10.0 tokens/s, first token after 0.50 s, finished by length]"
        );
        assert_eq!(
            summary(&reply(None, Ending::Stopped)),
            "[9 tokens (counted from the stream), 8.0 tokens/s, first token after 0.50 s]",
            "a stopped reply has no usage chunk, so the deltas are counted"
        );
    }
}
