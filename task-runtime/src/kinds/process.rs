//! `Process`: run a program and park on its pidfd until it exits; capture output on a blocking thread.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use net_io_sys::epoll::Interest;
use net_io_sys::pidfd::{ExitStatus, PidFd};

use crate::error::RuntimeError;
use crate::manager::{Dispatch, Reactor};
use crate::pool::global_pool;
use crate::task::{Source, Step, Task, Wait, Waker, sealed};

/// Backstop poll for a missed exit.
const PROCESS_POLL: Duration = Duration::from_millis(50);

/// Process constructors.
#[derive(Debug)]
pub struct Process;

/// A program to run: its path, arguments, working directory and environment.
#[derive(Debug, Clone)]
pub struct ProcessSpec {
    program: OsString,
    arguments: Vec<OsString>,
    directory: Option<PathBuf>,
    environment: Vec<(OsString, OsString)>,
    input: Option<Vec<u8>>,
}

impl ProcessSpec {
    /// Adds an argument.
    pub fn arg(mut self, argument: impl Into<OsString>) -> Self {
        self.arguments.push(argument.into());
        self
    }

    /// Adds arguments.
    pub fn args<A: Into<OsString>>(mut self, arguments: impl IntoIterator<Item = A>) -> Self {
        self.arguments.extend(arguments.into_iter().map(Into::into));
        self
    }

    /// Runs in `directory`.
    pub fn current_dir(mut self, directory: impl Into<PathBuf>) -> Self {
        self.directory = Some(directory.into());
        self
    }

    /// Sets an environment variable.
    pub fn env(mut self, name: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.environment.push((name.into(), value.into()));
        self
    }

    /// Bytes written to the child's standard input (for `output`).
    pub fn input(mut self, bytes: impl Into<Vec<u8>>) -> Self {
        self.input = Some(bytes.into());
        self
    }

    fn command(&self) -> Result<Command, RuntimeError> {
        if let Some(directory) = &self.directory
            && !directory.is_dir()
        {
            return Err(RuntimeError::BadDirectory);
        }
        let mut command = Command::new(&self.program);
        command.args(&self.arguments);
        if let Some(directory) = &self.directory {
            command.current_dir(directory);
        }
        for (name, value) in &self.environment {
            if name.is_empty() || name.to_string_lossy().contains('=') {
                return Err(RuntimeError::BadVariable);
            }
            command.env(name, value);
        }
        Ok(command)
    }

    /// A task that runs the program and returns its exit status, parking on the pidfd meanwhile.
    /// Cancelling it, a timeout, or dropping it kills the child.
    pub fn run(self) -> ProcessRun {
        ProcessRun {
            spec: self,
            child: None,
        }
    }

    /// A blocking task that runs the program and collects stdout, stderr and status (no pipe deadlock).
    pub fn output(self) -> ProcessOutput {
        ProcessOutput { spec: self }
    }
}

impl Process {
    /// Describes a program to run.
    pub fn command(program: impl Into<OsString>) -> ProcessSpec {
        ProcessSpec {
            program: program.into(),
            arguments: Vec::new(),
            directory: None,
            environment: Vec::new(),
            input: None,
        }
    }

    /// Shorthand: `Process::command(program).args(arguments).run()`.
    pub fn run<A: Into<OsString>>(
        program: impl Into<OsString>,
        arguments: impl IntoIterator<Item = A>,
    ) -> ProcessRun {
        Process::command(program).args(arguments).run()
    }

    /// Shorthand: `Process::command(program).args(arguments).output()`.
    pub fn output<A: Into<OsString>>(
        program: impl Into<OsString>,
        arguments: impl IntoIterator<Item = A>,
    ) -> ProcessOutput {
        Process::command(program).args(arguments).output()
    }

    /// Starts the program now and returns a running child with a pidfd.
    pub fn spawn(spec: ProcessSpec) -> Result<RunningProcess, RuntimeError> {
        let mut command = spec.command()?;
        command.stdin(Stdio::null());
        let child = command.spawn()?;
        let pidfd = PidFd::open(child.id())?;
        Ok(RunningProcess {
            shared: Arc::new(Running::new(child, pidfd)),
        })
    }
}

/// How a program ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// Exited with this code.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

impl Exit {
    /// Whether it exited with code 0.
    pub fn success(&self) -> bool {
        *self == Exit::Code(0)
    }
}

/// Captured output of a program.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Output {
    /// How it ended.
    pub status: Exit,
    /// Its standard output.
    pub stdout: Vec<u8>,
    /// Its standard error.
    pub stderr: Vec<u8>,
}

struct Running {
    child: Mutex<Option<Child>>,
    pidfd: PidFd,
    exit: Mutex<Option<Exit>>,
    waiter: Mutex<Option<Waker>>,
    registration: Mutex<Option<(Weak<Reactor>, u64)>>,
}

impl Running {
    fn new(child: Child, pidfd: PidFd) -> Self {
        Running {
            child: Mutex::new(Some(child)),
            pidfd,
            exit: Mutex::new(None),
            waiter: Mutex::new(None),
            registration: Mutex::new(None),
        }
    }

    /// Reaps through the pidfd if the child has exited.
    fn poll(&self) -> Option<Exit> {
        let mut exit = self.exit.lock().unwrap_or_else(|p| p.into_inner());
        if exit.is_none()
            && let Ok(Some(status)) = self.pidfd.try_wait()
        {
            *exit = Some(match status {
                ExitStatus::Exited(code) => Exit::Code(code),
                ExitStatus::Signaled(signal) => Exit::Signal(signal),
            });
            // Reaped through the pidfd: std's Child must not wait again.
            if let Some(child) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
                std::mem::forget(child);
            }
        }
        *exit
    }

    fn kill(&self) {
        if self
            .exit
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_none()
        {
            let _ = self.pidfd.send_signal(libc::SIGKILL);
        }
    }
}

impl Dispatch for Running {
    fn dispatch(&self, _readiness: Interest) {
        if let Some(waker) = self.waiter.lock().unwrap_or_else(|p| p.into_inner()).take() {
            waker.wake();
        }
    }

    fn abandon(&self) {
        self.dispatch(Interest::ERROR);
    }
}

struct ExitSource {
    running: Arc<Running>,
}

/// Parks a task until the child's pidfd is readable, with the `PROCESS_POLL` backstop in case that
/// readiness is missed.
fn park_until_exit(running: &Arc<Running>) -> Wait {
    Wait::on(
        Arc::new(ExitSource {
            running: Arc::clone(running),
        }),
        0,
        Some(Instant::now() + PROCESS_POLL),
    )
}

impl Source for ExitSource {
    fn register(&self, _direction: u8, waker: Waker) -> bool {
        if let Some(pool) = global_pool() {
            let mut registration = self
                .running
                .registration
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            if registration.is_none() {
                let target: Arc<dyn Dispatch> = self.running.clone();
                if let Ok(token) = pool.reactor.register(
                    std::os::fd::AsFd::as_fd(&self.running.pidfd),
                    Arc::downgrade(&target),
                    Interest::READABLE,
                ) {
                    *registration = Some((Arc::downgrade(&pool.reactor), token));
                }
            }
        }
        *self
            .running
            .waiter
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(waker);
        // Level-triggered: an exit before the registration still reports; check once more anyway.
        self.running.poll().is_none()
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.kill();
        let registration = self
            .registration
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some((reactor, token)) = registration
            && let Some(reactor) = reactor.upgrade()
        {
            reactor.deregister(std::os::fd::AsFd::as_fd(&self.pidfd), token);
        }
        if let Some(mut child) = self.child.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = child.wait();
        }
    }
}

/// A started program.
#[derive(Clone)]
pub struct RunningProcess {
    shared: Arc<Running>,
}

impl std::fmt::Debug for RunningProcess {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("RunningProcess")
            .finish_non_exhaustive()
    }
}

impl RunningProcess {
    /// A task that parks until the program exits and returns how it ended.
    pub fn wait(&self) -> ProcessWait {
        ProcessWait {
            running: Arc::clone(&self.shared),
        }
    }

    /// Kills the program (SIGKILL through the pidfd, so a reused pid is never hit).
    pub fn kill(&self) {
        self.shared.kill();
    }
}

/// Waits for a [`RunningProcess`].
pub struct ProcessWait {
    running: Arc<Running>,
}

impl std::fmt::Debug for ProcessWait {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ProcessWait")
            .finish_non_exhaustive()
    }
}

impl sealed::Sealed for ProcessWait {}

impl Task for ProcessWait {
    type Input = ();
    type Output = Exit;

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<Exit> {
        match self.running.poll() {
            Some(exit) => Step::Done(Ok(exit)),
            None => Step::Park(park_until_exit(&self.running)),
        }
    }
}

/// Runs a program and parks until it exits (see [`ProcessSpec::run`]).
pub struct ProcessRun {
    spec: ProcessSpec,
    child: Option<Arc<Running>>,
}

impl std::fmt::Debug for ProcessRun {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("ProcessRun")
            .field("spec", &self.spec)
            .finish()
    }
}

impl Clone for ProcessRun {
    fn clone(&self) -> Self {
        ProcessRun {
            spec: self.spec.clone(),
            child: None,
        }
    }
}

impl sealed::Sealed for ProcessRun {}

impl Task for ProcessRun {
    type Input = ();
    type Output = Exit;

    fn start(&mut self, _input: ()) {
        self.child = None;
    }

    fn step(&mut self) -> Step<Exit> {
        if self.child.is_none() {
            let mut command = match self.spec.command() {
                Ok(command) => command,
                Err(error) => return Step::Done(Err(error)),
            };
            command.stdin(Stdio::null());
            let child = match command.spawn() {
                Ok(child) => child,
                Err(error) => return Step::Done(Err(error.into())),
            };
            let pidfd = match PidFd::open(child.id()) {
                Ok(pidfd) => pidfd,
                Err(error) => return Step::Done(Err(error.into())),
            };
            self.child = Some(Arc::new(Running::new(child, pidfd)));
        }
        let Some(running) = self.child.as_ref() else {
            return Step::Done(Err(RuntimeError::TaskFailed));
        };
        match running.poll() {
            Some(exit) => {
                self.child = None;
                Step::Done(Ok(exit))
            }
            None => Step::Park(park_until_exit(running)),
        }
    }
}

/// Runs a program on a blocking thread and captures its output (see [`ProcessSpec::output`]).
#[derive(Debug, Clone)]
pub struct ProcessOutput {
    spec: ProcessSpec,
}

impl sealed::Sealed for ProcessOutput {}

impl Task for ProcessOutput {
    type Input = ();
    type Output = Output;

    fn blocking(&self) -> bool {
        true
    }

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<Output> {
        let mut command = match self.spec.command() {
            Ok(command) => command,
            Err(error) => return Step::Done(Err(error)),
        };
        command
            .stdin(if self.spec.input.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(error) => return Step::Done(Err(error.into())),
        };
        // Feed stdin from its own thread so a child that floods stdout before reading cannot deadlock.
        let feeder = match (child.stdin.take(), self.spec.input.clone()) {
            (Some(mut stdin), Some(bytes)) => Some(std::thread::spawn(move || {
                use std::io::Write;
                let _ = stdin.write_all(&bytes);
            })),
            _ => None,
        };
        let result = child.wait_with_output();
        if let Some(feeder) = feeder {
            let _ = feeder.join();
        }
        Step::Done(match result {
            Ok(output) => {
                use std::os::unix::process::ExitStatusExt;
                let status = match (output.status.code(), output.status.signal()) {
                    (Some(code), _) => Exit::Code(code),
                    (None, Some(signal)) => Exit::Signal(signal),
                    (None, None) => Exit::Code(-1),
                };
                Ok(Output {
                    status,
                    stdout: output.stdout,
                    stderr: output.stderr,
                })
            }
            Err(error) => Err(error.into()),
        })
    }
}
