//! Chat templates as HF tokenizers define them: the Jinja `chat_template`
//! of `tokenizer_config.json` (or a `chat_template.jinja` file beside it),
//! rendered with minijinja in the mode HF uses (`trim_blocks`,
//! `lstrip_blocks`, Python string methods, `raise_exception` and
//! `strftime_now`).

use std::path::Path;

use minijinja::{context, Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::DataError;

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// The roles chat templates render: a message of another role is most
/// often dropped by the template without a word, so it is refused.
pub(crate) const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Refuses a message of a role no template renders, naming it as
/// `field[i]`.
///
/// ```
/// use hlo_data::chat::{check_roles, Message};
/// assert!(check_roles(&[Message::new("user", "hi")], "messages").is_ok());
/// let e = check_roles(&[Message::new("bot", "hi")], "chosen").unwrap_err();
/// assert!(e.starts_with("`chosen[0]` has the role `bot`"));
/// ```
pub fn check_roles(messages: &[Message], field: &str) -> Result<(), String> {
    match messages
        .iter()
        .enumerate()
        .find(|(_, m)| !ROLES.contains(&m.role.as_str()))
    {
        Some((i, m)) => Err(format!(
            "`{field}[{i}]` has the role `{}`; chat templates render the roles {}",
            m.role,
            ROLES.join(", ")
        )),
        None => Ok(()),
    }
}

/// A model's chat template and the special tokens it refers to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    pub source: String,
    pub bos_token: String,
    pub eos_token: String,
}

/// `"<s>"` or `{"content": "<s>", ...}` (an AddedToken), as HF writes them.
fn token_text(v: Option<&Value>) -> String {
    match v {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of a tokenizer folder (`tokenizer_config.json`, and
    /// `chat_template.jinja` where present, which wins as in transformers).
    pub fn from_dir(dir: &Path) -> Result<ChatTemplate, DataError> {
        let path = dir.join("tokenizer_config.json");
        let text = std::fs::read_to_string(&path).map_err(|cause| DataError::Read {
            path: path.clone(),
            cause,
        })?;
        let config: Value = serde_json::from_str(&text).map_err(|cause| DataError::Json {
            path: path.clone(),
            cause,
        })?;
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.is_file() {
            std::fs::read_to_string(&jinja).map_err(|cause| DataError::Read {
                path: jinja.clone(),
                cause,
            })?
        } else {
            match config.get("chat_template") {
                Some(Value::String(s)) => s.clone(),
                // Several named templates: the default one.
                Some(Value::Array(list)) => list
                    .iter()
                    .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                    .and_then(|t| t.get("template"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| DataError::TokenizerConfig {
                        path: path.clone(),
                        message: "no `default` among the chat templates".into(),
                    })?
                    .to_string(),
                _ => return Err(DataError::NotAChatModel { path: path.clone() }),
            }
        };
        Ok(ChatTemplate {
            source,
            bos_token: token_text(config.get("bos_token")),
            eos_token: token_text(config.get("eos_token")),
        })
    }

    /// The conversation as the model's prompt text; with
    /// `add_generation_prompt`, ending where the assistant's reply begins.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, DataError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |format: String| strftime_now(&format));
        let bad = |e: Error| DataError::Template(format!("{e:#}"));
        env.add_template("chat", &self.source).map_err(bad)?;
        let template = env.get_template("chat").map_err(bad)?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(bad)
    }
}

/// Today's date (UTC) in the few `strftime` forms chat templates use.
fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs()) as i64;
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(m - 1) as usize];
    format
        .replace("%d", &format!("{d:02}"))
        .replace("%m", &format!("{m:02}"))
        .replace("%Y", &y.to_string())
        .replace("%B", name)
        .replace("%b", &name[..3])
}

/// (year, month, day) of a day count since 1970-01-01 (proleptic
/// Gregorian; H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
        assert_eq!(civil_from_days(20_513), (2026, 3, 1));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
    }
}
