//! Repository hygiene checked as tests: every Rust file opens with a `//!` line, `unsafe` stays fenced, and
//! the task-runtime tests wait with deadlines.

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::{Path, PathBuf};

    /// Where `unsafe` code may live, and why.
    const UNSAFE_ALLOWED: &[(&str, &str)] = &[
        ("net-io-sys/src/", "the one crate for OS calls"),
        (
            "stage-server/src/kernels/",
            "SIMD intrinsics behind runtime feature detection",
        ),
        (
            "stage-server/benches/kernels.rs",
            "process CPU clock for the kernel benchmark",
        ),
        (
            "net-io-blocking/tests/allocations.rs",
            "a counting global allocator",
        ),
    ];

    fn workspace_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask sits inside the workspace")
            .to_path_buf()
    }

    fn rust_files(directory: &Path, found: &mut Vec<PathBuf>) {
        let Ok(entries) = fs::read_dir(directory) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') || name.starts_with("target") || name == "node_modules" {
                continue;
            }
            if path.is_dir() {
                rust_files(&path, found);
            } else if name.ends_with(".rs") {
                found.push(path);
            }
        }
    }

    fn relative(path: &Path) -> String {
        path.strip_prefix(workspace_root())
            .unwrap_or(path)
            .to_string_lossy()
            .replace('\\', "/")
    }

    fn all_rust_files() -> Vec<PathBuf> {
        let mut found = Vec::new();
        rust_files(&workspace_root(), &mut found);
        assert!(
            found.len() > 20,
            "tidy found only {} Rust files; is the walk broken?",
            found.len()
        );
        found
    }

    #[test]
    fn every_rust_file_opens_with_a_one_line_purpose() {
        let missing: Vec<String> = all_rust_files()
            .into_iter()
            .filter(|path| !fs::read_to_string(path).is_ok_and(|text| text.starts_with("//! ")))
            .map(|path| relative(&path))
            .collect();
        assert!(
            missing.is_empty(),
            "these files do not start with a `//! ` purpose line: {missing:#?}"
        );
    }

    #[test]
    fn unsafe_code_stays_in_its_fenced_places_with_a_safety_comment() {
        let mut stray = Vec::new();
        let mut unexplained = Vec::new();
        for path in all_rust_files() {
            let name = relative(&path);
            if name.starts_with("xtask/") {
                continue;
            }
            let Ok(text) = fs::read_to_string(&path) else {
                continue;
            };
            let lines: Vec<&str> = text.lines().collect();
            for (index, line) in lines.iter().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                let opens_block = code.contains("unsafe {") || code.contains("unsafe impl");
                if !opens_block {
                    continue;
                }
                if !UNSAFE_ALLOWED
                    .iter()
                    .any(|(prefix, _)| name.starts_with(prefix))
                {
                    stray.push(format!("{name}:{}", index + 1));
                    continue;
                }
                let window = &lines[index.saturating_sub(8)..=index];
                if !window.iter().any(|earlier| earlier.contains("SAFETY")) {
                    unexplained.push(format!("{name}:{}", index + 1));
                }
            }
        }
        assert!(
            stray.is_empty(),
            "`unsafe` outside the fenced places {UNSAFE_ALLOWED:?}: {stray:#?}"
        );
        assert!(
            unexplained.is_empty(),
            "`unsafe` without a `// SAFETY:` comment just above it: {unexplained:#?}"
        );
    }

    /// A wait in the task-runtime tests with no deadline of its own: `.join()` and `.take()` on a handle or
    /// thread, and `.wait();` on a handle (a process's `.wait()` builds a task and is not a statement).
    fn waits_without_a_deadline(code: &str) -> bool {
        code.contains(".join()") || code.contains(".take()") || code.contains(".wait();")
    }

    #[test]
    fn task_runtime_tests_wait_with_a_deadline() {
        let mut unbounded = Vec::new();
        let tests = workspace_root().join("task-runtime/tests");
        let mut files = Vec::new();
        rust_files(&tests, &mut files);
        assert!(
            files.len() > 10,
            "found only {} task-runtime test files; is the walk broken?",
            files.len()
        );
        for path in files {
            let name = relative(&path);
            // The helpers themselves wrap the timed waits.
            if name.ends_with("tests/common/mod.rs") {
                continue;
            }
            let Ok(text) = fs::read_to_string(&path) else {
                continue;
            };
            let lines: Vec<&str> = text.lines().collect();
            for (index, line) in lines.iter().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                if !waits_without_a_deadline(code) || code.contains("within(") {
                    continue;
                }
                let window = &lines[index.saturating_sub(1)..=index];
                if !window.iter().any(|nearby| nearby.contains("// deadline:")) {
                    unbounded.push(format!("{name}:{}", index + 1));
                }
            }
        }
        assert!(
            unbounded.is_empty(),
            "waits without a deadline in task-runtime tests (a bug would hang CI instead of failing); use \
             common::join, take, wait, join_thread or within, or say what bounds the wait in a \
             `// deadline:` comment on the line or the one above: {unbounded:#?}"
        );
    }
}
