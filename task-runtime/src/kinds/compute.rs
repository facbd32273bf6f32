//! `Compute`: a closure run on a worker (or a blocking thread) with its wired input.

use std::marker::PhantomData;

use crate::error::RuntimeError;
use crate::task::{Step, Task, sealed};

/// A closure task. The closure takes the wired input (`()` when nothing is wired) and returns the output;
/// it is `FnMut` so repeats and gives can run it again.
pub struct Compute<F, I, O> {
    function: F,
    input: Option<I>,
    blocking: bool,
    _marker: PhantomData<fn(I) -> O>,
}

impl<F, I, O> std::fmt::Debug for Compute<F, I, O> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Compute")
            .field("blocking", &self.blocking)
            .finish_non_exhaustive()
    }
}

impl<F: Clone, I: Clone, O> Clone for Compute<F, I, O> {
    fn clone(&self) -> Self {
        Compute {
            function: self.function.clone(),
            input: self.input.clone(),
            blocking: self.blocking,
            _marker: PhantomData,
        }
    }
}

impl Compute<(), (), ()> {
    /// A compute task: `Compute::compute(|()| 21 * 2)`.
    // The name mirrors atap (`Compute::compute`, `Sleep::sleep`) so its users feel at home.
    #[allow(clippy::self_named_constructors)]
    pub fn compute<F, I, O>(function: F) -> Compute<F, I, O>
    where
        F: FnMut(I) -> O + Send + 'static,
        I: Send + 'static,
        O: Send + 'static,
    {
        Compute {
            function,
            input: None,
            blocking: false,
            _marker: PhantomData,
        }
    }
}

impl<F, I, O> Compute<F, I, O> {
    /// Runs on the blocking threads, for work that sleeps or blocks in the kernel.
    pub fn blocking(mut self) -> Self {
        self.blocking = true;
        self
    }
}

impl<F, I, O> sealed::Sealed for Compute<F, I, O> {}

impl<F, I, O> Task for Compute<F, I, O>
where
    F: FnMut(I) -> O + Send + 'static,
    I: Send + 'static,
    O: Send + 'static,
{
    type Input = I;
    type Output = O;

    fn blocking(&self) -> bool {
        self.blocking
    }

    fn start(&mut self, input: I) {
        self.input = Some(input);
    }

    fn step(&mut self) -> Step<O> {
        match self.input.take() {
            Some(input) => Step::Done(Ok((self.function)(input))),
            None => Step::Done(Err(RuntimeError::Finished)),
        }
    }
}
