//! Repository hygiene checked as tests: purpose lines, fenced `unsafe`, layering, file length, dependencies and crate attributes.

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::{Path, PathBuf};

    /// Where `unsafe` code may live, and why.
    const UNSAFE_ALLOWED: &[(&str, &str)] = &[
        ("net-io-sys/src/", "the one crate for OS calls"),
        (
            "stage-server/src/kernels/",
            "SIMD intrinsics behind runtime feature detection, and the compute pool's borrowed jobs (loom-modelled)",
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
                // Cargo marks every target directory, whatever CARGO_TARGET_DIR named it, with CACHEDIR.TAG.
                if path.join("CACHEDIR.TAG").exists() {
                    continue;
                }
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

    /// The workspace's crates, lowest layer first, each with the members it may depend on (itself aside).
    ///
    /// `task-runtime` sits beside `net-io-blocking`, not above it: neither may use the other.
    const LAYERS: &[(&str, &[&str])] = &[
        ("net-io-sys", &[]),
        ("net-io-core", &["net-io-sys"]),
        ("net-io-blocking", &["net-io-sys", "net-io-core"]),
        ("task-runtime", &["net-io-sys", "net-io-core"]),
        (
            "stage-server",
            &[
                "net-io-sys",
                "net-io-core",
                "net-io-blocking",
                "task-runtime",
            ],
        ),
        (
            "xtask",
            &[
                "net-io-sys",
                "net-io-core",
                "net-io-blocking",
                "task-runtime",
                "stage-server",
            ],
        ),
    ];

    /// Longest a Rust source file may grow, in lines; past it a file is split by concern.
    const MAX_LINES: usize = 1_500;

    /// Files allowed past [`MAX_LINES`], and why. An entry whose file has shrunk under the cap fails the test,
    /// so the list only ever names real exceptions.
    const LONG_FILES: &[(&str, &str)] = &[];

    /// One dependency line of a member's manifest.
    #[derive(Debug)]
    struct Dependency {
        /// The package depended on (a `package = "..."` rename resolved).
        name: String,
        /// `[dependencies]`, `[dev-dependencies]`, `[target.'cfg(..)'.build-dependencies]`, ...
        section: String,
        /// Whether it comes from `[workspace.dependencies]` (`workspace = true`).
        from_workspace: bool,
    }

    /// The members listed in the root manifest's `members = [...]`.
    fn members() -> Vec<String> {
        let manifest =
            fs::read_to_string(workspace_root().join("Cargo.toml")).expect("root Cargo.toml");
        let start = manifest
            .find("members = [")
            .expect("the root Cargo.toml lists its members");
        let list = &manifest[start + "members = [".len()..];
        let list = &list[..list.find(']').expect("the members list is closed")];
        let members: Vec<String> = list
            .split(',')
            .map(|item| item.trim().trim_matches('"').to_string())
            .filter(|item| !item.is_empty())
            .collect();
        assert!(
            members.len() >= 5,
            "found only {members:?} as workspace members; is the parse broken?"
        );
        members
    }

    /// A TOML section header without its brackets, or `None` for any other line.
    fn section_header(line: &str) -> Option<&str> {
        let line = line.trim();
        let inner = line.strip_prefix('[')?.strip_suffix(']')?;
        Some(inner.trim_matches(|c| c == '[' || c == ']'))
    }

    /// Whether a section header names a dependency table (`dependencies`, `dev-dependencies`,
    /// `build-dependencies`, under `target.'cfg(..)'.` or not). Returns the table and, for the
    /// `[dependencies.NAME]` form, the one dependency it describes.
    fn dependency_table(header: &str) -> Option<(String, Option<String>)> {
        for kind in ["dependencies", "dev-dependencies", "build-dependencies"] {
            if header == kind || header.ends_with(&format!(".{kind}")) {
                return Some((header.to_string(), None));
            }
            let marker = format!("{kind}.");
            if let Some(position) = header.find(&marker)
                && (position == 0 || header[..position].ends_with('.'))
            {
                let name = header[position + marker.len()..].trim_matches('"');
                return Some((
                    header[..position + kind.len()].to_string(),
                    Some(name.to_string()),
                ));
            }
        }
        None
    }

    /// The value of `key = "..."` inside an inline table or a table body, if present.
    fn string_value(text: &str, key: &str) -> Option<String> {
        let mut rest = text;
        while let Some(position) = rest.find(key) {
            let before = rest[..position].chars().last();
            let after = rest[position + key.len()..].trim_start();
            rest = &rest[position + key.len()..];
            if before.is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_') {
                continue;
            }
            let Some(after) = after.strip_prefix('=') else {
                continue;
            };
            let after = after.trim_start().strip_prefix('"')?;
            return Some(after[..after.find('"')?].to_string());
        }
        None
    }

    /// Whether `text` (an inline table or a table body) says `workspace = true`.
    fn says_workspace(text: &str) -> bool {
        text.split([',', '{', '}', '\n'])
            .any(|part| part.replace(' ', "") == "workspace=true")
    }

    /// Reads the dependency lines of one manifest by hand: enough TOML for Cargo manifests, no parser crate.
    fn dependencies(manifest: &str) -> Vec<Dependency> {
        let mut found = Vec::new();
        let mut table: Option<(String, Option<String>)> = None;
        let mut body = String::new();
        let finish =
            |table: &Option<(String, Option<String>)>, body: &str, found: &mut Vec<Dependency>| {
                if let Some((section, Some(name))) = table {
                    found.push(Dependency {
                        name: string_value(body, "package").unwrap_or_else(|| name.clone()),
                        section: section.clone(),
                        from_workspace: says_workspace(body),
                    });
                }
            };
        for line in manifest.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            if let Some(header) = section_header(line) {
                finish(&table, &body, &mut found);
                body.clear();
                table = dependency_table(header);
                continue;
            }
            match &table {
                Some((_, Some(_))) => {
                    body.push_str(line);
                    body.push('\n');
                }
                Some((section, None)) => {
                    let Some((key, value)) = line.split_once('=') else {
                        continue;
                    };
                    // `name.workspace = true` is the dotted form of `name = { workspace = true }`.
                    let (key, value) = match key.trim().split_once('.') {
                        Some((name, field)) => (name.trim(), format!("{field} = {value}")),
                        None => (key.trim(), value.to_string()),
                    };
                    found.push(Dependency {
                        name: string_value(&value, "package")
                            .unwrap_or_else(|| key.trim_matches('"').to_string()),
                        section: section.clone(),
                        from_workspace: says_workspace(&value),
                    });
                }
                None => {}
            }
        }
        finish(&table, &body, &mut found);
        found
    }

    fn member_dependencies() -> Vec<(String, Vec<Dependency>)> {
        members()
            .into_iter()
            .map(|member| {
                let path = workspace_root().join(&member).join("Cargo.toml");
                let manifest = fs::read_to_string(&path)
                    .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()));
                (member, dependencies(&manifest))
            })
            .collect()
    }

    /// The names in the root manifest's `[workspace.dependencies]`.
    fn workspace_table() -> Vec<String> {
        let manifest =
            fs::read_to_string(workspace_root().join("Cargo.toml")).expect("root Cargo.toml");
        let mut inside = false;
        let mut names = Vec::new();
        for line in manifest.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            if let Some(header) = section_header(line) {
                inside = header == "workspace.dependencies";
                continue;
            }
            if inside && let Some((key, _)) = line.split_once('=') {
                names.push(key.trim().to_string());
            }
        }
        assert!(
            names.len() > 10,
            "found only {names:?} in [workspace.dependencies]; is the parse broken?"
        );
        names
    }

    /// Layering breaks: each a member, the member it depends on and the section that says so.
    fn layering_breaks(manifests: &[(String, Vec<Dependency>)]) -> Vec<String> {
        let mut breaks = Vec::new();
        for (member, dependencies) in manifests {
            let Some((_, allowed)) = LAYERS.iter().find(|(name, _)| name == member) else {
                breaks.push(format!(
                    "{member} is a member but has no place in LAYERS; add it there"
                ));
                continue;
            };
            for dependency in dependencies {
                let is_member = LAYERS.iter().any(|(name, _)| *name == dependency.name);
                if is_member
                    && dependency.name != *member
                    && !allowed.contains(&dependency.name.as_str())
                {
                    breaks.push(format!(
                        "{member} depends on {} in [{}]",
                        dependency.name, dependency.section
                    ));
                }
            }
        }
        breaks
    }

    #[test]
    fn a_crate_depends_only_on_the_crates_below_it() {
        let manifests = member_dependencies();
        let breaks = layering_breaks(&manifests);
        assert!(
            breaks.is_empty(),
            "a crate may depend only on the layers below it (normal, dev and build dependencies alike; see \
             LAYERS in xtask/src/tidy.rs): {breaks:#?}"
        );
    }

    #[test]
    fn the_layering_check_sees_a_dependency_upward_in_every_kind_of_section() {
        let manifest = r#"
[package]
name = "net-io-core"

[dependencies]
net-io-sys = { workspace = true }
thiserror = "2"

[dev-dependencies]
net-io-blocking.workspace = true

[target.'cfg(loom)'.build-dependencies]
renamed = { package = "task-runtime", path = "../task-runtime" }

[dependencies.stage-server]
workspace = true
"#;
        let breaks = layering_breaks(&[("net-io-core".to_string(), dependencies(manifest))]);
        assert_eq!(
            breaks,
            [
                "net-io-core depends on net-io-blocking in [dev-dependencies]",
                "net-io-core depends on task-runtime in [target.'cfg(loom)'.build-dependencies]",
                "net-io-core depends on stage-server in [dependencies]",
            ],
            "the hand-written manifest reader missed or misread a dependency"
        );
    }

    #[test]
    fn no_source_file_is_longer_than_the_cap_unless_listed_with_a_reason() {
        let mut too_long = Vec::new();
        let mut lengths = std::collections::HashMap::new();
        for path in all_rust_files() {
            let name = relative(&path);
            let lines = fs::read_to_string(&path).map_or(0, |text| text.lines().count());
            lengths.insert(name.clone(), lines);
            if lines > MAX_LINES && !LONG_FILES.iter().any(|(listed, _)| *listed == name) {
                too_long.push(format!("{name}: {lines} lines"));
            }
        }
        assert!(
            too_long.is_empty(),
            "these files pass the {MAX_LINES}-line cap; split them by concern (or, for a real exception, add \
             them to LONG_FILES with the reason): {too_long:#?}"
        );
        let stale: Vec<&str> = LONG_FILES
            .iter()
            .filter(|(name, _)| lengths.get(*name).is_none_or(|&lines| lines <= MAX_LINES))
            .map(|(name, _)| *name)
            .collect();
        assert!(
            stale.is_empty(),
            "these LONG_FILES entries are gone or back under {MAX_LINES} lines; remove them from the list: {stale:?}"
        );
    }

    /// Our own crates have entries in `[workspace.dependencies]` whether or not another member uses them yet:
    /// the table is where a member finds a sibling's path and version.
    fn is_member(name: &str) -> bool {
        LAYERS.iter().any(|(member, _)| *member == name)
    }

    /// The `[workspace.dependencies]` entries no member takes.
    fn unused_workspace_entries(
        table: &[String],
        manifests: &[(String, Vec<Dependency>)],
    ) -> Vec<String> {
        table
            .iter()
            .filter(|name| !is_member(name))
            .filter(|name| {
                !manifests.iter().any(|(_, dependencies)| {
                    dependencies
                        .iter()
                        .any(|dependency| dependency.name == **name)
                })
            })
            .cloned()
            .collect()
    }

    /// Dependencies a member pins itself although the workspace table has them, or that two members pin
    /// each on their own.
    fn dependencies_not_from_the_table(
        table: &[String],
        manifests: &[(String, Vec<Dependency>)],
    ) -> Vec<String> {
        let mut pinned = Vec::new();
        let mut own_pins: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
        for (member, dependencies) in manifests {
            for dependency in dependencies
                .iter()
                .filter(|dependency| !dependency.from_workspace)
            {
                if table.contains(&dependency.name) {
                    pinned.push(format!(
                        "{member} [{}] {}: take it with `workspace = true`",
                        dependency.section, dependency.name
                    ));
                } else {
                    own_pins.entry(&dependency.name).or_default().push(member);
                }
            }
        }
        for (name, mut pinners) in own_pins {
            pinners.dedup();
            if pinners.len() > 1 {
                pinned.push(format!(
                    "{name} is pinned by {pinners:?} separately: move it to [workspace.dependencies]"
                ));
            }
        }
        pinned
    }

    #[test]
    fn every_workspace_dependency_is_used_and_members_take_shared_ones_from_the_table() {
        let table = workspace_table();
        let manifests = member_dependencies();
        let unused = unused_workspace_entries(&table, &manifests);
        assert!(
            unused.is_empty(),
            "no member uses these [workspace.dependencies] entries; remove them from the root Cargo.toml: {unused:?}"
        );
        let pinned = dependencies_not_from_the_table(&table, &manifests);
        assert!(
            pinned.is_empty(),
            "a shared dependency is pinned once, in [workspace.dependencies]: {pinned:#?}"
        );
    }

    #[test]
    fn the_dependency_checks_see_an_unused_entry_and_a_pinned_shared_dependency() {
        let table = vec![
            "libc".to_string(),
            "regex".to_string(),
            "net-io-sys".to_string(),
        ];
        let first = r#"
[dependencies]
libc = "0.2"
net-io-sys.workspace = true
[dev-dependencies]
proptest = "1"
"#;
        let second = "[dev-dependencies]\nproptest = { version = \"1\" }\n";
        let manifests = [
            ("net-io-core".to_string(), dependencies(first)),
            ("task-runtime".to_string(), dependencies(second)),
        ];
        assert_eq!(
            unused_workspace_entries(&table, &manifests),
            ["regex"],
            "regex is in the table and nobody uses it"
        );
        assert_eq!(
            dependencies_not_from_the_table(&table, &manifests),
            [
                "net-io-core [dependencies] libc: take it with `workspace = true`",
                "proptest is pinned by [\"net-io-core\", \"task-runtime\"] separately: move it to [workspace.dependencies]",
            ],
            "libc is pinned although the table has it, and proptest is pinned by two members"
        );
    }

    /// The crate attributes each library's `lib.rs` must carry.
    const CRATE_ATTRIBUTES: &[(&str, &[&str])] = &[
        ("net-io-sys", &["#![warn(missing_docs)]"]),
        (
            "net-io-core",
            &["#![forbid(unsafe_code)]", "#![warn(missing_docs)]"],
        ),
        (
            "net-io-blocking",
            &["#![forbid(unsafe_code)]", "#![warn(missing_docs)]"],
        ),
        (
            "task-runtime",
            &["#![forbid(unsafe_code)]", "#![warn(missing_docs)]"],
        ),
        (
            "stage-server",
            &["#![deny(unsafe_code)]", "#![warn(missing_docs)]"],
        ),
    ];

    /// The only files that may lift a crate's `deny(unsafe_code)`, and why.
    const UNSAFE_LIFTED: &[(&str, &str)] = &[
        (
            "stage-server/src/kernels/mod.rs",
            "SIMD intrinsics behind runtime feature detection",
        ),
        (
            "net-io-blocking/tests/allocations.rs",
            "a counting global allocator",
        ),
    ];

    #[test]
    fn library_crates_fence_unsafe_code_and_warn_on_missing_docs() {
        let mut missing = Vec::new();
        for member in members() {
            let lib = workspace_root().join(&member).join("src/lib.rs");
            let Ok(text) = fs::read_to_string(&lib) else {
                continue;
            };
            let Some((_, wanted)) = CRATE_ATTRIBUTES.iter().find(|(name, _)| *name == member)
            else {
                missing.push(format!(
                    "{member} has a lib.rs but no entry in CRATE_ATTRIBUTES"
                ));
                continue;
            };
            for attribute in *wanted {
                if !text.lines().any(|line| line.trim() == *attribute) {
                    missing.push(format!("{member}/src/lib.rs lacks {attribute}"));
                }
            }
        }
        assert!(missing.is_empty(), "crate attributes missing: {missing:#?}");

        let lifted: Vec<String> = all_rust_files()
            .into_iter()
            .filter(|path| {
                fs::read_to_string(path).is_ok_and(|text| {
                    text.lines().any(|line| {
                        let code = line.split("//").next().unwrap_or("");
                        code.contains("allow(unsafe_code)")
                    })
                })
            })
            .map(|path| relative(&path))
            .filter(|name| name != "xtask/src/tidy.rs")
            .filter(|name| !UNSAFE_LIFTED.iter().any(|(allowed, _)| allowed == name))
            .collect();
        assert!(
            lifted.is_empty(),
            "`allow(unsafe_code)` outside the places in UNSAFE_LIFTED {UNSAFE_LIFTED:?}: {lifted:#?}"
        );
    }
}
