//! A run's metrics file read back: hlo-train's JSON Lines, one object per
//! training step or evaluation, as the loss curves the chart draws. The
//! file is the record of the whole run (a resumed run appends to it), so
//! the curves come from it rather than from one process's memory.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::error::{ReportError, Result};

/// Train and eval loss by step, each sorted by step with one value a step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LossCurves {
    /// `(step, loss)` of training steps.
    pub train: Vec<(i64, f64)>,
    /// `(step, eval_loss)` of evaluations.
    pub eval: Vec<(i64, f64)>,
}

impl LossCurves {
    /// Reads hlo-train's metrics file (JSON Lines): an object with numeric
    /// `step` and `loss` is a train point, one with `step` and `eval_loss`
    /// an eval point; other objects and blank lines are skipped. A step
    /// seen again (a resumed run appends to the file) takes the later
    /// value.
    pub fn read_metrics(path: &Path) -> Result<LossCurves> {
        let text = std::fs::read_to_string(path).map_err(ReportError::io("read", path))?;
        parse_metrics(&text, path)
    }

    /// The curves of the metric `key` in a metrics file: its value per
    /// step (`train`) and its mean over the last `window` steps (`eval`)
    /// — for a noisy figure such as GRPO's `reward`.
    pub fn read_smoothed(path: &Path, key: &str, window: usize) -> Result<LossCurves> {
        let text = std::fs::read_to_string(path).map_err(ReportError::io("read", path))?;
        let mut points = BTreeMap::new();
        for line in text.lines() {
            let Ok(Value::Object(o)) = serde_json::from_str::<Value>(line.trim()) else {
                continue;
            };
            if let (Some(step), Some(v)) = (
                o.get("step").and_then(integer),
                o.get(key).and_then(Value::as_f64),
            ) {
                points.insert(step, v);
            }
        }
        let train: Vec<(i64, f64)> = points.into_iter().collect();
        let window = window.max(1);
        let eval = (0..train.len())
            .map(|i| {
                let from = (i + 1).saturating_sub(window);
                let part = &train[from..=i];
                (
                    train[i].0,
                    part.iter().map(|p| p.1).sum::<f64>() / part.len() as f64,
                )
            })
            .collect();
        Ok(LossCurves { train, eval })
    }

    /// Whether neither curve has a point.
    pub fn is_empty(&self) -> bool {
        self.train.is_empty() && self.eval.is_empty()
    }
}

/// The curves of a metrics file's text; `path` names it in errors.
fn parse_metrics(text: &str, path: &Path) -> Result<LossCurves> {
    let mut train = BTreeMap::new();
    let mut eval = BTreeMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = |detail: String| ReportError::MalformedLine {
            path: path.to_path_buf(),
            line: i + 1,
            detail,
        };
        let object = match serde_json::from_str::<Value>(line) {
            Ok(Value::Object(o)) => o,
            Ok(_) => return Err(bad(snippet(line))),
            Err(e) => return Err(bad(e.to_string())),
        };
        let Some(step) = object.get("step").and_then(integer) else {
            continue;
        };
        if let Some(loss) = object.get("loss").and_then(Value::as_f64) {
            train.insert(step, loss);
        }
        if let Some(loss) = object.get("eval_loss").and_then(Value::as_f64) {
            eval.insert(step, loss);
        }
    }
    Ok(LossCurves {
        train: train.into_iter().collect(),
        eval: eval.into_iter().collect(),
    })
}

/// A step written as an integer, or as a float with no fraction.
fn integer(v: &Value) -> Option<i64> {
    v.as_i64().or_else(|| {
        v.as_f64()
            .filter(|f| f.fract() == 0.0 && f.abs() < 9.0e15)
            .map(|f| f as i64)
    })
}

/// The start of a line, for an error message.
fn snippet(line: &str) -> String {
    const MAX: usize = 60;
    match line.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &line[..cut]),
        None => line.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_train_and_eval_points() {
        let dir = crate::temp_dir("read");
        let path = dir.join("metrics.jsonl");
        std::fs::write(
            &path,
            concat!(
                r#"{"step":1,"loss":3.5,"lr":0.001,"mfu":null}"#,
                "\n\n",
                r#"{"step":2,"loss":3.25}"#,
                "\n",
                r#"{"step":2,"eval_loss":3.4,"eval_perplexity":29.96}"#,
                "\n   \n",
                r#"{"event":"start","step":"x","loss":1}"#,
                "\n",
                r#"{"step":3,"loss":null}"#,
                "\n",
                // A resume from step 1 appends steps 2 and 3 again.
                r#"{"step":2,"loss":3.0}"#,
                "\n",
                r#"{"step":3,"loss":2.75}"#,
                "\n",
                r#"{"step":4.0,"eval_loss":2.5}"#,
                "\n",
            ),
        )
        .unwrap();
        let c = LossCurves::read_metrics(&path).unwrap();
        assert_eq!(c.train, vec![(1, 3.5), (2, 3.0), (3, 2.75)]);
        assert_eq!(c.eval, vec![(2, 3.4), (4, 2.5)]);
        assert!(!c.is_empty());
        assert!(LossCurves::default().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_bad_line_names_file_and_line() {
        let path = Path::new("/runs/m.jsonl");
        let err = parse_metrics("{\"step\":1,\"loss\":2}\n\n[1, 2]\n", path).unwrap_err();
        assert!(
            matches!(&err, ReportError::MalformedLine { line: 3, path: p, .. } if p == path),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "/runs/m.jsonl: line 3: not a JSON object: [1, 2]"
        );
        let err = parse_metrics("{\"step\":1}\n{\"step\": 2, loss\n", path).unwrap_err();
        let text = err.to_string();
        assert!(
            text.starts_with("/runs/m.jsonl: line 2: not a JSON object: key must be a string"),
            "{text}"
        );
    }
}
