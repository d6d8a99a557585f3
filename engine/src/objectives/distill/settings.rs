//! Distillation's own settings, declared as `crate::run::settings`
//! declares every setting (its rollouts', β's and the temperature's
//! tables are GRPO's and the preference objectives').

use crate::run::settings::{of, path, put, shown_path, Setting};

pub(crate) static SETTINGS: &[Setting] = &[of(
    "teacher",
    |s| shown_path(&s.objectives.distill.teacher),
    |s, v| put(&mut s.objectives.distill.teacher, path(v)?),
)];
