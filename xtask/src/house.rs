//! Repository hygiene checked as a test: inside a crate that declares its house (`// layers:` lines in its
//! `lib.rs`), no module reaches a module declared after it, so the crate reads top-down with no import circle.

/// The crates whose `lib.rs` declares the order of their modules.
#[cfg(test)]
const HOUSES: &[&str] = &["net-io-blocking"];

/// The modules of a crate from the bottom up, as its `// layers:` comment lines list them.
#[cfg(test)]
fn declared_layers(lib: &str) -> Vec<String> {
    lib.lines()
        .filter_map(|line| line.trim_start().strip_prefix("// layers:"))
        .flat_map(|names| names.split_whitespace().map(str::to_owned))
        .collect()
}

/// The modules a line of code names through `crate::module::` paths, ignoring what follows `//`.
#[cfg(test)]
fn modules_named(line: &str) -> Vec<&str> {
    let code = line.split("//").next().unwrap_or("");
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let after = &rest[at + "crate::".len()..];
        let name_end = after
            .find(|character: char| !(character.is_ascii_lowercase() || character == '_'))
            .unwrap_or(after.len());
        let name = &after[..name_end];
        // A module path goes on with `::`; `crate::Name` is a re-export at the root, judged by its own use.
        if !name.is_empty() && after[name_end..].starts_with("::") {
            found.push(name);
        }
        rest = &after[name_end..];
    }
    found
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::{Path, PathBuf};

    use super::*;

    fn workspace_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("xtask sits inside the workspace")
            .to_path_buf()
    }

    fn rust_files(directory: &Path, found: &mut Vec<PathBuf>) {
        let entries = fs::read_dir(directory)
            .unwrap_or_else(|error| panic!("cannot list {}: {error}", directory.display()));
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                rust_files(&path, found);
            } else if path.extension().is_some_and(|extension| extension == "rs") {
                found.push(path);
            }
        }
    }

    #[test]
    fn no_module_reaches_a_module_declared_above_it() {
        for crate_name in HOUSES {
            let source = workspace_root().join(crate_name).join("src");
            let lib = fs::read_to_string(source.join("lib.rs")).expect("read lib.rs");
            let layers = declared_layers(&lib);
            assert!(
                !layers.is_empty(),
                "{crate_name}/src/lib.rs should list its modules on `// layers:` lines"
            );
            let declared: Vec<String> = lib
                .lines()
                .filter_map(|line| {
                    let line = line.trim_start();
                    let line = line.strip_prefix("pub ").unwrap_or(line);
                    line.strip_prefix("mod ")?
                        .strip_suffix(';')
                        .map(str::to_owned)
                })
                .collect();
            let mut sorted_layers = layers.clone();
            sorted_layers.sort();
            let mut sorted_declared = declared.clone();
            sorted_declared.sort();
            assert_eq!(
                sorted_layers, sorted_declared,
                "{crate_name}: the `// layers:` lines should name every module lib.rs declares, once"
            );
            let rank = |name: &str| layers.iter().position(|layer| layer == name);
            let mut files = Vec::new();
            rust_files(&source, &mut files);
            let mut breaks = Vec::new();
            for file in files {
                let relative = file.strip_prefix(&source).expect("under src");
                let Some(own) = relative
                    .components()
                    .next()
                    .and_then(|component| component.as_os_str().to_str())
                    .map(|name| name.trim_end_matches(".rs").to_owned())
                else {
                    continue;
                };
                if own == "lib" {
                    continue;
                }
                let own_rank = rank(&own).unwrap_or_else(|| {
                    panic!(
                        "{crate_name}: {} is not a declared module",
                        relative.display()
                    )
                });
                let text = fs::read_to_string(&file).expect("read a source file");
                for (number, line) in text.lines().enumerate() {
                    for used in modules_named(line) {
                        if used == own {
                            continue;
                        }
                        match rank(used) {
                            Some(used_rank) if used_rank < own_rank => {}
                            _ => breaks.push(format!(
                                "{crate_name}/src/{}:{}: `{own}` uses `{used}`, declared above it",
                                relative.display(),
                                number + 1
                            )),
                        }
                    }
                }
            }
            assert!(
                breaks.is_empty(),
                "modules must only use modules below them (move the shared piece down):\n{}",
                breaks.join("\n")
            );
        }
    }

    #[test]
    fn module_paths_are_read_from_code_not_comments() {
        assert_eq!(
            modules_named("use crate::link::{Link, Received}; // crate::server::x"),
            vec!["link"]
        );
        assert_eq!(
            modules_named("let x = crate::clock::deadline_after(a, crate::codes::CODE);"),
            vec!["clock", "codes"]
        );
        assert!(modules_named("/// see [`crate::ServerHandle::connect`]").is_empty());
        assert!(modules_named("crate::ServerHandle::connect(x)").is_empty());
        assert_eq!(
            declared_layers("// layers: a b\nmod a;\n// layers: c\n"),
            vec!["a", "b", "c"]
        );
    }
}
