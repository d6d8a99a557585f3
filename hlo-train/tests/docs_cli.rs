//! `docs/cli.md` documents every command's flags exactly as `--help` gives
//! them: each table between `<!-- flags:COMMAND -->` markers must equal the
//! table made from `hlo-train COMMAND --help` (every documented flag
//! exists, every flag is documented, with its help text and default).
//! `HLO_TRAIN_UPDATE_DOCS=1 cargo test -p hlo-train --test docs_cli`
//! rewrites the tables.

mod common;

use common::*;

const COMMANDS: [&str; 15] = [
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
