//! `File`: read, write, append, metadata and directory listing on the blocking threads, plus `watch`.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::RuntimeError;
use crate::kinds::watch::FileWatch;
use crate::task::{Step, Task, sealed};

/// File constructors. Every operation but `watch` runs on the blocking threads.
#[derive(Debug)]
pub struct File;

/// Which file operation a [`FileTask`] performs.
#[derive(Debug, Clone)]
enum Operation {
    Read,
    Write(Vec<u8>),
    Append(Vec<u8>),
    Metadata,
    ReadDirectory,
}

/// What a file operation returns.
#[derive(Debug, Clone)]
pub enum FileOutput {
    /// The bytes read.
    Bytes(Vec<u8>),
    /// Bytes written or appended.
    Written(usize),
    /// The file's metadata.
    Metadata(std::fs::Metadata),
    /// The directory's entries, sorted.
    Entries(Vec<PathBuf>),
}

impl File {
    /// Reads the whole file.
    pub fn read(path: impl AsRef<Path>) -> FileTask {
        FileTask::new(path, Operation::Read)
    }

    /// Replaces the file's contents (creating it).
    pub fn write(path: impl AsRef<Path>, bytes: impl Into<Vec<u8>>) -> FileTask {
        FileTask::new(path, Operation::Write(bytes.into()))
    }

    /// Appends to the file (creating it).
    pub fn append(path: impl AsRef<Path>, bytes: impl Into<Vec<u8>>) -> FileTask {
        FileTask::new(path, Operation::Append(bytes.into()))
    }

    /// Reads the file's metadata.
    pub fn metadata(path: impl AsRef<Path>) -> FileTask {
        FileTask::new(path, Operation::Metadata)
    }

    /// Lists a directory's entries.
    pub fn read_dir(path: impl AsRef<Path>) -> FileTask {
        FileTask::new(path, Operation::ReadDirectory)
    }

    /// Parks until the file at `path` changes (inotify, with a stat backstop); repeat it to keep
    /// watching: a change between runs is not lost.
    pub fn watch(path: impl AsRef<Path>) -> FileWatch {
        FileWatch::new(path.as_ref().to_path_buf())
    }
}

/// A blocking file operation.
#[derive(Debug, Clone)]
pub struct FileTask {
    path: PathBuf,
    operation: Operation,
}

impl FileTask {
    fn new(path: impl AsRef<Path>, operation: Operation) -> Self {
        FileTask {
            path: path.as_ref().to_path_buf(),
            operation,
        }
    }
}

impl sealed::Sealed for FileTask {}

impl Task for FileTask {
    type Input = ();
    type Output = FileOutput;

    fn blocking(&self) -> bool {
        true
    }

    fn start(&mut self, _input: ()) {}

    fn step(&mut self) -> Step<FileOutput> {
        let path = &self.path;
        let result = match &self.operation {
            Operation::Read => std::fs::read(path).map(FileOutput::Bytes),
            Operation::Write(bytes) => {
                std::fs::write(path, bytes).map(|()| FileOutput::Written(bytes.len()))
            }
            Operation::Append(bytes) => std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(path)
                .and_then(|mut file| file.write_all(bytes))
                .map(|()| FileOutput::Written(bytes.len())),
            Operation::Metadata => std::fs::metadata(path).map(FileOutput::Metadata),
            Operation::ReadDirectory => std::fs::read_dir(path).and_then(|entries| {
                let mut paths = entries
                    .map(|entry| entry.map(|entry| entry.path()))
                    .collect::<std::io::Result<Vec<_>>>()?;
                paths.sort();
                Ok(FileOutput::Entries(paths))
            }),
        };
        Step::Done(result.map_err(RuntimeError::from))
    }
}
