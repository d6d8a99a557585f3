//! `xla-option`, the run setting of `--xla-option`: a saved run's options
//! come back on resume unless chosen anew, and a saved value this build
//! cannot read is an error naming it.

use std::collections::BTreeSet;

use hlo_engine::run::spec::{Chosen, RunSpec};
use hlo_engine::runtime::XlaOption;
use hlo_engine::train::checkpoint::RunSettings;

fn saved(value: serde_json::Value) -> RunSettings {
    let mut s = RunSettings::default();
    s.set("xla-option", value);
    s
}

#[test]
fn a_resumed_run_takes_the_saved_options() {
    let mut spec = RunSpec::resume("unused");
    let list = serde_json::json!(["xla_cpu_enable_fast_math=false", "xla_ratio=0.5"]);
    spec.merge_saved(&saved(list)).expect("readable");
    assert_eq!(
        spec.backend.xla_options,
        [
            (
                "xla_cpu_enable_fast_math".to_string(),
                XlaOption::Bool(false)
            ),
            ("xla_ratio".to_string(), XlaOption::Double(0.5)),
        ]
    );
}

#[test]
fn options_chosen_anew_replace_the_saved_ones() {
    let mut spec = RunSpec::resume("unused");
    spec.chosen = Chosen::Only(BTreeSet::from(["xla-option".to_string()]));
    spec.backend.xla_options = vec![("xla_a".into(), XlaOption::Int(1))];
    spec.merge_saved(&saved(serde_json::json!(["xla_b=2"])))
        .expect("readable");
    assert_eq!(
        spec.backend.xla_options,
        [("xla_a".to_string(), XlaOption::Int(1))]
    );
}

#[test]
fn an_unreadable_saved_option_is_an_error_naming_the_setting() {
    for bad in [
        serde_json::json!("xla_a=1"),
        serde_json::json!(["no equals sign"]),
        serde_json::json!([3]),
    ] {
        let mut spec = RunSpec::resume("unused");
        let err = spec.merge_saved(&saved(bad.clone())).expect_err("refused");
        assert!(err.to_string().contains("`xla-option`"), "{bad}: {err}");
    }
}
