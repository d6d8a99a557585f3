//! `docs/cli.md` documents every command's flags exactly as `--help` gives
//! them: each table between `<!-- flags:COMMAND -->` markers must equal the
//! table made from `hlo-train COMMAND --help` (every documented flag
//! exists, every flag is documented, with its help text and default).
//! `HLO_TRAIN_UPDATE_DOCS=1 cargo test -p hlo-train --test docs_cli`
//! rewrites the tables.

mod common;

use common::*;

const COMMANDS: [&str; 16] = [
    "train",
    "data",
    "data prepare",
    "eval",
    "generate",
    "serve",
    "merge",
    "export",
    "init",
    "score",
    "bench",
    "plan",
    "compile",
    "plot",
    "dump-hlo",
    "devices",
];

/// (flag, help text) of every option `--help` lists, `--help` excluded.
fn flags(command: &str) -> Vec<(String, String)> {
    let mut args: Vec<&str> = command.split(' ').collect();
    args.push("--help");
    let help = ok(&hlo_train(&args));
    let mut out: Vec<(String, String)> = Vec::new();
    for line in help.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        let option = trimmed
            .strip_prefix("-h, ")
            .unwrap_or(trimmed)
            .strip_prefix("--");
        match option {
            Some(rest) if indent <= 6 => {
                let name: String = rest
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '-')
                    .collect();
                let text = rest[name.len()..].trim_start();
                let text = match text.strip_prefix('<') {
                    Some(t) => t.split_once('>').map_or("", |(_, r)| r),
                    None => text,
                };
                out.push((format!("--{name}"), text.trim().to_string()));
            }
            _ if indent > 6 && !out.is_empty() => {
                let last = out.last_mut().expect("non-empty");
                last.1 = format!("{} {}", last.1, trimmed).trim().to_string();
            }
            _ => {}
        }
    }
    out.retain(|(f, _)| f != "--help");
    out
}

/// `[key: value]` taken out of a help text.
fn bracket(text: &mut String, key: &str) -> Option<String> {
    let open = format!("[{key}: ");
    let start = text.find(&open)?;
    let end = start + text[start..].find(']')?;
    let value = text[start + open.len()..end].to_string();
    text.replace_range(start..=end, "");
    *text = text.trim().to_string();
    Some(value)
}

/// The markdown table of `command`'s flags.
fn table(command: &str) -> String {
    let mut rows = vec![
        "| flag | meaning | default |".to_string(),
        "|---|---|---|".to_string(),
    ];
    for (flag, help) in flags(command) {
        let mut text = help;
        let default = bracket(&mut text, "default");
        let values = bracket(&mut text, "possible values");
        let env = bracket(&mut text, "env");
        let mut meaning = text.replace('|', "\\|");
        if let Some(v) = values {
            meaning += &format!(" (`{}`)", v.replace(", ", "`, `"));
        }
        if let Some(e) = env {
            meaning += &format!(" (also `{}`)", e.trim_end_matches('='));
        }
        let default = default.map_or("—".to_string(), |d| format!("`{d}`"));
        rows.push(format!("| `{flag}` | {meaning} | {default} |"));
    }
    rows.join("\n")
}

#[test]
fn the_documented_flags_are_the_flags() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/cli.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let mut want = doc.clone();
    for command in COMMANDS {
        let open = format!("<!-- flags:{command} -->\n");
        let start = want
            .find(&open)
            .unwrap_or_else(|| panic!("docs/cli.md has no flags table for `{command}`"))
            + open.len();
        let end = start + want[start..].find("<!-- /flags -->").unwrap();
        want.replace_range(start..end, &format!("{}\n", table(command)));
    }
    if std::env::var_os("HLO_TRAIN_UPDATE_DOCS").is_some() {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    assert!(
        doc == want,
        "docs/cli.md's flag tables differ from --help: run HLO_TRAIN_UPDATE_DOCS=1 cargo test -p hlo-train --test docs_cli"
    );
    // Every command the binary has is documented.
    let help = ok(&hlo_train(&["--help"]));
    for line in help
        .lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
    {
        let Some(command) = line.split_whitespace().next() else {
            break;
        };
        if command != "help" {
            assert!(
                COMMANDS.contains(&command),
                "`{command}` is not in docs/cli.md"
            );
        }
    }
}

/// The objectives `train --objective` takes (its possible values), in
/// `--help`'s order.
fn objectives() -> Vec<String> {
    let (_, help) = flags("train")
        .into_iter()
        .find(|(f, _)| f == "--objective")
        .expect("train --objective");
    let mut help = help;
    let values = bracket(&mut help, "possible values").expect("its possible values");
    values.split(", ").map(str::to_string).collect()
}

/// Whether `hlo-train COMMAND --objective OBJECTIVE` is taken: the run
/// gets as far as reading its (missing) data instead of refusing the
/// objective.
fn takes(command: &str, objective: &str) -> bool {
    let out = hlo_train(&[
        command,
        "--objective",
        objective,
        "--data",
        "/nonexistent/hlo-train-docs.jsonl",
    ]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    !stderr(&out).contains("--objective")
}

/// The text of `doc` from the line starting `from` to the next line
/// starting `to`.
fn section<'a>(doc: &'a str, from: &str, to: &str) -> &'a str {
    let start = doc
        .find(from)
        .unwrap_or_else(|| panic!("no `{from}` in the doc"));
    let end = doc[start + from.len()..]
        .find(to)
        .map_or(doc.len(), |e| start + from.len() + e);
    &doc[start..end]
}

/// The names between `` `--objective `` and the next `` ` `` in `text`,
/// split at `|`.
fn listed_objectives(text: &str) -> Vec<String> {
    let at = text
        .find("`--objective ")
        .unwrap_or_else(|| panic!("no `--objective ...` in:\n{text}"));
    let rest = &text[at + "`--objective ".len()..];
    rest[..rest.find('`').unwrap()]
        .split('|')
        .map(str::to_string)
        .collect()
}

/// The variants of `pub enum NAME` in a Rust source file.
fn variants(source: &str, name: &str) -> Vec<String> {
    let body = section(source, &format!("pub enum {name} {{"), "\n}");
    body.lines()
        .skip(1)
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            l.chars()
                .take_while(|c| c.is_ascii_alphanumeric())
                .collect::<String>()
        })
        .filter(|v| !v.is_empty())
        .collect()
}

fn read(path: &str) -> String {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::read_to_string(root.join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn the_documented_objectives_are_the_objectives() {
    let objectives = objectives();
    assert!(objectives.len() >= 10, "{objectives:?}");

    // docs/cli.md: what `eval` and `data` say they take is what they take.
    let cli = read("docs/cli.md");
    for (command, heading) in [
        ("eval", "## `hlo-train eval`"),
        ("data", "## `hlo-train data`"),
    ] {
        let text = section(&cli, heading, "\n## ");
        let mut want: Vec<String> = objectives
            .iter()
            .filter(|o| *o != "sft" && takes(command, o))
            .cloned()
            .collect();
        want.sort();
        let mut listed = listed_objectives(text);
        listed.sort();
        assert_eq!(
            listed, want,
            "docs/cli.md's `{command} --objective` list against what `{command}` takes"
        );
        assert!(takes(command, "sft"), "{command} --objective sft");
    }

    // docs/training.md: a section for each objective, each named in the
    // opening line.
    let training = read("docs/training.md");
    let opening = training.lines().nth(2).unwrap().to_lowercase();
    let headings: Vec<String> = training
        .lines()
        .filter(|l| l.starts_with("## "))
        .map(str::to_lowercase)
        .collect();
    for o in objectives.iter().filter(|o| *o != "sft") {
        assert!(
            headings.iter().any(|h| h.contains(o.as_str())),
            "docs/training.md has no section for {o}"
        );
        assert!(
            opening.contains(o.as_str()),
            "docs/training.md's opening line leaves out {o}"
        );
    }

    // docs/architecture.md's seam: every objective's folders, its loss's
    // variant and every data kind.
    let architecture = read("docs/architecture.md");
    let seam = section(
        &architecture,
        "An objective is one type behind one trait",
        "#### Adding an objective",
    );
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../engine/src/objectives");
    let mut defined = Vec::new();
    for entry in std::fs::read_dir(&root).unwrap().flatten() {
        let path = entry.path();
        let (named, text) = if path.is_dir() {
            let text: String = std::fs::read_dir(&path)
                .unwrap()
                .flatten()
                .filter_map(|f| std::fs::read_to_string(f.path()).ok())
                .collect();
            (
                format!("`objectives/{}/`", entry.file_name().to_string_lossy()),
                text,
            )
        } else {
            let text = std::fs::read_to_string(&path).unwrap();
            (
                format!("`objectives/{}`", entry.file_name().to_string_lossy()),
                text,
            )
        };
        if text.contains("impl ObjectiveDef for") {
            assert!(seam.contains(&named), "the seam leaves out {named}");
            defined.push(text);
        }
    }
    for o in &objectives {
        let name = format!("\"{o}\"");
        assert!(
            defined.iter().any(|t| t.contains(&name)),
            "no folder named in the seam defines {o}"
        );
    }
    let models = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/src");
    for entry in std::fs::read_dir(&models).unwrap().flatten() {
        let step = entry.path().join("step.rs");
        if std::fs::read_to_string(&step).is_ok_and(|t| t.contains("impl StepLoss for")) {
            let named = format!(
                "`models/src/{}/step.rs`",
                entry.file_name().to_string_lossy()
            );
            assert!(seam.contains(&named), "the seam leaves out {named}");
        }
    }
    for v in variants(&read("models/src/train.rs"), "Loss") {
        assert!(
            seam.contains(&format!("`{v}(..)`")) || seam.contains(&format!("`{v}`")),
            "the seam leaves out Loss::{v}"
        );
    }
    let data = variants(&read("engine/src/objectives/mod.rs"), "Data");
    assert!(data.len() >= 4, "{data:?}");
    for v in data {
        assert!(
            seam.contains(&format!("`{v}`")),
            "the seam leaves out Data::{v}"
        );
    }
}

/// `eval` and `data` list in `--help` (and so in docs/cli.md's tables)
/// only the objectives they take.
#[test]
fn eval_and_data_offer_only_the_objectives_they_take() {
    for command in ["eval", "data"] {
        let (_, help) = flags(command)
            .into_iter()
            .find(|(f, _)| f == "--objective")
            .expect("--objective");
        let mut help = help;
        let values = bracket(&mut help, "possible values").expect("its possible values");
        for o in values.split(", ") {
            assert!(
                takes(command, o),
                "`{command} --objective {o}` is offered and refused"
            );
        }
    }
}
